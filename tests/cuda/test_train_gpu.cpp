// The GPU trainer (cuda/train_gpu.h) against the CPU trainer (model::Model forward/backward,
// train::AdamW) and the transformers references of the fixture tiny_qwen3moe_a: logits, loss and
// every gradient in fp32; bf16 / qat / qat-sym against the CPU model in the same preset; the QAT
// weight operand against model::LinearQ::wq; routing record; packed sequences; AdamW; the
// TrainBackend adapter; a short SFT loop. Every test skips itself without a GPU. Measured
// deviations are printed on lines with "rel L2" (scripts/gpu/test_and_bench.sh greps them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/fixtures.h"
#include "cuda/model_gpu.h"
#include "cuda/train_gpu.h"
#include "cuda_test_util.h"
#include "model/model.h"
#include "numerics/formats.h"
#include "reqat/kv_quant.h"
#include "reqat/reqat_test_util.h"
#include "reqat/trainer.h"
#include "rl/char_tokenizer.h"
#include "rl/run.h"
#include "rl/tasks.h"
#include "rollout/engine.h"
#include "train/adamw.h"
#include "train/losses.h"

using namespace quads;
using namespace quads::cuda::testing;

namespace {




std::vector<int32_t> random_tokens(int64_t n, uint64_t seed, int vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % uint64_t(vocab));
  return t;
}

// What the CPU trainer computes for one batch: logits, mean next-token CE, every gradient.
struct CpuResult {
  std::vector<float> logits, grads;
  double loss = 0;
  model::Routing routing;
};
CpuResult cpu_train_step(model::Weights& w, const std::string& preset, const model::Batch& b,
                         const model::KvTransform* kv = nullptr) {
  model::Model m(w, model::PrecisionConfig::preset(preset));
  if (kv) m.kv_hooks = reqat::make_kv_hooks(w.cfg, *kv);
  const int64_t T = b.ntokens(), V = m.config().vocab_size;
  CpuResult r;
  r.logits.resize(T * V);
  std::vector<float> dlogits(T * V);
  model::Activations acts;
  model::ForwardOptions opt;
  opt.record = &r.routing;
  m.forward(b, r.logits.data(), &acts, opt);
  const auto targets = train::next_token_targets(b);
  r.loss = train::cross_entropy(r.logits.data(), T, V, targets.data(), nullptr, dlogits.data());
  r.grads.assign(w.size(), 0.f);
  m.backward(acts, dlogits.data(), r.grads.data());
  return r;
}

// The same on the GPU through the device CE path (replay: routing replay of given choices).
CpuResult gpu_train_step(cuda::GpuTrainer& g, const model::Batch& b, const model::Routing* replay = nullptr) {
  const int64_t T = b.ntokens(), V = g.config().vocab_size;
  CpuResult r;
  r.logits.resize(T * V);
  g.zero_grad();
  g.forward(b, r.logits.data(), true, &r.routing, replay);
  r.loss = g.loss_ce(train::next_token_targets(b));
  r.grads = g.grads();
  return r;
}

// Worst per-tensor relative L2 of a against b over tensors whose reference is not all zero
// (unused experts must be exactly zero in a as well), and the rel L2 of the whole buffer.
struct GradCompare {
  double worst = 0, all = 0;
  std::string worst_name;
};
GradCompare compare_grads(const model::Layout& lay, const std::vector<float>& a, const std::vector<float>& ref,
                          bool zero_exact) {
  GradCompare c;
  for (const auto& p : lay.params) {
    const float* r = ref.data() + p.offset;
    const float* x = a.data() + p.offset;
    if (std::all_of(r, r + p.numel, [](float v) { return v == 0.f; })) {
      if (zero_exact) {
        for (size_t i = 0; i < p.numel; ++i) EXPECT_EQ(x[i], 0.f) << p.name << " should have no gradient";
      }
      continue;
    }
    const double e = rel_l2(x, r, p.numel);
    if (e > c.worst) {
      c.worst = e;
      c.worst_name = p.name;
    }
  }
  c.all = rel_l2(a, ref);
  return c;
}

}  // namespace

// fp32: the exact path against the transformers references and against the CPU trainer.
TEST(CudaTrain, Fp32LogitsLossAndEveryGradientMatchReferenceAndCpu) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const model::Batch b = model::Batch::of({input_ids()});
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("fp32"));
  EXPECT_EQ(g.linear_path("model.layers.0.self_attn.q_proj"), "exact");
  EXPECT_EQ(g.linear_path("lm_head"), "exact");
  const CpuResult gr = gpu_train_step(g, b);
  const CpuResult cr = cpu_train_step(w, "fp32", b);

  const auto ref_logits = read_f32(fixture("logits.f32"));
  const double lr_ref = rel_l2(gr.logits, ref_logits), lr_cpu = rel_l2(gr.logits, cr.logits);
  std::printf("fp32 logits rel L2: vs transformers %.3g, vs CPU %.3g\n", lr_ref, lr_cpu);
  EXPECT_LT(lr_ref, 1e-5);
  EXPECT_LT(lr_cpu, 1e-5);
  const double ref_loss = read_json(fixture("loss.json"))["loss"].get<double>();
  std::printf("fp32 loss: GPU %.9f CPU %.9f transformers %.9f\n", gr.loss, cr.loss, ref_loss);
  EXPECT_NEAR(gr.loss, ref_loss, 1e-5);
  EXPECT_NEAR(gr.loss, cr.loss, 1e-6);

  std::vector<float> ref(w.size(), 0.f);
  model::read_hf_tensors({fixture("grads.safetensors")}, w.cfg, w.layout, ref.data(), /*require_all=*/true);
  const GradCompare vr = compare_grads(w.layout, gr.grads, ref, true);
  const GradCompare vc = compare_grads(w.layout, gr.grads, cr.grads, true);
  std::printf("fp32 grads rel L2 vs transformers: all %.3g, worst %.3g (%s)\n", vr.all, vr.worst, vr.worst_name.c_str());
  std::printf("fp32 grads rel L2 vs CPU: all %.3g, worst %.3g (%s)\n", vc.all, vc.worst, vc.worst_name.c_str());
  EXPECT_LT(vr.all, 1e-5);
  EXPECT_LT(vr.worst, 1e-4);  // the CPU's own bound against the reference (tests/model)
  EXPECT_LT(vc.all, 1e-5);
  EXPECT_LT(vc.worst, 1e-4);

  // The routing record: the same expert ids as the CPU's, layer by layer.
  ASSERT_EQ(gr.routing.experts.size(), cr.routing.experts.size());
  for (size_t l = 0; l < cr.routing.experts.size(); ++l) EXPECT_EQ(gr.routing.experts[l], cr.routing.experts[l]) << l;

  // Routing replay of the recorded choices reproduces the same logits bit for bit.
  std::vector<float> replayed(gr.logits.size());
  g.forward(b, replayed.data(), false, nullptr, &gr.routing);
  EXPECT_EQ(cuda::testing::first_float_mismatch(replayed, gr.logits), -1);
}

// bf16 and qat run the fast path (BF16 tensor-core GEMMs, dY rounded to BF16 in the backward) with
// the tensor-core attention by default; "qat+exact" is qat with the exact FP32 attention; qat-sym
// the exact path with NVFP4 activations. Tolerances: with exact attention the forward differs from
// the CPU only in the FP32 accumulation order and the backward adds BF16 rounding of dY (2^-9
// relative per element); the tensor-core attention adds BF16 rounding of q, k, v, P, dO and dS
// (a few 2^-9 relative in every attention output and gradient). There the GPU replays the CPU's
// expert choices, so that a near-tie the rounding flips cannot swap an expert's gradient.
class CudaTrainPreset : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaTrainPreset, MatchesCpuInTheSamePreset) {
  QUADS_REQUIRE_GPU();
  const std::string param = GetParam();
  const bool exact_attn = param.size() > 6 && param.compare(param.size() - 6, 6, "+exact") == 0;
  const std::string preset = exact_attn ? param.substr(0, param.size() - 6) : param;
  model::Weights w = fixture_weights();
  const auto ids = input_ids();
  const model::Batch b = model::Batch::of({ids, random_tokens(17, 3, w.cfg.vocab_size)});
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset(preset));
  const bool fast = preset != "qat-sym";
  EXPECT_EQ(g.linear_path("model.layers.1.mlp.experts.3.down_proj"), fast ? "fast" : "exact");
  EXPECT_EQ(g.linear_path("model.layers.1.mlp.gate"), "fast");  // the router stays bf16 in these presets
  EXPECT_EQ(g.attention(), fast ? "tc" : "exact");              // the default
  if (exact_attn) g.set_attention("exact");
  const bool tc = g.attention() == "tc";
  const CpuResult cr = cpu_train_step(w, preset, b);
  const CpuResult gr = gpu_train_step(g, b, tc ? &cr.routing : nullptr);
  const double el = rel_l2(gr.logits, cr.logits);
  const GradCompare gc = compare_grads(w.layout, gr.grads, cr.grads, false);
  std::printf("%s (%s attention) vs CPU rel L2: logits %.3g, grads all %.3g, worst tensor %.3g (%s); loss GPU %.7f "
              "CPU %.7f\n",
              preset.c_str(), g.attention().c_str(), el, gc.all, gc.worst, gc.worst_name.c_str(), gr.loss, cr.loss);
  size_t flips = 0;
  for (size_t l = 0; l < cr.routing.experts.size(); ++l)
    for (size_t i = 0; i < cr.routing.experts[l].size(); ++i) flips += gr.routing.experts[l][i] != cr.routing.experts[l][i];
  EXPECT_LE(flips, tc ? 0u : 3u) << "expert choices that differ from the CPU's";
  // Measured on the H200 with exact attention: bf16 logits 3.3e-4 / grads 3.4e-3 (worst 4.9e-3);
  // qat 7.9e-8 / 3.3e-3 (4.0e-3); qat-sym 7.7e-8 / 1.4e-3 (2.8e-3). With the tensor-core
  // attention: bf16 7.8e-3 / 1.3e-2 (3.0e-2), qat 6.8e-3 / 1.0e-2 (1.7e-2).
  if (tc) {
    EXPECT_LT(el, 2e-2);
    EXPECT_NEAR(gr.loss, cr.loss, 1e-2);
    EXPECT_LT(gc.all, 3e-2);
    EXPECT_LT(gc.worst, 1e-1);
  } else {
    EXPECT_LT(el, preset == "bf16" ? 1e-3 : 1e-6);  // qat / qat-sym: the CPU's forward up to FP32 sum order
    EXPECT_NEAR(gr.loss, cr.loss, 1e-3);
    EXPECT_LT(gc.all, 1e-2);
    EXPECT_LT(gc.worst, 3e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(CudaTrain, CudaTrainPreset, ::testing::Values("bf16", "qat", "qat+exact", "qat-sym"));

// The expert GEMMs grouped (one cuBLAS call per kind and layer) or spread over streams are the
// same cuBLAS problems as the per-expert path: the same logits and gradients (bf16: gate and up
// fused; qat: separate with per-expert alphas and the up projection's dX accumulated after gate's).
TEST(CudaTrain, GroupedExpertGemmsEqualPerExpert) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const model::Batch b = model::Batch::of({input_ids(), random_tokens(23, 7, w.cfg.vocab_size)});
  for (const char* preset : {"bf16", "qat"}) {
    cuda::GpuTrainer g(w, model::PrecisionConfig::preset(preset));
    g.set_expert_gemms("per-expert");
    const CpuResult ref = gpu_train_step(g, b);
    for (const char* mode : {"grouped", "streams"}) {
      g.set_expert_gemms(mode);
      const CpuResult r = gpu_train_step(g, b, &ref.routing);
      const double el = rel_l2(r.logits, ref.logits), eg = rel_l2(r.grads, ref.grads);
      const bool same = first_float_mismatch(r.logits, ref.logits) < 0 && first_float_mismatch(r.grads, ref.grads) < 0;
      std::printf("%s experts %s (ran: %s) vs per-expert rel L2: logits %.3g, grads %.3g%s\n", preset, mode,
                  g.expert_gemms().c_str(), el, eg, same ? " (same bits)" : "");
      EXPECT_LT(el, 1e-6) << preset << " " << mode;
      EXPECT_LT(eg, 1e-6) << preset << " " << mode;
      EXPECT_NEAR(r.loss, ref.loss, 1e-6) << preset << " " << mode;
      if (std::string(mode) == "streams") {
        EXPECT_TRUE(same) << preset << ": the same GEMMs on other streams";
      }
    }
  }
  // cuBLASLt with the bucketed algorithm cache (default) against cublasGemmEx's own choice
  // (QUADS_GPU_TRAIN_LT=0): other algorithms, so other FP32 summation orders, the same GEMMs.
  for (const char* preset : {"bf16", "qat"}) {
    cuda::GpuTrainer lt(w, model::PrecisionConfig::preset(preset));
    setenv("QUADS_GPU_TRAIN_LT", "0", 1);
    cuda::GpuTrainer ex(w, model::PrecisionConfig::preset(preset));
    unsetenv("QUADS_GPU_TRAIN_LT");
    const CpuResult a = gpu_train_step(lt, b), c = gpu_train_step(ex, b, &a.routing);
    const double el = rel_l2(a.logits, c.logits), eg = rel_l2(a.grads, c.grads);
    std::printf("%s cuBLASLt (%s) vs cublasGemmEx (%s) rel L2: logits %.3g, grads %.3g\n", preset,
                lt.expert_gemms().c_str(), ex.expert_gemms().c_str(), el, eg);
    EXPECT_LT(el, 1e-5) << preset;
    EXPECT_LT(eg, 1e-5) << preset;
    EXPECT_NE(lt.expert_gemms().find("cuBLASLt"), std::string::npos);
    EXPECT_NE(ex.expert_gemms().find("cublasGemmEx"), std::string::npos);
  }
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("fp32"));
  EXPECT_EQ(g.attention(), "exact");
  EXPECT_THROW(g.set_expert_gemms("fused"), Error);
  EXPECT_THROW(g.set_attention("flash"), Error);
}

// The QAT weight operand: BF16(code * E4M3 scale) from exactly the CPU's codes and scales, alpha =
// amax * fp32(1/2688), and operand * alpha equal to the CPU's W_eff up to the rounding of the scale
// product (the CPU forms (scale * amax) * (1/2688) first).
TEST(CudaTrain, QatOperandIsTheCpuQuantizedWeight) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("qat"));
  model::Model m(w, model::PrecisionConfig::preset("qat"));
  int checked = 0;
  double worst = 0;
  for (const model::LinearQ& L : m.linears()) {
    if (L.num.weight.kind != model::QuantKind::Quant) {
      if (L.num.weight.kind == model::QuantKind::BF16) {  // router, lm_head: plain BF16 of the master
        float alpha = 0;
        const auto wb = g.fast_weight(L.name, &alpha);
        EXPECT_EQ(alpha, 1.f) << L.name;
        const float* src = w.data.data() + L.offset;
        for (int64_t i = 0; i < L.out * L.in; ++i) ASSERT_EQ(wb[i], num::bf16_from_f32(src[i])) << L.name << " " << i;
      }
      continue;
    }
    ASSERT_EQ(g.linear_path(L.name), "fast") << L.name;
    float alpha = 0;
    const auto wb = g.fast_weight(L.name, &alpha);
    ASSERT_EQ(L.wq.amax.size(), 1u);
    EXPECT_EQ(alpha, L.wq.amax[0] * (1.f / 2688.f)) << L.name;
    const float* weff = m.effective_weights() + L.offset;
    const int64_t nb = L.in / 16;
    for (int64_t r = 0; r < L.out; ++r)
      for (int64_t c = 0; c < L.in; ++c) {
        const uint8_t byte = L.wq.codes[(r * L.in + c) / 2];
        const uint8_t code = (c % 2) ? byte >> 4 : byte & 15;
        const float v = num::e2m1_to_f32(code) * num::e4m3_to_f32(L.wq.scales[r * nb + c / 16]);
        const uint16_t got = wb[r * L.in + c];
        ASSERT_EQ(num::bf16_to_f32(got), v) << L.name << " [" << r << ", " << c << "]";
        ASSERT_EQ(got, num::bf16_from_f32(v));
        const float prod = v * alpha, want = weff[r * L.in + c];
        const double err = std::fabs(double(prod) - double(want));
        worst = std::max(worst, want != 0 ? err / std::fabs(double(want)) : err);
        ASSERT_LE(err, 4.0 * std::ldexp(std::fabs(double(want)), -23)) << L.name << " [" << r << ", " << c << "]";
      }
    ++checked;
  }
  std::printf("qat operand * alpha vs CPU W_eff: %d linears, worst relative difference %.3g\n", checked, worst);
  EXPECT_GT(checked, 50);
}

// Several packed sequences of different lengths: the same as the CPU, and each sequence's rows equal
// (up to accumulation order) what it gets alone: attention never crosses a boundary.
TEST(CudaTrain, PackedSequencesOfDifferentLengths) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const int V = w.cfg.vocab_size;
  const std::vector<std::vector<int32_t>> seqs = {random_tokens(5, 11, V), input_ids(), random_tokens(1, 12, V),
                                                  random_tokens(40, 13, V)};
  const model::Batch b = model::Batch::of(seqs);
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("fp32"));
  const CpuResult gr = gpu_train_step(g, b);
  const CpuResult cr = cpu_train_step(w, "fp32", b);
  const GradCompare gc = compare_grads(w.layout, gr.grads, cr.grads, true);
  const double el = rel_l2(gr.logits, cr.logits);
  std::printf("packed fp32 vs CPU rel L2: logits %.3g, grads all %.3g, worst %.3g (%s)\n", el, gc.all, gc.worst,
              gc.worst_name.c_str());
  EXPECT_LT(el, 1e-5);
  EXPECT_NEAR(gr.loss, cr.loss, 1e-6);
  EXPECT_LT(gc.all, 1e-5);
  EXPECT_LT(gc.worst, 1e-4);
  for (size_t s = 0; s < seqs.size(); ++s) {
    std::vector<float> alone(seqs[s].size() * V);
    g.forward(model::Batch::of({seqs[s]}), alone.data(), false);
    const float* packed = gr.logits.data() + b.offsets[s] * V;
    EXPECT_LT(rel_l2(alone.data(), packed, alone.size()), 1e-6) << "sequence " << s;
  }
}

// AdamW on the device against train::AdamW on the host, fed the same gradients, three steps with
// weight decay and clipping.
TEST(CudaTrain, AdamWMatchesHostAdamW) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const model::Batch b = model::Batch::of({input_ids()});
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("fp32"));
  train::AdamWConfig cfg;
  cfg.lr = 1e-3;
  cfg.weight_decay = 0.1;
  cfg.max_grad_norm = 0.5;
  train::AdamW host(w.size(), cfg, train::AdamW::decay_mask(w.layout));
  model::Weights gw = w;
  for (int step = 1; step <= 3; ++step) {
    g.zero_grad();
    g.forward(b, nullptr, true);
    g.loss_ce(train::next_token_targets(b));
    std::vector<float> gh = g.grads();
    const double hn = host.step(w.data.data(), gh.data());
    const double gn = g.adamw_step(cfg, step);
    EXPECT_NEAR(gn, hn, 1e-9 * hn) << "step " << step;
    g.download(gw);
    int64_t differ = 0, far = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      if (gw.data[i] == w.data[i]) continue;
      ++differ;
      // 2 ulp, or a millionth of a step where a parameter is so small that its ulp is tinier.
      const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(w.data[i]), 1e-30f)) - 23);
      far += std::fabs(double(gw.data[i]) - double(w.data[i])) > 2 * ulp + 1e-6 * cfg.lr;
    }
    std::printf("adamw step %d: grad norm GPU %.9g host %.9g; %lld of %zu parameters differ (rel L2 %.3g)\n", step, gn,
                hn, static_cast<long long>(differ), w.size(), rel_l2(gw.data, w.data));
    EXPECT_EQ(far, 0) << "parameters more than 2 ulp from the host's at step " << step;
    // Continue both from the host's masters, so that each step compares one update.
    g.upload(w);
  }
  std::vector<float> m, v;
  g.adam_state(&m, &v);
  EXPECT_LT(rel_l2(m, host.m), 1e-6);
  EXPECT_LT(rel_l2(v, host.v), 1e-6);
}

// The TrainBackend adapter: forward/backward through host buffers equal the direct calls, the
// gradient is added to what the caller's buffer holds, sync uploads new masters.
TEST(CudaTrain, BackendAdapterEqualsDirectCalls) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const model::Batch b = model::Batch::of({input_ids(), random_tokens(9, 5, w.cfg.vocab_size)});
  const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
  const auto p = model::PrecisionConfig::preset("qat");
  auto be = cuda::make_gpu_trainer(w, p);
  EXPECT_EQ(be->name().rfind("cuda:", 0), 0u) << be->name();
  cuda::GpuTrainer g(w, p);

  std::vector<float> l1(T * V), l2(T * V), dl(T * V);
  model::Routing r1, r2;
  be->forward(b, l1.data(), true, &r1);
  g.forward(b, l2.data(), true, &r2);
  EXPECT_EQ(cuda::testing::first_float_mismatch(l1, l2), -1);
  EXPECT_EQ(r1.experts, r2.experts);
  const auto targets = train::next_token_targets(b);
  train::cross_entropy(l1.data(), T, V, targets.data(), nullptr, dl.data());
  std::vector<float> ga(w.size(), 0.5f);
  be->backward(dl.data(), ga.data());
  g.zero_grad();
  g.backward(dl.data());
  const std::vector<float> gd = g.grads();
  int64_t bad = 0;
  for (size_t i = 0; i < gd.size(); ++i) bad += ga[i] != 0.5f + gd[i];
  EXPECT_EQ(bad, 0);
  // A second backward accumulates on the device (twice the gradient); with a host buffer, that
  // buffer receives the call's own gradient only.
  std::vector<float> gh(w.size(), 0.f);
  g.backward(dl.data(), gh.data());
  std::vector<float> g2 = g.grads(), twice(gd.size());
  for (size_t i = 0; i < gd.size(); ++i) twice[i] = 2.f * gd[i];
  EXPECT_LT(rel_l2(g2, twice), 1e-6);
  EXPECT_LT(rel_l2(gh, gd), 1e-6);

  // sync: new masters change the logits; the same masters give the same logits back.
  model::Weights w2 = w;
  for (auto& x : w2.data) x *= 1.01f;
  be->sync(w2);
  be->forward(b, l2.data(), false);
  EXPECT_GT(rel_l2(l2, l1), 1e-4);
  be->sync(w);
  be->forward(b, l2.data(), false);
  EXPECT_EQ(cuda::testing::first_float_mismatch(l1, l2), -1);
}

// The GPU trainer's masters straight into a GPU rollout engine (RolloutEngine::sync_device, the RL
// loop's weight sync with both on the GPU): after an AdamW step on the device the rollout model
// generates bit for bit what a sync through the host gives, and its host copy (the CPU model) comes
// back from the device when asked for. GpuModel refuses memory that is not a GPU's or another layout.
TEST(CudaTrain, RolloutEngineSyncsFromTheTrainersMasters) {
  QUADS_REQUIRE_GPU();
  const model::Weights& w = fixture_weights();
  const auto ids = input_ids();
  const model::Batch b = model::Batch::of({ids});
  const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
  auto be = cuda::make_gpu_trainer(w, model::PrecisionConfig::preset("qat"));
  ASSERT_TRUE(be->has_optimizer());
  train::AdamWConfig ac;
  ac.lr = 1e-2;
  train::AdamW opt(w.size(), ac, train::AdamW::decay_mask(w.layout));
  std::vector<float> logits(T * V), dl(T * V);
  be->forward(b, logits.data(), true);
  const auto targets = train::next_token_targets(b);
  train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dl.data());
  be->backward(dl.data(), nullptr);
  be->optimizer_step(opt);
  const model::DeviceWeights dm = be->device_masters();
  ASSERT_FALSE(dm.empty());
  EXPECT_EQ(dm.size, w.size());
  EXPECT_EQ(dm.device, "cuda");
  model::Weights host = w;
  be->download(host, nullptr);
  ASSERT_GT(rel_l2(host.data, w.data), 1e-5) << "the step must move the masters for this test to mean anything";

  const auto prec = model::PrecisionConfig::preset("nvfp4");
  rollout::RolloutEngine via_host(w, prec), via_dev(w, prec);
  via_host.set_backend(cuda::make_gpu_backend(w, prec));
  via_dev.set_backend(cuda::make_gpu_backend(w, prec));
  via_host.sync(host);
  ASSERT_TRUE(via_dev.sync_device(be->device_masters()));
  rollout::Request r;
  r.prompt.assign(ids.begin(), ids.begin() + 6);
  r.max_new_tokens = 8;
  r.sampling.temperature = 0.8;
  r.seed = 7;
  const rollout::Result a = via_host.generate({r})[0], d = via_dev.generate({r})[0];
  EXPECT_EQ(d.tokens, a.tokens);
  EXPECT_EQ(d.logprobs, a.logprobs);
  model::StepItem it;
  it.tokens = r.prompt;
  model::KVCache c1(w.cfg, 1), c2(w.cfg, 1);
  rollout::RolloutEngine cpu(host, prec);
  EXPECT_EQ(via_dev.model().step(c1, {it}), cpu.model().step(c2, {it})) << "the CPU model of the fetched masters";

  cuda::GpuModel g(w, prec);
  EXPECT_THROW(g.sync_device({host.data.data(), host.data.size(), "cpu"}), Error);
  EXPECT_THROW(g.sync_device({dm.data, dm.size - 1, "cuda"}), Error);
}

// A short SFT loop (forward, device CE + backward, device AdamW) lowers the loss and follows the
// CPU trainer's losses.
TEST(CudaTrain, SftLoopLowersTheLossLikeTheCpu) {
  QUADS_REQUIRE_GPU();
  for (const char* preset : {"fp32", "qat"}) {
    model::Weights wc = fixture_weights();
    const model::Batch b = model::Batch::of({input_ids(), random_tokens(30, 21, wc.cfg.vocab_size)});
    const int64_t T = b.ntokens(), V = wc.cfg.vocab_size;
    const auto targets = train::next_token_targets(b);
    train::AdamWConfig cfg;
    cfg.lr = 3e-3;
    cfg.max_grad_norm = 1.0;
    model::Model m(wc, model::PrecisionConfig::preset(preset));
    train::AdamW opt(wc.size(), cfg, train::AdamW::decay_mask(wc.layout));
    cuda::GpuTrainer g(wc, model::PrecisionConfig::preset(preset));
    std::vector<double> lc, lg;
    std::vector<float> logits(T * V), dlogits(T * V), grads(wc.size());
    model::Activations acts;
    for (int step = 1; step <= 5; ++step) {
      m.forward(b, logits.data(), &acts);
      lc.push_back(train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data()));
      std::fill(grads.begin(), grads.end(), 0.f);
      m.backward(acts, dlogits.data(), grads.data());
      opt.step(wc.data.data(), grads.data());
      m.sync();
      g.zero_grad();
      g.forward(b, nullptr, true);
      lg.push_back(g.loss_ce(targets));
      g.adamw_step(cfg, step);
    }
    for (int s = 0; s < 5; ++s)
      std::printf("sft %s step %d: loss GPU %.6f CPU %.6f (rel L2 %.3g)\n", preset, s + 1, lg[s], lc[s],
                  std::fabs(lg[s] - lc[s]) / lc[s]);
    EXPECT_LT(lg.back(), lg.front() - 0.05) << preset;
    // qat: BF16 dY moves near-zero gradients' signs, which AdamW turns into full-size steps
    // (measured: at most 0.8% apart over 5 steps).
    for (int s = 0; s < 5; ++s) EXPECT_NEAR(lg[s], lc[s], (std::string(preset) == "fp32" ? 1e-5 : 3e-2) * lc[s]) << s;
  }
}

// The re-quantization after each step runs as a CUDA graph (and, for bf16, AdamW writes the BF16
// operands itself): three steps give the eager path's losses, logits and masters bit for bit.
TEST(CudaTrain, RequantGraphEqualsEager) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = fixture_weights();
  const model::Batch b = model::Batch::of({input_ids(), random_tokens(30, 21, w.cfg.vocab_size)});
  const auto targets = train::next_token_targets(b);
  train::AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.max_grad_norm = 0.5;
  for (const char* preset : {"bf16", "qat"}) {
    cuda::GpuTrainer gg(w, model::PrecisionConfig::preset(preset));
    setenv("QUADS_GPU_TRAIN_GRAPHS", "0", 1);
    cuda::GpuTrainer ge(w, model::PrecisionConfig::preset(preset));
    unsetenv("QUADS_GPU_TRAIN_GRAPHS");
    for (int step = 1; step <= 3; ++step) {
      double loss[2];
      cuda::GpuTrainer* t[2] = {&gg, &ge};
      for (int i = 0; i < 2; ++i) {
        t[i]->zero_grad();
        t[i]->forward(b, nullptr, true);
        loss[i] = t[i]->loss_ce(targets);
        t[i]->adamw_step(cfg, step);
      }
      EXPECT_EQ(loss[0], loss[1]) << preset << " step " << step;
    }
    const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
    std::vector<float> la(T * V), lb(T * V);
    gg.forward(b, la.data(), false);
    ge.forward(b, lb.data(), false);
    EXPECT_EQ(first_float_mismatch(la, lb), -1) << preset;
    model::Weights wa = w, wb = w;
    gg.download(wa);
    ge.download(wb);
    EXPECT_EQ(first_float_mismatch(wa.data, wb.data), -1) << preset;
    EXPECT_NE(gg.profile_report().find("re-quantization (graph"), std::string::npos) << preset;
    EXPECT_NE(ge.profile_report().find("re-quantization (eager"), std::string::npos) << preset;
  }
}

// QAT's NVFP4 operands from one WeightOperandSet (its amax from the AdamW pass, or from its own
// pass with QUADS_GPU_TRAIN_WOP_AMAX=0) and from a quantize() and an operand launch per linear
// (QUADS_GPU_TRAIN_WOP=0): the same losses, logits and masters, step by step, with the set in use.
TEST(CudaTrain, WeightOperandSetEqualsLaunchChain) {
  QUADS_REQUIRE_GPU();
  const model::Weights w = fixture_weights();
  const model::Batch b = model::Batch::of({input_ids(), random_tokens(30, 22, w.cfg.vocab_size)});
  const auto targets = train::next_token_targets(b);
  train::AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.max_grad_norm = 0.5;
  cuda::GpuTrainer gs(w, model::PrecisionConfig::preset("qat"));
  setenv("QUADS_GPU_TRAIN_WOP_AMAX", "0", 1);
  cuda::GpuTrainer ga(w, model::PrecisionConfig::preset("qat"));
  unsetenv("QUADS_GPU_TRAIN_WOP_AMAX");
  setenv("QUADS_GPU_TRAIN_WOP", "0", 1);
  cuda::GpuTrainer gc(w, model::PrecisionConfig::preset("qat"));
  unsetenv("QUADS_GPU_TRAIN_WOP");
  cuda::GpuTrainer* t[3] = {&gs, &ga, &gc};
  for (int step = 1; step <= 3; ++step) {
    double loss[3];
    for (int i = 0; i < 3; ++i) {
      t[i]->zero_grad();
      t[i]->forward(b, nullptr, true);
      loss[i] = t[i]->loss_ce(targets);
      t[i]->adamw_step(cfg, step);
    }
    EXPECT_EQ(loss[0], loss[2]) << "step " << step;
    EXPECT_EQ(loss[1], loss[2]) << "step " << step;
  }
  const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
  for (int i = 0; i < 2; ++i) {
    std::vector<float> la(T * V), lb(T * V);
    t[i]->forward(b, la.data(), false);
    gc.forward(b, lb.data(), false);
    EXPECT_EQ(first_float_mismatch(la, lb), -1) << i;
    model::Weights wa = w, wb = w;
    t[i]->download(wa);
    gc.download(wb);
    EXPECT_EQ(first_float_mismatch(wa.data, wb.data), -1) << i;
  }
  const std::string rs = gs.profile_report(), rc = gc.profile_report();
  EXPECT_NE(rs.find("NVFP4 operands in one set"), std::string::npos) << rs;
  EXPECT_EQ(rc.find("in one set"), std::string::npos) << rc;
}

// The router's aux (load-balancing) and z losses, as model::Model computes them (HF's
// load_balancing_loss_func over all MoE layers' tokens): their values and every gradient of CE +
// aux_coef * aux + z_coef * z against the CPU trainer's in fp32, two packed sequences; the
// coefficients are large enough that the router's gradient moves by far more than the tolerance.
TEST(CudaTrain, RouterAuxAndZLossesMatchCpu) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const auto ids = input_ids();
  const model::Batch b = model::Batch::of({std::vector<int32_t>(ids.begin(), ids.begin() + 15),
                                           std::vector<int32_t>(ids.begin() + 15, ids.end())});
  const int64_t T = b.ntokens(), V = w.cfg.vocab_size;
  const double aux_coef = 0.05, z_coef = 0.01;
  model::Model m(w, model::PrecisionConfig::preset("fp32"));
  model::ForwardOptions opt;
  opt.aux_loss_coef = aux_coef;
  opt.z_loss_coef = z_coef;
  std::vector<float> logits(T * V), dlogits(T * V), want(w.size(), 0.f), plain(w.size(), 0.f);
  model::Activations acts;
  m.forward(b, logits.data(), &acts, opt);
  const auto targets = train::next_token_targets(b);
  train::cross_entropy(logits.data(), T, V, targets.data(), nullptr, dlogits.data());
  m.backward(acts, dlogits.data(), want.data());
  model::Activations acts0;
  m.forward(b, logits.data(), &acts0, {});
  m.backward(acts0, dlogits.data(), plain.data());

  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("fp32"));
  g.set_router_losses(aux_coef, z_coef);
  const CpuResult gr = gpu_train_step(g, b);
  std::printf("router losses: aux GPU %.9f CPU %.9f, z GPU %.9f CPU %.9f\n", g.aux_loss(), acts.aux_loss(),
              g.z_loss(), acts.z_loss());
  EXPECT_NEAR(g.aux_loss(), acts.aux_loss(), 1e-6 * acts.aux_loss());
  EXPECT_NEAR(g.z_loss(), acts.z_loss(), 1e-6 * acts.z_loss());
  EXPECT_GT(acts.aux_loss(), 0.5);  // E * sum f_e P_e is 1 for a balanced router
  const GradCompare vc = compare_grads(w.layout, gr.grads, want, true);
  std::printf("router losses: grads rel L2 vs CPU all %.3g, worst %.3g (%s)\n", vc.all, vc.worst, vc.worst_name.c_str());
  EXPECT_LT(vc.all, 1e-5);
  EXPECT_LT(vc.worst, 1e-4);
  const std::string router = "model.layers.0.mlp.gate.weight";
  const size_t off = w.layout.at(router).offset, n = w.layout.at(router).numel;
  const double moved = rel_l2(want.data() + off, plain.data() + off, n), got = rel_l2(gr.grads.data() + off, want.data() + off, n);
  std::printf("router losses: %s's gradient moves by %.3g with them; GPU vs CPU %.3g\n", router.c_str(), moved, got);
  EXPECT_GT(moved, 1e-2);
  EXPECT_LT(got, 1e-4);
  g.set_router_losses(0, 0);  // and off again: the plain gradient
  const CpuResult g0 = gpu_train_step(g, b);
  EXPECT_LT(compare_grads(w.layout, g0.grads, plain, true).all, 1e-5);
  EXPECT_EQ(g.aux_loss(), 0.0);
}

TEST(CudaTrain, UnsupportedSettingsAreErrors) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("bf16"));
  EXPECT_NO_THROW(g.set_router_losses(0, 0));
  EXPECT_THROW(g.set_router_losses(std::nan(""), 0), Error);
  EXPECT_THROW(g.set_router_losses(0, INFINITY), Error);
  const model::Batch b = model::Batch::of({input_ids()});
  g.forward(b, nullptr, false);
  std::vector<float> dl(b.ntokens() * w.cfg.vocab_size, 0.f);
  EXPECT_THROW(g.backward(dl.data()), Error);  // the forward kept nothing
  model::Batch bad = b;
  bad.tokens[3] = w.cfg.vocab_size;
  EXPECT_THROW(g.forward(bad, nullptr, true), Error);
  EXPECT_THROW(g.linear_path("model.layers.0.mlp.nope"), Error);
}

// ReQAT's KV transform in the trainer (Q-FIT's pre-RoPE factor and key shift, the KV4 fake
// quantization) against the CPU model running the same transform as hooks: logits, loss and every
// gradient, in fp32 and in qat-sym (stage 2's preset), with and without the KV quantization.
TEST(CudaTrain, KvTransformMatchesCpuHooks) {
  QUADS_REQUIRE_GPU();
  model::Weights w = fixture_weights();
  const model::ModelConfig& c = w.cfg;
  const model::Batch b = model::Batch::of({input_ids(), random_tokens(17, 5, c.vocab_size)});
  const reqat::QFit qf = test::random_qfit(c, 21);
  for (const std::string preset : {"fp32", "qat-sym"}) {
    cuda::GpuTrainer plain(w, model::PrecisionConfig::preset(preset));
    const CpuResult base = gpu_train_step(plain, b);
    for (const char* kvfmt : {"none", "e1m2"}) {
      reqat::KvQuantConfig kv = reqat::parse_kv_quant("e1m2");
      kv.enabled = std::string(kvfmt) != "none";
      const model::KvTransform t = reqat::make_kv_transform(c, kv, &qf);
      cuda::GpuTrainer g(w, model::PrecisionConfig::preset(preset));
      g.set_kv_transform(t);
      const CpuResult gr = gpu_train_step(g, b);
      const CpuResult cr = cpu_train_step(w, preset, b, &t);
      const double el = rel_l2(gr.logits, cr.logits), moved = rel_l2(gr.logits, base.logits);
      const GradCompare gc = compare_grads(w.layout, gr.grads, cr.grads, false);
      std::printf("%s Q-FIT%s vs CPU hooks rel L2: logits %.3g (the transform moved them %.3g), grads all %.3g, worst "
                  "%.3g (%s); loss GPU %.7f CPU %.7f\n",
                  preset.c_str(), kv.enabled ? " + KV4 e1m2" : "", el, moved, gc.all, gc.worst, gc.worst_name.c_str(),
                  gr.loss, cr.loss);
      SCOPED_TRACE(preset + " " + kvfmt);
      // fp32: the preset's own bounds (the fp32 test's). qat-sym: its 4-bit activation codes turn an
      // ulp of difference into a code flip now and then (logits 3.7e-5 from the CPU here with
      // Q-FIT alone), so the preset test's gradient bounds and a looser forward.
      const bool fp32 = preset == "fp32";
      EXPECT_LT(el, fp32 ? 1e-5 : 1e-3);
      EXPECT_NEAR(gr.loss, cr.loss, fp32 ? 1e-6 : 1e-4);
      EXPECT_LT(gc.all, fp32 ? 1e-5 : 1e-2);
      EXPECT_LT(gc.worst, fp32 ? 1e-4 : 3e-2);
      if (kv.enabled) {
        EXPECT_GT(moved, 20 * el) << "the KV transform must visibly change the logits";
      } else if (fp32) {
        // Without the KV quantizer, Q-FIT's factor cancels in q.k and its shift in the softmax: an
        // identity up to rounding (as ReqatQFit.WithoutKvQuantLogitsAndGradientsUnchanged on the CPU),
        // where the gradients above still check the factor's backward.
        EXPECT_LT(moved, 1e-5);
      }
      // An empty transform gives the plain trainer's results back, bit for bit.
      g.set_kv_transform({});
      const CpuResult back = gpu_train_step(g, b);
      EXPECT_EQ(cuda::testing::first_float_mismatch(back.logits, base.logits), -1);
      EXPECT_EQ(cuda::testing::first_float_mismatch(back.grads, base.grads), -1);
    }
  }
  // A transform that does not fit the model is refused, naming it.
  cuda::GpuTrainer g(w, model::PrecisionConfig::preset("fp32"));
  model::KvTransform bad;
  bad.factor.assign(c.num_hidden_layers, std::vector<float>(3, 1.f));
  try {
    g.set_kv_transform(bad);
    ADD_FAILURE() << "a transform of the wrong size was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kv_dim"), std::string::npos) << e.what();
  }
}

// ReQAT's stage 2 (qat-sym, KV4, Q-FIT, SEM) through reqat::train_sft on the GPU trainer against the
// same run on the CPU: the first step sees the same weights (loss up to FP32 order), the runs then
// drift as far as their rounding lets them (a flipped 4-bit code, then AdamW's normalized steps:
// measured on the H200, losses within 0.7% over 6 steps, masters 1.2e-2 apart, eval loss 0.2%),
// and the device is named.
TEST(CudaTrain, ReqatStageTwoOnTheGpuFollowsTheCpu) {
  QUADS_REQUIRE_GPU();
  rl::install_cuda_rollouts();
  const rl::CharTokenizer tok;
  const model::ModelConfig mc = reqat::task_model_config(64, 2, 4, 2, 16, 4, 2, 64, 128, 1e4, 1e-6, tok.vocab_size());
  rl::RunConfig rc;
  rc.tasks.families = {"add", "sort"};
  const rl::TaskSet ts(rc.task_mix(), 5, 4);
  std::vector<rl::SftExample> data;
  for (const rl::Task& t : ts.train_batch(0, 16)) data.push_back(rl::make_sft_example(t, tok));
  const reqat::QFit qf = test::random_qfit(mc, 31);
  const reqat::KvQuantConfig kv = reqat::parse_kv_quant("e1m2");
  const model::Weights w0 = model::Weights::random(mc, 7, 0.05f);
  auto run = [&](const std::string& device, model::Weights& w, std::string* where) {
    model::Model m(w, model::PrecisionConfig::preset("qat-sym"));
    reqat::install_kv_hooks(m, kv, &qf);
    reqat::TrainSpec s = test::short_spec(6, 8, true);
    s.device = device;
    if (device == "cuda") s.kv = reqat::make_kv_transform(mc, kv, &qf);
    const auto log = reqat::train_sft(m, data, s, where);
    return std::make_pair(log, reqat::eval_loss(m, data));
  };
  model::Weights wc = w0, wg = w0;
  std::string where_c, where_g;
  const auto [lc, ec] = run("cpu", wc, &where_c);
  const auto [lg, eg] = run("cuda", wg, &where_g);
  EXPECT_EQ(where_g.rfind("cuda:", 0), 0u) << where_g;
  ASSERT_EQ(lc.size(), lg.size());
  for (size_t i = 0; i < lc.size(); ++i)
    std::printf("reqat stage 2 step %zu: loss CPU %.6f GPU %.6f, SEM %.6f / %.6f, grad norm %.5f / %.5f\n", i,
                lc[i].loss, lg[i].loss, lc[i].sem, lg[i].sem, lc[i].grad_norm, lg[i].grad_norm);
  const double wrel = rel_l2(wg.data, wc.data);
  std::printf("reqat stage 2: masters rel L2 GPU vs CPU after %zu steps %.3g; eval loss CPU %.6f GPU %.6f\n", lc.size(),
              wrel, ec, eg);
  EXPECT_NEAR(lg[0].loss, lc[0].loss, 1e-4 * lc[0].loss);
  EXPECT_NEAR(lg[0].grad_norm, lc[0].grad_norm, 1e-2 * lc[0].grad_norm);
  EXPECT_GT(lg.back().sem, 0.0);
  for (size_t i = 0; i < lc.size(); ++i) EXPECT_NEAR(lg[i].loss, lc[i].loss, 2e-2 * lc[i].loss) << i;
  EXPECT_LT(lg[4].loss, lg[0].loss);  // the same batch (16 examples, 8 a step) four steps later
  EXPECT_LT(wrel, 3e-2);
  EXPECT_NEAR(eg, ec, 2e-2 * ec);
  EXPECT_FALSE(wg.data == w0.data);
}

// Q-FIT's calibration on the GPU (reqat::calibrate_qfit through the trainer backend): the capture is
// the CPU forward's attention inputs up to the forward's rounding; fed the CPU's capture, the GPU's
// attention MSEs are the CPU's up to the attention's rounding (and a rare 4-bit KV code flip); the
// calibration as a whole chooses what the CPU chooses, or a point whose CPU MSE is as good. The
// fixture (head_dim 16: the padded attention) and a head_dim-64 task model.
TEST(CudaTrain, QFitCalibratedOnTheGpuIsTheCpus) {
  QUADS_REQUIRE_GPU();
  const rl::CharTokenizer tok;
  std::vector<std::pair<std::string, model::Weights>> models;
  models.emplace_back("fixture", fixture_weights());
  models.emplace_back("hd64", model::Weights::random(
                                  reqat::task_model_config(128, 2, 4, 2, 64, 4, 2, 64, 128, 1e4, 1e-6, tok.vocab_size()),
                                  13, 0.2f, 0.6f));
  for (auto& [name, w] : models) {
    SCOPED_TRACE(name);
    const model::ModelConfig& c = w.cfg;
    const model::Batch b = model::Batch::of(
        {random_tokens(41, 3, c.vocab_size), random_tokens(17, 4, c.vocab_size), random_tokens(64, 5, c.vocab_size)});
    reqat::QFitOptions o;
    o.alphas = {0.0, 0.25, 0.5, 0.75};
    o.betas = {0.0, 0.45, 0.9};
    o.kv = reqat::parse_kv_quant("e1m2");
    model::Weights wc = w;
    model::Model m(wc);
    std::vector<reqat::QFitGrid> gc, gg;
    const reqat::QFit qc = reqat::calibrate_qfit(m, b, o, &gc);
    const auto dev = cuda::make_gpu_trainer(w, model::PrecisionConfig::preset("fp32"));
    const reqat::QFit qg = reqat::calibrate_qfit(*dev, c, b, o, &gg);

    train::AttentionInputs capg;
    dev->capture_attention(b, &capg);
    const reqat::AttnCapture capc = reqat::capture_attention_inputs(m, b);
    ASSERT_EQ(capg.T, capc.T);
    ASSERT_EQ(capg.q.size(), capc.q.size());
    const num::QConfig qcfg = o.kv.qconfig();
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const double eq = rel_l2(capg.q[l], capc.q[l]), ek = rel_l2(capg.k[l], capc.k[l]),
                   ev = rel_l2(capg.v[l], capc.v[l]);
      EXPECT_LT(std::max({eq, ek, ev}), 1e-5) << l;
      // The arithmetic alone: every grid candidate of the CPU's search on the CPU's capture.
      std::vector<train::KvCandidate> cands;
      for (double a : o.alphas)
        for (double be : o.betas) {
          std::vector<float> mean;
          reqat::qfit_attention_mse(c, capc, l, qc.layers[l].scale, a, 0.0, o.kv, &mean);
          train::KvCandidate k;
          if (a != 0) {
            k.factor.resize(qc.layers[l].scale.size(), 1.f);
            for (size_t i = 0; i < k.factor.size(); ++i)
              if (qc.layers[l].scale[i] > 0) k.factor[i] = float(std::pow(double(qc.layers[l].scale[i]), a));
          }
          if (be != 0)
            for (float x : mean) k.shift.push_back(float(be * double(x)));
          cands.push_back(k);
        }
      const std::vector<double> mg = dev->attention_mse(capc, l, cands, &qcfg);
      const std::vector<double> mc = reqat::attention_mse_cpu(c, capc, l, cands, &qcfg);
      ASSERT_EQ(mg.size(), gc[l].mse.size());
      double worst = 0, worst_run = 0;
      for (size_t i = 0; i < mg.size(); ++i) {
        EXPECT_EQ(mc[i], gc[l].mse[i]) << "the candidates rebuilt here are not the search's, point " << i;
        worst = std::max(worst, std::fabs(mg[i] - mc[i]) / mc[i]);
        worst_run = std::max(worst_run, std::fabs(gg[l].mse[i] - gc[l].mse[i]) / gc[l].mse[i]);
      }
      const size_t ig = std::min_element(gg[l].mse.begin(), gg[l].mse.end()) - gg[l].mse.begin();
      std::printf("%s layer %d: capture rel L2 q %.2g k %.2g v %.2g; MSE GPU vs CPU on one capture: worst rel %.3g; "
                  "whole calibration: worst rel %.3g, choice GPU (%.2f, %.2f) CPU (%.2f, %.2f), MSE %.4g -> %.4g "
                  "(CPU %.4g -> %.4g)\n",
                  name.c_str(), l, eq, ek, ev, worst, worst_run, qg.layers[l].alpha, qg.layers[l].beta,
                  qc.layers[l].alpha, qc.layers[l].beta, qg.layers[l].mse_plain, qg.layers[l].mse_best,
                  qc.layers[l].mse_plain, qc.layers[l].mse_best);
      EXPECT_LT(worst, 1e-3) << l;
      EXPECT_LT(worst_run, 2e-2) << l;
      EXPECT_NEAR(qg.layers[l].mse_plain, qc.layers[l].mse_plain, 2e-2 * qc.layers[l].mse_plain) << l;
      // The GPU's choice is the argmin of its own grid, and no worse than 1% on the CPU's grid.
      EXPECT_EQ(qg.layers[l].alpha, o.alphas[ig / o.betas.size()]) << l;
      EXPECT_EQ(qg.layers[l].beta, o.betas[ig % o.betas.size()]) << l;
      EXPECT_LE(gc[l].mse[ig], 1.01 * qc.layers[l].mse_best) << l;
      EXPECT_LT(rel_l2(qg.layers[l].scale, qc.layers[l].scale), 1e-5) << l;
      EXPECT_LT(rel_l2(qg.layers[l].shift, qc.layers[l].shift), 1e-4) << l;
      // The search had something to choose.
      EXPECT_GT(*std::max_element(gc[l].mse.begin(), gc[l].mse.end()), 1.01 * qc.layers[l].mse_best) << l;
    }
  }
}
