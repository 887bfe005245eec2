// The decode step's kernels (cuda/model_kernels.h, router_topk_fwd in cuda/train_kernels.h): each
// new path against the previous kernel (kern::set_legacy_decode_kernels(true)), bit for bit where
// the arithmetic is unchanged (rmsnorm, qk-norm/RoPE/cache store, router top-k), and the pipelined
// split-key decode attention against cpu::attention_forward at forced split counts, with bitwise
// repeatability. Every test skips itself without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cpu/ops.h"
#include "cuda/check.h"
#include "cuda/model_kernels.h"
#include "cuda/train_kernels.h"
#include "cuda_test_util.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;

namespace {

// Runs fn with the legacy kernels switched on, then restores the previous setting.
template <class F>
void with_legacy(F&& fn) {
  const bool was = cuda::kern::legacy_decode_kernels();
  cuda::kern::set_legacy_decode_kernels(true);
  fn();
  cuda::kern::set_legacy_decode_kernels(was);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

}  // namespace

TEST(CudaDecodeKernels, RmsnormSameBitsAsOldKernel) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  // Register paths of 1..16 elements per thread, ragged tails, and the fallback past 4096.
  for (int64_t D : {16, 100, 256, 300, 2048, 2051, 4096, 5000}) {
    for (int64_t rows : {1, 3, 37}) {
      const auto x = randn(rows * D, 7 + D + rows, 3.f), w = randn(D, 8 + D, 0.1f, 1.f);
      auto dx = dev(x), dw = dev(w);
      DeviceArray<float> dnew(rows * D), dold(rows * D);
      cuda::kern::rmsnorm(dx.data(), dw.data(), rows, D, 1e-6f, dnew.data(), nullptr);
      with_legacy([&] { cuda::kern::rmsnorm(dx.data(), dw.data(), rows, D, 1e-6f, dold.data(), nullptr); });
      const auto got = dnew.download();
      EXPECT_EQ(first_float_mismatch(got, dold.download()), -1) << "D " << D << " rows " << rows;
      std::vector<float> want(rows * D);
      cpu::rmsnorm_forward(x.data(), w.data(), rows, D, 1e-6f, want.data(), nullptr);
      EXPECT_LT(rel_l2(got, want), 3e-7) << "D " << D << " rows " << rows;
    }
  }
}

TEST(CudaDecodeKernels, QkNormRopeStoreSameBitsAsOldKernel) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int nh, nkv, hd, T;
    bool prescale;
  };
  // hd 64/128/256: the register rows; 96 and 34: the generic row; odd row counts per CTA.
  for (const Case c : {Case{32, 4, 128, 1, false}, Case{32, 4, 128, 64, false}, Case{32, 4, 128, 5, true},
                       Case{8, 2, 64, 3, false}, Case{16, 1, 256, 2, true}, Case{6, 3, 96, 4, false},
                       Case{5, 5, 34, 2, true}}) {
    const int slots = c.T + 2;
    const int64_t max_len = 24, kvd = int64_t(c.nkv) * c.hd, T = c.T;
    std::vector<int32_t> slot(T), pos(T);
    for (int t = 0; t < c.T; ++t) {
      slot[t] = (t * 5 + 1) % slots;
      pos[t] = (t * 7 + 3) % static_cast<int>(max_len);
    }
    const auto q = randn(T * c.nh * c.hd, 30 + c.hd, 2.f), k = randn(T * kvd, 31 + c.hd, 2.f),
               v = randn(T * kvd, 32 + c.hd), qn = randn(c.hd, 33, 0.1f, 1.f), kn = randn(c.hd, 34, 0.1f, 1.f),
               cs = randn(T * c.hd / 2, 35), sn = randn(T * c.hd / 2, 36), ps = randn(kvd, 37, 0.2f, 1.f),
               cache0 = randn(slots * max_len * kvd, 38);
    auto dk = dev(k), dv = dev(v), dqn = dev(qn), dkn = dev(kn), dcs = dev(cs), dsn = dev(sn), dps = dev(ps);
    auto dslot = dev(slot), dpos = dev(pos);
    auto run = [&](std::vector<float>& qo, std::vector<float>& ko, std::vector<float>& vo) {
      auto dq = dev(q), kc = dev(cache0), vc = dev(cache0);
      cuda::kern::qk_norm_rope_store(dq.data(), dk.data(), dv.data(), dqn.data(), dkn.data(), 1e-6f, dcs.data(),
                                     dsn.data(), dslot.data(), dpos.data(), T, c.nh, c.nkv, c.hd, kc.data(), vc.data(),
                                     max_len, nullptr, c.prescale ? dps.data() : nullptr);
      qo = dq.download();
      ko = kc.download();
      vo = vc.download();
    };
    std::vector<float> q1, k1, v1, q0, k0, v0;
    run(q1, k1, v1);
    with_legacy([&] { run(q0, k0, v0); });
    EXPECT_EQ(first_float_mismatch(q1, q0), -1) << "q, hd " << c.hd << " T " << c.T;
    EXPECT_EQ(first_float_mismatch(k1, k0), -1) << "k cache, hd " << c.hd << " T " << c.T;
    EXPECT_EQ(first_float_mismatch(v1, v0), -1) << "v cache, hd " << c.hd << " T " << c.T;
    EXPECT_NE(first_float_mismatch(k1, cache0), -1) << "the keys were stored";
  }
}

TEST(CudaDecodeKernels, RouterTopkSameBitsAsOldKernel) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int E, k;
    int64_t T;
    bool norm, ties, nan_rows, forced;
  };
  for (const Case c : {Case{64, 8, 1, true, false, false, false}, Case{64, 8, 64, true, true, false, false},
                       Case{64, 8, 13, false, false, true, false}, Case{8, 2, 5, true, true, false, false},
                       Case{100, 7, 9, true, true, true, false}, Case{128, 8, 33, true, false, false, false},
                       Case{256, 1, 4, false, true, false, false}, Case{300, 4, 6, true, false, false, false},
                       Case{64, 8, 7, true, false, false, true}, Case{32, 4, 9, true, true, false, false},
                       Case{48, 6, 11, false, true, false, false}, Case{64, 40, 3, true, true, false, false},
                       Case{64, 32, 5, true, true, false, false}, Case{2, 2, 3, true, true, false, false}}) {
    auto logits = randn(c.T * c.E, 50 + c.E + c.T, 2.f);
    if (c.ties)  // few distinct values: equal probabilities, the lower id must win
      for (auto& x : logits) x = std::round(x * 2.f) / 2.f;
    if (c.nan_rows) {
      for (int e = 0; e < c.E; ++e) logits[e] = std::numeric_limits<float>::quiet_NaN();  // all-NaN row 0
      logits[c.E + 3] = std::numeric_limits<float>::quiet_NaN();  // one NaN in row 1
    }
    std::vector<int32_t> forced(c.T * c.k);
    for (int64_t i = 0; i < c.T * c.k; ++i) forced[i] = static_cast<int32_t>((i * 13 + 5) % c.E);
    auto dl = dev(logits);
    auto dfo = dev(forced);
    auto run = [&](std::vector<float>& p, std::vector<int32_t>& id, std::vector<float>& w) {
      DeviceArray<float> dp(c.T * c.E), dw(c.T * c.k);
      DeviceArray<int32_t> di(c.T * c.k);
      cuda::kern::router_topk_fwd(dl.data(), c.T, c.E, c.k, c.norm, dp.data(), di.data(), dw.data(),
                                  c.forced ? dfo.data() : nullptr, nullptr);
      p = dp.download();
      id = di.download();
      w = dw.download();
    };
    std::vector<float> p1, w1, p0, w0;
    std::vector<int32_t> i1, i0;
    run(p1, i1, w1);
    with_legacy([&] { run(p0, i0, w0); });
    const std::string what = "E " + std::to_string(c.E) + " k " + std::to_string(c.k) + " T " + std::to_string(c.T);
    EXPECT_EQ(first_float_mismatch(p1, p0), -1) << what;
    EXPECT_EQ(i1, i0) << what;
    EXPECT_EQ(first_float_mismatch(w1, w0), -1) << what;
    if (!c.nan_rows && !c.forced) {
      std::vector<float> p(c.T * c.E), w(c.T * c.k);
      std::vector<int32_t> id(c.T * c.k);
      cpu::router_topk_forward(logits.data(), c.T, c.E, c.k, c.norm, p.data(), id.data(), w.data());
      EXPECT_EQ(i1, id) << what << " vs the CPU";
    }
  }
}

// The pipelined split-key decode attention at forced split counts (1: no merge; 2, 3: uneven
// splits, some past a token's context; the most: one tile each) and the automatic choice, the old
// kernel beside it, against the CPU twin token by token; repeated runs give the same bits.
TEST(CudaDecodeKernels, AttentionSplitCountsMatchCpu) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int nh, nkv, hd;
    int64_t max_ctx;
    int T;
  };
  // Groups 8 (two heads per warp), 1 and 3 (one per warp), 32 (16 warps); head dims 32..256; the
  // peer model's 32/4/128 at batch 1, 16 and 64.
  for (const Case c : {Case{32, 4, 128, 256, 1}, Case{32, 4, 128, 512, 16}, Case{32, 4, 128, 512, 64},
                       Case{8, 1, 64, 70, 3}, Case{4, 4, 32, 100, 2}, Case{12, 4, 64, 96, 2},
                       Case{16, 1, 256, 130, 2}, Case{32, 1, 128, 64, 1}}) {
    const int slots = c.T + 1;
    const int64_t max_len = c.max_ctx + 5, kvd = int64_t(c.nkv) * c.hd;
    std::mt19937_64 rng(101 + c.hd + c.T);
    std::vector<int32_t> slot(c.T), pos(c.T);
    for (int t = 0; t < c.T; ++t) {
      slot[t] = (t * 3 + 1) % slots;
      const int64_t pick[5] = {c.max_ctx - 1, 0, 31, 32, int64_t(rng() % uint64_t(c.max_ctx))};
      pos[t] = static_cast<int32_t>(pick[t % 5]);
    }
    const auto q = randn(int64_t(c.T) * c.nh * c.hd, 61 + c.T, 1.5f), kc = randn(slots * max_len * kvd, 62 + c.T),
               vc = randn(slots * max_len * kvd, 63 + c.T);
    const float scale = 1.f / std::sqrt(float(c.hd));
    const std::vector<float> want = cpu_decode_attention(q, kc, vc, slot, pos, c.nh, c.nkv, c.hd, max_len);
    auto dq = dev(q), dk = dev(kc), dv = dev(vc);
    auto ds = dev(slot), dp = dev(pos);
    const int tiles = static_cast<int>((c.max_ctx + 31) / 32);
    for (int legacy = 0; legacy < 2; ++legacy) {
      cuda::kern::set_legacy_decode_kernels(legacy == 1);
      for (int splits : {0, 1, 2, 3, tiles}) {
        auto run = [&](DeviceArray<float>& out) {
          out.fill_bytes(0xFF);
          return cuda::kern::attention_decode_split_n(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), c.T,
                                                      c.nh, c.nkv, c.hd, scale, max_len, c.max_ctx, out.data(),
                                                      nullptr, splits);
        };
        DeviceArray<float> out(q.size()), again(q.size());
        const int used = run(out);
        run(again);
        const auto got = out.download();
        const double e = rel_l2(got, want), m = max_abs_diff(got, want);
        std::printf("decode attention %s heads %d/%d hd %d ctx %lld batch %d splits %d: rel L2 %.3g max abs %.3g\n",
                    legacy ? "old" : "new", c.nh, c.nkv, c.hd, static_cast<long long>(c.max_ctx), c.T, used, e, m);
        EXPECT_LT(e, 2e-6) << "splits " << used;
        EXPECT_LT(m, 1e-5) << "splits " << used;
        EXPECT_EQ(first_float_mismatch(again.download(), got), -1) << "splits " << used << ": not repeatable";
      }
    }
    cuda::kern::set_legacy_decode_kernels(false);
  }
}
