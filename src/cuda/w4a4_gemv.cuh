#pragma once
// The W4A4 GEMV (decode) and what the W4A4 kernels share, included by w4a4_gemm.cu (the tile
// kernels, the plain GEMV on quantize()'s codes, the RAC gather) and w4a4_gemv_fused.cu (the GEMV
// that quantizes its activation rows in its prologue). Two translation units because the GEMV's
// template variants make one slow to compile. Everything here but Params has internal linkage (an
// anonymous namespace): each unit instantiates the kernels it launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/codecs.cuh"
#include "cuda/device.h"  // sm_count
#include "cuda/gemm.h"
#include "cuda/kernel_util.cuh"
#include "cuda/mma_util.cuh"  // e4m3x2_float2
#include "cuda/pdl.cuh"
#include "cuda/quant_row.cuh"

namespace quads::cuda {

// Params has external linkage: w4a4_wgmma.cu (a unit of its own, built for sm_90a) takes it too.
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
  // fused GEMV: X quantized in the prologue from FP32 rows (FusedAct in gemm.h)
  const float* fx;
  const float* fu;        // SwiGLU source: X = swiglu1(fx, fu)
  int64_t fld;            // row stride of fx and fu
  const int32_t* fmap;    // X row r is source row fmap[r] / fmap_div (null: r)
  int fmap_div;
  int fstatic;            // Global::Static: amax fstatic_amax, else per row
  float fstatic_amax;
  int early_w;            // dense: stream the first weights before waiting for the previous kernel
  // RAC folded (RES kernels, RacFold in gemm.h): residual operand j < nres at rq + j * rrows * K / 2,
  // rs + j * rrows * K / 16, ramax + j * rrows (per row); its rows are the problem's (no map); W
  // rows n >= rsplit0 take operand 1, n >= rsplit1 operand 2.
  const uint8_t* rq;
  const uint8_t* rs;
  const float* ramax;
  int nres;
  int64_t rrows, rsplit0, rsplit1;
  const uint4* xfrag;  // dense skinny tiles of at most 16 rows: X as FP16 fragments (Nvfp4View::frag)
};

namespace {

// The j-th group (0-based) with rows among eoff's groups (eoff[e] < eoff[e + 1]), or -1; the
// whole warp calls it and gets the same answer, 32 groups a ballot.
__device__ __forceinline__ int nth_nonempty_group(const int32_t* eoff, int groups, int j, int lane) {
  int seen = 0;
  for (int base = 0; base < groups; base += 32) {
    const int g = base + lane;
    const bool ne = g < groups && eoff[g + 1] > eoff[g];
    uint32_t m = __ballot_sync(0xFFFFFFFFu, ne);
    const int cnt = __popc(m);
    if (j < seen + cnt) {
      for (int i = 0; i < j - seen; ++i) m &= m - 1;
      return base + __ffs(m) - 1;
    }
    seen += cnt;
  }
  return -1;
}

// The residual operand of W rows from n on (RAC folded; the splits are multiples of 16).
__device__ __forceinline__ int res_operand(const Params& p, int64_t n) {
  return n >= p.rsplit1 ? 2 : n >= p.rsplit0 ? 1 : 0;
}

// Row r of the problem is X's row fmap[r] / fmap_div where a grouped call reads X's codes through
// a map (w4a4_gemm_grouped_mapped), else row r. (The fused GEMV's prologue reads its FP32 source
// rows through the same map.)
__device__ __forceinline__ int64_t x_row(const Params& p, int64_t r) {
  return p.fmap ? static_cast<int64_t>(__ldg(p.fmap + r) / p.fmap_div) : r;
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
#ifdef QUADS_EXPERIMENT_NODEQ  // as deq's in mma_util.cuh: one instruction, wrong values
  return nib & 0x07070707u;
#else
  const uint32_t idx = nib & 0x7777u;
  const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, idx);
  const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, idx);
  return __byte_perm(pos, neg, 0x3210u | ((nib & 0x8888u) >> 1));
#endif
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

// The fused prologue (FUSED): X rows xr0 .. xr0 + nr quantized from FP32 straight into the decoded
// layout above, with the steps of quantize()'s row kernel (quant_row.cuh), so the int8 codes and
// float block scales are those the plain GEMV decodes from quantize()'s output. The warps split
// into R groups of kGemvWarps / R, group r takes row r, a thread whole 16-blocks (four 16-byte
// loads): it keeps up to kFuseBlocks of them in registers across the one barrier of the row amax
// (warp maxima in s_wmax), and loads longer rows twice (the second time from L1/L2).
constexpr int kFuseBlocks = 1;

template <int R, bool SWIGLU>
__device__ __forceinline__ void fused_prologue(const Params& p, int64_t xr0, int nr, uint8_t* sx, float* sxs,
                                               uint32_t* s_wmax) {
  constexpr int GW = kGemvWarps / R, GT = 32 * GW;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = warp / GW, tg = static_cast<int>(threadIdx.x) - r * GT;
  const int64_t nb = p.K / 16, kpad = gemv_kpad(p.K);
  const bool live = r < nr;
  int64_t src = 0;
  if (live) src = p.fmap ? static_cast<int64_t>(__ldg(p.fmap + xr0 + r) / p.fmap_div) : xr0 + r;
  const float4* xg = reinterpret_cast<const float4*>(p.fx + src * p.fld);
  const float4* xu = reinterpret_cast<const float4*>(p.fu + src * p.fld);
  auto load_block = [&](int64_t b, float4 (&v)[4]) {
    if constexpr (SWIGLU) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 g = __ldg(xg + b * 4 + q), u = __ldg(xu + b * 4 + q);
        v[q] = make_float4(kern::swiglu1(g.x, u.x), kern::swiglu1(g.y, u.y), kern::swiglu1(g.z, u.z),
                           kern::swiglu1(g.w, u.w));
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = __ldg(xg + b * 4 + q);
    }
  };
  auto absmax16 = [](const float4 (&v)[4]) {
    return max(max(dev::vabsmax(v[0]), dev::vabsmax(v[1])), max(dev::vabsmax(v[2]), dev::vabsmax(v[3])));
  };
  const bool regs = nb <= int64_t(kFuseBlocks) * GT;
  float4 v[kFuseBlocks][4];
  uint32_t bm[kFuseBlocks], m = 0;
  if (regs) {
#pragma unroll
    for (int i = 0; i < kFuseBlocks; ++i) {
      const int64_t b = tg + i * GT;
      bm[i] = 0;
      if (live && b < nb) {
        load_block(b, v[i]);
        bm[i] = absmax16(v[i]);
        m = max(m, bm[i]);
      }
    }
  } else if (live && !p.fstatic) {
    for (int64_t b = tg; b < nb; b += GT) {
      float4 t[4];
      load_block(b, t);
      m = max(m, absmax16(t));
    }
  }
  float amax = p.fstatic_amax;
  if (!p.fstatic) {  // the row's amax over its group's warps (uniform over the CTA)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (lane == 0) s_wmax[warp] = m;
    __syncthreads();
    m = 0;
#pragma unroll
    for (int w = 0; w < GW; ++w) m = max(m, s_wmax[r * GW + w]);
    amax = dev::u2f(m);
    step_mark0(53);  // (step trace builds only) the row's amax known
  }
  if (!live) return;
  const dev::NvGlobal g = dev::nv_global<false>(amax);
  auto emit = [&](int64_t b, const float4 (&x)[4], uint32_t bmax) {
    uint32_t sf;
    const uint2 c = dev::nv_quant_block16(x, bmax, g, sf);
    const uint4 s8 = make_uint4(e2m1x4_to_s8(c.x), e2m1x4_to_s8(c.x >> 16), e2m1x4_to_s8(c.y), e2m1x4_to_s8(c.y >> 16));
    *reinterpret_cast<uint4*>(sx + r * kpad + (b >> 6) * 1024 + (b & 1) * 512 + ((b >> 1) & 31) * 16) = s8;
    sxs[r * nb + b] = dev::e4m3_decode(sf);
  };
  if (regs) {
#pragma unroll
    for (int i = 0; i < kFuseBlocks; ++i) {
      const int64_t b = tg + i * GT;
      if (b < nb) emit(b, v[i], bm[i]);
    }
  } else {
    for (int64_t b = tg; b < nb; b += GT) {
      float4 t[4];
      load_block(b, t);
      emit(b, t, absmax16(t));
    }
  }
}

// FUSE: 0 X as codes (quantize()'s output), 1 fused from FP32 rows, 2 fused from the SwiGLU of
// two FP32 sources (a template argument: the SwiGLU's loads and exp would cost the other
// variants registers).
// RES (RAC folded, FUSE 0): the nres residual operands' rows are staged after X's (R rows each),
// and a warp's rows meet X's rows and their operand's rows in the same pass over its weights,
// into a second set of sums.
// Weight-row tiles (kGemvWarps * NW rows): tile blockIdx.x, then every gridDim.x-th after it. A
// grid of one tile per CTA decodes X once per tile; a smaller one (gemv_tile_loop) decodes it once
// per CTA and keeps the weight stream going from one tile into the next: when the steps of a row
// are a multiple of PF, the refill after the last steps of a tile loads the first ones of the
// CTA's next tile. Either way every output is the same sum in the same order.
template <int R, int NW, bool GATHER, bool GROUPED, int FUSE, bool RES = false>
__global__ void __launch_bounds__(32 * kGemvWarps, NW == 4 ? 2 : 3) w4a4_gemv_kernel(const Params p) {
  constexpr bool FUSED = FUSE != 0;
  static_assert(!(GATHER && FUSED), "the RAC gather has no fused variant");
  static_assert(!(RES && (GATHER || FUSED)), "the folded residual reads X as codes");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint32_t s_wmax[kGemvWarps];  // fused: the warps' row amax bits
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Counts and indices below fit 32 bits (K < 2^31, rows and tiles < 2^31; the launcher checks):
  // with a short row (2 steps at K = 2048, batch 1) a warp's index math and bounds checks are most
  // of its instructions, so only the pointer offsets are 64-bit.
  const int64_t K = p.K, kpad = gemv_kpad(K);
  const int nb = static_cast<int>(K / 16);
  uint8_t* sx = smem;
  const int rt = RES ? R * (1 + p.nres) : R;  // staged rows: X's, then each residual operand's
  float* sxs = reinterpret_cast<float*>(smem + rt * kpad);
  const int64_t wrow = p.Kw / 2, wsrow = p.Kw / 16;
  const int nsteps = (nb + 63) / 64, N = static_cast<int>(p.N);
  const int ntiles = (N + kGemvWarps * NW - 1) / (kGemvWarps * NW);
  const int tile0 = blockIdx.x, tstride = gridDim.x;
  constexpr int PF = 4 / NW;
  const bool chain = nsteps % PF == 0;  // a refill past a tile's last step lands in the same buffer

  int64_t row0 = 0, rows = p.M;  // this CTA's rows of X and y
  const uint8_t* wq = p.wq;
  const uint8_t* ws = p.ws;
  const float* wamax = p.wamax;
  const int32_t* blk = p.blk;

  // Raw codes (gather: block 0 in x, y and block 1 in z, w) and the two scale bytes of step s of
  // tile t; steps past the tile's last are those of the CTA's next tiles (with chain), else none.
  auto load = [&](int t, int s, uint4 (&c)[NW], uint32_t (&sc)[NW]) {
    if (s >= nsteps) {  // s < nsteps + PF: a step or a few past the tile
      if (chain) {
        do {
          s -= nsteps;
          t += tstride;
        } while (s >= nsteps);
      } else {
        t = ntiles;
      }
    }
    const int b0 = s * 64 + 2 * lane;
    const bool act = t < ntiles && b0 < nb;  // nb is a multiple of 4: block b0 + 1 exists too
    int64_t g0 = b0, g1 = b0 + 1;
    if constexpr (GATHER) {
      if (act) {
        g0 = __ldg(blk + b0);
        g1 = __ldg(blk + b0 + 1);
      }
    }
    const int nbase = (t * kGemvWarps + warp) * NW;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      const int n = nbase + i;
      c[i] = make_uint4(0, 0, 0, 0);
      sc[i] = 0;
      if (!act || n >= N) continue;
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
  // step s + PF as soon as it is used. A dense fused call whose weights the previous kernel did
  // not write (early_w) issues its first PF steps before waiting for that kernel (PDL), so the
  // weight stream overlaps the predecessor's tail.
  uint4 c[PF][NW];
  uint32_t sc[PF][NW];
  const bool early = !GROUPED && p.early_w;
  if (early) {
#pragma unroll
    for (int j = 0; j < PF; ++j) load(tile0, j, c[j], sc[j]);
  }
  pdl_begin();

  if constexpr (GROUPED) {
    // CTA row j of the grid takes the j-th non-empty group (every warp finds the same one, so the
    // exit is uniform for the CTA, before any barrier).
    const int e = nth_nonempty_group(p.eoff, p.groups, blockIdx.y, lane);
    if (e < 0) return;
    step_mark0(50);  // (step trace builds only) the group found
    row0 = p.eoff[e];
    rows = p.eoff[e + 1] - row0;
    wq = p.wtab[e].codes;
    ws = p.wtab[e].scales;
    wamax = p.wtab[e].amax;
    if constexpr (GATHER) blk += e * p.blk_stride;
  }

  // Rows r0 .. r0 + R of them per pass: a dense call has one pass per CTA (grid z covers the rows),
  // a grouped one loops over its group's rows (re-reading the weights, mostly from L1/L2).
  const float kInv = 1.f / 2688.f;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.z) * R; r0 < rows; r0 += static_cast<int64_t>(gridDim.z) * R) {
    const int nr = static_cast<int>(min(static_cast<int64_t>(R), rows - r0));
    const bool later = r0 >= static_cast<int64_t>(gridDim.z) * R;
    if (!early || later) {
#pragma unroll
      for (int j = 0; j < PF; ++j) load(tile0, j, c[j], sc[j]);
    }
    if (later) __syncthreads();  // the last pass's readers are done

    if constexpr (FUSED) {
      fused_prologue<R, FUSE == 2>(p, row0 + r0, nr, sx, sxs, s_wmax);
    } else {
      const int nch = nb / 2;  // 32-element chunks (2 blocks) per row
      // chunk ch of a row of codes / scales into staged row sr
      auto stage = [&](const uint8_t* codes, const uint8_t* scales, int sr, int ch) {
        const int b = 2 * ch;
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + ch * 16));
        const uint32_t xsb = __ldg(reinterpret_cast<const uint16_t*>(scales + b));
        uint4 lo, hi;
        e2m1x32_to_s8(v, lo, hi);
        uint8_t* dst = sx + sr * kpad + (b >> 6) * 1024 + ((b >> 1) & 31) * 16;
        *reinterpret_cast<uint4*>(dst) = lo;
        *reinterpret_cast<uint4*>(dst + 512) = hi;
        *reinterpret_cast<float2*>(sxs + sr * nb + b) = e4m3x2_float2(xsb);
      };
      for (int q = threadIdx.x; q < nr * nch; q += blockDim.x) {
        const int r = q / nch, ch = q - r * nch;
        const int64_t gr = x_row(p, row0 + r0 + r);
        stage(p.xq + gr * (K / 2), p.xs + gr * nb, r, ch);
      }
      if constexpr (RES) {
        for (int q = threadIdx.x; q < p.nres * nr * nch; q += blockDim.x) {
          const int jr = q / (nr * nch), rem = q - jr * nr * nch, r = rem / nch, ch = rem - r * nch;
          const int64_t gr = static_cast<int64_t>(jr) * p.rrows + row0 + r0 + r;
          stage(p.rq + gr * (K / 2), p.rs + gr * nb, R + jr * R + r, ch);
        }
      }
    }
    __syncthreads();
    step_mark0(51);  // X staged

    for (int t = tile0; t < ntiles; t += tstride) {
      if (!chain && t != tile0) {
#pragma unroll
        for (int j = 0; j < PF; ++j) load(t, j, c[j], sc[j]);
      }
      float acc[R][NW], accr[RES ? R : 1][NW];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < NW; ++i) acc[r][i] = accr[RES ? r : 0][i] = 0.f;
      // this warp's residual operand (its NW rows never straddle a split)
      const int jr = RES ? res_operand(p, int64_t(t * kGemvWarps + warp) * NW) : 0;
      for (int s0 = 0; s0 < nsteps; s0 += PF) {
#pragma unroll
        for (int j = 0; j < PF; ++j) {
          const int s = s0 + j, b0 = s * 64 + 2 * lane;
          if (s >= nsteps) break;  // uniform
          const bool lane_act = b0 < nb;
          uint4 wlo[NW], whi[NW];
          float ws0[NW], ws1[NW];
          if (lane_act) {
#pragma unroll
            for (int i = 0; i < NW; ++i) {
              e2m1x32_to_s8(c[j][i], wlo[i], whi[i]);
              const float2 wsf = e4m3x2_float2(sc[j][i]);
              ws0[i] = wsf.x;
              ws1[i] = wsf.y;
            }
          }
          load(t, s + PF, c[j], sc[j]);  // every lane: the next tile's steps may have work for it
          if (lane_act) {
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
              if constexpr (RES) {
                const int sr = R + jr * R + r;
                const uint8_t* rr = sx + sr * kpad + s * 1024 + lane * 16;
                const uint4 rlo = *reinterpret_cast<const uint4*>(rr);
                const uint4 rhi = *reinterpret_cast<const uint4*>(rr + 512);
                const float2 rsc = *reinterpret_cast<const float2*>(sxs + sr * nb + b0);
#pragma unroll
                for (int i = 0; i < NW; ++i) {
                  accr[r][i] = __fmaf_rn(static_cast<float>(dot16(wlo[i], rlo)), __fmul_rn(rsc.x, ws0[i]), accr[r][i]);
                  accr[r][i] = __fmaf_rn(static_cast<float>(dot16(whi[i], rhi)), __fmul_rn(rsc.y, ws1[i]), accr[r][i]);
                }
              }
            }
          }
        }
      }

      step_mark0(52);  // the K loop done
      // lanes combine in a fixed butterfly; acc * 2^-16 (exact) is the tile kernels' raw sum (their
      // operands are code * scale * 2^-7, ours twice the code), then the same epilogue.
      const int nbase = (t * kGemvWarps + warp) * NW;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < NW; ++i) {
          float v = acc[r][i], vr = accr[RES ? r : 0][i];
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
          if constexpr (RES) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) vr += __shfl_xor_sync(0xFFFFFFFFu, vr, o);
          }
          const int64_t n = nbase + i;
          if (lane != 0 || r >= nr || n >= p.N) continue;
          const int64_t row = row0 + r0 + r;
          float xa;
          if constexpr (FUSED) {
            // the amax quantize() would have stored for this row (read before the next pass's barrier)
            constexpr int GW = kGemvWarps / R;
            uint32_t m = 0;
#pragma unroll
            for (int w = 0; w < GW; ++w) m = max(m, s_wmax[r * GW + w]);
            xa = p.fstatic ? p.fstatic_amax : dev::u2f(m);
          } else {
            xa = p.xamax[p.xamax_row ? x_row(p, row) : 0];
          }
          const float rf = xa * kInv * 16384.f, wf = wamax[p.wamax_row ? n : 0] * kInv;
          const float out = __fmul_rn(v, 1.f / 65536.f) * rf * wf;
          float* dst = p.y + row * p.ldy + n;
          float o = p.accumulate ? *dst + out : out;
          if constexpr (RES) {
            const float rrf = p.ramax[static_cast<int64_t>(jr) * p.rrows + row] * kInv * 16384.f;
            o += __fmul_rn(vr, 1.f / 65536.f) * rrf * wf;
          }
          *dst = o;
        }
    }
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
// staged: rows staged per row of X (1 + the residual operands of a folded RAC call).
GemvPlan gemv_plan(int64_t k, int64_t rows_per_weight, int64_t active_weight_rows, int staged = 1) {
  GemvPlan g;
  g.R = rows_per_weight <= 1 ? 1 : rows_per_weight <= 2 ? 2 : 4;
  while (g.R > 1 && gemv_smem(g.R * staged, k) > kGemvSmemMax) g.R /= 2;
  if (gemv_smem(g.R * staged, k) > kGemvSmemMax) g.R = 0;  // K too long for one row in shared memory
  g.smem = gemv_smem(std::max(g.R, 1) * staged, k);
  const int64_t steps = (k / 16 + 63) / 64;
  g.NW = steps >= 4 ? 1 : steps >= 2 ? 2 : 4;
  if (g.R >= 4) g.NW = std::min(g.NW, 2);  // registers: R * NW accumulators
  while (g.NW > 1 && active_weight_rows / g.NW < 8LL * sm_count()) g.NW /= 2;
  return g;
}

template <int R, int NW, bool GATHER, bool GROUPED, int FUSE, bool RES>
void launch_gemv_k(const Params& p, int64_t smem, dim3 grid, cudaStream_t s) {
  auto kern = w4a4_gemv_kernel<R, NW, GATHER, GROUPED, FUSE, RES>;
  static int64_t smem_set = 48 * 1024;  // per instantiation: the opt-in for more shared memory
  if (smem > smem_set) {
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kGemvSmemMax)));
    smem_set = kGemvSmemMax;
  }
  const GemvTileLoop mode = gemv_tile_loop();
  if (mode == GemvTileLoop::On ||
      (mode == GemvTileLoop::Auto && !GATHER && (!GROUPED || FUSE != 0 || p.M <= 1))) {
    // about one wave: the CTAs an SM holds (registers: the launch bound; shared memory; 1 KB of it
    // reserved per CTA) times the SMs, over the grid's y and z
    const int64_t per_sm = std::min<int64_t>(NW == 4 ? 2 : 3, (228 * 1024) / (smem + 32 + 1024));
    const int64_t yz = int64_t(grid.y) * grid.z;
    const int64_t want = (std::max<int64_t>(per_sm, 1) * sm_count() + yz - 1) / yz;
    grid.x = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(grid.x, want)));
  }
  launch_pdl(kern, grid, 32 * kGemvWarps, static_cast<size_t>(smem), s, p);
}
template <int R, bool GATHER, bool GROUPED, int FUSE, bool RES>
void launch_gemv_nw(const Params& p, const GemvPlan& g, dim3 grid, cudaStream_t s) {
  // the RAC residuals are short (a few hundred columns): one weight row per warp
  if constexpr (GATHER) {
    launch_gemv_k<R, 1, GATHER, GROUPED, FUSE, RES>(p, g.smem, grid, s);
  } else {
    if (g.NW == 1) launch_gemv_k<R, 1, GATHER, GROUPED, FUSE, RES>(p, g.smem, grid, s);
    else if (g.NW == 2 || R >= 4) launch_gemv_k<R, 2, GATHER, GROUPED, FUSE, RES>(p, g.smem, grid, s);
    else launch_gemv_k<R, (R >= 4 ? 2 : 4), GATHER, GROUPED, FUSE, RES>(p, g.smem, grid, s);
  }
}
// grid_y: 1 for a dense call, min(groups, rows) for a grouped one. Dense calls spread their rows
// over grid z; grouped ones loop (a host bound on a group's rows would launch mostly idle CTAs).
template <bool GATHER, bool GROUPED, int FUSE = 0, bool RES = false>
void launch_gemv(Params p, GemvPlan g, int64_t grid_y, cudaStream_t s) {
  QUADS_CHECK(g.R > 0, "w4a4_gemm: K = {} is too long for the GEMV (a row of X must fit in shared memory)", p.K);
  QUADS_CHECK(p.N < (int64_t(1) << 30), "w4a4_gemm: {} weight rows are too many for the GEMV (its indices are 32-bit)", p.N);
  if (GATHER) g.NW = 1;
  const int64_t rows_per_cta = int64_t(kGemvWarps) * g.NW, chunks = GROUPED ? 1 : (p.M + g.R - 1) / g.R;
  QUADS_CHECK(chunks <= 65535, "w4a4_gemm: {} rows are too many for the GEMV", p.M);
  const dim3 grid(static_cast<unsigned>((p.N + rows_per_cta - 1) / rows_per_cta), static_cast<unsigned>(grid_y),
                  static_cast<unsigned>(chunks));
  switch (g.R) {
    case 1: launch_gemv_nw<1, GATHER, GROUPED, FUSE, RES>(p, g, grid, s); break;
    case 2: launch_gemv_nw<2, GATHER, GROUPED, FUSE, RES>(p, g, grid, s); break;
    default: launch_gemv_nw<4, GATHER, GROUPED, FUSE, RES>(p, g, grid, s); break;
  }
}


// The GEMV plan of a grouped call: rows per CTA from the bound on a group's rows (p.M), warps from
// the weight rows of the min(groups, rows) groups that can have rows.
GemvPlan gemv_plan_grouped(const Params& p, int groups, int staged = 1) {
  return gemv_plan(p.K, p.M, std::min<int64_t>(groups, p.Mtot) * p.N, staged);
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

}  // namespace quads::cuda
