#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "common/error.h"
#include "rollout/sampler.h"
#include "train/losses.h"

using namespace quads::rollout;

namespace {

// Logits whose softmax is exactly proportional to `p` (up to float rounding of the logs).
std::vector<float> logits_of(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}

// Independent log-softmax of logits / T in long double.
long double ref_logprob(const std::vector<float>& l, double T, int tok) {
  long double mx = -INFINITY, s = 0;
  for (float x : l) mx = std::max(mx, (long double)x / T);
  for (float x : l) s += std::exp((long double)x / T - mx);
  return (long double)l[tok] / T - mx - std::log(s);
}

std::vector<int> counts(const std::vector<float>& l, const SamplingParams& p, uint64_t seed, int n) {
  std::vector<int> c(l.size(), 0);
  for (int i = 0; i < n; ++i) ++c[sample(l.data(), l.size(), p, seed, i).token];
  return c;
}

}  // namespace

TEST(RolloutSampler, PhiloxKnownAnswers) {
  // Random123's published known-answer vectors for philox4x32-10.
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  } kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const Philox4x32 r = philox4x32_10(k.ctr, k.key);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.v[i], k.out[i]) << "word " << i;
  }
}

TEST(RolloutSampler, UniformDrawIsAPureWellSpreadFunction) {
  // Same (seed, pos) -> same value; neighbouring seeds and positions -> different values.
  EXPECT_EQ(uniform_draw(7, 100), uniform_draw(7, 100));
  EXPECT_NE(uniform_draw(7, 100), uniform_draw(8, 100));
  EXPECT_NE(uniform_draw(7, 100), uniform_draw(7, 101));
  EXPECT_NE(uniform_draw(7, 100), uniform_draw(7, 100 + (uint64_t(1) << 32)));  // the high word counts
  // Moments and a 16-bucket histogram over 2^16 positions of one seed.
  const int n = 1 << 16;
  double sum = 0, sq = 0;
  std::vector<int> hist(16, 0);
  for (int i = 0; i < n; ++i) {
    const double u = uniform_draw(12345, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sq += u * u;
    ++hist[int(u * 16)];
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  EXPECT_NEAR(sq / n - (sum / n) * (sum / n), 1.0 / 12, 0.002);
  double chi2 = 0;
  for (int h : hist) chi2 += (h - n / 16.0) * (h - n / 16.0) / (n / 16.0);
  EXPECT_LT(chi2, 45.0);  // df = 15: far beyond the 99.99% quantile (~44) would mean a broken generator
}

TEST(RolloutSampler, GreedyIsArgmaxWithTheTrainersLogprob) {
  std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f, 1.5f};
  SamplingParams p;
  p.greedy = true;
  const Draw d = sample(l.data(), l.size(), p, 1, 0);
  EXPECT_EQ(d.token, 1);  // tie between 1 and 3: the lower id
  // Bitwise the trainer's log-prob of that token.
  const int32_t target = 1;
  float ref = 0;
  quads::train::token_logprobs(l.data(), 1, l.size(), &target, &ref);
  EXPECT_EQ(d.logprob, ref);
  // temperature 0 is greedy too, whatever the seed.
  SamplingParams t0;
  t0.temperature = 0;
  for (uint64_t s = 0; s < 20; ++s) EXPECT_EQ(sample(l.data(), l.size(), t0, s, s).token, 1);
}

TEST(RolloutSampler, TemperatureOneLogprobIsTheTrainersBitwise) {
  std::vector<float> l(300);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(0.37f * i) * 4.f + 0.01f * i;
  SamplingParams p;  // temperature 1, no truncation
  std::vector<int32_t> targets;
  std::vector<float> got;
  for (int pos = 0; pos < 200; ++pos) {
    const Draw d = sample(l.data(), l.size(), p, 99, pos);
    targets.push_back(d.token);
    got.push_back(d.logprob);
  }
  std::vector<float> rows;
  for (size_t i = 0; i < targets.size(); ++i) rows.insert(rows.end(), l.begin(), l.end());
  std::vector<float> ref(targets.size());
  quads::train::token_logprobs(rows.data(), targets.size(), l.size(), targets.data(), ref.data());
  for (size_t i = 0; i < targets.size(); ++i) EXPECT_EQ(got[i], ref[i]) << "draw " << i;
}

TEST(RolloutSampler, TemperatureScalesTheLogprobAndTheDistribution) {
  const std::vector<double> probs = {0.4, 0.3, 0.2, 0.1};
  const std::vector<float> l = logits_of(probs);
  SamplingParams p;
  p.temperature = 2.0;
  // Expected frequencies: p^(1/T), renormalized.
  std::vector<double> q;
  double z = 0;
  for (double x : probs) q.push_back(std::pow(x, 0.5)), z += q.back();
  const int n = 40000;
  const std::vector<int> c = counts(l, p, 2024, n);
  double chi2 = 0;
  for (size_t i = 0; i < q.size(); ++i) chi2 += std::pow(c[i] - n * q[i] / z, 2) / (n * q[i] / z);
  EXPECT_LT(chi2, 21.1);  // df = 3, 99.99% quantile
  for (int pos = 0; pos < 50; ++pos) {
    const Draw d = sample(l.data(), l.size(), p, 5, pos);
    EXPECT_NEAR(d.logprob, double(ref_logprob(l, 2.0, d.token)), 1e-6);
    EXPECT_NEAR(d.logprob, std::log(q[d.token] / z), 1e-6);
    EXPECT_EQ(d.log_kept_mass, 0.0);
  }
}

TEST(RolloutSampler, TopKKeepsTheKLargestWithLowerIdsOnTies) {
  // ids 2 and 5 tie for the 3rd place: top-3 keeps {0, 1, 2}.
  std::vector<float> l = {3.f, 2.5f, 1.f, 0.f, -1.f, 1.f, 0.5f};
  SamplingParams p;
  p.top_k = 3;
  const std::vector<int> c = counts(l, p, 3, 6000);
  for (int v : {3, 4, 5, 6}) EXPECT_EQ(c[v], 0) << "token " << v;
  for (int v : {0, 1, 2}) EXPECT_GT(c[v], 0) << "token " << v;
  // Frequencies follow the renormalized top-3 probabilities.
  const double e0 = std::exp(3.0), e1 = std::exp(2.5), e2 = std::exp(1.0), m = e0 + e1 + e2;
  EXPECT_NEAR(c[0] / 6000.0, e0 / m, 0.03);
  EXPECT_NEAR(c[1] / 6000.0, e1 / m, 0.03);
  EXPECT_NEAR(c[2] / 6000.0, e2 / m, 0.03);
  // The log-prob stays under the full distribution; the kept mass says how much was kept.
  const Draw d = sample(l.data(), l.size(), p, 3, 0);
  EXPECT_NEAR(d.logprob, double(ref_logprob(l, 1.0, d.token)), 1e-6);
  long double all = 0;
  for (float x : l) all += std::exp((long double)x);
  EXPECT_NEAR(d.log_kept_mass, double(std::log(m / all)), 1e-9);
  // top-k 1 is greedy whatever the seed.
  p.top_k = 1;
  for (uint64_t s = 0; s < 50; ++s) EXPECT_EQ(sample(l.data(), l.size(), p, s, 7).token, 0);
}

TEST(RolloutSampler, TopPKeepsTheShortestNucleus) {
  const std::vector<double> probs = {0.05, 0.5, 0.15, 0.3};  // sorted: 1 (.5), 3 (.3), 2 (.15), 0 (.05)
  const std::vector<float> l = logits_of(probs);
  SamplingParams p;
  p.top_p = 0.7;  // .5 < .7 <= .8: keeps {1, 3}
  const int n = 8000;
  std::vector<int> c = counts(l, p, 11, n);
  EXPECT_EQ(c[0], 0);
  EXPECT_EQ(c[2], 0);
  EXPECT_NEAR(c[1] / double(n), 0.5 / 0.8, 0.02);
  EXPECT_NEAR(c[3] / double(n), 0.3 / 0.8, 0.02);
  EXPECT_NEAR(sample(l.data(), l.size(), p, 11, 0).log_kept_mass, std::log(0.8), 1e-6);
  // A tiny top_p keeps at least the most likely token.
  p.top_p = 1e-9;
  c = counts(l, p, 11, 200);
  EXPECT_EQ(c[1], 200);
  // top-k then top-p over the renormalized top-k mass: top-3 mass .95, top_p .8 needs .76 -> {1, 3}.
  p.top_k = 3;
  p.top_p = 0.8;
  c = counts(l, p, 12, 2000);
  EXPECT_EQ(c[0] + c[2], 0);
  p.top_p = 0.9;  // needs .855 > .8 -> {1, 3, 2}
  c = counts(l, p, 12, 4000);
  EXPECT_EQ(c[0], 0);
  EXPECT_GT(c[2], 0);
}

TEST(RolloutSampler, TopPOverALargeVocabularyMatchesAFullSort) {
  // The nucleus is grown by partial sorts; it must be the prefix a full sort gives.
  const int V = 5000;
  std::vector<float> l(V);
  for (int i = 0; i < V; ++i) l[i] = float(std::fmod(i * 0.618034, 1.0) * 6.0);
  SamplingParams p;
  p.top_p = 0.9;
  p.temperature = 0.7;
  std::vector<int> order(V);
  for (int i = 0; i < V; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  // The same float64 quantities the sampler uses, so the boundary token is decided identically.
  const double m = double(*std::max_element(l.begin(), l.end())) / 0.7;
  std::vector<double> e(V);
  double sum = 0;
  for (int i = 0; i < V; ++i) sum += (e[i] = std::exp(double(l[i]) / 0.7 - m));
  double cum = 0;
  std::set<int> nucleus;
  for (int i = 0; i < V && cum < 0.9 * sum; ++i) cum += e[order[i]], nucleus.insert(order[i]);
  ASSERT_GT(nucleus.size(), 200u);  // forces several doublings of the sorted prefix
  // Both ways of finding the nucleus (binned, the default, and block sorting) keep exactly it.
  for (bool fast : {true, false}) {
    set_fast_nucleus(fast);
    std::set<int> seen;
    const int draws = fast ? 1000 : 300;  // block sorting costs ~0.5 ms a draw here
    for (int pos = 0; pos < draws; ++pos) {
      const Draw d = sample(l.data(), V, p, 8, pos);
      ASSERT_TRUE(nucleus.count(d.token)) << "token " << d.token << " outside the nucleus (fast " << fast << ")";
      seen.insert(d.token);
      if (pos == 0) {
        EXPECT_NEAR(d.log_kept_mass, std::log(cum / sum), 1e-12) << fast;
      }
    }
    EXPECT_GT(seen.size(), size_t(draws / 4)) << fast;  // draws spread over the nucleus
  }
  set_fast_nucleus(true);
  // Frequencies inside a small nucleus follow the renormalized probabilities on both paths.
  const int V2 = 1000;
  std::vector<float> l2(V2, -30.f);
  l2[900] = 2.f, l2[17] = 1.f, l2[500] = 1.f, l2[3] = 0.f;  // nucleus at top_p .9: {900, 17, 500}
  SamplingParams p2;
  p2.top_p = 0.9;
  const double e2 = std::exp(2.0), e1 = std::exp(1.0), tot = e2 + 2 * e1;
  for (bool fast : {true, false}) {
    set_fast_nucleus(fast);
    std::vector<int> c(V2, 0);
    const int n = 6000;
    for (int pos = 0; pos < n; ++pos) ++c[sample(l2.data(), V2, p2, 21, pos).token];
    EXPECT_EQ(c[900] + c[17] + c[500], n) << fast;
    EXPECT_NEAR(c[900] / double(n), e2 / tot, 0.02) << fast;
    EXPECT_NEAR(c[17] / double(n), e1 / tot, 0.02) << fast;
  }
  set_fast_nucleus(true);
}

TEST(RolloutSampler, DrawsArePureFunctionsOfSeedAndPosition) {
  std::vector<float> l(64);
  for (int i = 0; i < 64; ++i) l[i] = 0.05f * i;
  SamplingParams p;
  p.temperature = 0.9;
  p.top_k = 40;
  p.top_p = 0.95;
  int differ_seed = 0;
  for (int pos = 0; pos < 100; ++pos) {
    const Draw a = sample(l.data(), 64, p, 42, pos);
    // Interleave other draws: they must not disturb (seed 42, pos).
    sample(l.data(), 64, p, 43, pos + 1);
    const Draw b = sample(l.data(), 64, p, 42, pos);
    EXPECT_EQ(a.token, b.token);
    EXPECT_EQ(a.logprob, b.logprob);
    differ_seed += sample(l.data(), 64, p, 4242, pos).token != a.token;
  }
  EXPECT_GT(differ_seed, 50);
}

TEST(RolloutSampler, RejectsBadParametersAndNonFiniteLogits) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THROW(p.validate(), quads::Error);
  p = {};
  p.top_p = 0;
  EXPECT_THROW(p.validate(), quads::Error);
  p = {};
  p.top_p = 1.5;
  EXPECT_THROW(p.validate(), quads::Error);
  p = {};
  p.top_k = -2;
  EXPECT_THROW(p.validate(), quads::Error);
  p = {};
  EXPECT_NO_THROW(p.validate());
  std::vector<float> l = {0.f, std::numeric_limits<float>::quiet_NaN(), 1.f};
  try {
    sample(l.data(), 3, p, 0, 17);
    FAIL() << "NaN logits accepted";
  } catch (const quads::Error& e) {
    EXPECT_NE(std::string(e.what()).find("position 17"), std::string::npos) << e.what();
  }
  l = {0.f, std::numeric_limits<float>::infinity(), 1.f};
  p.greedy = true;
  EXPECT_THROW(sample(l.data(), 3, p, 0, 0), quads::Error);
}
