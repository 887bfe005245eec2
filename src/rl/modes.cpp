#include "rl/modes.h"

#include <fmt/format.h>

#include "common/error.h"

namespace quads::rl {

const std::vector<ModeSpec>& all_modes() {
  static const std::vector<ModeSpec> modes{
      {"bf16", "bf16", "bf16", false, false, "BF16 rollout, BF16 trainer"},
      {"fp8", "fp8", "bf16", false, false, "FP8 W8A8 rollout, BF16 trainer"},
      {"nvfp4", "nvfp4", "bf16", false, false, "naive NVFP4 W4A4 rollout, BF16 trainer"},
      {"nvfp4-tis", "nvfp4", "bf16", false, true, "NVFP4 W4A4 rollout, BF16 trainer, TIS"},
      {"quads", "nvfp4", "qat", true, false, "NVFP4 W4A4 + RAC rollout, asymmetric QAT trainer"},
      {"qat-only", "nvfp4", "qat", false, false, "NVFP4 W4A4 rollout, asymmetric QAT trainer"},
      {"rac-only", "nvfp4", "bf16", true, false, "NVFP4 W4A4 + RAC rollout, BF16 trainer"},
      {"qat-sym", "nvfp4", "qat-sym", false, false, "NVFP4 W4A4 rollout, symmetric QAT trainer (W4A4)"},
      {"fp32", "fp32", "fp32", false, false, "FP32 rollout, FP32 trainer (reference)"},
  };
  return modes;
}

std::vector<std::string> default_modes() { return {"bf16", "fp8", "nvfp4", "nvfp4-tis", "quads", "qat-only", "rac-only"}; }

bool is_mode(const std::string& name) {
  for (const auto& m : all_modes())
    if (m.name == name) return true;
  return false;
}

const ModeSpec& mode_spec(const std::string& name) {
  for (const auto& m : all_modes())
    if (m.name == name) return m;
  std::vector<std::string> names;
  for (const auto& m : all_modes()) names.push_back(m.name);
  fail("unknown mode '{}' (known: {})", name, fmt::join(names, ", "));
}

model::PrecisionConfig rollout_precision(const ModeSpec& m) { return model::PrecisionConfig::preset(m.rollout); }
model::PrecisionConfig trainer_precision(const ModeSpec& m) { return model::PrecisionConfig::preset(m.trainer); }

}  // namespace quads::rl
