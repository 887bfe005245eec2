#pragma once
// `quads bench model`: prefill and decode tokens/s of the rollout path per precision mode, and
// training tokens/s (forward + backward + AdamW), with the achieved GFLOP/s next to the machine's
// OpenBLAS sgemm GFLOP/s measured in the same run. Two models: a small random one (4 layers,
// hidden 256, 8 experts top-2, vocab 512) and the fixture checkpoint tiny_qwen3moe_a.
// Times are best-of-reps wall-clock; QUADS_BENCH_CLOCK=cpu switches to process CPU time, which
// with --threads 1 gives quiet-machine numbers on a machine busy with other jobs.
#include <cstdint>

#include "model/config.h"

namespace quads::rollout {

struct ModelBenchOptions {
  int threads = 0;  // 0: omp_get_max_threads()
  int reps = 3;     // timed repetitions per measurement (the best is reported)
};

int bench_model(const ModelBenchOptions& o);

// The small benchmark model (the numbers in the table are for this config).
model::ModelConfig bench_small_config();

// FLOPs (multiply-adds count 2) of one forward over `n` new tokens of a sequence whose first new
// token sits at position `start`: the linear layers the model runs (q, k, v, o, router, the top-k
// experts' gate/up/down or the dense MLP, per token), plus the lm_head for `logit_rows` rows.
double linear_flops(const model::ModelConfig& c, int64_t n, int64_t logit_rows);
// Causal attention scores and weighted values: token at position p attends to p + 1 keys.
double attention_flops(const model::ModelConfig& c, int64_t start, int64_t n);

}  // namespace quads::rollout
