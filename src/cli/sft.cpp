// quads sft: trains the base model of the RL experiments from scratch on generated worked solutions
// and writes an HF-format checkpoint with its tokenizer.
//   quads sft --out runs/base [--config FILE.toml] [--set sft.steps=300 ...]
// The folder gets config.json, model.safetensors, tokenizer.json, sft.json (loss, base pass@1) and
// the resolved run config (config.toml, config.json).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/error.h"
#include "rl/compare.h"
#include "rl/config.h"
#include "rl/sft.h"

namespace {

struct Options {
  std::string config, out;
  std::vector<std::string> set;
};

int run(const Options& o) {
  using namespace quads;
  rl::RunConfig cfg = rl::load_config(o.config, o.set);
  QUADS_CHECK(!cfg.uses_dataset(), "quads sft trains the base of the generated tasks; with data.model = {} that "
              "checkpoint is the base already (quads rl / compare --model)", cfg.data.model);
  rl::SftResult r = rl::run_sft(cfg, o.out, true);
  std::printf("base model written to %s: final loss %.4f, pass@1 %.3f (fp32, greedy, %lld tasks), %.0f s\n",
              o.out.c_str(), r.final_loss, r.pass1, static_cast<long long>(cfg.rl.eval_size), r.seconds);
  for (const auto& line : r.samples) std::printf("  %s\n", line.c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--config", o->config, "run configuration (TOML); without it the built-in default");
  app.add_option("--out", o->out, "checkpoint folder to write")->required();
  app.add_option("--set", o->set, "override a config key, e.g. --set sft.steps=300 (repeatable)");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("sft", "train the base model for RL from scratch on generated worked solutions", setup);
