#pragma once
// The ReQAT experiment behind `quads reqat`:
//   base      a model trained on the tasks' worked solutions (or loaded from base.checkpoint)
//   traces    the base model's own correct greedy traces on training prompts (traces.source =
//             greedy) or the worked solutions of those prompts (solutions)
//   stage 1   full-precision fine-tuning on the traces
//   Q-FIT     calibrated on the stage-1 model with the first qfit.calib_sequences traces
//   stage 2   from the stage-1 weights, W4A4KV4 fake quantization (`qat-sym` linears + KV4 hooks,
//             straight-through), one run per variant:
//               plain_qat  worked solutions of other prompts (not trace-aligned), no SEM, no Q-FIT
//               taq        the stage-1 traces in the same order (same batch size and steps)
//               taq_sem    taq + SEM
//               reqat      taq + SEM + Q-FIT (fixed)
//   eval      greedy pass@1 on the held-out set in full precision, W4A4 (NVFP4 linears, float32
//             KV cache) and W4A4KV4, for base, stage 1 (PTQ = round-to-nearest of it), stage 1 +
//             Q-FIT (PTQ + Q-FIT) and every variant; the low-entropy divergence analysis for PTQ
//             (before) and ReQAT (after)
// Outputs in `out`: summary.json, report.md, metrics.jsonl/.csv, loss and entropy plots,
// config.toml/json, qfit.json, the checkpoints (base/, stage1/, <variant>/).
#include <string>

#include <nlohmann/json.hpp>

#include "reqat/config.h"

namespace quads::reqat {

struct RunOptions {
  bool progress = true;
  bool save_checkpoints = true;
};

// Runs everything and returns summary.json's content.
nlohmann::ordered_json run_reqat(const ReqatConfig& cfg, const std::string& out, const RunOptions& opt = {});

// report.md from a summary (and the resolved config's TOML).
std::string reqat_report(const nlohmann::ordered_json& summary, const std::string& config_toml,
                         const std::vector<std::string>& plots);

}  // namespace quads::reqat
