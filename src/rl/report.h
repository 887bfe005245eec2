#pragma once
// Run outputs: the metrics log (JSONL, one object per line, flushed per line), its CSV export, the
// comparison's summary.json and report.md, and PNG plots drawn by gnuplot.
//
// Metrics rows (what the trainer writes; the summary and plots read these keys):
//   every row    "kind": "train" | "eval", "mode": str, "seed": int, "step": int,
//                "elapsed_s": seconds since the run started
//   train rows   "reward_mean", "loss", "clip_frac", "tis_weight_mean" and the rollout/trainer
//                log-prob gap of the sampled tokens (rl::Mismatch): "gap_mean_abs", "gap_max_abs",
//                "gap_k3", "gap_frac_above" (|gap| > 0.1); anything else is carried along
//   eval rows    "pass1" (on the held-out set) and "pass1_<family>"
// Step 0's eval row is the model before RL (the SFT model): base_pass1.
//
// Run folder of `quads compare` (suggested): metrics.jsonl, metrics.csv, summary.json, report.md,
// pass1.png, logp_gap.png, config.toml, config.json.
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace quads::rl {

// Writes `text` to `path` atomically: a temporary file in the same folder, then rename.
void write_text_atomic(const std::string& path, std::string_view text);

namespace metric {
inline constexpr const char* kKind = "kind";
inline constexpr const char* kMode = "mode";
inline constexpr const char* kSeed = "seed";
inline constexpr const char* kStep = "step";
inline constexpr const char* kElapsed = "elapsed_s";
inline constexpr const char* kPass1 = "pass1";
inline constexpr const char* kGapMeanAbs = "gap_mean_abs";
inline constexpr const char* kGapMaxAbs = "gap_max_abs";
inline constexpr const char* kGapK3 = "gap_k3";
inline constexpr const char* kGapFracAbove = "gap_frac_above";
inline constexpr const char* kRewardMean = "reward_mean";
}  // namespace metric

// Appends one JSON object per line and flushes it, so a crashed run keeps every finished step.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path, bool append = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& row);  // row must be an object
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// Reads a JSONL file (blank lines skipped); errors name the file and line.
std::vector<nlohmann::json> read_jsonl(const std::string& path);

// CSV of the rows: columns are kind, mode, seed, step, elapsed_s (those present), then the other
// keys in first-seen order (a row's keys come alphabetically: nlohmann::json sorts them; nested
// objects flatten to "a.b"). Missing values are empty, numbers in shortest round-trip form, strings
// quoted when needed.
std::string to_csv(const std::vector<nlohmann::json>& rows);
void write_csv(const std::vector<nlohmann::json>& rows, const std::string& path);

// ---- summary ---------------------------------------------------------------------------------
struct RunResult {
  double base_pass1 = 0;         // eval at the first evaluated step (step 0: before RL)
  double final_pass1 = 0;        // eval at the last evaluated step
  double best_pass1 = 0;         // max over evaluations, step 0 included
  double mean_abs_logp_gap = 0;  // mean over train steps of gap_mean_abs
  double max_abs_logp_gap = 0;   // mean over train steps of gap_max_abs (the per-step max)
  bool collapsed = false;        // final_pass1 < best_pass1 - collapse_margin
  double seconds = 0;            // largest elapsed_s of the run's rows
};

// One run (mode, seed) from metrics rows; throws if it has no eval row.
RunResult summarize_run(const std::vector<nlohmann::json>& rows, const std::string& mode, int64_t seed,
                        double collapse_margin);

struct MeanStd {
  double mean = 0, std = 0;  // std: sample standard deviation (divides by n-1); 0 for n == 1
};
MeanStd mean_std(std::span<const double> v);

// summary.json: {"seeds": n, "modes": {mode: {base_pass1, final_pass1, best_pass1,
// mean_abs_logp_gap, max_abs_logp_gap, collapsed, seconds, [*_std when n > 1], per_seed: [...]}}},
// modes in the given order. Every field is the mean over seeds; "collapsed" is the share of seeds
// that collapsed (0 or 1 with one seed). Every mode must have the same number of seeds.
nlohmann::ordered_json make_summary(const std::vector<std::pair<std::string, std::vector<RunResult>>>& per_mode);

struct PlotRef {
  std::string title, file;  // file relative to the report
};
// report.md: the table of the summary (mean ± std with several seeds), how to read it, the plots,
// and the resolved config (TOML).
std::string report_markdown(const nlohmann::ordered_json& summary, const std::string& config_toml,
                            const std::vector<PlotRef>& plots);

// ---- plots -----------------------------------------------------------------------------------
struct Series {
  std::string name;
  std::vector<double> x, y;  // points with a non-finite y are skipped
};
// The gnuplot PNG terminal that works here: "pngcairo", else "png", else "" (no gnuplot).
const std::string& gnuplot_terminal();
inline bool gnuplot_available() { return !gnuplot_terminal().empty(); }
// Draws one line per series into png_path (atomically); throws if gnuplot is missing or fails.
void plot_lines(const std::string& png_path, const std::string& title, const std::string& xlabel,
                const std::string& ylabel, const std::vector<Series>& series);
// One series per mode (in first-seen order) of rows with "kind" == kind: the mean of `key` over
// seeds at each step.
std::vector<Series> series_by_mode(const std::vector<nlohmann::json>& rows, std::string_view kind,
                                   std::string_view key);
// pass1.png (pass@1 vs step) and logp_gap.png (max |log-prob gap| vs step) in `dir`; returns what
// it drew (for report_markdown). Draws nothing and returns {} when gnuplot is missing.
std::vector<PlotRef> plot_comparison(const std::vector<nlohmann::json>& rows, const std::string& dir);

}  // namespace quads::rl
