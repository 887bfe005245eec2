#include "reqat/kv_quant.h"

#include <cmath>
#include <cstring>
#include <functional>

#include "common/error.h"
#include "cpu/ops.h"

namespace quads::reqat {

num::QConfig KvQuantConfig::qconfig() const {
  num::QConfig c = num::QConfig::nvfp4_kv();
  c.element = element;
  return c;
}

std::string KvQuantConfig::describe() const {
  if (!enabled) return "off";
  return element == num::Format::E1M2 ? "kv4 e1m2" : "kv4 e2m1";
}

KvQuantConfig parse_kv_quant(const std::string& name, const std::string& what) {
  KvQuantConfig k;
  if (name == "e1m2") k.element = num::Format::E1M2;
  else if (name == "e2m1") k.element = num::Format::E2M1;
  else if (name == "off") k.enabled = false;
  else fail("{}: unknown KV-cache format '{}' (e1m2 | e2m1 | off)", what, name);
  return k;
}

// ---- Q-FIT parameters as json -------------------------------------------------------------------

nlohmann::json QFit::to_json() const {
  nlohmann::json j = nlohmann::json::array();
  for (const QFitLayer& L : layers)
    j.push_back({{"alpha", L.alpha}, {"beta", L.beta}, {"mse_plain", L.mse_plain}, {"mse_best", L.mse_best},
                 {"scale", L.scale}, {"shift", L.shift}});
  return {{"layers", j}};
}

QFit QFit::from_json(const nlohmann::json& j, int num_layers, int64_t kv_dim, const std::string& origin) {
  QUADS_CHECK(j.is_object() && j.contains("layers") && j["layers"].is_array(), "{}: Q-FIT json needs a 'layers' array",
              origin);
  QFit q;
  const auto& arr = j["layers"];
  QUADS_CHECK(static_cast<int>(arr.size()) == num_layers, "{}: Q-FIT has {} layers, the model {}", origin, arr.size(),
              num_layers);
  for (size_t l = 0; l < arr.size(); ++l) {
    QFitLayer L;
    try {
      L.alpha = arr[l].at("alpha").get<double>();
      L.beta = arr[l].at("beta").get<double>();
      L.mse_plain = arr[l].value("mse_plain", 0.0);
      L.mse_best = arr[l].value("mse_best", 0.0);
      L.scale = arr[l].at("scale").get<std::vector<float>>();
      L.shift = arr[l].at("shift").get<std::vector<float>>();
    } catch (const nlohmann::json::exception& e) {
      fail("{}: Q-FIT layer {}: {}", origin, l, e.what());
    }
    QUADS_CHECK(L.scale.empty() || static_cast<int64_t>(L.scale.size()) == kv_dim,
                "{}: Q-FIT layer {} scale has {} values, expected {}", origin, l, L.scale.size(), kv_dim);
    QUADS_CHECK(L.shift.empty() || static_cast<int64_t>(L.shift.size()) == kv_dim,
                "{}: Q-FIT layer {} shift has {} values, expected {}", origin, l, L.shift.size(), kv_dim);
    q.layers.push_back(std::move(L));
  }
  return q;
}

// ---- the arithmetic shared by the hooks and the calibration (so both compute the same floats) ----

namespace {

// f[c] = s[c]^alpha (1 where s is 0: an all-zero channel has nothing to rescale).
std::vector<float> scale_factors(const std::vector<float>& s, double alpha) {
  std::vector<float> f(s.size(), 1.f);
  if (alpha == 0) return f;
  for (size_t c = 0; c < s.size(); ++c)
    if (s[c] > 0) f[c] = static_cast<float>(std::pow(static_cast<double>(s[c]), alpha));
  return f;
}

// m[c] = beta * shift[c].
std::vector<float> shift_values(const std::vector<float>& shift, double beta) {
  std::vector<float> m(shift.size());
  for (size_t c = 0; c < shift.size(); ++c) m[c] = static_cast<float>(beta * static_cast<double>(shift[c]));
  return m;
}

// q [n, nh, hd] *= f of its kv head (q may be null); k [n, nkv, hd] /= f.
void apply_scale(float* q, float* k, int64_t n, int nh, int nkv, int hd, const float* f) {
  const int group = nh / nkv;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    for (int h = 0; q && h < nh; ++h) {
      float* qr = q + (t * nh + h) * hd;
      const float* fr = f + static_cast<int64_t>(h / group) * hd;
      for (int j = 0; j < hd; ++j) qr[j] *= fr[j];
    }
    for (int g = 0; g < nkv; ++g) {
      float* kr = k + (t * nkv + g) * hd;
      const float* fr = f + static_cast<int64_t>(g) * hd;
      for (int j = 0; j < hd; ++j) kr[j] /= fr[j];
    }
  }
}

// The transpose for the backward: dq *= f, dk /= f.
void apply_scale_backward(float* dq, float* dk, int64_t n, int nh, int nkv, int hd, const float* f) {
  apply_scale(dq, dk, n, nh, nkv, hd, f);  // the same diagonal maps
}

// k [n, nkv, hd] -= m (m [nkv * hd]); then K and V fake-quantized (rows of hd).
void apply_post(float* k, float* v, int64_t n, int64_t kvd, int hd, const float* m, const num::QConfig* qc) {
  if (m) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < kvd; ++c) k[t * kvd + c] -= m[c];
  }
  if (qc) {
    const int64_t rows = n * (kvd / hd);
    num::fake_quantize(k, k, rows, hd, *qc);
    num::fake_quantize(v, v, rows, hd, *qc);
  }
}


}  // namespace

model::KvTransform make_kv_transform(const model::ModelConfig& cfg, const KvQuantConfig& kv, const QFit* qfit) {
  model::KvTransform t;
  const int64_t kvd = cfg.kv_dim();
  t.quantize = kv.enabled;
  if (kv.enabled) {
    t.qconfig = kv.qconfig();
    QUADS_CHECK(cfg.head_dim % 16 == 0, "KV-cache quantization needs head_dim a multiple of 16 (16-element blocks), "
                                        "the model has head_dim {}", cfg.head_dim);
  }
  if (qfit && !qfit->empty()) {
    QUADS_CHECK(static_cast<int>(qfit->layers.size()) == cfg.num_hidden_layers,
                "Q-FIT has {} layers, the model {}", qfit->layers.size(), cfg.num_hidden_layers);
    t.factor.resize(cfg.num_hidden_layers);
    t.shift.resize(cfg.num_hidden_layers);
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const QFitLayer& L = qfit->layers[l];
      QUADS_CHECK(L.scale.empty() || static_cast<int64_t>(L.scale.size()) == kvd,
                  "Q-FIT layer {}: scale has {} values, the model's kv_dim is {}", l, L.scale.size(), kvd);
      QUADS_CHECK(L.shift.empty() || static_cast<int64_t>(L.shift.size()) == kvd,
                  "Q-FIT layer {}: shift has {} values, the model's kv_dim is {}", l, L.shift.size(), kvd);
      if (!L.scale.empty() && L.alpha != 0) t.factor[l] = scale_factors(L.scale, L.alpha);
      if (!L.shift.empty() && L.beta != 0) t.shift[l] = shift_values(L.shift, L.beta);
    }
  }
  return t;
}

model::KvHooks make_kv_hooks(const model::ModelConfig& cfg, const KvQuantConfig& kv, const QFit* qfit) {
  return make_kv_hooks(cfg, make_kv_transform(cfg, kv, qfit));
}

model::KvHooks make_kv_hooks(const model::ModelConfig& cfg, const model::KvTransform& t) {
  t.validate(cfg, "KV hooks");
  struct State {
    int nh = 0, nkv = 0, hd = 0;
    model::KvTransform t;
  };
  auto st = std::make_shared<State>();
  st->nh = cfg.num_attention_heads;
  st->nkv = cfg.num_key_value_heads;
  st->hd = cfg.head_dim;
  st->t = t;
  bool any_scale = false, any_shift = false;
  for (const auto& f : st->t.factor) any_scale |= !f.empty();
  for (const auto& m : st->t.shift) any_shift |= !m.empty();
  model::KvHooks h;
  if (any_scale) {
    h.pre_rope = [st](int l, float* q, float* k, int64_t n) {
      if (!st->t.factor[l].empty()) apply_scale(q, k, n, st->nh, st->nkv, st->hd, st->t.factor[l].data());
    };
    h.pre_rope_backward = [st](int l, float* dq, float* dk, int64_t n) {
      if (!st->t.factor[l].empty()) apply_scale_backward(dq, dk, n, st->nh, st->nkv, st->hd, st->t.factor[l].data());
    };
  }
  if (any_shift || st->t.quantize) {
    h.post_rope = [st](int l, float* k, float* v, int64_t n) {
      const float* m = (!st->t.shift.empty() && !st->t.shift[l].empty()) ? st->t.shift[l].data() : nullptr;
      apply_post(k, v, n, static_cast<int64_t>(st->nkv) * st->hd, st->hd, m, st->t.quantize ? &st->t.qconfig : nullptr);
    };
  }
  return h;
}

void install_kv_hooks(model::Model& m, const KvQuantConfig& kv, const QFit* qfit) {
  m.kv_hooks = make_kv_hooks(m.config(), kv, qfit);
}

// ---- calibration -------------------------------------------------------------------------------

AttnCapture capture_attention_inputs(model::Model& m, const model::Batch& calib) {
  const model::ModelConfig& c = m.config();
  const int64_t T = calib.ntokens();
  AttnCapture cap;
  cap.T = T;
  cap.offsets = calib.offsets;
  cap.q.resize(c.num_hidden_layers);
  cap.k.resize(c.num_hidden_layers);
  cap.v.resize(c.num_hidden_layers);
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  model::KvHooks saved = m.kv_hooks;
  m.kv_hooks = {};
  m.kv_hooks.pre_rope = [&](int l, float* q, float* k, int64_t n) {
    cap.q[l].assign(q, q + n * qd);
    cap.k[l].assign(k, k + n * kvd);
  };
  m.kv_hooks.post_rope = [&](int l, float*, float* v, int64_t n) { cap.v[l].assign(v, v + n * kvd); };
  std::vector<float> logits(static_cast<size_t>(T) * c.vocab_size);
  try {
    m.forward(calib, logits.data());
  } catch (...) {
    m.kv_hooks = saved;
    throw;
  }
  m.kv_hooks = saved;
  return cap;
}

namespace {

// RoPE's tables for a capture's positions (restarting in every sequence).
struct RopeTables {
  std::vector<float> cos, sin;  // [T, hd/2]
  RopeTables(const model::ModelConfig& c, const AttnCapture& cap) {
    std::vector<int64_t> pos(cap.T);
    for (size_t s = 0; s + 1 < cap.offsets.size(); ++s)
      for (int64_t t = cap.offsets[s]; t < cap.offsets[s + 1]; ++t) pos[t] = t - cap.offsets[s];
    cos.resize(cap.T * (c.head_dim / 2));
    sin.resize(cap.T * (c.head_dim / 2));
    cpu::rope_tables(pos.data(), cap.T, c.head_dim, c.rope_theta, cos.data(), sin.data());
  }
};

void check_capture(const model::ModelConfig& c, const AttnCapture& cap, int l) {
  train::check_attention_inputs(c, cap, l, {}, "Q-FIT");
}

// The mean over the capture's tokens of layer l's keys divided by `factor` (empty: none) and
// rotated: the shift a candidate subtracts, times beta.
std::vector<float> rotated_key_mean(const model::ModelConfig& c, const AttnCapture& cap, int l, const RopeTables& rt,
                                    const std::vector<float>& factor) {
  const int64_t T = cap.T, kvd = c.kv_dim();
  std::vector<float> k = cap.k[l];
  if (!factor.empty())
    apply_scale(nullptr, k.data(), T, c.num_attention_heads, c.num_key_value_heads, c.head_dim, factor.data());
  cpu::rope_forward(k.data(), T, c.num_key_value_heads, c.head_dim, rt.cos.data(), rt.sin.data());
  std::vector<double> mean(kvd, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t ch = 0; ch < kvd; ++ch) mean[ch] += k[t * kvd + ch];
  std::vector<float> shift(kvd);
  for (int64_t ch = 0; ch < kvd; ++ch) shift[ch] = static_cast<float>(T ? mean[ch] / T : 0.0);
  return shift;
}

// One layer's attention on the host: the float32 reference and the error of each candidate.
struct LayerCalib {
  const model::ModelConfig& c;
  const AttnCapture& cap;
  int l;
  const RopeTables& rt;
  std::vector<float> ref;  // float32 attention output [T, nh, hd]

  LayerCalib(const model::ModelConfig& cfg, const AttnCapture& cp, int layer, const RopeTables& tables)
      : c(cfg), cap(cp), l(layer), rt(tables) {
    std::vector<float> q = cap.q[l], k = cap.k[l];
    cpu::rope_forward(q.data(), cap.T, c.num_attention_heads, c.head_dim, rt.cos.data(), rt.sin.data());
    cpu::rope_forward(k.data(), cap.T, c.num_key_value_heads, c.head_dim, rt.cos.data(), rt.sin.data());
    ref = attend(q.data(), k.data(), cap.v[l].data());
  }

  std::vector<float> attend(const float* q, const float* k, const float* v) const {
    const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    const int64_t qd = c.q_dim(), kvd = c.kv_dim();
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    std::vector<float> out(cap.T * qd);
    for (size_t s = 0; s + 1 < cap.offsets.size(); ++s) {
      const int64_t r0 = cap.offsets[s], n = cap.offsets[s + 1] - r0;
      if (n == 0) continue;
      cpu::attention_forward(q + r0 * qd, k + r0 * kvd, v + r0 * kvd, n, n, nh, nkv, hd, scale, out.data() + r0 * qd,
                             nullptr);
    }
    return out;
  }

  // Factor, RoPE, shift, K and V quantized: the order of the KV hooks (make_kv_hooks).
  double mse(const train::KvCandidate& cand, const num::QConfig* kv) const {
    const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    const int64_t T = cap.T, kvd = c.kv_dim();
    std::vector<float> q = cap.q[l], k = cap.k[l], v = cap.v[l];
    if (!cand.factor.empty()) apply_scale(q.data(), k.data(), T, nh, nkv, hd, cand.factor.data());
    cpu::rope_forward(q.data(), T, nh, hd, rt.cos.data(), rt.sin.data());
    cpu::rope_forward(k.data(), T, nkv, hd, rt.cos.data(), rt.sin.data());
    apply_post(k.data(), v.data(), T, kvd, hd, cand.shift.empty() ? nullptr : cand.shift.data(), kv);
    std::vector<float> out = attend(q.data(), k.data(), v.data());
    double e = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double d = double(out[i]) - double(ref[i]);
      e += d * d;
    }
    return out.empty() ? 0.0 : e / static_cast<double>(out.size());
  }
};

// s[g, j] = max over tokens of |k[t, g, j]|, then max of the RoPE pair (j, j + hd/2).
std::vector<float> key_channel_max(const model::ModelConfig& c, const std::vector<float>& k, int64_t T) {
  const int64_t kvd = c.kv_dim();
  const int hd = c.head_dim, half = hd / 2;
  std::vector<float> s(kvd, 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t ch = 0; ch < kvd; ++ch) s[ch] = std::max(s[ch], std::fabs(k[t * kvd + ch]));
  for (int g = 0; g < c.num_key_value_heads; ++g)
    for (int j = 0; j < half; ++j) {
      float& a = s[g * hd + j];
      float& b = s[g * hd + j + half];
      a = b = std::max(a, b);
    }
  return s;
}

std::vector<double> default_grid() {
  std::vector<double> g;
  for (int i = 0; i < 20; ++i) g.push_back(i * 0.05);
  return g;
}

// The candidate of (alpha, beta) for a layer with scale s; `mean` is rotated_key_mean at alpha.
train::KvCandidate candidate(const std::vector<float>& s, double alpha, double beta, const std::vector<float>& mean) {
  train::KvCandidate k;
  if (!s.empty() && alpha != 0) k.factor = scale_factors(s, alpha);
  if (beta != 0) k.shift = shift_values(mean, beta);
  return k;
}

// The search, wherever the MSEs are computed: eval(l, candidates) gives layer l's MSE of each.
using EvalFn = std::function<std::vector<double>(int, const std::vector<train::KvCandidate>&)>;
QFit search(const model::ModelConfig& c, const AttnCapture& cap, const QFitOptions& opt, std::vector<QFitGrid>* grids,
            const EvalFn& eval) {
  const std::vector<double> alphas = opt.alphas.empty() ? default_grid() : opt.alphas;
  const std::vector<double> betas = opt.betas.empty() ? default_grid() : opt.betas;
  const RopeTables rt(c, cap);
  QFit q;
  if (grids) grids->assign(c.num_hidden_layers, {});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    check_capture(c, cap, l);
    QFitLayer L;
    L.scale = key_channel_max(c, cap.k[l], cap.T);
    // Row-major over (alpha, beta), then (0, 0) once more: the error of KV quantization alone.
    std::vector<std::vector<float>> means(alphas.size());
    std::vector<train::KvCandidate> cands;
    for (size_t ia = 0; ia < alphas.size(); ++ia) {
      means[ia] = rotated_key_mean(c, cap, l, rt, candidate(L.scale, alphas[ia], 0.0, {}).factor);
      for (double beta : betas) cands.push_back(candidate(L.scale, alphas[ia], beta, means[ia]));
    }
    cands.emplace_back();
    const std::vector<double> mse = eval(l, cands);
    QUADS_CHECK(mse.size() == cands.size(), "Q-FIT: {} MSEs for {} candidates", mse.size(), cands.size());
    QFitGrid grid{alphas, betas, std::vector<double>(mse.begin(), mse.end() - 1)};
    // The first minimum wins, so ties go to the smaller alpha, beta.
    size_t best = 0;
    for (size_t i = 1; i < grid.mse.size(); ++i)
      if (grid.mse[i] < grid.mse[best]) best = i;
    L.alpha = alphas[best / betas.size()];
    L.beta = betas[best % betas.size()];
    L.mse_best = grid.mse[best];
    L.mse_plain = mse.back();
    L.shift = means[best / betas.size()];
    q.layers.push_back(std::move(L));
    if (grids) (*grids)[l] = std::move(grid);
  }
  return q;
}

void check_calibration(const model::ModelConfig& c, const model::Batch& calib) {
  QUADS_CHECK(calib.ntokens() > 0, "Q-FIT: empty calibration batch");
  QUADS_CHECK(c.head_dim % 2 == 0, "Q-FIT: head_dim {} must be even (RoPE pairs)", c.head_dim);
}

}  // namespace

std::vector<double> attention_mse_cpu(const model::ModelConfig& cfg, const AttnCapture& cap, int l,
                                      const std::vector<train::KvCandidate>& cands, const num::QConfig* kv) {
  train::check_attention_inputs(cfg, cap, l, cands, "Q-FIT");
  const RopeTables rt(cfg, cap);
  const LayerCalib lc(cfg, cap, l, rt);
  std::vector<double> mse;
  for (const train::KvCandidate& k : cands) mse.push_back(lc.mse(k, kv));
  return mse;
}

double qfit_attention_mse(const model::ModelConfig& cfg, const AttnCapture& cap, int l, const std::vector<float>& scale,
                          double alpha, double beta, const KvQuantConfig& kv, std::vector<float>* shift_out) {
  check_capture(cfg, cap, l);
  const RopeTables rt(cfg, cap);
  const train::KvCandidate f = candidate(scale, alpha, 0.0, {});
  const std::vector<float> mean = rotated_key_mean(cfg, cap, l, rt, f.factor);
  if (shift_out) *shift_out = mean;
  const num::QConfig qc = kv.qconfig();
  return LayerCalib(cfg, cap, l, rt).mse(candidate(scale, alpha, beta, mean), kv.enabled ? &qc : nullptr);
}

QFit calibrate_qfit(model::Model& m, const model::Batch& calib, const QFitOptions& opt, std::vector<QFitGrid>* grids) {
  const model::ModelConfig& c = m.config();
  check_calibration(c, calib);
  const AttnCapture cap = capture_attention_inputs(m, calib);
  const num::QConfig qc = opt.kv.qconfig();
  const RopeTables rt(c, cap);
  return search(c, cap, opt, grids, [&](int l, const std::vector<train::KvCandidate>& cands) {
    const LayerCalib lc(c, cap, l, rt);
    std::vector<double> mse;
    for (const train::KvCandidate& k : cands) mse.push_back(lc.mse(k, opt.kv.enabled ? &qc : nullptr));
    return mse;
  });
}

QFit calibrate_qfit(train::TrainBackend& dev, const model::ModelConfig& c, const model::Batch& calib,
                    const QFitOptions& opt, std::vector<QFitGrid>* grids) {
  check_calibration(c, calib);
  AttnCapture cap;
  dev.capture_attention(calib, &cap);
  const num::QConfig qc = opt.kv.qconfig();
  return search(c, cap, opt, grids, [&](int l, const std::vector<train::KvCandidate>& cands) {
    return dev.attention_mse(cap, l, cands, opt.kv.enabled ? &qc : nullptr);
  });
}

}  // namespace quads::reqat
