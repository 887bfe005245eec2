#pragma once
// Scalar number formats: bit-exact codecs and a traits table (one row per format, as in ggml).
// Conversions from float32 round to nearest, ties to even; formats without infinities saturate
// to their largest finite value ("satfinite"). NaN inputs map to the format's NaN where it has
// one, otherwise to the saturated value with the input's sign (documented per function).
#include <cstdint>

namespace quads::num {

enum class Format : uint8_t {
  E2M1,   // FP4: 1 sign, 2 exponent, 1 mantissa bits; values 0, .5, 1, 1.5, 2, 3, 4, 6. No inf/NaN.
  E1M2,   // 4-bit: 1 sign, 1 exponent, 2 mantissa; values 0..3.5 step .5 (ReQAT's KV-cache grid).
  E4M3,   // FP8 "fn": max 448, no inf, NaN = 0x7F/0xFF.
  E5M2,   // FP8: max 57344, IEEE-like inf/NaN.
  UE8M0,  // unsigned 8-bit exponent (MX scales): 2^(e-127), 0xFF = NaN.
  BF16,   // bfloat16.
  F16,    // IEEE half (checkpoint I/O only).
  F32,
};

struct FormatTraits {
  Format format;
  const char* name;
  int bits;
  float max_finite;      // largest finite magnitude
  float min_subnormal;   // smallest positive value (0 for UE8M0: smallest is 2^-127)
  bool has_inf;
  bool has_nan;
  bool is_signed;
};

const FormatTraits& traits(Format f);
const char* format_name(Format f);
Format parse_format(const char* name);  // throws quads::Error on an unknown name

// 4-bit codes: bit 3 is the sign, bits 0..2 the magnitude index. Round to nearest even,
// saturate at ±6 (E2M1) / ±3.5 (E1M2); NaN encodes as the max magnitude with NaN's sign bit
// (these grids have no NaN).
uint8_t e2m1_from_f32(float x);
float e2m1_to_f32(uint8_t code);
uint8_t e1m2_from_f32(float x);
float e1m2_to_f32(uint8_t code);

// E4M3 (fn), satfinite: |x| > 448 gives ±448, NaN gives 0x7F (sign kept: 0xFF for -NaN).
uint8_t e4m3_from_f32(float x);
float e4m3_to_f32(uint8_t code);

// E5M2: saturate=true clamps finite overflow to ±57344 (as quantizers do); false gives ±inf.
uint8_t e5m2_from_f32(float x, bool saturate = true);
float e5m2_to_f32(uint8_t code);

// UE8M0: the power of two 2^(code-127). from_f32 rounds the exponent as the MX spec's scale
// computation needs: floor(log2(x)) (round_up=false) or ceil(log2(x)) (round_up=true), for x>0.
uint8_t ue8m0_from_f32(float x, bool round_up = false);
float ue8m0_to_f32(uint8_t code);

// BF16, round to nearest even; NaN stays NaN (quiet).
uint16_t bf16_from_f32(float x);
float bf16_to_f32(uint16_t bits);
inline float bf16_round(float x) { return bf16_to_f32(bf16_from_f32(x)); }

// IEEE half, round to nearest even, overflow to inf (checkpoint I/O).
uint16_t f16_from_f32(float x);
float f16_to_f32(uint16_t bits);

}  // namespace quads::num
