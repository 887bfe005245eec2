// RolloutEngine with a StepBackend (the hook the GPU engine uses, cuda/model_gpu.h): a backend
// that runs the CPU model on its own cache must give bitwise the engine's own results, and the
// engine must drive the backend's cache (reset, prefill copies, slot reuse) as it drives its own.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "common/error.h"
#include "common/fixtures.h"
#include "model/model.h"
#include "rollout/cpu_step_backend.h"
#include "rollout/engine.h"

using namespace quads;
using namespace quads::rollout;

namespace {

const model::Weights& weights() {
  static const model::Weights w = model::Weights::load(fixtures_dir() + "/tiny_qwen3moe_a");
  return w;
}

using Calls = test::StepCalls;
using CpuBackend = test::CpuStepBackend;

std::vector<Request> requests() {
  std::vector<Request> r(5);
  for (int i = 0; i < 5; ++i) {
    r[i].prompt = {static_cast<int32_t>(10 + i), 200, 33, static_cast<int32_t>(7 * i + 1)};
    r[i].max_new_tokens = 6 + i;
    r[i].seed = 100 + i;
    r[i].sampling.temperature = 0.9;
  }
  r[3].prompt = r[1].prompt;  // shared prefill: the engine copies slot 1's cache
  r[4].sampling.greedy = true;
  return r;
}

}  // namespace

TEST(RolloutStepBackend, CpuModelBehindTheInterfaceIsBitwiseTheEngine) {
  for (const std::string preset : {"fp32", "nvfp4"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    EngineOptions o;
    o.max_batch = 3;  // fewer slots than requests: slots are cleared and reused
    RolloutEngine plain(weights(), prec, o);
    const std::vector<Result> want = plain.generate(requests());

    Calls calls;
    RolloutEngine eng(weights(), prec, o);
    eng.set_backend(std::make_unique<CpuBackend>(weights(), prec, &calls));
    ASSERT_NE(eng.backend(), nullptr);
    const std::vector<Result> got = eng.generate(requests());
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << preset << " request " << i;
      EXPECT_EQ(got[i].logprobs, want[i].logprobs) << preset << " request " << i;
      EXPECT_EQ(got[i].finish, want[i].finish);
    }
    EXPECT_EQ(calls.resets, 1);
    EXPECT_EQ(calls.slots, 3);
    EXPECT_EQ(calls.max_len, 4 + 10);  // longest prompt + max_new_tokens
    EXPECT_GE(calls.copies, 1);        // the shared prompt
    EXPECT_EQ(calls.clears, 5);        // every finished sequence gives its slot back
    EXPECT_EQ(calls.steps, eng.stats().steps);
    EXPECT_EQ(eng.stats().shared_prompts, plain.stats().shared_prompts);
  }
}

// Decode runs (EngineOptions::decode_ahead, the default StepBackend::decode_run feeding the draws
// back on the host): the model is batch-invariant, so the results are the engine's own for any run
// length, with sequences that stop inside a run (their later draws dropped, their slots cleared
// and given to waiting requests after the run) and runs cut short by the fewest tokens left.
TEST(RolloutStepBackend, DecodeRunsGiveTheEngineResults) {
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  std::vector<Request> reqs = requests();
  for (int i = 0; i < 3; ++i) {  // more requests than slots, longer generations
    Request r = reqs[i];
    r.seed += 50;
    r.max_new_tokens = 14 + 3 * i;
    reqs.push_back(r);
  }
  EngineOptions o;
  o.max_batch = 3;
  RolloutEngine plain(weights(), prec, o);
  // stop ids: tokens the plain run draws mid-generation, so that sequences stop inside runs
  for (size_t i = 0; i < reqs.size(); i += 2) {
    const std::vector<Result> first = plain.generate({reqs[i]});
    reqs[i].stop_ids = {first[0].tokens[first[0].tokens.size() / 2]};
  }
  const std::vector<Result> want = plain.generate(reqs);
  int stopped = 0;
  for (const Result& r : want) stopped += r.finish == Finish::Stop && r.tokens.size() > 1;
  ASSERT_GE(stopped, 3) << "the test needs sequences that stop before their length";
  int64_t dropped = 0;
  for (const int ahead : {1, 2, 4, 8, 64}) {
    o.decode_ahead = ahead;
    Calls calls;
    RolloutEngine eng(weights(), prec, o);
    eng.set_backend(std::make_unique<CpuBackend>(weights(), prec, &calls));
    const std::vector<Result> got = eng.generate(reqs);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << "decode_ahead " << ahead << " request " << i;
      EXPECT_EQ(got[i].logprobs, want[i].logprobs) << "decode_ahead " << ahead << " request " << i;
      EXPECT_EQ(got[i].finish, want[i].finish) << "decode_ahead " << ahead << " request " << i;
    }
    const EngineStats& st = eng.stats();
    EXPECT_EQ(calls.steps, st.steps) << ahead;
    EXPECT_LE(calls.max_seen, calls.max_len) << ahead;
    EXPECT_EQ(calls.clears, static_cast<int>(reqs.size())) << ahead;
    EXPECT_EQ(st.generated, plain.stats().generated) << ahead;
    if (ahead == 1) {
      EXPECT_EQ(st.decode_runs, 0);
      EXPECT_EQ(st.dropped, 0);
      EXPECT_EQ(st.steps, plain.stats().steps);
    } else {
      EXPECT_GT(st.decode_runs, 0) << ahead;
      EXPECT_LT(st.steps, plain.stats().steps + st.dropped) << ahead;
      dropped += st.dropped;
    }
    std::printf("decode_ahead %d: %lld steps, %lld decode runs, %lld draws dropped\n", ahead,
                static_cast<long long>(st.steps), static_cast<long long>(st.decode_runs),
                static_cast<long long>(st.dropped));
  }
  EXPECT_GT(dropped, 0) << "no sequence stopped inside a decode run";
  o.decode_ahead = 0;
  Calls calls;
  RolloutEngine bad(weights(), prec, o);
  bad.set_backend(std::make_unique<CpuBackend>(weights(), prec, &calls));
  EXPECT_THROW(bad.generate(reqs), quads::Error);
}

// decode_run refuses what it cannot run: items of several tokens, jobs on other rows.
TEST(RolloutStepBackend, DecodeRunChecksItsArguments) {
  const auto prec = model::PrecisionConfig::preset("fp32");
  Calls calls;
  CpuBackend b(weights(), prec, &calls);
  b.reset(2, 16);
  std::vector<model::StepItem> items(2);
  std::vector<SampleJob> jobs(2);
  for (int i = 0; i < 2; ++i) {
    items[i].slot = i;
    items[i].tokens = {5 + i};
    jobs[i].row = i;
    jobs[i].params.greedy = true;
  }
  const std::vector<Draw> d = b.decode_run(items, jobs, 3);
  ASSERT_EQ(d.size(), 6u);
  EXPECT_EQ(calls.steps, 3);
  auto two = items;
  two[1].tokens = {1, 2};
  EXPECT_THROW(b.decode_run(two, jobs, 2), quads::Error);
  auto swapped = jobs;
  std::swap(swapped[0].row, swapped[1].row);
  EXPECT_THROW(b.decode_run(items, swapped, 2), quads::Error);
  EXPECT_THROW(b.decode_run(items, jobs, 0), quads::Error);
  jobs.pop_back();
  EXPECT_THROW(b.decode_run(items, jobs, 2), quads::Error);
}

// RolloutEngine::inspect (the RL loop's routing replay and diagnostics): steps inspected by the
// backend give the CPU model's forward, whole sequences in chunks of at most chunk_tokens tokens (a
// longer sequence alone, an empty one skipped): the routing bit for bit, and the activation errors
// (sums over a linear's rows, whatever the chunks) to double rounding; a backend that cannot
// inspect leaves it to the CPU model.
TEST(RolloutStepBackend, InspectionFromTheBackendIsTheCpuForwards) {
  const model::Batch b = model::Batch::of({{1, 2, 3, 4, 5}, {}, {7, 8}, {9, 10, 11, 12, 13, 14, 15, 16, 17}, {20}});
  const model::ModelConfig& cfg = weights().cfg;
  const int K = cfg.num_experts_per_tok, L = cfg.num_hidden_layers;
  for (const std::string preset : {"fp32", "bf16", "nvfp4"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    RolloutEngine plain(weights(), prec);
    const Inspection want = plain.inspect(b, true);
    ASSERT_EQ(static_cast<int>(want.routing.experts.size()), L);
    int sparse = 0;
    for (int l = 0; l < L; ++l)
      if (cfg.is_sparse(l)) {
        EXPECT_EQ(static_cast<int64_t>(want.routing.experts[l].size()), b.ntokens() * K);
        ++sparse;
      }
    ASSERT_GT(sparse, 0);
    const std::vector<double> q = want.act_qerr_layers(L);
    if (preset == "fp32") {
      EXPECT_TRUE(want.act_error.empty()) << "fp32 rounds no input";
    } else {
      // every decoder linear that rounds its input, each over all of its rows
      for (const auto& [name, e] : want.act_error) {
        EXPECT_GE(e.layer, 0) << name;
        EXPECT_GT(e.rows, 0) << name;
        EXPECT_GT(e.sq_norm, 0) << name;
      }
      EXPECT_EQ(want.act_error.at("model.layers.0.self_attn.q_proj").rows, b.ntokens());
      for (int l = 0; l < L; ++l) EXPECT_GT(q[l], 0) << preset << " layer " << l;
      if (preset == "nvfp4") {
        for (int l = 0; l < L; ++l) EXPECT_GT(q[l], 1e-4) << "E2M1's error, not BF16's";
      }
    }
    EXPECT_EQ(plain.inspect(b, false).routing.experts, want.routing.experts);
    EXPECT_TRUE(plain.inspect(b, false).act_error.empty());
    // chunk_tokens -> inspected steps: 1 and 6 split the batch four ways, 8192 keeps it whole
    for (const auto& [chunk, steps] : std::vector<std::pair<int64_t, int>>{{1, 4}, {6, 4}, {8192, 1}}) {
      Calls calls;
      RolloutEngine eng(weights(), prec);
      eng.set_backend(std::make_unique<CpuBackend>(weights(), prec, &calls));
      for (const bool act : {false, true}) {
        const Inspection got = eng.inspect(b, act, chunk);
        EXPECT_EQ(got.routing.experts, want.routing.experts) << preset << " chunk " << chunk;
        ASSERT_EQ(got.act_error.size(), act ? want.act_error.size() : 0u) << preset << " chunk " << chunk;
        for (const auto& [name, e] : got.act_error) {
          const ActError& w = want.act_error.at(name);
          EXPECT_EQ(e.layer, w.layer);
          EXPECT_EQ(e.rows, w.rows) << name;
          EXPECT_NEAR(e.sq_err, w.sq_err, 1e-12 * w.sq_err) << name;
          EXPECT_NEAR(e.sq_norm, w.sq_norm, 1e-12 * w.sq_norm) << name;
        }
        if (act && chunk == 8192) {
          EXPECT_EQ(got.act_qerr_layers(L), q) << "one chunk: the CPU's sums exactly";
        }
      }
      EXPECT_EQ(calls.records, 2 * steps) << preset << " chunk " << chunk;
      EXPECT_EQ(calls.steps, 0);
      EXPECT_EQ(calls.max_seen, 9);  // each reset sized for its chunk's longest sequence (check_room)
    }
    Calls calls;
    RolloutEngine eng(weights(), prec);
    auto be = std::make_unique<CpuBackend>(weights(), prec, &calls);
    be->can_probe = false;  // routing only: the activation error goes to the CPU model, all of it
    eng.set_backend(std::move(be));
    EXPECT_EQ(eng.inspect(b, false).routing.experts, want.routing.experts) << preset;
    EXPECT_EQ(calls.records, 1);
    const Inspection cpu = eng.inspect(b, true);
    EXPECT_EQ(cpu.routing.experts, want.routing.experts);
    EXPECT_EQ(cpu.act_qerr_layers(L), q);
    EXPECT_EQ(calls.records + calls.steps, 1);
  }
}

// With a backend, the engine's CPU model re-quantizes the synced weights when it is next used
// (model(), or a generate() after set_backend(nullptr)): either way it is the new weights' model.
TEST(RolloutStepBackend, SyncReachesTheBackend) {
  for (const std::string preset : {"fp32", "nvfp4"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    Calls calls;
    RolloutEngine eng(weights(), prec);
    eng.set_backend(std::make_unique<CpuBackend>(weights(), prec, &calls));
    model::Weights w2 = weights();
    for (auto& x : w2.data) x *= 0.5f;
    eng.sync(w2);
    EXPECT_EQ(calls.syncs, 1) << preset;
    RolloutEngine ref(w2, prec);
    Request r = requests()[4];
    EXPECT_EQ(eng.generate({r})[0].tokens, ref.generate({r})[0].tokens) << preset;
    model::StepItem it;
    it.tokens = r.prompt;
    model::KVCache c1(w2.cfg, 1), c2(w2.cfg, 1);
    EXPECT_EQ(eng.model().step(c1, {it}), ref.model().step(c2, {it})) << preset << ": the CPU model after sync";
    eng.sync(weights());  // back, and straight to the CPU model
    eng.set_backend(nullptr);
    EXPECT_EQ(eng.backend(), nullptr);
    RolloutEngine ref0(weights(), prec);
    EXPECT_EQ(eng.generate({r})[0].tokens, ref0.generate({r})[0].tokens) << preset;
  }
}

// Masters handed over in the backend's memory (RolloutEngine::sync_device, what the RL loop does
// with a GPU trainer's): the backend syncs from them without the host, the engine's host copy and
// CPU model are fetched back from the backend only when used, and engines or memories that cannot
// take them say so (false) without changing anything.
TEST(RolloutStepBackend, SyncFromDeviceMemoryFetchesTheHostCopyOnlyWhenUsed) {
  for (const std::string preset : {"fp32", "nvfp4"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    model::Weights w2 = weights();
    for (auto& x : w2.data) x *= 0.5f;
    const model::DeviceWeights dev{w2.data.data(), w2.data.size(), "host-test"};
    RolloutEngine cpu_only(weights(), prec);
    EXPECT_FALSE(cpu_only.sync_device(dev)) << "no backend";

    Calls calls;
    RolloutEngine eng(weights(), prec);
    eng.set_backend(std::make_unique<CpuBackend>(weights(), prec, &calls));
    EXPECT_FALSE(eng.sync_device({w2.data.data(), w2.data.size(), "cuda"})) << "another memory";
    EXPECT_FALSE(eng.sync_device({w2.data.data(), w2.data.size() - 1, "host-test"})) << "another layout";
    EXPECT_FALSE(eng.sync_device({})) << "nothing";
    EXPECT_EQ(calls.device_syncs, 0);
    ASSERT_TRUE(eng.sync_device(dev));
    EXPECT_EQ(calls.device_syncs, 1);
    EXPECT_EQ(calls.syncs, 0);

    RolloutEngine ref(w2, prec);
    const Request r = requests()[4];
    EXPECT_EQ(eng.generate({r})[0].logprobs, ref.generate({r})[0].logprobs) << preset;
    EXPECT_EQ(calls.downloads, 0) << "generation on the backend needs no host copy";
    model::StepItem it;
    it.tokens = r.prompt;
    model::KVCache c1(w2.cfg, 1), c2(w2.cfg, 1);
    EXPECT_EQ(eng.model().step(c1, {it}), ref.model().step(c2, {it})) << preset << ": the CPU model, fetched";
    EXPECT_EQ(calls.downloads, 1);
    (void)eng.model();
    EXPECT_EQ(calls.downloads, 1) << "fetched once";

    // Back to the first weights through the backend; dropping the backend fetches them first.
    const model::Weights& w1 = weights();
    ASSERT_TRUE(eng.sync_device({w1.data.data(), w1.data.size(), "host-test"}));
    eng.set_backend(nullptr);
    EXPECT_EQ(calls.downloads, 2);
    RolloutEngine ref1(w1, prec);
    EXPECT_EQ(eng.generate({r})[0].logprobs, ref1.generate({r})[0].logprobs) << preset << ": the CPU path after it";
  }
}

// Static RAC calibrated on the backend (RolloutEngine::calibrate_rac: the energy pass there in
// chunks, the selection on the host) picks the CPU calibration's channels, and the backend then
// generates what the CPU engine with those channels generates. A backend that cannot calibrate
// gets the CPU model's channels.
TEST(RolloutStepBackend, RacCalibratedOnTheBackendIsTheCpuCalibration) {
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  const model::Batch calib =
      model::Batch::of({{1, 2, 3, 4, 5, 6, 7}, {40, 41}, {9, 10, 11, 12, 13, 14, 15, 16, 17}, {20, 21, 22}});
  model::RacConfig rc;
  rc.ratio = 0.25;
  RolloutEngine plain(weights(), prec);
  const int n0 = plain.calibrate_rac(calib, rc);
  ASSERT_GT(n0, 0);
  std::map<std::string, std::vector<int32_t>> want;
  bool ranked = false;  // some linear's choice is not simply its first channels
  for (const model::LinearQ& L : plain.model().linears()) {
    if (L.rac_channels.empty()) continue;
    want[L.name] = L.rac_channels;
    for (size_t i = 0; i < L.rac_channels.size(); ++i) ranked |= L.rac_channels[i] != static_cast<int32_t>(i);
  }
  ASSERT_EQ(static_cast<int>(want.size()), n0);
  ASSERT_TRUE(ranked);
  Request r = requests()[0];
  r.max_new_tokens = 12;
  const Result ref = plain.generate({r})[0];

  for (const auto& [chunk, steps] : std::vector<std::pair<int64_t, int>>{{1, 4}, {10, 3}, {8192, 1}}) {
    for (const bool on_backend : {true, false}) {
      Calls calls;
      RolloutEngine eng(weights(), prec);
      auto be = std::make_unique<CpuBackend>(weights(), prec, &calls);
      be->can_calibrate = on_backend;
      eng.set_backend(std::move(be));
      EXPECT_EQ(eng.calibrate_rac(calib, rc, chunk), n0) << "chunk " << chunk;
      EXPECT_EQ(calls.energy_steps, on_backend ? steps : 0) << "chunk " << chunk;
      EXPECT_EQ(calls.rac_sets, on_backend ? 2 : 1) << "off for the pass, then the channels";
      const Result got = eng.generate({r})[0];
      EXPECT_EQ(got.tokens, ref.tokens) << "chunk " << chunk << (on_backend ? " on the backend" : " on the CPU");
      EXPECT_EQ(got.logprobs, ref.logprobs);
      int n = 0;
      for (const model::LinearQ& L : eng.model().linears()) {
        if (L.rac_channels.empty()) continue;
        ++n;
        EXPECT_EQ(L.rac_channels, want.at(L.name)) << L.name << " chunk " << chunk;
        EXPECT_EQ(L.rac_quant, rc.residual) << L.name;
      }
      EXPECT_EQ(n, n0);
    }
  }
  // Bad energies are refused naming the linear.
  model::Weights wm = weights();
  model::Model m(wm, prec);
  std::vector<std::vector<double>> e(m.linears().size());
  size_t q = 0;
  while (q < e.size() && m.linears()[q].num.act.kind != model::QuantKind::Quant) ++q;
  ASSERT_LT(q, e.size());
  e[q].assign(m.linears()[q].in + 1, 1.0);
  try {
    model::rac_assign(m, e, rc);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find(m.linears()[q].name), std::string::npos) << err.what();
  }
  EXPECT_THROW(model::rac_assign(m, {}, rc), Error);
}
