#pragma once
// THE quantization path. Every place in quads that rounds a tensor to a low-precision format
// (rollout weights at sync, online activations, the trainer's fake quantization for QAT, export,
// analysis, KV cache) calls these functions; nothing else rounds to E2M1/E4M3/E5M2/UE8M0.
//
// Tensors are row-major float32 [rows, cols]; blocks run along a row (the reduction dimension of
// a GEMM: for a weight W[out, in] a row is one output channel, for activations X[tokens, in] a
// row is one token). docs/numerics.md describes every layout.
//
// NVFP4 (bit-exact with TransformerEngine's kernel; every step one float32 operation, RNE):
//   amax  = max|x| over the global group (tensor, row, or QConfig::static_amax)
//   S_enc = (448*G)/amax, clamped to FLT_MAX; 1 when amax == 0 or S_enc == 0;  S_dec = 1/S_enc
//   sf    = e4m3_satfinite(block_amax * (S_enc * fp32(1/G)))    one byte per block
//   enc   = min(1 / (float(sf) * S_dec), FLT_MAX)
//   code  = grid_rne_satfinite(x * enc)                           element 2i in the low nibble
//   x'    = value(code) * ((float(sf) * amax) * fp32(1/(448*G)))  (dequantize)
// G is the element grid's max: 6 for E2M1 (448*6 = 2688), 3.5 for E1M2 (448*3.5 = 1568), so a
// block's largest element lands on the grid's top either way.
//
// MXFP4: 32-element blocks, UE8M0 scale X = 2^e, code = e2m1_rne_satfinite(x / X), x' = v * X.
//   MxRule::OcpFloor (default): e = floor(log2(amax)) - 2, the OCP MX v1.0 rule. It is the spec,
//     what hardware converters and published MXFP4 checkpoints use, so codes exported from quads
//     mean the same thing elsewhere. The block max lands in [4, 8)*X, so values in (6X, 8X)
//     saturate to 6X (the spec accepts that clipping).
//   MxRule::TeCeil: e = ceil(log2(amax * fp32(1/6))) (TransformerEngine's rule): never clips,
//     but the block max lands in (3, 6]*X, a coarser grid for the rest of the block.
//   amax == 0 gives e = -127 (code 0); a non-finite amax gives the NaN scale 0xFF.
//
// FP8: scale = amax / fmax (fmax 448 for E4M3, 57344 for E5M2; amax == 0, or an amax so small
//   that the quotient underflows to 0, gives scale 1), code = e4m3_satfinite(x / scale),
//   x' = value(code) * scale. We DIVIDE by the scale rather than multiply by a precomputed
//   reciprocal: the division is one correctly rounded operation, so the code is the rounding of
//   the exact quotient (x = amax maps to exactly fmax or saturates to it), and it matches the
//   PyTorch reference quantizers of FP8 rollout stacks (vLLM per-token-group quant, DeepSeek's
//   act_quant: y = x / s). The reciprocal adds a second rounding that moves values across
//   midpoints (tests/numerics show such inputs).
//
// NaN / Inf in the hot path (quantize, fake_quantize): nothing scans for them. Amaxes are taken
// over |x| bit patterns in which NaN is larger than +inf, so a NaN poisons its whole amax group:
//   NVFP4: every scale of the group is NaN (E4M3 0x7F) and every dequantized value NaN (codes
//          are unspecified). An Inf without NaN gives S_enc = 1; its block's scale saturates
//          to 448 and the group's dequantized values become ±inf or NaN.
//   MXFP4: a block with NaN or Inf gets the NaN scale 0xFF; its values dequantize to NaN.
//   FP8:   the scale of the group becomes NaN or inf; its values dequantize to NaN.
// Nothing crashes and results stay deterministic. Data from outside goes through
// quantize_checked, which throws quads::Error naming the tensor and the first bad element.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "numerics/formats.h"

namespace quads::num {

enum class Scheme : uint8_t {
  NVFP4,  // E2M1 elements (or E1M2 for the KV cache), E4M3 scale per 16, FP32 global scale
  MXFP4,  // E2M1 elements, UE8M0 scale per 32
  FP8,    // E4M3 elements, FP32 scales (per tensor, per row, or per block)
};

enum class Block : uint8_t {
  B1x16,      // NVFP4 activations and weights
  B16x16,     // NVFP4 2-D weight tiles: one amax per tile, its scale repeated for the 16 rows
  B1x32,      // MXFP4
  PerTensor,  // FP8: one scale
  PerRow,     // FP8: one scale per row (per token / per output channel)
  B1x128,     // FP8 activations (DeepSeek-style blockwise)
  B128x128,   // FP8 weights
};

// NVFP4's second-level (FP32) scale: the amax it is derived from.
enum class Global : uint8_t {
  PerTensor,  // amax of the whole tensor (TransformerEngine's default)
  PerRow,     // amax per row: for activations, per token, which keeps rollouts batch-invariant
  Static,     // a calibrated amax given in QConfig::static_amax (ModelOpt's input_scale)
};

// MXFP4 scale rule (see the top of this file; OcpFloor is the default).
enum class MxRule : uint8_t {
  OcpFloor,  // OCP MX spec: e = floor(log2(amax)) - 2 (emax of E2M1); elements saturate
  TeCeil,    // TransformerEngine: e = ceil(log2(amax / 6)); never saturates
};

struct QConfig {
  Scheme scheme = Scheme::NVFP4;
  Block block = Block::B1x16;
  Global global = Global::PerTensor;  // NVFP4 only; B16x16 needs PerTensor or Static
  Format element = Format::E2M1;  // NVFP4: E2M1 or E1M2; MXFP4: E2M1; FP8: E4M3 or E5M2
  MxRule mx_rule = MxRule::OcpFloor;
  float static_amax = 0.f;        // with Global::Static
  bool stochastic = false;        // stochastic rounding of 4-bit elements (gradients); scales
                                  // stay RNE. NVFP4 and MXFP4 only.
  uint64_t seed = 0;              // with stochastic: the stream is a pure function of
                                  // (seed, row * cols + col)

  static QConfig nvfp4_act() { return {}; }  // 1x16, per-tensor global (TE); rollouts use PerRow
  static QConfig nvfp4_weight(bool block2d) {
    QConfig c; c.block = block2d ? Block::B16x16 : Block::B1x16; return c;
  }
  static QConfig mxfp4() { QConfig c; c.scheme = Scheme::MXFP4; c.block = Block::B1x32; return c; }
  static QConfig fp8(Block b) { QConfig c; c.scheme = Scheme::FP8; c.block = b; c.element = Format::E4M3; return c; }
  // NVFP4 with E1M2 elements and per-row (per-token) global scale: ReQAT's KV cache.
  static QConfig nvfp4_kv() {
    QConfig c; c.element = Format::E1M2; c.global = Global::PerRow; return c;
  }

  // Short names for configuration files and the command line:
  //   nvfp4 | nvfp4-row | nvfp4-2d | nvfp4-e1m2 | nvfp4-kv (e1m2, per-row) | mxfp4 | mxfp4-te |
  //   fp8 (per tensor) | fp8-row | fp8-1x128 | fp8-128x128 | fp8-e5m2 (per tensor)
  // Throws quads::Error listing the names on anything else.
  static QConfig parse(const std::string& name);
  std::string describe() const;  // e.g. "nvfp4 e2m1 1x16 global=per-row"
};

// Elements per scale block along a row: 16 (NVFP4), 32 (MXFP4), 128 (FP8 blockwise), cols for
// FP8 per-tensor/per-row (returns 0: "the whole row").
int block_width(const QConfig& cfg);

// A quantized tensor. Layouts (row-major unless said):
//  NVFP4/MXFP4: codes = packed 4-bit, [rows, cols/2], element 2i in the low nibble.
//               scales = one byte per block, [rows, cols/block] (E4M3 for NVFP4, UE8M0 for MX;
//               NVFP4 16x16 repeats each tile's scale on its 16 rows).
//  FP8:         codes = one byte per element [rows, cols]; scales unused; fscales = float32
//               dequantization scales: 1 (PerTensor), rows (PerRow), rows*ceil(cols/128) (1x128),
//               ceil(rows/128)*ceil(cols/128) (128x128), row-major.
//  amax:        NVFP4 global amax: 1 value (PerTensor/Static) or one per row (PerRow).
struct QTensor {
  QConfig cfg;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
  std::vector<float> fscales;
  std::vector<float> amax;
  size_t nbytes() const { return codes.size() + scales.size() + 4 * (fscales.size() + amax.size()); }
};

// Throws quads::Error (naming `what`) unless cfg is a valid combination and [rows, cols] fits it:
// cols a multiple of 16 (NVFP4) or 32 (MXFP4); rows % 16 == 0 for NVFP4 16x16; FP8 blocks may
// be ragged. quantize/fake_quantize call it too (the check is O(1)).
void check_config(const QConfig& cfg, int64_t rows, int64_t cols, const std::string& what = "tensor");

// OpenMP over rows / blocks; results never depend on the thread count or the schedule.
QTensor quantize(const float* x, int64_t rows, int64_t cols, const QConfig& cfg);
// The same into an existing QTensor, reusing its buffers (weight sync re-quantizes the same
// shapes every step; fresh multi-MB buffers cost a page fault per 4 KiB and a zero fill).
void quantize_into(QTensor& q, const float* x, int64_t rows, int64_t cols, const QConfig& cfg);
void dequantize(const QTensor& q, float* out);
// Rows [r0, r1) of dequantize(q), written to out[(r - r0) * cols + c].
void dequantize_rows(const QTensor& q, int64_t r0, int64_t r1, float* out);

// dequantize(quantize(x)) fused, bit-identical to the two-step path. Used for the trainer's
// fake-quantized weights (QAT) and online activations; out may alias x.
void fake_quantize(const float* x, float* out, int64_t rows, int64_t cols, const QConfig& cfg);

// Checked entry points: throw quads::Error naming `tensor_name` on NaN/Inf or bad shapes.
QTensor quantize_checked(const std::string& tensor_name, const float* x, int64_t rows, int64_t cols,
                         const QConfig& cfg);
void fake_quantize_checked(const std::string& tensor_name, const float* x, float* out, int64_t rows,
                           int64_t cols, const QConfig& cfg);

// NVFP4 scale factors in the cuBLASLt / CUTLASS 128x4 swizzled layout: rows padded to 128,
// blocks padded to 4 (zero fill); returns the padded buffer of
// round_up(rows, 128) * round_up(nblocks, 4) bytes. Scale (m, kb) goes to
//   ((m/128)*Kt + kb/4)*512 + (m%32)*16 + ((m%128)/32)*4 + kb%4,   Kt = padded blocks / 4.
std::vector<uint8_t> swizzle_scales_128x4(const uint8_t* scales, int64_t rows, int64_t nblocks);
std::vector<uint8_t> unswizzle_scales_128x4(const uint8_t* swizzled, int64_t rows, int64_t nblocks);

// NVFP4 global scales for a global amax, with TE's clamps (G = 6 for E2M1, 3.5 for E1M2):
// encode = S_enc = (448*G)/amax as above; decode = S_dec = 1/S_enc, the factor a GEMM applies to
// its output (cuBLASLt's alpha). ModelOpt stores weight_scale_2 = amax/2688, which can differ
// from S_dec in the last bit; dequantize follows TE's order (see the top of this file).
float nvfp4_global_encode_scale(float amax, Format element = Format::E2M1);
float nvfp4_global_decode_scale(float amax, Format element = Format::E2M1);

// Error statistics of a quantized tensor against its source (both [rows, cols]). Sums are in
// double, combined in a fixed order (bitwise repeatable for any thread count).
struct ErrorStats {
  double rel_mse = 0;      // sum (x-q)^2 / sum x^2 (0 when both are 0, inf when only x is 0)
  double sqnr_db = 0;      // -10 log10(rel_mse) (inf when exact)
  double max_abs = 0;      // max |x - q|
  double sq_err = 0, sq_norm = 0;  // sum (x-q)^2 and sum x^2: each row summed in column order, then the rows
  std::vector<double> channel_sq_err;   // per column: sum over rows of (x-q)^2
  std::vector<double> channel_sq_norm;  // per column: sum over rows of x^2 (for relative ranking)
};
ErrorStats error_stats(const float* x, const float* xq, int64_t rows, int64_t cols,
                       bool per_channel = false);
// error_stats(x, fake_quantize(x, cfg)).
ErrorStats quant_error(const float* x, int64_t rows, int64_t cols, const QConfig& cfg,
                       bool per_channel = false);

// Tests and benchmarks: the AVX2 kernels are used when the build has AVX2 and this is on (the
// default); off forces the portable scalar kernels (which are always compiled).
bool simd_available();
void set_simd_enabled(bool on);

}  // namespace quads::num
