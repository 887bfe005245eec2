// `quads bench <what>`: throughput measurements printed as a table. Each benchmark is one entry
// of the dispatch table below (name, help, function); add an entry to add a benchmark.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/error.h"
#include "numerics/quantize.h"
#include "rollout/bench_model.h"

namespace quads::cli {

namespace {

struct BenchOptions {
  int64_t rows = 4096, cols = 4096;
  int reps = 5;
  int threads = 0;  // 0: all (omp_get_max_threads at start)
};

// Best-of-`reps` wall time of f() in seconds, after one warm-up call.
double best_time(int reps, const std::function<void()>& f) {
  f();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// memcpy split into equal contiguous pieces, one per thread.
void parallel_memcpy(float* dst, const float* src, int64_t n) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t i0 = n * t / nt, i1 = n * (t + 1) / nt;
    std::memcpy(dst + i0, src + i0, sizeof(float) * (i1 - i0));
  }
}

int bench_quant(const BenchOptions& o) {
  namespace num = quads::num;
  QUADS_CHECK(o.rows > 0 && o.cols > 0 && o.cols % 32 == 0, "bench quant: --cols must be a positive multiple of 32");
  const int all = o.threads > 0 ? o.threads : omp_get_max_threads();
  const int64_t n = o.rows * o.cols;
  const double gb = 4.0 * static_cast<double>(n) / 1e9;
  std::vector<float> x(n), y(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);

  struct Row {
    std::string name;
    std::function<void()> f;
    bool simd = true;
  };
  num::QTensor q_nv = num::quantize(x.data(), o.rows, o.cols, num::QConfig::nvfp4_act());
  num::QTensor q_row, q_2d, q_other;
  const num::QConfig nv = num::QConfig::nvfp4_act(), nv_row = num::QConfig::parse("nvfp4-row"),
                     nv_2d = num::QConfig::nvfp4_weight(true), mx = num::QConfig::mxfp4(),
                     f8 = num::QConfig::fp8(num::Block::B1x128);
  num::QConfig nv_sr = nv;
  nv_sr.stochastic = true;
  std::vector<Row> rows = {
      {"memcpy", [&] { parallel_memcpy(y.data(), x.data(), n); }},
      {"nvfp4 quantize", [&] { num::quantize_into(q_nv, x.data(), o.rows, o.cols, nv); }},
      {"nvfp4 dequantize", [&] { num::dequantize(q_nv, y.data()); }},
      {"nvfp4 fake_quantize", [&] { num::fake_quantize(x.data(), y.data(), o.rows, o.cols, nv); }},
      {"nvfp4-row quantize", [&] { num::quantize_into(q_row, x.data(), o.rows, o.cols, nv_row); }},
      {"nvfp4-row fake_quantize", [&] { num::fake_quantize(x.data(), y.data(), o.rows, o.cols, nv_row); }},
      {"nvfp4-2d quantize", [&] { num::quantize_into(q_2d, x.data(), o.rows, o.cols, nv_2d); }},
      {"nvfp4 quantize, scalar", [&] { num::quantize_into(q_nv, x.data(), o.rows, o.cols, nv); }, false},
      {"nvfp4 fake_quant, scalar", [&] { num::fake_quantize(x.data(), y.data(), o.rows, o.cols, nv); }, false},
      {"nvfp4 fake_quantize, SR", [&] { num::fake_quantize(x.data(), y.data(), o.rows, o.cols, nv_sr); }},
      {"mxfp4 quantize", [&] { num::quantize_into(q_other, x.data(), o.rows, o.cols, mx); }},
      {"mxfp4 fake_quantize", [&] { num::fake_quantize(x.data(), y.data(), o.rows, o.cols, mx); }},
      {"fp8 1x128 quantize", [&] { num::quantize_into(q_other, x.data(), o.rows, o.cols, f8); }},
      {"fp8 1x128 fake_quantize", [&] { num::fake_quantize(x.data(), y.data(), o.rows, o.cols, f8); }},
  };

  std::printf("quads bench quant: %lld x %lld float32 (%.0f MiB), best of %d, %d threads available, %s kernels\n",
              static_cast<long long>(o.rows), static_cast<long long>(o.cols), 4.0 * n / (1 << 20), o.reps, all,
              num::simd_available() ? "AVX2" : "scalar");
  std::printf("GB/s of float32 input (dequantize: of float32 output); memcpy counts bytes copied\n\n");
  std::printf("%-26s %12s %12s %16s\n", "operation", "1 thread", fmt::format("{} threads", all).c_str(),
              "vs memcpy (all)");
  double memcpy_all = 0;
  for (Row& r : rows) {
    num::set_simd_enabled(r.simd);
    omp_set_num_threads(1);
    const double g1 = gb / best_time(o.reps, r.f);
    omp_set_num_threads(all);
    const double ga = gb / best_time(o.reps, r.f);
    num::set_simd_enabled(true);
    if (r.name == "memcpy") memcpy_all = ga;
    std::printf("%-26s %12.2f %12.2f %15.2fx\n", r.name.c_str(), g1, ga, ga / memcpy_all);
  }
  return 0;
}

struct BenchEntry {
  const char* name;
  const char* help;
  int (*run)(const BenchOptions&);
};
const BenchEntry kBenches[] = {
    {"quant", "NVFP4/MXFP4/FP8 quantize, dequantize, fake_quantize vs memcpy", bench_quant},
    {"model", "prefill/decode/training tokens/s per precision mode vs sgemm", [](const BenchOptions& o) { return rollout::bench_model({o.threads, o.reps}); }},
};

std::function<int()> setup(CLI::App& app) {
  auto what = std::make_shared<std::string>();
  auto o = std::make_shared<BenchOptions>();
  std::string names;
  for (const auto& b : kBenches) names += fmt::format("\n  {:8} {}", b.name, b.help);
  app.add_option("what", *what, "what to measure:" + names)->required();
  app.add_option("--rows", o->rows, "tensor rows")->capture_default_str();
  app.add_option("--cols", o->cols, "tensor columns")->capture_default_str();
  app.add_option("--reps", o->reps, "timed repetitions (the best is reported)")->capture_default_str();
  app.add_option("--threads", o->threads, "threads for the multi-threaded column (0: all)")->capture_default_str();
  return [what, o]() -> int {
    for (const auto& b : kBenches)
      if (*what == b.name) return b.run(*o);
    std::string known;
    for (const auto& b : kBenches) known += std::string(known.empty() ? "" : ", ") + b.name;
    fail("bench: unknown benchmark '{}' (known: {})", *what, known);
  };
}

QUADS_COMMAND("bench", "measure throughput (quads bench quant)", setup);

}  // namespace

}  // namespace quads::cli
