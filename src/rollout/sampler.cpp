#include "rollout/sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"

namespace quads::rollout {

void SamplingParams::validate(const std::string& what) const {
  QUADS_CHECK(std::isfinite(temperature) && temperature >= 0, "{}: temperature must be >= 0 (got {})", what,
              temperature);
  QUADS_CHECK(top_k >= 0, "{}: top_k must be >= 0 (0 = off; got {})", what, top_k);
  QUADS_CHECK(top_p > 0 && top_p <= 1, "{}: top_p must be in (0, 1] (got {})", what, top_p);
}

std::string SamplingParams::describe() const {
  if (is_greedy()) return "greedy";
  std::string s = fmt::format("temperature {}", temperature);
  if (top_k > 0) s += fmt::format(", top-k {}", top_k);
  if (top_p < 1) s += fmt::format(", top-p {}", top_p);
  return s;
}

namespace {

std::atomic<bool> g_fast_nucleus{true};

// Top-p over the whole vocabulary without sorting it: tokens are binned by z (kBins bins of
// kRange / kBins below the max, one more for everything lower), the bins are added from the top
// until the mass reaches `need`; every token of the bins above that boundary bin is in the
// nucleus (walked in vocabulary order) and only the boundary bin is sorted to find where the
// nucleus ends. The set is the same as a full sort gives, up to the order in which the float64
// masses are added. Returns false, leaving the caller to sort, in the rare case where that order
// makes the bins above the boundary reach `need` on their own.
template <typename Before>
bool nucleus_by_bins(const double* z, const double* e, double m, int64_t V, double need, const Before& before,
                     std::vector<int32_t>& order, int64_t& n, double& kept) {
  constexpr int kBins = 512;
  constexpr double kRange = 32.0;  // exp(-32) ~ 1e-14: lower tokens share the last bin
  thread_local std::vector<uint16_t> bin;
  bin.resize(V);
  double bmass[kBins + 1] = {};
  for (int64_t v = 0; v < V; ++v) {
    const double d = m - z[v];
    const int b = d < kRange ? std::min(kBins - 1, static_cast<int>(d * (kBins / kRange))) : kBins;
    bin[v] = static_cast<uint16_t>(b);
    bmass[b] += e[v];
  }
  int boundary = kBins;
  double cum = 0;
  for (int b = 0; b <= kBins; ++b) {
    cum += bmass[b];
    if (cum >= need) {
      boundary = b;
      break;
    }
  }
  order.clear();
  double above = 0;
  for (int64_t v = 0; v < V; ++v)
    if (bin[v] < boundary) {
      order.push_back(int32_t(v));
      above += e[v];
    }
  if (above >= need) return false;
  const size_t a = order.size();
  for (int64_t v = 0; v < V; ++v)
    if (bin[v] == boundary) order.push_back(int32_t(v));
  std::sort(order.begin() + a, order.end(), before);
  kept = above;
  n = static_cast<int64_t>(a);
  for (size_t i = a; i < order.size(); ++i) {
    kept += e[order[i]];
    ++n;
    if (kept >= need) break;
  }
  return true;
}

}  // namespace

void set_fast_nucleus(bool on) { g_fast_nucleus.store(on, std::memory_order_relaxed); }

Draw sample(const float* logits, int64_t V, const SamplingParams& p, uint64_t seed, uint64_t pos) {
  QUADS_CHECK(V > 0, "sample: empty vocabulary");
  const bool greedy = p.is_greedy();
  const double T = greedy ? 1.0 : p.temperature;
  // Per-thread scratch: the row's exponentials and the candidate order (vocabulary-sized).
  thread_local std::vector<double> z, e;
  thread_local std::vector<int32_t> order;
  z.resize(V);
  e.resize(V);

  float fmax = logits[0];
  int32_t arg = 0;
  for (int64_t v = 1; v < V; ++v)
    if (logits[v] > fmax) fmax = logits[v], arg = int32_t(v);
  // T == 1 keeps z == logit exactly, which makes the log-prob the trainer's formula bit for bit.
  const double m = T == 1.0 ? double(fmax) : double(fmax) / T;
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) {
    z[v] = T == 1.0 ? double(logits[v]) : double(logits[v]) / T;
    e[v] = std::exp(z[v] - m);
    sum += e[v];
  }
  const double lse = m + std::log(sum);
  QUADS_CHECK(std::isfinite(lse) && std::isfinite(m),
              "sample: the logits at position {} are not finite (max {}, sum of exponentials {})", pos, fmax, sum);

  Draw d;
  if (greedy) {
    d.token = arg;
    d.logprob = static_cast<float>(z[arg] - lse);
    return d;
  }

  const int64_t K = (p.top_k > 0 && p.top_k < V) ? p.top_k : V;
  const double u = uniform_draw(seed, pos);
  if (K == V && p.top_p >= 1.0) {
    // Full distribution: walk it in vocabulary order.
    const double target = u * sum;
    double cum = 0;
    int32_t pick = -1;
    for (int64_t v = 0; v < V; ++v) {
      if (e[v] <= 0) continue;
      cum += e[v];
      pick = int32_t(v);
      if (cum > target) break;
    }
    d.token = pick;
    d.logprob = static_cast<float>(z[pick] - lse);
    return d;
  }

  // Candidates in a strict total order: larger logit first, lower id on ties. Every prefix of
  // this order is unique, so selecting and sorting blocks gives the same answer as a full sort.
  auto before = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  int64_t n = K;     // order[0, n) is the set sampled from, in walk order
  double kept = sum;
  const bool by_bins = K == V && p.top_p < 1.0 && g_fast_nucleus.load(std::memory_order_relaxed) &&
                       nucleus_by_bins(z.data(), e.data(), m, V, p.top_p * sum, before, order, n, kept);
  if (!by_bins) {
    order.resize(V);
    for (int64_t v = 0; v < V; ++v) order[v] = int32_t(v);
    double mass = sum;  // mass of the top-k set
    int64_t sorted = 0;
    if (K < V) {
      std::nth_element(order.begin(), order.begin() + (K - 1), order.end(), before);
      std::sort(order.begin(), order.begin() + K, before);
      sorted = K;
      mass = 0;
      for (int64_t i = 0; i < K; ++i) mass += e[order[i]];
    }
    // Nucleus: the shortest prefix whose mass reaches top_p of the (top-k) mass.
    kept = mass;
    if (p.top_p < 1.0) {
      const double need = p.top_p * mass;
      double cum = 0;
      n = 0;
      while (true) {
        if (n == sorted) {  // extend the sorted prefix (doubling) when the nucleus needs more
          // Linear-time selection of the next block, then a sort of that block only.
          const int64_t upto = std::min<int64_t>(K, std::max<int64_t>(64, 2 * sorted));
          if (upto < V) std::nth_element(order.begin() + sorted, order.begin() + upto, order.end(), before);
          std::sort(order.begin() + sorted, order.begin() + upto, before);
          sorted = upto;
        }
        cum += e[order[n]];
        ++n;
        if (cum >= need || n == K) break;
      }
      kept = cum;
    }
  }
  const double target = u * kept;
  double cum = 0;
  int32_t pick = order[0];
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = order[i];
    if (e[v] <= 0) continue;
    cum += e[v];
    pick = v;
    if (cum > target) break;
  }
  d.token = pick;
  d.logprob = static_cast<float>(z[pick] - lse);
  d.log_kept_mass = std::log(kept / sum);
  return d;
}

std::vector<Draw> sample_jobs(const float* logits, int64_t V, const std::vector<SampleJob>& jobs) {
  const int n = static_cast<int>(jobs.size());
  std::vector<Draw> draws(n);
  std::vector<std::string> errors(n);
#pragma omp parallel for schedule(static) if (n > 1)
  for (int j = 0; j < n; ++j) {
    try {
      draws[j] = sample(logits + jobs[j].row * V, V, jobs[j].params, jobs[j].seed, jobs[j].pos);
    } catch (const std::exception& e) {
      errors[j] = e.what();
    }
  }
  for (int j = 0; j < n; ++j) QUADS_CHECK(errors[j].empty(), "rollout: request {}: {}", jobs[j].request, errors[j]);
  return draws;
}

}  // namespace quads::rollout
