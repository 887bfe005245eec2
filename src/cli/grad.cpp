// quads grad: mean next-token cross-entropy of one sequence and the gradient of every parameter.
//   quads grad --model DIR --input-ids ids.json --out grads.safetensors [--precision MODE]
// Prints the loss; writes every parameter's gradient as F32 under its HF name (per expert).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/input_ids.h"
#include "common/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "train/losses.h"

namespace {

struct Options {
  std::string model, input_ids, out, precision = "fp32";
  double aux = -1, z = 0;
};


int run(const Options& o) {
  using namespace quads::model;
  Weights w = Weights::load(o.model);
  Model m(w, PrecisionConfig::preset(o.precision));
  const Batch b = Batch::of({quads::cli::read_input_ids(o.input_ids, 2)});
  const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
  ForwardOptions opt;
  // As HF: the aux loss joins the loss only with output_router_logits (unless --aux-coef is given).
  opt.aux_loss_coef = o.aux >= 0 ? o.aux : w.cfg.effective_aux_loss_coef();
  opt.z_loss_coef = o.z;
  std::vector<float> logits(T * V), dlogits(T * V);
  Activations acts;
  m.forward(b, logits.data(), &acts, opt);
  const auto targets = quads::train::next_token_targets(b);
  const double ce = quads::train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data());
  std::vector<float> grads(w.size(), 0.f);
  m.backward(acts, dlogits.data(), grads.data());
  std::vector<quads::io::TensorData> tensors;
  for (const auto& p : w.layout.params)
    tensors.push_back(quads::io::TensorData::from_f32(p.name, p.shape, grads.data() + p.offset));
  quads::io::write_safetensors(o.out, tensors, {{"format", "pt"}});
  const double loss = ce + opt.aux_loss_coef * acts.aux_loss() + opt.z_loss_coef * acts.z_loss();
  std::printf("loss %.9f\n", loss);
  if (opt.aux_loss_coef != 0 || opt.z_loss_coef != 0)
    std::printf("cross-entropy %.9f aux %.9f (coef %g) z %.9f (coef %g)\n", ce, acts.aux_loss(), opt.aux_loss_coef,
                acts.z_loss(), opt.z_loss_coef);
  std::printf("wrote %zu gradients to %s\n", tensors.size(), o.out.c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "checkpoint folder (config.json + safetensors)")->required();
  app.add_option("--input-ids", o->input_ids, "JSON file {\"input_ids\": [...]}")->required();
  app.add_option("--out", o->out, "output safetensors: one F32 gradient per parameter (HF names)")->required();
  app.add_option("--precision", o->precision, "trainer precision: fp32, bf16, qat, qat-sym, ...")->capture_default_str();
  app.add_option("--aux-coef", o->aux, "load-balancing loss coefficient (default: HF's rule from config.json)");
  app.add_option("--z-coef", o->z, "router z-loss coefficient")->capture_default_str();
  return [o] { return run(*o); };
}

QUADS_COMMAND("grad", "Cross-entropy loss of a token sequence and the gradient of every parameter", setup);

}  // namespace
