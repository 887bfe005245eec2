// Checkpoint and config I/O: save/load round trips (F32, BF16, sharded), fused expert tensors in
// both orientations, transformers v4 and v5 config names, and errors that name the field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "model_test_util.h"
#include "numerics/formats.h"

using namespace quads;
using namespace quads::model;
namespace fs = std::filesystem;

namespace {

std::string tmpdir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("quads_test_weights_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

void write_text(const std::string& path, const std::string& s) { std::ofstream(path) << s; }

// Expect quads::Error whose message contains `needle`.
template <typename F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

nlohmann::json base_json() { return test::tiny_config().to_json(); }

}  // namespace

TEST(Weights, SaveLoadRoundTripF32IsExact) {
  ModelConfig c = test::tiny_config();
  c.mlp_only_layers = {1};
  const Weights w = Weights::random(c, 3, 0.1f, 0.1f);
  const std::string d = tmpdir("f32");
  w.save(d);
  EXPECT_TRUE(fs::exists(d + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(d + "/config.json"));
  const Weights r = Weights::load(d);
  EXPECT_EQ(r.cfg.mlp_only_layers, c.mlp_only_layers);
  EXPECT_EQ(r.layout.total, w.layout.total);
  EXPECT_EQ(r.data, w.data);
  // Per-expert HF names.
  auto f = io::SafeTensorsFile::open(d + "/model.safetensors");
  EXPECT_NE(f->find("model.layers.0.mlp.experts.5.down_proj.weight"), nullptr);
  EXPECT_NE(f->find("model.layers.1.mlp.gate_proj.weight"), nullptr);
  fs::remove_all(d);
}

TEST(Weights, SaveBf16RoundsToNearestEven) {
  ModelConfig c = test::tiny_config();
  c.tie_word_embeddings = true;
  const Weights w = Weights::random(c, 4, 0.1f, 0.1f);
  const std::string d = tmpdir("bf16");
  SaveOptions o;
  o.bf16 = true;
  w.save(d, o);
  auto f = io::SafeTensorsFile::open(d + "/model.safetensors");
  EXPECT_EQ(f->at("model.embed_tokens.weight").dtype, io::DType::BF16);
  EXPECT_EQ(f->find("lm_head.weight"), nullptr);  // tied
  const Weights r = Weights::load(d);
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(r.data[i], num::bf16_round(w.data[i])) << i;
  fs::remove_all(d);
}

TEST(Weights, LoadsF16Tensors) {
  const ModelConfig c = test::tiny_config();
  const Weights w = Weights::random(c, 8, 0.1f, 0.1f);
  std::vector<io::TensorData> t;
  for (const auto& p : w.layout.params)
    t.push_back(io::TensorData::from_f32(p.name, p.shape, w.data.data() + p.offset, io::DType::F16));
  const std::string d = tmpdir("f16");
  io::write_safetensors(d + "/model.safetensors", t);
  write_text(d + "/config.json", c.to_json().dump());
  const Weights r = Weights::load(d);
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(r.data[i], num::f16_to_f32(num::f16_from_f32(w.data[i]))) << i;
  fs::remove_all(d);
}

TEST(Weights, ShardedSaveWritesIndexAndRemovesStaleFiles) {
  const ModelConfig c = test::tiny_config();
  const Weights w = Weights::random(c, 5);
  const std::string d = tmpdir("shard");
  w.save(d);  // single file first
  SaveOptions o;
  o.max_shard_bytes = 20000;
  w.save(d, o);
  EXPECT_FALSE(fs::exists(d + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(d + "/model.safetensors.index.json"));
  const auto files = checkpoint_files(d);
  EXPECT_GT(files.size(), 2u);
  EXPECT_EQ(Weights::load(d).data, w.data);
  w.save(d);  // back to one file: the shards and the index go
  EXPECT_EQ(checkpoint_files(d).size(), 1u);
  for (const auto& f : files) EXPECT_FALSE(fs::exists(f)) << f;
  fs::remove_all(d);
}

TEST(Weights, LoadsFusedExpertsInBothOrientations) {
  ModelConfig c = test::tiny_config();  // H = 32, I = 16: 2I == H, so only [E, 2I, H] is unambiguous for gate_up
  c.moe_intermediate_size = 8;          // now 2I = 16 != H = 32 and I != H: both layouts are recognizable
  const Weights w = Weights::random(c, 6);
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  for (bool transposed : {false, true}) {
    std::vector<io::TensorData> t;
    for (const auto& p : w.layout.params)
      if (p.name.find(".mlp.experts.") == std::string::npos)
        t.push_back(io::TensorData::from_f32(p.name, p.shape, w.data.data() + p.offset));
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const LayerOffsets& o = w.layout.layers[l];
      std::vector<float> gu(E * 2 * I * H), dn(E * H * I);
      for (int64_t e = 0; e < E; ++e) {
        const float* g = w.data.data() + o.mlp + e * o.mlp_stride;
        const float* u = g + I * H;
        const float* d = u + I * H;
        for (int64_t i = 0; i < I; ++i)
          for (int64_t h = 0; h < H; ++h) {
            if (!transposed) {
              gu[(e * 2 * I + i) * H + h] = g[i * H + h];
              gu[(e * 2 * I + I + i) * H + h] = u[i * H + h];
              dn[(e * H + h) * I + i] = d[h * I + i];
            } else {
              gu[(e * H + h) * 2 * I + i] = g[i * H + h];
              gu[(e * H + h) * 2 * I + I + i] = u[i * H + h];
              dn[(e * I + i) * H + h] = d[h * I + i];
            }
          }
      }
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
      t.push_back(io::TensorData::from_f32(p + "gate_up_proj", transposed ? std::vector<int64_t>{E, H, 2 * I}
                                                                           : std::vector<int64_t>{E, 2 * I, H},
                                           gu.data()));
      t.push_back(io::TensorData::from_f32(p + "down_proj", transposed ? std::vector<int64_t>{E, I, H}
                                                                        : std::vector<int64_t>{E, H, I},
                                           dn.data()));
    }
    const std::string d = tmpdir(transposed ? "fusedT" : "fused");
    io::write_safetensors(d + "/model.safetensors", t);
    write_text(d + "/config.json", c.to_json().dump());
    EXPECT_EQ(Weights::load(d).data, w.data) << (transposed ? "transposed" : "documented");
    fs::remove_all(d);
  }
}

TEST(Weights, MissingUnknownAndMisshapedTensorsAreErrors) {
  const ModelConfig c = test::tiny_config();
  const Weights w = Weights::random(c, 7);
  const std::string d = tmpdir("bad");
  auto write = [&](auto edit) {
    std::vector<io::TensorData> t;
    for (const auto& p : w.layout.params) t.push_back(io::TensorData::from_f32(p.name, p.shape, w.data.data() + p.offset));
    edit(t);
    io::write_safetensors(d + "/model.safetensors", t);
    write_text(d + "/config.json", c.to_json().dump());
  };
  write([](auto& t) { t.erase(t.begin() + 3); });
  expect_error([&] { Weights::load(d); }, "model.layers.0.self_attn.k_proj.weight");
  write([](auto& t) {
    std::vector<float> x(4);
    t.push_back(io::TensorData::from_f32("model.layers.0.self_attn.q_proj.bias", {4}, x.data()));
  });
  expect_error([&] { Weights::load(d); }, "model.layers.0.self_attn.q_proj.bias");
  write([](auto& t) { t[3].shape = {t[3].shape[1], t[3].shape[0]}; });  // k_proj [16, 32] as [32, 16]
  expect_error([&] { Weights::load(d); }, "has shape");
  fs::remove_all(d);
}

TEST(Config, V4AndV5NamesAgree) {
  nlohmann::json v5 = base_json();
  v5.erase("num_experts");
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  nlohmann::json v4 = base_json();
  v4.erase("num_local_experts");
  v4.erase("rope_parameters");
  v4["rope_theta"] = 1e6;
  v4["rope_scaling"] = nullptr;
  v4.erase("head_dim");  // defaults to hidden / heads
  v4["hidden_size"] = 32;
  const ModelConfig a = ModelConfig::from_json(v5), b = ModelConfig::from_json(v4);
  EXPECT_EQ(a.num_experts, 6);
  EXPECT_EQ(b.num_experts, 6);
  EXPECT_EQ(a.rope_theta, 1e6);
  EXPECT_EQ(b.rope_theta, 1e6);
  EXPECT_EQ(b.head_dim, 8);
  // to_json writes both spellings and reads back the same.
  const ModelConfig r = ModelConfig::from_json(a.to_json());
  EXPECT_EQ(r.num_experts, a.num_experts);
  EXPECT_EQ(r.rope_theta, a.rope_theta);
}

TEST(Config, UnsupportedSettingsNameTheField) {
  auto bad = [](const char* key, nlohmann::json value) {
    nlohmann::json j = base_json();
    j[key] = value;
    expect_error([&] { ModelConfig::from_json(j); }, key);
  };
  bad("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}});
  bad("rope_parameters", {{"rope_type", "linear"}, {"rope_theta", 1e4}, {"factor", 2.0}});
  bad("use_sliding_window", true);
  bad("attention_bias", true);
  bad("hidden_act", "gelu");
  bad("model_type", "llama");
  bad("num_experts_per_tok", 9);
  bad("num_key_value_heads", 3);
  nlohmann::json j = base_json();
  j["num_experts"] = 4;  // disagrees with num_local_experts
  expect_error([&] { ModelConfig::from_json(j); }, "num_local_experts");
}
