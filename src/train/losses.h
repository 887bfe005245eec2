#pragma once
// Losses on logits, each with its gradient dL/dlogits: the model's backward takes dlogits, so any
// loss (SFT cross-entropy, the RL policy-gradient loss, entropy terms) is expressed by its caller
// as a gradient on the logits. Logits are [T, V] rows (float32); every per-row quantity is
// computed in float64 from a max-subtracted float32 row. Parallel over rows; totals are summed in
// row order, so results are bitwise repeatable.
#include <cstdint>
#include <vector>

#include "model/model.h"

namespace quads::train {

// Next-token targets of a packed batch: targets[t] = tokens[t+1] inside a sequence, -1 at the last
// token of each sequence (no target).
std::vector<int32_t> next_token_targets(const model::Batch& b);

// out[t, :] = log_softmax(logits[t, :]).
void log_softmax(const float* logits, int64_t T, int64_t V, float* out);

// Weighted mean cross-entropy: sum_t w_t * (-log p_t(target_t)) / denom over rows with
// target >= 0, w_t = weights[t] (1 when weights is null), denom = sum of those w_t unless
// denom > 0 is given (e.g. the token count of a whole accumulated batch). Returns the loss;
// writes dlogits (when non-null) = its gradient, zero on rows without a target.
double cross_entropy(const float* logits, int64_t T, int64_t V, const int32_t* targets, const float* weights,
                     float* dlogits, double denom = 0);

// logp[t] = log p_t(target_t) (0 where target < 0).
void token_logprobs(const float* logits, int64_t T, int64_t V, const int32_t* targets, float* logp);
// dlogits[t] += dlogp[t] * (onehot(target_t) - p_t).
void token_logprobs_backward(const float* logits, int64_t T, int64_t V, const int32_t* targets, const float* dlogp,
                             float* dlogits);

// H[t] = -sum_v p log p.
void entropy(const float* logits, int64_t T, int64_t V, float* H);
// dlogits[t] += dH[t] * (-p * (log p + H)).
void entropy_backward(const float* logits, int64_t T, int64_t V, const float* dH, float* dlogits);

}  // namespace quads::train
