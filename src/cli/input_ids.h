#pragma once
// The token-id input of `quads logits` and `quads grad`: a JSON file {"input_ids": [1, 2, ...]}.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace quads::cli {

// Errors name the file; `min_tokens` is what the command needs (2 for a next-token loss).
inline std::vector<int32_t> read_input_ids(const std::string& path, size_t min_tokens) {
  std::ifstream f(path);
  QUADS_CHECK(f.good(), "cannot open {}", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    quads::fail("{}: invalid JSON ({})", path, e.what());
  }
  QUADS_CHECK(j.is_object() && j.contains("input_ids") && j["input_ids"].is_array(),
              "{}: expected an object with an 'input_ids' list", path);
  std::vector<int32_t> ids;
  for (const auto& v : j["input_ids"]) {
    QUADS_CHECK(v.is_number_integer(), "{}: 'input_ids' must hold integers, found {}", path, v.dump());
    ids.push_back(v.get<int32_t>());
  }
  QUADS_CHECK(!ids.empty(), "{}: 'input_ids' is empty", path);
  QUADS_CHECK(ids.size() >= min_tokens, "{}: need at least {} tokens, found {}", path, min_tokens, ids.size());
  return ids;
}

}  // namespace quads::cli
