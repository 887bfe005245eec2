// The fused decode kernels (cuda/model_kernels.h): each against the unfused sequence it replaces,
// bit for bit (split + merge attention, split_cols3 + qk_norm_rope_store, rmsnorm + to_bf16,
// moe_combine_add / add_inplace + rmsnorm + to_bf16), at the peer model's shapes and odd ones; the
// fused attention also against the CPU, across repeated launches and CUDA graph replays (its
// counters must come back to zero). Every test skips itself without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"
#include "cuda/quant.h"
#include "cuda_test_util.h"

using namespace quads;
using quads::cuda::DeviceArray;
using namespace quads::cuda::testing;

namespace {

std::vector<uint16_t> download_u16(const DeviceArray<uint16_t>& a) { return a.download(); }

// Restores the automatic thread count of the residual + norm kernels when a test ends.
struct NormThreads {
  explicit NormThreads(int t) { cuda::kern::set_residual_norm_threads(t); }
  ~NormThreads() { cuda::kern::set_residual_norm_threads(0); }
};

}  // namespace

// Fused split-key attention vs the two kernels at the same split count: the peer model's heads at
// T = 1, 16, 64 with contexts up to 600, and odd groups / head dims (one or two heads per warp;
// hd 96 has no pipelined instance: the fused call runs the two old kernels, with no workspace).
TEST(CudaDecodeFused, AttentionSameBitsAsSplitMerge) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int nh, nkv, hd;
    int64_t max_ctx;
    int T;
  };
  for (const Case c : {Case{32, 4, 128, 600, 1}, Case{32, 4, 128, 256, 1}, Case{32, 4, 128, 512, 16},
                       Case{32, 4, 128, 600, 64}, Case{8, 1, 64, 70, 3}, Case{12, 4, 64, 96, 2},
                       Case{16, 1, 256, 130, 2}, Case{4, 4, 32, 33, 5}, Case{6, 3, 96, 64, 3}}) {
    const int slots = c.T + 1;
    const int64_t max_len = c.max_ctx + 3, kvd = int64_t(c.nkv) * c.hd;
    std::mt19937_64 rng(211 + c.hd + c.T + c.max_ctx);
    std::vector<int32_t> slot(c.T), pos(c.T);
    for (int t = 0; t < c.T; ++t) {
      slot[t] = (t * 5 + 2) % slots;
      // context 1, the bound, tile edges, and random lengths in between
      const int64_t pick[6] = {0, c.max_ctx - 1, 31, 32, int64_t(rng() % uint64_t(c.max_ctx)),
                               int64_t(rng() % uint64_t(c.max_ctx))};
      pos[t] = static_cast<int32_t>(pick[t % 6]);
    }
    const auto q = randn(int64_t(c.T) * c.nh * c.hd, 71 + c.T, 1.5f), kc = randn(slots * max_len * kvd, 72 + c.T),
               vc = randn(slots * max_len * kvd, 73 + c.T);
    const float scale = 1.f / std::sqrt(float(c.hd));
    const std::vector<float> want = cpu_decode_attention(q, kc, vc, slot, pos, c.nh, c.nkv, c.hd, max_len);
    auto dq = dev(q), dk = dev(kc), dv = dev(vc);
    auto ds = dev(slot), dp = dev(pos);
    const size_t ws_bytes = cuda::kern::attention_decode_fused_workspace(c.T, c.nh, c.nkv, c.hd, c.max_ctx);
    DeviceArray<unsigned char> ws(std::max<size_t>(ws_bytes, 1));
    ws.fill_bytes(0);
    const int tiles = static_cast<int>((c.max_ctx + 31) / 32);
    for (int splits : {0, 1, 2, 3, 7, tiles}) {
      const std::string what = "heads " + std::to_string(c.nh) + "/" + std::to_string(c.nkv) + " hd " +
                               std::to_string(c.hd) + " ctx " + std::to_string(c.max_ctx) + " T " +
                               std::to_string(c.T) + " splits " + std::to_string(splits);
      const size_t need = cuda::kern::attention_decode_fused_workspace(c.T, c.nh, c.nkv, c.hd, c.max_ctx, splits);
      DeviceArray<unsigned char> wsn(std::max<size_t>(need, 1));
      wsn.fill_bytes(0);
      DeviceArray<float> ref(q.size()), got(q.size());
      ref.fill_bytes(0xFF);
      got.fill_bytes(0xFF);
      const int used_ref = cuda::kern::attention_decode_split_n(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(),
                                                                c.T, c.nh, c.nkv, c.hd, scale, max_len, c.max_ctx,
                                                                ref.data(), nullptr, splits);
      // three launches on one workspace: the counters must return to zero each time
      std::vector<float> first;
      for (int rep = 0; rep < 3; ++rep) {
        const int used = cuda::kern::attention_decode_fused(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), c.T,
                                                            c.nh, c.nkv, c.hd, scale, max_len, c.max_ctx, got.data(),
                                                            wsn.data(), need, nullptr, splits);
        EXPECT_EQ(used, used_ref) << what;
        const auto g = got.download();
        if (rep == 0) {
          first = g;
          EXPECT_EQ(first_float_mismatch(g, ref.download()), -1) << what;
          const double e = rel_l2(g, want);
          std::printf("fused decode attention %s: rel L2 %.3g vs CPU\n", what.c_str(), e);
          EXPECT_LT(e, 2e-6) << what;
        } else {
          EXPECT_EQ(first_float_mismatch(g, first), -1) << what << " launch " << rep;
        }
      }
      if (need > 0) {  // the counters sit at the start of the workspace
        const auto bytes = wsn.download();
        const size_t nc = sizeof(unsigned) * size_t(c.T) * c.nkv;
        for (size_t i = 0; i < nc; ++i) ASSERT_EQ(bytes[i], 0) << what << ": counter byte " << i << " left set";
      }
    }
    // The automatic split count's workspace also serves fewer tokens and shorter context bounds.
    if (c.T > 1) {
      DeviceArray<float> ref(q.size()), got(q.size());
      const int64_t ctx2 = std::max<int64_t>(1, c.max_ctx / 2 + 5);
      std::vector<int32_t> pos2(pos);
      for (auto& p : pos2) p = static_cast<int32_t>(p % ctx2);
      auto dp2 = dev(pos2);
      cuda::kern::attention_decode_split_n(dq.data(), dk.data(), dv.data(), ds.data(), dp2.data(), c.T - 1, c.nh,
                                           c.nkv, c.hd, scale, max_len, ctx2, ref.data(), nullptr, 0);
      cuda::kern::attention_decode_fused(dq.data(), dk.data(), dv.data(), ds.data(), dp2.data(), c.T - 1, c.nh, c.nkv,
                                         c.hd, scale, max_len, ctx2, got.data(), ws.data(), ws_bytes, nullptr, 0);
      const size_t n = size_t(c.T - 1) * c.nh * c.hd;
      std::vector<float> r = ref.download(), g = got.download();
      r.resize(n);
      g.resize(n);
      EXPECT_EQ(first_float_mismatch(g, r), -1) << "T " << c.T - 1 << " ctx " << ctx2;
    }
  }
}

// Captured in a CUDA graph (no allocation in the launcher) and replayed: every replay gives the bits
// of the two kernels, also after the inputs change between replays.
TEST(CudaDecodeFused, AttentionGraphReplays) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  constexpr int nh = 32, nkv = 4, hd = 128, T = 16;
  constexpr int64_t max_ctx = 512, max_len = 512, kvd = nkv * hd;
  std::vector<int32_t> slot(T), pos(T);
  for (int t = 0; t < T; ++t) {
    slot[t] = t;
    pos[t] = static_cast<int32_t>((t * 97 + 13) % max_ctx);
  }
  const auto q1 = randn(T * nh * hd, 81, 1.5f), q2 = randn(T * nh * hd, 82, 1.5f), kc = randn(T * max_len * kvd, 83),
             vc = randn(T * max_len * kvd, 84);
  auto dq = dev(q1), dk = dev(kc), dv = dev(vc);
  auto ds = dev(slot), dp = dev(pos);
  const float scale = 1.f / std::sqrt(float(hd));
  const size_t need = cuda::kern::attention_decode_fused_workspace(T, nh, nkv, hd, max_ctx);
  DeviceArray<unsigned char> ws(std::max<size_t>(need, 1));
  ws.fill_bytes(0);
  DeviceArray<float> out(q1.size()), ref(q1.size());
  cudaStream_t s;
  QUADS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  QUADS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const int used = cuda::kern::attention_decode_fused(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), T, nh, nkv,
                                                      hd, scale, max_len, max_ctx, out.data(), ws.data(), need, s, 0);
  QUADS_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  QUADS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  EXPECT_GT(used, 1) << "the case should exercise the merge";
  for (int rep = 0; rep < 4; ++rep) {
    const auto& q = rep < 2 ? q1 : q2;
    if (rep == 2) dq.upload(q2);
    out.fill_bytes(0xFF);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());  // the memset and upload ran on the legacy stream, s does not wait for it
    QUADS_CUDA_CHECK(cudaGraphLaunch(exec, s));
    QUADS_CUDA_CHECK(cudaStreamSynchronize(s));
    cuda::kern::attention_decode_split_n(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), T, nh, nkv, hd, scale,
                                         max_len, max_ctx, ref.data(), nullptr, used);
    const auto g = out.download();
    EXPECT_EQ(first_float_mismatch(g, ref.download()), -1) << "replay " << rep;
    EXPECT_LT(rel_l2(g, cpu_decode_attention(q, kc, vc, slot, pos, nh, nkv, hd, max_len)), 2e-6) << "replay " << rep;
  }
  QUADS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  QUADS_CUDA_CHECK(cudaGraphDestroy(graph));
  QUADS_CUDA_CHECK(cudaStreamDestroy(s));
}

// kv_early (a decode step's contract): the first K/V tile's old rows are copied before the PDL
// wait, the new row after it. Each token's new row is written by the kernel launched just before
// the attention (kv_rows back into the cache, over stale values), in one stream, eagerly and in a
// graph: the same bits as kv_early off, and the CPU's result on the final cache.
TEST(CudaDecodeFused, AttentionEarlyKvSameBits) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int T;
    int64_t max_ctx;
  };
  constexpr int nh = 32, nkv = 4, hd = 128;
  for (const Case c : {Case{1, 160}, Case{1, 600}, Case{16, 256}, Case{64, 160}, Case{5, 33}}) {
    const int64_t max_len = c.max_ctx + 2, kvd = int64_t(nkv) * hd;
    const int slots = c.T + 2;
    std::vector<int32_t> slot(c.T), pos(c.T);
    for (int t = 0; t < c.T; ++t) {
      slot[t] = slots - 1 - t;  // one new row a slot, as in a decode step
      pos[t] = static_cast<int32_t>(t == 0 ? c.max_ctx - 1 : (t * 37 + 5) % c.max_ctx);  // tile edges among them
    }
    auto kc = randn(slots * max_len * kvd, 91 + c.T), vc = randn(slots * max_len * kvd, 92 + c.T);
    const auto q = randn(int64_t(c.T) * nh * hd, 93 + c.T, 1.5f), knew = randn(c.T * kvd, 94 + c.T),
               vnew = randn(c.T * kvd, 95 + c.T);
    auto dq = dev(q), dk = dev(kc), dv = dev(vc), dkn = dev(knew), dvn = dev(vnew);
    auto ds = dev(slot), dp = dev(pos);
    for (int t = 0; t < c.T; ++t)  // the final cache, for the CPU
      for (int64_t i = 0; i < kvd; ++i) {
        kc[(slot[t] * max_len + pos[t]) * kvd + i] = knew[t * kvd + i];
        vc[(slot[t] * max_len + pos[t]) * kvd + i] = vnew[t * kvd + i];
      }
    const std::vector<float> want = cpu_decode_attention(q, kc, vc, slot, pos, nh, nkv, hd, max_len);
    const float scale = 1.f / std::sqrt(float(hd));
    const size_t need = cuda::kern::attention_decode_fused_workspace(c.T, nh, nkv, hd, c.max_ctx);
    DeviceArray<unsigned char> ws(std::max<size_t>(need, 1));
    ws.fill_bytes(0);
    DeviceArray<float> ref(q.size()), got(q.size());
    cudaStream_t s;
    QUADS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const std::vector<float> stale = randn(c.T * kvd, 96 + c.T);
    for (const bool fused : {false, true})
      for (const bool graph : {false, true})
        for (const bool early : {false, true}) {
          const std::string what = "T " + std::to_string(c.T) + " ctx " + std::to_string(c.max_ctx) +
                                   (fused ? " fused" : " split+merge") + (graph ? " graph" : "") +
                                   (early ? " early" : "");
          auto run = [&] {
            cuda::kern::kv_rows(dk.data(), dv.data(), ds.data(), dp.data(), c.T, nkv, hd, max_len, nullptr, dkn.data(),
                                dvn.data(), true, s);
            if (fused)
              cuda::kern::attention_decode_fused(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), c.T, nh, nkv, hd,
                                                 scale, max_len, c.max_ctx, got.data(), ws.data(), need, s, 0, early);
            else
              cuda::kern::attention_decode_split_n(dq.data(), dk.data(), dv.data(), ds.data(), dp.data(), c.T, nh, nkv,
                                                   hd, scale, max_len, c.max_ctx, got.data(), s, 0, early);
          };
          for (int rep = 0; rep < 2; ++rep) {
            // stale values in the new rows, so a copy made before the write would show
            std::vector<float> ks = kc, vs = vc;
            for (int t = 0; t < c.T; ++t)
              for (int64_t i = 0; i < kvd; ++i) {
                ks[(slot[t] * max_len + pos[t]) * kvd + i] = stale[t * kvd + i];
                vs[(slot[t] * max_len + pos[t]) * kvd + i] = -stale[t * kvd + i];
              }
            dk.upload(ks);
            dv.upload(vs);
            got.fill_bytes(0xFF);
            QUADS_CUDA_CHECK(cudaDeviceSynchronize());
            if (graph) {
              cudaGraph_t gr = nullptr;
              cudaGraphExec_t ex = nullptr;
              QUADS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
              run();
              QUADS_CUDA_CHECK(cudaStreamEndCapture(s, &gr));
              QUADS_CUDA_CHECK(cudaGraphInstantiate(&ex, gr, 0));
              QUADS_CUDA_CHECK(cudaGraphLaunch(ex, s));
              QUADS_CUDA_CHECK(cudaStreamSynchronize(s));
              QUADS_CUDA_CHECK(cudaGraphExecDestroy(ex));
              QUADS_CUDA_CHECK(cudaGraphDestroy(gr));
            } else {
              run();
              QUADS_CUDA_CHECK(cudaStreamSynchronize(s));
            }
            const auto g = got.download();
            if (!early && !fused && !graph && rep == 0) {
              QUADS_CUDA_CHECK(cudaMemcpy(ref.data(), got.data(), 4 * q.size(), cudaMemcpyDeviceToDevice));
              EXPECT_LT(rel_l2(g, want), 2e-6) << what;
            } else {  // (the fused kernel's bits are the split + merge ones)
              EXPECT_EQ(first_float_mismatch(g, ref.download()), -1) << what << " rep " << rep;
            }
          }
        }
    QUADS_CUDA_CHECK(cudaStreamDestroy(s));
  }
}

// qk-norm/RoPE/cache store from the fused q/k/v product (packed and with a padded row stride) vs
// split_cols3 + qk_norm_rope_store.
TEST(CudaDecodeFused, QkvNormRopeStoreSameBitsAsSplit) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int nh, nkv, hd, T;
    bool prescale;
  };
  for (const Case c : {Case{32, 4, 128, 1, false}, Case{32, 4, 128, 16, false}, Case{32, 4, 128, 64, true},
                       Case{8, 2, 64, 3, false}, Case{16, 1, 256, 2, true}, Case{6, 3, 96, 4, false},
                       Case{5, 5, 34, 7, true}}) {
    const int slots = c.T + 2;
    const int64_t max_len = 24, qd = int64_t(c.nh) * c.hd, kvd = int64_t(c.nkv) * c.hd, T = c.T, w = qd + 2 * kvd;
    std::vector<int32_t> slot(T), pos(T);
    for (int t = 0; t < c.T; ++t) {
      slot[t] = (t * 5 + 1) % slots;
      pos[t] = (t * 7 + 3) % static_cast<int>(max_len);
    }
    const auto qkv = randn(T * w, 40 + c.hd + c.T, 2.f), qn = randn(c.hd, 41, 0.1f, 1.f),
               kn = randn(c.hd, 42, 0.1f, 1.f), cs = randn(T * c.hd / 2, 43), sn = randn(T * c.hd / 2, 44),
               ps = randn(kvd, 45, 0.2f, 1.f), cache0 = randn(slots * max_len * kvd, 46);
    auto dqkv = dev(qkv), dqn = dev(qn), dkn = dev(kn), dcs = dev(cs), dsn = dev(sn), dps = dev(ps);
    auto dslot = dev(slot), dpos = dev(pos);
    const float* pre = c.prescale ? dps.data() : nullptr;
    // the reference: split, then the in-place kernel
    DeviceArray<float> q0(T * qd), k0(T * kvd), v0(T * kvd);
    auto kc0 = dev(cache0), vc0 = dev(cache0);
    cuda::kern::split_cols3(dqkv.data(), T, qd, kvd, kvd, q0.data(), k0.data(), v0.data(), nullptr);
    cuda::kern::qk_norm_rope_store(q0.data(), k0.data(), v0.data(), dqn.data(), dkn.data(), 1e-6f, dcs.data(),
                                   dsn.data(), dslot.data(), dpos.data(), T, c.nh, c.nkv, c.hd, kc0.data(), vc0.data(),
                                   max_len, nullptr, pre);
    const auto qw = q0.download(), kw = kc0.download(), vw = vc0.download();
    EXPECT_NE(first_float_mismatch(kw, cache0), -1) << "the keys were stored";
    for (const int64_t pad : {int64_t(0), int64_t(12)}) {
      const int64_t ld = w + pad;
      std::vector<float> padded(T * ld, 777.f);
      for (int64_t t = 0; t < T; ++t) std::copy(qkv.begin() + t * w, qkv.begin() + (t + 1) * w, padded.begin() + t * ld);
      auto dpad = dev(padded);
      DeviceArray<float> q1(T * qd);
      q1.fill_bytes(0xFF);
      auto kc1 = dev(cache0), vc1 = dev(cache0);
      cuda::kern::qk_norm_rope_store_qkv(dpad.data(), ld, q1.data(), dqn.data(), dkn.data(), 1e-6f, dcs.data(),
                                         dsn.data(), dslot.data(), dpos.data(), T, c.nh, c.nkv, c.hd, kc1.data(),
                                         vc1.data(), max_len, nullptr, pre);
      const std::string what = "hd " + std::to_string(c.hd) + " T " + std::to_string(c.T) + " ld " + std::to_string(ld);
      EXPECT_EQ(first_float_mismatch(q1.download(), qw), -1) << "q, " << what;
      EXPECT_EQ(first_float_mismatch(kc1.download(), kw), -1) << "k cache, " << what;
      EXPECT_EQ(first_float_mismatch(vc1.download(), vw), -1) << "v cache, " << what;
      EXPECT_EQ(first_float_mismatch(dpad.download(), padded), -1) << "the product is read only, " << what;
    }
  }
}

// rmsnorm with its BF16 copy vs rmsnorm + to_bf16 (register rows of 1..16 per thread, ragged
// tails, the generic kernel past 4096), and without the copy.
TEST(CudaDecodeFused, RmsnormBf16SameBitsAsTwoKernels) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  for (int64_t D : {16, 100, 2048, 2051, 4096, 5000}) {
    for (int64_t rows : {1, 3, 37}) {
      const auto x = randn(rows * D, 17 + D + rows, 3.f), w = randn(D, 18 + D, 0.1f, 1.f);
      auto dx = dev(x), dw = dev(w);
      DeviceArray<float> y0(rows * D), y1(rows * D), y2(rows * D);
      DeviceArray<uint16_t> b0(rows * D), b1(rows * D);
      cuda::kern::rmsnorm(dx.data(), dw.data(), rows, D, 1e-6f, y0.data(), nullptr);
      cuda::kern::to_bf16(y0.data(), b0.data(), rows * D, nullptr);
      cuda::kern::rmsnorm_bf16(dx.data(), dw.data(), rows, D, 1e-6f, y1.data(), b1.data(), nullptr);
      cuda::kern::rmsnorm_bf16(dx.data(), dw.data(), rows, D, 1e-6f, y2.data(), nullptr, nullptr);
      const auto want = y0.download();
      EXPECT_EQ(first_float_mismatch(y1.download(), want), -1) << "D " << D << " rows " << rows;
      EXPECT_EQ(first_float_mismatch(y2.download(), want), -1) << "D " << D << " rows " << rows << " (no copy)";
      EXPECT_EQ(first_mismatch(download_u16(b1), download_u16(b0)), -1) << "bf16, D " << D << " rows " << rows;
    }
  }
}

// x += MoE combine (or a plain addend), then the norm with its BF16 copy, vs moe_combine_add /
// add_inplace + rmsnorm + to_bf16: the peer model's k = 8 rows of 2048 at T = 1, 16, 64, other
// top-k counts and widths, 256 and 1024 threads a row.
TEST(CudaDecodeFused, ResidualRmsnormSameBitsAsTwoKernels) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  struct Case {
    int64_t T;
    int k;
    int64_t D;
  };
  for (const int threads : {0, 256, 1024}) {
    NormThreads knob(threads);
    for (const Case c : {Case{1, 8, 2048}, Case{16, 8, 2048}, Case{64, 8, 2048}, Case{5, 1, 2048}, Case{3, 3, 100},
                         Case{2, 9, 2051}, Case{7, 17, 4096}, Case{2, 8, 5000}, Case{200, 2, 64}}) {
      const int64_t n = c.T * c.k, D = c.D;
      const auto x = randn(c.T * D, 91 + D + c.T, 2.f), ye = randn(n * D, 92 + c.k), wn = randn(D, 93, 0.1f, 1.f),
                 cw = randn(n, 94 + c.T, 0.3f, 0.2f), add = randn(c.T * D, 95);
      std::vector<int32_t> inv(n);
      std::iota(inv.begin(), inv.end(), 0);
      std::shuffle(inv.begin(), inv.end(), std::mt19937_64(96 + n));
      auto dye = dev(ye), dwn = dev(wn), dcw = dev(cw), dadd = dev(add);
      auto dinv = dev(inv);
      const std::string what = "T " + std::to_string(c.T) + " k " + std::to_string(c.k) + " D " + std::to_string(D) +
                               " threads " + std::to_string(threads);
      for (const bool moe : {true, false}) {
        auto x0 = dev(x), x1 = dev(x);
        DeviceArray<float> y0(c.T * D), y1(c.T * D);
        DeviceArray<uint16_t> b0(c.T * D), b1(c.T * D);
        if (moe) {
          cuda::kern::moe_combine_add(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x0.data(), nullptr);
          cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x1.data(), dwn.data(),
                                              1e-6f, y1.data(), b1.data(), nullptr);
        } else {
          cuda::kern::add_inplace(x0.data(), dadd.data(), c.T * D, nullptr);
          cuda::kern::add_rmsnorm(x1.data(), dadd.data(), c.T, D, dwn.data(), 1e-6f, y1.data(), b1.data(), nullptr);
        }
        cuda::kern::rmsnorm(x0.data(), dwn.data(), c.T, D, 1e-6f, y0.data(), nullptr);
        cuda::kern::to_bf16(y0.data(), b0.data(), c.T * D, nullptr);
        const char* kind = moe ? "moe " : "add ";
        const auto xw = x0.download();
        EXPECT_EQ(first_float_mismatch(x1.download(), xw), -1) << kind << "x, " << what;
        EXPECT_NE(first_float_mismatch(xw, x), -1) << kind << "x was updated, " << what;
        EXPECT_EQ(first_float_mismatch(y1.download(), y0.download()), -1) << kind << "y, " << what;
        EXPECT_EQ(first_mismatch(download_u16(b1), download_u16(b0)), -1) << kind << "bf16, " << what;
      }
      // without the BF16 copy
      auto x2 = dev(x), x3 = dev(x);
      DeviceArray<float> y2(c.T * D), y3(c.T * D);
      DeviceArray<uint16_t> b3(c.T * D);
      cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x2.data(), dwn.data(), 1e-6f,
                                          y2.data(), nullptr, nullptr);
      cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x3.data(), dwn.data(), 1e-6f,
                                          y3.data(), b3.data(), nullptr);
      EXPECT_EQ(first_float_mismatch(y2.download(), y3.download()), -1) << "no copy, " << what;
      // the routing and norm weights read before the PDL wait (a decode step's early): the same bits
      auto x4 = dev(x);
      DeviceArray<float> y4(c.T * D);
      cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x4.data(), dwn.data(), 1e-6f,
                                          y4.data(), nullptr, nullptr, {}, true);
      EXPECT_EQ(first_float_mismatch(x4.download(), x2.download()), -1) << "early x, " << what;
      EXPECT_EQ(first_float_mismatch(y4.download(), y2.download()), -1) << "early y, " << what;
    }
  }
}

// The norms' NVFP4 output (kern::RowNvfp4) is quantize()'s of their float output with the
// rollouts' activation config (E2M1 1x16, per-row amax), byte for byte: rmsnorm_bf16 (register
// rows of 1..16 per thread), moe_combine_add_rmsnorm and add_rmsnorm (256 and 1024 threads a
// row), rows with a wide dynamic range, a zero row, and the float / BF16 outputs unchanged.
TEST(CudaDecodeFused, NormNvfp4OutputIsQuantize) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  num::QConfig qc = num::QConfig::nvfp4_act();
  qc.global = num::Global::PerRow;
  struct Case {
    int64_t T;
    int k;
    int64_t D;
  };
  for (const int threads : {0, 256, 1024}) {
    NormThreads knob(threads);
    for (const Case c : {Case{1, 8, 2048}, Case{16, 8, 2048}, Case{64, 8, 2048}, Case{3, 2, 64}, Case{5, 3, 2064},
                         Case{7, 17, 4096}, Case{2, 1, 256}}) {
      const int64_t n = c.T * c.k, D = c.D;
      std::vector<float> x = randn(c.T * D, 201 + D + c.T, 2.f);
      for (int64_t j = 0; j < D; ++j) x[size_t(j)] *= (j % 97 == 0) ? 300.f : (j % 5 == 0 ? 1e-3f : 1.f);
      const auto ye = randn(n * D, 202 + c.k), wn = randn(D, 203, 0.1f, 1.f), cw = randn(n, 204 + c.T, 0.3f, 0.2f);
      std::vector<float> add = randn(c.T * D, 205);
      if (c.T > 2)  // a row of zeros after the add: amax 0
        for (int64_t j = 0; j < D; ++j) add[size_t(D + j)] = -x[size_t(D + j)];
      std::vector<int32_t> inv(n);
      std::iota(inv.begin(), inv.end(), 0);
      std::shuffle(inv.begin(), inv.end(), std::mt19937_64(206 + n));
      auto dye = dev(ye), dwn = dev(wn), dcw = dev(cw), dadd = dev(add);
      auto dinv = dev(inv);
      const std::string what = "T " + std::to_string(c.T) + " k " + std::to_string(c.k) + " D " + std::to_string(D) +
                               " threads " + std::to_string(threads);
      for (int kind = 0; kind < 3; ++kind) {  // rmsnorm_bf16, moe_combine_add_rmsnorm, add_rmsnorm
        auto x0 = dev(x), x1 = dev(x);
        DeviceArray<float> y0(c.T * D), y1(c.T * D);
        DeviceArray<uint16_t> b0(c.T * D), b1(c.T * D);
        cuda::DeviceQTensor want = cuda::make_qtensor(c.T, D, qc), got = cuda::make_qtensor(c.T, D, qc);
        got.codes.fill_bytes(0xAB);
        got.scales.fill_bytes(0xAB);
        // up to kXFragMaxRows rows: the FP16 fragments of the skinny tiles too (RowNvfp4::frag), which
        // must be w4a4_x_frag's of quantize()'s codes where written (the rest keeps its fill)
        const bool with_frag = c.T <= cuda::kXFragMaxRows;
        DeviceArray<uint8_t> frag(cuda::x_frag_bytes(D, c.T)), frag_want(cuda::x_frag_bytes(D, c.T));
        frag.fill_bytes(0x5A);
        frag_want.fill_bytes(0x5A);
        cuda::kern::RowNvfp4 yq{got.codes.data(), got.scales.data(), got.amax.data()};
        if (with_frag) yq.frag = frag.data();
        if (kind == 0) {
          cuda::kern::rmsnorm_bf16(x0.data(), dwn.data(), c.T, D, 1e-6f, y0.data(), b0.data(), nullptr);
          cuda::kern::rmsnorm_bf16(x1.data(), dwn.data(), c.T, D, 1e-6f, y1.data(), b1.data(), nullptr, yq);
        } else if (kind == 1) {
          cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x0.data(), dwn.data(),
                                              1e-6f, y0.data(), b0.data(), nullptr);
          cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), c.T, c.k, D, x1.data(), dwn.data(),
                                              1e-6f, y1.data(), b1.data(), nullptr, yq);
        } else {
          cuda::kern::add_rmsnorm(x0.data(), dadd.data(), c.T, D, dwn.data(), 1e-6f, y0.data(), b0.data(), nullptr);
          cuda::kern::add_rmsnorm(x1.data(), dadd.data(), c.T, D, dwn.data(), 1e-6f, y1.data(), b1.data(), nullptr, yq);
        }
        cuda::quantize(y0.data(), want);
        const std::string k = std::string(kind == 0 ? "rmsnorm " : kind == 1 ? "moe " : "add ") + what;
        EXPECT_EQ(first_float_mismatch(y1.download(), y0.download()), -1) << k << ": y";
        EXPECT_EQ(first_mismatch(download_u16(b1), download_u16(b0)), -1) << k << ": bf16";
        EXPECT_EQ(first_float_mismatch(x1.download(), x0.download()), -1) << k << ": x";
        EXPECT_EQ(first_mismatch(got.codes.download(), want.codes.download()), -1) << k << ": codes";
        EXPECT_EQ(first_mismatch(got.scales.download(), want.scales.download()), -1) << k << ": scales";
        EXPECT_EQ(first_float_mismatch(got.amax.download(), want.amax.download()), -1) << k << ": amax";
        if (with_frag) {
          cuda::w4a4_x_frag(cuda::nvfp4_view(want), frag_want.data());
          EXPECT_EQ(first_mismatch(frag.download(), frag_want.download()), -1) << k << ": fragments";
        }
      }
    }
  }
}

// The router's logits from rmsnorm_bf16 (kern::RowRouter): the norm's outputs (float, BF16,
// NVFP4) are those of the call without a router, bit for bit, and each logit is the float64 dot
// of the BF16 output with the BF16 weight row to float32 summation error; E not a multiple of the
// 8 experts a CTA, D not a multiple of the 256 elements a warp's pass covers.
TEST(CudaDecodeFused, NormRouterLogitsAreTheBf16Gemm) {
  QUADS_REQUIRE_GPU();
  cuda::kern::set_legacy_decode_kernels(false);
  num::QConfig qc = num::QConfig::nvfp4_act();
  qc.global = num::Global::PerRow;
  struct Case {
    int64_t T, D;
    int E;
  };
  for (const Case c : {Case{1, 2048, 64}, Case{16, 2048, 64}, Case{64, 2048, 128}, Case{3, 64, 8}, Case{5, 144, 60},
                       Case{2, 4096, 20}}) {
    ASSERT_TRUE(cuda::kern::router_fusable(c.T, c.D, c.E));
    const std::string what = "T " + std::to_string(c.T) + " D " + std::to_string(c.D) + " E " + std::to_string(c.E);
    const auto x = randn(c.T * c.D, 401 + c.D, 2.f), wn = randn(c.D, 402, 0.1f, 1.f), wr = randn(c.E * c.D, 403, 0.05f);
    std::vector<uint16_t> wrb(wr.size());
    for (size_t i = 0; i < wr.size(); ++i) wrb[i] = num::bf16_from_f32(wr[i]);
    auto dx = dev(x), dwn = dev(wn);
    auto dwr = dev(wrb);
    DeviceArray<float> y0(c.T * c.D), y1(c.T * c.D), lg(c.T * c.E);
    DeviceArray<uint16_t> b0(c.T * c.D), b1(c.T * c.D);
    cuda::DeviceQTensor q0 = cuda::make_qtensor(c.T, c.D, qc), q1 = cuda::make_qtensor(c.T, c.D, qc);
    lg.fill_bytes(0xFF);
    cuda::kern::rmsnorm_bf16(dx.data(), dwn.data(), c.T, c.D, 1e-6f, y0.data(), b0.data(), nullptr,
                             {q0.codes.data(), q0.scales.data(), q0.amax.data()});
    cuda::kern::rmsnorm_bf16(dx.data(), dwn.data(), c.T, c.D, 1e-6f, y1.data(), b1.data(), nullptr,
                             {q1.codes.data(), q1.scales.data(), q1.amax.data()}, {dwr.data(), c.E, lg.data()});
    EXPECT_EQ(first_float_mismatch(y1.download(), y0.download()), -1) << what << ": y";
    const std::vector<uint16_t> yb = download_u16(b1);
    EXPECT_EQ(first_mismatch(yb, download_u16(b0)), -1) << what << ": bf16";
    EXPECT_EQ(first_mismatch(q1.codes.download(), q0.codes.download()), -1) << what << ": codes";
    EXPECT_EQ(first_mismatch(q1.scales.download(), q0.scales.download()), -1) << what << ": scales";
    const std::vector<float> got = lg.download();
    for (int64_t t = 0; t < c.T; ++t)
      for (int e = 0; e < c.E; ++e) {
        double dot = 0, mag = 0;
        for (int64_t j = 0; j < c.D; ++j) {
          const double a = num::bf16_to_f32(yb[t * c.D + j]), b = num::bf16_to_f32(wrb[e * c.D + j]);
          dot += a * b;
          mag += std::fabs(a * b);
        }
        ASSERT_NEAR(got[t * c.E + e], dot, 1e-6 * mag + 1e-30) << what << " row " << t << " expert " << e;
      }
  }
}

// quantize_swiglu is kern::swiglu then quantize(), byte for byte: rows that stay in registers and
// longer ones (two passes), the expert MLP's fused gate/up layout (ld = 2I) and a separate up
// buffer (ld = I), per-row and static amax.
TEST(CudaDecodeFused, QuantizeSwigluIsSwigluThenQuantize) {
  QUADS_REQUIRE_GPU();
  struct Case {
    int64_t rows, I;
    bool fused_gu, per_row;
  };
  // (a warp a row: 768 in registers, 300 x 1536 in two passes; a CTA a row: 9 x 4096)
  for (const Case c : {Case{1, 768, true, true}, Case{128, 768, true, true}, Case{5, 64, false, true},
                       Case{9, 4096, true, true}, Case{3, 2048, false, false}, Case{300, 1536, true, true}}) {
    const int64_t ld = c.fused_gu ? 2 * c.I : c.I;
    std::vector<float> g = randn(c.rows * ld, 301 + c.I, 3.f), u = randn(c.rows * ld, 302 + c.rows);
    for (size_t i = 0; i < g.size(); i += 41) g[i] *= 40.f;  // a wide range of SiLU inputs
    auto dg = dev(g), du = dev(u);
    const float* gp = dg.data();
    const float* up = c.fused_gu ? dg.data() + c.I : du.data();
    num::QConfig qc = num::QConfig::nvfp4_act();
    qc.global = c.per_row ? num::Global::PerRow : num::Global::Static;
    qc.static_amax = 7.5f;
    ASSERT_TRUE(cuda::quantize_swiglu_supported(qc));
    DeviceArray<float> h(c.rows * c.I);
    cuda::kern::swiglu(gp, up, ld, c.rows, c.I, h.data(), nullptr);
    cuda::DeviceQTensor want = cuda::make_qtensor(c.rows, c.I, qc), got = cuda::make_qtensor(c.rows, c.I, qc);
    cuda::quantize(h.data(), want);
    got.codes.fill_bytes(0xAB);
    got.scales.fill_bytes(0xAB);
    cuda::quantize_swiglu(gp, up, ld, got);
    const std::string what = "rows " + std::to_string(c.rows) + " I " + std::to_string(c.I) +
                             (c.fused_gu ? " fused gate/up" : " separate up") + (c.per_row ? " per-row" : " static");
    EXPECT_EQ(first_mismatch(got.codes.download(), want.codes.download()), -1) << what << ": codes";
    EXPECT_EQ(first_mismatch(got.scales.download(), want.scales.download()), -1) << what << ": scales";
    const size_t na = c.per_row ? size_t(c.rows) : 1;
    std::vector<float> ga = got.amax.download(), wa = want.amax.download();
    ga.resize(na);
    wa.resize(na);
    EXPECT_EQ(first_float_mismatch(ga, wa), -1) << what << ": amax";
  }
}

// RAC folded (rac_quantize_fold): the activation's codes are quantize()'s and each residual operand
// is the CPU chain's (fake_quantize, X - X_eff on the selected blocks, zeros elsewhere, quantize)
// byte for byte, for plain rows, rows through a map, the SwiGLU of gate/up (the source rows made
// by kern::gather_rows / kern::swiglu on the device, which their own tests check), dense and
// grouped selections, one to three operands, per-row and static amax.
TEST(CudaDecodeFused, RacQuantizeFoldMatchesCpuChain) {
  QUADS_REQUIRE_GPU();
  num::QConfig row = num::QConfig::nvfp4_act();
  row.global = num::Global::PerRow;
  num::QConfig fixed = row;
  fixed.global = num::Global::Static;
  fixed.static_amax = 3.f;
  struct Case {
    int64_t rows, cols;
    int nops;
    int source;  // 0 plain, 1 through a map (div 2), 2 SwiGLU (gate/up fused, ld 2 cols)
    std::vector<int> groups;  // rows per group; empty: dense
  };
  uint64_t seed = 700;
  for (const Case& c : std::vector<Case>{{1, 2048, 3, 0, {}},
                                         {5, 512, 1, 0, {}},
                                         {16, 2048, 2, 1, {3, 0, 9, 4}},
                                         {8, 768, 1, 2, {2, 6}},
                                         {64, 4096, 1, 0, {}},
                                         {33, 128, 2, 2, {}}})
    for (const num::QConfig& act : {row, fixed})
      for (const num::QConfig& res : {row, fixed}) {
        const int64_t nb = c.cols / 16;
        const int G = c.groups.empty() ? 1 : static_cast<int>(c.groups.size());
        std::vector<int32_t> eoff(1, 0);
        for (int g : c.groups) eoff.push_back(eoff.back() + g);
        if (!c.groups.empty()) {
          ASSERT_EQ(eoff.back(), c.rows);
        }
        // the source rows X [rows, cols] on the device and the kernel's source arguments
        const int64_t src_rows = c.source == 1 ? (c.rows + 1) / 2 : c.rows, ld = c.source == 2 ? 2 * c.cols : c.cols;
        std::vector<float> a = randn(size_t(src_rows * ld), seed++, 2.f);
        for (size_t i = 0; i < a.size(); i += 37) a[i] *= 30.f;
        auto da = dev(a);
        std::vector<int32_t> map(size_t(c.rows));
        for (int64_t r = 0; r < c.rows; ++r) map[size_t(r)] = static_cast<int32_t>((r * 7 + 3) % c.rows);  // / 2: a token row
        auto dmap = dev(map);
        DeviceArray<float> dx(c.rows * c.cols);
        cuda::RacFoldSource src;
        src.x = da.data();
        src.ld = ld;
        if (c.source == 0) {
          QUADS_CUDA_CHECK(cudaMemcpy(dx.data(), da.data(), sizeof(float) * c.rows * c.cols, cudaMemcpyDeviceToDevice));
        } else if (c.source == 1) {
          cuda::kern::gather_rows(da.data(), dmap.data(), c.rows, 2, c.cols, dx.data(), nullptr);
          src.map = dmap.data();
          src.map_div = 2;
        } else {
          cuda::kern::swiglu(da.data(), da.data() + c.cols, ld, c.rows, c.cols, dx.data(), nullptr);
          src.u = da.data() + c.cols;
        }
        const std::vector<float> x = dx.download();
        // selections: operand j of group e takes about half of the blocks
        std::mt19937_64 rng(seed++);
        std::vector<std::vector<uint8_t>> sel(size_t(c.nops), std::vector<uint8_t>(size_t(G * nb)));
        for (auto& s : sel)
          for (auto& v : s) v = static_cast<uint8_t>(rng() % 2);
        // the CPU chain
        const num::QTensor want_x = num::quantize(x.data(), c.rows, c.cols, act);
        std::vector<float> xeff(x.size());
        num::fake_quantize(x.data(), xeff.data(), c.rows, c.cols, act);
        std::vector<num::QTensor> want_r;
        for (int j = 0; j < c.nops; ++j) {
          std::vector<float> r(x.size(), 0.f);
          for (int64_t m = 0; m < c.rows; ++m) {
            int e = 0;
            while (e + 1 < G && eoff[size_t(e) + 1] <= m) ++e;
            for (int64_t b = 0; b < nb; ++b)
              if (sel[size_t(j)][size_t(e * nb + b)])
                for (int64_t i = m * c.cols + b * 16; i < m * c.cols + b * 16 + 16; ++i) r[size_t(i)] = x[size_t(i)] - xeff[size_t(i)];
          }
          want_r.push_back(num::quantize(r.data(), c.rows, c.cols, res));
        }
        // the kernel
        std::vector<DeviceArray<uint8_t>> dsel;
        for (auto& s : sel) dsel.push_back(dev(s));
        const uint8_t* selp[3] = {};
        for (int j = 0; j < c.nops; ++j) selp[j] = dsel[size_t(j)].data();
        auto deoff = dev(eoff);
        cuda::DeviceQTensor gx = cuda::make_qtensor(c.rows, c.cols, act);
        gx.codes.fill_bytes(0xAB);
        DeviceArray<uint8_t> rc(c.nops * c.rows * c.cols / 2), rs(c.nops * c.rows * nb);
        DeviceArray<float> ra(c.nops * c.rows);
        rc.fill_bytes(0xAB);
        rs.fill_bytes(0xAB);
        cuda::rac_quantize_fold(src, c.rows, c.cols, act, &gx, c.nops, selp, c.groups.empty() ? nullptr : deoff.data(), G,
                                res, rc.data(), rs.data(), ra.data());
        const std::string what = "rows " + std::to_string(c.rows) + " cols " + std::to_string(c.cols) + " source " +
                                 std::to_string(c.source) + " groups " + std::to_string(c.groups.size()) + " act " +
                                 act.describe() + " residual " + res.describe();
        const num::QTensor hx = cuda::to_host(gx);
        EXPECT_EQ(hx.codes, want_x.codes) << what << ": activation codes";
        EXPECT_EQ(hx.scales, want_x.scales) << what << ": activation scales";
        EXPECT_EQ(hx.amax[0], want_x.amax[0]) << what << ": activation amax";
        if (act.global == num::Global::PerRow) {
          EXPECT_EQ(hx.amax, want_x.amax) << what;
        }
        const std::vector<uint8_t> gc = rc.download(), gs = rs.download();
        const std::vector<float> ga = ra.download();
        for (int j = 0; j < c.nops; ++j) {
          const num::QTensor& w = want_r[size_t(j)];
          const size_t nc = size_t(c.rows * c.cols / 2), ns = size_t(c.rows * nb);
          EXPECT_EQ(std::vector<uint8_t>(gc.begin() + j * nc, gc.begin() + (j + 1) * nc), w.codes) << what << " operand " << j;
          EXPECT_EQ(std::vector<uint8_t>(gs.begin() + j * ns, gs.begin() + (j + 1) * ns), w.scales) << what << " operand " << j;
          for (int64_t m = 0; m < c.rows; ++m)
            ASSERT_EQ(bits(ga[size_t(j * c.rows + m)]), bits(w.amax[res.global == num::Global::PerRow ? size_t(m) : 0]))
                << what << " operand " << j << " row " << m;
        }
      }
}

// The CPU's combine + add + norm agrees with the fused kernel to rounding (a check of the reference
// sequence's semantics, not only of the fusion).
TEST(CudaDecodeFused, ResidualRmsnormMatchesCpu) {
  QUADS_REQUIRE_GPU();
  constexpr int64_t T = 4, D = 2048;
  constexpr int k = 8;
  const auto x = randn(T * D, 101, 2.f), ye = randn(T * k * D, 102), wn = randn(D, 103, 0.1f, 1.f),
             cw = randn(T * k, 104, 0.3f, 0.2f);
  std::vector<int32_t> inv(T * k);
  std::iota(inv.begin(), inv.end(), 0);
  std::shuffle(inv.begin(), inv.end(), std::mt19937_64(105));
  auto dx = dev(x), dye = dev(ye), dwn = dev(wn), dcw = dev(cw);
  auto dinv = dev(inv);
  DeviceArray<float> dy(T * D);
  cuda::kern::moe_combine_add_rmsnorm(dye.data(), dinv.data(), dcw.data(), T, k, D, dx.data(), dwn.data(), 1e-6f,
                                      dy.data(), nullptr, nullptr);
  std::vector<float> xc(x), comb(T * D), y(T * D);
  cpu::moe_combine_forward(ye.data(), inv.data(), cw.data(), T, k, D, comb.data());
  for (int64_t i = 0; i < T * D; ++i) xc[i] += comb[i];
  cpu::rmsnorm_forward(xc.data(), wn.data(), T, D, 1e-6f, y.data(), nullptr);
  EXPECT_EQ(first_float_mismatch(dx.download(), xc), -1) << "x: the same operations as the CPU";
  EXPECT_LT(rel_l2(dy.download(), y), 3e-7);
}
