#pragma once
// GRPO math as pure functions: group-normalized advantages, the clipped policy-gradient loss per
// token with its gradient with respect to the new log-probs, the k3 KL penalty, loss aggregation,
// truncated importance sampling (TIS), and rollout/trainer mismatch diagnostics. No model here:
// the trainer computes log-probs, calls policy_loss, and backpropagates grad through its
// log-softmax. All sums run sequentially in double, so results are bitwise repeatable.
//
// Names of the log-probs of one sampled token y_t (all natural log):
//   logp          log pi_theta(y_t): trainer, current parameters (the one differentiated)
//   logp_old      log pi_old(y_t): trainer numerics, parameters at rollout time (PPO's "old")
//   logp_rollout  log-prob the rollout engine reported while sampling (e.g. NVFP4 numerics)
//   logp_ref      log pi_ref(y_t): reference policy for the KL penalty
//
// Per-token loss (minimized), with ratio r = exp(logp - logp_old) and advantage A of the sequence:
//   l_t = -w_t * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * k3_t
//   w_t  = min(exp(logp_old - logp_rollout), tis_cap)   with TIS on, else 1 (a constant: detached)
//   k3_t = exp(logp_ref - logp) - (logp_ref - logp) - 1  (Schulman's k3 estimate of KL(pi||pi_ref))
// Gradients:
//   d(-min(...))/dlogp = -r A when the unclipped term is the minimum or r lies inside the clip
//                        range; 0 when the clipped term is active (r outside the range, on the side
//                        where A pushes it further out)
//   dk3/dlogp          = 1 - exp(logp_ref - logp)
//
// Aggregation over a batch of N sequences with masks m_it (|o_i| = sum_t m_it):
//   TokenMean   L = sum_it m_it l_it / sum_it m_it            (DAPO; every token weighs the same)
//   SeqMean     L = (1/N) sum_i (1/|o_i|) sum_t m_it l_it     (original GRPO; every sequence the same)
//   SeqSumNorm  L = sum_it m_it l_it / (N * norm_len)         (Dr. GRPO: a constant length norm_len)
// With gradient accumulation over minibatches, pass the whole batch's token count (TokenMean) or
// sequence count (SeqMean, SeqSumNorm) as `denominator` so that the minibatch losses add up to the
// batch loss; 0 means "this call's own count". A sequence with |o_i| = 0 contributes nothing.
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace quads::rl {

// ---- advantages ------------------------------------------------------------------------------
struct AdvantageConfig {
  bool scale_by_std = true;  // false: Dr. GRPO, A = r - mean
  bool unbiased_std = true;  // std with 1/(G-1) (torch.std, TRL) or 1/G
  double eps = 1e-6;         // A = (r - mean) / (std + eps)
};

// rewards: [n_groups * G], each group's G samples consecutive. Returns the advantage per sample;
// a group whose rewards are all equal gets 0 for every member. G >= 2 (G >= 1 without scale_by_std).
std::vector<float> group_advantages(std::span<const float> rewards, int G, const AdvantageConfig& cfg);

struct GroupStats {
  double reward_mean = 0;   // over all samples
  double frac_uniform = 0;  // groups whose rewards are all equal (no learning signal)
  double frac_solved = 0;   // groups with at least one reward > 0
};
GroupStats group_stats(std::span<const float> rewards, int G);

// ---- per-token terms (scalars, double) --------------------------------------------------------
struct PgToken {
  double loss;   // -min(r A, clip(r) A)
  double grad;   // d loss / d logp
  bool clipped;  // the clipped term is active (grad 0)
};
PgToken clipped_pg_token(double logp, double logp_old, double adv, double clip_low, double clip_high);

double k3_kl(double logp, double logp_ref);       // exp(logp_ref - logp) - (logp_ref - logp) - 1
double k3_kl_grad(double logp, double logp_ref);  // d/dlogp: 1 - exp(logp_ref - logp)
double tis_weight(double logp_old, double logp_rollout, double cap);  // min(exp(old - rollout), cap)

// ---- batch loss ------------------------------------------------------------------------------
enum class Aggregation : uint8_t { TokenMean, SeqMean, SeqSumNorm };
const char* aggregation_name(Aggregation a);  // "token_mean", "seq_mean", "seq_sum_norm"
Aggregation parse_aggregation(std::string_view s);

struct PgConfig {
  double clip_low = 0.2, clip_high = 0.2;
  double kl_coef = 0;  // > 0 needs logp_ref
  bool tis = false;    // needs logp_rollout
  double tis_cap = 2.0;
  Aggregation aggregation = Aggregation::TokenMean;
  double norm_len = 0;  // SeqSumNorm's constant length (e.g. max new tokens); must be > 0 there
};

// Padded layout: every array is [n_seqs, T] row-major except adv [n_seqs]. mask 1 marks response
// tokens that count (prompt and padding are 0). Optional arrays are empty spans.
struct PgBatch {
  int64_t n_seqs = 0, T = 0;
  std::span<const float> logp, logp_old, logp_rollout, logp_ref;
  std::span<const uint8_t> mask;
  std::span<const float> adv;
};

struct PgResult {
  double loss = 0;          // the aggregated L
  std::vector<float> grad;  // dL/dlogp, [n_seqs, T], 0 where mask is 0
  // Diagnostics, token means over masked tokens (not scaled by the aggregation):
  double pg_loss = 0;        // mean of -w * min(...)
  double kl = 0;             // mean k3 (0 when kl_coef == 0 and no logp_ref)
  double clip_frac = 0;      // share of tokens whose clipped term is active
  double ratio_mean = 0, ratio_max = 0;
  double tis_weight_mean = 1, tis_clip_frac = 0;  // share of tokens whose TIS weight hit the cap
  int64_t n_tokens = 0;
};

// `denominator`: see the aggregation notes above (0: this batch's own count).
PgResult policy_loss(const PgBatch& b, const PgConfig& cfg, double denominator = 0);

// ---- rollout/trainer mismatch ------------------------------------------------------------------
// For the sampled tokens, d = logp_trainer - logp_rollout:
//   mean |d|, max |d|, share of tokens with |d| > threshold (0.1 by default), and the k3 estimate
//   mean(exp(d) - d - 1). The tokens were sampled by the rollout, so with q = pi_rollout and
//   p = pi_trainer, E_q[p/q - log(p/q) - 1] = KL(q || p): this estimates KL(rollout || trainer),
//   per token, and is >= 0 term by term.
// Sums are kept so that minibatches (or steps) merge exactly: call add() repeatedly, read after.
struct Mismatch {
  double threshold = 0.1;
  double sum_abs = 0, sum_diff = 0, sum_k3 = 0, max_abs = 0;
  int64_t n_above = 0, n = 0;

  void add(std::span<const float> logp_trainer, std::span<const float> logp_rollout,
           std::span<const uint8_t> mask = {});  // empty mask: every token counts
  void merge(const Mismatch& o);
  double mean_abs() const { return n ? sum_abs / n : 0; }
  double mean_diff() const { return n ? sum_diff / n : 0; }  // signed: trainer - rollout
  double k3() const { return n ? sum_k3 / n : 0; }
  double frac_above() const { return n ? static_cast<double>(n_above) / n : 0; }
};

}  // namespace quads::rl
