#pragma once
// One GRPO run in one mode (rl/modes.h): a rollout engine and a trainer with separate weights.
// Every step (DESIGN.md, "One RL step"):
// Inputs (rl/task_source.h): the base folder with the generated tasks, or with [data] model set,
// that model folder with its HF tokenizer and the JSONL datasets (out_dir/data.json records which).
//   sync      engine.sync(trainer master weights): copy + quantize once (shared num:: path);
//             with RAC, rank the residual channels on a fixed calibration batch (static RAC)
//   rollout   P prompts x G samples at rl.temperature; rewards by the task verifier
//   diag      the rollout model re-runs the sampled sequences (training forward, bitwise the same
//             as the decode path) recording its expert choices and, through a LinearProbe, the
//             per-layer activation quantization error (num::error_stats)
//   trainer   logp_old = the trainer's log-probs of the sampled tokens before the update (its own
//             numerics: bf16, asymmetric or symmetric QAT), compared with the rollout's log-probs
//             (rl::Mismatch); routing mismatch per layer; group-normalized advantages; clipped PG
//             loss (optional KL to the base, optional TIS), token- or sequence-level aggregation,
//             rl.minibatches AdamW steps, straight-through gradients to the float32 masters
//   eval      every rl.eval_every steps and at the end: greedy pass@1 on the held-out set with the
//             rollout precision and with fp32
// Rows go to out_dir/metrics.jsonl (keys: rl/report.h, plus the ones listed in docs/quads.md).
//
// Determinism: everything random is a pure function of (run seed, step): the prompts of step s are
// training tasks [seed * 2^32 + s * P, ... + P) (a dataset: positions s*P .. s*P+P-1 of seeded
// per-epoch shuffles, TaskSource::train_batch), sample j of step s has sampling seed
// hash(seed, s) + j. So a run is bitwise repeatable, and a checkpoint (trainer weights, AdamW
// moments and step count, the step, the metrics so far) resumes it bitwise identically.
// Checkpoints: out_dir/checkpoint/ written as checkpoint.tmp/ and renamed into place.
// A NaN or Inf in the loss or the gradients stops the run with an error naming the step; the last
// checkpoint written before it stays as it was.
//
// Device (rl.device): "cpu" runs everything above on the CPU. "cuda" gives the rollout engine and
// the fp32 evaluation engine a GPU step backend (rollout::StepBackend): rollouts and evaluation
// decode on the GPU, engine.sync re-uploads the weights every step, and static RAC is calibrated on
// the engine's CPU twin and its channels copied to the GPU after each calibration. The trainer and
// the diagnostics forward (it records expert choices, which the GPU model does not) stay on the
// CPU, on the same synced rollout weights. GPU sums run in another order than the CPU's, so a cuda
// run is repeatable on one GPU but not bitwise the CPU run.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.h"
#include "rl/config.h"
#include "rl/report.h"
#include "rollout/engine.h"

namespace quads::rl {

struct RunOptions {
  std::string mode = "bf16";
  int64_t seed = 1;
  std::string base_dir;  // base checkpoint (quads sft); unused when cfg.data.model is set
  std::string out_dir;   // run folder
  bool resume = false;   // continue from out_dir/checkpoint if there is one
  bool progress = true;
  std::string label;     // progress bar label (default: "mode s<seed>")
  // Called with every metrics row as it is written (progress of a comparison).
  std::function<void(const nlohmann::json& row)> on_row;
  // Tests: stop (as if interrupted) once this many steps are done; -1 = run to rl.steps.
  int64_t stop_after = -1;
  // Tests: called with the gradients of every minibatch before the NaN check (inject a NaN).
  std::function<void(int64_t step, float* grads, size_t n)> grad_hook;
};

struct RunOutcome {
  std::vector<nlohmann::json> rows;  // every metrics row of the run (resumed ones included)
  int64_t steps_done = 0;
  double seconds = 0;                // wall time of the run, across resumes
  std::string device = "cpu";        // where the rollouts ran: "cpu" or the backend's name ("cuda:<GPU>")
  std::string train_device = "cpu";  // where the trainer's forward/backward ran (same naming)
};

RunOutcome run_rl(const RunConfig& cfg, const RunOptions& opt);

// The summary numbers of one run from its rows (issue 4's definitions): base_pass1 = eval at step
// 0; final_pass1 = last eval; best_pass1 = max eval; mean_abs_logp_gap = mean over train steps of
// the per-step mean |gap|; max_abs_logp_gap = mean over train steps of the per-step max |gap|;
// collapsed = final_pass1 < best_pass1 - margin; seconds = the run's wall time.
RunResult summarize_rows(const std::vector<nlohmann::json>& rows, double collapse_margin);

// The step backend of rl.device = "cuda" (static RAC channels reach it through set_rac).
using RolloutBackendFactory =
    std::function<std::unique_ptr<rollout::StepBackend>(const model::Weights& w, const model::PrecisionConfig& p)>;
// quads_core (which holds run_rl) does not link the CUDA library, so a binary that does installs
// the factory (install_cuda_rollouts() below); without one, rl.device = "cuda" is an error.
void set_rollout_backend_factory(RolloutBackendFactory f);
// The installed factory; a quads::Error naming rl.device when there is none.
RolloutBackendFactory rollout_backend_factory();

}  // namespace quads::rl

#ifdef QUADS_HAVE_CUDA
// Only where quads_cuda is linked (it defines QUADS_HAVE_CUDA for its users): the quads binary
// and quads_cuda_tests call this once before run_rl / run_compare (GPU rollouts and the GPU trainer).
#include "common/error.h"
#include "cuda/device.h"
#include "cuda/model_gpu.h"
#include "cuda/train_gpu.h"
#include "train/backend.h"

namespace quads::rl {

inline void install_cuda_rollouts() {
  set_rollout_backend_factory([](const model::Weights& w, const model::PrecisionConfig& p) {
    QUADS_CHECK(cuda::device_count() > 0, "rl.device = \"cuda\": no CUDA device found (set rl.device = \"cpu\")");
    return cuda::make_gpu_backend(w, p);
  });
  train::register_gpu_train_backend([](const model::Weights& w, const model::PrecisionConfig& p) {
    QUADS_CHECK(cuda::device_count() > 0, "rl.train_device = \"cuda\": no CUDA device found (set rl.train_device = \"cpu\")");
    return cuda::make_gpu_trainer(w, p);
  });
}

}  // namespace quads::rl
#endif
