#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/error.h"

namespace quads::model {

namespace {

using json = nlohmann::json;

bool has(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

template <typename T>
T get(const json& j, const char* key, const std::string& src) {
  try {
    return j.at(key).get<T>();
  } catch (const json::exception& e) {
    fail("{}: field '{}' has the wrong type or is missing ({})", src, key, e.what());
  }
}

int get_int(const json& j, const char* key, const std::string& src) {
  const json& v = j.at(key);
  QUADS_CHECK(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()),
              "{}: field '{}' must be an integer, got {}", src, key, v.dump());
  return static_cast<int>(v.get<int64_t>());
}

int get_int_or(const json& j, const char* key, int dflt, const std::string& src) {
  return has(j, key) ? get_int(j, key, src) : dflt;
}

double get_num(const json& j, const char* key, const std::string& src) {
  QUADS_CHECK(j.at(key).is_number(), "{}: field '{}' must be a number, got {}", src, key, j.at(key).dump());
  return j.at(key).get<double>();
}

bool get_bool_or(const json& j, const char* key, bool dflt, const std::string& src) {
  if (!has(j, key)) return dflt;
  QUADS_CHECK(j.at(key).is_boolean(), "{}: field '{}' must be true or false, got {}", src, key, j.at(key).dump());
  return j.at(key).get<bool>();
}

// rope settings: v5 `rope_parameters` {rope_type, rope_theta, ...}, v4 `rope_theta` + `rope_scaling`.
void read_rope(const json& j, ModelConfig& c, const std::string& src) {
  bool have_theta = false;
  if (has(j, "rope_parameters")) {
    const json& rp = j.at("rope_parameters");
    QUADS_CHECK(rp.is_object(), "{}: field 'rope_parameters' must be an object", src);
    for (auto it = rp.begin(); it != rp.end(); ++it) {
      const std::string& k = it.key();
      if (k == "rope_theta") {
        c.rope_theta = get_num(rp, "rope_theta", src + " rope_parameters");
        have_theta = true;
      } else if (k == "rope_type" || k == "type") {
        const std::string t = it.value().get<std::string>();
        QUADS_CHECK(t == "default", "{}: field 'rope_parameters.{}' is '{}': only 'default' RoPE is implemented", src,
                    k, t);
      } else if (k == "partial_rotary_factor") {
        QUADS_CHECK(it.value().is_number() && it.value().get<double>() == 1.0,
                    "{}: field 'rope_parameters.partial_rotary_factor' = {} is not supported (only 1)", src,
                    it.value().dump());
      } else {
        fail("{}: field 'rope_parameters.{}' is not supported (RoPE scaling is not implemented)", src, k);
      }
    }
  }
  if (has(j, "rope_scaling")) {
    const json& rs = j.at("rope_scaling");
    std::string t = "?";
    if (rs.is_object()) {
      if (rs.contains("rope_type")) t = rs.at("rope_type").dump();
      else if (rs.contains("type")) t = rs.at("type").dump();
    }
    QUADS_CHECK(rs.is_object() && (t == "\"default\""),
                "{}: field 'rope_scaling' ({}) is not supported: RoPE scaling is not implemented", src, rs.dump());
  }
  if (has(j, "rope_theta")) {
    const double th = get_num(j, "rope_theta", src);
    QUADS_CHECK(!have_theta || th == c.rope_theta, "{}: fields 'rope_theta' ({}) and 'rope_parameters.rope_theta' ({}) disagree",
                src, th, c.rope_theta);
    c.rope_theta = th;
    have_theta = true;
  }
  if (!have_theta) c.rope_theta = 10000.0;  // HF's default
  if (has(j, "partial_rotary_factor")) {
    QUADS_CHECK(get_num(j, "partial_rotary_factor", src) == 1.0,
                "{}: field 'partial_rotary_factor' is not supported (only 1)", src);
  }
}

}  // namespace

bool ModelConfig::is_sparse(int layer) const {
  const bool listed = std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end();
  return !listed && num_experts > 0 && decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

ModelConfig ModelConfig::from_json(const json& j, const std::string& src) {
  QUADS_CHECK(j.is_object(), "{}: not a JSON object", src);
  ModelConfig c;
  c.raw = j;
  if (has(j, "model_type")) {
    const std::string mt = get<std::string>(j, "model_type", src);
    QUADS_CHECK(mt == "qwen3_moe", "{}: field 'model_type' is '{}': only 'qwen3_moe' is supported", src, mt);
  }
  for (const char* req : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"})
    QUADS_CHECK(has(j, req), "{}: required field '{}' is missing", src, req);
  c.vocab_size = get_int(j, "vocab_size", src);
  c.hidden_size = get_int(j, "hidden_size", src);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", src);
  c.num_attention_heads = get_int(j, "num_attention_heads", src);
  c.num_key_value_heads = get_int_or(j, "num_key_value_heads", c.num_attention_heads, src);
  c.intermediate_size = get_int_or(j, "intermediate_size", 0, src);
  c.moe_intermediate_size = get_int_or(j, "moe_intermediate_size", 0, src);
  c.head_dim = get_int_or(j, "head_dim", 0, src);
  if (c.head_dim == 0) {
    QUADS_CHECK(c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0,
                "{}: no 'head_dim' and hidden_size {} is not divisible by num_attention_heads {}", src, c.hidden_size,
                c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  // Experts: v5 `num_local_experts`, v4 `num_experts`.
  const bool v4e = has(j, "num_experts"), v5e = has(j, "num_local_experts");
  if (v4e && v5e) {
    QUADS_CHECK(get_int(j, "num_experts", src) == get_int(j, "num_local_experts", src),
                "{}: fields 'num_experts' ({}) and 'num_local_experts' ({}) disagree", src, j.at("num_experts").dump(),
                j.at("num_local_experts").dump());
  }
  c.num_experts = v5e ? get_int(j, "num_local_experts", src) : get_int_or(j, "num_experts", 0, src);
  c.num_experts_per_tok = get_int_or(j, "num_experts_per_tok", 0, src);
  c.decoder_sparse_step = get_int_or(j, "decoder_sparse_step", 1, src);
  if (has(j, "mlp_only_layers")) {
    QUADS_CHECK(j.at("mlp_only_layers").is_array(), "{}: field 'mlp_only_layers' must be a list", src);
    for (const auto& v : j.at("mlp_only_layers")) {
      QUADS_CHECK(v.is_number_integer(), "{}: field 'mlp_only_layers' must hold integers, got {}", src, v.dump());
      c.mlp_only_layers.push_back(v.get<int>());
    }
  }
  c.norm_topk_prob = get_bool_or(j, "norm_topk_prob", false, src);
  if (has(j, "rms_norm_eps")) c.rms_norm_eps = get_num(j, "rms_norm_eps", src);
  c.tie_word_embeddings = get_bool_or(j, "tie_word_embeddings", false, src);
  if (has(j, "router_aux_loss_coef")) c.router_aux_loss_coef = get_num(j, "router_aux_loss_coef", src);
  c.output_router_logits = get_bool_or(j, "output_router_logits", false, src);
  c.max_position_embeddings = get_int_or(j, "max_position_embeddings", 0, src);
  read_rope(j, c, src);

  // Settings that would change the computation and that we do not implement.
  QUADS_CHECK(!get_bool_or(j, "attention_bias", false, src),
              "{}: field 'attention_bias' is true: attention biases are not supported", src);
  QUADS_CHECK(!get_bool_or(j, "mlp_bias", false, src), "{}: field 'mlp_bias' is true: MLP biases are not supported",
              src);
  QUADS_CHECK(!get_bool_or(j, "use_sliding_window", false, src),
              "{}: field 'use_sliding_window' is true: sliding-window attention is not implemented", src);
  if (has(j, "hidden_act")) {
    const std::string act = get<std::string>(j, "hidden_act", src);
    QUADS_CHECK(act == "silu" || act == "swish", "{}: field 'hidden_act' is '{}': only 'silu' is supported", src, act);
  }
  if (has(j, "layer_types")) {
    for (const auto& v : j.at("layer_types"))
      QUADS_CHECK(v == "full_attention", "{}: field 'layer_types' contains {}: only full attention is implemented",
                  src, v.dump());
  }
  if (has(j, "shared_expert_intermediate_size")) {
    QUADS_CHECK(get_int(j, "shared_expert_intermediate_size", src) == 0,
                "{}: field 'shared_expert_intermediate_size' > 0: shared experts are not part of Qwen3-MoE", src);
  }
  if (has(j, "quantization_config")) c.quantization = parse_quantization(j.at("quantization_config"), src);
  c.validate(src);
  return c;
}

QuantizationInfo ModelConfig::parse_quantization(const json& qc, const std::string& src) {
  QUADS_CHECK(qc.is_object(), "{}: field 'quantization_config' must be an object, got {}", src, qc.dump());
  // hf_quant_config.json and older exports nest the settings under "quantization".
  const bool nested = qc.contains("quantization") && qc.at("quantization").is_object();
  const json& q = nested ? qc.at("quantization") : qc;
  const std::string at = nested ? "quantization_config.quantization" : "quantization_config";
  QuantizationInfo info;
  info.method = qc.contains("quant_method") && qc.at("quant_method").is_string() ? qc.at("quant_method").get<std::string>()
                                                                                   : std::string("modelopt");
  if (!qc.contains("quant_method")) {
    // hf_quant_config.json has no quant_method; it is ModelOpt's own file (producer + quant_algo).
    QUADS_CHECK(q.contains("quant_algo"), "{}: field 'quantization_config.quant_method' is missing", src);
  }
  QUADS_CHECK(info.method == "modelopt",
              "{}: field 'quantization_config.quant_method' is '{}': only NVIDIA ModelOpt NVFP4 checkpoints "
              "('modelopt') are loaded",
              src, info.method);
  QUADS_CHECK(q.contains("quant_algo") && q.at("quant_algo").is_string(), "{}: field '{}.quant_algo' is missing", src,
              at);
  info.algo = q.at("quant_algo").get<std::string>();
  QUADS_CHECK(info.algo == "NVFP4" || info.algo == "nvfp4",
              "{}: field '{}.quant_algo' is '{}': only NVFP4 is loaded (FP8, W4A8_AWQ, MIXED_PRECISION, ... are not)",
              src, at, info.algo);
  info.algo = "NVFP4";
  if (q.contains("group_size") && !q.at("group_size").is_null()) {
    QUADS_CHECK(q.at("group_size").is_number_integer() && q.at("group_size").get<int>() == 16,
                "{}: field '{}.group_size' is {}: NVFP4 needs 16", src, at, q.at("group_size").dump());
  }
  // KV-cache quantization: FP8 (ModelOpt's only KV format with NVFP4 weights) is accepted and its
  // scales skipped, since quads runs its own KV cache; anything else is an error.
  for (const json* o : {&q, &qc}) {
    if (o->contains("kv_cache_quant_algo") && !o->at("kv_cache_quant_algo").is_null()) {
      const json& v = o->at("kv_cache_quant_algo");
      QUADS_CHECK(v.is_string() && (v.get<std::string>() == "FP8" || v.get<std::string>() == "fp8"),
                  "{}: field 'kv_cache_quant_algo' is {}: only an FP8 KV cache (or none) is accepted", src, v.dump());
      info.kv_cache_algo = "FP8";
    }
    if (o->contains("kv_cache_scheme") && !o->at("kv_cache_scheme").is_null()) {
      const json& v = o->at("kv_cache_scheme");
      QUADS_CHECK(v.is_object() && v.value("num_bits", 0) == 8 && v.value("type", "") == "float",
                  "{}: field 'kv_cache_scheme' is {}: only an FP8 KV cache (8-bit float) or none is accepted", src,
                  v.dump());
      info.kv_cache_algo = "FP8";
    }
  }
  for (const char* ex : {"exclude_modules", "ignore"}) {
    if (!q.contains(ex) || q.at(ex).is_null()) continue;
    QUADS_CHECK(q.at(ex).is_array(), "{}: field '{}.{}' must be a list", src, at, ex);
    for (const auto& m : q.at(ex)) {
      QUADS_CHECK(m.is_string(), "{}: field '{}.{}' holds {}, not a module name", src, at, ex, m.dump());
      info.exclude_modules.push_back(m.get<std::string>());
    }
  }
  return info;
}

void ModelConfig::validate(const std::string& src) const {
  QUADS_CHECK(vocab_size > 0, "{}: vocab_size must be > 0 (got {})", src, vocab_size);
  QUADS_CHECK(hidden_size > 0, "{}: hidden_size must be > 0 (got {})", src, hidden_size);
  QUADS_CHECK(num_hidden_layers > 0, "{}: num_hidden_layers must be > 0 (got {})", src, num_hidden_layers);
  QUADS_CHECK(num_attention_heads > 0 && num_key_value_heads > 0,
              "{}: num_attention_heads ({}) and num_key_value_heads ({}) must be > 0", src, num_attention_heads,
              num_key_value_heads);
  QUADS_CHECK(num_attention_heads % num_key_value_heads == 0,
              "{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", src, num_attention_heads,
              num_key_value_heads);
  QUADS_CHECK(head_dim > 0 && head_dim % 2 == 0, "{}: head_dim must be even and > 0 (got {})", src, head_dim);
  QUADS_CHECK(num_experts >= 0, "{}: num_experts must be >= 0", src);
  QUADS_CHECK(decoder_sparse_step >= 1, "{}: decoder_sparse_step must be >= 1 (got {})", src, decoder_sparse_step);
  QUADS_CHECK(rms_norm_eps > 0, "{}: rms_norm_eps must be > 0", src);
  QUADS_CHECK(rope_theta > 0, "{}: rope_theta must be > 0", src);
  bool any_sparse = false, any_dense = false;
  for (int l = 0; l < num_hidden_layers; ++l) (is_sparse(l) ? any_sparse : any_dense) = true;
  if (any_sparse) {
    QUADS_CHECK(moe_intermediate_size > 0, "{}: moe_intermediate_size must be > 0 for MoE layers", src);
    QUADS_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts,
                "{}: num_experts_per_tok ({}) must be in 1..num_experts ({})", src, num_experts_per_tok, num_experts);
  }
  if (any_dense) QUADS_CHECK(intermediate_size > 0, "{}: intermediate_size must be > 0 for dense MLP layers", src);
}

ModelConfig ModelConfig::load(const std::string& path) {
  std::ifstream f(path);
  QUADS_CHECK(f.good(), "cannot open model config {}", path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON ({})", path, e.what());
  }
  return from_json(j, path);
}

json ModelConfig::to_json() const {
  json j = raw.is_object() ? raw : json::object();
  j.erase("quantization_config");  // the weights we hold are float32; an export adds its own
  j["model_type"] = "qwen3_moe";
  if (!j.contains("architectures")) j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["num_local_experts"] = num_experts;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers;
  j["norm_topk_prob"] = norm_topk_prob;
  j["rms_norm_eps"] = rms_norm_eps;
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_theta", rope_theta}, {"rope_type", "default"}};
  j["rope_theta"] = rope_theta;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["output_router_logits"] = output_router_logits;
  if (max_position_embeddings > 0) j["max_position_embeddings"] = max_position_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  return j;
}

std::string ModelConfig::describe() const {
  int nsparse = 0;
  for (int l = 0; l < num_hidden_layers; ++l) nsparse += is_sparse(l);
  return fmt::format(
      "qwen3_moe: {} layers ({} MoE), hidden {}, heads {}/{} x {}, experts {} top-{} (I={}{}), dense I={}, vocab {}{}",
      num_hidden_layers, nsparse, hidden_size, num_attention_heads, num_key_value_heads, head_dim, num_experts,
      num_experts_per_tok, moe_intermediate_size, norm_topk_prob ? ", renormalized" : "", intermediate_size, vocab_size,
      tie_word_embeddings ? ", tied embeddings" : "");
}

}  // namespace quads::model
