#include "io/export.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/quantized_checkpoint.h"
#include "io/safetensors.h"

namespace quads::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Shared with io/quantized_checkpoint.cpp, whose reader (load_quantized_weight) parses it.
constexpr const char* kAmaxPrefix = "quads.nvfp4_amax.";
constexpr float kFp4Fp8Max = 6.0f * 448.0f;  // 2688: ModelOpt's scale = amax / (6 * 448)

std::string format_amax(float a) { return fmt::format("{:.8e}", a); }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string strip_suffix(const std::string& s, const std::string& suffix) { return s.substr(0, s.size() - suffix.size()); }

// Decoder layer of an HF module name, or -1.
int layer_of(const std::string& module) {
  const std::string p = "model.layers.";
  if (module.compare(0, p.size(), p) != 0) return -1;
  return std::atoi(module.c_str() + p.size());
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  QUADS_CHECK(f.good(), "cannot open {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json read_json(const std::string& path) {
  const std::string text = read_text(path);
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    fail("{}: invalid JSON ({})", path, e.what());
  }
}

void write_json(const std::string& path, const json& j) {
  const std::string s = j.dump(2) + "\n";
  write_file_atomic(path, s.data(), s.size());
}

const char* kTokenizerFiles[] = {"tokenizer.json",    "tokenizer_config.json",  "special_tokens_map.json",
                                 "vocab.json",        "merges.txt",             "generation_config.json",
                                 "chat_template.jinja"};

void copy_tokenizer(const std::string& from, const std::string& to, ExportReport& rep) {
  if (from.empty()) return;
  std::error_code ec;
  if (fs::equivalent(from, to, ec)) return;
  for (const char* name : kTokenizerFiles) {
    const fs::path src = fs::path(from) / name;
    if (!fs::exists(src)) continue;
    const std::string s = read_text(src.string());
    write_file_atomic((fs::path(to) / name).string(), s.data(), s.size());
    rep.files.push_back(name);
  }
}

// The weight quantizer must be the one ModelOpt's NVFP4 layout can express.
void check_exportable(const model::LinearNumerics& n, const std::string& module) {
  const num::QConfig& c = n.weight.cfg;
  QUADS_CHECK(c.scheme == num::Scheme::NVFP4 && c.block == num::Block::B1x16 && c.global == num::Global::PerTensor &&
                  c.element == num::Format::E2M1 && !c.stochastic,
              "{}: weight quantizer '{}' cannot be written in the ModelOpt NVFP4 layout (needs NVFP4 E2M1 1x16 with "
              "a per-tensor global scale)",
              module, c.describe());
}

// One output tensor (already laid out) and the shard it goes to.
struct OutTensor {
  TensorData data;
  std::string amax_key, amax_value;  // metadata entry for its exact amax, if any
};

void write_shards(const std::string& dir, std::vector<OutTensor>& tensors, const std::map<std::string, std::string>& meta,
                  size_t max_shard_bytes, ExportReport& rep) {
  std::vector<std::vector<size_t>> shards(1);
  size_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t b = tensors[i].data.bytes.size();
    if (cur > 0 && cur + b > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += b;
    total += b;
  }
  const size_t n = shards.size();
  json weight_map = json::object();
  for (size_t s = 0; s < n; ++s) {
    const std::string fn = n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n);
    std::vector<TensorData> part;
    std::map<std::string, std::string> m = meta;
    for (size_t i : shards[s]) {
      if (!tensors[i].amax_key.empty()) m[tensors[i].amax_key] = tensors[i].amax_value;
      weight_map[tensors[i].data.name] = fn;
      part.push_back(std::move(tensors[i].data));
    }
    write_safetensors((fs::path(dir) / fn).string(), part, m);
    rep.files.push_back(fn);
    rep.bytes += fs::file_size(fs::path(dir) / fn);
  }
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (n > 1) {
    write_json(index.string(), json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
    rep.files.push_back(index.filename().string());
  } else if (fs::exists(index)) {
    fs::remove(index);
  }
  // Shards of an earlier export with a different count would shadow nothing (the index names
  // the files) but mislead; remove those this export did not write.
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("model-", 0) == 0 && ends_with(f, ".safetensors") &&
        std::find(rep.files.begin(), rep.files.end(), f) == rep.files.end())
      fs::remove(e.path());
  }
}

void export_nvfp4(const model::Weights& w, const std::string& dir, const ExportOptions& opt, ExportReport& rep) {
  const model::PrecisionConfig prec = model::PrecisionConfig::preset(opt.precision);
  const int L = w.cfg.num_hidden_layers;
  QuantizeOptions qopt;  // NVFP4 1x16, per-tensor global: the engine's weight quantizer
  qopt.format = CheckpointFormat::NVFP4;

  std::vector<OutTensor> out;
  for (const model::ParamInfo& p : w.layout.params) {
    const float* x = w.data.data() + p.offset;
    const bool linear = p.shape.size() == 2 && ends_with(p.name, ".weight") && p.name != "model.embed_tokens.weight";
    const std::string module = linear ? strip_suffix(p.name, ".weight") : "";
    model::LinearNumerics num;
    if (linear) num = prec.for_linear(module, layer_of(module), L);
    if (!linear || num.weight.kind != model::QuantKind::Quant) {
      if (linear) rep.excluded.push_back(module);
      out.push_back({TensorData::from_f32(p.name, p.shape, x, opt.bf16 ? DType::BF16 : DType::F32), "", ""});
      continue;
    }
    check_exportable(num, module);
    QuantizedWeight q = quantize_weight(p.name, x, p.shape[0], p.shape[1], qopt);
    const std::string amax = format_amax(q.q.amax[0]);
    for (size_t i = 0; i < q.tensors.size(); ++i)
      out.push_back({std::move(q.tensors[i]), i == 0 ? kAmaxPrefix + p.name : "", i == 0 ? amax : ""});
    auto it = opt.input_amax.find(module);
    if (it != opt.input_amax.end()) {
      const float a = it->second;
      QUADS_CHECK(std::isfinite(a) && a > 0, "{}: calibrated input amax is {}; calibrate on more prompts", module, a);
      const float scale = a / kFp4Fp8Max;
      const std::string name = module + ".input_scale";
      out.push_back({TensorData::raw(name, DType::F32, {}, &scale, 4), kAmaxPrefix + name, format_amax(a)});
    }
    ++rep.quantized;
  }

  std::map<std::string, std::string> meta{{"format", "pt"}, {"quads.quantization", "nvfp4"}};
  write_shards(dir, out, meta, opt.max_shard_bytes, rep);

  // hf_quant_config.json is what vLLM's ModelOpt config and TensorRT-LLM read; config.json's
  // quantization_config (same content plus quant_method) is what transformers and newer vLLM read.
  const json producer = {{"name", "quads"}, {"version", opt.producer_version}};
  const json quantization = {{"quant_algo", "NVFP4"},
                             {"kv_cache_quant_algo", nullptr},
                             {"group_size", 16},
                             {"exclude_modules", rep.excluded}};
  write_json((fs::path(dir) / "hf_quant_config.json").string(), {{"producer", producer}, {"quantization", quantization}});
  rep.files.push_back("hf_quant_config.json");
  json cfg = w.cfg.to_json();
  cfg["quantization_config"] = {{"quant_method", "modelopt"}, {"producer", producer}, {"quantization", quantization}};
  write_json((fs::path(dir) / "config.json").string(), cfg);
  rep.files.push_back("config.json");
}

}  // namespace

ExportFormat parse_export_format(const std::string& s) {
  if (s == "hf") return ExportFormat::HF;
  if (s == "nvfp4") return ExportFormat::NVFP4;
  fail("unknown export format '{}' (hf or nvfp4)", s);
}

ExportReport export_checkpoint(const model::Weights& w, const std::string& dir, const ExportOptions& opt,
                               const std::string& tokenizer_dir) {
  fs::create_directories(dir);
  ExportReport rep;
  if (opt.format == ExportFormat::HF) {
    model::SaveOptions so;
    so.bf16 = opt.bf16;
    so.max_shard_bytes = opt.max_shard_bytes;
    w.save(dir, so);
    // A quantization config left by an earlier nvfp4 export would make loaders misread the files.
    std::error_code ec;
    fs::remove(fs::path(dir) / "hf_quant_config.json", ec);
    for (const auto& f : model::checkpoint_files(dir)) {
      rep.files.push_back(fs::path(f).filename().string());
      rep.bytes += fs::file_size(f);
    }
    if (fs::exists(fs::path(dir) / "model.safetensors.index.json")) rep.files.push_back("model.safetensors.index.json");
    rep.files.push_back("config.json");
  } else {
    export_nvfp4(w, dir, opt, rep);
  }
  copy_tokenizer(tokenizer_dir, dir, rep);
  return rep;
}

std::map<std::string, float> calibrate_input_amax(model::Model& m, const std::vector<std::vector<int32_t>>& prompts,
                                                  int64_t batch_tokens) {
  std::map<std::string, float> amax;
  for (const auto& L : m.linears()) amax[L.name] = 0.f;
  std::mutex mu;  // max is order-independent, so the result does not depend on who locks first
  model::ForwardOptions fo;
  fo.probe = [&](const model::LinearQ& L, const float* X, const float*, const float*, int64_t M) {
    float a = 0.f;
    const int64_t n = M * L.in;
    for (int64_t i = 0; i < n; ++i) {
      const float v = std::fabs(X[i]);
      QUADS_CHECK(!std::isnan(v), "{}: NaN in the calibration activations", L.name);
      a = std::max(a, v);
    }
    std::lock_guard<std::mutex> lock(mu);
    float& dst = amax[L.name];
    dst = std::max(dst, a);
  };
  std::vector<float> logits;
  size_t i = 0;
  while (i < prompts.size()) {
    model::Batch b;
    while (i < prompts.size() && (b.ntokens() == 0 || b.ntokens() + int64_t(prompts[i].size()) <= batch_tokens)) {
      if (!prompts[i].empty()) b.add(prompts[i]);
      ++i;
    }
    if (b.ntokens() == 0) continue;
    logits.resize(size_t(b.ntokens()) * m.config().vocab_size);
    m.forward(b, logits.data(), nullptr, fo);
  }
  // Experts no calibration token was routed to: the largest amax of the same projection in the
  // layer (vLLM uses one input scale for all experts of a layer anyway); gate/up then the router's
  // (the same input rows).
  for (auto& [name, a] : amax) {
    if (a > 0) continue;
    const size_t pos = name.find(".mlp.experts.");
    if (pos == std::string::npos) continue;
    const std::string prefix = name.substr(0, pos);
    const std::string proj = name.substr(name.rfind('.'));
    float best = 0;
    for (const auto& [other, b] : amax)
      if (other.compare(0, pos, prefix) == 0 && other.find(".mlp.experts.") == pos && ends_with(other, proj))
        best = std::max(best, b);
    if (best == 0 && proj != ".down_proj") {
      auto r = amax.find(prefix + ".mlp.gate");
      if (r != amax.end()) best = r->second;
    }
    a = best;
  }
  return amax;
}

bool is_modelopt_checkpoint(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "hf_quant_config.json")) return true;
  const fs::path c = fs::path(dir) / "config.json";
  if (!fs::exists(c)) return false;
  const json j = read_json(c.string());
  return j.contains("quantization_config") && j["quantization_config"].is_object() &&
         j["quantization_config"].value("quant_method", "") == "modelopt";
}

Nvfp4Checkpoint load_nvfp4_checkpoint(const std::string& dir) {
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  json cj = read_json(cfg_path);
  json qc;
  const fs::path hq = fs::path(dir) / "hf_quant_config.json";
  if (fs::exists(hq)) qc = read_json(hq.string());
  else if (cj.contains("quantization_config")) qc = cj["quantization_config"];
  else fail("{}: neither hf_quant_config.json nor a quantization_config in config.json: not a ModelOpt checkpoint", dir);
  const json& q = qc.contains("quantization") ? qc["quantization"] : qc;
  const std::string algo = q.value("quant_algo", "");
  QUADS_CHECK(algo == "NVFP4" || algo == "nvfp4", "{}: quant_algo is '{}', only NVFP4 is read", dir, algo);
  QUADS_CHECK(q.value("group_size", 16) == 16, "{}: group_size {} (NVFP4 needs 16)", dir, q.value("group_size", 0));
  QUADS_CHECK(!q.contains("kv_cache_quant_algo") || q["kv_cache_quant_algo"].is_null(),
              "{}: kv_cache_quant_algo {} is not supported", dir, q["kv_cache_quant_algo"].dump());
  // The quantization is described by the tensors; the model config proper is the rest.
  cj.erase("quantization_config");

  Nvfp4Checkpoint ck;
  ck.weights = model::Weights(model::ModelConfig::from_json(cj, cfg_path));
  if (q.contains("exclude_modules") && q["exclude_modules"].is_array())
    for (const auto& e : q["exclude_modules"]) ck.exclude_modules.push_back(e.get<std::string>());
  if (qc.contains("producer") && qc["producer"].is_object())
    ck.producer = qc["producer"].value("name", "") + " " + qc["producer"].value("version", "");

  model::Weights& w = ck.weights;
  std::vector<char> seen(w.layout.params.size(), 0);
  QuantizeOptions qopt;
  qopt.format = CheckpointFormat::NVFP4;
  for (const std::string& file : model::checkpoint_files(dir)) {
    auto f = SafeTensorsFile::open(file);
    std::set<std::string> used;
    for (const std::string& name : quantized_weight_names(*f, qopt)) {
      const model::ParamInfo* p = w.layout.find(name);
      QUADS_CHECK(p, "{}: quantized tensor '{}' is not a parameter of this model", file, name);
      num::QTensor qt = load_quantized_weight(*f, name, qopt);
      QUADS_CHECK(p->shape.size() == 2 && p->shape[0] == qt.rows && p->shape[1] == qt.cols,
                  "{}: tensor '{}' holds [{}, {}] weights, the model expects {}", file, name, qt.rows, qt.cols,
                  shape_str(p->shape));
      const size_t idx = static_cast<size_t>(p - w.layout.params.data());
      QUADS_CHECK(!seen[idx], "{}: tensor '{}' appears twice in the checkpoint", file, name);
      seen[idx] = 1;
      num::dequantize(qt, w.data.data() + p->offset);
      const std::string module = strip_suffix(name, ".weight");
      LinearState st;
      st.wq = std::move(qt);
      const std::string in_name = module + ".input_scale";
      if (const TensorView* t = f->find(in_name)) {
        QUADS_CHECK(t->dtype == DType::F32 && t->numel() == 1, "{}: '{}' should be an F32 scalar, is {} {}", file,
                    in_name, dtype_name(t->dtype), shape_str(t->shape));
        float scale;
        std::memcpy(&scale, t->data, 4);
        auto it = f->metadata().find(kAmaxPrefix + in_name);
        if (it != f->metadata().end()) {
          char* end = nullptr;
          st.input_amax = std::strtof(it->second.c_str(), &end);
          QUADS_CHECK(end && *end == '\0', "{}: metadata '{}' = '{}' is not a number", file, it->first, it->second);
        } else {
          st.input_amax = scale * kFp4Fp8Max;
        }
        QUADS_CHECK(std::isfinite(st.input_amax) && st.input_amax > 0, "{}: '{}' = {} is not a positive scale", file,
                    in_name, scale);
        used.insert(in_name);
      }
      used.insert(name);
      used.insert(name + "_scale");
      used.insert(name + "_scale_2");
      ck.linears[module] = std::move(st);
    }
    for (const TensorView& t : f->tensors()) {
      if (used.count(t.name)) continue;
      if (ends_with(t.name, "rotary_emb.inv_freq")) continue;
      const model::ParamInfo* p = w.layout.find(t.name);
      QUADS_CHECK(p, "{}: tensor '{}' ({} {}) is not a parameter of this model, nor part of an NVFP4 weight", file,
                  t.name, dtype_name(t.dtype), shape_str(t.shape));
      QUADS_CHECK(t.shape == p->shape, "{}: tensor '{}' has shape {}, the model expects {}", file, t.name,
                  shape_str(t.shape), shape_str(p->shape));
      QUADS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16,
                  "{}: tensor '{}' is {}, expected F32, BF16 or F16", file, t.name, dtype_name(t.dtype));
      const size_t idx = static_cast<size_t>(p - w.layout.params.data());
      QUADS_CHECK(!seen[idx], "{}: tensor '{}' appears twice in the checkpoint", file, t.name);
      seen[idx] = 1;
      t.to_f32(w.data.data() + p->offset);
    }
  }
  for (size_t i = 0; i < seen.size(); ++i)
    QUADS_CHECK(seen[i], "{}: parameter '{}' is missing from the checkpoint", dir, w.layout.params[i].name);
  return ck;
}

void apply_nvfp4_checkpoint(model::Model& m, const Nvfp4Checkpoint& ck, ActScale act) {
  num::QConfig a;  // NVFP4 E2M1 1x16
  a.global = act == ActScale::PerToken ? num::Global::PerRow : num::Global::Static;
  size_t found = 0;
  for (model::LinearQ& L : m.linears()) {
    auto it = ck.linears.find(L.name);
    if (it == ck.linears.end()) continue;
    ++found;
    L.num.weight = model::OperandQuant::none();
    L.num.act = model::OperandQuant::quant(a);
    if (act == ActScale::Static) {
      QUADS_CHECK(it->second.input_amax > 0, "{}: static activation scales requested but the checkpoint has no "
                  "input_scale for it", L.name);
      L.act_static_amax = it->second.input_amax;
    }
  }
  QUADS_CHECK(found == ck.linears.size(), "{} quantized modules of the checkpoint are not linears of the model",
              ck.linears.size() - found);
  m.sync();
  for (model::LinearQ& L : m.linears()) {
    auto it = ck.linears.find(L.name);
    if (it != ck.linears.end()) L.wq = it->second.wq;
  }
}

void use_static_input_scales(model::Model& m, const std::map<std::string, float>& input_amax) {
  for (model::LinearQ& L : m.linears()) {
    if (L.num.act.kind != model::QuantKind::Quant || L.num.act.cfg.scheme != num::Scheme::NVFP4) continue;
    auto it = input_amax.find(L.name);
    QUADS_CHECK(it != input_amax.end() && it->second > 0, "{}: no calibrated input amax", L.name);
    L.num.act.cfg.global = num::Global::Static;
    L.act_static_amax = it->second;
  }
  m.sync();
}

}  // namespace quads::io
