#include "train/losses.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace quads::train {

namespace {
// Max and log-sum-exp of one row, in float64.
struct RowStats {
  double max = 0, lse = 0;
};
RowStats row_stats(const float* x, int64_t V) {
  float m = x[0];
  for (int64_t v = 1; v < V; ++v) m = std::max(m, x[v]);
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]) - double(m));
  return {double(m), double(m) + std::log(s)};
}
}  // namespace

std::vector<int32_t> next_token_targets(const model::Batch& b) {
  std::vector<int32_t> t(b.tokens.size(), -1);
  for (int s = 0; s < b.nseq(); ++s)
    for (int64_t i = b.offsets[s]; i + 1 < b.offsets[s + 1]; ++i) t[i] = b.tokens[i + 1];
  return t;
}

void log_softmax(const float* logits, int64_t T, int64_t V, float* out) {
#pragma omp parallel for schedule(static) if (T * V > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = logits + t * V;
    const RowStats st = row_stats(x, V);
    for (int64_t v = 0; v < V; ++v) out[t * V + v] = static_cast<float>(double(x[v]) - st.lse);
  }
}

double cross_entropy(const float* logits, int64_t T, int64_t V, const int32_t* targets, const float* weights,
                     float* dlogits, double denom) {
  for (int64_t t = 0; t < T; ++t)
    QUADS_CHECK(targets[t] < V, "cross_entropy: target {} of row {} is outside the vocabulary ({})", targets[t], t, V);
  double wsum = 0;
  for (int64_t t = 0; t < T; ++t)
    if (targets[t] >= 0) wsum += weights ? double(weights[t]) : 1.0;
  const double D = denom > 0 ? denom : wsum;
  std::vector<double> row_loss(T, 0.0);
#pragma omp parallel for schedule(static) if (T * V > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = logits + t * V;
    float* d = dlogits ? dlogits + t * V : nullptr;
    if (targets[t] < 0 || D == 0) {
      if (d) std::fill(d, d + V, 0.f);
      continue;
    }
    const double w = weights ? double(weights[t]) : 1.0;
    const RowStats st = row_stats(x, V);
    row_loss[t] = w * (st.lse - double(x[targets[t]]));
    if (d) {
      const double g = w / D;
      for (int64_t v = 0; v < V; ++v) d[v] = static_cast<float>(g * std::exp(double(x[v]) - st.lse));
      d[targets[t]] = static_cast<float>(g * (std::exp(double(x[targets[t]]) - st.lse) - 1.0));
    }
  }
  double total = 0;
  for (int64_t t = 0; t < T; ++t) total += row_loss[t];
  return D == 0 ? 0.0 : total / D;
}

void token_logprobs(const float* logits, int64_t T, int64_t V, const int32_t* targets, float* logp) {
#pragma omp parallel for schedule(static) if (T * V > 65536)
  for (int64_t t = 0; t < T; ++t) {
    if (targets[t] < 0) {
      logp[t] = 0.f;
      continue;
    }
    const RowStats st = row_stats(logits + t * V, V);
    logp[t] = static_cast<float>(double(logits[t * V + targets[t]]) - st.lse);
  }
}

void token_logprobs_backward(const float* logits, int64_t T, int64_t V, const int32_t* targets, const float* dlogp,
                             float* dlogits) {
#pragma omp parallel for schedule(static) if (T * V > 65536)
  for (int64_t t = 0; t < T; ++t) {
    if (targets[t] < 0 || dlogp[t] == 0) continue;
    const float* x = logits + t * V;
    const RowStats st = row_stats(x, V);
    const double g = dlogp[t];
    float* d = dlogits + t * V;
    for (int64_t v = 0; v < V; ++v) {
      const double p = std::exp(double(x[v]) - st.lse);
      d[v] += static_cast<float>(g * ((v == targets[t] ? 1.0 : 0.0) - p));
    }
  }
}

void entropy(const float* logits, int64_t T, int64_t V, float* H) {
#pragma omp parallel for schedule(static) if (T * V > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = logits + t * V;
    const RowStats st = row_stats(x, V);
    double h = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double lp = double(x[v]) - st.lse;
      h -= std::exp(lp) * lp;
    }
    H[t] = static_cast<float>(h);
  }
}

void entropy_backward(const float* logits, int64_t T, int64_t V, const float* dH, float* dlogits) {
#pragma omp parallel for schedule(static) if (T * V > 65536)
  for (int64_t t = 0; t < T; ++t) {
    if (dH[t] == 0) continue;
    const float* x = logits + t * V;
    const RowStats st = row_stats(x, V);
    double h = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double lp = double(x[v]) - st.lse;
      h -= std::exp(lp) * lp;
    }
    // dH/dx_v = -p_v (log p_v + H)
    float* d = dlogits + t * V;
    for (int64_t v = 0; v < V; ++v) {
      const double lp = double(x[v]) - st.lse;
      d[v] += static_cast<float>(double(dH[t]) * (-std::exp(lp) * (lp + h)));
    }
  }
}

}  // namespace quads::train
