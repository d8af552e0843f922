#include "sim/simulate.h"

#include "sim/cost.h"

#include <cohort/error.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <queue>
#include <random>
#include <set>
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
    if (!(v >= 0) || end != text.size()) throw InvalidArgument("--stragglers " + text + ": SIGMA must be >= 0");
  } else if (kind == "pareto") {
    t.kind = Kind::Pareto;
    if (!(v > 1)) throw InvalidArgument("--stragglers " + text + ": ALPHA must be > 1 (a finite mean)");
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

bool isSparseCodec(const std::string& codec) { return codec != "none" && codec != "fp16" && codec != "bf16"; }

// Draws compute-time factors.
class Sampler {
 public:
  Sampler(const Tail& tail, uint64_t seed) : tail_(tail), rng_(seed) {}
  double next() {
    switch (tail_.kind) {
      case Tail::Kind::None:
        return 1.0;
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
  double n = 0;            // dense gradient bytes (float32)
  double density = 1;
  double compute = 0;      // one worker's compute per step, before stragglers
  double backwardShare = 0.6;
  double a = 0;            // latency per message
  double bLink = 0;        // seconds per byte on a worker's link (wire + kernel CPU)
  double bServer = 0;      // seconds per byte on a shard's link
  double bCpu = 0;         // the kernel's CPU per byte (part of bLink)
  double wireLink = 0;     // seconds per byte on a worker's link, the wire alone
  double wireServer = 0;   // the same on a shard's link
  double aGloo = 0;        // one step of a Gloo allgather: its measured call plus the link's latency
  double bGloo = 0;        // a Gloo allgather's seconds per byte received: wire plus Gloo's CPU
  double g = 0;
  CodecCost codec;
  bool sparseCodec = false;
};

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
  if (s.codec == "none") {
    d.codec = CodecCost{"none", 0, 0, 1};
  } else {
    d.codec = c.codec(s.codec);
  }
  d.sparseCodec = isSparseCodec(s.codec);
  return d;
}

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
  if (d.sparseCodec || s.codec == "bf16") {
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

struct Totals {
  double elapsed = 0, samples = 0, steps = 0;
  double compute = 0, comm = 0, wait = 0, server = 0, bytes = 0, staleness = 0, stalenessCount = 0;
  double cpu = 0;  // CPU seconds of all ranks (for --cores)
};

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
  const bool overlapped = s.scheme == Scheme::kAllreduce && s.overlap && !d.sparseCodec && s.codec != "bf16" &&
                          !(d.density < 1 && (d.p - 1) * d.density < 2.0 * (d.p - 1) / d.p);
  const bool perBucket = s.scheme == Scheme::kAllreduce && (d.sparseCodec || s.codec == "bf16");
  if (overlapped || perBucket) buckets = bucketSizes(d.n, s.firstBucketMb * 1048576.0, s.bucketMb * 1048576.0);
  if (perBucket) {
    // DataParallel exchanges bf16 and the sparse codecs after backward, one bucket after another,
    // each with its own allgathers.
    for (double x : buckets) {
      double bucketSent = 0;
      exchange += exchangeSeconds(s, d, x, &bucketSent);
      sent += bucketSent;
    }
  } else {
    exchange = exchangeSeconds(s, d, d.n, &sent);
  }
  const double reduceCpu = d.sparseCodec ? 0.0 : double(d.p - 1) / d.p * d.n * d.g;
  const double linkCpu = d.sparseCodec || s.codec == "bf16" ? s.calibration.glooSecondsPerByte : 2 * d.bCpu;
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
    t.cpu += sum / computeScale + d.p * (sent * linkCpu + reduceCpu + d.n * (d.codec.encodeSecondsPerByte +
                                                    (d.sparseCodec || s.codec == "bf16" ? d.p : 1) * d.codec.decodeSecondsPerByte));
  }
  return t;
}

// A link whose transfers under way share it equally, as TCP flows through one bottleneck do
// (processor sharing), each also capped by its own worker's link. A transfer is described by
// `own`, the seconds its bytes take alone on the worker's link, and `shared`, the seconds they
// take alone on this link: with n transfers under way it progresses at 1 / max(own, n shared) of
// itself per second.
class SharedLink {
 public:
  void add(double now, int worker, double own, double shared) {
    advance(now);
    flows_.push_back({worker, 1.0, own, shared});
    ++epoch_;
  }
  void remove(double now, int worker) {
    advance(now);
    for (size_t i = 0; i < flows_.size(); ++i) {
      if (flows_[i].worker == worker) {
        flows_.erase(flows_.begin() + long(i));
        break;
      }
    }
    ++epoch_;
  }
  // The transfer that ends first and when, if any; valid while epoch() is unchanged.
  bool next(double* time, int* worker) const {
    bool any = false;
    for (const Flow& f : flows_) {
      const double t = now_ + f.left * period(f);
      if (!any || t < *time) {
        *time = t;
        *worker = f.worker;
        any = true;
      }
    }
    return any;
  }
  uint64_t epoch() const { return epoch_; }

 private:
  struct Flow {
    int worker;
    double left;  // the share of its bytes still to send
    double own, shared;
  };
  double period(const Flow& f) const { return std::max(f.own, double(flows_.size()) * f.shared); }
  void advance(double now) {
    if (now > now_) {
      for (Flow& f : flows_) {
        const double p = period(f);
        f.left = p > 0 ? std::max(0.0, f.left - (now - now_) / p) : 0.0;
      }
    }
    now_ = std::max(now_, now);
  }
  std::vector<Flow> flows_;
  double now_ = 0;
  uint64_t epoch_ = 0;
};

// The parameter server: workers, one representative shard (the k shards are symmetric: each push
// puts 1/k of its bytes on each), its link in and out shared by the transfers under way
// (SharedLink), and its CPU a FIFO resource. Worker w starts its first step at phase[w] times one
// lone worker's cycle (phases in [0, 1); see simulatePsPhases).
Totals simulatePs(const Scenario& s, const Derived& d, double computeScale, const std::vector<double>& phase,
                  uint64_t seed) {
  const int N = d.p;
  const int k = s.shards;
  const double push = d.n * d.density * d.codec.sentFraction;  // bytes a worker pushes per step
  const double pull = d.n * d.density;                         // bytes it pulls (float32)
  const double ranks = std::max(1, s.network.ranksPerHost);
  // The links carry the bytes at their wire rate; the CPU that gRPC spends on them (serialization,
  // HTTP/2, the kernel's copies) is in the two measured gRPC costs below, on each side.
  const double pushWire = push * d.wireLink * ranks;
  const double pullWire = pull * d.wireLink * ranks;
  const double pushShard = push / k * d.wireServer;
  const double pullShard = pull / k * d.wireServer;
  // The worker's own CPU per step: encoding, and its side of the k calls (measured per float32
  // byte of a push whose reply carries the parameters).
  const double workerCpu = d.n * d.density * (d.codec.encodeSecondsPerByte + s.calibration.rpcWorkerSecondsPerByte);
  const double cpu = d.n * d.density / k * (s.calibration.shardSecondsPerByte + d.codec.decodeSecondsPerByte);
  // Half the measured round trip of an empty call each way, plus the link's latency.
  const double a = s.calibration.rpcCallSeconds / 2 + s.network.latency;
  const double c = d.compute * computeScale;
  const int needed = s.psMode == PsMode::Sync ? N - s.backupWorkers : 1;
  // One worker's cycle with the links and the shard to itself.
  const double loneCycle = c + workerCpu + std::max(pushWire, pushShard) + std::max(pullWire, pullShard) + 2 * a + cpu;

  Sampler sampler(s.tail, seed);
  enum Type { Computed, Sent, Pushed, Applied, Pulled, Replied };
  struct Event {
    double time;
    int type;
    int worker;
    uint64_t epoch = 0;  // Pushed, Pulled: the link's epoch when it was scheduled
    bool operator>(const Event& o) const { return time > o.time || (time == o.time && worker > o.worker); }
  };
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  SharedLink ingress, egress;
  double cpuFree = 0;
  int64_t version = 0;
  int64_t stepOpen = 0;   // sync: the step being collected
  int inStep = 0;         // sync: pushes counted for stepOpen; softsync: pushes since the last version
  std::vector<int64_t> clock(N, 0), pulled(N, 0), stepOf(N, 0);
  std::vector<double> computeStart(N, 0), sendStart(N, 0), replyStart(N, 0), myCompute(N, 0), myQueue(N, 0),
      myServerQueue(N, 0);
  std::vector<int> held;                  // sync: waiting for the step to close; ssp: over the bound
  std::multiset<int64_t> clocks(clock.begin(), clock.end());

  Totals t;
  const int64_t warmup = std::min<int64_t>(5, s.steps / 4);
  const int64_t target = int64_t(s.steps) * N;
  int64_t applied = 0;
  double measureFrom = -1;

  auto schedule = [&](SharedLink& link, Type type) {
    double time = 0;
    int worker = 0;
    if (link.next(&time, &worker)) events.push({time, type, worker, link.epoch()});
  };
  auto startCompute = [&](int w, double time) {
    computeStart[w] = time;
    myCompute[w] = c * sampler.next();
    events.push({time + myCompute[w], Computed, w});
  };
  auto reply = [&](int w, double time) {
    pulled[w] = version;
    replyStart[w] = time;
    egress.add(time, w, pullWire, pullShard);
    schedule(egress, Pulled);
  };
  auto sspReleasable = [&](int w) { return clock[w] - *clocks.begin() <= s.staleness; };

  for (int w = 0; w < N; ++w) startCompute(w, phase[size_t(w)] * loneCycle);
  while (!events.empty() && applied < target) {
    const Event e = events.top();
    events.pop();
    const int w = e.worker;
    if (e.type == Computed) {
      events.push({e.time + workerCpu, Sent, w});
    } else if (e.type == Sent) {
      sendStart[w] = e.time;
      ingress.add(e.time, w, pushWire, pushShard);
      schedule(ingress, Pushed);
    } else if (e.type == Pushed) {
      if (e.epoch != ingress.epoch()) continue;  // the link's sharing changed since: rescheduled
      ingress.remove(e.time, w);
      schedule(ingress, Pushed);
      myQueue[w] += e.time - sendStart[w] - pushWire;
      const double arrival = e.time + a;
      const double done = std::max(cpuFree, arrival) + cpu;
      myServerQueue[w] += done - cpu - arrival;
      cpuFree = done;
      events.push({done, Applied, w});
    } else if (e.type == Pulled) {
      if (e.epoch != egress.epoch()) continue;
      egress.remove(e.time, w);
      schedule(egress, Pulled);
      myQueue[w] += e.time - replyStart[w] - pullWire;
      const double done = e.time + a;
      if (measureFrom >= 0) {
        const double cycle = done - computeStart[w];
        const double own = pushWire + pullWire + 2 * a + workerCpu;
        t.compute += myCompute[w];
        t.comm += own + myQueue[w];
        t.server += cpu + myServerQueue[w];
        t.wait += std::max(0.0, cycle - myCompute[w] - own - myQueue[w] - cpu - myServerQueue[w]);
        t.steps += 1;
        t.bytes += push;
      }
      myQueue[w] = 0;
      myServerQueue[w] = 0;
      events.push({done, Replied, w});
    } else if (e.type == Applied) {
      // The measured window opens at a step boundary (an applied push; under sync a closed step),
      // after the warm-up, and counts what is applied after it.
      const bool measuring = measureFrom >= 0;
      const bool opens = !measuring && applied >= warmup * N;
      switch (s.psMode) {
        case PsMode::Async:
        case PsMode::Softsync:
        case PsMode::Ssp: {
          if (measuring && e.time > measureFrom) {  // pushes applied with the opening one are before it
            t.staleness += double(version - pulled[w]);
            t.stalenessCount += 1;
            t.samples += s.batch;
          }
          ++applied;
          if (opens) measureFrom = e.time;
          if (s.psMode == PsMode::Softsync) {
            if (++inStep >= s.softsync) {
              ++version;
              inStep = 0;
            }
          } else {
            ++version;
          }
          clocks.erase(clocks.find(clock[w]));
          ++clock[w];
          clocks.insert(clock[w]);
          if (s.psMode != PsMode::Ssp || sspReleasable(w)) {
            reply(w, e.time);
          } else {
            held.push_back(w);
          }
          if (s.psMode == PsMode::Ssp && !held.empty()) {
            std::vector<int> still;
            for (int h : held) {
              if (sspReleasable(h)) {
                reply(h, e.time);
              } else {
                still.push_back(h);
              }
            }
            held.swap(still);
          }
          break;
        }
        case PsMode::Sync: {
          if (stepOf[w] < stepOpen) {  // late: the step closed without it (a backup worker's push)
            stepOf[w] = stepOpen;
            reply(w, e.time);
            break;
          }
          held.push_back(w);
          if (++inStep >= needed) {
            ++version;
            ++stepOpen;
            inStep = 0;
            applied += needed;
            if (measuring) t.samples += double(needed) * s.batch;
            if (opens) measureFrom = e.time;
            for (int h : held) {
              stepOf[h] = stepOpen;
              reply(h, e.time);
            }
            held.clear();
          }
          break;
        }
      }
    } else {  // Replied
      startCompute(w, e.time);
    }
    t.elapsed = measureFrom >= 0 ? e.time - measureFrom : 0;
  }
  t.cpu = t.steps * (d.compute + workerCpu + cpu * k);
  return t;
}

// Asynchronous workers keep the phases they start with: two pushes that start d apart on a shard
// link shared equally end d apart (the first alone for d, both at half rate, the second alone for
// d), and so do the replies. Nothing pulls the workers into step or apart; their phases are set by
// their start and the noise of their steps, and drift. One run with every worker starting at 0
// would be the case of workers in step, the slowest, every time. So an asynchronous run is
// repeated with the starting phases spread over one lone cycle (worker 0 at 0, worker 1 at
// (r + 1/2) / R in run r of R, the others uniform at random) and the R runs are pooled: the
// expected rate over uniformly spread phases, from about kPhaseSamples phase samples.
// Synchronous ps needs none: each closed step releases every worker at once.
constexpr int kPhaseSamples = 32;

Totals simulatePsPhases(const Scenario& s, const Derived& d, double computeScale) {
  const int N = d.p;
  if (N == 1 || s.psMode == PsMode::Sync) {
    return simulatePs(s, d, computeScale, std::vector<double>(size_t(N), 0.0), s.seed);
  }
  const int runs = (kPhaseSamples + N - 2) / (N - 1);
  std::mt19937_64 rng(s.seed ^ 0x9e3779b97f4a7c15ULL);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  Totals all;
  for (int r = 0; r < runs; ++r) {
    std::vector<double> phase(size_t(N), 0.0);
    phase[1] = (r + 0.5) / runs;
    for (int w = 2; w < N; ++w) phase[size_t(w)] = uniform(rng);
    const Totals t = simulatePs(s, d, computeScale, phase, s.seed + uint64_t(r));
    all.elapsed += t.elapsed;
    all.samples += t.samples;
    all.steps += t.steps;
    all.compute += t.compute;
    all.comm += t.comm;
    all.wait += t.wait;
    all.server += t.server;
    all.bytes += t.bytes;
    all.staleness += t.staleness;
    all.stalenessCount += t.stalenessCount;
    all.cpu += t.cpu;
  }
  return all;
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

Totals simulateGossip(const Scenario& s, const Derived& d, double computeScale) {
  Sampler sampler(s.tail, s.seed);
  Totals t;
  const int peers = std::min(s.gossipPeers, d.p - 1);
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

}  // namespace

void checkSetup(const Scenario& s, int workers) {
  validate(s.calibration, "the calibration");
  if (s.network.bandwidth < 0 || std::isnan(s.network.bandwidth)) {
    throw InvalidArgument("--bandwidth must be positive (or `unlimited`), got " + std::to_string(s.network.bandwidth));
  }
  if (s.network.serverBandwidth < 0 || std::isnan(s.network.serverBandwidth)) {
    throw InvalidArgument("--server-bandwidth must be positive, got " + std::to_string(s.network.serverBandwidth));
  }
  if (!(s.network.latency >= 0)) throw InvalidArgument("--latency must be >= 0, got " + std::to_string(s.network.latency));
  if (s.network.ranksPerHost < 1) throw InvalidArgument("--ranks-per-host must be >= 1");
  if (workers < 1 || workers > kMaxWorkers) {
    throw InvalidArgument("--workers: every count must be in 1.." + std::to_string(kMaxWorkers) + ", got " +
                          std::to_string(workers));
  }
  if (s.batch < 1) throw InvalidArgument("--batch must be >= 1, got " + std::to_string(s.batch));
  if (!(s.speed > 0)) throw InvalidArgument("--speed must be > 0, got " + std::to_string(s.speed));
  if (s.cores < 0) throw InvalidArgument("--cores must be >= 0");
  if (s.steps < 4) throw InvalidArgument("--steps must be >= 4, got " + std::to_string(s.steps));
  if (!(s.density >= 0 && s.density <= 1)) throw InvalidArgument("--density must be in (0, 1]");
  if (s.codec != "none") s.calibration.codec(s.codec);
  switch (s.scheme) {
    case Scheme::kAllreduce:
      if (!(s.bucketMb > 0)) throw InvalidArgument("--bucket-mb must be > 0");
      if (!(s.firstBucketMb >= 0)) throw InvalidArgument("--first-bucket-mb must be >= 0");
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
      if (s.backupWorkers < 0 || (s.psMode == PsMode::Sync && s.backupWorkers >= workers && workers > 1)) {
        throw InvalidArgument("--backup-workers " + std::to_string(s.backupWorkers) + " must be >= 0 and below the " +
                              std::to_string(workers) + " workers");
      }
      if (s.staleness < 0) throw InvalidArgument("--staleness must be >= 0");
      if (s.softsync < 1) throw InvalidArgument("--softsync must be >= 1");
      break;
    case Scheme::kGossip:
      if (s.gossipPeers < 1) throw InvalidArgument("--peers must be >= 1");
      break;
    case Scheme::kPipeline:
      // As cohort train: the codecs compress what data-parallel schemes exchange.
      if (s.codec != "none") {
        throw InvalidArgument("--codec " + s.codec + " applies to allreduce, average, ps and gossip; --strategy "
                              "pipeline sends activations and their gradients uncompressed: drop --codec");
      }
      if (s.stages < 1) throw InvalidArgument("--stages must be >= 1");
      if (workers % s.stages != 0) {
        throw InvalidArgument("--workers " + std::to_string(workers) + ": a pipeline needs a multiple of --stages " +
                              std::to_string(s.stages));
      }
      if (s.stages > s.calibration.layers) {
        throw InvalidArgument("--stages " + std::to_string(s.stages) + ": the model has " +
                              std::to_string(s.calibration.layers) + " layers; a pipeline cut needs one per stage");
      }
      if (s.microBatches < 1 || s.microBatches > s.batch) {
        throw InvalidArgument("--micro-batches must be in [1, --batch], got " + std::to_string(s.microBatches));
      }
      if (!(s.activationBytes >= 0)) throw InvalidArgument("--activation-bytes must be >= 0");
      break;
    default:
      throw InvalidArgument(std::string("--strategy ") + schemeName(s.scheme) +
                            ": the simulator models allreduce, average, ps, gossip and pipeline");
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

std::vector<Prediction> sweep(const Scenario& setup, const std::vector<int>& workers) {
  std::vector<Prediction> out;
  // One worker training alone: its compute only (with the same stragglers).
  Scenario base = setup;
  base.scheme = Scheme::kAllreduce;
  base.codec = "none";
  const Prediction one = simulateWorkers(base, 1);
  for (int w : workers) {
    if (setup.scheme == Scheme::kPipeline && w % setup.stages != 0) continue;
    if (setup.scheme == Scheme::kPs && setup.psMode == PsMode::Sync && setup.backupWorkers >= w) continue;
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
    if (k.stopsPaying == 0 && i + 1 < predictions.size()) {
      const Prediction& next = predictions[i + 1];
      const double perAdded = (next.samplesPerSecond - p.samplesPerSecond) / double(next.workers - p.workers);
      if (perAdded < kPaysShare * oneWorker) k.stopsPaying = p.workers;
    }
  }
  k.stillGrowing = k.peak == predictions.back().workers;
  return k;
}

std::vector<int> defaultWorkerCounts() {
  return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 50, 64, 100, 128, 200, 256, 400, 500, 512, 750, 1000};
}

}  // namespace cohort::sim
