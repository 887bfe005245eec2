#pragma once
// Residual activation compensation (RAC), the rollout half of QUADS. For a W4A4 linear with input
// X [M, in], the online activation quantizer leaves a residual R = X - DQ(Q(X)). RAC picks a set S
// of input channels with the largest residual energy and adds a second, small GEMM:
//   Y = DQ(Q(X)) · W_effᵀ                       (the main W4A4 GEMM, untouched)
//     + DQ(Q_rac(R[:, S])) · W_eff[:, S]ᵀ        (the same quantized weight columns)
// S is chosen per input channel or per whole 16-channel block; whole blocks keep the weight's NVFP4
// blocks intact in the residual GEMM (a GPU kernel can reuse W's codes and scales as they are).
// Q_rac rounds the gathered residual (NVFP4 1x16 with a per-token global scale by default, FP8
// per token, or BF16): every option is row-local, so a token's correction depends on that token.
//
// Selection:
//   static (default): ranked on a fixed calibration batch at every weight sync (rac_calibrate);
//     S is then a property of the weights, and generation stays batch-invariant.
//   dynamic: ranked per forward call over the rows of that call (LinearQ::rac_dynamic_count). S then depends
//     on which other tokens share the call: NOT batch-invariant (a sequence's log-probs change with
//     its batch), which is why it is only an option.
#include <cstdint>
#include <string>
#include <vector>

#include "model/linear.h"
#include "model/model.h"

namespace quads::model {

enum class RacGranularity : uint8_t { Channel, Block16 };

struct RacConfig {
  double ratio = 0.5;  // share of input channels compensated (see rac_count)
  RacGranularity granularity = RacGranularity::Block16;
  bool dynamic = false;
  OperandQuant residual = residual_format("nvfp4");

  // "nvfp4" (1x16, per-token global), "fp8" (E4M3, one scale per token) or "bf16"; throws otherwise.
  static OperandQuant residual_format(const std::string& name);
  static RacGranularity parse_granularity(const std::string& name);  // "block16" | "channel"
  std::string describe() const;
};

// How many channels a linear with `in` inputs compensates: ceil(ratio * in) rounded up to a
// multiple of 16 (the residual is quantized in whole 16-blocks), at most `in`; 0 when ratio <= 0.
int64_t rac_count(int64_t in, double ratio);

// energy[j] += sum over rows of (X - X_eff)[:, j]^2, in float64, rows in order.
void rac_energy(const float* X, const float* X_eff, int64_t M, int64_t in, double* energy);

// The `count` channels (count a multiple of 16 for Block16) with the largest energy, as sorted
// channel ids. Block16 ranks whole blocks by their summed energy. Ties go to the lower index, so
// the choice is a pure function of the energies.
std::vector<int32_t> rac_select(const double* energy, int64_t in, int64_t count, RacGranularity g);

// Y[M, out] (leading dimension ldy) += DQ(Q_q(R[:, S])) · W_eff[:, S]ᵀ with R = X - X_eff. Row-
// invariant (cpu::gemm_nt_rowinv), so a row's correction depends only on that row.
void rac_apply(const std::vector<int32_t>& S, const OperandQuant& q, const float* X, const float* X_eff, int64_t M,
               int64_t in, const float* W_eff, int64_t out, float* Y, int64_t ldy);

// The hook the linear forward calls after its GEMM (model.cpp): applies L.rac_channels with
// L.rac_quant, or with L.rac_dynamic_count > 0 ranks the channels on this call's own rows first
// (dynamic RAC). Nothing when RAC is off. W_eff is L's effective weight [out, in].
void rac_apply(const LinearQ& L, const float* X, const float* X_eff, int64_t M, const float* W_eff, float* Y,
               int64_t ldy);

// Sets up RAC on every linear whose activations are quantized (kind Quant) and clears it on the
// others. Static (the default): runs m.forward on `calib` with RAC off and a probe that sums each
// linear's residual energy, then gives every such linear its top rac_count(in, cfg.ratio) channels
// and cfg.residual; call it after every Model::sync of the rollout model. Dynamic: only marks the
// linears (rac_dynamic_count); `calib` is not used. Returns the number of linears with RAC.
int rac_calibrate(Model& m, const Batch& calib, const RacConfig& cfg);
// Static RAC's selection from measured energies: energy[i] (position i in m.linears(); empty for a
// linear without RAC) sums each input channel's residual energy over the calibration rows; every
// linear with energy gets its top rac_count(in, cfg.ratio) channels and cfg.residual, the others
// none. What rac_calibrate does after its forward; a GPU calibration pass feeds it too
// (rollout::RolloutEngine::calibrate_rac). Returns the number of linears with RAC.
int rac_assign(Model& m, const std::vector<std::vector<double>>& energy, const RacConfig& cfg);
void rac_clear(Model& m);

}  // namespace quads::model
