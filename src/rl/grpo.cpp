#include "rl/grpo.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace quads::rl {

std::vector<float> group_advantages(std::span<const float> rewards, int G, const AdvantageConfig& cfg) {
  QUADS_CHECK(G >= 1, "group size G = {} must be >= 1", G);
  QUADS_CHECK(!(cfg.scale_by_std && cfg.unbiased_std && G < 2),
              "group size G = {}: the unbiased std needs G >= 2", G);
  QUADS_CHECK(rewards.size() % static_cast<size_t>(G) == 0, "{} rewards are not a whole number of groups of {}",
              rewards.size(), G);
  std::vector<float> adv(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += static_cast<size_t>(G)) {
    double mean = 0;
    for (int i = 0; i < G; ++i) mean += rewards[g + i];
    mean /= G;
    double ss = 0;
    bool uniform = true;
    for (int i = 0; i < G; ++i) {
      double d = rewards[g + i] - mean;
      ss += d * d;
      uniform = uniform && rewards[g + i] == rewards[g];
    }
    // Equal rewards give exactly 0 (not a rounding residue divided by eps).
    if (uniform) {
      for (int i = 0; i < G; ++i) adv[g + i] = 0.f;
      continue;
    }
    double scale = 1;
    if (cfg.scale_by_std) scale = 1.0 / (std::sqrt(ss / (cfg.unbiased_std ? G - 1 : G)) + cfg.eps);
    for (int i = 0; i < G; ++i) adv[g + i] = static_cast<float>((rewards[g + i] - mean) * scale);
  }
  return adv;
}

GroupStats group_stats(std::span<const float> rewards, int G) {
  QUADS_CHECK(G >= 1 && rewards.size() % static_cast<size_t>(G) == 0,
              "{} rewards are not a whole number of groups of {}", rewards.size(), G);
  GroupStats s;
  if (rewards.empty()) return s;
  size_t groups = rewards.size() / static_cast<size_t>(G), uniform = 0, solved = 0;
  double sum = 0;
  for (size_t g = 0; g < rewards.size(); g += static_cast<size_t>(G)) {
    bool all_equal = true, any = false;
    for (int i = 0; i < G; ++i) {
      sum += rewards[g + i];
      all_equal = all_equal && rewards[g + i] == rewards[g];
      any = any || rewards[g + i] > 0;
    }
    uniform += all_equal;
    solved += any;
  }
  s.reward_mean = sum / static_cast<double>(rewards.size());
  s.frac_uniform = static_cast<double>(uniform) / static_cast<double>(groups);
  s.frac_solved = static_cast<double>(solved) / static_cast<double>(groups);
  return s;
}

PgToken clipped_pg_token(double logp, double logp_old, double adv, double clip_low, double clip_high) {
  double r = std::exp(logp - logp_old);
  double rc = std::clamp(r, 1.0 - clip_low, 1.0 + clip_high);
  double unclipped = r * adv, clipped = rc * adv;
  // min(u, c) picks c only when r is outside the range on the side the advantage pushes towards;
  // then the objective is constant in logp.
  if (unclipped <= clipped) return {-unclipped, -unclipped, false};
  return {-clipped, 0.0, true};
}

double k3_kl(double logp, double logp_ref) {
  double d = logp_ref - logp;
  return std::exp(d) - d - 1.0;
}

double k3_kl_grad(double logp, double logp_ref) { return 1.0 - std::exp(logp_ref - logp); }

double tis_weight(double logp_old, double logp_rollout, double cap) {
  return std::min(std::exp(logp_old - logp_rollout), cap);
}

const char* aggregation_name(Aggregation a) {
  switch (a) {
    case Aggregation::TokenMean: return "token_mean";
    case Aggregation::SeqMean: return "seq_mean";
    case Aggregation::SeqSumNorm: return "seq_sum_norm";
  }
  return "?";
}

Aggregation parse_aggregation(std::string_view s) {
  for (Aggregation a : {Aggregation::TokenMean, Aggregation::SeqMean, Aggregation::SeqSumNorm})
    if (s == aggregation_name(a)) return a;
  fail("unknown loss aggregation \"{}\" (known: token_mean, seq_mean, seq_sum_norm)", s);
}

PgResult policy_loss(const PgBatch& b, const PgConfig& cfg, double denominator) {
  const size_t n = static_cast<size_t>(b.n_seqs), T = static_cast<size_t>(b.T), nt = n * T;
  QUADS_CHECK(b.n_seqs >= 0 && b.T >= 0, "policy_loss: negative shape [{}, {}]", b.n_seqs, b.T);
  QUADS_CHECK(b.logp.size() == nt, "policy_loss: logp has {} values, expected {}", b.logp.size(), nt);
  QUADS_CHECK(b.logp_old.size() == nt, "policy_loss: logp_old has {} values, expected {}", b.logp_old.size(), nt);
  QUADS_CHECK(b.mask.size() == nt, "policy_loss: mask has {} values, expected {}", b.mask.size(), nt);
  QUADS_CHECK(b.adv.size() == n, "policy_loss: adv has {} values, expected {}", b.adv.size(), n);
  QUADS_CHECK(!cfg.tis || b.logp_rollout.size() == nt, "policy_loss: TIS needs logp_rollout of {} values, got {}",
              nt, b.logp_rollout.size());
  const bool has_ref = !b.logp_ref.empty();
  QUADS_CHECK(!has_ref || b.logp_ref.size() == nt, "policy_loss: logp_ref has {} values, expected {}",
              b.logp_ref.size(), nt);
  QUADS_CHECK(cfg.kl_coef == 0 || has_ref, "policy_loss: kl_coef {} needs logp_ref", cfg.kl_coef);
  QUADS_CHECK(cfg.clip_low >= 0 && cfg.clip_low < 1 && cfg.clip_high >= 0,
              "policy_loss: clip range [1-{}, 1+{}] is invalid", cfg.clip_low, cfg.clip_high);
  QUADS_CHECK(cfg.aggregation != Aggregation::SeqSumNorm || cfg.norm_len > 0,
              "policy_loss: seq_sum_norm needs norm_len > 0");

  PgResult res;
  res.grad.assign(nt, 0.f);
  int64_t n_tokens = 0;
  for (size_t i = 0; i < nt; ++i) n_tokens += b.mask[i] != 0;
  res.n_tokens = n_tokens;

  double seq_denom = denominator > 0 ? denominator : static_cast<double>(n);
  double sum_loss = 0, sum_pg = 0, sum_kl = 0, sum_ratio = 0, sum_w = 0;
  int64_t n_clip = 0, n_tis_clip = 0;
  for (size_t s = 0; s < n; ++s) {
    int64_t len = 0;
    for (size_t t = 0; t < T; ++t) len += b.mask[s * T + t] != 0;
    if (len == 0) continue;
    // The weight every token of this sequence gets in L.
    double scale = 0;
    switch (cfg.aggregation) {
      case Aggregation::TokenMean: scale = 1.0 / (denominator > 0 ? denominator : static_cast<double>(n_tokens)); break;
      case Aggregation::SeqMean: scale = 1.0 / (static_cast<double>(len) * seq_denom); break;
      case Aggregation::SeqSumNorm: scale = 1.0 / (seq_denom * cfg.norm_len); break;
    }
    const double A = b.adv[s];
    for (size_t t = 0; t < T; ++t) {
      size_t i = s * T + t;
      if (!b.mask[i]) continue;
      PgToken pg = clipped_pg_token(b.logp[i], b.logp_old[i], A, cfg.clip_low, cfg.clip_high);
      double w = 1;
      if (cfg.tis) {
        double raw = std::exp(static_cast<double>(b.logp_old[i]) - b.logp_rollout[i]);
        w = std::min(raw, cfg.tis_cap);
        n_tis_clip += raw > cfg.tis_cap;
      }
      double l = w * pg.loss, g = w * pg.grad;
      if (has_ref) {
        double kl = k3_kl(b.logp[i], b.logp_ref[i]);
        sum_kl += kl;
        l += cfg.kl_coef * kl;
        g += cfg.kl_coef * k3_kl_grad(b.logp[i], b.logp_ref[i]);
      }
      double r = std::exp(static_cast<double>(b.logp[i]) - b.logp_old[i]);
      sum_ratio += r;
      res.ratio_max = std::max(res.ratio_max, r);
      sum_pg += w * pg.loss;
      sum_w += w;
      n_clip += pg.clipped;
      sum_loss += scale * l;
      res.grad[i] = static_cast<float>(scale * g);
    }
  }
  res.loss = sum_loss;
  if (n_tokens > 0) {
    double nd = static_cast<double>(n_tokens);
    res.pg_loss = sum_pg / nd;
    res.kl = sum_kl / nd;
    res.clip_frac = static_cast<double>(n_clip) / nd;
    res.ratio_mean = sum_ratio / nd;
    res.tis_weight_mean = sum_w / nd;
    res.tis_clip_frac = static_cast<double>(n_tis_clip) / nd;
  }
  return res;
}

void Mismatch::add(std::span<const float> logp_trainer, std::span<const float> logp_rollout,
                   std::span<const uint8_t> mask) {
  QUADS_CHECK(logp_trainer.size() == logp_rollout.size(), "mismatch: {} trainer log-probs but {} rollout log-probs",
              logp_trainer.size(), logp_rollout.size());
  QUADS_CHECK(mask.empty() || mask.size() == logp_trainer.size(), "mismatch: mask has {} values, expected {}",
              mask.size(), logp_trainer.size());
  for (size_t i = 0; i < logp_trainer.size(); ++i) {
    if (!mask.empty() && !mask[i]) continue;
    double d = static_cast<double>(logp_trainer[i]) - logp_rollout[i];
    double a = std::fabs(d);
    sum_abs += a;
    sum_diff += d;
    sum_k3 += std::exp(d) - d - 1.0;
    max_abs = std::max(max_abs, a);
    n_above += a > threshold;
    ++n;
  }
}

void Mismatch::merge(const Mismatch& o) {
  QUADS_CHECK(o.threshold == threshold, "mismatch: merging statistics with thresholds {} and {}", threshold,
              o.threshold);
  sum_abs += o.sum_abs;
  sum_diff += o.sum_diff;
  sum_k3 += o.sum_k3;
  max_abs = std::max(max_abs, o.max_abs);
  n_above += o.n_above;
  n += o.n;
}

}  // namespace quads::rl
