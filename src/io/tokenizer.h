#pragma once
// A Hugging Face `tokenizer.json` loader for the byte-level BPE kind Qwen2/Qwen3 ship, encoding and
// decoding exactly as the `tokenizers` library does (reference: fixtures/tokenizer_bpe/cases.json).
//
// encode(text):
//   1. added tokens are split out first: `normalized: false` ones on the raw text, then the
//      remaining pieces are normalized and `normalized: true` ones are split out of them
//      (leftmost-longest matching, honouring single_word / lstrip / rstrip),
//   2. normalizer (NFC, NFD, NFKC, NFKD, or a Sequence of them; utf8proc),
//   3. pre-tokenizer (Split with a PCRE2 regex or literal, ByteLevel, or a Sequence of them),
//   4. BPE per pre-token (rank-ordered merges with a priority queue, results cached), with
//      ignore_merges, byte_fallback, unk_token/fuse_unk, continuing_subword_prefix and
//      end_of_word_suffix as HF defines them.
// decode(ids): token strings (added tokens by content) -> ByteLevel decoder -> UTF-8 with invalid
// sequences replaced by U+FFFD the way Rust's String::from_utf8_lossy does.
// Anything else in the file (another model type, normalizer, pre-tokenizer, decoder,
// post-processor, truncation, padding, dropout) is rejected with an error naming the field.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace quads::io {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

class Tokenizer {
 public:
  // Reads and validates a tokenizer.json; throws quads::Error naming the file and the field.
  static Tokenizer load(const std::string& path);
  // The same from the JSON text; `origin` names the source in error messages.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& origin);

  // Text must be valid UTF-8 (throws naming the byte offset otherwise). Thread-safe.
  std::vector<int32_t> encode(std::string_view text) const;
  // Ids that name no token are dropped, as HF does. Thread-safe.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // The bytes one token stands for (the ByteLevel mapping undone, added tokens as their content);
  // a token may hold part of a UTF-8 character. For streaming output of generated tokens.
  std::string token_bytes(int32_t id) const;

  // One past the largest id of the model vocabulary and the added tokens.
  int32_t vocab_size() const;
  // Added tokens first, then the model vocabulary (token strings in their byte-level form).
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token string of an id (byte-level form); throws naming the id if there is none.
  std::string id_to_token(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;
  bool is_special(int32_t id) const;
  // Id of an added/special token such as "<|im_end|>"; throws naming the file and the token.
  int32_t special_id(std::string_view content) const;
  const std::string& path() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable after load (the BPE cache locks itself)
};

// The prompt format for Qwen-style chat models (docs/tokenizer.md):
//   [<|im_start|>system\n{system}<|im_end|>\n]<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n
// The system turn is left out when `system` is empty. The end of an answer is <|im_end|>.
std::string chat_prompt(std::string_view user, std::string_view system = {});
// chat_prompt encoded; throws if the tokenizer lacks <|im_start|> or <|im_end|>.
std::vector<int32_t> encode_chat_prompt(const Tokenizer& tok, std::string_view user,
                                        std::string_view system = {});

// UTF-8 helpers shared with the datasets and verifiers.
// Byte offset of the first invalid UTF-8 sequence, or npos when `s` is valid.
size_t utf8_invalid_offset(std::string_view s);
// Invalid sequences replaced by U+FFFD, one per maximal invalid subpart (as Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

}  // namespace quads::io
