// The one place that maps --strategy to a scheme.
#include <cohort/autocast.h>
#include <cohort/communicator.h>
#include <cohort/error.h>

#include "base/compute_threads.h"
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

#include <cstdlib>
#include <thread>

namespace cohort {

// Without --replicas: this process's cores, which cohort launch (and mpirun or Slurm, where set)
// gives as OMP_NUM_THREADS when processes share the host; else the host's.
int replicaThreads(const StrategyOptions& options) {
  if (options.replicas > 0) return options.replicas;
  if (const std::optional<int> share = ompNumThreadsFromEnvironment()) return *share;
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

void checkCodecOptions(const StrategyOptions& options) {
  const compress::CodecSpec codec = compress::CodecSpec::parse(options.codec);
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.scheme != Scheme::kLocal, InvalidArgument, "--codec ",
               options.codec, " compresses what workers exchange, and --strategy local exchanges nothing: drop --codec "
               "or choose a distributed --strategy");
  COHORT_CHECK(codec.kind == compress::CodecKind::None || !isInProcess(options.scheme), InvalidArgument, "--codec ",
               options.codec, " does not apply to --strategy ", schemeName(options.scheme),
               ": its replica threads share memory and exchange nothing compressible; drop --codec");
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.scheme != Scheme::kTensor, InvalidArgument, "--codec ",
               options.codec, " does not apply to --strategy tensor: its activations and gradients travel "
               "uncompressed; drop --codec");
  COHORT_CHECK(options.replicas >= 0, InvalidArgument,
               "--replicas must not be negative (0: the scheme's default), got ", options.replicas);
  COHORT_CHECK(codec.kind == compress::CodecKind::None || options.scheme != Scheme::kPipeline, InvalidArgument, "--codec ",
               options.codec, " applies to allreduce, average, ps and gossip; --strategy pipeline sends activations "
               "and their gradients uncompressed: drop --codec");
  COHORT_CHECK(options.codecWarmupSteps >= 0, InvalidArgument, "--codec-warmup-steps must be at least 0, got ",
               options.codecWarmupSteps);
}

void checkAutocastOptions(const StrategyOptions& options) {
  if (!options.autocast || *options.autocast == c10::kBFloat16) return;
  COHORT_CHECK(*options.autocast == c10::kHalf, InvalidArgument, "--autocast in ", *options.autocast,
               ": expected bfloat16 or float16");
  const Scheme s = options.scheme;
  COHORT_CHECK(s == Scheme::kLocal || s == Scheme::kAllreduce || s == Scheme::kAverage || s == Scheme::kGossip,
               InvalidArgument,
               "--autocast fp16 needs a loss scaler where the optimizer steps, which local, "
               "allreduce, average and gossip have and --strategy ",
               schemeName(s), " does not: use --autocast bf16 (no scaling needed)");
  // allreduce's topk, threshold and onebit carry a residual of scaled gradients from step to step,
  // which a change of scale (or a skipped step) would mis-weigh or drop.
  const compress::CodecSpec codec = compress::CodecSpec::parse(options.codec);
  COHORT_CHECK(s != Scheme::kAllreduce || !codec.errorFeedback(), InvalidArgument, "--autocast fp16 with --codec ",
               options.codec,
               " under allreduce: the codec's residual holds loss-scaled gradients, which the changing scale would "
               "mis-weigh; use --autocast bf16, or bf16 as the codec");
  // The fp16 codec carries the loss-scaled gradients in float16, whose range the scale is chosen to
  // fill: a float32 gradient (a norm's, the loss's) beyond it saturates on the CPU, so the scaler
  // never sees the overflow it must back off from. bf16 has float32's range.
  COHORT_CHECK(s != Scheme::kAllreduce || codec.kind != compress::CodecKind::Fp16, InvalidArgument,
               "--autocast fp16 with --codec fp16 under allreduce: the loss-scaled gradients would overflow float16 "
               "on the wire unseen by the loss scaler; use --codec bf16 (float32's range, the same bytes), or "
               "--autocast bf16");
}

namespace {

std::unique_ptr<Strategy> makeSchemeStrategy(const StrategyOptions& options, const Job& job) {
  switch (options.scheme) {
    case Scheme::kLocal:
      COHORT_CHECK(job.worldSize() == 1, InvalidArgument, "--strategy local trains in one process, but this is ",
                   describe(job.cluster()),
                   ": choose a distributed --strategy (allreduce, average, ps, gossip, pipeline)");
      return std::make_unique<LocalStrategy>();
    case Scheme::kPs: {
      // Workers meet at the parameter servers, not in a Gloo group: a lost worker stops no one else.
      ParameterServerOptions ps = options.ps;
      ps.codec = options.codec;
      ps.codecWarmupSteps = options.codecWarmupSteps;
      ps.keepFreedMemory = true;  // the CLI owns its process
      return makePsStrategy(job, std::move(ps));
    }
    case Scheme::kGossip: {
      // Peers talk over sockets of their own (gossip/peer.h): a Gloo group would make one dead peer
      // everyone's failure.
      GossipOptions gossip = options.gossip;
      gossip.codec = options.codec;
      gossip.codecWarmupSteps = options.codecWarmupSteps;
      return makeGossipStrategy(job, std::move(gossip));
    }
    case Scheme::kAllreduce: {
      DataParallelOptions dp = options.allreduce;
      dp.codec = options.codec;
      dp.codecWarmupSteps = options.codecWarmupSteps;
      // A single worker gets a group of one: the same buckets, hooks and collectives as on many
      // ranks (what they cost against --strategy local is then measurable), over a store of its
      // own on a free loopback port.
      std::shared_ptr<Communicator> comm = job.communicator();
      if (comm == nullptr) {
        ClusterSpec alone = job.cluster();
        alone.rank = 0;
        alone.worldSize = 1;
        alone.master = HostPort{"127.0.0.1", 0};
        comm = Communicator::connect(alone, CommOptions{.timeout = job.timeout(), .backend = job.backend()});
      }
      return std::make_unique<AllreduceStrategy>(std::move(comm), std::move(dp));
    }
    case Scheme::kAverage: {
      AveragingOptions average = options.average;
      average.codec = options.codec;
      average.codecWarmupSteps = options.codecWarmupSteps;
      return std::make_unique<AverageStrategy>(job.communicator(), std::move(average));
    }
    case Scheme::kPipeline: {
      StrategyOptions::Pipeline pipeline = options.pipeline;
      if (options.replicas > 0) pipeline.replicas = options.replicas;
      return std::make_unique<PipelineStrategy>(job.communicator(), pipeline, options.checkpointDir, options.resume);
    }
    case Scheme::kTensor:
      return std::make_unique<TensorStrategy>(job.communicator(), options.ways);
    case Scheme::kMirrored:
    case Scheme::kCentral:
    case Scheme::kHogwild: {
      // Replica threads inside this process; mirrored alone also spans processes (one per host).
      COHORT_CHECK(options.scheme == Scheme::kMirrored || job.worldSize() == 1, InvalidArgument, "--strategy ",
                   schemeName(options.scheme), " trains in one process, but this is ", describe(job.cluster()),
                   ": run one process, or --strategy mirrored (replicas inside each process, allreduce across them)");
      ReplicaOptions replicas = options.inProcess;
      replicas.replicas = replicaThreads(options);
      replicas.timeout = job.timeout();
      replicas.overlap = options.allreduce.overlap;
      return std::make_unique<ReplicaStrategy>(options.scheme, job.worldSize() > 1 ? job.communicator() : nullptr,
                                               replicas);
    }
  }
  throw InvalidArgument("unknown strategy: expected one of " + schemeNames());
}

}  // namespace

std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options, const Job& job) {
  checkCodecOptions(options);
  checkAutocastOptions(options);
  std::unique_ptr<Strategy> strategy = makeSchemeStrategy(options, job);
  strategy->setAutocast(options.autocast, options.scaler);
  return strategy;
}

}  // namespace cohort
