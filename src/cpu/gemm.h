#pragma once
// Float32 GEMMs in the three shapes a linear layer needs (row-major, leading dimensions in
// elements). Weights are [N, K] (out, in) as in Hugging Face / torch.nn.Linear.
#include <cstdint>

namespace quads::cpu {

// Y[M, N] = X[M, K] · W[N, K]ᵀ  (+ Y when accumulate). OpenBLAS sgemm: fastest, but the result of
// a row may change with M (OpenBLAS picks different kernels and blockings; measured on 0.3.21).
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw,
             float* Y, int64_t ldy, bool accumulate = false);

// The same product, ROW-INVARIANT: Y[m, n] is a fixed function of row m of X and row n of W (a dot
// product in 8 interleaved float32 lanes with fused multiply-adds, lanes summed in a fixed tree),
// so it never depends on M, on the other rows, on the tiling or on the number of threads. Used by
// every forward GEMM so that a sequence's numbers do not depend on its batch. Bitwise the same on
// any x86-64 build (the AVX2 path and the portable path compute the identical operations).
void gemm_nt_rowinv(int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw,
                    float* Y, int64_t ldy, bool accumulate = false);

// dX[M, K] = dY[M, N] · W[N, K]  (+ dX when accumulate). OpenBLAS.
// The OpenBLAS products run single-threaded BLAS calls on fixed-size chunks spread over OpenMP
// threads: their results do not depend on the number of threads. (This sets OpenBLAS to one
// thread for the whole process on first use.)
void gemm_nn(int64_t M, int64_t N, int64_t K, const float* dY, int64_t lddy, const float* W, int64_t ldw,
             float* dX, int64_t lddx, bool accumulate = false);

// dW[N, K] += dY[M, N]ᵀ · X[M, K]. OpenBLAS.
void gemm_tn_acc(int64_t M, int64_t N, int64_t K, const float* dY, int64_t lddy, const float* X, int64_t ldx,
                 float* dW, int64_t lddw);

// The 8-lane dot product gemm_nt_rowinv uses (exposed for attention and tests).
float dot_rowinv(const float* a, const float* b, int64_t n);

}  // namespace quads::cpu
