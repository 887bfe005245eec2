#pragma once
// Qwen3-MoE on the CPU: the training forward, a hand-written backward for every parameter, and a
// decode API with a KV cache for the rollout engine. Semantics follow Hugging Face's
// modeling_qwen3_moe.py (RMSNorm in float32, per-head q/k RMSNorm before RoPE, rotate-half RoPE,
// GQA, causal softmax, softmax router over all experts in float32 with top-k and optional
// renormalization, SwiGLU experts scaled by their routing weight, dense MLP layers by
// mlp_only_layers / decoder_sparse_step, final norm, lm_head or tied embeddings).
//
// Batches are PACKED: sequences are concatenated; `Batch::offsets` marks the boundaries,
// positions restart at 0 in every sequence, and attention never crosses a boundary. There is no
// padding anywhere.
//
// Numerics: every linear layer runs in its precision mode (model/linear.h). The forward GEMMs
// are row-invariant by default (cpu::gemm_nt_rowinv): the numbers computed for one token depend
// only on that token's inputs, never on how many other rows share the GEMM. Together with
// per-token activation scales and per-sequence attention this makes the forward batch-invariant:
// a sequence's logits are bitwise the same alone, in any batch, in the training forward and in
// the decode path (prefill or token by token through the KV cache).
//
// Threads: OpenMP across tokens / heads / experts; every reduction runs in a fixed order, so
// results are bitwise repeatable (and independent of the number of threads).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/linear.h"
#include "model/weights.h"

namespace quads::model {

// Sequences packed back to back.
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};  // nseq + 1 entries; sequence s is tokens[offsets[s], offsets[s+1])

  int64_t ntokens() const { return static_cast<int64_t>(tokens.size()); }
  int nseq() const { return static_cast<int>(offsets.size()) - 1; }
  int64_t seq_len(int s) const { return offsets[s + 1] - offsets[s]; }
  void add(const std::vector<int32_t>& seq);
  static Batch of(const std::vector<std::vector<int32_t>>& seqs);
};

// Hooks on keys and values, for KV-cache quantization (ReQAT). Tensors are [n, heads, head_dim]
// rows of one layer: `q`/`k` after q_norm/k_norm and before RoPE; `k`/`v` after RoPE, before
// they are used and stored in the cache (so the cache holds what the hook returns). The backward
// passes gradients through post_rope unchanged (straight-through) and through pre_rope with
// pre_rope_backward when set (e.g. for a per-channel key scaling), else unchanged.
struct KvHooks {
  std::function<void(int layer, float* q, float* k, int64_t n)> pre_rope;
  std::function<void(int layer, float* dq, float* dk, int64_t n)> pre_rope_backward;
  std::function<void(int layer, float* k, float* v, int64_t n)> post_rope;
  bool empty() const { return !pre_rope && !post_rope; }
};

// The same transform as data (reqat::make_kv_transform builds it and the CPU hooks from it), for
// step backends that cannot call KvHooks (the GPU): per decoder layer an optional pre-RoPE factor
// f [n_kv * head_dim] (queries *= f of their kv head, keys /= f), an optional post-RoPE key shift
// m [n_kv * head_dim] (keys -= m), then, with `quantize`, K and V fake-quantized per (token, kv head)
// row of head_dim values with `qconfig`.
struct KvTransform {
  std::vector<std::vector<float>> factor, shift;  // per layer, or empty; an empty entry: identity
  bool quantize = false;
  num::QConfig qconfig;
  bool empty() const {
    for (const auto& f : factor) if (!f.empty()) return false;
    for (const auto& m : shift) if (!m.empty()) return false;
    return !quantize;
  }
  // Throws a quads::Error naming `who` where the transform does not fit model c (layer count,
  // vector lengths, head_dim a multiple of 16 for the quantizer's blocks).
  void validate(const ModelConfig& c, const std::string& who) const;
};

// Expert choices: for each decoder layer, [T, k] expert ids (empty for dense layers), T in batch
// order. Recorded by forward/step on request, or replayed by the training forward (routing
// replay: the expert SET is taken from the replay, the weights from this model's own router
// probabilities, renormalized as configured).
struct Routing {
  std::vector<std::vector<int32_t>> experts;
};

// Called for each linear layer in the forward with its input X [M, in], the quantized operand
// X_eff (== X when the activation quantizer is None) and the output Y [M, out]: for calibration
// (static activation scales, RAC channel selection) and error analysis.
using LinearProbe = std::function<void(const LinearQ& L, const float* X, const float* X_eff, const float* Y, int64_t M)>;

struct ForwardOptions {
  double aux_loss_coef = 0;  // load-balancing loss (HF: router_aux_loss_coef, see ModelConfig)
  double z_loss_coef = 0;    // router z-loss: mean over MoE layers and tokens of logsumexp(router logits)^2
  const Routing* replay = nullptr;
  Routing* record = nullptr;
  LinearProbe probe;
};

// What the backward needs from a forward. Reusable: buffers are kept between calls.
class Activations {
 public:
  Activations();
  ~Activations();
  Activations(Activations&&) noexcept;
  Activations& operator=(Activations&&) noexcept;
  // Load-balancing loss E * sum_e f_e P_e over all MoE layers' tokens concatenated (as HF's
  // load_balancing_loss_func computes it), and the router z-loss; unscaled.
  double aux_loss() const;
  double z_loss() const;
  int64_t ntokens() const;

  struct Impl;
  std::unique_ptr<Impl> impl;
};

// Per-sequence KV cache: float32 K (after RoPE and hooks) and V per layer, [length, n_kv, head_dim].
class KVCache {
 public:
  KVCache(const ModelConfig& cfg, int num_slots);
  int num_slots() const { return static_cast<int>(len_.size()); }
  int64_t length(int slot) const { return len_.at(slot); }
  void clear(int slot) { truncate(slot, 0); }
  void truncate(int slot, int64_t len);  // keep the first len positions
  void copy(int src, int dst);           // dst becomes a copy of src (share a prefilled prompt)
  float* keys(int layer, int slot) { return k_[index(layer, slot)].data(); }
  float* values(int layer, int slot) { return v_[index(layer, slot)].data(); }
  const float* keys(int layer, int slot) const { return k_[index(layer, slot)].data(); }
  const float* values(int layer, int slot) const { return v_[index(layer, slot)].data(); }
  size_t bytes() const;
  // Grows the slot by n positions (the model fills them) and returns the old length.
  int64_t extend(int slot, int64_t n);

 private:
  size_t index(int layer, int slot) const { return static_cast<size_t>(layer) * len_.size() + slot; }
  int num_layers_ = 0;
  int64_t row_ = 0;  // n_kv * head_dim
  std::vector<int64_t> len_;
  std::vector<std::vector<float>> k_, v_;
};

// One entry of a decode/prefill step: new tokens appended to a cache slot.
struct StepItem {
  int slot = 0;
  std::vector<int32_t> tokens;
  bool all_logits = false;  // logits for every new position, else only for the last one
};

enum class GemmMode : uint8_t {
  RowInvariant,  // own kernel: each output row depends only on its input row (batch invariance)
  Blas,          // OpenBLAS sgemm (faster for large M; rows may change with M)
};

class Model {
 public:
  // Wraps `w` (not owned: it must outlive the model; the optimizer updates it in place) and
  // syncs the effective weights.
  explicit Model(Weights& w, const PrecisionConfig& p = PrecisionConfig::preset("fp32"));
  // Quantize::Later builds the linears (names, numerics: what RAC's selection and the GPU backends
  // read) without the effective weights, for a model that may never run (the CPU twin of a GPU
  // engine or trainer); forward and step refuse to run before sync().
  enum class Quantize : uint8_t { Now, Later };
  Model(Weights& w, const PrecisionConfig& p, Quantize when);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return w_->cfg; }
  Weights& weights() { return *w_; }
  const Weights& weights() const { return *w_; }
  const PrecisionConfig& precision() const { return prec_; }
  void set_precision(const PrecisionConfig& p);  // rebuilds every linear's numerics and syncs

  // Recomputes every linear's W_eff from the master weights: quantize once. Call after loading,
  // after each optimizer step (QAT) and at each weight sync of the rollout engine.
  void sync();
  // The effective weights (same layout as weights().data; only linear weights are meaningful);
  // none (nullptr) before the first sync() of a Quantize::Later model.
  const float* effective_weights() const { return weff_.data(); }
  std::vector<LinearQ>& linears() { return linears_; }
  const std::vector<LinearQ>& linears() const { return linears_; }
  LinearQ* find_linear(const std::string& module);  // nullptr if absent

  KvHooks kv_hooks;
  GemmMode forward_gemm = GemmMode::RowInvariant;

  // Training forward over a packed batch: logits [T, V] (T = b.ntokens()). With acts, keeps what
  // backward() needs and the router losses.
  void forward(const Batch& b, float* logits, Activations* acts = nullptr, const ForwardOptions& opt = {});

  // Backward from dL/dlogits [T, V] of the forward that filled `acts`. ADDS the gradient of
  // L + aux_loss_coef * aux + z_loss_coef * z (coefficients of that forward) with respect to every
  // parameter into `grads` (weights().size() floats, same layout). Straight-through through the
  // quantizers. Tied embeddings receive the lm_head gradient too.
  void backward(Activations& acts, const float* dlogits, float* grads);

  // Decode: appends each item's tokens to its cache slot (positions continue from the slot's
  // length) and returns logits [rows, V], rows in item order (all new positions per item with
  // all_logits, else its last one). Prefill and decode are the same code; slots must be distinct.
  std::vector<float> step(KVCache& cache, const std::vector<StepItem>& items, Routing* record = nullptr);

  // log p(tokens[t+1] | tokens[..t]) for every sequence of the batch, t = 0..len-2, concatenated
  // (len-1 values per sequence), under this model's numerics through the decode path (prefill in
  // chunks of `chunk` tokens with a private cache): what the rollout engine would have computed.
  std::vector<float> token_logprobs(const Batch& b, int64_t chunk = 256);

 private:
  struct Layer;
  void build_linears();
  Weights* w_;
  PrecisionConfig prec_;
  std::vector<LinearQ> linears_;  // per layer: q, k, v, o, [router], experts/dense (gate, up, down)...; lm_head last
  std::vector<float> weff_;
  struct Index;  // where each layer's linears are in linears_
  std::unique_ptr<Index> index_;
  friend struct ModelImpl;
};

}  // namespace quads::model
