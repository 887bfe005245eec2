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
    double s = 0;
    const size_t e = std::min(n, (c + 1) * kChunk);
    for (size_t i = c * kChunk; i < e; ++i) s += double(g[i]) * double(g[i]);
    part[c] = s;
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
  const double lr = lr_override > 0 ? lr_override : cfg.lr;
  const double b1 = cfg.beta1, b2 = cfg.beta2;
  const double bc1 = 1.0 - std::pow(b1, double(t));
  const double bc2 = 1.0 - std::pow(b2, double(t));
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  const double wd = cfg.weight_decay;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (size_t i = 0; i < n; ++i) {
    double p = params[i];
    const double g = grads[i];
    if (wd != 0 && (decay_.empty() || decay_[i])) p *= 1.0 - lr * wd;
    const double mi = b1 * double(m[i]) + (1.0 - b1) * g;
    const double vi = b2 * double(v[i]) + (1.0 - b2) * g * g;
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
    const double denom = std::sqrt(vi) / bc2_sqrt + cfg.eps;
    params[i] = static_cast<float>(p - step_size * mi / denom);
  }
  return norm;
}

}  // namespace quads::train
