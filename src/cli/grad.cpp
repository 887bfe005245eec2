// quads grad: mean next-token cross-entropy of one sequence and the gradient of every parameter.
//   quads grad --model DIR --input-ids ids.json --out grads.safetensors [--precision MODE] [--device cuda]
// Prints the loss; writes every parameter's gradient as F32 under its HF name (per expert). With
// --device cuda the trainer's forward and backward run on the GPU (cuda::GpuTrainer through
// train::TrainBackend), router losses included; the cross-entropy and its dlogits on the host.
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/input_ids.h"
#include "common/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "train/backend.h"
#include "train/losses.h"

#ifdef QUADS_HAVE_CUDA
#include "cuda/device.h"
#include "rl/run.h"
#endif

namespace {

struct Options {
  std::string model, input_ids, out, precision = "fp32", device = "cpu";
  double aux = -1, z = 0;
};


int run(const Options& o) {
  using namespace quads::model;
  Weights w = Weights::load(o.model);
  const PrecisionConfig prec = PrecisionConfig::preset(o.precision);
  const Batch b = Batch::of({quads::cli::read_input_ids(o.input_ids, 2)});
  const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
  ForwardOptions opt;
  // As HF: the aux loss joins the loss only with output_router_logits (unless --aux-coef is given).
  opt.aux_loss_coef = o.aux >= 0 ? o.aux : w.cfg.effective_aux_loss_coef();
  opt.z_loss_coef = o.z;
  std::vector<float> logits(T * V), dlogits(T * V);
  std::vector<float> grads(w.size(), 0.f);
  const auto targets = quads::train::next_token_targets(b);
  double ce = 0, aux = 0, z = 0;
  if (o.device == "cuda") {
#ifdef QUADS_HAVE_CUDA
    quads::rl::install_cuda_rollouts();
    QUADS_CHECK(quads::cuda::device_count() > 0, "grad: --device cuda, but no CUDA device was found (use --device cpu)");
#endif
    std::unique_ptr<quads::train::TrainBackend> g;
    try {
      g = quads::train::gpu_train_backend_factory()(w, prec);
    } catch (const quads::Error& e) {
      quads::fail("grad: --device cuda: {}", e.what());
    }
    g->set_router_losses(opt.aux_loss_coef, opt.z_loss_coef);
    g->forward(b, logits.data(), true);
    ce = quads::train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data());
    g->backward(dlogits.data(), grads.data());
    aux = g->router_losses().aux;
    z = g->router_losses().z;
  } else {
    Model m(w, prec);
    Activations acts;
    m.forward(b, logits.data(), &acts, opt);
    ce = quads::train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data());
    m.backward(acts, dlogits.data(), grads.data());
    aux = acts.aux_loss();
    z = acts.z_loss();
  }
  std::vector<quads::io::TensorData> tensors;
  for (const auto& p : w.layout.params)
    tensors.push_back(quads::io::TensorData::from_f32(p.name, p.shape, grads.data() + p.offset));
  quads::io::write_safetensors(o.out, tensors, {{"format", "pt"}});
  const double loss = ce + opt.aux_loss_coef * aux + opt.z_loss_coef * z;
  std::printf("loss %.9f\n", loss);
  if (opt.aux_loss_coef != 0 || opt.z_loss_coef != 0)
    std::printf("cross-entropy %.9f aux %.9f (coef %g) z %.9f (coef %g)\n", ce, aux, opt.aux_loss_coef, z,
                opt.z_loss_coef);
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
  app.add_option("--device", o->device, "where the forward and backward run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  return [o] { return run(*o); };
}

QUADS_COMMAND("grad", "Cross-entropy loss of a token sequence and the gradient of every parameter", setup);

}  // namespace
