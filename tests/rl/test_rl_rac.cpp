// Residual activation compensation (model/rac.h) and the trainer/rollout weight identity of
// asymmetric QAT.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/error.h"
#include "cpu/gemm.h"
#include "model/model.h"
#include "model/rac.h"
#include "numerics/quantize.h"
#include "rl/modes.h"
#include "rollout/engine.h"

namespace quads {
namespace {

using model::RacConfig;
using model::RacGranularity;

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * d(g));
  return v;
}

// Activations with a few large outlier channels, as transformer activations have.
std::vector<float> outlier_acts(int64_t M, int64_t in, uint64_t seed) {
  std::vector<float> x = randn(M * in, seed);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j : {3, 17, 40}) x[m * in + j] *= 20.f;
  return x;
}

model::ModelConfig small_config() {
  model::ModelConfig c;
  c.vocab_size = 40;
  c.hidden_size = 64;
  c.intermediate_size = 64;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.max_position_embeddings = 128;
  return c;
}

model::Batch batch_of(int nseq, int len, int vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  model::Batch b;
  for (int s = 0; s < nseq; ++s) {
    std::vector<int32_t> t(len + s);
    for (auto& x : t) x = static_cast<int32_t>(g() % vocab);
    b.add(t);
  }
  return b;
}

TEST(RlLoopRac, CountRoundsUpToWholeBlocks) {
  EXPECT_EQ(model::rac_count(128, 0.0), 0);
  EXPECT_EQ(model::rac_count(128, 0.05), 16);   // 6.4 -> 7 -> 16
  EXPECT_EQ(model::rac_count(128, 0.125), 16);
  EXPECT_EQ(model::rac_count(128, 0.25), 32);
  EXPECT_EQ(model::rac_count(128, 0.3), 48);    // 38.4 -> 39 -> 48
  EXPECT_EQ(model::rac_count(128, 1.0), 128);
  EXPECT_EQ(model::rac_count(32, 2.0), 32);
}

TEST(RlLoopRac, SelectsLargestEnergyChannelsAndBlocks) {
  std::vector<double> e(64, 1.0);
  e[5] = 9;
  e[40] = 8;
  e[41] = 7;
  e[63] = 10;
  // Channels: the 4 largest, sorted by id; ties (all the 1s) never beat a larger value.
  std::vector<int32_t> s = model::rac_select(e.data(), 64, 4, RacGranularity::Channel);
  EXPECT_EQ(s, (std::vector<int32_t>{5, 40, 41, 63}));
  // Blocks: block 2 (8 + 7 + 14 = 29) beats block 3 (10 + 15 = 25), block 0 (9 + 15 = 24), block 1 (16).
  s = model::rac_select(e.data(), 64, 16, RacGranularity::Block16);
  ASSERT_EQ(s.size(), 16u);
  EXPECT_EQ(s.front(), 32);
  EXPECT_EQ(s.back(), 47);
  s = model::rac_select(e.data(), 64, 32, RacGranularity::Block16);
  ASSERT_EQ(s.size(), 32u);
  EXPECT_EQ(s.front(), 32);  // blocks 2 and 3
  EXPECT_EQ(s.back(), 63);
  std::vector<double> flat(64, 1.0);
  s = model::rac_select(flat.data(), 64, 16, RacGranularity::Block16);
  EXPECT_EQ(s.front(), 0);  // all equal: the lowest block
  EXPECT_THROW(model::rac_select(e.data(), 64, 8, RacGranularity::Block16), Error);
}

// rac_apply against a direct computation of its definition: y += DQ(Q(r[:, S])) · W[:, S]ᵀ.
TEST(RlLoopRac, ResidualGemmMatchesDefinition) {
  const int64_t M = 7, in = 64, out = 24;
  std::vector<float> X = outlier_acts(M, in, 1), W = randn(out * in, 2, 0.1f), Xq(M * in);
  num::QConfig a;
  a.global = num::Global::PerRow;
  num::fake_quantize(X.data(), Xq.data(), M, in, a);
  const std::vector<int32_t> S = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                  32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47};
  const model::OperandQuant q = RacConfig::residual_format("nvfp4");
  std::vector<float> Y(M * out, 0.5f);
  model::rac_apply(S, q, X.data(), Xq.data(), M, in, W.data(), out, Y.data(), out);
  std::vector<float> r(M * S.size()), rq(M * S.size());
  for (int64_t m = 0; m < M; ++m)
    for (size_t j = 0; j < S.size(); ++j) r[m * S.size() + j] = X[m * in + S[j]] - Xq[m * in + S[j]];
  num::fake_quantize(r.data(), rq.data(), M, static_cast<int64_t>(S.size()), q.cfg);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = 0; o < out; ++o) {
      double ref = 0;
      for (size_t j = 0; j < S.size(); ++j) ref += double(rq[m * S.size() + j]) * W[o * in + S[j]];
      EXPECT_NEAR(Y[m * out + o], 0.5 + ref, 1e-5) << m << "," << o;
    }
}

// Compensating more channels brings the W4A4 product closer to the product with unquantized
// activations; all channels with a BF16 residual leave only the residual's BF16 rounding.
TEST(RlLoopRac, ErrorShrinksWithRatio) {
  const int64_t M = 32, in = 128, out = 48;
  std::vector<float> X = outlier_acts(M, in, 3), W = randn(out * in, 4, 0.1f), Xq(M * in);
  num::QConfig a;
  a.global = num::Global::PerRow;
  num::fake_quantize(X.data(), Xq.data(), M, in, a);
  std::vector<float> exact(M * out), base(M * out);
  cpu::gemm_nt_rowinv(M, out, in, X.data(), in, W.data(), in, exact.data(), out);
  cpu::gemm_nt_rowinv(M, out, in, Xq.data(), in, W.data(), in, base.data(), out);
  auto err = [&](const std::vector<float>& y) {
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += (double(y[i]) - exact[i]) * (double(y[i]) - exact[i]);
    return s;
  };
  std::vector<double> energy(in, 0.0);
  model::rac_energy(X.data(), Xq.data(), M, in, energy.data());
  double prev = err(base);
  for (double ratio : {0.125, 0.25, 0.5, 1.0}) {
    std::vector<float> y = base;
    auto S = model::rac_select(energy.data(), in, model::rac_count(in, ratio), RacGranularity::Block16);
    model::rac_apply(S, RacConfig::residual_format("nvfp4"), X.data(), Xq.data(), M, in, W.data(), out, y.data(), out);
    const double e = err(y);
    EXPECT_LT(e, prev) << "ratio " << ratio;
    prev = e;
  }
  EXPECT_LT(prev, 0.1 * err(base));  // full-width NVFP4 residual: an order of magnitude less
  std::vector<float> y = base;
  std::vector<int32_t> all(in);
  for (int j = 0; j < in; ++j) all[j] = j;
  model::rac_apply(all, RacConfig::residual_format("bf16"), X.data(), Xq.data(), M, in, W.data(), out, y.data(), out);
  EXPECT_LT(err(y), 1e-3 * err(base));
}

// A W4A4 model with static RAC: every compensated linear's output is closer to the product with
// its unquantized input (same NVFP4 weights), and the rollout stays batch-invariant (a sequence's
// log-probs alone == in a batch).
TEST(RlLoopRac, ModelForwardCloserAndBatchInvariant) {
  const model::ModelConfig c = small_config();
  model::Weights w = model::Weights::random(c, 11, 0.08f);
  model::Model w4a4(w, model::PrecisionConfig::preset("nvfp4"));
  const model::Batch b = batch_of(3, 20, c.vocab_size, 5);
  const size_t n = static_cast<size_t>(b.ntokens()) * c.vocab_size;
  // Sum over the W4A4 linears of |Y - X W_eff^T|^2 and |X W_eff^T|^2 (the probe sees Y after RAC).
  auto linear_error = [&](model::Model& m, std::vector<float>* logits) {
    double err = 0, ref = 0;
    model::ForwardOptions fo;
    fo.probe = [&](const model::LinearQ& L, const float* X, const float* Xq, const float* Y, int64_t M) {
      if (L.num.act.kind != model::QuantKind::Quant) return;
      std::vector<float> exact(M * L.out);
      cpu::gemm_nt_rowinv(M, L.out, L.in, X, L.in, m.effective_weights() + L.offset, L.in, exact.data(), L.out);
      for (int64_t i = 0; i < M * L.out; ++i) {
        err += (double(Y[i]) - exact[i]) * (double(Y[i]) - exact[i]);
        ref += double(exact[i]) * exact[i];
      }
    };
    logits->resize(n);
    m.forward(b, logits->data(), nullptr, fo);
    return err / ref;
  };
  std::vector<float> plain, rac;
  const double e_plain = linear_error(w4a4, &plain);
  RacConfig rc;
  rc.ratio = 0.5;
  const int nlin = model::rac_calibrate(w4a4, batch_of(4, 16, c.vocab_size, 6), rc);
  // q, k, v, o and 4 experts x (gate, up, down) per layer; router and lm_head stay BF16.
  EXPECT_EQ(nlin, 2 * (4 + 4 * 3));
  for (const auto& L : w4a4.linears())
    EXPECT_EQ(L.rac_channels.size(), L.num.act.kind == model::QuantKind::Quant ? size_t(L.in / 2) : 0u) << L.name;
  const double e_rac = linear_error(w4a4, &rac);
  EXPECT_LT(e_rac, 0.5 * e_plain);
  std::vector<float> rac_again(n);
  w4a4.forward(b, rac_again.data());
  EXPECT_EQ(0, std::memcmp(rac.data(), rac_again.data(), n * sizeof(float)));  // the probe changes nothing

  // Batch invariance through the decode path.
  model::Batch one;
  one.add(std::vector<int32_t>(b.tokens.begin() + b.offsets[1], b.tokens.begin() + b.offsets[2]));
  std::vector<float> lp_all = w4a4.token_logprobs(b), lp_one = w4a4.token_logprobs(one);
  const int64_t start = b.seq_len(0) - 1;
  for (size_t i = 0; i < lp_one.size(); ++i) ASSERT_EQ(lp_one[i], lp_all[start + i]) << i;

  // Dynamic selection marks the same linears and changes the numbers (it ranks per call).
  rc.dynamic = true;
  EXPECT_EQ(model::rac_calibrate(w4a4, b, rc), nlin);
  for (const auto& L : w4a4.linears()) EXPECT_TRUE(L.rac_channels.empty());
  std::vector<float> dyn(n);
  w4a4.forward(b, dyn.data());
  EXPECT_NE(0, std::memcmp(dyn.data(), rac.data(), n * sizeof(float)));
  model::rac_clear(w4a4);
  std::vector<float> again(n);
  w4a4.forward(b, again.data());
  EXPECT_EQ(0, std::memcmp(again.data(), plain.data(), n * sizeof(float)));
}

// Asymmetric QAT: the trainer's quantized linears use exactly the rollout engine's dequantized
// NVFP4 weights (same masters -> bit-identical W_eff), before and after an update of the masters.
TEST(RlLoopRac, QatTrainerWeightsBitIdenticalToRollout) {
  const model::ModelConfig c = small_config();
  model::Weights master = model::Weights::random(c, 21, 0.05f);
  const rl::ModeSpec& quads = rl::mode_spec("quads");
  model::Model trainer(master, rl::trainer_precision(quads));
  rollout::RolloutEngine engine(master, rl::rollout_precision(quads));
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      std::vector<float> d = randn(master.size(), 99, 1e-3f);
      for (size_t i = 0; i < master.size(); ++i) master.data[i] += d[i];
      trainer.sync();
      engine.sync(master);
    }
    int quantized = 0;
    for (size_t i = 0; i < trainer.linears().size(); ++i) {
      const model::LinearQ& Lt = trainer.linears()[i];
      const model::LinearQ& Lr = engine.model().linears()[i];
      ASSERT_EQ(Lt.name, Lr.name);
      ASSERT_EQ(Lt.num.weight, Lr.num.weight) << Lt.name;
      const size_t bytes = sizeof(float) * Lt.out * Lt.in;
      if (Lt.num.weight.kind != model::QuantKind::Quant) continue;
      ++quantized;
      EXPECT_EQ(0, std::memcmp(trainer.effective_weights() + Lt.offset, engine.model().effective_weights() + Lr.offset,
                               bytes))
          << Lt.name << " round " << round;
      // And the trainer's activations are not quantized (asymmetric), the rollout's are.
      EXPECT_NE(Lt.num.act.kind, model::QuantKind::Quant) << Lt.name;
      EXPECT_EQ(Lr.num.act.kind, model::QuantKind::Quant) << Lr.name;
    }
    EXPECT_EQ(quantized, 2 * (4 + 4 * 3));
  }
}

}  // namespace
}  // namespace quads
