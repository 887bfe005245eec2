#pragma once
// The QUADS recipe and the modes of the comparison: which numerics the rollout engine and the
// trainer run in, whether the rollout adds residual activation compensation (RAC) and whether the
// policy gradient is corrected by truncated importance sampling (TIS).
//
//   mode        rollout            trainer                 TIS
//   bf16        bf16               bf16                    no
//   fp8         fp8 (W8A8 blocks)  bf16                    no
//   nvfp4       nvfp4 (W4A4)       bf16                    no
//   nvfp4-tis   nvfp4 (W4A4)       bf16                    yes
//   quads       nvfp4 + RAC        asymmetric QAT (qat)    no
//   qat-only    nvfp4 (W4A4)       asymmetric QAT (qat)    no
//   rac-only    nvfp4 + RAC        bf16                    no
//   qat-sym     nvfp4 (W4A4)       symmetric QAT (qat-sym) no   (ablation, not in the default list)
//   fp32        fp32               fp32                    no   (reference, not in the default list)
//
// rl.tis = true turns TIS on in every mode (the nvfp4-tis mode has it regardless). Asymmetric QAT:
// the trainer's quantized linears use the NVFP4 weights dequantized by the same num:: code from the
// same float32 master weights, so they are bit-identical to the rollout engine's; activations stay
// BF16. Gradients go straight through to the master weights (model/linear.h).
#include <string>
#include <vector>

#include "model/linear.h"
#include "model/rac.h"

namespace quads::rl {

struct ModeSpec {
  std::string name;
  std::string rollout;  // PrecisionConfig preset of the rollout engine
  std::string trainer;  // PrecisionConfig preset of the trainer
  bool rac = false;
  bool tis = false;
  std::string summary;  // one line for reports
};

// Every mode above, in the table's order.
const std::vector<ModeSpec>& all_modes();
// The modes `quads compare` runs by default: bf16 fp8 nvfp4 nvfp4-tis quads qat-only rac-only.
std::vector<std::string> default_modes();
// Throws quads::Error naming the mode and listing the known ones.
const ModeSpec& mode_spec(const std::string& name);
bool is_mode(const std::string& name);

model::PrecisionConfig rollout_precision(const ModeSpec& m);
model::PrecisionConfig trainer_precision(const ModeSpec& m);

}  // namespace quads::rl
