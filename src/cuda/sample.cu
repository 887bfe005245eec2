// Token draws on the device (the GPU rollout backend): rollout::sample()'s greedy and full
// tempered-distribution cases, so that a decode step hands the host a token and a log-prob per draw
// instead of a row of logits (at batch 64 and a 32k vocabulary: 8 MB a step to copy and 2M
// float64 exponentials for the host's sampler to take).
//
// The same definition as the CPU sampler: z = double(logit) / T (exactly the logit for T = 1),
// m = the max z, lse = m + log(sum exp(z - m)), u = uniform_draw(seed, pos) (the same Philox bits),
// the token is the first one, in vocabulary order, whose running sum of exp(z - m) passes u * sum,
// log-prob = z_token - lse. What differs is the order of the float64 sum (each thread sums a
// contiguous chunk, then a fixed tree of the chunks, over a cluster of CTAs for large vocabularies)
// and the device's exp: a log-prob may differ
// from the host's in the last bits of a double before its rounding to float, and a draw whose
// u * sum falls within that rounding of a token boundary may pick the neighbour. Every run of the
// same logits gives the same draws.
#include <cuda_runtime.h>

#include <cooperative_groups.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "cuda/check.h"
#include "cuda/model_kernels.h"
#include "cuda/pdl.cuh"
#include "rollout/philox.h"  // the host sampler's draw, on the device

namespace quads::cuda::kern {

namespace {

constexpr int kSampleThreads = 512;

__device__ __forceinline__ double z_of(float l, double T) { return T == 1.0 ? double(l) : double(l) / T; }

// A job's row over S CTAs (a thread-block cluster of S; S = 1: one CTA, no cluster): thread t of
// rank c owns the contiguous columns [g * C, (g + 1) * C), g = c * kSampleThreads + t. The CTAs
// exchange their max, sums and finds through distributed shared memory, each combined in rank
// order, so every rank holds the same values and the result depends on the row, the job and S
// alone (S is chosen by the vocabulary: the draws do not depend on the batch).
template <int S>
__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int64_t V, const SampleJobDev* __restrict__ jobs,
                  SampleDrawDev* __restrict__ out, int32_t* __restrict__ feed) {
  pdl_begin();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (S > 1) __trap();  // clusters need sm_90 (the host launches S = 1 elsewhere)
#endif
  __shared__ float s_v[kSampleThreads / 32];
  __shared__ int64_t s_i[kSampleThreads / 32];
  __shared__ double s_d[kSampleThreads / 32];
  __shared__ float c_v;  // this rank's max, its index, sum, last positive column, find (for the others)
  __shared__ int64_t c_i, c_l, c_f;
  __shared__ double c_d;
  const int rank = S > 1 ? static_cast<int>(blockIdx.x % S) : 0;
  const SampleJobDev jb = jobs[blockIdx.x / S];
  const double T = jb.greedy ? 1.0 : jb.temperature;
  const float* x = logits + jb.row * V;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int NW = kSampleThreads / 32;
  const int64_t C = (V + int64_t(S) * kSampleThreads - 1) / (int64_t(S) * kSampleThreads);
  const int64_t v0 = min(V, (int64_t(rank) * kSampleThreads + tid) * C), v1 = min(V, v0 + C);
  // rank r's copy of a shared variable (r = rank: this CTA's own)
  auto remote = [&](auto* p, int r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (S > 1) return cooperative_groups::this_cluster().map_shared_rank(p, r);
#endif
    return p;
  };
  auto cluster_sync = [] {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (S > 1) cooperative_groups::this_cluster().sync();
#endif
  };

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
  if constexpr (S > 1) {
    if (tid == 0) c_v = fm, c_i = am;
    cluster_sync();
    fm = -INFINITY;
    am = -1;
    for (int r = 0; r < S; ++r) {
      const float rv = *remote(&c_v, r);
      const int64_t ri = *remote(&c_i, r);
      if (better(rv, ri, fm, am)) fm = rv, am = ri;
    }
  }
  const double m = z_of(fm, T);

  // the chunk's sum of exp(z - m) in column order, and its last column with a positive term
  double part = 0;
  int64_t last = -1;
  for (int64_t v = v0; v < v1; ++v) {
    const double e = exp(z_of(x[v], T) - m);
    part += e;
    if (e > 0) last = v;
  }
  // exclusive prefix of the chunks' sums (a fixed tree: warp scan, the warps' totals, the ranks')
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
  if constexpr (S > 1) {
    if (tid == 0) c_d = total, c_l = lmax;
    cluster_sync();
    total = 0;
    for (int r = 0; r < S; ++r) {
      const double t = *remote(&c_d, r);
      if (r < rank) before += t;
      total += t;
      lmax = max(lmax, *remote(&c_l, r));
    }
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
    if constexpr (S > 1) {
      if (tid == 0) c_f = found;
      cluster_sync();
      for (int r = 0; r < S; ++r) found = min(found, *remote(&c_f, r));
    }
    pick = found != INT64_MAX ? found : lmax;
  }
  cluster_sync();  // no rank leaves while another may still read its shared memory
  if (tid != 0 || rank != 0) return;
  SampleDrawDev d{};
  d.ok = ok && pick >= 0;
  d.token = static_cast<int32_t>(pick < 0 ? 0 : pick);
  d.logprob = d.ok ? static_cast<float>(z_of(x[pick], T) - lse) : 0.f;
  d.fmax = fm;
  d.sum = total;
  out[blockIdx.x / S] = d;
  if (feed) feed[blockIdx.x / S] = d.token;
}

// CTAs a job: a cluster of 8 where the row gives each of its 4096 threads at least 2 columns
// (a 32k vocabulary: 8 columns a thread instead of 63, so a decode step's draws take ~1/8 of the
// time at small batches), on sm_90 and later; QUADS_GPU_SAMPLE_CTAS = 1 / 2 / 4 / 8 sets it.
int sample_ctas(int64_t V) {
  static const int forced = [] {
    const char* e = std::getenv("QUADS_GPU_SAMPLE_CTAS");
    const int f = e ? std::atoi(e) : 0;
    return f == 1 || f == 2 || f == 4 || f == 8 ? f : 0;
  }();
  static const bool clusters = [] {
    int dev = 0, major = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
  }();
  if (!clusters) return 1;
  if (forced) return forced;
  return V >= int64_t(8) * kSampleThreads * 2 ? 8 : 1;
}

}  // namespace

void sample_rows(const float* logits, int64_t V, const SampleJobDev* jobs, int n, SampleDrawDev* out, cudaStream_t s,
                 int32_t* feed) {
  if (n == 0) return;
  QUADS_CHECK(V > 0 && V < (int64_t(1) << 31), "cuda sample_rows: a vocabulary of {}", V);
  const unsigned grid = static_cast<unsigned>(n);
  switch (sample_ctas(V)) {
    case 8: launch_pdl_cluster(sample_kernel<8>, grid * 8, kSampleThreads, 0, s, dim3(8, 1, 1), logits, V, jobs, out, feed); break;
    case 4: launch_pdl_cluster(sample_kernel<4>, grid * 4, kSampleThreads, 0, s, dim3(4, 1, 1), logits, V, jobs, out, feed); break;
    case 2: launch_pdl_cluster(sample_kernel<2>, grid * 2, kSampleThreads, 0, s, dim3(2, 1, 1), logits, V, jobs, out, feed); break;
    default: launch_pdl(sample_kernel<1>, grid, kSampleThreads, 0, s, logits, V, jobs, out, feed);
  }
}

}  // namespace quads::cuda::kern
