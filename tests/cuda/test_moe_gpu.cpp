// The device MoE path of cuda::GpuModel: routing against cpu::moe_permute, the grouped expert GEMMs
// against per-expert GEMMs (ragged groups, empty experts), and CUDA graph replay against eager steps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>

#include "common/fixtures.h"
#include "cpu/ops.h"
#include "cuda/check.h"
#include "cuda/gemm.h"
#include "cuda/model_gpu.h"
#include "cuda/model_kernels.h"
#include "cuda/quant.h"
#include "cuda_test_util.h"
#include "model/model.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;

namespace {

// Row offsets of groups of the given sizes.
std::vector<int32_t> offsets_of(const std::vector<int>& sizes) {
  std::vector<int32_t> o(sizes.size() + 1, 0);
  for (size_t e = 0; e < sizes.size(); ++e) o[e + 1] = o[e] + sizes[e];
  return o;
}

// Grouped W4A4 operands: X [R, K] quantized per row (NVFP4), one random NVFP4 weight [N, K] per
// group (w_row: per-row weight amax), the device table and offsets.
struct GroupedW4A4 {
  std::vector<int> sizes;
  std::vector<int32_t> off;
  int E = 0, max_rows = 0;
  int64_t R = 0, N = 0, K = 0;
  num::QConfig xc;
  cuda::DeviceQTensor xq;
  cuda::Nvfp4View xv;
  std::vector<cuda::DeviceQTensor> wq;
  DeviceArray<cuda::Nvfp4Weight> dtab;
  DeviceArray<int32_t> deoff;

  GroupedW4A4(const std::vector<int>& sz, int64_t n, int64_t k, bool w_row, uint64_t x_seed, uint64_t w_seed)
      : sizes(sz), off(offsets_of(sz)), E(static_cast<int>(sz.size())), N(n), K(k) {
    R = off[E];
    for (int s : sizes) max_rows = std::max(max_rows, s);
    xc = num::QConfig::nvfp4_act();
    xc.global = num::Global::PerRow;
    cuda::DeviceArray<float> dx = dev(random_matrix(R, K, x_seed));
    xq = cuda::make_qtensor(R, K, xc);
    cuda::quantize(dx.data(), xq);
    xv = cuda::nvfp4_view(xq, "x");
    num::QConfig wc = num::QConfig::nvfp4_weight(false);
    if (w_row) wc.global = num::Global::PerRow;
    std::vector<cuda::Nvfp4Weight> tab;
    for (int e = 0; e < E; ++e) {
      DeviceArray<float> dw = dev(random_matrix(N, K, w_seed + e));
      wq.push_back(cuda::make_qtensor(N, K, wc));
      cuda::quantize(dw.data(), wq.back());
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const cuda::Nvfp4View v = cuda::nvfp4_view(wq.back(), "w");
      tab.push_back({v.codes, v.scales, v.amax});
    }
    dtab = dev(tab);
    deoff = dev(off);
  }
  // group e's rows of an operand with k columns laid out as X
  cuda::Nvfp4View rows_of(const cuda::Nvfp4View& v, int e, int64_t k) const {
    cuda::Nvfp4View xe = v;
    xe.codes += off[e] * k / 2;
    xe.scales += off[e] * k / 16;
    xe.amax += off[e];
    xe.rows = sizes[e];
    return xe;
  }
  std::string what() const { return std::to_string(E) + " groups, N " + std::to_string(N) + " K " + std::to_string(K); }
};

// A small random MoE model whose every linear fits the W4A4 kernels (K % 64 == 0) and whose
// head_dim the tiled attention supports (the fixture's 16 fits neither).
model::ModelConfig small_moe_config() {
  model::ModelConfig c;
  c.vocab_size = 64;
  c.hidden_size = 128;
  c.moe_intermediate_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.max_position_embeddings = 512;
  return c;
}

}  // namespace

TEST(CudaMoe, RouteMatchesCpuPermute) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int T, k, E;
    int mode;  // 0: distinct random experts per token, 1: few experts used (most empty), 2: all on one
  };
  // (3000 x 8 and 2049 x 3: several 4096-entry rounds of the route kernels, and a ragged tail)
  for (const Case c : {Case{1, 8, 64, 0}, Case{37, 4, 16, 1}, Case{300, 8, 64, 0}, Case{700, 2, 8, 2}, Case{5, 1, 3, 1},
                       Case{3000, 8, 64, 0}, Case{2049, 3, 40, 1}}) {
    std::mt19937 rng(1234 + c.T);
    std::vector<int32_t> idx(size_t(c.T) * c.k);
    for (int t = 0; t < c.T; ++t) {
      std::vector<int32_t> ex(c.E);
      for (int e = 0; e < c.E; ++e) ex[e] = e;
      std::shuffle(ex.begin(), ex.end(), rng);
      for (int s = 0; s < c.k; ++s) {
        int32_t v = ex[s];
        if (c.mode == 1) v = std::vector<int32_t>{0, c.E - 1, c.E / 2}[rng() % 3];
        if (c.mode == 2) v = c.E / 3;
        idx[size_t(t) * c.k + s] = v;
      }
    }
    const int64_t n = int64_t(c.T) * c.k;
    std::vector<int64_t> off(c.E + 1);
    std::vector<int32_t> perm(n), inv(n);
    cpu::moe_permute(idx.data(), c.T, c.k, c.E, off.data(), perm.data(), inv.data());
    DeviceArray<int32_t> di = dev(idx), counts(c.E), eoff(c.E + 1), dp(n), dv(n), bad(1);
    DeviceArray<unsigned long long> active(1);
    bad.fill_bytes(0);
    active.fill_bytes(0);
    cuda::kern::moe_route(di.data(), n, c.E, counts.data(), eoff.data(), dp.data(), dv.data(), active.data(), bad.data(),
                          nullptr);
    const auto geoff = eoff.download();
    for (int e = 0; e <= c.E; ++e) ASSERT_EQ(geoff[e], off[e]) << "T " << c.T << " expert " << e;
    EXPECT_EQ(first_mismatch(dp.download(), perm), -1) << "T " << c.T;
    EXPECT_EQ(first_mismatch(dv.download(), inv), -1) << "T " << c.T;
    int used = 0;
    for (int e = 0; e < c.E; ++e) used += off[e + 1] > off[e];
    EXPECT_EQ(active.download()[0], static_cast<unsigned long long>(used));
    EXPECT_EQ(bad.download()[0], 0);
  }
  // An id out of range is reported, and every index stays in range.
  std::vector<int32_t> idx = {0, 3, 7, 1, -1, 2};
  DeviceArray<int32_t> di = dev(idx), counts(4), eoff(5), dp(6), dv(6), bad(1);
  bad.fill_bytes(0);
  cuda::kern::moe_route(di.data(), 6, 4, counts.data(), eoff.data(), dp.data(), dv.data(), nullptr, bad.data(), nullptr);
  EXPECT_EQ(bad.download()[0], 1);
  for (int32_t v : dp.download()) EXPECT_TRUE(v >= 0 && v < 6);
  for (int32_t v : dv.download()) EXPECT_TRUE(v >= 0 && v < 6);
}

TEST(CudaMoe, GroupedW4A4EqualsPerExpertGemm) {
  QUADS_REQUIRE_GPU();
  const int64_t N = 200;
  struct Case {
    std::vector<int> sizes;
    int64_t K;
    int splits;  // K splits (the grouped call with few rows would pick 2 for the last case itself)
  };
  // max_rows picks the tile: 40 -> 16-row tiles, 300 -> 128-row tiles.
  for (const Case& c : {Case{{3, 0, 17, 1, 0, 40}, 256, 1}, Case{{0, 300, 5, 0, 129}, 256, 1},
                        Case{{1, 0, 2, 0, 0, 1}, 512, 2}}) {
    const std::vector<int>& sizes = c.sizes;
    const int64_t K = c.K;
    const int E = static_cast<int>(sizes.size());
    const std::vector<int32_t> off = offsets_of(sizes);
    const int64_t R = off[E];
    int max_rows = 0;
    for (int s : sizes) max_rows = std::max(max_rows, s);
    num::QConfig xc = num::QConfig::nvfp4_act();
    xc.global = num::Global::PerRow;
    const std::vector<float> x = random_matrix(R, K, 7);
    cuda::DeviceArray<float> dx = dev(x);
    cuda::DeviceQTensor xq = cuda::make_qtensor(R, K, xc);
    cuda::quantize(dx.data(), xq);
    const cuda::Nvfp4View xv = cuda::nvfp4_view(xq, "x");
    std::vector<cuda::DeviceQTensor> wq;
    std::vector<cuda::Nvfp4Weight> tab;
    for (int e = 0; e < E; ++e) {
      const std::vector<float> w = random_matrix(N, K, 100 + e);
      cuda::DeviceArray<float> dw = dev(w);
      wq.push_back(cuda::make_qtensor(N, K, num::QConfig::nvfp4_weight(false)));
      cuda::quantize(dw.data(), wq.back());
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    }
    for (int e = 0; e < E; ++e) {
      const cuda::Nvfp4View v = cuda::nvfp4_view(wq[e], "w");
      tab.push_back({v.codes, v.scales, v.amax});
    }
    DeviceArray<cuda::Nvfp4Weight> dtab = dev(tab);
    DeviceArray<int32_t> deoff = dev(off);
    DeviceArray<float> y(R * N), yref(R * N);
    // Many rows: each 128-row tile (Auto takes the warpgroup one on Hopper), grouped and per expert.
    std::vector<cuda::W4A4Tile> tiles = {cuda::W4A4Tile::Auto};
    if (max_rows > 64) {
      tiles = {cuda::W4A4Tile::M128};
      if (cuda::w4a4_wgmma_available()) tiles.insert(tiles.end(), {cuda::W4A4Tile::Wg128, cuda::W4A4Tile::Wg256});
    }
    std::vector<float> ref;
    for (cuda::W4A4Tile tile : tiles) {
      y.fill_bytes(0xFF);  // NaN: every row must be written
      cuda::w4a4_gemm_grouped(xv, dtab.data(), false, N, E, deoff.data(), max_rows, y.data(), nullptr, c.splits, tile);
      cuda::W4A4Options opt;
      opt.splits = c.splits;
      opt.tile = max_rows <= 64 ? cuda::W4A4Tile::M16 : tile;
      for (int e = 0; e < E; ++e) {
        if (sizes[e] == 0) continue;
        cuda::Nvfp4View xe = xv;
        xe.codes += off[e] * K / 2;
        xe.scales += off[e] * K / 16;
        xe.amax += off[e];
        xe.rows = sizes[e];
        cuda::w4a4_gemm_emulated(xe, cuda::nvfp4_view(wq[e], "w"), yref.data() + off[e] * N, false, nullptr, opt);
      }
      ref = yref.download();
      const std::vector<float> same = y.download();
      double d = 0, m = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        d = std::max(d, std::fabs(double(same[i]) - ref[i]));
        m = std::max(m, std::fabs(double(ref[i])));
      }
      // A row's sum does not depend on where its tile starts (each output is its own MMA dot
      // product over the same k-steps), so the bits agree; the deviation says how far off if not.
      EXPECT_EQ(first_float_mismatch(same, ref), -1)
          << "max rows " << max_rows << ", tile " << static_cast<int>(tile) << ": max |diff| " << d << " of max |y| " << m;
    }
    // the split count and tile chosen by the call itself: the same sums up to their grouping
    cuda::w4a4_gemm_grouped(xv, dtab.data(), false, N, E, deoff.data(), max_rows, y.data());
    const std::vector<float> got = y.download();
    double err = 0, mag = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      err = std::max(err, std::fabs(double(got[i]) - ref[i]));
      mag = std::max(mag, std::fabs(double(ref[i])));
    }
    EXPECT_LE(err, 1e-5 * mag) << "max rows " << max_rows;
  }
}

TEST(CudaMoe, GroupedBf16MatchesCpu) {
  QUADS_REQUIRE_GPU();
  const int64_t K = 264, N = 70;  // K not a multiple of 256: the lanes' last step is partial
  // <= 16 rows: K split over the warps; more: 16-row chunks over the warps (70: five chunks)
  const std::vector<int> sizes = {0, 9, 1, 0, 20, 16, 70};
  const int E = static_cast<int>(sizes.size());
  const std::vector<int32_t> off = offsets_of(sizes);
  const int64_t R = off[E];
  const std::vector<float> xf = random_matrix(R, K, 3);
  std::vector<uint16_t> xb(xf.size());
  for (size_t i = 0; i < xf.size(); ++i) xb[i] = to_bf16(xf[i]);
  std::vector<std::vector<uint16_t>> wb(E);
  std::vector<DeviceArray<uint16_t>> dw;
  std::vector<const uint16_t*> tab;
  for (int e = 0; e < E; ++e) {
    const std::vector<float> w = random_matrix(N, K, 50 + e);
    for (float v : w) wb[e].push_back(to_bf16(v));
    dw.push_back(dev(wb[e]));
  }
  for (auto& a : dw) tab.push_back(a.data());
  DeviceArray<const uint16_t*> dtab = dev(tab);
  DeviceArray<uint16_t> dx = dev(xb);
  DeviceArray<int32_t> deoff = dev(off);
  DeviceArray<float> y(R * N);
  y.fill_bytes(0xFF);
  cuda::kern::gemm_bf16_grouped(dx.data(), dtab.data(), N, K, E, deoff.data(), y.data(), nullptr);
  const std::vector<float> got = y.download();
  for (int e = 0; e < E; ++e)
    for (int32_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0, a = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = double(from_bf16(xb[r * K + k])) * double(from_bf16(wb[e][n * K + k]));
          s += p;
          a += std::fabs(p);
        }
        ASSERT_NEAR(got[r * N + n], s, 2e-6 * a + 1e-30) << "expert " << e << " row " << r << " col " << n;
      }
  // deterministic
  cuda::kern::gemm_bf16_grouped(dx.data(), dtab.data(), N, K, E, deoff.data(), y.data(), nullptr);
  EXPECT_EQ(first_float_mismatch(y.download(), got), -1);
}

TEST(CudaMoe, GroupedF32MatchesCpu) {
  QUADS_REQUIRE_GPU();
  const int64_t K = 40, N = 33;  // K < 256: most lanes idle
  const std::vector<int> sizes = {2, 0, 11};
  const int E = static_cast<int>(sizes.size());
  const std::vector<int32_t> off = offsets_of(sizes);
  const int64_t R = off[E];
  const std::vector<float> x = random_matrix(R, K, 5);
  std::vector<std::vector<float>> w(E);
  std::vector<DeviceArray<float>> dw;
  std::vector<const float*> tab;
  for (int e = 0; e < E; ++e) {
    w[e] = random_matrix(N, K, 70 + e);
    dw.push_back(dev(w[e]));
  }
  for (auto& a : dw) tab.push_back(a.data());
  DeviceArray<const float*> dtab = dev(tab);
  DeviceArray<float> dx = dev(x);
  DeviceArray<int32_t> deoff = dev(off);
  DeviceArray<float> y(R * N);
  y.fill_bytes(0xFF);
  cuda::kern::gemm_f32_grouped(dx.data(), dtab.data(), N, K, E, deoff.data(), y.data(), nullptr);
  const std::vector<float> got = y.download();
  for (int e = 0; e < E; ++e)
    for (int32_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0, a = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = double(x[r * K + k]) * double(w[e][n * K + k]);
          s += p;
          a += std::fabs(p);
        }
        ASSERT_NEAR(got[r * N + n], s, 2e-6 * a + 1e-30) << "expert " << e << " row " << r << " col " << n;
      }
}

namespace {

// Logits of `steps` decode steps over two slots (T = 2 per step), after a 3-token prefill.
std::vector<float> decode_logits(cuda::GpuModel& g, int steps, double* bytes, int64_t* graph_steps = nullptr) {
  g.reset_cache(2, 64);
  g.reset_stats();
  std::vector<float> out;
  model::StepItem a, b;
  a.slot = 0;
  b.slot = 1;
  a.tokens = {1, 5, 9};
  b.tokens = {2, 4, 6};
  auto lg = g.step({a, b});
  out.insert(out.end(), lg.begin(), lg.end());
  for (int i = 0; i < steps; ++i) {
    a.tokens = {(7 * i + 3) % 50};
    b.tokens = {(11 * i + 1) % 50};
    lg = g.step({a, b});
    out.insert(out.end(), lg.begin(), lg.end());
  }
  if (bytes) *bytes = g.stats().weight_bytes;
  if (graph_steps) *graph_steps = g.stats().graph_steps;
  return out;
}

// A model built with the environment switch `var` set to `value` (GpuModel reads its switches when
// it is built); the variable is unset again however the construction ends.
std::unique_ptr<cuda::GpuModel> model_with_env(const char* var, const char* value, const model::Weights& w,
                                               const model::PrecisionConfig& p) {
  setenv(var, value, 1);
  struct Unset {
    const char* v;
    ~Unset() { unsetenv(v); }
  } unset{var};
  return std::make_unique<cuda::GpuModel>(w, p);
}

// Decode logits of n slots (stats reset first): a 3-token prompt each, then 6 steps of one token.
std::vector<float> decode_batch(cuda::GpuModel& g, int n) {
  g.reset_cache(n, 64);
  g.reset_stats();
  std::vector<model::StepItem> items(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    items[size_t(i)].slot = i;
    items[size_t(i)].tokens = {i + 1, (2 * i + 3) % 50, 7};
  }
  std::vector<float> out = g.step(items);
  for (int s = 0; s < 6; ++s) {
    for (int i = 0; i < n; ++i) items[size_t(i)].tokens = {(3 * s + 5 * i + 1) % 50};
    const std::vector<float> lg = g.step(items);
    out.insert(out.end(), lg.begin(), lg.end());
  }
  return out;
}

}  // namespace

// Graph replay gives the eager step's bits; the device MoE path agrees with the host-routed one.
TEST(CudaModelGpu, GraphReplayEqualsEagerAndLegacyPath) {
  QUADS_REQUIRE_GPU();
  for (const std::string preset : {"fp32", "bf16", "nvfp4"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    const auto eager_m = model_with_env("QUADS_GPU_GRAPHS", "0", fixture_weights(), prec);
    cuda::GpuModel& eager = *eager_m;
    cuda::GpuModel graph(fixture_weights(), prec);
    const auto legacy_m = model_with_env("QUADS_GPU_MOE", "legacy", fixture_weights(), prec);
    cuda::GpuModel& legacy = *legacy_m;
    double be = 0, bg = 0, bl = 0;
    int64_t ge = -1, gg = -1;
    const auto le = decode_logits(eager, 6, &be, &ge);
    const auto lg = decode_logits(graph, 6, &bg, &gg);
    EXPECT_EQ(ge, 0) << preset;
    EXPECT_EQ(gg, 5) << preset << ": decode steps 2..6 run as a graph (captured at 2, replayed after)";
    const auto ll = decode_logits(legacy, 6, &bl);
    EXPECT_EQ(first_float_mismatch(lg, le), -1) << preset;
    const auto lg2 = decode_logits(graph, 6, nullptr);  // replays only
    EXPECT_EQ(first_float_mismatch(lg2, le), -1) << preset;
    const double e = rel_l2(lg, ll);
    std::printf("%s: device MoE path vs host-routed path: rel L2 of the logits %.3g\n", preset.c_str(), e);
    EXPECT_LT(e, 1e-3) << preset;
    EXPECT_NEAR(bg, be, 1e-9 * be) << preset;
    EXPECT_NEAR(bg, bl, 1e-9 * bl) << preset;
  }
}

// The norms that write their output's NVFP4 codes (the q/k/v operand, the experts' operand read
// through the routing map) and the down projection's quantize_swiglu give the bits of the step with
// quantize() launches, the gathered expert rows and kern::swiglu (QUADS_GPU_NORM_QUANT=0), eager
// and as a graph; at batch 1 the plain GEMV on those
// codes gives the bits of the GEMV that quantizes in its prologue.
TEST(CudaModelGpu, NormQuantEqualsQuantizeLaunches) {
  QUADS_REQUIRE_GPU();
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  // the fixture (experts' down K = 32: no W4A4 path there) and a model whose down is W4A4
  for (const bool fixture : {true, false}) {
    const model::Weights w = fixture ? fixture_weights() : model::Weights::random(small_moe_config(), 29, 0.05f);
    const std::string what = fixture ? "fixture" : "small model";
    const auto plain_m = model_with_env("QUADS_GPU_NORM_QUANT", "0", w, prec);
    cuda::GpuModel& plain = *plain_m;
    cuda::GpuModel fused(w, prec);
    int64_t gp = -1, gf = -1;
    const auto lp = decode_logits(plain, 6, nullptr, &gp);
    const auto lf = decode_logits(fused, 6, nullptr, &gf);
    EXPECT_EQ(gf, 5) << what;
    EXPECT_EQ(first_float_mismatch(lf, lp), -1) << what;
    // per layer: the q/k/v quantize(), the experts' gather and quantize() are gone, and the
    // SwiGLU where the down projection is W4A4
    const int64_t layers = fused.config().num_hidden_layers;
    const bool down_w4a4 = fused.linear_mode("model.layers.0.mlp.experts.0.down_proj") == cuda::GpuLinearMode::W4A4;
    EXPECT_EQ(down_w4a4, !fixture) << what;
    EXPECT_EQ(fused.stats().graph_kernels, plain.stats().graph_kernels - (down_w4a4 ? 4 : 3) * layers) << what;
    // batch 1: one slot, a 4-token prompt, 6 decode steps
    auto one = [](cuda::GpuModel& g) {
      g.reset_cache(1, 32);
      g.reset_stats();
      model::StepItem it;
      it.slot = 0;
      it.tokens = {3, 1, 4, 1};
      std::vector<float> out = g.step({it});
      for (int i = 0; i < 6; ++i) {
        it.tokens = {(5 * i + 2) % 50};
        const std::vector<float> lg = g.step({it});
        out.insert(out.end(), lg.begin(), lg.end());
      }
      return out;
    };
    const auto op = one(plain), of = one(fused);
    EXPECT_EQ(first_float_mismatch(of, op), -1) << what << ", batch 1";
    EXPECT_EQ(fused.stats().graph_steps, 5) << what << ", batch 1";
    EXPECT_EQ(fused.stats().graph_kernels, plain.stats().graph_kernels) << what << ", batch 1: the same launches";
  }
}

// The router's logits from the post-attention norm (kern::RowRouter, behind a W4A4 o_proj) instead
// of the BF16 GEMM (QUADS_GPU_ROUTER_NORM=0): a router GEMM launch fewer a layer, the logits of
// the step to float32 summation error (the same experts chosen: the final logits agree closely).
TEST(CudaModelGpu, RouterInNormMatchesRouterGemm) {
  QUADS_REQUIRE_GPU();
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  const model::Weights w = model::Weights::random(small_moe_config(), 31, 0.05f);
  const auto gemm_m = model_with_env("QUADS_GPU_ROUTER_NORM", "0", w, prec);
  cuda::GpuModel& gemm = *gemm_m;
  cuda::GpuModel fused(w, prec);
  ASSERT_EQ(fused.linear_mode("model.layers.0.self_attn.o_proj"), cuda::GpuLinearMode::W4A4);
  int64_t gg = -1, gf = -1;
  const auto lg = decode_logits(gemm, 6, nullptr, &gg);
  const auto lf = decode_logits(fused, 6, nullptr, &gf);
  EXPECT_EQ(gf, 5);
  const double e = rel_l2(lf, lg);
  std::printf("router in the norm vs the router GEMM: rel L2 of the logits %.3g\n", e);
  EXPECT_LT(e, 1e-5);
  EXPECT_GE(gemm.stats().graph_kernels - fused.stats().graph_kernels, fused.config().num_hidden_layers);
}

// The loads a decode step's kernels start before their PDL wait (the attention's first K/V tile,
// the router's weights in the norm, the combine's routing) give the bits of the step that waits
// first (QUADS_GPU_EARLY=0), at batch 2 and at batch 1, as graphs.
TEST(CudaModelGpu, EarlyLoadsSameBits) {
  QUADS_REQUIRE_GPU();
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  const model::Weights w = model::Weights::random(small_moe_config(), 37, 0.05f);
  const auto late_m = model_with_env("QUADS_GPU_EARLY", "0", w, prec);
  cuda::GpuModel& late = *late_m;
  cuda::GpuModel early(w, prec);
  ASSERT_EQ(early.linear_mode("model.layers.0.mlp.experts.0.down_proj"), cuda::GpuLinearMode::W4A4);
  int64_t gl = -1, ge = -1;
  const auto ll = decode_logits(late, 6, nullptr, &gl);
  const auto le = decode_logits(early, 6, nullptr, &ge);
  EXPECT_EQ(ge, 5);
  EXPECT_EQ(first_float_mismatch(le, ll), -1) << "batch 2";
  auto one = [](cuda::GpuModel& g) {
    g.reset_cache(1, 80);
    g.reset_stats();
    model::StepItem it;
    it.slot = 0;
    it.tokens = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5};
    std::vector<float> out = g.step({it});
    for (int i = 0; i < 12; ++i) {  // the context crosses the 32-key tile at 33
      it.tokens = {(5 * i + 2) % 50};
      const std::vector<float> lg = g.step({it});
      out.insert(out.end(), lg.begin(), lg.end());
    }
    return out;
  };
  const auto o_late = one(late), o_early = one(early);
  EXPECT_EQ(first_float_mismatch(o_early, o_late), -1) << "batch 1";
  EXPECT_EQ(early.stats().graph_steps, 11) << "batch 1";
}

// q/k/v's and o_proj's X as FP16 fragments written by their producers (QUADS_GPU_XFRAG, decode
// batches of 3-64 rows): the same logits as the codes path, eagerly and as graphs, at batches 9,
// 12 and 16 (hidden 512: the skinny tiles split K over a cluster without the fragments, over a
// CTA's warps with them), 4, 5 and 8 (the tiles of 8 rows), 24, 33 and 48 (chunks of 16 rows; rows
// split over CTAs, 16 a CTA), and 2 (the GEMV: no fragments). At 3 the codes path takes the GEMV
// (other bits): CudaGemm.SkinnyXFragSameBits covers 3 rows.
TEST(CudaModelGpu, XFragSameBits) {
  QUADS_REQUIRE_GPU();
  model::ModelConfig cfg = small_moe_config();
  cfg.hidden_size = 512;
  const model::Weights w = model::Weights::random(cfg, 43, 0.05f);
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  const auto batch = decode_batch;
  const auto off_m = model_with_env("QUADS_GPU_XFRAG", "0", w, prec);
  cuda::GpuModel on(w, prec);
  ASSERT_EQ(on.linear_mode("model.layers.0.self_attn.q_proj"), cuda::GpuLinearMode::W4A4);
  const auto eager_m = [&] {
    setenv("QUADS_GPU_GRAPHS", "0", 1);
    struct Unset {
      ~Unset() { unsetenv("QUADS_GPU_GRAPHS"); }
    } unset;
    return std::make_unique<cuda::GpuModel>(w, prec);
  }();
  for (int n : {9, 12, 16, 4, 5, 8, 24, 33, 48, 2}) {  // decode_batch's prompts need n < vocab (64)
    const auto want = batch(*off_m, n);
    EXPECT_EQ(first_float_mismatch(batch(on, n), want), -1) << "batch " << n << ", graphs";
    EXPECT_EQ(first_float_mismatch(batch(*eager_m, n), want), -1) << "batch " << n << ", eager";
  }
}

// The experts' MLP in chains on their own streams (a window of the 8 experts a chain: W4A4 gate/up,
// quantize_swiglu and down, or BF16 gate/up, swiglu_bf16 and down) gives the one-chain step's bits,
// eagerly and as graphs: 2, 3 and 4 chains forced (QUADS_GPU_MOE_CHAINS) at batches 2 and 5, with
// and without stream priorities, and the default rule (4 chains at batch 12) against chains off.
TEST(CudaModelGpu, MoeChainsSameBits) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = model::Weights::random(small_moe_config(), 41, 0.05f);
  const auto batch = decode_batch;
  const int64_t layers = w.cfg.num_hidden_layers;
  for (const std::string preset : {"nvfp4", "bf16"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    const auto off_m = model_with_env("QUADS_GPU_MOE_CHAINS", "1", w, prec);
    cuda::GpuModel& off = *off_m;
    const cuda::GpuLinearMode mode = preset == "bf16" ? cuda::GpuLinearMode::BF16 : cuda::GpuLinearMode::W4A4;
    ASSERT_EQ(off.linear_mode("model.layers.0.mlp.experts.0.down_proj"), mode);
    // launches a layer with c chains beyond one chain's (W4A4: gate/up, quantize_swiglu, down;
    // BF16: gate/up, swiglu, to_bf16, down against gate/up, swiglu_bf16, down a chain)
    auto extra = [&](int c) { return (preset == "bf16" ? 3 * c - 4 : 3 * (c - 1)) * layers; };
    const auto l1 = decode_logits(off, 6, nullptr);
    const auto f12 = batch(off, 12);
    const int64_t k12 = off.stats().graph_kernels;
    const auto f5 = batch(off, 5);
    const int64_t k5 = off.stats().graph_kernels;
    {
      cuda::GpuModel dflt(w, prec);
      EXPECT_EQ(first_float_mismatch(batch(dflt, 12), f12), -1) << preset << ", batch 12, the default rule";
      EXPECT_EQ(dflt.stats().graph_kernels - k12, extra(4)) << preset << ", batch 12: 4 chains by default";
      EXPECT_EQ(first_float_mismatch(batch(dflt, 5), f5), -1) << preset << ", batch 5, the default rule";
      EXPECT_EQ(dflt.stats().graph_kernels, k5) << preset << ", batch 5: one chain by default";
    }
    for (const char* chains : {"2", "3", "4"})
      for (const char* prio : {"0", "1"}) {
        setenv("QUADS_GPU_MOE_PRIO", prio, 1);
        const auto two_m = model_with_env("QUADS_GPU_MOE_CHAINS", chains, w, prec);
        const auto eager_m = [&] {
          setenv("QUADS_GPU_GRAPHS", "0", 1);
          struct Unset {
            ~Unset() { unsetenv("QUADS_GPU_GRAPHS"); }
          } unset;
          return model_with_env("QUADS_GPU_MOE_CHAINS", chains, w, prec);
        }();
        unsetenv("QUADS_GPU_MOE_PRIO");
        const std::string what = preset + ", " + chains + " chains, priorities " + prio;
        int64_t g2 = -1;
        const auto l2 = decode_logits(*two_m, 6, nullptr, &g2);
        EXPECT_EQ(g2, 5) << what;
        EXPECT_EQ(first_float_mismatch(l2, l1), -1) << "batch 2, graphs, " << what;
        EXPECT_EQ(first_float_mismatch(batch(*two_m, 5), f5), -1) << "batch 5, graphs, " << what;
        EXPECT_EQ(two_m->stats().graph_kernels - k5, extra(std::atoi(chains))) << what;
        EXPECT_EQ(first_float_mismatch(decode_logits(*eager_m, 6, nullptr), l1), -1) << "batch 2, eager, " << what;
        EXPECT_EQ(first_float_mismatch(batch(*eager_m, 5), f5), -1) << "batch 5, eager, " << what;
      }
  }
}

// Prefill attention with several tokens per CTA (QUADS_GPU_ATTN_TOKENS) gives the one-token launch's
// bits: each warp's arithmetic is the same, only the grid differs.
TEST(CudaModelKernels, AttentionTokensPerCtaSameBits) {
  QUADS_REQUIRE_GPU();
  const int nh = 8, nkv = 2, hd = 64, slots = 2;
  const int64_t max_len = 48;
  std::vector<int32_t> slot, pos;
  for (int j = 0; j < 21; ++j) slot.push_back(1), pos.push_back(3 + j);  // a chunk after 3 cached positions
  for (int j = 0; j < 13; ++j) slot.push_back(0), pos.push_back(j);      // a fresh prompt
  const int64_t T = static_cast<int64_t>(slot.size());
  std::mt19937_64 rng(99);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(T * nh * hd), kc(size_t(slots) * max_len * nkv * hd), vc(kc.size());
  for (auto& v : q) v = nd(rng);
  for (auto& v : kc) v = nd(rng);
  for (auto& v : vc) v = nd(rng);
  DeviceArray<float> dq = dev(q), dk = dev(kc), dv = dev(vc), out1(T * nh * hd), outn(T * nh * hd);
  DeviceArray<int32_t> ds = dev(slot), dp = dev(pos);
  const float scale = 1.f / 8.f;
  cuda::kern::attention(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), T, nh, nkv, hd, scale, max_len, 24, false,
                        out1.data(), nullptr, 1);
  const std::vector<float> ref = out1.download();
  for (int tpc : {2, 3, 4, 16}) {
    outn.fill_bytes(0xFF);
    cuda::kern::attention(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), T, nh, nkv, hd, scale, max_len, 24,
                          false, outn.data(), nullptr, tpc);
    EXPECT_EQ(first_float_mismatch(outn.download(), ref), -1) << tpc << " tokens per CTA";
  }
  for (float v : ref) ASSERT_TRUE(std::isfinite(v));
}

// The fused q/k/v product is split by columns into the three operands.
TEST(CudaModelKernels, SplitCols3) {
  QUADS_REQUIRE_GPU();
  const int64_t rows = 5, a = 7, b = 3, c = 2, w = a + b + c;
  std::vector<float> src(rows * w);
  for (size_t i = 0; i < src.size(); ++i) src[i] = float(i) * 0.5f;
  DeviceArray<float> ds = dev(src), da(rows * a), db(rows * b), dc(rows * c);
  cuda::kern::split_cols3(ds.data(), rows, a, b, c, da.data(), db.data(), dc.data(), nullptr);
  const auto ha = da.download(), hb = db.download(), hc = dc.download();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < a; ++j) EXPECT_EQ(ha[r * a + j], src[r * w + j]);
    for (int64_t j = 0; j < b; ++j) EXPECT_EQ(hb[r * b + j], src[r * w + a + j]);
    for (int64_t j = 0; j < c; ++j) EXPECT_EQ(hc[r * c + j], src[r * w + a + b + j]);
  }
}

// The tiled prefill attention (QUADS_GPU_ATTN=tiled) against the default kernel, bit for bit: two
// slots in one step, contexts longer than a 32-key tile, GQA groups of 4 and of 1.
TEST(CudaModelKernels, AttentionTiledSameBits) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int nh, nkv, hd;
  };
  for (const Case c : {Case{8, 2, 64}, Case{4, 4, 128}, Case{16, 4, 32}}) {
    const int slots = 3;
    const int64_t max_len = 96;
    std::vector<int32_t> slot, pos;
    for (int j = 0; j < 45; ++j) slot.push_back(2), pos.push_back(30 + j);  // a chunk after 30 cached positions
    for (int j = 0; j < 9; ++j) slot.push_back(0), pos.push_back(j);         // a fresh prompt
    for (int j = 0; j < 70; ++j) slot.push_back(1), pos.push_back(j);        // a longer one
    const int64_t T = static_cast<int64_t>(slot.size()), ctx = 80;
    std::mt19937_64 rng(7 + c.hd);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> q(T * c.nh * c.hd), kc(size_t(slots) * max_len * c.nkv * c.hd), vc(kc.size());
    for (auto& v : q) v = nd(rng);
    for (auto& v : kc) v = nd(rng);
    for (auto& v : vc) v = nd(rng);
    DeviceArray<float> dq = dev(q), dk = dev(kc), dv = dev(vc), out1(T * c.nh * c.hd), out2(T * c.nh * c.hd);
    DeviceArray<int32_t> ds = dev(slot), dp = dev(pos);
    const float scale = 1.f / std::sqrt(float(c.hd));
    cuda::kern::attention(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), T, c.nh, c.nkv, c.hd, scale, max_len,
                          ctx, false, out1.data(), nullptr);
    ASSERT_TRUE(cuda::kern::attention_tiled_supported(c.nh, c.nkv, c.hd));
    int hpc = 0;
    const int tpc = cuda::kern::attention_tiled_tokens(c.nh, c.nkv, c.hd, ctx, &hpc);
    ASSERT_GE(tpc, 1);
    ASSERT_EQ((c.nh / c.nkv) % hpc, 0);
    for (int tokens : {tpc, 3}) {
      std::vector<int32_t> blk;
      for (int64_t t = 0; t < T; ++t) {
        const size_t nb = blk.size() / 2;
        if (nb == 0 || slot[t] != slot[t - 1] || blk[2 * nb - 1] >= tokens) {
          blk.push_back(static_cast<int32_t>(t));
          blk.push_back(1);
        } else {
          ++blk[2 * nb - 1];
        }
      }
      DeviceArray<int32_t> db = dev(blk);
      out2.fill_bytes(0xFF);
      cuda::kern::attention_tiled(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), db.data(),
                                  static_cast<int64_t>(blk.size() / 2), c.nh, c.nkv, c.hd, scale, max_len, ctx, hpc,
                                  tokens, out2.data(), nullptr);
      EXPECT_EQ(first_float_mismatch(out2.download(), out1.download()), -1)
          << "heads " << c.nh << "/" << c.nkv << " hd " << c.hd << " tokens per CTA " << tokens;
    }
  }
}

// RAC on grouped experts: the grouped gather of each row's expert blocks equals the per-expert
// gather, and the grouped residual GEMM (one launch, each expert its own blocks, y with a row
// stride) gives each expert's w4a4_gemm_gather bits (same split count, same tile sums).
TEST(CudaMoe, GroupedRacGemmEqualsPerExpert) {
  QUADS_REQUIRE_GPU();
  const int64_t N = 96, K = 512, ldy = 2 * N;
  const std::vector<int> sizes = {3, 0, 17, 1, 40};
  const int E = static_cast<int>(sizes.size());
  const std::vector<int32_t> off = offsets_of(sizes);
  const int64_t R = off[E];
  const std::vector<int> nsel = {4, 7, 2, 8, 5};  // blocks per expert; the table pads to 8 (cols 128)
  const int64_t nb = 8, cols = nb * 16;
  std::vector<int32_t> blocks(size_t(E * nb), 0);
  std::mt19937 rng(3);
  for (int e = 0; e < E; ++e)
    for (int i = 0; i < nsel[e]; ++i) blocks[size_t(e * nb + i)] = static_cast<int32_t>(rng() % (K / 16));
  const std::vector<float> x = random_matrix(R, K, 9);
  DeviceArray<float> dx = dev(x);
  DeviceArray<int32_t> dblk = dev(blocks), dnsel = dev(nsel), deoff = dev(off);
  DeviceArray<float> gb(R * cols), gref(R * cols);
  gb.fill_bytes(0xFF);
  cuda::gather_blocks_grouped(dx.data(), R, K, dblk.data(), dnsel.data(), cols, deoff.data(), E, gb.data());
  for (int e = 0; e < E; ++e) {
    if (sizes[e] == 0) continue;
    cuda::gather_blocks(dx.data() + off[e] * K, sizes[e], K, dblk.data() + e * nb, nsel[e],
                        gref.data() + off[e] * cols, cols);
  }
  const std::vector<float> g_got = gb.download(), g_ref = gref.download();
  EXPECT_EQ(first_float_mismatch(g_got, g_ref), -1);
  for (int e = 0; e < E; ++e)  // spot check against the definition
    for (int32_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float want = c / 16 < nsel[e] ? x[r * K + blocks[size_t(e * nb + c / 16)] * 16 + c % 16] : 0.f;
        ASSERT_EQ(g_got[size_t(r * cols + c)], want) << "row " << r << " col " << c;
      }

  num::QConfig rc = num::QConfig::nvfp4_act();
  rc.global = num::Global::PerRow;
  cuda::DeviceQTensor xr = cuda::make_qtensor(R, cols, rc);
  cuda::quantize(gb.data(), xr);
  const cuda::Nvfp4View xv = cuda::nvfp4_view(xr, "residual");
  std::vector<cuda::DeviceQTensor> wq;
  std::vector<cuda::Nvfp4Weight> tab;
  for (int e = 0; e < E; ++e) {
    DeviceArray<float> dw = dev(random_matrix(N, K, 200 + e));
    wq.push_back(cuda::make_qtensor(N, K, num::QConfig::nvfp4_weight(false)));
    cuda::quantize(dw.data(), wq.back());
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    const cuda::Nvfp4View v = cuda::nvfp4_view(wq.back(), "w");
    tab.push_back({v.codes, v.scales, v.amax});
  }
  DeviceArray<cuda::Nvfp4Weight> dtab = dev(tab);
  const std::vector<float> y0 = random_matrix(R, ldy, 11);  // RAC adds into the main GEMM's output
  for (const int splits : {1, 2}) {
    DeviceArray<float> y = dev(y0), yref = dev(y0);
    cuda::w4a4_gemm_grouped_gather(xv, dtab.data(), false, N, K, E, deoff.data(), 40, dblk.data(), y.data(), ldy,
                                   nullptr, splits);
    cuda::W4A4Options opt;
    opt.splits = splits;
    opt.tile = cuda::W4A4Tile::M16;
    for (int e = 0; e < E; ++e) {
      if (sizes[e] == 0) continue;
      cuda::Nvfp4View xe = xv;
      xe.codes += off[e] * cols / 2;
      xe.scales += off[e] * cols / 16;
      xe.amax += off[e];
      xe.rows = sizes[e];
      // per-expert reference into a dense [rows, N] scratch, added to the strided rows below
      DeviceArray<float> ye(int64_t(sizes[e]) * N);
      ye.fill_bytes(0);
      cuda::w4a4_gemm_gather(xe, cuda::nvfp4_view(wq[e], "w"), dblk.data() + e * nb, ye.data(), true, nullptr, opt);
      const std::vector<float> he = ye.download();
      std::vector<float> yr = yref.download();
      for (int r = 0; r < sizes[e]; ++r)
        for (int64_t n = 0; n < N; ++n) yr[size_t((off[e] + r) * ldy + n)] += he[size_t(r * N + n)];
      yref = dev(yr);
    }
    const std::vector<float> got = y.download(), ref = yref.download();
    EXPECT_EQ(first_float_mismatch(got, ref), -1) << "splits " << splits;
    double moved = 0;
    for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, std::fabs(double(got[i]) - y0[i]));
    EXPECT_GT(moved, 0.0) << "the residual GEMM must add something";
    for (int64_t r = 0; r < R; ++r)  // columns past N are the caller's
      for (int64_t n = N; n < ldy; ++n) ASSERT_EQ(got[size_t(r * ldy + n)], y0[size_t(r * ldy + n)]);
  }
}

// The grouped GEMV (tile Gemv) gives each expert's dense GEMV bits: over more than 32 groups
// (the CTAs find the j-th non-empty group 32 at a time), empty groups, groups larger than a pass
// of rows, per-tensor and per-row weight amax; Auto takes it for decode-like calls. The grouped
// RAC GEMV (gather, y with a row stride) equals the per-expert gather GEMV likewise.
TEST(CudaMoe, GroupedGemvEqualsPerExpertGemv) {
  QUADS_REQUIRE_GPU();
  EXPECT_TRUE(cuda::gemv_auto_grouped(1, 768)) << "decode batch 1 takes the GEMV (the last case checks Auto)";
  struct Case {
    std::vector<int> sizes;
    int64_t N, K;
    bool w_row;  // per-row weight amax
  };
  std::vector<int> many(70, 0), ones(70, 0);  // 16 rows over 5 of 70 experts; decode batch 1, top-8
  many[0] = 3, many[5] = 1, many[33] = 9, many[40] = 2, many[69] = 1;
  for (int e : {1, 7, 31, 32, 33, 50, 64, 69}) ones[e] = 1;
  for (const Case& c : {Case{many, 200, 256, false}, Case{{3, 0, 17, 1, 0, 40}, 77, 1152, true},
                        Case{ones, 96, 512, false}}) {
    GroupedW4A4 G(c.sizes, c.N, c.K, c.w_row, 17, 300);
    const std::vector<int>& sizes = G.sizes;
    const std::vector<int32_t>& off = G.off;
    const int64_t N = G.N, K = G.K, R = G.R;
    const int E = G.E, max_rows = G.max_rows;
    const num::QConfig& xc = G.xc;
    const cuda::Nvfp4View& xv = G.xv;
    const std::vector<cuda::DeviceQTensor>& wq = G.wq;
    DeviceArray<cuda::Nvfp4Weight>& dtab = G.dtab;
    DeviceArray<int32_t>& deoff = G.deoff;
    cuda::W4A4Options opt;
    opt.tile = cuda::W4A4Tile::Gemv;
    auto expert_x = [&](const cuda::Nvfp4View& v, int e, int64_t k) { return G.rows_of(v, e, k); };
    const std::string what = G.what();

    DeviceArray<float> y(R * N), yref(R * N);
    y.fill_bytes(0xFF);  // NaN: every row must be written
    yref.fill_bytes(0xFF);
    cuda::w4a4_gemm_grouped(xv, dtab.data(), c.w_row, N, E, deoff.data(), max_rows, y.data(), nullptr, 0,
                            cuda::W4A4Tile::Gemv);
    for (int e = 0; e < E; ++e)
      if (sizes[e] > 0)
        cuda::w4a4_gemm_emulated(expert_x(xv, e, K), cuda::nvfp4_view(wq[e], "w"), yref.data() + off[e] * N, false,
                                 nullptr, opt);
    const std::vector<float> got = y.download(), ref = yref.download();
    EXPECT_EQ(first_float_mismatch(got, ref), -1) << what;
    // against the tile kernel: the same sums up to their order
    cuda::w4a4_gemm_grouped(xv, dtab.data(), c.w_row, N, E, deoff.data(), max_rows, y.data(), nullptr, 1,
                            cuda::W4A4Tile::M16);
    const std::vector<float> tiled = y.download();
    y.fill_bytes(0xFF);  // the 3-stage occupancy variant runs the same MMA chain: the same bits
    cuda::w4a4_gemm_grouped(xv, dtab.data(), c.w_row, N, E, deoff.data(), max_rows, y.data(), nullptr, 1,
                            cuda::W4A4Tile::M16W4S3);
    EXPECT_EQ(first_float_mismatch(y.download(), tiled), -1) << what << ": M16W4S3 vs M16";
    double err = 0, mag = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      err = std::max(err, std::fabs(double(tiled[i]) - ref[i]));
      mag = std::max(mag, std::fabs(double(ref[i])));
    }
    EXPECT_LE(err, 1e-5 * mag) << what;
    EXPECT_GT(mag, 0.0);
    if (cuda::gemv_auto_grouped(max_rows, K)) {
      y.fill_bytes(0xFF);
      cuda::w4a4_gemm_grouped(xv, dtab.data(), c.w_row, N, E, deoff.data(), max_rows, y.data());
      EXPECT_EQ(first_float_mismatch(y.download(), ref), -1) << what << ": Auto is not the GEMV";
    }

    // RAC: each expert's own blocks of W, compact residual of nb blocks, y with a row stride
    const int64_t nb = 8, cols = nb * 16, ldy = N + 5;
    std::vector<int32_t> blocks(size_t(E * nb));
    std::mt19937 rng(5);
    for (auto& b : blocks) b = static_cast<int32_t>(rng() % (K / 16));
    DeviceArray<int32_t> dblk = dev(blocks);
    cuda::DeviceArray<float> dr = dev(random_matrix(R, cols, 19));
    cuda::DeviceQTensor rq = cuda::make_qtensor(R, cols, xc);
    cuda::quantize(dr.data(), rq);
    const cuda::Nvfp4View rv = cuda::nvfp4_view(rq, "residual");
    const std::vector<float> y0 = random_matrix(R, ldy, 23);
    DeviceArray<float> yg = dev(y0);
    cuda::w4a4_gemm_grouped_gather(rv, dtab.data(), c.w_row, N, K, E, deoff.data(), max_rows, dblk.data(), yg.data(),
                                   ldy, nullptr, 0, cuda::W4A4Tile::Gemv);
    std::vector<float> want = y0;
    for (int e = 0; e < E; ++e) {
      if (sizes[e] == 0) continue;
      DeviceArray<float> ye(int64_t(sizes[e]) * N);
      ye.fill_bytes(0);
      cuda::w4a4_gemm_gather(expert_x(rv, e, cols), cuda::nvfp4_view(wq[e], "w"), dblk.data() + e * nb, ye.data(),
                             true, nullptr, opt);
      const std::vector<float> he = ye.download();
      for (int r = 0; r < sizes[e]; ++r)
        for (int64_t n = 0; n < N; ++n) want[size_t((off[e] + r) * ldy + n)] += he[size_t(r * N + n)];
    }
    const std::vector<float> gg = yg.download();
    EXPECT_EQ(first_float_mismatch(gg, want), -1) << what << " (gather)";
    for (int64_t r = 0; r < R; ++r)  // columns past N are the caller's
      for (int64_t n = N; n < ldy; ++n) ASSERT_EQ(gg[size_t(r * ldy + n)], y0[size_t(r * ldy + n)]);
  }
}

// The grouped skinny tiles give each expert's dense skinny bits (the same warps a row tile): over
// more than 32 groups, empty groups, groups of more than one 16-row chunk, per-row weight amax;
// and agree with the 16-row tiles to FP32 summation order. Auto takes them for decode batches.
TEST(CudaMoe, GroupedSkinnyEqualsPerExpertSkinny) {
  QUADS_REQUIRE_GPU();
  struct Case {
    std::vector<int> sizes;
    int64_t N, K;
    bool w_row;
  };
  std::vector<int> many(70, 0);
  many[0] = 3, many[5] = 1, many[33] = 9, many[40] = 2, many[69] = 16;
  for (const Case& c : {Case{many, 200, 256, false}, Case{{3, 0, 17, 1, 0, 40}, 77, 1152, true},
                        Case{{8, 8, 0, 5}, 96, 2048, false}}) {
    GroupedW4A4 G(c.sizes, c.N, c.K, c.w_row, 37, 400);
    const int64_t N = G.N, R = G.R;
    const int E = G.E, max_rows = G.max_rows;
    const std::string what = G.what();
    DeviceArray<float> y(R * N), yref(R * N);
    for (int ks : {1, 4}) {
      y.fill_bytes(0xFF);  // NaN: every row must be written
      yref.fill_bytes(0xFF);
      cuda::w4a4_gemm_grouped(G.xv, G.dtab.data(), c.w_row, N, E, G.deoff.data(), max_rows, y.data(), nullptr, ks,
                              cuda::W4A4Tile::Skinny);
      cuda::W4A4Options opt;
      opt.tile = cuda::W4A4Tile::Skinny;
      opt.splits = ks;
      for (int e = 0; e < E; ++e)
        if (G.sizes[e] > 0)
          cuda::w4a4_gemm_emulated(G.rows_of(G.xv, e, G.K), cuda::nvfp4_view(G.wq[e], "w"), yref.data() + G.off[e] * N,
                                   false, nullptr, opt);
      const std::vector<float> got = y.download(), ref = yref.download();
      EXPECT_EQ(first_float_mismatch(got, ref), -1) << what << " ks " << ks;
      // against the 16-row tiles: the same products, summed in another grouping
      cuda::w4a4_gemm_grouped(G.xv, G.dtab.data(), c.w_row, N, E, G.deoff.data(), max_rows, y.data(), nullptr, 1,
                              cuda::W4A4Tile::M16);
      const std::vector<float> tiled = y.download();
      double err = 0, mag = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        err = std::max(err, std::fabs(double(tiled[i]) - ref[i]));
        mag = std::max(mag, std::fabs(double(ref[i])));
      }
      EXPECT_LE(err, 1e-5 * mag) << what << " ks " << ks;
      EXPECT_GT(mag, 0.0);
    }
    // Auto with the decode batch as the bound: the skinny tiles, with their own split choice
    y.fill_bytes(0xFF);
    cuda::w4a4_gemm_grouped(G.xv, G.dtab.data(), c.w_row, N, E, G.deoff.data(), max_rows, y.data(), nullptr, 0,
                            cuda::W4A4Tile::Skinny);
    const std::vector<float> chosen = y.download();
    if (!cuda::gemv_auto_grouped(max_rows, G.K) && max_rows <= cuda::kSkinnyAutoMaxRows) {
      y.fill_bytes(0xFF);
      cuda::w4a4_gemm_grouped(G.xv, G.dtab.data(), c.w_row, N, E, G.deoff.data(), max_rows, y.data());
      EXPECT_EQ(first_float_mismatch(y.download(), chosen), -1) << what << ": Auto is not the skinny tiles";
    }
  }
}

// The grouped GEMM reading X's rows through the routing map (w4a4_gemm_grouped_mapped) against
// gather_rows + quantize() + w4a4_gemm_grouped: the same bits (T token rows quantized once, each
// group row r reading row perm[r] / k), at top-k 8 of 64 experts and an odd routing of 5 groups.
TEST(CudaMoe, GroupedMappedEqualsGathered) {
  QUADS_REQUIRE_GPU();
  num::QConfig xc = num::QConfig::nvfp4_act();
  xc.global = num::Global::PerRow;
  struct Case {
    int64_t T;
    int k, E;
    int64_t N, K;
    bool w_row;
  };
  // (16 tokens, 8 experts of 6400 x 1024: the whole call's plan has one warp a row tile on an
  // H200, a window of 4 groups planned alone would take two: plan_groups must keep it)
  for (const Case c : {Case{16, 8, 64, 96, 2048, false}, Case{64, 8, 64, 64, 768, true}, Case{3, 2, 5, 40, 256, false},
                       Case{2, 8, 64, 48, 1024, true}, Case{16, 2, 8, 6400, 1024, false}}) {
    const int64_t R = c.T * c.k;
    // a random top-k routing: token t's k distinct experts, rows in expert order
    std::mt19937 rng(static_cast<unsigned>(c.T * 31 + c.k));
    std::vector<int32_t> idx(static_cast<size_t>(R));
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<int> ex(c.E);
      std::iota(ex.begin(), ex.end(), 0);
      std::shuffle(ex.begin(), ex.end(), rng);
      for (int j = 0; j < c.k; ++j) idx[size_t(t * c.k + j)] = ex[size_t(j)];
    }
    std::vector<int> sizes(c.E, 0);
    for (int32_t e : idx) ++sizes[e];
    std::vector<int32_t> off = offsets_of(sizes), fill(off.begin(), off.end() - 1), perm(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) perm[size_t(fill[idx[size_t(i)]]++)] = static_cast<int32_t>(i);
    int max_rows = 0;
    for (int s : sizes) max_rows = std::max(max_rows, s);
    ASSERT_TRUE(cuda::w4a4_grouped_mapped_supported(c.T, c.K)) << c.T << " " << c.K;
    GroupedW4A4 G(sizes, c.N, c.K, c.w_row, 61, 500);  // its weights; X comes from the token rows below
    DeviceArray<float> xt = dev(random_matrix(c.T, c.K, 62)), xg(R * c.K);
    DeviceArray<int32_t> dperm = dev(perm);
    cuda::DeviceQTensor tq = cuda::make_qtensor(c.T, c.K, xc), gq = cuda::make_qtensor(R, c.K, xc);
    cuda::quantize(xt.data(), tq);
    cuda::kern::gather_rows(xt.data(), dperm.data(), R, c.k, c.K, xg.data(), nullptr);
    cuda::quantize(xg.data(), gq);
    DeviceArray<float> y(R * c.N), yref(R * c.N);
    y.fill_bytes(0xFF);
    yref.fill_bytes(0xFF);
    cuda::w4a4_gemm_grouped(cuda::nvfp4_view(gq, "x"), G.dtab.data(), c.w_row, c.N, c.E, G.deoff.data(), c.T,
                            yref.data());
    cuda::w4a4_gemm_grouped_mapped(cuda::nvfp4_view(tq, "x"), dperm.data(), c.k, R, G.dtab.data(), c.w_row, c.N, c.E,
                                   G.deoff.data(), c.T, y.data());
    const std::vector<float> ref = yref.download();
    EXPECT_EQ(first_float_mismatch(y.download(), ref), -1) << "T " << c.T << " k " << c.k << " K " << c.K;
    // two windows of groups, each with the whole call's plan (the model's two MoE chains), on two
    // streams: every row as in the one call, gathered and mapped
    {
      const int s0 = c.E / 2;
      cudaStream_t st[2];
      for (cudaStream_t& x : st) QUADS_CUDA_CHECK(cudaStreamCreate(&x));
      DeviceArray<float> yw(R * c.N), ymw(R * c.N);
      yw.fill_bytes(0xFF);
      ymw.fill_bytes(0xFF);
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const int gb[2] = {0, s0}, gn[2] = {s0, c.E - s0};
      for (int w = 0; w < 2; ++w) {
        cuda::w4a4_gemm_grouped(cuda::nvfp4_view(gq, "x"), G.dtab.data() + gb[w], c.w_row, c.N, gn[w],
                                G.deoff.data() + gb[w], c.T, yw.data(), st[w], 0, cuda::W4A4Tile::Auto, c.E);
        cuda::w4a4_gemm_grouped_mapped(cuda::nvfp4_view(tq, "x"), dperm.data(), c.k, R, G.dtab.data() + gb[w], c.w_row,
                                       c.N, gn[w], G.deoff.data() + gb[w], c.T, ymw.data(), st[w], c.E);
      }
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      for (cudaStream_t x : st) QUADS_CUDA_CHECK(cudaStreamDestroy(x));
      EXPECT_EQ(first_float_mismatch(yw.download(), ref), -1) << "windows, T " << c.T << " E " << c.E << " N " << c.N;
      EXPECT_EQ(first_float_mismatch(ymw.download(), ref), -1) << "mapped windows, T " << c.T << " E " << c.E;
    }
    double mag = 0;
    for (float v : ref) mag = std::max(mag, std::fabs(double(v)));
    EXPECT_GT(mag, 0.0);
  }
}

// nvfp4+RAC on a model whose expert projections are all W4A4: the experts' RAC runs grouped (no
// host sync, so decode steps become graphs) and agrees with the per-expert RAC path.
TEST(CudaModelGpu, GroupedRacEqualsPerExpertRac) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = model::Weights::random(small_moe_config(), 17, 0.05f);
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  cuda::GpuModel plain(w, prec);
  ASSERT_EQ(plain.linear_mode("model.layers.0.mlp.experts.0.down_proj"), cuda::GpuLinearMode::W4A4);
  double bytes = 0;
  const auto l_plain = decode_logits(plain, 6, &bytes);
  // Both without RAC folded into the main GEMMs (decode would not run the grouped gather GEMMs
  // this test is about, and the two would count different weight bytes).
  setenv("QUADS_GPU_RAC_FOLD", "0", 1);
  struct Unset {
    ~Unset() { unsetenv("QUADS_GPU_RAC_FOLD"); }
  } unset;
  cuda::GpuModel grouped(w, prec);
  grouped.set_rac_first_channels(0.25);
  const auto per_expert_m = model_with_env("QUADS_GPU_RAC_GROUPED", "0", w, prec);
  cuda::GpuModel& per_expert = *per_expert_m;
  per_expert.set_rac_first_channels(0.25);
  int64_t gsteps = -1, psteps = -1;
  double bg = 0, bp = 0;
  const auto lg = decode_logits(grouped, 6, &bg, &gsteps);
  const auto lp = decode_logits(per_expert, 6, &bp, &psteps);
  const double e = rel_l2(lg, lp), moved = rel_l2(lg, l_plain);
  std::printf("nvfp4+RAC grouped vs per-expert RAC: rel L2 of the logits %.3g (RAC moved them by %.3g)\n", e, moved);
  EXPECT_LT(e, 1e-5);
  EXPECT_GT(moved, 100 * e);
  EXPECT_EQ(gsteps, 5) << "grouped RAC has no host sync: decode steps 2..6 run as a graph";
  EXPECT_EQ(psteps, 0) << "the per-expert RAC path syncs per layer";
  EXPECT_NEAR(bg, bp, 1e-6 * bp) << "both count the same weight bytes";
}

// RAC folded into the main W4A4 GEMMs (decode shapes: the GEMV at 2 rows, the skinny tiles at the
// 6-token prefill and the grouped experts) gives the logits of the main GEMMs followed by the
// separate residual GEMMs (QUADS_GPU_RAC_FOLD=0) to FP32 summation order, in graphs as before.
// (With the first channels compensated the compact residual's blocks sit where the dense one's do,
// so the products meet in the same order and the H200 gave the same bits; the bound allows less.)
TEST(CudaModelGpu, RacFoldEqualsSeparateResidualGemms) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = model::Weights::random(small_moe_config(), 19, 0.05f);
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  cuda::GpuModel folded(w, prec);
  folded.set_rac_first_channels(0.5);
  const auto sep_m = model_with_env("QUADS_GPU_RAC_FOLD", "0", w, prec);
  cuda::GpuModel& separate = *sep_m;
  separate.set_rac_first_channels(0.5);
  cuda::GpuModel plain(w, prec);
  int64_t fsteps = -1, ssteps = -1;
  double bf = 0, bs = 0;
  const auto lf = decode_logits(folded, 6, &bf, &fsteps);
  const int64_t nfold = folded.stats().rac_fold_gemms;
  const auto ls = decode_logits(separate, 6, &bs, &ssteps);
  const auto lp = decode_logits(plain, 6, nullptr);
  const double e = rel_l2(lf, ls), moved = rel_l2(lf, lp);
  std::printf("nvfp4+RAC folded vs separate residual GEMMs: rel L2 of the logits %.3g (RAC moved them by %.3g), "
              "%lld folded GEMMs\n", e, moved, static_cast<long long>(nfold));
  EXPECT_LT(e, 1e-5);
  EXPECT_GT(moved, 100 * e);
  // a layer's q/k/v, o_proj, gate/up and down (eager steps; graph replays do not count)
  EXPECT_GE(nfold, 4 * small_moe_config().num_hidden_layers);
  EXPECT_EQ(separate.stats().rac_fold_gemms, 0);
  EXPECT_EQ(fsteps, 5);
  EXPECT_EQ(ssteps, 5);
  // weight bytes (the same routing both ways: the same logits): separately, the residual GEMMs read
  // the compensated half of every W4A4 linear's blocks again; folded, nothing is read twice
  EXPECT_GT(bs, 1.3 * bf) << "folded " << bf << " separate " << bs;
  EXPECT_LT(bs, 1.6 * bf) << "folded " << bf << " separate " << bs;
}

// Prefills of fresh slots run their attention as FP32 SGEMMs (cuda/attention_tc.h): the logits of
// every prompt token agree with the one-warp-per-row kernel (QUADS_GPU_ATTN=direct) to FP32
// summation-order noise, and decode continues from the cache the same way.
TEST(CudaModelGpu, GemmPrefillAttentionMatchesDirectKernel) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = model::Weights::random(small_moe_config(), 23, 0.05f);
  for (const auto& [preset, tol] : std::vector<std::pair<std::string, double>>{{"fp32", 1e-5}, {"nvfp4", 2e-3}}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    cuda::GpuModel fast(w, prec);
    const auto direct_m = model_with_env("QUADS_GPU_ATTN", "direct", w, prec);
    cuda::GpuModel& direct = *direct_m;
    auto run = [&](cuda::GpuModel& g) {
      g.reset_cache(3, 400);
      std::vector<model::StepItem> items(3);
      const int lens[3] = {150, 1, 300};
      for (int i = 0; i < 3; ++i) {
        items[i].slot = i;
        items[i].all_logits = true;
        for (int t = 0; t < lens[i]; ++t) items[i].tokens.push_back((13 * t + 7 * i + 1) % 64);
      }
      std::vector<float> out = g.step(items);
      for (int i = 0; i < 3; ++i) {
        items[i].tokens = {(5 * i + 3) % 64};
        items[i].all_logits = false;
      }
      const auto next = g.step(items);
      out.insert(out.end(), next.begin(), next.end());
      return out;
    };
    const auto a = run(fast), b = run(direct);
    EXPECT_EQ(fast.stats().gemm_attention_steps, 1) << preset << ": the prefill, not the decode step";
    EXPECT_EQ(direct.stats().gemm_attention_steps, 0) << preset;
    const double e = rel_l2(a, b);
    std::printf("%s: prefill attention as FP32 GEMMs vs the direct kernel: rel L2 of the logits %.3g\n",
                preset.c_str(), e);
    EXPECT_LT(e, tol) << preset;
  }
}

// Decode attention through the tiled kernel (QUADS_GPU_ATTN_DECODE=tiled: the GQA group's heads of
// a token share the staged K/V tiles) gives the one-warp-per-head kernel's bits (=warp), eager and
// in graphs; the default split-key kernel stays within float rounding of both.
TEST(CudaModelGpu, TiledDecodeAttentionSameBits) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = model::Weights::random(small_moe_config(), 29, 0.05f);
  ASSERT_TRUE(cuda::kern::attention_tiled_supported(4, 2, 64));
  for (const std::string preset : {"fp32", "nvfp4"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    cuda::GpuModel split(w, prec);
    const auto plain_m = model_with_env("QUADS_GPU_ATTN_DECODE", "warp", w, prec);
    const auto tiled_m = model_with_env("QUADS_GPU_ATTN_DECODE", "tiled", w, prec);
    cuda::GpuModel &plain = *plain_m, &tiled = *tiled_m;
    int64_t gp = -1, gt = -1, gs = -1;
    const auto a = decode_logits(plain, 6, nullptr, &gp), b = decode_logits(tiled, 6, nullptr, &gt),
               c = decode_logits(split, 6, nullptr, &gs);
    EXPECT_EQ(first_float_mismatch(b, a), -1) << preset;
    EXPECT_EQ(gt, gp) << preset;
    EXPECT_EQ(gs, gp) << preset;
    const double e = rel_l2(c, a);
    std::printf("%s: split-key decode attention vs one warp per head: rel L2 of the logits %.3g\n", preset.c_str(), e);
    EXPECT_LT(e, preset == "fp32" ? 1e-5 : 1e-3) << preset;
  }
}
