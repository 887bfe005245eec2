#include "cpu/ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/gemm.h"

namespace quads::cpu {

namespace {
// Column blocks for reductions over rows that are parallel over columns (deterministic: each
// column is summed by one thread, rows in order).
constexpr int64_t kColBlock = 64;
// Below this many elements an op runs on one thread: a parallel region costs more than it saves
// (and far more when the machine is oversubscribed).
constexpr int64_t kParallelMin = int64_t(1) << 15;
}  // namespace

// ---------------------------------------------------------------------------------------------
// RMSNorm

void rmsnorm_forward(const float* x, const float* w, int64_t rows, int64_t D, float eps, float* y, float* inv_rms) {
#pragma omp parallel for schedule(static) if (rows * D > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * double(xr[i]);
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / double(D) + double(eps)));
    if (inv_rms) inv_rms[r] = inv;
    float* yr = y + r * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* inv_rms, int64_t rows, int64_t D,
                      float* dx, float* dw) {
  // y_i = w_i x_i r with r = (mean(x^2) + eps)^-1/2:
  // dx_j = r w_j dy_j - x_j r^3 / D * sum_i dy_i w_i x_i
#pragma omp parallel for schedule(static) if (rows * D > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float* dyr = dy + r * D;
    const double inv = inv_rms[r];
    double dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += double(dyr[i]) * double(w[i]) * double(xr[i]);
    const double c = dot * inv * inv * inv / double(D);
    float* dxr = dx + r * D;
    for (int64_t i = 0; i < D; ++i) dxr[i] = static_cast<float>(inv * double(w[i]) * double(dyr[i]) - double(xr[i]) * c);
  }
  if (!dw) return;
  const int64_t nblk = (D + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (rows * D > kParallelMin)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t c0 = b * kColBlock, c1 = std::min(D, c0 + kColBlock);
    double acc[kColBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const double inv = inv_rms[r];
      for (int64_t i = c0; i < c1; ++i) acc[i - c0] += double(dy[r * D + i]) * double(x[r * D + i]) * inv;
    }
    for (int64_t i = c0; i < c1; ++i) dw[i] += static_cast<float>(acc[i - c0]);
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE

void rope_tables(const int64_t* pos, int64_t n, int hd, double theta, float* cos, float* sin) {
  const int half = hd / 2;
  // As HF computes it in float32: inv_freq = 1 / theta ** (arange(0, hd, 2) / hd), angle = pos * inv_freq.
  // Positions repeat across sequences and steps: the values are cached per thread, per (theta, hd).
  struct Table {
    double theta = 0;
    int hd = 0;
    std::vector<float> inv_freq, cos, sin;  // [npos, half]
  };
  thread_local Table tab;
  if (tab.theta != theta || tab.hd != hd) {
    tab = Table{};
    tab.theta = theta;
    tab.hd = hd;
    tab.inv_freq.resize(half);
    const float base = static_cast<float>(theta);
    for (int i = 0; i < half; ++i) {
      const float e = static_cast<float>(2 * i) / static_cast<float>(hd);
      tab.inv_freq[i] = 1.0f / static_cast<float>(std::pow(double(base), double(e)));
    }
  }
  int64_t maxpos = -1;
  for (int64_t t = 0; t < n; ++t) maxpos = std::max(maxpos, pos[t]);
  const int64_t have = static_cast<int64_t>(tab.cos.size()) / std::max(half, 1);
  if (maxpos >= have) {
    const int64_t npos = std::max(maxpos + 1, 2 * have);
    tab.cos.resize(npos * half);
    tab.sin.resize(npos * half);
    for (int64_t p = have; p < npos; ++p)
      for (int i = 0; i < half; ++i) {
        const float a = static_cast<float>(p) * tab.inv_freq[i];
        tab.cos[p * half + i] = static_cast<float>(std::cos(double(a)));
        tab.sin[p * half + i] = static_cast<float>(std::sin(double(a)));
      }
  }
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(cos + t * half, tab.cos.data() + pos[t] * half, sizeof(float) * half);
    std::memcpy(sin + t * half, tab.sin.data() + pos[t] * half, sizeof(float) * half);
  }
}

void rope_forward(float* x, int64_t n, int heads, int hd, const float* cos, const float* sin) {
  const int half = hd / 2;
#pragma omp parallel for schedule(static) if (n * heads * hd > kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * hd;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

void rope_backward(float* dx, int64_t n, int heads, int hd, const float* cos, const float* sin) {
  const int half = hd / 2;
#pragma omp parallel for schedule(static) if (n * heads * hd > kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int h = 0; h < heads; ++h) {
      float* v = dx + (t * heads + h) * hd;
      for (int i = 0; i < half; ++i) {
        const float da = v[i], db = v[i + half];
        v[i] = da * c[i] + db * s[i];
        v[i + half] = db * c[i] - da * s[i];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention

void attention_forward(const float* q, const float* k, const float* v, int64_t n, int64_t L, int nh, int nkv, int hd,
                       float scale, float* out, float* lse) {
  const int group = nh / nkv;
  const int64_t start = L - n;
  const int64_t work = n * nh;
#pragma omp parallel if (work * L * hd > 8 * kParallelMin)
  {
    std::vector<float> s(L), acc(hd);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t i = w / nh;
      const int h = static_cast<int>(w % nh);
      const int g = h / group;
      const int64_t p = start + i;
      const float* qi = q + (i * nh + h) * hd;
      // s_j = (q · k_j) * scale, each dot product computed as dot_rowinv does.
      gemm_nt_rowinv(1, p + 1, hd, qi, hd, k + g * hd, int64_t(nkv) * hd, s.data(), p + 1);
      float m = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        s[j] *= scale;
        m = std::max(m, s[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j <= p; ++j) {
        s[j] = std::exp(s[j] - m);
        sum += s[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      // out = sum_j p_j v_j, keys in order (a local accumulator so that the loop vectorizes).
      float* __restrict a = acc.data();
      for (int d = 0; d < hd; ++d) a[d] = 0.f;
      for (int64_t j = 0; j <= p; ++j) {
        const float pj = s[j] * inv;
        const float* __restrict vj = v + (j * nkv + g) * hd;
#pragma omp simd
        for (int d = 0; d < hd; ++d) a[d] += pj * vj[d];
      }
      std::copy(a, a + hd, out + (i * nh + h) * hd);
      if (lse) lse[i * nh + h] = static_cast<float>(double(m) + std::log(sum));
    }
  }
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t n, int64_t L, int nh, int nkv, int hd, float scale, float* dq,
                        float* dk, float* dv) {
  const int group = nh / nkv;
  const int64_t start = L - n;
  // Per query head: dq directly, dk/dv into a private [L, hd] buffer; the heads of one kv group are
  // then added in head order. Blocks of queries go through OpenBLAS (the backward need not be
  // row-invariant): S = Q Kᵀ, P = exp(S * scale - lse) (causal), dP = dO Vᵀ, dS = P (dP - D) * scale,
  // dQ = dS K, dK += dSᵀ Q, dV += Pᵀ dO.
  // Scratch kept per thread between calls (one call per layer and sequence). The OpenMP regions
  // below reach it through plain pointers: inside them a thread_local name would be each worker's
  // own (empty) copy.
  thread_local std::vector<float> dkh, dvh, P, dP;
  const size_t per_head = static_cast<size_t>(L) * hd;
  dkh.assign(nh * per_head, 0.f);
  dvh.assign(nh * per_head, 0.f);
  const int64_t Bq = 64;
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  if (P.size() < static_cast<size_t>(Bq * L)) {
    P.resize(Bq * L);
    dP.resize(Bq * L);
  }
  float* const Pd = P.data();
  float* const dPd = dP.data();
  const float* const dkhd = dkh.data();
  const float* const dvhd = dvh.data();
  for (int h = 0; h < nh; ++h) {
    const int g = h / group;
    float* dk_ = dkh.data() + static_cast<size_t>(h) * L * hd;
    float* dv_ = dvh.data() + static_cast<size_t>(h) * L * hd;
    const float* kg = k + g * hd;
    const float* vg = v + g * hd;
    for (int64_t i0 = 0; i0 < n; i0 += Bq) {
      const int64_t nb = std::min(Bq, n - i0);
      const int64_t Lb = start + i0 + nb;  // keys seen by the last query of the block
      const float* qb = q + i0 * ldq + h * hd;
      const float* dob = dout + i0 * ldq + h * hd;
      gemm_nt(nb, Lb, hd, qb, ldq, kg, ldk, Pd, Lb);
      gemm_nt(nb, Lb, hd, dob, ldq, vg, ldk, dPd, Lb);
#pragma omp parallel for schedule(static) if (nb * Lb > kParallelMin)
      for (int64_t r = 0; r < nb; ++r) {
        const int64_t i = i0 + r, p = start + i;
        const float* doi = dout + i * ldq + h * hd;
        const float* oi = out + i * ldq + h * hd;
        double D = 0;
        for (int d = 0; d < hd; ++d) D += double(doi[d]) * double(oi[d]);
        const float Df = static_cast<float>(D), l = lse[i * nh + h];
        float* pr = Pd + r * Lb;
        float* dpr = dPd + r * Lb;
        for (int64_t j = 0; j < Lb; ++j) {
          const float pj = j <= p ? std::exp(pr[j] * scale - l) : 0.f;
          pr[j] = pj;
          dpr[j] = pj * (dpr[j] - Df) * scale;  // dS
        }
      }
      gemm_nn(nb, Lb, hd, dPd, Lb, kg, ldk, dq + i0 * ldq + h * hd, ldq);
      gemm_tn_acc(nb, Lb, hd, dPd, Lb, qb, ldq, dk_, hd);
      gemm_tn_acc(nb, Lb, hd, Pd, Lb, dob, ldq, dv_, hd);
    }
  }
#pragma omp parallel for schedule(static) if (L * nkv * hd > kParallelMin)
  for (int64_t j = 0; j < L; ++j)
    for (int g = 0; g < nkv; ++g) {
      float* dkj = dk + (j * nkv + g) * hd;
      float* dvj = dv + (j * nkv + g) * hd;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const float* a = dkhd + (static_cast<size_t>(h) * L + j) * hd;
        const float* b = dvhd + (static_cast<size_t>(h) * L + j) * hd;
        for (int d = 0; d < hd; ++d) {
          dkj[d] += a[d];
          dvj[d] += b[d];
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax

void softmax_forward(const float* x, int64_t rows, int64_t cols, float* y) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float m = -INFINITY;
    for (int64_t i = 0; i < cols; ++i) m = std::max(m, xr[i]);
    double sum = 0;
    for (int64_t i = 0; i < cols; ++i) {
      yr[i] = std::exp(xr[i] - m);
      sum += yr[i];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < cols; ++i) yr[i] *= inv;
  }
}

void softmax_backward(const float* y, const float* dy, int64_t rows, int64_t cols, float* dx) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    double s = 0;
    for (int64_t i = 0; i < cols; ++i) s += double(yr[i]) * double(dyr[i]);
    for (int64_t i = 0; i < cols; ++i) dx[r * cols + i] = static_cast<float>(double(yr[i]) * (double(dyr[i]) - s));
  }
}

// ---------------------------------------------------------------------------------------------
// Router

void router_topk_forward(const float* logits, int64_t T, int E, int k, bool norm_topk, float* probs, int32_t* idx,
                         float* w, const int32_t* forced) {
  softmax_forward(logits, T, E, probs);
#pragma omp parallel for schedule(static) if (T * E > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs + t * E;
    int32_t* it = idx + t * k;
    if (forced) {
      for (int s = 0; s < k; ++s) it[s] = forced[t * k + s];
    } else {
      // Selection by repeated arg-max; a strict > keeps the lower expert id on ties.
      for (int s = 0; s < k; ++s) {
        int best = -1;
        for (int e = 0; e < E; ++e) {
          bool taken = false;
          for (int r = 0; r < s; ++r) taken |= (it[r] == e);
          if (taken) continue;
          if (best < 0 || p[e] > p[best]) best = e;
        }
        it[s] = best;
      }
    }
    float sum = 0;
    for (int s = 0; s < k; ++s) {
      w[t * k + s] = p[it[s]];
      sum += p[it[s]];
    }
    if (norm_topk)
      for (int s = 0; s < k; ++s) w[t * k + s] /= sum;
  }
}

void router_logsumexp(const float* rlogits, int64_t T, int E, double* z) {
  for (int64_t t = 0; t < T; ++t) {
    const float* r = rlogits + t * E;
    const float mx = *std::max_element(r, r + E);
    double s = 0;
    for (int e = 0; e < E; ++e) s += std::exp(double(r[e]) - mx);
    z[t] = mx + std::log(s);
  }
}

void router_zloss_backward(const float* probs, const double* g, int64_t T, int E, float* dlog) {
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) dlog[t * E + e] += static_cast<float>(g[t] * probs[t * E + e]);
}

void router_topk_backward(const float* probs, const int32_t* idx, const float* w, const float* dw,
                          const float* dprobs_extra, int64_t T, int E, int k, bool norm_topk, float* dlogits) {
#pragma omp parallel for schedule(static) if (T * E > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> dp(E, 0.0);
    if (dprobs_extra)
      for (int e = 0; e < E; ++e) dp[e] = dprobs_extra[t * E + e];
    const float* p = probs + t * E;
    if (norm_topk) {
      // w_s = p_s / S, S = sum of the selected p: dp_j = (dw_j - sum_s dw_s w_s) / S
      double S = 0, c = 0;
      for (int s = 0; s < k; ++s) {
        S += p[idx[t * k + s]];
        c += double(dw[t * k + s]) * double(w[t * k + s]);
      }
      for (int s = 0; s < k; ++s) dp[idx[t * k + s]] += (double(dw[t * k + s]) - c) / S;
    } else {
      for (int s = 0; s < k; ++s) dp[idx[t * k + s]] += dw[t * k + s];
    }
    double dot = 0;
    for (int e = 0; e < E; ++e) dot += double(p[e]) * dp[e];
    for (int e = 0; e < E; ++e) dlogits[t * E + e] = static_cast<float>(double(p[e]) * (dp[e] - dot));
  }
}

// ---------------------------------------------------------------------------------------------
// MoE permutation

void moe_permute(const int32_t* idx, int64_t T, int k, int E, int64_t* offsets, int32_t* perm, int32_t* inv) {
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) count[idx[i] + 1]++;
  for (int e = 0; e < E; ++e) count[e + 1] += count[e];
  for (int e = 0; e <= E; ++e) offsets[e] = count[e];
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t r = count[idx[i]]++;
    perm[r] = static_cast<int32_t>(i);
    inv[i] = static_cast<int32_t>(r);
  }
}

void moe_gather(const float* x, const int32_t* perm, int64_t n, int k, int64_t D, float* xe) {
#pragma omp parallel for schedule(static) if (n * D > kParallelMin)
  for (int64_t r = 0; r < n; ++r) std::memcpy(xe + r * D, x + (perm[r] / k) * D, sizeof(float) * D);
}

void moe_scatter_add(const float* dxe, const int32_t* inv, int64_t T, int k, int64_t D, float* dx, bool accumulate) {
#pragma omp parallel for schedule(static) if (T * D > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    float* d = dx + t * D;
    if (!accumulate) std::fill(d, d + D, 0.f);
    for (int s = 0; s < k; ++s) {
      const float* src = dxe + int64_t(inv[t * k + s]) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) d[i] += src[i];
    }
  }
}

void moe_combine_forward(const float* ye, const int32_t* inv, const float* w, int64_t T, int k, int64_t D, float* y) {
#pragma omp parallel for schedule(static) if (T * D > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    float* yt = y + t * D;
    std::fill(yt, yt + D, 0.f);
    for (int s = 0; s < k; ++s) {
      const float ws = w[t * k + s];
      const float* src = ye + int64_t(inv[t * k + s]) * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) yt[i] += ws * src[i];
    }
  }
}

void moe_combine_backward(const float* dy, const float* ye, const int32_t* inv, const float* w, int64_t T, int k,
                          int64_t D, float* dye, float* dw) {
#pragma omp parallel for schedule(static) if (T * D > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const float* dyt = dy + t * D;
    for (int s = 0; s < k; ++s) {
      const int64_t r = inv[t * k + s];
      const float ws = w[t * k + s];
      const float* yr = ye + r * D;
      float* dr = dye + r * D;
      double acc = 0;
      for (int64_t i = 0; i < D; ++i) {
        dr[i] = ws * dyt[i];
        acc += double(dyt[i]) * double(yr[i]);
      }
      dw[t * k + s] = static_cast<float>(acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

void swiglu_forward(const float* gu, int64_t n, int64_t I, float* h) {
#pragma omp parallel for schedule(static) if (n * I > kParallelMin)
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* hr = h + r * I;
    for (int64_t i = 0; i < I; ++i) hr[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
  }
}

void swiglu_backward(const float* gu, const float* dh, int64_t n, int64_t I, float* dgu) {
#pragma omp parallel for schedule(static) if (n * I > kParallelMin)
  for (int64_t r = 0; r < n; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    const float* d = dh + r * I;
    float* dg = dgu + r * 2 * I;
    float* du = dg + I;
    for (int64_t i = 0; i < I; ++i) {
      const double sg = 1.0 / (1.0 + std::exp(-double(g[i])));
      const double silu = double(g[i]) * sg;
      dg[i] = static_cast<float>(double(d[i]) * double(u[i]) * sg * (1.0 + double(g[i]) * (1.0 - sg)));
      du[i] = static_cast<float>(double(d[i]) * silu);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding

void embedding_forward(const float* table, const int32_t* tokens, int64_t T, int64_t H, float* out) {
#pragma omp parallel for schedule(static) if (T * H > kParallelMin)
  for (int64_t t = 0; t < T; ++t) std::memcpy(out + t * H, table + int64_t(tokens[t]) * H, sizeof(float) * H);
}

void embedding_backward(const float* dout, const int32_t* tokens, int64_t T, int64_t H, float* dtable) {
  const int64_t nblk = (H + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (T * H > kParallelMin)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t c0 = b * kColBlock, c1 = std::min(H, c0 + kColBlock);
    for (int64_t t = 0; t < T; ++t) {
      float* d = dtable + int64_t(tokens[t]) * H;
      const float* s = dout + t * H;
#pragma omp simd
      for (int64_t i = c0; i < c1; ++i) d[i] += s[i];
    }
  }
}

void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace quads::cpu
