// Draws on the device (kern::sample_rows, GpuModel::step_sample) against the host's sampler
// (rollout::sample): the same tokens and log-probs to float rounding on random logits (a token can
// only differ where u * sum falls within the float64 sum-order noise of a boundary: ~1e-13 a draw),
// ties and non-finite rows handled as the host does, the same bits run after run, and a rollout
// through the GPU backend drawing on the device or on the host. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/model_gpu.h"
#include "cuda/model_kernels.h"
#include "cuda_test_util.h"
#include "rollout/engine.h"
#include "rollout/sampler.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;

namespace {

std::vector<cuda::kern::SampleDrawDev> device_draws(const std::vector<float>& logits, int64_t V,
                                                    const std::vector<rollout::SampleJob>& jobs) {
  std::vector<cuda::kern::SampleJobDev> dj;
  for (const auto& j : jobs) dj.push_back({j.row, j.params.temperature, j.seed, j.pos, j.params.is_greedy() ? 1 : 0});
  auto dl = dev(logits);
  auto djobs = dev(dj);
  DeviceArray<cuda::kern::SampleDrawDev> out(jobs.size());
  cuda::kern::sample_rows(dl.data(), V, djobs.data(), static_cast<int>(jobs.size()), out.data(), nullptr);
  return out.download();
}

}  // namespace

TEST(CudaSample, DrawsMatchHostSampler) {
  QUADS_REQUIRE_GPU();
  // vocabularies: the peer model's, Qwen3's (more columns than threads * 64), fewer than the threads
  for (const int64_t V : {int64_t(32000), int64_t(151669), int64_t(300)}) {
    const int64_t R = 4;
    std::vector<float> logits = randn(size_t(R * V), 500 + V, 3.f);
    for (int64_t v = 0; v < V; ++v) logits[2 * V + v] = std::round(logits[2 * V + v]);  // row 2: many ties
    for (int64_t v = 0; v < V; v += 7) logits[3 * V + v] = -INFINITY;                  // row 3: masked tokens
    std::vector<rollout::SampleJob> jobs;
    for (int64_t r = 0; r < R; ++r) {
      rollout::SampleJob j;
      j.row = r;
      j.params.greedy = true;
      jobs.push_back(j);
      for (const double T : {1.0, 0.7, 1.6})
        for (uint64_t k = 0; k < 8; ++k) {
          j.params = {};
          j.params.temperature = T;
          j.seed = 1000 * r + k;
          j.pos = 17 + 3 * k + (uint64_t(1) << 33) * (k & 1);  // both halves of the counter
          jobs.push_back(j);
        }
    }
    const auto got = device_draws(logits, V, jobs);
    const auto again = device_draws(logits, V, jobs);
    for (size_t i = 0; i < jobs.size(); ++i) {
      const auto& j = jobs[i];
      const std::string what = "V " + std::to_string(V) + " job " + std::to_string(i) + " (row " +
                               std::to_string(j.row) + ", " + j.params.describe() + ")";
      const rollout::Draw want = rollout::sample(logits.data() + j.row * V, V, j.params, j.seed, j.pos);
      ASSERT_TRUE(got[i].ok) << what;
      EXPECT_EQ(got[i].token, want.token) << what;
      EXPECT_NEAR(got[i].logprob, want.logprob, 2e-6 + 1e-6 * std::fabs(want.logprob)) << what;
      EXPECT_EQ(got[i].token, again[i].token) << what;
      EXPECT_TRUE(same_float(got[i].logprob, again[i].logprob)) << what;
    }
  }
}

// Rows the host refuses (a NaN, +inf, all -inf) come back not ok; the others in the same call are
// unaffected.
TEST(CudaSample, NonFiniteRowsAreFlagged) {
  QUADS_REQUIRE_GPU();
  const int64_t V = 1000, R = 4;
  std::vector<float> logits = randn(size_t(R * V), 9, 2.f);
  logits[0 * V + 500] = std::nanf("");
  logits[1 * V + 3] = INFINITY;
  for (int64_t v = 0; v < V; ++v) logits[2 * V + v] = -INFINITY;
  std::vector<rollout::SampleJob> jobs;
  for (int64_t r = 0; r < R; ++r)
    for (const bool greedy : {true, false}) {
      rollout::SampleJob j;
      j.row = r;
      j.params.greedy = greedy;
      j.seed = 5;
      j.pos = 9;
      jobs.push_back(j);
    }
  const auto got = device_draws(logits, V, jobs);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto& j = jobs[i];
    const bool host_ok = [&] {
      try {
        rollout::sample(logits.data() + j.row * V, V, j.params, j.seed, j.pos);
        return true;
      } catch (const Error&) {
        return false;
      }
    }();
    EXPECT_EQ(bool(got[i].ok), host_ok) << "row " << j.row << (j.params.greedy ? " greedy" : " sampled");
    EXPECT_EQ(host_ok, j.row == 3) << "row " << j.row;
  }
}

// A rollout with sampling through the GPU backend (prefill shared by a group, temperature and
// greedy requests, one top-k request that sends its steps to the host): drawing on the device
// gives the tokens of drawing on the host from the downloaded logits (the same logits: the same
// device computations), log-probs to float rounding.
TEST(CudaSample, RolloutDrawsOnDeviceAsOnHost) {
  QUADS_REQUIRE_GPU();
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  std::vector<rollout::Request> reqs;
  for (int i = 0; i < 6; ++i) {
    rollout::Request r;
    r.prompt = {1 + i % 2, 5, 9, 2 + i % 2};  // two prompts, three requests each
    r.max_new_tokens = 12;
    r.seed = 77 + i;
    r.sampling.temperature = i == 5 ? 0.0 : 1.0 + 0.2 * (i % 3);
    reqs.push_back(r);
  }
  auto run = [&](const char* where, bool with_topk) {
    setenv("QUADS_GPU_SAMPLE", where, 1);
    rollout::RolloutEngine eng(fixture_weights(), prec);
    eng.set_backend(cuda::make_gpu_backend(fixture_weights(), prec));
    unsetenv("QUADS_GPU_SAMPLE");
    std::vector<rollout::Request> rs = reqs;
    if (with_topk) rs[1].sampling.top_k = 5;
    return eng.generate(rs);
  };
  for (const bool with_topk : {false, true}) {
    const auto d = run("device", with_topk), h = run("host", with_topk);
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_EQ(d[i].tokens, h[i].tokens) << "request " << i << (with_topk ? " (with a top-k request)" : "");
      ASSERT_EQ(d[i].logprobs.size(), h[i].logprobs.size());
      for (size_t t = 0; t < d[i].logprobs.size(); ++t)
        EXPECT_NEAR(d[i].logprobs[t], h[i].logprobs[t], 2e-6 + 1e-6 * std::fabs(h[i].logprobs[t]))
            << "request " << i << " token " << t;
    }
  }
}
