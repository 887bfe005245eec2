#include "model/weights.h"

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <fmt/format.h>

#include "common/error.h"
#include "io/quantized_checkpoint.h"
#include "io/safetensors.h"
#include "numerics/quantize.h"

namespace quads::model {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Layout

Layout Layout::build(const ModelConfig& c) {
  Layout L;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    ParamInfo p;
    p.name = name;
    p.shape = std::move(shape);
    p.numel = 1;
    for (auto d : p.shape) p.numel *= static_cast<size_t>(d);
    p.offset = L.total;
    L.total += p.numel;
    L.params.push_back(p);
    return p.offset;
  };
  const int64_t H = c.hidden_size, hd = c.head_dim;
  L.embed = add("model.embed_tokens.weight", {c.vocab_size, H});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerOffsets o;
    o.input_norm = add(p + "input_layernorm.weight", {H});
    o.q = add(p + "self_attn.q_proj.weight", {int64_t(c.num_attention_heads) * hd, H});
    o.k = add(p + "self_attn.k_proj.weight", {int64_t(c.num_key_value_heads) * hd, H});
    o.v = add(p + "self_attn.v_proj.weight", {int64_t(c.num_key_value_heads) * hd, H});
    o.o = add(p + "self_attn.o_proj.weight", {H, int64_t(c.num_attention_heads) * hd});
    o.q_norm = add(p + "self_attn.q_norm.weight", {hd});
    o.k_norm = add(p + "self_attn.k_norm.weight", {hd});
    o.post_norm = add(p + "post_attention_layernorm.weight", {H});
    o.sparse = c.is_sparse(l);
    if (o.sparse) {
      const int64_t I = c.moe_intermediate_size;
      o.inter = I;
      o.router = add(p + "mlp.gate.weight", {c.num_experts, H});
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        const size_t g = add(q + "gate_proj.weight", {I, H});
        add(q + "up_proj.weight", {I, H});
        add(q + "down_proj.weight", {H, I});
        if (e == 0) o.mlp = g;
      }
    } else {
      const int64_t I = c.intermediate_size;
      o.inter = I;
      o.mlp = add(p + "mlp.gate_proj.weight", {I, H});
      add(p + "mlp.up_proj.weight", {I, H});
      add(p + "mlp.down_proj.weight", {H, I});
    }
    o.mlp_stride = 3 * o.inter * H;
    L.layers.push_back(o);
  }
  L.final_norm = add("model.norm.weight", {H});
  L.lm_head = c.tie_word_embeddings ? L.embed : add("lm_head.weight", {c.vocab_size, H});
  return L;
}

const ParamInfo* Layout::find(const std::string& name) const {
  // Linear search would be O(P) per call; callers look up a handful of names, except the loader,
  // which builds its own map.
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

const ParamInfo& Layout::at(const std::string& name) const {
  const ParamInfo* p = find(name);
  QUADS_CHECK(p, "model has no parameter '{}'", name);
  return *p;
}

LinearTable linear_table(const ModelConfig& c, const Layout& L) {
  LinearTable t;
  auto add = [&](std::string name, int layer, int64_t out, int64_t in, size_t off) {
    t.specs.push_back({std::move(name), layer, out, in, off});
    return static_cast<int>(t.specs.size()) - 1;
  };
  const int64_t H = c.hidden_size;
  t.layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerOffsets& o = L.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    LinearTable::Layer& x = t.layers[l];
    x.q = add(p + "self_attn.q_proj", l, c.q_dim(), H, o.q);
    x.k = add(p + "self_attn.k_proj", l, c.kv_dim(), H, o.k);
    x.v = add(p + "self_attn.v_proj", l, c.kv_dim(), H, o.v);
    x.o = add(p + "self_attn.o_proj", l, H, c.q_dim(), o.o);
    const int64_t I = static_cast<int64_t>(o.inter);
    x.inter = I;
    x.sparse = o.sparse;
    x.nexperts = o.sparse ? c.num_experts : 1;
    if (o.sparse) {
      x.router = add(p + "mlp.gate", l, c.num_experts, H, o.router);
      for (int e = 0; e < c.num_experts; ++e) {
        const size_t base = o.mlp + e * o.mlp_stride;
        const std::string pe = fmt::format("{}mlp.experts.{}.", p, e);
        const int g = add(pe + "gate_proj", l, I, H, base);
        add(pe + "up_proj", l, I, H, base + I * H);
        add(pe + "down_proj", l, H, I, base + 2 * I * H);
        if (e == 0) x.mlp = g;
      }
    } else {
      x.mlp = add(p + "mlp.gate_proj", l, I, H, o.mlp);
      add(p + "mlp.up_proj", l, I, H, o.mlp + I * H);
      add(p + "mlp.down_proj", l, H, I, o.mlp + 2 * I * H);
    }
  }
  t.lm_head = add("lm_head", -1, c.vocab_size, H, L.lm_head);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Reading

std::vector<std::string> checkpoint_files(const std::string& dir) {
  const fs::path d(dir);
  const fs::path index = d / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream f(index);
    QUADS_CHECK(f.good(), "cannot open {}", index.string());
    json j;
    try {
      j = json::parse(f);
    } catch (const json::exception& e) {
      fail("{}: invalid JSON ({})", index.string(), e.what());
    }
    QUADS_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "{}: no 'weight_map' object",
                index.string());
    std::set<std::string> files;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      QUADS_CHECK(it.value().is_string(), "{}: weight_map entry '{}' is not a file name", index.string(), it.key());
      const std::string fname = it.value().get<std::string>();
      QUADS_CHECK(fname.find('/') == std::string::npos && fname != ".." && !fname.empty(),
                  "{}: weight_map entry '{}' names '{}', not a file in the checkpoint folder", index.string(), it.key(),
                  fname);
      files.insert(fname);
    }
    std::vector<std::string> out;
    for (const auto& f : files) {
      QUADS_CHECK(fs::exists(d / f), "{}: shard '{}' is missing", index.string(), f);
      out.push_back((d / f).string());
    }
    return out;
  }
  const fs::path single = d / "model.safetensors";
  QUADS_CHECK(fs::exists(single), "{}: neither model.safetensors nor model.safetensors.index.json found", dir);
  return {single.string()};
}

namespace {

bool is_float_dtype(io::DType t) {
  return t == io::DType::F32 || t == io::DType::BF16 || t == io::DType::F16 || t == io::DType::F64;
}

// "model.layers.{l}.mlp.experts.{suffix}" -> l, or -1.
int parse_layer(const std::string& name, const std::string& suffix) {
  const std::string pre = "model.layers.";
  if (name.rfind(pre, 0) != 0) return -1;
  size_t i = pre.size(), j = i;
  while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
  if (j == i || j - i > 6) return -1;
  if (name.compare(j, std::string::npos, "." + suffix) != 0) return -1;
  return std::stoi(name.substr(i, j - i));
}

std::string shape_s(const std::vector<int64_t>& s) { return io::shape_str(s); }

}  // namespace

namespace {

// read_hf_tensors with tensors already handled skipped (`handled`: names) and parameters already
// set marked in `filled`.
void read_tensors(const std::vector<std::string>& files, const ModelConfig& cfg, const Layout& layout, float* dst,
                  bool require_all, bool allow_unknown, const std::set<std::string>& handled,
                  std::vector<uint8_t> filled);

}  // namespace

void read_hf_tensors(const std::vector<std::string>& files, const ModelConfig& cfg, const Layout& layout, float* dst,
                     bool require_all, bool allow_unknown) {
  read_tensors(files, cfg, layout, dst, require_all, allow_unknown, {}, std::vector<uint8_t>(layout.params.size(), 0));
}

namespace {

void read_tensors(const std::vector<std::string>& files, const ModelConfig& cfg, const Layout& layout, float* dst,
                  bool require_all, bool allow_unknown, const std::set<std::string>& handled,
                  std::vector<uint8_t> filled) {
  std::map<std::string, const ParamInfo*> by_name;
  for (const auto& p : layout.params) by_name[p.name] = &p;
  auto mark = [&](const ParamInfo* p, const std::string& file, const std::string& tensor) {
    const size_t i = static_cast<size_t>(p - layout.params.data());
    QUADS_CHECK(!filled[i], "{}: tensor '{}' sets parameter '{}' a second time", file, tensor, p->name);
    filled[i] = 1;
  };
  std::vector<float> tied_lm_head;
  std::string tied_file;
  const int64_t H = cfg.hidden_size;

  for (const auto& path : files) {
    auto f = io::SafeTensorsFile::open(path);
    for (const auto& t : f->tensors()) {
      const std::string& name = t.name;
      if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;  // a buffer, recomputed
      if (handled.count(name)) continue;
      if (cfg.tie_word_embeddings && name == "lm_head.weight") {
        QUADS_CHECK(is_float_dtype(t.dtype), "{}: tensor '{}' has dtype {}, expected F32, BF16 or F16", path, name,
                    io::dtype_name(t.dtype));
        QUADS_CHECK(t.shape == std::vector<int64_t>({cfg.vocab_size, H}), "{}: tensor '{}' has shape {}, expected {}",
                    path, name, shape_s(t.shape), shape_s({cfg.vocab_size, H}));
        tied_lm_head = t.to_f32();
        tied_file = path;
        continue;
      }
      auto it = by_name.find(name);
      if (it != by_name.end()) {
        const ParamInfo* p = it->second;
        QUADS_CHECK(is_float_dtype(t.dtype), "{}: tensor '{}' has dtype {}, expected F32, BF16 or F16", path, name,
                    io::dtype_name(t.dtype));
        QUADS_CHECK(t.shape == p->shape, "{}: tensor '{}' has shape {}, expected {}", path, name, shape_s(t.shape),
                    shape_s(p->shape));
        mark(p, path, name);
        t.to_f32(dst + p->offset);
        continue;
      }
      // Fused experts (transformers v5).
      std::string base = name;
      if (base.size() > 7 && base.compare(base.size() - 7, 7, ".weight") == 0) base.resize(base.size() - 7);
      const int lg = parse_layer(base, "mlp.experts.gate_up_proj");
      const int ld = parse_layer(base, "mlp.experts.down_proj");
      const int l = lg >= 0 ? lg : ld;
      if (l >= 0) {
        QUADS_CHECK(l < cfg.num_hidden_layers && layout.layers[l].sparse,
                    "{}: tensor '{}' holds fused experts, but layer {} is not a MoE layer of this config", path, name, l);
        QUADS_CHECK(is_float_dtype(t.dtype), "{}: tensor '{}' has dtype {}, expected F32, BF16 or F16", path, name,
                    io::dtype_name(t.dtype));
        const LayerOffsets& o = layout.layers[l];
        const int64_t E = cfg.num_experts, I = static_cast<int64_t>(o.inter);
        const std::vector<float> v = t.to_f32();
        for (int64_t e = 0; e < E; ++e) {
          const std::string pe = fmt::format("model.layers.{}.mlp.experts.{}.", l, e);
          float* gate = dst + o.mlp + e * o.mlp_stride;
          float* up = gate + I * H;
          float* down = up + I * H;
          if (lg >= 0) {
            mark(by_name.at(pe + "gate_proj.weight"), path, name);
            mark(by_name.at(pe + "up_proj.weight"), path, name);
            const float* src = v.data() + e * 2 * I * H;
            if (t.shape == std::vector<int64_t>({E, 2 * I, H})) {  // documented: [E, 2I, H], gate rows first
              std::memcpy(gate, src, sizeof(float) * I * H);
              std::memcpy(up, src + I * H, sizeof(float) * I * H);
            } else if (2 * I != H && t.shape == std::vector<int64_t>({E, H, 2 * I})) {  // transposed
              for (int64_t h = 0; h < H; ++h)
                for (int64_t i = 0; i < I; ++i) {
                  gate[i * H + h] = src[h * 2 * I + i];
                  up[i * H + h] = src[h * 2 * I + I + i];
                }
            } else {
              fail("{}: tensor '{}' has shape {}, expected {} (num_experts, 2*moe_intermediate_size, hidden_size)",
                   path, name, shape_s(t.shape), shape_s({E, 2 * I, H}));
            }
          } else {
            mark(by_name.at(pe + "down_proj.weight"), path, name);
            const float* src = v.data() + e * H * I;
            if (t.shape == std::vector<int64_t>({E, H, I})) {
              std::memcpy(down, src, sizeof(float) * H * I);
            } else if (I != H && t.shape == std::vector<int64_t>({E, I, H})) {
              for (int64_t i = 0; i < I; ++i)
                for (int64_t h = 0; h < H; ++h) down[h * I + i] = src[i * H + h];
            } else {
              fail("{}: tensor '{}' has shape {}, expected {} (num_experts, hidden_size, moe_intermediate_size)", path,
                   name, shape_s(t.shape), shape_s({E, H, I}));
            }
          }
        }
        continue;
      }
      QUADS_CHECK(allow_unknown, "{}: tensor '{}' is not a parameter of this model ({})", path, name,
                  cfg.describe());
    }
  }
  if (require_all) {
    for (size_t i = 0; i < layout.params.size(); ++i)
      QUADS_CHECK(filled[i], "checkpoint {}: parameter '{}' is missing", files.empty() ? "" : files[0],
                  layout.params[i].name);
  }
  if (!tied_lm_head.empty()) {
    const float* emb = dst + layout.embed;
    for (size_t i = 0; i < tied_lm_head.size(); ++i)
      QUADS_CHECK(tied_lm_head[i] == emb[i],
                  "{}: tie_word_embeddings is true but 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                  "(element {})",
                  tied_file, i);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Weights

Weights::Weights(const ModelConfig& c) : cfg(c), layout(Layout::build(c)), data(layout.total, 0.f) {}

Weights Weights::load(const std::string& dir) {
  ModelConfig c = ModelConfig::load((fs::path(dir) / "config.json").string());
  const fs::path hq = fs::path(dir) / "hf_quant_config.json";
  if (!c.quantization.quantized() && fs::exists(hq)) {
    std::ifstream f(hq);
    json j;
    try {
      j = json::parse(f);
    } catch (const json::exception& e) {
      fail("{}: invalid JSON ({})", hq.string(), e.what());
    }
    c.quantization = ModelConfig::parse_quantization(j, hq.string());
  }
  Weights w(c);
  const std::vector<std::string> files = checkpoint_files(dir);
  if (!c.quantization.quantized()) {
    read_hf_tensors(files, w.cfg, w.layout, w.data.data(), /*require_all=*/true);
    return w;
  }
  // ModelOpt NVFP4: every (U8 NAME, F8_E4M3 NAME_scale, F32 NAME_scale_2) triple is decoded by the
  // one quantization path (io::load_quantized_weight + num::dequantize; E2M1 x E4M3 x F32 values
  // are exact in float32); input scales (and FP8 KV-cache scales) are calibration data the float
  // model does not use; the excluded modules are read as stored.
  io::QuantizeOptions qopt;
  qopt.format = io::CheckpointFormat::NVFP4;
  std::set<std::string> handled;
  std::vector<uint8_t> filled(w.layout.params.size(), 0);
  for (const std::string& file : files) {
    auto f = io::SafeTensorsFile::open(file);
    for (const std::string& name : io::quantized_weight_names(*f, qopt)) {
      const ParamInfo* p = w.layout.find(name);
      QUADS_CHECK(p, "{}: quantized tensor '{}' is not a parameter of this model ({})", file, name, c.describe());
      const num::QTensor q = io::load_quantized_weight(*f, name, qopt);
      QUADS_CHECK(p->shape.size() == 2 && p->shape[0] == q.rows && p->shape[1] == q.cols,
                  "{}: tensor '{}' holds [{}, {}] weights, the model expects {}", file, name, q.rows, q.cols,
                  shape_s(p->shape));
      const size_t i = static_cast<size_t>(p - w.layout.params.data());
      QUADS_CHECK(!filled[i], "{}: tensor '{}' sets parameter '{}' a second time", file, name, p->name);
      filled[i] = 1;
      num::dequantize(q, w.data.data() + p->offset);
      for (const char* suffix : {"", "_scale", "_scale_2"}) handled.insert(name + suffix);
      const std::string sfx = ".weight";
      if (name.size() > sfx.size() && name.compare(name.size() - sfx.size(), sfx.size(), sfx) == 0)
        handled.insert(name.substr(0, name.size() - sfx.size()) + ".input_scale");
    }
  }
  if (!c.quantization.kv_cache_algo.empty()) {
    // FP8 KV-cache scales (self_attn.k_proj.k_scale, self_attn.k_scale, ...): calibration data of
    // other engines' KV caches.
    for (const std::string& file : files) {
      auto f = io::SafeTensorsFile::open(file);
      for (const auto& t : f->tensors()) {
        const std::string& n = t.name;
        for (const char* sfx : {".k_scale", ".v_scale"})
          if (n.size() > 8 && n.compare(n.size() - 8, 8, sfx) == 0) handled.insert(n);
      }
    }
  }
  read_tensors(files, w.cfg, w.layout, w.data.data(), /*require_all=*/true, /*allow_unknown=*/false, handled,
               std::move(filled));
  return w;
}

namespace {
// splitmix64 + Box-Muller: a fixed generator so random test models are the same everywhere.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() {
    const double u = uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};
}  // namespace

Weights Weights::random(const ModelConfig& c, uint64_t seed, float stddev, float norm_stddev) {
  Weights w(c);
  Rng rng{seed};
  for (const auto& p : w.layout.params) {
    float* d = w.data.data() + p.offset;
    if (p.is_matrix()) {
      for (size_t i = 0; i < p.numel; ++i) d[i] = static_cast<float>(stddev * rng.normal());
    } else {
      for (size_t i = 0; i < p.numel; ++i) d[i] = static_cast<float>(1.0 + norm_stddev * rng.normal());
    }
  }
  return w;
}

void Weights::save(const std::string& dir, const SaveOptions& opt) const {
  fs::create_directories(dir);
  const io::DType dt = opt.bf16 ? io::DType::BF16 : io::DType::F32;
  const size_t esize = opt.bf16 ? 2 : 4;
  // Shards in layout order, greedily filled up to max_shard_bytes.
  std::vector<std::vector<const ParamInfo*>> shards(1);
  size_t cur = 0, total_bytes = 0;
  for (const auto& p : layout.params) {
    const size_t b = p.numel * esize;
    if (cur > 0 && cur + b > opt.max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(&p);
    cur += b;
    total_bytes += b;
  }
  const size_t n = shards.size();
  std::vector<std::string> names;
  json weight_map = json::object();
  for (size_t s = 0; s < n; ++s) {
    const std::string fname =
        n == 1 ? std::string("model.safetensors") : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n);
    // Streamed tensor by tensor: F32 straight from the masters, BF16 through one tensor's copy, so
    // a save never holds a second copy of a shard (a checkpoint of a large model would double it).
    std::vector<io::TensorSpec> specs;
    for (const ParamInfo* p : shards[s]) {
      specs.push_back({p->name, dt, p->shape});
      weight_map[p->name] = fname;
    }
    io::SafeTensorsWriter out((fs::path(dir) / fname).string(), std::move(specs), {{"format", "pt"}});
    for (const ParamInfo* p : shards[s]) {
      if (dt == io::DType::F32) {
        out.write(p->name, data.data() + p->offset, p->numel * sizeof(float));
      } else {
        const io::TensorData t = io::TensorData::from_f32(p->name, p->shape, data.data() + p->offset, dt);
        out.write(p->name, t.bytes.data(), t.bytes.size());
      }
    }
    out.commit();
    names.push_back(fname);
  }
  if (n > 1) {
    json idx = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    const std::string s = idx.dump(2) + "\n";
    io::write_file_atomic((fs::path(dir) / "model.safetensors.index.json").string(), s.data(), s.size());
  }
  json cj = cfg.to_json();
  cj["dtype"] = opt.bf16 ? "bfloat16" : "float32";
  cj.erase("torch_dtype");
  const std::string cs = cj.dump(2) + "\n";
  io::write_file_atomic((fs::path(dir) / "config.json").string(), cs.data(), cs.size());
  // Remove what an earlier save left behind and this one did not write.
  const std::set<std::string> keep(names.begin(), names.end());
  for (const auto& ent : fs::directory_iterator(dir)) {
    const std::string fn = ent.path().filename().string();
    const bool ours = fn == "model.safetensors" || fn == "model.safetensors.index.json" ||
                      (fn.rfind("model-", 0) == 0 && fn.find("-of-") != std::string::npos &&
                       fn.size() > 12 && fn.compare(fn.size() - 12, 12, ".safetensors") == 0);
    if (!ours || keep.count(fn)) continue;
    if (fn == "model.safetensors.index.json" && n > 1) continue;
    fs::remove(ent.path());
  }
}

}  // namespace quads::model
