// quads analyze layers: where the NVFP4 rollout error comes from (docs/analysis.md).
//   quads analyze layers --model DIR --out DIR2 [--data FILE.jsonl --tokenizer FILE]
//                        [--batches 4] [--batch-size 8] [--len 64] [--topk 16] [--rac-ratio 0.5] [--seed 0]
// Writes DIR2/layers.json, summary.txt and gnuplot PNGs; prints the summary.
#include <cstdio>

#include "analysis/layers.h"
#include "analysis/prompts.h"
#include "cli/command.h"
#include "common/error.h"

namespace {

using namespace quads;

struct Options {
  std::string model, out;
  int batches = 4, batch_size = 8;
  analysis::PromptSource prompts;
  analysis::LayersOptions layers;
};

int run(Options& o) {
  QUADS_CHECK(o.batches > 0 && o.batch_size > 0, "--batches and --batch-size must be positive");
  model::Weights w = model::Weights::load(o.model);
  o.prompts.vocab = w.cfg.vocab_size;
  o.prompts.count = o.batches * o.batch_size;
  auto prompts = analysis::load_prompts(o.prompts);
  std::vector<model::Batch> batches;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (i % size_t(o.batch_size) == 0) batches.emplace_back();
    batches.back().add(prompts[i]);
  }
  auto report = analysis::analyze_layers(w, batches, o.layers);
  report["model"] = o.model;
  report["data"] = o.prompts.data.empty() ? "random token ids" : o.prompts.data;
  auto files = analysis::write_layers_report(report, o.out);
  std::printf("%s", analysis::layers_summary(report).c_str());
  for (const auto& f : files) std::printf("  %s/%s\n", o.out.c_str(), f.c_str());
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<Options>();
  o->prompts.max_len = 64;
  app.require_subcommand(1);
  CLI::App* layers = app.add_subcommand("layers", "per-layer NVFP4 error: weights vs activations, channels, log-prob gaps");
  layers->add_option("--model", o->model, "checkpoint folder")->required();
  layers->add_option("--out", o->out, "output folder")->required();
  layers->add_option("--data", o->prompts.data, "prompts (JSONL, field 'prompt'); default random token ids");
  layers->add_option("--tokenizer", o->prompts.tokenizer, "tokenizer file for --data");
  layers->add_option("--batches", o->batches, "batches (>= 2 for channel persistence)");
  layers->add_option("--batch-size", o->batch_size, "prompts per batch");
  layers->add_option("--len", o->prompts.max_len, "tokens per prompt (at most)");
  layers->add_option("--topk", o->layers.topk, "channels in each top-k set");
  layers->add_option("--rac-ratio", o->layers.rac_ratio, "share of channels RAC compensates");
  layers->add_option("--seed", o->prompts.seed, "seed of random prompts");
  return [o] { return run(*o); };
}

}  // namespace

QUADS_COMMAND("analyze", "error analysis: `quads analyze layers` (NVFP4 error per layer, weights vs activations)", setup);
