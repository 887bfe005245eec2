// kern::router_route (the router top-k and the MoE routing of a decode step in one launch) and
// kern::moe_route_one against the separate kernels they replace, router_topk_fwd then moe_route:
// every output bit for bit, over token counts that take one CTA, two, and many, several expert
// counts, with and without renormalization, ties, NaN logits, and the `active` counter summed over
// calls. The routing is also checked against cpu::moe_permute on the ids the device chose.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

// The outputs of one routing, pre-filled with the same junk bytes on both sides so that an entry
// one side leaves unwritten also shows as a mismatch.
struct Routed {
  DeviceArray<float> probs, w;
  DeviceArray<int32_t> idx, counts, eoff, perm, inv, bad;
  DeviceArray<unsigned long long> active;
  Routed(int64_t T, int E, int k)
      : probs(T * E), w(T * k), idx(T * k), counts(E), eoff(E + 1), perm(T * k), inv(T * k), bad(1), active(1) {
    probs.fill_bytes(0x7f);
    w.fill_bytes(0x7f);
    idx.fill_bytes(0x5a);
    counts.fill_bytes(0x5a);
    eoff.fill_bytes(0x5a);
    perm.fill_bytes(0x5a);
    inv.fill_bytes(0x5a);
    bad.fill_bytes(0);
    active.fill_bytes(0);
  }
};

// Every output of a against b; `what` names the case.
void expect_same(const Routed& a, const Routed& b, const std::string& what) {
  EXPECT_EQ(first_float_mismatch(a.probs.download(), b.probs.download()), -1) << what << ": probs";
  EXPECT_EQ(first_float_mismatch(a.w.download(), b.w.download()), -1) << what << ": w";
  EXPECT_EQ(first_mismatch(a.idx.download(), b.idx.download()), -1) << what << ": idx";
  EXPECT_EQ(first_mismatch(a.counts.download(), b.counts.download()), -1) << what << ": counts";
  EXPECT_EQ(first_mismatch(a.eoff.download(), b.eoff.download()), -1) << what << ": eoff";
  EXPECT_EQ(first_mismatch(a.perm.download(), b.perm.download()), -1) << what << ": perm";
  EXPECT_EQ(first_mismatch(a.inv.download(), b.inv.download()), -1) << what << ": inv";
  EXPECT_EQ(a.bad.download()[0], b.bad.download()[0]) << what << ": bad";
  EXPECT_EQ(a.active.download()[0], b.active.download()[0]) << what << ": active";
}

// The separate kernels `calls` times, then router_route `calls` times on the same logits; both
// sides accumulate `active`. Returns the fused side's ticket, which every call must leave at 0.
uint32_t compare_route(const std::vector<float>& logits, int64_t T, int E, int k, bool norm, int calls,
                       const std::string& what, Routed* keep = nullptr) {
  DeviceArray<float> dl = dev(logits);
  Routed ref(T, E, k), fused(T, E, k);
  DeviceArray<uint32_t> ticket(1);
  ticket.fill_bytes(0);
  for (int c = 0; c < calls; ++c) {
    cuda::kern::router_topk_fwd(dl.data(), T, E, k, norm, ref.probs.data(), ref.idx.data(), ref.w.data(), nullptr,
                                nullptr);
    cuda::kern::moe_route(ref.idx.data(), T * k, E, ref.counts.data(), ref.eoff.data(), ref.perm.data(),
                          ref.inv.data(), ref.active.data(), ref.bad.data(), nullptr);
  }
  for (int c = 0; c < calls; ++c)
    cuda::kern::router_route(dl.data(), T, E, k, norm, fused.probs.data(), fused.idx.data(), fused.w.data(),
                             fused.counts.data(), fused.eoff.data(), fused.perm.data(), fused.inv.data(),
                             fused.active.data(), fused.bad.data(), ticket.data(), nullptr);
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  expect_same(fused, ref, what);

  // The routing is cpu::moe_permute of the chosen ids (an independent check of the reference too).
  const auto idx = fused.idx.download();
  std::vector<int64_t> off(E + 1);
  std::vector<int32_t> perm(T * k), inv(T * k);
  bool valid = true;
  for (int32_t e : idx) valid = valid && e >= 0 && e < E;
  if (valid) {
    cpu::moe_permute(idx.data(), T, k, E, off.data(), perm.data(), inv.data());
    const auto eoff = fused.eoff.download();
    for (int e = 0; e <= E; ++e) EXPECT_EQ(eoff[e], off[e]) << what << ": eoff vs cpu, expert " << e;
    EXPECT_EQ(first_mismatch(fused.perm.download(), perm), -1) << what << ": perm vs cpu";
    EXPECT_EQ(first_mismatch(fused.inv.download(), inv), -1) << what << ": inv vs cpu";
    int used = 0;
    for (int e = 0; e < E; ++e) used += off[e + 1] > off[e];
    EXPECT_EQ(fused.active.download()[0], static_cast<unsigned long long>(used) * calls) << what << ": active";
  }
  if (keep) *keep = std::move(fused);
  return ticket.download()[0];
}

}  // namespace

TEST(CudaRouteFused, MatchesTopkThenRoute) {
  QUADS_REQUIRE_GPU();
  struct Cfg {
    int E, k;
  };
  // T = 8 fills one CTA, 9 takes two, 300 takes 38 (the last one routes 2400 entries).
  for (const Cfg c : {Cfg{64, 8}, Cfg{8, 2}, Cfg{128, 8}, Cfg{256, 8}, Cfg{24, 3}})
    for (const int64_t T : {1, 8, 9, 16, 64, 300})
      for (const bool norm : {true, false}) {
        const std::string what = "E " + std::to_string(c.E) + " k " + std::to_string(c.k) + " T " +
                                 std::to_string(T) + (norm ? " norm" : "");
        const auto logits = randn(T * c.E, 1000 + T * 7 + c.E, 2.f);
        EXPECT_EQ(compare_route(logits, T, c.E, c.k, norm, 1, what), 0u) << what << ": ticket";
      }
}

// Few distinct logits (many equal probabilities: the lower id wins), whole rows equal, and one
// expert favoured by every token (one large group, the others empty).
TEST(CudaRouteFused, Ties) {
  QUADS_REQUIRE_GPU();
  for (const int64_t T : {1, 16, 64, 300}) {
    const int E = 64, k = 8;
    std::mt19937_64 rng(T);
    std::uniform_int_distribution<int> lv(0, 3);
    std::vector<float> logits(T * E);
    for (auto& v : logits) v = 0.5f * static_cast<float>(lv(rng));
    for (int e = 0; e < E; ++e) logits[e] = 1.f;  // token 0: all equal
    if (T > 2)
      for (int64_t t = 0; t < T; ++t) logits[t * E + 5] = 9.f;
    compare_route(logits, T, E, k, true, 1, "ties T " + std::to_string(T));
    compare_route(logits, T, E, k, false, 1, "ties T " + std::to_string(T) + " no norm");
  }
}

// NaN logits: router_topk_fwd gives a NaN row the lowest free ids and NaN weights; the fused
// kernel must give the same (and, like the separate kernels, raise no bad flag: the ids are valid).
TEST(CudaRouteFused, NanLogits) {
  QUADS_REQUIRE_GPU();
  for (const int64_t T : {1, 16, 64}) {
    const int E = 64, k = 8;
    auto logits = randn(T * E, 77 + T);
    logits[3] = NAN;  // one NaN in token 0
    for (int e = 0; e < E; ++e) logits[(T - 1) * E + e] = NAN;  // the last token all NaN
    if (T > 2) logits[E + 7] = INFINITY;
    Routed fused(1, 1, 1);
    compare_route(logits, T, E, k, true, 1, "nan T " + std::to_string(T), &fused);
    const auto w = fused.w.download();
    EXPECT_TRUE(std::isnan(w[(T - 1) * k])) << "T " << T;
  }
}

// `active` is a running sum over calls (the rollout engine adds every layer's experts in use), and
// the ticket is back at 0 after each call, so repeated calls keep routing.
TEST(CudaRouteFused, ActiveAccumulatesOverCalls) {
  QUADS_REQUIRE_GPU();
  for (const int64_t T : {1, 16, 64}) {
    const auto logits = randn(T * 64, 5 + T);
    EXPECT_EQ(compare_route(logits, T, 64, 8, true, 4, "4 calls, T " + std::to_string(T)), 0u);
  }
}

// Routing alone (moe_route_one), ids out of range included: bad set, inv / perm in range, the
// separate kernels' bits.
TEST(CudaRouteFused, RouteOneMatchesMoeRoute) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t n;
    int E;
    bool with_bad;
  };
  for (const Case c : {Case{8, 64, false}, Case{128, 64, true}, Case{512, 64, false}, Case{2400, 128, true},
                       Case{6, 4, true}, Case{0, 8, false}, Case{8192, 256, true}}) {
    std::mt19937_64 rng(c.n + c.E);
    std::uniform_int_distribution<int> ud(0, c.E - 1);
    std::vector<int32_t> idx(c.n);
    for (auto& v : idx) v = ud(rng);
    if (c.with_bad && c.n > 3) {
      idx[1] = -1;
      idx[c.n - 2] = c.E;
      idx[c.n / 2] = 1 << 30;
    }
    DeviceArray<int32_t> di = dev(idx);
    Routed ref(1, c.E, 1), one(1, c.E, 1);
    for (Routed* r : {&ref, &one}) {
      r->perm.resize(c.n);
      r->inv.resize(c.n);
      r->perm.fill_bytes(0x5a);
      r->inv.fill_bytes(0x5a);
    }
    for (int call = 0; call < 2; ++call) {
      cuda::kern::moe_route(di.data(), c.n, c.E, ref.counts.data(), ref.eoff.data(), ref.perm.data(), ref.inv.data(),
                            ref.active.data(), ref.bad.data(), nullptr);
      cuda::kern::moe_route_one(di.data(), c.n, c.E, one.counts.data(), one.eoff.data(), one.perm.data(),
                                one.inv.data(), one.active.data(), one.bad.data(), nullptr);
    }
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    const std::string what = "route n " + std::to_string(c.n) + " E " + std::to_string(c.E);
    EXPECT_EQ(first_mismatch(one.counts.download(), ref.counts.download()), -1) << what;
    EXPECT_EQ(first_mismatch(one.eoff.download(), ref.eoff.download()), -1) << what;
    EXPECT_EQ(first_mismatch(one.perm.download(), ref.perm.download()), -1) << what;
    EXPECT_EQ(first_mismatch(one.inv.download(), ref.inv.download()), -1) << what;
    EXPECT_EQ(one.active.download()[0], ref.active.download()[0]) << what;
    EXPECT_EQ(one.bad.download()[0], (c.with_bad && c.n > 3) ? 1 : 0) << what;
    EXPECT_EQ(ref.bad.download()[0], one.bad.download()[0]) << what;
    for (int32_t v : one.perm.download()) EXPECT_TRUE(v >= 0 && v < c.n) << what;
    for (int32_t v : one.inv.download()) EXPECT_TRUE(v >= 0 && v < c.n) << what;
  }
}
