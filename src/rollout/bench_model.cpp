#include "rollout/bench_model.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"
#include "common/fixtures.h"
#include "cpu/gemm.h"
#include "model/model.h"
#include "train/adamw.h"
#include "train/losses.h"

namespace quads::rollout {

model::ModelConfig bench_small_config() {
  model::ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 1024;
  c.moe_intermediate_size = 256;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.max_position_embeddings = 4096;
  c.validate("bench small config");
  return c;
}

double linear_flops(const model::ModelConfig& c, int64_t n, int64_t logit_rows) {
  const double H = c.hidden_size;
  double per_token = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    per_token += 2 * H * (c.q_dim() + 2.0 * c.kv_dim()) + 2.0 * c.q_dim() * H;
    if (c.is_sparse(l))
      per_token += 2 * H * c.num_experts + c.num_experts_per_tok * 2 * 3 * double(c.moe_intermediate_size) * H;
    else
      per_token += 2 * 3 * double(c.intermediate_size) * H;
  }
  return per_token * double(n) + 2 * H * double(c.vocab_size) * double(logit_rows);
}

double attention_flops(const model::ModelConfig& c, int64_t start, int64_t n) {
  // sum over p = start .. start+n-1 of (p + 1) keys, times QK and PV (2 flops each per element).
  const double keys = double(n) * double(start) + double(n) * double(n + 1) / 2;
  return keys * 4.0 * c.num_attention_heads * c.head_dim * c.num_hidden_layers;
}

namespace {

// Wall-clock seconds, or with QUADS_BENCH_CLOCK=cpu the process CPU time: on a machine shared
// with other jobs, a single-threaded run's CPU time is what its wall time would be on a quiet one.
bool g_cpu_clock = false;

double now() {
  if (g_cpu_clock) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double seconds_since(double t0) { return now() - t0; }

// Best-of-`reps` wall time of f() after one warm-up call; `reset` runs untimed before each call.
double best_time(int reps, const std::function<void()>& f, const std::function<void()>& reset = {}) {
  double best = 1e30;
  for (int i = 0; i <= reps; ++i) {
    if (reset) reset();
    const double t0 = now();
    f();
    const double t = seconds_since(t0);
    if (i > 0) best = std::min(best, t);
  }
  return best;
}

std::vector<int32_t> random_tokens(int64_t n, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % V);
  return t;
}

int32_t argmax(const float* row, int64_t V) { return int32_t(std::max_element(row, row + V) - row); }

struct Sgemm {
  double blas = 0, rowinv = 0;  // GFLOP/s
};

Sgemm measure_sgemm(int reps) {
  const int64_t S = 1024;
  std::vector<float> X(S * S), W(S * S), Y(S * S);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (auto& v : X) v = nd(rng);
  for (auto& v : W) v = nd(rng);
  const double fl = 2.0 * S * S * S;
  Sgemm g;
  g.blas = fl / best_time(reps, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, S, S, S, 1.f, X.data(), S, W.data(), S, 0.f, Y.data(), S);
  }) / 1e9;
  g.rowinv = fl / best_time(reps, [&] { cpu::gemm_nt_rowinv(S, S, S, X.data(), S, W.data(), S, Y.data(), S); }) / 1e9;
  return g;
}

struct Setup {
  std::string name;
  model::Weights w;
  int64_t prefill_seqs = 4, prefill_len = 256;  // prefill: 4 prompts of 256 tokens in one step
  int64_t context = 128, decode_steps = 32;     // decode: after a 128-token prompt per sequence
  int64_t train_seqs = 4, train_len = 256;      // training: 4 x 256 tokens per step
};

void bench_inference(const Setup& s, const std::vector<std::string>& modes, double sgemm, int reps) {
  const model::ModelConfig& c = s.w.cfg;
  const int64_t V = c.vocab_size;
  std::printf("\n%s, rollout path (Model::step, row-invariant GEMMs): prefill %lld x %lld tokens in one step; "
              "decode %lld steps after a %lld-token prompt\n",
              s.name.c_str(), (long long)s.prefill_seqs, (long long)s.prefill_len, (long long)s.decode_steps,
              (long long)s.context);
  std::printf("%-12s %12s %9s %7s | %12s %9s %7s | %12s %9s %7s\n", "mode", "prefill tok/s", "GFLOP/s", "%sgemm",
              "decode b=1", "GFLOP/s", "%sgemm", "decode b=16", "GFLOP/s", "%sgemm");
  for (const std::string& mode : modes) {
    model::Weights w = s.w;
    model::Model m(w, model::PrecisionConfig::preset(mode));
    m.forward_gemm = model::GemmMode::RowInvariant;

    // Prefill.
    model::KVCache pc(c, static_cast<int>(s.prefill_seqs));
    std::vector<model::StepItem> items(s.prefill_seqs);
    for (int64_t i = 0; i < s.prefill_seqs; ++i) {
      items[i].slot = static_cast<int>(i);
      items[i].tokens = random_tokens(s.prefill_len, c.vocab_size, 100 + i);
    }
    const double tp = best_time(reps, [&] { m.step(pc, items); },
                                [&] {
                                  for (int i = 0; i < pc.num_slots(); ++i) pc.clear(i);
                                });
    const double ntok_p = double(s.prefill_seqs * s.prefill_len);
    const double fl_p = s.prefill_seqs * (linear_flops(c, s.prefill_len, 1) + attention_flops(c, 0, s.prefill_len));

    double dec_tps[2], dec_gf[2];
    const int batches[2] = {1, 16};
    for (int bi = 0; bi < 2; ++bi) {
      const int B = batches[bi];
      model::KVCache dc(c, B);
      std::vector<model::StepItem> pre(B);
      for (int i = 0; i < B; ++i) {
        pre[i].slot = i;
        pre[i].tokens = random_tokens(s.context, c.vocab_size, 200 + i);
      }
      const std::vector<float> first = m.step(dc, pre);
      std::vector<int32_t> start_tok(B);
      for (int i = 0; i < B; ++i) start_tok[i] = argmax(first.data() + i * V, V);
      const double t = best_time(
          reps,
          [&] {
            std::vector<model::StepItem> st(B);
            std::vector<int32_t> tok = start_tok;
            for (int64_t k = 0; k < s.decode_steps; ++k) {
              for (int i = 0; i < B; ++i) st[i].slot = i, st[i].tokens.assign(1, tok[i]);
              const std::vector<float> lg = m.step(dc, st);
              for (int i = 0; i < B; ++i) tok[i] = argmax(lg.data() + i * V, V);
            }
          },
          [&] {
            for (int i = 0; i < B; ++i) dc.truncate(i, s.context);
          });
      dec_tps[bi] = double(B) * s.decode_steps / t;
      dec_gf[bi] = double(B) * (linear_flops(c, s.decode_steps, s.decode_steps) +
                                attention_flops(c, s.context, s.decode_steps)) / t / 1e9;
    }
    const double gp = fl_p / tp / 1e9;
    std::printf("%-12s %12.0f %9.2f %6.1f%% | %12.1f %9.2f %6.1f%% | %12.1f %9.2f %6.1f%%\n", mode.c_str(), ntok_p / tp,
                gp, 100 * gp / sgemm, dec_tps[0], dec_gf[0], 100 * dec_gf[0] / sgemm, dec_tps[1], dec_gf[1],
                100 * dec_gf[1] / sgemm);
    std::fflush(stdout);
  }
}

void bench_training(const Setup& s, double sgemm, int reps) {
  const model::ModelConfig& c = s.w.cfg;
  const int64_t V = c.vocab_size;
  std::printf("\n%s, training step (forward + cross-entropy + backward + AdamW + weight sync), %lld x %lld tokens\n",
              s.name.c_str(), (long long)s.train_seqs, (long long)s.train_len);
  std::printf("%-8s %-13s %10s %9s %7s | %9s %9s %9s %9s\n", "trainer", "forward GEMM", "tok/s", "GFLOP/s", "%sgemm",
              "fwd ms", "loss ms", "bwd ms", "opt ms");
  std::vector<std::vector<int32_t>> seqs;
  for (int64_t i = 0; i < s.train_seqs; ++i) seqs.push_back(random_tokens(s.train_len, c.vocab_size, 300 + i));
  const model::Batch b = model::Batch::of(seqs);
  const int64_t T = b.ntokens();
  const std::vector<int32_t> targets = train::next_token_targets(b);
  double fl = 0;
  for (int64_t i = 0; i < s.train_seqs; ++i)
    fl += 3 * (linear_flops(c, s.train_len, s.train_len) + attention_flops(c, 0, s.train_len));
  struct Variant {
    const char* prec;
    model::GemmMode gemm;
    const char* gemm_name;
  };
  const Variant variants[] = {{"fp32", model::GemmMode::RowInvariant, "row-invariant"},
                              {"fp32", model::GemmMode::Blas, "OpenBLAS"},
                              {"qat", model::GemmMode::RowInvariant, "row-invariant"},
                              {"qat", model::GemmMode::Blas, "OpenBLAS"}};
  for (const Variant& v : variants) {
    model::Weights w = s.w;
    model::Model m(w, model::PrecisionConfig::preset(v.prec));
    m.forward_gemm = v.gemm;
    train::AdamWConfig ac;
    ac.lr = 1e-5;
    train::AdamW opt(w.size(), ac, train::AdamW::decay_mask(w.layout));
    std::vector<float> logits(T * V), dlogits(T * V), grads(w.size());
    model::Activations acts;
    double best = 1e30, part[4] = {0, 0, 0, 0};
    for (int r = 0; r <= reps; ++r) {
      double t[4];
      double t0 = now();
      m.forward(b, logits.data(), &acts);
      t[0] = seconds_since(t0);
      t0 = now();
      train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data());
      t[1] = seconds_since(t0);
      t0 = now();
      std::fill(grads.begin(), grads.end(), 0.f);
      m.backward(acts, dlogits.data(), grads.data());
      t[2] = seconds_since(t0);
      t0 = now();
      opt.step(w.data.data(), grads.data());
      m.sync();
      t[3] = seconds_since(t0);
      const double total = t[0] + t[1] + t[2] + t[3];
      if (r > 0 && total < best) {
        best = total;
        std::copy(t, t + 4, part);
      }
    }
    const double gf = fl / best / 1e9;
    std::printf("%-8s %-13s %10.0f %9.2f %6.1f%% | %9.1f %9.1f %9.1f %9.1f\n", v.prec, v.gemm_name, T / best, gf,
                100 * gf / sgemm, 1e3 * part[0], 1e3 * part[1], 1e3 * part[2], 1e3 * part[3]);
    std::fflush(stdout);
  }
}

}  // namespace

int bench_model(const ModelBenchOptions& o) {
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  QUADS_CHECK(o.reps >= 1, "bench model: --reps must be >= 1 (got {})", o.reps);
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  const char* clk = std::getenv("QUADS_BENCH_CLOCK");
  g_cpu_clock = clk && std::string(clk) == "cpu";
  const Sgemm g = measure_sgemm(o.reps);
  std::printf("quads bench model: %d threads, best of %d, %s\n", threads, o.reps,
              g_cpu_clock ? "process CPU time (QUADS_BENCH_CLOCK=cpu: use with --threads 1)" : "wall-clock time");
  std::printf("OpenBLAS sgemm 1024^3: %.2f GFLOP/s (row-invariant GEMM, same shape: %.2f GFLOP/s); "
              "%%sgemm columns compare with the OpenBLAS number\n",
              g.blas, g.rowinv);
  std::printf("FLOPs: the linears each token runs (top-k experts only) + causal attention; training = 3x forward\n");

  std::vector<Setup> setups;
  {
    Setup s;
    s.name = "small (4 layers, hidden 256, 8 experts top-2, vocab 512, random weights seed 1)";
    s.w = model::Weights::random(bench_small_config(), 1);
    setups.push_back(std::move(s));
  }
  const std::string fx = fixtures_dir() + "/tiny_qwen3moe_a";
  if (std::filesystem::exists(fx + "/config.json")) {
    Setup s;
    s.name = "fixture tiny_qwen3moe_a (2 layers, hidden 64, 8 experts top-2, vocab 512)";
    s.w = model::Weights::load(fx);
    setups.push_back(std::move(s));
  } else {
    std::printf("(fixture %s not found: skipped)\n", fx.c_str());
  }
  const std::vector<std::string> modes = {"fp32", "bf16", "fp8", "nvfp4", "nvfp4-w4a16", "mxfp4"};
  for (const Setup& s : setups) {
    bench_inference(s, modes, g.blas, o.reps);
    bench_training(s, g.blas, o.reps);
  }
  return 0;
}

}  // namespace quads::rollout
