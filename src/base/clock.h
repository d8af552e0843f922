// Timing for the counters every scheme keeps (step time, communication wait).
#pragma once

#include <chrono>

namespace cohort {

using Clock = std::chrono::steady_clock;

inline double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace cohort
