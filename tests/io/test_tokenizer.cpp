#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/fixtures.h"
#include "io/tokenizer.h"

#include <utf8proc.h>

using quads::io::Tokenizer;
using json = nlohmann::json;

namespace {

std::string fixture_tokenizer() { return quads::fixtures_dir() + "/tokenizer_bpe/tokenizer.json"; }

json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

const Tokenizer& fixture() {
  static const Tokenizer tok = Tokenizer::load(fixture_tokenizer());
  return tok;
}

// A tokenizer over single characters: no pre-tokenizer, so every character (or merge) is a token
// and the expected ids can be written down by hand.
json char_tokenizer(const std::string& chars, json added = json::array()) {
  json vocab = json::object();
  int id = 0;
  for (char c : chars) vocab[std::string(1, c)] = id++;
  return json{{"version", "1.0"},     {"truncation", nullptr}, {"padding", nullptr},
              {"added_tokens", added}, {"normalizer", nullptr}, {"pre_tokenizer", nullptr},
              {"post_processor", nullptr}, {"decoder", nullptr},
              {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                         {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                         {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                         {"vocab", vocab}, {"merges", json::array()}}}};
}

json added_token(int id, const std::string& content, bool lstrip, bool rstrip, bool single_word,
                 bool normalized, bool special = true) {
  return {{"id", id},         {"content", content},       {"single_word", single_word},
          {"lstrip", lstrip}, {"rstrip", rstrip},         {"normalized", normalized},
          {"special", special}};
}

Tokenizer make(const json& j) { return Tokenizer::from_json_text(j.dump(), "test"); }

std::vector<int32_t> ids_of(const Tokenizer& t, const std::string& chars_or_tokens) {
  std::vector<int32_t> ids;
  for (char c : chars_or_tokens) ids.push_back(*t.token_to_id(std::string(1, c)));
  return ids;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const quads::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Every case HF tokenizers produced: ids exactly, and the text its decode gave back.
TEST(Tokenizer, FixtureCasesMatchHuggingFace) {
  const Tokenizer& tok = fixture();
  json cases = read_json(quads::fixtures_dir() + "/tokenizer_bpe/cases.json");
  ASSERT_GE(cases.size(), 50u);
  for (const auto& c : cases) {
    std::string text = c["text"];
    std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text), want) << "text: " << text;
    EXPECT_EQ(tok.decode(want, /*skip_special_tokens=*/true), c["decoded"].get<std::string>()) << "text: " << text;
  }
}

// Without skipping, special tokens decode to their content, so the chat case reads back whole.
TEST(Tokenizer, FixtureSpecialTokens) {
  const Tokenizer& tok = fixture();
  EXPECT_EQ(tok.special_id("<|endoftext|>"), 0);
  EXPECT_EQ(tok.special_id("<|im_start|>"), 1);
  EXPECT_EQ(tok.special_id("<|im_end|>"), 2);
  EXPECT_TRUE(tok.is_special(2));
  EXPECT_FALSE(tok.is_special(74));
  EXPECT_EQ(tok.vocab_size(), 540);
  std::string text = "<|im_start|>user\nWhat is 2+2?<|im_end|>";
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  // Adjacent specials with no text between them, and one glued to a word.
  std::vector<int32_t> ids = tok.encode("<|im_end|><|im_start|>x<|endoftext|>");
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 1);
  EXPECT_EQ(ids[3], 0);
  // A broken special token is plain text.
  std::vector<int32_t> plain = tok.encode("<|im_end|");
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 2), 0);
  EXPECT_EQ(tok.decode(plain), "<|im_end|");
  EXPECT_THROW(tok.special_id("<|nope|>"), quads::Error);
}

// decode(encode(s)) gives s back for any text already in NFC (precomposed characters only).
TEST(Tokenizer, RoundTripRandomText) {
  const Tokenizer& tok = fixture();
  const std::vector<std::string> atoms = {"a", "b", "the", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "7",
                                          "12", ".", ",", "?!", "é", "Ü", "ï", "中", "文", "😀", "🙂",
                                          "👍🏽", "ß", "Ω", "—", "\xC2\xA0", "\u3000", "x2", "'", "\"",
                                          "{", "}", "\\frac", "$", "<|", "|>", "<|im_end|>"};
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    int n = int(rng() % 40);
    for (int i = 0; i < n; ++i) s += atoms[rng() % atoms.size()];
    std::vector<int32_t> ids = tok.encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size());
    EXPECT_EQ(tok.decode(ids), s);
  }
}

// Decomposed input is normalized (NFC) before BPE: both spellings give the same ids.
TEST(Tokenizer, NfcNormalization) {
  const Tokenizer& tok = fixture();
  EXPECT_EQ(tok.encode("cafe\xCC\x81"), tok.encode("caf\xC3\xA9"));
  EXPECT_EQ(tok.decode(tok.encode("cafe\xCC\x81")), "caf\xC3\xA9");
  EXPECT_EQ(tok.encode("A\xCC\x8A"), tok.encode("\xC3\x85"));  // A + ring -> Å
}

// decode(encode(s)) is NFC(s) for text full of combining sequences (marks after ASCII letters,
// after accented letters, reordered marks, Hangul jamo), with utf8proc's whole-string NFC as the
// reference for the tokenizer's run-by-run normalization.
TEST(Tokenizer, NfcOfMixedCombiningText) {
  const Tokenizer& tok = fixture();
  const std::vector<std::string> atoms = {"e", "a", " ", "1", "\xCC\x81", "\xCC\x88", "\xCC\xA3", "\xC3\xA9",
                                          "\xE1\x84\x80", "\xE1\x85\xA1", "\xE1\x86\xA8", "\xE2\x84\xAB",
                                          "\n", "x", "\xEF\xAC\x81"};
  std::mt19937 rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    int n = int(rng() % 30);
    for (int i = 0; i < n; ++i) s += atoms[rng() % atoms.size()];
    utf8proc_uint8_t* nfc = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
    ASSERT_TRUE(nfc);
    std::string want(reinterpret_cast<char*>(nfc));
    std::free(nfc);
    EXPECT_EQ(tok.decode(tok.encode(s)), want) << s;
  }
}

TEST(Tokenizer, EmptyAndLongInputs) {
  const Tokenizer& tok = fixture();
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode(std::vector<int32_t>{}), "");
  // Long runs exercise the regex engine's limits (\s+(?!\S) backtracks over the whole run).
  std::string s = std::string(200000, ' ') + "x" + std::string(100000, '\n') + std::string(50000, '7');
  std::vector<int32_t> ids = tok.encode(s);
  EXPECT_EQ(tok.decode(ids), s);
  EXPECT_GE(ids.size(), 50000u);  // digits are split one by one
}

TEST(Tokenizer, RejectsInvalidUtf8Input) {
  const Tokenizer& tok = fixture();
  std::string msg = error_of([&] { tok.encode("ab\xFF" "cd"); });
  EXPECT_NE(msg.find("not valid UTF-8 (byte 2)"), std::string::npos) << msg;
  EXPECT_THROW(tok.encode("\xED\xA0\x80"), quads::Error);  // a surrogate
}

// Decoding ids of a split character gives U+FFFD, as String::from_utf8_lossy does; ids that name
// no token are dropped.
TEST(Tokenizer, DecodeLossyAndUnknownIds) {
  const Tokenizer& tok = fixture();
  std::vector<int32_t> ids = tok.encode("😀");  // 4 bytes, more than one token here
  ASSERT_GE(ids.size(), 2u);
  std::vector<int32_t> head(ids.begin(), ids.end() - 1);
  EXPECT_EQ(tok.decode(head), "\xEF\xBF\xBD");
  std::string bytes;
  for (int32_t id : ids) bytes += tok.token_bytes(id);
  EXPECT_EQ(bytes, "😀");
  std::vector<int32_t> with_bad = {-1, 74, 100000, 71};
  EXPECT_EQ(tok.decode(with_bad), tok.decode(std::vector<int32_t>{74, 71}));
  EXPECT_THROW(tok.id_to_token(100000), quads::Error);
}

TEST(Tokenizer, Utf8Lossy) {
  using quads::io::utf8_lossy;
  EXPECT_EQ(utf8_lossy("plain ascii"), "plain ascii");
  const std::string R = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_lossy("Hello\xF0\x90\x80World"), "Hello" + R + "World");  // truncated 4-byte: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), R + R + R);                       // surrogate: one per byte
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), R + R);                               // overlong
  EXPECT_EQ(utf8_lossy("\xE2\x82"), R);                                   // truncated at the end
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), R + R + R + R);               // above U+10FFFF
  EXPECT_EQ(utf8_lossy("\xE2\x82\xAC"), "\xE2\x82\xAC");                  // a valid euro sign
  EXPECT_EQ(quads::io::utf8_invalid_offset("ok\xE2\x82"), 2u);
}

// The rank-ordered queue merge equals the textbook loop: merge the lowest-rank pair (leftmost on
// ties) until none is left. Random merge tables over a 4-letter alphabet, random words.
TEST(Tokenizer, BpeMatchesNaiveMerging) {
  std::mt19937 rng(7);
  for (int table = 0; table < 20; ++table) {
    json j = char_tokenizer("abcd");
    std::vector<std::string> tokens = {"a", "b", "c", "d"};
    std::map<std::string, int> vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"d", 3}};
    std::vector<std::pair<std::string, std::string>> merges;
    std::map<std::pair<std::string, std::string>, int> rank;
    while (merges.size() < 25) {
      const std::string& x = tokens[rng() % tokens.size()];
      const std::string& y = tokens[rng() % tokens.size()];
      if (rank.count({x, y}) || x.size() + y.size() > 8) continue;
      rank[{x, y}] = int(merges.size());
      merges.push_back({x, y});
      if (!vocab.count(x + y)) {
        vocab[x + y] = int(vocab.size());
        tokens.push_back(x + y);
      }
    }
    for (auto& [t, id] : vocab) j["model"]["vocab"][t] = id;
    for (auto& [x, y] : merges) j["model"]["merges"].push_back({x, y});
    Tokenizer tok = make(j);
    for (int w = 0; w < 50; ++w) {
      std::string word;
      int n = 1 + int(rng() % 20);
      for (int i = 0; i < n; ++i) word += "abcd"[rng() % 4];
      std::vector<std::string> sym;
      for (char c : word) sym.push_back(std::string(1, c));
      for (;;) {
        int best = -1, best_rank = INT32_MAX;
        for (size_t i = 0; i + 1 < sym.size(); ++i) {
          auto it = rank.find({sym[i], sym[i + 1]});
          if (it != rank.end() && it->second < best_rank) best_rank = it->second, best = int(i);
        }
        if (best < 0) break;
        sym[size_t(best)] += sym[size_t(best) + 1];
        sym.erase(sym.begin() + best + 1);
      }
      std::vector<int32_t> want;
      for (auto& s : sym) want.push_back(vocab[s]);
      ASSERT_EQ(tok.encode(word), want) << "table " << table << " word " << word;
    }
  }
}

TEST(Tokenizer, IgnoreMergesAndByteFallbackAndUnk) {
  json j = char_tokenizer("abc");
  j["model"]["vocab"]["abc"] = 3;
  Tokenizer plain = make(j);
  EXPECT_EQ(plain.encode("abc"), (std::vector<int32_t>{0, 1, 2}));  // no merge leads to "abc"
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(make(j).encode("abc"), (std::vector<int32_t>{3}));  // whole pre-token in the vocab
  EXPECT_EQ(make(j).encode("abca"), (std::vector<int32_t>{0, 1, 2, 0}));

  // 'é' is not in the vocab: dropped without unk, <0xC3><0xA9> with byte_fallback, unk otherwise.
  json k = char_tokenizer("ab");
  EXPECT_EQ(make(k).encode("a\xC3\xA9" "b"), (std::vector<int32_t>{0, 1}));
  k["model"]["vocab"]["<unk>"] = 2;
  k["model"]["unk_token"] = "<unk>";
  EXPECT_EQ(make(k).encode("a\xC3\xA9\xC3\xA9" "b"), (std::vector<int32_t>{0, 2, 2, 1}));
  k["model"]["fuse_unk"] = true;
  EXPECT_EQ(make(k).encode("a\xC3\xA9\xC3\xA9" "b"), (std::vector<int32_t>{0, 2, 1}));
  k["model"]["vocab"]["<0xC3>"] = 3;
  k["model"]["vocab"]["<0xA9>"] = 4;
  k["model"]["byte_fallback"] = true;
  EXPECT_EQ(make(k).encode("a\xC3\xA9" "b"), (std::vector<int32_t>{0, 3, 4, 1}));
}

// lstrip/rstrip take the whitespace next to the token into it; single_word matches only between
// non-word characters; leftmost-longest wins among overlapping added tokens.
TEST(Tokenizer, AddedTokenFlags) {
  json added = json::array({added_token(100, "[L]", true, false, false, false),
                            added_token(101, "[R]", false, true, false, false),
                            added_token(102, "[W]", false, false, true, false),
                            added_token(103, "<a>", false, false, false, false),
                            added_token(104, "<a><b>", false, false, false, false)});
  Tokenizer tok = make(char_tokenizer("ab []LRW<>", added));
  auto c = [&](const std::string& s) { return ids_of(tok, s); };
  auto cat = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  EXPECT_EQ(tok.encode("a  [L] b"), cat(cat(c("a"), {100}), c(" b")));
  EXPECT_EQ(tok.encode("a [R]  b"), cat(cat(c("a "), {101}), c("b")));
  EXPECT_EQ(tok.encode("[L]"), (std::vector<int32_t>{100}));
  EXPECT_EQ(tok.encode("a [W] b"), cat(cat(c("a "), {102}), c(" b")));
  EXPECT_EQ(tok.encode("[W]"), (std::vector<int32_t>{102}));
  EXPECT_EQ(tok.encode("a[W] b"), c("a[W] b"));
  EXPECT_EQ(tok.encode("a [W]b"), c("a [W]b"));
  EXPECT_EQ(tok.encode("<a><b>"), (std::vector<int32_t>{104}));
  EXPECT_EQ(tok.encode("<a><a>"), (std::vector<int32_t>{103, 103}));
  EXPECT_EQ(tok.encode("<a><b"), cat({103}, c("<b")));
  EXPECT_EQ(tok.vocab_size(), 105);
  EXPECT_FALSE(tok.is_special(0));
  EXPECT_TRUE(tok.is_special(104));
}

// `normalized: false` tokens match the raw text; `normalized: true` ones match after NFC, with
// their own content normalized too.
TEST(Tokenizer, AddedTokensAndNormalization) {
  const std::string A_ring = "\xC3\x85", A_decomposed = "A\xCC\x8A";
  json added = json::array({added_token(50, "[" + A_ring + "]", false, false, false, false),
                            added_token(51, "{" + A_decomposed + "}", false, false, false, true, false)});
  json j = char_tokenizer("A[]{}", added);
  j["normalizer"] = {{"type", "NFC"}};
  j["model"]["vocab"][A_ring] = 5;
  Tokenizer tok = make(j);
  EXPECT_EQ(tok.encode("[" + A_ring + "]"), (std::vector<int32_t>{50}));
  EXPECT_EQ(tok.encode("[" + A_decomposed + "]"), (std::vector<int32_t>{1, 5, 2}));  // raw text differs
  EXPECT_EQ(tok.encode("{" + A_ring + "}"), (std::vector<int32_t>{51}));
  EXPECT_EQ(tok.encode("{" + A_decomposed + "}"), (std::vector<int32_t>{51}));
  // Decoding gives the normalized content of a normalized added token (no decoder: joined by spaces).
  EXPECT_EQ(tok.decode(std::vector<int32_t>{51}), "{" + A_ring + "}");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{0, 5}), "A " + A_ring);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{50, 0}, true), "A");  // special skipped
  EXPECT_EQ(tok.decode(std::vector<int32_t>{51, 0}, true), "{" + A_ring + "} A");  // not special
}

TEST(Tokenizer, SplitBehaviors) {
  auto with_split = [](const std::string& behavior, bool invert) {
    json j = char_tokenizer("ab-");
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}};
    j["model"]["vocab"]["ab"] = 3;
    j["model"]["vocab"]["b-"] = 4;
    j["model"]["vocab"]["-a"] = 5;
    j["model"]["vocab"]["--"] = 6;
    j["model"]["merges"] = json::array({json::array({"a", "b"}), json::array({"b", "-"}), json::array({"-", "a"}),
                                        json::array({"-", "-"})});
    return make(j);
  };
  // "ab-ab": merges within a piece show where the cuts are.
  EXPECT_EQ(with_split("Isolated", false).encode("ab-ab"), (std::vector<int32_t>{3, 2, 3}));
  EXPECT_EQ(with_split("Removed", false).encode("ab-ab"), (std::vector<int32_t>{3, 3}));
  EXPECT_EQ(with_split("MergedWithPrevious", false).encode("ab-ab"), (std::vector<int32_t>{3, 2, 3}));
  EXPECT_EQ(with_split("Isolated", false).encode("b-a"), (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(with_split("MergedWithNext", false).encode("b-a"), (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(with_split("MergedWithPrevious", false).encode("b-a"), (std::vector<int32_t>{4, 0}));
  EXPECT_EQ(with_split("Isolated", false).encode("a--b"), (std::vector<int32_t>{0, 2, 2, 1}));
  EXPECT_EQ(with_split("Contiguous", false).encode("a--b"), (std::vector<int32_t>{0, 6, 1}));
  EXPECT_EQ(with_split("Removed", true).encode("ab-ab"), (std::vector<int32_t>{2}));
}

TEST(Tokenizer, ErrorsNameTheField) {
  json j = read_json(fixture_tokenizer());
  auto msg = [&](const json& bad) { return error_of([&] { Tokenizer::from_json_text(bad.dump(), "tok.json"); }); };
  json m = j;
  m["model"]["type"] = "WordPiece";
  EXPECT_NE(msg(m).find("model.type"), std::string::npos) << msg(m);
  m = j;
  m["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(msg(m).find("normalizer.type"), std::string::npos) << msg(m);
  m = j;
  m["pre_tokenizer"]["pretokenizers"][0]["type"] = "Whitespace";
  EXPECT_NE(msg(m).find("pre_tokenizer.pretokenizers[0].type"), std::string::npos) << msg(m);
  m = j;
  m["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_NE(msg(m).find("pattern.Regex"), std::string::npos) << msg(m);
  m = j;
  m["decoder"] = {{"type", "WordPiece"}};
  EXPECT_NE(msg(m).find("decoder.type"), std::string::npos) << msg(m);
  m = j;
  m["post_processor"] = {{"type", "TemplateProcessing"}};
  EXPECT_NE(msg(m).find("post_processor.type"), std::string::npos) << msg(m);
  m = j;
  m["model"]["dropout"] = 0.1;
  EXPECT_NE(msg(m).find("model.dropout"), std::string::npos) << msg(m);
  m = j;
  m["model"]["merges"][3] = json::array({"Ġ", "no-such-token"});
  EXPECT_NE(msg(m).find("model.merges[3]"), std::string::npos) << msg(m);
  m = j;
  m["truncation"] = {{"max_length", 8}};
  EXPECT_NE(msg(m).find("truncation"), std::string::npos) << msg(m);
  EXPECT_NE(msg(json::array()).find("tok.json"), std::string::npos);
  std::string e = error_of([] { Tokenizer::from_json_text("{not json", "broken.json"); });
  EXPECT_NE(e.find("broken.json"), std::string::npos) << e;
  e = error_of([] { Tokenizer::load("/nonexistent/tokenizer.json"); });
  EXPECT_NE(e.find("/nonexistent/tokenizer.json"), std::string::npos) << e;
}

// Legacy "a b" merge strings load the same model as [a, b] pairs.
TEST(Tokenizer, LegacyMergeStrings) {
  json j = read_json(fixture_tokenizer());
  for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  Tokenizer legacy = Tokenizer::from_json_text(j.dump(), "legacy");
  for (const char* s : {"hello world", "The sum of 12345 and 678 is 13023.", "naïve café 数学推理"})
    EXPECT_EQ(legacy.encode(s), fixture().encode(s)) << s;
}

TEST(Tokenizer, ChatPromptFormat) {
  EXPECT_EQ(quads::io::chat_prompt("What is 2+2?"),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(quads::io::chat_prompt("q", "Be brief."),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n");
  std::vector<int32_t> ids = quads::io::encode_chat_prompt(fixture(), "What is 2+2?");
  ASSERT_GE(ids.size(), 6u);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 1), 2);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 1);
  EXPECT_EQ(fixture().decode(ids), quads::io::chat_prompt("What is 2+2?"));
  Tokenizer no_chat = make(char_tokenizer("ab"));
  EXPECT_THROW(quads::io::encode_chat_prompt(no_chat, "ab"), quads::Error);
}

// Concurrent encodes (sharing the BPE cache) give the same ids as sequential ones.
TEST(Tokenizer, ConcurrentEncodeIsConsistent) {
  Tokenizer tok = Tokenizer::load(fixture_tokenizer());  // fresh cache
  json cases = read_json(quads::fixtures_dir() + "/tokenizer_bpe/cases.json");
  std::vector<std::vector<int32_t>> got[2];
  auto work = [&](int t) {
    for (int rep = 0; rep < 20; ++rep)
      for (const auto& c : cases) got[t].push_back(tok.encode(c["text"].get<std::string>()));
  };
  std::thread a(work, 0), b(work, 1);
  a.join();
  b.join();
  ASSERT_EQ(got[0].size(), got[1].size());
  for (size_t i = 0; i < got[0].size(); ++i) EXPECT_EQ(got[0][i], cases[i % cases.size()]["ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(got[0], got[1]);
}

// `quads tokenize` prints {"ids": [...]} as its last line and decodes --decode lists.
TEST(Tokenizer, CliEncodesAndDecodes) {
  std::string bin = std::string(QUADS_BINARY_DIR) + "/quads";
  if (!std::ifstream(bin)) GTEST_SKIP() << "no quads binary at " << bin;
  auto run = [&](const std::string& args) {
    std::string out;
    FILE* p = popen((bin + " tokenize --tokenizer " + fixture_tokenizer() + " " + args + " 2>&1").c_str(), "r");
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    EXPECT_EQ(pclose(p), 0) << out;
    return out;
  };
  std::string out = run("--text 'The sum of 12345 and 678 is 13023.'");
  ASSERT_FALSE(out.empty());
  out.pop_back();
  json last = json::parse(out.substr(out.rfind('\n') + 1));
  EXPECT_EQ(last["ids"].get<std::vector<int32_t>>(), fixture().encode("The sum of 12345 and 678 is 13023."));
  EXPECT_EQ(run("--decode 74,71,78,345,264,280,78,70"), "hello world\n");
  EXPECT_EQ(run("--skip-special --decode 1,87,85,262,2"), "user\n");
}

// A GPT-2 style ByteLevel pre-tokenizer (its own regex, a prefix space) over the fixture's model:
// for words and single spaces it cuts where Qwen's regex does, after a space is put in front.
TEST(Tokenizer, ByteLevelWithRegexAndPrefixSpace) {
  json j = read_json(fixture_tokenizer());
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  Tokenizer gpt2 = Tokenizer::from_json_text(j.dump(), "gpt2-style");
  for (const char* s : {"hello world", "answer the scale is router", "naïve café"})
    EXPECT_EQ(gpt2.encode(s), fixture().encode(std::string(" ") + s)) << s;
  EXPECT_EQ(gpt2.encode(" x"), fixture().encode(" x"));  // no second space when one is there
  EXPECT_EQ(gpt2.decode(gpt2.encode("hello world")), " hello world");
}
