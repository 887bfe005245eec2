// The quantization path: configuration checks, the drivers that split tensors into scale
// groups and spread them over OpenMP threads, the portable scalar kernels, swizzling and error
// statistics. The AVX2 NVFP4 kernels are in nvfp4_avx2.cpp; reference.cpp is the literal
// specification both are tested against.
//
// Work is split into fixed pieces (rows, row groups or fixed-size chunks of blocks) that write
// disjoint outputs and depend on nothing but their inputs, so neither the thread count nor the
// schedule changes a bit. Dynamic schedules keep all threads busy when one is preempted (the
// only reductions are maxima of bit patterns, which are exact in any order).
#include "numerics/quantize.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "numerics/kernels.h"

namespace quads::num {

using namespace detail;

namespace detail {

Tables::Tables() {
  for (int c = 0; c < 256; ++c) {
    const auto b = static_cast<uint8_t>(c);
    e4m3[c] = e4m3_to_f32(b);
    e5m2[c] = e5m2_to_f32(b);
    ue8m0[c] = ue8m0_to_f32(b);
    ue8m0_inv[c] = c == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.f, 127 - c);
  }
}
const Tables& tables() {
  static const Tables t;
  return t;
}

Nvfp4Group nvfp4_group(float amax, const Grid4& grid) {
  const float smax = 448.f * grid.max;  // 2688 (E2M1) or 1568 (E1M2), exact
  float s_enc = smax / amax;
  if (s_enc > FLT_MAX) s_enc = FLT_MAX;
  if (amax == 0.f || s_enc == 0.f) s_enc = 1.f;
  Nvfp4Group g;
  g.amax = amax;
  g.s_enc = s_enc;
  g.s_dec = 1.f / s_enc;
  g.s_enc_g = s_enc * (1.f / grid.max);
  g.dq = 1.f / smax;
  g.grid = &grid;
  return g;
}

void nvfp4_blocks_scalar(const float* x, int64_t nblk, const Nvfp4Group& g, const uint8_t* sf_in,
                         uint8_t* codes, uint8_t* scales, float* fake, const SrStream& sr) {
  const Grid4& grid = *g.grid;
  const float* e4m3 = tables().e4m3;
  for (int64_t b = 0; b < nblk; ++b) {
    const float* xb = x + 16 * b;
    const uint8_t sf = sf_in ? sf_in[b] : e4m3_encode(absmax(xb, 16) * g.s_enc_g);
    const float sfv = e4m3[sf];
    float enc = 1.f / (sfv * g.s_dec);
    if (enc > FLT_MAX) enc = FLT_MAX;
    const float d = (sfv * g.amax) * g.dq;
    uint8_t c[16];
    for (int i = 0; i < 16; ++i) {
      const float v = xb[i] * enc;
      c[i] = sr.on ? grid4_encode_sr(v, grid, sr_uniform(sr.seed, sr.idx0 + 16 * b + i))
                   : grid4_encode(v, grid);
    }
    if (codes) {
      scales[b] = sf;
      for (int i = 0; i < 8; ++i) codes[8 * b + i] = static_cast<uint8_t>(c[2 * i] | (c[2 * i + 1] << 4));
    }
    if (fake)
      for (int i = 0; i < 16; ++i) fake[16 * b + i] = grid4_decode(c[i], grid) * d;
  }
}

void nvfp4_dequant_scalar(const uint8_t* codes, const uint8_t* scales, int64_t nblk,
                          const Nvfp4Group& g, float* out) {
  const float* e4m3 = tables().e4m3;
  for (int64_t b = 0; b < nblk; ++b) {
    const float d = (e4m3[scales[b]] * g.amax) * g.dq;
    for (int i = 0; i < 8; ++i) {
      const uint8_t byte = codes[8 * b + i];
      out[16 * b + 2 * i] = grid4_decode(byte & 0xF, *g.grid) * d;
      out[16 * b + 2 * i + 1] = grid4_decode(byte >> 4, *g.grid) * d;
    }
  }
}

void mxfp4_blocks_scalar(const float* x, int64_t nblk, MxRule rule, uint8_t* codes, uint8_t* scales,
                         float* fake, const SrStream& sr) {
  const Tables& t = tables();
  for (int64_t b = 0; b < nblk; ++b) {
    const float* xb = x + 32 * b;
    const uint8_t sc = mx_scale(absmax(xb, 32), rule);
    const float inv = t.ue8m0_inv[sc], X = t.ue8m0[sc];
    uint8_t c[32];
    for (int i = 0; i < 32; ++i) {
      const float v = xb[i] * inv;  // == xb[i] / X: both are the exact product rounded once
      c[i] = sr.on ? grid4_encode_sr(v, kGridE2M1, sr_uniform(sr.seed, sr.idx0 + 32 * b + i))
                   : grid4_encode(v, kGridE2M1);
    }
    if (codes) {
      scales[b] = sc;
      for (int i = 0; i < 16; ++i) codes[16 * b + i] = static_cast<uint8_t>(c[2 * i] | (c[2 * i + 1] << 4));
    }
    if (fake)
      for (int i = 0; i < 32; ++i) fake[32 * b + i] = grid4_decode(c[i], kGridE2M1) * X;
  }
}

void fp8_run_scalar(const float* x, int64_t n, float s, Format el, uint8_t* codes, float* fake) {
  const float* lut = el == Format::E4M3 ? tables().e4m3 : tables().e5m2;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] / s;
    const uint8_t code = el == Format::E4M3 ? e4m3_encode(v) : e5m2_from_f32(v, true);
    if (codes) codes[i] = code;
    if (fake) fake[i] = lut[code] * s;
  }
}

}  // namespace detail

namespace {

std::atomic<bool> g_simd{true};

bool use_simd() { return simd_available() && g_simd.load(std::memory_order_relaxed); }

// Below this many elements a tensor is done on the calling thread (the parallel region costs
// more than the work).
constexpr int64_t kParallelMin = 1 << 15;

// Rows per dynamically scheduled task: about 16K elements.
int64_t rows_per_task(int64_t cols) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(cols, 1)); }

const Grid4& grid_of(Format el) { return el == Format::E1M2 ? kGridE1M2 : kGridE2M1; }

float absmax_any(const float* x, int64_t n) {
#ifdef __AVX2__
  if (use_simd()) return absmax_avx2(x, n);
#endif
  return absmax(x, n);
}

// max|x| of a whole tensor: per-chunk maxima, then their max (exact, so order-free).
float absmax_tensor(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  uint32_t m = 0;
#pragma omp parallel for schedule(dynamic) reduction(max : m) if (n >= kParallelMin)
  for (int64_t k = 0; k < nchunks; ++k) {
    const int64_t i0 = k * kChunk;
    const uint32_t v = f2u(absmax_any(x + i0, std::min(kChunk, n - i0)));
    m = v > m ? v : m;
  }
  return u2f(m);
}

void nvfp4_run(const float* x, int64_t nblk, const Nvfp4Group& g, const uint8_t* sf_in, uint8_t* codes,
               uint8_t* scales, float* fake, const SrStream& sr) {
#ifdef __AVX2__
  if (!sr.on && use_simd()) return nvfp4_blocks_avx2(x, nblk, g, sf_in, codes, scales, fake);
#endif
  nvfp4_blocks_scalar(x, nblk, g, sf_in, codes, scales, fake, sr);
}

// NVFP4 quantize and/or fake-quantize. codes/scales (quantize) and fake may each be null.
void nvfp4_driver(const float* x, int64_t rows, int64_t cols, const QConfig& cfg, uint8_t* codes,
                  uint8_t* scales, float* fake, std::vector<float>* amax_out) {
  const Grid4& grid = grid_of(cfg.element);
  const int64_t nb = cols / 16;
  const bool par = rows * cols >= kParallelMin;
  auto sr_at = [&](int64_t idx0) { return SrStream{cfg.stochastic, cfg.seed, idx0}; };

  if (cfg.global == Global::PerRow) {
    std::vector<float> amax(rows);
#pragma omp parallel for schedule(dynamic, rows_per_task(cols)) if (par)
    for (int64_t r = 0; r < rows; ++r) {
      amax[r] = absmax_any(x + r * cols, cols);
      nvfp4_run(x + r * cols, nb, nvfp4_group(amax[r], grid), nullptr, codes ? codes + r * cols / 2 : nullptr,
                scales ? scales + r * nb : nullptr, fake ? fake + r * cols : nullptr, sr_at(r * cols));
    }
    if (amax_out) *amax_out = std::move(amax);
    return;
  }

  const float amax = cfg.global == Global::Static ? cfg.static_amax : absmax_tensor(x, rows * cols);
  if (amax_out) *amax_out = {amax};
  const Nvfp4Group g = nvfp4_group(amax, grid);

  if (cfg.block == Block::B1x16) {
    // Blocks are independent given the group: split the flat tensor into fixed chunks.
    constexpr int64_t kChunk = 1024;  // blocks (16K elements)
    const int64_t total = rows * nb, nchunks = (total + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(dynamic) if (par)
    for (int64_t k = 0; k < nchunks; ++k) {
      const int64_t b0 = k * kChunk, n = std::min(kChunk, total - b0);
      nvfp4_run(x + 16 * b0, n, g, nullptr, codes ? codes + 8 * b0 : nullptr, scales ? scales + b0 : nullptr,
                fake ? fake + 16 * b0 : nullptr, sr_at(16 * b0));
    }
    return;
  }

  // 16x16 tiles: one scale per tile from the tile's amax, then each row quantized with it.
#pragma omp parallel for schedule(dynamic) if (par)
  for (int64_t rg = 0; rg < rows / 16; ++rg) {
    const float* xg = x + rg * 16 * cols;
    std::vector<uint32_t> colmax(cols, 0);
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t a = abs_bits(xg[r * cols + c]);
        colmax[c] = a > colmax[c] ? a : colmax[c];
      }
    std::vector<uint8_t> sf(nb);
    for (int64_t b = 0; b < nb; ++b) {
      uint32_t m = 0;
      for (int i = 0; i < 16; ++i) m = std::max(m, colmax[16 * b + i]);
      sf[b] = e4m3_encode(u2f(m) * g.s_enc_g);
    }
    for (int64_t r = rg * 16; r < rg * 16 + 16; ++r)
      nvfp4_run(x + r * cols, nb, g, sf.data(), codes ? codes + r * cols / 2 : nullptr,
                scales ? scales + r * nb : nullptr, fake ? fake + r * cols : nullptr, sr_at(r * cols));
  }
}

void mxfp4_driver(const float* x, int64_t rows, int64_t cols, const QConfig& cfg, uint8_t* codes,
                  uint8_t* scales, float* fake) {
  const int64_t total = rows * cols / 32;
  constexpr int64_t kChunk = 512;  // blocks
  const int64_t nchunks = (total + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(dynamic) if (rows * cols >= kParallelMin)
  for (int64_t k = 0; k < nchunks; ++k) {
    const int64_t b0 = k * kChunk, n = std::min(kChunk, total - b0);
    uint8_t* c = codes ? codes + 16 * b0 : nullptr;
    uint8_t* s = scales ? scales + b0 : nullptr;
    float* f = fake ? fake + 32 * b0 : nullptr;
#ifdef __AVX2__
    if (!cfg.stochastic && use_simd()) {
      mxfp4_blocks_avx2(x + 32 * b0, n, cfg.mx_rule, c, s, f);
      continue;
    }
#endif
    mxfp4_blocks_scalar(x + 32 * b0, n, cfg.mx_rule, c, s, f, SrStream{cfg.stochastic, cfg.seed, 32 * b0});
  }
}

// FP8 scale groups are rectangles bh x bw (ragged at the edges).
struct Fp8Grid {
  int64_t bh, bw, nrb, ncb;
};
Fp8Grid fp8_grid(const QConfig& cfg, int64_t rows, int64_t cols) {
  int64_t bh = std::max<int64_t>(rows, 1), bw = std::max<int64_t>(cols, 1);
  if (cfg.block == Block::PerRow) bh = 1;
  if (cfg.block == Block::B1x128) { bh = 1; bw = 128; }
  if (cfg.block == Block::B128x128) { bh = 128; bw = 128; }
  return {bh, bw, (rows + bh - 1) / bh, (cols + bw - 1) / bw};
}

inline float fp8_scale(float amax, float fmax) {
  float s = amax / fmax;
  if (amax == 0.f || s == 0.f) s = 1.f;
  return s;
}

// One FP8 group: rows [r0, r1), columns [c0, c1), scale s.
void fp8_group(const float* x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float s,
               Format el, uint8_t* codes, float* fake) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * cols + c0;
    uint8_t* c = codes ? codes + i : nullptr;
    float* f = fake ? fake + i : nullptr;
#ifdef __AVX2__
    if (el == Format::E4M3 && use_simd()) {
      fp8_e4m3_run_avx2(x + i, c1 - c0, s, c, f);
      continue;
    }
#endif
    fp8_run_scalar(x + i, c1 - c0, s, el, c, f);
  }
}

void fp8_driver(const float* x, int64_t rows, int64_t cols, const QConfig& cfg, uint8_t* codes,
                float* fake, std::vector<float>* fscales_out) {
  const float fmax = cfg.element == Format::E4M3 ? 448.f : 57344.f;
  const Fp8Grid G = fp8_grid(cfg, rows, cols);
  const bool par = rows * cols >= kParallelMin;
  if (cfg.block == Block::PerTensor) {
    const float s = fp8_scale(absmax_tensor(x, rows * cols), fmax);
    if (fscales_out) *fscales_out = {s};
#pragma omp parallel for schedule(dynamic, rows_per_task(cols)) if (par)
    for (int64_t r = 0; r < rows; ++r) fp8_group(x, cols, r, r + 1, 0, cols, s, cfg.element, codes, fake);
    return;
  }
  std::vector<float> fs(G.nrb * G.ncb);
  // One task per row block: the amaxes of all its column blocks first, then the elements
  // (so that fake may alias x).
#pragma omp parallel for schedule(dynamic) if (par)
  for (int64_t rb = 0; rb < G.nrb; ++rb) {
    const int64_t r0 = rb * G.bh, r1 = std::min(rows, r0 + G.bh);
    for (int64_t cb = 0; cb < G.ncb; ++cb) {
      const int64_t c0 = cb * G.bw, c1 = std::min(cols, c0 + G.bw);
      uint32_t m = 0;
      for (int64_t r = r0; r < r1; ++r) m = std::max(m, f2u(absmax(x + r * cols + c0, c1 - c0)));
      fs[rb * G.ncb + cb] = fp8_scale(u2f(m), fmax);
    }
    for (int64_t cb = 0; cb < G.ncb; ++cb) {
      const int64_t c0 = cb * G.bw, c1 = std::min(cols, c0 + G.bw);
      fp8_group(x, cols, r0, r1, c0, c1, fs[rb * G.ncb + cb], cfg.element, codes, fake);
    }
  }
  if (fscales_out) *fscales_out = std::move(fs);
}

const char* block_name(Block b) {
  switch (b) {
    case Block::B1x16: return "1x16";
    case Block::B16x16: return "16x16";
    case Block::B1x32: return "1x32";
    case Block::PerTensor: return "per-tensor";
    case Block::PerRow: return "per-row";
    case Block::B1x128: return "1x128";
    case Block::B128x128: return "128x128";
  }
  return "?";
}

void check_finite(const std::string& name, const float* x, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]) && i < first) first = i;
  QUADS_CHECK(first == n, "tensor '{}' [{}, {}]: non-finite value {} at row {}, column {}", name, rows, cols,
              x[first], first / cols, first % cols);
}

}  // namespace

std::string QConfig::describe() const {
  std::string s;
  switch (scheme) {
    case Scheme::NVFP4: {
      s = fmt::format("nvfp4 {} {} global=", format_name(element), block_name(block));
      if (global == Global::PerTensor) s += "per-tensor";
      if (global == Global::PerRow) s += "per-row";
      if (global == Global::Static) s += fmt::format("static({})", static_amax);
      break;
    }
    case Scheme::MXFP4:
      s = fmt::format("mxfp4 e2m1 1x32 scale={}", mx_rule == MxRule::OcpFloor ? "ocp-floor" : "te-ceil");
      break;
    case Scheme::FP8: s = fmt::format("fp8 {} {}", format_name(element), block_name(block)); break;
  }
  if (stochastic) s += fmt::format(" sr(seed={})", seed);
  return s;
}

QConfig QConfig::parse(const std::string& name) {
  QConfig c;
  if (name == "nvfp4") return nvfp4_act();
  if (name == "nvfp4-row") { c.global = Global::PerRow; return c; }
  if (name == "nvfp4-2d") return nvfp4_weight(true);
  if (name == "nvfp4-e1m2") { c.element = Format::E1M2; return c; }
  if (name == "nvfp4-kv") return nvfp4_kv();
  if (name == "mxfp4") return mxfp4();
  if (name == "mxfp4-te") { c = mxfp4(); c.mx_rule = MxRule::TeCeil; return c; }
  if (name == "fp8") return fp8(Block::PerTensor);
  if (name == "fp8-row") return fp8(Block::PerRow);
  if (name == "fp8-1x128") return fp8(Block::B1x128);
  if (name == "fp8-128x128") return fp8(Block::B128x128);
  if (name == "fp8-e5m2") { c = fp8(Block::PerTensor); c.element = Format::E5M2; return c; }
  fail("unknown quantization scheme '{}' (expected nvfp4, nvfp4-row, nvfp4-2d, nvfp4-e1m2, nvfp4-kv, "
       "mxfp4, mxfp4-te, fp8, fp8-row, fp8-1x128, fp8-128x128 or fp8-e5m2)", name);
}

int block_width(const QConfig& cfg) {
  switch (cfg.block) {
    case Block::B1x16:
    case Block::B16x16: return 16;
    case Block::B1x32: return 32;
    case Block::B1x128:
    case Block::B128x128: return 128;
    default: return 0;
  }
}

void check_config(const QConfig& cfg, int64_t rows, int64_t cols, const std::string& what) {
  QUADS_CHECK(rows >= 0 && cols >= 0, "{}: bad shape [{}, {}]", what, rows, cols);
  const std::string d = cfg.describe();
  switch (cfg.scheme) {
    case Scheme::NVFP4:
      QUADS_CHECK(cfg.block == Block::B1x16 || cfg.block == Block::B16x16,
                  "{}: {}: NVFP4 blocks are 1x16 or 16x16", what, d);
      QUADS_CHECK(cfg.element == Format::E2M1 || cfg.element == Format::E1M2,
                  "{}: {}: NVFP4 elements are e2m1 or e1m2", what, d);
      QUADS_CHECK(cols % 16 == 0, "{}: {}: cols must be a multiple of 16, shape is [{}, {}]", what, d, rows, cols);
      if (cfg.block == Block::B16x16) {
        QUADS_CHECK(rows % 16 == 0, "{}: {}: rows must be a multiple of 16, shape is [{}, {}]", what, d, rows, cols);
        QUADS_CHECK(cfg.global != Global::PerRow,
                    "{}: {}: 16x16 tiles span 16 rows and need one global scale (per-tensor or static)", what, d);
      }
      if (cfg.global == Global::Static)
        QUADS_CHECK(std::isfinite(cfg.static_amax) && cfg.static_amax >= 0.f,
                    "{}: {}: static_amax must be finite and >= 0", what, d);
      break;
    case Scheme::MXFP4:
      QUADS_CHECK(cfg.block == Block::B1x32, "{}: {}: MXFP4 blocks are 1x32", what, d);
      QUADS_CHECK(cfg.element == Format::E2M1, "{}: {}: MXFP4 elements are e2m1", what, d);
      QUADS_CHECK(cols % 32 == 0, "{}: {}: cols must be a multiple of 32, shape is [{}, {}]", what, d, rows, cols);
      break;
    case Scheme::FP8:
      QUADS_CHECK(cfg.block == Block::PerTensor || cfg.block == Block::PerRow || cfg.block == Block::B1x128 ||
                      cfg.block == Block::B128x128,
                  "{}: {}: FP8 scales are per-tensor, per-row, 1x128 or 128x128", what, d);
      QUADS_CHECK(cfg.element == Format::E4M3 || cfg.element == Format::E5M2,
                  "{}: {}: FP8 elements are e4m3 or e5m2", what, d);
      QUADS_CHECK(!cfg.stochastic, "{}: {}: stochastic rounding is for 4-bit elements only", what, d);
      break;
  }
}

QTensor quantize(const float* x, int64_t rows, int64_t cols, const QConfig& cfg) {
  QTensor q;
  quantize_into(q, x, rows, cols, cfg);
  return q;
}

void quantize_into(QTensor& q, const float* x, int64_t rows, int64_t cols, const QConfig& cfg) {
  check_config(cfg, rows, cols, "quantize");
  q.cfg = cfg;
  q.rows = rows;
  q.cols = cols;
  q.scales.clear();
  q.fscales.clear();
  q.amax.clear();
  switch (cfg.scheme) {
    case Scheme::NVFP4:
      q.codes.resize(rows * cols / 2);
      q.scales.resize(rows * cols / 16);
      nvfp4_driver(x, rows, cols, cfg, q.codes.data(), q.scales.data(), nullptr, &q.amax);
      break;
    case Scheme::MXFP4:
      q.codes.resize(rows * cols / 2);
      q.scales.resize(rows * cols / 32);
      mxfp4_driver(x, rows, cols, cfg, q.codes.data(), q.scales.data(), nullptr);
      break;
    case Scheme::FP8:
      q.codes.resize(rows * cols);
      fp8_driver(x, rows, cols, cfg, q.codes.data(), nullptr, &q.fscales);
      break;
  }
}

void fake_quantize(const float* x, float* out, int64_t rows, int64_t cols, const QConfig& cfg) {
  check_config(cfg, rows, cols, "fake_quantize");
  switch (cfg.scheme) {
    case Scheme::NVFP4: nvfp4_driver(x, rows, cols, cfg, nullptr, nullptr, out, nullptr); break;
    case Scheme::MXFP4: mxfp4_driver(x, rows, cols, cfg, nullptr, nullptr, out); break;
    case Scheme::FP8: fp8_driver(x, rows, cols, cfg, nullptr, out, nullptr); break;
  }
}

void dequantize_rows(const QTensor& q, int64_t r0, int64_t r1, float* out) {
  const QConfig& cfg = q.cfg;
  const int64_t cols = q.cols;
  QUADS_CHECK(0 <= r0 && r0 <= r1 && r1 <= q.rows, "dequantize_rows: rows [{}, {}) outside [0, {})", r0, r1, q.rows);
  const bool par = (r1 - r0) * cols >= kParallelMin;
  const Tables& t = tables();
  switch (cfg.scheme) {
    case Scheme::NVFP4: {
      QUADS_CHECK(q.amax.size() == (cfg.global == Global::PerRow ? static_cast<size_t>(q.rows) : 1u) &&
                      q.codes.size() == static_cast<size_t>(q.rows * cols / 2) &&
                      q.scales.size() == static_cast<size_t>(q.rows * cols / 16),
                  "dequantize: NVFP4 tensor [{}, {}] has inconsistent buffers", q.rows, cols);
      const Grid4& grid = grid_of(cfg.element);
      const int64_t nb = cols / 16;
#pragma omp parallel for schedule(dynamic, rows_per_task(cols)) if (par)
      for (int64_t r = r0; r < r1; ++r) {
        const Nvfp4Group g = nvfp4_group(q.amax[cfg.global == Global::PerRow ? r : 0], grid);
        const uint8_t* c = q.codes.data() + r * cols / 2;
        const uint8_t* s = q.scales.data() + r * nb;
        float* o = out + (r - r0) * cols;
#ifdef __AVX2__
        if (use_simd()) {
          nvfp4_dequant_avx2(c, s, nb, g, o);
          continue;
        }
#endif
        nvfp4_dequant_scalar(c, s, nb, g, o);
      }
      break;
    }
    case Scheme::MXFP4: {
      QUADS_CHECK(q.codes.size() == static_cast<size_t>(q.rows * cols / 2) &&
                      q.scales.size() == static_cast<size_t>(q.rows * cols / 32),
                  "dequantize: MXFP4 tensor [{}, {}] has inconsistent buffers", q.rows, cols);
#pragma omp parallel for schedule(dynamic, rows_per_task(cols)) if (par)
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = r * cols + c;
          const uint8_t code = (q.codes[i / 2] >> ((i & 1) * 4)) & 0xF;
          out[(r - r0) * cols + c] = grid4_decode(code, kGridE2M1) * t.ue8m0[q.scales[i / 32]];
        }
      break;
    }
    case Scheme::FP8: {
      const Fp8Grid G = fp8_grid(cfg, q.rows, cols);
      QUADS_CHECK(q.codes.size() == static_cast<size_t>(q.rows * cols) &&
                      q.fscales.size() == (cfg.block == Block::PerTensor ? 1u : static_cast<size_t>(G.nrb * G.ncb)),
                  "dequantize: FP8 tensor [{}, {}] has inconsistent buffers", q.rows, cols);
      const float* lut = cfg.element == Format::E4M3 ? t.e4m3 : t.e5m2;
#pragma omp parallel for schedule(dynamic, rows_per_task(cols)) if (par)
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float s = cfg.block == Block::PerTensor ? q.fscales[0] : q.fscales[(r / G.bh) * G.ncb + c / G.bw];
          out[(r - r0) * cols + c] = lut[q.codes[r * cols + c]] * s;
        }
      break;
    }
  }
}

void dequantize(const QTensor& q, float* out) { dequantize_rows(q, 0, q.rows, out); }

QTensor quantize_checked(const std::string& tensor_name, const float* x, int64_t rows, int64_t cols,
                         const QConfig& cfg) {
  check_config(cfg, rows, cols, "tensor '" + tensor_name + "'");
  check_finite(tensor_name, x, rows, cols);
  return quantize(x, rows, cols, cfg);
}

void fake_quantize_checked(const std::string& tensor_name, const float* x, float* out, int64_t rows,
                           int64_t cols, const QConfig& cfg) {
  check_config(cfg, rows, cols, "tensor '" + tensor_name + "'");
  check_finite(tensor_name, x, rows, cols);
  fake_quantize(x, out, rows, cols, cfg);
}

std::vector<uint8_t> swizzle_scales_128x4(const uint8_t* scales, int64_t rows, int64_t nblocks) {
  const int64_t pr = (rows + 127) / 128 * 128, pk = (nblocks + 3) / 4 * 4, kt = pk / 4;
  std::vector<uint8_t> out(pr * pk, 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t kb = 0; kb < nblocks; ++kb)
      out[((m / 128) * kt + kb / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + kb % 4] = scales[m * nblocks + kb];
  return out;
}

std::vector<uint8_t> unswizzle_scales_128x4(const uint8_t* swizzled, int64_t rows, int64_t nblocks) {
  const int64_t kt = (nblocks + 3) / 4;
  std::vector<uint8_t> out(rows * nblocks);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t kb = 0; kb < nblocks; ++kb)
      out[m * nblocks + kb] = swizzled[((m / 128) * kt + kb / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + kb % 4];
  return out;
}

float nvfp4_global_encode_scale(float amax, Format element) {
  QUADS_CHECK(element == Format::E2M1 || element == Format::E1M2, "nvfp4 global scale: element must be e2m1 or e1m2");
  return nvfp4_group(amax, grid_of(element)).s_enc;
}
float nvfp4_global_decode_scale(float amax, Format element) {
  QUADS_CHECK(element == Format::E2M1 || element == Format::E1M2, "nvfp4 global scale: element must be e2m1 or e1m2");
  return nvfp4_group(amax, grid_of(element)).s_dec;
}

ErrorStats error_stats(const float* x, const float* xq, int64_t rows, int64_t cols, bool per_channel) {
  // Per-row partial sums in double, added in row order: the same bits for any thread count.
  std::vector<double> row_err(rows), row_norm(rows), row_max(rows);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    double e = 0, s = 0, m = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double xv = x[r * cols + c], d = xv - static_cast<double>(xq[r * cols + c]);
      e += d * d;
      s += xv * xv;
      m = std::max(m, std::fabs(d));
    }
    row_err[r] = e;
    row_norm[r] = s;
    row_max[r] = m;
  }
  ErrorStats st;
  double err = 0, norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    err += row_err[r];
    norm += row_norm[r];
    st.max_abs = std::max(st.max_abs, row_max[r]);
  }
  st.sq_err = err;
  st.sq_norm = norm;
  const double inf = std::numeric_limits<double>::infinity();
  st.rel_mse = norm > 0 ? err / norm : (err > 0 ? inf : 0.0);
  st.sqnr_db = st.rel_mse > 0 ? -10.0 * std::log10(st.rel_mse) : inf;
  if (per_channel) {
    st.channel_sq_err.assign(cols, 0.0);
    st.channel_sq_norm.assign(cols, 0.0);
    // Each column sums over rows in order; columns are split across threads.
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      const int64_t c1 = std::min(cols, c0 + 64);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const double xv = x[r * cols + c], d = xv - static_cast<double>(xq[r * cols + c]);
          st.channel_sq_err[c] += d * d;
          st.channel_sq_norm[c] += xv * xv;
        }
    }
  }
  return st;
}

ErrorStats quant_error(const float* x, int64_t rows, int64_t cols, const QConfig& cfg, bool per_channel) {
  std::vector<float> xq(rows * cols);
  fake_quantize(x, xq.data(), rows, cols, cfg);
  return error_stats(x, xq.data(), rows, cols, per_channel);
}

bool simd_available() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

void set_simd_enabled(bool on) { g_simd.store(on, std::memory_order_relaxed); }

}  // namespace quads::num
