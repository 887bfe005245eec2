#include "train/adamw.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace quads::train {

double global_norm(const float* g, size_t n) {
  // Fixed chunks, summed in order: the same result for any number of threads.
  constexpr size_t kChunk = size_t(1) << 16;
  const size_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(nchunks, 0.0);
#pragma omp parallel for schedule(static) if (nchunks > 1)
  for (size_t c = 0; c < nchunks; ++c) {
    // Four interleaved partial sums (a fixed order that still pipelines), added at the end.
    double s[4] = {0, 0, 0, 0};
    const size_t b = c * kChunk, e = std::min(n, b + kChunk);
    size_t i = b;
    for (; i + 4 <= e; i += 4)
      for (int j = 0; j < 4; ++j) s[j] += double(g[i + j]) * double(g[i + j]);
    for (; i < e; ++i) s[0] += double(g[i]) * double(g[i]);
    part[c] = (s[0] + s[1]) + (s[2] + s[3]);
  }
  double s = 0;
  for (double p : part) s += p;
  return std::sqrt(s);
}

AdamW::AdamW(size_t n, const AdamWConfig& c, std::vector<uint8_t> decay_mask)
    : cfg(c), m(n, 0.f), v(n, 0.f), decay_(std::move(decay_mask)) {
  QUADS_CHECK(decay_.empty() || decay_.size() == n, "AdamW: decay mask has {} entries for {} parameters", decay_.size(),
              n);
}

std::vector<uint8_t> AdamW::decay_mask(const model::Layout& layout) {
  std::vector<uint8_t> mask(layout.total, 0);
  for (const auto& p : layout.params)
    if (p.is_matrix()) std::fill(mask.begin() + p.offset, mask.begin() + p.offset + p.numel, 1);
  return mask;
}

double AdamW::step(float* params, float* grads, double lr_override) {
  const size_t n = m.size();
  const double norm = global_norm(grads, n);
  if (cfg.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
    const double coef = cfg.max_grad_norm / (norm + 1e-6);
    if (coef < 1.0) {
      const float cf = static_cast<float>(coef);
#pragma omp parallel for schedule(static) if (n > 65536)
      for (size_t i = 0; i < n; ++i) grads[i] *= cf;
    }
  }
  ++t;
  // torch.optim.AdamW's float32 update, one parameter at a time (vectorized; lanes are independent).
  const double lr = lr_override > 0 ? lr_override : cfg.lr;
  const float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(cfg.beta1, double(t))));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(cfg.beta2, double(t))));
  const float eps = static_cast<float>(cfg.eps);
  const float decay = static_cast<float>(1.0 - lr * cfg.weight_decay);
  const uint8_t* mask = decay_.empty() ? nullptr : decay_.data();
  float* __restrict pm = m.data();
  float* __restrict pv = v.data();
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (size_t i = 0; i < n; ++i) {
    const float g = grads[i];
    const float f = (mask == nullptr || mask[i]) ? decay : 1.f;
    const float p = params[i] * f;
    const float mi = b1 * pm[i] + (1.f - b1) * g;
    const float vi = b2 * pv[i] + (1.f - b2) * (g * g);
    pm[i] = mi;
    pv[i] = vi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    params[i] = p - step_size * (mi / denom);
  }
  return norm;
}

}  // namespace quads::train
