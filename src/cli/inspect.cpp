// quads inspect: what a safetensors checkpoint holds.
//   quads inspect model.safetensors          one file
//   quads inspect path/to/checkpoint/        a folder with model.safetensors or a sharded
//                                            model.safetensors.index.json
// Per tensor: name, dtype, shape and statistics (min, max, mean, std, absmax, share of zeros;
// for U8/I8/BOOL/F8 tensors a byte histogram summary instead), then the metadata and totals.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>

#include "cli/command.h"
#include "common/error.h"
#include "io/safetensors.h"

namespace {

using quads::io::DType;
using quads::io::SafeTensorsFile;
using quads::io::TensorView;
namespace fs = std::filesystem;

struct Options {
  std::string path, filter;
  bool no_stats = false;
};

// Moments of a chunk, merged in a fixed order (Chan et al.) so the result does not depend on
// the number of threads.
struct Moments {
  int64_t n = 0, zeros = 0, nans = 0, infs = 0;
  double mean = 0, m2 = 0;
  double min = std::numeric_limits<double>::infinity(), max = -std::numeric_limits<double>::infinity();
  void merge(const Moments& o) {
    if (o.n > 0) {
      if (n == 0) {
        mean = o.mean;
        m2 = o.m2;
      } else {
        double tot = static_cast<double>(n + o.n), d = o.mean - mean;
        mean += d * static_cast<double>(o.n) / tot;
        m2 += o.m2 + d * d * static_cast<double>(n) * static_cast<double>(o.n) / tot;
      }
      n += o.n;
      min = std::min(min, o.min);
      max = std::max(max, o.max);
    }
    zeros += o.zeros;
    nans += o.nans;
    infs += o.infs;
  }
};

constexpr int64_t kChunk = 1 << 16;

bool is_byte_type(DType d) {
  return d == DType::U8 || d == DType::I8 || d == DType::BOOL || d == DType::F8_E4M3 || d == DType::F8_E5M2 ||
         d == DType::F8_E8M0;
}

// The same tensor restricted to elements [begin, begin + n).
TensorView slice(const TensorView& t, int64_t begin, int64_t n) {
  TensorView s;
  s.name = t.name;
  s.dtype = t.dtype;
  s.shape = {n};
  size_t es = quads::io::dtype_size(t.dtype);
  s.data = t.data + static_cast<size_t>(begin) * es;
  s.nbytes = static_cast<size_t>(n) * es;
  return s;
}

Moments float_stats(const TensorView& t) {
  const int64_t n = t.numel(), nchunks = (n + kChunk - 1) / kChunk;
  std::vector<Moments> parts(static_cast<size_t>(nchunks));
#pragma omp parallel
  {
    std::vector<float> buf(kChunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t b = c * kChunk, len = std::min(kChunk, n - b);
      slice(t, b, len).to_f32(buf.data());
      Moments m;
      double sum = 0;
      for (int64_t i = 0; i < len; ++i) {
        float v = buf[i];
        if (std::isnan(v)) { ++m.nans; continue; }
        if (std::isinf(v)) { ++m.infs; continue; }
        if (v == 0) ++m.zeros;
        sum += v;
        ++m.n;
        m.min = std::min<double>(m.min, v);
        m.max = std::max<double>(m.max, v);
      }
      if (m.n > 0) {
        m.mean = sum / static_cast<double>(m.n);
        for (int64_t i = 0; i < len; ++i)
          if (std::isfinite(buf[i])) m.m2 += (buf[i] - m.mean) * (buf[i] - m.mean);
      }
      parts[c] = m;
    }
  }
  Moments all;
  for (const auto& p : parts) all.merge(p);
  return all;
}

std::array<int64_t, 256> byte_histogram(const TensorView& t) {
  const int64_t n = static_cast<int64_t>(t.nbytes), nchunks = (n + kChunk - 1) / kChunk;
  std::vector<std::array<int64_t, 256>> parts(static_cast<size_t>(nchunks));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    auto& h = parts[c];
    h.fill(0);
    for (int64_t i = c * kChunk, e = std::min(n, (c + 1) * kChunk); i < e; ++i) ++h[t.data[i]];
  }
  std::array<int64_t, 256> all{};
  for (const auto& p : parts)
    for (int i = 0; i < 256; ++i) all[i] += p[i];
  return all;
}

std::string byte_summary(const TensorView& t) {
  auto h = byte_histogram(t);
  const double n = static_cast<double>(t.nbytes);
  int distinct = 0;
  std::vector<int> order;
  for (int i = 0; i < 256; ++i)
    if (h[i]) {
      ++distinct;
      order.push_back(i);
    }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return h[a] > h[b]; });
  std::string s = fmt::format("bytes: {} distinct, zero {:.2f}%, top", distinct, 100.0 * h[0] / n);
  for (size_t i = 0; i < std::min<size_t>(4, order.size()); ++i)
    s += fmt::format(" 0x{:02x} {:.1f}%", order[i], 100.0 * h[order[i]] / n);
  return s;
}

struct Entry {
  std::string shard;  // empty for a single file
  const TensorView* t;
};

int run(const Options& o) {
  // Resolve the files to read.
  std::vector<std::string> files;
  std::map<std::string, std::string> index_map;  // tensor -> shard, from an index
  std::string index_path;
  fs::path p(o.path);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors.index.json")) index_path = (p / "model.safetensors.index.json").string();
    else if (fs::exists(p / "model.safetensors")) files.push_back((p / "model.safetensors").string());
    else quads::fail("{}: no model.safetensors or model.safetensors.index.json in this folder", o.path);
  } else if (o.path.size() > 5 && o.path.ends_with(".json")) {
    index_path = o.path;
  } else {
    files.push_back(o.path);
  }
  nlohmann::json index_meta;
  if (!index_path.empty()) {
    std::ifstream in(index_path);
    QUADS_CHECK(in, "{}: cannot open", index_path);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      quads::fail("{}: not valid JSON: {}", index_path, e.what());
    }
    QUADS_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                "{}: no \"weight_map\" object", index_path);
    std::set<std::string> shards;
    for (auto& [name, shard] : j["weight_map"].items()) {
      QUADS_CHECK(shard.is_string(), "{}: weight_map entry '{}' is not a file name", index_path, name);
      index_map[name] = shard.get<std::string>();
      shards.insert(shard.get<std::string>());
    }
    if (j.contains("metadata")) index_meta = j["metadata"];
    fs::path dir = fs::path(index_path).parent_path();
    for (const auto& s : shards) files.push_back((dir / s).string());
  }

  std::optional<std::regex> filter;
  if (!o.filter.empty()) {
    try {
      filter.emplace(o.filter, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      quads::fail("--filter: invalid regular expression '{}': {}", o.filter, e.what());
    }
  }

  std::vector<std::shared_ptr<SafeTensorsFile>> opened;
  std::vector<Entry> entries;
  size_t total_bytes = 0;
  for (const auto& f : files) {
    opened.push_back(SafeTensorsFile::open(f));
    const auto& sf = *opened.back();
    total_bytes += sf.file_size();
    std::string shard = index_path.empty() ? "" : fs::path(f).filename().string();
    std::printf("%s: %zu tensors, %zu bytes (header %zu)\n", f.c_str(), sf.tensors().size(), sf.file_size(),
                sf.header_size());
    // quantized checkpoints carry one amax entry per weight (io/quantized_checkpoint.h): count them
    size_t amax_entries = 0;
    for (const auto& [k, v] : sf.metadata()) {
      if (k.starts_with("quads.nvfp4_amax.")) ++amax_entries;
      else std::printf("  metadata %s: %s\n", k.c_str(), v.c_str());
    }
    if (amax_entries) std::printf("  metadata quads.nvfp4_amax.*: %zu weights\n", amax_entries);
    for (const auto& t : sf.tensors()) {
      if (!index_map.empty()) {
        auto it = index_map.find(t.name);
        if (it == index_map.end() || it->second != shard)
          std::fprintf(stderr, "warning: %s: tensor '%s' is not listed for this shard in %s\n", f.c_str(),
                       t.name.c_str(), index_path.c_str());
      }
      if (!filter || std::regex_search(t.name, *filter)) entries.push_back({shard, &t});
    }
  }
  for (const auto& [name, shard] : index_map) {
    bool found = false;
    for (size_t i = 0; i < files.size() && !found; ++i)
      found = fs::path(files[i]).filename() == shard && opened[i]->find(name);
    QUADS_CHECK(found, "{}: tensor '{}' is mapped to {} but that shard does not hold it", index_path, name, shard);
  }
  if (!index_meta.is_null()) std::printf("index metadata: %s\n", index_meta.dump().c_str());
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.t->name < b.t->name; });

  size_t name_w = 6, shape_w = 5;
  for (const auto& e : entries) {
    name_w = std::max(name_w, e.t->name.size());
    shape_w = std::max(shape_w, quads::io::shape_str(e.t->shape).size());
  }
  std::string head = fmt::format("{:<{}}  {:<7}  {:<{}}", "tensor", name_w, "dtype", "shape", shape_w);
  if (!o.no_stats)
    head += fmt::format("  {:>11} {:>11} {:>11} {:>11} {:>11} {:>7}", "min", "max", "mean", "std", "absmax", "zeros");
  if (!index_path.empty()) head += "  shard";
  std::printf("%s\n", head.c_str());

  std::map<std::string, std::array<int64_t, 3>> by_dtype;  // tensors, elements, bytes
  for (const auto& e : entries) {
    const TensorView& t = *e.t;
    auto& d = by_dtype[quads::io::dtype_name(t.dtype)];
    d[0] += 1;
    d[1] += t.numel();
    d[2] += static_cast<int64_t>(t.nbytes);
    std::string line = fmt::format("{:<{}}  {:<7}  {:<{}}", t.name, name_w, quads::io::dtype_name(t.dtype),
                                   quads::io::shape_str(t.shape), shape_w);
    if (!o.no_stats) {
      if (t.numel() == 0) {
        line += "  (empty)";
      } else if (is_byte_type(t.dtype)) {
        line += "  " + byte_summary(t);
      } else {
        Moments m = float_stats(t);
        if (m.n > 0) {
          double sd = std::sqrt(m.m2 / static_cast<double>(m.n));
          line += fmt::format("  {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>6.2f}%", m.min, m.max, m.mean, sd,
                              std::max(std::fabs(m.min), std::fabs(m.max)),
                              100.0 * static_cast<double>(m.zeros) / static_cast<double>(t.numel()));
        } else {
          line += "  (no finite values)";
        }
        if (m.nans || m.infs) line += fmt::format("  nan={} inf={}", m.nans, m.infs);
      }
    }
    if (!e.shard.empty()) line += "  " + e.shard;
    std::printf("%s\n", line.c_str());
  }
  std::printf("total: %zu tensors in %zu file(s), %zu bytes\n", entries.size(), files.size(), total_bytes);
  for (const auto& [name, d] : by_dtype)
    std::printf("  %-8s %6lld tensors %14lld elements %14lld bytes\n", name.c_str(), static_cast<long long>(d[0]),
                static_cast<long long>(d[1]), static_cast<long long>(d[2]));
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("path", o->path, "a .safetensors file, a model.safetensors.index.json, or a checkpoint folder")
      ->required();
  app.add_option("--filter", o->filter, "only tensors whose name matches this regular expression");
  app.add_flag("--no-stats", o->no_stats, "names, dtypes and shapes only (no pass over the data)");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("inspect", "show the tensors (dtype, shape, statistics) and metadata of a safetensors checkpoint", setup);
