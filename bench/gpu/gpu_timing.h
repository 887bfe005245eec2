#pragma once
// Device time of a call, shared by bench_cuda and bench_model_gpu so that a kernel's bandwidth and
// the copy bandwidth it is compared with are measured alike: CUDA events around batches of
// back-to-back calls (about 2 ms a batch), the median batch. A single call timed on the host
// includes its launch and the synchronization, a few microseconds that a 160-us quantizer pays and
// a 500-us copy hardly does.
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "cuda/check.h"

namespace quads::bench {

// Median time of one call in microseconds (after one untimed call).
inline double time_us(const std::function<void()>& fn, int reps = 9) {
  fn();
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  QUADS_CUDA_CHECK(cudaEventCreate(&a));
  QUADS_CUDA_CHECK(cudaEventCreate(&b));
  // size the batch to about 2 ms
  QUADS_CUDA_CHECK(cudaEventRecord(a));
  fn();
  QUADS_CUDA_CHECK(cudaEventRecord(b));
  QUADS_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  QUADS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  const int inner = std::clamp(static_cast<int>(2.0 / std::max(ms, 1e-4f)), 1, 2000);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    QUADS_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < inner; ++i) fn();
    QUADS_CUDA_CHECK(cudaEventRecord(b));
    QUADS_CUDA_CHECK(cudaEventSynchronize(b));
    QUADS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1e3 * ms / inner);
  }
  QUADS_CUDA_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace quads::bench
