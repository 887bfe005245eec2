#pragma once
// `bench_cuda --route`: the MoE router of a decode step of the peer model (hidden 2048, 64 experts
// top-8, renormalized) at T = 1, 16, 64 tokens: kern::router_topk_fwd + kern::moe_route (three
// kernels) against kern::router_route (one), alone and after the router's BF16 GEMM (cuBLAS, as
// GpuModel runs it), and moe_route against moe_route_one. Microseconds per call: the median over 9
// replays of a CUDA graph of 20 calls (decode_bench::graph_us). Included by bench_cuda.cpp only.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda/check.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"
#include "cuda/train_kernels.h"
#include "decode_kernels_bench.h"

namespace quads::cuda::route_bench {

inline int run() {
  constexpr int H = 2048, E = 64, K = 8;
  cudaStream_t s;
  QUADS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Blas blas;
  std::printf("\nMoE router of a decode step, peer model (H %d, E %d, top-%d); us per call in a CUDA graph, median\n",
              H, E, K);
  std::printf("| T | topk + route (3 kernels) | router_route | speedup | GEMM + 3 kernels | GEMM + router_route | "
              "speedup | moe_route | moe_route_one |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const int64_t T : {1, 16, 64}) {
    DeviceArray<float> logits = decode_bench::random_device(T * E, 11 + T, 2.f);
    DeviceArray<float> xf = decode_bench::random_device(T * H, 12 + T), wf = decode_bench::random_device(E * H, 13, 0.02f);
    DeviceArray<uint16_t> x(T * H), W(E * H);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());  // random_device fills on the default stream
    kern::to_bf16(xf.data(), x.data(), T * H, s);
    kern::to_bf16(wf.data(), W.data(), E * H, s);
    DeviceArray<float> probs(T * E), w(T * K);
    DeviceArray<int32_t> idx(T * K), counts(E), eoff(E + 1), perm(T * K), inv(T * K), bad(1);
    DeviceArray<unsigned long long> active(1);
    DeviceArray<uint32_t> ticket(1);
    bad.fill_bytes(0);
    active.fill_bytes(0);
    ticket.fill_bytes(0);
    auto unfused = [&](cudaStream_t st) {
      kern::router_topk_fwd(logits.data(), T, E, K, true, probs.data(), idx.data(), w.data(), nullptr, st);
      kern::moe_route(idx.data(), T * K, E, counts.data(), eoff.data(), perm.data(), inv.data(), active.data(),
                      bad.data(), st);
    };
    auto fused = [&](cudaStream_t st) {
      kern::router_route(logits.data(), T, E, K, true, probs.data(), idx.data(), w.data(), counts.data(), eoff.data(),
                         perm.data(), inv.data(), active.data(), bad.data(), ticket.data(), st);
    };
    auto gemm = [&](cudaStream_t st) { gemm_bf16(blas, x.data(), W.data(), logits.data(), T, E, H, st); };
    const double u = decode_bench::graph_us(unfused, s), f = decode_bench::graph_us(fused, s);
    const double gu = decode_bench::graph_us([&](cudaStream_t st) {
      gemm(st);
      unfused(st);
    }, s);
    const double gf = decode_bench::graph_us([&](cudaStream_t st) {
      gemm(st);
      fused(st);
    }, s);
    const double r0 = decode_bench::graph_us(
        [&](cudaStream_t st) {
          kern::moe_route(idx.data(), T * K, E, counts.data(), eoff.data(), perm.data(), inv.data(), active.data(),
                          bad.data(), st);
        },
        s);
    const double r1 = decode_bench::graph_us(
        [&](cudaStream_t st) {
          kern::moe_route_one(idx.data(), T * K, E, counts.data(), eoff.data(), perm.data(), inv.data(), active.data(),
                              bad.data(), st);
        },
        s);
    std::printf("| %lld | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2fx | %.2f | %.2f |\n", static_cast<long long>(T), u, f,
                u / f, gu, gf, gu / gf, r0, r1);
  }
  QUADS_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

}  // namespace quads::cuda::route_bench
