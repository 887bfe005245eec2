// The rollout engine's GPU forward on the peer model (Qwen3-MoE, random weights: vocab
// 32000, hidden 2048, 8 layers, 64 experts top-8, moe_intermediate 768, 32 q / 4 kv heads,
// head_dim 128, untied; 2.70B parameters): greedy decode tokens/s at batch 1 / 16 / 64 (128-token
// prompts, 128 new tokens; decode steps run as the rollout engine runs them, --ahead N = its
// decode_ahead, default 8 steps a GpuModel::decode_run call, and a call a step beside it) and
// prefill tokens/s (16 x 1024), per precision, beside the weight-read
// bound (GEMM weight bytes read per decode step, counted by the model, over the measured copy
// bandwidth) and the transformers peer's numbers (--peer FILE: measured in the same call by
// scripts/gpu/peer_transformers.py; without it issue 6's, same H200 model, bf16); then a row of
// sampled decode (temperature 1 through GpuModel::step_sample, the rollout engine's call, 64 new
// tokens) with the draws on the device and on the host.
//   bench_model_gpu [--quick] [--precisions bf16,nvfp4,nvfp4+rac] [--batches 4,8,32] [--ahead N]
//                   [--train-only | --rollout-only | --quant-only] [--peer peer.json]
//   bench_model_gpu --ncu P | --ncu-decode P | --ncu-train P   (regions for ncu, see below)
//   bench_model_gpu --step-trace P [--step-trace P2 ...]        (scripts/gpu/step_trace.sh, see below)
// Training rows (cuda::GpuTrainer, cuda/train_gpu.h): tokens/s of one optimizer step on 8 x 1024
// random tokens (forward + CE on the device + backward + clipping + AdamW + re-quantization; best
// of 3 after a warm-up step) for the `bf16` and `qat` presets, beside the transformers bf16 number
// (--peer's, or issue 6's 47000 tok/s on the same H200), and the QAT overhead; then the NVFP4
// quantizer's throughput on 512 MB of float32 (65536 x 2048 and 16384 x 8192, per-row global
// scale) against the copy bandwidth. --train-only skips the rollout rows, --rollout-only the
// training and quantizer rows, --quant-only prints the quantizer rows alone. --batches adds decode
// rows at other batch sizes (no peer number).
// nvfp4+rac: the nvfp4 preset with RAC on the first half of every quantized linear's input channels
// (model::RacConfig's default ratio; the cost of RAC, not a calibrated selection).
// Wall-clock times (host steady clock, the GPU synchronized at the end of each timed region), but
// for the copy and the quantizer rows: device time (gpu_timing.h), the host-timed call beside it.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/model_gpu.h"
#include "cuda/model_kernels.h"
#include "cuda/quant.h"
#include "cuda/train_gpu.h"
#include "gpu_timing.h"
#include "model/rac.h"
#include "train/adamw.h"
#include "train/losses.h"

using namespace quads;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

model::ModelConfig peer_config() {
  model::ModelConfig c;
  c.vocab_size = 32000;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;  // dense MLP size (unused: every layer is MoE)
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 64;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = false;
  c.validate("peer model");
  return c;
}

// Read + write GB/s of a 1 GB device-to-device copy (device time, as the quantizer below).
double copy_gbs() {
  cuda::DeviceArray<uint8_t> a(size_t(1) << 30), b(size_t(1) << 30);
  a.fill_bytes(1);
  const double us = bench::time_us(
      [&] { QUADS_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), a.bytes(), cudaMemcpyDeviceToDevice)); });
  return 2.0 * a.bytes() / us / 1e3;
}

std::vector<int32_t> random_prompt(int64_t n, uint64_t seed, int vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> p(n);
  for (auto& t : p) t = static_cast<int32_t>(rng() % uint64_t(vocab));
  return p;
}

struct DecodeResult {
  double e2e_tps = 0;     // new tokens / (prefill + decode) seconds
  double decode_tps = 0;  // decode steps only
  double bytes_per_step = 0;
  int new_tokens = 0;     // per sequence (fewer than asked when the time budget ran out)
  int64_t graph_steps = 0, steps = 0, graph_kernels = 0;
  double gpu_us_per_step = 0, wall_us_per_step = 0;  // decode steps: device time vs wall time
};

// Decode steps a call when every sequence decodes (--ahead N; the rollout engine's decode_ahead):
// N > 1 runs GpuModel::decode_run (the draws fed back on the device, one wait a call), 1 a call a
// step (step_greedy / step_sample, the host feeding the tokens back). QUADS_BENCH_AHEAD=N as --ahead.
int g_ahead = rollout::EngineOptions{}.decode_ahead;

// Greedy generation of new_tokens per sequence, stopping early after max_seconds of decoding
// (keeps the script's run bounded whatever the speed).
// sampled: draws at temperature 1 (the rollout engine's jobs) instead of greedy ones; where the
// draws are made is the model's setting (GpuModel::set_device_sampling). ahead: as g_ahead (greedy
// steps a call at a time use step_greedy, the arg-max alone; runs draw greedy jobs with log-probs).
DecodeResult run_decode(cuda::GpuModel& g, int B, int64_t prompt_len, int new_tokens, double max_seconds = 1e9,
                        bool sampled = false, int ahead = 1) {
  const int V = g.config().vocab_size;
  std::vector<rollout::SampleJob> jobs(B);
  for (int b = 0; b < B; ++b) {
    jobs[b].row = b;
    jobs[b].request = b;
    jobs[b].seed = 5000 + b;
    jobs[b].params.greedy = !sampled;
  }
  int64_t pos = prompt_len;
  auto step = [&](const std::vector<model::StepItem>& items) {
    if (!sampled) return g.step_greedy(items);
    for (auto& j : jobs) j.pos = static_cast<uint64_t>(pos);
    ++pos;
    const std::vector<rollout::Draw> d = g.step_sample(items, jobs);
    std::vector<int32_t> t(d.size());
    for (size_t i = 0; i < d.size(); ++i) t[i] = d[i].token;
    return t;
  };
  g.reset_cache(B, prompt_len + new_tokens + 1);
  std::vector<model::StepItem> items(B);
  for (int b = 0; b < B; ++b) {
    items[b].slot = b;
    items[b].tokens = random_prompt(prompt_len, 1000 + b, V);
  }
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  const double t0 = now();
  std::vector<int32_t> next = step(items);
  const double t1 = now();
  g.reset_stats();
  int done = 1;
  while (done < new_tokens && now() - t1 < max_seconds) {
    for (int b = 0; b < B; ++b) items[b].tokens.assign(1, next[b]);
    if (ahead <= 1) {
      next = step(items);
      ++done;
      continue;
    }
    const int n = std::min(ahead, new_tokens - done);
    for (auto& j : jobs) j.pos = static_cast<uint64_t>(pos);
    pos += n;
    const std::vector<rollout::Draw> d = g.decode_run(items, jobs, n);
    for (int b = 0; b < B; ++b) next[b] = d[size_t(n - 1) * B + b].token;
    done += n;
  }
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  const double t2 = now();
  DecodeResult r;
  r.new_tokens = done;
  r.e2e_tps = double(B) * done / (t2 - t0);
  r.decode_tps = double(B) * (done - 1) / (t2 - t1);
  const cuda::GpuModelStats st = g.stats();
  r.bytes_per_step = st.weight_bytes / std::max<int64_t>(st.steps, 1);
  r.graph_steps = st.graph_steps;
  r.steps = st.steps;
  r.graph_kernels = st.graph_kernels;
  r.gpu_us_per_step = 1e6 * st.gpu_seconds / std::max<int64_t>(st.steps, 1);
  r.wall_us_per_step = 1e6 * (t2 - t1) / std::max(done - 1, 1);
  return r;
}

double run_prefill(cuda::GpuModel& g, int B, int64_t len) {
  const int V = g.config().vocab_size;
  g.reset_cache(B, len + 1);
  std::vector<model::StepItem> items(B);
  for (int b = 0; b < B; ++b) {
    items[b].slot = b;
    items[b].tokens = random_prompt(len, 5000 + b, V);
  }
  g.step_greedy(items);  // warm-up (allocations, cuBLAS plans)
  for (int b = 0; b < B; ++b) g.clear(b);
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  const double t0 = now();
  g.step_greedy(items);
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  return double(B) * len / (now() - t0);
}

// --ncu P / --ncu-decode P: one prefill (16 x 1024) or one decode step at batch 64 (after a
// 128-token prompt; QUADS_NCU_DECODE_BATCH overrides the batch) of precision P without graphs,
// between cudaProfilerStart / Stop, for `ncu --profile-from-start off` (scripts/gpu/profile.sh
// sums the kernel times by name).
void ncu_regions(const model::ModelConfig& cfg, const std::string& p, bool decode) {
  setenv("QUADS_GPU_GRAPHS", "0", 1);
  std::string base = p;
  const bool rac = base.size() > 4 && base.compare(base.size() - 4, 4, "+rac") == 0;
  if (rac) base.resize(base.size() - 4);
  cuda::GpuModel g(cfg, model::PrecisionConfig::preset(base));
  g.randomize(42, 0.02f);
  if (rac) g.set_rac_first_channels(model::RacConfig{}.ratio);
  run_decode(g, 2, 8, 4);  // warm-up
  const int V = cfg.vocab_size;
  const int B = 16;
  g.reset_cache(B, 1025);
  std::vector<model::StepItem> items(B);
  for (int b = 0; b < B; ++b) {
    items[b].slot = b;
    items[b].tokens = random_prompt(1024, 5000 + b, V);
  }
  g.step_greedy(items);
  for (int b = 0; b < B; ++b) g.clear(b);
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  if (!decode) cudaProfilerStart();
  g.step_greedy(items);
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  if (!decode) cudaProfilerStop();
  const char* db = std::getenv("QUADS_NCU_DECODE_BATCH");
  const int D = db ? std::atoi(db) : 64;
  QUADS_CHECK(D > 0, "QUADS_NCU_DECODE_BATCH must be a positive batch size");
  g.reset_cache(D, 140);
  std::vector<model::StepItem> d(D);
  for (int b = 0; b < D; ++b) {
    d[b].slot = b;
    d[b].tokens = random_prompt(128, 1000 + b, V);
  }
  std::vector<int32_t> next = g.step_greedy(d);
  for (int r = 0; r < 2; ++r) {  // the second one is profiled
    for (int b = 0; b < D; ++b) d[b].tokens.assign(1, next[b]);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    if (r == 1 && decode) cudaProfilerStart();
    next = g.step_greedy(d);
    QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    if (r == 1 && decode) cudaProfilerStop();
  }
  unsetenv("QUADS_GPU_GRAPHS");
}

// --step-trace P (a build with QUADS_STEP_TRACE, scripts/gpu/step_trace.sh): one replayed decode
// graph of precision P at each batch of QUADS_STEP_TRACE_BATCHES (default 1,16,64; 128-token
// prompts), with pdl.cuh's record of every kernel that waits for its predecessor. Per kernel of
// the step: its grid and block, how long its first CTA sat resident before the predecessor was
// done ("early", us), and the time from its predecessor's completion to its own ("adds", us: what
// it puts on the step's critical path; a kernel without PDL, cuBLAS's, shows inside its
// successor's). Then the same summed over kernels of one shape (the layers' repeats), largest
// first. The full listing goes to $OUT/step_trace_P_bB.txt when OUT is set. At batches 9-64 the
// experts' MLP runs in chains on several streams (docs/cuda.md Part 19): their records interleave
// and a chain kernel's "adds" is not what it puts on the critical path; QUADS_GPU_MOE_CHAINS=1
// gives the one-chain step.
void step_trace(const model::ModelConfig& cfg, const std::string& p) {
  const int cap = 4096;
  cuda::DeviceArray<unsigned long long> buf(4 + 4 * cap);
  if (!cuda::step_trace_set(nullptr)) {
    std::printf("--step-trace: this build has no QUADS_STEP_TRACE (use scripts/gpu/step_trace.sh)\n");
    return;
  }
  std::vector<int> batches{1, 16, 64};
  if (const char* e = std::getenv("QUADS_STEP_TRACE_BATCHES")) {
    batches.clear();
    std::stringstream ss(e);
    for (std::string b; std::getline(ss, b, ',');) batches.push_back(std::atoi(b.c_str()));
  }
  std::string base = p;
  const bool rac = base.size() > 4 && base.compare(base.size() - 4, 4, "+rac") == 0;
  if (rac) base.resize(base.size() - 4);
  cuda::GpuModel g(cfg, model::PrecisionConfig::preset(base));
  g.randomize(42, 0.02f);
  if (rac) g.set_rac_first_channels(model::RacConfig{}.ratio);
  for (const int B : batches) {
    QUADS_CHECK(B > 0, "QUADS_STEP_TRACE_BATCHES: {} is not a batch size", B);
    g.reset_cache(B, 160);
    std::vector<model::StepItem> items(B);
    for (int b = 0; b < B; ++b) {
      items[b].slot = b;
      items[b].tokens = random_prompt(128, 1000 + b, cfg.vocab_size);
    }
    std::vector<int32_t> next = g.step_greedy(items);
    std::vector<unsigned long long> h(4 + 4 * cap);
    for (int r = 0; r < 6; ++r) {  // eager, capture, replays; the last replay is traced
      for (int b = 0; b < B; ++b) items[b].tokens.assign(1, next[b]);
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      if (r == 5) {
        h[0] = 0;
        h[1] = cap;
        QUADS_CUDA_CHECK(cudaMemcpy(buf.data(), h.data(), 32, cudaMemcpyHostToDevice));
        cuda::step_trace_set(buf.data());
      }
      next = g.step_greedy(items);
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
    }
    cuda::step_trace_set(nullptr);
    QUADS_CUDA_CHECK(cudaMemcpy(h.data(), buf.data(), 8 * h.size(), cudaMemcpyDeviceToHost));
    const int n = static_cast<int>(std::min<unsigned long long>(h[0], cap));
    struct Rec {
      unsigned long long t0, t1, grid, block;
    };
    std::vector<Rec> rec(n);
    for (int i = 0; i < n; ++i) rec[i] = {h[4 + 4 * i], h[5 + 4 * i], h[6 + 4 * i], h[7 + 4 * i]};
    std::sort(rec.begin(), rec.end(), [](const Rec& a, const Rec& b) { return a.t1 < b.t1; });
    auto shape = [](const Rec& r) {
      return fmt::format("({},{},{})x{}", r.grid & 0xFFFFFF, (r.grid >> 24) & 0xFFFFF, r.grid >> 44, r.block);
    };
    // marks (step_mark, pdl.cuh) are listed where they fell, with the time since the event before
    // them; a kernel's "adds" runs to the next kernel's record
    const bool marks = std::any_of(rec.begin(), rec.end(), [](const Rec& r) { return r.grid >> 63; });
    std::string listing = fmt::format("{} batch {}: {} records\n| # | grid x block | early us | at us | adds us |\n", p, B, n);
    std::vector<std::pair<std::string, std::pair<double, int>>> by;
    for (int i = 0; i < n; ++i) {
      if (rec[i].grid >> 63) {
        listing += fmt::format("|   | mark {} (CTA {}) | | {:.2f} | +{:.2f} since the last event |\n", rec[i].grid & 0xFFFFFFFF,
                               rec[i].block, (rec[i].t1 - rec[0].t1) / 1e3, i ? (rec[i].t1 - rec[i - 1].t1) / 1e3 : 0.0);
        continue;
      }
      int nx = i + 1;
      while (nx < n && rec[nx].grid >> 63) ++nx;
      const double adds = nx < n ? (rec[nx].t1 - rec[i].t1) / 1e3 : 0.0;
      listing += fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f} |\n", i, shape(rec[i]), (rec[i].t1 - rec[i].t0) / 1e3,
                             (rec[i].t1 - rec[0].t1) / 1e3, adds);
      const std::string k = shape(rec[i]);
      auto it = std::find_if(by.begin(), by.end(), [&](const auto& x) { return x.first == k; });
      if (it == by.end()) by.push_back({k, {adds, 1}});
      else it->second.first += adds, ++it->second.second;
    }
    if (const char* out = std::getenv("OUT")) {
      std::string name = p;
      for (char& c : name) c = c == '+' ? '_' : c;
      if (FILE* f = std::fopen(fmt::format("{}/step_trace_{}_b{}.txt", out, name, B).c_str(), "w")) {
        std::fputs(listing.c_str(), f);
        std::fclose(f);
      }
    }
    std::sort(by.begin(), by.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    const double span = n > 1 ? (rec[n - 1].t1 - rec[0].t1) / 1e3 : 0.0;
    std::printf("\n%s batch %d: %d records, first to last wait %.1f us; by shape (sum of 'adds', count):\n", p.c_str(), B,
                n, span);
    for (const auto& [k, v] : by) std::printf("  %-28s %8.1f us %4d\n", k.c_str(), v.first, v.second);
    if (B == batches.front() || marks) std::fputs(listing.c_str(), stdout);
  }
}

// --batches a,b,...: decode batches timed after the peer's 1 / 16 / 64 (no peer column; for
// rules that switch by batch size)
std::vector<int> g_extra_batches;

// The peer's numbers: issue 6's (transformers 5.17 on the same H200 model), or those that
// scripts/gpu/peer_transformers.py measured in the same call (--peer FILE, its JSON).
struct Peer {
  double decode[3] = {20, 310, 905};  // new tok/s at batch 1 / 16 / 64
  double prefill = 184000, train = 47000;
  std::string source = "issue 6's figures (transformers 5.17, same H200 model)";
};
Peer g_peer;

Peer read_peer(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("--peer: cannot open " + path);
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    throw std::runtime_error("--peer " + path + ": not JSON (" + e.what() + ")");
  }
  Peer p;
  const auto num = [&](const nlohmann::json& o, const std::string& key, const char* what) {
    if (!o.contains(key) || !o.at(key).is_number() || o.at(key).get<double>() <= 0)
      throw std::runtime_error("--peer " + path + ": no positive number at " + what);
    return o.at(key).get<double>();
  };
  if (!j.contains("decode") || !j["decode"].is_object())
    throw std::runtime_error("--peer " + path + ": no 'decode' object");
  const char* bs[3] = {"1", "16", "64"};
  for (int i = 0; i < 3; ++i)
    p.decode[i] = num(j["decode"], bs[i], fmt::format("decode.{}", bs[i]).c_str());
  p.prefill = num(j, "prefill", "prefill");
  p.train = num(j, "train", "train");
  p.source = fmt::format("measured in this call by scripts/gpu/peer_transformers.py (transformers {}, torch {})",
                         j.value("transformers", std::string("?")), j.value("torch", std::string("?")));
  return p;
}

// One precision's rows of the table; returns false (after printing the error) on failure.
bool bench_precision(const model::ModelConfig& cfg, const std::string& p, double bw, bool quick) {
  const int new_tokens = quick ? 16 : 128;
  const int64_t prompt = 128;
  const double* peer = g_peer.decode;
  const int batches[3] = {1, 16, 64};
  try {
    const double t0 = now();
    // Suffixes: +rac (RAC on the first channels), +eager (no CUDA graphs: QUADS_GPU_GRAPHS=0),
    // +legacy (host-routed MoE, one GEMM per expert: QUADS_GPU_MOE=legacy), +attn (prefill
    // attention with K/V tiles in shared memory: QUADS_GPU_ATTN=tiled), +attnl1 (the default
    // kernel with 4 tokens x the GQA group per CTA: QUADS_GPU_ATTN_TOKENS=4), +attndec (decode
    // attention through the tiled kernel: QUADS_GPU_ATTN_DECODE=tiled).
    std::string base = p;
    bool rac = false, eager = false, legacy = false, attn = false, attnl1 = false, attndec = false;
    for (const auto& [suffix, flag] :
         {std::pair<std::string, bool*>{"+rac", &rac}, {"+eager", &eager}, {"+legacy", &legacy},
          {"+attnl1", &attnl1}, {"+attndec", &attndec}, {"+attn", &attn}}) {
      const size_t at = base.find(suffix);
      if (at != std::string::npos) {
        *flag = true;
        base.erase(at, suffix.size());
      }
    }
    if (eager) setenv("QUADS_GPU_GRAPHS", "0", 1);
    if (legacy) setenv("QUADS_GPU_MOE", "legacy", 1);
    if (attnl1) setenv("QUADS_GPU_ATTN_TOKENS", "4", 1);
    if (attn) setenv("QUADS_GPU_ATTN", "tiled", 1);
    if (attndec) setenv("QUADS_GPU_ATTN_DECODE", "tiled", 1);
    cuda::GpuModel g(cfg, model::PrecisionConfig::preset(base));
    unsetenv("QUADS_GPU_GRAPHS");
    unsetenv("QUADS_GPU_MOE");
    unsetenv("QUADS_GPU_ATTN_TOKENS");
    unsetenv("QUADS_GPU_ATTN");
    unsetenv("QUADS_GPU_ATTN_DECODE");
    g.randomize(42, 0.02f);
    if (rac) g.set_rac_first_channels(model::RacConfig{}.ratio);
    std::fprintf(stderr, "%s: %.2f GB of GEMM weights on the device, set up in %.1f s\n", p.c_str(),
                 g.weight_bytes() / 1e9, now() - t0);
    run_decode(g, 2, 8, 4);  // warm-up
    for (int i = 0; i < 3; ++i) {
      const int B = batches[i];
      const DecodeResult r = run_decode(g, B, prompt, new_tokens, 15.0, false, g_ahead);
      const DecodeResult r1 = run_decode(g, B, prompt, new_tokens, 15.0);
      const double bound = B * bw * 1e9 / r.bytes_per_step;
      std::printf("| %s | %d%s | %.0f | %.0f | %.0f | %.2f | %.0f | %.1f | %.0f | %.1f |\n", p.c_str(), B,
                  r.new_tokens < new_tokens ? fmt::format(" ({} new: time budget)", r.new_tokens).c_str() : "", r.e2e_tps,
                  r.decode_tps, r1.decode_tps, r.bytes_per_step / 1e9, bound, 100.0 * r.decode_tps / bound, peer[i],
                  r.e2e_tps / peer[i]);
      std::fflush(stdout);
      std::fprintf(stderr,
                   "%s batch %d: %lld of %lld decode steps replayed a CUDA graph of %lld kernels; device %.0f us of "
                   "%.0f us a step\n",
                   p.c_str(), B, static_cast<long long>(r.graph_steps), static_cast<long long>(r.steps),
                   static_cast<long long>(r.graph_kernels), r.gpu_us_per_step, r.wall_us_per_step);
    }
    for (const int B : g_extra_batches) {
      const DecodeResult r = run_decode(g, B, prompt, new_tokens, 15.0, false, g_ahead);
      const DecodeResult r1 = run_decode(g, B, prompt, new_tokens, 15.0);
      const double bound = B * bw * 1e9 / r.bytes_per_step;
      std::printf("| %s | %d | %.0f | %.0f | %.0f | %.2f | %.0f | %.1f | | |\n", p.c_str(), B, r.e2e_tps, r.decode_tps,
                  r1.decode_tps, r.bytes_per_step / 1e9, bound, 100.0 * r.decode_tps / bound);
      std::fflush(stdout);
    }
    // The rollout engine's call (draws at temperature 1, returned per row) with the draws on the
    // device and on the host (the logits downloaded, rollout::sample_jobs on the CPU's threads).
    {
      std::string dev_s, host_s;
      for (int i = 0; i < 3; ++i)
        for (const bool on_dev : {true, false}) {
          g.set_device_sampling(on_dev);
          const DecodeResult r = run_decode(g, batches[i], prompt, quick ? 8 : 64, 10.0, true, g_ahead);
          (on_dev ? dev_s : host_s) += fmt::format("{}{:.0f}", i ? " / " : "", r.decode_tps);
        }
      g.set_device_sampling(true);
      std::printf("| %s | sampled (T = 1), batch 1 / 16 / 64 | decode tok/s, draws on the device: %s | on the host: %s "
                  "| | | | | | |\n",
                  p.c_str(), dev_s.c_str(), host_s.c_str());
      std::fflush(stdout);
    }
    const int pb = quick ? 4 : 16;
    const double tps = run_prefill(g, pb, 1024);
    std::printf("| %s | prefill %dx1024 | %.0f prompt tok/s | | | | | | %.0f | %.2f |\n", p.c_str(), pb, tps,
                g_peer.prefill, tps / g_peer.prefill);
    std::fflush(stdout);
    return true;
  } catch (const std::exception& e) {  // the other precisions still run
    std::printf("| %s | failed: %s |\n", p.c_str(), e.what());
    std::fflush(stdout);
    return false;
  }
}

// --ncu-train P: the second step (the first after the warm-up) of P's 8 x 1024 training row runs
// between cudaProfilerStart / Stop (scripts/gpu/profile.sh with QUADS_NCU_WHAT=train).
bool g_ncu_train = false;

// Seconds of one training step (best of `reps` after a warm-up), or < 0 after printing the error.
// attn / experts: "" for the trainer's defaults, else GpuTrainer::set_attention / set_expert_gemms.
// *what receives the attention and expert GEMMs that ran.
double train_step_seconds(const model::ModelConfig& cfg, const std::string& preset, const std::string& attn,
                          const std::string& experts, int nseq, int64_t len, int reps, std::string* what) {
  try {
    const double t0 = now();
    cuda::GpuTrainer g(cfg, model::PrecisionConfig::preset(preset), 42, 0.02f);
    if (!attn.empty()) g.set_attention(attn);
    if (!experts.empty()) g.set_expert_gemms(experts);
    std::fprintf(stderr, "train %s: trainer set up in %.1f s (attention %s, experts %s)\n", preset.c_str(),
                 now() - t0, g.attention().c_str(), g.expert_gemms().c_str());
    std::vector<std::vector<int32_t>> seqs;
    for (int s = 0; s < nseq; ++s) seqs.push_back(random_prompt(len, 9000 + s, cfg.vocab_size));
    const model::Batch b = model::Batch::of(seqs);
    const std::vector<int32_t> targets = train::next_token_targets(b);
    train::AdamWConfig ac;
    ac.lr = 1e-5;
    ac.weight_decay = 0.01;
    double best = 1e30;
    for (int r = 0; r <= reps; ++r) {
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      if (g_ncu_train && r == 1) cudaProfilerStart();
      const double a = now();
      g.zero_grad();
      g.forward(b, nullptr, true);
      const double fwd = now() - a;  // forward() ends with a sync
      const double loss = g.loss_ce(targets);
      const double bwd = now() - a - fwd;
      g.adamw_step(ac, r + 1);
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const double dt = now() - a;
      if (g_ncu_train && r == 1) cudaProfilerStop();
      std::fprintf(stderr, "train %s step %d: %.3f s (forward %.3f, CE + backward %.3f, AdamW + requant %.3f), loss %.4f\n",
                   preset.c_str(), r, dt, fwd, bwd, dt - fwd - bwd, loss);
      if (r > 0) best = std::min(best, dt);  // step 0 is the warm-up (allocations, cuBLAS heuristics)
    }
    // One more step with CUDA events between the pieces (not timed above): where the GPU time goes.
    g.set_profiling(true);
    g.zero_grad();
    g.forward(b, nullptr, true);
    g.loss_ce(targets);
    g.adamw_step(ac, reps + 2);
    std::fprintf(stderr, "train %s profile: %s\n", preset.c_str(), g.profile_report().c_str());
    *what = "attention " + g.attention() + ", experts " + g.expert_gemms();
    return best;
  } catch (const std::exception& e) {
    std::printf("| train %s | failed: %s |\n", preset.c_str(), e.what());
    std::fflush(stdout);
    return -1;
  }
}

void bench_training(const model::ModelConfig& cfg, double bw, bool quick) {
  const int nseq = quick ? 2 : 8;
  const int64_t len = 1024;
  const double peer = g_peer.train;
  std::printf("\n| training step (fwd + CE + bwd + AdamW + requant) | tokens | tok/s | transformers bf16 tok/s | x peer |\n"
              "|---|---|---|---|---|\n");
  std::fflush(stdout);
  // The defaults (tensor-core attention, expert GEMMs on 8 streams) first, then one GEMM per
  // expert on the trainer's stream, and the exact FP32 attention.
  struct Row {
    const char* preset;
    const char* attn;
    const char* experts;
  };
  const Row rows[] = {{"bf16", "", ""},
                      {"qat", "", ""},
                      {"bf16", "", "per-expert"},
                      {"qat", "", "per-expert"},
                      {"bf16", "exact", ""}};
  double sec[2] = {-1, -1};
  for (size_t i = 0; i < (quick ? 2 : sizeof(rows) / sizeof(rows[0])); ++i) {
    std::string what;
    const double t = train_step_seconds(cfg, rows[i].preset, rows[i].attn, rows[i].experts, nseq, len, 3, &what);
    if (i < 2) sec[i] = t;
    if (t <= 0) continue;
    const double tps = double(nseq) * len / t;
    std::printf("| train %s (%s) | %dx%lld | %.0f | %.0f | %.2f |\n", rows[i].preset, what.c_str(), nseq,
                static_cast<long long>(len), tps, peer, tps / peer);
    std::fflush(stdout);
  }
  if (sec[0] > 0 && sec[1] > 0)
    std::printf("QAT overhead (qat step time over bf16): %+.1f %%\n", 100.0 * (sec[1] / sec[0] - 1.0));
}

void bench_quantize(double bw) {
  // NVFP4 quantization of a float32 tensor, one global scale per row: activations [tokens, hidden]
  // (2048 columns, the rollout's case: a warp a row, in its registers) and long 8192-wide rows (a
  // CTA a row, in its four warps' registers), 512 MB of input each.
  for (const int64_t cols : {int64_t(2048), int64_t(8192)}) try {
    const int64_t rows = int64_t(16384) * 8192 / cols;
    num::QConfig qc;
    qc.global = num::Global::PerRow;
    cuda::DeviceArray<float> x(size_t(rows * cols));
    cuda::kern::fill_normal(x.data(), rows * cols, 7, 0.f, 1.f, nullptr);
    cuda::DeviceQTensor q = cuda::make_qtensor(rows, cols, qc);
    // device time (events over back-to-back calls, as copy_gbs); the host-timed single call beside
    // it adds a launch and a synchronization (best of 5)
    const double us = bench::time_us([&] { cuda::quantize(x.data(), q, nullptr); });
    double host = 1e30;
    for (int r = 0; r < 5; ++r) {
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      const double a = now();
      cuda::quantize(x.data(), q, nullptr);
      QUADS_CUDA_CHECK(cudaDeviceSynchronize());
      host = std::min(host, now() - a);
    }
    const double in = double(rows * cols) * 4, out = double(q.codes.bytes() + q.scales.bytes() + q.amax.bytes());
    const double gbs = (in + out) / us / 1e3;
    std::printf("| nvfp4 quantize %lldx%lld f32 (per-row global) | %.0f GB/s of input | %.0f GB/s read+write | copy "
                "%.0f GB/s | %.0f %% of copy | a call timed on the host: %.1f us, %.0f %% |\n",
                static_cast<long long>(rows), static_cast<long long>(cols), in / us / 1e3, gbs, bw, 100.0 * gbs / bw,
                1e6 * host, 100.0 * (in + out) / host / 1e9 / bw);
  } catch (const std::exception& e) {
    std::printf("| nvfp4 quantize | failed: %s |\n", e.what());
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (cuda::device_count() == 0) {
      std::printf("bench_model_gpu: no CUDA device\n");
      return 0;
    }
    bool quick = false, train_only = false, rollout_only = false, quant_only = false;
    if (const char* e = std::getenv("QUADS_BENCH_AHEAD")) g_ahead = std::max(1, std::atoi(e));  // A/B runs (ab.sh)
    std::vector<std::string> precisions{"bf16", "nvfp4", "nvfp4+eager", "nvfp4+rac", "nvfp4+attnl1", "nvfp4+attn"};
    for (int i = 1; i < argc; ++i) {
      if (!std::strcmp(argv[i], "--quick")) quick = true;
      else if (!std::strcmp(argv[i], "--train-only")) train_only = true;
      else if (!std::strcmp(argv[i], "--rollout-only")) rollout_only = true;
      else if (!std::strcmp(argv[i], "--quant-only")) quant_only = true;
      else if (!std::strcmp(argv[i], "--ncu-train") && i + 1 < argc) {
        g_ncu_train = true;
        std::string what;
        train_step_seconds(peer_config(), argv[i + 1], "", "", 8, 1024, 1, &what);
        return 0;
      }
      else if ((!std::strcmp(argv[i], "--ncu") || !std::strcmp(argv[i], "--ncu-decode")) && i + 1 < argc) {
        ncu_regions(peer_config(), argv[i + 1], !std::strcmp(argv[i], "--ncu-decode"));
        return 0;
      }
      else if (!std::strcmp(argv[i], "--step-trace") && i + 1 < argc) {
        step_trace(peer_config(), argv[++i]);
        if (i + 1 == argc) return 0;
      }
      else if (!std::strcmp(argv[i], "--peer") && i + 1 < argc) {
        g_peer = read_peer(argv[++i]);
      }
      else if (!std::strcmp(argv[i], "--ahead") && i + 1 < argc) {
        g_ahead = std::atoi(argv[++i]);
        if (g_ahead < 1) throw std::runtime_error("--ahead: decode steps a call must be >= 1");
      }
      else if (!std::strcmp(argv[i], "--batches") && i + 1 < argc) {
        std::stringstream ss(argv[++i]);
        for (std::string b; std::getline(ss, b, ',');) {
          const int B = std::atoi(b.c_str());
          if (B < 1) throw std::runtime_error("--batches: '" + b + "' is not a batch size >= 1");
          g_extra_batches.push_back(B);
        }
      }
      else if (!std::strcmp(argv[i], "--precisions") && i + 1 < argc) {
        precisions.clear();
        std::stringstream ss(argv[++i]);
        for (std::string p; std::getline(ss, p, ',');) precisions.push_back(p);
      }
    }
    const model::ModelConfig cfg = peer_config();
    const double bw = copy_gbs();
    std::printf("\nPeer model (%s) on %s; copy bandwidth %.0f GB/s; transformers numbers: %s\n",
                cfg.describe().c_str(), cuda::device_name(0).c_str(), bw, g_peer.source.c_str());
    int failures = 0;
    if (!train_only && !quant_only) {
      std::printf("| precision | batch | new tok/s (prefill+decode) | decode tok/s (%d steps a call) | decode tok/s (a "
                  "call a step) | weight GB read/step | bound tok/s | %% of bound | transformers bf16 tok/s | x peer "
                  "|\n|---|---|---|---|---|---|---|---|---|---|\n",
                  g_ahead);
      for (const std::string& p : precisions) failures += !bench_precision(cfg, p, bw, quick);
    }
    if (!rollout_only && !quant_only) bench_training(cfg, bw, quick);
    if (!rollout_only) bench_quantize(bw);
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_model_gpu: %s\n", e.what());
    return 1;
  }
}
