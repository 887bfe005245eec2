#pragma once
// Small random Qwen3-MoE models for the model tests.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "model/model.h"

namespace quads::test {

// A tiny config: 2 layers, hidden 32, 4 heads over 2 kv heads of dim 8, 6 experts top-2.
inline model::ModelConfig tiny_config() {
  model::ModelConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.num_experts = 6;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 256;
  return c;
}

inline std::vector<int32_t> random_tokens(int64_t n, int vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(g() % static_cast<uint64_t>(vocab));
  return t;
}

inline std::vector<float> random_normal(size_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * d(g));
  return v;
}

inline double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace quads::test
