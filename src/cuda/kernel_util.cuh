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
// The same over the 16 lanes of a half-warp (lane bits 0..3).
__device__ __forceinline__ double half_sum(double v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float half_max(float v) {
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace quads::cuda::kern
