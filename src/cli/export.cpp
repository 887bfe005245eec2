// quads export: a checkpoint for other inference stacks (docs/export.md).
//   quads export --model DIR --out DIR2 --format hf [--dtype f32|bf16] [--max-shard-gb G]
//   quads export --model DIR --out DIR2 --format nvfp4 [--data FILE.jsonl --tokenizer FILE]
//                [--calib-samples N] [--calib-len L] [--seed S] [--no-input-scale]
// nvfp4 writes the NVIDIA ModelOpt layout (vLLM --quantization modelopt, TensorRT-LLM); its
// input_scale comes from running the model (bf16 numerics) on the calibration prompts.
#include <cstdio>
#include <filesystem>

#include "analysis/prompts.h"
#include "cli/command.h"
#include "common/error.h"
#include "io/export.h"
#include "io/safetensors.h"
#include "model/model.h"

namespace {

namespace fs = std::filesystem;
using namespace quads;

struct Options {
  std::string model, out, format = "hf", dtype, precision = "nvfp4", calib_precision = "bf16";
  double max_shard_gb = 5.0;
  bool no_input_scale = false;
  analysis::PromptSource prompts;
};

int run(Options& o) {
  std::error_code ec;
  QUADS_CHECK(!fs::equivalent(o.model, o.out, ec), "--out {} is the model folder; write elsewhere", o.out);
  io::ExportOptions opt;
  opt.format = io::parse_export_format(o.format);
  const std::string dtype = o.dtype.empty() ? (opt.format == io::ExportFormat::NVFP4 ? "bf16" : "f32") : o.dtype;
  opt.bf16 = dtype == "bf16";
  opt.max_shard_bytes = static_cast<size_t>(o.max_shard_gb * 1e9);
  opt.precision = o.precision;
  model::Weights w = model::Weights::load(o.model);

  if (opt.format == io::ExportFormat::NVFP4 && !o.no_input_scale) {
    o.prompts.vocab = w.cfg.vocab_size;
    auto prompts = analysis::load_prompts(o.prompts);
    model::Weights copy = w;
    model::Model m(copy, model::PrecisionConfig::preset(o.calib_precision));
    opt.input_amax = io::calibrate_input_amax(m, prompts);
    int64_t ntok = 0;
    for (const auto& p : prompts) ntok += static_cast<int64_t>(p.size());
    std::printf("calibrated input scales on %zu prompts (%lld tokens, %s, %s numerics)\n", prompts.size(),
                static_cast<long long>(ntok), o.prompts.data.empty() ? "random token ids" : o.prompts.data.c_str(),
                o.calib_precision.c_str());
  }
  io::ExportReport rep = io::export_checkpoint(w, o.out, opt, o.model);
  // A tokenizer given for the calibration data travels along when the model folder has none.
  if (!o.prompts.tokenizer.empty() && !fs::exists(fs::path(o.out) / "tokenizer.json")) {
    fs::copy_file(o.prompts.tokenizer, fs::path(o.out) / "tokenizer.json", fs::copy_options::overwrite_existing);
    rep.files.push_back("tokenizer.json");
  }
  std::printf("%s: %s export, %d linears in NVFP4, %zu excluded, high precision %s, %zu bytes of weights\n",
              o.out.c_str(), o.format.c_str(), rep.quantized, rep.excluded.size(), dtype.c_str(), rep.bytes);
  for (const auto& f : rep.files) std::printf("  %s\n", f.c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  o->prompts.count = 32;
  o->prompts.max_len = 128;
  app.add_option("--model", o->model, "checkpoint folder (config.json + safetensors)")->required();
  app.add_option("--out", o->out, "output folder")->required();
  app.add_option("--format", o->format, "hf (F32/BF16 safetensors) or nvfp4 (ModelOpt NVFP4)")
      ->check(CLI::IsMember({"hf", "nvfp4"}));
  app.add_option("--dtype", o->dtype, "unquantized tensors: f32 or bf16 (default: f32 for hf, bf16 for nvfp4)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--max-shard-gb", o->max_shard_gb, "shard the safetensors above this size (GB)");
  app.add_option("--precision", o->precision, "nvfp4: the preset whose quantized linears are exported in NVFP4");
  app.add_option("--data", o->prompts.data, "nvfp4 calibration prompts (JSONL, field 'prompt'); default random ids");
  app.add_option("--tokenizer", o->prompts.tokenizer, "tokenizer file for --data (HF tokenizer.json or quads char)");
  app.add_option("--calib-samples", o->prompts.count, "calibration prompts");
  app.add_option("--calib-len", o->prompts.max_len, "tokens per calibration prompt (at most)");
  app.add_option("--calib-precision", o->calib_precision, "numerics of the calibration forward");
  app.add_option("--seed", o->prompts.seed, "seed of the random calibration ids");
  app.add_flag("--no-input-scale", o->no_input_scale, "nvfp4: no calibration, no input_scale (dynamic activations)");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("export", "export a checkpoint as HF safetensors or in the ModelOpt NVFP4 layout (vLLM, TensorRT-LLM)",
              setup);
