#include <cohort/error.h>
#include <cohort/strategy.h>

#include "strategy/local.h"

namespace cohort {

std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options) {
  if (options.name == "local") return std::make_unique<LocalStrategy>();
  throw InvalidArgument("unknown strategy '" + options.name + "': expected local");
}

}  // namespace cohort
