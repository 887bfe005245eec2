#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>

#include "common/error.h"
#include "io/dataset.h"

using namespace quads::io;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const quads::Error& e) {
    return e.what();
  }
  return "";
}

const char* kMixed =
    "{\"prompt\": \"What is 2+2?\", \"answer\": \"4\"}\n"
    "\n"
    "{\"prompt\": \"Half of 3?\", \"answer\": \"3/2\", \"extra\": 1}\r\n"
    "{\"prompt\": \"broken\", \"answer\": \n"
    "{\"prompt\": \"no answer\"}\n"
    "{\"prompt\": \"numeric\", \"answer\": 7}\n"
    "[1, 2]\n"
    "   \n"
    "{\"prompt\": \"Caf\\u00e9 \xE2\x82\xAC?\", \"answer\": \"5\"}";  // no final newline

}  // namespace

TEST(Dataset, ParsesGoodLinesWithLineNumbers) {
  std::string text =
      "{\"prompt\": \"a\", \"answer\": \"1\"}\n\n{\"answer\": \"2\", \"prompt\": \"b\\nc\"}\r\n";
  Dataset d = parse_jsonl(text, "mem.jsonl");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.examples[0].prompt, "a");
  EXPECT_EQ(d.examples[0].answer, "1");
  EXPECT_EQ(d.examples[0].line, 1);
  EXPECT_EQ(d.examples[1].prompt, "b\nc");
  EXPECT_EQ(d.examples[1].line, 3);
  EXPECT_EQ(d.skipped, 0u);
}

// Fatal by default: the message names the file, the line and the reason.
TEST(Dataset, BadLineIsFatalByDefault) {
  std::string msg = error_of([] { parse_jsonl(kMixed, "mixed.jsonl"); });
  EXPECT_NE(msg.find("mixed.jsonl:4:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;

  msg = error_of([] { parse_jsonl("{\"prompt\": \"x\"}\n", "f.jsonl"); });
  EXPECT_NE(msg.find("f.jsonl:1: no field 'answer'"), std::string::npos) << msg;
  msg = error_of([] { parse_jsonl("{\"prompt\": \"x\", \"answer\": 3}\n", "f.jsonl"); });
  EXPECT_NE(msg.find("f.jsonl:1: field 'answer' is number, not a string"), std::string::npos) << msg;
  msg = error_of([] { parse_jsonl("\n\n\"just a string\"\n", "f.jsonl"); });
  EXPECT_NE(msg.find("f.jsonl:3: not a JSON object"), std::string::npos) << msg;
}

TEST(Dataset, SkipsBadLinesAndCountsThem) {
  DatasetOptions opt;
  opt.skip_bad_lines = true;
  Dataset d = parse_jsonl(kMixed, "mixed.jsonl", opt);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d.examples[0].line, 1);
  EXPECT_EQ(d.examples[1].line, 3);
  EXPECT_EQ(d.examples[1].answer, "3/2");
  EXPECT_EQ(d.examples[2].line, 9);
  EXPECT_EQ(d.examples[2].prompt, "Caf\xC3\xA9 \xE2\x82\xAC?");
  EXPECT_EQ(d.skipped, 4u);
  ASSERT_EQ(d.warnings.size(), 4u);
  EXPECT_EQ(d.warnings[0].rfind("mixed.jsonl:4: not valid JSON", 0), 0u) << d.warnings[0];
  EXPECT_EQ(d.warnings[1], "mixed.jsonl:5: no field 'answer'");
  EXPECT_EQ(d.warnings[2], "mixed.jsonl:6: field 'answer' is number, not a string");
  EXPECT_EQ(d.warnings[3], "mixed.jsonl:7: not a JSON object");
}

TEST(Dataset, ConfigurableAndNestedFields) {
  std::string text =
      "{\"question\": \"q1\", \"meta\": {\"solution\": \"s1\"}}\n"
      "{\"question\": \"q2\", \"meta.solution\": \"flat\", \"meta\": {\"solution\": \"nested\"}}\n";
  DatasetOptions opt;
  opt.prompt_field = "question";
  opt.answer_field = "meta.solution";
  Dataset d = parse_jsonl(text, "nested.jsonl", opt);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.examples[0].prompt, "q1");
  EXPECT_EQ(d.examples[0].answer, "s1");
  EXPECT_EQ(d.examples[1].answer, "flat");  // an exact key wins over the path
  opt.answer_field = "meta.missing";
  std::string msg = error_of([&] { parse_jsonl(text, "nested.jsonl", opt); });
  EXPECT_NE(msg.find("nested.jsonl:1: no field 'meta.missing'"), std::string::npos) << msg;
  opt.max_examples = 1;
  opt.answer_field = "meta.solution";
  EXPECT_EQ(parse_jsonl(text, "nested.jsonl", opt).size(), 1u);
}

TEST(Dataset, LoadsFilesAndNamesMissingOnes) {
  std::string path = ::testing::TempDir() + "quads_dataset_test.jsonl";
  {
    std::ofstream f(path, std::ios::binary);
    f << "\xEF\xBB\xBF{\"prompt\": \"p\", \"answer\": \"a\"}\n{\"prompt\": 1, \"answer\": \"a\"}\n";
  }
  std::string msg = error_of([&] { load_jsonl(path); });
  EXPECT_NE(msg.find(path + ":2: field 'prompt' is number"), std::string::npos) << msg;
  DatasetOptions opt;
  opt.skip_bad_lines = true;
  Dataset d = load_jsonl(path, opt);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d.examples[0].prompt, "p");
  EXPECT_EQ(d.skipped, 1u);
  std::remove(path.c_str());
  msg = error_of([&] { load_jsonl(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

// Each epoch visits every example once; the order is fixed by the seed and changes per epoch.
TEST(Dataset, SamplerEpochsArePermutations) {
  PromptSampler s(10, 42);
  std::vector<size_t> first = s.next(10), second = s.next(10);
  EXPECT_EQ(std::set<size_t>(first.begin(), first.end()).size(), 10u);
  EXPECT_EQ(std::set<size_t>(second.begin(), second.end()).size(), 10u);
  EXPECT_NE(first, second);
  EXPECT_EQ(s.epoch(), 1u);
  EXPECT_EQ(first, s.permutation(0));

  PromptSampler again(10, 42), other(10, 43);
  EXPECT_EQ(again.next(20), [&] { auto v = first; v.insert(v.end(), second.begin(), second.end()); return v; }());
  EXPECT_NE(other.next(10), first);

  // A batch that crosses an epoch boundary, then a resumed sampler continues identically.
  PromptSampler a(7, 5);
  a.next(5);
  std::vector<size_t> cross = a.next(4);  // 2 from epoch 0, 2 from epoch 1
  EXPECT_EQ(a.epoch(), 1u);
  EXPECT_EQ(a.position(), 2u);
  PromptSampler b(7, 5);
  b.restore(a.epoch(), a.position());
  EXPECT_EQ(b.next(9), a.next(9));
  EXPECT_THROW(PromptSampler(0, 1), quads::Error);
  EXPECT_THROW(b.restore(0, 8), quads::Error);
}

// The permutation is uniform enough that every position sees every element over many epochs.
TEST(Dataset, SamplerCoversPositions) {
  PromptSampler s(5, 9);
  int seen[5][5] = {};
  for (uint64_t e = 0; e < 400; ++e) {
    auto p = s.permutation(e);
    for (size_t i = 0; i < 5; ++i) seen[i][p[i]]++;
  }
  for (auto& row : seen)
    for (int c : row) EXPECT_GT(c, 40);  // expected 80 each
}
