#include <gtest/gtest.h>

#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <toml++/toml.h>
#include <unistd.h>

#include "common/error.h"
#include "rl/config.h"
#include "rl/run.h"

using namespace quads::rl;

namespace {

std::string repo_file(const std::string& rel) {
  return (std::filesystem::path(__FILE__).parent_path() / "../.." / rel).lexically_normal().string();
}

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The quads::Error message of f(), or "" when it does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const quads::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// configs/default.toml spells out exactly the built-in default, every key included.
TEST(RlConfig, DefaultFileMatchesBuiltInDefault) {
  std::string path = repo_file("configs/default.toml");
  std::string text = read(path);
  ASSERT_FALSE(text.empty()) << path;
  EXPECT_EQ(parse_config(text, path), RunConfig{});
  toml::table tbl = toml::parse(text, path);
  for (const auto& key : config_keys()) EXPECT_TRUE(tbl.at_path(key).node() != nullptr) << key << " missing in " << path;
  EXPECT_EQ(load_config(path), load_config(""));
}

// A file only overrides what it mentions; the other examples load and validate.
TEST(RlConfig, ExampleConfigsLoad) {
  for (const char* name : {"configs/smoke.toml", "configs/compare_3seeds.toml", "configs/dr_grpo.toml",
                           "configs/harder.toml", "configs/long.toml", "configs/gpu.toml"})
    EXPECT_NO_THROW(load_config(repo_file(name))) << name;
  // The own-model example gets --model and --data from the command line (load_config's adjust).
  RunConfig own = load_config(repo_file("configs/own_model.toml"), {}, [](RunConfig& c) {
    c.data.model = "m";
    c.data.train = "t.jsonl";
  });
  EXPECT_TRUE(own.uses_dataset());
  EXPECT_TRUE(own.analysis.enabled);
  EXPECT_EQ(own.data.system_prompt, "Please reason step by step, and put your final answer within \\boxed{}.");
  EXPECT_EQ(load_config(repo_file("configs/compare_3seeds.toml")).rl.seeds, 3);
  RunConfig c = parse_config("[rl]\nsteps = 7\n", "x.toml");
  RunConfig d;
  d.rl.steps = 7;
  EXPECT_EQ(c, d);
}

TEST(RlConfig, TomlRoundTrip) {
  RunConfig c;
  c.modes = {"quads", "bf16"};
  c.rl.lr = 1.0 / 3.0;  // needs all 17 digits
  c.rl.tis = false;
  c.model.rope_theta = 1e6;
  c.quads.granularity = "channel";
  c.tasks.add_digits = {1, 8};
  c.tasks.families = {"sort"};
  EXPECT_EQ(parse_config(to_toml(c), "roundtrip.toml"), c);
  EXPECT_EQ(parse_config(to_toml(RunConfig{}), "roundtrip.toml"), RunConfig{});
  nlohmann::json j = to_json(c);
  EXPECT_EQ(j["rl"]["lr"].get<double>(), c.rl.lr);
  EXPECT_EQ(j["modes"], nlohmann::json({"quads", "bf16"}));
  EXPECT_EQ(j["tasks"]["add_digits"], nlohmann::json({1, 8}));
}

TEST(RlConfig, OverridesAreTypeChecked) {
  RunConfig c;
  apply_override(c, "rl.lr=1e-3");
  EXPECT_EQ(c.rl.lr, 1e-3);
  apply_override(c, "rl.lr = 2");  // an integer for a float key
  EXPECT_EQ(c.rl.lr, 2.0);
  apply_override(c, "rl.steps=5");
  EXPECT_EQ(c.rl.steps, 5);
  apply_override(c, "rl.tis=false");
  EXPECT_FALSE(c.rl.tis);
  apply_override(c, "quads.granularity=channel");
  EXPECT_EQ(c.quads.granularity, "channel");
  apply_override(c, "quads.residual_format=\"fp8\"");
  EXPECT_EQ(c.quads.residual_format, "fp8");
  apply_override(c, "modes=bf16,quads");
  EXPECT_EQ(c.modes, (std::vector<std::string>{"bf16", "quads"}));
  apply_override(c, "modes=[\"nvfp4\"]");
  EXPECT_EQ(c.modes, (std::vector<std::string>{"nvfp4"}));
  apply_override(c, "tasks.add_digits=2,5");
  EXPECT_EQ(c.tasks.add_digits, (std::vector<int64_t>{2, 5}));
  apply_override(c, "tasks.add_digits=[3]");
  EXPECT_EQ(c.tasks.add_digits, (std::vector<int64_t>{3}));
  apply_override(c, "tasks.add_digits=6");
  EXPECT_EQ(c.tasks.add_digits, (std::vector<int64_t>{6}));

  std::string m = error_of([&] { apply_override(c, "rl.steps=1.5"); });
  EXPECT_TRUE(contains(m, "rl.steps") && contains(m, "integer")) << m;
  m = error_of([&] { apply_override(c, "rl.lr=fast"); });
  EXPECT_TRUE(contains(m, "rl.lr")) << m;
  m = error_of([&] { apply_override(c, "rl.tis=1"); });
  EXPECT_TRUE(contains(m, "rl.tis") && contains(m, "boolean")) << m;
  m = error_of([&] { apply_override(c, "rl.lrr=1"); });
  EXPECT_TRUE(contains(m, "unknown key 'rl.lrr'")) << m;
  m = error_of([&] { apply_override(c, "tasks.add_digits=2,x"); });
  EXPECT_TRUE(contains(m, "tasks.add_digits")) << m;
  m = error_of([&] { apply_override(c, "rl.steps"); });
  EXPECT_TRUE(contains(m, "key=value")) << m;
}

TEST(RlConfig, FileErrorsNameKeyFileAndLine) {
  std::string m = error_of([] { parse_config("[rl]\nsteps = 3\nlrr = 1\n", "my.toml"); });
  EXPECT_TRUE(contains(m, "rl.lrr") && contains(m, "my.toml:3")) << m;
  m = error_of([] { parse_config("[rll]\nsteps = 3\n", "my.toml"); });
  EXPECT_TRUE(contains(m, "rll") && contains(m, "my.toml")) << m;
  m = error_of([] { parse_config("[rl]\nsteps = \"many\"\n", "my.toml"); });
  EXPECT_TRUE(contains(m, "rl.steps") && contains(m, "expects an integer") && contains(m, "my.toml:2")) << m;
  m = error_of([] { parse_config("modes = [\"bf16\", 3]\n", "my.toml"); });
  EXPECT_TRUE(contains(m, "modes") && contains(m, "array of strings")) << m;
  m = error_of([] { parse_config("[rl]\nsteps = = 3\n", "my.toml"); });
  EXPECT_TRUE(contains(m, "my.toml:2") && contains(m, "syntax")) << m;
  m = error_of([] { parse_config("rl.steps = 3\nrl.step = 4\n", "dotted.toml"); });
  EXPECT_TRUE(contains(m, "rl.step'") && contains(m, "dotted.toml")) << m;
  EXPECT_EQ(parse_config("rl.steps = 3\n", "dotted.toml").rl.steps, 3);
  m = error_of([] { load_config("/nonexistent/quads.toml"); });
  EXPECT_TRUE(contains(m, "/nonexistent/quads.toml")) << m;
}

TEST(RlConfig, ValidationNamesTheKey) {
  auto invalid = [](const std::string& assignment) {
    return error_of([&] { load_config("", {assignment}); });
  };
  EXPECT_TRUE(contains(invalid("rl.group_size=1"), "rl.group_size"));
  EXPECT_TRUE(contains(invalid("modes=bf16,int3"), "\"int3\""));
  EXPECT_TRUE(contains(invalid("modes=bf16,bf16"), "listed twice"));
  EXPECT_TRUE(contains(invalid("quads.granularity=tensor"), "quads.granularity"));
  EXPECT_TRUE(contains(invalid("quads.rac_ratio=1.5"), "quads.rac_ratio"));
  EXPECT_TRUE(contains(invalid("rl.aggregation=mean"), "rl.aggregation"));
  EXPECT_TRUE(contains(invalid("tasks.mul_digits=4"), "tasks.mul_digits"));
  EXPECT_TRUE(contains(invalid("tasks.families=add,division"), "division"));
  EXPECT_TRUE(contains(invalid("model.kv_heads=3"), "model.kv_heads"));
  EXPECT_TRUE(contains(invalid("rl.minibatches=3"), "rl.minibatches"));
  EXPECT_TRUE(contains(invalid("rl.clip_eps_low=1"), "rl.clip_eps_low"));
  EXPECT_TRUE(contains(invalid("rl.lr=0"), "with --set overrides"));
  EXPECT_TRUE(contains(invalid("rl.device=gpu"), "rl.device"));
  // A family that is not drawn may have an empty level list.
  EXPECT_NO_THROW(load_config("", {"tasks.families=add", "tasks.sort_length=[]"}));
  EXPECT_TRUE(contains(invalid("tasks.sort_length=[]"), "tasks.sort_length"));
}

// quads_tests links no CUDA backend (quads_core alone): rl.device = "cuda" is valid config but
// run_rl refuses it up front, naming the key, before it reads the base or writes anything.
TEST(RlConfig, CudaDeviceWithoutBackendNamesTheKey) {
  RunConfig cfg = load_config("", {"rl.device=cuda"});
  EXPECT_EQ(cfg.rl.device, "cuda");
  RunOptions o;
  o.base_dir = (std::filesystem::temp_directory_path() / fmt::format("quads_no_base_{}", ::getpid())).string();
  o.out_dir = o.base_dir + "_out";
  o.progress = false;
  const std::string e = error_of([&] { run_rl(cfg, o); });
  EXPECT_TRUE(contains(e, "rl.device") && contains(e, "QUADS_CUDA")) << e;
  EXPECT_FALSE(std::filesystem::exists(o.out_dir));
}

TEST(RlConfig, ConversionsForOtherModules) {
  RunConfig c = load_config("", {"tasks.families=sort,add", "tasks.sort_length=2,7", "rl.aggregation=seq_mean",
                                 "rl.clip_eps_high=0.3", "rl.scale_adv_by_std=false"});
  TaskMix mix = c.task_mix();
  ASSERT_EQ(mix.families.size(), 2u);
  EXPECT_EQ(mix.families[0], Family::Sort);
  EXPECT_EQ(mix.levels_of(Family::Sort), (std::vector<int>{2, 7}));
  PgConfig pg = c.pg_config();
  EXPECT_EQ(pg.aggregation, Aggregation::SeqMean);
  EXPECT_EQ(pg.clip_high, 0.3);
  EXPECT_EQ(pg.norm_len, static_cast<double>(c.rl.max_new_tokens));
  EXPECT_FALSE(c.advantage_config().scale_by_std);
}

TEST(RlConfig, SaveResolvedWritesTomlAndJson) {
  auto dir = std::filesystem::temp_directory_path() / ("quads_rl_cfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  RunConfig c = load_config("", {"rl.lr=5e-4", "modes=bf16"});
  save_resolved_config(c, dir.string());
  EXPECT_EQ(load_config((dir / "config.toml").string()), c);
  nlohmann::json j = nlohmann::json::parse(read((dir / "config.json").string()));
  EXPECT_EQ(j["rl"]["lr"].get<double>(), 5e-4);
  EXPECT_EQ(j["modes"], nlohmann::json({"bf16"}));
  std::filesystem::remove_all(dir);
}
