// The GPU trainer's kernels (cuda/train_kernels.h) against their CPU twins (cpu/ops.h,
// train/losses.h, train/adamw.h) on random shapes: odd sizes, packed sequences of different
// lengths, GQA ratios 1/2/8, head_dim 32..256, top-1..8 with and without renormalization, forced
// experts, rows without a target, x_scale != 1. Kernels that follow the CPU's float operations are
// held to the same bits; reductions in another order to a relative L2 error. Each kernel is also
// run twice: the same bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "cuda/check.h"
#include "cuda/quant.h"
#include "cuda/train_kernels.h"
#include "cuda_test_util.h"
#include "model/config.h"
#include "reqat/kv_quant.h"
#include "train/adamw.h"
#include "train/losses.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;
namespace kern = quads::cuda::kern;

namespace {

void device_sync() { QUADS_CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace

// ---- RMSNorm: both launch shapes (a warp per row for D <= 1024, a CTA per row above), dw
// accumulated onto a nonzero start.
TEST(CudaTrainKernels, RmsNormMatchesCpu) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t rows, D;
  };
  for (const Case c : {Case{1, 7}, Case{37, 128}, Case{300, 64}, Case{5, 2048}, Case{129, 1030}, Case{2000, 32}}) {
    const uint64_t seed = 100 + c.rows * 7 + c.D;
    const auto x = random_matrix(c.rows, c.D, seed);
    auto w = randn(c.D, seed + 1, 0.3f);
    for (auto& v : w) v += 1.f;
    const auto dy = randn(c.rows * c.D, seed + 2);
    const auto dw0 = randn(c.D, seed + 3);
    const float eps = 1e-6f;
    std::vector<float> y(c.rows * c.D), inv(c.rows), dx(c.rows * c.D), dw = dw0;
    cpu::rmsnorm_forward(x.data(), w.data(), c.rows, c.D, eps, y.data(), inv.data());
    cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), inv.data(), c.rows, c.D, dx.data(), dw.data());

    DeviceArray<float> gx = dev(x), gw = dev(w), gdy = dev(dy), gy(y.size()), ginv(inv.size()), gdx(dx.size());
    DeviceArray<float> gdw = dev(dw0), scratch(std::max<int64_t>(1, kern::rmsnorm_bwd_scratch(c.rows, c.D)));
    kern::rmsnorm_fwd(gx.data(), gw.data(), c.rows, c.D, eps, gy.data(), ginv.data(), nullptr);
    kern::rmsnorm_bwd(gdy.data(), gx.data(), gw.data(), ginv.data(), c.rows, c.D, gdx.data(), gdw.data(),
                      scratch.data(), nullptr);
    device_sync();
    const auto y1 = gy.download(), inv1 = ginv.download(), dx1 = gdx.download(), dw1 = gdw.download();
    EXPECT_LT(rel_l2(y1, y), 1e-7) << c.rows << "x" << c.D;
    EXPECT_LT(rel_l2(inv1, inv), 1e-7) << c.rows << "x" << c.D;
    EXPECT_LT(rel_l2(dx1, dx), 1e-6) << c.rows << "x" << c.D;
    EXPECT_LT(rel_l2(dw1, dw), 1e-6) << c.rows << "x" << c.D;

    // Again (dw from the same start; no dw at all must leave it alone): the same bits.
    gdw.upload(dw0);
    kern::rmsnorm_fwd(gx.data(), gw.data(), c.rows, c.D, eps, gy.data(), ginv.data(), nullptr);
    kern::rmsnorm_bwd(gdy.data(), gx.data(), gw.data(), ginv.data(), c.rows, c.D, gdx.data(), gdw.data(),
                      scratch.data(), nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gy.download(), y1), -1);
    EXPECT_EQ(first_float_mismatch(gdx.download(), dx1), -1);
    EXPECT_EQ(first_float_mismatch(gdw.download(), dw1), -1);
    kern::rmsnorm_bwd(gdy.data(), gx.data(), gw.data(), ginv.data(), c.rows, c.D, gdx.data(), nullptr, nullptr, nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gdx.download(), dx1), -1);
    EXPECT_EQ(first_float_mismatch(gdw.download(), dw1), -1);
  }
}

// ---- RoPE: the CPU's float operations, so the same bits.
TEST(CudaTrainKernels, RopeMatchesCpuBitwise) {
  QUADS_REQUIRE_GPU();
  for (const int hd : {32, 64, 128}) {
    const int64_t n = 37;
    const int heads = 3;
    std::mt19937_64 rng(hd);
    std::vector<int64_t> pos(n);
    for (auto& p : pos) p = static_cast<int64_t>(rng() % 5000);
    std::vector<float> cs(n * hd / 2), sn(n * hd / 2);
    cpu::rope_tables(pos.data(), n, hd, 1e6, cs.data(), sn.data());
    const auto x = randn(n * heads * hd, 7 + hd);
    auto fwd = x, bwd = x;
    cpu::rope_forward(fwd.data(), n, heads, hd, cs.data(), sn.data());
    cpu::rope_backward(bwd.data(), n, heads, hd, cs.data(), sn.data());
    DeviceArray<float> gf = dev(x), gb = dev(x), gc = dev(cs), gs = dev(sn);
    kern::rope_fwd(gf.data(), n, heads, hd, gc.data(), gs.data(), nullptr);
    kern::rope_bwd(gb.data(), n, heads, hd, gc.data(), gs.data(), nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gf.download(), fwd), -1) << "hd " << hd;
    EXPECT_EQ(first_float_mismatch(gb.download(), bwd), -1) << "hd " << hd;
  }
}

// ---- ReQAT's KV transform in the trainer: kv_factor and sub_cols against the CPU hooks made from
// the same transform (reqat::make_kv_hooks), bit for bit: pre_rope (q times f, k divided by f),
// pre_rope_backward (the same map), post_rope without the quantizer (k minus the shift).
TEST(CudaTrainKernels, KvTransformMatchesCpuHooksBitwise) {
  QUADS_REQUIRE_GPU();
  for (const auto& [nh, nkv, hd] : {std::tuple{4, 2, 16}, std::tuple{8, 1, 64}, std::tuple{6, 6, 32}}) {
    model::ModelConfig c;
    c.num_hidden_layers = 1;
    c.num_attention_heads = nh;
    c.num_key_value_heads = nkv;
    c.head_dim = hd;
    const int64_t n = 29, kvd = int64_t(nkv) * hd;
    model::KvTransform t;
    t.factor = {randn(kvd, 3 + hd)};
    for (float& f : t.factor[0]) f = 0.25f + std::fabs(f);
    t.shift = {randn(kvd, 5 + hd)};
    const model::KvHooks h = reqat::make_kv_hooks(c, t);
    const auto q = randn(n * nh * hd, 11 + nh), k = randn(n * kvd, 13 + nkv), v = randn(n * kvd, 17);
    auto cq = q, ck = k, cv = v, bq = q, bk = k;
    h.pre_rope(0, cq.data(), ck.data(), n);
    h.pre_rope_backward(0, bq.data(), bk.data(), n);
    auto sk = k;
    h.post_rope(0, sk.data(), cv.data(), n);
    DeviceArray<float> gq = dev(q), gk = dev(k), gs = dev(k), gf = dev(t.factor[0]), gm = dev(t.shift[0]);
    kern::kv_factor(gq.data(), gk.data(), n, nh, nkv, hd, gf.data(), nullptr);
    kern::sub_cols(gs.data(), n, kvd, gm.data(), nullptr);
    device_sync();
    SCOPED_TRACE(std::to_string(nh) + "/" + std::to_string(nkv) + " heads, hd " + std::to_string(hd));
    EXPECT_EQ(first_float_mismatch(gq.download(), cq), -1);
    EXPECT_EQ(first_float_mismatch(gk.download(), ck), -1);
    EXPECT_EQ(cq, bq) << "the backward's map is the forward's";
    EXPECT_EQ(ck, bk);
    EXPECT_EQ(first_float_mismatch(gs.download(), sk), -1);
    EXPECT_EQ(cv, v) << "without the quantizer the post-RoPE hook leaves V alone";
    EXPECT_NE(cq, q);
  }
}

// ---- Attention over packed sequences vs cpu::attention_forward / attention_backward per sequence.
TEST(CudaTrainKernels, AttentionMatchesCpuPerSequence) {
  QUADS_REQUIRE_GPU();
  struct Case {
    std::vector<int> lens;
    int nh, nkv, hd;
  };
  const std::vector<Case> cases = {
      {{1}, 2, 1, 32},                // T = 1
      {{70, 5, 129}, 4, 2, 64},       // GQA 2, T not a multiple of the tile, tiles across sequences
      {{33, 100}, 8, 1, 128},         // GQA 8
      {{40, 3, 1}, 2, 2, 256},        // GQA 1, the 32-row tiles
      {{65, 64, 1, 31}, 3, 3, 96},    // head_dim padded to 128
      {{200, 150, 64}, 4, 1, 128},    // several full tiles per sequence
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    const PackedAttention pa = packed_attention(c.lens, c.nh, c.nkv, c.hd, 11 + ci);
    const auto& [seq0, off, T, qd, kd, scale, q, k, v, dout, out, lse, dq, dk, dv] = pa;
    DeviceArray<float> gq = dev(q), gk = dev(k), gv = dev(v), gdo = dev(dout), gout(out.size()), glse(lse.size());
    DeviceArray<float> gdq(dq.size()), gdk(dk.size()), gdv(dv.size());
    DeviceArray<int32_t> gs0 = dev(seq0);
    // NaN-filled outputs: every element must be written.
    for (auto* a : {&gout, &glse, &gdq, &gdk, &gdv}) a->fill_bytes(0xFF);
    kern::attention_train_fwd(gq.data(), gk.data(), gv.data(), gs0.data(), T, c.nh, c.nkv, c.hd, scale, gout.data(),
                              glse.data(), nullptr);
    // The backward from the CPU's out / lse, so that it is compared on its own.
    DeviceArray<float> cout = dev(out), clse = dev(lse);
    kern::attention_train_bwd(gq.data(), gk.data(), gv.data(), cout.data(), clse.data(), gdo.data(), gs0.data(), T,
                              c.nh, c.nkv, c.hd, scale, gdq.data(), gdk.data(), gdv.data(), nullptr);
    device_sync();
    const auto out1 = gout.download(), lse1 = glse.download();
    const auto dq1 = gdq.download(), dk1 = gdk.download(), dv1 = gdv.download();
    // Gradients relative to at least 0.1 |dout|: with one-token sequences dq and dk are zero
    // up to rounding (p = 1), and a relative error of rounding noise means nothing.
    auto grad_err = [&](const std::vector<float>& a, const std::vector<float>& b) {
      double num = 0, den = 0, ref = 0;
      for (size_t i = 0; i < b.size(); ++i) {
        num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
        den += double(b[i]) * double(b[i]);
      }
      for (float x : dout) ref += double(x) * double(x);
      return std::sqrt(num / std::max(den, 1e-2 * ref));
    };
    const double e_out = rel_l2(out1, out), e_lse = rel_l2(lse1, lse);
    const double e_dq = grad_err(dq1, dq), e_dk = grad_err(dk1, dk), e_dv = grad_err(dv1, dv);
    std::printf("attention case %zu (T %lld, heads %d/%d, hd %d): rel L2 out %.3g lse %.3g dq %.3g dk %.3g dv %.3g\n",
                ci, static_cast<long long>(T), c.nh, c.nkv, c.hd, e_out, e_lse, e_dq, e_dk, e_dv);
    EXPECT_LT(e_out, 2e-6) << "case " << ci;
    EXPECT_LT(e_lse, 1e-6) << "case " << ci;
    EXPECT_LT(e_dq, 5e-6) << "case " << ci;
    EXPECT_LT(e_dk, 5e-6) << "case " << ci;
    EXPECT_LT(e_dv, 5e-6) << "case " << ci;

    for (auto* a : {&gout, &glse, &gdq, &gdk, &gdv}) a->fill_bytes(0);
    kern::attention_train_fwd(gq.data(), gk.data(), gv.data(), gs0.data(), T, c.nh, c.nkv, c.hd, scale, gout.data(),
                              glse.data(), nullptr);
    kern::attention_train_bwd(gq.data(), gk.data(), gv.data(), cout.data(), clse.data(), gdo.data(), gs0.data(), T,
                              c.nh, c.nkv, c.hd, scale, gdq.data(), gdk.data(), gdv.data(), nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gout.download(), out1), -1) << "case " << ci;
    EXPECT_EQ(first_float_mismatch(glse.download(), lse1), -1) << "case " << ci;
    EXPECT_EQ(first_float_mismatch(gdq.download(), dq1), -1) << "case " << ci;
    EXPECT_EQ(first_float_mismatch(gdk.download(), dk1), -1) << "case " << ci;
    EXPECT_EQ(first_float_mismatch(gdv.download(), dv1), -1) << "case " << ci;
  }
}

// The backward is the gradient of the forward: a finite-difference check of <dout, out> through
// the device kernels alone (double-checks the packing, where the CPU twin is per sequence).
TEST(CudaTrainKernels, AttentionBackwardIsTheGradient) {
  QUADS_REQUIRE_GPU();
  const std::vector<int32_t> seq0 = {0, 0, 0, 0, 0, 5, 5, 5, 8, 8, 8, 8, 8, 8, 8, 8, 8};
  const int64_t T = static_cast<int64_t>(seq0.size());
  const int nh = 4, nkv = 2, hd = 32;
  const float scale = 0.25f;
  const int64_t qd = int64_t(nh) * hd, kd = int64_t(nkv) * hd;
  const auto q = randn(T * qd, 51), k = randn(T * kd, 52), v = randn(T * kd, 53), dout = randn(T * qd, 54);
  DeviceArray<float> gq = dev(q), gk = dev(k), gv = dev(v), gdo = dev(dout), gout(T * qd), glse(T * nh);
  DeviceArray<float> gdq(T * qd), gdk(T * kd), gdv(T * kd);
  DeviceArray<int32_t> gs0 = dev(seq0);
  auto objective = [&](const std::vector<float>& qq, const std::vector<float>& kk, const std::vector<float>& vv) {
    gq.upload(qq);
    gk.upload(kk);
    gv.upload(vv);
    kern::attention_train_fwd(gq.data(), gk.data(), gv.data(), gs0.data(), T, nh, nkv, hd, scale, gout.data(),
                              glse.data(), nullptr);
    const auto o = gout.download();
    double s = 0;
    for (size_t i = 0; i < o.size(); ++i) s += double(o[i]) * double(dout[i]);
    return s;
  };
  objective(q, k, v);
  kern::attention_train_bwd(gq.data(), gk.data(), gv.data(), gout.data(), glse.data(), gdo.data(), gs0.data(), T, nh,
                            nkv, hd, scale, gdq.data(), gdk.data(), gdv.data(), nullptr);
  device_sync();
  const auto dq = gdq.download(), dk = gdk.download(), dv = gdv.download();
  std::mt19937 rng(3);
  const float h = 1e-2f;
  for (int which = 0; which < 3; ++which) {
    const std::vector<float>& base = which == 0 ? q : which == 1 ? k : v;
    const std::vector<float>& grad = which == 0 ? dq : which == 1 ? dk : dv;
    for (int trial = 0; trial < 12; ++trial) {
      const size_t i = rng() % base.size();
      auto plus = base, minus = base;
      plus[i] += h;
      minus[i] -= h;
      auto run = [&](const std::vector<float>& x) {
        return which == 0 ? objective(x, k, v) : which == 1 ? objective(q, x, v) : objective(q, k, x);
      };
      const double fd = (run(plus) - run(minus)) / (2.0 * h);
      EXPECT_NEAR(grad[i], fd, 2e-3 + 2e-3 * std::fabs(fd)) << "tensor " << which << " element " << i;
    }
  }
}

// ---- Router: softmax + top-k (ties: the lower id), forced experts, and its backward.
TEST(CudaTrainKernels, RouterMatchesCpu) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t T;
    int E, k;
    bool norm, forced, extra;
  };
  const std::vector<Case> cases = {{1, 8, 1, true, false, false},   {37, 64, 8, true, false, true},
                                   {300, 64, 8, false, false, false}, {50, 60, 4, true, true, true},
                                   {129, 16, 2, false, true, false}, {64, 128, 8, true, false, false}};
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    std::mt19937_64 rng(77 + ci);
    auto logits = randn(c.T * c.E, 78 + ci, 2.f);
    // Every third row in whole numbers: many exact ties.
    for (int64_t t = 0; t < c.T; t += 3)
      for (int e = 0; e < c.E; ++e) logits[t * c.E + e] = std::round(logits[t * c.E + e]);
    std::vector<int32_t> forced;
    if (c.forced) {
      forced.resize(c.T * c.k);
      for (int64_t t = 0; t < c.T; ++t) {
        std::vector<int32_t> ex(c.E);
        for (int e = 0; e < c.E; ++e) ex[e] = e;
        std::shuffle(ex.begin(), ex.end(), rng);
        std::copy(ex.begin(), ex.begin() + c.k, forced.begin() + t * c.k);
      }
    }
    std::vector<float> probs(c.T * c.E), w(c.T * c.k), dlog(c.T * c.E);
    std::vector<int32_t> idx(c.T * c.k);
    cpu::router_topk_forward(logits.data(), c.T, c.E, c.k, c.norm, probs.data(), idx.data(), w.data(),
                             c.forced ? forced.data() : nullptr);
    const auto dw = randn(c.T * c.k, 90 + ci);
    const auto extra = randn(c.T * c.E, 91 + ci, 0.1f);
    cpu::router_topk_backward(probs.data(), idx.data(), w.data(), dw.data(), c.extra ? extra.data() : nullptr, c.T, c.E,
                              c.k, c.norm, dlog.data());

    DeviceArray<float> gl = dev(logits), gp(probs.size()), gw(w.size()), gdw = dev(dw), gex = dev(extra);
    DeviceArray<float> gdl(dlog.size());
    DeviceArray<int32_t> gi(idx.size()), gf = dev(forced);
    kern::router_topk_fwd(gl.data(), c.T, c.E, c.k, c.norm, gp.data(), gi.data(), gw.data(),
                          c.forced ? gf.data() : nullptr, nullptr);
    device_sync();
    const auto p1 = gp.download(), w1 = gw.download();
    const auto i1 = gi.download();
    EXPECT_LT(rel_l2(p1, probs), 1e-6) << "case " << ci;
    EXPECT_LT(rel_l2(w1, w), 1e-6) << "case " << ci;
    EXPECT_EQ(first_mismatch(i1, idx), -1) << "case " << ci;
    // The backward from the CPU's forward: the same double arithmetic in the same order.
    DeviceArray<float> cp = dev(probs), cw = dev(w);
    DeviceArray<int32_t> ci_ = dev(idx);
    kern::router_topk_bwd(cp.data(), ci_.data(), cw.data(), gdw.data(), c.extra ? gex.data() : nullptr, c.T, c.E, c.k,
                          c.norm, gdl.data(), nullptr);
    device_sync();
    const auto dl1 = gdl.download();
    EXPECT_EQ(first_float_mismatch(dl1, dlog), -1) << "case " << ci;
    EXPECT_LT(rel_l2(dl1, dlog), 1e-7) << "case " << ci;

    kern::router_topk_fwd(gl.data(), c.T, c.E, c.k, c.norm, gp.data(), gi.data(), gw.data(),
                          c.forced ? gf.data() : nullptr, nullptr);
    kern::router_topk_bwd(cp.data(), ci_.data(), cw.data(), gdw.data(), c.extra ? gex.data() : nullptr, c.T, c.E, c.k,
                          c.norm, gdl.data(), nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gp.download(), p1), -1);
    EXPECT_EQ(first_float_mismatch(gw.download(), w1), -1);
    EXPECT_EQ(first_mismatch(gi.download(), i1), -1);
    EXPECT_EQ(first_float_mismatch(gdl.download(), dl1), -1);
  }
}

// The router z-loss's backward term: cpu::router_zloss_backward bit for bit (one double product and
// a float add per element), on top of a router backward's dlogits.
TEST(CudaTrainKernels, RouterZlossBackwardIsTheCpus) {
  QUADS_REQUIRE_GPU();
  for (const auto& [T, E] : std::vector<std::pair<int64_t, int>>{{1, 4}, {37, 64}, {300, 8}}) {
    std::vector<float> logits = randn(T * E, 5 + T), probs(T * E), dlog = randn(T * E, 7 + T);
    for (int64_t t = 0; t < T; ++t) cpu::softmax_forward(logits.data() + t * E, 1, E, probs.data() + t * E);
    std::vector<double> z(T);
    cpu::router_logsumexp(logits.data(), T, E, z.data());
    for (int64_t t = 0; t < T; ++t) z[t] *= 0.02 / double(T);
    DeviceArray<float> dp = dev(probs), dd = dev(dlog);
    DeviceArray<double> dz(T);
    dz.upload(z);
    kern::router_zloss_bwd(dp.data(), dz.data(), T, E, dd.data(), nullptr);
    cpu::router_zloss_backward(probs.data(), z.data(), T, E, dlog.data());
    EXPECT_EQ(first_float_mismatch(dd.download(), dlog), -1) << T << " x " << E;
  }
}

// ---- MoE combine / scatter on a real permutation (cpu::moe_permute), and SwiGLU's backward.
TEST(CudaTrainKernels, MoeCombineScatterSwigluMatchCpu) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t T;
    int k, E;
    int64_t D;
  };
  for (const Case c : {Case{1, 1, 4, 5}, Case{37, 8, 64, 128}, Case{130, 2, 8, 67}, Case{64, 4, 16, 2048}}) {
    std::mt19937_64 rng(c.T * 31 + c.k);
    std::vector<int32_t> idx(c.T * c.k);
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<int32_t> ex(c.E);
      for (int e = 0; e < c.E; ++e) ex[e] = e;
      std::shuffle(ex.begin(), ex.end(), rng);
      std::copy(ex.begin(), ex.begin() + c.k, idx.begin() + t * c.k);
    }
    const int64_t n = c.T * c.k;
    std::vector<int64_t> eoff(c.E + 1);
    std::vector<int32_t> perm(n), inv(n);
    cpu::moe_permute(idx.data(), c.T, c.k, c.E, eoff.data(), perm.data(), inv.data());
    const auto ye = randn(n * c.D, 5 + c.T), w = randn(n, 6 + c.T, 0.3f), dy = randn(c.T * c.D, 7 + c.T);
    const auto dxe = randn(n * c.D, 8 + c.T), dx0 = randn(c.T * c.D, 9 + c.T);
    std::vector<float> y(c.T * c.D), dye(n * c.D), dwv(n), dxa = dx0, dxw(c.T * c.D);
    cpu::moe_combine_forward(ye.data(), inv.data(), w.data(), c.T, c.k, c.D, y.data());
    cpu::moe_combine_backward(dy.data(), ye.data(), inv.data(), w.data(), c.T, c.k, c.D, dye.data(), dwv.data());
    cpu::moe_scatter_add(dxe.data(), inv.data(), c.T, c.k, c.D, dxa.data(), true);
    cpu::moe_scatter_add(dxe.data(), inv.data(), c.T, c.k, c.D, dxw.data(), false);

    DeviceArray<float> gye = dev(ye), gw = dev(w), gdy = dev(dy), gdxe = dev(dxe), gdxa = dev(dx0), gdxw = dev(dx0);
    DeviceArray<float> gy(y.size()), gdye(dye.size()), gdw(dwv.size());
    DeviceArray<int32_t> ginv = dev(inv);
    kern::moe_combine_fwd(gye.data(), ginv.data(), gw.data(), c.T, c.k, c.D, gy.data(), nullptr);
    kern::moe_combine_bwd(gdy.data(), gye.data(), ginv.data(), gw.data(), c.T, c.k, c.D, gdye.data(), gdw.data(),
                          nullptr);
    kern::moe_scatter_add(gdxe.data(), ginv.data(), c.T, c.k, c.D, gdxa.data(), true, nullptr);
    kern::moe_scatter_add(gdxe.data(), ginv.data(), c.T, c.k, c.D, gdxw.data(), false, nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gy.download(), y), -1) << "T " << c.T;
    EXPECT_EQ(first_float_mismatch(gdye.download(), dye), -1) << "T " << c.T;
    const auto dw1 = gdw.download();
    EXPECT_LT(rel_l2(dw1, dwv), 1e-7) << "T " << c.T;
    EXPECT_EQ(first_float_mismatch(gdxa.download(), dxa), -1) << "T " << c.T;
    EXPECT_EQ(first_float_mismatch(gdxw.download(), dxw), -1) << "T " << c.T;
    kern::moe_combine_bwd(gdy.data(), gye.data(), ginv.data(), gw.data(), c.T, c.k, c.D, gdye.data(), gdw.data(),
                          nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gdw.download(), dw1), -1) << "T " << c.T;

    // SwiGLU backward on [T, 2D] gate/up products (large |g| too: the sigmoid saturates).
    auto gu = randn(c.T * 2 * c.D, 10 + c.T, 3.f);
    if (!gu.empty()) gu[0] = 40.f;
    if (gu.size() > 1) gu[1] = -40.f;
    const auto dh = randn(c.T * c.D, 11 + c.T);
    std::vector<float> dgu(gu.size());
    cpu::swiglu_backward(gu.data(), dh.data(), c.T, c.D, dgu.data());
    DeviceArray<float> ggu = dev(gu), gdh = dev(dh), gdgu(dgu.size());
    kern::swiglu_bwd(ggu.data(), gdh.data(), c.T, c.D, gdgu.data(), nullptr);
    device_sync();
    EXPECT_LT(rel_l2(gdgu.download(), dgu), 1e-7) << "T " << c.T;
  }
}

// ---- Embedding backward: the host plan groups tokens by id (stable); the table rows receive the
// tokens' rows in token order, as the CPU adds them, so the same bits.
TEST(CudaTrainKernels, EmbeddingBackwardMatchesCpuBitwise) {
  QUADS_REQUIRE_GPU();
  for (const int64_t T : {int64_t(1), int64_t(7), int64_t(500)}) {
    const int64_t V = 50, H = 67;
    std::mt19937 rng(static_cast<unsigned>(T));
    std::vector<int32_t> tokens(T);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % (T > 7 ? V : 3));  // repeats
    const auto dout = randn(T * H, 20 + T), table0 = randn(V * H, 21 + T);
    auto table = table0;
    cpu::embedding_backward(dout.data(), tokens.data(), T, H, table.data());
    std::vector<int32_t> order(T), starts(T + 1), ids(T);
    int64_t nuniq = -1;
    kern::embedding_bwd_plan(tokens.data(), T, order.data(), starts.data(), ids.data(), &nuniq);
    ASSERT_GE(nuniq, 1);
    EXPECT_EQ(starts[0], 0);
    EXPECT_EQ(starts[nuniq], T);
    for (int64_t u = 0; u < nuniq; ++u) {
      ASSERT_LT(starts[u], starts[u + 1]);
      if (u) {
        EXPECT_LT(ids[u - 1], ids[u]);
      }
      for (int32_t i = starts[u]; i < starts[u + 1]; ++i) {
        EXPECT_EQ(tokens[order[i]], ids[u]);
        if (i > starts[u]) {
          EXPECT_LT(order[i - 1], order[i]);
        }
      }
    }
    DeviceArray<float> gd = dev(dout), gt = dev(table0);
    DeviceArray<int32_t> go = dev(order), gs = dev(starts), gi = dev(ids);
    kern::embedding_bwd(gd.data(), go.data(), gs.data(), gi.data(), nuniq, H, gt.data(), nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gt.download(), table), -1) << "T " << T;
  }
}

// ---- Token log-probs, entropy and the backward vs train/losses.cpp on x_scale * logits.
TEST(CudaTrainKernels, TokenLogprobsMatchCpu) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t T, V;
    float xs;
  };
  // V % 4 == 0: the float4 path; V odd: the scalar one. xs = 0.5: x_scale * dlogp is exact, so the
  // CPU twin sees the same gradient scale.
  for (const Case c : {Case{1, 8, 1.f}, Case{37, 1000, 1.f}, Case{29, 1001, 0.5f}, Case{16, 32000, 1.f / 0.7f},
                       Case{9, 4099, 1.f}}) {
    const auto raw = randn(c.T * c.V, 30 + c.T, 3.f);
    std::vector<float> scaled(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) scaled[i] = raw[i] * c.xs;
    std::mt19937 rng(static_cast<unsigned>(c.V));
    std::vector<int32_t> tg(c.T);
    for (int64_t t = 0; t < c.T; ++t) tg[t] = (t % 5 == 3) ? -1 : static_cast<int32_t>(rng() % c.V);
    auto dlogp = randn(c.T, 40 + c.T);
    if (c.T > 2) dlogp[2] = 0.f;
    std::vector<float> dscaled(c.T);
    for (int64_t t = 0; t < c.T; ++t) dscaled[t] = dlogp[t] * c.xs;
    std::vector<float> logp(c.T), H(c.T), dl(c.T * c.V, 0.f);
    train::token_logprobs(scaled.data(), c.T, c.V, tg.data(), logp.data());
    train::entropy(scaled.data(), c.T, c.V, H.data());
    train::token_logprobs_backward(scaled.data(), c.T, c.V, tg.data(), dscaled.data(), dl.data());

    DeviceArray<float> gx = dev(raw), gdp = dev(dlogp), glp(c.T), gH(c.T), gdl(dl.size()), glp2(c.T);
    DeviceArray<int32_t> gt = dev(tg);
    gdl.fill_bytes(0xFF);  // every element written
    kern::token_logprobs(gx.data(), c.T, c.V, gt.data(), c.xs, glp.data(), gH.data(), nullptr);
    kern::token_logprobs(gx.data(), c.T, c.V, gt.data(), c.xs, glp2.data(), nullptr, nullptr);
    kern::token_logprobs_bwd(gx.data(), c.T, c.V, gt.data(), c.xs, gdp.data(), gdl.data(), nullptr);
    device_sync();
    const auto lp1 = glp.download(), H1 = gH.download(), dl1 = gdl.download();
    const double tol_d = c.xs == 0.5f || c.xs == 1.f ? 1e-7 : 1e-6;
    EXPECT_LT(rel_l2(lp1, logp), 1e-7) << "V " << c.V;
    EXPECT_EQ(first_float_mismatch(glp2.download(), lp1), -1) << "V " << c.V;
    EXPECT_LT(rel_l2(H1, H), 1e-6) << "V " << c.V;
    EXPECT_LT(rel_l2(dl1, dl), tol_d) << "V " << c.V;
    for (int64_t t = 0; t < c.T; ++t)
      if (tg[t] < 0) {
        EXPECT_EQ(lp1[t], 0.f);
        for (int64_t v = 0; v < c.V; ++v) ASSERT_EQ(dl1[t * c.V + v], 0.f) << "row " << t;
      }
    kern::token_logprobs(gx.data(), c.T, c.V, gt.data(), c.xs, glp.data(), gH.data(), nullptr);
    kern::token_logprobs_bwd(gx.data(), c.T, c.V, gt.data(), c.xs, gdp.data(), gdl.data(), nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(glp.download(), lp1), -1);
    EXPECT_EQ(first_float_mismatch(gH.download(), H1), -1);
    EXPECT_EQ(first_float_mismatch(gdl.download(), dl1), -1);
  }
}

// ---- Global norm (aligned and not), scale, and AdamW steps vs train::AdamW::step (clipping by
// the device norm, decay mask): the same bits.
TEST(CudaTrainKernels, OptimizerMatchesCpu) {
  QUADS_REQUIRE_GPU();
  for (const int64_t n : {int64_t(1), int64_t(1000), int64_t(3) * 65536 + 5}) {
    const auto g = randn(n + 1, 60 + n, 1e-3f);
    DeviceArray<float> gg = dev(g);
    DeviceArray<double> scratch(kern::global_norm_scratch(n + 1)), out(2);
    kern::global_norm(gg.data(), n, scratch.data(), out.data(), nullptr);
    kern::global_norm(gg.data() + 1, n, scratch.data(), out.data() + 1, nullptr);  // not 16-byte aligned
    device_sync();
    const auto got = out.download();
    EXPECT_NEAR(got[0], train::global_norm(g.data(), n), 1e-12 * got[0]) << n;
    EXPECT_NEAR(got[1], train::global_norm(g.data() + 1, n), 1e-12 * got[1]) << n;
    kern::global_norm(gg.data(), n, scratch.data(), out.data() + 1, nullptr);
    device_sync();
    const auto again = out.download();
    EXPECT_EQ(again[0], again[1]) << n;
  }

  const int64_t n = 70001;
  train::AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.1;
  cfg.max_grad_norm = 1.0;
  std::vector<uint8_t> mask(n);
  for (int64_t i = 0; i < n; ++i) mask[i] = (i % 3) != 0;
  train::AdamW opt(n, cfg, mask);
  auto params = randn(n, 70);
  DeviceArray<float> gp = dev(params), gm(n), gv(n), gg(n);
  DeviceArray<uint8_t> gmask = dev(mask);
  DeviceArray<double> scratch(kern::global_norm_scratch(n)), norm(1);
  gm.fill_bytes(0);
  gv.fill_bytes(0);
  for (int step = 1; step <= 4; ++step) {
    // Steps 1 and 3 clip (norm > 1), 2 and 4 do not.
    auto grads = randn(n, 80 + step, step % 2 ? 0.1f : 1e-4f);
    gg.upload(grads);
    const double cpu_norm = opt.step(params.data(), grads.data());
    kern::global_norm(gg.data(), n, scratch.data(), norm.data(), nullptr);
    device_sync();
    const double gnorm = norm.download()[0];
    EXPECT_NEAR(gnorm, cpu_norm, 1e-12 * cpu_norm);
    const double coef = cfg.max_grad_norm / (gnorm + 1e-6);
    if (coef < 1.0) kern::scale(gg.data(), n, static_cast<float>(coef), nullptr);
    const double lr = cfg.lr;
    const float step_size = static_cast<float>(lr / (1.0 - std::pow(cfg.beta1, double(step))));
    const float bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(cfg.beta2, double(step))));
    const float decay = static_cast<float>(1.0 - lr * cfg.weight_decay);
    kern::adamw(gp.data(), gg.data(), gm.data(), gv.data(), gmask.data(), n, static_cast<float>(cfg.beta1),
                static_cast<float>(cfg.beta2), step_size, bc2, static_cast<float>(cfg.eps), decay, nullptr);
    device_sync();
    EXPECT_EQ(first_float_mismatch(gg.download(), grads), -1) << "clipped grads, step " << step;
    EXPECT_EQ(first_float_mismatch(gp.download(), params), -1) << "params, step " << step;
    EXPECT_EQ(first_float_mismatch(gm.download(), opt.m), -1) << "m, step " << step;
    EXPECT_EQ(first_float_mismatch(gv.download(), opt.v), -1) << "v, step " << step;
  }
  // Clipping and the BF16 copy inside the AdamW pass: the same bits as scale() then adamw(), and
  // the BF16 operand of every new parameter.
  {
    train::AdamW ref(n, cfg, mask);
    auto p0 = randn(n, 95);
    std::vector<float> p1 = p0;
    DeviceArray<float> fp = dev(p0), fm(n), fv(n);
    fm.fill_bytes(0);
    fv.fill_bytes(0);
    DeviceArray<uint16_t> fb(n);
    for (int step = 1; step <= 2; ++step) {
      auto grads = randn(n, 96 + step, 0.1f);
      DeviceArray<float> fg = dev(grads);
      const double cpu_norm = ref.step(p1.data(), grads.data());
      const double coef = cfg.max_grad_norm / (cpu_norm + 1e-6);
      ASSERT_LT(coef, 1.0);  // the clipping path
      const double lr = cfg.lr;
      kern::adamw(fp.data(), fg.data(), fm.data(), fv.data(), gmask.data(), n, static_cast<float>(cfg.beta1),
                  static_cast<float>(cfg.beta2), static_cast<float>(lr / (1.0 - std::pow(cfg.beta1, double(step)))),
                  static_cast<float>(std::sqrt(1.0 - std::pow(cfg.beta2, double(step)))), static_cast<float>(cfg.eps),
                  static_cast<float>(1.0 - lr * cfg.weight_decay), nullptr, static_cast<float>(coef), fb.data());
      device_sync();
      EXPECT_EQ(first_float_mismatch(fg.download(), grads), -1) << "fused clip, step " << step;
      EXPECT_EQ(first_float_mismatch(fp.download(), p1), -1) << "fused params, step " << step;
      const std::vector<uint16_t> hb = fb.download();
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hb[i], num::bf16_from_f32(p1[i])) << i;
    }
  }
  // The 16-byte path (aligned arrays) and the scalar one (the same update on copies one float off
  // alignment): the same bits, clip and BF16 copy included.
  {
    auto p0 = randn(n, 97), g0 = randn(n, 98, 0.1f), m0 = randn(n, 99, 0.01f), v0 = randn(n, 100);
    for (float& x : v0) x = x * x;
    std::vector<uint8_t> mk(n);
    for (int64_t i = 0; i < n; ++i) mk[i] = (i % 5) != 1;
    auto off = [](std::vector<float> a) {
      a.insert(a.begin(), 0.f);
      return a;
    };
    DeviceArray<float> ap = dev(p0), ag = dev(g0), am = dev(m0), av = dev(v0), up = dev(off(p0)), ug = dev(off(g0)),
                       um = dev(off(m0)), uv = dev(off(v0));
    DeviceArray<uint8_t> amk = dev(mk);
    DeviceArray<uint16_t> ab(n), ub(n + 1);
    kern::adamw(ap.data(), ag.data(), am.data(), av.data(), amk.data(), n, 0.9f, 0.95f, 1e-3f, 0.3f, 1e-8f, 0.999f,
                nullptr, 0.5f, ab.data());
    kern::adamw(up.data() + 1, ug.data() + 1, um.data() + 1, uv.data() + 1, amk.data(), n, 0.9f, 0.95f, 1e-3f, 0.3f,
                1e-8f, 0.999f, nullptr, 0.5f, ub.data() + 1);
    device_sync();
    auto tail = [](const std::vector<float>& u) { return std::vector<float>(u.begin() + 1, u.end()); };
    EXPECT_EQ(first_float_mismatch(ap.download(), tail(up.download())), -1) << "params";
    EXPECT_EQ(first_float_mismatch(ag.download(), tail(ug.download())), -1) << "clipped grads";
    EXPECT_EQ(first_float_mismatch(am.download(), tail(um.download())), -1) << "m";
    EXPECT_EQ(first_float_mismatch(av.download(), tail(uv.download())), -1) << "v";
    const auto hb = ab.download(), hu = ub.download();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hb[i], hu[i + 1]) << i;
  }
  // The per-range max |p| of the new parameters from the AdamW pass (kern::AdamWAmax): the bits of
  // cuda::absmax over each range afterwards. Ranges inside one CTA's 4096 parameters, across CTA
  // edges, exactly a CTA's, tiny ones, one holding the scalar kernel's tail (n % 4) and a NaN; on
  // aligned arrays and on arrays one float off (the scalar kernel throughout). The updates
  // themselves stay the plain call's bits.
  for (int shift : {0, 1}) {
    auto p0 = randn(n, 101), g0 = randn(n, 102, 0.1f), m0 = randn(n, 103, 0.01f), v0 = randn(n, 104);
    for (float& x : v0) x = x * x;
    p0[30000] = std::nanf("");
    auto off = [shift](std::vector<float> a) {
      a.insert(a.begin(), shift, 0.f);
      return a;
    };
    const std::vector<int64_t> begin = {0, 16, 5000, 8192, 20000, 40000, 69988};  // 16-byte aligned (absmax)
    const std::vector<int64_t> end = {16, 5000, 5003, 8192 + 3 * 4096, 39999, 40005, n};
    DeviceArray<int64_t> db = dev(begin), de = dev(end);
    DeviceArray<uint32_t> amax_bits(begin.size());
    DeviceArray<float> ap = dev(off(p0)), ag = dev(off(g0)), am = dev(off(m0)), av = dev(off(v0)), rp = dev(p0),
                       rg = dev(g0), rm = dev(m0), rv = dev(v0);
    kern::AdamWAmax wa;
    wa.begin = db.data();
    wa.end = de.data();
    wa.count = static_cast<int>(begin.size());
    wa.amax_bits = amax_bits.data();
    kern::adamw(ap.data() + shift, ag.data() + shift, am.data() + shift, av.data() + shift, gmask.data(), n, 0.9f,
                0.95f, 1e-3f, 0.3f, 1e-8f, 0.999f, nullptr, 0.5f, nullptr, wa);
    kern::adamw(rp.data(), rg.data(), rm.data(), rv.data(), gmask.data(), n, 0.9f, 0.95f, 1e-3f, 0.3f, 1e-8f, 0.999f,
                nullptr, 0.5f);
    DeviceArray<float> ref(begin.size());
    for (size_t r = 0; r < begin.size(); ++r) cuda::absmax(rp.data() + begin[r], end[r] - begin[r], ref.data() + r);
    device_sync();
    const std::vector<float> got = ap.download();
    EXPECT_EQ(first_float_mismatch(std::vector<float>(got.begin() + shift, got.end()), rp.download()), -1) << shift;
    const std::vector<uint32_t> hb = amax_bits.download();
    const std::vector<float> hr = ref.download();
    for (size_t r = 0; r < begin.size(); ++r) EXPECT_EQ(hb[r], bits(hr[r])) << "range " << r << " shift " << shift;
    EXPECT_TRUE(std::isnan(hr[4]));
  }
  // No mask: everything decays.
  train::AdamW plain(n, cfg);
  auto p2 = randn(n, 90), g2 = randn(n, 91, 1e-4f);
  DeviceArray<float> gp2 = dev(p2), gg2 = dev(g2);
  gm.fill_bytes(0);
  gv.fill_bytes(0);
  plain.step(p2.data(), g2.data());
  kern::adamw(gp2.data(), gg2.data(), gm.data(), gv.data(), nullptr, n, static_cast<float>(cfg.beta1),
              static_cast<float>(cfg.beta2), static_cast<float>(cfg.lr / (1.0 - cfg.beta1)),
              static_cast<float>(std::sqrt(1.0 - cfg.beta2)), static_cast<float>(cfg.eps),
              static_cast<float>(1.0 - cfg.lr * cfg.weight_decay), nullptr);
  device_sync();
  EXPECT_EQ(first_float_mismatch(gp2.download(), p2), -1);
}
