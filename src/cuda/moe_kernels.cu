// Device-side MoE routing and the grouped BF16 expert GEMM of the GPU forward (model_kernels.h).
// Nothing here needs the group sizes on the host: the decode step has no host sync.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/kernel_util.cuh"
#include "cuda/model_kernels.h"

namespace quads::cuda::kern {

namespace {

constexpr int kRouteThreads = 256;

// Block e counts the entries routed to expert e (a fixed number of rounds for every thread, so
// __syncthreads_count is legal); block 0 also flags ids outside 0..E-1.
__global__ void route_count_kernel(const int32_t* __restrict__ idx, int64_t n, int E, int32_t* __restrict__ counts,
                                   unsigned long long* active, int32_t* bad) {
  const int e = blockIdx.x;
  int c = 0, nbad = 0;
  for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
    const int64_t i = c0 + threadIdx.x;
    const int32_t v = i < n ? idx[i] : -1;
    c += __syncthreads_count(i < n && v == e);
    if (e == 0) nbad += __syncthreads_count(i < n && (v < 0 || v >= E));
  }
  if (threadIdx.x == 0) {
    counts[e] = c;
    if (active && c > 0) atomicAdd(active, 1ull);
    if (bad && nbad > 0) *bad = 1;
  }
}

// Block e places its entries in flat-index order after the rows of experts 0..e-1, as
// cpu::moe_permute does: perm[row] = flat index (token * k + slot), inv[flat] = row.
__global__ void route_place_kernel(const int32_t* __restrict__ idx, int64_t n, int E, const int32_t* __restrict__ counts,
                                   int32_t* __restrict__ eoff, int32_t* __restrict__ perm, int32_t* __restrict__ inv) {
  __shared__ int32_t wsum[kRouteThreads / 32];
  __shared__ int32_t sbase, stotal;
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (threadIdx.x == 0) {
    int b = 0;
    for (int j = 0; j < e; ++j) b += counts[j];
    sbase = b;
    eoff[e] = b;
    int t = b;
    for (int j = e; j < E; ++j) t += counts[j];
    stotal = t;
    if (e == E - 1) eoff[E] = t;
  }
  __syncthreads();
  int base = sbase;
  for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
    const int64_t i = c0 + threadIdx.x;
    const bool f = i < n && idx[i] == e;
    const unsigned b = __ballot_sync(0xffffffffu, f);
    if (lane == 0) wsum[warp] = __popc(b);
    __syncthreads();
    int off = 0, tot = 0;
    for (int w = 0; w < nw; ++w) {
      off += w < warp ? wsum[w] : 0;
      tot += wsum[w];
    }
    if (f) {
      const int r = base + off + __popc(b & ((1u << lane) - 1u));
      perm[r] = static_cast<int32_t>(i);
      inv[i] = r;
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

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// One warp per weight row n of expert blockIdx.y, for all of the expert's rows, kGroupRows at a
// time: each lane takes 8 consecutive elements per step of 256 along K. BF16: 16-byte loads; BF16 x
// BF16 products are exact in FP32, so fmaf adds each exact product once. FP32 (fake-quant linears):
// each product rounded, then added (__fmul_rn / __fadd_rn, as the CPU without contraction). Lane
// partials meet in a fixed tree.
template <bool F32>
__device__ __forceinline__ void load8(const void* p, int64_t i, float (&v)[8]) {
  if constexpr (F32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p) + i));
    const float4 b = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p) + i + 4));
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i));
    v[0] = bf16_lo(a.x), v[1] = bf16_hi(a.x), v[2] = bf16_lo(a.y), v[3] = bf16_hi(a.y);
    v[4] = bf16_lo(a.z), v[5] = bf16_hi(a.z), v[6] = bf16_lo(a.w), v[7] = bf16_hi(a.w);
  }
}

template <bool F32>
__global__ void grouped_gemv_kernel(const void* __restrict__ x, const void* const* __restrict__ wtab,
                                    const int32_t* __restrict__ eoff, int64_t N, int64_t K, float* __restrict__ y) {
  const int e = blockIdx.y;
  const int64_t mb = eoff[e], me = eoff[e + 1];
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (mb >= me || n >= N) return;  // no barriers in this kernel
  const void* wr = wtab[e];
  const int64_t wrow = n * K;
  for (int64_t r0 = mb; r0 < me; r0 += kGroupRows) {
    const int rows = me - r0 < kGroupRows ? static_cast<int>(me - r0) : kGroupRows;
    float acc[kGroupRows];
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) acc[r] = 0.f;
#pragma unroll 2
    for (int64_t k = int64_t(lane) * 8; k < K; k += 256) {
      float wf[8];
      load8<F32>(wr, wrow + k, wf);
#pragma unroll
      for (int r = 0; r < kGroupRows; ++r) {
        if (r < rows) {
          float xf[8];
          load8<F32>(x, (r0 + r) * K + k, xf);
          float s = acc[r];
#pragma unroll
          for (int j = 0; j < 8; ++j) s = F32 ? __fadd_rn(s, __fmul_rn(xf[j], wf[j])) : fmaf(xf[j], wf[j], s);
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

template <bool F32>
void grouped_gemv(const void* x, const void* const* w_table, int64_t N, int64_t K, int groups, const int32_t* eoff,
                  float* y, cudaStream_t s) {
  QUADS_CHECK(K % 8 == 0, "grouped expert GEMM: K = {} must be a multiple of 8", K);
  QUADS_CHECK(groups > 0 && groups <= 65535, "grouped expert GEMM: {} groups (1..65535)", groups);
  if (N == 0 || K == 0) return;
  constexpr int threads = 256;
  const dim3 grid(static_cast<unsigned>((N + threads / 32 - 1) / (threads / 32)), static_cast<unsigned>(groups));
  grouped_gemv_kernel<F32><<<grid, threads, 0, s>>>(x, w_table, eoff, N, K, y);
  QUADS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void moe_route(const int32_t* idx, int64_t n, int E, int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv,
               unsigned long long* active, int32_t* bad, cudaStream_t s) {
  QUADS_CHECK(E > 0 && E <= 65535, "moe_route: {} experts (1..65535)", E);
  QUADS_CHECK(n >= 0 && n < (int64_t(1) << 31), "moe_route: {} entries", n);
  route_count_kernel<<<E, kRouteThreads, 0, s>>>(idx, n, E, counts, active, bad);
  QUADS_CUDA_LAUNCH_CHECK();
  route_place_kernel<<<E, kRouteThreads, 0, s>>>(idx, n, E, counts, eoff, perm, inv);
  QUADS_CUDA_LAUNCH_CHECK();
}

void gemm_bf16_grouped(const uint16_t* x, const uint16_t* const* w_table, int64_t N, int64_t K, int groups,
                       const int32_t* eoff, float* y, cudaStream_t s) {
  grouped_gemv<false>(x, reinterpret_cast<const void* const*>(w_table), N, K, groups, eoff, y, s);
}

void gemm_f32_grouped(const float* x, const float* const* w_table, int64_t N, int64_t K, int groups,
                      const int32_t* eoff, float* y, cudaStream_t s) {
  grouped_gemv<true>(x, reinterpret_cast<const void* const*>(w_table), N, K, groups, eoff, y, s);
}

}  // namespace quads::cuda::kern
