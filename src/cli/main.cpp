#include <algorithm>
#include <cstdio>
#include <exception>

#include "cli/command.h"
#include "common/error.h"

namespace quads::cli {
std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}
}  // namespace quads::cli

int main(int argc, char** argv) {
  using namespace quads::cli;
  CLI::App app{"quads: RL for MoE language models with NVFP4 rollouts as accurate as BF16"};
  app.require_subcommand(1);
  auto& cmds = registry();
  std::sort(cmds.begin(), cmds.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
  std::vector<std::pair<CLI::App*, std::function<int()>>> actions;
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    actions.emplace_back(sub, c.setup(*sub));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : actions)
      if (sub->parsed()) return run();
  } catch (const quads::Error& e) {
    std::fprintf(stderr, "quads: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "quads: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
