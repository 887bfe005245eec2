// Losses on logits and their dlogits (finite differences), and AdamW against a hand computation.
#include <gtest/gtest.h>

#include <cmath>

#include "../model/model_test_util.h"
#include "train/adamw.h"
#include "train/losses.h"

using namespace quads;
using test::random_normal;

namespace {
double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}
// Directional derivative of f at x along u (central differences, Richardson).
template <typename F>
double fd(F f, const std::vector<float>& x, const std::vector<float>& u, double eps = 1e-2) {
  auto c = [&](double e) {
    std::vector<float> a(x), b(x);
    for (size_t i = 0; i < x.size(); ++i) {
      a[i] = static_cast<float>(x[i] + e * u[i]);
      b[i] = static_cast<float>(x[i] - e * u[i]);
    }
    return (f(a) - f(b)) / (2 * e);
  };
  return (4 * c(eps / 2) - c(eps)) / 3;
}
// The same check without the float32 rounding of the perturbed inputs: the change of f between
// the two float points a, b against <grad, a - b> (central, so exact to second order).
template <typename F>
double rel_err_exact(F f, const std::vector<float>& x, const std::vector<float>& u, const std::vector<float>& g,
                     double eps = 1e-3) {
  std::vector<float> a(x), b(x);
  double lin = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    a[i] = static_cast<float>(x[i] + eps * u[i]);
    b[i] = static_cast<float>(x[i] - eps * u[i]);
    lin += double(g[i]) * (double(a[i]) - double(b[i]));
  }
  return std::fabs((f(a) - f(b)) - lin) / std::fabs(lin);
}
}  // namespace

TEST(Losses, NextTokenTargetsStopAtSequenceEnds) {
  const auto b = model::Batch::of({{5, 6, 7}, {8}, {9, 10}});
  EXPECT_EQ(train::next_token_targets(b), (std::vector<int32_t>{6, 7, -1, -1, 10, -1}));
}

TEST(Losses, WeightedCrossEntropyValueAndGradient) {
  const int64_t T = 6, V = 11;
  const auto logits = random_normal(T * V, 1, 2.f);
  const std::vector<int32_t> tg = {3, -1, 0, 10, 7, 2};
  const std::vector<float> w = {1.f, 5.f, 0.5f, 2.f, 0.f, 1.f};
  std::vector<float> d(T * V);
  const double L = train::cross_entropy(logits.data(), T, V, tg.data(), w.data(), d.data());
  double num = 0, den = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] < 0) continue;
    double mx = -1e300, s = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits[t * V + v]));
    for (int64_t v = 0; v < V; ++v) s += std::exp(logits[t * V + v] - mx);
    num += w[t] * (mx + std::log(s) - logits[t * V + tg[t]]);
    den += w[t];
  }
  EXPECT_NEAR(L, num / den, 1e-12);
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(d[1 * V + v], 0.f);  // no target
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(d[4 * V + v], 0.f);  // weight 0
  auto f = [&](const std::vector<float>& x) { return train::cross_entropy(x.data(), T, V, tg.data(), w.data(), nullptr); };
  const auto u = random_normal(T * V, 2);
  EXPECT_LT(rel_err_exact(f, logits, u, d), 1e-5);
  // An explicit denominator (gradient accumulation over micro-batches) scales the loss.
  EXPECT_NEAR(train::cross_entropy(logits.data(), T, V, tg.data(), w.data(), nullptr, 10.0), num / 10.0, 1e-12);
}

TEST(Losses, LogSoftmaxLogprobsAndEntropy) {
  const int64_t T = 4, V = 9;
  const auto logits = random_normal(T * V, 3, 3.f);
  const std::vector<int32_t> tg = {1, 8, -1, 0};
  std::vector<float> ls(T * V), lp(T), H(T);
  train::log_softmax(logits.data(), T, V, ls.data());
  train::token_logprobs(logits.data(), T, V, tg.data(), lp.data());
  train::entropy(logits.data(), T, V, H.data());
  for (int64_t t = 0; t < T; ++t) {
    double s = 0, h = 0;
    for (int64_t v = 0; v < V; ++v) {
      s += std::exp(ls[t * V + v]);
      h -= std::exp(ls[t * V + v]) * ls[t * V + v];
    }
    EXPECT_NEAR(s, 1.0, 1e-6);
    EXPECT_NEAR(H[t], h, 1e-5);
    if (tg[t] >= 0) {
      EXPECT_EQ(lp[t], ls[t * V + tg[t]]);
    }
  }
  EXPECT_EQ(lp[2], 0.f);
  const auto glp = random_normal(T, 4), gH = random_normal(T, 5), u = random_normal(T * V, 6);
  std::vector<float> d(T * V, 0.f);
  train::token_logprobs_backward(logits.data(), T, V, tg.data(), glp.data(), d.data());
  train::entropy_backward(logits.data(), T, V, gH.data(), d.data());  // accumulates
  auto f = [&](const std::vector<float>& x) {
    std::vector<float> a(T), b(T);
    train::token_logprobs(x.data(), T, V, tg.data(), a.data());
    train::entropy(x.data(), T, V, b.data());
    return dot(a, glp) + dot(b, gH);
  };
  // f is a sum of float32 outputs: a larger step keeps their rounding small against the change.
  EXPECT_LT(rel_err_exact(f, logits, u, d, 1e-2), 2e-4);
}

TEST(AdamW, OneStepMatchesHandComputation) {
  // Two parameters with decay, one without; gradient norm 5 clipped to 1.
  train::AdamWConfig c;
  c.lr = 0.1;
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  c.eps = 1e-8;
  c.weight_decay = 0.5;
  c.max_grad_norm = 1.0;
  train::AdamW opt(3, c, {1, 1, 0});
  std::vector<float> p = {1.0f, -2.0f, 3.0f}, g = {3.0f, 0.0f, -4.0f};
  const double norm = opt.step(p.data(), g.data());
  EXPECT_DOUBLE_EQ(norm, 5.0);
  const double coef = 1.0 / (5.0 + 1e-6);
  EXPECT_FLOAT_EQ(g[0], float(3.0 * coef));
  // Step 1: m = 0.1 g, v = 0.01 g^2; bias corrections 0.1 and 0.01:
  // update = lr * (m / 0.1) / (sqrt(v) / 0.1 + eps) = lr * g / (|g| + eps) ~ lr * sign(g).
  auto expect = [&](double p0, double gg, bool decay) {
    const double pd = decay ? p0 * (1 - 0.1 * 0.5) : p0;
    const double m = 0.1 * gg, v = 0.01 * gg * gg;
    return pd - (0.1 / 0.1) * m / (std::sqrt(v) / std::sqrt(0.01) + 1e-8);
  };
  EXPECT_FLOAT_EQ(p[0], float(expect(1.0, float(3.0 * coef), true)));
  EXPECT_FLOAT_EQ(p[1], float(expect(-2.0, 0.0, true)));   // decay only
  EXPECT_FLOAT_EQ(p[2], float(expect(3.0, float(-4.0 * coef), false)));
  EXPECT_NEAR(p[0], 1.0 * 0.95 - 0.1, 1e-6);
  // Step 2 without clipping (small gradient), hand-computed moments.
  const float m0 = opt.m[0], v0 = opt.v[0];
  std::vector<float> g2 = {0.5f, 0.f, 0.f};
  const float p0 = p[0];
  opt.step(p.data(), g2.data());
  const double m1 = 0.9 * m0 + 0.1 * 0.5, v1 = 0.99 * v0 + 0.01 * 0.25;
  const double want = p0 * (1 - 0.05) - (0.1 / (1 - 0.81)) * m1 / (std::sqrt(v1) / std::sqrt(1 - 0.9801) + 1e-8);
  EXPECT_FLOAT_EQ(p[0], float(want));
  EXPECT_EQ(opt.t, 2);
}

TEST(AdamW, DecayMaskSkipsNorms) {
  const auto layout = model::Layout::build(test::tiny_config());
  const auto mask = train::AdamW::decay_mask(layout);
  EXPECT_EQ(mask[layout.at("model.layers.0.input_layernorm.weight").offset], 0);
  EXPECT_EQ(mask[layout.at("model.layers.0.self_attn.q_norm.weight").offset], 0);
  EXPECT_EQ(mask[layout.at("model.layers.0.self_attn.q_proj.weight").offset], 1);
  EXPECT_EQ(mask[layout.at("model.embed_tokens.weight").offset], 1);
  EXPECT_EQ(train::global_norm(std::vector<float>{3, 4}.data(), 2), 5.0);
}
