// GpuModel: host orchestration of the GPU Qwen3-MoE forward (see model_gpu.h); the kernels are in
// model_kernels.cu, the quantizers and W4A4 GEMM in quant.cu / w4a4_gemm.cu, BF16 GEMMs in blas.cu.
#include "cuda/model_gpu.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "common/error.h"
#include "cpu/ops.h"
#include "cuda/attention_tc.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/fp8_gemm.h"
#include "cuda/gemm.h"
#include "cuda/model_kernels.h"
#include "cuda/quant.h"
#include "cuda/train_kernels.h"
#include "model/rac.h"

namespace quads::cuda {

const char* gpu_linear_mode_name(GpuLinearMode m) {
  switch (m) {
    case GpuLinearMode::BF16: return "bf16";
    case GpuLinearMode::W4A4: return "w4a4";
    case GpuLinearMode::FP8: return "fp8";
    case GpuLinearMode::Fake: break;
  }
  return "fake-quant fp32";
}

namespace {

using model::QuantKind;

bool is_e2m1_nvfp4(const model::OperandQuant& q) {
  return q.kind == QuantKind::Quant && q.cfg.scheme == num::Scheme::NVFP4 && q.cfg.element == num::Format::E2M1 &&
         !q.cfg.stochastic;
}

GpuLinearMode choose_mode(const model::LinearNumerics& n, int64_t in) {
  if (n.weight.kind == QuantKind::BF16 && n.act.kind == QuantKind::BF16) return GpuLinearMode::BF16;
  if (is_e2m1_nvfp4(n.weight) && is_e2m1_nvfp4(n.act) && n.act.cfg.block == num::Block::B1x16 && in % 64 == 0)
    return GpuLinearMode::W4A4;
  // FP8 E4M3 weights with FP8 activations: codes + scales on the device, dequantized in the GEMV.
  if (n.weight.kind == QuantKind::Quant && fp8_weight_supported(n.weight.cfg, in) && in % 16 == 0 &&
      n.act.kind == QuantKind::Quant && n.act.cfg.scheme == num::Scheme::FP8)
    return GpuLinearMode::FP8;
  return GpuLinearMode::Fake;
}

struct DevLinear {
  std::string name;
  int layer = -1;
  int64_t out = 0, in = 0;
  size_t offset = 0;
  model::LinearNumerics num;
  GpuLinearMode mode = GpuLinearMode::Fake;
  DeviceArray<uint16_t> wb;  // BF16 [out, in]
  DeviceQTensor wq;          // W4A4: NVFP4 codes, scales, amax; FP8: E4M3 codes, FP32 scales
  Nvfp4View wv;
  Fp8Weight w8;              // FP8: wq's buffers and their layout
  Fp8Layout g8;
  DeviceArray<float> wf;     // Fake: W_eff [out, in]
  // RAC: W's 16-blocks compensated (padded with block 0 to rac_cols / 16 entries), the residual's
  // format, and for Fake linears the gathered columns W_eff[:, S] [out, rac_cols].
  DeviceArray<int32_t> rac_blocks;
  std::vector<int32_t> rac_blocks_host;
  int64_t rac_nsel = 0, rac_cols = 0;
  model::OperandQuant rac_quant;
  DeviceArray<float> rac_w;
  DeviceArray<uint8_t> rac_sel;  // W4A4: [in / 16], 1 where a block is compensated (RAC folded)
  // Gate linears of a layer that fuses gate and up (LayerIdx::fused_gu): both weights stacked
  // [2I, H] for one GEMM, BF16 or NVFP4 (codes, scales, and a global amax per row: the gate's on
  // the first I rows, the up's on the others; per-row W amax is read by the same W4A4 kernel).
  DeviceArray<uint16_t> gu_b;
  DeviceArray<uint8_t> gu_codes, gu_scales;
  DeviceArray<float> gu_amax;
  Nvfp4View gu_v;

  double bytes() const {
    switch (mode) {
      case GpuLinearMode::BF16: return double(out) * in * 2;
      case GpuLinearMode::W4A4: return double(out) * in / 2 + double(out) * in / 16 + double(wq.amax.bytes());
      case GpuLinearMode::FP8: return double(out) * in + double(wq.fscales.bytes());
      case GpuLinearMode::Fake: break;
    }
    return double(out) * in * 4;
  }
  double rac_bytes() const { return rac_nsel ? bytes() * double(rac_nsel * 16) / double(in) : 0.0; }
  // The activation quantizer applied (what LinearQ::act_cfg gives for an uncalibrated linear).
  const num::QConfig& act_cfg() const { return num.act.cfg; }
};

// The quantized operand of a GEMM: M rows of X in the linear's activation format.
struct Operand {
  GpuLinearMode mode = GpuLinearMode::Fake;
  int64_t rows = 0, k = 0;
  const float* x = nullptr;     // the unquantized input (RAC's residual)
  const float* f = nullptr;     // Fake
  const uint16_t* b = nullptr;  // BF16
  Nvfp4View v;                  // W4A4
  Fp8Act a8;                    // FP8 with E4M3 activations: codes + scales for the tile GEMMs
};

// FP8 activations the tile GEMMs read as codes: E4M3, deterministic, a block layout of Fp8Layout.
bool fp8_act_codes(const model::OperandQuant& a, int64_t k) {
  if (a.kind != QuantKind::Quant || !fp8_weight_supported(a.cfg, k) || k % 16 != 0) return false;
  const num::Block b = a.cfg.block;
  return b == num::Block::PerTensor || b == num::Block::PerRow || b == num::Block::B1x128 ||
         b == num::Block::B128x128;
}

// Bumped whenever a scratch buffer moves: a captured CUDA graph holds raw pointers and is only
// replayed while this is unchanged.
size_t g_alloc_gen = 0;

template <typename T>
T* grow(DeviceArray<T>& a, size_t n) {
  if (a.size() < n) {
    a.resize(n + n / 4 + 256);
    ++g_alloc_gen;
  }
  return a.data();
}

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, value) == 0;
}

}  // namespace

struct GpuModel::Impl {
  model::ModelConfig cfg;
  model::PrecisionConfig prec;
  model::Layout lay;
  std::vector<DevLinear> lin;
  struct LayerIdx : model::LinearTable::Layer {  // indices into lin, and how the layer runs
    bool experts_uniform = true;  // every expert's gate/up and down share one activation quantizer
    bool fused_gu = false;        // gate and up run as one [2I, H] GEMM per expert
    bool fused_qkv = false;       // q, k and v run as one [q_dim + 2 kv_dim, H] GEMM
  };
  std::vector<LayerIdx> layers;
  int lm_head = -1;
  // Fused q/k/v weights per layer (LayerIdx::fused_qkv): BF16, or NVFP4 with a per-row amax.
  struct Qkv {
    DeviceArray<uint16_t> b;
    DeviceArray<uint8_t> codes, scales;
    DeviceArray<float> amax;
    Nvfp4View v;
  };
  std::vector<Qkv> qkv;
  DeviceArray<float> qkvbuf;
  DeviceArray<float> master;  // float32 weights, Layout order
  // FP8 linears. Dense linears of up to fp8_gemv_rows rows run the GEMV on the codes
  // (QUADS_GPU_FP8_GEMV_ROWS): on the H200 (bench_cuda --fp8) it beat the 16-row tile at 1 and
  // 2 rows and lost from 4 (CUDA-core math, product and sum rounded apart). More rows run the tile
  // GEMM on the tensor cores (activation codes from prepare(); QUADS_GPU_FP8_TILES=0 keeps the
  // old path: W_eff dequantized into wdq for cuBLAS SGEMMs). Experts: the grouped GEMV up to
  // fp8_grouped_gemv_tokens tokens per step (QUADS_GPU_FP8_GROUPED_GEMV_TOKENS; it won at 2
  // tokens of 64 experts top-8 and lost at 4), grouped tiles past that, prefill included (no host
  // sync). wdq also holds W_eff for RAC's gathered columns.
  size_t w8_scratch = 0;
  DeviceArray<float> wdq;
  int64_t fp8_gemv_rows = 2;
  bool fp8_tiles = true;
  int64_t fp8_grouped_gemv_tokens = 2;
  DeviceQTensor xq8;  // FP8 activation codes and scales (rows set per use)
  cudaStream_t stream = nullptr;
  cudaEvent_t ev_begin = nullptr, ev_end = nullptr;  // a step's device time (stats.gpu_seconds)
  cublasHandle_t cublas = nullptr;
  std::unique_ptr<Blas> blas;
  GpuModelStats stats;

  // ReQAT's KV-cache transform (set_kv_transform): per layer a pre-RoPE factor and a post-RoPE key
  // shift (empty: none), and the row quantizer of K and V.
  std::vector<DeviceArray<float>> kv_factor, kv_shift;
  bool kv_quant = false;
  num::QConfig kv_qc;
  DeviceArray<float> kbuf, vbuf, kv_amax;

  // KV cache
  int slots = 0;
  int64_t max_len = 0;
  std::vector<int64_t> len;
  DeviceArray<float> kc, vc;  // [layers, slots, max_len, kvd]

  // Scratch (grow-only; one role each within a step)
  DeviceArray<float> x, xn, q, k, v, attn, tmp, rlogits, probs, w, xe, g, u, h, ye, xs, xf, logits, fop;
  DeviceArray<float> rbuf, gbuf;  // RAC: X_eff then the residual; the gathered residual blocks
  DeviceQTensor xrq;              // RAC: the quantized residual (W4A4 linears)
  DeviceArray<uint8_t> rf_codes, rf_scales;  // RAC folded: the dense residual operands
  DeviceArray<float> rf_amax;
  DeviceArray<int32_t> idx, perm, inv, argmax;
  DeviceArray<kern::SampleJobDev> sample_jobs;  // step_sample's draws
  DeviceArray<kern::SampleDrawDev> sample_out;
  DeviceArray<uint16_t> bop;
  DeviceArray<uint16_t> hbf;  // the BF16 experts' down operand in chains (mlp_chains)
  DeviceArray<uint16_t> xnb;     // BF16 copy of a norm's output (fused kernels), for the BF16 GEMM reading it
  DeviceArray<uint8_t> attn_ws;  // kern::attention_decode_fused's counters (zeroed once, left at zero)
  DeviceQTensor xq;  // W4A4 activation operand (rows set per use)
  // NVFP4 codes of a norm's output written by the norm kernel itself (kern::RowNvfp4): the operand
  // of the next layer's q/k/v or of this layer's experts (through the routing map), no quantize().
  DeviceArray<uint8_t> nq_codes, nq_scales;
  DeviceArray<float> nq_amax;
  // The input norm's rows (q/k/v) and o_proj's quantized input also as the skinny W4A4 tiles' FP16
  // operand (Nvfp4View::frag: decode batches of 3-64 rows, qkv_frag / oproj_frag), so those tiles
  // copy X instead of staging it. QUADS_GPU_XFRAG=0: codes only.
  DeviceArray<uint8_t> nq_frag;
  bool xfrag_on = true;
  int64_t xfrag_max_rows = kXFragMaxRows;  // QUADS_GPU_XFRAG_MAX_ROWS (A/B runs)

  // MoE on the device (default): routing by kern::moe_route, one grouped GEMM per projection per
  // layer, no host sync in a step. QUADS_GPU_MOE=legacy keeps the old path (expert ids to the
  // host, cpu::moe_permute, one GEMM per active expert); QUADS_GPU_GRAPHS=0 turns graphs off.
  bool legacy_moe = false, graphs_on = true, rac_grouped_on = true;
  // RAC's residual operand in one kernel (cuda::rac_quantize) where the formats allow; off
  // (QUADS_GPU_RAC_FUSED=0): fake_quantize, sub, gather, quantize (the same bits).
  bool rac_fused_on = true;
  // RAC folded into the main W4A4 GEMM at decode shapes (cuda::w4a4_gemm_rac: W read once for both
  // products); QUADS_GPU_RAC_FOLD=0 keeps the main GEMM followed by rac().
  bool rac_fold_on = true;
  int attn_tokens = 1;  // QUADS_GPU_ATTN_TOKENS: prefill attention tokens per CTA (kern::attention)
  bool attn_tiled = false;  // QUADS_GPU_ATTN=tiled: prefill through kern::attention_tiled
  // Decode attention: kern::attention_decode_split by default (keys split over CTAs, flash-decoding;
  // a batch-1 step otherwise ran 4 CTAs). QUADS_GPU_ATTN_DECODE=warp keeps kern::attention (the
  // CPU's summation order), =tiled kern::attention_tiled (its bits, K/V staged in shared memory).
  bool attn_tiled_decode = false, attn_split_decode = true;
  // Fused decode-step kernels (kern::rmsnorm_bf16, add_rmsnorm, moe_combine_add_rmsnorm,
  // qk_norm_rope_store_qkv, router_route, attention_decode_fused): fewer launches, the same bits.
  // QUADS_GPU_FUSED=0 (or QUADS_DECODE_KERNELS=old) runs the unfused sequence; QUADS_GPU_ATTN_FUSED=0
  // keeps the split + merge attention only.
  bool fused_on = true, attn_fused_on = true, norm_quant_on = true;
  bool device_sampling = true;  // step_sample draws on the device (QUADS_GPU_SAMPLE=host: on the host)
  // The router's logits from the post-attention norm kernel (decode batches behind a W4A4 o_proj,
  // whose GEMV updates the residual so the norm runs alone: kern::RowRouter) instead of a BF16
  // GEMM launch; QUADS_GPU_ROUTER_NORM=0 keeps the GEMM.
  bool router_norm_on = true;
  // Loads a decode step's kernels start before the PDL wait, where what they read was written
  // two or more kernels earlier (weights between steps, the cache rows of earlier positions, the
  // routing): the attention's first K/V tile, the router's weights in the post-attention norm,
  // the MoE combine's routing and the next norm's weights. QUADS_GPU_EARLY=0 waits first.
  bool early_on = true;
  // The experts' MLP of a decode batch in chains: chain i of c takes experts E * i / c ..
  // E * (i + 1) / c - 1 (W4A4: mapped gate/up, quantize_swiglu, down; BF16: gate/up, swiglu_bf16,
  // down) on a stream of its own, forked after the routing and joined before the combine, so that
  // a chain's down projection runs in the tail of the other chains' gate/up. Each launch is a
  // window of the whole call with its plan: the same bits. Chains 0 .. c - 2 run on side streams
  // at priority ranks 0 .. c - 2 from the highest (their CTAs are dispatched first;
  // QUADS_GPU_MOE_PRIO=0: all equal), the last chain on the step's stream, so that the combine
  // after it is a programmatic launch behind the chain that ends last (the other way round, chain
  // 0 on the step's stream at the highest priority: batch 16 / 32 / 64 0.6% / 1.4% / 2.2% slower).
  // moe_chains_for(T): 4 chains for 9-16 tokens, 2 for 17-64, none below or above (prefill);
  // QUADS_GPU_MOE_CHAINS=c forces c (1 = off). H200, peer model, nvfp4 decode tok/s, two rounds
  // each, chain 0 on the step's stream (docs/cuda.md Part 19): none / 2 / 4 chains at batch 4
  // 5377, 5369 / 5105, 5155 / 5216, 5214; 8 9082, 9084 / 9130, 9176 / 9098, 9044; 16 15582, 15520 /
  // 15735, 15777 / 16090, 16087; 32 23890, 23880 / 24709, 24721 / 24363, 24535; 64 40737, 40627 /
  // 41595, 41679 / 41409, 41466. bf16, the rule against off: +1.3% / +0.4% / +2.0% at 16 / 32 / 64.
  int moe_chains_env = 0;
  static constexpr int kMaxChains = 8;
  cudaStream_t side[kMaxChains - 1] = {};
  cudaEvent_t ev_fork = nullptr, ev_join[kMaxChains - 1] = {};
  int moe_chains_for(int64_t T) const {
    if (moe_chains_env > 0) return moe_chains_env;
    return T <= 8 || T > 64 ? 1 : T <= 16 ? 4 : 2;
  }
  // Prefills of fresh slots (every item from position 0, at least kGemmAttnTokens tokens): the
  // attention as FP32 SGEMMs in causal blocks of query rows, batched over the sequences
  // (AttentionTc::set_fp32: the CPU's arithmetic up to summation order, ~6x the one-warp-per-row
  // kernel at 16 x 1024 before the blocks); QUADS_GPU_ATTN=direct keeps kern::attention for every
  // prefill.
  bool attn_gemm_on = true;
  std::unique_ptr<AttentionTc> attn_gemm;
  static constexpr int64_t kGemmAttnTokens = 64;
  struct GroupedProj {  // one projection of all experts: a device table of their weights
    GpuLinearMode mode = GpuLinearMode::Fake;
    bool amax_row = false;             // W4A4: per-row weight amax
    DeviceArray<Nvfp4Weight> q;        // W4A4
    DeviceArray<const uint16_t*> b;    // BF16
    DeviceArray<const float*> f;       // fake-quant: W_eff
    DeviceArray<Fp8Weight> w8;         // FP8: codes and scales
    Fp8Layout g8;
  };
  // RAC of one projection of all experts, grouped: each expert's blocks (a row of `blocks`,
  // [E, cols / 16], padded with block 0) and their count; one residual format for all.
  struct GroupedRac {
    bool on = false;
    int64_t cols = 0;
    DeviceArray<int32_t> blocks, nsel;
    DeviceArray<uint8_t> sel;  // [E, in / 16]: 1 where expert e compensates a block (RAC folded)
    model::OperandQuant quant;
  };
  struct Grouped {
    bool ok = false;      // the layer's experts run as grouped GEMMs
    bool f32 = false;     // some projection uses an FP32 GEMV-style kernel (CUDA cores; fake-quant or FP8)
    bool bf16 = false;    // some projection uses the BF16 streaming tensor-core kernel
    GroupedProj gu, g, u, d;  // gu: the fused [2I, H] gate/up weights where the layer fuses them
    double expert_bytes = 0;  // weight bytes of one expert (gate + up + down), RAC's included
    double expert_rac_bytes = 0;  // RAC's share of them (the gather GEMMs read those blocks again)
    bool rac_ok = true;       // the experts' RAC (if any) runs grouped (else the per-expert path)
    GroupedRac rac[3];        // gate, up, down
  };
  std::vector<Grouped> grouped;  // per layer
  DeviceArray<int32_t> ecount, eoff_d, bad_d;
  DeviceArray<uint32_t> route_ticket;  // kern::router_route's last-CTA ticket (left at zero by every call)
  int32_t* bad_host = nullptr;  // pinned copy of bad_d, queued at the end of every step
  // Pinned staging of a step's inputs (tokens, slots, positions, rows, RoPE), two buffers used in
  // turn: a decode run writes the next step's while the copy of this one's may still wait in the
  // stream; ev_in[b] marks buffer b's last copy.
  uint8_t* in_host[2] = {nullptr, nullptr};
  size_t in_host_bytes[2] = {0, 0};
  cudaEvent_t ev_in[2] = {nullptr, nullptr};
  int in_turn = 0;
  DeviceArray<uint8_t> inbuf;   // their device copy; the tokens come first (offset 0)
  // A decode run's steps after its first: the tokens are already in inbuf (the previous step's
  // draws, kern::sample_rows' feed), and the step's device time started at the run's first step.
  bool fed_tokens = false;
  bool in_run = false;  // a decode run's step: the router's error flag is copied once, after the run
  // step(items, record): every MoE layer's [T, K] expert ids copied here ([layers][T][K]) as the
  // router writes them; such a step runs eagerly (a graph would replay into a fixed size).
  bool recording = false;
  DeviceArray<int32_t> rec_d;
  // step(items, ..., act_error): each linear's input against the operand it multiplies, per row on
  // the device (kern::row_error_sums into probe_sums), read after the step. probe_log: which rows of
  // probe_sums belong to which linear (q/k/v, and gate/up of row-local experts, share their rows).
  struct ProbeEntry {
    const DevLinear* L;
    size_t at;  // first row in probe_sums
    int64_t rows;
  };
  std::map<std::string, rollout::ActError>* probe_out = nullptr;
  std::vector<ProbeEntry> probe_log;
  size_t probe_used = 0;  // rows of probe_sums written this step
  DeviceArray<double> probe_sums;
  DeviceArray<float> probe_x;
  // rac_energy(items, energy): static RAC's calibration pass. Each linear with quantized activations
  // adds its residual energy per input channel into energy_d from energy_at[i] on (SIZE_MAX: none),
  // starting from the caller's sums, so the rows add up in the CPU forward's order over the chunks.
  std::map<std::string, std::vector<double>>* energy_out = nullptr;
  std::vector<size_t> energy_at;
  DeviceArray<double> energy_d;
  DeviceArray<unsigned long long> active_d;  // per layer: experts with rows, summed over steps
  // the same for the steps whose experts ran with RAC folded (their RAC blocks are not read again)
  DeviceArray<unsigned long long> active_fold_d;
  std::vector<int32_t> heoff;
  DeviceArray<uint8_t> cublas_ws;
  GpuModelStats stats_out;

  // CUDA graphs of decode steps, keyed by (tokens, logits rows, attention context bucket).
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    size_t gen = 0;
    double weight_bytes = 0;
    int64_t expert_gemms = 0;
  };
  std::map<std::tuple<int64_t, int64_t, int64_t>, Graph> graphs;
  std::set<std::tuple<int64_t, int64_t, int64_t>> seen;
  bool graph_failed = false;

  Impl(const model::ModelConfig& c, const model::PrecisionConfig& p) : cfg(c), prec(p) {
    cfg.validate("GpuModel config");
    QUADS_CHECK(device_count() > 0, "GpuModel: no CUDA device");
    lay = model::Layout::build(cfg);
    QUADS_CUBLAS_CHECK(cublasCreate(&cublas));
    QUADS_CUBLAS_CHECK(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));  // no TF32: FP32 GEMMs stay FP32
    // A workspace of our own: cuBLAS must not allocate while a graph is being captured.
    cublas_ws.resize(size_t(32) << 20);
    QUADS_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_ws.data(), cublas_ws.bytes()));
    // A stream of our own (graphs cannot capture the legacy default stream); a blocking one, so
    // synchronous copies on the default stream still wait for it.
    QUADS_CUDA_CHECK(cudaStreamCreate(&stream));
    keep_pool_memory();
    QUADS_CUDA_CHECK(cudaEventCreate(&ev_begin));
    QUADS_CUDA_CHECK(cudaEventCreate(&ev_end));
    for (cudaEvent_t& e : ev_in) QUADS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    legacy_moe = env_is("QUADS_GPU_MOE", "legacy");
    graphs_on = !env_is("QUADS_GPU_GRAPHS", "0");
    rac_grouped_on = !env_is("QUADS_GPU_RAC_GROUPED", "0");
    rac_fused_on = !env_is("QUADS_GPU_RAC_FUSED", "0");
    rac_fold_on = !env_is("QUADS_GPU_RAC_FOLD", "0");
    if (const char* a = std::getenv("QUADS_GPU_ATTN_TOKENS")) attn_tokens = std::max(1, std::atoi(a));
    if (const char* a = std::getenv("QUADS_GPU_FP8_GEMV_ROWS")) fp8_gemv_rows = std::max(0, std::atoi(a));
    fp8_tiles = !env_is("QUADS_GPU_FP8_TILES", "0");
    if (const char* a = std::getenv("QUADS_GPU_FP8_GROUPED_GEMV_TOKENS"))
      fp8_grouped_gemv_tokens = std::max(0, std::atoi(a));
    attn_tiled = env_is("QUADS_GPU_ATTN", "tiled");
    attn_tiled_decode = env_is("QUADS_GPU_ATTN_DECODE", "tiled");
    attn_split_decode = !attn_tiled_decode && !env_is("QUADS_GPU_ATTN_DECODE", "warp");
    attn_gemm_on = !attn_tiled && !env_is("QUADS_GPU_ATTN", "direct");
    fused_on = !env_is("QUADS_GPU_FUSED", "0");
    attn_fused_on = !env_is("QUADS_GPU_ATTN_FUSED", "0");
    norm_quant_on = !env_is("QUADS_GPU_NORM_QUANT", "0");
    xfrag_on = !env_is("QUADS_GPU_XFRAG", "0");
    if (const char* e = std::getenv("QUADS_GPU_XFRAG_MAX_ROWS"))
      xfrag_max_rows = std::clamp<int64_t>(std::atoll(e), 0, kXFragMaxRows);
    device_sampling = !env_is("QUADS_GPU_SAMPLE", "host");
    router_norm_on = !env_is("QUADS_GPU_ROUTER_NORM", "0");
    early_on = !env_is("QUADS_GPU_EARLY", "0");
    if (const char* a = std::getenv("QUADS_GPU_MOE_CHAINS")) moe_chains_env = std::clamp(std::atoi(a), 0, kMaxChains);
    {
      const int chains = std::max(moe_chains_env, 4);  // the most moe_chains_for can ask for
      int least = 0, greatest = 0;
      QUADS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      const bool prio = !env_is("QUADS_GPU_MOE_PRIO", "0");
      auto rank = [&](int i) { return prio ? std::min(least, greatest + i) : least; };  // greatest < least
      for (int i = 0; i + 1 < chains; ++i) {
        QUADS_CUDA_CHECK(cudaStreamCreateWithPriority(&side[i], cudaStreamDefault, rank(i)));
        QUADS_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join[i], cudaEventDisableTiming));
      }
      QUADS_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming));
    }
    if (attn_gemm_on) {  // now, not in the first prefill: creating its cuBLAS handle takes ~0.1 s
      attn_gemm = std::make_unique<AttentionTc>();
      attn_gemm->set_fp32(true);
    }
    blas = std::make_unique<Blas>();
    build_linears();
    master.resize(lay.total);
    build_grouped();
    const int E = std::max(cfg.num_experts, 1);
    ecount.resize(E);
    eoff_d.resize(E + 1);
    bad_d.resize(1);
    bad_d.fill_bytes(0);
    route_ticket.resize(1);
    route_ticket.fill_bytes(0);
    QUADS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&bad_host), sizeof(int32_t), cudaHostAllocDefault));
    *bad_host = 0;
    active_d.resize(std::max(cfg.num_hidden_layers, 1));
    active_d.fill_bytes(0);
    active_fold_d.resize(std::max(cfg.num_hidden_layers, 1));
    active_fold_d.fill_bytes(0);
  }
  ~Impl() {
    clear_graphs();
    if (cublas) cublasDestroy(cublas);
    if (stream) cudaStreamDestroy(stream);
    for (cudaStream_t x : side)
      if (x) cudaStreamDestroy(x);
    for (cudaEvent_t x : ev_join)
      if (x) cudaEventDestroy(x);
    if (ev_fork) cudaEventDestroy(ev_fork);
    if (ev_begin) cudaEventDestroy(ev_begin);
    if (ev_end) cudaEventDestroy(ev_end);
    if (bad_host) cudaFreeHost(bad_host);
    for (int b = 0; b < 2; ++b) {
      if (ev_in[b]) cudaEventDestroy(ev_in[b]);
      if (in_host[b]) cudaFreeHost(in_host[b]);
    }
  }

  void clear_graphs() {
    for (auto& kv : graphs)
      if (kv.second.exec) cudaGraphExecDestroy(kv.second.exec);
    graphs.clear();
    seen.clear();
  }

  // Device tables of the expert weights for the grouped GEMMs, for every sparse layer whose
  // experts share their numerics, with per-token activation quantizers (one operand for all rows).
  void build_grouped() {
    grouped.clear();
    grouped.resize(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerIdx& li = layers[l];
      Grouped& G = grouped[l];
      if (!li.sparse) continue;
      const DevLinear &G0 = lin[li.mlp], &D0 = lin[li.mlp + 2];
      bool ok = li.experts_uniform && G0.num.act.row_local() && D0.num.act.row_local();
      for (int j = 0; j < 3; ++j) {
        const DevLinear& b = lin[li.mlp + j];
        if (b.mode != GpuLinearMode::W4A4) ok &= b.in % 8 == 0;
        for (int e = 0; e < li.nexperts && ok; ++e) {
          const DevLinear& a = lin[li.mlp + 3 * e + j];
          ok &= a.mode == b.mode && a.out == b.out && a.in == b.in;
          if (b.mode == GpuLinearMode::W4A4) ok &= a.wv.amax_per_row == b.wv.amax_per_row;
          if (b.mode == GpuLinearMode::FP8) ok &= a.num.weight == b.num.weight;  // one layout for the table
        }
      }
      if (!ok) continue;
      G.ok = true;
      G.expert_bytes = G0.bytes() + lin[li.mlp + 1].bytes() + D0.bytes();
      auto ent = [](const Nvfp4View& v) {
        Nvfp4Weight w;
        w.codes = v.codes;
        w.scales = v.scales;
        w.amax = v.amax;
        return w;
      };
      auto table = [&](GroupedProj& P, int j) {
        const DevLinear& b = lin[li.mlp + j];
        P.mode = b.mode;
        P.amax_row = b.mode == GpuLinearMode::W4A4 && b.wv.amax_per_row;
        // FP8 experts past the GEMV run tiles when their activations come as codes
        G.f32 |= b.mode == GpuLinearMode::Fake ||
                 (b.mode == GpuLinearMode::FP8 && !(fp8_tiles && fp8_act_codes(b.num.act, b.in)));
        P.g8 = b.g8;
        G.bf16 |= b.mode == GpuLinearMode::BF16;
        std::vector<Nvfp4Weight> q;
        std::vector<const uint16_t*> bb;
        std::vector<const float*> f;
        std::vector<Fp8Weight> w8;
        for (int e = 0; e < li.nexperts; ++e) {
          const DevLinear& a = lin[li.mlp + 3 * e + j];
          if (b.mode == GpuLinearMode::W4A4) q.push_back(ent(a.wv));
          if (b.mode == GpuLinearMode::BF16) bb.push_back(a.wb.data());
          if (b.mode == GpuLinearMode::Fake) f.push_back(a.wf.data());
          if (b.mode == GpuLinearMode::FP8) w8.push_back(a.w8);
        }
        if (!q.empty()) P.q.upload(q);
        if (!bb.empty()) P.b.upload(bb);
        if (!f.empty()) P.f.upload(f);
        if (!w8.empty()) P.w8.upload(w8);
      };
      table(G.g, 0);
      table(G.u, 1);
      table(G.d, 2);
      if (li.fused_gu) {  // BF16 or W4A4 with a per-row amax (see setup_fused_gu)
        G.gu.mode = G0.mode;
        G.gu.amax_row = true;
        std::vector<Nvfp4Weight> q;
        std::vector<const uint16_t*> bb;
        for (int e = 0; e < li.nexperts; ++e) {
          const DevLinear& Ge = lin[li.mlp + 3 * e];
          if (G0.mode == GpuLinearMode::W4A4) q.push_back(ent(Ge.gu_v));
          else bb.push_back(Ge.gu_b.data());
        }
        if (!q.empty()) G.gu.q.upload(q);
        if (!bb.empty()) G.gu.b.upload(bb);
      }
    }
  }

  // Longer prefills run their experts through cuBLAS, one GEMM per expert (host sync, and cuBLAS's
  // heuristics for every new row count). The FP32 grouped kernel is a GEMV on CUDA cores; the BF16
  // one streams each weight row once per 16 activation rows (re-reads come from L2).
  static constexpr int64_t kF32GroupedMaxTokens = 256, kBf16GroupedMaxTokens = 8192;

  // The layer's experts run grouped in this step (RAC on an expert needs the per-expert path).
  bool grouped_now(int l, int64_t T) const {
    if (legacy_moe || !grouped[l].ok || !grouped[l].rac_ok) return false;
    if (grouped[l].f32 && T > kF32GroupedMaxTokens) return false;
    if (grouped[l].bf16 && T > kBf16GroupedMaxTokens) return false;
    return true;
  }

  // After RAC changed: the grouped tables of the experts' RAC. Grouped RAC needs W4A4 experts
  // with one residual format (the per-expert path takes the rest, and QUADS_GPU_RAC_GROUPED=0
  // forces it, for tests).
  void build_grouped_rac() {
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerIdx& li = layers[l];
      Grouped& G = grouped[l];
      if (!li.sparse || !G.ok) continue;
      G.rac_ok = true;
      G.expert_bytes = lin[li.mlp].bytes() + lin[li.mlp + 1].bytes() + lin[li.mlp + 2].bytes();
      G.expert_rac_bytes = 0;
      for (int j = 0; j < 3; ++j) {
        GroupedRac& R = G.rac[j];
        R = GroupedRac{};
        const DevLinear& b = lin[li.mlp + j];
        bool any = false, ok = b.mode == GpuLinearMode::W4A4 && rac_grouped_on;
        const model::OperandQuant* q = nullptr;
        for (int e = 0; e < li.nexperts; ++e) {
          const DevLinear& a = lin[li.mlp + 3 * e + j];
          if (a.rac_nsel == 0) continue;
          any = true;
          if (q && !(*q == a.rac_quant)) ok = false;
          q = &a.rac_quant;
          R.cols = std::max(R.cols, a.rac_cols);
        }
        if (!any) continue;
        if (!ok) {
          G.rac_ok = false;
          continue;
        }
        R.on = true;
        R.quant = *q;
        const int64_t nb = R.cols / 16;
        std::vector<int32_t> blocks(size_t(li.nexperts * nb), 0), nsel(size_t(li.nexperts), 0);
        double rac_bytes = 0;
        for (int e = 0; e < li.nexperts; ++e) {
          const DevLinear& a = lin[li.mlp + 3 * e + j];
          nsel[e] = static_cast<int32_t>(a.rac_nsel);
          for (int64_t i = 0; i < a.rac_nsel; ++i) blocks[size_t(e * nb + i)] = a.rac_blocks_host[size_t(i)];
          rac_bytes += a.rac_bytes();
        }
        R.blocks.upload(blocks);
        R.nsel.upload(nsel);
        const int64_t kb = b.in / 16;
        std::vector<uint8_t> sel(size_t(li.nexperts * kb), 0);
        for (int e = 0; e < li.nexperts; ++e) {
          const DevLinear& a = lin[li.mlp + 3 * e + j];
          for (int64_t i = 0; i < a.rac_nsel; ++i) sel[size_t(e * kb + a.rac_blocks_host[size_t(i)])] = 1;
        }
        R.sel.upload(sel);
        G.expert_bytes += rac_bytes / li.nexperts;
        G.expert_rac_bytes += rac_bytes / li.nexperts;
      }
    }
  }

  // Grouped RAC of projection j (0 gate, 1 up, 2 down) over the R expert-ordered rows X: y (row
  // stride ldy) += the quantized residual of each row's expert's blocks times those weight
  // blocks. `resid`: X - X_eff when the caller has it already (gate and up share their input).
  const float* grouped_rac(int l, int j, const float* X, int64_t R, int64_t T, float* y, int64_t ldy,
                           const float* resid = nullptr) {
    const LayerIdx& li = layers[l];
    const Grouped& Gt = grouped[l];
    const GroupedRac& gr = Gt.rac[j];
    if (!gr.on || R == 0) return resid;
    const DevLinear& L0 = lin[li.mlp + j];  // experts_uniform: every expert's shape and numerics
    const int64_t in = L0.in, cols = gr.cols;
    const GroupedProj& P = j == 0 ? Gt.g : j == 1 ? Gt.u : Gt.d;
    if (rac_fused_on && rac_quantize_supported(L0.act_cfg(), gr.quant.cfg)) {
      rac_xrq(R, cols, gr.quant.cfg);
      rac_quantize(X, in, L0.act_cfg(), gr.blocks.data(), cols / 16, 0, gr.nsel.data(), eoff_d.data(), li.nexperts,
                   xrq, stream);
      w4a4_gemm_grouped_gather(nvfp4_view(xrq, L0.name.c_str()), P.q.data(), P.amax_row, L0.out, in, li.nexperts,
                               eoff_d.data(), T, gr.blocks.data(), y, ldy, stream);
      return resid;
    }
    if (!resid) resid = rac_residual(L0, X, R);
    float* gb = grow(gbuf, size_t(R * cols));
    gather_blocks_grouped(resid, R, in, gr.blocks.data(), gr.nsel.data(), cols, eoff_d.data(), li.nexperts, gb,
                          stream);
    quantize_rac(gb, R, cols, gr.quant.cfg);
    w4a4_gemm_grouped_gather(nvfp4_view(xrq, L0.name.c_str()), P.q.data(), P.amax_row, L0.out, in, li.nexperts,
                             eoff_d.data(), T, gr.blocks.data(), y, ldy, stream);
    return resid;
  }

  // The W4A4 GEMV with the activation quantizer in its prologue (w4a4_gemv_fused): for a linear in
  // W4A4 whose activation rounding the fused quantizer reproduces, at rows per weight (a dense
  // call's rows, a grouped call's token count) where it pays (kGemvFusedMaxRows). RAC, if any,
  // runs after it from the unquantized rows (rac()).
  bool fused_gemv(const DevLinear& L, int64_t rows_per_weight) const {
    return fused_on && !kern::legacy_decode_kernels() && L.mode == GpuLinearMode::W4A4 &&
           w4a4_gemv_fused_supported(L.act_cfg(), L.in, rows_per_weight);
  }
  static FusedAct fused_act(const float* x, int64_t ld, int64_t rows, const DevLinear& L, bool dense) {
    FusedAct a;
    a.x = x;
    a.ld = ld;
    a.rows = rows;
    a.k = L.in;
    a.cfg = L.act_cfg();
    a.weights_ready = dense;  // in a step no kernel writes weights (requantize() runs between steps)
    return a;
  }
  // A fused norm can quantize its output for linear L (read by a W4A4 GEMM of T rows): the
  // activation quantizer is NVFP4 E2M1 1x16 with a per-row amax, deterministic, and a row fits the
  // norm kernel. At batch 1 the plain GEMV on those codes then replaces the GEMV that quantizes in
  // its prologue (every CTA quantized the row again). QUADS_GPU_NORM_QUANT=0 turns it off
  // (quantize() launches, the gather, and the quantizing GEMV at batch 1).
  bool norm_quant_ok(const DevLinear& L, int64_t /*T*/) const {
    if (!norm_quant_on || !fused_on || kern::legacy_decode_kernels() || L.mode != GpuLinearMode::W4A4 ||
        L.rac_nsel != 0)
      return false;
    const num::QConfig& c = L.act_cfg();
    return c.scheme == num::Scheme::NVFP4 && c.element == num::Format::E2M1 && c.block == num::Block::B1x16 &&
           c.global == num::Global::PerRow && !c.stochastic && L.in % 64 == 0 && L.in <= 16 * 256;
  }
  // Layer l's q/k/v read the codes its input norm wrote.
  bool qkv_norm_quant(int l, int64_t T) const {
    const LayerIdx& li = layers[l];
    return li.fused_qkv && lin[li.q].rac_nsel == 0 && lin[li.k].rac_nsel == 0 && lin[li.v].rac_nsel == 0 &&
           norm_quant_ok(lin[li.q], T);
  }
  // Sparse layer l's gate/up reads the codes of the post-attention norm's T rows through the
  // routing map (w4a4_gemm_grouped_mapped: no gather, T rows quantized instead of T * k).
  bool moe_mapped(int l, int64_t T) const {
    const LayerIdx& li = layers[l];
    return li.sparse && grouped_now(l, T) && li.fused_gu && !grouped[l].rac[0].on && !grouped[l].rac[1].on &&
           grouped[l].gu.mode == GpuLinearMode::W4A4 && norm_quant_ok(lin[li.mlp], T) &&
           w4a4_grouped_mapped_supported(T, cfg.hidden_size);
  }
  kern::RowNvfp4 nq_out() { return {nq_codes.data(), nq_scales.data(), nq_amax.data()}; }
  // q/k/v's X of T rows as FP16 fragments too: the skinny tiles' calls of 3-64 rows (fewer: the
  // GEMV), K a multiple of 128. H200 (docs/cuda.md Parts 27, 28): the q/k/v call at 16 rows 8.2 -> ~6 us.
  bool frag_rows(int64_t T) const { return T > gemv_auto_max_rows(true) && T <= xfrag_max_rows; }
  bool qkv_frag(int64_t T) const { return xfrag_on && frag_rows(T) && cfg.hidden_size % 128 == 0; }
  bool oproj_frag(const DevLinear& L, int64_t T) const {
    const num::QConfig& c = L.act_cfg();
    return xfrag_on && frag_rows(T) && L.in % 128 == 0 && L.mode == GpuLinearMode::W4A4 && L.rac_nsel == 0 &&
           c.scheme == num::Scheme::NVFP4 && c.element == num::Format::E2M1 && c.block == num::Block::B1x16 &&
           !kern::legacy_decode_kernels();
  }
  kern::RowNvfp4 nq_out_qkv(int64_t T) {
    kern::RowNvfp4 q = nq_out();
    if (qkv_frag(T)) q.frag = nq_frag.data();
    return q;
  }
  Nvfp4View nq_view(int64_t rows, int64_t k) const {
    Nvfp4View v;
    v.codes = nq_codes.data();
    v.scales = nq_scales.data();
    v.amax = nq_amax.data();
    v.amax_per_row = true;
    v.rows = rows;
    v.k = k;
    return v;
  }

  // Sparse layer l's gate/up reads the normed rows through the routing permutation (no gathered
  // copy): W4A4 experts, gate and up fused, no grouped RAC.
  bool moe_gate_up_fused(int l, int64_t T) const {
    const LayerIdx& li = layers[l];
    return li.fused_gu && !grouped[l].rac[0].on && !grouped[l].rac[1].on && fused_gemv(lin[li.mlp], T) &&
           grouped[l].gu.mode == GpuLinearMode::W4A4;
  }

  // The MLP of sparse layer l over the R = T * k rows X in expert order (eoff_d on the device):
  // one GEMM launch per projection. Same operands and per-row rounding as mlp(); each expert's
  // rows come out as a per-expert GEMM's (the W4A4 kernel without split K, BF16/FP32 our own sum).
  // xn (moe_gate_up_fused): X is not gathered; row r is xn's row perm[r] / k.
  // mapped (moe_mapped): gate/up reads nq's T rows through perm / k.
  void mlp_grouped(int l, int64_t T, const float* X, int64_t R, float* Y, const float* xn = nullptr,
                   bool mapped = false) {
    const LayerIdx& li = layers[l];
    const Grouped& Gt = grouped[l];
    const int E = li.nexperts;
    const int64_t H = cfg.hidden_size, I = li.inter;
    float* gp = grow(g, size_t(R * 2 * I));
    float* up = grow(u, size_t(R * I));
    float* hp = grow(h, size_t(R * I));
    const int32_t* eo = eoff_d.data();
    auto run = [&](const GroupedProj& P, const Operand& op, int64_t N, int64_t Kd, float* out) {
      switch (P.mode) {
        case GpuLinearMode::W4A4: w4a4_gemm_grouped(op.v, P.q.data(), P.amax_row, N, E, eo, T, out, stream); break;
        case GpuLinearMode::BF16: kern::gemm_bf16_grouped(op.b, P.b.data(), N, Kd, E, eo, out, stream); break;
        case GpuLinearMode::Fake: kern::gemm_f32_grouped(op.f, P.f.data(), N, Kd, E, eo, out, stream); break;
        case GpuLinearMode::FP8:
          QUADS_CHECK(P.g8.n == N && P.g8.k == Kd, "GpuModel: FP8 expert table of layer {} is [{}, {}], not [{}, {}]", l,
                      P.g8.n, P.g8.k, N, Kd);
          if (op.a8.codes)
            fp8_gemm_grouped(op.a8, P.w8.data(), P.g8, E, eo, T, out, stream);
          else
            fp8_gemv_grouped(op.f, P.w8.data(), P.g8, E, eo, T, out, stream);
          break;
      }
      stats.expert_gemms += 1;
    };
    const int need_f = T <= fp8_grouped_gemv_tokens ? 1 : 0;  // FP8: X_eff for the grouped GEMV
    if (xn) {
      FusedAct a = fused_act(xn, H, R, lin[li.mlp], false);
      a.map = perm.data();
      a.map_div = cfg.num_experts_per_tok;
      w4a4_gemv_fused_grouped(a, Gt.gu.q.data(), Gt.gu.amax_row, 2 * I, E, eo, T, gp, stream);
      stats.expert_gemms += 1;
    }
    const DevLinear& D0 = lin[li.mlp + 2];
    const bool down_fused = !Gt.rac[2].on && fused_gemv(D0, T) && Gt.d.mode == GpuLinearMode::W4A4;
    // the SwiGLU inside the down projection's quantizer (one kernel, quantize_swiglu), where the
    // GEMV does not fuse it; QUADS_GPU_NORM_QUANT=0 keeps kern::swiglu + quantize()
    const bool swiglu_q = !down_fused && !Gt.rac[2].on && Gt.d.mode == GpuLinearMode::W4A4 && norm_quant_on &&
                          fused_on && !kern::legacy_decode_kernels() && quantize_swiglu_supported(D0.act_cfg());
    if (mapped && swiglu_q && li.fused_gu && moe_chains_for(T) > 1 && E >= moe_chains_for(T)) {
      mlp_chains(l, T, R, Y, moe_chains_for(T));
      return;
    }
    if (mapped) {
      w4a4_gemm_grouped_mapped(nq_view(T, H), perm.data(), cfg.num_experts_per_tok, R, Gt.gu.q.data(), Gt.gu.amax_row,
                               2 * I, E, eo, T, gp, stream);
      stats.expert_gemms += 1;
    }
    if (!xn && !mapped && li.fused_gu && Gt.gu.mode == GpuLinearMode::BF16 && Gt.d.mode == GpuLinearMode::BF16 &&
        !Gt.rac[0].on && !Gt.rac[1].on && !Gt.rac[2].on && moe_chains_for(T) > 1 && E >= moe_chains_for(T)) {
      mlp_chains(l, T, R, Y, moe_chains_for(T), prepare(lin[li.mlp], X, R, need_f).b);
      return;
    }
    if (li.fused_gu) {
      if (!xn && !mapped) {
        const Operand all = prepare(lin[li.mlp], X, R, need_f);
        run(Gt.gu, all, 2 * I, H, gp);
        const float* res = grouped_rac(l, 0, X, R, T, gp, 2 * I);
        grouped_rac(l, 1, X, R, T, gp + I, 2 * I, res);
      }
      if (!down_fused && !swiglu_q) kern::swiglu(gp, gp + I, 2 * I, R, I, hp, stream);
    } else {
      QUADS_CHECK(!xn, "GpuModel: layer {}: the fused gate/up GEMV needs fused gate/up weights", l);
      const Operand all = prepare(lin[li.mlp], X, R, need_f);
      run(Gt.g, all, I, H, gp);
      run(Gt.u, all, I, H, up);
      const float* res = grouped_rac(l, 0, X, R, T, gp, I);
      grouped_rac(l, 1, X, R, T, up, I, res);
      if (!down_fused && !swiglu_q) kern::swiglu(gp, up, I, R, I, hp, stream);
    }
    if (down_fused) {  // SwiGLU and the quantizer in the down GEMV's prologue
      FusedAct a = fused_act(gp, li.fused_gu ? 2 * I : I, R, D0, false);
      a.u = li.fused_gu ? gp + I : up;
      w4a4_gemv_fused_grouped(a, Gt.d.q.data(), Gt.d.amax_row, H, E, eo, T, Y, stream);
      stats.expert_gemms += 1;
      return;
    }
    if (swiglu_q) {
      shape_xq(D0, R, I);
      quantize_swiglu(gp, li.fused_gu ? gp + I : up, li.fused_gu ? 2 * I : I, xq, stream);
      Operand od;
      od.mode = D0.mode;
      od.rows = R;
      od.k = I;
      od.v = nvfp4_view(xq, D0.name.c_str());
      run(Gt.d, od, H, I, Y);
      return;
    }
    const Operand od = prepare(D0, hp, R, need_f);
    run(Gt.d, od, H, I, Y);
    grouped_rac(l, 2, hp, R, T, Y, H);
  }

  // xq shaped for rows x cols NVFP4 codes of linear L's activation operand (row-major scales)
  void shape_xq(const DevLinear& L, int64_t R, int64_t I) {
    QUADS_CHECK(L.act_cfg().global != num::Global::Static || L.act_cfg().static_amax > 0,
                "GpuModel: {} uses a static activation scale but none is set (calibrate it first)", L.name);
    xq.cfg = L.act_cfg();
    xq.rows = R;
    xq.cols = I;
    xq.layout = ScaleLayout::RowMajor;
    grow(xq.codes, size_t(R * I / 2));
    grow(xq.scales, size_t(R * I / 16));
    grow(xq.amax, size_t(std::max<int64_t>(R, 1)));
  }

  // mlp_grouped's experts in C chains, one a stream (see moe_chains_for): W4A4 (xb null) the mapped
  // gate/up, quantize_swiglu and down; BF16 the gate/up on xb (X's BF16 rows in expert order),
  // swiglu_bf16 and down. Every launch is a window of the whole call's groups with its plan, so
  // each row gets the bits of the one-chain path.
  void mlp_chains(int l, int64_t T, int64_t R, float* Y, int C, const uint16_t* xb = nullptr) {
    const LayerIdx& li = layers[l];
    const Grouped& Gt = grouped[l];
    const int E = li.nexperts;
    const int64_t H = cfg.hidden_size, I = li.inter;
    float* gp = g.data();
    const int32_t* eo = eoff_d.data();
    const DevLinear& D0 = lin[li.mlp + 2];
    Nvfp4View xd;
    if (!xb) {
      shape_xq(D0, R, I);
      xd = nvfp4_view(xq, D0.name.c_str());
    }
    QUADS_CUDA_CHECK(cudaEventRecord(ev_fork, stream));
    for (int c = 0; c < C - 1; ++c) QUADS_CUDA_CHECK(cudaStreamWaitEvent(side[c], ev_fork, 0));
    auto st = [&](int c) { return c == C - 1 ? stream : side[c]; };
    auto gb = [&](int c) { return E * c / C; };
    for (int c = 0; c < C; ++c) {
      const int n = gb(c + 1) - gb(c);
      if (xb)
        kern::gemm_bf16_grouped(xb, Gt.gu.b.data() + gb(c), 2 * I, H, n, eo + gb(c), gp, st(c));
      else
        w4a4_gemm_grouped_mapped(nq_view(T, H), perm.data(), cfg.num_experts_per_tok, R, Gt.gu.q.data() + gb(c),
                                 Gt.gu.amax_row, 2 * I, n, eo + gb(c), T, gp, st(c), E);
    }
    for (int c = 0; c < C; ++c) {
      const int n = gb(c + 1) - gb(c);
      if (xb) {
        kern::swiglu_bf16(gp, gp + I, 2 * I, R, I, hbf.data(), st(c), eo + gb(c), eo + gb(c + 1));
        kern::gemm_bf16_grouped(hbf.data(), Gt.d.b.data() + gb(c), H, I, n, eo + gb(c), Y, st(c));
      } else {
        quantize_swiglu(gp, gp + I, 2 * I, xq, st(c), eo + gb(c), eo + gb(c + 1));
        w4a4_gemm_grouped(xd, Gt.d.q.data() + gb(c), Gt.d.amax_row, H, n, eo + gb(c), T, Y, st(c), 0, W4A4Tile::Auto,
                          E);
      }
    }
    stats.expert_gemms += 2 * C;
    for (int c = 0; c < C - 1; ++c) {
      QUADS_CUDA_CHECK(cudaEventRecord(ev_join[c], side[c]));
      QUADS_CUDA_CHECK(cudaStreamWaitEvent(stream, ev_join[c], 0));
    }
  }

  // Raises a router error recorded by kern::moe_route. `copied`: the step's queued copy into
  // bad_host has completed (the caller synchronized after run()); else copy now.
  void check_route(bool copied) {
    if (legacy_moe || cfg.num_experts == 0) return;
    if (!copied) QUADS_CUDA_CHECK(cudaMemcpy(bad_host, bad_d.data(), sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (*bad_host) {
      *bad_host = 0;
      bad_d.fill_bytes(0);
      fail("GpuModel: a router chose an expert outside 0..{} (NaN logits?)", cfg.num_experts - 1);
    }
  }
  // A step's device time, from its input copy to its last kernel (mark_end, queued before the
  // results' copy), added once the copy has synchronized: the benchmark's "device busy" share.
  void mark_end() { QUADS_CUDA_CHECK(cudaEventRecord(ev_end, stream)); }
  void add_gpu_time(bool ran) {
    if (!ran) return;
    QUADS_CUDA_CHECK(cudaEventSynchronize(ev_end));
    float ms = 0;
    if (cudaEventElapsedTime(&ms, ev_begin, ev_end) == cudaSuccess) stats.gpu_seconds += ms * 1e-3;
  }

  // Draws on the device (step_sample, decode_run): every job greedy or temperature-only.
  bool device_draws(const std::vector<rollout::SampleJob>& jobs) const {
    bool on = device_sampling;
    for (const rollout::SampleJob& j : jobs) on = on && rollout::device_samplable(j.params, cfg.vocab_size);
    return on;
  }
  // The jobs of `steps` decode steps (step k: position pos + k, job i at k * jobs + i) into
  // sample_jobs, queued on the stream; sample_out sized for their draws.
  void upload_sample_jobs(const std::vector<rollout::SampleJob>& jobs, int steps) {
    const size_t J = jobs.size();
    std::vector<kern::SampleJobDev> dj(size_t(steps) * J);
    for (int k = 0; k < steps; ++k)
      for (size_t i = 0; i < J; ++i) {
        const rollout::SampleJob& j = jobs[i];
        dj[k * J + i] = {j.row, j.params.temperature, j.seed, j.pos + k, j.params.is_greedy() ? 1 : 0};
      }
    grow(sample_jobs, dj.size());
    grow(sample_out, dj.size());
    QUADS_CUDA_CHECK(cudaMemcpyAsync(sample_jobs.data(), dj.data(), sizeof(kern::SampleJobDev) * dj.size(),
                                     cudaMemcpyHostToDevice, stream));
  }
  // sample_out's first `count` draws (waits for the stream).
  std::vector<kern::SampleDrawDev> download_draws(size_t count) {
    std::vector<kern::SampleDrawDev> got(count);
    if (count > 0)
      QUADS_CUDA_CHECK(cudaMemcpy(got.data(), sample_out.data(), sizeof(kern::SampleDrawDev) * count,
                                  cudaMemcpyDeviceToHost));
    return got;
  }
  // The draws of upload_sample_jobs' order as rollout's, each checked for finite logits.
  static std::vector<rollout::Draw> to_draws(const std::vector<kern::SampleDrawDev>& got,
                                             const std::vector<rollout::SampleJob>& jobs) {
    std::vector<rollout::Draw> draws(got.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const rollout::SampleJob& j = jobs[i % jobs.size()];
      QUADS_CHECK(got[i].ok, "rollout: request {}: sample: the logits at position {} are not finite (max {}, sum of "
                  "exponentials {})", j.request, j.pos + i / jobs.size(), got[i].fmax, got[i].sum);
      draws[i].token = got[i].token;
      draws[i].logprob = got[i].logprob;
    }
    return draws;
  }

  void queue_route_flag() {
    if (legacy_moe || cfg.num_experts == 0) return;
    QUADS_CUDA_CHECK(cudaMemcpyAsync(bad_host, bad_d.data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  }

  int add(const std::string& name, int layer, int64_t out, int64_t in, size_t off) {
    DevLinear L;
    L.name = name;
    L.layer = layer;
    L.out = out;
    L.in = in;
    L.offset = off;
    L.num = prec.for_linear(name, layer, cfg.num_hidden_layers);
    QUADS_CHECK(!(L.num.act.kind == QuantKind::Quant && L.num.act.cfg.stochastic),
                "GpuModel: {} quantizes its activations with stochastic rounding (not a rollout setting)", name);
    if (L.num.weight.kind == QuantKind::Quant) num::check_config(L.num.weight.cfg, out, in, name + ".weight");
    if (L.num.act.kind == QuantKind::Quant) num::check_config(L.num.act.cfg, 1, in, name + " input");
    L.mode = choose_mode(L.num, in);
    switch (L.mode) {
      case GpuLinearMode::BF16: L.wb.resize(size_t(out) * in); break;
      case GpuLinearMode::W4A4:
        L.wq = make_qtensor(out, in, L.num.weight.cfg);
        L.wv = nvfp4_view(L.wq, name.c_str());
        break;
      case GpuLinearMode::Fake: L.wf.resize(size_t(out) * in); break;
      case GpuLinearMode::FP8:
        L.wq = make_qtensor(out, in, L.num.weight.cfg);
        L.w8 = fp8_weight(L.wq, name.c_str());
        L.g8 = fp8_layout(L.num.weight.cfg, out, in, name.c_str());
        w8_scratch = std::max(w8_scratch, size_t(out) * in);
        break;
    }
    lin.push_back(std::move(L));
    return static_cast<int>(lin.size()) - 1;
  }

  // The same linears, names and order as model::Model (model::linear_table).
  void build_linears() {
    const model::LinearTable t = model::linear_table(cfg, lay);
    for (const model::LinearSpec& sp : t.specs) add(sp.name, sp.layer, sp.out, sp.in, sp.offset);
    layers.assign(cfg.num_hidden_layers, {});
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      LayerIdx& x = layers[l];
      static_cast<model::LinearTable::Layer&>(x) = t.layers[l];
      if (x.sparse)
        for (int e = 0; e < x.nexperts; ++e)
          for (int j = 0; j < 3; ++j) {
            const DevLinear& a = lin[x.mlp + 3 * e + j];
            const DevLinear& b = lin[x.mlp + (j == 2 ? 2 : 0)];
            x.experts_uniform &= a.mode == b.mode && a.num.act == b.num.act;
          }
      setup_fused_gu(x);
    }
    lm_head = t.lm_head;
    setup_fused_qkv();
    // Prefill's W_eff scratch of FP8 linears, allocated once: a grow inside a step could free a
    // buffer that queued SGEMMs still read.
    if (w8_scratch) wdq.resize(w8_scratch);
  }

  // q, k and v read the same operand; where their weights are BF16, or W4A4 with per-tensor
  // weight scales (stacked with a per-row amax, as gate/up), one GEMM computes all three
  // (QUADS_GPU_FUSE_QKV=0 keeps three).
  void setup_fused_qkv() {
    qkv.clear();
    qkv.resize(layers.size());
    if (env_is("QUADS_GPU_FUSE_QKV", "0")) return;
    for (size_t l = 0; l < layers.size(); ++l) {
      LayerIdx& x = layers[l];
      const DevLinear &Q = lin[x.q], &K = lin[x.k], &V = lin[x.v];
      bool ok = same_operand(K, Q) && same_operand(V, Q) && K.mode == Q.mode && V.mode == Q.mode;
      if (Q.mode == GpuLinearMode::W4A4)
        for (const DevLinear* L : {&Q, &K, &V}) ok &= L->num.weight.cfg.global == num::Global::PerTensor;
      else
        ok &= Q.mode == GpuLinearMode::BF16;
      x.fused_qkv = ok;
      if (!ok) continue;
      const int64_t rows = Q.out + K.out + V.out, H = Q.in;
      Qkv& F = qkv[l];
      if (Q.mode == GpuLinearMode::BF16) {
        F.b.resize(size_t(rows * H));
      } else {
        F.codes.resize(size_t(rows * H / 2));
        F.scales.resize(size_t(rows * H / 16));
        F.amax.resize(size_t(rows));
        F.v.codes = F.codes.data();
        F.v.scales = F.scales.data();
        F.v.amax = F.amax.data();
        F.v.amax_per_row = true;
        F.v.rows = rows;
        F.v.k = H;
      }
    }
  }

  void refresh_fused_qkv() {
    const auto d2d = cudaMemcpyDeviceToDevice;
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerIdx& x = layers[l];
      if (!x.fused_qkv) continue;
      Qkv& F = qkv[l];
      int64_t r0 = 0;
      for (int i : {x.q, x.k, x.v}) {
        const DevLinear& L = lin[i];
        const int64_t n = L.out * L.in;
        if (L.mode == GpuLinearMode::BF16) {
          QUADS_CUDA_CHECK(cudaMemcpyAsync(F.b.data() + r0 * L.in, L.wb.data(), sizeof(uint16_t) * n, d2d, stream));
        } else {
          QUADS_CUDA_CHECK(cudaMemcpyAsync(F.codes.data() + r0 * L.in / 2, L.wq.codes.data(), n / 2, d2d, stream));
          QUADS_CUDA_CHECK(cudaMemcpyAsync(F.scales.data() + r0 * L.in / 16, L.wq.scales.data(), n / 16, d2d, stream));
          kern::broadcast(L.wq.amax.data(), F.amax.data() + r0, L.out, stream);
        }
        r0 += L.out;
      }
    }
  }

  // Gate and up share their operand (same per-token activation quantizer) and have the same
  // weight numerics in BF16 or W4A4 with a per-tensor weight scale: one GEMM with N = 2I gives
  // every output element from the same operands (only the GEMM's summation order may differ).
  void setup_fused_gu(LayerIdx& x) {
    const DevLinear& G0 = lin[x.mlp];
    bool ok = x.experts_uniform && G0.num.act.row_local() &&
              (G0.mode == GpuLinearMode::BF16 ||
               (G0.mode == GpuLinearMode::W4A4 && G0.num.weight.cfg.global == num::Global::PerTensor));
    for (int e = 0; e < x.nexperts && ok; ++e) ok = lin[x.mlp + 3 * e].num == lin[x.mlp + 3 * e + 1].num;
    x.fused_gu = ok;
    if (!ok) return;
    for (int e = 0; e < x.nexperts; ++e) {
      DevLinear& G = lin[x.mlp + 3 * e];
      const int64_t n = 2 * G.out * G.in;
      if (G.mode == GpuLinearMode::BF16) {
        G.gu_b.resize(n);
      } else {
        G.gu_codes.resize(n / 2);
        G.gu_scales.resize(n / 16);
        G.gu_amax.resize(2 * G.out);
        G.gu_v.codes = G.gu_codes.data();
        G.gu_v.scales = G.gu_scales.data();
        G.gu_v.amax = G.gu_amax.data();
        G.gu_v.amax_per_row = true;
        G.gu_v.rows = 2 * G.out;
        G.gu_v.k = G.in;
      }
    }
  }

  void refresh_fused_gu() {
    for (const LayerIdx& x : layers) {
      if (!x.fused_gu) continue;
      for (int e = 0; e < x.nexperts; ++e) {
        DevLinear& G = lin[x.mlp + 3 * e];
        const DevLinear& U = lin[x.mlp + 3 * e + 1];
        const int64_t n = G.out * G.in;
        const auto d2d = cudaMemcpyDeviceToDevice;
        if (G.mode == GpuLinearMode::BF16) {
          QUADS_CUDA_CHECK(cudaMemcpyAsync(G.gu_b.data(), G.wb.data(), sizeof(uint16_t) * n, d2d, stream));
          QUADS_CUDA_CHECK(cudaMemcpyAsync(G.gu_b.data() + n, U.wb.data(), sizeof(uint16_t) * n, d2d, stream));
        } else {
          QUADS_CUDA_CHECK(cudaMemcpyAsync(G.gu_codes.data(), G.wq.codes.data(), n / 2, d2d, stream));
          QUADS_CUDA_CHECK(cudaMemcpyAsync(G.gu_codes.data() + n / 2, U.wq.codes.data(), n / 2, d2d, stream));
          QUADS_CUDA_CHECK(cudaMemcpyAsync(G.gu_scales.data(), G.wq.scales.data(), n / 16, d2d, stream));
          QUADS_CUDA_CHECK(cudaMemcpyAsync(G.gu_scales.data() + n / 16, U.wq.scales.data(), n / 16, d2d, stream));
          kern::broadcast(G.wq.amax.data(), G.gu_amax.data(), G.out, stream);
          kern::broadcast(U.wq.amax.data(), G.gu_amax.data() + G.out, U.out, stream);
        }
      }
    }
  }

  // Re-quantizes every linear from `master`.
  void requantize() {
    DeviceQTensor tmpq;
    for (DevLinear& L : lin) {
      const float* src = master.data() + L.offset;
      const int64_t n = L.out * L.in;
      switch (L.mode) {
        case GpuLinearMode::BF16: kern::to_bf16(src, L.wb.data(), n, stream); break;
        case GpuLinearMode::W4A4:
        case GpuLinearMode::FP8: quantize(src, L.wq, stream); break;
        case GpuLinearMode::Fake:
          switch (L.num.weight.kind) {
            case QuantKind::None:
              QUADS_CUDA_CHECK(cudaMemcpyAsync(L.wf.data(), src, sizeof(float) * n, cudaMemcpyDeviceToDevice, stream));
              break;
            case QuantKind::BF16: kern::bf16_round(src, L.wf.data(), n, stream); break;
            case QuantKind::Quant:
              if (tmpq.rows != L.out || tmpq.cols != L.in || !(tmpq.cfg.describe() == L.num.weight.cfg.describe())) {
                QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
                tmpq = make_qtensor(L.out, L.in, L.num.weight.cfg);
              }
              quantize(src, tmpq, stream);
              dequantize(tmpq, L.wf.data(), stream);
              break;
          }
          break;
      }
    }
    for (DevLinear& L : lin) refresh_rac_weights(L);
    refresh_fused_gu();
    refresh_fused_qkv();
    QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // ---- RAC

  void refresh_rac_weights(DevLinear& L) {
    if (L.rac_nsel == 0 || (L.mode != GpuLinearMode::Fake && L.mode != GpuLinearMode::FP8)) return;
    L.rac_w.resize(size_t(L.out) * L.rac_cols);
    const float* weff = L.wf.data();
    if (L.mode == GpuLinearMode::FP8) {  // W_eff from the codes, into the prefill scratch
      fp8_dequantize(L.w8, L.g8, wdq.data(), stream);
      weff = wdq.data();
    }
    gather_blocks(weff, L.out, L.in, L.rac_blocks.data(), L.rac_nsel, L.rac_w.data(), L.rac_cols, stream);
  }

  void set_rac(DevLinear& L, const std::vector<int32_t>& channels, const model::OperandQuant& q) {
    L.rac_nsel = L.rac_cols = 0;
    L.rac_blocks.reset();
    L.rac_blocks_host.clear();
    L.rac_w.reset();
    L.rac_sel.reset();
    if (channels.empty()) return;
    const int64_t ns = static_cast<int64_t>(channels.size());
    QUADS_CHECK(ns % 16 == 0, "GpuModel RAC: {} compensates {} channels: the GPU needs whole 16-channel blocks", L.name, ns);
    std::vector<int32_t> blocks;
    for (int64_t b = 0; b < ns / 16; ++b) {
      const int32_t c0 = channels[16 * b];
      bool whole = c0 % 16 == 0 && c0 >= 0 && c0 + 16 <= L.in;
      for (int j = 1; j < 16 && whole; ++j) whole = channels[16 * b + j] == c0 + j;
      QUADS_CHECK(whole, "GpuModel RAC: the channels of {} are not whole 16-blocks (channel {} at index {})", L.name,
                  c0, 16 * b);
      blocks.push_back(c0 / 16);
    }
    QUADS_CHECK(L.num.act.kind == QuantKind::Quant, "GpuModel RAC: {} does not quantize its activations", L.name);
    if (L.mode == GpuLinearMode::W4A4) {
      QUADS_CHECK(is_e2m1_nvfp4(q) && q.cfg.block == num::Block::B1x16 && q.row_local(),
                  "GpuModel RAC: {} is a W4A4 linear: its residual must be NVFP4 1x16 with per-token scales (got {})",
                  L.name, q.describe());
      L.rac_cols = (ns + 63) / 64 * 64;  // the gather GEMM's K: pad with zero blocks
    } else {
      L.rac_cols = ns;
    }
    QUADS_CHECK(L.mode != GpuLinearMode::BF16, "GpuModel RAC: {} runs in bf16", L.name);
    L.rac_nsel = ns / 16;
    L.rac_quant = q;
    if (L.mode == GpuLinearMode::W4A4) {
      std::vector<uint8_t> sel(size_t(L.in / 16), 0);
      for (int32_t b : blocks) sel[size_t(b)] = 1;
      L.rac_sel.upload(sel);
    }
    blocks.resize(L.rac_cols / 16, 0);
    L.rac_blocks.upload(blocks);
    L.rac_blocks_host = blocks;
    refresh_rac_weights(L);
  }

  // ---- RAC folded into the main W4A4 GEMM (decode shapes)
  // L's RAC can be folded into its main GEMM at rows_per_weight rows (a grouped call's bound).
  bool rac_fold(const DevLinear& L, int64_t rows_per_weight, bool grouped) const {
    return rac_fold_on && L.mode == GpuLinearMode::W4A4 && L.rac_nsel > 0 && L.rac_sel.size() > 0 &&
           rac_quantize_supported(L.act_cfg(), L.rac_quant.cfg) &&
           w4a4_rac_fold_supported(rows_per_weight, L.in, grouped);
  }
  // nops dense residual operands of rows x k in rf_*.
  RacFold fold_buffers(int nops, int64_t rows, int64_t k) {
    RacFold f;
    f.codes = grow(rf_codes, size_t(nops * rows * k / 2));
    f.scales = grow(rf_scales, size_t(nops * rows * k / 16));
    f.amax = grow(rf_amax, size_t(nops * rows));
    f.rows = rows;
    f.nops = nops;
    return f;
  }
  // y (+)= the linears Ls (stacked in w: Ls[j]'s rows after Ls[0..j-1]'s) of the T rows X (row
  // stride ld) with their RAC: one quantizer launch for the codes and every residual, one GEMM.
  void gemm_rac_fold(std::initializer_list<const DevLinear*> Ls, const Nvfp4View& w, const float* X, int64_t ld,
                     int64_t T, float* Y, bool accumulate) {
    const DevLinear& L0 = **Ls.begin();
    shape_xq(L0, T, L0.in);
    RacFold f = fold_buffers(static_cast<int>(Ls.size()), T, L0.in);
    const uint8_t* sel[3] = {};
    int n = 0;
    int64_t rows = 0;
    for (const DevLinear* L : Ls) {
      if (n > 0) f.split[n - 1] = rows;
      sel[n++] = L->rac_sel.data();
      rows += L->out;
    }
    RacFoldSource src;
    src.x = X;
    src.ld = ld;
    rac_quantize_fold(src, T, L0.in, L0.act_cfg(), &xq, n, sel, nullptr, 0, L0.rac_quant.cfg, rf_codes.data(),
                      rf_scales.data(), rf_amax.data(), stream);
    W4A4Options o;
    o.weights_ready = true;  // no kernel of a step writes weights (requantize() runs between steps)
    w4a4_gemm_rac(nvfp4_view(xq, L0.name.c_str()), w, f, Y, accumulate, stream, o);
    stats.rac_fold_gemms += 1;
  }
  // Layer l's fused q/k/v with RAC folded (every projection W4A4 with RAC in one format, the
  // splits whole 16-row blocks).
  bool qkv_fold(int l, int64_t T) const {
    const LayerIdx& li = layers[l];
    if (!li.fused_qkv) return false;
    const DevLinear &Lq = lin[li.q], &Lk = lin[li.k], &Lv = lin[li.v];
    return rac_fold(Lq, T, false) && rac_fold(Lk, T, false) && rac_fold(Lv, T, false) &&
           Lq.num.act == Lk.num.act && Lk.num.act == Lv.num.act && Lq.rac_quant == Lk.rac_quant &&
           Lk.rac_quant == Lv.rac_quant && Lq.out % 16 == 0 && Lk.out % 16 == 0;
  }
  // Layer l's counter of experts with rows (GpuModel::stats): folded steps read no RAC blocks again.
  unsigned long long* active_count(int l, int64_t T) {
    return (moe_fold(l, T) ? active_fold_d.data() : active_d.data()) + l;
  }
  // Sparse layer l's experts with RAC folded (mlp_grouped_fold): grouped, gate and up fused, all
  // three projections W4A4 with grouped RAC.
  bool moe_fold(int l, int64_t T) const {
    const LayerIdx& li = layers[l];
    if (!rac_fold_on || !li.sparse || !li.fused_gu || !grouped_now(l, T)) return false;
    const Grouped& Gt = grouped[l];
    if (Gt.gu.mode != GpuLinearMode::W4A4 || Gt.d.mode != GpuLinearMode::W4A4) return false;
    for (int j = 0; j < 3; ++j)
      if (!Gt.rac[j].on || Gt.rac[j].sel.size() == 0 || !rac_quantize_supported(lin[li.mlp + j].act_cfg(), Gt.rac[j].quant.cfg))
        return false;
    return Gt.rac[0].quant == Gt.rac[1].quant && lin[li.mlp].num.act == lin[li.mlp + 1].num.act && li.inter % 16 == 0 &&
           w4a4_rac_fold_supported(T, cfg.hidden_size, true) && w4a4_rac_fold_supported(T, li.inter, true);
  }
  // mlp_grouped with RAC folded, over the R = T * k expert-ordered rows: gate/up reads the normed
  // token rows xn through the routing map, down the SwiGLU of gate/up (both in the quantizer's loads).
  void mlp_grouped_fold(int l, int64_t T, const float* xn, int64_t R, float* Y) {
    const LayerIdx& li = layers[l];
    const Grouped& Gt = grouped[l];
    const int E = li.nexperts;
    const int64_t H = cfg.hidden_size, I = li.inter;
    float* gp = grow(g, size_t(R * 2 * I));
    const DevLinear &G0 = lin[li.mlp], &D0 = lin[li.mlp + 2];
    const int32_t* eo = eoff_d.data();
    shape_xq(G0, R, H);
    RacFold f = fold_buffers(2, R, H);
    f.split[0] = I;
    const uint8_t* sel_gu[2] = {Gt.rac[0].sel.data(), Gt.rac[1].sel.data()};
    RacFoldSource src;
    src.x = xn;
    src.ld = H;
    src.map = perm.data();
    src.map_div = cfg.num_experts_per_tok;
    rac_quantize_fold(src, R, H, G0.act_cfg(), &xq, 2, sel_gu, eo, E, Gt.rac[0].quant.cfg, rf_codes.data(),
                      rf_scales.data(), rf_amax.data(), stream);
    w4a4_gemm_grouped_rac(nvfp4_view(xq, G0.name.c_str()), nullptr, 1, R, f, Gt.gu.q.data(), Gt.gu.amax_row, 2 * I, E,
                          eo, T, gp, 0, stream);
    shape_xq(D0, R, I);
    RacFold fd = fold_buffers(1, R, I);
    const uint8_t* sel_d[1] = {Gt.rac[2].sel.data()};
    RacFoldSource sd;
    sd.x = gp;
    sd.u = gp + I;
    sd.ld = 2 * I;
    rac_quantize_fold(sd, R, I, D0.act_cfg(), &xq, 1, sel_d, eo, E, Gt.rac[2].quant.cfg, rf_codes.data(),
                      rf_scales.data(), rf_amax.data(), stream);
    w4a4_gemm_grouped_rac(nvfp4_view(xq, D0.name.c_str()), nullptr, 1, R, fd, Gt.d.q.data(), Gt.d.amax_row, H, E, eo,
                          T, Y, 0, stream);
    stats.expert_gemms += 2;
    stats.rac_fold_gemms += 2;
  }

  // RAC's residual R = X - X_eff of n rows of L's input (in rbuf).
  const float* rac_residual(const DevLinear& L, const float* X, int64_t n) {
    float* r = grow(rbuf, size_t(n * L.in));
    fake_quantize(X, r, n, L.in, L.act_cfg(), stream);
    kern::sub(X, r, r, n * L.in, stream);
    return r;
  }
  // xrq shaped for n rows of the residual's cols (NVFP4, row-major scales).
  void rac_xrq(int64_t n, int64_t cols, const num::QConfig& cfg) {
    xrq.cfg = cfg;
    xrq.rows = n;
    xrq.cols = cols;
    xrq.layout = ScaleLayout::RowMajor;
    grow(xrq.codes, size_t(n * cols / 2));
    grow(xrq.scales, size_t(n * cols / 16));
    grow(xrq.amax, size_t(n));
  }
  // The gathered residual blocks [n, cols] quantized into xrq.
  void quantize_rac(const float* gb, int64_t n, int64_t cols, const num::QConfig& cfg) {
    rac_xrq(n, cols, cfg);
    quantize(gb, xrq, stream);
  }

  // Y [n, out] (row stride ldy, 0: out) += Q_rac(R[:, S]) · W[:, S]^T for the rows X [n, in], R =
  // X - X_eff.
  void rac(const DevLinear& L, const float* X, int64_t n, float* Y, int64_t ldy = 0) {
    if (n == 0) return;
    stats.weight_bytes += L.rac_bytes();
    const int64_t in = L.in, cols = L.rac_cols;
    if (L.mode == GpuLinearMode::W4A4 && rac_fused_on && rac_quantize_supported(L.act_cfg(), L.rac_quant.cfg)) {
      rac_xrq(n, cols, L.rac_quant.cfg);
      rac_quantize(X, in, L.act_cfg(), L.rac_blocks.data(), cols / 16, L.rac_nsel, nullptr, nullptr, 0, xrq, stream);
      W4A4Options o;
      o.ldy = ldy;
      w4a4_gemm_gather(nvfp4_view(xrq, L.name.c_str()), L.wv, L.rac_blocks.data(), Y, true, stream, o);
      return;
    }
    const float* r = rac_residual(L, X, n);
    float* gb = grow(gbuf, size_t(n * cols));
    gather_blocks(r, n, in, L.rac_blocks.data(), L.rac_nsel, gb, cols, stream);
    if (L.mode == GpuLinearMode::W4A4) {
      quantize_rac(gb, n, cols, L.rac_quant.cfg);
      W4A4Options o;
      o.ldy = ldy;
      w4a4_gemm_gather(nvfp4_view(xrq, L.name.c_str()), L.wv, L.rac_blocks.data(), Y, true, stream, o);
      return;
    }
    switch (L.rac_quant.kind) {
      case QuantKind::None: break;
      case QuantKind::BF16: kern::bf16_round(gb, gb, n * cols, stream); break;
      case QuantKind::Quant: fake_quantize(gb, gb, n, cols, L.rac_quant.cfg, stream); break;
    }
    const float alpha = 1.f, beta = 1.f;
    QUADS_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    QUADS_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_ws.data(), cublas_ws.bytes()));  // reset by SetStream
    QUADS_CUBLAS_CHECK(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(L.out), static_cast<int>(n),
                                 static_cast<int>(cols), &alpha, L.rac_w.data(), static_cast<int>(cols), gb,
                                 static_cast<int>(cols), &beta, Y, static_cast<int>(ldy ? ldy : L.out)));
  }

  // ---- GEMMs

  bool same_operand(const DevLinear& a, const DevLinear& b) const {
    return a.mode == b.mode && a.in == b.in && a.num.act == b.num.act;
  }

  // The activation error of linear L on X [M, L.in] (a step with act_error): X_eff as the CPU's
  // operand (fake-quantized, or rounded to BF16) into probe_x, its row sums into probe_sums. Returns
  // the first row, or SIZE_MAX where L rounds nothing (the CPU's probe skips it too).
  size_t probe(const DevLinear& L, const float* X, int64_t M) {
    if (!probe_out || M == 0 || L.layer < 0 || L.num.act.kind == QuantKind::None) return SIZE_MAX;
    const size_t at = probe_used;
    QUADS_CHECK(at + size_t(M) <= probe_sums.size() / 2 && size_t(M * L.in) <= probe_x.size(),
                "GpuModel: activation-error rows exceed their buffers ({} rows, {} of {})", L.name, at + M,
                probe_sums.size() / 2);
    if (L.num.act.kind == QuantKind::BF16) {
      kern::bf16_round(X, probe_x.data(), M * L.in, stream);
    } else {
      const num::QConfig& c = L.act_cfg();
      QUADS_CHECK(c.scheme != num::Scheme::NVFP4 || c.global != num::Global::Static || c.static_amax > 0,
                  "GpuModel: {} uses a static activation scale but none is set (calibrate it first)", L.name);
      fake_quantize(X, probe_x.data(), M, L.in, c, stream);
    }
    kern::row_error_sums(X, probe_x.data(), M, L.in, probe_sums.data() + 2 * at, stream);
    probe_used += size_t(M);
    return at;
  }
  void probe_entry(const DevLinear& L, size_t at, int64_t rows) {
    if (at != SIZE_MAX && rows > 0) probe_log.push_back({&L, at, rows});
  }
  // The residual energy of the linears `ls`, which take X [M, in] (a calibration step): X_eff as the
  // CPU's operand into probe_x (once for those that round X alike), then model::rac_energy's sums.
  void energy_probe(std::initializer_list<const DevLinear*> ls, const float* X, int64_t M) {
    const DevLinear* first = nullptr;
    for (const DevLinear* L : ls) {
      const size_t at = energy_at[size_t(L - lin.data())];
      if (at == SIZE_MAX || M == 0) continue;
      if (!first || !(L->num.act == first->num.act)) {
        first = L;
        const num::QConfig& c = L->act_cfg();
        QUADS_CHECK(c.scheme != num::Scheme::NVFP4 || c.global != num::Global::Static || c.static_amax > 0,
                    "GpuModel: {} uses a static activation scale but none is set (calibrate it first)", L->name);
        QUADS_CHECK(size_t(M * L->in) <= probe_x.size(), "GpuModel: RAC calibration rows exceed their buffer ({})",
                    L->name);
        fake_quantize(X, probe_x.data(), M, L->in, c, stream);
      }
      kern::rac_energy(X, probe_x.data(), M, L->in, energy_d.data() + at, stream);
    }
  }
  // Linears that take the same X (q/k/v; an expert's gate and up): one probe for those that round it alike.
  void probe_same_x(std::initializer_list<const DevLinear*> ls, const float* X, int64_t M) {
    if (energy_out) energy_probe(ls, X, M);
    if (!probe_out) return;
    const DevLinear* first = nullptr;
    size_t at = SIZE_MAX;
    for (const DevLinear* L : ls) {
      if (!first || !(L->num.act == first->num.act)) {
        first = L;
        at = probe(*L, X, M);
      }
      probe_entry(*L, at, M);
    }
  }
  // After the step: the logged rows added up per linear, in row order (num::error_stats' order).
  void probe_collect() {
    if (!probe_out) return;
    std::vector<double> sums(2 * probe_used);
    if (!sums.empty())
      QUADS_CUDA_CHECK(cudaMemcpy(sums.data(), probe_sums.data(), sizeof(double) * sums.size(), cudaMemcpyDeviceToHost));
    for (const ProbeEntry& e : probe_log) {
      double err = 0, norm = 0;
      for (int64_t r = 0; r < e.rows; ++r) {
        err += sums[2 * (e.at + r)];
        norm += sums[2 * (e.at + r) + 1];
      }
      (*probe_out)[e.L->name].add(e.L->layer, err, norm, e.rows);
    }
  }

  // FP8 with E4M3 activations: codes + scales for the tiles, or X_eff in FP32 for the GEMVs where
  // every GEMM of the operand runs one (need_f: 1 yes, 0 no, -1 when M is at most a GEMV's rows).
  // xb: X's BF16 bits when a fused norm already wrote them (BF16 linears then convert nothing).
  Operand prepare(const DevLinear& L, const float* X, int64_t M, int need_f = -1, const uint16_t* xb = nullptr) {
    Operand op;
    op.mode = L.mode;
    op.rows = M;
    op.k = L.in;
    op.x = X;
    const int64_t n = M * L.in;
    switch (L.mode) {
      case GpuLinearMode::BF16:
        if (xb) {
          op.b = xb;
          break;
        }
        op.b = grow(bop, n);
        kern::to_bf16(X, bop.data(), n, stream);
        break;
      case GpuLinearMode::W4A4: {
        shape_xq(L, M, L.in);
        quantize(X, xq, stream);
        op.v = nvfp4_view(xq, L.name.c_str());
        break;
      }
      case GpuLinearMode::Fake:
      case GpuLinearMode::FP8:
        if (L.mode == GpuLinearMode::FP8 && fp8_tiles && fp8_act_codes(L.num.act, L.in) &&
            !(need_f < 0 ? M <= fp8_gemv_rows : need_f > 0)) {
          const num::QConfig& c = L.act_cfg();
          xq8.cfg = c;
          xq8.rows = M;
          xq8.cols = L.in;
          xq8.layout = ScaleLayout::RowMajor;
          Fp8Layout ag = fp8_layout(c, std::max<int64_t>(M, 1), L.in, L.name.c_str());
          ag.n = M;
          grow(xq8.codes, size_t(n));
          grow(xq8.fscales, size_t(std::max<int64_t>(fp8_scale_count(ag), 1)));
          quantize(X, xq8, stream);
          op.a8 = fp8_act(xq8, L.name.c_str());
          break;
        }
        switch (L.num.act.kind) {
          case QuantKind::None: op.f = X; break;
          case QuantKind::BF16:
            op.f = grow(fop, n);
            kern::bf16_round(X, fop.data(), n, stream);
            break;
          case QuantKind::Quant: {
            const num::QConfig& c = L.act_cfg();
            QUADS_CHECK(c.scheme != num::Scheme::NVFP4 || c.global != num::Global::Static || c.static_amax > 0,
                        "GpuModel: {} uses a static activation scale but none is set (calibrate it first)", L.name);
            op.f = grow(fop, n);
            fake_quantize(X, fop.data(), M, L.in, c, stream);
            break;
          }
        }
        break;
    }
    return op;
  }

  static Nvfp4View rows_of(const Nvfp4View& v, int64_t r0, int64_t n) {
    Nvfp4View x = v;
    x.codes += r0 * v.k / 2;
    x.scales += r0 * v.k / 16;
    if (x.amax_per_row) x.amax += r0;
    x.rows = n;
    return x;
  }

  // Y [n, 2I] = rows r0 .. r0+n of the operand times [W_gate; W_up]^T (gate columns first).
  void gemm_gu(const DevLinear& G, const DevLinear& U, const Operand& op, int64_t r0, int64_t n, float* Y) {
    QUADS_CHECK(op.mode == G.mode && op.k == G.in && r0 + n <= op.rows, "GpuModel: operand mismatch at {}", G.name);
    stats.weight_bytes += G.bytes() + U.bytes();
    if (n == 0) return;
    if (G.mode == GpuLinearMode::BF16)
      gemm_bf16(*blas, op.b + r0 * G.in, G.gu_b.data(), Y, n, 2 * G.out, G.in, stream);
    else
      w4a4_gemm_emulated(rows_of(op.v, r0, n), G.gu_v, Y, false, stream);
  }

  // Y [n, out] = X [n, in] . W [out, in]^T in FP32 (cuBLAS, no TF32).
  void sgemm(const float* W, const float* X, int64_t n, int64_t out, int64_t in, float* Y) {
    const float alpha = 1.f, beta = 0.f;
    QUADS_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    QUADS_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_ws.data(), cublas_ws.bytes()));  // reset by SetStream
    QUADS_CUBLAS_CHECK(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n),
                                 static_cast<int>(in), &alpha, W, static_cast<int>(in), X, static_cast<int>(in), &beta,
                                 Y, static_cast<int>(out)));
  }

  // The router's logits come from the post-attention norm kernel (router_norm_on) for this layer
  // at T rows, where the o_proj before it is W4A4 (the caller's condition).
  bool router_in_norm(const LayerIdx& li, int64_t T) const {
    if (!router_norm_on || !li.sparse) return false;
    const DevLinear& Lr = lin[li.router];
    return Lr.mode == GpuLinearMode::BF16 && Lr.rac_nsel == 0 && kern::router_fusable(T, Lr.in, static_cast<int>(Lr.out));
  }

  // Y [n, out] = rows r0 .. r0+n of the operand times W^T.
  void gemm(const DevLinear& L, const Operand& op, int64_t r0, int64_t n, float* Y) {
    QUADS_CHECK(op.mode == L.mode && op.k == L.in && r0 + n <= op.rows, "GpuModel: operand mismatch at {}", L.name);
    stats.weight_bytes += L.bytes();
    if (n == 0) return;
    switch (L.mode) {
      case GpuLinearMode::BF16: gemm_bf16(*blas, op.b + r0 * L.in, L.wb.data(), Y, n, L.out, L.in, stream); break;
      case GpuLinearMode::W4A4: w4a4_gemm_emulated(rows_of(op.v, r0, n), L.wv, Y, false, stream); break;
      case GpuLinearMode::Fake: sgemm(L.wf.data(), op.f + r0 * L.in, n, L.out, L.in, Y); break;
      case GpuLinearMode::FP8:
        if (op.a8.codes) {
          fp8_gemm(fp8_act_rows(op.a8, r0, n), L.w8, L.g8, Y, stream);
        } else if (n <= fp8_gemv_rows) {
          fp8_gemv(op.f + r0 * L.in, n, L.w8, L.g8, Y, stream);
        } else {
          fp8_dequantize(L.w8, L.g8, wdq.data(), stream);
          sgemm(wdq.data(), op.f + r0 * L.in, n, L.out, L.in, Y);
        }
        break;
    }
    if (L.rac_nsel > 0) rac(L, op.x + r0 * L.in, n, Y);
  }

  // ---- MLP over R rows grouped by expert (eoff: nE + 1 row offsets); dense: one group.
  void mlp(const LayerIdx& li, int nE, const std::vector<int64_t>& eoff, const float* X, int64_t R, float* Y) {
    const int64_t H = cfg.hidden_size, I = li.inter;
    float* gp = grow(g, size_t(R * 2 * I));  // [R, 2I] when gate and up are fused, else [R, I]
    float* up = grow(u, size_t(R * I));
    float* hp = grow(h, size_t(R * I));
    // One operand for all rows when every expert rounds its input the same way, row by row
    // (per-token scales): the rows of one expert then come out exactly as if quantized alone.
    const DevLinear& G0 = lin[li.mlp];
    const bool shared_in = li.experts_uniform && G0.num.act.row_local();
    bool fused = li.fused_gu && shared_in;
    for (int e = 0; e < nE && fused; ++e) fused = lin[li.mlp + 3 * e].rac_nsel == 0 && lin[li.mlp + 3 * e + 1].rac_nsel == 0;
    Operand all;
    if (shared_in) all = prepare(G0, X, R);
    // Activation error (a step with act_error): row-local rounding is the same for all rows, so
    // one probe of X serves every expert's gate and up.
    const size_t pin = probe_out && shared_in && lin[li.mlp + 1].num.act == G0.num.act ? probe(G0, X, R) : SIZE_MAX;
    for (int e = 0; e < nE; ++e) {
      const int64_t r0 = eoff[e], n = eoff[e + 1] - r0;
      if (n == 0) continue;
      const DevLinear& Lg = lin[li.mlp + 3 * e];
      const DevLinear& Lu = lin[li.mlp + 3 * e + 1];
      if (probe_out || energy_out) {
        if (pin != SIZE_MAX) {
          probe_entry(Lg, pin + r0, n);
          probe_entry(Lu, pin + r0, n);
        } else {
          probe_same_x({&Lg, &Lu}, X + r0 * H, n);
        }
      }
      if (fused) {
        gemm_gu(Lg, Lu, all, r0, n, gp + r0 * 2 * I);
        stats.expert_gemms += 1;
        continue;
      }
      if (shared_in) {
        gemm(Lg, all, r0, n, gp + r0 * I);
        gemm(Lu, all, r0, n, up + r0 * I);
      } else {
        const Operand og = prepare(Lg, X + r0 * H, n);
        gemm(Lg, og, 0, n, gp + r0 * I);
        const Operand ou = same_operand(Lu, Lg) ? og : prepare(Lu, X + r0 * H, n);
        gemm(Lu, ou, 0, n, up + r0 * I);
      }
      stats.expert_gemms += 2;
    }
    if (fused)
      kern::swiglu(gp, gp + I, 2 * I, R, I, hp, stream);
    else
      kern::swiglu(gp, up, I, R, I, hp, stream);
    const DevLinear& D0 = lin[li.mlp + 2];
    const bool shared_h = li.experts_uniform && D0.num.act.row_local();
    if (shared_h) all = prepare(D0, hp, R);
    const size_t ph = probe_out && shared_h ? probe(D0, hp, R) : SIZE_MAX;
    for (int e = 0; e < nE; ++e) {
      const int64_t r0 = eoff[e], n = eoff[e + 1] - r0;
      if (n == 0) continue;
      const DevLinear& Ld = lin[li.mlp + 3 * e + 2];
      if (probe_out) probe_entry(Ld, shared_h ? (ph == SIZE_MAX ? SIZE_MAX : ph + r0) : probe(Ld, hp + r0 * I, n), n);
      if (energy_out) energy_probe({&Ld}, hp + r0 * I, n);
      if (shared_h) {
        gemm(Ld, all, r0, n, Y + r0 * H);
      } else {
        const Operand od = prepare(Ld, hp + r0 * I, n);
        gemm(Ld, od, 0, n, Y + r0 * H);
      }
      stats.expert_gemms += 1;
    }
  }

  // ---- one step; returns the number of logits rows (in `logits`)
  int64_t run(const std::vector<model::StepItem>& items) {
    QUADS_CHECK(slots > 0, "GpuModel::step: no KV cache (call reset_cache first)");
    const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
    const int nh = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim;
    const int64_t qd = cfg.q_dim(), kvd = cfg.kv_dim();
    const float eps = static_cast<float>(cfg.rms_norm_eps);

    std::vector<int32_t> htok, hslot, hpos, hsel;
    std::vector<int64_t> pos64;
    std::vector<uint8_t> used(slots, 0);
    int64_t max_ctx = 1;
    bool decode = true, fresh = true;
    std::vector<int64_t> seq_off{0};
    for (size_t i = 0; i < items.size(); ++i) {
      const model::StepItem& it = items[i];
      QUADS_CHECK(it.slot >= 0 && it.slot < slots, "GpuModel::step: item {} uses slot {}, the cache has {}", i, it.slot,
                  slots);
      QUADS_CHECK(!used[it.slot], "GpuModel::step: slot {} appears twice in one step", it.slot);
      QUADS_CHECK(!it.tokens.empty(), "GpuModel::step: item {} (slot {}) has no tokens", i, it.slot);
      used[it.slot] = 1;
      const int64_t n = static_cast<int64_t>(it.tokens.size()), start = len[it.slot];
      QUADS_CHECK(start + n <= max_len, "GpuModel::step: slot {} would hold {} positions, the cache has room for {}",
                  it.slot, start + n, max_len);
      for (int64_t j = 0; j < n; ++j) {
        const int32_t tok = it.tokens[j];
        QUADS_CHECK(tok >= 0 && tok < V, "GpuModel::step: item {}: token {} at index {} is outside the vocabulary (0..{})",
                    i, tok, j, V - 1);
        if (it.all_logits || j == n - 1) hsel.push_back(static_cast<int32_t>(htok.size()));
        htok.push_back(tok);
        hslot.push_back(it.slot);
        hpos.push_back(static_cast<int32_t>(start + j));
        pos64.push_back(start + j);
      }
      max_ctx = std::max(max_ctx, start + n);
      decode &= n == 1;
      fresh &= start == 0;
      seq_off.push_back(seq_off.back() + n);
    }
    const int64_t T = static_cast<int64_t>(htok.size()), nout = static_cast<int64_t>(hsel.size());
    if (T == 0) return 0;
    for (const auto& it : items) len[it.slot] += static_cast<int64_t>(it.tokens.size());
    ++stats.steps;
    stats.tokens += T;

    // Tiled prefill attention: runs of at most tpc consecutive tokens of one slot.
    std::vector<int32_t> hblk;
    int attn_hpc = 1, attn_tpc = 1;
    const bool tiled =
        (decode ? attn_tiled_decode : attn_tiled) && kern::attention_tiled_supported(nh, nkv, hd);
    if (tiled) {
      attn_tpc = kern::attention_tiled_tokens(nh, nkv, hd, max_ctx, &attn_hpc);
      if (decode) attn_tpc = 1;  // a token per slot: the CTA's warps are its query heads
      for (int64_t t = 0; t < static_cast<int64_t>(hslot.size()); ++t) {
        const size_t nb = hblk.size() / 2;
        if (nb == 0 || hslot[t] != hslot[t - 1] || hblk[2 * nb - 1] >= attn_tpc) {
          hblk.push_back(static_cast<int32_t>(t));
          hblk.push_back(1);
        } else {
          ++hblk[2 * nb - 1];
        }
      }
    }
    const int64_t nblk = static_cast<int64_t>(hblk.size() / 2);
    const bool gemm_attn = attn_gemm_on && !decode && fresh && hd % 8 == 0 && T >= kGemmAttnTokens;
    if (gemm_attn) {
      attn_gemm->plan(seq_off);
      ++stats.gemm_attention_steps;
    }

    std::vector<float> hcos(T * hd / 2), hsin(T * hd / 2);
    cpu::rope_tables(pos64.data(), T, hd, cfg.rope_theta, hcos.data(), hsin.data());
    // The step's inputs in one pinned staging buffer and one asynchronous copy.
    size_t in_bytes = 0;
    auto place = [&](size_t bytes) {
      const size_t at = in_bytes;
      in_bytes += (bytes + 255) / 256 * 256;
      return at;
    };
    const size_t o_tok = place(4 * htok.size()), o_slot = place(4 * hslot.size()), o_pos = place(4 * hpos.size()),
                 o_sel = place(4 * hsel.size()), o_cos = place(4 * hcos.size()), o_sin = place(4 * hsin.size()),
                 o_blk = place(4 * hblk.size());
    const int b = in_turn;
    in_turn ^= 1;
    QUADS_CUDA_CHECK(cudaEventSynchronize(ev_in[b]));  // its previous copy has read it
    if (in_host_bytes[b] < in_bytes) {
      if (in_host[b]) cudaFreeHost(in_host[b]);
      in_host[b] = nullptr;
      in_host_bytes[b] = in_bytes + in_bytes / 4 + 4096;
      QUADS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&in_host[b]), in_host_bytes[b], cudaHostAllocDefault));
    }
    uint8_t* const ih = in_host[b];
    std::memcpy(ih + o_tok, htok.data(), 4 * htok.size());
    std::memcpy(ih + o_slot, hslot.data(), 4 * hslot.size());
    std::memcpy(ih + o_pos, hpos.data(), 4 * hpos.size());
    std::memcpy(ih + o_sel, hsel.data(), 4 * hsel.size());
    std::memcpy(ih + o_cos, hcos.data(), 4 * hcos.size());
    std::memcpy(ih + o_sin, hsin.data(), 4 * hsin.size());
    if (!hblk.empty()) std::memcpy(ih + o_blk, hblk.data(), 4 * hblk.size());
    // Fed tokens sit at offset 0 of inbuf, where the previous step of the run put them: the buffer
    // must not move (the run's first step, of the same shape, sized it).
    QUADS_CHECK(!fed_tokens || (o_tok == 0 && inbuf.size() >= in_bytes),
                "GpuModel: a decode run's step needs {} input bytes, its first step had {}", in_bytes, inbuf.size());
    uint8_t* in_dev = grow(inbuf, in_bytes);
    if (!fed_tokens) QUADS_CUDA_CHECK(cudaEventRecord(ev_begin, stream));
    const size_t skip = fed_tokens ? o_slot : 0;
    QUADS_CUDA_CHECK(cudaMemcpyAsync(in_dev + skip, ih + skip, in_bytes - skip, cudaMemcpyHostToDevice, stream));
    QUADS_CUDA_CHECK(cudaEventRecord(ev_in[b], stream));
    const int32_t* d_tok = reinterpret_cast<const int32_t*>(in_dev + o_tok);
    const int32_t* d_slot = reinterpret_cast<const int32_t*>(in_dev + o_slot);
    const int32_t* d_pos = reinterpret_cast<const int32_t*>(in_dev + o_pos);
    const int32_t* d_sel = reinterpret_cast<const int32_t*>(in_dev + o_sel);
    const float* d_cos = reinterpret_cast<const float*>(in_dev + o_cos);
    const float* d_sin = reinterpret_cast<const float*>(in_dev + o_sin);
    const int32_t* d_blk = reinterpret_cast<const int32_t*>(in_dev + o_blk);

    const int E = cfg.num_experts, K = cfg.num_experts_per_tok;
    int64_t maxI = 0;
    for (const auto& li : layers) maxI = std::max(maxI, li.inter);
    const int64_t R = std::max<int64_t>(T * std::max(K, 1), T);
    float* xp = grow(x, T * H);
    float* xnp = grow(xn, T * H);
    float* qp = grow(q, T * qd);
    float* kp = grow(k, T * kvd);
    float* vp = grow(v, T * kvd);
    float* ap = grow(attn, T * qd);
    float* tp = grow(tmp, T * H);
    float* qkvp = grow(qkvbuf, T * (qd + 2 * kvd));
    bool kv_post = kv_quant;
    for (const auto& m : kv_shift) kv_post |= m.size() > 0;
    float* kbp = kv_post || gemm_attn ? grow(kbuf, T * kvd) : nullptr;
    float* vbp = kv_post || gemm_attn ? grow(vbuf, T * kvd) : nullptr;
    float* kvap = kv_quant ? grow(kv_amax, T * nkv) : nullptr;
    float* xep = grow(xe, R * H);
    float* yep = grow(ye, R * H);
    grow(g, R * 2 * maxI);
    grow(u, R * maxI);
    grow(h, R * maxI);
    if (E > 0) {
      grow(rlogits, T * E);
      grow(probs, T * E);
      grow(idx, T * K);
      grow(w, T * K);
      grow(perm, T * K);
      grow(inv, T * K);
    }
    const size_t maxop = size_t(std::max({T * std::max<int64_t>(H, qd), R * std::max(H, maxI), nout * H}));
    // Operand scratch sized up front: a later grow would free a buffer that queued GEMMs still read.
    grow(fop, maxop);
    grow(bop, maxop);
    grow(hbf, size_t(R * maxI));
    grow(xq.codes, maxop / 2 + 1);
    grow(xq.scales, maxop / 16 + 1);
    grow(xq.amax, size_t(std::max(R, nout)) + 1);
    grow(rbuf, maxop);
    grow(gbuf, maxop + 64 * size_t(std::max(R, nout)));
    grow(xrq.codes, (maxop + 64 * size_t(std::max(R, nout))) / 2);
    grow(xrq.scales, (maxop + 64 * size_t(std::max(R, nout))) / 16);
    grow(xrq.amax, size_t(std::max(R, nout)) + 1);
    grow(nq_codes, size_t(T * std::max(H, qd) / 2 + 1));
    grow(nq_scales, size_t(T * std::max(H, qd) / 16 + 1));
    grow(nq_amax, size_t(T + 1));
    grow(nq_frag, size_t(x_frag_bytes(std::max(H, qd), kXFragMaxRows)));  // one size: no regrow under a graph
    if (probe_out) {  // sized up front: a grow would free rows that queued kernels still write
      probe_log.clear();
      probe_used = 0;
      grow(probe_x, maxop);
      grow(probe_sums, 2 * size_t(cfg.num_hidden_layers) * size_t(5 * T + 3 * R));
    }
    if (energy_out) grow(probe_x, maxop);

    const float* M = master.data();
    const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
    const size_t cache_layer = size_t(slots) * max_len * kvd;
    std::vector<int32_t> hidx(E > 0 ? T * K : 0), hperm(E > 0 ? T * K : 0), hinv(E > 0 ? T * K : 0);
    std::vector<int64_t> eoff;
    float* xsp = grow(xs, nout * H);
    float* xfp = grow(xf, nout * H);
    float* lg = grow(logits, nout * V);

    // A decode step with every MoE layer grouped has no host sync: it can be a CUDA graph. The
    // attention context is rounded up to a power of two (it only sizes shared memory), so one
    // graph serves many steps.
    bool graphable = decode && graphs_on && !graph_failed && !legacy_moe && !recording;
    int32_t* recp = recording && E > 0 ? grow(rec_d, size_t(cfg.num_hidden_layers) * T * K) : nullptr;
    for (int l = 0; l < cfg.num_hidden_layers && graphable; ++l) graphable = !layers[l].sparse || grouped_now(l, T);
    if (graphable) {
      int64_t c = 256;
      while (c < max_ctx) c *= 2;
      max_ctx = std::max(max_ctx, std::min(c, max_len));
    }

    // Fused kernels: every RMSNorm runs in the kernel that last wrote the residual stream (the MoE
    // combine or the residual add; the first layer's after the embedding), with a BF16 copy where a
    // BF16 GEMM reads it; the final norm too when every row gives logits, in order (decode).
    const bool fuse = fused_on && !kern::legacy_decode_kernels();
    bool final_in_layers = fuse && nout == T && cfg.num_hidden_layers > 0;
    for (int64_t i = 0; i < nout && final_in_layers; ++i) final_in_layers = hsel[i] == i;
    uint16_t* xnbp = fuse ? grow(xnb, size_t(T * H)) : nullptr;
    auto bf_in = [&](int l) -> uint16_t* { return fuse && lin[layers[l].q].mode == GpuLinearMode::BF16 ? xnbp : nullptr; };
    auto bf_post = [&](int l) -> uint16_t* {
      return fuse && layers[l].sparse && lin[layers[l].router].mode == GpuLinearMode::BF16 ? xnbp : nullptr;
    };
    uint16_t* bf_final = fuse && lin[lm_head].mode == GpuLinearMode::BF16 ? xnbp : nullptr;
    // One-kernel attention only at batch 1: H200, bench_cuda --decode-kernels, fused vs split +
    // merge at a context bound of 256: 1.06x at T = 1, 0.64x at 16, 0.96x at 64 (model decode at
    // batch 1: nvfp4 1519 vs 1489 tok/s; at 16: 9817 vs 10032).
    const bool attn_fused = fuse && attn_fused_on && decode && T == 1 && !tiled && attn_split_decode &&
                            kern::attention_decode_split_supported(nh, nkv, hd);
    size_t attn_ws_bytes = 0;
    if (attn_fused) {
      attn_ws_bytes = kern::attention_decode_fused_workspace(T, nh, nkv, hd, max_ctx);
      if (attn_ws.size() < attn_ws_bytes) {
        grow(attn_ws, attn_ws_bytes);
        attn_ws.fill_bytes(0);
      }
    }

    auto body = [&]() {
    kern::embedding(M + lay.embed, d_tok, T, H, xp, stream);
    if (fuse && cfg.num_hidden_layers > 0)
      kern::rmsnorm_bf16(xp, M + lay.layers[0].input_norm, T, H, eps, xnp, bf_in(0), stream,
                         qkv_norm_quant(0, T) ? nq_out_qkv(T) : kern::RowNvfp4{});
    // The MoE output or dense MLP output ye enters the residual stream; with fused kernels the next
    // norm (next layer's input norm, or the final norm) runs in the same kernel.
    auto finish_layer = [&](int l, const float* ye, bool moe) {
      const float* wn = nullptr;
      float* y = xnp;
      uint16_t* yb = nullptr;
      kern::RowNvfp4 yq;
      if (fuse && l + 1 < cfg.num_hidden_layers) {
        wn = M + lay.layers[l + 1].input_norm;
        yb = bf_in(l + 1);
        if (qkv_norm_quant(l + 1, T)) yq = nq_out_qkv(T);
      } else if (final_in_layers && l + 1 == cfg.num_hidden_layers) {
        wn = M + lay.final_norm;
        y = xfp;
        yb = bf_final;
      }
      if (moe && wn)
        kern::moe_combine_add_rmsnorm(ye, inv.data(), w.data(), T, K, H, xp, wn, eps, y, yb, stream, yq, early_on);
      else if (moe) kern::moe_combine_add(ye, inv.data(), w.data(), T, K, H, xp, stream);
      else if (wn) kern::add_rmsnorm(xp, ye, T, H, wn, eps, y, yb, stream, yq);
      else kern::add_inplace(xp, ye, T * H, stream);
    };
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const model::LayerOffsets& o = lay.layers[l];
      const LayerIdx& li = layers[l];
      if (!fuse) kern::rmsnorm(xp, M + o.input_norm, T, H, eps, xnp, stream);
      const DevLinear &Lq = lin[li.q], &Lk = lin[li.k], &Lv = lin[li.v], &Lo = lin[li.o];
      probe_same_x({&Lq, &Lk, &Lv}, xnp, T);
      float* kcl = kc.data() + l * cache_layer;
      float* vcl = vc.data() + l * cache_layer;
      const float* kvf = l < int(kv_factor.size()) && kv_factor[l].size() ? kv_factor[l].data() : nullptr;
      if (li.fused_qkv) {
        const int64_t rows = qd + 2 * kvd;
        stats.weight_bytes += Lq.bytes() + Lk.bytes() + Lv.bytes();
        const bool qkv_folded = qkv_fold(l, T);
        if (qkv_folded) {
          gemm_rac_fold({&Lq, &Lk, &Lv}, qkv[l].v, xnp, H, T, qkvp, false);
        } else if (fuse && qkv_norm_quant(l, T)) {  // the input norm wrote the codes
          W4A4Options o;
          o.weights_ready = true;  // no kernel of a step writes weights (requantize() runs between steps)
          Nvfp4View xv = nq_view(T, H);
          if (qkv_frag(T)) xv.frag = nq_frag.data();
          w4a4_gemm_emulated(xv, qkv[l].v, qkvp, false, stream, o);
        } else if (fused_gemv(Lq, T)) {
          w4a4_gemv_fused(fused_act(xnp, H, T, Lq, true), qkv[l].v, qkvp, false, stream);
        } else {
          const Operand oq = prepare(Lq, xnp, T, -1, bf_in(l));
          if (Lq.mode == GpuLinearMode::BF16)
            gemm_bf16(*blas, oq.b, qkv[l].b.data(), qkvp, T, rows, H, stream);
          else
            w4a4_gemm_emulated(oq.v, qkv[l].v, qkvp, false, stream);
        }
        // RAC of each projection into its columns (the fused GEMM above is the three main GEMMs)
        if (!qkv_folded) {
          if (Lq.rac_nsel > 0) rac(Lq, xnp, T, qkvp, rows);
          if (Lk.rac_nsel > 0) rac(Lk, xnp, T, qkvp + qd, rows);
          if (Lv.rac_nsel > 0) rac(Lv, xnp, T, qkvp + qd + kvd, rows);
        }
        if (fuse) {
          kern::qk_norm_rope_store_qkv(qkvp, rows, qp, M + o.q_norm, M + o.k_norm, eps, d_cos, d_sin, d_slot, d_pos, T,
                                       nh, nkv, hd, kcl, vcl, max_len, stream, kvf);
        } else {
          kern::split_cols3(qkvp, T, qd, kvd, kvd, qp, kp, vp, stream);
          kern::qk_norm_rope_store(qp, kp, vp, M + o.q_norm, M + o.k_norm, eps, d_cos, d_sin, d_slot, d_pos, T, nh,
                                   nkv, hd, kcl, vcl, max_len, stream, kvf);
        }
      } else {
        const Operand oq = prepare(Lq, xnp, T, -1, bf_in(l));
        gemm(Lq, oq, 0, T, qp);
        const Operand ok = same_operand(Lk, Lq) ? oq : prepare(Lk, xnp, T, -1, bf_in(l));
        gemm(Lk, ok, 0, T, kp);
        const Operand ov = same_operand(Lv, Lk) ? ok : prepare(Lv, xnp, T, -1, bf_in(l));
        gemm(Lv, ov, 0, T, vp);
        kern::qk_norm_rope_store(qp, kp, vp, M + o.q_norm, M + o.k_norm, eps, d_cos, d_sin, d_slot, d_pos, T, nh, nkv,
                                 hd, kcl, vcl, max_len, stream, kvf);
      }
      if (kv_post) {  // ReQAT: the new rows out of the cache (keys shifted), quantized, back
        const float* kvm = l < int(kv_shift.size()) && kv_shift[l].size() ? kv_shift[l].data() : nullptr;
        kern::kv_rows(kcl, vcl, d_slot, d_pos, T, nkv, hd, max_len, kvm, kbp, vbp, false, stream);
        if (kv_quant) {
          fake_quantize(kbp, kbp, T * nkv, hd, kv_qc, stream, kvap);
          fake_quantize(vbp, vbp, T * nkv, hd, kv_qc, stream, kvap);
        }
        kern::kv_rows(kcl, vcl, d_slot, d_pos, T, nkv, hd, max_len, nullptr, kbp, vbp, true, stream);
      }
      if (gemm_attn) {
        // the new K/V rows as the cache holds them (after ReQAT's transform, if any), packed
        kern::kv_rows(kcl, vcl, d_slot, d_pos, T, nkv, hd, max_len, nullptr, kbp, vbp, false, stream);
        attn_gemm->fwd(qp, kbp, vbp, nh, nkv, hd, scale, ap, nullptr, stream);
      } else if (tiled)
        kern::attention_tiled(qp, kcl, vcl, d_slot, d_pos, d_blk, nblk, nh, nkv, hd, scale, max_len, max_ctx, attn_hpc,
                              attn_tpc, ap, stream);
      else if (attn_fused)
        kern::attention_decode_fused(qp, kcl, vcl, d_slot, d_pos, T, nh, nkv, hd, scale, max_len, max_ctx, ap,
                                     attn_ws.data(), attn_ws_bytes, stream, 0, early_on);
      else if (decode && attn_split_decode && kern::attention_decode_split_supported(nh, nkv, hd))
        kern::attention_decode_split_n(qp, kcl, vcl, d_slot, d_pos, T, nh, nkv, hd, scale, max_len, max_ctx, ap, stream,
                                       0, early_on);
      else
        kern::attention(qp, kcl, vcl, d_slot, d_pos, T, nh, nkv, hd, scale, max_len, max_ctx, decode, ap, stream,
                        attn_tokens);
      probe_same_x({&Lo}, ap, T);
      if (Lo.mode == GpuLinearMode::W4A4) {
        // the epilogue adds into the residual stream (x + o, the add_inplace it replaces)
        stats.weight_bytes += Lo.bytes();
        const bool o_folded = rac_fold(Lo, T, false);
        if (o_folded) {
          gemm_rac_fold({&Lo}, Lo.wv, ap, qd, T, xp, true);
        } else if (fused_gemv(Lo, T)) {
          w4a4_gemv_fused(fused_act(ap, qd, T, Lo, true), Lo.wv, xp, true, stream);
        } else if (oproj_frag(Lo, T)) {  // its quantizer writes X's FP16 fragments too
          shape_xq(Lo, T, Lo.in);
          quantize(ap, xq, stream, nq_frag.data());
          Nvfp4View xv = nvfp4_view(xq, Lo.name.c_str());
          xv.frag = nq_frag.data();
          W4A4Options o;
          o.weights_ready = true;
          w4a4_gemm_emulated(xv, Lo.wv, xp, true, stream, o);
        } else {
          const Operand oo = prepare(Lo, ap, T);
          W4A4Options o;
          o.weights_ready = true;  // no kernel of a step writes weights (requantize() runs between steps)
          w4a4_gemm_emulated(oo.v, Lo.wv, xp, true, stream, o);
        }
        if (Lo.rac_nsel > 0 && !o_folded) rac(Lo, ap, T, xp);  // its residual GEMM adds into the stream too
        if (fuse) {
          kern::RowRouter rr;
          if (router_in_norm(li, T)) {
            const DevLinear& Lr = lin[li.router];
            rr = {Lr.wb.data(), static_cast<int>(Lr.out), rlogits.data(), early_on};
            stats.weight_bytes += Lr.bytes();
          }
          kern::rmsnorm_bf16(xp, M + o.post_norm, T, H, eps, xnp, bf_post(l), stream,
                             moe_mapped(l, T) ? nq_out() : kern::RowNvfp4{}, rr);
        } else {
          kern::rmsnorm(xp, M + o.post_norm, T, H, eps, xnp, stream);
        }
      } else {
        const Operand oo = prepare(Lo, ap, T);
        gemm(Lo, oo, 0, T, tp);
        if (fuse) {
          kern::add_rmsnorm(xp, tp, T, H, M + o.post_norm, eps, xnp, bf_post(l), stream,
                            moe_mapped(l, T) ? nq_out() : kern::RowNvfp4{});
        } else {
          kern::add_inplace(xp, tp, T * H, stream);
          kern::rmsnorm(xp, M + o.post_norm, T, H, eps, xnp, stream);
        }
      }
      if (li.sparse) {
        const DevLinear& Lr = lin[li.router];
        probe_same_x({&Lr}, xnp, T);
        const bool router_done = fuse && Lo.mode == GpuLinearMode::W4A4 && router_in_norm(li, T);
        if (!router_done) {
          const Operand orr = prepare(Lr, xnp, T, -1, bf_post(l));
          gemm(Lr, orr, 0, T, rlogits.data());
        }
        // top-k and routing in one launch pays at small batches (H200, bench_cuda --route: 5.7 vs
        // 7.4 us at T = 1, a tie at 16, 0.97x at 64)
        const bool one_launch = !legacy_moe && T <= 16;
        if (one_launch)
          kern::router_route(rlogits.data(), T, E, K, cfg.norm_topk_prob, probs.data(), idx.data(), w.data(),
                             ecount.data(), eoff_d.data(), perm.data(), inv.data(),
                             grouped_now(l, T) ? active_count(l, T) : nullptr, bad_d.data(), route_ticket.data(), stream);
        else
          kern::router_topk_fwd(rlogits.data(), T, E, K, cfg.norm_topk_prob, probs.data(), idx.data(), w.data(), nullptr,
                                stream);
        if (recp)
          QUADS_CUDA_CHECK(cudaMemcpyAsync(recp + size_t(l) * T * K, idx.data(), sizeof(int32_t) * T * K,
                                           cudaMemcpyDeviceToDevice, stream));
        if (!legacy_moe) {
          if (!one_launch)
            kern::moe_route(idx.data(), T * K, E, ecount.data(), eoff_d.data(), perm.data(), inv.data(),
                            grouped_now(l, T) ? active_count(l, T) : nullptr, bad_d.data(), stream);
          const bool mapped = fuse && moe_mapped(l, T);
          const bool folded = moe_fold(l, T);
          const bool gather_fused = !mapped && !folded && grouped_now(l, T) && moe_gate_up_fused(l, T);
          if (!gather_fused && !mapped && !folded) kern::gather_rows(xnp, perm.data(), T * K, K, H, xep, stream);
          if (folded) {
            mlp_grouped_fold(l, T, xnp, T * K, yep);
          } else if (grouped_now(l, T)) {
            mlp_grouped(l, T, xep, T * K, yep, gather_fused ? xnp : nullptr, mapped);
          } else {
            // RAC or mixed expert numerics: the per-expert path with the offsets from the device.
            heoff.resize(E + 1);
            QUADS_CUDA_CHECK(cudaMemcpyAsync(heoff.data(), eoff_d.data(), sizeof(int32_t) * (E + 1),
                                             cudaMemcpyDeviceToHost, stream));
            QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
            check_route(false);
            eoff.assign(heoff.begin(), heoff.end());
            mlp(li, E, eoff, xep, T * K, yep);
          }
          finish_layer(l, yep, true);
          continue;
        }
        QUADS_CUDA_CHECK(cudaMemcpyAsync(hidx.data(), idx.data(), sizeof(int32_t) * T * K, cudaMemcpyDeviceToHost, stream));
        QUADS_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (int32_t e : hidx) QUADS_CHECK(e >= 0 && e < E, "GpuModel: router of layer {} chose expert {} (NaN logits?)", l, e);
        eoff.assign(E + 1, 0);
        cpu::moe_permute(hidx.data(), T, K, E, eoff.data(), hperm.data(), hinv.data());
        QUADS_CUDA_CHECK(cudaMemcpyAsync(perm.data(), hperm.data(), sizeof(int32_t) * T * K, cudaMemcpyHostToDevice, stream));
        QUADS_CUDA_CHECK(cudaMemcpyAsync(inv.data(), hinv.data(), sizeof(int32_t) * T * K, cudaMemcpyHostToDevice, stream));
        kern::gather_rows(xnp, perm.data(), T * K, K, H, xep, stream);
        mlp(li, E, eoff, xep, T * K, yep);
        finish_layer(l, yep, true);
      } else {
        eoff = {0, T};
        mlp(li, 1, eoff, xnp, T, yep);
        finish_layer(l, yep, false);
      }
    }
    if (!final_in_layers) {
      kern::gather_rows(xp, d_sel, nout, 1, H, xsp, stream);
      kern::rmsnorm(xsp, M + lay.final_norm, nout, H, eps, xfp, stream);
    }
    const DevLinear& Llm = lin[lm_head];
    if (energy_out) energy_probe({&Llm}, xfp, nout);
    const Operand olm = prepare(Llm, xfp, nout, -1, final_in_layers ? bf_final : nullptr);
    gemm(Llm, olm, 0, nout, lg);
    };

    if (!graphable) {
      body();
      if (!in_run) queue_route_flag();
      return nout;
    }
    const auto key = std::make_tuple(T, nout, max_ctx);
    auto it = graphs.find(key);
    if (it != graphs.end() && it->second.gen != g_alloc_gen) {  // a buffer moved since the capture
      cudaGraphExecDestroy(it->second.exec);
      graphs.erase(it);
      it = graphs.end();
    }
    if (it != graphs.end()) {
      QUADS_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream));
      ++stats.graph_steps;
      stats.weight_bytes += it->second.weight_bytes;
      stats.expert_gemms += it->second.expert_gemms;
      if (!in_run) queue_route_flag();
      return nout;
    }
    if (!seen.count(key)) {  // the first step of a shape runs eagerly (and sizes every buffer)
      seen.insert(key);
      body();
    } else {
      capture(body, key);
    }
    if (!in_run) queue_route_flag();
    return nout;
  }

  static int64_t kernel_nodes(cudaGraph_t graph) {
    size_t n = 0;
    if (cudaGraphGetNodes(graph, nullptr, &n) != cudaSuccess) return 0;
    std::vector<cudaGraphNode_t> nodes(n);
    if (n == 0 || cudaGraphGetNodes(graph, nodes.data(), &n) != cudaSuccess) return 0;
    int64_t k = 0;
    for (cudaGraphNode_t v : nodes) {
      cudaGraphNodeType t;
      k += cudaGraphNodeGetType(v, &t) == cudaSuccess && t == cudaGraphNodeTypeKernel;
    }
    return k;
  }

  // Captures `body_fn` into the graph for `key` and launches it; on any capture failure graphs are
  // turned off for this model (a warning on stderr) and the step runs eagerly.
  template <typename F>
  void capture(F& body_fn, const std::tuple<int64_t, int64_t, int64_t>& key) {
    const GpuModelStats before = stats;
    const size_t gen0 = g_alloc_gen;
    cudaGraph_t graph = nullptr;
    std::string why;
    bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (!ok) why = "cudaStreamBeginCapture failed";
    if (ok) {
      try {
        body_fn();
      } catch (const std::exception& e) {
        ok = false;
        why = e.what();
      }
      const cudaError_t st = cudaStreamEndCapture(stream, &graph);
      if (st != cudaSuccess) {
        ok = false;
        if (why.empty()) why = cudaGetErrorString(st);
      }
    }
    if (ok && gen0 != g_alloc_gen) {
      ok = false;
      why = "a buffer was reallocated during the capture";
    }
    cudaGraphExec_t exec = nullptr;
    if (ok && cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
      ok = false;
      why = "cudaGraphInstantiate failed";
    }
    if (ok) stats.graph_kernels = kernel_nodes(graph);
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();  // capture errors are not sticky; clear the last one
    Graph gr;
    gr.exec = exec;
    gr.gen = gen0;
    gr.weight_bytes = stats.weight_bytes - before.weight_bytes;  // host-side counts of one step
    gr.expert_gemms = stats.expert_gemms - before.expert_gemms;
    stats.weight_bytes = before.weight_bytes;
    stats.expert_gemms = before.expert_gemms;
    if (!ok) {
      if (exec) cudaGraphExecDestroy(exec);
      graph_failed = true;
      std::fprintf(stderr, "GpuModel: CUDA graph capture failed (%s); decode steps run eagerly\n", why.c_str());
      body_fn();
      return;
    }
    graphs[key] = gr;
    QUADS_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // the capture itself ran nothing
    ++stats.graph_steps;
    stats.weight_bytes += gr.weight_bytes;
    stats.expert_gemms += gr.expert_gemms;
  }
};

GpuModel::GpuModel(const model::ModelConfig& cfg, const model::PrecisionConfig& p)
    : impl_(std::make_unique<Impl>(cfg, p)) {}

GpuModel::GpuModel(const model::Weights& w, const model::PrecisionConfig& p) : GpuModel(w.cfg, p) { sync(w); }

GpuModel::~GpuModel() = default;

const model::ModelConfig& GpuModel::config() const { return impl_->cfg; }
const model::PrecisionConfig& GpuModel::precision() const { return impl_->prec; }

void GpuModel::sync(const model::Weights& w) {
  Impl& m = *impl_;
  QUADS_CHECK(w.data.size() == m.lay.total, "GpuModel::sync: the weights hold {} floats, the model's layout {}",
              w.data.size(), m.lay.total);
  QUADS_CHECK(w.layout.params.size() == m.lay.params.size(), "GpuModel::sync: {} tensors given, the model has {}",
              w.layout.params.size(), m.lay.params.size());
  for (size_t i = 0; i < m.lay.params.size(); ++i)
    QUADS_CHECK(w.layout.params[i].name == m.lay.params[i].name && w.layout.params[i].shape == m.lay.params[i].shape,
                "GpuModel::sync: tensor {} does not match the model's {}", w.layout.params[i].name, m.lay.params[i].name);
  m.master.upload(w.data);
  m.requantize();
  m.clear_graphs();
}

void GpuModel::sync_device(const model::DeviceWeights& w) {
  Impl& m = *impl_;
  QUADS_CHECK(w.device == "cuda" && w.data != nullptr,
              "GpuModel::sync_device: the masters are in {} memory, not this GPU's", w.device.empty() ? "no" : w.device);
  QUADS_CHECK(w.size == m.lay.total, "GpuModel::sync_device: {} floats given, the model's layout has {}", w.size,
              m.lay.total);
  // The producer (a GpuTrainer) may have queued its last writes on its own stream.
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  QUADS_CUDA_CHECK(
      cudaMemcpyAsync(m.master.data(), w.data, sizeof(float) * m.lay.total, cudaMemcpyDeviceToDevice, m.stream));
  m.requantize();
  m.clear_graphs();
}

void GpuModel::download(model::Weights& w) const {
  Impl& m = *impl_;
  QUADS_CHECK(w.data.size() == m.lay.total, "GpuModel::download: the weights hold {} floats, the model's layout {}",
              w.data.size(), m.lay.total);
  QUADS_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  QUADS_CUDA_CHECK(cudaMemcpy(w.data.data(), m.master.data(), sizeof(float) * m.lay.total, cudaMemcpyDeviceToHost));
}

void GpuModel::randomize(uint64_t seed, float stddev) {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.lay.params.size(); ++i) {
    const model::ParamInfo& p = m.lay.params[i];
    if (m.cfg.tie_word_embeddings && p.name == "lm_head.weight") continue;
    if (p.is_matrix())
      kern::fill_normal(m.master.data() + p.offset, static_cast<int64_t>(p.numel), seed + 7919 * i, 0.f, stddev, m.stream);
    else
      kern::fill_normal(m.master.data() + p.offset, static_cast<int64_t>(p.numel), 0, 1.f, 0.f, m.stream);
  }
  m.requantize();
  m.clear_graphs();
}

void GpuModel::set_rac(const model::Model& m) {
  Impl& g = *impl_;
  const auto& cl = m.linears();
  QUADS_CHECK(cl.size() == g.lin.size(), "GpuModel::set_rac: the CPU model has {} linears, the GPU model {}", cl.size(),
              g.lin.size());
  for (size_t i = 0; i < cl.size(); ++i) {
    QUADS_CHECK(cl[i].name == g.lin[i].name && cl[i].num == g.lin[i].num,
                "GpuModel::set_rac: linear {} of the CPU model ({}) does not match the GPU model's {} ({})", cl[i].name,
                cl[i].num.describe(), g.lin[i].name, g.lin[i].num.describe());
    QUADS_CHECK(cl[i].rac_dynamic_count == 0, "GpuModel::set_rac: {} uses dynamic RAC (not on the GPU)", cl[i].name);
  }
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  for (size_t i = 0; i < cl.size(); ++i) g.set_rac(g.lin[i], cl[i].rac_channels, cl[i].rac_quant);
  g.build_grouped_rac();
  QUADS_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  g.clear_graphs();
}

void GpuModel::set_kv_transform(const model::KvTransform& t) {
  Impl& g = *impl_;
  t.validate(g.cfg, "GpuModel::set_kv_transform");
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  upload_each(t.factor, g.kv_factor);
  upload_each(t.shift, g.kv_shift);
  g.kv_quant = t.quantize;
  g.kv_qc = t.qconfig;
  ++g_alloc_gen;  // captured graphs do not have the new kernels
  g.clear_graphs();
}

void GpuModel::set_rac_first_channels(double ratio) {
  Impl& g = *impl_;
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  const model::OperandQuant q = model::RacConfig{}.residual;
  for (DevLinear& L : g.lin) {
    const int64_t count = L.num.act.kind == QuantKind::Quant ? model::rac_count(L.in, ratio) : 0;
    std::vector<int32_t> ch(count);
    for (int64_t c = 0; c < count; ++c) ch[c] = static_cast<int32_t>(c);
    g.set_rac(L, ch, q);
  }
  g.build_grouped_rac();
  QUADS_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  g.clear_graphs();
}

void GpuModel::reset_cache(int num_slots, int64_t max_len) {
  Impl& m = *impl_;
  QUADS_CHECK(num_slots > 0 && max_len > 0, "GpuModel::reset_cache: {} slots of {} positions", num_slots, max_len);
  const size_t n = size_t(m.cfg.num_hidden_layers) * num_slots * max_len * m.cfg.kv_dim();
  QUADS_CUDA_CHECK(cudaDeviceSynchronize());
  m.kc.resize(n);
  m.vc.resize(n);
  m.slots = num_slots;
  m.max_len = max_len;
  m.len.assign(num_slots, 0);
  m.clear_graphs();
}

int GpuModel::num_slots() const { return impl_->slots; }
int64_t GpuModel::max_len() const { return impl_->max_len; }
int64_t GpuModel::length(int slot) const {
  QUADS_CHECK(slot >= 0 && slot < impl_->slots, "GpuModel: slot {} out of range (0..{})", slot, impl_->slots - 1);
  return impl_->len[slot];
}
void GpuModel::clear(int slot) {
  (void)length(slot);
  impl_->len[slot] = 0;
}
void GpuModel::copy(int src, int dst) {
  Impl& m = *impl_;
  (void)length(src);
  (void)length(dst);
  if (src == dst) return;
  const int64_t kvd = m.cfg.kv_dim();
  const size_t cache_layer = size_t(m.slots) * m.max_len * kvd;
  const size_t bytes = sizeof(float) * size_t(m.len[src]) * kvd;
  for (int l = 0; l < m.cfg.num_hidden_layers; ++l) {
    const size_t s = l * cache_layer + size_t(src) * m.max_len * kvd, d = l * cache_layer + size_t(dst) * m.max_len * kvd;
    if (bytes == 0) continue;
    QUADS_CUDA_CHECK(cudaMemcpyAsync(m.kc.data() + d, m.kc.data() + s, bytes, cudaMemcpyDeviceToDevice, m.stream));
    QUADS_CUDA_CHECK(cudaMemcpyAsync(m.vc.data() + d, m.vc.data() + s, bytes, cudaMemcpyDeviceToDevice, m.stream));
  }
  m.len[dst] = m.len[src];
}

namespace {

// A step that measures what the linears are given (the activation error, RAC's energies) takes the
// plain kernels: every linear's input in FP32 through prepare(), the experts one by one; fused
// norms, folded RAC, the grouped experts and X's fragments never materialize some of those inputs.
// Restores the kernel modes and drops the step's measuring outputs when it ends or throws.
struct MeasuringStep {
  GpuModel::Impl& m;
  bool fused, legacy, fold, xfrag;
  MeasuringStep(GpuModel::Impl& g, bool plain)
      : m(g), fused(g.fused_on), legacy(g.legacy_moe), fold(g.rac_fold_on), xfrag(g.xfrag_on) {
    if (!plain) return;
    m.fused_on = m.rac_fold_on = m.xfrag_on = false;
    m.legacy_moe = true;
  }
  ~MeasuringStep() {
    m.recording = false;
    m.probe_out = nullptr;
    m.energy_out = nullptr;
    m.fused_on = fused;
    m.legacy_moe = legacy;
    m.rac_fold_on = fold;
    m.xfrag_on = xfrag;
  }
  MeasuringStep(const MeasuringStep&) = delete;
  MeasuringStep& operator=(const MeasuringStep&) = delete;
};

}  // namespace

std::vector<float> GpuModel::step(const std::vector<model::StepItem>& items, model::Routing* record,
                                  std::map<std::string, rollout::ActError>* act_error) {
  Impl& m = *impl_;
  const MeasuringStep guard(m, act_error != nullptr);
  m.recording = record != nullptr;
  m.probe_out = act_error;
  const int64_t nout = m.run(items);
  m.mark_end();
  std::vector<float> out(size_t(nout) * m.cfg.vocab_size);
  if (nout)
    QUADS_CUDA_CHECK(cudaMemcpy(out.data(), m.logits.data(), sizeof(float) * out.size(), cudaMemcpyDeviceToHost));
  m.check_route(nout > 0);
  m.add_gpu_time(nout > 0);
  m.probe_collect();
  if (record) {
    // As model::Model::step: one entry per layer, [T, K] expert ids for the MoE layers, empty for
    // the dense ones; T the step's tokens in item order.
    const int L = m.cfg.num_hidden_layers, K = m.cfg.num_experts_per_tok;
    int64_t T = 0;
    for (const auto& it : items) T += static_cast<int64_t>(it.tokens.size());
    record->experts.assign(L, {});
    std::vector<int32_t> all(m.cfg.num_experts > 0 ? size_t(L) * T * K : 0);
    if (!all.empty())
      QUADS_CUDA_CHECK(cudaMemcpy(all.data(), m.rec_d.data(), sizeof(int32_t) * all.size(), cudaMemcpyDeviceToHost));
    for (int l = 0; l < L; ++l)
      if (m.cfg.is_sparse(l)) record->experts[l].assign(all.begin() + size_t(l) * T * K, all.begin() + size_t(l + 1) * T * K);
  }
  return out;
}

void GpuModel::rac_energy(const std::vector<model::StepItem>& items, std::map<std::string, std::vector<double>>& energy) {
  Impl& m = *impl_;
  for (const DevLinear& L : m.lin)
    QUADS_CHECK(L.rac_nsel == 0, "GpuModel::rac_energy: {} runs RAC; the calibration pass measures the model without it "
                "(set_rac with a model without channels first)", L.name);
  // Each linear with quantized activations gets its slice of energy_d, starting from the caller's sums.
  m.energy_at.assign(m.lin.size(), SIZE_MAX);
  size_t total = 0;
  bool head = false;
  for (size_t i = 0; i < m.lin.size(); ++i) {
    const DevLinear& L = m.lin[i];
    if (L.num.act.kind != QuantKind::Quant) continue;
    m.energy_at[i] = total;
    total += size_t(L.in);
    head |= int(i) == m.lm_head;
  }
  std::vector<double> host(total, 0.0);
  for (size_t i = 0; i < m.lin.size(); ++i) {
    if (m.energy_at[i] == SIZE_MAX) continue;
    auto it = energy.find(m.lin[i].name);
    if (it == energy.end()) continue;
    QUADS_CHECK(int64_t(it->second.size()) == m.lin[i].in, "GpuModel::rac_energy: energy[{}] holds {} channels, not {}",
                m.lin[i].name, it->second.size(), m.lin[i].in);
    std::copy(it->second.begin(), it->second.end(), host.begin() + m.energy_at[i]);
  }
  m.energy_d.upload(host);
  const MeasuringStep guard(m, true);
  m.energy_out = &energy;
  // The CPU's forward multiplies every row by lm_head; the step does so for the rows it returns.
  std::vector<model::StepItem> all;
  if (head) {
    all = items;
    for (auto& it : all) it.all_logits = true;
  }
  const int64_t nout = m.run(head ? all : items);
  m.mark_end();
  m.check_route(nout > 0);
  m.add_gpu_time(nout > 0);
  if (total) {
    QUADS_CUDA_CHECK(cudaMemcpy(host.data(), m.energy_d.data(), sizeof(double) * total, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < m.lin.size(); ++i)
      if (m.energy_at[i] != SIZE_MAX) {
        const auto from = host.begin() + m.energy_at[i];
        energy[m.lin[i].name].assign(from, from + m.lin[i].in);
      }
  }
}

std::vector<int32_t> GpuModel::step_greedy(const std::vector<model::StepItem>& items) {
  Impl& m = *impl_;
  const int64_t nout = m.run(items);
  std::vector<int32_t> out(nout);
  if (nout) {
    grow(m.argmax, size_t(nout));
    kern::argmax_rows(m.logits.data(), nout, m.cfg.vocab_size, m.argmax.data(), m.stream);
    m.mark_end();
    QUADS_CUDA_CHECK(cudaMemcpy(out.data(), m.argmax.data(), sizeof(int32_t) * nout, cudaMemcpyDeviceToHost));
  }
  m.check_route(nout > 0);
  m.add_gpu_time(nout > 0);
  return out;
}

std::vector<rollout::Draw> GpuModel::step_sample(const std::vector<model::StepItem>& items,
                                                 const std::vector<rollout::SampleJob>& jobs) {
  Impl& m = *impl_;
  const int64_t V = m.cfg.vocab_size;
  if (!m.device_draws(jobs)) {
    const std::vector<float> logits = step(items);
    return rollout::sample_jobs(logits.data(), V, jobs);
  }
  const int64_t nout = m.run(items);
  const int n = static_cast<int>(jobs.size());
  if (n > 0) {
    for (int i = 0; i < n; ++i)
      QUADS_CHECK(jobs[i].row >= 0 && jobs[i].row < nout,
                  "GpuModel::step_sample: job {} reads row {} of a step with {} rows", i, jobs[i].row, nout);
    m.upload_sample_jobs(jobs, 1);
    kern::sample_rows(m.logits.data(), V, m.sample_jobs.data(), n, m.sample_out.data(), m.stream);
  }
  m.mark_end();
  const std::vector<kern::SampleDrawDev> got = m.download_draws(size_t(n));
  m.check_route(nout > 0);
  m.add_gpu_time(nout > 0);
  return Impl::to_draws(got, jobs);
}

std::vector<rollout::Draw> GpuModel::decode_run(std::vector<model::StepItem> items, std::vector<rollout::SampleJob> jobs,
                                                int n) {
  Impl& m = *impl_;
  rollout::check_decode_run(items, jobs, n, "GpuModel");
  const int64_t V = m.cfg.vocab_size;
  if (!m.device_draws(jobs) || items.empty())  // the host draws: a step at a time
    return rollout::decode_stepwise(std::move(items), std::move(jobs), n,
                                    [&](const std::vector<model::StepItem>& it, const std::vector<rollout::SampleJob>& jb) {
                                      return step_sample(it, jb);
                                    });
  const int J = static_cast<int>(jobs.size());
  m.upload_sample_jobs(jobs, n);
  // Every step is queued before any draw comes back: step k + 1's inputs (positions, RoPE) are
  // known on the host, its tokens are step k's draws, written by sample_rows where step k + 1's
  // copy of its inputs leaves them (offset 0 of inbuf).
  struct RunFlags {  // also reset when a step throws
    Impl& m;
    ~RunFlags() { m.fed_tokens = m.in_run = false; }
  } flags{m};
  m.in_run = true;
  for (int k = 0; k < n; ++k) {
    m.fed_tokens = k > 0;
    const int64_t nout = m.run(items);
    QUADS_CHECK(nout == J, "GpuModel::decode_run: a step gave {} rows for {} items", nout, J);
    int32_t* feed = k + 1 < n ? reinterpret_cast<int32_t*>(m.inbuf.data()) : nullptr;
    kern::sample_rows(m.logits.data(), V, m.sample_jobs.data() + size_t(k) * J, J, m.sample_out.data() + size_t(k) * J,
                      m.stream, feed);
  }
  m.fed_tokens = m.in_run = false;
  m.queue_route_flag();
  m.mark_end();
  const std::vector<kern::SampleDrawDev> got = m.download_draws(size_t(n) * J);
  m.check_route(true);
  m.add_gpu_time(true);
  return Impl::to_draws(got, jobs);
}

void GpuModel::set_device_sampling(bool on) { impl_->device_sampling = on; }

GpuLinearMode GpuModel::linear_mode(const std::string& module) const {
  for (const auto& L : impl_->lin)
    if (L.name == module) return L.mode;
  fail("GpuModel: no linear named '{}'", module);
}

size_t GpuModel::weight_bytes() const {
  double b = 0;
  for (const auto& L : impl_->lin) b += L.bytes();
  return static_cast<size_t>(b);
}

// Grouped MoE layers count their weight bytes on the device (experts with rows per layer).
const GpuModelStats& GpuModel::stats() const {
  Impl& m = *impl_;
  m.stats_out = m.stats;
  const std::vector<unsigned long long> active = m.active_d.download(), folded = m.active_fold_d.download();
  for (size_t l = 0; l < m.grouped.size() && l < active.size(); ++l)
    m.stats_out.weight_bytes += double(active[l]) * m.grouped[l].expert_bytes +
                                double(folded[l]) * (m.grouped[l].expert_bytes - m.grouped[l].expert_rac_bytes);
  return m.stats_out;
}
void GpuModel::reset_stats() {
  impl_->stats = {};
  impl_->active_d.fill_bytes(0);
  impl_->active_fold_d.fill_bytes(0);
}

namespace {

class GpuBackend : public rollout::StepBackend {
 public:
  GpuBackend(const model::Weights& w, const model::PrecisionConfig& p) : m_(w, p) {}
  std::string name() const override { return "cuda:" + device_name(0); }
  void sync(const model::Weights& w) override { m_.sync(w); }
  void reset(int num_slots, int64_t max_len) override { m_.reset_cache(num_slots, max_len); }
  std::vector<float> step(const std::vector<model::StepItem>& items) override { return m_.step(items); }
  bool inspects(bool) const override { return true; }
  std::vector<float> step_inspect(const std::vector<model::StepItem>& items, rollout::Inspection& out,
                                  bool act_error) override {
    return m_.step(items, &out.routing, act_error ? &out.act_error : nullptr);
  }
  std::vector<rollout::Draw> step_sample(const std::vector<model::StepItem>& items,
                                         const std::vector<rollout::SampleJob>& jobs) override {
    return m_.step_sample(items, jobs);
  }
  std::vector<rollout::Draw> decode_run(std::vector<model::StepItem> items, std::vector<rollout::SampleJob> jobs,
                                        int n) override {
    return m_.decode_run(std::move(items), std::move(jobs), n);
  }
  void copy(int src, int dst) override { m_.copy(src, dst); }
  void clear(int slot) override { m_.clear(slot); }
  void set_rac(const model::Model& calibrated) override { m_.set_rac(calibrated); }
  void set_kv_transform(const model::KvTransform& t) override {
    m_.set_kv_transform(t);
    kv_ = !t.empty();
  }
  bool has_kv_transform() const override { return kv_; }
  bool calibrates_rac() const override { return true; }
  void step_rac_energy(const std::vector<model::StepItem>& items,
                       std::map<std::string, std::vector<double>>& energy) override {
    m_.rac_energy(items, energy);
  }
  // One process, one GPU: a "cuda" address is this device's.
  bool syncs_from(const model::DeviceWeights& w) const override { return !w.empty() && w.device == "cuda"; }
  void sync_device(const model::DeviceWeights& w) override { m_.sync_device(w); }
  void download(model::Weights& w) const override { m_.download(w); }

 private:
  GpuModel m_;
  bool kv_ = false;
};

}  // namespace

std::unique_ptr<rollout::StepBackend> make_gpu_backend(const model::Weights& w, const model::PrecisionConfig& p) {
  return std::make_unique<GpuBackend>(w, p);
}

}  // namespace quads::cuda
