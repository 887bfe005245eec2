#pragma once
// The quantizers written out literally, one element at a time, with the codecs of formats.h:
// the specification the fast kernels in quantize.cpp / nvfp4_avx2.cpp are tested against.
// Slow; not for production use.
#include "numerics/quantize.h"

namespace quads::num::ref {

QTensor quantize(const float* x, int64_t rows, int64_t cols, const QConfig& cfg);
void dequantize(const QTensor& q, float* out);

}  // namespace quads::num::ref
