#pragma once
// ReQAT's 4-bit KV cache and Q-FIT, as model::KvHooks.
//
// KV-cache quantization: K and V rows of one token and one kv head ([head_dim] values) are split
// into 16-element blocks along head_dim, one E4M3 scale per block, elements on the E1M2 grid
// (0..3.5 in steps of .5, ReQAT's choice) or E2M1 (NVFP4). Keys are quantized after RoPE and after
// the Q-FIT shift, values as produced; queries, softmax and the attention output stay float32.
// The cache then holds the fake-quantized values (dequantize(quantize(x))), so the trainer (same
// hook, straight-through gradient) and the rollout engine (Model::step through the cache) see the
// same numbers.
//
// Second-level scale: one FP32 global amax PER ROW (per token and head), num::Global::PerRow.
// Why not per tensor: a per-tensor amax would depend on the other tokens of the batch, so a
// token's cached K/V would change with what it was batched with (no batch invariance, and the
// cache would have to be re-quantized when new tokens raise the amax). Why not none (global 1):
// E4M3 block scales then have to cover the raw magnitudes (keys after RMSNorm ~1, values anywhere
// from 1e-3 to 1e2): small values land in E4M3's subnormals and lose scale precision. The per-row
// amax costs one float per 16-32 bytes of codes, and makes each row's largest block use the full
// E4M3 range (its scale is exactly 448).
//
// Q-FIT (quantization-friendly initialization), per layer, computed once before QAT:
//  (a) pre-RoPE scaling: s[g, j] = max |K[t, g, j]| over calibration tokens (after k_norm, before
//      RoPE), made equal for the two channels RoPE rotates together (j and j + hd/2) so that the
//      scaling commutes with the rotation; keys are divided by s^alpha and the queries of the heads
//      that read kv head g multiplied by s^alpha: q·k is unchanged.
//  (b) post-RoPE key shift: every key loses m = beta * mean(K_rot) (mean over calibration tokens of
//      the scaled, rotated keys, per kv head and channel): q·(k - m) = q·k - q·m is the same for
//      every key of one query, so the softmax is unchanged.
//  (alpha, beta) per layer: grid search over grid x grid (default {0, .05, ..., .95}^2) minimizing
//  the MSE between the float32 attention output and the output with K and V fake-quantized, on
//  calibration sequences.
// Where the scale lives: Qwen3 applies q_norm/k_norm per head BEFORE RoPE, so it cannot be folded
// into k_proj. The q/k norm weights are shared by all heads, so folding there would force one scale
// for every kv head; and they are trained in stage 2, which would move it. We keep an EXPLICIT
// per-(kv head, channel) factor applied in the pre_rope hook (and its transpose in
// pre_rope_backward), fixed during QAT — it costs hd multiplies per head per token.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.h"
#include "numerics/quantize.h"
#include "train/backend.h"

namespace quads::reqat {

struct KvQuantConfig {
  bool enabled = true;
  num::Format element = num::Format::E1M2;  // E1M2 or E2M1
  // NVFP4-style: 1x16 blocks, E4M3 scales, per-row global amax (see above).
  num::QConfig qconfig() const;
  std::string describe() const;  // "kv4 e1m2" / "off"
};
// "e1m2" | "e2m1" | "off" (throws naming `what`).
KvQuantConfig parse_kv_quant(const std::string& name, const std::string& what = "kv");

// Q-FIT parameters of one layer. Empty `scale` = no scaling, empty `shift` = no shift.
struct QFitLayer {
  double alpha = 0, beta = 0;
  std::vector<float> scale;  // [nkv * hd]: s (max|K|, equal on j and j + hd/2)
  std::vector<float> shift;  // [nkv * hd]: mean of the rotated, scaled calibration keys
  double mse_plain = 0;      // calibration MSE at alpha = beta = 0 (KV quantization alone)
  double mse_best = 0;       // at the chosen (alpha, beta)
};

struct QFit {
  std::vector<QFitLayer> layers;  // one per decoder layer (or empty: identity)
  bool empty() const { return layers.empty(); }
  nlohmann::json to_json() const;  // parameters and MSEs (vectors included)
  static QFit from_json(const nlohmann::json& j, int num_layers, int64_t kv_dim, const std::string& origin);
};

// The transform as data (model::KvTransform: Q-FIT factors s^alpha and shifts beta * mean, the KV
// quantizer), the form a GPU step backend takes. Same checks as make_kv_hooks.
model::KvTransform make_kv_transform(const model::ModelConfig& cfg, const KvQuantConfig& kv, const QFit* qfit);
// The hooks for a model with config `cfg`: Q-FIT (when qfit is non-null and non-empty) and KV
// fake quantization (when kv.enabled). Throws when head_dim is not a multiple of 16 (with KV
// quantization) or the Q-FIT sizes do not match the config.
model::KvHooks make_kv_hooks(const model::ModelConfig& cfg, const KvQuantConfig& kv, const QFit* qfit);
// The hooks that run transform t (checked against cfg: model::KvTransform::validate).
model::KvHooks make_kv_hooks(const model::ModelConfig& cfg, const model::KvTransform& t);
// m.kv_hooks = make_kv_hooks(m.config(), kv, qfit).
void install_kv_hooks(model::Model& m, const KvQuantConfig& kv, const QFit* qfit);

// Per-layer inputs of attention (train::AttentionInputs): q [T, nh, hd] and k [T, nkv, hd] after
// q_norm/k_norm (before RoPE), v [T, nkv, hd]; positions restart at 0 in every sequence.
using AttnCapture = train::AttentionInputs;
// Runs m.forward on `calib` with capturing hooks (the model's own kv_hooks are restored after).
AttnCapture capture_attention_inputs(model::Model& m, const model::Batch& calib);

struct QFitOptions {
  std::vector<double> alphas, betas;  // empty: {0, 0.05, ..., 0.95}
  KvQuantConfig kv;                   // the quantizer whose error is minimized
};
// The grid of one layer: mse[ia * betas.size() + ib].
struct QFitGrid {
  std::vector<double> alphas, betas, mse;
};

// Attention-output MSE of layer `l` of a capture under (alpha, beta): float32 attention vs the
// attention with Q-FIT applied and K, V fake-quantized. `scale` is the layer's s. shift_out: the
// mean of the rotated, scaled keys (QFitLayer::shift).
double qfit_attention_mse(const model::ModelConfig& cfg, const AttnCapture& cap, int l, const std::vector<float>& scale,
                          double alpha, double beta, const KvQuantConfig& kv, std::vector<float>* shift_out = nullptr);
// The host's train::TrainBackend::attention_mse: layer l's MSE under each candidate transform.
std::vector<double> attention_mse_cpu(const model::ModelConfig& cfg, const AttnCapture& cap, int l,
                                      const std::vector<train::KvCandidate>& cands, const num::QConfig* kv);

// Q-FIT on calibration sequences (run in m's current precision, normally float32). grids (if
// non-null) receives every layer's grid.
QFit calibrate_qfit(model::Model& m, const model::Batch& calib, const QFitOptions& opt,
                    std::vector<QFitGrid>* grids = nullptr);
// The same search with the capture and every layer's grid of attention MSEs on a trainer backend
// (the GPU: a forward and ~grid^2 attentions a layer); the scales, shifts and the choice are made
// here as above. Equals the CPU's calibration up to the backend's rounding of the MSEs.
QFit calibrate_qfit(train::TrainBackend& dev, const model::ModelConfig& cfg, const model::Batch& calib,
                    const QFitOptions& opt, std::vector<QFitGrid>* grids = nullptr);

}  // namespace quads::reqat
