#pragma once
// What the tensor-core GEMMs share (w4a4_gemm.cu, fp8_gemm.cu): cp.async copies global -> shared
// (they hold no register and do not stall the thread; src_bytes = 0 zero-fills), and mma.sync
// m16n8k16 with FP16 operands and FP32 accumulators. Both need sm_80: for an older target they
// compile to nothing, the kernels that use them trap (QUADS_MMA_SM80 unset), and the host refuses
// to launch those kernels. Included by .cu files only.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define QUADS_MMA_SM80 1
#endif

namespace quads::cuda {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
#ifdef QUADS_MMA_SM80
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, int src_bytes) {
#ifdef QUADS_MMA_SM80
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
#ifdef QUADS_MMA_SM80
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef QUADS_MMA_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef QUADS_MMA_SM80
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// d += a . b (16 x 16 FP16 row-major A fragment, 16 x 8 FP16 column-major B fragment, FP32 d).
// QUADS_EXPERIMENT_NOMMA (timing builds only; wrong, finite results): an add that keeps the operands
// live instead of the MMA, so the W4A4 tiles keep their loads and lose their tensor work (and, with
// QUADS_EXPERIMENT_NODEQ, which it implies, their E2M1 decode).
#if defined(QUADS_EXPERIMENT_NOMMA) && !defined(QUADS_EXPERIMENT_NODEQ)
#define QUADS_EXPERIMENT_NODEQ 1
#endif
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(QUADS_EXPERIMENT_NOMMA)
  d[0] += __uint_as_float((a[0] ^ b0) & 0x3C003C00u);
#elif defined(QUADS_MMA_SM80)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Read-only loads whose L2 miss brings in the aligned PF bytes around them (PTX .L2::128B /
// .L2::256B; PF 0: the default). A skinny tile's lane reads 16 of the 64 bytes a weight row has in
// a stage, so with 128 one DRAM access serves two stages and the next finds its bytes in L2 (H200,
// decode batch 16 / 64, nvfp4: +7% / +3% tok/s; 256 is no better; ncu: the grouped gate/up's
// long-scoreboard stalls per instruction 2.75 -> 1.46). volatile: a load of a weight must stay after
// pdl_begin() (an RL step's re-quantization may have written it).
template <int PF>
__device__ __forceinline__ uint4 ldg_pf(const void* p) {
  uint4 v;
  if constexpr (PF == 256)
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (PF == 128)
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    v = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}
template <int PF>
__device__ __forceinline__ uint32_t ldg_pf_u16(const void* p) {
  unsigned short v;
  if constexpr (PF == 256)
    asm volatile("ld.global.nc.L2::256B.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  else if constexpr (PF == 128)
    asm volatile("ld.global.nc.L2::128B.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  else
    v = __ldg(reinterpret_cast<const unsigned short*>(p));
  return v;
}

// Two E4M3 codes (low byte -> low half) as FP16x2: exact, every E4M3 value is an FP16 value.
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// Two E4M3 codes (low byte -> x) as floats, through FP16: exact, dev::e4m3_decode's values (NaN for
// 0x7F / 0xFF) in a conversion instruction instead of its branches.
__device__ __forceinline__ float2 e4m3x2_float2(uint32_t two) {
  const __half2 h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  return __half22float2(h);
}

// The W4A4 tiles' E2M1 -> FP16 dequantization (w4a4_gemm.cu's header has the numerics).
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// The high bytes of E2M1 codes as FP16 * 2^-14: sign at bit 7, the three magnitude bits (e1 e0 m)
// at bits 1..3 (bit 9 is the top mantissa bit, bits 10..11 the low exponent bits: FP16's subnormals
// are E2M1's). hb_lo: the low nibble of each byte of w, hb_hi: the high nibble.
__device__ __forceinline__ uint32_t hb_lo(uint32_t w) { return ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ uint32_t hb_hi(uint32_t w) { return ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u); }
// Two E4M3 scales (low byte: block 2t) as FP16 * 2^7.
__device__ __forceinline__ uint32_t scales_f16x2(uint32_t two_bytes) {
  return hmul2(e4m3x2_f16x2(two_bytes), 0x58005800u);  // * 128
}
__device__ __forceinline__ uint32_t lo2(uint32_t v) { return __byte_perm(v, 0, 0x1010); }
__device__ __forceinline__ uint32_t hi2(uint32_t v) { return __byte_perm(v, 0, 0x3232); }

// Dequantized pair from word w: nibbles S / 4 and S / 4 + 4 (S = 0, 4, 8, 12), as FP16 in the low
// and high halves, times the scale pair. A word's four pairs share its two hb words (7 integer
// instructions), then a byte permute each places two codes' bytes over zero low bytes: 15
// instructions a word with the four scale multiplies, where shifting each pair into place and
// moving its sign bits took 20 (the same bits: every 32-bit word checked). H200, nvfp4 decode
// tok/s at batch 16 / 64 14190 / 36032 -> 14633 / 36745, prefill 93.5k -> 98.3k tok/s.
// QUADS_EXPERIMENT_NODEQ (timing builds only; wrong results): the codes' bits masked into finite
// FP16 values instead of dequantized, one instruction a word for all four pairs: what the W4A4
// kernels would run at if E2M1 cost nothing to decode, as on a GPU with FP4 tensor cores.
template <int S>
__device__ __forceinline__ uint32_t deq(uint32_t w, uint32_t sc) {
#ifdef QUADS_EXPERIMENT_NODEQ
  return w & 0x3C003C00u;
#else
  const uint32_t hb = (S & 4) ? hb_hi(w) : hb_lo(w);
  return hmul2(__byte_perm(hb, 0u, (S & 8) ? 0x3414u : 0x2404u), sc);
#endif
}

// X's rows as the skinny W4A4 tiles' FP16 operand (w4a4_skinny.cuh), in chunks of 16 rows (chunk
// after chunk, ceil(K / 128) * 256 entries each); in a chunk, uint4
// entry ((s * 4 + hw) * 2 + nt) * 32 + g * 4 + qt holds word hw (elements 8 hw .. 8 hw + 7 of the
// 32 that blocks 2 qt, 2 qt + 1 of the 128-wide K stage s cover) of row 8 nt + g, dequantized and
// times its block scale in the MMA's k-slot order (deq<0, 4, 8, 12>): the values the tiles stage
// from the codes, 4 KB a stage (x_frag_bytes in gemm.h). A producer that writes the codes can write
// these too (the norms' RowNvfp4::frag, w4a4_x_frag), and a dense tile then copies X instead of
// staging and dequantizing it.
__device__ __forceinline__ uint4 x_frag_word(uint32_t w, uint32_t scale_byte) {
  const uint32_t f = lo2(scales_f16x2(scale_byte));
  return make_uint4(deq<0>(w, f), deq<4>(w, f), deq<8>(w, f), deq<12>(w, f));
}
// Block b (16 elements: codes c, E4M3 scale byte sf) of row r of X, whose rows have nb blocks.
__device__ __forceinline__ void x_frag_store(uint4* frag, int r, int64_t b, uint2 c, uint32_t sf, int64_t nb) {
  frag += static_cast<int64_t>(r >> 4) * ((nb + 7) / 8) * 256;
  const int j = static_cast<int>(b & 7), qt = j >> 1, hw = 2 * (j & 1), nt = (r >> 3) & 1, g = r & 7;
  uint4* d = frag + (((b >> 3) * 4 + hw) * 2 + nt) * 32 + g * 4 + qt;
  d[0] = x_frag_word(c.x, sf);
  d[2 * 32] = x_frag_word(c.y, sf);  // word hw + 1
}

}  // namespace quads::cuda
