#include "reqat/sem.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "train/losses.h"

namespace quads::reqat {

double quantile(std::vector<double> v, double q) {
  QUADS_CHECK(!v.empty(), "quantile of an empty set");
  QUADS_CHECK(q >= 0 && q <= 1, "quantile {} outside [0, 1]", q);
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return v[lo] + (v[hi] - v[lo]) * frac;
}

std::vector<double> sem_weights(const std::vector<double>& H, const SemConfig& cfg, double* tau_out,
                                double* hmin_out) {
  if (H.empty()) return {};
  const double tau = quantile(H, cfg.percentile);
  const double hmin = *std::min_element(H.begin(), H.end());
  std::vector<double> w(H.size());
  for (size_t i = 0; i < H.size(); ++i) w[i] = std::max(0.0, 1.0 - (H[i] - hmin) / (tau - hmin + cfg.eps));
  if (tau_out) *tau_out = tau;
  if (hmin_out) *hmin_out = hmin;
  return w;
}

double sem_fixed_weights(const float* logits, int64_t T, int64_t V, const std::vector<double>& w, double lambda,
                         double denom, float* dlogits) {
  QUADS_CHECK(static_cast<int64_t>(w.size()) == T, "SEM: {} weights for {} rows", w.size(), T);
  QUADS_CHECK(denom > 0, "SEM: denominator {} must be positive", denom);
  std::vector<float> H(T);
  train::entropy(logits, T, V, H.data());
  double loss = 0;
  for (int64_t t = 0; t < T; ++t) loss += w[t] * double(H[t]);
  loss *= lambda / denom;
  if (dlogits) {
    std::vector<float> dH(T);
    for (int64_t t = 0; t < T; ++t) dH[t] = static_cast<float>(lambda * w[t] / denom);
    train::entropy_backward(logits, T, V, dH.data(), dlogits);
  }
  return loss;
}

SemStats sem_loss(const float* logits, int64_t T, int64_t V, const uint8_t* mask, const SemConfig& cfg, double denom,
                  float* dlogits) {
  SemStats st;
  std::vector<float> H(T);
  train::entropy(logits, T, V, H.data());
  std::vector<double> sel;
  for (int64_t t = 0; t < T; ++t)
    if (mask[t]) sel.push_back(H[t]);
  st.n = static_cast<int64_t>(sel.size());
  if (sel.empty()) return st;
  if (denom <= 0) denom = static_cast<double>(sel.size());
  const std::vector<double> ws = sem_weights(sel, cfg, &st.tau, &st.h_min);
  std::vector<double> w(T, 0.0);
  double hsum = 0, wsum = 0;
  for (int64_t t = 0, i = 0; t < T; ++t)
    if (mask[t]) {
      w[t] = ws[i++];
      hsum += H[t];
      wsum += w[t];
    }
  st.mean_entropy = hsum / static_cast<double>(st.n);
  st.mean_weight = wsum / static_cast<double>(st.n);
  st.loss = sem_fixed_weights(logits, T, V, w, cfg.lambda, denom, dlogits);
  return st;
}

}  // namespace quads::reqat
