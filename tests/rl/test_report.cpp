#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "common/error.h"
#include "common/progress.h"
#include "rl/report.h"

using namespace quads::rl;
using json = nlohmann::json;

namespace {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / ("quads_rl_" + name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& f) const { return (path / f).string(); }
};

json train_row(const std::string& mode, int seed, int step, double gap_mean, double gap_max, double elapsed) {
  return {{"kind", "train"}, {"mode", mode}, {"seed", seed}, {"step", step}, {"elapsed_s", elapsed},
          {"gap_mean_abs", gap_mean}, {"gap_max_abs", gap_max}, {"reward_mean", 0.5}};
}
json eval_row(const std::string& mode, int seed, int step, double pass1, double elapsed) {
  return {{"kind", "eval"}, {"mode", mode}, {"seed", seed}, {"step", step}, {"elapsed_s", elapsed}, {"pass1", pass1}};
}

}  // namespace

TEST(RlReport, MeanStdHandComputed) {
  std::vector<double> v{1, 2, 3, 4};
  MeanStd ms = mean_std(v);
  EXPECT_DOUBLE_EQ(ms.mean, 2.5);
  EXPECT_NEAR(ms.std, std::sqrt(5.0 / 3.0), 1e-15);  // sample std: sum of squares 5 over n-1 = 3
  std::vector<double> one{0.7};
  EXPECT_DOUBLE_EQ(mean_std(one).mean, 0.7);
  EXPECT_EQ(mean_std(one).std, 0.0);
  EXPECT_EQ(mean_std(std::vector<double>{}).mean, 0.0);
}

TEST(RlReport, JsonlRoundTripAndFlushPerLine) {
  TempDir dir("jsonl");
  std::vector<json> rows{
      {{"step", 0}, {"loss", 0.1}, {"tiny", 1e-300}, {"name", "a \"quoted\"\nline"}},
      {{"step", 1}, {"nested", {{"a", 1}, {"b", {1.5, 2.5}}}}, {"flag", true}},
      {{"step", 2}, {"big", 12345678901234LL}, {"neg", -0.25}},
  };
  {
    MetricsWriter w(dir.file("m.jsonl"));
    w.write(rows[0]);
    // Flushed at once: a reader sees the row while the writer is still open.
    EXPECT_EQ(read_jsonl(dir.file("m.jsonl")).size(), 1u);
    w.write(rows[1]);
    EXPECT_THROW(w.write(json::array({1, 2})), quads::Error);
  }
  {
    MetricsWriter w(dir.file("m.jsonl"), /*append=*/true);
    w.write(rows[2]);
  }
  auto back = read_jsonl(dir.file("m.jsonl"));
  ASSERT_EQ(back.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(back[i], rows[i]) << i;
  EXPECT_EQ(back[0]["loss"].get<double>(), 0.1);  // bit-exact doubles

  {
    std::ofstream f(dir.file("bad.jsonl"));
    f << "{\"a\": 1}\n\n{oops\n";
  }
  try {
    read_jsonl(dir.file("bad.jsonl"));
    FAIL() << "no error";
  } catch (const quads::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:3"), std::string::npos) << e.what();
  }
}

TEST(RlReport, CsvColumnsAndQuoting) {
  std::vector<json> rows{
      {{"step", 0}, {"loss", 0.5}, {"mode", "bf16"}},
      {{"step", 1}, {"acc", {{"add", 0.25}}}, {"note", "a,b"}},
      {{"step", 2}, {"loss", 1e-7}, {"note", "say \"hi\""}, {"ok", false}},
  };
  EXPECT_EQ(to_csv(rows),
            "mode,step,loss,acc.add,note,ok\n"
            "bf16,0,0.5,,,\n"
            ",1,,0.25,\"a,b\",\n"
            ",2,1e-07,,\"say \"\"hi\"\"\",false\n");
  TempDir dir("csv");
  write_csv(rows, dir.file("m.csv"));
  std::ifstream f(dir.file("m.csv"));
  std::string header;
  std::getline(f, header);
  EXPECT_EQ(header, "mode,step,loss,acc.add,note,ok");
}

TEST(RlReport, SummarizeRunFromMetrics) {
  std::vector<json> rows{
      eval_row("bf16", 1, 0, 0.2, 1.0),   train_row("bf16", 1, 1, 0.01, 0.2, 2.0),
      eval_row("bf16", 1, 20, 0.3, 9.0),  train_row("bf16", 1, 2, 0.03, 0.5, 3.0),
      eval_row("bf16", 1, 10, 0.5, 5.0),  eval_row("bf16", 2, 10, 0.9, 50.0),  // other seed
      eval_row("fp8", 1, 10, 0.95, 70.0),  // other mode
  };
  RunResult r = summarize_run(rows, "bf16", 1, 0.1);
  EXPECT_DOUBLE_EQ(r.base_pass1, 0.2);
  EXPECT_DOUBLE_EQ(r.final_pass1, 0.3);
  EXPECT_DOUBLE_EQ(r.best_pass1, 0.5);
  EXPECT_DOUBLE_EQ(r.mean_abs_logp_gap, 0.02);
  EXPECT_DOUBLE_EQ(r.max_abs_logp_gap, 0.35);  // mean of the per-step maxima 0.2 and 0.5
  EXPECT_DOUBLE_EQ(r.seconds, 9.0);
  EXPECT_TRUE(r.collapsed);  // 0.3 < 0.5 - 0.1
  EXPECT_FALSE(summarize_run(rows, "bf16", 1, 0.25).collapsed);
  EXPECT_THROW(summarize_run(rows, "nvfp4", 1, 0.1), quads::Error);
}

TEST(RlReport, SummaryMeanAndStdOverSeeds) {
  auto run = [](double final_pass1, bool collapsed) {
    RunResult r;
    r.base_pass1 = 0.2;
    r.final_pass1 = final_pass1;
    r.best_pass1 = 0.6;
    r.mean_abs_logp_gap = 0.01;
    r.max_abs_logp_gap = 0.3;
    r.collapsed = collapsed;
    r.seconds = 10;
    return r;
  };
  auto s = make_summary({{"nvfp4", {run(0.1, true), run(0.5, false), run(0.3, true)}},
                         {"bf16", {run(0.5, false), run(0.6, false), run(0.7, false)}}});
  EXPECT_EQ(s["seeds"].get<int>(), 3);
  auto names = std::vector<std::string>();
  for (const auto& [k, v] : s["modes"].items()) names.push_back(k);
  EXPECT_EQ(names, (std::vector<std::string>{"nvfp4", "bf16"}));  // config order kept
  const auto& m = s["modes"]["nvfp4"];
  EXPECT_NEAR(m["final_pass1"].get<double>(), 0.3, 1e-12);
  EXPECT_NEAR(m["final_pass1_std"].get<double>(), 0.2, 1e-12);  // sqrt((.04 + .04 + 0) / 2)
  EXPECT_EQ(m["collapsed"], true);  // a flag: any seed
  EXPECT_EQ(m["collapsed_seeds"].get<int>(), 2);
  EXPECT_FALSE(m.contains("collapsed_std"));
  EXPECT_NEAR(m["base_pass1_std"].get<double>(), 0.0, 1e-15);
  for (const char* k : {"base_pass1", "final_pass1", "best_pass1", "mean_abs_logp_gap", "max_abs_logp_gap",
                        "seconds"}) {
    EXPECT_TRUE(m.contains(k)) << k;
    EXPECT_TRUE(m.contains(std::string(k) + "_std")) << k;
  }
  EXPECT_EQ(m["per_seed"].size(), 3u);
  EXPECT_EQ(m["per_seed"][0]["collapsed"], true);

  auto one = make_summary({{"bf16", {run(0.5, false)}}});
  EXPECT_FALSE(one["modes"]["bf16"].contains("final_pass1_std"));
  EXPECT_EQ(one["modes"]["bf16"]["collapsed"], false);
  EXPECT_EQ(one["modes"]["bf16"]["collapsed_seeds"].get<int>(), 0);
  EXPECT_THROW(make_summary({{"a", {run(0.1, false)}}, {"b", {run(0.1, false), run(0.2, false)}}}), quads::Error);

  std::string md = report_markdown(s, "[rl]\nsteps = 3\n", {{"pass@1", "pass1.png"}});
  EXPECT_NE(md.find("| nvfp4 | 0.200 ± 0.000 | 0.300 ± 0.200 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| 2/3 |"), std::string::npos) << md;
  EXPECT_NE(md.find("![pass@1](pass1.png)"), std::string::npos);
  EXPECT_NE(md.find("```toml\n[rl]\nsteps = 3\n```"), std::string::npos);
}

TEST(RlReport, SeriesAverageSeedsPerMode) {
  std::vector<json> rows{eval_row("quads", 1, 0, 0.2, 0), eval_row("quads", 2, 0, 0.4, 0),
                         eval_row("quads", 1, 10, 0.5, 0), eval_row("bf16", 1, 0, 0.1, 0),
                         train_row("quads", 1, 3, 0.0, 0.7, 0)};
  auto s = series_by_mode(rows, "eval", "pass1");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].name, "quads");
  EXPECT_EQ(s[0].x, (std::vector<double>{0, 10}));
  EXPECT_NEAR(s[0].y[0], 0.3, 1e-12);
  EXPECT_EQ(s[1].name, "bf16");
  EXPECT_EQ(series_by_mode(rows, "train", "gap_max_abs")[0].y, (std::vector<double>{0.7}));
}

TEST(RlReport, GnuplotDrawsPngs) {
  if (!gnuplot_available()) GTEST_SKIP() << "gnuplot with a png terminal is not installed";
  TempDir dir("plots");
  std::vector<json> rows;
  for (const char* mode : {"bf16", "nvfp4", "quads"})
    for (int step = 0; step <= 20; step += 5) {
      rows.push_back(eval_row(mode, 1, step, 0.2 + 0.01 * step, step));
      if (step) rows.push_back(train_row(mode, 1, step, 0.01, 0.1 * step / 20.0, step));
    }
  auto plots = plot_comparison(rows, dir.path.string());
  ASSERT_EQ(plots.size(), 2u);
  for (const auto& p : plots) {
    std::string path = dir.file(p.file);
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    EXPECT_GT(std::filesystem::file_size(path), 1000u);
    std::ifstream f(path, std::ios::binary);
    char sig[8] = {};
    f.read(sig, 8);
    EXPECT_EQ(std::string(sig, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  }
  // Nothing but the PNGs is left behind.
  size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path)) ++files;
  EXPECT_EQ(files, 2u);
  EXPECT_THROW(plot_lines(dir.file("empty.png"), "t", "x", "y", {Series{"a", {1.0}, {NAN}}}), quads::Error);
}

TEST(RlReport, WriteTextAtomicReplaces) {
  TempDir dir("atomic");
  write_text_atomic(dir.file("a.txt"), "first");
  write_text_atomic(dir.file("a.txt"), "second");
  std::ifstream f(dir.file("a.txt"));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(s, "second");
  EXPECT_THROW(write_text_atomic(dir.file("missing/a.txt"), "x"), quads::Error);
}

// ---- progress bar (src/common/progress.h) --------------------------------------------------------
TEST(RlProgress, FormatsBarTimesAndMetrics) {
  EXPECT_EQ(quads::format_duration(0), "0:00");
  EXPECT_EQ(quads::format_duration(65.4), "1:05");
  EXPECT_EQ(quads::format_duration(3725), "1:02:05");
  EXPECT_EQ(quads::format_duration(-1), "?");
  EXPECT_EQ(quads::format_progress("sft", 50, 200, 10.0, {{"loss", 0.81234}, {"lr", 0.003}}, 10),
            "sft [##........]  50/200  0:10<0:30  loss=0.8123  lr=0.003");
  EXPECT_EQ(quads::format_progress("rl", 0, 5, 0.0, {}, 4), "rl [....] 0/5  0:00<?");
  EXPECT_EQ(quads::format_progress("rl", 5, 5, 61.0, {}, 4), "rl [####] 5/5  1:01<0:00");
  EXPECT_EQ(quads::format_progress("eval", 3, 4, 3.0, {}, 0), "eval 3/4  0:03<0:01");
}

TEST(RlProgress, PlainLinesWhenNotATerminal) {
  TempDir dir("progress");
  std::string path = dir.file("log.txt");
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  {
    quads::ProgressBar bar(20, "steps", f);
    for (int i = 1; i <= 20; ++i) bar.update(i, {{"reward", 0.5}});
  }
  std::fclose(f);
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 11u);  // the first update, then one line per 10%; no control characters
  EXPECT_EQ(lines.back().rfind("steps 20/20", 0), 0u) << lines.back();
  for (const auto& l : lines) EXPECT_EQ(l.find('\r'), std::string::npos);
  EXPECT_NE(lines.back().find("reward=0.5"), std::string::npos);
}
