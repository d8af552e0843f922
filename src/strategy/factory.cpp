#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/strategy.h>

#include "compress/codec.h"
#include "strategy/allreduce.h"
#include "strategy/average.h"
#include "strategy/local.h"
#include "strategy/pipeline.h"

namespace cohort {

bool isDistributed(const std::string& name) { return name != "local"; }

void checkCodecOptions(const StrategyOptions& options) {
  const compress::CodecSpec codec = compress::CodecSpec::parse(options.codec);
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.name != "local", InvalidArgument, "--codec ",
               options.codec, " compresses what workers exchange, and --strategy local exchanges nothing: drop --codec "
               "or choose a distributed --strategy");
  COHORT_CHECK(options.codecWarmupSteps >= 0, InvalidArgument, "--codec-warmup-steps must be at least 0, got ",
               options.codecWarmupSteps);
}

std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options, std::shared_ptr<Communicator> comm) {
  checkCodecOptions(options);
  const compress::CodecSpec codec = compress::CodecSpec::parse(options.codec);
  if (options.name == "local") return std::make_unique<LocalStrategy>();
  if (options.name == "allreduce") {
    return std::make_unique<AllreduceStrategy>(
        std::move(comm), AllreduceOptions{.bucketMb = options.bucketMb,
                                          .firstBucketMb = options.firstBucketMb,
                                          .overlap = options.overlap,
                                          .codec = codec,
                                          .codecWarmupSteps = options.codecWarmupSteps});
  }
  if (options.name == "average") {
    return std::make_unique<AverageStrategy>(
        std::move(comm), AverageOptions{.period = options.period,
                                        .averageOptimizerState = options.averageOptimizerState,
                                        .codec = codec,
                                        .codecWarmupSteps = options.codecWarmupSteps});
  }
  if (options.name == "pipeline") {
    return std::make_unique<PipelineStrategy>(std::move(comm), options.pipeline, options.checkpointDir, options.resume);
  }
  // ps and gossip need no Gloo group: the Trainer builds them (makePsStrategy, makeGossipStrategy).
  throw InvalidArgument("unknown strategy '" + options.name +
                        "': expected local, allreduce, average, ps, gossip or pipeline");
}

}  // namespace cohort
