#include <gtest/gtest.h>

#include "rl/math_verify.h"

using namespace quads::rl;

TEST(MathVerify, LastBoxedWithNestedBraces) {
  EXPECT_EQ(last_boxed("so \\boxed{\\frac{3}{4}} done"), "\\frac{3}{4}");
  EXPECT_EQ(last_boxed("first \\boxed{1} then \\boxed{2}"), "2");
  EXPECT_EQ(last_boxed("\\boxed{\\{1, 2\\}}"), "\\{1, 2\\}");  // escaped braces do not count
  EXPECT_EQ(last_boxed("$\\boxed {x^{2}+1}$"), "x^{2}+1");
  EXPECT_EQ(last_boxed("\\fbox{7}"), "7");
  EXPECT_EQ(last_boxed("\\boxed 42$ and more"), "42");
  // An unclosed last box falls back to the one before it.
  EXPECT_EQ(last_boxed("\\boxed{5} and \\boxed{6"), "5");
  EXPECT_FALSE(last_boxed("no box here, 12"));
  EXPECT_FALSE(last_boxed("\\boxed{unclosed"));
}

TEST(MathVerify, LastNumber) {
  EXPECT_EQ(last_number("I have 3 apples and 12 pears."), "12");
  EXPECT_EQ(last_number("It costs 1,234.50 dollars"), "1,234.50");
  EXPECT_EQ(last_number("so x = -7"), "-7");
  EXPECT_EQ(last_number("5-3 gives 2, and 10-4"), "4");  // a binary minus is not a sign
  EXPECT_EQ(last_number("the ratio is 3/4."), "3/4");
  EXPECT_EQ(last_number("half: \\frac{1}{2}"), "\\frac{1}{2}");
  EXPECT_EQ(last_number("neg: -\\dfrac{5}{8} ok"), "-\\dfrac{5}{8}");
  EXPECT_EQ(last_number("list 1,2,3"), "3");
  EXPECT_EQ(last_number("value .5"), ".5");
  EXPECT_EQ(last_number("minus \xE2\x88\x92" "4"), "\xE2\x88\x92" "4");
  EXPECT_FALSE(last_number("no digits at all"));
  EXPECT_FALSE(last_number(""));
}

TEST(MathVerify, CanonicalNumbers) {
  EXPECT_EQ(canonical_number("42"), "42");
  EXPECT_EQ(canonical_number("-42"), "-42");
  EXPECT_EQ(canonical_number("+42"), "42");
  EXPECT_EQ(canonical_number("42.000"), "42");
  EXPECT_EQ(canonical_number("0.75"), "3/4");
  EXPECT_EQ(canonical_number(".5"), "1/2");
  EXPECT_EQ(canonical_number("1,234"), "1234");
  EXPECT_EQ(canonical_number("1,234,567.25"), "4938269/4");
  EXPECT_EQ(canonical_number("1{,}234"), "1234");
  EXPECT_EQ(canonical_number("6/8"), "3/4");
  EXPECT_EQ(canonical_number("\\frac{3}{4}"), "3/4");
  EXPECT_EQ(canonical_number("\\dfrac{6}{8}"), "3/4");
  EXPECT_EQ(canonical_number("\\tfrac12"), "1/2");
  EXPECT_EQ(canonical_number("-\\frac{1}{2}"), "-1/2");
  EXPECT_EQ(canonical_number("\\frac{-1}{2}"), "-1/2");
  EXPECT_EQ(canonical_number("\\frac{1.5}{3}"), "1/2");
  EXPECT_EQ(canonical_number("$18$"), "18");
  EXPECT_EQ(canonical_number("\\$18"), "18");
  EXPECT_EQ(canonical_number("50\\%"), "50");
  EXPECT_EQ(canonical_number("90^\\circ"), "90");
  EXPECT_EQ(canonical_number("18 dollars"), "18");
  EXPECT_EQ(canonical_number("18 \\text{ dollars}"), "18");
  EXPECT_EQ(canonical_number("x = 5"), "5");
  EXPECT_EQ(canonical_number("{5}"), "5");
  EXPECT_EQ(canonical_number("5."), "5");
  EXPECT_EQ(canonical_number("-0"), "0");
  EXPECT_EQ(canonical_number("\xE2\x88\x92" "3"), "-3");
  EXPECT_FALSE(canonical_number("1,23"));      // not a thousands group
  EXPECT_FALSE(canonical_number("3/0"));
  EXPECT_FALSE(canonical_number("x^2+1"));
  EXPECT_FALSE(canonical_number("2\\sqrt{2}"));
  EXPECT_FALSE(canonical_number("1.2.3"));
  EXPECT_FALSE(canonical_number(""));
  EXPECT_FALSE(canonical_number("1234567890123456789012345678901234567890"));  // beyond 128 bits
}

TEST(MathVerify, AnswersMatch) {
  EXPECT_TRUE(answers_match("3/4", "0.75"));
  EXPECT_TRUE(answers_match("\\frac{3}{4}", "3/4"));
  EXPECT_TRUE(answers_match("\\dfrac{1}{2}", "0.5"));
  EXPECT_TRUE(answers_match("1,234", "1234"));
  EXPECT_TRUE(answers_match("-5", "-5.0"));
  EXPECT_FALSE(answers_match("5", "-5"));
  EXPECT_FALSE(answers_match("0.33", "1/3"));
  EXPECT_FALSE(answers_match("12", "1,2"));
  // Non-numeric answers compare as cleaned text.
  EXPECT_TRUE(answers_match("x^{2} + 1", "x^{2}+1"));
  EXPECT_TRUE(answers_match("\\left(1, 2\\right)", "(1,2)"));
  EXPECT_TRUE(answers_match("\\dfrac{1}{x}", "\\frac{1}{x}"));
  EXPECT_FALSE(answers_match("x^2", "x^3"));
  EXPECT_FALSE(answers_match("", ""));
  EXPECT_FALSE(answers_match("five", "5"));
}

TEST(MathVerify, ReferenceAnswerForms) {
  EXPECT_EQ(reference_answer("  72 "), "72");
  EXPECT_EQ(reference_answer("Natalia sold 48/2 = 24 clips.\n#### 72"), "72");
  EXPECT_EQ(reference_answer("The answer is $\\boxed{\\frac{1}{2}}$."), "\\frac{1}{2}");
}

TEST(MathVerify, RewardOnlyForCorrectFinalAnswer) {
  EXPECT_EQ(math_reward("First 3+4=7, so the answer is \\boxed{7}.", "7"), 1.0);
  EXPECT_EQ(math_reward("\\boxed{7} ... wait, actually \\boxed{8}", "7"), 0.0);  // the last box counts
  EXPECT_EQ(math_reward("The answer is 7 because 7 = 3 + 4", "7"), 0.0);         // last number is 4
  EXPECT_EQ(math_reward("3 + 4 gives 7", "7"), 1.0);
  EXPECT_EQ(math_reward("\\boxed{\\dfrac{3}{4}}", "0.75"), 1.0);
  EXPECT_EQ(math_reward("so we get $\\boxed{1{,}234}$", "#### 1234"), 1.0);
  EXPECT_EQ(math_reward("The total is 1,234 dollars.", "1234"), 1.0);
  EXPECT_EQ(math_reward("I think it's -2.50", "-5/2"), 1.0);
  EXPECT_EQ(math_reward("no answer here", "7"), 0.0);
  EXPECT_EQ(math_reward("", "7"), 0.0);
  // A box wins over a later number in the text.
  EXPECT_EQ(math_reward("\\boxed{12} (checked in 3 steps)", "12"), 1.0);

  MathVerdict v = verify_math("so \\boxed{x = 5}", "The answer is \\boxed{5}");
  EXPECT_EQ(v.reward, 1.0);
  EXPECT_TRUE(v.found);
  EXPECT_TRUE(v.boxed);
  EXPECT_EQ(v.answer, "x = 5");
  EXPECT_EQ(v.reference, "5");
  v = verify_math("maybe 6", "5");
  EXPECT_EQ(v.reward, 0.0);
  EXPECT_TRUE(v.found);
  EXPECT_FALSE(v.boxed);
  EXPECT_EQ(v.answer, "6");
}
