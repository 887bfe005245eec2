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

// QUADS_STEP_TRACE (a build flag for `bench_model_gpu --step-trace` only, scripts/gpu/step_trace.sh):
// thread 0 of CTA (0, 0, 0) of every kernel that calls pdl_begin() appends a record of 4 words to
// the buffer set by step_trace_set() (device.h): the global timer (ns) before the wait and after
// it, the grid (x | y << 24 | z << 44) and the block's threads. Kernels run in stream order, so
// the time from one record's "after the wait" to the next one's is what that kernel adds to the
// step's critical path. Every translation unit has its own copy of the buffer's pointer
// (no separate compilation), registered at start-up. Without the flag nothing is compiled.
#ifdef QUADS_STEP_TRACE
void step_trace_register(void (*set)(unsigned long long*));  // device.cu
namespace {
__device__ unsigned long long* g_step_trace = nullptr;
void step_trace_set_here(unsigned long long* p) {
  QUADS_CUDA_CHECK(cudaMemcpyToSymbol(g_step_trace, &p, sizeof(p)));
}
[[maybe_unused]] const bool g_step_trace_registered = (step_trace_register(&step_trace_set_here), true);
}  // namespace
__device__ __forceinline__ unsigned long long step_trace_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// A mark inside a kernel for the step trace, in builds with QUADS_STEP_TRACE=2 only (each costs
// its thread an atomic's round trip, ~0.4 us, which the marked kernel's time then includes): the
// calling thread appends {now, now, 1 << 63 | id, its CTA's linear index}; the listing shows it
// between the kernels' records, with the time since the event before it. The ids: 10-12 the
// router (its first warp's token done, the routing CTA's tokens done, routed), 20-23 the decode
// attention (first tile in, keys done, the merging CTA starts, merged), 30-31 the norm (normalized
// and quantized, router logits), 40-41 the residual norm (combined, normalized), 50-53 the GEMV
// (group found, X staged, a tile's K loop done, the fused quantizer's amax known).
__device__ __forceinline__ void step_mark(int id) {
#if defined(QUADS_STEP_TRACE) && QUADS_STEP_TRACE >= 2
  const unsigned long long t = step_trace_ns();
  if (unsigned long long* b = g_step_trace) {
    const unsigned long long i = atomicAdd(b, 1ull);
    if (i < b[1]) {
      unsigned long long* r = b + 4 + 4 * i;
      r[0] = t;
      r[1] = t;
      r[2] = (1ull << 63) | static_cast<unsigned>(id);
      r[3] = blockIdx.x + gridDim.x * (blockIdx.y + static_cast<unsigned long long>(gridDim.y) * blockIdx.z);
    }
  }
#endif
}
// step_mark by thread 0 of CTA (0, 0, 0)
__device__ __forceinline__ void step_mark0(int id) {
#if defined(QUADS_STEP_TRACE) && QUADS_STEP_TRACE >= 2
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) step_mark(id);
#endif
}

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#ifdef QUADS_STEP_TRACE
  const unsigned long long t0 = step_trace_ns();
#endif
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#ifdef QUADS_STEP_TRACE
  if (threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    const unsigned long long t1 = step_trace_ns();
    if (unsigned long long* b = g_step_trace) {
      const unsigned long long i = atomicAdd(b, 1ull);
      if (i < b[1]) {  // b[1]: the records the buffer holds
        unsigned long long* r = b + 4 + 4 * i;
        r[0] = t0;
        r[1] = t1;
        r[2] = gridDim.x | (static_cast<unsigned long long>(gridDim.y) << 24) |
               (static_cast<unsigned long long>(gridDim.z) << 44);
        r[3] = blockDim.x * blockDim.y * blockDim.z;
      }
    }
  }
#endif
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
