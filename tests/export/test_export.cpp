// quads export: the ModelOpt NVFP4 layout, its round trip back into the model (bitwise the same
// logits as the engine's own nvfp4 modes), and the HF export.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/export.h"
#include "io/safetensors.h"
#include "model/model_test_util.h"

namespace fs = std::filesystem;
using namespace quads;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("quads_export_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

model::Weights test_weights() {
  return model::Weights::random(test::tiny_config(), 7, 0.1f, 0.1f);
}

std::vector<std::vector<int32_t>> prompts(int n, int len, uint64_t seed) {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < n; ++i) p.push_back(test::random_tokens(len + i, test::tiny_config().vocab_size, seed + i));
  return p;
}

std::map<std::string, float> calibrate(const model::Weights& w) {
  model::Weights copy = w;
  model::Model m(copy, model::PrecisionConfig::preset("bf16"));
  return io::calibrate_input_amax(m, prompts(6, 12, 100));
}

std::vector<float> logits_of(model::Model& m, const model::Batch& b) {
  std::vector<float> out(size_t(b.ntokens()) * m.config().vocab_size);
  m.forward(b, out.data());
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

}  // namespace

TEST(ExportCalibration, AmaxIsTheLargestInputAndSharedInputsAgree) {
  model::Weights w = test_weights();
  auto amax = calibrate(w);
  model::Weights copy = w;
  model::Model m(copy, model::PrecisionConfig::preset("bf16"));
  for (const auto& L : m.linears()) {
    ASSERT_TRUE(amax.count(L.name)) << L.name;
    EXPECT_GT(amax[L.name], 0.f) << L.name;
  }
  // q/k/v read the same normalized rows; gate of the router reads what experts' gate/up read.
  EXPECT_EQ(amax["model.layers.0.self_attn.q_proj"], amax["model.layers.0.self_attn.k_proj"]);
  EXPECT_EQ(amax["model.layers.0.self_attn.q_proj"], amax["model.layers.0.self_attn.v_proj"]);
  for (int e = 0; e < 6; ++e) {
    const std::string p = "model.layers.1.mlp.experts." + std::to_string(e);
    EXPECT_EQ(amax[p + ".gate_proj"], amax[p + ".up_proj"]);
    EXPECT_LE(amax[p + ".gate_proj"], amax["model.layers.1.mlp.gate"]);
  }
  // A calibration set that contains this one (the forward is batch-invariant) can only raise it.
  model::Model m2(copy, model::PrecisionConfig::preset("bf16"));
  auto more = io::calibrate_input_amax(m2, prompts(12, 12, 100));
  for (const auto& [k, v] : amax) EXPECT_GE(more[k], v) << k;
}

TEST(ExportNvfp4, ModelOptLayoutAndConfig) {
  model::Weights w = test_weights();
  io::ExportOptions opt;
  opt.format = io::ExportFormat::NVFP4;
  opt.input_amax = calibrate(w);
  const fs::path dir = fresh_dir("layout");
  const fs::path tok = fresh_dir("layout_tok");
  { std::ofstream(tok / "tokenizer.json") << R"({"type": "quads-char", "tokens": []})"; }
  io::ExportReport rep = io::export_checkpoint(w, dir.string(), opt, tok.string());
  EXPECT_EQ(rep.quantized, 2 * 4 + 2 * 6 * 3);
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json"));

  auto f = io::SafeTensorsFile::open((dir / "model.safetensors").string());
  const std::string q = "model.layers.0.self_attn.q_proj";
  EXPECT_EQ(f->at(q + ".weight").dtype, io::DType::U8);
  EXPECT_EQ(f->at(q + ".weight").shape, (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(f->at(q + ".weight_scale").dtype, io::DType::F8_E4M3);
  EXPECT_EQ(f->at(q + ".weight_scale").shape, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(f->at(q + ".weight_scale_2").dtype, io::DType::F32);
  EXPECT_TRUE(f->at(q + ".weight_scale_2").shape.empty());
  EXPECT_TRUE(f->at(q + ".input_scale").shape.empty());
  // input_scale = amax / (6 * 448) in float32 (ModelOpt's definition).
  float in_scale;
  std::memcpy(&in_scale, f->at(q + ".input_scale").data, 4);
  EXPECT_EQ(in_scale, opt.input_amax[q] / 2688.0f);
  // weight_scale_2 = the weight's amax / 2688.
  float s2;
  std::memcpy(&s2, f->at(q + ".weight_scale_2").data, 4);
  float wamax = 0;
  const auto& p = w.layout.at(q + ".weight");
  for (size_t i = 0; i < p.numel; ++i) wamax = std::max(wamax, std::fabs(w.data[p.offset + i]));
  EXPECT_EQ(s2, wamax / 2688.0f);
  // Routers and lm_head stay in high precision and are listed as excluded.
  EXPECT_EQ(f->at("model.layers.0.mlp.gate.weight").dtype, io::DType::F32);
  EXPECT_EQ(f->at("lm_head.weight").dtype, io::DType::F32);
  EXPECT_FALSE(f->find("lm_head.weight_scale"));

  auto hq = read_json(dir / "hf_quant_config.json");
  EXPECT_EQ(hq["producer"]["name"], "quads");
  EXPECT_EQ(hq["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(hq["quantization"]["group_size"], 16);
  EXPECT_TRUE(hq["quantization"]["kv_cache_quant_algo"].is_null());
  std::vector<std::string> ex = hq["quantization"]["exclude_modules"];
  EXPECT_EQ(ex, (std::vector<std::string>{"model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"}));
  auto cfg = read_json(dir / "config.json");
  EXPECT_EQ(cfg["quantization_config"]["quant_method"], "modelopt");
  EXPECT_EQ(cfg["quantization_config"]["quantization"], hq["quantization"]);
  EXPECT_TRUE(io::is_modelopt_checkpoint(dir.string()));
  // The plain loader reads the NVFP4 checkpoint back (dequantized masters, tests/model/test_nvfp4_load.cpp).
  EXPECT_TRUE(model::Weights::load(dir.string()).cfg.quantization.quantized());
  fs::remove_all(dir);
  fs::remove_all(tok);
}

// The round trip of the issue: export, load back, same logits as the engine's own nvfp4 modes.
TEST(ExportNvfp4, RoundTripBitwiseWithEngine) {
  model::Weights w = test_weights();
  const auto amax = calibrate(w);
  io::ExportOptions opt;
  opt.format = io::ExportFormat::NVFP4;
  opt.input_amax = amax;
  opt.max_shard_bytes = 8 << 10;  // several shards and an index
  const fs::path dir = fresh_dir("roundtrip");
  io::export_checkpoint(w, dir.string(), opt);
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));

  io::Nvfp4Checkpoint ck = io::load_nvfp4_checkpoint(dir.string());
  EXPECT_EQ(ck.linears.size(), 2u * 4 + 2 * 6 * 3);
  const model::Batch b = model::Batch::of(prompts(3, 9, 500));

  model::Weights w_ref = w;
  model::Model ref(w_ref, model::PrecisionConfig::preset("nvfp4"));
  model::Model back(ck.weights, model::PrecisionConfig::preset("nvfp4"));
  io::apply_nvfp4_checkpoint(back, ck, io::ActScale::PerToken);
  // Codes, block scales and global amax as the engine quantized them at sync.
  for (const auto& L : ref.linears()) {
    auto it = ck.linears.find(L.name);
    if (L.num.weight.kind != model::QuantKind::Quant) {
      EXPECT_EQ(it, ck.linears.end()) << L.name;
      continue;
    }
    ASSERT_NE(it, ck.linears.end()) << L.name;
    EXPECT_EQ(it->second.wq.codes, L.wq.codes) << L.name;
    EXPECT_EQ(it->second.wq.scales, L.wq.scales) << L.name;
    EXPECT_EQ(it->second.wq.amax, L.wq.amax) << L.name;
    EXPECT_EQ(it->second.input_amax, amax.at(L.name)) << L.name;
  }
  const auto ref_tok = logits_of(ref, b);
  EXPECT_TRUE(bitwise_equal(logits_of(back, b), ref_tok));

  io::use_static_input_scales(ref, amax);
  io::apply_nvfp4_checkpoint(back, ck, io::ActScale::Static);
  const auto ref_static = logits_of(ref, b);
  EXPECT_TRUE(bitwise_equal(logits_of(back, b), ref_static));
  // The two activation modes really differ, so the comparisons above test the scale that was used.
  EXPECT_FALSE(bitwise_equal(ref_static, ref_tok));
  fs::remove_all(dir);
}

TEST(ExportNvfp4, Bf16HighPrecisionTensorsRoundTripOnBf16Weights) {
  model::Weights w = test_weights();
  for (float& x : w.data) x = num::bf16_round(x);
  io::ExportOptions opt;
  opt.format = io::ExportFormat::NVFP4;
  opt.bf16 = true;  // no input scales: dynamic activations only
  const fs::path dir = fresh_dir("bf16");
  io::export_checkpoint(w, dir.string(), opt);
  auto f = io::SafeTensorsFile::open((dir / "model.safetensors").string());
  EXPECT_EQ(f->at("model.embed_tokens.weight").dtype, io::DType::BF16);
  EXPECT_FALSE(f->find("model.layers.0.self_attn.q_proj.input_scale"));
  io::Nvfp4Checkpoint ck = io::load_nvfp4_checkpoint(dir.string());
  const model::Batch b = model::Batch::of(prompts(2, 7, 900));
  model::Model ref(w, model::PrecisionConfig::preset("nvfp4"));
  model::Model back(ck.weights, model::PrecisionConfig::preset("nvfp4"));
  EXPECT_THROW(io::apply_nvfp4_checkpoint(back, ck, io::ActScale::Static), Error);
  io::apply_nvfp4_checkpoint(back, ck, io::ActScale::PerToken);
  EXPECT_TRUE(bitwise_equal(logits_of(back, b), logits_of(ref, b)));
  fs::remove_all(dir);
}

TEST(ExportNvfp4, LoaderNamesBadTensors) {
  model::Weights w = test_weights();
  io::ExportOptions opt;
  opt.format = io::ExportFormat::NVFP4;
  const fs::path dir = fresh_dir("bad");
  io::export_checkpoint(w, dir.string(), opt);
  // Drop one block-scale tensor: its weight is then U8 codes without scales, which is no
  // parameter the model can read.
  auto f = io::SafeTensorsFile::open((dir / "model.safetensors").string());
  std::vector<io::TensorData> keep;
  const std::string drop = "model.layers.1.self_attn.o_proj.weight_scale";
  for (const auto& t : f->tensors())
    if (t.name != drop) keep.push_back(io::TensorData::raw(t.name, t.dtype, t.shape, t.data, t.nbytes));
  auto meta = f->metadata();
  f.reset();
  io::write_safetensors((dir / "model.safetensors").string(), keep, meta);
  try {
    io::load_nvfp4_checkpoint(dir.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.self_attn.o_proj.weight"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(ExportHf, F32ExactAndShardedBf16) {
  model::Weights w = test_weights();
  const fs::path dir = fresh_dir("hf");
  io::ExportOptions opt;
  io::export_checkpoint(w, dir.string(), opt);
  model::Weights back = model::Weights::load(dir.string());
  EXPECT_EQ(back.data, w.data);
  EXPECT_FALSE(io::is_modelopt_checkpoint(dir.string()));

  opt.bf16 = true;
  opt.max_shard_bytes = 16 << 10;
  io::ExportReport rep = io::export_checkpoint(w, dir.string(), opt);
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_GT(rep.files.size(), 3u);
  back = model::Weights::load(dir.string());
  ASSERT_EQ(back.data.size(), w.data.size());
  for (size_t i = 0; i < w.data.size(); ++i) ASSERT_EQ(back.data[i], num::bf16_round(w.data[i])) << i;
  fs::remove_all(dir);
}
