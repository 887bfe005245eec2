// NVFP4 / MXFP4 / FP8 quantizers on the GPU (see quant.h). The formulas are those at the top of
// numerics/quantize.h, step by step, with the codecs of codecs.cuh.
//
// The hot path (NVFP4 1x16, MXFP4) is one warp per row: lane l loads the 16-byte vectors
// l, l+32, ... of the row (coalesced), so a 16-element block sits in 4 consecutive lanes (float)
// or 2 (bf16) and its amax is two or one shuffles away. A row of up to 2048 elements stays in
// registers, so a per-row (per-token) global amax costs no second read.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "cuda/codecs.cuh"
#include "cuda/device.h"  // sm_count
#include "cuda/kernel_util.cuh"  // kern::swiglu1, kern::warp_max
#include "cuda/mma_util.cuh"  // x_frag_store
#include "cuda/pdl.cuh"
#include "cuda/quant.h"
#include "cuda/quant_row.cuh"

namespace quads::cuda {

using num::Block;
using num::Format;
using num::Global;
using num::QConfig;
using num::Scheme;

namespace {

using namespace dev;

// 16-byte vectors (Vec, vget, vabsmax) and the NVFP4 steps: quant_row.cuh.
template <typename T>
__device__ __forceinline__ uint4 vpack(const float* v) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(f2u(v[0]), f2u(v[1]), f2u(v[2]), f2u(v[3]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = bf16_encode(v[2 * i]) | (bf16_encode(v[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}
template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (sizeof(T) == 4) return v;
  else return u2f(static_cast<uint32_t>(v) << 16);
}

using kern::warp_max;

enum Kind { kNvE2M1, kNvE1M2, kMx };

// Where an NVFP4 kernel gets its global amax.
enum AmaxMode : int {
  kAmaxTensor = 0,  // amax[0], computed beforehand
  kAmaxRowCompute,  // per row, computed by the row kernel and written to amax[row]
  kAmaxStatic,      // the static value, written to amax[0] by the first warp
};

template <typename T>
struct RowArgs {
  const T* x;
  int64_t rows, cols;
  uint8_t* codes;   // quantize: codes and scales
  uint8_t* scales;
  int64_t kt;       // > 0: scales in the 128x4 swizzled layout with this many 4-block columns
  T* out;           // fake quantize: dequantized values
  float* amax;
  int amax_mode;
  float static_amax;
  bool mx_te_ceil;
  bool sr;
  uint64_t seed;
  // quantize_swiglu (row_block_kernel's SW variant, float): row r's element c is
  // kern::swiglu1(x[r * ld + c], u[r * ld + c])
  const T* u;
  int64_t ld;
  // warps a row (1, or kRowWarps: a CTA a row, for a few long rows that one warp would stream in
  // several round trips, or a row with its own amax that fits a CTA's registers; see row_warps)
  int rw;
  // quantize_swiglu of a window of rows: only rows *row_lo .. *row_hi - 1 (device values, e.g. a
  // MoE group range in eoff); nullptr: all
  const int32_t* row_lo;
  const int32_t* row_hi;
  // quantize(..., frag): the rows also as the skinny W4A4 tiles' FP16 operand (NVFP4 E2M1 1x16)
  uint4* frag;
};

__device__ __forceinline__ uint32_t encode4(Kind k, float v) {
  return k == kNvE1M2 ? e1m2_encode(v) : e2m1_encode(v);
}
__device__ __forceinline__ float decode4(Kind k, uint32_t c) {
  return k == kNvE1M2 ? e1m2_decode(c) : e2m1_decode(c);
}

constexpr int kRowWarps = 4;
// row_block_kernel's blocks a lane holds per chunk: 16 vectors of 16 bytes (SW: 8, the up half in
// registers too), so a warp's chunk is 2048 float32 or 4096 bf16 elements (SW: half).
template <typename T, Kind K, bool SW>
constexpr int row_lane_blocks() {
  return (SW ? 8 : 16) / ((K == kMx ? 32 : 16) / Vec<T>::N);
}

// Stochastic rounding of one element, out of line: it is rare (gradients) and long, and inlining it
// at every element of the unrolled hot loop would bloat the kernel.
__device__ __noinline__ uint32_t encode4_sr(float t, bool e1m2, uint64_t seed, uint64_t index) {
  const float u = sr_uniform(seed, index);
  return e1m2 ? grid4_encode_sr<true>(t, u) : grid4_encode_sr<false>(t, u);
}

// One warp per row (a.rw == 1) or one CTA per row (a.rw == kRowWarps); NVFP4 1x16 (E2M1 or E1M2)
// or MXFP4 1x32; quantize or fake-quantize. Lane l of the row's warp w owns the whole blocks
// (i * rw + w) * 32 + l of a chunk, so a block's scale is computed once, by one lane, with no
// shuffles; a chunk is 16 vectors of 16 bytes per lane (2048 float32 or 4096 bf16 elements per
// warp) and rows up to a chunk long stay in registers. The row's warps combine their amax through
// shared memory (max: the same bits whatever the split).
template <typename T, Kind K, bool FAKE, bool SW = false>
__global__ void __launch_bounds__(32 * kRowWarps) row_block_kernel(const RowArgs<T> a) {
  static_assert(!SW || sizeof(T) == 4, "the SwiGLU source is float32");
  pdl_begin();
  constexpr int VEC = Vec<T>::N;
  constexpr int BLK = K == kMx ? 32 : 16;
  constexpr int VPB = BLK / VEC;  // vectors per block
  constexpr int NB = row_lane_blocks<T, K, SW>();
  constexpr int CHUNK = 32 * NB;  // blocks per chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rw = a.rw, wr = warp % rw;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowWarps / rw) + warp / rw;
  if (row >= a.rows) return;  // rw > 1: a CTA is one row, all live (the barrier below)
  if (SW && a.row_lo && (row < *a.row_lo || row >= *a.row_hi)) return;  // uniform over a row's CTA too
  const int64_t nblk = a.cols / BLK;
  const uint4* xr = reinterpret_cast<const uint4*>(a.x + row * (SW ? a.ld : a.cols));
  const uint4* ur = reinterpret_cast<const uint4*>(SW ? a.u + row * a.ld : nullptr);
  // SW: the SwiGLU of the two sources' vectors, applied once all of a batch's loads are issued
  // (interleaved with the exp and division, the loads went out one round trip at a time)
  auto swiglu4 = [](uint4 gv, uint4 uv) {
    return make_uint4(f2u(kern::swiglu1(u2f(gv.x), u2f(uv.x))), f2u(kern::swiglu1(u2f(gv.y), u2f(uv.y))),
                      f2u(kern::swiglu1(u2f(gv.z), u2f(uv.z))), f2u(kern::swiglu1(u2f(gv.w), u2f(uv.w))));
  };
  uint4 buf[NB][VPB];
  auto load_chunk = [&](int64_t b0) {
    [[maybe_unused]] uint4 ub[NB][VPB];
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int64_t b = b0 + (i * rw + wr) * 32 + lane;
#pragma unroll
      for (int q = 0; q < VPB; ++q) {
        buf[i][q] = b < nblk ? xr[b * VPB + q] : make_uint4(0, 0, 0, 0);
        if constexpr (SW) ub[i][q] = b < nblk ? ur[b * VPB + q] : make_uint4(0, 0, 0, 0);
      }
    }
    if constexpr (SW)
#pragma unroll
      for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int q = 0; q < VPB; ++q) buf[i][q] = swiglu4(buf[i][q], ub[i][q]);
  };

  const bool row_in_regs = a.amax_mode == kAmaxRowCompute && nblk <= CHUNK * rw;
  // row_in_regs (NVFP4 only): each block's amax from the row's amax pass, kept for the encoding
  // pass instead of a second max over every element
  uint32_t bm[NB];
  NvGlobal g{};
  if constexpr (K != kMx) {
    float amax;
    if (a.amax_mode == kAmaxRowCompute) {
      uint32_t m = 0;
      if (row_in_regs) {
        load_chunk(0);
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          bm[i] = 0;
#pragma unroll
          for (int q = 0; q < VPB; ++q) bm[i] = max(bm[i], vabsmax<T>(buf[i][q]));
          m = max(m, bm[i]);
        }
      } else {
        const int64_t nvec = nblk * VPB;
        for (int64_t v = wr * 32 + lane; v < nvec; v += 4 * 32 * rw) {  // four loads in flight
          uint4 r[4];
          [[maybe_unused]] uint4 ru[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const bool ok = v + u * 32 * rw < nvec;
            r[u] = ok ? xr[v + u * 32 * rw] : make_uint4(0, 0, 0, 0);
            if constexpr (SW) ru[u] = ok ? ur[v + u * 32 * rw] : make_uint4(0, 0, 0, 0);
          }
          if constexpr (SW)
#pragma unroll
            for (int u = 0; u < 4; ++u) r[u] = swiglu4(r[u], ru[u]);
#pragma unroll
          for (int u = 0; u < 4; ++u) m = max(m, vabsmax<T>(r[u]));
        }
      }
      m = warp_max(m);
      if (rw > 1) {
        __shared__ uint32_t wm[kRowWarps];
        if (lane == 0) wm[warp] = m;
        __syncthreads();
        for (int w = 0; w < rw; ++w) m = max(m, wm[w]);
      }
      amax = u2f(m);
      if (lane == 0 && wr == 0 && a.amax) a.amax[row] = amax;
    } else if (a.amax_mode == kAmaxStatic) {
      amax = a.static_amax;
      if (row == 0 && lane == 0 && wr == 0 && a.amax) a.amax[0] = amax;
    } else {
      amax = a.amax[0];
    }
    g = nv_global<K == kNvE1M2>(amax);
  }

  for (int64_t b0 = 0; b0 < nblk; b0 += CHUNK * rw) {
    if (!row_in_regs) load_chunk(b0);
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      if (b0 + (i * rw + wr) * 32 >= nblk) break;  // warp-uniform
      const int64_t b = b0 + (i * rw + wr) * 32 + lane;
      if (b >= nblk) continue;
      uint32_t m = 0;
      if (row_in_regs) {
        m = bm[i];
      } else {
#pragma unroll
        for (int q = 0; q < VPB; ++q) m = max(m, vabsmax<T>(buf[i][q]));
      }
      uint32_t sf;
      float enc, dq;
      if constexpr (K == kMx) {
        sf = mx_scale_code(u2f(m), a.mx_te_ceil);
        dq = ue8m0_decode(sf);
        enc = __fdiv_rn(1.f, dq);  // exact: a power of two (or NaN), so x*enc == x/X
      } else {
        const NvBlockScale bs = nv_block_scale(m, g);
        sf = bs.sf;
        enc = bs.enc;
        dq = nv_decode_factor<K == kNvE1M2>(sf, g.amax);
      }
      uint32_t packed[BLK / 8];
#pragma unroll
      for (int w = 0; w < BLK / 8; ++w) packed[w] = 0;
      // Stochastic rounding in a loop of its own: the common path then has no branch or call site
      // at each element. At 2048-wide rows this kernel is bound by instruction issue, not bytes
      // (ncu: 114M -> 99M instructions with this and the kept block maxima, 70% -> 89% of copy).
      // Codes add into `packed` (disjoint bits: one shift-add each).
      auto encode = [&](auto sr) {
#pragma unroll
        for (int q = 0; q < VPB; ++q) {
          [[maybe_unused]] float y[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const int e = q * VEC + j;  // element of the block
            const float x = vget<T>(buf[i][q], j);
            uint32_t c;
            if constexpr (decltype(sr)::value)
              c = encode4_sr(nv_scaled(x, enc), K == kNvE1M2, a.seed,
                             static_cast<uint64_t>((row * nblk + b) * BLK + e));
            else
              c = nv_encode<K == kNvE1M2>(x, enc);
            packed[e / 8] += c << (4 * (e % 8));
            if constexpr (FAKE) y[j] = __fmul_rn(decode4(K, c), dq);
          }
          if constexpr (FAKE) reinterpret_cast<uint4*>(a.out + row * a.cols)[b * VPB + q] = vpack<T>(y);
        }
      };
      if (a.sr) encode(std::true_type{});
      else encode(std::false_type{});
      if constexpr (!FAKE) {
        uint8_t* dst = a.codes + row * a.cols / 2 + b * (BLK / 2);
        if constexpr (BLK == 16) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        if constexpr (K == kNvE2M1)
          if (a.frag) x_frag_store(a.frag, static_cast<int>(row), b, make_uint2(packed[0], packed[1]), sf, nblk);
        a.scales[a.kt > 0 ? swizzle_offset(row, b, a.kt) : row * nblk + b] = static_cast<uint8_t>(sf);
      }
    }
  }
}

// NVFP4 16x16 tiles (per-tensor or static global): a warp covers 16 rows and 32 vectors; each
// lane holds its vector of all 16 rows, a tile is LPB lanes wide.
template <typename T, Kind K, bool FAKE>
__global__ void __launch_bounds__(128) tile16_kernel(const RowArgs<T> a) {
  pdl_begin();
  constexpr int VEC = Vec<T>::N;
  constexpr int LPB = 16 / VEC;
  const int lane = threadIdx.x & 31;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 16;
  const int64_t nvec = a.cols / VEC;
  const int64_t vbase = (static_cast<int64_t>(blockIdx.y) * 4 + (threadIdx.x >> 5)) * 32;
  if (vbase >= nvec) return;
  const int64_t v = vbase + lane;
  const bool valid = v < nvec;
  uint4 buf[16];
  uint32_t m = 0;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    buf[r] = valid ? reinterpret_cast<const uint4*>(a.x + (r0 + r) * a.cols)[v] : make_uint4(0, 0, 0, 0);
    m = max(m, vabsmax<T>(buf[r]));
  }
#pragma unroll
  for (int s = 1; s < LPB; s <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
  float amax;
  if (a.amax_mode == kAmaxStatic) {
    amax = a.static_amax;
    if (r0 == 0 && vbase == 0 && lane == 0 && a.amax) a.amax[0] = amax;
  } else {
    amax = a.amax[0];
  }
  if (!valid) return;
  const NvGlobal g = nv_global<K == kNvE1M2>(amax);
  const uint32_t sf = nv_scale_code(u2f(m), g);
  const float enc = nv_encode_factor(sf, g);
  const float dq = nv_decode_factor<K == kNvE1M2>(sf, g.amax);
  const int64_t nblk = a.cols / 16;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int64_t row = r0 + r;
    uint32_t packed = 0;
    [[maybe_unused]] float y[VEC];
    // stochastic rounding in a loop of its own, as in row_block_kernel
    auto encode = [&](auto sr) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float t = __fmul_rn(vget<T>(buf[r], j), enc);
        uint32_t c;
        if constexpr (decltype(sr)::value)
          c = encode4_sr(t, K == kNvE1M2, a.seed, static_cast<uint64_t>(row * a.cols + v * VEC + j));
        else
          c = encode4(K, t);
        packed += c << (4 * j);
        if constexpr (FAKE) y[j] = __fmul_rn(decode4(K, c), dq);
      }
    };
    if (a.sr) encode(std::true_type{});
    else encode(std::false_type{});
    if constexpr (FAKE) {
      reinterpret_cast<uint4*>(a.out + row * a.cols)[v] = vpack<T>(y);
    } else {
      if constexpr (VEC == 4) reinterpret_cast<uint16_t*>(a.codes + row * a.cols / 2)[v] = static_cast<uint16_t>(packed);
      else reinterpret_cast<uint32_t*>(a.codes + row * a.cols / 2)[v] = packed;
      if (lane % LPB == 0) {
        const int64_t b = v / LPB;
        a.scales[a.kt > 0 ? swizzle_offset(row, b, a.kt) : row * nblk + b] = static_cast<uint8_t>(sf);
      }
    }
  }
}

// max |x| over a whole tensor into *out (zeroed beforehand) as float bits.
template <typename T>
__global__ void absmax_kernel(const T* x, int64_t n, uint32_t* out) {
  pdl_begin();
  constexpr int VEC = Vec<T>::N;
  const int64_t nvec = n / VEC;
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  for (int64_t i = t0; i < nvec; i += 4 * stride) {
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = i + u * stride < nvec ? xv[i + u * stride] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 4; ++u) m = max(m, vabsmax<T>(r[u]));
  }
  for (int64_t i = nvec * VEC + t0; i < n; i += stride) m = max(m, f2u(to_f32(x[i])) & 0x7FFFFFFFu);
  kern::block_atomic_max(m, out);
}

// ---- FP8 ---------------------------------------------------------------------------------
struct Fp8Geom {
  int64_t rows, cols, bh, bw, ncb;  // scale groups are bh x bw rectangles, ncb per group row
};
__host__ __device__ inline Fp8Geom fp8_geom(const QConfig& cfg, int64_t rows, int64_t cols) {
  int64_t bh = rows, bw = cols;
  if (cfg.block == Block::PerRow) { bh = 1; bw = cols; }
  if (cfg.block == Block::B1x128) { bh = 1; bw = 128; }
  if (cfg.block == Block::B128x128) { bh = 128; bw = 128; }
  if (bh == 0) bh = 1;
  if (bw == 0) bw = 1;
  return {rows, cols, bh, bw, (cols + bw - 1) / bw};
}

__device__ __forceinline__ float fp8_scale(float amax, float fmax) {
  float scale = __fdiv_rn(amax, fmax);
  if (amax == 0.f || scale == 0.f) scale = 1.f;
  return scale;
}

// One warp per scale group (not per-tensor): its amax, then its scale.
template <typename T>
__global__ void fp8_group_scale_kernel(const T* x, Fp8Geom gm, int64_t ngroups, float fmax, float* fscales) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (gi >= ngroups) return;
  const int64_t rb = gi / gm.ncb, cb = gi % gm.ncb;
  const int64_t r0 = rb * gm.bh, r1 = min(gm.rows, r0 + gm.bh), c0 = cb * gm.bw, c1 = min(gm.cols, c0 + gm.bw);
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0 + lane; c < c1; c += 32) m = max(m, f2u(to_f32(x[r * gm.cols + c])) & 0x7FFFFFFFu);
  m = warp_max(m);
  if (lane == 0) fscales[gi] = fp8_scale(u2f(m), fmax);
}
__global__ void fp8_tensor_scale_kernel(float* fscales, float fmax) {
  pdl_begin();
  fscales[0] = fp8_scale(fscales[0], fmax);  // fscales[0] held the amax bits
}

// Scale index of element (r, c) for a non-per-tensor FP8 layout (bw is 128 or the whole row).
__device__ __forceinline__ int64_t fp8_group(const Fp8Geom& gm, int64_t r, int64_t c) {
  const int64_t rb = gm.bh == 1 ? r : r >> 7;
  const int64_t cb = gm.bw == 128 ? c >> 7 : 0;
  return rb * gm.ncb + cb;
}

// FP8 quantize / fake-quantize: rows along y (grid-stride), columns along x.
template <typename T, bool E5M2, bool FAKE>
__global__ void fp8_encode_kernel(const T* x, Fp8Geom gm, bool per_tensor, const float* fscales, uint8_t* codes, T* out) {
  pdl_begin();
  for (int64_t r = blockIdx.y; r < gm.rows; r += gridDim.y)
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < gm.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t i = r * gm.cols + c;
      const float s = per_tensor ? fscales[0] : fscales[fp8_group(gm, r, c)];
      const float v = __fdiv_rn(to_f32(x[i]), s);
      const uint32_t code = E5M2 ? e5m2_encode_sat(v) : e4m3_encode(v);
      if constexpr (FAKE) {
        const float y = __fmul_rn(E5M2 ? e5m2_decode(code) : e4m3_decode(code), s);
        if constexpr (sizeof(T) == 4) out[i] = y;
        else out[i] = static_cast<T>(bf16_encode(y));
      } else {
        codes[i] = static_cast<uint8_t>(code);
      }
    }
}

// ---- dequantize ---------------------------------------------------------------------------
// NVFP4 / MXFP4: one thread per 8 elements (one 32-bit word of codes, always inside one block).
template <typename T, Kind K>
__global__ void dequant4_kernel(const uint8_t* codes, const uint8_t* scales, const float* amax, bool amax_per_row,
                                int64_t rows, int64_t cols, int64_t kt, T* out) {
  pdl_begin();
  constexpr int BLK = K == kMx ? 32 : 16;
  const int64_t nw = rows * cols / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nblk = cols / BLK;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < nw; w += stride) {
    const int64_t e0 = w * 8, r = e0 / cols, c = e0 % cols, b = c / BLK;
    const uint32_t sf = scales[kt > 0 ? swizzle_offset(r, b, kt) : r * nblk + b];
    float dq;
    if constexpr (K == kMx) dq = ue8m0_decode(sf);
    else dq = nv_decode_factor<K == kNvE1M2>(sf, amax[amax_per_row ? r : 0]);
    const uint32_t q = reinterpret_cast<const uint32_t*>(codes)[w];
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(decode4(K, (q >> (4 * j)) & 0xFu), dq);
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<uint4*>(out + e0)[0] = vpack<float>(y);
      reinterpret_cast<uint4*>(out + e0)[1] = vpack<float>(y + 4);
    } else {
      reinterpret_cast<uint4*>(out + e0)[0] = vpack<T>(y);
    }
  }
}
template <typename T, bool E5M2>
__global__ void dequant_fp8_kernel(const uint8_t* codes, const float* fscales, Fp8Geom gm, bool per_tensor, T* out) {
  pdl_begin();
  for (int64_t r = blockIdx.y; r < gm.rows; r += gridDim.y)
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < gm.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t i = r * gm.cols + c;
      const float s = per_tensor ? fscales[0] : fscales[fp8_group(gm, r, c)];
      const float y = __fmul_rn(E5M2 ? e5m2_decode(codes[i]) : e4m3_decode(codes[i]), s);
      if constexpr (sizeof(T) == 4) out[i] = y;
      else out[i] = static_cast<T>(bf16_encode(y));
    }
}

__global__ void swizzle_kernel(const uint8_t* in, uint8_t* out, int64_t rows, int64_t nblocks, int64_t kt,
                               int64_t total, bool forward) {
  pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t kpad = kt * 4;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    // i runs over the padded [rows128, kpad] grid in forward mode, over [rows, nblocks] otherwise
    if (forward) {
      const int64_t r = i / kpad, b = i % kpad;
      out[swizzle_offset(r, b, kt)] = (r < rows && b < nblocks) ? in[r * nblocks + b] : 0;
    } else {
      const int64_t r = i / nblocks, b = i % nblocks;
      out[i] = in[swizzle_offset(r, b, kt)];
    }
  }
}

// ---- host side ----------------------------------------------------------------------------
int grid_for(int64_t work, int threads) {
  const int64_t want = (work + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(sm_count()) * 16)));
}

dim3 fp8_grid(int64_t rows, int64_t cols) {
  const int64_t gx = std::min<int64_t>((cols + 255) / 256, 64);
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>(rows, 16 * 132 * 8 / gx));
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(std::min<int64_t>(gy, 65535)));
}

Kind kind_of(const QConfig& cfg) {
  if (cfg.scheme == Scheme::MXFP4) return kMx;
  return cfg.element == Format::E1M2 ? kNvE1M2 : kNvE2M1;
}

// ---- WeightOperandSet: the trainer's NVFP4 weight operands, many tensors a launch ----
// A CTA takes a chunk of kWopChunk elements of one tensor (cta_t: its tensor); the amax pass and
// the operand pass use the same chunks. The steps are quantize()'s row kernel's at a per-tensor
// amax (nv_quant_block16) and nvfp4_weight_bf16's (nv_operand_bf16x8, nv_weight_alpha).
struct WDesc {
  const float* src;
  uint16_t* out;
  float* alpha;
  int64_t n;     // rows * cols, a multiple of 16
  int64_t cta0;  // the tensor's first CTA
};
constexpr int kWopThreads = 256;
constexpr int64_t kWopChunk = 8192;  // 8 vectors a thread for the amax, 2 blocks of 16 for the operand

__global__ void __launch_bounds__(kWopThreads) wop_amax_kernel(const WDesc* __restrict__ d,
                                                                const int32_t* __restrict__ cta_t, uint32_t* amax) {
  pdl_begin();
  const int t = cta_t[blockIdx.x];
  const WDesc w = d[t];
  const int64_t e0 = (static_cast<int64_t>(blockIdx.x) - w.cta0) * kWopChunk;
  const int64_t nv = min(kWopChunk, w.n - e0) / 4;
  const uint4* x = reinterpret_cast<const uint4*>(w.src + e0);
  uint4 r[kWopChunk / 4 / kWopThreads];
#pragma unroll
  for (int u = 0; u < kWopChunk / 4 / kWopThreads; ++u) {
    const int64_t v = threadIdx.x + u * kWopThreads;
    r[u] = v < nv ? x[v] : make_uint4(0, 0, 0, 0);
  }
  uint32_t m = 0;
#pragma unroll
  for (int u = 0; u < kWopChunk / 4 / kWopThreads; ++u) m = max(m, vabsmax<float>(r[u]));
  kern::block_atomic_max(m, amax + t);  // the absmax kernel's bits
}

__global__ void __launch_bounds__(kWopThreads) wop_operand_kernel(const WDesc* __restrict__ d,
                                                                   const int32_t* __restrict__ cta_t,
                                                                   const float* __restrict__ amax) {
  pdl_begin();
  constexpr int BPT = kWopChunk / 16 / kWopThreads;  // blocks a thread
  const int t = cta_t[blockIdx.x];
  const WDesc w = d[t];
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) - w.cta0;
  const float am = amax[t];
  if (chunk == 0 && threadIdx.x == 0) *w.alpha = nv_weight_alpha(am);
  const NvGlobal g = nv_global<false>(am);
  const int64_t nb = min(kWopChunk, w.n - chunk * kWopChunk) / 16;
  const float4* x = reinterpret_cast<const float4*>(w.src + chunk * kWopChunk);
  uint4* o = reinterpret_cast<uint4*>(w.out + chunk * kWopChunk);
  float4 v[BPT][4];
#pragma unroll
  for (int i = 0; i < BPT; ++i) {
    const int64_t b = threadIdx.x + i * kWopThreads;
#pragma unroll
    for (int q = 0; q < 4; ++q) v[i][q] = b < nb ? x[b * 4 + q] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int i = 0; i < BPT; ++i) {
    const int64_t b = threadIdx.x + i * kWopThreads;
    if (b >= nb) break;
    uint32_t m = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) m = max(m, vabsmax(v[i][q]));
    uint32_t sf;
    const uint2 c = nv_quant_block16(v[i], m, g, sf);
    const float sc = e4m3_decode(sf);
    o[2 * b] = nv_operand_bf16x8(c.x, sc);
    o[2 * b + 1] = nv_operand_bf16x8(c.y, sc);
  }
}

int64_t kt_of(int64_t nblocks) { return (nblocks + 3) / 4; }

int64_t fp8_nscales(const QConfig& cfg, int64_t rows, int64_t cols) {
  if (cfg.block == Block::PerTensor) return 1;
  const Fp8Geom g = fp8_geom(cfg, rows, cols);
  return ((rows + g.bh - 1) / g.bh) * g.ncb;
}

template <typename T>
void launch_absmax(const T* x, int64_t n, float* amax, cudaStream_t s) {
  QUADS_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), s));
  if (n == 0) return;
  launch_pdl(absmax_kernel<T>, grid_for(n / Vec<T>::N + 1, 256), 256, 0, s, x, n, reinterpret_cast<uint32_t*>(amax));
}

// A CTA a row (1) where a warp a row would leave most SMs idle and the row has a block for each
// lane of the CTA: decode-batch activations (16 x 4096 float: 10 us a call under ncu with a warp a
// row, mostly that warp's round trips over its 16 KB); (2) where a row with its own amax fits the
// CTA's registers but not a warp's: one pass over it from memory instead of an amax pass and a
// second read that L2 no longer holds (16384 x 8192 float, per-row amax: 52% -> 86% of copy).
template <typename T, Kind K, bool SW>
int row_warps(int64_t rows, int64_t cols, bool row_amax) {
  const int64_t nblk = cols / (K == kMx ? 32 : 16), chunk = 32 * row_lane_blocks<T, K, SW>();
  if (rows < 2LL * sm_count() && nblk >= 32LL * kRowWarps) return kRowWarps;
  return row_amax && nblk > chunk && nblk <= chunk * kRowWarps ? kRowWarps : 1;
}
template <typename T, bool FAKE, Kind K, bool SW = false>
void launch_row(RowArgs<T> a, cudaStream_t s) {
  a.rw = row_warps<T, K, SW>(a.rows, a.cols, a.amax_mode == kAmaxRowCompute);
  const unsigned blocks = static_cast<unsigned>((a.rows + kRowWarps / a.rw - 1) / (kRowWarps / a.rw));
  launch_pdl(row_block_kernel<T, K, FAKE, SW>, blocks, 32 * kRowWarps, 0, s, a);
}
template <typename T, bool FAKE, Kind K>
void launch_tile16(const RowArgs<T>& a, cudaStream_t s) {
  const int64_t nvec = a.cols / Vec<T>::N;
  const dim3 grid(static_cast<unsigned>(a.rows / 16), static_cast<unsigned>((nvec + 127) / 128));
  launch_pdl(tile16_kernel<T, K, FAKE>, grid, 128, 0, s, a);
}

// NVFP4 / MXFP4 quantize or fake-quantize of a [rows, cols] T tensor.
template <typename T, bool FAKE>
void run_4bit(const T* x, int64_t rows, int64_t cols, const QConfig& cfg, uint8_t* codes, uint8_t* scales,
              int64_t kt, T* out, float* amax, cudaStream_t s, uint8_t* frag = nullptr) {
  // the kernels move 16-byte vectors
  QUADS_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
              "cuda quantizer ({}): input and output must be 16-byte aligned device pointers", cfg.describe());
  RowArgs<T> a{};
  a.x = x;
  a.rows = rows;
  a.cols = cols;
  a.codes = codes;
  a.scales = scales;
  a.kt = kt;
  a.out = out;
  a.amax = amax;
  a.static_amax = cfg.static_amax;
  a.mx_te_ceil = cfg.mx_rule == num::MxRule::TeCeil;
  a.sr = cfg.stochastic;
  a.seed = cfg.seed;
  a.frag = reinterpret_cast<uint4*>(frag);
  if (cfg.scheme == Scheme::NVFP4) {
    if (cfg.global == Global::PerTensor) {
      launch_absmax(x, rows * cols, amax, s);
      a.amax_mode = kAmaxTensor;
    } else if (cfg.global == Global::Static) {
      a.amax_mode = kAmaxStatic;
    } else {
      a.amax_mode = kAmaxRowCompute;
    }
  }
  const Kind k = kind_of(cfg);
  if (cfg.scheme == Scheme::NVFP4 && cfg.block == Block::B16x16) {
    if (k == kNvE1M2) launch_tile16<T, FAKE, kNvE1M2>(a, s);
    else launch_tile16<T, FAKE, kNvE2M1>(a, s);
  } else if (k == kMx) {
    launch_row<T, FAKE, kMx>(a, s);
  } else if (k == kNvE1M2) {
    launch_row<T, FAKE, kNvE1M2>(a, s);
  } else {
    launch_row<T, FAKE, kNvE2M1>(a, s);
  }
}

template <typename T, bool FAKE>
void run_fp8(const T* x, int64_t rows, int64_t cols, const QConfig& cfg, uint8_t* codes, float* fscales, T* out,
             cudaStream_t s) {
  const Fp8Geom gm = fp8_geom(cfg, rows, cols);
  const float fmax = cfg.element == Format::E4M3 ? 448.f : 57344.f;
  const bool per_tensor = cfg.block == Block::PerTensor;
  if (per_tensor) {
    launch_absmax(x, rows * cols, fscales, s);
    launch_pdl(fp8_tensor_scale_kernel, 1, 1, 0, s, fscales, fmax);
  } else {
    const int64_t ng = fp8_nscales(cfg, rows, cols);
    launch_pdl(fp8_group_scale_kernel<T>, static_cast<unsigned>((ng + 7) / 8), 256, 0, s, x, gm, ng, fmax, fscales);
  }
  QUADS_CUDA_LAUNCH_CHECK();
  const dim3 g = fp8_grid(rows, cols);
  if (cfg.element == Format::E5M2) launch_pdl(fp8_encode_kernel<T, true, FAKE>, g, 256, 0, s, x, gm, per_tensor, fscales, codes, out);
  else launch_pdl(fp8_encode_kernel<T, false, FAKE>, g, 256, 0, s, x, gm, per_tensor, fscales, codes, out);
}

void check_shape(const DeviceQTensor& q, const char* what) { num::check_config(q.cfg, q.rows, q.cols, what); }

template <typename T>
void quantize_any(const T* x, DeviceQTensor& q, cudaStream_t s, uint8_t* frag = nullptr) {
  check_shape(q, "cuda::quantize");
  QUADS_CHECK(!frag || (q.cfg.scheme == Scheme::NVFP4 && q.cfg.element == Format::E2M1 &&
                        q.cfg.block == Block::B1x16 && q.rows <= kXFragMaxRows && q.layout == ScaleLayout::RowMajor &&
                        reinterpret_cast<uintptr_t>(frag) % 16 == 0),
              "cuda::quantize: FP16 fragments are written for NVFP4 E2M1 1x16 with row-major scales, at most {} "
              "rows and a 16-byte aligned buffer (got {}, {} rows)", kXFragMaxRows, q.cfg.describe(), q.rows);
  if (q.rows == 0 || q.cols == 0) return;
  if (q.cfg.scheme == Scheme::FP8) {
    run_fp8<T, false>(x, q.rows, q.cols, q.cfg, q.codes.data(), q.fscales.data(), nullptr, s);
    return;
  }
  int64_t kt = 0;
  if (q.layout == ScaleLayout::Swizzled128x4) {
    kt = kt_of(q.nblocks());
    // the padding rows/blocks of the swizzled layout are zeros
    QUADS_CUDA_CHECK(cudaMemsetAsync(q.scales.data(), 0, q.scales.bytes(), s));
  }
  run_4bit<T, false>(x, q.rows, q.cols, q.cfg, q.codes.data(), q.scales.data(), kt, nullptr, q.amax.data(), s, frag);
}

template <typename T>
void dequantize_any(const DeviceQTensor& q, T* out, cudaStream_t s) {
  check_shape(q, "cuda::dequantize");
  if (q.rows == 0 || q.cols == 0) return;
  if (q.cfg.scheme == Scheme::FP8) {
    const Fp8Geom gm = fp8_geom(q.cfg, q.rows, q.cols);
    const bool pt = q.cfg.block == Block::PerTensor;
    const dim3 g = fp8_grid(q.rows, q.cols);
    if (q.cfg.element == Format::E5M2) launch_pdl(dequant_fp8_kernel<T, true>, g, 256, 0, s, q.codes.data(), q.fscales.data(), gm, pt, out);
    else launch_pdl(dequant_fp8_kernel<T, false>, g, 256, 0, s, q.codes.data(), q.fscales.data(), gm, pt, out);
    return;
  }
  const int64_t kt = q.layout == ScaleLayout::Swizzled128x4 ? kt_of(q.nblocks()) : 0;
  const bool per_row = q.cfg.scheme == Scheme::NVFP4 && q.cfg.global == Global::PerRow;
  const int g = grid_for(q.rows * q.cols / 8, 256);
  switch (kind_of(q.cfg)) {
    case kMx: launch_pdl(dequant4_kernel<T, kMx>, g, 256, 0, s, q.codes.data(), q.scales.data(), nullptr, false, q.rows, q.cols, kt, out); break;
    case kNvE1M2: launch_pdl(dequant4_kernel<T, kNvE1M2>, g, 256, 0, s, q.codes.data(), q.scales.data(), q.amax.data(), per_row, q.rows, q.cols, kt, out); break;
    default: launch_pdl(dequant4_kernel<T, kNvE2M1>, g, 256, 0, s, q.codes.data(), q.scales.data(), q.amax.data(), per_row, q.rows, q.cols, kt, out); break;
  }
  QUADS_CUDA_LAUNCH_CHECK();
}

template <typename T>
void fake_quantize_any(const T* x, T* out, int64_t rows, int64_t cols, const QConfig& cfg, cudaStream_t s,
                       float* amax) {
  num::check_config(cfg, rows, cols, "cuda::fake_quantize");
  if (rows == 0 || cols == 0) return;
  if (cfg.scheme == Scheme::FP8) {
    uint8_t* codes = nullptr;  // unused by the fused FP8 path
    float* fs = nullptr;
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&fs), sizeof(float) * fp8_nscales(cfg, rows, cols), s));
    run_fp8<T, true>(x, rows, cols, cfg, codes, fs, out, s);
    QUADS_CUDA_CHECK(cudaFreeAsync(fs, s));
    return;
  }
  float* tmp = nullptr;
  if (!amax && cfg.scheme == Scheme::NVFP4) {
    const int64_t n = cfg.global == Global::PerRow ? rows : 1;
    QUADS_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&tmp), sizeof(float) * n, s));
    amax = tmp;
  }
  run_4bit<T, true>(x, rows, cols, cfg, nullptr, nullptr, 0, out, amax, s);
  if (tmp) QUADS_CUDA_CHECK(cudaFreeAsync(tmp, s));
}

}  // namespace

int64_t DeviceQTensor::nblocks() const {
  if (cfg.scheme == Scheme::NVFP4) return cols / 16;
  if (cfg.scheme == Scheme::MXFP4) return cols / 32;
  return 0;
}

int64_t swizzled_scales_size(int64_t rows, int64_t nblocks) {
  return (rows + 127) / 128 * 128 * kt_of(nblocks) * 4;
}

DeviceQTensor make_qtensor(int64_t rows, int64_t cols, const QConfig& cfg, ScaleLayout layout) {
  num::check_config(cfg, rows, cols, "cuda::make_qtensor");
  DeviceQTensor q;
  q.cfg = cfg;
  q.rows = rows;
  q.cols = cols;
  q.layout = cfg.scheme == Scheme::FP8 ? ScaleLayout::RowMajor : layout;
  if (cfg.scheme == Scheme::FP8) {
    q.codes.resize(rows * cols);
    q.fscales.resize(fp8_nscales(cfg, rows, cols));
  } else {
    q.codes.resize(rows * cols / 2);
    const int64_t nb = q.nblocks();
    q.scales.resize(q.layout == ScaleLayout::Swizzled128x4 ? swizzled_scales_size(rows, nb) : rows * nb);
    if (cfg.scheme == Scheme::NVFP4) q.amax.resize(cfg.global == Global::PerRow ? rows : 1);
  }
  return q;
}

void quantize(const float* x, DeviceQTensor& q, cudaStream_t s, uint8_t* frag) { quantize_any(x, q, s, frag); }

namespace {

// rac_quantize: one warp a row. Lane l takes the listed blocks l, l + 32, ...: the activation
// quantizer's codes of a block give X_eff, the residual is x - X_eff (as fake_quantize then
// kern::sub), and the residual row is quantized as quantize() would the gathered row: its amax
// (over the listed blocks; the zero blocks past nsel do not change it), then each block. The
// residual is computed twice (for the amax, then for the codes), the same operations both times.
__global__ void __launch_bounds__(128) rac_quantize_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                                           int act_static, float act_amax, const int32_t* blocks,
                                                           int64_t nb, int64_t nsel_dense, const int32_t* nsel_dev,
                                                           const int32_t* eoff, int groups, int res_static,
                                                           float res_amax, uint8_t* codes, uint8_t* scales,
                                                           float* amax_out) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float* xr = x + row * cols;
  float aamax = act_amax;
  if (!act_static) {
    uint32_t m = 0;
    for (int64_t v = lane; v < cols / 4; v += 32) m = max(m, vabsmax(reinterpret_cast<const float4*>(xr)[v]));
    aamax = u2f(kern::warp_max(m));
  }
  const NvGlobal ga = nv_global<false>(aamax);
  int e = 0;
  int64_t ns = nsel_dense;
  if (eoff) {
    e = group_of_row(eoff, groups, row);
    ns = nsel_dev[e];
  }
  const int32_t* bl = blocks + static_cast<int64_t>(e) * nb;
  auto residual = [&](int64_t i, float4 (&r)[4]) {
    if (i >= ns) {
#pragma unroll
      for (int q = 0; q < 4; ++q) r[q] = make_float4(0.f, 0.f, 0.f, 0.f);
      return;
    }
    const float4* src = reinterpret_cast<const float4*>(xr + static_cast<int64_t>(bl[i]) * 16);
    float4 v[4];
    uint32_t bm = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      v[q] = src[q];
      bm = max(bm, vabsmax(v[q]));
    }
    nv_residual16(v, bm, ga, r);
  };
  float ramax = res_amax;
  if (!res_static) {
    uint32_t m = 0;
    for (int64_t i = lane; i < nb; i += 32) {
      float4 r[4];
      residual(i, r);
#pragma unroll
      for (int q = 0; q < 4; ++q) m = max(m, vabsmax(r[q]));
    }
    ramax = u2f(kern::warp_max(m));
    if (lane == 0) amax_out[row] = ramax;
  } else if (row == 0 && lane == 0) {
    amax_out[0] = ramax;
  }
  const NvGlobal gr = nv_global<false>(ramax);
  for (int64_t i = lane; i < nb; i += 32) {
    float4 r[4];
    residual(i, r);
    uint32_t bm = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) bm = max(bm, vabsmax(r[q]));
    uint32_t sf;
    const uint2 packed = nv_quant_block16(r, bm, gr, sf);
    *reinterpret_cast<uint2*>(codes + (row * nb + i) * 8) = packed;
    scales[row * nb + i] = static_cast<uint8_t>(sf);
  }
}


// rac_quantize_fold: a CTA a row (kFoldThreads threads, a thread a 16-block: blocks t, t + kFoldThreads,
// ..., the first kFoldRegs of them kept in registers, the rest loaded again). The row's amax (a
// CTA-wide max), each block's activation codes (stored) and X_eff, the residual of the blocks any
// operand selects and each operand's amax over its blocks (one more CTA-wide max), then every
// operand's blocks: the selected ones quantized as rac_quantize does, the others zeros. (A warp a
// row walked a 4096-wide row three times: 19.5 us at batch 1 on the H200, against ~4 us here.)
constexpr int kFoldThreads = 256, kFoldRegs = 2;
struct FoldSel {
  const uint8_t* p[3];
};
__global__ void __launch_bounds__(kFoldThreads) rac_fold_kernel(const float* __restrict__ x, const float* __restrict__ u,
                                                                int64_t ld, const int32_t* map, int map_div,
                                                                int64_t rows, int64_t cols, int act_static,
                                                                float act_amax, uint8_t* xcodes, uint8_t* xscales,
                                                                float* xamax, FoldSel sel, int nops,
                                                                const int32_t* eoff, int groups, int res_static,
                                                                float res_amax, uint8_t* rcodes, uint8_t* rscales,
                                                                float* ramax) {
  __shared__ uint32_t s_max[2][kFoldThreads / 32][4];  // one set per CTA-wide max (no barrier between them)
  pdl_begin();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int64_t nb = cols / 16, src = map ? static_cast<int64_t>(map[row] / map_div) : row;
  const float4* xr = reinterpret_cast<const float4*>(x + src * ld);
  const float4* ur = u ? reinterpret_cast<const float4*>(u + src * ld) : nullptr;
  auto load_block = [&](int64_t b, float4 (&v)[4], uint32_t& bm) {
    bm = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float4 g = xr[b * 4 + q];
      if (ur) {
        const float4 w = ur[b * 4 + q];
        g = make_float4(kern::swiglu1(g.x, w.x), kern::swiglu1(g.y, w.y), kern::swiglu1(g.z, w.z),
                        kern::swiglu1(g.w, w.w));
      }
      v[q] = g;
      bm = max(bm, vabsmax(g));
    }
  };
  // the CTA-wide max of n values a thread (n <= 4) into m, through set `set` of s_max; every
  // thread gets them
  auto cta_max = [&](uint32_t (&m)[4], int n, int set) {
    for (int i = 0; i < n; ++i) {
      uint32_t v = kern::warp_max(m[i]);
      if (lane == 0) s_max[set][warp][i] = v;
    }
    __syncthreads();
    for (int i = 0; i < n; ++i) {
      uint32_t v = 0;
#pragma unroll
      for (int w = 0; w < kFoldThreads / 32; ++w) v = max(v, s_max[set][w][i]);
      m[i] = v;
    }
  };
  float4 v[kFoldRegs][4];
  uint32_t bmax[kFoldRegs];
#pragma unroll
  for (int i = 0; i < kFoldRegs; ++i) {
    const int64_t b = tid + int64_t(i) * kFoldThreads;
    bmax[i] = 0;
    if (b < nb) load_block(b, v[i], bmax[i]);
  }
  float aamax = act_amax;
  if (!act_static) {
    uint32_t m[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kFoldRegs; ++i) m[0] = max(m[0], bmax[i]);
    for (int64_t b = tid + int64_t(kFoldRegs) * kFoldThreads; b < nb; b += kFoldThreads) {
      float4 t[4];
      uint32_t bm;
      load_block(b, t, bm);
      m[0] = max(m[0], bm);
    }
    cta_max(m, 1, 0);
    aamax = u2f(m[0]);
  }
  const NvGlobal ga = nv_global<false>(aamax);
  if (xcodes && tid == 0 && (!act_static || row == 0)) xamax[act_static ? 0 : row] = aamax;
  const int64_t soff = eoff ? static_cast<int64_t>(group_of_row(eoff, groups, row)) * nb : 0;
  // block b's activation codes (stored) and residual (into r, its absmax bits returned)
  auto main_and_residual = [&](int64_t b, const float4 (&x4)[4], uint32_t bm, float4 (&r)[4]) {
    if (xcodes) {
      uint32_t sf;
      const uint2 packed = nv_quant_block16(x4, bm, ga, sf);
      *reinterpret_cast<uint2*>(xcodes + (row * nb + b) * 8) = packed;
      xscales[row * nb + b] = static_cast<uint8_t>(sf);
    }
    return nv_residual16(x4, bm, ga, r);
  };
  float4 rr[kFoldRegs][4];
  uint32_t rmax[kFoldRegs];
  uint32_t m[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < kFoldRegs; ++i) {
    const int64_t b = tid + int64_t(i) * kFoldThreads;
    rmax[i] = 0;
    if (b >= nb) continue;
    rmax[i] = main_and_residual(b, v[i], bmax[i], rr[i]);
    for (int j = 0; j < nops; ++j)
      if (sel.p[j][soff + b]) m[j] = max(m[j], rmax[i]);
  }
  for (int64_t b = tid + int64_t(kFoldRegs) * kFoldThreads; b < nb; b += kFoldThreads) {
    float4 t[4], r[4];
    uint32_t bm;
    load_block(b, t, bm);
    const uint32_t rm = main_and_residual(b, t, bm, r);
    for (int j = 0; j < nops; ++j)
      if (sel.p[j][soff + b]) m[j] = max(m[j], rm);
  }
  if (!res_static) cta_max(m, nops, 1);
  for (int j = 0; j < nops; ++j) {
    const float amax_j = res_static ? res_amax : u2f(m[j]);
    const int64_t orow = static_cast<int64_t>(j) * rows + row;
    if (tid == 0) ramax[orow] = amax_j;
    const NvGlobal gr = nv_global<false>(amax_j);
    auto emit = [&](int64_t b, const float4 (&r)[4], uint32_t rm) {
      uint2 packed = make_uint2(0u, 0u);
      uint32_t sf = 0;
      if (sel.p[j][soff + b]) packed = nv_quant_block16(r, rm, gr, sf);
      *reinterpret_cast<uint2*>(rcodes + (orow * nb + b) * 8) = packed;
      rscales[orow * nb + b] = static_cast<uint8_t>(sf);
    };
#pragma unroll
    for (int i = 0; i < kFoldRegs; ++i) {
      const int64_t b = tid + int64_t(i) * kFoldThreads;
      if (b < nb) emit(b, rr[i], rmax[i]);
    }
    for (int64_t b = tid + int64_t(kFoldRegs) * kFoldThreads; b < nb; b += kFoldThreads) {
      float4 t[4], r[4];
      uint32_t bm;
      load_block(b, t, bm);
      emit(b, r, nv_residual16(t, bm, ga, r));
    }
  }
}

}  // namespace

bool rac_quantize_supported(const QConfig& act, const QConfig& res) {
  return quantize_swiglu_supported(act) && quantize_swiglu_supported(res);
}

void rac_quantize(const float* x, int64_t cols, const QConfig& act, const int32_t* blocks, int64_t nb,
                  int64_t nsel_dense, const int32_t* nsel_dev, const int32_t* eoff, int groups, DeviceQTensor& q,
                  cudaStream_t s) {
  check_shape(q, "cuda::rac_quantize");
  QUADS_CHECK(rac_quantize_supported(act, q.cfg) && q.layout == ScaleLayout::RowMajor,
              "cuda::rac_quantize: NVFP4 E2M1 1x16 with a per-row or static amax (both the activation's {} and "
              "the residual's {}) and row-major scales only", act.describe(), q.cfg.describe());
  QUADS_CHECK(q.cols == nb * 16 && cols % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0,
              "cuda::rac_quantize: the residual has {} columns for {} blocks; x ({} columns) must be 16-byte "
              "aligned with whole blocks", q.cols, nb, cols);
  QUADS_CHECK(!eoff || (nsel_dev && groups > 0), "cuda::rac_quantize: a grouped call needs nsel per group");
  if (q.rows == 0 || nb == 0) return;
  launch_pdl(rac_quantize_kernel, static_cast<unsigned>((q.rows + 3) / 4), 128, 0, s, x, q.rows, cols,
             act.global == Global::Static ? 1 : 0, act.static_amax, blocks, nb, nsel_dense, nsel_dev, eoff, groups,
             q.cfg.global == Global::Static ? 1 : 0, q.cfg.static_amax, q.codes.data(), q.scales.data(), q.amax.data());
  QUADS_CUDA_LAUNCH_CHECK();
}

void rac_quantize_fold(const RacFoldSource& src, int64_t rows, int64_t cols, const QConfig& act, DeviceQTensor* xq,
                       int nops, const uint8_t* const* sel, const int32_t* eoff, int groups, const QConfig& res,
                       uint8_t* rcodes, uint8_t* rscales, float* ramax, cudaStream_t s) {
  QUADS_CHECK(rac_quantize_supported(act, res),
              "cuda::rac_quantize_fold: NVFP4 E2M1 1x16 with a per-row or static amax (both the activation's {} and "
              "the residual's {})", act.describe(), res.describe());
  QUADS_CHECK(nops >= 1 && nops <= 3 && sel, "cuda::rac_quantize_fold: {} residual operands (1..3, each with a selection)",
              nops);
  QUADS_CHECK(cols % 16 == 0 && src.ld % 4 == 0 && src.ld >= cols && reinterpret_cast<uintptr_t>(src.x) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(src.u) % 16 == 0,
              "cuda::rac_quantize_fold: cols = {} must be a multiple of 16 and ld = {} of 4 (ld >= cols), x and u 16-byte "
              "aligned", cols, src.ld);
  QUADS_CHECK(!src.map || src.map_div >= 1, "cuda::rac_quantize_fold: the row map's divisor must be >= 1");
  QUADS_CHECK(!eoff || groups > 0, "cuda::rac_quantize_fold: a grouped call needs its group count");
  if (xq) {
    check_shape(*xq, "cuda::rac_quantize_fold");
    QUADS_CHECK(xq->rows == rows && xq->cols == cols && xq->cfg.describe() == act.describe() && xq->layout == ScaleLayout::RowMajor,
                "cuda::rac_quantize_fold: the activation's codes must be [{}, {}] in {} with row-major scales", rows,
                cols, act.describe());
  }
  if (rows == 0 || cols == 0) return;
  FoldSel fs{};
  for (int j = 0; j < nops; ++j) {
    QUADS_CHECK(sel[j], "cuda::rac_quantize_fold: residual operand {} has no selection", j);
    fs.p[j] = sel[j];
  }
  QUADS_CHECK(rows <= INT32_MAX, "cuda::rac_quantize_fold: {} rows are too many (a CTA a row)", rows);
  launch_pdl(rac_fold_kernel, static_cast<unsigned>(rows), kFoldThreads, 0, s, src.x, src.u, src.ld, src.map,
             src.map_div, rows, cols, act.global == Global::Static ? 1 : 0, act.static_amax,
             xq ? xq->codes.data() : nullptr, xq ? xq->scales.data() : nullptr, xq ? xq->amax.data() : nullptr, fs,
             nops, eoff, groups, res.global == Global::Static ? 1 : 0, res.static_amax, rcodes, rscales, ramax);
  QUADS_CUDA_LAUNCH_CHECK();
}

bool quantize_swiglu_supported(const QConfig& c) {
  return c.scheme == Scheme::NVFP4 && c.element == Format::E2M1 && c.block == Block::B1x16 &&
         (c.global == Global::PerRow || c.global == Global::Static) && !c.stochastic;
}

void quantize_swiglu(const float* g, const float* u, int64_t ld, DeviceQTensor& q, cudaStream_t s,
                     const int32_t* row_lo, const int32_t* row_hi) {
  check_shape(q, "cuda::quantize_swiglu");
  QUADS_CHECK(quantize_swiglu_supported(q.cfg) && q.layout == ScaleLayout::RowMajor,
              "cuda::quantize_swiglu: NVFP4 E2M1 1x16 with a per-row or static amax and row-major scales only, not {}",
              q.cfg.describe());
  QUADS_CHECK(ld >= q.cols && ld % 4 == 0 && reinterpret_cast<uintptr_t>(g) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(u) % 16 == 0,
              "cuda::quantize_swiglu: sources must be 16-byte aligned with a row stride >= {} and a multiple of 4 (got {})",
              q.cols, ld);
  if (q.rows == 0 || q.cols == 0) return;
  RowArgs<float> a{};
  a.x = g;
  a.u = u;
  a.ld = ld;
  a.rows = q.rows;
  a.cols = q.cols;
  a.codes = q.codes.data();
  a.scales = q.scales.data();
  a.amax = q.amax.data();
  a.static_amax = q.cfg.static_amax;
  a.amax_mode = q.cfg.global == Global::Static ? kAmaxStatic : kAmaxRowCompute;
  QUADS_CHECK((row_lo == nullptr) == (row_hi == nullptr), "cuda::quantize_swiglu: a row window needs both ends");
  a.row_lo = row_lo;
  a.row_hi = row_hi;
  launch_row<float, false, kNvE2M1, true>(a, s);
}
void quantize_bf16(const uint16_t* x, DeviceQTensor& q, cudaStream_t s) { quantize_any(x, q, s); }

bool weight_operands_supported(const QConfig& c) {
  return c.scheme == Scheme::NVFP4 && c.element == Format::E2M1 && c.block == Block::B1x16 &&
         c.global == Global::PerTensor && !c.stochastic;
}

WeightOperandSet::WeightOperandSet(const std::vector<WeightOperand>& list, const QConfig& cfg) {
  QUADS_CHECK(weight_operands_supported(cfg),
              "cuda::WeightOperandSet: NVFP4 E2M1 1x16 with a per-tensor amax and no stochastic rounding only, not {}",
              cfg.describe());
  std::vector<WDesc> desc;
  std::vector<int32_t> cta;
  QUADS_CHECK(list.size() < (size_t(1) << 31), "cuda::WeightOperandSet: {} tensors", list.size());
  for (size_t t = 0; t < list.size(); ++t) {
    const WeightOperand& w = list[t];
    QUADS_CHECK(w.rows > 0 && w.cols > 0 && w.cols % 16 == 0 && reinterpret_cast<uintptr_t>(w.src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(w.out) % 16 == 0 && w.alpha != nullptr,
                "cuda::WeightOperandSet: tensor {} ([{}, {}]) needs cols % 16 == 0, 16-byte aligned source and "
                "output, and an alpha",
                t, w.rows, w.cols);
    const int64_t n = w.rows * w.cols, chunks = (n + kWopChunk - 1) / kWopChunk;
    desc.push_back({w.src, w.out, w.alpha, n, static_cast<int64_t>(cta.size())});
    cta.insert(cta.end(), static_cast<size_t>(chunks), static_cast<int32_t>(t));
  }
  QUADS_CHECK(cta.size() < (size_t(1) << 31), "cuda::WeightOperandSet: {} CTAs", cta.size());
  desc_.upload(reinterpret_cast<const uint8_t*>(desc.data()), desc.size() * sizeof(WDesc));
  cta_.upload(cta);
  amax_.resize(list.size());
  count_ = static_cast<int64_t>(list.size());
  ctas_ = static_cast<int64_t>(cta.size());
}

void WeightOperandSet::run(cudaStream_t s, bool amax_ready) {
  if (count_ == 0) return;
  const WDesc* d = reinterpret_cast<const WDesc*>(desc_.data());
  if (!amax_ready) {
    QUADS_CUDA_CHECK(cudaMemsetAsync(amax_.data(), 0, amax_.bytes(), s));
    launch_pdl(wop_amax_kernel, static_cast<unsigned>(ctas_), kWopThreads, 0, s, d, cta_.data(),
               reinterpret_cast<uint32_t*>(amax_.data()));
  }
  launch_pdl(wop_operand_kernel, static_cast<unsigned>(ctas_), kWopThreads, 0, s, d, cta_.data(),
             static_cast<const float*>(amax_.data()));
}
void dequantize(const DeviceQTensor& q, float* out, cudaStream_t s) { dequantize_any(q, out, s); }
void dequantize_bf16(const DeviceQTensor& q, uint16_t* out, cudaStream_t s) { dequantize_any(q, out, s); }

void fake_quantize(const float* x, float* out, int64_t rows, int64_t cols, const QConfig& cfg, cudaStream_t s,
                   float* amax) {
  fake_quantize_any(x, out, rows, cols, cfg, s, amax);
}
void fake_quantize_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t cols, const QConfig& cfg,
                        cudaStream_t s, float* amax) {
  fake_quantize_any(x, out, rows, cols, cfg, s, amax);
}

void absmax(const float* x, int64_t n, float* amax, cudaStream_t s) { launch_absmax(x, n, amax, s); }

num::QTensor to_host(const DeviceQTensor& q) {
  num::QTensor h;
  h.cfg = q.cfg;
  h.rows = q.rows;
  h.cols = q.cols;
  h.codes = q.codes.download();
  h.fscales = q.fscales.download();
  h.amax = q.amax.download();
  if (q.layout == ScaleLayout::Swizzled128x4) {
    const std::vector<uint8_t> sw = q.scales.download();
    h.scales = num::unswizzle_scales_128x4(sw.data(), q.rows, q.nblocks());
  } else {
    h.scales = q.scales.download();
  }
  return h;
}

DeviceQTensor to_device(const num::QTensor& h, ScaleLayout layout) {
  DeviceQTensor q = make_qtensor(h.rows, h.cols, h.cfg, layout);
  QUADS_CHECK(h.codes.size() == q.codes.size() && h.fscales.size() == q.fscales.size() &&
                  h.amax.size() == q.amax.size() && h.scales.size() == static_cast<size_t>(h.rows * q.nblocks()),
              "cuda::to_device: QTensor [{}, {}] ({}) has inconsistent buffer sizes", h.rows, h.cols, h.cfg.describe());
  q.codes.upload(h.codes);
  q.fscales.upload(h.fscales);
  q.amax.upload(h.amax);
  if (q.layout == ScaleLayout::Swizzled128x4) q.scales.upload(num::swizzle_scales_128x4(h.scales.data(), h.rows, q.nblocks()));
  else q.scales.upload(h.scales);
  return q;
}

void swizzle_scales(const uint8_t* in, uint8_t* out, int64_t rows, int64_t nblocks, cudaStream_t s) {
  const int64_t kt = kt_of(nblocks), total = (rows + 127) / 128 * 128 * kt * 4;
  if (total == 0) return;
  launch_pdl(swizzle_kernel, grid_for(total, 256), 256, 0, s, in, out, rows, nblocks, kt, total, true);
}
void unswizzle_scales(const uint8_t* in, uint8_t* out, int64_t rows, int64_t nblocks, cudaStream_t s) {
  const int64_t kt = kt_of(nblocks), total = rows * nblocks;
  if (total == 0) return;
  launch_pdl(swizzle_kernel, grid_for(total, 256), 256, 0, s, in, out, rows, nblocks, kt, total, false);
}

}  // namespace quads::cuda
