#pragma once
// Helpers shared by the RL run tests.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rl/config.h"

namespace quads::test {

// A one-layer model that SFT teaches some one-digit additions in ~1 s, and 4 GRPO steps whose groups
// have varying rewards (a learning signal).
inline rl::RunConfig tiny_run_config() {
  rl::RunConfig c;
  c.model.hidden = 32;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.kv_heads = 1;
  c.model.head_dim = 16;
  c.model.experts = 4;
  c.model.experts_per_token = 2;
  c.model.moe_intermediate = 32;
  c.model.max_seq_len = 64;
  c.sft.steps = 120;
  c.sft.batch = 16;
  c.sft.warmup_steps = 10;
  c.rl.steps = 4;
  c.rl.group_size = 4;
  c.rl.prompts_per_step = 2;
  c.rl.max_new_tokens = 12;
  c.rl.eval_every = 2;
  c.rl.eval_size = 8;
  c.rl.checkpoint_every = 2;
  c.rl.lr = 1e-3;
  // One-digit additions: a tiny model learns to get some right, so rewards vary within groups.
  c.tasks.families = {"add"};
  c.tasks.add_digits = {1};
  return c;
}

// Metrics rows without their wall-clock keys (elapsed_s, t_*): what a bitwise-repeatable run must
// reproduce exactly.
inline std::vector<nlohmann::json> deterministic(std::vector<nlohmann::json> rows) {
  for (auto& r : rows) {
    std::vector<std::string> drop;
    for (auto& [k, v] : r.items())
      if (k == "elapsed_s" || k.rfind("t_", 0) == 0) drop.push_back(k);
    for (const auto& k : drop) r.erase(k);
  }
  return rows;
}

}  // namespace quads::test
