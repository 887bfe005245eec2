// Google Benchmark twin of `quads bench quant`: quantizer throughput beside memcpy, in bytes of
// float32 input per second. Arguments: {elements, OpenMP threads (0 = all)}.
//   build-<you>/bench_quant --benchmark_filter=Nvfp4
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstring>
#include <random>
#include <vector>

#include "numerics/quantize.h"

namespace {

using namespace quads::num;

std::vector<float> input(int64_t n) {
  std::vector<float> x(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  return x;
}

int threads_of(const benchmark::State& st) {
  return st.range(1) > 0 ? static_cast<int>(st.range(1)) : omp_get_num_procs();
}

void finish(benchmark::State& st, int64_t n) {
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 4);
  omp_set_num_threads(omp_get_num_procs());
}

void BM_Memcpy(benchmark::State& st) {
  const int64_t n = st.range(0);
  const std::vector<float> x = input(n);
  std::vector<float> y(n);
  omp_set_num_threads(threads_of(st));
  for (auto _ : st) {
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t i0 = n * t / nt, i1 = n * (t + 1) / nt;
      std::memcpy(y.data() + i0, x.data() + i0, 4 * (i1 - i0));
    }
    benchmark::DoNotOptimize(y.data());
  }
  finish(st, n);
}

// op: 0 quantize, 1 dequantize, 2 fake_quantize
void run_quant(benchmark::State& st, int op, const char* scheme) {
  const int64_t n = st.range(0), cols = 4096, rows = n / cols;
  const std::vector<float> x = input(n);
  std::vector<float> y(n);
  const QConfig cfg = QConfig::parse(scheme);
  QTensor q = quantize(x.data(), rows, cols, cfg);
  omp_set_num_threads(threads_of(st));
  for (auto _ : st) {
    if (op == 0) quantize_into(q, x.data(), rows, cols, cfg);
    if (op == 1) dequantize(q, y.data());
    if (op == 2) fake_quantize(x.data(), y.data(), rows, cols, cfg);
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(q.codes.data());
  }
  finish(st, n);
}

void BM_Quantize(benchmark::State& st, const char* scheme) { run_quant(st, 0, scheme); }
void BM_Dequantize(benchmark::State& st, const char* scheme) { run_quant(st, 1, scheme); }
void BM_FakeQuantize(benchmark::State& st, const char* scheme) { run_quant(st, 2, scheme); }

void args(benchmark::internal::Benchmark* b) {
  for (int64_t n : {1 << 20, 1 << 24})
    for (int t : {1, 0}) b->Args({n, t});
  b->UseRealTime();
}

BENCHMARK(BM_Memcpy)->Apply(args);
BENCHMARK_CAPTURE(BM_Quantize, nvfp4_quantize, "nvfp4")->Apply(args);
BENCHMARK_CAPTURE(BM_Dequantize, nvfp4_dequantize, "nvfp4")->Apply(args);
BENCHMARK_CAPTURE(BM_FakeQuantize, nvfp4_fake_quantize, "nvfp4")->Apply(args);
BENCHMARK_CAPTURE(BM_Quantize, nvfp4_row_quantize, "nvfp4-row")->Apply(args);
BENCHMARK_CAPTURE(BM_FakeQuantize, nvfp4_row_fake_quantize, "nvfp4-row")->Apply(args);
BENCHMARK_CAPTURE(BM_Quantize, nvfp4_2d_quantize, "nvfp4-2d")->Apply(args);
BENCHMARK_CAPTURE(BM_Quantize, mxfp4_quantize, "mxfp4")->Apply(args);
BENCHMARK_CAPTURE(BM_Quantize, fp8_1x128_quantize, "fp8-1x128")->Apply(args);

}  // namespace

BENCHMARK_MAIN();
