#pragma once
// CUDA error checking and an owning device buffer. C++17-clean: included by .cu files (nvcc,
// C++17) and by host .cpp files (g++, C++20) alike.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/error.h"

// QUADS_CUDA_CHECK(call): throws quads::Error naming the call, the file and line, and CUDA's message.
#define QUADS_CUDA_CHECK(call)                                                                  \
  do {                                                                                          \
    cudaError_t quads_err_ = (call);                                                            \
    if (quads_err_ != cudaSuccess)                                                              \
      ::quads::fail("CUDA error in {} ({}:{}): {}", #call, __FILE__, __LINE__,                  \
                    cudaGetErrorString(quads_err_));                                            \
  } while (0)

// QUADS_CUBLAS_CHECK(call): the same for cuBLAS / cuBLASLt calls (where cublas_api.h is included).
#define QUADS_CUBLAS_CHECK(call)                                                                \
  do {                                                                                          \
    cublasStatus_t quads_st_ = (call);                                                          \
    if (quads_st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::quads::fail("cuBLAS error in {} ({}:{}): {} ({})", #call, __FILE__, __LINE__,           \
                    cublasGetStatusName(quads_st_), static_cast<int>(quads_st_));               \
  } while (0)

// After a kernel launch: reports launch-configuration errors at once (execution errors surface at
// the next synchronizing call).
#define QUADS_CUDA_LAUNCH_CHECK() QUADS_CUDA_CHECK(cudaGetLastError())

namespace quads::cuda {

// cudaMalloc'd array of T, freed on destruction; move-only. Plain allocations only (no managed
// memory: see docs/cuda.md).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) { resize(n); }
  ~DeviceArray() { reset(); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }

  void resize(size_t n) {
    if (n == n_) return;
    reset();
    if (n) QUADS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
    n_ = n;
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  void upload(const T* src, size_t n) {
    resize(n);
    if (n) QUADS_CUDA_CHECK(cudaMemcpy(p_, src, n * sizeof(T), cudaMemcpyHostToDevice));
  }
  void upload(const std::vector<T>& v) { upload(v.data(), v.size()); }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    if (n_) QUADS_CUDA_CHECK(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void fill_bytes(int byte) {
    if (n_) QUADS_CUDA_CHECK(cudaMemset(p_, byte, n_ * sizeof(T)));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// One device array per host vector (an empty vector: an empty array), e.g. per-layer tables.
template <typename T>
void upload_each(const std::vector<std::vector<T>>& src, std::vector<DeviceArray<T>>& dst) {
  dst.clear();
  dst.resize(src.size());
  for (size_t i = 0; i < src.size(); ++i)
    if (!src[i].empty()) dst[i].upload(src[i]);
}

}  // namespace quads::cuda
