// libFuzzer target for the safetensors reader: any byte string must either parse into a
// consistent file or throw quads::Error naming the file; never crash, hang or read out of
// bounds. Built only with clang (tests/fuzz/CMakeLists.txt defines QUADS_FUZZ); inside
// quads_tests, which globs every tests/**/*.cpp, this file compiles to nothing.
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ && cmake --build build-fuzz --target fuzz_safetensors
//   mkdir -p fuzz-work
//   build-fuzz/tests/fuzz/fuzz_safetensors -max_total_time=60 -dict=tests/fuzz/safetensors.dict fuzz-work tests/fuzz/corpus
// (libFuzzer adds new inputs to the first folder: keep the seed corpus second.)
#ifdef QUADS_FUZZ
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto f = quads::io::SafeTensorsFile::from_bytes("fuzz.safetensors", data, size);
    // Accepted: every view must lie inside the buffer and the views must tile the data.
    size_t total = 0;
    for (const auto& t : f->tensors()) {
      if (t.nbytes != static_cast<size_t>(t.numel()) * quads::io::dtype_size(t.dtype)) std::abort();
      total += t.nbytes;
      volatile uint8_t sink = 0;
      for (size_t i = 0; i < t.nbytes; ++i) sink = sink ^ t.data[i];  // ASan checks the range
      if (t.numel() > 0 && t.numel() < (1 << 16)) (void)t.to_f32();
    }
    if (total != f->file_size() - 8 - f->header_size()) std::abort();
  } catch (const quads::Error& e) {
    if (!std::strstr(e.what(), "fuzz.safetensors")) std::abort();
  }
  return 0;
}
#endif
