// Device-side MoE routing and the grouped BF16 expert GEMM of the GPU forward (model_kernels.h).
// Nothing here needs the group sizes on the host: the decode step has no host sync.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/kernel_util.cuh"
#include "cuda/model_kernels.h"
#include "cuda/pdl.cuh"

namespace quads::cuda::kern {

namespace {

// A prefill routes T * k = 131k entries (16 x 1024 tokens, top-8): every block of the two kernels
// below reads them all, four consecutive entries a thread a round, so a round of 1024 threads
// covers 4096 entries without a barrier (count) or with two (place). H200, peer model, prefill
// 16 x 1024 (ncu, a layer): count 203 -> 17 us, place 390 -> 91 us (256 threads and an entry a
// thread a round before); prompt tok/s bf16 148.7k -> 153.7k, nvfp4 103.3k -> 105.4k.
constexpr int kRouteThreads = 1024, kRouteEntries = 4;

// The four entries i .. i + 3 (-1 past n: no expert's, and not counted as invalid by the caller).
__device__ __forceinline__ void route_entries(const int32_t* __restrict__ idx, int64_t n, int64_t i, int32_t (&v)[4]) {
  if (i + 3 < n && (reinterpret_cast<uintptr_t>(idx + i) & 15u) == 0) {
    const int4 q = *reinterpret_cast<const int4*>(idx + i);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j < n ? idx[i + j] : -1;
  }
}
// The block's sum of an int (every thread gets it); red: kRouteThreads / 32 ints of shared memory.
__device__ __forceinline__ int route_block_sum(int c, int* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (lane == 0) red[warp] = c;
  __syncthreads();
  int t = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  __syncthreads();
  return t;
}

// Block e counts the entries routed to expert e; block 0 also flags ids outside 0..E-1.
__global__ void __launch_bounds__(kRouteThreads) route_count_kernel(const int32_t* __restrict__ idx, int64_t n, int E,
                                                                    int32_t* __restrict__ counts,
                                                                    unsigned long long* active, int32_t* bad) {
  pdl_begin();
  __shared__ int red[kRouteThreads / 32];
  const int e = blockIdx.x;
  int c = 0, nbad = 0;
  for (int64_t c0 = 0; c0 < n; c0 += int64_t(kRouteEntries) * blockDim.x) {
    const int64_t i = c0 + int64_t(kRouteEntries) * threadIdx.x;
    int32_t v[4];
    route_entries(idx, n, i, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c += v[j] == e;
      nbad += i + j < n && (v[j] < 0 || v[j] >= E);
    }
  }
  c = route_block_sum(c, red);
  const int nb = e == 0 ? route_block_sum(nbad, red) : 0;
  if (threadIdx.x == 0) {
    counts[e] = c;
    if (active && c > 0) atomicAdd(active, 1ull);
    if (bad && nb > 0) *bad = 1;
  }
}

// Block e places its entries in flat-index order after the rows of experts 0..e-1, as
// cpu::moe_permute does: perm[row] = flat index (token * k + slot), inv[flat] = row. Thread t holds
// entries 4t .. 4t + 3 of a round: its matches' rows follow those of threads 0 .. t - 1 (a block
// scan of the threads' match counts).
__global__ void __launch_bounds__(kRouteThreads) route_place_kernel(const int32_t* __restrict__ idx, int64_t n, int E,
                                                                    const int32_t* __restrict__ counts,
                                                                    int32_t* __restrict__ eoff, int32_t* __restrict__ perm,
                                                                    int32_t* __restrict__ inv) {
  pdl_begin();
  __shared__ int wsum[kRouteThreads / 32];
  __shared__ int32_t sbase, stotal;
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (warp == 0) {  // the rows of experts before e, and of all of them
    int b = 0, t = 0;
    for (int j = lane; j < E; j += 32) {
      const int c = counts[j];
      b += j < e ? c : 0;
      t += c;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      b += __shfl_xor_sync(0xffffffffu, b, o);
      t += __shfl_xor_sync(0xffffffffu, t, o);
    }
    if (lane == 0) {
      sbase = b;
      stotal = t;
      eoff[e] = b;
      if (e == E - 1) eoff[E] = t;
    }
  }
  __syncthreads();
  int base = sbase;
  for (int64_t c0 = 0; c0 < n; c0 += int64_t(kRouteEntries) * blockDim.x) {
    const int64_t i = c0 + int64_t(kRouteEntries) * threadIdx.x;
    int32_t v[4];
    route_entries(idx, n, i, v);
    int m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) m += v[j] == e;
    int incl = m;  // inclusive scan over the warp's lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int off = 0, tot = 0;
    for (int w = 0; w < nw; ++w) {
      const int ws = wsum[w];
      off += w < warp ? ws : 0;
      tot += ws;
    }
    int r = base + off + incl - m;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (v[j] == e) {
        perm[r] = static_cast<int32_t>(i + j);
        inv[i + j] = r;
        ++r;
      }
    base += tot;
    __syncthreads();
  }
  // Invalid ids (reported through `bad`) still leave every index in range: their entries read
  // row 0, the rows past the valid ones gather token 0.
  if (e == 0) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      if (idx[i] < 0 || idx[i] >= E) inv[i] = 0;
    for (int64_t r = stotal + threadIdx.x; r < n; r += blockDim.x) perm[r] = 0;
  }
}

constexpr int kGroupRows = 8;  // activation rows per pass over a weight row

// FP32 (fake-quant linears): one warp per weight row n of expert blockIdx.y, for all of the
// expert's rows, kGroupRows at a time: each lane takes 8 consecutive elements per step of 256
// along K; each product rounded, then added (__fmul_rn / __fadd_rn, as the CPU without
// contraction). Lane partials meet in a fixed tree.
__device__ __forceinline__ void load8(const float* p, int64_t i, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p + i));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p + i + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__global__ void grouped_gemv_kernel(const float* __restrict__ x, const float* const* __restrict__ wtab,
                                    const int32_t* __restrict__ eoff, int64_t N, int64_t K, float* __restrict__ y) {
  pdl_begin();
  const int e = blockIdx.y;
  const int64_t mb = eoff[e], me = eoff[e + 1];
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (mb >= me || n >= N) return;  // no barriers in this kernel
  const float* wr = wtab[e];
  const int64_t wrow = n * K;
  for (int64_t r0 = mb; r0 < me; r0 += kGroupRows) {
    const int rows = me - r0 < kGroupRows ? static_cast<int>(me - r0) : kGroupRows;
    float acc[kGroupRows];
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) acc[r] = 0.f;
#pragma unroll 2
    for (int64_t k = int64_t(lane) * 8; k < K; k += 256) {
      float wf[8];
      load8(wr, wrow + k, wf);
#pragma unroll
      for (int r = 0; r < kGroupRows; ++r) {
        if (r < rows) {
          float xf[8];
          load8(x, (r0 + r) * K + k, xf);
          float s = acc[r];
#pragma unroll
          for (int j = 0; j < 8; ++j) s = __fadd_rn(s, __fmul_rn(xf[j], wf[j]));
          acc[r] = s;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) {
      const float v = warp_sum(acc[r]);
      if (lane == 0 && r < rows) y[(r0 + r) * N + n] = v;
    }
  }
}

// BF16 on tensor cores (mma.sync m16n8k16, FP32 accumulation): a CTA owns 32 weight rows (4 n8
// tiles) of expert blockIdx.y, and each warp streams those weight rows with 16-byte loads straight
// into the B fragments. The sum over k is order-free for the MMA, so each lane takes 8 consecutive
// elements of a 32-wide chunk (physical k = 8t .. 8t+7, t = lane % 4) and both operands use that
// same permutation of the fragment's k: A and B need no shuffle or shared memory. An expert with
// at most 16 rows (decode) splits K over the 4 warps, whose partials meet in shared memory in warp
// order (a batch-1 step otherwise had 8 experts x 12 column tiles of single warps streaming the
// whole K); a larger one gives each warp every 4th 16-row chunk over the whole K (the 4 warps share
// the weight slice through L1). BF16 x BF16 products are exact; only the FP32 sums round.
constexpr int kTcWarps = 4, kTcCols = 32;

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

__device__ __forceinline__ uint4 ldg16_or_zero(const uint16_t* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// acc += rows ra / rb (16-row chunk) x the CTA's 32 weight rows over k chunks kb0, kb0 + step, ...
__device__ __forceinline__ void bf16_tc_rows(float (&acc)[4][4], const uint16_t* __restrict__ x,
                                             const uint16_t* __restrict__ W, int64_t ra, int64_t rb, bool va, bool vb,
                                             int64_t n0, int64_t N, int64_t K, int64_t kb0, int64_t step, int g,
                                             int t) {
#pragma unroll 4
  for (int64_t kb = kb0; kb < K; kb += step) {
    const int64_t k = kb + 8 * t;
    const bool vk = k < K;  // K % 8 == 0: a lane's 8 elements are all inside or all outside
    const uint4 xa = ldg16_or_zero(x + ra * K + k, va && vk);
    const uint4 xb = ldg16_or_zero(x + rb * K + k, vb && vk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + 8 * j + g;
      const uint4 wv = ldg16_or_zero(W + n * K + k, n < N && vk);
      mma_bf16_16816(acc[j], xa.x, xb.x, xa.y, xb.y, wv.x, wv.y);
      mma_bf16_16816(acc[j], xa.z, xb.z, xa.w, xb.w, wv.z, wv.w);
    }
  }
}

__device__ __forceinline__ void bf16_tc_store(const float (&acc)[4][4], float* __restrict__ y, int64_t ra, int64_t rb,
                                              bool va, bool vb, int64_t n0, int64_t N, int t) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t n = n0 + 8 * j + 2 * t + c;
      if (n >= N) continue;
      if (va) y[ra * N + n] = acc[j][c];
      if (vb) y[rb * N + n] = acc[j][2 + c];
    }
}

__global__ void __launch_bounds__(32 * kTcWarps)
grouped_bf16_tc_kernel(const uint16_t* __restrict__ x, const uint16_t* const* __restrict__ wtab,
                       const int32_t* __restrict__ eoff, int64_t N, int64_t K, float* __restrict__ y) {
  pdl_begin();
  __shared__ float red[kTcWarps - 1][32][16];
  const int e = blockIdx.y;
  const int64_t mb = eoff[e], me = eoff[e + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t n0 = int64_t(blockIdx.x) * kTcCols;
  if (mb >= me || n0 >= N) return;  // uniform over the CTA: before its only barrier
  const uint16_t* W = wtab[e];
  float acc[4][4];
  if (me - mb <= 16) {
    const int64_t ra = mb + g, rb = mb + g + 8;
    const bool va = ra < me, vb = rb < me;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.f;
    bf16_tc_rows(acc, x, W, ra, rb, va, vb, n0, N, K, 32 * warp, 32 * kTcWarps, g, t);
    if (warp > 0)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) red[warp - 1][lane][4 * j + q] = acc[j][q];
    __syncthreads();
    if (warp > 0) return;
    for (int w = 1; w < kTcWarps; ++w)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[j][q] += red[w - 1][lane][4 * j + q];
    bf16_tc_store(acc, y, ra, rb, va, vb, n0, N, t);
    return;
  }
  for (int64_t r0 = mb + 16 * warp; r0 < me; r0 += 16 * kTcWarps) {
    const int64_t ra = r0 + g, rb = r0 + g + 8;
    const bool va = ra < me, vb = rb < me;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.f;
    bf16_tc_rows(acc, x, W, ra, rb, va, vb, n0, N, K, 0, 32, g, t);
    bf16_tc_store(acc, y, ra, rb, va, vb, n0, N, t);
  }
}

void grouped_gemv(const float* x, const float* const* w_table, int64_t N, int64_t K, int groups, const int32_t* eoff,
                  float* y, cudaStream_t s) {
  QUADS_CHECK(K % 8 == 0, "grouped expert GEMM: K = {} must be a multiple of 8", K);
  QUADS_CHECK(groups > 0 && groups <= 65535, "grouped expert GEMM: {} groups (1..65535)", groups);
  if (N == 0 || K == 0) return;
  constexpr int threads = 256;
  const dim3 grid(static_cast<unsigned>((N + threads / 32 - 1) / (threads / 32)), static_cast<unsigned>(groups));
  launch_pdl(grouped_gemv_kernel, grid, threads, 0, s, x, w_table, eoff, N, K, y);
}

}  // namespace

void moe_route(const int32_t* idx, int64_t n, int E, int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv,
               unsigned long long* active, int32_t* bad, cudaStream_t s) {
  QUADS_CHECK(E > 0 && E <= 65535, "moe_route: {} experts (1..65535)", E);
  QUADS_CHECK(n >= 0 && n < (int64_t(1) << 31), "moe_route: {} entries", n);
  // decode batches (a few hundred entries) fill a round of 256 threads; prefills take 1024
  const int threads = n > int64_t(kRouteEntries) * kRouteThreads ? kRouteThreads : 256;
  launch_pdl(route_count_kernel, E, threads, 0, s, idx, n, E, counts, active, bad);
  launch_pdl(route_place_kernel, E, threads, 0, s, idx, n, E, counts, eoff, perm, inv);
}

void gemm_bf16_grouped(const uint16_t* x, const uint16_t* const* w_table, int64_t N, int64_t K, int groups,
                       const int32_t* eoff, float* y, cudaStream_t s) {
  QUADS_CHECK(K % 8 == 0, "grouped expert GEMM: K = {} must be a multiple of 8", K);
  QUADS_CHECK(groups > 0 && groups <= 65535, "grouped expert GEMM: {} groups (1..65535)", groups);
  if (N == 0 || K == 0) return;
  const dim3 grid(static_cast<unsigned>((N + kTcCols - 1) / kTcCols), static_cast<unsigned>(groups));
  launch_pdl(grouped_bf16_tc_kernel, grid, 32 * kTcWarps, 0, s, x, w_table, eoff, N, K, y);
}

void gemm_f32_grouped(const float* x, const float* const* w_table, int64_t N, int64_t K, int groups,
                      const int32_t* eoff, float* y, cudaStream_t s) {
  grouped_gemv(x, w_table, N, K, groups, eoff, y, s);
}

}  // namespace quads::cuda::kern
