#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include <fmt/format.h>

#include "common/error.h"
#include "numerics/quantize.h"

namespace quads::rollout {

const char* finish_name(Finish f) { return f == Finish::Stop ? "stop" : "length"; }

std::vector<int32_t> Result::ids() const {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), tokens.begin(), tokens.end());
  return all;
}

std::vector<Request> group_requests(const std::vector<std::vector<int32_t>>& prompts, int G, uint64_t base_seed,
                                    const Request& proto) {
  QUADS_CHECK(G >= 1, "group_requests: group size must be >= 1 (got {})", G);
  std::vector<Request> out;
  out.reserve(prompts.size() * G);
  for (size_t i = 0; i < prompts.size(); ++i)
    for (int g = 0; g < G; ++g) {
      Request r = proto;
      r.prompt = prompts[i];
      r.seed = base_seed + i * G + g;
      out.push_back(std::move(r));
    }
  return out;
}

RolloutEngine::RolloutEngine(const model::Weights& master, const model::PrecisionConfig& p, const EngineOptions& o)
    : RolloutEngine(model::Weights(master), p, o) {}

RolloutEngine::RolloutEngine(model::Weights&& weights, const model::PrecisionConfig& p, const EngineOptions& o)
    : options(o), weights_(std::make_unique<model::Weights>(std::move(weights))) {
  // Quantized when first used: an engine that steps on a backend may never need its CPU model.
  model_ = std::make_unique<model::Model>(*weights_, p, model::Model::Quantize::Later);
  model_stale_ = true;
  // Batch invariance rests on the row-invariant GEMMs (see the top of engine.h).
  model_->forward_gemm = model::GemmMode::RowInvariant;
}

void RolloutEngine::sync(const model::Weights& master) {
  const model::Layout& a = master.layout;
  const model::Layout& b = weights_->layout;
  QUADS_CHECK(a.params.size() == b.params.size(), "rollout sync: the master weights have {} tensors, the engine {}",
              a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i)
    QUADS_CHECK(a.params[i].name == b.params[i].name && a.params[i].shape == b.params[i].shape,
                "rollout sync: master tensor {} ({}) does not match the engine's {} ({})", a.params[i].name,
                fmt::join(a.params[i].shape, "x"), b.params[i].name, fmt::join(b.params[i].shape, "x"));
  sync(master.data.data(), master.data.size());
}

void RolloutEngine::sync(const float* master, size_t n) {
  QUADS_CHECK(n == weights_->data.size(), "rollout sync: {} floats given, the model has {}", n, weights_->data.size());
  std::memcpy(weights_->data.data(), master, n * sizeof(float));
  host_stale_ = false;
  if (backend_) {
    model_stale_ = true;
    backend_->sync(*weights_);
  } else {
    model_->sync();
    model_stale_ = false;
  }
}

bool RolloutEngine::sync_device(const model::DeviceWeights& master) {
  if (!backend_ || master.empty() || master.size != weights_->data.size() || !backend_->syncs_from(master)) return false;
  backend_->sync_device(master);
  host_stale_ = true;
  model_stale_ = true;
  return true;
}

namespace {

struct Seq {
  int req = -1;
  int slot = -1;
  int64_t fed = 0;         // prompt tokens already in the cache
  int32_t next = -1;       // the token to feed at the next step (after the prompt)
  std::vector<Seq> peers;  // same prompt, slots reserved: they copy this one's prefill
};

}  // namespace

std::vector<Result> RolloutEngine::generate(const std::vector<Request>& requests) {
  const auto t0 = std::chrono::steady_clock::now();
  const model::ModelConfig& cfg = weights_->cfg;
  const int64_t V = cfg.vocab_size;
  const int n = static_cast<int>(requests.size());
  QUADS_CHECK(options.max_batch >= 1, "rollout: max_batch must be >= 1 (got {})", options.max_batch);
  QUADS_CHECK(options.prefill_chunk >= 1, "rollout: prefill_chunk must be >= 1 (got {})", options.prefill_chunk);
  QUADS_CHECK(options.decode_ahead >= 1, "rollout: decode_ahead must be >= 1 (got {})", options.decode_ahead);
  stats_ = {};

  std::vector<Result> results(n);
  std::vector<int> todo;  // requests that need the model, in request order
  for (int i = 0; i < n; ++i) {
    const Request& r = requests[i];
    QUADS_CHECK(!r.prompt.empty(), "rollout: request {} has an empty prompt", i);
    for (size_t j = 0; j < r.prompt.size(); ++j)
      QUADS_CHECK(r.prompt[j] >= 0 && r.prompt[j] < V,
                  "rollout: request {}: prompt token {} at index {} is outside the vocabulary (0..{})", i, r.prompt[j],
                  j, V - 1);
    for (int32_t s : r.stop_ids)
      QUADS_CHECK(s >= 0 && s < V, "rollout: request {}: stop id {} is outside the vocabulary (0..{})", i, s, V - 1);
    QUADS_CHECK(r.max_new_tokens >= 0, "rollout: request {}: max_new_tokens must be >= 0 (got {})", i,
                r.max_new_tokens);
    r.sampling.validate(fmt::format("rollout: request {}", i));
    results[i].prompt = r.prompt;
    results[i].seed = r.seed;
    results[i].tokens.reserve(r.max_new_tokens);
    results[i].logprobs.reserve(r.max_new_tokens);
    if (r.max_new_tokens > 0) todo.push_back(i);
  }
  if (todo.empty()) return results;

  // Waiting requests with the same prompt, for prefill sharing.
  std::map<std::vector<int32_t>, std::vector<int>> same_prompt;
  if (options.share_prefill)
    for (int i : todo) same_prompt[requests[i].prompt].push_back(i);
  std::vector<uint8_t> admitted(n, 0);
  size_t next_todo = 0;

  const int nslots = std::min<int>(options.max_batch, static_cast<int>(todo.size()));
  // The CPU cache, or the backend's (sized for the longest request).
  model::KVCache cache(cfg, backend_ ? 1 : nslots);
  if (backend_) {
    QUADS_CHECK(model_->kv_hooks.empty() || backend_->has_kv_transform(),
                "rollout: the model has KV-cache hooks, which the step backend {} does not see: give it the same "
                "transform with StepBackend::set_kv_transform",
                backend_->name());
    int64_t max_len = 1;
    for (int i : todo)
      max_len = std::max<int64_t>(max_len, static_cast<int64_t>(requests[i].prompt.size()) + requests[i].max_new_tokens);
    backend_->reset(nslots, max_len);
  }
  auto copy_slot = [&](int src, int dst) { backend_ ? backend_->copy(src, dst) : cache.copy(src, dst); };
  auto clear_slot = [&](int slot) { backend_ ? backend_->clear(slot) : cache.clear(slot); };
  std::vector<int> free_slots;
  for (int s = nslots - 1; s >= 0; --s) free_slots.push_back(s);  // lowest slot first
  auto take_slot = [&] {
    const int s = free_slots.back();
    free_slots.pop_back();
    return s;
  };

  std::vector<Seq> live;
  std::vector<model::StepItem> items;
  std::vector<int> item_seq;  // index into live per item
  // A draw of this step: for sequence live[live] or for the peer joined[joined] (which copies
  // its leader's prefill after the step and draws from the leader's row), with its job.
  struct Job {
    int live;    // index into live, or -1
    int joined;  // index into joined, or -1
  };
  std::vector<Job> jobs;
  std::vector<SampleJob> sjobs;
  std::vector<Seq> joined;
  std::vector<Draw> draws;

  while (true) {
    // Admit waiting requests into free slots, with the peers that share their prompt.
    while (!free_slots.empty()) {
      while (next_todo < todo.size() && admitted[todo[next_todo]]) ++next_todo;
      if (next_todo == todo.size()) break;
      Seq s;
      s.req = todo[next_todo];
      s.slot = take_slot();
      admitted[s.req] = 1;
      if (options.share_prefill) {
        for (int m : same_prompt[requests[s.req].prompt]) {
          if (free_slots.empty()) break;
          if (admitted[m]) continue;
          Seq p;
          p.req = m;
          p.slot = take_slot();
          admitted[m] = 1;
          s.peers.push_back(std::move(p));
        }
      }
      live.push_back(std::move(s));
    }
    if (live.empty()) break;

    // One step: the next prompt chunk of sequences still prefilling, the last token of the others.
    items.clear();
    item_seq.clear();
    int64_t budget = options.max_step_tokens;
    bool any_prefill = false;
    for (size_t i = 0; i < live.size(); ++i) {
      Seq& s = live[i];
      const auto& prompt = requests[s.req].prompt;
      const int64_t plen = static_cast<int64_t>(prompt.size());
      model::StepItem it;
      it.slot = s.slot;
      if (s.fed < plen) {
        int64_t m = std::min(options.prefill_chunk, plen - s.fed);
        if (any_prefill) m = std::min(m, budget);
        if (m <= 0) continue;
        any_prefill = true;
        budget -= m;
        it.tokens.assign(prompt.begin() + s.fed, prompt.begin() + s.fed + m);
        stats_.prefill_tokens += m;
      } else {
        it.tokens.push_back(s.next);
        ++stats_.decode_tokens;
      }
      items.push_back(std::move(it));
      item_seq.push_back(static_cast<int>(i));
    }
    // Which sequences draw after this step: those whose prompt completes now (with the peers
    // sharing it, which copy the cache and draw from the same row) and every decoding sequence.
    // Known before the step, so that a backend can draw on its device.
    jobs.clear();
    sjobs.clear();
    auto add_job = [&](int req, int64_t row, int live_i, int joined_i) {
      const Request& r = requests[req];
      jobs.push_back({live_i, joined_i});
      sjobs.push_back({row, req, r.sampling, r.seed, r.prompt.size() + results[req].tokens.size()});
    };
    int n_joined = 0;
    for (size_t j = 0; j < items.size(); ++j) {
      const Seq& s = live[item_seq[j]];
      const int64_t plen = static_cast<int64_t>(requests[s.req].prompt.size());
      if (s.fed < plen) {
        if (s.fed + static_cast<int64_t>(items[j].tokens.size()) < plen) continue;
        for (const Seq& p : s.peers) add_job(p.req, static_cast<int64_t>(j), -1, n_joined++);
      }
      add_job(s.req, static_cast<int64_t>(j), item_seq[j], -1);
    }
    // Every sequence decodes: a run of steps in one backend call, as long as no sequence can end
    // by length inside it.
    int run = 1;
    if (backend_ && !any_prefill && options.decode_ahead > 1) {
      run = options.decode_ahead;
      for (const Seq& s : live)
        run = std::min(run, requests[s.req].max_new_tokens - static_cast<int>(results[s.req].tokens.size()));
      run = std::max(run, 1);
    }
    if (run > 1) {
      draws = backend_->decode_run(items, sjobs, run);
      stats_.steps += run;
      stats_.decode_tokens += static_cast<int64_t>(items.size()) * (run - 1);
      ++stats_.decode_runs;
      stats_.run_steps += run;
    } else if (backend_) {
      draws = backend_->step_sample(items, sjobs);
      ++stats_.steps;
    } else {
      cpu_model_current();
      const std::vector<float> logits = model_->step(cache, items);
      draws = sample_jobs(logits.data(), V, sjobs);
      ++stats_.steps;
    }

    // The prompts that completed: their peers copy the prefill and join.
    joined.clear();
    for (size_t j = 0; j < items.size(); ++j) {
      Seq& s = live[item_seq[j]];
      const int64_t plen = static_cast<int64_t>(requests[s.req].prompt.size());
      if (s.fed >= plen) continue;
      s.fed += static_cast<int64_t>(items[j].tokens.size());
      if (s.fed < plen) continue;
      for (Seq& p : s.peers) {
        copy_slot(s.slot, p.slot);
        p.fed = plen;
        ++stats_.shared_prompts;
        joined.push_back(std::move(p));
      }
      s.peers.clear();
    }

    const int njobs = static_cast<int>(jobs.size());
    for (int k = 0; k < run; ++k)
      for (int j = 0; j < njobs; ++j) {
        const Request& r = requests[sjobs[j].request];
        Result& res = results[sjobs[j].request];
        Seq& s = jobs[j].live >= 0 ? live[jobs[j].live] : joined[jobs[j].joined];
        const Draw& d = draws[static_cast<size_t>(k) * njobs + j];
        if (s.req < 0) {  // ended earlier in this run
          ++stats_.dropped;
          continue;
        }
        res.tokens.push_back(d.token);
        res.logprobs.push_back(d.logprob);
        ++stats_.generated;
        const bool stop = std::find(r.stop_ids.begin(), r.stop_ids.end(), d.token) != r.stop_ids.end();
        if (stop || static_cast<int>(res.tokens.size()) >= r.max_new_tokens) {
          res.finish = stop ? Finish::Stop : Finish::Length;
          clear_slot(s.slot);
          free_slots.push_back(s.slot);
          s.req = -1;  // finished
        } else {
          s.next = d.token;
        }
      }
    live.erase(std::remove_if(live.begin(), live.end(), [](const Seq& s) { return s.req < 0; }), live.end());
    for (Seq& p : joined)
      if (p.req >= 0) live.push_back(std::move(p));
    std::sort(free_slots.begin(), free_slots.end(), std::greater<int>());
  }
  stats_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return results;
}

std::vector<Draw> StepBackend::step_sample(const std::vector<model::StepItem>& items, const std::vector<SampleJob>& jobs) {
  const std::vector<float> logits = step(items);
  const int64_t V = items.empty() ? 0 : static_cast<int64_t>(logits.size() / items.size());
  return sample_jobs(logits.data(), V, jobs);
}

std::vector<Draw> StepBackend::decode_run(std::vector<model::StepItem> items, std::vector<SampleJob> jobs, int n) {
  check_decode_run(items, jobs, n, name());
  return decode_stepwise(std::move(items), std::move(jobs), n,
                         [&](const std::vector<model::StepItem>& it, const std::vector<SampleJob>& jb) {
                           return step_sample(it, jb);
                         });
}

std::vector<Draw> decode_stepwise(
    std::vector<model::StepItem> items, std::vector<SampleJob> jobs, int n,
    const std::function<std::vector<Draw>(const std::vector<model::StepItem>&, const std::vector<SampleJob>&)>& step) {
  std::vector<Draw> all;
  all.reserve(static_cast<size_t>(n) * items.size());
  for (int k = 0; k < n; ++k) {
    if (k > 0)
      for (size_t i = 0; i < items.size(); ++i) {
        items[i].tokens[0] = all[all.size() - items.size() + i].token;
        ++jobs[i].pos;
      }
    const std::vector<Draw> d = step(items, jobs);
    all.insert(all.end(), d.begin(), d.end());
  }
  return all;
}

void check_decode_run(const std::vector<model::StepItem>& items, const std::vector<SampleJob>& jobs, int n,
                      const std::string& who) {
  QUADS_CHECK(n >= 1, "{}: decode_run of {} steps", who, n);
  QUADS_CHECK(jobs.size() == items.size(), "{}: decode_run with {} items and {} jobs (one each)", who, items.size(),
              jobs.size());
  for (size_t i = 0; i < items.size(); ++i) {
    QUADS_CHECK(items[i].tokens.size() == 1 && !items[i].all_logits,
                "{}: decode_run item {} (slot {}) has {} tokens (one, last logits only)", who, i, items[i].slot,
                items[i].tokens.size());
    QUADS_CHECK(jobs[i].row == static_cast<int64_t>(i), "{}: decode_run job {} reads row {} (must be its item's)", who,
                i, jobs[i].row);
  }
}

std::vector<float> StepBackend::step_inspect(const std::vector<model::StepItem>&, Inspection&, bool) {
  fail("step backend {} does not inspect its steps (routing, activation error)", name());
}

std::vector<double> Inspection::act_qerr_layers(int layers) const {
  std::vector<double> sum(layers, 0.0), rows(layers, 0.0);
  for (const auto& [name, e] : act_error) {
    if (e.layer < 0 || e.layer >= layers || e.rows == 0) continue;
    const double rel = e.sq_norm > 0 ? e.sq_err / e.sq_norm : (e.sq_err > 0 ? HUGE_VAL : 0.0);
    if (!std::isfinite(rel)) continue;
    sum[e.layer] += rel * static_cast<double>(e.rows);
    rows[e.layer] += static_cast<double>(e.rows);
  }
  for (int l = 0; l < layers; ++l) sum[l] = rows[l] > 0 ? sum[l] / rows[l] : 0.0;
  return sum;
}

model::LinearProbe act_error_probe(std::map<std::string, ActError>& out) {
  return [&out](const model::LinearQ& L, const float* X, const float* Xq, const float*, int64_t M) {
    if (L.layer < 0 || X == Xq || M == 0) return;
    const num::ErrorStats e = num::error_stats(X, Xq, M, L.in);
    out[L.name].add(L.layer, e.sq_err, e.sq_norm, M);
  };
}

namespace {

// Whole sequences of `b` in steps of at most chunk_tokens tokens (a longer sequence alone), each
// chunk on a freshly reset cache: fn(items) runs one step; sequences without tokens are skipped.
void for_each_chunk(StepBackend& be, const model::Batch& b, int64_t chunk_tokens,
                    const std::function<void(const std::vector<model::StepItem>&)>& fn) {
  for (int s0 = 0; s0 < b.nseq();) {
    int s1 = s0 + 1;
    int64_t ntok = b.seq_len(s0), max_len = std::max<int64_t>(1, b.seq_len(s0));
    while (s1 < b.nseq() && ntok + b.seq_len(s1) <= chunk_tokens) {
      ntok += b.seq_len(s1);
      max_len = std::max(max_len, b.seq_len(s1));
      ++s1;
    }
    std::vector<model::StepItem> items;
    for (int s = s0; s < s1; ++s) {
      if (b.seq_len(s) == 0) continue;  // no tokens, nothing to measure
      model::StepItem it;
      it.slot = s - s0;
      it.tokens.assign(b.tokens.begin() + b.offsets[s], b.tokens.begin() + b.offsets[s + 1]);
      items.push_back(std::move(it));
    }
    if (!items.empty()) {
      be.reset(s1 - s0, max_len);
      fn(items);
    }
    s0 = s1;
  }
}

}  // namespace

Inspection RolloutEngine::inspect(const model::Batch& b, bool act_error, int64_t chunk_tokens) {
  const model::ModelConfig& cfg = config();
  Inspection out;
  if (!backend_ || !backend_->inspects(act_error)) {
    std::vector<float> logits(size_t(b.ntokens()) * cfg.vocab_size);
    model::ForwardOptions fo;
    fo.record = &out.routing;
    if (act_error) fo.probe = act_error_probe(out.act_error);
    model().forward(b, logits.data(), nullptr, fo);
    return out;
  }
  out.routing.experts.assign(cfg.num_hidden_layers, {});
  for_each_chunk(*backend_, b, chunk_tokens, [&](const std::vector<model::StepItem>& items) {
    Inspection part;
    backend_->step_inspect(items, part, act_error);
    QUADS_CHECK(static_cast<int>(part.routing.experts.size()) == cfg.num_hidden_layers,
                "step backend {} recorded {} layers of routing, the model has {}", backend_->name(),
                part.routing.experts.size(), cfg.num_hidden_layers);
    for (int l = 0; l < cfg.num_hidden_layers; ++l)
      out.routing.experts[l].insert(out.routing.experts[l].end(), part.routing.experts[l].begin(),
                                    part.routing.experts[l].end());
    for (const auto& [name, e] : part.act_error) out.act_error[name].add(e.layer, e.sq_err, e.sq_norm, e.rows);
  });
  return out;
}

int RolloutEngine::calibrate_rac(const model::Batch& calib, const model::RacConfig& cfg, int64_t chunk_tokens) {
  if (!backend_ || !backend_->calibrates_rac() || cfg.dynamic || cfg.ratio <= 0) {
    const int n = model::rac_calibrate(model(), calib, cfg);
    if (backend_) backend_->set_rac(*model_);
    return n;
  }
  // The CPU model's linears carry the selection (names, widths, numerics: no weights needed, so
  // its re-quantization stays deferred); the backend runs the pass with RAC off.
  model::rac_clear(*model_);
  backend_->set_rac(*model_);
  std::map<std::string, std::vector<double>> by_name;
  for_each_chunk(*backend_, calib, chunk_tokens,
                 [&](const std::vector<model::StepItem>& items) { backend_->step_rac_energy(items, by_name); });
  const std::vector<model::LinearQ>& lin = model_->linears();
  std::vector<std::vector<double>> energy(lin.size());
  for (size_t i = 0; i < lin.size(); ++i) {
    if (lin[i].num.act.kind != model::QuantKind::Quant) continue;
    auto it = by_name.find(lin[i].name);
    // A linear the pass never reached (an expert no calibration token chose) has zero energy, as
    // on the CPU.
    energy[i] = it != by_name.end() ? std::move(it->second) : std::vector<double>(lin[i].in, 0.0);
    QUADS_CHECK(static_cast<int64_t>(energy[i].size()) == lin[i].in,
                "step backend {} measured {} channels of RAC energy for {}, it has {} inputs", backend_->name(),
                energy[i].size(), lin[i].name, lin[i].in);
  }
  const int n = model::rac_assign(*model_, energy, cfg);
  backend_->set_rac(*model_);
  return n;
}

void StepBackend::step_rac_energy(const std::vector<model::StepItem>&, std::map<std::string, std::vector<double>>&) {
  fail("step backend {} does not calibrate RAC", name());
}
void StepBackend::sync_device(const model::DeviceWeights& w) {
  fail("step backend {} cannot sync from {} memory", name(), w.device.empty() ? "(no)" : w.device);
}
void StepBackend::download(model::Weights&) const { fail("step backend {} cannot give its weights back", name()); }

void StepBackend::set_rac(const model::Model&) { fail("step backend {} does not run RAC", name()); }
void StepBackend::set_kv_transform(const model::KvTransform& t) {
  QUADS_CHECK(t.empty(), "step backend {} does not run a KV-cache transform (ReQAT's KV4 / Q-FIT)", name());
}

}  // namespace quads::rollout
