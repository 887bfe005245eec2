#pragma once
// Causal attention over a packed batch as batched GEMMs. For the GPU trainer's BF16 presets (on
// tensor cores) and, with set_fp32, the rollout engine's prefill of fresh slots (FP32). The
// contract of kern::attention_train_fwd / attention_train_bwd (cuda/train_kernels.h) with BF16
// GEMM operands, FP32 accumulation and an FP32 softmax, as a BF16 trainer's flash attention
// computes it. Token t attends to the tokens of its own sequence up to itself; q [T, nh, hd],
// k, v [T, nkv, hd], out [T, nh, hd], lse [T, nh] (log-sum-exp of the scaled scores); GQA head h
// uses kv head h / (nh / nkv). Backward: dq [T, nh, hd], dk, dv [T, nkv, hd], all written.
//
// How: one sequence after another, cuBLAS strided-batched BF16 GEMMs batched over the kv heads,
// the g = nh / nkv query heads of a group stacked as rows (row r = t * g + i of kv head j is query
// t of head j * g + i), so the scores of a kv head are one [L g, L] matrix:
//   forward   S = Qb Kbᵀ (FP32), P = softmax(scale S) causal (FP32, stored BF16) with lse, O = P Vb
//   backward  S again, P = exp(scale S - lse), dP = dOb Vbᵀ, D = rowsum(dO * O),
//             dS = P (dP - D) (BF16), dQ = scale dS Kb, dK = scale dSᵀ Qb, dV = Pᵀ dOb
// Nothing of size L^2 is kept between calls: the score scratch is sized for the largest block of
// query rows and reused (long sequences run in blocks of query rows, each against the keys up to
// its last query, so the masked upper triangle beyond a block is skipped; the FP32 forward runs
// the blocks with the same query rows of all sequences as one pointer-array batched GEMM). The
// GEMMs and every reduction run in a fixed order: the results are the same bits from run to run.
// C++17-clean host header; device pointers, asynchronous on the stream passed in.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace quads::cuda {

class AttentionTc {
 public:
  AttentionTc();
  ~AttentionTc();
  AttentionTc(const AttentionTc&) = delete;
  AttentionTc& operator=(const AttentionTc&) = delete;

  // The packed batch: offsets [nseq + 1], offsets[0] = 0, non-decreasing, offsets.back() = T.
  // Uploads the per-token sequence table (synchronous); fwd and bwd use the last plan.
  void plan(const std::vector<int64_t>& offsets);
  int64_t tokens() const;

  // hd % 8 == 0 (16-byte aligned BF16 rows for the tensor cores), nh % nkv == 0.
  void fwd(const float* q, const float* k, const float* v, int nh, int nkv, int hd, float scale, float* out,
           float* lse, cudaStream_t s);
  // out and lse: the forward's (out for D = rowsum(dout * out), lse to recompute P).
  void bwd(const float* q, const float* k, const float* v, const float* out, const float* lse, const float* dout,
           int nh, int nkv, int hd, float scale, float* dq, float* dk, float* dv, cudaStream_t s);

  // FP32 forward (the rollout engine's prefill): float32 operands, SGEMMs without TF32, float32
  // probabilities: the CPU's arithmetic up to summation order. bwd refuses this mode; lse may be
  // null in fwd.
  void set_fp32(bool on);

  // Most score elements (kv heads x query rows x keys) of one block of query rows (default 2^25:
  // a 1024-token sequence with 32 heads in one block). Tests lower it to exercise the blocking.
  // The FP32 forward also caps a block at 256 query rows and batches the blocks of equal query
  // rows over sequences (attention_tc.cu says why).
  void set_block_elems(int64_t n);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace quads::cuda
