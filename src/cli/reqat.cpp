// quads reqat: the ReQAT experiment (stage 1, Q-FIT, stage 2 variants, W4A4KV4 evaluation).
//   quads reqat --out runs/reqat                       # the built-in default (configs/reqat.toml)
//   quads reqat --config configs/reqat.toml --set stage2.lr=1e-4 --out runs/reqat2
// Writes OUT/summary.json, OUT/report.md, metrics, plots, qfit.json and checkpoints (src/reqat/pipeline.h).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/error.h"
#include "reqat/config.h"
#include "reqat/pipeline.h"
#include "rl/run.h"
#include "train/backend.h"

namespace {

struct Options {
  std::string config, out;
  std::vector<std::string> sets;
  bool quiet = false;
  bool no_checkpoints = false;
  bool print_config = false;
  std::string device;
};

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--config", o->config, "TOML file (default: the built-in default, as configs/reqat.toml)");
  app.add_option("--set", o->sets, "override a key, e.g. --set stage2.lr=1e-4 (repeatable)");
  app.add_option("--out", o->out, "output folder");
  app.add_flag("--quiet", o->quiet, "no progress output");
  app.add_flag("--no-checkpoints", o->no_checkpoints, "do not save the model checkpoints");
  app.add_option("--device", o->device,
                 "where the training and the evaluation rollouts run: cpu | cuda (sets train_device and eval.device)");
  app.add_flag("--print-config", o->print_config, "print the resolved configuration (TOML) and exit");
  return [o] {
    using namespace quads;
    std::vector<std::string> sets = o->sets;
    if (!o->device.empty()) {
      sets.push_back("eval.device=\"" + o->device + "\"");
      sets.push_back("train_device=\"" + o->device + "\"");
    }
    const reqat::ReqatConfig cfg = reqat::load_reqat_config(o->config, sets);
#ifdef QUADS_HAVE_CUDA
    rl::install_cuda_rollouts();
#endif
    if (cfg.eval.device == "cuda") {  // fail before any work
      try {
        (void)rl::rollout_backend_factory();
      } catch (const Error&) {
        fail("reqat: eval.device = \"cuda\" (--device cuda), but this build has no CUDA backend (configure with "
             "-DQUADS_CUDA=ON, or use the cpu)");
      }
    }
    if (cfg.train_device == "cuda") {
      try {
        (void)train::gpu_train_backend_factory();
      } catch (const Error&) {
        fail("reqat: train_device = \"cuda\" (--device cuda), but this build has no CUDA trainer (configure with "
             "-DQUADS_CUDA=ON, or use the cpu)");
      }
    }
    if (o->print_config) {
      std::printf("%s", reqat::to_toml(cfg).c_str());
      return 0;
    }
#ifdef QUADS_HAVE_CUDA
    // Here rather than in the backends' factories, whose errors name the RL settings.
    if ((cfg.eval.device == "cuda" || cfg.train_device == "cuda") && cuda::device_count() == 0)
      fail("reqat: train_device = \"{}\", eval.device = \"{}\" (--device), but no CUDA device was found (use the "
           "cpu)",
           cfg.train_device, cfg.eval.device);
#endif
    QUADS_CHECK(!o->out.empty(), "reqat: --out is required");
    reqat::RunOptions ro;
    ro.progress = !o->quiet;
    ro.save_checkpoints = !o->no_checkpoints;
    const auto s = reqat::run_reqat(cfg, o->out, ro);
    std::printf("%s\n", s.dump(2).c_str());
    return 0;
  };
}

}  // namespace

QUADS_COMMAND("reqat", "ReQAT: trace-aligned QAT + SEM + Q-FIT for W4A4KV4 inference; writes summary.json and a report",
              setup);
