#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/error.h"
#include "common/fixtures.h"
#include "io/quantized_checkpoint.h"
#include "io/safetensors.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"

using namespace quads;
using namespace quads::io;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path dir;
  TempDir() {
    dir = fs::temp_directory_path() /
          ("quads_qckpt_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
};

std::vector<float> randn(size_t n, uint64_t seed, float sd = 0.05f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * 4) == 0; }

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.nbytes == b.nbytes &&
         (a.nbytes == 0 || std::memcmp(a.data, b.data, a.nbytes) == 0);
}

// A little checkpoint with a bit of everything the quantizer must tell apart.
std::string make_input(const TempDir& tmp) {
  std::vector<TensorData> ts;
  uint64_t seed = 1;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, DType dt) {
    size_t n = 1;
    for (auto d : shape) n *= static_cast<size_t>(d);
    auto v = randn(n, seed++);
    if (n > 5) v[5] = 0.9f;  // an outlier
    ts.push_back(TensorData::from_f32(name, shape, v.data(), dt));
  };
  add("model.layers.0.self_attn.q_proj.weight", {64, 64}, DType::F32);
  add("model.layers.0.self_attn.k_proj.weight", {32, 64}, DType::BF16);
  add("model.layers.0.self_attn.v_proj.weight", {32, 128}, DType::F16);
  add("model.layers.0.mlp.experts.3.down_proj.weight", {130, 256}, DType::F32);  // rows not /16
  add("model.embed_tokens.weight", {64, 64}, DType::F32);                     // excluded below
  add("model.layers.0.input_layernorm.weight", {64}, DType::F32);               // 1-D
  add("model.layers.0.self_attn.q_proj.bias", {4, 64}, DType::F32);              // not .weight
  add("model.layers.0.odd.weight", {16, 40}, DType::F32);                       // cols not /16
  add("model.layers.0.mlp.experts.gate_up_proj.weight", {2, 16, 32}, DType::F32);  // 3-D
  std::vector<double> f64(16 * 32, 0.25);
  ts.push_back(TensorData::raw("model.layers.0.f64.weight", DType::F64, {16, 32}, f64.data(), f64.size() * 8));
  int32_t ints[32 * 16];
  for (int i = 0; i < 32 * 16; ++i) ints[i] = i - 100;
  ts.push_back(TensorData::raw("model.layers.0.int.weight", DType::I32, {32, 16}, ints, sizeof ints));
  ts.push_back(TensorData::raw("empty.weight", DType::F32, {0, 16}, nullptr, 0));
  std::string p = tmp / "in.safetensors";
  write_safetensors(p, ts, {{"format", "pt"}});
  return p;
}

QuantizeOptions opts(CheckpointFormat f, bool block2d = false, int fp8_block = 0) {
  QuantizeOptions o;
  o.format = f;
  o.block2d = block2d;
  o.fp8_block = fp8_block;
  o.exclude = "embed_tokens";
  return o;
}

const TensorReport& find_report(const QuantizeReport& r, const std::string& name) {
  for (const auto& t : r.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no report for " + name);
}

// The checks every format shares: copied tensors identical, quantized ones decoding exactly
// to num::dequantize(num::quantize(x)), and verify() accepting the file.
void check_output(const std::string& in_path, const std::string& out_path, const QuantizeOptions& opt,
                  const QuantizeReport& rep) {
  auto in = SafeTensorsFile::open(in_path);
  auto out = SafeTensorsFile::open(out_path);
  for (const auto& [k, v] : in->metadata()) EXPECT_EQ(out->metadata().at(k), v) << k;
  EXPECT_EQ(out->metadata().at("quads.quantization"), opt.describe());
  QuantizeOptions detected;
  ASSERT_TRUE(detect_checkpoint_format(*out, &detected));
  EXPECT_EQ(detected.describe(), opt.describe());
  std::vector<std::string> quantized;
  for (const TensorReport& r : rep.tensors) {
    const TensorView& s = in->at(r.name);
    if (r.action != Action::Quantize) {
      EXPECT_TRUE(same_bytes(s, out->at(r.name))) << r.name;
      continue;
    }
    quantized.push_back(r.name);
    auto x = s.to_f32();
    const int64_t rows = s.shape[0], cols = s.shape[1];
    num::QTensor ref = num::quantize(x.data(), rows, cols, opt.qconfig());
    std::vector<float> want(x.size()), got(x.size());
    num::dequantize(ref, want.data());
    num::QTensor q = load_quantized_weight(*out, r.name, opt);
    EXPECT_EQ(q.codes, ref.codes) << r.name;
    EXPECT_EQ(q.scales, ref.scales) << r.name;
    EXPECT_EQ(q.amax, ref.amax) << r.name;
    EXPECT_EQ(q.fscales, ref.fscales) << r.name;
    num::dequantize(q, got.data());
    EXPECT_TRUE(same_bits(got.data(), want.data(), got.size())) << r.name;
    num::ErrorStats e = num::error_stats(x.data(), want.data(), rows, cols);
    EXPECT_EQ(r.stats.rel_mse, e.rel_mse) << r.name;
    EXPECT_EQ(r.stats.max_abs, e.max_abs) << r.name;
    EXPECT_GT(r.stats.sqnr_db, 0) << r.name;
  }
  EXPECT_EQ(quantized_weight_names(*out, opt), [&] {
    std::sort(quantized.begin(), quantized.end());
    return quantized;
  }());
  EXPECT_NO_THROW(verify_quantized_checkpoint(in_path, out_path, opt, rep));
}

}  // namespace

TEST(QuantizedCheckpoint, PlanRules) {
  QuantizeOptions o = opts(CheckpointFormat::NVFP4);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {16, 32}, o).action, Action::Quantize);
  EXPECT_EQ(plan_tensor("a.weight", DType::BF16, {16, 32}, o).action, Action::Quantize);
  EXPECT_EQ(plan_tensor("a.weight", DType::F16, {16, 32}, o).action, Action::Quantize);
  EXPECT_EQ(plan_tensor("a.weight", DType::F64, {16, 32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("a.weight", DType::U8, {16, 32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("a.weights", DType::F32, {16, 32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("a.weight_scale", DType::F32, {16, 32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {2, 16, 32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("model.embed_tokens.weight", DType::F32, {16, 32}, o).action, Action::Copy);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {16, 24}, o).action, Action::Unfit);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {0, 32}, o).action, Action::Unfit);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {24, 32}, o).action, Action::Quantize);
  o.block2d = true;
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {24, 32}, o).action, Action::Unfit);
  o = opts(CheckpointFormat::MXFP4);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {3, 48}, o).action, Action::Unfit);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {3, 64}, o).action, Action::Quantize);
  o = opts(CheckpointFormat::FP8, false, 128);
  EXPECT_EQ(plan_tensor("a.weight", DType::F32, {3, 5}, o).action, Action::Quantize);
  o.include = "q_proj|k_proj";
  EXPECT_EQ(plan_tensor("l.q_proj.weight", DType::F32, {3, 5}, o).action, Action::Quantize);
  EXPECT_EQ(plan_tensor("l.v_proj.weight", DType::F32, {3, 5}, o).action, Action::Copy);
  o.include = "([unclosed";
  try {
    plan_tensor("a.weight", DType::F32, {3, 5}, o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--include"), std::string::npos);
  }
  for (float a : {0.f, 1e-40f, 3.4e38f, 0.1f, 2688.f}) {
    std::string v = format_nvfp4_amax(a);
    EXPECT_EQ(v.size(), 14u) << v;
    EXPECT_EQ(std::strtof(v.c_str(), nullptr), a) << v;
  }
  EXPECT_EQ(nvfp4_amax_key("x.weight"), "quads.nvfp4_amax.x.weight");
  EXPECT_EQ(parse_checkpoint_format("mxfp4"), CheckpointFormat::MXFP4);
  EXPECT_THROW(parse_checkpoint_format("int4"), Error);
}

TEST(QuantizedCheckpoint, Nvfp4Layout) {
  TempDir tmp;
  std::string in = make_input(tmp), out = tmp / "out.safetensors";
  QuantizeOptions opt = opts(CheckpointFormat::NVFP4);
  QuantizeReport rep = quantize_checkpoint(in, out, opt);
  EXPECT_EQ(SafeTensorsFile::open(out)->metadata().at("format"), "pt");
  EXPECT_EQ(rep.quantized, 4);  // q, k, v, experts.3.down (rows 130 are fine for 1x16)
  EXPECT_EQ(rep.unfit, 2);      // odd (cols 40), empty
  EXPECT_EQ(rep.out_bytes, fs::file_size(out));
  EXPECT_EQ(find_report(rep, "model.embed_tokens.weight").action, Action::Copy);
  EXPECT_EQ(find_report(rep, "model.layers.0.odd.weight").action, Action::Unfit);

  auto src = SafeTensorsFile::open(in);
  auto f = SafeTensorsFile::open(out);
  const std::string w = "model.layers.0.self_attn.q_proj.weight";
  EXPECT_EQ(f->at(w).dtype, DType::U8);
  EXPECT_EQ(f->at(w).shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(f->at(w + "_scale").dtype, DType::F8_E4M3);
  EXPECT_EQ(f->at(w + "_scale").shape, (std::vector<int64_t>{64, 4}));
  EXPECT_EQ(f->at(w + "_scale_2").dtype, DType::F32);
  EXPECT_EQ(f->at(w + "_scale_2").shape, (std::vector<int64_t>{}));
  EXPECT_EQ(f->at("model.layers.0.mlp.experts.3.down_proj.weight_scale").shape, (std::vector<int64_t>{130, 16}));
  // scale_2 = amax / 2688 with amax the max |x| of the tensor (an independent computation here)
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}) {
    auto x = src->at(name).to_f32();
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    EXPECT_EQ(f->at(std::string(name) + "_scale_2").to_f32()[0], amax / 2688.0f) << name;
  }
  // Decoding as ModelOpt / vLLM do (code * scale * scale_2, from the file's bytes alone) agrees
  // with num::dequantize to float32 rounding: the layout means what those engines assume.
  auto x = src->at(w).to_f32();
  std::vector<float> ours(x.size());
  num::dequantize(load_quantized_weight(*f, w, opt), ours.data());
  const TensorView& codes = f->at(w);
  const TensorView& sc = f->at(w + "_scale");
  const float s2 = f->at(w + "_scale_2").to_f32()[0];
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t c = 0; c < 64; ++c) {
      uint8_t byte = codes.data[r * 32 + c / 2];
      float v = num::e2m1_to_f32(c % 2 ? byte >> 4 : byte & 0xF) * num::e4m3_to_f32(sc.data[r * 4 + c / 16]) * s2;
      float o = ours[r * 64 + c];
      ASSERT_NEAR(v, o, 4e-7f * std::fabs(o)) << r << "," << c;
      // and both are close to the input (4-bit: within half a grid step of the block scale)
      EXPECT_LE(std::fabs(o - x[r * 64 + c]), 0.5f * 448 * s2 * 2 + 1e-6f);
    }
  check_output(in, out, opt, rep);
}

TEST(QuantizedCheckpoint, Nvfp4Block2dAndOtherFormats) {
  TempDir tmp;
  std::string in = make_input(tmp);
  for (QuantizeOptions opt : {opts(CheckpointFormat::NVFP4, true), opts(CheckpointFormat::MXFP4),
                              opts(CheckpointFormat::FP8), opts(CheckpointFormat::FP8, false, 128)}) {
    SCOPED_TRACE(opt.describe());
    std::string out = tmp / (opt.describe() + ".safetensors");
    QuantizeReport rep = quantize_checkpoint(in, out, opt);
    auto f = SafeTensorsFile::open(out);
    const std::string w = "model.layers.0.self_attn.q_proj.weight";
    const std::string d = "model.layers.0.mlp.experts.3.down_proj.weight";
    switch (opt.format) {
      case CheckpointFormat::NVFP4:  // 2-D: rows 130 do not tile by 16
        EXPECT_EQ(find_report(rep, d).action, Action::Unfit);
        EXPECT_EQ(rep.quantized, 3);
        break;
      case CheckpointFormat::MXFP4:
        EXPECT_EQ(f->at(w).dtype, DType::U8);
        EXPECT_EQ(f->at(w).shape, (std::vector<int64_t>{64, 32}));
        EXPECT_EQ(f->at(w + "_scale").dtype, DType::U8);
        EXPECT_EQ(f->at(w + "_scale").shape, (std::vector<int64_t>{64, 2}));
        EXPECT_EQ(f->find(w + "_scale_2"), nullptr);
        EXPECT_EQ(rep.quantized, 4);
        break;
      case CheckpointFormat::FP8:
        EXPECT_EQ(f->at(w).dtype, DType::F8_E4M3);
        EXPECT_EQ(f->at(w).shape, (std::vector<int64_t>{64, 64}));
        EXPECT_EQ(rep.quantized, 5);  // cols 40 fit FP8
        if (opt.fp8_block) {
          EXPECT_EQ(f->at(d + "_scale_inv").shape, (std::vector<int64_t>{2, 2}));
          EXPECT_EQ(f->find(d + "_scale"), nullptr);
        } else {
          EXPECT_EQ(f->at(d + "_scale").shape, (std::vector<int64_t>{}));
          EXPECT_EQ(f->at(d + "_scale").dtype, DType::F32);
        }
        break;
    }
    check_output(in, out, opt, rep);
  }
}

// The file layout against the reference fixture: quantizing the golden inputs puts exactly the
// golden codes and scales (computed independently with TransformerEngine's formula) in the file.
TEST(QuantizedCheckpoint, MatchesGoldenNvfp4) {
  TempDir tmp;
  auto g = SafeTensorsFile::open(fixtures_dir() + "/nvfp4/golden.safetensors");
  std::string in = tmp / "golden_in.safetensors";
  const TensorView& x1 = g->at("case1.input");
  const TensorView& x0 = g->at("case0.input");
  write_safetensors(in, {TensorData::raw("a.weight", x1.dtype, x1.shape, x1.data, x1.nbytes),
                         TensorData::raw("b.weight", x0.dtype, x0.shape, x0.data, x0.nbytes)});
  for (bool block2d : {false, true}) {
    std::string out = tmp / "golden_out.safetensors";
    QuantizeOptions opt;
    opt.block2d = block2d;
    QuantizeReport rep = quantize_checkpoint(in, out, opt);
    auto f = SafeTensorsFile::open(out);
    const std::string sfx = block2d ? "_2d" : "";
    EXPECT_TRUE(same_bytes(f->at("a.weight"), g->at("case1.packed" + sfx)));
    const TensorView& s = f->at("a.weight_scale");
    const TensorView& gs = g->at("case1.scales" + sfx);
    ASSERT_EQ(s.nbytes, gs.nbytes);
    EXPECT_EQ(std::memcmp(s.data, gs.data, s.nbytes), 0);
    EXPECT_EQ(f->at("a.weight_scale_2").to_f32()[0], g->at("case1.amax").to_f32()[0] / 2688.0f);
    std::vector<float> deq(static_cast<size_t>(x1.numel()));
    num::dequantize(load_quantized_weight(*f, "a.weight", opt), deq.data());
    EXPECT_TRUE(same_bits(deq.data(), g->at("case1.dequant" + sfx).to_f32().data(), deq.size()));
    if (!block2d) {  // case 0 has 200 rows: 1x16 only
      EXPECT_TRUE(same_bytes(f->at("b.weight"), g->at("case0.packed")));
      EXPECT_EQ(std::memcmp(f->at("b.weight_scale").data, g->at("case0.scales").data, 200 * 6), 0);
    } else {
      EXPECT_EQ(find_report(rep, "b.weight").action, Action::Unfit);
    }
  }
}

TEST(QuantizedCheckpoint, ExcludedAndIncludedCopiedBitExactly) {
  TempDir tmp;
  std::string in = make_input(tmp), out = tmp / "out.safetensors";
  QuantizeOptions opt = opts(CheckpointFormat::NVFP4);
  opt.include = "self_attn";
  opt.exclude = "k_proj";
  QuantizeReport rep = quantize_checkpoint(in, out, opt);
  EXPECT_EQ(rep.quantized, 2);  // q_proj, v_proj
  auto src = SafeTensorsFile::open(in);
  auto f = SafeTensorsFile::open(out);
  for (const char* name : {"model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight",
                           "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.input_layernorm.weight",
                           "model.layers.0.self_attn.q_proj.bias", "model.layers.0.int.weight",
                           "model.layers.0.mlp.experts.gate_up_proj.weight"}) {
    EXPECT_TRUE(same_bytes(src->at(name), f->at(name))) << name;
    EXPECT_EQ(f->find(std::string(name) + "_scale"), nullptr) << name;
  }
  check_output(in, out, opt, rep);
}

TEST(QuantizedCheckpoint, ZeroTensorAndAtomicFailure) {
  TempDir tmp;
  std::vector<float> zero(16 * 32, 0.f), bad = randn(16 * 32, 9);
  bad[77] = NAN;
  std::string in = tmp / "in.safetensors", out = tmp / "out.safetensors";
  write_safetensors(in, {TensorData::from_f32("z.weight", {16, 32}, zero.data())});
  QuantizeOptions opt;
  QuantizeReport rep = quantize_checkpoint(in, out, opt);
  auto f = SafeTensorsFile::open(out);
  float s2 = f->at("z.weight_scale_2").to_f32()[0];
  EXPECT_TRUE(std::isfinite(s2) && s2 > 0);  // engines invert it
  std::vector<float> deq(zero.size(), 1.f);
  num::dequantize(load_quantized_weight(*f, "z.weight", opt), deq.data());
  for (float v : deq) EXPECT_EQ(v, 0.f);
  check_output(in, out, opt, rep);

  // a NaN fails naming the tensor and leaves the previous output untouched, no temp files
  auto before = fs::file_size(out);
  write_safetensors(in, {TensorData::from_f32("ok.weight", {16, 32}, zero.data()),
                         TensorData::from_f32("nan.weight", {16, 32}, bad.data())});
  try {
    quantize_checkpoint(in, out, opt);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nan.weight"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fs::file_size(out), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.dir), fs::directory_iterator()), 2);
}

TEST(QuantizedCheckpoint, NameCollisionAndVerifyCatchesCorruption) {
  TempDir tmp;
  std::vector<float> x = randn(16 * 32, 4), one = {1.f};
  std::string in = tmp / "in.safetensors", out = tmp / "out.safetensors";
  write_safetensors(in, {TensorData::from_f32("a.weight", {16, 32}, x.data()),
                         TensorData::from_f32("a.weight_scale_2", {1}, one.data())});
  QuantizeOptions opt;
  try {
    quantize_checkpoint(in, out, opt);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a.weight_scale_2"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(out));

  write_safetensors(in, {TensorData::from_f32("a.weight", {16, 32}, x.data())});
  QuantizeReport rep = quantize_checkpoint(in, out, opt);
  EXPECT_NO_THROW(verify_quantized_checkpoint(in, out, opt, rep));
  // flip one code nibble in the output: verify must notice
  auto f = SafeTensorsFile::open(out);
  size_t at = static_cast<size_t>(f->at("a.weight").data - f->at(f->tensors().front().name).data) + 8 + f->header_size();
  std::vector<char> bytes(fs::file_size(out));
  std::ifstream(out, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes[at + 3] ^= 0x01;
  std::string bad = tmp / "bad.safetensors";
  std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    verify_quantized_checkpoint(in, bad, opt, rep);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a.weight"), std::string::npos) << e.what();
  }
}
