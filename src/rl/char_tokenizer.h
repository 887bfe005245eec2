#pragma once
// Character-level tokenizer for the RL tasks (src/rl/tasks.h): one token per character of a small
// fixed vocabulary plus three specials. It travels with a checkpoint as a JSON file so that a
// model is always decoded with the vocabulary it was trained with.
//
// Default vocabulary (id: token), 50 tokens:
//   0 <pad>   1 <bos>   2 <eos>
//   3 '\n'    4 ' '     5..14 '0'..'9'
//   15 '+'  16 '-'  17 '*'  18 '='  19 '>'  20 '('  21 ')'  22 ','  23 ':'
//   24..49 'a'..'z'
// The model's embedding table may be larger (padded to a multiple of 8 or 64); ids >= vocab_size()
// are never produced by encode() and are rejected by decode().
//
// JSON file (tokenizer.json in a checkpoint folder):
//   {"type": "quads-char", "version": 1, "pad_id": 0, "bos_id": 1, "eos_id": 2,
//    "tokens": ["<pad>", "<bos>", "<eos>", "\n", " ", "0", ...]}
// The id of a token is its index in "tokens"; every token that is not a special is exactly one
// byte (printable ASCII or '\n').
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace quads::rl {

class CharTokenizer {
 public:
  CharTokenizer();  // the default vocabulary above

  // Builds from the JSON form; `origin` (a file name) is named in every error.
  static CharTokenizer from_json(const nlohmann::json& j, const std::string& origin);
  static CharTokenizer load(const std::string& path);
  nlohmann::json to_json() const;
  void save(const std::string& path) const;  // atomic (temporary file + rename)

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  int32_t pad_id() const { return pad_; }
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  bool is_special(int32_t id) const { return id == pad_ || id == bos_ || id == eos_; }
  const std::string& token(int32_t id) const;  // throws on an id outside the vocabulary

  bool has_char(char c) const { return char_to_id_[static_cast<unsigned char>(c)] >= 0; }
  int32_t char_id(char c) const;  // throws naming the character

  // Characters to ids, no specials added. Throws quads::Error on the first character outside the
  // vocabulary, naming it (printable form and hex) and its byte position in `text`.
  std::vector<int32_t> encode(std::string_view text) const;
  // BOS followed by encode(prompt): what the model is fed before it generates.
  std::vector<int32_t> encode_prompt(std::string_view prompt) const;

  // Ids to text. Specials are rendered as "<pad>", "<bos>", "<eos>"; an id outside the vocabulary
  // throws naming the id and its position.
  std::string decode(std::span<const int32_t> ids) const;

  bool operator==(const CharTokenizer& o) const {
    return tokens_ == o.tokens_ && pad_ == o.pad_ && bos_ == o.bos_ && eos_ == o.eos_;
  }

 private:
  void index(const std::string& origin);
  std::vector<std::string> tokens_;
  int32_t pad_ = 0, bos_ = 1, eos_ = 2;
  int32_t char_to_id_[256];
};

}  // namespace quads::rl
