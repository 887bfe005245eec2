// Google Benchmark of checkpoint-sized safetensors writes (fsync'ed, as every save is): Weights::save,
// which streams the float32 masters tensor by tensor, beside the copying path it replaced (each
// tensor copied into a TensorData, then write_safetensors), in bytes written per second, with the
// process's peak resident memory as a counter. Argument: the model's hidden size (768: the 0.29B
// model of configs/gpu.toml). Disk-bound and noisy: compare runs made one after another.
//   build-<you>/bench_io --benchmark_filter=Save
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <filesystem>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/weights.h"

namespace {

namespace fs = std::filesystem;
using namespace quads;

model::Weights weights(int64_t hidden) {
  model::ModelConfig c;
  c.vocab_size = 32000;
  c.hidden_size = static_cast<int>(hidden);
  c.num_hidden_layers = 8;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = static_cast<int>(hidden / 2);
  c.max_position_embeddings = 128;
  return model::Weights::random(c, 1);
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;
}

void finish(benchmark::State& st, const model::Weights& w, const std::string& dir) {
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(w.size() * 4));
  st.counters["peak_rss_MB"] = peak_rss_mb();
  fs::remove_all(dir);
}

void BM_SaveStreamed(benchmark::State& st) {
  const model::Weights w = weights(st.range(0));
  const std::string dir = (fs::temp_directory_path() / "quads_bench_io_streamed").string();
  for (auto _ : st) w.save(dir);
  finish(st, w, dir);
}

void BM_SaveCopying(benchmark::State& st) {
  const model::Weights w = weights(st.range(0));
  const std::string dir = (fs::temp_directory_path() / "quads_bench_io_copying").string();
  fs::create_directories(dir);
  for (auto _ : st) {
    std::vector<io::TensorData> ts;
    for (const auto& p : w.layout.params)
      ts.push_back(io::TensorData::from_f32(p.name, p.shape, w.data.data() + p.offset, io::DType::F32));
    io::write_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  }
  finish(st, w, dir);
}

}  // namespace

// Streamed first: the copying form raises the process's peak memory for good.
BENCHMARK(BM_SaveStreamed)->Arg(768)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveCopying)->Arg(768)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
