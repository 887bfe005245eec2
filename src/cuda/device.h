#pragma once
// CUDA device discovery. Declared for every build; without QUADS_HAVE_CUDA it reports no device.
#include <string>

namespace quads::cuda {
int device_count();              // 0 when built without CUDA or when no driver/GPU is present
std::string device_name(int i);  // "" when unavailable
int sm_count();  // streaming multiprocessors of the current device (queried once; grids are sized by it)
}  // namespace quads::cuda
