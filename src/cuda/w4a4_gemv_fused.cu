// The W4A4 GEMV with the activation quantizer fused into its prologue (gemm.h: FusedAct); the
// kernel is w4a4_gemv.cuh's GEMV with FUSE = 1 (FP32 rows) or 2 (SwiGLU of two sources).
#include "cuda/w4a4_gemv.cuh"

namespace quads::cuda {

namespace {

// What the fused prologue reproduces of quantize(): NVFP4 E2M1 1x16, round to nearest even, an
// amax per row or static (a per-tensor amax needs all rows before any CTA could start).
bool fused_config_ok(const num::QConfig& c, int64_t k) {
  return c.scheme == num::Scheme::NVFP4 && c.element == num::Format::E2M1 && c.block == num::Block::B1x16 &&
         (c.global == num::Global::PerRow || c.global == num::Global::Static) && !c.stochastic && k > 0 &&
         k % 64 == 0 && gemv_plan(k, 1, 1).R > 0;
}

Params fused_params(const FusedAct& a, const Nvfp4View& w, float* y, bool accumulate, const char* what) {
  QUADS_CHECK(fused_config_ok(a.cfg, a.k), "{}: no fused quantizer for activations {} with K = {} (ask w4a4_gemv_fused_supported)",
              what, a.cfg.describe(), a.k);
  QUADS_CHECK(a.k == w.k, "{}: X has K = {} but W is [{}, {}]", what, a.k, w.rows, w.k);
  QUADS_CHECK(a.x && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.u) % 16 == 0,
              "{}: the activation rows must be 16-byte aligned device pointers", what);
  QUADS_CHECK(a.ld >= a.k && a.ld % 4 == 0, "{}: row stride {} must be >= K = {} and a multiple of 4", what, a.ld, a.k);
  QUADS_CHECK(a.map_div >= 1, "{}: map_div = {} must be >= 1", what, a.map_div);
  Nvfp4View x;
  x.rows = a.rows;
  x.k = a.k;
  Params p = make_params(x, w, y, accumulate);
  p.fx = a.x;
  p.fu = a.u;
  p.fld = a.ld;
  p.fmap = a.map;
  p.fmap_div = a.map_div;
  p.fstatic = a.cfg.global == num::Global::Static;
  p.fstatic_amax = a.cfg.static_amax;
  p.early_w = a.weights_ready;
  return p;
}

}  // namespace

bool w4a4_gemv_fused_supported(const num::QConfig& act, int64_t k, int64_t max_rows_per_weight) {
  return fused_config_ok(act, k) && max_rows_per_weight >= 1 && max_rows_per_weight <= kGemvFusedMaxRows;
}

void w4a4_gemv_fused(const FusedAct& a, const Nvfp4View& w, float* y, bool accumulate, cudaStream_t s) {
  Params p = fused_params(a, w, y, accumulate, "w4a4_gemv_fused");
  if (a.rows == 0 || w.rows == 0) return;
  if (a.u) launch_gemv<false, false, 2>(p, gemv_plan(p.K, p.M, p.N), 1, s);
  else launch_gemv<false, false, 1>(p, gemv_plan(p.K, p.M, p.N), 1, s);
}

void w4a4_gemv_fused_grouped(const FusedAct& a, const Nvfp4Weight* w_table, bool w_amax_per_row, int64_t n, int groups,
                             const int32_t* eoff, int64_t max_rows, float* y, cudaStream_t s) {
  QUADS_CHECK(groups > 0 && groups <= 65535, "w4a4_gemv_fused_grouped: {} groups (1..65535)", groups);
  Nvfp4View w;
  w.rows = n;
  w.k = a.k;
  w.amax_per_row = w_amax_per_row;
  FusedAct ag = a;
  ag.weights_ready = false;  // the weights come from the table, after eoff: nothing to start early
  Params p = fused_params(ag, w, y, false, "w4a4_gemv_fused_grouped");
  if (a.rows == 0 || n == 0 || max_rows <= 0) return;
  p.M = std::min(max_rows, a.rows);
  p.Mtot = a.rows;
  p.eoff = eoff;
  p.wtab = w_table;
  p.groups = groups;
  const GemvPlan g = gemv_plan_grouped(p, groups);
  const int64_t grid_y = std::min<int64_t>(groups, p.Mtot);
  if (a.u) launch_gemv<false, true, 2>(p, g, grid_y, s);
  else launch_gemv<false, true, 1>(p, g, grid_y, s);
}
}  // namespace quads::cuda
