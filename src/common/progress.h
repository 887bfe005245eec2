#pragma once
// A terminal progress bar on stderr for long loops (SFT steps, RL steps, evaluation):
//   sft [##########..........]  120/600  0:42<2:48  loss=0.8123 lr=0.003
// On a terminal it redraws one line in place (at most 10 times a second, and always at the end);
// when stderr is a file or a pipe it prints a plain line at every 10% instead, so logs stay short.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace quads {

using Metrics = std::vector<std::pair<std::string, double>>;

class ProgressBar {
 public:
  ProgressBar(int64_t total, std::string label, std::FILE* out = stderr);
  ~ProgressBar();  // finishes the line if finish() was not called
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // `done` steps of `total` are finished; metrics are shown as name=value (4 significant digits).
  void update(int64_t done, const Metrics& metrics = {});
  void finish();

 private:
  void draw(bool force);
  int64_t total_, done_ = 0;
  std::string label_;
  std::FILE* out_;
  bool tty_;
  bool finished_ = false;
  int last_decile_ = -1;
  int64_t last_printed_ = -1;
  Metrics metrics_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// "m:ss" below an hour, "h:mm:ss" above; "?" for a negative or non-finite value.
std::string format_duration(double seconds);
// The bar line without control characters. ETA = elapsed / done * (total - done), "?" before the
// first step. bar_width 0 leaves the bar out.
std::string format_progress(std::string_view label, int64_t done, int64_t total, double elapsed_s,
                            const Metrics& metrics, int bar_width = 20);

}  // namespace quads
