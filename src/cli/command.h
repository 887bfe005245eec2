#pragma once
// Subcommand registry. Each cli/<name>.cpp defines one subcommand and registers it with a static
// QUADS_COMMAND object, so main.cpp never needs editing when a command is added.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace quads::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `app` and returns the action to run when the subcommand was chosen.
  std::function<std::function<int()>(CLI::App& app)> setup;
};

std::vector<Command>& registry();

struct Registrar {
  explicit Registrar(Command c) { registry().push_back(std::move(c)); }
};

}  // namespace quads::cli

#define QUADS_CONCAT_(a, b) a##b
#define QUADS_CONCAT(a, b) QUADS_CONCAT_(a, b)
#define QUADS_COMMAND(name, help, setup_fn) \
  static ::quads::cli::Registrar QUADS_CONCAT(quads_cmd_, __LINE__)({name, help, setup_fn})
