#include "rl/config.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <toml++/toml.h>
#include <variant>

#include "common/error.h"
#include "rl/report.h"

namespace quads::rl {

namespace {

using FieldPtr = std::variant<int64_t*, double*, bool*, std::string*, std::vector<std::string>*,
                              std::vector<int64_t>*>;
struct Field {
  std::string key;
  FieldPtr ptr;
};

// The one list of keys: parsing, overrides, TOML/JSON output and docs all walk it in this order.
std::vector<Field> fields(RunConfig& c) {
  return {
      {"modes", &c.modes},
      {"model.hidden", &c.model.hidden},
      {"model.layers", &c.model.layers},
      {"model.heads", &c.model.heads},
      {"model.kv_heads", &c.model.kv_heads},
      {"model.head_dim", &c.model.head_dim},
      {"model.experts", &c.model.experts},
      {"model.experts_per_token", &c.model.experts_per_token},
      {"model.moe_intermediate", &c.model.moe_intermediate},
      {"model.max_seq_len", &c.model.max_seq_len},
      {"model.rope_theta", &c.model.rope_theta},
      {"model.rms_eps", &c.model.rms_eps},
      {"model.init_std", &c.model.init_std},
      {"sft.steps", &c.sft.steps},
      {"sft.lr", &c.sft.lr},
      {"sft.batch", &c.sft.batch},
      {"sft.warmup_steps", &c.sft.warmup_steps},
      {"sft.weight_decay", &c.sft.weight_decay},
      {"sft.grad_clip", &c.sft.grad_clip},
      {"rl.steps", &c.rl.steps},
      {"rl.group_size", &c.rl.group_size},
      {"rl.prompts_per_step", &c.rl.prompts_per_step},
      {"rl.lr", &c.rl.lr},
      {"rl.clip_eps_low", &c.rl.clip_eps_low},
      {"rl.clip_eps_high", &c.rl.clip_eps_high},
      {"rl.kl_coef", &c.rl.kl_coef},
      {"rl.max_new_tokens", &c.rl.max_new_tokens},
      {"rl.decode_ahead", &c.rl.decode_ahead},
      {"rl.temperature", &c.rl.temperature},
      {"rl.eval_temperature", &c.rl.eval_temperature},
      {"rl.eval_every", &c.rl.eval_every},
      {"rl.eval_size", &c.rl.eval_size},
      {"rl.collapse_margin", &c.rl.collapse_margin},
      {"rl.checkpoint_every", &c.rl.checkpoint_every},
      {"rl.seed", &c.rl.seed},
      {"rl.seeds", &c.rl.seeds},
      {"rl.aggregation", &c.rl.aggregation},
      {"rl.scale_adv_by_std", &c.rl.scale_adv_by_std},
      {"rl.tis", &c.rl.tis},
      {"rl.tis_cap", &c.rl.tis_cap},
      {"rl.minibatches", &c.rl.minibatches},
      {"rl.grad_clip", &c.rl.grad_clip},
      {"rl.routing_replay", &c.rl.routing_replay},
      {"rl.diagnostics", &c.rl.diagnostics},
      {"rl.device", &c.rl.device},
      {"rl.train_device", &c.rl.train_device},
      {"quads.rac_ratio", &c.quads.rac_ratio},
      {"quads.granularity", &c.quads.granularity},
      {"quads.rac_selection", &c.quads.rac_selection},
      {"quads.residual_format", &c.quads.residual_format},
      {"quads.asymmetric_qat", &c.quads.asymmetric_qat},
      {"tasks.families", &c.tasks.families},
      {"tasks.add_digits", &c.tasks.add_digits},
      {"tasks.mul_digits", &c.tasks.mul_digits},
      {"tasks.countdown_numbers", &c.tasks.countdown_numbers},
      {"tasks.sort_length", &c.tasks.sort_length},
      {"tasks.seed", &c.tasks.seed},
      {"data.model", &c.data.model},
      {"data.train", &c.data.train},
      {"data.eval", &c.data.eval},
      {"data.eval_split", &c.data.eval_split},
      {"data.prompt_field", &c.data.prompt_field},
      {"data.answer_field", &c.data.answer_field},
      {"data.skip_bad_lines", &c.data.skip_bad_lines},
      {"data.prompt_format", &c.data.prompt_format},
      {"data.system_prompt", &c.data.system_prompt},
      {"data.max_prompt_tokens", &c.data.max_prompt_tokens},
      {"data.skip_long_prompts", &c.data.skip_long_prompts},
      {"data.score_truncated", &c.data.score_truncated},
      {"data.seed", &c.data.seed},
      {"analysis.enabled", &c.analysis.enabled},
      {"analysis.batches", &c.analysis.batches},
      {"analysis.batch_size", &c.analysis.batch_size},
      {"analysis.max_len", &c.analysis.max_len},
      {"analysis.topk", &c.analysis.topk},
  };
}

Field* find_field(std::vector<Field>& fs, std::string_view key) {
  for (auto& f : fs)
    if (f.key == key) return &f;
  return nullptr;
}

const char* kind_name(const FieldPtr& p) {
  switch (p.index()) {
    case 0: return "an integer";
    case 1: return "a float";
    case 2: return "a boolean";
    case 3: return "a string";
    case 4: return "an array of strings";
    default: return "an array of integers";
  }
}

const char* node_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    default: return "a date/time";
  }
}

std::string where(const std::string& origin, const toml::node& n) {
  if (n.source().begin.line == 0) return origin;
  return fmt::format("{}:{}", origin, n.source().begin.line);
}

// Assigns a TOML value to a field; integers are accepted for floats, nothing else converts.
void assign(const Field& f, const toml::node& n, const std::string& at) {
  auto bad = [&]() { fail("{}: key '{}' expects {}, got {}", at, f.key, kind_name(f.ptr), node_type_name(n)); };
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          if (!n.is_integer()) bad();
          *p = n.as_integer()->get();
        } else if constexpr (std::is_same_v<T, double>) {
          if (n.is_integer()) *p = static_cast<double>(n.as_integer()->get());
          else if (n.is_floating_point()) *p = n.as_floating_point()->get();
          else bad();
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!n.is_boolean()) bad();
          *p = n.as_boolean()->get();
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!n.is_string()) bad();
          *p = n.as_string()->get();
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (!n.is_array()) bad();
          T v;
          for (const auto& el : *n.as_array()) {
            if (!el.is_string()) fail("{}: key '{}' expects an array of strings, found {} in it", at, f.key, node_type_name(el));
            v.push_back(el.as_string()->get());
          }
          *p = std::move(v);
        } else {
          if (!n.is_array()) bad();
          T v;
          for (const auto& el : *n.as_array()) {
            if (!el.is_integer()) fail("{}: key '{}' expects an array of integers, found {} in it", at, f.key, node_type_name(el));
            v.push_back(el.as_integer()->get());
          }
          *p = std::move(v);
        }
      },
      f.ptr);
}

void walk(const toml::table& t, const std::string& prefix, std::vector<Field>& fs, const std::string& origin) {
  for (auto&& [k, node] : t) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (Field* f = find_field(fs, key)) {
      assign(*f, node, where(origin, node));
    } else if (node.is_table()) {
      bool is_section = std::any_of(fs.begin(), fs.end(), [&](const Field& f) { return f.key.rfind(key + ".", 0) == 0; });
      if (!is_section) fail("{}: unknown section [{}] in {}", where(origin, node), key, origin);
      walk(*node.as_table(), key, fs, origin);
    } else {
      fail("{}: unknown key '{}' in {}", where(origin, node), key, origin);
    }
  }
}

std::string trim(std::string_view s) {
  size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string_view::npos ? std::string() : std::string(s.substr(a, b - a + 1));
}

std::vector<std::string> split_commas(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t c = s.find(',', start);
    out.push_back(trim(s.substr(start, c == std::string_view::npos ? std::string_view::npos : c - start)));
    if (c == std::string_view::npos) break;
    start = c + 1;
  }
  return out;
}

std::string toml_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // "n": inf/nan keep their spelling
  return s;
}

std::string toml_value(const FieldPtr& p) {
  return std::visit(
      [](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) return std::to_string(*v);
        else if constexpr (std::is_same_v<T, double>) return toml_float(*v);
        else if constexpr (std::is_same_v<T, bool>) return *v ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::string>) return nlohmann::json(*v).dump();
        else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          std::vector<std::string> q;
          for (const auto& s : *v) q.push_back(nlohmann::json(s).dump());
          return fmt::format("[{}]", fmt::join(q, ", "));
        } else {
          return fmt::format("[{}]", fmt::join(*v, ", "));
        }
      },
      p);
}

}  // namespace

TaskMix RunConfig::task_mix() const {
  TaskMix m;
  m.families.clear();
  for (const auto& f : tasks.families) m.families.push_back(parse_family(f));
  const std::vector<int64_t>* lv[kNumFamilies] = {&tasks.add_digits, &tasks.mul_digits, &tasks.countdown_numbers,
                                                  &tasks.sort_length};
  for (int f = 0; f < kNumFamilies; ++f) m.levels[f].assign(lv[f]->begin(), lv[f]->end());
  return m;
}

PgConfig RunConfig::pg_config() const {
  PgConfig p;
  p.clip_low = rl.clip_eps_low;
  p.clip_high = rl.clip_eps_high;
  p.kl_coef = rl.kl_coef;
  p.tis = rl.tis;
  p.tis_cap = rl.tis_cap;
  p.aggregation = parse_aggregation(rl.aggregation);
  p.norm_len = static_cast<double>(rl.max_new_tokens);
  return p;
}

AdvantageConfig RunConfig::advantage_config() const {
  AdvantageConfig a;
  a.scale_by_std = rl.scale_adv_by_std;
  return a;
}

RunConfig parse_config(std::string_view toml_text, const std::string& origin, const RunConfig& base) {
  toml::table tbl;
  try {
    tbl = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    fail("{}:{}: TOML syntax error: {}", origin, e.source().begin.line, e.description());
  }
  RunConfig cfg = base;
  auto fs = fields(cfg);
  walk(tbl, "", fs, origin);
  return cfg;
}

void apply_override(RunConfig& cfg, std::string_view assignment) {
  std::string origin = fmt::format("--set {}", assignment);
  size_t eq = assignment.find('=');
  QUADS_CHECK(eq != std::string_view::npos, "{}: expected key=value", origin);
  std::string key = trim(assignment.substr(0, eq)), raw = trim(assignment.substr(eq + 1));
  auto fs = fields(cfg);
  Field* f = find_field(fs, key);
  QUADS_CHECK(f, "{}: unknown key '{}'", origin, key);
  // Read the value as TOML first; fall back to bare words and comma lists where the key allows.
  toml::table parsed;
  bool ok = true;
  try {
    parsed = toml::parse(std::string_view("v = " + raw), std::string_view("--set"));
  } catch (const toml::parse_error&) {
    ok = false;
  }
  const toml::node* n = ok ? parsed.get("v") : nullptr;
  switch (f->ptr.index()) {
    case 3:  // string
      if (!n || !n->is_string()) {
        *std::get<std::string*>(f->ptr) = raw;
        return;
      }
      break;
    case 4:  // list of strings
      if (!n || !n->is_array()) {
        std::vector<std::string> v = split_commas(raw);
        for (auto& s : v)
          if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
        *std::get<std::vector<std::string>*>(f->ptr) = v;
        return;
      }
      break;
    case 5:  // list of integers
      if (!n || !n->is_array()) {
        std::vector<int64_t> v;
        for (const auto& s : split_commas(raw)) {
          size_t used = 0;
          long long x = 0;
          try {
            x = std::stoll(s, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          QUADS_CHECK(used == s.size() && !s.empty(), "{}: key '{}' expects an array of integers, \"{}\" is not one",
                      origin, key, s);
          v.push_back(x);
        }
        *std::get<std::vector<int64_t>*>(f->ptr) = v;
        return;
      }
      break;
    default: break;
  }
  QUADS_CHECK(n, "{}: key '{}' expects {}, \"{}\" is not a TOML value", origin, key, kind_name(f->ptr), raw);
  assign(*f, *n, origin);
}

void validate(const RunConfig& c, const std::string& origin) {
  auto check = [&](bool ok, std::string_view key, std::string_view value, std::string_view rule) {
    if (!ok) fail("{}: {} = {}: {}", origin, key, value, rule);
  };
  auto one_of = [&](const std::string& v, std::string_view key, std::initializer_list<std::string_view> allowed) {
    bool ok = std::find(allowed.begin(), allowed.end(), v) != allowed.end();
    check(ok, key, nlohmann::json(v).dump(), fmt::format("must be one of {}", fmt::join(allowed, ", ")));
  };
  auto pos = [&](auto v, std::string_view key) { check(v > 0, key, fmt::format("{}", v), "must be > 0"); };
  auto nonneg = [&](auto v, std::string_view key) { check(v >= 0, key, fmt::format("{}", v), "must be >= 0"); };

  check(!c.modes.empty(), "modes", "[]", "needs at least one mode");
  std::set<std::string> seen;
  for (const auto& m : c.modes) {
    bool known = std::find(known_modes().begin(), known_modes().end(), m) != known_modes().end();
    check(known, "modes", nlohmann::json(m).dump(), fmt::format("unknown mode (known: {})", fmt::join(known_modes(), ", ")));
    check(seen.insert(m).second, "modes", nlohmann::json(m).dump(), "listed twice");
  }

  const auto& m = c.model;
  pos(m.hidden, "model.hidden");
  pos(m.layers, "model.layers");
  pos(m.heads, "model.heads");
  pos(m.kv_heads, "model.kv_heads");
  check(m.heads % m.kv_heads == 0, "model.kv_heads", std::to_string(m.kv_heads), "must divide model.heads");
  pos(m.head_dim, "model.head_dim");
  pos(m.experts, "model.experts");
  pos(m.experts_per_token, "model.experts_per_token");
  check(m.experts_per_token <= m.experts, "model.experts_per_token", std::to_string(m.experts_per_token),
        "must be <= model.experts");
  pos(m.moe_intermediate, "model.moe_intermediate");
  pos(m.max_seq_len, "model.max_seq_len");
  pos(m.rope_theta, "model.rope_theta");
  pos(m.rms_eps, "model.rms_eps");
  pos(m.init_std, "model.init_std");

  nonneg(c.sft.steps, "sft.steps");
  pos(c.sft.lr, "sft.lr");
  pos(c.sft.batch, "sft.batch");
  nonneg(c.sft.warmup_steps, "sft.warmup_steps");
  nonneg(c.sft.weight_decay, "sft.weight_decay");
  nonneg(c.sft.grad_clip, "sft.grad_clip");

  const auto& r = c.rl;
  nonneg(r.steps, "rl.steps");
  check(r.group_size >= 2, "rl.group_size", std::to_string(r.group_size), "must be >= 2 (GRPO compares samples)");
  pos(r.prompts_per_step, "rl.prompts_per_step");
  pos(r.lr, "rl.lr");
  check(r.clip_eps_low >= 0 && r.clip_eps_low < 1, "rl.clip_eps_low", fmt::format("{}", r.clip_eps_low), "must be in [0, 1)");
  nonneg(r.clip_eps_high, "rl.clip_eps_high");
  nonneg(r.kl_coef, "rl.kl_coef");
  pos(r.max_new_tokens, "rl.max_new_tokens");
  pos(r.decode_ahead, "rl.decode_ahead");
  pos(r.temperature, "rl.temperature");
  nonneg(r.eval_temperature, "rl.eval_temperature");
  pos(r.eval_every, "rl.eval_every");
  pos(r.eval_size, "rl.eval_size");
  nonneg(r.collapse_margin, "rl.collapse_margin");
  nonneg(r.checkpoint_every, "rl.checkpoint_every");
  nonneg(r.seed, "rl.seed");
  pos(r.seeds, "rl.seeds");
  one_of(r.aggregation, "rl.aggregation", {"token_mean", "seq_mean", "seq_sum_norm"});
  check(r.tis_cap >= 1, "rl.tis_cap", fmt::format("{}", r.tis_cap), "must be >= 1");
  pos(r.minibatches, "rl.minibatches");
  check((r.prompts_per_step * r.group_size) % r.minibatches == 0, "rl.minibatches", std::to_string(r.minibatches),
        fmt::format("must divide rl.prompts_per_step * rl.group_size = {}", r.prompts_per_step * r.group_size));
  nonneg(r.grad_clip, "rl.grad_clip");
  one_of(r.device, "rl.device", {"cpu", "cuda"});
  one_of(r.train_device, "rl.train_device", {"auto", "cpu", "cuda"});

  check(c.quads.rac_ratio >= 0 && c.quads.rac_ratio <= 1, "quads.rac_ratio", fmt::format("{}", c.quads.rac_ratio),
        "must be in [0, 1]");
  one_of(c.quads.granularity, "quads.granularity", {"block16", "channel"});
  one_of(c.quads.rac_selection, "quads.rac_selection", {"static", "dynamic"});
  one_of(c.quads.residual_format, "quads.residual_format", {"nvfp4", "fp8", "bf16"});

  const auto& t = c.tasks;
  check(!t.families.empty(), "tasks.families", "[]", "needs at least one family");
  seen.clear();
  for (const auto& f : t.families) {
    check(f == "add" || f == "mul" || f == "countdown" || f == "sort", "tasks.families", nlohmann::json(f).dump(),
          "unknown family (known: add, mul, countdown, sort)");
    check(seen.insert(f).second, "tasks.families", nlohmann::json(f).dump(), "listed twice");
  }
  const std::pair<const char*, const std::vector<int64_t>*> lists[kNumFamilies] = {
      {"tasks.add_digits", &t.add_digits},
      {"tasks.mul_digits", &t.mul_digits},
      {"tasks.countdown_numbers", &t.countdown_numbers},
      {"tasks.sort_length", &t.sort_length}};
  for (int fi = 0; fi < kNumFamilies; ++fi) {
    auto fam = static_cast<Family>(fi);
    auto [key, lv] = lists[fi];
    bool used = seen.count(family_name(fam)) > 0;
    check(!used || !lv->empty(), key, "[]", fmt::format("family {} is in tasks.families but has no level", family_name(fam)));
    int lo = 0, hi = 0;
    level_range(fam, &lo, &hi);
    for (int64_t l : *lv) check(l >= lo && l <= hi, key, std::to_string(l), fmt::format("levels run from {} to {}", lo, hi));
  }
  nonneg(t.seed, "tasks.seed");

  const auto& d = c.data;
  check(d.model.empty() || !d.train.empty(), "data.train", "\"\"", "a model folder (data.model) needs a training set");
  check(!d.model.empty() || (d.train.empty() && d.eval.empty()), "data.model", "\"\"",
        "datasets (data.train / data.eval) need a model folder with an HF tokenizer (the generated tasks use the "
        "SFT base)");
  check(d.eval_split > 0 && d.eval_split < 1, "data.eval_split", fmt::format("{}", d.eval_split), "must be in (0, 1)");
  check(!d.prompt_field.empty(), "data.prompt_field", "\"\"", "must name a field");
  check(!d.answer_field.empty(), "data.answer_field", "\"\"", "must name a field");
  one_of(d.prompt_format, "data.prompt_format", {"auto", "chat", "raw"});
  pos(d.max_prompt_tokens, "data.max_prompt_tokens");
  nonneg(d.seed, "data.seed");

  const auto& a = c.analysis;
  pos(a.batches, "analysis.batches");
  pos(a.batch_size, "analysis.batch_size");
  pos(a.max_len, "analysis.max_len");
  pos(a.topk, "analysis.topk");
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_config(path, overrides, {});
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides,
                      const std::function<void(RunConfig&)>& adjust) {
  RunConfig cfg;
  std::string origin = "built-in default config";
  if (!path.empty()) {
    std::ifstream f(path, std::ios::binary);
    QUADS_CHECK(f.good(), "cannot open config file {}", path);
    std::stringstream ss;
    ss << f.rdbuf();
    cfg = parse_config(ss.str(), path);
    origin = path;
  }
  for (const auto& o : overrides) apply_override(cfg, o);
  if (adjust) adjust(cfg);
  validate(cfg, origin + (overrides.empty() ? "" : " with --set overrides") + (adjust ? " and command-line options" : ""));
  return cfg;
}

std::string to_toml(const RunConfig& cfg) {
  RunConfig c = cfg;
  std::string out = "# quads run configuration (resolved)\n";
  std::string section;
  for (const auto& f : fields(c)) {
    size_t dot = f.key.find('.');
    std::string sec = dot == std::string::npos ? "" : f.key.substr(0, dot);
    std::string name = dot == std::string::npos ? f.key : f.key.substr(dot + 1);
    if (sec != section) {
      out += fmt::format("\n[{}]\n", sec);
      section = sec;
    }
    out += fmt::format("{} = {}\n", name, toml_value(f.ptr));
  }
  return out;
}

nlohmann::json to_json(const RunConfig& cfg) {
  RunConfig c = cfg;
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : fields(c)) {
    nlohmann::json v = std::visit([](auto* p) { return nlohmann::json(*p); }, f.ptr);
    size_t dot = f.key.find('.');
    if (dot == std::string::npos) j[f.key] = v;
    else j[f.key.substr(0, dot)][f.key.substr(dot + 1)] = v;
  }
  return j;
}

void save_resolved_config(const RunConfig& cfg, const std::string& dir) {
  write_text_atomic(dir + "/config.toml", to_toml(cfg));
  write_text_atomic(dir + "/config.json", to_json(cfg).dump(2) + "\n");
}

std::vector<std::string> config_keys() {
  RunConfig c;
  std::vector<std::string> keys;
  for (const auto& f : fields(c)) keys.push_back(f.key);
  return keys;
}

}  // namespace quads::rl
