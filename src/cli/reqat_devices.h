#pragma once
// The devices of `quads reqat` and `quads reqat-tokens`: --device sets both of the config's
// (train_device: training, Q-FIT, the low-entropy analysis; eval.device: the evaluation rollouts),
// the CUDA backends are installed where the build has them, and a device that cannot run is an
// error before any work.
#include <string>
#include <vector>

#include "common/error.h"
#include "reqat/config.h"
#include "rl/run.h"
#include "train/backend.h"

namespace quads::cli {

inline std::vector<std::string> with_device(std::vector<std::string> sets, const std::string& device) {
  if (!device.empty()) {
    sets.push_back("eval.device=\"" + device + "\"");
    sets.push_back("train_device=\"" + device + "\"");
  }
  return sets;
}

inline void install_reqat_devices(const reqat::ReqatConfig& cfg, const std::string& cmd) {
#ifdef QUADS_HAVE_CUDA
  rl::install_cuda_rollouts();
#endif
  if (cfg.eval.device == "cuda") {
    try {
      (void)rl::rollout_backend_factory();
    } catch (const Error&) {
      fail("{}: eval.device = \"cuda\" (--device cuda), but this build has no CUDA backend (configure with "
           "-DQUADS_CUDA=ON, or use the cpu)",
           cmd);
    }
  }
  if (cfg.train_device == "cuda") {
    try {
      (void)train::gpu_train_backend_factory();
    } catch (const Error&) {
      fail("{}: train_device = \"cuda\" (--device cuda), but this build has no CUDA trainer (configure with "
           "-DQUADS_CUDA=ON, or use the cpu)",
           cmd);
    }
  }
}

// After install_reqat_devices (and after --print-config, which needs no device): a CUDA device must
// be there. Here rather than in the backends' factories, whose errors name the RL settings.
inline void check_reqat_devices(const reqat::ReqatConfig& cfg, const std::string& cmd) {
#ifdef QUADS_HAVE_CUDA
  if ((cfg.eval.device == "cuda" || cfg.train_device == "cuda") && cuda::device_count() == 0)
    fail("{}: train_device = \"{}\", eval.device = \"{}\" (--device), but no CUDA device was found (use the cpu)", cmd,
         cfg.train_device, cfg.eval.device);
#else
  (void)cfg;
  (void)cmd;
#endif
}

}  // namespace quads::cli
