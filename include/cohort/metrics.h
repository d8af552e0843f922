// The metrics file: one JSON object per line, flushed line by line so a crash loses nothing.
//   {"event":"step", ...}  {"event":"eval", ...}  {"event":"done", ...}
#pragma once

#include <cohort/export.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace cohort {

using MetricValue = std::variant<int64_t, double, std::string, bool, std::vector<int64_t>, std::vector<double>>;
using MetricFields = std::vector<std::pair<std::string, MetricValue>>;

// Formats one JSON line (no newline): {"event":event, fields...}, in the order given.
// Non-finite doubles are written as null.
COHORT_API std::string formatMetricLine(const std::string& event, const MetricFields& fields);

class COHORT_API MetricsWriter {
 public:
  // An empty path makes a writer that discards everything. Throws IoError if the file cannot be
  // opened for appending.
  explicit MetricsWriter(const std::string& path, bool append = false);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const std::string& event, const MetricFields& fields);
  bool enabled() const { return file_ != nullptr; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace cohort
