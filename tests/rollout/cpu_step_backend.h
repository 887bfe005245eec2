#pragma once
// The CPU model behind the rollout::StepBackend interface (what the GPU model is to the rollout
// engine and the RL loop), so their backend paths can be checked without a GPU: a run through it
// must equal the engine's own bit for bit. It counts its calls and checks that the engine sizes its
// cache (reset) for every step it is given.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/weights.h"
#include "rollout/engine.h"

namespace quads::test {

struct StepCalls {
  int resets = 0, steps = 0, copies = 0, clears = 0, syncs = 0, records = 0;
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
  bool records_routing() const override { return can_record; }
  std::vector<float> step_record(const std::vector<model::StepItem>& items, model::Routing& record) override {
    ++calls_->records;
    check_room(items);
    return m_.step(*cache_, items, &record);
  }
  bool can_record = true;
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
