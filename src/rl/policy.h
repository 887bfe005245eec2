#pragma once
// What `quads sft`, `quads rl` and `quads compare` share: the model built from the [model] section,
// the base checkpoint folder (HF weights + the character tokenizer), pass@1 evaluation through the
// rollout engine, and the packing of prompt + response sequences.
#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"
#include "rl/char_tokenizer.h"
#include "rl/config.h"
#include "rl/tasks.h"
#include "rollout/engine.h"

namespace quads::rl {

// The Qwen3-MoE configuration of the [model] section for a tokenizer (the embedding table is the
// vocabulary rounded up to a multiple of 8).
model::ModelConfig model_config(const ModelSection& m, const CharTokenizer& tok);

// A base checkpoint folder: config.json + model.safetensors (Weights::save), tokenizer.json.
struct BaseModel {
  model::Weights weights;
  CharTokenizer tok;
};
void save_base(const std::string& dir, const model::Weights& w, const CharTokenizer& tok);
BaseModel load_base(const std::string& dir);  // errors name the folder and the missing file

// pass@1 on `tasks`: one sample per prompt (greedy when temperature == 0), stop at <eos>, at most
// max_new_tokens, verified by verify_ids. Sample i uses seed `seed + i`.
struct EvalResult {
  EvalScore score;
  std::vector<std::string> responses;  // decoded (up to the end token)
  std::vector<Outcome> outcomes;
  double seconds = 0;
  int64_t generated = 0;
};
EvalResult evaluate(rollout::RolloutEngine& eng, const std::vector<Task>& tasks, const CharTokenizer& tok,
                    int64_t max_new_tokens, double temperature, uint64_t seed = 0);

// Prompt + response sequences, packed.
struct Sequences {
  model::Batch batch;
  std::vector<int64_t> prompt_len;  // per sequence (the response starts there)
  // Position in the packed batch of response token j of sequence s: batch.offsets[s] + prompt_len[s] + j.
  int64_t response_len(int s) const { return batch.seq_len(s) - prompt_len[s]; }
  int64_t response_tokens() const;
};
Sequences pack_results(const std::vector<rollout::Result>& results);

// log p(response tokens) from logits [T, V] of the packed batch, divided by `temperature` first
// (the sampler's policy), in response order: sum of response lengths values. Each value is
// train::token_logprobs of the row before the token.
std::vector<float> response_logprobs(const Sequences& s, const float* logits, int64_t V, double temperature);

}  // namespace quads::rl
