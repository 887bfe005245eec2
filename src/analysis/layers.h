#pragma once
// The error analysis behind QUADS (`quads analyze layers`, docs/analysis.md). For batches of
// prompts the trainer's forward (bf16 preset) is the reference. Two views:
//
// Local, per linear: on the reference input X of each quantized linear (the rows it sees in the
// bf16 forward), the output of each rollout variant is compared with the bf16 output
// Y = bf16(X)·W_bf16ᵀ:  rel_err = ||Y_v - Y||² / ||Y||², summed per decoder layer (numerator and
// denominator summed over the layer's linears and batches) and per projection kind.
//   w_only   X_bf16 · W_nvfp4ᵀ          (the weights' share)
//   a_only   Q_nvfp4(X) · W_bf16ᵀ       (the activations' share; per-token global scale)
//   w4a4     Q_nvfp4(X) · W_nvfp4ᵀ      (the engine's `nvfp4`)
//   w4a4_rac w4a4 + RAC (model/rac.h: static channels ranked on the first batch, ratio 0.5,
//            16-blocks, NVFP4 residual)
//   fp8      the engine's `fp8` (E4M3 128x128 weights, 1x128 activations)
// Activation channels: per linear kind and layer, the residual energy Σ_rows (X - Q(X))² per input
// channel, its top-k channels per batch, and how persistent they are: the Jaccard index of the
// top-k sets of batch 0 and batch b (mean over b >= 1).
//
// End to end: per-token log-prob gaps logp_v(t) - logp_bf16(t) of every variant model (the full
// forward in that precision, RAC channels from the first batch), mean |gap|, max |gap| and mean
// |gap| by the reference's next-token entropy (bins [0, .1), [.1, .5), [.5, 1), [1, 2), [2, inf) nats).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.h"

namespace quads::analysis {

struct LayersOptions {
  int topk = 16;             // channels per top-k set
  double rac_ratio = 0.5;    // RAC's share of compensated input channels
};

// The variants, in report order.
const std::vector<std::string>& layer_variants();  // w_only, a_only, w4a4, w4a4_rac, fp8

// `batches`: at least one (two or more for persistence). The weights are not changed. Returns the
// JSON report (schema in docs/analysis.md).
nlohmann::ordered_json analyze_layers(const model::Weights& w, const std::vector<model::Batch>& batches,
                                      const LayersOptions& opt = {});

// Per-token log-prob gaps of `variant` against `ref` logits over batch b (next-token targets,
// len-1 per sequence): mean, max |gap|, and per entropy bin.
nlohmann::ordered_json logprob_gaps(const model::Batch& b, const std::vector<float>& ref_logits,
                                    const std::vector<float>& var_logits, int vocab);

// Writes layers.json, summary.txt and (when gnuplot works) layer_error.png, w_vs_a.png and
// logp_gap_entropy.png into `dir`; returns the files written.
std::vector<std::string> write_layers_report(const nlohmann::ordered_json& report, const std::string& dir);

// The short text summary (also in summary.txt).
std::string layers_summary(const nlohmann::ordered_json& report);

}  // namespace quads::analysis
