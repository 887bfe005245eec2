#include "train/backend.h"

#include <mutex>

#include "common/error.h"

namespace quads::train {

namespace {
std::mutex g_mu;
TrainBackendFactory g_factory;
}  // namespace

void check_attention_inputs(const model::ModelConfig& c, const AttentionInputs& in, int l,
                            const std::vector<KvCandidate>& cands, const std::string& who) {
  QUADS_CHECK(l >= 0 && l < static_cast<int>(in.q.size()) && in.k.size() == in.q.size() && in.v.size() == in.q.size(),
              "{}: layer {} not in the attention inputs ({} layers)", who, l, in.q.size());
  QUADS_CHECK(!in.offsets.empty() && in.offsets.front() == 0 && in.offsets.back() == in.T,
              "{}: the attention inputs' sequence offsets do not cover their {} tokens", who, in.T);
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  QUADS_CHECK(static_cast<int64_t>(in.q[l].size()) == in.T * qd && static_cast<int64_t>(in.k[l].size()) == in.T * kvd &&
                  static_cast<int64_t>(in.v[l].size()) == in.T * kvd,
              "{}: layer {} holds q/k/v of {}/{}/{} floats, {} tokens need {}/{}/{}", who, l, in.q[l].size(),
              in.k[l].size(), in.v[l].size(), in.T, in.T * qd, in.T * kvd, in.T * kvd);
  for (const KvCandidate& k : cands)
    QUADS_CHECK((k.factor.empty() || static_cast<int64_t>(k.factor.size()) == kvd) &&
                    (k.shift.empty() || static_cast<int64_t>(k.shift.size()) == kvd),
                "{}: a candidate's factor / shift has {} / {} values, kv_dim is {}", who, k.factor.size(),
                k.shift.size(), kvd);
}

void TrainBackend::set_kv_transform(const model::KvTransform& t) {
  QUADS_CHECK(t.empty(), "train backend {} has no KV-cache transform (ReQAT's KV quantization / Q-FIT): train on the "
                         "cpu or on cuda",
              name());
}

void TrainBackend::capture_attention(const model::Batch&, AttentionInputs*) {
  fail("train backend {} cannot capture attention inputs (Q-FIT's calibration): calibrate on the cpu or on cuda",
       name());
}

std::vector<double> TrainBackend::attention_mse(const AttentionInputs&, int, const std::vector<KvCandidate>&,
                                                const num::QConfig*) {
  fail("train backend {} has no attention error (Q-FIT's calibration): calibrate on the cpu or on cuda", name());
}

void TrainBackend::set_router_losses(double aux_loss_coef, double z_loss_coef) {
  QUADS_CHECK(aux_loss_coef == 0 && z_loss_coef == 0,
              "train backend {} has no router aux / z losses (coefficients {} and {}): train on the cpu or on cuda",
              name(), aux_loss_coef, z_loss_coef);
}

double TrainBackend::optimizer_step(AdamW&, double) { fail("train backend {} has no optimizer", name()); }
void TrainBackend::download(model::Weights&, AdamW*) { fail("train backend {} keeps no masters", name()); }
void TrainBackend::upload_optimizer(const AdamW&) { fail("train backend {} has no optimizer", name()); }

void register_gpu_train_backend(TrainBackendFactory f) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_factory = std::move(f);
}

TrainBackendFactory gpu_train_backend_factory() {
  TrainBackendFactory f;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    f = g_factory;
  }
  QUADS_CHECK(f != nullptr,
              "device = \"cuda\": this build has no CUDA trainer (configure with -DQUADS_CUDA=ON, or set the "
              "device to \"cpu\")");
  return f;
}

}  // namespace quads::train
