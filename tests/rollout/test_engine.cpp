#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/fixtures.h"
#include "model/model.h"
#include "rollout/engine.h"
#include "train/losses.h"

using namespace quads;
using rollout::Request;
using rollout::Result;
using rollout::RolloutEngine;

namespace {

const std::string kFixture = "/tiny_qwen3moe_a";

const model::Weights& fixture_weights() {
  static const model::Weights w = model::Weights::load(fixtures_dir() + kFixture);
  return w;
}

// The modes the issue lists; all of them scale activations per token, so all are batch-invariant.
const std::vector<std::string> kModes = {"fp32", "bf16", "fp8", "nvfp4", "nvfp4-w4a16", "mxfp4"};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same(const Result& a, const Result& b, const std::string& what) {
  EXPECT_EQ(a.tokens, b.tokens) << what;
  EXPECT_TRUE(same_bits(a.logprobs, b.logprobs)) << what << ": log-probs differ";
  EXPECT_EQ(a.finish, b.finish) << what;
}

std::vector<int32_t> make_prompt(int len, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back((i * 131 + salt * 977 + 7) % 512);
  return p;
}

// A mix of prompt lengths and sampling settings, each with its own seed.
std::vector<Request> mixed_requests() {
  std::vector<Request> r(5);
  const int lens[] = {8, 3, 37, 1, 20};
  for (int i = 0; i < 5; ++i) {
    r[i].prompt = make_prompt(lens[i], i);
    r[i].max_new_tokens = 10 + 3 * i;
    r[i].seed = 1000 + i;
  }
  r[0].sampling.temperature = 1.0;
  r[1].sampling.temperature = 0.7;
  r[1].sampling.top_p = 0.9;
  r[2].sampling.greedy = true;
  r[3].sampling.temperature = 1.3;
  r[3].sampling.top_k = 20;
  r[4].sampling.temperature = 0.9;
  r[4].sampling.top_k = 50;
  r[4].sampling.top_p = 0.95;
  return r;
}

}  // namespace

TEST(RolloutEngine, GreedyMatchesTransformers) {
  std::ifstream f(fixtures_dir() + kFixture + "/greedy.json");
  ASSERT_TRUE(f) << "missing greedy.json";
  const nlohmann::json j = nlohmann::json::parse(f);
  Request r;
  r.prompt = j["prompt"].get<std::vector<int32_t>>();
  const std::vector<int32_t> want = j["greedy"].get<std::vector<int32_t>>();
  r.max_new_tokens = static_cast<int>(want.size() - r.prompt.size());
  r.sampling.greedy = true;
  RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset("fp32"));
  const std::vector<Result> out = eng.generate({r});
  EXPECT_EQ(out[0].ids(), want);
  EXPECT_EQ(out[0].logprobs.size(), size_t(r.max_new_tokens));
  EXPECT_EQ(out[0].finish, rollout::Finish::Length);
}

// The rollout log-probs are bitwise what the trainer computes with the same numerics: the
// training forward of the whole sequence, then train::token_logprobs (temperature 1).
TEST(RolloutEngine, LogprobsEqualTheTrainersInEveryMode) {
  for (const std::string& mode : kModes) {
    RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset(mode));
    std::vector<Request> reqs(2);
    reqs[0].prompt = make_prompt(9, 1);
    reqs[1].prompt = make_prompt(4, 2);
    for (auto& r : reqs) r.max_new_tokens = 12;
    reqs[1].seed = 5;
    reqs[1].sampling.greedy = true;
    const std::vector<Result> out = eng.generate(reqs);
    for (const Result& res : out) {
      const model::Batch b = model::Batch::of({res.ids()});
      std::vector<float> logits(b.ntokens() * eng.config().vocab_size);
      eng.model().forward(b, logits.data());
      const std::vector<int32_t> targets = train::next_token_targets(b);
      std::vector<float> lp(b.ntokens());
      train::token_logprobs(logits.data(), b.ntokens(), eng.config().vocab_size, targets.data(), lp.data());
      const std::vector<float> gen(lp.end() - 1 - res.tokens.size(), lp.end() - 1);
      EXPECT_TRUE(same_bits(gen, res.logprobs)) << mode << ": rollout and trainer log-probs differ";
    }
  }
}

TEST(RolloutEngine, BatchInvariantInEveryMode) {
  const std::vector<Request> reqs = mixed_requests();
  // Every preset whose activation scales are per token (the six and the others).
  std::vector<std::string> not_invariant;
  for (const std::string& mode : model::PrecisionConfig::preset_names()) {
    model::PrecisionConfig prec = model::PrecisionConfig::preset(mode);
    if (!prec.batch_invariant()) {
      not_invariant.push_back(mode);
      continue;
    }
    if (mode == "nvfp4-static") prec.quant.act.cfg.static_amax = 8.f;  // a calibrated amax
    RolloutEngine eng(fixture_weights(), prec);
    std::vector<Result> alone;
    for (const Request& r : reqs) alone.push_back(eng.generate({r})[0]);
    const std::vector<Result> together = eng.generate(reqs);
    // Few slots, small prefill chunks and a small step budget: sequences join and leave mid-way and
    // prompts are prefilled in pieces next to other sequences' decode steps.
    eng.options.max_batch = 2;
    eng.options.prefill_chunk = 5;
    eng.options.max_step_tokens = 7;
    std::vector<Request> reversed(reqs.rbegin(), reqs.rend());
    const std::vector<Result> squeezed = eng.generate(reversed);
    for (size_t i = 0; i < reqs.size(); ++i) {
      expect_same(alone[i], together[i], mode + " request " + std::to_string(i) + " in a batch");
      expect_same(alone[i], squeezed[reqs.size() - 1 - i], mode + " request " + std::to_string(i) + " squeezed");
      EXPECT_EQ(alone[i].tokens.size(), size_t(reqs[i].max_new_tokens));
    }
    // Sampling is really random: different seeds give different continuations.
    std::vector<Request> reseeded = reqs;
    reseeded[0].seed += 1;
    EXPECT_NE(eng.generate({reseeded[0]})[0].tokens, alone[0].tokens) << mode;
  }
  for (const char* m : {"fp8-tensor", "nvfp4-tensor"})
    EXPECT_NE(std::find(not_invariant.begin(), not_invariant.end(), m), not_invariant.end()) << m;
  for (const std::string& mode : kModes) EXPECT_TRUE(model::PrecisionConfig::preset(mode).batch_invariant()) << mode;
}

TEST(RolloutEngine, IndependentOfTheThreadCount) {
  const std::vector<Request> reqs = mixed_requests();
  for (const std::string& mode : {std::string("fp32"), std::string("nvfp4")}) {
    RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset(mode));
    const int before = omp_get_max_threads();
    omp_set_num_threads(1);
    const std::vector<Result> one = eng.generate(reqs);
    omp_set_num_threads(3);
    const std::vector<Result> three = eng.generate(reqs);
    omp_set_num_threads(before);
    for (size_t i = 0; i < reqs.size(); ++i) expect_same(one[i], three[i], mode + " request " + std::to_string(i));
  }
}

TEST(RolloutEngine, PrefillEqualsTokenByTokenDecoding) {
  // Prompt chunk 1 runs the prompt through the cache one token at a time.
  Request r;
  r.prompt = make_prompt(30, 3);
  r.max_new_tokens = 8;
  r.seed = 77;
  for (const std::string& mode : {std::string("fp32"), std::string("nvfp4")}) {
    RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset(mode));
    const Result whole = eng.generate({r})[0];
    eng.options.prefill_chunk = 1;
    const Result pieces = eng.generate({r})[0];
    expect_same(whole, pieces, mode);
  }
}

TEST(RolloutEngine, StopsAtStopTokensAndMaxNewTokens) {
  RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset("bf16"));
  Request r;
  r.prompt = make_prompt(6, 4);
  r.max_new_tokens = 20;
  r.seed = 3;
  const Result free_run = eng.generate({r})[0];
  ASSERT_EQ(free_run.tokens.size(), 20u);
  EXPECT_EQ(free_run.finish, rollout::Finish::Length);
  // Stop at the token sampled 6th (plus an id that never occurs): generation ends at its first
  // occurrence, which is kept.
  const int32_t stop = free_run.tokens[5];
  size_t first = 0;
  while (free_run.tokens[first] != stop) ++first;
  int32_t never = 0;
  while (std::find(free_run.tokens.begin(), free_run.tokens.end(), never) != free_run.tokens.end()) ++never;
  r.stop_ids = {never, stop};
  const Result stopped = eng.generate({r})[0];
  EXPECT_EQ(stopped.finish, rollout::Finish::Stop);
  ASSERT_EQ(stopped.tokens.size(), first + 1);
  EXPECT_TRUE(std::equal(stopped.tokens.begin(), stopped.tokens.end(), free_run.tokens.begin()));
  EXPECT_TRUE(std::memcmp(stopped.logprobs.data(), free_run.logprobs.data(), (first + 1) * sizeof(float)) == 0);
  // max_new_tokens 0: nothing generated; 1: one token.
  Request z = r;
  z.stop_ids.clear();
  z.max_new_tokens = 0;
  Request one = z;
  one.max_new_tokens = 1;
  const std::vector<Result> zo = eng.generate({z, one});
  EXPECT_TRUE(zo[0].tokens.empty());
  EXPECT_TRUE(zo[0].logprobs.empty());
  EXPECT_EQ(zo[0].ids(), z.prompt);
  ASSERT_EQ(zo[1].tokens.size(), 1u);
  EXPECT_EQ(zo[1].tokens[0], free_run.tokens[0]);
}

TEST(RolloutEngine, SharedPrefillGivesTheSameResults) {
  std::vector<std::vector<int32_t>> prompts = {make_prompt(25, 5), make_prompt(11, 6)};
  Request proto;
  proto.max_new_tokens = 9;
  proto.sampling.temperature = 1.0;
  const std::vector<Request> reqs = rollout::group_requests(prompts, 4, 500, proto);
  ASSERT_EQ(reqs.size(), 8u);
  EXPECT_EQ(reqs[5].prompt, prompts[1]);
  EXPECT_EQ(reqs[5].seed, 505u);
  RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset("nvfp4"));
  eng.options.share_prefill = false;
  const std::vector<Result> plain = eng.generate(reqs);
  EXPECT_EQ(eng.stats().prefill_tokens, 4 * (25 + 11));
  EXPECT_EQ(eng.stats().shared_prompts, 0);
  eng.options.share_prefill = true;
  const std::vector<Result> shared = eng.generate(reqs);
  EXPECT_EQ(eng.stats().prefill_tokens, 25 + 11);
  EXPECT_EQ(eng.stats().shared_prompts, 6);
  // Three slots: a group is split over several admissions and partly prefilled again.
  eng.options.max_batch = 3;
  const std::vector<Result> split = eng.generate(reqs);
  std::set<std::vector<int32_t>> distinct;
  for (size_t i = 0; i < reqs.size(); ++i) {
    expect_same(plain[i], shared[i], "shared, request " + std::to_string(i));
    expect_same(plain[i], split[i], "3 slots, request " + std::to_string(i));
    distinct.insert(plain[i].tokens);
  }
  EXPECT_GT(distinct.size(), 4u);  // the group members really sample differently
}

TEST(RolloutEngine, SyncCopiesAndRequantizesTheMasterWeights) {
  model::Weights master = fixture_weights();
  const model::PrecisionConfig prec = model::PrecisionConfig::preset("nvfp4");
  RolloutEngine eng(master, prec);
  Request r;
  r.prompt = make_prompt(10, 7);
  r.max_new_tokens = 12;
  r.seed = 9;
  const Result before = eng.generate({r})[0];
  // An optimizer step on the master: the engine does not see it until sync().
  for (size_t i = 0; i < master.data.size(); ++i) master.data[i] += 0.05f * std::sin(float(i));
  expect_same(before, eng.generate({r})[0], "before sync");
  eng.sync(master);
  RolloutEngine fresh(master, prec);
  const Result after = eng.generate({r})[0];
  expect_same(fresh.generate({r})[0], after, "after sync");
  EXPECT_FALSE(after.tokens == before.tokens && same_bits(after.logprobs, before.logprobs));
  // The engine's quantized weights are those the trainer's QAT computes from the same master.
  model::Weights trainer_copy = master;
  model::Model qat(trainer_copy, model::PrecisionConfig::preset("qat"));
  for (const auto& L : eng.model().linears()) {
    if (L.num.weight.kind != model::QuantKind::Quant) continue;
    const model::LinearQ* T = qat.find_linear(L.name);
    ASSERT_NE(T, nullptr) << L.name;
    ASSERT_EQ(T->num.weight, L.num.weight) << L.name;
    EXPECT_EQ(std::memcmp(eng.model().effective_weights() + L.offset, qat.effective_weights() + T->offset,
                          sizeof(float) * L.out * L.in),
              0)
        << L.name;
  }
  // A master of another shape is refused, naming the tensor.
  model::ModelConfig other = master.cfg;
  other.vocab_size = 256;
  model::Weights wrong(other);
  try {
    eng.sync(wrong);
    FAIL() << "sync accepted weights of another shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("embed_tokens"), std::string::npos) << e.what();
  }
}

TEST(RolloutEngine, RejectsBadRequestsNamingThem) {
  RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset("fp32"));
  Request ok;
  ok.prompt = {1, 2, 3};
  auto expect_error = [&](Request bad, const std::string& needle) {
    try {
      eng.generate({ok, bad});
      ADD_FAILURE() << "accepted a request with " << needle;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("request 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  Request bad = ok;
  bad.prompt.clear();
  expect_error(bad, "empty prompt");
  bad = ok;
  bad.prompt = {1, 512};
  expect_error(bad, "512");
  bad = ok;
  bad.sampling.top_p = 0;
  expect_error(bad, "top_p");
  bad = ok;
  bad.stop_ids = {-1};
  expect_error(bad, "stop id");
  bad = ok;
  bad.max_new_tokens = -1;
  expect_error(bad, "max_new_tokens");
}

TEST(RolloutEngine, PerBatchActivationScalesAreNotBatchInvariant) {
  // The per-tensor presets are flagged, and the flag is true: a neighbour changes the results.
  RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset("nvfp4-tensor"));
  EXPECT_FALSE(eng.batch_invariant());
  std::vector<Request> reqs = mixed_requests();
  for (auto& r : reqs) r.sampling = {}, r.sampling.greedy = false;
  const Result alone = eng.generate({reqs[0]})[0];
  const Result batched = eng.generate(reqs)[0];
  EXPECT_FALSE(alone.tokens == batched.tokens && same_bits(alone.logprobs, batched.logprobs));
}
