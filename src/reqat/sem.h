#pragma once
// Selective entropy minimization (SEM), ReQAT stage 2:
//   L_sem = lambda * sum_t w_t * H_t / N
// over the response positions t of a micro-batch (the rows the cross-entropy is computed on), with
//   H_t   the model's own entropy over the full vocabulary at t,
//   w_t   = max(0, 1 - (H_t - H_min) / (tau - H_min + eps)), DETACHED (a constant weight),
//   H_min the smallest H_t of the micro-batch, tau the `percentile` (0.75) quantile of the H_t of
//         the micro-batch (linear interpolation between order statistics, numpy's default),
//   N     the denominator of the cross-entropy (the micro-batch's response tokens by default).
// Low-entropy (confident) tokens get weight ~1, tokens above tau none: the term sharpens the
// positions where a small FP4 perturbation would otherwise flip a near-tie, and leaves genuinely
// uncertain positions alone.
#include <cstdint>
#include <vector>

namespace quads::reqat {

struct SemConfig {
  double lambda = 0.1;
  double percentile = 0.75;  // tau's quantile
  double eps = 1e-6;
};

struct SemStats {
  double loss = 0;          // lambda * sum w H / N
  double tau = 0, h_min = 0;
  double mean_entropy = 0;  // over the selected rows
  double mean_weight = 0;
  int64_t n = 0;            // selected rows
};

// The q-quantile of v (0 <= q <= 1), linear interpolation; v non-empty.
double quantile(std::vector<double> v, double q);

// The detached weights w_t for entropies H (one per selected row).
std::vector<double> sem_weights(const std::vector<double>& H, const SemConfig& cfg, double* tau = nullptr,
                                double* h_min = nullptr);

// Adds the SEM term's gradient to dlogits [T, V] (rows where mask[t] != 0 are the response
// positions) and returns its value and statistics. denom <= 0: the number of selected rows.
SemStats sem_loss(const float* logits, int64_t T, int64_t V, const uint8_t* mask, const SemConfig& cfg, double denom,
                  float* dlogits);

// With the weights given (for gradient checks): lambda * sum_t w[t] H_t / denom over all T rows
// (w has T entries, 0 for rows that do not count); adds the gradient to dlogits when non-null.
double sem_fixed_weights(const float* logits, int64_t T, int64_t V, const std::vector<double>& w, double lambda,
                         double denom, float* dlogits);

}  // namespace quads::reqat
