#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"

namespace quads::cuda {
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later checks start clean
    return 0;
  }
  return n;
}
std::string device_name(int i) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, i) != cudaSuccess) return "";
  return p.name;
}
void keep_pool_memory() {
  int dev = 0;
  QUADS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool{};
  QUADS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t keep = UINT64_MAX;
  QUADS_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
}
int sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0) {
      cudaGetLastError();  // no device (a launch plan checked on a machine without one): an H100/H200's count
      return 132;
    }
    return sms;
  }();
  return n;
}

#ifdef QUADS_STEP_TRACE
namespace {
std::vector<void (*)(unsigned long long*)>& step_trace_setters() {
  static std::vector<void (*)(unsigned long long*)> v;  // filled during static initialization
  return v;
}
}  // namespace
void step_trace_register(void (*set)(unsigned long long*)) { step_trace_setters().push_back(set); }
bool step_trace_set(unsigned long long* buf) {
  for (auto* set : step_trace_setters()) set(buf);
  return true;
}
#else
bool step_trace_set(unsigned long long*) { return false; }
#endif
}  // namespace quads::cuda
