// quads generate: sample continuations of a token prompt with the rollout engine.
//   quads generate --model DIR --prompt-ids 1,2,3 --max-new-tokens 16 --greedy
//   quads generate --model DIR --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.95 --seed 7 --batch 4
// stdout: one JSON line {"ids": [prompt and new tokens], "logprobs": [one per new token]} per
// sequence. With --batch B the B copies of the prompt get seeds S..S+B-1 and the lines come in
// REVERSE order (seed S+B-1 first), so that the last line is always the first sequence (seed S).
// Log-probs are under the engine's numerics and the temperature-scaled distribution
// (rollout/sampler.h). Everything else (settings, finish reasons, timings) goes to stderr.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "common/error.h"
#include "rollout/engine.h"
#ifdef QUADS_HAVE_CUDA
#include "cuda/model_gpu.h"
#endif

namespace {

struct Options {
  std::string model_dir;
  std::vector<int32_t> prompt;
  std::vector<int32_t> stop_ids;
  int max_new_tokens = 16;
  bool greedy = false;
  double temperature = 1.0;
  double top_p = 1.0;
  int top_k = 0;
  uint64_t seed = 0;
  std::string precision = "fp32";
  int batch = 1;
  int max_batch = 64;
  bool no_share = false;
  int decode_ahead = quads::rollout::EngineOptions{}.decode_ahead;
  std::string device = "cpu";
};

int run(const Options& o) {
  using namespace quads;
  QUADS_CHECK(o.batch >= 1, "generate: --batch must be >= 1 (got {})", o.batch);
  QUADS_CHECK(!o.prompt.empty(), "generate: --prompt-ids is empty");
  QUADS_CHECK(o.device == "cpu" || o.device == "cuda", "generate: --device must be cpu or cuda (got '{}')", o.device);
#ifndef QUADS_HAVE_CUDA
  QUADS_CHECK(o.device == "cpu", "generate: --device cuda needs a build with -DQUADS_CUDA=ON");
#endif
  const model::PrecisionConfig prec = model::PrecisionConfig::preset(o.precision);
  model::Weights w = model::Weights::load(o.model_dir);
  std::fprintf(stderr, "model: %s\n", w.cfg.describe().c_str());
  rollout::EngineOptions eo;
  eo.max_batch = o.max_batch;
  eo.share_prefill = !o.no_share;
  eo.decode_ahead = o.decode_ahead;
  rollout::RolloutEngine eng(std::move(w), prec, eo);
#ifdef QUADS_HAVE_CUDA
  if (o.device == "cuda") eng.set_backend(cuda::make_gpu_backend(eng.model().weights(), prec));
#endif
  std::fprintf(stderr, "device: %s\n", eng.backend() ? eng.backend()->name().c_str() : "cpu");
  std::fprintf(stderr, "precision: %s\n", prec.describe().c_str());
  if (o.batch > 1 && !eng.batch_invariant())
    std::fprintf(stderr, "note: precision '%s' scales activations over the whole step: results depend on the batch\n",
                 o.precision.c_str());

  rollout::Request proto;
  proto.prompt = o.prompt;
  proto.max_new_tokens = o.max_new_tokens;
  proto.stop_ids = o.stop_ids;
  proto.sampling.greedy = o.greedy;
  proto.sampling.temperature = o.temperature;
  proto.sampling.top_k = o.top_k;
  proto.sampling.top_p = o.top_p;
  const std::vector<rollout::Request> reqs = rollout::group_requests({o.prompt}, o.batch, o.seed, proto);
  std::fprintf(stderr, "sampling: %s, %d sequence(s), seeds %llu..%llu\n", proto.sampling.describe().c_str(), o.batch,
               static_cast<unsigned long long>(o.seed), static_cast<unsigned long long>(o.seed + o.batch - 1));

  const std::vector<rollout::Result> out = eng.generate(reqs);
  const rollout::EngineStats& st = eng.stats();
  std::fprintf(stderr,
               "%lld tokens generated in %.3f s (%lld steps, %lld of them in %lld decode runs; %lld prompt tokens "
               "prefilled, %lld shared; %lld draws dropped after a stop)\n",
               static_cast<long long>(st.generated), st.seconds, static_cast<long long>(st.steps),
               static_cast<long long>(st.run_steps), static_cast<long long>(st.decode_runs),
               static_cast<long long>(st.prefill_tokens), static_cast<long long>(st.shared_prompts),
               static_cast<long long>(st.dropped));
  for (int i = o.batch - 1; i >= 0; --i) {
    const rollout::Result& r = out[i];
    std::fprintf(stderr, "sequence %d (seed %llu): %zu new tokens, finished by %s\n", i,
                 static_cast<unsigned long long>(r.seed), r.tokens.size(), rollout::finish_name(r.finish));
    const nlohmann::json j = {{"ids", r.ids()}, {"logprobs", r.logprobs}};
    std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model_dir, "checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--prompt-ids", o->prompt, "prompt token ids, comma-separated, e.g. 1,2,3")
      ->required()
      ->delimiter(',');
  app.add_option("--max-new-tokens", o->max_new_tokens, "tokens to generate at most")->capture_default_str();
  auto* greedy = app.add_flag("--greedy", o->greedy, "argmax decoding (same as --temperature 0)");
  auto* temp = app.add_option("--temperature", o->temperature, "sampling temperature")->capture_default_str();
  auto* top_p = app.add_option("--top-p", o->top_p, "nucleus sampling threshold (1 = off)")->capture_default_str();
  auto* top_k = app.add_option("--top-k", o->top_k, "keep the k most likely tokens (0 = off)")->capture_default_str();
  app.add_option("--seed", o->seed, "seed of the first sequence (sequence i uses seed + i)")->capture_default_str();
  greedy->excludes(temp)->excludes(top_p)->excludes(top_k);
  app.add_option("--precision", o->precision,
                 "precision mode: fp32, bf16, fp8, fp8-tensor, nvfp4, nvfp4-2d, nvfp4-tensor, nvfp4-w4a16, mxfp4, ...")
      ->capture_default_str();
  app.add_option("--batch", o->batch, "copies of the prompt, seeds S..S+B-1 (printed last to first)")
      ->capture_default_str();
  app.add_option("--stop-ids", o->stop_ids, "token ids that end a sequence (kept in the output), comma-separated")
      ->delimiter(',');
  app.add_option("--max-batch", o->max_batch, "sequences decoded at once (KV-cache slots)")->capture_default_str();
  app.add_option("--device", o->device, "cpu, or cuda (the GPU rollout engine, cuda/model_gpu.h)")->capture_default_str();
  app.add_option("--decode-ahead", o->decode_ahead,
                 "with --device cuda: decode steps queued in one call while every sequence decodes (1 = a call a step)")
      ->capture_default_str();
  app.add_flag("--no-share-prefill", o->no_share, "prefill every copy of the prompt instead of copying the KV cache");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("generate", "sample continuations of a token prompt with the rollout engine (KV cache, batching)", setup);
