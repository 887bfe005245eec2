// Small kernels of the GPU trainer (see train_gpu_kernels.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/kernel_util.cuh"
#include "cuda/quant_row.cuh"
#include "cuda/train_gpu_kernels.h"
#include "cuda/train_kernels.h"

namespace quads::cuda::kern {

namespace {

__device__ __forceinline__ uint16_t bf16_bits(float x) { return static_cast<uint16_t>(dev::bf16_encode(x)); }

// One thread per byte of codes (two elements).
__global__ void nvfp4_weight_bf16_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                         const float* __restrict__ amax, int64_t rows, int64_t cols,
                                         uint16_t* __restrict__ out, float* __restrict__ alpha) {
  const int64_t nbytes = rows * cols / 2;
  if (blockIdx.x == 0 && threadIdx.x == 0) *alpha = dev::nv_weight_alpha(amax[0]);
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


// ---- The bandwidth versions (kern::legacy_train_kernels() == false): rows over blocks
// (row_grid), columns over threads in 16-byte vectors, no per-element division. Each element gets
// the same arithmetic as in the scalar kernels above, so the bits are the same; the launchers take
// the vector path only where the sizes and pointers allow it, else the scalar row kernels below.

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  return dev::bf16_encode(lo) | (dev::bf16_encode(hi) << 16);
}
__device__ __forceinline__ uint4 bf16x8(float4 a, float4 b) {
  return make_uint4(bf16_pair(a.x, a.y), bf16_pair(a.z, a.w), bf16_pair(b.x, b.y), bf16_pair(b.z, b.w));
}

// out [n, D] = BF16 of rows idx[r] / div of x; V = 8 (D % 8 == 0, 16-byte aligned) or 1.
template <int V>
__global__ void gather_rows_bf16_row_kernel(const float* __restrict__ x, const int32_t* __restrict__ idx, int64_t n,
                                            int div, int64_t D, uint16_t* __restrict__ out) {
  const int64_t cols = D / V;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* src = x + int64_t(idx[r] / div) * D;
    uint16_t* dst = out + r * D;
    for (int64_t c = col0(); c < cols; c += col_step()) {
      if constexpr (V == 8) {
        const float4 a = reinterpret_cast<const float4*>(src)[2 * c], b = reinterpret_cast<const float4*>(src)[2 * c + 1];
        reinterpret_cast<uint4*>(dst)[c] = bf16x8(a, b);
      } else {
        dst[c] = bf16_bits(src[c]);
      }
    }
  }
}

// V = 4: sw, dw multiples of 4, both pointers 16-byte aligned.
template <int V>
__global__ void copy_cols_row_kernel(const float* __restrict__ src, int64_t rows, int64_t sw, float* __restrict__ dst,
                                     int64_t dw) {
  const int64_t cols = dw / V, scols = sw / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    for (int64_t c = col0(); c < cols; c += col_step()) {
      if constexpr (V == 4) {
        reinterpret_cast<float4*>(dst + r * dw)[c] =
            c < scols ? reinterpret_cast<const float4*>(src + r * sw)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        dst[r * dw + c] = c < sw ? src[r * sw + c] : 0.f;
      }
    }
  }
}

template <int V>
__global__ void concat_cols3_row_kernel(const float* __restrict__ da, const float* __restrict__ db,
                                        const float* __restrict__ dc, int64_t rows, int64_t a, int64_t b, int64_t c,
                                        float* __restrict__ out) {
  const int64_t w = (a + b + c) / V, av = a / V, abv = (a + b) / V, bv = b / V, cv = c / V;
  using E = std::conditional_t<V == 4, float4, float>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const E* pa = reinterpret_cast<const E*>(da) + r * av;
    const E* pb = reinterpret_cast<const E*>(db) + r * bv;
    const E* pc = reinterpret_cast<const E*>(dc) + r * cv;
    E* o = reinterpret_cast<E*>(out) + r * w;
    for (int64_t col = col0(); col < w; col += col_step()) o[col] = col < av ? pa[col] : col < abv ? pb[col - av] : pc[col - abv];
  }
}

// n4 float4 groups, then the tail scalar (n - 4 n4 < 4 elements) by the first threads.
__global__ void add_vec_kernel(const float4* x, const float4* y, float4* out, int64_t n4, const float* xs,
                               const float* ys, float* outs, int64_t n) {
  const int64_t i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = i0; i < n4; i += step) {
    const float4 a = x[i], b = y[i];
    out[i] = make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
  }
  if (i0 < n - 4 * n4) outs[4 * n4 + i0] = __fadd_rn(xs[4 * n4 + i0], ys[4 * n4 + i0]);
}

__global__ void fill_vec_kernel(float4* dst, float v, int64_t n4, float* dsts, int64_t n) {
  const int64_t i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = i0; i < n4; i += step) dst[i] = make_float4(v, v, v, v);
  if (i0 < n - 4 * n4) dsts[4 * n4 + i0] = v;
}

bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// nvfp4_weight_bf16_kernel a 16-element scale block per thread (rows over blocks): 8 code bytes in
// one load, one scale, two 16-byte stores. cols % 16 == 0, codes 8-byte and out 16-byte aligned.
__global__ void nvfp4_weight_bf16_row_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                             const float* __restrict__ amax, int64_t rows, int64_t cols,
                                             uint16_t* __restrict__ out, float* __restrict__ alpha) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *alpha = dev::nv_weight_alpha(amax[0]);
  const int64_t nb = cols / 16;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint2* crow = reinterpret_cast<const uint2*>(codes + r * (cols / 2));
    uint4* orow = reinterpret_cast<uint4*>(out + r * cols);
    for (int64_t b = col0(); b < nb; b += col_step()) {
      const uint2 cw = crow[b];
      const float sf = dev::e4m3_decode(scales[r * nb + b]);
      orow[2 * b] = dev::nv_operand_bf16x8(cw.x, sf);
      orow[2 * b + 1] = dev::nv_operand_bf16x8(cw.y, sf);
    }
  }
}

}  // namespace

void nvfp4_weight_bf16(const uint8_t* codes, const uint8_t* scales, const float* amax, int64_t rows, int64_t cols,
                       uint16_t* out, float* alpha, cudaStream_t s) {
  if (!legacy_train_kernels() && rows * cols > 0 && cols % 16 == 0 &&
      (reinterpret_cast<uintptr_t>(codes) & 7u) == 0 && al16(out)) {
    nvfp4_weight_bf16_row_kernel<<<row_grid(rows, cols / 16), row_threads(cols / 16), 0, s>>>(codes, scales, amax, rows,
                                                                                             cols, out, alpha);
    QUADS_CUDA_LAUNCH_CHECK();
    return;
  }
  nvfp4_weight_bf16_kernel<<<grid_for(rows * cols / 2), kThreads, 0, s>>>(codes, scales, amax, rows, cols, out, alpha);
  QUADS_CUDA_LAUNCH_CHECK();
}

void concat_cols3(const float* da, const float* db, const float* dc, int64_t rows, int64_t a, int64_t b, int64_t c,
                  float* out, cudaStream_t s) {
  if (rows * (a + b + c) == 0) return;
  if (!legacy_train_kernels()) {
    const bool v4 = a % 4 == 0 && b % 4 == 0 && c % 4 == 0 && al16(da) && al16(db) && al16(dc) && al16(out);
    const int64_t cols = v4 ? (a + b + c) / 4 : a + b + c;
    if (v4) concat_cols3_row_kernel<4><<<row_grid(rows, cols), row_threads(cols), 0, s>>>(da, db, dc, rows, a, b, c, out);
    else concat_cols3_row_kernel<1><<<row_grid(rows, cols), row_threads(cols), 0, s>>>(da, db, dc, rows, a, b, c, out);
    QUADS_CUDA_LAUNCH_CHECK();
    return;
  }
  concat_cols3_kernel<<<grid_for(rows * (a + b + c)), kThreads, 0, s>>>(da, db, dc, rows, a, b, c, out);
  QUADS_CUDA_LAUNCH_CHECK();
}

void add(const float* x, const float* y, float* out, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  if (!legacy_train_kernels() && al16(x) && al16(y) && al16(out)) {
    const int64_t n4 = n / 4;
    add_vec_kernel<<<grid_for(std::max<int64_t>(n4, 4)), kThreads, 0, s>>>(
        reinterpret_cast<const float4*>(x), reinterpret_cast<const float4*>(y), reinterpret_cast<float4*>(out), n4, x,
        y, out, n);
    QUADS_CUDA_LAUNCH_CHECK();
    return;
  }
  add_kernel<<<grid_for(n), kThreads, 0, s>>>(x, y, out, n);
  QUADS_CUDA_LAUNCH_CHECK();
}

void gather_rows_bf16(const float* x, const int32_t* idx, int64_t n, int div, int64_t D, uint16_t* out,
                      cudaStream_t s) {
  if (n * D == 0) return;
  if (!legacy_train_kernels()) {
    const bool v8 = D % 8 == 0 && al16(x) && al16(out);
    const int64_t cols = v8 ? D / 8 : D;
    if (v8) gather_rows_bf16_row_kernel<8><<<row_grid(n, cols), row_threads(cols), 0, s>>>(x, idx, n, div, D, out);
    else gather_rows_bf16_row_kernel<1><<<row_grid(n, cols), row_threads(cols), 0, s>>>(x, idx, n, div, D, out);
    QUADS_CUDA_LAUNCH_CHECK();
    return;
  }
  gather_rows_bf16_kernel<<<grid_for(n * D), kThreads, 0, s>>>(x, idx, n, div, D, out);
  QUADS_CUDA_LAUNCH_CHECK();
}

void copy_cols(const float* src, int64_t rows, int64_t sw, float* dst, int64_t dw, cudaStream_t s) {
  if (rows * dw == 0) return;
  if (!legacy_train_kernels()) {
    const bool v4 = sw % 4 == 0 && dw % 4 == 0 && al16(src) && al16(dst);
    const int64_t cols = v4 ? dw / 4 : dw;
    if (v4) copy_cols_row_kernel<4><<<row_grid(rows, cols), row_threads(cols), 0, s>>>(src, rows, sw, dst, dw);
    else copy_cols_row_kernel<1><<<row_grid(rows, cols), row_threads(cols), 0, s>>>(src, rows, sw, dst, dw);
    QUADS_CUDA_LAUNCH_CHECK();
    return;
  }
  copy_cols_kernel<<<grid_for(rows * dw), kThreads, 0, s>>>(src, rows, sw, dst, dw);
  QUADS_CUDA_LAUNCH_CHECK();
}

void fill(float* dst, float v, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  if (!legacy_train_kernels() && al16(dst)) {
    const int64_t n4 = n / 4;
    fill_vec_kernel<<<grid_for(std::max<int64_t>(n4, 4)), kThreads, 0, s>>>(reinterpret_cast<float4*>(dst), v, n4,
                                                                            dst, n);
    QUADS_CUDA_LAUNCH_CHECK();
    return;
  }
  fill_kernel<<<grid_for(n), kThreads, 0, s>>>(dst, v, n);
  QUADS_CUDA_LAUNCH_CHECK();
}

}  // namespace quads::cuda::kern
