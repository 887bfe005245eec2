// Emulated W4A4 NVFP4 GEMM on FP16 tensor cores (see gemm.h for the numerics).
//
// Tiles: a CTA computes BM x BN outputs, warps WM x WN each; K advances 128 elements (8 scale
// blocks, 64 bytes of codes per row) per pipeline stage, copied global -> shared with cp.async,
// STAGES deep. Each thread of a quad (t = lane % 4) owns the two blocks 2t, 2t+1 of a stage for its
// rows: a 32-bit word of codes is 8 elements. The MMA's K slots are filled from those words in an
// order of our choosing (the sum over K does not care), the same for both operands:
//   slot pair (2t, 2t+1)   <- nibbles (0, 4) of word >> 8j,   slot pair (2t+8, 2t+9) <- (1, 5) ...
// so a thread never needs data of another thread. Nibble -> FP16: sign to bit 15, magnitude bits
// to 9..11 gives value * 2^-14 (the E2M1 subnormal 0.5 lands on the FP16 subnormal 2^-15); one
// FP16 multiply by (E4M3 scale * 2^7) then gives code * scale * 2^-7 exactly: magnitudes
// 2^-17 .. 21, multiples of 2^-17, all exact in FP16. The epilogue multiplies by 2^14 and the
// global decode scales amax/2688 of both operands.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/codecs.cuh"
#include "cuda/gemm.h"
#include "cuda/mma_util.cuh"
#include "cuda/pdl.cuh"

namespace quads::cuda {

namespace {

constexpr int kBK = 128;  // K elements per stage

struct Params {
  const uint8_t* xq;
  const uint8_t* xs;
  const float* xamax;
  int xamax_row;
  const uint8_t* wq;
  const uint8_t* ws;
  const float* wamax;
  int wamax_row;
  const int32_t* blk;  // gather: W block per K block of X (grouped: groups rows of blk_stride)
  int64_t blk_stride;
  int64_t M, N, K;     // K: X's columns
  int64_t Kw;          // W's columns
  float* y;
  int64_t ldy;         // y's row stride (>= N)
  int accumulate;
  float* partial;      // split K: [splits, M, N] raw sums
  int kb_per_split;    // stages per split
  // grouped: expert blockIdx.z owns rows eoff[e] .. eoff[e+1] of X and y, its weight is wtab[e]
  const int32_t* eoff;
  const Nvfp4Weight* wtab;
  int gsplits;   // grouped: K splits per expert (blockIdx.z = expert * gsplits + split)
  int64_t Mtot;  // grouped: rows of X and y (the partials' row count)
  int groups;    // grouped GEMV: entries of wtab (eoff has groups + 1)
};

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// Nibbles 0 and 4 of x as FP16 (value * 2^-14) in the low and high halves.
__device__ __forceinline__ uint32_t fp4x2_raw(uint32_t x) {
  const uint32_t y = x & 0x1E001E00u;  // x is pre-shifted: nibble bits at 9..12 and 25..28
  return y + (y & 0x10001000u) * 7u;   // sign bit 12 -> 15 (0x1000 + 0x7000 = 0x8000)
}
// Two E4M3 scales (low byte: block 2t) as FP16 * 2^7.
__device__ __forceinline__ uint32_t scales_f16x2(uint32_t two_bytes) {
  return hmul2(e4m3x2_f16x2(two_bytes), 0x58005800u);  // * 128
}
__device__ __forceinline__ uint32_t lo2(uint32_t v) { return __byte_perm(v, 0, 0x1010); }
__device__ __forceinline__ uint32_t hi2(uint32_t v) { return __byte_perm(v, 0, 0x3232); }


// Dequantized pair from word w at nibble shift s (0, 4, 8, 12), times the scale pair.
template <int S>
__device__ __forceinline__ uint32_t deq(uint32_t w, uint32_t sc) {
  const uint32_t x = S <= 9 ? (w << (9 - S)) : (w >> (S - 9));
  return hmul2(fp4x2_raw(x), sc);
}

template <int BM, int BN, bool GATHER>
struct Smem {
  static constexpr int A = BM * 64, B = BN * 64, AS = BM * 8, BS = GATHER ? BN * 32 : BN * 8;
  static constexpr int STAGE = A + B + AS + BS;
};

template <int BM, int BN, int WM, int WN, int STAGES, bool GATHER, bool GROUPED>
__global__ void __launch_bounds__(32 * (BM / WM) * (BN / WN))
w4a4_kernel(const Params p) {
  pdl_begin();
  constexpr int NWN = BN / WN;
  constexpr int NT = 32 * (BM / WM) * NWN;
  constexpr int MT = WM / 16, NTL = WN / 8;
  using SM = Smem<BM, BN, GATHER>;
  extern __shared__ __align__(16) uint8_t smem[];
#ifndef QUADS_MMA_SM80
  __trap();
#endif

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / NWN, wn = warp % NWN;
  int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM, mend = p.M;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int64_t kb_total = (p.K + kBK - 1) / kBK;
  int64_t kb0 = static_cast<int64_t>(blockIdx.z) * p.kb_per_split;
  const uint8_t* wq = p.wq;
  const uint8_t* ws = p.ws;
  const float* wamax = p.wamax;
  const int32_t* blk = p.blk;
  if constexpr (GROUPED) {
    // The grid covers the largest possible group; tiles past this expert's rows leave at once
    // (uniformly for the whole CTA, before any barrier).
    const int e = blockIdx.z / p.gsplits;
    const int64_t mb = p.eoff[e];
    mend = p.eoff[e + 1];
    m0 += mb;
    if (m0 >= mend) return;
    wq = p.wtab[e].codes;
    ws = p.wtab[e].scales;
    wamax = p.wtab[e].amax;
    if constexpr (GATHER) blk += e * p.blk_stride;
    kb0 = static_cast<int64_t>(blockIdx.z % p.gsplits) * p.kb_per_split;
  }
  const int64_t zsplit = GROUPED ? blockIdx.z % p.gsplits : blockIdx.z;
  const int64_t prows = GROUPED ? p.Mtot : p.M;
  const int64_t kb1 = min(kb_total, kb0 + p.kb_per_split);
  const int nkb = kb1 > kb0 ? static_cast<int>(kb1 - kb0) : 0;
  const int64_t xrow = p.K / 2, xsrow = p.K / 16, wrow = p.Kw / 2, wsrow = p.Kw / 16;
  const int64_t kblocks = p.K / 16;

  auto load_stage = [&](int slot, int64_t kb) {
    uint8_t* sa = smem + slot * SM::STAGE;
    uint8_t* sb = sa + SM::A;
    uint8_t* sas = sb + SM::B;
    uint8_t* sbs = sas + SM::AS;
    const int64_t k0 = kb * kBK;
    for (int c = tid; c < BM * 4; c += NT) {
      const int r = c >> 2, part = c & 3;
      const int64_t gr = m0 + r, kc = k0 + part * 32;
      const bool ok = gr < mend && kc < p.K;
      cp_async16(sa + r * 64 + part * 16, p.xq + (ok ? gr * xrow + kc / 2 : 0), ok ? 16 : 0);
    }
    for (int c = tid; c < BM * 2; c += NT) {
      const int r = c >> 1, h = c & 1;
      const int64_t gr = m0 + r, kc = k0 + h * 64;
      const bool ok = gr < mend && kc < p.K;
      cp_async4(sas + r * 8 + h * 4, p.xs + (ok ? gr * xsrow + kc / 16 : 0), ok ? 4 : 0);
    }
    if constexpr (!GATHER) {
      for (int c = tid; c < BN * 4; c += NT) {
        const int r = c >> 2, part = c & 3;
        const int64_t gn = n0 + r, kc = k0 + part * 32;
        const bool ok = gn < p.N && kc < p.K;
        cp_async16(sb + r * 64 + part * 16, wq + (ok ? gn * wrow + kc / 2 : 0), ok ? 16 : 0);
      }
      for (int c = tid; c < BN * 2; c += NT) {
        const int r = c >> 1, h = c & 1;
        const int64_t gn = n0 + r, kc = k0 + h * 64;
        const bool ok = gn < p.N && kc < p.K;
        cp_async4(sbs + r * 8 + h * 4, ws + (ok ? gn * wsrow + kc / 16 : 0), ok ? 4 : 0);
      }
    } else {
      for (int c = tid; c < BN * 8; c += NT) {
        const int r = c >> 3, b = c & 7;
        const int64_t gn = n0 + r, kblk = kb * 8 + b;
        const bool ok = gn < p.N && kblk < kblocks;
        const int64_t src = ok ? blk[kblk] : 0;
        cp_async8(sb + r * 64 + b * 8, wq + (ok ? gn * wrow + src * 8 : 0), ok ? 8 : 0);
        cp_async4(sbs + (r * 8 + b) * 4, ws + (ok ? gn * wsrow + (src & ~int64_t(3)) : 0), ok ? 4 : 0);
      }
    }
  };

  float acc[MT][NTL][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NTL; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nkb) load_stage(s, kb0 + s);
    cp_async_commit();
  }

  for (int it = 0; it < nkb; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nx = it + STAGES - 1;
      if (nx < nkb) load_stage(nx % STAGES, kb0 + nx);
      cp_async_commit();
    }
    const uint8_t* sa = smem + (it % STAGES) * SM::STAGE;
    const uint8_t* sb = sa + SM::A;
    const uint8_t* sas = sb + SM::B;
    const uint8_t* sbs = sas + SM::AS;

    // scale pairs (blocks 2t, 2t+1) of this thread's rows, FP16 * 2^7
    uint32_t asc[MT][2], bsc[NTL];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * WM + i * 16 + g + 8 * h;
        asc[i][h] = scales_f16x2(*reinterpret_cast<const uint16_t*>(sas + r * 8 + 2 * t));
      }
    int sh0 = 0, sh1 = 0;  // gather: the scale byte sits at (block index & 3) in its 4-byte word
    if constexpr (GATHER) {
      const int64_t kblk = (kb0 + it) * 8 + 2 * t;
      sh0 = kblk < kblocks ? 8 * (__ldg(blk + kblk) & 3) : 0;
      sh1 = kblk + 1 < kblocks ? 8 * (__ldg(blk + kblk + 1) & 3) : 0;
    }
#pragma unroll
    for (int j = 0; j < NTL; ++j) {
      const int r = wn * WN + j * 8 + g;
      uint32_t two;
      if constexpr (!GATHER) {
        two = *reinterpret_cast<const uint16_t*>(sbs + r * 8 + 2 * t);
      } else {
        const uint32_t w0 = *reinterpret_cast<const uint32_t*>(sbs + (r * 8 + 2 * t) * 4);
        const uint32_t w1 = *reinterpret_cast<const uint32_t*>(sbs + (r * 8 + 2 * t + 1) * 4);
        two = ((w0 >> sh0) & 0xFFu) | (((w1 >> sh1) & 0xFFu) << 8);
      }
      bsc[j] = scales_f16x2(two);
    }

#pragma unroll
    for (int hw = 0; hw < 4; ++hw) {  // block 2t + h, its word wd (elements 8wd .. 8wd+7)
      {
        const int h = hw >> 1;
        const int off = t * 16 + hw * 4;
        uint32_t aw[MT][2], bw[NTL];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr)
            aw[i][hr] = *reinterpret_cast<const uint32_t*>(sa + (wm * WM + i * 16 + g + 8 * hr) * 64 + off);
#pragma unroll
        for (int j = 0; j < NTL; ++j)
          bw[j] = *reinterpret_cast<const uint32_t*>(sb + (wn * WN + j * 8 + g) * 64 + off);

#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {  // two MMA k-steps per word
          uint32_t af[MT][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            const uint32_t s0 = h ? hi2(asc[i][0]) : lo2(asc[i][0]);
            const uint32_t s1 = h ? hi2(asc[i][1]) : lo2(asc[i][1]);
            if (ks == 0) {
              af[i][0] = deq<0>(aw[i][0], s0);
              af[i][1] = deq<0>(aw[i][1], s1);
              af[i][2] = deq<4>(aw[i][0], s0);
              af[i][3] = deq<4>(aw[i][1], s1);
            } else {
              af[i][0] = deq<8>(aw[i][0], s0);
              af[i][1] = deq<8>(aw[i][1], s1);
              af[i][2] = deq<12>(aw[i][0], s0);
              af[i][3] = deq<12>(aw[i][1], s1);
            }
          }
#pragma unroll
          for (int j = 0; j < NTL; ++j) {
            const uint32_t sc = h ? hi2(bsc[j]) : lo2(bsc[j]);
            const uint32_t b0 = ks == 0 ? deq<0>(bw[j], sc) : deq<8>(bw[j], sc);
            const uint32_t b1 = ks == 0 ? deq<4>(bw[j], sc) : deq<12>(bw[j], sc);
#pragma unroll
            for (int i = 0; i < MT; ++i) mma16816(acc[i][j], af[i], b0, b1);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // epilogue
  const float kInv = 1.f / 2688.f;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t row = m0 + wm * WM + i * 16 + g + 8 * hr;
      if (row >= mend) continue;
      const float rf = p.partial ? 0.f : p.xamax[p.xamax_row ? row : 0] * kInv * 16384.f;
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int64_t col = n0 + wn * WN + j * 8 + 2 * t + c;
          if (col >= p.N) continue;
          const float v = acc[i][j][2 * hr + c];
          if (p.partial) {
            p.partial[(zsplit * prows + row) * p.N + col] = v;
          } else {
            const float out = v * rf * (wamax[p.wamax_row ? col : 0] * kInv);
            float* dst = p.y + row * p.ldy + col;
            *dst = p.accumulate ? *dst + out : out;
          }
        }
    }
}

// Sums the split-K partials in split order and applies the epilogue. Grouped (groups > 0): every
// row belongs to one expert (rows eoff[e] .. eoff[e+1]) whose weight amax lives in wtab[e] (p.wamax
// is unset); the expert of a row is found by binary search over eoff.
__global__ void splitk_reduce_kernel(const Params p, int splits, int groups) {
  pdl_begin();
  const int64_t n = (groups > 0 ? p.Mtot : p.M) * p.N;
  const float kInv = 1.f / 2688.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int z = 0; z < splits; ++z) s += p.partial[z * n + i];
    const int64_t row = i / p.N, col = i % p.N;
    const float* wamax = p.wamax;
    if (groups > 0) {
      int lo = 0, hi = groups - 1;  // the last e with eoff[e] <= row
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p.eoff[mid] <= row) lo = mid;
        else hi = mid - 1;
      }
      wamax = p.wtab[lo].amax;
    }
    const float out = s * (p.xamax[p.xamax_row ? row : 0] * kInv * 16384.f) * (wamax[p.wamax_row ? col : 0] * kInv);
    float* dst = p.y + row * p.ldy + col;
    *dst = p.accumulate ? *dst + out : out;
  }
}

// ---- GEMV (decode: a few rows per weight) ----
// A CTA of kGemvWarps warps owns kGemvWarps * NW consecutive weight rows (NW per warp). Lane l
// reads, per step of 1024 elements, the 32 elements 1024 s + 32 l .. +31 of each of its warp's
// rows: one 16-byte load of codes (gather: two 8-byte loads of the listed blocks) and the two
// block scales. X's rows are decoded once per CTA (R rows at a time) into shared memory as int8
// (twice the E2M1 value) plus float block scales; the int8 of block b sits at
// (b / 64) * 1024 + (b % 2) * 512 + ((b / 2) % 32) * 16 in its row, so that the 16-byte reads of a
// warp's lanes are consecutive (no bank conflicts).
constexpr int kGemvWarps = 8;

// Four E2M1 codes (nibbles 0..3 of `nib`) as int8 of twice their value {0,1,2,3,4,6,8,12}, negated
// where bit 3 is set: two table lookups (byte_perm over 8-byte tables, positive and negative),
// then a per-byte choice by the sign bits.
__device__ __forceinline__ uint32_t e2m1x4_to_s8(uint32_t nib) {
  const uint32_t idx = nib & 0x7777u;
  const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, idx);
  const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, idx);
  return __byte_perm(pos, neg, 0x3210u | ((nib & 0x8888u) >> 1));
}
// The 32 elements of a 16-byte code load as int8: block 0 in lo (elements 0..15), block 1 in hi.
__device__ __forceinline__ void e2m1x32_to_s8(const uint4 c, uint4& lo, uint4& hi) {
  lo = make_uint4(e2m1x4_to_s8(c.x), e2m1x4_to_s8(c.x >> 16), e2m1x4_to_s8(c.y), e2m1x4_to_s8(c.y >> 16));
  hi = make_uint4(e2m1x4_to_s8(c.z), e2m1x4_to_s8(c.z >> 16), e2m1x4_to_s8(c.w), e2m1x4_to_s8(c.w >> 16));
}
__device__ __forceinline__ int dot16(const uint4 a, const uint4 b) {
  int d = __dp4a(static_cast<int>(a.x), static_cast<int>(b.x), 0);
  d = __dp4a(static_cast<int>(a.y), static_cast<int>(b.y), d);
  d = __dp4a(static_cast<int>(a.z), static_cast<int>(b.z), d);
  return __dp4a(static_cast<int>(a.w), static_cast<int>(b.w), d);
}
__host__ __device__ constexpr int64_t gemv_kpad(int64_t k) { return (k + 1023) / 1024 * 1024; }
// Shared memory of R decoded X rows: int8 [R, kpad] then float scales [R, k / 16].
__host__ __device__ constexpr int64_t gemv_smem(int R, int64_t k) { return R * (gemv_kpad(k) + k / 4); }

template <int R, int NW, bool GATHER, bool GROUPED>
__global__ void __launch_bounds__(32 * kGemvWarps, NW == 4 ? 2 : 3) w4a4_gemv_kernel(const Params p) {
  pdl_begin();
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t K = p.K, nb = K / 16, kpad = gemv_kpad(K);
  uint8_t* sx = smem;
  float* sxs = reinterpret_cast<float*>(smem + R * kpad);
  const int64_t wrow = p.Kw / 2, wsrow = p.Kw / 16;

  int64_t row0 = 0, rows = p.M;  // this CTA's rows of X and y
  const uint8_t* wq = p.wq;
  const uint8_t* ws = p.ws;
  const float* wamax = p.wamax;
  const int32_t* blk = p.blk;
  if constexpr (GROUPED) {
    // CTA row j of the grid takes the j-th non-empty group (every warp finds the same one, so the
    // exit is uniform for the CTA, before any barrier).
    const int j = blockIdx.y;
    int e = -1, seen = 0;
    for (int base = 0; base < p.groups && e < 0; base += 32) {
      const int g = base + lane;
      const bool ne = g < p.groups && p.eoff[g + 1] > p.eoff[g];
      uint32_t m = __ballot_sync(0xFFFFFFFFu, ne);
      const int c = __popc(m);
      if (j < seen + c) {
        for (int i = 0; i < j - seen; ++i) m &= m - 1;
        e = base + __ffs(m) - 1;
      }
      seen += c;
    }
    if (e < 0) return;
    row0 = p.eoff[e];
    rows = p.eoff[e + 1] - row0;
    wq = p.wtab[e].codes;
    ws = p.wtab[e].scales;
    wamax = p.wtab[e].amax;
    if constexpr (GATHER) blk += e * p.blk_stride;
  }
  const int64_t nbase = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp) * NW;
  const int64_t nsteps = (nb + 63) / 64;

  // Raw codes (gather: block 0 in x, y and block 1 in z, w) and the two scale bytes of step s.
  auto load = [&](int64_t s, uint4 (&c)[NW], uint32_t (&sc)[NW]) {
    const int64_t b0 = s * 64 + 2 * lane;
    const bool act = s < nsteps && b0 < nb;  // nb is a multiple of 4: block b0 + 1 exists too
    int64_t g0 = b0, g1 = b0 + 1;
    if constexpr (GATHER) {
      if (act) {
        g0 = __ldg(blk + b0);
        g1 = __ldg(blk + b0 + 1);
      }
    }
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      const int64_t n = nbase + i;
      c[i] = make_uint4(0, 0, 0, 0);
      sc[i] = 0;
      if (!act || n >= p.N) continue;
      const uint8_t* wr = wq + n * wrow;
      const uint8_t* wsr = ws + n * wsrow;
      if constexpr (!GATHER) {
        c[i] = __ldg(reinterpret_cast<const uint4*>(wr + b0 * 8));
        sc[i] = __ldg(reinterpret_cast<const uint16_t*>(wsr + b0));
      } else {
        const uint2 c0 = __ldg(reinterpret_cast<const uint2*>(wr + g0 * 8));
        const uint2 c1 = __ldg(reinterpret_cast<const uint2*>(wr + g1 * 8));
        c[i] = make_uint4(c0.x, c0.y, c1.x, c1.y);
        sc[i] = static_cast<uint32_t>(__ldg(wsr + g0)) | (static_cast<uint32_t>(__ldg(wsr + g1)) << 8);
      }
    }
  };

  // Decode needs little data per SM, so the loads are issued early: PF steps of the warp's rows
  // (PF * NW 16-byte loads per lane) before X is decoded, and each step's buffer is refilled with
  // step s + PF as soon as it is used.
  // Rows r0 .. r0 + R of them per pass: a dense call has one pass per CTA (grid z covers the rows),
  // a grouped one loops over its group's rows (re-reading the weights, mostly from L1/L2).
  constexpr int PF = 4 / NW;
  const float kInv = 1.f / 2688.f;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.z) * R; r0 < rows; r0 += static_cast<int64_t>(gridDim.z) * R) {
    const int nr = static_cast<int>(min(static_cast<int64_t>(R), rows - r0));
    uint4 c[PF][NW];
    uint32_t sc[PF][NW];
#pragma unroll
    for (int j = 0; j < PF; ++j) load(j, c[j], sc[j]);
    if (r0 >= static_cast<int64_t>(gridDim.z) * R) __syncthreads();  // the last pass's readers are done

    const int64_t nch = K / 32;  // 32-element chunks (2 blocks) per row
    for (int64_t q = threadIdx.x; q < nr * nch; q += blockDim.x) {
      const int r = static_cast<int>(q / nch);
      const int64_t ch = q % nch, b = 2 * ch, gr = row0 + r0 + r;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p.xq + gr * (K / 2) + ch * 16));
      const uint32_t xsb = __ldg(reinterpret_cast<const uint16_t*>(p.xs + gr * nb + b));
      uint4 lo, hi;
      e2m1x32_to_s8(v, lo, hi);
      uint8_t* dst = sx + r * kpad + (b >> 6) * 1024 + ((b >> 1) & 31) * 16;
      *reinterpret_cast<uint4*>(dst) = lo;
      *reinterpret_cast<uint4*>(dst + 512) = hi;
      *reinterpret_cast<float2*>(sxs + r * nb + b) = make_float2(dev::e4m3_decode(xsb & 0xFFu), dev::e4m3_decode(xsb >> 8));
    }
    __syncthreads();

    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < NW; ++i) acc[r][i] = 0.f;
    for (int64_t s0 = 0; s0 < nsteps; s0 += PF) {
#pragma unroll
      for (int j = 0; j < PF; ++j) {
        const int64_t s = s0 + j, b0 = s * 64 + 2 * lane;
        if (s < nsteps && b0 < nb) {
          uint4 wlo[NW], whi[NW];
          float ws0[NW], ws1[NW];
#pragma unroll
          for (int i = 0; i < NW; ++i) {
            e2m1x32_to_s8(c[j][i], wlo[i], whi[i]);
            ws0[i] = dev::e4m3_decode(sc[j][i] & 0xFFu);
            ws1[i] = dev::e4m3_decode((sc[j][i] >> 8) & 0xFFu);
          }
          load(s + PF, c[j], sc[j]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r >= nr) break;
            const uint8_t* xr = sx + r * kpad + s * 1024 + lane * 16;
            const uint4 xlo = *reinterpret_cast<const uint4*>(xr);
            const uint4 xhi = *reinterpret_cast<const uint4*>(xr + 512);
            const float2 xs = *reinterpret_cast<const float2*>(sxs + r * nb + b0);
#pragma unroll
            for (int i = 0; i < NW; ++i) {
              // block terms are exact: |dot| <= 16 * 144 < 2^12 times a product of two E4M3 scales
              acc[r][i] = __fmaf_rn(static_cast<float>(dot16(wlo[i], xlo)), __fmul_rn(xs.x, ws0[i]), acc[r][i]);
              acc[r][i] = __fmaf_rn(static_cast<float>(dot16(whi[i], xhi)), __fmul_rn(xs.y, ws1[i]), acc[r][i]);
            }
          }
        }
      }
    }

    // lanes combine in a fixed butterfly; acc * 2^-16 (exact) is the tile kernels' raw sum (their
    // operands are code * scale * 2^-7, ours twice the code), then the same epilogue.
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < NW; ++i) {
        float v = acc[r][i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
        const int64_t n = nbase + i;
        if (lane != 0 || r >= nr || n >= p.N) continue;
        const int64_t row = row0 + r0 + r;
        const float rf = p.xamax[p.xamax_row ? row : 0] * kInv * 16384.f;
        const float out = __fmul_rn(v, 1.f / 65536.f) * rf * (wamax[p.wamax_row ? n : 0] * kInv);
        float* dst = p.y + row * p.ldy + n;
        *dst = p.accumulate ? *dst + out : out;
      }
  }
}

__global__ void gather_blocks_kernel(const float* x, int64_t m, int64_t k, const int32_t* blocks, int64_t nsel,
                                     float* out, int64_t out_cols) {
  pdl_begin();
  const int64_t n = m * out_cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out_cols, c = i % out_cols, b = c / 16;
    out[i] = b < nsel ? x[r * k + static_cast<int64_t>(blocks[b]) * 16 + c % 16] : 0.f;
  }
}

// The grouped gather: row r belongs to the expert e with eoff[e] <= r < eoff[e+1] and takes that
// expert's nsel[e] blocks (blocks row e); zeros after them.
__global__ void gather_blocks_grouped_kernel(const float* x, int64_t m, int64_t k, const int32_t* blocks,
                                             const int32_t* nsel, int64_t nb, const int32_t* eoff, int groups,
                                             float* out) {
  pdl_begin();
  const int64_t out_cols = nb * 16, n = m * out_cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out_cols, c = i % out_cols, b = c / 16;
    int lo = 0, hi = groups - 1;  // the last e with eoff[e] <= r
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (eoff[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    out[i] = b < nsel[lo] ? x[r * k + static_cast<int64_t>(blocks[lo * nb + b]) * 16 + c % 16] : 0.f;
  }
}

int sm_count() {
  static int sms = [] {
    int dev = 0, n = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n;
  }();
  return sms;
}

template <int BM, int BN, int WM, int WN, int STAGES, bool GATHER, bool GROUPED = false>
void launch(Params p, int splits_req, cudaStream_t s, int groups = 1) {
  constexpr int threads = 32 * (BM / WM) * (BN / WN);
  const int smem = Smem<BM, BN, GATHER>::STAGE * STAGES;
  auto kern = w4a4_kernel<BM, BN, WM, WN, STAGES, GATHER, GROUPED>;
  static bool checked = false;  // per instantiation
  if (!checked) {
    // The code the driver picked for this GPU must be sm_80 or newer (else the kernel is a trap).
    cudaFuncAttributes fa{};
    QUADS_CUDA_CHECK(cudaFuncGetAttributes(&fa, kern));
    QUADS_CHECK(fa.binaryVersion >= 80 && fa.ptxVersion >= 80,
                "w4a4_gemm: quads_cuda holds code for sm_{} only; the W4A4 kernels need sm_80 or newer "
                "(configure with -DCMAKE_CUDA_ARCHITECTURES=90)", fa.ptxVersion);
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    checked = true;
  }
  const int64_t tiles_n = (p.N + BN - 1) / BN, tiles_m = (p.M + BM - 1) / BM;
  const int64_t kb_total = (p.K + kBK - 1) / kBK;
  if constexpr (GROUPED) {
    // The grid is E x the tiles of the largest group (p.M); decode's few active experts would
    // leave most SMs idle, so K is split until about 4 CTAs per SM could be busy (row tiles with
    // work: at least one per active expert, at most min(E, rows) experts, and at least rows / BM).
    // Partials are summed in split order (deterministic).
    int splits = splits_req;
    if (splits <= 0) {
      const int64_t row_tiles = std::max<int64_t>(std::min<int64_t>(groups, p.Mtot), (p.Mtot + BM - 1) / BM);
      const int64_t busy = row_tiles * tiles_n, want = 4LL * sm_count();
      splits = busy >= want ? 1 : static_cast<int>(std::min<int64_t>((want + busy - 1) / busy, kb_total / 2));
    }
    splits = static_cast<int>(std::min<int64_t>(std::max(splits, 1), std::max<int64_t>(kb_total, 1)));
    p.kb_per_split = static_cast<int>((kb_total + splits - 1) / splits);
    splits = static_cast<int>(std::max<int64_t>(1, (kb_total + p.kb_per_split - 1) / p.kb_per_split));
    p.gsplits = splits;
    float* partial = nullptr;
    if (splits > 1) {
      QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial), sizeof(float) * splits * p.Mtot * p.N, s));
      p.partial = partial;
    }
    QUADS_CHECK(int64_t(groups) * splits <= 65535, "w4a4_gemm_grouped: {} groups x {} splits", groups, splits);
    const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                    static_cast<unsigned>(groups * splits));
    launch_pdl(kern, grid, threads, smem, s, p);
    if (splits > 1) {
      const int64_t n = p.Mtot * p.N;  // every row of y: each belongs to one expert
      const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
      launch_pdl(splitk_reduce_kernel, blocks, 256, 0, s, p, splits, groups);
      QUADS_CUDA_CHECK(cudaFreeAsync(partial, s));
    }
    return;
  }
  int splits = splits_req;
  if (splits <= 0) {
    // enough CTAs for about two waves, at least 2 stages of K per split
    const int64_t tiles = tiles_n * tiles_m, want = 2 * sm_count();
    splits = tiles >= want ? 1 : static_cast<int>(std::min<int64_t>((want + tiles - 1) / tiles, kb_total / 2));
    splits = std::max(splits, 1);
  }
  splits = static_cast<int>(std::min<int64_t>(std::max(splits, 1), std::max<int64_t>(kb_total, 1)));
  p.kb_per_split = static_cast<int>((kb_total + splits - 1) / splits);
  splits = static_cast<int>(std::max<int64_t>(1, (kb_total + p.kb_per_split - 1) / p.kb_per_split));
  float* partial = nullptr;
  if (splits > 1) {
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial), sizeof(float) * splits * p.M * p.N, s));
    p.partial = partial;
  }
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m), static_cast<unsigned>(splits));
  launch_pdl(kern, grid, threads, smem, s, p);
  if (splits > 1) {
    const int64_t n = p.M * p.N;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
    launch_pdl(splitk_reduce_kernel, blocks, 256, 0, s, p, splits, 0);
    QUADS_CUDA_CHECK(cudaFreeAsync(partial, s));
  }
}

// GEMV launch plan: R rows of X per CTA (up to 4; more rows take more CTAs along grid z, which
// read the same weights, mostly from L2), shared memory R * (kpad + k/4) bytes; NW weight rows per
// warp so that a lane has about four 16-byte loads in flight (NW * min(steps, 4 / NW)), fewer
// when the weight rows with work would leave SMs without 8 warps.
constexpr int64_t kGemvSmemMax = 100 * 1024;
struct GemvPlan {
  int R = 0, NW = 1;
  int64_t smem = 0;
};
GemvPlan gemv_plan(int64_t k, int64_t rows_per_weight, int64_t active_weight_rows) {
  GemvPlan g;
  g.R = rows_per_weight <= 1 ? 1 : rows_per_weight <= 2 ? 2 : 4;
  while (g.R > 1 && gemv_smem(g.R, k) > kGemvSmemMax) g.R /= 2;
  if (gemv_smem(g.R, k) > kGemvSmemMax) g.R = 0;  // K too long for one row in shared memory
  g.smem = gemv_smem(std::max(g.R, 1), k);
  const int64_t steps = (k / 16 + 63) / 64;
  g.NW = steps >= 4 ? 1 : steps >= 2 ? 2 : 4;
  if (g.R >= 4) g.NW = std::min(g.NW, 2);  // registers: R * NW accumulators
  while (g.NW > 1 && active_weight_rows / g.NW < 8LL * sm_count()) g.NW /= 2;
  return g;
}

template <int R, int NW, bool GATHER, bool GROUPED>
void launch_gemv_k(const Params& p, int64_t smem, dim3 grid, cudaStream_t s) {
  auto kern = w4a4_gemv_kernel<R, NW, GATHER, GROUPED>;
  static int64_t smem_set = 48 * 1024;  // per instantiation: the opt-in for more shared memory
  if (smem > smem_set) {
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kGemvSmemMax)));
    smem_set = kGemvSmemMax;
  }
  launch_pdl(kern, grid, 32 * kGemvWarps, static_cast<size_t>(smem), s, p);
}
template <int R, bool GATHER, bool GROUPED>
void launch_gemv_nw(const Params& p, const GemvPlan& g, dim3 grid, cudaStream_t s) {
  // the RAC residuals are short (a few hundred columns): one weight row per warp
  if constexpr (GATHER) {
    launch_gemv_k<R, 1, GATHER, GROUPED>(p, g.smem, grid, s);
  } else {
    if (g.NW == 1) launch_gemv_k<R, 1, GATHER, GROUPED>(p, g.smem, grid, s);
    else if (g.NW == 2 || R >= 4) launch_gemv_k<R, 2, GATHER, GROUPED>(p, g.smem, grid, s);
    else launch_gemv_k<R, (R >= 4 ? 2 : 4), GATHER, GROUPED>(p, g.smem, grid, s);
  }
}
// grid_y: 1 for a dense call, min(groups, rows) for a grouped one. Dense calls spread their rows
// over grid z; grouped ones loop (a host bound on a group's rows would launch mostly idle CTAs).
template <bool GATHER, bool GROUPED>
void launch_gemv(Params p, GemvPlan g, int64_t grid_y, cudaStream_t s) {
  QUADS_CHECK(g.R > 0, "w4a4_gemm: K = {} is too long for the GEMV (a row of X must fit in shared memory)", p.K);
  if (GATHER) g.NW = 1;
  const int64_t rows_per_cta = int64_t(kGemvWarps) * g.NW, chunks = GROUPED ? 1 : (p.M + g.R - 1) / g.R;
  QUADS_CHECK(chunks <= 65535, "w4a4_gemm: {} rows are too many for the GEMV", p.M);
  const dim3 grid(static_cast<unsigned>((p.N + rows_per_cta - 1) / rows_per_cta), static_cast<unsigned>(grid_y),
                  static_cast<unsigned>(chunks));
  switch (g.R) {
    case 1: launch_gemv_nw<1, GATHER, GROUPED>(p, g, grid, s); break;
    case 2: launch_gemv_nw<2, GATHER, GROUPED>(p, g, grid, s); break;
    default: launch_gemv_nw<4, GATHER, GROUPED>(p, g, grid, s); break;
  }
}

template <bool GATHER>
void dispatch(const Params& p, const W4A4Options& opt, cudaStream_t s) {
  W4A4Tile tile = opt.tile;
  if (tile == W4A4Tile::Auto && p.M <= kGemvAutoMaxRows && gemv_plan(p.K, p.M, p.N).R > 0) tile = W4A4Tile::Gemv;
  // M = 17..32 runs two 16-row tiles over the same weights (measured faster than one 64-row tile);
  // 4 warps per 16-row tile beat 2 by 0-13% at M 8..32 on the H200 (bench_cuda --gemv).
  if (tile == W4A4Tile::Auto) tile = p.M <= 32 ? W4A4Tile::M16W4 : p.M <= 64 ? W4A4Tile::M64 : W4A4Tile::M128;
  switch (tile) {
    case W4A4Tile::Gemv: launch_gemv<GATHER, false>(p, gemv_plan(p.K, p.M, p.N), 1, s); break;
    case W4A4Tile::M16: launch<16, 128, 16, 64, 4, GATHER>(p, opt.splits, s); break;
    case W4A4Tile::M16W4: launch<16, 128, 16, 32, 4, GATHER>(p, opt.splits, s); break;
    case W4A4Tile::M16N64: launch<16, 64, 16, 32, 4, GATHER>(p, opt.splits, s); break;
    case W4A4Tile::M64: launch<64, 128, 32, 64, 4, GATHER>(p, opt.splits, s); break;
    default: launch<128, 128, 64, 64, 3, GATHER>(p, opt.splits, s); break;
  }
}

// The GEMV plan of a grouped call: rows per CTA from the bound on a group's rows (p.M), warps from
// the weight rows of the min(groups, rows) groups that can have rows.
GemvPlan gemv_plan_grouped(const Params& p, int groups) {
  return gemv_plan(p.K, p.M, std::min<int64_t>(groups, p.Mtot) * p.N);
}

template <bool GATHER>
void dispatch_grouped(Params p, int groups, int splits, W4A4Tile tile, cudaStream_t s) {
  p.groups = groups;
  if (tile == W4A4Tile::Auto && splits <= 0 && gemv_auto_grouped(p.M, p.K) &&
      gemv_plan_grouped(p, groups).R > 0)
    tile = W4A4Tile::Gemv;
  if (tile == W4A4Tile::Gemv) {
    launch_gemv<GATHER, true>(p, gemv_plan_grouped(p, groups), std::min<int64_t>(groups, p.Mtot), s);
    return;
  }
  // p.M is the largest group: decode has a few rows per expert, M16 tiles stream the weights. With
  // 4 warps per tile (H200, routed decode batches, bench_cuda --gemv): gate/up 70 vs 82 us at batch
  // 16, 87 vs 87 at 64; down 40 vs 37 at 16, 46 vs 55 at 64.
  if (tile == W4A4Tile::Auto) tile = p.M <= 64 ? W4A4Tile::M16W4 : p.M <= 256 ? W4A4Tile::M64 : W4A4Tile::M128;
  switch (tile) {
    case W4A4Tile::M16: launch<16, 128, 16, 64, 4, GATHER, true>(p, splits, s, groups); break;
    case W4A4Tile::M16W4: launch<16, 128, 16, 32, 4, GATHER, true>(p, splits, s, groups); break;
    case W4A4Tile::M16N64: launch<16, 64, 16, 32, 4, GATHER, true>(p, splits, s, groups); break;
    case W4A4Tile::M64: launch<64, 128, 32, 64, 4, GATHER, true>(p, splits, s, groups); break;
    default: launch<128, 128, 64, 64, 3, GATHER, true>(p, splits, s, groups); break;
  }
}

Params make_params(const Nvfp4View& x, const Nvfp4View& w, float* y, bool accumulate) {
  Params p{};
  p.xq = x.codes;
  p.xs = x.scales;
  p.xamax = x.amax;
  p.xamax_row = x.amax_per_row;
  p.wq = w.codes;
  p.ws = w.scales;
  p.wamax = w.amax;
  p.wamax_row = w.amax_per_row;
  p.M = x.rows;
  p.N = w.rows;
  p.K = x.k;
  p.Kw = w.k;
  p.y = y;
  p.ldy = w.rows;
  p.accumulate = accumulate;
  p.gsplits = 1;
  return p;
}

}  // namespace

bool gemv_auto_grouped(int64_t max_rows, int64_t k) {
  // max_rows is the decode batch (a group has at most one row per token)
  return max_rows <= 1 || (max_rows <= 4 && k >= 2048);
}

Nvfp4View nvfp4_view(const DeviceQTensor& q, const char* what) {
  QUADS_CHECK(q.cfg.scheme == num::Scheme::NVFP4 && q.cfg.element == num::Format::E2M1,
              "{}: the W4A4 GEMM needs NVFP4 with E2M1 elements, got {}", what, q.cfg.describe());
  QUADS_CHECK(q.layout == ScaleLayout::RowMajor, "{}: the emulated W4A4 GEMM reads row-major scales", what);
  Nvfp4View v;
  v.codes = q.codes.data();
  v.scales = q.scales.data();
  v.amax = q.amax.data();
  v.amax_per_row = q.cfg.global == num::Global::PerRow;
  v.rows = q.rows;
  v.k = q.cols;
  return v;
}

void w4a4_gemm_emulated(const Nvfp4View& x, const Nvfp4View& w, float* y, bool accumulate, cudaStream_t s,
                        const W4A4Options& opt) {
  QUADS_CHECK(x.k == w.k, "w4a4_gemm: X is [{}, {}] but W is [{}, {}]: inner dimensions differ", x.rows, x.k, w.rows, w.k);
  QUADS_CHECK(x.k % 64 == 0, "w4a4_gemm: K = {} must be a multiple of 64", x.k);
  if (x.rows == 0 || w.rows == 0) return;
  dispatch<false>(make_params(x, w, y, accumulate), opt, s);
}

void w4a4_gemm_gather(const Nvfp4View& xr, const Nvfp4View& w, const int32_t* blocks, float* y, bool accumulate,
                      cudaStream_t s, const W4A4Options& opt) {
  QUADS_CHECK(xr.k % 64 == 0, "w4a4_gemm_gather: the residual's K = {} must be a multiple of 64 (pad with zero blocks)", xr.k);
  QUADS_CHECK(w.k % 64 == 0, "w4a4_gemm_gather: W's K = {} must be a multiple of 64", w.k);
  if (xr.rows == 0 || w.rows == 0 || xr.k == 0) {
    if (!accumulate && xr.rows && w.rows) QUADS_CUDA_CHECK(cudaMemsetAsync(y, 0, sizeof(float) * xr.rows * w.rows, s));
    return;
  }
  Params p = make_params(xr, w, y, accumulate);
  p.blk = blocks;
  dispatch<true>(p, opt, s);
}

void w4a4_gemm_grouped(const Nvfp4View& x, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                       const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t s, int splits,
                       W4A4Tile tile) {
  QUADS_CHECK(x.k % 64 == 0, "w4a4_gemm_grouped: K = {} must be a multiple of 64", x.k);
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemm_grouped: {} groups (1..65535)", groups);
  if (x.rows == 0 || n == 0 || max_rows <= 0) return;
  Nvfp4View w;
  w.rows = n;
  w.k = x.k;
  w.amax_per_row = w_amax_per_row;
  Params p = make_params(x, w, y, false);
  p.M = std::min(max_rows, x.rows);  // grid bound; each CTA reads its own group's row range
  p.Mtot = x.rows;
  p.eoff = eoff;
  p.wtab = w_table;
  dispatch_grouped<false>(p, groups, splits, tile, s);
}

void w4a4_gemm_grouped_gather(const Nvfp4View& xr, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n,
                              int64_t w_k, int groups, const int32_t* eoff, int64_t max_rows, const int32_t* blocks,
                              float* y, int64_t ldy, cudaStream_t s, int splits, W4A4Tile tile) {
  QUADS_CHECK(xr.k % 64 == 0, "w4a4_gemm_grouped_gather: the residual's K = {} must be a multiple of 64", xr.k);
  QUADS_CHECK(w_k % 64 == 0, "w4a4_gemm_grouped_gather: W's K = {} must be a multiple of 64", w_k);
  QUADS_CHECK(ldy >= n, "w4a4_gemm_grouped_gather: ldy = {} < n = {}", ldy, n);
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemm_grouped_gather: {} groups (1..65535)", groups);
  if (xr.rows == 0 || n == 0 || max_rows <= 0 || xr.k == 0) return;
  Nvfp4View w;
  w.rows = n;
  w.k = w_k;
  w.amax_per_row = w_amax_per_row;
  Params p = make_params(xr, w, y, true);
  p.ldy = ldy;
  p.M = std::min(max_rows, xr.rows);
  p.Mtot = xr.rows;
  p.eoff = eoff;
  p.wtab = w_table;
  p.blk = blocks;
  p.blk_stride = xr.k / 16;
  dispatch_grouped<true>(p, groups, splits, tile, s);
}

void gather_blocks(const float* x, int64_t m, int64_t k, const int32_t* blocks, int64_t nsel, float* out,
                   int64_t out_cols, cudaStream_t s) {
  QUADS_CHECK(out_cols % 16 == 0 && out_cols >= 16 * nsel, "gather_blocks: out_cols = {} cannot hold {} blocks", out_cols, nsel);
  const int64_t n = m * out_cols;
  if (n == 0) return;
  const int blocks_n = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
  launch_pdl(gather_blocks_kernel, blocks_n, 256, 0, s, x, m, k, blocks, nsel, out, out_cols);
}

void gather_blocks_grouped(const float* x, int64_t m, int64_t k, const int32_t* blocks, const int32_t* nsel,
                           int64_t out_cols, const int32_t* eoff, int groups, float* out, cudaStream_t s) {
  QUADS_CHECK(out_cols % 16 == 0, "gather_blocks_grouped: out_cols = {} is not a multiple of 16", out_cols);
  const int64_t n = m * out_cols;
  if (n == 0) return;
  const int blocks_n = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
  launch_pdl(gather_blocks_grouped_kernel, blocks_n, 256, 0, s, x, m, k, blocks, nsel, out_cols / 16, eoff, groups, out);
}

}  // namespace quads::cuda
