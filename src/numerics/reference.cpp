// Literal reference quantizers: one element at a time, the formats.h codecs, the formulas of
// quantize.h in the order written there. Tests hold the fast kernels to these bit for bit.
#include "numerics/reference.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "numerics/kernels.h"

namespace quads::num::ref {

namespace {

float grid_max(Format el) { return el == Format::E2M1 ? 6.f : 3.5f; }
uint8_t enc4(float v, Format el) { return el == Format::E2M1 ? e2m1_from_f32(v) : e1m2_from_f32(v); }
float dec4(uint8_t c, Format el) { return el == Format::E2M1 ? e2m1_to_f32(c) : e1m2_to_f32(c); }

// Stochastic rounding spelled out: find the grid neighbours of |v| by decoding every code.
uint8_t enc4_sr(float v, Format el, float u) {
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  const float a = std::fabs(v);
  if (std::isnan(a) || a >= grid_max(el)) return static_cast<uint8_t>(sign | 7);
  int lo = 0;
  for (int c = 0; c < 8; ++c)
    if (dec4(static_cast<uint8_t>(c), el) <= a) lo = c;
  const float vlo = dec4(static_cast<uint8_t>(lo), el), vhi = dec4(static_cast<uint8_t>(lo + 1), el);
  const float p = (a - vlo) / (vhi - vlo);
  return static_cast<uint8_t>(sign | (u < p ? lo + 1 : lo));
}

// max |x| over a rectangle, NaN largest (see kernels.h abs_bits).
float rect_amax(const float* x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) m = std::max(m, detail::abs_bits(x[r * cols + c]));
  return detail::u2f(m);
}

void set_nibble(std::vector<uint8_t>& codes, int64_t i, uint8_t c) {
  codes[i / 2] |= static_cast<uint8_t>((i % 2) ? c << 4 : c);
}
uint8_t get_nibble(const std::vector<uint8_t>& codes, int64_t i) {
  return static_cast<uint8_t>((codes[i / 2] >> ((i % 2) * 4)) & 0xF);
}

void quantize_nvfp4(const float* x, QTensor& q) {
  const QConfig& cfg = q.cfg;
  const int64_t rows = q.rows, cols = q.cols, nb = cols / 16;
  const float G = grid_max(cfg.element);
  q.codes.assign(rows * cols / 2, 0);
  q.scales.assign(rows * nb, 0);
  if (cfg.global == Global::PerRow) {
    for (int64_t r = 0; r < rows; ++r) q.amax.push_back(rect_amax(x, cols, r, r + 1, 0, cols));
  } else {
    q.amax.push_back(cfg.global == Global::Static ? cfg.static_amax : rect_amax(x, cols, 0, rows, 0, cols));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float amax = q.amax[cfg.global == Global::PerRow ? r : 0];
    float s_enc = (448.f * G) / amax;
    if (s_enc > FLT_MAX) s_enc = FLT_MAX;
    if (amax == 0.f || s_enc == 0.f) s_enc = 1.f;
    const float s_dec = 1.f / s_enc;
    for (int64_t b = 0; b < nb; ++b) {
      const float bamax = cfg.block == Block::B16x16
                              ? rect_amax(x, cols, r / 16 * 16, r / 16 * 16 + 16, b * 16, b * 16 + 16)
                              : rect_amax(x, cols, r, r + 1, b * 16, b * 16 + 16);
      const uint8_t sf = e4m3_from_f32(bamax * (s_enc * (1.f / G)));
      q.scales[r * nb + b] = sf;
      float enc = 1.f / (e4m3_to_f32(sf) * s_dec);
      if (enc > FLT_MAX) enc = FLT_MAX;
      for (int64_t c = b * 16; c < b * 16 + 16; ++c) {
        const int64_t i = r * cols + c;
        const float v = x[i] * enc;
        const uint8_t code = cfg.stochastic ? enc4_sr(v, cfg.element, detail::sr_uniform(cfg.seed, i))
                                            : enc4(v, cfg.element);
        set_nibble(q.codes, i, code);
      }
    }
  }
}

void quantize_mxfp4(const float* x, QTensor& q) {
  const QConfig& cfg = q.cfg;
  const int64_t rows = q.rows, cols = q.cols, nb = cols / 32;
  q.codes.assign(rows * cols / 2, 0);
  q.scales.assign(rows * nb, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float amax = rect_amax(x, cols, r, r + 1, b * 32, b * 32 + 32);
      uint8_t sc;
      if (!std::isfinite(amax)) {
        sc = 0xFF;
      } else if (cfg.mx_rule == MxRule::TeCeil) {
        sc = ue8m0_from_f32(amax * (1.f / 6.f), /*round_up=*/true);
      } else if (amax == 0.f) {
        sc = 0;
      } else {
        int k;
        std::frexp(amax, &k);  // amax = f 2^k, f in [0.5, 1): floor(log2 amax) = k - 1
        const int e = (k - 1) - 2;
        sc = static_cast<uint8_t>(std::clamp(e + 127, 0, 254));
      }
      q.scales[r * nb + b] = sc;
      const float X = ue8m0_to_f32(sc);
      for (int64_t c = b * 32; c < b * 32 + 32; ++c) {
        const int64_t i = r * cols + c;
        const float v = x[i] / X;
        const uint8_t code = cfg.stochastic ? enc4_sr(v, Format::E2M1, detail::sr_uniform(cfg.seed, i))
                                            : e2m1_from_f32(v);
        set_nibble(q.codes, i, code);
      }
    }
}

void quantize_fp8(const float* x, QTensor& q) {
  const QConfig& cfg = q.cfg;
  const int64_t rows = q.rows, cols = q.cols;
  const float fmax = cfg.element == Format::E4M3 ? 448.f : 57344.f;
  // Scale groups as rectangles: (row blocks) x (column blocks).
  int64_t bh = rows, bw = cols;
  if (cfg.block == Block::PerRow) { bh = 1; bw = cols; }
  if (cfg.block == Block::B1x128) { bh = 1; bw = 128; }
  if (cfg.block == Block::B128x128) { bh = 128; bw = 128; }
  if (bh == 0) bh = 1;
  if (bw == 0) bw = 1;
  const int64_t nrb = (rows + bh - 1) / bh, ncb = (cols + bw - 1) / bw;
  q.codes.assign(rows * cols, 0);
  q.fscales.assign(cfg.block == Block::PerTensor ? 1 : nrb * ncb, 1.f);
  for (int64_t rb = 0; rb < nrb; ++rb)
    for (int64_t cb = 0; cb < ncb; ++cb) {
      const int64_t r0 = rb * bh, r1 = std::min(rows, r0 + bh), c0 = cb * bw, c1 = std::min(cols, c0 + bw);
      const float amax = rect_amax(x, cols, r0, r1, c0, c1);
      float scale = amax / fmax;
      if (amax == 0.f || scale == 0.f) scale = 1.f;
      q.fscales[rb * ncb + cb] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float v = x[r * cols + c] / scale;
          q.codes[r * cols + c] = cfg.element == Format::E4M3 ? e4m3_from_f32(v) : e5m2_from_f32(v, true);
        }
    }
}

}  // namespace

QTensor quantize(const float* x, int64_t rows, int64_t cols, const QConfig& cfg) {
  check_config(cfg, rows, cols, "ref::quantize");
  QTensor q;
  q.cfg = cfg;
  q.rows = rows;
  q.cols = cols;
  switch (cfg.scheme) {
    case Scheme::NVFP4: quantize_nvfp4(x, q); break;
    case Scheme::MXFP4: quantize_mxfp4(x, q); break;
    case Scheme::FP8: quantize_fp8(x, q); break;
  }
  return q;
}

void dequantize(const QTensor& q, float* out) {
  const QConfig& cfg = q.cfg;
  const int64_t rows = q.rows, cols = q.cols;
  if (cfg.scheme == Scheme::NVFP4) {
    const float G = grid_max(cfg.element);
    const int64_t nb = cols / 16;
    for (int64_t r = 0; r < rows; ++r) {
      const float amax = q.amax[cfg.global == Global::PerRow ? r : 0];
      for (int64_t c = 0; c < cols; ++c) {
        const float sf = e4m3_to_f32(q.scales[r * nb + c / 16]);
        out[r * cols + c] = dec4(get_nibble(q.codes, r * cols + c), cfg.element) * ((sf * amax) * (1.f / (448.f * G)));
      }
    }
  } else if (cfg.scheme == Scheme::MXFP4) {
    const int64_t nb = cols / 32;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[r * cols + c] = e2m1_to_f32(get_nibble(q.codes, r * cols + c)) * ue8m0_to_f32(q.scales[r * nb + c / 32]);
  } else {
    int64_t bh = rows, bw = cols;
    if (cfg.block == Block::PerRow) { bh = 1; bw = cols; }
    if (cfg.block == Block::B1x128) { bh = 1; bw = 128; }
    if (cfg.block == Block::B128x128) { bh = 128; bw = 128; }
    if (bh == 0) bh = 1;
    if (bw == 0) bw = 1;
    const int64_t ncb = (cols + bw - 1) / bw;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float s = cfg.block == Block::PerTensor ? q.fscales[0] : q.fscales[(r / bh) * ncb + c / bw];
        const uint8_t code = q.codes[r * cols + c];
        out[r * cols + c] = (cfg.element == Format::E4M3 ? e4m3_to_f32(code) : e5m2_to_f32(code)) * s;
      }
  }
}

}  // namespace quads::num::ref
