// The quantization path: golden NVFP4 vectors from an independent implementation, the fast
// kernels (AVX2 and portable) against the literal reference over every scheme, fake_quantize
// against dequantize(quantize()), stochastic rounding statistics, MXFP4 and FP8 rules, the
// swizzled scale layout, NaN/Inf behaviour, errors and error statistics.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fixtures.h"
#include "io/safetensors.h"
#include "numerics/quantize.h"
#include "numerics/reference.h"

using namespace quads::num;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// Bitwise equality where any two NaNs count as equal (NaN payloads are not specified).
bool same(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}
::testing::AssertionResult same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (!same(a[i], b[i]))
      return ::testing::AssertionFailure() << "at " << i << ": " << a[i] << " (0x" << std::hex
                                           << std::bit_cast<uint32_t>(a[i]) << ") vs " << b[i] << " (0x"
                                           << std::bit_cast<uint32_t>(b[i]) << ")";
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult same_qtensor(const QTensor& a, const QTensor& b) {
  if (a.codes != b.codes) return ::testing::AssertionFailure() << "codes differ";
  if (a.scales != b.scales) return ::testing::AssertionFailure() << "scales differ";
  if (auto r = same_floats(a.fscales, b.fscales); !r) return r << " (fscales)";
  if (auto r = same_floats(a.amax, b.amax); !r) return r << " (amax)";
  return ::testing::AssertionSuccess();
}

std::vector<float> dq(const QTensor& q) {
  std::vector<float> out(q.rows * q.cols);
  dequantize(q, out.data());
  return out;
}
std::vector<float> ref_dq(const QTensor& q) {
  std::vector<float> out(q.rows * q.cols);
  ref::dequantize(q, out.data());
  return out;
}
std::vector<float> fq(const std::vector<float>& x, int64_t rows, int64_t cols, const QConfig& cfg) {
  std::vector<float> out(rows * cols);
  fake_quantize(x.data(), out.data(), rows, cols, cfg);
  return out;
}

// Rough data with the cases that matter: a spread of row magnitudes, outliers, zero blocks,
// -0, blocks tiny enough for their scales to underflow, exact grid midpoints, huge values.
std::vector<float> make_data(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, 99);
  const float mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::exp(2.f * n01(rng));
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int kind = pick(rng);
      for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c) {
        float v = n01(rng) * row_scale;
        if (kind < 3) v = 0.f;
        else if (kind < 5) v = n01(rng) * 1e-30f;
        else if (kind < 8) v = mids[pick(rng) % 7] * ((pick(rng) & 1) ? 1.f : -1.f);
        else if (kind < 9) v = n01(rng) * 1e-41f;  // float subnormals
        const int e = pick(rng);
        if (e == 0) v *= 100.f;
        if (e == 1) v = -0.f;
        x[r * cols + c] = v;
      }
    }
  }
  if (rows * cols > 3 && seed % 5 == 0) x[(seed * 7) % (rows * cols)] = 3e37f;
  return x;
}

// Every valid combination of scheme / block / global / element / rounding.
std::vector<QConfig> all_configs() {
  std::vector<QConfig> out;
  for (Block b : {Block::B1x16, Block::B16x16})
    for (Global g : {Global::PerTensor, Global::PerRow, Global::Static})
      for (Format el : {Format::E2M1, Format::E1M2})
        for (bool sr : {false, true}) {
          if (b == Block::B16x16 && g == Global::PerRow) continue;
          QConfig c = QConfig::nvfp4_weight(b == Block::B16x16);
          c.global = g;
          c.static_amax = 3.f;
          c.element = el;
          c.stochastic = sr;
          c.seed = 11;
          out.push_back(c);
        }
  for (MxRule rule : {MxRule::OcpFloor, MxRule::TeCeil})
    for (bool sr : {false, true}) {
      QConfig c = QConfig::mxfp4();
      c.mx_rule = rule;
      c.stochastic = sr;
      c.seed = 5;
      out.push_back(c);
    }
  for (Block b : {Block::PerTensor, Block::PerRow, Block::B1x128, Block::B128x128})
    for (Format el : {Format::E4M3, Format::E5M2}) {
      QConfig c = QConfig::fp8(b);
      c.element = el;
      out.push_back(c);
    }
  return out;
}

struct SimdGuard {
  ~SimdGuard() { set_simd_enabled(true); }
};

// quantize (both kernel families) == reference, dequantize == reference, fake == dequant(quant),
// in place too.
void check_against_reference(const std::vector<float>& x, int64_t rows, int64_t cols, const QConfig& cfg) {
  SCOPED_TRACE(cfg.describe() + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  SimdGuard guard;
  const QTensor want = ref::quantize(x.data(), rows, cols, cfg);
  const std::vector<float> want_dq = ref_dq(want);
  for (bool simd : {true, false}) {
    SCOPED_TRACE(simd ? "simd" : "scalar");
    set_simd_enabled(simd);
    const QTensor q = quantize(x.data(), rows, cols, cfg);
    ASSERT_TRUE(same_qtensor(q, want));
    const std::vector<float> d = dq(q);
    ASSERT_TRUE(same_floats(d, want_dq));
    ASSERT_TRUE(same_floats(fq(x, rows, cols, cfg), d));
    std::vector<float> inplace = x;
    fake_quantize(inplace.data(), inplace.data(), rows, cols, cfg);
    ASSERT_TRUE(same_floats(inplace, d));
  }
}

std::string golden_path() { return quads::fixtures_dir() + "/nvfp4/golden.safetensors"; }

template <typename T>
std::vector<T> golden(const quads::io::SafeTensorsFile& f, const std::string& name) {
  const auto& t = f.at(name);
  std::vector<T> v(t.nbytes / sizeof(T));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

}  // namespace

// ---- golden vectors (TransformerEngine's formula computed independently) ----

TEST(QuantizeGolden, Nvfp4Cases) {
  const auto f = quads::io::SafeTensorsFile::open(golden_path());
  SimdGuard guard;
  for (const std::string c : {"case0", "case1"}) {
    SCOPED_TRACE(c);
    const auto& in = f->at(c + ".input");
    const int64_t rows = in.shape[0], cols = in.shape[1];
    const std::vector<float> x = golden<float>(*f, c + ".input");
    const auto packed = golden<uint8_t>(*f, c + ".packed");
    const auto scales = golden<uint8_t>(*f, c + ".scales");
    const auto swz = golden<uint8_t>(*f, c + ".scales_swizzled");
    const auto amax = golden<float>(*f, c + ".amax");
    const auto deq = golden<float>(*f, c + ".dequant");
    for (bool simd : {true, false}) {
      set_simd_enabled(simd);
      const QTensor q = quantize(x.data(), rows, cols, QConfig::nvfp4_act());
      EXPECT_EQ(q.codes, packed);
      EXPECT_EQ(q.scales, scales);
      ASSERT_EQ(q.amax.size(), 1u);
      EXPECT_EQ(std::bit_cast<uint32_t>(q.amax[0]), std::bit_cast<uint32_t>(amax[0]));
      EXPECT_EQ(swizzle_scales_128x4(q.scales.data(), rows, cols / 16), swz);
      EXPECT_EQ(unswizzle_scales_128x4(swz.data(), rows, cols / 16), scales);
      EXPECT_TRUE(same_floats(dq(q), deq));
      EXPECT_TRUE(same_floats(fq(x, rows, cols, QConfig::nvfp4_act()), deq));
    }
    const QTensor r = ref::quantize(x.data(), rows, cols, QConfig::nvfp4_act());
    EXPECT_EQ(r.codes, packed);
    EXPECT_EQ(r.scales, scales);
    EXPECT_TRUE(same_floats(ref_dq(r), deq));
  }
  // The 2-D (16x16 tile) variant used for weights.
  const std::vector<float> x = golden<float>(*f, "case1.input");
  const int64_t rows = f->at("case1.input").shape[0], cols = f->at("case1.input").shape[1];
  for (bool simd : {true, false}) {
    set_simd_enabled(simd);
    const QConfig cfg = QConfig::nvfp4_weight(true);
    const QTensor q = quantize(x.data(), rows, cols, cfg);
    EXPECT_EQ(q.codes, golden<uint8_t>(*f, "case1.packed_2d"));
    EXPECT_EQ(q.scales, golden<uint8_t>(*f, "case1.scales_2d"));
    EXPECT_TRUE(same_floats(dq(q), golden<float>(*f, "case1.dequant_2d")));
    EXPECT_TRUE(same_floats(fq(x, rows, cols, cfg), golden<float>(*f, "case1.dequant_2d")));
  }
  const QTensor r = ref::quantize(x.data(), rows, cols, QConfig::nvfp4_weight(true));
  EXPECT_EQ(r.codes, golden<uint8_t>(*f, "case1.packed_2d"));
  EXPECT_TRUE(same_floats(ref_dq(r), golden<float>(*f, "case1.dequant_2d")));
}

// ---- fast kernels == reference, fake == dequant(quant) ----

TEST(Quantize, FastMatchesReferenceEveryConfig) {
  std::mt19937 rng(2024);
  int n = 0;
  for (const QConfig& cfg : all_configs()) {
    for (int trial = 0; trial < 4; ++trial) {
      int64_t rows = 1 + rng() % 40, cols;
      if (cfg.scheme == Scheme::NVFP4) cols = 16 * (1 + rng() % 24);
      else if (cfg.scheme == Scheme::MXFP4) cols = 32 * (1 + rng() % 12);
      else cols = 1 + rng() % 300;
      if (cfg.block == Block::B16x16) rows = 16 * (1 + rng() % 3);
      if (trial == 0) rows = std::min<int64_t>(rows, 16);  // also small shapes
      check_against_reference(make_data(rows, cols, 100 * n + trial), rows, cols, cfg);
      if (HasFatalFailure()) return;
    }
    ++n;
  }
}

// Scales: with a static amax of 448, S_enc * (1/6) rounds to exactly 1, so a block's scale is
// e4m3(block amax): blocks whose amax sits on every E4M3 code, midpoint and neighbour drive the
// vector E4M3 rounding through every case, subnormal scales included.
TEST(Quantize, Nvfp4EveryScaleCode) {
  std::vector<float> amaxes;
  for (int c = 0; c < 126; ++c) {
    const float lo = e4m3_to_f32(static_cast<uint8_t>(c)), hi = e4m3_to_f32(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    for (float v : {lo, mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) amaxes.push_back(v);
  }
  for (float v : {448.f, 460.f, 464.f, 1e6f, 1e-5f}) amaxes.push_back(v);
  const int64_t cols = 16 * 8, rows = (static_cast<int64_t>(amaxes.size()) + 7) / 8;
  std::vector<float> x(rows * cols, 0.f);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (size_t b = 0; b < amaxes.size(); ++b) {
    for (int i = 0; i < 16; ++i) x[16 * b + i] = amaxes[b] * u(rng);
    x[16 * b + (b % 16)] = (b & 1) ? -amaxes[b] : amaxes[b];
  }
  QConfig cfg;
  cfg.global = Global::Static;
  cfg.static_amax = 448.f;
  const QTensor q = quantize(x.data(), rows, cols, cfg);
  for (size_t b = 0; b < amaxes.size(); ++b) ASSERT_EQ(q.scales[b], e4m3_from_f32(amaxes[b])) << amaxes[b];
  check_against_reference(x, rows, cols, cfg);
}

// Element rounding through the vector kernels, densely: with a static amax of 448 and a block
// holding the grid max G, the block scale is G and enc is exactly 1, so every other element is
// rounded on the grid itself and must get the codec's code. Likewise MXFP4 with a block amax of
// 4 (scale 2^0). Probes: a stride over all floats up to the saturation range, every midpoint
// and its float neighbours, both signs.
TEST(Quantize, ElementRoundingSweep) {
  SimdGuard guard;
  struct Case { QConfig cfg; float top, range; uint8_t (*enc)(float); float (*dec)(uint8_t); };
  QConfig e2m1, e1m2;
  e2m1.global = e1m2.global = Global::Static;
  e2m1.static_amax = e1m2.static_amax = 448.f;
  e1m2.element = Format::E1M2;
  for (const Case& k : {Case{e2m1, 6.f, 6.f, e2m1_from_f32, e2m1_to_f32}, Case{e1m2, 3.5f, 3.5f, e1m2_from_f32, e1m2_to_f32},
                        Case{QConfig::mxfp4(), 4.f, std::nextafter(8.f, 0.f), e2m1_from_f32, e2m1_to_f32}}) {
    SCOPED_TRACE(k.cfg.describe());
    std::vector<float> probes;
    for (uint32_t u = 0; u <= std::bit_cast<uint32_t>(k.range); u += 1009) probes.push_back(std::bit_cast<float>(u));
    for (int c = 0; c < 7; ++c) {
      const float mid = (k.dec(static_cast<uint8_t>(c)) + k.dec(static_cast<uint8_t>(c + 1))) / 2;
      for (float v : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 9.f)}) probes.push_back(v);
    }
    const int bw = k.cfg.scheme == Scheme::MXFP4 ? 32 : 16;
    const int per_block = bw - 1;
    const int64_t nblk = (2 * static_cast<int64_t>(probes.size()) + per_block - 1) / per_block;
    const int64_t cols = 16 * bw, rows = (nblk + 15) / 16;
    std::vector<float> x(rows * cols, 0.f);
    std::vector<int64_t> where;  // index in x of probe i (positive, then negative)
    for (int64_t b = 0, p = 0; b < rows * cols / bw; ++b) {
      x[b * bw] = (b & 1) ? -k.top : k.top;
      for (int i = 1; i < bw && p < 2 * static_cast<int64_t>(probes.size()); ++i, ++p) {
        const float v = probes[p % probes.size()];
        x[b * bw + i] = p < static_cast<int64_t>(probes.size()) ? v : -v;
        where.push_back(b * bw + i);
      }
    }
    for (bool simd : {true, false}) {
      set_simd_enabled(simd);
      const QTensor q = quantize(x.data(), rows, cols, k.cfg);
      for (int64_t b = 0; b < rows * cols / bw; ++b) ASSERT_EQ(q.scales[b], k.cfg.scheme == Scheme::MXFP4 ? 127 : e4m3_from_f32(k.top));
      for (int64_t i : where) {
        const uint8_t code = (q.codes[i / 2] >> (4 * (i % 2))) & 0xF;
        ASSERT_EQ(code, k.enc(x[i])) << x[i] << (simd ? " simd" : " scalar");
      }
      ASSERT_TRUE(same_floats(fq(x, rows, cols, k.cfg), dq(q)));
    }
  }
}

TEST(Quantize, ThreadCountDoesNotChangeResults) {
  // Large enough for the parallel paths (and for several chunks per thread).
  const int64_t rows = 256, cols = 1024;
  const std::vector<float> x = make_data(rows, cols, 77);
  const int saved = omp_get_max_threads();
  for (const QConfig& cfg : all_configs()) {
    SCOPED_TRACE(cfg.describe());
    omp_set_num_threads(1);
    const QTensor q1 = quantize(x.data(), rows, cols, cfg);
    const std::vector<float> f1 = fq(x, rows, cols, cfg);
    omp_set_num_threads(3);
    const QTensor q3 = quantize(x.data(), rows, cols, cfg);
    EXPECT_TRUE(same_qtensor(q1, q3));
    EXPECT_TRUE(same_floats(f1, fq(x, rows, cols, cfg)));
    EXPECT_TRUE(same_floats(f1, dq(q3)));
  }
  // One large config against the reference too (the parallel drivers' chunking).
  check_against_reference(x, rows, cols, QConfig::nvfp4_act());
  check_against_reference(x, rows, cols, QConfig::nvfp4_weight(true));
  std::vector<float> xq = fq(x, rows, cols, QConfig::nvfp4_act());
  omp_set_num_threads(1);
  const ErrorStats s1 = error_stats(x.data(), xq.data(), rows, cols, true);
  omp_set_num_threads(3);
  const ErrorStats s3 = error_stats(x.data(), xq.data(), rows, cols, true);
  omp_set_num_threads(saved);
  EXPECT_EQ(std::bit_cast<uint64_t>(s1.rel_mse), std::bit_cast<uint64_t>(s3.rel_mse));
  EXPECT_EQ(s1.channel_sq_err, s3.channel_sq_err);
}

// ---- NVFP4 properties ----

TEST(Quantize, Nvfp4BlockMaxLandsOnGridTop) {
  // The element holding the global amax maps to the top code (6 for E2M1, 3.5 for E1M2) and
  // dequantizes back to (almost exactly) itself.
  for (Format el : {Format::E2M1, Format::E1M2}) {
    std::vector<float> x(64);
    for (int i = 0; i < 64; ++i) x[i] = 0.01f * (i - 30);
    x[37] = -2.75f;
    QConfig cfg;
    cfg.element = el;
    const QTensor q = quantize(x.data(), 1, 64, cfg);
    EXPECT_EQ((q.codes[18] >> 4) & 0xF, 0xF);  // element 37: -max
    EXPECT_NEAR(dq(q)[37], -2.75f, 1e-6f);
  }
}

TEST(Quantize, Nvfp4PerRowGlobalIsBatchInvariant) {
  // Per-token global scales: a row quantizes the same alone or beside any other rows.
  const int64_t cols = 256;
  const std::vector<float> x = make_data(8, cols, 3);
  QConfig cfg = QConfig::nvfp4_act();
  cfg.global = Global::PerRow;
  const std::vector<float> all = fq(x, 8, cols, cfg);
  for (int64_t r = 0; r < 8; ++r) {
    const std::vector<float> row(x.begin() + r * cols, x.begin() + (r + 1) * cols);
    const std::vector<float> alone = fq(row, 1, cols, cfg);
    EXPECT_TRUE(same_floats(alone, std::vector<float>(all.begin() + r * cols, all.begin() + (r + 1) * cols)));
  }
  // A per-tensor global does depend on the batch (this is why rollouts use per-row).
  QConfig pt = QConfig::nvfp4_act();
  const std::vector<float> all_pt = fq(x, 8, cols, pt);
  int differ = 0;
  for (int64_t r = 0; r < 8; ++r) {
    const std::vector<float> row(x.begin() + r * cols, x.begin() + (r + 1) * cols);
    differ += !same_floats(fq(row, 1, cols, pt), std::vector<float>(all_pt.begin() + r * cols, all_pt.begin() + (r + 1) * cols));
  }
  EXPECT_GT(differ, 0);
}

TEST(Quantize, Nvfp4GlobalScales) {
  EXPECT_EQ(nvfp4_global_encode_scale(2688.f), 1.f);
  EXPECT_EQ(nvfp4_global_decode_scale(2688.f), 1.f);
  EXPECT_EQ(nvfp4_global_encode_scale(0.f), 1.f);
  EXPECT_EQ(nvfp4_global_encode_scale(1e-45f), std::numeric_limits<float>::max());
  EXPECT_EQ(nvfp4_global_encode_scale(1568.f, Format::E1M2), 1.f);
  EXPECT_EQ(nvfp4_global_encode_scale(1.f), 2688.f);
  EXPECT_EQ(nvfp4_global_decode_scale(1.f), 1.f / 2688.f);
}

// ---- NaN / Inf ----

TEST(Quantize, NanPoisonsItsGroup) {
  const int64_t rows = 4, cols = 64;
  std::vector<float> x = make_data(rows, cols, 9);
  x[1 * cols + 20] = kNaN;
  SimdGuard guard;
  for (bool simd : {true, false}) {
    set_simd_enabled(simd);
    // Per-row NVFP4: row 1 is all NaN with NaN scales, the other rows are untouched.
    QConfig row = QConfig::nvfp4_act();
    row.global = Global::PerRow;
    const QTensor q = quantize(x.data(), rows, cols, row);
    const std::vector<float> d = dq(q);
    for (int64_t c = 0; c < cols; ++c) EXPECT_TRUE(std::isnan(d[cols + c]));
    for (int b = 0; b < 4; ++b) EXPECT_EQ(q.scales[4 + b], 0x7F);
    for (int64_t c = 0; c < cols; ++c) EXPECT_TRUE(std::isfinite(d[c]) && std::isfinite(d[2 * cols + c]));
    EXPECT_TRUE(same_floats(fq(x, rows, cols, row), d));
    // Per-tensor: everything NaN.
    for (float v : dq(quantize(x.data(), rows, cols, QConfig::nvfp4_act()))) EXPECT_TRUE(std::isnan(v));
    // MXFP4: only the block holding the NaN.
    const QTensor m = quantize(x.data(), rows, cols, QConfig::mxfp4());
    EXPECT_EQ(m.scales[2], 0xFF);
    const std::vector<float> md = dq(m);
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(std::isnan(md[cols + c]), c < 32) << c;
    // FP8 per row: the row.
    const std::vector<float> f8 = fq(x, rows, cols, QConfig::fp8(Block::PerRow));
    for (int64_t c = 0; c < cols; ++c) EXPECT_TRUE(std::isnan(f8[cols + c]));
    EXPECT_TRUE(std::isfinite(f8[0]));
  }
}

TEST(Quantize, InfMatchesReference) {
  const int64_t rows = 16, cols = 128;
  std::vector<float> x = make_data(rows, cols, 10);
  x[2 * cols + 70] = -kInf;
  for (const QConfig& cfg : all_configs()) check_against_reference(x, rows, cols, cfg);
}

TEST(Quantize, CheckedApiNamesTensorAndElement) {
  std::vector<float> x(4 * 32, 1.f);
  x[2 * 32 + 5] = kNaN;
  try {
    quantize_checked("layers.3.mlp.up", x.data(), 4, 32, QConfig::nvfp4_act());
    FAIL() << "no error";
  } catch (const quads::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layers.3.mlp.up"), std::string::npos) << m;
    EXPECT_NE(m.find("row 2, column 5"), std::string::npos) << m;
  }
  x[2 * 32 + 5] = kInf;
  std::vector<float> out(x.size());
  EXPECT_THROW(fake_quantize_checked("acts", x.data(), out.data(), 4, 32, QConfig::fp8(Block::PerRow)), quads::Error);
  x[2 * 32 + 5] = 1.f;
  try {
    quantize_checked("w", x.data(), 4, 24, QConfig::nvfp4_act());
    FAIL() << "no error";
  } catch (const quads::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(quantize_checked("w", x.data(), 4, 32, QConfig::nvfp4_act()));
}

TEST(Quantize, BadConfigsAreErrors) {
  std::vector<float> x(32 * 64, 1.f), out(x.size());
  QConfig c = QConfig::nvfp4_weight(true);
  EXPECT_THROW(quantize(x.data(), 8, 64, c), quads::Error);  // rows % 16
  c.global = Global::PerRow;
  EXPECT_THROW(quantize(x.data(), 32, 64, c), quads::Error);  // 16x16 needs one global
  EXPECT_THROW(quantize(x.data(), 2, 48, QConfig::mxfp4()), quads::Error);
  QConfig f = QConfig::fp8(Block::PerRow);
  f.stochastic = true;
  EXPECT_THROW(fake_quantize(x.data(), out.data(), 2, 64, f), quads::Error);
  QConfig s;
  s.global = Global::Static;
  s.static_amax = -1.f;
  EXPECT_THROW(quantize(x.data(), 2, 64, s), quads::Error);
  QConfig mixed = QConfig::nvfp4_act();
  mixed.block = Block::B1x32;
  EXPECT_THROW(quantize(x.data(), 2, 64, mixed), quads::Error);
  EXPECT_NO_THROW(quantize(x.data(), 0, 64, QConfig::nvfp4_act()));
}

TEST(Quantize, ParseNames) {
  const char* names[] = {"nvfp4", "nvfp4-row", "nvfp4-2d", "nvfp4-e1m2", "nvfp4-kv", "mxfp4",
                         "mxfp4-te", "fp8", "fp8-row", "fp8-1x128", "fp8-128x128", "fp8-e5m2"};
  std::vector<std::string> seen;
  for (const char* n : names) {
    const QConfig c = QConfig::parse(n);
    EXPECT_NO_THROW(check_config(c, 128, 256));
    const std::string d = c.describe();
    EXPECT_EQ(std::count(seen.begin(), seen.end(), d), 0) << n << " -> " << d;
    seen.push_back(d);
  }
  EXPECT_EQ(QConfig::parse("nvfp4-kv").element, Format::E1M2);
  EXPECT_THROW(QConfig::parse("int4"), quads::Error);
}

// ---- stochastic rounding ----

TEST(Quantize, StochasticRoundingIsUnbiasedAndSeeded) {
  // Static amax 448: a block holding 6 gets sf = 6 and enc = 1, so elements are rounded on the
  // E2M1 grid itself and dequantize with d = 2688 * fp32(1/2688).
  const int64_t rows = 4096, cols = 16;
  const float d = 2688.f * (1.f / 2688.f);
  for (float v : {0.1f, 0.7f, 1.3f, 2.3f, 3.9f, 4.9f}) {
    std::vector<float> x(rows * cols, v);
    for (int64_t r = 0; r < rows; ++r) x[r * cols] = 6.f;
    QConfig cfg;
    cfg.global = Global::Static;
    cfg.static_amax = 448.f;
    cfg.stochastic = true;
    cfg.seed = 123;
    const std::vector<float> y = fq(x, rows, cols, cfg);
    // Neighbours of v on the grid.
    const float grid[] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    int k = 0;
    while (grid[k + 1] <= v) ++k;
    const double lo = grid[k] * d, hi = grid[k + 1] * d;
    double sum = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 1; c < cols; ++c, ++n) {
        const float q = y[r * cols + c];
        ASSERT_TRUE(q == static_cast<float>(lo) || q == static_cast<float>(hi)) << q;
        sum += q;
      }
    const double p = (v - grid[k]) / (grid[k + 1] - grid[k]);
    const double stderr_ = (hi - lo) * std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(sum / n, v * d, 4 * stderr_) << v;
    // Deterministic for a seed, different for another.
    EXPECT_TRUE(same_floats(fq(x, rows, cols, cfg), y));
    cfg.seed = 124;
    EXPECT_FALSE(same_floats(fq(x, rows, cols, cfg), y));
    // Round to nearest gives the same value every time: biased unless v is on the grid.
    cfg.stochastic = false;
    const float rne = fq(x, rows, cols, cfg)[1];
    EXPECT_TRUE(rne == static_cast<float>(lo) || rne == static_cast<float>(hi));
  }
}

TEST(Quantize, MxStochasticRoundingIsUnbiased) {
  const int64_t rows = 2048, cols = 32;
  const float v = 0.37f;  // with amax 1 (OCP: X = 2^-2): v / X = 1.48, between 1 and 1.5
  std::vector<float> x(rows * cols, v);
  for (int64_t r = 0; r < rows; ++r) x[r * cols] = 1.f;
  QConfig cfg = QConfig::mxfp4();
  cfg.stochastic = true;
  cfg.seed = 99;
  const std::vector<float> y = fq(x, rows, cols, cfg);
  double sum = 0;
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 1; c < cols; ++c, ++n) {
      ASSERT_TRUE(y[r * cols + c] == 0.25f || y[r * cols + c] == 0.375f) << y[r * cols + c];
      sum += y[r * cols + c];
    }
  const double p = (v / 0.25 - 1.0) / 0.5;
  EXPECT_NEAR(sum / n, v, 4 * 0.125 * std::sqrt(p * (1 - p) / n));
}

// ---- MXFP4 ----

TEST(Quantize, MxfpScaleRules) {
  std::vector<float> x(64, 0.f);
  x[0] = 7.f;  // block 0: amax 7
  x[1] = 3.f;
  x[40] = 0.75f;  // block 1: amax 0.75
  QConfig ocp = QConfig::mxfp4();
  const QTensor a = quantize(x.data(), 1, 64, ocp);
  // OCP: floor(log2 7) - 2 = 0, X = 1: 7 saturates to 6.
  EXPECT_EQ(a.scales[0], 127);
  EXPECT_EQ(a.codes[0], 0x57);  // 6 | 3 << 4
  // floor(log2 0.75) - 2 = -3.
  EXPECT_EQ(a.scales[1], 124);
  EXPECT_EQ(dq(a)[40], 0.75f);
  QConfig te = ocp;
  te.mx_rule = MxRule::TeCeil;
  const QTensor b = quantize(x.data(), 1, 64, te);
  // TE: ceil(log2(7/6)) = 1, X = 2: 7/2 = 3.5 ties to 4 (even), 3/2 = 1.5.
  EXPECT_EQ(b.scales[0], 128);
  EXPECT_EQ(dq(b)[0], 8.f);
  EXPECT_EQ(dq(b)[1], 3.f);
  // ceil(log2(0.125)) = -3.
  EXPECT_EQ(b.scales[1], 124);
  // All-zero block: scale 2^-127, zeros.
  std::vector<float> z(32, 0.f);
  EXPECT_EQ(quantize(z.data(), 1, 32, ocp).scales[0], 0);
}

// ---- FP8 ----

TEST(Quantize, Fp8ScaleLayoutsAndAmax) {
  const int64_t rows = 130, cols = 200;  // ragged against 128
  const std::vector<float> x = make_data(rows, cols, 4);
  struct L { Block b; size_t n; };
  for (L l : {L{Block::PerTensor, 1}, L{Block::PerRow, 130}, L{Block::B1x128, 260}, L{Block::B128x128, 4}}) {
    const QTensor q = quantize(x.data(), rows, cols, QConfig::fp8(l.b));
    ASSERT_EQ(q.fscales.size(), l.n);
    // Each group's largest element maps to exactly +-448 (code 0x7E / 0xFE).
    for (size_t g = 0; g < l.n; ++g) EXPECT_GT(q.fscales[g], 0.f);
  }
  const QTensor q = quantize(x.data(), rows, cols, QConfig::fp8(Block::PerRow));
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = 0;
    for (int64_t c = 0; c < cols; ++c)
      if (std::fabs(x[r * cols + c]) > std::fabs(x[r * cols + at])) at = c;
    if (x[r * cols + at] != 0.f) {
      EXPECT_EQ(q.codes[r * cols + at] & 0x7F, 0x7E) << r;
    }
  }
}

// The choice of x / scale over x * (1 / scale): the two differ on some inputs, and the
// quantizer follows the division.
TEST(Quantize, Fp8DividesByTheScale) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> ua(0.5f, 1000.f);
  int found = 0;
  for (int trial = 0; trial < 200000 && found < 5; ++trial) {
    const float amax = ua(rng);
    const float s = amax / 448.f;
    // A value near an E4M3 midpoint (times the scale), where one rounding more can matter.
    const int c = 8 + static_cast<int>(rng() % 110);
    const float mid = (e4m3_to_f32(static_cast<uint8_t>(c)) + e4m3_to_f32(static_cast<uint8_t>(c + 1))) / 2;
    float x = mid * s;
    for (int k = 0; k < 3 && std::fabs(x) <= amax; ++k, x = std::nextafter(x, 1e9f)) {
      if (e4m3_from_f32(x / s) == e4m3_from_f32(x * (1.f / s))) continue;
      std::vector<float> v = {amax, x};
      const QTensor q = quantize(v.data(), 1, 2, QConfig::fp8(Block::PerTensor));
      ASSERT_EQ(q.fscales[0], s);
      EXPECT_EQ(q.codes[1], e4m3_from_f32(x / s));
      EXPECT_NE(q.codes[1], e4m3_from_f32(x * (1.f / s)));
      ++found;
    }
  }
  EXPECT_GT(found, 0);
}

// ---- swizzled scales ----

TEST(Quantize, SwizzleLayout) {
  const int64_t rows = 200, nb = 6;  // pads to 256 x 8
  std::vector<uint8_t> s(rows * nb);
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<uint8_t>(1 + i % 251);
  const std::vector<uint8_t> w = swizzle_scales_128x4(s.data(), rows, nb);
  ASSERT_EQ(w.size(), 256u * 8u);
  EXPECT_EQ(unswizzle_scales_128x4(w.data(), rows, nb), s);
  // Padding is zero and every real scale appears once: count nonzeros.
  EXPECT_EQ(std::count_if(w.begin(), w.end(), [](uint8_t b) { return b != 0; }), rows * nb);
  // Row 0's four first blocks are the first 4 bytes; row 32 starts the next 4-byte column.
  EXPECT_EQ(w[0], s[0]);
  EXPECT_EQ(w[3], s[3]);
  EXPECT_EQ(w[4], s[32 * nb]);
  EXPECT_EQ(w[16], s[1 * nb]);
  EXPECT_EQ(w[512], s[4]);  // blocks 4..7 of rows 0..127 follow the first 512 bytes
  EXPECT_EQ(w[1024], s[128 * nb]);
}

// ---- error statistics ----

TEST(Quantize, ErrorStats) {
  const std::vector<float> x = {1, 2, 3, 4}, q = {1, 2, 3, 5};
  const ErrorStats s = error_stats(x.data(), q.data(), 2, 2, true);
  EXPECT_DOUBLE_EQ(s.rel_mse, 1.0 / 30.0);
  EXPECT_DOUBLE_EQ(s.sqnr_db, 10.0 * std::log10(30.0));
  EXPECT_EQ(s.max_abs, 1.0);
  EXPECT_EQ(s.channel_sq_err, (std::vector<double>{0.0, 1.0}));
  EXPECT_EQ(s.channel_sq_norm, (std::vector<double>{10.0, 20.0}));
  const ErrorStats exact = error_stats(x.data(), x.data(), 2, 2);
  EXPECT_EQ(exact.rel_mse, 0.0);
  EXPECT_TRUE(std::isinf(exact.sqnr_db));
  // NVFP4 on Gaussian data lands in a plausible SQNR band, and a channel with 30x outliers
  // ranks first by error.
  const int64_t rows = 64, cols = 256;
  std::mt19937 rng(8);
  std::normal_distribution<float> n01;
  std::vector<float> g(rows * cols);
  for (auto& v : g) v = n01(rng);
  for (int64_t r = 0; r < rows; ++r) g[r * cols + 77] *= 30.f;
  const ErrorStats e = quant_error(g.data(), rows, cols, QConfig::nvfp4_act(), true);
  EXPECT_GT(e.sqnr_db, 10.0);
  EXPECT_LT(e.sqnr_db, 30.0);
  EXPECT_EQ(std::max_element(e.channel_sq_err.begin(), e.channel_sq_err.end()) - e.channel_sq_err.begin(), 77);
  // FP8 is far more accurate than NVFP4 on the same data.
  EXPECT_GT(quant_error(g.data(), rows, cols, QConfig::fp8(Block::PerRow)).sqnr_db, e.sqnr_db + 8);
}

TEST(Quantize, DequantizeRows) {
  const int64_t rows = 40, cols = 64;
  const std::vector<float> x = make_data(rows, cols, 12);
  for (const char* name : {"nvfp4-row", "mxfp4", "fp8-1x128"}) {
    const QTensor q = quantize(x.data(), rows, cols, QConfig::parse(name));
    const std::vector<float> all = dq(q);
    std::vector<float> part(10 * cols);
    dequantize_rows(q, 17, 27, part.data());
    EXPECT_TRUE(same_floats(part, std::vector<float>(all.begin() + 17 * cols, all.begin() + 27 * cols)));
  }
}
