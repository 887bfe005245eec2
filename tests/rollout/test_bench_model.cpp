// The FLOP counts behind `quads bench model`'s GFLOP/s column.
#include <gtest/gtest.h>

#include "common/fixtures.h"
#include "model/model.h"
#include "rollout/bench_model.h"

using namespace quads;

namespace {

// 2 * M * out * in over every linear the forward actually runs, seen through the probe hook.
double probed_linear_flops(model::Weights& w, const model::Batch& b) {
  model::Model m(w);
  double fl = 0;
  model::ForwardOptions opt;
  opt.probe = [&](const model::LinearQ& L, const float*, const float*, const float*, int64_t M) {
    fl += 2.0 * double(M) * double(L.out) * double(L.in);
  };
  std::vector<float> logits(b.ntokens() * w.cfg.vocab_size);
  m.forward(b, logits.data(), nullptr, opt);
  return fl;
}

}  // namespace

TEST(RolloutBenchModel, LinearFlopsCountWhatTheModelRuns) {
  model::ModelConfig small = rollout::bench_small_config();
  small.num_hidden_layers = 2;  // one sparse and (below) one dense layer keep the test fast
  small.mlp_only_layers = {1};
  model::Weights ws = model::Weights::random(small, 3);
  model::Weights wf = model::Weights::load(fixtures_dir() + "/tiny_qwen3moe_a");
  const model::Batch b = model::Batch::of({{1, 2, 3, 4, 5}, {6, 7, 8}});
  EXPECT_DOUBLE_EQ(probed_linear_flops(ws, b), rollout::linear_flops(small, b.ntokens(), b.ntokens()));
  EXPECT_DOUBLE_EQ(probed_linear_flops(wf, b), rollout::linear_flops(wf.cfg, b.ntokens(), b.ntokens()));
}

TEST(RolloutBenchModel, AttentionFlopsSumTheCausalContexts) {
  const model::ModelConfig c = rollout::bench_small_config();
  const double per_key = 4.0 * c.num_attention_heads * c.head_dim * c.num_hidden_layers;
  for (int64_t start : {0, 1, 37})
    for (int64_t n : {1, 2, 50}) {
      double keys = 0;
      for (int64_t p = start; p < start + n; ++p) keys += double(p + 1);
      EXPECT_DOUBLE_EQ(rollout::attention_flops(c, start, n), keys * per_key) << start << " " << n;
    }
}
