#pragma once
// Exporting a quads checkpoint for other inference stacks (docs/export.md), and reading the NVFP4
// export back.
//
//   hf:    config.json + model.safetensors (or shards + model.safetensors.index.json), F32 or BF16,
//          per-expert names: Weights::save.
//   nvfp4: the NVIDIA ModelOpt NVFP4 layout that vLLM (quantization "modelopt"/"modelopt_fp4")
//          and TensorRT-LLM load. For every quantized linear MODULE:
//            MODULE.weight          U8      [out, in/2]   E2M1 codes, element 2i in the low nibble
//            MODULE.weight_scale    F8_E4M3 [out, in/16]  block scales
//            MODULE.weight_scale_2  F32     []            weight amax / (6*448)
//            MODULE.input_scale     F32     []            calibrated activation amax / (6*448)
//          Everything else (embeddings, norms, the routers, lm_head) in BF16 (or F32), listed as
//          excluded modules in hf_quant_config.json and in config.json's quantization_config.
//          The weight codes come from io::quantize_weight, the code `quads quantize` uses, which
//          is num::quantize with the weight quantizer of the engine's `nvfp4` preset.
//
// Exact round trip: amax/2688 does not always give the amax back bit-exactly, so the file's
// __metadata__ also records "quads.nvfp4_amax.<tensor>" for every weight and input_scale (a
// checkpoint from ModelOpt lacks them; its amaxes are then scale*2688).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/model.h"
#include "numerics/quantize.h"

namespace quads::io {

enum class ExportFormat : uint8_t { HF, NVFP4 };
ExportFormat parse_export_format(const std::string& s);  // "hf" | "nvfp4"

struct ExportOptions {
  ExportFormat format = ExportFormat::HF;
  bool bf16 = false;                         // tensors kept in high precision: BF16 instead of F32
  size_t max_shard_bytes = size_t(5) << 30;  // above this, shards + model.safetensors.index.json
  // nvfp4: the precision preset whose `quant` linears are quantized (its weight quantizer must be
  // NVFP4 1x16 with a per-tensor global scale: nvfp4, nvfp4-static, nvfp4-tensor, nvfp4-w4a16, qat).
  std::string precision = "nvfp4";
  // nvfp4: calibrated activation amax per module (from calibrate_input_amax); a quantized module
  // missing here gets no input_scale (then engines must quantize activations dynamically).
  std::map<std::string, float> input_amax;
  std::string producer_version = "quads-0.1";
};

struct ExportReport {
  std::vector<std::string> files;  // written, relative to the output folder
  int quantized = 0;               // linears stored as NVFP4
  std::vector<std::string> excluded;
  size_t bytes = 0;                // of the weight files
};

// Writes `w` to `dir` in the chosen format (files atomically) and copies the tokenizer files found
// in `tokenizer_dir` (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.json,
// merges.txt, generation_config.json, chat_template.jinja; empty = none).
ExportReport export_checkpoint(const model::Weights& w, const std::string& dir, const ExportOptions& opt,
                               const std::string& tokenizer_dir = "");

// Runs `m` on the prompts (packed in one batch per call to m.forward, `batch_tokens` at most) and
// returns each linear's input amax: max |X| over every row the linear saw (experts only see their
// routed tokens). A linear that saw no row (an expert never chosen) gets the largest amax of its
// layer's experts of the same projection, or 0 when none saw a row.
std::map<std::string, float> calibrate_input_amax(model::Model& m, const std::vector<std::vector<int32_t>>& prompts,
                                                  int64_t batch_tokens = 4096);

// A ModelOpt NVFP4 checkpoint read back: float32 weights (the quantized linears hold their
// dequantized values, which are exactly what the engine's W_eff holds) and, per quantized module,
// its codes and scales and the calibrated input amax (0 if the file has no input_scale).
struct LinearState {
  num::QTensor wq;
  float input_amax = 0;
};
struct Nvfp4Checkpoint {
  model::Weights weights;
  std::map<std::string, LinearState> linears;  // by module name ("model.layers.0.self_attn.q_proj")
  std::vector<std::string> exclude_modules;    // from hf_quant_config.json
  std::string producer;
};
Nvfp4Checkpoint load_nvfp4_checkpoint(const std::string& dir);

// True if `dir` holds a ModelOpt-style quantized checkpoint (hf_quant_config.json, or a
// config.json whose quantization_config has quant_method "modelopt").
bool is_modelopt_checkpoint(const std::string& dir);

// Activation global scale of the rollout precision built by make_nvfp4_model.
enum class ActScale : uint8_t { PerToken, Static };

// Sets up `m` (a Model over ck.weights, any preset) to run the checkpoint the way the engine's
// nvfp4 (PerToken) or nvfp4-static (Static, from the file's input_scale) mode runs the original
// weights: for every module of ck.linears the weight quantizer becomes "none" (the dequantized
// weights are already exact), the activation quantizer NVFP4 1x16 with the chosen global scale,
// LinearQ::wq the file's codes; every other linear keeps the preset's `high` numerics (bf16 for
// the nvfp4 presets). Calls m.sync(). Throws naming the module if Static and it has no input_scale.
void apply_nvfp4_checkpoint(model::Model& m, const Nvfp4Checkpoint& ck, ActScale act);

// The engine's nvfp4-static mode on `m` (built with an NVFP4 preset such as "nvfp4"): every linear
// with an NVFP4 activation quantizer switches to Global::Static with its calibrated amax from
// `input_amax` (throws naming a linear without one), then m.sync(). Model cannot be constructed
// with the nvfp4-static preset directly: its constructor syncs before any amax can be set.
void use_static_input_scales(model::Model& m, const std::map<std::string, float>& input_amax);

}  // namespace quads::io
