#include "numerics/formats.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "common/error.h"

namespace quads::num {

namespace {

// A sign-magnitude minifloat: `ebits` exponent bits with bias `bias`, `mbits` mantissa bits.
// The largest finite value is given explicitly because E4M3fn spends only its all-ones code on NaN.
struct Mini {
  int ebits, mbits, bias;
  float max;
};
constexpr Mini kE2M1{2, 1, 1, 6.f};
constexpr Mini kE1M2{1, 2, 0, 3.5f};
constexpr Mini kE4M3{4, 3, 7, 448.f};
constexpr Mini kE5M2{5, 2, 15, 57344.f};
constexpr Mini kF16{5, 10, 15, 65504.f};

// Rounds |x| (finite, >= 0) to the grid of `m` with round-to-nearest-even. Power-of-two scaling
// is exact and nearbyint rounds ties to even in the default FP environment, so this is exact.
inline float round_to_grid(float a, const Mini& m) {
  if (a == 0.f) return 0.f;
  const int emin = 1 - m.bias;
  int k;
  std::frexp(a, &k);  // a = f * 2^k, f in [0.5, 1)
  int e = k - 1;      // floor(log2 a)
  if (e < emin) e = emin;
  const float q = std::ldexp(1.f, e - m.mbits);
  return std::nearbyint(a / q) * q;
}

// Encodes a value already on the grid (|r| <= max).
inline uint32_t encode_on_grid(float r, const Mini& m) {
  if (r == 0.f) return 0;
  const int emin = 1 - m.bias;
  int k;
  std::frexp(r, &k);
  const int e = k - 1;
  if (e < emin) return static_cast<uint32_t>(std::ldexp(r, m.mbits - emin));  // subnormal
  const uint32_t mant = static_cast<uint32_t>(std::ldexp(r, m.mbits - e)) - (1u << m.mbits);
  return (static_cast<uint32_t>(e + m.bias) << m.mbits) | mant;
}

inline float decode(uint32_t bits, const Mini& m) {
  const uint32_t mant = bits & ((1u << m.mbits) - 1);
  const int e = static_cast<int>(bits >> m.mbits);
  if (e == 0) return std::ldexp(static_cast<float>(mant), 1 - m.bias - m.mbits);
  return std::ldexp(static_cast<float>(mant + (1u << m.mbits)), e - m.bias - m.mbits);
}

// Satfinite encoding of a minifloat with `nbits` total bits; `nan_code` is the magnitude code
// used for NaN (formats without NaN pass the code of max).
inline uint32_t encode_satfinite(float x, const Mini& m, int nbits, uint32_t nan_code) {
  const uint32_t sign = std::signbit(x) ? (1u << (nbits - 1)) : 0u;
  if (std::isnan(x)) return sign | nan_code;
  float a = std::fabs(x);
  if (a >= m.max) return sign | encode_on_grid(m.max, m);
  a = round_to_grid(a, m);
  if (a > m.max) a = m.max;
  return sign | encode_on_grid(a, m);
}

const FormatTraits kTraits[] = {
    {Format::E2M1, "e2m1", 4, 6.f, 0.5f, false, false, true},
    {Format::E1M2, "e1m2", 4, 3.5f, 0.5f, false, false, true},
    {Format::E4M3, "e4m3", 8, 448.f, 0.001953125f, false, true, true},
    {Format::E5M2, "e5m2", 8, 57344.f, 1.52587890625e-05f, true, true, true},
    {Format::UE8M0, "ue8m0", 8, 1.7014118346046923e38f, 0.f, false, true, false},
    {Format::BF16, "bf16", 16, 3.3895313892515355e38f, 9.183549615799121e-41f, true, true, true},
    {Format::F16, "f16", 16, 65504.f, 5.960464477539063e-08f, true, true, true},
    {Format::F32, "f32", 32, std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(), true, true, true},
};

}  // namespace

const FormatTraits& traits(Format f) { return kTraits[static_cast<int>(f)]; }
const char* format_name(Format f) { return traits(f).name; }
Format parse_format(const char* name) {
  for (const auto& t : kTraits)
    if (std::string(name) == t.name) return t.format;
  fail("unknown number format '{}' (expected e2m1, e1m2, e4m3, e5m2, ue8m0, bf16, f16 or f32)", name);
}

uint8_t e2m1_from_f32(float x) { return static_cast<uint8_t>(encode_satfinite(x, kE2M1, 4, 0x7)); }
float e2m1_to_f32(uint8_t c) {
  const float v = decode(c & 0x7, kE2M1);
  return (c & 0x8) ? -v : v;
}
uint8_t e1m2_from_f32(float x) { return static_cast<uint8_t>(encode_satfinite(x, kE1M2, 4, 0x7)); }
float e1m2_to_f32(uint8_t c) {
  const float v = decode(c & 0x7, kE1M2);
  return (c & 0x8) ? -v : v;
}

uint8_t e4m3_from_f32(float x) { return static_cast<uint8_t>(encode_satfinite(x, kE4M3, 8, 0x7F)); }
float e4m3_to_f32(uint8_t c) {
  if ((c & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const float v = decode(c & 0x7F, kE4M3);
  return (c & 0x80) ? -v : v;
}

uint8_t e5m2_from_f32(float x, bool saturate) {
  const uint32_t sign = std::signbit(x) ? 0x80u : 0u;
  if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7F);
  float a = std::fabs(x);
  if (std::isinf(a)) return static_cast<uint8_t>(sign | (saturate ? 0x7B : 0x7C));
  a = round_to_grid(a, kE5M2);
  if (a > kE5M2.max) return static_cast<uint8_t>(sign | (saturate ? 0x7B : 0x7C));
  return static_cast<uint8_t>(sign | encode_on_grid(a, kE5M2));
}
float e5m2_to_f32(uint8_t c) {
  const uint32_t mag = c & 0x7F;
  float v;
  if (mag == 0x7C) v = std::numeric_limits<float>::infinity();
  else if (mag > 0x7C) v = std::numeric_limits<float>::quiet_NaN();
  else v = decode(mag, kE5M2);
  return (c & 0x80) ? -v : v;
}

uint8_t ue8m0_from_f32(float x, bool round_up) {
  if (std::isnan(x) || x < 0.f) return 0xFF;
  if (x == 0.f) return 0;
  if (std::isinf(x)) return 0xFE;
  int k;
  const float f = std::frexp(x, &k);  // x = f * 2^k
  int e = k - 1;                      // floor(log2 x)
  if (round_up && f != 0.5f) e += 1;  // ceil(log2 x) unless x is a power of two
  e += 127;
  if (e < 0) e = 0;
  if (e > 254) e = 254;
  return static_cast<uint8_t>(e);
}
float ue8m0_to_f32(uint8_t c) {
  if (c == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.f, static_cast<int>(c) - 127);
}

uint16_t bf16_from_f32(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_to_f32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t f16_from_f32(float x) {
  const uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7E00);
  float a = std::fabs(x);
  if (std::isinf(a)) return static_cast<uint16_t>(sign | 0x7C00);
  a = round_to_grid(a, kF16);
  if (a > kF16.max) return static_cast<uint16_t>(sign | 0x7C00);
  return static_cast<uint16_t>(sign | encode_on_grid(a, kF16));
}
float f16_to_f32(uint16_t b) {
  const uint32_t mag = b & 0x7FFF;
  float v;
  if (mag == 0x7C00) v = std::numeric_limits<float>::infinity();
  else if (mag > 0x7C00) v = std::numeric_limits<float>::quiet_NaN();
  else v = decode(mag, kF16);
  return (b & 0x8000) ? -v : v;
}

}  // namespace quads::num
