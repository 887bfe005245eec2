// Draws on the device (kern::sample_rows, GpuModel::step_sample) against the host's sampler
// (rollout::sample): the same tokens and log-probs to float rounding on random logits (a token can
// only differ where u * sum falls within the float64 sum-order noise of a boundary: ~1e-13 a draw),
// ties and non-finite rows handled as the host does, the same bits run after run, and a rollout
// through the GPU backend drawing on the device or on the host. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
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

// GpuModel::decode_run (steps queued back to back, each step's tokens the draws of the step
// before, fed on the device) against step_sample a step at a time with the host feeding the
// tokens back: the same draws, bit for bit, for greedy and temperature jobs, with the graphs (the
// run's first steps capture a graph while earlier steps are still queued, and the context crosses
// a graph's bucket at 32) and without; a top-k job sends the run to the host, a step at a time.
TEST(CudaSample, DecodeRunIsStepSampleStepByStep) {
  QUADS_REQUIRE_GPU();
  const std::vector<int> prompt_lens = {5, 17, 28};
  const int B = static_cast<int>(prompt_lens.size()), n = 12;
  for (const std::string preset : {"nvfp4", "bf16"})
    for (const bool graphs : {true, false})
      for (const bool topk : {false, true}) {
        const std::string what = preset + (graphs ? "" : ", eager") + (topk ? ", a top-k job" : "");
        if (!graphs) setenv("QUADS_GPU_GRAPHS", "0", 1);
        cuda::GpuModel a(fixture_weights(), model::PrecisionConfig::preset(preset));
        cuda::GpuModel b(fixture_weights(), model::PrecisionConfig::preset(preset));
        unsetenv("QUADS_GPU_GRAPHS");
        std::vector<model::StepItem> items(B);
        std::vector<rollout::SampleJob> jobs(B);
        for (int i = 0; i < B; ++i) {
          items[i].slot = i;
          for (int t = 0; t < prompt_lens[i]; ++t) items[i].tokens.push_back((37 * t + 11 * i + 3) % 200);
          jobs[i].row = i;
          jobs[i].request = i;
          jobs[i].seed = 900 + i;
          jobs[i].params.temperature = 0.8 + 0.3 * i;
        }
        jobs[0].params.greedy = true;
        if (topk) jobs[2].params.top_k = 4;
        for (cuda::GpuModel* g : {&a, &b}) g->reset_cache(B, 64);
        auto set_pos = [&] {
          for (int i = 0; i < B; ++i) jobs[i].pos = static_cast<uint64_t>(a.length(i));
        };
        set_pos();
        const std::vector<rollout::Draw> pa = a.step_sample(items, jobs), pb = b.step_sample(items, jobs);
        std::vector<model::StepItem> dec(B);
        for (int i = 0; i < B; ++i) {
          ASSERT_EQ(pa[i].token, pb[i].token) << what;
          dec[i].slot = i;
          dec[i].tokens = {pa[i].token};
        }
        set_pos();
        a.reset_stats();
        const std::vector<rollout::Draw> run = a.decode_run(dec, jobs, n);
        ASSERT_EQ(run.size(), size_t(n) * B) << what;
        EXPECT_EQ(a.stats().steps, n) << what;
        for (int k = 0; k < n; ++k) {
          const std::vector<rollout::Draw> one = b.step_sample(dec, jobs);
          for (int i = 0; i < B; ++i) {
            const rollout::Draw& r = run[size_t(k) * B + i];
            EXPECT_EQ(r.token, one[i].token) << what << ": step " << k << " row " << i;
            EXPECT_TRUE(same_float(r.logprob, one[i].logprob)) << what << ": step " << k << " row " << i;
            dec[i].tokens = {one[i].token};
            ++jobs[i].pos;
          }
        }
        for (int i = 0; i < B; ++i) {
          EXPECT_EQ(a.length(i), prompt_lens[i] + n) << what;
          EXPECT_EQ(a.length(i), b.length(i)) << what;
        }
        // the caches hold the same entries: one more step from each agrees
        set_pos();
        const std::vector<rollout::Draw> na = a.step_sample(dec, jobs), nb = b.step_sample(dec, jobs);
        for (int i = 0; i < B; ++i) EXPECT_TRUE(na[i].token == nb[i].token && same_float(na[i].logprob, nb[i].logprob));
      }
}

// The rollout engine on the GPU backend with decode runs of 8 against a call a step: with every
// sequence of the same length and no stop ids the steps see the same batches either way, so the
// results are the same bits. Stops: four copies of one request (the same draws, so every copy
// stops at the same step and the batches stay the same) with a stop id drawn inside a run: the
// output ends at it, the run's later draws are dropped.
TEST(CudaSample, RolloutDecodeRunsAsStepByStep) {
  QUADS_REQUIRE_GPU();
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  std::vector<rollout::Request> reqs;
  for (int i = 0; i < 4; ++i) {
    rollout::Request r;
    r.prompt = {3 + i, 40, 9 + 2 * i, 7};
    r.max_new_tokens = 21;
    r.seed = 31 + i;
    r.sampling.temperature = i == 0 ? 0.0 : 1.1;
    reqs.push_back(r);
  }
  auto run = [&](int ahead, const std::vector<rollout::Request>& rs, rollout::EngineStats* st = nullptr) {
    rollout::EngineOptions o;
    o.decode_ahead = ahead;
    rollout::RolloutEngine eng(fixture_weights(), prec, o);
    eng.set_backend(cuda::make_gpu_backend(fixture_weights(), prec));
    auto out = eng.generate(rs);
    if (st) *st = eng.stats();
    return out;
  };
  rollout::EngineStats st;
  const auto one = run(1, reqs), eight = run(8, reqs, &st);
  EXPECT_GT(st.decode_runs, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(eight[i].tokens, one[i].tokens) << "request " << i;
    EXPECT_EQ(eight[i].logprobs, one[i].logprobs) << "request " << i;
  }

  std::vector<rollout::Request> same(4, reqs[1]);
  const std::vector<int32_t> free_run = run(1, same)[0].tokens;
  size_t stop_at = 0;  // the first occurrence of the stop token: not the last draw of a run of 8
  for (size_t j = 2; j < free_run.size() && !stop_at; ++j) {
    const size_t e = std::find(free_run.begin(), free_run.end(), free_run[j]) - free_run.begin();
    if (e >= 2 && e % 8 != 0 && e + 1 < free_run.size()) stop_at = e;
  }
  ASSERT_GT(stop_at, 0u);
  for (auto& r : same) r.stop_ids = {free_run[stop_at]};
  const auto a = run(1, same), b = run(8, same, &st);
  const std::vector<int32_t> want(free_run.begin(), free_run.begin() + stop_at + 1);
  for (size_t i = 0; i < same.size(); ++i) {
    EXPECT_EQ(a[i].tokens, want) << "request " << i;
    EXPECT_EQ(b[i].tokens, want) << "request " << i;
    EXPECT_EQ(b[i].logprobs, a[i].logprobs) << "request " << i;
    EXPECT_EQ(b[i].finish, rollout::Finish::Stop) << "request " << i;
  }
  EXPECT_GT(st.dropped, 0);
}
