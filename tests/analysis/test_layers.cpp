// quads analyze layers: the per-layer error decomposition and the log-prob gaps.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "analysis/layers.h"
#include "model/model_test_util.h"

using namespace quads;
namespace fs = std::filesystem;

namespace {

model::Batch batch(int nseq, int len, uint64_t seed) {
  model::Batch b;
  for (int s = 0; s < nseq; ++s) b.add(test::random_tokens(len + s, test::tiny_config().vocab_size, seed + s));
  return b;
}

const nlohmann::ordered_json& report() {
  static const nlohmann::ordered_json r = [] {
    model::Weights w = model::Weights::random(test::tiny_config(), 11, 0.1f, 0.1f);
    return analysis::analyze_layers(w, {batch(4, 12, 1), batch(4, 12, 50), batch(4, 12, 1)});
  }();
  return r;
}

}  // namespace

TEST(AnalysisLayers, ReportFieldsPresent) {
  const auto& r = report();
  for (const char* k : {"variants", "reference", "batches", "tokens", "topk", "rac", "layers", "total_rel_err",
                        "logprob_gaps"})
    EXPECT_TRUE(r.contains(k)) << k;
  ASSERT_EQ(r["layers"].size(), 2u);
  for (const auto& l : r["layers"]) {
    for (const auto& v : analysis::layer_variants()) EXPECT_TRUE(l["rel_err"].contains(v)) << v;
    for (const char* k : {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}) {
      ASSERT_TRUE(l["kinds"].contains(k)) << k;
      EXPECT_EQ(l["kinds"][k]["top_channels"].size(), 16u);
    }
    EXPECT_GE(l["weight_share"].get<double>(), 0.0);
    EXPECT_LE(l["weight_share"].get<double>(), 1.0);
  }
  for (const auto& v : analysis::layer_variants()) EXPECT_EQ(r["logprob_gaps"][v]["by_entropy"].size(), 5u);
}

TEST(AnalysisLayers, ErrorOrdering) {
  const auto& t = report()["total_rel_err"];
  // Every quantized variant has an error; W4A4 quantizes both operands of w_only and of a_only.
  for (const auto& v : analysis::layer_variants()) EXPECT_GT(t[v].get<double>(), 0.0) << v;
  for (const auto& l : report()["layers"]) {
    const auto& e = l["rel_err"];
    EXPECT_GE(e["w4a4"].get<double>(), e["w_only"].get<double>());
    EXPECT_GE(e["w4a4"].get<double>(), e["a_only"].get<double>());
    // RAC compensates half of the channels' activation residual: strictly less error.
    EXPECT_LT(e["w4a4_rac"].get<double>(), e["w4a4"].get<double>());
    // FP8 (E4M3, 128-blocks) is far finer than NVFP4.
    EXPECT_LT(e["fp8"].get<double>(), e["w4a4"].get<double>());
  }
  const auto& g = report()["logprob_gaps"];
  EXPECT_GT(g["w4a4"]["mean_abs_gap"].get<double>(), g["fp8"]["mean_abs_gap"].get<double>());
  EXPECT_GE(g["w4a4"]["max_abs_gap"].get<double>(), g["w4a4"]["mean_abs_gap"].get<double>());
}

TEST(AnalysisLayers, SameDataGivesFullyPersistentChannels) {
  // Batches 0 and 2 are the same tokens: their top-k sets agree (Jaccard 1); batch 1 differs, so
  // the mean over batches 1 and 2 lies in [0.5, 1].
  for (const auto& l : report()["layers"])
    for (const auto& [k, kj] : l["kinds"].items()) {
      const double j = kj["jaccard_vs_batch0"].get<double>();
      EXPECT_GE(j, 0.5) << k;
      EXPECT_LE(j, 1.0) << k;
      EXPECT_GT(kj["top_energy_share"].get<double>(), 0.0);
    }
}

TEST(AnalysisLogprobGaps, ZeroAgainstItselfAndUnderShifts) {
  const model::Batch b = batch(3, 7, 77);
  const int V = test::tiny_config().vocab_size;
  std::vector<float> ref = test::random_normal(size_t(b.ntokens()) * V, 5, 2.f);
  auto self = analysis::logprob_gaps(b, ref, ref, V);
  EXPECT_EQ(self["mean_abs_gap"].get<double>(), 0.0);
  EXPECT_EQ(self["max_abs_gap"].get<double>(), 0.0);
  EXPECT_EQ(self["tokens"].get<int64_t>(), b.ntokens() - b.nseq());
  // log-softmax ignores a constant added to a row (a power of two keeps every sum exact enough).
  std::vector<float> shifted = ref;
  for (size_t t = 0; t < size_t(b.ntokens()); ++t)
    for (int v = 0; v < V; ++v) shifted[t * V + v] += 0.25f * float(t % 3);
  EXPECT_LT(analysis::logprob_gaps(b, ref, shifted, V)["max_abs_gap"].get<double>(), 1e-5);
  // Raising the target logit of one token by d changes its log-prob by d * (1 - p) > 0.
  std::vector<float> bumped = ref;
  const int32_t next = b.tokens[1];
  bumped[0 * V + next] += 1.0f;
  auto g = analysis::logprob_gaps(b, ref, bumped, V);
  EXPECT_GT(g["max_abs_gap"].get<double>(), 0.0);
  EXPECT_LT(g["max_abs_gap"].get<double>(), 1.0);
  int64_t n = 0;
  for (const auto& bin : g["by_entropy"]) n += bin["tokens"].get<int64_t>();
  EXPECT_EQ(n, g["tokens"].get<int64_t>());
}

TEST(AnalysisLayers, WritesReport) {
  const fs::path dir = fs::temp_directory_path() / ("quads_analysis_" + std::to_string(::getpid()));
  auto files = analysis::write_layers_report(report(), dir.string());
  EXPECT_TRUE(fs::exists(dir / "layers.json"));
  EXPECT_TRUE(fs::exists(dir / "summary.txt"));
  for (const auto& f : files) EXPECT_TRUE(fs::exists(dir / f)) << f;
  fs::remove_all(dir);
}
