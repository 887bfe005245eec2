// Byte-level BPE as Hugging Face `tokenizers` runs it. The reference for every rule here is that
// library's behaviour (tokenizer/added_vocabulary.rs, pre_tokenizers/{split,byte_level}.rs,
// models/bpe/{model,word}.rs); tests/io/test_tokenizer.cpp checks it against ids HF produced.
#include "io/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "common/error.h"

namespace quads::io {

using json = nlohmann::json;

// ------------------------------------------------------------------------------------------------
// UTF-8

namespace {

// Length of the valid character at p[0..n), or 0 when invalid; then *bad is the length of the
// maximal subpart of a valid sequence found there (>= 1), which the lossy decoder replaces by one
// U+FFFD (the Unicode "maximal subpart" practice that Rust follows).
int utf8_char(const unsigned char* p, size_t n, size_t* bad) {
  unsigned char b = p[0];
  if (b < 0x80) return 1;
  int w;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    w = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    w = 3;
    if (b == 0xE0) lo = 0xA0;  // no overlong forms
    if (b == 0xED) hi = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    w = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *bad = 1;
    return 0;
  }
  for (int k = 1; k < w; ++k) {
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (size_t(k) >= n || p[k] < l || p[k] > h) {
      *bad = size_t(k);
      return 0;
    }
  }
  return w;
}

// Length of the character starting at s[i]; s is valid UTF-8.
inline int char_len(unsigned char b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

uint32_t decode_cp(const unsigned char* p, int len) {
  switch (len) {
    case 1: return p[0];
    case 2: return (uint32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3: return (uint32_t(p[0] & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    default:
      return (uint32_t(p[0] & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) |
             (uint32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
  }
}

void append_cp(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

// The last / first code point of a valid UTF-8 string (s non-empty).
uint32_t last_cp(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  auto p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  return decode_cp(p, char_len(p[0]));
}
uint32_t first_cp(std::string_view s) {
  auto p = reinterpret_cast<const unsigned char*>(s.data());
  return decode_cp(p, char_len(p[0]));
}

// Rust regex `\s`: the Unicode White_Space property.
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Rust regex `\w`: Alphabetic, marks, decimal digits, connector punctuation, join controls.
// Alphabetic is approximated by the letter categories plus Nl (its other members are marks).
bool is_word_char(uint32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

}  // namespace

size_t utf8_invalid_offset(std::string_view s) {
  auto p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0;
    int w = utf8_char(p + i, n - i, &bad);
    if (w == 0) return i;
    i += size_t(w);
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  auto p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0, n = bytes.size();
  std::string out;
  out.reserve(n);
  while (i < n) {
    size_t bad = 0;
    int w = utf8_char(p + i, n - i, &bad);
    if (w > 0) {
      out.append(bytes.data() + i, size_t(w));
      i += size_t(w);
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

namespace {

// ------------------------------------------------------------------------------------------------
// Byte-level alphabet: GPT-2's bytes_to_unicode. Printable bytes map to themselves, the other 68
// bytes to U+0100.. in byte order.

struct ByteLevelTables {
  std::string byte_to_utf8[256];
  int16_t cp_to_byte[0x144];  // -1: not a byte-level character
};

const ByteLevelTables& byte_level() {
  static const ByteLevelTables t = [] {
    ByteLevelTables t;
    std::fill(std::begin(t.cp_to_byte), std::end(t.cp_to_byte), int16_t(-1));
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      uint32_t cp = printable ? uint32_t(b) : next++;
      append_cp(t.byte_to_utf8[b], cp);
      t.cp_to_byte[cp] = int16_t(b);
    }
    return t;
  }();
  return t;
}

// The ByteLevel decoder on one token: every character mapped back to its byte, or the token's own
// bytes when any character is outside the byte-level alphabet.
void byte_level_unmap(const std::string& tok, std::string& out) {
  const auto& t = byte_level();
  auto p = reinterpret_cast<const unsigned char*>(tok.data());
  size_t mark = out.size();
  for (size_t i = 0; i < tok.size();) {
    int len = char_len(p[i]);
    uint32_t cp = decode_cp(p + i, len);
    if (cp >= 0x144 || t.cp_to_byte[cp] < 0) {
      out.resize(mark);
      out += tok;
      return;
    }
    out += char(t.cp_to_byte[cp]);
    i += size_t(len);
  }
}

// ------------------------------------------------------------------------------------------------
// PCRE2 regex with HF's iteration: non-overlapping matches left to right.

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& what) : source_(pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err,
                          &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("{}: cannot compile regex at offset {}: {}", what, size_t(off), reinterpret_cast<char*>(msg));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // optional: the interpreter is the fallback
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-empty matches [begin, end) in order. Empty matches are dropped: every split behaviour
  // discards empty pieces, and the patterns tokenizers use never match empty.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    QUADS_CHECK(md, "tokenizer: out of memory for regex match data");
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    uint32_t extra = 0;
    size_t start = 0, n = s.size();
    while (start <= n) {
      int rc = pcre2_match(code_, subject, n, start, PCRE2_NO_UTF_CHECK | extra, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !(extra & PCRE2_NO_JIT)) {
        extra |= PCRE2_NO_JIT;  // very long input: the interpreter keeps its stack on the heap
        continue;
      }
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        pcre2_match_data_free(md);
        fail("tokenizer: regex /{}/ failed on a {}-byte input: {}", source_, n, reinterpret_cast<char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t a = ov[0], b = ov[1];
      if (b > a) {
        out.emplace_back(a, b);
        start = b;
      } else {
        if (a >= n) break;
        start = a + size_t(char_len(static_cast<unsigned char>(s[a])));
      }
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  std::string source_;
  pcre2_code* code_ = nullptr;
};

// GPT-2's pattern, which the ByteLevel pre-tokenizer applies when use_regex is true.
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct Span {
  size_t off, len;
};

// HF's NormalizedString::split on buf[in]: the piece cut at the regex matches, the parts kept or
// merged per `behavior`; empty parts are dropped. Parts are appended to `out` as spans of `buf`.
void split_span(std::string_view buf, Span in, const Regex& re, Behavior behavior, bool invert,
                std::vector<Span>& out) {
  if (in.len == 0) return;
  std::string_view s = buf.substr(in.off, in.len);
  struct Seg {
    size_t a, b;
    bool match;
  };
  std::vector<Seg> segs;
  size_t prev = 0;
  for (auto [a, b] : re.find_all(s)) {
    if (prev != a) segs.push_back({prev, a, false});
    segs.push_back({a, b, true});
    prev = b;
  }
  if (prev != s.size()) segs.push_back({prev, s.size(), false});
  if (invert)
    for (auto& g : segs) g.match = !g.match;

  struct Cut {
    size_t a, b;
    bool remove;
  };
  std::vector<Cut> cuts;
  switch (behavior) {
    case Behavior::Isolated:
      for (auto& g : segs) cuts.push_back({g.a, g.b, false});
      break;
    case Behavior::Removed:
      for (auto& g : segs) cuts.push_back({g.a, g.b, g.match});
      break;
    case Behavior::Contiguous: {
      bool previous = false;
      for (auto& g : segs) {
        if (g.match == previous && !cuts.empty()) cuts.back().b = g.b;
        else cuts.push_back({g.a, g.b, false});
        previous = g.match;
      }
      break;
    }
    case Behavior::MergedWithPrevious: {
      bool previous = false;
      for (auto& g : segs) {
        if (g.match && !previous && !cuts.empty()) cuts.back().b = g.b;
        else cuts.push_back({g.a, g.b, false});
        previous = g.match;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool previous = false;
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !previous && !cuts.empty()) cuts.back().a = it->a;
        else cuts.push_back({it->a, it->b, false});
        previous = it->match;
      }
      std::reverse(cuts.begin(), cuts.end());
      break;
    }
  }
  for (auto& c : cuts)
    if (!c.remove && c.b > c.a) out.push_back({in.off + c.a, c.b - c.a});
}

// ------------------------------------------------------------------------------------------------
// Added-token matching: leftmost-longest, non-overlapping (HF builds an Aho-Corasick automaton with
// MatchKind::LeftmostLongest; a few dozen patterns bucketed by first byte do the same job).

class Matcher {
 public:
  void add(const std::string& pattern, int32_t id) {
    if (pattern.empty()) return;
    auto& bucket = by_first_[static_cast<unsigned char>(pattern[0])];
    for (auto& p : bucket)
      if (p.text == pattern) return;  // the first token with this text wins
    bucket.push_back({pattern, id});
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const Pat& x, const Pat& y) { return x.text.size() > y.text.size(); });
    any_ = true;
  }
  bool empty() const { return !any_; }
  bool find(std::string_view s, size_t from, size_t* start, size_t* end, int32_t* id) const {
    for (size_t i = from; i < s.size(); ++i) {
      const auto& bucket = by_first_[static_cast<unsigned char>(s[i])];
      for (const auto& p : bucket) {
        if (p.text.size() <= s.size() - i && std::memcmp(p.text.data(), s.data() + i, p.text.size()) == 0) {
          *start = i;
          *end = i + p.text.size();
          *id = p.id;
          return true;
        }
      }
    }
    return false;
  }

 private:
  struct Pat {
    std::string text;
    int32_t id;
  };
  std::vector<Pat> by_first_[256];
  bool any_ = false;
};

struct Piece {
  size_t a, b;
  int32_t id;  // -1: plain text
};

// ------------------------------------------------------------------------------------------------
// Pipeline parts

struct PreStep {
  enum Kind { Split, ByteLevel } kind = Split;
  std::unique_ptr<Regex> regex;  // Split's pattern, or GPT-2's for ByteLevel with use_regex
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;
};

// Hash maps keyed by std::string that can be searched with a string_view (no temporary string).
struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StrMap = std::unordered_map<std::string, V, SvHash, std::equal_to<>>;

struct Bpe {
  StrMap<int32_t> vocab;
  std::unordered_map<int32_t, std::string> vocab_r;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, merged id)
  std::optional<std::string> unk_token, prefix, suffix;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;

  // HF's cache: pre-tokens under 256 bytes, up to 10000 of them, then no more insertions.
  static constexpr size_t kCacheCapacity = 10000, kCacheMaxLen = 256;
  mutable std::mutex cache_mu;
  mutable StrMap<std::vector<int32_t>> cache;

  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  void tokenize(std::string_view w, std::vector<int32_t>& out) const {
    if (w.empty()) return;
    if (ignore_merges) {
      if (auto it = vocab.find(w); it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    if (w.size() < kCacheMaxLen) {
      std::lock_guard<std::mutex> lock(cache_mu);
      if (auto it = cache.find(w); it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = merge_word(w);
    out.insert(out.end(), ids.begin(), ids.end());
    if (w.size() < kCacheMaxLen) {
      std::lock_guard<std::mutex> lock(cache_mu);
      if (cache.size() < kCacheCapacity) cache.emplace(w, std::move(ids));
    }
  }

  int32_t unk_id() const {
    auto it = vocab.find(*unk_token);
    QUADS_CHECK(it != vocab.end(), "tokenizer: model.unk_token '{}' is not in model.vocab", *unk_token);
    return it->second;
  }

  std::vector<int32_t> merge_word(std::string_view w) const {
    struct Sym {
      int32_t c;
      int32_t prev, next;
      int32_t len;  // bytes; 0 once merged into its left neighbour
    };
    std::vector<Sym> syms;
    syms.reserve(w.size());
    auto add = [&](int32_t c, int32_t len) {
      int32_t n = int32_t(syms.size());
      if (n > 0) syms.back().next = n;
      syms.push_back({c, n - 1, -1, len});
    };
    bool have_unk = false;
    int32_t unk_c = 0, unk_len = 0;
    auto p = reinterpret_cast<const unsigned char*>(w.data());
    for (size_t i = 0; i < w.size();) {
      int len = char_len(p[i]);
      bool first = i == 0, last = i + size_t(len) == w.size();
      std::string s(w.substr(i, size_t(len)));
      if (!first && prefix) s = *prefix + s;
      if (last && suffix) s += *suffix;
      i += size_t(len);
      if (auto it = vocab.find(s); it != vocab.end()) {
        if (have_unk) add(unk_c, unk_len), have_unk = false;
        add(it->second, len);
        continue;
      }
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (unsigned char b : s) {
          auto bt = vocab.find(fmt::format("<0x{:02X}>", b));
          if (bt == vocab.end()) break;
          bytes.push_back(bt->second);
        }
        if (bytes.size() == s.size()) {
          for (int32_t t : bytes) add(t, 1);
          continue;
        }
      }
      if (unk_token) {
        if (have_unk && fuse_unk) {
          unk_len += len;
        } else {
          if (have_unk) add(unk_c, unk_len);
          unk_c = unk_id(), unk_len = len, have_unk = true;
        }
      }
      // Without an unk token the character is dropped, as HF does.
    }
    if (have_unk) add(unk_c, unk_len);

    struct Merge {
      int32_t rank, pos, new_id;
      bool operator<(const Merge& o) const {  // the queue's top: lowest rank, then leftmost
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Merge> queue;
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      if (auto it = merges.find(key(syms[i].c, syms[i + 1].c)); it != merges.end())
        queue.push({it->second.first, int32_t(i), it->second.second});
    while (!queue.empty()) {
      Merge top = queue.top();
      queue.pop();
      Sym& cur = syms[size_t(top.pos)];
      if (cur.len == 0 || cur.next == -1) continue;
      Sym right = syms[size_t(cur.next)];
      auto it = merges.find(key(cur.c, right.c));
      if (it == merges.end() || it->second.second != top.new_id) continue;  // stale entry
      syms[size_t(cur.next)].len = 0;
      cur.c = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;
      if (cur.prev >= 0) {
        if (auto m = merges.find(key(syms[size_t(cur.prev)].c, cur.c)); m != merges.end())
          queue.push({m->second.first, cur.prev, m->second.second});
      }
      if (cur.next >= 0) {
        if (auto m = merges.find(key(cur.c, syms[size_t(cur.next)].c)); m != merges.end())
          queue.push({m->second.first, top.pos, m->second.second});
      }
    }
    std::vector<int32_t> ids;
    for (const Sym& s : syms)
      if (s.len != 0) ids.push_back(s.c);
    return ids;
  }
};

}  // namespace

// ------------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string path;
  std::vector<int> normalizers;  // utf8proc option sets, applied in order
  bool has_pre = false;
  std::vector<PreStep> pre;
  Bpe bpe;
  bool byte_level_decoder = false;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_map;      // content -> id
  std::unordered_map<int32_t, size_t> added_index;         // id -> index in `added`
  std::unordered_map<int32_t, std::string> added_display;  // id -> normalized content, if it differs
  std::unordered_set<std::string> special_set;
  Matcher raw_matcher, norm_matcher;
  int32_t vocab_size = 0;
  std::vector<uint8_t> skip_special;  // per id: dropped by decode(skip_special_tokens=true)

  // Per id, filled after loading: the token string (nullptr: no token) and, with the ByteLevel
  // decoder, the bytes it decodes to.
  std::vector<const std::string*> id_token;
  std::vector<std::string> id_bytes;

  // Every normal form leaves ASCII alone and no ASCII character combines with what precedes it,
  // so only the non-ASCII runs, each with the character before it, go through utf8proc.
  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (int opts : normalizers) {
      size_t i = 0, n = s.size();
      while (i < n && static_cast<unsigned char>(s[i]) < 0x80) ++i;
      if (i == n) continue;
      std::string out(s, 0, i > 0 ? i - 1 : 0);
      while (i < n) {
        size_t a = i > 0 ? i - 1 : 0, b = i;
        while (b < n && static_cast<unsigned char>(s[b]) >= 0x80) ++b;
        utf8proc_uint8_t* dst = nullptr;
        utf8proc_ssize_t m = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + a),
                                          utf8proc_ssize_t(b - a), &dst, utf8proc_option_t(opts));
        if (m < 0) fail("tokenizer {}: normalizer failed: {}", path, utf8proc_errmsg(m));
        out.append(reinterpret_cast<char*>(dst), size_t(m));
        std::free(dst);
        i = b;
        while (i < n && static_cast<unsigned char>(s[i]) < 0x80) ++i;
        out.append(s, b, i < n ? i - 1 - b : i - b);  // the ASCII run, less the character that
      }                                                 // goes with the next non-ASCII run
      s = std::move(out);
    }
    return s;
  }

  // HF's AddedVocabulary::find_matches on one piece of text.
  void find_added(const std::string& s, const Matcher& m, std::vector<Piece>& out) const {
    size_t start_offset = 0, pos = 0, a = 0, b = 0;
    int32_t id = -1;
    while (!m.empty() && m.find(s, pos, &a, &b, &id)) {
      pos = b;  // iteration resumes after the match, taken or not
      const AddedToken& t = added[added_index.at(id)];
      size_t start = a, stop = b;
      if (t.single_word) {
        bool start_space = start == 0 || !is_word_char(last_cp(std::string_view(s).substr(0, start)));
        bool stop_space = stop == s.size() || !is_word_char(first_cp(std::string_view(s).substr(stop)));
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) {
        size_t ns = start;
        while (ns > 0) {
          size_t k = ns - 1;
          while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          if (!is_white_space(first_cp(std::string_view(s).substr(k)))) break;
          ns = k;
        }
        start = std::max(ns, start_offset);
      }
      if (t.rstrip) {
        while (stop < s.size()) {
          uint32_t c = first_cp(std::string_view(s).substr(stop));
          if (!is_white_space(c)) break;
          stop += size_t(char_len(static_cast<unsigned char>(s[stop])));
        }
      }
      if (start_offset < start) out.push_back({start_offset, start, -1});
      out.push_back({start, stop, id});
      start_offset = stop;
    }
    if (start_offset != s.size()) out.push_back({start_offset, s.size(), -1});
  }

  // The pre-tokenizer steps over one piece of text; then BPE on each pre-token. Pre-tokens are
  // spans of a buffer: splitting keeps the buffer, the ByteLevel mapping writes a new one.
  void encode_text(std::string_view text, std::vector<int32_t>& ids) const {
    if (!has_pre) {
      bpe.tokenize(text, ids);
      return;
    }
    std::string buf(text), nbuf, tmp;
    std::vector<Span> cur{{0, buf.size()}}, next, parts;
    for (const PreStep& st : pre) {
      next.clear();
      if (st.kind == PreStep::Split) {
        for (Span sp : cur) split_span(buf, sp, *st.regex, st.behavior, st.invert, next);
      } else {
        nbuf.clear();
        nbuf.reserve(2 * buf.size() + 16);
        for (Span sp : cur) {
          std::string_view piece = std::string_view(buf).substr(sp.off, sp.len);
          if (st.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
            tmp = " ";
            tmp += piece;
            piece = tmp;
          }
          parts.clear();
          if (st.regex) split_span(piece, {0, piece.size()}, *st.regex, Behavior::Isolated, false, parts);
          else parts.push_back({0, piece.size()});
          for (Span q : parts) {
            size_t off = nbuf.size();
            for (unsigned char c : piece.substr(q.off, q.len)) {
              const std::string& m = byte_level().byte_to_utf8[c];
              nbuf.append(m.data(), m.size());
            }
            next.push_back({off, nbuf.size() - off});
          }
        }
        std::swap(buf, nbuf);
      }
      std::swap(cur, next);
    }
    for (Span sp : cur) bpe.tokenize(std::string_view(buf).substr(sp.off, sp.len), ids);
  }

  const std::string* token_string(int32_t id) const {
    if (auto it = added_index.find(id); it != added_index.end()) {
      if (auto d = added_display.find(id); d != added_display.end()) return &d->second;
      return &added[it->second].content;
    }
    if (auto it = bpe.vocab_r.find(id); it != bpe.vocab_r.end()) return &it->second;
    return nullptr;
  }
};

// ------------------------------------------------------------------------------------------------
// Loading

namespace {

struct Loader {
  const std::string& origin;

  [[noreturn]] void bad(const std::string& field, const std::string& what) const {
    fail("tokenizer {}: {}: {}", origin, field, what);
  }
  bool flag(const json& obj, const std::string& where, const char* key, bool dflt) const {
    if (!obj.contains(key) || obj[key].is_null()) return dflt;
    if (!obj[key].is_boolean()) bad(where + "." + key, "expected true or false");
    return obj[key].get<bool>();
  }
  std::optional<std::string> opt_string(const json& obj, const std::string& where, const char* key) const {
    if (!obj.contains(key) || obj[key].is_null()) return std::nullopt;
    if (!obj[key].is_string()) bad(where + "." + key, "expected a string or null");
    return obj[key].get<std::string>();
  }
  std::string type_of(const json& obj, const std::string& where) const {
    if (!obj.is_object()) bad(where, "expected an object or null");
    if (!obj.contains("type") || !obj["type"].is_string()) bad(where + ".type", "missing or not a string");
    return obj["type"].get<std::string>();
  }

  void normalizer(const json& j, const std::string& where, std::vector<int>& out) const {
    std::string t = type_of(j, where);
    if (t == "NFC") out.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    else if (t == "NFD") out.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
    else if (t == "NFKC") out.push_back(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    else if (t == "NFKD") out.push_back(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
    else if (t == "Sequence") {
      if (!j.contains("normalizers") || !j["normalizers"].is_array()) bad(where + ".normalizers", "expected an array");
      for (size_t i = 0; i < j["normalizers"].size(); ++i)
        normalizer(j["normalizers"][i], fmt::format("{}.normalizers[{}]", where, i), out);
    } else {
      bad(where + ".type", fmt::format("normalizer '{}' is not supported (NFC, NFD, NFKC, NFKD, Sequence)", t));
    }
  }

  void pre_tokenizer(const json& j, const std::string& where, std::vector<PreStep>& out) const {
    std::string t = type_of(j, where);
    if (t == "Sequence") {
      if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array()) bad(where + ".pretokenizers", "expected an array");
      for (size_t i = 0; i < j["pretokenizers"].size(); ++i)
        pre_tokenizer(j["pretokenizers"][i], fmt::format("{}.pretokenizers[{}]", where, i), out);
    } else if (t == "Split") {
      PreStep st;
      st.kind = PreStep::Split;
      const json& pat = j.contains("pattern") ? j["pattern"] : json();
      if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string())
        st.regex = std::make_unique<Regex>(pat["Regex"].get<std::string>(), false, fmt::format("tokenizer {}: {}.pattern.Regex", origin, where));
      else if (pat.is_object() && pat.contains("String") && pat["String"].is_string())
        st.regex = std::make_unique<Regex>(pat["String"].get<std::string>(), true, fmt::format("tokenizer {}: {}.pattern.String", origin, where));
      else
        bad(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      std::string b = j.contains("behavior") && j["behavior"].is_string() ? j["behavior"].get<std::string>() : "";
      if (b == "Removed") st.behavior = Behavior::Removed;
      else if (b == "Isolated") st.behavior = Behavior::Isolated;
      else if (b == "MergedWithPrevious") st.behavior = Behavior::MergedWithPrevious;
      else if (b == "MergedWithNext") st.behavior = Behavior::MergedWithNext;
      else if (b == "Contiguous") st.behavior = Behavior::Contiguous;
      else bad(where + ".behavior", fmt::format("'{}' is not a split behavior", b));
      st.invert = flag(j, where, "invert", false);
      out.push_back(std::move(st));
    } else if (t == "ByteLevel") {
      PreStep st;
      st.kind = PreStep::ByteLevel;
      st.add_prefix_space = flag(j, where, "add_prefix_space", true);
      if (flag(j, where, "use_regex", true))
        st.regex = std::make_unique<Regex>(kGpt2Pattern, false, fmt::format("tokenizer {}: {} (GPT-2 regex)", origin, where));
      out.push_back(std::move(st));
    } else {
      bad(where + ".type", fmt::format("pre-tokenizer '{}' is not supported (Split, ByteLevel, Sequence)", t));
    }
  }

  void model(const json& j, Bpe& bpe) const {
    if (!j.is_object()) bad("model", "missing or not an object");
    if (j.contains("type") && !(j["type"].is_string() && j["type"] == "BPE"))
      bad("model.type", fmt::format("model '{}' is not supported (only BPE)", j["type"].dump()));
    if (j.contains("dropout") && !j["dropout"].is_null() && !(j["dropout"].is_number() && j["dropout"].get<double>() == 0.0))
      bad("model.dropout", "BPE dropout is not supported (encoding would be random)");
    bpe.unk_token = opt_string(j, "model", "unk_token");
    bpe.prefix = opt_string(j, "model", "continuing_subword_prefix");
    bpe.suffix = opt_string(j, "model", "end_of_word_suffix");
    bpe.fuse_unk = flag(j, "model", "fuse_unk", false);
    bpe.byte_fallback = flag(j, "model", "byte_fallback", false);
    bpe.ignore_merges = flag(j, "model", "ignore_merges", false);

    if (!j.contains("vocab") || !j["vocab"].is_object()) bad("model.vocab", "missing or not an object");
    for (auto& [tok, v] : j["vocab"].items()) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
        bad("model.vocab", fmt::format("token '{}' has id {}, not an integer in [0, 2^31)", tok, v.dump()));
      int32_t id = v.get<int32_t>();
      if (!bpe.vocab_r.emplace(id, tok).second)
        bad("model.vocab", fmt::format("id {} is given to both '{}' and '{}'", id, bpe.vocab_r[id], tok));
      bpe.vocab.emplace(tok, id);
    }

    if (!j.contains("merges") || !j["merges"].is_array()) bad("model.merges", "missing or not an array");
    const json& merges = j["merges"];
    size_t plen = bpe.prefix ? bpe.prefix->size() : 0;
    bpe.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const json& m = merges[i];
      std::string a, b;
      if (m.is_string()) {  // legacy "a b"
        const std::string& s = m.get_ref<const std::string&>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos) bad(fmt::format("model.merges[{}]", i), fmt::format("'{}' is not two tokens separated by a space", s));
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>(), b = m[1].get<std::string>();
      } else {
        bad(fmt::format("model.merges[{}]", i), "expected \"a b\" or [\"a\", \"b\"]");
      }
      auto ia = bpe.vocab.find(a), ib = bpe.vocab.find(b);
      if (ia == bpe.vocab.end() || ib == bpe.vocab.end())
        bad(fmt::format("model.merges[{}]", i), fmt::format("token '{}' is not in model.vocab", ia == bpe.vocab.end() ? a : b));
      if (b.size() < plen) bad(fmt::format("model.merges[{}]", i), "second token shorter than continuing_subword_prefix");
      std::string merged = a + b.substr(plen);
      auto im = bpe.vocab.find(merged);
      if (im == bpe.vocab.end()) bad(fmt::format("model.merges[{}]", i), fmt::format("merged token '{}' is not in model.vocab", merged));
      bpe.merges[Bpe::key(ia->second, ib->second)] = {int32_t(i), im->second};  // a repeat wins, as in HF
    }
  }
};

}  // namespace

Tokenizer Tokenizer::from_json_text(std::string_view text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail("tokenizer {}: not valid JSON: {}", origin, e.what());
  }
  Loader L{origin};
  if (!j.is_object()) L.bad("(top level)", "expected a JSON object");
  auto impl = std::make_shared<Impl>();
  impl->path = origin;

  if (j.contains("version") && !(j["version"].is_string() && j["version"] == "1.0"))
    L.bad("version", fmt::format("unknown tokenizer version {}", j["version"].dump()));
  for (const char* k : {"truncation", "padding"})
    if (j.contains(k) && !j[k].is_null()) L.bad(k, "must be null: truncation and padding are not supported");
  if (j.contains("normalizer") && !j["normalizer"].is_null()) L.normalizer(j["normalizer"], "normalizer", impl->normalizers);
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    impl->has_pre = true;
    L.pre_tokenizer(j["pre_tokenizer"], "pre_tokenizer", impl->pre);
  }
  L.model(j.contains("model") ? j["model"] : json(), impl->bpe);
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    std::string t = L.type_of(j["decoder"], "decoder");
    if (t != "ByteLevel") L.bad("decoder.type", fmt::format("decoder '{}' is not supported (only ByteLevel)", t));
    impl->byte_level_decoder = true;
  }
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    // ByteLevel post-processing only trims offsets; anything else would change the ids.
    std::string t = L.type_of(j["post_processor"], "post_processor");
    if (t != "ByteLevel") L.bad("post_processor.type", fmt::format("post-processor '{}' is not supported (only ByteLevel)", t));
  }

  int32_t max_id = -1;
  for (auto& [id, tok] : impl->bpe.vocab_r) max_id = std::max(max_id, id);
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const json& arr = j["added_tokens"];
    if (!arr.is_array()) L.bad("added_tokens", "expected an array");
    for (size_t i = 0; i < arr.size(); ++i) {
      const json& e = arr[i];
      std::string where = fmt::format("added_tokens[{}]", i);
      if (!e.is_object() || !e.contains("content") || !e["content"].is_string())
        L.bad(where + ".content", "missing or not a string");
      if (!e.contains("id") || !e["id"].is_number_integer() || e["id"].get<int64_t>() < 0 || e["id"].get<int64_t>() > INT32_MAX)
        L.bad(where + ".id", "missing or not a non-negative integer");
      AddedToken t;
      t.content = e["content"].get<std::string>();
      if (t.content.empty()) continue;  // HF ignores empty added tokens
      QUADS_CHECK(utf8_invalid_offset(t.content) == std::string_view::npos, "tokenizer {}: {}.content is not valid UTF-8", origin, where);
      t.single_word = L.flag(e, where, "single_word", false);
      t.lstrip = L.flag(e, where, "lstrip", false);
      t.rstrip = L.flag(e, where, "rstrip", false);
      t.special = L.flag(e, where, "special", false);
      t.normalized = L.flag(e, where, "normalized", !t.special);
      t.id = e["id"].get<int32_t>();
      // HF gives a token that is in the model vocabulary the model's id.
      if (auto it = impl->bpe.vocab.find(t.content); it != impl->bpe.vocab.end()) t.id = it->second;
      if (impl->added_map.count(t.content)) L.bad(where, fmt::format("'{}' is listed twice", t.content));
      if (impl->added_index.count(t.id))
        L.bad(where + ".id", fmt::format("id {} of '{}' is already taken by '{}'", t.id, t.content, impl->added[impl->added_index[t.id]].content));
      if (auto it = impl->bpe.vocab_r.find(t.id); it != impl->bpe.vocab_r.end() && it->second != t.content)
        L.bad(where + ".id", fmt::format("id {} of '{}' is the model's token '{}'", t.id, t.content, it->second));
      impl->added_map[t.content] = t.id;
      impl->added_index[t.id] = impl->added.size();
      if (t.special) impl->special_set.insert(t.content);
      max_id = std::max(max_id, t.id);
      impl->added.push_back(t);
    }
  }
  for (const AddedToken& t : impl->added) {
    if (t.normalized) {
      std::string n = impl->normalize(t.content);
      if (n != t.content) impl->added_display[t.id] = n;
      impl->norm_matcher.add(n, t.id);
    } else {
      impl->raw_matcher.add(t.content, t.id);
    }
  }
  impl->vocab_size = max_id + 1;
  // decode(skip_special_tokens) drops every token whose string is a special token's content.
  impl->skip_special.assign(size_t(impl->vocab_size), 0);
  impl->id_token.assign(size_t(impl->vocab_size), nullptr);
  if (impl->byte_level_decoder) impl->id_bytes.resize(size_t(impl->vocab_size));
  for (int32_t id = 0; id < impl->vocab_size; ++id) {
    const std::string* s = impl->token_string(id);
    impl->id_token[size_t(id)] = s;
    if (!s) continue;
    impl->skip_special[size_t(id)] = impl->special_set.count(*s) ? 1 : 0;
    if (impl->byte_level_decoder) byte_level_unmap(*s, impl->id_bytes[size_t(id)]);
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  QUADS_CHECK(f, "tokenizer {}: cannot open file", path);
  std::stringstream ss;
  ss << f.rdbuf();
  QUADS_CHECK(!f.bad(), "tokenizer {}: read error", path);
  return from_json_text(ss.str(), path);
}

// ------------------------------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const Impl& I = *impl_;
  size_t bad = utf8_invalid_offset(text);
  QUADS_CHECK(bad == std::string_view::npos, "tokenizer {}: input text is not valid UTF-8 (byte {})", I.path, bad);
  std::vector<int32_t> ids;
  std::string s(text);
  std::vector<Piece> raw, norm;
  I.find_added(s, I.raw_matcher, raw);
  for (const Piece& p : raw) {
    if (p.id >= 0) {
      ids.push_back(p.id);
      continue;
    }
    std::string n = I.normalize(std::string_view(s).substr(p.a, p.b - p.a));
    norm.clear();
    I.find_added(n, I.norm_matcher, norm);
    for (const Piece& q : norm) {
      if (q.id >= 0) ids.push_back(q.id);
      else if (q.b > q.a) I.encode_text(std::string_view(n).substr(q.a, q.b - q.a), ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& I = *impl_;
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= I.vocab_size || !I.id_token[size_t(id)]) continue;
    if (skip_special_tokens && I.skip_special[size_t(id)]) continue;
    if (I.byte_level_decoder) {
      out += I.id_bytes[size_t(id)];
    } else {
      if (!first) out += ' ';  // HF joins with spaces when there is no decoder
      out += *I.id_token[size_t(id)];
    }
    first = false;
  }
  if (I.byte_level_decoder && utf8_invalid_offset(out) != std::string_view::npos) return utf8_lossy(out);
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  const Impl& I = *impl_;
  QUADS_CHECK(id >= 0 && id < I.vocab_size && I.id_token[size_t(id)], "tokenizer {}: no token has id {}", I.path, id);
  return I.byte_level_decoder ? I.id_bytes[size_t(id)] : *I.id_token[size_t(id)];
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  std::string t(token);
  if (auto it = impl_->added_map.find(t); it != impl_->added_map.end()) return it->second;
  if (auto it = impl_->bpe.vocab.find(t); it != impl_->bpe.vocab.end()) return it->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const Impl& I = *impl_;
  QUADS_CHECK(id >= 0 && id < I.vocab_size && I.id_token[size_t(id)], "tokenizer {}: no token has id {}", I.path, id);
  return *I.id_token[size_t(id)];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_index.find(id);
  return it != impl_->added_index.end() && impl_->added[it->second].special;
}

int32_t Tokenizer::special_id(std::string_view content) const {
  auto it = impl_->added_map.find(std::string(content));
  QUADS_CHECK(it != impl_->added_map.end(), "tokenizer {}: has no added token '{}'", impl_->path, content);
  return it->second;
}

const std::string& Tokenizer::path() const { return impl_->path; }

std::string chat_prompt(std::string_view user, std::string_view system) {
  std::string s;
  if (!system.empty()) s += fmt::format("<|im_start|>system\n{}<|im_end|>\n", system);
  s += fmt::format("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", user);
  return s;
}

std::vector<int32_t> encode_chat_prompt(const Tokenizer& tok, std::string_view user, std::string_view system) {
  tok.special_id("<|im_start|>");
  tok.special_id("<|im_end|>");
  return tok.encode(chat_prompt(user, system));
}

}  // namespace quads::io
