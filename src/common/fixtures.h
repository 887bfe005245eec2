#pragma once
#include <cstdlib>
#include <string>

namespace quads {
// Where the reference fixtures live: $QUADS_FIXTURES, else the path given to CMake
// (QUADS_FIXTURES_DIR, by default ../shared/fixtures beside the source tree).
inline std::string fixtures_dir() {
  if (const char* env = std::getenv("QUADS_FIXTURES"); env && *env) return env;
  return QUADS_DEFAULT_FIXTURES;
}
}  // namespace quads
