// quads reqat-tokens: where a model's W4A4KV4 greedy traces leave its full-precision ones
// (first differing token: the full-precision entropy there and the token class), and the share
// of quantization-induced errors that start at a low-entropy token (src/reqat/tokens.h).
//   quads reqat-tokens --model runs/reqat/reqat --qfit runs/reqat/qfit.json
//   quads reqat-tokens --model runs/reqat/stage1 --config configs/reqat.toml
// The tasks and evaluation set come from the config ([tasks], eval.size); stdout: one JSON object.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/reqat_devices.h"
#include "common/error.h"
#include "reqat/config.h"
#include "reqat/tokens.h"
#include "reqat/trainer.h"

namespace {

struct Options {
  std::string model, qfit, config, kv;
  std::vector<std::string> sets;
  std::string device;
  double low = -1;
};

int run(const Options& o) {
  using namespace quads;
  const reqat::ReqatConfig cfg = reqat::load_reqat_config(o.config, cli::with_device(o.sets, o.device));
  cli::install_reqat_devices(cfg, "reqat-tokens");
  cli::check_reqat_devices(cfg, "reqat-tokens");
  const model::Weights w = model::Weights::load(o.model);
  reqat::QFit qfit;
  if (!o.qfit.empty()) {
    std::ifstream in(o.qfit);
    QUADS_CHECK(in.good(), "reqat-tokens: cannot read '{}'", o.qfit);
    nlohmann::json j;
    try {
      in >> j;
    } catch (const nlohmann::json::exception& e) {
      fail("reqat-tokens: '{}' is not JSON: {}", o.qfit, e.what());
    }
    qfit = reqat::QFit::from_json(j, w.cfg.num_hidden_layers, w.cfg.kv_dim(), o.qfit);
  }
  const reqat::KvQuantConfig kv = reqat::parse_kv_quant(o.kv.empty() ? cfg.kv_format : o.kv, "--kv");
  const rl::CharTokenizer tok;
  rl::RunConfig rc;
  rc.tasks = cfg.tasks;
  const rl::TaskSet ts(rc.task_mix(), static_cast<uint64_t>(cfg.tasks.seed), static_cast<int>(cfg.eval.size));
  const int max_new = static_cast<int>(cfg.eval.max_new_tokens);
  reqat::InferSpec fp = reqat::fp_infer();
  fp.qfit = &qfit;
  fp.device = cfg.eval.device;
  reqat::InferSpec q = reqat::w4a4kv4_infer(kv, &qfit);
  q.device = cfg.eval.device;
  const reqat::EvalResult efp = reqat::evaluate(w, fp, ts.eval_set(), tok, max_new);
  const reqat::EvalResult eq = reqat::evaluate(w, q, ts.eval_set(), tok, max_new);
  const reqat::TokenAnalysis a = reqat::analyze_divergence(w, &qfit, ts.eval_set(), efp, eq, tok,
                                                           o.low >= 0 ? o.low : cfg.eval.low_entropy, cfg.train_device);
  nlohmann::json j = a.to_json();
  j["fp_pass1"] = efp.score.pass1;
  j["w4a4kv4_pass1"] = eq.score.pass1;
  nlohmann::json recs = nlohmann::json::array();
  for (const auto& d : a.records)
    recs.push_back({{"task", d.task}, {"pos", d.pos}, {"entropy", d.entropy},
                    {"class", reqat::token_class_name(d.cls)}, {"fp_correct", d.fp_correct},
                    {"q_correct", d.q_correct}});
  j["divergences"] = recs;
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "checkpoint folder")->required();
  app.add_option("--qfit", o->qfit, "qfit.json of a reqat run (for the reqat model)");
  app.add_option("--config", o->config, "reqat TOML config (tasks and eval set); default: built-in");
  app.add_option("--set", o->sets, "override a config key (repeatable)");
  app.add_option("--kv", o->kv, "KV-cache format e1m2 | e2m1 (default: the config's kv_format)");
  app.add_option("--device", o->device,
                 "where the evaluation rollouts and the entropy forward run: cpu | cuda (sets eval.device and "
                 "train_device)");
  app.add_option("--low-entropy", o->low, "low-entropy threshold in nats (default: eval.low_entropy)");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("reqat-tokens", "where W4A4KV4 greedy traces leave the full-precision ones: entropy and token class",
              setup);
