#include "rl/tasks.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace quads::rl {

namespace {

// splitmix64: the seeds of every task are derived with it, so generation does not depend on the
// standard library's distributions (which differ between implementations).
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t mix64(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b + 0x632BE59BD9B4E019ull)); }

struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform integer in [lo, hi], without modulo bias.
  int64_t uniform(int64_t lo, int64_t hi) {
    uint64_t range = static_cast<uint64_t>(hi - lo) + 1;
    uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % range;
    uint64_t x;
    do x = next();
    while (x >= limit);
    return lo + static_cast<int64_t>(x % range);
  }
};

constexpr uint64_t kTrainStream = 1, kEvalStream = 2;

int64_t pow10(int n) {
  int64_t p = 1;
  while (n-- > 0) p *= 10;
  return p;
}

// A number with exactly `digits` digits (1..9 for one digit).
int64_t random_digits(Rng& rng, int digits) { return rng.uniform(pow10(digits - 1), pow10(digits) - 1); }

Task make_add(int d, Rng& rng) {
  Task t;
  int64_t a = random_digits(rng, d), b = random_digits(rng, d);
  t.prompt = fmt::format("add {}+{}\n", a, b);
  int carry = 0;
  int64_t x = a, y = b;
  for (int j = 0; j < d; ++j) {
    int da = static_cast<int>(x % 10), db = static_cast<int>(y % 10);
    int s = da + db + carry;
    t.solution += fmt::format("{}{}+{}{}={}", j ? " " : "", da, db, carry ? "+1" : "", s);
    carry = s / 10;
    x /= 10;
    y /= 10;
  }
  t.answer = std::to_string(a + b);
  t.solution += " => " + t.answer;
  return t;
}

Task make_mul(int d, Rng& rng) {
  Task t;
  int64_t a = random_digits(rng, d), b = random_digits(rng, d);
  t.prompt = fmt::format("mul {}*{}\n", a, b);
  std::vector<int64_t> partial;
  int64_t y = b;
  for (int j = 0; j < d; ++j) {
    int64_t digit = y % 10;
    y /= 10;
    int64_t m = digit * pow10(j);
    partial.push_back(a * m);
    t.solution += fmt::format("{}{}*{}={}", j ? " " : "", a, m, a * m);
  }
  int64_t sum = partial[0];
  for (int j = 1; j < d; ++j) {
    t.solution += fmt::format(" {}+{}={}", sum, partial[j], sum + partial[j]);
    sum += partial[j];
  }
  t.answer = std::to_string(a * b);
  t.solution += " => " + t.answer;
  return t;
}

constexpr int kCountdownMaxNumber = 15;
constexpr int kCountdownMaxTarget = 200;

Task make_countdown(int n, Rng& rng) {
  Task t;
  for (;;) {
    std::vector<int> nums(n);
    for (int& v : nums) v = static_cast<int>(rng.uniform(1, kCountdownMaxNumber));
    // The target comes from a random combination of k of the numbers, so a solution exists.
    int k = n;
    std::vector<int64_t> pool(nums.begin(), nums.begin() + k);
    bool ok = true;
    while (pool.size() > 1 && ok) {
      size_t i = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(pool.size()) - 1));
      size_t j = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(pool.size()) - 2));
      if (j >= i) ++j;
      int64_t a = std::max(pool[i], pool[j]), b = std::min(pool[i], pool[j]);
      int64_t r = 0;
      switch (rng.uniform(0, 2)) {
        case 0: r = a + b; break;
        case 1: r = a - b; ok = r > 0; break;
        default: r = a * b; break;
      }
      pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(std::max(i, j)));
      pool[std::min(i, j)] = r;
    }
    int64_t target = pool[0];
    if (!ok || target < 1 || target > kCountdownMaxTarget) continue;
    if (std::find(nums.begin(), nums.end(), target) != nums.end()) continue;
    std::string steps, expr;
    QUADS_CHECK(solve_countdown(nums, static_cast<int>(target), &steps, &expr),
                "countdown generator: no solution found for target {}", target);
    // Keep the target only if it really needs k numbers, so that the level sets the difficulty
    // (a target drawn from 4 numbers is often reachable with 2).
    if (std::count(steps.begin(), steps.end(), ' ') + 2 != k) continue;
    t.numbers = nums;
    t.target = static_cast<int>(target);
    t.prompt = fmt::format("make {} from {}\n", target, fmt::join(nums, " "));
    t.answer = expr;
    t.solution = steps + " => " + expr;
    return t;
  }
}

constexpr int kSortMaxValue = 99;

Task make_sort(int n, Rng& rng) {
  Task t;
  std::vector<int> v(n);
  for (int& x : v) x = static_cast<int>(rng.uniform(0, kSortMaxValue));
  t.prompt = fmt::format("sort {}\n", fmt::join(v, " "));
  std::sort(v.begin(), v.end());
  t.answer = fmt::format("{}", fmt::join(v, " "));
  t.solution = "=> " + t.answer;
  return t;
}

// ---- countdown search ------------------------------------------------------------------------
// Values only while searching (the generator calls this many times); the text is built once a
// solution is found, from the combinations left on the path.
struct Node {
  int64_t value;
  char op;  // 0 for a given number
  int left, right;
};

struct Search {
  std::vector<Node> nodes;  // the given numbers, then the combinations on the current path
  int64_t target;

  bool dfs(const int* pool, int size, int combines_left) {
    for (int i = 0; i < size; ++i) {
      for (int j = i + 1; j < size; ++j) {
        int x = pool[i], y = pool[j];
        if (nodes[x].value < nodes[y].value) std::swap(x, y);
        const int64_t a = nodes[x].value, b = nodes[y].value;
        for (char op : {'+', '-', '*'}) {
          if (op == '-' && a == b) continue;
          int64_t v = op == '+' ? a + b : op == '-' ? a - b : a * b;
          nodes.push_back({v, op, x, y});
          if (v == target) return true;
          if (combines_left > 1) {
            int next[16], k = 0;
            for (int m = 0; m < size; ++m)
              if (m != i && m != j) next[k++] = pool[m];
            next[k++] = static_cast<int>(nodes.size()) - 1;
            if (dfs(next, k, combines_left - 1)) return true;
          }
          nodes.pop_back();
        }
      }
    }
    return false;
  }

  // Minimal parentheses: '+' needs none, the right side of '-' and both sides of '*' need them
  // around a sum or difference. prec: 0 number, 1 sum/difference, 2 product.
  std::string expr(int id, int* prec) const {
    const Node& n = nodes[id];
    if (n.op == 0) {
      *prec = 0;
      return std::to_string(n.value);
    }
    int pl, pr;
    std::string l = expr(n.left, &pl), r = expr(n.right, &pr);
    auto paren = [](const std::string& s, bool need) { return need ? "(" + s + ")" : s; };
    if (n.op == '+') return *prec = 1, l + "+" + r;
    if (n.op == '-') return *prec = 1, l + "-" + paren(r, pr == 1);
    return *prec = 2, paren(l, pl == 1) + "*" + paren(r, pr == 1);
  }
};

// ---- expression parser (verifier) ------------------------------------------------------------
constexpr int64_t kExprLimit = 1'000'000'000'000'000ll;

struct Parser {
  std::string_view s;
  size_t p = 0;
  int depth = 0;
  std::vector<int64_t>* literals;

  static bool in_range(__int128 v) { return v >= -kExprLimit && v <= kExprLimit; }
  bool expr(int64_t* out) {
    if (++depth > 64) return false;
    int64_t v;
    if (!term(&v)) return false;
    while (p < s.size() && (s[p] == '+' || s[p] == '-')) {
      char op = s[p++];
      int64_t w;
      if (!term(&w)) return false;
      __int128 r = op == '+' ? static_cast<__int128>(v) + w : static_cast<__int128>(v) - w;
      if (!in_range(r)) return false;
      v = static_cast<int64_t>(r);
    }
    --depth;
    *out = v;
    return true;
  }
  bool term(int64_t* out) {
    int64_t v;
    if (!factor(&v)) return false;
    while (p < s.size() && s[p] == '*') {
      ++p;
      int64_t w;
      if (!factor(&w)) return false;
      __int128 r = static_cast<__int128>(v) * w;
      if (!in_range(r)) return false;
      v = static_cast<int64_t>(r);
    }
    *out = v;
    return true;
  }
  bool factor(int64_t* out) {
    if (p >= s.size()) return false;
    if (s[p] == '(') {
      ++p;
      if (!expr(out)) return false;
      if (p >= s.size() || s[p] != ')') return false;
      ++p;
      return true;
    }
    size_t start = p;
    while (p < s.size() && s[p] >= '0' && s[p] <= '9') ++p;
    size_t len = p - start;
    if (len == 0 || len > 12 || (len > 1 && s[start] == '0')) return false;
    int64_t v = 0;
    for (size_t i = start; i < p; ++i) v = v * 10 + (s[i] - '0');
    literals->push_back(v);
    *out = v;
    return true;
  }
};

bool is_canonical_uint(std::string_view s) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return s.size() == 1 || s[0] != '0';
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

// ---- families --------------------------------------------------------------------------------
const char* family_name(Family f) {
  switch (f) {
    case Family::Add: return "add";
    case Family::Mul: return "mul";
    case Family::Countdown: return "countdown";
    case Family::Sort: return "sort";
  }
  return "?";
}

Family parse_family(std::string_view name) {
  for (int i = 0; i < kNumFamilies; ++i)
    if (name == family_name(static_cast<Family>(i))) return static_cast<Family>(i);
  fail("unknown task family \"{}\" (known: add, mul, countdown, sort)", name);
}

void level_range(Family f, int* lo, int* hi) {
  switch (f) {
    case Family::Add: *lo = 1, *hi = 8; return;
    case Family::Mul: *lo = 1, *hi = 3; return;
    case Family::Countdown: *lo = 2, *hi = 5; return;
    case Family::Sort: *lo = 2, *hi = 10; return;
  }
}

Task make_task(Family f, int level, uint64_t seed) {
  int lo = 0, hi = 0;
  level_range(f, &lo, &hi);
  QUADS_CHECK(level >= lo && level <= hi, "task family {}: level {} is outside {}..{}", family_name(f), level,
              lo, hi);
  Rng rng(seed);
  Task t;
  switch (f) {
    case Family::Add: t = make_add(level, rng); break;
    case Family::Mul: t = make_mul(level, rng); break;
    case Family::Countdown: t = make_countdown(level, rng); break;
    case Family::Sort: t = make_sort(level, rng); break;
  }
  t.family = f;
  t.level = level;
  return t;
}

bool is_eval_prompt(std::string_view prompt) { return fnv1a64(prompt) % kEvalBuckets == 0; }

// ---- task set --------------------------------------------------------------------------------
TaskSet::TaskSet(TaskMix mix, uint64_t seed, int eval_size) : mix_(std::move(mix)), seed_(seed) {
  QUADS_CHECK(!mix_.families.empty(), "tasks.families is empty");
  QUADS_CHECK(eval_size >= 0, "evaluation set size {} is negative", eval_size);
  for (Family f : mix_.families) {
    const auto& lv = mix_.levels_of(f);
    QUADS_CHECK(!lv.empty(), "task family {} has no difficulty levels", family_name(f));
    int lo = 0, hi = 0;
    level_range(f, &lo, &hi);
    for (int l : lv)
      QUADS_CHECK(l >= lo && l <= hi, "task family {}: level {} is outside {}..{}", family_name(f), l, lo, hi);
  }
  eval_.reserve(eval_size);
  for (int i = 0; i < eval_size; ++i) eval_.push_back(draw(kEvalStream, static_cast<uint64_t>(i), true));
}

Task TaskSet::draw(uint64_t stream, uint64_t index, bool want_eval) const {
  for (uint64_t attempt = 0; attempt < 100000; ++attempt) {
    Rng rng(mix64(mix64(mix64(seed_, stream), index), attempt));
    Family f = mix_.families[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(mix_.families.size()) - 1))];
    const auto& lv = mix_.levels_of(f);
    int level = lv[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(lv.size()) - 1))];
    Task t = make_task(f, level, rng.next());
    if (is_eval_prompt(t.prompt) == want_eval) return t;
  }
  fail("could not draw a {} task (index {}) from the task mix", want_eval ? "held-out" : "training", index);
}

Task TaskSet::train(uint64_t index) const { return draw(kTrainStream, index, false); }

std::vector<Task> TaskSet::train_batch(uint64_t first, int n) const {
  std::vector<Task> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.push_back(train(first + static_cast<uint64_t>(i)));
  return out;
}

// ---- verification ----------------------------------------------------------------------------
const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::Correct: return "correct";
    case Outcome::Truncated: return "truncated";
    case Outcome::Malformed: return "malformed";
    case Outcome::Wrong: return "wrong";
    case Outcome::InvalidNumbers: return "invalid_numbers";
  }
  return "?";
}

bool eval_countdown_expr(std::string_view expr, int64_t* value, std::vector<int64_t>* literals) {
  literals->clear();
  Parser ps{expr, 0, 0, literals};
  int64_t v;
  if (!ps.expr(&v) || ps.p != expr.size()) return false;
  *value = v;
  return true;
}

bool solve_countdown(const std::vector<int>& numbers, int target, std::string* steps, std::string* expr) {
  QUADS_CHECK(numbers.size() <= 8, "countdown: at most 8 numbers, got {}", numbers.size());
  for (int v : numbers)
    if (v == target) {
      steps->clear();
      *expr = std::to_string(v);
      return true;
    }
  Search s;
  s.target = target;
  int pool[16];
  for (size_t i = 0; i < numbers.size(); ++i) {
    s.nodes.push_back({numbers[i], 0, -1, -1});
    pool[i] = static_cast<int>(i);
  }
  // Iterative deepening: the first solution found uses the fewest numbers.
  for (int combines = 1; combines < static_cast<int>(numbers.size()); ++combines) {
    if (!s.dfs(pool, static_cast<int>(numbers.size()), combines)) continue;
    std::vector<std::string> st;
    for (size_t i = numbers.size(); i < s.nodes.size(); ++i) {
      const Node& n = s.nodes[i];
      st.push_back(fmt::format("{}{}{}={}", s.nodes[n.left].value, n.op, s.nodes[n.right].value, n.value));
    }
    *steps = fmt::format("{}", fmt::join(st, " "));
    int prec;
    *expr = s.expr(static_cast<int>(s.nodes.size()) - 1, &prec);
    return true;
  }
  return false;
}

Verdict verify_text(const Task& task, std::string_view response) {
  auto verdict = [](Outcome o) { return Verdict{o, o == Outcome::Correct ? 1.f : 0.f}; };
  size_t pos = response.find("=>");
  if (pos == std::string_view::npos || response.find("=>", pos + 1) != std::string_view::npos)
    return verdict(Outcome::Malformed);
  std::string_view rest = response.substr(pos + 2);
  if (rest.size() < 2 || rest[0] != ' ') return verdict(Outcome::Malformed);
  std::string_view ans = rest.substr(1);
  switch (task.family) {
    case Family::Add:
    case Family::Mul:
      if (!is_canonical_uint(ans)) return verdict(Outcome::Malformed);
      return verdict(ans == task.answer ? Outcome::Correct : Outcome::Wrong);
    case Family::Sort: {
      size_t start = 0;
      for (;;) {
        size_t sp = ans.find(' ', start);
        std::string_view num = ans.substr(start, sp == std::string_view::npos ? std::string_view::npos : sp - start);
        if (!is_canonical_uint(num)) return verdict(Outcome::Malformed);
        if (sp == std::string_view::npos) break;
        start = sp + 1;
      }
      return verdict(ans == task.answer ? Outcome::Correct : Outcome::Wrong);
    }
    case Family::Countdown: {
      int64_t value;
      std::vector<int64_t> lits;
      if (!eval_countdown_expr(ans, &value, &lits)) return verdict(Outcome::Malformed);
      std::vector<int> avail = task.numbers;
      for (int64_t l : lits) {
        auto it = std::find(avail.begin(), avail.end(), l);
        if (it == avail.end()) return verdict(Outcome::InvalidNumbers);
        avail.erase(it);
      }
      return verdict(value == task.target ? Outcome::Correct : Outcome::Wrong);
    }
  }
  return verdict(Outcome::Malformed);
}

Verdict verify_ids(const Task& task, std::span<const int32_t> response_ids, const CharTokenizer& tok) {
  size_t end = 0;
  while (end < response_ids.size() && response_ids[end] != tok.eos_id()) ++end;
  if (end == response_ids.size()) return {Outcome::Truncated, 0.f};
  for (size_t i = 0; i < end; ++i) {
    int32_t id = response_ids[i];
    if (id < 0 || id >= tok.vocab_size() || tok.is_special(id)) return {Outcome::Malformed, 0.f};
  }
  return verify_text(task, tok.decode(response_ids.subspan(0, end)));
}

SftExample make_sft_example(const Task& task, const CharTokenizer& tok) {
  SftExample ex;
  ex.tokens = tok.encode_prompt(task.prompt);
  ex.loss_mask.assign(ex.tokens.size(), 0);
  std::vector<int32_t> sol = tok.encode(task.solution);
  ex.tokens.insert(ex.tokens.end(), sol.begin(), sol.end());
  ex.tokens.push_back(tok.eos_id());
  ex.loss_mask.resize(ex.tokens.size(), 1);
  return ex;
}

EvalScore score(std::span<const Task> tasks, std::span<const Verdict> verdicts) {
  QUADS_CHECK(tasks.size() == verdicts.size(), "score: {} tasks but {} verdicts", tasks.size(), verdicts.size());
  EvalScore s{};
  double correct = 0, fam_correct[kNumFamilies] = {};
  for (size_t i = 0; i < tasks.size(); ++i) {
    int f = static_cast<int>(tasks[i].family);
    s.family_count[f]++;
    s.outcome_count[static_cast<int>(verdicts[i].outcome)]++;
    correct += verdicts[i].reward;
    fam_correct[f] += verdicts[i].reward;
  }
  s.n = static_cast<int>(tasks.size());
  s.pass1 = s.n ? correct / s.n : std::nan("");
  for (int f = 0; f < kNumFamilies; ++f)
    s.family_pass1[f] = s.family_count[f] ? fam_correct[f] / s.family_count[f] : std::nan("");
  return s;
}

}  // namespace quads::rl
