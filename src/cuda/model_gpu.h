#pragma once
// Qwen3-MoE forward with a KV cache on the GPU: the device twin of model::Model::step (model/model.h)
// for the rollout engine. C++17-clean host header, no CUDA types.
//
//   cuda::GpuModel g(weights, model::PrecisionConfig::preset("nvfp4"));
//   g.reset_cache(num_slots, max_len);
//   std::vector<float> logits = g.step(items);   // as Model::step: packed items appended to slots
//
// Weights live on the device in each linear's storage: BF16 (linears whose weight and activation
// are bf16), packed NVFP4 codes + E4M3 block scales + global amax (W4A4 linears: weight and
// activation NVFP4 with E2M1 elements and K % 64 == 0), quantized on the GPU by cuda::quantize,
// which is bit-identical to num::quantize, so the GPU holds exactly the CPU engine's quantized
// weights; FP8 (E4M3 weights in any FP8 block layout, FP8 activations, K % 16 == 0) keeps the E4M3
// codes and FP32 scales (1 byte per weight) and dequantizes them inside its GEMV (cuda/fp8_gemm.h);
// everything else (fp32, mxfp4, w4a16, NVFP4 with K % 64 != 0) keeps the effective
// weight W_eff = dequantize(quantize(W)) in float32 and fake-quantizes the activations, then runs
// an FP32 cuBLAS GEMM (exact emulation, as the CPU). The float32 master weights stay on the
// device too (embedding, norms; re-quantization at sync).
// GEMMs per linear:  bf16: X rounded to BF16, cuBLAS BF16 x BF16 -> FP32 accumulation;
//                    W4A4: X quantized per token by cuda::quantize with the linear's activation
//                          QConfig, then the emulated W4A4 GEMM (cuda/gemm.h);
//                    fake: cuBLAS SGEMM on the fake-quantized operands;
//                    fp8:  X fake-quantized, then the FP8 GEMV on the codes (up to
//                          QUADS_GPU_FP8_GEMV_ROWS rows, default 8), else W_eff dequantized
//                          into a scratch and cuBLAS SGEMM (prefill).
// Activations, norms, RoPE, attention, router softmax and the residual stream are float32, as
// on the CPU. The KV cache is float32: [layers][slots, max_len, n_kv, head_dim] for K and V.
// MoE: router softmax + top-k on the device; the [T, k] expert ids are copied to the host, where
// cpu::moe_permute groups the rows by expert (the CPU twin itself); one GEMM per active expert.
// RAC (model/rac.h) with static channels in whole 16-channel blocks: set_rac copies them from a
// CPU model calibrated there or on this GPU (rac_energy, RolloutEngine::calibrate_rac); W4A4
// linears run the residual through cuda::w4a4_gemm_gather on W's own codes, fake-quant linears
// through an SGEMM on the gathered W_eff columns.
// Inspection (rollout::StepBackend::step_inspect): step(items, &record, &act_error) copies each MoE
// layer's expert ids from the device (as Model::step records them) and measures each linear's
// activation error; the RL loop's routing replay and diagnostics read them.
// Not supported (quads::Error): dynamic RAC, KV hooks (set_kv_transform is their data form),
// routing replay (a rollout engine follows its own router).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/linear.h"
#include "model/model.h"
#include "model/weights.h"
#include "rollout/engine.h"

namespace quads::cuda {

// How one linear runs on the GPU.
enum class GpuLinearMode : uint8_t { Fake, BF16, W4A4, FP8 };
const char* gpu_linear_mode_name(GpuLinearMode m);

struct GpuModelStats {
  int64_t steps = 0;
  int64_t tokens = 0;        // tokens run through the layers
  int64_t expert_gemms = 0;  // (expert, GEMM) launches
  double weight_bytes = 0;   // GEMM weight bytes read (each linear's device storage, once per use)
  int64_t graph_steps = 0;   // steps run as a CUDA graph (decode, every MoE layer grouped)
  int64_t gemm_attention_steps = 0;  // prefills whose attention ran as FP32 SGEMMs (AttentionTc)
  int64_t graph_kernels = 0;  // kernel nodes of the last decode step captured as a CUDA graph
  int64_t rac_fold_gemms = 0;  // GEMMs with RAC folded in (cuda::w4a4_gemm_rac and its grouped twin)
  double gpu_seconds = 0;     // device time of the steps, from the input copy to the results copied
};

class GpuModel {
 public:
  // Allocates the device weights for `cfg` in precision `p`; call sync() or randomize() next.
  GpuModel(const model::ModelConfig& cfg, const model::PrecisionConfig& p);
  // ... and syncs `w`.
  GpuModel(const model::Weights& w, const model::PrecisionConfig& p);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const model::ModelConfig& config() const;
  const model::PrecisionConfig& precision() const;

  // Uploads the float32 master weights (same config and layout) and re-quantizes every linear.
  void sync(const model::Weights& w);
  // sync() from masters already in this GPU's memory (a GpuTrainer's, model::DeviceWeights with
  // device "cuda"): a device-to-device copy, then the same re-quantization.
  void sync_device(const model::DeviceWeights& w);
  // The float32 masters to the host (w: this model's layout).
  void download(model::Weights& w) const;
  // Random weights generated on the device (benchmarks: no host copy of a large model): matrices
  // N(0, stddev), norm weights 1; then re-quantizes.
  void randomize(uint64_t seed, float stddev = 0.02f);

  // RAC: every linear takes the rac_channels / rac_quant of the linear of the same name in the CPU
  // model `m` (same config and precision; call after model::rac_calibrate(m, ...) and again after
  // each re-calibration); linears without channels in `m` get none. Channels must form whole
  // 16-blocks (RacGranularity::Block16); W4A4 linears need the NVFP4 1x16 per-token residual format.
  void set_rac(const model::Model& m);
  // Benchmarks: every linear with quantized activations compensates its first
  // model::rac_count(in, ratio) channels with the default NVFP4 residual (RAC's cost, not a
  // calibrated choice). ratio <= 0 turns RAC off.
  void set_rac_first_channels(double ratio);

  // ReQAT's KV cache (model::KvTransform, built by reqat::make_kv_transform): the pre-RoPE Q-FIT
  // factor inside the q/k norm + RoPE kernel (between the two, as the CPU hook), then the new K/V
  // rows shifted and fake-quantized by cuda::fake_quantize (bit-identical to num::fake_quantize)
  // before attention reads them. An empty transform turns it off.
  void set_kv_transform(const model::KvTransform& t);

  // An empty cache of num_slots sequences of at most max_len positions each.
  void reset_cache(int num_slots, int64_t max_len);
  int num_slots() const;
  int64_t max_len() const;
  int64_t length(int slot) const;
  void clear(int slot);
  void copy(int src, int dst);  // dst becomes a copy of src

  // Model::step semantics: logits [rows, V] in item order (every new position of an item with
  // all_logits, else its last one). Slots distinct; a slot may not grow past max_len.
  // With `record`, also the expert ids each MoE layer chose for each token (model::Routing, as
  // Model::step fills it; such a step runs eagerly, not as a CUDA graph). With `act_error`, each
  // decoder linear's activation error added in by module name (rollout::ActError: the sums of
  // num::error_stats of its input against the operand it multiplies, as the CPU's probe,
  // rollout::act_error_probe, measures them); such a step runs the plain kernels (no fused norms,
  // folded RAC or grouped experts: their inputs never exist in FP32), one expert at a time.
  std::vector<float> step(const std::vector<model::StepItem>& items, model::Routing* record = nullptr,
                          std::map<std::string, rollout::ActError>* act_error = nullptr);
  // Static RAC's calibration pass (rollout::StepBackend::step_rac_energy): the step with RAC off
  // (throws while any linear has channels) and the plain kernels, as with act_error, adding each
  // quantized-activation linear's residual energy per input channel (model::rac_energy, through
  // kern::rac_energy: bit for bit on the same inputs) into energy[name], starting from the sums
  // there; lm_head over every row when it has them (all_logits).
  void rac_energy(const std::vector<model::StepItem>& items, std::map<std::string, std::vector<double>>& energy);
  // The same step, returning the arg-max token of each logits row (computed on the device).
  std::vector<int32_t> step_greedy(const std::vector<model::StepItem>& items);
  // The same step and the draws of `jobs` from its logits (rollout::StepBackend::step_sample):
  // greedy and temperature-only jobs on the device (kern::sample_rows: a token and a log-prob
  // back per draw), any others (top-k / top-p) by the host's sampler from the downloaded logits;
  // QUADS_GPU_SAMPLE=host sends every job there.
  std::vector<rollout::Draw> step_sample(const std::vector<model::StepItem>& items,
                                         const std::vector<rollout::SampleJob>& jobs);
  // rollout::StepBackend::decode_run: n decode steps queued back to back, each step's tokens the
  // draws of the step before, fed on the device (one wait for the host, at the end). Jobs the
  // device cannot draw (top-k / top-p, or set_device_sampling(false)) go a step at a time.
  std::vector<rollout::Draw> decode_run(std::vector<model::StepItem> items, std::vector<rollout::SampleJob> jobs, int n);
  void set_device_sampling(bool on);  // false: as QUADS_GPU_SAMPLE=host (benchmarks, tests)

  GpuLinearMode linear_mode(const std::string& module) const;  // throws for an unknown name
  size_t weight_bytes() const;  // device bytes of all GEMM weights (storage of every linear)
  const GpuModelStats& stats() const;
  void reset_stats();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The rollout engine's GPU backend (rollout::StepBackend over a GpuModel).
std::unique_ptr<rollout::StepBackend> make_gpu_backend(const model::Weights& w, const model::PrecisionConfig& p);

}  // namespace quads::cuda
