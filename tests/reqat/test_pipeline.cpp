// The trainer learns (loss falls on a tiny data set, in float32 and under W4A4KV4 fake
// quantization), and a miniature `quads reqat` run writes a complete, consistent summary.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "reqat/kv_quant.h"
#include "reqat/pipeline.h"
#include "reqat/reqat_test_util.h"
#include "reqat/trainer.h"
#include "rl/report.h"
#include "train/backend.h"
#include "train/cpu_as_backend.h"

using namespace quads;
using namespace quads::reqat;

namespace {

ReqatConfig tiny() {
  ReqatConfig c;
  c.model.hidden = 32;
  c.model.layers = 2;
  c.model.heads = 2;
  c.model.kv_heads = 1;
  c.model.head_dim = 16;
  c.model.experts = 4;
  c.model.experts_per_token = 2;
  c.model.moe_intermediate = 32;
  c.base.steps = 12;
  c.base.batch = 8;
  c.base.warmup = 2;
  c.traces.source = "solutions";
  c.traces.prompts = 24;
  c.stage1 = {4, 1e-3, 8, 1};
  c.stage2 = {4, 3e-4, 8, 1};
  c.qfit.calib_sequences = 4;
  c.qfit.grid = 3;
  c.eval.size = 8;
  c.eval.max_new_tokens = 20;
  c.tasks.families = {"add"};
  c.tasks.add_digits = {2};
  return c;
}

}  // namespace

TEST(ReqatTrainer, LossFallsInFp32AndW4A4KV4) {
  const ReqatConfig c = tiny();
  const rl::CharTokenizer tok;
  const model::ModelConfig mc = task_model_config(32, 2, 2, 1, 16, 4, 2, 32, 128, 1e4, 1e-6, tok.vocab_size());
  rl::RunConfig rc;
  rc.tasks = c.tasks;
  const rl::TaskSet ts(rc.task_mix(), 5, 4);
  std::vector<rl::SftExample> data;
  for (const rl::Task& t : ts.train_batch(0, 8)) data.push_back(rl::make_sft_example(t, tok));
  for (const char* mode : {"fp32", "w4a4kv4"}) {
    SCOPED_TRACE(mode);
    model::Weights w = model::Weights::random(mc, 3, 0.02f);
    const bool q = std::string(mode) == "w4a4kv4";
    model::Model m(w, model::PrecisionConfig::preset(q ? "qat-sym" : "fp32"));
    if (q) install_kv_hooks(m, KvQuantConfig{}, nullptr);
    const double before = eval_loss(m, data);
    const TrainSpec s = test::short_spec(30, 8, q, 2);
    const auto log = train_sft(m, data, s);
    ASSERT_EQ(log.size(), 30u);
    const double after = eval_loss(m, data);
    EXPECT_LT(after, 0.6 * before) << before << " -> " << after;
    if (q) {
      EXPECT_GT(log.back().sem, 0.0);
    }
  }
}

// Stage 2's setting (qat-sym, KV4, Q-FIT, SEM) with device = "cuda" runs the trainer backend: the
// CPU model behind the backend interface (tests/train/cpu_as_backend.h) must give the CPU path's run
// bit for bit, which checks the plumbing (the KV transform handed over as data and run by hooks made
// from it, AdamW on the backend, the masters downloaded at the end) without a GPU. Then the checks.
TEST(ReqatTrainer, DevicePathThroughABackendEqualsTheCpuBitwise) {
  const rl::CharTokenizer tok;
  const model::ModelConfig mc = task_model_config(32, 2, 2, 1, 16, 4, 2, 32, 128, 1e4, 1e-6, tok.vocab_size());
  rl::RunConfig rc;
  rc.tasks = tiny().tasks;
  const rl::TaskSet ts(rc.task_mix(), 5, 4);
  std::vector<rl::SftExample> data;
  for (const rl::Task& t : ts.train_batch(0, 8)) data.push_back(rl::make_sft_example(t, tok));
  const QFit qf = test::random_qfit(mc, 11);
  const KvQuantConfig kv = parse_kv_quant("e1m2");
  const model::Weights w0 = model::Weights::random(mc, 3, 0.02f);
  const TrainSpec s = test::short_spec(4, 4, true);
  auto run = [&](const std::string& device, model::Weights& w, std::string* where) {
    model::Model m(w, model::PrecisionConfig::preset("qat-sym"));
    install_kv_hooks(m, kv, &qf);
    TrainSpec d = s;
    d.device = device;
    if (device == "cuda") d.kv = make_kv_transform(mc, kv, &qf);
    return train_sft(m, data, d, where);
  };
  int calls = 0;
  model::Weights wc = w0;
  std::string where_c;
  const auto lc = run("cpu", wc, &where_c);
  EXPECT_EQ(where_c, "cpu");
  EXPECT_GT(lc.back().sem, 0.0);
  EXPECT_FALSE(wc.data == w0.data);
  // A backend with its own AdamW (the GPU trainer's way), and one without (the host's AdamW on the
  // gradients it adds, the masters synced back to it each step).
  for (const bool optimizer : {true, false}) {
    calls = 0;
    train::register_gpu_train_backend([&calls, optimizer](const model::Weights& w, const model::PrecisionConfig& p) {
      return std::make_unique<test::CpuAsBackend>(w, p, &calls, optimizer);
    });
    model::Weights wd = w0;
    std::string where_d;
    const auto ld = run("cuda", wd, &where_d);
    EXPECT_EQ(where_d, "cpu-as-backend");
    EXPECT_EQ(calls, 4);
    ASSERT_EQ(lc.size(), ld.size());
    for (size_t i = 0; i < lc.size(); ++i) {
      EXPECT_EQ(lc[i].loss, ld[i].loss) << i << " optimizer " << optimizer;
      EXPECT_EQ(lc[i].sem, ld[i].sem) << i << " optimizer " << optimizer;
      EXPECT_EQ(lc[i].grad_norm, ld[i].grad_norm) << i << " optimizer " << optimizer;
    }
    EXPECT_TRUE(wc.data == wd.data) << "the masters after training differ (optimizer " << optimizer << ")";
  }

  // The hooks and the transform must come together; unknown devices and missing backends are named.
  {
    model::Weights w = w0;
    model::Model m(w, model::PrecisionConfig::preset("qat-sym"));
    install_kv_hooks(m, kv, &qf);
    TrainSpec d = s;
    d.device = "cuda";  // no d.kv
    try {
      train_sft(m, data, d);
      ADD_FAILURE() << "hooks without a transform were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KV transform"), std::string::npos) << e.what();
    }
    d.device = "tpu";
    try {
      train_sft(m, data, d);
      ADD_FAILURE() << "device tpu was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tpu"), std::string::npos) << e.what();
    }
  }
  train::register_gpu_train_backend(nullptr);
  {
    model::Weights w = w0;
    model::Model m(w, model::PrecisionConfig::preset("fp32"));
    TrainSpec d = s;
    d.device = "cuda";
    try {
      train_sft(m, data, d);
      ADD_FAILURE() << "device cuda without a CUDA trainer was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA trainer"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(w.data == w0.data);
  }
  // A backend without a KV transform of its own takes an empty one only.
  struct Bare : train::TrainBackend {
    std::string name() const override { return "bare"; }
    void forward(const model::Batch&, float*, bool, model::Routing*, const model::Routing*) override {}
    void backward(const float*, float*) override {}
    void sync(const model::Weights&) override {}
  } bare;
  EXPECT_NO_THROW(bare.set_kv_transform(model::KvTransform{}));
  EXPECT_THROW(bare.set_kv_transform(make_kv_transform(mc, kv, nullptr)), Error);
}

TEST(ReqatPipeline, MiniatureRunWritesConsistentSummary) {
  const std::string out = (std::filesystem::temp_directory_path() / "quads_reqat_pipeline_test").string();
  std::filesystem::remove_all(out);
  RunOptions ro;
  ro.progress = false;
  ro.save_checkpoints = false;
  const ReqatConfig c = tiny();
  const auto s = run_reqat(c, out, ro);
  for (const char* f : {"summary.json", "report.md", "metrics.jsonl", "metrics.csv", "qfit.json", "config.toml"})
    EXPECT_TRUE(std::filesystem::exists(out + "/" + f)) << f;
  ASSERT_EQ(s["rows"].size(), 3u + c.variants.size());
  for (const auto& r : s["rows"])
    for (const char* k : {"fp_pass1", "w4a4_pass1", "w4a4kv4_pass1"}) {
      const double v = r[k].get<double>();
      EXPECT_TRUE(v >= 0 && v <= 1) << r["name"] << " " << k;
    }
  // The stage-1 model's FP row is the reference; W4A4KV4 of each variant is in the headline dict.
  EXPECT_EQ(s["full_precision_pass1"].get<double>(), s["rows"][1]["fp_pass1"].get<double>());
  for (const std::string& v : c.variants) EXPECT_TRUE(s["w4a4kv4_pass1"].contains(v)) << v;
  EXPECT_EQ(s["train_device"], "cpu");
  EXPECT_EQ(s["eval_device"], "cpu");
  ASSERT_EQ(s["qfit"].size(), 2u);
  for (const auto& q : s["qfit"]) EXPECT_LE(q["attn_mse_qfit"].get<double>(), q["attn_mse_plain"].get<double>());
  // Every stage-2 variant trained its steps; only the SEM variants have a SEM term.
  const auto rows = rl::read_jsonl(out + "/metrics.jsonl");
  for (const std::string& v : c.variants) {
    int n = 0;
    double sem = 0;
    for (const auto& r : rows)
      if (r["kind"] == "train" && r["mode"] == v) {
        ++n;
        sem += r["sem"].get<double>();
      }
    EXPECT_EQ(n, c.stage2.steps) << v;
    if (v == "taq_sem" || v == "reqat") {
      EXPECT_GT(sem, 0.0) << v;
    } else {
      EXPECT_EQ(sem, 0.0) << v;
    }
  }
  std::ifstream f(out + "/report.md");
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_NE(ss.str().find("| reqat |"), std::string::npos);
  std::filesystem::remove_all(out);
}

// train_device = "cuda" puts the stages, Q-FIT's calibration and the low-entropy analysis on the
// trainer backend: through the CPU model behind that interface the run must be the CPU run's bit
// for bit (the backend's capture and attention errors are the host's code, so Q-FIT's search, its
// candidates and shifts, must come out the same).
TEST(ReqatPipeline, TrainDeviceRunEqualsTheCpuRun) {
  const std::string base = (std::filesystem::temp_directory_path() / "quads_reqat_device_test").string();
  std::filesystem::remove_all(base);
  RunOptions ro;
  ro.progress = false;
  ro.save_checkpoints = false;
  ReqatConfig c = tiny();
  c.variants = {"reqat"};
  const auto cpu = run_reqat(c, base + "/cpu", ro);
  int calls = 0;
  train::register_gpu_train_backend([&calls](const model::Weights& w, const model::PrecisionConfig& p) {
    return std::make_unique<test::CpuAsBackend>(w, p, &calls, true);
  });
  c.train_device = "cuda";
  nlohmann::ordered_json dev;
  try {
    dev = run_reqat(c, base + "/dev", ro);
  } catch (...) {
    train::register_gpu_train_backend(nullptr);
    throw;
  }
  train::register_gpu_train_backend(nullptr);
  EXPECT_EQ(dev["train_device"], "cpu-as-backend");
  EXPECT_GT(calls, 0);
  EXPECT_EQ(dev["qfit"], cpu["qfit"]);
  EXPECT_EQ(dev["rows"], cpu["rows"]);
  EXPECT_EQ(dev["tokens"], cpu["tokens"]);
  const auto qa = rl::read_jsonl(base + "/cpu/qfit.json"), qb = rl::read_jsonl(base + "/dev/qfit.json");
  EXPECT_EQ(qa, qb);  // scales and shifts too
  std::filesystem::remove_all(base);
}
