// GPU GEMMs against CPU GEMMs of the dequantized operands (double accumulation). The GPU
// accumulates in float32 in another order, so results agree to ~1e-5 relative, not bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "cuda/gemm.h"

using namespace quads;
using namespace quads::cuda;
using namespace quads::cuda::testing;
using num::Block;
using num::Global;
using num::QConfig;

namespace {

// ref[m, n] = sum_k x[m, k] w[n, k] in double, and the sum of |products| (the scale of the
// rounding error an fp32 accumulation can make).
void ref_gemm(const std::vector<float>& x, const std::vector<float>& w, int64_t M, int64_t N, int64_t K,
              std::vector<double>& ref, std::vector<double>& absref) {
  ref.assign(M * N, 0.0);
  absref.assign(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(x[m * K + k]) * w[n * K + k];
        s += p;
        a += std::fabs(p);
      }
      ref[m * N + n] = s;
      absref[m * N + n] = a;
    }
}

// ||y - ref|| / ||ref|| <= rel, and every element within elem_rel of its |product| sum.
void expect_close(const std::vector<float>& y, const std::vector<double>& ref, const std::vector<double>& absref,
                  double rel, double elem_rel, const std::string& what) {
  ASSERT_EQ(y.size(), ref.size()) << what;
  double num = 0, den = 0;
  int64_t bad = -1;
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_FALSE(std::isnan(y[i])) << what << " at " << i;
    const double d = y[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    if (bad < 0 && std::fabs(d) > elem_rel * absref[i] + 1e-30) bad = static_cast<int64_t>(i);
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), rel) << what;
  EXPECT_EQ(bad, -1) << what << ": y=" << (bad >= 0 ? y[bad] : 0.f) << " ref=" << (bad >= 0 ? ref[bad] : 0.0);
}

std::vector<float> dequant_cpu(const num::QTensor& q) {
  std::vector<float> v(q.rows * q.cols);
  num::dequantize(q, v.data());
  return v;
}

struct Shape {
  int64_t m, n, k;
};

// A decode-shaped W4A4 problem: X [M, K] and W [N, K] quantized on the CPU (per-row or per-tensor
// amax of both, 1x16 or 16x16 weight blocks) and copied to the device, the float64 reference of
// X . W^T and of y0 + X . W^T (y0 random), and a name for messages. Seeds: x, w, y0 in turn.
struct DecodeCase {
  int64_t M, N, K;
  std::vector<float> y0;
  std::vector<double> ref, absref, refa, absa;
  DeviceQTensor dxq, dwq;
  std::string what;
  DecodeCase(int64_t m, int64_t n, int64_t k, bool per_row, bool w2d, uint64_t& seed) : M(m), N(n), K(k) {
    QConfig xc = QConfig::nvfp4_act(), wc = QConfig::nvfp4_weight(w2d);
    xc.global = per_row ? Global::PerRow : Global::PerTensor;
    if (per_row && !w2d) wc.global = Global::PerRow;
    const std::vector<float> x = random_matrix(M, K, seed++), w = random_matrix(N, K, seed++);
    y0 = random_matrix(M, N, seed++);
    const num::QTensor xq = num::quantize(x.data(), M, K, xc), wq = num::quantize(w.data(), N, K, wc);
    ref_gemm(dequant_cpu(xq), dequant_cpu(wq), M, N, K, ref, absref);
    refa = ref, absa = absref;
    for (size_t i = 0; i < refa.size(); ++i) {
      refa[i] += y0[i];
      absa[i] += std::fabs(y0[i]);
    }
    dxq = to_device(xq), dwq = to_device(wq);
    what = "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
           (per_row ? " per-row amax" : " per-tensor amax") + (w2d ? " w 16x16" : "");
  }
  // Runs the GEMM with opt: every output written and within the reference's tolerance, a second
  // run the same bits, and y0 + X . W^T when accumulating. Returns the first run's y.
  std::vector<float> check(const W4A4Options& opt, const std::string& tag) {
    DeviceArray<float> y(M * N);
    y.fill_bytes(0xFF);  // NaN poison: every output must be written
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, opt);
    const std::vector<float> first = y.download();
    expect_close(first, ref, absref, 1e-5, 1e-4, what + tag);
    y.fill_bytes(0xFF);
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, opt);
    EXPECT_EQ(first_float_mismatch(first, y.download()), -1) << what << tag << ": repeat run differs";
    y.upload(y0);
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), true, nullptr, opt);
    expect_close(y.download(), refa, absa, 1e-5, 1e-4, what + tag + " accumulate");
    return first;
  }
};

}  // namespace

// The emulated W4A4 GEMM against float64 GEMM of the CPU-dequantized operands, for each tile
// configuration, split-K choice, global-scale mode and 1-D / 2-D weight blocks.
TEST(CudaGemm, W4A4MatchesDequantizedCpuGemm) {
  QUADS_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 8, 64}, {5, 200, 192}, {16, 768, 2048}, {17, 96, 320},
                                     {64, 136, 768}, {100, 256, 1024}, {300, 130, 576}};
  uint64_t seed = 100;
  for (const Shape& s : shapes) {
    for (bool x_row : {false, true})
      for (bool w2d : {false, true}) {
        if (w2d && s.n % 16) continue;
        QConfig xc = QConfig::nvfp4_act();
        if (x_row) xc.global = Global::PerRow;
        const QConfig wc = QConfig::nvfp4_weight(w2d);
        const std::vector<float> x = random_matrix(s.m, s.k, seed++), w = random_matrix(s.n, s.k, seed++);
        const num::QTensor xq = num::quantize(x.data(), s.m, s.k, xc), wq = num::quantize(w.data(), s.n, s.k, wc);
        std::vector<double> ref, absref;
        ref_gemm(dequant_cpu(xq), dequant_cpu(wq), s.m, s.n, s.k, ref, absref);
        DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
        DeviceArray<float> y(s.m * s.n);
        std::vector<W4A4Tile> tiles = {W4A4Tile::M16,  W4A4Tile::M16W4, W4A4Tile::M16N64, W4A4Tile::M16W4S3,
                                       W4A4Tile::M64,  W4A4Tile::M128,  W4A4Tile::Gemv,   W4A4Tile::Skinny};
        if (w4a4_wgmma_available()) tiles.insert(tiles.end(), {W4A4Tile::Wg128, W4A4Tile::Wg256});
        for (W4A4Tile tile : tiles)
          for (int splits : {1, 0, 3}) {
            if (tile == W4A4Tile::Gemv && splits != 1) continue;  // the GEMV does not split K
            if (tile == W4A4Tile::Skinny && splits == 3) continue;  // 1, 2, 4 or 8 warps a row tile
            const std::string what = "M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) + " K=" +
                                     std::to_string(s.k) + " tile=" + std::to_string(static_cast<int>(tile)) +
                                     " splits=" + std::to_string(splits) + (x_row ? " x per-row" : "") +
                                     (w2d ? " w 16x16" : "");
            y.fill_bytes(0xFF);  // NaN poison: every output must be written
            W4A4Options opt;
            opt.tile = tile;
            opt.splits = splits;
            w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, opt);
            expect_close(y.download(), ref, absref, 1e-5, 1e-4, what);
          }
      }
  }
}

// The warpgroup tiles exist on every sm_90 GPU this library runs on (the build always holds their
// sm_90a code), and nowhere else; at 8192 x 1536 x 2048 (several waves of CTAs, K split off and
// on) they stay within FP32 rounding of the mma.sync tile, whose sums they reorder.
TEST(CudaGemm, W4A4WarpgroupTilesOnHopper) {
  QUADS_REQUIRE_GPU();
  int dev = 0, major = 0, minor = 0;
  QUADS_CUDA_CHECK(cudaGetDevice(&dev));
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  EXPECT_EQ(w4a4_wgmma_available(), major == 9 && minor == 0);
  if (!w4a4_wgmma_available()) {
    W4A4Options o;
    o.tile = W4A4Tile::Wg128;
    DeviceQTensor a = make_qtensor(128, 64, QConfig::nvfp4_act()), b = make_qtensor(128, 64, QConfig::nvfp4_act());
    DeviceArray<float> y(128 * 128);
    EXPECT_THROW(w4a4_gemm_emulated(nvfp4_view(a), nvfp4_view(b), y.data(), false, nullptr, o), Error);
    return;
  }
  const int64_t M = 1000, N = 1536, K = 2048;
  QConfig xc = QConfig::nvfp4_act();
  xc.global = Global::PerRow;
  const std::vector<float> x = random_matrix(M, K, 41), w = random_matrix(N, K, 42);
  const num::QTensor xq = num::quantize(x.data(), M, K, xc), wq = num::quantize(w.data(), N, K, QConfig::nvfp4_weight(false));
  DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
  DeviceArray<float> y(M * N);
  auto run = [&](W4A4Tile tile, int splits) {
    W4A4Options o;
    o.tile = tile;
    o.splits = splits;
    y.fill_bytes(0xFF);
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, o);
    return y.download();
  };
  const std::vector<float> ref = run(W4A4Tile::M128, 1);
  double mag = 0;
  for (float v : ref) mag = std::max(mag, std::fabs(double(v)));
  for (W4A4Tile tile : {W4A4Tile::Wg128, W4A4Tile::Wg256, W4A4Tile::Auto})
    for (int splits : {1, 2}) {
      const std::vector<float> got = run(tile, splits);
      double err = 0;
      for (size_t i = 0; i < ref.size(); ++i) err = std::max(err, std::fabs(double(got[i]) - ref[i]));
      EXPECT_LE(err, 2e-6 * mag) << "tile " << static_cast<int>(tile) << " splits " << splits;
      EXPECT_EQ(first_float_mismatch(got, run(tile, splits)), -1) << "tile " << static_cast<int>(tile) << ": repeat run differs";
    }
}

// The 16-row tile variants differ only in how the CTA's columns are split over warps and CTAs:
// every output is the same MMA chain over K, so the bits must agree (Auto may pick any of them).
TEST(CudaGemm, W4A4M16VariantsAgreeBitwise) {
  QUADS_REQUIRE_GPU();
  const int64_t M = 20, N = 200, K = 1024;
  const std::vector<float> x = random_matrix(M, K, 31), w = random_matrix(N, K, 32);
  QConfig xc = QConfig::nvfp4_act();
  xc.global = Global::PerRow;
  const num::QTensor xq = num::quantize(x.data(), M, K, xc), wq = num::quantize(w.data(), N, K, QConfig::nvfp4_weight(false));
  DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
  for (int splits : {1, 3}) {
    std::vector<std::vector<float>> out;
    for (W4A4Tile tile : {W4A4Tile::M16, W4A4Tile::M16W4, W4A4Tile::M16N64, W4A4Tile::M16W4S3}) {
      DeviceArray<float> y(M * N);
      y.fill_bytes(0xFF);
      W4A4Options opt;
      opt.tile = tile;
      opt.splits = splits;
      w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, opt);
      out.push_back(y.download());
    }
    for (size_t v = 1; v < out.size(); ++v)
      ASSERT_EQ(0, std::memcmp(out[0].data(), out[v].data(), out[0].size() * sizeof(float)))
          << "variant " << v << " splits " << splits;
  }
}

// The skinny tiles (weights as the MMA's A operand) against float64 GEMM of the CPU-dequantized
// operands: rows of X from 1 to 64 (8 to 64 rows a chunk, and several chunks), N not a multiple of
// a CTA's rows (warps without rows), K with a half last stage (192) and up to 4096, K split over
// 1, 2, 4 and 8 warps and, for dense calls of more than 8 rows, over the 2, 4 or 8 CTAs of a
// cluster (also more CTAs than stages: some hold none), per-row and per-tensor amax, overwrite
// and accumulate. Without a K split every output is the 16-row tile's MMA chain with the operands'
// roles swapped: the same bits as M16 with one split. Two runs give the same bits, and Auto takes
// the skinny tiles from kGemvAutoMaxRows + 1 to kSkinnyDenseMaxRows rows.
TEST(CudaGemm, SkinnyMatchesDequantizedCpuGemm) {
  QUADS_REQUIRE_GPU();
  uint64_t seed = 700;
  for (int64_t K : {64, 192, 768, 2048, 4096})
    for (int64_t M : {1, 5, 8, 9, 16, 17, 40, 64}) {
      const bool w2d = M % 2 == 1;
      DecodeCase d(M, w2d ? 144 : K >= 2048 ? 67 : 200, K, (M + K / 64) % 2 == 0, w2d, seed);
      const int64_t N = d.N;
      DeviceQTensor &dxq = d.dxq, &dwq = d.dwq;
      DeviceArray<float> y(M * N);
      const std::string& shape = d.what;
      std::vector<float> one_split;
      for (int ks : {1, 2, 4, 8}) {
        W4A4Options opt;
        opt.tile = W4A4Tile::Skinny;
        opt.splits = ks;
        const std::vector<float> first = d.check(opt, " ks=" + std::to_string(ks));
        if (ks == 1) one_split = first;
      }
      if (M > 8) {
        for (int cl : {2, 4, 8}) {
          W4A4Options opt;
          opt.tile = W4A4Tile::Skinny;
          opt.splits = cl == 4 ? 2 : 1;
          opt.kcluster = cl;
          d.check(opt, " cluster=" + std::to_string(cl) + " ks=" + std::to_string(opt.splits));
        }
        // X's rows split over the grid's rows of CTAs (16 or 32 a CTA) or not: the same bits
        for (int cl : {1, 2, 4}) {
          std::vector<float> whole;
          for (int rb : {64, 32, 16}) {
            W4A4Options opt;
            opt.tile = W4A4Tile::Skinny;
            opt.kcluster = cl;
            opt.row_block = rb;
            const std::vector<float> got =
                d.check(opt, " cluster=" + std::to_string(cl) + " rows a CTA " + std::to_string(rb));
            if (rb == 64) whole = got;
            else EXPECT_EQ(first_float_mismatch(whole, got), -1) << shape << " cluster " << cl << ", rows a CTA " << rb;
          }
        }
        W4A4Options chosen;
        chosen.tile = W4A4Tile::Skinny;
        const std::vector<float> own = d.check(chosen, " skinny, own choice");
        chosen.weights_ready = true;  // the first weight stages before pdl_begin(): the same bits
        EXPECT_EQ(first_float_mismatch(own, d.check(chosen, " skinny, weights_ready")), -1) << shape;
      }
      W4A4Options m16;
      m16.tile = W4A4Tile::M16;
      m16.splits = 1;
      y.fill_bytes(0xFF);
      w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, m16);
      EXPECT_EQ(first_float_mismatch(one_split, y.download()), -1) << shape << ": skinny (1 warp a tile) vs M16 (1 split)";
      if (M > kGemvAutoMaxRows && M <= kSkinnyDenseMaxRows) {
        W4A4Options chosen;
        chosen.tile = W4A4Tile::Skinny;  // splits 0: the kernel's own choice, as Auto's
        y.fill_bytes(0xFF);
        w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, chosen);
        const std::vector<float> want = y.download();
        y.fill_bytes(0xFF);
        w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, {});
        EXPECT_EQ(first_float_mismatch(want, y.download()), -1) << shape << ": Auto is not the skinny tiles";
      }
    }
}

// X as FP16 fragments (Nvfp4View::frag, from w4a4_x_frag): the dense skinny tiles copy them
// instead of staging the codes, and Auto splits K over a CTA's warps where it split it over a
// cluster: the same bits as the codes path, for Auto and for explicit splits and clusters, plain
// and accumulating, in the tiles of 16 rows and in those of 8 (at most 8 rows: they copy the first
// n-tile of the 16-row layout), and at 17-64 rows (chunks of 16 rows, the rows split over CTAs,
// 16 a CTA under Auto; explicit splits keep the rows in one CTA); Auto's GEMV (at most
// kGemvAutoMaxRowsXFrag rows with fragments) and K % 128 != 0 ignore the fragments.
TEST(CudaGemm, SkinnyXFragSameBits) {
  QUADS_REQUIRE_GPU();
  uint64_t seed = 910;
  for (int64_t K : {128, 512, 2048, 4096, 192})
    for (int64_t M : {2, 3, 4, 7, 8, 9, 13, 16, 17, 32, 40, 64}) {
      DecodeCase d(M, K >= 2048 ? 520 : 2048, K, M % 2 == 1, false, seed);
      const int64_t N = d.N;
      DeviceArray<uint8_t> frag(x_frag_bytes(K, M));
      frag.fill_bytes(0xFF);  // NaN in every slot the fragments leave (rows past M)
      w4a4_x_frag(nvfp4_view(d.dxq), frag.data());
      Nvfp4View xv = nvfp4_view(d.dxq), xf = xv;
      xf.frag = frag.data();
      std::vector<std::pair<int, int>> plans = {{0, 0}, {1, 1}, {2, 1}, {4, 1}};
      if (M > 8) plans.insert(plans.end(), {{1, 2}, {1, 4}, {2, 2}});
      for (const auto& [ks, cl] : plans)
        for (bool acc : {false, true}) {
          W4A4Options opt;
          opt.tile = W4A4Tile::Skinny;
          opt.splits = ks;
          opt.kcluster = cl;
          opt.weights_ready = true;
          DeviceArray<float> y(M * N);
          auto run = [&](const Nvfp4View& x) {
            if (acc) y.upload(d.y0);
            else y.fill_bytes(0xFF);
            w4a4_gemm_emulated(x, nvfp4_view(d.dwq), y.data(), acc, nullptr, opt);
            return y.download();
          };
          const std::vector<float> want = run(xv), got = run(xf);
          const std::string what = d.what + " ks=" + std::to_string(ks) + " cl=" + std::to_string(cl) +
                                   (acc ? " accumulate" : "");
          EXPECT_EQ(first_float_mismatch(want, got), -1) << what;
          if (!acc) expect_close(got, d.ref, d.absref, 1e-5, 1e-4, what + " with fragments");
        }
      // Auto with fragments: the skinny tiles' bits from kGemvAutoMaxRowsXFrag + 1 rows (the codes
      // path takes the GEMV up to kGemvAutoMaxRows)
      DeviceArray<float> y(M * N);
      y.fill_bytes(0xFF);
      W4A4Options codes_opt;
      if (M > kGemvAutoMaxRowsXFrag && M <= kGemvAutoMaxRows) codes_opt.tile = W4A4Tile::Skinny;
      w4a4_gemm_emulated(xv, nvfp4_view(d.dwq), y.data(), false, nullptr, codes_opt);
      const std::vector<float> auto_codes = y.download();
      y.fill_bytes(0xFF);
      w4a4_gemm_emulated(xf, nvfp4_view(d.dwq), y.data(), false, nullptr, {});
      EXPECT_EQ(first_float_mismatch(auto_codes, y.download()), -1) << d.what << ": Auto with fragments";
      // the fragments are what the tiles read where they apply: NaN fragments give NaN outputs
      DeviceArray<uint8_t> poison(x_frag_bytes(K, M));
      poison.fill_bytes(0xFF);
      Nvfp4View xp = xv;
      xp.frag = poison.data();
      y.fill_bytes(0);
      w4a4_gemm_emulated(xp, nvfp4_view(d.dwq), y.data(), false, nullptr, {});
      const std::vector<float> got = y.download();
      const bool read = M > kGemvAutoMaxRowsXFrag && K % 128 == 0;
      EXPECT_EQ(std::isnan(got[0]), read) << d.what << ": " << (read ? "fragments not read" : "fragments read");
    }
}

// quantize() with a fragment buffer: the same codes, scales and amax as without, and the
// fragments w4a4_x_frag makes of those codes (per-row and per-tensor amax, K not a multiple of 128);
// other configs and more than kXFragMaxRows rows are refused.
TEST(CudaGemm, QuantizeWritesXFrag) {
  QUADS_REQUIRE_GPU();
  uint64_t seed = 930;
  for (int64_t K : {64, 2048, 4096, 2064})
    for (int64_t M : {1, 9, 16, 37, 64})
      for (bool per_row : {true, false}) {
        QConfig xc = QConfig::nvfp4_act();
        xc.global = per_row ? Global::PerRow : Global::PerTensor;
        const std::vector<float> x = random_matrix(M, K, seed++);
        DeviceArray<float> dx(M * K);
        dx.upload(x);
        DeviceQTensor a = make_qtensor(M, K, xc), b = make_qtensor(M, K, xc);
        DeviceArray<uint8_t> frag(x_frag_bytes(K, M)), want(x_frag_bytes(K, M));
        frag.fill_bytes(0x5A);
        want.fill_bytes(0x5A);
        quantize(dx.data(), a);
        quantize(dx.data(), b, nullptr, frag.data());
        w4a4_x_frag(nvfp4_view(a), want.data());
        const std::string what = "M=" + std::to_string(M) + " K=" + std::to_string(K) + (per_row ? " per-row" : "");
        EXPECT_EQ(first_mismatch(a.codes.download(), b.codes.download()), -1) << what;
        EXPECT_EQ(first_mismatch(a.scales.download(), b.scales.download()), -1) << what;
        EXPECT_EQ(first_float_mismatch(a.amax.download(), b.amax.download()), -1) << what;
        EXPECT_EQ(first_mismatch(frag.download(), want.download()), -1) << what << ": fragments";
      }
  DeviceArray<float> dx((kXFragMaxRows + 1) * 128);
  DeviceArray<uint8_t> frag(x_frag_bytes(128, kXFragMaxRows + 16));
  DeviceQTensor big = make_qtensor(kXFragMaxRows + 1, 128, QConfig::nvfp4_act());
  EXPECT_THROW(quantize(dx.data(), big, nullptr, frag.data()), Error);
  DeviceQTensor mx = make_qtensor(4, 128, QConfig::mxfp4());
  EXPECT_THROW(quantize(dx.data(), mx, nullptr, frag.data()), Error);
}

TEST(CudaGemm, W4A4AccumulatesAndIsDeterministic) {
  QUADS_REQUIRE_GPU();
  const int64_t M = 40, N = 264, K = 1536;
  const std::vector<float> x = random_matrix(M, K, 1), w = random_matrix(N, K, 2), y0 = random_matrix(M, N, 3);
  QConfig xc = QConfig::nvfp4_act();
  xc.global = Global::PerRow;
  const num::QTensor xq = num::quantize(x.data(), M, K, xc), wq = num::quantize(w.data(), N, K, QConfig::nvfp4_weight(false));
  std::vector<double> ref, absref;
  ref_gemm(dequant_cpu(xq), dequant_cpu(wq), M, N, K, ref, absref);
  for (size_t i = 0; i < ref.size(); ++i) {
    ref[i] += y0[i];
    absref[i] += std::fabs(y0[i]);
  }
  DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
  for (int splits : {1, 4}) {
    DeviceArray<float> y;
    y.upload(y0);
    W4A4Options opt;
    opt.splits = splits;
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), true, nullptr, opt);
    const std::vector<float> first = y.download();
    expect_close(first, ref, absref, 1e-5, 1e-4, "accumulate splits=" + std::to_string(splits));
    y.upload(y0);
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), true, nullptr, opt);
    EXPECT_EQ(first_float_mismatch(first, y.download()), -1) << "repeat run differs, splits=" << splits;
  }
}

// RAC: the residual GEMM over a list of W's 16-blocks equals the CPU GEMM of the dequantized
// compact residual with the gathered dequantized weight columns; gather_blocks is exact.
TEST(CudaGemm, RacGatherGemm) {
  QUADS_REQUIRE_GPU();
  std::mt19937_64 rng(9);
  for (const Shape& s : std::vector<Shape>{{3, 80, 512}, {16, 768, 2048}, {77, 144, 768}}) {
    const int64_t nb = s.k / 16;
    for (int64_t nsel : {int64_t(1), int64_t(5), nb / 8 + 3}) {
      std::vector<int32_t> all(nb);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> sel(all.begin(), all.begin() + nsel);
      const int64_t kp = (nsel * 16 + 63) / 64 * 64;  // padded to 4 blocks
      std::vector<int32_t> blocks(kp / 16, 0);
      std::copy(sel.begin(), sel.end(), blocks.begin());

      const std::vector<float> x = random_matrix(s.m, s.k, 50 + nsel), w = random_matrix(s.n, s.k, 60 + nsel);
      DeviceArray<float> dx, dg(s.m * kp);
      DeviceArray<int32_t> dblocks;
      dx.upload(x);
      dblocks.upload(blocks);
      gather_blocks(dx.data(), s.m, s.k, dblocks.data(), nsel, dg.data(), kp);
      std::vector<float> g(s.m * kp, 0.f);
      for (int64_t r = 0; r < s.m; ++r)
        for (int64_t i = 0; i < nsel; ++i)
          for (int j = 0; j < 16; ++j) g[r * kp + i * 16 + j] = x[r * s.k + sel[i] * 16 + j];
      ASSERT_EQ(first_float_mismatch(g, dg.download()), -1) << "gather_blocks";

      QConfig xc = QConfig::nvfp4_act();
      xc.global = Global::PerRow;
      const num::QTensor rq = num::quantize(g.data(), s.m, kp, xc);
      const num::QTensor wq = num::quantize(w.data(), s.n, s.k, QConfig::nvfp4_weight(true));
      const std::vector<float> wd = dequant_cpu(wq);
      std::vector<float> wsel(s.n * kp, 0.f);
      for (int64_t n = 0; n < s.n; ++n)
        for (int64_t i = 0; i < nsel; ++i)
          for (int j = 0; j < 16; ++j) wsel[n * kp + i * 16 + j] = wd[n * s.k + sel[i] * 16 + j];
      std::vector<double> ref, absref;
      ref_gemm(dequant_cpu(rq), wsel, s.m, s.n, kp, ref, absref);

      DeviceQTensor drq = to_device(rq), dwq = to_device(wq);
      DeviceArray<float> y(s.m * s.n);
      for (W4A4Tile tile : {W4A4Tile::Auto, W4A4Tile::M128, W4A4Tile::Gemv}) {
        y.fill_bytes(0xFF);
        W4A4Options opt;
        opt.tile = tile;
        w4a4_gemm_gather(nvfp4_view(drq), nvfp4_view(dwq), dblocks.data(), y.data(), false, nullptr, opt);
        expect_close(y.download(), ref, absref, 1e-5, 1e-4, "gather nsel=" + std::to_string(nsel) + " M=" + std::to_string(s.m));
      }
    }
  }
}

// The decode GEMV against float64 GEMM of the CPU-dequantized operands: few and odd row counts
// (R = 1, 2, 4, 8 rows per pass, 13 in two passes), odd N (a CTA's last warps without rows), K
// from one partial 1024-step to several, per-row and per-tensor amax of both operands,
// overwrite and accumulate; two runs give the same bits, and Auto takes the GEMV up to
// kGemvAutoMaxRows rows (same bits as the explicit choice).
TEST(CudaGemm, GemvMatchesDequantizedCpuGemm) {
  QUADS_REQUIRE_GPU();
  uint64_t seed = 500;
  for (int64_t K : {64, 192, 2048, 4096})
    for (int64_t M : {1, 2, 3, 5, 8, 13}) {
      // odd N: 8 weight rows per CTA, the last CTA partly empty; 16x16 weight blocks need N % 16 == 0
      const bool w2d = M % 3 == 0;
      DecodeCase d(M, w2d ? 80 : K >= 2048 ? 67 : 333, K, (M + K / 64) % 2 == 0, w2d, seed);  // both amax modes
      DeviceQTensor &dxq = d.dxq, &dwq = d.dwq;
      W4A4Options opt;
      opt.tile = W4A4Tile::Gemv;
      const std::vector<float> first = d.check(opt, "");
      if (M <= kGemvAutoMaxRows) {
        DeviceArray<float> y(M * d.N);
        y.fill_bytes(0xFF);
        w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), y.data(), false, nullptr, {});
        EXPECT_EQ(first_float_mismatch(first, y.download()), -1) << d.what << ": Auto is not the GEMV";
      }
    }
}

// A row's GEMV output does not depend on the other rows: the first and last rows of a 7-row call
// (passes of 4 rows) equal one-row calls bit for bit, with 1, 2 and 4 weight rows per warp.
TEST(CudaGemm, GemvRowIndependentOfM) {
  QUADS_REQUIRE_GPU();
  struct NK {
    int64_t n, k;
  };
  for (const NK& s : {NK{40, 1024}, NK{20000, 2048}, NK{20000, 1024}}) {
    const int64_t M = 7, N = s.n, K = s.k;
    const std::vector<float> x = random_matrix(M, K, 71 + N), w = random_matrix(N, K, 72 + N);
    const num::QTensor xq = num::quantize(x.data(), M, K, QConfig::nvfp4_act());
    const num::QTensor wq = num::quantize(w.data(), N, K, QConfig::nvfp4_weight(false));
    DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
    W4A4Options opt;
    opt.tile = W4A4Tile::Gemv;
    DeviceArray<float> ym(M * N), y1(N);
    w4a4_gemm_emulated(nvfp4_view(dxq), nvfp4_view(dwq), ym.data(), false, nullptr, opt);
    Nvfp4View x1 = nvfp4_view(dxq);
    for (int64_t r : {int64_t(0), M - 1}) {
      x1.codes = dxq.codes.data() + r * K / 2;
      x1.scales = dxq.scales.data() + r * K / 16;
      if (x1.amax_per_row) x1.amax = dxq.amax.data() + r;
      x1.rows = 1;
      w4a4_gemm_emulated(x1, nvfp4_view(dwq), y1.data(), false, nullptr, opt);
      const std::vector<float> all = ym.download();
      const std::vector<float> one(all.begin() + r * N, all.begin() + (r + 1) * N);
      EXPECT_EQ(first_float_mismatch(one, y1.download()), -1) << "N=" << N << " K=" << K << " row " << r;
    }
  }
}

TEST(CudaGemm, Bf16CublasMatchesCpu) {
  QUADS_REQUIRE_GPU();
  Blas blas;
  for (const Shape& s : std::vector<Shape>{{1, 768, 2048}, {33, 100, 96}, {256, 512, 768}}) {
    std::vector<float> x = random_matrix(s.m, s.k, 21), w = random_matrix(s.n, s.k, 22);
    std::vector<uint16_t> xb(x.size()), wb(w.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = from_bf16(xb[i] = to_bf16(x[i]));
    for (size_t i = 0; i < w.size(); ++i) w[i] = from_bf16(wb[i] = to_bf16(w[i]));
    std::vector<double> ref, absref;
    ref_gemm(x, w, s.m, s.n, s.k, ref, absref);
    DeviceArray<uint16_t> dx, dw;
    dx.upload(xb);
    dw.upload(wb);
    DeviceArray<float> y(s.m * s.n);
    gemm_bf16(blas, dx.data(), dw.data(), y.data(), s.m, s.n, s.k);
    expect_close(y.download(), ref, absref, 1e-5, 1e-4, "bf16 M=" + std::to_string(s.m));
  }
}

TEST(CudaGemm, Fp8CublasLtMatchesCpu) {
  QUADS_REQUIRE_GPU();
  Blas blas;
  for (const Shape& s : std::vector<Shape>{{16, 768, 2048}, {64, 96, 128}, {512, 256, 768}}) {
    const std::vector<float> x = random_matrix(s.m, s.k, 31), w = random_matrix(s.n, s.k, 32);
    const QConfig c = QConfig::fp8(Block::PerTensor);
    const num::QTensor xq = num::quantize(x.data(), s.m, s.k, c), wq = num::quantize(w.data(), s.n, s.k, c);
    std::vector<double> ref, absref;
    ref_gemm(dequant_cpu(xq), dequant_cpu(wq), s.m, s.n, s.k, ref, absref);
    DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
    DeviceArray<float> y(s.m * s.n);
    gemm_fp8(blas, dxq.codes.data(), dxq.fscales.data(), dwq.codes.data(), dwq.fscales.data(), y.data(), s.m, s.n, s.k);
    // Hopper's FP8 tensor cores accumulate with a narrower significand than FP32 (about 2^-13
    // relative per addition, measured here: ~3e-4 relative error over K = 2048), so FP8 gets a
    // wider tolerance than the FP16/BF16 paths.
    expect_close(y.download(), ref, absref, 2e-3, 2e-3, "fp8 M=" + std::to_string(s.m));
  }
}

// Blackwell only: cuBLASLt's native FP4 GEMM agrees with the emulation.
TEST(CudaGemm, NativeNvfp4MatchesEmulation) {
  QUADS_REQUIRE_GPU();
  if (!nvfp4_native_available()) GTEST_SKIP() << "no native FP4 GEMM on " << device_name(0);
  Blas blas;
  const int64_t M = 64, N = 256, K = 1024;
  const std::vector<float> x = random_matrix(M, K, 41), w = random_matrix(N, K, 42);
  QConfig xc = QConfig::nvfp4_act();
  xc.global = Global::PerRow;
  const num::QTensor xq = num::quantize(x.data(), M, K, xc), wq = num::quantize(w.data(), N, K, QConfig::nvfp4_weight(true));
  std::vector<double> ref, absref;
  ref_gemm(dequant_cpu(xq), dequant_cpu(wq), M, N, K, ref, absref);
  DeviceQTensor xs = to_device(xq, ScaleLayout::Swizzled128x4), ws = to_device(wq, ScaleLayout::Swizzled128x4);
  DeviceArray<float> y(M * N);
  w4a4_gemm_native(blas, xs, ws, y.data());
  expect_close(y.download(), ref, absref, 1e-5, 1e-4, "native nvfp4");
}

namespace {
// RAC folded: residual operands laid out densely over K (the selected 16-blocks hold a quantized
// residual, the others zero, as rac_quantize_fold writes them), concatenated operand after operand.
struct FoldOperands {
  std::vector<std::vector<float>> deq;  // per operand [rows, K], dequantized on the CPU
  DeviceArray<uint8_t> codes, scales;
  DeviceArray<float> amax;
  RacFold fold(int64_t rows, int nops, const std::vector<int64_t>& splits) const {
    RacFold f;
    f.codes = codes.data();
    f.scales = scales.data();
    f.amax = amax.data();
    f.rows = rows;
    f.nops = nops;
    for (size_t j = 0; j < splits.size(); ++j) f.split[j] = splits[j];
    return f;
  }
};
FoldOperands fold_operands(int64_t rows, int64_t K, int nops, uint64_t seed) {
  QConfig rc = QConfig::nvfp4_act();
  rc.global = Global::PerRow;
  FoldOperands o;
  std::vector<uint8_t> codes, scales;
  std::vector<float> amax;
  std::mt19937_64 rng(seed);
  for (int j = 0; j < nops; ++j) {
    std::vector<float> r = random_matrix(rows, K, seed + 11 * j);
    for (int64_t b = 0; b < K / 16; ++b) {  // about half of the blocks compensated, the same for every row
      if (rng() % 2 == 0) continue;
      for (int64_t m = 0; m < rows; ++m) std::fill_n(r.begin() + m * K + b * 16, 16, 0.f);
    }
    const num::QTensor q = num::quantize(r.data(), rows, K, rc);
    o.deq.push_back(dequant_cpu(q));
    codes.insert(codes.end(), q.codes.begin(), q.codes.end());
    scales.insert(scales.end(), q.scales.begin(), q.scales.end());
    amax.insert(amax.end(), q.amax.begin(), q.amax.end());
  }
  o.codes.upload(codes);
  o.scales.upload(scales);
  o.amax.upload(amax);
  return o;
}
// ref[m, n] += sum_k r[m, k] w[n, k] (double), absref += |products|.
void add_ref(const std::vector<float>& r, const std::vector<float>& w, int64_t m, int64_t n, int64_t K,
             std::vector<double>& ref, std::vector<double>& absref, int64_t ldr) {
  for (int64_t k = 0; k < K; ++k) {
    const double p = static_cast<double>(r[m * ldr + k]) * w[n * K + k];
    ref.back() += p;
    absref.back() += std::fabs(p);
  }
}
}  // namespace

// RAC folded into the main GEMM (w4a4_gemm_rac): y (+)= X . W^T + Xr_j . W^T (operand j for W's
// rows from split j - 1) against float64 of the CPU-dequantized operands, on the GEMV (1..3 rows)
// and the skinny tiles (clusters, row blocks, the K split over warps that keeps a CTA's rows on
// one side of a split), overwrite and accumulate, repeatable bits; and the grouped twin with and
// without a row map.
TEST(CudaGemm, W4A4RacFoldMatchesDequantizedCpuGemm) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t M, N, K;
    std::vector<int64_t> splits;  // nops - 1 entries
  };
  uint64_t seed = 4000;
  for (const Case& c : std::vector<Case>{{1, 640, 2048, {512, 576}},
                                         {2, 384, 128, {256, 320}},
                                         {3, 768, 1024, {384}},
                                         {5, 640, 512, {}},
                                         {16, 384, 512, {128, 256}},
                                         {33, 256, 256, {64}},
                                         {64, 1536, 2048, {768}}}) {
    const int nops = static_cast<int>(c.splits.size()) + 1;
    ASSERT_TRUE(w4a4_rac_fold_supported(c.M, c.K, false));
    QConfig xc = QConfig::nvfp4_act();
    xc.global = Global::PerRow;
    QConfig wc = QConfig::nvfp4_weight(false);
    wc.global = Global::PerRow;
    const std::vector<float> x = random_matrix(c.M, c.K, seed++), w = random_matrix(c.N, c.K, seed++);
    const std::vector<float> y0 = random_matrix(c.M, c.N, seed++);
    const num::QTensor xq = num::quantize(x.data(), c.M, c.K, xc), wq = num::quantize(w.data(), c.N, c.K, wc);
    const std::vector<float> xd = dequant_cpu(xq), wd = dequant_cpu(wq);
    const FoldOperands ops = fold_operands(c.M, c.K, nops, seed++);
    std::vector<double> ref, absref;
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n) {
        ref.push_back(0.0);
        absref.push_back(0.0);
        int j = 0;
        while (j + 1 < nops && n >= c.splits[size_t(j)]) ++j;
        add_ref(xd, wd, m, n, c.K, ref, absref, c.K);
        add_ref(ops.deq[size_t(j)], wd, m, n, c.K, ref, absref, c.K);
      }
    const std::string what = "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
                             " operands " + std::to_string(nops);
    DeviceQTensor dxq = to_device(xq), dwq = to_device(wq);
    const RacFold f = ops.fold(c.M, nops, c.splits);
    DeviceArray<float> y(c.M * c.N);
    y.fill_bytes(0xFF);
    w4a4_gemm_rac(nvfp4_view(dxq), nvfp4_view(dwq), f, y.data());
    const std::vector<float> first = y.download();
    expect_close(first, ref, absref, 1e-5, 1e-4, what);
    y.fill_bytes(0xFF);
    w4a4_gemm_rac(nvfp4_view(dxq), nvfp4_view(dwq), f, y.data());
    EXPECT_EQ(first_float_mismatch(first, y.download()), -1) << what << ": repeat run differs";
    y.upload(y0);
    w4a4_gemm_rac(nvfp4_view(dxq), nvfp4_view(dwq), f, y.data(), true);
    std::vector<double> refa = ref, absa = absref;
    for (size_t i = 0; i < refa.size(); ++i) {
      refa[i] += y0[i];
      absa[i] += std::fabs(y0[i]);
    }
    expect_close(y.download(), refa, absa, 1e-5, 1e-4, what + " accumulate");
    // a split off a multiple of 16 is refused
    if (nops > 1) {
      RacFold bad = f;
      bad.split[0] += 8;
      EXPECT_THROW(w4a4_gemm_rac(nvfp4_view(dxq), nvfp4_view(dwq), bad, y.data()), Error) << what;
    }
  }

  // grouped: E experts, rows in expert order, X read directly or through a map of T token rows
  struct GCase {
    int64_t T;
    int k, E;
    int64_t N, K;
    std::vector<int64_t> splits;
  };
  for (const GCase& c : std::vector<GCase>{{1, 8, 64, 1536, 2048, {768}},
                                           {2, 2, 8, 128, 128, {64}},
                                           {4, 8, 64, 1536, 2048, {768}},
                                           {16, 8, 16, 2048, 768, {}},
                                           {64, 8, 64, 256, 512, {128}},
                                           // 16 rows a chunk in CTAs of 16 warps (skinny_plan), one warp a row tile
                                           {64, 8, 64, 512, 2048, {256}},
                                           // the same with one stage of K and K split over 4 warps: the
                                           // warps' sums take more shared memory than X's fragments
                                           {64, 8, 8, 128, 128, {64}},
                                           // a split at an odd multiple of 16 rows: 8 warps a CTA
                                           {64, 8, 8, 96, 128, {48}}}) {
    const int nops = static_cast<int>(c.splits.size()) + 1;
    ASSERT_TRUE(w4a4_rac_fold_supported(c.T, c.K, true));
    const int64_t R = c.T * c.k;
    std::mt19937_64 rng(seed++);
    // each token picks k distinct experts; rows sorted by expert, map[r] = token * k + slot
    std::vector<std::vector<int32_t>> by_e(size_t(c.E));
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<int32_t> es(size_t(c.E));
      std::iota(es.begin(), es.end(), 0);
      std::shuffle(es.begin(), es.end(), rng);
      for (int s = 0; s < c.k; ++s) by_e[size_t(es[size_t(s)])].push_back(static_cast<int32_t>(t * c.k + s));
    }
    std::vector<int32_t> eoff(1, 0), map;
    for (int e = 0; e < c.E; ++e) {
      for (int32_t v : by_e[size_t(e)]) map.push_back(v);
      eoff.push_back(static_cast<int32_t>(map.size()));
    }
    QConfig xc = QConfig::nvfp4_act();
    xc.global = Global::PerRow;
    QConfig wc = QConfig::nvfp4_weight(false);
    wc.global = Global::PerRow;
    const std::vector<float> xt = random_matrix(c.T, c.K, seed++);
    std::vector<float> xg(size_t(R * c.K));  // the rows gathered in expert order
    for (int64_t r = 0; r < R; ++r)
      std::copy_n(xt.begin() + map[size_t(r)] / c.k * c.K, c.K, xg.begin() + r * c.K);
    const num::QTensor tq = num::quantize(xt.data(), c.T, c.K, xc), gq = num::quantize(xg.data(), R, c.K, xc);
    const std::vector<float> gd = dequant_cpu(gq);
    std::vector<DeviceQTensor> wdev;
    std::vector<std::vector<float>> wdq;
    std::vector<Nvfp4Weight> tab;
    for (int e = 0; e < c.E; ++e) {
      const std::vector<float> w = random_matrix(c.N, c.K, seed + 100 + e);
      const num::QTensor q = num::quantize(w.data(), c.N, c.K, wc);
      wdq.push_back(dequant_cpu(q));
      wdev.push_back(to_device(q));
    }
    seed += 200;
    for (const DeviceQTensor& q : wdev) tab.push_back({q.codes.data(), q.scales.data(), q.amax.data()});
    DeviceArray<Nvfp4Weight> dtab;
    dtab.upload(tab);
    DeviceArray<int32_t> deoff, dmap;
    deoff.upload(eoff);
    dmap.upload(map);
    const FoldOperands ops = fold_operands(R, c.K, nops, seed++);
    std::vector<double> ref, absref;
    for (int e = 0; e < c.E; ++e)
      for (int64_t r = eoff[size_t(e)]; r < eoff[size_t(e) + 1]; ++r)
        for (int64_t n = 0; n < c.N; ++n) {
          ref.push_back(0.0);
          absref.push_back(0.0);
          int j = 0;
          while (j + 1 < nops && n >= c.splits[size_t(j)]) ++j;
          add_ref(gd, wdq[size_t(e)], r, n, c.K, ref, absref, c.K);
          add_ref(ops.deq[size_t(j)], wdq[size_t(e)], r, n, c.K, ref, absref, c.K);
        }
    const std::string what = "grouped T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " E=" +
                             std::to_string(c.E) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K);
    const RacFold f = ops.fold(R, nops, c.splits);
    DeviceQTensor dgq = to_device(gq), dtq = to_device(tq);
    DeviceArray<float> y(R * c.N);
    std::vector<float> first;
    for (int mapped = 0; mapped < 2; ++mapped) {
      y.fill_bytes(0xFF);
      w4a4_gemm_grouped_rac(nvfp4_view(mapped ? dtq : dgq), mapped ? dmap.data() : nullptr, c.k, R, f, dtab.data(),
                            true, c.N, c.E, deoff.data(), c.T, y.data());
      const std::vector<float> got = y.download();
      expect_close(got, ref, absref, 1e-5, 1e-4, what + (mapped ? " mapped" : ""));
      if (mapped) EXPECT_EQ(first_float_mismatch(first, got), -1) << what << ": mapped rows differ from gathered";
      else first = got;
    }
  }
}
