#include "rl/math_verify.h"

#include <algorithm>
#include <vector>

namespace quads::rl {

namespace {

using i128 = __int128;
constexpr size_t npos = std::string_view::npos;

bool digit(char c) { return c >= '0' && c <= '9'; }
bool alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
}

// Index just past the brace group opening at t[i] == '{', or npos when it never closes.
// Escaped braces (\{ \}) do not count.
size_t close_brace(std::string_view t, size_t i) {
  int depth = 0;
  for (size_t k = i; k < t.size(); ++k) {
    if (t[k] == '\\') {
      ++k;
      continue;
    }
    if (t[k] == '{') ++depth;
    if (t[k] == '}' && --depth == 0) return k + 1;
  }
  return npos;
}

// ---- exact rationals -------------------------------------------------------------------------

struct Rat {
  i128 p = 0, q = 1;
};

i128 gcd(i128 a, i128 b) {
  if (a < 0) a = -a;
  while (b != 0) {
    i128 t = a % b;
    a = b;
    b = t;
  }
  return a < 0 ? -a : a;
}

std::optional<Rat> make_rat(i128 p, i128 q) {
  if (q == 0) return std::nullopt;
  if (q < 0) p = -p, q = -q;
  i128 g = gcd(p, q);
  if (g > 1) p /= g, q /= g;
  return Rat{p, q};
}

std::optional<Rat> divide(Rat a, Rat b) {
  i128 p, q;
  if (__builtin_mul_overflow(a.p, b.q, &p) || __builtin_mul_overflow(a.q, b.p, &q)) return std::nullopt;
  return make_rat(p, q);
}

std::string to_string(i128 v) {
  if (v == 0) return "0";
  bool neg = v < 0;
  std::string s;
  while (v != 0) {
    int d = int(v % 10);
    s += char('0' + (d < 0 ? -d : d));
    v /= 10;
  }
  if (neg) s += '-';
  std::reverse(s.begin(), s.end());
  return s;
}

// Parser over a cleaned, whitespace-free answer:
//   value := ('-'|'+')? ( frac | num ('/' num)? )
//   frac  := ('\frac'|'\dfrac'|'\tfrac') ( '{' value '}' '{' value '}' | digit digit )
//   num   := d{1,3}(','d{3})+ ('.' d+)? | d+ ('.' d+)? | '.' d+
struct Parser {
  std::string_view s;
  size_t i = 0;

  bool eat(std::string_view w) {
    if (s.substr(i, w.size()) != w) return false;
    i += w.size();
    return true;
  }

  std::optional<Rat> num() {
    std::string digits;
    size_t frac_digits = 0;
    size_t start = i;
    while (i < s.size() && digit(s[i])) digits += s[i++];
    size_t lead = digits.size();
    if (lead >= 1 && lead <= 3) {
      while (i + 3 < s.size() && s[i] == ',' && digit(s[i + 1]) && digit(s[i + 2]) && digit(s[i + 3]) &&
             !(i + 4 < s.size() && digit(s[i + 4]))) {
        digits.append(s.substr(i + 1, 3));
        i += 4;
      }
    }
    if (i + 1 < s.size() && s[i] == '.' && digit(s[i + 1])) {
      ++i;
      while (i < s.size() && digit(s[i])) digits += s[i++], ++frac_digits;
    }
    if (digits.empty() || i == start) return std::nullopt;
    if (digits.size() > 36) return std::nullopt;  // keeps p and q well inside 128 bits
    i128 p = 0, q = 1;
    for (char c : digits) p = p * 10 + (c - '0');
    for (size_t k = 0; k < frac_digits; ++k) q *= 10;
    return make_rat(p, q);
  }

  std::optional<Rat> value() {
    bool neg = false;
    if (eat("-")) neg = true;
    else eat("+");
    std::optional<Rat> r;
    if (eat("\\frac") || eat("\\dfrac") || eat("\\tfrac")) {
      if (i < s.size() && s[i] == '{') {
        std::optional<Rat> a = group(), b;
        if (a) b = group();
        if (b) r = divide(*a, *b);
      } else if (i + 1 < s.size() && digit(s[i]) && digit(s[i + 1])) {  // \frac34
        r = make_rat(s[i] - '0', s[i + 1] - '0');
        i += 2;
      }
    } else {
      r = num();
      if (r && i + 1 < s.size() && s[i] == '/') {
        ++i;
        std::optional<Rat> d = num();
        r = d ? divide(*r, *d) : std::nullopt;
      }
    }
    if (r && neg) r->p = -r->p;
    return r;
  }

  std::optional<Rat> group() {
    if (i >= s.size() || s[i] != '{') return std::nullopt;
    size_t end = close_brace(s, i);
    if (end == npos) return std::nullopt;
    Parser inner{s.substr(i + 1, end - i - 2)};
    std::optional<Rat> r = inner.whole();
    i = end;
    return r;
  }

  std::optional<Rat> whole() {
    // Braces around the whole value ("{5}") are only grouping.
    while (s.size() >= 2 && s.front() == '{' && close_brace(s, 0) == s.size()) s = s.substr(1, s.size() - 2);
    std::optional<Rat> r = value();
    if (!r || i != s.size()) return std::nullopt;
    return r;
  }
};

// LaTeX clean-up shared by the numeric and the textual comparison. Whitespace is kept here.
std::string clean(std::string_view answer) {
  std::string s(trim(answer));
  replace_all(s, "\xE2\x88\x92", "-");  // U+2212 minus sign
  for (std::string_view w : {"\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ",
                             "\\$", "$", "\\(", "\\)", "\\[", "\\]", "\\%", "%", "^{\\circ}", "^\\circ",
                             "\xC2\xB0", "~"})
    replace_all(s, w, w == "\\ " || w == "~" ? " " : "");
  replace_all(s, "{,}", ",");
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  // \text{...} and friends: keep the words, drop the wrapper.
  for (std::string_view w : {"\\text", "\\textbf", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox"}) {
    for (size_t p = s.find(w); p != std::string::npos; p = s.find(w, p)) {
      size_t b = p + w.size();
      if (b < s.size() && alpha(s[b])) {  // a longer command name (\textbf seen as \text)
        p = b;
        continue;
      }
      size_t e = b < s.size() && s[b] == '{' ? close_brace(s, b) : npos;
      if (e == npos) {
        p = b;
        continue;
      }
      s = s.substr(0, p) + s.substr(b + 1, e - b - 2) + s.substr(e);
    }
  }
  std::string_view v = trim(s);
  while (!v.empty() && v.back() == '.') v = trim(v.substr(0, v.size() - 1));  // sentence end
  // "x = 5" -> "5": a single variable name before one '='.
  size_t k = 0;
  if (k < v.size() && alpha(v[k])) {
    ++k;
    while (k < v.size() && space(v[k])) ++k;
    if (k < v.size() && v[k] == '=' && (k + 1 >= v.size() || v[k + 1] != '=')) v = trim(v.substr(k + 1));
  }
  return std::string(v);
}

std::string without_spaces(std::string_view s) {
  std::string out;
  for (char c : s)
    if (!space(c)) out += c;
  return out;
}

// Start of a sign at t[i]: a '-' that is not a binary minus (nothing number-like right before).
bool sign_at(std::string_view t, size_t i) {
  if (t[i] != '-') return false;
  if (i == 0) return true;
  char p = t[i - 1];
  return !(digit(p) || alpha(p) || p == ')' || p == ']' || p == '}' || p == '.');
}

// End of the number starting at t[j] (a digit or '.' digit): thousands groups, decimals and a
// "/d" fraction part included.
size_t scan_number(std::string_view t, size_t j) {
  size_t n = t.size(), k = j;
  if (t[k] == '.') {
    ++k;
    while (k < n && digit(t[k])) ++k;
    return k;
  }
  while (k < n && digit(t[k])) ++k;
  if (k - j <= 3)
    while (k + 3 < n && t[k] == ',' && digit(t[k + 1]) && digit(t[k + 2]) && digit(t[k + 3]) &&
           !(k + 4 < n && digit(t[k + 4])))
      k += 4;
  if (k + 1 < n && t[k] == '.' && digit(t[k + 1])) {
    ++k;
    while (k < n && digit(t[k])) ++k;
  }
  if (k + 1 < n && t[k] == '/' && digit(t[k + 1])) {
    size_t m = k + 1;
    while (m < n && digit(t[m])) ++m;
    if (m + 1 < n && t[m] == '.' && digit(t[m + 1])) {
      ++m;
      while (m < n && digit(t[m])) ++m;
    }
    k = m;
  }
  return k;
}

// End of a \frac{a}{b} (or \dfrac, \tfrac, \frac34) at t[j] whose parts are numbers, else npos.
size_t scan_frac(std::string_view t, size_t j) {
  size_t k = npos;
  for (std::string_view w : {"\\frac", "\\dfrac", "\\tfrac"})
    if (t.substr(j, w.size()) == w) k = j + w.size();
  if (k == npos || k >= t.size()) return npos;
  if (k + 1 < t.size() && digit(t[k]) && digit(t[k + 1])) return k + 2;
  if (t[k] != '{') return npos;
  size_t e1 = close_brace(t, k);
  if (e1 == npos || e1 >= t.size() || t[e1] != '{') return npos;
  size_t e2 = close_brace(t, e1);
  if (e2 == npos) return npos;
  if (!canonical_number(t.substr(k + 1, e1 - k - 2)) || !canonical_number(t.substr(e1 + 1, e2 - e1 - 2))) return npos;
  return e2;
}

}  // namespace

std::optional<std::string> last_boxed(std::string_view text) {
  std::vector<std::pair<size_t, size_t>> hits;  // (position, length of the command)
  for (std::string_view cmd : {"\\boxed", "\\fbox"})
    for (size_t p = text.find(cmd); p != npos; p = text.find(cmd, p + 1)) hits.push_back({p, cmd.size()});
  std::sort(hits.begin(), hits.end());
  for (auto it = hits.rbegin(); it != hits.rend(); ++it) {
    size_t k = it->first + it->second;
    if (k < text.size() && alpha(text[k])) continue;  // another command, e.g. \boxedtext
    size_t b = k;
    while (b < text.size() && space(text[b])) ++b;
    if (b < text.size() && text[b] == '{') {
      size_t e = close_brace(text, b);
      if (e != npos) return std::string(text.substr(b + 1, e - b - 2));
    } else if (b > k && b < text.size()) {  // "\boxed 5": up to the next space or '$'
      size_t e = b;
      while (e < text.size() && !space(text[e]) && text[e] != '$') ++e;
      return std::string(text.substr(b, e - b));
    }
  }
  return std::nullopt;
}

std::optional<std::string> last_number(std::string_view t) {
  std::optional<std::string> best;
  size_t i = 0;
  while (i < t.size()) {
    size_t start = i, j = i;
    if (sign_at(t, j)) ++j;
    else if (t.substr(j, 3) == "\xE2\x88\x92") j += 3;  // U+2212 minus
    size_t end = npos;
    if (j < t.size() && (digit(t[j]) || (t[j] == '.' && j + 1 < t.size() && digit(t[j + 1]) &&
                                         !(j > 0 && digit(t[j - 1])))))
      end = scan_number(t, j);
    else if (j < t.size() && t[j] == '\\')
      end = scan_frac(t, j);
    if (end != npos) {
      best = std::string(t.substr(start, end - start));
      i = end;
    } else {
      i = start + 1;
    }
  }
  return best;
}

std::optional<std::string> extract_final_answer(std::string_view completion) {
  if (auto b = last_boxed(completion)) return b;
  return last_number(completion);
}

std::optional<std::string> canonical_number(std::string_view answer) {
  std::string s = clean(answer);
  // A number followed by unit words ("18 dollars", "5 cm") reads as the number.
  size_t sp = s.find_first_of(" \t\n");
  if (sp != std::string::npos) {
    std::string_view rest = trim(std::string_view(s).substr(sp));
    if (!rest.empty() && std::all_of(rest.begin(), rest.end(), [](char c) { return alpha(c) || space(c); }))
      s = s.substr(0, sp);
  }
  s = without_spaces(s);
  Parser p{s};
  std::optional<Rat> r = p.whole();
  if (!r) return std::nullopt;
  if (r->p == 0) return "0";
  return r->q == 1 ? to_string(r->p) : to_string(r->p) + "/" + to_string(r->q);
}

std::string normalize_answer(std::string_view answer) { return without_spaces(clean(answer)); }

bool answers_match(std::string_view answer, std::string_view reference) {
  std::optional<std::string> a = canonical_number(answer), r = canonical_number(reference);
  if (a && r) return *a == *r;
  if (a || r) return false;
  std::string na = normalize_answer(answer), nr = normalize_answer(reference);
  return !na.empty() && na == nr;
}

std::string reference_answer(std::string_view reference) {
  if (auto b = last_boxed(reference)) return *b;
  if (size_t p = reference.rfind("####"); p != npos) return std::string(trim(reference.substr(p + 4)));
  return std::string(trim(reference));
}

MathVerdict verify_math(std::string_view completion, std::string_view reference) {
  MathVerdict v;
  v.reference = reference_answer(reference);
  if (auto b = last_boxed(completion)) {
    v.found = v.boxed = true;
    v.answer = *b;
  } else if (auto n = last_number(completion)) {
    v.found = true;
    v.answer = *n;
  }
  v.reward = v.found && answers_match(v.answer, v.reference) ? 1.0 : 0.0;
  return v;
}

}  // namespace quads::rl
