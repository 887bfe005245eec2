// Small kernels of the GPU trainer (see train_gpu_kernels.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/kernel_util.cuh"
#include "cuda/train_gpu_kernels.h"

namespace quads::cuda::kern {

namespace {

__device__ __forceinline__ uint16_t bf16_bits(float x) { return static_cast<uint16_t>(dev::bf16_encode(x)); }

// One thread per byte of codes (two elements).
__global__ void nvfp4_weight_bf16_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                         const float* __restrict__ amax, int64_t rows, int64_t cols,
                                         uint16_t* __restrict__ out, float* __restrict__ alpha) {
  const int64_t nbytes = rows * cols / 2;
  if (blockIdx.x == 0 && threadIdx.x == 0) *alpha = __fmul_rn(amax[0], 1.f / 2688.f);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nbytes; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = 2 * i, r = e / cols, c = e - r * cols;
    const float sf = dev::e4m3_decode(scales[r * (cols / 16) + c / 16]);
    const uint32_t b = codes[i];
    out[e] = bf16_bits(__fmul_rn(dev::e2m1_decode(b & 15u), sf));
    out[e + 1] = bf16_bits(__fmul_rn(dev::e2m1_decode(b >> 4), sf));
  }
}

__global__ void concat_cols3_kernel(const float* __restrict__ da, const float* __restrict__ db,
                                    const float* __restrict__ dc, int64_t rows, int64_t a, int64_t b, int64_t c,
                                    float* __restrict__ out) {
  const int64_t w = a + b + c, n = rows * w;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / w, col = i - r * w;
    float v;
    if (col < a) v = da[r * a + col];
    else if (col < a + b) v = db[r * b + col - a];
    else v = dc[r * c + col - a - b];
    out[i] = v;
  }
}

__global__ void add_kernel(const float* x, const float* y, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __fadd_rn(x[i], y[i]);
}

__global__ void gather_rows_bf16_kernel(const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t n,
                                        int div, int64_t D, uint16_t* __restrict__ out) {
  const int64_t total = n * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / D, c = i - r * D;
    out[i] = bf16_bits(x[int64_t(idx[r] / div) * D + c]);
  }
}

__global__ void copy_cols_kernel(const float* __restrict__ src, int64_t rows, int64_t sw, float* __restrict__ dst,
                                 int64_t dw) {
  const int64_t n = rows * dw;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / dw, c = i - r * dw;
    dst[i] = c < sw ? src[r * sw + c] : 0.f;
  }
}

__global__ void fill_kernel(float* dst, float v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = v;
}

}  // namespace

void nvfp4_weight_bf16(const uint8_t* codes, const uint8_t* scales, const float* amax, int64_t rows, int64_t cols,
                       uint16_t* out, float* alpha, cudaStream_t s) {
  nvfp4_weight_bf16_kernel<<<grid_for(rows * cols / 2), kThreads, 0, s>>>(codes, scales, amax, rows, cols, out, alpha);
  QUADS_CUDA_LAUNCH_CHECK();
}

void concat_cols3(const float* da, const float* db, const float* dc, int64_t rows, int64_t a, int64_t b, int64_t c,
                  float* out, cudaStream_t s) {
  if (rows * (a + b + c) == 0) return;
  concat_cols3_kernel<<<grid_for(rows * (a + b + c)), kThreads, 0, s>>>(da, db, dc, rows, a, b, c, out);
  QUADS_CUDA_LAUNCH_CHECK();
}

void add(const float* x, const float* y, float* out, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, s>>>(x, y, out, n);
  QUADS_CUDA_LAUNCH_CHECK();
}

void gather_rows_bf16(const float* x, const int32_t* idx, int64_t n, int div, int64_t D, uint16_t* out,
                      cudaStream_t s) {
  if (n * D == 0) return;
  gather_rows_bf16_kernel<<<grid_for(n * D), kThreads, 0, s>>>(x, idx, n, div, D, out);
  QUADS_CUDA_LAUNCH_CHECK();
}

void copy_cols(const float* src, int64_t rows, int64_t sw, float* dst, int64_t dw, cudaStream_t s) {
  if (rows * dw == 0) return;
  copy_cols_kernel<<<grid_for(rows * dw), kThreads, 0, s>>>(src, rows, sw, dst, dw);
  QUADS_CUDA_LAUNCH_CHECK();
}

void fill(float* dst, float v, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kThreads, 0, s>>>(dst, v, n);
  QUADS_CUDA_LAUNCH_CHECK();
}

}  // namespace quads::cuda::kern
