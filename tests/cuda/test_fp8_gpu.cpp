// FP8 weights on the GPU (cuda/fp8_gemm.h, GpuLinearMode::FP8): the device dequantization against
// num::dequantize bit for bit, the GEMV and the W8A8 tiles (dense and grouped) against a float64
// GEMM of the CPU's W_eff and X_eff, and the fp8 presets of GpuModel against the CPU model (logits; greedy
// generation is CudaModelGpu.GreedyGenerationMatches). Every test skips itself without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/fp8_gemm.h"
#include "cuda/model_gpu.h"
#include "cuda/quant.h"
#include "cuda_test_util.h"
#include "model/model.h"
#include "numerics/quantize.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;

namespace {

const std::vector<num::Block> kWeightBlocks = {num::Block::PerTensor, num::Block::PerRow, num::Block::B1x128,
                                               num::Block::B128x128};

const char* block_str(num::Block b) {
  switch (b) {
    case num::Block::PerTensor: return "per-tensor";
    case num::Block::PerRow: return "per-row";
    case num::Block::B1x128: return "1x128";
    case num::Block::B128x128: return "128x128";
    default: return "?";
  }
}

// The CPU side of one FP8 linear: the quantized weight, W_eff and X_eff.
struct CpuFp8 {
  num::QTensor wq;
  std::vector<float> weff, xeff;
};
CpuFp8 cpu_fp8(int64_t m, int64_t n, int64_t k, num::Block wb, uint64_t seed) {
  CpuFp8 c;
  const std::vector<float> w = random_matrix(n, k, seed);
  c.wq = num::quantize(w.data(), n, k, num::QConfig::fp8(wb));
  c.weff.resize(size_t(n * k));
  num::dequantize(c.wq, c.weff.data());
  c.xeff = random_matrix(std::max<int64_t>(m, 1), k, seed + 1);
  c.xeff.resize(size_t(m * k));
  if (m > 0) num::fake_quantize(c.xeff.data(), c.xeff.data(), m, k, num::QConfig::fp8(num::Block::B1x128));
  return c;
}

// Row r of y [*, n] against float64 sums over X_eff[xr] . W_eff^T; the bound is the worst case of
// FP32 rounding of this summation (each partial sum of at most k/256*8 + 5 terms in sequence).
void expect_rows_match(const std::vector<float>& y, int64_t yr, const std::vector<float>& xeff, int64_t xr,
                       const std::vector<float>& weff, int64_t n, int64_t k, const std::string& what) {
  const double u = std::ldexp(1.0, -24);
  const double depth = double((k + 255) / 256 * 8 + 6);
  for (int64_t j = 0; j < n; ++j) {
    double s = 0, a = 0;
    for (int64_t c = 0; c < k; ++c) {
      const double p = double(xeff[size_t(xr * k + c)]) * double(weff[size_t(j * k + c)]);
      s += p;
      a += std::fabs(p);
    }
    const double got = y[size_t(yr * n + j)];
    ASSERT_LE(std::fabs(got - s), depth * u * a + 1e-37) << what << " row " << xr << " col " << j << " ref " << s;
  }
}

std::vector<float> cpu_logits(const model::PrecisionConfig& p, const std::vector<int32_t>& ids) {
  model::Weights w = fixture_weights();
  model::Model m(w, p);
  model::KVCache cache(w.cfg, 1);
  model::StepItem it;
  it.tokens = ids;
  it.all_logits = true;
  return m.step(cache, {it});
}

// A GpuModel built with environment variables set (they are read by the constructor).
std::unique_ptr<cuda::GpuModel> model_with_env(const model::PrecisionConfig& p,
                                               const std::vector<std::pair<const char*, const char*>>& env) {
  for (const auto& [k, v] : env) setenv(k, v, 1);
  auto g = std::make_unique<cuda::GpuModel>(fixture_weights(), p);
  for (const auto& [k, v] : env) unsetenv(k);
  return g;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Kernels

TEST(CudaFp8Kernels, DequantizeMatchesCpuBitForBit) {
  QUADS_REQUIRE_GPU();
  for (num::Block wb : kWeightBlocks)
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{200, 272}, {130, 384}, {1, 16}, {257, 136}}) {
      const CpuFp8 c = cpu_fp8(0, n, k, wb, 11 + n + k);
      const cuda::DeviceQTensor dq = cuda::to_device(c.wq);
      const cuda::Fp8Layout g = cuda::fp8_layout(c.wq.cfg, n, k);
      DeviceArray<float> out(size_t(n * k));
      cuda::fp8_dequantize(cuda::fp8_weight(dq), g, out.data());
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const int64_t bad = first_float_mismatch(out.download(), c.weff);
      EXPECT_EQ(bad, -1) << block_str(wb) << " [" << n << ", " << k << "]";
    }
}

TEST(CudaFp8Kernels, LayoutRejectsWhatTheKernelsCannotRead) {
  QUADS_REQUIRE_GPU();
  EXPECT_THROW(cuda::fp8_layout(num::QConfig::fp8(num::Block::B128x128), 64, 20), Error);  // k % 8
  num::QConfig e5 = num::QConfig::fp8(num::Block::PerTensor);
  e5.element = num::Format::E5M2;
  EXPECT_THROW(cuda::fp8_layout(e5, 64, 64), Error);
  EXPECT_THROW(cuda::fp8_layout(num::QConfig::parse("nvfp4"), 64, 64), Error);
}

TEST(CudaFp8Kernels, GemvMatchesFloat64Gemm) {
  QUADS_REQUIRE_GPU();
  const std::vector<int64_t> ms = {1, 2, 7, 8, 9, 16, 20};
  for (num::Block wb : kWeightBlocks)
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{200, 272}, {33, 384}, {130, 16}, {5, 400}})
      for (int64_t m : ms) {
        const CpuFp8 c = cpu_fp8(m, n, k, wb, 100 * m + n + k);
        const cuda::DeviceQTensor dq = cuda::to_device(c.wq);
        DeviceArray<float> x, y(size_t(m * n));
        x.upload(c.xeff);
        y.fill_bytes(0xFF);  // NaN: every output must be written
        cuda::fp8_gemv(x.data(), m, cuda::fp8_weight(dq), cuda::fp8_layout(c.wq.cfg, n, k), y.data());
        QUADS_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> got = y.download();
        const std::string what = std::string(block_str(wb)) + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                                 " k=" + std::to_string(k);
        for (int64_t r = 0; r < m; ++r) {
          expect_rows_match(got, r, c.xeff, r, c.weff, n, k, what);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
}

// Five experts with 3, 0, 7, 1 and 9 rows (one empty, one over the 8-row pass), each its own
// weight; the rows of each group against that expert's float64 GEMM.
TEST(CudaFp8Kernels, GroupedGemvMatchesPerExpertFloat64Gemm) {
  QUADS_REQUIRE_GPU();
  const std::vector<int32_t> eoff = {0, 3, 3, 10, 11, 20};
  const int E = 5;
  const int64_t M = eoff.back();
  for (num::Block wb : {num::Block::B128x128, num::Block::PerRow})
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{72, 400}, {200, 144}})
    for (int64_t max_rows : {int64_t(0), M}) {  // no bound (8-row passes) / the bound the model passes
      std::vector<CpuFp8> cs;
      std::vector<cuda::DeviceQTensor> dqs;
      std::vector<cuda::Fp8Weight> table;
      std::vector<float> x(size_t(M * k));
      for (int e = 0; e < E; ++e) {
        const int64_t rows = eoff[e + 1] - eoff[e];
        cs.push_back(cpu_fp8(rows, n, k, wb, 7000 + 31 * e + n));
        std::copy(cs.back().xeff.begin(), cs.back().xeff.end(), x.begin() + eoff[e] * k);
        dqs.push_back(cuda::to_device(cs.back().wq));
      }
      for (int e = 0; e < E; ++e) table.push_back(cuda::fp8_weight(dqs[e]));
      DeviceArray<float> xd, y(size_t(M * n));
      DeviceArray<int32_t> eoffd;
      DeviceArray<cuda::Fp8Weight> tabd;
      xd.upload(x);
      eoffd.upload(eoff);
      tabd.upload(table);
      y.fill_bytes(0xFF);
      cuda::fp8_gemv_grouped(xd.data(), tabd.data(), cuda::fp8_layout(cs[0].wq.cfg, n, k), E, eoffd.data(), max_rows,
                             y.data());
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> got = y.download();
      for (int e = 0; e < E; ++e)
        for (int32_t r = eoff[e]; r < eoff[e + 1]; ++r) {
          expect_rows_match(got, r, cs[e].xeff, r - eoff[e], cs[e].weff, n, k,
                            std::string(block_str(wb)) + " expert " + std::to_string(e));
          if (::testing::Test::HasFatalFailure()) return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// W8A8 tiles (fp8_gemm, fp8_gemm_grouped)

namespace {

// One W8A8 product on both sides: CPU codes of X and W (so the GPU reads the same codes), X_eff
// and W_eff (num::dequantize), and the device tensors.
struct W8A8 {
  num::QTensor xq, wq;
  std::vector<float> xeff, weff;
  cuda::DeviceQTensor dx, dw;
};
W8A8 w8a8(int64_t m, int64_t n, int64_t k, num::Block wb, num::Block ab, uint64_t seed) {
  W8A8 c;
  const std::vector<float> w = random_matrix(n, k, seed), x = random_matrix(std::max<int64_t>(m, 1), k, seed + 1);
  c.wq = num::quantize(w.data(), n, k, num::QConfig::fp8(wb));
  c.xq = num::quantize(x.data(), std::max<int64_t>(m, 1), k, num::QConfig::fp8(ab));
  c.weff.resize(size_t(n * k));
  c.xeff.resize(size_t(std::max<int64_t>(m, 1) * k));
  num::dequantize(c.wq, c.weff.data());
  num::dequantize(c.xq, c.xeff.data());
  c.dx = cuda::to_device(c.xq);
  c.dw = cuda::to_device(c.wq);
  return c;
}

// Row xr of X_eff . W_eff^T in float64 against row yr of y: the tiles sum exact code products
// per 128-block and scale block sums, so they differ from any FP32 order by a few units of
// 2^-24 of sum |x w| per block; 1e-5 of it is far above that and far below a wrong index.
void expect_rows_close(const std::vector<float>& y, int64_t yr, const std::vector<float>& xeff, int64_t xr,
                       const std::vector<float>& weff, int64_t n, int64_t k, const std::string& what) {
  for (int64_t j = 0; j < n; ++j) {
    double s = 0, a = 0;
    for (int64_t c = 0; c < k; ++c) {
      const double p = double(xeff[size_t(xr * k + c)]) * double(weff[size_t(j * k + c)]);
      s += p;
      a += std::fabs(p);
    }
    const double got = y[size_t(yr * n + j)];
    ASSERT_LE(std::fabs(got - s), 1e-5 * a + 1e-35) << what << " row " << xr << " col " << j << " ref " << s;
  }
}

const char* tile_str(cuda::Fp8Tile t) {
  switch (t) {
    case cuda::Fp8Tile::M16: return "M16";
    case cuda::Fp8Tile::M64: return "M64";
    case cuda::Fp8Tile::M128: return "M128";
    default: return "auto";
  }
}

}  // namespace

// Every tile and weight layout, 1x128 and per-tensor activations, M from 1 to 300, N not a
// multiple of 128, K a multiple of 16 but not of 128 (a zero-filled tail block), split K.
TEST(CudaFp8Tiles, DenseMatchesFloat64Gemm) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t m, n, k;
  };
  const std::vector<Case> cases = {{1, 200, 272}, {17, 130, 400}, {64, 33, 128}, {130, 256, 144}, {300, 72, 16}};
  for (num::Block ab : {num::Block::B1x128, num::Block::PerTensor})
    for (num::Block wb : kWeightBlocks)
      for (const Case& cs : cases) {
        const W8A8 c = w8a8(cs.m, cs.n, cs.k, wb, ab, 31 * cs.m + cs.n + cs.k);
        const cuda::Fp8Act a = cuda::fp8_act(c.dx);
        const cuda::Fp8Layout g = cuda::fp8_layout(c.wq.cfg, cs.n, cs.k);
        DeviceArray<float> y(size_t(cs.m * cs.n));
        for (cuda::Fp8Tile t : {cuda::Fp8Tile::Auto, cuda::Fp8Tile::M16, cuda::Fp8Tile::M64, cuda::Fp8Tile::M128})
          for (int splits : {0, 1, 3}) {
            y.fill_bytes(0xFF);  // NaN: every output must be written
            cuda::fp8_gemm(a, cuda::fp8_weight(c.dw), g, y.data(), nullptr, splits, t);
            QUADS_CUDA_CHECK(cudaDeviceSynchronize());
            const std::vector<float> got = y.download();
            const std::string what = std::string("act ") + block_str(ab) + " weight " + block_str(wb) +
                                     " m=" + std::to_string(cs.m) + " n=" + std::to_string(cs.n) +
                                     " k=" + std::to_string(cs.k) + " tile " + tile_str(t) +
                                     " splits " + std::to_string(splits);
            for (int64_t r = 0; r < cs.m; ++r) {
              expect_rows_close(got, r, c.xeff, r, c.weff, cs.n, cs.k, what);
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
      }
}

// Split K sums its partials in a fixed order: two runs give the same bits; a row slice of the
// operand (fp8_act_rows) gives the rows of the whole call bit for bit.
TEST(CudaFp8Tiles, SplitKIsDeterministicAndSlicesAgree) {
  QUADS_REQUIRE_GPU();
  const int64_t m = 40, n = 300, k = 2048;
  const W8A8 c = w8a8(m, n, k, num::Block::B128x128, num::Block::B1x128, 77);
  const cuda::Fp8Act a = cuda::fp8_act(c.dx);
  const cuda::Fp8Layout g = cuda::fp8_layout(c.wq.cfg, n, k);
  DeviceArray<float> y1(size_t(m * n)), y2(size_t(m * n)), ys(size_t(10 * n));
  for (int splits : {0, 5, 16}) {
    y1.fill_bytes(0xFF);
    y2.fill_bytes(0);
    cuda::fp8_gemm(a, cuda::fp8_weight(c.dw), g, y1.data(), nullptr, splits, cuda::Fp8Tile::M16);
    cuda::fp8_gemm(a, cuda::fp8_weight(c.dw), g, y2.data(), nullptr, splits, cuda::Fp8Tile::M16);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> r1 = y1.download();
    EXPECT_EQ(first_float_mismatch(r1, y2.download()), -1) << "splits " << splits;
    for (int64_t r = 0; r < m; ++r) {
      expect_rows_close(r1, r, c.xeff, r, c.weff, n, k, "splits " + std::to_string(splits));
      if (::testing::Test::HasFatalFailure()) return;
    }
    cuda::fp8_gemm(cuda::fp8_act_rows(a, 13, 10), cuda::fp8_weight(c.dw), g, ys.data(), nullptr, splits,
                   cuda::Fp8Tile::M16);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> part(r1.begin() + 13 * n, r1.begin() + 23 * n);
    EXPECT_EQ(first_float_mismatch(ys.download(), part), -1) << "rows 13..23, splits " << splits;
  }
}

// Experts with 3, 0, 37, 1, 20 and 0 rows (empty ones, one past a 16-row tile), then 70 experts
// of 0 .. 5 rows and one of 40 (the kernel finds a tile's expert 32 experts at a time), each its
// own weight: the grouped call against float64 per expert, and bit for bit against a dense call
// per expert with the same tile and splits.
TEST(CudaFp8Tiles, GroupedMatchesPerExpertCalls) {
  QUADS_REQUIRE_GPU();
  std::vector<int32_t> many = {0};
  for (int e = 0; e < 70; ++e) many.push_back(many.back() + (e == 45 ? 40 : (e * 7 + 3) % 6));
  for (const std::vector<int32_t>& eoff : {std::vector<int32_t>{0, 3, 3, 40, 41, 61, 61}, many})
  for (num::Block wb : {num::Block::B128x128, num::Block::PerRow})
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{200, 400}, {72, 144}}) {
      const int E = static_cast<int>(eoff.size()) - 1;
      const int64_t M = eoff.back(), max_rows = 40;
      if (E > 6 && n == 200) continue;  // the many-expert case at one shape
      // one operand for all rows (1x128: per-row scales, as the model's shared operand)
      const W8A8 all = w8a8(M, n, k, wb, num::Block::B1x128, 500 + n);
      std::vector<W8A8> ws;
      std::vector<cuda::Fp8Weight> table;
      for (int e = 0; e < E; ++e) ws.push_back(w8a8(1, n, k, wb, num::Block::B1x128, 900 + 13 * e + n));
      for (int e = 0; e < E; ++e) table.push_back(cuda::fp8_weight(ws[e].dw));
      DeviceArray<int32_t> eoffd;
      DeviceArray<cuda::Fp8Weight> tabd;
      eoffd.upload(eoff);
      tabd.upload(table);
      const cuda::Fp8Act a = cuda::fp8_act(all.dx);
      const cuda::Fp8Layout g = cuda::fp8_layout(ws[0].wq.cfg, n, k);
      DeviceArray<float> y(size_t(M * n)), yd(size_t(M * n));
      for (cuda::Fp8Tile t : {cuda::Fp8Tile::Auto, cuda::Fp8Tile::M16, cuda::Fp8Tile::M64, cuda::Fp8Tile::M128})
        for (int splits : {0, 1, 2}) {
          const std::string what = std::string(block_str(wb)) + " n=" + std::to_string(n) + " k=" +
                                   std::to_string(k) + " tile " + tile_str(t) + " splits " + std::to_string(splits);
          y.fill_bytes(0xFF);
          cuda::fp8_gemm_grouped(a, tabd.data(), g, E, eoffd.data(), max_rows, y.data(), nullptr, splits, t);
          QUADS_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<float> got = y.download();
          for (int e = 0; e < E; ++e)
            for (int32_t r = eoff[e]; r < eoff[e + 1]; ++r) {
              expect_rows_close(got, r, all.xeff, r, ws[e].weff, n, k, what + " expert " + std::to_string(e));
              if (::testing::Test::HasFatalFailure()) return;
            }
          if (splits == 0 || t == cuda::Fp8Tile::Auto) continue;  // the split and tile choices differ
          yd.fill_bytes(0xFF);
          for (int e = 0; e < E; ++e) {
            const int64_t rows = eoff[e + 1] - eoff[e];
            if (rows == 0) continue;
            cuda::fp8_gemm(cuda::fp8_act_rows(a, eoff[e], rows), table[e], g, yd.data() + eoff[e] * n, nullptr,
                           splits, t);
          }
          QUADS_CUDA_CHECK(cudaDeviceSynchronize());
          EXPECT_EQ(first_float_mismatch(got, yd.download()), -1) << what;
        }
    }
}

TEST(CudaFp8Tiles, RejectsWhatTheTilesCannotRead) {
  QUADS_REQUIRE_GPU();
  const W8A8 c = w8a8(4, 32, 64, num::Block::PerTensor, num::Block::B1x128, 5);
  const cuda::Fp8Act a = cuda::fp8_act(c.dx);
  DeviceArray<float> y(size_t(4 * 32));
  // inner dimensions differ
  EXPECT_THROW(cuda::fp8_gemm(a, cuda::fp8_weight(c.dw), cuda::fp8_layout(c.wq.cfg, 32, 48), y.data()), Error);
  // K % 16
  cuda::Fp8Act a8 = a;
  a8.g.k = 56;
  EXPECT_THROW(cuda::fp8_gemm(a8, cuda::fp8_weight(c.dw), cuda::fp8_layout(c.wq.cfg, 32, 56), y.data()), Error);
  EXPECT_THROW(cuda::fp8_act_rows(a, 2, 3), Error);  // past the operand's rows
}

// ---------------------------------------------------------------------------------------------
// The model on the fixture

// fp8 (128x128 / 1x128) and fp8-tensor: the GPU holds the CPU's codes and scales, so W_eff is the
// same; activations are fake-quantized from FP32 inputs that differ in the last bits (a code can
// flip at a rounding boundary), the rest is summation order. Routes: the W8A8 tiles (this
// 24-token prefill: dense and grouped experts), the GEMVs (decode one token at a time), tiles for
// everything at decode too (QUADS_GPU_FP8_GEMV_ROWS=0, QUADS_GPU_FP8_GROUPED_GEMV_TOKENS=0: the
// captured decode graphs with tiles), per-expert dense tiles (QUADS_GPU_MOE=legacy), and W_eff
// dequantized for SGEMMs with per-expert GEMMs (QUADS_GPU_FP8_TILES=0).
TEST(CudaFp8Model, LogitsMatchCpu) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  for (const std::string preset : {"fp8", "fp8-tensor"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    const auto cpu = cpu_logits(prec, ids);
    cuda::GpuModel g(fixture_weights(), prec);
    EXPECT_EQ(g.linear_mode("model.layers.0.self_attn.q_proj"), cuda::GpuLinearMode::FP8) << preset;
    EXPECT_EQ(g.linear_mode("model.layers.1.mlp.experts.3.down_proj"), cuda::GpuLinearMode::FP8) << preset;
    EXPECT_EQ(g.linear_mode("lm_head"), cuda::GpuLinearMode::BF16) << preset;
    const auto whole = gpu_logits(g, ids, 1000);
    // fp8-tensor scales activations per step (the whole batch): one token at a time is another input.
    const auto by_token = preset == "fp8" ? gpu_logits(g, ids, 1) : whole;
    auto tl = model_with_env(prec, {{"QUADS_GPU_FP8_GEMV_ROWS", "0"}, {"QUADS_GPU_FP8_GROUPED_GEMV_TOKENS", "0"}});
    const auto tiles_tok = preset == "fp8" ? gpu_logits(*tl, ids, 1) : gpu_logits(*tl, ids, 1000);
    auto pe = model_with_env(prec, {{"QUADS_GPU_FP8_GEMV_ROWS", "0"}, {"QUADS_GPU_MOE", "legacy"}});
    const auto per_expert = gpu_logits(*pe, ids, 1000);
    auto sg = model_with_env(
        prec, {{"QUADS_GPU_FP8_GEMV_ROWS", "0"}, {"QUADS_GPU_MOE", "legacy"}, {"QUADS_GPU_FP8_TILES", "0"}});
    const auto sgemm = gpu_logits(*sg, ids, 1000);
    const double e1 = rel_l2(whole, cpu), e2 = rel_l2(by_token, cpu), e3 = rel_l2(sgemm, cpu);
    const double e4 = rel_l2(tiles_tok, cpu), e5 = rel_l2(per_expert, cpu);
    std::printf("%s: rel L2 vs the CPU model: prefill (tiles) %.3g, decode (GEMV) %.3g, SGEMM/per-expert %.3g, "
                "decode (tiles) %.3g, per-expert tiles %.3g\n",
                preset.c_str(), e1, e2, e3, e4, e5);
    EXPECT_LT(e1, 1e-3) << preset;
    EXPECT_LT(e2, 1e-3) << preset;
    EXPECT_LT(e3, 1e-3) << preset;
    EXPECT_LT(e4, 1e-3) << preset;
    EXPECT_LT(e5, 1e-3) << preset;
    EXPECT_EQ(gpu_logits(g, ids, 1000), whole) << preset << ": not repeatable";
  }
  // What is read per use: codes (1 byte) and scales, not a float32 W_eff.
  cuda::GpuModel g8(fixture_weights(), model::PrecisionConfig::preset("fp8"));
  cuda::GpuModel g32(fixture_weights(), model::PrecisionConfig::preset("fp32"));
  const model::ModelConfig& c = fixture_weights().cfg;
  const double experts = double(c.num_hidden_layers) * c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size;
  EXPECT_LT(double(g8.weight_bytes()), double(g32.weight_bytes()) - 2.9 * experts);
}

