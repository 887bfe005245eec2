#pragma once
// The CPU model behind the rollout::StepBackend interface (what the GPU model is to the rollout
// engine and the RL loop), so their backend paths can be checked without a GPU: a run through it
// must equal the engine's own bit for bit. It counts its calls and checks that the engine sizes its
// cache (reset) for every step it is given.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/rac.h"
#include "model/weights.h"
#include "rollout/engine.h"

namespace quads::test {

struct StepCalls {
  int resets = 0, steps = 0, copies = 0, clears = 0, syncs = 0, records = 0;
  int energy_steps = 0, device_syncs = 0, downloads = 0, rac_sets = 0;
  int slots = 0;
  int64_t max_len = 0, max_seen = 0;
};

// The CPU model behind the backend interface, with a cache that refuses to grow past max_len.
class CpuStepBackend : public rollout::StepBackend {
 public:
  CpuStepBackend(const model::Weights& w, const model::PrecisionConfig& p, StepCalls* calls)
      : w_(w), m_(w_, p), calls_(calls) {}
  std::string name() const override { return "cpu-test"; }
  void sync(const model::Weights& w) override {
    w_.data = w.data;
    m_.sync();
    ++calls_->syncs;
  }
  void reset(int num_slots, int64_t max_len) override {
    cache_ = std::make_unique<model::KVCache>(w_.cfg, num_slots);
    calls_->slots = num_slots;
    calls_->max_len = max_len;
    ++calls_->resets;
  }
  std::vector<float> step(const std::vector<model::StepItem>& items) override {
    ++calls_->steps;
    check_room(items);
    return m_.step(*cache_, items);
  }
  // Routing through Model::step's record; with act_error a forward of the items' sequences with the
  // engine's CPU probe (the engine inspects whole sequences from empty slots).
  bool inspects(bool act_error) const override { return can_record && (!act_error || can_probe); }
  std::vector<float> step_inspect(const std::vector<model::StepItem>& items, rollout::Inspection& out,
                                  bool act_error) override {
    ++calls_->records;
    check_room(items);
    if (!act_error) return m_.step(*cache_, items, &out.routing);
    model::Batch b;
    for (const auto& it : items) {
      EXPECT_EQ(cache_->length(it.slot), 0) << "inspected items start from empty slots";
      b.add(it.tokens);
    }
    std::vector<float> logits(size_t(b.ntokens()) * w_.cfg.vocab_size);
    model::ForwardOptions fo;
    fo.record = &out.routing;
    fo.probe = rollout::act_error_probe(out.act_error);
    m_.forward(b, logits.data(), nullptr, fo);
    std::vector<float> last;
    for (int s = 0; s < b.nseq(); ++s)
      last.insert(last.end(), logits.begin() + (b.offsets[s + 1] - 1) * w_.cfg.vocab_size,
                  logits.begin() + b.offsets[s + 1] * w_.cfg.vocab_size);
    return last;
  }
  bool can_record = true, can_probe = true;
  // Static RAC: channels copied by name from the calibrated model; the calibration pass is a
  // forward of the items' sequences with a probe that adds model::rac_energy (RAC must be off).
  void set_rac(const model::Model& calibrated) override {
    for (const model::LinearQ& src : calibrated.linears()) {
      model::LinearQ* dst = nullptr;
      for (model::LinearQ& L : m_.linears())
        if (L.name == src.name) dst = &L;
      EXPECT_NE(dst, nullptr) << src.name;
      if (!dst) continue;
      dst->rac_channels = src.rac_channels;
      dst->rac_quant = src.rac_quant;
    }
    ++calls_->rac_sets;
  }
  bool can_calibrate = true;
  bool calibrates_rac() const override { return can_calibrate; }
  void step_rac_energy(const std::vector<model::StepItem>& items,
                       std::map<std::string, std::vector<double>>& energy) override {
    ++calls_->energy_steps;
    check_room(items);
    for (const model::LinearQ& L : m_.linears()) EXPECT_TRUE(L.rac_channels.empty()) << "RAC on in the pass: " << L.name;
    model::Batch b;
    for (const auto& it : items) b.add(it.tokens);
    std::vector<float> logits(size_t(b.ntokens()) * w_.cfg.vocab_size);
    model::ForwardOptions fo;
    fo.probe = [&](const model::LinearQ& L, const float* X, const float* X_eff, const float*, int64_t M) {
      if (L.num.act.kind != model::QuantKind::Quant) return;
      std::vector<double>& e = energy[L.name];
      if (e.empty()) e.assign(L.in, 0.0);
      model::rac_energy(X, X_eff, M, L.in, e.data());
    };
    m_.forward(b, logits.data(), nullptr, fo);
  }
  // "Device memory" here is a host buffer that the test names "host-test".
  bool syncs_from(const model::DeviceWeights& w) const override { return !w.empty() && w.device == "host-test"; }
  void sync_device(const model::DeviceWeights& w) override {
    EXPECT_EQ(w.size, w_.data.size());
    std::copy(w.data, w.data + w.size, w_.data.begin());
    m_.sync();
    ++calls_->device_syncs;
  }
  void download(model::Weights& w) const override {
    w.data = w_.data;
    ++calls_->downloads;
  }
  void copy(int src, int dst) override {
    cache_->copy(src, dst);
    ++calls_->copies;
  }
  void clear(int slot) override {
    cache_->clear(slot);
    ++calls_->clears;
  }

 private:
  model::Weights w_;
  model::Model m_;
  StepCalls* calls_;
  std::unique_ptr<model::KVCache> cache_;

  void check_room(const std::vector<model::StepItem>& items) {
    for (const auto& it : items) {
      const int64_t len = cache_->length(it.slot) + static_cast<int64_t>(it.tokens.size());
      EXPECT_LE(len, calls_->max_len) << "the engine sized the cache too small";
      calls_->max_seen = std::max(calls_->max_seen, len);
    }
  }
};

}  // namespace quads::test
