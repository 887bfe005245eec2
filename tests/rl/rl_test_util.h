#pragma once
// Helpers shared by the RL run tests.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace quads::test {

// Metrics rows without their wall-clock keys (elapsed_s, t_*): what a bitwise-repeatable run must
// reproduce exactly.
inline std::vector<nlohmann::json> deterministic(std::vector<nlohmann::json> rows) {
  for (auto& r : rows) {
    std::vector<std::string> drop;
    for (auto& [k, v] : r.items())
      if (k == "elapsed_s" || k.rfind("t_", 0) == 0) drop.push_back(k);
    for (const auto& k : drop) r.erase(k);
  }
  return rows;
}

}  // namespace quads::test
