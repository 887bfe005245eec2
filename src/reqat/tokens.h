#pragma once
// Low-entropy analysis: where a quantized model's greedy trace first leaves the full-precision
// greedy trace of the same weights, the full-precision model's entropy there and the class of the
// token it would have emitted (digit, operator, other), and how many quantization-induced errors
// (full precision right, quantized wrong) start at a low-entropy token — the positions SEM targets.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/weights.h"
#include "reqat/kv_quant.h"
#include "reqat/trainer.h"

namespace quads::reqat {

enum class TokenClass : uint8_t { Digit, Operator, Other };
const char* token_class_name(TokenClass c);  // "digit", "operator", "other"
// '0'..'9': digit; + - * = > ( ): operator; everything else (space, newline, letters, specials): other.
TokenClass classify_token(const rl::CharTokenizer& tok, int32_t id);

// The first index where two responses differ (the shorter length if one is a prefix of the
// other); -1 when they are equal.
int64_t first_divergence(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

struct Divergence {
  int task = 0;
  int64_t pos = 0;          // index into the response
  double entropy = 0;       // full-precision entropy (nats) at that position
  TokenClass cls = TokenClass::Other;  // of the full-precision token there
  bool fp_correct = false, q_correct = false;
};

struct TokenAnalysis {
  int n = 0;              // tasks
  int diverged = 0;       // tasks whose traces differ
  int errors = 0;         // quantization-induced errors: fp correct, quantized wrong
  int errors_low = 0;     // ... whose divergence is at a low-entropy token
  double low_entropy = 0; // the threshold (nats)
  int class_count[3] = {0, 0, 0};        // divergences per class
  int error_class_count[3] = {0, 0, 0};  // quantization-induced errors per class
  double mean_entropy_diverged = 0;      // mean entropy at the divergences
  double mean_entropy_all = 0;           // mean entropy over every full-precision response token
  double share_low_all = 0;              // share of response tokens below the threshold
  std::vector<Divergence> records;
  double share_errors_low() const { return errors ? static_cast<double>(errors_low) / errors : 0.0; }
  nlohmann::json to_json() const;  // counts and shares (records left out)
};

// fp and q: evaluations of the same tasks (full precision, quantized). The entropies come from
// `w` run in float32 (with Q-FIT's hooks, KV quantization off, when qfit is given), on the host's
// model (device "cpu") or a trainer backend's forward ("cuda": train::gpu_train_backend_factory).
TokenAnalysis analyze_divergence(const model::Weights& w, const QFit* qfit, const std::vector<rl::Task>& tasks,
                                 const EvalResult& fp, const EvalResult& q, const rl::CharTokenizer& tok,
                                 double low_entropy, const std::string& device = "cpu");

}  // namespace quads::reqat
