#pragma once
// The W4A4 tile for many rows on Hopper's warpgroup MMA (w4a4_wgmma.cu, a unit of its own built
// for sm_90a only). Internal to the W4A4 GEMM (w4a4_gemm.cu chooses and launches it).
#include <cuda_runtime.h>

namespace quads::cuda {

struct Params;  // w4a4_gemv.cuh

// A W4A4 tile kernel and its launch shape (CTA threads, dynamic shared memory, rows of X and of W
// a CTA), launched by w4a4_gemm.cu's launch_tile.
struct TileKernel {
  void (*kernel)(Params) = nullptr;  // null: this build or this device has no such kernel
  int threads = 0, smem = 0, bm = 0, bn = 0;
};
// The tile of bn (128 or 256) weight rows, for dense or grouped calls; its kernel is ready to
// launch (dynamic shared memory set) or null where the device is not sm_90.
TileKernel w4a4_wgmma_tile(int bn, bool grouped);

}  // namespace quads::cuda
