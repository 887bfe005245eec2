// Weights::load on ModelOpt NVFP4 checkpoints (quads export --format nvfp4, or ModelOpt's own
// config): the NVFP4 weights are dequantized exactly into the float32 masters, the excluded
// modules read as stored, unknown quantization methods/algorithms are errors naming the field,
// and the engine's nvfp4 mode on the loaded model reproduces the original model's nvfp4 logits.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/export.h"
#include "io/safetensors.h"
#include "model/model_test_util.h"
#include "numerics/quantize.h"

namespace fs = std::filesystem;
using namespace quads;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("quads_nvfp4_load_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<float> logits_of(model::Model& m, const model::Batch& b) {
  std::vector<float> out(size_t(b.ntokens()) * m.config().vocab_size);
  m.forward(b, out.data());
  return out;
}

model::Batch test_batch() {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < 3; ++i) p.push_back(test::random_tokens(9 + i, test::tiny_config().vocab_size, 300 + i));
  return model::Batch::of(p);
}

std::string load_error(const fs::path& dir) {
  try {
    model::Weights::load(dir.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& f) {
  nlohmann::json j;
  {
    std::ifstream in(dir / "config.json");
    j = nlohmann::json::parse(in);
  }
  f(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

}  // namespace

// The loaded masters are the dequantized NVFP4 weights (what load_nvfp4_checkpoint gives and
// num::fake_quantize of the original gives), excluded modules are the original F32 values.
TEST(ModelLoadNvfp4, DequantizesIntoTheMasters) {
  const model::Weights w = model::Weights::random(test::tiny_config(), 21, 0.1f, 0.1f);
  io::ExportOptions eo;
  eo.format = io::ExportFormat::NVFP4;
  eo.max_shard_bytes = 8 << 10;  // shards + index
  const fs::path dir = fresh_dir("masters");
  io::export_checkpoint(w, dir.string(), eo);
  const model::Weights back = model::Weights::load(dir.string());
  EXPECT_TRUE(back.cfg.quantization.quantized());
  EXPECT_EQ(back.cfg.quantization.algo, "NVFP4");
  EXPECT_FALSE(back.cfg.quantization.exclude_modules.empty());
  EXPECT_FALSE(back.cfg.to_json().contains("quantization_config"));
  const io::Nvfp4Checkpoint ck = io::load_nvfp4_checkpoint(dir.string());
  ASSERT_EQ(back.data.size(), ck.weights.data.size());
  EXPECT_EQ(std::memcmp(back.data.data(), ck.weights.data.data(), 4 * back.data.size()), 0);
  int quantized = 0;
  for (const auto& p : w.layout.params) {
    const std::string module = p.name.substr(0, p.name.size() - 7);
    std::vector<float> expect(w.data.begin() + p.offset, w.data.begin() + p.offset + p.numel);
    if (ck.linears.count(module)) {
      ++quantized;
      num::fake_quantize(expect.data(), expect.data(), p.shape[0], p.shape[1], num::QConfig::nvfp4_weight(false));
    }
    EXPECT_EQ(std::memcmp(back.data.data() + p.offset, expect.data(), 4 * p.numel), 0) << p.name;
  }
  EXPECT_EQ(quantized, 2 * 4 + 2 * 6 * 3);  // q k v o + 6 experts x gate up down, 2 layers
  fs::remove_all(dir);
}

// The engine's nvfp4 mode on the loaded model against the original model in nvfp4 mode. The
// loaded masters are NVFP4-exact, and re-quantizing them reproduces the same codes and block
// scales; the per-tensor global amax is recomputed from the dequantized weights, whose largest
// value is amax only up to the rounding of (448 * amax) / 2688 (docs/export.md): where that
// rounds, the dequantized weights move by an ulp and logits agree to ~1e-6, not bitwise.
TEST(ModelLoadNvfp4, EngineNvfp4ModeMatchesTheOriginal) {
  const model::Weights w = model::Weights::random(test::tiny_config(), 22, 0.1f, 0.1f);
  io::ExportOptions eo;
  eo.format = io::ExportFormat::NVFP4;
  const fs::path dir = fresh_dir("engine");
  io::export_checkpoint(w, dir.string(), eo);
  model::Weights back = model::Weights::load(dir.string());
  model::Weights orig = w;
  model::Model ref(orig, model::PrecisionConfig::preset("nvfp4"));
  model::Model got(back, model::PrecisionConfig::preset("nvfp4"));
  int same_amax = 0, n = 0;
  for (size_t i = 0; i < ref.linears().size(); ++i) {
    const model::LinearQ& a = ref.linears()[i];
    const model::LinearQ& b = got.linears()[i];
    ASSERT_EQ(a.name, b.name);
    if (a.num.weight.kind != model::QuantKind::Quant) continue;
    ++n;
    EXPECT_EQ(a.wq.codes, b.wq.codes) << a.name;
    EXPECT_EQ(a.wq.scales, b.wq.scales) << a.name;
    ASSERT_EQ(a.wq.amax.size(), 1u);
    // The recomputed amax is the largest dequantized value: within an ulp of the original.
    EXPECT_NEAR(b.wq.amax[0], a.wq.amax[0], 2 * std::nextafter(a.wq.amax[0], INFINITY) - 2 * a.wq.amax[0]) << a.name;
    same_amax += a.wq.amax[0] == b.wq.amax[0];
  }
  EXPECT_GT(n, 0);
  RecordProperty("amax_equal", same_amax);
  RecordProperty("quantized_linears", n);
  const model::Batch b = test_batch();
  const auto lr = logits_of(ref, b), lg = logits_of(got, b);
  ASSERT_EQ(lr.size(), lg.size());
  if (same_amax == n) {
    EXPECT_EQ(std::memcmp(lr.data(), lg.data(), 4 * lr.size()), 0);
  } else {
    EXPECT_LT(test::rel_l2(lg.data(), lr.data(), lr.size()), 1e-5) << same_amax << " of " << n << " amaxes equal";
  }
  // io::apply_nvfp4_checkpoint (the file's codes and amax, no re-quantization) is bitwise.
  const io::Nvfp4Checkpoint ck = io::load_nvfp4_checkpoint(dir.string());
  model::Weights ckw = ck.weights;
  model::Model exact(ckw, model::PrecisionConfig::preset("nvfp4"));
  io::apply_nvfp4_checkpoint(exact, ck, io::ActScale::PerToken);
  const auto le = logits_of(exact, b);
  EXPECT_EQ(std::memcmp(lr.data(), le.data(), 4 * lr.size()), 0);
  fs::remove_all(dir);
}

// hf_quant_config.json alone (older ModelOpt exports) marks the folder as well; unknown methods,
// algorithms, group sizes and KV-cache quantization are errors naming the field.
TEST(ModelLoadNvfp4, QuantizationConfigErrorsNameTheField) {
  const model::Weights w = model::Weights::random(test::tiny_config(), 23, 0.1f, 0.1f);
  io::ExportOptions eo;
  eo.format = io::ExportFormat::NVFP4;
  const fs::path dir = fresh_dir("errors");
  io::export_checkpoint(w, dir.string(), eo);
  const model::Weights a = model::Weights::load(dir.string());

  edit_config(dir, [](nlohmann::json& j) { j.erase("quantization_config"); });
  const model::Weights b = model::Weights::load(dir.string());  // from hf_quant_config.json
  EXPECT_TRUE(b.cfg.quantization.quantized());
  EXPECT_EQ(a.data, b.data);

  edit_config(dir, [](nlohmann::json& j) { j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}}; });
  std::string e = load_error(dir);
  EXPECT_NE(e.find("quantization_config.quant_method"), std::string::npos) << e;
  EXPECT_NE(e.find("gptq"), std::string::npos) << e;
  edit_config(dir, [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "FP8"}};
  });
  e = load_error(dir);
  EXPECT_NE(e.find("quantization_config.quant_algo"), std::string::npos) << e;
  edit_config(dir, [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "modelopt"},
                                {"quantization", {{"quant_algo", "NVFP4"}, {"group_size", 32}}}};
  });
  e = load_error(dir);
  EXPECT_NE(e.find("quantization_config.quantization.group_size"), std::string::npos) << e;
  edit_config(dir, [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", "INT8"}};
  });
  e = load_error(dir);
  EXPECT_NE(e.find("kv_cache_quant_algo"), std::string::npos) << e;
  // ModelOpt's flat spelling with `ignore` loads.
  edit_config(dir, [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"ignore", {"lm_head"}}};
  });
  const model::Weights c = model::Weights::load(dir.string());
  EXPECT_EQ(c.cfg.quantization.exclude_modules, std::vector<std::string>{"lm_head"});
  EXPECT_EQ(a.data, c.data);
  // An FP8 KV cache (ModelOpt's usual companion of NVFP4) is accepted: its scales are skipped,
  // and without it they are unknown tensors.
  {
    auto f = io::SafeTensorsFile::open((dir / "model.safetensors").string());
    std::vector<io::TensorData> keep;
    for (const auto& t : f->tensors()) keep.push_back(io::TensorData::raw(t.name, t.dtype, t.shape, t.data, t.nbytes));
    const float ks = 0.01f;
    keep.push_back(io::TensorData::from_f32("model.layers.0.self_attn.k_proj.k_scale", {}, &ks));
    keep.push_back(io::TensorData::from_f32("model.layers.0.self_attn.v_proj.v_scale", {}, &ks));
    auto meta = f->metadata();
    f.reset();
    io::write_safetensors((dir / "model.safetensors").string(), keep, meta);
  }
  edit_config(dir, [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", "FP8"}};
  });
  const model::Weights kv = model::Weights::load(dir.string());
  EXPECT_EQ(kv.cfg.quantization.kv_cache_algo, "FP8");
  EXPECT_EQ(a.data, kv.data);
  edit_config(dir, [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}};
  });
  e = load_error(dir);
  EXPECT_NE(e.find("k_scale"), std::string::npos) << e;
  fs::remove_all(dir);
}
