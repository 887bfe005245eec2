// GPU benchmark table for docs/cuda.md: device copy bandwidth, NVFP4 quantize / fake-quantize
// bandwidth, W4A4 GEMM (emulated) against cuBLAS BF16 and cuBLASLt FP8 at the peer model's shapes
// (Qwen3-30B-A3B: hidden 2048, moe_intermediate 768), and the decode GEMV's weight-stream rate.
// Times are CUDA-event medians over repeated batches after a warm-up; inputs are random.
// `bench_cuda --gemv`: the copy bandwidth, the decode GEMV table (GEMV vs 16-row tile) and the fused
// quantizer + GEMV table (fused vs quantize + GEMM) alone.
// `bench_cuda --fused-warm`: the fused table with weights from HBM, then with the same weights (and
// routing) every call, read from L2: what an L2 prefetch ahead of a decode GEMV could win at most.
// `bench_cuda --decode-kernels`: the decode step's small kernels, old vs new (decode_kernels_bench.h).
// `bench_cuda --skinny-trace`: phase stamps of the skinny W4A4 launches (a build with
// -DQUADS_SKINNY_TRACE; skinny_trace_table below).
// `bench_cuda --fp8`: the copy bandwidth and the FP8 table (GEMV vs W8A8 tiles vs SGEMM) alone.
// `bench_cuda --quant`: the copy bandwidth and the quantizer rows alone.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/fp8_gemm.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"
#include "cuda/quant.h"
#include "decode_kernels_bench.h"
#include "gpu_timing.h"
#include "route_bench.h"

using namespace quads;
using namespace quads::cuda;

namespace {

using bench::time_us;

std::vector<float> randn(int64_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Random device data without a host round trip of the large tensors: upload a 16M-element block
// and tile it.
template <typename T>
void fill_device(DeviceArray<T>& d, const std::vector<T>& block) {
  for (size_t off = 0; off < d.size(); off += block.size()) {
    const size_t n = std::min(block.size(), d.size() - off);
    QUADS_CUDA_CHECK(cudaMemcpy(d.data() + off, block.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
}

const char* tile_name(W4A4Tile t) {
  switch (t) {
    case W4A4Tile::M16: return "16x128";
    case W4A4Tile::M64: return "64x128";
    case W4A4Tile::M128: return "128x128";
    case W4A4Tile::Gemv: return "gemv";
    case W4A4Tile::M16W4: return "16x128/4w";
    case W4A4Tile::M16N64: return "16x64";
    case W4A4Tile::M16W4S3: return "16x128/4w/3st";
    case W4A4Tile::Skinny: return "skinny";
    case W4A4Tile::Wg128: return "wgmma 128x128";
    case W4A4Tile::Wg256: return "wgmma 128x256";
    default: return "auto";
  }
}

// One decode and one large W4A4 GEMM, for a profiler (ncu --kernel-name regex:w4a4).
int profile() {
  const int64_t N = 128 * 1536, K = 2048;
  for (int64_t M : {16, 8192}) {
    const int64_t n = M == 16 ? N : 8192;
    DeviceArray<float> w(n * K), x(M * K), y(M * n);
    fill_device(w, randn(1 << 22, 1, 0.02f));
    fill_device(x, randn(1 << 22, 2));
    num::QConfig xc = num::QConfig::nvfp4_act();
    xc.global = num::Global::PerRow;
    DeviceQTensor xq = make_qtensor(M, K, xc), wq = make_qtensor(n, K, num::QConfig::nvfp4_weight(true));
    quantize(x.data(), xq);
    quantize(w.data(), wq);
    for (int r = 0; r < 2; ++r) w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), y.data());
  }
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}

// Copies of one random weight [n, k] quantized with cfg, enough (of `bytes` each) that calls
// rotating over them read more than rotate_bytes: weights that are not in L2.
std::vector<DeviceQTensor> weight_copies(int64_t n, int64_t k, const num::QConfig& cfg, uint64_t seed, double bytes,
                                         double rotate_bytes) {
  DeviceArray<float> w(n * k);
  fill_device(w, randn(std::min<int64_t>(n * k, 1 << 22), seed, 0.02f));
  std::vector<DeviceQTensor> wq;
  const int copies = static_cast<int>(rotate_bytes / bytes) + 1;
  for (int c = 0; c < copies; ++c) {
    wq.push_back(make_qtensor(n, k, cfg));
    quantize(w.data(), wq.back());
  }
  return wq;
}

// NVFP4 expert weights [n, k] of E experts for enough layers that calls rotating over them read
// weights that are not in L2 (more than rotate_bytes), and each layer's device table.
struct ExpertLayers {
  std::vector<DeviceQTensor> wq;
  std::vector<DeviceArray<Nvfp4Weight>> tabs;
  double ebytes = 0;  // one expert's codes and scales
  int layers = 0;
};
ExpertLayers expert_layers(int64_t n, int64_t k, int E, uint64_t seed, double rotate_bytes = 150e6) {
  ExpertLayers el;
  el.ebytes = n * k * (0.5 + 1.0 / 16);
  el.layers = static_cast<int>(rotate_bytes / (E * el.ebytes)) + 1;
  DeviceArray<float> w(n * k);
  fill_device(w, randn(std::min<int64_t>(n * k, 1 << 22), seed, 0.02f));
  for (int l = 0; l < el.layers; ++l) {
    std::vector<Nvfp4Weight> tab;
    for (int e = 0; e < E; ++e) {
      el.wq.push_back(make_qtensor(n, k, num::QConfig::nvfp4_weight(true)));
      quantize(w.data(), el.wq.back());
      const Nvfp4View v = nvfp4_view(el.wq.back());
      tab.push_back({v.codes, v.scales, v.amax});
    }
    el.tabs.emplace_back();
    el.tabs.back().upload(tab);
  }
  return el;
}

// `count` group-offset sets (E + 1 entries each) of a decode batch of T tokens routed top-`active`
// of E at random; experts: the mean number of non-empty groups a set.
std::vector<std::vector<int32_t>> routed_sets(int64_t T, int E, int active, int count, std::mt19937& rng,
                                              double& experts) {
  std::vector<std::vector<int32_t>> sets;
  experts = 0;
  for (int s = 0; s < count; ++s) {
    std::vector<int32_t> cnt(E, 0);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int> perm(E);
      for (int e = 0; e < E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < active; ++j) ++cnt[perm[j]];
    }
    std::vector<int32_t> off(E + 1, 0);
    for (int e = 0; e < E; ++e) {
      off[e + 1] = off[e] + cnt[e];
      experts += cnt[e] > 0 ? 1.0 / count : 0.0;
    }
    sets.push_back(off);
  }
  return sets;
}

// A weight of the peer model; kPeerDense: its dense decode GEMMs, q/k/v fused (N = 32 x 128 +
// 2 x 4 x 128) and o_proj (K = 4096, its output accumulated into the residual stream in decode).
struct PeerShape {
  const char* name;
  int64_t n, k;
  bool residual;
};
constexpr PeerShape kPeerDense[] = {{"dense q/k/v", 5120, 2048, false}, {"dense o_proj", 2048, 4096, true}};

// M random rows of K columns quantized as decode's activations (NVFP4, amax per row).
DeviceQTensor decode_rows(int64_t M, int64_t K, uint64_t seed) {
  num::QConfig xc = num::QConfig::nvfp4_act();
  xc.global = num::Global::PerRow;
  DeviceArray<float> x(M * K);
  fill_device(x, randn(M * K, seed));
  DeviceQTensor xq = make_qtensor(M, K, xc);
  quantize(x.data(), xq);
  return xq;
}

// The dense skinny tiles' split of K (bench_cuda --dense-sweep): warps a row tile (ks) times CTAs
// a cluster (cl) at the peer model's dense shapes, for 16 / 32 / 64 rows of X, against Auto's
// choice (ks 1, cl chosen) and against the bf16 preset's cuBLAS BF16 GEMM of the same shape (its
// "% of copy" counts its own, 3.6x larger, weight bytes). Weights rotate over copies worth more
// than 150 MB (read from HBM) and stream before the previous call ends (weights_ready, as in
// decode; cuBLAS's kernels have no programmatic dependent launch).
void dense_sweep(double copy_gbs) {
  const double kRotateBytes = 150e6;
  Blas blas;
  std::printf("\n| dense skinny | weight N x K | M | ks x cl | CTAs | us | %% of copy |\n|---|---|---|---|---|---|---|\n");
  for (const PeerShape& d : kPeerDense) {
    const double wbytes = d.n * d.k * (0.5 + 1.0 / 16);
    const std::vector<DeviceQTensor> wq = weight_copies(d.n, d.k, num::QConfig::nvfp4_weight(true), 11, wbytes, kRotateBytes);
    const int copies = static_cast<int>(wq.size());
    const double bbytes = 2.0 * d.n * d.k;
    std::vector<DeviceArray<uint16_t>> wb(static_cast<size_t>(kRotateBytes / bbytes) + 1);
    {
      const std::vector<float> hw = randn(d.n * d.k, 13, 0.02f);
      std::vector<uint16_t> bw(hw.size());
      for (size_t i = 0; i < hw.size(); ++i) bw[i] = bf16(hw[i]);
      for (auto& c : wb) c.upload(bw);
    }
    for (int64_t M : {16, 32, 64}) {
      DeviceArray<float> y(M * d.n);
      const DeviceQTensor xq = decode_rows(M, d.k, 12);
      {
        const std::vector<float> hx = randn(M * d.k, 14);
        std::vector<uint16_t> bx(hx.size());
        for (size_t i = 0; i < hx.size(); ++i) bx[i] = bf16(hx[i]);
        DeviceArray<uint16_t> xb(M * d.k);
        xb.upload(bx);
        int i = 0;
        const double us = time_us([&] {
          gemm_bf16(blas, xb.data(), wb[i++ % wb.size()].data(), y.data(), M, d.n, d.k);
        });
        std::printf("| %s | %lldx%lld | %lld | bf16 cuBLAS | | %.1f | %.0f |\n", d.name, static_cast<long long>(d.n),
                    static_cast<long long>(d.k), static_cast<long long>(M), us, 100.0 * bbytes / us / 1e3 / copy_gbs);
      }
      auto run = [&](int ks, int cl) {
        W4A4Options o;
        o.weights_ready = true;
        if (ks > 0) {
          o.tile = W4A4Tile::Skinny;
          o.splits = ks;
          o.kcluster = cl;
          o.row_block = M > 32 ? 32 : 0;
        }
        int i = 0;
        char what[32], ctas[16] = "";
        std::snprintf(what, sizeof what, ks > 0 ? "%d x %d" : "auto", ks, cl);
        if (ks > 0)
          std::snprintf(ctas, sizeof ctas, "%lld", static_cast<long long>((d.n + 128 / ks - 1) / (128 / ks) * cl * (M > 32 ? (M + 31) / 32 : 1)));
        try {
          const double us = time_us([&] {
            w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i++ % copies]), y.data(), d.residual, nullptr, o);
          });
          std::printf("| %s | %lldx%lld | %lld | %s | %s | %.1f | %.0f |\n", d.name, static_cast<long long>(d.n),
                      static_cast<long long>(d.k), static_cast<long long>(M), what, ctas, us, 100.0 * wbytes / us / 1e3 / copy_gbs);
        } catch (const std::exception& e) {
          std::printf("| %s | | %lld | %s | | n/a (%s) | |\n", d.name, static_cast<long long>(M), what, e.what());
        }
      };
      run(0, 0);
      for (int ks : {1, 2, 4, 8})
        for (int cl : {1, 2, 4, 8}) run(ks, cl);
    }
  }
}

// Decode GEMV against the 16-row tile at the peer model's shapes (hidden 2048, 64 experts top-8,
// moe_intermediate 768, kPeerDense; before Part 17 this table ran q/k/v at N = 6144, not the
// peer's 5120). Every call reads weights that are not in L2: the calls rotate over copies (dense) or over layers x disjoint sets of 8 experts
// (grouped) worth more than 150 MB. GB/s counts the codes and scales of the weights read.
void gemv_table(double copy_gbs) {
  const double kRotateBytes = 150e6;
  std::printf("\n| W4A4 decode | weight N x K | M (rows per weight) | kernel | us | weight GB/s | %% of copy |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  auto print = [&](const char* what, int64_t n, int64_t k, int64_t m, const char* kern, double us, double bytes) {
    const double gbs = bytes / us / 1e3;
    std::printf("| %s | %lldx%lld | %lld | %s | %.1f | %.0f | %.0f |\n", what, static_cast<long long>(n),
                static_cast<long long>(k), static_cast<long long>(m), kern, us, gbs, 100.0 * gbs / copy_gbs);
  };
  for (const PeerShape& d : kPeerDense) {
    const double wbytes = d.n * d.k * (0.5 + 1.0 / 16);
    const std::vector<DeviceQTensor> wq = weight_copies(d.n, d.k, num::QConfig::nvfp4_weight(true), 11, wbytes, kRotateBytes);
    const int copies = static_cast<int>(wq.size());
    for (int64_t M : {1, 4, 8, 16, 32, 64}) {
      DeviceArray<float> y(M * d.n);
      const DeviceQTensor xq = decode_rows(M, d.k, 12);
      std::vector<W4A4Tile> tiles = {W4A4Tile::M16, W4A4Tile::M16W4, W4A4Tile::M16N64, W4A4Tile::M16W4S3,
                                     W4A4Tile::Auto};
      if (M <= 16) tiles.insert(tiles.begin() + 3, W4A4Tile::Gemv);
      if (M > 16) tiles.insert(tiles.begin() + 3, W4A4Tile::M64);
      if (M <= kSkinnyAutoMaxRows) tiles.insert(tiles.end() - 1, W4A4Tile::Skinny);
      for (W4A4Tile t : tiles) {
        W4A4Options o;
        o.tile = t;
        int i = 0;
        const double us = time_us([&] {
          w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i++ % copies]), y.data(), false, nullptr, o);
        });
        print(d.name, d.n, d.k, M, tile_name(t), us, wbytes);
      }
      for (int cl : {1, 2, 4, 8}) {  // the skinny tiles with K split over cl CTAs of a cluster
        if (M <= 8) break;
        W4A4Options o;
        o.tile = W4A4Tile::Skinny;
        o.kcluster = cl;
        int i = 0;
        const double us = time_us([&] {
          w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i++ % copies]), y.data(), false, nullptr, o);
        });
        const std::string what = "skinny, cluster of " + std::to_string(cl);
        print(d.name, d.n, d.k, M, what.c_str(), us, wbytes);
      }
    }
  }
  // grouped: 64 experts; M rows for each of 8 active experts (max_rows = M), and a routed decode
  // batch of T tokens (top-8 of 64 at random: 8T rows, max_rows = T)
  for (const PeerShape& g : {PeerShape{"experts gate/up", 1536, 2048, false}, PeerShape{"experts down", 2048, 768, false}}) {
    const int E = 64, active = 8;
    ExpertLayers el = expert_layers(g.n, g.k, E, 13);
    const double ebytes = el.ebytes;
    const int layers = el.layers;
    std::vector<DeviceArray<Nvfp4Weight>>& tabs = el.tabs;
    // eoff sets: sets[s] for one call; `experts` non-empty groups each
    auto run = [&](const char* what, int64_t rows, int64_t max_rows, const std::vector<std::vector<int32_t>>& sets,
                   int64_t show_m, int experts) {
      std::vector<DeviceArray<int32_t>> deoff(sets.size());
      for (size_t s = 0; s < sets.size(); ++s) deoff[s].upload(sets[s]);
      DeviceArray<float> y(rows * g.n);
      const DeviceQTensor xq = decode_rows(rows, g.k, 14);
      const int ns = static_cast<int>(sets.size());
      std::vector<W4A4Tile> tiles = {W4A4Tile::M16, W4A4Tile::M16W4, W4A4Tile::M16N64, W4A4Tile::M16W4S3,
                                     W4A4Tile::Auto};
      if (max_rows <= 16) tiles.insert(tiles.begin() + 3, W4A4Tile::Gemv);
      if (max_rows <= kSkinnyAutoMaxRows) tiles.insert(tiles.end() - 1, W4A4Tile::Skinny);
      for (W4A4Tile t : tiles) {
        int i = 0;
        const double us = time_us([&] {
          const int c = i++;
          w4a4_gemm_grouped(nvfp4_view(xq), tabs[c % layers].data(), false, g.n, E, deoff[(c / layers) % ns].data(),
                            max_rows, y.data(), nullptr, 0, t);
        });
        print(what, g.n, g.k, show_m, tile_name(t), us, experts * ebytes);
      }
      for (int ks : {2, 4}) {  // the skinny tiles with ks warps a row tile
        if (max_rows > kSkinnyAutoMaxRows) break;
        int i = 0;
        const double us = time_us([&] {
          const int c = i++;
          w4a4_gemm_grouped(nvfp4_view(xq), tabs[c % layers].data(), false, g.n, E, deoff[(c / layers) % ns].data(),
                            max_rows, y.data(), nullptr, ks, W4A4Tile::Skinny);
        });
        print(what, g.n, g.k, show_m, ks == 2 ? "skinny, 2 warps a tile" : "skinny, 4 warps a tile", us, experts * ebytes);
      }
    };
    for (int64_t M : {1, 4, 8, 16}) {
      std::vector<std::vector<int32_t>> sets;
      for (int s = 0; s < E / active; ++s) {  // experts s*8 .. s*8+7 hold M rows each
        std::vector<int32_t> off(E + 1, 0);
        for (int e = 0; e < E; ++e) off[e + 1] = off[e] + (e / active == s ? static_cast<int32_t>(M) : 0);
        sets.push_back(off);
      }
      run(g.name, active * M, M, sets, M, active);
    }
    std::mt19937 rng(7);
    for (int64_t T : {4, 16, 64}) {  // decode batches: rows per expert from a random top-8 routing
      double experts = 0;
      const std::vector<std::vector<int32_t>> sets = routed_sets(T, E, active, 8, rng, experts);
      const std::string what = std::string(g.name) + ", routed batch " + std::to_string(T);
      run(what.c_str(), active * T, T, sets, T, static_cast<int>(experts + 0.5));
    }
  }
}

// The GEMV with the activation quantizer fused into it (w4a4_gemv_fused*) against the decode
// sequence it replaces, per call at the peer model's shapes for decode batches 1, 4, 16: dense
// q/k/v (N 5120) and o_proj (K 4096, accumulating into the residual), the routed experts' gate/up
// (the MoE gather fused) and down (the SwiGLU fused). Each variant is captured as one CUDA graph
// of `calls` launches rotating over weights worth more than 150 MB (read from HBM, as in decode),
// and us is the median graph time / calls, so launch gaps count as they do in the decode graph.
// Paths: "gemv only" (X already quantized: the floor), "quantize + auto" and "+ gemv" / "+ 16x128/4w"
// (the unfused sequences: gather_rows / swiglu, quantize(), the GEMM; GemvTileLoop::Auto), "fused",
// and "fused early" (dense, FusedAct::weights_ready: the weight stream starts before the previous
// kernel ends); "gemv only" and "fused" with the tile loop Off, ", tile loop" with it On.
// warm (`--fused-warm`): the same weights and routing every call (read from L2 after the first):
// what an L2 prefetch ahead of a call could win at most.
void fused_table(double copy_gbs, bool warm = false) {
  const double kRotateBytes = warm ? 0.0 : 150e6;
  if (warm) std::printf("\nweights warm in L2 (one copy, one routing)\n");
  std::printf("\n| W4A4 decode, fused quantizer | weight N x K | batch | path | us per call | weight GB/s | %% of copy |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  auto print = [&](const char* what, int64_t n, int64_t k, int64_t m, const char* path, double us, double bytes) {
    const double gbs = bytes / us / 1e3;
    std::printf("| %s | %lldx%lld | %lld | %s | %.2f | %.0f | %.0f |\n", what, static_cast<long long>(n),
                static_cast<long long>(k), static_cast<long long>(m), path, us, gbs, 100.0 * gbs / copy_gbs);
  };
  cudaStream_t st;  // blocking: time_us's events on the legacy stream order around it
  QUADS_CUDA_CHECK(cudaStreamCreate(&st));
  const int calls = 24;
  auto graph_us = [&](const std::function<void(int)>& body) {
    for (int i = 0; i < 2; ++i) body(i);  // one-time setup (shared-memory opt-ins) outside the capture
    QUADS_CUDA_CHECK(cudaStreamSynchronize(st));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    QUADS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) body(i);
    QUADS_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    QUADS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    const double us = time_us([&] { QUADS_CUDA_CHECK(cudaGraphLaunch(ge, st)); }) / calls;
    QUADS_CUDA_CHECK(cudaGraphExecDestroy(ge));
    QUADS_CUDA_CHECK(cudaGraphDestroy(g));
    return us;
  };
  num::QConfig xc = num::QConfig::nvfp4_act();
  xc.global = num::Global::PerRow;
  W4A4Options gemv_opt;
  gemv_opt.tile = W4A4Tile::Gemv;

  for (const PeerShape& d : kPeerDense) {
    const std::string name = std::string(d.name) + (d.residual ? " (+= residual)" : "");
    const double wbytes = d.n * d.k * (0.5 + 1.0 / 16);
    const std::vector<DeviceQTensor> wq = weight_copies(d.n, d.k, num::QConfig::nvfp4_weight(true), 21, wbytes, kRotateBytes);
    const int copies = static_cast<int>(wq.size());
    for (int64_t M : {1, 4, 16}) {
      DeviceArray<float> x(M * d.k), y(M * d.n);
      fill_device(x, randn(M * d.k, 22));
      y.fill_bytes(0);
      DeviceQTensor xq = make_qtensor(M, d.k, xc);
      quantize(x.data(), xq, st);
      for (bool loop : {false, true}) {
        set_gemv_tile_loop(loop ? GemvTileLoop::On : GemvTileLoop::Off);
        const double us = graph_us([&](int i) {
          w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i % copies]), y.data(), d.residual, st, gemv_opt);
        });
        print(name.c_str(), d.n, d.k, M, loop ? "gemv only, tile loop" : "gemv only", us, wbytes);
      }
      set_gemv_tile_loop(GemvTileLoop::Auto);
      const double us_auto = graph_us([&](int i) {
        quantize(x.data(), xq, st);
        w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i % copies]), y.data(), d.residual, st);
      });
      print(name.c_str(), d.n, d.k, M,
            M <= kGemvAutoMaxRows      ? "quantize + auto (gemv)"
            : M <= kSkinnyDenseMaxRows ? "quantize + auto (skinny)"
                                       : "quantize + auto (16x128/4w)",
            us_auto, wbytes);
      if (M > kGemvAutoMaxRows) {
        const double us = graph_us([&](int i) {
          quantize(x.data(), xq, st);
          w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i % copies]), y.data(), d.residual, st, gemv_opt);
        });
        print(name.c_str(), d.n, d.k, M, "quantize + gemv", us, wbytes);
      }
      for (int v = 0; v < 3; ++v) {  // fused, early, early + tile loop
        const bool early = v > 0;
        set_gemv_tile_loop(v == 2 ? GemvTileLoop::On : GemvTileLoop::Off);
        FusedAct a;
        a.x = x.data();
        a.ld = d.k;
        a.rows = M;
        a.k = d.k;
        a.cfg = xc;
        a.weights_ready = early;
        const double us = graph_us([&](int i) { w4a4_gemv_fused(a, nvfp4_view(wq[i % copies]), y.data(), d.residual, st); });
        print(name.c_str(), d.n, d.k, M, v == 0 ? "fused" : v == 1 ? "fused early" : "fused early, tile loop", us, wbytes);
      }
      set_gemv_tile_loop(GemvTileLoop::Auto);
    }
  }

  // routed experts: 64, top-8 at random; 8 routings rotate with the weight layers
  for (const PeerShape& g : {PeerShape{"experts gate/up (gather)", 1536, 2048, false},
                             PeerShape{"experts down (swiglu)", 2048, 768, false}}) {
    const int E = 64, topk = 8;
    const bool swiglu = g.k == 768;
    ExpertLayers el = expert_layers(g.n, g.k, E, 23, kRotateBytes);
    const double ebytes = el.ebytes;
    const int layers = el.layers;
    std::vector<DeviceArray<Nvfp4Weight>>& tabs = el.tabs;
    std::mt19937 rng(29);
    for (int64_t T : {1, 4, 16}) {
      const int64_t R = T * topk;
      const int ns = warm ? 1 : 8;
      std::vector<DeviceArray<int32_t>> deoff(ns), dperm(ns);
      double experts = 0;
      for (int s = 0; s < ns; ++s) {
        std::vector<std::vector<int32_t>> rows(E);
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int> perm(E);
          for (int e = 0; e < E; ++e) perm[e] = e;
          std::shuffle(perm.begin(), perm.end(), rng);
          for (int j = 0; j < topk; ++j) rows[perm[j]].push_back(static_cast<int32_t>(t * topk + j));
        }
        std::vector<int32_t> off(E + 1, 0), pm;
        for (int e = 0; e < E; ++e) {
          off[e + 1] = off[e] + static_cast<int32_t>(rows[e].size());
          pm.insert(pm.end(), rows[e].begin(), rows[e].end());
          experts += rows[e].empty() ? 0.0 : 1.0 / ns;
        }
        deoff[s].upload(off);
        dperm[s].upload(pm);
      }
      const double bytes = experts * ebytes;
      // sources: normed hidden rows [T, K] (gather), or the gate/up product [R, 2K] (swiglu)
      DeviceArray<float> src(swiglu ? R * 2 * g.k : T * g.k), xe(R * g.k), y(R * g.n);
      fill_device(src, randn(std::min<int64_t>(static_cast<int64_t>(src.size()), 1 << 22), 24));
      DeviceQTensor xq = make_qtensor(R, g.k, xc);
      auto prologue = [&](int s) {  // the unfused X: kern::gather_rows or kern::swiglu, then quantize()
        if (swiglu) kern::swiglu(src.data(), src.data() + g.k, 2 * g.k, R, g.k, xe.data(), st);
        else kern::gather_rows(src.data(), dperm[s].data(), R, topk, g.k, xe.data(), st);
        quantize(xe.data(), xq, st);
      };
      prologue(0);
      for (bool loop : {false, true}) {
        set_gemv_tile_loop(loop ? GemvTileLoop::On : GemvTileLoop::Off);
        const double us = graph_us([&](int i) {
          w4a4_gemm_grouped(nvfp4_view(xq), tabs[i % layers].data(), false, g.n, E, deoff[(i / layers) % ns].data(), T,
                            y.data(), st, 0, W4A4Tile::Gemv);
        });
        print(g.name, g.n, g.k, T, loop ? "gemv only, tile loop" : "gemv only", us, bytes);
      }
      set_gemv_tile_loop(GemvTileLoop::Auto);
      for (W4A4Tile t : {W4A4Tile::Auto, W4A4Tile::Gemv, W4A4Tile::M16W4}) {
        const double us = graph_us([&](int i) {
          const int s = (i / layers) % ns;
          prologue(s);
          w4a4_gemm_grouped(nvfp4_view(xq), tabs[i % layers].data(), false, g.n, E, deoff[s].data(), T, y.data(), st,
                            0, t);
        });
        const std::string path = std::string(swiglu ? "swiglu + " : "gather + ") + "quantize + " +
                                 (t == W4A4Tile::Auto ? (gemv_auto_grouped(T, g.k)     ? "auto (gemv)"
                                                         : T <= kSkinnyAutoMaxRows ? "auto (skinny)"
                                                                                   : "auto (16x128/4w)")
                                                      : tile_name(t));
        print(g.name, g.n, g.k, T, path.c_str(), us, bytes);
      }
      for (bool loop : {false, true}) {
        set_gemv_tile_loop(loop ? GemvTileLoop::On : GemvTileLoop::Off);
        const double us_fused = graph_us([&](int i) {
          const int s = (i / layers) % ns;
          FusedAct a;
          a.x = src.data();
          a.rows = R;
          a.k = g.k;
          a.cfg = xc;
          if (swiglu) {
            a.u = src.data() + g.k;
            a.ld = 2 * g.k;
          } else {
            a.ld = g.k;
            a.map = dperm[s].data();
            a.map_div = topk;
          }
          w4a4_gemv_fused_grouped(a, tabs[i % layers].data(), false, g.n, E, deoff[s].data(), T, y.data(), st);
        });
        print(g.name, g.n, g.k, T, loop ? "fused, tile loop" : "fused", us_fused, bytes);
      }
      set_gemv_tile_loop(GemvTileLoop::Auto);
    }
  }
  QUADS_CUDA_CHECK(cudaStreamDestroy(st));
}

// FP8 (E4M3, the `fp8` preset: 128x128 weight blocks, 1x128 activation blocks) at the peer
// model's shapes: the CUDA-core GEMV on X_eff against the W8A8 tensor-core tiles on codes, and
// (dense) W_eff dequantized + cuBLAS SGEMM, the old prefill path. Experts: 64, top-8 routed at
// random, one grouped call per projection; calls rotate over weights worth more than 150 MB so
// that they are read from HBM. GB/s counts weight codes + scales.
void fp8_table(double copy_gbs) {
  const double kRotateBytes = 150e6;
  const num::QConfig wc = num::QConfig::fp8(num::Block::B128x128), xc = num::QConfig::fp8(num::Block::B1x128);
  std::printf("\n| FP8 W8A8 | weight N x K | rows (tokens) | kernel | us | weight GB/s | %% of copy | TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  auto print = [&](const char* what, int64_t n, int64_t k, int64_t m, const char* kern, double us, double bytes,
                   double flop) {
    const double gbs = bytes / us / 1e3;
    std::printf("| %s | %lldx%lld | %lld | %s | %.1f | %.0f | %.0f | %.1f |\n", what, static_cast<long long>(n),
                static_cast<long long>(k), static_cast<long long>(m), kern, us, gbs, 100.0 * gbs / copy_gbs,
                flop / us / 1e6);
  };
  cublasHandle_t cublas = nullptr;
  QUADS_CUBLAS_CHECK(cublasCreate(&cublas));
  QUADS_CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));  // FP32, no TF32 (as the model)
  struct S {
    const char* name;
    int64_t n, k;
  };
  for (const S& d : {S{"dense q_proj", 4096, 2048}, S{"dense o_proj", 2048, 4096}}) {
    const double wbytes = double(d.n) * d.k;
    const std::vector<DeviceQTensor> wq = weight_copies(d.n, d.k, wc, 21, wbytes, kRotateBytes);
    const int copies = static_cast<int>(wq.size());
    DeviceArray<float> wdq(d.n * d.k);
    const Fp8Layout g = fp8_layout(wc, d.n, d.k);
    for (int64_t M : {1, 2, 4, 8, 16, 64, 1024, 8192}) {
      DeviceArray<float> x(M * d.k), y(M * d.n);
      fill_device(x, randn(std::min<int64_t>(M * d.k, 1 << 22), 22));
      DeviceQTensor xq = make_qtensor(M, d.k, xc);
      quantize(x.data(), xq);
      dequantize(xq, x.data());
      const Fp8Act a = fp8_act(xq);
      const double flop = 2.0 * M * d.n * d.k;
      int i = 0;
      if (M <= 16) {
        const double us = time_us([&] { fp8_gemv(x.data(), M, fp8_weight(wq[i++ % copies]), g, y.data()); });
        print(d.name, d.n, d.k, M, "gemv", us, wbytes, flop);
      }
      const double ut = time_us([&] { fp8_gemm(a, fp8_weight(wq[i++ % copies]), g, y.data()); });
      print(d.name, d.n, d.k, M, "tiles", ut, wbytes, flop);
      if (M >= 16) {
        const double us = time_us([&] {
          fp8_dequantize(fp8_weight(wq[i++ % copies]), g, wdq.data());
          const float alpha = 1.f, beta = 0.f;
          QUADS_CUBLAS_CHECK(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(d.n),
                                         static_cast<int>(M), static_cast<int>(d.k), &alpha, wdq.data(),
                                         static_cast<int>(d.k), x.data(), static_cast<int>(d.k), &beta, y.data(),
                                         static_cast<int>(d.n)));
        });
        print(d.name, d.n, d.k, M, "dequant+SGEMM", us, wbytes, flop);
      }
    }
  }
  for (const S& g : {S{"experts gate", 768, 2048}, S{"experts down", 2048, 768}}) {
    const int E = 64, active = 8;
    const double ebytes = double(g.n) * g.k;
    const int layers = static_cast<int>(kRotateBytes / (E * ebytes)) + 1;
    DeviceArray<float> w(g.n * g.k);
    fill_device(w, randn(std::min<int64_t>(g.n * g.k, 1 << 22), 23, 0.02f));
    std::vector<DeviceQTensor> wq;
    std::vector<DeviceArray<Fp8Weight>> tabs;
    for (int l = 0; l < layers; ++l) {
      std::vector<Fp8Weight> tab;
      for (int e = 0; e < E; ++e) {
        wq.push_back(make_qtensor(g.n, g.k, wc));
        quantize(w.data(), wq.back());
        tab.push_back(fp8_weight(wq.back()));
      }
      tabs.emplace_back();
      tabs.back().upload(tab);
    }
    const Fp8Layout lay = fp8_layout(wc, g.n, g.k);
    std::mt19937 rng(9);
    for (int64_t T : {1, 2, 4, 8, 16, 32, 64, 1024, 16384}) {  // random top-8 routing of T tokens
      double experts = 0;
      const std::vector<std::vector<int32_t>> sets = routed_sets(T, E, active, T >= 1024 ? 1 : 8, rng, experts);
      std::vector<DeviceArray<int32_t>> deoff(sets.size());
      for (size_t s = 0; s < sets.size(); ++s) deoff[s].upload(sets[s]);
      const int64_t rows = active * T;
      DeviceArray<float> x(rows * g.k), y(rows * g.n);
      fill_device(x, randn(std::min<int64_t>(rows * g.k, 1 << 22), 24));
      DeviceQTensor xq = make_qtensor(rows, g.k, xc);
      quantize(x.data(), xq);
      dequantize(xq, x.data());
      const Fp8Act a = fp8_act(xq);
      const int ns = static_cast<int>(sets.size());
      const double flop = 2.0 * rows * g.n * g.k, bytes = experts * ebytes;
      const std::string what = std::string(g.name) + ", routed";
      int i = 0;
      if (T <= 64) {
        const double us = time_us([&] {
          const int c = i++;
          fp8_gemv_grouped(x.data(), tabs[c % layers].data(), lay, E, deoff[(c / layers) % ns].data(), T, y.data());
        });
        print(what.c_str(), g.n, g.k, T, "grouped gemv", us, bytes, flop);
      }
      const double ut = time_us([&] {
        const int c = i++;
        fp8_gemm_grouped(a, tabs[c % layers].data(), lay, E, deoff[(c / layers) % ns].data(), T, y.data());
      });
      print(what.c_str(), g.n, g.k, T, "grouped tiles", ut, bytes, flop);
    }
  }
  cublasDestroy(cublas);
}

}  // namespace

// `bench_cuda --skinny-trace` (quads_cuda built with -DQUADS_SKINNY_TRACE in CMAKE_CUDA_FLAGS):
// where the time of one skinny W4A4 launch goes, at the peer model's decode shapes. Each case runs
// 20 launches back to back in a stream (PDL: a launch's CTAs may start before the one before it
// ends); the stamps are the last launch's. Times in us from the first CTA's release from the PDL
// wait (t0): CTAs' entry (negative: started under the previous launch) and end, p50 / max; then
// the median and the max over CTAs of each phase in SM cycles (wait -> X copied -> X dequantized ->
// the last warp's K loop done -> sums added -> stored).
int skinny_trace_table() {
  const int slots = skinny_trace_slots();
  const int64_t max_ctas = 1 << 16;
  DeviceArray<unsigned long long> buf(max_ctas * slots);
  if (!skinny_trace(buf.data())) {
    std::printf("--skinny-trace: quads_cuda was built without -DQUADS_SKINNY_TRACE in CMAKE_CUDA_FLAGS\n");
    skinny_trace(nullptr);
    return 1;
  }
  int clock_khz = 0;
  QUADS_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::printf("SM clock %.2f GHz (cycles below)\n\n", clock_khz / 1e6);
  std::printf("| call | rows | CTAs (SMs, max a SM) | entry p50 / min us | wait released p50 / max us | end p50 / max us "
              "| X copy cyc p50 / max | X deq | K loop | sums | store |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto report = [&](const std::string& what, int64_t rows, const std::function<void(int)>& launch) {
    QUADS_CUDA_CHECK(cudaMemset(buf.data(), 0, buf.bytes()));
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < 20; ++i) launch(i);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<unsigned long long> h(static_cast<size_t>(max_ctas) * slots);
    QUADS_CUDA_CHECK(cudaMemcpy(h.data(), buf.data(), buf.bytes(), cudaMemcpyDeviceToHost));
    std::vector<const unsigned long long*> cta;
    for (int64_t c = 0; c < max_ctas; ++c)
      if (h[c * slots + 9] != 0) cta.push_back(&h[c * slots]);
    if (cta.empty()) {
      std::printf("| %s | %lld | no CTA stamped |\n", what.c_str(), static_cast<long long>(rows));
      return;
    }
    unsigned long long t0 = ~0ull;
    std::vector<int> per_sm(1024, 0);
    for (auto* c : cta) {
      t0 = std::min(t0, c[1]);
      ++per_sm[std::min<unsigned long long>(c[10], 1023)];
    }
    int sms = 0, max_sm = 0;
    for (int n : per_sm) sms += n > 0, max_sm = std::max(max_sm, n);
    auto pct = [](std::vector<double> v, double q) {
      std::sort(v.begin(), v.end());
      return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
    };
    auto us_of = [&](int slot) {
      std::vector<double> v;
      for (auto* c : cta) v.push_back((static_cast<double>(c[slot]) - static_cast<double>(t0)) / 1e3);
      return v;
    };
    auto cyc_of = [&](int from, int to) {
      std::vector<double> v;
      for (auto* c : cta) v.push_back(c[to] >= c[from] ? static_cast<double>(c[to] - c[from]) : 0.0);
      return v;
    };
    const std::vector<double> entry = us_of(0), rel = us_of(1), end = us_of(9);
    std::printf("| %s | %lld | %zu (%d, %d) | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |", what.c_str(),
                static_cast<long long>(rows), cta.size(), sms, max_sm, pct(entry, 0.5), pct(entry, 0.0),
                pct(rel, 0.5), pct(rel, 1.0), pct(end, 0.5), pct(end, 1.0));
    for (auto [a, b] : {std::pair{3, 4}, {4, 5}, {5, 6}, {6, 7}, {7, 8}}) {
      const std::vector<double> v = cyc_of(a, b);
      std::printf(" %.0f / %.0f |", pct(v, 0.5), pct(v, 1.0));
    }
    std::printf("\n");
  };
  num::QConfig xc = num::QConfig::nvfp4_act();
  xc.global = num::Global::PerRow;
  for (const PeerShape& d : kPeerDense) {
    const double wbytes = d.n * d.k * (0.5 + 1.0 / 16);
    const std::vector<DeviceQTensor> wq = weight_copies(d.n, d.k, num::QConfig::nvfp4_weight(true), 11, wbytes, 150e6);
    const int copies = static_cast<int>(wq.size());
    for (int64_t M : {4, 16, 64}) {
      DeviceArray<float> x(M * d.k), y(M * d.n);
      fill_device(x, randn(M * d.k, 12));
      DeviceQTensor xq = make_qtensor(M, d.k, xc);
      quantize(x.data(), xq);
      for (bool early : {false, true}) {
        W4A4Options o;
        o.tile = W4A4Tile::Skinny;
        o.weights_ready = early;
        report(std::string(d.name) + (early ? ", weights early" : ""), M, [&](int i) {
          w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq[i % copies]), y.data(), false, nullptr, o);
        });
      }
    }
  }
  std::mt19937 rng(7);
  for (const PeerShape& g : {PeerShape{"experts gate/up", 1536, 2048, false}, PeerShape{"experts down", 2048, 768, false}}) {
    const int E = 64, active = 8;
    ExpertLayers el = expert_layers(g.n, g.k, E, 13);
    for (int64_t T : {4, 16, 64}) {
      double experts = 0;
      const std::vector<std::vector<int32_t>> sets = routed_sets(T, E, active, 1, rng, experts);
      DeviceArray<int32_t> deoff;
      deoff.upload(sets[0]);
      const int64_t rows = active * T;
      DeviceArray<float> x(rows * g.k), y(rows * g.n);
      fill_device(x, randn(rows * g.k, 14));
      DeviceQTensor xq = make_qtensor(rows, g.k, xc);
      quantize(x.data(), xq);
      report(std::string(g.name) + ", routed batch " + std::to_string(T) + " (" +
                 std::to_string(static_cast<int>(experts + 0.5)) + " experts)",
             rows, [&](int i) {
               w4a4_gemm_grouped(nvfp4_view(xq), el.tabs[i % el.layers].data(), false, g.n, E, deoff.data(), T,
                                 y.data(), nullptr, 0, W4A4Tile::Skinny);
             });
    }
  }
  skinny_trace(nullptr);
  return 0;
}

// GEMMs at the peer model's shapes (the W4A4 emulation's tile Auto takes there, against cuBLAS BF16
// and FP8), then the large-M tiles side by side: the expert shapes at prefill sizes and a square
// GEMM (the emulation's compute ceiling).
void gemm_table() {
  Blas blas;
  std::printf("\n| GEMM Y=X.W^T | M | N | K | W4A4 emul us | TFLOP/s | BF16 cuBLAS us | TFLOP/s | FP8 cuBLASLt us | TFLOP/s | W4A4/BF16 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct G {
    const char* name;
    int64_t n, k;
  };
  for (const G& g : {G{"expert gate/up", 1536, 2048}, G{"expert down", 2048, 768}}) {
    for (int64_t M : {1, 16, 64, 1024, 8192}) {
      const int64_t N = g.n, K = g.k;
      DeviceArray<float> x(M * K), w(N * K), y(M * N);
      fill_device(x, randn(std::min<int64_t>(M * K, 1 << 22), 3));
      fill_device(w, randn(std::min<int64_t>(N * K, 1 << 22), 4, 0.02f));
      num::QConfig xc = num::QConfig::nvfp4_act();
      xc.global = num::Global::PerRow;
      DeviceQTensor xq = make_qtensor(M, K, xc), wq = make_qtensor(N, K, num::QConfig::nvfp4_weight(true));
      quantize(x.data(), xq);
      quantize(w.data(), wq);
      const double flop = 2.0 * M * N * K;
      const double t4 = time_us([&] { w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), y.data()); });
      DeviceArray<uint16_t> xb(M * K), wb(N * K);
      {
        std::vector<float> hx = randn(M * K, 5), hw = randn(N * K, 6, 0.02f);
        std::vector<uint16_t> bx(hx.size()), bw(hw.size());
        for (size_t i = 0; i < hx.size(); ++i) bx[i] = bf16(hx[i]);
        for (size_t i = 0; i < hw.size(); ++i) bw[i] = bf16(hw[i]);
        xb.upload(bx);
        wb.upload(bw);
      }
      const double tb = time_us([&] { gemm_bf16(blas, xb.data(), wb.data(), y.data(), M, N, K); });
      DeviceQTensor x8 = make_qtensor(M, K, num::QConfig::fp8(num::Block::PerTensor));
      DeviceQTensor w8 = make_qtensor(N, K, num::QConfig::fp8(num::Block::PerTensor));
      quantize(x.data(), x8);
      quantize(w.data(), w8);
      double t8 = -1;
      try {
        t8 = time_us([&] { gemm_fp8(blas, x8.codes.data(), x8.fscales.data(), w8.codes.data(), w8.fscales.data(), y.data(), M, N, K); });
      } catch (const Error& e) {
        std::fprintf(stderr, "fp8: %s\n", e.what());
      }
      std::printf("| %s | %lld | %lld | %lld | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f |\n", g.name,
                  static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), t4, flop / t4 / 1e6,
                  tb, flop / tb / 1e6, t8, t8 > 0 ? flop / t8 / 1e6 : 0.0, tb / t4);
    }
  }

  // large square-ish GEMM: the emulation's compute ceiling
  {
    const int64_t M = 8192, N = 8192, K = 8192;
    DeviceArray<float> x(M * K), y(M * N);
    fill_device(x, randn(1 << 22, 7));
    num::QConfig xc = num::QConfig::nvfp4_act();
    xc.global = num::Global::PerRow;
    DeviceQTensor xq = make_qtensor(M, K, xc), wq = make_qtensor(N, K, num::QConfig::nvfp4_weight(true));
    quantize(x.data(), xq);
    quantize(x.data(), wq);
    x.reset();
    const double flop = 2.0 * M * N * K;
    std::vector<W4A4Tile> sq = {W4A4Tile::M128, W4A4Tile::M64};
    if (w4a4_wgmma_available()) sq.insert(sq.end(), {W4A4Tile::Wg128, W4A4Tile::Wg256});
    for (W4A4Tile t : sq) {
      W4A4Options o;
      o.tile = t;
      const double us = time_us([&] { w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), y.data(), false, nullptr, o); }, 5);
      std::printf("| square, tile %s | %lld | %lld | %lld | %.1f | %.1f | | | | | |\n", tile_name(t),
                  static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), us, flop / us / 1e6);
    }
    DeviceArray<uint16_t> xb(M * K);
    std::vector<uint16_t> bb(1 << 22);
    const std::vector<float> r = randn(1 << 22, 8);
    for (size_t i = 0; i < bb.size(); ++i) bb[i] = bf16(r[i]);
    fill_device(xb, bb);
    const double tb = time_us([&] { gemm_bf16(blas, xb.data(), xb.data(), y.data(), M, N, K); }, 5);
    std::printf("| square, cuBLAS BF16 | %lld | %lld | %lld | | | %.1f | %.1f | | | |\n", static_cast<long long>(M),
                static_cast<long long>(N), static_cast<long long>(K), tb, flop / tb / 1e6);
  }

  std::printf("\n| W4A4 tile (many rows) | M | N | K | us | TFLOP/s |\n|---|---|---|---|---|---|\n");
  std::vector<W4A4Tile> big = {W4A4Tile::M128};
  if (w4a4_wgmma_available()) big.insert(big.end(), {W4A4Tile::Wg128, W4A4Tile::Wg256});
  struct S {
    int64_t m, n, k;
  };
  for (const S& g : {S{2048, 1536, 2048}, S{2048, 2048, 768}, S{16384, 5120, 2048}, S{16384, 2048, 4096}}) {
    DeviceArray<float> x(g.m * g.k), w(g.n * g.k), y(g.m * g.n);
    fill_device(x, randn(std::min<int64_t>(g.m * g.k, 1 << 22), 11));
    fill_device(w, randn(std::min<int64_t>(g.n * g.k, 1 << 22), 12, 0.02f));
    num::QConfig xc = num::QConfig::nvfp4_act();
    xc.global = num::Global::PerRow;
    DeviceQTensor xq = make_qtensor(g.m, g.k, xc), wq = make_qtensor(g.n, g.k, num::QConfig::nvfp4_weight(true));
    quantize(x.data(), xq);
    quantize(w.data(), wq);
    for (W4A4Tile t : big) {
      W4A4Options o;
      o.tile = t;
      const double us = time_us([&] { w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), y.data(), false, nullptr, o); });
      std::printf("| %s | %lld | %lld | %lld | %.1f | %.1f |\n", tile_name(t), static_cast<long long>(g.m),
                  static_cast<long long>(g.n), static_cast<long long>(g.k), us, 2.0 * g.m * g.n * g.k / us / 1e6);
    }
  }
}

int main(int argc, char** argv) {
  if (device_count() == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--profile") return profile();
  if (argc > 1 && std::string(argv[1]) == "--decode-kernels") return decode_bench::run();  // decode_kernels_bench.h
  if (argc > 1 && std::string(argv[1]) == "--route") return route_bench::run();  // route_bench.h
  if (argc > 1 && std::string(argv[1]) == "--skinny-trace") return skinny_trace_table();
  cudaDeviceProp prop{};
  QUADS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);

  // ---- bandwidth ----
  int64_t R = 16384, C = 8192;  // 134M elements: 512 MB float32
  DeviceArray<float> src(R * C), dst(R * C);
  const std::vector<float> blk = randn(1 << 24, 1);
  fill_device(src, blk);
  const double copy_us = time_us([&] { QUADS_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * src.bytes() / copy_us / 1e3;
  std::printf("| kernel | shape | us | GB/s | %% of copy |\n|---|---|---|---|---|\n");
  std::printf("| device copy (read+write) | %lld MB | %.1f | %.0f | 100 |\n", static_cast<long long>(src.bytes() >> 20), copy_us, copy_gbs);
  if (argc > 1 && std::string(argv[1]) == "--gemv") {  // the decode GEMV table alone
    src.reset();
    dst.reset();
    gemv_table(copy_gbs);
    fused_table(copy_gbs);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--fused-warm") {  // the fused table from HBM and warm in L2
    src.reset();
    dst.reset();
    fused_table(copy_gbs);
    fused_table(copy_gbs, true);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--dense-sweep") {
    src.reset();
    dst.reset();
    dense_sweep(copy_gbs);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--gemm") {  // the GEMM tables alone
    src.reset();
    dst.reset();
    gemm_table();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--fp8") {  // the FP8 GEMV / tile table alone
    src.reset();
    dst.reset();
    fp8_table(copy_gbs);
    return 0;
  }

  DeviceArray<uint16_t> srcb(R * C), dstb(R * C);
  {
    std::vector<uint16_t> bb(blk.size());
    for (size_t i = 0; i < blk.size(); ++i) bb[i] = bf16(blk[i]);
    fill_device(srcb, bb);
  }
  auto row = [&](const std::string& name, double us, double bytes) {
    const double gbs = bytes / us / 1e3;
    std::printf("| %s | %lldx%lld | %.1f | %.0f | %.0f |\n", name.c_str(), static_cast<long long>(R),
                static_cast<long long>(C), us, gbs, 100.0 * gbs / copy_gbs);
  };
  // activations [tokens, hidden 2048] first (the rollout's case), then long rows (a CTA a row with
  // a per-row amax; a tensor amax is a pass of its own before the row kernel's)
  for (int64_t cols : {2048, 8192}) {
    C = cols;
    R = 16384 * 8192 / cols;
    const double codes_b = R * C / 2.0, scales_b = R * C / 16.0;
    for (num::Global g : {num::Global::PerRow, num::Global::PerTensor}) {
      num::QConfig cfg = num::QConfig::nvfp4_act();
      cfg.global = g;
      const std::string gname = g == num::Global::PerRow ? "per-row" : "per-tensor";
      DeviceQTensor q = make_qtensor(R, C, cfg);
      row("nvfp4 quantize f32, " + gname, time_us([&] { quantize(src.data(), q); }), 4.0 * R * C + codes_b + scales_b);
      row("nvfp4 quantize bf16, " + gname, time_us([&] { quantize_bf16(srcb.data(), q); }), 2.0 * R * C + codes_b + scales_b);
      row("nvfp4 fake-quant f32, " + gname,
          time_us([&] { fake_quantize(src.data(), dst.data(), R, C, cfg, nullptr, q.amax.data()); }), 8.0 * R * C);
      row("nvfp4 fake-quant bf16, " + gname,
          time_us([&] { fake_quantize_bf16(srcb.data(), dstb.data(), R, C, cfg, nullptr, q.amax.data()); }), 4.0 * R * C);
    }
    if (cols != 2048) continue;
    DeviceQTensor q = make_qtensor(R, C, num::QConfig::nvfp4_weight(true));
    row("nvfp4 quantize f32, 16x16 (weights)", time_us([&] { quantize(src.data(), q); }), 4.0 * R * C + codes_b + scales_b);
    row("nvfp4 dequantize -> f32", time_us([&] { dequantize(q, dst.data()); }), 4.0 * R * C + codes_b + scales_b);
    DeviceQTensor m = make_qtensor(R, C, num::QConfig::mxfp4());
    row("mxfp4 quantize f32", time_us([&] { quantize(src.data(), m); }), 4.0 * R * C + codes_b + scales_b / 2);
    DeviceQTensor f8 = make_qtensor(R, C, num::QConfig::fp8(num::Block::PerRow));
    row("fp8 quantize f32, per-row", time_us([&] { quantize(src.data(), f8); }), 5.0 * R * C);
  }
  if (argc > 1 && std::string(argv[1]) == "--quant") return 0;  // the quantizer rows alone
  src.reset();
  dst.reset();
  srcb.reset();
  dstb.reset();

  gemm_table();

  // ---- decode: weight streaming ----
  // All 128 experts' gate/up weights stacked (N = 128 * 1536, K = 2048: 201 MB of codes + 25 MB of
  // scales, over three times the L2), M tokens against all of them.
  std::printf("\n| decode GEMV (weight stream) | M | N | K | us | weight GB/s | %% of copy |\n|---|---|---|---|---|---|---|\n");
  {
    const int64_t N = 128 * 1536, K = 2048;
    DeviceArray<float> w(N * K);
    fill_device(w, randn(1 << 24, 9, 0.02f));
    DeviceQTensor wq = make_qtensor(N, K, num::QConfig::nvfp4_weight(true));
    quantize(w.data(), wq);
    w.reset();
    const double wbytes = N * K / 2.0 + N * K / 16.0;
    for (int64_t M : {1, 4, 16, 32, 64}) {
      DeviceArray<float> x(M * K), y(M * N);
      fill_device(x, randn(M * K, 10));
      num::QConfig xc = num::QConfig::nvfp4_act();
      xc.global = num::Global::PerRow;
      DeviceQTensor xq = make_qtensor(M, K, xc);
      quantize(x.data(), xq);
      std::vector<W4A4Tile> tiles = {W4A4Tile::Auto};
      if (M > 32) tiles.push_back(W4A4Tile::M16);
      for (W4A4Tile t : tiles) {
        W4A4Options o;
        o.tile = t;
        const double us = time_us([&] { w4a4_gemm_emulated(nvfp4_view(xq), nvfp4_view(wq), y.data(), false, nullptr, o); }, 7);
        const double gbs = wbytes / us / 1e3;
        std::printf("| W4A4 emulated, tile %s | %lld | %lld | %lld | %.1f | %.0f | %.0f |\n", tile_name(t),
                    static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), us, gbs,
                    100.0 * gbs / copy_gbs);
      }
    }
  }
  gemv_table(copy_gbs);
  fp8_table(copy_gbs);
  return 0;
}
