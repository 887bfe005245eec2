// KV-cache quantization hooks and Q-FIT: the cache holds exactly the per-(token, head) fake-quantized
// rows, training forward and cached decode agree under the hooks, Q-FIT without quantization leaves
// logits (and gradients) unchanged, the key shift is softmax-invariant, and the grid search returns
// the argmin of the MSE it reports, which is the attention error the model itself shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "model/model_test_util.h"
#include "common/error.h"
#include "numerics/formats.h"
#include "reqat/kv_quant.h"
#include "train/cpu_as_backend.h"

using namespace quads;
using namespace quads::model;
using namespace quads::reqat;

namespace {

ModelConfig kv_config() {
  ModelConfig c = test::tiny_config();
  c.head_dim = 16;  // one 16-element block per row
  return c;
}

Batch calib_batch(int vocab) {
  return Batch::of({test::random_tokens(23, vocab, 11), test::random_tokens(17, vocab, 12),
                    test::random_tokens(30, vocab, 13)});
}

std::vector<float> forward_logits(Model& m, const Batch& b) {
  std::vector<float> lg(b.ntokens() * m.config().vocab_size);
  m.forward(b, lg.data());
  return lg;
}

// A Q-FIT with non-trivial scales and shifts (from a calibration with fixed alpha, beta).
QFit strong_qfit(Model& m, const Batch& b, double alpha, double beta) {
  QFitOptions o;
  o.alphas = {alpha};
  o.betas = {beta};
  return calibrate_qfit(m, b, o);
}

}  // namespace

TEST(ReqatKvQuant, HookQuantizesEachTokenHeadRow) {
  const ModelConfig c = kv_config();
  for (const char* fmt : {"e1m2", "e2m1"}) {
    SCOPED_TRACE(fmt);
    const KvQuantConfig kv = parse_kv_quant(fmt);
    KvHooks h = make_kv_hooks(c, kv, nullptr);
    ASSERT_TRUE(h.post_rope);
    EXPECT_FALSE(h.pre_rope);
    const int64_t n = 9, kvd = c.kv_dim();
    std::vector<float> k = test::random_normal(n * kvd, 5, 1.5f), v = test::random_normal(n * kvd, 6, 0.01f);
    for (int64_t i = 0; i < kvd; ++i) k[3 * kvd + i] *= 100.f;  // one loud token must not affect the others
    const std::vector<float> k0 = k, v0 = v;
    h.post_rope(0, k.data(), v.data(), n);
    const num::QConfig qc = kv.qconfig();
    EXPECT_EQ(qc.block, num::Block::B1x16);
    EXPECT_EQ(qc.global, num::Global::PerRow);
    const float gmax = fmt[1] == '1' ? 3.5f : 6.f;
    for (int64_t r = 0; r < n * c.num_key_value_heads; ++r) {
      std::vector<float> kr(c.head_dim), vr(c.head_dim);
      num::fake_quantize(k0.data() + r * c.head_dim, kr.data(), 1, c.head_dim, qc);
      num::fake_quantize(v0.data() + r * c.head_dim, vr.data(), 1, c.head_dim, qc);
      for (int j = 0; j < c.head_dim; ++j) {
        ASSERT_EQ(k[r * c.head_dim + j], kr[j]) << "row " << r;
        ASSERT_EQ(v[r * c.head_dim + j], vr[j]) << "row " << r;
      }
      // The row's largest magnitude is kept (it maps to the grid's top), the rest is on a 4-bit grid.
      float amax = 0, qmax = 0;
      for (int j = 0; j < c.head_dim; ++j) {
        amax = std::max(amax, std::fabs(k0[r * c.head_dim + j]));
        qmax = std::max(qmax, std::fabs(k[r * c.head_dim + j]));
      }
      EXPECT_NEAR(qmax, amax, 1e-5 * amax);
      std::vector<float> mags;
      for (int j = 0; j < c.head_dim; ++j) mags.push_back(std::fabs(k[r * c.head_dim + j]));
      std::sort(mags.begin(), mags.end());
      mags.erase(std::unique(mags.begin(), mags.end()), mags.end());
      EXPECT_LE(mags.size(), 8u);  // at most 8 magnitudes per 16-block
      (void)gmax;
    }
  }
}

TEST(ReqatKvQuant, RejectsHeadDimNotMultipleOf16) {
  ModelConfig c = test::tiny_config();  // head_dim 8
  EXPECT_THROW(make_kv_hooks(c, KvQuantConfig{}, nullptr), Error);
  EXPECT_THROW(parse_kv_quant("e3m0"), Error);
}

TEST(ReqatKvQuant, TrainingForwardMatchesCachedDecode) {
  // The cache holds the hooked (Q-FIT + quantized) keys and values: decoding token by token
  // through the cache gives the training forward's logits bit for bit.
  const ModelConfig c = kv_config();
  Weights w = Weights::random(c, 7, 0.2f, 0.3f);
  Model m(w);
  const Batch cal = calib_batch(c.vocab_size);
  const QFit qf = strong_qfit(m, cal, 0.5, 0.6);
  install_kv_hooks(m, KvQuantConfig{}, &qf);
  const std::vector<int32_t> seq = test::random_tokens(12, c.vocab_size, 3);
  const std::vector<float> full = forward_logits(m, Batch::of({seq}));
  KVCache cache(c, 1);
  for (size_t t = 0; t < seq.size(); ++t) {
    const std::vector<float> lg = m.step(cache, {StepItem{0, {seq[t]}, false}});
    for (int v = 0; v < c.vocab_size; ++v) ASSERT_EQ(lg[v], full[t * c.vocab_size + v]) << "t=" << t;
  }
  // And the quantization changed something.
  Model plain(w);
  const std::vector<float> ref = forward_logits(plain, Batch::of({seq}));
  EXPECT_GT(test::rel_l2(full.data(), ref.data(), full.size()), 1e-4);
}

TEST(ReqatQFit, WithoutKvQuantLogitsAndGradientsUnchanged) {
  const ModelConfig c = kv_config();
  Weights w = Weights::random(c, 8, 0.2f, 0.5f);
  Model m(w);
  const Batch b = calib_batch(c.vocab_size);
  const std::vector<float> ref = forward_logits(m, b);
  Activations acts;
  std::vector<float> lg(ref.size());
  const std::vector<float> dl = test::random_normal(ref.size(), 4, 0.1f);
  std::vector<float> g_ref(w.size(), 0.f), g_q(w.size(), 0.f);
  m.forward(b, lg.data(), &acts);
  m.backward(acts, dl.data(), g_ref.data());

  for (double alpha : {0.35, 0.95}) {
    const QFit qf = strong_qfit(m, b, alpha, 0.9);
    ASSERT_EQ(qf.layers.size(), size_t(c.num_hidden_layers));
    // The scale is really non-trivial: channels differ, RoPE pairs agree.
    const auto& s = qf.layers[0].scale;
    EXPECT_NE(*std::min_element(s.begin(), s.end()), *std::max_element(s.begin(), s.end()));
    for (int j = 0; j < c.head_dim / 2; ++j) EXPECT_EQ(s[j], s[j + c.head_dim / 2]);
    KvQuantConfig off;
    off.enabled = false;
    install_kv_hooks(m, off, &qf);
    ASSERT_TRUE(m.kv_hooks.pre_rope && m.kv_hooks.post_rope && m.kv_hooks.pre_rope_backward);
    const std::vector<float> out = forward_logits(m, b);
    EXPECT_LT(test::rel_l2(out.data(), ref.data(), ref.size()), 2e-5) << alpha;
    std::fill(g_q.begin(), g_q.end(), 0.f);
    m.forward(b, lg.data(), &acts);
    m.backward(acts, dl.data(), g_q.data());
    EXPECT_LT(test::rel_l2(g_q.data(), g_ref.data(), g_q.size()), 1e-4) << alpha;
    m.kv_hooks = {};
  }
}

TEST(ReqatQFit, ShiftIsSoftmaxInvariant) {
  const ModelConfig c = kv_config();
  Weights w = Weights::random(c, 9, 0.2f, 0.5f);
  Model m(w);
  const Batch b = calib_batch(c.vocab_size);
  const AttnCapture cap = capture_attention_inputs(m, b);
  KvQuantConfig off;
  off.enabled = false;
  // Attention output MSE against float32 is rounding-level for any shift (and scale) without
  // quantization, while the shift itself is large.
  std::vector<float> shift;
  for (double beta : {0.0, 0.5, 0.95}) {
    const double e = qfit_attention_mse(c, cap, 1, {}, 0.0, beta, off, &shift);
    EXPECT_LT(e, 1e-12) << beta;
  }
  double smax = 0;
  for (float x : shift) smax = std::max(smax, double(std::fabs(x)));
  EXPECT_GT(smax, 0.05);
  // With quantization the error is far above rounding.
  EXPECT_GT(qfit_attention_mse(c, cap, 1, {}, 0.0, 0.0, KvQuantConfig{}), 1e-8);
}

TEST(ReqatQFit, GridSearchPicksArgminAndMatchesModel) {
  const ModelConfig c = kv_config();
  Weights w = Weights::random(c, 10, 0.2f, 0.6f);
  Model m(w);
  const Batch b = calib_batch(c.vocab_size);
  QFitOptions o;
  o.alphas = {0.0, 0.3, 0.6, 0.9};
  o.betas = {0.0, 0.45, 0.9};
  std::vector<QFitGrid> grids;
  const QFit qf = calibrate_qfit(m, b, o, &grids);
  ASSERT_EQ(grids.size(), size_t(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const QFitGrid& g = grids[l];
    ASSERT_EQ(g.mse.size(), 12u);
    const size_t best = std::min_element(g.mse.begin(), g.mse.end()) - g.mse.begin();
    EXPECT_EQ(qf.layers[l].alpha, g.alphas[best / 3]);
    EXPECT_EQ(qf.layers[l].beta, g.betas[best % 3]);
    EXPECT_EQ(qf.layers[l].mse_best, g.mse[best]);
    EXPECT_EQ(qf.layers[l].mse_plain, g.mse[0]);
    EXPECT_LE(qf.layers[l].mse_best, qf.layers[l].mse_plain);
    // The grid is not flat: the search has something to choose.
    EXPECT_GT(*std::max_element(g.mse.begin(), g.mse.end()), g.mse[best] * 1.01);
  }
  // Layer 0's attention output (o_proj input) under the installed hooks has exactly the grid's error.
  std::vector<float> attn_ref, attn_q;
  const LinearQ* o0 = m.find_linear("model.layers.0.self_attn.o_proj");
  ASSERT_NE(o0, nullptr);
  auto grab = [&](std::vector<float>* dst) {
    ForwardOptions fo;
    fo.probe = [&](const LinearQ& L, const float* X, const float*, const float*, int64_t M) {
      if (L.name == o0->name) dst->assign(X, X + M * L.in);
    };
    std::vector<float> lg(b.ntokens() * c.vocab_size);
    m.forward(b, lg.data(), nullptr, fo);
  };
  grab(&attn_ref);
  install_kv_hooks(m, o.kv, &qf);
  grab(&attn_q);
  double e = 0;
  for (size_t i = 0; i < attn_q.size(); ++i) e += (double(attn_q[i]) - attn_ref[i]) * (double(attn_q[i]) - attn_ref[i]);
  e /= static_cast<double>(attn_q.size());
  EXPECT_NEAR(e, qf.layers[0].mse_best, 1e-9 * qf.layers[0].mse_best + 1e-15);
}

TEST(ReqatQFit, JsonRoundTrip) {
  const ModelConfig c = kv_config();
  Weights w = Weights::random(c, 11, 0.2f, 0.5f);
  Model m(w);
  const QFit qf = strong_qfit(m, calib_batch(c.vocab_size), 0.4, 0.2);
  const QFit back = QFit::from_json(qf.to_json(), c.num_hidden_layers, c.kv_dim(), "test");
  ASSERT_EQ(back.layers.size(), qf.layers.size());
  for (size_t l = 0; l < qf.layers.size(); ++l) {
    EXPECT_EQ(back.layers[l].alpha, qf.layers[l].alpha);
    EXPECT_EQ(back.layers[l].scale, qf.layers[l].scale);
    EXPECT_EQ(back.layers[l].shift, qf.layers[l].shift);
  }
  EXPECT_THROW(QFit::from_json(qf.to_json(), c.num_hidden_layers + 1, c.kv_dim(), "test"), Error);
}

// The search through a trainer backend (the GPU's way: capture and MSEs there, scales, candidates
// and the choice here): with the host's code behind the interface, the CPU's calibration exactly.
TEST(ReqatQFit, CalibrationThroughABackendIsTheCpus) {
  const ModelConfig c = kv_config();
  Weights w = Weights::random(c, 12, 0.2f, 0.6f);
  Model m(w);
  const Batch b = calib_batch(c.vocab_size);
  QFitOptions o;
  o.alphas = {0.0, 0.25, 0.5, 0.75};
  o.betas = {0.0, 0.5, 0.9};
  std::vector<QFitGrid> gc, gd;
  const QFit qc = calibrate_qfit(m, b, o, &gc);
  int calls = 0;
  test::CpuAsBackend dev(w, PrecisionConfig::preset("fp32"), &calls, false);
  const QFit qd = calibrate_qfit(dev, c, b, o, &gd);
  EXPECT_EQ(calls, 1);  // one capture
  ASSERT_EQ(qd.layers.size(), qc.layers.size());
  for (size_t l = 0; l < qc.layers.size(); ++l) {
    EXPECT_EQ(qd.layers[l].alpha, qc.layers[l].alpha) << l;
    EXPECT_EQ(qd.layers[l].beta, qc.layers[l].beta) << l;
    EXPECT_EQ(qd.layers[l].mse_plain, qc.layers[l].mse_plain) << l;
    EXPECT_EQ(qd.layers[l].mse_best, qc.layers[l].mse_best) << l;
    EXPECT_EQ(qd.layers[l].scale, qc.layers[l].scale) << l;
    EXPECT_EQ(qd.layers[l].shift, qc.layers[l].shift) << l;
    EXPECT_EQ(gd[l].mse, gc[l].mse) << l;
  }
  // A backend without the calibration names itself; a capture of the wrong size is named.
  struct Bare : train::TrainBackend {
    std::string name() const override { return "bare"; }
    void forward(const Batch&, float*, bool, Routing*, const Routing*) override {}
    void backward(const float*, float*) override {}
    void sync(const Weights&) override {}
  } bare;
  try {
    calibrate_qfit(bare, c, b, o);
    ADD_FAILURE() << "a backend without a capture was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bare"), std::string::npos) << e.what();
  }
  AttnCapture cap = capture_attention_inputs(m, b);
  train::KvCandidate short_factor;
  short_factor.factor.assign(c.kv_dim() - 1, 1.f);
  EXPECT_THROW(attention_mse_cpu(c, cap, 1, {short_factor}, nullptr), Error);
  cap.k[1].pop_back();
  EXPECT_THROW(attention_mse_cpu(c, cap, 1, {train::KvCandidate{}}, nullptr), Error);
  EXPECT_THROW(attention_mse_cpu(c, cap, 2, {train::KvCandidate{}}, nullptr), Error);
}
