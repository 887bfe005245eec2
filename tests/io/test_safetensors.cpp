#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "common/error.h"
#include "common/fixtures.h"
#include "io/safetensors.h"
#include "numerics/formats.h"

using namespace quads;
using namespace quads::io;
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A fresh folder per test, removed afterwards.
struct TempDir {
  fs::path dir;
  TempDir() {
    dir = fs::temp_directory_path() /
          ("quads_io_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
};

// header length (little-endian u64) + header text + data
std::vector<uint8_t> make_file(const std::string& header, const std::vector<uint8_t>& data, uint64_t len = UINT64_MAX) {
  if (len == UINT64_MAX) len = header.size();
  std::vector<uint8_t> b(8 + header.size() + data.size());
  std::memcpy(b.data(), &len, 8);
  std::copy(header.begin(), header.end(), b.begin() + 8);
  std::copy(data.begin(), data.end(), b.begin() + 8 + static_cast<long>(header.size()));
  return b;
}

// Expects from_bytes to throw quads::Error whose message names the file (and `also`, if given).
void expect_rejected(const std::vector<uint8_t>& bytes, const std::string& also = "", const std::string& label = "bad.safetensors") {
  try {
    SafeTensorsFile::from_bytes(label, bytes.data(), bytes.size());
    ADD_FAILURE() << "accepted: " << std::string(bytes.begin() + std::min<size_t>(8, bytes.size()), bytes.end());
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(label), std::string::npos) << msg;
    if (!also.empty()) {
      EXPECT_NE(msg.find(also), std::string::npos) << "want '" << also << "' in: " << msg;
    }
  }
}

void expect_rejected_header(const std::string& header, size_t data_bytes, const std::string& also = "") {
  expect_rejected(make_file(header, std::vector<uint8_t>(data_bytes, 0)), also);
}

// A small valid file with three tensors of different dtypes and a metadata entry.
std::vector<uint8_t> small_valid_file(const TempDir& tmp) {
  std::vector<TensorData> ts;
  float a[6] = {1, -2, 3.5f, 0, 1e-3f, 7};
  ts.push_back(TensorData::from_f32("a", {2, 3}, a, DType::F32));
  ts.push_back(TensorData::from_f32("b.weight", {3}, a, DType::BF16));
  uint8_t c[5] = {1, 2, 3, 4, 5};
  ts.push_back(TensorData::raw("c", DType::U8, {5}, c, 5));
  std::string p = tmp / "small.safetensors";
  write_safetensors(p, ts, {{"format", "pt"}});
  return read_bytes(p);
}

// Invariants that hold for every file the reader accepts.
void check_accepted_invariants(const SafeTensorsFile& f) {
  size_t total = 0;
  for (const auto& t : f.tensors()) {
    EXPECT_EQ(t.nbytes, static_cast<size_t>(t.numel()) * dtype_size(t.dtype));
    total += t.nbytes;
    EXPECT_EQ(f.find(t.name), &t);
  }
  EXPECT_EQ(total, f.file_size() - 8 - f.header_size());
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Reading the reference fixtures (written by Python's safetensors)

TEST(SafeTensorsFixtures, ReadsTinyModel) {
  auto f = SafeTensorsFile::open(fixtures_dir() + "/tiny_qwen3moe_a/model.safetensors");
  EXPECT_EQ(f->tensors().size(), 69u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const auto& e = f->at("model.embed_tokens.weight");
  EXPECT_EQ(e.dtype, DType::F32);
  EXPECT_EQ(e.shape, (std::vector<int64_t>{512, 64}));
  const auto& n = f->at("model.layers.1.input_layernorm.weight");
  EXPECT_EQ(n.shape, (std::vector<int64_t>{64}));
  // norm weights are 1 + 0.1 N(0,1) (fixtures README): all near 1
  for (float v : n.to_f32()) EXPECT_NEAR(v, 1.0f, 0.6f);
  check_accepted_invariants(*f);
  EXPECT_EQ(f->find("nope"), nullptr);
  try {
    f->at("nope");
    ADD_FAILURE();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("model.safetensors"), std::string::npos);
    EXPECT_NE(std::string(err.what()).find("nope"), std::string::npos);
  }
}

TEST(SafeTensorsFixtures, ReadsGradsAndGolden) {
  auto g = SafeTensorsFile::open(fixtures_dir() + "/tiny_qwen3moe_a/grads.safetensors");
  EXPECT_EQ(g->at("model.layers.0.mlp.experts.gate_up_proj").shape, (std::vector<int64_t>{8, 64, 64}));
  EXPECT_TRUE(g->metadata().empty());
  check_accepted_invariants(*g);
  auto n = SafeTensorsFile::open(fixtures_dir() + "/nvfp4/golden.safetensors");
  EXPECT_EQ(n->tensors().size(), 15u);
  EXPECT_EQ(n->at("case0.packed").dtype, DType::U8);
  EXPECT_EQ(n->at("case0.packed").shape, (std::vector<int64_t>{200, 48}));
  EXPECT_EQ(n->at("case1.input").shape, (std::vector<int64_t>{256, 512}));
  // file order: the F32 tensors come before the U8 ones, as Python lays them out
  EXPECT_EQ(n->tensors().front().name, "case0.amax");
  EXPECT_EQ(n->tensors().back().name, "case1.scales_swizzled");
  // the stored amax is the max |input|
  auto in = n->at("case0.input").to_f32();
  float amax = 0;
  for (float v : in) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(n->at("case0.amax").to_f32()[0], amax);
  check_accepted_invariants(*n);
}

// Writing back what we read reproduces the Python library's file byte for byte: same tensor
// order (dtype, then name), same JSON spelling, same padding.
TEST(SafeTensorsFixtures, RewriteIsByteIdenticalToPython) {
  TempDir tmp;
  for (const char* rel : {"/tiny_qwen3moe_a/model.safetensors", "/tiny_qwen3moe_a/grads.safetensors",
                          "/nvfp4/golden.safetensors"}) {
    std::string src = fixtures_dir() + rel;
    auto f = SafeTensorsFile::open(src);
    std::vector<TensorData> ts;
    // reversed so that the writer's own ordering is what is tested
    for (auto it = f->tensors().rbegin(); it != f->tensors().rend(); ++it)
      ts.push_back(TensorData::raw(it->name, it->dtype, it->shape, it->data, it->nbytes));
    std::string out = tmp / "rewrite.safetensors";
    write_safetensors(out, ts, f->metadata());
    EXPECT_TRUE(read_bytes(out) == read_bytes(src)) << rel;
  }
}

// ------------------------------------------------------------------------------------------------
// Round trips

TEST(SafeTensorsRoundTrip, EveryDTypeEmptyAndScalar) {
  TempDir tmp;
  const DType all[] = {DType::BOOL, DType::U8,  DType::I8,  DType::U16, DType::I16,     DType::F16,     DType::BF16,   DType::U32,
                       DType::I32,  DType::F32, DType::U64, DType::I64, DType::F64, DType::F8_E4M3, DType::F8_E5M2, DType::F8_E8M0};
  std::mt19937_64 rng(7);
  std::vector<TensorData> ts;
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {3}, {2, 3}, {3, 0, 2}, {1, 1, 5}};
  for (DType d : all) {
    DType parsed;
    ASSERT_TRUE(parse_dtype(dtype_name(d), &parsed));
    EXPECT_EQ(parsed, d);
    for (size_t s = 0; s < shapes.size(); ++s) {
      size_t n = dtype_size(d);
      for (int64_t x : shapes[s]) n *= x;
      std::vector<uint8_t> b(n);
      for (auto& x : b) x = static_cast<uint8_t>(rng());
      if (d == DType::BOOL)
        for (auto& x : b) x &= 1;
      ts.push_back(TensorData::raw(fmt::format("t.{}.{}", dtype_name(d), s), d, shapes[s], b.data(), b.size()));
    }
  }
  std::string p = tmp / "all.safetensors";
  write_safetensors(p, ts, {{"k", "v"}, {"quote\"and\\slash\n", "\x01 ünïcødé"}});
  auto f = SafeTensorsFile::open(p);
  ASSERT_EQ(f->tensors().size(), ts.size());
  EXPECT_EQ(f->metadata().at("quote\"and\\slash\n"), "\x01 ünïcødé");
  EXPECT_EQ(f->header_size() % 8, 0u);
  const uint8_t* data0 = f->tensors().front().data;
  for (const auto& t : ts) {
    const TensorView& v = f->at(t.name);
    EXPECT_EQ(v.dtype, t.dtype) << t.name;
    EXPECT_EQ(v.shape, t.shape) << t.name;
    ASSERT_EQ(v.nbytes, t.bytes.size()) << t.name;
    if (v.nbytes) {
      EXPECT_EQ(std::memcmp(v.data, t.bytes.data(), v.nbytes), 0) << t.name;
    }
    // the dtype-major order keeps every tensor aligned to its element size
    EXPECT_EQ((v.data - data0) % dtype_size(v.dtype), 0u) << t.name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % dtype_size(v.dtype), 0u) << t.name;
  }
  // the header is what serde_json would write: compact, parses back to the same content
  auto bytes = read_bytes(p);
  std::string header(bytes.begin() + 8, bytes.begin() + 8 + f->header_size());
  auto j = nlohmann::json::parse(header);
  EXPECT_EQ(header.find(": "), std::string::npos);
  EXPECT_EQ(header.rfind("{\"__metadata__\":{", 0), 0u);
  EXPECT_EQ(j.size(), ts.size() + 1);
  EXPECT_EQ(f->at("t.F32.0").numel(), 1);
  EXPECT_EQ(f->at("t.F32.4").numel(), 0);
}

TEST(SafeTensorsRoundTrip, EmptyFile) {
  TempDir tmp;
  std::string p = tmp / "empty.safetensors";
  write_safetensors(p, {});
  auto b = read_bytes(p);
  EXPECT_EQ(b, make_file("{}      ", {}));
  auto f = SafeTensorsFile::open(p);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_TRUE(f->metadata().empty());
}

TEST(SafeTensorsRoundTrip, FloatConversions) {
  TempDir tmp;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<float> x(257);
  for (auto& v : x) v = nd(rng);
  x[0] = 0.f;
  x[1] = -0.f;
  x[2] = 65504.f;
  x[3] = 1e-7f;  // an F16 subnormal
  std::string p = tmp / "f.safetensors";
  write_safetensors(p, {TensorData::from_f32("f32", {257}, x.data(), DType::F32),
                        TensorData::from_f32("bf16", {257}, x.data(), DType::BF16),
                        TensorData::from_f32("f16", {257}, x.data(), DType::F16)});
  auto f = SafeTensorsFile::open(p);
  auto f32 = f->at("f32").to_f32(), bf = f->at("bf16").to_f32(), h = f->at("f16").to_f32();
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(f32[i]), std::bit_cast<uint32_t>(x[i]));
    EXPECT_EQ(std::bit_cast<uint32_t>(bf[i]), std::bit_cast<uint32_t>(num::bf16_to_f32(num::bf16_from_f32(x[i]))));
    EXPECT_EQ(std::bit_cast<uint32_t>(h[i]), std::bit_cast<uint32_t>(num::f16_to_f32(num::f16_from_f32(x[i]))));
  }
  EXPECT_THROW(TensorData::from_f32("bad", {2}, x.data(), DType::U8), Error);
}

TEST(SafeTensorsRoundTrip, ToF32IntegersF64AndF8) {
  int32_t i32[4] = {-5, 0, 7, 1 << 20};
  uint64_t u64[2] = {3, 1ull << 40};
  int8_t i8[3] = {-128, 0, 127};
  double f64[3] = {0.1, -2.5, 1e300};
  uint8_t f8[4] = {0x38, 0xB8, 0x7E, 0x01};
  uint8_t boolv[2] = {0, 1};
  uint16_t u16[2] = {65535, 1};
  TempDir tmp;
  std::string p = tmp / "ints.safetensors";
  write_safetensors(p, {TensorData::raw("i32", DType::I32, {4}, i32, 16), TensorData::raw("u64", DType::U64, {2}, u64, 16),
                        TensorData::raw("i8", DType::I8, {3}, i8, 3), TensorData::raw("f64", DType::F64, {3}, f64, 24),
                        TensorData::raw("e4m3", DType::F8_E4M3, {4}, f8, 4), TensorData::raw("e5m2", DType::F8_E5M2, {4}, f8, 4),
                        TensorData::raw("e8m0", DType::F8_E8M0, {4}, f8, 4), TensorData::raw("bool", DType::BOOL, {2}, boolv, 2),
                        TensorData::raw("u16", DType::U16, {2}, u16, 4)});
  auto f = SafeTensorsFile::open(p);
  EXPECT_EQ(f->at("i32").to_f32(), (std::vector<float>{-5, 0, 7, 1 << 20}));
  EXPECT_EQ(f->at("u64").to_f32(), (std::vector<float>{3, 1099511627776.f}));
  EXPECT_EQ(f->at("i8").to_f32(), (std::vector<float>{-128, 0, 127}));
  EXPECT_EQ(f->at("f64").to_f32(), (std::vector<float>{0.1f, -2.5f, INFINITY}));
  EXPECT_EQ(f->at("bool").to_f32(), (std::vector<float>{0, 1}));
  EXPECT_EQ(f->at("u16").to_f32(), (std::vector<float>{65535, 1}));
  auto e4 = f->at("e4m3").to_f32(), e5 = f->at("e5m2").to_f32(), e8 = f->at("e8m0").to_f32();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(e4[i]), std::bit_cast<uint32_t>(num::e4m3_to_f32(f8[i])));
    EXPECT_EQ(std::bit_cast<uint32_t>(e5[i]), std::bit_cast<uint32_t>(num::e5m2_to_f32(f8[i])));
    EXPECT_EQ(std::bit_cast<uint32_t>(e8[i]), std::bit_cast<uint32_t>(num::ue8m0_to_f32(f8[i])));
  }
  EXPECT_EQ(e4[0], 1.0f);   // 0x38 = 2^0 in E4M3
  EXPECT_EQ(e4[1], -1.0f);
  EXPECT_EQ(e4[2], 448.0f);
}

// ------------------------------------------------------------------------------------------------
// The writer's own checks and atomicity

TEST(SafeTensorsWriter, RejectsBadInput) {
  TempDir tmp;
  std::string p = tmp / "w.safetensors";
  float x[4] = {1, 2, 3, 4};
  auto a = TensorData::from_f32("a", {4}, x);
  EXPECT_THROW(write_safetensors(p, {a, a}), Error);  // duplicate
  auto e = a;
  e.name = "";
  EXPECT_THROW(write_safetensors(p, {e}), Error);
  e.name = "__metadata__";
  EXPECT_THROW(write_safetensors(p, {e}), Error);
  e.name = "bad\xff";
  EXPECT_THROW(write_safetensors(p, {e}), Error);
  e = a;
  e.bytes.pop_back();
  EXPECT_THROW(write_safetensors(p, {e}), Error);
  e = a;
  e.shape = {-4};
  EXPECT_THROW(write_safetensors(p, {e}), Error);
  EXPECT_THROW(TensorData::raw("r", DType::F32, {3}, x, 8), Error);
  EXPECT_FALSE(fs::exists(p));
  // nothing left behind by the failed attempts
  EXPECT_TRUE(fs::is_empty(tmp.dir));
}

TEST(SafeTensorsWriter, MetadataFilledInLater) {
  TempDir tmp;
  std::string p = tmp / "m.safetensors";
  float x[2] = {1, 2};
  {
    SafeTensorsWriter w(p, {{"a", DType::F32, {2}}}, {{"amax", "0.00000000e+00"}, {"other", "x"}});
    w.write("a", x, 8);
    EXPECT_THROW(w.set_metadata("amax", "1.5"), Error);        // different length
    EXPECT_THROW(w.set_metadata("missing", "x"), Error);       // not reserved
    w.set_metadata("amax", "1.50000000e+00");
    EXPECT_THROW(w.set_metadata("other", "\n"), Error);  // escapes to two bytes: too long
  }
  EXPECT_FALSE(fs::exists(p));
  SafeTensorsWriter w(p, {{"a", DType::F32, {2}}}, {{"amax", "0.00000000e+00"}, {"other", "x"}});
  w.write("a", x, 8);
  w.set_metadata("amax", "1.50000000e+00");
  w.set_metadata("other", "y");
  w.commit();
  auto f = SafeTensorsFile::open(p);
  EXPECT_EQ(f->metadata().at("amax"), "1.50000000e+00");
  EXPECT_EQ(f->metadata().at("other"), "y");
  // identical to writing the final values directly
  std::string q = tmp / "q.safetensors";
  write_safetensors(q, {TensorData::from_f32("a", {2}, x)}, {{"amax", "1.50000000e+00"}, {"other", "y"}});
  EXPECT_EQ(read_bytes(p), read_bytes(q));
}

TEST(SafeTensorsWriter, StreamingOutOfOrderAndAtomic) {
  TempDir tmp;
  std::string p = tmp / "s.safetensors";
  write_file_atomic(p, "old", 3);
  EXPECT_EQ(read_bytes(p), (std::vector<uint8_t>{'o', 'l', 'd'}));
  float x[2] = {1.5f, -2.f};
  uint8_t c[3] = {9, 8, 7};
  {
    SafeTensorsWriter w(p, {{"z", DType::F32, {2}}, {"codes", DType::U8, {3}}, {"none", DType::F32, {0, 4}}});
    w.write("codes", c, 3);
    EXPECT_THROW(w.write("codes", c, 3), Error);  // twice
    EXPECT_THROW(w.write("z", x, 4), Error);      // wrong size
    EXPECT_THROW(w.write("y", x, 8), Error);      // undeclared
    EXPECT_THROW(w.commit(), Error);              // z missing
    // the old file is untouched until commit
  }
  EXPECT_EQ(read_bytes(p), (std::vector<uint8_t>{'o', 'l', 'd'}));
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.dir), fs::directory_iterator()), 1);
  {
    SafeTensorsWriter w(p, {{"z", DType::F32, {2}}, {"codes", DType::U8, {3}}, {"none", DType::F32, {0, 4}}});
    w.write("codes", c, 3);
    w.write("z", x, 8);
    w.commit();
    EXPECT_EQ(w.file_size(), fs::file_size(p));
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.dir), fs::directory_iterator()), 1);
  auto f = SafeTensorsFile::open(p);
  EXPECT_EQ(f->at("z").to_f32(), (std::vector<float>{1.5f, -2.f}));
  EXPECT_EQ(f->at("codes").to_f32(), (std::vector<float>{9, 8, 7}));
  EXPECT_EQ(f->at("none").numel(), 0);
  // same content through write_safetensors gives the same bytes
  std::string q = tmp / "q.safetensors";
  write_safetensors(q, {TensorData::raw("codes", DType::U8, {3}, c, 3), TensorData::from_f32("z", {2}, x),
                        TensorData::raw("none", DType::F32, {0, 4}, nullptr, 0)});
  EXPECT_EQ(read_bytes(p), read_bytes(q));
}

// ------------------------------------------------------------------------------------------------
// Corrupt files: always a quads::Error naming the file, never a crash

TEST(SafeTensorsCorrupt, TruncatedAtEveryByte) {
  TempDir tmp;
  auto good = small_valid_file(tmp);
  ASSERT_NO_THROW(SafeTensorsFile::open(tmp / "small.safetensors"));
  std::string p = tmp / "cut.safetensors";
  for (size_t k = 0; k < good.size(); ++k) {
    write_bytes(p, std::vector<uint8_t>(good.begin(), good.begin() + k));
    try {
      SafeTensorsFile::open(p);
      ADD_FAILURE() << "accepted a file cut at byte " << k;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cut.safetensors"), std::string::npos) << e.what();
    }
  }
  // one byte too many is as bad
  auto longer = good;
  longer.push_back(0);
  expect_rejected(longer, "not covered");
}

TEST(SafeTensorsCorrupt, FlippedHeaderBytes) {
  TempDir tmp;
  auto good = small_valid_file(tmp);
  uint64_t n;
  std::memcpy(&n, good.data(), 8);
  int accepted = 0, rejected = 0;
  for (size_t pos = 0; pos < 8 + n; ++pos)
    for (uint8_t mask : {0x01, 0x02, 0x10, 0x20, 0x80, 0xFF}) {
      auto b = good;
      b[pos] ^= mask;
      try {
        auto f = SafeTensorsFile::from_bytes("flip.safetensors", b.data(), b.size());
        check_accepted_invariants(*f);  // e.g. a renamed tensor: still a consistent file
        ++accepted;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("flip.safetensors"), std::string::npos) << e.what();
        ++rejected;
      }
    }
  EXPECT_GT(rejected, accepted);
}

TEST(SafeTensorsCorrupt, RandomMutations) {
  TempDir tmp;
  auto good = small_valid_file(tmp);
  std::mt19937_64 rng(12345);
  for (int it = 0; it < 3000; ++it) {
    auto b = good;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t pos = rng() % b.size();
      switch (rng() % 4) {
        case 0: b[pos] = static_cast<uint8_t>(rng()); break;
        case 1: b.erase(b.begin() + static_cast<long>(pos)); break;
        case 2: b.insert(b.begin() + static_cast<long>(pos), static_cast<uint8_t>("{}[]\",:0123456789-e."[rng() % 21])); break;
        case 3: b[pos] = static_cast<uint8_t>("{}[]\",:0123456789-e. "[rng() % 22]); break;
      }
      if (b.empty()) b.push_back(0);
    }
    try {
      auto f = SafeTensorsFile::from_bytes("mut.safetensors", b.data(), b.size());
      check_accepted_invariants(*f);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("mut.safetensors"), std::string::npos) << e.what();
    }
  }
}

TEST(SafeTensorsCorrupt, HeaderLength) {
  expect_rejected({}, "too short");
  expect_rejected({1, 0, 0, 0, 0, 0, 0}, "too short");
  expect_rejected(make_file("{}", {}, 0), "not valid JSON");
  expect_rejected(make_file("{}", {}, 3), "past the end");
  expect_rejected(make_file("{}", {}, 100'000'001), "100 MB");
  expect_rejected(make_file("{}", {}, UINT64_MAX - 1), "100 MB");
  expect_rejected(make_file("{}", {}, 1ull << 63), "100 MB");
  // the length field covers part of the data: the JSON then has trailing garbage
  const std::string one = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  expect_rejected(make_file(one, {'x'}, one.size() + 1), "JSON");
}

TEST(SafeTensorsCorrupt, NotAnObject) {
  for (const char* h : {"[]", "\"str\"", "42", "null", "true", "{", "{\"a\":}", "{}x", "{'a':1}", "\xff\xfe{}", "{\"a\xff\":1}"})
    expect_rejected_header(h, 0);
  expect_rejected_header("[]", 0, "array");
  // whitespace padding is fine
  EXPECT_NO_THROW(SafeTensorsFile::from_bytes("ok", make_file("  {}  \n\t ", {}).data(), 17));
}

TEST(SafeTensorsCorrupt, Metadata) {
  expect_rejected_header(R"({"__metadata__":{"a":1}})", 0, "__metadata__");
  expect_rejected_header(R"({"__metadata__":{"a":"x","b":null}})", 0, "'b'");
  expect_rejected_header(R"({"__metadata__":{"a":{"b":"c"}}})", 0, "__metadata__");
  expect_rejected_header(R"({"__metadata__":{"a":["x"]}})", 0, "__metadata__");
  expect_rejected_header(R"({"__metadata__":{"a":true}})", 0, "__metadata__");
  expect_rejected_header(R"({"__metadata__":["a","b"]})", 0, "__metadata__");
  expect_rejected_header(R"({"__metadata__":"a"})", 0, "__metadata__");
  expect_rejected_header(R"({"__metadata__":{"a":"x","a":"y"}})", 0, "twice");
  auto ok = make_file(R"({"__metadata__":{"a":"x","b":""}})", {});
  auto f = SafeTensorsFile::from_bytes("ok", ok.data(), ok.size());
  EXPECT_EQ(f->metadata().size(), 2u);
}

TEST(SafeTensorsCorrupt, TensorEntries) {
  auto t = [](const std::string& body) { return "{\"w\":" + body + "}"; };
  expect_rejected_header(t(R"({"dtype":"F33","shape":[1],"data_offsets":[0,4]})"), 4, "unknown dtype 'F33'");
  expect_rejected_header(t(R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})"), 4, "'w'");
  expect_rejected_header(t(R"({"dtype":4,"shape":[1],"data_offsets":[0,4]})"), 4, "'w'");
  expect_rejected_header(t(R"({"shape":[1],"data_offsets":[0,4]})"), 4, "dtype");
  expect_rejected_header(t(R"({"dtype":"F32","data_offsets":[0,4]})"), 4, "shape");
  expect_rejected_header(t(R"({"dtype":"F32","shape":[1]})"), 4, "data_offsets");
  expect_rejected_header(t(R"({"dtype":"F32","shape":1,"data_offsets":[0,4]})"), 4, "shape");
  expect_rejected_header(t(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), 4, "shape entry -1");
  expect_rejected_header(t(R"({"dtype":"F32","shape":[1.0],"data_offsets":[0,4]})"), 4, "shape entry");
  expect_rejected_header(t(R"({"dtype":"F32","shape":["1"],"data_offsets":[0,4]})"), 4, "shape entry");
  expect_rejected_header(t(R"({"dtype":"F32","shape":[[1]],"data_offsets":[0,4]})"), 4);
  expect_rejected_header(t(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1})"), 4, "extra");
  expect_rejected_header(t(R"({"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]})"), 4, "twice");
  expect_rejected_header(t(R"([1,2,3])"), 4, "'w'");
  expect_rejected_header(t(R"("F32")"), 4, "'w'");
  // shapes whose byte count overflows
  expect_rejected_header(t(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})"), 4, "overflow");
  expect_rejected_header(t(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]})"), 0, "overflow");
  expect_rejected_header(t(R"({"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,1]})"), 1, "too large");
  expect_rejected_header(t(R"({"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,1]})"), 1, "shape entry");
  // a dtype/shape that disagrees with the byte range
  expect_rejected_header(t(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), 4, "needs 8");
  expect_rejected_header(t(R"({"dtype":"BF16","shape":[3],"data_offsets":[0,4]})"), 4, "'w'");
  // a file that names no tensor twice but spells one name twice
  expect_rejected_header(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                         2, "'w' appears twice");
  // nesting bombs stop early
  expect_rejected_header(std::string(100000, '[') + std::string(100000, ']'), 0);
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += "{\"k\":";
  expect_rejected_header(deep, 0, "deeper");
}

TEST(SafeTensorsCorrupt, Offsets) {
  auto two = [](const char* a, const char* b) {
    return fmt::format(R"({{"x":{{"dtype":"U8","shape":[4],"data_offsets":{}}},"y":{{"dtype":"U8","shape":[4],"data_offsets":{}}}}})", a, b);
  };
  EXPECT_NO_THROW(SafeTensorsFile::from_bytes("ok", make_file(two("[0,4]", "[4,8]"), std::vector<uint8_t>(8)).data(), 8 + 8 + two("[0,4]", "[4,8]").size()));
  expect_rejected_header(two("[0,4]", "[2,6]"), 6, "overlap");
  expect_rejected_header(two("[0,4]", "[0,4]"), 4, "overlap");
  expect_rejected_header(two("[0,4]", "[6,10]"), 10, "gap");
  expect_rejected_header(two("[2,6]", "[6,10]"), 10, "gap of 2 bytes after the header");
  expect_rejected_header(two("[0,4]", "[4,8]"), 9, "not covered");
  expect_rejected_header(two("[0,4]", "[4,8]"), 7, "run past");
  expect_rejected_header(two("[0,4]", "[8,4]"), 8, "end before");
  expect_rejected_header(two("[0,4]", "[4,8,9]"), 8, "[begin, end]");
  expect_rejected_header(two("[0,4]", "[4]"), 8, "'y'");
  expect_rejected_header(two("[0,4]", "[-4,0]"), 8, "'y'");
  expect_rejected_header(two("[0,4]", "[4.0,8]"), 8, "'y'");
  expect_rejected_header(two("[0,4]", "[18446744073709551612,0]"), 8, "'y'");
  expect_rejected_header(two("[0,4]", "[4,18446744073709551620]"), 8, "'y'");
  expect_rejected_header(two("[0,4]", "\"4,8\""), 8, "'y'");
  // data but no tensors
  expect_rejected_header("{}", 3, "not covered");
  // empty tensors may share an offset, anywhere
  auto z = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"c":{"dtype":"I64","shape":[2,0],"data_offsets":[4,4]}})";
  auto zb = make_file(z, std::vector<uint8_t>(4));
  auto f = SafeTensorsFile::from_bytes("z", zb.data(), zb.size());
  EXPECT_EQ(f->tensors().size(), 3u);
}

TEST(SafeTensorsCorrupt, FileLevel) {
  TempDir tmp;
  try {
    SafeTensorsFile::open(tmp / "missing.safetensors");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos);
  }
  try {
    SafeTensorsFile::open(tmp.dir.string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos);
  }
  write_bytes(tmp / "zero.safetensors", {});
  EXPECT_THROW(SafeTensorsFile::open(tmp / "zero.safetensors"), Error);
}
