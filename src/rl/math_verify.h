#pragma once
// Math answer verification for RL rewards and evaluation.
//
// The final answer of a completion is the content of its last \boxed{...} (nested braces allowed;
// \fbox too), or, when there is none, the last number in the text. It is correct when it equals
// the reference answer: numerically when both read as numbers (integers, decimals, signs,
// thousands separators "1,234", fractions "3/4", \frac{3}{4}, \dfrac, \tfrac, a percent sign or a
// trailing unit word dropped), otherwise as text after light LaTeX clean-up with whitespace
// removed. The reward is 1 only for a correct final answer, else 0.
#include <optional>
#include <string>
#include <string_view>

namespace quads::rl {

// The content of the last well-formed \boxed{...} / \fbox{...} (or `\boxed 5`), if any.
std::optional<std::string> last_boxed(std::string_view text);
// The last number in the text (as written, e.g. "-1,234.5", "3/4", "\frac{1}{2}"), if any.
std::optional<std::string> last_number(std::string_view text);
// last_boxed, else last_number.
std::optional<std::string> extract_final_answer(std::string_view completion);

// The exact value of an answer that is a number, as a reduced fraction "p/q" or an integer "p";
// nullopt when it is not a number (or its digits do not fit in 128 bits).
std::optional<std::string> canonical_number(std::string_view answer);
// Light clean-up used for comparing non-numeric answers: $...$, \left/\right, spacing commands,
// \text{...} wrappers, a leading "x =" and a trailing period removed; whitespace removed.
std::string normalize_answer(std::string_view answer);
// Whether an extracted answer equals the reference (numerically, else as normalized text).
bool answers_match(std::string_view answer, std::string_view reference);

// The reference answer as stored in a dataset: its last \boxed{...} if it has one, the part
// after the last "####" (GSM8K), else the whole string.
std::string reference_answer(std::string_view reference);

struct MathVerdict {
  double reward = 0.0;        // 1 for a correct final answer, else 0
  bool found = false;         // a final answer was found in the completion
  bool boxed = false;         // ... and it came from \boxed
  std::string answer;         // the extracted final answer
  std::string reference;      // the reference answer used
};
MathVerdict verify_math(std::string_view completion, std::string_view reference);
inline double math_reward(std::string_view completion, std::string_view reference) {
  return verify_math(completion, reference).reward;
}

}  // namespace quads::rl
