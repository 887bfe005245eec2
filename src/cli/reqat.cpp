// quads reqat: the ReQAT experiment (stage 1, Q-FIT, stage 2 variants, W4A4KV4 evaluation).
//   quads reqat --out runs/reqat                       # the built-in default (configs/reqat.toml)
//   quads reqat --config configs/reqat.toml --set stage2.lr=1e-4 --out runs/reqat2
// Writes OUT/summary.json, OUT/report.md, metrics, plots, qfit.json and checkpoints (src/reqat/pipeline.h).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/reqat_devices.h"
#include "common/error.h"
#include "reqat/config.h"
#include "reqat/pipeline.h"

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
                 "where the training, Q-FIT, the low-entropy analysis and the evaluation rollouts run: cpu | cuda (sets "
                 "train_device and eval.device)");
  app.add_flag("--print-config", o->print_config, "print the resolved configuration (TOML) and exit");
  return [o] {
    using namespace quads;
    const reqat::ReqatConfig cfg = reqat::load_reqat_config(o->config, cli::with_device(o->sets, o->device));
    cli::install_reqat_devices(cfg, "reqat");
    if (o->print_config) {
      std::printf("%s", reqat::to_toml(cfg).c_str());
      return 0;
    }
    cli::check_reqat_devices(cfg, "reqat");
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
