// `cohort simulate`'s predictor (torch-free): a scheme, a network and a calibrated model in, the
// samples/s at a worker count out. Synchronous collectives are simulated step by step with each
// worker's compute time drawn from the straggler distribution (the step ends with the slowest
// worker's buckets); the parameter server is a discrete-event simulation of workers, shard links
// and shard CPU, from which async staleness, backup workers (Chen et al. 2016) and bounded
// staleness come out of the same run. Without stragglers both reduce to the closed forms of
// sim/cost.h (tested).
#pragma once

#include "base/scheme.h"
#include "sim/calibration.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::sim {

enum class Algorithm { Ring, HalvingDoubling };
enum class PsMode { Sync, Async, Ssp, Softsync };

// A worker's compute time in a step is the calibrated time times a factor drawn from this.
struct Tail {
  enum class Kind { None, Lognormal, Pareto };
  Kind kind = Kind::None;
  double param = 0;        // lognormal: sigma of log (mean factor 1); pareto: alpha (> 1)
  double probability = 1;  // pareto: the share of steps that draw from the tail (the rest take 1)
  static Tail parse(const std::string& text);  // none | lognormal:SIGMA | pareto:ALPHA[:P]
  std::string text() const;
};

struct Network {
  double bandwidth = 0;        // bytes/s of each host's link, each direction; 0: unlimited
  double latency = 0;          // seconds added to every message (on top of the calibrated a)
  double serverBandwidth = 0;  // bytes/s of a shard's link; 0: as bandwidth
  int ranksPerHost = 1;        // ranks sharing one host link (ps and gossip divide it)
};

struct Scenario {
  Calibration calibration;
  Network network;
  Scheme scheme = Scheme::kAllreduce;
  Algorithm algorithm = Algorithm::Ring;
  compress::CodecSpec codec;                // none by default
  double bucketMb = 25, firstBucketMb = 1;  // MiB, as --bucket-mb
  bool overlap = true;
  int period = 1;  // average: steps between averages
  PsMode psMode = PsMode::Async;
  int shards = 1, backupWorkers = 0, staleness = 0, softsync = 1;
  int gossipPeers = 0;  // peers each update goes to; 0: all the others (as cohort train)
  int stages = 2, microBatches = 4;
  double activationBytes = 0;  // pipeline: bytes crossing a cut per example
  double density = 0;          // share of gradient rows touched per step (sparse models); 0: dense
  int batch = 64;              // per worker (pipeline: per replica)
  double speed = 1;            // compute runs this many times faster than the calibration's
  int cores = 0;               // all ranks share this many cores (the emulated clusters); 0: own cores
  Tail tail;
  int steps = 200;  // simulated steps (ps: pushes per worker)
  uint64_t seed = 1;
};

// The most workers one prediction simulates: 4x the default counts' largest. The ps simulation's
// cost grows with the square of the workers (on the 2-core VM, the default 200 steps: 1.5 s at
// 1000, 15 s at 4000, 250 s at 16000), so a larger count would run for minutes to hours.
inline constexpr int kMaxWorkers = 4096;

// Throws InvalidArgument naming the option (--bandwidth, --shards, --stages, ...): checkOptions the
// options that hold at every worker count, checkSetup those and the count's own.
void checkOptions(const Scenario& setup);
void checkSetup(const Scenario& setup, int workers);

struct Prediction {
  int workers = 0;
  double samplesPerSecond = 0;
  double speedup = 0;      // against one worker training alone (its compute only)
  double stepSeconds = 0;  // per step of one worker
  // Where a step's time goes, per worker on average: its own compute, communication not hidden
  // (transfers, queueing on links, codec CPU), waiting for others (stragglers, held pushes), and
  // the shards' CPU on its pushes (with their queue for that CPU).
  double computeSeconds = 0, commSeconds = 0, waitSeconds = 0, serverSeconds = 0;
  double bytesPerStep = 0;  // sent by one worker per step
  double staleness = 0;     // ps: mean versions between a worker's pull and its push being applied
  bool cpuBound = false;    // --cores: the shared cores, not the network, set the step time
};

Prediction simulateWorkers(const Scenario& setup, int workers);
// Whether the scheme runs on `workers` workers: a pipeline on a multiple of --stages, a sync
// parameter server on more than --backup-workers; every other scheme on any count.
bool takesWorkerCount(const Scenario& setup, int workers);
// What those counts are, for messages: "a multiple of --stages 4", "above --backup-workers 1".
std::string workerCountRule(const Scenario& setup);
// "1,2,4".
std::string countsText(const std::vector<int>& counts);
// One prediction per count the scheme takes (takesWorkerCount; the others are skipped), with
// speedup against a 1-worker run. Throws InvalidArgument naming the counts when it takes none.
std::vector<Prediction> sweep(const Scenario& setup, const std::vector<int>& workers);

// Where adding workers stops paying: from `stopsPaying` on, each added worker adds less than
// kPaysShare of what one worker alone trains, up to the largest count (0: it still pays there).
inline constexpr double kPaysShare = 0.1;
struct Knee {
  int stopsPaying = 0;
  int peak = 0;               // the count with the most samples/s
  bool stillGrowing = false;  // the peak is the largest count
  int halfEfficiency = 0;     // the first count whose speed-up is below half the count (0: none)
};
Knee findKnee(const std::vector<Prediction>& predictions);

// The default worker counts: 1 to 1000.
std::vector<int> defaultWorkerCounts();

// Speed-up against workers, one curve per named scheme, log-log, with the linear limit.
struct Curve {
  std::string name;
  std::vector<Prediction> points;
};
std::string svgPlot(const std::vector<Curve>& curves, const std::string& title);

}  // namespace cohort::sim
