// Small statistics over measurements: what the probes, the calibration and the benchmarks report.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace cohort {

// The median of v: the upper one of an even count (a value that was measured, not a mean of
// two); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const auto middle = v.begin() + std::ptrdiff_t(v.size() / 2);
  std::nth_element(v.begin(), middle, v.end());
  return *middle;
}

}  // namespace cohort
