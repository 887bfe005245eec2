#pragma once
// Shared helpers of the CUDA tests: skipping without a GPU, random test data, bit comparisons.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fixtures.h"
#include "cpu/ops.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/model_gpu.h"
#include "model/weights.h"

// Every GPU test starts with this: CI has no GPU and runs the binary as a no-op.
#define QUADS_REQUIRE_GPU()                                                     \
  do {                                                                          \
    if (quads::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";     \
  } while (0)

namespace quads::cuda::testing {

// Gaussian data with per-row magnitudes spread over 2^-8 .. 2^8 (so per-row and per-tensor global
// scales differ), some outliers, some all-zero 16-blocks, a few tiny values (scale underflow).
inline std::vector<float> random_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float rs = std::ldexp(1.f, static_cast<int>(ud(rng) * 16.f) - 8);
    for (int64_t c = 0; c < cols; ++c) {
      float v = nd(rng) * rs;
      const float u = ud(rng);
      if (u < 0.002f) v *= 50.f;              // outlier
      else if (u < 0.004f) v *= 1e-30f;       // tiny
      x[r * cols + c] = v;
    }
    if (cols >= 32 && ud(rng) < 0.3f) {       // a zero block
      const int64_t b = static_cast<int64_t>(ud(rng) * static_cast<float>(cols / 16)) % (cols / 16);
      for (int64_t c = b * 16; c < b * 16 + 16; ++c) x[r * cols + c] = 0.f;
    }
  }
  return x;
}

// bf16 bits of x (round to nearest even) and their float values.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// Same bits, or both NaN.
inline bool same_float(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }
inline bool same_double(double a, double b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

// Index of the first mismatch of two float arrays (bitwise, NaN == NaN), or -1.
inline int64_t first_float_mismatch(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_float(a[i], b[i])) return static_cast<int64_t>(i);
  return -1;
}
template <typename T>
inline int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

// ---- data to and from the device, error measures, fixture files

template <typename T>
DeviceArray<T> dev(const std::vector<T>& v) {
  DeviceArray<T> a;
  a.upload(v);
  return a;
}

inline std::vector<float> randn(size_t n, uint64_t seed, float sd = 1.f, float mean = 0.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Causal attention over packed sequences of lengths `lens` (seq0[t]: the first token of t's
// sequence; off: sequence offsets) with random q, k, v, dout (seeds seed .. seed + 3) and the CPU
// twin's forward and backward per sequence: the reference of the GPU attention tests.
struct PackedAttention {
  std::vector<int32_t> seq0;
  std::vector<int64_t> off;
  int64_t T, qd, kd;
  float scale;
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
};
inline PackedAttention packed_attention(const std::vector<int>& lens, int nh, int nkv, int hd, uint64_t seed) {
  PackedAttention a;
  a.off = {0};
  for (int L : lens) {
    for (int i = 0; i < L; ++i) a.seq0.push_back(static_cast<int32_t>(a.off.back()));
    a.off.push_back(a.off.back() + L);
  }
  a.T = a.off.back();
  a.qd = int64_t(nh) * hd;
  a.kd = int64_t(nkv) * hd;
  a.scale = 1.f / std::sqrt(float(hd));
  const int64_t T = a.T, qd = a.qd, kd = a.kd;
  a.q = randn(T * qd, seed, 1.5f);
  a.k = randn(T * kd, seed + 1, 1.5f);
  a.v = randn(T * kd, seed + 2);
  a.dout = randn(T * qd, seed + 3);
  a.out.resize(T * qd);
  a.lse.resize(T * nh);
  a.dq.resize(T * qd);
  a.dk.assign(T * kd, 0.f);
  a.dv.assign(T * kd, 0.f);
  for (size_t s = 0; s + 1 < a.off.size(); ++s) {
    const int64_t o = a.off[s], L = a.off[s + 1] - a.off[s];
    cpu::attention_forward(a.q.data() + o * qd, a.k.data() + o * kd, a.v.data() + o * kd, L, L, nh, nkv, hd, a.scale,
                           a.out.data() + o * qd, a.lse.data() + o * nh);
    cpu::attention_backward(a.q.data() + o * qd, a.k.data() + o * kd, a.v.data() + o * kd, a.out.data() + o * qd,
                            a.lse.data() + o * nh, a.dout.data() + o * qd, L, L, nh, nkv, hd, a.scale,
                            a.dq.data() + o * qd, a.dk.data() + o * kd, a.dv.data() + o * kd);
  }
  return a;
}

// |a - b| / |b| in float64.
inline double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_l2(a.data(), b.data(), std::min(a.size(), b.size()));
}

// The fixture tiny_qwen3moe_a (../shared/fixtures, or QUADS_FIXTURES).
// All-position logits of one sequence through GpuModel, fed `chunk` tokens per step (prefill,
// chunked prefill, or token by token).
inline std::vector<float> gpu_logits(GpuModel& g, const std::vector<int32_t>& ids, int64_t chunk) {
  g.reset_cache(1, static_cast<int64_t>(ids.size()) + 4);
  std::vector<float> out;
  for (size_t p = 0; p < ids.size(); p += chunk) {
    model::StepItem it;
    it.tokens.assign(ids.begin() + p, ids.begin() + std::min(ids.size(), p + size_t(chunk)));
    it.all_logits = true;
    const std::vector<float> lg = g.step({it});
    out.insert(out.end(), lg.begin(), lg.end());
  }
  return out;
}

inline std::string fixture(const std::string& f) { return fixtures_dir() + "/tiny_qwen3moe_a/" + f; }
inline const model::Weights& fixture_weights() {
  static const model::Weights w = model::Weights::load(fixtures_dir() + "/tiny_qwen3moe_a");
  return w;
}
inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return nlohmann::json::parse(f);
}
inline std::vector<float> read_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  EXPECT_TRUE(f.good()) << path;
  const size_t n = static_cast<size_t>(f.tellg());
  f.seekg(0);
  std::vector<float> v(n / 4);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n));
  return v;
}
inline std::vector<int32_t> input_ids() {
  return read_json(fixture("input_ids.json"))["input_ids"].get<std::vector<int32_t>>();
}

// The CPU twin of decode attention over a slotted KV cache [slots, max_len, nkv * hd]: token t's
// nh query heads attend to positions 0 .. pos[t] of cache slot slot[t] (cpu::attention_forward
// with one query row), scale 1 / sqrt(hd).
inline std::vector<float> cpu_decode_attention(const std::vector<float>& q, const std::vector<float>& kc,
                                               const std::vector<float>& vc, const std::vector<int32_t>& slot,
                                               const std::vector<int32_t>& pos, int nh, int nkv, int hd,
                                               int64_t max_len) {
  const int64_t kvd = int64_t(nkv) * hd, T = static_cast<int64_t>(slot.size());
  const float scale = 1.f / std::sqrt(float(hd));
  std::vector<float> out(q.size());
  for (int64_t t = 0; t < T; ++t)
    cpu::attention_forward(q.data() + t * nh * hd, kc.data() + slot[t] * max_len * kvd,
                           vc.data() + slot[t] * max_len * kvd, 1, pos[t] + 1, nh, nkv, hd, scale,
                           out.data() + t * nh * hd, nullptr);
  return out;
}

}  // namespace quads::cuda::testing
