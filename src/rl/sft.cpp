#include "rl/sft.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/progress.h"
#include "model/model.h"
#include "rl/policy.h"
#include "rl/report.h"
#include "rl/run.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/losses.h"

namespace quads::rl {

namespace {

// The settings that determine the base weights.
nlohmann::json sft_key(const RunConfig& cfg) {
  nlohmann::json j = to_json(cfg);
  nlohmann::json key = {{"model", j["model"]}, {"sft", j["sft"]}, {"tasks", j["tasks"]}};
  // GPU training rounds differently (BF16-free but other summation orders): another base.
  if (cfg.rl.trainer_device() == "cuda") key["device"] = "cuda";
  return key;
}

double lr_at(const SftSection& s, int64_t step) {
  if (s.warmup_steps > 0 && step < s.warmup_steps) return s.lr * static_cast<double>(step + 1) / s.warmup_steps;
  const double span = std::max<int64_t>(1, s.steps - s.warmup_steps);
  const double p = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  return s.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * p)));
}

}  // namespace

SftResult run_sft(const RunConfig& cfg, const std::string& dir, bool progress) {
  const auto t0 = std::chrono::steady_clock::now();
  std::filesystem::create_directories(dir);
  TaskSet tasks(cfg.task_mix(), static_cast<uint64_t>(cfg.tasks.seed), static_cast<int>(cfg.rl.eval_size));
  CharTokenizer tok;
  model::ModelConfig mc = model_config(cfg.model, tok);
  model::Weights w = model::Weights::random(mc, static_cast<uint64_t>(cfg.tasks.seed) * 7919u + 17u,
                                            static_cast<float>(cfg.model.init_std));
  model::Model m(w, model::PrecisionConfig::preset("fp32"));
  train::AdamWConfig ac;
  ac.lr = cfg.sft.lr;
  ac.beta2 = 0.99;
  ac.weight_decay = cfg.sft.weight_decay;
  ac.max_grad_norm = cfg.sft.grad_clip;
  train::AdamW opt(w.size(), ac, train::AdamW::decay_mask(w.layout));
  // rl.train_device = "cuda": forward and backward on the GPU, AdamW here (as the RL loop).
  std::unique_ptr<train::TrainBackend> gpu;
  if (cfg.rl.trainer_device() == "cuda") gpu = train::gpu_train_backend_factory()(w, model::PrecisionConfig::preset("fp32"));

  const int64_t V = mc.vocab_size, B = cfg.sft.batch, steps = cfg.sft.steps;
  std::vector<float> logits, dlogits, grads(w.size());
  model::Activations acts;
  double tail_loss = 0;
  int64_t tail_n = 0;
  std::optional<ProgressBar> bar;
  if (progress) bar.emplace(steps, "sft");
  for (int64_t step = 0; step < steps; ++step) {
    model::Batch b;
    std::vector<float> weight;
    for (const Task& t : tasks.train_batch(static_cast<uint64_t>(step * B), static_cast<int>(B))) {
      SftExample ex = make_sft_example(t, tok);
      QUADS_CHECK(static_cast<int64_t>(ex.tokens.size()) <= cfg.model.max_seq_len,
                  "sft: a task needs {} tokens, model.max_seq_len is {} (prompt: {})", ex.tokens.size(),
                  cfg.model.max_seq_len, t.prompt.substr(0, t.prompt.size() - 1));
      b.add(ex.tokens);
      // Row i predicts token i+1: it counts when that token is a solution token.
      for (size_t i = 0; i < ex.tokens.size(); ++i)
        weight.push_back(i + 1 < ex.tokens.size() && ex.loss_mask[i + 1] ? 1.f : 0.f);
    }
    const int64_t T = b.ntokens();
    std::vector<int32_t> targets = train::next_token_targets(b);
    logits.resize(T * V);
    dlogits.resize(T * V);
    if (gpu) gpu->forward(b, logits.data(), true);
    else m.forward(b, logits.data(), &acts);
    const double loss = train::cross_entropy(logits.data(), T, V, targets.data(), weight.data(), dlogits.data());
    QUADS_CHECK(std::isfinite(loss), "sft: the loss is {} at step {}", loss, step);
    double gnorm = 0;
    if (gpu && gpu->has_optimizer()) {  // AdamW where the masters are
      gpu->backward(dlogits.data(), nullptr);
      gnorm = gpu->optimizer_step(opt, lr_at(cfg.sft, step));
    } else {
      std::fill(grads.begin(), grads.end(), 0.f);
      if (gpu) gpu->backward(dlogits.data(), grads.data());
      else m.backward(acts, dlogits.data(), grads.data());
      gnorm = opt.step(w.data.data(), grads.data(), lr_at(cfg.sft, step));
      if (gpu) gpu->sync(w);
      else m.sync();
    }
    QUADS_CHECK(std::isfinite(gnorm), "sft: the gradient norm is {} at step {}", gnorm, step);
    if (step >= steps - std::max<int64_t>(1, steps / 10)) {
      tail_loss += loss;
      ++tail_n;
    }
    if (bar) bar->update(step + 1, {{"loss", loss}, {"lr", lr_at(cfg.sft, step)}});
  }
  if (bar) bar->finish();
  if (gpu && gpu->has_optimizer()) gpu->download(w, nullptr);

  SftResult r;
  r.final_loss = tail_n ? tail_loss / tail_n : std::nan("");
  save_base(dir, w, tok);
  rollout::RolloutEngine eng(w, model::PrecisionConfig::preset("fp32"));
  if (cfg.rl.device == "cuda") eng.set_backend(rollout_backend_factory()(w, eng.precision()));
  EvalResult ev = evaluate(eng, tasks.eval_set(), tok, cfg.rl.max_new_tokens, 0.0);
  r.pass1 = ev.score.pass1;
  for (size_t i = 0; i < ev.responses.size() && i < 8; ++i) {
    const Task& t = tasks.eval_set()[i];
    r.samples.push_back(fmt::format("{} -> {} [{}]", t.prompt.substr(0, t.prompt.size() - 1), ev.responses[i],
                                    outcome_name(ev.outcomes[i])));
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json meta = {{"config", sft_key(cfg)},
                         {"final_loss", r.final_loss},
                         {"pass1_fp32", r.pass1},
                         {"seconds", r.seconds}};
  nlohmann::json fam = nlohmann::json::object();
  for (int f = 0; f < kNumFamilies; ++f)
    if (ev.score.family_count[f] > 0) fam[family_name(static_cast<Family>(f))] = ev.score.family_pass1[f];
  meta["pass1_by_family"] = fam;
  meta["samples"] = r.samples;
  write_text_atomic(dir + "/sft.json", meta.dump(2) + "\n");
  return r;
}

SftResult ensure_base(const RunConfig& cfg, const std::string& dir, bool progress) {
  const std::string meta_path = dir + "/sft.json";
  if (std::filesystem::exists(meta_path) && std::filesystem::exists(dir + "/model.safetensors")) {
    std::ifstream f(meta_path);
    std::stringstream ss;
    ss << f.rdbuf();
    nlohmann::json meta = nlohmann::json::parse(ss.str(), nullptr, false);
    if (!meta.is_discarded() && meta.contains("config") && meta["config"] == sft_key(cfg)) {
      SftResult r;
      r.final_loss = meta.value("final_loss", 0.0);
      r.pass1 = meta.value("pass1_fp32", 0.0);
      r.seconds = meta.value("seconds", 0.0);
      r.cached = true;
      if (meta.contains("samples")) r.samples = meta["samples"].get<std::vector<std::string>>();
      return r;
    }
  }
  return run_sft(cfg, dir, progress);
}

}  // namespace quads::rl
