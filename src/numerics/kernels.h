#pragma once
// Internal to src/numerics: fast scalar codecs and helpers shared by the quantizers. Each one is
// bit-identical to its reference codec in formats.cpp (tests/numerics/test_kernels.cpp checks
// that over every code, every midpoint and its neighbours, and millions of random floats); they
// exist because the reference codecs go through frexp/ldexp/nearbyint, which is exact but slow.
#include <bit>
#include <cfloat>
#include <cstdint>

#include "numerics/formats.h"
#include "numerics/quantize.h"

namespace quads::num::detail {

inline uint32_t f2u(float x) { return std::bit_cast<uint32_t>(x); }
inline float u2f(uint32_t u) { return std::bit_cast<float>(u); }

// |x| as bits. For non-negative floats the unsigned order of the bits is the numeric order, and
// every NaN sorts above +inf, so a max over these bits is an amax in which NaN wins: one NaN
// makes the whole amax NaN (the "poison" rule the quantizers document) and the result does not
// depend on the order of the reduction.
inline uint32_t abs_bits(float x) { return f2u(x) & 0x7FFFFFFFu; }
inline float absmax(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = abs_bits(x[i]);
    m = a > m ? a : m;
  }
  return u2f(m);
}

// A 4-bit element grid (E2M1 or E1M2): magnitudes of codes 0..7 and the 7 decision thresholds
// (midpoints). Ties go to the even code, so the threshold between codes k and k+1 is strict (>)
// when k is even and inclusive (>=) when k is odd.
struct Grid4 {
  float values[8];
  float thr[7];
  float max;
};
inline constexpr Grid4 kGridE2M1{{0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f},
                                 {.25f, .75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f}, 6.f};
inline constexpr Grid4 kGridE1M2{{0.f, .5f, 1.f, 1.5f, 2.f, 2.5f, 3.f, 3.5f},
                                 {.25f, .75f, 1.25f, 1.75f, 2.25f, 2.75f, 3.25f}, 3.5f};

// Round to nearest even, saturating; NaN gives the max code with NaN's sign bit (as the codec).
// Written as "not <=" / "not <" so that NaN passes every threshold.
inline uint8_t grid4_encode(float v, const Grid4& g) {
  const float a = u2f(abs_bits(v));
  uint32_t c = 0;
  c += !(a <= g.thr[0]);
  c += !(a < g.thr[1]);
  c += !(a <= g.thr[2]);
  c += !(a < g.thr[3]);
  c += !(a <= g.thr[4]);
  c += !(a < g.thr[5]);
  c += !(a <= g.thr[6]);
  return static_cast<uint8_t>(c | ((f2u(v) >> 28) & 8u));
}
inline float grid4_decode(uint8_t c, const Grid4& g) {
  const float v = g.values[c & 7];
  return (c & 8) ? -v : v;
}

// Counter-based random stream for stochastic rounding: a SplitMix64 finaliser applied to
// (seed, element index). A pure function of both, so results do not depend on threading.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// A uniform in [0, 1) with 24 bits: k * 2^-24, exact in float32.
inline float sr_uniform(uint64_t seed, uint64_t index) {
  const uint64_t h = mix64(mix64(seed ^ 0x5851F42D4C957F2Dull) + (index + 1) * 0x9E3779B97F4A7C15ull);
  return static_cast<float>(h >> 40) * 0x1p-24f;
}

// Stochastic rounding on a 4-bit grid: |v| between grid points lo <= |v| < hi rounds up with
// probability (|v| - lo) / (hi - lo). The subtraction is exact (Sterbenz: hi <= 2 lo for every
// neighbour pair with lo > 0) and the steps are powers of two, so p is exact; u < p with
// u = k 2^-24 gives P(up) = ceil(p 2^24) 2^-24, unbiased to 2^-24. |v| >= max saturates; NaN
// gives the max code like the nearest rounding does.
inline uint8_t grid4_encode_sr(float v, const Grid4& g, float u) {
  const float a = u2f(abs_bits(v));
  const uint32_t sign = (f2u(v) >> 28) & 8u;
  if (!(a < g.max)) return static_cast<uint8_t>(7u | sign);
  uint32_t k = 0;
  while (k < 6 && g.values[k + 1] <= a) ++k;
  const float p = (a - g.values[k]) / (g.values[k + 1] - g.values[k]);
  return static_cast<uint8_t>((k + (u < p ? 1u : 0u)) | sign);
}

// E4M3 (fn) satfinite, round to nearest even; bit-identical to e4m3_from_f32. Normal results
// round the float32 mantissa to 3 bits with an integer add (carry into the exponent is the
// right answer); below 2^-6 the grid is uniform (step 2^-9) and x * 2^9 is exact.
inline uint8_t e4m3_encode(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7F);  // NaN
  if (a >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7E);  // >= 448, inf
  if (a < 0x3C800000u) {                                            // < 2^-6
    // Values below 2^-6 scaled by 2^9 are < 8; adding 2^23 makes the FPU round to an integer
    // with ties to even, and the integer is the low mantissa bits.
    const float s = u2f(a) * 512.f + 8388608.f;
    return static_cast<uint8_t>(sign | (f2u(s) - 0x4B000000u));
  }
  const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>(sign | (r - 960u));  // rebias 127 -> 7: (127 - 7) << 3
}

// Decoding tables (filled once from the formats.h codecs, on first use).
struct Tables {
  float e4m3[256];
  float e5m2[256];
  float ue8m0[256];      // 2^(c-127), NaN for 0xFF
  float ue8m0_inv[256];  // 2^(127-c), NaN for 0xFF: x * ue8m0_inv[c] == x / ue8m0[c] exactly
  Tables();
};
const Tables& tables();

// One NVFP4 global-scale group (a tensor, a row, or a static amax), see quantize.h.
struct Nvfp4Group {
  float amax;
  float s_enc;    // S_enc with TE's clamps
  float s_dec;    // 1 / S_enc
  float s_enc_g;  // S_enc * fp32(1/G): multiplies a block amax to give its scale
  float dq;       // fp32(1 / (448 G)): dequant factor is (float(sf) * amax) * dq
  const Grid4* grid;
};
Nvfp4Group nvfp4_group(float amax, const Grid4& grid);

// Stochastic rounding of a run of elements: element i of the run has global index idx0 + i.
struct SrStream {
  bool on = false;
  uint64_t seed = 0;
  int64_t idx0 = 0;
};

// NVFP4 on nblk consecutive 1x16 blocks of x sharing one group. If sf_in is given the blocks'
// scale codes come from it (16x16 tiles) instead of each block's own amax. Writes packed codes
// (8 bytes per block) and scales when `codes` is set, dequantized values when `fake` is set
// (fake may alias x: a block is read completely before it is written).
void nvfp4_blocks_scalar(const float* x, int64_t nblk, const Nvfp4Group& g, const uint8_t* sf_in,
                         uint8_t* codes, uint8_t* scales, float* fake, const SrStream& sr);
void nvfp4_dequant_scalar(const uint8_t* codes, const uint8_t* scales, int64_t nblk,
                          const Nvfp4Group& g, float* out);

// MXFP4 scale code of a block with this amax (see quantize.h).
inline uint8_t mx_scale(float amax, MxRule rule) {
  const uint32_t bits = f2u(amax);
  if (bits >= 0x7F800000u) return 0xFF;  // NaN or inf (amax is non-negative)
  if (rule == MxRule::TeCeil) return ue8m0_from_f32(amax * (1.f / 6.f), /*round_up=*/true);
  // floor(log2 amax) + 127 is the biased exponent field (0 for zero and subnormals, whose
  // scale clamps to 2^-127 anyway); minus emax(E2M1) = 2, clamped at code 0.
  const uint32_t e = bits >> 23;
  return static_cast<uint8_t>(e >= 2 ? e - 2 : 0);
}
// MXFP4 on nblk consecutive 32-element blocks; outputs as nvfp4_blocks_scalar.
void mxfp4_blocks_scalar(const float* x, int64_t nblk, MxRule rule, uint8_t* codes, uint8_t* scales,
                         float* fake, const SrStream& sr);
// FP8 on a run of n elements sharing the scale s: codes and/or dequantized values.
void fp8_run_scalar(const float* x, int64_t n, float s, Format el, uint8_t* codes, float* fake);

#ifdef __AVX2__
// The same with AVX2 (kernels_avx2.cpp), bit-identical; no stochastic mode.
void nvfp4_blocks_avx2(const float* x, int64_t nblk, const Nvfp4Group& g, const uint8_t* sf_in,
                       uint8_t* codes, uint8_t* scales, float* fake);
void nvfp4_dequant_avx2(const uint8_t* codes, const uint8_t* scales, int64_t nblk,
                        const Nvfp4Group& g, float* out);
void mxfp4_blocks_avx2(const float* x, int64_t nblk, MxRule rule, uint8_t* codes, uint8_t* scales, float* fake);
void fp8_e4m3_run_avx2(const float* x, int64_t n, float s, uint8_t* codes, float* fake);
float absmax_avx2(const float* x, int64_t n);
#endif

}  // namespace quads::num::detail
