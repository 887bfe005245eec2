#include "model/linear.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstring>

#include <fmt/format.h>

#include "common/error.h"
#include "numerics/formats.h"

namespace quads::model {

namespace {

bool same_qconfig(const num::QConfig& a, const num::QConfig& b) {
  return a.scheme == b.scheme && a.block == b.block && a.global == b.global && a.element == b.element &&
         a.mx_rule == b.mx_rule && a.static_amax == b.static_amax && a.stochastic == b.stochastic && a.seed == b.seed;
}

num::QConfig nvfp4_act_per_token() {
  num::QConfig c;
  c.global = num::Global::PerRow;
  return c;
}

bool regex_search(const std::string& pattern, const std::string& subject) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), PCRE2_ZERO_TERMINATED, 0, &err, &off,
                                 nullptr);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    fail("precision filter: invalid regular expression '{}' at offset {}: {}", pattern, off,
         reinterpret_cast<const char*>(msg));
  }
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  const int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(subject.c_str()), subject.size(), 0, 0, md, nullptr);
  pcre2_match_data_free(md);
  pcre2_code_free(re);
  QUADS_CHECK(rc >= 0 || rc == PCRE2_ERROR_NOMATCH, "precision filter '{}': matching '{}' failed ({})", pattern,
              subject, rc);
  return rc >= 0;
}

}  // namespace

bool OperandQuant::operator==(const OperandQuant& o) const {
  if (kind != o.kind) return false;
  return kind != QuantKind::Quant || same_qconfig(cfg, o.cfg);
}

std::string OperandQuant::describe() const {
  switch (kind) {
    case QuantKind::None: return "fp32";
    case QuantKind::BF16: return "bf16";
    case QuantKind::Quant: return cfg.describe();
  }
  return "?";
}

bool OperandQuant::row_local() const {
  if (kind != QuantKind::Quant) return true;
  switch (cfg.scheme) {
    case num::Scheme::NVFP4:
      return cfg.block == num::Block::B1x16 && cfg.global != num::Global::PerTensor;
    case num::Scheme::MXFP4:
      return true;
    case num::Scheme::FP8:
      return cfg.block == num::Block::PerRow || cfg.block == num::Block::B1x128;
  }
  return false;
}

std::string LinearNumerics::describe() const { return fmt::format("w={} a={}", weight.describe(), act.describe()); }

// ---------------------------------------------------------------------------------------------
// Presets

std::vector<std::string> PrecisionConfig::preset_names() {
  return {"fp32",         "bf16",         "fp8",         "fp8-tensor", "nvfp4", "nvfp4-2d", "nvfp4-tensor",
          "nvfp4-static", "nvfp4-w4a16", "mxfp4",       "qat",        "qat-sym"};
}

PrecisionConfig PrecisionConfig::preset(const std::string& name) {
  PrecisionConfig p;
  p.name = name;
  const OperandQuant bf = OperandQuant::bf16();
  const OperandQuant w_nvfp4 = OperandQuant::quant(num::QConfig::nvfp4_weight(false));
  const OperandQuant a_nvfp4 = OperandQuant::quant(nvfp4_act_per_token());
  p.high = {bf, bf};
  if (name == "fp32") {
    p.high = {};
    p.quant = {};
  } else if (name == "bf16") {
    p.quant = {bf, bf};
  } else if (name == "fp8") {
    p.quant = {OperandQuant::quant(num::QConfig::fp8(num::Block::B128x128)),
               OperandQuant::quant(num::QConfig::fp8(num::Block::B1x128))};
  } else if (name == "fp8-tensor") {
    p.quant = {OperandQuant::quant(num::QConfig::fp8(num::Block::PerTensor)),
               OperandQuant::quant(num::QConfig::fp8(num::Block::PerTensor))};
  } else if (name == "nvfp4") {
    p.quant = {w_nvfp4, a_nvfp4};
  } else if (name == "nvfp4-2d") {
    p.quant = {OperandQuant::quant(num::QConfig::nvfp4_weight(true)), a_nvfp4};
  } else if (name == "nvfp4-tensor") {
    p.quant = {w_nvfp4, OperandQuant::quant(num::QConfig::nvfp4_act())};
  } else if (name == "nvfp4-static") {
    num::QConfig c;
    c.global = num::Global::Static;
    p.quant = {w_nvfp4, OperandQuant::quant(c)};
  } else if (name == "nvfp4-w4a16") {
    p.quant = {w_nvfp4, bf};
  } else if (name == "mxfp4") {
    p.quant = {OperandQuant::quant(num::QConfig::mxfp4()), OperandQuant::quant(num::QConfig::mxfp4())};
  } else if (name == "qat") {
    p.quant = {w_nvfp4, bf};
  } else if (name == "qat-sym") {
    p.quant = {w_nvfp4, a_nvfp4};
  } else {
    std::string all;
    for (const auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    fail("unknown precision mode '{}' (known: {})", name, all);
  }
  return p;
}

LinearNumerics PrecisionConfig::for_linear(const std::string& module, int layer, int num_layers) const {
  const bool is_router = module.size() >= 9 && module.compare(module.size() - 9, 9, ".mlp.gate") == 0;
  const bool is_lm_head = module == "lm_head";
  if (is_router && !quantize_router) return high;
  if (is_lm_head && !quantize_lm_head) return high;
  if (layer >= 0 && keep_last_high > 0 && layer >= num_layers - keep_last_high) return high;
  if (!filter.empty() && !regex_search(filter, module)) return high;
  return quant;
}

bool PrecisionConfig::batch_invariant() const {
  return quant.act.row_local() && high.act.row_local();
}

std::string PrecisionConfig::describe() const {
  std::string s = fmt::format("{}: quantized linears {}; others {}", name, quant.describe(), high.describe());
  if (!filter.empty()) s += fmt::format("; filter /{}/", filter);
  if (keep_last_high > 0) s += fmt::format("; last {} layers high", keep_last_high);
  if (quantize_router) s += "; router quantized";
  if (quantize_lm_head) s += "; lm_head quantized";
  return s;
}

// ---------------------------------------------------------------------------------------------
// Quantizers

num::QConfig LinearQ::act_cfg() const {
  num::QConfig c = num.act.cfg;
  if (c.scheme == num::Scheme::NVFP4 && c.global == num::Global::Static && act_static_amax > 0)
    c.static_amax = act_static_amax;
  return c;
}

void quantize_weight(LinearQ& L, const float* w, float* w_eff) {
  const int64_t n = L.out * L.in;
  L.wq = num::QTensor{};
  switch (L.num.weight.kind) {
    case QuantKind::None:
      if (w_eff != w) std::memcpy(w_eff, w, sizeof(float) * n);
      break;
    case QuantKind::BF16:
      for (int64_t i = 0; i < n; ++i) w_eff[i] = num::bf16_round(w[i]);
      break;
    case QuantKind::Quant:
      num::check_config(L.num.weight.cfg, L.out, L.in, L.name + ".weight");
      L.wq = num::quantize(w, L.out, L.in, L.num.weight.cfg);
      num::dequantize(L.wq, w_eff);
      break;
  }
}

void quantize_act(const LinearQ& L, const float* X, int64_t M, float* x_eff) {
  const int64_t n = M * L.in;
  switch (L.num.act.kind) {
    case QuantKind::None:
      if (x_eff != X) std::memcpy(x_eff, X, sizeof(float) * n);
      break;
    case QuantKind::BF16:
      for (int64_t i = 0; i < n; ++i) x_eff[i] = num::bf16_round(X[i]);
      break;
    case QuantKind::Quant:
      num::fake_quantize(X, x_eff, M, L.in, L.act_cfg());
      break;
  }
}

}  // namespace quads::model
