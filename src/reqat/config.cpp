#include "reqat/config.h"

#include <fstream>
#include <sstream>
#include <variant>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "common/error.h"
#include "reqat/kv_quant.h"

namespace quads::reqat {

namespace {

using Ptr = std::variant<int64_t*, double*, bool*, std::string*, std::vector<std::string>*, std::vector<int64_t>*>;
struct Field {
  std::string key;
  Ptr ptr;
};

// Every key, bound to cfg, in file order.
std::vector<Field> fields(ReqatConfig& c) {
  std::vector<Field> f = {{"variants", &c.variants}, {"kv_format", &c.kv_format}, {"seed", &c.seed},
                          {"train_device", &c.train_device}};
  auto add = [&](const std::string& k, Ptr p) { f.push_back({k, p}); };
  add("model.hidden", &c.model.hidden);
  add("model.layers", &c.model.layers);
  add("model.heads", &c.model.heads);
  add("model.kv_heads", &c.model.kv_heads);
  add("model.head_dim", &c.model.head_dim);
  add("model.experts", &c.model.experts);
  add("model.experts_per_token", &c.model.experts_per_token);
  add("model.moe_intermediate", &c.model.moe_intermediate);
  add("model.max_seq_len", &c.model.max_seq_len);
  add("model.rope_theta", &c.model.rope_theta);
  add("model.rms_eps", &c.model.rms_eps);
  add("model.init_std", &c.model.init_std);
  add("base.dir", &c.base.dir);
  add("base.steps", &c.base.steps);
  add("base.lr", &c.base.lr);
  add("base.batch", &c.base.batch);
  add("base.warmup", &c.base.warmup);
  add("traces.source", &c.traces.source);
  add("traces.prompts", &c.traces.prompts);
  for (auto [name, st] : {std::pair<const char*, StageSection*>{"stage1", &c.stage1}, {"stage2", &c.stage2}}) {
    add(std::string(name) + ".steps", &st->steps);
    add(std::string(name) + ".lr", &st->lr);
    add(std::string(name) + ".batch", &st->batch);
    add(std::string(name) + ".warmup", &st->warmup);
  }
  add("sem.lambda", &c.sem.lambda);
  add("sem.percentile", &c.sem.percentile);
  add("sem.eps", &c.sem.eps);
  add("qfit.calib_sequences", &c.qfit.calib_sequences);
  add("qfit.grid", &c.qfit.grid);
  add("eval.size", &c.eval.size);
  add("eval.max_new_tokens", &c.eval.max_new_tokens);
  add("eval.low_entropy", &c.eval.low_entropy);
  add("eval.device", &c.eval.device);
  add("tasks.families", &c.tasks.families);
  add("tasks.add_digits", &c.tasks.add_digits);
  add("tasks.mul_digits", &c.tasks.mul_digits);
  add("tasks.countdown_numbers", &c.tasks.countdown_numbers);
  add("tasks.sort_length", &c.tasks.sort_length);
  add("tasks.seed", &c.tasks.seed);
  return f;
}

std::string where(const toml::node& n, const std::string& origin) {
  const auto& s = n.source();
  return s.begin.line ? fmt::format("{}:{}", origin, s.begin.line) : origin;
}

void set_field(const Field& f, const toml::node& n, const std::string& at) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          auto v = n.value_exact<int64_t>();
          QUADS_CHECK(v.has_value(), "{}: '{}' must be an integer", at, f.key);
          *p = *v;
        } else if constexpr (std::is_same_v<T, double>) {
          auto v = n.value<double>();  // integers are accepted for floats
          QUADS_CHECK(v.has_value() && (n.is_floating_point() || n.is_integer()), "{}: '{}' must be a number", at,
                      f.key);
          *p = *v;
        } else if constexpr (std::is_same_v<T, bool>) {
          auto v = n.value_exact<bool>();
          QUADS_CHECK(v.has_value(), "{}: '{}' must be true or false", at, f.key);
          *p = *v;
        } else if constexpr (std::is_same_v<T, std::string>) {
          auto v = n.value_exact<std::string>();
          QUADS_CHECK(v.has_value(), "{}: '{}' must be a string", at, f.key);
          *p = *v;
        } else {
          const toml::array* a = n.as_array();
          QUADS_CHECK(a, "{}: '{}' must be an array", at, f.key);
          p->clear();
          for (const toml::node& e : *a) {
            using E = typename T::value_type;
            if constexpr (std::is_same_v<E, std::string>) {
              auto v = e.value_exact<std::string>();
              QUADS_CHECK(v.has_value(), "{}: '{}' must be an array of strings", at, f.key);
              p->push_back(*v);
            } else {
              auto v = e.value_exact<int64_t>();
              QUADS_CHECK(v.has_value(), "{}: '{}' must be an array of integers", at, f.key);
              p->push_back(*v);
            }
          }
        }
      },
      f.ptr);
}

void walk(const toml::table& t, const std::string& prefix, ReqatConfig& cfg, const std::string& origin) {
  std::vector<Field> fs = fields(cfg);
  for (auto&& [k, node] : t) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = node.as_table()) {
      walk(*sub, key, cfg, origin);
      continue;
    }
    const Field* f = nullptr;
    for (const Field& x : fs)
      if (x.key == key) f = &x;
    QUADS_CHECK(f, "{}: unknown key '{}'", where(node, origin), key);
    set_field(*f, node, where(node, origin));
  }
}

std::string toml_value(const Ptr& p) {
  return std::visit(
      [](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) return std::to_string(*v);
        else if constexpr (std::is_same_v<T, double>) {
          std::string s = fmt::format("{}", *v);
          if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
          return s;
        } else if constexpr (std::is_same_v<T, bool>) return *v ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::string>) {
          std::ostringstream os;
          os << toml::value<std::string>(*v);
          return os.str();
        } else {
          std::string s = "[";
          for (size_t i = 0; i < v->size(); ++i) {
            if (i) s += ", ";
            if constexpr (std::is_same_v<typename T::value_type, std::string>) {
              std::ostringstream os;
              os << toml::value<std::string>((*v)[i]);
              s += os.str();
            } else {
              s += std::to_string((*v)[i]);
            }
          }
          return s + "]";
        }
      },
      p);
}

}  // namespace

ReqatConfig parse_reqat_config(std::string_view text, const std::string& origin, const ReqatConfig& base) {
  ReqatConfig cfg = base;
  toml::table t;
  try {
    t = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    fail("{}:{}: {}", origin, e.source().begin.line, e.description());
  }
  walk(t, "", cfg, origin);
  return cfg;
}

void apply_reqat_override(ReqatConfig& cfg, std::string_view assignment) {
  const size_t eq = assignment.find('=');
  QUADS_CHECK(eq != std::string_view::npos && eq > 0, "--set '{}': expected key=value", assignment);
  const std::string key(assignment.substr(0, eq));
  std::string value(assignment.substr(eq + 1));
  std::vector<Field> fs = fields(cfg);
  const Field* f = nullptr;
  for (const Field& x : fs)
    if (x.key == key) f = &x;
  QUADS_CHECK(f, "--set: unknown key '{}'", key);
  // Bare words for strings, bare comma lists for arrays.
  if (std::holds_alternative<std::string*>(f->ptr) && (value.empty() || value[0] != '"')) {
    *std::get<std::string*>(f->ptr) = value;
    return;
  }
  if ((std::holds_alternative<std::vector<std::string>*>(f->ptr) ||
       std::holds_alternative<std::vector<int64_t>*>(f->ptr)) &&
      (value.empty() || value[0] != '[')) {
    if (std::holds_alternative<std::vector<std::string>*>(f->ptr)) {
      std::string q = "[";
      std::stringstream ss(value);
      std::string item;
      bool first = true;
      while (std::getline(ss, item, ',')) {
        q += (first ? "\"" : ", \"") + item + "\"";
        first = false;
      }
      value = q + "]";
    } else {
      value = "[" + value + "]";
    }
  }
  toml::table t;
  try {
    t = toml::parse("v = " + value, "--set " + key);
  } catch (const toml::parse_error& e) {
    fail("--set {}: cannot read '{}': {}", key, value, e.description());
  }
  set_field(*f, *t.get("v"), "--set");
}

void validate(const ReqatConfig& c, const std::string& origin) {
  QUADS_CHECK(!c.variants.empty(), "{}: 'variants' is empty", origin);
  for (const std::string& v : c.variants) {
    bool ok = false;
    for (const std::string& k : known_variants()) ok = ok || k == v;
    QUADS_CHECK(ok, "{}: unknown variant '{}' in 'variants' (plain_qat | taq | taq_sem | reqat)", origin, v);
  }
  QUADS_CHECK(c.kv_format == "e1m2" || c.kv_format == "e2m1", "{}: 'kv_format' must be e1m2 or e2m1, not '{}'", origin,
              c.kv_format);
  QUADS_CHECK(c.model.head_dim % 16 == 0, "{}: 'model.head_dim' = {} must be a multiple of 16 (KV-cache blocks)",
              origin, c.model.head_dim);
  QUADS_CHECK(c.traces.source == "greedy" || c.traces.source == "solutions",
              "{}: 'traces.source' must be greedy or solutions, not '{}'", origin, c.traces.source);
  QUADS_CHECK(c.traces.prompts > 0, "{}: 'traces.prompts' must be positive", origin);
  for (auto [name, st] : {std::pair<const char*, const StageSection*>{"base", nullptr}, {"stage1", &c.stage1},
                          {"stage2", &c.stage2}}) {
    if (!st) continue;
    QUADS_CHECK(st->steps >= 0 && st->batch > 0 && st->lr > 0 && st->warmup >= 0,
                "{}: [{}] needs steps >= 0, batch > 0, lr > 0, warmup >= 0", origin, name);
  }
  QUADS_CHECK(c.base.steps >= 0 && c.base.batch > 0 && c.base.lr > 0, "{}: [base] needs steps >= 0, batch > 0, lr > 0",
              origin);
  QUADS_CHECK(c.sem.lambda >= 0, "{}: 'sem.lambda' must be >= 0", origin);
  QUADS_CHECK(c.sem.percentile > 0 && c.sem.percentile <= 1, "{}: 'sem.percentile' must be in (0, 1]", origin);
  QUADS_CHECK(c.sem.eps > 0, "{}: 'sem.eps' must be > 0", origin);
  QUADS_CHECK(c.qfit.calib_sequences > 0, "{}: 'qfit.calib_sequences' must be positive", origin);
  QUADS_CHECK(c.qfit.grid >= 1 && c.qfit.grid <= 100, "{}: 'qfit.grid' must be in 1..100", origin);
  QUADS_CHECK(c.eval.size > 0 && c.eval.max_new_tokens > 0, "{}: [eval] size and max_new_tokens must be positive",
              origin);
  QUADS_CHECK(c.eval.device == "cpu" || c.eval.device == "cuda", "{}: 'eval.device' is \"{}\" (cpu | cuda)", origin,
              c.eval.device);
  QUADS_CHECK(c.train_device == "cpu" || c.train_device == "cuda", "{}: 'train_device' is \"{}\" (cpu | cuda)", origin,
              c.train_device);
  // The task and model keys are checked by the RL config's validator.
  rl::RunConfig rc;
  rc.model = c.model;
  rc.tasks = c.tasks;
  rl::validate(rc, origin);
}

ReqatConfig load_reqat_config(const std::string& path, const std::vector<std::string>& overrides) {
  ReqatConfig cfg;
  std::string origin = "built-in default";
  if (!path.empty()) {
    std::ifstream in(path);
    QUADS_CHECK(in.good(), "cannot read config file '{}'", path);
    std::stringstream ss;
    ss << in.rdbuf();
    cfg = parse_reqat_config(ss.str(), path);
    origin = path;
  }
  for (const std::string& o : overrides) apply_reqat_override(cfg, o);
  validate(cfg, origin);
  return cfg;
}

std::string to_toml(const ReqatConfig& c0) {
  ReqatConfig c = c0;
  std::string out, section;
  for (const Field& f : fields(c)) {
    const size_t dot = f.key.find('.');
    const std::string sec = dot == std::string::npos ? "" : f.key.substr(0, dot);
    const std::string name = dot == std::string::npos ? f.key : f.key.substr(dot + 1);
    if (sec != section) {
      out += "\n[" + sec + "]\n";
      section = sec;
    }
    out += name + " = " + toml_value(f.ptr) + "\n";
  }
  return out;
}

nlohmann::json to_json(const ReqatConfig& c0) {
  ReqatConfig c = c0;
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : fields(c)) {
    nlohmann::json* dst = &j;
    std::string key = f.key;
    const size_t dot = key.find('.');
    if (dot != std::string::npos) {
      dst = &j[key.substr(0, dot)];
      key = key.substr(dot + 1);
    }
    std::visit([&](auto* p) { (*dst)[key] = *p; }, f.ptr);
  }
  return j;
}

bool operator==(const ReqatConfig& a, const ReqatConfig& b) { return to_json(a) == to_json(b); }

}  // namespace quads::reqat
