#pragma once
// NVFP4 / MXFP4 / FP8 quantization on the GPU: the device twins of numerics/quantize.h, bit for
// bit (tests/cuda/test_quant.cpp holds them to num::quantize and to the TransformerEngine golden
// vectors). Same configurations (QConfig), same layouts (QTensor), with two additions:
//  - input may be float32 or bfloat16 (given as its raw bits); bf16 input quantizes exactly as its
//    float32 value does on the CPU;
//  - NVFP4/MXFP4 block scales may be written directly in the cuBLASLt/CUTLASS 128x4 swizzled layout
//    (rows padded to 128, blocks to 4, zero fill) that the Blackwell block-scaled GEMM reads.
// Not supported on the GPU (quads::Error at the call): NVFP4 with a ragged shape (cols % 16, or
// rows % 16 for 16x16 tiles), MXFP4 with cols % 32 (the CPU has the same rules).
// All functions are asynchronous on `stream` unless said otherwise; pointers are device pointers,
// 16-byte aligned for the 4-bit schemes (cudaMalloc gives 256).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuda/check.h"
#include "numerics/quantize.h"

namespace quads::cuda {

enum class ScaleLayout : uint8_t {
  RowMajor,       // [rows, cols/block], as num::QTensor
  Swizzled128x4,  // off = ((r/128)*Kt + b/4)*512 + (r%32)*16 + ((r%128)/32)*4 + b%4, Kt = ceil(nb/4)
};

// A quantized tensor in device memory: num::QTensor's layout, device-owned.
struct DeviceQTensor {
  num::QConfig cfg;
  int64_t rows = 0, cols = 0;
  ScaleLayout layout = ScaleLayout::RowMajor;
  DeviceArray<uint8_t> codes;   // 4-bit packed [rows, cols/2] or FP8 [rows, cols]
  DeviceArray<uint8_t> scales;  // NVFP4 E4M3 / MXFP4 UE8M0 block scales (layout above)
  DeviceArray<float> fscales;   // FP8 dequantization scales (count as in num::QTensor)
  DeviceArray<float> amax;      // NVFP4 global amax: 1, or `rows` with Global::PerRow
  int64_t nblocks() const;      // block scales per row (NVFP4 cols/16, MXFP4 cols/32; 0 for FP8)
};

// Allocates a tensor for quantize(); checks the shape against the configuration.
DeviceQTensor make_qtensor(int64_t rows, int64_t cols, const num::QConfig& cfg,
                           ScaleLayout layout = ScaleLayout::RowMajor);

// The most rows of X as the skinny W4A4 tiles' FP16 operand (gemm.h's Nvfp4View::frag): a decode batch.
constexpr int64_t kXFragMaxRows = 64;
// x: [q.rows, q.cols] row-major on the device; q from make_qtensor (its cfg, shape and layout).
// frag (optional; NVFP4 E2M1 1x16, at most kXFragMaxRows rows): the rows also as the skinny W4A4
// tiles' FP16 operand (gemm.h's Nvfp4View::frag, x_frag_bytes(cols, rows) bytes).
void quantize(const float* x, DeviceQTensor& q, cudaStream_t stream = nullptr, uint8_t* frag = nullptr);
void quantize_bf16(const uint16_t* x, DeviceQTensor& q, cudaStream_t stream = nullptr);
// quantize() of the SwiGLU of two float32 sources in one kernel: row r of the input is
// kern::swiglu1(g[r * ld + c], u[r * ld + c]) for c < q.cols (the expert MLP's gate and up halves,
// ld = 2I), so the result is kern::swiglu then quantize(), byte for byte, without the [rows, cols]
// intermediate. For configs where quantize_swiglu_supported (NVFP4 E2M1 1x16, per-row or static
// amax, no stochastic rounding), row-major scales; g and u 16-byte aligned, ld a multiple of 4.
bool quantize_swiglu_supported(const num::QConfig& cfg);
// row_lo / row_hi (device int32, both or neither): only rows *row_lo .. *row_hi - 1 are written
// (a window of MoE groups: eoff + first, eoff + end), each as in the whole call.
void quantize_swiglu(const float* g, const float* u, int64_t ld, DeviceQTensor& q, cudaStream_t stream = nullptr,
                     const int32_t* row_lo = nullptr, const int32_t* row_hi = nullptr);

// RAC's residual operand in one kernel (model/rac.h): for each row of x [rows, cols], the
// activation quantizer `act` gives X_eff; the residual R = x - X_eff of the row's listed blocks
// (16 columns each: blocks[e * nb + i] for i < nsel, zeros for i in nsel .. nb - 1) is quantized
// into q ([rows, nb * 16], q.cfg, row-major scales). Bit for bit fake_quantize(x, act) ->
// kern::sub -> gather_blocks -> quantize(q), without the three intermediates. Dense: e = 0 and
// nsel = nsel_dense. Grouped (eoff non-null): row r belongs to the group e with eoff[e] <= r <
// eoff[e + 1] (groups of them) and nsel = nsel_dev[e]. For act and q.cfg NVFP4 E2M1 1x16 with
// a per-row or static amax and no stochastic rounding (rac_quantize_supported); x 16-byte aligned,
// cols a multiple of 16.
bool rac_quantize_supported(const num::QConfig& act, const num::QConfig& residual);
void rac_quantize(const float* x, int64_t cols, const num::QConfig& act, const int32_t* blocks, int64_t nb,
                  int64_t nsel_dense, const int32_t* nsel_dev, const int32_t* eoff, int groups, DeviceQTensor& q,
                  cudaStream_t stream = nullptr);

// RAC folded into the main GEMM (w4a4_gemm_rac, gemm.h), one kernel for the activation's codes
// and up to three residual operands. Row r < rows of the input is source row s = map ? map[r] /
// map_div : r of x (row stride ld), or with u the SwiGLU kern::swiglu1(x, u) (as quantize_swiglu).
// xq (optional, [rows, cols]): the activation's NVFP4 codes, quantize()'s bits. Operand j < nops
// (sel[j]: [groups, cols / 16] bytes on the device, nonzero where the block is compensated; row
// r's group by eoff as rac_quantize, or group 0 when eoff is null): the residual R = X - X_eff of
// the selected blocks quantized with `res` densely over cols, every other block zero: codes at
// rcodes + (j * rows + r) * cols / 2, scales at rscales + (j * rows + r) * cols / 16, amax at
// ramax[j * rows + r]. Its selected blocks hold rac_quantize's bits for the same blocks. Formats
// as rac_quantize_supported; x (and u) 16-byte aligned, cols a multiple of 16, ld of 4.
struct RacFoldSource {
  const float* x = nullptr;
  const float* u = nullptr;
  int64_t ld = 0;
  const int32_t* map = nullptr;
  int map_div = 1;
};
void rac_quantize_fold(const RacFoldSource& src, int64_t rows, int64_t cols, const num::QConfig& act,
                       DeviceQTensor* xq, int nops, const uint8_t* const* sel, const int32_t* eoff, int groups,
                       const num::QConfig& res, uint8_t* rcodes, uint8_t* rscales, float* ramax,
                       cudaStream_t stream = nullptr);

// The trainer's NVFP4 weight operands, many tensors in two launches (asymmetric QAT re-quantizes
// every linear after each optimizer step; a launch chain per tensor was ~4700 kernels a step on
// the peer model). Tensor t: src [rows, cols] float32, 16-byte aligned, cols % 16 == 0, quantized
// with cfg (weight_operands_supported: NVFP4 E2M1 1x16 with a per-tensor amax, no stochastic
// rounding); out [rows, cols] (16-byte aligned) receives the BF16 bits of e2m1(code) * e4m3(scale)
// and *alpha = amax * fp32(1/2688): quantize() then kern::nvfp4_weight_bf16, bit for bit, without
// the codes and scales in memory. run(): a pass for the tensors' amax, one for the operands;
// capturable in a CUDA graph (the pointers are fixed when the set is built). run(s, true): amax()
// already holds the tensors' amax (the trainer's AdamW pass writes it, kern::AdamWAmax).
struct WeightOperand {
  const float* src = nullptr;
  int64_t rows = 0, cols = 0;
  uint16_t* out = nullptr;
  float* alpha = nullptr;
};
bool weight_operands_supported(const num::QConfig& cfg);
class WeightOperandSet {
 public:
  WeightOperandSet() = default;
  WeightOperandSet(const std::vector<WeightOperand>& list, const num::QConfig& cfg);
  void run(cudaStream_t stream = nullptr, bool amax_ready = false);
  int64_t size() const { return count_; }
  float* amax() { return amax_.data(); }  // [size()], the tensors' amax after run()
  const float* amax() const { return amax_.data(); }

 private:
  DeviceArray<uint8_t> desc_;  // the kernels' descriptors, one per tensor
  DeviceArray<int32_t> cta_;   // the tensor of each CTA (a chunk of 8192 elements of one tensor)
  DeviceArray<float> amax_;
  int64_t count_ = 0, ctas_ = 0;
};

// Dequantized values, [rows, cols] float32 (or bf16 bits, rounded to nearest even).
void dequantize(const DeviceQTensor& q, float* out, cudaStream_t stream = nullptr);
void dequantize_bf16(const DeviceQTensor& q, uint16_t* out, cudaStream_t stream = nullptr);

// dequantize(quantize(x)) in one pass where the scheme allows it (NVFP4 1x16 and 16x16, MXFP4);
// otherwise (FP8) through a temporary. Bit-identical to the two-step path; out may alias x.
// amax (optional, device): receives the NVFP4 global amax (1 value, or rows with PerRow); when
// null, a stream-ordered temporary is used.
void fake_quantize(const float* x, float* out, int64_t rows, int64_t cols, const num::QConfig& cfg,
                   cudaStream_t stream = nullptr, float* amax = nullptr);
void fake_quantize_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t cols,
                        const num::QConfig& cfg, cudaStream_t stream = nullptr, float* amax = nullptr);

// Copies between host and device (synchronous). to_host always returns row-major scales.
num::QTensor to_host(const DeviceQTensor& q);
DeviceQTensor to_device(const num::QTensor& q, ScaleLayout layout = ScaleLayout::RowMajor);

// 128x4 scale swizzle on the device. `out` holds swizzled_scales_size(rows, nblocks) bytes; the
// padding is written as zeros.
int64_t swizzled_scales_size(int64_t rows, int64_t nblocks);
void swizzle_scales(const uint8_t* in, uint8_t* out, int64_t rows, int64_t nblocks, cudaStream_t stream = nullptr);
void unswizzle_scales(const uint8_t* in, uint8_t* out, int64_t rows, int64_t nblocks, cudaStream_t stream = nullptr);

// max |x| over n elements into *amax (device), NaN largest (as the CPU quantizer).
void absmax(const float* x, int64_t n, float* amax, cudaStream_t stream = nullptr);

}  // namespace quads::cuda
