#pragma once
// The CPU ops of the Qwen3-MoE model, one function per op, each with its forward and backward,
// on raw row-major float32 buffers (so that a CUDA twin can be tested against each one).
// Parallel with OpenMP over rows / heads; every reduction has a fixed order, independent of the
// number of threads. Backward functions WRITE input gradients unless they say "accumulate";
// parameter gradients are always accumulated.
#include <cstdint>

namespace quads::cpu {

// ---- RMSNorm (HF Qwen3MoeRMSNorm in float32): y = w * (x * rsqrt(mean(x²) + eps)), per row of D.
// inv_rms[rows] receives rsqrt(mean(x²) + eps) (may be null in inference).
void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, float* inv_rms);
// dx[rows, D] (written); dw[D] accumulated (may be null).
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* inv_rms, int64_t rows,
                      int64_t D, float* dx, float* dw);

// ---- RoPE, rotate-half form (HF apply_rotary_pos_emb). cos/sin: [n, hd/2] for the positions of the
// n rows, computed as HF does in float32: inv_freq = 1 / theta^(2i/hd), angle = float(pos) * inv_freq.
void rope_tables(const int64_t* pos, int64_t n, int hd, double theta, float* cos, float* sin);
// x [n, heads, hd] in place.
void rope_forward(float* x, int64_t n, int heads, int hd, const float* cos, const float* sin);
// dx in place: the transposed rotation.
void rope_backward(float* dx, int64_t n, int heads, int hd, const float* cos, const float* sin);

// ---- Causal attention of one sequence. Queries are the LAST n of L positions: query i sits at
// position L - n + i and sees keys 0 .. L - n + i. q [n, nh, hd]; k, v [L, nkv, hd] (GQA: query
// head h uses kv head h / (nh / nkv)); out [n, nh, hd]; lse [n, nh] = log-sum-exp of the scaled
// scores (may be null). Each (query, head) is computed on its own, in a fixed order: the result
// for a query does not depend on n (prefill vs decode).
void attention_forward(const float* q, const float* k, const float* v, int64_t n, int64_t L, int nh, int nkv,
                       int hd, float scale, float* out, float* lse);
// dq [n, nh, hd] written; dk, dv [L, nkv, hd] accumulated. Recomputes the probabilities from lse.
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t n, int64_t L, int nh, int nkv, int hd, float scale, float* dq,
                        float* dk, float* dv);

// ---- Row-wise softmax (float32, max-subtracted).
void softmax_forward(const float* x, int64_t rows, int64_t cols, float* y);
// dx = y * (dy - sum(y * dy)) (written).
void softmax_backward(const float* y, const float* dy, int64_t rows, int64_t cols, float* dx);

// ---- Router: probs = softmax(logits) over all E experts, the top-k (ties: the lower expert id
// first; idx in descending order of probability), w = those probs, divided by their sum when
// norm_topk. With `forced` ([T, k] expert ids, routing replay) the experts are taken from it.
void router_topk_forward(const float* logits, int64_t T, int E, int k, bool norm_topk, float* probs, int32_t* idx,
                         float* w, const int32_t* forced = nullptr);
// dw [T, k] (dL/dw) plus dprobs_extra [T, E] (dL/dprobs from other terms, e.g. the aux loss; may
// be null) -> dlogits [T, E] (written).
void router_topk_backward(const float* probs, const int32_t* idx, const float* w, const float* dw,
                          const float* dprobs_extra, int64_t T, int E, int k, bool norm_topk, float* dlogits);

// Router z-loss (float64): z[t] = logsumexp of rlogits[t, :] (the max in float, then the sum of
// exp(double(r - max))); its backward adds dlog[t, e] += float(g[t] * probs[t, e]) with
// g[t] = d(loss)/d(z[t]^2) * 2 z[t] (the router's softmax Jacobian applied to one logsumexp).
void router_logsumexp(const float* rlogits, int64_t T, int E, double* z);
void router_zloss_backward(const float* probs, const double* g, int64_t T, int E, float* dlog);

// ---- MoE permutation. Groups the T*k (token, slot) pairs by expert: expert e owns rows
// offsets[e] .. offsets[e+1] of the permuted order, tokens ascending; perm[r] = t*k + s is the
// pair at permuted row r, inv[t*k + s] = r.
void moe_permute(const int32_t* idx, int64_t T, int k, int E, int64_t* offsets, int32_t* perm, int32_t* inv);
// xe[r] = x[perm[r] / k] for the n permuted rows (a gather of D-wide rows).
void moe_gather(const float* x, const int32_t* perm, int64_t n, int k, int64_t D, float* xe);
// dx[t] (+)= sum over slots s of dxe[inv[t*k+s]], in slot order.
void moe_scatter_add(const float* dxe, const int32_t* inv, int64_t T, int k, int64_t D, float* dx, bool accumulate);
// y[t] = sum over s of w[t,s] * ye[inv[t*k+s]], in slot order (written).
void moe_combine_forward(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* y);
// dye[r] = w * dy[t] for the pair at row r; dw[t,s] = <dy[t], ye[inv[t*k+s]]> (both written).
void moe_combine_backward(const float* dy, const float* ye, const int32_t* inv, const float* w, int64_t T, int k,
                          int64_t D, float* dye, float* dw);

// ---- SwiGLU on a fused gate/up product: gu [n, 2I] (gate columns first, as transformers v5's
// gate_up_proj), h [n, I] = silu(gate) * up with silu(g) = g / (1 + exp(-g)).
void swiglu_forward(const float* gu, int64_t n, int64_t I, float* h);
// dgu [n, 2I] (written).
void swiglu_backward(const float* gu, const float* dh, int64_t n, int64_t I, float* dgu);

// ---- Embedding lookup; the backward adds each token's gradient row to its table row
// (deterministic: parallel over columns, tokens in order).
void embedding_forward(const float* table, const int32_t* tokens, int64_t T, int64_t H, float* out);
void embedding_backward(const float* dout, const int32_t* tokens, int64_t T, int64_t H, float* dtable);

// y += x (n floats).
void add_inplace(float* y, const float* x, int64_t n);

}  // namespace quads::cpu
