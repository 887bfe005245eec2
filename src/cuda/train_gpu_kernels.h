#pragma once
// Small kernels of the GPU trainer's orchestration (cuda/train_gpu.cpp) that neither the rollout
// kernels (model_kernels.h) nor the trainer's layer kernels (train_kernels.h) cover. Device
// pointers, asynchronous on `s`. C++17-clean.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace quads::cuda::kern {

// The fast path's NVFP4 weight operand: out[r, c] = BF16 bits of e2m1(code) * e4m3(scale) (exact:
// at most 6 significant bits) from codes [rows, cols/2] and row-major scales [rows, cols/16];
// *alpha = amax[0] * fp32(1/2688), the global decode factor as the W4A4 GEMM's epilogue forms it.
void nvfp4_weight_bf16(const uint8_t* codes, const uint8_t* scales, const float* amax, int64_t rows, int64_t cols,
                       uint16_t* out, float* alpha, cudaStream_t s);

// out [rows, a + b + c] = the columns of da [rows, a], db [rows, b], dc [rows, c] side by side
// (the inverse of split_cols3: the fused q/k/v gradient).
void concat_cols3(const float* da, const float* db, const float* dc, int64_t rows, int64_t a, int64_t b, int64_t c,
                  float* out, cudaStream_t s);

// out = x + y (n floats; out may alias either).
void add(const float* x, const float* y, float* out, int64_t n, cudaStream_t s);

// out[r] = BF16 bits of x[idx[r] / div] for r < n, rows of D (kern::gather_rows then to_bf16).
void gather_rows_bf16(const float* x, const int32_t* idx, int64_t n, int div, int64_t D, uint16_t* out,
                      cudaStream_t s);

// dst [rows, dw] = src [rows, sw] with columns past sw zero (dw > sw pads, dw < sw truncates): runs
// the attention kernels at a head_dim they support (zero channels change no score or output).
void copy_cols(const float* src, int64_t rows, int64_t sw, float* dst, int64_t dw, cudaStream_t s);

// dst[i] = v for i < n.
void fill(float* dst, float v, int64_t n, cudaStream_t s);

}  // namespace quads::cuda::kern
