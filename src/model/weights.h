#pragma once
// The float32 parameters of a Qwen3-MoE model, in one flat buffer with a table of named tensors
// (HF names, per-expert spelling `model.layers.{l}.mlp.experts.{e}.gate_proj.weight`). Gradients
// and optimizer state are flat buffers of the same size and layout, so the optimizer and gradient
// clipping never need to know about the model's structure.
//
// Storage order (it matters to the kernels, not to users):
//   model.embed_tokens.weight [V, H]
//   per layer l:
//     input_layernorm [H], q_proj [nh*hd, H], k_proj [nkv*hd, H], v_proj [nkv*hd, H],
//     o_proj [H, nh*hd], q_norm [hd], k_norm [hd], post_attention_layernorm [H],
//     sparse layer: mlp.gate [E, H], then for e in 0..E-1: gate_proj [I, H], up_proj [I, H],
//                   down_proj [H, I]   (so gate and up of one expert form one [2I, H] matrix)
//     dense layer:  gate_proj [Id, H], up_proj [Id, H], down_proj [H, Id]
//   model.norm.weight [H]
//   lm_head.weight [V, H]   (absent with tie_word_embeddings: the embedding is used)
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace quads::model {

struct ParamInfo {
  std::string name;             // HF name
  std::vector<int64_t> shape;
  size_t offset = 0;            // into the flat buffer, in floats
  size_t numel = 0;
  bool is_matrix() const { return shape.size() >= 2; }  // decays under AdamW (norms do not)
};

// Offsets (in floats) of one decoder layer's tensors in the flat buffer.
struct LayerOffsets {
  size_t input_norm = 0, q = 0, k = 0, v = 0, o = 0, q_norm = 0, k_norm = 0, post_norm = 0;
  bool sparse = false;
  size_t router = 0;   // sparse: [E, H]
  size_t mlp = 0;      // sparse: expert 0's gate_proj; expert e starts at mlp + e * mlp_stride
                       // dense: gate_proj, then up_proj, then down_proj
  size_t inter = 0;    // I of this layer's MLP (moe_intermediate_size or intermediate_size)
  size_t mlp_stride = 0;  // 3 * inter * H
};

struct Layout {
  std::vector<ParamInfo> params;
  std::vector<LayerOffsets> layers;
  size_t embed = 0, final_norm = 0, lm_head = 0;  // lm_head == embed when tied
  size_t total = 0;

  static Layout build(const ModelConfig& cfg);
  const ParamInfo* find(const std::string& name) const;  // nullptr if absent
  const ParamInfo& at(const std::string& name) const;    // throws naming the tensor
};

// Every linear layer of a model in the one order the CPU model (model::Model), the GPU rollout
// model and the GPU trainer keep them: per decoder layer q, k, v, o, then the router and each
// expert's gate, up, down (MoE layer) or the dense gate, up, down; lm_head last.
struct LinearSpec {
  std::string name;  // HF module name (the tensor is name + ".weight")
  int layer = -1;    // decoder layer, -1 for lm_head
  int64_t out = 0, in = 0;
  size_t offset = 0;  // of the [out, in] weight in the Layout
};
struct LinearTable {
  struct Layer {
    int q = -1, k = -1, v = -1, o = -1, router = -1;  // indices into specs (router: -1 when dense)
    int mlp = -1;  // the dense gate_proj, or expert 0's; expert e's gate, up, down at mlp + 3e + 0/1/2
    int64_t inter = 0;  // the MLP's (or each expert's) intermediate size
    bool sparse = false;
    int nexperts = 1;   // 1 for a dense MLP
  };
  std::vector<LinearSpec> specs;
  std::vector<Layer> layers;
  int lm_head = -1;
};
LinearTable linear_table(const ModelConfig& cfg, const Layout& layout);

struct SaveOptions {
  bool bf16 = false;                         // store BF16 (round to nearest even) instead of F32
  size_t max_shard_bytes = size_t(5) << 30;  // above this, model-0000i-of-0000n.safetensors + index
};

class Weights {
 public:
  ModelConfig cfg;
  Layout layout;
  std::vector<float> data;

  Weights() = default;
  explicit Weights(const ModelConfig& c);  // zeros

  // Loads `dir`/config.json and the checkpoint: model.safetensors, or the shards listed in
  // model.safetensors.index.json. F32/BF16/F16 tensors; experts either per expert or fused
  // (transformers v5: mlp.experts.gate_up_proj [E, 2I, H] with gate rows first, and
  // mlp.experts.down_proj [E, H, I]; the transposed layout [E, H, 2I] / [E, I, H] used by some
  // exporters is accepted only where the shapes tell the two apart, i.e. 2I != H resp. I != H).
  // Every parameter must be present exactly once; unknown tensors are an error (naming them),
  // except rotary inv_freq buffers. With tied embeddings a stored lm_head.weight must equal the
  // embedding or is an error.
  // ModelOpt NVFP4 checkpoints (`quads export --format nvfp4`, or ModelOpt's own: config.json
  // quantization_config or hf_quant_config.json, see ModelConfig::parse_quantization): the NVFP4
  // weights are dequantized exactly into the float32 masters, input_scale tensors are skipped, the
  // excluded modules are read as stored; cfg.quantization says how the file was stored.
  static Weights load(const std::string& dir);

  // Random weights for tests: matrices N(0, stddev), norm weights 1 + N(0, norm_stddev).
  static Weights random(const ModelConfig& c, uint64_t seed, float stddev = 0.02f, float norm_stddev = 0.f);

  // Writes config.json and model.safetensors (or shards + model.safetensors.index.json), per-expert
  // names, each file atomically (temp + rename); stale files of an earlier save in `dir`
  // (an index or shards this save did not write) are removed afterwards.
  void save(const std::string& dir, const SaveOptions& opt = {}) const;

  size_t size() const { return data.size(); }
  float* ptr(const std::string& name) { return data.data() + layout.at(name).offset; }
  const float* ptr(const std::string& name) const { return data.data() + layout.at(name).offset; }
};

// Float32 masters in a Weights layout that live in a device's memory (a GPU trainer's), handed to
// another engine on the same device without a copy through the host (rollout::RolloutEngine::
// sync_device). `device` names the memory ("cuda"); an empty one means the holder has none.
struct DeviceWeights {
  const float* data = nullptr;  // device address, valid until the holder next changes its masters
  size_t size = 0;              // floats
  std::string device;
  bool empty() const { return data == nullptr || device.empty(); }
};

// Reads tensors with HF names (per-expert or fused, as Weights::load accepts) from the given
// safetensors files into `dst`, a buffer with `layout`. Used by Weights::load and to read
// gradient files. With require_all, a parameter missing from the files is an error; with
// allow_unknown, tensors not in the layout are skipped instead of being an error.
void read_hf_tensors(const std::vector<std::string>& files, const ModelConfig& cfg, const Layout& layout,
                     float* dst, bool require_all, bool allow_unknown = false);

// The safetensors files of a checkpoint directory (one file, or the shards of the index).
std::vector<std::string> checkpoint_files(const std::string& dir);

}  // namespace quads::model
