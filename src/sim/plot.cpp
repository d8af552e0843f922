// The SVG plot of `cohort simulate --plot`: speed-up against workers, log-log, one polyline per
// scheme and the linear limit dashed. Plain SVG 1.1, no script, no external fonts.
#include "sim/simulate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace cohort::sim {

namespace {

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string svgPlot(const std::vector<Curve>& curves, const std::string& title) {
  constexpr double width = 820, height = 520, left = 70, right = 280, top = 40, bottom = 60;
  double maxWorkers = 2, maxSpeedup = 2, minSpeedup = 1;
  for (const Curve& c : curves) {
    for (const Prediction& p : c.points) {
      maxWorkers = std::max(maxWorkers, double(p.workers));
      maxSpeedup = std::max(maxSpeedup, p.speedup);
      if (p.speedup > 0) minSpeedup = std::min(minSpeedup, p.speedup);
    }
  }
  const double maxAxis = std::pow(10, std::ceil(std::log10(std::max(maxWorkers, maxSpeedup))));
  // Speed-ups below 1 (a slow link) get decades of their own below the x axis's 1.
  const double minAxis = std::pow(10, std::floor(std::log10(std::max(minSpeedup, 1e-3))));
  auto x = [&](double v) { return left + (width - left - right) * std::log10(std::max(v, 1.0)) / std::log10(maxAxis); };
  auto y = [&](double v) {
    const double span = std::log10(maxAxis) - std::log10(minAxis);
    return height - bottom - (height - top - bottom) * (std::log10(std::max(v, minAxis)) - std::log10(minAxis)) / span;
  };
  std::ostringstream out;
  char buf[256];
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  out << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out << "<text x=\"" << width / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << escape(title)
      << "</text>\n";
  for (double v = 1; v <= maxAxis * 1.0001; v *= 10) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                  x(v), y(minAxis), x(v), y(maxAxis), x(v), height - bottom + 18, v);
    out << buf;
  }
  for (double v = minAxis; v <= maxAxis * 1.0001; v *= 10) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                  x(1), y(v), x(maxAxis), y(v), left - 6, y(v) + 4, v);
    out << buf;
  }
  out << "<text x=\"" << (left + width - right) / 2 << "\" y=\"" << height - 18
      << "\" text-anchor=\"middle\">workers</text>\n";
  std::snprintf(buf, sizeof buf,
                "<text transform=\"translate(18,%.1f) rotate(-90)\" text-anchor=\"middle\">speed-up over one "
                "worker</text>\n",
                (top + height - bottom) / 2);
  out << buf;
  std::snprintf(buf, sizeof buf,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"6,4\"/>\n",
                x(1), y(1), x(maxAxis), y(maxAxis));
  out << buf;
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
  double legendY = top + 10;
  std::snprintf(buf, sizeof buf,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"6,4\"/>"
                "<text x=\"%.1f\" y=\"%.1f\">linear</text>\n",
                width - right + 15, legendY, width - right + 45, legendY, width - right + 50, legendY + 4);
  out << buf;
  for (size_t i = 0; i < curves.size(); ++i) {
    const char* color = colors[i % 8];
    out << "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"" << color << "\" points=\"";
    for (const Prediction& p : curves[i].points) {
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x(p.workers), y(p.speedup));
      out << buf;
    }
    out << "\"/>\n";
    legendY += 18;
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\">",
                  width - right + 15, legendY, width - right + 45, legendY, color, width - right + 50, legendY + 4);
    out << buf << escape(curves[i].name) << "</text>\n";
  }
  out << "</svg>\n";
  return out.str();
}

}  // namespace cohort::sim
