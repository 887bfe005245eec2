#pragma once
// Device codecs, bit-identical to the reference codecs in numerics/formats.cpp (and to the fast
// ones in numerics/kernels.h, whose integer methods they share). Every float operation that
// feeds a rounding is written with an explicit _rn intrinsic so that nvcc cannot fuse a multiply
// and an add behind our back (the CPU build uses -ffp-contract=off).
#include <cfloat>
#include <cstdint>

namespace quads::cuda::dev {

__device__ __forceinline__ uint32_t f2u(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float u2f(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ float nan_f() { return u2f(0x7FFFFFFFu); }

// BF16 bits of x, round to nearest even, NaN quieted (num::bf16_from_f32).
__device__ __forceinline__ uint32_t bf16_encode(float x) {
  uint32_t u = f2u(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return u >> 16;
}

// E4M3 (fn), satfinite, round to nearest even; NaN keeps its sign (0x7F / 0xFF).
__device__ __forceinline__ uint32_t e4m3_encode(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;
  if (a >= 0x43E00000u) return sign | 0x7Eu;  // >= 448 (and inf)
  if (a < 0x3C800000u) {                      // < 2^-6: uniform grid of step 2^-9
    const float s = __fmaf_rn(u2f(a), 512.f, 8388608.f);  // a * 2^9 is exact: one rounding
    return sign | (f2u(s) - 0x4B000000u);
  }
  const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  return sign | (r - 960u);  // rebias 127 -> 7
}
__device__ __forceinline__ float e4m3_decode(uint32_t c) {
  const uint32_t mag = c & 0x7Fu;
  float v;
  if (mag == 0x7Fu) v = nan_f();
  else if (mag < 8u) v = __fmul_rn(static_cast<float>(mag), 0.001953125f);
  else v = u2f((((mag >> 3) + 120u) << 23) | ((mag & 7u) << 20));
  return (c & 0x80u) ? -v : v;
}

// E5M2 satfinite (the quantizers' saturate=true), round to nearest even.
__device__ __forceinline__ uint32_t e5m2_encode_sat(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;
  if (a >= 0x47600000u) return sign | 0x7Bu;  // >= 57344 (and inf)
  if (a < 0x38800000u) {                      // < 2^-14: step 2^-16
    const float s = __fmaf_rn(u2f(a), 65536.f, 8388608.f);
    return sign | (f2u(s) - 0x4B000000u);
  }
  const uint32_t r = (a + 0xFFFFFu + ((a >> 21) & 1u)) >> 21;
  return sign | (r - 448u);  // rebias 127 -> 15
}
__device__ __forceinline__ float e5m2_decode(uint32_t c) {
  const uint32_t mag = c & 0x7Fu;
  float v;
  if (mag == 0x7Cu) v = u2f(0x7F800000u);
  else if (mag > 0x7Cu) v = nan_f();
  else if (mag < 4u) v = __fmul_rn(static_cast<float>(mag), 1.52587890625e-05f);
  else v = u2f((((mag >> 2) + 112u) << 23) | ((mag & 3u) << 21));
  return (c & 0x80u) ? -v : v;
}

// UE8M0: 2^(c-127); 0xFF is NaN. c = 0 is the subnormal 2^-127.
__device__ __forceinline__ float ue8m0_decode(uint32_t c) {
  if (c == 0xFFu) return nan_f();
  if (c == 0u) return u2f(0x00400000u);
  return u2f(c << 23);
}
// ue8m0_from_f32(x, round_up=true) for finite x >= 0: ceil(log2 x) + 127, clamped to [0, 254].
__device__ __forceinline__ uint32_t ue8m0_ceil(float x) {
  const uint32_t u = f2u(x);
  if (u == 0u) return 0u;
  const uint32_t e = u >> 23, m = u & 0x7FFFFFu;
  if (e == 0u) return m > 0x400000u ? 1u : 0u;  // subnormal: ceil(log2 x) is -126 or below
  const uint32_t c = e + (m != 0u ? 1u : 0u);
  return c > 254u ? 254u : c;
}

// 4-bit element grids. Code: bit 3 sign, bits 0-2 magnitude index; round to nearest even,
// saturate; NaN gives the max code with NaN's sign.
// E2M1 {0,.5,1,1.5,2,3,4,6}: below 1 the grid is .5 apart (rint(2a)); from 1 up it is a float
// with one mantissa bit, rounded by an integer add on the float32 bits.
__device__ __forceinline__ uint32_t e2m1_encode(float v) {
  const uint32_t u = f2u(v);
  const float a = fminf(u2f(u & 0x7FFFFFFFu), 6.f);  // fminf(NaN, 6) = 6
  const uint32_t lo = f2u(__fmaf_rn(a, 2.f, 8388608.f)) - 0x4B000000u;
  const uint32_t b = f2u(a);
  const uint32_t hi = (b + 0x1FFFFFu + ((b >> 22) & 1u) - 0x3F000000u) >> 22;
  return (a < 1.f ? lo : hi) | ((u >> 28) & 8u);
}
// E1M2 {0,.5,...,3.5}: uniform, rint(2a).
__device__ __forceinline__ uint32_t e1m2_encode(float v) {
  const uint32_t u = f2u(v);
  const float a = fminf(u2f(u & 0x7FFFFFFFu), 3.5f);
  return (f2u(__fmaf_rn(a, 2.f, 8388608.f)) - 0x4B000000u) | ((u >> 28) & 8u);
}
__device__ __forceinline__ float e2m1_decode(uint32_t c) {
  const uint32_t m = c & 7u;
  // 0, .5 then 2^(e-1) * (1 + m0/2): exponent field (m>>1)+126, mantissa bit m&1.
  const float v = m < 2u ? 0.5f * static_cast<float>(m) : u2f(((m >> 1) + 126u) << 23 | (m & 1u) << 22);
  return (c & 8u) ? -v : v;
}
__device__ __forceinline__ float e1m2_decode(uint32_t c) {
  const float v = 0.5f * static_cast<float>(c & 7u);
  return (c & 8u) ? -v : v;
}

// Stochastic rounding stream (numerics/kernels.h: sr_uniform): SplitMix64 of (seed, index).
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float sr_uniform(uint64_t seed, uint64_t index) {
  const uint64_t h = mix64(mix64(seed ^ 0x5851F42D4C957F2Dull) + (index + 1) * 0x9E3779B97F4A7C15ull);
  return __fmul_rn(static_cast<float>(h >> 40), 5.9604644775390625e-08f);  // k * 2^-24
}
// grid4_encode_sr: |v| between neighbours lo <= |v| < hi rounds up with probability
// (|v| - lo) / (hi - lo); |v| >= max (and NaN) saturates.
template <bool E1M2>
__device__ __forceinline__ uint32_t grid4_encode_sr(float v, float u) {
  const uint32_t ub = f2u(v);
  const uint32_t sign = (ub >> 28) & 8u;
  const float a = u2f(ub & 0x7FFFFFFFu);
  const float gmax = E1M2 ? 3.5f : 6.f;
  if (!(a < gmax)) return 7u | sign;
  uint32_t k = 0;
  float lo = 0.f, hi = 0.5f;
  for (uint32_t c = 1; c < 7; ++c) {
    const float g = E1M2 ? e1m2_decode(c) : e2m1_decode(c);
    if (g <= a) { k = c; lo = g; }
  }
  hi = E1M2 ? e1m2_decode(k + 1) : e2m1_decode(k + 1);
  const float p = __fdiv_rn(__fsub_rn(a, lo), __fsub_rn(hi, lo));
  return (k + (u < p ? 1u : 0u)) | sign;
}

// NVFP4 second-level scale from the global amax (the reference's order of operations):
// S_enc = 448*G / amax, clamped to FLT_MAX (NaN stays NaN), 1 when amax or S_enc is 0.
struct NvGlobal {
  float amax, s_enc, s_enc_div_g, s_dec;
};
template <bool E1M2>
__device__ __forceinline__ NvGlobal nv_global(float amax) {
  constexpr float G = E1M2 ? 3.5f : 6.f;
  float s_enc = __fdiv_rn(448.f * G, amax);
  if (s_enc > FLT_MAX) s_enc = FLT_MAX;
  if (amax == 0.f || s_enc == 0.f) s_enc = 1.f;
  return {amax, s_enc, __fmul_rn(s_enc, 1.f / G), __fdiv_rn(1.f, s_enc)};
}
// Block scale code for a block amax; the element encoding factor; the dequantization factor.
__device__ __forceinline__ uint32_t nv_scale_code(float bamax, const NvGlobal& g) {
  return e4m3_encode(__fmul_rn(bamax, g.s_enc_div_g));
}
__device__ __forceinline__ float nv_encode_factor(uint32_t sf, const NvGlobal& g) {
  float enc = __fdiv_rn(1.f, __fmul_rn(e4m3_decode(sf), g.s_dec));
  if (enc > FLT_MAX) enc = FLT_MAX;
  return enc;
}
template <bool E1M2>
__device__ __forceinline__ float nv_decode_factor(uint32_t sf, float amax) {
  constexpr float G = E1M2 ? 3.5f : 6.f;
  return __fmul_rn(__fmul_rn(e4m3_decode(sf), amax), 1.f / (448.f * G));
}

// MXFP4 scale code for a block amax (the reference's two rules).
__device__ __forceinline__ uint32_t mx_scale_code(float amax, bool te_ceil) {
  const uint32_t u = f2u(amax);
  if (u >= 0x7F800000u) return 0xFFu;  // inf or NaN (amax is non-negative)
  if (te_ceil) return ue8m0_ceil(__fmul_rn(amax, 1.f / 6.f));
  const uint32_t e = u >> 23;  // floor(log2 amax) + 127 for normals; subnormals clamp to 0
  return e > 2u ? e - 2u : 0u;
}

// Offset of scale (r, b) in the 128x4 swizzled layout with kt = ceil(nblocks / 4).
__device__ __forceinline__ int64_t swizzle_offset(int64_t r, int64_t b, int64_t kt) {
  return ((r >> 7) * kt + (b >> 2)) * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + (b & 3);
}

}  // namespace quads::cuda::dev
