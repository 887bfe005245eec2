// The decode API and batch invariance: a sequence's numbers do not depend on what else is in the
// batch, nor on how it is fed (training forward, one prefill, chunks, token by token), bitwise.
#include <gtest/gtest.h>

#include <cstring>

#include "common/error.h"
#include "model/model.h"
#include "model_test_util.h"
#include "train/losses.h"

using namespace quads;
using namespace quads::model;

namespace {

// Dimensions every quantizer accepts (multiples of 32 on every reduction dimension).
ModelConfig quant_friendly_config() {
  ModelConfig c = test::tiny_config();
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.moe_intermediate_size = 32;
  c.intermediate_size = 64;
  c.num_experts = 8;
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {1};
  return c;
}

std::vector<float> forward_logits(Model& m, const Batch& b) {
  std::vector<float> lg(b.ntokens() * m.config().vocab_size);
  m.forward(b, lg.data());
  return lg;
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

class Decode : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    cfg = quant_friendly_config();
    w = Weights::random(cfg, 77, 0.15f, 0.1f);
    m = std::make_unique<Model>(w, PrecisionConfig::preset(GetParam()));
    A = test::random_tokens(11, cfg.vocab_size, 1);
    B = test::random_tokens(6, cfg.vocab_size, 2);
    C = test::random_tokens(17, cfg.vocab_size, 3);
  }
  ModelConfig cfg;
  Weights w;
  std::unique_ptr<Model> m;
  std::vector<int32_t> A, B, C;
};

}  // namespace

TEST_P(Decode, PackedBatchEqualsEachSequenceAlone) {
  const int64_t V = cfg.vocab_size;
  const auto all = forward_logits(*m, Batch::of({B, A, C}));
  const auto a = forward_logits(*m, Batch::of({A}));
  const auto c = forward_logits(*m, Batch::of({C}));
  EXPECT_TRUE(same_bits(all.data() + B.size() * V, a.data(), a.size()));
  EXPECT_TRUE(same_bits(all.data() + (B.size() + A.size()) * V, c.data(), c.size()));
}

TEST_P(Decode, PrefillChunksAndTokenByTokenEqualForward) {
  const int64_t V = cfg.vocab_size;
  const auto ref = forward_logits(*m, Batch::of({C}));
  // One prefill.
  KVCache cache(cfg, 3);
  const auto one = m->step(cache, {{0, C, true}});
  EXPECT_TRUE(same_bits(one.data(), ref.data(), ref.size()));
  // Chunks of 5, 1 and the rest.
  std::vector<float> chunks;
  size_t p = 0;
  for (size_t n : {size_t(5), size_t(1), C.size() - 6}) {
    const auto lg = m->step(cache, {{1, std::vector<int32_t>(C.begin() + p, C.begin() + p + n), true}});
    chunks.insert(chunks.end(), lg.begin(), lg.end());
    p += n;
  }
  EXPECT_TRUE(same_bits(chunks.data(), ref.data(), ref.size()));
  // Token by token, only the last logits.
  for (size_t i = 0; i < C.size(); ++i) {
    const auto lg = m->step(cache, {{2, {C[i]}, false}});
    ASSERT_EQ(lg.size(), size_t(V));
    EXPECT_TRUE(same_bits(lg.data(), ref.data() + i * V, V)) << "position " << i;
  }
  EXPECT_EQ(cache.length(2), static_cast<int64_t>(C.size()));
}

TEST_P(Decode, SequenceAloneEqualsSequenceInABatch) {
  const int64_t V = cfg.vocab_size;
  // A alone: prefill then 4 decode steps.
  KVCache solo(cfg, 1);
  std::vector<std::vector<float>> alone;
  alone.push_back(m->step(solo, {{0, A, false}}));
  for (int i = 0; i < 4; ++i) alone.push_back(m->step(solo, {{0, {int32_t(3 * i + 1)}, false}}));
  // A in slot 2 of a batch whose other members change from step to step (prefills and decodes).
  KVCache cache(cfg, 4);
  m->step(cache, {{0, B, false}});
  std::vector<std::vector<float>> together;
  auto lg = m->step(cache, {{1, C, true}, {2, A, false}, {0, {5}, false}});
  together.emplace_back(lg.end() - 2 * V, lg.end() - V);
  for (int i = 0; i < 4; ++i) {
    std::vector<StepItem> items;
    if (i % 2 == 0) items.push_back({3, test::random_tokens(3 + i, cfg.vocab_size, 10 + i), true});
    items.push_back({2, {int32_t(3 * i + 1)}, false});
    if (i != 2) items.push_back({1, {int32_t(i)}, false});
    lg = m->step(cache, items);
    const int64_t row = (i % 2 == 0) ? 3 + i : 0;  // A's row
    together.emplace_back(lg.begin() + row * V, lg.begin() + (row + 1) * V);
    if (i % 2 == 0) cache.clear(3);
  }
  ASSERT_EQ(alone.size(), together.size());
  for (size_t i = 0; i < alone.size(); ++i) EXPECT_TRUE(same_bits(alone[i].data(), together[i].data(), V)) << "step " << i;
}

TEST_P(Decode, ForkedCacheEqualsFreshPrefill) {
  KVCache cache(cfg, 3);
  m->step(cache, {{0, A, false}});
  cache.copy(0, 1);
  const auto x = m->step(cache, {{1, {7, 8}, true}});
  std::vector<int32_t> full = A;
  full.push_back(7);
  full.push_back(8);
  const auto ref = m->step(cache, {{2, full, true}});
  const int64_t V = cfg.vocab_size;
  EXPECT_TRUE(same_bits(x.data(), ref.data() + (full.size() - 2) * V, 2 * V));
  // Truncating slot 2 back to A and decoding again gives the same numbers.
  cache.truncate(2, static_cast<int64_t>(A.size()));
  const auto y = m->step(cache, {{2, {7, 8}, true}});
  EXPECT_TRUE(same_bits(x.data(), y.data(), x.size()));
}

TEST_P(Decode, TokenLogprobsMatchForwardLogSoftmax) {
  const Batch b = Batch::of({A, C});
  const auto lg = forward_logits(*m, b);
  const auto targets = train::next_token_targets(b);
  std::vector<float> ref(b.ntokens());
  train::token_logprobs(lg.data(), b.ntokens(), cfg.vocab_size, targets.data(), ref.data());
  const auto lp = m->token_logprobs(b, 4);
  ASSERT_EQ(lp.size(), A.size() + C.size() - 2);
  size_t j = 0;
  for (int64_t t = 0; t < b.ntokens(); ++t) {
    if (targets[t] < 0) continue;
    EXPECT_NEAR(lp[j], ref[t], 2e-6) << t;
    ++j;
  }
}

TEST_P(Decode, StepRecordsTheForwardRouting) {
  Routing r1, r2;
  std::vector<float> lg(A.size() * cfg.vocab_size);
  ForwardOptions opt;
  opt.record = &r1;
  m->forward(Batch::of({A}), lg.data(), nullptr, opt);
  KVCache cache(cfg, 1);
  m->step(cache, {{0, A, false}}, &r2);
  EXPECT_EQ(r1.experts, r2.experts);
  EXPECT_TRUE(r1.experts[1].empty());  // the dense layer
  EXPECT_EQ(r1.experts[0].size(), A.size() * cfg.num_experts_per_tok);
}

INSTANTIATE_TEST_SUITE_P(Modes, Decode, ::testing::Values("fp32", "bf16", "nvfp4", "nvfp4-2d", "fp8", "mxfp4", "qat"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& ch : s)
                             if (ch == '-') ch = '_';
                           return s;
                         });

TEST(DecodeApi, RejectsBadSteps) {
  const ModelConfig cfg = quant_friendly_config();
  Weights w = Weights::random(cfg, 1);
  Model m(w);
  KVCache cache(cfg, 2);
  EXPECT_THROW(m.step(cache, {{0, {1}, false}, {0, {2}, false}}), Error);  // a slot twice
  EXPECT_THROW(m.step(cache, {{2, {1}, false}}), Error);                   // no such slot
  EXPECT_THROW(m.step(cache, {{0, {}, false}}), Error);                    // no tokens
  EXPECT_THROW(m.step(cache, {{0, {cfg.vocab_size}, false}}), Error);      // outside the vocabulary
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_FALSE(PrecisionConfig::preset("nvfp4-tensor").batch_invariant());
  EXPECT_FALSE(PrecisionConfig::preset("fp8-tensor").batch_invariant());
  EXPECT_TRUE(PrecisionConfig::preset("nvfp4").batch_invariant());
}
