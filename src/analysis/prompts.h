#pragma once
// Token-id prompts for calibration and analysis: from a JSONL dataset with a tokenizer file, or
// random ids when no data is given.
#include <cstdint>
#include <string>
#include <vector>

namespace quads::analysis {

struct PromptSource {
  std::string data;       // JSONL with a "prompt" field (io::load_jsonl); empty: random token ids
  std::string tokenizer;  // tokenizer file: HF tokenizer.json or quads' char tokenizer JSON
  int count = 16;         // prompts
  int max_len = 64;       // tokens per prompt at most (longer ones are cut); random ones: exactly
  int vocab = 0;          // random ids are drawn in [0, vocab)
  uint64_t seed = 0;      // random ids (a dataset gives its first `count` prompts)
};

// Throws quads::Error naming the file when the data or tokenizer cannot be read, or a prompt
// tokenizes to nothing or to ids >= vocab (when vocab > 0).
std::vector<std::vector<int32_t>> load_prompts(const PromptSource& src);

}  // namespace quads::analysis
