#pragma once
// Configuration of `quads reqat`: a TOML file on top of the built-in default (the member
// initializers below; configs/reqat.toml spells out the same values and a test checks that they
// agree), then `--set key=value` overrides with dotted keys. Unknown keys are errors naming the key
// and the file. docs/reqat.md describes every key.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "rl/config.h"

namespace quads::reqat {

// The base model: the RL helper's SFT (rl::ensure_base) with these settings as its [sft] section,
// in folder `dir` ("" = OUT/base); a folder whose sft.json was made by the same [model], [sft] and
// [tasks] settings is reused instead of trained (e.g. the RL comparison's base, with steps/lr/batch/
// warmup set to its [sft] values).
struct BaseSection {
  std::string dir;
  int64_t steps = 400;
  double lr = 3e-3;
  int64_t batch = 16;
  int64_t warmup = 20;
};

struct TracesSection {
  std::string source = "greedy";  // greedy: the base model's own correct greedy traces; solutions: worked solutions
  int64_t prompts = 512;          // training prompts the traces are drawn from (greedy keeps the correct ones)
};

struct StageSection {
  int64_t steps = 80;
  double lr = 1e-3;
  int64_t batch = 16;
  int64_t warmup = 10;
};

struct SemSection {
  double lambda = 0.1;
  double percentile = 0.75;
  double eps = 1e-6;
};

struct QFitSection {
  int64_t calib_sequences = 32;  // traces used for calibration
  int64_t grid = 20;             // alpha, beta in {0, 1/grid, ..., (grid-1)/grid}
};

struct EvalSection {
  int64_t size = 128;
  int64_t max_new_tokens = 48;
  double low_entropy = 0.5;  // nats: "low-entropy" token in the divergence analysis
  std::string device = "cpu";  // cpu | cuda: where the evaluation rollouts and the greedy traces run
};

// Stage-2 variants: plain_qat (QAT on different data: worked solutions of fresh prompts, no SEM,
// no Q-FIT), taq (QAT on the stage-1 traces in the same order), taq_sem (+ SEM), reqat (+ Q-FIT).
inline const std::vector<std::string>& known_variants() {
  static const std::vector<std::string> v{"plain_qat", "taq", "taq_sem", "reqat"};
  return v;
}

// The default is sized for 2 CPU cores: a smaller model (hidden 64, head_dim 16, 4 experts) than
// the RL comparison's, and the easiest add and sort levels only (at this compute a base model
// learns nothing of the harder ones: pass@1 0 on add 2-3 digits / sort 3-4 after 400 steps).
inline rl::ModelSection reqat_default_model() {
  rl::ModelSection m;
  m.hidden = 64;
  m.head_dim = 16;
  m.experts = 4;
  m.moe_intermediate = 64;
  return m;
}
inline rl::TasksSection reqat_default_tasks() {
  rl::TasksSection t;
  t.families = {"add", "sort"};
  t.add_digits = {1, 2};
  t.sort_length = {2, 3};
  return t;
}

struct ReqatConfig {
  std::vector<std::string> variants{"plain_qat", "taq", "taq_sem", "reqat"};
  std::string kv_format = "e1m2";  // e1m2 | e2m1
  int64_t seed = 1;
  std::string train_device = "cpu";  // cpu | cuda: where the base SFT, stage 1 and stage 2 train
  rl::ModelSection model = reqat_default_model();
  BaseSection base;
  TracesSection traces;
  StageSection stage1;
  StageSection stage2{80, 3e-4, 16, 10};
  SemSection sem;
  QFitSection qfit;
  EvalSection eval;
  rl::TasksSection tasks = reqat_default_tasks();
};

// TOML text on top of `base`; `origin` is named in errors (with the line).
ReqatConfig parse_reqat_config(std::string_view toml_text, const std::string& origin, const ReqatConfig& base = {});
void apply_reqat_override(ReqatConfig& cfg, std::string_view assignment);  // "stage2.lr=1e-4"
void validate(const ReqatConfig& cfg, const std::string& origin);
ReqatConfig load_reqat_config(const std::string& path, const std::vector<std::string>& overrides = {});
std::string to_toml(const ReqatConfig& cfg);  // parse_reqat_config(to_toml(c)) == c
nlohmann::json to_json(const ReqatConfig& cfg);
bool operator==(const ReqatConfig& a, const ReqatConfig& b);

}  // namespace quads::reqat
