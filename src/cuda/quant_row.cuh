#pragma once
// The NVFP4 row quantizer's steps as device functions, shared by quant.cu's row kernel
// (quantize / fake_quantize) and the W4A4 GEMV that quantizes its activation rows in its prologue
// (w4a4_gemm.cu): both compose these same functions, so the fused GEMV's codes, block scales and
// global amax are quantize()'s bit for bit by construction. Steps, in the order of
// numerics/quantize.h:
//   amax  = max |x| over the row (or the static / per-tensor value): absmax bits of 16-byte
//           vectors, NaN largest, combined with integer max;
//   g     = nv_global(amax)                       (codecs.cuh)
//   block = nv_block_scale(block amax, g)         scale code and encoding factor
//   code  = nv_encode(x, block.enc)               round to nearest even
#include <cstdint>

#include "cuda/codecs.cuh"

namespace quads::cuda::dev {

// 16-byte vectors of float32 (4) or bf16 bits (8).
template <typename T>
struct Vec {
  static constexpr int N = 16 / sizeof(T);
};

template <typename T>
__device__ __forceinline__ float vget(const uint4& r, int i) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  if constexpr (sizeof(T) == 4) {
    return u2f(w[i]);
  } else {
    return u2f((i & 1) ? (w[i >> 1] & 0xFFFF0000u) : (w[i >> 1] << 16));
  }
}
// max |x| of the vector as float bits (NaN largest: its bits exceed inf's)
template <typename T>
__device__ __forceinline__ uint32_t vabsmax(const uint4& r) {
  if constexpr (sizeof(T) == 4) {
    return max(max(r.x & 0x7FFFFFFFu, r.y & 0x7FFFFFFFu), max(r.z & 0x7FFFFFFFu, r.w & 0x7FFFFFFFu));
  } else {
    const uint32_t a = max(max((r.x << 16) & 0x7FFF0000u, (r.y << 16) & 0x7FFF0000u),
                           max((r.z << 16) & 0x7FFF0000u, (r.w << 16) & 0x7FFF0000u));
    const uint32_t b = max(max(r.x & 0x7FFF0000u, r.y & 0x7FFF0000u), max(r.z & 0x7FFF0000u, r.w & 0x7FFF0000u));
    return max(a, b);
  }
}
__device__ __forceinline__ uint32_t vabsmax(const float4& v) {
  return vabsmax<float>(make_uint4(f2u(v.x), f2u(v.y), f2u(v.z), f2u(v.w)));
}

// The scale of one NVFP4 block: E4M3 scale code and the factor its elements are multiplied by
// before rounding to the element grid.
struct NvBlockScale {
  uint32_t sf;
  float enc;
};
__device__ __forceinline__ NvBlockScale nv_block_scale(uint32_t block_amax_bits, const NvGlobal& g) {
  const uint32_t sf = nv_scale_code(u2f(block_amax_bits), g);
  return {sf, nv_encode_factor(sf, g)};
}
// x * enc, the value that is rounded to the 4-bit grid (stochastic rounding starts from it too).
__device__ __forceinline__ float nv_scaled(float x, float enc) { return __fmul_rn(x, enc); }
// The element's 4-bit code, round to nearest even.
template <bool E1M2>
__device__ __forceinline__ uint32_t nv_encode(float x, float enc) {
  const float t = nv_scaled(x, enc);
  return E1M2 ? e1m2_encode(t) : e2m1_encode(t);
}

// One NVFP4 E2M1 block of 16 float32 (four vectors) as quantize() stores it: the 16 codes packed
// two per byte in element order (elements 0..7 in .x, element 0 in the low nibble), and its scale
// code in sf. block_amax_bits: the vabsmax of the four vectors.
__device__ __forceinline__ uint2 nv_quant_block16(const float4 (&v)[4], uint32_t block_amax_bits, const NvGlobal& g,
                                                  uint32_t& sf) {
  const NvBlockScale s = nv_block_scale(block_amax_bits, g);
  sf = s.sf;
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float e[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) w[q >> 1] |= nv_encode<false>(e[j], s.enc) << (4 * ((q & 1) * 4 + j));
  }
  return make_uint2(w[0], w[1]);
}

// The trainer's BF16 weight operand (kern::nvfp4_weight_bf16, WeightOperandSet): eight codes of a
// block (one word, element 0 in the low nibble) as BF16 bits of e2m1(code) * scale, scale the
// block's decoded E4M3 scale: exact (at most 6 significant bits), two elements a word.
__device__ __forceinline__ uint4 nv_operand_bf16x8(uint32_t word, float scale) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = (word >> (8 * j)) & 0xFFu;
    w[j] = bf16_encode(__fmul_rn(e2m1_decode(byte & 15u), scale)) |
           (bf16_encode(__fmul_rn(e2m1_decode(byte >> 4), scale)) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// The global decode factor the W4A4 GEMM's epilogue and the trainer's operand use: amax / 2688
// (6 * 448) as fp32(amax) * fp32(1/2688).
__device__ __forceinline__ float nv_weight_alpha(float amax) { return __fmul_rn(amax, 1.f / 2688.f); }

// RAC's residual of one block, x - X_eff (fake_quantize then kern::sub, element by element), from
// its values, their absmax bits and the activation's global g; returns the residual's absmax bits.
__device__ __forceinline__ uint32_t nv_residual16(const float4 (&x)[4], uint32_t block_amax_bits, const NvGlobal& g,
                                                  float4 (&r)[4]) {
  const NvBlockScale bs = nv_block_scale(block_amax_bits, g);
  const float dq = nv_decode_factor<false>(bs.sf, g.amax);
  auto res = [&](float xv) { return __fsub_rn(xv, __fmul_rn(e2m1_decode(nv_encode<false>(xv, bs.enc)), dq)); };
  uint32_t m = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    r[q] = make_float4(res(x[q].x), res(x[q].y), res(x[q].z), res(x[q].w));
    m = max(m, vabsmax(r[q]));
  }
  return m;
}

// The group of row `row` among `groups` groups of rows (eoff: groups + 1 offsets): the last e with
// eoff[e] <= row (empty groups skipped).
__device__ __forceinline__ int group_of_row(const int32_t* eoff, int groups, int64_t row) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (eoff[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace quads::cuda::dev
