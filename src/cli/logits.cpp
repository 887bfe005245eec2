// quads logits: the logits of one sequence under a precision mode.
//   quads logits --model DIR --input-ids ids.json [--precision MODE] --out logits.f32
// ids.json is {"input_ids": [...]}; the output is raw little-endian float32 [tokens, vocab].
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/input_ids.h"
#include "common/error.h"
#include "io/safetensors.h"
#include "model/model.h"

namespace {

struct Options {
  std::string model, input_ids, out, precision = "fp32", filter;
  int keep_last_high = 0;
  bool blas = false;
};


int run(const Options& o) {
  using namespace quads::model;
  Weights w = Weights::load(o.model);
  PrecisionConfig p = PrecisionConfig::preset(o.precision);
  p.filter = o.filter;
  p.keep_last_high = o.keep_last_high;
  const std::vector<int32_t> ids = quads::cli::read_input_ids(o.input_ids, 1);
  Model m(w, p);
  if (o.blas) m.forward_gemm = GemmMode::Blas;
  const Batch b = Batch::of({ids});
  std::vector<float> logits(b.ntokens() * w.cfg.vocab_size);
  m.forward(b, logits.data());
  quads::io::write_file_atomic(o.out, logits.data(), logits.size() * sizeof(float));
  std::printf("%s\nprecision %s\nwrote %lld x %d float32 logits to %s\n", w.cfg.describe().c_str(),
              p.describe().c_str(), static_cast<long long>(b.ntokens()), w.cfg.vocab_size, o.out.c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "checkpoint folder (config.json + safetensors)")->required();
  app.add_option("--input-ids", o->input_ids, "JSON file {\"input_ids\": [...]}")->required();
  app.add_option("--out", o->out, "output: raw little-endian float32 [tokens, vocab]")->required();
  app.add_option("--precision", o->precision, "precision mode: fp32 bf16 fp8 fp8-tensor nvfp4 nvfp4-2d nvfp4-tensor "
                                              "nvfp4-static nvfp4-w4a16 mxfp4 qat qat-sym")
      ->capture_default_str();
  app.add_option("--filter", o->filter, "regex on module names: only matching linears are quantized");
  app.add_option("--keep-last-high", o->keep_last_high, "keep the last N decoder layers in high precision (bf16)");
  app.add_flag("--blas", o->blas, "OpenBLAS GEMMs in the forward (faster, not batch-invariant)");
  return [o] { return run(*o); };
}

QUADS_COMMAND("logits", "Compute the logits of a token sequence under a precision mode", setup);

}  // namespace
