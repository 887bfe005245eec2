// FP8 (E4M3) weight GEMV and dequantization of the GPU rollout engine (see fp8_gemm.h).
#include "cuda/fp8_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/codecs.cuh"
#include "cuda/kernel_util.cuh"

namespace quads::cuda {

namespace {

constexpr int kWarps = 8;        // warps per CTA
constexpr int kRowsPerWarp = 4;  // weight rows per warp: each activation load feeds 4 rows
// Activation rows per pass over the weight rows: the kernel's template MR (1, 2, 4 or 8), the
// smallest that holds a group's rows when the host knows a bound (decode at batch 1: 1; fewer
// accumulators leave room for more warps in flight).
constexpr int kChunk = 8;        // codes per lane and step (one 8-byte load)

// Two E4M3 codes (low byte first) to float. On sm_89+ the hardware converts them to FP16 (every
// E4M3 value, subnormals included, is exact in FP16) and FP16 to float is exact: the same values
// as dev::e4m3_decode in 1.5 instructions per code instead of about eight.
__device__ __forceinline__ void e4m3x2_decode(uint32_t two, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const unsigned short in = static_cast<unsigned short>(two & 0xFFFFu);
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
#else
  lo = dev::e4m3_decode(two & 0xFFu);
  hi = dev::e4m3_decode((two >> 8) & 0xFFu);
#endif
}

// value(code) * scale, one rounding: num::dequantize's lut[code] * s.
__device__ __forceinline__ void dequant8(uint2 c, float s, float (&w)[kChunk]) {
  e4m3x2_decode(c.x, w[0], w[1]);
  e4m3x2_decode(c.x >> 16, w[2], w[3]);
  e4m3x2_decode(c.y, w[4], w[5]);
  e4m3x2_decode(c.y >> 16, w[6], w[7]);
#pragma unroll
  for (int j = 0; j < kChunk; ++j) w[j] = __fmul_rn(w[j], s);
}

__device__ __forceinline__ void load8(const float* p, float (&v)[kChunk]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Warp (blockIdx.x, warp) owns weight rows n0 .. n0+3 of group blockIdx.y (table null: the one
// weight w0 and rows 0 .. m). Lane l takes codes 8l .. 8l+7 of every 256-wide step along k, in
// increasing k; a chunk of 8 never straddles a 128-column scale block.
template <int kActRows>
__global__ void __launch_bounds__(kWarps * 32)
    fp8_gemv_kernel(const float* __restrict__ x, int64_t m, Fp8Weight w0, const Fp8Weight* __restrict__ table,
                    const int32_t* __restrict__ eoff, Fp8Layout g, float* __restrict__ y) {
  int64_t mb = 0, me = m;
  Fp8Weight w = w0;
  if (table) {
    const int e = blockIdx.y;
    mb = eoff[e];
    me = eoff[e + 1];
    w = table[e];
  }
  const int lane = threadIdx.x & 31;
  const int64_t N = g.n, K = g.k;
  const int64_t n0 = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRowsPerWarp;
  if (mb >= me || n0 >= N) return;  // no barriers below
  const uint8_t* wr[kRowsPerWarp];
  const float* sr[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = n0 + i < N ? n0 + i : N - 1;  // rows past N repeat the last one, never stored
    wr[i] = w.codes + r * K;
    sr[i] = w.fscales + (r / g.bh) * g.ncb;
  }
  for (int64_t r0 = mb; r0 < me; r0 += kActRows) {
    const int rows = me - r0 < kActRows ? static_cast<int>(me - r0) : kActRows;
    float acc[kRowsPerWarp][kActRows];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int r = 0; r < kActRows; ++r) acc[i][r] = 0.f;
    for (int64_t k = int64_t(lane) * kChunk; k < K; k += 32 * kChunk) {
      const int64_t cb = g.col_blocks ? (k >> 7) : 0;
      float wv[kRowsPerWarp][kChunk];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i)
        dequant8(__ldg(reinterpret_cast<const uint2*>(wr[i] + k)), __ldg(sr[i] + cb), wv[i]);
#pragma unroll
      for (int r = 0; r < kActRows; ++r) {
        if (r < rows) {
          float xv[kChunk];
          load8(x + (r0 + r) * K + k, xv);
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i) {
            float s = acc[i][r];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) s = __fadd_rn(s, __fmul_rn(xv[j], wv[i][j]));
            acc[i][r] = s;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kActRows; ++r) {
      if (r >= rows) continue;  // warp-uniform
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float v = kern::warp_sum(acc[i][r]);
        if (lane == 0 && n0 + i < N) y[(r0 + r) * N + n0 + i] = v;
      }
    }
  }
}

__global__ void fp8_dequant_kernel(Fp8Weight w, Fp8Layout g, float* __restrict__ out) {
  const int64_t chunks = g.n * g.k / kChunk;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i * kChunk, r = e / g.k, c = e - r * g.k;
    const float s = w.fscales[(r / g.bh) * g.ncb + (g.col_blocks ? (c >> 7) : 0)];
    float v[kChunk];
    dequant8(*reinterpret_cast<const uint2*>(w.codes + e), s, v);
    float4* o = reinterpret_cast<float4*>(out + e);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

int64_t fp8_scale_count(const Fp8Layout& g) { return ((g.n + g.bh - 1) / g.bh) * g.ncb; }

// max_rows: a bound on the rows of every group (<= 0: none known).
void launch_gemv(const float* x, int64_t m, const Fp8Weight& w, const Fp8Weight* table, const int32_t* eoff,
                 int groups, int64_t max_rows, const Fp8Layout& g, float* y, cudaStream_t s) {
  const int64_t per_cta = int64_t(kWarps) * kRowsPerWarp;
  const dim3 grid(static_cast<unsigned>((g.n + per_cta - 1) / per_cta), static_cast<unsigned>(groups));
  const int th = kWarps * 32;
  if (max_rows == 1) fp8_gemv_kernel<1><<<grid, th, 0, s>>>(x, m, w, table, eoff, g, y);
  else if (max_rows == 2) fp8_gemv_kernel<2><<<grid, th, 0, s>>>(x, m, w, table, eoff, g, y);
  else if (max_rows > 0 && max_rows <= 4) fp8_gemv_kernel<4><<<grid, th, 0, s>>>(x, m, w, table, eoff, g, y);
  else fp8_gemv_kernel<8><<<grid, th, 0, s>>>(x, m, w, table, eoff, g, y);
  QUADS_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool fp8_weight_supported(const num::QConfig& cfg, int64_t k) {
  return cfg.scheme == num::Scheme::FP8 && cfg.element == num::Format::E4M3 && !cfg.stochastic && k > 0 &&
         k % kChunk == 0;
}

Fp8Layout fp8_layout(const num::QConfig& cfg, int64_t n, int64_t k, const char* what) {
  QUADS_CHECK(fp8_weight_supported(cfg, k) && n > 0,
              "fp8 GEMM: {} [{}, {}] in {}: needs FP8 E4M3 weights with in % 8 == 0", what, n, k, cfg.describe());
  Fp8Layout g;
  g.n = n;
  g.k = k;
  switch (cfg.block) {
    case num::Block::PerTensor: g.bh = n; break;
    case num::Block::PerRow: g.bh = 1; break;
    case num::Block::B1x128:
      g.bh = 1;
      g.ncb = (k + 127) / 128;
      g.col_blocks = true;
      break;
    case num::Block::B128x128:
      g.bh = 128;
      g.ncb = (k + 127) / 128;
      g.col_blocks = true;
      break;
    default: fail("fp8 GEMM: {}: FP8 block layout of {} not supported", what, cfg.describe());
  }
  return g;
}

Fp8Weight fp8_weight(const DeviceQTensor& q, const char* what) {
  const Fp8Layout g = fp8_layout(q.cfg, q.rows, q.cols, what);
  QUADS_CHECK(q.codes.size() == size_t(q.rows * q.cols) && q.fscales.size() == size_t(fp8_scale_count(g)),
              "fp8 GEMM: {} [{}, {}] holds {} codes and {} scales (expected {} and {})", what, q.rows, q.cols,
              q.codes.size(), q.fscales.size(), q.rows * q.cols, fp8_scale_count(g));
  Fp8Weight w;
  w.codes = q.codes.data();
  w.fscales = q.fscales.data();
  return w;
}

void fp8_dequantize(const Fp8Weight& w, const Fp8Layout& g, float* out, cudaStream_t stream) {
  const int64_t chunks = g.n * g.k / kChunk;
  if (chunks == 0) return;
  fp8_dequant_kernel<<<kern::grid_for(chunks), kern::kThreads, 0, stream>>>(w, g, out);
  QUADS_CUDA_LAUNCH_CHECK();
}

void fp8_gemv(const float* x, int64_t m, const Fp8Weight& w, const Fp8Layout& g, float* y, cudaStream_t stream) {
  if (m == 0 || g.n == 0) return;
  launch_gemv(x, m, w, nullptr, nullptr, 1, m, g, y, stream);
}

void fp8_gemv_grouped(const float* x, const Fp8Weight* w_table, const Fp8Layout& g, int groups, const int32_t* eoff,
                      int64_t max_rows, float* y, cudaStream_t stream) {
  if (groups == 0 || g.n == 0) return;
  QUADS_CHECK(groups <= 65535, "fp8_gemv_grouped: {} groups (at most 65535)", groups);
  launch_gemv(x, 0, Fp8Weight{}, w_table, eoff, groups, max_rows, g, y, stream);
}

}  // namespace quads::cuda
