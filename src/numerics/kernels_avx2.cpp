// AVX2 kernels. NVFP4: eight 1x16 blocks per step. The block amaxes of the eight blocks are
// reduced into one vector, so the scale arithmetic (E4M3 rounding, the reciprocal, the dequant
// factor) runs once per 128 elements in vector form; elements are rounded by the FPU itself
// (grid_round8), codes recovered with one byte shuffle per 32 elements and signs with movemask
// and PDEP. MXFP4 and FP8 (E4M3) reuse the same pieces. The float operations that produce
// results are those of the scalar kernels in quantize.cpp, in the same order, and the roundings
// are proven equal to the codecs', so the results are bit-identical (tests/numerics checks it,
// over random data, every scale code and a dense sweep of element values).
#ifdef __AVX2__

#include <immintrin.h>

#include "numerics/kernels.h"

namespace quads::num::detail {

namespace {

inline __m256i abs_bits8(const float* p) {
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                          _mm256_set1_epi32(0x7FFFFFFF));
}

// Amaxes (as |x| bits, NaN largest) of the eight 16-blocks starting at x, lane j = block j.
inline __m256i block_amax8(const float* x) {
  __m256i m[8];
  for (int j = 0; j < 8; ++j) m[j] = _mm256_max_epu32(abs_bits8(x + 16 * j), abs_bits8(x + 16 * j + 8));
  // Transposing reduction: after two rounds each 128-bit lane holds [b0 b1 b2 b3] (or b4..b7)
  // reduced over that lane's half; the last round folds the two halves.
  __m256i p[4];
  for (int j = 0; j < 4; ++j)
    p[j] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * j], m[2 * j + 1]),
                            _mm256_unpackhi_epi32(m[2 * j], m[2 * j + 1]));
  const __m256i q0 = _mm256_max_epu32(_mm256_unpacklo_epi64(p[0], p[1]), _mm256_unpackhi_epi64(p[0], p[1]));
  const __m256i q1 = _mm256_max_epu32(_mm256_unpacklo_epi64(p[2], p[3]), _mm256_unpackhi_epi64(p[2], p[3]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// E4M3 satfinite RNE of non-negative (or NaN) v: the code and its value (canonical NaN for NaN,
// as the decoding table gives). Same steps as e4m3_encode in kernels.h.
inline void e4m3_encode8(__m256 v, __m256i* code, __m256* value) {
  const __m256 a = _mm256_min_ps(_mm256_set1_ps(448.f), v);  // NaN stays NaN (second operand)
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
  const __m256i rb = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), lsb));
  const __m256i code_n = _mm256_sub_epi32(_mm256_srli_epi32(rb, 20), _mm256_set1_epi32(960));
  const __m256 val_n = _mm256_castsi256_ps(_mm256_and_si256(rb, _mm256_set1_epi32(static_cast<int>(0xFFF00000u))));
  // Below 2^-6: a * 2^9 < 8 rounded to an integer by adding 2^23 (ties to even).
  const __m256 s = _mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)), _mm256_set1_ps(8388608.f));
  const __m256i code_s = _mm256_sub_epi32(_mm256_castps_si256(s), _mm256_set1_epi32(0x4B000000));
  const __m256 val_s = _mm256_mul_ps(_mm256_sub_ps(s, _mm256_set1_ps(8388608.f)), _mm256_set1_ps(1.f / 512.f));
  const __m256 sub = _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ);
  const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  __m256i c = _mm256_blendv_epi8(code_n, code_s, _mm256_castps_si256(sub));
  __m256 val = _mm256_blendv_ps(val_n, val_s, sub);
  c = _mm256_blendv_epi8(c, _mm256_set1_epi32(0x7F), _mm256_castps_si256(nan));
  val = _mm256_blendv_ps(val, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  *code = c;
  *value = val;
}

inline __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline __m256 sign8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)))); }

// |v| rounded to the element grid, as a float (grid4_encode's rounding: nearest, ties to the
// even code, saturating, NaN -> max). Adding M = 1.5 * 2^(22 + e) to a value a < 2^(e+1) rounds
// it to a multiple of ulp(M) = 2^(e-1) with the FPU's ties-to-even, and (a + M) - M is exact.
// For E2M1 in binade e >= 0 that multiple is its grid step (1 mantissa bit); below 2 the step
// is 0.5, so M is at least 1.5 * 2^22. Even multiples of the step are exactly the even codes.
// E1M2's step is 0.5 throughout. min(a, max) saturates and maps NaN to max (MINPS returns its
// second operand when the first is NaN).
template <bool kUniform>
inline __m256 grid_round8(__m256 a0) {
  const __m256 m0 = _mm256_set1_ps(6291456.f);  // 1.5 * 2^22
  if (kUniform) {
    const __m256 a = _mm256_min_ps(a0, _mm256_set1_ps(3.5f));
    return _mm256_sub_ps(_mm256_add_ps(a, m0), m0);
  }
  const __m256 a = _mm256_min_ps(a0, _mm256_set1_ps(6.f));
  const __m256i e = _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000));
  const __m256 m = _mm256_castsi256_ps(_mm256_max_epi32(_mm256_add_epi32(e, _mm256_set1_epi32((22 << 23) | 0x400000)),
                                                        _mm256_castps_si256(m0)));
  return _mm256_sub_ps(_mm256_add_ps(a, m), m);
}

// 32 rounded magnitudes (4 vectors of 8, in element order, from grid_round8) and their 32 sign
// bits (bit i for element i) -> 16 packed bytes, element 2i in the low nibble, sign in bit 3 of
// each nibble. A grid value's bits >> 21, minus 503 with unsigned saturation, is a distinct
// number below 16 for each of the 8 values of either grid; one byte shuffle maps it to the code.
template <bool kUniform>
inline void pack32(__m256 r0, __m256 r1, __m256 r2, __m256 r3, uint32_t signs, uint8_t* out) {
  auto key = [](__m256 r) { return _mm256_srli_epi32(_mm256_castps_si256(r), 21); };
  const __m256i bias = _mm256_set1_epi16(503);
  const __m256i w01 = _mm256_subs_epu16(_mm256_packs_epi32(key(r0), key(r1)), bias);
  const __m256i w23 = _mm256_subs_epu16(_mm256_packs_epi32(key(r2), key(r3)), bias);
  // E2M1 keys 0 1 5 7 9 11 13 15, E1M2 keys 0 1 5 7 9 10 11 12 -> codes 0..7.
  const __m256i lut = kUniform ? _mm256_setr_epi8(0, 1, 0, 0, 0, 2, 0, 3, 0, 4, 5, 6, 7, 0, 0, 0,
                                                  0, 1, 0, 0, 0, 2, 0, 3, 0, 4, 5, 6, 7, 0, 0, 0)
                               : _mm256_setr_epi8(0, 1, 0, 0, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7,
                                                  0, 1, 0, 0, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7);
  const __m256i b = _mm256_shuffle_epi8(lut, _mm256_packs_epi16(w01, w23));
  // packs interleave the 128-bit lanes: 4-byte groups come out as r0lo r1lo r2lo r3lo | r0hi ...
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i pairs = _mm256_maddubs_epi16(ordered, _mm256_set1_epi16(0x1001));  // lo + 16 * hi
  const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
  // Sign bit i goes to bit 4i + 3.
  const __m128i sb = _mm_set_epi64x(static_cast<int64_t>(_pdep_u64(signs >> 16, 0x8888888888888888ull)),
                                    static_cast<int64_t>(_pdep_u64(signs & 0xFFFF, 0x8888888888888888ull)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_or_si128(bytes, sb));
}

inline uint32_t signs32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  return static_cast<uint32_t>(_mm256_movemask_ps(v0)) | (static_cast<uint32_t>(_mm256_movemask_ps(v1)) << 8) |
         (static_cast<uint32_t>(_mm256_movemask_ps(v2)) << 16) | (static_cast<uint32_t>(_mm256_movemask_ps(v3)) << 24);
}

// A rounded magnitude with the sign of v, times d: grid4_decode(code) * d (negation is a flip
// of the sign bit).
inline __m256 signed_times(__m256 r, __m256 v, __m256 d) { return _mm256_mul_ps(_mm256_xor_ps(r, sign8(v)), d); }

// Values of eight codes (sign in bit 3) times d, as grid4_decode(c) * d.
inline __m256 grid_decode8(__m256i c, __m256 values, __m256 d) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 28), _mm256_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(values, c), sign), d);
}

// Low bytes of eight int32 lanes -> 8 bytes.
inline void store_bytes8(__m256i c, uint8_t* out) {
  const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(c, c), _mm256_setzero_si256());
  const __m256i o = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(o));
}

// 8 packed bytes (16 codes) -> two vectors of eight codes.
inline void unpack16(const uint8_t* p, __m256i* c0, __m256i* c1) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m128i il = _mm_unpacklo_epi8(lo, hi);
  *c0 = _mm256_cvtepu8_epi32(il);
  *c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(il, 8));
}
template <bool kCodes, bool kFake, bool kUniform>
void blocks8(const float* x, int64_t n8, const Nvfp4Group& g, const uint8_t* sf_in, uint8_t* codes,
             uint8_t* scales, float* fake) {
  const __m256 s_enc_g = _mm256_set1_ps(g.s_enc_g), s_dec = _mm256_set1_ps(g.s_dec);
  const __m256 amax = _mm256_set1_ps(g.amax), dq = _mm256_set1_ps(g.dq);
  const __m256 fmax = _mm256_set1_ps(FLT_MAX), one = _mm256_set1_ps(1.f);
  const float* e4m3 = tables().e4m3;
  alignas(32) float enc_a[8], d_a[8];  // per-block factors, broadcast from memory below
  for (int64_t s = 0; s < n8; ++s) {
    const float* xs = x + 128 * s;
    __m256i sf;
    __m256 sfv;
    if (sf_in) {
      sf = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sf_in + 8 * s)));
      sfv = _mm256_i32gather_ps(e4m3, sf, 4);
    } else {
      e4m3_encode8(_mm256_mul_ps(_mm256_castsi256_ps(block_amax8(xs)), s_enc_g), &sf, &sfv);
    }
    // fmax < enc ? fmax : enc, so NaN stays NaN, as the scalar kernel's comparison.
    _mm256_store_ps(enc_a, _mm256_min_ps(fmax, _mm256_div_ps(one, _mm256_mul_ps(sfv, s_dec))));
    if (kFake) _mm256_store_ps(d_a, _mm256_mul_ps(_mm256_mul_ps(sfv, amax), dq));
    if (kCodes) store_bytes8(sf, scales + 8 * s);
    // Two blocks per step, kept in registers for packing.
    for (int j = 0; j < 8; j += 2) {
      const __m256 e0 = _mm256_broadcast_ss(enc_a + j), e1 = _mm256_broadcast_ss(enc_a + j + 1);
      const float* xb = xs + 16 * j;
      const __m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(xb), e0);
      const __m256 v1 = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), e0);
      const __m256 v2 = _mm256_mul_ps(_mm256_loadu_ps(xb + 16), e1);
      const __m256 v3 = _mm256_mul_ps(_mm256_loadu_ps(xb + 24), e1);
      const __m256 r0 = grid_round8<kUniform>(abs8(v0)), r1 = grid_round8<kUniform>(abs8(v1));
      const __m256 r2 = grid_round8<kUniform>(abs8(v2)), r3 = grid_round8<kUniform>(abs8(v3));
      if (kFake) {
        const __m256 d0 = _mm256_broadcast_ss(d_a + j), d1 = _mm256_broadcast_ss(d_a + j + 1);
        float* ob = fake + 128 * s + 16 * j;
        _mm256_storeu_ps(ob, signed_times(r0, v0, d0));
        _mm256_storeu_ps(ob + 8, signed_times(r1, v1, d0));
        _mm256_storeu_ps(ob + 16, signed_times(r2, v2, d1));
        _mm256_storeu_ps(ob + 24, signed_times(r3, v3, d1));
      }
      if (kCodes) pack32<kUniform>(r0, r1, r2, r3, signs32(v0, v1, v2, v3), codes + 64 * s + 8 * j);
    }
  }
}

template <bool kUniform>
void blocks8_any(const float* x, int64_t n8, const Nvfp4Group& g, const uint8_t* sf_in, uint8_t* codes,
                 uint8_t* scales, float* fake) {
  if (codes && fake) blocks8<true, true, kUniform>(x, n8, g, sf_in, codes, scales, fake);
  else if (codes) blocks8<true, false, kUniform>(x, n8, g, sf_in, codes, scales, nullptr);
  else blocks8<false, true, kUniform>(x, n8, g, sf_in, nullptr, nullptr, fake);
}

}  // namespace

void nvfp4_blocks_avx2(const float* x, int64_t nblk, const Nvfp4Group& g, const uint8_t* sf_in,
                       uint8_t* codes, uint8_t* scales, float* fake) {
  const int64_t n8 = nblk / 8, done = 8 * n8;
  if (g.grid == &kGridE1M2) blocks8_any<true>(x, n8, g, sf_in, codes, scales, fake);
  else blocks8_any<false>(x, n8, g, sf_in, codes, scales, fake);
  if (done < nblk)
    nvfp4_blocks_scalar(x + 16 * done, nblk - done, g, sf_in ? sf_in + done : nullptr,
                        codes ? codes + 8 * done : nullptr, scales ? scales + done : nullptr,
                        fake ? fake + 16 * done : nullptr, SrStream{});
}

void nvfp4_dequant_avx2(const uint8_t* codes, const uint8_t* scales, int64_t nblk,
                        const Nvfp4Group& g, float* out) {
  const __m256 values = _mm256_loadu_ps(g.grid->values);
  const float* e4m3 = tables().e4m3;
  for (int64_t b = 0; b < nblk; ++b) {
    const __m256 d = _mm256_set1_ps((e4m3[scales[b]] * g.amax) * g.dq);
    __m256i c0, c1;
    unpack16(codes + 8 * b, &c0, &c1);
    _mm256_storeu_ps(out + 16 * b, grid_decode8(c0, values, d));
    _mm256_storeu_ps(out + 16 * b + 8, grid_decode8(c1, values, d));
  }
}

void mxfp4_blocks_avx2(const float* x, int64_t nblk, MxRule rule, uint8_t* codes, uint8_t* scales, float* fake) {
  const Tables& t = tables();
  for (int64_t b = 0; b < nblk; ++b) {
    const float* xb = x + 32 * b;
    __m256i m = _mm256_max_epu32(_mm256_max_epu32(abs_bits8(xb), abs_bits8(xb + 8)),
                                 _mm256_max_epu32(abs_bits8(xb + 16), abs_bits8(xb + 24)));
    m = _mm256_max_epu32(m, _mm256_permute2x128_si256(m, m, 1));
    m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0x4E));
    m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0xB1));
    const uint8_t sc = mx_scale(u2f(static_cast<uint32_t>(_mm256_cvtsi256_si32(m))), rule);
    const __m256 inv = _mm256_set1_ps(t.ue8m0_inv[sc]);
    const __m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(xb), inv), v1 = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), inv);
    const __m256 v2 = _mm256_mul_ps(_mm256_loadu_ps(xb + 16), inv), v3 = _mm256_mul_ps(_mm256_loadu_ps(xb + 24), inv);
    const __m256 r0 = grid_round8<false>(abs8(v0)), r1 = grid_round8<false>(abs8(v1));
    const __m256 r2 = grid_round8<false>(abs8(v2)), r3 = grid_round8<false>(abs8(v3));
    if (codes) {
      scales[b] = sc;
      pack32<false>(r0, r1, r2, r3, signs32(v0, v1, v2, v3), codes + 16 * b);
    }
    if (fake) {
      const __m256 X = _mm256_set1_ps(t.ue8m0[sc]);
      float* o = fake + 32 * b;
      _mm256_storeu_ps(o, signed_times(r0, v0, X));
      _mm256_storeu_ps(o + 8, signed_times(r1, v1, X));
      _mm256_storeu_ps(o + 16, signed_times(r2, v2, X));
      _mm256_storeu_ps(o + 24, signed_times(r3, v3, X));
    }
  }
}

void fp8_e4m3_run_avx2(const float* x, int64_t n, float s, uint8_t* codes, float* fake) {
  const __m256 sv = _mm256_set1_ps(s);
  const float* lut = tables().e4m3;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), sv);
    __m256i c;
    __m256 unused;
    e4m3_encode8(abs8(v), &c, &unused);
    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 24), _mm256_set1_epi32(0x80)));
    if (codes) store_bytes8(c, codes + i);
    if (fake) _mm256_storeu_ps(fake + i, _mm256_mul_ps(_mm256_i32gather_ps(lut, c, 4), sv));
  }
  if (i < n) fp8_run_scalar(x + i, n - i, s, Format::E4M3, codes ? codes + i : nullptr, fake ? fake + i : nullptr);
}

float absmax_avx2(const float* x, int64_t n) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_epu32(m0, abs_bits8(x + i));
    m1 = _mm256_max_epu32(m1, abs_bits8(x + i + 8));
    m2 = _mm256_max_epu32(m2, abs_bits8(x + i + 16));
    m3 = _mm256_max_epu32(m3, abs_bits8(x + i + 24));
  }
  const __m256i m = _mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t r = 0;
  for (uint32_t v : lanes) r = v > r ? v : r;
  const uint32_t tail = f2u(absmax(x + i, n - i));
  return u2f(tail > r ? tail : r);
}

}  // namespace quads::num::detail

#endif  // __AVX2__
