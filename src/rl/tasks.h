#pragma once
// Verifiable reasoning tasks for small models, generated from a seed. docs/rl.md shows examples
// and the lengths at every difficulty.
//
// Four families, each with a difficulty level:
//   add        level = digits of both operands (1..8)      "add 347+285\n"
//              "7+5=12 4+8+1=13 3+2+1=6 => 632"             column addition, right to left, carries
//                                                           shown as the "+1" of the next column
//   mul        level = digits of both operands (1..3)      "mul 47*36\n"
//              "47*6=282 47*30=1410 282+1410=1692 => 1692"  one partial product per digit of the
//                                                           second operand, then running sums
//   countdown  level = how many numbers are given (2..5)    "make 21 from 15 3 2\n"
//              "3*2=6 15+6=21 => 15+3*2"                    reach the target with + - * and
//                                                           parentheses, each number at most once;
//                                                           numbers 1..15, target 1..200, and the
//                                                           shortest solution needs all of them
//   sort       level = list length (2..10), values 0..99    "sort 52 7 33 91 4\n"
//              "=> 4 7 33 52 91"                            ascending, duplicates kept
//
// A response is what the model generates after the prompt. It earns reward 1 only when it ends with
// "=> ANSWER" followed by the end token, with exactly one "=>" in it and ANSWER in canonical form
// (see verify_text); everything before "=>" is free-form. Everything else earns 0.
//
// Determinism: training task i is a pure function of (seed, i), so a run resumes by remembering a
// counter. The evaluation set is drawn from a separate stream of the same seed, and prompts are split
// between the two by a hash of the prompt text (1 in kEvalBuckets is held out), so a training task
// never has the prompt of any possible evaluation task.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rl/char_tokenizer.h"

namespace quads::rl {

enum class Family : uint8_t { Add, Mul, Countdown, Sort };
inline constexpr int kNumFamilies = 4;

const char* family_name(Family f);                   // "add", "mul", "countdown", "sort"
Family parse_family(std::string_view name);          // throws quads::Error naming the name
void level_range(Family f, int* lo, int* hi);        // supported difficulty levels, inclusive

struct Task {
  Family family = Family::Add;
  int level = 0;
  std::string prompt;    // ends with '\n'
  std::string solution;  // worked solution, ends with "=> " + answer (no end token)
  std::string answer;    // canonical answer text (countdown: one solution expression of many)
  // countdown only: the numbers offered and the target.
  std::vector<int> numbers;
  int target = 0;
};

// Generates one task of a family and level from a 64-bit seed (pure function of its arguments).
Task make_task(Family f, int level, uint64_t seed);

// Which families and levels to draw from; a draw picks a family uniformly among `families`, then a
// level uniformly from that family's list.
struct TaskMix {
  std::vector<Family> families{Family::Add, Family::Mul, Family::Countdown, Family::Sort};
  std::vector<int> levels[kNumFamilies] = {{2, 3, 4}, {2}, {3, 4}, {3, 4, 5}};
  const std::vector<int>& levels_of(Family f) const { return levels[static_cast<int>(f)]; }
};

inline constexpr uint64_t kEvalBuckets = 8;
// True when a prompt belongs to the held-out side of the split (FNV-1a 64 of the text, mod 8 == 0).
bool is_eval_prompt(std::string_view prompt);

class TaskSet {
 public:
  // Builds the evaluation set (eval_size tasks, i.i.d. from the held-out side; a small family/level
  // can repeat a prompt). Throws on an empty mix or a level outside level_range.
  TaskSet(TaskMix mix, uint64_t seed, int eval_size);

  // Training task number `index` (never a held-out prompt).
  Task train(uint64_t index) const;
  // Tasks first .. first+n-1; an RL step s with P prompts uses train_batch(s * P, P).
  std::vector<Task> train_batch(uint64_t first, int n) const;
  const std::vector<Task>& eval_set() const { return eval_; }
  const TaskMix& mix() const { return mix_; }
  uint64_t seed() const { return seed_; }

 private:
  Task draw(uint64_t stream, uint64_t index, bool want_eval) const;
  TaskMix mix_;
  uint64_t seed_;
  std::vector<Task> eval_;
};

// Verification.
enum class Outcome : uint8_t {
  Correct,
  Truncated,      // no end token in the response (ran out of tokens)
  Malformed,      // not "...=> ANSWER<eos>" with ANSWER in canonical form; bad ids before <eos>
  Wrong,          // well-formed answer that is not the right one
  InvalidNumbers  // countdown: uses a number not offered, or one more often than offered
};
const char* outcome_name(Outcome o);

struct Verdict {
  Outcome outcome = Outcome::Malformed;
  float reward = 0.f;  // 1 for Correct, else 0
};

// `response` is the generated text up to (not including) the end token, which the caller has seen.
// Canonical answers: add/mul a decimal integer without leading zeros; sort the sorted numbers joined
// by single spaces; countdown an expression over the offered numbers with + - * and parentheses, no
// spaces, no unary minus, no leading zeros, evaluating (in exact integer arithmetic) to the target.
// No whitespace or newline may follow the answer.
Verdict verify_text(const Task& task, std::string_view response);
// `response_ids` are the generated ids (the prompt excluded). Reads up to the first <eos>
// (Truncated if there is none); <bos>/<pad> or an unknown id before it is Malformed.
Verdict verify_ids(const Task& task, std::span<const int32_t> response_ids, const CharTokenizer& tok);

// Countdown helpers (exposed for tests and the docs).
// Evaluates an expression of the grammar above; false when it does not parse, `*value` otherwise,
// with the integer literals it used in `*literals`.
bool eval_countdown_expr(std::string_view expr, int64_t* value, std::vector<int64_t>* literals);
// Shortest solution found by exhaustive search (fewest numbers used; ties broken by a fixed search
// order); writes the worked steps ("a-b=c" joined by spaces) and the expression. False if none.
bool solve_countdown(const std::vector<int>& numbers, int target, std::string* steps, std::string* expr);

// A supervised example: tokens = <bos> prompt solution <eos>; loss_mask[i] = 1 when tokens[i] is a
// target the model is trained to predict (from position i-1): the solution and the <eos>.
struct SftExample {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;
};
SftExample make_sft_example(const Task& task, const CharTokenizer& tok);

// pass@1 of a set of verdicts, overall and per family (families with no task are NaN).
struct EvalScore {
  double pass1 = 0;
  double family_pass1[kNumFamilies];
  int family_count[kNumFamilies];
  int outcome_count[5];  // indexed by Outcome
  int n = 0;
};
EvalScore score(std::span<const Task> tasks, std::span<const Verdict> verdicts);

}  // namespace quads::rl
