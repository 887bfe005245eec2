#include "rl/task_source.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "rl/math_verify.h"
#include "rl/policy.h"

namespace fs = std::filesystem;

namespace quads::rl {

namespace {

uint64_t mix64(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a 64 of a file's bytes and its size: which data a run used, recorded in data.json.
nlohmann::json file_fingerprint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  uint64_t h = 0xcbf29ce484222325ull;
  size_t n = 0;
  char buf[1 << 16];
  while (f) {
    f.read(buf, sizeof buf);
    const std::streamsize got = f.gcount();
    for (std::streamsize i = 0; i < got; ++i) {
      h ^= static_cast<unsigned char>(buf[i]);
      h *= 0x100000001b3ull;
    }
    n += static_cast<size_t>(got);
  }
  return {{"path", path}, {"bytes", n}, {"fnv1a64", fmt::format("{:016x}", h)}};
}

// The response up to its first stop id; `stopped` tells whether there was one.
std::span<const int32_t> cut_at_stop(std::span<const int32_t> r, const std::vector<int32_t>& stop, bool* stopped) {
  for (size_t i = 0; i < r.size(); ++i)
    if (std::find(stop.begin(), stop.end(), r[i]) != stop.end()) {
      *stopped = true;
      return r.first(i);
    }
  *stopped = false;
  return r;
}

}  // namespace

// ---- generated tasks -----------------------------------------------------------------------------

GeneratedTasks::GeneratedTasks(const RunConfig& cfg, CharTokenizer tok)
    : tasks_(cfg.task_mix(), static_cast<uint64_t>(cfg.tasks.seed), static_cast<int>(cfg.rl.eval_size)),
      tok_(std::move(tok)),
      stop_{tok_.eos_id()} {
  const auto& ev = tasks_.eval_set();
  for (size_t i = 0; i < ev.size(); ++i) eval_.push_back(problem(ev[i], static_cast<int64_t>(i)));
}

Problem GeneratedTasks::problem(const Task& t, int64_t item) const {
  Problem p;
  p.prompt = tok_.encode_prompt(t.prompt);
  p.item = item;
  p.task = std::make_shared<const Task>(t);
  return p;
}

std::vector<Problem> GeneratedTasks::train_batch(int64_t seed, int64_t step, int P) const {
  const uint64_t first = (static_cast<uint64_t>(seed) << 32) + static_cast<uint64_t>(step * P);
  std::vector<Problem> out;
  const std::vector<Task> batch = tasks_.train_batch(first, P);
  for (size_t j = 0; j < batch.size(); ++j) out.push_back(problem(batch[j], static_cast<int64_t>(first + j)));
  return out;
}

Verdict GeneratedTasks::verify(const Problem& p, std::span<const int32_t> response) const {
  QUADS_CHECK(p.task, "generated tasks: problem {} has no task", p.item);
  return verify_ids(*p.task, response, tok_);
}

std::string GeneratedTasks::decode(std::span<const int32_t> response) const {
  bool stopped = false;
  const auto body = cut_at_stop(response, stop_, &stopped);
  std::string out;
  // The embedding is padded past the vocabulary: an untrained model can sample those ids.
  for (int32_t id : body) out += id >= 0 && id < tok_.vocab_size() ? tok_.token(id) : fmt::format("<{}?>", id);
  return out;
}

std::vector<std::vector<int32_t>> GeneratedTasks::calibration(int n) const {
  std::vector<std::vector<int32_t>> out;
  for (const Task& t : tasks_.train_batch(uint64_t(1) << 62, n)) out.push_back(make_sft_example(t, tok_).tokens);
  return out;
}

SourceScore GeneratedTasks::score(std::span<const Verdict> verdicts) const {
  std::vector<Task> tasks;
  for (const Problem& p : eval_) tasks.push_back(*p.task);
  const EvalScore e = rl::score(tasks, verdicts);
  SourceScore s;
  s.pass1 = e.pass1;
  s.n = e.n;
  for (int f = 0; f < kNumFamilies; ++f) {
    s.group_names.push_back(family_name(static_cast<Family>(f)));
    s.group_pass1.push_back(e.family_pass1[f]);
    s.group_count.push_back(e.family_count[f]);
  }
  std::copy(std::begin(e.outcome_count), std::end(e.outcome_count), s.outcome_count);
  return s;
}

nlohmann::json GeneratedTasks::describe() const {
  std::vector<std::string> fams;
  for (Family f : tasks_.mix().families) fams.push_back(family_name(f));
  return {{"source", "generated tasks"},
          {"families", fams},
          {"task_seed", tasks_.seed()},
          {"eval_size", eval_.size()},
          {"tokenizer", "quads-char"}};
}

// ---- datasets ------------------------------------------------------------------------------------

DatasetTasks::DatasetTasks(const DataSection& d, int64_t eval_size, const model::ModelConfig& mc, io::Tokenizer tok)
    : d_(d), tok_(std::move(tok)), vocab_(mc.vocab_size) {
  const bool has_chat = tok_.token_to_id("<|im_start|>").has_value() && tok_.token_to_id("<|im_end|>").has_value();
  if (d_.prompt_format == "chat") {
    QUADS_CHECK(has_chat, "data.prompt_format = \"chat\" but the tokenizer {} has no <|im_start|> / <|im_end|> tokens",
                tok_.path());
    chat_ = true;
  } else if (d_.prompt_format == "auto") {
    chat_ = has_chat;
  } else {
    QUADS_CHECK(d_.prompt_format == "raw", "data.prompt_format = \"{}\" (auto | chat | raw)", d_.prompt_format);
  }

  // Stop tokens: the chat end markers, then the config's eos_token_id (a number or a list).
  auto add_stop = [&](int64_t id, const std::string& what) {
    QUADS_CHECK(id >= 0 && id < vocab_, "{} = {} is outside the model's vocabulary of {}", what, id, vocab_);
    if (std::find(stop_.begin(), stop_.end(), static_cast<int32_t>(id)) == stop_.end())
      stop_.push_back(static_cast<int32_t>(id));
  };
  if (chat_) {
    add_stop(tok_.special_id("<|im_end|>"), "<|im_end|>");
    if (auto e = tok_.token_to_id("<|endoftext|>")) add_stop(*e, "<|endoftext|>");
  }
  if (mc.raw.is_object() && mc.raw.contains("eos_token_id") && !mc.raw["eos_token_id"].is_null()) {
    const auto& e = mc.raw["eos_token_id"];
    if (e.is_number_integer()) {
      add_stop(e.get<int64_t>(), "config.json eos_token_id");
    } else {
      QUADS_CHECK(e.is_array(), "config.json: field 'eos_token_id' must be an integer or a list, got {}", e.dump());
      for (const auto& x : e) {
        QUADS_CHECK(x.is_number_integer(), "config.json: field 'eos_token_id' holds {}, not a token id", x.dump());
        add_stop(x.get<int64_t>(), "config.json eos_token_id");
      }
    }
  }
  if (stop_.empty())
    if (auto e = tok_.token_to_id("<|endoftext|>")) add_stop(*e, "<|endoftext|>");
  QUADS_CHECK(!stop_.empty(),
              "raw prompts need an end token: config.json has no eos_token_id and the tokenizer {} no <|endoftext|>",
              tok_.path());

  size_t bad = 0, long_ = 0;
  items_ = load(d_.train, "train", &bad, &long_);
  QUADS_CHECK(!items_.empty(), "dataset {}: no usable example", d_.train);
  std::vector<size_t> eval_items;
  info_["train"] = file_fingerprint(d_.train);
  if (!d_.eval.empty()) {
    for (size_t i = 0; i < items_.size(); ++i) train_.push_back(i);
    std::vector<Item> ev = load(d_.eval, "eval", &bad, &long_);
    QUADS_CHECK(!ev.empty(), "dataset {}: no usable example", d_.eval);
    for (auto& it : ev) {
      eval_items.push_back(items_.size());
      items_.push_back(std::move(it));
    }
    info_["eval"] = file_fingerprint(d_.eval);
  } else {
    // A seeded held-out split; both sides keep file order.
    const size_t n = items_.size();
    const size_t n_eval = std::max<size_t>(1, static_cast<size_t>(std::llround(static_cast<double>(n) * d_.eval_split)));
    QUADS_CHECK(n_eval < n, "dataset {}: {} usable example(s) are too few to hold out {} for evaluation (data.eval_split "
                "= {}); give data.eval", d_.train, n, n_eval, d_.eval_split);
    const std::vector<size_t> perm = io::PromptSampler(n, mix64(static_cast<uint64_t>(d_.seed), 0x5E1D)).permutation(0);
    std::vector<uint8_t> held(n, 0);
    for (size_t i = 0; i < n_eval; ++i) held[perm[i]] = 1;
    for (size_t i = 0; i < n; ++i) (held[i] ? eval_items : train_).push_back(i);
    info_["eval"] = fmt::format("{} examples held out of {} (data.eval_split = {}, data.seed = {})", n_eval,
                                d_.train, d_.eval_split, d_.seed);
  }
  for (size_t k = 0; k < eval_items.size() && static_cast<int64_t>(k) < eval_size; ++k) {
    Problem p;
    p.prompt = items_[eval_items[k]].prompt;
    p.item = static_cast<int64_t>(eval_items[k]);
    eval_.push_back(std::move(p));
  }
  info_["source"] = "dataset";
  info_["tokenizer"] = tok_.path();
  info_["prompt_format"] = chat_ ? "chat" : "raw";
  info_["stop_ids"] = stop_;
  info_["train_examples"] = train_.size();
  info_["eval_examples"] = eval_.size();
  info_["skipped_bad_lines"] = bad;
  info_["skipped_long_prompts"] = long_;
  info_["prompt_field"] = d_.prompt_field;
  info_["answer_field"] = d_.answer_field;
}

std::vector<DatasetTasks::Item> DatasetTasks::load(const std::string& path, const char* role, size_t* skipped_bad,
                                                   size_t* skipped_long) {
  io::DatasetOptions o;
  o.prompt_field = d_.prompt_field;
  o.answer_field = d_.answer_field;
  o.skip_bad_lines = d_.skip_bad_lines;
  const io::Dataset ds = io::load_jsonl(path, o);
  *skipped_bad += ds.skipped;
  // Recorded in data.json (the first 100); the commands print a one-line count.
  for (const auto& w : ds.warnings) info_["skipped"].push_back(fmt::format("{} set: {}", role, w));
  std::vector<Item> out;
  for (const io::Example& ex : ds.examples) {
    Item it;
    it.where = fmt::format("{}:{}", path, ex.line);
    it.text = ex.prompt;
    it.answer = ex.answer;
    try {
      it.prompt = chat_ ? io::encode_chat_prompt(tok_, ex.prompt, d_.system_prompt) : tok_.encode(ex.prompt);
    } catch (const Error& e) {
      fail("dataset {}: the prompt cannot be tokenized: {}", it.where, e.what());
    }
    if (it.prompt.empty()) {
      QUADS_CHECK(d_.skip_bad_lines, "dataset {}: the prompt is empty (set skip_bad_lines to skip bad lines)",
                  it.where);
      ++*skipped_bad;
      if (info_["skipped"].size() < 200) info_["skipped"].push_back(fmt::format("{} set: {}: empty prompt", role, it.where));
      continue;
    }
    for (int32_t t : it.prompt)
      QUADS_CHECK(t < vocab_, "dataset {}: the prompt has token id {}, outside the model's vocabulary of {}", it.where,
                  t, vocab_);
    if (static_cast<int64_t>(it.prompt.size()) > d_.max_prompt_tokens) {
      QUADS_CHECK(d_.skip_long_prompts,
                  "dataset {}: the prompt has {} tokens, more than data.max_prompt_tokens = {} (set "
                  "data.skip_long_prompts = true to skip such prompts)",
                  it.where, it.prompt.size(), d_.max_prompt_tokens);
      ++*skipped_long;
      if (info_["skipped"].size() < 200)
        info_["skipped"].push_back(fmt::format("{} set: {}: {} prompt tokens", role, it.where, it.prompt.size()));
      continue;
    }
    out.push_back(std::move(it));
  }
  return out;
}

std::vector<size_t> DatasetTasks::train_indices(int64_t seed, int64_t step, int P) const {
  const size_t n = train_.size();
  const io::PromptSampler order(n, mix64(static_cast<uint64_t>(d_.seed), static_cast<uint64_t>(seed)));
  std::vector<size_t> out;
  uint64_t cur_epoch = UINT64_MAX;
  std::vector<size_t> perm;
  for (int j = 0; j < P; ++j) {
    const uint64_t k = static_cast<uint64_t>(step) * static_cast<uint64_t>(P) + static_cast<uint64_t>(j);
    const uint64_t epoch = k / n;
    if (epoch != cur_epoch) {
      perm = order.permutation(epoch);
      cur_epoch = epoch;
    }
    out.push_back(train_[perm[k % n]]);
  }
  return out;
}

std::vector<Problem> DatasetTasks::train_batch(int64_t seed, int64_t step, int P) const {
  std::vector<Problem> out;
  for (size_t i : train_indices(seed, step, P)) {
    Problem p;
    p.prompt = items_[i].prompt;
    p.item = static_cast<int64_t>(i);
    out.push_back(std::move(p));
  }
  return out;
}

const std::string& DatasetTasks::answer(const Problem& p) const {
  QUADS_CHECK(p.item >= 0 && static_cast<size_t>(p.item) < items_.size(), "dataset: no example {}", p.item);
  return items_[static_cast<size_t>(p.item)].answer;
}

Verdict DatasetTasks::verify(const Problem& p, std::span<const int32_t> response) const {
  bool stopped = false;
  const auto body = cut_at_stop(response, stop_, &stopped);
  Verdict v;
  if (!stopped && !d_.score_truncated) {
    v.outcome = Outcome::Truncated;
    return v;
  }
  const MathVerdict m = verify_math(tok_.decode(body), answer(p));
  v.reward = m.reward > 0 ? 1.f : 0.f;
  v.outcome = m.reward > 0 ? Outcome::Correct : !stopped ? Outcome::Truncated : m.found ? Outcome::Wrong : Outcome::Malformed;
  return v;
}

std::string DatasetTasks::decode(std::span<const int32_t> response) const {
  bool stopped = false;
  return tok_.decode(cut_at_stop(response, stop_, &stopped));
}

std::vector<std::vector<int32_t>> DatasetTasks::calibration(int n) const {
  // The first n training prompts of a fixed shuffle (independent of the run seed).
  std::vector<std::vector<int32_t>> out;
  const auto perm = io::PromptSampler(train_.size(), mix64(static_cast<uint64_t>(d_.seed), 0xCA11B)).permutation(0);
  for (size_t k = 0; k < perm.size() && static_cast<int>(out.size()) < n; ++k) out.push_back(items_[train_[perm[k]]].prompt);
  return out;
}

SourceScore DatasetTasks::score(std::span<const Verdict> verdicts) const {
  QUADS_CHECK(verdicts.size() == eval_.size(), "score: {} problems but {} verdicts", eval_.size(), verdicts.size());
  SourceScore s;
  double correct = 0;
  for (const Verdict& v : verdicts) {
    correct += v.reward;
    s.outcome_count[static_cast<int>(v.outcome)]++;
  }
  s.n = static_cast<int>(verdicts.size());
  s.pass1 = s.n ? correct / s.n : std::nan("");
  return s;
}

nlohmann::json DatasetTasks::describe() const { return info_; }

// ---- a run's inputs ------------------------------------------------------------------------------

RunInputs load_run_inputs(const RunConfig& cfg, const std::string& base_dir) {
  // Every piece is made before the result: no partly built RunInputs is ever unwound.
  if (!cfg.uses_dataset()) {
    BaseModel b = load_base(base_dir);
    auto src = std::make_unique<GeneratedTasks>(cfg, std::move(b.tok));
    return RunInputs{std::move(b.weights), std::move(src), base_dir};
  }
  const std::string& dir = cfg.data.model;
  QUADS_CHECK(fs::exists(dir + "/config.json"), "data.model {}: config.json is missing", dir);
  QUADS_CHECK(fs::exists(dir + "/tokenizer.json"), "data.model {}: tokenizer.json is missing (an HF tokenizer)", dir);
  model::Weights w = model::Weights::load(dir);
  io::Tokenizer tok = io::Tokenizer::load(dir + "/tokenizer.json");
  QUADS_CHECK(tok.vocab_size() <= w.cfg.vocab_size,
              "data.model {}: the tokenizer has {} ids but the model's embedding only {} rows", dir, tok.vocab_size(),
              w.cfg.vocab_size);
  auto src = std::make_unique<DatasetTasks>(cfg.data, cfg.rl.eval_size, w.cfg, std::move(tok));
  return RunInputs{std::move(w), std::move(src), dir};
}

SourceEval evaluate_source(rollout::RolloutEngine& eng, const TaskSource& src, int64_t max_new_tokens,
                           double temperature, uint64_t seed) {
  const auto& probs = src.eval_set();
  std::vector<rollout::Request> reqs(probs.size());
  for (size_t i = 0; i < probs.size(); ++i) {
    rollout::Request& r = reqs[i];
    r.prompt = probs[i].prompt;
    r.max_new_tokens = static_cast<int>(max_new_tokens);
    r.stop_ids = src.stop_ids();
    r.sampling.temperature = temperature;
    r.sampling.greedy = temperature == 0.0;
    if (r.sampling.greedy) r.sampling.temperature = 1.0;
    r.seed = seed + i;
  }
  const std::vector<rollout::Result> res = eng.generate(reqs);
  SourceEval out;
  for (size_t i = 0; i < probs.size(); ++i) {
    out.verdicts.push_back(src.verify(probs[i], res[i].tokens));
    out.responses.push_back(src.decode(res[i].tokens));
    out.generated += static_cast<int64_t>(res[i].tokens.size());
  }
  out.score = src.score(out.verdicts);
  return out;
}

}  // namespace quads::rl
