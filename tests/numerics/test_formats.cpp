// Every codec of formats.h against an independent formulation: decoding from the bit-field
// definition, encoding by brute force (the nearest representable value computed in double,
// ties to the even code) over every code, every midpoint between adjacent codes, the floats
// just above and below each midpoint, and large samples of float bit patterns.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "common/error.h"
#include "numerics/formats.h"

using namespace quads::num;

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

float up(float x) { return std::nextafter(x, kInf); }
float down(float x) { return std::nextafter(x, -kInf); }

// A sign-magnitude minifloat described by its fields, decoded from the definition.
struct Spec {
  int ebits, mbits, bias;
  bool ieee_specials;  // all-ones exponent = inf/NaN (E5M2, F16)
  bool fn_nan;         // E4M3fn: only the all-ones code is NaN
};
const Spec kSpecE2M1{2, 1, 1, false, false};
const Spec kSpecE1M2{1, 2, 0, false, false};
const Spec kSpecE4M3{4, 3, 7, false, true};
const Spec kSpecE5M2{5, 2, 15, true, false};
const Spec kSpecF16{5, 10, 15, true, false};

double spec_decode(uint32_t c, const Spec& s) {
  const uint32_t nbits = 1 + s.ebits + s.mbits;
  const bool neg = (c >> (nbits - 1)) & 1;
  const uint32_t e = (c >> s.mbits) & ((1u << s.ebits) - 1);
  const uint32_t m = c & ((1u << s.mbits) - 1);
  const uint32_t emax = (1u << s.ebits) - 1;
  double v;
  if (s.ieee_specials && e == emax) v = m == 0 ? INFINITY : NAN;
  else if (s.fn_nan && e == emax && m == (1u << s.mbits) - 1) v = NAN;
  else if (e == 0) v = std::ldexp(static_cast<double>(m), 1 - s.bias - s.mbits);
  else v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -s.mbits), static_cast<int>(e) - s.bias);
  return neg ? -v : v;
}

// Finite non-negative codes of a format in increasing order.
std::vector<uint32_t> finite_magnitudes(const Spec& s) {
  std::vector<uint32_t> out;
  const uint32_t n = 1u << (s.ebits + s.mbits);
  for (uint32_t c = 0; c < n; ++c)
    if (std::isfinite(spec_decode(c, s))) out.push_back(c);
  return out;
}

// Brute-force round to nearest, ties to the even code, over the finite magnitudes; `overflow`
// is the code returned when |x| rounds beyond the largest finite value (the saturated max, or
// the inf code for IEEE overflow, where the rounding boundary is max + half an ulp).
uint32_t brute_encode(float x, const Spec& s, bool ieee_overflow) {
  const uint32_t nbits = 1 + s.ebits + s.mbits;
  const uint32_t sign = std::signbit(x) ? 1u << (nbits - 1) : 0u;
  static std::map<const Spec*, std::vector<uint32_t>> cache;
  auto it = cache.find(&s);
  if (it == cache.end()) it = cache.emplace(&s, finite_magnitudes(s)).first;
  const std::vector<uint32_t>& mags = it->second;
  const double a = std::fabs(static_cast<double>(x));
  const double vmax = spec_decode(mags.back(), s);
  if (ieee_overflow) {
    // The next value after max would be max + ulp(max); its code (all-ones exponent) is inf.
    const double next = vmax + (vmax - spec_decode(mags.back() - 1, s));
    if (a > (vmax + next) / 2 || (a == (vmax + next) / 2 && (mags.back() & 1))) return sign | (mags.back() + 1);
  }
  if (a >= vmax) return sign | mags.back();  // (the distances below lose precision for huge a)
  uint32_t best = mags[0];
  double best_d = INFINITY;
  for (uint32_t c : mags) {
    const double d = std::fabs(spec_decode(c, s) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

// Floats that stress rounding: every midpoint of the format, its neighbours, random floats in
// the format's range, and special values.
std::vector<float> probe_values(const Spec& s, int nrandom) {
  std::vector<float> v;
  const auto mags = finite_magnitudes(s);
  for (size_t i = 0; i + 1 < mags.size(); ++i) {
    const float lo = static_cast<float>(spec_decode(mags[i], s)), hi = static_cast<float>(spec_decode(mags[i + 1], s));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    for (float f : {lo, hi, mid, up(mid), down(mid), up(lo), down(hi)}) v.push_back(f);
  }
  const float vmax = static_cast<float>(spec_decode(mags.back(), s));
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> lg(-30.f, std::log2(vmax) + 2);
  for (int i = 0; i < nrandom; ++i) v.push_back(std::exp2(lg(rng)) * (1.f + 0.001f * (i % 7)));
  for (float f : {0.f, 1e-45f, 1e-38f, vmax * 1.01f, vmax * 4.f, 1e30f, std::numeric_limits<float>::max(), kInf})
    v.push_back(f);
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return v;
}

}  // namespace

TEST(Formats, E2M1EveryCode) {
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c)), spec_decode(c, kSpecE2M1)) << c;
    EXPECT_EQ(e2m1_from_f32(e2m1_to_f32(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(e2m1_to_f32(0x7), 6.f);
  EXPECT_TRUE(std::signbit(e2m1_to_f32(0x8)));
}

TEST(Formats, E2M1RoundingAgainstBruteForce) {
  for (float x : probe_values(kSpecE2M1, 20000))
    ASSERT_EQ(e2m1_from_f32(x), brute_encode(x, kSpecE2M1, false)) << x;
  // The ties spelled out: midpoints go to the code with an even mantissa.
  EXPECT_EQ(e2m1_from_f32(0.25f), 0x0);
  EXPECT_EQ(e2m1_from_f32(0.75f), 0x2);
  EXPECT_EQ(e2m1_from_f32(1.25f), 0x2);
  EXPECT_EQ(e2m1_from_f32(1.75f), 0x4);
  EXPECT_EQ(e2m1_from_f32(2.5f), 0x4);
  EXPECT_EQ(e2m1_from_f32(3.5f), 0x6);
  EXPECT_EQ(e2m1_from_f32(5.f), 0x6);
  EXPECT_EQ(e2m1_from_f32(up(5.f)), 0x7);
  EXPECT_EQ(e2m1_from_f32(-0.f), 0x8);
  EXPECT_EQ(e2m1_from_f32(kInf), 0x7);
  EXPECT_EQ(e2m1_from_f32(-kInf), 0xF);
  EXPECT_EQ(e2m1_from_f32(kNaN), 0x7);  // no NaN in the grid: max magnitude, NaN's sign
  EXPECT_EQ(e2m1_from_f32(-kNaN), 0xF);
}

TEST(Formats, E1M2EveryCodeAndRounding) {
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(e1m2_to_f32(static_cast<uint8_t>(c)), spec_decode(c, kSpecE1M2)) << c;
    EXPECT_EQ(e1m2_from_f32(e1m2_to_f32(static_cast<uint8_t>(c))), c) << c;
  }
  for (int c = 0; c < 8; ++c) EXPECT_EQ(e1m2_to_f32(static_cast<uint8_t>(c)), 0.5f * c);  // uniform grid
  for (float x : probe_values(kSpecE1M2, 20000))
    ASSERT_EQ(e1m2_from_f32(x), brute_encode(x, kSpecE1M2, false)) << x;
  EXPECT_EQ(e1m2_from_f32(3.25f), 0x6);
  EXPECT_EQ(e1m2_from_f32(100.f), 0x7);
  EXPECT_EQ(e1m2_from_f32(kNaN), 0x7);
}

TEST(Formats, E4M3EveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const double want = spec_decode(c, kSpecE4M3);
    const float got = e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_TRUE(c == 0x7F || c == 0xFF);
      continue;
    }
    EXPECT_EQ(got, want) << c;
    EXPECT_EQ(e4m3_from_f32(got), c) << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);  // smallest subnormal
}

TEST(Formats, E4M3RoundingAgainstBruteForce) {
  for (float x : probe_values(kSpecE4M3, 50000))
    ASSERT_EQ(e4m3_from_f32(x), brute_encode(x, kSpecE4M3, false)) << x;
  EXPECT_EQ(e4m3_from_f32(464.f), 0x7E);  // midpoint to the NaN code: satfinite
  EXPECT_EQ(e4m3_from_f32(1e9f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(kInf), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-kInf), 0xFE);
  EXPECT_EQ(e4m3_from_f32(kNaN), 0x7F);
  EXPECT_EQ(e4m3_from_f32(-kNaN), 0xFF);
  EXPECT_EQ(e4m3_from_f32(-0.f), 0x80);
  EXPECT_EQ(e4m3_from_f32(0x1p-10f), 0x00);       // half the smallest subnormal: tie to 0
  EXPECT_EQ(e4m3_from_f32(up(0x1p-10f)), 0x01);
  EXPECT_EQ(e4m3_from_f32(3 * 0x1p-10f), 0x02);   // 1.5 ulp: tie to even (2)
  EXPECT_EQ(e4m3_from_f32(1e-45f), 0x00);         // float subnormal input
  EXPECT_EQ(e4m3_from_f32(-1e-45f), 0x80);
}

TEST(Formats, E5M2EveryCodeAndRounding) {
  for (uint32_t c = 0; c < 256; ++c) {
    const double want = spec_decode(c, kSpecE5M2);
    const float got = e5m2_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    EXPECT_EQ(got, want) << c;
    EXPECT_EQ(e5m2_from_f32(got, false), c) << c;
    if (std::isfinite(want)) {
      EXPECT_EQ(e5m2_from_f32(got, true), c) << c;
    }
  }
  for (float x : probe_values(kSpecE5M2, 50000)) {
    if (std::isinf(x)) continue;
    ASSERT_EQ(e5m2_from_f32(x, true), brute_encode(x, kSpecE5M2, false)) << x;
    ASSERT_EQ(e5m2_from_f32(x, false), brute_encode(x, kSpecE5M2, true)) << x;
  }
  EXPECT_EQ(e5m2_from_f32(61440.f, false), 0x7C);  // max + half ulp: ties to even = inf
  EXPECT_EQ(e5m2_from_f32(down(61440.f), false), 0x7B);
  EXPECT_EQ(e5m2_from_f32(61440.f, true), 0x7B);
  EXPECT_EQ(e5m2_from_f32(kInf, false), 0x7C);
  EXPECT_EQ(e5m2_from_f32(-kInf, true), 0xFB);
  EXPECT_TRUE(std::isnan(e5m2_to_f32(e5m2_from_f32(kNaN))));
}

TEST(Formats, UE8M0) {
  for (int c = 0; c < 255; ++c) EXPECT_EQ(ue8m0_to_f32(static_cast<uint8_t>(c)), std::ldexp(1.0, c - 127)) << c;
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(0xFF)));
  // Powers of two are exact under both rules; anything else is floor / ceil of log2.
  for (int e = -127; e <= 127; ++e) {
    const float p = std::ldexp(1.f, e);
    EXPECT_EQ(ue8m0_from_f32(p, false), e + 127) << e;
    EXPECT_EQ(ue8m0_from_f32(p, true), e + 127) << e;
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> lg(-126.0, 126.0);
  for (int i = 0; i < 20000; ++i) {
    const float x = static_cast<float>(std::exp2(lg(rng)));
    const double l = std::log2(static_cast<double>(x));
    EXPECT_EQ(ue8m0_from_f32(x, false), static_cast<int>(std::floor(l)) + 127) << x;
    EXPECT_EQ(ue8m0_from_f32(x, true), static_cast<int>(std::ceil(l)) + 127) << x;
  }
  EXPECT_EQ(ue8m0_from_f32(up(1.f), true), 128);
  EXPECT_EQ(ue8m0_from_f32(down(2.f), false), 127);
  EXPECT_EQ(ue8m0_from_f32(0.f), 0);
  EXPECT_EQ(ue8m0_from_f32(1e-45f), 0);  // below 2^-127: clamps
  EXPECT_EQ(ue8m0_from_f32(std::numeric_limits<float>::max(), true), 254);
  EXPECT_EQ(ue8m0_from_f32(-1.f), 0xFF);
  EXPECT_EQ(ue8m0_from_f32(kNaN), 0xFF);
}

// BF16 against a double-based formulation: the two bf16 neighbours of x are its truncation and
// the truncation plus one bf16 ulp (for x near FLT_MAX that neighbour is 2^128, i.e. inf);
// pick the nearer in exact double arithmetic, ties to the even one.
TEST(Formats, BF16AgainstDouble) {
  auto expected = [](float x) -> uint16_t {
    const uint32_t u = std::bit_cast<uint32_t>(x);
    const uint32_t t = u & 0xFFFF0000u;
    const double a = std::fabs(static_cast<double>(x));
    const double lo = std::fabs(static_cast<double>(std::bit_cast<float>(t)));
    const int ex = static_cast<int>((t >> 23) & 0xFF);
    const double ulp = std::ldexp(1.0, (ex == 0 ? 1 : ex) - 127 - 7);
    const double hi = lo + ulp;
    const bool round_up = (a - lo > hi - a) || (a - lo == hi - a && ((t >> 16) & 1));
    return static_cast<uint16_t>((t >> 16) + (round_up ? 1 : 0));
  };
  std::mt19937 rng(42);
  int n = 0;
  for (uint64_t k = 0; k < (1ull << 32); k += 997 + (rng() & 1023), ++n) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(k));
    if (std::isnan(x)) continue;
    ASSERT_EQ(bf16_from_f32(x), expected(x)) << std::hex << k;
  }
  EXPECT_GT(n, 2000000);
  // Every bf16 value round-trips; every midpoint and its neighbours round as the formulation says.
  for (uint32_t b = 0; b < 65536; ++b) {
    const float v = bf16_to_f32(static_cast<uint16_t>(b));
    if (std::isnan(v)) continue;
    ASSERT_EQ(bf16_from_f32(v), b);
    const float mid = std::bit_cast<float>((b << 16) | 0x8000u);
    if (std::isnan(mid) || std::isinf(v)) continue;
    for (float x : {mid, up(mid), down(mid)}) ASSERT_EQ(bf16_from_f32(x), expected(x)) << std::hex << b;
  }
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_TRUE(std::isnan(bf16_to_f32(bf16_from_f32(std::bit_cast<float>(0x7F800001u)))));  // sNaN stays NaN
  EXPECT_TRUE(std::isnan(bf16_to_f32(bf16_from_f32(-kNaN))));
  EXPECT_EQ(bf16_from_f32(-0.f), 0x8000);
  EXPECT_EQ(bf16_round(1.f + 0x1p-8f), 1.f);          // tie to even
  EXPECT_EQ(bf16_round(1.f + 3 * 0x1p-8f), 1.f + 0x1p-6f);  // tie to even, upward
}

TEST(Formats, F16EveryCodeAndRounding) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const double want = spec_decode(c, kSpecF16);
    const float got = f16_to_f32(static_cast<uint16_t>(c));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << c;
      continue;
    }
    ASSERT_EQ(got, want) << c;
    ASSERT_EQ(f16_from_f32(got), c) << c;
  }
  // Rounding, as values: the nearest f16 in double arithmetic, ties to an even significand.
  auto expected = [](float x) -> double {
    const double a = std::fabs(static_cast<double>(x));
    const int e = a < 0x1p-14 ? -14 : static_cast<int>(std::floor(std::log2(a)));
    const double step = std::ldexp(1.0, e - 10);
    const double k = std::floor(a / step), lo = k * step, hi = lo + step;
    double r = (a - lo > hi - a || (a - lo == hi - a && std::fmod(k, 2.0) == 1.0)) ? hi : lo;
    if (r > 65504.0) r = INFINITY;
    return std::signbit(x) ? -r : r;
  };
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> lg(-27.0, 17.0);
  std::vector<float> xs;
  for (int i = 0; i < 300000; ++i) xs.push_back(static_cast<float>(std::exp2(lg(rng))) * ((i & 1) ? -1.f : 1.f));
  for (uint32_t c = 0; c < 0x7C00; ++c) {  // every midpoint and its neighbours
    const double lo = spec_decode(c, kSpecF16), hi = spec_decode(c + 1, kSpecF16);
    const float mid = static_cast<float>((lo + (std::isinf(hi) ? 65536.0 : hi)) / 2);
    for (float x : {mid, up(mid), down(mid)}) xs.push_back(x);
  }
  for (float x : xs) ASSERT_EQ(f16_to_f32(f16_from_f32(x)), expected(x)) << x;
  EXPECT_EQ(f16_from_f32(65520.f), 0x7C00);
  EXPECT_EQ(f16_from_f32(down(65520.f)), 0x7BFF);
  EXPECT_EQ(f16_from_f32(-kInf), 0xFC00);
  EXPECT_EQ(f16_from_f32(0x1p-25f), 0x0000);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(f16_from_f32(-1e-45f), 0x8000);
  EXPECT_TRUE(std::isnan(f16_to_f32(f16_from_f32(kNaN))));
}

TEST(Formats, TraitsAndNames) {
  for (Format f : {Format::E2M1, Format::E1M2, Format::E4M3, Format::E5M2, Format::UE8M0, Format::BF16, Format::F16,
                   Format::F32}) {
    EXPECT_EQ(traits(f).format, f);
    EXPECT_EQ(parse_format(format_name(f)), f);
  }
  EXPECT_EQ(traits(Format::E4M3).max_finite, e4m3_to_f32(0x7E));
  EXPECT_EQ(traits(Format::E5M2).max_finite, e5m2_to_f32(0x7B));
  EXPECT_EQ(traits(Format::F16).max_finite, f16_to_f32(0x7BFF));
  EXPECT_EQ(traits(Format::BF16).max_finite, bf16_to_f32(0x7F7F));
  EXPECT_EQ(traits(Format::E4M3).min_subnormal, e4m3_to_f32(0x01));
  EXPECT_EQ(traits(Format::E5M2).min_subnormal, e5m2_to_f32(0x01));
  EXPECT_EQ(traits(Format::F16).min_subnormal, f16_to_f32(0x0001));
  EXPECT_EQ(traits(Format::BF16).min_subnormal, bf16_to_f32(0x0001));
  EXPECT_EQ(traits(Format::UE8M0).max_finite, ue8m0_to_f32(0xFE));
  EXPECT_THROW(parse_format("fp5"), quads::Error);
}
