// GpuTrainer: host orchestration of the training forward, backward and AdamW on the GPU (see
// train_gpu.h). The layer kernels are in train_kernels.cu / model_kernels.cu, the quantizers in
// quant.cu, the GEMMs are cuBLAS. It follows model::Model::forward / backward (model/model.cpp)
// step by step; comments name the CPU step where the order matters.
#include "cuda/train_gpu.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "common/error.h"
#include "cpu/ops.h"
#include "cuda/attention_tc.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/model_kernels.h"
#include "cuda/quant.h"
#include "cuda/train_gpu_kernels.h"
#include "cuda/train_kernels.h"

namespace quads::cuda {

namespace {

using model::QuantKind;

enum class Path : uint8_t { Exact, Fast };

// Weights the fast path can hold as a BF16 operand with a scalar alpha.
bool fast_weight(const model::OperandQuant& w) {
  if (w.kind == QuantKind::BF16) return true;
  return w.kind == QuantKind::Quant && w.cfg.scheme == num::Scheme::NVFP4 && w.cfg.element == num::Format::E2M1 &&
         w.cfg.block == num::Block::B1x16 && w.cfg.global == num::Global::PerTensor && !w.cfg.stochastic;
}

Path choose_path(const model::LinearNumerics& n) {
  return n.act.kind == QuantKind::BF16 && fast_weight(n.weight) ? Path::Fast : Path::Exact;
}

struct Lin {
  std::string name;
  int layer = -1;
  int64_t out = 0, in = 0;
  size_t offset = 0;
  model::LinearNumerics num;
  Path path = Path::Exact;
  bool nvfp4() const { return path == Path::Fast && num.weight.kind == QuantKind::Quant; }
};

// A GEMM's activation operand: float32 X_eff (exact path) or BF16 bits (fast path).
struct Opnd {
  const float* f = nullptr;
  const uint16_t* b = nullptr;
  Opnd rows(int64_t r0, int64_t in) const {
    Opnd o;
    if (f) o.f = f + r0 * in;
    if (b) o.b = b + r0 * in;
    return o;
  }
};

// One fast-path GEMM as cublasGemmEx takes it (column-major, BF16 operands, FP32 C), kept for an
// expert batch: alpha = alphas[alpha_li] (the linear's NVFP4 decode scale) or 1, beta 0 or 1.
struct GemmOp {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  int m = 0, n = 0, k = 0;
  int alpha_li = -1;
  bool beta1 = false;
  const void* A = nullptr;
  const void* B = nullptr;
  void* C = nullptr;
  int lda = 0, ldb = 0, ldc = 0;
  int lane = 0;   // the expert: its GEMMs stay in issue order on one stream
  int phase = 0;  // j > 0: accumulates onto the C of phase j - 1 (QAT's unfused up-projection dX)
};

// How the fast path runs the experts' GEMMs of a MoE layer.
enum class ExpertGemms : uint8_t { PerExpert, Grouped, Streams };
constexpr int kLanes = 8;  // streams of the Streams mode and of the re-quantization (the main stream is lane 0)

// Grow-only buffer (contents are not kept).
template <typename T>
T* need(DeviceArray<T>& a, size_t n) {
  if (a.size() < n) a.resize(n);
  return a.data();
}

// What one decoder layer keeps for the backward.
struct LayerBuf {
  DeviceArray<float> x_mid, inv1, xn1, q_raw, k_raw, inv_q, inv_k, q, k, v, attn, lse, inv2, xn2;
  DeviceArray<float> probs, w, gu, h, ye, xe;
  DeviceArray<float> qp, kp, vp, attn_p;  // head_dim padded for the attention kernels (see attn_hd)
  DeviceArray<int32_t> idx, perm, inv;
  std::vector<int64_t> eoff;  // host: expert row offsets [E + 1] (dense: {0, T})
  DeviceArray<float> f_qkv, f_o, f_r, f_in, f_d;       // exact operands (when not the input itself)
  DeviceArray<uint16_t> b_qkv, b_o, b_r, b_in, b_d;    // fast operands
  Opnd op_qkv, op_o, op_r, op_in, op_d;
};

}  // namespace

// The fast path's GEMMs through cuBLASLt with our own algorithm cache. The experts' GEMMs change
// shape every step (an expert's token count is its routing's), and cublasGemmEx ran cuBLAS's
// heuristics for each new shape: a first trainer in a process spent 266 ms per 8x1024 step in
// GEMMs, a trainer that had seen the same shapes 116 ms. Here the heuristic runs once per bucket
// (each dimension rounded up to a power of two, the leading dimensions, the operands' alignment),
// and that algorithm runs every shape of the bucket; should cuBLASLt refuse it for a shape, that
// shape gets its own heuristic. Deterministic: a shape's algorithm depends only on its bucket.
class LtGemms {
 public:
  LtGemms() { QUADS_CUBLAS_CHECK(cublasLtCreate(&lt_)); }
  ~LtGemms() {
    if (lt_) cublasLtDestroy(lt_);
  }
  LtGemms(const LtGemms&) = delete;
  LtGemms& operator=(const LtGemms&) = delete;

  // C[m, n] (column-major, FP32, ldc) = alpha op(A) op(B) + beta C, A and B BF16; alpha and beta
  // are device pointers.
  void run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* alpha, const void* A, int lda,
           const void* B, int ldb, const float* beta, void* C, int ldc, void* ws, size_t ws_bytes, cudaStream_t s) {
    const int align = std::min({alignment(A), alignment(B), alignment(C)});
    const Key key{ta, tb, bucket(m), bucket(n), bucket(k), lda, ldb, ldc, align, ws_bytes};
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      cublasLtMatmulAlgo_t algo{};
      const bool ok = heuristic(ta, tb, key.m, key.n, key.k, std::max(lda, rows(ta, key.m, key.k)),
                                std::max(ldb, rows(tb, key.k, key.n)), std::max(ldc, key.m), align, ws_bytes, &algo);
      it = algos_.emplace(key, Entry{ok, algo}).first;
    }
    Desc d(ta, tb, m, n, k, lda, ldb, ldc);
    if (it->second.ok && cublasLtMatmul(lt_, d.op, alpha, A, d.a, B, d.b, beta, C, d.c, C, d.c, &it->second.algo, ws,
                                        ws_bytes, s) == CUBLAS_STATUS_SUCCESS)
      return;
    ++misses_;
    cublasLtMatmulAlgo_t algo{};
    QUADS_CHECK(heuristic(ta, tb, m, n, k, lda, ldb, ldc, align, ws_bytes, &algo),
                "GpuTrainer: cuBLASLt has no BF16 GEMM for m={} n={} k={}", m, n, k);
    QUADS_CUBLAS_CHECK(cublasLtMatmul(lt_, d.op, alpha, A, d.a, B, d.b, beta, C, d.c, C, d.c, &algo, ws, ws_bytes, s));
  }
  size_t buckets() const { return algos_.size(); }
  int64_t misses() const { return misses_; }

 private:
  struct Key {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc, align;
    size_t ws;
    auto tie() const { return std::tie(ta, tb, m, n, k, lda, ldb, ldc, align, ws); }
    bool operator<(const Key& o) const { return tie() < o.tie(); }
  };
  struct Entry {
    bool ok;
    cublasLtMatmulAlgo_t algo;
  };
  // Matmul descriptor (device pointer mode, FP32 compute) and the three layouts of one shape.
  struct Desc {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    Desc(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb, int ldc) {
      QUADS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
      QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm)));
      QUADS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, rows(ta, m, k), ta == CUBLAS_OP_N ? k : m, lda));
      QUADS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, rows(tb, k, n), tb == CUBLAS_OP_N ? n : k, ldb));
      QUADS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, m, n, ldc));
    }
    ~Desc() {
      cublasLtMatrixLayoutDestroy(c);
      cublasLtMatrixLayoutDestroy(b);
      cublasLtMatrixLayoutDestroy(a);
      cublasLtMatmulDescDestroy(op);
    }
  };
  // Rows of a stored operand whose op() is r x c.
  static int rows(cublasOperation_t t, int r, int c) { return t == CUBLAS_OP_N ? r : c; }
  static int bucket(int d) {
    int b = 16;
    while (b < d) b *= 2;
    return b;
  }
  static int alignment(const void* p) {
    const auto v = reinterpret_cast<uintptr_t>(p);
    int a = 256;
    while (a > 2 && v % a) a /= 2;
    return a;
  }
  bool heuristic(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb, int ldc, int align,
                 size_t ws_bytes, cublasLtMatmulAlgo_t* algo) {
    Desc d(ta, tb, m, n, k, lda, ldb, ldc);
    cublasLtMatmulPreference_t pref = nullptr;
    QUADS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = ws_bytes;
    const uint32_t al = static_cast<uint32_t>(align);
    QUADS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      QUADS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, d.op, d.a, d.b, d.c, d.c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) return false;
    *algo = res.algo;
    return true;
  }

  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, Entry> algos_;
  int64_t misses_ = 0;
};

struct GpuTrainer::Impl {
  model::ModelConfig cfg;
  model::PrecisionConfig prec;
  // Router losses (model::ForwardOptions' aux_loss_coef / z_loss_coef), their statistics on the host
  // per MoE layer (the forward synchronizes there anyway) in model::Model::forward's order and
  // float64: F_e (selections), P_e (sum of probabilities, token order), z[t] (logsumexp of a
  // token's router logits). aux_loss / z_loss: the last forward's, unscaled.
  double aux_coef = 0, z_coef = 0, aux_loss = 0, z_loss = 0;
  std::vector<double> aux_F, aux_P;           // per expert; after the forward aux_F holds F_e / rows
  double zsum = 0;
  int nsparse = 0;
  std::vector<std::vector<double>> router_z;  // per layer (kept forwards): z[t] for the backward
  std::vector<float> router_host;             // a layer's [T, E] probabilities or logits
  std::vector<float> extra_host;
  std::vector<double> zg_host;
  DeviceArray<float> extra_d;
  DeviceArray<double> zg_d;
  model::Layout lay;
  std::vector<Lin> lin;
  using LayerIdx = model::LinearTable::Layer;  // indices into lin (q, k, v consecutive)
  std::vector<LayerIdx> layers;
  int lm_head = -1;
  bool any_exact = false, any_fast = false;
  int64_t bf16_fast_params = 0;  // weights of the linears whose fast-path operand is plain BF16

  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  DeviceArray<uint8_t> blas_ws;
  // The fast path's BF16 GEMMs: cuBLASLt with LtGemms' algorithm cache, or cublasGemmEx
  // (QUADS_GPU_TRAIN_LT=0: cuBLAS's own heuristics for every new shape).
  LtGemms lt;
  bool lt_on = true;
  DeviceArray<float> consts;  // [0, 1]: beta values (device pointer mode)
  DeviceArray<float> alphas;  // per linear: the fast path's alpha (1 but for NVFP4 weights)

  DeviceArray<float> master, grads, weff;  // weights layout
  DeviceArray<uint16_t> wb;                 // fast path BF16 weight operands, weights layout
  std::map<std::tuple<int64_t, int64_t, int>, DeviceQTensor> qtmp;  // NVFP4 quantization scratch per shape, lane
  // The NVFP4 linears whose operands one WeightOperandSet makes in two launches (built at the first
  // re-quantization; QUADS_GPU_TRAIN_WOP=0: a quantize() and an operand launch each, as before).
  WeightOperandSet wops;
  std::vector<uint8_t> in_wops;  // per linear
  bool wops_on = true, wops_built = false, wops_amax_in_adamw = true;
  // The set's tensors as ranges of the masters (in the set's order), for AdamW's amax (adamw_step).
  DeviceArray<int64_t> wops_begin, wops_end;
  DeviceArray<float> adam_m, adam_v;
  DeviceArray<uint8_t> decay_mask;
  DeviceArray<double> norm_scratch, norm_out;
  bool grads_zero = true;

  // The last forward.
  int64_t T = 0;
  bool kept = false;         // the last forward completed with keep
  bool keep_layers = false;  // the forward in progress keeps every layer (X(l) reads it)
  std::vector<int32_t> tokens;
  std::vector<LayerBuf> lb;
  std::vector<DeviceArray<float>> resid;  // residual stream entering layer l (and leaving the last)
  DeviceArray<int32_t> seq0, tok_d, emb_order, emb_starts, emb_ids, forced, targets_d;
  int64_t emb_nuniq = 0;
  DeviceArray<float> cosb, sinb, inv_f, xf, f_lm, logits;
  // ReQAT's KV transform (set_kv_transform): per layer, empty where the layer has none
  std::vector<DeviceArray<float>> kv_f, kv_m;
  bool kv_quant = false;
  num::QConfig kv_qc;
  // capture_attention: the forward copies each layer's attention inputs here and runs no KV transform
  train::AttentionInputs* capture = nullptr;
  // attention_mse's buffers
  DeviceArray<float> c_q, c_k, c_v, c_wq, c_wk, c_wv, c_ref, c_out, c_lse, c_pq, c_pk, c_pv, c_po, c_tf;
  DeviceArray<double> c_sums;
  DeviceArray<uint16_t> b_lm;
  Opnd op_lm;
  // Scratch of one layer at a time.
  DeviceArray<float> qkv, tmp, h_tmp, dlogits, dx, dtmp, dxn, dattn, dq, dk, dv, dq_raw, dk_raw, dqkv, dye, dw, dxe,
      dh, dgu, dlog, rms_scratch, logp, dlogp, dattn_p, dq_p, dk_p, dv_p;
  DeviceArray<uint16_t> dyb;
  DeviceArray<int32_t> counts, eoff_d, bad_d;

  // Attention: the tensor-core kernels (attention_tc.h) or the exact FP32 ones (train_kernels.h).
  // attn_tc_fwd: what the last forward ran (its backward runs the same).
  bool attn_tc = false, attn_tc_fwd = false;
  std::unique_ptr<AttentionTc> atc;

  // The fast path's expert GEMMs: while `collecting` they are kept in `batch`, then flush_experts
  // runs them grouped (one cuBLAS call per phase) or spread over kLanes streams.
  ExpertGemms expert_mode = ExpertGemms::Streams;
  bool grouped_ok = true;    // cuBLAS has not refused the grouped GEMM
  bool grouped_ran = false;  // ... and ran it at least once
  bool collecting = false;
  int cur_lane = 0;
  std::vector<GemmOp> batch;
  std::vector<float> halpha;      // host copy of alphas (grouped GEMMs take host scalars)
  DeviceArray<const void*> gptrs;  // the grouped GEMM's A, B, C pointer arrays
  cudaStream_t lane_stream[kLanes] = {};
  cublasHandle_t lane_blas[kLanes] = {};
  DeviceArray<uint8_t> lane_ws[kLanes];
  cudaEvent_t fork_ev = nullptr, join_ev[kLanes] = {};

  // Profiling: an event closes each segment of stream work and names its category.
  enum Cat { kGemm, kAttn, kRoute, kLoss, kOpt, kRequant, kOther, kNcat };
  bool prof = false;
  std::vector<cudaEvent_t> ev;
  std::vector<int> ev_cat;  // category of the segment ending at event i; -1 starts a phase
  double prof_ms[kNcat] = {};
  void tick(int cat) {
    if (!prof) return;
    if (ev_cat.size() == ev.size()) {
      cudaEvent_t e;
      QUADS_CUDA_CHECK(cudaEventCreate(&e));
      ev.push_back(e);
    }
    QUADS_CUDA_CHECK(cudaEventRecord(ev[ev_cat.size()], stream));
    ev_cat.push_back(cat);
  }
  void collect() {
    if (!prof || ev_cat.empty()) return;
    QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t i = 1; i < ev_cat.size(); ++i) {
      if (ev_cat[i] < 0) continue;
      float ms = 0;
      QUADS_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i - 1], ev[i]));
      prof_ms[ev_cat[i]] += ms;
    }
    ev_cat.clear();
  }

  Impl(const model::ModelConfig& c, const model::PrecisionConfig& p) : cfg(c), prec(p) {
    cfg.validate("GpuTrainer config");
    QUADS_CHECK(device_count() > 0, "GpuTrainer: no CUDA device");
    lay = model::Layout::build(cfg);
    QUADS_CUDA_CHECK(cudaStreamCreate(&stream));
    keep_pool_memory();
    QUADS_CUBLAS_CHECK(cublasCreate(&blas));
    QUADS_CUBLAS_CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));  // no TF32: FP32 GEMMs stay FP32
    QUADS_CUBLAS_CHECK(cublasSetStream(blas, stream));
    blas_ws.resize(size_t(64) << 20);
    QUADS_CUBLAS_CHECK(cublasSetWorkspace(blas, blas_ws.data(), blas_ws.bytes()));
    QUADS_CUBLAS_CHECK(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_DEVICE));
    consts.upload(std::vector<float>{0.f, 1.f});
    build_linears();
    alphas.upload(std::vector<float>(lin.size(), 1.f));
    halpha.assign(lin.size(), 1.f);
    // BF16 trainers run BF16 flash attention; everything else keeps the CPU-equal FP32 kernels.
    attn_tc = !any_exact;
    if (const char* e = std::getenv("QUADS_GPU_TRAIN_ATTN"); e && *e) set_attention(e);
    if (const char* e = std::getenv("QUADS_GPU_TRAIN_LT"); e && *e) lt_on = std::string(e) != "0";
    if (const char* e = std::getenv("QUADS_GPU_TRAIN_GRAPHS"); e && *e) requant_graphs = std::string(e) != "0";
    if (const char* e = std::getenv("QUADS_GPU_TRAIN_WOP"); e && *e) wops_on = std::string(e) != "0";
    if (const char* e = std::getenv("QUADS_GPU_TRAIN_WOP_AMAX"); e && *e) wops_amax_in_adamw = std::string(e) != "0";
    if (const char* e = std::getenv("QUADS_GPU_TRAIN_GROUPED"); e && *e) {
      const std::string v = e;
      set_expert_gemms(v == "0" ? "per-expert" : v == "1" ? "grouped" : v);
    }
    master.resize(lay.total);
    grads.resize(lay.total);
    grads.fill_bytes(0);
    if (any_exact) weff.resize(lay.total);
    if (any_fast) wb.resize(lay.total);
    const int E = std::max(cfg.num_experts, 1);
    counts.resize(E);
    eoff_d.resize(E + 1);
    bad_d.resize(1);
    bad_d.fill_bytes(0);
  }
  ~Impl() {
    for (cudaGraphExec_t e : requant_exec)
      if (e) cudaGraphExecDestroy(e);
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    for (int i = 1; i < kLanes; ++i) {
      if (lane_blas[i]) cublasDestroy(lane_blas[i]);
      if (lane_stream[i]) cudaStreamDestroy(lane_stream[i]);
      if (join_ev[i]) cudaEventDestroy(join_ev[i]);
    }
    if (fork_ev) cudaEventDestroy(fork_ev);
    if (blas) cublasDestroy(blas);
    if (stream) cudaStreamDestroy(stream);
  }

  int add(const std::string& name, int layer, int64_t out, int64_t in, size_t off) {
    Lin L;
    L.name = name;
    L.layer = layer;
    L.out = out;
    L.in = in;
    L.offset = off;
    L.num = prec.for_linear(name, layer, cfg.num_hidden_layers);
    if (L.num.weight.kind == QuantKind::Quant) {
      num::check_config(L.num.weight.cfg, out, in, name + ".weight");
      QUADS_CHECK(!L.num.weight.cfg.stochastic, "GpuTrainer: {} rounds its weight stochastically (not supported)", name);
    }
    if (L.num.act.kind == QuantKind::Quant) {
      num::check_config(L.num.act.cfg, 1, in, name + " input");
      QUADS_CHECK(!L.num.act.cfg.stochastic, "GpuTrainer: {} rounds its input stochastically (not supported)", name);
      QUADS_CHECK(L.num.act.cfg.scheme != num::Scheme::NVFP4 || L.num.act.cfg.global != num::Global::Static ||
                      L.num.act.cfg.static_amax > 0,
                  "GpuTrainer: {} uses a static activation scale but its QConfig has no static_amax", name);
    }
    L.path = choose_path(L.num);
    any_exact |= L.path == Path::Exact;
    any_fast |= L.path == Path::Fast;
    if (L.path == Path::Fast && L.num.weight.kind == QuantKind::BF16) bf16_fast_params += out * in;
    lin.push_back(std::move(L));
    return static_cast<int>(lin.size()) - 1;
  }

  // Linears that read one operand must round it the same way (the CPU would quantize it twice).
  void check_same_operand(int a, int b) const {
    const Lin &A = lin[a], &B = lin[b];
    QUADS_CHECK(A.path == B.path && A.num.act == B.num.act,
                "GpuTrainer: {} ({}) and {} ({}) read the same input with different numerics (not supported on the "
                "GPU)",
                A.name, A.num.describe(), B.name, B.num.describe());
  }

  // The same linears, names and order as model::Model (model::linear_table).
  void build_linears() {
    const model::LinearTable t = model::linear_table(cfg, lay);
    for (const model::LinearSpec& sp : t.specs) add(sp.name, sp.layer, sp.out, sp.in, sp.offset);
    layers = t.layers;
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const LayerIdx& x = layers[l];
      check_same_operand(x.q, x.q + 1);
      check_same_operand(x.q, x.q + 2);
      if (x.sparse) {
        // One operand for every expert's rows: the experts of a layer must share their numerics.
        for (int e = 0; e < cfg.num_experts; ++e)
          for (int j = 0; j < 3; ++j) {
            const Lin &a = lin[x.mlp + 3 * e + j], &b = lin[x.mlp + j];
            QUADS_CHECK(a.num == b.num && a.path == b.path,
                        "GpuTrainer: experts of layer {} differ in numerics ({}: {}, {}: {}; not supported on the GPU)",
                        l, a.name, a.num.describe(), b.name, b.num.describe());
          }
      }
      check_same_operand(x.mlp, x.mlp + 1);
    }
    lm_head = t.lm_head;
  }

  // ---- weights

  // Every linear's effective weight from the masters (model::Model::sync).
  // bf16_done: the fast path's BF16 operands are already written (kern::adamw's bf16_out);
  // amax_ready: the WeightOperandSet's amax too (kern::adamw's AdamWAmax).
  // The launches (BF16 conversions of runs of linears, the WeightOperandSet's two kernels, and a
  // quantization and an operand conversion for each NVFP4 linear outside the set: with a launch
  // chain for every linear, ~4700 small kernels a QAT step on the peer model, 33 ms eagerly) are a
  // CUDA graph after the first call; every pointer they use is fixed for the trainer's life.
  // QUADS_GPU_TRAIN_GRAPHS=0 keeps them eager.
  void requantize(bool bf16_done = false, bool amax_ready = false) {
    cudaGraphExec_t& ex = requant_exec[(bf16_done ? 1 : 0) + (amax_ready ? 2 : 0)];
    // The first call runs eagerly: it allocates the quantization scratch (no cudaMalloc while
    // a stream is being captured).
    if (requant_graphs && !ex && requant_calls++ > 0) {
      cudaGraph_t graph = nullptr;
      QUADS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      bool ok = true;
      try {
        requantize_launches(bf16_done, amax_ready);
      } catch (const Error&) {
        ok = false;
      }
      const cudaError_t end = cudaStreamEndCapture(stream, &graph);
      ok = ok && end == cudaSuccess && graph && cudaGraphInstantiate(&ex, graph, 0) == cudaSuccess;
      if (graph) cudaGraphDestroy(graph);
      if (!ok) {  // stay eager from now on
        (void)cudaGetLastError();
        if (ex) cudaGraphExecDestroy(ex);
        ex = nullptr;
        requant_graphs = false;
      }
    }
    if (ex)
      QUADS_CUDA_CHECK(cudaGraphLaunch(ex, stream));
    else
      requantize_launches(bf16_done, amax_ready);
    // The grouped expert GEMMs take their alphas from the host.
    if (any_fast && expert_mode == ExpertGemms::Grouped) {
      QUADS_CUDA_CHECK(cudaMemcpyAsync(halpha.data(), alphas.data(), sizeof(float) * lin.size(), cudaMemcpyDeviceToHost,
                                       stream));
      QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
  bool requant_graphs = true;
  int64_t requant_calls = 0;
  cudaGraphExec_t requant_exec[4] = {};

  void build_wops() {
    wops_built = true;
    in_wops.assign(lin.size(), 0);
    if (!wops_on) return;
    std::vector<size_t> order;  // the linears in the set, by their place in the masters
    for (size_t i = 0; i < lin.size(); ++i) {
      const Lin& L = lin[i];
      // 16-byte aligned source (4 floats) and operand (8 BF16)
      if (L.nvfp4() && weight_operands_supported(L.num.weight.cfg) && L.in % 16 == 0 && L.offset % 8 == 0)
        order.push_back(i);
    }
    if (order.empty()) return;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lin[a].offset < lin[b].offset; });
    std::vector<WeightOperand> list;
    std::vector<int64_t> begin, end;
    for (size_t i : order) {
      const Lin& L = lin[i];
      in_wops[i] = 1;
      list.push_back({master.data() + L.offset, L.out, L.in, wb.data() + L.offset, alphas.data() + i});
      begin.push_back(static_cast<int64_t>(L.offset));
      end.push_back(static_cast<int64_t>(L.offset) + L.out * L.in);
    }
    wops = WeightOperandSet(list, lin[order[0]].num.weight.cfg);
    wops_begin.upload(begin);
    wops_end.upload(end);
  }

  void requantize_launches(bool bf16_done, bool amax_ready = false) {
    if (!wops_built) build_wops();  // the first call is eager (requantize): no allocation is captured
    int64_t nvfp4_count = 0;
    // BF16 operands of adjacent linears (a layer's experts lie one after another) convert in one
    // launch: one per linear was ~1600 small kernels per step on the peer model (15 ms).
    size_t run_off = 0;
    int64_t run_n = 0;
    auto flush_bf16 = [&]() {
      if (run_n) kern::to_bf16(master.data() + run_off, wb.data() + run_off, run_n, stream);
      run_n = 0;
    };
    for (size_t i = 0; i < lin.size(); ++i) {
      const Lin& L = lin[i];
      const float* src = master.data() + L.offset;
      const int64_t n = L.out * L.in;
      if (L.path != Path::Exact && L.num.weight.kind == QuantKind::BF16) {
        if (bf16_done) continue;
        if (run_n > 0 && run_off + size_t(run_n) == L.offset) {
          run_n += n;
        } else {
          flush_bf16();
          run_off = L.offset;
          run_n = n;
        }
        continue;
      }
      flush_bf16();
      if (in_wops[i]) continue;  // wops.run() below
      if (L.path == Path::Exact) {
        float* dst = weff.data() + L.offset;
        switch (L.num.weight.kind) {
          case QuantKind::None:
            QUADS_CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToDevice, stream));
            break;
          case QuantKind::BF16: kern::bf16_round(src, dst, n, stream); break;
          case QuantKind::Quant: fake_quantize(src, dst, L.out, L.in, L.num.weight.cfg, stream); break;
        }
      } else {
        // NVFP4 operands: a chain of small kernels each (amax, quantize, BF16 operand), round-robin
        // over the lanes so that several chains fill the GPU; a scratch per shape and lane.
        if (nvfp4_count++ == 0) fork_lanes();
        const int lane = static_cast<int>(nvfp4_count % kLanes);
        auto key = std::make_tuple(L.out, L.in, lane);
        auto it = qtmp.find(key);
        if (it == qtmp.end()) it = qtmp.emplace(key, make_qtensor(L.out, L.in, L.num.weight.cfg)).first;
        DeviceQTensor& q = it->second;
        cudaStream_t ls = lane_stream[lane];
        quantize(src, q, ls);
        kern::nvfp4_weight_bf16(q.codes.data(), q.scales.data(), q.amax.data(), L.out, L.in, wb.data() + L.offset,
                                alphas.data() + i, ls);
      }
    }
    flush_bf16();
    wops.run(stream, amax_ready);
    if (nvfp4_count > 0) join_lanes();
  }

  void check_layout(const model::Weights& w, const char* what) const {
    QUADS_CHECK(w.data.size() == lay.total, "GpuTrainer::{}: the weights hold {} floats, the model's layout {}", what,
                w.data.size(), lay.total);
    QUADS_CHECK(w.layout.params.size() == lay.params.size(), "GpuTrainer::{}: {} tensors given, the model has {}", what,
                w.layout.params.size(), lay.params.size());
    for (size_t i = 0; i < lay.params.size(); ++i)
      QUADS_CHECK(w.layout.params[i].name == lay.params[i].name && w.layout.params[i].shape == lay.params[i].shape,
                  "GpuTrainer::{}: tensor {} does not match the model's {}", what, w.layout.params[i].name,
                  lay.params[i].name);
  }

  // ---- GEMMs (cuBLAS is column-major: a row-major [r, c] matrix is its c x r transpose)

  const float* zero() const { return consts.data(); }
  const float* one() const { return consts.data() + 1; }

  void set_attention(const std::string& v) {
    if (v == "exact") attn_tc = false;
    else if (v == "tc") attn_tc = true;
    else fail("GpuTrainer: attention '{}' (QUADS_GPU_TRAIN_ATTN): expected exact or tc", v);
  }
  void set_expert_gemms(const std::string& v) {
    if (v == "per-expert") expert_mode = ExpertGemms::PerExpert;
    else if (v == "grouped") {
      expert_mode = ExpertGemms::Grouped;
      if (any_fast && alphas.size() == lin.size()) {  // requantize() keeps halpha from now on
        QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
        QUADS_CUDA_CHECK(cudaMemcpy(halpha.data(), alphas.data(), sizeof(float) * lin.size(), cudaMemcpyDeviceToHost));
      }
    }
    else if (v == "streams") expert_mode = ExpertGemms::Streams;
    else fail("GpuTrainer: expert GEMMs '{}' (QUADS_GPU_TRAIN_GROUPED): expected per-expert (0), grouped (1) or streams", v);
  }
  std::string expert_gemms() const {
    const std::string how = lt_on ? fmt::format(" cuBLASLt, {} algorithm buckets, {} misses", lt.buckets(), lt.misses())
                                  : std::string(" cublasGemmEx");
    switch (expert_mode) {
      case ExpertGemms::PerExpert: return "per-expert" + how;
      case ExpertGemms::Streams: return "streams" + how;
      case ExpertGemms::Grouped: break;
    }
    return grouped_ok ? "grouped" : "per-expert (cuBLAS refused grouped)" + how;
  }

  // ---- the fast path's GEMMs: at once, or kept for an expert batch

  // lane: the stream (and workspace) of run_streams' lane; 0 is the main stream.
  void exec_gemm(int lane, const GemmOp& g) {
    const float* alpha = g.alpha_li >= 0 ? alphas.data() + g.alpha_li : one();
    const float* beta = g.beta1 ? one() : zero();
    if (!lt_on) {
      QUADS_CUBLAS_CHECK(cublasGemmEx(lane ? lane_blas[lane] : blas, g.ta, g.tb, g.m, g.n, g.k, alpha, g.A,
                                      CUDA_R_16BF, g.lda, g.B, CUDA_R_16BF, g.ldb, beta, g.C, CUDA_R_32F, g.ldc,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      return;
    }
    DeviceArray<uint8_t>& ws = lane ? lane_ws[lane] : blas_ws;
    lt.run(g.ta, g.tb, g.m, g.n, g.k, alpha, g.A, g.lda, g.B, g.ldb, beta, g.C, g.ldc, ws.data(), ws.bytes(),
           lane ? lane_stream[lane] : stream);
  }
  void fast_gemm(GemmOp g) {
    if (!collecting) return exec_gemm(0, g);
    g.lane = cur_lane;
    batch.push_back(g);
  }

  // Collect the fast path's GEMMs of one expert loop (linear L0 stands for the layer's experts).
  void begin_experts(const Lin& L0) {
    collecting = L0.path == Path::Fast && expert_mode != ExpertGemms::PerExpert;
    batch.clear();
  }

  int max_phase() const {
    int p = 0;
    for (const GemmOp& g : batch) p = std::max(p, g.phase);
    return p;
  }

  // cublasGemmGroupedBatchedEx, one group per GEMM; false when cuBLAS refuses it the first time
  // (nothing ran then).
  bool run_grouped() {
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
    for (int phase = 0; phase <= max_phase(); ++phase) {
      std::vector<cublasOperation_t> ta, tb;
      std::vector<int> m, n, k, lda, ldb, ldc;
      std::vector<float> al, be;
      std::vector<const void*> ptr;
      for (const GemmOp& g : batch) {
        if (g.phase != phase) continue;
        ta.push_back(g.ta);
        tb.push_back(g.tb);
        m.push_back(g.m);
        n.push_back(g.n);
        k.push_back(g.k);
        lda.push_back(g.lda);
        ldb.push_back(g.ldb);
        ldc.push_back(g.ldc);
        al.push_back(g.alpha_li >= 0 ? halpha[g.alpha_li] : 1.f);
        be.push_back(g.beta1 ? 1.f : 0.f);
      }
      const int cnt = static_cast<int>(ta.size());
      if (cnt == 0) continue;
      ptr.resize(3 * size_t(cnt));
      int i = 0;
      for (const GemmOp& g : batch) {
        if (g.phase != phase) continue;
        ptr[i] = g.A;
        ptr[cnt + i] = g.B;
        ptr[2 * cnt + i] = g.C;
        ++i;
      }
      // Pageable source: the copy has taken it when the call returns; the device array is
      // overwritten only by later work on the same stream.
      need(gptrs, ptr.size());
      QUADS_CUDA_CHECK(cudaMemcpyAsync(gptrs.data(), ptr.data(), sizeof(void*) * ptr.size(), cudaMemcpyHostToDevice,
                                       stream));
      const std::vector<int> ones(cnt, 1);
      const void* const* P = gptrs.data();
      QUADS_CUBLAS_CHECK(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_HOST));
      const cublasStatus_t st = cublasGemmGroupedBatchedEx(
          blas, ta.data(), tb.data(), m.data(), n.data(), k.data(), al.data(), P, CUDA_R_16BF, lda.data(), P + cnt,
          CUDA_R_16BF, ldb.data(), be.data(), const_cast<void* const*>(P + 2 * cnt), CUDA_R_32F, ldc.data(), cnt,
          ones.data(), CUBLAS_COMPUTE_32F);
      QUADS_CUBLAS_CHECK(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_DEVICE));
      if (st != CUBLAS_STATUS_SUCCESS) {
        QUADS_CHECK(!grouped_ran, "GpuTrainer: cublasGemmGroupedBatchedEx failed with status {} ({} GEMMs)",
                    static_cast<int>(st), cnt);
        std::fprintf(stderr,
                     "GpuTrainer: cublasGemmGroupedBatchedEx (BF16 inputs, FP32 output) refused with status %d; the "
                     "expert GEMMs run per expert\n",
                     static_cast<int>(st));
        return false;
      }
      grouped_ran = true;
    }
    return true;
#else
    return false;
#endif
  }

  // Each expert's GEMMs in order on stream lane % kLanes (the main stream is lane 0): the same
  // cuBLAS problems as the per-expert path on handles configured alike.
  // The streams (and their cuBLAS handles) of lanes 1 .. kLanes-1.
  void ensure_lanes() {
    if (!fork_ev) {
      QUADS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming));
      lane_stream[0] = stream;
      lane_blas[0] = blas;
      for (int i = 1; i < kLanes; ++i) {
        QUADS_CUDA_CHECK(cudaStreamCreateWithFlags(&lane_stream[i], cudaStreamNonBlocking));
        QUADS_CUDA_CHECK(cudaEventCreateWithFlags(&join_ev[i], cudaEventDisableTiming));
        QUADS_CUBLAS_CHECK(cublasCreate(&lane_blas[i]));
        QUADS_CUBLAS_CHECK(cublasSetMathMode(lane_blas[i], CUBLAS_DEFAULT_MATH));
        QUADS_CUBLAS_CHECK(cublasSetStream(lane_blas[i], lane_stream[i]));
        lane_ws[i].resize(blas_ws.size());
        QUADS_CUBLAS_CHECK(cublasSetWorkspace(lane_blas[i], lane_ws[i].data(), lane_ws[i].bytes()));
        QUADS_CUBLAS_CHECK(cublasSetPointerMode(lane_blas[i], CUBLAS_POINTER_MODE_DEVICE));
      }
    }
  }
  // Lanes 1.. start after the work queued on the main stream so far; join_lanes makes the main
  // stream wait for them.
  void fork_lanes() {
    ensure_lanes();
    QUADS_CUDA_CHECK(cudaEventRecord(fork_ev, stream));
    for (int i = 1; i < kLanes; ++i) QUADS_CUDA_CHECK(cudaStreamWaitEvent(lane_stream[i], fork_ev, 0));
  }
  void join_lanes() {
    for (int i = 1; i < kLanes; ++i) {
      QUADS_CUDA_CHECK(cudaEventRecord(join_ev[i], lane_stream[i]));
      QUADS_CUDA_CHECK(cudaStreamWaitEvent(stream, join_ev[i], 0));
    }
  }

  void run_streams() {
    fork_lanes();
    for (int phase = 0; phase <= max_phase(); ++phase)
      for (const GemmOp& g : batch)
        if (g.phase == phase) exec_gemm(g.lane % kLanes, g);
    join_lanes();
  }

  void flush_experts() {
    if (!collecting) return;
    collecting = false;
    if (batch.empty()) return;
    tick(kOther);
    bool done = false;
    if (expert_mode == ExpertGemms::Grouped && grouped_ok) {
      done = run_grouped();
      grouped_ok = done;
    }
    if (!done && expert_mode == ExpertGemms::Streams) {
      run_streams();
      done = true;
    }
    if (!done)  // grouped refused: the per-expert path's GEMMs in its order
      for (const GemmOp& g : batch) exec_gemm(0, g);
    tick(kGemm);
    batch.clear();
  }

  // Consecutive linears i0 .. i0+n-1 whose weights follow each other in the layout and whose
  // outputs sit side by side can run as one GEMM (the NVFP4 ones have their own alphas).
  bool fusable(int i0, int n) const {
    for (int j = 1; j < n; ++j) {
      const Lin &a = lin[i0 + j - 1], &b = lin[i0 + j];
      if (b.offset != a.offset + size_t(a.out * a.in) || b.in != a.in || b.path != a.path || b.nvfp4() || a.nvfp4())
        return false;
    }
    return true;
  }

  // One GEMM Y[M, N] (row stride ldy) = op(X)[M, K] · W[N, K]ᵀ for linear L's weight at `off`.
  void gemm_nt(const Lin& L, size_t off, int64_t N, const Opnd& x, int64_t M, float* Y, int64_t ldy, int li) {
    const int K = static_cast<int>(L.in);
    if (L.path == Path::Fast) {
      GemmOp g;
      g.ta = CUBLAS_OP_T;
      g.tb = CUBLAS_OP_N;
      g.m = static_cast<int>(N);
      g.n = static_cast<int>(M);
      g.k = K;
      g.alpha_li = li;
      g.A = wb.data() + off;
      g.lda = K;
      g.B = x.b;
      g.ldb = K;
      g.C = Y;
      g.ldc = static_cast<int>(ldy);
      fast_gemm(g);
    } else {
      QUADS_CUBLAS_CHECK(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M), K,
                                     one(), weff.data() + off, K, x.f, K, zero(), Y, static_cast<int>(ldy)));
    }
  }

  // Y[:, outputs of linears i0 .. i0+n-1] = op(X) · W_effᵀ (model::ModelImpl::gemm).
  void linear_fwd(int i0, int n, const Opnd& x, int64_t M, float* Y, int64_t ldy) {
    if (M == 0) return;
    tick(kOther);
    if (fusable(i0, n)) {
      int64_t N = 0;
      for (int j = 0; j < n; ++j) N += lin[i0 + j].out;
      gemm_nt(lin[i0], lin[i0].offset, N, x, M, Y, ldy, i0);
      tick(kGemm);
      return;
    }
    int64_t c0 = 0;
    for (int j = 0; j < n; ++j) {
      const Lin& L = lin[i0 + j];
      gemm_nt(L, L.offset, L.out, x, M, Y + c0, ldy, i0 + j);
      c0 += L.out;
    }
    tick(kGemm);
  }

  // Backward of linear_fwd: dX (+)= dY · W_eff (straight through the activation quantizer) and
  // dW += dYᵀ · X_eff for each linear (model::ModelImpl::linear_backward). dY [M, lddy] in float32
  // (exact path) or its BF16 copy dYb (fast path). dX may be null.
  void linear_bwd(int i0, int n, const float* dY, const uint16_t* dYb, int64_t lddy, const Opnd& x, int64_t M, float* dX,
                  bool accumulate) {
    if (M == 0) return;
    const Lin& L0 = lin[i0];
    const int K = static_cast<int>(L0.in), Mi = static_cast<int>(M), ld = static_cast<int>(lddy);
    const bool fast = L0.path == Path::Fast;
    tick(kOther);
    auto dx_gemm = [&](size_t off, int64_t N, int64_t c0, int li, bool acc, int phase) {
      const float* beta = acc ? one() : zero();
      if (fast) {
        GemmOp g;
        g.m = K;
        g.n = Mi;
        g.k = static_cast<int>(N);
        g.alpha_li = li;
        g.beta1 = acc;
        g.A = wb.data() + off;
        g.lda = K;
        g.B = dYb + c0;
        g.ldb = ld;
        g.C = dX;
        g.ldc = K;
        g.phase = phase;
        fast_gemm(g);
      } else
        QUADS_CUBLAS_CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, K, Mi, static_cast<int>(N), one(),
                                       weff.data() + off, K, dY + c0, ld, beta, dX, K));
    };
    auto dw_gemm = [&](size_t off, int64_t N, int64_t c0) {
      if (fast) {
        GemmOp g;
        g.tb = CUBLAS_OP_T;
        g.m = K;
        g.n = static_cast<int>(N);
        g.k = Mi;
        g.beta1 = true;
        g.A = x.b;
        g.lda = K;
        g.B = dYb + c0;
        g.ldb = ld;
        g.C = grads.data() + off;
        g.ldc = K;
        fast_gemm(g);
      } else
        QUADS_CUBLAS_CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, K, static_cast<int>(N), Mi, one(), x.f, K,
                                       dY + c0, ld, one(), grads.data() + off, K));
    };
    if (fusable(i0, n)) {
      int64_t N = 0;
      for (int j = 0; j < n; ++j) N += lin[i0 + j].out;
      if (dX) dx_gemm(L0.offset, N, 0, i0, accumulate, 0);
      dw_gemm(L0.offset, N, 0);
    } else {
      int64_t c0 = 0;
      for (int j = 0; j < n; ++j) {
        const Lin& L = lin[i0 + j];
        if (dX) dx_gemm(L.offset, L.out, c0, i0 + j, accumulate || j > 0, j);
        dw_gemm(L.offset, L.out, c0);
        c0 += L.out;
      }
    }
    tick(kGemm);
    grads_zero = false;
  }

  // The operand of linear L for X [M, in] (model::quantize_act); `f` / `b` hold it unless it is X.
  // `groups` (host row offsets) quantize each group on its own where the rounding is not row-local
  // (as the CPU quantizes each expert's rows).
  Opnd make_op(const Lin& L, const float* X, int64_t M, DeviceArray<float>& f, DeviceArray<uint16_t>& b,
               const std::vector<int64_t>* groups = nullptr) {
    Opnd op;
    const int64_t n = M * L.in;
    if (L.path == Path::Fast) {
      op.b = need(b, size_t(std::max<int64_t>(n, 1)));
      kern::to_bf16(X, b.data(), n, stream);
      return op;
    }
    switch (L.num.act.kind) {
      case QuantKind::None: op.f = X; break;
      case QuantKind::BF16:
        op.f = need(f, size_t(std::max<int64_t>(n, 1)));
        kern::bf16_round(X, f.data(), n, stream);
        break;
      case QuantKind::Quant:
        op.f = need(f, size_t(std::max<int64_t>(n, 1)));
        if (groups && !L.num.act.row_local()) {
          for (size_t g = 0; g + 1 < groups->size(); ++g) {
            const int64_t r0 = (*groups)[g], r1 = (*groups)[g + 1];
            if (r1 > r0) fake_quantize(X + r0 * L.in, f.data() + r0 * L.in, r1 - r0, L.in, L.num.act.cfg, stream);
          }
        } else if (M > 0) {
          fake_quantize(X, f.data(), M, L.in, L.num.act.cfg, stream);
        }
        break;
    }
    return op;
  }

  // dY rounded to BF16 for the fast path's backward GEMMs (n floats).
  const uint16_t* dy_bf16(const Lin& L, const float* dY, int64_t n) {
    if (L.path != Path::Fast) return nullptr;
    need(dyb, size_t(std::max<int64_t>(n, 1)));
    kern::to_bf16(dY, dyb.data(), n, stream);
    return dyb.data();
  }

  // ---- forward

  // seq0 and RoPE's tables for T packed tokens with these sequence offsets (positions restart in
  // every sequence; seq0[t] = the first token of t's sequence). Synchronous copies: the stream is
  // idle between calls (every call ends with a sync).
  void set_positions(const std::vector<int64_t>& offsets) {
    const int hd = cfg.head_dim;
    std::vector<int64_t> pos(T);
    std::vector<int32_t> hseq0(T);
    for (size_t s = 0; s + 1 < offsets.size(); ++s)
      for (int64_t t = offsets[s]; t < offsets[s + 1]; ++t) {
        pos[t] = t - offsets[s];
        hseq0[t] = static_cast<int32_t>(offsets[s]);
      }
    std::vector<float> hcos(T * hd / 2), hsin(T * hd / 2);
    cpu::rope_tables(pos.data(), T, hd, cfg.rope_theta, hcos.data(), hsin.data());
    QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
    seq0.upload(hseq0);
    cosb.upload(hcos);
    sinb.upload(hsin);
  }

  void download_async(const float* src, int64_t n, std::vector<float>* dst) {
    dst->resize(size_t(n));
    QUADS_CUDA_CHECK(cudaMemcpyAsync(dst->data(), src, size_t(n) * sizeof(float), cudaMemcpyDeviceToHost, stream));
  }

  // The exact FP32 causal attention of T packed tokens (seq0, set_positions), zero-padded where
  // head_dim is not a kernel's (attn_hd); out [T, nh, hd].
  void attend_exact(const float* q, const float* k, const float* v, float* out) {
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim, hdp = attn_hd();
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    float* lse = need(c_lse, size_t(T * nh));
    if (hdp == hd) return kern::attention_train_fwd(q, k, v, seq0.data(), T, nh, nkv, hd, scale, out, lse, stream);
    kern::copy_cols(q, T * nh, hd, need(c_pq, size_t(T * nh * hdp)), hdp, stream);
    kern::copy_cols(k, T * nkv, hd, need(c_pk, size_t(T * nkv * hdp)), hdp, stream);
    kern::copy_cols(v, T * nkv, hd, need(c_pv, size_t(T * nkv * hdp)), hdp, stream);
    kern::attention_train_fwd(c_pq.data(), c_pk.data(), c_pv.data(), seq0.data(), T, nh, nkv, hdp, scale,
                              need(c_po, size_t(T * nh * hdp)), lse, stream);
    kern::copy_cols(c_po.data(), T * nh, hdp, out, hd, stream);
  }

  // reqat::attention_mse_cpu's arithmetic, with the trainer's kernels (the transform's order of
  // forward(): factor, RoPE, shift, K and V fake-quantized); each candidate's error is summed per
  // (token, head) row in double on the device and over the rows on the host.
  std::vector<double> attention_mse(const train::AttentionInputs& in, int l, const std::vector<train::KvCandidate>& cands,
                                    const num::QConfig* kvq) {
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim;
    const int64_t qd = cfg.q_dim(), kvd = cfg.kv_dim();
    train::check_attention_inputs(cfg, in, l, cands, "GpuTrainer::attention_mse");
    kept = false;  // the buffers below are not the kept forward's, but T and the positions change
    T = in.T;
    if (T == 0 || cands.empty()) return std::vector<double>(cands.size(), 0.0);
    set_positions(in.offsets);
    // Every candidate's factor and shift in one upload: [cands][2][kvd].
    std::vector<float> tf(cands.size() * 2 * size_t(kvd), 0.f);
    for (size_t i = 0; i < cands.size(); ++i) {
      std::copy(cands[i].factor.begin(), cands[i].factor.end(), tf.begin() + (2 * i) * kvd);
      std::copy(cands[i].shift.begin(), cands[i].shift.end(), tf.begin() + (2 * i + 1) * kvd);
    }
    c_tf.upload(tf);
    c_q.upload(in.q[l]);
    c_k.upload(in.k[l]);
    c_v.upload(in.v[l]);
    const size_t nq = size_t(T * qd), nk = size_t(T * kvd);
    float *wq = need(c_wq, nq), *wk = need(c_wk, nk), *wv = need(c_wv, nk);
    auto d2d = [&](float* dst, const float* src, size_t n) {
      QUADS_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    };
    d2d(wq, c_q.data(), nq);
    d2d(wk, c_k.data(), nk);
    kern::rope_fwd(wq, T, nh, hd, cosb.data(), sinb.data(), stream);
    kern::rope_fwd(wk, T, nkv, hd, cosb.data(), sinb.data(), stream);
    attend_exact(wq, wk, c_v.data(), need(c_ref, nq));
    const int64_t rows = T * nh;
    const size_t chunk = 32;  // candidates a download
    double* sums = need(c_sums, chunk * 2 * size_t(rows));
    std::vector<double> hs(chunk * 2 * size_t(rows)), mse(cands.size());
    for (size_t c0 = 0; c0 < cands.size(); c0 += chunk) {
      const size_t c1 = std::min(cands.size(), c0 + chunk);
      for (size_t i = c0; i < c1; ++i) {
        d2d(wq, c_q.data(), nq);
        d2d(wk, c_k.data(), nk);
        d2d(wv, c_v.data(), nk);
        if (!cands[i].factor.empty()) kern::kv_factor(wq, wk, T, nh, nkv, hd, c_tf.data() + (2 * i) * kvd, stream);
        kern::rope_fwd(wq, T, nh, hd, cosb.data(), sinb.data(), stream);
        kern::rope_fwd(wk, T, nkv, hd, cosb.data(), sinb.data(), stream);
        if (!cands[i].shift.empty()) kern::sub_cols(wk, T, kvd, c_tf.data() + (2 * i + 1) * kvd, stream);
        if (kvq) {
          fake_quantize(wk, wk, T * nkv, hd, *kvq, stream);
          fake_quantize(wv, wv, T * nkv, hd, *kvq, stream);
        }
        float* out = need(c_out, nq);
        attend_exact(wq, wk, wv, out);
        kern::row_error_sums(out, c_ref.data(), rows, hd, sums + (i - c0) * 2 * rows, stream);
      }
      QUADS_CUDA_CHECK(cudaMemcpyAsync(hs.data(), sums, (c1 - c0) * 2 * rows * sizeof(double), cudaMemcpyDeviceToHost,
                                       stream));
      QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (size_t i = c0; i < c1; ++i) {
        double e = 0;
        for (int64_t r = 0; r < rows; ++r) e += hs[(i - c0) * 2 * rows + 2 * r];
        mse[i] = e / static_cast<double>(T * qd);
      }
    }
    return mse;
  }

  // The head_dim the attention kernels run at: theirs need a multiple of 32 (train_kernels.h), so
  // smaller or ragged heads (the test fixtures' 16) run zero-padded; zero channels add exact zeros
  // to every score and leave the real output and gradient channels unchanged.
  int attn_hd() const { return (cfg.head_dim + 31) / 32 * 32; }

  float* X(int l) { return resid[keep_layers ? l : (l & 1)].data(); }

  // The packed causal attention at head_dim hdr (the padded one where attn_hd() pads).
  void attention_fwd(const float* q, const float* k, const float* v, int hdr, float scale, float* out, float* lse) {
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads;
    if (attn_tc_fwd) atc->fwd(q, k, v, nh, nkv, hdr, scale, out, lse, stream);
    else kern::attention_train_fwd(q, k, v, seq0.data(), T, nh, nkv, hdr, scale, out, lse, stream);
  }
  void attention_bwd(const float* q, const float* k, const float* v, const float* out, const float* lse,
                     const float* dout, int hdr, float scale, float* dq, float* dk, float* dv) {
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads;
    if (attn_tc_fwd) atc->bwd(q, k, v, out, lse, dout, nh, nkv, hdr, scale, dq, dk, dv, stream);
    else kern::attention_train_bwd(q, k, v, out, lse, dout, seq0.data(), T, nh, nkv, hdr, scale, dq, dk, dv, stream);
  }

  void forward(const model::Batch& b, float* logits_host, bool keep, model::Routing* record,
               const model::Routing* replay) {
    const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim;
    const int64_t qd = cfg.q_dim(), kvd = cfg.kv_dim();
    const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    const int64_t Tn = b.ntokens();
    QUADS_CHECK(b.offsets.size() >= 1 && b.offsets.front() == 0 && b.offsets.back() == Tn,
                "GpuTrainer::forward: batch offsets do not cover its {} tokens", Tn);
    for (int s = 0; s < b.nseq(); ++s)
      QUADS_CHECK(b.offsets[s + 1] >= b.offsets[s], "GpuTrainer::forward: batch offsets are not increasing at sequence {}",
                  s);
    for (size_t i = 0; i < b.tokens.size(); ++i)
      QUADS_CHECK(b.tokens[i] >= 0 && b.tokens[i] < V,
                  "GpuTrainer::forward: token id {} at index {} is outside the vocabulary (0..{})", b.tokens[i], i, V - 1);
    if (replay) {
      QUADS_CHECK(static_cast<int>(replay->experts.size()) == cfg.num_hidden_layers,
                  "routing replay: {} layers given, the model has {}", replay->experts.size(), cfg.num_hidden_layers);
      for (int l = 0; l < cfg.num_hidden_layers; ++l) {
        if (!cfg.is_sparse(l)) continue;
        const auto& r = replay->experts[l];
        QUADS_CHECK(static_cast<int64_t>(r.size()) == Tn * K, "routing replay: layer {} has {} entries, expected {}", l,
                    r.size(), Tn * K);
        for (int64_t t = 0; t < Tn; ++t)
          for (int s = 0; s < K; ++s) {
            const int32_t e = r[t * K + s];
            QUADS_CHECK(e >= 0 && e < E, "routing replay: layer {} token {}: expert {} out of range", l, t, e);
            for (int s2 = 0; s2 < s; ++s2)
              QUADS_CHECK(r[t * K + s2] != e, "routing replay: layer {} token {}: expert {} chosen twice", l, t, e);
          }
      }
    }
    if (record) record->experts.assign(cfg.num_hidden_layers, {});
    kept = false;
    collecting = false;
    aux_F.assign(E, 0.0);
    aux_P.assign(E, 0.0);
    zsum = 0;
    nsparse = 0;
    aux_loss = z_loss = 0;
    router_z.assign(cfg.num_hidden_layers, {});
    T = Tn;
    tokens = b.tokens;
    keep_layers = keep;
    if (T == 0) {
      kept = keep;
      return;
    }
    const int L = cfg.num_hidden_layers;
    const size_t nbuf = keep ? size_t(L) : size_t(1);
    if (lb.size() < nbuf) lb.resize(nbuf);
    const size_t nres = keep ? size_t(L + 1) : size_t(2);
    if (resid.size() < nres) resid.resize(nres);
    for (size_t i = 0; i < nres; ++i) need(resid[i], size_t(T * H));

    set_positions(b.offsets);
    attn_tc_fwd = attn_tc;
    if (attn_tc_fwd) {
      if (!atc) atc = std::make_unique<AttentionTc>();
      atc->plan(b.offsets);
    }
    tok_d.upload(b.tokens);
    if (keep) {
      std::vector<int32_t> order(T), starts(T + 1), ids(T);
      kern::embedding_bwd_plan(b.tokens.data(), T, order.data(), starts.data(), ids.data(), &emb_nuniq);
      emb_order.upload(order);
      emb_starts.upload(starts);
      emb_ids.upload(ids);
    }

    need(qkv, size_t(T * (qd + 2 * kvd)));
    need(tmp, size_t(T * H));
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    const int hdp = attn_hd();
    const float* M = master.data();

    tick(-1);
    kern::embedding(M + lay.embed, tok_d.data(), T, H, X(0), stream);
    for (int l = 0; l < L; ++l) {
      const model::LayerOffsets& o = lay.layers[l];
      const LayerIdx& li = layers[l];
      LayerBuf& a = lb[keep ? l : 0];
      const float* xin = X(l);
      float* xout = X(l + 1);
      // Attention block.
      kern::rmsnorm_fwd(xin, M + o.input_norm, T, H, eps, need(a.xn1, T * H), need(a.inv1, T), stream);
      a.op_qkv = make_op(lin[li.q], a.xn1.data(), T, a.f_qkv, a.b_qkv);
      linear_fwd(li.q, 3, a.op_qkv, T, qkv.data(), qd + 2 * kvd);
      kern::split_cols3(qkv.data(), T, qd, kvd, kvd, need(a.q_raw, T * qd), need(a.k_raw, T * kvd), need(a.v, T * kvd),
                        stream);
      kern::rmsnorm_fwd(a.q_raw.data(), M + o.q_norm, T * nh, hd, eps, need(a.q, T * qd), need(a.inv_q, T * nh), stream);
      kern::rmsnorm_fwd(a.k_raw.data(), M + o.k_norm, T * nkv, hd, eps, need(a.k, T * kvd), need(a.inv_k, T * nkv),
                        stream);
      if (capture) {  // ordered before this buffer's next use on the stream; the caller syncs
        download_async(a.q.data(), T * qd, &capture->q[l]);
        download_async(a.k.data(), T * kvd, &capture->k[l]);
        download_async(a.v.data(), T * kvd, &capture->v[l]);
      }
      const bool kvt = !capture;
      const float* kvf = kvt && l < int(kv_f.size()) && kv_f[l].size() ? kv_f[l].data() : nullptr;
      if (kvf) kern::kv_factor(a.q.data(), a.k.data(), T, nh, nkv, hd, kvf, stream);
      kern::rope_fwd(a.q.data(), T, nh, hd, cosb.data(), sinb.data(), stream);
      kern::rope_fwd(a.k.data(), T, nkv, hd, cosb.data(), sinb.data(), stream);
      if (kvt && l < int(kv_m.size()) && kv_m[l].size()) kern::sub_cols(a.k.data(), T, kvd, kv_m[l].data(), stream);
      if (kvt && kv_quant) {  // K and V as the cache would hold them; the attention and its backward read these
        fake_quantize(a.k.data(), a.k.data(), T * nkv, hd, kv_qc, stream);
        fake_quantize(a.v.data(), a.v.data(), T * nkv, hd, kv_qc, stream);
      }
      float* attn = need(a.attn, T * qd);
      tick(kOther);
      if (hdp == hd) {
        attention_fwd(a.q.data(), a.k.data(), a.v.data(), hd, scale, attn, need(a.lse, T * nh));
      } else {
        kern::copy_cols(a.q.data(), T * nh, hd, need(a.qp, T * nh * hdp), hdp, stream);
        kern::copy_cols(a.k.data(), T * nkv, hd, need(a.kp, T * nkv * hdp), hdp, stream);
        kern::copy_cols(a.v.data(), T * nkv, hd, need(a.vp, T * nkv * hdp), hdp, stream);
        attention_fwd(a.qp.data(), a.kp.data(), a.vp.data(), hdp, scale, need(a.attn_p, T * nh * hdp),
                      need(a.lse, T * nh));
        kern::copy_cols(a.attn_p.data(), T * nh, hdp, attn, hd, stream);
      }
      tick(kAttn);
      a.op_o = make_op(lin[li.o], a.attn.data(), T, a.f_o, a.b_o);
      linear_fwd(li.o, 1, a.op_o, T, tmp.data(), H);
      kern::add(xin, tmp.data(), need(a.x_mid, T * H), T * H, stream);
      // MLP block.
      kern::rmsnorm_fwd(a.x_mid.data(), M + o.post_norm, T, H, eps, need(a.xn2, T * H), need(a.inv2, T), stream);
      const int64_t I = li.inter;
      const Lin &G0 = lin[li.mlp], &D0 = lin[li.mlp + 2];
      // h is the down projection's operand itself in the exact path without an activation quantizer.
      const bool keep_h = D0.path == Path::Exact && D0.num.act.kind == QuantKind::None;
      if (li.sparse) {
        const int64_t R = T * K;
        const Lin& Lr = lin[li.router];
        float* rl = need(dlog, size_t(T * E));  // router logits: scratch (router_stats reads them first)
        a.op_r = make_op(Lr, a.xn2.data(), T, a.f_r, a.b_r);
        linear_fwd(li.router, 1, a.op_r, T, rl, E);
        tick(kOther);
        const int32_t* fr = nullptr;
        if (replay) {
          forced.upload(replay->experts[l]);
          fr = forced.data();
        }
        kern::router_topk_fwd(rl, T, E, K, cfg.norm_topk_prob, need(a.probs, T * E), need(a.idx, R), need(a.w, R), fr,
                              stream);
        kern::moe_route(a.idx.data(), R, E, counts.data(), eoff_d.data(), need(a.perm, R), need(a.inv, R), nullptr,
                        bad_d.data(), stream);
        std::vector<int32_t> heoff(E + 1);
        int32_t bad = 0;
        QUADS_CUDA_CHECK(cudaMemcpyAsync(heoff.data(), eoff_d.data(), sizeof(int32_t) * (E + 1), cudaMemcpyDeviceToHost,
                                         stream));
        QUADS_CUDA_CHECK(cudaMemcpyAsync(&bad, bad_d.data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
        QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
        if (bad) {
          bad_d.fill_bytes(0);
          fail("GpuTrainer: the router of layer {} chose an expert outside 0..{} (NaN logits?)", l, E - 1);
        }
        a.eoff.assign(heoff.begin(), heoff.end());
        QUADS_CHECK(a.eoff[E] == R, "GpuTrainer: layer {} routed {} rows, expected {}", l, a.eoff[E], R);
        ++nsparse;
        if (aux_coef != 0 || z_coef != 0) router_stats(l, rl, a.probs.data(), a.eoff, keep);
        tick(kRoute);
        if (record) {
          record->experts[l].resize(R);
          QUADS_CUDA_CHECK(cudaMemcpy(record->experts[l].data(), a.idx.data(), sizeof(int32_t) * R,
                                      cudaMemcpyDeviceToHost));
        }
        // Expert inputs in expert order (cpu::moe_gather), then each expert's gate/up GEMM.
        if (G0.path == Path::Fast) {
          a.op_in = Opnd{};
          a.op_in.b = need(a.b_in, size_t(R * H));
          kern::gather_rows_bf16(a.xn2.data(), a.perm.data(), R, K, H, a.b_in.data(), stream);
        } else {
          kern::gather_rows(a.xn2.data(), a.perm.data(), R, K, H, need(a.xe, size_t(R * H)), stream);
          a.op_in = make_op(G0, a.xe.data(), R, a.f_in, a.b_in, &a.eoff);
        }
        float* gu = need(a.gu, size_t(R * 2 * I));
        begin_experts(G0);
        for (int e = 0; e < E; ++e) {
          const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
          cur_lane = e;
          if (n > 0) linear_fwd(li.mlp + 3 * e, 2, a.op_in.rows(r0, H), n, gu + r0 * 2 * I, 2 * I);
        }
        flush_experts();
        float* h = keep_h ? need(a.h, size_t(R * I)) : need(h_tmp, size_t(R * I));
        kern::swiglu(gu, gu + I, 2 * I, R, I, h, stream);
        a.op_d = make_op(D0, h, R, a.f_d, a.b_d, &a.eoff);
        float* ye = need(a.ye, size_t(R * H));
        begin_experts(D0);
        for (int e = 0; e < E; ++e) {
          const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
          cur_lane = e;
          if (n > 0) linear_fwd(li.mlp + 3 * e + 2, 1, a.op_d.rows(r0, I), n, ye + r0 * H, H);
        }
        flush_experts();
        // x += sum_s w[t, s] * ye[inv[t, s]] (cpu::moe_combine_forward then add_inplace).
        QUADS_CUDA_CHECK(cudaMemcpyAsync(xout, a.x_mid.data(), sizeof(float) * T * H, cudaMemcpyDeviceToDevice, stream));
        kern::moe_combine_add(ye, a.inv.data(), a.w.data(), T, K, H, xout, stream);
      } else {
        a.eoff = {0, T};
        a.op_in = make_op(G0, a.xn2.data(), T, a.f_in, a.b_in);
        float* gu = need(a.gu, size_t(T * 2 * I));
        linear_fwd(li.mlp, 2, a.op_in, T, gu, 2 * I);
        float* h = keep_h ? need(a.h, size_t(T * I)) : need(h_tmp, size_t(T * I));
        kern::swiglu(gu, gu + I, 2 * I, T, I, h, stream);
        a.op_d = make_op(D0, h, T, a.f_d, a.b_d);
        linear_fwd(li.mlp + 2, 1, a.op_d, T, tmp.data(), H);
        kern::add(a.x_mid.data(), tmp.data(), xout, T * H, stream);
      }
    }
    kern::rmsnorm_fwd(X(L), M + lay.final_norm, T, H, eps, need(xf, T * H), need(inv_f, T), stream);
    op_lm = make_op(lin[lm_head], xf.data(), T, f_lm, b_lm);
    linear_fwd(lm_head, 1, op_lm, T, need(logits, size_t(T * V)), V);
    if (logits_host)
      QUADS_CUDA_CHECK(cudaMemcpyAsync(logits_host, logits.data(), sizeof(float) * T * V, cudaMemcpyDeviceToHost, stream));
    tick(kOther);
    collect();
    QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (nsparse > 0 && T > 0) {  // as model::Model::forward: HF's losses over all MoE layers' tokens
      const double rows = double(nsparse) * double(T);
      for (int e = 0; e < E; ++e) {
        aux_F[e] /= rows;
        aux_loss += aux_F[e] * (aux_P[e] / rows);
      }
      aux_loss *= E;
      z_loss = zsum / rows;
    }
    kept = keep;
  }

  // A MoE layer's router-loss statistics (rl: its router logits, probs: their softmax, [T, E]).
  void router_stats(int l, const float* rl, const float* probs, const std::vector<int64_t>& eoff, bool keep) {
    const int E = cfg.num_experts;
    for (int e = 0; e < E; ++e) aux_F[e] += double(eoff[e + 1] - eoff[e]);
    router_host.resize(size_t(T) * E);
    QUADS_CUDA_CHECK(cudaMemcpy(router_host.data(), probs, sizeof(float) * T * E, cudaMemcpyDeviceToHost));
    for (int64_t t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) aux_P[e] += router_host[t * E + e];
    QUADS_CUDA_CHECK(cudaMemcpy(router_host.data(), rl, sizeof(float) * T * E, cudaMemcpyDeviceToHost));
    std::vector<double> z(T);
    cpu::router_logsumexp(router_host.data(), T, E, z.data());
    for (int64_t t = 0; t < T; ++t) zsum += z[t] * z[t];
    if (keep) router_z[l] = std::move(z);
  }

  // ---- backward from dlogits (device)

  void backward_device() {
    QUADS_CHECK(kept, "GpuTrainer::backward: the last forward did not keep its activations (keep = true)");
    if (T == 0) return;
    const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim;
    const int64_t qd = cfg.q_dim(), kvd = cfg.kv_dim();
    const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
    const int L = cfg.num_hidden_layers;
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    const float* M = master.data();
    float* G = grads.data();
    const int64_t R = std::max<int64_t>(T * std::max(K, 1), T);
    collecting = false;
    need(rms_scratch, size_t(std::max({kern::rmsnorm_bwd_scratch(T, H), kern::rmsnorm_bwd_scratch(T * nh, hd),
                                       kern::rmsnorm_bwd_scratch(T * nkv, hd), int64_t(1)})));
    float* dxp = need(dx, size_t(T * H));
    float* dtp = need(dtmp, size_t(T * H));
    float* dxnp = need(dxn, size_t(T * H));
    grads_zero = false;
    tick(-1);

    // lm_head and the final norm.
    const Lin& Llm = lin[lm_head];
    linear_bwd(lm_head, 1, dlogits.data(), dy_bf16(Llm, dlogits.data(), T * V), V, op_lm, T, dxnp, false);
    kern::rmsnorm_bwd(dxnp, X(L), M + lay.final_norm, inv_f.data(), T, H, dxp, G + lay.final_norm, rms_scratch.data(),
                      stream);

    for (int l = L - 1; l >= 0; --l) {
      const model::LayerOffsets& o = lay.layers[l];
      const LayerIdx& li = layers[l];
      LayerBuf& a = lb[l];
      const int64_t I = li.inter;
      const Lin &G0 = lin[li.mlp], &D0 = lin[li.mlp + 2];
      // MLP: x_out = x_mid + mlp(norm(x_mid)); dx is dL/dx_out.
      if (li.sparse) {
        float* dyep = need(dye, size_t(R * H));
        float* dwp = need(dw, size_t(T * K));
        float* dxep = need(dxe, size_t(R * H));
        float* dhp = need(dh, size_t(R * I));
        float* dgup = need(dgu, size_t(R * 2 * I));
        kern::moe_combine_bwd(dxp, a.ye.data(), a.inv.data(), a.w.data(), T, K, H, dyep, dwp, stream);
        const uint16_t* dyeb = dy_bf16(D0, dyep, R * H);
        begin_experts(D0);
        for (int e = 0; e < E; ++e) {
          const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
          cur_lane = e;
          if (n > 0)
            linear_bwd(li.mlp + 3 * e + 2, 1, dyep + r0 * H, dyeb ? dyeb + r0 * H : nullptr, H, a.op_d.rows(r0, I), n,
                       dhp + r0 * I, false);
        }
        flush_experts();
        kern::swiglu_bwd(a.gu.data(), dhp, R, I, dgup, stream);
        const uint16_t* dgub = dy_bf16(G0, dgup, R * 2 * I);
        begin_experts(G0);
        for (int e = 0; e < E; ++e) {
          const int64_t r0 = a.eoff[e], n = a.eoff[e + 1] - r0;
          cur_lane = e;
          if (n > 0)
            linear_bwd(li.mlp + 3 * e, 2, dgup + r0 * 2 * I, dgub ? dgub + r0 * 2 * I : nullptr, 2 * I,
                       a.op_in.rows(r0, H), n, dxep + r0 * H, false);
        }
        flush_experts();
        kern::moe_scatter_add(dxep, a.inv.data(), T, K, H, dxnp, false, stream);
        // Router: through the top-k weights, plus the aux and z losses (model::Model::backward's terms).
        float* dl = need(dlog, size_t(T * E));
        const double nrows = double(nsparse) * double(T);
        const float* extra = nullptr;
        if (aux_coef != 0) {  // dL/dprobs[t, e] = coef * E * F_e / rows, the same for every token
          extra_host.resize(size_t(T) * E);
          for (int e = 0; e < E; ++e) {
            const float g = static_cast<float>(aux_coef * E * aux_F[e] / nrows);
            for (int64_t t = 0; t < T; ++t) extra_host[t * E + e] = g;
          }
          // stream-ordered: the previous layer's router backward has read the buffer before this copy
          QUADS_CUDA_CHECK(cudaMemcpyAsync(need(extra_d, extra_host.size()), extra_host.data(),
                                           sizeof(float) * extra_host.size(), cudaMemcpyHostToDevice, stream));
          extra = extra_d.data();
        }
        kern::router_topk_bwd(a.probs.data(), a.idx.data(), a.w.data(), dwp, extra, T, E, K, cfg.norm_topk_prob, dl,
                              stream);
        if (z_coef != 0) {
          zg_host.resize(T);
          for (int64_t t = 0; t < T; ++t) zg_host[t] = z_coef * 2.0 * router_z[l][t] / nrows;
          QUADS_CUDA_CHECK(cudaMemcpyAsync(need(zg_d, zg_host.size()), zg_host.data(), sizeof(double) * zg_host.size(),
                                           cudaMemcpyHostToDevice, stream));
          kern::router_zloss_bwd(a.probs.data(), zg_d.data(), T, E, dl, stream);
        }
        const Lin& Lr = lin[li.router];
        linear_bwd(li.router, 1, dl, dy_bf16(Lr, dl, T * E), E, a.op_r, T, dxnp, true);
      } else {
        float* dhp = need(dh, size_t(T * I));
        float* dgup = need(dgu, size_t(T * 2 * I));
        linear_bwd(li.mlp + 2, 1, dxp, dy_bf16(D0, dxp, T * H), H, a.op_d, T, dhp, false);
        kern::swiglu_bwd(a.gu.data(), dhp, T, I, dgup, stream);
        linear_bwd(li.mlp, 2, dgup, dy_bf16(G0, dgup, T * 2 * I), 2 * I, a.op_in, T, dxnp, false);
      }
      kern::rmsnorm_bwd(dxnp, a.x_mid.data(), M + o.post_norm, a.inv2.data(), T, H, dtp, G + o.post_norm,
                        rms_scratch.data(), stream);
      kern::add_inplace(dxp, dtp, T * H, stream);

      // Attention: x_mid = x_in + o_proj(attn(norm(x_in))).
      const Lin& Lo = lin[li.o];
      float* dap = need(dattn, size_t(T * qd));
      linear_bwd(li.o, 1, dxp, dy_bf16(Lo, dxp, T * H), H, a.op_o, T, dap, false);
      float* dqp = need(dq, size_t(T * qd));
      float* dkp = need(dk, size_t(T * kvd));
      float* dvp = need(dv, size_t(T * kvd));
      const int hdp = attn_hd();
      tick(kOther);
      if (hdp == hd) {
        attention_bwd(a.q.data(), a.k.data(), a.v.data(), a.attn.data(), a.lse.data(), dap, hd, scale, dqp, dkp, dvp);
      } else {
        kern::copy_cols(dap, T * nh, hd, need(dattn_p, T * nh * hdp), hdp, stream);
        attention_bwd(a.qp.data(), a.kp.data(), a.vp.data(), a.attn_p.data(), a.lse.data(), dattn_p.data(), hdp, scale,
                      need(dq_p, T * nh * hdp), need(dk_p, T * nkv * hdp), need(dv_p, T * nkv * hdp));
        kern::copy_cols(dq_p.data(), T * nh, hdp, dqp, hd, stream);
        kern::copy_cols(dk_p.data(), T * nkv, hdp, dkp, hd, stream);
        kern::copy_cols(dv_p.data(), T * nkv, hdp, dvp, hd, stream);
      }
      tick(kAttn);
      // the KV transform's post-RoPE part: straight-through; its factor: the same diagonal map
      kern::rope_bwd(dqp, T, nh, hd, cosb.data(), sinb.data(), stream);
      kern::rope_bwd(dkp, T, nkv, hd, cosb.data(), sinb.data(), stream);
      if (l < int(kv_f.size()) && kv_f[l].size()) kern::kv_factor(dqp, dkp, T, nh, nkv, hd, kv_f[l].data(), stream);
      float* dqr = need(dq_raw, size_t(T * qd));
      float* dkr = need(dk_raw, size_t(T * kvd));
      kern::rmsnorm_bwd(dqp, a.q_raw.data(), M + o.q_norm, a.inv_q.data(), T * nh, hd, dqr, G + o.q_norm,
                        rms_scratch.data(), stream);
      kern::rmsnorm_bwd(dkp, a.k_raw.data(), M + o.k_norm, a.inv_k.data(), T * nkv, hd, dkr, G + o.k_norm,
                        rms_scratch.data(), stream);
      const int64_t nqkv = qd + 2 * kvd;
      float* dqkvp = need(dqkv, size_t(T * nqkv));
      kern::concat_cols3(dqr, dkr, dvp, T, qd, kvd, kvd, dqkvp, stream);
      linear_bwd(li.q, 3, dqkvp, dy_bf16(lin[li.q], dqkvp, T * nqkv), nqkv, a.op_qkv, T, dxnp, false);
      kern::rmsnorm_bwd(dxnp, X(l), M + o.input_norm, a.inv1.data(), T, H, dtp, G + o.input_norm, rms_scratch.data(),
                        stream);
      kern::add_inplace(dxp, dtp, T * H, stream);
    }
    kern::embedding_bwd(dxp, emb_order.data(), emb_starts.data(), emb_ids.data(), emb_nuniq, H, G + lay.embed, stream);
    tick(kOther);
    collect();
  }
};

// ---------------------------------------------------------------------------------------------

GpuTrainer::GpuTrainer(const model::Weights& w, const model::PrecisionConfig& p)
    : impl_(std::make_unique<Impl>(w.cfg, p)) {
  upload(w);
}

GpuTrainer::GpuTrainer(const model::ModelConfig& cfg, const model::PrecisionConfig& p, uint64_t seed, float stddev)
    : impl_(std::make_unique<Impl>(cfg, p)) {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.lay.params.size(); ++i) {
    const model::ParamInfo& pi = m.lay.params[i];
    if (m.cfg.tie_word_embeddings && pi.name == "lm_head.weight") continue;
    if (pi.is_matrix())
      kern::fill_normal(m.master.data() + pi.offset, static_cast<int64_t>(pi.numel), seed + 7919 * i, 0.f, stddev,
                        m.stream);
    else
      kern::fill_normal(m.master.data() + pi.offset, static_cast<int64_t>(pi.numel), 0, 1.f, 0.f, m.stream);
  }
  m.requantize();
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

GpuTrainer::~GpuTrainer() = default;

const model::ModelConfig& GpuTrainer::config() const { return impl_->cfg; }
const model::PrecisionConfig& GpuTrainer::precision() const { return impl_->prec; }
std::string GpuTrainer::device_name() const { return cuda::device_name(0); }

void GpuTrainer::upload(const model::Weights& w) {
  Impl& m = *impl_;
  m.check_layout(w, "upload");
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.master.upload(w.data);
  m.requantize();
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

void GpuTrainer::download(model::Weights& w) const {
  Impl& m = *impl_;
  m.check_layout(w, "download");
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  QUADS_CUDA_CHECK(cudaMemcpy(w.data.data(), m.master.data(), sizeof(float) * m.lay.total, cudaMemcpyDeviceToHost));
}

model::DeviceWeights GpuTrainer::device_masters() const {
  Impl& m = *impl_;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  return {m.master.data(), m.lay.total, "cuda"};
}

void GpuTrainer::forward(const model::Batch& b, float* logits_host, bool keep, model::Routing* record,
                         const model::Routing* replay) {
  impl_->forward(b, logits_host, keep, record, replay);
}

void GpuTrainer::set_router_losses(double aux_loss_coef, double z_loss_coef) {
  QUADS_CHECK(std::isfinite(aux_loss_coef) && std::isfinite(z_loss_coef),
              "GpuTrainer: router loss coefficients must be finite (aux {}, z {})", aux_loss_coef, z_loss_coef);
  impl_->aux_coef = aux_loss_coef;
  impl_->z_coef = z_loss_coef;
  impl_->kept = false;  // a kept forward ran without the z statistics
}
double GpuTrainer::aux_loss() const { return impl_->aux_loss; }
double GpuTrainer::z_loss() const { return impl_->z_loss; }

void GpuTrainer::set_kv_transform(const model::KvTransform& t) {
  Impl& m = *impl_;
  t.validate(m.cfg, "GpuTrainer::set_kv_transform");
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  upload_each(t.factor, m.kv_f);
  upload_each(t.shift, m.kv_m);
  m.kv_quant = t.quantize;
  m.kv_qc = t.qconfig;
  m.kept = false;  // a kept forward ran without it
}

void GpuTrainer::capture_attention(const model::Batch& b, train::AttentionInputs* out) {
  Impl& m = *impl_;
  QUADS_CHECK(out != nullptr, "GpuTrainer::capture_attention: no output");
  const int L = m.cfg.num_hidden_layers;
  *out = {};
  out->q.resize(L);
  out->k.resize(L);
  out->v.resize(L);
  out->offsets = b.offsets;
  out->T = b.ntokens();
  m.capture = out;
  try {
    m.forward(b, nullptr, false, nullptr, nullptr);
  } catch (...) {
    m.capture = nullptr;
    throw;
  }
  m.capture = nullptr;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

std::vector<double> GpuTrainer::attention_mse(const train::AttentionInputs& in, int l,
                                              const std::vector<train::KvCandidate>& cands, const num::QConfig* kv) {
  return impl_->attention_mse(in, l, cands, kv);
}

void GpuTrainer::backward(const float* dlogits_host, float* grads_host) {
  Impl& m = *impl_;
  QUADS_CHECK(m.kept, "GpuTrainer::backward: the last forward did not keep its activations (keep = true)");
  const int64_t n = m.T * m.cfg.vocab_size;
  std::vector<float> before;
  if (grads_host && !m.grads_zero) before = grads();
  need(m.dlogits, size_t(std::max<int64_t>(n, 1)));
  if (n) QUADS_CUDA_CHECK(cudaMemcpyAsync(m.dlogits.data(), dlogits_host, sizeof(float) * n, cudaMemcpyHostToDevice, m.stream));
  m.backward_device();
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  if (!grads_host) return;
  const std::vector<float> after = grads();
  if (before.empty())
    for (size_t i = 0; i < after.size(); ++i) grads_host[i] += after[i];
  else
    for (size_t i = 0; i < after.size(); ++i) grads_host[i] += after[i] - before[i];
}

double GpuTrainer::loss_ce(const std::vector<int32_t>& targets, bool run_backward) {
  Impl& m = *impl_;
  QUADS_CHECK(m.kept, "GpuTrainer::loss_ce: the last forward did not keep its activations (keep = true)");
  QUADS_CHECK(static_cast<int64_t>(targets.size()) == m.T, "GpuTrainer::loss_ce: {} targets for {} tokens",
              targets.size(), m.T);
  const int64_t V = m.cfg.vocab_size;
  int64_t N = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    QUADS_CHECK(targets[i] < V, "GpuTrainer::loss_ce: target {} at row {} is outside the vocabulary (0..{})", targets[i],
                i, V - 1);
    N += targets[i] >= 0;
  }
  if (N == 0) return 0.0;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.targets_d.upload(targets);
  m.tick(-1);
  float* logp = need(m.logp, size_t(m.T));
  kern::token_logprobs(m.logits.data(), m.T, V, m.targets_d.data(), 1.f, logp, nullptr, m.stream);
  std::vector<float> hl(m.T);
  QUADS_CUDA_CHECK(cudaMemcpyAsync(hl.data(), logp, sizeof(float) * m.T, cudaMemcpyDeviceToHost, m.stream));
  if (run_backward) {
    // d(mean CE)/d logp_t = -1/N on rows with a target (token_logprobs_bwd zeroes the others).
    kern::fill(need(m.dlogp, size_t(m.T)), static_cast<float>(-1.0 / double(N)), m.T, m.stream);
    kern::token_logprobs_bwd(m.logits.data(), m.T, V, m.targets_d.data(), 1.f, m.dlogp.data(),
                             need(m.dlogits, size_t(m.T * V)), m.stream);
    m.tick(Impl::kLoss);
    m.collect();
    m.backward_device();
  }
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  double s = 0;
  for (int64_t t = 0; t < m.T; ++t)
    if (targets[t] >= 0) s -= double(hl[t]);
  return s / double(N);
}

void GpuTrainer::zero_grad() {
  Impl& m = *impl_;
  QUADS_CUDA_CHECK(cudaMemsetAsync(m.grads.data(), 0, m.grads.bytes(), m.stream));
  m.grads_zero = true;
}

std::vector<float> GpuTrainer::grads() const {
  Impl& m = *impl_;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  return m.grads.download();
}

namespace {
// AdamW's device state, zero-initialized at first use.
void ensure_adam(GpuTrainer::Impl& m) {
  const int64_t n = static_cast<int64_t>(m.lay.total);
  if (m.adam_m.size() == size_t(n)) return;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.adam_m.resize(n);
  m.adam_v.resize(n);
  m.adam_m.fill_bytes(0);
  m.adam_v.fill_bytes(0);
  m.decay_mask.upload(train::AdamW::decay_mask(m.lay));
  m.norm_scratch.resize(size_t(std::max<int64_t>(kern::global_norm_scratch(n), 1)));
  m.norm_out.resize(1);
}
}  // namespace

void GpuTrainer::set_adam_state(const std::vector<float>& mo, const std::vector<float>& vo) {
  Impl& m = *impl_;
  QUADS_CHECK(mo.size() == m.lay.total && vo.size() == m.lay.total,
              "GpuTrainer::set_adam_state: {} / {} moments for {} parameters", mo.size(), vo.size(), m.lay.total);
  ensure_adam(m);
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  QUADS_CUDA_CHECK(cudaMemcpy(m.adam_m.data(), mo.data(), mo.size() * sizeof(float), cudaMemcpyHostToDevice));
  QUADS_CUDA_CHECK(cudaMemcpy(m.adam_v.data(), vo.data(), vo.size() * sizeof(float), cudaMemcpyHostToDevice));
}

double GpuTrainer::adamw_step(const train::AdamWConfig& c, int64_t t, double lr_override) {
  Impl& m = *impl_;
  QUADS_CHECK(t >= 1, "GpuTrainer::adamw_step: step number {} (the first step is 1)", t);
  const int64_t n = static_cast<int64_t>(m.lay.total);
  ensure_adam(m);
  m.tick(-1);
  kern::global_norm(m.grads.data(), n, m.norm_scratch.data(), m.norm_out.data(), m.stream);
  double norm = 0;
  QUADS_CUDA_CHECK(cudaMemcpyAsync(&norm, m.norm_out.data(), sizeof(double), cudaMemcpyDeviceToHost, m.stream));
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  // train::AdamW::step, constant for constant.
  float clip = 1.f;  // applied inside the AdamW pass (kern::scale's multiply)
  if (c.max_grad_norm > 0) {
    const double coef = c.max_grad_norm / (norm + 1e-6);
    if (coef < 1.0) clip = static_cast<float>(coef);
  }
  const double lr = lr_override > 0 ? lr_override : c.lr;
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(c.beta1, double(t))));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(c.beta2, double(t))));
  const float eps = static_cast<float>(c.eps);
  const float decay = static_cast<float>(1.0 - lr * c.weight_decay);
  // Where BF16 operands are most of the weights (the bf16 preset) AdamW writes them for every
  // parameter in its pass; requantize() then skips them.
  const bool bf16_fused = 2 * m.bf16_fast_params > n;
  // The WeightOperandSet's amax pass in the same pass (QUADS_GPU_TRAIN_WOP_AMAX=0: its own pass).
  if (!m.wops_built) m.build_wops();
  kern::AdamWAmax wa;
  if (m.wops.size() > 0 && m.wops_amax_in_adamw) {
    wa.begin = m.wops_begin.data();
    wa.end = m.wops_end.data();
    wa.count = static_cast<int>(m.wops.size());
    wa.amax_bits = reinterpret_cast<uint32_t*>(m.wops.amax());
  }
  kern::adamw(m.master.data(), m.grads.data(), m.adam_m.data(), m.adam_v.data(), m.decay_mask.data(), n, b1, b2,
              step_size, bc2_sqrt, eps, decay, m.stream, clip, bf16_fused ? m.wb.data() : nullptr, wa);
  m.tick(Impl::kOpt);
  m.requantize(bf16_fused, wa.count > 0);
  m.tick(Impl::kRequant);
  m.collect();
  return norm;
}

void GpuTrainer::set_attention(const std::string& which) { impl_->set_attention(which); }
std::string GpuTrainer::attention() const { return impl_->attn_tc ? "tc" : "exact"; }
void GpuTrainer::set_expert_gemms(const std::string& which) { impl_->set_expert_gemms(which); }
std::string GpuTrainer::expert_gemms() const {
  return impl_->any_fast ? impl_->expert_gemms() : std::string("per-expert (exact path)");
}

void GpuTrainer::set_profiling(bool on) {
  Impl& m = *impl_;
  m.collect();
  m.prof = on;
}

std::string GpuTrainer::profile_report() {
  Impl& m = *impl_;
  m.collect();
  const std::string attn = fmt::format("attention ({})", m.attn_tc_fwd ? "tc" : "exact");
  const std::string gemm = fmt::format("GEMMs (experts {})", m.any_fast ? m.expert_gemms() : "per-expert");
  const std::string requant =
      fmt::format("re-quantization ({}{})",
                  m.requant_exec[0] || m.requant_exec[1] || m.requant_exec[2] || m.requant_exec[3] ? "graph" : "eager",
                  m.wops.size() > 0 ? fmt::format(", {} NVFP4 operands in one set", m.wops.size()) : std::string());
  const char* names[Impl::kNcat] = {gemm.c_str(), attn.c_str(), "MoE routing (+ host sync)", "losses",
                                    "clip + AdamW", requant.c_str(), "other"};
  std::string r;
  double total = 0;
  for (int c = 0; c < Impl::kNcat; ++c) total += m.prof_ms[c];
  for (int c = 0; c < Impl::kNcat; ++c) {
    r += fmt::format("{}{} {:.1f} ms", r.empty() ? "" : ", ", names[c], m.prof_ms[c]);
    m.prof_ms[c] = 0;
  }
  return fmt::format("{:.1f} ms: {}", total, r);
}

void GpuTrainer::adam_state(std::vector<float>* mo, std::vector<float>* vo) const {
  Impl& m = *impl_;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  if (mo) *mo = m.adam_m.download();
  if (vo) *vo = m.adam_v.download();
}

std::string GpuTrainer::linear_path(const std::string& module) const {
  for (const auto& L : impl_->lin)
    if (L.name == module) return L.path == Path::Fast ? "fast" : "exact";
  fail("GpuTrainer: no linear named '{}'", module);
}

std::vector<uint16_t> GpuTrainer::fast_weight(const std::string& module, float* alpha) const {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.lin.size(); ++i) {
    const Lin& L = m.lin[i];
    if (L.name != module) continue;
    QUADS_CHECK(L.path == Path::Fast, "GpuTrainer::fast_weight: {} runs on the exact path", module);
    QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    std::vector<uint16_t> w(size_t(L.out * L.in));
    QUADS_CUDA_CHECK(cudaMemcpy(w.data(), m.wb.data() + L.offset, sizeof(uint16_t) * w.size(), cudaMemcpyDeviceToHost));
    if (alpha) QUADS_CUDA_CHECK(cudaMemcpy(alpha, m.alphas.data() + i, sizeof(float), cudaMemcpyDeviceToHost));
    return w;
  }
  fail("GpuTrainer: no linear named '{}'", module);
}

std::vector<float> GpuTrainer::exact_weights() const {
  Impl& m = *impl_;
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  return m.any_exact ? m.weff.download() : std::vector<float>{};
}

// ---------------------------------------------------------------------------------------------

namespace {

class GpuTrainBackend : public train::TrainBackend {
 public:
  GpuTrainBackend(const model::Weights& w, const model::PrecisionConfig& p) : g_(w, p) {}
  std::string name() const override { return "cuda:" + g_.device_name(); }
  void forward(const model::Batch& b, float* logits, bool keep, model::Routing* record,
               const model::Routing* replay) override {
    g_.forward(b, logits, keep, record, replay);
  }
  // The interface adds this call's gradient into `grads`: the device gradients start from zero.
  void backward(const float* dlogits, float* grads) override {
    g_.zero_grad();
    g_.backward(dlogits, grads);
  }
  void sync(const model::Weights& w) override { g_.upload(w); }
  void set_kv_transform(const model::KvTransform& t) override { g_.set_kv_transform(t); }
  void capture_attention(const model::Batch& b, train::AttentionInputs* out) override { g_.capture_attention(b, out); }
  std::vector<double> attention_mse(const train::AttentionInputs& in, int l, const std::vector<train::KvCandidate>& cands,
                                    const num::QConfig* kv) override {
    return g_.attention_mse(in, l, cands, kv);
  }
  void set_router_losses(double aux_loss_coef, double z_loss_coef) override {
    g_.set_router_losses(aux_loss_coef, z_loss_coef);
  }
  RouterLosses router_losses() const override { return {g_.aux_loss(), g_.z_loss()}; }

  // AdamW on the device: no gradient or master crosses PCIe in a step.
  bool has_optimizer() const override { return true; }
  double optimizer_step(train::AdamW& opt, double lr) override {
    const double norm = g_.adamw_step(opt.cfg, opt.t + 1, lr);
    ++opt.t;
    return norm;
  }
  void download(model::Weights& w, train::AdamW* opt) override {
    g_.download(w);
    if (opt && opt->t > 0) g_.adam_state(&opt->m, &opt->v);
  }
  void upload_optimizer(const train::AdamW& opt) override {
    if (opt.t > 0) g_.set_adam_state(opt.m, opt.v);
  }
  model::DeviceWeights device_masters() override { return g_.device_masters(); }

 private:
  GpuTrainer g_;
};

}  // namespace

std::unique_ptr<train::TrainBackend> make_gpu_trainer(const model::Weights& w, const model::PrecisionConfig& p) {
  return std::make_unique<GpuTrainBackend>(w, p);
}

}  // namespace quads::cuda
