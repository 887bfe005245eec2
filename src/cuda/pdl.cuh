#pragma once
// Programmatic dependent launch (Hopper and newer). A decode step is a CUDA graph of ~200 small
// kernels, and between two of them the GPU idles for about a microsecond: the next grid is
// launched and its blocks scheduled only once the previous one has finished. A kernel launched
// with launch_pdl() may be scheduled while the kernel before it still runs; it must call
// pdl_begin() before it touches memory: that waits until the previous grid has completed and its
// writes are visible (so the results are those of a plain launch, bit for bit), then lets the
// next kernel of the stream be scheduled in turn. Without PDL (older GPUs, QUADS_GPU_PDL=0, or a
// plain <<<>>> launch) both instructions are no-ops and the launch is an ordinary one.
// Every kernel launched through launch_pdl must begin with pdl_begin().
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda/check.h"

namespace quads::cuda {

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// On when the kernels were compiled for sm_90 or newer (QUADS_CUDA_PDL_TARGET, set by
// src/CMakeLists.txt from CMAKE_CUDA_ARCHITECTURES: a Hopper GPU running code JIT-compiled from an
// older target's PTX has no griddepcontrol in its kernels, and launching those with the attribute
// would let them race their predecessor) and the device has compute capability 9.0 or newer,
// unless QUADS_GPU_PDL=0. Decided once per process.
inline bool pdl_enabled() {
#ifdef QUADS_CUDA_PDL_TARGET
  static const bool on = [] {
    const char* e = std::getenv("QUADS_GPU_PDL");
    if (e && std::strcmp(e, "0") == 0) return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major >= 9;
  }();
  return on;
#else
  return false;
#endif
}

// A launch with PDL and, where cluster is not 1 x 1 x 1, thread-block clusters of that shape
// (sm_90; the grid must be a multiple of it).
template <typename... Params, typename... Args>
void launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  QUADS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem, stream, dim3(1, 1, 1), std::forward<Args>(args)...);
}

}  // namespace quads::cuda
