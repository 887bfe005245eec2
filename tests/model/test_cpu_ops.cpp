// The CPU ops one by one (src/cpu): forward against straightforward float64 references, backward
// against finite differences (directional derivatives, central differences with Richardson
// extrapolation), and the row invariance of the forward GEMM.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include <omp.h>

#include "cpu/gemm.h"
#include "cpu/ops.h"
#include "model_test_util.h"

using namespace quads;
using test::random_normal;

namespace {

// d/dt f(x + t u) at t = 0 for a random direction u.
double directional_fd(const std::function<double(const std::vector<float>&)>& f, const std::vector<float>& x,
                      const std::vector<float>& u, double eps) {
  auto central = [&](double e) {
    std::vector<float> a(x), b(x);
    for (size_t i = 0; i < x.size(); ++i) {
      a[i] = static_cast<float>(x[i] + e * u[i]);
      b[i] = static_cast<float>(x[i] - e * u[i]);
    }
    return (f(a) - f(b)) / (2 * e);
  };
  return (4 * central(eps / 2) - central(eps)) / 3;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

void expect_close(double fd, double an, double tol, const char* what) {
  EXPECT_LT(std::fabs(fd - an), tol * (std::fabs(an) + 1e-2)) << what << ": analytic " << an << " fd " << fd;
}

}  // namespace

TEST(CpuGemm, RowInvariantMatchesFloat64AndNeverDependsOnM) {
  for (int64_t K : {1, 7, 8, 13, 64, 200}) {
    const int64_t M = 37, N = 29;
    const auto X = random_normal(M * K, K), W = random_normal(N * K, K + 1);
    std::vector<float> Y(M * N);
    cpu::gemm_nt_rowinv(M, N, K, X.data(), K, W.data(), K, Y.data(), N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0, a = 0;
        for (int64_t k = 0; k < K; ++k) {
          s += double(X[m * K + k]) * W[n * K + k];
          a += std::fabs(double(X[m * K + k]) * W[n * K + k]);
        }
        ASSERT_NEAR(Y[m * N + n], s, 1e-6 * a) << "K=" << K;
      }
    // Any sub-block (different M, N, offsets, strides) gives the same bits.
    for (int64_t m0 : {0, 5, 36})
      for (int64_t mc : {1, 2, 3, 4, 5}) {
        if (m0 + mc > M) continue;
        std::vector<float> Z(mc * (N + 3), -1.f);
        cpu::gemm_nt_rowinv(mc, N - 2, K, X.data() + m0 * K, K, W.data() + 2 * K, K, Z.data(), N + 3);
        for (int64_t r = 0; r < mc; ++r)
          ASSERT_EQ(std::memcmp(Z.data() + r * (N + 3), Y.data() + (m0 + r) * N + 2, (N - 2) * 4), 0)
              << "K=" << K << " m0=" << m0 << " mc=" << mc;
      }
    // accumulate adds the same value.
    std::vector<float> acc(M * N, 1.f);
    cpu::gemm_nt_rowinv(M, N, K, X.data(), K, W.data(), K, acc.data(), N, true);
    for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(acc[i], 1.f + Y[i]);
    EXPECT_EQ(cpu::dot_rowinv(X.data() + 3 * K, W.data() + 4 * K, K), Y[3 * N + 4]);
  }
}

TEST(CpuGemm, BlasShapesAgreeWithRowInvariant) {
  const int64_t M = 9, N = 11, K = 24;
  const auto X = random_normal(M * K, 1), W = random_normal(N * K, 2), dY = random_normal(M * N, 3);
  std::vector<float> a(M * N), b(M * N);
  cpu::gemm_nt(M, N, K, X.data(), K, W.data(), K, a.data(), N);
  cpu::gemm_nt_rowinv(M, N, K, X.data(), K, W.data(), K, b.data(), N);
  EXPECT_LT(test::rel_l2(a.data(), b.data(), a.size()), 1e-6);
  std::vector<float> dX(M * K);
  cpu::gemm_nn(M, N, K, dY.data(), N, W.data(), K, dX.data(), K);
  std::vector<float> dW(N * K, 0.5f);
  cpu::gemm_tn_acc(M, N, K, dY.data(), N, X.data(), K, dW.data(), K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += double(dY[m * N + n]) * W[n * K + k];
      ASSERT_NEAR(dX[m * K + k], s, 1e-5);
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0.5;
      for (int64_t m = 0; m < M; ++m) s += double(dY[m * N + n]) * X[m * K + k];
      ASSERT_NEAR(dW[n * K + k], s, 1e-5);
    }
}

TEST(CpuOps, RmsNorm) {
  const int64_t R = 5, D = 24;
  const auto x = random_normal(R * D, 1), w = random_normal(D, 2, 0.3f), c = random_normal(R * D, 3);
  std::vector<float> y(R * D), inv(R);
  cpu::rmsnorm_forward(x.data(), w.data(), R, D, 1e-6f, y.data(), inv.data());
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[r * D + i]) * x[r * D + i];
    const double s = 1 / std::sqrt(ss / D + 1e-6);
    for (int64_t i = 0; i < D; ++i) ASSERT_NEAR(y[r * D + i], w[i] * x[r * D + i] * s, 1e-6);
  }
  std::vector<float> dx(R * D), dw(D, 0.f);
  cpu::rmsnorm_backward(c.data(), x.data(), w.data(), inv.data(), R, D, dx.data(), dw.data());
  auto fx = [&](const std::vector<float>& xx) {
    std::vector<float> yy(R * D);
    cpu::rmsnorm_forward(xx.data(), w.data(), R, D, 1e-6f, yy.data(), nullptr);
    return dot(yy, c);
  };
  auto fw = [&](const std::vector<float>& ww) {
    std::vector<float> yy(R * D);
    cpu::rmsnorm_forward(x.data(), ww.data(), R, D, 1e-6f, yy.data(), nullptr);
    return dot(yy, c);
  };
  const auto ux = random_normal(R * D, 4), uw = random_normal(D, 5);
  expect_close(directional_fd(fx, x, ux, 1e-2), dot(dx, ux), 1e-3, "dx");
  expect_close(directional_fd(fw, w, uw, 1e-2), dot(dw, uw), 1e-3, "dw");
}

TEST(CpuOps, RopeRotatesAndBackwardIsTheTranspose) {
  const int64_t n = 6;
  const int heads = 3, hd = 8;
  std::vector<int64_t> pos = {0, 1, 2, 7, 100, 5000};
  std::vector<float> cs(n * hd / 2), sn(n * hd / 2);
  cpu::rope_tables(pos.data(), n, hd, 10000.0, cs.data(), sn.data());
  EXPECT_EQ(cs[0], 1.f);
  EXPECT_EQ(sn[0], 0.f);
  // HF: inv_freq[i] = 1 / 10000^(2i/hd) in float32; angle = pos * inv_freq.
  const float inv1 = 1.0f / static_cast<float>(std::pow(10000.0, double(2.0f / 8.0f)));
  EXPECT_EQ(cs[3 * hd / 2 + 1], static_cast<float>(std::cos(double(7.0f * inv1))));
  const auto x = random_normal(n * heads * hd, 1), y = random_normal(n * heads * hd, 2);
  std::vector<float> rx = x, ry = y;
  cpu::rope_forward(rx.data(), n, heads, hd, cs.data(), sn.data());
  cpu::rope_backward(ry.data(), n, heads, hd, cs.data(), sn.data());
  EXPECT_NEAR(dot(rx, y), dot(x, ry), 1e-5);  // <R x, y> = <x, Rᵀ y>
  for (int h = 0; h < heads; ++h)  // position 0 is the identity
    for (int i = 0; i < hd; ++i) EXPECT_EQ(rx[h * hd + i], x[h * hd + i]);
  // Rotation: pairs (i, i + hd/2) keep their norm.
  for (int64_t t = 0; t < n * heads; ++t)
    for (int i = 0; i < hd / 2; ++i) {
      const double a = std::hypot(x[t * hd + i], x[t * hd + i + hd / 2]);
      const double b = std::hypot(rx[t * hd + i], rx[t * hd + i + hd / 2]);
      EXPECT_NEAR(a, b, 1e-5);
    }
}

TEST(CpuOps, AttentionForwardBackwardGqa) {
  for (auto [nh, nkv] : {std::pair{4, 2}, std::pair{3, 1}, std::pair{2, 2}}) {
    const int hd = 8;
    const int64_t L = 7, n = 4;  // 4 queries at positions 3..6
    const float scale = 1.f / std::sqrt(float(hd));
    const auto q = random_normal(n * nh * hd, 1), k = random_normal(L * nkv * hd, 2), v = random_normal(L * nkv * hd, 3);
    const auto c = random_normal(n * nh * hd, 4);
    std::vector<float> out(n * nh * hd), lse(n * nh);
    cpu::attention_forward(q.data(), k.data(), v.data(), n, L, nh, nkv, hd, scale, out.data(), lse.data());
    // Reference in float64.
    for (int64_t i = 0; i < n; ++i)
      for (int h = 0; h < nh; ++h) {
        const int g = h / (nh / nkv);
        const int64_t p = L - n + i;
        std::vector<double> s(p + 1);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= p; ++j) {
          double d = 0;
          for (int e = 0; e < hd; ++e) d += double(q[(i * nh + h) * hd + e]) * k[(j * nkv + g) * hd + e];
          s[j] = d * scale;
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j <= p; ++j) sum += std::exp(s[j] - mx);
        EXPECT_NEAR(lse[i * nh + h], mx + std::log(sum), 1e-5);
        for (int e = 0; e < hd; ++e) {
          double o = 0;
          for (int64_t j = 0; j <= p; ++j) o += std::exp(s[j] - mx) / sum * v[(j * nkv + g) * hd + e];
          ASSERT_NEAR(out[(i * nh + h) * hd + e], o, 1e-5);
        }
      }
    std::vector<float> dq(q.size()), dk(k.size(), 0.f), dv(v.size(), 0.f);
    cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), c.data(), n, L, nh, nkv, hd, scale,
                            dq.data(), dk.data(), dv.data());
    auto f = [&](const std::vector<float>& qq, const std::vector<float>& kk, const std::vector<float>& vv) {
      std::vector<float> o(n * nh * hd);
      cpu::attention_forward(qq.data(), kk.data(), vv.data(), n, L, nh, nkv, hd, scale, o.data(), nullptr);
      return dot(o, c);
    };
    const auto uq = random_normal(q.size(), 5), uk = random_normal(k.size(), 6), uv = random_normal(v.size(), 7);
    expect_close(directional_fd([&](const auto& x) { return f(x, k, v); }, q, uq, 1e-2), dot(dq, uq), 1e-3, "dq");
    expect_close(directional_fd([&](const auto& x) { return f(q, x, v); }, k, uk, 1e-2), dot(dk, uk), 1e-3, "dk");
    expect_close(directional_fd([&](const auto& x) { return f(q, k, x); }, v, uv, 1e-2), dot(dv, uv), 1e-3, "dv");
    // Causality: the last key only reaches the last query, so its gradient comes from it alone;
    // keys are never seen by earlier queries.
    std::vector<float> k2 = k;
    for (int e = 0; e < nkv * hd; ++e) k2[(L - 1) * nkv * hd + e] += 1.f;
    std::vector<float> o2(out.size());
    cpu::attention_forward(q.data(), k2.data(), v.data(), n, L, nh, nkv, hd, scale, o2.data(), nullptr);
    EXPECT_EQ(std::memcmp(o2.data(), out.data(), (n - 1) * nh * hd * 4), 0);
    // A query's result does not depend on how many queries share the call.
    std::vector<float> last(nh * hd);
    cpu::attention_forward(q.data() + (n - 1) * nh * hd, k.data(), v.data(), 1, L, nh, nkv, hd, scale, last.data(),
                           nullptr);
    EXPECT_EQ(std::memcmp(last.data(), out.data() + (n - 1) * nh * hd, nh * hd * 4), 0);
  }
}

// Shapes large enough for the OpenMP regions of the backward (blocks of 64 queries x 600 keys,
// L x nkv x hd = 76800): the threads share the call's scratch (a thread_local buffer read inside
// the region crashed the worker threads), and the result is the same bits with 1 or 2 threads.
TEST(CpuOps, AttentionBackwardParallelRegions) {
  const int nh = 4, nkv = 2, hd = 64;
  const int64_t L = 600, n = 600;
  const float scale = 1.f / std::sqrt(float(hd));
  const auto q = random_normal(n * nh * hd, 11), k = random_normal(L * nkv * hd, 12),
             v = random_normal(L * nkv * hd, 13), c = random_normal(n * nh * hd, 14);
  std::vector<float> out(n * nh * hd), lse(n * nh);
  cpu::attention_forward(q.data(), k.data(), v.data(), n, L, nh, nkv, hd, scale, out.data(), lse.data());
  auto grads = [&](int threads) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> dq(q.size()), dk(k.size(), 0.f), dv(v.size(), 0.f);
    cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), c.data(), n, L, nh, nkv, hd, scale,
                            dq.data(), dk.data(), dv.data());
    omp_set_num_threads(before);
    dq.insert(dq.end(), dk.begin(), dk.end());
    dq.insert(dq.end(), dv.begin(), dv.end());
    return dq;
  };
  const auto one = grads(1), two = grads(2);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
  double norm = 0;
  for (float x : two) norm += double(x) * x;
  EXPECT_TRUE(std::isfinite(norm) && norm > 0);
}

TEST(CpuOps, SoftmaxAndSwiglu) {
  const int64_t R = 4, C = 9, I = 6;
  const auto x = random_normal(R * C, 1, 2.f), c = random_normal(R * C, 2);
  std::vector<float> y(R * C), dx(R * C);
  cpu::softmax_forward(x.data(), R, C, y.data());
  cpu::softmax_backward(y.data(), c.data(), R, C, dx.data());
  auto f = [&](const std::vector<float>& xx) {
    std::vector<float> yy(R * C);
    cpu::softmax_forward(xx.data(), R, C, yy.data());
    return dot(yy, c);
  };
  const auto u = random_normal(R * C, 3);
  expect_close(directional_fd(f, x, u, 1e-2), dot(dx, u), 1e-3, "softmax");

  const auto gu = random_normal(R * 2 * I, 4, 2.f), ch = random_normal(R * I, 5);
  std::vector<float> h(R * I), dgu(R * 2 * I);
  cpu::swiglu_forward(gu.data(), R, I, h.data());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[r * 2 * I + i], up = gu[r * 2 * I + I + i];
      ASSERT_NEAR(h[r * I + i], g / (1 + std::exp(-g)) * up, 1e-6);
    }
  cpu::swiglu_backward(gu.data(), ch.data(), R, I, dgu.data());
  auto fs = [&](const std::vector<float>& xx) {
    std::vector<float> hh(R * I);
    cpu::swiglu_forward(xx.data(), R, I, hh.data());
    return dot(hh, ch);
  };
  const auto ug = random_normal(R * 2 * I, 6);
  expect_close(directional_fd(fs, gu, ug, 1e-2), dot(dgu, ug), 1e-3, "swiglu");
}

TEST(CpuOps, RouterTopkTiesAndBackward) {
  // Ties: the lower expert id wins, and the result is in descending order.
  const std::vector<float> tie = {0.f, 1.f, 1.f, 0.5f, 1.f};
  std::vector<float> p(5), w(3);
  std::vector<int32_t> idx(3);
  cpu::router_topk_forward(tie.data(), 1, 5, 3, true, p.data(), idx.data(), w.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 4}));
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0, 1e-6);
  for (bool norm : {true, false}) {
    const int64_t T = 5;
    const int E = 6, k = 3;
    const auto logits = random_normal(T * E, 1, 1.5f), cw = random_normal(T * k, 2), cp = random_normal(T * E, 3);
    std::vector<float> probs(T * E), ww(T * k), dl(T * E);
    std::vector<int32_t> id(T * k);
    cpu::router_topk_forward(logits.data(), T, E, k, norm, probs.data(), id.data(), ww.data());
    // L = <cw, w> + <cp, probs>
    cpu::router_topk_backward(probs.data(), id.data(), ww.data(), cw.data(), cp.data(), T, E, k, norm, dl.data());
    auto f = [&](const std::vector<float>& x) {
      std::vector<float> pp(T * E), w2(T * k);
      std::vector<int32_t> i2(T * k);
      cpu::router_topk_forward(x.data(), T, E, k, norm, pp.data(), i2.data(), w2.data(), id.data());
      return dot(w2, cw) + dot(pp, cp);
    };
    const auto u = random_normal(T * E, 4);
    expect_close(directional_fd(f, logits, u, 1e-2), dot(dl, u), 1e-3, norm ? "router norm" : "router raw");
  }
}

TEST(CpuOps, MoePermuteCombineAndEmbedding) {
  const int64_t T = 5, D = 4;
  const int k = 2, E = 3;
  const std::vector<int32_t> idx = {2, 0, 0, 1, 2, 1, 0, 2, 1, 0};
  std::vector<int64_t> off(E + 1);
  std::vector<int32_t> perm(T * k), inv(T * k);
  cpu::moe_permute(idx.data(), T, k, E, off.data(), perm.data(), inv.data());
  EXPECT_EQ(off, (std::vector<int64_t>{0, 4, 7, 10}));
  EXPECT_EQ(perm, (std::vector<int32_t>{1, 2, 6, 9, 3, 5, 8, 0, 4, 7}));  // by expert, tokens ascending
  for (int64_t i = 0; i < T * k; ++i) EXPECT_EQ(perm[inv[i]], i);
  const auto ye = random_normal(T * k * D, 1), w = random_normal(T * k, 2), c = random_normal(T * D, 3);
  std::vector<float> y(T * D), dye(T * k * D), dw(T * k);
  cpu::moe_combine_forward(ye.data(), inv.data(), w.data(), T, k, D, y.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D; ++i)
      EXPECT_NEAR(y[t * D + i], w[t * k] * ye[inv[t * k] * D + i] + w[t * k + 1] * ye[inv[t * k + 1] * D + i], 1e-6);
  cpu::moe_combine_backward(c.data(), ye.data(), inv.data(), w.data(), T, k, D, dye.data(), dw.data());
  auto f = [&](const std::vector<float>& yy, const std::vector<float>& ww) {
    std::vector<float> o(T * D);
    cpu::moe_combine_forward(yy.data(), inv.data(), ww.data(), T, k, D, o.data());
    return dot(o, c);
  };
  const auto uy = random_normal(ye.size(), 4), uw = random_normal(w.size(), 5);
  expect_close(directional_fd([&](const auto& x) { return f(x, w); }, ye, uy, 1e-2), dot(dye, uy), 1e-3, "dye");
  expect_close(directional_fd([&](const auto& x) { return f(ye, x); }, w, uw, 1e-2), dot(dw, uw), 1e-3, "dw");
  // Gather / scatter are adjoint.
  const auto x = random_normal(T * D, 6), g = random_normal(T * k * D, 7);
  std::vector<float> xe(T * k * D), dx(T * D);
  cpu::moe_gather(x.data(), perm.data(), T * k, k, D, xe.data());
  cpu::moe_scatter_add(g.data(), inv.data(), T, k, D, dx.data(), false);
  EXPECT_NEAR(dot(xe, g), dot(x, dx), 1e-5);
  // Embedding backward sums repeated tokens.
  const std::vector<int32_t> tok = {3, 1, 3};
  const auto dout = random_normal(3 * D, 8);
  std::vector<float> dtab(4 * D, 0.f);
  cpu::embedding_backward(dout.data(), tok.data(), 3, D, dtab.data());
  for (int64_t i = 0; i < D; ++i) {
    EXPECT_EQ(dtab[3 * D + i], dout[i] + dout[2 * D + i]);
    EXPECT_EQ(dtab[1 * D + i], dout[D + i]);
    EXPECT_EQ(dtab[i], 0.f);
  }
}
