#pragma once
// What the W4A4 tile kernels share: the E2M1 -> FP16 dequantization (all tiles: w4a4_gemm.cu's
// header has the numerics) and, for the tiles of many rows (w4a4_gemm.cu's mma.sync tiles M16 ..
// M128, w4a4_wgmma.cu's warpgroup tiles), a CTA's rows and weights (dense, or one expert of a
// grouped call), the copy of one K stage of codes and scales into shared memory, and the store of
// an output. Internal linkage, as w4a4_gemv.cuh.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/mma_util.cuh"
#include "cuda/w4a4_gemv.cuh"  // Params

namespace quads::cuda {

namespace {

// The E2M1 -> FP16 dequantization (hmul2, hb_lo / hb_hi, scales_f16x2, deq) is in mma_util.cuh.

constexpr int kBK = 128;  // K elements a stage: 8 scale blocks, 64 bytes of codes a row

// A stage in shared memory: X codes [BM][64 B], W codes [BN][64 B], X scales [BM][8 B], W scales
// [BN][8 B] (gather: [BN][8][4 B], the 4-byte word that holds each gathered block's scale byte).
template <int BM, int BN, bool GATHER>
struct Smem {
  static constexpr int A = BM * 64, B = BN * 64, AS = BM * 8, BS = GATHER ? BN * 32 : BN * 8;
  static constexpr int STAGE = A + B + AS + BS;
};

// A CTA's share: rows m0 .. mend of X and y (a grouped call: of its expert), columns from n0, K
// stages kb0 .. kb0 + nkb, the weight it reads.
struct TileCtx {
  int64_t m0, mend, n0, kb0, zsplit, prows;
  int nkb;
  const uint8_t* wq;
  const uint8_t* ws;
  const float* wamax;
  const int32_t* blk;
};

// false: the CTA has no rows (a grouped call's grid covers the largest group; the tiles past this
// expert's rows leave at once, uniformly for the whole CTA, before any barrier).
template <int BM, int BN, bool GROUPED, bool GATHER>
__device__ __forceinline__ bool tile_ctx(const Params& p, TileCtx& c) {
  c.m0 = static_cast<int64_t>(blockIdx.y) * BM;
  c.mend = p.M;
  c.n0 = static_cast<int64_t>(blockIdx.x) * BN;
  c.kb0 = static_cast<int64_t>(blockIdx.z) * p.kb_per_split;
  c.wq = p.wq;
  c.ws = p.ws;
  c.wamax = p.wamax;
  c.blk = p.blk;
  if constexpr (GROUPED) {
    const int e = blockIdx.z / p.gsplits;
    const int64_t mb = p.eoff[e];
    c.mend = p.eoff[e + 1];
    c.m0 += mb;
    if (c.m0 >= c.mend) return false;
    c.wq = p.wtab[e].codes;
    c.ws = p.wtab[e].scales;
    c.wamax = p.wtab[e].amax;
    if constexpr (GATHER) c.blk += e * p.blk_stride;
    c.kb0 = static_cast<int64_t>(blockIdx.z % p.gsplits) * p.kb_per_split;
  }
  c.zsplit = GROUPED ? blockIdx.z % p.gsplits : blockIdx.z;
  c.prows = GROUPED ? p.Mtot : p.M;
  const int64_t kb_total = (p.K + kBK - 1) / kBK;
  const int64_t kb1 = min(kb_total, c.kb0 + p.kb_per_split);
  c.nkb = kb1 > c.kb0 ? static_cast<int>(kb1 - c.kb0) : 0;
  return true;
}

// ROWS rows (from row0; rows at or past rend, and K past K, read as zeros) of one operand's
// stage at k0: codes [ROWS][64 B] and scales [ROWS][8 B], by NT threads.
template <int ROWS, int NT>
__device__ __forceinline__ void load_stage_rows(uint8_t* codes, uint8_t* scales, const uint8_t* q, const uint8_t* s,
                                                int64_t row0, int64_t rend, int64_t qrow, int64_t srow, int64_t k0,
                                                int64_t K, int tid) {
  for (int i = tid; i < ROWS * 4; i += NT) {
    const int r = i >> 2, part = i & 3;
    const int64_t gr = row0 + r, kc = k0 + part * 32;
    const bool ok = gr < rend && kc < K;
    cp_async16(codes + r * 64 + part * 16, q + (ok ? gr * qrow + kc / 2 : 0), ok ? 16 : 0);
  }
  for (int i = tid; i < ROWS * 2; i += NT) {
    const int r = i >> 1, h = i & 1;
    const int64_t gr = row0 + r, kc = k0 + h * 64;
    const bool ok = gr < rend && kc < K;
    cp_async4(scales + r * 8 + h * 4, s + (ok ? gr * srow + kc / 16 : 0), ok ? 4 : 0);
  }
}

// Stage kb's codes and scales (cp.async; rows past the end and K past K read as zeros) by NT
// threads into `stage` (the Smem layout).
template <int BM, int BN, int NT, bool GATHER>
__device__ __forceinline__ void load_stage(const Params& p, const TileCtx& c, uint8_t* stage, int64_t kb, int tid) {
  using SM = Smem<BM, BN, GATHER>;
  uint8_t* sa = stage;
  uint8_t* sb = sa + SM::A;
  uint8_t* sas = sb + SM::B;
  uint8_t* sbs = sas + SM::AS;
  const int64_t k0 = kb * kBK;
  const int64_t wrow = p.Kw / 2, wsrow = p.Kw / 16, kblocks = p.K / 16;
  load_stage_rows<BM, NT>(sa, sas, p.xq, p.xs, c.m0, c.mend, p.K / 2, p.K / 16, k0, p.K, tid);
  if constexpr (!GATHER) {
    load_stage_rows<BN, NT>(sb, sbs, c.wq, c.ws, c.n0, p.N, wrow, wsrow, k0, p.K, tid);
  } else {
    for (int i = tid; i < BN * 8; i += NT) {
      const int r = i >> 3, b = i & 7;
      const int64_t gn = c.n0 + r, kblk = kb * 8 + b;
      const bool ok = gn < p.N && kblk < kblocks;
      const int64_t src = ok ? c.blk[kblk] : 0;
      cp_async8(sb + r * 64 + b * 8, c.wq + (ok ? gn * wrow + src * 8 : 0), ok ? 8 : 0);
      cp_async4(sbs + (r * 8 + b) * 4, c.ws + (ok ? gn * wsrow + (src & ~int64_t(3)) : 0), ok ? 4 : 0);
    }
  }
}

// Output (row, col) from its FP32 sum v (the codes' products times 2^-14 x the block scales): y
// = v x 2^14 x amax_x / 2688 x amax_w / 2688, written or added; with split K the raw sum goes to
// the split's partials instead (splitk_reduce applies the scales).
__device__ __forceinline__ void store_out(const Params& p, const TileCtx& c, int64_t row, int64_t col, float v) {
  if (p.partial) {
    p.partial[(c.zsplit * c.prows + row) * p.N + col] = v;
    return;
  }
  const float kInv = 1.f / 2688.f;
  const float rf = p.xamax[p.xamax_row ? row : 0] * kInv * 16384.f;
  const float out = v * rf * (c.wamax[p.wamax_row ? col : 0] * kInv);
  float* dst = p.y + row * p.ldy + col;
  *dst = p.accumulate ? *dst + out : out;
}

}  // namespace

}  // namespace quads::cuda
