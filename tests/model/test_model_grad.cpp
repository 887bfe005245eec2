// Finite-difference checks of the hand-written backward: for every parameter tensor, the
// directional derivative along a random unit direction (central differences) against the
// analytic gradient, on random small models that cover GQA ratios, top-k > 2, norm_topk_prob
// false, dense layers (mlp_only_layers, decoder_sparse_step), tied embeddings, the aux loss and
// the router z-loss, with packed batches of several sequences.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>

#include "model/model.h"
#include "model_test_util.h"

using namespace quads;
using namespace quads::model;

namespace {

struct Case {
  const char* name;
  ModelConfig cfg;
  double aux = 0, z = 0;
};

// L = sum c * logits + aux * aux_loss + z * z_loss (float64 sum of float32 logits).
double eval_loss(Model& m, const Batch& b, const std::vector<float>& c, const ForwardOptions& opt, Routing* rec) {
  const int64_t n = b.ntokens() * m.config().vocab_size;
  std::vector<float> logits(n);
  Activations acts;
  ForwardOptions o = opt;
  o.record = rec;
  m.forward(b, logits.data(), &acts, o);
  double L = 0;
  for (int64_t i = 0; i < n; ++i) L += double(c[i]) * double(logits[i]);
  return L + opt.aux_loss_coef * acts.aux_loss() + opt.z_loss_coef * acts.z_loss();
}

void check_case(const Case& cs) {
  SCOPED_TRACE(cs.name);
  Weights w = Weights::random(cs.cfg, 1234, 0.15f, 0.1f);
  Model m(w);
  const Batch b = Batch::of({test::random_tokens(7, cs.cfg.vocab_size, 1), test::random_tokens(5, cs.cfg.vocab_size, 2),
                             test::random_tokens(9, cs.cfg.vocab_size, 3)});
  const std::vector<float> c = test::random_normal(b.ntokens() * cs.cfg.vocab_size, 99, 0.1f);
  ForwardOptions opt;
  opt.aux_loss_coef = cs.aux;
  opt.z_loss_coef = cs.z;

  std::vector<float> logits(c.size()), grads(w.size(), 0.f);
  Activations acts;
  Routing base;
  opt.record = &base;
  m.forward(b, logits.data(), &acts, opt);
  opt.record = nullptr;
  opt.replay = &base;
  if (cs.aux != 0) {
    EXPECT_GT(acts.aux_loss(), 0.0);
  }
  if (cs.z != 0) {
    EXPECT_GT(acts.z_loss(), 0.0);
  }
  m.backward(acts, c.data(), grads.data());

  int checked = 0;
  double worst = 0;
  std::string worst_name;
  for (size_t pi = 0; pi < w.layout.params.size(); ++pi) {
    const ParamInfo& p = w.layout.params[pi];
    std::vector<float> u = test::random_normal(p.numel, 1000 + pi);
    double nu = 0;
    for (float x : u) nu += double(x) * x;
    for (float& x : u) x = static_cast<float>(x / std::sqrt(nu));
    double an = 0;
    for (size_t i = 0; i < p.numel; ++i) an += double(grads[p.offset + i]) * u[i];

    // The expert choices are replayed from the unperturbed forward: top-k selection is piecewise
    // constant, so this leaves the gradient unchanged and makes the loss smooth for the check.
    const std::vector<float> saved(w.data.begin() + p.offset, w.data.begin() + p.offset + p.numel);
    auto central = [&](double eps) {
      for (size_t i = 0; i < p.numel; ++i) w.data[p.offset + i] = static_cast<float>(saved[i] + eps * u[i]);
      m.sync();
      const double lp = eval_loss(m, b, c, opt, nullptr);
      for (size_t i = 0; i < p.numel; ++i) w.data[p.offset + i] = static_cast<float>(saved[i] - eps * u[i]);
      m.sync();
      const double lm = eval_loss(m, b, c, opt, nullptr);
      return (lp - lm) / (2 * eps);
    };
    // Richardson extrapolation of two central differences: error O(eps^4), and eps large enough
    // that float32 rounding in the loss stays far below the signal.
    const double fd = (4 * central(0.05) - central(0.1)) / 3;
    std::copy(saved.begin(), saved.end(), w.data.begin() + p.offset);
    m.sync();
    ++checked;
    // Relative error, with a floor for float32 rounding in the loss (about 1e-5 here).
    const double err = std::fabs(fd - an) / (std::fabs(an) + 3e-2);
    if (err > worst) {
      worst = err;
      worst_name = p.name;
    }
    EXPECT_LT(err, 1e-3) << p.name << ": analytic " << an << " finite difference " << fd;
  }
  EXPECT_EQ(checked, static_cast<int>(w.layout.params.size()));
  ::testing::Test::RecordProperty(std::string("worst_rel_err_") + cs.name, std::to_string(worst) + " " + worst_name);
}

}  // namespace

TEST(ModelGrad, GqaTop2Renormalized) {
  check_case({"gqa2_top2_norm", test::tiny_config()});
}

TEST(ModelGrad, MqaTop3NotRenormalized) {
  ModelConfig c = test::tiny_config();
  c.num_key_value_heads = 1;
  c.num_experts_per_tok = 3;
  c.norm_topk_prob = false;
  check_case({"mqa_top3_raw", c});
}

TEST(ModelGrad, DenseLayersBySparseStepAndMlpOnly) {
  ModelConfig c = test::tiny_config();
  c.num_hidden_layers = 4;
  c.decoder_sparse_step = 2;    // layers 1 and 3 sparse ...
  c.mlp_only_layers = {3};      // ... but 3 is forced dense
  ASSERT_FALSE(c.is_sparse(0));
  ASSERT_TRUE(c.is_sparse(1));
  ASSERT_FALSE(c.is_sparse(2));
  ASSERT_FALSE(c.is_sparse(3));
  check_case({"dense_layers", c});
}

TEST(ModelGrad, TiedEmbeddingsMhaTop4) {
  ModelConfig c = test::tiny_config();
  c.tie_word_embeddings = true;
  c.num_key_value_heads = 4;
  c.num_experts = 8;
  c.num_experts_per_tok = 4;
  check_case({"tied_mha_top4", c});
}

TEST(ModelGrad, AuxAndZLoss) {
  ModelConfig c = test::tiny_config();
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {1};
  check_case({"aux_z", c, 0.5, 0.2});
}

TEST(ModelGrad, AuxLossMatchesHfDefinition) {
  // E * sum_e f_e P_e over all MoE layers' tokens concatenated (HF's load_balancing_loss_func),
  // computed here from the recorded routing and the router probabilities.
  ModelConfig c = test::tiny_config();
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {1};
  Weights w = Weights::random(c, 5, 0.15f, 0.1f);
  Model m(w);
  const Batch b = Batch::of({test::random_tokens(6, c.vocab_size, 7), test::random_tokens(4, c.vocab_size, 8)});
  std::vector<float> logits(b.ntokens() * c.vocab_size);
  Activations acts;
  Routing rec;
  ForwardOptions opt;
  opt.record = &rec;
  // Router probabilities per layer, through a probe on the router linear.
  std::vector<std::vector<float>> rlogits(c.num_hidden_layers);
  opt.probe = [&](const LinearQ& L, const float*, const float*, const float* Y, int64_t M) {
    if (L.name == "model.layers." + std::to_string(L.layer) + ".mlp.gate") rlogits[L.layer].assign(Y, Y + M * c.num_experts);
  };
  m.forward(b, logits.data(), &acts, opt);
  const int64_t T = b.ntokens();
  const int E = c.num_experts, k = c.num_experts_per_tok;
  std::vector<double> f(E, 0), P(E, 0);
  int nl = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_sparse(l)) {
      EXPECT_TRUE(rec.experts[l].empty());
      continue;
    }
    ++nl;
    for (int64_t i = 0; i < T * k; ++i) f[rec.experts[l][i]] += 1;
    for (int64_t t = 0; t < T; ++t) {
      double mx = -1e30, s = 0;
      for (int e = 0; e < E; ++e) mx = std::max(mx, double(rlogits[l][t * E + e]));
      for (int e = 0; e < E; ++e) s += std::exp(rlogits[l][t * E + e] - mx);
      for (int e = 0; e < E; ++e) P[e] += std::exp(rlogits[l][t * E + e] - mx) / s;
    }
  }
  double aux = 0, rows = double(nl) * T;
  for (int e = 0; e < E; ++e) aux += (f[e] / rows) * (P[e] / rows);
  aux *= E;
  EXPECT_NEAR(acts.aux_loss(), aux, 1e-6 * aux);
  // A perfectly balanced router gives k (f sums to k, P to 1, each uniform).
  EXPECT_GT(aux, 0.5 * k);
}

TEST(ModelGrad, ResultsDoNotDependOnTheThreadCount) {
  // Big enough that the parallel paths (GEMM tiles, BLAS chunks, row-parallel ops) are taken.
  ModelConfig c = test::tiny_config();
  c.hidden_size = 128;
  c.head_dim = 32;
  c.moe_intermediate_size = 64;
  c.vocab_size = 300;
  Weights w = Weights::random(c, 21, 0.1f, 0.1f);
  Model m(w);
  const Batch b = Batch::of({test::random_tokens(200, c.vocab_size, 1), test::random_tokens(150, c.vocab_size, 2)});
  const auto dl = test::random_normal(b.ntokens() * c.vocab_size, 3, 0.01f);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> logits(dl.size()), grads(w.size(), 0.f);
    Activations a;
    ForwardOptions opt;
    opt.aux_loss_coef = 0.01;
    m.forward(b, logits.data(), &a, opt);
    m.backward(a, dl.data(), grads.data());
    omp_set_num_threads(saved);
    return std::make_pair(logits, grads);
  };
  const auto one = run(1), two = run(2), three = run(3);
  EXPECT_TRUE(one.first == two.first && one.first == three.first);
  EXPECT_TRUE(one.second == two.second && one.second == three.second);
}
