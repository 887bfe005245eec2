#pragma once
// THE quantization path. Every place in quads that rounds a tensor to a low-precision format
// (rollout weights at sync, online activations, the trainer's fake quantization for QAT, export,
// analysis, KV cache) calls these functions; nothing else rounds to E2M1/E4M3/E5M2/UE8M0.
//
// Tensors are row-major float32 [rows, cols]; blocks run along a row (the reduction dimension of
// a GEMM: for a weight W[out, in] a row is one output channel, for activations X[tokens, in] a
// row is one token).
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

// MXFP4 scale rule.
enum class MxRule : uint8_t {
  OcpFloor,  // OCP MX spec: e = floor(log2(amax)) - 2 (emax of E2M1); elements saturate
  TeCeil,    // TransformerEngine: e = ceil(log2(amax / 6)); never saturates
};

struct QConfig {
  Scheme scheme = Scheme::NVFP4;
  Block block = Block::B1x16;
  Global global = Global::PerTensor;
  Format element = Format::E2M1;  // NVFP4: E2M1 or E1M2; FP8: E4M3 or E5M2
  MxRule mx_rule = MxRule::OcpFloor;
  float static_amax = 0.f;        // with Global::Static
  bool stochastic = false;        // stochastic rounding of elements (gradients); scales stay RNE
  uint64_t seed = 0;              // with stochastic: the stream is a pure function of (seed, index)

  static QConfig nvfp4_act() { return {}; }  // 1x16, per-tensor global (TE); rollouts use PerRow
  static QConfig nvfp4_weight(bool block2d) {
    QConfig c; c.block = block2d ? Block::B16x16 : Block::B1x16; return c;
  }
  static QConfig mxfp4() { QConfig c; c.scheme = Scheme::MXFP4; c.block = Block::B1x32; return c; }
  static QConfig fp8(Block b) { QConfig c; c.scheme = Scheme::FP8; c.block = b; c.element = Format::E4M3; return c; }
  std::string describe() const;
};

// A quantized tensor. Layouts (row-major unless said):
//  NVFP4/MXFP4: codes = packed 4-bit, [rows, cols/2], element 2i in the low nibble.
//               scales = one byte per block, [rows, cols/block] (E4M3 for NVFP4, UE8M0 for MX).
//  FP8:         codes = one byte per element [rows, cols]; scales unused; fscales = float32
//               dequantization scales: 1 (PerTensor), rows (PerRow), rows*ceil(cols/128) (1x128),
//               ceil(rows/128)*ceil(cols/128) (128x128).
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

// cols must be a multiple of the block width for NVFP4 (16) and MXFP4 (32); FP8 blocks may be
// ragged. NVFP4 16x16 needs rows % 16 == 0. Hot-path functions do not scan for NaN/Inf: a NaN
// in a block makes that block's scale NaN (E4M3 0x7F) and its outputs NaN; use the *_checked
// variants on data from outside.
QTensor quantize(const float* x, int64_t rows, int64_t cols, const QConfig& cfg);
void dequantize(const QTensor& q, float* out);

// dequantize(quantize(x)) fused, bit-identical to the two-step path. Used for the trainer's
// fake-quantized weights (QAT) and online activations; out may alias x.
void fake_quantize(const float* x, float* out, int64_t rows, int64_t cols, const QConfig& cfg);

// Checked entry points: throw quads::Error naming `tensor_name` on NaN/Inf or bad shapes.
QTensor quantize_checked(const std::string& tensor_name, const float* x, int64_t rows, int64_t cols,
                         const QConfig& cfg);

// NVFP4 scale factors in the cuBLASLt / CUTLASS 128x4 swizzled layout: rows padded to 128,
// blocks padded to 4 (zero fill); returns the padded buffer.
std::vector<uint8_t> swizzle_scales_128x4(const uint8_t* scales, int64_t rows, int64_t nblocks);
std::vector<uint8_t> unswizzle_scales_128x4(const uint8_t* swizzled, int64_t rows, int64_t nblocks);

// NVFP4 decode scale for a global amax: amax / 2688 as ModelOpt stores `weight_scale_2`
// (the reciprocal of TE's S_enc with its clamps).
float nvfp4_global_decode_scale(float amax);

// Error statistics of a quantized tensor against its source (both [rows, cols]).
struct ErrorStats {
  double rel_mse = 0;      // sum (x-q)^2 / sum x^2
  double sqnr_db = 0;      // -10 log10(rel_mse) (inf when exact)
  double max_abs = 0;
  std::vector<double> channel_sq_err;  // per column: sum over rows of (x-q)^2
};
ErrorStats error_stats(const float* x, const float* xq, int64_t rows, int64_t cols,
                       bool per_channel = false);

}  // namespace quads::num
