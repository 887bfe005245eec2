#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unistd.h>

#include "common/error.h"
#include "rl/char_tokenizer.h"
#include "rl/tasks.h"

using namespace quads::rl;

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, sep)) out.push_back(part);
  return out;
}

// Every "lhs=rhs" step of a worked solution must be a true equation.
void expect_steps_true(const Task& t) {
  std::string steps = t.solution.substr(0, t.solution.find("=>"));
  for (const auto& step : split(steps, ' ')) {
    if (step.empty()) continue;
    size_t eq = step.find('=');
    ASSERT_NE(eq, std::string::npos) << t.prompt << t.solution;
    int64_t lhs, rhs;
    std::vector<int64_t> lits;
    ASSERT_TRUE(eval_countdown_expr(step.substr(0, eq), &lhs, &lits)) << step;
    ASSERT_TRUE(eval_countdown_expr(step.substr(eq + 1), &rhs, &lits)) << step;
    EXPECT_EQ(lhs, rhs) << "false step \"" << step << "\" in " << t.prompt << t.solution;
  }
}

Task manual(Family f, std::string answer, std::vector<int> numbers = {}, int target = 0) {
  Task t;
  t.family = f;
  t.answer = std::move(answer);
  t.numbers = std::move(numbers);
  t.target = target;
  return t;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("quads_rl_" + std::to_string(::getpid()) + "_" + name)).string();
}

}  // namespace

// Every level of every family: the worked solution verifies, its steps are true equations, and
// the answer is right by an independent computation from the prompt.
TEST(RlTasks, EveryLevelSolvesAndVerifies) {
  for (int fi = 0; fi < kNumFamilies; ++fi) {
    auto f = static_cast<Family>(fi);
    int lo, hi;
    level_range(f, &lo, &hi);
    for (int level = lo; level <= hi; ++level) {
      for (uint64_t s = 0; s < 60; ++s) {
        Task t = make_task(f, level, s * 1000003 + static_cast<uint64_t>(level));
        ASSERT_EQ(t.family, f);
        ASSERT_EQ(t.level, level);
        ASSERT_EQ(t.prompt.back(), '\n');
        ASSERT_EQ(t.solution.substr(t.solution.size() - t.answer.size() - 3), "=> " + t.answer);
        EXPECT_EQ(verify_text(t, t.solution).outcome, Outcome::Correct) << t.prompt << t.solution;
        expect_steps_true(t);
        std::string body = t.prompt.substr(0, t.prompt.size() - 1);
        if (f == Family::Add || f == Family::Mul) {
          char op = f == Family::Add ? '+' : '*';
          auto ops = split(body.substr(4), op);
          ASSERT_EQ(ops.size(), 2u);
          EXPECT_EQ(ops[0].size(), static_cast<size_t>(level));
          EXPECT_EQ(ops[1].size(), static_cast<size_t>(level));
          int64_t a = std::stoll(ops[0]), b = std::stoll(ops[1]);
          EXPECT_EQ(t.answer, std::to_string(f == Family::Add ? a + b : a * b));
        } else if (f == Family::Sort) {
          auto in = split(body.substr(5), ' ');
          ASSERT_EQ(in.size(), static_cast<size_t>(level));
          std::vector<int> v;
          for (auto& x : in) v.push_back(std::stoi(x));
          std::sort(v.begin(), v.end());
          std::string expect;
          for (size_t i = 0; i < v.size(); ++i) expect += (i ? " " : "") + std::to_string(v[i]);
          EXPECT_EQ(t.answer, expect);
        } else {
          ASSERT_EQ(t.numbers.size(), static_cast<size_t>(level));
          EXPECT_EQ(body, "make " + std::to_string(t.target) + " from " + [&] {
                      std::string s;
                      for (size_t i = 0; i < t.numbers.size(); ++i) s += (i ? " " : "") + std::to_string(t.numbers[i]);
                      return s;
                    }());
          int64_t v;
          std::vector<int64_t> lits;
          ASSERT_TRUE(eval_countdown_expr(t.answer, &v, &lits));
          EXPECT_EQ(v, t.target);
          // The level is the number of numbers the shortest solution needs: all of them.
          EXPECT_EQ(lits.size(), static_cast<size_t>(level)) << t.prompt << t.solution;
          EXPECT_TRUE(std::find(t.numbers.begin(), t.numbers.end(), t.target) == t.numbers.end());
          EXPECT_GE(t.target, 1);
          EXPECT_LE(t.target, 200);
        }
      }
    }
  }
}

TEST(RlTasks, AdditionStepsFollowTheColumns) {
  Task t = make_task(Family::Add, 3, 7);
  std::string body = t.prompt.substr(4, t.prompt.size() - 5);
  auto ops = split(body, '+');
  auto steps = split(t.solution.substr(0, t.solution.find(" =>")), ' ');
  ASSERT_EQ(steps.size(), 3u);
  int carry = 0;
  for (int j = 0; j < 3; ++j) {
    int da = ops[0][2 - j] - '0', db = ops[1][2 - j] - '0';
    std::string expect = std::to_string(da) + "+" + std::to_string(db) + (carry ? "+1" : "") + "=" +
                         std::to_string(da + db + carry);
    EXPECT_EQ(steps[j], expect);
    carry = (da + db + carry) / 10;
  }
}

TEST(RlTasks, HandCheckedExamples) {
  std::string steps, expr;
  ASSERT_TRUE(solve_countdown({15, 3, 2}, 21, &steps, &expr));
  EXPECT_EQ(steps, "3*2=6 15+6=21");
  EXPECT_EQ(expr, "15+3*2");
  ASSERT_TRUE(solve_countdown({14, 2, 12}, 144, &steps, &expr));
  int64_t v;
  std::vector<int64_t> lits;
  ASSERT_TRUE(eval_countdown_expr(expr, &v, &lits));
  EXPECT_EQ(v, 144);
  EXPECT_FALSE(solve_countdown({2, 3}, 7, &steps, &expr));
  EXPECT_FALSE(solve_countdown({1, 1, 1}, 9, &steps, &expr));
}

TEST(RlTasks, ExpressionEvaluator) {
  int64_t v;
  std::vector<int64_t> lits;
  ASSERT_TRUE(eval_countdown_expr("2+3*4", &v, &lits));
  EXPECT_EQ(v, 14);
  EXPECT_EQ(lits, (std::vector<int64_t>{2, 3, 4}));
  ASSERT_TRUE(eval_countdown_expr("(2+3)*4", &v, &lits));
  EXPECT_EQ(v, 20);
  ASSERT_TRUE(eval_countdown_expr("10-2-3", &v, &lits));
  EXPECT_EQ(v, 5);
  ASSERT_TRUE(eval_countdown_expr("2*(3-5)", &v, &lits));
  EXPECT_EQ(v, -4);
  ASSERT_TRUE(eval_countdown_expr("((7))", &v, &lits));
  EXPECT_EQ(v, 7);
  for (const char* bad : {"", "2+", "+2", "-2+3", "2 + 3", "(2+3", "2+3)", "2/3", "02+3", "2**3", "()", "2(3)",
                          "999999999999*999999999999"})
    EXPECT_FALSE(eval_countdown_expr(bad, &v, &lits)) << bad;
}

TEST(RlTasks, VerifierFormatRules) {
  Task add = manual(Family::Add, "632");
  auto out = [&](const Task& t, const char* r) { return verify_text(t, r).outcome; };
  EXPECT_EQ(out(add, "7+5=12 4+8+1=13 3+2+1=6 => 632"), Outcome::Correct);
  EXPECT_EQ(out(add, "=> 632"), Outcome::Correct);
  EXPECT_EQ(verify_text(add, "=> 632").reward, 1.f);
  EXPECT_EQ(out(add, "=> 633"), Outcome::Wrong);
  EXPECT_EQ(verify_text(add, "=> 633").reward, 0.f);
  for (const char* bad : {"", "632", "=>632", "=> 0632", "=> 632 ", "=> 632\n", "=> 6 => 632", "=> ", "=> -632",
                          "= > 632", "=> 63 2"})
    EXPECT_EQ(out(add, bad), Outcome::Malformed) << '"' << bad << '"';

  Task sort = manual(Family::Sort, "4 7 33 52 91");
  EXPECT_EQ(out(sort, "=> 4 7 33 52 91"), Outcome::Correct);
  EXPECT_EQ(out(sort, "=> 4 7 33 52"), Outcome::Wrong);
  EXPECT_EQ(out(sort, "=> 91 52 33 7 4"), Outcome::Wrong);
  for (const char* bad : {"=> 4  7 33 52 91", "=> 4,7,33,52,91", "=> 4 7 33 52 91 ", "=> 04 7 33 52 91"})
    EXPECT_EQ(out(sort, bad), Outcome::Malformed) << bad;

  Task cd = manual(Family::Countdown, "15+3*2", {15, 3, 2}, 21);
  EXPECT_EQ(out(cd, "3*2=6 15+6=21 => 15+3*2"), Outcome::Correct);
  EXPECT_EQ(out(cd, "=> 2*3+15"), Outcome::Correct);
  EXPECT_EQ(out(cd, "=> ((15)+(3*2))"), Outcome::Correct);
  EXPECT_EQ(out(cd, "=> (15+3)*2"), Outcome::Wrong);
  EXPECT_EQ(out(cd, "=> 15+3+3"), Outcome::InvalidNumbers);
  EXPECT_EQ(out(cd, "=> 21"), Outcome::InvalidNumbers);
  EXPECT_EQ(out(cd, "=> 15+6"), Outcome::InvalidNumbers);
  for (const char* bad : {"=> 15 + 3*2", "=> -2+15+3+5", "=> 15+03*2", "=> 15+3*2=21", "=> 15+3x2"})
    EXPECT_EQ(out(cd, bad), Outcome::Malformed) << bad;
}

TEST(RlTasks, VerifierOnTokenIds) {
  CharTokenizer tok;
  Task add = manual(Family::Add, "632");
  auto ids = tok.encode("x => 632");
  EXPECT_EQ(verify_ids(add, ids, tok).outcome, Outcome::Truncated);
  ids.push_back(tok.eos_id());
  EXPECT_EQ(verify_ids(add, ids, tok).outcome, Outcome::Correct);
  ids.push_back(tok.char_id('9'));  // after <eos>: ignored
  EXPECT_EQ(verify_ids(add, ids, tok).outcome, Outcome::Correct);
  auto with_bos = tok.encode("=> 632");
  with_bos.insert(with_bos.begin(), tok.bos_id());
  with_bos.push_back(tok.eos_id());
  EXPECT_EQ(verify_ids(add, with_bos, tok).outcome, Outcome::Malformed);
  std::vector<int32_t> out_of_vocab{tok.vocab_size() + 3, tok.eos_id()};
  EXPECT_EQ(verify_ids(add, out_of_vocab, tok).outcome, Outcome::Malformed);
  EXPECT_EQ(verify_ids(add, std::vector<int32_t>{}, tok).outcome, Outcome::Truncated);
}

TEST(RlTasks, DeterministicAndSeedDependent) {
  Task a = make_task(Family::Countdown, 4, 99), b = make_task(Family::Countdown, 4, 99);
  EXPECT_EQ(a.prompt, b.prompt);
  EXPECT_EQ(a.solution, b.solution);
  TaskSet s1(TaskMix{}, 5, 64), s2(TaskMix{}, 5, 64), s3(TaskMix{}, 6, 64);
  int same_as_other_seed = 0;
  for (size_t i = 0; i < 64; ++i) {
    EXPECT_EQ(s1.eval_set()[i].prompt, s2.eval_set()[i].prompt);
    same_as_other_seed += s1.eval_set()[i].prompt == s3.eval_set()[i].prompt;
  }
  EXPECT_LT(same_as_other_seed, 8);
  for (uint64_t i : {0ull, 1ull, 12345ull}) EXPECT_EQ(s1.train(i).solution, s2.train(i).solution);
  auto batch = s1.train_batch(100, 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(batch[i].prompt, s1.train(100 + i).prompt);
}

// Held-out prompts never appear in training, and the split is the documented hash rule.
TEST(RlTasks, EvalSetDisjointFromTraining) {
  TaskMix mix;
  mix.levels[0] = {1, 2};  // small spaces make collisions likely if the split were broken
  mix.levels[1] = {1};
  TaskSet ts(mix, 77, 300);
  std::set<std::string> eval;
  for (const auto& t : ts.eval_set()) {
    EXPECT_TRUE(is_eval_prompt(t.prompt));
    eval.insert(t.prompt);
  }
  for (uint64_t i = 0; i < 3000; ++i) {
    Task t = ts.train(i);
    EXPECT_FALSE(is_eval_prompt(t.prompt));
    EXPECT_EQ(eval.count(t.prompt), 0u) << t.prompt;
  }
  // Every family of the mix is represented in the evaluation set.
  int per_family[kNumFamilies] = {};
  for (const auto& t : ts.eval_set()) per_family[static_cast<int>(t.family)]++;
  for (int f = 0; f < kNumFamilies; ++f) EXPECT_GT(per_family[f], 30) << family_name(static_cast<Family>(f));
}

// The documented budget: prompt + solution <= 96 characters at the default difficulties.
TEST(RlTasks, DefaultLengthsFitTheBudget) {
  TaskSet ts(TaskMix{}, 3, 0);
  size_t longest = 0;
  for (uint64_t i = 0; i < 4000; ++i) {
    Task t = ts.train(i);
    longest = std::max(longest, t.prompt.size() + t.solution.size());
  }
  EXPECT_LE(longest, 96u);
  EXPECT_GE(longest, 50u);  // the mix does include the longer families
}

TEST(RlTasks, MixValidation) {
  TaskMix bad;
  bad.levels[1] = {4};
  EXPECT_THROW(TaskSet(bad, 1, 4), quads::Error);
  TaskMix empty;
  empty.families.clear();
  EXPECT_THROW(TaskSet(empty, 1, 4), quads::Error);
  EXPECT_THROW(make_task(Family::Sort, 11, 1), quads::Error);
  EXPECT_EQ(parse_family("countdown"), Family::Countdown);
  EXPECT_THROW(parse_family("division"), quads::Error);
}

TEST(RlTasks, SftExampleMasksThePrompt) {
  CharTokenizer tok;
  Task t = make_task(Family::Mul, 2, 11);
  SftExample ex = make_sft_example(t, tok);
  ASSERT_EQ(ex.tokens.size(), ex.loss_mask.size());
  ASSERT_EQ(ex.tokens.size(), 1 + t.prompt.size() + t.solution.size() + 1);
  EXPECT_EQ(ex.tokens.front(), tok.bos_id());
  EXPECT_EQ(ex.tokens.back(), tok.eos_id());
  for (size_t i = 0; i < ex.tokens.size(); ++i) EXPECT_EQ(ex.loss_mask[i], i > t.prompt.size() ? 1 : 0) << i;
  std::span<const int32_t> all(ex.tokens);
  EXPECT_EQ(tok.decode(all.subspan(1, ex.tokens.size() - 2)), t.prompt + t.solution);
}

TEST(RlTasks, ScoreCountsPerFamily) {
  std::vector<Task> tasks{manual(Family::Add, "1"), manual(Family::Add, "2"), manual(Family::Sort, "1 2")};
  std::vector<Verdict> v{{Outcome::Correct, 1.f}, {Outcome::Truncated, 0.f}, {Outcome::Correct, 1.f}};
  EvalScore s = score(tasks, v);
  EXPECT_EQ(s.n, 3);
  EXPECT_DOUBLE_EQ(s.pass1, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(s.family_pass1[0], 0.5);
  EXPECT_DOUBLE_EQ(s.family_pass1[3], 1.0);
  EXPECT_TRUE(std::isnan(s.family_pass1[1]));
  EXPECT_EQ(s.outcome_count[static_cast<int>(Outcome::Truncated)], 1);
}

// ---- tokenizer ---------------------------------------------------------------------------------
TEST(RlCharTokenizer, DefaultVocabulary) {
  CharTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 50);
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.char_id('\n'), 3);
  EXPECT_EQ(tok.char_id('0'), 5);
  EXPECT_EQ(tok.char_id('a'), 24);
  EXPECT_EQ(tok.char_id('z'), 49);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, 24, 2, 0}), "<bos>a<eos><pad>");
}

TEST(RlCharTokenizer, RoundTripsEveryTaskText) {
  CharTokenizer tok;
  for (int fi = 0; fi < kNumFamilies; ++fi) {
    int lo, hi;
    level_range(static_cast<Family>(fi), &lo, &hi);
    for (int l = lo; l <= hi; ++l) {
      Task t = make_task(static_cast<Family>(fi), l, 5);
      std::string text = t.prompt + t.solution;
      auto ids = tok.encode(text);
      ASSERT_EQ(ids.size(), text.size());
      for (int32_t id : ids) EXPECT_FALSE(tok.is_special(id));
      EXPECT_EQ(tok.decode(ids), text);
    }
  }
}

TEST(RlCharTokenizer, UnknownCharacterNamesCharAndPosition) {
  CharTokenizer tok;
  try {
    tok.encode("add 1+X");
    FAIL() << "no error";
  } catch (const quads::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'X'"), std::string::npos) << m;
    EXPECT_NE(m.find("position 6"), std::string::npos) << m;
  }
  EXPECT_THROW(tok.encode("a\tb"), quads::Error);
  EXPECT_THROW(tok.encode("A"), quads::Error);  // upper case is not in the vocabulary
  EXPECT_THROW(tok.decode(std::vector<int32_t>{3, 50}), quads::Error);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{-1}), quads::Error);
}

TEST(RlCharTokenizer, SaveLoadRoundTrip) {
  CharTokenizer tok;
  std::string path = temp_path("tokenizer.json");
  tok.save(path);
  CharTokenizer back = CharTokenizer::load(path);
  EXPECT_EQ(back, tok);
  EXPECT_EQ(back.encode("make 21 from 15 3 2\n"), tok.encode("make 21 from 15 3 2\n"));
  std::filesystem::remove(path);

  // A custom vocabulary survives the JSON form.
  nlohmann::json j = tok.to_json();
  j["tokens"].push_back("?");
  CharTokenizer custom = CharTokenizer::from_json(j, "custom.json");
  EXPECT_EQ(custom.vocab_size(), 51);
  EXPECT_EQ(custom.char_id('?'), 50);
}

TEST(RlCharTokenizer, LoadRejectsBadFiles) {
  auto message = [](const nlohmann::json& j) {
    try {
      CharTokenizer::from_json(j, "bad.json");
    } catch (const quads::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json good = CharTokenizer().to_json();
  nlohmann::json dup = good;
  dup["tokens"].push_back("a");
  EXPECT_NE(message(dup).find("appears twice"), std::string::npos) << message(dup);
  nlohmann::json multi = good;
  multi["tokens"][10] = "ab";
  EXPECT_NE(message(multi).find("not a single character"), std::string::npos);
  nlohmann::json special = good;
  special["eos_id"] = 99;
  EXPECT_NE(message(special).find("bad.json"), std::string::npos);
  nlohmann::json type = good;
  type["type"] = "bpe";
  EXPECT_NE(message(type).find("type"), std::string::npos);

  std::string path = temp_path("broken.json");
  {
    std::ofstream f(path);
    f << "{not json";
  }
  try {
    CharTokenizer::load(path);
    FAIL() << "no error";
  } catch (const quads::Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
  }
  std::filesystem::remove(path);
  EXPECT_THROW(CharTokenizer::load(path), quads::Error);  // missing file
}
