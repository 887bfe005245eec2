// GRPO on the GPU (rl.device = "cuda": rollouts, and with rl.train_device = auto the trainer's
// forward/backward and AdamW too, rl/run.h): a 3-step run in modes bf16 and quads on a tiny model
// next to the same run on the CPU. Skips without a GPU.
//
// What can be asserted: the GPU sums in another order than the CPU (logits agree to ~1e-7 rel. L2,
// not bitwise), so with the same seeds a sampled token can flip where two tokens' cumulative
// probabilities straddle the sampler's uniform draw, and from there that sequence differs. Such
// flips are rare but possible, so the runs are compared through averages, not token by token:
//   - every metric is finite and every reward is 0 or 1 (reward_mean * N is an integer);
//   - bf16: the CPU's trainer and rollout agree exactly (gap 0); on the GPU the gap is only the
//     sum-order noise, far below the NVFP4 gap: mean |gap| < 2e-3;
//   - quads: the mean |gap| over the 3 steps is the CPU run's within 25% + 2e-3 (the gap comes from
//     the W4A4+RAC numerics, which the GPU reproduces; a few flipped tokens move it a little);
//   - the step-0 greedy pass@1 (same base weights) differs from the CPU's by at most one prompt.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_test_util.h"
#include "rl/config.h"
#include "rl/run.h"
#include "rl/sft.h"

namespace fs = std::filesystem;
using namespace quads;

namespace {

// Sizes that take the W4A4 GEMM path on the GPU (K % 64 == 0) and RAC in whole 16-blocks.
rl::RunConfig tiny_config() {
  rl::RunConfig c;
  c.model.hidden = 64;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.kv_heads = 1;
  c.model.head_dim = 32;
  c.model.experts = 4;
  c.model.experts_per_token = 2;
  c.model.moe_intermediate = 64;
  c.model.max_seq_len = 64;
  c.sft.steps = 120;
  c.sft.batch = 16;
  c.sft.warmup_steps = 10;
  c.rl.steps = 3;
  c.rl.group_size = 4;
  c.rl.prompts_per_step = 2;
  c.rl.max_new_tokens = 24;  // room for the answer: some rewards are 1 (0.125 at step 0 on the CPU)
  c.rl.eval_every = 3;
  c.rl.eval_size = 16;
  c.rl.checkpoint_every = 0;
  c.rl.lr = 1e-3;
  c.tasks.families = {"add"};
  c.tasks.add_digits = {1};
  return c;
}

class CudaRl : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (cuda::device_count() == 0) return;
    root_ = fs::temp_directory_path() / fmt::format("quads_rl_gpu_{}", ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
    rl::run_sft(tiny_config(), (root_ / "base").string(), false);
    rl::install_cuda_rollouts();
  }
  static void TearDownTestSuite() {
    if (!root_.empty()) fs::remove_all(root_);
  }

  static rl::RunOutcome run(const std::string& mode, const std::string& device, bool replay = false,
                            bool diagnostics = true) {
    rl::RunConfig cfg = tiny_config();
    cfg.rl.device = device;
    cfg.rl.routing_replay = replay;
    cfg.rl.diagnostics = diagnostics;
    rl::RunOptions o;
    o.mode = mode;
    o.seed = 5;
    o.base_dir = (root_ / "base").string();
    o.out_dir = (root_ / (mode + "-" + device + (replay ? "-replay" : ""))).string();
    o.progress = false;
    return rl::run_rl(cfg, o);
  }
  static fs::path root_;
};
fs::path CudaRl::root_;

struct Runs {
  std::vector<nlohmann::json> train_cpu, train_gpu;
  double pass1_cpu0 = -1, pass1_gpu0 = -1;
  double mean_gap_cpu = 0, mean_gap_gpu = 0;
};

Runs compare(const rl::RunOutcome& cpu, const rl::RunOutcome& gpu) {
  const rl::RunConfig cfg = tiny_config();
  const double N = static_cast<double>(cfg.rl.group_size * cfg.rl.prompts_per_step);
  Runs r;
  EXPECT_EQ(cpu.device, "cpu");
  EXPECT_EQ(gpu.device.rfind("cuda:", 0), 0u) << gpu.device;
  EXPECT_EQ(gpu.train_device.rfind("cuda:", 0), 0u) << gpu.train_device;  // rl.train_device = auto follows
  for (int side = 0; side < 2; ++side) {
    const auto& rows = side ? gpu.rows : cpu.rows;
    auto& train = side ? r.train_gpu : r.train_cpu;
    for (const auto& row : rows) {
      for (const auto& [k, v] : row.items()) {
        if (v.is_number()) {
          EXPECT_TRUE(std::isfinite(v.get<double>())) << k << " in " << row.dump();
        }
      }
      if (row["kind"] == "train") {
        train.push_back(row);
        const double m = row["reward_mean"].get<double>();
        EXPECT_GE(m, 0.0);
        EXPECT_LE(m, 1.0);
        EXPECT_NEAR(m * N, std::round(m * N), 1e-6) << "rewards not in {0, 1}: " << row.dump();
        (side ? r.mean_gap_gpu : r.mean_gap_cpu) += row["gap_mean_abs"].get<double>() / cfg.rl.steps;
      } else if (row["kind"] == "eval" && row["step"] == 0) {
        (side ? r.pass1_gpu0 : r.pass1_cpu0) = row["pass1"].get<double>();
      }
    }
  }
  EXPECT_EQ(r.train_cpu.size(), static_cast<size_t>(cfg.rl.steps));
  EXPECT_EQ(r.train_gpu.size(), static_cast<size_t>(cfg.rl.steps));
  EXPECT_GE(r.pass1_gpu0, 0.0);
  EXPECT_LE(std::abs(r.pass1_gpu0 - r.pass1_cpu0), 1.0 / cfg.rl.eval_size + 1e-9)
      << "step-0 greedy pass@1: GPU " << r.pass1_gpu0 << ", CPU " << r.pass1_cpu0;
  std::printf("  rl on the GPU: mean |logp gap| GPU %.3g, CPU %.3g; step-0 greedy pass@1 GPU %.3f, CPU %.3f\n",
              r.mean_gap_gpu, r.mean_gap_cpu, r.pass1_gpu0, r.pass1_cpu0);
  return r;
}

}  // namespace

TEST_F(CudaRl, Bf16RolloutsOnGpu) {
  QUADS_REQUIRE_GPU();
  const Runs r = compare(run("bf16", "cpu"), run("bf16", "cuda"));
  EXPECT_EQ(r.mean_gap_cpu, 0.0);  // the CPU's BF16 rollout and BF16 trainer agree exactly
  EXPECT_LT(r.mean_gap_gpu, 2e-3);
}

TEST_F(CudaRl, QuadsRolloutsOnGpu) {
  QUADS_REQUIRE_GPU();
  const Runs r = compare(run("quads", "cpu"), run("quads", "cuda"));
  EXPECT_GT(r.mean_gap_cpu, 0.0);
  EXPECT_NEAR(r.mean_gap_gpu, r.mean_gap_cpu, 0.25 * r.mean_gap_cpu + 2e-3);
}

// Routing replay with the trainer on the GPU: it routes each token to the experts the rollout chose,
// as the CPU trainer does (the reference model's replay is checked bit for bit through the backend
// double on the CPU: RlTrainBackend.RoutingReplayThroughTheBackendBitwise). Without diagnostics the
// rollout's choices come from the GPU rollout model (RolloutEngine::inspect through
// GpuModel::step's record), not from a CPU forward.
TEST_F(CudaRl, RoutingReplayWithTheGpuTrainer) {
  QUADS_REQUIRE_GPU();
  const Runs r = compare(run("nvfp4", "cpu", true), run("nvfp4", "cuda", true, false));
  EXPECT_GT(r.mean_gap_cpu, 0.0);
  EXPECT_NEAR(r.mean_gap_gpu, r.mean_gap_cpu, 0.25 * r.mean_gap_cpu + 2e-3);
}
