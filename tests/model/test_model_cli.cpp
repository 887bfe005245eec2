// `quads logits` and `quads grad` end to end on the fixture checkpoint (the built binary).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/fixtures.h"
#include "model/weights.h"
#include "model_test_util.h"

using namespace quads;

namespace {

const std::string kModel = fixtures_dir() + "/tiny_qwen3moe_a";

// Runs `quads <args>`; returns stdout and sets *rc.
std::string run(const std::string& args, int* rc) {
  const std::string cmd = std::string(QUADS_BINARY_DIR) + "/quads " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  if (!p) return {};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *rc = pclose(p);
  return out;
}

std::vector<float> read_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::vector<float> v(static_cast<size_t>(f.tellg()) / 4);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  return v;
}

std::string tmp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("quads_cli_" + std::to_string(::getpid()) + "_" + name)).string();
}

// `quads grad`'s printed loss and written gradients (then removed) against the fixture's.
void expect_fixture_grads(const std::string& log, const std::string& out) {
  std::ifstream lf(kModel + "/loss.json");
  const double want = nlohmann::json::parse(lf)["loss"].get<double>();
  const size_t at = log.find("loss ");
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_NEAR(std::stod(log.substr(at + 5)), want, 1e-5);
  const model::Weights w = model::Weights::load(kModel);
  std::vector<float> got(w.size()), ref(w.size());
  model::read_hf_tensors({out}, w.cfg, w.layout, got.data(), /*require_all=*/true);  // per-expert names, F32
  model::read_hf_tensors({kModel + "/grads.safetensors"}, w.cfg, w.layout, ref.data(), true);
  EXPECT_LT(test::rel_l2(got.data(), ref.data(), ref.size()), 1e-4);
  std::filesystem::remove(out);
}

}  // namespace

TEST(ModelCli, LogitsMatchTheReference) {
  const std::string out = tmp("logits.f32");
  int rc = -1;
  const std::string log = run("logits --model " + kModel + " --input-ids " + kModel + "/input_ids.json --out " + out, &rc);
  ASSERT_EQ(rc, 0) << log << " (is the quads binary built? it lives in " << QUADS_BINARY_DIR << ")";
  const auto got = read_f32(out), ref = read_f32(kModel + "/logits.f32");
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_LT(test::rel_l2(got.data(), ref.data(), ref.size()), 1e-5);
  // A quantized mode runs too, and differs from fp32 by a quantization-sized amount.
  const std::string out4 = tmp("logits4.f32");
  run("logits --model " + kModel + " --input-ids " + kModel + "/input_ids.json --precision nvfp4 --out " + out4, &rc);
  ASSERT_EQ(rc, 0);
  const auto q = read_f32(out4);
  const double e = test::rel_l2(q.data(), ref.data(), ref.size());
  EXPECT_GT(e, 1e-3);
  EXPECT_LT(e, 0.5);
  // Errors name what is wrong.
  const std::string bad = run("logits --model " + kModel + " --input-ids " + kModel + "/input_ids.json --precision nvfp5 --out " + out, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(bad.find("nvfp5"), std::string::npos) << bad;
  std::filesystem::remove(out);
  std::filesystem::remove(out4);
}

TEST(ModelCli, GradPrintsTheLossAndWritesEveryGradient) {
  const std::string out = tmp("grads.safetensors");
  int rc = -1;
  const std::string log = run("grad --model " + kModel + " --input-ids " + kModel + "/input_ids.json --out " + out, &rc);
  ASSERT_EQ(rc, 0) << log;
  expect_fixture_grads(log, out);
}

// --device cuda: on a machine with a GPU, the GPU trainer's loss and gradients (the fixture's, as
// on the CPU); without one (CI), a clear error naming the device and nothing written.
TEST(ModelCli, GradOnCudaComputesOrSaysWhyNot) {
  const std::string out = tmp("grads_cuda.safetensors");
  std::filesystem::remove(out);
  int rc = -1;
  const std::string log =
      run("grad --device cuda --model " + kModel + " --input-ids " + kModel + "/input_ids.json --out " + out, &rc);
  if (rc != 0) {
    EXPECT_NE(log.find("--device cuda"), std::string::npos) << log;
    EXPECT_FALSE(std::filesystem::exists(out));
    return;
  }
  expect_fixture_grads(log, out);
}

// A bad --device is refused by the option parser, naming the option.
TEST(ModelCli, GradRefusesAnUnknownDevice) {
  int rc = -1;
  const std::string log = run("grad --device tpu --model " + kModel + " --input-ids " + kModel + "/input_ids.json --out " +
                                  tmp("never.safetensors"),
                              &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(log.find("--device"), std::string::npos) << log;
}
