// Layer kernels of the GPU Qwen3-MoE forward; see model_kernels.h for what each one computes.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/device.h"  // sm_count
#include "cuda/kernel_util.cuh"
#include "cuda/mma_util.cuh"  // cp_async_commit / cp_async_wait
#include "cuda/model_kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/quant.h"  // kXFragMaxRows
#include "cuda/quant_row.cuh"
#include "cuda/train_kernels.h"

namespace quads::cuda::kern {

namespace {


// The softmax of a warp's scores s[0..L) (lane j holds every 32nd), m the lane's running max: s
// becomes exp(s - max) in place (max over the warp, expf and a double sum as the CPU twin does) and
// the return value is 1 / sum, which the caller applies while it sums over V.
__device__ __forceinline__ float warp_softmax_scores(float* s, int64_t L, int lane, float m) {
  m = warp_max(m);
  double sum = 0;
  for (int64_t j = lane; j < L; j += 32) {
    const float e = expf(s[j] - m);
    s[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  __syncwarp();
  return static_cast<float>(1.0 / sum);
}

__device__ __forceinline__ uint16_t bf16_bits(float x) { return static_cast<uint16_t>(dev::bf16_encode(x)); }

__global__ void embedding_kernel(const float* __restrict__ table, const int32_t* __restrict__ tokens, int64_t T,
                                 int64_t H, float* __restrict__ out) {
  pdl_begin();
  const int64_t n = T * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, c = i - t * H;
    out[i] = table[int64_t(tokens[t]) * H + c];
  }
}

// One CTA per row. Sum of squares in double: per-thread strided partials, then a fixed tree.
// yb (optional): the BF16 bits of y as well (kern::to_bf16(y)).
__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w, int64_t D, float eps,
                               float* __restrict__ y, uint16_t* __restrict__ yb) {
  pdl_begin();
  __shared__ double red[kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * D;
  double ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss += double(xr[i]) * double(xr[i]);
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    double v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0;
    v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = static_cast<float>(1.0 / sqrt(red[0] / double(D) + double(eps)));
  float* yr = y + r * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = __fmul_rn(w[i], __fmul_rn(xr[i], inv));
    yr[i] = v;
    if (yb) yb[r * D + i] = bf16_bits(v);
  }
}

// The new tokens' K and V rows of one layer's cache, [T, kvd] each, to/from contiguous buffers
// (ReQAT's KV quantization runs the row quantizer on them); keys lose `shift` on the way out.
__global__ void kv_rows_kernel(float* __restrict__ kcache, float* __restrict__ vcache, const int32_t* __restrict__ slot,
                               const int32_t* __restrict__ pos, int64_t T, int64_t kvd, int64_t max_len,
                               const float* __restrict__ shift, float* __restrict__ kbuf, float* __restrict__ vbuf,
                               bool to_cache) {
  pdl_begin();
  const int64_t total = T * kvd;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / kvd, c = i - t * kvd;
    const int64_t at = (int64_t(slot[t]) * max_len + pos[t]) * kvd + c;
    if (to_cache) {
      kcache[at] = kbuf[i];
      vcache[at] = vbuf[i];
    } else {
      kbuf[i] = shift ? __fsub_rn(kcache[at], shift[c]) : kcache[at];
      vbuf[i] = vcache[at];
    }
  }
}

// Row kernels: blocks over rows (grid-stride), threads (and, for few rows, blockIdx.y) over the
// columns: no 64-bit division per element (which made the per-element grid-stride versions slow
// at prefill sizes) and enough blocks at decode sizes (kern::row_grid).
__global__ void gather_rows_kernel(const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t n, int div,
                                   int64_t D, float* __restrict__ out) {
  pdl_begin();
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* src = x + int64_t(idx[r] / div) * D;
    float* dst = out + r * D;
    if ((D & 3) == 0) {
      for (int64_t c = col0(); c < D / 4; c += col_step())
        reinterpret_cast<float4*>(dst)[c] = reinterpret_cast<const float4*>(src)[c];
    } else {
      for (int64_t c = col0(); c < D; c += col_step()) dst[c] = src[c];
    }
  }
}

// One warp per (token, head) row of hd: RMSNorm (double sum, fixed tree), then RoPE on the pairs
// (i, i + hd/2) as cpu::rope_forward: v[i] = a*c + (-b)*s, v[i+half] = b*c + a*s. Between the two,
// ReQAT's pre-RoPE Q-FIT factor f (when non-null): queries multiplied, keys divided (div), as
// reqat's pre_rope hook does between the norm and RoPE on the CPU.
__device__ void norm_rope_row(const float* __restrict__ src, float* __restrict__ dst, const float* __restrict__ wn,
                              float eps, const float* __restrict__ c, const float* __restrict__ sn, int hd,
                              const float* __restrict__ f = nullptr, bool div = false) {
  const int lane = threadIdx.x & 31;
  double ss = 0;
  for (int i = lane; i < hd; i += 32) ss += double(src[i]) * double(src[i]);
  ss = warp_sum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / double(hd) + double(eps)));
  const int half = hd / 2;
  for (int i = lane; i < half; i += 32) {
    float a = __fmul_rn(wn[i], __fmul_rn(src[i], inv));
    float b = __fmul_rn(wn[i + half], __fmul_rn(src[i + half], inv));
    if (f) {
      a = div ? __fdiv_rn(a, f[i]) : __fmul_rn(a, f[i]);
      b = div ? __fdiv_rn(b, f[i + half]) : __fmul_rn(b, f[i + half]);
    }
    const float lo = __fadd_rn(__fmul_rn(a, c[i]), __fmul_rn(-b, sn[i]));
    const float hi = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, sn[i]));
    dst[i] = lo;
    dst[i + half] = hi;
  }
}

// grid.x = token; warps loop over the nh + 2*nkv rows of that token.
__global__ void qk_norm_rope_store_kernel(float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, const float* __restrict__ qn,
                                          const float* __restrict__ kn, float eps, const float* __restrict__ cos,
                                          const float* __restrict__ sin, const int32_t* __restrict__ slot,
                                          const int32_t* __restrict__ pos, int nh, int nkv, int hd,
                                          float* __restrict__ kcache, float* __restrict__ vcache, int64_t max_len,
                                          const float* __restrict__ prescale) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const float* c = cos + t * (hd / 2);
  const float* sn = sin + t * (hd / 2);
  const int64_t kvd = int64_t(nkv) * hd;
  const int64_t cpos = (int64_t(slot[t]) * max_len + pos[t]) * kvd;
  for (int r = warp; r < nh + 2 * nkv; r += nwarps) {
    if (r < nh) {
      float* row = q + (t * nh + r) * hd;
      norm_rope_row(row, row, qn, eps, c, sn, hd, prescale ? prescale + int64_t(r / (nh / nkv)) * hd : nullptr);
    } else if (r < nh + nkv) {
      const int g = r - nh;
      norm_rope_row(k + (t * nkv + g) * hd, kcache + cpos + int64_t(g) * hd, kn, eps, c, sn, hd,
                    prescale ? prescale + int64_t(g) * hd : nullptr, true);
    } else {
      const int g = r - nh - nkv;
      const float* src = v + (t * nkv + g) * hd;
      float* dst = vcache + cpos + int64_t(g) * hd;
      for (int i = lane; i < hd; i += 32) dst[i] = src[i];
    }
  }
}

// Attention: one warp per (token, query head). Lanes own keys for the scores (j = lane + 32 i, a
// full dot product each, in dimension order), then own dimensions for P·V (keys in order), as the
// CPU computes out = sum_j (p_j * inv) v_j. Shared memory per warp: hd floats of q, ctx scores.
// heads_per_cta x tokens_per_cta warps share a CTA: the query heads (h0 .. h0 + heads_per_cta - 1)
// of tokens_per_cta consecutive tokens (prefill: the same sequence's K/V rows, read by all of them
// through L1). Each warp's arithmetic does not depend on the shape.
__global__ void attention_kernel(const float* __restrict__ q, const float* __restrict__ kcache,
                                 const float* __restrict__ vcache, const int32_t* __restrict__ slot,
                                 const int32_t* __restrict__ pos, int nh, int nkv, int hd, float scale,
                                 int64_t max_len, int64_t max_ctx, int heads_per_cta, int tokens_per_cta, int64_t T,
                                 float* __restrict__ out) {
  pdl_begin();
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.y) * tokens_per_cta + warp / heads_per_cta;
  const int h = blockIdx.x * heads_per_cta + warp % heads_per_cta;
  if (h >= nh || t >= T) return;  // whole warps; the kernel has no block barrier
  const int g = h / (nh / nkv);
  const int64_t L = int64_t(pos[t]) + 1;
  float* qs = smem + int64_t(warp) * (hd + max_ctx);
  float* s = qs + hd;
  const float* qrow = q + (t * nh + h) * hd;
  for (int i = lane; i < hd; i += 32) qs[i] = qrow[i];
  __syncwarp();
  const int64_t kvd = int64_t(nkv) * hd;
  const float* kb = kcache + int64_t(slot[t]) * max_len * kvd + int64_t(g) * hd;
  const float* vb = vcache + int64_t(slot[t]) * max_len * kvd + int64_t(g) * hd;
  float m = -INFINITY;
  for (int64_t j = lane; j < L; j += 32) {
    const float4* kr = reinterpret_cast<const float4*>(kb + j * kvd);
    float acc = 0.f;
    for (int d = 0; d < hd / 4; ++d) {
      const float4 kv = kr[d];
      acc = __fmaf_rn(qs[4 * d], kv.x, acc);
      acc = __fmaf_rn(qs[4 * d + 1], kv.y, acc);
      acc = __fmaf_rn(qs[4 * d + 2], kv.z, acc);
      acc = __fmaf_rn(qs[4 * d + 3], kv.w, acc);
    }
    const float sj = __fmul_rn(acc, scale);
    s[j] = sj;
    m = fmaxf(m, sj);
  }
  const float inv = warp_softmax_scores(s, L, lane, m);
  float* orow = out + (t * nh + h) * hd;
  for (int d = lane; d < hd; d += 32) {
    float a = 0.f;
    for (int64_t j = 0; j < L; ++j) a = __fadd_rn(a, __fmul_rn(__fmul_rn(s[j], inv), vb[j * kvd + d]));
    orow[d] = a;
  }
}

// Prefill attention with K/V tiles in shared memory: a CTA holds heads_per_cta query heads of one
// GQA group for up to tokens_per_cta tokens of ONE slot (blocks[2 b], blocks[2 b + 1]: first token,
// count), and stages kTile keys (then values) at a time for all of its warps. Each warp's arithmetic
// is attention_kernel's, in the same order (lane j owns keys j + 32 i, dot products in dimension
// order; P.V sums keys in order per dimension, a lane owning hd / 32 adjacent dimensions), so the
// results are the same bits.
constexpr int kAttnTile = 32;
__global__ void __launch_bounds__(1024)
attention_tiled_kernel(const float* __restrict__ q, const float* __restrict__ kcache, const float* __restrict__ vcache,
                       const int32_t* __restrict__ slot, const int32_t* __restrict__ pos,
                       const int32_t* __restrict__ blocks, int nh, int nkv, int hd, float scale, int64_t max_len,
                       int64_t max_ctx, int heads_per_cta, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ float smem[];
  __shared__ int64_t lmax_s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int64_t t0 = blocks[2 * blockIdx.y], cnt = blocks[2 * blockIdx.y + 1];
  const int tl = warp / heads_per_cta;
  const int h = blockIdx.x * heads_per_cta + warp % heads_per_cta;
  const bool active = tl < cnt && h < nh;
  const int64_t t = t0 + (tl < cnt ? tl : cnt - 1);  // idle warps still take part in the barriers
  const int g = (blockIdx.x * heads_per_cta) / (nh / nkv);
  const int64_t L = active ? int64_t(pos[t]) + 1 : 0;
  if (threadIdx.x == 0) {
    int64_t m = 0;
    for (int64_t i = 0; i < cnt; ++i) m = max(m, int64_t(pos[t0 + i]) + 1);
    lmax_s = m;
  }
  // Per warp: q then the scores, a stride rounded to 4 floats (float4 reads). K rows padded to
  // hd + 4 floats: lanes read different rows with float4 loads, conflict-free per 8-lane phase.
  const int64_t wstride = (int64_t(hd) + max_ctx + 3) / 4 * 4;
  const int kstride = hd + 4;
  float* qs = smem + int64_t(warp) * wstride;
  float* s = qs + hd;
  float* kt = smem + int64_t(nw) * wstride;  // [kAttnTile][hd + 4]
  float* vt = kt + kAttnTile * kstride;      // [kAttnTile][hd]
  const float* qrow = q + (t * nh + (h < nh ? h : 0)) * hd;
  for (int i = lane; i < hd; i += 32) qs[i] = qrow[i];
  __syncthreads();
  const int64_t Lmax = lmax_s;
  const int64_t kvd = int64_t(nkv) * hd;
  const float* kb = kcache + int64_t(slot[t0]) * max_len * kvd + int64_t(g) * hd;
  const float* vb = vcache + int64_t(slot[t0]) * max_len * kvd + int64_t(g) * hd;
  float m = -INFINITY;
  for (int64_t j0 = 0; j0 < Lmax; j0 += kAttnTile) {
    __syncthreads();
    for (int i = threadIdx.x; i < kAttnTile * hd; i += blockDim.x) {
      const int r = i / hd, d = i - r * hd;
      kt[r * kstride + d] = j0 + r < Lmax ? kb[(j0 + r) * kvd + d] : 0.f;
    }
    __syncthreads();
    const int64_t j = j0 + lane;
    if (active && j < L) {
      const float4* kr = reinterpret_cast<const float4*>(kt + lane * kstride);
      const float4* q4 = reinterpret_cast<const float4*>(qs);
      float acc = 0.f;
      for (int d = 0; d < hd / 4; ++d) {
        const float4 kv = kr[d], qv = q4[d];
        acc = __fmaf_rn(qv.x, kv.x, acc);
        acc = __fmaf_rn(qv.y, kv.y, acc);
        acc = __fmaf_rn(qv.z, kv.z, acc);
        acc = __fmaf_rn(qv.w, kv.w, acc);
      }
      const float sj = __fmul_rn(acc, scale);
      s[j] = sj;
      m = fmaxf(m, sj);
    }
  }
  const float inv = warp_softmax_scores(s, L, lane, m);
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = 0.f;
  const int nd = hd / 32;
  for (int64_t j0 = 0; j0 < Lmax; j0 += kAttnTile) {
    __syncthreads();
    for (int i = threadIdx.x; i < kAttnTile * hd; i += blockDim.x) {
      const int r = i / hd, d = i - r * hd;
      vt[i] = j0 + r < Lmax ? vb[(j0 + r) * kvd + d] : 0.f;
    }
    __syncthreads();
    if (active) {
      // lane owns dimensions lane * nd .. lane * nd + nd - 1 (each summed over keys in order)
      const int64_t jn = L - j0 < kAttnTile ? L - j0 : kAttnTile;
      for (int64_t r = 0; r < jn; ++r) {
        const float p = __fmul_rn(s[j0 + r], inv);
        const float* vr = vt + r * hd + lane * nd;
        if (nd % 4 == 0) {
#pragma unroll
          for (int i = 0; i < 8; i += 4)
            if (i < nd) {
              const float4 v4 = *reinterpret_cast<const float4*>(vr + i);
              a[i] = __fadd_rn(a[i], __fmul_rn(p, v4.x));
              a[i + 1] = __fadd_rn(a[i + 1], __fmul_rn(p, v4.y));
              a[i + 2] = __fadd_rn(a[i + 2], __fmul_rn(p, v4.z));
              a[i + 3] = __fadd_rn(a[i + 3], __fmul_rn(p, v4.w));
            }
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (i < nd) a[i] = __fadd_rn(a[i], __fmul_rn(p, vr[i]));
        }
      }
    }
  }
  if (active) {
    float* orow = out + (t * nh + h) * hd + lane * nd;
    for (int i = 0; i < nd; ++i) orow[i] = a[i];
  }
}

// Decode attention split over keys (attention_decode_split): CTA (split, kv head g, token t), one
// warp per query head of the group. Keys [split * chunk, min(L, split * chunk + chunk)) pass 32
// at a time through shared memory (K rows padded to hd + 4 floats: conflict-free float4 reads by
// lanes of different rows); lane j scores key j of the tile, the tile's max and sum update an online
// softmax, and lane l accumulates the unnormalized output of dimensions l * hd/32 .. + hd/32.
constexpr int kDecTile = 32;
__global__ void __launch_bounds__(1024)
attention_decode_split_kernel(const float* __restrict__ q, const float* __restrict__ kcache,
                              const float* __restrict__ vcache, const int32_t* __restrict__ slot,
                              const int32_t* __restrict__ pos, int nh, int nkv, int hd, float scale, int64_t max_len,
                              int64_t chunk, float* __restrict__ part_o, float* __restrict__ part_ml,
                              float* __restrict__ out) {
  pdl_begin();
  extern __shared__ float smem[];
  const int G = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nd = hd / 32;
  const int split = blockIdx.x, nsplit = gridDim.x, g = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int h = g * G + warp;
  const int64_t L = int64_t(pos[t]) + 1;
  const int64_t j0 = int64_t(split) * chunk, j1 = min(L, j0 + chunk);
  const int kstride = hd + 4, h4 = hd / 4;
  float* qs = smem;                   // [G][hd]
  float* kt = qs + G * hd;            // [kDecTile][hd + 4]
  float* vt = kt + kDecTile * kstride;  // [kDecTile][hd]
  for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = q[(t * nh + int64_t(g) * G) * hd + i];
  const int64_t kvd = int64_t(nkv) * hd;
  const float* kb = kcache + int64_t(slot[t]) * max_len * kvd + int64_t(g) * hd;
  const float* vb = vcache + int64_t(slot[t]) * max_len * kvd + int64_t(g) * hd;
  float m = -INFINITY, l = 0.f, acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  const float* qw = qs + warp * hd;
  for (int64_t jt = j0; jt < j1; jt += kDecTile) {
    const int n = static_cast<int>(min(int64_t(kDecTile), j1 - jt));
    __syncthreads();  // the previous tile is consumed (and qs written, the first time)
    for (int i = threadIdx.x; i < kDecTile * h4; i += blockDim.x) {
      const int r = i / h4, c = i - r * h4;
      float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
      if (r < n) {
        kv = *reinterpret_cast<const float4*>(kb + (jt + r) * kvd + 4 * c);
        vv = *reinterpret_cast<const float4*>(vb + (jt + r) * kvd + 4 * c);
      }
      *reinterpret_cast<float4*>(kt + r * kstride + 4 * c) = kv;
      *reinterpret_cast<float4*>(vt + r * hd + 4 * c) = vv;
    }
    __syncthreads();
    float sj = -INFINITY;
    if (lane < n) {
      const float4* kr = reinterpret_cast<const float4*>(kt + lane * kstride);
      const float4* q4 = reinterpret_cast<const float4*>(qw);
      float a = 0.f;
      for (int d = 0; d < h4; ++d) {
        const float4 kv = kr[d], qv = q4[d];
        a = __fmaf_rn(qv.x, kv.x, a);
        a = __fmaf_rn(qv.y, kv.y, a);
        a = __fmaf_rn(qv.z, kv.z, a);
        a = __fmaf_rn(qv.w, kv.w, a);
      }
      sj = __fmul_rn(a, scale);
    }
    const float mnew = fmaxf(m, warp_max(sj));
    const float corr = m == -INFINITY ? 0.f : expf(m - mnew);
    const float p = lane < n ? expf(sj - mnew) : 0.f;
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= corr;
    for (int r = 0; r < n; ++r) {
      const float pr = __shfl_sync(0xffffffffu, p, r);
      const float* vr = vt + r * hd + lane * nd;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < nd) acc[i] = __fmaf_rn(pr, vr[i], acc[i]);
    }
    m = mnew;
  }
  const int64_t th = t * nh + h;
  if (nsplit == 1) {  // j0 = 0 < L: at least one key, l > 0
    const float inv = 1.f / l;
    for (int i = 0; i < nd; ++i) out[th * hd + lane * nd + i] = acc[i] * inv;
    return;
  }
  for (int i = 0; i < nd; ++i) part_o[(th * nsplit + split) * hd + lane * nd + i] = acc[i];
  if (lane == 0) {
    part_ml[2 * (th * nsplit + split)] = m;  // -inf for a split past the context
    part_ml[2 * (th * nsplit + split) + 1] = l;
  }
}

// Merges the splits of one (token, head) in split order: a warp, lane l owns hd/32 dimensions.
__global__ void attention_decode_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                              int nsplit, int hd, float* __restrict__ out) {
  pdl_begin();
  const int64_t th = blockIdx.x;
  const int lane = threadIdx.x, nd = hd / 32;
  const float* ml = part_ml + 2 * th * nsplit;
  float M = -INFINITY;
  for (int s = 0; s < nsplit; ++s) M = fmaxf(M, ml[2 * s]);
  float lsum = 0.f, o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = 0.f;
  for (int s = 0; s < nsplit; ++s) {
    if (ml[2 * s] == -INFINITY) continue;
    const float w = expf(ml[2 * s] - M);
    lsum = __fmaf_rn(w, ml[2 * s + 1], lsum);
    const float* po = part_o + (th * nsplit + s) * hd + lane * nd;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < nd) o[i] = __fmaf_rn(w, po[i], o[i]);
  }
  const float inv = 1.f / lsum;
  for (int i = 0; i < nd; ++i) out[th * hd + lane * nd + i] = o[i] * inv;
}

// The fused kernel's merge of heads th0 .. th0 + NHW - 1 by one warp: attention_decode_merge_kernel's
// operations in its order, but with the loads issued up front (through L2: the partials were written by other
// CTAs of the same launch). Lane s holds split s's (m, l) and weight expf(m - M); the partial rows
// of JC splits are loaded before they are summed in split order. A few memory round trips instead
// of two per split, which is what the merge costs when it runs in the last CTA of a (token, kv head).
// M: the max over the splits, as the merge kernel's running fmaxf (the same value; where it is a
// zero its sign does not change any m - M).
template <int ND, int NHW>
__device__ __forceinline__ void decode_merge_heads(const float* part_o, const float* part_ml, int64_t th0, int nsplit,
                                                   int lane, float* out) {
  constexpr int HD = 32 * ND, JC = NHW * ND >= 16 ? 4 : 8;
  float M[NHW], ms0[NHW], ls0[NHW], lsum[NHW], o[NHW][ND];
#pragma unroll
  for (int u = 0; u < NHW; ++u) {
    const float* ml = part_ml + 2 * (th0 + u) * nsplit;
    ms0[u] = lane < nsplit ? __ldcg(ml + 2 * lane) : -INFINITY;
    ls0[u] = lane < nsplit ? __ldcg(ml + 2 * lane + 1) : 0.f;
    float m = ms0[u];
    for (int s = lane + 32; s < nsplit; s += 32) m = fmaxf(m, __ldcg(ml + 2 * s));
    M[u] = warp_max(m);
    lsum[u] = 0.f;
#pragma unroll
    for (int i = 0; i < ND; ++i) o[u][i] = 0.f;
  }
  for (int s0 = 0; s0 < nsplit; s0 += 32) {
    float ms[NHW], ls[NHW], ws[NHW];
#pragma unroll
    for (int u = 0; u < NHW; ++u) {
      if (s0 == 0) {
        ms[u] = ms0[u];
        ls[u] = ls0[u];
      } else {
        const float* ml = part_ml + 2 * (th0 + u) * nsplit;
        const int s = s0 + lane;
        ms[u] = s < nsplit ? __ldcg(ml + 2 * s) : -INFINITY;
        ls[u] = s < nsplit ? __ldcg(ml + 2 * s + 1) : 0.f;
      }
      ws[u] = ms[u] == -INFINITY ? 0.f : expf(ms[u] - M[u]);
    }
    const int n = min(32, nsplit - s0);
    for (int j0 = 0; j0 < n; j0 += JC) {
      float pv[NHW][JC][ND];
#pragma unroll
      for (int u = 0; u < NHW; ++u)
#pragma unroll
        for (int j = 0; j < JC; ++j) {
          const int sj = min(s0 + j0 + j, nsplit - 1);  // rows past n are loaded (in bounds) but not used
          const float* po = part_o + ((th0 + u) * nsplit + sj) * HD + lane * ND;
#pragma unroll
          for (int i = 0; i < ND; ++i) pv[u][j][i] = __ldcg(po + i);
        }
#pragma unroll
      for (int j = 0; j < JC; ++j) {
#pragma unroll
        for (int u = 0; u < NHW; ++u) {
          // (j0 + j < 32: the shuffles read a valid lane; the conditions below are warp-uniform)
          const float msj = __shfl_sync(0xffffffffu, ms[u], j0 + j);
          const float wj = __shfl_sync(0xffffffffu, ws[u], j0 + j);
          const float lj = __shfl_sync(0xffffffffu, ls[u], j0 + j);
          if (j0 + j < n && msj != -INFINITY) {  // skip rows past n and splits past the context
            lsum[u] = __fmaf_rn(wj, lj, lsum[u]);
#pragma unroll
            for (int i = 0; i < ND; ++i) o[u][i] = __fmaf_rn(wj, pv[u][j][i], o[u][i]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < NHW; ++u) {
    const float inv = 1.f / lsum[u];
#pragma unroll
    for (int i = 0; i < ND; ++i) out[(th0 + u) * HD + lane * ND + i] = __fmul_rn(o[u][i], inv);
  }
}

__global__ void swiglu_kernel(const float* __restrict__ g, const float* __restrict__ u, int64_t ld, int64_t n,
                              int64_t I, float* __restrict__ h) {
  pdl_begin();
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x)
    for (int64_t c = col0(); c < I; c += col_step()) {
      h[r * I + c] = swiglu1(g[r * ld + c], u[r * ld + c]);
    }
}

__global__ void swiglu_bf16_kernel(const float* __restrict__ g, const float* __restrict__ u, int64_t ld, int64_t n,
                                   int64_t I, uint16_t* __restrict__ out, const int32_t* row_lo,
                                   const int32_t* row_hi) {
  pdl_begin();
  const int64_t r_lo = row_lo ? *row_lo : 0, r_hi = row_hi ? *row_hi : n;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    if (r < r_lo || r >= r_hi) continue;
    for (int64_t c = col0(); c < I; c += col_step()) out[r * I + c] = bf16_bits(swiglu1(g[r * ld + c], u[r * ld + c]));
  }
}

__global__ void split_cols3_kernel(const float* __restrict__ src, int64_t rows, int64_t a, int64_t b, int64_t c,
                                   float* __restrict__ da, float* __restrict__ db, float* __restrict__ dc) {
  pdl_begin();
  const int64_t w = a + b + c;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t col = col0(); col < w; col += col_step()) {
      const float v = src[r * w + col];
      if (col < a) da[r * a + col] = v;
      else if (col < a + b) db[r * b + col - a] = v;
      else dc[r * c + col - a - b] = v;
    }
}

__global__ void broadcast_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = *src;
}

__global__ void moe_combine_add_kernel(const float* __restrict__ ye, const int32_t* __restrict__ inv,
                                       const float* __restrict__ w, int64_t T, int k, int64_t D,
                                       float* __restrict__ x) {
  pdl_begin();
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
    for (int64_t c = col0(); c < D; c += col_step()) {
      float acc = 0.f;
      for (int s = 0; s < k; ++s) acc = __fadd_rn(acc, __fmul_rn(w[t * k + s], ye[int64_t(inv[t * k + s]) * D + c]));
      x[t * D + c] = __fadd_rn(x[t * D + c], acc);
    }
}

__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __fadd_rn(y[i], x[i]);
}

__global__ void sub_kernel(const float* x, const float* y, float* out, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __fsub_rn(x[i], y[i]);
}

__global__ void to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ out, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = bf16_bits(x[i]);
}

__global__ void bf16_round_kernel(const float* x, float* out, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __uint_as_float(uint32_t(bf16_bits(x[i])) << 16);
}

// The same conversions 8 elements a thread (two float4 loads, one 16-byte store of 8 BF16), the
// n % 8 tail by the first threads; x and out 16-byte aligned (else the scalar kernels above).
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  return dev::bf16_encode(lo) | (dev::bf16_encode(hi) << 16);
}
__global__ void to_bf16_vec_kernel(const float* __restrict__ x, uint16_t* __restrict__ out, int64_t n) {
  pdl_begin();
  const int64_t n8 = n / 8, i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t i = i0; i < n8; i += step) {
    const float4 a = x4[2 * i], b = x4[2 * i + 1];
    reinterpret_cast<uint4*>(out)[i] =
        make_uint4(bf16_pair(a.x, a.y), bf16_pair(a.z, a.w), bf16_pair(b.x, b.y), bf16_pair(b.z, b.w));
  }
  if (i0 < n - 8 * n8) out[8 * n8 + i0] = bf16_bits(x[8 * n8 + i0]);
}
__device__ __forceinline__ float bf16_rounded(float v) { return __uint_as_float(uint32_t(bf16_bits(v)) << 16); }
__global__ void bf16_round_vec_kernel(const float* x, float* out, int64_t n) {
  pdl_begin();
  const int64_t n4 = n / 4, i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = i0; i < n4; i += step) {
    const float4 a = reinterpret_cast<const float4*>(x)[i];
    reinterpret_cast<float4*>(out)[i] = make_float4(bf16_rounded(a.x), bf16_rounded(a.y), bf16_rounded(a.z), bf16_rounded(a.w));
  }
  if (i0 < n - 4 * n4) out[4 * n4 + i0] = bf16_rounded(x[4 * n4 + i0]);
}
bool aligned_16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// A thread a row: the CPU's order of additions (a diagnostic, not a hot path).
__global__ void row_error_sums_kernel(const float* x, const float* xq, int64_t rows, int64_t cols, double* out) {
  pdl_begin();
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  double e = 0, n = 0;
  for (int64_t c = 0; c < cols; ++c) {
    const double xv = x[r * cols + c], d = __dsub_rn(xv, double(xq[r * cols + c]));
    e = __dadd_rn(e, __dmul_rn(d, d));
    n = __dadd_rn(n, __dmul_rn(xv, xv));
  }
  out[2 * r] = e;
  out[2 * r + 1] = n;
}

// A thread a column, the rows in order (model::rac_energy's order); neighbouring threads read
// neighbouring columns of a row.
__global__ void rac_energy_kernel(const float* x, const float* xq, int64_t rows, int64_t cols, double* energy) {
  pdl_begin();
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  double e = energy[c];
  for (int64_t r = 0; r < rows; ++r) {
    const double d = __dsub_rn(double(x[r * cols + c]), double(xq[r * cols + c]));
    e = __dadd_rn(e, __dmul_rn(d, d));
  }
  energy[c] = e;
}

// The better of two (value, index) candidates: NaN never wins (index < 0: none), then the larger
// value, then the lower index.
__device__ __forceinline__ bool argmax_better(float v, int64_t i, float bv, int64_t bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// The best of columns chunk * per .. + per of a row in a fixed tree. Unchunked (CTA = row) it
// writes the index; chunked (CTA = (chunk, row)) the (value, index) for argmax_merge_kernel.
__global__ void argmax_kernel(const float* __restrict__ x, int64_t cols, int64_t per, int32_t* __restrict__ out,
                              float* __restrict__ pv, int64_t* __restrict__ pi) {
  pdl_begin();
  __shared__ float bv[kThreads];
  __shared__ int64_t bi[kThreads];
  const bool chunked = pv != nullptr;
  const int64_t row = chunked ? blockIdx.y : blockIdx.x, chunk = chunked ? blockIdx.x : 0;
  const int64_t c0 = chunk * per, c1 = min(cols, c0 + per);
  const float* r = x + row * cols;
  float best = -INFINITY;
  int64_t bidx = -1;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    const float v = r[c];
    if (!isnan(v) && (bidx < 0 || v > best)) {
      best = v;
      bidx = c;
    }
  }
  bv[threadIdx.x] = best;
  bi[threadIdx.x] = bidx;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o && argmax_better(bv[threadIdx.x + o], bi[threadIdx.x + o], bv[threadIdx.x], bi[threadIdx.x])) {
      bv[threadIdx.x] = bv[threadIdx.x + o];
      bi[threadIdx.x] = bi[threadIdx.x + o];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  if (!chunked) {
    out[row] = static_cast<int32_t>(bi[0] < 0 ? 0 : bi[0]);
  } else {
    pv[row * gridDim.x + chunk] = bv[0];
    pi[row * gridDim.x + chunk] = bi[0];
  }
}

// One thread per row: the chunks' candidates in chunk order (the same winner as one pass).
__global__ void argmax_merge_kernel(const float* __restrict__ pv, const int64_t* __restrict__ pi, int64_t rows,
                                    int chunks, int32_t* __restrict__ out) {
  pdl_begin();
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float best = -INFINITY;
  int64_t bidx = -1;
  for (int c = 0; c < chunks; ++c)
    if (argmax_better(pv[row * chunks + c], pi[row * chunks + c], best, bidx)) {
      best = pv[row * chunks + c];
      bidx = pi[row * chunks + c];
    }
  out[row] = static_cast<int32_t>(bidx < 0 ? 0 : bidx);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_normal_kernel(float* __restrict__ x, int64_t n, uint64_t seed, float mean, float stddev) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed ^ mix64(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(r >> 40) + 1.f) * (1.f / 16777216.f);  // (0, 1]
    const float u2 = static_cast<float>((r >> 16) & 0xFFFFFF) * (1.f / 16777216.f);
    x[i] = mean + stddev * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
  }
}

// ---------------------------------------------------------------------------------------------
// Decode-step variants (kern::legacy_decode_kernels() == false). Each one's per-element arithmetic
// is the kernel's above (rmsnorm, qk-norm/RoPE, router: the same bits); what changes is how the
// work is spread and how the loads are issued, which is what a decode step's few rows pay for.

// cp.async (sm_80+): a 16-byte global -> shared copy that does not hold a register or stall the
// thread; src_bytes = 0 zero-fills. Older targets copy synchronously.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define QUADS_DEC_CP_ASYNC 1
#endif
__device__ __forceinline__ void dec_cp16(float* smem, const float* gmem, bool ok) {
#ifdef QUADS_DEC_CP_ASYNC
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(ok ? 16 : 0));
#else
  *reinterpret_cast<float4*>(smem) = ok ? *reinterpret_cast<const float4*>(gmem) : make_float4(0.f, 0.f, 0.f, 0.f);
#endif
}

// Shared memory of rmsnorm_reg_kernel's row copy for the quantizer (PER * kThreads floats).
constexpr int yq_rows_smem(int per) { return per * kThreads; }
// With yq.codes (yq's pointers at the row), y is also quantized to NVFP4 as quantize()'s row
// kernel does it (per-row amax; quant_row.cuh's steps): ys (D floats of shared memory, may be the
// buffer xv was read from: each thread overwrites only its own elements) holds the row for the
// 16-element blocks.
__device__ __forceinline__ void rmsnorm_quant_row(uint32_t m, const float* ys, int64_t D, const RowNvfp4& yq) {
  __shared__ uint32_t s_m[kThreads / 32];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) s_m[threadIdx.x >> 5] = m;
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
  m = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) m = max(m, s_m[w]);
  const float amax = dev::u2f(m);
  const dev::NvGlobal g = dev::nv_global<false>(amax);
  for (int64_t b = threadIdx.x; b < D / 16; b += kThreads) {
    float4 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = reinterpret_cast<const float4*>(ys + b * 16)[q];
    const uint32_t bm = max(max(dev::vabsmax(v[0]), dev::vabsmax(v[1])), max(dev::vabsmax(v[2]), dev::vabsmax(v[3])));
    uint32_t sf;
    const uint2 c = dev::nv_quant_block16(v, bm, g, sf);
    reinterpret_cast<uint2*>(yq.codes)[b] = c;
    yq.scales[b] = static_cast<uint8_t>(sf);
    if (yq.frag && yq.frag_row < kXFragMaxRows) x_frag_store(reinterpret_cast<uint4*>(yq.frag), yq.frag_row, b, c, sf, D / 16);
  }
  if (threadIdx.x == 0) *yq.amax = amax;
}

// rmsnorm with the row in registers: thread i holds elements i, i + 256, ... (the old kernel's
// strided partials, summed in the same order), w is fetched before the reduction, and every warp
// finishes the cross-warp tree itself (the same butterfly warp 0 ran), so one barrier, one read of x.
// The row's tail, shared with the fused residual + norm kernel (so both give rmsnorm's bits): xv,
// wv the thread's elements, red kThreads / 32 doubles of shared memory; yb (optional) BF16 bits;
// yq (optional) NVFP4 codes through ys (rmsnorm_quant_row).
// yr may be null (a router CTA other than the row's first writes nothing); yb_s (optional) gets
// the BF16 bits in shared memory too.
template <int PER>
__device__ __forceinline__ void rmsnorm_reg_row(const float (&xv)[PER], const float (&wv)[PER], int64_t D, float eps,
                                                double* red, float* yr, uint16_t* ybr, float* ys = nullptr,
                                                const RowNvfp4& yq = {}, uint16_t* yb_s = nullptr) {
  double ss = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (threadIdx.x + int64_t(i) * kThreads < D) ss += double(xv[i]) * double(xv[i]);
  ss = warp_sum(ss);
  const int lane = threadIdx.x & 31;
  if (lane == 0) red[threadIdx.x >> 5] = ss;
  // The first kThreads threads only (the fused kernel's other warps have left): named barrier 1.
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
  double v = lane < kThreads / 32 ? red[lane] : 0.0;
  v = warp_sum(v);
  const float inv = static_cast<float>(1.0 / sqrt(v / double(D) + double(eps)));
  uint32_t m = 0;  // max |y| as float bits (NaN largest), as quantize()'s absmax
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * kThreads;
    if (c < D) {
      const float y = __fmul_rn(wv[i], __fmul_rn(xv[i], inv));
      if (yr) yr[c] = y;
      if (ybr) ybr[c] = bf16_bits(y);
      if (yb_s) yb_s[c] = bf16_bits(y);
      if (yq.codes) {
        ys[c] = y;
        m = max(m, dev::f2u(y) & 0x7FFFFFFFu);
      }
    }
  }
  if (yq.codes) rmsnorm_quant_row(m, ys, D, yq);
}
// yq's pointers at row r
__device__ __forceinline__ RowNvfp4 row_nvfp4_at(const RowNvfp4& q, int64_t r, int64_t D) {
  if (!q.codes) return q;
  return {q.codes + r * (D / 2), q.scales + r * (D / 16), q.amax + r, q.frag,
          static_cast<int>(r < kXFragMaxRows ? r : kXFragMaxRows)};
}

// Router logits of row r for experts 8 * blockIdx.y + warp from the row's BF16 bits in shared
// memory: lane l takes elements 256 i + 8 l .. + 8 (16-byte loads, the warp's consecutive), then
// a butterfly.
__device__ __forceinline__ int router_expert() {
  return static_cast<int>(blockIdx.y) * (kThreads / 32) + (threadIdx.x >> 5);
}
// PER: the row's 16-byte pieces a lane takes (D <= 256 PER); wpre: those of the weight row, loaded
// before the PDL wait where rr.early, else after it.
template <int PER>
__device__ __forceinline__ void router_weights_load(int64_t D, const RowRouter& rr, uint4 (&wpre)[PER]) {
  const int lane = threadIdx.x & 31, e = router_expert();
  const uint16_t* wr = rr.w + int64_t(e < rr.E ? e : 0) * D;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int64_t c = 8 * lane + 256 * int64_t(i);
    wpre[i] = c < D ? __ldg(reinterpret_cast<const uint4*>(wr + c)) : make_uint4(0, 0, 0, 0);
  }
}
template <int PER>
__device__ __forceinline__ void router_logits_row(const uint16_t* yb_s, int64_t D, const RowRouter& rr, int64_t r,
                                                  const uint4 (&wpre)[PER]) {
  const int lane = threadIdx.x & 31, e = router_expert();
  if (e >= rr.E) return;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int64_t c = 8 * lane + 256 * int64_t(i);
    if (c >= D) break;
    const uint4 wv = wpre[i];
    const uint4 yv = *reinterpret_cast<const uint4*>(yb_s + c);
    const uint32_t ww[4] = {wv.x, wv.y, wv.z, wv.w}, yy[4] = {yv.x, yv.y, yv.z, yv.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc = __fmaf_rn(dev::u2f(ww[q] << 16), dev::u2f(yy[q] << 16), acc);
      acc = __fmaf_rn(dev::u2f(ww[q] & 0xFFFF0000u), dev::u2f(yy[q] & 0xFFFF0000u), acc);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
  if (lane == 0) rr.logits[r * rr.E + e] = acc;
}

// grid (rows, router CTAs): with a router, CTA (r, j) normalizes row r again and takes experts
// 8 j .. 8 j + 7; only j = 0 writes the norm's outputs.
template <int PER>
__global__ void __launch_bounds__(kThreads) rmsnorm_reg_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                                              int64_t D, float eps, float* __restrict__ y,
                                                              uint16_t* __restrict__ yb, const RowNvfp4 yq,
                                                              const RowRouter rr) {
  uint4 wpre[PER];
  if (rr.w && rr.early) router_weights_load<PER>(D, rr, wpre);
  pdl_begin();
  if (rr.w && !rr.early) router_weights_load<PER>(D, rr, wpre);
  __shared__ double red[kThreads / 32];
  __shared__ __align__(16) float ys[yq_rows_smem(PER)];
  __shared__ __align__(16) uint16_t yb_s[PER * kThreads];
  const int64_t r = blockIdx.x;
  const bool lead = blockIdx.y == 0;
  const float* xr = x + r * D;
  float xv[PER], wv[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * kThreads;
    xv[i] = c < D ? xr[c] : 0.f;
    wv[i] = c < D ? w[c] : 0.f;
  }
  rmsnorm_reg_row<PER>(xv, wv, D, eps, red, lead ? y + r * D : nullptr, lead && yb ? yb + r * D : nullptr, ys,
                       lead ? row_nvfp4_at(yq, r, D) : RowNvfp4{}, rr.w ? yb_s : nullptr);
  step_mark0(30);
  if (!rr.w) return;
  __syncthreads();
  router_logits_row<PER>(yb_s, D, rr, r, wpre);
  step_mark0(31);
}

// x[r] += the MoE combine sum_s cw[r, s] * ye[inv[r*k + s]] (moe_combine_add's operations; inv null:
// += ye[r], add_inplace's), then y = rmsnorm(x) (rmsnorm_reg_row: the same bits as the two kernels).
// One CTA per row of BD threads. The residual update runs over all BD threads (element c = tid + j*BD,
// the k addend rows loaded 8 at a time so that many loads are in flight: at batch 1 the CTA reads
// k rows of D floats alone); the new row then goes through shared memory to the first 256 threads in
// rmsnorm_reg's layout (PER elements each) for the sum of squares and the output.
template <int PER, int BD>
__global__ void __launch_bounds__(BD)
residual_rmsnorm_kernel(const float* __restrict__ ye, const int32_t* __restrict__ inv, const float* __restrict__ cw,
                        int k, int64_t D, float* __restrict__ x, const float* __restrict__ w, float eps,
                        float* __restrict__ y, uint16_t* __restrict__ yb, const RowNvfp4 yq, int early) {
  static_assert(BD >= kThreads && BD % kThreads == 0, "the norm needs the first kThreads threads");
  constexpr int PC = (PER * kThreads + BD - 1) / BD, KU = PC >= 8 ? 32 / PC : 8;
  const int64_t r = blockIdx.x;
  // early: the combine's weights and rows (inv, cw) and the norm's weights were written before the
  // previous kernel (the router, two kernels back): the first KU of them, and w, before the wait
  float cw0[KU];
  int32_t inv0[KU];
  float wv[PER];
  auto load_w = [&] {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int64_t c = threadIdx.x + int64_t(i) * kThreads;
      wv[i] = threadIdx.x < kThreads && c < D ? w[c] : 0.f;
    }
  };
  if (early) {
    if (inv)
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        cw0[u] = u < k ? __ldcg(cw + r * k + u) : 0.f;
        inv0[u] = u < k ? __ldcg(inv + r * k + u) : 0;
      }
    load_w();
  }
  pdl_begin();
  __shared__ double red[kThreads / 32];
  extern __shared__ float4 rr_smem4[];
  float* xs = reinterpret_cast<float*>(rr_smem4);  // [D]
  float* xr = x + r * D;
  float acc[PC], xo[PC];
#pragma unroll
  for (int j = 0; j < PC; ++j) {
    const int64_t c = threadIdx.x + int64_t(j) * BD;
    xo[j] = c < D ? xr[c] : 0.f;
    acc[j] = 0.f;
  }
  if (inv) {
    for (int s0 = 0; s0 < k; s0 += KU) {
      float v[KU][PC], ws[KU];
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const bool ok = s0 + u < k;
        const bool pre = early && s0 == 0;
        ws[u] = !ok ? 0.f : pre ? cw0[u] : cw[r * k + s0 + u];
        const float* src = ye + (ok ? int64_t(pre ? inv0[u] : inv[r * k + s0 + u]) * D : 0);
#pragma unroll
        for (int j = 0; j < PC; ++j) {
          const int64_t c = threadIdx.x + int64_t(j) * BD;
          v[u][j] = ok && c < D ? src[c] : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < KU; ++u)
        if (s0 + u < k)
#pragma unroll
          for (int j = 0; j < PC; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(ws[u], v[u][j]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < PC; ++j) {
      const int64_t c = threadIdx.x + int64_t(j) * BD;
      acc[j] = c < D ? ye[r * D + c] : 0.f;
    }
  }
#pragma unroll
  for (int j = 0; j < PC; ++j) {
    const int64_t c = threadIdx.x + int64_t(j) * BD;
    if (c < D) {
      const float nx = __fadd_rn(xo[j], acc[j]);
      xr[c] = nx;
      xs[c] = nx;
    }
  }
  __syncthreads();
  step_mark0(40);
  if (threadIdx.x >= kThreads) return;  // whole warps; rmsnorm_reg_row's barrier counts the first kThreads
  if (!early) load_w();
  float xv[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * kThreads;
    xv[i] = c < D ? xs[c] : 0.f;
  }
  rmsnorm_reg_row<PER>(xv, wv, D, eps, red, y + r * D, yb ? yb + r * D : nullptr, xs, row_nvfp4_at(yq, r, D));
  step_mark0(41);
}

// norm_rope_row with the row in registers (HD = hd known, HD % 64 == 0): lane holds elements
// lane + 32 j, summed in that order as norm_rope_row does, and the RoPE pairs (i, i + HD/2) are
// its registers (j, j + HD/64). Same operations, same bits.
template <int HD>
__device__ __forceinline__ void norm_rope_row_reg(const float* src, float* dst, const float* __restrict__ wn,
                                                  float eps, const float* __restrict__ c,
                                                  const float* __restrict__ sn, const float* __restrict__ f,
                                                  bool div) {
  constexpr int NJ = HD / 32, HJ = NJ / 2;
  const int lane = threadIdx.x & 31;
  float v[NJ], wv[NJ], cv[HJ], sv[HJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    v[j] = src[lane + 32 * j];
    wv[j] = wn[lane + 32 * j];
  }
#pragma unroll
  for (int j = 0; j < HJ; ++j) {
    cv[j] = c[lane + 32 * j];
    sv[j] = sn[lane + 32 * j];
  }
  double ss = 0;
#pragma unroll
  for (int j = 0; j < NJ; ++j) ss += double(v[j]) * double(v[j]);
  ss = warp_sum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / double(HD) + double(eps)));
#pragma unroll
  for (int j = 0; j < HJ; ++j) {
    const int i = lane + 32 * j;
    float a = __fmul_rn(wv[j], __fmul_rn(v[j], inv));
    float b = __fmul_rn(wv[j + HJ], __fmul_rn(v[j + HJ], inv));
    if (f) {
      a = div ? __fdiv_rn(a, f[i]) : __fmul_rn(a, f[i]);
      b = div ? __fdiv_rn(b, f[i + HD / 2]) : __fmul_rn(b, f[i + HD / 2]);
    }
    dst[i] = __fadd_rn(__fmul_rn(a, cv[j]), __fmul_rn(-b, sv[j]));
    dst[i + HD / 2] = __fadd_rn(__fmul_rn(b, cv[j]), __fmul_rn(a, sv[j]));
  }
}

// One warp per head row: grid (ceil(rows / warps), T), so a token's nh + 2 nkv rows run on many SMs
// at once instead of one CTA walking them. HD = 0: any even hd (norm_rope_row). Token t's rows of
// q, k, v start at t * ldq, t * ldk, t * ldv (separate buffers, or the fused q/k/v product's row
// [q | k | v]); q goes to qdst [T, nh, hd] (qdst == qsrc: in place).
constexpr int kQkWarps = 4;
template <int HD>
__global__ void __launch_bounds__(32 * kQkWarps)
qk_norm_rope_store_wide_kernel(const float* qsrc, int64_t ldq, float* qdst, const float* __restrict__ k, int64_t ldk,
                               const float* __restrict__ v, int64_t ldv, const float* __restrict__ qn, const float* __restrict__ kn, float eps,
                               const float* __restrict__ cos, const float* __restrict__ sin,
                               const int32_t* __restrict__ slot, const int32_t* __restrict__ pos, int nh, int nkv,
                               int hd, float* __restrict__ kcache, float* __restrict__ vcache, int64_t max_len,
                               const float* __restrict__ prescale) {
  pdl_begin();
  const int64_t t = blockIdx.y;
  const int r = blockIdx.x * kQkWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= nh + 2 * nkv) return;  // whole warps; no block barrier
  const float* c = cos + t * (hd / 2);
  const float* sn = sin + t * (hd / 2);
  const int64_t kvd = int64_t(nkv) * hd;
  const int64_t cpos = (int64_t(slot[t]) * max_len + pos[t]) * kvd;
  const float* src;
  float* dst;
  const float* f = nullptr;
  bool div = false;
  const float* wn = qn;
  if (r < nh) {
    src = qsrc + t * ldq + int64_t(r) * hd;
    dst = qdst + (t * nh + r) * hd;
    if (prescale) f = prescale + int64_t(r / (nh / nkv)) * hd;
  } else if (r < nh + nkv) {
    const int g = r - nh;
    src = k + t * ldk + int64_t(g) * hd;
    dst = kcache + cpos + int64_t(g) * hd;
    wn = kn;
    if (prescale) f = prescale + int64_t(g) * hd;
    div = true;
  } else {
    const int g = r - nh - nkv;
    const float* s = v + t * ldv + int64_t(g) * hd;
    float* d = vcache + cpos + int64_t(g) * hd;
    for (int i = lane; i < hd; i += 32) d[i] = s[i];
    return;
  }
  if constexpr (HD > 0) norm_rope_row_reg<HD>(src, dst, wn, eps, c, sn, f, div);
  else norm_rope_row(src, dst, wn, eps, c, sn, hd, f, div);
}

// Decode attention split over keys, pipelined (attention_decode_split's new path). CTA (split, kv
// head g, token t) has G / HPW warps; warp w owns query heads w*HPW .. w*HPW + HPW - 1 of the group,
// so each K row and V row read from shared memory serves HPW heads. Keys pass kDecTile at a time
// through a two-stage cp.async ring: the next tile's copy is in flight while this one is scored.
// Scores: lane j dots key j of the tile with each head's q (four interleaved partial sums, added in
// a fixed order). Online softmax per head (running max over the warp; each lane keeps its own
// partial sum of exp, summed over the warp at the end). P.V: the tile's probabilities go through
// shared memory; lane l owns dimensions l*ND .. l*ND + ND - 1. Fixed order everywhere: the same
// bits for the same inputs whatever the scheduling.
template <int ND, int HPW, bool FUSED>
__global__ void __launch_bounds__(512)
attention_decode_pipe_kernel(const float* __restrict__ q, const float* __restrict__ kcache,
                             const float* __restrict__ vcache, const int32_t* __restrict__ slot,
                             const int32_t* __restrict__ pos, int nh, int nkv, float scale, int64_t max_len,
                             int64_t chunk, float* __restrict__ part_o, float* __restrict__ part_ml,
                             float* __restrict__ out, unsigned* __restrict__ counters, int kv_early) {
  // kv_early: slot, pos and the cache rows before each token's new one were written before the
  // previous kernel (a decode step: only the new row is that kernel's), so the first tile's old
  // rows are copied before the wait and only q and the new row after it.
  if (!kv_early) pdl_begin();
  constexpr int HD = ND * 32, H4 = HD / 4, KS = HD + 4, TILE = 32;
  extern __shared__ float4 dec_smem4[];
  float* smem = reinterpret_cast<float*>(dec_smem4);
  const int nw = blockDim.x >> 5, G = nw * HPW, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int split = blockIdx.x, nsplit = gridDim.x, g = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int64_t L = int64_t(pos[t]) + 1;
  const int64_t j0 = int64_t(split) * chunk, j1 = min(L, j0 + chunk);
  const int ntiles = j1 > j0 ? static_cast<int>((j1 - j0 + TILE - 1) / TILE) : 0;
  float* qs = smem;                  // [G][HD]
  float* ps = qs + G * HD;           // [G][TILE]
  float* kt = ps + G * TILE;         // [2][TILE][KS]
  float* vt = kt + 2 * TILE * KS;    // [2][TILE][HD]
  const int64_t kvd = int64_t(nkv) * HD;
  const float* kb = kcache + int64_t(slot[t]) * max_len * kvd + int64_t(g) * HD;
  const float* vb = vcache + int64_t(slot[t]) * max_len * kvd + int64_t(g) * HD;
  // skip: a row of the tile left out (copied later by load_row), or -1
  auto load = [&](int stage, int64_t jt, int skip = -1) {
    const int64_t n = min(int64_t(TILE), j1 - jt);
    float* ks = kt + stage * TILE * KS;
    float* vs = vt + stage * TILE * HD;
    for (int i = threadIdx.x; i < TILE * H4; i += blockDim.x) {
      const int r = i / H4, c = i - r * H4;
      if (r == skip) continue;
      const bool ok = r < n;
      const int64_t off = (ok ? (jt + r) * kvd : 0) + 4 * c;
      dec_cp16(ks + r * KS + 4 * c, kb + off, ok);
      dec_cp16(vs + r * HD + 4 * c, vb + off, ok);
    }
    cp_async_commit();
  };
  float m[HPW], lsum[HPW], acc[HPW][ND];
#pragma unroll
  for (int u = 0; u < HPW; ++u) {
    m[u] = -INFINITY;
    lsum[u] = 0.f;
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;
  }
  const float* qg = q + (t * nh + int64_t(g) * G) * HD;
  if (kv_early) {
    // the new row L - 1, where it is in the first tile, and q after the wait (a second copy group:
    // the loop's waits count the first tile's two groups as one)
    const int fresh = L - 1 - j0 < TILE ? static_cast<int>(L - 1 - j0) : -1;
    if (ntiles > 0) load(0, j0, fresh);
    pdl_begin();
    if (ntiles > 0) {
      for (int i = threadIdx.x; i < G * H4; i += blockDim.x) dec_cp16(qs + 4 * i, qg + 4 * i, true);
      if (fresh >= 0)
        for (int c = threadIdx.x; c < H4; c += blockDim.x) {
          const int64_t off = (L - 1) * kvd + 4 * c;
          dec_cp16(kt + fresh * KS + 4 * c, kb + off, true);
          dec_cp16(vt + fresh * HD + 4 * c, vb + off, true);
        }
      cp_async_commit();
    }
  } else if (ntiles > 0) {  // q travels in the first tile's copy group: one memory round trip, not two
    for (int i = threadIdx.x; i < G * H4; i += blockDim.x) dec_cp16(qs + 4 * i, qg + 4 * i, true);
    load(0, j0);
  }
  for (int it = 0; it < ntiles; ++it) {
    const int64_t jt = j0 + int64_t(it) * TILE;
    const int n = static_cast<int>(min(int64_t(TILE), j1 - jt));
    if (it + 1 < ntiles) {
      load((it + 1) & 1, jt + TILE);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` (and q) visible to every thread
    if (it == 0) step_mark0(20);
    const float* ks = kt + (it & 1) * TILE * KS;
    const float* vs = vt + (it & 1) * TILE * HD;
    float sj[HPW];
    {
      float a[HPW][4];
#pragma unroll
      for (int u = 0; u < HPW; ++u) a[u][0] = a[u][1] = a[u][2] = a[u][3] = 0.f;
      const float4* kr = reinterpret_cast<const float4*>(ks + lane * KS);
#pragma unroll 8
      for (int d = 0; d < H4; ++d) {
        const float4 kv = kr[d];
#pragma unroll
        for (int u = 0; u < HPW; ++u) {
          const float4 qv = reinterpret_cast<const float4*>(qs + (warp * HPW + u) * HD)[d];
          a[u][0] = __fmaf_rn(qv.x, kv.x, a[u][0]);
          a[u][1] = __fmaf_rn(qv.y, kv.y, a[u][1]);
          a[u][2] = __fmaf_rn(qv.z, kv.z, a[u][2]);
          a[u][3] = __fmaf_rn(qv.w, kv.w, a[u][3]);
        }
      }
#pragma unroll
      for (int u = 0; u < HPW; ++u)
        sj[u] = lane < n ? __fmul_rn(__fadd_rn(__fadd_rn(a[u][0], a[u][1]), __fadd_rn(a[u][2], a[u][3])), scale)
                         : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < HPW; ++u) {
      const float mnew = fmaxf(m[u], warp_max(sj[u]));
      const float corr = m[u] == -INFINITY ? 0.f : expf(m[u] - mnew);
      const float p = lane < n ? expf(sj[u] - mnew) : 0.f;
      lsum[u] = __fmaf_rn(lsum[u], corr, p);
      ps[(warp * HPW + u) * TILE + lane] = p;
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[u][i] = __fmul_rn(acc[u][i], corr);
      m[u] = mnew;
    }
    __syncwarp();
    // Rows past n are zero-filled and their p is 0: the loop runs the whole tile unrolled.
#pragma unroll 4
    for (int r4 = 0; r4 < TILE / 4; ++r4) {
      float pr[HPW][4];
#pragma unroll
      for (int u = 0; u < HPW; ++u) {
        const float4 p4 = reinterpret_cast<const float4*>(ps + (warp * HPW + u) * TILE)[r4];
        pr[u][0] = p4.x;
        pr[u][1] = p4.y;
        pr[u][2] = p4.z;
        pr[u][3] = p4.w;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float* vr = vs + (4 * r4 + e) * HD + lane * ND;
        float vv[ND];
        if constexpr (ND % 4 == 0) {
#pragma unroll
          for (int i = 0; i < ND; i += 4) {
            const float4 x4 = *reinterpret_cast<const float4*>(vr + i);
            vv[i] = x4.x;
            vv[i + 1] = x4.y;
            vv[i + 2] = x4.z;
            vv[i + 3] = x4.w;
          }
        } else if constexpr (ND % 2 == 0) {
#pragma unroll
          for (int i = 0; i < ND; i += 2) {
            const float2 x2 = *reinterpret_cast<const float2*>(vr + i);
            vv[i] = x2.x;
            vv[i + 1] = x2.y;
          }
        } else {
#pragma unroll
          for (int i = 0; i < ND; ++i) vv[i] = vr[i];
        }
#pragma unroll
        for (int u = 0; u < HPW; ++u)
#pragma unroll
          for (int i = 0; i < ND; ++i) acc[u][i] = __fmaf_rn(pr[u][e], vv[i], acc[u][i]);
      }
    }
    __syncthreads();  // stage it & 1 and ps are free for the next tile's copy and scores
  }
#pragma unroll
  for (int u = 0; u < HPW; ++u) {
    const float l = warp_sum(lsum[u]);
    const int64_t th = t * nh + int64_t(g) * G + warp * HPW + u;
    if (nsplit == 1) {  // j0 = 0 < L: at least one key, l > 0
      const float inv = 1.f / l;
#pragma unroll
      for (int i = 0; i < ND; ++i) out[th * HD + lane * ND + i] = __fmul_rn(acc[u][i], inv);
    } else {
#pragma unroll
      for (int i = 0; i < ND; ++i) part_o[(th * nsplit + split) * HD + lane * ND + i] = acc[u][i];
      if (lane == 0) {
        part_ml[2 * (th * nsplit + split)] = m[u];  // -inf for a split past the context
        part_ml[2 * (th * nsplit + split) + 1] = l;
      }
    }
  }
  step_mark0(21);
  // FUSED (attention_decode_fused): the last CTA of (t, g) to finish merges the group's heads, as
  // attention_decode_merge_kernel would, and leaves its counter at 0 for the next launch (a CUDA
  // graph replays the same counters). The unfused instances compile none of this.
  if constexpr (FUSED) {
    if (nsplit == 1) return;
    __shared__ unsigned last_s;
    __threadfence();  // this CTA's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned* cnt = counters + t * nkv + g;
      const unsigned done = atomicAdd(cnt, 1u);
      last_s = done + 1 == unsigned(nsplit);
      if (last_s) {
        *cnt = 0u;
        __threadfence();
      }
    }
    __syncthreads();
    if (!last_s) return;
    if (threadIdx.x == 0 && t == 0 && g == 0) step_mark(22);
    decode_merge_heads<ND, HPW>(part_o, part_ml, t * nh + int64_t(g) * G + warp * HPW, nsplit, lane, out);
    if (threadIdx.x == 0 && t == 0 && g == 0) step_mark(23);
  }
}

}  // namespace

void embedding(const float* table, const int32_t* tokens, int64_t T, int64_t H, float* out, cudaStream_t s) {
  if (T * H == 0) return;
  launch_pdl(embedding_kernel, grid_for(T * H), kThreads, 0, s, table, tokens, T, H, out);
}

namespace {

void rmsnorm_launch(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, uint16_t* yb,
                    bool legacy, cudaStream_t s, const RowNvfp4& yq = {}, const RowRouter& rr = {}) {
  if (rows == 0) return;
  QUADS_CHECK(rows < (int64_t(1) << 31), "cuda rmsnorm: {} rows is too many", rows);
  const int64_t per = (D + kThreads - 1) / kThreads;
  QUADS_CHECK(!yq.codes || (!legacy && per <= 16 && D % 16 == 0),
              "cuda rmsnorm: no NVFP4 output for rows of {} (at most {}, a multiple of 16)", D, 16 * kThreads);
  QUADS_CHECK(!rr.w || (!legacy && router_fusable(rows, D, rr.E)),
              "cuda rmsnorm: no router logits for {} rows of {} and {} experts", rows, D, rr.E);
  const dim3 grid(static_cast<unsigned>(rows), rr.w ? static_cast<unsigned>((rr.E + kThreads / 32 - 1) / (kThreads / 32)) : 1u);
  if (legacy || per > 16) launch_pdl(rmsnorm_kernel, grid.x, kThreads, 0, s, x, w, D, eps, y, yb);
  else if (per <= 1) launch_pdl(rmsnorm_reg_kernel<1>, grid, kThreads, 0, s, x, w, D, eps, y, yb, yq, rr);
  else if (per <= 2) launch_pdl(rmsnorm_reg_kernel<2>, grid, kThreads, 0, s, x, w, D, eps, y, yb, yq, rr);
  else if (per <= 4) launch_pdl(rmsnorm_reg_kernel<4>, grid, kThreads, 0, s, x, w, D, eps, y, yb, yq, rr);
  else if (per <= 8) launch_pdl(rmsnorm_reg_kernel<8>, grid, kThreads, 0, s, x, w, D, eps, y, yb, yq, rr);
  else launch_pdl(rmsnorm_reg_kernel<16>, grid, kThreads, 0, s, x, w, D, eps, y, yb, yq, rr);
}

int& residual_norm_threads_knob() {
  static int threads = 0;
  return threads;
}

// x += (MoE combine or plain addend), then the norm: one kernel for rows of at most 16 * kThreads.
void residual_rmsnorm(const float* ye, const int32_t* inv, const float* cw, int k, int64_t rows, int64_t D, float* x,
                      const float* w_norm, float eps, float* y, uint16_t* yb, cudaStream_t s, const RowNvfp4& yq,
                      bool early = false) {
  if (rows == 0 || D == 0) return;
  QUADS_CHECK(rows < (int64_t(1) << 31), "cuda residual rmsnorm: {} rows is too many", rows);
  const int64_t per = (D + kThreads - 1) / kThreads;
  if (per > 16) {  // wide rows: the two kernels
    if (inv) moe_combine_add(ye, inv, cw, rows, k, D, x, s);
    else add_inplace(x, ye, rows * D, s);
    rmsnorm_launch(x, w_norm, rows, D, eps, y, yb, false, s, yq);
    return;
  }
  QUADS_CHECK(!yq.codes || D % 16 == 0, "cuda residual rmsnorm: no NVFP4 output for rows of {} (a multiple of 16)", D);
  // A few rows (decode): 1024 threads a row, so one CTA has enough loads in flight for its k rows.
  int bd = residual_norm_threads_knob();
  if (bd != 256 && bd != 1024) bd = rows < sm_count() ? 1024 : 256;
  const unsigned grid = static_cast<unsigned>(rows);
  const size_t smem = sizeof(float) * size_t(D);
#define QUADS_RESNORM(PER)                                                                                 \
  do {                                                                                                     \
    if (bd == 1024)                                                                                        \
      launch_pdl(residual_rmsnorm_kernel<PER, 1024>, grid, 1024, smem, s, ye, inv, cw, k, D, x, w_norm, eps, y, yb, \
                 yq, int(early));                                                                          \
    else                                                                                                   \
      launch_pdl(residual_rmsnorm_kernel<PER, kThreads>, grid, kThreads, smem, s, ye, inv, cw, k, D, x, w_norm, eps, y, \
                 yb, yq, int(early));                                                                      \
  } while (0)
  if (per <= 1) QUADS_RESNORM(1);
  else if (per <= 2) QUADS_RESNORM(2);
  else if (per <= 4) QUADS_RESNORM(4);
  else if (per <= 8) QUADS_RESNORM(8);
  else QUADS_RESNORM(16);
#undef QUADS_RESNORM
}

}  // namespace

void rmsnorm(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, cudaStream_t s) {
  rmsnorm_launch(x, w, rows, D, eps, y, nullptr, legacy_decode_kernels(), s);
}

bool router_fusable(int64_t rows, int64_t D, int E) {
  // decode batches (more rows: the BF16 GEMM), rows the register kernel holds, 16-byte loads
  return rows <= 64 && D % 8 == 0 && D <= 16 * kThreads && E > 0 && E <= 65535 * (kThreads / 32);
}

void rmsnorm_bf16(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, uint16_t* y_bf16,
                  cudaStream_t s, const RowNvfp4& yq, const RowRouter& router) {
  rmsnorm_launch(x, w, rows, D, eps, y, y_bf16, false, s, yq, router);
}

void moe_combine_add_rmsnorm(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* x,
                             const float* w_norm, float eps, float* y, uint16_t* y_bf16, cudaStream_t s,
                             const RowNvfp4& yq, bool early) {
  QUADS_CHECK(k > 0, "cuda moe_combine_add_rmsnorm: top-k {}", k);
  residual_rmsnorm(ye, inv, w, k, T, D, x, w_norm, eps, y, y_bf16, s, yq, early);
}

void add_rmsnorm(float* x, const float* t, int64_t rows, int64_t D, const float* w_norm, float eps, float* y,
                 uint16_t* y_bf16, cudaStream_t s, const RowNvfp4& yq) {
  residual_rmsnorm(t, nullptr, nullptr, 0, rows, D, x, w_norm, eps, y, y_bf16, s, yq);
}

void set_residual_norm_threads(int threads) { residual_norm_threads_knob() = threads; }

void gather_rows(const float* x, const int32_t* idx, int64_t n, int div, int64_t D, float* out, cudaStream_t s) {
  if (n * D == 0) return;
  launch_pdl(gather_rows_kernel, row_grid(n, (D & 3) == 0 ? D / 4 : D), row_threads((D & 3) == 0 ? D / 4 : D), 0, s, 
      x, idx, n, div, D, out);
}

namespace {

void qk_wide_launch(const float* qsrc, int64_t ldq, float* qdst, const float* k, int64_t ldk, const float* v,
                    int64_t ldv, const float* qn, const float* kn, float eps, const float* cos, const float* sin,
                    const int32_t* slot, const int32_t* pos, int64_t T, int nh, int nkv, int hd, float* kcache,
                    float* vcache, int64_t max_len, const float* prescale, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((nh + 2 * nkv + kQkWarps - 1) / kQkWarps), static_cast<unsigned>(T));
#define QUADS_QK_WIDE(HD)                                                                                      \
  launch_pdl(qk_norm_rope_store_wide_kernel<HD>, grid, 32 * kQkWarps, 0, s, qsrc, ldq, qdst, k, ldk, v, ldv, qn, kn, eps, \
             cos, sin, slot, pos, nh, nkv, hd, kcache, vcache, max_len, prescale)
  if (hd == 64) QUADS_QK_WIDE(64);
  else if (hd == 128) QUADS_QK_WIDE(128);
  else if (hd == 256) QUADS_QK_WIDE(256);
  else QUADS_QK_WIDE(0);
#undef QUADS_QK_WIDE
}

}  // namespace

void qk_norm_rope_store(float* q, const float* k, const float* v, const float* qn, const float* kn, float eps,
                        const float* cos, const float* sin, const int32_t* slot, const int32_t* pos, int64_t T,
                        int nh, int nkv, int hd, float* kcache, float* vcache, int64_t max_len, cudaStream_t s,
                        const float* prescale) {
  if (T == 0) return;
  QUADS_CHECK(hd % 2 == 0, "cuda qk_norm_rope: head_dim {} must be even", hd);
  if (legacy_decode_kernels() || T >= 65536) {
    launch_pdl(qk_norm_rope_store_kernel, static_cast<unsigned>(T), 256, 0, s, q, k, v, qn, kn, eps, cos, sin, slot, pos, nh,
                                                                       nkv, hd, kcache, vcache, max_len, prescale);
  } else {
    const int64_t kvd = int64_t(nkv) * hd;
    qk_wide_launch(q, int64_t(nh) * hd, q, k, kvd, v, kvd, qn, kn, eps, cos, sin, slot, pos, T, nh, nkv, hd, kcache,
                   vcache, max_len, prescale, s);
  }
  QUADS_CUDA_LAUNCH_CHECK();
}

void qk_norm_rope_store_qkv(const float* qkv, int64_t ld, float* q, const float* qn, const float* kn, float eps,
                            const float* cos, const float* sin, const int32_t* slot, const int32_t* pos, int64_t T,
                            int nh, int nkv, int hd, float* kcache, float* vcache, int64_t max_len, cudaStream_t s,
                            const float* prescale) {
  if (T == 0) return;
  QUADS_CHECK(hd % 2 == 0, "cuda qk_norm_rope_store_qkv: head_dim {} must be even", hd);
  const int64_t qd = int64_t(nh) * hd, kvd = int64_t(nkv) * hd;
  QUADS_CHECK(ld >= qd + 2 * kvd, "cuda qk_norm_rope_store_qkv: row stride {} < q/k/v width {}", ld, qd + 2 * kvd);
  for (int64_t t0 = 0; t0 < T; t0 += 65535) {  // grid.y bounds the tokens of one launch
    const int64_t n = std::min<int64_t>(65535, T - t0);
    const float* row = qkv + t0 * ld;
    qk_wide_launch(row, ld, q + t0 * qd, row + qd, ld, row + qd + kvd, ld, qn, kn, eps, cos + t0 * (hd / 2),
                   sin + t0 * (hd / 2), slot + t0, pos + t0, n, nh, nkv, hd, kcache, vcache, max_len, prescale, s);
  }
}

void kv_rows(float* kcache, float* vcache, const int32_t* slot, const int32_t* pos, int64_t T, int nkv, int hd,
             int64_t max_len, const float* shift, float* kbuf, float* vbuf, bool to_cache, cudaStream_t s) {
  const int64_t kvd = int64_t(nkv) * hd;
  if (T * kvd == 0) return;
  launch_pdl(kv_rows_kernel, grid_for(T * kvd), kThreads, 0, s, kcache, vcache, slot, pos, T, kvd, max_len, shift, kbuf, vbuf,
                                                         to_cache);
}

void attention(const float* q, const float* kcache, const float* vcache, const int32_t* slot, const int32_t* pos,
               int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len, int64_t max_ctx, bool decode,
               float* out, cudaStream_t s, int prefill_tokens_per_cta) {
  if (T == 0) return;
  QUADS_CHECK(hd % 4 == 0, "cuda attention: head_dim {} must be a multiple of 4", hd);
  QUADS_CHECK(nh % nkv == 0, "cuda attention: {} query heads over {} kv heads", nh, nkv);
  // Decode: the query heads of one kv head share a CTA (their K/V rows are read once into L1);
  // prefill: 4 heads of a token per CTA.
  // prefill_tokens_per_cta > 1: the whole GQA group of that many tokens per CTA (at most 32 warps).
  const bool multi = !decode && prefill_tokens_per_cta > 1;
  int per_cta = decode || multi ? nh / nkv : 4;
  per_cta = std::max(1, std::min({per_cta, nh, 8}));
  int tpc = multi ? std::max(1, std::min(prefill_tokens_per_cta, 32 / per_cta)) : 1;
  int dev = 0, max_smem = 0;
  QUADS_CUDA_CHECK(cudaGetDevice(&dev));
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  size_t smem = sizeof(float) * size_t(per_cta) * size_t(tpc) * size_t(hd + max_ctx);
  while (tpc > 1 && smem > size_t(max_smem)) {
    tpc /= 2;
    smem = sizeof(float) * size_t(per_cta) * size_t(tpc) * size_t(hd + max_ctx);
  }
  while (per_cta > 1 && smem > size_t(max_smem)) {
    per_cta /= 2;
    smem = sizeof(float) * size_t(per_cta) * size_t(hd + max_ctx);
  }
  QUADS_CHECK(smem <= size_t(max_smem), "cuda attention: a context of {} positions needs {} bytes of shared memory per "
              "head (the device allows {})", max_ctx, smem, max_smem);
  if (smem > 48 * 1024)
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  QUADS_CHECK(T < 65536, "cuda attention: {} tokens in one step (at most 65535)", T);
  const dim3 grid((nh + per_cta - 1) / per_cta, static_cast<unsigned>((T + tpc - 1) / tpc));
  launch_pdl(attention_kernel, grid, 32 * per_cta * tpc, smem, s, q, kcache, vcache, slot, pos, nh, nkv, hd, scale, max_len,
                                                          max_ctx, per_cta, tpc, T, out);
}

bool attention_decode_split_supported(int nh, int nkv, int hd) {
  return hd % 32 == 0 && hd <= 256 && nkv > 0 && nh % nkv == 0 && nh / nkv <= 32;
}

namespace {

// The pipelined kernel's instance for (ND, HPW), or nullptr where only the old kernel serves.
using DecodePipeFn = void (*)(const float*, const float*, const float*, const int32_t*, const int32_t*, int, int, float,
                              int64_t, int64_t, float*, float*, float*, unsigned*, int);
template <int HPW, bool FUSED>
DecodePipeFn decode_pipe_fn(int nd) {
  switch (nd) {
    case 1: return attention_decode_pipe_kernel<1, HPW, FUSED>;
    case 2: return attention_decode_pipe_kernel<2, HPW, FUSED>;
    case 4: return attention_decode_pipe_kernel<4, HPW, FUSED>;
    case 8: return attention_decode_pipe_kernel<8, HPW, FUSED>;
    default: return nullptr;
  }
}

std::atomic<bool>& legacy_decode_flag() {
  static std::atomic<bool> flag{[] {
    const char* e = std::getenv("QUADS_DECODE_KERNELS");
    return e != nullptr && std::strcmp(e, "old") == 0;
  }()};
  return flag;
}


}  // namespace

void set_legacy_decode_kernels(bool on) { legacy_decode_flag().store(on); }
bool legacy_decode_kernels() { return legacy_decode_flag().load(); }

void attention_decode_split(const float* q, const float* kcache, const float* vcache, const int32_t* slot,
                            const int32_t* pos, int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len,
                            int64_t max_ctx, float* out, cudaStream_t s) {
  attention_decode_split_n(q, kcache, vcache, slot, pos, T, nh, nkv, hd, scale, max_len, max_ctx, out, s, 0);
}

namespace {

// How a decode attention launch runs: the pipelined kernel (pipe, when it has an instance and fits)
// or the old one, the CTA shape, and the split of the keys (nsplit splits of chunk keys).
struct DecodePlan {
  DecodePipeFn pipe = nullptr, pipe_fused = nullptr;  // unfused and fused instances
  int pthreads = 0;
  size_t psmem = 0;
  int64_t nsplit = 1, chunk = 0;
  int64_t nsplit_bound = 1;  // the most splits any context bound up to this one gets (workspace size)
};

// A pipelined instance's opt-in shared memory, raised to `bytes` where it is lower (never lowered:
// one instance serves every group size, and its launches for a larger group must stay valid).
void pipe_smem_optin(DecodePipeFn fn, size_t bytes) {
  static std::vector<std::pair<DecodePipeFn, size_t>> set;
  for (auto& [f, b] : set)
    if (f == fn) {
      if (b < bytes) {
        QUADS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
        b = bytes;
      }
      return;
    }
  QUADS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  set.push_back({fn, bytes});
}

DecodePlan decode_plan(int64_t T, int nh, int nkv, int hd, int64_t max_ctx, int splits, bool allow_pipe) {
  QUADS_CHECK(attention_decode_split_supported(nh, nkv, hd),
              "cuda attention_decode_split: heads {}/{} and head_dim {} unsupported (hd % 32, hd <= 256, group <= 32)",
              nh, nkv, hd);
  QUADS_CHECK(T < 65536 && max_ctx > 0, "cuda attention_decode_split: {} tokens, context {}", T, max_ctx);
  DecodePlan p;
  const int sms = sm_count();
  const int G = nh / nkv, nd = hd / 32;
  const int64_t base = T * nkv, tiles = (max_ctx + kDecTile - 1) / kDecTile;

  // The pipelined kernel where it has an instance: two heads per warp for even groups, at most 16
  // warps, its shared memory within the device's limit.
  const int hpw = G % 2 == 0 ? 2 : 1;
  DecodePipeFn pipe = !allow_pipe ? nullptr : hpw == 2 ? decode_pipe_fn<2, false>(nd) : decode_pipe_fn<1, false>(nd);
  const int pthreads = 32 * G / hpw;
  const size_t psmem = sizeof(float) * (size_t(G) * (hd + kDecTile) + 2 * size_t(kDecTile) * (2 * hd + 4));
  int occ = 0;
  if (pipe && pthreads <= 512) {
    // Per instance and group size: the opt-in shared memory and the resident CTAs per SM.
    static int occ_cache[2][9][33] = {};
    int& oc = occ_cache[hpw - 1][nd][G];
    if (oc == 0) {
      int dev = 0, max_smem = 0;
      QUADS_CUDA_CHECK(cudaGetDevice(&dev));
      QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      oc = -1;
      if (psmem <= size_t(max_smem)) {
        pipe_smem_optin(pipe, psmem);
        int blocks = 0;
        QUADS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, reinterpret_cast<const void*>(pipe),
                                                                       pthreads, psmem));
        oc = blocks > 0 ? blocks : -1;
      }
    }
    occ = oc;
  }
  if (occ > 0) {
    p.pipe = pipe;
    p.pthreads = pthreads;
    p.psmem = psmem;
    // The fused instance runs the same split plan (so the same bits as split + merge); it needs
    // its own shared memory opt-in, and must fit once per SM (its merge adds registers).
    static int fused_ok[2][9][33] = {};
    int& fo = fused_ok[hpw - 1][nd][G];
    DecodePipeFn fused = hpw == 2 ? decode_pipe_fn<2, true>(nd) : decode_pipe_fn<1, true>(nd);
    if (fo == 0) {
      pipe_smem_optin(fused, psmem);
      int blocks = 0;
      QUADS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, reinterpret_cast<const void*>(fused),
                                                                     pthreads, psmem));
      fo = blocks > 0 ? 1 : -1;
    }
    if (fo > 0) p.pipe_fused = fused;
  }

  // Splits: the old kernel aims at about two CTAs per SM; the pipelined one at no more than one
  // wave of resident CTAs (each split at least one 32-key tile either way). On the H200 at batch
  // 64, context 512 (3 CTAs per SM): 1 split 46.8 us, 2 splits 53.3, 3 50.1, 4 48.4, 8 52.7: a
  // second partial wave costs more than the longer key loop, which the pipeline hides.
  int64_t nsplit = p.pipe ? std::max<int64_t>(1, int64_t(occ) * sms / base) : (2 * sms + base - 1) / base;
  static const int env_splits = [] {
    const char* e = std::getenv("QUADS_GPU_ATTN_SPLITS");  // an A/B switch: force the split count
    return e ? std::atoi(e) : 0;
  }();
  if (splits > 0) nsplit = splits;
  else if (env_splits > 0) nsplit = env_splits;
  nsplit = std::clamp<int64_t>(nsplit, 1, tiles);
  p.nsplit_bound = nsplit;
  const int64_t chunk = (tiles + nsplit - 1) / nsplit * kDecTile;
  nsplit = (max_ctx + chunk - 1) / chunk;
  QUADS_CHECK(nsplit < 65536, "cuda attention_decode_split: {} splits", nsplit);
  p.nsplit = nsplit;
  p.chunk = chunk;
  return p;
}

// The fused attention's workspace for T tokens: counters [T * nkv], then part_ml [T, nh, nsplit, 2]
// and part_o [T, nh, nsplit, hd], each part 256-byte aligned.
constexpr size_t kWsAlign = 256;
size_t ws_round(size_t b) { return (b + kWsAlign - 1) / kWsAlign * kWsAlign; }
size_t decode_ws_bytes(int64_t T, int nh, int nkv, int hd, int64_t nsplit) {
  if (nsplit <= 1) return 0;
  return ws_round(sizeof(unsigned) * size_t(T) * nkv) + ws_round(sizeof(float) * 2 * size_t(T) * nh * nsplit) +
         ws_round(sizeof(float) * size_t(T) * nh * nsplit * hd);
}

}  // namespace

int attention_decode_split_n(const float* q, const float* kcache, const float* vcache, const int32_t* slot,
                             const int32_t* pos, int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len,
                             int64_t max_ctx, float* out, cudaStream_t s, int splits, bool kv_early) {
  if (T == 0) return 0;
  const DecodePlan p = decode_plan(T, nh, nkv, hd, max_ctx, splits, !legacy_decode_kernels());
  const int G = nh / nkv;
  const int64_t nsplit = p.nsplit, chunk = p.chunk;
  float *part_o = nullptr, *part_ml = nullptr;
  if (nsplit > 1) {
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&part_o), sizeof(float) * T * nh * nsplit * hd, s));
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&part_ml), sizeof(float) * 2 * T * nh * nsplit, s));
  }
  const dim3 grid(static_cast<unsigned>(nsplit), static_cast<unsigned>(nkv), static_cast<unsigned>(T));
  if (p.pipe) {
    launch_pdl(p.pipe, grid, p.pthreads, p.psmem, s, q, kcache, vcache, slot, pos, nh, nkv, scale, max_len, chunk,
               part_o, part_ml, out, static_cast<unsigned*>(nullptr), int(kv_early));
  } else {
    const size_t smem = sizeof(float) * (size_t(G) * hd + size_t(kDecTile) * (hd + 4) + size_t(kDecTile) * hd);
    static size_t smem_set = 48 * 1024;
    if (smem > smem_set) {
      QUADS_CUDA_CHECK(cudaFuncSetAttribute(attention_decode_split_kernel,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      smem_set = smem;
    }
    launch_pdl(attention_decode_split_kernel, grid, 32 * G, smem, s, q, kcache, vcache, slot, pos, nh, nkv, hd, scale,
                                                             max_len, chunk, part_o, part_ml, out);
  }
  QUADS_CUDA_LAUNCH_CHECK();
  if (nsplit > 1) {
    launch_pdl(attention_decode_merge_kernel, static_cast<unsigned>(T * nh), 32, 0, s, part_o, part_ml,
                                                                                static_cast<int>(nsplit), hd, out);
    QUADS_CUDA_CHECK(cudaFreeAsync(part_o, s));
    QUADS_CUDA_CHECK(cudaFreeAsync(part_ml, s));
  }
  return static_cast<int>(nsplit);
}

size_t attention_decode_fused_workspace(int64_t T, int nh, int nkv, int hd, int64_t max_ctx, int splits) {
  size_t most = 0;
  for (int64_t t = 1; t <= T; ++t) {
    const DecodePlan p = decode_plan(t, nh, nkv, hd, max_ctx, splits, true);
    if (p.pipe_fused) most = std::max(most, decode_ws_bytes(t, nh, nkv, hd, p.nsplit_bound));
  }
  return most;
}

int attention_decode_fused(const float* q, const float* kcache, const float* vcache, const int32_t* slot,
                           const int32_t* pos, int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len,
                           int64_t max_ctx, float* out, void* workspace, size_t workspace_bytes, cudaStream_t s,
                           int splits, bool kv_early) {
  if (T == 0) return 0;
  const DecodePlan p = decode_plan(T, nh, nkv, hd, max_ctx, splits, true);
  if (!p.pipe_fused) {  // no pipelined instance for this shape: the two kernels (current or legacy)
    return attention_decode_split_n(q, kcache, vcache, slot, pos, T, nh, nkv, hd, scale, max_len, max_ctx, out, s,
                                    splits, kv_early);
  }
  const int64_t nsplit = p.nsplit;
  const size_t need = decode_ws_bytes(T, nh, nkv, hd, nsplit);
  QUADS_CHECK(need <= workspace_bytes && (need == 0 || workspace != nullptr),
              "cuda attention_decode_fused: {} tokens in {} splits need {} bytes of workspace, {} given "
              "(size it with attention_decode_fused_workspace)", T, nsplit, need, workspace_bytes);
  unsigned* counters = nullptr;
  float *part_ml = nullptr, *part_o = nullptr;
  if (nsplit > 1) {
    char* w = static_cast<char*>(workspace);
    counters = reinterpret_cast<unsigned*>(w);
    part_ml = reinterpret_cast<float*>(w + ws_round(sizeof(unsigned) * size_t(T) * nkv));
    part_o = reinterpret_cast<float*>(w + ws_round(sizeof(unsigned) * size_t(T) * nkv) +
                                      ws_round(sizeof(float) * 2 * size_t(T) * nh * nsplit));
  }
  const dim3 grid(static_cast<unsigned>(nsplit), static_cast<unsigned>(nkv), static_cast<unsigned>(T));
  launch_pdl(p.pipe_fused, grid, p.pthreads, p.psmem, s, q, kcache, vcache, slot, pos, nh, nkv, scale, max_len,
             p.chunk, part_o, part_ml, out, counters, int(kv_early));
  return static_cast<int>(nsplit);
}

bool attention_tiled_supported(int nh, int nkv, int hd) { return hd % 32 == 0 && hd <= 256 && nh % nkv == 0; }

int attention_tiled_tokens(int nh, int nkv, int hd, int64_t max_ctx, int* heads_per_cta) {
  const int G = nh / nkv;
  int hpc = 1;
  for (int d = 1; d <= std::min(G, 8); ++d)
    if (G % d == 0) hpc = d;
  int tpc = std::max(1, 32 / hpc);
  int dev = 0, max_smem = 0;
  QUADS_CUDA_CHECK(cudaGetDevice(&dev));
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const size_t tiles = sizeof(float) * size_t(kAttnTile) * size_t(2 * hd + 4) + 64;
  const size_t wst = size_t((hd + max_ctx + 3) / 4 * 4);
  while (tpc > 1 && sizeof(float) * size_t(hpc) * tpc * wst + tiles > size_t(max_smem)) tpc /= 2;
  while (hpc > 1 && sizeof(float) * size_t(hpc) * tpc * wst + tiles > size_t(max_smem)) {
    int d = hpc - 1;
    while (d > 1 && G % d) --d;
    hpc = d;
  }
  *heads_per_cta = hpc;
  return tpc;
}

void attention_tiled(const float* q, const float* kcache, const float* vcache, const int32_t* slot, const int32_t* pos,
                     const int32_t* blocks, int64_t nblocks, int nh, int nkv, int hd, float scale, int64_t max_len,
                     int64_t max_ctx, int heads_per_cta, int tokens_per_cta, float* out, cudaStream_t s) {
  if (nblocks == 0) return;
  QUADS_CHECK(attention_tiled_supported(nh, nkv, hd), "cuda attention_tiled: head_dim {} (a multiple of 32, <= 256), "
              "{} heads over {} kv heads", hd, nh, nkv);
  QUADS_CHECK((nh / nkv) % heads_per_cta == 0, "cuda attention_tiled: {} heads per CTA split a group of {}",
              heads_per_cta, nh / nkv);
  QUADS_CHECK(nblocks < 65536, "cuda attention_tiled: {} token blocks (at most 65535)", nblocks);
  const int warps = heads_per_cta * tokens_per_cta;
  QUADS_CHECK(warps >= 1 && warps <= 32, "cuda attention_tiled: {} warps per CTA", warps);
  const size_t wst = size_t((hd + max_ctx + 3) / 4 * 4);
  const size_t smem = sizeof(float) * (size_t(warps) * wst + size_t(kAttnTile) * size_t(2 * hd + 4));
  int dev = 0, max_smem = 0;
  QUADS_CUDA_CHECK(cudaGetDevice(&dev));
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  QUADS_CHECK(smem + 64 <= size_t(max_smem), "cuda attention_tiled: {} bytes of shared memory (the device allows {})",
              smem, max_smem);
  if (smem > 48 * 1024)
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(attention_tiled_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((nh + heads_per_cta - 1) / heads_per_cta), static_cast<unsigned>(nblocks));
  launch_pdl(attention_tiled_kernel, grid, 32 * warps, smem, s, q, kcache, vcache, slot, pos, blocks, nh, nkv, hd, scale,
                                                        max_len, max_ctx, heads_per_cta, out);
}

void swiglu(const float* g, const float* u, int64_t ld, int64_t n, int64_t I, float* h, cudaStream_t s) {
  if (n * I == 0) return;
  launch_pdl(swiglu_kernel, row_grid(n, I), row_threads(I), 0, s, g, u, ld, n, I, h);
}

void swiglu_bf16(const float* g, const float* u, int64_t ld, int64_t n, int64_t I, uint16_t* out, cudaStream_t s,
                 const int32_t* row_lo, const int32_t* row_hi) {
  QUADS_CHECK((row_lo == nullptr) == (row_hi == nullptr), "swiglu_bf16: a row window needs both ends");
  if (n * I == 0) return;
  launch_pdl(swiglu_bf16_kernel, row_grid(n, I), row_threads(I), 0, s, g, u, ld, n, I, out, row_lo, row_hi);
}

void split_cols3(const float* src, int64_t rows, int64_t a, int64_t b, int64_t c, float* da, float* db, float* dc,
                 cudaStream_t s) {
  if (rows * (a + b + c) == 0) return;
  launch_pdl(split_cols3_kernel, row_grid(rows, a + b + c), row_threads(a + b + c), 0, s, src, rows, a, b, c, da, db, dc);
}

void broadcast(const float* src, float* dst, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(broadcast_kernel, grid_for(n), kThreads, 0, s, src, dst, n);
}

void moe_combine_add(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* x,
                     cudaStream_t s) {
  if (T * D == 0) return;
  launch_pdl(moe_combine_add_kernel, row_grid(T, D), row_threads(D), 0, s, ye, inv, w, T, k, D, x);
}

void add_inplace(float* y, const float* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(add_kernel, grid_for(n), kThreads, 0, s, y, x, n);
}

void sub(const float* x, const float* y, float* out, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(sub_kernel, grid_for(n), kThreads, 0, s, x, y, out, n);
}

void to_bf16(const float* x, uint16_t* out, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  if (!legacy_train_kernels() && aligned_16(x) && aligned_16(out)) {
    launch_pdl(to_bf16_vec_kernel, grid_for(std::max<int64_t>(n / 8, 8)), kThreads, 0, s, x, out, n);
    return;
  }
  launch_pdl(to_bf16_kernel, grid_for(n), kThreads, 0, s, x, out, n);
}

void bf16_round(const float* x, float* out, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  if (!legacy_train_kernels() && aligned_16(x) && aligned_16(out)) {
    launch_pdl(bf16_round_vec_kernel, grid_for(std::max<int64_t>(n / 4, 4)), kThreads, 0, s, x, out, n);
    return;
  }
  launch_pdl(bf16_round_kernel, grid_for(n), kThreads, 0, s, x, out, n);
}

void row_error_sums(const float* x, const float* xq, int64_t rows, int64_t cols, double* out, cudaStream_t s) {
  if (rows == 0) return;
  launch_pdl(row_error_sums_kernel, static_cast<int>((rows + 127) / 128), 128, 0, s, x, xq, rows, cols, out);
}

void rac_energy(const float* x, const float* xq, int64_t rows, int64_t cols, double* energy, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  launch_pdl(rac_energy_kernel, static_cast<int>((cols + 127) / 128), 128, 0, s, x, xq, rows, cols, energy);
}

void argmax_rows(const float* x, int64_t rows, int64_t cols, int32_t* out, cudaStream_t s) {
  if (rows == 0) return;
  // A few rows (decode at batch 1: one row of 32000 logits) split their columns over CTAs.
  constexpr int64_t kPer = 4096;
  const int64_t chunks = rows >= 64 || cols <= kPer ? 1 : (cols + kPer - 1) / kPer;
  if (chunks == 1) {
    launch_pdl(argmax_kernel, static_cast<unsigned>(rows), kThreads, 0, s, x, cols, cols, out, nullptr, nullptr);
    return;
  }
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));  // rows < 64
  float* pv = nullptr;
  int64_t* pi = nullptr;
  QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&pv), sizeof(float) * rows * chunks, s));
  QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&pi), sizeof(int64_t) * rows * chunks, s));
  launch_pdl(argmax_kernel, grid, kThreads, 0, s, x, cols, kPer, out, pv, pi);
  launch_pdl(argmax_merge_kernel, static_cast<unsigned>((rows + 63) / 64), 64, 0, s, pv, pi, rows, static_cast<int>(chunks), out);
  QUADS_CUDA_CHECK(cudaFreeAsync(pv, s));
  QUADS_CUDA_CHECK(cudaFreeAsync(pi, s));
}

void fill_normal(float* x, int64_t n, uint64_t seed, float mean, float stddev, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(fill_normal_kernel, grid_for(n), kThreads, 0, s, x, n, seed, mean, stddev);
}

}  // namespace quads::cuda::kern
