#include "rl/report.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "common/error.h"

namespace quads::rl {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

void write_text_atomic(const std::string& path, std::string_view text) {
  std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  QUADS_CHECK(f, "cannot write {}: {}", tmp, std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = std::fflush(f) == 0 && ok;
  ok = ::fsync(::fileno(f)) == 0 && ok;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    fail("cannot write {}: {}", path, std::strerror(err));
  }
}

// ---- JSONL / CSV -------------------------------------------------------------------------------
MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  f_ = std::fopen(path.c_str(), append ? "ab" : "wb");
  QUADS_CHECK(f_, "cannot open metrics file {}: {}", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::write(const json& row) {
  QUADS_CHECK(row.is_object(), "metrics file {}: a row must be a JSON object", path_);
  std::string line = row.dump() + "\n";
  bool ok = std::fwrite(line.data(), 1, line.size(), f_) == line.size() && std::fflush(f_) == 0;
  QUADS_CHECK(ok, "cannot write metrics file {}: {}", path_, std::strerror(errno));
}

std::vector<json> read_jsonl(const std::string& path) {
  std::ifstream f(path);
  QUADS_CHECK(f.good(), "cannot open {}", path);
  std::vector<json> rows;
  std::string line;
  for (int lineno = 1; std::getline(f, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    QUADS_CHECK(!j.is_discarded(), "{}:{}: not valid JSON", path, lineno);
    rows.push_back(std::move(j));
  }
  return rows;
}

namespace {

void flatten(const json& j, const std::string& prefix, std::vector<std::pair<std::string, const json*>>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object()) flatten(*it, key, out);
    else out.emplace_back(key, &*it);
  }
}

std::string csv_quote(const std::string& s) {
  bool need = s.find_first_of(",\"\n\r") != std::string::npos || (!s.empty() && (s.front() == ' ' || s.back() == ' '));
  if (!need) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string csv_cell(const json& v) {
  if (v.is_null()) return "";
  if (v.is_number_float()) {
    double d = v.get<double>();
    return std::isfinite(d) ? fmt::format("{}", d) : "";
  }
  if (v.is_number_unsigned()) return std::to_string(v.get<uint64_t>());
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_string()) return csv_quote(v.get<std::string>());
  return csv_quote(v.dump());
}

}  // namespace

std::string to_csv(const std::vector<json>& rows) {
  std::vector<std::string> columns;
  std::map<std::string, size_t> col_index;
  std::vector<std::vector<std::pair<std::string, const json*>>> flat(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    QUADS_CHECK(rows[r].is_object(), "to_csv: row {} is not a JSON object", r);
    flatten(rows[r], "", flat[r]);
  }
  // The identifying columns lead; the rest follow in first-seen order.
  for (const char* lead : {metric::kKind, metric::kMode, metric::kSeed, metric::kStep, metric::kElapsed})
    for (const auto& fr : flat)
      if (std::any_of(fr.begin(), fr.end(), [&](const auto& kv) { return kv.first == lead; })) {
        col_index.emplace(lead, columns.size());
        columns.push_back(lead);
        break;
      }
  for (const auto& fr : flat)
    for (const auto& [k, v] : fr)
      if (col_index.emplace(k, columns.size()).second) columns.push_back(k);
  std::string out;
  for (size_t c = 0; c < columns.size(); ++c) out += (c ? "," : "") + csv_quote(columns[c]);
  out += "\n";
  for (const auto& fr : flat) {
    std::vector<std::string> cells(columns.size());
    for (const auto& [k, v] : fr) cells[col_index[k]] = csv_cell(*v);
    for (size_t c = 0; c < cells.size(); ++c) out += (c ? "," : "") + cells[c];
    out += "\n";
  }
  return out;
}

void write_csv(const std::vector<json>& rows, const std::string& path) { write_text_atomic(path, to_csv(rows)); }

// ---- summary -----------------------------------------------------------------------------------
namespace {

bool row_matches(const json& r, std::string_view kind, const std::string& mode, int64_t seed) {
  return r.is_object() && r.value(metric::kKind, "") == kind && r.value(metric::kMode, "") == mode &&
         r.contains(metric::kSeed) && r[metric::kSeed].is_number_integer() && r[metric::kSeed].get<int64_t>() == seed;
}

// A finite number under `key`, or false.
bool get_number(const json& r, const char* key, double* out) {
  auto it = r.find(key);
  if (it == r.end() || !it->is_number()) return false;
  *out = it->get<double>();
  return std::isfinite(*out);
}

}  // namespace

RunResult summarize_run(const std::vector<json>& rows, const std::string& mode, int64_t seed, double collapse_margin) {
  std::vector<std::pair<int64_t, double>> evals;
  RunResult res;
  double gap_sum = 0, gap_max_sum = 0;
  int64_t gap_n = 0, gap_max_n = 0;
  for (const auto& r : rows) {
    double v;
    if (r.is_object() && r.value(metric::kMode, "") == mode && r.contains(metric::kSeed) &&
        r[metric::kSeed].is_number_integer() && r[metric::kSeed].get<int64_t>() == seed &&
        get_number(r, metric::kElapsed, &v))
      res.seconds = std::max(res.seconds, v);
    if (row_matches(r, "eval", mode, seed) && get_number(r, metric::kPass1, &v))
      evals.emplace_back(r.value(metric::kStep, int64_t{0}), v);
    if (row_matches(r, "train", mode, seed)) {
      if (get_number(r, metric::kGapMeanAbs, &v)) gap_sum += v, ++gap_n;
      if (get_number(r, metric::kGapMaxAbs, &v)) gap_max_sum += v, ++gap_max_n;
    }
  }
  QUADS_CHECK(!evals.empty(), "metrics: mode {} seed {} has no eval row with a pass1 value", mode, seed);
  std::stable_sort(evals.begin(), evals.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  res.base_pass1 = evals.front().second;
  res.final_pass1 = evals.back().second;
  res.best_pass1 = evals.front().second;
  for (const auto& e : evals) res.best_pass1 = std::max(res.best_pass1, e.second);
  res.mean_abs_logp_gap = gap_n ? gap_sum / static_cast<double>(gap_n) : 0;
  res.max_abs_logp_gap = gap_max_n ? gap_max_sum / static_cast<double>(gap_max_n) : 0;
  res.collapsed = res.final_pass1 < res.best_pass1 - collapse_margin;
  return res;
}

MeanStd mean_std(std::span<const double> v) {
  MeanStd r;
  if (v.empty()) return r;
  double s = 0;
  for (double x : v) s += x;
  r.mean = s / static_cast<double>(v.size());
  if (v.size() > 1) {
    double ss = 0;
    for (double x : v) ss += (x - r.mean) * (x - r.mean);
    r.std = std::sqrt(ss / static_cast<double>(v.size() - 1));
  }
  return r;
}

namespace {

struct SummaryField {
  const char* name;
  double (*get)(const RunResult&);
};
const SummaryField kSummaryFields[] = {
    {"base_pass1", [](const RunResult& r) { return r.base_pass1; }},
    {"final_pass1", [](const RunResult& r) { return r.final_pass1; }},
    {"best_pass1", [](const RunResult& r) { return r.best_pass1; }},
    {"mean_abs_logp_gap", [](const RunResult& r) { return r.mean_abs_logp_gap; }},
    {"max_abs_logp_gap", [](const RunResult& r) { return r.max_abs_logp_gap; }},
    {"seconds", [](const RunResult& r) { return r.seconds; }},
};

}  // namespace

ojson make_summary(const std::vector<std::pair<std::string, std::vector<RunResult>>>& per_mode) {
  ojson s = ojson::object();
  size_t n = per_mode.empty() ? 0 : per_mode.front().second.size();
  s["seeds"] = n;
  s["modes"] = ojson::object();
  for (const auto& [mode, runs] : per_mode) {
    QUADS_CHECK(!runs.empty(), "summary: mode {} has no run", mode);
    QUADS_CHECK(runs.size() == n, "summary: mode {} has {} seeds, the first mode has {}", mode, runs.size(), n);
    ojson m = ojson::object();
    for (const auto& f : kSummaryFields) {
      std::vector<double> v;
      for (const auto& r : runs) v.push_back(f.get(r));
      MeanStd ms = mean_std(v);
      m[f.name] = ms.mean;
      if (n > 1) m[std::string(f.name) + "_std"] = ms.std;
    }
    // A flag, not a mean: true when any seed collapsed; collapsed_seeds says how many did.
    int ncollapsed = 0;
    for (const auto& r : runs) ncollapsed += r.collapsed ? 1 : 0;
    m["collapsed"] = ncollapsed > 0;
    m["collapsed_seeds"] = ncollapsed;
    ojson seeds = ojson::array();
    for (const auto& r : runs) {
      ojson one = ojson::object();
      for (const auto& f : kSummaryFields) one[f.name] = f.get(r);
      one["collapsed"] = r.collapsed;
      seeds.push_back(one);
    }
    m["per_seed"] = seeds;
    s["modes"][mode] = m;
  }
  return s;
}

std::string report_markdown(const ojson& summary, const std::string& config_toml, const std::vector<PlotRef>& plots) {
  size_t n = summary.value("seeds", size_t{1});
  auto cell = [&](const ojson& m, const char* key, int digits) {
    double v = m.value(key, std::nan(""));
    std::string s = fmt::format("{:.{}f}", v, digits);
    std::string k = std::string(key) + "_std";
    if (n > 1 && m.contains(k)) s += fmt::format(" ± {:.{}f}", m[k].get<double>(), digits);
    return s;
  };
  std::string md = "# quads comparison\n\n";
  md += fmt::format("{} seed{} per mode{}.\n\n", n, n == 1 ? "" : "s", n > 1 ? "; cells are mean ± std over seeds" : "");
  if (summary.contains("device"))
    md += fmt::format("Rollouts and evaluation ran on: {} (the static-RAC calibration too); the trainer's forward, "
                      "backward and AdamW on: {}.\n\n",
                      summary["device"].get<std::string>(), summary.value("train_device", std::string("cpu")));
  md += "| mode | base pass@1 | final pass@1 | best pass@1 | mean abs logp gap | max abs logp gap | collapsed | seconds |\n";
  md += "|---|---|---|---|---|---|---|---|\n";
  for (const auto& [mode, m] : summary.at("modes").items()) {
    const int c = m.value("collapsed_seeds", 0);
    std::string collapsed = n > 1 ? fmt::format("{}/{}", c, n) : (c > 0 ? "yes" : "no");
    md += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |\n", mode, cell(m, "base_pass1", 3), cell(m, "final_pass1", 3),
                      cell(m, "best_pass1", 3), cell(m, "mean_abs_logp_gap", 4), cell(m, "max_abs_logp_gap", 3), collapsed,
                      cell(m, "seconds", 0));
  }
  md += R"(
## How to read this
- **pass@1** is the share of the held-out evaluation set answered correctly (reward 1: the response
  ends with `=> ANSWER` and the end token). *base* is the model before RL (the SFT model, step 0),
  *final* the last evaluation, *best* the highest one, step 0 included.
- **logp gap** is, for each sampled token, log p(trainer) - log p(rollout): how differently the
  rollout engine (BF16, FP8 or NVFP4 numerics) and the trainer score what the rollout sampled.
  *mean abs* averages the per-step mean |gap| over RL steps, *max abs* the per-step maximum |gap|.
  With exact agreement both are 0; a large gap makes the policy gradient off-policy.
- **collapsed** marks a run whose final pass@1 fell more than `rl.collapse_margin` below its best.
- **seconds** is the wall time of the run (SFT excluded when it is shared).
- A good low-precision mode has final pass@1 close to bf16's, a small gap, and does not collapse.
)";
  if (!plots.empty()) {
    md += "\n## Plots\n";
    for (const auto& p : plots) md += fmt::format("\n### {}\n![{}]({})\n", p.title, p.title, p.file);
  }
  md += "\n## Configuration\n```toml\n" + config_toml + (config_toml.empty() || config_toml.back() == '\n' ? "" : "\n") + "```\n";
  return md;
}

// ---- plots -------------------------------------------------------------------------------------
namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string gp_quote(const std::string& s) {  // gnuplot single-quoted string
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

std::string detect_terminal() {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) return "";
  for (const char* t : {"pngcairo", "png"})
    if (std::system(fmt::format("gnuplot -e 'set terminal {}' >/dev/null 2>&1", t).c_str()) == 0) return t;
  return "";
}

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

const std::string& gnuplot_terminal() {
  static const std::string t = detect_terminal();
  return t;
}

void plot_lines(const std::string& png_path, const std::string& title, const std::string& xlabel,
                const std::string& ylabel, const std::vector<Series>& series) {
  const std::string& term = gnuplot_terminal();
  QUADS_CHECK(!term.empty(), "cannot draw {}: gnuplot with a png or pngcairo terminal is not installed", png_path);
  std::string tmp_png = fmt::format("{}.tmp.{}.png", png_path, ::getpid());
  std::string script_path = fmt::format("{}.tmp.{}.gp", png_path, ::getpid());
  std::string err_path = fmt::format("{}.tmp.{}.err", png_path, ::getpid());

  std::string gp = fmt::format("set terminal {} size 900,540 noenhanced\nset output {}\n", term, gp_quote(tmp_png));
  gp += fmt::format("set title {}\nset xlabel {}\nset ylabel {}\nset grid\nset key outside right top\n", gp_quote(title),
                    gp_quote(xlabel), gp_quote(ylabel));
  std::vector<std::string> plots;
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    QUADS_CHECK(s.x.size() == s.y.size(), "plot {}: series {} has {} x and {} y values", png_path, s.name, s.x.size(),
                s.y.size());
    std::string block;
    for (size_t k = 0; k < s.x.size(); ++k)
      if (std::isfinite(s.x[k]) && std::isfinite(s.y[k])) block += fmt::format("{} {}\n", s.x[k], s.y[k]);
    if (block.empty()) continue;
    gp += fmt::format("$d{} << EOD\n{}EOD\n", i, block);
    plots.push_back(fmt::format("$d{} using 1:2 with linespoints lw 2 pt 7 ps 0.6 title {}", i, gp_quote(s.name)));
  }
  QUADS_CHECK(!plots.empty(), "plot {}: no finite point to draw", png_path);
  gp += fmt::format("plot {}\nunset output\n", fmt::join(plots, ", \\\n     "));
  write_text_atomic(script_path, gp);

  int rc = std::system(fmt::format("gnuplot {} 2>{}", shell_quote(script_path), shell_quote(err_path)).c_str());
  std::string err = read_all(err_path);
  std::remove(script_path.c_str());
  std::remove(err_path.c_str());
  std::error_code ec;
  bool made = rc == 0 && std::filesystem::exists(tmp_png, ec) && std::filesystem::file_size(tmp_png, ec) > 0;
  if (!made || std::rename(tmp_png.c_str(), png_path.c_str()) != 0) {
    std::remove(tmp_png.c_str());
    fail("gnuplot failed to draw {} (exit {}): {}", png_path, rc, err);
  }
}

std::vector<Series> series_by_mode(const std::vector<json>& rows, std::string_view kind, std::string_view key) {
  std::vector<std::string> modes;
  std::map<std::string, std::map<int64_t, std::pair<double, int>>> acc;  // mode -> step -> (sum, count)
  std::string k(key);
  for (const auto& r : rows) {
    if (!r.is_object() || r.value(metric::kKind, "") != kind) continue;
    double v;
    if (!get_number(r, k.c_str(), &v) || !r.contains(metric::kStep) || !r[metric::kStep].is_number_integer()) continue;
    std::string mode = r.value(metric::kMode, "");
    if (!acc.count(mode)) modes.push_back(mode);
    auto& cell = acc[mode][r[metric::kStep].get<int64_t>()];
    cell.first += v;
    cell.second += 1;
  }
  std::vector<Series> out;
  for (const auto& m : modes) {
    Series s;
    s.name = m;
    for (const auto& [step, sc] : acc[m]) {
      s.x.push_back(static_cast<double>(step));
      s.y.push_back(sc.first / sc.second);
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<PlotRef> plot_comparison(const std::vector<json>& rows, const std::string& dir) {
  std::vector<PlotRef> made;
  if (!gnuplot_available()) return made;
  struct Spec {
    const char* file;
    const char* title;
    const char* kind;
    const char* key;
    const char* ylabel;
  };
  const Spec specs[] = {
      {"pass1.png", "pass@1 on the held-out set", "eval", metric::kPass1, "pass@1"},
      {"logp_gap.png", "max |log-prob gap| (trainer - rollout) of sampled tokens", "train", metric::kGapMaxAbs,
       "max |logp gap|"},
  };
  for (const auto& s : specs) {
    std::vector<Series> series = series_by_mode(rows, s.kind, s.key);
    if (series.empty()) continue;
    plot_lines(dir + "/" + s.file, s.title, "RL step", s.ylabel, series);
    made.push_back({s.title, s.file});
  }
  return made;
}

}  // namespace quads::rl
