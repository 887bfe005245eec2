#pragma once
// The comparison experiment (`quads compare`): one base model (SFT, cached in DIR/base), then for
// every mode of cfg.modes and every seed rl.seed .. rl.seed + rl.seeds - 1 one GRPO run
// (rl/run.h) in DIR/runs/<mode>-s<seed>/, all from the same base checkpoint with the same seeds.
// Writes DIR/metrics.jsonl + metrics.csv (every row of every run), DIR/summary.json (per mode, the
// mean over seeds and a _std twin with several seeds), DIR/report.md and the plots pass1.png and
// logp_gap.png, and returns the table it prints.
//
// With [data] model set (your own checkpoint and JSONL data) there is no SFT: that folder is the
// base of every run. With analysis.enabled (quads compare --analyze) the per-layer NVFP4 error
// analysis of the base model (analysis/layers.h) runs first on the runs' own prompts (the
// dataset's training prompts, or the generated tasks' worked solutions) into DIR/analysis;
// report.md links its plots and embeds its summary.txt whenever DIR/analysis has one (also when
// `quads analyze layers --out DIR/analysis` made it separately).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rl/config.h"
#include "rl/run.h"

namespace quads::rl {

struct CompareOptions {
  std::string out_dir;
  std::string base_dir;   // an existing base checkpoint; empty: train or reuse out_dir/base
  bool resume = false;    // continue runs from their checkpoints
  bool progress = true;
  int jobs = 1;           // runs in flight at once (results do not depend on it)
};

// Runs the layer analysis of cfg's base model (base_dir, or cfg.data.model) into out_dir/analysis
// with cfg.analysis's sizes; returns the files written (relative to out_dir/analysis).
std::vector<std::string> analyze_base(const RunConfig& cfg, const std::string& base_dir, const std::string& out_dir);

// The report.md section about DIR/analysis (empty when DIR/analysis/summary.txt does not exist).
std::string analysis_section(const std::string& out_dir);

struct CompareOutcome {
  nlohmann::ordered_json summary;
  std::string table;      // plain-text table of the summary
  double seconds = 0;
};

CompareOutcome run_compare(const RunConfig& cfg, const CompareOptions& opt);

// A fixed-width text table of a summary.json object (what `quads compare` prints at the end).
std::string summary_table(const nlohmann::ordered_json& summary);

}  // namespace quads::rl
