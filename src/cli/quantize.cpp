// quads quantize: a checkpoint's weights into the layouts inference engines load (docs/formats.md).
//   quads quantize --format nvfp4 [--block2d] --in model.safetensors --out model-nvfp4.safetensors
//                  [--include REGEX] [--exclude REGEX] [--verify]
//   quads quantize --format mxfp4 ...            quads quantize --format fp8 [--fp8-block 128] ...
// The 2-D F32/BF16/F16 tensors whose name ends in ".weight" (and pass the filters) are quantized
// through num::quantize; everything else is copied unchanged. Prints the error of each quantized
// tensor (relative MSE, SQNR, max abs error of the dequantized weights) and writes atomically.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/command.h"
#include "common/error.h"
#include "common/progress.h"
#include "io/quantized_checkpoint.h"

namespace {

using namespace quads::io;

struct Options {
  std::string format = "nvfp4", in, out, include, exclude;
  bool block2d = false, verify = false, quiet = false;
  int fp8_block = 0;
};

// Below this input size the bar would only flash by.
constexpr size_t kProgressMinBytes = size_t(256) << 20;

int run(const Options& o) {
  QuantizeOptions opt;
  opt.format = parse_checkpoint_format(o.format);
  opt.block2d = o.block2d;
  opt.fp8_block = o.fp8_block;
  opt.include = o.include;
  opt.exclude = o.exclude;
  QUADS_CHECK(!o.block2d || opt.format == CheckpointFormat::NVFP4, "--block2d applies to --format nvfp4 only");
  QUADS_CHECK(o.fp8_block == 0 || opt.format == CheckpointFormat::FP8, "--fp8-block applies to --format fp8 only");
  std::error_code ec;
  QUADS_CHECK(!std::filesystem::equivalent(o.in, o.out, ec), "--out {} is the input file; write elsewhere", o.out);

  std::unique_ptr<quads::ProgressBar> bar;
  const size_t in_size = std::filesystem::file_size(o.in, ec);
  const bool show_progress = !ec && in_size >= kProgressMinBytes;
  auto progress = [&](size_t done, size_t total, size_t bytes) {
    if (!show_progress) return;
    if (!bar) bar = std::make_unique<quads::ProgressBar>(static_cast<int64_t>(total), "quantize");
    bar->update(static_cast<int64_t>(done), {{"GB", static_cast<double>(bytes) / 1e9}});
  };
  QuantizeReport rep = quantize_checkpoint(o.in, o.out, opt, progress);
  if (bar) bar->finish();

  size_t name_w = 6;
  for (const auto& t : rep.tensors) name_w = std::max(name_w, t.name.size());
  for (const auto& t : rep.tensors)
    if (t.action == Action::Unfit)
      std::fprintf(stderr, "warning: %s %s: %s; copied unchanged\n", t.name.c_str(), shape_str(t.shape).c_str(),
                   t.reason.c_str());
  const TensorReport* worst = nullptr;
  if (!o.quiet)
    std::printf("%s\n", fmt::format("{:<{}}  {:<14} {:<6}  {:>10} {:>9} {:>10}", "tensor", name_w, "shape", "dtype",
                                    "rel_mse", "sqnr_dB", "max_abs")
                            .c_str());
  for (const auto& t : rep.tensors) {
    if (t.action == Action::Quantize && (!worst || t.stats.sqnr_db < worst->stats.sqnr_db)) worst = &t;
    if (o.quiet) continue;
    std::string line = fmt::format("{:<{}}  {:<14} {:<6}", t.name, name_w, shape_str(t.shape), dtype_name(t.dtype));
    if (t.action == Action::Quantize)
      line += fmt::format("  {:>10.3e} {:>9.2f} {:>10.3e}", t.stats.rel_mse, t.stats.sqnr_db, t.stats.max_abs);
    else
      line += fmt::format("  copied ({})", t.reason);
    std::printf("%s\n", line.c_str());
  }
  std::printf("%s: %d tensors quantized to %s, %d copied, %d copied with a warning; %zu -> %zu bytes (%.3fx)\n",
              o.out.c_str(), rep.quantized, opt.describe().c_str(), rep.copied, rep.unfit, rep.in_bytes, rep.out_bytes,
              rep.in_bytes ? static_cast<double>(rep.out_bytes) / static_cast<double>(rep.in_bytes) : 0.0);
  if (worst)
    std::printf("lowest SQNR: %.2f dB (%s)\n", worst->stats.sqnr_db, worst->name.c_str());
  if (o.verify) {
    verify_quantized_checkpoint(o.in, o.out, opt, rep);
    std::printf("verify: %s reads back and decodes to the values written\n", o.out.c_str());
  }
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--format", o->format, "nvfp4 (ModelOpt layout), mxfp4 or fp8")
      ->check(CLI::IsMember({"nvfp4", "mxfp4", "fp8"}));
  app.add_option("--in", o->in, "input .safetensors")->required();
  app.add_option("--out", o->out, "output .safetensors (written atomically)")->required();
  app.add_flag("--block2d", o->block2d, "nvfp4: one scale per 16x16 weight tile");
  app.add_option("--fp8-block", o->fp8_block, "fp8: 128 for 128x128 block scales (NAME_scale_inv); 0 = per tensor")
      ->check(CLI::IsMember({0, 128}));
  app.add_option("--include", o->include, "quantize only weights whose name matches this regex");
  app.add_option("--exclude", o->exclude,
                 "leave weights whose name matches this regex unquantized, e.g. 'embed_tokens|lm_head|mlp\\.gate\\.'");
  app.add_flag("--verify", o->verify, "read the output back and check it against the input");
  app.add_flag("--quiet", o->quiet, "print only the summary, not one line per tensor");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("quantize", "quantize a checkpoint's weights to nvfp4 / mxfp4 / fp8 in the layout inference engines load",
              setup);
