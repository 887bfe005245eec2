#include "cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUADS_ROWINV_AVX2 1
#endif

namespace quads::cpu {

// OpenBLAS runs single-threaded; the threads are ours (OpenMP). Each product is cut into chunks of
// a FIXED size along one output dimension and the chunks are spread over the threads, so a result
// never depends on the number of threads, and two thread pools never compete for the cores.
namespace {

void blas_single_threaded() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

constexpr int64_t kChunk = 128;

// Calls fn(r0, r1, c0, c1) over chunks of the [rows, cols] output, in parallel when it pays.
template <typename F>
void chunked(int64_t rows, int64_t cols, double flops, F fn) {
  blas_single_threaded();
  const bool by_rows = rows >= cols;
  const int64_t len = by_rows ? rows : cols;
  const int64_t n = (len + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > 1 && flops > 4e6)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = i * kChunk, b = std::min(len, a + kChunk);
    if (by_rows)
      fn(a, b, int64_t(0), cols);
    else
      fn(int64_t(0), rows, a, b);
  }
}

}  // namespace

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw, float* Y,
             int64_t ldy, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(Y + m * ldy, Y + m * ldy + N, 0.f);
    return;
  }
  chunked(M, N, 2.0 * M * N * K, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m1 - m0), int(n1 - n0), int(K), 1.f, X + m0 * ldx,
                int(ldx), W + n0 * ldw, int(ldw), accumulate ? 1.f : 0.f, Y + m0 * ldy + n0, int(ldy));
  });
}

void gemm_nn(int64_t M, int64_t N, int64_t K, const float* dY, int64_t lddy, const float* W, int64_t ldw, float* dX,
             int64_t lddx, bool accumulate) {
  if (M <= 0 || K <= 0) return;
  if (N <= 0) {
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(dX + m * lddx, dX + m * lddx + K, 0.f);
    return;
  }
  chunked(M, K, 2.0 * M * N * K, [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m1 - m0), int(k1 - k0), int(N), 1.f, dY + m0 * lddy,
                int(lddy), W + k0, int(ldw), accumulate ? 1.f : 0.f, dX + m0 * lddx + k0, int(lddx));
  });
}

void gemm_tn_acc(int64_t M, int64_t N, int64_t K, const float* dY, int64_t lddy, const float* X, int64_t ldx, float* dW,
                 int64_t lddw) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  chunked(N, K, 2.0 * M * N * K, [&](int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(n1 - n0), int(k1 - k0), int(M), 1.f, dY + n0, int(lddy),
                X + k0, int(ldx), 1.f, dW + n0 * lddw + k0, int(lddw));
  });
}

// ---------------------------------------------------------------------------------------------
// Row-invariant GEMM. Every output is the same function of its two rows: lane j (0..7) of an
// accumulator sums fma(x[k], w[k], acc) over k = j, j+8, j+16, ... in increasing order, with the
// rows zero-padded to a multiple of 8; the lanes are then added as
// ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)). The blocking below only decides which outputs are
// computed together, never how one is computed.

namespace {

#ifdef QUADS_ROWINV_AVX2

inline float hsum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  const __m128 s = _mm_add_ps(lo, hi);                 // (l0+l4, l1+l5, l2+l6, l3+l7)
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s)); // (s0+s2, s1+s3, ., .)
  const __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));  // (s0+s2) + (s1+s3)
  return _mm_cvtss_f32(u);
}

inline __m256i tail_mask(int64_t rem) {
  alignas(32) static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 - rem));
}

// MR rows of X times NR rows of W.
template <int MR, int NR>
inline void kernel(int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw, float* Y, int64_t ldy,
                   bool accumulate) {
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 w[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w[j] = _mm256_loadu_ps(W + j * ldw + k);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_loadu_ps(X + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  if (K8 < K) {
    const __m256i mask = tail_mask(K - K8);
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm256_maskload_ps(W + j * ldw + K8, mask);
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_maskload_ps(X + i * ldx + K8, mask);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float s = hsum8(acc[i][j]);
      Y[i * ldy + j] = accumulate ? Y[i * ldy + j] + s : s;
    }
}

#else

inline float dot8_portable(const float* a, const float* b, int64_t n) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) l[j] = std::fma(a[k + j], b[k + j], l[j]);
  if (k < n)
    for (int j = 0; j < 8; ++j) l[j] = std::fma(k + j < n ? a[k + j] : 0.f, k + j < n ? b[k + j] : 0.f, l[j]);
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

template <int MR, int NR>
inline void kernel(int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw, float* Y, int64_t ldy,
                   bool accumulate) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float s = dot8_portable(X + i * ldx, W + j * ldw, K);
      Y[i * ldy + j] = accumulate ? Y[i * ldy + j] + s : s;
    }
}

#endif

constexpr int kMR = 4, kNR = 3;

// One strip of NR rows of W against rows m0..m1 of X, four at a time.
template <int NR>
inline void strip(int64_t m0, int64_t m1, int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw,
                  float* Y, int64_t ldy, bool acc) {
  int64_t m = m0;
  for (; m + kMR <= m1; m += kMR) kernel<kMR, NR>(K, X + m * ldx, ldx, W, ldw, Y + m * ldy, ldy, acc);
  switch (m1 - m) {
    case 3: kernel<3, NR>(K, X + m * ldx, ldx, W, ldw, Y + m * ldy, ldy, acc); break;
    case 2: kernel<2, NR>(K, X + m * ldx, ldx, W, ldw, Y + m * ldy, ldy, acc); break;
    case 1: kernel<1, NR>(K, X + m * ldx, ldx, W, ldw, Y + m * ldy, ldy, acc); break;
    default: break;
  }
}

}  // namespace

float dot_rowinv(const float* a, const float* b, int64_t n) {
  float y;
  kernel<1, 1>(n, a, 0, b, 0, &y, 0, false);
  return y;
}

void gemm_nt_rowinv(int64_t M, int64_t N, int64_t K, const float* X, int64_t ldx, const float* W, int64_t ldw,
                    float* Y, int64_t ldy, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  // Tiles: a block of X rows and a panel of W rows. Within a tile, each strip of kNR rows of W
  // stays in L1 while the block's rows of X (also L1-sized) pass over it.
  const int64_t Kc = std::max<int64_t>(K, 1);
  const int64_t rblk = std::max<int64_t>(kMR, std::min<int64_t>(64, (int64_t(16) << 10) / (4 * Kc) / kMR * kMR));
  const int64_t panel = std::max<int64_t>(kNR, std::min<int64_t>(N, (int64_t(192) << 10) / (4 * Kc) / kNR * kNR));
  const int64_t npanels = (N + panel - 1) / panel, nrblk = (M + rblk - 1) / rblk;
  const int64_t ntasks = npanels * nrblk;
  const double flops = 2.0 * double(M) * double(N) * double(K);
#pragma omp parallel for schedule(static) if (ntasks > 1 && flops > 2e6)
  for (int64_t task = 0; task < ntasks; ++task) {
    const int64_t p = task / nrblk, rb = task % nrblk;
    const int64_t n0 = p * panel, n1 = std::min(N, n0 + panel);
    const int64_t m0 = rb * rblk, m1 = std::min(M, m0 + rblk);
    int64_t n = n0;
    for (; n + kNR <= n1; n += kNR) strip<kNR>(m0, m1, K, X, ldx, W + n * ldw, ldw, Y + n, ldy, accumulate);
    switch (n1 - n) {
      case 2: strip<2>(m0, m1, K, X, ldx, W + n * ldw, ldw, Y + n, ldy, accumulate); break;
      case 1: strip<1>(m0, m1, K, X, ldx, W + n * ldw, ldw, Y + n, ldy, accumulate); break;
      default: break;
    }
  }
}

}  // namespace quads::cpu
