#include "model/model.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "common/error.h"
#include "cpu/gemm.h"
#include "cpu/ops.h"
#include "model/rac.h"

namespace quads::model {

// ---------------------------------------------------------------------------------------------
// Batch, KV cache

void Batch::add(const std::vector<int32_t>& seq) {
  tokens.insert(tokens.end(), seq.begin(), seq.end());
  offsets.push_back(static_cast<int64_t>(tokens.size()));
}

Batch Batch::of(const std::vector<std::vector<int32_t>>& seqs) {
  Batch b;
  for (const auto& s : seqs) b.add(s);
  return b;
}

KVCache::KVCache(const ModelConfig& cfg, int num_slots)
    : num_layers_(cfg.num_hidden_layers), row_(int64_t(cfg.num_key_value_heads) * cfg.head_dim) {
  QUADS_CHECK(num_slots > 0, "KVCache: num_slots must be > 0 (got {})", num_slots);
  len_.assign(num_slots, 0);
  k_.resize(size_t(num_layers_) * num_slots);
  v_.resize(size_t(num_layers_) * num_slots);
}

void KVCache::truncate(int slot, int64_t len) {
  QUADS_CHECK(slot >= 0 && slot < num_slots(), "KVCache: slot {} out of range (0..{})", slot, num_slots() - 1);
  QUADS_CHECK(len >= 0 && len <= len_[slot], "KVCache: cannot truncate slot {} of length {} to {}", slot, len_[slot], len);
  len_[slot] = len;
  for (int l = 0; l < num_layers_; ++l) {
    k_[index(l, slot)].resize(size_t(len) * row_);
    v_[index(l, slot)].resize(size_t(len) * row_);
  }
}

void KVCache::copy(int src, int dst) {
  QUADS_CHECK(src >= 0 && src < num_slots() && dst >= 0 && dst < num_slots(), "KVCache: slot {} or {} out of range",
              src, dst);
  if (src == dst) return;
  len_[dst] = len_[src];
  for (int l = 0; l < num_layers_; ++l) {
    k_[index(l, dst)] = k_[index(l, src)];
    v_[index(l, dst)] = v_[index(l, src)];
  }
}

int64_t KVCache::extend(int slot, int64_t n) {
  QUADS_CHECK(slot >= 0 && slot < num_slots(), "KVCache: slot {} out of range (0..{})", slot, num_slots() - 1);
  const int64_t old = len_[slot];
  len_[slot] = old + n;
  for (int l = 0; l < num_layers_; ++l) {
    k_[index(l, slot)].resize(size_t(old + n) * row_);
    v_[index(l, slot)].resize(size_t(old + n) * row_);
  }
  return old;
}

size_t KVCache::bytes() const {
  size_t b = 0;
  for (const auto& x : k_) b += x.size() * sizeof(float);
  for (const auto& x : v_) b += x.size() * sizeof(float);
  return b;
}

void KvTransform::validate(const ModelConfig& c, const std::string& who) const {
  const size_t kvd = size_t(c.num_key_value_heads) * c.head_dim;
  const size_t L = size_t(c.num_hidden_layers);
  QUADS_CHECK(factor.empty() || factor.size() == L, "{}: the KV transform has {} factor layers, the model has {}", who,
              factor.size(), L);
  QUADS_CHECK(shift.empty() || shift.size() == L, "{}: the KV transform has {} shift layers, the model has {}", who,
              shift.size(), L);
  for (size_t l = 0; l < factor.size(); ++l)
    QUADS_CHECK(factor[l].empty() || factor[l].size() == kvd, "{}: layer {} of the KV transform has {} factors, kv_dim is {}",
                who, l, factor[l].size(), kvd);
  for (size_t l = 0; l < shift.size(); ++l)
    QUADS_CHECK(shift[l].empty() || shift[l].size() == kvd, "{}: layer {} of the KV transform has {} shifts, kv_dim is {}",
                who, l, shift[l].size(), kvd);
  QUADS_CHECK(!quantize || c.head_dim % 16 == 0, "{}: KV quantization needs head_dim a multiple of 16 (has {})", who,
              c.head_dim);
}

// ---------------------------------------------------------------------------------------------
// Activations

namespace {

// A GEMM operand: the input itself (no activation quantizer) or its quantized copy.
struct Operand {
  std::vector<float> buf;
  bool alias = true;
  const float* ptr(const float* src) const { return alias ? src : buf.data(); }
};

struct LayerActs {
  std::vector<float> x_in;               // [T, H] residual stream entering the layer
  std::vector<float> inv1, xn1;          // input norm
  Operand op_q, op_k, op_v;              // operands of q/k/v (of xn1)
  std::vector<float> q_raw, k_raw;       // projections before the head norms
  std::vector<float> inv_q, inv_k;
  std::vector<float> q, k, v;            // after head norm, RoPE and hooks: [T, heads, hd]
  std::vector<float> attn, lse;          // attention output [T, nh*hd], log-sum-exp [T, nh]
  Operand op_o;
  std::vector<float> x_mid;              // residual after attention
  std::vector<float> inv2, xn2;          // post-attention norm
  // MoE
  std::vector<float> rlogits, probs, w;  // [T, E], [T, E], [T, k]
  Operand op_r;
  std::vector<int32_t> idx, perm, inv;   // [T, k], [T*k], [T*k]
  std::vector<int64_t> eoff;             // [E+1]
  std::vector<float> xe;                 // gathered expert inputs [T*k, H]
  Operand op_gate, op_up;                // of xe (MoE) or xn2 (dense)
  std::vector<float> gu, h;              // [rows, 2I], [rows, I]
  Operand op_down;
  std::vector<float> ye;                 // expert outputs [T*k, H] (MoE) / MLP output [T, H] (dense)
  std::vector<float> mlp_out;            // [T, H]
  std::vector<float> o_out;              // o_proj output [T, H]
};

}  // namespace

// Backward temporaries, kept between calls so that large buffers are not re-allocated (and
// page-faulted) at every step.
struct Scratch {
  std::vector<float> dx, dxf, dxn1, dxn2, tmp, dattn, dq, dk, dv, dq_raw, dk_raw, dye, dw, dxe, extra, dlog, dh, dgu;
};

inline float* sized(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

struct Activations::Impl {
  Scratch scratch;
  Batch batch;
  std::vector<int64_t> pos;
  std::vector<float> cos, sin;
  std::vector<LayerActs> layers;
  std::vector<float> x_final, inv_f, xf;
  Operand op_lm;
  double aux = 0, z = 0, aux_coef = 0, z_coef = 0;
  std::vector<double> F;  // aux loss: per expert, the fraction of selections over all MoE layers' tokens
  int nsparse = 0;
  bool valid = false;
};

Activations::Activations() : impl(std::make_unique<Impl>()) {}
Activations::~Activations() = default;
Activations::Activations(Activations&&) noexcept = default;
Activations& Activations::operator=(Activations&&) noexcept = default;
double Activations::aux_loss() const { return impl->aux; }
double Activations::z_loss() const { return impl->z; }
int64_t Activations::ntokens() const { return impl->batch.ntokens(); }

// ---------------------------------------------------------------------------------------------
// Model: construction, numerics

struct Model::Index {
  struct Lin {
    int q = -1, k = -1, v = -1, o = -1, router = -1, mlp = -1;  // mlp: dense gate/up/down or expert 0's
  };
  std::vector<Lin> layers;
  int lm_head = -1;
};

Model::Model(Weights& w, const PrecisionConfig& p) : Model(w, p, Quantize::Now) {}

Model::Model(Weights& w, const PrecisionConfig& p, Quantize when)
    : w_(&w), prec_(p), index_(std::make_unique<Index>()) {
  w_->cfg.validate("model config");
  QUADS_CHECK(w_->data.size() == w_->layout.total, "model weights hold {} floats, the layout needs {}", w_->data.size(),
              w_->layout.total);
  build_linears();
  if (when == Quantize::Now) sync();
}

Model::~Model() = default;

void Model::set_precision(const PrecisionConfig& p) {
  prec_ = p;
  build_linears();
  sync();
}

void Model::build_linears() {
  const ModelConfig& c = w_->cfg;
  const Layout& L = w_->layout;
  linears_.clear();
  index_->layers.assign(c.num_hidden_layers, {});
  const LinearTable t = linear_table(c, L);
  for (const LinearSpec& s : t.specs) {
    LinearQ q;
    q.name = s.name;
    q.layer = s.layer;
    q.out = s.out;
    q.in = s.in;
    q.offset = s.offset;
    q.num = prec_.for_linear(s.name, s.layer, c.num_hidden_layers);
    linears_.push_back(std::move(q));
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LinearTable::Layer& y = t.layers[l];
    index_->layers[l] = {y.q, y.k, y.v, y.o, y.router, y.mlp};
  }
  index_->lm_head = t.lm_head;
  // Validate every quantizer against its shapes now, so that nothing throws inside a parallel region.
  for (const auto& q : linears_) {
    if (q.num.weight.kind == QuantKind::Quant) num::check_config(q.num.weight.cfg, q.out, q.in, q.name + ".weight");
    if (q.num.act.kind == QuantKind::Quant) num::check_config(q.num.act.cfg, 1, q.in, q.name + " input");
  }
}

LinearQ* Model::find_linear(const std::string& module) {
  for (auto& q : linears_)
    if (q.name == module) return &q;
  return nullptr;
}

void Model::sync() {
  weff_.resize(w_->data.size());
  const int n = static_cast<int>(linears_.size());
  // Each linear is independent; the quantizers are deterministic whatever the thread.
#pragma omp parallel for schedule(dynamic) if (n > 1 && w_->data.size() > (size_t(1) << 20))
  for (int i = 0; i < n; ++i) {
    LinearQ& q = linears_[i];
    quantize_weight(q, w_->data.data() + q.offset, weff_.data() + q.offset);
  }
}

// ---------------------------------------------------------------------------------------------
// The forward / backward implementation

struct ModelImpl {
  Model& m;
  const ModelConfig& c;
  const Layout& lay;
  const float* W;      // master weights
  const float* Weff;   // effective weights

  explicit ModelImpl(Model& model)
      : m(model), c(model.w_->cfg), lay(model.w_->layout), W(model.w_->data.data()), Weff(model.weff_.data()) {
    QUADS_CHECK(model.weff_.size() == model.w_->data.size(),
                "model: its weights are not quantized yet (built with Quantize::Later: sync() first)");
  }

  const LinearQ& lin(int i) const { return m.linears_[i]; }
  const Model::Index::Lin& idx(int l) const { return m.index_->layers[l]; }

  // Y = Xop · W_effᵀ; X is the unquantized input, for the residual GEMM of RAC (model/rac.h).
  void gemm(const LinearQ& L, const float* X, const float* Xop, int64_t M, float* Y, int64_t ldy) const {
    const float* Wl = Weff + L.offset;
    if (m.forward_gemm == GemmMode::RowInvariant)
      cpu::gemm_nt_rowinv(M, L.out, L.in, Xop, L.in, Wl, L.in, Y, ldy);
    else
      cpu::gemm_nt(M, L.out, L.in, Xop, L.in, Wl, L.in, Y, ldy);
    if (X != Xop) rac_apply(L, X, Xop, M, Wl, Y, ldy);
  }

  // Fills `op` with the operand of L for input X [M, in]; shares `other` when it has the same quantizer.
  static void make_operand(const LinearQ& L, const float* X, int64_t M, Operand& op, const LinearQ* other = nullptr,
                           const Operand* other_op = nullptr) {
    if (L.num.act.kind == QuantKind::None) {
      op.alias = true;
      return;
    }
    op.alias = false;
    if (other && other_op && !other_op->alias && other->num.act == L.num.act &&
        other->act_static_amax == L.act_static_amax) {
      op.buf = other_op->buf;
      return;
    }
    op.buf.resize(size_t(M) * L.in);
    quantize_act(L, X, M, op.buf.data());
  }

  void probe(const ForwardOptions* opt, const LinearQ& L, const float* X, const Operand& op, const float* Y,
             int64_t M) const {
    if (opt && opt->probe) opt->probe(L, X, op.ptr(X), Y, M);
  }

  // Segments of the token rows: for attention, where each one's keys and values live.
  struct Segment {
    int64_t r0 = 0, r1 = 0;  // token rows
    int64_t start = 0;       // position of row r0 (0 in training)
    int slot = -1;           // cache slot (decode), -1 in training
  };

  // One decoder layer, x [T, H] updated in place. With a cache, new keys/values are stored in it.
  void layer_forward(int l, float* x, int64_t T, const std::vector<Segment>& segs, const float* cos, const float* sin,
                     LayerActs& a, bool save, KVCache* cache, const ForwardOptions* opt, const int32_t* forced,
                     std::vector<int32_t>* record, double* aux_F, double* aux_P, double* zsum) const {
    const LayerOffsets& o = lay.layers[l];
    const Model::Index::Lin& ix = idx(l);
    const int64_t H = c.hidden_size;
    const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    const int64_t qd = c.q_dim(), kvd = c.kv_dim();
    const float eps = static_cast<float>(c.rms_norm_eps);

    if (save) a.x_in.assign(x, x + T * H);
    a.inv1.resize(T);
    a.xn1.resize(T * H);
    cpu::rmsnorm_forward(x, W + o.input_norm, T, H, eps, a.xn1.data(), a.inv1.data());

    // q, k, v
    const LinearQ &Lq = lin(ix.q), &Lk = lin(ix.k), &Lv = lin(ix.v), &Lo = lin(ix.o);
    make_operand(Lq, a.xn1.data(), T, a.op_q);
    make_operand(Lk, a.xn1.data(), T, a.op_k, &Lq, &a.op_q);
    make_operand(Lv, a.xn1.data(), T, a.op_v, &Lk, &a.op_k);
    a.q_raw.resize(T * qd);
    a.k_raw.resize(T * kvd);
    a.v.resize(T * kvd);
    gemm(Lq, a.xn1.data(), a.op_q.ptr(a.xn1.data()), T, a.q_raw.data(), qd);
    gemm(Lk, a.xn1.data(), a.op_k.ptr(a.xn1.data()), T, a.k_raw.data(), kvd);
    gemm(Lv, a.xn1.data(), a.op_v.ptr(a.xn1.data()), T, a.v.data(), kvd);
    probe(opt, Lq, a.xn1.data(), a.op_q, a.q_raw.data(), T);
    probe(opt, Lk, a.xn1.data(), a.op_k, a.k_raw.data(), T);
    probe(opt, Lv, a.xn1.data(), a.op_v, a.v.data(), T);

    // Head norms, hooks, RoPE.
    a.q.resize(T * qd);
    a.k.resize(T * kvd);
    a.inv_q.resize(T * nh);
    a.inv_k.resize(T * nkv);
    cpu::rmsnorm_forward(a.q_raw.data(), W + o.q_norm, T * nh, hd, eps, a.q.data(), a.inv_q.data());
    cpu::rmsnorm_forward(a.k_raw.data(), W + o.k_norm, T * nkv, hd, eps, a.k.data(), a.inv_k.data());
    if (m.kv_hooks.pre_rope) m.kv_hooks.pre_rope(l, a.q.data(), a.k.data(), T);
    cpu::rope_forward(a.q.data(), T, nh, hd, cos, sin);
    cpu::rope_forward(a.k.data(), T, nkv, hd, cos, sin);
    if (m.kv_hooks.post_rope) m.kv_hooks.post_rope(l, a.k.data(), a.v.data(), T);

    // Attention, one segment at a time.
    a.attn.resize(T * qd);
    a.lse.resize(T * nh);
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    for (const Segment& s : segs) {
      const int64_t n = s.r1 - s.r0;
      if (n == 0) continue;
      const float *kp, *vp;
      int64_t L;
      if (cache) {
        float* kc = cache->keys(l, s.slot);
        float* vc = cache->values(l, s.slot);
        std::memcpy(kc + s.start * kvd, a.k.data() + s.r0 * kvd, sizeof(float) * n * kvd);
        std::memcpy(vc + s.start * kvd, a.v.data() + s.r0 * kvd, sizeof(float) * n * kvd);
        kp = kc;
        vp = vc;
        L = s.start + n;
      } else {
        kp = a.k.data() + s.r0 * kvd;
        vp = a.v.data() + s.r0 * kvd;
        L = n;
      }
      cpu::attention_forward(a.q.data() + s.r0 * qd, kp, vp, n, L, nh, nkv, hd, scale, a.attn.data() + s.r0 * qd,
                             a.lse.data() + s.r0 * nh);
    }

    // o_proj + residual.
    make_operand(Lo, a.attn.data(), T, a.op_o);
    float* tmp = sized(a.o_out, T * H);
    gemm(Lo, a.attn.data(), a.op_o.ptr(a.attn.data()), T, tmp, H);
    probe(opt, Lo, a.attn.data(), a.op_o, tmp, T);
    cpu::add_inplace(x, tmp, T * H);
    if (save) a.x_mid.assign(x, x + T * H);

    // MLP.
    a.inv2.resize(T);
    a.xn2.resize(T * H);
    cpu::rmsnorm_forward(x, W + o.post_norm, T, H, eps, a.xn2.data(), a.inv2.data());
    a.mlp_out.resize(T * H);
    if (o.sparse)
      moe_forward(l, T, a, opt, forced, record, aux_F, aux_P, zsum);
    else
      dense_forward(l, T, a, opt);
    cpu::add_inplace(x, a.mlp_out.data(), T * H);
  }

  // gu = X · [W_gate; W_up]ᵀ with each half's own operand; h = swiglu(gu); y = h · W_downᵀ.
  void mlp_rows(const LinearQ& Lg, const LinearQ& Lu, const LinearQ& Ld, const float* X, int64_t n, Operand& og,
                Operand& ou, Operand& od, float* gu, float* h, float* y, const ForwardOptions* opt) const {
    const int64_t I = Lg.out, H = Lg.in;
    make_operand(Lg, X, n, og);
    make_operand(Lu, X, n, ou, &Lg, &og);
    gemm(Lg, X, og.ptr(X), n, gu, 2 * I);
    gemm(Lu, X, ou.ptr(X), n, gu + I, 2 * I);
    cpu::swiglu_forward(gu, n, I, h);
    make_operand(Ld, h, n, od);
    gemm(Ld, h, od.ptr(h), n, y, H);
    if (opt && opt->probe) {
      // The probe sees each half of the fused product as its own [n, I] output.
      std::vector<float> part(n * I);
      for (int half = 0; half < 2; ++half) {
        for (int64_t r = 0; r < n; ++r) std::memcpy(part.data() + r * I, gu + r * 2 * I + half * I, sizeof(float) * I);
        probe(opt, half ? Lu : Lg, X, half ? ou : og, part.data(), n);
      }
      probe(opt, Ld, h, od, y, n);
    }
  }

  void dense_forward(int l, int64_t T, LayerActs& a, const ForwardOptions* opt) const {
    const int base = idx(l).mlp;
    const int64_t I = lin(base).out;
    a.gu.resize(T * 2 * I);
    a.h.resize(T * I);
    mlp_rows(lin(base), lin(base + 1), lin(base + 2), a.xn2.data(), T, a.op_gate, a.op_up, a.op_down, a.gu.data(),
             a.h.data(), a.mlp_out.data(), opt);
  }

  void moe_forward(int l, int64_t T, LayerActs& a, const ForwardOptions* opt, const int32_t* forced,
                   std::vector<int32_t>* record, double* aux_F, double* aux_P, double* zsum) const {
    const Model::Index::Lin& ix = idx(l);
    const int E = c.num_experts, k = c.num_experts_per_tok;
    const int64_t H = c.hidden_size;
    const LinearQ& Lr = lin(ix.router);
    // Router (its own numerics, `high` by default), softmax in float32, top-k.
    make_operand(Lr, a.xn2.data(), T, a.op_r);
    a.rlogits.resize(T * E);
    gemm(Lr, a.xn2.data(), a.op_r.ptr(a.xn2.data()), T, a.rlogits.data(), E);
    probe(opt, Lr, a.xn2.data(), a.op_r, a.rlogits.data(), T);
    a.probs.resize(T * E);
    a.idx.resize(T * k);
    a.w.resize(T * k);
    cpu::router_topk_forward(a.rlogits.data(), T, E, k, c.norm_topk_prob, a.probs.data(), a.idx.data(), a.w.data(),
                             forced);
    if (record) record->assign(a.idx.begin(), a.idx.end());
    // Router-loss statistics (float64, token order).
    if (aux_F) {
      for (int64_t i = 0; i < T * k; ++i) aux_F[a.idx[i]] += 1.0;
      for (int64_t t = 0; t < T; ++t)
        for (int e = 0; e < E; ++e) aux_P[e] += a.probs[t * E + e];
    }
    if (zsum) {
      std::vector<double> zt(T);
      cpu::router_logsumexp(a.rlogits.data(), T, E, zt.data());
      for (int64_t t = 0; t < T; ++t) *zsum += zt[t] * zt[t];
    }
    // Group the (token, slot) pairs by expert; each expert runs one GEMM over its rows.
    a.eoff.resize(E + 1);
    a.perm.resize(T * k);
    a.inv.resize(T * k);
    cpu::moe_permute(a.idx.data(), T, k, E, a.eoff.data(), a.perm.data(), a.inv.data());
    const int64_t R = T * k;
    a.xe.resize(R * H);
    cpu::moe_gather(a.xn2.data(), a.perm.data(), R, k, H, a.xe.data());
    const int64_t I = static_cast<int64_t>(lay.layers[l].inter);
    a.gu.resize(R * 2 * I);
    a.h.resize(R * I);
    a.ye.resize(R * H);
    // Operands are per expert here but stored as one [R, .] buffer in permuted row order.
    std::vector<Operand> og(E), ou(E), od(E);
    auto run_expert = [&](int e) {
      const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
      if (n == 0) return;
      const int b = ix.mlp + 3 * e;
      mlp_rows(lin(b), lin(b + 1), lin(b + 2), a.xe.data() + r0 * H, n, og[e], ou[e], od[e], a.gu.data() + r0 * 2 * I,
               a.h.data() + r0 * I, a.ye.data() + r0 * H, opt);
    };
    const bool parallel_experts =
        m.forward_gemm == GemmMode::RowInvariant && !(opt && opt->probe) && R * H * I > (int64_t(1) << 18);
    if (parallel_experts) {
      // Rows of an expert are computed the same way whichever thread runs it (row-invariant GEMMs).
#pragma omp parallel for schedule(dynamic)
      for (int e = 0; e < E; ++e) run_expert(e);
    } else {
      for (int e = 0; e < E; ++e) run_expert(e);
    }
    // Keep the quantized operands for the backward, in permuted row order.
    auto pack = [&](std::vector<Operand>& ops, Operand& dst, int64_t width, int which) {
      bool any = false;
      for (int e = 0; e < E; ++e) any |= lin(ix.mlp + 3 * e + which).num.act.kind != QuantKind::None;
      dst.alias = !any;
      if (!any) return;
      dst.buf.resize(R * width);
      for (int e = 0; e < E; ++e) {
        const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
        if (n == 0) continue;
        const Operand& s = ops[e];
        const float* src = s.alias ? (which == 2 ? a.h.data() + r0 * width : a.xe.data() + r0 * width) : s.buf.data();
        std::memcpy(dst.buf.data() + r0 * width, src, sizeof(float) * n * width);
      }
    };
    pack(og, a.op_gate, H, 0);
    pack(ou, a.op_up, H, 1);
    pack(od, a.op_down, I, 2);
    cpu::moe_combine_forward(a.ye.data(), a.inv.data(), a.w.data(), T, k, H, a.mlp_out.data());
  }

  // ---- backward

  // Linear backward: dX (+)= dY · W_eff; dW += dYᵀ · X_op.
  void linear_backward(const LinearQ& L, const float* dY, int64_t M, int64_t lddy, const float* Xop, float* dX,
                       bool accumulate, float* grads) const {
    cpu::gemm_nn(M, L.out, L.in, dY, lddy, Weff + L.offset, L.in, dX, L.in, accumulate);
    cpu::gemm_tn_acc(M, L.out, L.in, dY, lddy, Xop, L.in, grads + L.offset, L.in);
  }

  // Backward of mlp_rows for n rows: Xg / Xu are the gate / up operands, hop the down operand,
  // dy = dL/dy; writes dX, adds the weight gradients, uses dh [n, I] and dgu [n, 2I] as scratch.
  void mlp_rows_backward(const LinearQ& Lg, const LinearQ& Lu, const LinearQ& Ld, const float* Xg, const float* Xu,
                         const float* gu, const float* hop, const float* dy, int64_t n, float* dX, float* grads,
                         float* dh, float* dgu) const {
    const int64_t I = Lg.out;
    linear_backward(Ld, dy, n, Ld.out, hop, dh, false, grads);
    cpu::swiglu_backward(gu, dh, n, I, dgu);
    linear_backward(Lg, dgu, n, 2 * I, Xg, dX, false, grads);
    linear_backward(Lu, dgu + I, n, 2 * I, Xu, dX, true, grads);
  }

  void layer_backward(int l, Activations::Impl& A, float* dx, float* grads) const {
    LayerActs& a = A.layers[l];
    const LayerOffsets& o = lay.layers[l];
    const Model::Index::Lin& ix = idx(l);
    const int64_t T = A.batch.ntokens(), H = c.hidden_size;
    const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
    const int64_t qd = c.q_dim(), kvd = c.kv_dim();

    Scratch& S = A.scratch;
    // MLP: y = x_mid + mlp(norm(x_mid)); dx is dL/dy.
    float* dxn2 = sized(S.dxn2, T * H);
    if (o.sparse)
      moe_backward(l, A, dx, dxn2, grads);
    else {
      const int b = ix.mlp;
      const float* X = a.xn2.data();
      const int64_t I = lin(b).out;
      mlp_rows_backward(lin(b), lin(b + 1), lin(b + 2), a.op_gate.ptr(X), a.op_up.ptr(X), a.gu.data(),
                        a.op_down.ptr(a.h.data()), dx, T, dxn2, grads, sized(S.dh, T * I), sized(S.dgu, T * 2 * I));
    }
    float* tmp = sized(S.tmp, T * H);
    cpu::rmsnorm_backward(dxn2, a.x_mid.data(), W + o.post_norm, a.inv2.data(), T, H, tmp, grads + o.post_norm);
    cpu::add_inplace(dx, tmp, T * H);

    // Attention: x_mid = x_in + o_proj(attn(norm(x_in))).
    float* dattn = sized(S.dattn, T * qd);
    const LinearQ &Lq = lin(ix.q), &Lk = lin(ix.k), &Lv = lin(ix.v), &Lo = lin(ix.o);
    linear_backward(Lo, dx, T, H, a.op_o.ptr(a.attn.data()), dattn, false, grads);
    float* dq = sized(S.dq, T * qd);
    float* dk = sized(S.dk, T * kvd);
    float* dv = sized(S.dv, T * kvd);
    std::fill(dk, dk + T * kvd, 0.f);
    std::fill(dv, dv + T * kvd, 0.f);
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    const Batch& b = A.batch;
    for (int s = 0; s < b.nseq(); ++s) {
      const int64_t r0 = b.offsets[s], n = b.seq_len(s);
      if (n == 0) continue;
      cpu::attention_backward(a.q.data() + r0 * qd, a.k.data() + r0 * kvd, a.v.data() + r0 * kvd,
                              a.attn.data() + r0 * qd, a.lse.data() + r0 * nh, dattn + r0 * qd, n, n, nh, nkv, hd, scale,
                              dq + r0 * qd, dk + r0 * kvd, dv + r0 * kvd);
    }
    // post_rope hook: straight-through.
    cpu::rope_backward(dq, T, nh, hd, A.cos.data(), A.sin.data());
    cpu::rope_backward(dk, T, nkv, hd, A.cos.data(), A.sin.data());
    if (m.kv_hooks.pre_rope_backward) m.kv_hooks.pre_rope_backward(l, dq, dk, T);
    float* dq_raw = sized(S.dq_raw, T * qd);
    float* dk_raw = sized(S.dk_raw, T * kvd);
    cpu::rmsnorm_backward(dq, a.q_raw.data(), W + o.q_norm, a.inv_q.data(), T * nh, hd, dq_raw, grads + o.q_norm);
    cpu::rmsnorm_backward(dk, a.k_raw.data(), W + o.k_norm, a.inv_k.data(), T * nkv, hd, dk_raw, grads + o.k_norm);
    float* dxn1 = sized(S.dxn1, T * H);
    const float* X1 = a.xn1.data();
    linear_backward(Lq, dq_raw, T, qd, a.op_q.ptr(X1), dxn1, false, grads);
    linear_backward(Lk, dk_raw, T, kvd, a.op_k.ptr(X1), dxn1, true, grads);
    linear_backward(Lv, dv, T, kvd, a.op_v.ptr(X1), dxn1, true, grads);
    cpu::rmsnorm_backward(dxn1, a.x_in.data(), W + o.input_norm, a.inv1.data(), T, H, tmp, grads + o.input_norm);
    cpu::add_inplace(dx, tmp, T * H);
  }

  void moe_backward(int l, Activations::Impl& A, const float* dy, float* dxn2, float* grads) const {
    LayerActs& a = A.layers[l];
    const Model::Index::Lin& ix = idx(l);
    const int E = c.num_experts, k = c.num_experts_per_tok;
    const int64_t T = A.batch.ntokens(), H = c.hidden_size, R = T * k;
    const int64_t I = static_cast<int64_t>(lay.layers[l].inter);
    Scratch& S = A.scratch;
    float* dye = sized(S.dye, R * H);
    float* dw = sized(S.dw, T * k);
    float* dxe = sized(S.dxe, R * H);
    float* dh = sized(S.dh, R * I);
    float* dgu = sized(S.dgu, R * 2 * I);
    cpu::moe_combine_backward(dy, a.ye.data(), a.inv.data(), a.w.data(), T, k, H, dye, dw);
    for (int e = 0; e < E; ++e) {
      const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
      if (n == 0) continue;
      const int b = ix.mlp + 3 * e;
      const float* X = a.xe.data() + r0 * H;
      const float* Xg = a.op_gate.alias ? X : a.op_gate.buf.data() + r0 * H;
      const float* Xu = a.op_up.alias ? X : a.op_up.buf.data() + r0 * H;
      const float* hh = a.h.data() + r0 * I;
      const float* hop = a.op_down.alias ? hh : a.op_down.buf.data() + r0 * I;
      mlp_rows_backward(lin(b), lin(b + 1), lin(b + 2), Xg, Xu, a.gu.data() + r0 * 2 * I, hop, dye + r0 * H, n,
                        dxe + r0 * H, grads, dh + r0 * I, dgu + r0 * 2 * I);
    }
    cpu::moe_scatter_add(dxe, a.inv.data(), T, k, H, dxn2, false);
    // Router: through the top-k weights, plus the aux and z losses.
    float* extra = nullptr;
    const double nrows = double(A.nsparse) * double(T);
    if (A.aux_coef != 0) {
      extra = sized(S.extra, T * E);
      for (int e = 0; e < E; ++e) {
        const float g = static_cast<float>(A.aux_coef * E * A.F[e] / nrows);
        for (int64_t t = 0; t < T; ++t) extra[t * E + e] = g;
      }
    }
    float* dlog = sized(S.dlog, T * E);
    cpu::router_topk_backward(a.probs.data(), a.idx.data(), a.w.data(), dw, extra, T, E, k, c.norm_topk_prob, dlog);
    if (A.z_coef != 0) {
      std::vector<double> g(T);
      cpu::router_logsumexp(a.rlogits.data(), T, E, g.data());
      for (int64_t t = 0; t < T; ++t) g[t] = A.z_coef * 2.0 * g[t] / nrows;
      cpu::router_zloss_backward(a.probs.data(), g.data(), T, E, dlog);
    }
    const LinearQ& Lr = lin(ix.router);
    cpu::gemm_nn(T, E, H, dlog, E, Weff + Lr.offset, H, dxn2, H, true);
    cpu::gemm_tn_acc(T, E, H, dlog, E, a.op_r.ptr(a.xn2.data()), H, grads + Lr.offset, H);
  }
};

// ---------------------------------------------------------------------------------------------
// Public entry points

namespace {

void check_tokens(const std::vector<int32_t>& tokens, int vocab, const char* what) {
  for (size_t i = 0; i < tokens.size(); ++i)
    QUADS_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "{}: token id {} at index {} is outside the vocabulary (0..{})",
                what, tokens[i], i, vocab - 1);
}

}  // namespace

// Static activation scales are set after construction (calibration), so they are checked when the
// model runs: here, before any parallel region.
static void check_static_scales(const std::vector<LinearQ>& linears) {
  for (const auto& q : linears)
    if (q.num.act.kind == QuantKind::Quant && q.num.act.cfg.scheme == num::Scheme::NVFP4 &&
        q.num.act.cfg.global == num::Global::Static)
      QUADS_CHECK(q.act_static_amax > 0 || q.num.act.cfg.static_amax > 0,
                  "{}: static activation scale requested but no calibrated amax is set (LinearQ::act_static_amax)",
                  q.name);
}

void Model::forward(const Batch& b, float* logits, Activations* acts, const ForwardOptions& opt) {
  check_static_scales(linears_);
  const ModelConfig& c = w_->cfg;
  const int64_t T = b.ntokens(), H = c.hidden_size, V = c.vocab_size;
  QUADS_CHECK(b.offsets.size() >= 1 && b.offsets.front() == 0 && b.offsets.back() == T,
              "forward: batch offsets do not cover its {} tokens", T);
  for (int s = 0; s < b.nseq(); ++s)
    QUADS_CHECK(b.offsets[s + 1] >= b.offsets[s], "forward: batch offsets are not increasing at sequence {}", s);
  check_tokens(b.tokens, c.vocab_size, "forward");
  const int k = c.num_experts_per_tok;
  if (opt.replay) {
    QUADS_CHECK(static_cast<int>(opt.replay->experts.size()) == c.num_hidden_layers,
                "routing replay: {} layers given, the model has {}", opt.replay->experts.size(), c.num_hidden_layers);
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      if (!c.is_sparse(l)) continue;
      const auto& r = opt.replay->experts[l];
      QUADS_CHECK(static_cast<int64_t>(r.size()) == T * k, "routing replay: layer {} has {} entries, expected {}", l,
                  r.size(), T * k);
      for (int64_t t = 0; t < T; ++t)
        for (int s = 0; s < k; ++s) {
          const int32_t e = r[t * k + s];
          QUADS_CHECK(e >= 0 && e < c.num_experts, "routing replay: layer {} token {}: expert {} out of range", l, t, e);
          for (int s2 = 0; s2 < s; ++s2)
            QUADS_CHECK(r[t * k + s2] != e, "routing replay: layer {} token {}: expert {} chosen twice", l, t, e);
        }
    }
  }
  if (opt.record) opt.record->experts.assign(c.num_hidden_layers, {});

  Activations local;
  Activations::Impl& A = acts ? *acts->impl : *local.impl;
  const bool save = acts != nullptr;
  A.valid = false;
  A.batch = b;
  A.pos.resize(T);
  for (int s = 0; s < b.nseq(); ++s)
    for (int64_t t = b.offsets[s]; t < b.offsets[s + 1]; ++t) A.pos[t] = t - b.offsets[s];
  A.cos.resize(T * c.head_dim / 2);
  A.sin.resize(T * c.head_dim / 2);
  cpu::rope_tables(A.pos.data(), T, c.head_dim, c.rope_theta, A.cos.data(), A.sin.data());
  A.layers.resize(save ? c.num_hidden_layers : 1);
  A.aux_coef = opt.aux_loss_coef;
  A.z_coef = opt.z_loss_coef;
  A.nsparse = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) A.nsparse += c.is_sparse(l);
  std::vector<double> F(c.num_experts, 0.0), P(c.num_experts, 0.0);
  double zsum = 0;

  std::vector<ModelImpl::Segment> segs(b.nseq());
  for (int s = 0; s < b.nseq(); ++s) segs[s] = {b.offsets[s], b.offsets[s + 1], 0, -1};

  ModelImpl impl(*this);
  std::vector<float> x(T * H);
  cpu::embedding_forward(w_->data.data() + w_->layout.embed, b.tokens.data(), T, H, x.data());
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerActs& a = A.layers[save ? l : 0];
    const int32_t* forced = (opt.replay && c.is_sparse(l)) ? opt.replay->experts[l].data() : nullptr;
    std::vector<int32_t>* rec = opt.record ? &opt.record->experts[l] : nullptr;
    impl.layer_forward(l, x.data(), T, segs, A.cos.data(), A.sin.data(), a, save, nullptr, &opt, forced, rec, F.data(),
                       P.data(), &zsum);
  }
  if (save) A.x_final = x;
  A.inv_f.resize(T);
  A.xf.resize(T * H);
  cpu::rmsnorm_forward(x.data(), w_->data.data() + w_->layout.final_norm, T, H, static_cast<float>(c.rms_norm_eps),
                       A.xf.data(), A.inv_f.data());
  const LinearQ& Llm = linears_[index_->lm_head];
  ModelImpl::make_operand(Llm, A.xf.data(), T, A.op_lm);
  impl.gemm(Llm, A.xf.data(), A.op_lm.ptr(A.xf.data()), T, logits, V);
  impl.probe(&opt, Llm, A.xf.data(), A.op_lm, logits, T);

  // Router losses over all MoE layers' tokens, concatenated as HF's load_balancing_loss_func does.
  A.aux = 0;
  A.z = 0;
  A.F.assign(c.num_experts, 0.0);
  if (A.nsparse > 0 && T > 0) {
    const double rows = double(A.nsparse) * double(T);
    for (int e = 0; e < c.num_experts; ++e) {
      A.F[e] = F[e] / rows;
      A.aux += A.F[e] * (P[e] / rows);
    }
    A.aux *= c.num_experts;
    A.z = zsum / rows;
  }
  A.valid = save;
}

void Model::backward(Activations& acts, const float* dlogits, float* grads) {
  Activations::Impl& A = *acts.impl;
  QUADS_CHECK(A.valid, "backward: the activations do not come from a forward with saved activations");
  const ModelConfig& c = w_->cfg;
  const int64_t T = A.batch.ntokens(), H = c.hidden_size, V = c.vocab_size;
  ModelImpl impl(*this);
  const LinearQ& Llm = linears_[index_->lm_head];
  float* dxf = sized(A.scratch.dxf, T * H);
  float* dx = sized(A.scratch.dx, T * H);
  impl.linear_backward(Llm, dlogits, T, V, A.op_lm.ptr(A.xf.data()), dxf, false, grads);
  cpu::rmsnorm_backward(dxf, A.x_final.data(), w_->data.data() + w_->layout.final_norm, A.inv_f.data(), T, H, dx,
                        grads + w_->layout.final_norm);
  for (int l = c.num_hidden_layers - 1; l >= 0; --l) impl.layer_backward(l, A, dx, grads);
  cpu::embedding_backward(dx, A.batch.tokens.data(), T, H, grads + w_->layout.embed);
}

std::vector<float> Model::step(KVCache& cache, const std::vector<StepItem>& items, Routing* record) {
  check_static_scales(linears_);
  const ModelConfig& c = w_->cfg;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  std::vector<ModelImpl::Segment> segs;
  std::vector<int32_t> tokens;
  std::vector<int64_t> pos;
  std::vector<uint8_t> used(cache.num_slots(), 0);
  int64_t nout = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    QUADS_CHECK(it.slot >= 0 && it.slot < cache.num_slots(), "step: item {} uses slot {}, the cache has {}", i, it.slot,
                cache.num_slots());
    QUADS_CHECK(!used[it.slot], "step: slot {} appears twice in one step", it.slot);
    QUADS_CHECK(!it.tokens.empty(), "step: item {} (slot {}) has no tokens", i, it.slot);
    used[it.slot] = 1;
    check_tokens(it.tokens, c.vocab_size, "step");
    ModelImpl::Segment s;
    s.r0 = static_cast<int64_t>(tokens.size());
    s.r1 = s.r0 + static_cast<int64_t>(it.tokens.size());
    s.slot = it.slot;
    s.start = cache.length(it.slot);
    for (int64_t j = 0; j < s.r1 - s.r0; ++j) pos.push_back(s.start + j);
    tokens.insert(tokens.end(), it.tokens.begin(), it.tokens.end());
    segs.push_back(s);
    nout += it.all_logits ? static_cast<int64_t>(it.tokens.size()) : 1;
  }
  const int64_t T = static_cast<int64_t>(tokens.size());
  for (const auto& s : segs) cache.extend(s.slot, s.r1 - s.r0);
  if (record) record->experts.assign(c.num_hidden_layers, {});

  std::vector<float> cos(T * c.head_dim / 2), sin(T * c.head_dim / 2);
  cpu::rope_tables(pos.data(), T, c.head_dim, c.rope_theta, cos.data(), sin.data());
  ModelImpl impl(*this);
  std::vector<float> x(T * H);
  cpu::embedding_forward(w_->data.data() + w_->layout.embed, tokens.data(), T, H, x.data());
  LayerActs a;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    impl.layer_forward(l, x.data(), T, segs, cos.data(), sin.data(), a, false, &cache, nullptr, nullptr,
                       record ? &record->experts[l] : nullptr, nullptr, nullptr, nullptr);
  // Final norm and lm_head only for the rows that are returned.
  std::vector<float> xs(nout * H);
  int64_t r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& s = segs[i];
    const int64_t from = items[i].all_logits ? s.r0 : s.r1 - 1;
    for (int64_t t = from; t < s.r1; ++t, ++r) std::memcpy(xs.data() + r * H, x.data() + t * H, sizeof(float) * H);
  }
  std::vector<float> xf(nout * H);
  cpu::rmsnorm_forward(xs.data(), w_->data.data() + w_->layout.final_norm, nout, H, static_cast<float>(c.rms_norm_eps),
                       xf.data(), nullptr);
  const LinearQ& Llm = linears_[index_->lm_head];
  Operand op;
  ModelImpl::make_operand(Llm, xf.data(), nout, op);
  std::vector<float> logits(nout * V);
  impl.gemm(Llm, xf.data(), op.ptr(xf.data()), nout, logits.data(), V);
  return logits;
}

std::vector<float> Model::token_logprobs(const Batch& b, int64_t chunk) {
  QUADS_CHECK(chunk > 0, "token_logprobs: chunk must be > 0");
  const int64_t V = w_->cfg.vocab_size;
  std::vector<float> out;
  KVCache cache(w_->cfg, 1);
  for (int s = 0; s < b.nseq(); ++s) {
    cache.clear(0);
    const int64_t r0 = b.offsets[s], n = b.seq_len(s);
    for (int64_t p = 0; p + 1 < n; p += chunk) {
      const int64_t m = std::min(chunk, n - 1 - p);
      StepItem it;
      it.slot = 0;
      it.tokens.assign(b.tokens.begin() + r0 + p, b.tokens.begin() + r0 + p + m);
      it.all_logits = true;
      const std::vector<float> lg = step(cache, {it});
      for (int64_t i = 0; i < m; ++i) {
        const float* row = lg.data() + i * V;
        const int32_t target = b.tokens[r0 + p + i + 1];
        const float mx = *std::max_element(row, row + V);
        double sum = 0;
        for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
        out.push_back(static_cast<float>(double(row[target]) - mx - std::log(sum)));
      }
    }
  }
  return out;
}

}  // namespace quads::model
