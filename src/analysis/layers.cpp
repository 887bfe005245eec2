#include "analysis/layers.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "common/error.h"
#include "cpu/gemm.h"
#include "model/rac.h"
#include "rl/report.h"

namespace quads::analysis {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

namespace {

enum Variant { WOnly, AOnly, W4A4, W4A4Rac, Fp8, NumVariants };
const char* kKinds[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
constexpr int kNumKinds = 7;
const double kEntropyEdges[] = {0.0, 0.1, 0.5, 1.0, 2.0, INFINITY};
constexpr int kNumBins = 5;

int kind_of(const std::string& module) {
  const std::string last = module.substr(module.rfind('.') + 1);
  for (int k = 0; k < kNumKinds; ++k)
    if (last == kKinds[k]) return k;
  return -1;
}

struct Acc {
  double err[NumVariants] = {};
  double norm = 0;
  void add(const Acc& o) {
    for (int v = 0; v < NumVariants; ++v) err[v] += o.err[v];
    norm += o.norm;
  }
  ordered_json json() const {
    ordered_json j = ordered_json::object();
    for (int v = 0; v < NumVariants; ++v) j[layer_variants()[v]] = norm > 0 ? err[v] / norm : 0.0;
    return j;
  }
};

double sq_diff(const float* a, const float* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = double(a[i]) - double(b[i]);
    s += d * d;
  }
  return s;
}

std::vector<int32_t> top_channels(const std::vector<double>& e, int k) {
  std::vector<int32_t> idx(e.size());
  for (size_t i = 0; i < e.size(); ++i) idx[i] = static_cast<int32_t>(i);
  k = std::min<int>(k, static_cast<int>(e.size()));
  // Ties to the lower index: a pure function of the energies.
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
  idx.resize(k);
  return idx;
}

double jaccard(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::set<int32_t> sa(a.begin(), a.end()), sb(b.begin(), b.end());
  size_t inter = 0;
  for (int32_t x : sa) inter += sb.count(x);
  const size_t uni = sa.size() + sb.size() - inter;
  return uni ? static_cast<double>(inter) / static_cast<double>(uni) : 1.0;
}

std::vector<float> run_logits(model::Model& m, const model::Batch& b) {
  std::vector<float> out(size_t(b.ntokens()) * m.config().vocab_size);
  m.forward(b, out.data());
  return out;
}

}  // namespace

const std::vector<std::string>& layer_variants() {
  static const std::vector<std::string> v = {"w_only", "a_only", "w4a4", "w4a4_rac", "fp8"};
  return v;
}

ordered_json logprob_gaps(const model::Batch& b, const std::vector<float>& ref, const std::vector<float>& var,
                          int vocab) {
  QUADS_CHECK(ref.size() == var.size() && ref.size() == size_t(b.ntokens()) * vocab, "logit buffers do not match");
  double sum = 0, mx = 0;
  int64_t n = 0;
  double bsum[kNumBins] = {};
  int64_t bn[kNumBins] = {};
  auto logsumexp = [&](const float* z, double* ent) {
    double m = -INFINITY;
    for (int v = 0; v < vocab; ++v) m = std::max(m, double(z[v]));
    double s = 0;
    for (int v = 0; v < vocab; ++v) s += std::exp(double(z[v]) - m);
    const double lse = m + std::log(s);
    if (ent) {
      double h = 0;
      for (int v = 0; v < vocab; ++v) {
        const double lp = double(z[v]) - lse;
        h -= std::exp(lp) * lp;
      }
      *ent = h;
    }
    return lse;
  };
  for (int s = 0; s < b.nseq(); ++s) {
    for (int64_t t = b.offsets[s]; t + 1 < b.offsets[s + 1]; ++t) {
      const float* zr = ref.data() + t * vocab;
      const float* zv = var.data() + t * vocab;
      const int32_t next = b.tokens[t + 1];
      double ent = 0;
      const double lr = double(zr[next]) - logsumexp(zr, &ent);
      const double lv = double(zv[next]) - logsumexp(zv, nullptr);
      const double gap = std::fabs(lv - lr);
      sum += gap;
      mx = std::max(mx, gap);
      ++n;
      int bin = 0;
      while (bin + 1 < kNumBins && ent >= kEntropyEdges[bin + 1]) ++bin;
      bsum[bin] += gap;
      ++bn[bin];
    }
  }
  ordered_json j;
  j["tokens"] = n;
  j["mean_abs_gap"] = n ? sum / double(n) : 0.0;
  j["max_abs_gap"] = mx;
  ordered_json bins = ordered_json::array();
  for (int i = 0; i < kNumBins; ++i)
    bins.push_back({{"entropy_lo", kEntropyEdges[i]},
                    {"entropy_hi", std::isinf(kEntropyEdges[i + 1]) ? ordered_json(nullptr) : ordered_json(kEntropyEdges[i + 1])},
                    {"tokens", bn[i]},
                    {"mean_abs_gap", bn[i] ? bsum[i] / double(bn[i]) : 0.0}});
  j["by_entropy"] = bins;
  return j;
}

ordered_json analyze_layers(const model::Weights& w, const std::vector<model::Batch>& batches, const LayersOptions& opt) {
  QUADS_CHECK(!batches.empty(), "analyze layers needs at least one batch");
  QUADS_CHECK(opt.topk > 0, "topk must be positive, not {}", opt.topk);
  // The models only read the weights; one copy serves them all.
  model::Weights wc = w;
  model::PrecisionConfig a_only = model::PrecisionConfig::preset("nvfp4");
  a_only.name = "nvfp4-a-only";
  a_only.quant.weight = model::OperandQuant::bf16();
  model::Model ref(wc, model::PrecisionConfig::preset("bf16"));
  model::Model mw(wc, model::PrecisionConfig::preset("nvfp4-w4a16"));
  model::Model ma(wc, a_only);
  model::Model m4(wc, model::PrecisionConfig::preset("nvfp4"));
  model::Model mr(wc, model::PrecisionConfig::preset("nvfp4"));
  model::Model mf(wc, model::PrecisionConfig::preset("fp8"));
  model::RacConfig rc;
  rc.ratio = opt.rac_ratio;
  model::rac_calibrate(mr, batches[0], rc);

  const int L = w.cfg.num_hidden_layers;
  const size_t nb = batches.size();
  std::vector<std::array<Acc, kNumKinds>> acc(L);
  // energy[b][l][kind]: activation residual energy per input channel.
  std::vector<std::vector<std::vector<std::vector<double>>>> energy(
      nb, std::vector<std::vector<std::vector<double>>>(L, std::vector<std::vector<double>>(kNumKinds)));
  size_t cur = 0;
  std::vector<float> xq, xf, y[NumVariants];
  model::ForwardOptions fo;
  fo.probe = [&](const model::LinearQ& Lr, const float* X, const float* Xb, const float* Y, int64_t M) {
    const size_t i = static_cast<size_t>(&Lr - ref.linears().data());
    const model::LinearQ& Lq = m4.linears()[i];
    const int kind = kind_of(Lr.name);
    if (Lq.num.weight.kind != model::QuantKind::Quant || kind < 0 || Lr.layer < 0 || M == 0) return;
    const int64_t out = Lr.out, in = Lr.in;
    const size_t ny = size_t(M) * out;
    const float* Wb = ref.effective_weights() + Lr.offset;
    const float* Wq = m4.effective_weights() + Lr.offset;
    const float* Wf = mf.effective_weights() + Lr.offset;
    xq.resize(size_t(M) * in);
    xf.resize(size_t(M) * in);
    model::quantize_act(Lq, X, M, xq.data());
    model::quantize_act(mf.linears()[i], X, M, xf.data());
    for (auto& v : y) v.assign(ny, 0.f);
    cpu::gemm_nt_rowinv(M, out, in, Xb, in, Wq, in, y[WOnly].data(), out);
    cpu::gemm_nt_rowinv(M, out, in, xq.data(), in, Wb, in, y[AOnly].data(), out);
    cpu::gemm_nt_rowinv(M, out, in, xq.data(), in, Wq, in, y[W4A4].data(), out);
    y[W4A4Rac] = y[W4A4];
    model::rac_apply(mr.linears()[i], X, xq.data(), M, mr.effective_weights() + Lr.offset, y[W4A4Rac].data(), out);
    cpu::gemm_nt_rowinv(M, out, in, xf.data(), in, Wf, in, y[Fp8].data(), out);
    Acc& a = acc[Lr.layer][kind];
    for (int v = 0; v < NumVariants; ++v) a.err[v] += sq_diff(y[v].data(), Y, ny);
    for (size_t k = 0; k < ny; ++k) a.norm += double(Y[k]) * double(Y[k]);
    auto& e = energy[cur][Lr.layer][kind];
    if (e.empty()) e.assign(size_t(in), 0.0);
    model::rac_energy(X, xq.data(), M, in, e.data());
  };

  const int vocab = w.cfg.vocab_size;
  std::vector<model::Model*> e2e = {&mw, &ma, &m4, &mr, &mf};
  std::vector<float> scratch;
  for (cur = 0; cur < nb; ++cur) {
    scratch.resize(size_t(batches[cur].ntokens()) * vocab);
    ref.forward(batches[cur], scratch.data(), nullptr, fo);
  }
  ordered_json report;
  report["variants"] = layer_variants();
  report["reference"] = "bf16";
  report["batches"] = nb;
  int64_t ntok = 0;
  for (const auto& b : batches) ntok += b.ntokens();
  report["tokens"] = ntok;
  report["topk"] = opt.topk;
  report["rac"] = {{"ratio", opt.rac_ratio}, {"selection", "static, ranked on batch 0 (model::rac_calibrate)"},
                   {"config", rc.describe()}};

  ordered_json layers = ordered_json::array();
  Acc total;
  for (int l = 0; l < L; ++l) {
    Acc lay;
    ordered_json kinds = ordered_json::object();
    for (int k = 0; k < kNumKinds; ++k) {
      if (acc[l][k].norm == 0) continue;
      lay.add(acc[l][k]);
      ordered_json kj;
      kj["rel_err"] = acc[l][k].json();
      // Channels: top-k by residual energy in each batch and their persistence.
      std::vector<std::vector<int32_t>> tops;
      for (size_t b = 0; b < nb; ++b)
        if (!energy[b][l][k].empty()) tops.push_back(top_channels(energy[b][l][k], opt.topk));
      kj["top_channels"] = tops.empty() ? ordered_json::array() : ordered_json(tops[0]);
      if (!tops.empty()) {
        const auto& e0 = energy[0][l][k];
        double tot = 0, top = 0;
        for (double v : e0) tot += v;
        for (int32_t c : tops[0]) top += e0[c];
        kj["top_energy_share"] = tot > 0 ? top / tot : 0.0;
      }
      if (tops.size() >= 2) {
        double s = 0;
        for (size_t b = 1; b < tops.size(); ++b) s += jaccard(tops[0], tops[b]);
        kj["jaccard_vs_batch0"] = s / double(tops.size() - 1);
      } else {
        kj["jaccard_vs_batch0"] = nullptr;
      }
      kinds[kKinds[k]] = kj;
    }
    total.add(lay);
    ordered_json lj;
    lj["layer"] = l;
    lj["rel_err"] = lay.json();
    lj["weight_share"] = lay.err[AOnly] + lay.err[WOnly] > 0 ? lay.err[WOnly] / (lay.err[AOnly] + lay.err[WOnly]) : 0.0;
    lj["kinds"] = kinds;
    layers.push_back(lj);
  }
  report["layers"] = layers;
  report["total_rel_err"] = total.json();

  // End to end: each variant's full forward against the bf16 reference.
  ordered_json gaps = ordered_json::object();
  std::vector<std::vector<float>> refl(nb);
  for (size_t b = 0; b < nb; ++b) refl[b] = run_logits(ref, batches[b]);
  for (int v = 0; v < NumVariants; ++v) {
    model::Batch all;
    std::vector<float> rl, vl;
    for (size_t b = 0; b < nb; ++b) {
      for (int s = 0; s < batches[b].nseq(); ++s)
        all.add(std::vector<int32_t>(batches[b].tokens.begin() + batches[b].offsets[s],
                                     batches[b].tokens.begin() + batches[b].offsets[s + 1]));
      rl.insert(rl.end(), refl[b].begin(), refl[b].end());
      auto lv = run_logits(*e2e[v], batches[b]);
      vl.insert(vl.end(), lv.begin(), lv.end());
    }
    gaps[layer_variants()[v]] = logprob_gaps(all, rl, vl, vocab);
  }
  report["logprob_gaps"] = gaps;
  return report;
}

std::string layers_summary(const ordered_json& r) {
  std::string s = fmt::format("quads analyze layers: {} batches, {} tokens, reference {}\n", r["batches"].get<size_t>(),
                              r["tokens"].get<int64_t>(), r["reference"].get<std::string>());
  s += "relative output error of the quantized linears, ||Y_v - Y_bf16||^2 / ||Y_bf16||^2 (local, per layer):\n";
  s += fmt::format("{:>6}", "layer");
  for (const auto& v : layer_variants()) s += fmt::format(" {:>10}", v);
  s += fmt::format(" {:>8}\n", "W share");
  for (const auto& l : r["layers"]) {
    s += fmt::format("{:>6}", l["layer"].get<int>());
    for (const auto& v : layer_variants()) s += fmt::format(" {:>10.3e}", l["rel_err"][v].get<double>());
    s += fmt::format(" {:>7.1f}%\n", 100 * l["weight_share"].get<double>());
  }
  s += fmt::format("{:>6}", "all");
  for (const auto& v : layer_variants()) s += fmt::format(" {:>10.3e}", r["total_rel_err"][v].get<double>());
  s += "\nper-token |log-prob gap| against bf16 (end to end): mean / max\n";
  for (const auto& v : layer_variants()) {
    const auto& g = r["logprob_gaps"][v];
    s += fmt::format("  {:<9} {:.4e} / {:.4e}\n", v, g["mean_abs_gap"].get<double>(), g["max_abs_gap"].get<double>());
  }
  // Persistence of the activation outlier channels.
  double js = 0;
  int jn = 0;
  for (const auto& l : r["layers"])
    for (const auto& [k, kj] : l["kinds"].items())
      if (!kj["jaccard_vs_batch0"].is_null()) js += kj["jaccard_vs_batch0"].get<double>(), ++jn;
  if (jn) s += fmt::format("top-{} residual channels: mean Jaccard vs batch 0 = {:.3f} over {} (layer, kind) sets\n",
                           r["topk"].get<int>(), js / jn, jn);
  return s;
}

std::vector<std::string> write_layers_report(const ordered_json& r, const std::string& dir) {
  fs::create_directories(dir);
  std::vector<std::string> files;
  rl::write_text_atomic((fs::path(dir) / "layers.json").string(), r.dump(2) + "\n");
  files.push_back("layers.json");
  rl::write_text_atomic((fs::path(dir) / "summary.txt").string(), layers_summary(r));
  files.push_back("summary.txt");
  if (!rl::gnuplot_available()) return files;
  std::vector<rl::Series> err, wa;
  for (const auto& v : layer_variants()) {
    rl::Series s{v, {}, {}};
    for (const auto& l : r["layers"]) {
      s.x.push_back(l["layer"].get<double>());
      s.y.push_back(std::log10(std::max(l["rel_err"][v].get<double>(), 1e-30)));
    }
    err.push_back(s);
  }
  rl::plot_lines((fs::path(dir) / "layer_error.png").string(), "relative output error per layer", "layer",
                 "log10 rel. error", err);
  files.push_back("layer_error.png");
  rl::Series ws{"weight share of W+A error", {}, {}};
  for (const auto& l : r["layers"]) {
    ws.x.push_back(l["layer"].get<double>());
    ws.y.push_back(l["weight_share"].get<double>());
  }
  wa.push_back(ws);
  rl::plot_lines((fs::path(dir) / "w_vs_a.png").string(), "weights' share of the quantization error", "layer",
                 "w_only / (w_only + a_only)", wa);
  files.push_back("w_vs_a.png");
  std::vector<rl::Series> ent;
  for (const auto& v : layer_variants()) {
    rl::Series s{v, {}, {}};
    int i = 0;
    for (const auto& b : r["logprob_gaps"][v]["by_entropy"]) {
      s.x.push_back(i++);
      s.y.push_back(b["tokens"].get<int64_t>() ? b["mean_abs_gap"].get<double>() : NAN);
    }
    ent.push_back(s);
  }
  rl::plot_lines((fs::path(dir) / "logp_gap_entropy.png").string(),
                 "mean |log-prob gap| by entropy bin (0:<0.1 1:<0.5 2:<1 3:<2 4:>=2 nats)", "entropy bin",
                 "mean |gap|", ent);
  files.push_back("logp_gap_entropy.png");
  return files;
}

}  // namespace quads::analysis
