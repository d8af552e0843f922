#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/strategy.h>

#include "strategy/allreduce.h"
#include "strategy/average.h"
#include "strategy/local.h"

namespace cohort {

bool isDistributed(const std::string& name) { return name != "local"; }

std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options, std::shared_ptr<Communicator> comm) {
  if (options.name == "local") return std::make_unique<LocalStrategy>();
  if (options.name == "allreduce") {
    return std::make_unique<AllreduceStrategy>(
        std::move(comm), AllreduceOptions{.bucketMb = options.bucketMb,
                                          .firstBucketMb = options.firstBucketMb,
                                          .overlap = options.overlap});
  }
  if (options.name == "average") {
    return std::make_unique<AverageStrategy>(
        std::move(comm), AverageOptions{.period = options.period,
                                        .averageOptimizerState = options.averageOptimizerState});
  }
  // ps and gossip need no Gloo group: the Trainer builds them (makePsStrategy, makeGossipStrategy).
  throw InvalidArgument("unknown strategy '" + options.name + "': expected local, allreduce, average, ps or gossip");
}

}  // namespace cohort
