#pragma once
// `bench_cuda --decode-kernels`: the small per-layer kernels of a decode step of the peer model
// (hidden 2048, 32 query / 4 KV heads, head_dim 128, 64 experts top-8) at T = 1, 16, 64 tokens,
// the previous kernels (kern::set_legacy_decode_kernels(true)) beside the current ones. Each time
// is the median over 9 replays of a CUDA graph holding 20 launches (as the rollout engine runs
// them: graph launches, no host gaps), divided by 20. A second table times the fused kernels
// against the unfused sequences they replace (both current kernels). Included by bench_cuda.cpp only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/model_kernels.h"
#include "cuda/train_kernels.h"

namespace quads::cuda::decode_bench {

// Microseconds per call of fn (one launch sequence on stream s), from graph replays.
inline double graph_us(const std::function<void(cudaStream_t)>& fn, cudaStream_t s) {
  constexpr int kPerGraph = 20, kReps = 9;
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());  // set-up on other streams is done
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  QUADS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kPerGraph; ++i) fn(s);
  QUADS_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  QUADS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  QUADS_CUDA_CHECK(cudaEventCreate(&a));
  QUADS_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) QUADS_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
  std::vector<double> t;
  for (int r = 0; r < kReps; ++r) {
    QUADS_CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < 10; ++i) QUADS_CUDA_CHECK(cudaGraphLaunch(exec, s));
    QUADS_CUDA_CHECK(cudaEventRecord(b, s));
    QUADS_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    QUADS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1e3 * ms / (10.0 * kPerGraph));
  }
  QUADS_CUDA_CHECK(cudaEventDestroy(a));
  QUADS_CUDA_CHECK(cudaEventDestroy(b));
  QUADS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  QUADS_CUDA_CHECK(cudaGraphDestroy(graph));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// old and new time of one kernel: one table row.
inline void row(const char* name, int64_t T, const char* shape, const std::function<void(cudaStream_t)>& fn,
                cudaStream_t s, double bytes = 0) {
  kern::set_legacy_decode_kernels(true);
  const double old_us = graph_us(fn, s);
  kern::set_legacy_decode_kernels(false);
  const double new_us = graph_us(fn, s);
  std::printf("| %s | %lld | %s | %.2f | %.2f | %.2fx |", name, static_cast<long long>(T), shape, old_us, new_us,
              old_us / new_us);
  if (bytes > 0) std::printf(" %.0f |\n", bytes / new_us / 1e3);
  else std::printf(" |\n");
}

// unfused and fused time of one step: one row of the fused table.
inline void fused_row(const char* name, int64_t T, const char* shape, const std::function<void(cudaStream_t)>& unfused,
                      const std::function<void(cudaStream_t)>& fused, cudaStream_t s) {
  const double u = graph_us(unfused, s), f = graph_us(fused, s);
  std::printf("| %s | %lld | %s | %.2f | %.2f | %.2fx |\n", name, static_cast<long long>(T), shape, u, f, u / f);
}

inline DeviceArray<float> random_device(int64_t n, uint64_t seed, float sd = 1.f, float mean = 0.f) {
  DeviceArray<float> d(n);
  kern::fill_normal(d.data(), n, seed, mean, sd, nullptr);
  return d;
}

inline int run() {
  constexpr int H = 2048, nh = 32, nkv = 4, hd = 128, E = 64, K = 8;
  constexpr int64_t max_len = 512;
  const bool was = kern::legacy_decode_kernels();
  cudaStream_t s;
  QUADS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("\ndecode-step kernels, peer model shapes (us per call in a CUDA graph, median)\n");
  std::printf("| kernel | T | shape | old us | new us | speedup | new GB/s |\n|---|---|---|---|---|---|---|\n");
  const int64_t Tmax = 64, slots = Tmax;
  auto x = random_device(Tmax * H, 1, 2.f), w = random_device(H, 2, 0.1f, 1.f), y = random_device(Tmax * H, 3);
  auto ao = random_device(Tmax * nh * hd, 16);  // attention output [T, nh * hd]
  auto q = random_device(Tmax * nh * hd, 4), k = random_device(Tmax * nkv * hd, 5), v = random_device(Tmax * nkv * hd, 6);
  auto qn = random_device(hd, 7, 0.1f, 1.f), kn = random_device(hd, 8, 0.1f, 1.f);
  auto cs = random_device(Tmax * hd / 2, 9), sn = random_device(Tmax * hd / 2, 10);
  auto kc = random_device(slots * max_len * nkv * hd, 11), vc = random_device(slots * max_len * nkv * hd, 12);
  auto logits = random_device(Tmax * E, 13, 2.f), probs = random_device(Tmax * E, 14), rw = random_device(Tmax * K, 15);
  DeviceArray<int32_t> ridx(Tmax * K), slot(Tmax), pos(Tmax);
  std::vector<int32_t> hs(Tmax);
  for (int64_t t = 0; t < Tmax; ++t) hs[t] = static_cast<int32_t>(t);
  slot.upload(hs);
  for (int64_t T : {1, 16, 64}) {
    char shape[96];
    std::snprintf(shape, sizeof shape, "%d", H);
    row("rmsnorm", T, shape, [&](cudaStream_t st) { kern::rmsnorm(x.data(), w.data(), T, H, 1e-6f, y.data(), st); },
        s, 2.0 * T * H * 4 + H * 4);
    std::snprintf(shape, sizeof shape, "%d+2x%d heads x %d", nh, nkv, hd);
    // pos 0 everywhere: the stores land in positions the attention rows below do not read
    std::vector<int32_t> p0(Tmax, 0);
    pos.upload(p0);
    row("qk_norm_rope_store", T, shape, [&](cudaStream_t st) {
      kern::qk_norm_rope_store(q.data(), k.data(), v.data(), qn.data(), kn.data(), 1e-6f, cs.data(), sn.data(),
                               slot.data(), pos.data(), T, nh, nkv, hd, kc.data(), vc.data(), max_len, st);
    }, s);
    std::snprintf(shape, sizeof shape, "E %d top-%d", E, K);
    row("router_topk_fwd", T, shape, [&](cudaStream_t st) {
      kern::router_topk_fwd(logits.data(), T, E, K, true, probs.data(), ridx.data(), rw.data(), nullptr, st);
    }, s);
    for (int64_t ctx : {128, 256, 512}) {
      // every token at its last position; the graph's context bound rounds up to 256 as the engine's
      std::vector<int32_t> pl(Tmax, static_cast<int32_t>(ctx - 1));
      pos.upload(pl);
      const int64_t bound = std::max<int64_t>(256, ctx);
      const double bytes = 2.0 * T * ctx * nkv * hd * 4;
      std::snprintf(shape, sizeof shape, "ctx %lld (bound %lld)", static_cast<long long>(ctx),
                    static_cast<long long>(bound));
      row("attention_decode_split", T, shape, [&](cudaStream_t st) {
        kern::attention_decode_split(q.data(), kc.data(), vc.data(), slot.data(), pos.data(), T, nh, nkv, hd,
                                     0.08838835f, max_len, bound, ao.data(), st);
      }, s, bytes);
    }
  }
  // The pipelined kernel's split count at decode batches 16 and 64 (the first row of each is the
  // automatic choice; splits > 1 add the merge kernel).
  std::printf("\nattention_decode_split (new): us by forced split count\n| T | ctx | splits | us | GB/s |\n|---|---|---|---|---|\n");
  for (int64_t T : {16, 64})
    for (int64_t ctx : {256, 512}) {
      std::vector<int32_t> pl(Tmax, static_cast<int32_t>(ctx - 1));
      pos.upload(pl);
      for (int sp : {0, 1, 2, 3, 4, 8}) {
        int used = 0;
        const double us = graph_us([&](cudaStream_t st) {
          used = kern::attention_decode_split_n(q.data(), kc.data(), vc.data(), slot.data(), pos.data(), T, nh, nkv,
                                                hd, 0.08838835f, max_len, ctx, ao.data(), st, sp);
        }, s);
        std::printf("| %lld | %lld | %d%s | %.2f | %.0f |\n", static_cast<long long>(T), static_cast<long long>(ctx),
                    used, sp == 0 ? " (auto)" : "", us, 2.0 * T * ctx * nkv * hd * 4 / us / 1e3);
      }
    }

  // ---- fused kernels vs the sequences they replace (current kernels on both sides)
  kern::set_legacy_decode_kernels(false);
  std::printf("\nfused decode kernels vs the unfused sequence, peer model shapes (us per step in a CUDA graph, "
              "median)\n| fused kernel | T | shape | unfused us | fused us | speedup |\n|---|---|---|---|---|---|\n");
  constexpr int64_t qd = int64_t(nh) * hd, kvd = int64_t(nkv) * hd, wqkv = qd + 2 * kvd;
  auto qkv = random_device(Tmax * wqkv, 21), ye = random_device(Tmax * K * H, 22), cw = random_device(Tmax * K, 23, 0.2f);
  auto kk = random_device(Tmax * kvd, 24), vv = random_device(Tmax * kvd, 25);
  DeviceArray<uint16_t> yb(Tmax * H);
  DeviceArray<int32_t> inv(Tmax * K);
  {
    std::vector<int32_t> hi(Tmax * K);
    std::iota(hi.begin(), hi.end(), 0);
    std::shuffle(hi.begin(), hi.end(), std::mt19937_64(7));
    inv.upload(hi);
  }
  const size_t ws_bytes = kern::attention_decode_fused_workspace(Tmax, nh, nkv, hd, max_len);
  DeviceArray<unsigned char> ws(std::max<size_t>(ws_bytes, 1));
  ws.fill_bytes(0);
  for (int64_t T : {1, 16, 64}) {
    char shape[96];
    std::snprintf(shape, sizeof shape, "%d", H);
    fused_row("rmsnorm_bf16 (rmsnorm + to_bf16)", T, shape, [&](cudaStream_t st) {
      kern::rmsnorm(x.data(), w.data(), T, H, 1e-6f, y.data(), st);
      kern::to_bf16(y.data(), yb.data(), T * H, st);
    }, [&](cudaStream_t st) { kern::rmsnorm_bf16(x.data(), w.data(), T, H, 1e-6f, y.data(), yb.data(), st); }, s);
    std::snprintf(shape, sizeof shape, "k %d x %d", K, H);
    for (int threads : {0, 256, 1024}) {
      kern::set_residual_norm_threads(threads);
      char name[96];
      std::snprintf(name, sizeof name, "moe_combine_add_rmsnorm (combine + rmsnorm), %s threads",
                    threads == 0 ? "auto" : threads == 256 ? "256" : "1024");
      fused_row(name, T, shape, [&](cudaStream_t st) {
        kern::moe_combine_add(ye.data(), inv.data(), cw.data(), T, K, H, x.data(), st);
        kern::rmsnorm(x.data(), w.data(), T, H, 1e-6f, y.data(), st);
      }, [&](cudaStream_t st) {
        kern::moe_combine_add_rmsnorm(ye.data(), inv.data(), cw.data(), T, K, H, x.data(), w.data(), 1e-6f, y.data(),
                                      nullptr, st);
      }, s);
    }
    kern::set_residual_norm_threads(0);
    fused_row("moe_combine_add_rmsnorm + bf16 (combine + rmsnorm + to_bf16)", T, shape, [&](cudaStream_t st) {
      kern::moe_combine_add(ye.data(), inv.data(), cw.data(), T, K, H, x.data(), st);
      kern::rmsnorm(x.data(), w.data(), T, H, 1e-6f, y.data(), st);
      kern::to_bf16(y.data(), yb.data(), T * H, st);
    }, [&](cudaStream_t st) {
      kern::moe_combine_add_rmsnorm(ye.data(), inv.data(), cw.data(), T, K, H, x.data(), w.data(), 1e-6f, y.data(),
                                    yb.data(), st);
    }, s);
    std::snprintf(shape, sizeof shape, "%d", H);
    fused_row("add_rmsnorm (add_inplace + rmsnorm)", T, shape, [&](cudaStream_t st) {
      kern::add_inplace(x.data(), ye.data(), T * H, st);
      kern::rmsnorm(x.data(), w.data(), T, H, 1e-6f, y.data(), st);
    }, [&](cudaStream_t st) {
      kern::add_rmsnorm(x.data(), ye.data(), T, H, w.data(), 1e-6f, y.data(), nullptr, st);
    }, s);
    std::vector<int32_t> p0(Tmax, 0);
    pos.upload(p0);
    std::snprintf(shape, sizeof shape, "%d+2x%d heads x %d", nh, nkv, hd);
    fused_row("qk_norm_rope_store_qkv (split_cols3 + qk_norm_rope_store)", T, shape, [&](cudaStream_t st) {
      kern::split_cols3(qkv.data(), T, qd, kvd, kvd, q.data(), kk.data(), vv.data(), st);
      kern::qk_norm_rope_store(q.data(), kk.data(), vv.data(), qn.data(), kn.data(), 1e-6f, cs.data(), sn.data(),
                               slot.data(), pos.data(), T, nh, nkv, hd, kc.data(), vc.data(), max_len, st);
    }, [&](cudaStream_t st) {
      kern::qk_norm_rope_store_qkv(qkv.data(), wqkv, q.data(), qn.data(), kn.data(), 1e-6f, cs.data(), sn.data(),
                                   slot.data(), pos.data(), T, nh, nkv, hd, kc.data(), vc.data(), max_len, st);
    }, s);
    for (int64_t ctx : {128, 256, 512}) {
      std::vector<int32_t> pl(Tmax, static_cast<int32_t>(ctx - 1));
      pos.upload(pl);
      const int64_t bound = std::max<int64_t>(256, ctx);
      int used = 0;
      std::snprintf(shape, sizeof shape, "ctx %lld (bound %lld)", static_cast<long long>(ctx),
                    static_cast<long long>(bound));
      kern::attention_decode_split_n(q.data(), kc.data(), vc.data(), slot.data(), pos.data(), T, nh, nkv, hd,
                                     0.08838835f, max_len, bound, ao.data(), s, 0);
      used = kern::attention_decode_fused(q.data(), kc.data(), vc.data(), slot.data(), pos.data(), T, nh, nkv, hd,
                                          0.08838835f, max_len, bound, ao.data(), ws.data(), ws_bytes, s, 0);
      char name[96];
      std::snprintf(name, sizeof name, "attention_decode_fused (split + merge), %d splits", used);
      fused_row(name, T, shape, [&](cudaStream_t st) {
        kern::attention_decode_split(q.data(), kc.data(), vc.data(), slot.data(), pos.data(), T, nh, nkv, hd,
                                     0.08838835f, max_len, bound, ao.data(), st);
      }, [&](cudaStream_t st) {
        kern::attention_decode_fused(q.data(), kc.data(), vc.data(), slot.data(), pos.data(), T, nh, nkv, hd,
                                     0.08838835f, max_len, bound, ao.data(), ws.data(), ws_bytes, st, 0);
      }, s);
    }
  }
  QUADS_CUDA_CHECK(cudaStreamSynchronize(s));
  QUADS_CUDA_CHECK(cudaStreamDestroy(s));
  kern::set_legacy_decode_kernels(was);
  return 0;
}

}  // namespace quads::cuda::decode_bench
