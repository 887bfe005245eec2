#include "rl/compare.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <mutex>
#include <optional>
#include <thread>

#include "common/error.h"
#include "common/progress.h"
#include "rl/modes.h"
#include "rl/policy.h"
#include "rl/report.h"
#include "rl/sft.h"
#include "rl/task_source.h"
#include "analysis/layers.h"

namespace fs = std::filesystem;

namespace quads::rl {

namespace {

using ojson = nlohmann::ordered_json;

double mean_key(const std::vector<nlohmann::json>& rows, const char* kind, const char* key, bool last_only = false) {
  double s = 0;
  int64_t n = 0;
  for (const auto& r : rows) {
    if (r.value("kind", "") != kind || !r.contains(key) || !r[key].is_number()) continue;
    if (last_only) {
      s = r[key].get<double>();
      n = 1;
    } else {
      s += r[key].get<double>();
      ++n;
    }
  }
  return n ? s / n : std::nan("");
}

// Mean over seeds of extra per-run numbers that summary.json carries beside the required ones.
void add_extras(ojson& m, const std::vector<std::vector<nlohmann::json>>& runs) {
  auto avg = [&](const char* kind, const char* key, bool last_only) {
    double s = 0;
    int n = 0;
    for (const auto& rows : runs) {
      double v = mean_key(rows, kind, key, last_only);
      if (std::isfinite(v)) {
        s += v;
        ++n;
      }
    }
    return n ? s / n : std::nan("");
  };
  auto put = [&](const char* name, double v) {
    if (std::isfinite(v)) m[name] = v;
  };
  put("final_pass1_fp32", avg("eval", "pass1_fp32", true));
  put("gap_k3", avg("train", "gap_k3", false));
  put("gap_frac_above", avg("train", "gap_frac_above", false));
  put("routing_mismatch", avg("train", "routing_mismatch", false));
  put("act_qerr", avg("train", "act_qerr", false));
  put("reward_mean", avg("train", "reward_mean", false));
  put("t_rollout", avg("train", "t_rollout", false));
  put("t_train", avg("train", "t_train", false));
  put("t_sync", avg("train", "t_sync", false));
}

std::string observations(const ojson& summary, double margin) {
  const ojson& modes = summary.at("modes");
  std::string md = "\n## What this run shows\n\n";
  auto gap = [&](const char* mode, const char* key) {
    return modes.contains(mode) ? modes[mode].value(key, std::nan("")) : std::nan("");
  };
  for (const char* key : {"mean_abs_logp_gap", "max_abs_logp_gap"}) {
    const double n4 = gap("nvfp4", key), q = gap("quads", key);
    if (std::isfinite(n4) && std::isfinite(q) && n4 > 0)
      md += fmt::format("- {}: quads {:.4f} vs naive nvfp4 {:.4f} ({:+.0f}%).\n", key, q, n4, 100.0 * (q - n4) / n4);
  }
  for (const char* m : {"qat-only", "rac-only", "nvfp4-tis", "fp8", "bf16"}) {
    const double n4 = gap("nvfp4", "mean_abs_logp_gap"), v = gap(m, "mean_abs_logp_gap");
    if (std::isfinite(n4) && std::isfinite(v) && n4 > 0)
      md += fmt::format("- {}: mean |gap| {:.4f} ({:+.0f}% vs nvfp4).\n", m, v, 100.0 * (v - n4) / n4);
  }
  std::vector<std::string> collapsed;
  for (const auto& [name, m] : modes.items())
    if (m.value("collapsed_seeds", 0) > 0)
      collapsed.push_back(fmt::format("{} ({} of {} seeds)", name, m.value("collapsed_seeds", 0), summary.value("seeds", 1)));
  md += collapsed.empty()
            ? fmt::format("- No mode collapsed (final pass@1 never fell more than {} below its best).\n", margin)
            : fmt::format("- Collapsed (final pass@1 more than {} below its best): {}.\n", margin, fmt::join(collapsed, ", "));
  md += "- Differences of pass@1 smaller than the seed spread (the _std columns, or about 1/sqrt(eval_size)"
        " with one seed) are noise.\n";
  md += "\nExtra columns in summary.json: final_pass1_fp32 (the same weights evaluated in fp32), gap_k3 (k3 estimate"
        " of KL(rollout || trainer) per token), gap_frac_above (share of tokens with |gap| > 0.1), routing_mismatch"
        " (share of tokens whose top-k expert set differs between rollout and trainer, mean over layers),"
        " act_qerr (relative MSE of the rollout's quantized activations), t_rollout/t_train/t_sync (seconds per"
        " step).\n";
  md += "\n## Modes\n\n| mode | meaning |\n|---|---|\n";
  for (const auto& [name, m] : modes.items()) {
    (void)m;
    if (is_mode(name)) md += fmt::format("| {} | {} |\n", name, mode_spec(name).summary);
  }
  return md;
}

std::string read_file_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<std::string> analyze_base(const RunConfig& cfg, const std::string& base_dir, const std::string& out_dir) {
  const AnalysisSection& A = cfg.analysis;
  RunInputs in = load_run_inputs(cfg, base_dir);
  const int n = static_cast<int>(A.batches * A.batch_size);
  std::vector<std::vector<int32_t>> seqs = in.source->calibration(n);
  QUADS_CHECK(!seqs.empty(), "analysis: the task source gave no prompts");
  std::vector<model::Batch> batches;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (i % static_cast<size_t>(A.batch_size) == 0) batches.emplace_back();
    auto& s = seqs[i];
    if (static_cast<int64_t>(s.size()) > A.max_len) s.resize(static_cast<size_t>(A.max_len));
    batches.back().add(s);
  }
  analysis::LayersOptions lo;
  lo.topk = static_cast<int>(A.topk);
  lo.rac_ratio = cfg.quads.rac_ratio;
  auto report = analysis::analyze_layers(in.weights, batches, lo);
  report["model"] = in.base_dir;
  const nlohmann::json d = in.source->describe();
  report["data"] = d.contains("train") ? d["train"].value("path", "") : std::string("generated tasks (worked solutions)");
  return analysis::write_layers_report(report, out_dir + "/analysis");
}

std::string analysis_section(const std::string& out_dir) {
  const fs::path dir = fs::path(out_dir) / "analysis";
  if (!fs::exists(dir / "summary.txt")) return "";
  std::string md = "\n## Error analysis of the base model\n\n";
  md += "Where the NVFP4 rollout error comes from, per layer (docs/analysis.md; `analysis/layers.json` has "
        "every number):\n\n";
  const std::pair<const char*, const char*> plots[] = {
      {"layer_error.png", "relative output error per layer and variant"},
      {"w_vs_a.png", "the weights' share of the W4A4 error per layer"},
      {"logp_gap_entropy.png", "mean |log-prob gap| by the next token's entropy"}};
  for (const auto& [file, title] : plots)
    if (fs::exists(dir / file)) md += fmt::format("![{}](analysis/{})\n\n", title, file);
  md += "[summary.txt](analysis/summary.txt):\n\n```\n";
  std::string text = read_file_text((dir / "summary.txt").string());
  if (!text.empty() && text.back() != '\n') text += '\n';
  md += text + "```\n";
  return md;
}

std::string summary_table(const ojson& summary) {
  const size_t n = summary.value("seeds", size_t{1});
  auto cell = [&](const ojson& m, const char* key, int digits) {
    std::string s = fmt::format("{:.{}f}", m.value(key, std::nan("")), digits);
    const std::string k = std::string(key) + "_std";
    if (n > 1 && m.contains(k)) s += fmt::format("±{:.{}f}", m[k].get<double>(), digits);
    return s;
  };
  std::vector<std::vector<std::string>> t = {
      {"mode", "base", "final", "best", "mean|gap|", "max|gap|", "collapsed", "seconds"}};
  for (const auto& [mode, m] : summary.at("modes").items()) {
    const int c = m.value("collapsed_seeds", 0);
    t.push_back({mode, cell(m, "base_pass1", 3), cell(m, "final_pass1", 3), cell(m, "best_pass1", 3),
                 cell(m, "mean_abs_logp_gap", 4), cell(m, "max_abs_logp_gap", 3),
                 n > 1 ? fmt::format("{}/{}", c, n) : (c > 0 ? "yes" : "no"),
                 cell(m, "seconds", 0)});
  }
  std::vector<size_t> w(t[0].size(), 0);
  for (const auto& r : t)
    for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  std::string out;
  for (size_t j = 0; j < t.size(); ++j) {
    for (size_t i = 0; i < t[j].size(); ++i)
      out += i == 0 ? fmt::format("{:<{}}", t[j][i], w[i]) : fmt::format("  {:>{}}", t[j][i], w[i]);
    out += "\n";
    if (j == 0) {
      size_t total = 0;
      for (size_t x : w) total += x + 2;
      out += std::string(total - 2, '-') + "\n";
    }
  }
  return out;
}

CompareOutcome run_compare(const RunConfig& cfg, const CompareOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  QUADS_CHECK(!opt.out_dir.empty(), "compare: no output folder given");
  fs::create_directories(opt.out_dir);
  save_resolved_config(cfg, opt.out_dir);
  for (const auto& m : cfg.modes) (void)mode_spec(m);  // fail early on a mode without a ModeSpec

  std::string base_dir = opt.base_dir.empty() ? opt.out_dir + "/base" : opt.base_dir;
  SftResult sft;
  nlohmann::json data_info;
  if (cfg.uses_dataset()) {
    // Your own checkpoint is the base: no SFT. Load it and the data once to fail early.
    QUADS_CHECK(opt.base_dir.empty(), "compare: --base {} and data.model {} both name a base model; give one",
                opt.base_dir, cfg.data.model);
    base_dir = cfg.data.model;
    data_info = load_run_inputs(cfg, base_dir).source->describe();
    sft.cached = true;
    sft.pass1 = std::nan("");
  } else if (opt.base_dir.empty()) {
    sft = ensure_base(cfg, base_dir, opt.progress);
  } else {
    (void)load_base(base_dir);  // fail early on a folder that is not a base checkpoint
    sft.cached = true;
    const std::string meta = base_dir + "/sft.json";
    if (fs::exists(meta)) {
      std::ifstream f(meta);
      std::stringstream ss;
      ss << f.rdbuf();
      const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
      if (!j.is_discarded()) sft.pass1 = j.value("pass1_fp32", 0.0);
    }
  }
  if (cfg.analysis.enabled) {
    if (opt.progress) std::fprintf(stderr, "analysis of the base model into %s/analysis\n", opt.out_dir.c_str());
    (void)analyze_base(cfg, base_dir, opt.out_dir);
  }
  if (opt.progress && cfg.uses_dataset())
    std::fprintf(stderr, "base model %s (no SFT), data %s: %d training and %d evaluation prompts, %d bad line(s) and "
                 "%d long prompt(s) skipped\n",
                 base_dir.c_str(), cfg.data.train.c_str(), data_info.value("train_examples", 0),
                 data_info.value("eval_examples", 0), data_info.value("skipped_bad_lines", 0),
                 data_info.value("skipped_long_prompts", 0));
  else if (opt.progress)
    std::fprintf(stderr, "base model %s: pass@1 %.3f (fp32, greedy)%s\n", base_dir.c_str(), sft.pass1,
                 sft.cached ? ", reused" : fmt::format(", trained in {:.0f} s", sft.seconds).c_str());

  struct Job {
    std::string mode;
    int64_t seed;
    RunOutcome out;
  };
  std::vector<Job> jobs;
  for (const auto& m : cfg.modes)
    for (int64_t i = 0; i < cfg.rl.seeds; ++i) jobs.push_back({m, cfg.rl.seed + i, {}});

  // One progress bar over all RL steps of all runs.
  const int64_t total_steps = static_cast<int64_t>(jobs.size()) * cfg.rl.steps;
  std::mutex mu;
  int64_t steps_done = 0;
  std::optional<ProgressBar> bar;
  if (opt.progress) bar.emplace(total_steps, "rl runs");
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(jobs.size());
  // On the GPU the runs take turns: one device, and each run's engines hold their own GPU models.
  const int nworkers =
      cfg.rl.device == "cuda" || cfg.rl.trainer_device() == "cuda" ? 1 : std::max(1, std::min<int>(opt.jobs, static_cast<int>(jobs.size())));
  const int threads = std::max(1, omp_get_max_threads() / nworkers);
  auto worker = [&] {
    omp_set_num_threads(threads);
    for (size_t j; (j = next++) < jobs.size();) {
      Job& job = jobs[j];
      RunOptions ro;
      ro.mode = job.mode;
      ro.seed = job.seed;
      ro.base_dir = base_dir;
      ro.out_dir = fmt::format("{}/runs/{}-s{}", opt.out_dir, job.mode, job.seed);
      ro.resume = opt.resume;
      ro.progress = false;
      ro.on_row = [&](const nlohmann::json& row) {
        if (row.value("kind", "") != "train") return;
        std::lock_guard<std::mutex> lk(mu);
        ++steps_done;
        if (bar)
          bar->update(steps_done, {{"run", static_cast<double>(j + 1)},
                                   {"reward", row.value("reward_mean", 0.0)},
                                   {"gap", row.value("gap_mean_abs", 0.0)}});
      };
      try {
        job.out = run_rl(cfg, ro);
        std::lock_guard<std::mutex> lk(mu);
        if (opt.progress) {
          RunResult r = summarize_rows(job.out.rows, cfg.rl.collapse_margin);
          std::fprintf(stderr, "\r\x1b[K  %-10s seed %lld: pass@1 %.3f -> %.3f (best %.3f), mean|gap| %.4f, %.0f s\n",
                       job.mode.c_str(), static_cast<long long>(job.seed), r.base_pass1, r.final_pass1, r.best_pass1,
                       r.mean_abs_logp_gap, job.out.seconds);
        }
      } catch (...) {
        errors[j] = std::current_exception();
      }
    }
  };
  if (nworkers == 1) {
    worker();
  } else {
    std::vector<std::thread> pool;
    for (int i = 0; i < nworkers; ++i) pool.emplace_back(worker);
    for (auto& t : pool) t.join();
  }
  if (bar) bar->finish();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);

  // Everything into one log, the summary, the report and the plots.
  std::vector<nlohmann::json> all;
  std::vector<std::pair<std::string, std::vector<RunResult>>> per_mode;
  std::vector<std::vector<std::vector<nlohmann::json>>> rows_by_mode;
  for (const auto& m : cfg.modes) {
    per_mode.push_back({m, {}});
    rows_by_mode.push_back({});
    for (auto& job : jobs) {
      if (job.mode != m) continue;
      RunResult r = summarize_rows(job.out.rows, cfg.rl.collapse_margin);
      r.seconds = job.out.seconds;
      per_mode.back().second.push_back(r);
      rows_by_mode.back().push_back(job.out.rows);
      all.insert(all.end(), job.out.rows.begin(), job.out.rows.end());
    }
  }
  std::string jsonl;
  for (const auto& r : all) jsonl += r.dump() + "\n";
  write_text_atomic(opt.out_dir + "/metrics.jsonl", jsonl);
  write_csv(all, opt.out_dir + "/metrics.csv");

  ojson summary = make_summary(per_mode);
  for (size_t i = 0; i < per_mode.size(); ++i) add_extras(summary["modes"][per_mode[i].first], rows_by_mode[i]);
  if (cfg.uses_dataset())
    summary["base"] = {{"dir", base_dir}, {"sft", false}, {"data", data_info}};
  else
    summary["base"] = {{"dir", base_dir}, {"pass1_fp32", sft.pass1}, {"sft_seconds", sft.seconds}, {"reused", sft.cached}};
  CompareOutcome out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  summary["seconds_total"] = out.seconds;
  summary["device"] = jobs.empty() ? std::string("cpu") : jobs.front().out.device;
  summary["train_device"] = jobs.empty() ? std::string("cpu") : jobs.front().out.train_device;
  write_text_atomic(opt.out_dir + "/summary.json", summary.dump(2) + "\n");

  std::vector<PlotRef> plots;
  try {
    plots = plot_comparison(all, opt.out_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "warning: plots not drawn: %s\n", e.what());
  }
  std::string md = report_markdown(summary, to_toml(cfg), plots);
  // The comparison's max gap is the mean over steps of the per-step maximum (issue 4).
  const std::string wrong = "*max abs* is the largest |gap| seen.";
  if (auto p = md.find(wrong); p != std::string::npos)
    md.replace(p, wrong.size(), "*max abs* is the per-step maximum |gap|, averaged over RL steps.");
  md += observations(summary, cfg.rl.collapse_margin);
  if (cfg.uses_dataset()) {
    md += "\n## Model and data\n\n";
    md += fmt::format("- model: `{}` (the base of every run; no SFT)\n", base_dir);
    md += fmt::format("- train: `{}`, {} examples\n", cfg.data.train, data_info.value("train_examples", 0));
    md += fmt::format("- eval: {}, {} examples (greedy pass@1, rl::verify_math)\n",
                      cfg.data.eval.empty() ? "held out of train" : "`" + cfg.data.eval + "`",
                      data_info.value("eval_examples", 0));
    md += fmt::format("- prompt format: {}; stop ids {}\n", data_info.value("prompt_format", "?"),
                      data_info.contains("stop_ids") ? data_info["stop_ids"].dump() : "[]");
  }
  md += analysis_section(opt.out_dir);
  write_text_atomic(opt.out_dir + "/report.md", md);
  out.summary = std::move(summary);
  out.table = summary_table(out.summary);
  return out;
}

}  // namespace quads::rl
