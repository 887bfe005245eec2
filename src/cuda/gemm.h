#pragma once
// GEMMs of the CUDA backend. Every GEMM computes Y[M, N] = X[M, K] . W[N, K]^T (activations times
// the transpose of a weight stored [out, in], as a Linear layer), row-major, float32 output.
//
// W4A4 (NVFP4 activations and weights, E2M1 elements):
//  - Hopper and older: exact emulation. code * E4M3 block scale is exact in FP16 (at most 5
//    significant bits, magnitudes 2^-10 .. 2688), so the kernel dequantizes the packed 4-bit tiles in
//    registers (never a BF16/FP16 copy of the weights in memory), multiplies on FP16 tensor cores
//    (mma.sync m16n8k16) with FP32 accumulation, and applies the global scales in the epilogue.
//    Its only rounding is the FP32 accumulation. On Hopper, calls of many rows (prefill) use the
//    warpgroup MMA (wgmma, FP16 from shared memory): each stage's W codes dequantized once per CTA
//    into shared memory, X's in the registers of the warp that multiplies them (W4A4Tile::Wg128).
//    For M <= 16 (decode) the tiles are 16 x 128 and
//    stream the packed weights; small grids split K (partials summed in a fixed order, so results
//    are deterministic). For a few rows (decode) a GEMV on CUDA cores (int8 dot products of the
//    codes, exact block terms, FP32 sums) streams the weights without split K (W4A4Tile::Gemv).
//  - Blackwell (sm_100, checked at run time): cuBLASLt's native block-scaled FP4 GEMM
//    (CUDA_R_4F_E2M1, VEC16_UE4M3 scales in the 128x4 swizzled layout).
// RAC's residual GEMM: the same kernel over a subset of W's 16-blocks given as a list.
//
// Baselines: BF16 through cuBLAS, FP8 (E4M3, per-tensor scales) through cuBLASLt.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "cuda/quant.h"

namespace quads::cuda {

// An NVFP4 (E2M1) operand in device memory: codes [rows, k/2], row-major E4M3 scales [rows, k/16]
// (16x16 weights repeat a tile's scale on its rows, so they read the same way), global amax.
struct Nvfp4View {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* amax = nullptr;  // 1 value, or one per row when amax_per_row
  bool amax_per_row = false;
  int64_t rows = 0, k = 0;
  // X of a dense call with at most kXFragMaxRows rows, optional: the same rows as the skinny
  // tiles' FP16 operand (x_frag_bytes(k, rows) bytes, 16-byte aligned; mma_util.cuh's
  // x_frag_store layout), written with the codes by their producer (a norm's RowNvfp4::frag,
  // quantize(), or w4a4_x_frag). The skinny tiles then copy X instead of staging and dequantizing
  // it, and at 9-16 rows split K over the warps of a CTA where they would split it over a cluster
  // of CTAs (the same K ranges added in the same order: the same bits). Ignored by every other
  // kernel and where K % 128 != 0.
  const uint8_t* frag = nullptr;
};
// Bytes of Nvfp4View::frag for K columns and `rows` rows: 4 KB a 128-wide stage a chunk of 16 rows.
constexpr int64_t x_frag_bytes(int64_t k, int64_t rows = 16) { return (rows + 15) / 16 * ((k + 127) / 128) * 4096; }
// x.frag from x's codes (rows <= kXFragMaxRows, K % 16 == 0): what a producer that writes both stores.
void w4a4_x_frag(const Nvfp4View& x, uint8_t* frag, cudaStream_t stream = nullptr);
// Checks that q is NVFP4 with E2M1 elements and row-major scales (throws naming `what`).
Nvfp4View nvfp4_view(const DeviceQTensor& q, const char* what = "operand");

// Kernel choice, for tests and benchmarks. Tiles are M x 128 outputs per CTA on tensor cores.
// Gemv (decode, a few rows per weight): warps stream whole weight rows with 16-byte loads, the
// E2M1 codes become int8 (twice their value) in registers, X's rows (decoded once per CTA into
// shared memory) meet them in __dp4a dot products of 16-element blocks; a block's integer sum times
// the two block scales is exact in FP32 (|sum| < 2^12, scale product 8 bits), and those exact
// block terms are summed in FP32 per lane in K order, then over the lanes by a fixed shuffle tree.
// So the GEMV differs from the tile kernels only in the FP32 summation order, and an output's
// bits do not depend on M, on how many rows a CTA takes at once, or on a grouped call's grouping.
// It ignores `splits`. Auto picks the GEMV for M <= kGemvAutoMaxRows (kGemvAutoMaxRowsXFrag where X
// has fragments), Skinny up to
// kSkinnyDenseMaxRows (64), else M128 (with QUADS_W4A4_SKINNY=N for N < 64: M16W4 up to 32 rows,
// M16W4S3 where K <= 1024, M64 up to 64).
// M16 variants (same sums in the same order, so the same bits; they differ in warps per CTA and
// columns per CTA, i.e. in how many warps an SM has to hide the dequantization's latency):
// M16 16x128 with 2 warps of 16x64, M16W4 16x128 with 4 warps of 16x32, M16N64 16x64 with 2 warps
// of 16x32, M16W4S3 as M16W4 with 3 pipeline stages and at most 72 registers a thread, so that 7
// CTAs (28 warps) fit an SM instead of 5. bench_cuda --gemv compares them at decode shapes.
// Skinny (decode batches): the weight as the MMA's A operand, 16 weight rows a warp streamed into
// registers, X as the B operand (8 .. 64 rows at a time, dequantized once per CTA into shared
// memory); `splits` is the number of warps (1, 2, 4, 8) that share a row tile's K, 0 = choose;
// dense calls of more than 8 rows also split K over the CTAs of a thread-block cluster
// (`kcluster`, sm_90), their sums added in rank order through distributed shared memory, and
// calls of more than 32 rows split X's rows over CTAs (`row_block`).
// With one warp a tile and no cluster every output is M16's MMA chain with the operands' roles
// swapped, and the bits are M16's (one split). Auto takes it from kGemvAutoMaxRows + 1 rows per
// weight up to kSkinnyDenseMaxRows (dense) and kSkinnyAutoMaxRows (grouped: the bound on a group's
// rows, the decode batch). QUADS_W4A4_SKINNY=0 keeps Auto off it (=grouped: grouped calls only).
// Wg128 / Wg256 (sm_90 only, w4a4_wgmma.cu): 128 rows of X x 128 / 256 rows of W a CTA of two
// warpgroups, m64n128k16 wgmma with FP32 accumulators; the same products as M128 summed in wgmma's
// order (FP32 rounding apart, not the same bits). Auto takes Wg128 where it would take M128 (not
// for the RAC gather) when the device runs it; QUADS_W4A4_WGMMA=0 keeps M128, =256 takes Wg256.
enum class W4A4Tile : uint8_t { Auto, M16, M64, M128, Gemv, M16W4, M16N64, M16W4S3, Skinny, Wg128, Wg256 };
// Whether this build and device run the Wg tiles (sm_90: H100 / H200).
bool w4a4_wgmma_available();
struct W4A4Options {
  W4A4Tile tile = W4A4Tile::Auto;
  int splits = 0;  // K splits of the tile kernels; 0 = choose (enough CTAs to fill the GPU)
  // Skinny, dense: CTAs of a cluster that split K (1, 2, 4, 8); 0 = choose where splits is 0
  // (enough CTAs to cover the SMs), else 1.
  int kcluster = 0;
  // The GEMV and the skinny tiles (dense): W was not written by the kernel just before this call
  // in the stream, so its first weights may be loaded before that kernel ends (as
  // FusedAct::weights_ready; QUADS_GPU_SKINNY_EARLY=0 turns it off for the skinny tiles).
  bool weights_ready = false;
  // Skinny, dense: rows of X a CTA (16, 32 or 64; more rows split over the grid's rows of CTAs);
  // 0 = choose (16 above 16 rows, QUADS_SKINNY_ROWSPLIT=0 / 32 to change it). The bits do not
  // depend on it.
  int row_block = 0;
  // y's row stride (0: N); e.g. one projection's columns inside a fused q/k/v output.
  int64_t ldy = 0;
};

// Y (+)= X . W^T, emulated (any GPU from sm_80; tests and benchmarks use it on Hopper). K must be a
// multiple of 64. `accumulate` adds into y instead of overwriting it.
void w4a4_gemm_emulated(const Nvfp4View& x, const Nvfp4View& w, float* y, bool accumulate = false,
                        cudaStream_t stream = nullptr, const W4A4Options& opt = {});

// Phase stamps of the skinny tiles (`bench_cuda --skinny-trace`): with quads_cuda built with
// -DQUADS_SKINNY_TRACE in CMAKE_CUDA_FLAGS, each CTA of the skinny launches that follow writes
// skinny_trace_slots() values at buf + its linear index * that (see w4a4_skinny.cuh); nullptr
// stops it. False (and nothing written) in a build without the flag.
bool skinny_trace(unsigned long long* buf);
int skinny_trace_slots();

// RAC residual: Y (+)= Xr . W[:, S]^T where S is the list of W's 16-element blocks `blocks`
// (int32 device array, xr.k / 16 entries: block i of Xr multiplies W's block blocks[i]). Xr is the
// quantized residual of the selected blocks, compact [M, xr.k]; xr.k a multiple of 64 (pad the
// selection with zero blocks; their entries in `blocks` may be any valid index). W's k must be a
// multiple of 64.
void w4a4_gemm_gather(const Nvfp4View& xr, const Nvfp4View& w, const int32_t* blocks, float* y,
                      bool accumulate = true, cudaStream_t stream = nullptr, const W4A4Options& opt = {});

// One expert's NVFP4 weight [n, k] (device pointers), an entry of the grouped GEMM's device table.
struct Nvfp4Weight {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const float* amax = nullptr;  // 1 value, or n with w_amax_per_row
};

// Grouped (MoE experts, one launch): for every group e < groups, rows eoff[e] .. eoff[e+1] of X
// times W_e^T into the same rows of y [x.rows, n]. eoff (int32, groups + 1 entries) and w_table
// (groups entries) live on the device, so the host needs no group sizes (no sync): the grid covers
// max_rows rows per group (a host bound on eoff[e+1] - eoff[e], e.g. the token count) and tiles
// past a group's end exit at once; empty groups cost one CTA launch each per tile. Same kernels as
// w4a4_gemm_emulated. Tile kernels: `splits` K splits per expert (0: chosen from min(groups,
// x.rows) active experts, so that decode fills the GPU), partials summed in split order: each
// output is the same sum in the same order as a per-expert w4a4_gemm_emulated with the same tile
// and split count. GEMV (tile Gemv, or Auto with splits == 0 and few rows per expert, see
// gemv_auto_grouped): the grid covers min(groups, x.rows) non-empty groups (a CTA finds the j-th
// non-empty group in eoff) and loops over its group's rows; each output is bit for bit the
// per-expert w4a4_gemm_emulated with tile Gemv. Skinny (Auto for max_rows 2 .. kSkinnyAutoMaxRows
// with splits == 0): the same grid over non-empty groups, `splits` warps a row tile; each output
// is the per-expert w4a4_gemm_emulated with tile Skinny and the same splits, bit for bit.
// `splits` > 0 with Auto asks for the tile kernels (Auto then never picks the GEMV or Skinny).
// Every row of y must belong to a group (eoff[groups] == x.rows).
// Auto with splits == 0 and the same max_rows gives w4a4_gemm_grouped and
// w4a4_gemm_grouped_gather the same choice.
// plan_groups > groups: the call is a window of a call of plan_groups groups (eoff, w_table
// offset to the window's first group) and keeps that call's launch plan (the GEMV's and the
// skinny tiles' splits: the only kernels it may choose then), so each output has the same bits as
// in the whole call.
void w4a4_gemm_grouped(const Nvfp4View& x, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                       const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t stream = nullptr, int splits = 0,
                       W4A4Tile tile = W4A4Tile::Auto, int plan_groups = 0);

// w4a4_gemm_grouped (Auto, splits 0) with X read through a row map: row r of the grouped problem
// (eoff's rows, `rows` of them, y [rows, n]) is X's row x_map[r] / x_map_div (kern::gather_rows'
// idx / div: the MoE permutation and top-k), so the experts read the T token rows' codes without
// a gathered copy. Each output is w4a4_gemm_grouped's on the gathered rows, bit for bit. The
// GEMV at decode batch 1 and the skinny tiles (Auto's choices there) only: for max_rows and k
// where w4a4_grouped_mapped_supported says so. plan_groups: as w4a4_gemm_grouped's.
bool w4a4_grouped_mapped_supported(int64_t max_rows, int64_t k);
void w4a4_gemm_grouped_mapped(const Nvfp4View& x, const int32_t* x_map, int x_map_div, int64_t rows,
                              const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                              const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t stream = nullptr,
                              int plan_groups = 0);

// RAC on grouped experts (one launch for all experts' residual GEMMs, no host sync): y[r, :]
// (row stride ldy) += Xr[r] . W_e[:, S_e]^T for the rows r of group e (eoff as w4a4_gemm_grouped),
// where S_e is row e of `blocks` [groups, xr.k / 16] (W_e's 16-blocks; padding entries any valid
// index, their residual is zero). W_e is [n, w_k]. Every row of y must belong to a group. Kernel
// choice and bit-equality with the per-expert w4a4_gemm_gather as in w4a4_gemm_grouped.
void w4a4_gemm_grouped_gather(const Nvfp4View& xr, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n,
                              int64_t w_k, int groups, const int32_t* eoff, int64_t max_rows, const int32_t* blocks,
                              float* y, int64_t ldy, cudaStream_t stream = nullptr, int splits = 0,
                              W4A4Tile tile = W4A4Tile::Auto);

// Auto's choices (measured on the H200, bench_cuda --gemv), exposed for tests and benchmarks: the
// dense GEMV up to kGemvAutoMaxRows rows, the skinny tiles up to kSkinnyDenseMaxRows (4 rows:
// q/k/v 8.6 vs 9.6 us, o_proj 7.7 vs 10.3; 8 rows: 9.1 vs 12.3 for the 16-row tile; 16 / 32 / 64
// rows with a cluster's K split: q/k/v 9.6 / 12.4 / 19.5 vs the best tile's 13.8 / 19.4 / 24.8,
// o_proj 10.0 / 12.5 / 20.4 vs 10.6 / 13.7 / 20.1). Grouped: the GEMV at decode batch 1
// (gemv_auto_grouped), the skinny tiles for bounds up to kSkinnyAutoMaxRows (routed batch 4 / 16 /
// 64 gate/up 25 / 44 / 60 us against the GEMV's 42 / 98 and the tiles' 43 / 71 / 79).
constexpr int64_t kGemvAutoMaxRows = 3;
// With X as FP16 fragments (Nvfp4View::frag) the skinny tiles win from 3 rows: nvfp4 decode at
// batch 3 +2.6%, batch 2 even (H200, docs/cuda.md Part 28).
constexpr int64_t kGemvAutoMaxRowsXFrag = 2;
// The dense GEMV's bound as Auto applies it (QUADS_GEMV_AUTO_ROWS overrides both, for A/B runs).
int64_t gemv_auto_max_rows(bool xfrag);
constexpr int64_t kSkinnyAutoMaxRows = 64, kSkinnyDenseMaxRows = 64;
bool gemv_auto_grouped(int64_t max_rows, int64_t k);
// The GEMV's grid: one CTA per tile of weight rows (Off), or about one wave of CTAs that loop
// over the tiles (On: X is decoded once per CTA, and the weight loads run on from one tile into
// the next). Same bits either way. Auto (the default) takes the loop for dense and fused calls and
// for grouped calls with at most one row per group, not for the RAC gather. H200, graph-timed
// (bench_cuda --gemv): grouped batch 1 gate/up 12.9 -> 11.4 us, down 10.1 -> 8.6, fused 16.9 ->
// 14.5 and 14.0 -> 10.6; dense a tie at 1 and 4 rows, o_proj at 16 rows 25.4 -> 23.6; but plain
// grouped calls with more rows lose (routed batch 4 gate/up 41.1 -> 42.1, batch 16 99 -> 127).
// Read at each launch (a captured graph keeps its grid); QUADS_GEMV_TILE_LOOP=0 / 1 in the
// environment sets Off / On.
enum class GemvTileLoop : uint8_t { Auto, Off, On };
void set_gemv_tile_loop(GemvTileLoop mode);
GemvTileLoop gemv_tile_loop();

// ---- RAC folded into the main W4A4 GEMM (decode) ----
// y (+)= X . W^T + Xr_j . W^T, where Xr_j is RAC's quantized residual laid out densely over W's K
// (cuda::rac_quantize_fold: the compensated 16-blocks hold the residual's codes and scales, every
// other block is zero), so the residual term is RAC's Q(R[:, S]) . W[:, S]^T exactly and W's codes
// are read once for both products (w4a4_gemm_gather reads S's blocks a second time, in a second
// launch). The residual is a second set of rows of the B operand: the GEMV stages it beside X
// and keeps a second sum, the skinny tiles add it as more n-tiles; the main and residual sums
// each get their own global factors, then y = (y +) main + residual, in that order (the order of
// the main GEMM followed by the gather GEMM adding into y). Up to three residual operands for one
// call (a fused q/k/v or gate/up weight: operand j for W's rows from split[j - 1]); the splits must
// be multiples of 16 (a GEMV warp's rows and a skinny CTA's never straddle one: the skinny tiles
// split K over more warps where 128 rows a CTA would). Decode shapes only: Auto's GEMV and skinny
// tiles (w4a4_rac_fold_supported).
struct RacFold {
  const uint8_t* codes = nullptr;   // operand j: codes + j * rows * k / 2, [rows, k / 2]
  const uint8_t* scales = nullptr;  // operand j: scales + j * rows * k / 16 (row-major E4M3)
  const float* amax = nullptr;      // operand j: amax + j * rows, one per row
  int64_t rows = 0;                 // rows of each operand: the call's rows (grouped: all groups')
  int nops = 1;
  int64_t split[2] = {INT64_MAX, INT64_MAX};
};
// Whether the folded GEMM runs for this many rows per weight (a dense call's rows, a grouped
// call's max_rows) and K.
bool w4a4_rac_fold_supported(int64_t rows_per_weight, int64_t k, bool grouped);
void w4a4_gemm_rac(const Nvfp4View& x, const Nvfp4View& w, const RacFold& r, float* y, bool accumulate = false,
                   cudaStream_t stream = nullptr, const W4A4Options& opt = {});
// Grouped as w4a4_gemm_grouped (x read through x_map / x_map_div when x_map is set, as
// w4a4_gemm_grouped_mapped), y [rows, n] with row stride ldy (0: n); the residual rows are the
// problem's rows (no map).
void w4a4_gemm_grouped_rac(const Nvfp4View& x, const int32_t* x_map, int x_map_div, int64_t rows, const RacFold& r,
                           const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                           const int32_t* eoff, int64_t max_rows, float* y, int64_t ldy = 0,
                           cudaStream_t stream = nullptr);

// ---- The GEMV with the activation quantizer fused into it (decode) ----
// Y (+)= quantize(X) . W^T where X is given as FP32 rows and each CTA quantizes the rows it needs
// (NVFP4 E2M1 1x16, the config's per-row or static amax) in its prologue, straight into the GEMV's
// shared-memory operand: no codes in global memory, no quantize() launch, and the gather of MoE
// rows and the SwiGLU of the expert MLP happen in the same loads. The quantizer is quantize()'s
// row kernel step for step (cuda/quant_row.cuh), and the GEMV is W4A4Tile::Gemv, so y is bit for
// bit what (gather_rows / swiglu ->) quantize() -> w4a4_gemm_emulated / w4a4_gemm_grouped with
// tile Gemv give (tests/cuda/test_w4a4_fused.cpp).
// The rows of X (r < rows, K = k columns):
//   source row s = map ? map[r] / map_div : r   (map: int32 on the device; kern::gather_rows'
//                                               idx / div, e.g. the MoE permutation and top-k)
//   X[r][c] = x[s * ld + c], or with u: kern::swiglu1(x[s * ld + c], u[s * ld + c]) (the fused
//   gate/up product [R, 2I]: x = gu, u = gu + I, ld = 2I, k = I).
// x and u 16-byte aligned, ld a multiple of 4, and neither may alias y.
struct FusedAct {
  const float* x = nullptr;
  const float* u = nullptr;
  int64_t ld = 0;
  const int32_t* map = nullptr;
  int map_div = 1;
  int64_t rows = 0, k = 0;
  num::QConfig cfg;
  // Dense calls: the weights were not written by the kernel just before this one in the stream,
  // so the GEMV may start streaming them before that kernel has finished (programmatic dependent
  // launch; X and y are touched only after it). True for a model's decode graph, whose weights
  // change only between steps; leave false after a kernel that writes W (requantization).
  bool weights_ready = false;
};
// Rows per weight (a dense call's rows, a grouped call's max_rows) up to which a caller should
// take the fused GEMV. H200, graph-timed per call (bench_cuda --gemv), fused vs (gather_rows /
// swiglu +) quantize() + Auto at batch 1: q/k/v 10.3 -> 7.2 us (weights_ready), o_proj 12.4 ->
// 8.8, experts gate/up 17.9 -> 14.5, down 14.0 -> 10.6. At batch 4 it loses (q/k/v 13.0 vs 13.5,
// o_proj 15.5 vs 18.8, down 27.5 vs 43.5 against the tiles; gate/up ties): every CTA quantizes
// its 4 rows again. In the model (nvfp4 decode tok/s, two rounds, docs/cuda.md Part 20) a bound of
// 2 rows lost at batch 2 (2860, 2832 vs 2941, 3034) and 4 rows at batches 3-4 (3494 vs 3986 at 3).
constexpr int64_t kGemvFusedMaxRows = 1;
// True when the fused GEMV reproduces quantize() for act (NVFP4 E2M1 1x16, Global::PerRow or
// Static, no stochastic rounding), K is a multiple of 64 that fits the GEMV's shared memory, and
// 1 <= max_rows_per_weight <= kGemvFusedMaxRows. Otherwise: quantize() and the GEMM.
bool w4a4_gemv_fused_supported(const num::QConfig& act, int64_t k, int64_t max_rows_per_weight);
// Dense: y [x.rows, w.rows] (+)= X . W^T.
void w4a4_gemv_fused(const FusedAct& x, const Nvfp4View& w, float* y, bool accumulate = false,
                     cudaStream_t stream = nullptr);
// Grouped over experts as w4a4_gemm_grouped (eoff, w_table on the device, max_rows a host bound
// on a group's rows): rows eoff[e] .. eoff[e+1] of X times W_e^T into the same rows of y
// [x.rows, n]; x.weights_ready is ignored (the weight comes from the table, after eoff).
void w4a4_gemv_fused_grouped(const FusedAct& x, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n,
                             int groups, const int32_t* eoff, int64_t max_rows, float* y,
                             cudaStream_t stream = nullptr);

// out[m, 16 i + j] = x[m, 16 blocks[i] + j] for i < nsel, zeros up to out_cols (a multiple of 16):
// the compact input of w4a4_gemm_gather's quantizer.
void gather_blocks(const float* x, int64_t m, int64_t k, const int32_t* blocks, int64_t nsel, float* out,
                   int64_t out_cols, cudaStream_t stream = nullptr);

// The grouped twin: row r of group e (eoff, groups + 1 entries on the device) gathers the first
// nsel[e] blocks of row e of blocks [groups, out_cols / 16]; zeros after them.
void gather_blocks_grouped(const float* x, int64_t m, int64_t k, const int32_t* blocks, const int32_t* nsel,
                           int64_t out_cols, const int32_t* eoff, int groups, float* out,
                           cudaStream_t stream = nullptr);

// cuBLAS / cuBLASLt handles and workspace, one per stream user. Not thread-safe.
class Blas {
 public:
  Blas();
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// BF16 (raw bits) operands, FP32 accumulation and output, cuBLAS (tensor cores).
void gemm_bf16(Blas& blas, const uint16_t* x, const uint16_t* w, float* y, int64_t m, int64_t n, int64_t k,
               cudaStream_t stream = nullptr);

// FP8 E4M3 operands (codes [m, k] and [n, k]) with per-tensor dequantization scales (device
// float, as fscales of a per-tensor FP8 DeviceQTensor), FP32 output, cuBLASLt. k % 16 == 0.
void gemm_fp8(Blas& blas, const uint8_t* x, const float* x_scale, const uint8_t* w, const float* w_scale, float* y,
              int64_t m, int64_t n, int64_t k, cudaStream_t stream = nullptr);

// True on devices with native FP4 tensor cores that cuBLASLt drives (compute capability 10.x).
bool nvfp4_native_available();
// Native W4A4 through cuBLASLt: x and w NVFP4 E2M1 with scales in the Swizzled128x4 layout,
// per-tensor or per-row amax for x, per-tensor for w. Throws quads::Error where unavailable.
void w4a4_gemm_native(Blas& blas, const DeviceQTensor& x, const DeviceQTensor& w, float* y,
                      cudaStream_t stream = nullptr);

// The W4A4 GEMM a model should call: native where available (x and w swizzled), else emulated
// (x and w row-major).
void w4a4_gemm(Blas& blas, const DeviceQTensor& x, const DeviceQTensor& w, float* y, bool accumulate = false,
               cudaStream_t stream = nullptr);

}  // namespace quads::cuda
