// Emulated W4A4 NVFP4 GEMM on FP16 tensor cores (see gemm.h for the numerics).
//
// Tiles: a CTA computes BM x BN outputs, warps WM x WN each; K advances 128 elements (8 scale
// blocks, 64 bytes of codes per row) per pipeline stage, copied global -> shared with cp.async,
// STAGES deep. Each thread of a quad (t = lane % 4) owns the two blocks 2t, 2t+1 of a stage for its
// rows: a 32-bit word of codes is 8 elements. The MMA's K slots are filled from those words in an
// order of our choosing (the sum over K does not care), the same for both operands:
//   slot pair (2t, 2t+1)   <- nibbles (0, 4) of word >> 8j,   slot pair (2t+8, 2t+9) <- (1, 5) ...
// so a thread never needs data of another thread. Nibble -> FP16: sign to bit 15, magnitude bits
// to 9..11 gives value * 2^-14 (the E2M1 subnormal 0.5 lands on the FP16 subnormal 2^-15); one
// FP16 multiply by (E4M3 scale * 2^7) then gives code * scale * 2^-7 exactly: magnitudes
// 2^-17 .. 21, multiples of 2^-17, all exact in FP16. The epilogue multiplies by 2^14 and the
// global decode scales amax/2688 of both operands.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/codecs.cuh"
#include "cuda/gemm.h"
#include "cuda/mma_util.cuh"
#include "cuda/pdl.cuh"
#include "cuda/w4a4_gemv.cuh"  // Params, the GEMV and its launch
#include "cuda/w4a4_skinny.cuh"  // the skinny tiles
#include "cuda/w4a4_tile.cuh"  // the large tiles' stage copy and epilogue
#include "cuda/w4a4_wgmma.h"

namespace quads::cuda {

namespace {

// MINB: CTAs an SM must hold (caps the registers a thread).
template <int BM, int BN, int WM, int WN, int STAGES, bool GATHER, bool GROUPED, int MINB = 1>
__global__ void __launch_bounds__(32 * (BM / WM) * (BN / WN), MINB)
w4a4_kernel(const Params p) {
  pdl_begin();
  constexpr int NWN = BN / WN;
  constexpr int NT = 32 * (BM / WM) * NWN;
  constexpr int MT = WM / 16, NTL = WN / 8;
  using SM = Smem<BM, BN, GATHER>;
  extern __shared__ __align__(16) uint8_t smem[];
#ifndef QUADS_MMA_SM80
  __trap();
#endif

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / NWN, wn = warp % NWN;
  TileCtx c;
  if (!tile_ctx<BM, BN, GROUPED, GATHER>(p, c)) return;
  const int64_t kb0 = c.kb0;
  const int nkb = c.nkb;
  const int64_t kblocks = p.K / 16;
  const int32_t* blk = c.blk;
  auto load = [&](int slot, int64_t kb) { load_stage<BM, BN, NT, GATHER>(p, c, smem + slot * SM::STAGE, kb, tid); };

  float acc[MT][NTL][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NTL; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nkb) load(s, kb0 + s);
    cp_async_commit();
  }

  for (int it = 0; it < nkb; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nx = it + STAGES - 1;
      if (nx < nkb) load(nx % STAGES, kb0 + nx);
      cp_async_commit();
    }
    const uint8_t* sa = smem + (it % STAGES) * SM::STAGE;
    const uint8_t* sb = sa + SM::A;
    const uint8_t* sas = sb + SM::B;
    const uint8_t* sbs = sas + SM::AS;

    // scale pairs (blocks 2t, 2t+1) of this thread's rows, FP16 * 2^7
    uint32_t asc[MT][2], bsc[NTL];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * WM + i * 16 + g + 8 * h;
        asc[i][h] = scales_f16x2(*reinterpret_cast<const uint16_t*>(sas + r * 8 + 2 * t));
      }
    int sh0 = 0, sh1 = 0;  // gather: the scale byte sits at (block index & 3) in its 4-byte word
    if constexpr (GATHER) {
      const int64_t kblk = (kb0 + it) * 8 + 2 * t;
      sh0 = kblk < kblocks ? 8 * (__ldg(blk + kblk) & 3) : 0;
      sh1 = kblk + 1 < kblocks ? 8 * (__ldg(blk + kblk + 1) & 3) : 0;
    }
#pragma unroll
    for (int j = 0; j < NTL; ++j) {
      const int r = wn * WN + j * 8 + g;
      uint32_t two;
      if constexpr (!GATHER) {
        two = *reinterpret_cast<const uint16_t*>(sbs + r * 8 + 2 * t);
      } else {
        const uint32_t w0 = *reinterpret_cast<const uint32_t*>(sbs + (r * 8 + 2 * t) * 4);
        const uint32_t w1 = *reinterpret_cast<const uint32_t*>(sbs + (r * 8 + 2 * t + 1) * 4);
        two = ((w0 >> sh0) & 0xFFu) | (((w1 >> sh1) & 0xFFu) << 8);
      }
      bsc[j] = scales_f16x2(two);
    }

#pragma unroll
    for (int hw = 0; hw < 4; ++hw) {  // block 2t + h, its word wd (elements 8wd .. 8wd+7)
      {
        const int h = hw >> 1;
        const int off = t * 16 + hw * 4;
        uint32_t aw[MT][2], bw[NTL];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr)
            aw[i][hr] = *reinterpret_cast<const uint32_t*>(sa + (wm * WM + i * 16 + g + 8 * hr) * 64 + off);
#pragma unroll
        for (int j = 0; j < NTL; ++j)
          bw[j] = *reinterpret_cast<const uint32_t*>(sb + (wn * WN + j * 8 + g) * 64 + off);

#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {  // two MMA k-steps per word
          uint32_t af[MT][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            const uint32_t s0 = h ? hi2(asc[i][0]) : lo2(asc[i][0]);
            const uint32_t s1 = h ? hi2(asc[i][1]) : lo2(asc[i][1]);
            if (ks == 0) {
              af[i][0] = deq<0>(aw[i][0], s0);
              af[i][1] = deq<0>(aw[i][1], s1);
              af[i][2] = deq<4>(aw[i][0], s0);
              af[i][3] = deq<4>(aw[i][1], s1);
            } else {
              af[i][0] = deq<8>(aw[i][0], s0);
              af[i][1] = deq<8>(aw[i][1], s1);
              af[i][2] = deq<12>(aw[i][0], s0);
              af[i][3] = deq<12>(aw[i][1], s1);
            }
          }
#pragma unroll
          for (int j = 0; j < NTL; ++j) {
            const uint32_t sc = h ? hi2(bsc[j]) : lo2(bsc[j]);
            const uint32_t b0 = ks == 0 ? deq<0>(bw[j], sc) : deq<8>(bw[j], sc);
            const uint32_t b1 = ks == 0 ? deq<4>(bw[j], sc) : deq<12>(bw[j], sc);
#pragma unroll
            for (int i = 0; i < MT; ++i) mma16816(acc[i][j], af[i], b0, b1);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // epilogue
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t row = c.m0 + wm * WM + i * 16 + g + 8 * hr;
      if (row >= c.mend) continue;
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int64_t col = c.n0 + wn * WN + j * 8 + 2 * t + cc;
          if (col < p.N) store_out(p, c, row, col, acc[i][j][2 * hr + cc]);
        }
    }
}

// Sums the split-K partials in split order and applies the epilogue. Grouped (groups > 0): every
// row belongs to one expert (rows eoff[e] .. eoff[e+1]) whose weight amax lives in wtab[e] (p.wamax
// is unset); the expert of a row is found by binary search over eoff.
__global__ void splitk_reduce_kernel(const Params p, int splits, int groups) {
  pdl_begin();
  const int64_t n = (groups > 0 ? p.Mtot : p.M) * p.N;
  const float kInv = 1.f / 2688.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int z = 0; z < splits; ++z) s += p.partial[z * n + i];
    const int64_t row = i / p.N, col = i % p.N;
    const float* wamax = p.wamax;
    if (groups > 0) {
      int lo = 0, hi = groups - 1;  // the last e with eoff[e] <= row
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p.eoff[mid] <= row) lo = mid;
        else hi = mid - 1;
      }
      wamax = p.wtab[lo].amax;
    }
    const float out = s * (p.xamax[p.xamax_row ? row : 0] * kInv * 16384.f) * (wamax[p.wamax_row ? col : 0] * kInv);
    float* dst = p.y + row * p.ldy + col;
    *dst = p.accumulate ? *dst + out : out;
  }
}

__global__ void gather_blocks_kernel(const float* x, int64_t m, int64_t k, const int32_t* blocks, int64_t nsel,
                                     float* out, int64_t out_cols) {
  pdl_begin();
  const int64_t n = m * out_cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out_cols, c = i % out_cols, b = c / 16;
    out[i] = b < nsel ? x[r * k + static_cast<int64_t>(blocks[b]) * 16 + c % 16] : 0.f;
  }
}

// The grouped gather: row r belongs to the expert e with eoff[e] <= r < eoff[e+1] and takes that
// expert's nsel[e] blocks (blocks row e); zeros after them.
__global__ void gather_blocks_grouped_kernel(const float* x, int64_t m, int64_t k, const int32_t* blocks,
                                             const int32_t* nsel, int64_t nb, const int32_t* eoff, int groups,
                                             float* out) {
  pdl_begin();
  const int64_t out_cols = nb * 16, n = m * out_cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / out_cols, c = i % out_cols, b = c / 16;
    int lo = 0, hi = groups - 1;  // the last e with eoff[e] <= r
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (eoff[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    out[i] = b < nsel[lo] ? x[r * k + static_cast<int64_t>(blocks[lo * nb + b]) * 16 + c % 16] : 0.f;
  }
}


void launch_tile(const TileKernel& k, Params p, int splits_req, cudaStream_t s, bool grouped, int groups) {
  const int64_t tiles_n = (p.N + k.bn - 1) / k.bn, tiles_m = (p.M + k.bm - 1) / k.bm;
  const int64_t kb_total = (p.K + kBK - 1) / kBK;
  if (grouped) {
    // The grid is E x the tiles of the largest group (p.M); decode's few active experts would
    // leave most SMs idle, so K is split until about 4 CTAs per SM could be busy (row tiles with
    // work: at least one per active expert, at most min(E, rows) experts, and at least rows / BM).
    // Partials are summed in split order (deterministic).
    int splits = splits_req;
    if (splits <= 0) {
      const int64_t row_tiles = std::max<int64_t>(std::min<int64_t>(groups, p.Mtot), (p.Mtot + k.bm - 1) / k.bm);
      const int64_t busy = row_tiles * tiles_n, want = 4LL * sm_count();
      splits = busy >= want ? 1 : static_cast<int>(std::min<int64_t>((want + busy - 1) / busy, kb_total / 2));
    }
    splits = static_cast<int>(std::min<int64_t>(std::max(splits, 1), std::max<int64_t>(kb_total, 1)));
    p.kb_per_split = static_cast<int>((kb_total + splits - 1) / splits);
    splits = static_cast<int>(std::max<int64_t>(1, (kb_total + p.kb_per_split - 1) / p.kb_per_split));
    p.gsplits = splits;
    float* partial = nullptr;
    if (splits > 1) {
      QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial), sizeof(float) * splits * p.Mtot * p.N, s));
      p.partial = partial;
    }
    QUADS_CHECK(int64_t(groups) * splits <= 65535, "w4a4_gemm_grouped: {} groups x {} splits", groups, splits);
    const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                    static_cast<unsigned>(groups * splits));
    launch_pdl(k.kernel, grid, k.threads, static_cast<size_t>(k.smem), s, p);
    if (splits > 1) {
      const int64_t n = p.Mtot * p.N;  // every row of y: each belongs to one expert
      const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
      launch_pdl(splitk_reduce_kernel, blocks, 256, 0, s, p, splits, groups);
      QUADS_CUDA_CHECK(cudaFreeAsync(partial, s));
    }
    return;
  }
  int splits = splits_req;
  if (splits <= 0) {
    // enough CTAs for about two waves, at least 2 stages of K per split
    const int64_t tiles = tiles_n * tiles_m, want = 2 * sm_count();
    splits = tiles >= want ? 1 : static_cast<int>(std::min<int64_t>((want + tiles - 1) / tiles, kb_total / 2));
    splits = std::max(splits, 1);
  }
  splits = static_cast<int>(std::min<int64_t>(std::max(splits, 1), std::max<int64_t>(kb_total, 1)));
  p.kb_per_split = static_cast<int>((kb_total + splits - 1) / splits);
  splits = static_cast<int>(std::max<int64_t>(1, (kb_total + p.kb_per_split - 1) / p.kb_per_split));
  float* partial = nullptr;
  if (splits > 1) {
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial), sizeof(float) * splits * p.M * p.N, s));
    p.partial = partial;
  }
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m), static_cast<unsigned>(splits));
  launch_pdl(k.kernel, grid, k.threads, static_cast<size_t>(k.smem), s, p);
  if (splits > 1) {
    const int64_t n = p.M * p.N;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
    launch_pdl(splitk_reduce_kernel, blocks, 256, 0, s, p, splits, 0);
    QUADS_CUDA_CHECK(cudaFreeAsync(partial, s));
  }
}


template <int BM, int BN, int WM, int WN, int STAGES, bool GATHER, bool GROUPED = false, int MINB = 1>
void launch(Params p, int splits_req, cudaStream_t s, int groups = 1) {
  const int smem = Smem<BM, BN, GATHER>::STAGE * STAGES;
  constexpr auto kern = w4a4_kernel<BM, BN, WM, WN, STAGES, GATHER, GROUPED, MINB>;
  prepare_mma_kernel<kern>(smem);
  launch_tile({kern, 32 * (BM / WM) * (BN / WN), smem, BM, BN}, p, splits_req, s, GROUPED, groups);
}

// Auto's 16-row tile. The 3-stage, 7-CTAs-per-SM variant wins where K is short (bench_cuda --gemv,
// H200, routed decode: down (K 768) 39.6 -> 34.3 us at batch 16, 48.3 -> 43.7 at 64) and loses on
// the longer K of q/k/v, o_proj and gate/up (gate/up 70.5 -> 79.2 at batch 16).
W4A4Tile auto_m16(int64_t k) { return k <= 1024 ? W4A4Tile::M16W4S3 : W4A4Tile::M16W4; }

// Auto's choice of the skinny tiles, for A/B runs: QUADS_W4A4_SKINNY=0 never, =grouped for grouped
// calls only, =N (a number) for grouped calls and dense ones of up to N rows, else where Auto's
// rules take them.
int64_t skinny_dense_max_rows() {
  static const int64_t rows = [] {
    const char* e = std::getenv("QUADS_W4A4_SKINNY");
    if (e && (std::strcmp(e, "0") == 0 || std::strcmp(e, "grouped") == 0)) return int64_t(0);
    if (e && std::atoll(e) > 0) return static_cast<int64_t>(std::atoll(e));
    return kSkinnyDenseMaxRows;
  }();
  return rows;
}
bool skinny_enabled(bool grouped) {
  static const bool off = [] {
    const char* e = std::getenv("QUADS_W4A4_SKINNY");
    return e && std::strcmp(e, "0") == 0;
  }();
  return grouped ? !off : skinny_dense_max_rows() > 0;
}

// QUADS_GPU_SKINNY_EARLY=0: the dense skinny tiles wait for the previous kernel before their first
// weight loads even where weights_ready allows them earlier (an A/B switch).
bool skinny_early_on() {
  static const bool on = [] {
    const char* e = std::getenv("QUADS_GPU_SKINNY_EARLY");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// Auto's tile for many rows (see W4A4Tile).
W4A4Tile auto_large() {
  static const W4A4Tile tile = [] {
    const char* e = std::getenv("QUADS_W4A4_WGMMA");
    if ((e && std::strcmp(e, "0") == 0) || !w4a4_wgmma_available()) return W4A4Tile::M128;
    return e && std::strcmp(e, "256") == 0 ? W4A4Tile::Wg256 : W4A4Tile::Wg128;
  }();
  return tile;
}

TileKernel wgmma_tile(W4A4Tile tile, bool grouped) {
  const TileKernel k = w4a4_wgmma_tile(tile == W4A4Tile::Wg256 ? 256 : 128, grouped);
  QUADS_CHECK(k.kernel, "w4a4_gemm: the warpgroup tiles (Wg128, Wg256) need an sm_90 GPU (H100, H200)");
  return k;
}

}  // namespace

int64_t gemv_auto_max_rows(bool xfrag) {
  static const int64_t forced = [] {
    const char* e = std::getenv("QUADS_GEMV_AUTO_ROWS");
    return e != nullptr ? static_cast<int64_t>(std::atoll(e)) : int64_t(-1);
  }();
  return forced >= 0 ? forced : xfrag ? kGemvAutoMaxRowsXFrag : kGemvAutoMaxRows;
}

namespace {
template <bool GATHER>
void dispatch(const Params& p, const W4A4Options& opt, cudaStream_t s) {
  W4A4Tile tile = opt.tile;
  if (tile == W4A4Tile::Auto && p.M <= gemv_auto_max_rows(p.xfrag != nullptr) && gemv_plan(p.K, p.M, p.N).R > 0) tile = W4A4Tile::Gemv;
  if (tile == W4A4Tile::Auto && !GATHER && opt.splits <= 0 && p.M <= skinny_dense_max_rows() &&
      skinny_smem(1, p.K) <= kSkinnySmemMax)
    tile = W4A4Tile::Skinny;
  if (tile == W4A4Tile::Skinny) {
    QUADS_CHECK(!GATHER, "w4a4_gemm_gather: the skinny tiles have no gather variant");
    Params q = p;
    q.early_w = p.early_w && skinny_early_on();
    launch_skinny<false>(q, q.M, 1, opt.splits, opt.kcluster, s, opt.row_block);
    return;
  }
  // M = 17..32 runs two 16-row tiles over the same weights (measured faster than one 64-row tile);
  // 4 warps per 16-row tile beat 2 by 0-13% at M 8..32 on the H200 (bench_cuda --gemv).
  if (tile == W4A4Tile::Auto) tile = p.M <= 32 ? auto_m16(p.K) : p.M <= 64 ? W4A4Tile::M64 : GATHER ? W4A4Tile::M128 : auto_large();
  if (tile == W4A4Tile::Wg128 || tile == W4A4Tile::Wg256) {
    QUADS_CHECK(!GATHER, "w4a4_gemm_gather: the warpgroup tiles have no gather variant");
    launch_tile(wgmma_tile(tile, false), p, opt.splits, s, false, 1);
    return;
  }
  switch (tile) {
    case W4A4Tile::Gemv: launch_gemv<GATHER, false>(p, gemv_plan(p.K, p.M, p.N), 1, s); break;
    case W4A4Tile::M16: launch<16, 128, 16, 64, 4, GATHER>(p, opt.splits, s); break;
    case W4A4Tile::M16W4: launch<16, 128, 16, 32, 4, GATHER>(p, opt.splits, s); break;
    case W4A4Tile::M16W4S3: launch<16, 128, 16, 32, 3, GATHER, false, 7>(p, opt.splits, s); break;
    case W4A4Tile::M16N64: launch<16, 64, 16, 32, 4, GATHER>(p, opt.splits, s); break;
    case W4A4Tile::M64: launch<64, 128, 32, 64, 4, GATHER>(p, opt.splits, s); break;
    default: launch<128, 128, 64, 64, 3, GATHER>(p, opt.splits, s); break;
  }
}


// plan_groups: the groups the GEMV's and skinny tiles' plans are made for (a window of a larger
// call keeps its plan: the same bits); the grid covers `groups`.
template <bool GATHER>
void dispatch_grouped(Params p, int groups, int splits, W4A4Tile tile, cudaStream_t s, int plan_groups = 0) {
  p.groups = groups;
  const int pg = std::max(groups, plan_groups);
  const int64_t grid_active = std::min<int64_t>(groups, p.Mtot);
  if (tile == W4A4Tile::Auto && splits <= 0 && gemv_auto_grouped(p.M, p.K) &&
      gemv_plan_grouped(p, pg).R > 0)
    tile = W4A4Tile::Gemv;
  if (tile == W4A4Tile::Gemv) {
    launch_gemv<GATHER, true>(p, gemv_plan_grouped(p, pg), grid_active, s);
    return;
  }
  if (tile == W4A4Tile::Auto && !GATHER && splits <= 0 && skinny_enabled(true) && p.M <= kSkinnyAutoMaxRows &&
      skinny_smem(1, p.K) <= kSkinnySmemMax)
    tile = W4A4Tile::Skinny;
  if (tile == W4A4Tile::Skinny) {
    QUADS_CHECK(!GATHER, "w4a4_gemm_grouped_gather: the skinny tiles have no gather variant");
    launch_skinny<true>(p, p.M, std::min<int64_t>(pg, p.Mtot), splits, 0, s, 0, grid_active);
    return;
  }
  QUADS_CHECK(pg == groups, "w4a4_gemm_grouped: a window of groups (plan_groups {} > groups {}) needs the GEMV or "
              "the skinny tiles (a few rows a group)", plan_groups, groups);
  // p.M is the largest group: decode has a few rows per expert, M16 tiles stream the weights. With
  // 4 warps per tile (H200, routed decode batches, bench_cuda --gemv): gate/up 70 vs 82 us at batch
  // 16, 87 vs 87 at 64; down 40 vs 37 at 16, 46 vs 55 at 64.
  if (tile == W4A4Tile::Auto)
    tile = p.M <= 64 ? auto_m16(p.K) : p.M <= 256 ? W4A4Tile::M64 : GATHER ? W4A4Tile::M128 : auto_large();
  if (tile == W4A4Tile::Wg128 || tile == W4A4Tile::Wg256) {
    QUADS_CHECK(!GATHER, "w4a4_gemm_grouped_gather: the warpgroup tiles have no gather variant");
    launch_tile(wgmma_tile(tile, true), p, splits, s, true, groups);
    return;
  }
  switch (tile) {
    case W4A4Tile::M16: launch<16, 128, 16, 64, 4, GATHER, true>(p, splits, s, groups); break;
    case W4A4Tile::M16W4: launch<16, 128, 16, 32, 4, GATHER, true>(p, splits, s, groups); break;
    case W4A4Tile::M16W4S3: launch<16, 128, 16, 32, 3, GATHER, true, 7>(p, splits, s, groups); break;
    case W4A4Tile::M16N64: launch<16, 64, 16, 32, 4, GATHER, true>(p, splits, s, groups); break;
    case W4A4Tile::M64: launch<64, 128, 32, 64, 4, GATHER, true>(p, splits, s, groups); break;
    default: launch<128, 128, 64, 64, 3, GATHER, true>(p, splits, s, groups); break;
  }
}


}  // namespace

namespace {
GemvTileLoop& tile_loop_mode() {
  static GemvTileLoop mode = [] {
    const char* e = std::getenv("QUADS_GEMV_TILE_LOOP");
    if (e && std::strcmp(e, "0") == 0) return GemvTileLoop::Off;
    if (e && std::strcmp(e, "1") == 0) return GemvTileLoop::On;
    return GemvTileLoop::Auto;
  }();
  return mode;
}
}  // namespace
void set_gemv_tile_loop(GemvTileLoop mode) { tile_loop_mode() = mode; }
GemvTileLoop gemv_tile_loop() { return tile_loop_mode(); }

bool w4a4_wgmma_available() {
  static const bool ok = w4a4_wgmma_tile(128, false).kernel && w4a4_wgmma_tile(128, true).kernel &&
                         w4a4_wgmma_tile(256, false).kernel && w4a4_wgmma_tile(256, true).kernel;
  return ok;
}

bool gemv_auto_grouped(int64_t max_rows, int64_t /*k*/) {
  // max_rows is the decode batch (a group has at most one row per token); from 2 rows the skinny
  // tiles win (routed batch 4, bench_cuda --gemv: gate/up 25 vs 38 us)
  return max_rows <= 1;
}

Nvfp4View nvfp4_view(const DeviceQTensor& q, const char* what) {
  QUADS_CHECK(q.cfg.scheme == num::Scheme::NVFP4 && q.cfg.element == num::Format::E2M1,
              "{}: the W4A4 GEMM needs NVFP4 with E2M1 elements, got {}", what, q.cfg.describe());
  QUADS_CHECK(q.layout == ScaleLayout::RowMajor, "{}: the emulated W4A4 GEMM reads row-major scales", what);
  Nvfp4View v;
  v.codes = q.codes.data();
  v.scales = q.scales.data();
  v.amax = q.amax.data();
  v.amax_per_row = q.cfg.global == num::Global::PerRow;
  v.rows = q.rows;
  v.k = q.cols;
  return v;
}

namespace {
void set_ldy(Params& p, const W4A4Options& opt, const char* what) {
  if (opt.ldy == 0) return;
  QUADS_CHECK(opt.ldy >= p.N, "{}: ldy = {} < N = {}", what, opt.ldy, p.N);
  p.ldy = opt.ldy;
}
}  // namespace

void w4a4_gemm_emulated(const Nvfp4View& x, const Nvfp4View& w, float* y, bool accumulate, cudaStream_t s,
                        const W4A4Options& opt) {
  QUADS_CHECK(x.k == w.k, "w4a4_gemm: X is [{}, {}] but W is [{}, {}]: inner dimensions differ", x.rows, x.k, w.rows, w.k);
  QUADS_CHECK(x.k % 64 == 0, "w4a4_gemm: K = {} must be a multiple of 64", x.k);
  if (x.rows == 0 || w.rows == 0) return;
  Params p = make_params(x, w, y, accumulate);
  p.early_w = opt.weights_ready;
  if (x.frag && x.rows <= kXFragMaxRows && x.k % 128 == 0) {
    QUADS_CHECK(reinterpret_cast<uintptr_t>(x.frag) % 16 == 0, "w4a4_gemm: X's fragments must be 16-byte aligned");
    p.xfrag = reinterpret_cast<const uint4*>(x.frag);
  }
  set_ldy(p, opt, "w4a4_gemm");
  dispatch<false>(p, opt, s);
}

namespace {
__global__ void x_frag_kernel(const uint8_t* codes, const uint8_t* scales, int rows, int64_t nb, uint4* frag) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * nb) return;
  const int r = static_cast<int>(i / nb);
  const int64_t b = i - r * nb;
  x_frag_store(frag, r, b, reinterpret_cast<const uint2*>(codes)[i], scales[i], nb);
}
}  // namespace

void w4a4_x_frag(const Nvfp4View& x, uint8_t* frag, cudaStream_t s) {
  QUADS_CHECK(x.rows >= 0 && x.rows <= kXFragMaxRows, "w4a4_x_frag: {} rows (at most {})", x.rows, kXFragMaxRows);
  QUADS_CHECK(x.k % 16 == 0, "w4a4_x_frag: K = {} must be a multiple of 16", x.k);
  QUADS_CHECK(reinterpret_cast<uintptr_t>(frag) % 16 == 0, "w4a4_x_frag: the fragments must be 16-byte aligned");
  const int64_t n = x.rows * (x.k / 16);
  if (n == 0) return;
  launch_pdl(x_frag_kernel, static_cast<unsigned>((n + 255) / 256), 256, 0, s, x.codes, x.scales,
             static_cast<int>(x.rows), x.k / 16, reinterpret_cast<uint4*>(frag));
}

void w4a4_gemm_gather(const Nvfp4View& xr, const Nvfp4View& w, const int32_t* blocks, float* y, bool accumulate,
                      cudaStream_t s, const W4A4Options& opt) {
  QUADS_CHECK(xr.k % 64 == 0, "w4a4_gemm_gather: the residual's K = {} must be a multiple of 64 (pad with zero blocks)", xr.k);
  QUADS_CHECK(w.k % 64 == 0, "w4a4_gemm_gather: W's K = {} must be a multiple of 64", w.k);
  Params p = make_params(xr, w, y, accumulate);
  set_ldy(p, opt, "w4a4_gemm_gather");
  if (xr.rows == 0 || w.rows == 0 || xr.k == 0) {
    if (!accumulate && xr.rows && w.rows)
      QUADS_CUDA_CHECK(cudaMemset2DAsync(y, sizeof(float) * p.ldy, 0, sizeof(float) * w.rows, xr.rows, s));
    return;
  }
  p.blk = blocks;
  dispatch<true>(p, opt, s);
}

namespace {
// A grouped call's parameters: `rows` rows of the problem (y's), groups from eoff, weights from
// the table; max_rows bounds the grid (each CTA reads its own group's row range).
Params grouped_params(const Nvfp4View& x, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n,
                      const int32_t* eoff, int64_t max_rows, int64_t rows, float* y) {
  Nvfp4View w;
  w.rows = n;
  w.k = x.k;
  w.amax_per_row = w_amax_per_row;
  Params p = make_params(x, w, y, false);
  p.M = std::min(max_rows, rows);
  p.Mtot = rows;
  p.eoff = eoff;
  p.wtab = w_table;
  return p;
}
}  // namespace

void w4a4_gemm_grouped(const Nvfp4View& x, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                       const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t s, int splits,
                       W4A4Tile tile, int plan_groups) {
  QUADS_CHECK(x.k % 64 == 0, "w4a4_gemm_grouped: K = {} must be a multiple of 64", x.k);
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemm_grouped: {} groups (1..65535)", groups);
  QUADS_CHECK(plan_groups <= 65535, "w4a4_gemm_grouped: plan_groups = {} (at most 65535)", plan_groups);
  if (x.rows == 0 || n == 0 || max_rows <= 0) return;
  dispatch_grouped<false>(grouped_params(x, w_table, w_amax_per_row, n, eoff, max_rows, x.rows, y), groups, splits,
                          tile, s, plan_groups);
}

bool w4a4_grouped_mapped_supported(int64_t max_rows, int64_t k) {
  if (k % 64 != 0 || max_rows < 1) return false;
  if (gemv_auto_grouped(max_rows, k)) return gemv_plan(k, max_rows, 1).R > 0;
  return skinny_enabled(true) && max_rows <= kSkinnyAutoMaxRows && skinny_smem(1, k) <= kSkinnySmemMax;
}

void w4a4_gemm_grouped_mapped(const Nvfp4View& x, const int32_t* x_map, int x_map_div, int64_t rows,
                              const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                              const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t s,
                              int plan_groups) {
  QUADS_CHECK(w4a4_grouped_mapped_supported(max_rows, x.k),
              "w4a4_gemm_grouped_mapped: no mapped kernel for {} rows a group and K = {} (ask "
              "w4a4_grouped_mapped_supported)", max_rows, x.k);
  QUADS_CHECK(x_map && x_map_div >= 1, "w4a4_gemm_grouped_mapped: a row map and a divisor >= 1 are needed");
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemm_grouped_mapped: {} groups (1..65535)", groups);
  QUADS_CHECK(plan_groups <= 65535, "w4a4_gemm_grouped_mapped: plan_groups = {} (at most 65535)", plan_groups);
  if (rows == 0 || x.rows == 0 || n == 0) return;
  Params p = grouped_params(x, w_table, w_amax_per_row, n, eoff, max_rows, rows, y);
  p.fmap = x_map;
  p.fmap_div = x_map_div;
  p.groups = groups;
  const int pg = std::max(groups, plan_groups);
  const int64_t grid_active = std::min<int64_t>(groups, p.Mtot);
  if (gemv_auto_grouped(max_rows, x.k)) launch_gemv<false, true>(p, gemv_plan_grouped(p, pg), grid_active, s);
  else launch_skinny<true>(p, p.M, std::min<int64_t>(pg, p.Mtot), 0, 0, s, 0, grid_active);
}

void w4a4_gemm_grouped_gather(const Nvfp4View& xr, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n,
                              int64_t w_k, int groups, const int32_t* eoff, int64_t max_rows, const int32_t* blocks,
                              float* y, int64_t ldy, cudaStream_t s, int splits, W4A4Tile tile) {
  QUADS_CHECK(xr.k % 64 == 0, "w4a4_gemm_grouped_gather: the residual's K = {} must be a multiple of 64", xr.k);
  QUADS_CHECK(w_k % 64 == 0, "w4a4_gemm_grouped_gather: W's K = {} must be a multiple of 64", w_k);
  QUADS_CHECK(ldy >= n, "w4a4_gemm_grouped_gather: ldy = {} < n = {}", ldy, n);
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemm_grouped_gather: {} groups (1..65535)", groups);
  if (xr.rows == 0 || n == 0 || max_rows <= 0 || xr.k == 0) return;
  Nvfp4View w;
  w.rows = n;
  w.k = w_k;
  w.amax_per_row = w_amax_per_row;
  Params p = make_params(xr, w, y, true);
  p.ldy = ldy;
  p.M = std::min(max_rows, xr.rows);
  p.Mtot = xr.rows;
  p.eoff = eoff;
  p.wtab = w_table;
  p.blk = blocks;
  p.blk_stride = xr.k / 16;
  dispatch_grouped<true>(p, groups, splits, tile, s);
}

namespace {
// The folded call's residual fields, checked against W's rows and the call's rows.
void set_rac_fold(Params& p, const RacFold& r, int64_t rows, const char* what) {
  QUADS_CHECK(r.codes && r.scales && r.amax, "{}: the residual operand's codes, scales and amax are needed", what);
  QUADS_CHECK(r.nops >= 1 && r.nops <= 3, "{}: {} residual operands (1..3)", what, r.nops);
  QUADS_CHECK(r.rows == rows, "{}: the residual has {} rows, the call {}", what, r.rows, rows);
  for (int j = 0; j + 1 < r.nops; ++j)
    QUADS_CHECK(r.split[j] > 0 && r.split[j] < p.N && r.split[j] % 16 == 0 && (j == 0 || r.split[j] > r.split[j - 1]),
                "{}: residual operand {} starts at W row {}: splits must rise, lie inside W's {} rows and be "
                "multiples of 16", what, j + 1, r.split[j], p.N);
  p.rq = r.codes;
  p.rs = r.scales;
  p.ramax = r.amax;
  p.nres = r.nops;
  p.rrows = r.rows;
  p.rsplit0 = r.nops > 1 ? r.split[0] : INT64_MAX;
  p.rsplit1 = r.nops > 2 ? r.split[1] : INT64_MAX;
}
}  // namespace

bool w4a4_rac_fold_supported(int64_t rows_per_weight, int64_t k, bool grouped) {
  if (k % 64 != 0 || rows_per_weight < 1) return false;
  if (grouped ? gemv_auto_grouped(rows_per_weight, k) : rows_per_weight <= kGemvAutoMaxRows)
    return gemv_plan(k, rows_per_weight, 1, 4).R > 0;
  return skinny_enabled(grouped) && rows_per_weight <= (grouped ? kSkinnyAutoMaxRows : skinny_dense_max_rows()) &&
         skinny_smem_stages(2, (k + 127) / 128) <= kSkinnySmemMax;
}

void w4a4_gemm_rac(const Nvfp4View& x, const Nvfp4View& w, const RacFold& r, float* y, bool accumulate,
                   cudaStream_t s, const W4A4Options& opt) {
  QUADS_CHECK(x.k == w.k, "w4a4_gemm_rac: X is [{}, {}] but W is [{}, {}]: inner dimensions differ", x.rows, x.k, w.rows, w.k);
  QUADS_CHECK(w4a4_rac_fold_supported(x.rows, x.k, false),
              "w4a4_gemm_rac: no folded kernel for {} rows and K = {} (ask w4a4_rac_fold_supported)", x.rows, x.k);
  QUADS_CHECK(opt.tile == W4A4Tile::Auto && opt.splits == 0, "w4a4_gemm_rac: Auto's GEMV or skinny tiles only");
  if (x.rows == 0 || w.rows == 0) return;
  Params p = make_params(x, w, y, accumulate);
  p.early_w = opt.weights_ready;
  set_ldy(p, opt, "w4a4_gemm_rac");
  set_rac_fold(p, r, x.rows, "w4a4_gemm_rac");
  if (p.M <= kGemvAutoMaxRows) {
    launch_gemv<false, false, 0, true>(p, gemv_plan(p.K, p.M, p.N, 1 + r.nops), 1, s);
  } else {
    p.early_w = p.early_w && skinny_early_on();
    launch_skinny<false, true>(p, p.M, 1, 0, opt.kcluster, s, opt.row_block);
  }
}

void w4a4_gemm_grouped_rac(const Nvfp4View& x, const int32_t* x_map, int x_map_div, int64_t rows, const RacFold& r,
                           const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                           const int32_t* eoff, int64_t max_rows, float* y, int64_t ldy, cudaStream_t s) {
  QUADS_CHECK(w4a4_rac_fold_supported(max_rows, x.k, true),
              "w4a4_gemm_grouped_rac: no folded kernel for {} rows a group and K = {} (ask w4a4_rac_fold_supported)",
              max_rows, x.k);
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemm_grouped_rac: {} groups (1..65535)", groups);
  QUADS_CHECK(!x_map || x_map_div >= 1, "w4a4_gemm_grouped_rac: the row map's divisor must be >= 1");
  QUADS_CHECK(x_map || x.rows == rows, "w4a4_gemm_grouped_rac: X has {} rows, the call {} (and no row map)", x.rows, rows);
  if (rows == 0 || x.rows == 0 || n == 0) return;
  Params p = grouped_params(x, w_table, w_amax_per_row, n, eoff, max_rows, rows, y);
  if (ldy) {
    QUADS_CHECK(ldy >= n, "w4a4_gemm_grouped_rac: ldy = {} < n = {}", ldy, n);
    p.ldy = ldy;
  }
  p.fmap = x_map;
  p.fmap_div = x_map ? x_map_div : 1;
  p.groups = groups;
  set_rac_fold(p, r, rows, "w4a4_gemm_grouped_rac");
  const int64_t grid_active = std::min<int64_t>(groups, p.Mtot);
  if (gemv_auto_grouped(max_rows, x.k))
    launch_gemv<false, true, 0, true>(p, gemv_plan_grouped(p, groups, 1 + r.nops), grid_active, s);
  else
    launch_skinny<true, true>(p, p.M, grid_active, 0, 0, s, 0, grid_active);
}

void gather_blocks(const float* x, int64_t m, int64_t k, const int32_t* blocks, int64_t nsel, float* out,
                   int64_t out_cols, cudaStream_t s) {
  QUADS_CHECK(out_cols % 16 == 0 && out_cols >= 16 * nsel, "gather_blocks: out_cols = {} cannot hold {} blocks", out_cols, nsel);
  const int64_t n = m * out_cols;
  if (n == 0) return;
  const int blocks_n = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
  launch_pdl(gather_blocks_kernel, blocks_n, 256, 0, s, x, m, k, blocks, nsel, out, out_cols);
}

void gather_blocks_grouped(const float* x, int64_t m, int64_t k, const int32_t* blocks, const int32_t* nsel,
                           int64_t out_cols, const int32_t* eoff, int groups, float* out, cudaStream_t s) {
  QUADS_CHECK(out_cols % 16 == 0, "gather_blocks_grouped: out_cols = {} is not a multiple of 16", out_cols);
  const int64_t n = m * out_cols;
  if (n == 0) return;
  const int blocks_n = static_cast<int>(std::min<int64_t>((n + 255) / 256, 16LL * sm_count()));
  launch_pdl(gather_blocks_grouped_kernel, blocks_n, 256, 0, s, x, m, k, blocks, nsel, out_cols / 16, eoff, groups, out);
}

bool skinny_trace(unsigned long long* buf) {
#ifdef QUADS_SKINNY_TRACE
  QUADS_CUDA_CHECK(cudaMemcpyToSymbol(g_skinny_trace, &buf, sizeof(buf)));
  return true;
#else
  (void)buf;
  return false;
#endif
}
int skinny_trace_slots() { return kSkinnyTraceSlots; }

}  // namespace quads::cuda
