// The W4A4 GEMV with the activation quantizer fused into it (w4a4_gemv_fused*) against the
// unfused sequence it replaces: (gather_rows / swiglu ->) quantize() -> the GEMV (W4A4Tile::Gemv),
// bit for bit. That sequence is held to the CPU reference by test_quant.cpp (the row quantizer,
// whose steps the fused prologue shares) and test_gemm.cpp (the GEMV).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "cuda/cuda_test_util.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"

using namespace quads;
using namespace quads::cuda;
using namespace quads::cuda::testing;
using num::Global;
using num::QConfig;

namespace {

QConfig act_cfg(bool static_amax, float amax = 0.f) {
  QConfig c = QConfig::nvfp4_act();
  c.global = static_amax ? Global::Static : Global::PerRow;
  c.static_amax = amax;
  return c;
}

// Random NVFP4 weight [n, k] on the device (16x16 tiles or 1x16 with a per-row amax).
DeviceQTensor random_weight(int64_t n, int64_t k, bool tiles, bool amax_per_row, uint64_t seed) {
  QConfig c = QConfig::nvfp4_weight(tiles);
  if (amax_per_row) c.global = Global::PerRow;
  DeviceArray<float> w;
  w.upload(random_matrix(n, k, seed));
  DeviceQTensor q = make_qtensor(n, k, c);
  quantize(w.data(), q);
  return q;
}

// Expert weights: 8 distinct ones per shape, cycled over the experts (neighbours differ, so a
// wrong expert shows), made once per shape for the whole test.
const std::vector<DeviceQTensor>& expert_pool(int64_t n, int64_t k, bool amax_per_row) {
  static std::map<std::tuple<int64_t, int64_t, bool>, std::vector<DeviceQTensor>> pools;
  std::vector<DeviceQTensor>& p = pools[{n, k, amax_per_row}];
  if (p.empty())
    for (int i = 0; i < 8; ++i) p.push_back(random_weight(n, k, !amax_per_row && n % 16 == 0, amax_per_row, 3000 + 17 * i + n + k));
  return p;
}

// Same bits everywhere (NaN patterns included), and the data is not degenerate.
void expect_same_bits(const std::vector<float>& ref, const std::vector<float>& got, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  EXPECT_EQ(std::memcmp(ref.data(), got.data(), ref.size() * sizeof(float)), 0)
      << what << ": first mismatch at " << first_float_mismatch(ref, got);
  int64_t finite_nonzero = 0;
  for (float v : ref) finite_nonzero += std::isfinite(v) && v != 0.f;
  EXPECT_GT(finite_nonzero, static_cast<int64_t>(ref.size() / 2)) << what << ": degenerate outputs";
}

// Sets the GEMV's tile loop for a scope (gemm.h: set_gemv_tile_loop).
struct TileLoop {
  GemvTileLoop old = gemv_tile_loop();
  explicit TileLoop(bool on) { set_gemv_tile_loop(on ? GemvTileLoop::On : GemvTileLoop::Off); }
  ~TileLoop() { set_gemv_tile_loop(old); }
};

struct DenseCase {
  int64_t n, k, rows, ld;
  bool static_amax, accumulate, tiles, w_row_amax, early;
};

}  // namespace

// Dense rows (with a row stride), per-row and static amax, accumulate, the early weight stream;
// with the GEMV's tile loop off and on (the plain GEMV too: it must not change a bit).
TEST(CudaW4A4Fused, DenseMatchesQuantizeThenGemv) {
  QUADS_REQUIRE_GPU();
  TileLoop off(false);  // the reference: one tile per CTA
  const std::vector<DenseCase> cases = {
      {5120, 2048, 1, 2048, false, false, true, false, true},    // q/k/v, decode batch 1
      {5120, 2048, 4, 2048, false, false, true, false, true},
      {5120, 2048, 16, 2048, false, false, false, true, false},  // 4 chunks of 4 rows (grid z)
      {2048, 4096, 1, 4096, false, true, true, false, true},     // o_proj into the residual
      {2048, 4096, 3, 4096, false, true, true, false, false},
      {2048, 4096, 4, 4096, false, true, false, true, true},     // long rows loaded twice
      {333, 768, 2, 800, false, false, false, false, false},     // row stride > K
      {67, 1088, 5, 1088, true, false, false, false, false},      // K not a multiple of 1024
      {129, 64, 13, 64, true, true, false, true, true},
      {80, 192, 7, 200, false, false, true, false, false},
      {40, 1024, 16, 1024, true, false, false, false, true},
      {2048, 768, 16, 768, false, true, true, false, false},     // tile loop without chained refills
  };
  uint64_t seed = 900;
  for (const DenseCase& c : cases) {
    // a static amax below the rows' own saturates the largest elements, as quantize() does
    const QConfig xc = act_cfg(c.static_amax, c.static_amax ? 3.f : 0.f);
    const std::string what = "N=" + std::to_string(c.n) + " K=" + std::to_string(c.k) + " rows=" +
                             std::to_string(c.rows) + " ld=" + std::to_string(c.ld) +
                             (c.static_amax ? " static" : " per-row") + (c.accumulate ? " accumulate" : "") +
                             (c.early ? " early" : "");
    ASSERT_TRUE(w4a4_gemv_fused_supported(xc, c.k, 1)) << what;
    const std::vector<float> xs = random_matrix(c.rows, c.ld, seed++);
    const std::vector<float> y0 = random_matrix(c.rows, c.n, seed++);
    DeviceQTensor wq = random_weight(c.n, c.k, c.tiles, c.w_row_amax, seed++);
    DeviceArray<float> dxs, xc_dense(c.rows * c.k), yref(c.rows * c.n), yf(c.rows * c.n);
    dxs.upload(xs);
    // unfused: the rows packed (row stride K), quantize(), the GEMV
    for (int64_t r = 0; r < c.rows; ++r)
      QUADS_CUDA_CHECK(cudaMemcpy(xc_dense.data() + r * c.k, dxs.data() + r * c.ld, sizeof(float) * c.k,
                                  cudaMemcpyDeviceToDevice));
    DeviceQTensor xq = make_qtensor(c.rows, c.k, xc);
    quantize(xc_dense.data(), xq);
    W4A4Options opt;
    opt.tile = W4A4Tile::Gemv;
    if (c.accumulate) yref.upload(y0);
    else yref.fill_bytes(0xFF);
    w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), yref.data(), c.accumulate, nullptr, opt);

    const std::vector<float> ref = yref.download();

    FusedAct a;
    a.x = dxs.data();
    a.ld = c.ld;
    a.rows = c.rows;
    a.k = c.k;
    a.cfg = xc;
    a.weights_ready = c.early;
    for (bool loop : {false, true}) {
      TileLoop tl(loop);
      const std::string w = what + (loop ? " tile loop" : "");
      if (c.accumulate) yf.upload(y0);
      else yf.fill_bytes(0xFF);  // NaN poison: every output must be written
      w4a4_gemv_fused(a, nvfp4_view(wq), yf.data(), c.accumulate);
      expect_same_bits(ref, yf.download(), w);
      if (loop) {
        if (c.accumulate) yf.upload(y0);
        else yf.fill_bytes(0xFF);
        w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), yf.data(), c.accumulate, nullptr, opt);
        expect_same_bits(ref, yf.download(), w + " (plain GEMV)");
      }
    }
  }
}

namespace {

// A random top-k routing of T tokens over E experts, some experts left empty (only the first
// `used` experts are chosen), in expert order: eoff [E + 1] and perm [T * topk] (perm[r] =
// t * topk + j, kern::gather_rows' index with div = topk).
void route(int64_t T, int topk, int E, int used, uint64_t seed, std::vector<int32_t>& eoff, std::vector<int32_t>& perm) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> rows(E);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> e(used);
    std::iota(e.begin(), e.end(), 0);
    std::shuffle(e.begin(), e.end(), rng);
    for (int j = 0; j < topk; ++j) rows[e[j]].push_back(static_cast<int32_t>(t * topk + j));
  }
  eoff.assign(E + 1, 0);
  perm.clear();
  for (int e = 0; e < E; ++e) {
    eoff[e + 1] = eoff[e] + static_cast<int32_t>(rows[e].size());
    perm.insert(perm.end(), rows[e].begin(), rows[e].end());
  }
}

struct GroupedCase {
  int64_t tokens;
  int topk, experts, used;
  int64_t n, k;
  bool swiglu, static_amax, w_row_amax;
};

}  // namespace

// Grouped over experts: the MoE gather (row map) and the SwiGLU source, empty experts, uneven
// rows (up to 16 per expert: several passes of the GEMV's row loop).
TEST(CudaW4A4Fused, GroupedMatchesGatherQuantizeThenGemv) {
  QUADS_REQUIRE_GPU();
  TileLoop off(false);  // the reference: one tile per CTA
  const std::vector<GroupedCase> cases = {
      {1, 8, 64, 64, 1536, 2048, false, false, false},  // gate/up, decode batch 1
      {4, 8, 64, 64, 1536, 2048, false, false, false},
      {16, 8, 64, 24, 1536, 2048, false, false, true},  // ~5 rows per expert, 40 experts empty
      {1, 8, 64, 64, 2048, 768, true, false, false},    // down from the SwiGLU of gate/up
      {4, 8, 64, 64, 2048, 768, true, false, true},
      {16, 8, 64, 9, 2048, 768, true, false, false},    // up to 16 rows per expert
      {7, 2, 5, 4, 200, 1088, false, true, false},      // K not a multiple of 1024, static amax
      {11, 3, 9, 6, 72, 192, true, true, true},
  };
  uint64_t seed = 1700;
  for (const GroupedCase& c : cases) {
    const QConfig xc = act_cfg(c.static_amax, c.static_amax ? 2.f : 0.f);
    const int64_t R = c.tokens * c.topk, K = c.k, N = c.n;
    const std::string what = "T=" + std::to_string(c.tokens) + " top" + std::to_string(c.topk) + " of " +
                             std::to_string(c.experts) + " (" + std::to_string(c.used) + " used) N=" +
                             std::to_string(N) + " K=" + std::to_string(K) + (c.swiglu ? " swiglu" : " gather") +
                             (c.static_amax ? " static" : " per-row");
    ASSERT_TRUE(w4a4_gemv_fused_supported(xc, K, 1)) << what;
    std::vector<int32_t> eoff, perm;
    route(c.tokens, c.topk, c.experts, c.used, seed++, eoff, perm);
    const std::vector<DeviceQTensor>& pool = expert_pool(N, K, c.w_row_amax);
    std::vector<Nvfp4Weight> tab;
    for (int e = 0; e < c.experts; ++e) {
      const Nvfp4View v = nvfp4_view(pool[e % pool.size()]);
      tab.push_back({v.codes, v.scales, v.amax});
    }
    DeviceArray<Nvfp4Weight> dtab;
    dtab.upload(tab);
    DeviceArray<int32_t> deoff, dperm;
    deoff.upload(eoff);
    dperm.upload(perm);

    // the unfused sequence: X in expert order, quantize(), the grouped GEMV
    DeviceArray<float> src, xe(R * K), yref(R * N), yf(R * N);
    FusedAct a;
    a.rows = R;
    a.k = K;
    a.cfg = xc;
    if (c.swiglu) {
      src.upload(random_matrix(R, 2 * K, seed++));  // the gate/up product [R, 2I], I = K
      kern::swiglu(src.data(), src.data() + K, 2 * K, R, K, xe.data(), nullptr);
      a.x = src.data();
      a.u = src.data() + K;
      a.ld = 2 * K;
    } else {
      src.upload(random_matrix(c.tokens, K, seed++));  // normed hidden rows [T, H]
      kern::gather_rows(src.data(), dperm.data(), R, c.topk, K, xe.data(), nullptr);
      a.x = src.data();
      a.ld = K;
      a.map = dperm.data();
      a.map_div = c.topk;
    }
    DeviceQTensor xq = make_qtensor(R, K, xc);
    quantize(xe.data(), xq);
    yref.fill_bytes(0xFF);
    w4a4_gemm_grouped(nvfp4_view(xq), dtab.data(), c.w_row_amax, N, c.experts, deoff.data(), c.tokens, yref.data(),
                      nullptr, 0, W4A4Tile::Gemv);
    const std::vector<float> ref = yref.download();
    for (bool loop : {false, true}) {
      TileLoop tl(loop);
      const std::string w = what + (loop ? " tile loop" : "");
      yf.fill_bytes(0xFF);
      w4a4_gemv_fused_grouped(a, dtab.data(), c.w_row_amax, N, c.experts, deoff.data(), c.tokens, yf.data());
      expect_same_bits(ref, yf.download(), w);
      if (loop) {
        yf.fill_bytes(0xFF);
        w4a4_gemm_grouped(nvfp4_view(xq), dtab.data(), c.w_row_amax, N, c.experts, deoff.data(), c.tokens, yf.data(),
                          nullptr, 0, W4A4Tile::Gemv);
        expect_same_bits(ref, yf.download(), w + " (plain GEMV)");
      }
    }
  }
}

// Non-finite inputs: a NaN or inf in a row makes that row's amax NaN / inf exactly as quantize()
// does, and the outputs follow bit for bit (NaN payloads included).
TEST(CudaW4A4Fused, NonFiniteRowsMatch) {
  QUADS_REQUIRE_GPU();
  const int64_t rows = 4, K = 2048, N = 96;
  std::vector<float> x = random_matrix(rows, K, 41);
  x[1 * K + 7] = std::numeric_limits<float>::infinity();
  x[2 * K + 1000] = std::nanf("");
  x[3 * K + 2047] = -std::numeric_limits<float>::infinity();
  DeviceArray<float> dx, yref(rows * N), yf(rows * N);
  dx.upload(x);
  DeviceQTensor wq = random_weight(N, K, true, false, 42);
  const QConfig xc = act_cfg(false);
  DeviceQTensor xq = make_qtensor(rows, K, xc);
  quantize(dx.data(), xq);
  W4A4Options opt;
  opt.tile = W4A4Tile::Gemv;
  w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), yref.data(), false, nullptr, opt);
  FusedAct a;
  a.x = dx.data();
  a.ld = K;
  a.rows = rows;
  a.k = K;
  a.cfg = xc;
  w4a4_gemv_fused(a, nvfp4_view(wq), yf.data());
  const std::vector<float> ref = yref.download(), got = yf.download();
  EXPECT_EQ(std::memcmp(ref.data(), got.data(), ref.size() * sizeof(float)), 0)
      << "first mismatch at " << first_float_mismatch(ref, got);
  EXPECT_TRUE(std::isfinite(ref[0]));
  EXPECT_TRUE(std::isnan(ref[2 * N]));
}

// The fused quantizer exists only where it can reproduce quantize(); the calls refuse the rest.
TEST(CudaW4A4Fused, SupportedRule) {
  const QConfig row = act_cfg(false), stat = act_cfg(true, 4.f);
  for (int64_t m = 1; m <= kGemvFusedMaxRows; ++m) {
    EXPECT_TRUE(w4a4_gemv_fused_supported(row, 2048, m)) << m;
    EXPECT_TRUE(w4a4_gemv_fused_supported(stat, 768, m)) << m;
  }
  EXPECT_FALSE(w4a4_gemv_fused_supported(row, 2048, 0));
  EXPECT_FALSE(w4a4_gemv_fused_supported(row, 2048, kGemvFusedMaxRows + 1));
  EXPECT_FALSE(w4a4_gemv_fused_supported(QConfig::nvfp4_act(), 2048, 1));  // per-tensor amax: needs all rows
  QConfig sr = row;
  sr.stochastic = true;
  EXPECT_FALSE(w4a4_gemv_fused_supported(sr, 2048, 1));
  EXPECT_FALSE(w4a4_gemv_fused_supported(QConfig::nvfp4_kv(), 2048, 1));  // E1M2 elements
  EXPECT_FALSE(w4a4_gemv_fused_supported(QConfig::mxfp4(), 2048, 1));
  EXPECT_FALSE(w4a4_gemv_fused_supported(QConfig::fp8(num::Block::B1x128), 2048, 1));
  QConfig tiles = row;
  tiles.block = num::Block::B16x16;
  EXPECT_FALSE(w4a4_gemv_fused_supported(tiles, 2048, 1));
  EXPECT_FALSE(w4a4_gemv_fused_supported(row, 2000, 1));  // K % 64
  EXPECT_FALSE(w4a4_gemv_fused_supported(row, 0, 1));
  EXPECT_FALSE(w4a4_gemv_fused_supported(row, int64_t(1) << 20, 1));  // a row does not fit in shared memory
}

TEST(CudaW4A4Fused, RejectsWhatItCannotDo) {
  QUADS_REQUIRE_GPU();
  const int64_t K = 256, N = 32;
  DeviceQTensor wq = random_weight(N, K, true, false, 5);
  DeviceArray<float> x(2 * K + 4), y(2 * N);
  FusedAct a;
  a.x = x.data();
  a.ld = K;
  a.rows = 2;
  a.k = K;
  a.cfg = QConfig::nvfp4_act();  // per-tensor amax
  EXPECT_THROW(w4a4_gemv_fused(a, nvfp4_view(wq), y.data()), Error);
  a.cfg = act_cfg(false);
  a.x = x.data() + 1;  // not 16-byte aligned
  EXPECT_THROW(w4a4_gemv_fused(a, nvfp4_view(wq), y.data()), Error);
  a.x = x.data();
  a.ld = K + 2;  // not a multiple of 4
  EXPECT_THROW(w4a4_gemv_fused(a, nvfp4_view(wq), y.data()), Error);
  a.ld = K;
  a.k = K - 64;  // X and W disagree on K
  EXPECT_THROW(w4a4_gemv_fused(a, nvfp4_view(wq), y.data()), Error);
}
