// cuBLAS / cuBLASLt GEMMs: the BF16 and FP8 baselines, and the native NVFP4 path on Blackwell.
// All compute Y[M, N] = X[M, K] . W[N, K]^T with row-major Y. cuBLAS is column-major, so each call
// computes Y^T = W . X^T: A = W (stored [N, K] row-major = K x N column-major, transposed),
// B = X (K x M column-major), D = Y^T (N x M column-major, ld N): the "TN" layout FP8 and FP4 need.
// The native FP4 path needs no sm_100a device code of ours: cuBLASLt brings its own kernels, and
// the two small helper kernels here run from the embedded compute_90 PTX on any newer GPU.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "cuda/gemm.h"

namespace quads::cuda {

// A cuBLASLt matmul set up once per (kind, m, n, k, accumulate): descriptors and the heuristic's
// first algorithm.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~LtPlan() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

struct Blas::Impl {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  DeviceArray<uint8_t> workspace;
  DeviceArray<float> consts;  // [alpha, beta=0, beta=1] for device pointer mode
  std::map<std::tuple<int, int64_t, int64_t, int64_t>, std::unique_ptr<LtPlan>> plans;
};

Blas::Blas() : impl_(std::make_unique<Impl>()) {
  QUADS_CUBLAS_CHECK(cublasCreate(&impl_->blas));
  QUADS_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
  QUADS_CUBLAS_CHECK(cublasSetMathMode(impl_->blas, CUBLAS_DEFAULT_MATH));
  impl_->workspace.resize(64u << 20);
  QUADS_CUBLAS_CHECK(cublasSetWorkspace(impl_->blas, impl_->workspace.data(), impl_->workspace.bytes()));
  impl_->consts.upload(std::vector<float>{1.f, 0.f, 1.f});
}
Blas::~Blas() {
  impl_->plans.clear();
  if (impl_->lt) cublasLtDestroy(impl_->lt);
  if (impl_->blas) cublasDestroy(impl_->blas);
}

void gemm_bf16(Blas& blas, const uint16_t* x, const uint16_t* w, float* y, int64_t m, int64_t n, int64_t k,
               cudaStream_t s) {
  if (m == 0 || n == 0) return;
  auto& B = blas.impl();
  // cublasSetStream resets the handle's workspace to cuBLAS's default pool: ours is set again, so
  // no GEMM allocates (CUDA graph capture).
  QUADS_CUBLAS_CHECK(cublasSetStream(B.blas, s));
  QUADS_CUBLAS_CHECK(cublasSetWorkspace(B.blas, B.workspace.data(), B.workspace.bytes()));
  const float alpha = 1.f, beta = 0.f;
  QUADS_CUBLAS_CHECK(cublasGemmEx(B.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                  static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), x, CUDA_R_16BF,
                                  static_cast<int>(k), &beta, y, CUDA_R_32F, static_cast<int>(n),
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

namespace {

enum PlanKind { kFp8 = 0, kFp4 = 1 };

LtPlan& get_plan(Blas::Impl& B, PlanKind kind, int64_t m, int64_t n, int64_t k) {
  auto key = std::make_tuple(static_cast<int>(kind), m, n, k);
  auto it = B.plans.find(key);
  if (it != B.plans.end()) return *it->second;
  auto plan = std::make_unique<LtPlan>();
  const cudaDataType_t dt = kind == kFp8 ? CUDA_R_8F_E4M3 : CUDA_R_4F_E2M1;
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (kind != kFp8) {
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode)));
    QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode)));
    const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof(pm)));
  }
  QUADS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, dt, k, n, k));
  QUADS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, dt, k, m, k));
  QUADS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, n, m, n));
  cublasLtMatmulPreference_t pref = nullptr;
  QUADS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = B.workspace.bytes();
  QUADS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(B.lt, plan->op, plan->a, plan->b, plan->d, plan->d, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  QUADS_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
              "cuBLASLt has no {} GEMM for m={} n={} k={} on this GPU ({})", kind == kFp8 ? "FP8 E4M3" : "NVFP4", m, n,
              k, cublasGetStatusName(st));
  plan->algo = res.algo;
  auto& ref = *plan;
  B.plans.emplace(key, std::move(plan));
  return ref;
}

__global__ void nvfp4_alpha_kernel(const float* xamax, const float* wamax, int x_per_row, float* alpha) {
  const float inv = 1.f / 2688.f;
  alpha[0] = x_per_row ? wamax[0] * inv : (xamax[0] * inv) * (wamax[0] * inv);
}
__global__ void scale_rows_kernel(float* y, const float* xamax, int64_t m, int64_t n) {
  const float inv = 1.f / 2688.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] *= xamax[i / n] * inv;
}

}  // namespace

void gemm_fp8(Blas& blas, const uint8_t* x, const float* x_scale, const uint8_t* w, const float* w_scale, float* y,
              int64_t m, int64_t n, int64_t k, cudaStream_t s) {
  QUADS_CHECK(k % 16 == 0, "gemm_fp8: K = {} must be a multiple of 16", k);
  if (m == 0 || n == 0) return;
  auto& B = blas.impl();
  LtPlan& p = get_plan(B, kFp8, m, n, k);
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale)));
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale)));
  const float alpha = 1.f, beta = 0.f;
  QUADS_CUBLAS_CHECK(cublasLtMatmul(B.lt, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.d, y, p.d, &p.algo,
                                    B.workspace.data(), B.workspace.bytes(), s));
}

bool nvfp4_native_available() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  return major == 10;
}

void w4a4_gemm_native(Blas& blas, const DeviceQTensor& x, const DeviceQTensor& w, float* y, cudaStream_t s) {
  QUADS_CHECK(nvfp4_native_available(), "w4a4_gemm_native: this GPU has no native FP4 GEMM (needs compute capability 10.x)");
  for (const DeviceQTensor* q : {&x, &w})
    QUADS_CHECK(q->cfg.scheme == num::Scheme::NVFP4 && q->cfg.element == num::Format::E2M1 &&
                    q->layout == ScaleLayout::Swizzled128x4,
                "w4a4_gemm_native: operands must be NVFP4 E2M1 with swizzled scales, got {}", q->cfg.describe());
  QUADS_CHECK(w.cfg.global != num::Global::PerRow, "w4a4_gemm_native: W needs one global scale");
  QUADS_CHECK(x.cols == w.cols && x.cols % 32 == 0, "w4a4_gemm_native: X [{}, {}], W [{}, {}]", x.rows, x.cols, w.rows, w.cols);
  const int64_t m = x.rows, n = w.rows, k = x.cols;
  if (m == 0 || n == 0) return;
  auto& B = blas.impl();
  LtPlan& p = get_plan(B, kFp4, m, n, k);
  const void* as = w.scales.data();
  const void* bs = x.scales.data();
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof(as)));
  QUADS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof(bs)));
  const bool per_row = x.cfg.global == num::Global::PerRow;
  float* alpha = B.consts.data();
  nvfp4_alpha_kernel<<<1, 1, 0, s>>>(x.amax.data(), w.amax.data(), per_row, alpha);
  QUADS_CUDA_LAUNCH_CHECK();
  QUADS_CUBLAS_CHECK(cublasLtMatmul(B.lt, p.op, alpha, w.codes.data(), p.a, x.codes.data(), p.b, B.consts.data() + 1, y,
                                    p.d, y, p.d, &p.algo, B.workspace.data(), B.workspace.bytes(), s));
  if (per_row) {
    scale_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>((m * n + 255) / 256, 4096)), 256, 0, s>>>(y, x.amax.data(), m, n);
    QUADS_CUDA_LAUNCH_CHECK();
  }
}

void w4a4_gemm(Blas& blas, const DeviceQTensor& x, const DeviceQTensor& w, float* y, bool accumulate, cudaStream_t s) {
  if (!accumulate && nvfp4_native_available() && x.layout == ScaleLayout::Swizzled128x4 &&
      w.layout == ScaleLayout::Swizzled128x4) {
    w4a4_gemm_native(blas, x, w, y, s);
    return;
  }
  w4a4_gemm_emulated(nvfp4_view(x, "w4a4_gemm: X"), nvfp4_view(w, "w4a4_gemm: W"), y, accumulate, s);
}

}  // namespace quads::cuda
