#pragma once
// AdamW with decoupled weight decay (torch.optim.AdamW's update in float32, like torch with
// float32 parameters) and gradient clipping by global L2 norm, on flat float32 buffers
// (model/weights.h layout).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace quads::train {

struct AdamWConfig {
  double lr = 1e-5;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;  // <= 0: no clipping
};

// Global L2 norm of g: squares summed in float64 in fixed chunks, chunks added in order.
double global_norm(const float* g, size_t n);

class AdamW {
 public:
  // decay_mask: one byte per parameter float, 1 = weight decay applies; empty = everything decays.
  AdamW(size_t n, const AdamWConfig& cfg, std::vector<uint8_t> decay_mask = {});
  // Matrices (embeddings, projections, router, lm_head) decay; norm weights do not.
  static std::vector<uint8_t> decay_mask(const model::Layout& layout);

  // One step: clips `grads` in place to max_grad_norm, then for each parameter
  //   p -= lr * wd * p  (where decay applies);  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g²
  //   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  // Returns the gradient norm before clipping. `lr` overrides cfg.lr when > 0 (schedules).
  double step(float* params, float* grads, double lr = 0);

  AdamWConfig cfg;
  int64_t t = 0;
  std::vector<float> m, v;

 private:
  std::vector<uint8_t> decay_;
};

}  // namespace quads::train
