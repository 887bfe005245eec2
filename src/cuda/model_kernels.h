#pragma once
// The layer kernels of the GPU Qwen3-MoE forward (cuda::GpuModel), as host launchers. Each one is
// the device twin of a CPU op in cpu/ops.h (named beside it) and follows its arithmetic operation by
// operation where that is cheap (explicit __fmul_rn / __fadd_rn: nvcc would contract a*b+c into an
// FMA, the CPU build does not); reductions run in a fixed tree order, so results are deterministic
// and independent of the launch, but may differ from the CPU's sequential sums in the last bits.
// All pointers are device pointers; every launcher is asynchronous on `stream`. C++17-clean.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace quads::cuda::kern {

// out[t] = table[tokens[t]] (cpu::embedding_forward). Token ids must be in range (checked on the host).
void embedding(const float* table, const int32_t* tokens, int64_t T, int64_t H, float* out, cudaStream_t s);

// The decode step's kernels come in two versions: the current ones (default) and the previous ones
// (legacy: the benchmark's "old" column and the tests' bitwise references). rmsnorm,
// qk_norm_rope_store and router_topk_fwd (train_kernels.h) give the same bits either way;
// attention_decode_split the same within rounding. The initial value is QUADS_DECODE_KERNELS=old in
// the environment; the switch is read at each launch (a captured CUDA graph keeps what it captured).
void set_legacy_decode_kernels(bool on);
bool legacy_decode_kernels();

// y = w * (x * inv_rms) per row of D (cpu::rmsnorm_forward; sum of squares in double).
void rmsnorm(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, cudaStream_t s);

// ---- Fused decode kernels: fewer launches per layer (at batch 1..16 a decode step's time is mostly
// the ~3-4 us each kernel costs). Each gives the same bits as the unfused sequence it replaces.
// They ignore legacy_decode_kernels(): the unfused calls are the old path, which a caller keeps
// under that switch (QUADS_DECODE_KERNELS=old).

// The norms below can also write y quantized to NVFP4 (E2M1, 1x16 blocks, per-row global amax,
// round to nearest even): codes [rows, D/2], row-major E4M3 scales [rows, D/16], amax [rows], what
// cuda::quantize() stores for y with that config (the same device functions, quant_row.cuh), so a
// W4A4 GEMM reading y needs no quantize() launch. Null codes: none. D a multiple of 16.
struct RowNvfp4 {
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  float* amax = nullptr;
  // Optional (at most kXFragMaxRows rows): y's rows also as the skinny W4A4 tiles' FP16 operand
  // (Nvfp4View::frag, x_frag_bytes(D, rows) bytes, 16-byte aligned), from the same codes. frag_row:
  // the row's index in it (the kernels set it; rows from kXFragMaxRows on write none).
  uint8_t* frag = nullptr;
  int frag_row = 0;
};

// The MoE router's logits from the norm's output: logits [rows, E] = bf16(y) . w^T with w the
// router's BF16 weight [E, D] (the BF16 GEMM's products, float32 sums in a fixed order of this
// kernel's own). Null w: none. Decode rows: router_fusable() says which.
struct RowRouter {
  const uint16_t* w = nullptr;
  int E = 0;
  float* logits = nullptr;
  // w was written before the kernel that precedes the norm in the stream (a decode step: weights
  // change only between steps): each warp loads its expert's row before the wait (PDL).
  bool early = false;
};
bool router_fusable(int64_t rows, int64_t D, int E);

// rmsnorm (current kernel), and when y_bf16 is non-null the BF16 bits of y as well (what
// to_bf16(y) gives: the operand of the router's and lm_head's BF16 GEMMs), in one kernel; with
// router.w also the router's logits (the CTAs of a row each take 8 experts).
void rmsnorm_bf16(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, uint16_t* y_bf16,
                  cudaStream_t s, const RowNvfp4& yq = {}, const RowRouter& router = {});
// moe_combine_add(ye, inv, w, T, k, D, x) then rmsnorm_bf16(x, w_norm, T, D, eps, y, y_bf16): the
// MoE output enters the residual stream x and the next layer's input norm (or the final norm) runs
// in the same kernel; x is updated as moe_combine_add leaves it. early: inv, w and w_norm were
// written before the kernel that precedes this launch (a decode step: the router ran two kernels
// before), so the first of them are read before the wait for it (PDL).
void moe_combine_add_rmsnorm(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* x,
                             const float* w_norm, float eps, float* y, uint16_t* y_bf16, cudaStream_t s,
                             const RowNvfp4& yq = {}, bool early = false);
// add_inplace(x, t, rows * D) then rmsnorm_bf16(x, w_norm, rows, D, eps, y, y_bf16) (the dense or
// BF16 path, where o_proj's GEMM cannot accumulate into x).
void add_rmsnorm(float* x, const float* t, int64_t rows, int64_t D, const float* w_norm, float eps, float* y,
                 uint16_t* y_bf16, cudaStream_t s, const RowNvfp4& yq = {});
// Threads per row of the two above (256 or 1024; 0, the default: 1024 while the rows are fewer
// than the SMs, else 256). Same bits either way; for the benchmark.
void set_residual_norm_threads(int threads);

// out[r] = x[idx[r] / div] for r < n (rows of D floats): cpu::moe_gather (div = k) and row selection.
void gather_rows(const float* x, const int32_t* idx, int64_t n, int div, int64_t D, float* out, cudaStream_t s);

// The attention prologue of one layer for T packed tokens: per-head RMSNorm of q [T, nh, hd] and
// k [T, nkv, hd] (weights qn, kn), rotate-half RoPE with cos/sin [T, hd/2] (cpu::rope_forward),
// q written in place; the roped k and the untouched v [T, nkv, hd] are stored in the cache at
// (slot[t], pos[t]). Cache layout per layer: [slots, max_len, nkv, hd].
void qk_norm_rope_store(float* q, const float* k, const float* v, const float* qn, const float* kn, float eps,
                        const float* cos, const float* sin, const int32_t* slot, const int32_t* pos, int64_t T,
                        int nh, int nkv, int hd, float* kcache, float* vcache, int64_t max_len, cudaStream_t s,
                        const float* prescale = nullptr);
// prescale (optional, [nkv, hd]): ReQAT's Q-FIT factor, applied between the norm and RoPE (queries
// multiplied by their kv head's row, keys divided), as reqat's pre_rope hook on the CPU.

// The same reading q, k, v straight from the fused q/k/v product qkv [T, ld] (row t: q | k | v,
// ld >= nh*hd + 2*nkv*hd) and writing the normed, roped q to q [T, nh*hd]: the same bits as
// split_cols3 then qk_norm_rope_store (current kernel), one launch instead of two.
void qk_norm_rope_store_qkv(const float* qkv, int64_t ld, float* q, const float* qn, const float* kn, float eps,
                            const float* cos, const float* sin, const int32_t* slot, const int32_t* pos, int64_t T,
                            int nh, int nkv, int hd, float* kcache, float* vcache, int64_t max_len, cudaStream_t s,
                            const float* prescale = nullptr);

// The new tokens' K/V rows of one layer's cache (at (slot[t], pos[t])) to contiguous kbuf, vbuf
// [T, nkv*hd] (keys minus `shift` [nkv*hd] when non-null), or back into the cache with to_cache:
// ReQAT's post-RoPE shift and KV quantization run on the contiguous rows.
void kv_rows(float* kcache, float* vcache, const int32_t* slot, const int32_t* pos, int64_t T, int nkv, int hd,
             int64_t max_len, const float* shift, float* kbuf, float* vbuf, bool to_cache, cudaStream_t s);

// Causal attention over the cache (cpu::attention_forward): token t (query q[t], [nh, hd]) attends
// to keys/values 0..pos[t] of its slot; out [T, nh*hd]. GQA: head h uses kv head h / (nh / nkv).
// Prefill chunks and decode share the arithmetic; `decode` selects the launch shape (one CTA per
// (sequence, kv head) holding the group's queries, vs one CTA per (token, head)). max_ctx bounds
// pos + 1 (shared memory for the scores).
// prefill_tokens_per_cta > 1 (prefill only): a CTA holds the GQA group's heads of that many
// consecutive tokens (K/V rows shared through L1; same results bit for bit).
void attention(const float* q, const float* kcache, const float* vcache, const int32_t* slot, const int32_t* pos,
               int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len, int64_t max_ctx, bool decode,
               float* out, cudaStream_t s, int prefill_tokens_per_cta = 1);

// Decode attention split over the keys (flash-decoding): CTA (split, kv head, token) stages its
// share of the keys and values (at most max_ctx / splits, 32 at a time) in shared memory for all
// query heads of the GQA group, keeps an online softmax (running max, sum, unnormalized output),
// and a second kernel merges the splits in split order (deterministic). The splits are chosen from
// T * nkv so that a batch-1 step still fills the GPU. Same contract as attention(); the sums run in
// another order than the CPU's (within ~1e-6 relative, measured in the tests). Supported:
// hd % 32 == 0, hd <= 256, nh / nkv <= 32.
bool attention_decode_split_supported(int nh, int nkv, int hd);
void attention_decode_split(const float* q, const float* kcache, const float* vcache, const int32_t* slot,
                            const int32_t* pos, int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len,
                            int64_t max_ctx, float* out, cudaStream_t s);
// The same with the split count forced (splits > 0; clamped to the 32-key tiles of max_ctx) or
// chosen as above (0); returns the split count used. Where hd / 32 is 1, 2, 4 or 8 and the group
// fits 16 warps (two heads per warp for even groups), a pipelined kernel runs: two K/V tiles in
// flight through cp.async, at most one wave of resident CTAs. Otherwise, and with
// legacy_decode_kernels(), the kernel described above.
// kv_early (the pipelined kernel): slot, pos and every cache row before each token's new one were
// written before the kernel that precedes this launch in the stream (a decode step: that kernel
// stores only the new rows), so the first K/V tile is copied before the wait for it (PDL).
int attention_decode_split_n(const float* q, const float* kcache, const float* vcache, const int32_t* slot,
                             const int32_t* pos, int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len,
                             int64_t max_ctx, float* out, cudaStream_t s, int splits, bool kv_early = false);

// The pipelined split-key kernel with the merge fused into it: the last CTA of each (token, kv
// head) to finish (a device counter per pair, counted after a __threadfence) merges that group's
// splits in split order (all its loads issued up front: a few memory round trips, not two per
// split), so the output is bit-identical to attention_decode_split_n (current kernels), which
// chooses the same split count, in one launch. Returns the split count. Where the pipelined
// kernel has no instance for the shape, it runs attention_decode_split_n (two kernels).
// workspace: device memory of at least attention_decode_fused_workspace(T, ...) bytes, ZEROED ONCE
// by the caller after allocating it (cudaMemset); every launch leaves its counters at zero again, so
// the same workspace serves every later call and every replay of a captured graph. Launches using
// one workspace must not run concurrently (one stream). No allocation here: capture-safe.
// attention_decode_fused_workspace(T, ...) is enough for every batch of 1..T tokens with a context
// bound of at most max_ctx (0 when no split is needed); it queries the device (call it outside a
// capture).
size_t attention_decode_fused_workspace(int64_t T, int nh, int nkv, int hd, int64_t max_ctx, int splits = 0);
int attention_decode_fused(const float* q, const float* kcache, const float* vcache, const int32_t* slot,
                           const int32_t* pos, int64_t T, int nh, int nkv, int hd, float scale, int64_t max_len,
                           int64_t max_ctx, float* out, void* workspace, size_t workspace_bytes, cudaStream_t s,
                           int splits = 0, bool kv_early = false);

// Prefill attention with K/V staged through shared memory (QUADS_GPU_ATTN=tiled): the same bits as
// attention(). blocks [nblocks, 2] = (first token, count): runs of consecutive tokens of ONE slot,
// at most tokens_per_cta each; a CTA holds heads_per_cta heads (a divisor of the GQA group) of one
// block. attention_tiled_tokens picks both for a context of max_ctx; supported: hd % 32 == 0,
// hd <= 256.
bool attention_tiled_supported(int nh, int nkv, int hd);
int attention_tiled_tokens(int nh, int nkv, int hd, int64_t max_ctx, int* heads_per_cta);
void attention_tiled(const float* q, const float* kcache, const float* vcache, const int32_t* slot, const int32_t* pos,
                     const int32_t* blocks, int64_t nblocks, int nh, int nkv, int hd, float scale, int64_t max_len,
                     int64_t max_ctx, int heads_per_cta, int tokens_per_cta, float* out, cudaStream_t s);

// The router's softmax + top-k is kern::router_topk_fwd (cuda/train_kernels.h; forced = nullptr),
// shared with the trainer.

// h [n, I] = silu(g) * u, row r of g and u at r * ld (cpu::swiglu_forward: the fused [n, 2I] product
// is g = gu, u = gu + I, ld = 2I; separate [n, I] buffers have ld = I).
void swiglu(const float* g, const float* u, int64_t ld, int64_t n, int64_t I, float* h, cudaStream_t s);
// to_bf16(swiglu(...)) in one kernel: out [n, I] the BF16 bits of h (the down projection's BF16
// operand), the same bits; row_lo / row_hi (device int32, both or neither): only rows *row_lo ..
// *row_hi - 1 (a window of MoE groups: eoff + first, eoff + end).
void swiglu_bf16(const float* g, const float* u, int64_t ld, int64_t n, int64_t I, uint16_t* out, cudaStream_t s,
                 const int32_t* row_lo = nullptr, const int32_t* row_hi = nullptr);

// Rows of src [rows, a + b + c] split by columns into da [rows, a], db [rows, b], dc [rows, c]
// (the fused q/k/v product).
void split_cols3(const float* src, int64_t rows, int64_t a, int64_t b, int64_t c, float* da, float* db, float* dc,
                 cudaStream_t s);

// dst[i] = *src for i < n (a device scalar broadcast: per-row global scales of a fused weight).
void broadcast(const float* src, float* dst, int64_t n, cudaStream_t s);

// x[t] += sum over slots s (in order) of w[t, s] * ye[inv[t*k + s]] (cpu::moe_combine_forward then
// cpu::add_inplace: the sum is formed first, then added).
void moe_combine_add(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* x,
                     cudaStream_t s);

// Device-side cpu::moe_permute over n = T * k expert ids idx (no host sync): eoff [E + 1] row offsets
// per expert (int32), perm [n] (row -> flat index token * k + slot, in flat order within an
// expert), inv [n] (flat index -> row); counts [E] is scratch. active (optional) is incremented by
// the number of experts with rows; bad (optional) is set to 1 when an id is outside 0..E-1 (those
// entries then point at row 0, so later kernels stay in bounds; the caller reports the error).
void moe_route(const int32_t* idx, int64_t n, int E, int32_t* counts, int32_t* eoff, int32_t* perm, int32_t* inv,
               unsigned long long* active, int32_t* bad, cudaStream_t s);

// Grouped BF16 GEMM for MoE experts: for every group e, rows eoff[e] .. eoff[e+1] of x [*, K]
// (BF16 bits) times W_e^T (w_table[e]: device pointer to BF16 [N, K]) into the same rows of
// y [*, N], FP32 accumulation (exact products, fixed order: deterministic). For decode and short
// prefills (few rows per expert): BF16 tensor cores (mma.sync), each weight row streamed once per
// 16 activation rows. K % 8 == 0, 16-byte aligned rows.
void gemm_bf16_grouped(const uint16_t* x, const uint16_t* const* w_table, int64_t N, int64_t K, int groups,
                       const int32_t* eoff, float* y, cudaStream_t s);
// The same over float32 operands (fake-quant linears: W_eff and the fake-quantized X) on CUDA cores
// (a GEMV-style kernel, 8 activation rows per pass over a weight row); each product rounded then
// added, as the CPU's GEMM (summation order differs). K % 8 == 0, 32-byte aligned rows.
void gemm_f32_grouped(const float* x, const float* const* w_table, int64_t N, int64_t K, int groups,
                      const int32_t* eoff, float* y, cudaStream_t s);

// y += x (n floats).
void add_inplace(float* y, const float* x, int64_t n, cudaStream_t s);
// out = x - y (n floats; out may alias y): RAC's residual X - X_eff.
void sub(const float* x, const float* y, float* out, int64_t n, cudaStream_t s);

// BF16 bits of x, round to nearest even, NaN quieted (num::bf16_from_f32).
void to_bf16(const float* x, uint16_t* out, int64_t n, cudaStream_t s);
// out = float(bf16(x)) (num::bf16_round); may alias.
void bf16_round(const float* x, float* out, int64_t n, cudaStream_t s);

// Per row r of x and xq [rows, cols]: out[2r] = sum (x - xq)^2, out[2r + 1] = sum x^2, in double,
// summed in column order without contraction: num::error_stats' row sums bit for bit (its sq_err
// and sq_norm are these added over the rows in order). The rollout model's activation error.
void row_error_sums(const float* x, const float* xq, int64_t rows, int64_t cols, double* out, cudaStream_t s);
// energy[c] += (x - xq)[r, c]^2 over the rows r in order, in double without contraction:
// model::rac_energy bit for bit. Static RAC's calibration pass on the GPU.
void rac_energy(const float* x, const float* xq, int64_t rows, int64_t cols, double* energy, cudaStream_t s);

// Arg-max of each row of x [rows, cols] (first index on ties; NaN never wins).
void argmax_rows(const float* x, int64_t rows, int64_t cols, int32_t* out, cudaStream_t s);

// Draws on the device (cuda/sample.cu): rollout::sample() for greedy and full-distribution jobs
// (temperature only), one per job, from row `row` of logits [rows, V]: token, log-prob under the
// tempered distribution, and (for the host's error message) the max logit and the sum of
// exponentials; ok = 0 where they are not finite. Deterministic; see sample.cu for how it can
// differ from the host's sampler.
struct SampleJobDev {
  int64_t row;
  double temperature;
  uint64_t seed, pos;
  int32_t greedy;
};
struct SampleDrawDev {
  int32_t token;
  float logprob;
  float fmax;
  int32_t ok;
  double sum;
};
// feed (optional): also each draw's token alone, feed[i] for job i (a decode run's next tokens).
void sample_rows(const float* logits, int64_t V, const SampleJobDev* jobs, int n, SampleDrawDev* out, cudaStream_t s,
                 int32_t* feed = nullptr);

// Pseudo-random N(mean, stddev) values, a pure function of (seed, index) (benchmarks' random weights).
void fill_normal(float* x, int64_t n, uint64_t seed, float mean, float stddev, cudaStream_t s);

}  // namespace quads::cuda::kern
