// Token draws on the device (the GPU rollout backend): rollout::sample()'s greedy and full
// tempered-distribution cases, so that a decode step hands the host a token and a log-prob per draw
// instead of a row of logits (at batch 64 and a 32k vocabulary: 8 MB a step to copy and 2M
// float64 exponentials for the host's sampler to take).
//
// The same definition as the CPU sampler: z = double(logit) / T (exactly the logit for T = 1),
// m = the max z, lse = m + log(sum exp(z - m)), u = uniform_draw(seed, pos) (the same Philox bits),
// the token is the first one, in vocabulary order, whose running sum of exp(z - m) passes u * sum,
// log-prob = z_token - lse. What differs is the order of the float64 sum (each thread sums a
// contiguous chunk, then a fixed tree of the chunks) and the device's exp: a log-prob may differ
// from the host's in the last bits of a double before its rounding to float, and a draw whose
// u * sum falls within that rounding of a token boundary may pick the neighbour. Every run of the
// same logits gives the same draws.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/check.h"
#include "cuda/model_kernels.h"
#include "cuda/pdl.cuh"
#include "rollout/philox.h"  // the host sampler's draw, on the device

namespace quads::cuda::kern {

namespace {

constexpr int kSampleThreads = 512;

__device__ __forceinline__ double z_of(float l, double T) { return T == 1.0 ? double(l) : double(l) / T; }

// One CTA a job; thread t owns the contiguous columns [t * C, (t + 1) * C).
__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int64_t V, const SampleJobDev* __restrict__ jobs,
                  SampleDrawDev* __restrict__ out, int32_t* __restrict__ feed) {
  pdl_begin();
  __shared__ float s_v[kSampleThreads / 32];
  __shared__ int64_t s_i[kSampleThreads / 32];
  __shared__ double s_d[kSampleThreads / 32];
  const SampleJobDev jb = jobs[blockIdx.x];
  const double T = jb.greedy ? 1.0 : jb.temperature;
  const float* x = logits + jb.row * V;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int NW = kSampleThreads / 32;
  const int64_t C = (V + kSampleThreads - 1) / kSampleThreads;
  const int64_t v0 = min(V, tid * C), v1 = min(V, v0 + C);

  // max logit, first index (the host's strict > scan: NaN never wins)
  float fm = -INFINITY;
  int64_t am = -1;
  for (int64_t v = v0; v < v1; ++v) {
    const float l = x[v];
    if (am < 0 ? !(l != l) : l > fm) fm = l, am = v;
  }
  auto better = [](float v, int64_t i, float bv, int64_t bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
  };
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, fm, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, am, o);
    if (better(ov, oi, fm, am)) fm = ov, am = oi;
  }
  if (lane == 0) s_v[warp] = fm, s_i[warp] = am;
  __syncthreads();
  fm = -INFINITY;
  am = -1;
  for (int w = 0; w < NW; ++w)
    if (better(s_v[w], s_i[w], fm, am)) fm = s_v[w], am = s_i[w];
  const double m = z_of(fm, T);

  // the chunk's sum of exp(z - m) in column order, and its last column with a positive term
  double part = 0;
  int64_t last = -1;
  for (int64_t v = v0; v < v1; ++v) {
    const double e = exp(z_of(x[v], T) - m);
    part += e;
    if (e > 0) last = v;
  }
  // exclusive prefix of the chunks' sums (a fixed tree: warp scan, then the warps' totals)
  double incl = part;
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  int64_t lmax = last;
  for (int o = 16; o > 0; o >>= 1) lmax = max(lmax, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, lmax, o)));
  __syncthreads();  // s_v / s_i are read
  if (lane == 31) s_d[warp] = incl;
  if (lane == 0) s_i[warp] = lmax;
  __syncthreads();
  double before = 0, total = 0;
  for (int w = 0; w < NW; ++w) {
    if (w < warp) before += s_d[w];
    total += s_d[w];
    lmax = max(lmax, s_i[w]);
  }
  const double prefix = before + incl - part;
  const double lse = m + log(total);
  const bool ok = isfinite(lse) && isfinite(m);

  int64_t pick = am;
  if (!jb.greedy && ok) {
    // the first column whose running sum passes u * total, walked from each chunk's prefix by
    // the chunks that start at or below it (the lowest find wins); none (rounding): the last
    // column with a positive term, as the host's walk ends
    const double target = rollout::uniform_draw(jb.seed, jb.pos) * total;
    int64_t found = INT64_MAX;
    if (prefix <= target) {
      double cum = prefix;
      for (int64_t v = v0; v < v1; ++v) {
        const double e = exp(z_of(x[v], T) - m);
        if (e <= 0) continue;
        cum += e;
        if (cum > target) {
          found = v;
          break;
        }
      }
    }
    for (int o = 16; o > 0; o >>= 1) found = min(found, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, found, o)));
    __syncthreads();  // s_i is read
    if (lane == 0) s_i[warp] = found;
    __syncthreads();
    for (int w = 0; w < NW; ++w) found = min(found, s_i[w]);
    pick = found != INT64_MAX ? found : lmax;
  }
  if (tid != 0) return;
  SampleDrawDev d{};
  d.ok = ok && pick >= 0;
  d.token = static_cast<int32_t>(pick < 0 ? 0 : pick);
  d.logprob = d.ok ? static_cast<float>(z_of(x[pick], T) - lse) : 0.f;
  d.fmax = fm;
  d.sum = total;
  out[blockIdx.x] = d;
  if (feed) feed[blockIdx.x] = d.token;
}

}  // namespace

void sample_rows(const float* logits, int64_t V, const SampleJobDev* jobs, int n, SampleDrawDev* out, cudaStream_t s,
                 int32_t* feed) {
  if (n == 0) return;
  QUADS_CHECK(V > 0 && V < (int64_t(1) << 31), "cuda sample_rows: a vocabulary of {}", V);
  launch_pdl(sample_kernel, static_cast<unsigned>(n), kSampleThreads, 0, s, logits, V, jobs, out, feed);
}

}  // namespace quads::cuda::kern
