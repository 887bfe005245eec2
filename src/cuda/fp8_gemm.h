#pragma once
// FP8 weights in the GPU rollout engine: the E4M3 codes [n, k] (one byte each) and the FP32
// dequantization scales of num::QTensor's FP8 layout stay on the device as they are; nothing keeps
// an FP32 copy of W_eff. Every kernel dequantizes a weight element exactly as num::dequantize does
// (value(code) * scale, one FP32 multiply), so W_eff is bit-identical to the CPU's and a GEMM
// differs from the CPU's FP32 GEMM of X_eff . W_eff^T only by its summation order.
//
//  - fp8_gemv / fp8_gemv_grouped (decode, few rows): a warp owns 4 weight rows and streams their
//    codes (8 per lane per step, 256 per warp, 4 steps in flight), dequantizes them in registers and multiplies them
//    with up to 8 FP32 activation rows at a time (1, 2, 4 or 8 by the rows known); each product rounded, then added (no FMA, as the
//    CPU built with -ffp-contract=off); lane partials meet in a fixed xor tree. The grouped form
//    takes MoE experts with the same device eoff / weight table machinery as
//    kern::gemm_f32_grouped (no host sync: decode steps stay CUDA graphs).
//  - fp8_gemm / fp8_gemm_grouped (W8A8, past a few rows): both operands as E4M3 codes + FP32
//    scales, tiles on the tensor cores (mma.sync m16n8k16, FP16 in, FP32 accumulate; E4M3 -> FP16
//    is exact). Per 128-wide K block the tile sums ca * cw (exact products, FP32 sums), then adds
//    that block sum times sa[row, kb] * sw[col, kb] into FP32 accumulators (DeepSeek-V3-style
//    promotion). Mathematically X_eff . W_eff^T; the rounding differs from the CPU's FP32 GEMM of
//    X_eff . W_eff^T only in order (the scales multiply block sums instead of each element), a
//    relative ~1e-7 per operation, within the summation bound of the tests. K % 16 == 0; a K tail
//    short of 128 is zero-filled. Split K sums its partials in split order (deterministic).
//  - fp8_dequantize: W_eff into an FP32 scratch (RAC's gathered columns, the SGEMM fallback
//    QUADS_GPU_FP8_TILES=0).
// Y[m, n] = X[m, k] . W[n, k]^T, row-major, FP32 output. k % 8 == 0; x rows 16-byte aligned.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/quant.h"

namespace quads::cuda {

// Where the scale of weight element (r, c) is: fscales[(r / bh) * ncb + (col_blocks ? c / 128 : 0)].
// PerTensor: bh = n, ncb = 1; PerRow: bh = 1, ncb = 1; 1x128: bh = 1; 128x128: bh = 128
// (ncb = ceil(k / 128) for both).
struct Fp8Layout {
  int64_t n = 0, k = 0;
  int64_t bh = 1, ncb = 1;
  bool col_blocks = false;
};

// One weight's device buffers (an entry of the grouped kernel's device table).
struct Fp8Weight {
  const uint8_t* codes = nullptr;
  const float* fscales = nullptr;
};

// An E4M3 activation operand [rows, k]: codes and scales, addressed as a weight's (Fp8Layout with
// n = rows; a per-tensor scale has bh = rows, so slices of rows keep reading fscales[0]).
struct Fp8Act {
  const uint8_t* codes = nullptr;
  const float* fscales = nullptr;
  Fp8Layout g;
};

// True for configurations these kernels run: FP8 with E4M3 elements, deterministic rounding, any
// block layout, k % 8 == 0.
bool fp8_weight_supported(const num::QConfig& cfg, int64_t k);
// The layout of an [n, k] weight in `cfg` (throws quads::Error naming `what` if unsupported).
Fp8Layout fp8_layout(const num::QConfig& cfg, int64_t n, int64_t k, const char* what = "weight");
// The buffers of a device FP8 tensor (checks its configuration and sizes, naming `what`).
Fp8Weight fp8_weight(const DeviceQTensor& q, const char* what = "weight");

// out [n, k] = W_eff (float32), bit-identical to num::dequantize.
void fp8_dequantize(const Fp8Weight& w, const Fp8Layout& g, float* out, cudaStream_t stream = nullptr);

// y [m, n] = x [m, k] . W_eff^T.
void fp8_gemv(const float* x, int64_t m, const Fp8Weight& w, const Fp8Layout& g, float* y,
              cudaStream_t stream = nullptr);

// MoE experts, one launch: for every group e < groups, rows eoff[e] .. eoff[e+1] of x times
// W_e^T (w_table[e], device table; every expert has layout g) into the same rows of y [*, g.n].
// eoff (groups + 1 int32) lives on the device; empty groups exit at once. max_rows: a host bound
// on any group's rows (e.g. the step's token count; it picks the kernel), 0 if none is known.
void fp8_gemv_grouped(const float* x, const Fp8Weight* w_table, const Fp8Layout& g, int groups, const int32_t* eoff,
                      int64_t max_rows, float* y, cudaStream_t stream = nullptr);

// The operand of a device FP8 tensor (E4M3, any block layout; checks sizes, naming `what`).
Fp8Act fp8_act(const DeviceQTensor& q, const char* what = "activation");
// Rows r0 .. r0+n of an operand (128x128 activation blocks need r0 % 128 == 0).
Fp8Act fp8_act_rows(const Fp8Act& x, int64_t r0, int64_t n);
// Scale count of a layout: ceil(n / bh) * ncb.
int64_t fp8_scale_count(const Fp8Layout& g);

enum class Fp8Tile : uint8_t { Auto, M16, M64, M128 };

// y [x.g.n, g.n] = X_eff . W_eff^T on tensor cores. x.g.k == g.k, k % 16 == 0. splits: K splits
// (0: picked from the tile count), tile: the CTA tile (Auto: by rows).
void fp8_gemm(const Fp8Act& x, const Fp8Weight& w, const Fp8Layout& g, float* y, cudaStream_t stream = nullptr,
              int splits = 0, Fp8Tile tile = Fp8Tile::Auto);

// MoE experts, one launch, as fp8_gemv_grouped: rows eoff[e] .. eoff[e+1] of x (x.g.n rows in all)
// times W_e^T (w_table[e]) into the same rows of y [*, g.n]; no host sync. max_rows: a host bound
// on any group's rows (the step's token count; sizes the grid and picks the tile), > 0.
void fp8_gemm_grouped(const Fp8Act& x, const Fp8Weight* w_table, const Fp8Layout& g, int groups,
                      const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t stream = nullptr, int splits = 0,
                      Fp8Tile tile = Fp8Tile::Auto);

}  // namespace quads::cuda
