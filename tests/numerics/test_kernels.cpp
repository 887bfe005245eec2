// The fast scalar codecs of numerics/kernels.h against the reference codecs of formats.h.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "numerics/formats.h"
#include "numerics/kernels.h"

using namespace quads::num;
using namespace quads::num::detail;

namespace {

// Floats around every code and midpoint of a decode table, plus a stride over all bit patterns.
std::vector<float> probes(float (*decode)(uint8_t), int ncodes, uint64_t stride) {
  std::vector<float> v;
  const float inf = std::numeric_limits<float>::infinity();
  for (int c = 0; c + 1 < ncodes; ++c) {
    const float lo = decode(static_cast<uint8_t>(c)), hi = decode(static_cast<uint8_t>(c + 1));
    if (!std::isfinite(lo) || !std::isfinite(hi) || !(hi > lo)) continue;
    const float mid = (lo + hi) / 2;  // exact: both have few mantissa bits
    for (float f : {lo, hi, mid, std::nextafter(mid, inf), std::nextafter(mid, -inf)}) v.push_back(f);
  }
  for (uint64_t k = 0; k < (1ull << 32); k += stride) v.push_back(std::bit_cast<float>(static_cast<uint32_t>(k)));
  for (float f : {0.f, -0.f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7F800001u),
                  std::bit_cast<float>(0xFFFFFFFFu), std::numeric_limits<float>::denorm_min()})
    v.push_back(f);
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return v;
}

}  // namespace

TEST(Kernels, E4M3EncodeMatchesCodec) {
  for (float x : probes(e4m3_to_f32, 127, 1009)) ASSERT_EQ(e4m3_encode(x), e4m3_from_f32(x)) << x;
  // Dense sweep over the range that block scales live in: every fifth float in [2^-12, 2^-4) and a
  // fine stride up to 512.
  for (uint32_t u = 0x39800000u; u < 0x3D800000u; u += 5) ASSERT_EQ(e4m3_encode(std::bit_cast<float>(u)), e4m3_from_f32(std::bit_cast<float>(u)));
  for (uint32_t u = 0x3D800000u; u < 0x44000000u; u += 7) ASSERT_EQ(e4m3_encode(std::bit_cast<float>(u)), e4m3_from_f32(std::bit_cast<float>(u)));
}

TEST(Kernels, Grid4EncodeMatchesCodecs) {
  for (float x : probes(e2m1_to_f32, 8, 4099)) {
    ASSERT_EQ(grid4_encode(x, kGridE2M1), e2m1_from_f32(x)) << x;
    if (!std::isnan(x)) {
      ASSERT_EQ(grid4_decode(grid4_encode(x, kGridE2M1), kGridE2M1), e2m1_to_f32(e2m1_from_f32(x)));
    }
  }
  for (float x : probes(e1m2_to_f32, 8, 4099)) ASSERT_EQ(grid4_encode(x, kGridE1M2), e1m2_from_f32(x)) << x;
  for (uint32_t u = 0x3E000000u; u < 0x41000000u; u += 3) {  // every third float in [0.125, 8)
    const float x = std::bit_cast<float>(u);
    ASSERT_EQ(grid4_encode(x, kGridE2M1), e2m1_from_f32(x)) << x;
    ASSERT_EQ(grid4_encode(-x, kGridE1M2), e1m2_from_f32(-x)) << x;
  }
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(std::bit_cast<uint32_t>(grid4_decode(static_cast<uint8_t>(c), kGridE2M1)),
              std::bit_cast<uint32_t>(e2m1_to_f32(static_cast<uint8_t>(c))));
    EXPECT_EQ(std::bit_cast<uint32_t>(grid4_decode(static_cast<uint8_t>(c), kGridE1M2)),
              std::bit_cast<uint32_t>(e1m2_to_f32(static_cast<uint8_t>(c))));
  }
}

TEST(Kernels, AbsmaxNaNWins) {
  std::vector<float> x = {1.f, -3.f, 2.f, -0.f};
  EXPECT_EQ(absmax(x.data(), 4), 3.f);
  x.push_back(-std::numeric_limits<float>::infinity());
  EXPECT_EQ(absmax(x.data(), 5), std::numeric_limits<float>::infinity());
  x.insert(x.begin(), std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(absmax(x.data(), 6)));
  EXPECT_EQ(absmax(x.data(), 0), 0.f);
}

TEST(Kernels, StochasticRoundingStream) {
  // A pure function of (seed, index), uniform in [0, 1) with 24 bits.
  EXPECT_EQ(sr_uniform(1, 5), sr_uniform(1, 5));
  EXPECT_NE(sr_uniform(1, 5), sr_uniform(2, 5));
  EXPECT_NE(sr_uniform(1, 5), sr_uniform(1, 6));
  double sum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const float u = sr_uniform(9, i);
    ASSERT_GE(u, 0.f);
    ASSERT_LT(u, 1.f);
    ASSERT_EQ(u * 16777216.f, std::floor(u * 16777216.f));
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 4 * std::sqrt(1.0 / 12 / n));
  // Rounding goes to one of the two neighbours: down for u >= p, up for u < p.
  EXPECT_EQ(grid4_encode_sr(2.5f, kGridE2M1, 0.49f), 5);   // p = 0.5: up
  EXPECT_EQ(grid4_encode_sr(2.5f, kGridE2M1, 0.5f), 4);    // down
  EXPECT_EQ(grid4_encode_sr(-0.2f, kGridE2M1, 0.f), 9);    // -0.5
  EXPECT_EQ(grid4_encode_sr(3.f, kGridE2M1, 0.f), 5);      // on the grid: stays
  EXPECT_EQ(grid4_encode_sr(7.f, kGridE2M1, 0.f), 7);      // saturates
  EXPECT_EQ(grid4_encode_sr(3.4f, kGridE1M2, 0.99f), 6);
}
