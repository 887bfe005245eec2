#include "io/dataset.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"

namespace quads::io {

namespace {

using json = nlohmann::json;

// The field `name` of `obj`: the key itself, else a dotted path through nested objects.
const json* find_field(const json& obj, const std::string& name) {
  if (auto it = obj.find(name); it != obj.end()) return &*it;
  const json* cur = &obj;
  size_t start = 0;
  while (true) {
    size_t dot = name.find('.', start);
    std::string key = name.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end()) return nullptr;
    cur = &*it;
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

// Empty when the line is good, else why not.
std::string parse_line(std::string_view line, const DatasetOptions& opt, Example* ex) {
  json j;
  try {
    j = json::parse(line.begin(), line.end());
  } catch (const json::exception& e) {
    return fmt::format("not valid JSON ({})", e.what());
  }
  if (!j.is_object()) return "not a JSON object";
  std::string* out[2] = {&ex->prompt, &ex->answer};
  const std::string* names[2] = {&opt.prompt_field, &opt.answer_field};
  for (int k = 0; k < 2; ++k) {
    const json* f = find_field(j, *names[k]);
    if (!f) return fmt::format("no field '{}'", *names[k]);
    if (!f->is_string()) return fmt::format("field '{}' is {}, not a string", *names[k], f->type_name());
    *out[k] = f->get<std::string>();
  }
  return "";
}

// splitmix64: a tiny, well-mixed generator whose output is the same everywhere.
uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, n) without modulo bias (rejection sampling).
uint64_t below(uint64_t& s, uint64_t n) {
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  for (;;) {
    uint64_t r = splitmix64(s);
    if (r < limit) return r % n;
  }
}

}  // namespace

Dataset parse_jsonl(std::string_view text, const std::string& origin, const DatasetOptions& opt) {
  QUADS_CHECK(!opt.prompt_field.empty() && !opt.answer_field.empty(),
              "dataset {}: the prompt and answer field names must not be empty", origin);
  Dataset d;
  d.path = origin;
  int64_t lineno = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    if (lineno == 1 && line.substr(0, 3) == "\xEF\xBB\xBF") line.remove_prefix(3);  // UTF-8 byte order mark
    Example ex;
    ex.line = lineno;
    std::string why = parse_line(line, opt, &ex);
    if (why.empty()) {
      d.examples.push_back(std::move(ex));
      if (opt.max_examples && d.examples.size() >= opt.max_examples) break;
      continue;
    }
    std::string msg = fmt::format("{}:{}: {}", origin, lineno, why);
    if (!opt.skip_bad_lines) fail("dataset {} (set skip_bad_lines to skip bad lines)", msg);
    if (d.warnings.size() < 100) d.warnings.push_back(msg);
    ++d.skipped;
  }
  return d;
}

Dataset load_jsonl(const std::string& path, const DatasetOptions& opt) {
  std::ifstream f(path, std::ios::binary);
  QUADS_CHECK(f, "dataset {}: cannot open file", path);
  std::stringstream ss;
  ss << f.rdbuf();
  QUADS_CHECK(!f.bad(), "dataset {}: read error", path);
  return parse_jsonl(ss.str(), path, opt);
}

PromptSampler::PromptSampler(size_t dataset_size, uint64_t seed) : size_(dataset_size), seed_(seed) {
  QUADS_CHECK(dataset_size > 0, "PromptSampler: the dataset is empty");
  order_ = permutation(0);
}

std::vector<size_t> PromptSampler::permutation(uint64_t epoch) const {
  std::vector<size_t> p(size_);
  for (size_t i = 0; i < size_; ++i) p[i] = i;
  uint64_t s = seed_ ^ (0xD1B54A32D192ED03ull * (epoch + 1));
  for (size_t i = size_; i > 1; --i) std::swap(p[i - 1], p[below(s, i)]);
  return p;
}

std::vector<size_t> PromptSampler::next(size_t n) {
  std::vector<size_t> out;
  out.reserve(n);
  while (out.size() < n) {
    if (pos_ == size_) {
      ++epoch_;
      pos_ = 0;
      order_ = permutation(epoch_);
    }
    out.push_back(order_[pos_++]);
  }
  return out;
}

void PromptSampler::restore(uint64_t epoch, size_t position) {
  QUADS_CHECK(position <= size_, "PromptSampler: position {} is beyond the dataset size {}", position, size_);
  epoch_ = epoch;
  pos_ = position;
  order_ = permutation(epoch_);
}

}  // namespace quads::io
