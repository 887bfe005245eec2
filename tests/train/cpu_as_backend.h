#pragma once
// The CPU model behind the train::TrainBackend interface (what a GPU trainer is to the RL loop, SFT
// and ReQAT's trainer), so their device paths can be checked without a GPU: a run through it must
// equal the CPU trainer's bit for bit.
#include <algorithm>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/weights.h"
#include "reqat/kv_quant.h"
#include "train/adamw.h"
#include "train/backend.h"

namespace quads::test {

// The CPU model behind the backend interface, with its own copy of the masters (as a GPU has), and
// optionally its own AdamW (as the GPU backend: has_optimizer()).
class CpuAsBackend : public train::TrainBackend {
 public:
  CpuAsBackend(const model::Weights& w, const model::PrecisionConfig& p, int* calls, bool optimizer)
      : w_(w), m_(w_, p), calls_(calls), optimizer_(optimizer), grads_(w.size()),
        opt_(w.size(), train::AdamWConfig{}, train::AdamW::decay_mask(w.layout)) {}
  std::string name() const override { return "cpu-as-backend"; }
  void forward(const model::Batch& b, float* logits, bool keep, model::Routing* record,
               const model::Routing* replay) override {
    model::ForwardOptions fo;
    fo.record = record;
    fo.replay = replay;
    m_.forward(b, logits, keep ? &acts_ : nullptr, fo);
    ++*calls_;
  }
  void backward(const float* dlogits, float* grads) override {
    if (grads) return m_.backward(acts_, dlogits, grads);
    std::fill(grads_.begin(), grads_.end(), 0.f);
    m_.backward(acts_, dlogits, grads_.data());
  }
  // The transform through the CPU hooks made from it (reqat::make_kv_hooks).
  void set_kv_transform(const model::KvTransform& t) override { m_.kv_hooks = reqat::make_kv_hooks(w_.cfg, t); }
  // Q-FIT's calibration through the host's code (reqat/kv_quant.h).
  void capture_attention(const model::Batch& b, train::AttentionInputs* out) override {
    *out = reqat::capture_attention_inputs(m_, b);
    ++*calls_;
  }
  std::vector<double> attention_mse(const train::AttentionInputs& in, int l, const std::vector<train::KvCandidate>& cands,
                                    const num::QConfig* kv) override {
    return reqat::attention_mse_cpu(w_.cfg, in, l, cands, kv);
  }
  void sync(const model::Weights& w) override {
    w_.data = w.data;
    m_.sync();
  }
  bool has_optimizer() const override { return optimizer_; }
  double optimizer_step(train::AdamW& host, double lr) override {
    opt_.cfg = host.cfg;
    opt_.t = host.t;
    const double norm = opt_.step(w_.data.data(), grads_.data(), lr);
    host.t = opt_.t;
    m_.sync();
    return norm;
  }
  void download(model::Weights& w, train::AdamW* host) override {
    w.data = w_.data;
    if (host) {
      host->m = opt_.m;
      host->v = opt_.v;
    }
  }
  void upload_optimizer(const train::AdamW& host) override {
    opt_.m = host.m;
    opt_.v = host.v;
    opt_.t = host.t;
  }
  // With its optimizer the masters "live on the device": a host buffer that rollout backends of
  // the tests take as "host-test" memory (test::CpuStepBackend::syncs_from).
  model::DeviceWeights device_masters() override {
    if (!optimizer_) return {};
    return {w_.data.data(), w_.data.size(), "host-test"};
  }

 private:
  model::Weights w_;
  model::Model m_;
  model::Activations acts_;
  int* calls_;
  bool optimizer_;
  std::vector<float> grads_;
  train::AdamW opt_;
};

}  // namespace quads::test
