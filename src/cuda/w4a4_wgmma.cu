// The W4A4 tile for many rows (prefill, training-sized calls) on Hopper's warpgroup MMA (wgmma,
// sm_90a). The mma.sync tiles of w4a4_gemm.cu dequantize every fragment in the warp that uses it:
// one E2M1 word per MMA, a warp's four dependent steps between loads and MMAs, ~210 TFLOP/s at
// 8192 rows. Here a CTA of two warpgroups (128 rows of X, BN rows of W) dequantizes each stage's
// W codes once, into FP16 in shared memory in wgmma's K-major core-matrix layout, and each warp
// dequantizes only its own 16 rows of X into registers (wgmma's A operand); one m64n128k16 then
// does the work of 64 mma.sync, asynchronously. The arithmetic is the mma.sync tiles': FP16
// operands that are code x scale x 2^-7 exactly (w4a4_gemm.cu's header), FP32 accumulation, the
// same K-slot order for both operands, the same epilogue; only the order of the FP32 sums differs
// (wgmma's), so results agree with the other tiles to FP32 rounding, not bit for bit.
//
// A stage (128 K): cp.async brings the codes and scales (w4a4_tile.cuh, 3 stages deep); after a
// barrier every thread turns 16 bytes of W codes (a row, a quarter of the stage) into 16 FP16
// pairs in a tile (k-step ks of 8, row n: bytes ks * BN * 32 + (n / 8) * 256 + (k / 8) * 128 +
// (n % 8) * 16 + (k % 8) * 2: core matrices of 8 rows x 16 bytes, LBO 128, SBO 256) and builds its
// X fragments for the 8 k-steps; a proxy fence and a barrier; 8 (BN = 256: 16) wgmma, which stay
// in flight while the next stage is dequantized into the other tile and the other set of
// fragments (the loop runs two stages a turn, so that each set is a fixed set of registers:
// ptxas serializes the wgmma otherwise); then the wait for the stage before.
//
// Measured (H200, bench_cuda --gemm, docs/cuda.md Part 22): 8192^3 298-301 TFLOP/s against 239
// for M128 and 764-795 for cuBLAS BF16. Without the dequantization (constant operands) this loop
// reaches only ~370, without the MMAs ~400. Neither a 128-byte swizzled W tile (the same speed),
// one warpgroup a CTA with two CTAs an SM (267), nor warp specialization (two warpgroups
// dequantizing both operands into a ring of FP16 slots, two issuing only wgmma: 301) did better;
// Part 22 has the probes that say why (the dequantization's ALU work and the copy-and-barrier
// pipeline each cap it at about the same rate).
#include "cuda/w4a4_wgmma.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/pdl.cuh"
#include "cuda/w4a4_tile.cuh"  // deq, scales_f16x2, lo2, hi2, the stage copy, store_out

namespace quads::cuda {

namespace {

constexpr int kWgThreads = 256, kWgBM = 128, kWgStages = 3;

template <int BN>
struct WgSmem {
  static constexpr int TILE = 8 * BN * 32;  // W as FP16: 8 k-steps x BN rows x 16 values
  static constexpr int STAGE = Smem<kWgBM, BN, false>::STAGE;
  static constexpr int TOTAL = 2 * TILE + kWgStages * STAGE;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QUADS_WGMMA 1
#endif

// K-major, no swizzle: the k 8..15 core matrix 128 bytes after the k 0..7 one (LBO), the next 8
// rows 256 bytes on (SBO).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}

#ifdef QUADS_WGMMA
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins a register for the compiler: no copy or move of it across this point, so that the registers
// an asynchronous wgmma reads and writes stay the ones it was issued with.
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void pin(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
// st.shared by threads, then read by wgmma (the async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (m64n128's FP32 fragment: rows 16 * (warp % 4) + g (+ 8), columns 8j + 2t (+ 1)) += A x B,
// A this warp's 16 rows x 16 K as f16x2 (mma.m16n8k16's A layout), B from the descriptor.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#endif

template <int BN, bool GROUPED>
__global__ void __launch_bounds__(kWgThreads, 1) w4a4_wgmma_kernel(const Params p) {
  pdl_begin();
#ifdef QUADS_WGMMA
  constexpr int NB = BN / 128;
  using SM = Smem<kWgBM, BN, false>;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* tile = smem;  // two tiles, alternating stages
  uint8_t* stages = smem + 2 * WgSmem<BN>::TILE;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  TileCtx c;
  if (!tile_ctx<kWgBM, BN, GROUPED, false>(p, c)) return;
  auto load = [&](int slot, int64_t kb) {
    load_stage<kWgBM, BN, kWgThreads, false>(p, c, stages + slot * SM::STAGE, kb, tid);
  };

  float acc[NB][64];
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[b][i] = 0.f;

#pragma unroll
  for (int s = 0; s < kWgStages - 1; ++s) {
    if (s < c.nkb) load(s, c.kb0 + s);
    cp_async_commit();
  }
  const int arow = (warp >> 2) * 64 + (warp & 3) * 16 + g;  // this thread's X rows: arow, arow + 8

  // Stage it: its W codes -> FP16 in `tl`, its X codes -> this warp's A fragments.
  auto dequant = [&](int it, uint8_t* tl, uint32_t (&af)[8][4]) {
    const uint8_t* sa = stages + (it % kWgStages) * SM::STAGE;
    const uint8_t* sb = sa + SM::A;
    const uint8_t* sas = sb + SM::B;
    const uint8_t* sbs = sas + SM::AS;
    // W: lane (row n, quarter t) reads its row's bytes 16t .. 16t + 15 (words hw = 0..3: elements
    // 32t + 8hw ..) and writes K slots (2t, 2t+1) and (2t+8, 2t+9) of k-steps 2hw and 2hw + 1,
    // the pairs the mma.sync tiles give thread t.
#pragma unroll
    for (int pass = 0; pass < BN / 64; ++pass) {
      const int n = pass * 64 + warp * 8 + g;
      const uint4 v = *reinterpret_cast<const uint4*>(sb + n * 64 + t * 16);
      const uint32_t f = scales_f16x2(*reinterpret_cast<const uint16_t*>(sbs + n * 8 + 2 * t));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint8_t* dst = tl + (n >> 3) * 256 + (n & 7) * 16 + 4 * t;
#pragma unroll
      for (int hw = 0; hw < 4; ++hw) {
        const uint32_t sc = hw < 2 ? lo2(f) : hi2(f);
        uint8_t* d0 = dst + (2 * hw) * (BN * 32);
        uint8_t* d1 = d0 + BN * 32;
        *reinterpret_cast<uint32_t*>(d0) = deq<0>(w[hw], sc);
        *reinterpret_cast<uint32_t*>(d0 + 128) = deq<4>(w[hw], sc);
        *reinterpret_cast<uint32_t*>(d1) = deq<8>(w[hw], sc);
        *reinterpret_cast<uint32_t*>(d1 + 128) = deq<12>(w[hw], sc);
      }
    }
    const uint4 x0 = *reinterpret_cast<const uint4*>(sa + arow * 64 + t * 16);
    const uint4 x1 = *reinterpret_cast<const uint4*>(sa + (arow + 8) * 64 + t * 16);
    const uint32_t f0 = scales_f16x2(*reinterpret_cast<const uint16_t*>(sas + arow * 8 + 2 * t));
    const uint32_t f1 = scales_f16x2(*reinterpret_cast<const uint16_t*>(sas + (arow + 8) * 8 + 2 * t));
    const uint32_t w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int hw = 0; hw < 4; ++hw) {
      const uint32_t s0 = hw < 2 ? lo2(f0) : hi2(f0), s1 = hw < 2 ? lo2(f1) : hi2(f1);
      af[2 * hw][0] = deq<0>(w0[hw], s0);
      af[2 * hw][1] = deq<0>(w1[hw], s1);
      af[2 * hw][2] = deq<4>(w0[hw], s0);
      af[2 * hw][3] = deq<4>(w1[hw], s1);
      af[2 * hw + 1][0] = deq<8>(w0[hw], s0);
      af[2 * hw + 1][1] = deq<8>(w1[hw], s1);
      af[2 * hw + 1][2] = deq<12>(w0[hw], s0);
      af[2 * hw + 1][3] = deq<12>(w1[hw], s1);
    }
  };
  // Stage it end to end; its MMAs stay in flight while the next stage is dequantized (two tiles
  // and two sets of fragments, alternating).
  auto step = [&](int it, uint8_t* tl, uint32_t (&af)[8][4]) {
    cp_async_wait<kWgStages - 2>();
    __syncthreads();  // stage it is in; every warp has waited for the MMAs of it - 2 (this tile)
    {
      const int nx = it + kWgStages - 1;
      if (nx < c.nkb) load(nx % kWgStages, c.kb0 + nx);
      cp_async_commit();
    }
    dequant(it, tl, af);
    fence_proxy_async();
    __syncthreads();  // the tile is written
    const uint32_t tls = static_cast<uint32_t>(__cvta_generic_to_shared(tl));
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(acc[b][i]);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) pin(af[ks][i]);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
#pragma unroll
      for (int b = 0; b < NB; ++b) wgmma_m64n128k16(acc[b], af[ks], wg_desc(tls + ks * BN * 32 + b * 4096));
    wg_commit();
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(acc[b][i]);
    wg_wait<1>();  // the MMAs of it - 1 are done
  };
  uint32_t af0[8][4], af1[8][4];
  int it = 0;
  for (; it + 1 < c.nkb; it += 2) {
    step(it, tile, af0);
    step(it + 1, tile + WgSmem<BN>::TILE, af1);
  }
  wg_wait<0>();
  if (it < c.nkb) {  // an odd stage count's last
    step(it, tile, af0);
    wg_wait<0>();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int64_t row = c.m0 + arow + 8 * hr;
        if (row >= c.mend) continue;
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int64_t col = c.n0 + b * 128 + 8 * j + 2 * t + cc;
          if (col < p.N) store_out(p, c, row, col, acc[b][4 * j + 2 * hr + cc]);
        }
      }
#else
  __trap();
#endif
}

template <int BN, bool GROUPED>
TileKernel make_tile() {
  static const TileKernel tile = [] {
    TileKernel w;
    constexpr auto kern = w4a4_wgmma_kernel<BN, GROUPED>;
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, kern) != cudaSuccess) {
      (void)cudaGetLastError();  // no image for this device: not an error, the caller falls back
      return w;
    }
    if (fa.binaryVersion != 90) return w;
    const int smem = WgSmem<BN>::TOTAL;
    QUADS_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    w.kernel = kern;
    w.threads = kWgThreads;
    w.smem = smem;
    w.bm = kWgBM;
    w.bn = BN;
    return w;
  }();
  return tile;
}

}  // namespace

TileKernel w4a4_wgmma_tile(int bn, bool grouped) {
  QUADS_CHECK(bn == 128 || bn == 256, "w4a4_wgmma_tile: bn = {} (128 or 256)", bn);
  if (bn == 128) return grouped ? make_tile<128, true>() : make_tile<128, false>();
  return grouped ? make_tile<256, true>() : make_tile<256, false>();
}

}  // namespace quads::cuda
