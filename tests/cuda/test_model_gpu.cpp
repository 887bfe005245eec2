// The GPU Qwen3-MoE forward (cuda/model_gpu.h) against its CPU twins: each layer kernel against
// the cpu:: op it mirrors (random data), then whole-model logits against model::Model on the
// fixture tiny_qwen3moe_a (and against transformers' float64 logits), prefill vs decode, greedy
// generation through the rollout engine. Every test skips itself without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "common/fixtures.h"
#include "cpu/ops.h"
#include "cuda/check.h"
#include "cuda/model_gpu.h"
#include "cuda/model_kernels.h"
#include "cuda/train_kernels.h"
#include "cuda_test_util.h"
#include "model/model.h"
#include "model/rac.h"
#include "numerics/quantize.h"
#include "reqat/kv_quant.h"
#include "rollout/engine.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;

namespace {


double max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}


// All-position logits of one sequence through the CPU decode path (one step: prefill).
std::vector<float> cpu_logits(const std::string& preset, const std::vector<int32_t>& ids) {
  model::Weights w = fixture_weights();
  model::Model m(w, model::PrecisionConfig::preset(preset));
  model::KVCache cache(w.cfg, 1);
  model::StepItem it;
  it.tokens = ids;
  it.all_logits = true;
  return m.step(cache, {it});
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Kernels against their CPU twins

TEST(CudaModelKernels, RmsnormMatchesCpu) {
  QUADS_REQUIRE_GPU();
  for (int64_t D : {16, 64, 2048, 2051}) {
    const int64_t rows = 37;
    const auto x = randn(rows * D, 1 + D, 3.f), w = randn(D, 2 + D, 0.1f, 1.f);
    std::vector<float> want(rows * D);
    cpu::rmsnorm_forward(x.data(), w.data(), rows, D, 1e-6f, want.data(), nullptr);
    auto dx = dev(x), dw = dev(w);
    DeviceArray<float> dy(rows * D);
    cuda::kern::rmsnorm(dx.data(), dw.data(), rows, D, 1e-6f, dy.data(), nullptr);
    // Only the double sum of squares is reordered: at most one float ulp of the scale.
    EXPECT_LT(rel_l2(dy.download(), want), 3e-7) << "D = " << D;
  }
}

TEST(CudaModelKernels, QkNormRopeAndAttentionMatchCpu) {
  QUADS_REQUIRE_GPU();
  const int nh = 8, nkv = 2, hd = 64, slots = 3;
  const int64_t max_len = 40;
  const float eps = 1e-6f, scale = 0.125f;
  // Slot 1 already holds 17 positions (a previous step); this step appends 6 tokens to it and
  // 1 token to slot 2 (empty before): a prefill chunk and a first decode position.
  const int64_t prior = 17, n1 = 6, T = n1 + 1;
  const auto qn = randn(hd, 3, 0.1f, 1.f), kn = randn(hd, 4, 0.1f, 1.f);
  const int64_t kvd = int64_t(nkv) * hd;
  // CPU reference: the whole sequence of slot 1 (prior + n1), then the new one of slot 2.
  const int64_t L1 = prior + n1;
  auto q1 = randn(L1 * nh * hd, 5), k1 = randn(L1 * kvd, 6), v1 = randn(L1 * kvd, 7);
  auto q2 = randn(nh * hd, 8), k2 = randn(kvd, 9), v2 = randn(kvd, 10);
  auto cpu_prep = [&](std::vector<float>& q, std::vector<float>& k, const std::vector<int64_t>& pos) {
    const int64_t n = static_cast<int64_t>(pos.size());
    std::vector<float> cs(n * hd / 2), sn(n * hd / 2);
    cpu::rope_tables(pos.data(), n, hd, 1e6, cs.data(), sn.data());
    std::vector<float> qq(q.size()), kk(k.size());
    cpu::rmsnorm_forward(q.data(), qn.data(), n * nh, hd, eps, qq.data(), nullptr);
    cpu::rmsnorm_forward(k.data(), kn.data(), n * nkv, hd, eps, kk.data(), nullptr);
    cpu::rope_forward(qq.data(), n, nh, hd, cs.data(), sn.data());
    cpu::rope_forward(kk.data(), n, nkv, hd, cs.data(), sn.data());
    q = qq;
    k = kk;
  };
  std::vector<int64_t> pos1(L1);
  for (int64_t i = 0; i < L1; ++i) pos1[i] = i;
  const std::vector<float> q1raw = q1, k1raw = k1;
  cpu_prep(q1, k1, pos1);
  cpu_prep(q2, k2, {0});
  std::vector<float> want(T * nh * hd);
  cpu::attention_forward(q1.data() + prior * nh * hd, k1.data(), v1.data(), n1, L1, nh, nkv, hd, scale, want.data(),
                         nullptr);
  cpu::attention_forward(q2.data(), k2.data(), v2.data(), 1, 1, nh, nkv, hd, scale, want.data() + n1 * nh * hd, nullptr);

  // GPU: the prior positions go in through a first step of the same kernels.
  DeviceArray<float> kc(size_t(slots) * max_len * kvd), vc(size_t(slots) * max_len * kvd);
  kc.fill_bytes(0xFF);  // NaN poison: reading a position that was never written shows up
  vc.fill_bytes(0xFF);
  auto dqn = dev(qn), dkn = dev(kn);
  auto run = [&](std::vector<float> q, const std::vector<float>& k, const std::vector<float>& v,
                 const std::vector<int32_t>& slot, const std::vector<int32_t>& pos, bool decode) {
    const int64_t n = static_cast<int64_t>(slot.size());
    std::vector<int64_t> p64(pos.begin(), pos.end());
    std::vector<float> cs(n * hd / 2), sn(n * hd / 2);
    cpu::rope_tables(p64.data(), n, hd, 1e6, cs.data(), sn.data());
    auto dq = dev(q), dk = dev(k), dv = dev(v), dc = dev(cs), ds = dev(sn);
    auto dslot = dev(slot), dpos = dev(pos);
    cuda::kern::qk_norm_rope_store(dq.data(), dk.data(), dv.data(), dqn.data(), dkn.data(), eps, dc.data(), ds.data(),
                                   dslot.data(), dpos.data(), n, nh, nkv, hd, kc.data(), vc.data(), max_len, nullptr);
    DeviceArray<float> out(n * nh * hd);
    int64_t ctx = 1;
    for (int32_t p : pos) ctx = std::max<int64_t>(ctx, p + 1);
    cuda::kern::attention(dq.data(), kc.data(), vc.data(), dslot.data(), dpos.data(), n, nh, nkv, hd, scale, max_len, ctx,
                          decode, out.data(), nullptr);
    return std::make_pair(dq.download(), out.download());
  };
  std::vector<int32_t> s0(prior, 1), p0(prior);
  for (int64_t i = 0; i < prior; ++i) p0[i] = static_cast<int32_t>(i);
  run(std::vector<float>(q1raw.begin(), q1raw.begin() + prior * nh * hd),
      std::vector<float>(k1raw.begin(), k1raw.begin() + prior * kvd), std::vector<float>(v1.begin(), v1.begin() + prior * kvd),
      s0, p0, false);
  std::vector<float> qs(q1raw.begin() + prior * nh * hd, q1raw.end()), ks(k1raw.begin() + prior * kvd, k1raw.end()),
      vs(v1.begin() + prior * kvd, v1.end());
  const auto q2raw = randn(nh * hd, 8), k2raw = randn(kvd, 9);
  qs.insert(qs.end(), q2raw.begin(), q2raw.end());
  ks.insert(ks.end(), k2raw.begin(), k2raw.end());
  vs.insert(vs.end(), v2.begin(), v2.end());
  std::vector<int32_t> slot(n1, 1), pos(n1);
  for (int64_t i = 0; i < n1; ++i) pos[i] = static_cast<int32_t>(prior + i);
  slot.push_back(2);
  pos.push_back(0);
  for (bool decode : {false, true}) {
    const auto [qg, out] = run(qs, ks, vs, slot, pos, decode);
    std::vector<float> qwant(q1.begin() + prior * nh * hd, q1.end());
    qwant.insert(qwant.end(), q2.begin(), q2.end());
    EXPECT_LT(rel_l2(qg, qwant), 1e-6) << "q after norm + RoPE";
    EXPECT_LT(rel_l2(out, want), 1e-5) << "attention, decode launch = " << decode;
  }
  // The cache holds the roped keys of slot 1 at every position and the values as given.
  const auto kh = kc.download(), vh = vc.download();
  std::vector<float> kslot(kh.begin() + 1 * max_len * kvd, kh.begin() + (1 * max_len + L1) * kvd);
  std::vector<float> vslot(vh.begin() + 1 * max_len * kvd, vh.begin() + (1 * max_len + L1) * kvd);
  EXPECT_LT(rel_l2(kslot, k1), 1e-6);
  EXPECT_EQ(vslot, v1);
}

TEST(CudaModelKernels, RouterSwigluCombineMatchCpu) {
  QUADS_REQUIRE_GPU();
  const int64_t T = 50;
  const int E = 64, k = 8;
  const auto logits = randn(T * E, 11, 2.f);
  std::vector<float> probs(T * E), w(T * k);
  std::vector<int32_t> idx(T * k);
  cpu::router_topk_forward(logits.data(), T, E, k, true, probs.data(), idx.data(), w.data());
  auto dl = dev(logits);
  DeviceArray<float> dp(T * E), dw(T * k);
  DeviceArray<int32_t> di(T * k);
  cuda::kern::router_topk_fwd(dl.data(), T, E, k, true, dp.data(), di.data(), dw.data(), nullptr, nullptr);
  EXPECT_EQ(di.download(), idx);
  EXPECT_LT(max_abs(dw.download(), w), 1e-6);
  EXPECT_LT(rel_l2(dp.download(), probs), 1e-6);

  const int64_t I = 96, H = 40;
  const auto gu = randn(T * 2 * I, 12, 3.f);
  std::vector<float> h(T * I);
  cpu::swiglu_forward(gu.data(), T, I, h.data());
  std::vector<float> g(T * I), u(T * I);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t i = 0; i < I; ++i) {
      g[r * I + i] = gu[r * 2 * I + i];
      u[r * I + i] = gu[r * 2 * I + I + i];
    }
  auto dg = dev(g), du = dev(u), dgu = dev(gu);
  DeviceArray<float> dh(T * I), dh2(T * I);
  cuda::kern::swiglu(dg.data(), du.data(), I, T, I, dh.data(), nullptr);  // separate gate / up
  cuda::kern::swiglu(dgu.data(), dgu.data() + I, 2 * I, T, I, dh2.data(), nullptr);  // the fused layout
  EXPECT_LT(rel_l2(dh.download(), h), 1e-6);
  EXPECT_EQ(dh2.download(), dh.download());
  {  // swiglu_bf16: to_bf16 of the same h, all rows or a window of them (the rest untouched)
    DeviceArray<uint16_t> want_b(T * I), got_b(T * I), win_b(T * I);
    cuda::kern::to_bf16(dh.data(), want_b.data(), T * I, nullptr);
    cuda::kern::swiglu_bf16(dgu.data(), dgu.data() + I, 2 * I, T, I, got_b.data(), nullptr);
    EXPECT_EQ(got_b.download(), want_b.download());
    const std::vector<int32_t> lohi{static_cast<int32_t>(T / 3), static_cast<int32_t>(T - 1)};
    auto dlohi = dev(lohi);
    win_b.fill_bytes(0xAB);
    cuda::kern::swiglu_bf16(dgu.data(), dgu.data() + I, 2 * I, T, I, win_b.data(), nullptr, dlohi.data(),
                            dlohi.data() + 1);
    const std::vector<uint16_t> wb = win_b.download(), ab = want_b.download();
    for (int64_t r = 0; r < T; ++r)
      for (int64_t i = 0; i < I; ++i)
        ASSERT_EQ(wb[r * I + i], r >= lohi[0] && r < lohi[1] ? ab[r * I + i] : uint16_t(0xABAB)) << r << " " << i;
  }
  std::vector<float> one{-2.5f};
  auto d1 = dev(one);
  DeviceArray<float> dm(1000);
  cuda::kern::broadcast(d1.data(), dm.data(), 1000, nullptr);
  for (float v : dm.download()) ASSERT_EQ(v, -2.5f);

  // Permutation (the host's cpu::moe_permute), gather, combine + residual.
  std::vector<int64_t> eoff(E + 1);
  std::vector<int32_t> perm(T * k), inv(T * k);
  cpu::moe_permute(idx.data(), T, k, E, eoff.data(), perm.data(), inv.data());
  const auto x = randn(T * H, 13), ye = randn(T * k * H, 14), resid = randn(T * H, 15);
  std::vector<float> xe(T * k * H), y(T * H);
  cpu::moe_gather(x.data(), perm.data(), T * k, k, H, xe.data());
  cpu::moe_combine_forward(ye.data(), inv.data(), w.data(), T, k, H, y.data());
  std::vector<float> want = resid;
  cpu::add_inplace(want.data(), y.data(), T * H);
  auto dx = dev(x), dye = dev(ye), dres = dev(resid), dwc = dev(w);
  auto dperm = dev(perm), dinv = dev(inv);
  DeviceArray<float> dxe(T * k * H);
  cuda::kern::gather_rows(dx.data(), dperm.data(), T * k, k, H, dxe.data(), nullptr);
  EXPECT_EQ(dxe.download(), xe);
  cuda::kern::moe_combine_add(dye.data(), dinv.data(), dwc.data(), T, k, H, dres.data(), nullptr);
  EXPECT_EQ(dres.download(), want) << "same operations in the same order: bitwise";
}

// Decode attention split over keys (the default decode launch) against cpu::attention_forward,
// token by token: GQA groups of 8, 4, 1 and 16, head dims 32..256, contexts of 1 key, of less than
// one 32-key tile, of many tiles and of exactly max_ctx keys, a batch of 1 (many splits) and of 40
// tokens (few splits), slots in any order.
TEST(CudaModelKernels, AttentionDecodeSplitMatchesCpu) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int nh, nkv, hd;
    int64_t max_ctx;
    int T;
  };
  for (const Case c : {Case{8, 1, 64, 40, 1}, Case{32, 4, 128, 256, 1}, Case{32, 4, 128, 256, 40},
                       Case{4, 4, 32, 100, 3}, Case{16, 1, 256, 70, 2}}) {
    const int slots = c.T + 1;
    const int64_t max_len = c.max_ctx + 3, kvd = int64_t(c.nkv) * c.hd;
    std::mt19937_64 rng(11 + c.hd + c.T);
    std::vector<int32_t> slot(c.T), pos(c.T);
    for (int t = 0; t < c.T; ++t) {
      slot[t] = (t * 7 + 1) % slots;
      const int64_t pick[4] = {0, 17, c.max_ctx - 1, int64_t(rng() % uint64_t(c.max_ctx))};
      pos[t] = static_cast<int32_t>(pick[t % 4]);
    }
    const auto q = randn(int64_t(c.T) * c.nh * c.hd, 21 + c.T), kc = randn(slots * max_len * kvd, 22 + c.T),
               vc = randn(slots * max_len * kvd, 23 + c.T);
    const float scale = 1.f / std::sqrt(float(c.hd));
    const std::vector<float> want = cpu_decode_attention(q, kc, vc, slot, pos, c.nh, c.nkv, c.hd, max_len);
    auto dq = dev(q), dk = dev(kc), dv = dev(vc);
    auto ds = dev(slot), dp = dev(pos);
    DeviceArray<float> out(q.size());
    out.fill_bytes(0xFF);
    ASSERT_TRUE(cuda::kern::attention_decode_split_supported(c.nh, c.nkv, c.hd));
    cuda::kern::attention_decode_split(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), c.T, c.nh, c.nkv, c.hd,
                                       scale, max_len, c.max_ctx, out.data(), nullptr);
    const auto got = out.download();
    const double e = rel_l2(got, want), m = max_abs(got, want);
    std::printf("decode split attention heads %d/%d hd %d ctx %lld batch %d: rel L2 %.3g max abs %.3g\n", c.nh, c.nkv,
                c.hd, static_cast<long long>(c.max_ctx), c.T, e, m);
    EXPECT_LT(e, 2e-6);
    EXPECT_LT(m, 1e-5);
    // deterministic: the splits merge in a fixed order
    DeviceArray<float> again(q.size());
    cuda::kern::attention_decode_split(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), c.T, c.nh, c.nkv, c.hd,
                                       scale, max_len, c.max_ctx, again.data(), nullptr);
    EXPECT_EQ(first_float_mismatch(again.download(), got), -1);
  }
}

// The activation error's row sums: num::error_stats of each row alone, bit for bit (its sq_err and
// sq_norm are the rows' sums added in order), NaN and Inf rows included.
TEST(CudaModelKernels, RowErrorSumsAreTheCpuRowSums) {
  QUADS_REQUIRE_GPU();
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 208}, {300, 2048}}) {
    const auto x = randn(rows * cols, 11 + rows);
    std::vector<float> xq(x.size());
    const num::QConfig c = num::QConfig::nvfp4_act();
    num::fake_quantize(x.data(), xq.data(), rows, cols, c);
    std::vector<float> xb = x;
    if (rows > 1) {
      xb[cols + 3] = std::nanf("");
      xb[cols + 5] = INFINITY;
    }
    auto dx = dev(xb);
    auto dq = dev(xq);
    DeviceArray<double> out(2 * rows);
    cuda::kern::row_error_sums(dx.data(), dq.data(), rows, cols, out.data(), nullptr);
    const std::vector<double> got = out.download();
    double err = 0, norm = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const num::ErrorStats e = num::error_stats(xb.data() + r * cols, xq.data() + r * cols, 1, cols);
      EXPECT_TRUE(cuda::testing::same_double(got[2 * r], e.sq_err)) << rows << "x" << cols << " row " << r;
      EXPECT_TRUE(cuda::testing::same_double(got[2 * r + 1], e.sq_norm)) << rows << "x" << cols << " row " << r;
      err += got[2 * r];
      norm += got[2 * r + 1];
    }
    const num::ErrorStats all = num::error_stats(xb.data(), xq.data(), rows, cols);
    EXPECT_TRUE(cuda::testing::same_double(err, all.sq_err));
    EXPECT_TRUE(cuda::testing::same_double(norm, all.sq_norm));
  }
}

// Static RAC's channel energies (kern::rac_energy): model::rac_energy bit for bit, added onto the
// sums already there (the calibration pass's chunks), NaN / Inf columns included.
TEST(CudaModelKernels, RacEnergyIsTheCpus) {
  QUADS_REQUIRE_GPU();
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 208}, {300, 2048}}) {
    const auto x = randn(rows * cols, 5 + rows);
    std::vector<float> xq(x.size());
    num::fake_quantize(x.data(), xq.data(), rows, cols, num::QConfig::nvfp4_act());
    std::vector<float> xb = x;
    if (rows > 1) {
      xb[cols + 3] = std::nanf("");
      xb[5] = INFINITY;
    }
    std::vector<double> want(cols);
    for (int64_t c = 0; c < cols; ++c) want[c] = 0.25 * double(c);  // earlier chunks' sums
    auto dx = dev(xb);
    auto dq = dev(xq);
    DeviceArray<double> e;
    e.upload(want);
    model::rac_energy(xb.data(), xq.data(), rows, cols, want.data());
    cuda::kern::rac_energy(dx.data(), dq.data(), rows, cols, e.data(), nullptr);
    const std::vector<double> got = e.download();
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_TRUE(cuda::testing::same_double(got[c], want[c])) << rows << "x" << cols << " column " << c;
  }
}

TEST(CudaModelKernels, Bf16ArgmaxEmbedding) {
  QUADS_REQUIRE_GPU();
  auto x = randn(1000, 16, 100.f);
  x[3] = std::nanf("");
  auto dx = dev(x);
  DeviceArray<float> r(1000);
  cuda::kern::bf16_round(dx.data(), r.data(), 1000, nullptr);
  const auto got = r.download();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(cuda::testing::same_float(got[i], num::bf16_round(x[i]))) << i;
  DeviceArray<uint16_t> bits(1000);
  cuda::kern::to_bf16(dx.data(), bits.data(), 1000, nullptr);
  const auto hb = bits.download();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(hb[i], num::bf16_from_f32(x[i])) << i;
  // add_inplace and sub: one IEEE operation per element, bitwise the CPU's.
  const auto y = randn(1000, 18, 3.f);
  auto dy = dev(y);
  cuda::kern::add_inplace(dy.data(), dx.data(), 1000, nullptr);
  std::vector<float> sum = y;
  cpu::add_inplace(sum.data(), x.data(), 1000);
  const auto gsum = dy.download();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(cuda::testing::same_float(gsum[i], sum[i])) << i;
  DeviceArray<float> diff(1000);
  cuda::kern::sub(dy.data(), dx.data(), diff.data(), 1000, nullptr);
  const auto gd = diff.download();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_TRUE(cuda::testing::same_float(gd[i], sum[i] - x[i])) << i;
  std::vector<float> m(3 * 700, -1.f);
  m[5] = 3.f;
  m[700 + 699] = 2.f;
  m[700 + 10] = 2.f;  // tie: the lower index wins
  m[1400 + 0] = std::nanf("");
  m[1400 + 1] = 0.5f;
  auto dm = dev(m);
  DeviceArray<int32_t> am(3);
  cuda::kern::argmax_rows(dm.data(), 3, 700, am.data(), nullptr);
  EXPECT_EQ(am.download(), (std::vector<int32_t>{5, 10, 1}));
  // Long rows (a decode step's vocabulary) split their columns over CTAs: the same first-index
  // winner across chunk boundaries, NaNs skipped, an all-NaN row gives 0.
  const int64_t V = 32000;
  std::vector<float> lv(3 * V, -5.f);
  lv[4095] = 7.f;
  lv[4096] = 7.f;
  lv[30000] = 7.f;
  lv[V + 31999] = 1.f;
  lv[V + 12] = std::nanf("");
  for (int64_t i = 0; i < V; ++i) lv[2 * V + i] = std::nanf("");
  auto dl = dev(lv);
  DeviceArray<int32_t> al(3);
  cuda::kern::argmax_rows(dl.data(), 3, V, al.data(), nullptr);
  EXPECT_EQ(al.download(), (std::vector<int32_t>{4095, 31999, 0}));
  const auto table = randn(20 * 8, 17);
  const std::vector<int32_t> toks{3, 19, 0, 3};
  std::vector<float> want(4 * 8);
  cpu::embedding_forward(table.data(), toks.data(), 4, 8, want.data());
  auto dt = dev(table);
  auto dtok = dev(toks);
  DeviceArray<float> out(32);
  cuda::kern::embedding(dt.data(), dtok.data(), 4, 8, out.data(), nullptr);
  EXPECT_EQ(out.download(), want);
}

// ---------------------------------------------------------------------------------------------
// The whole model on the fixture

TEST(CudaModelGpu, Fp32LogitsMatchCpuAndTransformers) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  cuda::GpuModel g(fixture_weights(), model::PrecisionConfig::preset("fp32"));
  EXPECT_EQ(g.linear_mode("model.layers.0.self_attn.q_proj"), cuda::GpuLinearMode::Fake);
  const auto got = gpu_logits(g, ids, 1000);
  const auto cpu = cpu_logits("fp32", ids);
  const auto ref = read_f32(fixture("logits.f32"));
  const double e_cpu = rel_l2(got, cpu), e_ref = rel_l2(got, ref);
  std::printf("fp32: rel L2 vs CPU %.3g, vs transformers float64 %.3g\n", e_cpu, e_ref);
  EXPECT_LT(e_cpu, 1e-5);
  EXPECT_LT(e_ref, 1e-5);
}

TEST(CudaModelGpu, Bf16AndNvfp4LogitsMatchCpu) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  // bf16: operands rounded to BF16 on both sides, FP32 accumulation in a different order: a
  // rounding boundary of a BF16 activation can flip (one BF16 ulp, 2^-8 relative) downstream.
  // nvfp4: identical codes and scales for weights; activations are quantized per token from
  // float32 inputs that differ in the last bits, so an E2M1 code flips only where an input lies
  // within that distance of a rounding boundary (rare); the rest is FP32 summation order.
  for (const auto& [preset, tol] : std::vector<std::pair<std::string, double>>{{"bf16", 1e-3}, {"nvfp4", 2e-3},
                                                                                {"nvfp4-2d", 2e-3}, {"fp8", 1e-3}}) {
    cuda::GpuModel g(fixture_weights(), model::PrecisionConfig::preset(preset));
    const auto got = gpu_logits(g, ids, 1000);
    const auto cpu = cpu_logits(preset, ids);
    const double e = rel_l2(got, cpu);
    std::printf("%s: rel L2 of the logits vs the CPU model %.3g (q_proj runs as %s, down_proj as %s)\n", preset.c_str(),
                e, cuda::gpu_linear_mode_name(g.linear_mode("model.layers.0.self_attn.q_proj")),
                cuda::gpu_linear_mode_name(g.linear_mode("model.layers.0.mlp.experts.0.down_proj")));
    EXPECT_LT(e, tol) << preset;
  }
  cuda::GpuModel g(fixture_weights(), model::PrecisionConfig::preset("nvfp4"));
  EXPECT_EQ(g.linear_mode("model.layers.0.self_attn.q_proj"), cuda::GpuLinearMode::W4A4);
  EXPECT_EQ(g.linear_mode("model.layers.1.mlp.experts.3.gate_proj"), cuda::GpuLinearMode::W4A4);
  EXPECT_EQ(g.linear_mode("model.layers.0.mlp.gate"), cuda::GpuLinearMode::BF16);  // router stays high
  EXPECT_EQ(g.linear_mode("lm_head"), cuda::GpuLinearMode::BF16);
}

// RAC with static channels calibrated on the CPU model: the W4A4 linears run the gather GEMM on
// W's own codes, the fake-quant ones (the fixture's down_proj, K = 32) an SGEMM on W_eff[:, S].
TEST(CudaModelGpu, RacMatchesCpu) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  model::Weights w = fixture_weights();
  model::Model m(w, prec);
  const int n = model::rac_calibrate(m, model::Batch::of({ids}), model::RacConfig{});
  ASSERT_GT(n, 0);
  model::KVCache cache(w.cfg, 1);
  model::StepItem it;
  it.tokens = ids;
  it.all_logits = true;
  const auto cpu = m.step(cache, {it});
  cuda::GpuModel g(fixture_weights(), prec);
  const auto plain = gpu_logits(g, ids, 1000);
  g.set_rac(m);
  const auto got = gpu_logits(g, ids, 1000);
  const double e = rel_l2(got, cpu), moved = rel_l2(got, plain);
  std::printf("nvfp4+RAC: rel L2 vs the CPU model %.3g; RAC moved the logits by %.3g\n", e, moved);
  EXPECT_LT(e, 2e-3);
  EXPECT_GT(moved, 5 * e) << "RAC must visibly change the logits for this test to mean anything";
  const auto by_token = gpu_logits(g, ids, 1);
  EXPECT_LT(rel_l2(by_token, got), 2e-3);
  // Per-channel (not whole-block) selections are refused with the linear's name.
  model::rac_calibrate(m, model::Batch::of({ids}), model::RacConfig{0.3, model::RacGranularity::Channel});
  bool aligned = true;
  for (const auto& L : m.linears()) {
    if (L.rac_channels.empty()) continue;
    for (size_t i = 0; i < L.rac_channels.size(); ++i) aligned &= L.rac_channels[i] % 16 == int32_t(i % 16);
  }
  if (!aligned) {
    EXPECT_THROW(g.set_rac(m), Error);
  }
}

// ReQAT's W4A4KV4 on the GPU: the KV transform (Q-FIT factor and shift, E1M2 KV quantization) gives
// the CPU model's logits with the same hooks, prefill and token by token.
TEST(CudaModelGpu, KvTransformMatchesCpuHooks) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  const model::Weights& w0 = fixture_weights();
  const model::ModelConfig& c = w0.cfg;
  const int64_t kvd = c.kv_dim();
  reqat::QFit qf;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    reqat::QFitLayer L;
    L.alpha = 0.5;
    L.beta = 0.35;
    L.scale.resize(kvd);
    const auto r = randn(kvd, 700 + l);
    for (int64_t g = 0; g < c.num_key_value_heads; ++g)
      for (int j = 0; j < c.head_dim / 2; ++j) {  // equal on the pair RoPE rotates together
        const float s = 0.25f + std::fabs(r[g * c.head_dim + j]);
        L.scale[g * c.head_dim + j] = L.scale[g * c.head_dim + j + c.head_dim / 2] = s;
      }
    L.shift = randn(kvd, 800 + l, 0.3f);
    qf.layers.push_back(L);
  }
  for (const std::string preset : {"fp32", "nvfp4"}) {
    for (const bool with_qfit : {false, true}) {
      const reqat::KvQuantConfig kv = reqat::parse_kv_quant("e1m2");
      model::Weights w = w0;
      model::Model m(w, model::PrecisionConfig::preset(preset));
      reqat::install_kv_hooks(m, kv, with_qfit ? &qf : nullptr);
      model::KVCache cache(w.cfg, 1);
      model::StepItem it;
      it.tokens = ids;
      it.all_logits = true;
      const auto cpu = m.step(cache, {it});
      cuda::GpuModel g(w0, model::PrecisionConfig::preset(preset));
      const auto plain = gpu_logits(g, ids, 1000);
      g.set_kv_transform(reqat::make_kv_transform(c, kv, with_qfit ? &qf : nullptr));
      const auto got = gpu_logits(g, ids, 1000);
      const auto by_token = gpu_logits(g, ids, 1);
      const double e = rel_l2(got, cpu), moved = rel_l2(got, plain);
      std::printf("%s KV4 e1m2%s: rel L2 vs the CPU hooks %.3g (token by token %.3g); the transform moved the logits by %.3g\n",
                  preset.c_str(), with_qfit ? " + Q-FIT" : "", e, rel_l2(by_token, cpu), moved);
      if (preset == "fp32") {
        EXPECT_LT(e, 1e-4) << "qfit " << with_qfit;
        EXPECT_LT(rel_l2(by_token, cpu), 1e-4) << "qfit " << with_qfit;
        EXPECT_GT(moved, 5 * e) << "the KV transform must visibly change the logits";
      } else {
        // With W4A4 as well, the GPU's other summation order (logits 7.6e-8 from the CPU without the
        // KV cache quantized) moves K by an ulp here and there; where that flips a 4-bit KV code,
        // the change cascades through the next layers' 4-bit activation codes on this tiny model
        // (measured on the H200: 0.18 without Q-FIT, 5e-5 with). So W4A4KV4 is held to being
        // deterministic and the same prefilled or token by token, and the KV arithmetic to the
        // fp32 cases above.
        EXPECT_TRUE(std::isfinite(e));
        EXPECT_LT(rel_l2(by_token, got), 2e-3) << "qfit " << with_qfit;
        EXPECT_EQ(gpu_logits(g, ids, 1000), got) << "qfit " << with_qfit;
      }
    }
  }
  // The rollout engine refuses a model with CPU hooks on a backend without the transform.
  model::Weights w = w0;
  rollout::RolloutEngine eng(w, model::PrecisionConfig::preset("fp32"));
  reqat::install_kv_hooks(eng.model(), reqat::parse_kv_quant("e1m2"), nullptr);
  eng.set_backend(cuda::make_gpu_backend(w0, eng.precision()));
  rollout::Request rq;
  rq.prompt = ids;
  rq.max_new_tokens = 2;
  EXPECT_THROW(eng.generate({rq}), Error);
  eng.backend()->set_kv_transform(reqat::make_kv_transform(c, reqat::parse_kv_quant("e1m2"), nullptr));
  EXPECT_NO_THROW(eng.generate({rq}));
}

// Routing record (GpuModel::step's `record`, which the RL loop's routing replay reads through
// RolloutEngine::inspect): the expert ids the GPU's routers chose are the CPU model's where the
// router logits agree. fp32 (FP32 GEMMs on both sides) must give the CPU's choices exactly; bf16 and
// nvfp4 route from logits that differ in the last bits (see Bf16AndNvfp4LogitsMatchCpu), so a near
// tie may flip: at most 2% of the entries and 2 more (one flipped tie changes up to two slots). Recording leaves the logits bit for bit as they are; a
// decode step (a CUDA graph without a record) records eagerly.
TEST(CudaModelGpu, RoutingRecordMatchesCpu) {
  QUADS_REQUIRE_GPU();
  const model::Weights& w = fixture_weights();
  const int K = w.cfg.num_experts_per_tok;
  const auto ids = input_ids();
  const size_t third = ids.size() / 3;
  std::vector<model::StepItem> items(3);
  for (int i = 0; i < 3; ++i) {
    items[i].slot = i;
    items[i].tokens.assign(ids.begin() + i * third, ids.begin() + (i + 1) * third - 2 * i);  // lengths differ
  }
  std::vector<model::StepItem> decode(3);
  for (int i = 0; i < 3; ++i) {
    decode[i].slot = i;
    decode[i].tokens = {static_cast<int32_t>(7 + 11 * i)};
  }
  for (const auto& [preset, tol] : std::vector<std::pair<std::string, double>>{{"fp32", 0.0}, {"bf16", 0.02},
                                                                                {"nvfp4", 0.02}}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    model::Weights wm = w;
    model::Model m(wm, prec);
    model::KVCache cache(w.cfg, 3);
    model::Routing want, want_dec;
    m.step(cache, items, &want);
    m.step(cache, decode, &want_dec);

    cuda::GpuModel g(w, prec);
    g.reset_cache(3, static_cast<int64_t>(third) + 8);
    const std::vector<float> plain = g.step(items);
    g.reset_cache(3, static_cast<int64_t>(third) + 8);
    model::Routing got, got_dec;
    EXPECT_EQ(g.step(items, &got), plain) << preset << ": recording changed the logits";
    {  // measuring the activation error takes the plain kernels: the same logits to summation order
      g.reset_cache(3, static_cast<int64_t>(third) + 8);
      std::map<std::string, rollout::ActError> err;
      model::Routing r2;
      const std::vector<float> probed = g.step(items, &r2, &err);
      EXPECT_LT(rel_l2(probed, plain), preset == "fp32" ? 1e-6 : 2e-3) << preset;
      EXPECT_EQ(err.empty(), preset == "fp32") << preset;
      g.reset_cache(3, static_cast<int64_t>(third) + 8);
      EXPECT_EQ(g.step(items, &got), plain) << preset << ": the fused kernels are back after a measuring step";
    }
    const int64_t graphs0 = g.stats().graph_steps;
    g.step(decode, &got_dec);
    EXPECT_EQ(g.stats().graph_steps, graphs0) << preset << ": a recorded step ran as a graph";

    for (const auto& [a, b, what] : {std::tuple{&got, &want, "prefill"}, std::tuple{&got_dec, &want_dec, "decode"}}) {
      ASSERT_EQ(a->experts.size(), b->experts.size()) << preset;
      int64_t n = 0, diff = 0;
      for (size_t l = 0; l < a->experts.size(); ++l) {
        ASSERT_EQ(a->experts[l].size(), b->experts[l].size()) << preset << " " << what << " layer " << l;
        if (w.cfg.is_sparse(static_cast<int>(l))) {
          const int64_t T = what == std::string("prefill") ? 3 * int64_t(third) - 6 : 3;
          EXPECT_EQ(static_cast<int64_t>(a->experts[l].size()), T * K);
        }
        for (size_t j = 0; j < a->experts[l].size(); ++j) {
          ASSERT_GE(a->experts[l][j], 0);
          ASSERT_LT(a->experts[l][j], w.cfg.num_experts);
          diff += a->experts[l][j] != b->experts[l][j];
          ++n;
        }
      }
      ASSERT_GT(n, 0);
      std::printf("%s %s: %lld of %lld recorded expert ids differ from the CPU's\n", preset.c_str(), what,
                  static_cast<long long>(diff), static_cast<long long>(n));
      EXPECT_LE(double(diff), tol > 0 ? tol * double(n) + 2 : 0.0) << preset << " " << what;
    }
  }
}

// Through the rollout engine (RolloutEngine::inspect on the GPU backend): the CPU model's forward
// routing of a batch of sequences, whole or in chunks (fp32: exactly), and each linear's activation
// error (rel. MSE of its input against its operand) near the CPU probe's: the inputs differ in the
// last bits (GPU sums), so an E2M1 code (or a BF16 rounding) flips here and there.
TEST(CudaModelGpu, EngineInspectionOnTheGpuIsTheCpuForwards) {
  QUADS_REQUIRE_GPU();
  const model::Weights& w = fixture_weights();
  const int L = w.cfg.num_hidden_layers;
  const auto ids = input_ids();
  std::vector<std::vector<int32_t>> seqs;
  for (size_t p = 0, n = 3; p + n <= ids.size(); p += n, n += 2) seqs.emplace_back(ids.begin() + p, ids.begin() + p + n);
  const model::Batch b = model::Batch::of(seqs);
  for (const auto& [preset, tol] : std::vector<std::pair<std::string, double>>{{"fp32", 0.0}, {"bf16", 0.05},
                                                                                {"nvfp4", 0.02}, {"fp8", 0.05}}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    rollout::RolloutEngine cpu(w, prec);
    const rollout::Inspection want = cpu.inspect(b, true);
    rollout::RolloutEngine eng(w, prec);
    eng.set_backend(cuda::make_gpu_backend(w, prec));
    for (int64_t chunk : {int64_t(1), int64_t(12), int64_t(8192)}) {
      const rollout::Inspection got = eng.inspect(b, chunk != 12, chunk);
      if (preset == "fp32") {
        EXPECT_EQ(got.routing.experts, want.routing.experts) << "chunk " << chunk;
      }
      if (chunk == 12) {
        EXPECT_TRUE(got.act_error.empty());
        continue;
      }
      ASSERT_EQ(got.act_error.size(), want.act_error.size()) << preset << " chunk " << chunk;
      double worst = 0;
      for (const auto& [name, e] : got.act_error) {
        ASSERT_TRUE(want.act_error.count(name)) << name;
        const rollout::ActError& c = want.act_error.at(name);
        EXPECT_EQ(e.layer, c.layer) << name;
        EXPECT_EQ(e.rows, c.rows) << name;
        const double rg = e.sq_err / e.sq_norm, rc = c.sq_err / c.sq_norm;
        worst = std::max(worst, std::fabs(rg - rc) / rc);
        EXPECT_NEAR(e.sq_norm, c.sq_norm, 5e-3 * c.sq_norm) << name;
      }
      const std::vector<double> qg = got.act_qerr_layers(L), qc = want.act_qerr_layers(L);
      std::printf("%s chunk %lld: act_qerr layer 0 GPU %.6g CPU %.6g; worst linear's rel. MSE off by %.3g\n",
                  preset.c_str(), static_cast<long long>(chunk), qg[0], qc[0], worst);
      for (int l = 0; l < L; ++l) EXPECT_NEAR(qg[l], qc[l], tol * qc[l]) << preset << " layer " << l;
      EXPECT_LE(worst, 0.25) << preset << ": a linear of a few rows moves most where a code flips";
    }
  }
  // and the engine still generates afterwards (its next generate() resets the cache), with the
  // GPU's fused kernels back (a measuring step restores them)
  const auto prec = model::PrecisionConfig::preset("fp32");
  rollout::RolloutEngine cpu(w, prec), eng(w, prec);
  eng.set_backend(cuda::make_gpu_backend(w, prec));
  (void)eng.inspect(b, true);
  rollout::Request r;
  r.prompt = seqs[0];
  r.max_new_tokens = 5;
  r.sampling.greedy = true;
  EXPECT_EQ(eng.generate({r})[0].tokens, cpu.generate({r})[0].tokens);
}

// Static RAC calibrated on the GPU (GpuModel::rac_energy, RolloutEngine::calibrate_rac): every
// linear's channel energies are the CPU forward's within the two devices' rounding of X, the
// selections differ from the CPU's at most at the threshold (a block in one and not the other has
// nearly the threshold's energy), the engine selects from the GPU's energies exactly, and the GPU
// then generates what the CPU does with its own calibration.
TEST(CudaModelGpu, RacCalibratedOnTheGpuIsTheCpus) {
  QUADS_REQUIRE_GPU();
  const model::Weights& w = fixture_weights();
  const auto ids = input_ids();
  std::vector<std::vector<int32_t>> seqs;
  for (size_t p = 0, n = 3; p + n <= ids.size(); p += n, n += 2) seqs.emplace_back(ids.begin() + p, ids.begin() + p + n);
  const model::Batch b = model::Batch::of(seqs);
  const auto prec = model::PrecisionConfig::preset("nvfp4");
  const model::RacConfig rc;  // half the channels, whole blocks, NVFP4 residual

  // The CPU's energies (rac_calibrate's probe) and the GPU's over the same rows, one step.
  model::Weights wm = w;
  model::Model m(wm, prec);
  std::map<std::string, std::vector<double>> cpu_e, gpu_e;
  model::ForwardOptions fo;
  fo.probe = [&](const model::LinearQ& L, const float* X, const float* X_eff, const float*, int64_t M) {
    if (L.num.act.kind != model::QuantKind::Quant) return;
    auto& e = cpu_e[L.name];
    if (e.empty()) e.assign(L.in, 0.0);
    model::rac_energy(X, X_eff, M, L.in, e.data());
  };
  std::vector<float> logits(size_t(b.ntokens()) * w.cfg.vocab_size);
  m.forward(b, logits.data(), nullptr, fo);
  cuda::GpuModel g(w, prec);
  g.reset_cache(b.nseq(), 64);
  std::vector<model::StepItem> items;
  for (int q = 0; q < b.nseq(); ++q) {
    model::StepItem it;
    it.slot = q;
    it.tokens = seqs[q];
    items.push_back(it);
  }
  g.rac_energy(items, gpu_e);
  ASSERT_EQ(gpu_e.size(), cpu_e.size());
  double worst_total = 0;
  int linears = 0, blocks = 0, boundary = 0;
  for (const auto& [name, ec] : cpu_e) {
    ASSERT_TRUE(gpu_e.count(name)) << name;
    const std::vector<double>& eg = gpu_e.at(name);
    ASSERT_EQ(eg.size(), ec.size()) << name;
    double tc = 0, tg = 0;
    for (size_t j = 0; j < ec.size(); ++j) {
      tc += ec[j];
      tg += eg[j];
    }
    if (tc == 0) {  // an expert no token chose
      EXPECT_EQ(tg, 0) << name;
      continue;
    }
    worst_total = std::max(worst_total, std::fabs(tg - tc) / tc);
    const int64_t in = int64_t(ec.size()), count = model::rac_count(in, rc.ratio);
    const auto sc = model::rac_select(ec.data(), in, count, rc.granularity);
    const auto sg = model::rac_select(eg.data(), in, count, rc.granularity);
    ++linears;
    // block energies on the CPU; the threshold is the smallest selected one
    std::vector<double> be(in / 16, 0.0);
    for (int64_t j = 0; j < in; ++j) be[j / 16] += ec[j];
    double thr = INFINITY;
    for (size_t i = 0; i < sc.size(); i += 16) thr = std::min(thr, be[sc[i] / 16]);
    std::vector<int32_t> diff;
    std::set_symmetric_difference(sc.begin(), sc.end(), sg.begin(), sg.end(), std::back_inserter(diff));
    blocks += int(sc.size() / 16);
    for (size_t i = 0; i < diff.size(); i += 16) {
      ++boundary;
      EXPECT_NEAR(be[diff[i] / 16], thr, 0.1 * thr) << name << ": block " << diff[i] / 16 << " chosen on one side only";
    }
  }
  std::printf("RAC energies: %d linears, worst total off by %.3g; %d of %d selected blocks differ (at the threshold)\n",
              linears, worst_total, boundary / 2, blocks);
  EXPECT_GT(linears, 0);
  EXPECT_LT(worst_total, 0.02);
  EXPECT_LE(boundary, blocks / 10) << "most selections must agree";

  // The engine: one chunk is the step above (its selection exactly), chunks of 12 tokens nearly.
  rollout::RolloutEngine eng(w, prec), cpu(w, prec);
  eng.set_backend(cuda::make_gpu_backend(w, prec));
  const int n0 = cpu.calibrate_rac(b, rc);
  for (const int64_t chunk : {int64_t(8192), int64_t(12)}) {
    EXPECT_EQ(eng.calibrate_rac(b, rc, chunk), n0);
    for (const model::LinearQ& L : eng.model().linears()) {
      if (!gpu_e.count(L.name)) {
        EXPECT_TRUE(L.rac_channels.empty()) << L.name;
        continue;
      }
      const auto want = model::rac_select(gpu_e.at(L.name).data(), L.in, model::rac_count(L.in, rc.ratio), rc.granularity);
      if (chunk == 8192) {
        EXPECT_EQ(L.rac_channels, want) << L.name;
      }
      EXPECT_EQ(L.rac_channels.size(), want.size()) << L.name;
    }
  }
  (void)eng.calibrate_rac(b, rc);
  rollout::RolloutEngine norac(w, prec);
  norac.set_backend(cuda::make_gpu_backend(w, prec));
  rollout::Request r;
  r.prompt = seqs[1];
  r.max_new_tokens = 6;
  r.sampling.greedy = true;
  const rollout::Result got = eng.generate({r})[0], want = cpu.generate({r})[0], off = norac.generate({r})[0];
  // compared while the sequences agree (a near-tie may flip a greedy token between devices)
  auto max_gap = [](const rollout::Result& x, const rollout::Result& y) {
    double d = 0;
    for (size_t i = 0; i < x.tokens.size() && i < y.tokens.size(); ++i) {
      d = std::max(d, double(std::fabs(x.logprobs[i] - y.logprobs[i])));
      if (x.tokens[i] != y.tokens[i]) break;
    }
    return d;
  };
  const double d_cpu = max_gap(got, want), d_off = max_gap(got, off);
  std::printf("greedy log-probs with GPU-calibrated RAC: max |GPU - CPU| %.3g, |with - without RAC| %.3g\n", d_cpu,
              d_off);
  EXPECT_LT(d_cpu, 0.25 * d_off) << "RAC must move the log-probs more than the devices differ";
}

TEST(CudaModelGpu, PrefillAndDecodeAgree) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  for (const std::string preset : {"fp32", "nvfp4"}) {
    cuda::GpuModel g(fixture_weights(), model::PrecisionConfig::preset(preset));
    const auto whole = gpu_logits(g, ids, 1000);
    const auto by_token = gpu_logits(g, ids, 1);
    const auto chunks = gpu_logits(g, ids, 5);
    const double tol = preset == "fp32" ? 1e-5 : 2e-3;
    EXPECT_LT(rel_l2(by_token, whole), tol) << preset;
    EXPECT_LT(rel_l2(chunks, whole), tol) << preset;
    // Deterministic: the same step twice gives the same bits.
    EXPECT_EQ(gpu_logits(g, ids, 5), chunks) << preset;
  }
}

TEST(CudaModelGpu, SlotsAreIndependentAndCopied) {
  QUADS_REQUIRE_GPU();
  const auto ids = input_ids();
  cuda::GpuModel g(fixture_weights(), model::PrecisionConfig::preset("fp32"));
  const auto alone = gpu_logits(g, ids, 1000);
  const int64_t V = g.config().vocab_size;
  // Two sequences packed in one step (slot 2: the first 10 tokens, slot 0: all), then slot 2
  // copied to slot 1 and continued there.
  g.reset_cache(3, 64);
  model::StepItem a, b;
  a.slot = 2;
  a.tokens.assign(ids.begin(), ids.begin() + 10);
  b.slot = 0;
  b.tokens = ids;
  b.all_logits = true;
  const auto both = g.step({a, b});
  ASSERT_EQ(both.size(), size_t(1 + ids.size()) * V);
  const std::vector<float> b_rows(both.begin() + V, both.end());
  EXPECT_LT(rel_l2(b_rows, alone), 1e-5);
  const std::vector<float> a_row(both.begin(), both.begin() + V), a_want(alone.begin() + 9 * V, alone.begin() + 10 * V);
  EXPECT_LT(rel_l2(a_row, a_want), 1e-5);
  g.copy(2, 1);
  EXPECT_EQ(g.length(1), 10);
  model::StepItem c;
  c.slot = 1;
  c.tokens.assign(ids.begin() + 10, ids.end());
  c.all_logits = true;
  const auto rest = g.step({c});
  const std::vector<float> rest_want(alone.begin() + 10 * V, alone.end());
  EXPECT_LT(rel_l2(rest, rest_want), 1e-5);
  // Errors name what is wrong.
  model::StepItem bad;
  bad.slot = 1;
  bad.tokens = {static_cast<int32_t>(V)};
  EXPECT_THROW(g.step({bad}), Error);
  bad.tokens = std::vector<int32_t>(100, 1);
  EXPECT_THROW(g.step({bad}), Error);  // past max_len
}

// Greedy generation through the rollout engine with the GPU backend: the fixture's transformers
// continuation in fp32, and the CPU engine's tokens in bf16 / nvfp4 up to the first step where
// the CPU's top-2 logit margin is below 0.02 (too close for a different summation order to be
// sure of it; on the fixture the smallest margins are 0.034 (bf16) and 0.048 (nvfp4), so all 16
// tokens are compared).
TEST(CudaModelGpu, GreedyGenerationMatches) {
  QUADS_REQUIRE_GPU();
  const auto j = read_json(fixture("greedy.json"));
  rollout::Request r;
  r.prompt = j["prompt"].get<std::vector<int32_t>>();
  const auto want = j["greedy"].get<std::vector<int32_t>>();
  r.max_new_tokens = static_cast<int>(want.size() - r.prompt.size());
  r.sampling.greedy = true;
  {
    rollout::RolloutEngine eng(fixture_weights(), model::PrecisionConfig::preset("fp32"));
    eng.set_backend(cuda::make_gpu_backend(fixture_weights(), eng.precision()));
    const auto out = eng.generate({r, r, r});  // three copies: prefill shared, slots copied
    for (const auto& o : out) EXPECT_EQ(o.ids(), want);
  }
  for (const std::string preset : {"bf16", "nvfp4", "fp8"}) {
    const auto prec = model::PrecisionConfig::preset(preset);
    rollout::RolloutEngine cpu(fixture_weights(), prec);
    const auto ref = cpu.generate({r})[0];
    // The CPU's top-2 margins along its own greedy path.
    model::Weights w = fixture_weights();
    model::Model m(w, prec);
    const auto ids = ref.ids();
    model::KVCache cache(w.cfg, 1);
    model::StepItem it;
    it.tokens = ids;
    it.all_logits = true;
    const auto lg = m.step(cache, {it});
    const int64_t V = w.cfg.vocab_size;
    size_t sure = 0;
    for (size_t t = r.prompt.size() - 1; t + 1 < ids.size(); ++t, ++sure) {
      std::vector<float> row(lg.begin() + t * V, lg.begin() + (t + 1) * V);
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
      if (row[0] - row[1] < 0.02f) break;  // far above the logit deviations measured above
    }
    rollout::RolloutEngine eng(fixture_weights(), prec);
    eng.set_backend(cuda::make_gpu_backend(fixture_weights(), prec));
    const auto got = eng.generate({r})[0];
    std::printf("%s: GPU greedy = CPU greedy for the first %zu tokens required (%zu generated)\n", preset.c_str(), sure,
                ref.tokens.size());
    EXPECT_GE(sure, size_t(8)) << preset;
    for (size_t i = 0; i < sure; ++i) ASSERT_EQ(got.tokens[i], ref.tokens[i]) << preset << " token " << i;
    for (size_t i = 0; i < sure; ++i) EXPECT_NEAR(got.logprobs[i], ref.logprobs[i], 1e-2) << preset << " token " << i;
  }
}
