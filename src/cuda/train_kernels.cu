// Kernels of the GPU trainer; see train_kernels.h for what each one computes. Where the CPU twin's
// float arithmetic is cheap to follow, it is followed operation by operation with explicit
// __fmul_rn / __fadd_rn / __dmul_rn / __dadd_rn (nvcc contracts a*b+c into an FMA, the CPU build
// does not), so those kernels give the CPU's bits. Reductions run in fixed trees; no float atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <type_traits>
#include <vector>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/kernel_util.cuh"
#include "cuda/model_kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/train_kernels.h"

namespace quads::cuda::kern {

namespace {


bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int max_smem_optin() {
  int dev = 0, v = 0;
  QUADS_CUDA_CHECK(cudaGetDevice(&dev));
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return v;
}

// Block-wide sum / max (blockDim.x a multiple of 32): warp trees, then every warp reduces the warp
// results in the same order, so all threads return the same value. red: shared [32].
__device__ double block_sum(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return warp_sum(lane < nw ? red[lane] : 0.0);
}
__device__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return warp_max(lane < nw ? red[lane] : -INFINITY);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

// kWarp: one warp per row (per-head q/k norms, D <= 1024), else one CTA per row. Sum of squares in
// double; y = w * (x * inv) as the CPU rounds it.
template <bool kWarp>
__global__ void rmsnorm_fwd_kernel(const float* __restrict__ x, const float* __restrict__ w, int64_t rows, int64_t D,
                                   float eps, float* __restrict__ y, float* __restrict__ inv_rms) {
  __shared__ double red[32];
  int64_t r;
  int tid, nt;
  if constexpr (kWarp) {
    r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    tid = threadIdx.x & 31;
    nt = 32;
    if (r >= rows) return;  // whole warps; no block barrier on this path
  } else {
    r = blockIdx.x;
    tid = threadIdx.x;
    nt = blockDim.x;
  }
  const float* xr = x + r * D;
  double ss = 0;
  for (int64_t i = tid; i < D; i += nt) ss += double(xr[i]) * double(xr[i]);  // exact products
  if constexpr (kWarp) ss = warp_sum(ss);
  else ss = block_sum(ss, red);
  const float inv = static_cast<float>(1.0 / sqrt(ss / double(D) + double(eps)));
  if (tid == 0 && inv_rms) inv_rms[r] = inv;
  float* yr = y + r * D;
  for (int64_t i = tid; i < D; i += nt) yr[i] = __fmul_rn(w[i], __fmul_rn(xr[i], inv));
}

// dx_j = r w_j dy_j - x_j r^3 / D * sum_i dy_i w_i x_i, in double as cpu::rmsnorm_backward.
template <bool kWarp>
__global__ void rmsnorm_bwd_dx_kernel(const float* __restrict__ dy, const float* __restrict__ x,
                                      const float* __restrict__ w, const float* __restrict__ inv_rms, int64_t rows,
                                      int64_t D, float* __restrict__ dx) {
  __shared__ double red[32];
  int64_t r;
  int tid, nt;
  if constexpr (kWarp) {
    r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    tid = threadIdx.x & 31;
    nt = 32;
    if (r >= rows) return;
  } else {
    r = blockIdx.x;
    tid = threadIdx.x;
    nt = blockDim.x;
  }
  const float* xr = x + r * D;
  const float* dyr = dy + r * D;
  double dot = 0;
  for (int64_t i = tid; i < D; i += nt)
    dot = __dadd_rn(dot, __dmul_rn(__dmul_rn(double(dyr[i]), double(w[i])), double(xr[i])));
  if constexpr (kWarp) dot = warp_sum(dot);
  else dot = block_sum(dot, red);
  const double inv = inv_rms[r];
  const double c = dot * inv * inv * inv / double(D);
  float* dxr = dx + r * D;
  for (int64_t i = tid; i < D; i += nt)
    dxr[i] = static_cast<float>(
        __dsub_rn(__dmul_rn(__dmul_rn(inv, double(w[i])), double(dyr[i])), __dmul_rn(double(xr[i]), c)));
}

// dw partials: rows are cut into chunks of rmsnorm_chunk_rows(rows) (a function of the shape only);
// part[chunk, col] = sum over the chunk's rows, in row order, of (dy * x) * inv in double.
int64_t rmsnorm_chunk_rows(int64_t rows) { return std::max<int64_t>(16, (rows + 1023) / 1024); }

__global__ void rmsnorm_dw_part_kernel(const float* __restrict__ dy, const float* __restrict__ x,
                                       const float* __restrict__ inv_rms, int64_t rows, int64_t D, int64_t chunk,
                                       double* __restrict__ part) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= D) return;
  const int64_t r0 = int64_t(blockIdx.y) * chunk, r1 = min(rows, r0 + chunk);
  double acc = 0;
  for (int64_t r = r0; r < r1; ++r)
    acc = __dadd_rn(acc, __dmul_rn(__dmul_rn(double(dy[r * D + col]), double(x[r * D + col])), double(inv_rms[r])));
  part[int64_t(blockIdx.y) * D + col] = acc;
}

// One CTA per column: the chunk partials in a fixed tree, then dw[col] += float(sum).
__global__ void rmsnorm_dw_sum_kernel(const double* __restrict__ part, int64_t nchunks, int64_t D,
                                      float* __restrict__ dw) {
  __shared__ double red[32];
  const int64_t col = blockIdx.x;
  double s = 0;
  for (int64_t c = threadIdx.x; c < nchunks; c += blockDim.x) s += part[c * D + col];
  s = block_sum(s, red);
  if (threadIdx.x == 0) dw[col] = __fadd_rn(dw[col], static_cast<float>(s));
}

// ---------------------------------------------------------------------------------------------
// RoPE (rotate-half pairs (i, i + hd/2)), the CPU's float operations.

__global__ void rope_kernel(float* __restrict__ x, int64_t n, int heads, int hd, const float* __restrict__ cos,
                            const float* __restrict__ sin, bool backward) {
  const int half = hd / 2;
  const int64_t total = n * heads * half;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / half;
    const int i = static_cast<int>(e - row * half);
    const int64_t t = row / heads;
    const float c = cos[t * half + i], s = sin[t * half + i];
    float* v = x + row * hd;
    const float a = v[i], b = v[i + half];
    if (!backward) {
      v[i] = __fadd_rn(__fmul_rn(a, c), __fmul_rn(-b, s));
      v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    } else {
      v[i] = __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      v[i + half] = __fsub_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
  }
}

// The same per pair as a row kernel: rows = n * heads over blocks, V consecutive pairs per thread
// (V = 4: half % 4 == 0, x / cos / sin 16-byte aligned).
template <int V>
__global__ void rope_row_kernel(float* __restrict__ x, int64_t rows, int heads, int hd, const float* __restrict__ cos,
                                const float* __restrict__ sin, bool backward) {
  using E = std::conditional_t<V == 4, float4, float>;
  const int half = hd / 2, cols = half / V;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = row / heads;
    E* lo = reinterpret_cast<E*>(x + row * hd);
    E* hi = reinterpret_cast<E*>(x + row * hd + half);
    const E* cr = reinterpret_cast<const E*>(cos + t * half);
    const E* sr = reinterpret_cast<const E*>(sin + t * half);
    for (int64_t i = col0(); i < cols; i += col_step()) {
      E a = lo[i], b = hi[i];
      const E c = cr[i], s = sr[i];
      float* av = reinterpret_cast<float*>(&a);
      float* bv = reinterpret_cast<float*>(&b);
      const float* cv = reinterpret_cast<const float*>(&c);
      const float* sv = reinterpret_cast<const float*>(&s);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float aj = av[j], bj = bv[j];
        if (!backward) {
          av[j] = __fadd_rn(__fmul_rn(aj, cv[j]), __fmul_rn(-bj, sv[j]));
          bv[j] = __fadd_rn(__fmul_rn(bj, cv[j]), __fmul_rn(aj, sv[j]));
        } else {
          av[j] = __fadd_rn(__fmul_rn(aj, cv[j]), __fmul_rn(bj, sv[j]));
          bv[j] = __fsub_rn(__fmul_rn(bj, cv[j]), __fmul_rn(aj, sv[j]));
        }
      }
      lo[i] = a;
      hi[i] = b;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention over a packed batch. Tiles of BT rows (queries or keys) by HD columns (head_dim padded
// up to 32/64/128/256; the padding columns load as zeros and are never stored) live in shared
// memory; 256 threads as a 16 x 16 grid (ty, tx). Score tiles [BT, BT]: thread (ty, tx) holds rows
// ty + 16 i and columns tx + 16 j (i, j < R), dot products over d in order (float4 steps, FMA).
// Output tiles [BT, HD]: rows ty + 16 i, the C = HD / 16 adjacent columns from tx * C, summed over
// the contracted index in order. So each thread's arithmetic is a fixed function of the shape.
// seq0 is nondecreasing (sequences are packed back to back): a query tile's keys start at seq0 of
// its first query, and the queries that see a key tile end where seq0 passes its last key.

template <int HD, int BT>
struct AttnTile {
  static constexpr int R = BT / 16;
  static constexpr int C = HD / 16;
  static constexpr int LD = HD + 4;  // padded rows: float4 reads of 8 different rows are conflict-free
  static constexpr int LP = BT + 4;
};

constexpr int kAttnThreads = 256;

// Rows row0 .. row0 + BT of a [T, heads, hd] tensor (base = the head's first column, ld = heads * hd)
// into dst [BT][LD]; rows past T and columns past hd are zeros.
template <int HD, int BT>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const float* __restrict__ base, int64_t row0,
                                          int64_t T, int64_t ld, int hd) {
  constexpr int LD = AttnTile<HD, BT>::LD, V4 = HD / 4;
  for (int i = threadIdx.x; i < BT * V4; i += kAttnThreads) {
    const int r = i / V4, c = (i - r * V4) * 4;
    const int64_t t = row0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t < T && c < hd) v = *reinterpret_cast<const float4*>(base + t * ld + c);
    *reinterpret_cast<float4*>(dst + r * LD + c) = v;
  }
}

// S[i][j] = A[ty + 16 i] . B[tx + 16 j] over HD columns.
template <int HD, int BT>
__device__ __forceinline__ void tile_dot(const float* __restrict__ A, const float* __restrict__ B,
                                         float (&S)[BT / 16][BT / 16], int ty, int tx) {
  constexpr int R = AttnTile<HD, BT>::R, LD = AttnTile<HD, BT>::LD;
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < R; ++j) S[i][j] = 0.f;
#pragma unroll 4
  for (int d = 0; d < HD; d += 4) {
    float4 a[R], b[R];
#pragma unroll
    for (int i = 0; i < R; ++i) a[i] = *reinterpret_cast<const float4*>(A + (ty + 16 * i) * LD + d);
#pragma unroll
    for (int j = 0; j < R; ++j) b[j] = *reinterpret_cast<const float4*>(B + (tx + 16 * j) * LD + d);
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int j = 0; j < R; ++j) {
        float s = S[i][j];
        s = fmaf(a[i].x, b[j].x, s);
        s = fmaf(a[i].y, b[j].y, s);
        s = fmaf(a[i].z, b[j].z, s);
        s = fmaf(a[i].w, b[j].w, s);
        S[i][j] = s;
      }
  }
}

// O[i][c] += sum_j P[ty + 16 i][j] * M[j][tx * C + c], j = 0 .. BT in order. P [BT][LP], M [BT][LD].
template <int HD, int BT>
__device__ __forceinline__ void tile_acc(const float* __restrict__ P, const float* __restrict__ M,
                                         float (&O)[BT / 16][HD / 16], int ty, int tx) {
  constexpr int R = AttnTile<HD, BT>::R, C = AttnTile<HD, BT>::C, LD = AttnTile<HD, BT>::LD,
                LP = AttnTile<HD, BT>::LP;
#pragma unroll 2
  for (int j = 0; j < BT; j += 4) {
    float4 p[R];
#pragma unroll
    for (int i = 0; i < R; ++i) p[i] = *reinterpret_cast<const float4*>(P + (ty + 16 * i) * LP + j);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float m[C];
      const float* row = M + (j + jj) * LD + tx * C;
      if constexpr (C % 4 == 0) {
#pragma unroll
        for (int c = 0; c < C; c += 4) {
          const float4 v = *reinterpret_cast<const float4*>(row + c);
          m[c] = v.x, m[c + 1] = v.y, m[c + 2] = v.z, m[c + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int c = 0; c < C; c += 2) {
          const float2 v = *reinterpret_cast<const float2*>(row + c);
          m[c] = v.x, m[c + 1] = v.y;
        }
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float pv = jj == 0 ? p[i].x : jj == 1 ? p[i].y : jj == 2 ? p[i].z : p[i].w;
#pragma unroll
        for (int c = 0; c < C; ++c) O[i][c] = fmaf(pv, m[c], O[i][c]);
      }
    }
  }
}

// Rows ty + 16 i of an output tile to dst (a [T, heads, hd] tensor's head base, ld = heads * hd),
// times mul[i] (1 for none).
template <int HD, int BT>
__device__ __forceinline__ void store_tile(float* __restrict__ base, const float (&O)[BT / 16][HD / 16],
                                           const float (&mul)[BT / 16], int64_t row0, int64_t T, int64_t ld, int hd,
                                           int ty, int tx) {
  constexpr int R = AttnTile<HD, BT>::R, C = AttnTile<HD, BT>::C;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t t = row0 + ty + 16 * i;
    if (t >= T) continue;
    float* dst = base + t * ld + tx * C;
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (tx * C + c < hd) dst[c] = __fmul_rn(O[i][c], mul[i]);
  }
}

// D = dout . out of row t in double (lane tx of a half-warp owns columns tx + 16 c), as a float as
// the CPU uses it. Both backward kernels call it with this layout, so they agree bit for bit.
// Every lane of the warp must call it (shuffles).
template <int HD>
__device__ __forceinline__ float attn_row_D(const float* __restrict__ out, const float* __restrict__ dout, int64_t t,
                                            int64_t T, int64_t off, int64_t ld, int hd, int tx) {
  double s = 0;
  if (t < T) {
    const float* o = out + t * ld + off;
    const float* g = dout + t * ld + off;
#pragma unroll
    for (int c = 0; c < HD / 16; ++c) {
      const int d = tx + 16 * c;
      if (d < hd) s += double(o[d]) * double(g[d]);  // exact products
    }
  }
  return static_cast<float>(half_sum(s));
}

// Forward: one CTA per (query tile, head), the heaviest (last) query tiles first. Online softmax
// over key tiles; the running sum in double; out = O * float(1 / sum), lse = m + log(sum).
// K and V take turns in one buffer, so that two CTAs fit on an SM (one's loads overlap the other's math).
template <int HD, int BT>
__global__ void __launch_bounds__(kAttnThreads, 2)
attn_fwd_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                const int32_t* __restrict__ seq0, int64_t T, int nh, int nkv, int hd, float scale,
                float* __restrict__ out, float* __restrict__ lse) {
  using Tl = AttnTile<HD, BT>;
  constexpr int R = Tl::R, C = Tl::C, LD = Tl::LD, LP = Tl::LP;
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);
  float* KVs = Qs + BT * LD;
  float* Ps = KVs + BT * LD;
  __shared__ int32_t s0q[BT];
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int64_t q0 = int64_t(gridDim.x - 1 - blockIdx.x) * BT;
  const int h = blockIdx.y, g = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  load_tile<HD, BT>(Qs, q + int64_t(h) * hd, q0, T, ldq, hd);
  for (int i = threadIdx.x; i < BT; i += kAttnThreads) s0q[i] = q0 + i < T ? seq0[q0 + i] : INT_MAX;
  const int64_t qlast = min(q0 + BT, T) - 1;
  const int64_t kbeg = seq0[q0];
  float m[R], O[R][C];
  double l[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    m[i] = -INFINITY;
    l[i] = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) O[i][c] = 0.f;
  }
  for (int64_t k0 = kbeg; k0 <= qlast; k0 += BT) {
    __syncthreads();  // the previous tile's V and P are consumed (and Q, s0q are in place)
    load_tile<HD, BT>(KVs, k + int64_t(g) * hd, k0, T, ldk, hd);
    __syncthreads();
    float S[R][R];
    tile_dot<HD, BT>(Qs, KVs, S, ty, tx);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = ty + 16 * i;
      const int64_t t = q0 + r;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int64_t kj = k0 + tx + 16 * j;
        const bool ok = t < T && kj <= t && kj >= s0q[r];
        S[i][j] = ok ? __fmul_rn(S[i][j], scale) : -INFINITY;
        mx = fmaxf(mx, S[i][j]);
      }
      mx = half_max(mx);
      const float mnew = fmaxf(m[i], mx);
      const float mref = mnew == -INFINITY ? 0.f : mnew;  // no valid key yet: everything stays 0
      const float alpha = expf(__fsub_rn(m[i], mref));
      double ps = 0;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const float p = expf(__fsub_rn(S[i][j], mref));
        Ps[r * LP + tx + 16 * j] = p;
        ps += p;
      }
      ps = half_sum(ps);
      l[i] = __dadd_rn(__dmul_rn(l[i], double(alpha)), ps);
      m[i] = mnew;
#pragma unroll
      for (int c = 0; c < C; ++c) O[i][c] = __fmul_rn(O[i][c], alpha);
    }
    __syncthreads();  // K is consumed
    load_tile<HD, BT>(KVs, v + int64_t(g) * hd, k0, T, ldk, hd);
    __syncthreads();
    tile_acc<HD, BT>(Ps, KVs, O, ty, tx);
  }
  float inv[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t t = q0 + ty + 16 * i;
    inv[i] = l[i] > 0 ? static_cast<float>(1.0 / l[i]) : 0.f;
    if (tx == 0 && t < T) lse[t * nh + h] = static_cast<float>(double(m[i]) + log(l[i]));
  }
  store_tile<HD, BT>(out + int64_t(h) * hd, O, inv, q0, T, ldq, hd, ty, tx);
}

// dq: one CTA per (query tile, head); P = exp(S * scale - lse), dS = P (dP - D) scale, dQ = dS K
// over the key tiles in order.
template <int HD, int BT>
__device__ __forceinline__ void attn_bwd_dq_cta(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, const float* __restrict__ out,
                                                const float* __restrict__ lse, const float* __restrict__ dout,
                                                const int32_t* __restrict__ seq0, int64_t T, int nh, int nkv, int hd,
                                                float scale, float* __restrict__ dq, int64_t qtile, int h) {
  using Tl = AttnTile<HD, BT>;
  constexpr int R = Tl::R, C = Tl::C, LD = Tl::LD, LP = Tl::LP;
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);
  float* dOs = Qs + BT * LD;
  float* Ks = dOs + BT * LD;
  float* Vs = Ks + BT * LD;
  float* dSs = Vs + BT * LD;
  __shared__ int32_t s0q[BT];
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int64_t q0 = qtile * BT;
  const int g = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd, hoff = int64_t(h) * hd;
  load_tile<HD, BT>(Qs, q + hoff, q0, T, ldq, hd);
  load_tile<HD, BT>(dOs, dout + hoff, q0, T, ldq, hd);
  for (int i = threadIdx.x; i < BT; i += kAttnThreads) s0q[i] = q0 + i < T ? seq0[q0 + i] : INT_MAX;
  float lr[R], Dr[R], dQ[R][C];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t t = q0 + ty + 16 * i;
    lr[i] = t < T ? lse[t * nh + h] : 0.f;
    Dr[i] = attn_row_D<HD>(out, dout, t, T, hoff, ldq, hd, tx);
#pragma unroll
    for (int c = 0; c < C; ++c) dQ[i][c] = 0.f;
  }
  const int64_t qlast = min(q0 + BT, T) - 1;
  for (int64_t k0 = seq0[q0]; k0 <= qlast; k0 += BT) {
    __syncthreads();
    load_tile<HD, BT>(Ks, k + int64_t(g) * hd, k0, T, ldk, hd);
    load_tile<HD, BT>(Vs, v + int64_t(g) * hd, k0, T, ldk, hd);
    __syncthreads();
    float S[R][R], dP[R][R];
    tile_dot<HD, BT>(Qs, Ks, S, ty, tx);
    tile_dot<HD, BT>(dOs, Vs, dP, ty, tx);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = ty + 16 * i;
      const int64_t t = q0 + r;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int64_t kj = k0 + tx + 16 * j;
        float ds = 0.f;
        if (t < T && kj <= t && kj >= s0q[r]) {
          const float p = expf(__fsub_rn(__fmul_rn(S[i][j], scale), lr[i]));
          ds = __fmul_rn(__fmul_rn(p, __fsub_rn(dP[i][j], Dr[i])), scale);
        }
        dSs[r * LP + tx + 16 * j] = ds;
      }
    }
    __syncthreads();
    tile_acc<HD, BT>(dSs, Ks, dQ, ty, tx);
  }
  float one[R];
#pragma unroll
  for (int i = 0; i < R; ++i) one[i] = 1.f;
  store_tile<HD, BT>(dq + hoff, dQ, one, q0, T, ldq, hd, ty, tx);
}

// dk, dv: one CTA per (key tile, kv head), looping over the group's heads in order and, for each,
// the query tiles that can see the key tile in order. Transposed tiles: rows are keys.
template <int HD, int BT>
__device__ __forceinline__ void attn_bwd_dkdv_cta(const float* __restrict__ q, const float* __restrict__ k,
                                                  const float* __restrict__ v, const float* __restrict__ out,
                                                  const float* __restrict__ lse, const float* __restrict__ dout,
                                                  const int32_t* __restrict__ seq0, int64_t T, int nh, int nkv, int hd,
                                                  float scale, float* __restrict__ dk, float* __restrict__ dv,
                                                  int64_t ktile, int g) {
  using Tl = AttnTile<HD, BT>;
  constexpr int R = Tl::R, C = Tl::C, LD = Tl::LD, LP = Tl::LP;
  extern __shared__ float4 smem4[];
  float* Ks = reinterpret_cast<float*>(smem4);
  float* Vs = Ks + BT * LD;
  float* Qs = Vs + BT * LD;
  float* dOs = Qs + BT * LD;
  float* Ps = dOs + BT * LD;
  float* dSs = Ps + BT * LP;
  __shared__ int32_t s0q[BT];
  __shared__ float lse_s[BT], D_s[BT];
  __shared__ int64_t qend_s;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int64_t k0 = ktile * BT;
  const int G = nh / nkv;
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd, goff = int64_t(g) * hd;
  load_tile<HD, BT>(Ks, k + goff, k0, T, ldk, hd);
  load_tile<HD, BT>(Vs, v + goff, k0, T, ldk, hd);
  const int64_t klast = min(k0 + BT, T) - 1;
  if (threadIdx.x == 0) {  // the first query past klast whose sequence starts after klast
    int64_t lo = klast + 1, hi = T;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (seq0[mid] > klast) hi = mid;
      else lo = mid + 1;
    }
    qend_s = lo;
  }
  __syncthreads();
  const int64_t qend = qend_s;
  float dK[R][C], dV[R][C];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < C; ++c) dK[i][c] = dV[i][c] = 0.f;
  for (int h = g * G; h < (g + 1) * G; ++h) {
    const int64_t hoff = int64_t(h) * hd;
    for (int64_t qt0 = k0; qt0 < qend; qt0 += BT) {
      __syncthreads();  // the previous query tile is consumed
      load_tile<HD, BT>(Qs, q + hoff, qt0, T, ldq, hd);
      load_tile<HD, BT>(dOs, dout + hoff, qt0, T, ldq, hd);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        const int64_t t = qt0 + r;
        const float D = attn_row_D<HD>(out, dout, t, T, hoff, ldq, hd, tx);
        if (tx == 0) {
          D_s[r] = D;
          lse_s[r] = t < T ? lse[t * nh + h] : 0.f;
          s0q[r] = t < T ? seq0[t] : INT_MAX;
        }
      }
      __syncthreads();
      float S[R][R], dP[R][R];
      tile_dot<HD, BT>(Ks, Qs, S, ty, tx);
      tile_dot<HD, BT>(Vs, dOs, dP, ty, tx);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        const int64_t kj = k0 + r;
#pragma unroll
        for (int j = 0; j < R; ++j) {
          const int cq = tx + 16 * j;
          const int64_t t = qt0 + cq;
          float p = 0.f, ds = 0.f;
          if (t < T && kj <= t && kj >= s0q[cq]) {
            p = expf(__fsub_rn(__fmul_rn(S[i][j], scale), lse_s[cq]));
            ds = __fmul_rn(__fmul_rn(p, __fsub_rn(dP[i][j], D_s[cq])), scale);
          }
          Ps[r * LP + cq] = p;
          dSs[r * LP + cq] = ds;
        }
      }
      __syncthreads();
      tile_acc<HD, BT>(Ps, dOs, dV, ty, tx);
      tile_acc<HD, BT>(dSs, Qs, dK, ty, tx);
    }
  }
  float one[R];
#pragma unroll
  for (int i = 0; i < R; ++i) one[i] = 1.f;
  store_tile<HD, BT>(dk + goff, dK, one, k0, T, ldk, hd, ty, tx);
  store_tile<HD, BT>(dv + goff, dV, one, k0, T, ldk, hd, ty, tx);
}

// Both backward passes in one launch: the (key tile, kv head) CTAs first (the longest: a key tile
// early in a sequence is seen by all of the sequence's later queries), then the (query tile, head)
// CTAs, the latest query tiles first; these fill the SMs that the first kind leaves idle.
template <int HD, int BT>
__global__ void __launch_bounds__(kAttnThreads)
attn_bwd_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                const float* __restrict__ out, const float* __restrict__ lse, const float* __restrict__ dout,
                const int32_t* __restrict__ seq0, int64_t T, int nh, int nkv, int hd, float scale,
                float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, int64_t tiles) {
  const int64_t b = blockIdx.x, nkv_ctas = tiles * nkv;
  if (b < nkv_ctas) {
    attn_bwd_dkdv_cta<HD, BT>(q, k, v, out, lse, dout, seq0, T, nh, nkv, hd, scale, dk, dv, b % tiles,
                              static_cast<int>(b / tiles));
  } else {
    const int64_t c = b - nkv_ctas;
    attn_bwd_dq_cta<HD, BT>(q, k, v, out, lse, dout, seq0, T, nh, nkv, hd, scale, dq, tiles - 1 - c % tiles,
                            static_cast<int>(c / tiles));
  }
}

template <int HD>
constexpr int attn_bt() {
  return HD <= 128 ? 64 : 32;
}

template <typename Kernel>
void attn_prepare(Kernel kernel, size_t smem, const char* what) {
  const int maxs = max_smem_optin();
  QUADS_CHECK(smem + 1024 <= size_t(maxs), "cuda {}: {} bytes of shared memory per CTA (the device allows {})", what,
              smem, maxs);
  if (smem > 48 * 1024)
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

template <int HD>
void attn_fwd_launch(const float* q, const float* k, const float* v, const int32_t* seq0, int64_t T, int nh, int nkv,
                     int hd, float scale, float* out, float* lse, cudaStream_t s) {
  constexpr int BT = attn_bt<HD>();
  using Tl = AttnTile<HD, BT>;
  const size_t smem = sizeof(float) * (2 * size_t(BT) * Tl::LD + size_t(BT) * Tl::LP);
  attn_prepare(attn_fwd_kernel<HD, BT>, smem, "attention_train_fwd");
  const dim3 grid(static_cast<unsigned>((T + BT - 1) / BT), static_cast<unsigned>(nh));
  attn_fwd_kernel<HD, BT><<<grid, kAttnThreads, smem, s>>>(q, k, v, seq0, T, nh, nkv, hd, scale, out, lse);
  QUADS_CUDA_LAUNCH_CHECK();
}

template <int HD>
void attn_bwd_launch(const float* q, const float* k, const float* v, const float* out, const float* lse,
                     const float* dout, const int32_t* seq0, int64_t T, int nh, int nkv, int hd, float scale, float* dq,
                     float* dk, float* dv, cudaStream_t s) {
  constexpr int BT = attn_bt<HD>();
  using Tl = AttnTile<HD, BT>;
  const int64_t tiles = (T + BT - 1) / BT;
  // The dk/dv CTAs' tiles: K, V, Q, dO and P, dS; the dq CTAs' (Q, dO, K, V and dS) fit in them.
  const size_t smem = sizeof(float) * (4 * size_t(BT) * Tl::LD + 2 * size_t(BT) * Tl::LP);
  attn_prepare(attn_bwd_kernel<HD, BT>, smem, "attention_train_bwd");
  const int64_t ctas = tiles * (nkv + nh);
  QUADS_CHECK(ctas < (int64_t(1) << 31), "cuda attention_train_bwd: {} tokens x {} heads is too many", T, nh + nkv);
  attn_bwd_kernel<HD, BT><<<static_cast<unsigned>(ctas), kAttnThreads, smem, s>>>(q, k, v, out, lse, dout, seq0, T, nh,
                                                                                  nkv, hd, scale, dq, dk, dv, tiles);
  QUADS_CUDA_LAUNCH_CHECK();
}

void attn_check(const char* what, int64_t T, int nh, int nkv, int hd, std::initializer_list<const void*> ptrs) {
  QUADS_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "cuda {}: {} query heads over {} kv heads", what, nh, nkv);
  QUADS_CHECK(hd > 0 && hd % 32 == 0 && hd <= 256, "cuda {}: head_dim {} (a multiple of 32, at most 256)", what, hd);
  QUADS_CHECK(nh <= 65535 && nkv <= 65535, "cuda {}: {} heads", what, nh);
  QUADS_CHECK(T < (int64_t(1) << 31), "cuda {}: {} tokens (at most 2^31 - 1)", what, T);
  for (const void* p : ptrs)
    QUADS_CHECK(aligned16(p), "cuda {}: a q/k/v/out/dout/dq/dk/dv pointer is not 16-byte aligned", what);
}

// ---------------------------------------------------------------------------------------------
// Router

// One warp per token (decode has few tokens: a thread per token left the step waiting on 64
// serial softmaxes). Softmax as cpu::softmax_forward: exp rounded from double (matches the
// correctly rounded float exp almost always), the sum in double in expert order (lane 0). Top-k
// by repeated arg-max as cpu::router_topk_forward (the larger probability, the lower id on ties;
// all-NaN rows take the lowest free ids, as the CPU's scan), or the forced experts. A forced id
// outside 0..E-1 gets a NaN weight (it shows in the loss). Shared: per warp E probabilities, k ids.
constexpr int kTopkWarps = 4;
__global__ void router_topk_fwd_kernel(const float* __restrict__ logits, int64_t T, int E, int k, bool norm_topk,
                                       float* __restrict__ probs, int32_t* __restrict__ idx, float* __restrict__ w,
                                       const int32_t* __restrict__ forced) {
  extern __shared__ float topk_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kTopkWarps + warp;
  if (t >= T) return;  // whole warps; only warp-level sync below
  float* ps = topk_smem + int64_t(warp) * (E + k);
  int32_t* sel = reinterpret_cast<int32_t*>(ps + E);
  const float* x = logits + t * E;
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, x[e]);
  m = warp_max(m);
  for (int e = lane; e < E; e += 32) ps[e] = static_cast<float>(exp(double(__fsub_rn(x[e], m))));
  __syncwarp();
  double sum = 0;
  if (lane == 0)
    for (int e = 0; e < E; ++e) sum = __dadd_rn(sum, double(ps[e]));
  sum = __shfl_sync(0xffffffffu, sum, 0);
  const float inv = static_cast<float>(1.0 / sum);
  float* p = probs + t * E;
  for (int e = lane; e < E; e += 32) {
    const float v = __fmul_rn(ps[e], inv);
    ps[e] = v;
    p[e] = v;
  }
  __syncwarp();
  if (forced) {
    for (int s = lane; s < k; s += 32) sel[s] = forced[t * k + s];
  } else {
    for (int s = 0; s < k; ++s) {
      int best = -1;
      float bp = 0.f;
      for (int e = lane; e < E; e += 32) {
        bool taken = false;
        for (int r = 0; r < s; ++r) taken |= (sel[r] == e);
        if (taken) continue;
        if (best < 0 || ps[e] > bp) {
          best = e;
          bp = ps[e];
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const int ob = __shfl_xor_sync(0xffffffffu, best, o);
        const float op = __shfl_xor_sync(0xffffffffu, bp, o);
        if (ob >= 0 && (best < 0 || op > bp || (!(bp > op) && ob < best))) {
          best = ob;
          bp = op;
        }
      }
      if (lane == 0) sel[s] = best;
      __syncwarp();
    }
  }
  __syncwarp();
  if (lane == 0) {
    float tot = 0;
    for (int s = 0; s < k; ++s) {
      const int e = sel[s];
      const float pe = e >= 0 && e < E ? ps[e] : NAN;
      idx[t * k + s] = e;
      w[t * k + s] = pe;
      tot = __fadd_rn(tot, pe);
    }
    if (norm_topk)
      for (int s = 0; s < k; ++s) w[t * k + s] = __fdiv_rn(w[t * k + s], tot);
  }
}

// The k <= 32 largest of a warp's E <= 64 probabilities (lane l holds experts l and l + 32) in
// (probability desc, id asc) order, by a bitonic sort of 64-bit keys (probability bits, then the
// complement of the id: for probabilities >= +0 the key order is that order, ties included) in
// registers: 21 compare-exchange steps, 20 of them a shuffle away, instead of every lane counting
// the experts ahead of its own (64 dependent steps). Returns lane l's key of place l (places
// 0..31 of the order); experts past E sort last (key 0).
__device__ __forceinline__ uint64_t topk_sort_keys(const float (&pv)[2], int E, int lane) {
  uint64_t key[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int e = lane + 32 * j;
    key[j] = e < E ? (uint64_t(__float_as_uint(pv[j])) << 32) | uint64_t(0xFFFFu - unsigned(e)) : 0ull;
  }
  // element i = 32 j + lane; sorted descending over i
#pragma unroll
  for (int size = 2; size <= 64; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int i = 32 * j + lane;
        // descending blocks where (i & size) == 0 (the last stage is one descending block)
        const bool desc = size == 64 || (i & size) == 0;
        if (stride == 32) {
          if (j == 0) {  // the pair (lane, lane + 32) is this lane's two keys
            const bool swap = desc ? key[0] < key[1] : key[0] > key[1];
            if (swap) {
              const uint64_t tmp = key[0];
              key[0] = key[1];
              key[1] = tmp;
            }
          }
        } else {
          const uint64_t other = __shfl_xor_sync(0xffffffffu, key[j], stride);
          const bool lower = (i & stride) == 0;  // keeps the larger key where descending
          const bool take = desc == lower ? other > key[j] : other < key[j];
          if (take) key[j] = other;
        }
      }
    }
  }
  return key[0];
}

// router_topk_fwd_kernel with a lane's logits and probabilities in registers (experts lane + 32 j,
// EPL of them): a chosen expert is marked by its owner lane instead of every lane scanning the
// chosen list for each candidate; lane 0's winner is broadcast by a shuffle. The softmax (max, exp
// from double, lane 0's sum in expert order), the arg-max butterfly and the final weights are the
// old kernel's operations: the same bits.
// One token t by one warp (lane = its lane); ps: the warp's shared E + k floats (sel, the chosen
// ids, left in ps + E). Also the body of router_route_kernel.
template <int EPL>
__device__ __forceinline__ void router_topk_row(const float* __restrict__ logits, int64_t t, int E, int k,
                                                bool norm_topk, float* __restrict__ probs, int32_t* __restrict__ idx,
                                                float* __restrict__ w, const int32_t* __restrict__ forced, float* ps,
                                                int lane) {
  int32_t* sel = reinterpret_cast<int32_t*>(ps + E);
  const float* x = logits + t * E;
  float pv[EPL];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    pv[j] = e < E ? x[e] : -INFINITY;
    m = fmaxf(m, pv[j]);
  }
  m = warp_max(m);
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    if (e < E) {
      pv[j] = static_cast<float>(exp(double(__fsub_rn(pv[j], m))));
      ps[e] = pv[j];
    }
  }
  __syncwarp();
  double sum = 0;
  if (lane == 0)
    for (int e = 0; e < E; ++e) sum = __dadd_rn(sum, double(ps[e]));
  sum = __shfl_sync(0xffffffffu, sum, 0);
  const float inv = static_cast<float>(1.0 / sum);
  float* p = probs + t * E;
  __syncwarp();
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int e = lane + 32 * j;
    if (e < E) {
      pv[j] = __fmul_rn(pv[j], inv);
      ps[e] = pv[j];
      p[e] = pv[j];
    }
  }
  bool nan = false;
#pragma unroll
  for (int j = 0; j < EPL; ++j) nan |= lane + 32 * j < E && pv[j] != pv[j];
  if (EPL <= 2 && !forced && k <= 32 && !__any_sync(0xffffffffu, nan)) {
    // the sorting network's order; lane s < k holds place s, and the weights' float sum runs in
    // place order by lane 0 (the loop below's operations): the same selection and bits
    const float q2[2] = {pv[0], pv[EPL - 1]};  // (EPL 1: the second is past E)
    const uint64_t key = topk_sort_keys(q2, EPL > 1 ? E : min(E, 32), lane);
    const int e = static_cast<int>(0xFFFFu - unsigned(key & 0xFFFFu));
    const float pe = __uint_as_float(static_cast<uint32_t>(key >> 32));
    float tot = 0.f;
    for (int s = 0; s < k; ++s) tot = __fadd_rn(tot, __shfl_sync(0xffffffffu, pe, s));
    if (lane < k) {
      sel[lane] = e;
      idx[t * k + lane] = e;
      w[t * k + lane] = norm_topk ? __fdiv_rn(pe, tot) : pe;
    }
    __syncwarp();
    return;
  }
  if (forced) {
    for (int s = lane; s < k; s += 32) sel[s] = forced[t * k + s];
  } else if (!__any_sync(0xffffffffu, nan)) {
    // Without NaNs the argmax rounds below pick the experts in (probability desc, id asc) order, a
    // total order: an expert's place in it is the experts before it, counted in one pass over ps
    // (broadcast reads) instead of k rounds of dependent shuffles. The same selection.
    __syncwarp();
    int rank[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) rank[j] = 0;
    for (int e2 = 0; e2 < E; ++e2) {
      const float q = ps[e2];
#pragma unroll
      for (int j = 0; j < EPL; ++j) rank[j] += q > pv[j] || (q == pv[j] && e2 < lane + 32 * j);
    }
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (lane + 32 * j < E && rank[j] < k) sel[rank[j]] = lane + 32 * j;
  } else {
    bool taken[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) taken[j] = false;
    for (int s = 0; s < k; ++s) {
      int best = -1;
      float bp = 0.f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int e = lane + 32 * j;
        if (e >= E || taken[j]) continue;
        if (best < 0 || pv[j] > bp) {
          best = e;
          bp = pv[j];
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const int ob = __shfl_xor_sync(0xffffffffu, best, o);
        const float op = __shfl_xor_sync(0xffffffffu, bp, o);
        if (ob >= 0 && (best < 0 || op > bp || (!(bp > op) && ob < best))) {
          best = ob;
          bp = op;
        }
      }
      best = __shfl_sync(0xffffffffu, best, 0);
      if (lane == 0) sel[s] = best;
#pragma unroll
      for (int j = 0; j < EPL; ++j) taken[j] = taken[j] || best == lane + 32 * j;
    }
  }
  __syncwarp();
  if (lane == 0) {
    float tot = 0;
    for (int s = 0; s < k; ++s) {
      const int e = sel[s];
      const float pe = e >= 0 && e < E ? ps[e] : NAN;
      idx[t * k + s] = e;
      w[t * k + s] = pe;
      tot = __fadd_rn(tot, pe);
    }
    if (norm_topk)
      for (int s = 0; s < k; ++s) w[t * k + s] = __fdiv_rn(w[t * k + s], tot);
  }
}

template <int EPL>
__global__ void router_topk_fwd_reg_kernel(const float* __restrict__ logits, int64_t T, int E, int k, bool norm_topk,
                                           float* __restrict__ probs, int32_t* __restrict__ idx,
                                           float* __restrict__ w, const int32_t* __restrict__ forced) {
  extern __shared__ float topk_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kTopkWarps + warp;
  if (t >= T) return;  // whole warps; only warp-level sync below
  router_topk_row<EPL>(logits, t, E, k, norm_topk, probs, idx, w, forced, topk_smem + int64_t(warp) * (E + k), lane);
}

// Top-k and routing of a decode step in one launch (router_route): warp w of CTA b takes token
// b * kRouteWarps + w (router_topk_row), then the last CTA to finish (a ticket in global memory,
// reset by that CTA) routes all n = T * k entries in shared memory as route_count_kernel +
// route_place_kernel do. Routing: warp w owns the contiguous entries [w * seg, (w + 1) * seg) and
// counts each expert in them (__match_any_sync per 32 entries, the group's first lane adds), so an
// entry's row is eoff[e] + the entries of e in earlier warps + those earlier in its own warp: flat
// order within an expert, as cpu::moe_permute. Integer sums only: the bits of the separate kernels.
constexpr int kRouteWarps = 8;
constexpr int64_t kRouteMaxEntries = 8192;  // T * k above this: the separate kernels

__device__ void route_block(const int32_t* __restrict__ idx, int n, int E, int32_t* smem, int32_t* __restrict__ counts,
                            int32_t* __restrict__ eoff, int32_t* __restrict__ perm, int32_t* __restrict__ inv,
                            unsigned long long* active, int32_t* bad) {
  __shared__ int s_bad, s_total;
  constexpr int nw = kRouteWarps;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int32_t* cnt = smem;            // [nw][E]: per-warp counts, then per-warp first rows
  int32_t* sidx = cnt + nw * E;   // [n]
  int32_t* sofs = sidx + n;       // [E]: counts, then eoff
  for (int i = threadIdx.x; i < n; i += blockDim.x) sidx[i] = __ldcg(idx + i);  // L2: other CTAs wrote them
  for (int j = threadIdx.x; j < nw * E; j += blockDim.x) cnt[j] = 0;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  const int seg = (n + nw - 1) / nw, i0 = min(n, warp * seg), i1 = min(n, i0 + seg);
  const unsigned below = (1u << lane) - 1u;
  bool anybad = false;
  for (int c0 = i0; c0 < i1; c0 += 32) {  // warp-uniform bounds
    const int i = c0 + lane;
    const int v = i < i1 ? sidx[i] : 0;
    const bool ok = i < i1 && v >= 0 && v < E;
    anybad |= i < i1 && !ok;
    const unsigned same = __match_any_sync(0xffffffffu, ok ? v : -1);
    if (ok && (same & below) == 0) cnt[warp * E + v] += __popc(same);
    __syncwarp();
  }
  if (__any_sync(0xffffffffu, anybad) && lane == 0) s_bad = 1;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int c = 0;
    for (int w = 0; w < nw; ++w) c += cnt[w * E + e];
    sofs[e] = c;
    counts[e] = c;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the counts, 32 experts at a time
    int carry = 0, used = 0;
    for (int c0 = 0; c0 < E; c0 += 32) {
      const int e = c0 + lane;
      const int v = e < E ? sofs[e] : 0;
      int incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      if (e < E) {
        eoff[e] = carry + incl - v;
        sofs[e] = carry + incl - v;
      }
      used += __popc(__ballot_sync(0xffffffffu, v > 0));
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      eoff[E] = carry;
      s_total = carry;
      if (active && used > 0) atomicAdd(active, static_cast<unsigned long long>(used));
      if (bad && s_bad) *bad = 1;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int b = sofs[e];
    for (int w = 0; w < nw; ++w) {
      const int c = cnt[w * E + e];
      cnt[w * E + e] = b;
      b += c;
    }
  }
  __syncthreads();
  for (int c0 = i0; c0 < i1; c0 += 32) {
    const int i = c0 + lane;
    const int v = i < i1 ? sidx[i] : 0;
    const bool ok = i < i1 && v >= 0 && v < E;
    const unsigned same = __match_any_sync(0xffffffffu, ok ? v : -1);
    if (ok) {
      const int r = cnt[warp * E + v] + __popc(same & below);
      perm[r] = i;
      inv[i] = r;
    } else if (i < i1) {
      inv[i] = 0;  // an invalid id (reported through bad) reads row 0, as route_place_kernel
    }
    __syncwarp();
    if (ok && (same & below) == 0) cnt[warp * E + v] += __popc(same);
    __syncwarp();
  }
  for (int r = s_total + threadIdx.x; r < n; r += blockDim.x) perm[r] = 0;
}

// route_block for a batch whose n = T * k <= 32 entries are one CTA's (decode batches up to 4 at
// top-8), by one warp: lane i takes entry i, its id read from the top-k warps' shared memory (the
// ids router_topk_row wrote to idx), so no global round trip and no block barriers. The same
// outputs as route_block: counts, eoff, perm in flat order within an expert, inv, active, bad.
// ecnt: E ints of shared memory outside the top-k scratch.
__device__ void route_warp(const float* topk_smem, int T, int E, int k, int32_t* ecnt, int32_t* __restrict__ counts,
                           int32_t* __restrict__ eoff, int32_t* __restrict__ perm, int32_t* __restrict__ inv,
                           unsigned long long* active, int32_t* bad, int lane) {
  const int n = T * k;
  const unsigned below = (1u << lane) - 1u;
  int v = -1;
  if (lane < n) {
    const int t = lane / k;
    v = reinterpret_cast<const int32_t*>(topk_smem + t * (E + k) + E)[lane - t * k];
  }
  const bool ok = lane < n && v >= 0 && v < E;
  const bool anybad = __any_sync(0xffffffffu, lane < n && !ok);
  for (int e = lane; e < E; e += 32) ecnt[e] = 0;
  __syncwarp();
  const unsigned same = __match_any_sync(0xffffffffu, ok ? v : -1);
  if (ok && (same & below) == 0) ecnt[v] = __popc(same);
  __syncwarp();
  // exclusive scan over the experts, lane l taking experts l * epw .. l * epw + epw - 1
  const int epw = (E + 31) / 32;
  int loc = 0, used = 0;
  for (int j = 0; j < epw; ++j) {
    const int e = lane * epw + j;
    if (e < E) {
      loc += ecnt[e];
      used += ecnt[e] > 0;
    }
  }
  int incl = loc;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  for (int o = 16; o > 0; o >>= 1) used += __shfl_xor_sync(0xffffffffu, used, o);
  const int total = __shfl_sync(0xffffffffu, incl, 31);
  int run = incl - loc;
  for (int j = 0; j < epw; ++j) {
    const int e = lane * epw + j;
    if (e < E) {
      const int c = ecnt[e];
      counts[e] = c;
      eoff[e] = run;
      ecnt[e] = run;  // the expert's first row, for the entries below
      run += c;
    }
  }
  if (lane == 0) {
    eoff[E] = total;
    if (active && used > 0) atomicAdd(active, static_cast<unsigned long long>(used));
    if (bad && anybad) *bad = 1;
  }
  __syncwarp();
  if (lane < n) {
    if (ok) {
      const int r = ecnt[v] + __popc(same & below);
      perm[r] = lane;
      inv[lane] = r;
    } else {
      inv[lane] = 0;  // an invalid id (reported through bad) reads row 0, as route_block
    }
  }
  for (int r = total + lane; r < n; r += 32) perm[r] = 0;
}

template <int EPL>
__global__ void __launch_bounds__(32 * kRouteWarps)
router_route_kernel(const float* __restrict__ logits, int64_t T, int E, int k, bool norm_topk,
                    float* __restrict__ probs, int32_t* __restrict__ idx, float* __restrict__ w,
                    int32_t* __restrict__ counts, int32_t* __restrict__ eoff, int32_t* __restrict__ perm,
                    int32_t* __restrict__ inv, unsigned long long* active, int32_t* bad, unsigned int* ticket,
                    bool warp_route) {
  pdl_begin();
  extern __shared__ float route_smem[];
  __shared__ int s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRouteWarps + warp;
  if (t < T) router_topk_row<EPL>(logits, t, E, k, norm_topk, probs, idx, w, nullptr, route_smem + warp * (E + k), lane);
  if (threadIdx.x == 0) step_mark(10);  // (step trace builds only) warp 0's token done
  if (gridDim.x > 1) {
    __threadfence();  // this CTA's idx before its ticket
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch
  } else {
    __syncthreads();
    if (warp_route && T * k <= 32) {  // uniform: the whole CTA returns here
      if (threadIdx.x == 0) step_mark(11);
      if (warp == 0)
        route_warp(route_smem, static_cast<int>(T), E, k, reinterpret_cast<int32_t*>(route_smem + kRouteWarps * (E + k)),
                   counts, eoff, perm, inv, active, bad, lane);
      if (threadIdx.x == 0) step_mark(12);
      return;
    }
  }
  if (threadIdx.x == 0) step_mark(11);  // the routing CTA's tokens are all done
  // the top-k scratch [kRouteWarps][E + k] is free now and holds route_block's [kRouteWarps][E]
  route_block(idx, static_cast<int>(T * k), E, reinterpret_cast<int32_t*>(route_smem), counts, eoff, perm, inv, active,
              bad);
  if (threadIdx.x == 0) step_mark(12);
}

__global__ void __launch_bounds__(32 * kRouteWarps)
route_one_kernel(const int32_t* __restrict__ idx, int n, int E, int32_t* __restrict__ counts,
                 int32_t* __restrict__ eoff, int32_t* __restrict__ perm, int32_t* __restrict__ inv,
                 unsigned long long* active, int32_t* bad) {
  pdl_begin();
  extern __shared__ float route_smem[];
  route_block(idx, n, E, reinterpret_cast<int32_t*>(route_smem), counts, eoff, perm, inv, active, bad);
}

// One warp per token; dp [E] (double) in shared memory. Lane 0 forms the sums in the CPU's order
// (selected experts, then experts 0..E-1), so the result is cpu::router_topk_backward's.
constexpr int kRouterWarps = 4;
__global__ void router_topk_bwd_kernel(const float* __restrict__ probs, const int32_t* __restrict__ idx,
                                       const float* __restrict__ w, const float* __restrict__ dw,
                                       const float* __restrict__ dprobs_extra, int64_t T, int E, int k,
                                       bool norm_topk, float* __restrict__ dlogits) {
  extern __shared__ double dps[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRouterWarps + warp;
  if (t >= T) return;  // whole warps; only warp-level sync below
  double* dp = dps + int64_t(warp) * E;
  __shared__ double dot_s[kRouterWarps];
  const float* p = probs + t * E;
  for (int e = lane; e < E; e += 32) dp[e] = dprobs_extra ? double(dprobs_extra[t * E + e]) : 0.0;
  __syncwarp();
  if (lane == 0) {
    const int32_t* it = idx + t * k;
    if (norm_topk) {
      double S = 0, c = 0;
      for (int s = 0; s < k; ++s) {
        S = __dadd_rn(S, double(p[it[s]]));
        c = __dadd_rn(c, __dmul_rn(double(dw[t * k + s]), double(w[t * k + s])));
      }
      for (int s = 0; s < k; ++s) dp[it[s]] = __dadd_rn(dp[it[s]], __dsub_rn(double(dw[t * k + s]), c) / S);
    } else {
      for (int s = 0; s < k; ++s) dp[it[s]] = __dadd_rn(dp[it[s]], double(dw[t * k + s]));
    }
    double dot = 0;
    for (int e = 0; e < E; ++e) dot = __dadd_rn(dot, __dmul_rn(double(p[e]), dp[e]));
    dot_s[warp] = dot;
  }
  __syncwarp();
  const double dot = dot_s[warp];
  for (int e = lane; e < E; e += 32)
    dlogits[t * E + e] = static_cast<float>(__dmul_rn(double(p[e]), __dsub_rn(dp[e], dot)));
}

// ---------------------------------------------------------------------------------------------
// MoE combine / scatter (the CPU's float operations, slots in order)

__global__ void moe_combine_fwd_kernel(const float* __restrict__ ye, const int32_t* __restrict__ inv,
                                       const float* __restrict__ w, int64_t T, int k, int64_t D, float* __restrict__ y) {
  const int64_t n = T * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, c = i - t * D;
    float a = 0.f;
    for (int s = 0; s < k; ++s) a = __fadd_rn(a, __fmul_rn(w[t * k + s], ye[int64_t(inv[t * k + s]) * D + c]));
    y[i] = a;
  }
}

// One warp per (token, slot): dye = w * dy (exact as the CPU), dw = <dy, ye> in double (fixed tree).
__global__ void moe_combine_bwd_kernel(const float* __restrict__ dy, const float* __restrict__ ye,
                                       const int32_t* __restrict__ inv, const float* __restrict__ w, int64_t T, int k,
                                       int64_t D, float* __restrict__ dye, float* __restrict__ dw) {
  const int64_t pair = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (pair >= T * k) return;
  const int64_t t = pair / k, r = inv[pair];
  const float ws = w[pair];
  const float* dyt = dy + t * D;
  const float* yr = ye + r * D;
  float* dr = dye + r * D;
  double acc = 0;
  for (int64_t i = lane; i < D; i += 32) {
    const float g = dyt[i];
    dr[i] = __fmul_rn(ws, g);
    acc += double(g) * double(yr[i]);  // exact products
  }
  acc = warp_sum(acc);
  if (lane == 0) dw[pair] = static_cast<float>(acc);
}

__global__ void moe_scatter_add_kernel(const float* __restrict__ dxe, const int32_t* __restrict__ inv, int64_t T,
                                       int k, int64_t D, float* __restrict__ dx, bool accumulate) {
  const int64_t n = T * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, c = i - t * D;
    float a = accumulate ? dx[i] : 0.f;
    for (int s = 0; s < k; ++s) a = __fadd_rn(a, dxe[int64_t(inv[t * k + s]) * D + c]);
    dx[i] = a;
  }
}

// The same two as row kernels (tokens over blocks, V = 4: D % 4 == 0 and 16-byte aligned rows):
// each element still sums its slots in order.
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
__device__ __forceinline__ float4 mul4(float s, float4 b) {
  return make_float4(__fmul_rn(s, b.x), __fmul_rn(s, b.y), __fmul_rn(s, b.z), __fmul_rn(s, b.w));
}
__device__ __forceinline__ float add4(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float mul4(float s, float b) { return __fmul_rn(s, b); }

template <int V>
__global__ void moe_combine_fwd_row_kernel(const float* __restrict__ ye, const int32_t* __restrict__ inv,
                                           const float* __restrict__ w, int64_t T, int k, int64_t D,
                                           float* __restrict__ y) {
  using E = std::conditional_t<V == 4, float4, float>;
  const int64_t cols = D / V;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    for (int64_t c = col0(); c < cols; c += col_step()) {
      E a;
      if constexpr (V == 4) a = make_float4(0.f, 0.f, 0.f, 0.f);
      else a = 0.f;
      for (int s = 0; s < k; ++s)
        a = add4(a, mul4(w[t * k + s], reinterpret_cast<const E*>(ye + int64_t(inv[t * k + s]) * D)[c]));
      reinterpret_cast<E*>(y + t * D)[c] = a;
    }
  }
}

template <int V>
__global__ void moe_scatter_add_row_kernel(const float* __restrict__ dxe, const int32_t* __restrict__ inv, int64_t T,
                                           int k, int64_t D, float* __restrict__ dx, bool accumulate) {
  using E = std::conditional_t<V == 4, float4, float>;
  const int64_t cols = D / V;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    E* o = reinterpret_cast<E*>(dx + t * D);
    for (int64_t c = col0(); c < cols; c += col_step()) {
      E a;
      if (accumulate) a = o[c];
      else if constexpr (V == 4) a = make_float4(0.f, 0.f, 0.f, 0.f);
      else a = 0.f;
      for (int s = 0; s < k; ++s) a = add4(a, reinterpret_cast<const E*>(dxe + int64_t(inv[t * k + s]) * D)[c]);
      o[c] = a;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU backward, in double as cpu::swiglu_backward.

__global__ void swiglu_bwd_kernel(const float* __restrict__ gu, const float* __restrict__ dh, int64_t n, int64_t I,
                                  float* __restrict__ dgu) {
  const int64_t total = n * I;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / I, i = e - r * I;
    const double g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i], d = dh[e];
    const double sg = 1.0 / __dadd_rn(1.0, exp(-g));
    const double silu = __dmul_rn(g, sg);
    dgu[r * 2 * I + i] = static_cast<float>(
        __dmul_rn(__dmul_rn(__dmul_rn(d, u), sg), __dadd_rn(1.0, __dmul_rn(g, __dsub_rn(1.0, sg)))));
    dgu[r * 2 * I + I + i] = static_cast<float>(__dmul_rn(d, silu));
  }
}

// The same per element as a row kernel (rows over blocks; V = 4: I % 4 == 0 and 16-byte aligned
// pointers).
__device__ __forceinline__ void swiglu_bwd_one(float gf, float uf, float df, float& dg, float& du) {
  const double g = gf, u = uf, d = df;
  const double sg = 1.0 / __dadd_rn(1.0, exp(-g));
  const double silu = __dmul_rn(g, sg);
  dg = static_cast<float>(__dmul_rn(__dmul_rn(__dmul_rn(d, u), sg), __dadd_rn(1.0, __dmul_rn(g, __dsub_rn(1.0, sg)))));
  du = static_cast<float>(__dmul_rn(d, silu));
}
template <int V>
__global__ void swiglu_bwd_row_kernel(const float* __restrict__ gu, const float* __restrict__ dh, int64_t n, int64_t I,
                                      float* __restrict__ dgu) {
  using E = std::conditional_t<V == 4, float4, float>;
  const int64_t cols = I / V;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const E* g = reinterpret_cast<const E*>(gu + r * 2 * I);
    const E* u = reinterpret_cast<const E*>(gu + r * 2 * I + I);
    const E* d = reinterpret_cast<const E*>(dh + r * I);
    E* og = reinterpret_cast<E*>(dgu + r * 2 * I);
    E* ou = reinterpret_cast<E*>(dgu + r * 2 * I + I);
    for (int64_t i = col0(); i < cols; i += col_step()) {
      const E gv = g[i], uv = u[i], dv = d[i];
      E a, b;
      const float* gp = reinterpret_cast<const float*>(&gv);
      const float* up = reinterpret_cast<const float*>(&uv);
      const float* dp = reinterpret_cast<const float*>(&dv);
      float* ap = reinterpret_cast<float*>(&a);
      float* bp = reinterpret_cast<float*>(&b);
#pragma unroll
      for (int j = 0; j < V; ++j) swiglu_bwd_one(gp[j], up[j], dp[j], ap[j], bp[j]);
      og[i] = a;
      ou[i] = b;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding backward: one CTA per distinct id, its tokens in order, added into the table row.

__global__ void embedding_bwd_kernel(const float* __restrict__ dout, const int32_t* __restrict__ order,
                                     const int32_t* __restrict__ starts, const int32_t* __restrict__ ids, int64_t H,
                                     float* __restrict__ dtable) {
  const int64_t u = blockIdx.x;
  const int32_t b = starts[u], e = starts[u + 1];
  float* row = dtable + int64_t(ids[u]) * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float a = row[c];
    for (int32_t i = b; i < e; ++i) a = __fadd_rn(a, dout[int64_t(order[i]) * H + c]);
    row[c] = a;
  }
}

// ---------------------------------------------------------------------------------------------
// Losses on logits: one CTA per row. Row statistics in double from the scaled float row (max,
// then sum of exp(x - max), fixed trees), as train::row_stats.

constexpr int kLossThreads = 512;

// x_scale * logits[i], the float the CPU forms before its row statistics.
template <bool kVec>
__device__ __forceinline__ void row_max_lse(const float* __restrict__ x, int64_t V, float xs, double* red_d,
                                            float* red_f, float* m_out, double* lse_out) {
  float m = -INFINITY;
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
      const float4 a = x4[i];
      m = fmaxf(m, fmaxf(fmaxf(__fmul_rn(a.x, xs), __fmul_rn(a.y, xs)), fmaxf(__fmul_rn(a.z, xs), __fmul_rn(a.w, xs))));
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, __fmul_rn(x[i], xs));
  }
  m = block_max(m, red_f);
  const double md = m;
  double s = 0;
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
      const float4 a = x4[i];
      s += exp(double(__fmul_rn(a.x, xs)) - md) + exp(double(__fmul_rn(a.y, xs)) - md);
      s += exp(double(__fmul_rn(a.z, xs)) - md) + exp(double(__fmul_rn(a.w, xs)) - md);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) s += exp(double(__fmul_rn(x[i], xs)) - md);
  }
  s = block_sum(s, red_d);
  *m_out = m;
  *lse_out = md + log(s);
}

template <bool kVec>
__global__ void __launch_bounds__(kLossThreads)
token_logprobs_kernel(const float* __restrict__ logits, int64_t V, const int32_t* __restrict__ targets, float xs,
                      float* __restrict__ logp, float* __restrict__ H) {
  __shared__ double red_d[32];
  __shared__ float red_f[32];
  const int64_t t = blockIdx.x;
  const int32_t tg = targets[t];
  if (tg < 0 && !H) {
    if (threadIdx.x == 0) logp[t] = 0.f;
    return;
  }
  const float* x = logits + t * V;
  float m;
  double lse;
  row_max_lse<kVec>(x, V, xs, red_d, red_f, &m, &lse);
  if (threadIdx.x == 0) logp[t] = tg >= 0 && tg < V ? static_cast<float>(double(__fmul_rn(x[tg], xs)) - lse) : 0.f;
  if (!H) return;
  double h = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const double lp = double(__fmul_rn(x[i], xs)) - lse;
    h = __dsub_rn(h, __dmul_rn(exp(lp), lp));
  }
  h = block_sum(h, red_d);
  if (threadIdx.x == 0) H[t] = static_cast<float>(h);
}

template <bool kVec>
__global__ void __launch_bounds__(kLossThreads)
token_logprobs_bwd_kernel(const float* __restrict__ logits, int64_t V, const int32_t* __restrict__ targets, float xs,
                          const float* __restrict__ dlogp, float* __restrict__ dlogits) {
  __shared__ double red_d[32];
  __shared__ float red_f[32];
  const int64_t t = blockIdx.x;
  const int32_t tg = targets[t];
  float* d = dlogits + t * V;
  if (tg < 0 || dlogp[t] == 0.f) {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) d[i] = 0.f;
    return;
  }
  const float* x = logits + t * V;
  float m;
  double lse;
  row_max_lse<kVec>(x, V, xs, red_d, red_f, &m, &lse);
  const double g = __dmul_rn(double(xs), double(dlogp[t]));
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const double p = exp(double(__fmul_rn(x[i], xs)) - lse);
    d[i] = static_cast<float>(__dmul_rn(g, __dsub_rn(i == tg ? 1.0 : 0.0, p)));
  }
}

// ---------------------------------------------------------------------------------------------
// Optimizer

constexpr int64_t kNormChunk = int64_t(1) << 16;  // elements per CTA of global_norm
constexpr int kNormThreads = 256;

template <bool kVec>
__global__ void norm_part_kernel(const float* __restrict__ g, int64_t n, double* __restrict__ part) {
  __shared__ double red[32];
  const int64_t b = int64_t(blockIdx.x) * kNormChunk, e = min(n, b + kNormChunk);
  double s = 0;
  if constexpr (kVec) {
    const float4* g4 = reinterpret_cast<const float4*>(g + b);
    const int64_t n4 = (e - b) / 4;
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
      const float4 a = g4[i];
      s += (double(a.x) * double(a.x) + double(a.y) * double(a.y)) + (double(a.z) * double(a.z) + double(a.w) * double(a.w));
    }
    for (int64_t i = b + n4 * 4 + threadIdx.x; i < e; i += blockDim.x) s += double(g[i]) * double(g[i]);
  } else {
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) s += double(g[i]) * double(g[i]);
  }
  s = block_sum(s, red);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ void norm_final_kernel(const double* __restrict__ part, int64_t nparts, double* __restrict__ out) {
  __shared__ double red[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < nparts; i += blockDim.x) s += part[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) *out = sqrt(s);
}

// One thread an element of q's rows, then of k's; a multiply by f and a division by f, as the CPU.
__global__ void kv_factor_kernel(float* __restrict__ q, float* __restrict__ k, int64_t n, int nh, int nkv, int hd,
                                 const float* __restrict__ f) {
  const int64_t nq = n * nh * hd, nk = n * nkv * hd;
  const int group = nh / nkv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nq + nk; i += int64_t(gridDim.x) * blockDim.x) {
    if (i < nq) {
      const int j = static_cast<int>(i % hd), h = static_cast<int>((i / hd) % nh);
      q[i] = __fmul_rn(q[i], f[(h / group) * hd + j]);
    } else {
      const int64_t e = i - nq;
      k[e] = __fdiv_rn(k[e], f[e % (int64_t(nkv) * hd)]);
    }
  }
}

__global__ void sub_cols_kernel(float* __restrict__ x, int64_t n, int64_t cols, const float* __restrict__ m) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __fsub_rn(x[i], m[i % cols]);
}

__global__ void scale_kernel(float* __restrict__ x, int64_t n, float coef) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __fmul_rn(x[i], coef);
}

// train::AdamW::step's element update, operation by operation.
// clip != 1: the gradient is first clipped (scale_kernel's multiply, written back); bf16_out: the
// new parameter's BF16 bits as well (the trainer's BF16 GEMM operands).
// One parameter's AdamW update (train::AdamW::step's operations, in its order): g already clipped,
// f the decay factor; m and v updated in place; returns the new parameter.
struct AdamWConsts {
  float b1, b2, step_size, bc2_sqrt, eps, decay, clip;
};
__device__ __forceinline__ float adamw1(float g, float p, float& m, float& v, bool decays, const AdamWConsts& k) {
  const float c1 = __fsub_rn(1.f, k.b1), c2 = __fsub_rn(1.f, k.b2);
  const float f = decays ? k.decay : 1.f;
  const float pf = __fmul_rn(p, f);
  m = __fadd_rn(__fmul_rn(k.b1, m), __fmul_rn(c1, g));
  v = __fadd_rn(__fmul_rn(k.b2, v), __fmul_rn(c2, __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), k.eps);
  return __fsub_rn(pf, __fmul_rn(k.step_size, __fdiv_rn(m, denom)));
}

// The range of `a` that holds parameter i (i + base in the whole array), or -1.
__device__ __forceinline__ int amax_range(const AdamWAmax& a, int64_t i) {
  int lo = 0, hi = a.count;  // the first range whose end is past i
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a.end[mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  return lo < a.count && a.begin[lo] <= i ? lo : -1;
}
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

// base: the index of params[0] in the array the ranges of `a` refer to.
__global__ void adamw_kernel(float* __restrict__ params, float* __restrict__ grads, float* __restrict__ m,
                             float* __restrict__ v, const uint8_t* __restrict__ mask, int64_t n, AdamWConsts k,
                             uint16_t* __restrict__ bf16_out, AdamWAmax a, int64_t base) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float g = grads[i];
    if (k.clip != 1.f) {
      g = __fmul_rn(g, k.clip);
      grads[i] = g;
    }
    float mi = m[i], vi = v[i];
    const float pn = adamw1(g, params[i], mi, vi, mask == nullptr || mask[i], k);
    m[i] = mi;
    v[i] = vi;
    params[i] = pn;
    if (bf16_out) bf16_out[i] = static_cast<uint16_t>(dev::bf16_encode(pn));
    if (a.count > 0)
      if (const int r = amax_range(a, base + i); r >= 0) atomicMax(a.amax_bits + r, abs_bits(pn));
  }
}

// Four parameters a thread with 16-byte loads and stores (the optimizer state is ~30 bytes a
// parameter of pure streaming: 4-byte accesses left it at ~74% of the copy bandwidth).
// AMAX: CTA b takes the vectors b * kAdamCta .. + kAdamCta - 1 (kAdamVecs a thread) so that it
// knows its ranges: inside one range, one atomic a CTA; across range edges, one a thread and range.
constexpr int kAdamVecs = 4;
constexpr int64_t kAdamCta = int64_t(kThreads) * kAdamVecs;
template <bool AMAX>
__global__ void adamw_vec_kernel(float4* __restrict__ params, float4* __restrict__ grads, float4* __restrict__ m,
                                 float4* __restrict__ v, const uchar4* __restrict__ mask, int64_t n4, AdamWConsts k,
                                 uint2* __restrict__ bf16_out, AdamWAmax a) {
  auto update = [&](int64_t i) {
    float4 g = grads[i];
    const float4 p = params[i];
    float4 mi = m[i], vi = v[i];
    const uchar4 mk = mask ? mask[i] : make_uchar4(1, 1, 1, 1);
    if (k.clip != 1.f) {
      g = make_float4(__fmul_rn(g.x, k.clip), __fmul_rn(g.y, k.clip), __fmul_rn(g.z, k.clip), __fmul_rn(g.w, k.clip));
      grads[i] = g;
    }
    const float4 pn = make_float4(adamw1(g.x, p.x, mi.x, vi.x, mk.x, k), adamw1(g.y, p.y, mi.y, vi.y, mk.y, k),
                                  adamw1(g.z, p.z, mi.z, vi.z, mk.z, k), adamw1(g.w, p.w, mi.w, vi.w, mk.w, k));
    m[i] = mi;
    v[i] = vi;
    params[i] = pn;
    if (bf16_out)
      bf16_out[i] = make_uint2(dev::bf16_encode(pn.x) | (dev::bf16_encode(pn.y) << 16),
                               dev::bf16_encode(pn.z) | (dev::bf16_encode(pn.w) << 16));
    return pn;
  };
  if constexpr (!AMAX) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x)
      update(i);
  } else {
    const int64_t v0 = blockIdx.x * kAdamCta, v1 = min(n4, v0 + kAdamCta);
    __shared__ int first;
    __shared__ bool whole, none;
    if (threadIdx.x == 0) {
      int lo = 0, hi = a.count;  // the first range whose end is past the CTA's first parameter
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (a.end[mid] <= 4 * v0) lo = mid + 1;
        else hi = mid;
      }
      first = lo;
      whole = lo < a.count && a.begin[lo] <= 4 * v0 && a.end[lo] >= 4 * v1;
      none = lo == a.count || a.begin[lo] >= 4 * v1;
    }
    __syncthreads();
    if (none) {
      for (int64_t i = v0 + threadIdx.x; i < v1; i += kThreads) update(i);
      return;
    }
    int r = first;
    uint32_t mx = 0;
    for (int u = 0; u < kAdamVecs; ++u) {
      const int64_t i = v0 + u * kThreads + threadIdx.x;
      if (i >= v1) break;
      const float4 pn = update(i);
      if (whole) {
        mx = max(mx, max(max(abs_bits(pn.x), abs_bits(pn.y)), max(abs_bits(pn.z), abs_bits(pn.w))));
        continue;
      }
      const float e[4] = {pn.x, pn.y, pn.z, pn.w};
      for (int j = 0; j < 4; ++j) {  // parameters in increasing order: r only moves forward
        const int64_t p = 4 * i + j;
        while (r < a.count && a.end[r] <= p) {
          if (mx) atomicMax(a.amax_bits + r, mx);
          mx = 0;
          ++r;
        }
        if (r < a.count && a.begin[r] <= p) mx = max(mx, abs_bits(e[j]));
      }
    }
    if (!whole) {
      if (mx && r < a.count) atomicMax(a.amax_bits + r, mx);
      return;
    }
    block_atomic_max(mx, a.amax_bits + first);
  }
}

void rope_launch(float* x, int64_t n, int heads, int hd, const float* cos, const float* sin, bool backward,
                 cudaStream_t s) {
  const int half = hd / 2;
  if (legacy_train_kernels()) {
    rope_kernel<<<grid_for(n * heads * half), kThreads, 0, s>>>(x, n, heads, hd, cos, sin, backward);
  } else if (half % 4 == 0 && aligned16(x) && aligned16(cos) && aligned16(sin)) {
    rope_row_kernel<4><<<row_grid(n * heads, half / 4), row_threads(half / 4), 0, s>>>(x, n * heads, heads, hd, cos, sin,
                                                                                        backward);
  } else {
    rope_row_kernel<1><<<row_grid(n * heads, half), row_threads(half), 0, s>>>(x, n * heads, heads, hd, cos, sin,
                                                                                backward);
  }
}

// Initially on with QUADS_TRAIN_KERNELS=old (the benchmark's before / after).
std::atomic<bool>& legacy_train_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("QUADS_TRAIN_KERNELS");
    return e != nullptr && std::strcmp(e, "old") == 0;
  }()};
  return on;
}

}  // namespace

void set_legacy_train_kernels(bool on) { legacy_train_flag().store(on); }
bool legacy_train_kernels() { return legacy_train_flag().load(); }

// ---------------------------------------------------------------------------------------------
// Launchers

void rmsnorm_fwd(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, float* inv_rms,
                 cudaStream_t s) {
  if (rows == 0) return;
  QUADS_CHECK(D > 0, "cuda rmsnorm_fwd: row length D = {}", D);
  QUADS_CHECK(rows < (int64_t(1) << 31), "cuda rmsnorm_fwd: {} rows is too many", rows);
  if (D <= 1024) {
    rmsnorm_fwd_kernel<true><<<grid_for(rows, kThreads / 32), kThreads, 0, s>>>(x, w, rows, D, eps, y, inv_rms);
  } else {
    rmsnorm_fwd_kernel<false><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(x, w, rows, D, eps, y, inv_rms);
  }
  QUADS_CUDA_LAUNCH_CHECK();
}

int64_t rmsnorm_bwd_scratch(int64_t rows, int64_t D) {
  if (rows <= 0 || D <= 0) return 0;
  const int64_t chunk = rmsnorm_chunk_rows(rows);
  return 2 * ((rows + chunk - 1) / chunk) * D;  // doubles, as pairs of floats
}

void rmsnorm_bwd(const float* dy, const float* x, const float* w, const float* inv_rms, int64_t rows, int64_t D,
                 float* dx, float* dw, float* scratch, cudaStream_t s) {
  if (rows == 0) return;
  QUADS_CHECK(D > 0, "cuda rmsnorm_bwd: row length D = {}", D);
  QUADS_CHECK(rows < (int64_t(1) << 31), "cuda rmsnorm_bwd: {} rows is too many", rows);
  if (D <= 1024) {
    rmsnorm_bwd_dx_kernel<true><<<grid_for(rows, kThreads / 32), kThreads, 0, s>>>(dy, x, w, inv_rms, rows, D, dx);
  } else {
    rmsnorm_bwd_dx_kernel<false><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(dy, x, w, inv_rms, rows, D, dx);
  }
  QUADS_CUDA_LAUNCH_CHECK();
  if (!dw) return;
  QUADS_CHECK(scratch != nullptr, "cuda rmsnorm_bwd: dw needs scratch (rmsnorm_bwd_scratch floats)");
  QUADS_CHECK((reinterpret_cast<uintptr_t>(scratch) & 7u) == 0, "cuda rmsnorm_bwd: scratch must be 8-byte aligned");
  QUADS_CHECK(D < 65536 * 128, "cuda rmsnorm_bwd: D = {} is too large", D);
  const int64_t chunk = rmsnorm_chunk_rows(rows), nchunks = (rows + chunk - 1) / chunk;
  double* part = reinterpret_cast<double*>(scratch);
  const dim3 grid(static_cast<unsigned>((D + 127) / 128), static_cast<unsigned>(nchunks));
  rmsnorm_dw_part_kernel<<<grid, 128, 0, s>>>(dy, x, inv_rms, rows, D, chunk, part);
  QUADS_CUDA_LAUNCH_CHECK();
  rmsnorm_dw_sum_kernel<<<static_cast<unsigned>(D), 128, 0, s>>>(part, nchunks, D, dw);
  QUADS_CUDA_LAUNCH_CHECK();
}

void rope_fwd(float* x, int64_t n, int heads, int hd, const float* cos, const float* sin, cudaStream_t s) {
  QUADS_CHECK(hd > 0 && hd % 2 == 0, "cuda rope_fwd: head_dim {} must be even", hd);
  if (n * heads == 0) return;
  rope_launch(x, n, heads, hd, cos, sin, false, s);
  QUADS_CUDA_LAUNCH_CHECK();
}

void rope_bwd(float* dx, int64_t n, int heads, int hd, const float* cos, const float* sin, cudaStream_t s) {
  QUADS_CHECK(hd > 0 && hd % 2 == 0, "cuda rope_bwd: head_dim {} must be even", hd);
  if (n * heads == 0) return;
  rope_launch(dx, n, heads, hd, cos, sin, true, s);
  QUADS_CUDA_LAUNCH_CHECK();
}

void kv_factor(float* q, float* k, int64_t n, int nh, int nkv, int hd, const float* f, cudaStream_t s) {
  QUADS_CHECK(nkv > 0 && nh % nkv == 0 && hd > 0, "cuda kv_factor: {} heads, {} kv heads, head_dim {}", nh, nkv, hd);
  const int64_t total = n * (nh + nkv) * hd;
  if (total == 0) return;
  kv_factor_kernel<<<grid_for(total), kThreads, 0, s>>>(q, k, n, nh, nkv, hd, f);
  QUADS_CUDA_LAUNCH_CHECK();
}

void sub_cols(float* x, int64_t rows, int64_t cols, const float* m, cudaStream_t s) {
  if (rows * cols == 0) return;
  sub_cols_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(x, rows * cols, cols, m);
  QUADS_CUDA_LAUNCH_CHECK();
}

void attention_train_fwd(const float* q, const float* k, const float* v, const int32_t* seq0, int64_t T, int nh,
                         int nkv, int hd, float scale, float* out, float* lse, cudaStream_t s) {
  if (T == 0) return;
  attn_check("attention_train_fwd", T, nh, nkv, hd, {q, k, v, out});
  if (hd <= 32) attn_fwd_launch<32>(q, k, v, seq0, T, nh, nkv, hd, scale, out, lse, s);
  else if (hd <= 64) attn_fwd_launch<64>(q, k, v, seq0, T, nh, nkv, hd, scale, out, lse, s);
  else if (hd <= 128) attn_fwd_launch<128>(q, k, v, seq0, T, nh, nkv, hd, scale, out, lse, s);
  else attn_fwd_launch<256>(q, k, v, seq0, T, nh, nkv, hd, scale, out, lse, s);
}

void attention_train_bwd(const float* q, const float* k, const float* v, const float* out, const float* lse,
                         const float* dout, const int32_t* seq0, int64_t T, int nh, int nkv, int hd, float scale,
                         float* dq, float* dk, float* dv, cudaStream_t s) {
  if (T == 0) return;
  attn_check("attention_train_bwd", T, nh, nkv, hd, {q, k, v, out, dout, dq, dk, dv});
  if (hd <= 32) attn_bwd_launch<32>(q, k, v, out, lse, dout, seq0, T, nh, nkv, hd, scale, dq, dk, dv, s);
  else if (hd <= 64) attn_bwd_launch<64>(q, k, v, out, lse, dout, seq0, T, nh, nkv, hd, scale, dq, dk, dv, s);
  else if (hd <= 128) attn_bwd_launch<128>(q, k, v, out, lse, dout, seq0, T, nh, nkv, hd, scale, dq, dk, dv, s);
  else attn_bwd_launch<256>(q, k, v, out, lse, dout, seq0, T, nh, nkv, hd, scale, dq, dk, dv, s);
}

void router_topk_fwd(const float* logits, int64_t T, int E, int k, bool norm_topk, float* probs, int32_t* idx,
                     float* w, const int32_t* forced, cudaStream_t s) {
  if (T == 0) return;
  QUADS_CHECK(E > 0 && k > 0 && k <= E, "cuda router_topk_fwd: top-{} of {} experts", k, E);
  const size_t smem = sizeof(float) * size_t(kTopkWarps) * size_t(E + k);
  QUADS_CHECK(smem <= 48 * 1024, "cuda router_topk_fwd: {} experts (top-{}) is too many", E, k);
  const unsigned grid = static_cast<unsigned>((T + kTopkWarps - 1) / kTopkWarps);
  if (legacy_decode_kernels() || E > 256)
    router_topk_fwd_kernel<<<grid, 32 * kTopkWarps, smem, s>>>(logits, T, E, k, norm_topk, probs, idx, w, forced);
  else if (E <= 32)
    router_topk_fwd_reg_kernel<1><<<grid, 32 * kTopkWarps, smem, s>>>(logits, T, E, k, norm_topk, probs, idx, w, forced);
  else if (E <= 64)
    router_topk_fwd_reg_kernel<2><<<grid, 32 * kTopkWarps, smem, s>>>(logits, T, E, k, norm_topk, probs, idx, w, forced);
  else if (E <= 128)
    router_topk_fwd_reg_kernel<4><<<grid, 32 * kTopkWarps, smem, s>>>(logits, T, E, k, norm_topk, probs, idx, w, forced);
  else
    router_topk_fwd_reg_kernel<8><<<grid, 32 * kTopkWarps, smem, s>>>(logits, T, E, k, norm_topk, probs, idx, w, forced);
  QUADS_CUDA_LAUNCH_CHECK();
}

// QUADS_GPU_ROUTE_WARP=0 keeps route_block for batches that route_warp could take (A/B runs).
static bool route_warp_on() {
  static const bool on = [] {
    const char* e = std::getenv("QUADS_GPU_ROUTE_WARP");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

void router_route(const float* logits, int64_t T, int E, int k, bool norm_topk, float* probs, int32_t* idx, float* w,
                  int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv, unsigned long long* active, int32_t* bad,
                  uint32_t* ticket, cudaStream_t s) {
  const int64_t n = T * k;
  if (T == 0 || E > 256 || n > kRouteMaxEntries) {  // outside decode sizes: the same results, two launches
    router_topk_fwd(logits, T, E, k, norm_topk, probs, idx, w, nullptr, s);
    moe_route(idx, n, E, counts, eoff, perm, inv, active, bad, s);
    return;
  }
  QUADS_CHECK(E > 0 && k > 0 && k <= E, "cuda router_route: top-{} of {} experts", k, E);
  const unsigned grid = static_cast<unsigned>((T + kRouteWarps - 1) / kRouteWarps);
  QUADS_CHECK(grid == 1 || ticket, "cuda router_route: {} tokens need the ticket (one zeroed uint32)", T);
  // the top-k scratch (reused for the per-warp counts), the n ids, the E offsets
  const size_t smem = sizeof(float) * (size_t(kRouteWarps) * size_t(E + k) + size_t(n) + size_t(E));
  const dim3 block(32 * kRouteWarps);
  if (E <= 32)
    launch_pdl(router_route_kernel<1>, grid, block, smem, s, logits, T, E, k, norm_topk, probs, idx, w, counts, eoff,
               perm, inv, active, bad, ticket, route_warp_on());
  else if (E <= 64)
    launch_pdl(router_route_kernel<2>, grid, block, smem, s, logits, T, E, k, norm_topk, probs, idx, w, counts, eoff,
               perm, inv, active, bad, ticket, route_warp_on());
  else if (E <= 128)
    launch_pdl(router_route_kernel<4>, grid, block, smem, s, logits, T, E, k, norm_topk, probs, idx, w, counts, eoff,
               perm, inv, active, bad, ticket, route_warp_on());
  else
    launch_pdl(router_route_kernel<8>, grid, block, smem, s, logits, T, E, k, norm_topk, probs, idx, w, counts, eoff,
               perm, inv, active, bad, ticket, route_warp_on());
}

void moe_route_one(const int32_t* idx, int64_t n, int E, int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv,
                   unsigned long long* active, int32_t* bad, cudaStream_t s) {
  if (E > 256 || n > kRouteMaxEntries) {
    moe_route(idx, n, E, counts, eoff, perm, inv, active, bad, s);
    return;
  }
  QUADS_CHECK(E > 0 && n >= 0, "cuda moe_route_one: {} entries, {} experts", n, E);
  const size_t smem = sizeof(int32_t) * (size_t(kRouteWarps) * size_t(E) + size_t(n) + size_t(E));
  launch_pdl(route_one_kernel, 1, 32 * kRouteWarps, smem, s, idx, static_cast<int>(n), E, counts, eoff, perm, inv,
             active, bad);
}

void router_topk_bwd(const float* probs, const int32_t* idx, const float* w, const float* dw,
                     const float* dprobs_extra, int64_t T, int E, int k, bool norm_topk, float* dlogits,
                     cudaStream_t s) {
  if (T == 0) return;
  QUADS_CHECK(E > 0 && k > 0 && k <= E, "cuda router_topk_bwd: top-{} of {} experts", k, E);
  const size_t smem = sizeof(double) * size_t(kRouterWarps) * size_t(E);
  QUADS_CHECK(smem <= 48 * 1024, "cuda router_topk_bwd: {} experts is too many", E);
  router_topk_bwd_kernel<<<static_cast<unsigned>((T + kRouterWarps - 1) / kRouterWarps), 32 * kRouterWarps, smem,
                           s>>>(probs, idx, w, dw, dprobs_extra, T, E, k, norm_topk, dlogits);
  QUADS_CUDA_LAUNCH_CHECK();
}

__global__ void router_zloss_bwd_kernel(const float* probs, const double* g, int64_t n, int E, float* dlog) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) dlog[i] = __fadd_rn(dlog[i], __double2float_rn(__dmul_rn(g[i / E], double(probs[i]))));
}

void router_zloss_bwd(const float* probs, const double* g, int64_t T, int E, float* dlog, cudaStream_t s) {
  const int64_t n = T * E;
  if (n == 0) return;
  router_zloss_bwd_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(probs, g, n, E, dlog);
  QUADS_CUDA_LAUNCH_CHECK();
}

void moe_combine_fwd(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* y,
                     cudaStream_t s) {
  if (T * D == 0) return;
  QUADS_CHECK(k > 0, "cuda moe_combine_fwd: k = {}", k);
  if (legacy_train_kernels())
    moe_combine_fwd_kernel<<<grid_for(T * D), kThreads, 0, s>>>(ye, inv, w, T, k, D, y);
  else if (D % 4 == 0 && aligned16(ye) && aligned16(y))
    moe_combine_fwd_row_kernel<4><<<row_grid(T, D / 4), row_threads(D / 4), 0, s>>>(ye, inv, w, T, k, D, y);
  else
    moe_combine_fwd_row_kernel<1><<<row_grid(T, D), row_threads(D), 0, s>>>(ye, inv, w, T, k, D, y);
  QUADS_CUDA_LAUNCH_CHECK();
}

void moe_combine_bwd(const float* dy, const float* ye, const int32_t* inv, const float* w, int64_t T, int k,
                     int64_t D, float* dye, float* dw, cudaStream_t s) {
  if (T * k == 0) return;
  QUADS_CHECK(k > 0, "cuda moe_combine_bwd: k = {}", k);
  moe_combine_bwd_kernel<<<grid_for(T * k, kThreads / 32), kThreads, 0, s>>>(dy, ye, inv, w, T, k, D, dye, dw);
  QUADS_CUDA_LAUNCH_CHECK();
}

void moe_scatter_add(const float* dxe, const int32_t* inv, int64_t T, int k, int64_t D, float* dx, bool accumulate,
                     cudaStream_t s) {
  if (T * D == 0) return;
  if (legacy_train_kernels())
    moe_scatter_add_kernel<<<grid_for(T * D), kThreads, 0, s>>>(dxe, inv, T, k, D, dx, accumulate);
  else if (D % 4 == 0 && aligned16(dxe) && aligned16(dx))
    moe_scatter_add_row_kernel<4><<<row_grid(T, D / 4), row_threads(D / 4), 0, s>>>(dxe, inv, T, k, D, dx, accumulate);
  else
    moe_scatter_add_row_kernel<1><<<row_grid(T, D), row_threads(D), 0, s>>>(dxe, inv, T, k, D, dx, accumulate);
  QUADS_CUDA_LAUNCH_CHECK();
}

void swiglu_bwd(const float* gu, const float* dh, int64_t n, int64_t I, float* dgu, cudaStream_t s) {
  if (n * I == 0) return;
  if (legacy_train_kernels()) {
    swiglu_bwd_kernel<<<grid_for(n * I), kThreads, 0, s>>>(gu, dh, n, I, dgu);
  } else if (I % 4 == 0 && aligned16(gu) && aligned16(dh) && aligned16(dgu)) {
    swiglu_bwd_row_kernel<4><<<row_grid(n, I / 4), row_threads(I / 4), 0, s>>>(gu, dh, n, I, dgu);
  } else {
    swiglu_bwd_row_kernel<1><<<row_grid(n, I), row_threads(I), 0, s>>>(gu, dh, n, I, dgu);
  }
  QUADS_CUDA_LAUNCH_CHECK();
}

void embedding_bwd_plan(const int32_t* tokens_host, int64_t T, int32_t* order_host, int32_t* starts_host,
                        int32_t* ids_host, int64_t* nuniq) {
  QUADS_CHECK(T >= 0 && T < (int64_t(1) << 31), "embedding_bwd_plan: {} tokens", T);
  for (int64_t t = 0; t < T; ++t)
    QUADS_CHECK(tokens_host[t] >= 0, "embedding_bwd_plan: token {} has the negative id {}", t, tokens_host[t]);
  std::iota(order_host, order_host + T, 0);
  std::stable_sort(order_host, order_host + T,
                   [&](int32_t a, int32_t b) { return tokens_host[a] < tokens_host[b]; });
  int64_t u = 0;
  for (int64_t i = 0; i < T; ++i) {
    if (i == 0 || tokens_host[order_host[i]] != tokens_host[order_host[i - 1]]) {
      ids_host[u] = tokens_host[order_host[i]];
      starts_host[u] = static_cast<int32_t>(i);
      ++u;
    }
  }
  starts_host[u] = static_cast<int32_t>(T);
  *nuniq = u;
}

void embedding_bwd(const float* dout, const int32_t* order, const int32_t* starts, const int32_t* ids, int64_t nuniq,
                   int64_t H, float* dtable, cudaStream_t s) {
  if (nuniq == 0 || H == 0) return;
  QUADS_CHECK(nuniq < (int64_t(1) << 31), "cuda embedding_bwd: {} distinct ids", nuniq);
  embedding_bwd_kernel<<<static_cast<unsigned>(nuniq), kThreads, 0, s>>>(dout, order, starts, ids, H, dtable);
  QUADS_CUDA_LAUNCH_CHECK();
}

void token_logprobs(const float* logits, int64_t T, int64_t V, const int32_t* targets, float x_scale, float* logp,
                    float* H, cudaStream_t s) {
  if (T == 0) return;
  QUADS_CHECK(V > 0, "cuda token_logprobs: vocabulary of {}", V);
  QUADS_CHECK(T < (int64_t(1) << 31), "cuda token_logprobs: {} rows", T);
  if (V % 4 == 0 && aligned16(logits))
    token_logprobs_kernel<true><<<static_cast<unsigned>(T), kLossThreads, 0, s>>>(logits, V, targets, x_scale, logp, H);
  else
    token_logprobs_kernel<false><<<static_cast<unsigned>(T), kLossThreads, 0, s>>>(logits, V, targets, x_scale, logp, H);
  QUADS_CUDA_LAUNCH_CHECK();
}

void token_logprobs_bwd(const float* logits, int64_t T, int64_t V, const int32_t* targets, float x_scale,
                        const float* dlogp, float* dlogits, cudaStream_t s) {
  if (T == 0) return;
  QUADS_CHECK(V > 0, "cuda token_logprobs_bwd: vocabulary of {}", V);
  QUADS_CHECK(T < (int64_t(1) << 31), "cuda token_logprobs_bwd: {} rows", T);
  if (V % 4 == 0 && aligned16(logits))
    token_logprobs_bwd_kernel<true><<<static_cast<unsigned>(T), kLossThreads, 0, s>>>(logits, V, targets, x_scale,
                                                                                    dlogp, dlogits);
  else
    token_logprobs_bwd_kernel<false><<<static_cast<unsigned>(T), kLossThreads, 0, s>>>(logits, V, targets, x_scale,
                                                                                     dlogp, dlogits);
  QUADS_CUDA_LAUNCH_CHECK();
}

int64_t global_norm_scratch(int64_t n) { return std::max<int64_t>(1, (n + kNormChunk - 1) / kNormChunk); }

void global_norm(const float* g, int64_t n, double* scratch, double* out, cudaStream_t s) {
  QUADS_CHECK(n >= 0, "cuda global_norm: n = {}", n);
  const int64_t parts = global_norm_scratch(n);
  QUADS_CHECK(parts < (int64_t(1) << 31), "cuda global_norm: {} elements", n);
  if (n == 0) {
    QUADS_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), s));
    return;
  }
  if (aligned16(g)) norm_part_kernel<true><<<static_cast<unsigned>(parts), kNormThreads, 0, s>>>(g, n, scratch);
  else norm_part_kernel<false><<<static_cast<unsigned>(parts), kNormThreads, 0, s>>>(g, n, scratch);
  QUADS_CUDA_LAUNCH_CHECK();
  norm_final_kernel<<<1, 1024, 0, s>>>(scratch, parts, out);
  QUADS_CUDA_LAUNCH_CHECK();
}

void scale(float* x, int64_t n, float coef, cudaStream_t s) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, s>>>(x, n, coef);
  QUADS_CUDA_LAUNCH_CHECK();
}

void adamw(float* params, float* grads, float* m, float* v, const uint8_t* mask, int64_t n, float b1, float b2,
           float step_size, float bc2_sqrt, float eps, float decay, cudaStream_t s, float clip, uint16_t* bf16_out,
           const AdamWAmax& amax) {
  if (amax.count > 0) QUADS_CUDA_CHECK(cudaMemsetAsync(amax.amax_bits, 0, sizeof(uint32_t) * amax.count, s));
  if (n == 0) return;
  const AdamWConsts k{b1, b2, step_size, bc2_sqrt, eps, decay, clip};
  auto al = [](const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; };
  int64_t n4 = 0;
  if (!legacy_train_kernels() && al(params, 16) && al(grads, 16) && al(m, 16) && al(v, 16) && al(mask, 4) &&
      al(bf16_out, 8)) {
    n4 = n / 4;
    auto p4 = [](float* x) { return reinterpret_cast<float4*>(x); };
    const auto* mk = reinterpret_cast<const uchar4*>(mask);
    auto* b4 = reinterpret_cast<uint2*>(bf16_out);
    if (n4 > 0 && amax.count > 0) {
      const int64_t ctas = (n4 + kAdamCta - 1) / kAdamCta;
      QUADS_CHECK(ctas < (int64_t(1) << 31), "cuda adamw: {} parameters", n);
      adamw_vec_kernel<true><<<static_cast<unsigned>(ctas), kThreads, 0, s>>>(p4(params), p4(grads), p4(m), p4(v), mk,
                                                                              n4, k, b4, amax);
    } else if (n4 > 0) {
      adamw_vec_kernel<false><<<grid_for(n4), kThreads, 0, s>>>(p4(params), p4(grads), p4(m), p4(v), mk, n4, k, b4, amax);
    }
    QUADS_CUDA_LAUNCH_CHECK();
  }
  const int64_t o = 4 * n4;  // the parameters the vector kernel left (all of them where it did not run)
  if (o == n) return;
  adamw_kernel<<<grid_for(n - o), kThreads, 0, s>>>(params + o, grads + o, m + o, v + o, mask ? mask + o : nullptr,
                                                    n - o, k, bf16_out ? bf16_out + o : nullptr, amax, o);
  QUADS_CUDA_LAUNCH_CHECK();
}

}  // namespace quads::cuda::kern
