#pragma once
// The skinny W4A4 tiles (decode batches) and the per-kernel launch check of the mma.sync tiles. Included by w4a4_gemm.cu; internal linkage, as w4a4_gemv.cuh.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/mma_util.cuh"
#include "cuda/w4a4_gemv.cuh"  // Params, sm_count, quant_row.cuh
#include "cuda/w4a4_tile.cuh"  // the FP16 dequantization

namespace quads::cuda {

namespace {

// Once per kernel: the code the driver picked for this GPU must be sm_80 or newer (else the
// kernel is a trap), and the kernel may use smem_max bytes of dynamic shared memory.
template <auto Kern>
void prepare_mma_kernel(int64_t smem_max) {
  static bool checked = false;
  if (checked) return;
  cudaFuncAttributes fa{};
  QUADS_CUDA_CHECK(cudaFuncGetAttributes(&fa, Kern));
  QUADS_CHECK(fa.binaryVersion >= 80 && fa.ptxVersion >= 80,
              "w4a4_gemm: quads_cuda holds code for sm_{} only; the W4A4 kernels need sm_80 or newer "
              "(configure with -DCMAKE_CUDA_ARCHITECTURES=90)", fa.ptxVersion);
  QUADS_CUDA_CHECK(cudaFuncSetAttribute(Kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_max)));
  checked = true;
}

// ---- Skinny tiles (decode batches: a few rows per weight, many weight rows) ----
// The 16-row tiles put X's few rows in the MMA's 16-row A operand (mostly padding) and dequantize
// both operands between shared-memory loads and MMAs, behind a barrier per stage. Here the weight
// is the A operand (16 weight rows a warp) and X the B operand (8 rows of X an n-tile), so an
// m16n8k16 uses all 16 rows of its weight fragment however few rows X has, and a weight is
// dequantized once for up to 8 * NT rows of X. A lane loads its two 16-byte pieces of codes (rows g
// and g + 8 of the warp's 16, blocks 2t and 2t + 1 of a 128-wide stage: the tile kernels' K-slot
// order) straight into registers, kSkinnyPF stages ahead: no shared memory and no barrier in the K
// loop. X's rows (8 * NT at a time) are copied into shared memory at once (cp.async) and
// dequantized there once per CTA, in fragment order (one 16-byte read a lane per stage, word and
// n-tile). The 8 warps of a CTA take 8 / ks row tiles, ks warps splitting each tile's stages;
// their sums are added in warp order through shared memory. The products are the tile kernels'
// (the same FP16 operands in the same K slots); with ks = 1 the sums are M16's too (same bits).
// A ring of two stages a lane, a slot reloaded once its stage is decoded (see the K loop): 3 or 4
// stages spill under the launch bounds below.
// Dense calls of more than 16 rows split X's rows over the grid's rows of CTAs (16 a CTA: see
// skinny_row_split). Dense calls of 9 .. 64 rows also split K over the CL CTAs of a thread-block
// cluster (Hopper): a CTA stages and dequantizes X only over its own K range, so 128 weight
// rows a CTA still make enough CTAs, and the CTAs of rank 1 .. CL - 1 hand
// their sums to rank 0 through distributed shared memory, added in rank order (no workspace, no
// second kernel, the same bits every run).
// QUADS_SKINNY_TRACE (a build flag for `bench_cuda --skinny-trace` only): thread 0 of each CTA
// writes when it reached each phase of the kernel (kSkinnyTraceSlots a CTA: the global timer at
// entry, after the PDL wait and at the end; SM cycles at entry, after the wait, after X's copy,
// after X's dequantization, the last warp's end of the K loop, after the sums, at the end; its SM).
// Without the flag the stamps compile to nothing.
constexpr int kSkinnyTraceSlots = 12;
// Timing experiments (bench builds only; wrong results): the dense tiles skip X's copy and
// dequantization (QUADS_EXPERIMENT_NOX) or the sums across warps and CTAs (QUADS_EXPERIMENT_NOSUM;
// =2: both).
#if defined(QUADS_EXPERIMENT_NOX) || QUADS_EXPERIMENT_NOSUM + 0 == 2
constexpr bool kExpNoX = true;
#else
constexpr bool kExpNoX = false;
#endif
// QUADS_EXPERIMENT_NOXG: the grouped tiles skip X's copy and dequantization, their X zeros (an
// upper bound on what X's fragments from its producer could save there; the experts' outputs are
// zero, the routing still follows the attention's output).
#ifdef QUADS_EXPERIMENT_NOXG
constexpr bool kExpNoXG = true;
#else
constexpr bool kExpNoXG = false;
#endif
#ifdef QUADS_EXPERIMENT_NOSUM
constexpr bool kExpNoSum = true;
#else
constexpr bool kExpNoSum = false;
#endif
#ifdef QUADS_SKINNY_TRACE
__device__ unsigned long long* g_skinny_trace = nullptr;
__device__ __forceinline__ unsigned long long* skinny_trace_cta() {
  if (g_skinny_trace == nullptr) return nullptr;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return g_skinny_trace + static_cast<size_t>(cta) * kSkinnyTraceSlots;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// (the value is read before the buffer's pointer: that load's latency is not in the stamp)
#define SKINNY_STAMP(slot, value)                                             \
  do {                                                                        \
    if (threadIdx.x == 0) {                                                   \
      const unsigned long long v_ = (value);                                  \
      if (unsigned long long* tr_ = skinny_trace_cta()) tr_[slot] = v_;       \
    }                                                                         \
  } while (0)
#define SKINNY_STAMP_WARPS_MAX(slot)                                          \
  do {                                                                        \
    if ((threadIdx.x & 31) == 0) {                                            \
      const unsigned long long v_ = clock64();                                \
      if (unsigned long long* tr_ = skinny_trace_cta()) atomicMax(tr_ + (slot), v_); \
    }                                                                         \
  } while (0)
#else
#define SKINNY_STAMP(slot, value) \
  do {                            \
  } while (0)
#define SKINNY_STAMP_WARPS_MAX(slot) \
  do {                               \
  } while (0)
#endif

constexpr int kSkinnyWarps = 8, kSkinnyPF = 2;
// Shared memory of `stages` 128-wide stages of 8 * nt rows: X's fragments (or, after the K loop,
// the warps' sums: at least warps * nt * 512 bytes), then the rows' raw codes and scales.
__host__ __device__ constexpr int64_t skinny_frag_bytes(int nt, int64_t stages, int warps = kSkinnyWarps) {
  return (4 * stages > warps ? 4 * stages : warps) * nt * 32 * 16;
}
__host__ __device__ constexpr int64_t skinny_smem_stages(int nt, int64_t stages, int warps = kSkinnyWarps) {
  return skinny_frag_bytes(nt, stages, warps) + 8 * nt * stages * (64 + 8);
}
__host__ __device__ constexpr int64_t skinny_smem(int nt, int64_t k) { return skinny_smem_stages(nt, (k + 127) / 128); }

// 8 rows of X at a time fit 80 registers without spills (3 CTAs an SM); 16 rows take ~110 (2 CTAs:
// capped at 80 they spill, and ran 7% slower at routed batch 64).
// cper: stages a CTA of the cluster takes (CL = 1: all).
// RES (RAC folded): the CTA's residual operand (one per CTA: skinny_plan splits K over enough
// warps that a CTA's rows never straddle a split) is staged as NT more n-tiles after X's, for the same rows, and its sums are added to X's in the
// epilogue with their own global factor. NA: the n-tiles staged.
// WARPS: warps a CTA (kSkinnyWarps, or 16 for the grouped RES tiles of 16 rows: see skinny_plan).
template <int NT, bool GROUPED, int CL, bool RES = false, int WARPS = kSkinnyWarps>
__global__ void __launch_bounds__(32 * WARPS, WARPS > kSkinnyWarps ? 1 : (RES ? 2 * NT : NT) == 1 ? 3 : 2)
    w4a4_skinny_kernel(const Params p, int ks, int cper, int rblock) {
  static_assert(CL == 1 || !GROUPED, "the grouped skinny tiles split K over warps only");
  constexpr int NA = RES ? 2 * NT : NT;
  extern __shared__ __align__(16) uint8_t smem[];
#ifndef QUADS_MMA_SM80
  __trap();
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t K = p.K;
  SKINNY_STAMP(0, global_ns());
  SKINNY_STAMP(2, clock64());
  const int nb = static_cast<int>(K / 16), nst = static_cast<int>((K + 127) / 128);
  // this CTA's stages (rank blockIdx.z of its cluster), then its warps' share of them
  const int cz = CL > 1 ? static_cast<int>(blockIdx.z) : 0;
  const int cs_beg = min(nst, cz * cper), cs_end = min(nst, cs_beg + cper), ncs = cs_end - cs_beg;
  const int64_t kbeg = int64_t(cs_beg) * 128, kc = min(int64_t(cs_end) * 128, K) - kbeg;  // K columns staged
  // X's fragments (the sums after the K loop), then its raw codes and scales (8 NT rows)
  uint4* sx = reinterpret_cast<uint4*>(smem);
  float4* red = reinterpret_cast<float4*>(smem);  // [WARPS][NA][32]
  uint8_t* raw = smem + skinny_frag_bytes(NA, cper, WARPS);
  uint8_t* raw_s = raw + 8 * NA * cper * 64;
  const int tiles_per_cta = WARPS / ks, kidx = warp % ks;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * tiles_per_cta + warp / ks) * 16;
  const int jr = RES ? res_operand(p, static_cast<int64_t>(blockIdx.x) * tiles_per_cta * 16) : 0;
  const int per = (ncs + ks - 1) / ks, s_beg = cs_beg + min(ncs, kidx * per), s_end = min(cs_end, s_beg + per);
  // This lane's codes and scales of rows n0 + g (a) and n0 + g + 8 (b) at stage s_beg. Rows past
  // N read row N - 1 (their outputs are not stored: a row's sums never meet another row's).
  const uint8_t *pa = nullptr, *pb = nullptr, *qa = nullptr, *qb = nullptr;
  const float* wamax = p.wamax;
  auto set_weight = [&](const uint8_t* wq, const uint8_t* ws) {
    const int64_t wrow = p.Kw / 2, wsrow = p.Kw / 16;
    const int64_t na = min(n0 + g, p.N - 1), nb8 = min(n0 + g + 8, p.N - 1);
    pa = wq + na * wrow + t * 16 + s_beg * 64;
    pb = wq + nb8 * wrow + t * 16 + s_beg * 64;
    qa = ws + na * wsrow + 2 * t + s_beg * 8;
    qb = ws + nb8 * wsrow + 2 * t + s_beg * 8;
  };
  // Where K % 128 == 64 the last stage holds blocks 0..3 only: lanes t >= 2 take zeros there.
  const int s_data = (K % 128 != 0 && t >= 2 && s_end == nst) ? s_end - 1 : s_end;

  uint4 ca[kSkinnyPF], cb[kSkinnyPF];
  uint32_t sca[kSkinnyPF], scb[kSkinnyPF];
  // stage s (j stages past the stage pa points at) into ring slot i
  // full (std::true_type): every stage of the warp has all its blocks (K % 128 == 0, or the warp's
  // stages end before a half last stage), so no zero-fill path: its register zeroing was issued
  // in every K step otherwise
  auto load = [&](int s, int j, int i, auto full) {
    if (s >= s_end) return;
    if (decltype(full)::value || s < s_data) {
      ca[i] = ldg_pf<128>(pa + j * 64);
      cb[i] = ldg_pf<128>(pb + j * 64);
      sca[i] = ldg_pf_u16<128>(qa + j * 8);
      scb[i] = ldg_pf_u16<128>(qb + j * 8);
    } else {
      ca[i] = cb[i] = make_uint4(0, 0, 0, 0);
      sca[i] = scb[i] = 0;
    }
  };
  if (!GROUPED) set_weight(p.wq, p.ws);
  // A dense call whose weights the previous kernel did not write (early_w) issues its first
  // stages before waiting for that kernel (PDL), as the GEMV does: the weight stream starts under
  // the previous kernel's tail. X is read only after pdl_begin(). (The same for the grouped down
  // projection behind quantize_swiglu, its group found from L2 before the wait, measured within
  // the noise: not kept.)
  const bool early = !GROUPED && p.early_w;
  if (early) {
#pragma unroll
    for (int j = 0; j < kSkinnyPF; ++j) load(s_beg + j, j, j, std::false_type{});
  }

  pdl_begin();
  SKINNY_STAMP(1, global_ns());
  SKINNY_STAMP(3, clock64());
  SKINNY_STAMP(6, 0ull);  // the warps' atomicMax starts from 0 (after the wait: the launch before has ended)
  int64_t row0 = 0, rows = p.M;
  if (!GROUPED && rblock > 0) {  // dense, X's rows split over the grid's rows of CTAs, rblock a CTA
    row0 = static_cast<int64_t>(blockIdx.y) * rblock;
    rows = min(static_cast<int64_t>(rblock), p.M - row0);
  }
  if constexpr (GROUPED) {
    // CTA row j of the grid takes the j-th non-empty group (as the grouped GEMV)
    const int e = nth_nonempty_group(p.eoff, p.groups, blockIdx.y, lane);
    if (e < 0) return;
    row0 = p.eoff[e];
    rows = p.eoff[e + 1] - row0;
    set_weight(p.wtab[e].codes, p.wtab[e].scales);
    wamax = p.wtab[e].amax;
  }

  const float kInv = 1.f / 2688.f;
  // X as FP16 fragments from its producer (Nvfp4View::frag: chunks of 16 rows, two n-tiles each)
  const bool xf = !GROUPED && !RES && p.xfrag != nullptr;
  for (int64_t c0 = 0; c0 < rows; c0 += 8 * NT) {
    const int ntu = static_cast<int>(min(static_cast<int64_t>(NT), (rows - c0 + 7) / 8));  // n-tiles with rows
    if (c0 > 0) __syncthreads();  // the last chunk's readers are done
    // X rows c0 .. c0 + nrow (consecutive rows of X), columns kbeg .. kbeg + kc, copied raw into
    // shared memory, all at once (16-byte pieces of codes, 4-byte pieces of scales; 32-bit index
    // math: a 64-bit division costs ~100 instructions), issued before the ring's first weight
    // loads so that it does not queue behind them. (X's copy is still ~3.5 us of a grouped gate/up
    // CTA at routed batch 16 under load, eoff's lookup included: bench_cuda --skinny-trace.)
    const int nrow = static_cast<int>(min(static_cast<int64_t>(8 * ntu), rows - c0));
    const int rowb = static_cast<int>(kc / 2), rows_s = static_cast<int>(kc / 16);
    if (xf) {  // this CTA's stages of its n-tiles with rows, as they are to sit in shared memory:
      // entry ((s * 4 + hw) * NA + nt) * 32 + l is entry ((s * 4 + hw) * 2 + gt % 2) * 32 + l of the
      // producer's chunk gt / 2, gt = (row0 + c0) / 8 + nt the n-tile's 8 rows of X
      const int64_t gt0 = (row0 + c0) >> 3, cstride = static_cast<int64_t>(nst) * 256;
      const uint4* src = p.xfrag + static_cast<int64_t>(cs_beg) * 4 * 2 * 32;
      for (int i = threadIdx.x; i < ncs * 4 * NT * 32; i += blockDim.x) {
        const int l = i & 31, nt = (i >> 5) % NT, sh = (i >> 5) / NT;
        const int64_t gt = gt0 + nt;
        if (nt < ntu) cp_async16(sx + i, src + (gt >> 1) * cstride + (sh * 2 + (gt & 1)) * 32 + l, 16);
      }
      cp_async_commit();
    } else if (!(kExpNoX && !GROUPED) && !(kExpNoXG && GROUPED)) {
      const int cpr = rowb / 16;
      for (int i = threadIdx.x; i < nrow * cpr; i += blockDim.x) {
        const int r = i / cpr;
        cp_async16(raw + i * 16, p.xq + x_row(p, row0 + c0 + r) * (K / 2) + kbeg / 2 + (i - r * cpr) * 16, 16);
      }
      const int spr = rows_s / 4;
      for (int i = threadIdx.x; i < nrow * spr; i += blockDim.x) {
        const int r = i / spr;
        cp_async4(raw_s + i * 4, p.xs + x_row(p, row0 + c0 + r) * (K / 16) + kbeg / 16 + (i - r * spr) * 4, 4);
      }
      if constexpr (RES) {  // the residual's rows at raw rows 8 NT ..
        const int64_t rbase = static_cast<int64_t>(jr) * p.rrows + row0 + c0;
        for (int i = threadIdx.x; i < nrow * cpr; i += blockDim.x) {
          const int r = i / cpr;
          cp_async16(raw + (8 * NT * cpr + i) * 16, p.rq + (rbase + r) * (K / 2) + kbeg / 2 + (i - r * cpr) * 16, 16);
        }
        for (int i = threadIdx.x; i < nrow * spr; i += blockDim.x) {
          const int r = i / spr;
          cp_async4(raw_s + (8 * NT * spr + i) * 4, p.rs + (rbase + r) * (K / 16) + kbeg / 16 + (i - r * spr) * 4, 4);
        }
      }
      cp_async_commit();
    }
    {
      if (!early || c0 > 0) {
#pragma unroll
        for (int j = 0; j < kSkinnyPF; ++j) load(s_beg + j, j, j, std::false_type{});
      }
      cp_async_wait<0>();
    }
    __syncthreads();
    SKINNY_STAMP(4, clock64());
    // ... then as FP16 fragments: entry ((s * 4 + hw) * NT + nt) * 32 + g * 4 + t (s counted from
    // cs_beg) holds word hw (elements 8 hw .. 8 hw + 7 of blocks 2t, 2t + 1 of stage s) of row
    // nt * 8 + g, times the block scale, as the B fragments of the word's two k-steps. A half-warp
    // takes a row (its 16 words a stage: 64 consecutive bytes of codes), stage after stage.
    if (!xf && !(kExpNoX && !GROUPED)) {
      // With 8 rows (one n-tile: the routed decode batches), two half-warps share a row, taking
      // alternate stages, so all 8 warps work instead of 4.
      // (RES: staged rows 8 NT .. 8 NT + 8 ntu are the residual's; 8 ntu .. 8 NT are skipped)
      const int wi = lane & 15, qt = wi >> 2, hw = wi & 3, hwi = warp * 2 + (lane >> 4);
      const bool two = ntu == 1 && !RES && WARPS == kSkinnyWarps;
      const int s0 = two ? hwi >> 3 : 0, sstep = two ? 2 : 1;
      for (int r = two ? hwi & 7 : hwi; r < (RES ? 8 * NT : 0) + 8 * ntu; r += 2 * WARPS) {
        if (RES && r >= 8 * ntu && r < 8 * NT) continue;
        uint4* dst = sx + (hw * NA + (r >> 3)) * 32 + (r & 7) * 4 + qt;
        const uint8_t* src = raw + r * rowb + wi * 4;
        const uint8_t* ssrc = raw_s + r * rows_s + 2 * qt + (hw >> 1);
        const bool live = (RES && r >= 8 * NT ? r - 8 * NT : r) < nrow && !(kExpNoXG && GROUPED);
        // kXU stages at a time, their shared-memory reads issued before any store (one stage at
        // a time, each waited for its read: 8.2k -> 5.6k cycles at 64 dense rows, 3.8k -> 3.3k
        // in a grouped gate/up CTA at routed batch 16; bench_cuda --skinny-trace, H200)
        constexpr int kXU = 4;
        for (int sb = s0; sb < ncs; sb += kXU * sstep) {
          uint32_t w[kXU], sc[kXU];
          bool ok[kXU];
#pragma unroll
          for (int u = 0; u < kXU; ++u) {
            const int s = sb + u * sstep;
            ok[u] = live && s < ncs && (cs_beg + s) * 8 + 2 * qt + (hw >> 1) < nb;
            w[u] = ok[u] ? *reinterpret_cast<const uint32_t*>(src + s * 64) : 0u;
            sc[u] = ok[u] ? ssrc[s * 8] : 0u;
          }
#pragma unroll
          for (int u = 0; u < kXU; ++u) {
            const int s = sb + u * sstep;
            if (s >= ncs) break;
            const uint32_t f = lo2(scales_f16x2(sc[u]));
            dst[s * 4 * NA * 32] = ok[u] ? make_uint4(deq<0>(w[u], f), deq<4>(w[u], f), deq<8>(w[u], f), deq<12>(w[u], f))
                                         : make_uint4(0, 0, 0, 0);
          }
        }
      }
    }
    __syncthreads();
    SKINNY_STAMP(5, clock64());

    float acc[NA][4];
#pragma unroll
    for (int nt = 0; nt < NA; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.f;
    // the K loop for NTU n-tiles with rows (a compile-time count: no branch per MMA)
    auto k_loop = [&](auto ntu_c, auto full) {
      constexpr int NTU = decltype(ntu_c)::value;
#pragma unroll 1
      for (int s0 = s_beg; s0 < s_end; s0 += kSkinnyPF) {
#pragma unroll
        for (int j = 0; j < kSkinnyPF; ++j) {
          const int s = s0 + j;
          if (s >= s_end) break;  // uniform
          const uint4 A = ca[j], B = cb[j];
          const uint32_t fa = scales_f16x2(sca[j]), fb = scales_f16x2(scb[j]);
          const uint4* xs_s = sx + (s - cs_beg) * 4 * NA * 32 + lane;
          const uint32_t wa[4] = {A.x, A.y, A.z, A.w}, wb[4] = {B.x, B.y, B.z, B.w};
#pragma unroll
          for (int hw = 0; hw < 4; ++hw) {
            const uint32_t sa = hw >> 1 ? hi2(fa) : lo2(fa), sb = hw >> 1 ? hi2(fb) : lo2(fb);
            const uint32_t a0[4] = {deq<0>(wa[hw], sa), deq<0>(wb[hw], sb), deq<4>(wa[hw], sa), deq<4>(wb[hw], sb)};
            const uint32_t a1[4] = {deq<8>(wa[hw], sa), deq<8>(wb[hw], sb), deq<12>(wa[hw], sa), deq<12>(wb[hw], sb)};
#pragma unroll
            for (int nt = 0; nt < NTU; ++nt) {
              const uint4 xf = xs_s[(hw * NA + nt) * 32];
              mma16816(acc[nt], a0, xf.x, xf.y);
              mma16816(acc[nt], a1, xf.z, xf.w);
            }
            if constexpr (RES) {
#pragma unroll
              for (int nt = 0; nt < NTU; ++nt) {
                const uint4 xf = xs_s[(hw * NA + NT + nt) * 32];
                mma16816(acc[NT + nt], a0, xf.x, xf.y);
                mma16816(acc[NT + nt], a1, xf.z, xf.w);
              }
            }
          }
          // The slot's next stage is loaded once this stage's codes are decoded: loaded first, into
          // fresh registers, ptxas copied the whole ring back at the loop's back edge (IMAD.MOV).
          // With the zero-fill path out of FULL loops: IMAD.MOV 88 -> 74 in the grouped gate/up
          // kernel, decode tok/s at batch 16 / 64 +1.2% / +1.4% (scripts/gpu/variants.sh, H200).
          load(s + kSkinnyPF, j + kSkinnyPF, j, full);
        }
        pa += kSkinnyPF * 64;
        pb += kSkinnyPF * 64;
        qa += kSkinnyPF * 8;
        qb += kSkinnyPF * 8;
      }
    };
    // the n-tiles with rows rounded up to NT or NT / 2 (padding n-tiles hold zeros)
    if (K % 128 == 0 || s_end < nst) {  // warp-uniform (s_data is not: lanes t >= 2 stop early)
      if (ntu > NT / 2 || NT == 1) k_loop(std::integral_constant<int, NT>{}, std::true_type{});
      else k_loop(std::integral_constant<int, (NT > 1 ? NT / 2 : 1)>{}, std::true_type{});
    } else {
      if (ntu > NT / 2 || NT == 1) k_loop(std::integral_constant<int, NT>{}, std::false_type{});
      else k_loop(std::integral_constant<int, (NT > 1 ? NT / 2 : 1)>{}, std::false_type{});
    }
    SKINNY_STAMP_WARPS_MAX(6);
    {  // back to stage s_beg for the next chunk (the K loop advanced kSkinnyPF stages a pass)
      const int back = (s_end - s_beg + kSkinnyPF - 1) / kSkinnyPF * kSkinnyPF;
      pa -= back * 64, pb -= back * 64, qa -= back * 8, qb -= back * 8;
    }

    // a warp's tile sums into red[warp] (this CTA's, or another rank's `from`), and back
    auto publish = [&] {
#pragma unroll
      for (int nt = 0; nt < NA; ++nt)
        red[(warp * NA + nt) * 32 + lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    };
    auto add_sums = [&](const float4* from, int w) {
#pragma unroll
      for (int nt = 0; nt < NA; ++nt) {
        const float4 v = from[(w * NA + nt) * 32 + lane];
        acc[nt][0] += v.x;
        acc[nt][1] += v.y;
        acc[nt][2] += v.z;
        acc[nt][3] += v.w;
      }
    };
    const bool sums = !(kExpNoSum && !GROUPED);
    if (sums && (ks > 1 || CL > 1)) __syncthreads();  // X's fragments are read: the space takes the sums
    if (sums && ks > 1) {  // the tile's other warps hand their sums to its first, added in warp order
      if (kidx > 0) publish();
      __syncthreads();
      if (kidx == 0)
        for (int w = warp + 1; w < warp + ks; ++w) add_sums(red, w);
    }
    if constexpr (CL > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (sums) {
      // ranks 1 .. CL - 1 publish their tile sums, rank 0 adds them in rank order
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      if (ks > 1) __syncthreads();  // the warp sums above are read
      if (kidx == 0 && cz > 0) publish();
      cluster.sync();
      if (kidx == 0 && cz == 0)
        for (int r = 1; r < CL; ++r) add_sums(cluster.map_shared_rank(red, r), warp);
      cluster.sync();  // rank 0 has read every rank's sums
      }
#else
      __trap();
#endif
    }
    SKINNY_STAMP(7, clock64());
    if (kidx > 0 || cz > 0) continue;
    // outputs (n0 + g, n0 + g + 8) x (rows c0 + 8 nt + 2 t, + 1): acc * (X's and W's global factors)
    const int64_t na = n0 + g, nb8 = n0 + g + 8;
    const float wfa = na < p.N ? wamax[p.wamax_row ? na : 0] * kInv : 0.f;
    const float wfb = nb8 < p.N ? wamax[p.wamax_row ? nb8 : 0] * kInv : 0.f;
    // X's row factors all read before the first store (y may alias xamax for the compiler: read
    // between the stores, no load could be issued before the store ahead of it, and the loads'
    // latencies added up)
    float rfs[NT][2], rrs[RES ? NT : 1][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t r = c0 + nt * 8 + 2 * t + j;
        const bool in = nt < ntu && r < rows;
        rfs[nt][j] = in ? p.xamax[p.xamax_row ? x_row(p, row0 + r) : 0] * kInv * 16384.f : 0.f;
        if constexpr (RES) rrs[nt][j] = in ? p.ramax[static_cast<int64_t>(jr) * p.rrows + row0 + r] * kInv * 16384.f : 0.f;
      }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt >= ntu) break;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t r = c0 + nt * 8 + 2 * t + j;
        if (r >= rows) continue;
        const int64_t row = row0 + r;
        const float rf = rfs[nt][j];
        float* dst = p.y + row * p.ldy + na;
        if (na < p.N) {
          const float out = acc[nt][j] * rf * wfa;
          float o = p.accumulate ? dst[0] + out : out;
          if constexpr (RES) o += acc[NT + nt][j] * rrs[nt][j] * wfa;
          dst[0] = o;
        }
        if (nb8 < p.N) {
          const float out = acc[nt][2 + j] * rf * wfb;
          float o = p.accumulate ? dst[8] + out : out;
          if constexpr (RES) o += acc[NT + nt][2 + j] * rrs[nt][j] * wfb;
          dst[8] = o;
        }
      }
    }
  }
  SKINNY_STAMP(8, clock64());
  SKINNY_STAMP(9, global_ns());
#ifdef QUADS_SKINNY_TRACE
  unsigned smid_;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid_));
  SKINNY_STAMP(10, smid_ + 1ull);
#endif
}

// The skinny tiles' shared memory is X's rows dequantized (4 KB a 128-wide stage for 16 rows) and
// raw: 82 KB for K 2048 and 16 rows, up to 164 KB (K 4096, 16 rows; longer K takes 8 rows at a time).
constexpr int64_t kSkinnySmemMax = 164 * 1024;
// Warps sharing a row tile's K: more while the row tiles leave SMs short of about 3 CTAs of 8
// warps, as long as every warp keeps at least 2 stages.
int skinny_ks(int64_t row_tiles, int64_t k) {
  const int64_t nst = (k + 127) / 128;
  int ks = 1;
  while (ks < kSkinnyWarps && row_tiles * ks < 3LL * kSkinnyWarps * sm_count() && nst >= 4LL * ks) ks *= 2;
  return ks;
}
// Thread-block clusters need sm_90 code on a device of compute capability 9.0 or newer.
bool skinny_cluster_ok() {
  static const bool ok = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major < 9) return false;
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, w4a4_skinny_kernel<2, false, 2>) != cudaSuccess) return false;
    return fa.binaryVersion >= 90;
  }();
  return ok;
}

// Dense calls of more than 16 rows: X's rows split over the grid's rows of CTAs, 16 a CTA (2
// n-tiles). Each row block reads the weights (the later reads hit L2 where the blocks run
// together). 64 rows a CTA took 128 registers and spilled, one CTA an SM; 32 a CTA (4 n-tiles) was
// the default until X came as FP16 fragments for up to 64 rows (Part 28): with no X to dequantize a
// CTA, more CTAs of fewer rows win. H200, nvfp4 decode tok/s, two rounds in one call (ab.sh,
// docs/cuda.md Part 29), 32 -> 16 rows a CTA: batch 32 25306 / 25416 -> 26714 / 26687, 48 34566 /
// 34791 -> 36803 / 36802, 64 43160 / 43384 -> 43707 / 43676 (64 rows a CTA at 32 / 48 / 64: 25326
// / 32193 / 40123).
// QUADS_SKINNY_ROWSPLIT=0: 64 rows a CTA; =32: 32 rows a CTA.
int skinny_row_split() {
  static const int rows = [] {
    const char* e = std::getenv("QUADS_SKINNY_ROWSPLIT");
    if (e == nullptr) return 16;
    const int v = std::atoi(e);
    return v == 0 ? 0 : v <= 16 ? 16 : 32;
  }();
  return rows;
}
// Which grouped tiles of 16 rows take CTAs of 16 warps (QUADS_SKINNY_G16: 0 none, 1 the RES tiles, 2 all).
int skinny_g16() {
  static const int w = [] {
    const char* e = std::getenv("QUADS_SKINNY_G16");
    return e != nullptr ? std::atoi(e) : 1;
  }();
  return w;
}
struct SkinnyPlan {
  int nt = 1, ks = 1, cl = 1, cper = 1, rsplit = 1, rblock = 0, warps = kSkinnyWarps;  // rblock: rows of X a CTA row (rsplit > 1)
  int64_t smem = 0;
};
// rows: rows of X per weight (dense: M; grouped: the bound on a group's rows); active: weights
// with rows (dense 1; grouped min(groups, rows of X)); splits: warps per row tile, kcluster: CTAs
// of a cluster splitting K (dense only); 0: choose.
// res: a folded RAC call (each n-tile of X staged twice; dense calls take 16 rows of X a CTA, so
// that X's and the residual's sums fit the registers 32 rows take).
SkinnyPlan skinny_plan(const Params& p, bool grouped, int64_t rows, int64_t active, int splits, int kcluster,
                       int row_block, bool res = false) {
  SkinnyPlan pl;
  const int mult = res ? 2 : 1;
  if (res && !grouped && rows > 16 && row_block == 0) row_block = 16;
  // res: a CTA's weight rows (16 * warps / ks) must not straddle a residual operand's split
  auto fits = [&](int ks, int warps) {
    const int64_t rpc = 16LL * (warps / ks);
    return (p.rsplit0 == INT64_MAX || p.rsplit0 % rpc == 0) && (p.rsplit1 == INT64_MAX || p.rsplit1 % rpc == 0);
  };
  auto align_ks = [&] {
    while (res && pl.ks < kSkinnyWarps && !fits(pl.ks, pl.warps)) pl.ks *= 2;
  };
  const int nst = static_cast<int>((p.K + 127) / 128);
  const int64_t row_tiles = (p.N + 15) / 16;
  if (grouped || rows <= 8) {
    // 16 rows of X at a time where the grouped calls' bound says groups of more than 8 rows are
    // common (above 16, the decode batch; 8 rows at a time have more resident warps)
    pl.nt = grouped && rows > 16 && skinny_smem(2, p.K) <= kSkinnySmemMax ? 2 : 1;
    // RES at 16 rows: X's and the residual's fragments take up to 168 KB (K 2048): one CTA an SM,
    // 8 warps where plain nvfp4 has 16 (two CTAs). A CTA of 16 warps (256 weight rows) keeps 16 an
    // SM: nvfp4+rac decode at batch 64 27856 / 27801 -> 29704 / 29880 tok/s (H200, ncu: gate/up
    // 85.9 us at 12.5% occupancy before). Plain nvfp4 with 16-warp CTAs: 41484 / 41774 against
    // 42031 / 42543 with 8 (two CTAs an SM either way), so it keeps 8.
    // (16 warps need splits at multiples of 32 rows: K split over at most 8 warps; the sums take 16 KB an n-tile)
    if (grouped && pl.nt == 2 && skinny_g16() >= (res ? 1 : 2) && (!res || fits(kSkinnyWarps, 16))) pl.warps = 16;
    pl.ks = splits > 0 ? splits : skinny_ks(row_tiles * active, p.K);
    align_ks();
    pl.cl = kcluster > 0 ? kcluster : 1;
  } else {
    // Dense, more rows: 16 rows of X a CTA (more rows split over the grid's rows of CTAs, see
    // skinny_row_split; 32 or 64 a CTA where asked), a warp per row tile (X dequantized once for
    // 128 weight rows), K split over a cluster's CTAs until the grid covers the SMs (16 rows, or
    // rows split) or half of them (32 rows: each CTA has more MMAs, and a cluster's sums take
    // longer to add), at most 4 CTAs a cluster and 2 stages a CTA. H200, bench_cuda --gemv, us
    // for 1 / 2 / 4 / 8 CTAs a cluster: q/k/v (6144 x 2048) at 16 rows 13.8 / 10.1 / 9.6 / 15.0,
    // at 64 rows 32.5 / 19.5 / 21.9 / 35.4; o_proj (2048 x 4096) at 16 rows 24.1 / 14.7 / 10.0 /
    // 10.4, at 64 rows 83.6 / 34.5 / 20.4 / 24.9.
    pl.nt = rows <= 16 ? 2 : rows <= 32 ? 4 : 8;
    QUADS_CHECK(row_block == 0 || row_block == 16 || row_block == 32 || row_block == 64,
                "w4a4_gemm: the skinny tiles take 16, 32 or 64 rows of X a CTA, not {}", row_block);
    const int rs = row_block > 0 ? row_block : splits <= 0 ? skinny_row_split() : 0;
    if (rs > 0 && rows > rs) {
      pl.nt = rs / 8;
      pl.rsplit = static_cast<int>((rows + rs - 1) / rs);
      pl.rblock = rs;  // NT may still shrink below (shared memory): the kernel then takes it in chunks
    }
    pl.ks = splits > 0 ? splits : 1;
    align_ks();
    if (kcluster > 0) {
      pl.cl = kcluster;
    } else if (splits <= 0 && skinny_cluster_ok()) {
      const int64_t ctas = (p.N + 16LL * (kSkinnyWarps / pl.ks) - 1) / (16LL * (kSkinnyWarps / pl.ks)) * pl.rsplit;
      const int64_t want = rows <= 16 || pl.rsplit > 1 ? sm_count() : sm_count() / 2;
      while (pl.cl < 4 && ctas * pl.cl < want && (nst + 2 * pl.cl - 1) / (2 * pl.cl) >= 2) pl.cl *= 2;
    }
  }
  // X as FP16 fragments (Nvfp4View::frag): nothing to stage, so K splits over the CTA's warps where
  // it would split over a cluster of CTAs, which exists to stage a share of X per CTA (the same
  // stage ranges, added in the same order: the same bits). H200, bench_cuda --dense-sweep without
  // X's staging (docs/cuda.md Part 27): q/k/v at 16 rows 6.8 us (1 x 4) -> 5.2 (4 x 1).
  if (p.xfrag && !grouped && !res && pl.nt == 2 && pl.rsplit == 1 && splits <= 0 && kcluster <= 0 && pl.ks == 1 &&
      pl.cl > 1 && skinny_smem_stages(2, nst, pl.warps) <= kSkinnySmemMax) {
    pl.ks = pl.cl;
    pl.cl = 1;
  }
  QUADS_CHECK(pl.ks == 1 || pl.ks == 2 || pl.ks == 4 || pl.ks == 8,
              "w4a4_gemm: the skinny tiles split K over 1, 2, 4 or 8 warps, not {}", pl.ks);
  QUADS_CHECK(pl.cl == 1 || pl.cl == 2 || pl.cl == 4 || pl.cl == 8,
              "w4a4_gemm: the skinny tiles split K over clusters of 1, 2, 4 or 8 CTAs, not {}", pl.cl);
  QUADS_CHECK(pl.cl == 1 || (!grouped && skinny_cluster_ok()),
              "w4a4_gemm: K split over a cluster of CTAs needs dense calls, sm_90 code and a device of compute "
              "capability 9.0 or newer");
  pl.cper = (nst + pl.cl - 1) / pl.cl;
  while (pl.nt > 1 && skinny_smem_stages(pl.nt * mult, pl.cper, pl.warps) > kSkinnySmemMax) pl.nt /= 2;  // rows in more chunks
  if (pl.nt != 2) pl.warps = kSkinnyWarps;  // 16 warps only where NT 2 stays (the kernels instantiated)
  pl.smem = skinny_smem_stages(pl.nt * mult, pl.cper, pl.warps);
  QUADS_CHECK(pl.smem <= kSkinnySmemMax, "w4a4_gemm: K = {} is too long for the skinny tiles", p.K);
  return pl;
}
template <int NT, bool GROUPED, int CL, bool RES, int WARPS = kSkinnyWarps>
void launch_skinny_k(const Params& p, const SkinnyPlan& pl, dim3 grid, cudaStream_t s) {
  constexpr auto kern = w4a4_skinny_kernel<NT, GROUPED, CL, RES, WARPS>;
  prepare_mma_kernel<kern>(kSkinnySmemMax);
  grid.z = CL;
  launch_pdl_cluster(kern, grid, 32 * WARPS, static_cast<size_t>(pl.smem), s, dim3(1, 1, CL), p, pl.ks,
                     pl.cper, pl.rblock);
}
template <int NT, bool GROUPED, bool RES>
void launch_skinny_nt(const Params& p, const SkinnyPlan& pl, dim3 grid, cudaStream_t s) {
  if constexpr (GROUPED) {
    if constexpr (NT == 2) {
      if (pl.warps == 16) return launch_skinny_k<NT, true, 1, RES, 16>(p, pl, grid, s);
    }
    launch_skinny_k<NT, true, 1, RES>(p, pl, grid, s);
  } else {
    switch (pl.cl) {
      case 1: launch_skinny_k<NT, false, 1, RES>(p, pl, grid, s); break;
      case 2: launch_skinny_k<NT, false, 2, RES>(p, pl, grid, s); break;
      case 4: launch_skinny_k<NT, false, 4, RES>(p, pl, grid, s); break;
      default: launch_skinny_k<NT, false, 8, RES>(p, pl, grid, s); break;
    }
  }
}
// grid_active (grouped, >= 0): the grid's rows of CTAs where the plan is made for `active` groups
// (a window of a larger call).
template <bool GROUPED, bool RES = false>
void launch_skinny(const Params& p0, int64_t rows, int64_t active, int splits, int kcluster, cudaStream_t s,
                   int row_block = 0, int64_t grid_active = -1) {
  const SkinnyPlan pl = skinny_plan(p0, GROUPED, rows, active, splits, kcluster, row_block, RES);
  Params p = p0;
  if (GROUPED || RES || rows > kXFragMaxRows) p.xfrag = nullptr;  // the codes are staged
  const int64_t rows_per_cta = 16LL * (pl.warps / pl.ks);
  const int64_t gy = grid_active >= 0 ? grid_active : active;
  QUADS_CHECK(gy <= 65535, "w4a4_gemm: {} groups are too many for the skinny tiles", gy);
  const dim3 grid(static_cast<unsigned>((p.N + rows_per_cta - 1) / rows_per_cta),
                  static_cast<unsigned>(GROUPED ? gy : pl.rsplit));
  if constexpr (GROUPED) {
    if (pl.nt == 1) launch_skinny_nt<1, true, RES>(p, pl, grid, s);
    else launch_skinny_nt<2, true, RES>(p, pl, grid, s);
  } else if constexpr (RES) {  // 16 rows a CTA at most (skinny_plan)
    QUADS_CHECK(pl.nt <= 2, "w4a4_gemm_rac: {} n-tiles a CTA (at most 2)", pl.nt);
    if (pl.nt == 1) launch_skinny_nt<1, false, true>(p, pl, grid, s);
    else launch_skinny_nt<2, false, true>(p, pl, grid, s);
  } else {
    switch (pl.nt) {
      case 1: launch_skinny_nt<1, false, false>(p, pl, grid, s); break;
      case 2: launch_skinny_nt<2, false, false>(p, pl, grid, s); break;
      case 4: launch_skinny_nt<4, false, false>(p, pl, grid, s); break;
      default: launch_skinny_nt<8, false, false>(p, pl, grid, s); break;
    }
  }
}
}  // namespace

}  // namespace quads::cuda
