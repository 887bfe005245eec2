#pragma once
// Token sampling for the rollout engine: greedy, temperature, top-k, top-p, with a counter-based
// random number generator so that a sequence's draws are a pure function of (seed, position).
//
// The draw for the token at position `pos` of a sequence with seed `seed` (pos = the index the
// new token will have in the sequence, prompt included) is
//   u = uniform53(philox4x32_10(counter = {pos lo, pos hi, 0, 0}, key = {seed lo, seed hi}))
// so it never depends on other sequences, on the batch, on threads or on how many tokens were
// drawn before. Together with the model's row-invariant forward this makes generation
// batch-invariant.
//
// Log-probabilities. With z_v = double(logit_v) / T and m = max_v z_v (T = the temperature, 1
// for greedy), the returned log-prob of the chosen token is
//   logp = z_tok - (m + log(sum_v exp(z_v - m)))      (float64, vocabulary order, then float)
// i.e. the log-softmax of the TEMPERATURE-SCALED logits the sampler saw: the log-prob of the
// policy the sample came from. For T = 1 this is bitwise train::token_logprobs (the trainer's
// formula), so a trainer in the same numerics reproduces it exactly. Top-k / top-p truncation is
// NOT reflected: the value is under the full tempered distribution, which is what a trainer can
// recompute from its own logits. For the truncated policy use logp - Draw::log_kept_mass.
#include <cstdint>
#include <string>
#include <vector>

#include "rollout/philox.h"  // philox4x32_10, uniform_draw

namespace quads::rollout {

struct SamplingParams {
  bool greedy = false;       // argmax (lowest id on ties); same as temperature == 0
  double temperature = 1.0;  // > 0 for sampling
  int top_k = 0;             // keep the k largest logits (ties: lower id first); 0 = off
  double top_p = 1.0;        // nucleus over the (top-k) renormalized probabilities; 1 = off

  bool is_greedy() const { return greedy || temperature == 0.0; }
  void validate(const std::string& what = "sampling") const;  // throws quads::Error naming the field
  std::string describe() const;
};

struct Draw {
  int32_t token = -1;
  float logprob = 0;          // see the top of this file
  double log_kept_mass = 0;   // log of the tempered probability mass top-k/top-p kept (0: all)
};

// Samples one token from a row of V float32 logits. Throws quads::Error (naming `pos`) if the
// logits are not finite. A pure function of (logits, params, seed, pos); thread-safe.
Draw sample(const float* logits, int64_t V, const SamplingParams& p, uint64_t seed, uint64_t pos);

// One draw a step's caller wants: from row `row` of the step's [rows, V] logits (a prompt shared
// by several requests gives one row several draws). `request` names the job in errors.
struct SampleJob {
  int64_t row = 0;
  int request = 0;
  SamplingParams params;
  uint64_t seed = 0, pos = 0;
};
// The jobs whose draw a GPU backend can make on the device: greedy, or the full tempered
// distribution (no top-k / top-p truncation).
inline bool device_samplable(const SamplingParams& p, int64_t V) {
  return p.is_greedy() || ((p.top_k <= 0 || p.top_k >= V) && p.top_p >= 1.0);
}
// sample() for every job (in parallel: each draw is a pure function of its row and job); a failure
// throws quads::Error "rollout: request R: ..." for the first failing job.
std::vector<Draw> sample_jobs(const float* logits, int64_t V, const std::vector<SampleJob>& jobs);

// Tests and benchmarks: top-p over the whole vocabulary finds the nucleus by binning the logits
// and sorting one bin (O(V), the default) or, when off, by sorting blocks of the vocabulary.
// The nucleus is the same; the walk order inside it (hence which token a draw maps to) is not.
void set_fast_nucleus(bool on);

}  // namespace quads::rollout
