#include "io/quantized_checkpoint.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <cstring>
#include <regex>
#include <set>

#include "common/error.h"

namespace quads::io {

namespace {

constexpr const char* kFormatKey = "quads.quantization";
constexpr const char* kAmaxPrefix = "quads.nvfp4_amax.";
// "1.23456789e-05": nine significant digits round-trip every float, and a finite non-negative
// float always prints in exactly this many characters, so the value can be reserved in the
// header before the tensor is quantized and filled in afterwards.
constexpr const char* kAmaxPlaceholder = "0.00000000e+00";

std::string format_amax(float a) { return fmt::format("{:.8e}", a); }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string scale_name(const std::string& name, const QuantizeOptions& opt) {
  return name + (opt.format == CheckpointFormat::FP8 && opt.fp8_block > 0 ? "_scale_inv" : "_scale");
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// plan_tensor with the regexes compiled once.
struct Planner {
  QuantizeOptions opt;
  std::regex include, exclude;
  explicit Planner(const QuantizeOptions& o) : opt(o) {
    QUADS_CHECK(opt.format != CheckpointFormat::FP8 || opt.fp8_block == 0 || opt.fp8_block == 128,
                "--fp8-block must be 0 (per tensor) or 128, not {}", opt.fp8_block);
    auto compile = [](const std::string& re, const char* what) {
      try {
        return std::regex(re, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        fail("{}: invalid regular expression '{}': {}", what, re, e.what());
      }
    };
    if (!opt.include.empty()) include = compile(opt.include, "--include");
    if (!opt.exclude.empty()) exclude = compile(opt.exclude, "--exclude");
  }

  TensorPlan plan(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const {
    if (!ends_with(name, ".weight")) return {Action::Copy, "not a .weight"};
    if (shape.size() != 2) return {Action::Copy, fmt::format("{}-D", shape.size())};
    if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
      return {Action::Copy, fmt::format("dtype {}", dtype_name(dtype))};
    if (!opt.include.empty() && !std::regex_search(name, include)) return {Action::Copy, "not matched by --include"};
    if (!opt.exclude.empty() && std::regex_search(name, exclude)) return {Action::Copy, "matched by --exclude"};
    const int64_t rows = shape[0], cols = shape[1];
    if (rows == 0 || cols == 0) return {Action::Unfit, "empty"};
    switch (opt.format) {
      case CheckpointFormat::NVFP4:
        if (cols % 16) return {Action::Unfit, fmt::format("cols {} not a multiple of 16", cols)};
        if (opt.block2d && rows % 16) return {Action::Unfit, fmt::format("rows {} not a multiple of 16 (--block2d)", rows)};
        break;
      case CheckpointFormat::MXFP4:
        if (cols % 32) return {Action::Unfit, fmt::format("cols {} not a multiple of 32", cols)};
        break;
      case CheckpointFormat::FP8: break;
    }
    return {Action::Quantize, ""};
  }
};

const TensorView& expect_tensor(const SafeTensorsFile& f, const std::string& name, std::initializer_list<DType> dtypes,
                                const std::vector<int64_t>& shape) {
  const TensorView& t = f.at(name);
  bool ok = false;
  std::string want;
  for (DType d : dtypes) {
    ok |= t.dtype == d;
    want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  QUADS_CHECK(ok, "{}: tensor '{}' is {}, expected {}", f.path(), name, dtype_name(t.dtype), want);
  QUADS_CHECK(t.shape == shape, "{}: tensor '{}' has shape {}, expected {}", f.path(), name, shape_str(t.shape),
              shape_str(shape));
  return t;
}

// A scalar stored as [] (ModelOpt) or [1].
float scalar_f32(const SafeTensorsFile& f, const std::string& name) {
  const TensorView& t = f.at(name);
  QUADS_CHECK(t.dtype == DType::F32 && t.numel() == 1 && t.shape.size() <= 1,
              "{}: tensor '{}' should be an F32 scalar but is {} {}", f.path(), name, dtype_name(t.dtype),
              shape_str(t.shape));
  float v;
  std::memcpy(&v, t.data, 4);
  return v;
}

}  // namespace

std::string nvfp4_amax_key(const std::string& name) { return kAmaxPrefix + name; }
std::string format_nvfp4_amax(float amax) { return format_amax(amax); }

num::QConfig QuantizeOptions::qconfig() const {
  switch (format) {
    case CheckpointFormat::NVFP4: return num::QConfig::nvfp4_weight(block2d);
    case CheckpointFormat::MXFP4: return num::QConfig::mxfp4();
    case CheckpointFormat::FP8: return num::QConfig::fp8(fp8_block > 0 ? num::Block::B128x128 : num::Block::PerTensor);
  }
  fail("invalid checkpoint format");
}

std::string QuantizeOptions::describe() const {
  switch (format) {
    case CheckpointFormat::NVFP4: return block2d ? "nvfp4-2d" : "nvfp4";
    case CheckpointFormat::MXFP4: return "mxfp4";
    case CheckpointFormat::FP8: return fp8_block > 0 ? "fp8-block128" : "fp8";
  }
  fail("invalid checkpoint format");
}

CheckpointFormat parse_checkpoint_format(const std::string& s) {
  if (s == "nvfp4") return CheckpointFormat::NVFP4;
  if (s == "mxfp4") return CheckpointFormat::MXFP4;
  if (s == "fp8") return CheckpointFormat::FP8;
  fail("unknown checkpoint format '{}' (nvfp4, mxfp4 or fp8)", s);
}

TensorPlan plan_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                       const QuantizeOptions& opt) {
  return Planner(opt).plan(name, dtype, shape);
}

std::vector<TensorSpec> quantized_specs(const std::string& name, int64_t rows, int64_t cols, const QuantizeOptions& opt) {
  switch (opt.format) {
    case CheckpointFormat::NVFP4:
      return {{name, DType::U8, {rows, cols / 2}},
              {name + "_scale", DType::F8_E4M3, {rows, cols / 16}},
              {name + "_scale_2", DType::F32, {}}};
    case CheckpointFormat::MXFP4:
      return {{name, DType::U8, {rows, cols / 2}}, {name + "_scale", DType::U8, {rows, cols / 32}}};
    case CheckpointFormat::FP8:
      if (opt.fp8_block > 0)
        return {{name, DType::F8_E4M3, {rows, cols}},
                {name + "_scale_inv", DType::F32, {ceil_div(rows, opt.fp8_block), ceil_div(cols, opt.fp8_block)}}};
      return {{name, DType::F8_E4M3, {rows, cols}}, {name + "_scale", DType::F32, {}}};
  }
  fail("invalid checkpoint format");
}

QuantizedWeight quantize_weight(const std::string& name, const float* x, int64_t rows, int64_t cols,
                                const QuantizeOptions& opt) {
  QuantizedWeight w;
  w.q = num::quantize_checked(name, x, rows, cols, opt.qconfig());
  const num::QTensor& q = w.q;
  auto specs = quantized_specs(name, rows, cols, opt);
  auto put = [&](const TensorSpec& s, const void* data, size_t n) {
    w.tensors.push_back(TensorData::raw(s.name, s.dtype, s.shape, data, n));
  };
  switch (opt.format) {
    case CheckpointFormat::NVFP4: {
      QUADS_CHECK(q.amax.size() == 1, "tensor '{}': expected one global amax, got {}", name, q.amax.size());
      // ModelOpt's weight_scale_2 = amax / (6 * 448) in float32. An all-zero tensor would get 0,
      // which engines invert into inf; TE's convention (decode scale 1) is kept for it instead.
      const float amax = q.amax[0];
      const float scale_2 = amax > 0 ? amax / 2688.0f : num::nvfp4_global_decode_scale(amax);
      put(specs[0], q.codes.data(), q.codes.size());
      put(specs[1], q.scales.data(), q.scales.size());
      put(specs[2], &scale_2, 4);
      break;
    }
    case CheckpointFormat::MXFP4:
      put(specs[0], q.codes.data(), q.codes.size());
      put(specs[1], q.scales.data(), q.scales.size());
      break;
    case CheckpointFormat::FP8:
      put(specs[0], q.codes.data(), q.codes.size());
      put(specs[1], q.fscales.data(), q.fscales.size() * sizeof(float));
      break;
  }
  return w;
}

bool detect_checkpoint_format(const SafeTensorsFile& f, QuantizeOptions* opt) {
  auto it = f.metadata().find(kFormatKey);
  if (it != f.metadata().end()) {
    const std::string& s = it->second;
    QuantizeOptions o;
    if (s == "nvfp4" || s == "nvfp4-2d") o.format = CheckpointFormat::NVFP4, o.block2d = s == "nvfp4-2d";
    else if (s == "mxfp4") o.format = CheckpointFormat::MXFP4;
    else if (s == "fp8" || s == "fp8-block128") o.format = CheckpointFormat::FP8, o.fp8_block = s == "fp8" ? 0 : 128;
    else fail("{}: unknown {} '{}'", f.path(), kFormatKey, s);
    *opt = o;
    return true;
  }
  for (const auto& t : f.tensors()) {
    if (ends_with(t.name, "_scale_2") && t.dtype == DType::F32) {
      *opt = QuantizeOptions{};
      return true;
    }
  }
  for (const auto& t : f.tensors()) {
    if (t.dtype == DType::F8_E4M3 && ends_with(t.name, ".weight")) {
      QuantizeOptions o;
      o.format = CheckpointFormat::FP8;
      o.fp8_block = f.find(t.name + "_scale_inv") ? 128 : 0;
      *opt = o;
      return true;
    }
    if (t.dtype == DType::U8 && ends_with(t.name, ".weight")) {
      const TensorView* s = f.find(t.name + "_scale");
      if (s && (s->dtype == DType::U8 || s->dtype == DType::F8_E8M0)) {
        QuantizeOptions o;
        o.format = CheckpointFormat::MXFP4;
        *opt = o;
        return true;
      }
    }
  }
  return false;
}

std::vector<std::string> quantized_weight_names(const SafeTensorsFile& f, const QuantizeOptions& opt) {
  std::vector<std::string> names;
  for (const auto& t : f.tensors()) {
    switch (opt.format) {
      case CheckpointFormat::NVFP4:
        if (t.dtype == DType::U8 && f.find(t.name + "_scale") && f.find(t.name + "_scale_2")) names.push_back(t.name);
        break;
      case CheckpointFormat::MXFP4:
        if (t.dtype == DType::U8 && f.find(t.name + "_scale")) names.push_back(t.name);
        break;
      case CheckpointFormat::FP8:
        if (t.dtype == DType::F8_E4M3 && f.find(scale_name(t.name, opt))) names.push_back(t.name);
        break;
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

num::QTensor load_quantized_weight(const SafeTensorsFile& f, const std::string& name, const QuantizeOptions& opt) {
  const TensorView& w = f.at(name);
  QUADS_CHECK(w.shape.size() == 2, "{}: quantized weight '{}' should be 2-D but has shape {}", f.path(), name,
              shape_str(w.shape));
  num::QTensor q;
  q.cfg = opt.qconfig();
  q.rows = w.shape[0];
  switch (opt.format) {
    case CheckpointFormat::NVFP4: {
      q.cols = 2 * w.shape[1];
      QUADS_CHECK(w.dtype == DType::U8 && q.cols % 16 == 0, "{}: tensor '{}' ({} {}) is not NVFP4 packed codes",
                  f.path(), name, dtype_name(w.dtype), shape_str(w.shape));
      const TensorView& s = expect_tensor(f, name + "_scale", {DType::F8_E4M3, DType::U8}, {q.rows, q.cols / 16});
      const float scale_2 = scalar_f32(f, name + "_scale_2");
      float amax;
      auto it = f.metadata().find(kAmaxPrefix + name);
      if (it != f.metadata().end()) {
        char* end = nullptr;
        amax = std::strtof(it->second.c_str(), &end);
        QUADS_CHECK(end && *end == '\0' && !it->second.empty(), "{}: metadata '{}' = '{}' is not a number", f.path(),
                    it->first, it->second);
      } else {
        amax = scale_2 * 2688.0f;
      }
      q.codes.assign(w.data, w.data + w.nbytes);
      q.scales.assign(s.data, s.data + s.nbytes);
      q.amax = {amax};
      break;
    }
    case CheckpointFormat::MXFP4: {
      q.cols = 2 * w.shape[1];
      QUADS_CHECK(w.dtype == DType::U8 && q.cols % 32 == 0, "{}: tensor '{}' ({} {}) is not MXFP4 packed codes",
                  f.path(), name, dtype_name(w.dtype), shape_str(w.shape));
      const TensorView& s = expect_tensor(f, name + "_scale", {DType::U8, DType::F8_E8M0}, {q.rows, q.cols / 32});
      q.codes.assign(w.data, w.data + w.nbytes);
      q.scales.assign(s.data, s.data + s.nbytes);
      break;
    }
    case CheckpointFormat::FP8: {
      q.cols = w.shape[1];
      QUADS_CHECK(w.dtype == DType::F8_E4M3, "{}: tensor '{}' is {}, expected F8_E4M3", f.path(), name,
                  dtype_name(w.dtype));
      q.codes.assign(w.data, w.data + w.nbytes);
      if (opt.fp8_block > 0) {
        const TensorView& s = expect_tensor(f, name + "_scale_inv", {DType::F32},
                                            {ceil_div(q.rows, opt.fp8_block), ceil_div(q.cols, opt.fp8_block)});
        q.fscales = s.to_f32();
      } else {
        q.fscales = {scalar_f32(f, name + "_scale")};
      }
      break;
    }
  }
  return q;
}

QuantizeReport quantize_checkpoint(const std::string& in, const std::string& out, const QuantizeOptions& opt,
                                   const std::function<void(size_t, size_t, size_t)>& progress) {
  const Planner planner(opt);
  auto src = SafeTensorsFile::open(in);
  QuantizeReport report;
  report.in_bytes = src->file_size();

  // The whole output layout is fixed before any data is written.
  std::vector<TensorSpec> specs;
  std::map<std::string, std::string> producer;  // output name -> input tensor it comes from
  std::map<std::string, std::string> metadata = src->metadata();
  metadata[kFormatKey] = opt.describe();
  for (const auto& t : src->tensors()) {
    TensorReport r;
    r.name = t.name;
    r.dtype = t.dtype;
    r.shape = t.shape;
    TensorPlan p = planner.plan(t.name, t.dtype, t.shape);
    r.action = p.action;
    r.reason = p.reason;
    std::vector<TensorSpec> mine;
    if (p.action == Action::Quantize) {
      mine = quantized_specs(t.name, t.shape[0], t.shape[1], opt);
      if (opt.format == CheckpointFormat::NVFP4) metadata[kAmaxPrefix + t.name] = kAmaxPlaceholder;
      ++report.quantized;
    } else {
      mine = {{t.name, t.dtype, t.shape}};
      ++(p.action == Action::Unfit ? report.unfit : report.copied);
    }
    for (auto& s : mine) {
      auto [it, fresh] = producer.emplace(s.name, t.name);
      QUADS_CHECK(fresh, "{}: output tensor '{}' would come from both '{}' and '{}' (is the input already quantized?)",
                  in, s.name, it->second, t.name);
      uint64_t n = dtype_size(s.dtype);
      for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
      r.out_bytes += n;
      specs.push_back(std::move(s));
    }
    report.tensors.push_back(std::move(r));
  }

  SafeTensorsWriter writer(out, std::move(specs), metadata);
  size_t done_bytes = 0;
  std::vector<float> x, deq;
  for (size_t i = 0; i < src->tensors().size(); ++i) {
    const TensorView& t = src->tensors()[i];
    TensorReport& r = report.tensors[i];
    if (r.action == Action::Quantize) {
      const int64_t rows = t.shape[0], cols = t.shape[1];
      x.resize(static_cast<size_t>(rows * cols));
      t.to_f32(x.data());
      QuantizedWeight w = quantize_weight(t.name, x.data(), rows, cols, opt);
      for (const auto& d : w.tensors) writer.write(d.name, d.bytes.data(), d.bytes.size());
      if (opt.format == CheckpointFormat::NVFP4) writer.set_metadata(kAmaxPrefix + t.name, format_amax(w.q.amax[0]));
      deq.resize(x.size());
      num::dequantize(w.q, deq.data());
      r.stats = num::error_stats(x.data(), deq.data(), rows, cols);
    } else {
      writer.write(t.name, t.data, t.nbytes);
    }
    done_bytes += t.nbytes;
    if (progress) progress(i + 1, src->tensors().size(), done_bytes);
  }
  writer.commit();
  report.out_bytes = writer.file_size();
  return report;
}

void verify_quantized_checkpoint(const std::string& in, const std::string& out, const QuantizeOptions& opt,
                                 const QuantizeReport& report) {
  auto src = SafeTensorsFile::open(in);
  auto dst = SafeTensorsFile::open(out);
  QuantizeOptions found;
  QUADS_CHECK(detect_checkpoint_format(*dst, &found) && found.describe() == opt.describe(),
              "{}: metadata says the format is not {}", out, opt.describe());
  for (const auto& [k, v] : src->metadata()) {
    auto it = dst->metadata().find(k);
    QUADS_CHECK(it != dst->metadata().end() && it->second == v, "{}: metadata '{}' was not carried over", out, k);
  }
  size_t expected_tensors = 0;
  std::vector<float> x, deq;
  for (const TensorReport& r : report.tensors) {
    const TensorView& s = src->at(r.name);
    if (r.action != Action::Quantize) {
      const TensorView& d = expect_tensor(*dst, r.name, {s.dtype}, s.shape);
      QUADS_CHECK(std::memcmp(d.data, s.data, s.nbytes) == 0, "{}: tensor '{}' differs from the input", out, r.name);
      ++expected_tensors;
      continue;
    }
    const int64_t rows = s.shape[0], cols = s.shape[1];
    for (const TensorSpec& spec : quantized_specs(r.name, rows, cols, opt)) {
      expect_tensor(*dst, spec.name, {spec.dtype}, spec.shape);
      ++expected_tensors;
    }
    num::QTensor q = load_quantized_weight(*dst, r.name, opt);
    x = s.to_f32();
    deq.resize(x.size());
    num::dequantize(q, deq.data());
    num::ErrorStats e = num::error_stats(x.data(), deq.data(), rows, cols);
    QUADS_CHECK(std::memcmp(&e.rel_mse, &r.stats.rel_mse, sizeof(double)) == 0 &&
                    std::memcmp(&e.max_abs, &r.stats.max_abs, sizeof(double)) == 0,
                "{}: tensor '{}' decodes to different values than were written (rel MSE {} vs {}, max abs {} vs {})",
                out, r.name, e.rel_mse, r.stats.rel_mse, e.max_abs, r.stats.max_abs);
  }
  QUADS_CHECK(dst->tensors().size() == expected_tensors, "{}: holds {} tensors, expected {}", out,
              dst->tensors().size(), expected_tensors);
}

}  // namespace quads::io
