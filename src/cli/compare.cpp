// quads compare: the comparison experiment. From one base model (trained by SFT first, cached in
// DIR/base) and the same seeds, one GRPO run per mode and seed; then DIR/summary.json,
// DIR/report.md, DIR/pass1.png, DIR/logp_gap.png, DIR/metrics.jsonl/.csv, and the table on stdout.
//   quads compare --out runs/default
//   quads compare --config configs/harder.toml --out runs/harder --seeds 3 --set rl.lr=5e-4
//   quads compare --model HF_DIR --data train.jsonl [--eval-data eval.jsonl] --out runs/mine [--analyze]
//   quads compare --out runs/gpu --device cuda      (rollouts on the GPU, runs one after another)
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "common/error.h"
#include "rl/compare.h"
#include "rl/config.h"
#include "rl/report.h"
#include "rl/run.h"
#include "rl/sweep.h"
#include "rl/sft.h"

namespace {

struct Options {
  std::string config, out, base, model, data, eval_data, device;
  std::vector<std::string> set;
  int64_t seeds = 0;
  int jobs = 0;
  bool resume = false, replay = false, no_diag = false, sweep = false, analyze = false;
};

// The RAC ratio sweep on the base model only (rl/sweep.h).
int run_sweep(const quads::rl::RunConfig& cfg, const std::string& out) {
  using namespace quads;
  std::filesystem::create_directories(out);
  rl::SftResult s = rl::ensure_base(cfg, out + "/base", true);
  std::fprintf(stderr, "base model %s/base: pass@1 %.3f%s\n", out.c_str(), s.pass1, s.cached ? " (reused)" : "");
  const auto pts = rl::rac_sweep(cfg, out + "/base");
  rl::write_text_atomic(out + "/rac_sweep.json", rl::sweep_json(pts).dump(2) + "\n");
  std::printf("%s", rl::sweep_table(pts).c_str());
  return 0;
}

int run(const Options& o) {
  using namespace quads;
  std::vector<std::string> set = o.set;
  if (o.replay) set.push_back("rl.routing_replay=true");
  if (o.no_diag) set.push_back("rl.diagnostics=false");
  if (o.seeds > 0) set.push_back("rl.seeds=" + std::to_string(o.seeds));
  rl::RunConfig cfg = rl::load_config(o.config, set, [&](rl::RunConfig& c) {
    if (!o.model.empty()) c.data.model = o.model;
    if (!o.data.empty()) c.data.train = o.data;
    if (!o.eval_data.empty()) c.data.eval = o.eval_data;
    if (o.analyze) c.analysis.enabled = true;
    if (!o.device.empty()) c.rl.device = o.device;
  });
  if (o.sweep) {
    QUADS_CHECK(!cfg.uses_dataset(), "--rac-sweep works on the generated tasks' SFT base, not with data.model");
    return run_sweep(cfg, o.out);
  }
  rl::CompareOptions co;
  co.out_dir = o.out;
  co.base_dir = o.base;
  co.resume = o.resume;
  // Tiny models use a core far better as one run per thread than as one run over all threads.
  co.jobs = o.jobs > 0 ? o.jobs : std::max(1, omp_get_max_threads());
#ifdef QUADS_HAVE_CUDA
  rl::install_cuda_rollouts();
#endif
  rl::CompareOutcome r = rl::run_compare(cfg, co);
  std::printf("\n%s\n", r.table.c_str());
  std::printf("%lld seed(s) per mode, %lld RL steps each; %s/report.md has the details (%.0f s in all)\n",
              static_cast<long long>(cfg.rl.seeds), static_cast<long long>(cfg.rl.steps), o.out.c_str(), r.seconds);
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--config", o->config, "run configuration (TOML); without it the built-in default");
  app.add_option("--out", o->out, "output folder")->required();
  app.add_option("--base", o->base, "an existing base checkpoint (quads sft) instead of DIR/base");
  app.add_option("--model", o->model, "your own base model: HF checkpoint folder with tokenizer.json (sets data.model; no SFT)");
  app.add_option("--data", o->data, "training prompts, JSONL {\"prompt\", \"answer\"} (sets data.train)");
  app.add_option("--eval-data", o->eval_data, "evaluation prompts, JSONL (sets data.eval; default: held out of --data)");
  app.add_flag("--analyze", o->analyze, "first run `analyze layers` on the base model into OUT/analysis (sets analysis.enabled)");
  app.add_option("--set", o->set, "override a config key, e.g. --set rl.lr=1e-3 (repeatable)");
  app.add_option("--seeds", o->seeds, "seeds per mode (overrides rl.seeds)");
  app.add_option("--jobs", o->jobs, "runs in flight at once (default: the OpenMP thread count; results do not depend on it)");
  app.add_flag("--resume", o->resume, "continue runs from their checkpoints");
  app.add_flag("--rac-sweep", o->sweep, "only measure the log-prob gap of RAC ratios 0..1 on the base model");
  app.add_flag("--routing-replay", o->replay, "the trainer routes tokens to the experts the rollout chose");
  app.add_flag("--no-diagnostics", o->no_diag, "skip the routing mismatch and activation error measurements");
  app.add_option("--device", o->device, "where the rollout engines run: cpu | cuda (sets rl.device; the trainer follows unless rl.train_device is set)");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("compare", "the RL comparison: every precision mode from one base model, summary + report + plots", setup);
