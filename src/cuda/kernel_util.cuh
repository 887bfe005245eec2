#pragma once
// What the layer kernels share (model_kernels.cu, moe_kernels.cu, train_kernels.cu,
// train_gpu_kernels.cu): the launch size of their grid-stride loops, and warp reductions over a
// fixed xor butterfly, so every lane ends with the same value and the result does not depend on
// the launch. Included by .cu files only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace quads::cuda::kern {

constexpr int kThreads = 256;

// Blocks for n grid-stride work items (at least 1, at most 2^20).
inline int grid_for(int64_t n, int threads = kThreads) {
  const int64_t g = (n + threads - 1) / threads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(g, 1), 1 << 20));
}

// Row kernels: blockIdx.x strides over the rows, threads over a row's `cols` work items, and when
// the rows are few (decode), blockIdx.y splits the columns too so that the grid fills the GPU.
// In the kernel: for (r = blockIdx.x; r < n; r += gridDim.x) for (c = col0(); c < cols; c += col_step()).
inline int row_threads(int64_t cols) {
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, (cols + 31) / 32 * 32)));
}
inline dim3 row_grid(int64_t n, int64_t cols) {
  const int64_t rows = std::min<int64_t>(std::max<int64_t>(n, 1), 1 << 24);
  const int64_t threads = row_threads(cols), chunks = (cols + threads - 1) / threads;
  const int64_t split = rows >= 1024 ? 1 : std::max<int64_t>(1, std::min<int64_t>(chunks, 65535));
  return dim3(static_cast<unsigned>(rows), static_cast<unsigned>(split));
}
__device__ __forceinline__ int64_t col0() { return int64_t(blockIdx.y) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t col_step() { return int64_t(gridDim.y) * blockDim.x; }

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Max of float bits (absmax as integers: NaN above inf), as the quantizers take it.
__device__ __forceinline__ uint32_t warp_max(uint32_t m) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
  return m;
}
// The CTA's max of m (float bits, as above) into *out with one atomicMax (max is order-free: the
// same bits whatever the CTAs' order). Every thread of the CTA calls it (a barrier inside);
// blockDim.x a multiple of 32, at most 1024.
__device__ __forceinline__ void block_atomic_max(uint32_t m, uint32_t* out) {
  __shared__ uint32_t wm[32];
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < blockDim.x / 32 ? wm[threadIdx.x] : 0u;
    m = warp_max(m);
    if (threadIdx.x == 0) atomicMax(out, m);
  }
}
// The same over the 16 lanes of a half-warp (lane bits 0..3).
__device__ __forceinline__ double half_sum(double v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float half_max(float v) {
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// silu(g) * u as cpu::swiglu_forward, operation by operation (no contraction): the one definition
// for kern::swiglu and the kernels that fuse it into their prologue (the W4A4 GEMV).
__device__ __forceinline__ float swiglu1(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}

}  // namespace quads::cuda::kern
