#pragma once
// The run configuration of `quads sft`, `quads rl` and `quads compare`: a TOML file, then
// `--set key=value` overrides with dotted keys (`--set rl.lr=1e-3`). Every key is type-checked;
// an unknown key is an error naming the key and the file. The member initializers below ARE the
// built-in default, and configs/default.toml spells out the same values (a test checks they agree).
// docs/rl.md describes every key.
//
// Typical use:
//   RunConfig cfg = load_config(path_or_empty, overrides);   // "" = built-in default
//   save_resolved_config(cfg, run_dir);                      // config.toml + config.json
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "rl/grpo.h"
#include "rl/tasks.h"

namespace quads::rl {

struct ModelSection {
  int64_t hidden = 128;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 32;
  int64_t experts = 8;
  int64_t experts_per_token = 2;
  int64_t moe_intermediate = 128;
  int64_t max_seq_len = 128;  // prompt + response tokens, <bos> included
  double rope_theta = 10000.0;
  double rms_eps = 1e-6;
  double init_std = 0.02;
  bool operator==(const ModelSection&) const = default;
};

struct SftSection {
  int64_t steps = 600;
  double lr = 3e-3;
  int64_t batch = 32;
  int64_t warmup_steps = 30;
  double weight_decay = 0.0;
  double grad_clip = 1.0;
  bool operator==(const SftSection&) const = default;
};

struct RlSection {
  int64_t steps = 60;
  int64_t group_size = 8;        // G samples per prompt
  int64_t prompts_per_step = 8;
  double lr = 5e-5;
  double clip_eps_low = 0.2;     // ratio clipped to [1 - low, 1 + high]
  double clip_eps_high = 0.28;
  double kl_coef = 0.0;          // > 0: k3 penalty to the SFT model
  int64_t max_new_tokens = 64;
  double temperature = 1.0;      // rollouts for training
  double eval_temperature = 0.0; // 0: greedy pass@1
  int64_t eval_every = 10;       // steps; step 0 (the SFT model) is always evaluated
  int64_t eval_size = 128;
  double collapse_margin = 0.1;  // collapsed: final pass@1 < best pass@1 - margin
  int64_t checkpoint_every = 20;
  int64_t seed = 1;              // first seed; seed i of a comparison is seed + i
  int64_t seeds = 2;             // how many seeds per mode (the report gives mean ± std)
  std::string aggregation = "token_mean";  // token_mean | seq_mean | seq_sum_norm
  bool scale_adv_by_std = true;  // false: Dr. GRPO advantages
  bool tis = false;              // TIS in every mode (the nvfp4-tis mode has it regardless)
  double tis_cap = 2.0;
  int64_t minibatches = 1;       // optimizer steps per RL step
  double grad_clip = 1.0;
  bool routing_replay = false;   // trainer routes each token to the experts the rollout chose
  bool diagnostics = true;       // routing mismatch and per-layer activation error (extra forward)
  std::string device = "cpu";    // cpu | cuda: where the rollout engine runs
  int64_t decode_ahead = 8;      // decode steps a GPU rollout backend call (rollout::EngineOptions)
  std::string train_device = "auto";  // auto (= device) | cpu | cuda: where the trainer's forward,
                                      // backward and AdamW run
  std::string trainer_device() const { return train_device == "auto" ? device : train_device; }
  bool operator==(const RlSection&) const = default;
};

struct QuadsSection {
  double rac_ratio = 0.5;               // share of input channels given a residual correction
  std::string granularity = "block16";  // block16 (whole 16-channel blocks) | channel
  std::string rac_selection = "static"; // static (ranked on a calibration batch at each sync,
                                        // batch-invariant) | dynamic (per forward call, not)
  std::string residual_format = "nvfp4";     // nvfp4 | fp8 | bf16
  bool asymmetric_qat = true;           // trainer sees the rollout's quantized weights
  bool operator==(const QuadsSection&) const = default;
};

struct TasksSection {
  std::vector<std::string> families{"add", "mul", "countdown", "sort"};
  std::vector<int64_t> add_digits{2, 3};
  std::vector<int64_t> mul_digits{2};
  std::vector<int64_t> countdown_numbers{2, 3};
  std::vector<int64_t> sort_length{3, 4};
  int64_t seed = 1234;  // task seed: the same evaluation set for every mode and run seed
  bool operator==(const TasksSection&) const = default;
};

// Your own model and data (docs/quads.md, "Your own model and data"). With `model` empty the runs
// use the generated tasks and the SFT base, as before; with a model folder (HF checkpoint:
// config.json + safetensors + tokenizer.json, or a ModelOpt NVFP4 export) that folder is the base
// (no SFT) and the prompts come from the JSONL files, rewarded by rl::verify_math.
struct DataSection {
  std::string model;                     // checkpoint folder; empty: generated tasks
  std::string train;                     // JSONL of training prompts (needed with model)
  std::string eval;                      // JSONL of evaluation prompts; empty: held out from train
  double eval_split = 0.1;               // without eval: share of train held out (seeded by data.seed)
  std::string prompt_field = "prompt";   // "a.b" reaches into nested objects
  std::string answer_field = "answer";
  bool skip_bad_lines = false;           // false: a bad line is an error naming file:line
  std::string prompt_format = "auto";    // auto (chat when the tokenizer has <|im_start|>/<|im_end|>)
                                         // | chat | raw
  std::string system_prompt;             // chat format: an optional system turn
  int64_t max_prompt_tokens = 256;       // longer prompts: an error naming file:line, or skipped
  bool skip_long_prompts = false;
  bool score_truncated = false;          // false: a response without a stop token earns 0
  int64_t seed = 1234;                   // epoch shuffles and the held-out split
  bool operator==(const DataSection&) const = default;
};

// The error analysis of the base model that `quads compare` can run first (analysis/layers.h).
struct AnalysisSection {
  bool enabled = false;      // also: quads compare --analyze
  int64_t batches = 2;       // >= 2 for channel persistence
  int64_t batch_size = 8;    // prompts per batch
  int64_t max_len = 64;      // tokens per prompt at most
  int64_t topk = 16;
  bool operator==(const AnalysisSection&) const = default;
};

// Mode names the config accepts (their meaning: src/rl/modes.h). Keep in step with all_modes().
inline const std::vector<std::string>& known_modes() {
  static const std::vector<std::string> m{"bf16",     "fp8",      "nvfp4",   "nvfp4-tis", "quads",
                                          "qat-only", "rac-only", "qat-sym", "fp32"};
  return m;
}

struct RunConfig {
  std::vector<std::string> modes{"bf16", "fp8", "nvfp4", "nvfp4-tis", "quads", "qat-only", "rac-only"};
  ModelSection model;
  SftSection sft;
  RlSection rl;
  QuadsSection quads;
  TasksSection tasks;
  DataSection data;
  AnalysisSection analysis;
  bool operator==(const RunConfig&) const = default;
  bool uses_dataset() const { return !data.model.empty(); }

  // Conversions for the other modules.
  TaskMix task_mix() const;
  PgConfig pg_config() const;
  AdvantageConfig advantage_config() const;
};

// Parses TOML text on top of `base` (keys absent from the text keep base's values). `origin` (a file
// name) is named in every error, with the line of the offending key.
RunConfig parse_config(std::string_view toml_text, const std::string& origin, const RunConfig& base = {});
// "key=value": value is read as a TOML value (1e-3, true, "x", ["a", "b"]); for string keys a bare
// word is taken as the string, and for list keys a bare comma-separated list is accepted
// (modes=bf16,quads; tasks.add_digits=2,3).
void apply_override(RunConfig& cfg, std::string_view assignment);
// Range and enum checks; throws naming the key and `origin`.
void validate(const RunConfig& cfg, const std::string& origin);
// File (or the built-in default when path is empty), then overrides in order, then validate.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same with `adjust` applied after the overrides and before validation (command-line
// shortcuts such as --model/--data that set keys directly, paths with any characters).
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides,
                      const std::function<void(RunConfig&)>& adjust);

std::string to_toml(const RunConfig& cfg);  // parse_config(to_toml(c)) == c
nlohmann::json to_json(const RunConfig& cfg);
// Writes dir/config.toml and dir/config.json atomically (dir must exist).
void save_resolved_config(const RunConfig& cfg, const std::string& dir);
// Every dotted key in file order, e.g. "modes", "model.hidden", ..., "analysis.topk".
std::vector<std::string> config_keys();

}  // namespace quads::rl
