// reqat configuration: configs/reqat.toml is exactly the built-in default, TOML round trip,
// overrides, and errors that name the key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "reqat/config.h"

using namespace quads;
using namespace quads::reqat;

namespace {
std::string repo_file(const std::string& rel) {
  return (std::filesystem::path(__FILE__).parent_path() / "../.." / rel).lexically_normal().string();
}
}  // namespace

TEST(ReqatConfig, FileMatchesBuiltInDefault) {
  const std::string path = repo_file("configs/reqat.toml");
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  // Parsed on top of a config where every value differs from the default: every key must be in the file.
  ReqatConfig odd;
  odd.variants = {"taq"};
  odd.kv_format = "e2m1";
  odd.seed = 99;
  odd.model.hidden = 1;
  const ReqatConfig parsed = parse_reqat_config(ss.str(), path);
  EXPECT_TRUE(parsed == ReqatConfig{}) << to_toml(parsed);
  const ReqatConfig over_odd = parse_reqat_config(ss.str(), path, odd);
  EXPECT_TRUE(over_odd == ReqatConfig{});
  EXPECT_NO_THROW(validate(parsed, path));
}

TEST(ReqatConfig, TomlRoundTripAndOverrides) {
  ReqatConfig c;
  apply_reqat_override(c, "stage2.lr=1e-4");
  apply_reqat_override(c, "variants=taq,reqat");
  apply_reqat_override(c, "traces.source=solutions");
  apply_reqat_override(c, "tasks.add_digits=2,3");
  EXPECT_DOUBLE_EQ(c.stage2.lr, 1e-4);
  EXPECT_EQ(c.variants, (std::vector<std::string>{"taq", "reqat"}));
  EXPECT_EQ(c.traces.source, "solutions");
  EXPECT_EQ(c.tasks.add_digits, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(parse_reqat_config(to_toml(c), "rt") == c);
}

TEST(ReqatConfig, ErrorsNameTheKey) {
  try {
    parse_reqat_config("[stage1]\nstepz = 3\n", "x.toml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stage1.stepz"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("x.toml:2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_reqat_config("seed = \"a\"\n", "x.toml"), Error);
  ReqatConfig tmp;
  EXPECT_THROW(apply_reqat_override(tmp, "nope=1"), Error);
  ReqatConfig c;
  c.variants = {"taq", "bogus"};
  EXPECT_THROW(validate(c, "x"), Error);
  c = {};
  c.model.head_dim = 24;
  EXPECT_THROW(validate(c, "x"), Error);
  c = {};
  c.train_device = "gpu";
  try {
    validate(c, "x");
    ADD_FAILURE() << "train_device gpu was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train_device"), std::string::npos) << e.what();
  }
}
