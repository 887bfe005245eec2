#pragma once
// Supervised warm-up of the base model: a small Qwen3-MoE trained from scratch on the worked
// solutions of the generated tasks (cross-entropy on the solution and <eos>, not on the prompt),
// AdamW with linear warm-up and cosine decay to 10%. Float32 numerics; deterministic for a config.
//
// The result is a base checkpoint folder (config.json, model.safetensors, tokenizer.json) plus
// sft.json: the parts of the config that made it ([model], [sft], [tasks]), the final loss and the
// base pass@1 (greedy, fp32) on the evaluation set. `quads compare` reuses a folder whose sft.json
// matches the current config instead of training again.
#include <string>
#include <vector>

#include "rl/config.h"

namespace quads::rl {

struct SftResult {
  double final_loss = 0;  // mean over the last 10% of steps
  double pass1 = 0;       // base pass@1 on the evaluation set (fp32, greedy)
  double seconds = 0;
  bool cached = false;    // reused an existing folder
  std::vector<std::string> samples;  // a few evaluation prompts with the model's answer and verdict
};

// Trains and writes the checkpoint folder `dir` (created). Progress bar on stderr when `progress`.
SftResult run_sft(const RunConfig& cfg, const std::string& dir, bool progress = true);

// The folder's SFT result if its sft.json was made by the same [model], [sft] and [tasks] settings,
// else trains it (run_sft).
SftResult ensure_base(const RunConfig& cfg, const std::string& dir, bool progress = true);

}  // namespace quads::rl
