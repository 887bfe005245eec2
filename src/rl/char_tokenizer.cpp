#include "rl/char_tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "rl/report.h"

namespace quads::rl {

namespace {

constexpr const char* kPad = "<pad>";
constexpr const char* kBos = "<bos>";
constexpr const char* kEos = "<eos>";

// How a byte is shown in an error message.
std::string show_char(unsigned char c) {
  if (c == '\n') return fmt::format("'\\n' (0x{:02x})", c);
  if (c == '\t') return fmt::format("'\\t' (0x{:02x})", c);
  if (c >= 0x20 && c < 0x7f) return fmt::format("'{}' (0x{:02x})", static_cast<char>(c), c);
  return fmt::format("byte 0x{:02x}", c);
}

}  // namespace

CharTokenizer::CharTokenizer() {
  tokens_ = {kPad, kBos, kEos, "\n", " "};
  for (char c = '0'; c <= '9'; ++c) tokens_.emplace_back(1, c);
  for (char c : std::string_view("+-*=>(),:")) tokens_.emplace_back(1, c);
  for (char c = 'a'; c <= 'z'; ++c) tokens_.emplace_back(1, c);
  index("built-in vocabulary");
}

void CharTokenizer::index(const std::string& origin) {
  for (auto& v : char_to_id_) v = -1;
  QUADS_CHECK(!tokens_.empty(), "{}: tokenizer has no tokens", origin);
  for (int32_t id : {pad_, bos_, eos_})
    QUADS_CHECK(id >= 0 && id < vocab_size(), "{}: special id {} is outside the vocabulary (size {})",
                origin, id, vocab_size());
  QUADS_CHECK(pad_ != bos_ && pad_ != eos_ && bos_ != eos_, "{}: pad_id, bos_id and eos_id must differ",
              origin);
  for (int32_t id = 0; id < vocab_size(); ++id) {
    if (is_special(id)) continue;
    const std::string& t = tokens_[id];
    QUADS_CHECK(t.size() == 1, "{}: token {} (\"{}\") is not a single character", origin, id, t);
    unsigned char c = static_cast<unsigned char>(t[0]);
    QUADS_CHECK(c == '\n' || (c >= 0x20 && c < 0x7f), "{}: token {} is {}, not printable ASCII or '\\n'",
                origin, id, show_char(c));
    QUADS_CHECK(char_to_id_[c] < 0, "{}: character {} appears twice (ids {} and {})", origin, show_char(c),
                char_to_id_[c], id);
    char_to_id_[c] = id;
  }
}

CharTokenizer CharTokenizer::from_json(const nlohmann::json& j, const std::string& origin) {
  QUADS_CHECK(j.is_object(), "{}: tokenizer JSON must be an object", origin);
  QUADS_CHECK(j.value("type", "") == "quads-char", "{}: field \"type\" must be \"quads-char\"", origin);
  QUADS_CHECK(j.contains("version") && j["version"].is_number_integer() && j["version"].get<int>() == 1,
              "{}: field \"version\" must be 1", origin);
  CharTokenizer t;
  for (auto [field, dst] : {std::pair{"pad_id", &t.pad_}, {"bos_id", &t.bos_}, {"eos_id", &t.eos_}}) {
    QUADS_CHECK(j.contains(field) && j[field].is_number_integer(), "{}: field \"{}\" must be an integer",
                origin, field);
    *dst = j[field].get<int32_t>();
  }
  QUADS_CHECK(j.contains("tokens") && j["tokens"].is_array(), "{}: field \"tokens\" must be an array",
              origin);
  t.tokens_.clear();
  for (size_t i = 0; i < j["tokens"].size(); ++i) {
    const auto& v = j["tokens"][i];
    QUADS_CHECK(v.is_string(), "{}: tokens[{}] is not a string", origin, i);
    t.tokens_.push_back(v.get<std::string>());
  }
  t.index(origin);
  return t;
}

CharTokenizer CharTokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  QUADS_CHECK(f.good(), "cannot open tokenizer file {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  QUADS_CHECK(!j.is_discarded(), "{}: not valid JSON", path);
  return from_json(j, path);
}

nlohmann::json CharTokenizer::to_json() const {
  return {{"type", "quads-char"}, {"version", 1},  {"pad_id", pad_},
          {"bos_id", bos_},       {"eos_id", eos_}, {"tokens", tokens_}};
}

void CharTokenizer::save(const std::string& path) const { write_text_atomic(path, to_json().dump(1) + "\n"); }

const std::string& CharTokenizer::token(int32_t id) const {
  QUADS_CHECK(id >= 0 && id < vocab_size(), "token id {} is outside the vocabulary (size {})", id,
              vocab_size());
  return tokens_[id];
}

int32_t CharTokenizer::char_id(char c) const {
  int32_t id = char_to_id_[static_cast<unsigned char>(c)];
  QUADS_CHECK(id >= 0, "tokenizer: character {} is not in the vocabulary", show_char(c));
  return id;
}

std::vector<int32_t> CharTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    int32_t id = char_to_id_[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      std::string shown(text.substr(0, 60));
      fail("tokenizer: unknown character {} at position {} of \"{}{}\"", show_char(text[i]), i, shown,
           text.size() > 60 ? "..." : "");
    }
    ids.push_back(id);
  }
  return ids;
}

std::vector<int32_t> CharTokenizer::encode_prompt(std::string_view prompt) const {
  std::vector<int32_t> ids{bos_};
  std::vector<int32_t> body = encode(prompt);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::string CharTokenizer::decode(std::span<const int32_t> ids) const {
  std::string s;
  s.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id = ids[i];
    QUADS_CHECK(id >= 0 && id < vocab_size(), "tokenizer: id {} at position {} is outside the vocabulary (size {})",
                id, i, vocab_size());
    s += tokens_[id];
  }
  return s;
}

}  // namespace quads::rl
