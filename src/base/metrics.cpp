#include <cohort/error.h>
#include <cohort/metrics.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>

namespace cohort {

std::string formatMetricLine(const std::string& event, const MetricFields& fields) {
  nlohmann::ordered_json line;
  line["event"] = event;
  for (const auto& [key, value] : fields) {
    std::visit(
        [&, &k = key](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double>) {
            if (std::isfinite(v)) {
              line[k] = v;
            } else {
              line[k] = nullptr;
            }
          } else {
            line[k] = v;
          }
        },
        value);
  }
  return line.dump();
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  COHORT_CHECK(file_ != nullptr, IoError, path, ": cannot open the metrics file: ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::write(const std::string& event, const MetricFields& fields) {
  if (file_ == nullptr) return;
  const std::string line = formatMetricLine(event, fields) + "\n";
  const bool ok = std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
  COHORT_CHECK(ok, IoError, path_, ": cannot write the metrics file: ", std::strerror(errno));
}

}  // namespace cohort
