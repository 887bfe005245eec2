#pragma once
// Where the prompts of an RL run come from and how responses are scored (rl/run.h): either the
// generated tasks with the character tokenizer and the SFT base (GeneratedTasks, the default), or
// a model folder with its HF tokenizer and JSONL datasets scored by rl::verify_math
// (DatasetTasks, the [data] section). The run loop only sees token ids:
//
//   src = make_task_source(cfg, base_dir)            // loads the model and the data
//   for step s: problems = src->train_batch(seed, s, P)
//               rollouts from problems[i].prompt, stopping at src->stop_ids()
//               reward_i = src->verify(problems[i / G], response_ids).reward
//   eval: src->eval_set() greedily, the same verify
//
// Determinism: train_batch is a pure function of (run seed, step, P) and of the data, so a run
// resumes from its step counter alone.
//
// Dataset prompts (docs/quads.md): with prompt_format "chat" (or "auto" and a tokenizer that has
// <|im_start|> and <|im_end|>) a prompt is io::chat_prompt(prompt, system) encoded, i.e.
//   <|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n
// and generation stops at <|im_end|>, <|endoftext|> and the config's eos_token_id; with "raw" the
// prompt text is encoded as it is and generation stops at eos_token_id (or <|endoftext|>).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/dataset.h"
#include "io/tokenizer.h"
#include "model/weights.h"
#include "rl/char_tokenizer.h"
#include "rl/config.h"
#include "rl/tasks.h"
#include "rollout/engine.h"

namespace quads::rl {

// One prompt to solve: its token ids and which item of the source it is.
struct Problem {
  std::vector<int32_t> prompt;
  int64_t item = 0;                  // DatasetTasks: example index; GeneratedTasks: task index
  std::shared_ptr<const Task> task;  // GeneratedTasks: the task itself
};

// The score of a source's evaluation set: pass@1 and, per group (task family; a dataset has
// none), pass@1 and size, with the outcome counts.
struct SourceScore {
  double pass1 = 0;
  int n = 0;
  std::vector<std::string> group_names;
  std::vector<double> group_pass1;
  std::vector<int> group_count;
  int outcome_count[5] = {0, 0, 0, 0, 0};  // indexed by Outcome
};

class TaskSource {
 public:
  virtual ~TaskSource() = default;

  // The P training problems of step `step` of the run with seed `seed`.
  virtual std::vector<Problem> train_batch(int64_t seed, int64_t step, int P) const = 0;
  virtual const std::vector<Problem>& eval_set() const = 0;
  // `response` are the generated ids (prompt excluded), possibly ending with a stop id.
  virtual Verdict verify(const Problem& p, std::span<const int32_t> response) const = 0;
  // Response text up to (not including) the first stop id.
  virtual std::string decode(std::span<const int32_t> response) const = 0;
  virtual const std::vector<int32_t>& stop_ids() const = 0;
  // Fixed token sequences for ranking static RAC channels (the same at every sync).
  virtual std::vector<std::vector<int32_t>> calibration(int n) const = 0;
  // pass@1 over eval_set() from its verdicts (same order), with the per-group breakdown.
  virtual SourceScore score(std::span<const Verdict> verdicts) const = 0;
  // What the run used (recorded in the run folder as data.json); a dataset lists its skipped
  // lines under "skipped" ("train set: file:line: reason", the first 100 per file).
  virtual nlohmann::json describe() const = 0;
};

// The generated tasks (rl/tasks.h) with the base folder's character tokenizer. Bitwise the
// prompts, rewards and calibration batch the run loop used before sources existed.
class GeneratedTasks : public TaskSource {
 public:
  GeneratedTasks(const RunConfig& cfg, CharTokenizer tok);
  std::vector<Problem> train_batch(int64_t seed, int64_t step, int P) const override;
  const std::vector<Problem>& eval_set() const override { return eval_; }
  Verdict verify(const Problem& p, std::span<const int32_t> response) const override;
  std::string decode(std::span<const int32_t> response) const override;
  const std::vector<int32_t>& stop_ids() const override { return stop_; }
  std::vector<std::vector<int32_t>> calibration(int n) const override;
  SourceScore score(std::span<const Verdict> verdicts) const override;
  nlohmann::json describe() const override;

 private:
  Problem problem(const Task& t, int64_t item) const;
  TaskSet tasks_;
  CharTokenizer tok_;
  std::vector<int32_t> stop_;
  std::vector<Problem> eval_;
};

// JSONL prompts with an HF tokenizer, rewarded by verify_math on the decoded response.
class DatasetTasks : public TaskSource {
 public:
  // `model_cfg` gives eos_token_id and the vocabulary size the prompt ids must fit.
  DatasetTasks(const DataSection& d, int64_t eval_size, const model::ModelConfig& model_cfg, io::Tokenizer tok);
  std::vector<Problem> train_batch(int64_t seed, int64_t step, int P) const override;
  const std::vector<Problem>& eval_set() const override { return eval_; }
  Verdict verify(const Problem& p, std::span<const int32_t> response) const override;
  std::string decode(std::span<const int32_t> response) const override;
  const std::vector<int32_t>& stop_ids() const override { return stop_; }
  std::vector<std::vector<int32_t>> calibration(int n) const override;
  SourceScore score(std::span<const Verdict> verdicts) const override;
  nlohmann::json describe() const override;

  bool chat() const { return chat_; }
  size_t train_size() const { return train_.size(); }
  // The answer of a problem's example.
  const std::string& answer(const Problem& p) const;
  // The training example indices of step `step` (what train_batch encodes).
  std::vector<size_t> train_indices(int64_t seed, int64_t step, int P) const;

 private:
  struct Item {
    std::vector<int32_t> prompt;
    std::string text;  // the prompt as in the file
    std::string answer;
    std::string where;  // "file:line"
  };
  std::vector<Item> load(const std::string& path, const char* role, size_t* skipped_bad, size_t* skipped_long);
  DataSection d_;
  io::Tokenizer tok_;
  bool chat_ = false;
  int64_t vocab_ = 0;
  std::vector<int32_t> stop_;
  std::vector<Item> items_;       // train items first, then eval items
  std::vector<size_t> train_;     // indices into items_
  std::vector<Problem> eval_;     // item = index into items_
  nlohmann::json info_;
};

// The base model and task source of a run: with cfg.data.model empty, load_base(base_dir) and the
// generated tasks; otherwise the model folder (Weights::load, so NVFP4 exports too) with its
// tokenizer.json and the [data] datasets (base_dir is ignored).
struct RunInputs {
  model::Weights weights;
  std::unique_ptr<TaskSource> source;
  std::string base_dir;  // the folder the weights came from
};
RunInputs load_run_inputs(const RunConfig& cfg, const std::string& base_dir);

// Greedy (temperature 0) or sampled pass@1 of `src`'s evaluation set with `eng`; sample i uses
// seed `seed + i`.
struct SourceEval {
  SourceScore score;
  std::vector<std::string> responses;
  std::vector<Verdict> verdicts;
  int64_t generated = 0;
};
SourceEval evaluate_source(rollout::RolloutEngine& eng, const TaskSource& src, int64_t max_new_tokens,
                           double temperature, uint64_t seed);

}  // namespace quads::rl
