// The trainer-backend plumbing of the RL loop and SFT (rl.train_device = "cuda"), checked without a
// GPU: a backend that runs the CPU model behind the TrainBackend interface must give the very same
// run, bit for bit, as the trainer on the CPU (same forwards in the same order, gradients added, the
// masters re-synced after every optimizer step, the reference model, resume).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "common/error.h"
#include "model/model.h"
#include "model/weights.h"
#include "rl/config.h"
#include "rl/run.h"
#include "rl/sft.h"
#include "rl_test_util.h"
#include "rollout/cpu_step_backend.h"
#include "train/backend.h"
#include "train/cpu_as_backend.h"

namespace fs = std::filesystem;

namespace quads {
namespace {

// The shared tiny run with a reference model (kl) and two minibatches (a separate no-grad pass for
// the old log-probs, two optimizer steps per RL step) on the backend too.
rl::RunConfig tiny() {
  rl::RunConfig c = test::tiny_run_config();
  c.rl.steps = 3;
  c.rl.prompts_per_step = 4;
  c.rl.kl_coef = 0.05;
  c.rl.minibatches = 2;
  return c;
}

class RlTrainBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / fmt::format("quads_rl_backend_{}", ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
    train::register_gpu_train_backend([this](const model::Weights& w, const model::PrecisionConfig& p) {
      return std::make_unique<test::CpuAsBackend>(w, p, &calls_, optimizer_);
    });
  }
  void TearDown() override {
    train::register_gpu_train_backend(nullptr);
    rl::set_rollout_backend_factory(nullptr);
    fs::remove_all(root_);
  }
  std::string dir(const std::string& n) const { return (root_ / n).string(); }
  rl::RunOptions options(const std::string& out, const std::string& base) const {
    rl::RunOptions o;
    o.mode = "quads";
    o.seed = 3;
    o.base_dir = base;
    o.out_dir = out;
    o.progress = false;
    return o;
  }
  void equals_the_cpu_trainer(bool replay = false);
  fs::path root_;
  int calls_ = 0;
  bool optimizer_ = false;
};

TEST_F(RlTrainBackend, SftAndRlThroughTheBackendEqualTheCpuTrainerBitwise) { equals_the_cpu_trainer(); }

// The same with AdamW on the backend (the GPU's path: gradients and masters stay there, the host
// gets the masters once per RL step and the moments at checkpoints).
TEST_F(RlTrainBackend, WithTheBackendsOptimizerTooBitwise) {
  optimizer_ = true;
  equals_the_cpu_trainer();
}

// Routing replay (the trainer and the reference routed to the rollout's experts) on the backend.
TEST_F(RlTrainBackend, RoutingReplayThroughTheBackendBitwise) {
  optimizer_ = true;
  equals_the_cpu_trainer(true);
}

void RlTrainBackend::equals_the_cpu_trainer(bool replay) {
  rl::RunConfig cpu = tiny();
  cpu.rl.routing_replay = replay;
  rl::RunConfig dev = cpu;
  dev.rl.train_device = "cuda";  // rollouts stay on the CPU (rl.device = "cpu")

  const rl::SftResult s_cpu = rl::run_sft(cpu, dir("base_cpu"), false);
  const rl::SftResult s_dev = rl::run_sft(dev, dir("base_dev"), false);
  EXPECT_GT(calls_, 0);
  EXPECT_EQ(s_cpu.final_loss, s_dev.final_loss);
  EXPECT_EQ(s_cpu.pass1, s_dev.pass1);
  const model::Weights a = model::Weights::load(dir("base_cpu"));
  const model::Weights b = model::Weights::load(dir("base_dev"));
  ASSERT_EQ(a.data.size(), b.data.size());
  EXPECT_EQ(0, std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)));
  // The device is part of the base's identity: a CPU config does not reuse a GPU-trained base.
  EXPECT_FALSE(rl::ensure_base(cpu, dir("base_dev"), false).cached);

  calls_ = 0;
  const rl::RunOutcome r_cpu = rl::run_rl(cpu, options(dir("rl_cpu"), dir("base_cpu")));
  EXPECT_EQ(calls_, 0);
  const rl::RunOutcome r_dev = rl::run_rl(dev, options(dir("rl_dev"), dir("base_cpu")));
  // Per step: the reference, the old log-probs (with replay: the trainer's own routing, then the
  // replayed pass), two minibatch forwards.
  EXPECT_EQ(calls_, (replay ? 5 : 4) * dev.rl.steps);
  EXPECT_EQ(r_dev.train_device, "cpu-as-backend");
  EXPECT_EQ(r_cpu.train_device, "cpu");
  double grad = 0;
  for (const auto& row : r_cpu.rows)
    if (row["kind"] == "train") grad += row["grad_norm"].get<double>();
  ASSERT_GT(grad, 0.0) << "no learning signal: " << r_cpu.rows.back().dump();
  EXPECT_EQ(test::deterministic(r_cpu.rows), test::deterministic(r_dev.rows));
  const model::Weights c = model::Weights::load(dir("rl_cpu") + "/checkpoint");
  const model::Weights d = model::Weights::load(dir("rl_dev") + "/checkpoint");
  EXPECT_EQ(0, std::memcmp(c.data.data(), d.data.data(), c.data.size() * sizeof(float)));

  // Resume through the backend: stop after 2 steps (a checkpoint), go on to the end.
  rl::RunOptions half = options(dir("rl_dev_resumed"), dir("base_cpu"));
  half.stop_after = 2;
  rl::run_rl(dev, half);
  half.stop_after = -1;
  half.resume = true;
  const rl::RunOutcome r_res = rl::run_rl(dev, half);
  EXPECT_EQ(test::deterministic(r_cpu.rows), test::deterministic(r_res.rows));
}

// rl.device = "cuda" through a rollout backend that records routing (the GPU's RolloutEngine::inspect
// path, here the CPU model behind the StepBackend interface): with routing replay, the rollout's
// expert choices come from the backend's recorded steps (with or without the diagnostics' CPU
// forward, which then only measures the activation error), and the run is the CPU run bit for bit.
TEST_F(RlTrainBackend, RolloutRoutingFromTheStepBackendBitwise) {
  rl::RunConfig cpu = tiny();
  cpu.rl.routing_replay = true;
  rl::run_sft(cpu, dir("base"), false);
  rl::RunOptions o = options(dir("rl_cpu"), dir("base"));
  o.mode = "nvfp4";
  const rl::RunOutcome want = rl::run_rl(cpu, o);
  for (const bool diagnostics : {true, false}) {
    rl::RunConfig dev = cpu;
    dev.rl.device = "cuda";
    dev.rl.train_device = "cpu";
    dev.rl.diagnostics = diagnostics;
    test::StepCalls sc;
    rl::set_rollout_backend_factory([&sc](const model::Weights& w, const model::PrecisionConfig& p) {
      return std::make_unique<test::CpuStepBackend>(w, p, &sc);
    });
    o.out_dir = dir(diagnostics ? "rl_dev_diag" : "rl_dev");
    const rl::RunOutcome got = rl::run_rl(dev, o);
    rl::set_rollout_backend_factory(nullptr);
    EXPECT_EQ(got.device, "cpu-test");
    EXPECT_EQ(sc.records, dev.rl.steps) << "one recorded step per RL step (the batch fits one chunk)";
    std::vector<nlohmann::json> w = test::deterministic(want.rows), g = test::deterministic(got.rows);
    int mismatch_rows = 0;
    for (const auto& row : g) mismatch_rows += row.contains("routing_mismatch");
    EXPECT_EQ(mismatch_rows, dev.rl.steps) << "replay measures the rollout's routing against the trainer's";
    if (!diagnostics)  // the activation error needs the diagnostics' forward
      for (auto& row : w)
        for (const char* k : {"act_qerr", "act_qerr_layers"}) row.erase(k);
    EXPECT_EQ(w, g) << "diagnostics " << diagnostics;
  }
}

// Both sides on "the device" (rl.device and rl.train_device = "cuda", AdamW on the trainer's
// backend), as on a GPU: the rollout engines sync from the trainer's masters without the host, the
// static-RAC calibration runs on the rollout backend, intermediate checkpoints are written in the
// background; the run, and a run resumed from one of those checkpoints, are the CPU run bit for bit.
TEST_F(RlTrainBackend, RolloutsAndTrainerOnTheBackendsBitwise) {
  optimizer_ = true;
  rl::RunConfig cpu = tiny();
  rl::run_sft(cpu, dir("base"), false);
  const rl::RunOutcome want = rl::run_rl(cpu, options(dir("rl_cpu"), dir("base")));
  rl::RunConfig dev = cpu;
  dev.rl.device = "cuda";
  dev.rl.train_device = "cuda";
  test::StepCalls sc;
  rl::set_rollout_backend_factory([&sc](const model::Weights& w, const model::PrecisionConfig& p) {
    return std::make_unique<test::CpuStepBackend>(w, p, &sc);
  });
  const rl::RunOutcome got = rl::run_rl(dev, options(dir("rl_dev"), dir("base")));
  EXPECT_EQ(got.device, "cpu-test");
  EXPECT_EQ(got.train_device, "cpu-as-backend");
  EXPECT_EQ(test::deterministic(want.rows), test::deterministic(got.rows));
  // a sync a step for the rollout engine, one an evaluation for the fp32 engine (every eval_every
  // steps and the final one, which syncs the rollout engine too), none through the host
  const int64_t evals = (dev.rl.steps + dev.rl.eval_every - 1) / dev.rl.eval_every + 1;
  EXPECT_EQ(sc.device_syncs, dev.rl.steps + 1 + evals);
  EXPECT_EQ(sc.syncs, 0);
  EXPECT_EQ(sc.downloads, 0) << "nothing needed the engines' host copies";
  EXPECT_GT(sc.energy_steps, 0) << "quads calibrates RAC on the rollout backend";
  const model::Weights c = model::Weights::load(dir("rl_cpu") + "/checkpoint");
  const model::Weights d = model::Weights::load(dir("rl_dev") + "/checkpoint");
  EXPECT_EQ(0, std::memcmp(c.data.data(), d.data.data(), c.data.size() * sizeof(float)));

  rl::RunOptions half = options(dir("rl_dev_resumed"), dir("base"));
  half.stop_after = 2;  // ends on the checkpoint of step 2, written in the background
  rl::run_rl(dev, half);
  half.stop_after = -1;
  half.resume = true;
  const rl::RunOutcome res = rl::run_rl(dev, half);
  rl::set_rollout_backend_factory(nullptr);
  EXPECT_EQ(test::deterministic(want.rows), test::deterministic(res.rows));
}

TEST_F(RlTrainBackend, ClearErrors) {
  rl::RunConfig cfg = tiny();
  cfg.rl.train_device = "cuda";
  rl::run_sft(tiny(), dir("base"), false);
  train::register_gpu_train_backend(nullptr);
  try {
    rl::run_rl(cfg, options(dir("none"), dir("base")));
    FAIL() << "no backend installed: must be an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace quads
