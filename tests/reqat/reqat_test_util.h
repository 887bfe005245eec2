#pragma once
// Helpers of the ReQAT tests (tests/reqat) and of their GPU twins (tests/cuda).
#include <cstdint>
#include <random>

#include "model/config.h"
#include "reqat/kv_quant.h"
#include "reqat/trainer.h"

namespace quads::test {

// A random Q-FIT transform: per layer a positive scale (equal on the pair of channels RoPE rotates
// together, as calibration gives) and a shift, with alpha and beta inside (0, 1).
inline reqat::QFit random_qfit(const model::ModelConfig& c, uint64_t seed) {
  reqat::QFit qf;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> scale(0.5f, 2.f), shift(-0.3f, 0.3f);
  const int64_t kvd = c.kv_dim();
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    reqat::QFitLayer L;
    L.alpha = 0.5;
    L.beta = 0.4;
    L.scale.resize(kvd);
    L.shift.resize(kvd);
    for (int64_t ch = 0; ch < kvd; ++ch) L.shift[ch] = shift(rng);
    for (int64_t g = 0; g < c.num_key_value_heads; ++g)
      for (int j = 0; j < c.head_dim / 2; ++j)
        L.scale[g * c.head_dim + j] = L.scale[g * c.head_dim + j + c.head_dim / 2] = scale(rng);
    qf.layers.push_back(L);
  }
  return qf;
}

// A short, quiet training run: lr 3e-3, warm-up warmup steps.
inline reqat::TrainSpec short_spec(int64_t steps, int64_t batch, bool sem, int64_t warmup = 1) {
  reqat::TrainSpec s;
  s.steps = steps;
  s.batch = batch;
  s.lr = 3e-3;
  s.warmup = warmup;
  s.progress = false;
  s.sem = sem;
  return s;
}

}  // namespace quads::test
