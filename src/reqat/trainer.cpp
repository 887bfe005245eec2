#include "reqat/trainer.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "common/error.h"
#include "common/progress.h"
#include "rollout/engine.h"
#include "rl/run.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/losses.h"

namespace quads::reqat {

double lr_at(const TrainSpec& s, int64_t step) {
  if (s.warmup > 0 && step < s.warmup) return s.lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  const int64_t span = std::max<int64_t>(1, s.steps - s.warmup);
  const double p = std::min(1.0, static_cast<double>(step - s.warmup) / static_cast<double>(span));
  const double c = 0.5 * (1.0 + std::cos(M_PI * p));
  return s.lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * c);
}

namespace {

// The packed batch of examples [first, first + n) (cyclic) and its next-token targets, -1 where
// the next token is not a response token.
struct MicroBatch {
  model::Batch b;
  std::vector<int32_t> targets;
  std::vector<uint8_t> rows;  // 1 where a target counts
  int64_t count = 0;
};

MicroBatch make_batch(const std::vector<rl::SftExample>& data, int64_t first, int64_t n) {
  MicroBatch mb;
  std::vector<const rl::SftExample*> ex;
  for (int64_t i = 0; i < n; ++i) {
    const rl::SftExample& e = data[static_cast<size_t>((first + i) % static_cast<int64_t>(data.size()))];
    mb.b.add(e.tokens);
    ex.push_back(&e);
  }
  mb.targets = train::next_token_targets(mb.b);
  mb.rows.assign(mb.targets.size(), 0);
  for (int s = 0; s < mb.b.nseq(); ++s) {
    const int64_t r0 = mb.b.offsets[s];
    for (int64_t t = 0; t < mb.b.seq_len(s); ++t) {
      const int64_t r = r0 + t;
      if (mb.targets[r] >= 0 && ex[s]->loss_mask[t + 1]) {
        mb.rows[r] = 1;
        ++mb.count;
      } else {
        mb.targets[r] = -1;
      }
    }
  }
  return mb;
}

}  // namespace

std::vector<TrainStepLog> train_sft(model::Model& m, const std::vector<rl::SftExample>& data, const TrainSpec& spec,
                                    std::string* device) {
  QUADS_CHECK(!data.empty(), "{}: no training examples", spec.label);
  QUADS_CHECK(spec.batch > 0 && spec.steps >= 0, "{}: batch {} / steps {} out of range", spec.label, spec.batch,
              spec.steps);
  QUADS_CHECK(spec.device == "cpu" || spec.device == "cuda", "{}: device \"{}\" (cpu | cuda)", spec.label, spec.device);
  model::Weights& w = m.weights();
  const int64_t V = m.config().vocab_size;
  train::AdamWConfig oc;
  oc.lr = spec.lr;
  oc.weight_decay = spec.weight_decay;
  oc.max_grad_norm = spec.grad_clip;
  train::AdamW opt(w.size(), oc, train::AdamW::decay_mask(w.layout));
  std::unique_ptr<train::TrainBackend> gpu;
  if (spec.device == "cuda") {
    QUADS_CHECK(m.kv_hooks.empty() == spec.kv.empty(),
                "{}: the model {} KV-cache hooks but the spec {} KV transform (the GPU trainer runs the transform, "
                "not the hooks: give both or neither)",
                spec.label, m.kv_hooks.empty() ? "has no" : "has", spec.kv.empty() ? "no" : "a");
    gpu = train::gpu_train_backend_factory()(w, m.precision());
    gpu->set_kv_transform(spec.kv);
  }
  if (device) *device = gpu ? gpu->name() : "cpu";
  // AdamW where the masters are: the backend's own (the GPU trainer), else the host's on gradients
  // the backend adds into `grads`, the new masters synced to it after each step.
  const bool dev_opt = gpu && gpu->has_optimizer();
  std::vector<float> grads(dev_opt ? 0 : w.size());
  std::vector<float> logits, dlogits, H;
  model::Activations acts;
  std::vector<TrainStepLog> log;
  std::unique_ptr<ProgressBar> bar;
  if (spec.progress) bar = std::make_unique<ProgressBar>(spec.steps, spec.label);
  for (int64_t s = 0; s < spec.steps; ++s) {
    const MicroBatch mb = make_batch(data, s * spec.batch, spec.batch);
    const int64_t T = mb.b.ntokens();
    logits.resize(T * V);
    dlogits.assign(T * V, 0.f);
    if (gpu) gpu->forward(mb.b, logits.data(), true);
    else m.forward(mb.b, logits.data(), &acts);
    TrainStepLog L;
    L.step = s;
    L.ce = train::cross_entropy(logits.data(), T, V, mb.targets.data(), nullptr, dlogits.data());
    if (spec.sem) {
      const SemStats st = sem_loss(logits.data(), T, V, mb.rows.data(), spec.sem_cfg, static_cast<double>(mb.count),
                                   dlogits.data());
      L.sem = st.loss;
      L.mean_entropy = st.mean_entropy;
    } else {
      H.resize(T);
      train::entropy(logits.data(), T, V, H.data());
      double hs = 0;
      for (int64_t t = 0; t < T; ++t)
        if (mb.rows[t]) hs += H[t];
      L.mean_entropy = mb.count ? hs / static_cast<double>(mb.count) : 0;
    }
    L.loss = L.ce + L.sem;
    L.lr = lr_at(spec, s);
    if (dev_opt) {
      gpu->backward(dlogits.data(), nullptr);
      L.grad_norm = gpu->optimizer_step(opt, L.lr);
    } else if (gpu) {
      std::fill(grads.begin(), grads.end(), 0.f);
      gpu->backward(dlogits.data(), grads.data());
      L.grad_norm = opt.step(w.data.data(), grads.data(), L.lr);
      gpu->sync(w);
    } else {
      std::fill(grads.begin(), grads.end(), 0.f);
      m.backward(acts, dlogits.data(), grads.data());
      L.grad_norm = opt.step(w.data.data(), grads.data(), L.lr);
      m.sync();
    }
    QUADS_CHECK(std::isfinite(L.loss) && std::isfinite(L.grad_norm), "{}: loss {} / gradient norm {} at step {}",
                spec.label, L.loss, L.grad_norm, s);
    log.push_back(L);
    if (bar) bar->update(s + 1, {{"loss", L.loss}, {"H", L.mean_entropy}, {"lr", L.lr}});
  }
  if (bar) bar->finish();
  if (dev_opt) gpu->download(w, nullptr);
  if (gpu) m.sync();
  return log;
}

double eval_loss(model::Model& m, const std::vector<rl::SftExample>& data, int64_t batch) {
  const int64_t V = m.config().vocab_size;
  double sum = 0;
  int64_t count = 0;
  std::vector<float> logits;
  for (int64_t first = 0; first < static_cast<int64_t>(data.size()); first += batch) {
    const int64_t n = std::min<int64_t>(batch, static_cast<int64_t>(data.size()) - first);
    const MicroBatch mb = make_batch(data, first, n);
    logits.resize(mb.b.ntokens() * V);
    m.forward(mb.b, logits.data());
    sum += train::cross_entropy(logits.data(), mb.b.ntokens(), V, mb.targets.data(), nullptr, nullptr) *
           static_cast<double>(mb.count);
    count += mb.count;
  }
  return count ? sum / static_cast<double>(count) : 0.0;
}

std::string InferSpec::describe() const {
  std::string s = precision;
  s += kv.enabled ? " + " + kv.describe() : " + kv fp32";
  if (qfit && !qfit->empty()) s += " + Q-FIT";
  return s;
}

EvalResult evaluate(const model::Weights& w, const InferSpec& spec, const std::vector<rl::Task>& tasks,
                    const rl::CharTokenizer& tok, int max_new_tokens, int max_batch) {
  rollout::EngineOptions eo;
  eo.max_batch = max_batch;
  rollout::RolloutEngine eng(w, model::PrecisionConfig::preset(spec.precision), eo);
  if (spec.kv.enabled || (spec.qfit && !spec.qfit->empty())) install_kv_hooks(eng.model(), spec.kv, spec.qfit);
  if (spec.device == "cuda") {
    eng.set_backend(rl::rollout_backend_factory()(w, eng.precision()));
    eng.backend()->set_kv_transform(make_kv_transform(w.cfg, spec.kv, spec.qfit));
  }
  std::vector<rollout::Request> reqs;
  reqs.reserve(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    rollout::Request r;
    r.prompt = tok.encode_prompt(tasks[i].prompt);
    r.max_new_tokens = max_new_tokens;
    r.stop_ids = {tok.eos_id()};
    r.sampling.greedy = true;
    r.seed = i;
    reqs.push_back(std::move(r));
  }
  const std::vector<rollout::Result> res = eng.generate(reqs);
  EvalResult out;
  for (size_t i = 0; i < tasks.size(); ++i) {
    out.verdicts.push_back(rl::verify_ids(tasks[i], res[i].tokens, tok));
    out.responses.push_back(res[i].tokens);
  }
  out.score = rl::score(tasks, out.verdicts);
  if (eng.backend()) out.device = eng.backend()->name();
  return out;
}

model::ModelConfig task_model_config(int64_t hidden, int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t experts, int64_t experts_per_token, int64_t moe_intermediate,
                                     int64_t max_seq_len, double rope_theta, double rms_eps, int vocab) {
  model::ModelConfig c;
  c.vocab_size = vocab;
  c.hidden_size = static_cast<int>(hidden);
  c.intermediate_size = static_cast<int>(2 * moe_intermediate);
  c.moe_intermediate_size = static_cast<int>(moe_intermediate);
  c.num_hidden_layers = static_cast<int>(layers);
  c.num_attention_heads = static_cast<int>(heads);
  c.num_key_value_heads = static_cast<int>(kv_heads);
  c.head_dim = static_cast<int>(head_dim);
  c.num_experts = static_cast<int>(experts);
  c.num_experts_per_tok = static_cast<int>(experts_per_token);
  c.norm_topk_prob = true;
  c.rope_theta = rope_theta;
  c.rms_norm_eps = rms_eps;
  c.max_position_embeddings = static_cast<int>(max_seq_len);
  c.validate("reqat [model]");
  return c;
}

}  // namespace quads::reqat
