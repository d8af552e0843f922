// The synchronous schemes of `cohort simulate`, step by step: allreduce and average (the
// exchange after the slowest worker, overlapped with backward by buckets), the pipeline and gossip.
#include "sim/simulate_internal.h"

#include <algorithm>
#include <vector>

namespace cohort::sim {

namespace {

// The Gloo allgather of one m-byte message per rank (CompressedSum): bf16's is one allgather; a
// sparse codec's messages differ in length, so allgatherVariable first allgathers the 8-byte
// lengths, then the messages (padded to the longest; taken here as all of length m). Each is a
// ring of p-1 steps of the measured Gloo call plus m bytes (sim/cost.h's ringAllgatherSeconds).
double allgatherMessagesSeconds(const Derived& d, double m, bool variable) {
  const double lengths = variable ? ringAllgatherSeconds(d.p, 8, d.aGloo, d.bGloo) : 0.0;
  return lengths + ringAllgatherSeconds(d.p, m, d.aGloo, d.bGloo);
}

// One allreduce of `bytes` dense float32 bytes through the codec, not overlapped with anything:
// what `average` does every period, and what allreduce does with the sparse codecs and bf16.
double exchangeSeconds(const Scenario& s, const Derived& d, double bytes, double* sentBytes) {
  const int p = d.p;
  if (p <= 1) {
    *sentBytes = 0;
    return 0;
  }
  const double codecCpu = bytes * d.codec.encodeSecondsPerByte;
  if (d.gathered) {
    const double m = bytes * d.codec.sentFraction;
    *sentBytes = (p - 1) * m;
    return codecCpu + allgatherMessagesSeconds(d, m, d.sparseCodec) + p * bytes * d.codec.decodeSecondsPerByte;
  }
  const double wireBytes = bytes * d.codec.sentFraction;
  if (d.density < 1 && (p - 1) * d.density < 2.0 * (p - 1) / p) {
    // A sparse model's touched rows, allgathered, when that is fewer bytes than the dense ring.
    const double m = wireBytes * d.density;
    *sentBytes = (p - 1) * m;
    return codecCpu + ringAllgatherSeconds(p, m, d.a, d.bLink) + (p - 1) * m * d.g;
  }
  *sentBytes = 2.0 * (p - 1) / p * wireBytes;
  const double reduce = s.algorithm == Algorithm::Ring ? ringAllreduceSeconds(p, wireBytes, d.a, d.bLink, d.g)
                                                       : halvingDoublingSeconds(p, wireBytes, d.a, d.bLink, d.g);
  return codecCpu + reduce + bytes * d.codec.decodeSecondsPerByte;
}

}  // namespace

// Synchronous data parallelism (allreduce and average): each step (period) every worker computes
// with its own factor; the exchange starts from the slowest worker.
Totals simulateCollective(const Scenario& s, const Derived& d, double computeScale) {
  Sampler sampler(s.tail, s.seed);
  Totals t;
  const int period = s.scheme == Scheme::kAverage ? s.period : 1;
  const double c = d.compute * computeScale;
  double sent = 0;
  double exchange = 0;
  std::vector<double> buckets;
  const bool rows = d.density < 1 && (d.p - 1) * d.density < 2.0 * (d.p - 1) / d.p;
  const bool overlapped = s.scheme == Scheme::kAllreduce && s.overlap && !d.gathered && !rows;
  // DataParallel exchanges bf16 and the sparse codecs after backward, and without overlap every
  // codec's buckets: one bucket after another, each its own allreduce (or allgathers).
  const bool perBucket = s.scheme == Scheme::kAllreduce && (d.gathered || (!s.overlap && !rows));
  if (overlapped || perBucket) buckets = bucketSizes(d.n, s.firstBucketMb * 1048576.0, s.bucketMb * 1048576.0);
  if (perBucket) {
    for (double x : buckets) {
      double bucketSent = 0;
      exchange += exchangeSeconds(s, d, x, &bucketSent);
      sent += bucketSent;
    }
  } else {
    exchange = exchangeSeconds(s, d, d.n, &sent);
  }
  const double reduceCpu = d.sparseCodec ? 0.0 : double(d.p - 1) / d.p * d.n * d.g;
  const double linkCpu = d.gathered ? s.calibration.glooSecondsPerByte : 2 * d.bCpu;
  for (int step = 0; step < s.steps; ++step) {
    double slowest = 0, sum = 0;
    for (int i = 0; i < d.p; ++i) {
      double x = 0;
      for (int k = 0; k < period; ++k) x += c * sampler.next();
      slowest = std::max(slowest, x);
      sum += x;
    }
    double comm = 0;
    if (d.p > 1) {
      if (overlapped) {
        // The last step of the period overlaps its backward; a bucket is ready on every worker when
        // the slowest has produced it.
        const double lastBackward = slowest * d.backwardShare / period;
        comm = exposedAfterBackward(buckets, lastBackward, [&](double x) {
          double ignored = 0;
          return exchangeSeconds(s, d, x, &ignored);
        });
      } else {
        comm = exchange;
      }
    }
    t.elapsed += slowest + comm;
    t.steps += period;
    t.samples += double(d.p) * period * s.batch;
    t.compute += sum / d.p;
    t.wait += std::max(0.0, slowest - sum / d.p);
    t.comm += comm;
    t.bytes += sent;
    t.cpu += sum / computeScale +
             d.p * (sent * linkCpu + reduceCpu +
                    d.n * (d.codec.encodeSecondsPerByte + (d.gathered ? d.p : 1) * d.codec.decodeSecondsPerByte));
  }
  return t;
}

Totals simulatePipeline(const Scenario& s, const Derived& d, double computeScale) {
  const int replicas = d.p / s.stages;
  Sampler sampler(s.tail, s.seed);
  Totals t;
  double sent = 0;
  Derived stage = d;
  stage.p = replicas;
  const double exchange = replicas > 1 ? exchangeSeconds(s, stage, d.n / s.stages, &sent) : 0.0;
  const double act = s.activationBytes * s.batch / s.microBatches;
  for (int step = 0; step < s.steps; ++step) {
    double slowest = 0;
    for (int i = 0; i < d.p; ++i) slowest = std::max(slowest, sampler.next());
    const double c = d.compute * computeScale * slowest;
    const double pipe = pipelineStepSeconds(s.stages, s.microBatches, c, act, d.a, d.bLink);
    const double computePart = c / s.stages;
    t.elapsed += pipe + exchange;
    t.steps += 1;
    t.samples += double(replicas) * s.batch;
    t.compute += computePart;
    t.wait += pipe - computePart - 2.0 * (s.stages - 1) * (d.a + act * d.bLink);
    t.comm += exchange + 2.0 * (s.stages - 1) * (d.a + act * d.bLink);
    t.bytes += sent + 2 * act * s.microBatches;
    t.cpu += d.compute * replicas;
  }
  return t;
}

// Gossip: sends run on their own threads beside the compute.
Totals simulateGossip(const Scenario& s, const Derived& d, double computeScale) {
  Sampler sampler(s.tail, s.seed);
  Totals t;
  const int peers = s.gossipPeers == 0 ? d.p - 1 : std::min(s.gossipPeers, d.p - 1);
  const double m = d.n * d.density * d.codec.sentFraction;
  const double ranks = std::max(1, s.network.ranksPerHost);
  const double encode = d.n * d.codec.encodeSecondsPerByte;
  // Sends run on their own threads: a worker waits for its link only when the link is slower than
  // its compute (the outbox holds one update per peer).
  const double link = peers * (d.a + m * d.bLink * ranks);
  for (int step = 0; step < s.steps; ++step) {
    double sum = 0;
    for (int i = 0; i < d.p; ++i) sum += d.compute * computeScale * sampler.next();
    const double own = sum / d.p + encode;
    const double stepTime = std::max(own, link);
    t.elapsed += stepTime;
    t.steps += 1;
    t.samples += double(d.p) * s.batch;
    t.compute += sum / d.p;
    t.comm += stepTime - sum / d.p;
    t.bytes += peers * m;
    t.cpu += sum / computeScale + d.p * (encode + peers * (m * 2 * d.bCpu + d.n * d.codec.decodeSecondsPerByte));
  }
  return t;
}

}  // namespace cohort::sim
