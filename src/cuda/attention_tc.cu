// Tensor-core causal attention of the GPU trainer (see attention_tc.h). cuBLAS is column-major: a
// row-major [r, c] matrix with row stride ld is the column-major c x r matrix with the same ld, so
// each GEMM below is written for the transposed product (its comment names the row-major one).
#include "cuda/attention_tc.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/device.h"
#include "cuda/kernel_util.cuh"
#include "cuda/model_kernels.h"
#include "cuda/train_kernels.h"

namespace quads::cuda {

namespace {

constexpr int kRowThreads = 128;  // one CTA per score row in the softmax kernels

__device__ __forceinline__ uint16_t bf16_bits(float x) { return static_cast<uint16_t>(dev::bf16_encode(x)); }

// The grouped layout of one sequence (start s0, length L): [nkv][L g][hd], row r = tl * g + i of
// kv head j holding local token tl of head j * g + i; the sequence's block starts at s0 * nh * hd.
__device__ __forceinline__ int64_t grouped_index(int64_t t, int h, int c, const int32_t* s0, const int32_t* len,
                                                 int nh, int g, int hd) {
  const int64_t start = s0[t], L = len[t], tl = t - start;
  const int j = h / g, i = h - j * g;
  return start * nh * hd + ((int64_t(j) * L + tl) * g + i) * hd + c;
}

// Element type of the GEMM operands: BF16 (tensor cores) or float32 (the FP32 forward).
__device__ __forceinline__ void store_as(uint16_t* p, float v) { *p = bf16_bits(v); }
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }

template <typename T>
__global__ void pack_kernel(const float* __restrict__ src, const int32_t* __restrict__ s0,
                            const int32_t* __restrict__ len, int64_t Tn, int nh, int g, int hd, T* __restrict__ dst) {
  const int64_t row = int64_t(nh) * hd, n = Tn * row;
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < n; x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = x / row, rem = x - t * row;
    const int h = static_cast<int>(rem / hd), c = static_cast<int>(rem - int64_t(h) * hd);
    store_as(dst + grouped_index(t, h, c, s0, len, nh, g, hd), src[x]);
  }
}

__global__ void unpack_f32_kernel(const float* __restrict__ src, const int32_t* __restrict__ s0,
                                  const int32_t* __restrict__ len, int64_t T, int nh, int g, int hd,
                                  float* __restrict__ dst) {
  const int64_t row = int64_t(nh) * hd, n = T * row;
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < n; x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = x / row, rem = x - t * row;
    const int h = static_cast<int>(rem / hd), c = static_cast<int>(rem - int64_t(h) * hd);
    dst[x] = src[grouped_index(t, h, c, s0, len, nh, g, hd)];
  }
}

// D[row] = sum over hd of BF16(dout) * out (rows T * nh), a warp per row, lanes summed in a fixed
// tree. dout rounded as the dP GEMM reads it: where P is one-hot, dP - D is then exactly 0.
__global__ void rowdot_kernel(const float* __restrict__ a, const float* __restrict__ b, int64_t rows, int hd,
                              float* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    float s = 0.f;
    for (int c = lane; c < hd; c += 32) s += dev::u2f(dev::bf16_encode(a[r * hd + c]) << 16) * b[r * hd + c];
    s = kern::warp_sum(s);
    if (lane == 0) out[r] = s;
  }
}

// Block-wide reductions of kRowThreads threads: warps first, then the warps' results in order.
__device__ __forceinline__ float block_max(float v, float* sh) {
  v = kern::warp_max(v);
  const int w = threadIdx.x / 32;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[w] = v;
  __syncthreads();
  float m = sh[0];
  for (int i = 1; i < kRowThreads / 32; ++i) m = fmaxf(m, sh[i]);
  return m;
}
__device__ __forceinline__ float block_sum(float v, float* sh) {
  v = kern::warp_sum(v);
  const int w = threadIdx.x / 32;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[w] = v;
  __syncthreads();
  float s = sh[0];
  for (int i = 1; i < kRowThreads / 32; ++i) s += sh[i];
  return s;
}

// One score row per CTA: grid (M rows of a query block, nkv). Row r of kv head j is local query
// q0 + r / g of head j * g + r % g; keys 0 .. that query are valid, the rest of the Lk columns get
// P = 0. S and P are [nkv][M][ld]. t0s (the FP32 forward's blocks batched over sequences): grid y
// is b * nkv + j for sequence b of the batch, starting at token t0s[b], and S and P are
// [batch * nkv][M][ld]; else grid y is j and the sequence starts at t0.
__device__ __forceinline__ void softmax_head(const int64_t* t0s, int nkv, int64_t& t0, int& j) {
  j = static_cast<int>(blockIdx.y);
  if (t0s) {
    t0 = t0s[j / nkv];
    j %= nkv;
  }
}
template <typename T>
__global__ void softmax_fwd_kernel(const float* __restrict__ S, int64_t ld, int Lk, int64_t M, int q0, int g,
                                   int64_t t0, int nh, float scale, T* __restrict__ P, float* __restrict__ lse,
                                   const int64_t* __restrict__ t0s, int nkv) {
  __shared__ float sh[kRowThreads / 32];
  const int64_t r = blockIdx.x;
  int j;
  softmax_head(t0s, nkv, t0, j);
  const int tl = q0 + static_cast<int>(r / g), i = static_cast<int>(r % g);
  const int n = tl + 1;
  const float* row = S + (int64_t(blockIdx.y) * M + r) * ld;
  T* prow = P + (int64_t(blockIdx.y) * M + r) * ld;
  float m = -INFINITY;
  for (int c = threadIdx.x; c < n; c += kRowThreads) m = fmaxf(m, row[c] * scale);
  m = block_max(m, sh);
  float s = 0.f;
  for (int c = threadIdx.x; c < n; c += kRowThreads) s += expf(row[c] * scale - m);
  s = block_sum(s, sh);
  const float l = m + logf(s);
  for (int c = threadIdx.x; c < Lk; c += kRowThreads) store_as(prow + c, c < n ? expf(row[c] * scale - l) : 0.f);
  if (lse && threadIdx.x == 0) lse[(t0 + tl) * nh + int64_t(j) * g + i] = l;
}

// The backward's element-wise step on the same rows: P = exp(scale S - lse) (the forward's P
// before its BF16 rounding), dS = P (dP - D); both stored BF16, zero above the diagonal.
__global__ void softmax_bwd_kernel(const float* __restrict__ S, const float* __restrict__ dP, int64_t ld, int Lk,
                                   int64_t M, int q0, int g, int64_t t0, int nh, float scale,
                                   const float* __restrict__ lse, const float* __restrict__ D,
                                   uint16_t* __restrict__ P, uint16_t* __restrict__ dS) {
  const int64_t r = blockIdx.x;
  const int j = blockIdx.y;
  const int tl = q0 + static_cast<int>(r / g), i = static_cast<int>(r % g);
  const int n = tl + 1;
  const int64_t off = (int64_t(j) * M + r) * ld;
  const int64_t hrow = (t0 + tl) * nh + int64_t(j) * g + i;
  const float l = lse[hrow], d = D[hrow];
  for (int c = threadIdx.x; c < Lk; c += kRowThreads) {
    uint16_t pb = 0, db = 0;
    if (c < n) {
      const float p = expf(S[off + c] * scale - l);
      pb = bf16_bits(p);
      db = bf16_bits(p * (dP[off + c] - d));
    }
    P[off + c] = pb;
    dS[off + c] = db;
  }
}

// ---- The bandwidth versions of the element-wise kernels above (kern::legacy_train_kernels() ==
// false; same per-element arithmetic, same reduction order, so the same bits).

// 8 consecutive floats as E: BF16 bits in one 16-byte store, or two float4.
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  return dev::bf16_encode(lo) | (dev::bf16_encode(hi) << 16);
}
__device__ __forceinline__ void store8(uint16_t* p, float4 a, float4 b) {
  *reinterpret_cast<uint4*>(p) = make_uint4(bf16_pair(a.x, a.y), bf16_pair(a.z, a.w), bf16_pair(b.x, b.y), bf16_pair(b.z, b.w));
}
__device__ __forceinline__ void store8(float* p, float4 a, float4 b) {
  reinterpret_cast<float4*>(p)[0] = a;
  reinterpret_cast<float4*>(p)[1] = b;
}

// Tokens over blocks, 8-column chunks of a token's nh * hd over threads (hd % 8 == 0, 16-byte
// aligned pointers): one division per 8 elements, 16-byte loads and stores.
template <typename T>
__global__ void pack_row_kernel(const float* __restrict__ src, const int32_t* __restrict__ s0,
                                const int32_t* __restrict__ len, int64_t Tn, int nh, int g, int hd, T* __restrict__ dst) {
  const int per = hd / 8, chunks = nh * per;
  for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
    const float* row = src + t * nh * hd;
    for (int64_t q = kern::col0(); q < chunks; q += kern::col_step()) {
      const int h = static_cast<int>(q) / per, c = (static_cast<int>(q) - h * per) * 8;
      const float4 a = reinterpret_cast<const float4*>(row + h * hd + c)[0];
      const float4 b = reinterpret_cast<const float4*>(row + h * hd + c)[1];
      store8(dst + grouped_index(t, h, c, s0, len, nh, g, hd), a, b);
    }
  }
}

__global__ void unpack_f32_row_kernel(const float* __restrict__ src, const int32_t* __restrict__ s0,
                                      const int32_t* __restrict__ len, int64_t Tn, int nh, int g, int hd,
                                      float* __restrict__ dst) {
  const int per = hd / 8, chunks = nh * per;
  for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
    float* row = dst + t * nh * hd;
    for (int64_t q = kern::col0(); q < chunks; q += kern::col_step()) {
      const int h = static_cast<int>(q) / per, c = (static_cast<int>(q) - h * per) * 8;
      const float4* from = reinterpret_cast<const float4*>(src + grouped_index(t, h, c, s0, len, nh, g, hd));
      const float4 a = from[0], b = from[1];
      store8(row + h * hd + c, a, b);
    }
  }
}

// softmax_fwd_kernel with the row's valid scores read once into registers (K per thread, Lk <= K
// kRowThreads; thread x holds columns x + k kRowThreads, the old kernel's order for its max and
// sum), P staged in shared memory and written in 16-byte stores.
template <typename T, int K>
__global__ void softmax_fwd_reg_kernel(const float* __restrict__ S, int64_t ld, int Lk, int64_t M, int q0, int g,
                                       int64_t t0, int nh, float scale, T* __restrict__ P, float* __restrict__ lse,
                                       const int64_t* __restrict__ t0s, int nkv) {
  __shared__ float sh[kRowThreads / 32];
  __shared__ __align__(16) T stage[K * kRowThreads];
  const int64_t r = blockIdx.x;
  int j;
  softmax_head(t0s, nkv, t0, j);
  const int tl = q0 + static_cast<int>(r / g), i = static_cast<int>(r % g);
  const int n = tl + 1;
  const float* row = S + (int64_t(blockIdx.y) * M + r) * ld;
  T* prow = P + (int64_t(blockIdx.y) * M + r) * ld;
  float x[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * kRowThreads;
    x[k] = c < n ? row[c] : 0.f;
  }
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (threadIdx.x + k * kRowThreads < n) m = fmaxf(m, x[k] * scale);
  m = block_max(m, sh);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (threadIdx.x + k * kRowThreads < n) s += expf(x[k] * scale - m);
  s = block_sum(s, sh);
  const float l = m + logf(s);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * kRowThreads;
    if (c < Lk) store_as(stage + c, c < n ? expf(x[k] * scale - l) : 0.f);
  }
  __syncthreads();
  constexpr int W = 16 / sizeof(T);
  const int nv = Lk / W;
  for (int v = threadIdx.x; v < nv; v += kRowThreads)
    reinterpret_cast<uint4*>(prow)[v] = reinterpret_cast<const uint4*>(stage)[v];
  for (int c = nv * W + threadIdx.x; c < Lk; c += kRowThreads) prow[c] = stage[c];
  if (lse && threadIdx.x == 0) lse[(t0 + tl) * nh + int64_t(j) * g + i] = l;
}

// softmax_bwd_kernel 8 consecutive columns a thread (rows are ld = round8(Lk) apart, so every
// row starts 16-byte aligned): float4 loads of S and dP where a column is valid, 16-byte stores.
__global__ void softmax_bwd_vec_kernel(const float* __restrict__ S, const float* __restrict__ dP, int64_t ld, int Lk,
                                       int64_t M, int q0, int g, int64_t t0, int nh, float scale,
                                       const float* __restrict__ lse, const float* __restrict__ D,
                                       uint16_t* __restrict__ P, uint16_t* __restrict__ dS) {
  const int64_t r = blockIdx.x;
  const int j = blockIdx.y;
  const int tl = q0 + static_cast<int>(r / g), i = static_cast<int>(r % g);
  const int n = tl + 1;
  const int64_t off = (int64_t(j) * M + r) * ld;
  const int64_t hrow = (t0 + tl) * nh + int64_t(j) * g + i;
  const float l = lse[hrow], d = D[hrow];
  for (int c0 = 8 * threadIdx.x; c0 < Lk; c0 += 8 * kRowThreads) {
    uint32_t pb[4] = {0, 0, 0, 0}, db[4] = {0, 0, 0, 0};
    if (c0 < n) {
      float sv[8], gv[8];
      *reinterpret_cast<float4*>(sv) = reinterpret_cast<const float4*>(S + off + c0)[0];
      *reinterpret_cast<float4*>(sv + 4) = reinterpret_cast<const float4*>(S + off + c0)[1];
      *reinterpret_cast<float4*>(gv) = reinterpret_cast<const float4*>(dP + off + c0)[0];
      *reinterpret_cast<float4*>(gv + 4) = reinterpret_cast<const float4*>(dP + off + c0)[1];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (c0 + e < n) {
          const float p = expf(sv[e] * scale - l);
          pb[e / 2] |= dev::bf16_encode(p) << (16 * (e & 1));
          db[e / 2] |= dev::bf16_encode(p * (gv[e] - d)) << (16 * (e & 1));
        }
      }
    }
    if (c0 + 8 <= Lk) {
      *reinterpret_cast<uint4*>(P + off + c0) = make_uint4(pb[0], pb[1], pb[2], pb[3]);
      *reinterpret_cast<uint4*>(dS + off + c0) = make_uint4(db[0], db[1], db[2], db[3]);
    } else {
      for (int e = 0; c0 + e < Lk; ++e) {
        P[off + c0 + e] = static_cast<uint16_t>(pb[e / 2] >> (16 * (e & 1)));
        dS[off + c0 + e] = static_cast<uint16_t>(db[e / 2] >> (16 * (e & 1)));
      }
    }
  }
}

bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
T* need(DeviceArray<T>& a, size_t n) {
  if (a.size() < n) a.resize(n);
  return a.data();
}

int64_t round8(int64_t x) { return (x + 7) / 8 * 8; }

}  // namespace

struct AttentionTc::Impl {
  cublasHandle_t blas = nullptr;
  DeviceArray<uint8_t> ws;
  std::vector<int64_t> off;  // the plan's sequence offsets
  DeviceArray<int32_t> s0, len;
  int64_t block_elems = int64_t(1) << 25;
  // The FP32 forward's query rows a block at most (0: none). Its SGEMMs run on CUDA cores, so the
  // masked keys past a block's last query are worth skipping. H200, peer model, prefill 16 x 1024
  // (bench_model_gpu), bf16 / nvfp4 prompt tok/s, a sequence's blocks one after another: one block
  // 137.3k / 98.7k, 256 rows 148.3k / 104.4k, 128 rows 138.2k / 98.5k (the GEMMs too small to fill
  // the GPU); with the blocks batched over sequences (fwd_fp32): 256 rows 167.3k / 112.9k, 128 rows
  // 173.9k, 174.2k / 115.7k, 115.2k, 64 rows 173.8k / 115.1k: 128. QUADS_ATTN_BLOCK_ROWS overrides
  // it, for both modes (the BF16 trainer's default is one block).
  int64_t fp32_rows = 128;
  int64_t rows_env = -1;
  DeviceArray<uint16_t> qg, dog, kb, vb, pb, dsb;
  DeviceArray<float> og, S, dP, D;
  bool fp32 = false;               // set_fp32: the forward's operands stay float32
  DeviceArray<float> qf, pf;       // its packed queries and probabilities

  Impl() {
    if (const char* e = std::getenv("QUADS_ATTN_BLOCK_ROWS")) rows_env = std::max<int64_t>(0, std::atoll(e));
    QUADS_CUBLAS_CHECK(cublasCreate(&blas));
    QUADS_CUBLAS_CHECK(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_HOST));
    ws.resize(size_t(32) << 20);
    QUADS_CUBLAS_CHECK(cublasSetWorkspace(blas, ws.data(), ws.bytes()));
  }
  ~Impl() {
    if (blas) cublasDestroy(blas);
  }

  int64_t T() const { return off.empty() ? 0 : off.back(); }

  // Query rows per block for a sequence of L tokens: as many as keep nh * rows * round8(L) within
  // block_elems (at least one), at most the FP32 forward's cap (or QUADS_ATTN_BLOCK_ROWS).
  int64_t block_rows(int64_t L, int nh) const {
    int64_t r = std::clamp<int64_t>(block_elems / (int64_t(nh) * round8(L)), 1, std::max<int64_t>(L, 1));
    const int64_t cap = rows_env >= 0 ? rows_env : fp32 ? fp32_rows : 0;
    if (cap > 0) r = std::min(r, cap);
    return r;
  }

  // Scratch for the largest block of any sequence.
  void reserve(int nh, int nkv, bool backward) {
    int64_t most = 1;
    for (size_t s = 0; s + 1 < off.size(); ++s) {
      const int64_t L = off[s + 1] - off[s];
      if (L == 0) continue;
      most = std::max(most, int64_t(nh) * block_rows(L, nh) * round8(L));
    }
    (void)nkv;
    need(S, size_t(most));
    if (fp32 && !backward) need(pf, size_t(most));
    else need(pb, size_t(most));
    if (backward) {
      need(dP, size_t(most));
      need(dsb, size_t(most));
    }
  }

  // C = alpha op(A) op(B) + beta C over `batch` kv heads, FP32 accumulation; BF16 operands on
  // tensor cores, or float32 ones (CUBLAS_COMPUTE_32F: no TF32) for the FP32 forward.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha,
            const void* A, int64_t lda, int64_t sa, const void* B, int64_t ldb, int64_t sb, float beta,
            void* C, cudaDataType_t ct, int64_t ldc, int64_t sc, int batch, cudaDataType_t abt = CUDA_R_16BF) {
    QUADS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        blas, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, A, abt,
        static_cast<int>(lda), sa, B, abt, static_cast<int>(ldb), sb, &beta, C, ct, static_cast<int>(ldc), sc,
        batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  void check(int nh, int nkv, int hd, const char* what) const {
    QUADS_CHECK(!off.empty(), "AttentionTc::{}: no plan (call plan() with the batch offsets first)", what);
    QUADS_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "AttentionTc::{}: {} query heads are not a multiple of {} kv heads",
                what, nh, nkv);
    QUADS_CHECK(hd > 0 && hd % 8 == 0, "AttentionTc::{}: head_dim {} is not a multiple of 8", what, hd);
  }

  template <typename E>
  void pack(const float* src, int nh, int g, int hd, E* dst, cudaStream_t st) {
    const int64_t n = T() * nh * hd;
    if (!kern::legacy_train_kernels() && al16(src) && al16(dst)) {
      const int64_t chunks = int64_t(nh) * hd / 8;
      pack_row_kernel<E><<<kern::row_grid(T(), chunks), kern::row_threads(chunks), 0, st>>>(src, s0.data(), len.data(),
                                                                                         T(), nh, g, hd, dst);
    } else {
      pack_kernel<E><<<kern::grid_for(n), kern::kThreads, 0, st>>>(src, s0.data(), len.data(), T(), nh, g, hd, dst);
    }
    QUADS_CUDA_LAUNCH_CHECK();
  }
  void unpack(const float* src, int nh, int g, int hd, float* dst, cudaStream_t st) {
    const int64_t n = T() * nh * hd;
    if (!kern::legacy_train_kernels() && al16(src) && al16(dst)) {
      const int64_t chunks = int64_t(nh) * hd / 8;
      unpack_f32_row_kernel<<<kern::row_grid(T(), chunks), kern::row_threads(chunks), 0, st>>>(
          src, s0.data(), len.data(), T(), nh, g, hd, dst);
    } else {
      unpack_f32_kernel<<<kern::grid_for(n), kern::kThreads, 0, st>>>(src, s0.data(), len.data(), T(), nh, g, hd, dst);
    }
    QUADS_CUDA_LAUNCH_CHECK();
  }

  // P = softmax of the score block S: the register kernel up to 4096 keys, else (or legacy) the
  // three-pass one.
  template <typename E>
  void softmax_fwd(dim3 grid, int64_t ld, int Lk, int64_t M, int q0, int g, int64_t t0, int nh, float scale, E* p,
                   float* lse, cudaStream_t st, const int64_t* t0s = nullptr, int nkv = 1) {
    const float* Sd = S.data();
    if (kern::legacy_train_kernels() || Lk > 32 * kRowThreads)
      softmax_fwd_kernel<E><<<grid, kRowThreads, 0, st>>>(Sd, ld, Lk, M, q0, g, t0, nh, scale, p, lse, t0s, nkv);
    else if (Lk <= 2 * kRowThreads)
      softmax_fwd_reg_kernel<E, 2><<<grid, kRowThreads, 0, st>>>(Sd, ld, Lk, M, q0, g, t0, nh, scale, p, lse, t0s, nkv);
    else if (Lk <= 8 * kRowThreads)
      softmax_fwd_reg_kernel<E, 8><<<grid, kRowThreads, 0, st>>>(Sd, ld, Lk, M, q0, g, t0, nh, scale, p, lse, t0s, nkv);
    else
      softmax_fwd_reg_kernel<E, 32><<<grid, kRowThreads, 0, st>>>(Sd, ld, Lk, M, q0, g, t0, nh, scale, p, lse, t0s,
                                                                  nkv);
    QUADS_CUDA_LAUNCH_CHECK();
  }

  // S [nkv][M][ld] = Qb Kbᵀ for the rows of local queries q0 .. q1-1 against keys 0 .. q1-1 of the
  // sequence at t0 (column-major: Sᵀ [Lk, M] = Kb [Lk, hd] · Qbᵀ, kv head j's K at column j * hd).
  template <typename E>
  void scores(const E* xg, const E* keys, int64_t t0, int64_t L, int64_t q0, int64_t q1, int nh, int nkv, int hd,
              float* out) {
    const int g = nh / nkv;
    const int64_t M = (q1 - q0) * g, Lk = q1, ld = round8(Lk);
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, Lk, M, hd, 1.f, keys + t0 * nkv * hd, int64_t(nkv) * hd, hd,
         xg + t0 * nh * hd + q0 * g * hd, hd, L * g * hd, 0.f, out, CUDA_R_32F, ld, M * ld, nkv, elem_type<E>());
  }
  template <typename E>
  static cudaDataType_t elem_type() {
    return std::is_same_v<E, float> ? CUDA_R_32F : CUDA_R_16BF;
  }

  void fwd(const float* q, const float* k, const float* v, int nh, int nkv, int hd, float scale, float* out,
           float* lse, cudaStream_t st) {
    check(nh, nkv, hd, "fwd");
    const int64_t Tn = T();
    if (Tn == 0) return;
    QUADS_CUBLAS_CHECK(cublasSetStream(blas, st));
    reserve(nh, nkv, false);
    if (fp32) {
      fwd_fp32(need(qf, size_t(Tn * nh * hd)), k, v, q, nh, nkv, hd, scale, out, lse, st);
    } else {
      uint16_t* k_b = need(kb, size_t(Tn * nkv * hd));
      uint16_t* v_b = need(vb, size_t(Tn * nkv * hd));
      kern::to_bf16(k, k_b, Tn * nkv * hd, st);
      kern::to_bf16(v, v_b, Tn * nkv * hd, st);
      fwd_as<uint16_t>(need(qg, size_t(Tn * nh * hd)), k_b, v_b, pb.data(), q, nh, nkv, hd, scale, out, lse, st);
    }
  }

  // The forward over operands of element type E: qx (scratch for the packed queries), keys and
  // values [T, nkv, hd] already in E, p (scratch for the probabilities).
  template <typename E>
  void fwd_as(E* qx, const E* k_e, const E* v_e, E* p, const float* q, int nh, int nkv, int hd, float scale,
              float* out, float* lse, cudaStream_t st) {
    const int64_t Tn = T();
    const int g = nh / nkv;
    float* o_g = need(og, size_t(Tn * nh * hd));
    pack<E>(q, nh, g, hd, qx, st);
    for (size_t s = 0; s + 1 < off.size(); ++s) {
      const int64_t t0 = off[s], L = off[s + 1] - t0;
      if (L == 0) continue;
      const int64_t br = block_rows(L, nh);
      for (int64_t q0 = 0; q0 < L; q0 += br) {
        const int64_t q1 = std::min(L, q0 + br), M = (q1 - q0) * g, Lk = q1, ld = round8(Lk);
        scores<E>(qx, k_e, t0, L, q0, q1, nh, nkv, hd, S.data());
        softmax_fwd<E>(dim3(static_cast<unsigned>(M), static_cast<unsigned>(nkv)), ld, static_cast<int>(Lk), M,
                       static_cast<int>(q0), g, t0, nh, scale, p, lse, st);
        // O [M, hd] = P [M, Lk] · V [Lk, hd]; column-major Oᵀ = Vᵀ · Pᵀ.
        gemm(CUBLAS_OP_N, CUBLAS_OP_N, hd, M, Lk, 1.f, v_e + t0 * nkv * hd, int64_t(nkv) * hd, hd, p, ld, M * ld, 0.f,
             o_g + t0 * nh * hd + q0 * g * hd, CUDA_R_32F, hd, L * g * hd, nkv, elem_type<E>());
      }
    }
    unpack(o_g, nh, g, hd, out, st);
  }

  // The FP32 forward with the blocks of every sequence that have the same query rows (q0 .. q1 - 1:
  // a full block of each sequence long enough, or equal tails) in one batched GEMM each (pointer
  // arrays over (sequence, kv head)), so that small blocks still fill the GPU; at most twice
  // block_elems score elements a launch. Per sequence the operations of fwd_as<float>.
  DeviceArray<const void*> bptr;  // six arrays of pointers a launch group, in order
  DeviceArray<int64_t> bt0;       // each launch group's sequence starts
  void fwd_fp32(float* qx, const float* k_e, const float* v_e, const float* q, int nh, int nkv, int hd, float scale,
                float* out, float* lse, cudaStream_t st) {
    const int64_t Tn = T();
    const int g = nh / nkv;
    float* o_g = need(og, size_t(Tn * nh * hd));
    pack<float>(q, nh, g, hd, qx, st);
    struct Job {
      int64_t t0, L;
    };
    struct Group {
      int64_t q0, q1;
      std::vector<Job> jobs;
    };
    std::vector<Group> groups;  // in order of first appearance
    for (size_t s = 0; s + 1 < off.size(); ++s) {
      const int64_t t0 = off[s], L = off[s + 1] - t0;
      if (L == 0) continue;
      const int64_t br = block_rows(L, nh);
      for (int64_t q0 = 0; q0 < L; q0 += br) {
        const int64_t q1 = std::min(L, q0 + br);
        auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& x) { return x.q0 == q0 && x.q1 == q1; });
        if (it == groups.end()) {
          groups.push_back(Group{q0, q1, {}});
          it = groups.end() - 1;
        }
        it->jobs.push_back(Job{t0, L});
      }
    }
    // launches: (group, first job, jobs), their pointer arrays and sequence starts
    struct Launch {
      size_t grp, j0, nb, ptr0, t00;
    };
    std::vector<Launch> launches;
    int64_t most = 1;
    size_t nptr = 0, nt0 = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const Group& G = groups[gi];
      const int64_t M = (G.q1 - G.q0) * g, per = int64_t(nkv) * M * round8(G.q1);
      const size_t cap = static_cast<size_t>(std::max<int64_t>(1, 2 * block_elems / per));
      for (size_t j0 = 0; j0 < G.jobs.size(); j0 += cap) {
        const size_t nb = std::min(cap, G.jobs.size() - j0);
        launches.push_back(Launch{gi, j0, nb, nptr, nt0});
        nptr += 6 * nb * nkv;
        nt0 += nb;
        most = std::max(most, int64_t(nb) * per);
      }
    }
    float* Sd = need(S, size_t(most));
    float* Pd = need(pf, size_t(most));
    std::vector<const void*> hp(nptr);
    std::vector<int64_t> ht0(nt0);
    for (const Launch& la : launches) {
      const Group& G = groups[la.grp];
      const int64_t M = (G.q1 - G.q0) * g, ld = round8(G.q1);
      const size_t n = la.nb * nkv;
      for (size_t b = 0; b < la.nb; ++b) {
        const Job& jb = G.jobs[la.j0 + b];
        ht0[la.t00 + b] = jb.t0;
        for (int j = 0; j < nkv; ++j) {
          const size_t x = b * nkv + j;
          const int64_t qoff = jb.t0 * nh * hd + G.q0 * g * hd + j * jb.L * g * hd;
          hp[la.ptr0 + 0 * n + x] = k_e + jb.t0 * nkv * hd + j * hd;  // scores: A (keys), B (queries), C
          hp[la.ptr0 + 1 * n + x] = qx + qoff;
          hp[la.ptr0 + 2 * n + x] = Sd + int64_t(x) * M * ld;
          hp[la.ptr0 + 3 * n + x] = v_e + jb.t0 * nkv * hd + j * hd;  // P V: A (values), B (P), C
          hp[la.ptr0 + 4 * n + x] = Pd + int64_t(x) * M * ld;
          hp[la.ptr0 + 5 * n + x] = o_g + qoff;
        }
      }
    }
    // stream-ordered: a previous call's launches read these arrays before this copy lands
    if (bptr.size() < hp.size()) bptr.resize(hp.size());
    if (bt0.size() < ht0.size()) bt0.resize(ht0.size());
    QUADS_CUDA_CHECK(cudaMemcpyAsync(bptr.data(), hp.data(), sizeof(void*) * hp.size(), cudaMemcpyHostToDevice, st));
    QUADS_CUDA_CHECK(cudaMemcpyAsync(bt0.data(), ht0.data(), sizeof(int64_t) * ht0.size(), cudaMemcpyHostToDevice, st));
    const float one = 1.f, zero = 0.f;
    for (const Launch& la : launches) {
      const Group& G = groups[la.grp];
      const int64_t M = (G.q1 - G.q0) * g, Lk = G.q1, ld = round8(Lk);
      const int n = static_cast<int>(la.nb * nkv);
      const void* const* P0 = bptr.data() + la.ptr0;
      // S [M, Lk] row-major = Qb Kbᵀ (column-major Sᵀ = Kb · Qbᵀ), as scores()
      QUADS_CUBLAS_CHECK(cublasGemmBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(Lk), static_cast<int>(M), hd,
                                             &one, P0, CUDA_R_32F, nkv * hd, P0 + n, CUDA_R_32F, hd, &zero,
                                             const_cast<void* const*>(P0 + 2 * n), CUDA_R_32F, static_cast<int>(ld), n,
                                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      softmax_fwd<float>(dim3(static_cast<unsigned>(M), static_cast<unsigned>(n)), ld, static_cast<int>(Lk), M,
                         static_cast<int>(G.q0), g, 0, nh, scale, Pd, lse, st, bt0.data() + la.t00, nkv);
      // O [M, hd] = P [M, Lk] · V [Lk, hd]; column-major Oᵀ = Vᵀ · Pᵀ
      QUADS_CUBLAS_CHECK(cublasGemmBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, static_cast<int>(M), static_cast<int>(Lk),
                                             &one, P0 + 3 * n, CUDA_R_32F, nkv * hd, P0 + 4 * n, CUDA_R_32F,
                                             static_cast<int>(ld), &zero, const_cast<void* const*>(P0 + 5 * n),
                                             CUDA_R_32F, hd, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    unpack(o_g, nh, g, hd, out, st);
  }

  void bwd(const float* q, const float* k, const float* v, const float* out, const float* lse, const float* dout,
           int nh, int nkv, int hd, float scale, float* dq, float* dk, float* dv, cudaStream_t st) {
    check(nh, nkv, hd, "bwd");
    const int64_t Tn = T();
    if (Tn == 0) return;
    const int g = nh / nkv;
    QUADS_CUBLAS_CHECK(cublasSetStream(blas, st));
    reserve(nh, nkv, true);
    uint16_t* q_b = need(qg, size_t(Tn * nh * hd));
    uint16_t* do_b = need(dog, size_t(Tn * nh * hd));
    uint16_t* k_b = need(kb, size_t(Tn * nkv * hd));
    uint16_t* v_b = need(vb, size_t(Tn * nkv * hd));
    float* dq_g = need(og, size_t(Tn * nh * hd));
    float* Dp = need(D, size_t(Tn * nh));
    kern::to_bf16(k, k_b, Tn * nkv * hd, st);
    kern::to_bf16(v, v_b, Tn * nkv * hd, st);
    QUADS_CHECK(!fp32, "AttentionTc::bwd: the FP32 mode is forward-only");
    pack<uint16_t>(q, nh, g, hd, q_b, st);
    pack<uint16_t>(dout, nh, g, hd, do_b, st);
    {
      const int64_t rows = Tn * nh;
      rowdot_kernel<<<kern::grid_for(rows * 32), kern::kThreads, 0, st>>>(dout, out, rows, hd, Dp);
      QUADS_CUDA_LAUNCH_CHECK();
    }
    const int64_t kvld = int64_t(nkv) * hd;
    for (size_t s = 0; s + 1 < off.size(); ++s) {
      const int64_t t0 = off[s], L = off[s + 1] - t0;
      if (L == 0) continue;
      const int64_t br = block_rows(L, nh);
      const int64_t nblocks = (L + br - 1) / br;
      // The last block sees every key: it writes dk / dv (beta 0), the earlier ones add to them.
      for (int64_t bi = nblocks - 1; bi >= 0; --bi) {
        const int64_t q0 = bi * br, q1 = std::min(L, q0 + br), M = (q1 - q0) * g, Lk = q1, ld = round8(Lk);
        const float beta = bi == nblocks - 1 ? 0.f : 1.f;
        const uint16_t* qrows = q_b + t0 * nh * hd + q0 * g * hd;
        const uint16_t* dorows = do_b + t0 * nh * hd + q0 * g * hd;
        scores<uint16_t>(q_b, k_b, t0, L, q0, q1, nh, nkv, hd, S.data());
        // dP [M, Lk] = dO · Vᵀ: the same product as the scores with (dO, V) for (Q, K).
        scores<uint16_t>(do_b, v_b, t0, L, q0, q1, nh, nkv, hd, dP.data());
        if (kern::legacy_train_kernels())
          softmax_bwd_kernel<<<dim3(static_cast<unsigned>(M), static_cast<unsigned>(nkv)), kRowThreads, 0, st>>>(
              S.data(), dP.data(), ld, static_cast<int>(Lk), M, static_cast<int>(q0), g, t0, nh, scale, lse, Dp,
              pb.data(), dsb.data());
        else
          softmax_bwd_vec_kernel<<<dim3(static_cast<unsigned>(M), static_cast<unsigned>(nkv)), kRowThreads, 0, st>>>(
              S.data(), dP.data(), ld, static_cast<int>(Lk), M, static_cast<int>(q0), g, t0, nh, scale, lse, Dp,
              pb.data(), dsb.data());
        QUADS_CUDA_LAUNCH_CHECK();
        // dV [Lk, hd] (+)= Pᵀ [Lk, M] · dO [M, hd]; column-major dVᵀ = dObᵀ · P, rows of dv at ld nkv * hd.
        gemm(CUBLAS_OP_N, CUBLAS_OP_T, hd, Lk, M, 1.f, dorows, hd, L * g * hd, pb.data(), ld, M * ld, beta,
             dv + t0 * kvld, CUDA_R_32F, kvld, hd, nkv);
        // dK (+)= scale dSᵀ · Qb (the group's g heads summed by the stacked rows).
        gemm(CUBLAS_OP_N, CUBLAS_OP_T, hd, Lk, M, scale, qrows, hd, L * g * hd, dsb.data(), ld, M * ld, beta,
             dk + t0 * kvld, CUDA_R_32F, kvld, hd, nkv);
        // dQ [M, hd] = scale dS [M, Lk] · K [Lk, hd]; column-major dQᵀ = Kbᵀ · dSᵀ.
        gemm(CUBLAS_OP_N, CUBLAS_OP_N, hd, M, Lk, scale, k_b + t0 * kvld, kvld, hd, dsb.data(), ld, M * ld, 0.f,
             dq_g + t0 * nh * hd + q0 * g * hd, CUDA_R_32F, hd, L * g * hd, nkv);
      }
    }
    unpack(dq_g, nh, g, hd, dq, st);
  }
};

AttentionTc::AttentionTc() : impl_(std::make_unique<Impl>()) {}
AttentionTc::~AttentionTc() = default;

void AttentionTc::plan(const std::vector<int64_t>& offsets) {
  Impl& m = *impl_;
  QUADS_CHECK(!offsets.empty() && offsets.front() == 0, "AttentionTc::plan: offsets must start at 0");
  for (size_t s = 0; s + 1 < offsets.size(); ++s)
    QUADS_CHECK(offsets[s + 1] >= offsets[s], "AttentionTc::plan: offsets decrease at sequence {}", s);
  const int64_t T = offsets.back();
  QUADS_CHECK(T < (int64_t(1) << 31), "AttentionTc::plan: {} tokens (at most 2^31 - 1)", T);
  std::vector<int32_t> hs0(T), hlen(T);
  for (size_t s = 0; s + 1 < offsets.size(); ++s)
    for (int64_t t = offsets[s]; t < offsets[s + 1]; ++t) {
      hs0[t] = static_cast<int32_t>(offsets[s]);
      hlen[t] = static_cast<int32_t>(offsets[s + 1] - offsets[s]);
    }
  m.off = offsets;
  m.s0.upload(hs0);
  m.len.upload(hlen);
}

int64_t AttentionTc::tokens() const { return impl_->T(); }

void AttentionTc::fwd(const float* q, const float* k, const float* v, int nh, int nkv, int hd, float scale,
                      float* out, float* lse, cudaStream_t s) {
  impl_->fwd(q, k, v, nh, nkv, hd, scale, out, lse, s);
}

void AttentionTc::bwd(const float* q, const float* k, const float* v, const float* out, const float* lse,
                      const float* dout, int nh, int nkv, int hd, float scale, float* dq, float* dk, float* dv,
                      cudaStream_t s) {
  impl_->bwd(q, k, v, out, lse, dout, nh, nkv, hd, scale, dq, dk, dv, s);
}

void AttentionTc::set_fp32(bool on) { impl_->fp32 = on; }

void AttentionTc::set_block_elems(int64_t n) {
  QUADS_CHECK(n > 0, "AttentionTc::set_block_elems: {} elements", n);
  impl_->block_elems = n;
}

}  // namespace quads::cuda
