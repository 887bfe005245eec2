// Precision modes: the trainer's fake-quantized weights are bit-identical to the rollout
// engine's dequantized ones, W4A4 is exact emulation (X_eff · W_effᵀ with float32 accumulation),
// straight-through gradients, and the per-linear selection (filter, last layers, router, lm_head).
#include <gtest/gtest.h>

#include <cstring>

#include "common/error.h"
#include "cpu/gemm.h"
#include "model/model.h"
#include "model_test_util.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"

using namespace quads;
using namespace quads::model;

namespace {

ModelConfig config() {
  ModelConfig c = test::tiny_config();
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.head_dim = 16;
  c.moe_intermediate_size = 32;
  c.intermediate_size = 64;
  c.num_experts = 4;
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {2};
  return c;
}

bool is_quantizable(const LinearQ& L) {
  const std::string router = ".mlp.gate";
  const bool is_router = L.name.size() > router.size() &&
                         L.name.compare(L.name.size() - router.size(), router.size(), router) == 0;
  return L.name != "lm_head" && !is_router;
}

}  // namespace

TEST(Precision, QatWeightsAreBitIdenticalToRolloutDequantizedWeights) {
  const ModelConfig c = config();
  Weights w = Weights::random(c, 11, 0.1f);
  Model rollout(w, PrecisionConfig::preset("nvfp4"));
  Model trainer(w, PrecisionConfig::preset("qat"));
  Model trainer_sym(w, PrecisionConfig::preset("qat-sym"));
  int n = 0;
  for (const LinearQ& L : rollout.linears()) {
    if (!is_quantizable(L)) continue;
    const size_t cnt = L.out * L.in;
    const float* r = rollout.effective_weights() + L.offset;
    EXPECT_EQ(std::memcmp(r, trainer.effective_weights() + L.offset, cnt * 4), 0) << L.name;
    EXPECT_EQ(std::memcmp(r, trainer_sym.effective_weights() + L.offset, cnt * 4), 0) << L.name;
    // ... and equal to the shared quantization path applied directly.
    std::vector<float> fq(cnt);
    num::fake_quantize(w.data.data() + L.offset, fq.data(), L.out, L.in, num::QConfig::nvfp4_weight(false));
    EXPECT_EQ(std::memcmp(r, fq.data(), cnt * 4), 0) << L.name;
    // The rollout keeps the codes: dequantizing them gives the same weights.
    std::vector<float> dq(cnt);
    num::dequantize(L.wq, dq.data());
    EXPECT_EQ(std::memcmp(r, dq.data(), cnt * 4), 0) << L.name;
    // Quantization did something.
    EXPECT_NE(std::memcmp(r, w.data.data() + L.offset, cnt * 4), 0) << L.name;
    ++n;
  }
  EXPECT_EQ(n, 3 * 4 + 2 * 3 * c.num_experts + 3);
}

TEST(Precision, SyncRequantizesAfterAWeightUpdate) {
  const ModelConfig c = config();
  Weights w = Weights::random(c, 12, 0.1f);
  Model m(w, PrecisionConfig::preset("qat"));
  const LinearQ* L = m.find_linear("model.layers.1.self_attn.o_proj");
  ASSERT_NE(L, nullptr);
  std::vector<float> before(m.effective_weights() + L->offset, m.effective_weights() + L->offset + L->out * L->in);
  for (int64_t i = 0; i < L->out * L->in; ++i) w.data[L->offset + i] *= 1.5f;
  EXPECT_EQ(std::memcmp(before.data(), m.effective_weights() + L->offset, before.size() * 4), 0);  // not yet
  m.sync();
  std::vector<float> fq(before.size());
  num::fake_quantize(w.data.data() + L->offset, fq.data(), L->out, L->in, num::QConfig::nvfp4_weight(false));
  EXPECT_EQ(std::memcmp(fq.data(), m.effective_weights() + L->offset, fq.size() * 4), 0);
}

// Quantize::Later (the CPU twin of a GPU engine or trainer): the same linears, no effective weights
// until sync(), a forward or step before it is an error, and after it the model is Quantize::Now's.
TEST(Precision, ModelQuantizedLaterRunsOnlyAfterSync) {
  const ModelConfig c = config();
  Weights w = Weights::random(c, 5, 0.1f);
  const auto p = PrecisionConfig::preset("nvfp4");
  Model now(w, p);
  Model later(w, p, Model::Quantize::Later);
  ASSERT_EQ(later.linears().size(), now.linears().size());
  for (size_t i = 0; i < now.linears().size(); ++i) {
    EXPECT_EQ(later.linears()[i].name, now.linears()[i].name);
    EXPECT_TRUE(later.linears()[i].num == now.linears()[i].num) << now.linears()[i].name;
  }
  const Batch b = Batch::of({{1, 2, 3, 4}, {5, 6}});
  std::vector<float> a(b.ntokens() * c.vocab_size), z(a.size());
  EXPECT_THROW(later.forward(b, z.data()), Error);
  KVCache cache(c, 1);
  StepItem it;
  it.tokens = {1, 2, 3};
  EXPECT_THROW(later.step(cache, {it}), Error);
  later.sync();
  now.forward(b, a.data());
  later.forward(b, z.data());
  EXPECT_EQ(std::memcmp(a.data(), z.data(), a.size() * 4), 0);
}

TEST(Precision, W4A4IsExactEmulation) {
  const ModelConfig c = config();
  Weights w = Weights::random(c, 13, 0.1f);
  Model m(w, PrecisionConfig::preset("nvfp4"));
  num::QConfig act;
  act.global = num::Global::PerRow;
  int seen = 0;
  ForwardOptions opt;
  opt.probe = [&](const LinearQ& L, const float* X, const float* Xe, const float* Y, int64_t M) {
    if (!is_quantizable(L)) {
      // High precision (bf16) linears: both operands are bf16 values.
      for (int64_t i = 0; i < M * L.in; ++i) ASSERT_EQ(Xe[i], num::bf16_round(X[i])) << L.name;
      return;
    }
    ++seen;
    std::vector<float> ref(M * L.in);
    num::fake_quantize(X, ref.data(), M, L.in, act);
    ASSERT_EQ(std::memcmp(ref.data(), Xe, ref.size() * 4), 0) << L.name;
    const float* We = m.effective_weights() + L.offset;
    // Y = X_eff · W_effᵀ: the row-invariant GEMM bit for bit, and the exact products within
    // float32 accumulation error.
    std::vector<float> y(M * L.out);
    cpu::gemm_nt_rowinv(M, L.out, L.in, Xe, L.in, We, L.in, y.data(), L.out);
    ASSERT_EQ(std::memcmp(y.data(), Y, y.size() * 4), 0) << L.name;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t o = 0; o < L.out; ++o) {
        double s = 0, a = 0;
        for (int64_t i = 0; i < L.in; ++i) {
          s += double(Xe[r * L.in + i]) * double(We[o * L.in + i]);
          a += std::fabs(double(Xe[r * L.in + i]) * double(We[o * L.in + i]));
        }
        ASSERT_NEAR(Y[r * L.out + o], s, 1e-6 * a + 1e-30) << L.name;
      }
  };
  std::vector<float> logits(9 * c.vocab_size);
  m.forward(Batch::of({test::random_tokens(9, c.vocab_size, 4)}), logits.data(), nullptr, opt);
  EXPECT_GT(seen, 3 * 4 + 3);
}

TEST(Precision, Bf16ModeRoundsBothOperands) {
  const ModelConfig c = config();
  Weights w = Weights::random(c, 14, 0.1f);
  Model m(w, PrecisionConfig::preset("bf16"));
  for (const LinearQ& L : m.linears()) {
    const float* We = m.effective_weights() + L.offset;
    for (int64_t i = 0; i < L.out * L.in; ++i) {
      ASSERT_EQ(We[i], num::bf16_round(w.data[L.offset + i])) << L.name;
    }
  }
  ForwardOptions opt;
  int seen = 0;
  opt.probe = [&](const LinearQ& L, const float* X, const float* Xe, const float*, int64_t M) {
    ++seen;
    for (int64_t i = 0; i < M * L.in; ++i) ASSERT_EQ(Xe[i], num::bf16_round(X[i])) << L.name;
  };
  std::vector<float> logits(5 * c.vocab_size);
  m.forward(Batch::of({test::random_tokens(5, c.vocab_size, 5)}), logits.data(), nullptr, opt);
  EXPECT_GT(seen, 0);
}

TEST(Precision, StraightThroughWeightGradientIsTheGradientAtTheQuantizedWeights) {
  // With weight fake quantization only, the backward must equal the exact gradient of the
  // float32 model whose linear weights ARE the quantized ones (dX = dY·W_eff, dW = dYᵀ·X).
  const ModelConfig c = config();
  Weights w = Weights::random(c, 15, 0.1f, 0.1f);
  PrecisionConfig p = PrecisionConfig::preset("fp32");
  p.name = "w-nvfp4";
  p.quant.weight = OperandQuant::quant(num::QConfig::nvfp4_weight(false));
  Model q(w, p);
  Weights weff = w;
  for (const LinearQ& L : q.linears())
    std::memcpy(weff.data.data() + L.offset, q.effective_weights() + L.offset, L.out * L.in * 4);
  Model ref(weff);
  const Batch b = Batch::of({test::random_tokens(7, c.vocab_size, 6), test::random_tokens(4, c.vocab_size, 7)});
  const auto dl = test::random_normal(b.ntokens() * c.vocab_size, 8, 0.1f);
  std::vector<float> l1(dl.size()), l2(dl.size()), g1(w.size(), 0.f), g2(w.size(), 0.f);
  Activations a1, a2;
  q.forward(b, l1.data(), &a1);
  ref.forward(b, l2.data(), &a2);
  EXPECT_EQ(l1, l2);
  q.backward(a1, dl.data(), g1.data());
  ref.backward(a2, dl.data(), g2.data());
  EXPECT_EQ(g1, g2);
}

TEST(Precision, LinearSelection) {
  const ModelConfig c = config();
  PrecisionConfig p = PrecisionConfig::preset("nvfp4");
  const LinearNumerics quant = p.quant, high = p.high;
  EXPECT_EQ(p.for_linear("model.layers.0.self_attn.q_proj", 0, 3), quant);
  EXPECT_EQ(p.for_linear("model.layers.0.mlp.gate", 0, 3), high);
  EXPECT_EQ(p.for_linear("lm_head", -1, 3), high);
  p.quantize_router = true;
  EXPECT_EQ(p.for_linear("model.layers.0.mlp.gate", 0, 3), quant);
  p.filter = "mlp\\.experts\\.\\d+\\.(gate|up)_proj";
  EXPECT_EQ(p.for_linear("model.layers.0.self_attn.q_proj", 0, 3), high);
  EXPECT_EQ(p.for_linear("model.layers.0.mlp.experts.3.up_proj", 0, 3), quant);
  EXPECT_EQ(p.for_linear("model.layers.0.mlp.experts.3.down_proj", 0, 3), high);
  p.filter.clear();
  p.keep_last_high = 1;
  EXPECT_EQ(p.for_linear("model.layers.1.mlp.experts.0.up_proj", 1, 3), quant);
  EXPECT_EQ(p.for_linear("model.layers.2.mlp.down_proj", 2, 3), high);
  p.filter = "(";
  EXPECT_THROW(p.for_linear("model.layers.0.self_attn.q_proj", 0, 3), Error);

  // A filtered model: mixed numerics among the experts of one layer still run and stay
  // batch-invariant and differentiable.
  Weights w = Weights::random(c, 16, 0.1f);
  PrecisionConfig f = PrecisionConfig::preset("nvfp4");
  f.filter = "experts\\.[02]\\.|self_attn\\.v_proj";
  Model m(w, f);
  EXPECT_EQ(m.find_linear("model.layers.0.mlp.experts.1.gate_proj")->num, f.high);
  EXPECT_EQ(m.find_linear("model.layers.0.mlp.experts.2.gate_proj")->num, f.quant);
  const Batch b = Batch::of({test::random_tokens(12, c.vocab_size, 9)});
  std::vector<float> l(b.ntokens() * c.vocab_size), g(w.size(), 0.f);
  Activations a;
  m.forward(b, l.data(), &a);
  m.backward(a, l.data(), g.data());
  for (float x : g) ASSERT_TRUE(std::isfinite(x));
}

TEST(Precision, StaticActivationScaleNeedsCalibration) {
  const ModelConfig c = config();
  Weights w = Weights::random(c, 17, 0.1f);
  {
    // The model can be built before calibration; it refuses to run without the scales.
    Model m(w, PrecisionConfig::preset("nvfp4-static"));
    std::vector<float> l(3 * c.vocab_size);
    try {
      m.forward(Batch::of({{1, 2, 3}}), l.data());
      ADD_FAILURE() << "no error without calibrated amax";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.q_proj"), std::string::npos) << e.what();
    }
    KVCache cache(c, 1);
    EXPECT_THROW(m.step(cache, {{0, {1}, false}}), Error);
    for (auto& L : m.linears()) L.act_static_amax = 2.f;
    m.forward(Batch::of({{1, 2, 3}}), l.data());
  }
  // Calibrate: a static amax per linear; the activations then use it.
  PrecisionConfig p = PrecisionConfig::preset("nvfp4-static");
  p.quant.act.cfg.static_amax = 3.0f;  // default for every linear
  Model m(w, p);
  m.find_linear("model.layers.1.self_attn.o_proj")->act_static_amax = 0.5f;
  ForwardOptions opt;
  opt.probe = [&](const LinearQ& L, const float* X, const float* Xe, const float*, int64_t M) {
    if (!is_quantizable(L)) return;
    num::QConfig q;
    q.global = num::Global::Static;
    q.static_amax = L.name == "model.layers.1.self_attn.o_proj" ? 0.5f : 3.0f;
    std::vector<float> ref(M * L.in);
    num::fake_quantize(X, ref.data(), M, L.in, q);
    ASSERT_EQ(std::memcmp(ref.data(), Xe, ref.size() * 4), 0) << L.name;
  };
  std::vector<float> l(6 * c.vocab_size);
  m.forward(Batch::of({test::random_tokens(6, c.vocab_size, 10)}), l.data(), nullptr, opt);
}
