#pragma once
// Shared helpers of the CUDA tests: skipping without a GPU, random test data, bit comparisons.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/device.h"

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

}  // namespace quads::cuda::testing
