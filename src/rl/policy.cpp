#include "rl/policy.h"

#include <filesystem>

#include "common/error.h"
#include "train/losses.h"

namespace quads::rl {

model::ModelConfig model_config(const ModelSection& m, const CharTokenizer& tok) {
  model::ModelConfig c;
  c.vocab_size = (tok.vocab_size() + 7) / 8 * 8;
  c.hidden_size = static_cast<int>(m.hidden);
  c.num_hidden_layers = static_cast<int>(m.layers);
  c.num_attention_heads = static_cast<int>(m.heads);
  c.num_key_value_heads = static_cast<int>(m.kv_heads);
  c.head_dim = static_cast<int>(m.head_dim);
  c.num_experts = static_cast<int>(m.experts);
  c.num_experts_per_tok = static_cast<int>(m.experts_per_token);
  c.moe_intermediate_size = static_cast<int>(m.moe_intermediate);
  c.intermediate_size = static_cast<int>(m.moe_intermediate * m.experts_per_token);  // unused: every layer is MoE
  c.decoder_sparse_step = 1;
  c.norm_topk_prob = true;  // Qwen3-MoE's setting
  c.rms_norm_eps = m.rms_eps;
  c.rope_theta = m.rope_theta;
  c.max_position_embeddings = static_cast<int>(m.max_seq_len);
  c.tie_word_embeddings = false;
  c.raw = nlohmann::json::object();
  c.validate("[model] section");
  return c;
}

void save_base(const std::string& dir, const model::Weights& w, const CharTokenizer& tok) {
  std::filesystem::create_directories(dir);
  w.save(dir);
  tok.save(dir + "/tokenizer.json");
}

BaseModel load_base(const std::string& dir) {
  QUADS_CHECK(std::filesystem::exists(dir + "/config.json"), "base model {}: config.json is missing", dir);
  QUADS_CHECK(std::filesystem::exists(dir + "/tokenizer.json"),
              "base model {}: tokenizer.json is missing (a checkpoint of `quads sft` has one)", dir);
  BaseModel b{model::Weights::load(dir), CharTokenizer::load(dir + "/tokenizer.json")};
  QUADS_CHECK(b.weights.cfg.vocab_size >= b.tok.vocab_size(),
              "base model {}: the embedding has {} rows but the tokenizer has {} tokens", dir, b.weights.cfg.vocab_size,
              b.tok.vocab_size());
  return b;
}

EvalResult evaluate(rollout::RolloutEngine& eng, const std::vector<Task>& tasks, const CharTokenizer& tok,
                    int64_t max_new_tokens, double temperature, uint64_t seed) {
  std::vector<rollout::Request> reqs(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    rollout::Request& r = reqs[i];
    r.prompt = tok.encode_prompt(tasks[i].prompt);
    r.max_new_tokens = static_cast<int>(max_new_tokens);
    r.stop_ids = {tok.eos_id()};
    r.sampling.temperature = temperature;
    r.sampling.greedy = temperature == 0.0;
    if (r.sampling.greedy) r.sampling.temperature = 1.0;
    r.seed = seed + i;
  }
  std::vector<rollout::Result> res = eng.generate(reqs);
  std::vector<Verdict> v(tasks.size());
  EvalResult out;
  for (size_t i = 0; i < tasks.size(); ++i) {
    v[i] = verify_ids(tasks[i], res[i].tokens, tok);
    out.outcomes.push_back(v[i].outcome);
    out.responses.push_back(tok.decode(res[i].tokens));
    out.generated += static_cast<int64_t>(res[i].tokens.size());
  }
  out.score = score(tasks, v);
  out.seconds = eng.stats().seconds;
  return out;
}

int64_t Sequences::response_tokens() const {
  int64_t n = 0;
  for (int s = 0; s < batch.nseq(); ++s) n += response_len(s);
  return n;
}

Sequences pack_results(const std::vector<rollout::Result>& results) {
  Sequences s;
  for (const auto& r : results) {
    s.batch.add(r.ids());
    s.prompt_len.push_back(static_cast<int64_t>(r.prompt.size()));
  }
  return s;
}

std::vector<float> response_logprobs(const Sequences& s, const float* logits, int64_t V, double temperature) {
  const int64_t T = s.batch.ntokens();
  std::vector<int32_t> targets(T, -1);
  for (int q = 0; q < s.batch.nseq(); ++q) {
    const int64_t p0 = s.batch.offsets[q] + s.prompt_len[q];
    for (int64_t p = p0; p < s.batch.offsets[q + 1]; ++p) targets[p - 1] = s.batch.tokens[p];
  }
  std::vector<float> scaled;
  if (temperature != 1.0) {
    scaled.resize(static_cast<size_t>(T) * V);
    const float inv = static_cast<float>(1.0 / temperature);
    for (size_t i = 0; i < scaled.size(); ++i) scaled[i] = logits[i] * inv;
    logits = scaled.data();
  }
  std::vector<float> all(T);
  train::token_logprobs(logits, T, V, targets.data(), all.data());
  std::vector<float> out;
  out.reserve(s.response_tokens());
  for (int64_t t = 0; t < T; ++t)
    if (targets[t] >= 0) out.push_back(all[t]);
  return out;
}

}  // namespace quads::rl
