// The internals of `cohort simulate`'s predictor (sim/simulate.h): the numbers every scheme's
// simulation needs, the straggler draws, the totals a run adds up, and one simulation per kind of
// scheme: the synchronous step-by-step ones (sim/simulate_collective.cpp) and the parameter
// server's discrete-event one (sim/simulate_ps.cpp).
#pragma once

#include "sim/cost.h"
#include "sim/simulate.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>

namespace cohort::sim {

// Draws compute-time factors.
class Sampler {
 public:
  Sampler(const Tail& tail, uint64_t seed) : tail_(tail), rng_(seed) {}
  double next() {
    switch (tail_.kind) {
      case Tail::Kind::None: return 1.0;
      case Tail::Kind::Lognormal: {
        const double z = normal_(rng_);
        return std::exp(tail_.param * z - tail_.param * tail_.param / 2);
      }
      case Tail::Kind::Pareto: {
        if (uniform_(rng_) >= tail_.probability) return 1.0;
        const double u = 1.0 - uniform_(rng_);  // (0, 1]
        return std::pow(u, -1.0 / tail_.param);
      }
    }
    return 1.0;
  }

 private:
  Tail tail_;
  std::mt19937_64 rng_;
  std::normal_distribution<double> normal_{0.0, 1.0};
  std::uniform_real_distribution<double> uniform_{0.0, 1.0};
};

// The numbers every scheme needs, derived once per (setup, workers).
struct Derived {
  int p = 1;
  double n = 0;  // dense gradient bytes (float32)
  double density = 1;
  double compute = 0;  // one worker's compute per step, before stragglers
  double backwardShare = 0.6;
  double a = 0;           // latency per message
  double bLink = 0;       // seconds per byte on a worker's link (wire + kernel CPU)
  double bServer = 0;     // seconds per byte on a shard's link
  double bCpu = 0;        // the kernel's CPU per byte (part of bLink)
  double wireLink = 0;    // seconds per byte on a worker's link, the wire alone
  double wireServer = 0;  // the same on a shard's link
  double aGloo = 0;       // one step of a Gloo allgather: its measured call plus the link's latency
  double bGloo = 0;       // a Gloo allgather's seconds per byte received: wire plus Gloo's CPU
  double g = 0;
  CodecCost codec;
  bool sparseCodec = false;
  // The codec's messages are allgathered and decoded by every rank, not summed on the way: the
  // sparse codecs and bf16 (DataParallel sums fp16 in 16 bits, bf16 it gathers).
  bool gathered = false;
};

// The numbers of `s` at `workers` workers.
Derived derive(const Scenario& s, int workers);

// What one simulated run adds up; simulateWorkers turns it into a Prediction.
struct Totals {
  double elapsed = 0, samples = 0, steps = 0;
  double compute = 0, comm = 0, wait = 0, server = 0, bytes = 0, staleness = 0, stalenessCount = 0;
  double cpu = 0;  // CPU seconds of all ranks (for --cores)
};

// Synchronous data parallelism (allreduce and average): each step (period) every worker computes
// with its own factor; the exchange starts from the slowest worker.
Totals simulateCollective(const Scenario& s, const Derived& d, double computeScale);
// The pipeline: every step's micro-batches through the stages, then the replicas' exchange.
Totals simulatePipeline(const Scenario& s, const Derived& d, double computeScale);
// Gossip: each worker sends to its peers on their own threads while it computes.
Totals simulateGossip(const Scenario& s, const Derived& d, double computeScale);
// The parameter server, asynchronous runs pooled over spread starting phases (sim/simulate_ps.cpp).
Totals simulatePsPhases(const Scenario& s, const Derived& d, double computeScale);

}  // namespace cohort::sim
