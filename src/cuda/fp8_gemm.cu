// FP8 (E4M3) weight GEMV, W8A8 tensor-core GEMM and dequantization of the GPU rollout engine
// (see fp8_gemm.h).
#include "cuda/fp8_gemm.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/device.h"  // sm_count
#include "cuda/kernel_util.cuh"
#include "cuda/mma_util.cuh"
#include "cuda/pdl.cuh"

namespace quads::cuda {

namespace {

// Warps per CTA: 4, so that decode's few weight rows (one expert's 768 at batch 1) still spread
// over most SMs.
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;  // weight rows per warp: each activation load feeds 4 rows
// Activation rows per pass over the weight rows: the kernel's template MR (1, 2, 4 or 8), the
// smallest that holds a group's rows when the host knows a bound (decode at batch 1: 1; fewer
// accumulators leave room for more warps in flight).
constexpr int kChunk = 8;        // codes per lane and step (one 8-byte load)
// Steps whose weight loads a lane issues before using them: a warp then has 4 rows x 4 steps x
// 256 bytes in flight (one step at a time left the H200 at a fifth of its copy bandwidth).
constexpr int kUnroll = 4;

// Two E4M3 codes (low byte first) to float. On sm_89+ the hardware converts them to FP16 (every
// E4M3 value, subnormals included, is exact in FP16) and FP16 to float is exact: the same values
// as dev::e4m3_decode in 1.5 instructions per code instead of about eight.
__device__ __forceinline__ void e4m3x2_decode(uint32_t two, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const unsigned short in = static_cast<unsigned short>(two & 0xFFFFu);
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
#else
  lo = dev::e4m3_decode(two & 0xFFu);
  hi = dev::e4m3_decode((two >> 8) & 0xFFu);
#endif
}

// value(code) * scale, one rounding: num::dequantize's lut[code] * s.
__device__ __forceinline__ void dequant8(uint2 c, float s, float (&w)[kChunk]) {
  e4m3x2_decode(c.x, w[0], w[1]);
  e4m3x2_decode(c.x >> 16, w[2], w[3]);
  e4m3x2_decode(c.y, w[4], w[5]);
  e4m3x2_decode(c.y >> 16, w[6], w[7]);
#pragma unroll
  for (int j = 0; j < kChunk; ++j) w[j] = __fmul_rn(w[j], s);
}

__device__ __forceinline__ void load8(const float* p, float (&v)[kChunk]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Warp (blockIdx.x, warp) owns weight rows n0 .. n0+3 of group blockIdx.y (table null: the one
// weight w0 and rows 0 .. m). Lane l takes codes 8l .. 8l+7 of every 256-wide step along k, in
// increasing k; a chunk of 8 never straddles a 128-column scale block.
template <int kActRows>
__global__ void __launch_bounds__(kWarps * 32)
    fp8_gemv_kernel(const float* __restrict__ x, int64_t m, Fp8Weight w0, const Fp8Weight* __restrict__ table,
                    const int32_t* __restrict__ eoff, Fp8Layout g, float* __restrict__ y) {
  pdl_begin();
  int64_t mb = 0, me = m;
  Fp8Weight w = w0;
  if (table) {
    const int e = blockIdx.y;
    mb = eoff[e];
    me = eoff[e + 1];
    w = table[e];
  }
  const int lane = threadIdx.x & 31;
  const int64_t N = g.n, K = g.k;
  const int64_t n0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRowsPerWarp;
  if (mb >= me || n0 >= N) return;  // no barriers below
  const uint8_t* wr[kRowsPerWarp];
  const float* sr[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = n0 + i < N ? n0 + i : N - 1;  // rows past N repeat the last one, never stored
    wr[i] = w.codes + r * K;
    sr[i] = w.fscales + (r / g.bh) * g.ncb;
  }
  for (int64_t r0 = mb; r0 < me; r0 += kActRows) {
    const int rows = me - r0 < kActRows ? static_cast<int>(me - r0) : kActRows;
    float acc[kRowsPerWarp][kActRows];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int r = 0; r < kActRows; ++r) acc[i][r] = 0.f;
    for (int64_t k0 = int64_t(lane) * kChunk; k0 < K; k0 += kUnroll * 32 * kChunk) {
      uint2 codes[kUnroll][kRowsPerWarp];
      float scales[kUnroll][kRowsPerWarp];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = k0 + int64_t(u) * 32 * kChunk;
        const int64_t cb = g.col_blocks ? (k >> 7) : 0;
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          codes[u][i] = k < K ? __ldg(reinterpret_cast<const uint2*>(wr[i] + k)) : make_uint2(0, 0);
          scales[u][i] = k < K ? __ldg(sr[i] + cb) : 0.f;
        }
      }
      // the steps in increasing k, as one step at a time would (same sums, same bits)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = k0 + int64_t(u) * 32 * kChunk;
        if (k >= K) break;
        float wv[kRowsPerWarp][kChunk];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) dequant8(codes[u][i], scales[u][i], wv[i]);
#pragma unroll
        for (int r = 0; r < kActRows; ++r) {
          if (r < rows) {
            float xv[kChunk];
            load8(x + (r0 + r) * K + k, xv);
#pragma unroll
            for (int i = 0; i < kRowsPerWarp; ++i) {
              float s = acc[i][r];
#pragma unroll
              for (int j = 0; j < kChunk; ++j) s = __fadd_rn(s, __fmul_rn(xv[j], wv[i][j]));
              acc[i][r] = s;
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kActRows; ++r) {
      if (r >= rows) continue;  // warp-uniform
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float v = kern::warp_sum(acc[i][r]);
        if (lane == 0 && n0 + i < N) y[(r0 + r) * N + n0 + i] = v;
      }
    }
  }
}

__global__ void fp8_dequant_kernel(Fp8Weight w, Fp8Layout g, float* __restrict__ out) {
  pdl_begin();
  const int64_t chunks = g.n * g.k / kChunk;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i * kChunk, r = e / g.k, c = e - r * g.k;
    const float s = w.fscales[(r / g.bh) * g.ncb + (g.col_blocks ? (c >> 7) : 0)];
    float v[kChunk];
    dequant8(*reinterpret_cast<const uint2*>(w.codes + e), s, v);
    float4* o = reinterpret_cast<float4*>(out + e);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// max_rows: a bound on the rows of every group (<= 0: none known).
void launch_gemv(const float* x, int64_t m, const Fp8Weight& w, const Fp8Weight* table, const int32_t* eoff,
                 int groups, int64_t max_rows, const Fp8Layout& g, float* y, cudaStream_t s) {
  const int64_t per_cta = int64_t(kWarps) * kRowsPerWarp;
  const dim3 grid(static_cast<unsigned>((g.n + per_cta - 1) / per_cta), static_cast<unsigned>(groups));
  const int th = kWarps * 32;
  if (max_rows == 1) launch_pdl(fp8_gemv_kernel<1>, grid, th, 0, s, x, m, w, table, eoff, g, y);
  else if (max_rows == 2) launch_pdl(fp8_gemv_kernel<2>, grid, th, 0, s, x, m, w, table, eoff, g, y);
  else if (max_rows > 0 && max_rows <= 4) launch_pdl(fp8_gemv_kernel<4>, grid, th, 0, s, x, m, w, table, eoff, g, y);
  else launch_pdl(fp8_gemv_kernel<8>, grid, th, 0, s, x, m, w, table, eoff, g, y);
}

// ---- W8A8 tiles on the tensor cores ----
// A CTA computes BM x BN outputs (warps WM x WN each); K advances one 128-wide scale block per
// pipeline stage, copied global -> shared with cp.async, STAGES deep: codes [BM | BN rows, 128]
// (16-byte chunks XOR-swizzled by row & 7, so that a quarter warp's 16-byte reads hit 8 distinct
// chunks) and the block's scales of those rows (act) and columns (weight). Thread (g, t) of a warp
// reads chunk 2t + hh (hh = 0, 1) of its rows; word j of a chunk fills K slots (2t, 2t+1) with its
// low two codes and (2t+8, 2t+9) with its high two, for A and B alike (the sum over K does not
// care which K a slot holds as long as both operands agree), so no thread needs another's data.
constexpr int kBK = 128;

struct TileParams {
  const uint8_t* xq = nullptr;
  const float* xs = nullptr;
  Fp8Layout xa;                  // activation scale layout (xa.n: rows)
  const uint8_t* wq = nullptr;   // dense weight
  const float* ws = nullptr;
  Fp8Layout g;                   // weight layout (n = N, k = K)
  int64_t M = 0;                 // dense: rows; grouped: the bound on a group's rows (grid)
  int64_t Mtot = 0;              // rows of x and y
  float* y = nullptr;
  float* partial = nullptr;      // split K: [splits, Mtot, N]
  int kb_per_split = 1;
  int groups = 0;                // grouped: entries of wtab (eoff has groups + 1)
  const int32_t* eoff = nullptr;
  const Fp8Weight* wtab = nullptr;
};

template <int BM, int BN, int STAGES>
struct TileSmem {
  static constexpr int A = BM * kBK, B = BN * kBK, AS = BM * 4, BS = BN * 4;
  static constexpr int STAGE = A + B + AS + BS;
  static constexpr int BYTES = STAGE * STAGES;
};

template <int BM, int BN, int WM, int WN, int STAGES, bool GROUPED>
__global__ void __launch_bounds__(32 * (BM / WM) * (BN / WN)) fp8_tile_kernel(const TileParams p) {
  pdl_begin();
  constexpr int NWN = BN / WN;
  constexpr int NT = 32 * (BM / WM) * NWN;
  constexpr int MT = WM / 16, NTL = WN / 8;
  constexpr int SC = (BM + BN + NT - 1) / NT;  // scale entries each thread copies per stage
  using SM = TileSmem<BM, BN, STAGES>;
  extern __shared__ __align__(16) uint8_t smem[];
#ifndef QUADS_MMA_SM80
  __trap();
#endif
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / NWN, wn = warp % NWN;
  const int64_t N = p.g.n, K = p.g.k;
  int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM, mend = p.M;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  int64_t split = blockIdx.z;
  const uint8_t* wq = p.wq;
  const float* ws = p.ws;
  if constexpr (GROUPED) {
    // blockIdx.y counts the row tiles of all groups in order (ceil(rows / BM) each): every warp
    // finds the group of its CTA's tile by a prefix sum over 32 groups at a time, so the exit of
    // CTAs past the last tile is uniform for the CTA, before any barrier. (The grid holds
    // ceil(Mtot / BM) + groups tiles, not groups x the largest group's.)
    long long tile = blockIdx.y, base = 0;
    int e = -1;
    for (int c0 = 0; c0 < p.groups && e < 0; c0 += 32) {
      const int i = c0 + lane;
      long long nt = 0;
      if (i < p.groups) nt = (static_cast<long long>(p.eoff[i + 1]) - p.eoff[i] + BM - 1) / BM;
      long long incl = nt;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += v;
      }
      const unsigned hit = __ballot_sync(0xFFFFFFFFu, tile < base + incl);
      if (hit) {
        const int l = __ffs(hit) - 1;
        e = c0 + l;
        tile -= base + __shfl_sync(0xFFFFFFFFu, incl - nt, l);
      } else {
        base += __shfl_sync(0xFFFFFFFFu, incl, 31);
      }
    }
    if (e < 0) return;
    m0 = p.eoff[e] + tile * BM;
    mend = p.eoff[e + 1];
    wq = p.wtab[e].codes;
    ws = p.wtab[e].fscales;
  }
  const int64_t kb_total = (K + kBK - 1) / kBK;
  const int64_t kb0 = split * p.kb_per_split;
  const int64_t kb1 = min(kb_total, kb0 + p.kb_per_split);
  const int nkb = kb1 > kb0 ? static_cast<int>(kb1 - kb0) : 0;

  // The scale rows this thread copies each stage: entry c < BM is act row m0 + c, else weight
  // row (output column) n0 + c - BM; the block index kb is added per stage where scales have one.
  int64_t soff[SC];
  bool sok[SC];
#pragma unroll
  for (int i = 0; i < SC; ++i) {
    const int c = tid + i * NT;
    soff[i] = 0;
    sok[i] = false;
    if (c < BM) {
      const int64_t r = m0 + c;
      sok[i] = r < mend;
      if (sok[i]) soff[i] = (r / p.xa.bh) * p.xa.ncb;
    } else if (c < BM + BN) {
      const int64_t r = n0 + c - BM;
      sok[i] = r < N;
      if (sok[i]) soff[i] = (r / p.g.bh) * p.g.ncb;
    }
  }

  auto load_stage = [&](int slot, int64_t kb) {
    uint8_t* sa = smem + slot * SM::STAGE;
    uint8_t* sb = sa + SM::A;
    float* ss = reinterpret_cast<float*>(sb + SM::B);
    const int64_t k0 = kb * kBK;
    for (int c = tid; c < BM * 8; c += NT) {
      const int r = c >> 3, ch = c & 7;
      const int64_t gr = m0 + r, kc = k0 + ch * 16;
      const bool ok = gr < mend && kc < K;
      cp_async16(sa + r * kBK + ((ch ^ (r & 7)) << 4), p.xq + (ok ? gr * K + kc : 0), ok ? 16 : 0);
    }
    for (int c = tid; c < BN * 8; c += NT) {
      const int r = c >> 3, ch = c & 7;
      const int64_t gn = n0 + r, kc = k0 + ch * 16;
      const bool ok = gn < N && kc < K;
      cp_async16(sb + r * kBK + ((ch ^ (r & 7)) << 4), wq + (ok ? gn * K + kc : 0), ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < SC; ++i) {
      const int c = tid + i * NT;
      if (c >= BM + BN) continue;
      const bool act = c < BM;
      const float* base = act ? p.xs : ws;
      const int64_t off = soff[i] + ((act ? p.xa.col_blocks : p.g.col_blocks) ? kb : 0);
      cp_async4(ss + c, base + (sok[i] ? off : 0), sok[i] ? 4 : 0);
    }
  };

  float acc[MT][NTL][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NTL; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nkb) load_stage(s, kb0 + s);
    cp_async_commit();
  }

  for (int it = 0; it < nkb; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nx = it + STAGES - 1;
      if (nx < nkb) load_stage(nx % STAGES, kb0 + nx);
      cp_async_commit();
    }
    const uint8_t* sa = smem + (it % STAGES) * SM::STAGE;
    const uint8_t* sb = sa + SM::A;
    const float* ss = reinterpret_cast<const float*>(sb + SM::B);

    float blk[MT][NTL][4];  // this K block's sums of code products
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) blk[i][j][q] = 0.f;

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      uint4 av[MT][2], bv[NTL];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wm * WM + i * 16 + g + 8 * h;
          av[i][h] = *reinterpret_cast<const uint4*>(sa + r * kBK + (((2 * t + hh) ^ (r & 7)) << 4));
        }
#pragma unroll
      for (int j = 0; j < NTL; ++j) {
        const int r = wn * WN + j * 8 + g;
        bv[j] = *reinterpret_cast<const uint4*>(sb + r * kBK + (((2 * t + hh) ^ (r & 7)) << 4));
      }
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        uint32_t af[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const uint32_t w0 = wd == 0 ? av[i][0].x : wd == 1 ? av[i][0].y : wd == 2 ? av[i][0].z : av[i][0].w;
          const uint32_t w1 = wd == 0 ? av[i][1].x : wd == 1 ? av[i][1].y : wd == 2 ? av[i][1].z : av[i][1].w;
          af[i][0] = e4m3x2_f16x2(w0);
          af[i][1] = e4m3x2_f16x2(w1);
          af[i][2] = e4m3x2_f16x2(w0 >> 16);
          af[i][3] = e4m3x2_f16x2(w1 >> 16);
        }
#pragma unroll
        for (int j = 0; j < NTL; ++j) {
          const uint32_t wb = wd == 0 ? bv[j].x : wd == 1 ? bv[j].y : wd == 2 ? bv[j].z : bv[j].w;
          const uint32_t b0 = e4m3x2_f16x2(wb), b1 = e4m3x2_f16x2(wb >> 16);
#pragma unroll
          for (int i = 0; i < MT; ++i) mma16816(blk[i][j], af[i], b0, b1);
        }
      }
    }

    // promotion: acc += block sum * sa[row] * sw[col]
    float sar[MT][2], swc[NTL][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) sar[i][h] = ss[wm * WM + i * 16 + g + 8 * h];
#pragma unroll
    for (int j = 0; j < NTL; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) swc[j][c] = ss[BM + wn * WN + j * 8 + 2 * t + c];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          acc[i][j][q] = __fmaf_rn(blk[i][j][q], __fmul_rn(sar[i][q >> 1], swc[j][q & 1]), acc[i][j][q]);
  }
  cp_async_wait<0>();

  const int64_t prows = GROUPED ? p.Mtot : p.M;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m0 + wm * WM + i * 16 + g + 8 * h;
      if (row >= mend) continue;
      float* dst = p.partial ? p.partial + (split * prows + row) * N : p.y + row * N;
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int64_t col = n0 + wn * WN + j * 8 + 2 * t + c;
          if (col < N) dst[col] = acc[i][j][2 * h + c];
        }
    }
}

// y = the split partials [splits, n] summed in split order.
__global__ void fp8_splitk_reduce_kernel(const float* __restrict__ partial, int splits, int64_t n,
                                         float* __restrict__ y) {
  pdl_begin();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = partial[i];
    for (int z = 1; z < splits; ++z) s = __fadd_rn(s, partial[z * n + i]);
    y[i] = s;
  }
}

// groups == 0: dense. splits_req <= 0: picked here (dense: about two waves of CTAs; grouped:
// about four CTAs per SM over the row tiles that can have work), at least 2 stages per split.
template <int BM, int BN, int WM, int WN, int STAGES, bool GROUPED>
void launch_tiles(TileParams p, int splits_req, int groups, cudaStream_t s) {
  constexpr int threads = 32 * (BM / WM) * (BN / WN);
  constexpr int smem = TileSmem<BM, BN, STAGES>::BYTES;
  auto kern = fp8_tile_kernel<BM, BN, WM, WN, STAGES, GROUPED>;
  static bool checked = false;  // per instantiation
  if (!checked) {
    cudaFuncAttributes fa{};
    QUADS_CUDA_CHECK(cudaFuncGetAttributes(&fa, kern));
    QUADS_CHECK(fa.binaryVersion >= 80 && fa.ptxVersion >= 80,
                "fp8_gemm: quads_cuda holds code for sm_{} only; the FP8 tile kernels need sm_80 or newer "
                "(configure with -DCMAKE_CUDA_ARCHITECTURES=90)", fa.ptxVersion);
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    checked = true;
  }
  const int64_t N = p.g.n, K = p.g.k;
  const int64_t tiles_n = (N + BN - 1) / BN, tiles_m = (p.M + BM - 1) / BM;
  const int64_t kb_total = (K + kBK - 1) / kBK;
  QUADS_CHECK(tiles_n <= 0x7FFFFFFF && tiles_m <= 65535, "fp8_gemm: [{}, {}] x [{}, {}] has too many tiles", p.M, K,
              N, K);
  int splits = splits_req;
  if (splits <= 0) {
    const int64_t busy = GROUPED ? std::max<int64_t>(std::min<int64_t>(groups, p.Mtot), (p.Mtot + BM - 1) / BM) * tiles_n
                                 : tiles_n * tiles_m;
    const int64_t want = (GROUPED ? 4LL : 2LL) * sm_count();
    splits = busy >= want ? 1 : static_cast<int>(std::min<int64_t>((want + busy - 1) / busy, kb_total / 2));
  }
  splits = static_cast<int>(std::min<int64_t>(std::max(splits, 1), std::max<int64_t>(kb_total, 1)));
  p.kb_per_split = static_cast<int>((kb_total + splits - 1) / splits);
  splits = static_cast<int>(std::max<int64_t>(1, (kb_total + p.kb_per_split - 1) / p.kb_per_split));
  // grouped: row tiles of all groups (at most ceil(Mtot / BM) + groups, and groups x tiles_m)
  const int64_t tiles_y =
      GROUPED ? std::min<int64_t>(int64_t(groups) * tiles_m, (p.Mtot + BM - 1) / BM + groups) : tiles_m;
  QUADS_CHECK(tiles_y <= 65535 && splits <= 65535, "fp8_gemm: {} row tiles x {} splits", tiles_y, splits);
  p.groups = groups;
  float* partial = nullptr;
  const int64_t n_out = p.Mtot * N;
  if (splits > 1) {
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial), sizeof(float) * splits * n_out, s));
    p.partial = partial;
  }
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_y), static_cast<unsigned>(splits));
  launch_pdl(kern, grid, threads, smem, s, p);
  if (splits > 1) {
    const int blocks = static_cast<int>(std::min<int64_t>((n_out + 255) / 256, 16LL * sm_count()));
    launch_pdl(fp8_splitk_reduce_kernel, blocks, 256, 0, s, partial, splits, n_out, p.y);
    QUADS_CUDA_CHECK(cudaFreeAsync(partial, s));
  }
}

template <bool GROUPED>
void dispatch_tiles(const TileParams& p, int splits, int groups, Fp8Tile tile, cudaStream_t s) {
  if (tile == Fp8Tile::Auto) {
    // grouped: p.M bounds a group's rows (decode: a few rows per expert; 16-row tiles stream the
    // weights); dense: the rows themselves
    if (GROUPED) tile = p.M <= 64 ? Fp8Tile::M16 : p.M <= 256 ? Fp8Tile::M64 : Fp8Tile::M128;
    else tile = p.M <= 32 ? Fp8Tile::M16 : p.M <= 64 ? Fp8Tile::M64 : Fp8Tile::M128;
  }
  switch (tile) {
    case Fp8Tile::M16: launch_tiles<16, 128, 16, 32, 4, GROUPED>(p, splits, groups, s); break;
    case Fp8Tile::M64: launch_tiles<64, 128, 32, 64, 4, GROUPED>(p, splits, groups, s); break;
    default: launch_tiles<128, 128, 32, 64, 4, GROUPED>(p, splits, groups, s); break;
  }
}

}  // namespace

bool fp8_weight_supported(const num::QConfig& cfg, int64_t k) {
  return cfg.scheme == num::Scheme::FP8 && cfg.element == num::Format::E4M3 && !cfg.stochastic && k > 0 &&
         k % kChunk == 0;
}

Fp8Layout fp8_layout(const num::QConfig& cfg, int64_t n, int64_t k, const char* what) {
  QUADS_CHECK(fp8_weight_supported(cfg, k) && n > 0,
              "fp8 GEMM: {} [{}, {}] in {}: needs FP8 E4M3 weights with in % 8 == 0", what, n, k, cfg.describe());
  Fp8Layout g;
  g.n = n;
  g.k = k;
  switch (cfg.block) {
    case num::Block::PerTensor: g.bh = n; break;
    case num::Block::PerRow: g.bh = 1; break;
    case num::Block::B1x128:
      g.bh = 1;
      g.ncb = (k + 127) / 128;
      g.col_blocks = true;
      break;
    case num::Block::B128x128:
      g.bh = 128;
      g.ncb = (k + 127) / 128;
      g.col_blocks = true;
      break;
    default: fail("fp8 GEMM: {}: FP8 block layout of {} not supported", what, cfg.describe());
  }
  return g;
}

Fp8Weight fp8_weight(const DeviceQTensor& q, const char* what) {
  const Fp8Layout g = fp8_layout(q.cfg, q.rows, q.cols, what);
  QUADS_CHECK(q.codes.size() == size_t(q.rows * q.cols) && q.fscales.size() == size_t(fp8_scale_count(g)),
              "fp8 GEMM: {} [{}, {}] holds {} codes and {} scales (expected {} and {})", what, q.rows, q.cols,
              q.codes.size(), q.fscales.size(), q.rows * q.cols, fp8_scale_count(g));
  Fp8Weight w;
  w.codes = q.codes.data();
  w.fscales = q.fscales.data();
  return w;
}

void fp8_dequantize(const Fp8Weight& w, const Fp8Layout& g, float* out, cudaStream_t stream) {
  const int64_t chunks = g.n * g.k / kChunk;
  if (chunks == 0) return;
  launch_pdl(fp8_dequant_kernel, kern::grid_for(chunks), kern::kThreads, 0, stream, w, g, out);
}

void fp8_gemv(const float* x, int64_t m, const Fp8Weight& w, const Fp8Layout& g, float* y, cudaStream_t stream) {
  if (m == 0 || g.n == 0) return;
  launch_gemv(x, m, w, nullptr, nullptr, 1, m, g, y, stream);
}

void fp8_gemv_grouped(const float* x, const Fp8Weight* w_table, const Fp8Layout& g, int groups, const int32_t* eoff,
                      int64_t max_rows, float* y, cudaStream_t stream) {
  if (groups == 0 || g.n == 0) return;
  QUADS_CHECK(groups <= 65535, "fp8_gemv_grouped: {} groups (at most 65535)", groups);
  launch_gemv(x, 0, Fp8Weight{}, w_table, eoff, groups, max_rows, g, y, stream);
}

int64_t fp8_scale_count(const Fp8Layout& g) { return ((g.n + g.bh - 1) / g.bh) * g.ncb; }

Fp8Act fp8_act(const DeviceQTensor& q, const char* what) {
  Fp8Act a;
  a.g = fp8_layout(q.cfg, std::max<int64_t>(q.rows, 1), q.cols, what);
  a.g.n = q.rows;
  QUADS_CHECK(q.codes.size() >= size_t(q.rows * q.cols) && q.fscales.size() >= size_t(fp8_scale_count(a.g)),
              "fp8 GEMM: {} [{}, {}] holds {} codes and {} scales (needs {} and {})", what, q.rows, q.cols,
              q.codes.size(), q.fscales.size(), q.rows * q.cols, fp8_scale_count(a.g));
  a.codes = q.codes.data();
  a.fscales = q.fscales.data();
  return a;
}

Fp8Act fp8_act_rows(const Fp8Act& x, int64_t r0, int64_t n) {
  QUADS_CHECK(r0 >= 0 && n >= 0 && r0 + n <= x.g.n, "fp8 GEMM: rows {} .. {} of an operand of {} rows", r0, r0 + n,
              x.g.n);
  QUADS_CHECK(r0 % x.g.bh == 0 || x.g.bh >= x.g.n,
              "fp8 GEMM: rows from {} of an operand with {}-row scale blocks", r0, x.g.bh);
  Fp8Act a = x;
  a.codes += r0 * x.g.k;
  if (x.g.bh < x.g.n) a.fscales += (r0 / x.g.bh) * x.g.ncb;  // per-tensor: fscales[0] for every row
  a.g.n = n;
  if (x.g.bh >= x.g.n) a.g.bh = std::max<int64_t>(n, 1);
  return a;
}

namespace {
TileParams tile_params(const Fp8Act& x, const Fp8Layout& g, float* y, const char* what) {
  QUADS_CHECK(x.g.k == g.k, "{}: X is [{}, {}] but W is [{}, {}]: inner dimensions differ", what, x.g.n, x.g.k, g.n,
              g.k);
  QUADS_CHECK(g.k % 16 == 0, "{}: K = {} must be a multiple of 16", what, g.k);
  TileParams p;
  p.xq = x.codes;
  p.xs = x.fscales;
  p.xa = x.g;
  p.g = g;
  p.M = p.Mtot = x.g.n;
  p.y = y;
  return p;
}
}  // namespace

void fp8_gemm(const Fp8Act& x, const Fp8Weight& w, const Fp8Layout& g, float* y, cudaStream_t stream, int splits,
              Fp8Tile tile) {
  TileParams p = tile_params(x, g, y, "fp8_gemm");
  if (x.g.n == 0 || g.n == 0) return;
  p.wq = w.codes;
  p.ws = w.fscales;
  dispatch_tiles<false>(p, splits, 0, tile, stream);
}

void fp8_gemm_grouped(const Fp8Act& x, const Fp8Weight* w_table, const Fp8Layout& g, int groups,
                      const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t stream, int splits, Fp8Tile tile) {
  TileParams p = tile_params(x, g, y, "fp8_gemm_grouped");
  QUADS_CHECK(groups > 0 && groups <= 65535, "fp8_gemm_grouped: {} groups (1..65535)", groups);
  QUADS_CHECK(max_rows > 0, "fp8_gemm_grouped: needs a bound on a group's rows (got {})", max_rows);
  if (x.g.n == 0 || g.n == 0) return;
  p.M = std::min(max_rows, x.g.n);
  p.eoff = eoff;
  p.wtab = w_table;
  dispatch_tiles<true>(p, splits, groups, tile, stream);
}

}  // namespace quads::cuda
