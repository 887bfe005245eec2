#include "reqat/pipeline.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "common/error.h"
#include "reqat/kv_quant.h"
#include "reqat/tokens.h"
#include "reqat/trainer.h"
#include "train/backend.h"
#include "rl/report.h"
#include "rl/sft.h"

namespace quads::reqat {

namespace fs = std::filesystem;

namespace {

// Task indices of the training stream used for the traces and for plain QAT's data: far from the
// base model's range [0, base.steps * base.batch), and from each other.
constexpr uint64_t kTraceFirst = uint64_t(1) << 24;
constexpr uint64_t kPlainFirst = uint64_t(1) << 25;

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::vector<rl::SftExample> solutions(const std::vector<rl::Task>& tasks, const rl::CharTokenizer& tok) {
  std::vector<rl::SftExample> v;
  v.reserve(tasks.size());
  for (const rl::Task& t : tasks) v.push_back(rl::make_sft_example(t, tok));
  return v;
}

TrainSpec stage_spec(const StageSection& s, const std::string& label, bool progress, const std::string& device) {
  TrainSpec t;
  t.device = device;
  t.steps = s.steps;
  t.batch = s.batch;
  t.lr = s.lr;
  t.warmup = s.warmup;
  t.label = label;
  t.progress = progress;
  return t;
}

struct Row {
  std::string name, what;
  double fp = NAN, w4a4 = NAN, w4a4kv4 = NAN;
  rl::EvalScore kv4_score;
};

nlohmann::ordered_json score_json(const rl::EvalScore& s) {
  nlohmann::ordered_json j;
  j["pass1"] = s.pass1;
  for (int f = 0; f < rl::kNumFamilies; ++f)
    if (s.family_count[f] > 0) j[rl::family_name(static_cast<rl::Family>(f))] = s.family_pass1[f];
  return j;
}

}  // namespace

nlohmann::ordered_json run_reqat(const ReqatConfig& cfg, const std::string& out, const RunOptions& opt) {
  const Clock::time_point t0 = Clock::now();
  fs::create_directories(out);
  const std::string config_toml = to_toml(cfg);
  rl::write_text_atomic(out + "/config.toml", config_toml);
  rl::write_text_atomic(out + "/config.json", to_json(cfg).dump(2) + "\n");
  auto say = [&](const std::string& s) {
    if (opt.progress) fmt::print(stderr, "[reqat {:>6.1f}s] {}\n", since(t0), s);
  };

  const rl::CharTokenizer tok;
  rl::RunConfig rc;
  rc.model = cfg.model;
  rc.tasks = cfg.tasks;
  const rl::TaskSet ts(rc.task_mix(), static_cast<uint64_t>(cfg.tasks.seed), static_cast<int>(cfg.eval.size));
  const std::vector<rl::Task>& evalset = ts.eval_set();
  const KvQuantConfig kv = parse_kv_quant(cfg.kv_format, "kv_format");
  const int max_new = static_cast<int>(cfg.eval.max_new_tokens);
  rl::MetricsWriter metrics(out + "/metrics.jsonl");
  nlohmann::ordered_json timings;

  auto log_train = [&](const std::string& mode, const std::vector<TrainStepLog>& log) {
    for (const TrainStepLog& L : log)
      metrics.write({{"kind", "train"}, {"mode", mode}, {"seed", cfg.seed}, {"step", L.step}, {"elapsed_s", since(t0)},
                     {"loss", L.loss}, {"ce", L.ce}, {"sem", L.sem}, {"entropy", L.mean_entropy}, {"lr", L.lr},
                     {"grad_norm", L.grad_norm}});
  };
  auto save = [&](const model::Weights& w, const std::string& name) {
    if (opt.save_checkpoints) w.save(out + "/" + name);
  };

  // ---- base ----
  Clock::time_point tp = Clock::now();
  const std::string base_dir = cfg.base.dir.empty() ? out + "/base" : cfg.base.dir;
  rl::RunConfig brc = rc;
  brc.rl.train_device = cfg.train_device;
  brc.rl.device = cfg.eval.device;  // the base model's pass@1
  brc.sft.steps = cfg.base.steps;
  brc.sft.lr = cfg.base.lr;
  brc.sft.batch = cfg.base.batch;
  brc.sft.warmup_steps = cfg.base.warmup;
  brc.rl.eval_size = cfg.eval.size;
  brc.rl.max_new_tokens = cfg.eval.max_new_tokens;
  say(fmt::format("base: {} ({} SFT steps x {} worked solutions)", base_dir, cfg.base.steps, cfg.base.batch));
  const rl::SftResult sft = rl::ensure_base(brc, base_dir, opt.progress);
  const model::Weights base = model::Weights::load(base_dir);
  const std::string base_from =
      fmt::format("{} {} ({} SFT steps x {}, final loss {:.4f}, fp32 pass@1 {:.4f})", sft.cached ? "reused" : "trained",
                  base_dir, cfg.base.steps, cfg.base.batch, sft.final_loss, sft.pass1);
  timings["base_s"] = since(tp);

  // ---- traces ----
  tp = Clock::now();
  const std::vector<rl::Task> trace_tasks = ts.train_batch(kTraceFirst, static_cast<int>(cfg.traces.prompts));
  std::vector<rl::SftExample> traces;
  double trace_yield = 1.0;
  std::string trace_source = cfg.traces.source;
  if (cfg.traces.source == "solutions") {
    traces = solutions(trace_tasks, tok);
  } else {
    say(fmt::format("traces: greedy decoding of the base model on {} training prompts", trace_tasks.size()));
    InferSpec fp = fp_infer();
    fp.device = cfg.eval.device;
    const EvalResult r = evaluate(base, fp, trace_tasks, tok, max_new);
    for (size_t i = 0; i < trace_tasks.size(); ++i) {
      if (r.verdicts[i].outcome != rl::Outcome::Correct) continue;
      rl::SftExample e;
      e.tokens = tok.encode_prompt(trace_tasks[i].prompt);
      e.loss_mask.assign(e.tokens.size(), 0);
      e.tokens.insert(e.tokens.end(), r.responses[i].begin(), r.responses[i].end());
      e.loss_mask.resize(e.tokens.size(), 1);
      traces.push_back(std::move(e));
    }
    trace_yield = static_cast<double>(traces.size()) / static_cast<double>(trace_tasks.size());
    // A base too weak to produce a batch of correct traces would leave nothing to fine-tune on:
    // fall back to the worked solutions, and say so in the summary.
    if (static_cast<int64_t>(traces.size()) < cfg.stage1.batch) {
      say(fmt::format("traces: only {} correct greedy traces; using the worked solutions instead", traces.size()));
      traces = solutions(trace_tasks, tok);
      trace_source = "solutions (fallback: base yield too low)";
    }
  }
  say(fmt::format("traces: {} ({}, greedy yield {:.3f})", traces.size(), trace_source, trace_yield));
  timings["traces_s"] = since(tp);

  // ---- stage 1 ----
  tp = Clock::now();
  std::string train_device = "cpu";  // where the stages trained (the GPU trainer's name on cuda)
  model::Weights stage1 = base;
  {
    model::Model m(stage1);
    say("stage 1: full-precision fine-tuning on the traces");
    log_train("stage1", train_sft(m, traces, stage_spec(cfg.stage1, "stage 1", opt.progress, cfg.train_device),
                                  &train_device));
  }
  save(stage1, "stage1");
  timings["stage1_s"] = since(tp);

  // ---- Q-FIT ----
  tp = Clock::now();
  QFit qfit;
  std::vector<QFitGrid> grids;
  {
    model::Batch calib;
    for (int64_t i = 0; i < std::min<int64_t>(cfg.qfit.calib_sequences, static_cast<int64_t>(traces.size())); ++i)
      calib.add(traces[i].tokens);
    QFitOptions qo;
    qo.kv = kv;
    for (int64_t i = 0; i < cfg.qfit.grid; ++i) qo.alphas.push_back(static_cast<double>(i) / cfg.qfit.grid);
    qo.betas = qo.alphas;
    // On the training device: a forward and grid^2 attentions a layer (the GPU trainer's exact
    // float32 kernels there; the stage-1 model in float32 either way).
    if (cfg.train_device == "cuda") {
      auto dev = train::gpu_train_backend_factory()(stage1, model::PrecisionConfig::preset("fp32"));
      qfit = calibrate_qfit(*dev, stage1.cfg, calib, qo, &grids);
    } else {
      model::Weights w = stage1;
      model::Model m(w);
      qfit = calibrate_qfit(m, calib, qo, &grids);
    }
    for (size_t l = 0; l < qfit.layers.size(); ++l)
      say(fmt::format("Q-FIT layer {}: alpha {:.2f} beta {:.2f}, attention MSE {:.3g} -> {:.3g}", l,
                      qfit.layers[l].alpha, qfit.layers[l].beta, qfit.layers[l].mse_plain, qfit.layers[l].mse_best));
  }
  rl::write_text_atomic(out + "/qfit.json", qfit.to_json().dump() + "\n");
  timings["qfit_s"] = since(tp);

  // ---- stage 2 ----
  tp = Clock::now();
  std::vector<std::pair<std::string, model::Weights>> variants;
  // Plain QAT's data: as many worked solutions of other training prompts as there are traces.
  const std::vector<rl::SftExample> plain_data =
      solutions(ts.train_batch(kPlainFirst, static_cast<int>(traces.size())), tok);
  for (const std::string& v : cfg.variants) {
    model::Weights w = stage1;
    model::Model m(w, model::PrecisionConfig::preset("qat-sym"));
    const bool use_qfit = v == "reqat";
    install_kv_hooks(m, kv, use_qfit ? &qfit : nullptr);
    TrainSpec spec = stage_spec(cfg.stage2, "stage 2 " + v, opt.progress, cfg.train_device);
    if (cfg.train_device == "cuda") spec.kv = make_kv_transform(m.config(), kv, use_qfit ? &qfit : nullptr);
    spec.sem = v == "taq_sem" || v == "reqat";
    spec.sem_cfg = {cfg.sem.lambda, cfg.sem.percentile, cfg.sem.eps};
    say(fmt::format("stage 2 [{}]: W4A4KV4 QAT{}{} on {}", v, spec.sem ? " + SEM" : "", use_qfit ? " + Q-FIT" : "",
                    v == "plain_qat" ? "worked solutions of other prompts" : "the stage-1 traces, same order"));
    log_train(v, train_sft(m, v == "plain_qat" ? plain_data : traces, spec, &train_device));
    save(w, v);
    variants.emplace_back(v, std::move(w));
  }
  timings["stage2_s"] = since(tp);

  // ---- evaluation ----
  tp = Clock::now();
  std::vector<Row> rows;
  EvalResult ptq_fp, ptq_q, reqat_fp, reqat_q;
  bool have_reqat = false;
  std::string eval_device = "cpu";
  auto eval_row = [&](const std::string& name, const std::string& what, const model::Weights& w, const QFit* q,
                      EvalResult* keep_fp, EvalResult* keep_q) {
    Row r;
    r.name = name;
    r.what = what;
    InferSpec fp = fp_infer();
    fp.qfit = q;
    fp.device = cfg.eval.device;
    InferSpec a4 = fp;
    a4.precision = "nvfp4";
    InferSpec a4kv4 = w4a4kv4_infer(kv, q);
    a4kv4.device = cfg.eval.device;
    EvalResult efp = evaluate(w, fp, evalset, tok, max_new);
    EvalResult ea4 = evaluate(w, a4, evalset, tok, max_new);
    EvalResult ekv = evaluate(w, a4kv4, evalset, tok, max_new);
    eval_device = ekv.device;
    r.fp = efp.score.pass1;
    r.w4a4 = ea4.score.pass1;
    r.w4a4kv4 = ekv.score.pass1;
    r.kv4_score = ekv.score;
    say(fmt::format("eval {:<10} fp {:.4f}  w4a4 {:.4f}  w4a4kv4 {:.4f}", name, r.fp, r.w4a4, r.w4a4kv4));
    metrics.write({{"kind", "eval"}, {"mode", name}, {"seed", cfg.seed}, {"step", 0}, {"elapsed_s", since(t0)},
                   {"pass1", r.w4a4kv4}, {"pass1_fp", r.fp}, {"pass1_w4a4", r.w4a4}});
    if (keep_fp) *keep_fp = std::move(efp);
    if (keep_q) *keep_q = std::move(ekv);
    rows.push_back(std::move(r));
  };
  eval_row("base", "base model (before stage 1), round-to-nearest", base, nullptr, nullptr, nullptr);
  eval_row("ptq", "stage-1 model (full-precision fine-tuning), round-to-nearest", stage1, nullptr, &ptq_fp, &ptq_q);
  eval_row("ptq_qfit", "stage-1 model + Q-FIT, no QAT", stage1, &qfit, nullptr, nullptr);
  for (const auto& [v, w] : variants) {
    const bool is_reqat = v == "reqat";
    const std::string what = v == "plain_qat" ? "QAT on non-aligned data, no SEM, no Q-FIT"
                             : v == "taq"     ? "trace-aligned QAT"
                             : v == "taq_sem" ? "trace-aligned QAT + SEM"
                                              : "trace-aligned QAT + SEM + Q-FIT";
    eval_row(v, what, w, is_reqat ? &qfit : nullptr, is_reqat ? &reqat_fp : nullptr, is_reqat ? &reqat_q : nullptr);
    have_reqat = have_reqat || is_reqat;
  }
  timings["eval_s"] = since(tp);

  // ---- low-entropy analysis ----
  tp = Clock::now();
  nlohmann::ordered_json tokens;
  const TokenAnalysis before = analyze_divergence(stage1, nullptr, evalset, ptq_fp, ptq_q, tok, cfg.eval.low_entropy,
                                                cfg.train_device);
  tokens["before_ptq"] = before.to_json();
  if (have_reqat) {
    const model::Weights* wr = nullptr;
    for (const auto& [v, w] : variants)
      if (v == "reqat") wr = &w;
    const TokenAnalysis after = analyze_divergence(*wr, &qfit, evalset, reqat_fp, reqat_q, tok, cfg.eval.low_entropy,
                                                  cfg.train_device);
    tokens["after_reqat"] = after.to_json();
  }
  timings["tokens_s"] = since(tp);

  // ---- summary, report, plots ----
  metrics.write({{"kind", "done"}, {"mode", "all"}, {"seed", cfg.seed}, {"step", 0}, {"elapsed_s", since(t0)}});
  nlohmann::ordered_json s;
  s["full_precision_pass1"] = rows[1].fp;  // the stage-1 (full-precision fine-tuned) model
  nlohmann::ordered_json kv4;
  for (const Row& r : rows) kv4[r.name] = r.w4a4kv4;
  s["w4a4kv4_pass1"] = kv4;
  nlohmann::ordered_json table = nlohmann::ordered_json::array();
  for (const Row& r : rows)
    table.push_back({{"name", r.name}, {"what", r.what}, {"fp_pass1", r.fp}, {"w4a4_pass1", r.w4a4},
                     {"w4a4kv4_pass1", r.w4a4kv4}, {"w4a4kv4_by_family", score_json(r.kv4_score)}});
  s["rows"] = table;
  s["eval_tasks"] = evalset.size();
  s["eval_device"] = eval_device;
  s["train_device"] = train_device;
  s["kv_cache"] = kv.describe() + " (1x16 blocks along head_dim, E4M3 block scales, per-(token, head) FP32 amax)";
  s["base"] = base_from;
  s["traces"] = {{"source", trace_source}, {"prompts", cfg.traces.prompts}, {"kept", traces.size()},
                 {"yield", trace_yield}};
  nlohmann::ordered_json ql = nlohmann::ordered_json::array();
  for (const QFitLayer& L : qfit.layers)
    ql.push_back({{"alpha", L.alpha}, {"beta", L.beta}, {"attn_mse_plain", L.mse_plain}, {"attn_mse_qfit", L.mse_best}});
  s["qfit"] = ql;
  s["tokens"] = tokens;
  timings["total_s"] = since(t0);
  s["timings"] = timings;
  rl::write_text_atomic(out + "/summary.json", s.dump(2) + "\n");

  const std::vector<nlohmann::json> mrows = rl::read_jsonl(out + "/metrics.jsonl");
  rl::write_csv(mrows, out + "/metrics.csv");
  std::vector<std::string> plots;
  if (rl::gnuplot_available()) {
    rl::plot_lines(out + "/loss.png", "training cross-entropy", "step", "CE (nats/token)",
                   rl::series_by_mode(mrows, "train", "ce"));
    rl::plot_lines(out + "/entropy.png", "mean entropy of response tokens", "step", "nats",
                   rl::series_by_mode(mrows, "train", "entropy"));
    plots = {"loss.png", "entropy.png"};
  }
  rl::write_text_atomic(out + "/report.md", reqat_report(s, config_toml, plots));
  say(fmt::format("done in {:.1f}s: {}/summary.json, {}/report.md", since(t0), out, out));
  return s;
}

std::string reqat_report(const nlohmann::ordered_json& s, const std::string& config_toml,
                         const std::vector<std::string>& plots) {
  std::string md = "# ReQAT: full FP4 inference (W4A4KV4)\n\n";
  const double ref = s.value("full_precision_pass1", 0.0);
  md += fmt::format(
      "Greedy pass@1 on {} held-out tasks. FP: float32 weights, activations and KV cache. W4A4: NVFP4 linears "
      "(weights and per-token activations), float32 KV cache. W4A4KV4: W4A4 plus a 4-bit KV cache ({}). "
      "Reference (full-precision fine-tuning, stage 1, in FP): **{:.4f}**.\n\n",
      s.value("eval_tasks", 0), s.value("kv_cache", std::string("?")), ref);
  md += fmt::format("Evaluation rollouts ran on: {}; the training stages (forward, backward, AdamW), Q-FIT's "
                    "calibration and the low-entropy analysis on: {}.\n\n",
                    s.value("eval_device", std::string("cpu")), s.value("train_device", std::string("cpu")));
  md += "| model | what | FP | W4A4 | W4A4KV4 | W4A4KV4 - ref |\n|---|---|---|---|---|---|\n";
  for (const auto& r : s["rows"])
    md += fmt::format("| {} | {} | {:.4f} | {:.4f} | **{:.4f}** | {:+.4f} |\n", r["name"].get<std::string>(),
                      r["what"].get<std::string>(), r["fp_pass1"].get<double>(), r["w4a4_pass1"].get<double>(),
                      r["w4a4kv4_pass1"].get<double>(), r["w4a4kv4_pass1"].get<double>() - ref);
  md += "\nW4A4KV4 pass@1 per family:\n\n| model |";
  std::vector<std::string> fams;
  for (const auto& [k, v] : s["rows"][0]["w4a4kv4_by_family"].items())
    if (k != "pass1") fams.push_back(k);
  for (const auto& f : fams) md += " " + f + " |";
  md += "\n|---|";
  for (size_t i = 0; i < fams.size(); ++i) md += "---|";
  md += "\n";
  for (const auto& r : s["rows"]) {
    md += "| " + r["name"].get<std::string>() + " |";
    for (const auto& f : fams) md += fmt::format(" {:.3f} |", r["w4a4kv4_by_family"].value(f, NAN));
    md += "\n";
  }
  md += fmt::format("\nBase model: {}. Traces: {}.\n", s.value("base", std::string("?")), s["traces"].dump());
  md += "\n## Q-FIT (per layer)\n\n| layer | alpha | beta | attention MSE, KV4 alone | with Q-FIT |\n|---|---|---|---|---|\n";
  int l = 0;
  for (const auto& q : s["qfit"])
    md += fmt::format("| {} | {:.2f} | {:.2f} | {:.4g} | {:.4g} |\n", l++, q["alpha"].get<double>(),
                      q["beta"].get<double>(), q["attn_mse_plain"].get<double>(), q["attn_mse_qfit"].get<double>());
  md += "\n## Where quantized greedy traces leave the full-precision ones\n\n"
        "A quantization error: the FP greedy answer is right and the W4A4KV4 one wrong. Entropy: the FP model's, "
        "at the first differing token.\n\n"
        "| | diverged | quant. errors | at low entropy | share | mean H at divergence | digit / operator / other |\n"
        "|---|---|---|---|---|---|---|\n";
  for (const auto& [k, t] : s["tokens"].items()) {
    const auto& c = t["divergences_by_class"];
    md += fmt::format("| {} | {} | {} | {} | {:.3f} | {:.3f} | {} / {} / {} |\n", k, t["diverged"].get<int>(),
                      t["quant_errors"].get<int>(), t["quant_errors_low_entropy"].get<int>(),
                      t["share_quant_errors_low_entropy"].get<double>(), t["mean_entropy_at_divergence"].get<double>(),
                      c["digit"].get<int>(), c["operator"].get<int>(), c["other"].get<int>());
  }
  md += "\n## Timings (s)\n\n```\n" + s["timings"].dump(2) + "\n```\n";
  for (const auto& p : plots) md += "\n![" + p + "](" + p + ")\n";
  md += "\n## Configuration\n\n```toml\n" + config_toml + "```\n";
  return md;
}

}  // namespace quads::reqat
