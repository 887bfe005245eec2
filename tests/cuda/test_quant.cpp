// The GPU quantizers against their CPU twins (num::quantize / dequantize / fake_quantize), bit for
// bit, on random shapes and data, for every configuration; and against the TransformerEngine
// golden vectors of the fixtures.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fixtures.h"
#include "cuda/cuda_test_util.h"
#include "cuda/quant.h"
#include "cuda/train_gpu_kernels.h"
#include "io/safetensors.h"

using namespace quads;
using namespace quads::cuda;
using namespace quads::cuda::testing;
using num::Block;
using num::Format;
using num::Global;
using num::QConfig;
using num::Scheme;

namespace {

struct Case {
  std::string name;
  QConfig cfg;
};

std::vector<Case> all_configs() {
  std::vector<Case> v;
  auto nv = [](Block b, Global g, Format e) {
    QConfig c;
    c.block = b;
    c.global = g;
    c.element = e;
    c.static_amax = 3.5f;
    return c;
  };
  v.push_back({"nvfp4 1x16 tensor", nv(Block::B1x16, Global::PerTensor, Format::E2M1)});
  v.push_back({"nvfp4 1x16 row", nv(Block::B1x16, Global::PerRow, Format::E2M1)});
  v.push_back({"nvfp4 1x16 static", nv(Block::B1x16, Global::Static, Format::E2M1)});
  v.push_back({"nvfp4 16x16 tensor", nv(Block::B16x16, Global::PerTensor, Format::E2M1)});
  v.push_back({"nvfp4 16x16 static", nv(Block::B16x16, Global::Static, Format::E2M1)});
  v.push_back({"nvfp4 e1m2 row (kv)", nv(Block::B1x16, Global::PerRow, Format::E1M2)});
  v.push_back({"nvfp4 e1m2 16x16", nv(Block::B16x16, Global::PerTensor, Format::E1M2)});
  QConfig sr = nv(Block::B1x16, Global::PerRow, Format::E2M1);
  sr.stochastic = true;
  sr.seed = 1234;
  v.push_back({"nvfp4 1x16 row stochastic", sr});
  QConfig sr2 = nv(Block::B16x16, Global::PerTensor, Format::E2M1);
  sr2.stochastic = true;
  sr2.seed = 99;
  v.push_back({"nvfp4 16x16 stochastic", sr2});
  v.push_back({"mxfp4 ocp", QConfig::mxfp4()});
  QConfig te = QConfig::mxfp4();
  te.mx_rule = num::MxRule::TeCeil;
  v.push_back({"mxfp4 te", te});
  QConfig mxsr = QConfig::mxfp4();
  mxsr.stochastic = true;
  mxsr.seed = 7;
  v.push_back({"mxfp4 stochastic", mxsr});
  v.push_back({"fp8 tensor", QConfig::fp8(Block::PerTensor)});
  v.push_back({"fp8 row", QConfig::fp8(Block::PerRow)});
  v.push_back({"fp8 1x128", QConfig::fp8(Block::B1x128)});
  v.push_back({"fp8 128x128", QConfig::fp8(Block::B128x128)});
  QConfig e5 = QConfig::fp8(Block::PerRow);
  e5.element = Format::E5M2;
  v.push_back({"fp8 e5m2 row", e5});
  return v;
}

// Shapes valid for the configuration: rows a multiple of 16 for 16x16, cols of 16/32 for 4-bit;
// FP8 gets ragged ones. The row kernel's paths: a warp a row with the row in registers ({130, 768};
// bf16 rows up to 4096 elements) or not (MXFP4's {272, 4128}; float NVFP4 rows past 4 warps' chunks
// among many rows, {300, 8208}), a CTA a row in registers (few rows of 128+ blocks; many per-row
// amax rows longer than a warp's chunk: {272, 2064}) or not (float rows past 4 warps' 2048-element
// chunks: 8208, 8224 columns).
std::vector<std::pair<int64_t, int64_t>> shapes_for(const QConfig& cfg) {
  if (cfg.scheme == Scheme::FP8) return {{1, 7}, {3, 200}, {130, 300}, {257, 129}, {64, 2048}};
  if (cfg.scheme == Scheme::MXFP4) return {{1, 32}, {5, 96}, {33, 2048}, {7, 4160}, {64, 768}, {2, 8224}, {272, 4128}};
  if (cfg.block == Block::B16x16) return {{16, 16}, {32, 48}, {48, 2064}, {16, 4096}, {64, 768}};
  return {{1, 16}, {3, 48}, {37, 2048}, {5, 4112}, {130, 768}, {3, 8208}, {272, 2064}, {300, 8208}};
}

void expect_same_qtensor(const num::QTensor& cpu, const num::QTensor& gpu, const std::string& what) {
  EXPECT_EQ(first_mismatch(cpu.codes, gpu.codes), -1) << what << ": codes";
  EXPECT_EQ(first_mismatch(cpu.scales, gpu.scales), -1) << what << ": scales";
  EXPECT_EQ(first_float_mismatch(cpu.fscales, gpu.fscales), -1) << what << ": fscales";
  EXPECT_EQ(first_float_mismatch(cpu.amax, gpu.amax), -1) << what << ": amax";
}

// Runs every GPU path for one input and compares with the CPU.
void check_one(const Case& c, int64_t rows, int64_t cols, uint64_t seed, bool bf16) {
  const std::string what = c.name + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]" +
                           (bf16 ? " bf16" : " f32");
  std::vector<float> x = random_matrix(rows, cols, seed);
  std::vector<uint16_t> xb(x.size());
  if (bf16) {
    for (size_t i = 0; i < x.size(); ++i) {
      xb[i] = to_bf16(x[i]);
      x[i] = from_bf16(xb[i]);  // the CPU sees exactly the bf16 values
    }
  }
  const num::QTensor cpu = num::quantize(x.data(), rows, cols, c.cfg);
  std::vector<float> cpu_dq(x.size()), cpu_fake(x.size());
  num::dequantize(cpu, cpu_dq.data());
  num::fake_quantize(x.data(), cpu_fake.data(), rows, cols, c.cfg);

  DeviceArray<float> dx;
  DeviceArray<uint16_t> dxb;
  if (bf16) dxb.upload(xb);
  else dx.upload(x);

  for (ScaleLayout layout : {ScaleLayout::RowMajor, ScaleLayout::Swizzled128x4}) {
    if (layout == ScaleLayout::Swizzled128x4 && c.cfg.scheme == Scheme::FP8) continue;
    const std::string w = what + (layout == ScaleLayout::RowMajor ? "" : " swizzled");
    DeviceQTensor q = make_qtensor(rows, cols, c.cfg, layout);
    q.codes.fill_bytes(0xAB);  // poison: every byte must be written
    if (bf16) cuda::quantize_bf16(dxb.data(), q);
    else cuda::quantize(dx.data(), q);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same_qtensor(cpu, to_host(q), w);
    if (layout == ScaleLayout::Swizzled128x4) {
      const std::vector<uint8_t> ref = num::swizzle_scales_128x4(cpu.scales.data(), rows, q.nblocks());
      EXPECT_EQ(first_mismatch(ref, q.scales.download()), -1) << w << ": raw swizzled scales";
    }
    DeviceArray<float> out(x.size());
    out.fill_bytes(0xFF);
    cuda::dequantize(q, out.data());
    EXPECT_EQ(first_float_mismatch(cpu_dq, out.download()), -1) << w << ": dequantize";
  }

  // fake quantize, out of place and in place
  if (bf16) {
    DeviceArray<uint16_t> out(x.size());
    fake_quantize_bf16(dxb.data(), out.data(), rows, cols, c.cfg);
    const std::vector<uint16_t> got = out.download();
    int64_t bad = -1;
    for (size_t i = 0; i < got.size() && bad < 0; ++i)
      if (got[i] != to_bf16(cpu_fake[i]) && !(std::isnan(cpu_fake[i]) && std::isnan(from_bf16(got[i])))) bad = i;
    EXPECT_EQ(bad, -1) << what << ": fake_quantize_bf16";
  } else {
    DeviceArray<float> out(x.size());
    DeviceArray<float> amax(rows);
    cuda::fake_quantize(dx.data(), out.data(), rows, cols, c.cfg, nullptr, amax.data());
    EXPECT_EQ(first_float_mismatch(cpu_fake, out.download()), -1) << what << ": fake_quantize";
    if (c.cfg.scheme == Scheme::NVFP4) {
      std::vector<float> a = amax.download();
      a.resize(cpu.amax.size());
      EXPECT_EQ(first_float_mismatch(cpu.amax, a), -1) << what << ": fake_quantize amax";
    }
    cuda::fake_quantize(dx.data(), dx.data(), rows, cols, c.cfg);  // in place
    EXPECT_EQ(first_float_mismatch(cpu_fake, dx.download()), -1) << what << ": fake_quantize in place";
  }
}

}  // namespace

TEST(CudaQuant, MatchesCpuOnRandomShapes) {
  QUADS_REQUIRE_GPU();
  uint64_t seed = 1;
  for (const Case& c : all_configs())
    for (auto [rows, cols] : shapes_for(c.cfg))
      for (bool bf16 : {false, true}) check_one(c, rows, cols, seed++, bf16);
}

// NaN and Inf poison their amax group the same way on both sides (scales and dequantized values;
// NVFP4 codes of a poisoned group are unspecified, so only the clean rows' codes are compared).
TEST(CudaQuant, NonFiniteInputsMatchCpu) {
  QUADS_REQUIRE_GPU();
  const int64_t rows = 32, cols = 64;
  for (const Case& c : all_configs()) {
    if (c.cfg.block == Block::B16x16 || c.cfg.scheme == Scheme::FP8) continue;
    std::vector<float> x = random_matrix(rows, cols, 77);
    x[3 * cols + 5] = std::nanf("");
    x[9 * cols + 40] = -INFINITY;
    x[20 * cols + 1] = INFINITY;
    QConfig cfg = c.cfg;
    if (cfg.global == Global::PerTensor) cfg.global = Global::PerRow;  // keep the poison to a few rows
    const num::QTensor cpu = num::quantize(x.data(), rows, cols, cfg);
    std::vector<float> cpu_dq(x.size());
    num::dequantize(cpu, cpu_dq.data());
    DeviceArray<float> dx;
    dx.upload(x);
    DeviceQTensor q = make_qtensor(rows, cols, cfg);
    cuda::quantize(dx.data(), q);
    const num::QTensor gpu = to_host(q);
    EXPECT_EQ(first_mismatch(cpu.scales, gpu.scales), -1) << c.name;
    EXPECT_EQ(first_float_mismatch(cpu.amax, gpu.amax), -1) << c.name;
    DeviceArray<float> out(x.size());
    cuda::dequantize(q, out.data());
    EXPECT_EQ(first_float_mismatch(cpu_dq, out.download()), -1) << c.name;
    for (int64_t r : {0, 10, 31})
      for (int64_t i = r * cols / 2; i < (r + 1) * cols / 2; ++i) ASSERT_EQ(cpu.codes[i], gpu.codes[i]) << c.name << " row " << r;
  }
}

TEST(CudaQuant, GoldenVectors) {
  QUADS_REQUIRE_GPU();
  auto f = io::SafeTensorsFile::open(fixtures_dir() + "/nvfp4/golden.safetensors");
  for (int ci : {0, 1}) {
    const std::string p = "case" + std::to_string(ci) + ".";
    const io::TensorView& in = f->at(p + "input");
    const int64_t rows = in.shape[0], cols = in.shape[1];
    const std::vector<float> x = in.to_f32();
    auto bytes = [&](const std::string& name) {
      const io::TensorView& t = f->at(p + name);
      return std::vector<uint8_t>(t.data, t.data + t.nbytes);
    };
    DeviceArray<float> dx;
    dx.upload(x);
    for (bool two_d : {false, true}) {
      if (two_d && ci == 0) continue;
      const std::string sfx = two_d ? "_2d" : "";
      const QConfig cfg = QConfig::nvfp4_weight(two_d);
      DeviceQTensor q = make_qtensor(rows, cols, cfg);
      cuda::quantize(dx.data(), q);
      const num::QTensor h = to_host(q);
      EXPECT_EQ(first_mismatch(bytes("packed" + sfx), h.codes), -1) << p << "packed" << sfx;
      EXPECT_EQ(first_mismatch(bytes("scales" + sfx), h.scales), -1) << p << "scales" << sfx;
      EXPECT_EQ(first_float_mismatch(f->at(p + "amax").to_f32(), h.amax), -1) << p << "amax";
      DeviceArray<float> out(x.size());
      cuda::dequantize(q, out.data());
      EXPECT_EQ(first_float_mismatch(f->at(p + "dequant" + sfx).to_f32(), out.download()), -1) << p << "dequant" << sfx;
      cuda::fake_quantize(dx.data(), out.data(), rows, cols, cfg);
      EXPECT_EQ(first_float_mismatch(f->at(p + "dequant" + sfx).to_f32(), out.download()), -1) << p << "fake" << sfx;
      if (!two_d) {
        DeviceQTensor qs = make_qtensor(rows, cols, cfg, ScaleLayout::Swizzled128x4);
        cuda::quantize(dx.data(), qs);
        EXPECT_EQ(first_mismatch(bytes("scales_swizzled"), qs.scales.download()), -1) << p << "scales_swizzled";
        // the standalone swizzle kernels, both ways
        DeviceArray<uint8_t> sw(swizzled_scales_size(rows, cols / 16)), back(rows * cols / 16);
        sw.fill_bytes(0x5A);
        swizzle_scales(q.scales.data(), sw.data(), rows, cols / 16);
        EXPECT_EQ(first_mismatch(bytes("scales_swizzled"), sw.download()), -1) << p << "swizzle_scales";
        unswizzle_scales(sw.data(), back.data(), rows, cols / 16);
        EXPECT_EQ(first_mismatch(bytes("scales"), back.download()), -1) << p << "unswizzle_scales";
      }
    }
  }
}

// Uploading a CPU-quantized tensor and dequantizing it on the GPU gives the CPU's values.
TEST(CudaQuant, ToDeviceRoundTrip) {
  QUADS_REQUIRE_GPU();
  const std::vector<float> x = random_matrix(48, 256, 5);
  for (const Case& c : all_configs()) {
    const num::QTensor cpu = num::quantize(x.data(), 48, 256, c.cfg);
    std::vector<float> ref(x.size());
    num::dequantize(cpu, ref.data());
    DeviceQTensor q = to_device(cpu, c.cfg.scheme == Scheme::FP8 ? ScaleLayout::RowMajor : ScaleLayout::Swizzled128x4);
    DeviceArray<float> out(x.size());
    cuda::dequantize(q, out.data());
    EXPECT_EQ(first_float_mismatch(ref, out.download()), -1) << c.name;
    expect_same_qtensor(cpu, to_host(q), c.name + " to_host");
  }
}

TEST(CudaQuant, AbsmaxIsNanAware) {
  QUADS_REQUIRE_GPU();
  std::vector<float> x = random_matrix(1, 100003, 11);
  x[777] = -1e30f;
  DeviceArray<float> dx, a(1);
  dx.upload(x);
  absmax(dx.data(), static_cast<int64_t>(x.size()), a.data());
  EXPECT_EQ(a.download()[0], 1e30f);
  x[5000] = std::nanf("");
  dx.upload(x);
  absmax(dx.data(), static_cast<int64_t>(x.size()), a.data());
  EXPECT_TRUE(std::isnan(a.download()[0]));
}

// Shape errors are quads::Error naming the operation (no GPU needed: checked before any launch).
TEST(CudaQuant, RejectsBadShapes) {
  EXPECT_THROW(make_qtensor(4, 24, QConfig::nvfp4_act()), Error);
  EXPECT_THROW(make_qtensor(8, 32, QConfig::nvfp4_weight(true)), Error);
  EXPECT_THROW(make_qtensor(2, 48, QConfig::mxfp4()), Error);
  try {
    make_qtensor(4, 24, QConfig::nvfp4_act());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda::make_qtensor"), std::string::npos) << e.what();
  }
}

// The trainer's NVFP4 weight operands from one WeightOperandSet against quantize() then
// kern::nvfp4_weight_bf16 per tensor: the same BF16 operand bits, alpha and amax. Tensors of one
// block to several 8192-element chunks (a chunk's last rows ragged), magnitudes from 1e-30 to 1e30
// (the per-tensor global scale near both ends of float32), an all-zero tensor, and -0 / NaN elements (the NaN
// tensor's operand is compared where the chain defines it: alpha and amax NaN, as the CPU's); two
// runs give the same bits. Refused: other configurations, unaligned or ragged tensors.
TEST(CudaQuant, WeightOperandSetIsQuantizeThenOperand) {
  QUADS_REQUIRE_GPU();
  const QConfig cfg = QConfig::nvfp4_weight(false);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 16},   {3, 48},    {16, 2048}, {7, 8208},
                                                           {768, 64}, {5, 16400}, {2, 32},    {4, 4096}};
  const float mags[] = {1.f, 3e-3f, 1e30f, 1e-30f, 0.f, 250.f, 1.f, 1.f};
  std::vector<DeviceArray<float>> src(shapes.size());
  std::vector<DeviceArray<uint16_t>> out(shapes.size()), ref(shapes.size());
  DeviceArray<float> alpha(shapes.size()), ref_alpha(shapes.size());
  std::vector<WeightOperand> list;
  std::vector<std::vector<float>> host(shapes.size());
  for (size_t t = 0; t < shapes.size(); ++t) {
    const auto [rows, cols] = shapes[t];
    std::vector<float> x = random_matrix(rows, cols, 300 + t);
    for (float& v : x) v *= mags[t];
    if (t == 6) x[5] = std::nanf("");
    if (t == 7) x[0] = -0.f;
    host[t] = x;
    src[t].upload(x);
    out[t].resize(size_t(rows * cols));
    ref[t].resize(size_t(rows * cols));
    list.push_back({src[t].data(), rows, cols, out[t].data(), alpha.data() + t});
  }
  WeightOperandSet set(list, cfg);
  ASSERT_EQ(set.size(), static_cast<int64_t>(shapes.size()));
  for (int run = 0; run < 2; ++run) {
    for (auto& o : out) o.fill_bytes(0xFF);
    set.run();
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> am(shapes.size());
    QUADS_CUDA_CHECK(cudaMemcpy(am.data(), set.amax(), sizeof(float) * am.size(), cudaMemcpyDeviceToHost));
    const std::vector<float> al = alpha.download();
    for (size_t t = 0; t < shapes.size(); ++t) {
      const auto [rows, cols] = shapes[t];
      DeviceQTensor q = make_qtensor(rows, cols, cfg);
      cuda::quantize(src[t].data(), q);
      kern::nvfp4_weight_bf16(q.codes.data(), q.scales.data(), q.amax.data(), rows, cols, ref[t].data(),
                              ref_alpha.data() + t, nullptr);
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const num::QTensor cpu = num::quantize(host[t].data(), rows, cols, cfg);
      EXPECT_TRUE(same_float(am[t], cpu.amax[0])) << "tensor " << t << " run " << run;
      EXPECT_TRUE(same_float(al[t], ref_alpha.download()[t])) << "tensor " << t << " run " << run;
      if (t == 6) {
        EXPECT_TRUE(std::isnan(am[t]));
        continue;  // a NaN amax poisons every scale: the operand is unspecified, as the chain's codes
      }
      EXPECT_EQ(first_mismatch(out[t].download(), ref[t].download()), -1) << "tensor " << t << " run " << run;
    }
  }
  QConfig bad = cfg;
  bad.global = Global::PerRow;
  EXPECT_THROW(WeightOperandSet(list, bad), Error);
  bad = QConfig::nvfp4_weight(true);
  EXPECT_THROW(WeightOperandSet(list, bad), Error);
  bad = cfg;
  bad.stochastic = true;
  EXPECT_THROW(WeightOperandSet(list, bad), Error);
  std::vector<WeightOperand> odd = {list[0]};
  odd[0].src = src[1].data() + 1;  // 4-byte aligned only
  EXPECT_THROW(WeightOperandSet(odd, cfg), Error);
  odd = {list[1]};
  odd[0].cols = 40;
  EXPECT_THROW(WeightOperandSet(odd, cfg), Error);
}

// RAC's residual operand in one kernel against its CPU twin: num::fake_quantize of the activation,
// the residual x - X_eff, the listed blocks gathered (zeros past nsel), num::quantize: the same
// codes, scales and amax, bit for bit. Dense and grouped (a block list per group of rows), per-row
// and static amax, row widths from one block to 4096, nsel from 0 to all blocks.
TEST(CudaQuant, RacQuantizeMatchesCpuChain) {
  QUADS_REQUIRE_GPU();
  QConfig row = QConfig::nvfp4_act();
  row.global = Global::PerRow;
  QConfig fixed = row;
  fixed.global = Global::Static;
  fixed.static_amax = 2.5f;
  struct Shape {
    int64_t cols, nb;
    std::vector<int> rows_per_group;  // one entry: dense
    std::vector<int> nsel;
  };
  const std::vector<Shape> shapes = {{2048, 64, {5}, {64}},       {768, 24, {3}, {17}},
                                     {4096, 128, {70}, {100}},    {16, 1, {2}, {0}},
                                     {2048, 8, {3, 0, 9, 1}, {8, 2, 0, 5}}, {256, 16, {33, 40}, {16, 7}}};
  uint64_t seed = 900;
  for (const Shape& sh : shapes)
    for (const QConfig& act : {row, fixed})
      for (const QConfig& res : {row, fixed}) {
        const bool grouped = sh.rows_per_group.size() > 1;
        const int G = static_cast<int>(sh.rows_per_group.size());
        std::vector<int32_t> eoff(size_t(G) + 1, 0);
        for (int e = 0; e < G; ++e) eoff[size_t(e) + 1] = eoff[size_t(e)] + sh.rows_per_group[size_t(e)];
        const int64_t rows = eoff.back(), cols = sh.cols, nb = sh.nb;
        const std::vector<float> x = random_matrix(rows, cols, seed++);
        std::mt19937 gen(static_cast<uint32_t>(seed++));
        std::vector<int32_t> blocks(size_t(G * nb), 0);  // each group: distinct blocks, padded with 0
        for (int e = 0; e < G; ++e) {
          std::vector<int32_t> all(size_t(cols / 16));
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), gen);
          for (int i = 0; i < sh.nsel[size_t(e)]; ++i) blocks[size_t(e * nb + i)] = all[size_t(i)];
        }
        // the CPU chain
        std::vector<float> xeff(x.size()), gath(size_t(rows * nb * 16), 0.f);
        num::fake_quantize(x.data(), xeff.data(), rows, cols, act);
        for (int e = 0; e < G; ++e)
          for (int64_t r = eoff[size_t(e)]; r < eoff[size_t(e) + 1]; ++r)
            for (int i = 0; i < sh.nsel[size_t(e)]; ++i)
              for (int c = 0; c < 16; ++c) {
                const int64_t src = r * cols + int64_t(blocks[size_t(e * nb + i)]) * 16 + c;
                gath[size_t((r * nb + i) * 16 + c)] = x[size_t(src)] - xeff[size_t(src)];
              }
        const num::QTensor want = num::quantize(gath.data(), rows, nb * 16, res);
        // the fused kernel
        DeviceArray<float> dx(x.size());
        dx.upload(x);
        DeviceArray<int32_t> db(blocks.size()), dn(sh.nsel.size()), de(eoff.size());
        db.upload(blocks);
        dn.upload(std::vector<int32_t>(sh.nsel.begin(), sh.nsel.end()));
        de.upload(eoff);
        DeviceQTensor got = make_qtensor(rows, nb * 16, res);
        ASSERT_TRUE(rac_quantize_supported(act, res));
        rac_quantize(dx.data(), cols, act, db.data(), nb, grouped ? 0 : sh.nsel[0], grouped ? dn.data() : nullptr,
                     grouped ? de.data() : nullptr, G, got);
        const num::QTensor h = to_host(got);
        const std::string what = "cols " + std::to_string(cols) + " rows " + std::to_string(rows) + " act " +
                                 act.describe() + " residual " + res.describe();
        EXPECT_EQ(h.codes, want.codes) << what;
        EXPECT_EQ(h.scales, want.scales) << what;
        ASSERT_EQ(h.amax.size() >= 1, true) << what;
        if (res.global == Global::PerRow) EXPECT_EQ(h.amax, want.amax) << what;
        else EXPECT_EQ(h.amax[0], want.amax[0]) << what;
      }
  QConfig te = QConfig::nvfp4_act();  // per-tensor amax: not row-local, so not supported
  EXPECT_FALSE(rac_quantize_supported(te, row));
  EXPECT_FALSE(rac_quantize_supported(row, te));
}
