#pragma once
// Linear layers in a precision mode. One code path serves the trainer and the rollout engine;
// what differs is a per-linear "numerics" setting:
//   weight quantizer: applied ONCE per sync, W_eff = dequantize(quantize(W)) (float32, kept);
//   activation quantizer: applied per call, X_eff = fake_quantize(X), one row per token;
//   Y = X_eff · W_effᵀ in float32 (exact emulation of W4A4 / FP8 / BF16 tensor-core GEMMs: the
//   products of the low-precision operands are exact in float32, only the accumulation rounds).
// Training uses straight-through gradients: dX = dY · W_eff (with activation quantization the STE
// passes dX through unchanged) and dW = dYᵀ · X_eff goes straight to the float32 master weights.
// The QAT weights are therefore bit-identical to what the rollout engine dequantizes.
#include <cstdint>
#include <string>
#include <vector>

#include "numerics/quantize.h"

namespace quads::model {

enum class QuantKind : uint8_t {
  None,   // float32 as is
  BF16,   // rounded to bfloat16 (num::bf16_round)
  Quant,  // num::fake_quantize with `cfg` (NVFP4, MXFP4, FP8)
};

struct OperandQuant {
  QuantKind kind = QuantKind::None;
  num::QConfig cfg;  // with kind == Quant

  static OperandQuant none() { return {}; }
  static OperandQuant bf16() { OperandQuant q; q.kind = QuantKind::BF16; return q; }
  static OperandQuant quant(const num::QConfig& c) { OperandQuant q; q.kind = QuantKind::Quant; q.cfg = c; return q; }
  bool operator==(const OperandQuant& o) const;
  bool operator!=(const OperandQuant& o) const { return !(*this == o); }
  std::string describe() const;  // "fp32", "bf16", or the QConfig
  // True if the rounding of row t depends only on row t (so a rollout stays batch-invariant).
  bool row_local() const;
};

struct LinearNumerics {
  OperandQuant weight;
  OperandQuant act;
  bool operator==(const LinearNumerics& o) const { return weight == o.weight && act == o.act; }
  std::string describe() const;  // "w=... a=..."
};

// The precision of a whole model. Presets (name: quantized linears / everything else):
//   fp32          fp32 / fp32
//   bf16          W bf16, A bf16 / bf16            (also the `bf16` trainer preset)
//   fp8           W E4M3 128x128 blocks, A E4M3 1x128 blocks / bf16
//   fp8-tensor    W and A E4M3 with one scale per tensor (A: of the current batch) / bf16
//   nvfp4         W NVFP4 1x16, A NVFP4 1x16 with a global scale per token / bf16
//   nvfp4-2d      as nvfp4 with 16x16 weight blocks
//   nvfp4-tensor  as nvfp4 with the activation global scale per tensor (current batch)
//   nvfp4-static  as nvfp4 with a static calibrated activation amax per linear (input_scale;
//                 set LinearQ::act_static_amax before the model runs, or QConfig::static_amax)
//   nvfp4-w4a16   W NVFP4 1x16, A bf16 / bf16
//   mxfp4         W and A MXFP4 (1x32, UE8M0, OCP rule) / bf16
//   qat           trainer, asymmetric: W NVFP4 1x16 exactly as `nvfp4` / A bf16; rest bf16
//   qat-sym       trainer: W and A exactly as `nvfp4`; rest bf16
// "Quantized linears" are q/k/v/o, expert gate/up/down and dense MLP gate/up/down; the router
// (mlp.gate) and lm_head use `high` unless quantize_router / quantize_lm_head; embeddings and
// norms are never quantized.
struct PrecisionConfig {
  std::string name = "fp32";
  LinearNumerics quant;   // linears selected by `filter` (and not in the last keep_last_high layers)
  LinearNumerics high;    // all other linears
  std::string filter;     // PCRE2 regex searched in the module name, e.g. "mlp\\.experts"; empty: all
  int keep_last_high = 0; // the last N decoder layers stay in `high` ("keep the last N in BF16")
  bool quantize_router = false;
  bool quantize_lm_head = false;

  static PrecisionConfig preset(const std::string& name);  // throws listing the presets
  static std::vector<std::string> preset_names();
  // The numerics of one linear. `module` is the HF module name ("model.layers.3.self_attn.q_proj",
  // "model.layers.3.mlp.gate", "lm_head"); `layer` its decoder layer or -1.
  LinearNumerics for_linear(const std::string& module, int layer, int num_layers) const;
  // True if every linear's activation rounding is row-local (see OperandQuant::row_local).
  bool batch_invariant() const;
  std::string describe() const;
};

// One linear layer: its master weight (by offset into the model's Weights), its numerics and
// quantized state. W_eff lives in the model's effective-weight buffer at the same offset.
struct LinearQ {
  std::string name;           // HF module name (the tensor is name + ".weight")
  int layer = -1;             // decoder layer, -1 for lm_head
  int64_t out = 0, in = 0;
  size_t offset = 0;          // of the [out, in] weight in the flat buffers
  LinearNumerics num;
  float act_static_amax = 0;  // Global::Static activations: calibrated amax (0: use num.act.cfg.static_amax)
  num::QTensor wq;            // the quantized weight of the last sync (weight.kind == Quant): codes,
                              // scales, global amax, for export or for uploading to a GPU backend

  // Residual activation compensation (RAC, model/rac.h; applied after the GEMM): input channels S
  // whose quantization residual r = X - X_eff gets a second GEMM, y += Q_rac(r[:, S]) · W_eff[:, S]ᵀ.
  // Empty = off. The channel choice is made at sync time; `rac_quant` rounds the residual.
  std::vector<int32_t> rac_channels;
  OperandQuant rac_quant;
  // Dynamic RAC (model/rac.h; not batch-invariant): when rac_dynamic_count > 0, every forward call
  // ranks the input channels on its own rows and compensates the top rac_dynamic_count of them
  // (whole 16-channel blocks when rac_dynamic_block16) instead of rac_channels.
  int32_t rac_dynamic_count = 0;
  bool rac_dynamic_block16 = true;

  // The activation quantizer actually applied (static amax filled in).
  num::QConfig act_cfg() const;
};

// W_eff = the weight quantizer applied to w [out, in] (written to w_eff; wq receives the codes).
void quantize_weight(LinearQ& L, const float* w, float* w_eff);

// X_eff[M, in] = the activation quantizer applied to X (a copy when act.kind == None).
void quantize_act(const LinearQ& L, const float* X, int64_t M, float* x_eff);

}  // namespace quads::model
