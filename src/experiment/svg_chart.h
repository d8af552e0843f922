// Charts as standalone SVG documents, written by hand: line charts (one polyline per series) and
// bar charts (one bar per series, with a whisker for the spread). The markup is plain SVG 1.1 with
// presentation attributes only (no CSS, no script), so browsers and rsvg-convert draw it alike.
//
// Structure the report's tests rely on: the root is <svg class="chart" id=ID data-series=N>, and
// each series is one <g class="series" data-name=NAME> holding its marks.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace cohort::experiment {

struct LineSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in order
};

struct LineChart {
  std::string id;
  std::string title;
  std::string xLabel;
  std::string yLabel;
  std::vector<LineSeries> series;
};

struct Bar {
  std::string name;
  double value = 0;
  double low = 0;  // the whisker; low == high draws none
  double high = 0;
};

struct BarChart {
  std::string id;
  std::string title;
  std::string yLabel;
  std::vector<Bar> bars;
};

std::string renderLineChart(const LineChart& chart);
std::string renderBarChart(const BarChart& chart);

// Escapes &, <, >, " and ' for XML text and attributes.
std::string xmlEscape(const std::string& text);

// The color of series i, shared by every chart so a configuration keeps its color.
std::string seriesColor(size_t i);

}  // namespace cohort::experiment
