#include "model/rac.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "common/error.h"
#include "cpu/gemm.h"
#include "numerics/formats.h"

namespace quads::model {

OperandQuant RacConfig::residual_format(const std::string& name) {
  if (name == "nvfp4") {
    num::QConfig c;
    c.global = num::Global::PerRow;  // per token: row-local like the main activation quantizer
    return OperandQuant::quant(c);
  }
  if (name == "fp8") return OperandQuant::quant(num::QConfig::fp8(num::Block::PerRow));
  if (name == "bf16") return OperandQuant::bf16();
  fail("unknown RAC residual format '{}' (known: nvfp4, fp8, bf16)", name);
}

RacGranularity RacConfig::parse_granularity(const std::string& name) {
  if (name == "block16") return RacGranularity::Block16;
  if (name == "channel") return RacGranularity::Channel;
  fail("unknown RAC granularity '{}' (known: block16, channel)", name);
}

std::string RacConfig::describe() const {
  return fmt::format("RAC ratio={} {} {} residual={}", ratio,
                     granularity == RacGranularity::Block16 ? "block16" : "channel", dynamic ? "dynamic" : "static",
                     residual.describe());
}

int64_t rac_count(int64_t in, double ratio) {
  if (ratio <= 0 || in <= 0) return 0;
  int64_t n = static_cast<int64_t>(std::ceil(ratio * static_cast<double>(in)));
  n = (n + 15) / 16 * 16;
  return std::min(n, in);
}

void rac_energy(const float* X, const float* X_eff, int64_t M, int64_t in, double* energy) {
  for (int64_t r = 0; r < M; ++r) {
    const float* x = X + r * in;
    const float* q = X_eff + r * in;
    for (int64_t j = 0; j < in; ++j) {
      const double d = static_cast<double>(x[j]) - q[j];
      energy[j] += d * d;
    }
  }
}

std::vector<int32_t> rac_select(const double* energy, int64_t in, int64_t count, RacGranularity g) {
  count = std::min(count, in);
  if (count <= 0) return {};
  const int64_t width = g == RacGranularity::Block16 ? 16 : 1;
  QUADS_CHECK(in % width == 0 && count % width == 0,
              "RAC: block16 selection needs the input width ({}) and the count ({}) to be multiples of 16", in, count);
  const int64_t units = in / width, take = count / width;
  std::vector<double> score(units, 0.0);
  for (int64_t u = 0; u < units; ++u)
    for (int64_t j = 0; j < width; ++j) score[u] += energy[u * width + j];
  std::vector<int32_t> order(units);
  std::iota(order.begin(), order.end(), 0);
  // Largest energy first, lower index on ties; NaN energies rank last.
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const double sa = std::isnan(score[a]) ? -1.0 : score[a];
    const double sb = std::isnan(score[b]) ? -1.0 : score[b];
    return sa > sb;
  });
  order.resize(take);
  std::sort(order.begin(), order.end());
  std::vector<int32_t> S;
  S.reserve(count);
  for (int32_t u : order)
    for (int64_t j = 0; j < width; ++j) S.push_back(static_cast<int32_t>(u * width + j));
  return S;
}

void rac_apply(const std::vector<int32_t>& S, const OperandQuant& q, const float* X, const float* X_eff, int64_t M,
               int64_t in, const float* W_eff, int64_t out, float* Y, int64_t ldy) {
  const int64_t ns = static_cast<int64_t>(S.size());
  if (ns == 0 || M == 0) return;
  // Gathered residual R[:, S] and weight columns W_eff[:, S] (W changes only at sync, but gathering
  // it costs 1/M of the GEMM, so it is not worth caching).
  std::vector<float> r(M * ns), rq(M * ns), ws(out * ns), y(M * out);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < ns; ++j) r[m * ns + j] = X[m * in + S[j]] - X_eff[m * in + S[j]];
  for (int64_t o = 0; o < out; ++o)
    for (int64_t j = 0; j < ns; ++j) ws[o * ns + j] = W_eff[o * in + S[j]];
  switch (q.kind) {
    case QuantKind::None: rq = r; break;
    case QuantKind::BF16:
      for (int64_t i = 0; i < M * ns; ++i) rq[i] = num::bf16_round(r[i]);
      break;
    case QuantKind::Quant: num::fake_quantize(r.data(), rq.data(), M, ns, q.cfg); break;
  }
  // A separate GEMM added to the main output, as a kernel would do it.
  cpu::gemm_nt_rowinv(M, out, ns, rq.data(), ns, ws.data(), ns, y.data(), out);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = 0; o < out; ++o) Y[m * ldy + o] += y[m * out + o];
}

void rac_apply(const LinearQ& L, const float* X, const float* X_eff, int64_t M, const float* W_eff, float* Y,
               int64_t ldy) {
  if (L.rac_dynamic_count > 0) {
    if (M == 0) return;
    std::vector<double> e(L.in, 0.0);
    rac_energy(X, X_eff, M, L.in, e.data());
    const auto g = L.rac_dynamic_block16 ? RacGranularity::Block16 : RacGranularity::Channel;
    rac_apply(rac_select(e.data(), L.in, L.rac_dynamic_count, g), L.rac_quant, X, X_eff, M, L.in, W_eff, L.out, Y, ldy);
    return;
  }
  if (L.rac_channels.empty()) return;
  rac_apply(L.rac_channels, L.rac_quant, X, X_eff, M, L.in, W_eff, L.out, Y, ldy);
}

void rac_clear(Model& m) {
  for (LinearQ& L : m.linears()) {
    L.rac_channels.clear();
    L.rac_quant = OperandQuant::none();
    L.rac_dynamic_count = 0;
  }
}

int rac_calibrate(Model& m, const Batch& calib, const RacConfig& cfg) {
  rac_clear(m);
  if (cfg.ratio <= 0) return 0;
  std::vector<LinearQ>& lin = m.linears();
  if (cfg.dynamic) {
    int n = 0;
    for (LinearQ& L : lin) {
      const int64_t count = rac_count(L.in, cfg.ratio);
      if (L.num.act.kind != QuantKind::Quant || count == 0) continue;
      L.rac_dynamic_count = static_cast<int32_t>(count);
      L.rac_dynamic_block16 = cfg.granularity == RacGranularity::Block16;
      L.rac_quant = cfg.residual;
      ++n;
    }
    return n;
  }
  std::vector<std::vector<double>> energy(lin.size());
  for (size_t i = 0; i < lin.size(); ++i)
    if (lin[i].num.act.kind == QuantKind::Quant) energy[i].assign(lin[i].in, 0.0);
  // The probe is called once per linear per forward (experts serially when a probe is set), so the
  // sums accumulate in a fixed order. Linears are found by their position in the model's list.
  const LinearQ* base = lin.data();
  ForwardOptions opt;
  opt.probe = [&](const LinearQ& L, const float* X, const float* X_eff, const float*, int64_t M) {
    const size_t i = static_cast<size_t>(&L - base);
    if (i < energy.size() && !energy[i].empty()) rac_energy(X, X_eff, M, L.in, energy[i].data());
  };
  std::vector<float> logits(static_cast<size_t>(calib.ntokens()) * m.config().vocab_size);
  m.forward(calib, logits.data(), nullptr, opt);
  return rac_assign(m, energy, cfg);
}

int rac_assign(Model& m, const std::vector<std::vector<double>>& energy, const RacConfig& cfg) {
  std::vector<LinearQ>& lin = m.linears();
  QUADS_CHECK(energy.size() == lin.size(), "RAC: energies for {} linears given, the model has {}", energy.size(),
              lin.size());
  rac_clear(m);
  if (cfg.ratio <= 0) return 0;
  int n = 0;
  for (size_t i = 0; i < lin.size(); ++i) {
    if (energy[i].empty()) continue;
    QUADS_CHECK(static_cast<int64_t>(energy[i].size()) == lin[i].in, "RAC: {} channels of energy for {} ({} inputs)",
                energy[i].size(), lin[i].name, lin[i].in);
    const int64_t count = rac_count(lin[i].in, cfg.ratio);
    if (count == 0) continue;
    lin[i].rac_channels = rac_select(energy[i].data(), lin[i].in, count, cfg.granularity);
    lin[i].rac_quant = cfg.residual;
    ++n;
  }
  return n;
}

}  // namespace quads::model
