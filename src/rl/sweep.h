#pragma once
// The RAC ratio sweep that justifies quads.rac_ratio: on the base model, sample responses to
// training prompts (fp32 policy, so every setting scores the same tokens), then for each RAC
// granularity and ratio r in {0, 0.125, 0.25, 0.5, 1.0} score those tokens with the W4A4+RAC rollout
// model and with the trainer (asymmetric QAT and BF16) and report the log-prob gap (mean and
// per-batch max |gap|) together with the extra GEMM work RAC costs (residual GEMM FLOPs over main
// GEMM FLOPs of the compensated linears, r rounded to whole 16-channel blocks).
//   quads compare --rac-sweep --out DIR   (trains or reuses DIR/base; writes DIR/rac_sweep.json)
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rl/config.h"

namespace quads::rl {

struct SweepPoint {
  std::string granularity;  // "block16" | "channel"
  double ratio = 0;
  double extra_flops = 0;   // residual GEMM / main GEMM over the W4A4 linears
  double gap_qat_mean = 0, gap_qat_max = 0;    // rollout vs asymmetric-QAT trainer
  double gap_bf16_mean = 0, gap_bf16_max = 0;  // rollout vs BF16 trainer
};

std::vector<SweepPoint> rac_sweep(const RunConfig& cfg, const std::string& base_dir, int prompts = 32, int group = 4);
nlohmann::json sweep_json(const std::vector<SweepPoint>& pts);
std::string sweep_table(const std::vector<SweepPoint>& pts);

}  // namespace quads::rl
