#pragma once
// Quantizing a checkpoint's weights into the layouts inference engines load (docs/formats.md).
// For a weight NAME (2-D [rows, cols], usually "....weight"):
//   nvfp4 (NVIDIA ModelOpt, read by vLLM and TensorRT-LLM):
//     NAME          U8      [rows, cols/2]   E2M1 codes, element 2i in the low nibble
//     NAME_scale    F8_E4M3 [rows, cols/16]  block scales, row-major (not swizzled)
//     NAME_scale_2  F32     []               amax/2688, the per-tensor decode scale
//   mxfp4 (OCP MX):
//     NAME          U8      [rows, cols/2]   E2M1 codes, element 2i in the low nibble
//     NAME_scale    U8      [rows, cols/32]  UE8M0 exponents (2^(e-127))
//   fp8 (E4M3):
//     NAME          F8_E4M3 [rows, cols]
//     NAME_scale    F32     []               per-tensor dequantization scale (ModelOpt), or with
//     NAME_scale_inv F32    [ceil(rows/128), ceil(cols/128)]  (fp8_block = 128: DeepSeek-V3 style)
// Every code and scale comes from num::quantize; this file only lays them out. The output's
// __metadata__ keeps the input's entries and adds "quads.quantization" (the format) and, for
// nvfp4, "quads.nvfp4_amax.NAME" per weight (its global amax, printed to round-trip) so that our
// own reader rebuilds num::QTensor exactly: amax cannot be recovered bit-exactly from amax/2688.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "numerics/quantize.h"

namespace quads::io {

enum class CheckpointFormat : uint8_t { NVFP4, MXFP4, FP8 };

struct QuantizeOptions {
  CheckpointFormat format = CheckpointFormat::NVFP4;
  bool block2d = false;  // nvfp4: one scale per 16x16 tile (repeated on its 16 rows in NAME_scale)
  int fp8_block = 0;     // fp8: 0 = per-tensor scale, 128 = 128x128 blocks (NAME_scale_inv)
  std::string include;   // ECMAScript regex searched in the name; empty = every tensor
  std::string exclude;   // ECMAScript regex searched in the name; empty = none

  num::QConfig qconfig() const;
  std::string describe() const;  // "nvfp4", "nvfp4-2d", "mxfp4", "fp8", "fp8-block128"
};

// The metadata entry that holds weight NAME's NVFP4 global amax ("quads.nvfp4_amax.NAME"), and
// the value's spelling: 9 significant digits, which round-trip float32 and always take 14
// characters for a finite amax >= 0 (so a writer can reserve it before quantizing).
std::string nvfp4_amax_key(const std::string& name);
std::string format_nvfp4_amax(float amax);

// "nvfp4" | "mxfp4" | "fp8"; throws quads::Error otherwise.
CheckpointFormat parse_checkpoint_format(const std::string& s);

// What happens to one input tensor. Copy: not a candidate (name, rank or dtype) or filtered out;
// Unfit: a candidate whose shape the format cannot take, copied with a warning.
enum class Action : uint8_t { Quantize, Copy, Unfit };
struct TensorPlan {
  Action action;
  std::string reason;  // for Copy and Unfit
};
TensorPlan plan_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                       const QuantizeOptions& opt);

// The output tensors (names, dtypes, shapes) that stand for the quantized weight NAME.
std::vector<TensorSpec> quantized_specs(const std::string& name, int64_t rows, int64_t cols,
                                        const QuantizeOptions& opt);

// Quantizes x [rows, cols] (num::quantize_checked: NaN/Inf throw naming the tensor) and lays it
// out as the tensors of quantized_specs, in that order.
struct QuantizedWeight {
  num::QTensor q;
  std::vector<TensorData> tensors;
};
QuantizedWeight quantize_weight(const std::string& name, const float* x, int64_t rows, int64_t cols,
                                const QuantizeOptions& opt);

// The format a file was written in (from "quads.quantization", else guessed from the tensors:
// F32 NAME_scale_2 -> nvfp4, U8 NAME_scale -> mxfp4, F8_E4M3 weights -> fp8); false if none.
bool detect_checkpoint_format(const SafeTensorsFile& f, QuantizeOptions* opt);

// Rebuilds num::QTensor for the quantized weight NAME of `f` (checking dtypes and shapes and
// naming the file and tensor on any mismatch); num::dequantize of it then gives the weights the
// writer meant. For nvfp4 the amax comes from "quads.nvfp4_amax"; a file without it (written by
// ModelOpt) gets amax = scale_2 * 2688, which can be off by one ulp.
num::QTensor load_quantized_weight(const SafeTensorsFile& f, const std::string& name, const QuantizeOptions& opt);

// The names of the weights `f` holds in quantized form under `opt` (their NAME tensors).
std::vector<std::string> quantized_weight_names(const SafeTensorsFile& f, const QuantizeOptions& opt);

struct TensorReport {
  std::string name;
  DType dtype;                 // input dtype
  std::vector<int64_t> shape;  // input shape
  Action action;
  std::string reason;          // why copied (Copy / Unfit)
  num::ErrorStats stats;       // Quantize only: of num::dequantize against the input
  size_t out_bytes = 0;        // bytes this tensor takes in the output
};
struct QuantizeReport {
  std::vector<TensorReport> tensors;  // in input file order
  size_t in_bytes = 0, out_bytes = 0;  // file sizes
  int quantized = 0, copied = 0, unfit = 0;
};

// Reads `in`, quantizes the selected weights, copies everything else unchanged and writes `out`
// atomically (streaming: one tensor in memory at a time). `progress(done, total, bytes_done)` is
// called after each tensor when given.
QuantizeReport quantize_checkpoint(const std::string& in, const std::string& out, const QuantizeOptions& opt,
                                   const std::function<void(size_t, size_t, size_t)>& progress = {});

// Reopens `out` and checks it against `in` and the report: every copied tensor byte-identical,
// every quantized one with the layout's dtypes and shapes and decoding to the same error
// statistics, bit for bit, as when it was written. Throws quads::Error naming the tensor.
void verify_quantized_checkpoint(const std::string& in, const std::string& out, const QuantizeOptions& opt,
                                 const QuantizeReport& report);

}  // namespace quads::io
