#pragma once
// Prompt/answer datasets for RL and evaluation, one JSON object per line (JSONL):
//   {"prompt": "What is 2+2?", "answer": "4"}
// Field names are configurable ("a.b" reaches into nested objects when no key "a.b" exists).
// A bad line (not JSON, not an object, a missing field, a field that is not a string) is an error
// naming the file and the line, or, with skip_bad_lines, is skipped and counted. Blank lines are
// ignored.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace quads::io {

struct Example {
  std::string prompt;
  std::string answer;
  int64_t line = 0;  // 1-based line in the file
};

struct DatasetOptions {
  std::string prompt_field = "prompt";
  std::string answer_field = "answer";
  bool skip_bad_lines = false;  // false: the first bad line throws quads::Error
  size_t max_examples = 0;      // 0: all
};

struct Dataset {
  std::string path;
  std::vector<Example> examples;
  size_t skipped = 0;                 // bad lines skipped
  std::vector<std::string> warnings;  // "file:line: reason" for the first 100 skipped lines
  size_t size() const { return examples.size(); }
};

Dataset load_jsonl(const std::string& path, const DatasetOptions& opt = {});
// The same from text in memory; `origin` stands for the file name in messages.
Dataset parse_jsonl(std::string_view text, const std::string& origin, const DatasetOptions& opt = {});

// Visits a dataset in shuffled epochs: every example once per epoch, a fresh permutation each
// epoch, the same sequence on every platform for a given seed (own RNG and Fisher-Yates, no
// std::shuffle). Its state is (epoch, position) so that a resumed run continues where it stopped.
class PromptSampler {
 public:
  PromptSampler(size_t dataset_size, uint64_t seed);
  // The next n example indices (crossing into the next epoch when this one runs out).
  std::vector<size_t> next(size_t n);
  uint64_t epoch() const { return epoch_; }
  size_t position() const { return pos_; }
  void restore(uint64_t epoch, size_t position);
  // The order of one epoch.
  std::vector<size_t> permutation(uint64_t epoch) const;

 private:
  size_t size_;
  uint64_t seed_;
  uint64_t epoch_ = 0;
  size_t pos_ = 0;
  std::vector<size_t> order_;
};

}  // namespace quads::io
