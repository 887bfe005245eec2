#include "reqat/tokens.h"

#include <algorithm>
#include <memory>

#include "common/error.h"
#include "train/backend.h"
#include "train/losses.h"

namespace quads::reqat {

const char* token_class_name(TokenClass c) {
  switch (c) {
    case TokenClass::Digit: return "digit";
    case TokenClass::Operator: return "operator";
    default: return "other";
  }
}

TokenClass classify_token(const rl::CharTokenizer& tok, int32_t id) {
  if (id < 0 || id >= tok.vocab_size() || tok.is_special(id)) return TokenClass::Other;
  const std::string& s = tok.token(id);
  if (s.size() != 1) return TokenClass::Other;
  const char ch = s[0];
  if (ch >= '0' && ch <= '9') return TokenClass::Digit;
  if (std::string_view("+-*=>()").find(ch) != std::string_view::npos) return TokenClass::Operator;
  return TokenClass::Other;
}

int64_t first_divergence(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

nlohmann::json TokenAnalysis::to_json() const {
  nlohmann::json j = {{"tasks", n},
                      {"diverged", diverged},
                      {"quant_errors", errors},
                      {"quant_errors_low_entropy", errors_low},
                      {"share_quant_errors_low_entropy", share_errors_low()},
                      {"low_entropy_threshold", low_entropy},
                      {"mean_entropy_at_divergence", mean_entropy_diverged},
                      {"mean_entropy_all_tokens", mean_entropy_all},
                      {"share_low_entropy_tokens", share_low_all}};
  for (int c = 0; c < 3; ++c) {
    j["divergences_by_class"][token_class_name(static_cast<TokenClass>(c))] = class_count[c];
    j["quant_errors_by_class"][token_class_name(static_cast<TokenClass>(c))] = error_class_count[c];
  }
  return j;
}

TokenAnalysis analyze_divergence(const model::Weights& w, const QFit* qfit, const std::vector<rl::Task>& tasks,
                                 const EvalResult& fp, const EvalResult& q, const rl::CharTokenizer& tok,
                                 double low_entropy, const std::string& device) {
  QUADS_CHECK(device == "cpu" || device == "cuda", "token analysis: device \"{}\" (cpu | cuda)", device);
  QUADS_CHECK(fp.responses.size() == tasks.size() && q.responses.size() == tasks.size(),
              "token analysis: {} tasks but {} / {} responses", tasks.size(), fp.responses.size(), q.responses.size());
  TokenAnalysis a;
  a.n = static_cast<int>(tasks.size());
  a.low_entropy = low_entropy;
  // Entropy of the full-precision model along its own greedy traces (one packed forward per chunk).
  KvQuantConfig off;
  off.enabled = false;
  const bool with_qfit = qfit && !qfit->empty();
  model::Weights wc;  // the CPU model's (it keeps a reference)
  std::unique_ptr<model::Model> m;
  std::unique_ptr<train::TrainBackend> dev;
  if (device == "cuda") {
    dev = train::gpu_train_backend_factory()(w, model::PrecisionConfig::preset("fp32"));
    if (with_qfit) dev->set_kv_transform(make_kv_transform(w.cfg, off, qfit));
  } else {
    wc = w;
    m = std::make_unique<model::Model>(wc, model::PrecisionConfig::preset("fp32"));
    if (with_qfit) install_kv_hooks(*m, off, qfit);
  }
  const int64_t V = w.cfg.vocab_size;
  double hsum = 0;
  int64_t hcount = 0, hlow = 0;
  double div_sum = 0;
  const size_t chunk = 64;
  for (size_t first = 0; first < tasks.size(); first += chunk) {
    const size_t last = std::min(tasks.size(), first + chunk);
    model::Batch b;
    std::vector<int64_t> plen;
    for (size_t i = first; i < last; ++i) {
      std::vector<int32_t> ids = tok.encode_prompt(tasks[i].prompt);
      plen.push_back(static_cast<int64_t>(ids.size()));
      ids.insert(ids.end(), fp.responses[i].begin(), fp.responses[i].end());
      b.add(ids);
    }
    std::vector<float> logits(b.ntokens() * V), H(b.ntokens());
    if (dev) dev->forward(b, logits.data(), false);
    else m->forward(b, logits.data());
    train::entropy(logits.data(), b.ntokens(), V, H.data());
    for (size_t i = first; i < last; ++i) {
      const int s = static_cast<int>(i - first);
      // Response token k is predicted at row offsets[s] + plen - 1 + k.
      const int64_t row0 = b.offsets[s] + plen[s] - 1;
      const int64_t nresp = static_cast<int64_t>(fp.responses[i].size());
      for (int64_t k = 0; k < nresp; ++k) {
        hsum += H[row0 + k];
        ++hcount;
        if (H[row0 + k] < low_entropy) ++hlow;
      }
      const int64_t pos = first_divergence(fp.responses[i], q.responses[i]);
      if (pos < 0) continue;
      Divergence d;
      d.task = static_cast<int>(i);
      d.pos = pos;
      // pos == nresp: the quantized trace continued past the end of the full-precision one (which
      // stopped without <eos> at max_new_tokens); no full-precision prediction there.
      if (pos >= nresp) continue;
      d.entropy = H[row0 + pos];
      d.cls = classify_token(tok, fp.responses[i][pos]);
      d.fp_correct = fp.verdicts[i].outcome == rl::Outcome::Correct;
      d.q_correct = q.verdicts[i].outcome == rl::Outcome::Correct;
      ++a.diverged;
      div_sum += d.entropy;
      ++a.class_count[static_cast<int>(d.cls)];
      if (d.fp_correct && !d.q_correct) {
        ++a.errors;
        ++a.error_class_count[static_cast<int>(d.cls)];
        if (d.entropy < low_entropy) ++a.errors_low;
      }
      a.records.push_back(d);
    }
  }
  a.mean_entropy_diverged = a.diverged ? div_sum / a.diverged : 0.0;
  a.mean_entropy_all = hcount ? hsum / static_cast<double>(hcount) : 0.0;
  a.share_low_all = hcount ? static_cast<double>(hlow) / static_cast<double>(hcount) : 0.0;
  return a;
}

}  // namespace quads::reqat
