#include "rl/sweep.h"

#include <algorithm>

#include <fmt/format.h>

#include "model/model.h"
#include "model/rac.h"
#include "rl/grpo.h"
#include "rl/policy.h"
#include "rollout/engine.h"

namespace quads::rl {

std::vector<SweepPoint> rac_sweep(const RunConfig& cfg, const std::string& base_dir, int prompts, int group) {
  BaseModel base = load_base(base_dir);
  const CharTokenizer& tok = base.tok;
  const int64_t V = base.weights.cfg.vocab_size;
  TaskSet tasks(cfg.task_mix(), static_cast<uint64_t>(cfg.tasks.seed), static_cast<int>(cfg.rl.eval_size));

  // The tokens every setting scores: sampled by the fp32 model at the training temperature.
  std::vector<std::vector<int32_t>> ids;
  for (const Task& t : tasks.train_batch(uint64_t(3) << 60, prompts)) ids.push_back(tok.encode_prompt(t.prompt));
  rollout::Request proto;
  proto.max_new_tokens = static_cast<int>(cfg.rl.max_new_tokens);
  proto.stop_ids = {tok.eos_id()};
  proto.sampling.temperature = cfg.rl.temperature;
  rollout::RolloutEngine sampler(base.weights, model::PrecisionConfig::preset("fp32"));
  const Sequences seqs = pack_results(sampler.generate(rollout::group_requests(ids, group, 12345, proto)));
  std::vector<float> logits(static_cast<size_t>(seqs.batch.ntokens()) * V);

  auto score = [&](model::Model& m) {
    m.forward(seqs.batch, logits.data());
    return response_logprobs(seqs, logits.data(), V, cfg.rl.temperature);
  };
  model::Weights w_qat = base.weights, w_bf16 = base.weights, w_roll = base.weights;
  model::Model qat(w_qat, model::PrecisionConfig::preset("qat"));
  model::Model bf16(w_bf16, model::PrecisionConfig::preset("bf16"));
  const std::vector<float> lp_qat = score(qat), lp_bf16 = score(bf16);

  model::Model roll(w_roll, model::PrecisionConfig::preset("nvfp4"));
  model::Batch calib;
  for (const Task& t : tasks.train_batch(uint64_t(1) << 62, 16)) calib.add(make_sft_example(t, tok).tokens);

  std::vector<SweepPoint> out;
  for (const char* gran : {"block16", "channel"}) {
    for (double ratio : {0.0, 0.125, 0.25, 0.5, 1.0}) {
      if (ratio == 0.0 && std::string(gran) == "channel") continue;  // the same as block16 at 0
      model::RacConfig rc;
      rc.ratio = ratio;
      rc.granularity = model::RacConfig::parse_granularity(gran);
      rc.residual = model::RacConfig::residual_format(cfg.quads.residual_format);
      model::rac_calibrate(roll, calib, rc);
      double extra = 0, main = 0;
      for (const auto& L : roll.linears()) {
        if (L.num.act.kind != model::QuantKind::Quant) continue;
        main += static_cast<double>(L.in) * L.out;
        extra += static_cast<double>(L.rac_channels.size()) * L.out;
      }
      const std::vector<float> lp = score(roll);
      Mismatch a, b;
      a.add(lp_qat, lp);
      b.add(lp_bf16, lp);
      SweepPoint p;
      p.granularity = gran;
      p.ratio = ratio;
      p.extra_flops = main > 0 ? extra / main : 0;
      p.gap_qat_mean = a.mean_abs();
      p.gap_qat_max = a.max_abs;
      p.gap_bf16_mean = b.mean_abs();
      p.gap_bf16_max = b.max_abs;
      out.push_back(p);
    }
  }
  return out;
}

nlohmann::json sweep_json(const std::vector<SweepPoint>& pts) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& p : pts)
    a.push_back({{"granularity", p.granularity},
                 {"ratio", p.ratio},
                 {"extra_gemm_flops", p.extra_flops},
                 {"gap_vs_qat_mean_abs", p.gap_qat_mean},
                 {"gap_vs_qat_max_abs", p.gap_qat_max},
                 {"gap_vs_bf16_mean_abs", p.gap_bf16_mean},
                 {"gap_vs_bf16_max_abs", p.gap_bf16_max}});
  return a;
}

std::string sweep_table(const std::vector<SweepPoint>& pts) {
  std::string s = fmt::format("{:<8} {:>6} {:>11} {:>14} {:>13} {:>15} {:>14}\n", "RAC", "ratio", "extra GEMM",
                              "vs QAT mean|d|", "vs QAT max|d|", "vs BF16 mean|d|", "vs BF16 max|d|");
  for (const auto& p : pts)
    s += fmt::format("{:<8} {:>6.3f} {:>10.0f}% {:>14.4f} {:>13.3f} {:>15.4f} {:>14.3f}\n",
                     p.ratio == 0 ? "off" : p.granularity, p.ratio, 100 * p.extra_flops, p.gap_qat_mean, p.gap_qat_max,
                     p.gap_bf16_mean, p.gap_bf16_max);
  return s;
}

}  // namespace quads::rl
