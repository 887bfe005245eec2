#pragma once
// The rollout engine: batched generation with a KV cache on the model's decode API.
//
//   RolloutEngine eng(master_weights, PrecisionConfig::preset("nvfp4"));
//   eng.sync(master_weights);                       // every RL step: copy + quantize once
//   auto out = eng.generate(requests);              // tokens + log-probs per request
//
// The engine owns a float32 copy of the weights and a model::Model over it in its precision mode;
// sync() copies the master weights and re-quantizes every linear once (Model::sync), through the
// same num:: path the trainer's QAT uses, so both sides see bit-identical quantized weights.
//
// Scheduling (continuous batching): up to `max_batch` sequences hold a KV-cache slot at once;
// each step feeds every running sequence its last sampled token and every new one the next chunk
// of its prompt (variable-length prompts, chunked prefill), all in one Model::step. A sequence
// ends at a stop token (kept in the output, with its log-prob) or after max_new_tokens; its slot
// goes to the next waiting request. Requests with identical prompts prefill once (share_prefill):
// the others copy the KV cache and the prompt's last logits, then sample with their own seeds.
//
// Batch invariance: a request's tokens and log-probs are a pure function of (weights, precision,
// prompt, sampling params, seed, max_new_tokens, stop ids) — bitwise the same alone or in any
// batch, whatever max_batch, chunking or prefill sharing — as long as the precision mode is
// batch-invariant (PrecisionConfig::batch_invariant(): per-token activation scales; the
// `*-tensor` presets take their activation scale over the whole step and are not) and the model
// runs its row-invariant GEMMs (GemmMode::RowInvariant, the default, which the engine keeps).
// The model makes each token's logits independent of the batch; the sampler (rollout/sampler.h)
// draws from a counter-based RNG keyed by (seed, position).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/rac.h"
#include "rollout/sampler.h"

namespace quads::rollout {

struct Request {
  std::vector<int32_t> prompt;    // at least one token
  int max_new_tokens = 16;        // >= 0
  std::vector<int32_t> stop_ids;  // generation ends after any of these (it is kept)
  SamplingParams sampling;
  uint64_t seed = 0;
};

enum class Finish : uint8_t { Length, Stop };
const char* finish_name(Finish f);  // "length" / "stop"

struct Result {
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;    // the new tokens
  std::vector<float> logprobs;    // one per new token (rollout/sampler.h says which distribution)
  Finish finish = Finish::Length;
  uint64_t seed = 0;
  std::vector<int32_t> ids() const;  // prompt followed by the new tokens
};

struct EngineOptions {
  int max_batch = 64;              // KV-cache slots: sequences in flight at once
  int64_t prefill_chunk = 512;     // at most this many prompt tokens of one sequence per step
  int64_t max_step_tokens = 2048;  // prompt tokens per step over all sequences (one chunk always fits)
  bool share_prefill = true;       // identical prompts prefill once and copy the KV cache
  // With a step backend, while every sequence decodes: up to this many steps in one
  // StepBackend::decode_run call (at most the fewest tokens any sequence has left), which a GPU
  // backend runs back to back with the drawn tokens fed back on the device, so that no step waits
  // for the host. The cost: a sequence that stops inside a run keeps its slot (and draws tokens
  // that are dropped) until the run ends, and a waiting request is admitted after it. With a
  // batch-invariant model the results are the same for any value; 1: a call a step.
  int decode_ahead = 8;
};

// Counters of the last generate() call (timings are wall-clock seconds, for reports only).
struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;   // prompt tokens run through the model
  int64_t shared_prompts = 0;   // sequences that copied another's prefill instead
  int64_t decode_tokens = 0;    // sampled tokens fed back
  int64_t generated = 0;        // tokens sampled
  int64_t dropped = 0;          // tokens drawn in a decode run after their sequence had ended
  int64_t decode_runs = 0;      // StepBackend::decode_run calls
  int64_t run_steps = 0;        // the steps they ran (counted in `steps` too)
  double seconds = 0;
};

// A linear's activation quantization error over the rows it was given: sq_err = sum (x - x_eff)^2 and
// sq_norm = sum x^2 over its input x, x_eff the operand it multiplies (fake-quantized or rounded to
// BF16; linears whose input is not rounded have none).
struct ActError {
  int layer = -1;
  double sq_err = 0, sq_norm = 0;
  int64_t rows = 0;
  void add(int l, double err, double norm, int64_t n) {
    layer = l;
    sq_err += err;
    sq_norm += norm;
    rows += n;
  }
};

// What a pass of the rollout model over finished sequences measures (RolloutEngine::inspect): the RL
// loop's routing replay and diagnostics.
struct Inspection {
  model::Routing routing;                     // [T, k] expert ids per MoE layer, in the batch's token order
  std::map<std::string, ActError> act_error;  // by module name (decoder layers only: not lm_head)
  // Per layer: the row-weighted mean over its linears of rel_mse = sq_err / sq_norm (0 where both are
  // 0; a linear whose rel_mse is not finite is left out), 0 for a layer without any.
  std::vector<double> act_qerr_layers(int layers) const;
};

// The CPU model's probe (model::ForwardOptions::probe) that adds each linear call's activation
// error into `out` (what Inspection::act_error holds).
model::LinearProbe act_error_probe(std::map<std::string, ActError>& out);

// A step backend other than the CPU model (the GPU: cuda::make_gpu_backend in cuda/model_gpu.h).
// With one set, the engine keeps its scheduling and sampling and calls it instead of
// model::Model::step on a model::KVCache; without one (the default) nothing changes.
class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual std::string name() const = 0;
  virtual void sync(const model::Weights& w) = 0;                 // re-upload and re-quantize
  virtual void reset(int num_slots, int64_t max_len) = 0;         // an empty cache
  virtual std::vector<float> step(const std::vector<model::StepItem>& items) = 0;  // Model::step
  // A step and the draws of `jobs` from its logits (rows: one per item). Default: step(), then
  // sample_jobs() on the host; a backend may draw on its device instead and move only the draws.
  virtual std::vector<Draw> step_sample(const std::vector<model::StepItem>& items, const std::vector<SampleJob>& jobs);
  // n (>= 1) decode steps in one call: `items` hold one token each and job i draws from row i; at
  // every later step item i is fed the token drawn for it at the step before and its job's pos
  // grows by one. Returns the draws of step 0, then step 1, ... (n * items.size()). Default:
  // step_sample n times, the host feeding the tokens back.
  virtual std::vector<Draw> decode_run(std::vector<model::StepItem> items, std::vector<SampleJob> jobs, int n);
  virtual void copy(int src, int dst) = 0;                        // KVCache::copy
  virtual void clear(int slot) = 0;                               // KVCache::clear
  // Static RAC channels from a calibrated CPU model of the same weights (model/rac.h); a backend
  // without RAC support throws quads::Error naming itself.
  virtual void set_rac(const model::Model& calibrated);
  // ReQAT's KV-cache transform (the CPU model's kv_hooks do not reach a backend; the engine refuses
  // to run a model with hooks on a backend without one). Default: throws unless t is empty.
  virtual void set_kv_transform(const model::KvTransform& t);
  virtual bool has_kv_transform() const { return false; }
  // step() that also measures this step into a fresh `out` (RolloutEngine::inspect): the routing
  // (as Model::step's `record`) and, with act_error, each linear's activation error. Default:
  // inspects() false and step_inspect throws naming the backend.
  virtual bool inspects(bool act_error) const { return false; }
  virtual std::vector<float> step_inspect(const std::vector<model::StepItem>& items, Inspection& out, bool act_error);
  // Static RAC's calibration pass on the backend (RolloutEngine::calibrate_rac): step() with RAC
  // off that adds each linear's residual energy (model::rac_energy of its input against the operand
  // it multiplies, rows in the CPU forward's order: experts one after another) into energy[name],
  // for every linear whose activations are quantized (QuantKind::Quant); absent names start at 0.
  // Default: calibrates_rac() false and step_rac_energy throws naming the backend.
  virtual bool calibrates_rac() const { return false; }
  virtual void step_rac_energy(const std::vector<model::StepItem>& items,
                               std::map<std::string, std::vector<double>>& energy);
  // Masters handed over in the backend's own memory (a GPU trainer's, model::DeviceWeights): with
  // syncs_from(w), sync_device(w) is sync() without the host, and download() gives the masters back
  // (the engine's host copy, when it needs one). Default: syncs_from false, the others throw.
  virtual bool syncs_from(const model::DeviceWeights& w) const { return false; }
  virtual void sync_device(const model::DeviceWeights& w);
  virtual void download(model::Weights& w) const;
};

// decode_run's preconditions (one token an item, last logits only, job i on row i, n >= 1);
// quads::Error naming `who` otherwise.
void check_decode_run(const std::vector<model::StepItem>& items, const std::vector<SampleJob>& jobs, int n,
                      const std::string& who);
// decode_run a step at a time through `step` (a step_sample), feeding each draw back on the host.
std::vector<Draw> decode_stepwise(
    std::vector<model::StepItem> items, std::vector<SampleJob> jobs, int n,
    const std::function<std::vector<Draw>(const std::vector<model::StepItem>&, const std::vector<SampleJob>&)>& step);

class RolloutEngine {
 public:
  // Copies `master` (config and float32 weights); its CPU model in precision `p` is quantized when
  // first used.
  RolloutEngine(const model::Weights& master, const model::PrecisionConfig& p, const EngineOptions& o = {});
  // Takes the weights over (no copy): for a command-line run that loads a checkpoint once.
  RolloutEngine(model::Weights&& weights, const model::PrecisionConfig& p, const EngineOptions& o = {});

  // Copies the master weights into the engine's own copy and re-quantizes them once. The master
  // must have the same configuration (the error names the first difference).
  void sync(const model::Weights& master);
  void sync(const float* master, size_t n);  // a flat buffer in this model's layout
  // The masters from device memory (a GPU trainer's, TrainBackend::device_masters) straight into
  // the backend when it syncs_from() them: returns false, changing nothing, when it cannot (no
  // backend, another device, another layout); the caller then syncs from the host. The engine's
  // host copy (and the CPU model) is fetched back from the backend only when next needed (model(),
  // set_backend, a CPU step).
  bool sync_device(const model::DeviceWeights& master);

  // Generates every request; results in request order. Throws quads::Error naming the request
  // for an empty prompt, a token id outside the vocabulary or invalid sampling parameters.
  std::vector<Result> generate(const std::vector<Request>& requests);

  // The CPU model (RAC calibration, diagnostics). It is quantized when first used, and with a
  // backend sync() leaves its re-quantization to the first use after it: an engine or an RL step
  // that never runs it on the CPU skips the work (the whole model quantized on the host).
  const model::Model& model() const {
    cpu_model_current();
    return *model_;
  }
  model::Model& model() {
    cpu_model_current();
    return *model_;
  }
  // The rollout model over every sequence of `b`, each run whole as the trainer's forward runs it
  // (teacher forcing): its expert choices and, with act_error, each linear's activation error
  // (Inspection). On the backend when it inspects, whole sequences in steps of at most
  // chunk_tokens tokens (a longer sequence alone; the backend's cache is reset, and generate()
  // starts from an empty one anyway), else one forward of the CPU model. The RL loop's routing
  // replay and diagnostics read it.
  Inspection inspect(const model::Batch& b, bool act_error, int64_t chunk_tokens = 8192);
  // Static RAC (model/rac.h) for the current weights: ranks each W4A4 linear's input channels on
  // `calib` and sets them on the CPU model and the backend. On a backend that calibrates_rac() the
  // calibration pass runs there (chunks as inspect()), with the same selection on the host
  // (model::rac_assign); else model::rac_calibrate on the CPU model, then set_rac on the backend.
  // Returns the number of linears with RAC.
  int calibrate_rac(const model::Batch& calib, const model::RacConfig& cfg, int64_t chunk_tokens = 8192);
  const model::ModelConfig& config() const { return weights_->cfg; }
  const model::PrecisionConfig& precision() const { return model_->precision(); }
  bool batch_invariant() const { return model_->precision().batch_invariant(); }
  EngineOptions options;
  const EngineStats& stats() const { return stats_; }

  // Runs the steps on `b` from now on (nullptr: back to the CPU model). sync() syncs both (the CPU
  // model when it is next used).
  void set_backend(std::unique_ptr<StepBackend> b) {
    host_current();
    backend_ = std::move(b);
  }
  StepBackend* backend() const { return backend_.get(); }

 private:
  std::unique_ptr<StepBackend> backend_;
  std::unique_ptr<model::Weights> weights_;
  std::unique_ptr<model::Model> model_;
  mutable bool model_stale_ = false;  // weights_ changed since model_ last quantized them
  mutable bool host_stale_ = false;   // weights_ behind the backend's (sync_device): download first
  void host_current() const {
    if (!host_stale_) return;
    backend_->download(*weights_);
    host_stale_ = false;
    model_stale_ = true;
  }
  void cpu_model_current() const {
    host_current();
    if (!model_stale_) return;
    model_->sync();
    model_stale_ = false;
  }
  EngineStats stats_;
};

// G requests per prompt (group sampling, as GRPO needs): request i*G + g gets seed
// base_seed + i*G + g and otherwise `proto`'s settings. With share_prefill the G members of a
// group prefill once.
std::vector<Request> group_requests(const std::vector<std::vector<int32_t>>& prompts, int G, uint64_t base_seed,
                                    const Request& proto);

}  // namespace quads::rollout
