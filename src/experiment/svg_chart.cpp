#include "experiment/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace cohort::experiment {

namespace {

constexpr double kWidth = 760;
constexpr double kHeight = 420;
constexpr double kLeft = 70;
constexpr double kRight = 210;  // the legend
constexpr double kTop = 40;
constexpr double kBottom = 56;
constexpr int kTargetTicks = 6;

// Tableau's ten, then two more: distinct for the usual dozen configurations.
constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
                                    "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#1b9e77", "#7570b3"};
constexpr size_t kColors = sizeof(kPalette) / sizeof(kPalette[0]);

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

// A tick label: few significant digits, k/M/G for large values.
std::string tickLabel(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.4gG", v / 1e9);
  } else if (a >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.4gM", v / 1e6);
  } else if (a >= 1e4) {
    std::snprintf(buf, sizeof(buf), "%.4gk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  return buf;
}

struct Axis {
  double lo = 0, hi = 1, step = 0.2;
};

// Round bounds and a 1-2-5 step that cover [lo, hi].
Axis niceAxis(double lo, double hi) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (hi - lo < 1e-12) {
    hi = lo + (std::fabs(lo) > 0 ? std::fabs(lo) * 0.1 : 1.0);
  }
  const double raw = (hi - lo) / kTargetTicks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  }
  return Axis{std::floor(lo / step) * step, std::ceil(hi / step) * step, step};
}

std::string header(const std::string& id, const std::string& title, size_t series, double width) {
  std::string out = "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" id=\"" + xmlEscape(id) +
                    "\" data-series=\"" + std::to_string(series) + "\" width=\"" + num(width) + "\" height=\"" +
                    num(kHeight) + "\" viewBox=\"0 0 " + num(width) + " " + num(kHeight) +
                    "\" font-family=\"DejaVu Sans, Arial, sans-serif\" font-size=\"12\">\n";
  out += "<rect x=\"0\" y=\"0\" width=\"" + num(width) + "\" height=\"" + num(kHeight) + "\" fill=\"#ffffff\"/>\n";
  out += "<text x=\"" + num(width / 2) + "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">" +
         xmlEscape(title) + "</text>\n";
  return out;
}

std::string yAxis(const Axis& y, double plotW, double plotH, const std::string& label) {
  std::string out;
  for (double v = y.lo; v <= y.hi + y.step * 1e-6; v += y.step) {
    const double py = kTop + plotH - (v - y.lo) / (y.hi - y.lo) * plotH;
    out += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(py) + "\" x2=\"" + num(kLeft + plotW) + "\" y2=\"" + num(py) +
           "\" stroke=\"#e0e0e0\" stroke-width=\"1\"/>\n";
    out += "<text x=\"" + num(kLeft - 6) + "\" y=\"" + num(py + 4) + "\" text-anchor=\"end\">" + tickLabel(v) + "</text>\n";
  }
  out += "<text transform=\"translate(16," + num(kTop + plotH / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
         xmlEscape(label) + "</text>\n";
  out += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(kLeft) + "\" y2=\"" + num(kTop + plotH) +
         "\" stroke=\"#333333\"/>\n";
  out += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(kTop + plotH) + "\" x2=\"" + num(kLeft + plotW) + "\" y2=\"" +
         num(kTop + plotH) + "\" stroke=\"#333333\"/>\n";
  return out;
}

std::string legendEntry(size_t i, const std::string& name, double x) {
  const double y = kTop + 8 + double(i) * 18;
  return "<rect x=\"" + num(x) + "\" y=\"" + num(y - 9) + "\" width=\"14\" height=\"10\" fill=\"" + seriesColor(i) +
         "\"/><text x=\"" + num(x + 20) + "\" y=\"" + num(y) + "\">" + xmlEscape(name) + "</text>\n";
}

}  // namespace

std::string seriesColor(size_t i) { return kPalette[i % kColors]; }

std::string xmlEscape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string renderLineChart(const LineChart& chart) {
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  for (const LineSeries& s : chart.series) {
    for (const auto& [x, y] : s.points) {
      xlo = std::min(xlo, x), xhi = std::max(xhi, x), ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  }
  const Axis xa = niceAxis(std::min(0.0, xlo), xhi);
  const Axis ya = niceAxis(std::min(ylo, yhi), yhi);
  const double plotW = kWidth - kLeft - kRight, plotH = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - xa.lo) / (xa.hi - xa.lo) * plotW; };
  auto py = [&](double y) { return kTop + plotH - (y - ya.lo) / (ya.hi - ya.lo) * plotH; };

  std::string out = header(chart.id, chart.title, chart.series.size(), kWidth);
  out += yAxis(ya, plotW, plotH, chart.yLabel);
  for (double v = xa.lo; v <= xa.hi + xa.step * 1e-6; v += xa.step) {
    out += "<text x=\"" + num(px(v)) + "\" y=\"" + num(kTop + plotH + 16) + "\" text-anchor=\"middle\">" + tickLabel(v) +
           "</text>\n";
  }
  out += "<text x=\"" + num(kLeft + plotW / 2) + "\" y=\"" + num(kHeight - 12) + "\" text-anchor=\"middle\">" +
         xmlEscape(chart.xLabel) + "</text>\n";
  for (size_t i = 0; i < chart.series.size(); ++i) {
    const LineSeries& s = chart.series[i];
    const std::string color = seriesColor(i);
    const std::string dash = i >= kColors ? " stroke-dasharray=\"6 3\"" : "";
    out += "<g class=\"series\" data-name=\"" + xmlEscape(s.name) + "\">\n<title>" + xmlEscape(s.name) + "</title>\n";
    std::string points;
    for (const auto& [x, y] : s.points) points += num(px(x)) + "," + num(py(y)) + " ";
    out += "<polyline fill=\"none\" stroke=\"" + color + "\" stroke-width=\"2\"" + dash + " points=\"" + points + "\"/>\n";
    for (const auto& [x, y] : s.points) {
      out += "<circle cx=\"" + num(px(x)) + "\" cy=\"" + num(py(y)) + "\" r=\"2.5\" fill=\"" + color + "\"/>\n";
    }
    out += "</g>\n";
    out += legendEntry(i, s.name, kWidth - kRight + 16);
  }
  return out + "</svg>\n";
}

std::string renderBarChart(const BarChart& chart) {
  double hi = 0;
  for (const Bar& b : chart.bars) hi = std::max({hi, b.value, b.high});
  const Axis ya = niceAxis(0, hi);
  const double slot = 36;
  const double plotW = std::max(kWidth - kLeft - kRight, slot * double(chart.bars.size()));
  const double width = kLeft + plotW + kRight;
  const double plotH = kHeight - kTop - kBottom;
  auto py = [&](double y) { return kTop + plotH - (y - ya.lo) / (ya.hi - ya.lo) * plotH; };

  std::string out = header(chart.id, chart.title, chart.bars.size(), width);
  out += yAxis(ya, plotW, plotH, chart.yLabel);
  const double step = plotW / double(std::max<size_t>(1, chart.bars.size()));
  for (size_t i = 0; i < chart.bars.size(); ++i) {
    const Bar& b = chart.bars[i];
    const double x = kLeft + step * double(i) + step * 0.2;
    const double w = step * 0.6;
    out += "<g class=\"series\" data-name=\"" + xmlEscape(b.name) + "\">\n<title>" + xmlEscape(b.name) + ": " +
           tickLabel(b.value) + "</title>\n";
    out += "<rect x=\"" + num(x) + "\" y=\"" + num(py(b.value)) + "\" width=\"" + num(w) + "\" height=\"" +
           num(py(0) - py(b.value)) + "\" fill=\"" + seriesColor(i) + "\"/>\n";
    if (b.high > b.low) {
      const double cx = x + w / 2;
      out += "<line x1=\"" + num(cx) + "\" y1=\"" + num(py(b.low)) + "\" x2=\"" + num(cx) + "\" y2=\"" + num(py(b.high)) +
             "\" stroke=\"#222222\" stroke-width=\"1.5\"/>\n";
      for (double v : {b.low, b.high}) {
        out += "<line x1=\"" + num(cx - 5) + "\" y1=\"" + num(py(v)) + "\" x2=\"" + num(cx + 5) + "\" y2=\"" + num(py(v)) +
               "\" stroke=\"#222222\" stroke-width=\"1.5\"/>\n";
      }
    }
    out += "</g>\n";
    out += legendEntry(i, b.name + "  " + tickLabel(b.value), width - kRight + 16);
  }
  return out + "</svg>\n";
}

}  // namespace cohort::experiment
