#pragma once
// Qwen3-MoE configuration, read from a Hugging Face config.json. Both the transformers v4 names
// (`num_experts`, `rope_theta`, `rope_scaling`) and the v5 names (`num_local_experts`,
// `rope_parameters`) are accepted. Anything that would change the computation and that we do not
// implement (rope scaling, sliding window, attention bias, an activation other than SiLU, ...) is
// an error naming the field; fields that cannot change the computation (dtype, token ids, dropout
// at inference, ...) are kept as they are and written back on save.
//
// Pre-quantized checkpoints: a `quantization_config` of NVIDIA ModelOpt NVFP4 (quant_method
// "modelopt", quant_algo "NVFP4" flat or under "quantization", group size 16, KV cache unquantized
// or FP8) is read into `quantization`; Weights::load then dequantizes the NVFP4 weights into
// the float32 masters. Any other quantization method or algorithm is an error naming the field.
// to_json() leaves quantization_config out: the weights in memory are float32.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace quads::model {

struct QuantizationInfo {
  std::string method;   // "" (a float checkpoint) or "modelopt"
  std::string algo;     // "NVFP4"
  int group_size = 16;
  std::vector<std::string> exclude_modules;  // kept in high precision (exclude_modules / ignore)
  std::string kv_cache_algo;  // "" or "FP8": the file's KV-cache scales (k_scale / v_scale) are
                              // skipped; quads' own KV cache runs in float

  bool quantized() const { return !method.empty(); }
};

struct ModelConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;      // dense MLP layers
  int moe_intermediate_size = 0;  // each expert
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;               // `head_dim`, else hidden_size / num_attention_heads
  int num_experts = 0;            // 0: every layer is dense
  int num_experts_per_tok = 0;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  bool norm_topk_prob = false;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;  // HF adds the aux loss to the training loss only when true
  int max_position_embeddings = 0;
  QuantizationInfo quantization;  // how the checkpoint's weights are stored (not how quads runs them)

  // The json it came from (or an empty object), re-emitted with our fields updated by to_json().
  nlohmann::json raw = nlohmann::json::object();

  // HF's rule: (layer not in mlp_only_layers) and num_experts > 0 and (layer+1) % step == 0.
  bool is_sparse(int layer) const;
  int q_dim() const { return num_attention_heads * head_dim; }
  int kv_dim() const { return num_key_value_heads * head_dim; }
  // The aux-loss coefficient HF would use in training: router_aux_loss_coef when
  // output_router_logits is set, else 0.
  double effective_aux_loss_coef() const { return output_router_logits ? router_aux_loss_coef : 0.0; }

  // `source` names the file in error messages. Validates (positive sizes, heads divisible by kv
  // heads, top-k <= experts, supported rope/attention/activation settings).
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source = "config.json");
  static ModelConfig load(const std::string& path);  // a config.json file
  // Reads a quantization description: config.json's quantization_config, or the contents of a
  // ModelOpt hf_quant_config.json ({"producer", "quantization": {...}}). Throws naming the field of
  // anything but ModelOpt NVFP4 with group size 16 and an unquantized or FP8 KV cache.
  static QuantizationInfo parse_quantization(const nlohmann::json& q, const std::string& source);
  void validate(const std::string& source = "config") const;

  // Writes the transformers v5 spelling (num_local_experts, rope_parameters) plus the v4 aliases
  // num_experts and rope_theta so that either version loads it.
  nlohmann::json to_json() const;
  std::string describe() const;  // one line
};

}  // namespace quads::model
