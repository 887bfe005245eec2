// `quads generate` end to end: runs the built binary on the fixture checkpoint.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fixtures.h"
#include "model/model.h"
#include "rollout/engine.h"

namespace {

const std::string kModel = quads::fixtures_dir() + "/tiny_qwen3moe_a";

// Runs `quads generate <args>` and returns its stdout lines; fails the test on a non-zero exit.
std::vector<std::string> run_generate(const std::string& args, int* status = nullptr) {
  const std::string cmd = std::string(QUADS_BINARY_DIR) + "/quads generate --model " + kModel + " " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  std::vector<std::string> lines;
  if (!p) return lines;
  std::string cur;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) cur.append(buf, n);
  const int rc = pclose(p);
  if (status)
    *status = rc;
  else
    EXPECT_EQ(rc, 0) << cmd << " (is the quads binary built? it lives in " << QUADS_BINARY_DIR << ")";
  size_t i = 0;
  while (i < cur.size()) {
    size_t j = cur.find('\n', i);
    if (j == std::string::npos) j = cur.size();
    lines.push_back(cur.substr(i, j - i));
    i = j + 1;
  }
  return lines;
}

std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

TEST(RolloutGenerateCli, GreedyFixtureOnTheLastLine) {
  std::ifstream f(kModel + "/greedy.json");
  ASSERT_TRUE(f);
  const nlohmann::json fx = nlohmann::json::parse(f);
  const auto prompt = fx["prompt"].get<std::vector<int32_t>>();
  const auto want = fx["greedy"].get<std::vector<int32_t>>();
  const int n_new = static_cast<int>(want.size() - prompt.size());
  const auto lines = run_generate("--prompt-ids " + join(prompt) + " --max-new-tokens " + std::to_string(n_new) +
                                  " --greedy");
  ASSERT_FALSE(lines.empty());
  const nlohmann::json j = nlohmann::json::parse(lines.back());
  EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), want);
  // The printed log-probs round-trip to the engine's floats exactly.
  quads::rollout::RolloutEngine eng(quads::model::Weights::load(kModel), quads::model::PrecisionConfig::preset("fp32"));
  quads::rollout::Request r;
  r.prompt = prompt;
  r.max_new_tokens = n_new;
  r.sampling.greedy = true;
  const auto res = eng.generate({r})[0];
  const auto lp = j["logprobs"].get<std::vector<double>>();
  ASSERT_EQ(lp.size(), size_t(n_new));
  for (int i = 0; i < n_new; ++i) EXPECT_EQ(static_cast<float>(lp[i]), res.logprobs[i]) << i;
}

TEST(RolloutGenerateCli, BatchPrintsOneLinePerSeedEndingWithTheFirst) {
  const std::string common = "--prompt-ids 5,17,300,42 --max-new-tokens 7 --temperature 0.9 --top-k 40 --precision nvfp4";
  const auto batch = run_generate(common + " --seed 11 --batch 3");
  ASSERT_EQ(batch.size(), 3u);
  for (int s = 0; s < 3; ++s) {
    // Line 2 - s is seed 11 + s, and equals that seed generated alone.
    const auto alone = run_generate(common + " --seed " + std::to_string(11 + s));
    ASSERT_EQ(alone.size(), 1u);
    EXPECT_EQ(batch[2 - s], alone[0]) << "seed " << 11 + s;
    const nlohmann::json j = nlohmann::json::parse(alone[0]);
    EXPECT_EQ(j["ids"].size(), 4u + 7u);
    EXPECT_EQ(j["logprobs"].size(), 7u);
  }
  EXPECT_NE(batch[0], batch[2]);
}

TEST(RolloutGenerateCli, StopIdsAndErrors) {
  const auto free_run = run_generate("--prompt-ids 9,8,7 --max-new-tokens 10 --seed 3");
  ASSERT_EQ(free_run.size(), 1u);
  const auto ids = nlohmann::json::parse(free_run[0])["ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(ids.size(), 13u);
  const auto stopped = run_generate("--prompt-ids 9,8,7 --max-new-tokens 10 --seed 3 --stop-ids " +
                                    std::to_string(ids[3]));
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(stopped[0])["ids"].get<std::vector<int32_t>>(),
            std::vector<int32_t>(ids.begin(), ids.begin() + 4));
  int rc = 0;
  run_generate("--prompt-ids 9,8,700 --max-new-tokens 3", &rc);  // outside the 512-token vocabulary
  EXPECT_NE(rc, 0);
  run_generate("--prompt-ids 9 --precision nvfp5", &rc);
  EXPECT_NE(rc, 0);
}
