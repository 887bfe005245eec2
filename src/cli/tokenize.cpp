// quads tokenize: encode text with a Hugging Face tokenizer.json, or decode ids back to text.
//   quads tokenize --tokenizer tokenizer.json --text "hello"        -> last line {"ids": [...]}
//   quads tokenize --tokenizer tokenizer.json --decode 74,71,78     -> the text
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "common/error.h"
#include "io/tokenizer.h"

namespace {

struct Options {
  std::string tokenizer, text, decode;
  bool chat = false, skip_special = false, show_tokens = false;
  bool has_text = false, has_decode = false;
};

std::vector<int32_t> parse_ids(const std::string& list) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= list.size()) {
    size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    std::string item = list.substr(i, j - i);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (!item.empty() || j < list.size()) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      QUADS_CHECK(used == item.size() && used > 0 && v >= 0 && v <= INT32_MAX,
                  "--decode: '{}' is not a token id (expected a comma-separated list like 1,2,3)", item);
      ids.push_back(int32_t(v));
    }
    i = j + 1;
  }
  return ids;
}

int run(const Options& o) {
  QUADS_CHECK(o.has_text != o.has_decode, "tokenize: give either --text or --decode");
  auto tok = quads::io::Tokenizer::load(o.tokenizer);
  if (o.has_decode) {
    std::string text = tok.decode(parse_ids(o.decode), o.skip_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  }
  std::string text = o.chat ? quads::io::chat_prompt(o.text) : o.text;
  std::vector<int32_t> ids = tok.encode(text);
  if (o.show_tokens) {
    nlohmann::json pieces = nlohmann::json::array();
    for (int32_t id : ids) pieces.push_back(quads::io::utf8_lossy(tok.token_bytes(id)));
    std::printf("%s\n", pieces.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  std::printf("%zu tokens\n", ids.size());
  std::printf("%s\n", nlohmann::json{{"ids", ids}}.dump().c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--tokenizer", o->tokenizer, "Hugging Face tokenizer.json")->required();
  auto* text = app.add_option("--text", o->text, "text to encode");
  auto* dec = app.add_option("--decode", o->decode, "comma-separated ids to decode, e.g. 1,2,3");
  text->excludes(dec);
  app.add_flag("--chat", o->chat, "wrap --text in the chat prompt format (docs/tokenizer.md)");
  app.add_flag("--skip-special", o->skip_special, "with --decode: leave out special tokens");
  app.add_flag("--tokens", o->show_tokens, "with --text: also print each token's text");
  return [o, text, dec] {
    o->has_text = text->count() > 0;
    o->has_decode = dec->count() > 0;
    return run(*o);
  };
}

QUADS_COMMAND("tokenize", "Encode text to token ids, or decode ids to text, with a tokenizer.json", setup);

}  // namespace
