#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/error.h"
#include "rl/grpo.h"

using namespace quads::rl;

TEST(RlGrpo, GroupAdvantagesHandComputed) {
  std::vector<float> r{1, 0, 0, 1, /*group 2*/ 1, 1, 1, 1, /*group 3*/ 0, 0, 0, 3};
  AdvantageConfig cfg;
  cfg.eps = 0;
  auto a = group_advantages(r, 4, cfg);
  // mean .5, sample std sqrt(4 * .25 / 3) = sqrt(1/3)
  EXPECT_NEAR(a[0], 0.5 / std::sqrt(1.0 / 3.0), 1e-6);
  EXPECT_NEAR(a[1], -0.5 / std::sqrt(1.0 / 3.0), 1e-6);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[i], 0.f);  // equal rewards: exactly zero
  // mean .75, sample std sqrt((3 * .5625 + 5.0625) / 3) = 1.5
  EXPECT_NEAR(a[8], -0.75 / 1.5, 1e-6);
  EXPECT_NEAR(a[11], 2.25 / 1.5, 1e-6);

  cfg.unbiased_std = false;  // population std .5 -> +-1
  a = group_advantages(r, 4, cfg);
  EXPECT_NEAR(a[0], 1.0, 1e-6);
  EXPECT_NEAR(a[2], -1.0, 1e-6);

  cfg.eps = 0.5;  // (r - mean) / (std + eps)
  a = group_advantages(r, 4, cfg);
  EXPECT_NEAR(a[0], 0.5, 1e-6);

  AdvantageConfig dr;
  dr.scale_by_std = false;  // Dr. GRPO
  a = group_advantages(r, 4, dr);
  EXPECT_NEAR(a[0], 0.5, 1e-7);
  EXPECT_NEAR(a[11], 2.25, 1e-7);
  double sum = 0;
  for (float x : a) sum += x;
  EXPECT_NEAR(sum, 0.0, 1e-6);  // zero mean per group

  EXPECT_THROW(group_advantages(r, 5, cfg), quads::Error);
  EXPECT_THROW(group_advantages(std::vector<float>{1}, 1, AdvantageConfig{}), quads::Error);
}

TEST(RlGrpo, GroupStats) {
  std::vector<float> r{1, 0, /**/ 0, 0, /**/ 1, 1};
  GroupStats s = group_stats(r, 2);
  EXPECT_DOUBLE_EQ(s.reward_mean, 0.5);
  EXPECT_DOUBLE_EQ(s.frac_uniform, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(s.frac_solved, 2.0 / 3.0);
}

TEST(RlGrpo, ClippedTokenValuesAndClipping) {
  // r = 1: loss -A, gradient -A.
  PgToken t = clipped_pg_token(-1.3, -1.3, 0.7, 0.2, 0.28);
  EXPECT_DOUBLE_EQ(t.loss, -0.7);
  EXPECT_DOUBLE_EQ(t.grad, -0.7);
  EXPECT_FALSE(t.clipped);
  // r = e^0.5 = 1.65 > 1.28 with A > 0: clipped to 1.28, no gradient.
  t = clipped_pg_token(-0.5, -1.0, 2.0, 0.2, 0.28);
  EXPECT_TRUE(t.clipped);
  EXPECT_DOUBLE_EQ(t.grad, 0.0);
  EXPECT_NEAR(t.loss, -1.28 * 2.0, 1e-12);
  // Same ratio with A < 0: the unclipped term is the minimum, the gradient flows.
  t = clipped_pg_token(-0.5, -1.0, -2.0, 0.2, 0.28);
  EXPECT_FALSE(t.clipped);
  EXPECT_NEAR(t.grad, std::exp(0.5) * 2.0, 1e-12);
  // r = e^-0.5 = 0.61 < 0.8 with A < 0: clipped.
  t = clipped_pg_token(-1.5, -1.0, -1.0, 0.2, 0.28);
  EXPECT_TRUE(t.clipped);
  EXPECT_NEAR(t.loss, 0.8, 1e-12);
}

// d loss / d logp against central differences, away from the clip boundaries (the kinks).
TEST(RlGrpo, ClippedTokenGradientMatchesFiniteDifferences) {
  const double h = 1e-6;
  int checked = 0;
  for (double lo : {-3.0, -1.0, -0.2})
    for (double d : {-0.6, -0.3, -0.1, 0.0, 0.1, 0.2, 0.5})
      for (double A : {-1.5, -0.2, 0.4, 2.0}) {
        double logp = lo + d, r = std::exp(d);
        if (std::fabs(r - 0.8) < 1e-3 || std::fabs(r - 1.28) < 1e-3) continue;
        double fd = (clipped_pg_token(logp + h, lo, A, 0.2, 0.28).loss - clipped_pg_token(logp - h, lo, A, 0.2, 0.28).loss) /
                    (2 * h);
        EXPECT_NEAR(clipped_pg_token(logp, lo, A, 0.2, 0.28).grad, fd, 1e-6 * (1 + std::fabs(fd)))
            << "logp_old " << lo << " d " << d << " A " << A;
        ++checked;
      }
  EXPECT_GT(checked, 60);
}

TEST(RlGrpo, K3PenaltyAndGradient) {
  EXPECT_DOUBLE_EQ(k3_kl(-1.0, -1.0), 0.0);
  EXPECT_DOUBLE_EQ(k3_kl_grad(-1.0, -1.0), 0.0);
  // d = logp_ref - logp = 0.5: e^0.5 - 0.5 - 1
  EXPECT_NEAR(k3_kl(-1.5, -1.0), std::exp(0.5) - 1.5, 1e-15);
  const double h = 1e-6;
  for (double logp : {-4.0, -1.2, -0.1})
    for (double ref : {-3.0, -1.0, -0.05}) {
      EXPECT_GE(k3_kl(logp, ref), 0.0);
      double fd = (k3_kl(logp + h, ref) - k3_kl(logp - h, ref)) / (2 * h);
      EXPECT_NEAR(k3_kl_grad(logp, ref), fd, 1e-6 * (1 + std::fabs(fd)));
    }
}

TEST(RlGrpo, TisWeight) {
  EXPECT_DOUBLE_EQ(tis_weight(-1.0, -1.0, 2.0), 1.0);
  EXPECT_NEAR(tis_weight(-1.0, -1.0 - std::log(1.5), 2.0), 1.5, 1e-12);
  EXPECT_DOUBLE_EQ(tis_weight(-1.0, -3.0, 2.0), 2.0);  // e^2 capped
  EXPECT_NEAR(tis_weight(-2.0, -1.0, 2.0), std::exp(-1.0), 1e-15);
}

namespace {

// Two sequences padded to T = 4: seq 0 has 1 response token, seq 1 has 3.
struct Toy {
  std::vector<float> logp{-1, 0, 0, 0, -2, -0.5f, -3, 0};
  std::vector<float> old = logp;
  std::vector<uint8_t> mask{1, 0, 0, 0, 1, 1, 1, 0};
  std::vector<float> adv{1, -1};
  PgBatch batch() const {
    PgBatch b;
    b.n_seqs = 2;
    b.T = 4;
    b.logp = logp;
    b.logp_old = old;
    b.mask = mask;
    b.adv = adv;
    return b;
  }
};

}  // namespace

// At r = 1 every token's loss is -A; the three documented normalizations, by hand.
TEST(RlGrpo, AggregationNormalizations) {
  Toy toy;
  PgConfig cfg;
  cfg.aggregation = Aggregation::TokenMean;
  PgResult r = policy_loss(toy.batch(), cfg);
  EXPECT_NEAR(r.loss, (-1.0 + 3.0) / 4.0, 1e-12);
  EXPECT_FLOAT_EQ(r.grad[0], -0.25f);
  EXPECT_FLOAT_EQ(r.grad[4], 0.25f);
  EXPECT_EQ(r.grad[1], 0.f);
  EXPECT_EQ(r.grad[7], 0.f);
  EXPECT_EQ(r.n_tokens, 4);

  cfg.aggregation = Aggregation::SeqMean;
  r = policy_loss(toy.batch(), cfg);
  EXPECT_NEAR(r.loss, (-1.0 / 1.0 + 3.0 / 3.0) / 2.0, 1e-12);
  EXPECT_FLOAT_EQ(r.grad[0], -0.5f);
  EXPECT_FLOAT_EQ(r.grad[5], static_cast<float>(1.0 / 6.0));

  cfg.aggregation = Aggregation::SeqSumNorm;
  cfg.norm_len = 4;
  r = policy_loss(toy.batch(), cfg);
  EXPECT_NEAR(r.loss, (-1.0 + 3.0) / (2.0 * 4.0), 1e-12);
  EXPECT_FLOAT_EQ(r.grad[6], 0.125f);
  cfg.norm_len = 0;
  EXPECT_THROW(policy_loss(toy.batch(), cfg), quads::Error);
}

// Splitting a batch into minibatches with the batch-wide denominator reproduces the batch loss.
TEST(RlGrpo, MinibatchDenominatorsAddUp) {
  Toy toy;
  for (Aggregation agg : {Aggregation::TokenMean, Aggregation::SeqMean, Aggregation::SeqSumNorm}) {
    PgConfig cfg;
    cfg.aggregation = agg;
    cfg.norm_len = 4;
    PgResult full = policy_loss(toy.batch(), cfg);
    double denom = agg == Aggregation::TokenMean ? 4.0 : 2.0;
    double sum = 0;
    for (int s = 0; s < 2; ++s) {
      PgBatch b = toy.batch();
      b.n_seqs = 1;
      b.logp = b.logp.subspan(4 * s, 4);
      b.logp_old = b.logp_old.subspan(4 * s, 4);
      b.mask = b.mask.subspan(4 * s, 4);
      b.adv = b.adv.subspan(s, 1);
      PgResult part = policy_loss(b, cfg, denom);
      sum += part.loss;
      for (int t = 0; t < 4; ++t) EXPECT_FLOAT_EQ(part.grad[t], full.grad[4 * s + t]) << aggregation_name(agg);
    }
    EXPECT_NEAR(sum, full.loss, 1e-12) << aggregation_name(agg);
  }
}

// The whole batch loss (clipping, TIS, KL, every aggregation) against central differences in each
// log-prob. Inputs are float, so the step actually taken is measured in float.
TEST(RlGrpo, BatchGradientMatchesFiniteDifferences) {
  const int n = 3, T = 5;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-0.4f, 0.4f);
  std::vector<float> logp(n * T), old(n * T), roll(n * T), ref(n * T), adv{1.2f, -0.7f, 0.3f};
  std::vector<uint8_t> mask{1, 1, 1, 0, 0, /**/ 1, 1, 1, 1, 1, /**/ 0, 0, 0, 0, 0};
  for (int i = 0; i < n * T; ++i) {
    old[i] = -1.5f + u(rng);
    logp[i] = old[i] + u(rng);
    roll[i] = old[i] + 2 * u(rng);
    ref[i] = old[i] + u(rng);
  }
  for (Aggregation agg : {Aggregation::TokenMean, Aggregation::SeqMean, Aggregation::SeqSumNorm}) {
    PgConfig cfg;
    cfg.aggregation = agg;
    cfg.norm_len = 6;
    cfg.kl_coef = 0.3;
    cfg.tis = true;
    cfg.tis_cap = 1.2;
    auto loss_at = [&](const std::vector<float>& lp) {
      PgBatch b{n, T, lp, old, roll, ref, mask, adv};
      return policy_loss(b, cfg);
    };
    PgResult base = loss_at(logp);
    EXPECT_GT(base.clip_frac, 0.0);  // the check covers clipped tokens too
    EXPECT_GT(base.tis_clip_frac, 0.0);
    for (int i = 0; i < n * T; ++i) {
      if (!mask[i]) {
        EXPECT_EQ(base.grad[i], 0.f);
        continue;
      }
      double r = std::exp(static_cast<double>(logp[i]) - old[i]);
      if (std::fabs(r - 0.8) < 0.01 || std::fabs(r - 1.2) < 0.01) continue;
      std::vector<float> up = logp, dn = logp;
      up[i] = logp[i] + 1e-3f;
      dn[i] = logp[i] - 1e-3f;
      double step = static_cast<double>(up[i]) - dn[i];
      double fd = (loss_at(up).loss - loss_at(dn).loss) / step;
      EXPECT_NEAR(base.grad[i], fd, 2e-4 * (1 + std::fabs(fd))) << aggregation_name(agg) << " token " << i;
    }
  }
}

TEST(RlGrpo, TisAndClipDiagnostics) {
  // One token: logp_old - logp_rollout = log 3 -> weight 3 capped at 2; r = e^0.5 clipped (A > 0).
  std::vector<float> logp{-0.5f}, old{-1.0f}, roll{static_cast<float>(-1.0 - std::log(3.0))};
  std::vector<uint8_t> mask{1};
  std::vector<float> adv{1.0f};
  PgConfig cfg;
  cfg.tis = true;
  cfg.tis_cap = 2.0;
  cfg.clip_high = 0.28;
  PgBatch b{1, 1, logp, old, roll, {}, mask, adv};
  PgResult r = policy_loss(b, cfg);
  EXPECT_DOUBLE_EQ(r.tis_weight_mean, 2.0);
  EXPECT_DOUBLE_EQ(r.tis_clip_frac, 1.0);
  EXPECT_DOUBLE_EQ(r.clip_frac, 1.0);
  EXPECT_NEAR(r.loss, -2.0 * 1.28, 1e-6);
  EXPECT_EQ(r.grad[0], 0.f);
  EXPECT_NEAR(r.ratio_mean, std::exp(0.5), 1e-6);
  cfg.kl_coef = 0.1;  // a KL penalty without reference log-probs is an error
  EXPECT_THROW(policy_loss(b, cfg), quads::Error);
  cfg.kl_coef = 0;
  b.logp_rollout = {};
  EXPECT_THROW(policy_loss(b, cfg), quads::Error);
}

TEST(RlGrpo, MismatchStatsHandComputed) {
  std::vector<float> trainer{-1.0f, -2.0f, -0.5f, -3.0f, -1.0f};
  std::vector<float> rollout{-1.05f, -1.8f, -0.8f, -3.0f, -9.0f};
  std::vector<uint8_t> mask{1, 1, 1, 1, 0};
  Mismatch m;
  m.add(trainer, rollout, mask);
  // d = trainer - rollout over the masked tokens (computed from the float inputs)
  double d[4];
  for (int i = 0; i < 4; ++i) d[i] = static_cast<double>(trainer[i]) - rollout[i];
  EXPECT_EQ(m.n, 4);
  EXPECT_NEAR(m.mean_abs(), (std::fabs(d[0]) + std::fabs(d[1]) + std::fabs(d[2])) / 4, 1e-12);
  EXPECT_NEAR(m.max_abs, 0.3, 1e-6);
  EXPECT_DOUBLE_EQ(m.frac_above(), 0.5);  // 0.2 and 0.3 exceed 0.1; 0.05 and 0 do not
  double k3 = 0;
  for (double x : d) k3 += std::exp(x) - x - 1;
  EXPECT_NEAR(m.k3(), k3 / 4, 1e-12);
  EXPECT_NEAR(m.mean_diff(), (d[0] + d[1] + d[2]) / 4, 1e-12);
  EXPECT_GT(m.mean_diff(), 0.0);  // trainer - rollout: positive here

  // Merging two halves equals adding everything at once.
  Mismatch a, b;
  a.add(std::span(trainer).first(2), std::span(rollout).first(2), std::span(mask).first(2));
  b.add(std::span(trainer).subspan(2), std::span(rollout).subspan(2), std::span(mask).subspan(2));
  a.merge(b);
  EXPECT_EQ(a.n, m.n);
  EXPECT_DOUBLE_EQ(a.max_abs, m.max_abs);
  EXPECT_NEAR(a.sum_k3, m.sum_k3, 1e-15);
  EXPECT_THROW(m.add(trainer, std::span(rollout).first(3)), quads::Error);
}

// The k3 statistic over tokens sampled by the rollout estimates KL(rollout || trainer), as
// documented, and not the reverse direction.
TEST(RlGrpo, MismatchK3EstimatesKlRolloutToTrainer) {
  const double q[3] = {0.6, 0.3, 0.1};   // rollout
  const double p[3] = {0.45, 0.35, 0.2};  // trainer
  double kl_qp = 0, kl_pq = 0;
  for (int i = 0; i < 3; ++i) {
    kl_qp += q[i] * std::log(q[i] / p[i]);
    kl_pq += p[i] * std::log(p[i] / q[i]);
  }
  ASSERT_GT(std::fabs(kl_qp - kl_pq), 0.005);
  std::mt19937_64 rng(11);
  std::discrete_distribution<int> sample({q[0], q[1], q[2]});
  const int N = 200000;
  std::vector<float> lt(N), lr(N);
  for (int i = 0; i < N; ++i) {
    int k = sample(rng);
    lt[i] = static_cast<float>(std::log(p[k]));
    lr[i] = static_cast<float>(std::log(q[k]));
  }
  Mismatch m;
  m.add(lt, lr);
  EXPECT_NEAR(m.k3(), kl_qp, 0.0015);
  EXPECT_GT(std::fabs(m.k3() - kl_pq), 0.003);
}
