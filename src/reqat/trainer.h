#pragma once
// The small supervised trainer ReQAT needs (the RL helper's SFT loop did not exist when this was
// written): next-token cross-entropy on the response tokens of SftExamples, optionally plus SEM,
// AdamW with linear warm-up and cosine decay, and the evaluation (greedy pass@1 through the rollout
// engine in any precision, with the KV-cache hooks). Whatever numerics the model is in (its
// PrecisionConfig and kv_hooks) are the training numerics: fp32 for stage 1, `qat-sym` + KV4 hooks
// (straight-through everywhere) for stage 2.
//
// Data order: step s uses examples (s*batch + i) mod N, i < batch; two runs over the same list with
// the same batch size see the very same sequences in the same order (trace alignment).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/model.h"
#include "reqat/kv_quant.h"
#include "reqat/sem.h"
#include "rl/char_tokenizer.h"
#include "rl/tasks.h"

namespace quads::reqat {

struct TrainSpec {
  int64_t steps = 100;
  int64_t batch = 32;
  double lr = 1e-3;
  int64_t warmup = 10;
  double min_lr_ratio = 0.1;  // cosine decays to lr * this
  double weight_decay = 0.0;
  double grad_clip = 1.0;
  bool sem = false;
  SemConfig sem_cfg;
  std::string label = "train";  // progress bar
  bool progress = true;
  // cpu: model::Model's forward and backward, train::AdamW here. cuda: the GPU trainer
  // (train::gpu_train_backend_factory) in the model's precision, AdamW on the device, the masters
  // back to the model at the end (a backend without an optimizer: AdamW here on the gradients it
  // returns, the masters synced to it after each step); the losses (CE, SEM) stay here, on the
  // logits it returns.
  std::string device = "cpu";
  // The model's KV hooks as data (reqat::make_kv_transform), for the cuda device, which cannot call
  // them; it must be empty exactly when the model has no hooks.
  model::KvTransform kv;
};

struct TrainStepLog {
  int64_t step = 0;
  double loss = 0, ce = 0, sem = 0, grad_norm = 0, lr = 0;
  double mean_entropy = 0;  // over response tokens
};

// Learning rate at step s (0-based).
double lr_at(const TrainSpec& s, int64_t step);

// Trains the model's master weights in place (re-syncs its quantized weights after every step; on
// the cuda device, once at the end). Returns the per-step log; `device` (optional) receives where
// the forward and backward ran ("cpu" or the GPU trainer's name).
std::vector<TrainStepLog> train_sft(model::Model& m, const std::vector<rl::SftExample>& data, const TrainSpec& spec,
                                    std::string* device = nullptr);

// Cross-entropy (mean over response tokens) of the model on examples, in its current numerics.
double eval_loss(model::Model& m, const std::vector<rl::SftExample>& data, int64_t batch = 64);

// How a model is run at evaluation.
struct InferSpec {
  std::string precision = "fp32";  // model::PrecisionConfig preset ("nvfp4" = W4A4)
  KvQuantConfig kv;                // KV4 hooks (kv.enabled = false: float32 cache)
  const QFit* qfit = nullptr;      // Q-FIT hooks (with or without KV quantization)
  std::string device = "cpu";      // cuda: the GPU step backend with the same KV transform
  std::string describe() const;
};
inline InferSpec fp_infer() { InferSpec s; s.kv.enabled = false; return s; }
inline InferSpec w4a4kv4_infer(const KvQuantConfig& kv, const QFit* q = nullptr) {
  InferSpec s; s.precision = "nvfp4"; s.kv = kv; s.qfit = q; return s;
}

struct EvalResult {
  rl::EvalScore score;
  std::vector<std::vector<int32_t>> responses;  // generated ids per task (eos included when emitted)
  std::vector<rl::Verdict> verdicts;
  std::string device = "cpu";  // where the rollouts ran (the step backend's name)
};

// Greedy pass@1 over `tasks` with the rollout engine in `spec`'s numerics.
EvalResult evaluate(const model::Weights& w, const InferSpec& spec, const std::vector<rl::Task>& tasks,
                    const rl::CharTokenizer& tok, int max_new_tokens, int max_batch = 64);

// Model config of the tasks' model from the [model] keys.
model::ModelConfig task_model_config(int64_t hidden, int64_t layers, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, int64_t experts, int64_t experts_per_token,
                                     int64_t moe_intermediate, int64_t max_seq_len, double rope_theta,
                                     double rms_eps, int vocab);

}  // namespace quads::reqat
