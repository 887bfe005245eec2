#pragma once
// CUDA device discovery. Declared for every build; without QUADS_HAVE_CUDA it reports no device.
#include <string>

namespace quads::cuda {
int device_count();              // 0 when built without CUDA or when no driver/GPU is present
std::string device_name(int i);  // "" when unavailable
// The current device's default memory pool keeps what cudaFreeAsync returns instead of giving it
// back to the driver at every synchronization (its default release threshold, 0): the kernels'
// stream-ordered workspaces (split-K partials, arg-max chunks) then cost a pool lookup, not a new
// mapping (~100 us a decode step at batch 1 when they were remapped each step). Idempotent.
void keep_pool_memory();
// Streaming multiprocessors of the current device (queried once; grids are sized by it); 132 (an
// H100/H200) where there is none, so launch plans can be checked without a GPU.
int sm_count();
// The step trace of a build with QUADS_STEP_TRACE (pdl.cuh): `buf` (device memory, 4 + 4 * cap
// words, buf[0] = 0 and buf[1] = cap) receives a record per kernel from now on; nullptr stops it.
// Returns false, and does nothing, in a build without the flag.
bool step_trace_set(unsigned long long* buf);
}  // namespace quads::cuda
