// RL and compare on your own model and data: a tiny random Qwen3-MoE checkpoint with the fixture
// BPE tokenizer, a small JSONL with a bad line, then run_rl (resume bitwise identical), the
// ModelOpt NVFP4 export of the same model as the base, and a two-mode compare with the analysis
// linked from its report; plus the dataset source's prompts, stop tokens, rewards and errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/fixtures.h"
#include "io/export.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "model/weights.h"
#include "rl/compare.h"
#include "rl/config.h"
#include "rl/run.h"
#include "rl_test_util.h"
#include "rl/task_source.h"

namespace fs = std::filesystem;

namespace quads {
namespace {

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A model config with the fixture tokenizer's vocabulary (540 ids incl. the added tokens), padded.
model::ModelConfig tiny_model_config() {
  model::ModelConfig c;
  c.vocab_size = 544;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.max_position_embeddings = 512;
  c.raw = {{"eos_token_id", 0}, {"bos_token_id", 0}};
  c.validate("test");
  return c;
}

// Prompts, one a bad line (no answer) on line 4.
const char* kTrain =
    "{\"prompt\": \"What is 2+3?\", \"answer\": \"5\"}\n"
    "{\"prompt\": \"What is 7-4?\", \"answer\": \"3\"}\n"
    "{\"prompt\": \"Compute 6*7.\", \"answer\": \"42\"}\n"
    "{\"prompt\": \"A line without an answer\"}\n"
    "{\"prompt\": \"Half of 10?\", \"answer\": \"\\\\boxed{5}\"}\n"
    "{\"prompt\": \"What is 9+9?\", \"answer\": \"18\"}\n"
    "\n"
    "{\"prompt\": \"What is 1/2 + 1/4?\", \"answer\": \"3/4\"}\n"
    "{\"prompt\": \"What is 100-1?\", \"answer\": \"99\"}\n";
const char* kEval =
    "{\"prompt\": \"What is 4+4?\", \"answer\": \"8\"}\n"
    "{\"prompt\": \"What is 3*3?\", \"answer\": \"9\"}\n"
    "{\"prompt\": \"What is 8-5?\", \"answer\": \"3\"}\n";

class RlData : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / fmt::format("quads_rl_data_{}", ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
    model::Weights w = model::Weights::random(tiny_model_config(), 11, 0.05f);
    w.save(model_dir());
    fs::copy_file(fs::path(fixtures_dir()) / "tokenizer_bpe" / "tokenizer.json", fs::path(model_dir()) / "tokenizer.json");
    write_text(root_ / "train.jsonl", kTrain);
    write_text(root_ / "eval.jsonl", kEval);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }
  static std::string model_dir() { return (root_ / "model").string(); }
  static std::string file(const std::string& name) { return (root_ / name).string(); }

  static rl::RunConfig config() {
    rl::RunConfig c;
    c.data.model = model_dir();
    c.data.train = file("train.jsonl");
    c.data.eval = file("eval.jsonl");
    c.data.skip_bad_lines = true;
    c.rl.steps = 3;
    c.rl.group_size = 4;
    c.rl.prompts_per_step = 2;
    c.rl.max_new_tokens = 6;
    c.rl.eval_every = 2;
    c.rl.eval_size = 3;
    c.rl.checkpoint_every = 1;
    c.rl.lr = 1e-3;
    return c;
  }
  static rl::RunOptions options(const std::string& mode, const std::string& out) {
    rl::RunOptions o;
    o.mode = mode;
    o.seed = 5;
    o.out_dir = out;
    o.progress = false;
    return o;
  }
  static fs::path root_;
};
fs::path RlData::root_;

using test::deterministic;

// Prompts in the chat format, stop tokens, rewards by verify_math, truncation, decoding.
TEST_F(RlData, DatasetSourcePromptsStopsAndRewards) {
  const rl::RunConfig cfg = config();
  model::Weights w = model::Weights::load(model_dir());
  io::Tokenizer tok = io::Tokenizer::load(model_dir() + "/tokenizer.json");
  rl::DatasetTasks src(cfg.data, cfg.rl.eval_size, w.cfg, tok);
  EXPECT_TRUE(src.chat());
  EXPECT_EQ(src.train_size(), 7u);  // 8 examples, the bad line skipped
  EXPECT_EQ(src.describe()["skipped_bad_lines"], 1);
  EXPECT_EQ(src.describe()["skipped"][0], "train set: " + file("train.jsonl") + ":4: no field 'answer'");
  // <|im_end|> (2), <|endoftext|> (0) and the config's eos_token_id (0 again, once).
  EXPECT_EQ(src.stop_ids(), (std::vector<int32_t>{2, 0}));
  ASSERT_EQ(src.eval_set().size(), 3u);
  EXPECT_EQ(src.eval_set()[0].prompt, io::encode_chat_prompt(tok, "What is 4+4?"));
  EXPECT_EQ(tok.decode(src.eval_set()[0].prompt), "<|im_start|>user\nWhat is 4+4?<|im_end|>\n<|im_start|>assistant\n");

  const rl::Problem& p = src.eval_set()[0];  // answer 8
  auto ids = [&](const std::string& text, bool stop) {
    std::vector<int32_t> r = tok.encode(text);
    if (stop) r.push_back(2);
    return r;
  };
  rl::Verdict v = src.verify(p, ids("4+4 = \\boxed{8}", true));
  EXPECT_EQ(v.reward, 1.f);
  EXPECT_EQ(v.outcome, rl::Outcome::Correct);
  v = src.verify(p, ids("it is 8.0", true));  // last number, numerically equal
  EXPECT_EQ(v.reward, 1.f);
  v = src.verify(p, ids("\\boxed{9}", true));
  EXPECT_EQ(v.reward, 0.f);
  EXPECT_EQ(v.outcome, rl::Outcome::Wrong);
  v = src.verify(p, ids("no idea", true));
  EXPECT_EQ(v.outcome, rl::Outcome::Malformed);
  v = src.verify(p, ids("\\boxed{8}", false));  // never stopped: 0 unless score_truncated
  EXPECT_EQ(v.reward, 0.f);
  EXPECT_EQ(v.outcome, rl::Outcome::Truncated);
  // Text after the stop token is not part of the response.
  std::vector<int32_t> r = ids("\\boxed{8}", true);
  const std::vector<int32_t> tail = tok.encode(" \\boxed{7}");
  r.insert(r.end(), tail.begin(), tail.end());
  EXPECT_EQ(src.verify(p, r).reward, 1.f);
  EXPECT_EQ(src.decode(r), "\\boxed{8}");

  rl::DataSection d = cfg.data;
  d.score_truncated = true;
  rl::DatasetTasks src2(d, cfg.rl.eval_size, w.cfg, tok);
  EXPECT_EQ(src2.verify(src2.eval_set()[0], ids("\\boxed{8}", false)).reward, 1.f);

  // Raw format: the prompt text alone, stopping at eos_token_id only.
  d.prompt_format = "raw";
  rl::DatasetTasks raw(d, cfg.rl.eval_size, w.cfg, tok);
  EXPECT_FALSE(raw.chat());
  EXPECT_EQ(raw.eval_set()[0].prompt, tok.encode("What is 4+4?"));
  EXPECT_EQ(raw.stop_ids(), (std::vector<int32_t>{0}));
}

// Step s's prompts are a pure function of (seed, step): each epoch visits every training example
// once; the held-out split is seeded and disjoint from training.
TEST_F(RlData, TrainingPromptsAreAPureFunctionOfSeedAndStep) {
  rl::RunConfig cfg = config();
  model::Weights w = model::Weights::load(model_dir());
  io::Tokenizer tok = io::Tokenizer::load(model_dir() + "/tokenizer.json");
  rl::DatasetTasks a(cfg.data, 8, w.cfg, tok), b(cfg.data, 8, w.cfg, tok);
  EXPECT_EQ(a.train_indices(5, 3, 2), b.train_indices(5, 3, 2));
  EXPECT_NE(a.train_indices(5, 0, 7), a.train_indices(6, 0, 7));
  // 7 examples, 7 prompts per step: every step is one permutation of them.
  for (int64_t step : {0, 1, 4}) {
    auto idx = a.train_indices(5, step, 7);
    EXPECT_EQ(std::set<size_t>(idx.begin(), idx.end()).size(), 7u) << step;
  }
  // Prompts straddling an epoch boundary: steps of 3 cover 7 examples in epochs.
  std::vector<size_t> first_epoch;
  for (int64_t s = 0; s < 3; ++s)
    for (size_t i : a.train_indices(5, s, 3)) first_epoch.push_back(i);
  first_epoch.resize(7);
  EXPECT_EQ(std::set<size_t>(first_epoch.begin(), first_epoch.end()).size(), 7u);

  cfg.data.eval.clear();
  cfg.data.eval_split = 0.3;
  rl::DatasetTasks split(cfg.data, 8, w.cfg, tok);
  EXPECT_EQ(split.eval_set().size(), 2u);  // round(7 * 0.3)
  EXPECT_EQ(split.train_size(), 5u);
  std::set<int64_t> held;
  for (const auto& p : split.eval_set()) held.insert(p.item);
  for (int64_t s = 0; s < 5; ++s)
    for (const auto& p : split.train_batch(1, s, 3)) EXPECT_FALSE(held.count(p.item)) << p.item;
  cfg.data.seed = 99;
  rl::DatasetTasks split2(cfg.data, 8, w.cfg, tok);
  std::set<int64_t> held2;
  for (const auto& p : split2.eval_set()) held2.insert(p.item);
  rl::DatasetTasks split3(cfg.data, 8, w.cfg, tok);
  std::set<int64_t> held3;
  for (const auto& p : split3.eval_set()) held3.insert(p.item);
  EXPECT_EQ(held2, held3);
}

// Bad lines and long prompts: errors name file:line, or are skipped by option.
TEST_F(RlData, BadLinesAndLongPromptsNameFileAndLine) {
  rl::RunConfig cfg = config();
  cfg.data.skip_bad_lines = false;
  std::string e = error_of([&] { rl::load_run_inputs(cfg, ""); });
  EXPECT_TRUE(has(e, file("train.jsonl") + ":4")) << e;
  EXPECT_TRUE(has(e, "no field 'answer'")) << e;
  // Through run_rl too, before anything is written but the folder.
  e = error_of([&] { rl::run_rl(cfg, options("bf16", file("bad_run"))); });
  EXPECT_TRUE(has(e, file("train.jsonl") + ":4")) << e;

  cfg.data.skip_bad_lines = true;
  cfg.data.max_prompt_tokens = 25;  // "What is 1/2 + 1/4?" (line 8, 29 tokens) and line 9 (26) are longer
  e = error_of([&] { rl::load_run_inputs(cfg, ""); });
  EXPECT_TRUE(has(e, file("train.jsonl") + ":")) << e;
  EXPECT_TRUE(has(e, "data.max_prompt_tokens = 25")) << e;
  EXPECT_TRUE(has(e, file("train.jsonl") + ":8")) << e;
  cfg.data.skip_long_prompts = true;
  rl::RunInputs in = rl::load_run_inputs(cfg, "");
  const auto info = in.source->describe();
  EXPECT_EQ(info["skipped_long_prompts"], 2);
  EXPECT_EQ(info["skipped_bad_lines"], 1);
  for (const auto& p : in.source->eval_set()) EXPECT_LE(p.prompt.size(), 25u);

  // Config checks name the key.
  rl::RunConfig c2;
  c2.data.train = file("train.jsonl");
  e = error_of([&] { rl::validate(c2, "x.toml"); });
  EXPECT_TRUE(has(e, "data.model")) << e;
  c2.data.model = model_dir();
  c2.data.prompt_format = "jinja";
  e = error_of([&] { rl::validate(c2, "x.toml"); });
  EXPECT_TRUE(has(e, "data.prompt_format")) << e;
}

// run_rl on the checkpoint and the JSONL: rows finite, rewards 0/1, resume bitwise identical,
// the run folder says which model and data it used.
TEST_F(RlData, RunOnModelAndDatasetResumesBitwise) {
  const rl::RunConfig cfg = config();
  rl::RunOutcome straight = rl::run_rl(cfg, options("nvfp4", file("straight")));
  EXPECT_EQ(straight.steps_done, 3);
  int train_rows = 0, eval_rows = 0;
  for (const auto& r : straight.rows) {
    for (const auto& [k, v] : r.items())
      if (v.is_number()) {
        EXPECT_TRUE(std::isfinite(v.get<double>())) << k << " in " << r.dump();
      }
    if (r["kind"] == "train") {
      ++train_rows;
      const double R = r["reward_mean"].get<double>() * 8;  // 2 prompts x 4 samples, rewards 0/1
      EXPECT_EQ(R, std::round(R)) << r.dump();
      EXPECT_GE(R, 0.0);
      EXPECT_LE(R, 8.0);
      EXPECT_GT(r["response_len"].get<double>(), 0.0);
      EXPECT_GT(r["gap_mean_abs"].get<double>(), 0.0);  // nvfp4 rollout vs bf16 trainer
    } else {
      ++eval_rows;
      const double P = r["pass1"].get<double>() * 3;
      EXPECT_EQ(P, std::round(P)) << r.dump();
    }
  }
  EXPECT_EQ(train_rows, 3);
  EXPECT_EQ(eval_rows, 3);  // steps 0, 2 and the final one
  const auto info = nlohmann::json::parse(read_text(file("straight") + "/data.json"));
  EXPECT_EQ(info["model"], model_dir());
  EXPECT_EQ(info["train"]["path"], file("train.jsonl"));
  EXPECT_EQ(info["eval"]["path"], file("eval.jsonl"));
  EXPECT_EQ(info["prompt_format"], "chat");

  rl::RunOptions o = options("nvfp4", file("resumed"));
  o.stop_after = 1;
  EXPECT_EQ(rl::run_rl(cfg, o).steps_done, 1);
  o.stop_after = -1;
  o.resume = true;
  rl::RunOutcome resumed = rl::run_rl(cfg, o);
  EXPECT_EQ(deterministic(resumed.rows), deterministic(straight.rows));
  const auto a = io::SafeTensorsFile::open(file("straight") + "/checkpoint/model.safetensors");
  const auto b = io::SafeTensorsFile::open(file("resumed") + "/checkpoint/model.safetensors");
  EXPECT_EQ(a->at("model.layers.0.self_attn.q_proj.weight").to_f32(), b->at("model.layers.0.self_attn.q_proj.weight").to_f32());
  EXPECT_EQ(a->at("lm_head.weight").to_f32(), b->at("lm_head.weight").to_f32());
  // The checkpoint reloads as a float model (no quantization_config).
  EXPECT_FALSE(model::Weights::load(file("straight") + "/checkpoint").cfg.quantization.quantized());
}

// The ModelOpt NVFP4 export of the model is a base too (Weights::load dequantizes it).
TEST_F(RlData, RunOnNvfp4Export) {
  model::Weights w = model::Weights::load(model_dir());
  io::ExportOptions eo;
  eo.format = io::ExportFormat::NVFP4;
  const std::string dir = file("model_nvfp4");
  io::export_checkpoint(w, dir, eo, model_dir());
  ASSERT_TRUE(fs::exists(dir + "/tokenizer.json"));
  rl::RunConfig cfg = config();
  cfg.data.model = dir;
  cfg.rl.steps = 1;
  rl::RunOutcome out = rl::run_rl(cfg, options("quads", file("from_nvfp4")));
  EXPECT_EQ(out.steps_done, 1);
  const auto info = nlohmann::json::parse(read_text(file("from_nvfp4") + "/data.json"));
  EXPECT_EQ(info["model"], dir);
}

// compare with two modes on the dataset, the analysis of the base model linked from the report.
TEST_F(RlData, CompareWithAnalysisLinksTheReport) {
  rl::RunConfig cfg = config();
  cfg.modes = {"bf16", "nvfp4"};
  cfg.rl.steps = 2;
  cfg.rl.checkpoint_every = 0;
  cfg.data.eval.clear();  // held out of train
  cfg.data.eval_split = 0.3;
  cfg.analysis.enabled = true;
  cfg.analysis.batches = 2;
  cfg.analysis.batch_size = 2;
  rl::CompareOptions co;
  co.out_dir = file("cmp");
  co.progress = false;
  co.jobs = 2;
  rl::CompareOutcome out = rl::run_compare(cfg, co);
  for (const char* m : {"bf16", "nvfp4"}) {
    ASSERT_TRUE(out.summary["modes"].contains(m)) << m;
    const double base = out.summary["modes"][m]["base_pass1"].get<double>();
    EXPECT_TRUE(base >= 0 && base <= 1) << m;
    EXPECT_TRUE(fs::exists(file("cmp") + "/runs/" + m + "-s1/metrics.jsonl")) << m;
    EXPECT_TRUE(fs::exists(file("cmp") + "/runs/" + m + "-s1/data.json")) << m;
  }
  EXPECT_EQ(out.summary["modes"]["bf16"]["mean_abs_logp_gap"].get<double>(), 0.0);
  EXPECT_EQ(out.summary["base"]["dir"], model_dir());
  EXPECT_EQ(out.summary["base"]["sft"], false);
  EXPECT_FALSE(fs::exists(file("cmp") + "/base"));  // no SFT
  const std::string md = read_text(file("cmp") + "/report.md");
  EXPECT_TRUE(has(md, "## Model and data")) << md;
  EXPECT_TRUE(has(md, model_dir()));
  EXPECT_TRUE(has(md, "## Error analysis of the base model")) << md;
  EXPECT_TRUE(has(md, "(analysis/summary.txt)"));
  // The summary text itself is embedded.
  const std::string summary = read_text(file("cmp") + "/analysis/summary.txt");
  ASSERT_FALSE(summary.empty());
  EXPECT_TRUE(has(md, summary));
  const auto layers = nlohmann::json::parse(read_text(file("cmp") + "/analysis/layers.json"));
  EXPECT_EQ(layers["model"], model_dir());
  EXPECT_EQ(layers["data"], file("train.jsonl"));
  for (const char* png : {"layer_error.png", "w_vs_a.png", "logp_gap_entropy.png"})
    if (fs::exists(file("cmp") + "/analysis/" + png)) {
      EXPECT_TRUE(has(md, std::string("analysis/") + png)) << png;
    }
  const auto cfg_json = nlohmann::json::parse(read_text(file("cmp") + "/config.json"));
  EXPECT_EQ(cfg_json["data"]["model"], model_dir());
}

// An analysis folder made separately (quads analyze layers --out DIR/analysis) is linked too.
TEST(RlCompareReport, LinksAnAnalysisFolderMadeSeparately) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("quads_rl_an_{}", ::getpid());
  fs::remove_all(dir);
  EXPECT_EQ(rl::analysis_section(dir.string()), "");
  fs::create_directories(dir / "analysis");
  write_text(dir / "analysis" / "summary.txt", "layer 0: w4a4 rel err 0.01\n");
  write_text(dir / "analysis" / "w_vs_a.png", "png");
  const std::string md = rl::analysis_section(dir.string());
  EXPECT_TRUE(has(md, "layer 0: w4a4 rel err 0.01")) << md;
  EXPECT_TRUE(has(md, "(analysis/w_vs_a.png)")) << md;
  EXPECT_FALSE(has(md, "layer_error.png")) << md;  // only the plots that exist
  fs::remove_all(dir);
}

// The CLI shortcuts set the [data] keys: quads rl --model --data --eval-data.
TEST_F(RlData, CliShortcutsRunAnRl) {
  const std::string out = file("cli_rl");
  const std::string cmd = fmt::format(
      "{}/quads rl --out {} --mode bf16 --model {} --data {} --eval-data {} --set data.skip_bad_lines=true "
      "--set rl.steps=1 --set rl.group_size=2 --set rl.prompts_per_step=2 --set rl.max_new_tokens=4 "
      "--set rl.eval_size=2 2>&1",
      QUADS_BINARY_DIR, out, model_dir(), file("train.jsonl"), file("eval.jsonl"));
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_TRUE(p);
  std::string text;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  EXPECT_EQ(pclose(p), 0) << text;
  EXPECT_TRUE(fs::exists(out + "/metrics.jsonl")) << text;
  EXPECT_FALSE(fs::exists(out + "/base")) << text;
  const auto c = nlohmann::json::parse(read_text(out + "/config.json"));
  EXPECT_EQ(c["data"]["model"], model_dir());
  EXPECT_EQ(c["data"]["train"], file("train.jsonl"));
  EXPECT_EQ(c["data"]["eval"], file("eval.jsonl"));
  // Without skip_bad_lines the CLI reports the bad line.
  const std::string bad = fmt::format("{}/quads rl --out {} --mode bf16 --model {} --data {} 2>&1", QUADS_BINARY_DIR,
                                      file("cli_bad"), model_dir(), file("train.jsonl"));
  p = popen(bad.c_str(), "r");
  ASSERT_TRUE(p);
  text.clear();
  while (size_t n = fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  EXPECT_NE(pclose(p), 0);
  EXPECT_TRUE(has(text, file("train.jsonl") + ":4")) << text;
}

}  // namespace
}  // namespace quads
