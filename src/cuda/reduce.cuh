#pragma once
// Warp reductions shared by the layer kernels (model_kernels.cu, moe_kernels.cu, train_kernels.cu):
// a fixed xor butterfly, so every lane ends with the same value and the result does not depend on
// the launch. Included by .cu files only.
#include <cuda_runtime.h>

namespace quads::cuda::kern {

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
