#pragma once
// Qwen3-MoE training on the GPU: the device twin of model::Model::forward / backward plus the
// optimizer (train::AdamW) on device-resident masters. C++17-clean host header, no CUDA types.
//
//   cuda::GpuTrainer g(weights, model::PrecisionConfig::preset("qat"));
//   g.forward(batch, nullptr, /*keep=*/true);
//   double loss = g.loss_ce(train::next_token_targets(batch));  // CE + backward, logits stay on the device
//   double gnorm = g.adamw_step(adamw_cfg, ++t);                   // clip + AdamW + re-quantize
//   g.zero_grad();
//
// What lives on the device: the float32 masters (model/weights.h layout), the gradients (same
// layout, accumulated over backward() calls until zero_grad()), AdamW's m and v (allocated at the
// first adamw_step), every linear's effective weight, and the activations of the last kept forward.
//
// Linears run in one of two ways (model/linear.h has the numerics):
//  - exact (any precision; the CPU's arithmetic): W_eff = cuda::fake_quantize of the master
//    (bit-identical to model::quantize_weight; bf16 weights through kern::bf16_round), X_eff = the
//    activation quantizer (none / bf16 round / cuda::fake_quantize per call), FP32 cuBLAS SGEMMs
//    (no TF32) for Y = X_eff·W_effᵀ, dX = dY·W_eff, dW += dYᵀ·X_eff.
//  - fast (weight bf16 and activation bf16: `bf16`; or weight NVFP4 1x16 E2M1 with a per-tensor
//    global scale and activation bf16: `qat`): BF16 tensor-core GEMMs (cublasGemmEx, BF16 inputs,
//    FP32 accumulation and output). The NVFP4 weight operand is code * E4M3 block scale stored as
//    BF16 (exact: E2M1 x E4M3 has at most 6 significant bits) and the global decode scale
//    amax * fp32(1/2688) is the GEMM's alpha, as the rollout's emulated W4A4 GEMM applies it; the
//    operand times alpha equals the CPU's W_eff up to the rounding of the scale product (a few ulp).
//    Backward: dY is rounded to BF16 for both dX = dY·W and dW = dYᵀ·X (what BF16 training
//    frameworks do; the CPU keeps dY in float32), FP32 accumulation, dW added into the float32
//    gradient (beta = 1). Expect gradients within ~1e-2 relative L2 of the CPU's in these presets.
// Layer ops (norms, RoPE, attention, router, SwiGLU, MoE combine, losses, AdamW) run in float32
// with the kernels of cuda/train_kernels.h; reductions in a fixed order, so runs are repeatable.
// Attention: where every linear runs the fast path (bf16, qat) the default is the tensor-core
// attention of cuda/attention_tc.h (BF16 Q, K, V, P, dO, dS operands, FP32 accumulation and
// softmax: what BF16 trainers run as flash attention; ~5e-3 relative to the FP32 kernels);
// otherwise (fp32, every exact-emulation preset) the exact FP32 kernels kern::attention_train_*,
// which keep the CPU-equal reference. QUADS_GPU_TRAIN_ATTN=exact|tc or set_attention() override.
// MoE: routing on the device (kern::router_topk_fwd, kern::moe_route); the [E+1] expert offsets
// are copied to the host once per MoE layer in the forward (one sync), then each active expert's
// GEMMs (gate and up fused where their weights share the scale). Fast path, opt-in:
// QUADS_GPU_TRAIN_GROUPED=1 / set_expert_gemms("grouped") runs a layer's expert GEMMs of one kind
// as one cublasGemmGroupedBatchedEx (a group per expert GEMM, the NVFP4 alpha per group); cuBLAS
// 13.1 refuses BF16 inputs with FP32 output there (CUBLAS_STATUS_NOT_SUPPORTED on the H200), and
// the trainer then stays per expert. Default ("streams"): the per-expert GEMMs spread over 8
// streams, each expert's GEMMs in order on one of them (the same cuBLASLt problems and algorithms
// as "per-expert", so the same bits; 52.6 vs 70.7 ms of GEMMs per 8x1024 step of the peer model on
// the H200 once the expert GEMMs stopped paying cuBLAS heuristics per shape).
// QUADS_GPU_TRAIN_GROUPED=0 or "per-expert": one GEMM per expert on the trainer's stream.
// The fast path's GEMMs run through cuBLASLt with an algorithm per shape bucket (train_gpu.cpp,
// LtGemms); QUADS_GPU_TRAIN_LT=0 uses cublasGemmEx.
// Not supported (quads::Error): KV hooks (set_kv_transform is their data form), RAC, stochastic
// weight rounding, static activation scales without an amax in the QConfig.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/linear.h"
#include "model/model.h"
#include "model/weights.h"
#include "train/adamw.h"
#include "train/backend.h"

namespace quads::cuda {

class GpuTrainer {
 public:
  GpuTrainer(const model::Weights& w, const model::PrecisionConfig& p);
  // Random weights generated on the device (benchmarks: no host copy of a large model): matrices
  // N(0, stddev), norm weights 1.
  GpuTrainer(const model::ModelConfig& cfg, const model::PrecisionConfig& p, uint64_t seed, float stddev = 0.02f);
  ~GpuTrainer();
  GpuTrainer(const GpuTrainer&) = delete;
  GpuTrainer& operator=(const GpuTrainer&) = delete;

  const model::ModelConfig& config() const;
  const model::PrecisionConfig& precision() const;
  std::string device_name() const;

  // Masters to the device (same config and layout) and re-quantization of every linear
  // (model::Model::sync). Gradients and optimizer state are kept.
  void upload(const model::Weights& w);
  // Device masters to the host (w must have this model's config and layout).
  void download(model::Weights& w) const;
  // The device masters as they are once the trainer's queued work ends (it waits for it), for
  // another engine on this GPU (cuda::GpuModel::sync_device): valid until the next upload or
  // AdamW step.
  model::DeviceWeights device_masters() const;

  // model::Model::forward over a packed batch (positions restart per sequence; attention never
  // crosses sequences). logits [T, V] to the host when non-null (else they stay on the device).
  // keep: keep what backward() needs (one forward at a time). record: the expert choices, as
  // ForwardOptions::record; replay: routing replay, as ForwardOptions::replay.
  void forward(const model::Batch& b, float* logits_host, bool keep, model::Routing* record = nullptr,
               const model::Routing* replay = nullptr);
  // Router aux (load-balancing) and z losses, as model::ForwardOptions' aux_loss_coef and
  // z_loss_coef: from the next forward, backward() adds their gradients (model::Model::backward's
  // terms) to the one from dlogits. Their statistics go to the host at every MoE layer (a copy of
  // the router's probabilities and logits): with both 0 (the default) the forward does no such work.
  void set_router_losses(double aux_loss_coef, double z_loss_coef);
  // The last forward's losses, unscaled (model::Activations::aux_loss / z_loss); 0 while both
  // coefficients are 0.
  double aux_loss() const;
  double z_loss() const;
  // ReQAT's KV-cache transform (model::KvTransform, the data of the CPU model's KvHooks): after the
  // q/k head norms the pre-RoPE factor, after RoPE the key shift and the K/V fake quantization
  // (over all of a forward's rows at once, as the CPU hook); the backward is straight-through for
  // the post-RoPE part and the factor's diagonal map for the pre-RoPE one. An empty transform
  // removes it. Applies from the next forward.
  void set_kv_transform(const model::KvTransform& t);
  // Q-FIT's calibration (train::TrainBackend's): every layer's attention inputs of a forward of b
  // (run without the KV transform; logits stay on the device), and for layer l of such a capture
  // the attention's MSE under each candidate against the float32 attention, on the exact FP32
  // attention kernels whatever the trainer's attention setting. Both end a kept forward.
  void capture_attention(const model::Batch& b, train::AttentionInputs* out);
  std::vector<double> attention_mse(const train::AttentionInputs& in, int l, const std::vector<train::KvCandidate>& cands,
                                    const num::QConfig* kv);
  // From dL/dlogits [T, V] (host) of the last kept forward: adds the gradient of every parameter
  // to the device gradients; with grads_host (weights layout), this call's gradient is also ADDED
  // to it (a download of the whole gradient).
  void backward(const float* dlogits_host, float* grads_host = nullptr);
  // The SFT / benchmark path, all on the device after a kept forward: mean next-token cross-entropy
  // over the rows with targets[t] >= 0 (kern::token_logprobs), then, with run_backward, the backward
  // from its dlogits (kern::token_logprobs_bwd with dlogp = -1/N). No logits leave the device;
  // returns the loss (one small copy of the per-row log-probs).
  double loss_ce(const std::vector<int32_t>& targets, bool run_backward = true);
  void zero_grad();
  std::vector<float> grads() const;  // the device gradients (weights layout)

  // Clipping by global norm (cfg.max_grad_norm > 0) and one AdamW step on the device with the
  // float32 constants of train::AdamW::step for step number t (1 for the first step: AdamW::t after
  // its increment); lr > 0 overrides cfg.lr. Decay mask from train::AdamW::decay_mask. Then
  // re-quantizes every linear. Returns the gradient norm before clipping. Gradients are left
  // (clipped) in place: call zero_grad() before the next accumulation.
  double adamw_step(const train::AdamWConfig& cfg, int64_t t, double lr = 0);
  // AdamW's moments (empty before the first step), for tests and checkpoints.
  void adam_state(std::vector<float>* m, std::vector<float>* v) const;
  // ... and back to the device (resume from a checkpoint); sizes must match the model.
  void set_adam_state(const std::vector<float>& m, const std::vector<float>& v);

  // Attention: "tc" or "exact" (see above); applies from the next forward.
  void set_attention(const std::string& which);
  std::string attention() const;
  // Expert GEMMs of the fast path: "per-expert", "grouped" or "streams"; expert_gemms() says what
  // runs ("per-expert (cuBLAS refused grouped)" after a refusal).
  void set_expert_gemms(const std::string& which);
  std::string expert_gemms() const;

  // Profiling (benchmarks): with it on, CUDA events split the GPU time into GEMMs, attention, MoE
  // routing (including its host sync), losses, optimizer, re-quantization and the rest;
  // profile_report() returns the milliseconds accumulated since the last report and resets them.
  void set_profiling(bool on);
  std::string profile_report();

  // ---- introspection (tests)
  // "exact" or "fast" for a linear (HF module name); throws for an unknown one.
  std::string linear_path(const std::string& module) const;
  // The fast path's BF16 weight operand of a linear [out, in] (raw bits) and its GEMM alpha (1 for
  // bf16 weights, amax * fp32(1/2688) for NVFP4).
  std::vector<uint16_t> fast_weight(const std::string& module, float* alpha) const;
  // The effective weights of the exact path (weights layout; only exact linears are meaningful).
  std::vector<float> exact_weights() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// train::TrainBackend over a GpuTrainer (name() = "cuda:" + device name): forward/backward through
// host buffers; sync() uploads the host masters; has_optimizer(): AdamW on the device
// (optimizer_step = adamw_step with the host AdamW's configuration and step count, download =
// masters and moments to the host, upload_optimizer = set_adam_state).
std::unique_ptr<train::TrainBackend> make_gpu_trainer(const model::Weights& w, const model::PrecisionConfig& p);

}  // namespace quads::cuda
