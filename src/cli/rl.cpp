// quads rl: one GRPO run in one mode from a base checkpoint.
//   quads rl --out runs/nvfp4 --mode nvfp4 [--base DIR] [--config FILE.toml] [--set rl.steps=50]
//            [--seed N] [--resume] [--routing-replay] [--device cpu|cuda]
//   quads rl --out runs/mine --mode quads --model HF_DIR --data train.jsonl [--eval-data eval.jsonl]
// Without --base the base model is trained first (or reused) in OUT/base. With --model (data.model)
// that checkpoint is the base and the prompts come from the JSONL data (docs/quads.md). Writes OUT/metrics.jsonl
// (one row per step and per evaluation), OUT/checkpoint/ and OUT/summary.json.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/error.h"
#include "rl/compare.h"
#include "rl/config.h"
#include "rl/modes.h"
#include "rl/report.h"
#include "rl/run.h"
#include "rl/sft.h"

namespace {

struct Options {
  std::string config, out, mode = "quads", base, model, data, eval_data, device;
  std::vector<std::string> set;
  int64_t seed = -1;
  bool resume = false, replay = false, no_diag = false;
};

int run(const Options& o) {
  using namespace quads;
  std::vector<std::string> set = o.set;
  if (o.replay) set.push_back("rl.routing_replay=true");
  if (o.no_diag) set.push_back("rl.diagnostics=false");
  rl::RunConfig cfg = rl::load_config(o.config, set, [&](rl::RunConfig& c) {
    if (!o.model.empty()) c.data.model = o.model;
    if (!o.data.empty()) c.data.train = o.data;
    if (!o.eval_data.empty()) c.data.eval = o.eval_data;
    if (!o.device.empty()) c.rl.device = o.device;
  });
  (void)rl::mode_spec(o.mode);
  QUADS_CHECK(!cfg.uses_dataset() || o.base.empty(), "--base {} and --model / data.model {} both name a base model",
              o.base, cfg.data.model);
  std::filesystem::create_directories(o.out);
  rl::save_resolved_config(cfg, o.out);
  std::string base = o.base;
  if (base.empty() && !cfg.uses_dataset()) {
    base = o.out + "/base";
    rl::SftResult s = rl::ensure_base(cfg, base, true);
    std::fprintf(stderr, "base model %s: pass@1 %.3f%s\n", base.c_str(), s.pass1, s.cached ? " (reused)" : "");
  }
  rl::RunOptions ro;
  ro.mode = o.mode;
  ro.seed = o.seed >= 0 ? o.seed : cfg.rl.seed;
  ro.base_dir = base;
  ro.out_dir = o.out;
  ro.resume = o.resume;
#ifdef QUADS_HAVE_CUDA
  rl::install_cuda_rollouts();
#endif
  rl::RunOutcome out = rl::run_rl(cfg, ro);
  rl::RunResult r = rl::summarize_rows(out.rows, cfg.rl.collapse_margin);
  r.seconds = out.seconds;
  auto summary = rl::make_summary({{o.mode, {r}}});
  summary["device"] = out.device;
  summary["train_device"] = out.train_device;
  rl::write_text_atomic(o.out + "/summary.json", summary.dump(2) + "\n");
  std::printf("%s", rl::summary_table(summary).c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--config", o->config, "run configuration (TOML); without it the built-in default");
  app.add_option("--out", o->out, "run folder")->required();
  app.add_option("--mode", o->mode,
                 "bf16 | fp8 | nvfp4 | nvfp4-tis | quads | qat-only | rac-only | qat-sym | fp32")
      ->capture_default_str();
  app.add_option("--base", o->base, "base checkpoint folder (quads sft); default: train or reuse OUT/base");
  app.add_option("--model", o->model, "your own base model: HF checkpoint folder with tokenizer.json (sets data.model; no SFT)");
  app.add_option("--data", o->data, "training prompts, JSONL {\"prompt\", \"answer\"} (sets data.train)");
  app.add_option("--eval-data", o->eval_data, "evaluation prompts, JSONL (sets data.eval; default: held out of --data)");
  app.add_option("--set", o->set, "override a config key, e.g. --set rl.lr=1e-3 (repeatable)");
  app.add_option("--seed", o->seed, "run seed (default: rl.seed)");
  app.add_flag("--resume", o->resume, "continue from OUT/checkpoint (bitwise the same as an uninterrupted run)");
  app.add_flag("--routing-replay", o->replay, "the trainer routes tokens to the experts the rollout chose");
  app.add_flag("--no-diagnostics", o->no_diag, "skip the routing mismatch and activation error measurements");
  app.add_option("--device", o->device, "where the rollout engine runs: cpu | cuda (sets rl.device; the trainer follows unless rl.train_device is set)");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("rl", "one GRPO run in one precision mode (rollout engine + trainer)", setup);
