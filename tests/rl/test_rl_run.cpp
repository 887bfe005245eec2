// GRPO runs on a tiny model: resume is bitwise identical, a NaN stops the run and keeps the last
// checkpoint, BF16 rollout and BF16 trainer agree exactly, the summary follows its definitions, and
// `compare` writes its outputs.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "rl/compare.h"
#include "rl/config.h"
#include "rl/policy.h"
#include "rl/run.h"
#include "rl_test_util.h"
#include "rl/sft.h"

namespace fs = std::filesystem;

namespace quads {
namespace {


class RlLoopRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / fmt::format("quads_rl_run_{}", ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
    rl::run_sft(test::tiny_run_config(), base(), false);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }
  static std::string base() { return (root_ / "base").string(); }
  static std::string dir(const std::string& name) { return (root_ / name).string(); }

  static rl::RunOptions options(const std::string& mode, const std::string& out) {
    rl::RunOptions o;
    o.mode = mode;
    o.seed = 3;
    o.base_dir = base();
    o.out_dir = out;
    o.progress = false;
    return o;
  }
  static fs::path root_;
};
fs::path RlLoopRun::root_;

using test::deterministic;

std::vector<float> read_tensor(const std::string& file, const std::string& name) {
  auto f = io::SafeTensorsFile::open(file);
  return f->at(name).to_f32();
}

TEST_F(RlLoopRun, BaseCheckpointLoads) {
  rl::BaseModel b = rl::load_base(base());
  EXPECT_EQ(b.weights.cfg.hidden_size, 32);
  EXPECT_EQ(b.weights.cfg.vocab_size % 8, 0);
  EXPECT_GE(b.weights.cfg.vocab_size, b.tok.vocab_size());
  EXPECT_TRUE(fs::exists(base() + "/sft.json"));
  // A second ensure_base with the same config reuses the folder; another config retrains.
  EXPECT_TRUE(rl::ensure_base(test::tiny_run_config(), base(), false).cached);
  EXPECT_THROW(rl::load_base(dir("nowhere")), Error);
}

TEST_F(RlLoopRun, ResumeIsBitwiseIdentical) {
  const rl::RunConfig cfg = test::tiny_run_config();
  rl::RunOutcome straight = rl::run_rl(cfg, options("quads", dir("straight")));
  EXPECT_EQ(straight.steps_done, 4);
  double grad = 0;
  for (const auto& r : straight.rows)
    if (r["kind"] == "train") grad += r["grad_norm"].get<double>();
  ASSERT_GT(grad, 0.0) << "no learning signal: every group had equal rewards";

  rl::RunOptions half = options("quads", dir("resumed"));
  half.stop_after = 2;
  rl::RunOutcome first = rl::run_rl(cfg, half);
  EXPECT_EQ(first.steps_done, 2);
  half.stop_after = -1;
  half.resume = true;
  rl::RunOutcome second = rl::run_rl(cfg, half);
  EXPECT_EQ(second.steps_done, 4);

  EXPECT_EQ(deterministic(straight.rows), deterministic(second.rows));
  EXPECT_EQ(deterministic(rl::read_jsonl(dir("straight") + "/metrics.jsonl")),
            deterministic(rl::read_jsonl(dir("resumed") + "/metrics.jsonl")));
  const model::Weights a = model::Weights::load(dir("straight") + "/checkpoint");
  const model::Weights b = model::Weights::load(dir("resumed") + "/checkpoint");
  ASSERT_EQ(a.data.size(), b.data.size());
  EXPECT_EQ(0, std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)));
  for (const char* t : {"adamw.m", "adamw.v"})
    EXPECT_EQ(read_tensor(dir("straight") + "/checkpoint/optimizer.safetensors", t),
              read_tensor(dir("resumed") + "/checkpoint/optimizer.safetensors", t))
        << t;
  // The run learned something different from the base (the update is not a no-op).
  const model::Weights base_w = model::Weights::load(base());
  EXPECT_NE(0, std::memcmp(a.data.data(), base_w.data.data(), a.data.size() * sizeof(float)));
}

TEST_F(RlLoopRun, NanStopsTheRunAndKeepsTheLastCheckpoint) {
  rl::RunOptions o = options("nvfp4", dir("nan"));
  o.grad_hook = [](int64_t step, float* g, size_t) {
    if (step == 3) g[0] = std::numeric_limits<float>::quiet_NaN();
  };
  try {
    rl::run_rl(test::tiny_run_config(), o);
    FAIL() << "the run did not stop";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("at step 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("NaN/Inf in the gradients"), std::string::npos) << msg;
  }
  std::ifstream f(dir("nan") + "/checkpoint/state.json");
  std::stringstream ss;
  ss << f.rdbuf();
  const nlohmann::json st = nlohmann::json::parse(ss.str());
  EXPECT_EQ(st.at("step").get<int64_t>(), 2);
  // Resuming without the fault finishes the run.
  o.grad_hook = nullptr;
  o.resume = true;
  EXPECT_EQ(rl::run_rl(test::tiny_run_config(), o).steps_done, 4);
}

TEST_F(RlLoopRun, Bf16RolloutAndTrainerAgreeExactly) {
  rl::RunConfig cfg = test::tiny_run_config();
  cfg.rl.steps = 2;
  for (const char* mode : {"bf16", "nvfp4"}) {
    rl::RunOutcome r = rl::run_rl(cfg, options(mode, dir(std::string("gap_") + mode)));
    int train_rows = 0;
    for (const auto& row : r.rows) {
      if (row["kind"] != "train") continue;
      ++train_rows;
      const double gap = row["gap_mean_abs"].get<double>(), mm = row["routing_mismatch"].get<double>();
      if (std::string(mode) == "bf16") {
        EXPECT_EQ(gap, 0.0);
        EXPECT_EQ(row["gap_max_abs"].get<double>(), 0.0);
        EXPECT_EQ(mm, 0.0);
      } else {
        EXPECT_GT(gap, 0.0);
        EXPECT_GE(mm, 0.0);
        EXPECT_LE(mm, 1.0);
        EXPECT_GT(row["act_qerr"].get<double>(), 1e-4);  // NVFP4 activations: a visible error
      }
      EXPECT_TRUE(row.contains("entropy") && row.contains("response_len") && row.contains("t_rollout"));
    }
    EXPECT_EQ(train_rows, 2);
  }
}

TEST_F(RlLoopRun, RoutingReplayAndKlRun) {
  rl::RunConfig cfg = test::tiny_run_config();
  cfg.rl.steps = 1;
  cfg.rl.routing_replay = true;
  cfg.rl.kl_coef = 0.1;
  cfg.rl.minibatches = 2;
  rl::RunOutcome r = rl::run_rl(cfg, options("nvfp4-tis", dir("replay")));
  bool seen = false;
  for (const auto& row : r.rows)
    if (row["kind"] == "train") {
      seen = true;
      EXPECT_TRUE(row.contains("routing_mismatch"));
      EXPECT_GE(row["kl_ref"].get<double>(), 0.0);
      EXPECT_GT(row["tis_weight_mean"].get<double>(), 0.0);
    }
  EXPECT_TRUE(seen);
}

TEST(RlLoopSummary, FollowsTheDefinitions) {
  std::vector<nlohmann::json> rows = {
      {{"kind", "eval"}, {"step", 0}, {"pass1", 0.5}, {"elapsed_s", 1.0}},
      {{"kind", "train"}, {"step", 0}, {"gap_mean_abs", 0.1}, {"gap_max_abs", 2.0}, {"elapsed_s", 2.0}},
      {{"kind", "train"}, {"step", 1}, {"gap_mean_abs", 0.3}, {"gap_max_abs", 4.0}, {"elapsed_s", 3.0}},
      {{"kind", "eval"}, {"step", 2}, {"pass1", 0.8}, {"elapsed_s", 4.0}},
      {{"kind", "eval"}, {"step", 4}, {"pass1", 0.65}, {"elapsed_s", 5.0}},
  };
  rl::RunResult r = rl::summarize_rows(rows, 0.1);
  EXPECT_EQ(r.base_pass1, 0.5);
  EXPECT_EQ(r.final_pass1, 0.65);
  EXPECT_EQ(r.best_pass1, 0.8);
  EXPECT_DOUBLE_EQ(r.mean_abs_logp_gap, 0.2);
  EXPECT_DOUBLE_EQ(r.max_abs_logp_gap, 3.0);  // mean of the per-step maxima, not their max
  EXPECT_TRUE(r.collapsed);                   // 0.65 < 0.8 - 0.1
  EXPECT_FALSE(rl::summarize_rows(rows, 0.2).collapsed);
  EXPECT_EQ(r.seconds, 5.0);
  rows.erase(rows.begin());
  rows.erase(rows.begin() + 2, rows.end());
  EXPECT_THROW(rl::summarize_rows(rows, 0.1), Error);
}

TEST_F(RlLoopRun, CompareWritesSummaryReportAndTable) {
  rl::RunConfig cfg = test::tiny_run_config();
  cfg.modes = {"bf16", "quads"};
  cfg.rl.steps = 1;
  cfg.rl.seeds = 2;
  rl::CompareOptions co;
  co.out_dir = dir("compare");
  co.progress = false;
  co.jobs = 2;
  // The compare folder trains its own base (same config: same weights as the suite's base).
  rl::CompareOutcome out = rl::run_compare(cfg, co);
  for (const char* f : {"summary.json", "report.md", "metrics.jsonl", "metrics.csv", "config.toml", "base/sft.json"})
    EXPECT_TRUE(fs::exists(dir("compare") + "/" + f)) << f;
  const auto& modes = out.summary.at("modes");
  ASSERT_TRUE(modes.contains("bf16") && modes.contains("quads"));
  for (const char* k : {"base_pass1", "final_pass1", "best_pass1", "mean_abs_logp_gap", "max_abs_logp_gap", "collapsed",
                        "seconds", "base_pass1_std", "mean_abs_logp_gap_std"})
    EXPECT_TRUE(modes["quads"].contains(k)) << k;
  EXPECT_EQ(modes["bf16"]["mean_abs_logp_gap"].get<double>(), 0.0);
  EXPECT_GT(modes["quads"]["mean_abs_logp_gap"].get<double>(), 0.0);
  // Both modes start from the same base: the fp32 evaluation at step 0 agrees.
  std::map<std::string, double> fp32_at_0;
  for (const auto& row : rl::read_jsonl(dir("compare") + "/metrics.jsonl"))
    if (row["kind"] == "eval" && row["step"] == 0 && row["seed"] == 1) fp32_at_0[row["mode"]] = row["pass1_fp32"];
  ASSERT_EQ(fp32_at_0.size(), 2u);
  EXPECT_EQ(fp32_at_0["bf16"], fp32_at_0["quads"]);
  EXPECT_NE(out.table.find("quads"), std::string::npos);
  const model::Weights a = model::Weights::load(base());
  const model::Weights b = model::Weights::load(dir("compare") + "/base");
  EXPECT_EQ(0, std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)));
}

// compare --analyze on the generated tasks: the SFT base analyzed on worked solutions, and the
// report section built from DIR/analysis.
TEST_F(RlLoopRun, AnalyzeBaseOnGeneratedTasks) {
  rl::RunConfig cfg = test::tiny_run_config();
  cfg.analysis.batches = 2;
  cfg.analysis.batch_size = 3;
  cfg.analysis.max_len = 20;
  cfg.analysis.topk = 4;
  const std::string out = dir("analyze");
  const auto files = rl::analyze_base(cfg, base(), out);
  EXPECT_NE(std::find(files.begin(), files.end(), "summary.txt"), files.end());
  std::ifstream f(out + "/analysis/layers.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["data"], "generated tasks (worked solutions)");
  EXPECT_EQ(j["model"], base());
  EXPECT_EQ(j["batches"], 2);
  EXPECT_EQ(j["topk"], 4);
  const std::string md = rl::analysis_section(out);
  EXPECT_NE(md.find("## Error analysis of the base model"), std::string::npos);
  EXPECT_NE(md.find("quads analyze layers"), std::string::npos) << md;  // the summary's first line
}

}  // namespace
}  // namespace quads
