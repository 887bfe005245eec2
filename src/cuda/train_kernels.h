#pragma once
// The kernels of the GPU trainer (cuda/train_gpu.h): the training forward pieces that the rollout
// kernels (cuda/model_kernels.h) do not cover, the backward of every layer op, the losses on the
// logits and AdamW. Each one is the device twin of the CPU function named beside it and is tested
// against it on random shapes (tests/cuda/test_train_kernels.cpp). Reductions run in a fixed order
// (no atomics on floats), so results are deterministic from run to run; they may differ from the
// CPU's sequential sums in the last bits. All pointers are device pointers; every launcher is
// asynchronous on `s`. C++17-clean.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace quads::cuda::kern {

// The element-wise kernels of the trainer (to_bf16 / bf16_round, gather_rows_bf16, copy_cols, fill,
// add, concat_cols3, nvfp4_weight_bf16, the attention's pack / unpack / softmax, rope, swiglu_bwd,
// moe_combine_fwd, moe_scatter_add) run as row kernels with 16-byte vectors; on (process-wide) they run their former scalar grid-stride versions, which
// give the same bits: the same-bits tests' reference (tests/cuda/test_train_elementwise.cpp).
// Initially on where QUADS_TRAIN_KERNELS=old.
void set_legacy_train_kernels(bool on);
bool legacy_train_kernels();

// ---- RMSNorm (cpu::rmsnorm_forward / rmsnorm_backward) over rows of D; per-head q/k norms are the
// same op with rows = T * heads, D = head_dim. inv_rms [rows] is kept for the backward.
void rmsnorm_fwd(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, float* inv_rms,
                 cudaStream_t s);
// dx [rows, D] written; dw [D] ACCUMULATED (may be null). `scratch` holds
// rmsnorm_bwd_scratch(rows, D) floats (per-block partial sums of dw, reduced in block order).
int64_t rmsnorm_bwd_scratch(int64_t rows, int64_t D);
void rmsnorm_bwd(const float* dy, const float* x, const float* w, const float* inv_rms, int64_t rows, int64_t D,
                 float* dx, float* dw, float* scratch, cudaStream_t s);

// ---- RoPE, rotate-half (cpu::rope_forward / rope_backward): x [n, heads, hd] in place; cos/sin
// [n, hd/2] per row (cpu::rope_tables, uploaded).
void rope_fwd(float* x, int64_t n, int heads, int hd, const float* cos, const float* sin, cudaStream_t s);
void rope_bwd(float* dx, int64_t n, int heads, int hd, const float* cos, const float* sin, cudaStream_t s);

// ---- ReQAT's KV-cache transform in the trainer (model::KvTransform; the CPU's are reqat's
// KvHooks): q [n, nh, hd] *= f of each head's kv head, k [n, nkv, hd] /= f (f [nkv * hd]). The
// same diagonal maps are the backward's (dq *= f, dk /= f).
void kv_factor(float* q, float* k, int64_t n, int nh, int nkv, int hd, const float* f, cudaStream_t s);
// x [rows, cols] -= m [cols] (the post-RoPE key shift).
void sub_cols(float* x, int64_t rows, int64_t cols, const float* m, cudaStream_t s);

// ---- Causal attention over a packed batch (cpu::attention_forward / attention_backward applied to
// each sequence): token t attends to the tokens seq0[t] .. t (seq0[t]: the first token of t's
// sequence). q [T, nh, hd], k, v [T, nkv, hd]; out [T, nh, hd]; lse [T, nh] (log-sum-exp of the
// scaled scores). GQA: head h uses kv head h / (nh / nkv). hd <= 256, hd % 32 == 0.
void attention_train_fwd(const float* q, const float* k, const float* v, const int32_t* seq0, int64_t T, int nh,
                         int nkv, int hd, float scale, float* out, float* lse, cudaStream_t s);
// dq [T, nh, hd], dk, dv [T, nkv, hd], all WRITTEN (each key row sums over its queries in query
// order, the GQA group's heads in head order).
void attention_train_bwd(const float* q, const float* k, const float* v, const float* out, const float* lse,
                         const float* dout, const int32_t* seq0, int64_t T, int nh, int nkv, int hd, float scale,
                         float* dq, float* dk, float* dv, cudaStream_t s);

// ---- Router (cpu::router_topk_forward with `forced` / cpu::router_topk_backward). The forward of
// the rollout kernels (kern::router_topk) has no forced experts; this one takes them (routing
// replay: forced [T, k] may be null).
void router_topk_fwd(const float* logits, int64_t T, int E, int k, bool norm_topk, float* probs, int32_t* idx,
                     float* w, const int32_t* forced, cudaStream_t s);
// The MoE router of a decode step in one launch: router_topk_fwd (forced = nullptr) followed by
// kern::moe_route (model_kernels.h) over n = T * k ids, with the same outputs bit for bit: probs,
// idx, w, counts [E], eoff [E + 1], perm, inv, active (incremented; may be null), bad (set to 1 on
// an id outside 0..E-1, as from NaN logits; may be null). The last CTA to finish its tokens routes
// the whole batch; `ticket` (one uint32, zero before the first call, left at zero by every call) is
// how they find out which: needed when T > 8, one per stream that runs router_route concurrently.
// T * k > 8192 or E > 256 run the two separate kernels.
void router_route(const float* logits, int64_t T, int E, int k, bool norm_topk, float* probs, int32_t* idx, float* w,
                  int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv, unsigned long long* active, int32_t* bad,
                  uint32_t* ticket, cudaStream_t s);
// kern::moe_route in one launch of one CTA (router_route's routing alone), the same outputs; n > 8192
// or E > 256 run moe_route.
void moe_route_one(const int32_t* idx, int64_t n, int E, int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv,
                   unsigned long long* active, int32_t* bad, cudaStream_t s);
// dlogits [T, E] written; dprobs_extra [T, E] may be null.
void router_topk_bwd(const float* probs, const int32_t* idx, const float* w, const float* dw,
                     const float* dprobs_extra, int64_t T, int E, int k, bool norm_topk, float* dlogits,
                     cudaStream_t s);
// The router z-loss's backward (cpu::router_zloss_backward, bit for bit): dlog[t, e] +=
// float(g[t] * probs[t, e]), g [T] in double.
void router_zloss_bwd(const float* probs, const double* g, int64_t T, int E, float* dlog, cudaStream_t s);

// ---- MoE (cpu::moe_combine_forward / moe_combine_backward / moe_scatter_add). perm/inv as
// cpu::moe_permute (kern::moe_route computes them on the device).
void moe_combine_fwd(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* y,
                     cudaStream_t s);
// dye [T*k, D] and dw [T, k] written.
void moe_combine_bwd(const float* dy, const float* ye, const int32_t* inv, const float* w, int64_t T, int k,
                     int64_t D, float* dye, float* dw, cudaStream_t s);
// dx[t] (+)= sum over slots s (in order) of dxe[inv[t*k + s]].
void moe_scatter_add(const float* dxe, const int32_t* inv, int64_t T, int k, int64_t D, float* dx, bool accumulate,
                     cudaStream_t s);

// ---- SwiGLU on the fused gate/up product gu [n, 2I] (cpu::swiglu_backward): dgu [n, 2I] written.
void swiglu_bwd(const float* gu, const float* dh, int64_t n, int64_t I, float* dgu, cudaStream_t s);

// ---- Embedding (cpu::embedding_backward): dtable[tokens[t]] += dout[t], tokens in order for each
// table row (deterministic). `order` [T] and `starts` [T + 1] come from embedding_bwd_plan on the host
// (tokens grouped by id, stable); nuniq = the number of distinct ids.
void embedding_bwd_plan(const int32_t* tokens_host, int64_t T, int32_t* order_host, int32_t* starts_host,
                        int32_t* ids_host, int64_t* nuniq);
void embedding_bwd(const float* dout, const int32_t* order, const int32_t* starts, const int32_t* ids, int64_t nuniq,
                   int64_t H, float* dtable, cudaStream_t s);

// ---- Losses on logits [T, V] (train/losses.h; per-row quantities in double from a max-subtracted
// float row). x_scale multiplies the logits first (1 / temperature; 1 for plain logits).
// logp[t] = log softmax(x_scale * logits[t])[target_t], 0 where target < 0. H (may be null) = entropy.
void token_logprobs(const float* logits, int64_t T, int64_t V, const int32_t* targets, float x_scale, float* logp,
                    float* H, cudaStream_t s);
// dlogits[t] = x_scale * dlogp[t] * (onehot(target_t) - p_t) (WRITTEN; zero rows where target < 0).
void token_logprobs_bwd(const float* logits, int64_t T, int64_t V, const int32_t* targets, float x_scale,
                        const float* dlogp, float* dlogits, cudaStream_t s);

// ---- Optimizer (train::global_norm, train::AdamW::step's element update).
// *out = sqrt(sum g^2) in double, fixed chunking. scratch: global_norm_scratch(n) doubles.
int64_t global_norm_scratch(int64_t n);
void global_norm(const float* g, int64_t n, double* scratch, double* out, cudaStream_t s);
// grads *= coef (clipping).
void scale(float* x, int64_t n, float coef, cudaStream_t s);
// One AdamW step over n parameters with the float32 constants train::AdamW::step computes on the
// host (decay = 1 - lr * wd where mask[i] != 0 or mask is null). clip != 1 first clips the
// gradients in place (scale()'s multiply, in the same pass); bf16_out (optional) receives the new
// parameters' BF16 bits (one pass instead of AdamW, then a conversion).
// amax (optional): the max |p| of the new parameters over each of `count` sorted, disjoint ranges
// [begin[i], end[i]) (device int64), as float bits (NaN largest: quantize()'s per-tensor amax)
// into amax_bits[i], zeroed first: the amax pass of the trainer's WeightOperandSet, in this pass.
struct AdamWAmax {
  const int64_t* begin = nullptr;
  const int64_t* end = nullptr;
  int count = 0;
  uint32_t* amax_bits = nullptr;
};
void adamw(float* params, float* grads, float* m, float* v, const uint8_t* mask, int64_t n, float b1, float b2,
           float step_size, float bc2_sqrt, float eps, float decay, cudaStream_t s, float clip = 1.f,
           uint16_t* bf16_out = nullptr, const AdamWAmax& amax = {});

}  // namespace quads::cuda::kern
