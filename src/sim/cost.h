// The closed-form cost models behind `cohort simulate` (torch-free). Each is written down, with its
// source, in docs/ARCHITECTURE.md ("cohort simulate"). Units: seconds, bytes; a is the latency of
// one message, b the seconds per byte on the link, g the seconds per byte of a reduction (the sum
// of two float32 buffers).
#pragma once

#include <cstdint>
#include <vector>

namespace cohort::sim {

// Ring allreduce of n bytes over p ranks (Thakur, Rabenseifner and Gropp 2005, section 4.4):
//   2 (p-1) a + 2 (p-1)/p n b + (p-1)/p n g.
double ringAllreduceSeconds(int p, double n, double a, double b, double g);

// Recursive halving (reduce-scatter) and doubling (allgather), Rabenseifner's algorithm (same
// paper): 2 lg p a + 2 (p-1)/p n b + (p-1)/p n g for p a power of two. Otherwise the ranks above
// the largest power of two p' first send their whole buffer to a partner, which sums it
// (a + n b + n g), and get the result back at the end (a + n b).
double halvingDoublingSeconds(int p, double n, double a, double b, double g);

// Ring allgather of one m-byte message per rank: (p-1) (a + m b). cohort's sparse codecs
// exchange their messages this way (Communicator::allgatherVariable).
double ringAllgatherSeconds(int p, double m, double a, double b);

// One direction of a parameter-server step: N workers each send m bytes, spread evenly over k
// shards; a worker's link carries m at bandwidth bw (bytes/s), a shard's link N m / k at bs:
//   max(m / bw, N m / (k bs)).
double psTransferSeconds(int workers, int shards, double m, double workerBandwidth, double serverBandwidth);

// The idle fraction of a pipeline of S stages running M micro-batches (GPipe, Huang et al. 2019):
// (S-1) / (M+S-1).
double pipelineBubble(int stages, int microBatches);

// The time a pipeline step of `computeSeconds` (one replica's forward and backward of the whole
// batch, unsplit) takes cut into S balanced stages and M micro-batches: each micro-batch spends
// computeSeconds / (S M) in a stage, and a step is (M + S - 1) such slots; plus the activations
// crossing each of the S-1 cuts on the critical path, one micro-batch's forward and backward per
// cut: 2 (S-1) (a + activationBytes b).
double pipelineStepSeconds(int stages, int microBatches, double computeSeconds, double activationBytes, double a,
                           double b);

// The buckets a gradient of n bytes is packed into, in the order they fill during backward: the
// first capped at firstBucket bytes, the others at bucket bytes (cohort's DataParallel, after DDP).
std::vector<double> bucketSizes(double n, double firstBucket, double bucket);

// Bucketed overlap of communication with backward: bucket i (bytes[i]) is ready when backward
// has produced that share of the gradient (gradients come out at a uniform rate over
// backwardSeconds), and is sent once it is ready and the bucket before it is done (collectives
// keep their order). Returns the time after the end of backward until the last bucket is done:
// the exposed communication. cost(bytes) is one bucket's exchange time.
template <typename Cost>
double exposedAfterBackward(const std::vector<double>& bytes, double backwardSeconds, Cost cost) {
  double total = 0;
  for (double x : bytes) total += x;
  double done = 0, produced = 0;
  for (double x : bytes) {
    produced += x;
    const double ready = total > 0 ? backwardSeconds * produced / total : backwardSeconds;
    done = (ready > done ? ready : done) + cost(x);
  }
  return done > backwardSeconds ? done - backwardSeconds : 0.0;
}

}  // namespace cohort::sim
