#include "rl/run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/progress.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/rac.h"
#include "rl/grpo.h"
#include "rl/modes.h"
#include "rl/policy.h"
#include "rl/task_source.h"
#include "rollout/engine.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/losses.h"

namespace fs = std::filesystem;

namespace quads::rl {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  QUADS_CHECK(f.good(), "cannot read {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---- checkpoints ---------------------------------------------------------------------------------

struct Checkpoint {
  int64_t step = 0;  // steps done
  double elapsed = 0;
  std::vector<nlohmann::json> rows;
};

// m, v and t are AdamW's state (its moments and step count).
void save_checkpoint(const std::string& run_dir, const model::Weights& w, const std::vector<float>& m,
                     const std::vector<float>& v, int64_t t, const Checkpoint& c, const std::string& mode,
                     int64_t seed) {
  const std::string dst = run_dir + "/checkpoint", tmp = run_dir + "/checkpoint.tmp", old = run_dir + "/checkpoint.old";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  w.save(tmp);
  const int64_t n = static_cast<int64_t>(m.size());
  io::SafeTensorsWriter ow(tmp + "/optimizer.safetensors",
                           {{"adamw.m", io::DType::F32, {n}}, {"adamw.v", io::DType::F32, {n}}},
                           {{"adamw.t", std::to_string(t)}});
  ow.write("adamw.m", m.data(), m.size() * sizeof(float));  // from the buffers: no copy of the moments
  ow.write("adamw.v", v.data(), v.size() * sizeof(float));
  ow.commit();
  nlohmann::json st = {{"step", c.step},
                       {"mode", mode},
                       {"seed", seed},
                       {"elapsed_s", c.elapsed},
                       {"adamw_t", t},
                       // Every random draw is keyed by (seed, step): the step IS the RNG state.
                       {"rng", {{"scheme", "counter(seed, step)"}, {"seed", seed}, {"next_step", c.step}}},
                       {"rows", c.rows}};
  write_text_atomic(tmp + "/state.json", st.dump() + "\n");
  // Swap the folders: at every moment either checkpoint/ or checkpoint.old/ is complete.
  fs::remove_all(old);
  if (fs::exists(dst)) fs::rename(dst, old);
  fs::rename(tmp, dst);
  fs::remove_all(old);
}

// One checkpoint write at a time on a thread of its own: the masters and AdamW's moments are
// gigabytes, fsync'ed (configs/gpu.toml: 2.9 GB, ~6 s), which an RL step need not wait for when the
// host buffers stay untouched until the next checkpoint (AdamW on the trainer's device, rollouts
// synced from there). wait() joins and rethrows a failed write; the caller waits before it touches
// the buffers again and before the run returns.
class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter() {
    if (t_.joinable()) t_.join();
    if (err_) {  // unwinding from another error: this one can only be reported
      try {
        std::rethrow_exception(err_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rl: a checkpoint write failed: %s\n", e.what());
      }
    }
  }
  void start(std::function<void()> job) {
    wait();
    t_ = std::thread([this, job = std::move(job)] {
      try {
        job();
      } catch (...) {
        err_ = std::current_exception();
      }
    });
  }
  void wait() {
    if (t_.joinable()) t_.join();
    if (err_) std::rethrow_exception(std::exchange(err_, nullptr));
  }

 private:
  std::thread t_;
  std::exception_ptr err_;
};

bool load_checkpoint(const std::string& run_dir, model::Weights& w, train::AdamW& opt, Checkpoint& c,
                     const std::string& mode, int64_t seed) {
  std::string dir = run_dir + "/checkpoint";
  if (!fs::exists(dir + "/state.json")) {
    dir = run_dir + "/checkpoint.old";  // interrupted between the two renames
    if (!fs::exists(dir + "/state.json")) return false;
  }
  nlohmann::json st = nlohmann::json::parse(read_text(dir + "/state.json"));
  QUADS_CHECK(st.value("mode", "") == mode && st.value("seed", int64_t(-1)) == seed,
              "resume: {} holds a checkpoint of mode {} seed {}, not mode {} seed {}", dir, st.value("mode", "?"),
              st.value("seed", int64_t(-1)), mode, seed);
  model::Weights lw = model::Weights::load(dir);
  QUADS_CHECK(lw.data.size() == w.data.size(), "resume: {} has {} parameters, the run's model {}", dir, lw.data.size(),
              w.data.size());
  w.data = std::move(lw.data);
  auto f = io::SafeTensorsFile::open(dir + "/optimizer.safetensors");
  const auto& m = f->at("adamw.m");
  const auto& v = f->at("adamw.v");
  QUADS_CHECK(m.numel() == static_cast<int64_t>(opt.m.size()) && v.numel() == static_cast<int64_t>(opt.v.size()),
              "resume: {}/optimizer.safetensors does not match the model's {} parameters", dir, opt.m.size());
  m.to_f32(opt.m.data());
  v.to_f32(opt.v.data());
  opt.t = st.at("adamw_t").get<int64_t>();
  c.step = st.at("step").get<int64_t>();
  c.elapsed = st.value("elapsed_s", 0.0);
  c.rows = st.at("rows").get<std::vector<nlohmann::json>>();
  return true;
}

// ---- device -------------------------------------------------------------------------------------

std::mutex g_backend_mu;
RolloutBackendFactory g_backend_factory;

// ---- per-step pieces ---------------------------------------------------------------------------

// Rows [t0, t1) of every layer's routing (k experts per token).
model::Routing slice_routing(const model::Routing& r, int64_t t0, int64_t t1, int k) {
  model::Routing s;
  s.experts.resize(r.experts.size());
  for (size_t l = 0; l < r.experts.size(); ++l)
    if (!r.experts[l].empty())
      s.experts[l].assign(r.experts[l].begin() + t0 * k, r.experts[l].begin() + t1 * k);
  return s;
}

// Per layer: the share of tokens whose top-k expert SET differs.
std::vector<double> routing_mismatch(const model::Routing& a, const model::Routing& b, int k) {
  std::vector<double> out;
  for (size_t l = 0; l < a.experts.size(); ++l) {
    const auto& x = a.experts[l];
    const auto& y = b.experts[l];
    if (x.empty() || y.size() != x.size()) continue;
    const int64_t T = static_cast<int64_t>(x.size()) / k;
    int64_t diff = 0;
    std::vector<int32_t> sx(k), sy(k);
    for (int64_t t = 0; t < T; ++t) {
      std::copy(x.begin() + t * k, x.begin() + (t + 1) * k, sx.begin());
      std::copy(y.begin() + t * k, y.begin() + (t + 1) * k, sy.begin());
      std::sort(sx.begin(), sx.end());
      std::sort(sy.begin(), sy.end());
      diff += sx != sy;
    }
    out.push_back(T ? static_cast<double>(diff) / T : 0.0);
  }
  return out;
}

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / v.size();
}

// A subset of sequences [s0, s1) of a packed set.
Sequences slice(const Sequences& all, int s0, int s1) {
  Sequences s;
  for (int q = s0; q < s1; ++q) {
    s.batch.add(std::vector<int32_t>(all.batch.tokens.begin() + all.batch.offsets[q],
                                     all.batch.tokens.begin() + all.batch.offsets[q + 1]));
    s.prompt_len.push_back(all.prompt_len[q]);
  }
  return s;
}

}  // namespace

// ---- the run -------------------------------------------------------------------------------------

RunOutcome run_rl(const RunConfig& cfg, const RunOptions& opt) {
  const auto t_start = Clock::now();
  const ModeSpec& spec = mode_spec(opt.mode);
  QUADS_CHECK(!opt.out_dir.empty(), "rl: no output folder given");
  QUADS_CHECK(cfg.uses_dataset() || !opt.base_dir.empty(), "rl: no base model folder given");
  if (cfg.rl.device == "cuda") (void)rollout_backend_factory();  // fail before any work
  if (cfg.rl.trainer_device() == "cuda") (void)train::gpu_train_backend_factory();
  fs::create_directories(opt.out_dir);
  const RlSection& R = cfg.rl;
  const int P = static_cast<int>(R.prompts_per_step), G = static_cast<int>(R.group_size);
  const int N = P * G;
  const int nmb = static_cast<int>(R.minibatches);
  QUADS_CHECK(N % nmb == 0, "rl: rl.minibatches = {} must divide prompts_per_step * group_size = {}", nmb, N);

  RunInputs inputs = load_run_inputs(cfg, opt.base_dir);
  const TaskSource& src = *inputs.source;
  const model::Weights& base_w = inputs.weights;
  const model::ModelConfig& mc = base_w.cfg;
  const int64_t V = mc.vocab_size;
  const int K = std::max(1, mc.num_experts_per_tok);
  {
    nlohmann::json info = src.describe();
    info["model"] = inputs.base_dir;
    info["model_config"] = mc.describe();
    write_text_atomic(opt.out_dir + "/data.json", info.dump(2) + "\n");
    if (opt.progress && info.value("skipped_bad_lines", 0) + info.value("skipped_long_prompts", 0) > 0)
      std::fprintf(stderr, "data: skipped %d bad line(s) and %d long prompt(s) (listed in %s/data.json)\n",
                   info.value("skipped_bad_lines", 0), info.value("skipped_long_prompts", 0), opt.out_dir.c_str());
  }

  // Trainer: float32 masters in the trainer's numerics. Reference: the base, frozen. With the
  // trainer on the GPU their CPU models only carry the layout (never quantized, never run).
  const auto cpu_models = R.trainer_device() == "cuda" ? model::Model::Quantize::Later : model::Model::Quantize::Now;
  model::Weights W = base_w;
  model::Model trainer(W, trainer_precision(spec), cpu_models);
  std::optional<model::Weights> ref_w;
  std::optional<model::Model> ref;
  if (R.kl_coef > 0) {
    ref_w.emplace(base_w);
    ref.emplace(*ref_w, trainer_precision(spec), cpu_models);
  }
  train::AdamWConfig ac;
  ac.lr = R.lr;
  ac.beta2 = 0.999;
  ac.max_grad_norm = R.grad_clip;
  train::AdamW adam(W.size(), ac, train::AdamW::decay_mask(W.layout));
  // rl.train_device = "cuda": the trainer's (and the reference's) forward and backward run on the
  // GPU. With the backend's optimizer (dev_opt) AdamW runs there too and W receives the new masters
  // after every RL step and AdamW's moments before every checkpoint; checkpoints are written here in
  // one format, so resume works across devices. The NaN test hook needs host gradients.
  std::unique_ptr<train::TrainBackend> gtrain, gref;
  if (R.trainer_device() == "cuda") {
    gtrain = train::gpu_train_backend_factory()(W, trainer_precision(spec));
    if (ref) gref = train::gpu_train_backend_factory()(*ref_w, trainer_precision(spec));
  }
  const bool dev_opt = gtrain && gtrain->has_optimizer() && !opt.grad_hook;
  auto trainer_forward = [&](const model::Batch& b, float* lg, model::Activations* keep,
                             const model::ForwardOptions& fo) {
    if (!gtrain) return trainer.forward(b, lg, keep, fo);
    gtrain->forward(b, lg, keep != nullptr, fo.record, fo.replay);
  };

  // Rollout side, with its own copy of the weights; fp32 engine for the reference evaluation.
  rollout::EngineOptions eo;
  eo.max_batch = std::max(N, 1);
  eo.decode_ahead = static_cast<int>(std::min<int64_t>(cfg.rl.decode_ahead, 1 << 20));
  rollout::RolloutEngine engine(base_w, rollout_precision(spec), eo);
  rollout::RolloutEngine engine32(base_w, model::PrecisionConfig::preset("fp32"), eo);
  model::RacConfig rac;
  rac.ratio = cfg.quads.rac_ratio;
  rac.granularity = model::RacConfig::parse_granularity(cfg.quads.granularity);
  rac.residual = model::RacConfig::residual_format(cfg.quads.residual_format);
  QUADS_CHECK(cfg.quads.rac_selection == "static" || cfg.quads.rac_selection == "dynamic",
              "rl: quads.rac_selection = {} (static | dynamic)", cfg.quads.rac_selection);
  rac.dynamic = cfg.quads.rac_selection == "dynamic";
  // Calibration batch for static RAC: fixed sequences of the source (worked solutions of the
  // generated tasks, training prompts of a dataset).
  model::Batch calib;
  for (auto& seq : src.calibration(16)) calib.add(std::move(seq));

  // rl.device = "cuda": both engines step on the GPU, where the RAC calibration and the diagnostics
  // run too; their CPU models are brought up to date only if something asks for them.
  std::string device = "cpu";
  if (R.device == "cuda") {
    QUADS_CHECK(!spec.rac || !rac.dynamic,
                "rl.device = \"cuda\" runs static RAC only (quads.rac_selection = \"dynamic\"; mode {})", opt.mode);
    QUADS_CHECK(!spec.rac || rac.granularity == model::RacGranularity::Block16,
                "rl.device = \"cuda\" compensates whole 16-channel blocks only (quads.granularity = \"{}\"; mode {})",
                cfg.quads.granularity, opt.mode);
    std::unique_ptr<rollout::StepBackend> b = rollout_backend_factory()(base_w, engine.precision());
    device = b->name();
    engine.set_backend(std::move(b));
    engine32.set_backend(rollout_backend_factory()(base_w, engine32.precision()));
  }

  PgConfig pg = cfg.pg_config();
  pg.tis = R.tis || spec.tis;
  AdvantageConfig advc = cfg.advantage_config();
  rollout::SamplingParams sp;
  sp.temperature = R.temperature;

  // Resume.
  Checkpoint ck;
  if (opt.resume && load_checkpoint(opt.out_dir, W, adam, ck, opt.mode, opt.seed)) {
    if (gtrain) gtrain->sync(W);
    else trainer.sync();
    if (dev_opt) gtrain->upload_optimizer(adam);
  }
  const double elapsed0 = ck.elapsed;
  std::vector<nlohmann::json> rows = ck.rows;
  {
    std::string text;
    for (const auto& r : rows) text += r.dump() + "\n";
    write_text_atomic(opt.out_dir + "/metrics.jsonl", text);
  }
  MetricsWriter log(opt.out_dir + "/metrics.jsonl", true);
  auto elapsed = [&] { return elapsed0 + since(t_start); };
  auto emit = [&](nlohmann::json row) {
    log.write(row);
    if (opt.on_row) opt.on_row(row);
    rows.push_back(std::move(row));
  };

  // With dev_opt the masters live on the trainer's device: W (host) is fetched only when something
  // needs it (a host sync, a checkpoint), and an engine whose backend shares that device syncs from
  // it directly (no host round trip; RolloutEngine::sync_device).
  bool w_stale = false;
  CheckpointWriter writer;
  auto sync_engine = [&](rollout::RolloutEngine& e) {
    if (dev_opt && e.sync_device(gtrain->device_masters())) return;
    if (w_stale) {
      writer.wait();  // it may still be writing W
      gtrain->download(W, nullptr);
      w_stale = false;
    }
    e.sync(W);
  };
  // ck's step, elapsed and rows are set. With dev_opt the host holds the masters and moments only
  // for checkpoints, so an intermediate one is written in the background.
  auto checkpoint = [&](bool background) {
    writer.wait();
    if (dev_opt) gtrain->download(W, &adam);  // the masters and AdamW's moments
    w_stale = false;
    auto job = [&W, &adam, c = ck, t = adam.t, dir = opt.out_dir, mode = opt.mode, seed = opt.seed] {
      save_checkpoint(dir, W, adam.m, adam.v, t, c, mode, seed);
    };
    if (background && dev_opt) writer.start(std::move(job));
    else job();
  };
  double t_sync = 0;
  auto sync = [&] {
    const auto t = Clock::now();
    sync_engine(engine);
    // Static RAC ranks on the rollout's device when its backend can (the GPU), else on the CPU model.
    if (spec.rac) engine.calibrate_rac(calib, rac);
    t_sync = since(t);
  };

  auto evaluate_now = [&](int64_t step) {
    const auto t = Clock::now();
    SourceEval er = evaluate_source(engine, src, R.max_new_tokens, R.eval_temperature,
                                    mix(static_cast<uint64_t>(opt.seed), 0xE7A1));
    sync_engine(engine32);
    SourceEval e32 = evaluate_source(engine32, src, R.max_new_tokens, R.eval_temperature,
                                     mix(static_cast<uint64_t>(opt.seed), 0xE7A1));
    nlohmann::json row = {{metric::kKind, "eval"},
                          {metric::kMode, opt.mode},
                          {metric::kSeed, opt.seed},
                          {metric::kStep, step},
                          {metric::kPass1, er.score.pass1},
                          {"pass1_fp32", e32.score.pass1}};
    for (size_t g = 0; g < er.score.group_names.size(); ++g)
      if (er.score.group_count[g] > 0) row["pass1_" + er.score.group_names[g]] = er.score.group_pass1[g];
    row["t_eval"] = since(t);
    row[metric::kElapsed] = elapsed();
    emit(std::move(row));
    return er.score.pass1;
  };

  const int64_t steps = R.steps;
  const int64_t last = opt.stop_after >= 0 ? std::min(steps, opt.stop_after) : steps;
  std::optional<ProgressBar> bar;
  if (opt.progress)
    bar.emplace(steps, opt.label.empty() ? fmt::format("{} s{}", opt.mode, opt.seed) : opt.label);
  double last_pass1 = std::nan(""), last_reward = std::nan(""), last_gap = std::nan("");
  for (const auto& r : rows) {
    if (r.value(metric::kKind, "") == "eval") last_pass1 = r.value(metric::kPass1, 0.0);
    if (r.value(metric::kKind, "") == "train") last_reward = r.value(metric::kRewardMean, 0.0);
  }
  if (bar) bar->update(ck.step, {{"pass1", last_pass1}});

  std::vector<float> logits, dlogits, grads(W.size());
  model::Activations acts;
  for (int64_t step = ck.step; step < last; ++step) {
    sync();
    if (step % R.eval_every == 0) last_pass1 = evaluate_now(step);

    // ---- rollout
    auto t = Clock::now();
    const std::vector<Problem> batch = src.train_batch(opt.seed, step, P);
    std::vector<std::vector<int32_t>> prompts;
    for (const Problem& pb : batch) prompts.push_back(pb.prompt);
    rollout::Request proto;
    proto.max_new_tokens = static_cast<int>(R.max_new_tokens);
    proto.stop_ids = src.stop_ids();
    proto.sampling = sp;
    const std::vector<rollout::Result> res =
        engine.generate(rollout::group_requests(prompts, G, mix(static_cast<uint64_t>(opt.seed), step), proto));
    const double t_rollout = since(t);

    std::vector<float> rewards(N);
    int64_t truncated = 0;
    for (int i = 0; i < N; ++i) {
      Verdict v = src.verify(batch[i / G], res[i].tokens);
      rewards[i] = v.reward;
      truncated += v.outcome == Outcome::Truncated;
    }
    const std::vector<float> adv = group_advantages(rewards, G, advc);
    const GroupStats gs = group_stats(rewards, G);
    const Sequences seqs = pack_results(res);
    std::vector<float> lp_roll;
    for (const auto& r : res) lp_roll.insert(lp_roll.end(), r.logprobs.begin(), r.logprobs.end());
    const int64_t ntok = seqs.response_tokens();

    // ---- rollout-side diagnostics: expert choices and activation quantization error per layer, on
    // the rollout's device when its backend inspects (the GPU), else one CPU forward
    t = Clock::now();
    model::Routing r_roll;
    std::vector<double> qerr_layers;
    if (R.routing_replay || R.diagnostics) {
      rollout::Inspection insp = engine.inspect(seqs.batch, R.diagnostics);
      r_roll = std::move(insp.routing);
      if (R.diagnostics) qerr_layers = insp.act_qerr_layers(mc.num_hidden_layers);
    }
    const double t_diag = since(t);

    // ---- trainer: old log-probs, mismatch, update
    t = Clock::now();
    model::Routing r_train;
    std::vector<double> route_mm;
    std::vector<float> lp_ref;
    if (ref) {
      logits.resize(seqs.batch.ntokens() * V);
      model::ForwardOptions fo;
      if (R.routing_replay) fo.replay = &r_roll;
      if (gref) gref->forward(seqs.batch, logits.data(), false, nullptr, fo.replay);
      else ref->forward(seqs.batch, logits.data(), nullptr, fo);
      lp_ref = response_logprobs(seqs, logits.data(), V, R.temperature);
    }
    std::vector<float> lp_old;
    if (nmb > 1 || R.routing_replay) {
      // A separate no-grad pass: the minibatch forwards run after earlier updates. With routing
      // replay it also measures the trainer's own routing (the replayed pass cannot).
      logits.resize(seqs.batch.ntokens() * V);
      model::ForwardOptions fo;
      fo.record = &r_train;
      trainer_forward(seqs.batch, logits.data(), nullptr, fo);
      if (!R.routing_replay) lp_old = response_logprobs(seqs, logits.data(), V, R.temperature);
      if (R.routing_replay) {
        fo.record = nullptr;
        fo.replay = &r_roll;
        trainer_forward(seqs.batch, logits.data(), nullptr, fo);
        lp_old = response_logprobs(seqs, logits.data(), V, R.temperature);
      }
    }

    Mismatch mm;
    double loss_sum = 0, clip_w = 0, tis_w = 0, tis_clip_w = 0, ratio_max = 0, kl_w = 0, entropy_sum = 0,
           gnorm_max = 0;
    const int per_mb = N / nmb;
    for (int mb = 0; mb < nmb; ++mb) {
      const Sequences part = slice(seqs, mb * per_mb, (mb + 1) * per_mb);
      const int64_t tok0 = seqs.batch.offsets[mb * per_mb], tok1 = seqs.batch.offsets[(mb + 1) * per_mb];
      int64_t r0 = 0;  // first response token of this minibatch in the response order
      for (int q = 0; q < mb * per_mb; ++q) r0 += seqs.response_len(q);
      const int64_t nr = part.response_tokens();
      const int64_t T = part.batch.ntokens();
      logits.resize(T * V);
      model::ForwardOptions fo;
      model::Routing replay_part;
      if (R.routing_replay) {
        replay_part = slice_routing(r_roll, tok0, tok1, K);
        fo.replay = &replay_part;
      } else if (nmb == 1) {
        fo.record = &r_train;
      }
      trainer_forward(part.batch, logits.data(), &acts, fo);
      std::vector<float> lp = response_logprobs(part, logits.data(), V, R.temperature);
      if (lp_old.empty() && nmb == 1) lp_old = lp;  // same weights, same forward: identical

      // Padded [n, Tmax] arrays for the loss.
      const int n = part.batch.nseq();
      int64_t Tmax = 0;
      for (int q = 0; q < n; ++q) Tmax = std::max(Tmax, part.response_len(q));
      std::vector<float> a_lp(n * Tmax, 0.f), a_old(n * Tmax, 0.f), a_roll(n * Tmax, 0.f), a_ref;
      std::vector<uint8_t> mask(n * Tmax, 0);
      if (ref) a_ref.assign(n * Tmax, 0.f);
      int64_t j = 0;
      for (int q = 0; q < n; ++q)
        for (int64_t u = 0; u < part.response_len(q); ++u, ++j) {
          const size_t i = static_cast<size_t>(q) * Tmax + u;
          a_lp[i] = lp[j];
          a_old[i] = lp_old[r0 + j];
          a_roll[i] = lp_roll[r0 + j];
          if (ref) a_ref[i] = lp_ref[r0 + j];
          mask[i] = 1;
        }
      mm.add(std::span<const float>(lp_old).subspan(r0, nr), std::span<const float>(lp_roll).subspan(r0, nr));
      PgBatch b;
      b.n_seqs = n;
      b.T = Tmax;
      b.logp = a_lp;
      b.logp_old = a_old;
      b.logp_rollout = a_roll;
      if (ref) b.logp_ref = a_ref;
      b.mask = mask;
      b.adv = std::span<const float>(adv).subspan(mb * per_mb, n);
      double denom = 0;
      if (pg.aggregation == Aggregation::TokenMean) denom = static_cast<double>(std::max<int64_t>(1, ntok));
      else denom = N;
      const PgResult pr = policy_loss(b, pg, denom);
      loss_sum += pr.loss;
      clip_w += pr.clip_frac * pr.n_tokens;
      tis_w += pr.tis_weight_mean * pr.n_tokens;
      tis_clip_w += pr.tis_clip_frac * pr.n_tokens;
      kl_w += pr.kl * pr.n_tokens;
      ratio_max = std::max(ratio_max, pr.ratio_max);

      // dL/dlogits on the rows that predict response tokens, and the entropy there.
      std::vector<int32_t> targets(T, -1);
      std::vector<float> dlp(T, 0.f);
      j = 0;
      for (int q = 0; q < n; ++q) {
        const int64_t p0 = part.batch.offsets[q] + part.prompt_len[q];
        for (int64_t u = 0; u < part.response_len(q); ++u, ++j) {
          targets[p0 + u - 1] = part.batch.tokens[p0 + u];
          dlp[p0 + u - 1] = pr.grad[static_cast<size_t>(q) * Tmax + u];
        }
      }
      std::vector<float> H(T);
      train::entropy(logits.data(), T, V, H.data());
      for (int64_t r = 0; r < T; ++r)
        if (targets[r] >= 0) entropy_sum += H[r];
      dlogits.assign(T * V, 0.f);
      if (R.temperature != 1.0) {
        const float inv = static_cast<float>(1.0 / R.temperature);
        std::vector<float> scaled(logits.size());
        for (size_t i = 0; i < scaled.size(); ++i) scaled[i] = logits[i] * inv;
        train::token_logprobs_backward(scaled.data(), T, V, targets.data(), dlp.data(), dlogits.data());
        for (float& g : dlogits) g *= inv;
      } else {
        train::token_logprobs_backward(logits.data(), T, V, targets.data(), dlp.data(), dlogits.data());
      }
      double gn = 0;
      if (dev_opt) {  // gradient, clipping and AdamW where the masters are; checked right after
        gtrain->backward(dlogits.data(), nullptr);
        gn = gtrain->optimizer_step(adam);
      } else {
        std::fill(grads.begin(), grads.end(), 0.f);
        if (gtrain) gtrain->backward(dlogits.data(), grads.data());
        else trainer.backward(acts, dlogits.data(), grads.data());
        if (opt.grad_hook) opt.grad_hook(step, grads.data(), grads.size());
        gn = train::global_norm(grads.data(), grads.size());
      }
      QUADS_CHECK(std::isfinite(pr.loss) && std::isfinite(gn),
                  "rl ({} seed {}): {} at step {} (minibatch {}); the run stops here, the last good checkpoint "
                  "is {}/checkpoint",
                  opt.mode, opt.seed, std::isfinite(pr.loss) ? "NaN/Inf in the gradients" : "NaN/Inf in the loss",
                  step, mb, opt.out_dir);
      gnorm_max = std::max(gnorm_max, gn);
      if (dev_opt) continue;
      adam.step(W.data.data(), grads.data());
      const auto ts = Clock::now();
      if (gtrain) gtrain->sync(W);
      else trainer.sync();  // W_eff of the new masters (bf16 rounding or the QAT weights)
      t_sync += since(ts);
    }
    if (dev_opt) w_stale = true;  // the new masters are on the device
    if (!R.routing_replay || !r_train.experts.empty()) route_mm = routing_mismatch(r_roll, r_train, K);
    const double t_train = since(t);

    nlohmann::json row = {{metric::kKind, "train"},
                          {metric::kMode, opt.mode},
                          {metric::kSeed, opt.seed},
                          {metric::kStep, step},
                          {metric::kRewardMean, gs.reward_mean},
                          {"frac_solved_groups", gs.frac_solved},
                          {"frac_uniform_groups", gs.frac_uniform},
                          {"response_len", static_cast<double>(ntok) / N},
                          {"frac_truncated", static_cast<double>(truncated) / N},
                          {"entropy", ntok ? entropy_sum / ntok : 0.0},
                          {"loss", loss_sum},
                          {"clip_frac", ntok ? clip_w / ntok : 0.0},
                          {"ratio_max", ratio_max},
                          {"tis_weight_mean", ntok ? tis_w / ntok : 1.0},
                          {"tis_clip_frac", ntok ? tis_clip_w / ntok : 0.0},
                          {"kl_ref", ntok ? kl_w / ntok : 0.0},
                          {"grad_norm", gnorm_max},
                          {metric::kGapMeanAbs, mm.mean_abs()},
                          {metric::kGapMaxAbs, mm.max_abs},
                          {metric::kGapK3, mm.k3()},
                          {metric::kGapFracAbove, mm.frac_above()},
                          {"gap_mean", mm.mean_diff()}};
    if (!route_mm.empty()) {
      row["routing_mismatch"] = mean_of(route_mm);
      row["routing_mismatch_layers"] = route_mm;
    }
    if (R.diagnostics) {
      row["act_qerr"] = mean_of(qerr_layers);
      row["act_qerr_layers"] = qerr_layers;
    }
    row["t_rollout"] = t_rollout;
    row["t_train"] = t_train;
    row["t_sync"] = t_sync;
    row["t_diag"] = t_diag;
    row[metric::kElapsed] = elapsed();
    emit(std::move(row));
    last_reward = gs.reward_mean;
    last_gap = mm.mean_abs();

    const int64_t done = step + 1;
    if (R.checkpoint_every > 0 && done % R.checkpoint_every == 0 && done < steps) {
      ck.step = done;
      ck.elapsed = elapsed();
      ck.rows = rows;
      checkpoint(true);
    }
    if (bar) bar->update(done, {{"reward", last_reward}, {"gap", last_gap}, {"pass1", last_pass1}});
  }
  writer.wait();
  int64_t done = std::max(ck.step, last);
  if (last == steps && done == steps) {
    // Final evaluation (unless the last step already had one) and checkpoint.
    bool have = false;
    for (const auto& r : rows)
      have |= r.value(metric::kKind, "") == "eval" && r.value(metric::kStep, int64_t(-1)) == steps;
    if (!have) {
      sync();
      last_pass1 = evaluate_now(steps);
    }
    ck.step = steps;
    ck.elapsed = elapsed();
    ck.rows = rows;
    checkpoint(false);
  }
  if (bar) {
    bar->update(done, {{"reward", last_reward}, {"gap", last_gap}, {"pass1", last_pass1}});
    bar->finish();
  }
  RunOutcome out;
  out.rows = std::move(rows);
  out.steps_done = done;
  out.seconds = elapsed();
  out.device = device;
  out.train_device = gtrain ? gtrain->name() : "cpu";
  return out;
}

RolloutBackendFactory rollout_backend_factory() {
  RolloutBackendFactory f;
  {
    std::lock_guard<std::mutex> lk(g_backend_mu);
    f = g_backend_factory;
  }
  QUADS_CHECK(f != nullptr,
              "rl.device = \"cuda\": this build has no CUDA backend (configure with -DQUADS_CUDA=ON, or set "
              "rl.device = \"cpu\")");
  return f;
}

void set_rollout_backend_factory(RolloutBackendFactory f) {
  std::lock_guard<std::mutex> lk(g_backend_mu);
  g_backend_factory = std::move(f);
}

RunResult summarize_rows(const std::vector<nlohmann::json>& rows, double collapse_margin) {
  RunResult r;
  bool any_eval = false;
  int64_t first_step = -1, last_step = -1;
  double gsum = 0, gmax = 0;
  int64_t ntrain = 0;
  for (const auto& row : rows) {
    const std::string kind = row.value(metric::kKind, "");
    const int64_t step = row.value(metric::kStep, int64_t(0));
    r.seconds = std::max(r.seconds, row.value(metric::kElapsed, 0.0));
    if (kind == "eval") {
      const double p = row.value(metric::kPass1, 0.0);
      if (!any_eval || step < first_step) {
        first_step = step;
        r.base_pass1 = p;
      }
      if (!any_eval || step >= last_step) {
        last_step = step;
        r.final_pass1 = p;
      }
      r.best_pass1 = any_eval ? std::max(r.best_pass1, p) : p;
      any_eval = true;
    } else if (kind == "train") {
      gsum += row.value(metric::kGapMeanAbs, 0.0);
      gmax += row.value(metric::kGapMaxAbs, 0.0);
      ++ntrain;
    }
  }
  QUADS_CHECK(any_eval, "summary: the run has no evaluation row");
  r.mean_abs_logp_gap = ntrain ? gsum / ntrain : 0.0;
  r.max_abs_logp_gap = ntrain ? gmax / ntrain : 0.0;
  r.collapsed = r.final_pass1 < r.best_pass1 - collapse_margin;
  return r;
}

}  // namespace quads::rl
