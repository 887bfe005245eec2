#include "common/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

namespace quads {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  auto t = static_cast<int64_t>(std::llround(s));
  int64_t h = t / 3600, m = (t / 60) % 60, sec = t % 60;
  if (h > 0) return fmt::format("{}:{:02}:{:02}", h, m, sec);
  return fmt::format("{}:{:02}", m, sec);
}

std::string format_progress(std::string_view label, int64_t done, int64_t total, double elapsed_s,
                            const Metrics& metrics, int bar_width) {
  std::string line(label);
  if (bar_width > 0) {
    double frac = total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0) : 0.0;
    int filled = static_cast<int>(frac * bar_width);
    line += " [" + std::string(filled, '#') + std::string(bar_width - filled, '.') + "]";
  }
  int width = static_cast<int>(std::to_string(total).size());
  double eta = done > 0 ? elapsed_s / static_cast<double>(done) * static_cast<double>(total - done) : -1;
  line += fmt::format(" {:>{}}/{}  {}<{}", done, width, total, format_duration(elapsed_s), format_duration(eta));
  for (const auto& [name, v] : metrics) line += fmt::format("  {}={:.4g}", name, v);
  return line;
}

ProgressBar::ProgressBar(int64_t total, std::string label, std::FILE* out)
    : total_(total), label_(std::move(label)), out_(out), tty_(::isatty(::fileno(out)) != 0) {
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

ProgressBar::~ProgressBar() {
  if (!finished_) finish();
}

void ProgressBar::update(int64_t done, const Metrics& metrics) {
  done_ = done;
  if (!metrics.empty()) metrics_ = metrics;
  draw(done_ >= total_);
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  draw(true);
  if (tty_) std::fputc('\n', out_);
  std::fflush(out_);
}

void ProgressBar::draw(bool force) {
  auto now = std::chrono::steady_clock::now();
  double elapsed = std::chrono::duration<double>(now - start_).count();
  if (tty_) {
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    // \r returns to the line start, \x1b[K clears what a longer previous line left behind.
    std::fprintf(out_, "\r%s\x1b[K", format_progress(label_, done_, total_, elapsed, metrics_).c_str());
    std::fflush(out_);
    return;
  }
  int decile = total_ > 0 ? static_cast<int>(10 * done_ / total_) : 10;
  if (decile <= last_decile_ && !(force && done_ != last_printed_)) return;
  last_decile_ = std::max(decile, last_decile_);
  last_printed_ = done_;
  std::fprintf(out_, "%s\n", format_progress(label_, done_, total_, elapsed, metrics_, 0).c_str());
  std::fflush(out_);
}

}  // namespace quads
