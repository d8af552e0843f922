// The one place that maps --strategy to a scheme.
#include <cohort/communicator.h>
#include <cohort/error.h>

#include "compress/codec.h"
#include "strategy/allreduce.h"
#include "strategy/average.h"
#include "strategy/gossip.h"
#include "strategy/local.h"
#include "strategy/pipeline.h"
#include "strategy/ps.h"
#include "strategy/replicas.h"
#include "strategy/strategy.h"
#include "strategy/tensor.h"

#include <thread>

namespace cohort {

namespace {

bool isInProcess(const std::string& name) { return name == "mirrored" || name == "central" || name == "hogwild"; }

}  // namespace

int replicaThreads(const StrategyOptions& options) {
  if (options.replicas > 0) return options.replicas;
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

void checkCodecOptions(const StrategyOptions& options) {
  const compress::CodecSpec codec = compress::CodecSpec::parse(options.codec);
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.name != "local", InvalidArgument, "--codec ",
               options.codec, " compresses what workers exchange, and --strategy local exchanges nothing: drop --codec "
               "or choose a distributed --strategy");
  COHORT_CHECK(codec.kind == compress::CodecKind::None || !isInProcess(options.name), InvalidArgument, "--codec ",
               options.codec, " does not apply to --strategy ", options.name,
               ": its replica threads share memory and exchange nothing compressible; drop --codec");
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.name != "tensor", InvalidArgument, "--codec ",
               options.codec, " does not apply to --strategy tensor: its activations and gradients travel "
               "uncompressed; drop --codec");
  COHORT_CHECK(options.replicas >= 0, InvalidArgument, "--replicas must be at least 1, got ", options.replicas);
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.name != "pipeline", InvalidArgument, "--codec ",
               options.codec, " applies to allreduce, average, ps and gossip; --strategy pipeline sends activations "
               "and their gradients uncompressed: drop --codec");
  COHORT_CHECK(options.codecWarmupSteps >= 0, InvalidArgument, "--codec-warmup-steps must be at least 0, got ",
               options.codecWarmupSteps);
}

std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options, const Job& job) {
  checkCodecOptions(options);
  const std::string& name = options.name;
  if (name == "local") {
    COHORT_CHECK(job.worldSize() == 1, InvalidArgument, "--strategy local trains in one process, but this is ",
                 describe(job.cluster()), ": choose a distributed --strategy (allreduce, average, ps, gossip, pipeline)");
    return std::make_unique<LocalStrategy>();
  }
  if (name == "ps") {
    // Workers meet at the parameter servers, not in a Gloo group: a lost worker stops no one else.
    ParameterServerOptions ps = options.ps;
    ps.codec = options.codec;
    ps.codecWarmupSteps = options.codecWarmupSteps;
    ps.keepFreedMemory = true;  // the CLI owns its process
    return makePsStrategy(job, std::move(ps));
  }
  if (name == "gossip") {
    // Peers talk over sockets of their own (gossip/peer.h): a Gloo group would make one dead peer
    // everyone's failure.
    GossipOptions gossip = options.gossip;
    gossip.codec = options.codec;
    gossip.codecWarmupSteps = options.codecWarmupSteps;
    return makeGossipStrategy(job, std::move(gossip));
  }
  if (name == "allreduce") {
    DataParallelOptions dp = options.allreduce;
    dp.codec = options.codec;
    dp.codecWarmupSteps = options.codecWarmupSteps;
    return std::make_unique<AllreduceStrategy>(job.communicator(), std::move(dp));
  }
  if (name == "average") {
    AveragingOptions average = options.average;
    average.codec = options.codec;
    average.codecWarmupSteps = options.codecWarmupSteps;
    return std::make_unique<AverageStrategy>(job.communicator(), std::move(average));
  }
  if (name == "pipeline") {
    StrategyOptions::Pipeline pipeline = options.pipeline;
    if (options.replicas > 0) pipeline.replicas = options.replicas;
    return std::make_unique<PipelineStrategy>(job.communicator(), pipeline, options.checkpointDir, options.resume);
  }
  if (name == "tensor") return std::make_unique<TensorStrategy>(job.communicator(), options.ways);
  if (isInProcess(name)) {
    // Replica threads inside this process; mirrored alone also spans processes (one per host).
    COHORT_CHECK(name == "mirrored" || job.worldSize() == 1, InvalidArgument, "--strategy ", name,
                 " trains in one process, but this is ", describe(job.cluster()),
                 ": run one process, or --strategy mirrored (replicas inside each process, allreduce across them)");
    ReplicaOptions replicas = options.inProcess;
    replicas.replicas = replicaThreads(options);
    replicas.timeout = job.timeout();
    replicas.overlap = options.allreduce.overlap;
    return std::make_unique<ReplicaStrategy>(name, job.worldSize() > 1 ? job.communicator() : nullptr, replicas);
  }
  throw InvalidArgument("unknown strategy '" + name +
                        "': expected local, allreduce, average, ps, gossip, pipeline, mirrored, central, hogwild or tensor");
}

}  // namespace cohort
