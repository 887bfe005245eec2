#include "analysis/prompts.h"

#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/dataset.h"
#include "io/tokenizer.h"
#include "rl/char_tokenizer.h"

namespace quads::analysis {

std::vector<std::vector<int32_t>> load_prompts(const PromptSource& src) {
  QUADS_CHECK(src.count > 0 && src.max_len > 0, "prompt count {} and length {} must be positive", src.count,
              src.max_len);
  std::vector<std::vector<int32_t>> out;
  if (src.data.empty()) {
    QUADS_CHECK(src.vocab > 0, "random prompts need the vocabulary size");
    std::mt19937_64 g(src.seed);
    for (int i = 0; i < src.count; ++i) {
      std::vector<int32_t> p(static_cast<size_t>(src.max_len));
      for (auto& t : p) t = static_cast<int32_t>(g() % static_cast<uint64_t>(src.vocab));
      out.push_back(std::move(p));
    }
    return out;
  }
  QUADS_CHECK(!src.tokenizer.empty(), "--data {} needs --tokenizer", src.data);
  nlohmann::json tj;
  {
    std::ifstream f(src.tokenizer);
    QUADS_CHECK(f.good(), "cannot open tokenizer {}", src.tokenizer);
    try {
      tj = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
      fail("{}: invalid JSON ({})", src.tokenizer, e.what());
    }
  }
  // quads' char tokenizer says so in "type"; anything else is read as an HF tokenizer.json.
  const bool is_char = tj.is_object() && tj.value("type", "") == "quads-char";
  std::function<std::vector<int32_t>(const std::string&)> encode;
  if (is_char) {
    auto tok = std::make_shared<rl::CharTokenizer>(rl::CharTokenizer::load(src.tokenizer));
    encode = [tok](const std::string& s) { return tok->encode_prompt(s); };
  } else {
    auto tok = std::make_shared<io::Tokenizer>(io::Tokenizer::load(src.tokenizer));
    encode = [tok](const std::string& s) { return tok->encode(s); };
  }
  io::DatasetOptions dopt;
  dopt.max_examples = static_cast<size_t>(src.count);
  io::Dataset ds = io::load_jsonl(src.data, dopt);
  QUADS_CHECK(!ds.examples.empty(), "{}: no prompts", src.data);
  for (const auto& ex : ds.examples) {
    std::vector<int32_t> p = encode(ex.prompt);
    QUADS_CHECK(!p.empty(), "{}:{}: the prompt tokenizes to nothing", src.data, ex.line);
    if (p.size() > static_cast<size_t>(src.max_len)) p.resize(static_cast<size_t>(src.max_len));
    for (int32_t t : p)
      QUADS_CHECK(src.vocab <= 0 || t < src.vocab, "{}:{}: token id {} is outside the model's vocabulary of {}",
                  src.data, ex.line, t, src.vocab);
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace quads::analysis
