#include "sim/simulate.h"

#include "sim/cost.h"
#include "sim/simulate_internal.h"

#include <cohort/error.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace cohort::sim {

Tail Tail::parse(const std::string& text) {
  Tail t;
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  auto number = [&](size_t from) {
    try {
      size_t used = 0;
      const std::string rest = text.substr(from);
      const double v = std::stod(rest, &used);
      return std::make_pair(v, from + used);
    } catch (const std::exception&) {
      throw InvalidArgument("--stragglers " + text + ": expected none, lognormal:SIGMA or pareto:ALPHA[:P]");
    }
  };
  if (kind == "none" && colon == std::string::npos) return t;
  if (colon == std::string::npos) {
    throw InvalidArgument("--stragglers " + text + ": expected none, lognormal:SIGMA or pareto:ALPHA[:P]");
  }
  auto [v, end] = number(colon + 1);
  t.param = v;
  if (kind == "lognormal") {
    t.kind = Kind::Lognormal;
    if (!(v >= 0 && std::isfinite(v)) || end != text.size()) {
      throw InvalidArgument("--stragglers " + text + ": SIGMA must be a finite number >= 0");
    }
  } else if (kind == "pareto") {
    t.kind = Kind::Pareto;
    if (!(v > 1 && std::isfinite(v))) {
      throw InvalidArgument("--stragglers " + text + ": ALPHA must be a finite number > 1 (a finite mean)");
    }
    if (end != text.size()) {
      if (text[end] != ':') throw InvalidArgument("--stragglers " + text + ": expected pareto:ALPHA[:P]");
      auto [p, end2] = number(end + 1);
      if (!(p > 0 && p <= 1) || end2 != text.size()) throw InvalidArgument("--stragglers " + text + ": P must be in (0, 1]");
      t.probability = p;
    }
  } else {
    throw InvalidArgument("--stragglers " + text + ": expected none, lognormal:SIGMA or pareto:ALPHA[:P]");
  }
  return t;
}

std::string Tail::text() const {
  std::ostringstream out;
  if (kind == Kind::None) return "none";
  if (kind == Kind::Lognormal) out << "lognormal:" << param;
  if (kind == Kind::Pareto) out << "pareto:" << param << ":" << probability;
  return out.str();
}

namespace {

// TCP over Ethernet with a 1500-byte MTU carries 1448 payload bytes (TCP timestamps on) in a
// 1514-byte frame: the link's rate counts the frame.
constexpr double kWireOverhead = 1514.0 / 1448.0;

// The most buckets one allreduce step is cut into: the simulation lists them and prices each one
// every step (a 1e-9 MB bucket made billions, and std::bad_alloc).
constexpr double kMaxBuckets = 100000;

// Refuses a --bucket-mb that cuts the model into more than kMaxBuckets buckets, naming the
// smallest that does not.
void checkBucketCount(const Scenario& s) {
  const double n = s.calibration.parameterBytes;
  const double first = std::min(n, s.firstBucketMb * 1048576.0);
  const double buckets = (first > 0 ? 1 : 0) + std::ceil((n - first) / (s.bucketMb * 1048576.0));
  if (buckets <= kMaxBuckets) return;
  char text[256];
  std::snprintf(text, sizeof text,
                "--bucket-mb %g: cuts the model's %.4g MB into %.3g buckets; the simulator takes at most %.0f: "
                "give --bucket-mb %.3g or more",
                s.bucketMb, n / 1e6, buckets, kMaxBuckets, n / kMaxBuckets / 1048576.0 * 1.001);
  throw InvalidArgument(text);
}

}  // namespace

Derived derive(const Scenario& s, int workers) {
  const Calibration& c = s.calibration;
  Derived d;
  d.p = workers;
  d.n = c.parameterBytes;
  // cohort sends every built-in model's gradients as dense tensors, zeros included: only a sparse
  // model's touched rows (--density) make fewer bytes. The calibration's density is the share of
  // nonzero entries, for information.
  d.density = s.density > 0 ? s.density : 1.0;
  // Ranks sharing the cores (--cores) compute at the speed a real job's ranks had on the
  // calibrating machine's cores (its nearest rank count); simulateWorkers slows it by ranks / cores
  // when more ranks than cores compute in step.
  const bool shared = s.cores > 0 && workers > 1;
  d.compute = s.batch * (shared ? c.sharedComputeSecondsPerExample(workers) : c.computeSecondsPerExample) / s.speed;
  d.backwardShare = c.backwardFraction;
  d.a = c.latencySeconds + s.network.latency;
  d.bCpu = c.secondsPerByte;
  const double wire = s.network.bandwidth > 0 ? kWireOverhead / s.network.bandwidth : 0.0;
  d.bLink = wire + d.bCpu;
  const double serverBw = s.network.serverBandwidth > 0 ? s.network.serverBandwidth : s.network.bandwidth;
  d.bServer = (serverBw > 0 ? kWireOverhead / serverBw : 0.0) + d.bCpu;
  d.wireLink = wire;
  d.wireServer = serverBw > 0 ? kWireOverhead / serverBw : 0.0;
  d.aGloo = c.glooAllgatherSeconds + s.network.latency;
  d.bGloo = wire + c.glooSecondsPerByte;
  d.g = c.reduceSecondsPerByte;
  if (s.codec.kind == compress::CodecKind::None) {
    d.codec = CodecCost{"none", 0, 0, 1};
  } else {
    d.codec = c.codec(s.codec);
  }
  d.sparseCodec = !s.codec.dense();
  d.gathered = d.sparseCodec || s.codec.kind == compress::CodecKind::Bf16;
  return d;
}

void checkOptions(const Scenario& s) {
  validate(s.calibration, "the calibration");
  if (s.network.bandwidth < 0 || std::isnan(s.network.bandwidth)) {
    throw InvalidArgument("--bandwidth must be positive (or `unlimited`), got " + std::to_string(s.network.bandwidth));
  }
  if (s.network.serverBandwidth < 0 || std::isnan(s.network.serverBandwidth)) {
    throw InvalidArgument("--server-bandwidth must be positive, got " + std::to_string(s.network.serverBandwidth));
  }
  if (!(s.network.latency >= 0 && std::isfinite(s.network.latency))) {
    throw InvalidArgument("--latency-us must be a finite number >= 0, got " + std::to_string(s.network.latency * 1e6));
  }
  if (s.network.ranksPerHost < 1) throw InvalidArgument("--ranks-per-host must be >= 1");
  if (s.batch < 1) throw InvalidArgument("--batch must be >= 1, got " + std::to_string(s.batch));
  if (!(s.speed > 0 && std::isfinite(s.speed))) {
    throw InvalidArgument("--speed must be a finite number > 0, got " + std::to_string(s.speed));
  }
  if (s.cores < 0) throw InvalidArgument("--cores must be >= 0");
  if (s.steps < 4) throw InvalidArgument("--steps must be >= 4, got " + std::to_string(s.steps));
  if (!(s.density >= 0 && s.density <= 1)) {
    throw InvalidArgument("--density must be in [0, 1] (0: dense, every row), got " + std::to_string(s.density));
  }
  if (s.codec.kind != compress::CodecKind::None) s.calibration.codec(s.codec);
  switch (s.scheme) {
    case Scheme::kAllreduce:
      if (!(s.bucketMb > 0)) throw InvalidArgument("--bucket-mb must be > 0");
      if (!(s.firstBucketMb >= 0)) throw InvalidArgument("--first-bucket-mb must be >= 0");
      checkBucketCount(s);
      break;
    case Scheme::kAverage:
      if (s.period < 1) throw InvalidArgument("--period must be >= 1, got " + std::to_string(s.period));
      break;
    case Scheme::kPs:
      if (s.shards < 1) throw InvalidArgument("--shards must be >= 1, got " + std::to_string(s.shards));
      if (double(s.shards) > s.calibration.parameterCount) {
        throw InvalidArgument("--shards " + std::to_string(s.shards) + ": more shards than the model has parameters (" +
                              std::to_string(int64_t(s.calibration.parameterCount)) + ")");
      }
      if (s.backupWorkers < 0) {
        throw InvalidArgument("--backup-workers must be >= 0, got " + std::to_string(s.backupWorkers));
      }
      if (s.staleness < 0) throw InvalidArgument("--staleness-bound must be >= 0, got " + std::to_string(s.staleness));
      if (s.softsync < 1) throw InvalidArgument("--softsync must be >= 1");
      break;
    case Scheme::kGossip:
      if (s.gossipPeers < 0) {
        throw InvalidArgument("--gossip-peers must be >= 0 (0: all the others), got " + std::to_string(s.gossipPeers));
      }
      break;
    case Scheme::kPipeline:
      // As cohort train: the codecs compress what data-parallel schemes exchange.
      if (s.codec.kind != compress::CodecKind::None) {
        throw InvalidArgument("--codec " + s.codec.text() +
                              " applies to allreduce, average, ps and gossip; --strategy "
                              "pipeline sends activations and their gradients uncompressed: drop --codec");
      }
      if (s.stages < 1) throw InvalidArgument("--stages must be >= 1, got " + std::to_string(s.stages));
      if (s.stages > s.calibration.layers) {
        throw InvalidArgument("--stages " + std::to_string(s.stages) + ": the model has " +
                              std::to_string(s.calibration.layers) + " layers; a pipeline cut needs one per stage");
      }
      if (s.microBatches < 1 || s.microBatches > s.batch) {
        throw InvalidArgument("--micro-batches must be in [1, --batch], got " + std::to_string(s.microBatches));
      }
      if (!(s.activationBytes >= 0 && std::isfinite(s.activationBytes))) {
        throw InvalidArgument("--activation-bytes must be a finite number >= 0");
      }
      break;
    default:
      throw InvalidArgument(std::string("--strategy ") + schemeName(s.scheme) +
                            ": the simulator models allreduce, average, ps, gossip and pipeline");
  }
}

void checkSetup(const Scenario& s, int workers) {
  checkOptions(s);
  if (workers < 1 || workers > kMaxWorkers) {
    throw InvalidArgument("--workers: every count must be in 1.." + std::to_string(kMaxWorkers) + ", got " +
                          std::to_string(workers));
  }
  if (s.scheme == Scheme::kPs && s.psMode == PsMode::Sync && s.backupWorkers >= workers && workers > 1) {
    throw InvalidArgument("--backup-workers " + std::to_string(s.backupWorkers) + " must be below the " +
                          std::to_string(workers) + " workers");
  }
  if (s.scheme == Scheme::kPipeline && workers % s.stages != 0) {
    throw InvalidArgument("--workers " + std::to_string(workers) + ": a pipeline needs a multiple of --stages " +
                          std::to_string(s.stages));
  }
}

Prediction simulateWorkers(const Scenario& s, int workers) {
  checkSetup(s, workers);
  Derived d = derive(s, workers);
  int ranks = workers;
  // Synchronous schemes compute all at once, so more ranks than cores slow each one's compute;
  // the asynchronous ones interleave compute with others' communication and are bounded by the
  // CPU floor below only.
  const bool lockstep = s.scheme != Scheme::kGossip && !(s.scheme == Scheme::kPs && s.psMode != PsMode::Sync);
  double computeScale = 1;
  if (s.cores > 0 && lockstep) computeScale = std::max(1.0, double(ranks) / s.cores);
  Totals t;
  switch (s.scheme) {
    case Scheme::kAllreduce:
    case Scheme::kAverage:
      t = simulateCollective(s, d, computeScale);
      break;
    case Scheme::kPs:
      t = simulatePsPhases(s, d, computeScale);
      break;
    case Scheme::kGossip:
      t = simulateGossip(s, d, computeScale);
      break;
    case Scheme::kPipeline:
      t = simulatePipeline(s, d, computeScale);
      break;
    default:
      break;  // checkSetup refused it
  }
  Prediction p;
  p.workers = workers;
  const double perWorkerSteps = s.scheme == Scheme::kPs ? t.steps / workers : t.steps;
  double elapsed = t.elapsed;
  if (s.cores > 0 && t.cpu > 0) {
    // The ranks share the cores: the run takes at least the CPU all of them spend (compute at its
    // own speed, codecs, the kernel's copies, the shards), spread over the cores.
    const double floor = t.cpu / s.cores;
    if (floor > elapsed) {
      elapsed = floor;
      p.cpuBound = true;
    }
  }
  p.samplesPerSecond = elapsed > 0 ? t.samples / elapsed : 0;
  if (s.scheme == Scheme::kPs) {
    // Throughput from the simulated clock; per-worker step figures from the counted steps.
    const double steps = std::max(1.0, t.steps);
    // async: one worker's cycle; sync: one update, which takes N - b gradients.
    const int perUpdate = s.psMode == PsMode::Sync ? workers - s.backupWorkers : workers;
    p.stepSeconds = perUpdate * s.batch / std::max(p.samplesPerSecond, 1e-300);
    p.computeSeconds = t.compute / steps;
    p.commSeconds = t.comm / steps;
    p.waitSeconds = t.wait / steps;
    p.serverSeconds = t.server / steps;
    p.bytesPerStep = t.bytes / steps;
  } else {
    const double steps = std::max(1.0, perWorkerSteps);
    p.stepSeconds = elapsed / steps;
    p.computeSeconds = t.compute / steps;
    p.commSeconds = t.comm / steps;
    p.waitSeconds = t.wait / steps;
    p.bytesPerStep = t.bytes / steps;
  }
  p.staleness = t.stalenessCount > 0 ? t.staleness / t.stalenessCount : 0;
  return p;
}

bool takesWorkerCount(const Scenario& setup, int workers) {
  if (setup.scheme == Scheme::kPipeline) return setup.stages >= 1 && workers % setup.stages == 0;
  if (setup.scheme == Scheme::kPs && setup.psMode == PsMode::Sync) return workers > setup.backupWorkers;
  return true;
}

std::string workerCountRule(const Scenario& setup) {
  if (setup.scheme == Scheme::kPipeline) return "a multiple of --stages " + std::to_string(setup.stages);
  if (setup.scheme == Scheme::kPs && setup.psMode == PsMode::Sync) {
    return "above --backup-workers " + std::to_string(setup.backupWorkers);
  }
  return "any count";
}

std::string countsText(const std::vector<int>& counts) {
  std::string text;
  for (int w : counts) text += (text.empty() ? "" : ",") + std::to_string(w);
  return text;
}

std::vector<Prediction> sweep(const Scenario& setup, const std::vector<int>& workers) {
  checkOptions(setup);  // before the counts are sorted by --stages and --backup-workers
  if (workers.empty()) throw InvalidArgument("--workers: no worker count given: expected counts such as 1,2,4");
  if (std::none_of(workers.begin(), workers.end(), [&](int w) { return takesWorkerCount(setup, w); })) {
    const bool pipeline = setup.scheme == Scheme::kPipeline;
    throw InvalidArgument("--workers " + countsText(workers) + ": no count is " + workerCountRule(setup) + ", as " +
                          (pipeline ? "--strategy pipeline" : "--ps-mode sync") + " needs: give such counts or change " +
                          (pipeline ? "--stages" : "--backup-workers"));
  }
  std::vector<Prediction> out;
  // One worker training alone: its compute only (with the same stragglers).
  Scenario base = setup;
  base.scheme = Scheme::kAllreduce;
  base.codec = {};
  const Prediction one = simulateWorkers(base, 1);
  for (int w : workers) {
    if (!takesWorkerCount(setup, w)) continue;
    Prediction p = simulateWorkers(setup, w);
    p.speedup = one.samplesPerSecond > 0 ? p.samplesPerSecond / one.samplesPerSecond : 0;
    out.push_back(p);
  }
  return out;
}

Knee findKnee(const std::vector<Prediction>& predictions) {
  Knee k;
  if (predictions.empty()) return k;
  double best = -1;
  const Prediction& first = predictions.front();
  const double oneWorker = first.speedup > 0 ? first.samplesPerSecond / first.speedup : 0;
  for (size_t i = 0; i < predictions.size(); ++i) {
    const Prediction& p = predictions[i];
    if (p.samplesPerSecond > best) {
      best = p.samplesPerSecond;
      k.peak = p.workers;
    }
    if (k.halfEfficiency == 0 && p.speedup < 0.5 * p.workers) k.halfEfficiency = p.workers;
  }
  // From the largest count back: the first count from which every further count adds too little
  // (a dip followed by counts that pay again is not where it stops paying).
  for (size_t i = predictions.size() - 1; i-- > 0;) {
    const Prediction& p = predictions[i];
    const Prediction& next = predictions[i + 1];
    const double perAdded = (next.samplesPerSecond - p.samplesPerSecond) / double(next.workers - p.workers);
    if (perAdded >= kPaysShare * oneWorker) break;
    k.stopsPaying = p.workers;
  }
  k.stillGrowing = k.peak == predictions.back().workers;
  return k;
}

std::vector<int> defaultWorkerCounts() {
  return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 50, 64, 100, 128, 200, 256, 400, 500, 512, 750, 1000};
}

}  // namespace cohort::sim
