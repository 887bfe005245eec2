// The model against the outside reference: /work/shared/fixtures/tiny_qwen3moe_a, computed by
// Hugging Face transformers in float64 (see fixtures/README.md).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/fixtures.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "train/losses.h"

using namespace quads;
using namespace quads::model;

namespace {

std::string fixture(const std::string& f) { return fixtures_dir() + "/tiny_qwen3moe_a/" + f; }

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return nlohmann::json::parse(f);
}

std::vector<float> read_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  const size_t n = static_cast<size_t>(f.tellg());
  f.seekg(0);
  std::vector<float> v(n / 4);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n));
  return v;
}

double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / den);
}

int argmax(const float* x, int64_t n) { return static_cast<int>(std::max_element(x, x + n) - x); }

struct Fixture : ::testing::Test {
  static Weights& weights() {
    static Weights w = Weights::load(fixtures_dir() + "/tiny_qwen3moe_a");
    return w;
  }
  std::vector<int32_t> input_ids() {
    return read_json(fixture("input_ids.json"))["input_ids"].get<std::vector<int32_t>>();
  }
};

}  // namespace

TEST_F(Fixture, ConfigReadsTransformersV5Names) {
  const ModelConfig& c = weights().cfg;
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_TRUE(c.is_sparse(0) && c.is_sparse(1));
}

TEST_F(Fixture, LogitsMatchReference) {
  Model m(weights());
  const auto ids = input_ids();
  const Batch b = Batch::of({ids});
  std::vector<float> logits(b.ntokens() * m.config().vocab_size);
  m.forward(b, logits.data());
  const auto ref = read_f32(fixture("logits.f32"));
  ASSERT_EQ(ref.size(), logits.size());
  EXPECT_LT(rel_l2(logits.data(), ref.data(), ref.size()), 1e-5);
}

TEST_F(Fixture, LossAndEveryGradientMatchReference) {
  Model m(weights());
  const auto ids = input_ids();
  const Batch b = Batch::of({ids});
  const int64_t T = b.ntokens(), V = m.config().vocab_size;
  std::vector<float> logits(T * V), dlogits(T * V);
  Activations acts;
  m.forward(b, logits.data(), &acts);
  const auto targets = train::next_token_targets(b);
  const double loss = train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data());
  const auto lj = read_json(fixture("loss.json"));
  EXPECT_NEAR(loss, lj["loss"].get<double>(), 1e-5);

  std::vector<float> grads(m.weights().size(), 0.f);
  m.backward(acts, dlogits.data(), grads.data());
  // The reference gradients use transformers v5's fused expert tensors: the loader maps them.
  std::vector<float> ref(m.weights().size(), 0.f);
  read_hf_tensors({fixture("grads.safetensors")}, m.config(), m.weights().layout, ref.data(), /*require_all=*/true);
  int unused_experts = 0;
  for (const auto& p : m.weights().layout.params) {
    const float* r = ref.data() + p.offset;
    if (std::all_of(r, r + p.numel, [](float x) { return x == 0.f; })) {
      // An expert no token was routed to: its gradient is exactly zero.
      ++unused_experts;
      for (size_t i = 0; i < p.numel; ++i) ASSERT_EQ(grads[p.offset + i], 0.f) << p.name;
      continue;
    }
    EXPECT_LT(rel_l2(grads.data() + p.offset, r, p.numel), 1e-4) << p.name;
  }
  EXPECT_LT(unused_experts, 12);
}

TEST_F(Fixture, GreedyContinuationThroughKvCacheAndFullForward) {
  Model m(weights());
  const auto g = read_json(fixture("greedy.json"));
  const auto prompt = g["prompt"].get<std::vector<int32_t>>();
  const auto expect = g["greedy"].get<std::vector<int32_t>>();
  const int64_t V = m.config().vocab_size;
  const size_t new_tokens = expect.size() - prompt.size();

  // Decode path: prefill the prompt, then one token at a time through the cache.
  KVCache cache(m.config(), 2);
  std::vector<int32_t> seq = prompt;
  std::vector<float> lg = m.step(cache, {{1, prompt, false}});
  for (size_t i = 0; i < new_tokens; ++i) {
    const int32_t t = argmax(lg.data(), V);
    seq.push_back(t);
    if (i + 1 < new_tokens) lg = m.step(cache, {{1, {t}, false}});
  }
  EXPECT_EQ(seq, expect);
  EXPECT_EQ(cache.length(1), static_cast<int64_t>(expect.size()) - 1);
  EXPECT_EQ(cache.length(0), 0);

  // Full forward over the growing sequence.
  std::vector<int32_t> seq2 = prompt;
  for (size_t i = 0; i < new_tokens; ++i) {
    const Batch b = Batch::of({seq2});
    std::vector<float> logits(b.ntokens() * V);
    m.forward(b, logits.data());
    seq2.push_back(argmax(logits.data() + (b.ntokens() - 1) * V, V));
  }
  EXPECT_EQ(seq2, expect);
}
