#include "experiment/report.h"

#include "base/files.h"
#include "base/subprocess.h"
#include "base/text.h"
#include "experiment/svg_chart.h"

#include <cohort/error.h>

#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

namespace cohort::experiment {

namespace fs = std::filesystem;

namespace {

Measure measure(std::vector<double> values) {
  Measure m;
  if (values.empty()) return m;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  m.median = n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  m.low = values.front();
  m.high = values.back();
  return m;
}

double medianOf(std::vector<double> values) { return measure(std::move(values)).median.value_or(0); }

std::vector<const RunData*> okRuns(const ConfigResult& c) {
  std::vector<const RunData*> out;
  for (size_t i = 0; i < c.runs.size() && i < c.data.size(); ++i) {
    if (c.runs[i].status == JobStatus::kOk && c.data[i].hasDone) out.push_back(&c.data[i]);
  }
  return out;
}

// Pointwise medians over runs of one configuration (their evaluations are at the same steps).
std::vector<std::pair<double, double>> medianCurve(const std::vector<const RunData*>& runs, bool byTime) {
  std::vector<std::pair<double, double>> out;
  if (runs.empty()) return out;
  size_t n = runs.front()->evals.size();
  for (const RunData* r : runs) n = std::min(n, r->evals.size());
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> xs, ys;
    for (const RunData* r : runs) {
      xs.push_back(byTime ? r->evals[i].wallSeconds : r->evals[i].epochs);
      ys.push_back(r->evals[i].accuracy);
    }
    out.emplace_back(medianOf(xs), medianOf(ys));
  }
  return out;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string measureText(const Measure& m, int digits, double scale = 1.0) {
  if (!m.median) return "&mdash;";
  std::string out = fixed(*m.median * scale, digits);
  if (m.high > m.low) out += " <span class=\"spread\">(" + fixed(m.low * scale, digits) + "&ndash;" + fixed(m.high * scale, digits) + ")</span>";
  return out;
}

// Replaced whole (base/files.h), as results.jsonl is: a kill leaves the last report or the new one.
void writeText(const std::string& path, const std::string& text) { replaceFileWithText(path, text); }

std::string readText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string utcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

// Ranks configurations by one measure, best (largest) first; those without a value last.
std::vector<size_t> ranking(const Summary& s, Measure ConfigSummary::*field) {
  std::vector<size_t> order(s.configs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto& ma = s.configs[a].*field;
    const auto& mb = s.configs[b].*field;
    if (ma.median.has_value() != mb.median.has_value()) return ma.median.has_value();
    return ma.median.value_or(0) > mb.median.value_or(0);
  });
  return order;
}

struct Figure {
  std::string name;
  std::string caption;
  std::string svg;
};

std::vector<Figure> figures(const ReportInput& input, const Summary& summary) {
  std::vector<Figure> out;
  LineChart byEpochs{"accuracy-epochs", "Test accuracy against epochs", "epochs", "test accuracy", {}};
  LineChart byTime{"accuracy-time", "Test accuracy against wall-clock time", "seconds", "test accuracy", {}};
  BarChart speed{"samples-per-second", "Training speed (median, whiskers: min to max)", "samples/s", {}};
  BarChart bytes{"bytes-per-step", "Bytes sent and received per step (chief)", "bytes per step", {}};
  BarChart wait{"communication-wait", "Communication wait per step (chief)", "ms per step", {}};
  LineChart staleness{"staleness", "Staleness of applied updates (asynchronous schemes)", "staleness (updates)",
                      "fraction of updates", {}};
  for (size_t i = 0; i < input.configs.size(); ++i) {
    const ConfigResult& c = input.configs[i];
    const ConfigSummary& cs = summary.configs[i];
    const auto runs = okRuns(c);
    if (runs.empty()) continue;
    byEpochs.series.push_back({c.config.name, medianCurve(runs, false)});
    byTime.series.push_back({c.config.name, medianCurve(runs, true)});
    speed.bars.push_back({c.config.name, *cs.samplesPerSecond.median, cs.samplesPerSecond.low, cs.samplesPerSecond.high});
    bytes.bars.push_back({c.config.name, *cs.bytesPerStep.median, cs.bytesPerStep.low, cs.bytesPerStep.high});
    wait.bars.push_back({c.config.name, *cs.commWaitPerStep.median * 1e3, cs.commWaitPerStep.low * 1e3,
                         cs.commWaitPerStep.high * 1e3});
    if (c.config.asynchronous()) {
      std::vector<double> sum;
      for (const RunData* r : runs) {
        if (sum.size() < r->stalenessHistogram.size()) sum.resize(r->stalenessHistogram.size(), 0);
        for (size_t t = 0; t < r->stalenessHistogram.size(); ++t) sum[t] += double(r->stalenessHistogram[t]);
      }
      double total = 0;
      for (double v : sum) total += v;
      LineSeries s{c.config.name, {}};
      for (size_t t = 0; t < sum.size(); ++t) s.points.emplace_back(double(t), total > 0 ? sum[t] / total : 0);
      staleness.series.push_back(std::move(s));
    }
  }
  out.push_back({byEpochs.id, "Accuracy for a given number of epochs: the median run of each configuration.",
                 renderLineChart(byEpochs)});
  out.push_back({byTime.id, "Accuracy for a given wall-clock time (evaluation time included).", renderLineChart(byTime)});
  out.push_back({speed.id, "Examples per second in steady state (the first 5 steps and evaluations excluded).",
                 renderBarChart(speed)});
  out.push_back({bytes.id, "Bytes the chief sent and received per step: what the scheme puts on the wire.",
                 renderBarChart(bytes)});
  out.push_back({wait.id, "Time per step the chief waited for communication.", renderBarChart(wait)});
  if (!staleness.series.empty()) {
    out.push_back({staleness.id, "How many updates behind the parameters each applied update was computed on.",
                   renderLineChart(staleness)});
  }
  return out;
}

void writeCsvs(const ReportInput& input, const Summary& summary, const std::string& dir) {
  std::string runs =
      "configuration,strategy,workers,run,status,error,steps,samples_per_s,test_accuracy,max_accuracy,wall_s,"
      "bytes_sent,bytes_received,comm_wait_s,command\n";
  std::string evals = "configuration,run,step,epoch,wall_s,accuracy,loss\n";
  for (const ConfigResult& c : input.configs) {
    for (size_t r = 0; r < c.runs.size(); ++r) {
      const JobRecord& rec = c.runs[r];
      const RunData& d = c.data[r];
      const std::string run = std::to_string(r + 1);
      runs += csvField(c.config.name) + "," + schemeName(c.config.scheme) + std::string(",") + std::to_string(c.config.workers) + "," + run +
              "," + (rec.status == JobStatus::kOk ? "ok" : "failed") + "," + csvField(rec.error) + "," +
              std::to_string(d.steps) + "," + exactNumber(d.samplesPerSecond) + "," + exactNumber(d.testAccuracy) + "," +
              exactNumber(d.maxAccuracy()) + "," + exactNumber(d.wallSeconds) + "," + std::to_string(d.bytesSent) + "," +
              std::to_string(d.bytesReceived) + "," + exactNumber(d.commWaitSeconds) + "," + csvField(rec.command) + "\n";
      for (const EvalPoint& e : d.evals) {
        evals += csvField(c.config.name) + "," + run + "," + std::to_string(e.step) + "," + exactNumber(e.epochs) + "," +
                 exactNumber(e.wallSeconds) + "," + exactNumber(e.accuracy) + "," + exactNumber(e.loss) + "\n";
      }
    }
  }
  auto cell = [](const Measure& m) {
    return m.median ? exactNumber(*m.median) + "," + exactNumber(m.low) + "," + exactNumber(m.high) : std::string(",,");
  };
  std::string sum =
      "configuration,ok_runs,samples_per_s,samples_per_s_min,samples_per_s_max,max_accuracy,max_accuracy_min,"
      "max_accuracy_max,accuracy_at_" + exactNumber(summary.timeBudget) + "s,min,max,accuracy_at_" +
      exactNumber(summary.epochBudget) + "_epochs,min,max,bytes_per_step,min,max,comm_wait_per_step_s,min,max,error\n";
  for (const ConfigSummary& cs : summary.configs) {
    sum += csvField(cs.name) + "," + std::to_string(cs.okRuns) + "," + cell(cs.samplesPerSecond) + "," +
           cell(cs.maxAccuracy) + "," + cell(cs.accuracyAtTime) + "," + cell(cs.accuracyAtEpochs) + "," +
           cell(cs.bytesPerStep) + "," + cell(cs.commWaitPerStep) + "," + csvField(cs.error) + "\n";
  }
  writeText(dir + "/runs.csv", runs);
  writeText(dir + "/evals.csv", evals);
  writeText(dir + "/summary.csv", sum);
}

std::string htmlEscape(const std::string& s) { return xmlEscape(s); }

std::string rankingTable(const Summary& summary, const ReportInput& input) {
  struct Criterion {
    const char* title;
    Measure ConfigSummary::*field;
    int digits;
    double scale;
  };
  const std::string atTime = "Accuracy after " + fixed(summary.timeBudget, 1) + " s";
  const std::string atEpochs = "Accuracy after " + fixed(summary.epochBudget, 2) + " epochs";
  const Criterion criteria[] = {{"Training speed (samples/s)", &ConfigSummary::samplesPerSecond, 0, 1},
                                {"Maximum accuracy", &ConfigSummary::maxAccuracy, 4, 1},
                                {atTime.c_str(), &ConfigSummary::accuracyAtTime, 4, 1},
                                {atEpochs.c_str(), &ConfigSummary::accuracyAtEpochs, 4, 1}};
  std::string out = "<table class=\"ranking\"><thead><tr><th>rank</th>";
  for (const Criterion& c : criteria) out += "<th colspan=\"2\">" + htmlEscape(c.title) + "</th>";
  out += "</tr></thead><tbody>\n";
  std::vector<std::vector<size_t>> orders;
  for (const Criterion& c : criteria) orders.push_back(ranking(summary, c.field));
  for (size_t row = 0; row < summary.configs.size(); ++row) {
    out += "<tr><td>" + std::to_string(row + 1) + "</td>";
    for (size_t k = 0; k < std::size(criteria); ++k) {
      const ConfigSummary& cs = summary.configs[orders[k][row]];
      const Measure& m = cs.*(criteria[k].field);
      const bool failed = cs.okRuns == 0;
      out += std::string("<td class=\"") + (failed ? "failed" : row == 0 ? "best" : "") + "\">" + htmlEscape(cs.name) +
             "</td><td class=\"num\">" +
             (failed ? std::string("failed") : measureText(m, criteria[k].digits, criteria[k].scale)) + "</td>";
    }
    out += "</tr>\n";
  }
  out += "</tbody></table>\n";
  (void)input;
  return out;
}

std::string runsTable(const ReportInput& input, const Summary& summary) {
  std::string out =
      "<table class=\"runs\"><thead><tr><th>configuration</th><th>scheme</th><th>processes</th><th>runs ok</th>"
      "<th>samples/s</th><th>time per epoch (s)</th><th>max accuracy</th><th>bytes/step</th><th>wait ms/step</th>"
      "<th>wall s</th><th>status</th></tr></thead><tbody>\n";
  for (size_t i = 0; i < input.configs.size(); ++i) {
    const ConfigResult& c = input.configs[i];
    const ConfigSummary& cs = summary.configs[i];
    Measure epochTime;
    if (cs.samplesPerSecond.median && *cs.samplesPerSecond.median > 0) {
      const double examples = double(c.epochExamples > 0 ? c.epochExamples : input.trainExamples);
      epochTime.median = examples / *cs.samplesPerSecond.median;
      epochTime.low = examples / cs.samplesPerSecond.high;
      epochTime.high = examples / cs.samplesPerSecond.low;
    }
    const std::string processes = std::to_string(c.config.workers) +
                                  (c.config.shards > 0 ? " + " + std::to_string(c.config.shards) + " ps" : "");
    std::string status = cs.okRuns == int(c.runs.size()) ? "ok" : "";
    for (const JobRecord& r : c.runs) {
      if (r.status == JobStatus::kFailed) {
        status = "<span class=\"error\">failed: " + htmlEscape(r.error) + "</span>";
        break;
      }
    }
    out += "<tr><td>" + htmlEscape(c.config.name) + "</td><td>" + htmlEscape(schemeName(c.config.scheme)) + "</td><td>" + processes +
           "</td><td>" + std::to_string(cs.okRuns) + "/" + std::to_string(c.runs.size()) + "</td><td class=\"num\">" +
           measureText(cs.samplesPerSecond, 0) + "</td><td class=\"num\">" + measureText(epochTime, 1) +
           "</td><td class=\"num\">" + measureText(cs.maxAccuracy, 4) + "</td><td class=\"num\">" +
           measureText(cs.bytesPerStep, 0) + "</td><td class=\"num\">" + measureText(cs.commWaitPerStep, 2, 1e3) +
           "</td><td class=\"num\">" + measureText(cs.wallSeconds, 1) + "</td><td>" + status + "</td></tr>\n";
  }
  return out + "</tbody></table>\n";
}

std::string winners(const Summary& summary) {
  struct Named {
    const char* what;
    Measure ConfigSummary::*field;
  };
  const Named named[] = {{"fastest training", &ConfigSummary::samplesPerSecond},
                         {"highest accuracy", &ConfigSummary::maxAccuracy},
                         {"best accuracy for the wall-clock time", &ConfigSummary::accuracyAtTime},
                         {"best accuracy for the epochs", &ConfigSummary::accuracyAtEpochs}};
  std::string out = "<ul class=\"winners\">";
  for (const Named& n : named) {
    const auto order = ranking(summary, n.field);
    if (order.empty() || !(summary.configs[order[0]].*(n.field)).median) continue;
    out += "<li>" + std::string(n.what) + ": <b>" + htmlEscape(summary.configs[order[0]].name) + "</b></li>";
  }
  return out + "</ul>\n";
}

constexpr const char* kStyle = R"(
body { font-family: "DejaVu Sans", Arial, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; white-space: nowrap; }
td.best { font-weight: bold; } td.failed, .error { color: #b00020; }
.spread { color: #777; font-size: 11px; }
figure { margin: 16px 0; } figcaption { font-size: 13px; color: #555; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; white-space: pre-wrap; }
dl { display: grid; grid-template-columns: max-content auto; gap: 4px 12px; font-size: 14px; }
dt { font-weight: bold; }
)";

// Runs when the page loads: counts the charts and their series into #self-check and the console,
// so a browser (the tests' headless Chromium) can show the page was drawn whole.
constexpr const char* kSelfCheck = R"(
(function () {
  var charts = document.querySelectorAll("svg.chart");
  var parts = [];
  for (var i = 0; i < charts.length; i++) {
    parts.push(charts[i].id + "=" + charts[i].querySelectorAll("g.series").length);
  }
  var text = "charts=" + charts.length + ";" + parts.join(";");
  document.getElementById("self-check").textContent = text;
  console.log("cohort-report: " + text);
})();
)";

}  // namespace

std::string exactNumber(double v) {
  if (!std::isfinite(v)) return "";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, end);
}

std::string csvField(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string machineDescription() {
  std::string cpu = "unknown CPU";
  std::istringstream cpuinfo(readText("/proc/cpuinfo"));
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  double memGiB = 0;
  std::istringstream meminfo(readText("/proc/meminfo"));
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemTotal:", 0) == 0) memGiB = std::atof(line.substr(9).c_str()) / (1024.0 * 1024.0);
  }
  utsname u{};
  ::uname(&u);
  return std::string(u.nodename) + ": " + std::to_string(std::thread::hardware_concurrency()) + " cores, " + cpu + ", " +
         fixed(memGiB, 0) + " GiB, " + u.sysname + " " + u.release;
}

Summary summarize(const ReportInput& input) {
  Summary s;
  // The common budgets: the wall-clock time every configuration's median run reached (the
  // fastest one's last evaluation) and the epochs every one completed.
  double time = std::numeric_limits<double>::infinity(), epochs = std::numeric_limits<double>::infinity();
  for (const ConfigResult& c : input.configs) {
    const auto runs = okRuns(c);
    if (runs.empty()) continue;
    std::vector<double> lastTime, lastEpochs;
    for (const RunData* r : runs) {
      if (r->evals.empty()) continue;
      lastTime.push_back(r->evals.back().wallSeconds);
      lastEpochs.push_back(r->evals.back().epochs);
    }
    if (lastTime.empty()) continue;
    time = std::min(time, medianOf(lastTime));
    epochs = std::min(epochs, medianOf(lastEpochs));
  }
  s.timeBudget = std::isfinite(time) ? time : 0;
  s.epochBudget = std::isfinite(epochs) ? epochs : 0;
  for (const ConfigResult& c : input.configs) {
    ConfigSummary cs;
    cs.name = c.config.name;
    for (const JobRecord& r : c.runs) {
      if (r.status == JobStatus::kFailed && cs.error.empty()) cs.error = r.error;
    }
    const auto runs = okRuns(c);
    cs.okRuns = int(runs.size());
    std::vector<double> speed, maxAcc, atTime, atEpochs, bytes, wait, wall;
    for (const RunData* r : runs) {
      speed.push_back(r->samplesPerSecond);
      maxAcc.push_back(r->maxAccuracy());
      if (auto a = r->accuracyAtSeconds(s.timeBudget)) atTime.push_back(*a);
      if (auto a = r->accuracyAtEpochs(s.epochBudget)) atEpochs.push_back(*a);
      bytes.push_back(r->bytesPerStep());
      wait.push_back(r->commWaitPerStep());
      wall.push_back(r->wallSeconds);
    }
    cs.samplesPerSecond = measure(speed);
    cs.maxAccuracy = measure(maxAcc);
    cs.accuracyAtTime = measure(atTime);
    cs.accuracyAtEpochs = measure(atEpochs);
    cs.bytesPerStep = measure(bytes);
    cs.commWaitPerStep = measure(wait);
    cs.wallSeconds = measure(wall);
    s.configs.push_back(std::move(cs));
  }
  return s;
}

namespace {

// rsvg-convert, run without a shell (an --out with a quote in it broke the command line); its
// own words when it fails, and a bound on how long it may take.
void convertToPng(const std::string& svg, const std::string& png) {
  constexpr auto kLimit = std::chrono::seconds(60);
  CapturedRun run;
  try {
    run = runCapturingOutput({"rsvg-convert", "--format=png", "--zoom=1.5", "--output", png, svg}, kLimit, 64 * 1024);
  } catch (const SubprocessError& e) {
    throw IoError(png + ": " + e.what() + " (apt-get install librsvg2-bin, or pass --no-png)");
  }
  COHORT_CHECK(run.status.has_value(), IoError, png, ": rsvg-convert took more than ", kLimit.count(), " s");
  COHORT_CHECK(run.status->ok(), IoError, png, ": rsvg-convert failed (exit ", run.status->shellCode(),
               "): ", firstLine(run.output), " (or pass --no-png)");
}

}  // namespace

std::string writeReport(const ReportInput& input, const std::string& dir, const ReportOptions& options) {
  const Summary summary = summarize(input);
  std::error_code ec;
  fs::create_directories(dir + "/figures", ec);
  COHORT_CHECK(!ec, IoError, dir, "/figures: cannot create: ", ec.message());
  const std::vector<Figure> figs = figures(input, summary);
  for (const Figure& f : figs) {
    const std::string svg = dir + "/figures/" + f.name + ".svg";
    writeText(svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n" + f.svg);
    if (options.png) {
      const std::string png = dir + "/figures/" + f.name + ".png";
      convertToPng(svg, png);
    }
  }
  writeCsvs(input, summary, dir);

  std::string html = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>" +
                     htmlEscape(input.title) + "</title>\n<style>" + kStyle + "</style></head>\n<body>\n";
  html += "<h1>" + htmlEscape(input.title) + "</h1>\n";
  html += "<dl><dt>date</dt><dd>" + utcNow() + "</dd><dt>machine</dt><dd>" + htmlEscape(machineDescription()) +
          "</dd><dt>budget</dt><dd>" + htmlEscape(input.budget) + "</dd><dt>network</dt><dd>" +
          htmlEscape(input.network) + "</dd><dt>command</dt><dd><code>" + htmlEscape(input.invocation) +
          "</code></dd></dl>\n";
  html += "<h2>Which approach is best?</h2>\n" + winners(summary);
  html += "<p>Rankings by Skymind's four criteria (median over runs; in brackets the range). Accuracy for a given "
          "wall-clock time is read at " + fixed(summary.timeBudget, 1) +
          " s, when the fastest configuration had finished; for a given number of epochs at " +
          fixed(summary.epochBudget, 2) + " epochs.</p>\n";
  html += rankingTable(summary, input);
  html += "<h2>Configurations</h2>\n" + runsTable(input, summary);
  html += "<h2>Figures</h2>\n";
  for (const Figure& f : figs) {
    html += "<figure id=\"figure-" + f.name + "\">\n" + f.svg + "<figcaption>" + htmlEscape(f.caption) +
            " (figures/" + f.name + ".svg, .png)</figcaption></figure>\n";
  }
  html += "<h2>Commands</h2>\n<p>Each configuration's first run (runs.csv has every run's):</p>\n";
  for (const ConfigResult& c : input.configs) {
    html += "<p><b>" + htmlEscape(c.config.name) + "</b></p><pre>" + htmlEscape(c.command) + "</pre>\n";
  }
  html += "<p>Raw data: runs.csv, evals.csv, summary.csv and runs/*/metrics.jsonl beside this file.</p>\n";
  html += "<pre id=\"self-check\"></pre>\n<script>" + std::string(kSelfCheck) + "</script>\n</body></html>\n";
  const std::string path = dir + "/report.html";
  writeText(path, html);
  return path;
}

}  // namespace cohort::experiment
