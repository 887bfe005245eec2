// Selective entropy minimization: the quantile, the weights (1 at the least uncertain token, 0 from
// tau up, linear between), and the gradient against central finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"
#include "model/model_test_util.h"
#include "reqat/sem.h"
#include "train/losses.h"

using namespace quads;
using namespace quads::reqat;

TEST(ReqatSem, QuantileInterpolatesLikeNumpy) {
  EXPECT_DOUBLE_EQ(quantile({4, 1, 3, 2}, 0.75), 3.25);  // numpy.quantile([1,2,3,4], .75)
  EXPECT_DOUBLE_EQ(quantile({5, 1, 2}, 0.5), 2.0);
  EXPECT_DOUBLE_EQ(quantile({7}, 0.75), 7.0);
  EXPECT_DOUBLE_EQ(quantile({1, 2, 3, 4, 5}, 1.0), 5.0);
  EXPECT_THROW(quantile({}, 0.5), Error);
}

TEST(ReqatSem, WeightsAreOneAtMinZeroFromTau) {
  SemConfig cfg;
  cfg.eps = 0;
  const std::vector<double> H = {0.1, 0.5, 0.3, 2.0, 0.2, 1.0, 0.4, 3.0};
  double tau = 0, hmin = 0;
  const std::vector<double> w = sem_weights(H, cfg, &tau, &hmin);
  EXPECT_DOUBLE_EQ(hmin, 0.1);
  EXPECT_DOUBLE_EQ(tau, quantile(H, 0.75));
  for (size_t i = 0; i < H.size(); ++i) {
    if (H[i] >= tau) EXPECT_EQ(w[i], 0.0) << i;
    else EXPECT_NEAR(w[i], 1.0 - (H[i] - hmin) / (tau - hmin), 1e-15) << i;
    EXPECT_GE(w[i], 0.0);
    EXPECT_LE(w[i], 1.0);
  }
  EXPECT_EQ(w[0], 1.0);
}

TEST(ReqatSem, GradientMatchesFiniteDifferences) {
  const int64_t T = 6, V = 11;
  std::vector<float> logits = test::random_normal(T * V, 21, 2.0f);
  const std::vector<double> w = {1.0, 0.0, 0.4, 0.75, 0.1, 1.0};
  const double lambda = 0.3, denom = 5.0;
  std::vector<float> d(T * V, 0.f);
  sem_fixed_weights(logits.data(), T, V, w, lambda, denom, d.data());
  double worst = 0, gmax = 0;
  for (int64_t i = 0; i < T * V; ++i) {
    const float x0 = logits[i];
    const double h = 1e-2;
    logits[i] = static_cast<float>(x0 + h);
    const double up = sem_fixed_weights(logits.data(), T, V, w, lambda, denom, nullptr);
    logits[i] = static_cast<float>(x0 - h);
    const double dn = sem_fixed_weights(logits.data(), T, V, w, lambda, denom, nullptr);
    logits[i] = x0;
    const double fd = (up - dn) / (double(static_cast<float>(x0 + h)) - double(static_cast<float>(x0 - h)));
    worst = std::max(worst, std::fabs(fd - d[i]));
    gmax = std::max(gmax, std::fabs(double(d[i])));
    if (w[i / V] == 0) {
      EXPECT_EQ(d[i], 0.f);
    }
  }
  EXPECT_GT(gmax, 1e-3);
  EXPECT_LT(worst, 2e-3 * gmax);
}

TEST(ReqatSem, LossUsesMaskedRowsAndDetachedWeights) {
  const int64_t T = 9, V = 7;
  const std::vector<float> logits = test::random_normal(T * V, 22, 1.5f);
  const std::vector<uint8_t> mask = {0, 1, 1, 0, 1, 1, 1, 0, 1};
  SemConfig cfg;
  std::vector<float> d(T * V, 0.f);
  const SemStats st = sem_loss(logits.data(), T, V, mask.data(), cfg, 0, d.data());
  EXPECT_EQ(st.n, 6);
  // Same value and gradient as the fixed-weight form with the weights of the masked entropies.
  std::vector<float> H(T);
  train::entropy(logits.data(), T, V, H.data());
  std::vector<double> sel;
  for (int64_t t = 0; t < T; ++t)
    if (mask[t]) sel.push_back(H[t]);
  const std::vector<double> ws = sem_weights(sel, cfg);
  std::vector<double> w(T, 0.0);
  for (int64_t t = 0, i = 0; t < T; ++t)
    if (mask[t]) w[t] = ws[i++];
  std::vector<float> d2(T * V, 0.f);
  const double L = sem_fixed_weights(logits.data(), T, V, w, cfg.lambda, 6.0, d2.data());
  EXPECT_DOUBLE_EQ(st.loss, L);
  for (int64_t i = 0; i < T * V; ++i) ASSERT_EQ(d[i], d2[i]);
  for (int64_t t = 0; t < T; ++t)
    if (!mask[t]) {
      for (int64_t v = 0; v < V; ++v) EXPECT_EQ(d[t * V + v], 0.f);
    }
  EXPECT_GT(st.loss, 0.0);
}
