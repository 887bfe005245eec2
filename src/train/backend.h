#pragma once
// Where the trainer's forward and backward run. The CPU path is model::Model itself; the GPU one
// (cuda::make_gpu_trainer in cuda/train_gpu.h) keeps the model on the device and exchanges only
// logits, dlogits, gradients and master weights with the host. The optimizer stays with the caller
// (train::AdamW on the host masters), so checkpoints and resume are the same on every device.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "train/adamw.h"

namespace quads::train {

// Every decoder layer's attention inputs over a packed batch, as a forward computes them: q [T, nh, hd]
// and k [T, nkv, hd] after q_norm / k_norm (before any KV transform and RoPE), v [T, nkv, hd].
// Q-FIT's calibration data (reqat/kv_quant.h).
struct AttentionInputs {
  std::vector<std::vector<float>> q, k, v;  // per layer
  std::vector<int64_t> offsets;             // sequence boundaries (Batch::offsets); positions restart in each
  int64_t T = 0;
};

// One candidate KV transform of one layer (model::KvTransform's per-layer data): q *= factor and
// k /= factor before RoPE, k -= shift after it (each empty: none).
struct KvCandidate {
  std::vector<float> factor, shift;
};

// Throws a quads::Error naming `who` unless layer l of `in` holds q/k/v of in.T tokens of model c,
// in.offsets cover those tokens, and every candidate's factor and shift is empty or kv_dim long.
void check_attention_inputs(const model::ModelConfig& c, const AttentionInputs& in, int l,
                            const std::vector<KvCandidate>& cands, const std::string& who);

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;
  virtual std::string name() const = 0;  // e.g. "cuda:NVIDIA H200"
  // The training forward of model::Model::forward over a packed batch: logits [T, V] to the host.
  // With `keep`, keeps what backward() needs (one forward at a time). `record` (optional) receives
  // the expert choices, as ForwardOptions::record; `replay` (optional) routes every token to the
  // given experts, as ForwardOptions::replay (routing replay).
  virtual void forward(const model::Batch& b, float* logits, bool keep, model::Routing* record = nullptr,
                       const model::Routing* replay = nullptr) = 0;
  // From dL/dlogits [T, V] (host) of the last kept forward: ADDS the gradient with respect to every
  // parameter into grads (host, weights layout), as model::Model::backward. grads may be null with
  // has_optimizer(): the gradient then stays with the backend for optimizer_step().
  virtual void backward(const float* dlogits, float* grads) = 0;
  // The host masters changed (optimizer step, resume): upload and re-quantize (model::Model::sync).
  virtual void sync(const model::Weights& w) = 0;
  // ReQAT's KV-cache transform in the training forward and backward (the data the CPU model's
  // KvHooks are made from, model::KvTransform). A backend without one accepts an empty transform
  // only.
  virtual void set_kv_transform(const model::KvTransform& t);
  // Q-FIT's calibration on the backend's device (reqat::calibrate_qfit). capture_attention: the
  // attention inputs of a forward of b, run without the KV transform. attention_mse: for layer l of
  // such a capture, the mean squared difference between the causal attention output (per sequence)
  // under each candidate, K and V then fake-quantized with kv (null: not), and the plain float32
  // attention. Either may end what a kept forward left for backward(). A backend without them throws.
  virtual void capture_attention(const model::Batch& b, AttentionInputs* out);
  virtual std::vector<double> attention_mse(const AttentionInputs& in, int l, const std::vector<KvCandidate>& cands,
                                            const num::QConfig* kv);

  // Router aux / z losses (model::ForwardOptions' coefficients) in the following forwards and
  // backwards; router_losses() gives the last forward's values, unscaled. A backend without them
  // accepts 0 and 0 only.
  virtual void set_router_losses(double aux_loss_coef, double z_loss_coef);
  struct RouterLosses {
    double aux = 0, z = 0;
  };
  virtual RouterLosses router_losses() const { return {}; }
  // Optional: AdamW where the masters are (a GPU keeps masters, m and v on the device, so a step
  // moves no gradient or weight over PCIe). With has_optimizer(), a caller may run
  //   backward(dlogits, nullptr); optimizer_step(opt, lr);
  // instead of a host step, and download() whenever it needs the host masters (weight sync,
  // checkpoint). The host AdamW `opt` carries the configuration and the step count (t is
  // incremented as AdamW::step does); its m and v are only filled by download().
  virtual bool has_optimizer() const { return false; }
  // Clip + one AdamW step (train::AdamW::step's arithmetic) on the last backward's gradient; lr > 0
  // overrides opt.cfg.lr. Returns the gradient norm before clipping.
  virtual double optimizer_step(AdamW& opt, double lr = 0);
  // The masters (and with opt, AdamW's m and v) to the host.
  virtual void download(model::Weights& w, AdamW* opt);
  // AdamW's m and v to the backend (resume); the masters go with sync().
  virtual void upload_optimizer(const AdamW& opt);
  // With has_optimizer(): the masters where they live (device memory), for an engine on the same
  // device to sync from without the host (rollout::RolloutEngine::sync_device). Valid until the
  // next optimizer_step or sync; the backend's queued work on them has finished. Empty when the
  // masters are not in device memory (the default).
  virtual model::DeviceWeights device_masters() { return {}; }
};

// Makes a trainer backend for weights w in precision p (a trainer preset: fp32, bf16, qat, ...).
using TrainBackendFactory =
    std::function<std::unique_ptr<TrainBackend>(const model::Weights& w, const model::PrecisionConfig& p)>;

// quads_core does not link the CUDA library: a binary that does installs the GPU factory
// (rl::install_cuda_rollouts in rl/run.h); the RL loop and SFT ask for it with `device = "cuda"`.
// gpu_train_backend_factory() throws a quads::Error naming the setting when none is installed.
void register_gpu_train_backend(TrainBackendFactory f);
TrainBackendFactory gpu_train_backend_factory();

}  // namespace quads::train
