// The GPU trainer's element-wise kernels in their bandwidth versions (row kernels, 16-byte vectors)
// against their former scalar versions (kern::set_legacy_train_kernels(true)): the same bits on
// ragged shapes (rows 1..37, columns not a multiple of 4 or 8, pointers off 16-byte alignment,
// so both the vector paths and their scalar fallbacks run). Outputs start as NaN bytes, so an
// element left unwritten fails too.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_tc.h"
#include "cuda/check.h"
#include "cuda/model_kernels.h"
#include "cuda/train_gpu_kernels.h"
#include "cuda/train_kernels.h"
#include "cuda_test_util.h"

using namespace quads;
using quads::cuda::DeviceArray;
namespace kern = quads::cuda::kern;

namespace {

// Restores the bandwidth kernels when a test ends, also on a failed assertion.
struct LegacyGuard {
  ~LegacyGuard() { kern::set_legacy_train_kernels(false); }
};

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  // Values whose BF16 rounding ties or carries, and specials.
  if (n > 4) {
    x[0] = 1.00390625f;  // halfway between two BF16 values
    x[1] = -0.f;
    x[2] = 3.0e38f;
    x[3] = 1e-40f;
  }
  return x;
}

template <typename T>
DeviceArray<T> dev(const std::vector<T>& v) {
  DeviceArray<T> a(std::max<size_t>(v.size(), 1));
  if (!v.empty()) a.upload(v);
  return a;
}

// Runs `fn` with the legacy kernels, then the new ones, on `out` (filled with NaN bytes before
// each), and expects the same bytes.
template <typename T, typename Fn>
void expect_same_bits(DeviceArray<T>& out, Fn fn, const std::string& what) {
  LegacyGuard guard;
  std::vector<T> res[2];
  for (int legacy = 1; legacy >= 0; --legacy) {
    kern::set_legacy_train_kernels(legacy == 1);
    out.fill_bytes(0xFF);
    fn();
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    res[legacy] = out.download();
  }
  ASSERT_EQ(res[0].size(), res[1].size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < res[0].size(); ++i)
    if (std::memcmp(&res[0][i], &res[1][i], sizeof(T)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements differ, first at " << first;
}

const int kRows[] = {1, 2, 3, 5, 8, 13, 21, 37};
const int kCols[] = {1, 3, 7, 8, 12, 13, 64, 100, 257};
const int kOffsets[] = {0, 1, 4};  // in elements: aligned, misaligned, aligned again

}  // namespace

TEST(CudaTrainElementwise, ToBf16AndRound) {
  QUADS_REQUIRE_GPU();
  for (int64_t n : {1, 3, 7, 8, 9, 17, 37, 1000, 4099, 70001}) {
    const auto x = randn(size_t(n) + 8, 11 + n, 100.f);
    DeviceArray<float> gx = dev(x);
    for (int xo : kOffsets)
      for (int oo : {0, 2, 8}) {
        DeviceArray<uint16_t> o(size_t(n) + 8);
        expect_same_bits(o, [&] { kern::to_bf16(gx.data() + xo, o.data() + oo, n, nullptr); },
                         "to_bf16 n " + std::to_string(n) + " offsets " + std::to_string(xo) + "/" + std::to_string(oo));
        DeviceArray<float> r(size_t(n) + 8);
        expect_same_bits(r, [&] { kern::bf16_round(gx.data() + xo, r.data() + oo / 2, n, nullptr); },
                         "bf16_round n " + std::to_string(n));
      }
    // In place (the trainer rounds buffers onto themselves).
    DeviceArray<float> inplace(x.size());
    expect_same_bits(inplace, [&] {
      inplace.upload(x);
      kern::bf16_round(inplace.data(), inplace.data(), n, nullptr);
    }, "bf16_round in place");
  }
}

TEST(CudaTrainElementwise, GatherCopyFillAddConcat) {
  QUADS_REQUIRE_GPU();
  for (int rows : kRows)
    for (int D : kCols)
      for (int off : kOffsets) {
        const std::string tag = " rows " + std::to_string(rows) + " D " + std::to_string(D) + " off " + std::to_string(off);
        const int div = 3, src_rows = (rows + 5) * div;
        const auto x = randn(size_t(src_rows) * D + 8, rows * 1000 + D);
        std::vector<int32_t> idx(rows);
        std::mt19937 rng(rows + D);
        for (auto& i : idx) i = static_cast<int32_t>(rng() % src_rows);
        DeviceArray<float> gx = dev(x);
        DeviceArray<int32_t> gi = dev(idx);
        DeviceArray<uint16_t> gb(size_t(rows) * D + 8);
        expect_same_bits(gb, [&] { kern::gather_rows_bf16(gx.data() + off, gi.data(), rows, div, D, gb.data() + off, nullptr); },
                         "gather_rows_bf16" + tag);

        for (int dw : {D, D + 3, std::max(1, D - 5), D + 8, 4 * ((D + 3) / 4)}) {
          DeviceArray<float> cc(size_t(rows) * dw + 8);
          expect_same_bits(cc, [&] { kern::copy_cols(gx.data() + off, rows, D, cc.data() + off, dw, nullptr); },
                           "copy_cols dw " + std::to_string(dw) + tag);
        }

        const int64_t n = int64_t(rows) * D;
        DeviceArray<float> f(size_t(n) + 8);
        expect_same_bits(f, [&] { kern::fill(f.data() + off, -2.5f, n, nullptr); }, "fill" + tag);

        const auto y = randn(size_t(n) + 8, 7 * n + 1);
        DeviceArray<float> gy = dev(y), s(size_t(n) + 8);
        expect_same_bits(s, [&] { kern::add(gx.data() + off, gy.data() + off, s.data() + off, n, nullptr); }, "add" + tag);
        expect_same_bits(s, [&] {  // out aliasing x
          s.upload(x.data(), size_t(n) + 8);
          kern::add(s.data() + off, gy.data() + off, s.data() + off, n, nullptr);
        }, "add aliased" + tag);

        for (auto [a, b, c] : {std::array<int, 3>{D, D, D}, {D, 4, 8}, {4 * D, D, D}, {8, 3, D}}) {
          const auto xa = randn(size_t(rows) * a + 8, 1 + a), xb = randn(size_t(rows) * b + 8, 2 + b),
                     xc = randn(size_t(rows) * c + 8, 3 + c);
          DeviceArray<float> ga = dev(xa), gb2 = dev(xb), gc = dev(xc), o(size_t(rows) * (a + b + c) + 8);
          expect_same_bits(o, [&] {
            kern::concat_cols3(ga.data() + off, gb2.data() + off, gc.data() + off, rows, a, b, c, o.data() + off, nullptr);
          }, "concat_cols3 " + std::to_string(a) + "/" + std::to_string(b) + "/" + std::to_string(c) + tag);
        }
      }
}

TEST(CudaTrainElementwise, RopeAndSwigluBwd) {
  QUADS_REQUIRE_GPU();
  for (int rows : kRows)
    for (int off : kOffsets) {
      for (int hd : {2, 6, 8, 16, 64, 128}) {
        for (int heads : {1, 3}) {
          const int half = hd / 2;
          const auto x = randn(size_t(rows) * heads * hd + 8, rows * 31 + hd);
          const auto cs = randn(size_t(rows) * half + 8, 5 + hd), sn = randn(size_t(rows) * half + 8, 6 + hd);
          DeviceArray<float> gc = dev(cs), gs = dev(sn), gx(x.size());
          for (bool bwd : {false, true}) {
            expect_same_bits(gx, [&] {
              gx.upload(x);
              if (bwd) kern::rope_bwd(gx.data() + off, rows, heads, hd, gc.data() + off, gs.data() + off, nullptr);
              else kern::rope_fwd(gx.data() + off, rows, heads, hd, gc.data() + off, gs.data() + off, nullptr);
            }, "rope hd " + std::to_string(hd) + " heads " + std::to_string(heads) + " rows " + std::to_string(rows) +
                   " off " + std::to_string(off) + (bwd ? " bwd" : " fwd"));
          }
        }
      }
      for (int I : {1, 3, 8, 13, 64, 100}) {
        const auto gu = randn(size_t(rows) * 2 * I + 8, rows * 17 + I, 4.f), dh = randn(size_t(rows) * I + 8, I + 3);
        DeviceArray<float> ggu = dev(gu), gdh = dev(dh), o(gu.size());
        expect_same_bits(o, [&] { kern::swiglu_bwd(ggu.data() + off, gdh.data() + off, rows, I, o.data() + off, nullptr); },
                         "swiglu_bwd I " + std::to_string(I) + " rows " + std::to_string(rows) + " off " + std::to_string(off));
      }
    }
}

TEST(CudaTrainElementwise, Nvfp4WeightAndMoeCombineScatter) {
  QUADS_REQUIRE_GPU();
  std::mt19937 rng(5);
  for (int rows : kRows)
    for (int cols : {16, 48, 64, 2048, 24}) {  // 24: no whole 16-blocks per row, the scalar kernel
      for (int off : {0, 8, 1}) {              // code / output offsets: aligned, 8 bytes, misaligned
        std::vector<uint8_t> codes(size_t(rows) * cols / 2 + 16), scales(size_t(rows) * (cols / 16) + 16);
        for (auto& b : codes) b = static_cast<uint8_t>(rng());
        for (auto& b : scales) b = static_cast<uint8_t>(rng() % 0x7F);  // finite E4M3
        DeviceArray<uint8_t> gc = dev(codes), gs = dev(scales);
        DeviceArray<float> amax = dev(std::vector<float>{3.75f}), alpha(1);
        DeviceArray<uint16_t> o(size_t(rows) * cols + 16);
        expect_same_bits(o, [&] {
          kern::nvfp4_weight_bf16(gc.data() + off, gs.data(), amax.data(), rows, cols, o.data() + off, alpha.data(), nullptr);
        }, "nvfp4_weight_bf16 rows " + std::to_string(rows) + " cols " + std::to_string(cols) + " off " + std::to_string(off));
        expect_same_bits(alpha, [&] {
          kern::nvfp4_weight_bf16(gc.data() + off, gs.data(), amax.data(), rows, cols, o.data() + off, alpha.data(), nullptr);
        }, "nvfp4_weight_bf16 alpha");
      }
    }
  for (int T : kRows)
    for (int D : kCols)
      for (int k : {1, 3, 8})
        for (int off : kOffsets) {
          const int64_t slots = int64_t(T) * k;
          std::vector<int32_t> perm(slots);
          for (int64_t i = 0; i < slots; ++i) perm[i] = static_cast<int32_t>(i);
          std::shuffle(perm.begin(), perm.end(), rng);
          const auto ye = randn(size_t(slots) * D + 8, T * 7 + D), w = randn(size_t(slots), k + D);
          const auto base = randn(size_t(T) * D + 8, T + 3 * D);
          DeviceArray<float> gye = dev(ye), gw = dev(w), y(size_t(T) * D + 8);
          DeviceArray<int32_t> ginv = dev(perm);
          const std::string tag = " T " + std::to_string(T) + " D " + std::to_string(D) + " k " + std::to_string(k) +
                                  " off " + std::to_string(off);
          expect_same_bits(y, [&] { kern::moe_combine_fwd(gye.data() + off, ginv.data(), gw.data(), T, k, D, y.data() + off, nullptr); },
                           "moe_combine_fwd" + tag);
          for (bool acc : {false, true})
            expect_same_bits(y, [&] {
              y.upload(base);
              kern::moe_scatter_add(gye.data() + off, ginv.data(), T, k, D, y.data() + off, acc, nullptr);
            }, std::string("moe_scatter_add") + (acc ? " accumulate" : "") + tag);
        }
}

// AttentionTc's pack / unpack / softmax kernels through fwd and bwd: ragged sequences (1 to 1100
// tokens: the 2-, 8- and 32-per-thread register softmax), GQA, query rows in blocks, and the
// FP32 forward.
TEST(CudaTrainElementwise, AttentionTcKernels) {
  QUADS_REQUIRE_GPU();
  struct Case {
    std::vector<int64_t> lens;
    int nh, nkv, hd;
    int64_t block_elems;
  };
  const std::vector<Case> cases = {
      {{1, 7, 37, 13}, 4, 2, 32, 0},
      {{300, 5, 129}, 8, 2, 64, 0},
      {{1100, 3}, 2, 1, 8, 0},
      {{257, 33}, 4, 1, 16, 4 * 40 * 264},  // blocks of query rows
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    std::vector<int64_t> off{0};
    for (int64_t L : c.lens) off.push_back(off.back() + L);
    const int64_t T = off.back();
    const size_t qn = size_t(T) * c.nh * c.hd, kn = size_t(T) * c.nkv * c.hd;
    DeviceArray<float> q = dev(randn(qn, 100 + ci, 2.f)), k = dev(randn(kn, 200 + ci, 2.f)), v = dev(randn(kn, 300 + ci));
    DeviceArray<float> dout = dev(randn(qn, 400 + ci)), out(qn), lse(size_t(T) * c.nh), dq(qn), dk(kn), dv(kn);
    const float scale = 1.f / std::sqrt(float(c.hd));
    for (bool fp32 : {false, true}) {
      cuda::AttentionTc tc;
      if (c.block_elems > 0) tc.set_block_elems(c.block_elems);
      tc.set_fp32(fp32);
      tc.plan(off);
      const std::string tag = "case " + std::to_string(ci) + (fp32 ? " fp32" : " bf16");
      auto fwd = [&] { tc.fwd(q.data(), k.data(), v.data(), c.nh, c.nkv, c.hd, scale, out.data(), lse.data(), nullptr); };
      expect_same_bits(out, fwd, "attention out " + tag);
      expect_same_bits(lse, fwd, "attention lse " + tag);
      if (fp32) continue;
      fwd();
      auto bwd = [&] {
        tc.bwd(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), c.nh, c.nkv, c.hd, scale, dq.data(),
               dk.data(), dv.data(), nullptr);
      };
      expect_same_bits(dq, bwd, "attention dq " + tag);
      expect_same_bits(dk, bwd, "attention dk " + tag);
      expect_same_bits(dv, bwd, "attention dv " + tag);
    }
  }
}
