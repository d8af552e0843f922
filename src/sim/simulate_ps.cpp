// `cohort simulate`'s parameter server: a discrete-event simulation of the workers, one shard's
// links in and out (shared by the transfers under way) and its CPU, under the four update policies
// (sync with backup workers, async, softsync, ssp), pooled over starting phases when asynchronous.
#include "sim/simulate_internal.h"

#include <algorithm>
#include <queue>
#include <set>
#include <vector>

namespace cohort::sim {

namespace {

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

// What one push costs, from the setup: bytes, link seconds on the worker's and the shard's side,
// CPU on each side, the latency each way. Constant through a run.
struct PsCosts {
  int workers = 1;
  int shards = 1;
  double push = 0, pull = 0;            // bytes a worker pushes per step, and pulls (float32)
  double pushWire = 0, pullWire = 0;    // their seconds on the worker's link
  double pushShard = 0, pullShard = 0;  // their seconds on the shard's link
  double workerCpu = 0;                 // the worker's own CPU per step
  double cpu = 0;                       // the shard's CPU per push
  double a = 0;                         // the latency each way
  double c = 0;                         // one worker's compute per step, before stragglers
  int needed = 1;                       // sync: pushes that close a step
  double loneCycle = 0;                 // one worker's cycle with the links and the shard to itself
};

PsCosts psCosts(const Scenario& s, const Derived& d, double computeScale) {
  PsCosts k;
  k.workers = d.p;
  k.shards = s.shards;
  k.push = d.n * d.density * d.codec.sentFraction;
  k.pull = d.n * d.density;
  const double ranks = std::max(1, s.network.ranksPerHost);
  // The links carry the bytes at their wire rate; the CPU that gRPC spends on them (serialization,
  // HTTP/2, the kernel's copies) is in the two measured gRPC costs below, on each side.
  k.pushWire = k.push * d.wireLink * ranks;
  k.pullWire = k.pull * d.wireLink * ranks;
  k.pushShard = k.push / k.shards * d.wireServer;
  k.pullShard = k.pull / k.shards * d.wireServer;
  // The worker's own CPU per step: encoding, and its side of the k calls (measured per float32
  // byte of a push whose reply carries the parameters).
  k.workerCpu = d.n * d.density * (d.codec.encodeSecondsPerByte + s.calibration.rpcWorkerSecondsPerByte);
  k.cpu = d.n * d.density / k.shards * (s.calibration.shardSecondsPerByte + d.codec.decodeSecondsPerByte);
  // Half the measured round trip of an empty call each way, plus the link's latency.
  k.a = s.calibration.rpcCallSeconds / 2 + s.network.latency;
  k.c = d.compute * computeScale;
  k.needed = s.psMode == PsMode::Sync ? k.workers - s.backupWorkers : 1;
  k.loneCycle =
      k.c + k.workerCpu + std::max(k.pushWire, k.pushShard) + std::max(k.pullWire, k.pullShard) + 2 * k.a + k.cpu;
  return k;
}

// The parameter server: workers, one representative shard (the k shards are symmetric: each push
// puts 1/k of its bytes on each), its link in and out shared by the transfers under way
// (SharedLink), and its CPU a FIFO resource. Each worker cycles: compute, encode and send its
// push, the shard applies it, the reply comes back (possibly held by the update policy).
class PsSimulation {
 public:
  PsSimulation(const Scenario& s, const PsCosts& costs, uint64_t seed)
      : s_(s),
        k_(costs),
        sampler_(s.tail, seed),
        clock_(size_t(costs.workers), 0),
        pulled_(clock_),
        stepOf_(clock_),
        computeStart_(size_t(costs.workers), 0),
        sendStart_(computeStart_),
        replyStart_(computeStart_),
        myCompute_(computeStart_),
        myQueue_(computeStart_),
        myServerQueue_(computeStart_),
        clocks_(clock_.begin(), clock_.end()) {}

  // Worker w starts its first step at phase[w] times one lone worker's cycle (phases in [0, 1); see
  // simulatePsPhases). Runs until steps x workers pushes are applied.
  Totals run(const std::vector<double>& phase, double compute) {
    const int N = k_.workers;
    const int64_t target = int64_t(s_.steps) * N;
    for (int w = 0; w < N; ++w) startCompute(w, phase[size_t(w)] * k_.loneCycle);
    while (!events_.empty() && applied_ < target) {
      const Event e = events_.top();
      events_.pop();
      if (!handle(e)) continue;
      t_.elapsed = measureFrom_ >= 0 ? e.time - measureFrom_ : 0;
    }
    t_.cpu = t_.steps * (compute + k_.workerCpu + k_.cpu * k_.shards);
    return t_;
  }

 private:
  enum Type { Computed, Sent, Pushed, Applied, Pulled, Replied };
  struct Event {
    double time;
    int type;
    int worker;
    uint64_t epoch = 0;  // Pushed, Pulled: the link's epoch when it was scheduled
    bool operator>(const Event& o) const { return time > o.time || (time == o.time && worker > o.worker); }
  };

  // Returns false for an event made stale by a change of its link's sharing (it was rescheduled).
  bool handle(const Event& e) {
    const int w = e.worker;
    if (e.type == Computed) {
      events_.push({e.time + k_.workerCpu, Sent, w});
    } else if (e.type == Sent) {
      sendStart_[w] = e.time;
      ingress_.add(e.time, w, k_.pushWire, k_.pushShard);
      schedule(ingress_, Pushed);
    } else if (e.type == Pushed) {
      if (e.epoch != ingress_.epoch()) return false;
      pushArrived(e);
    } else if (e.type == Pulled) {
      if (e.epoch != egress_.epoch()) return false;
      replyArrived(e);
    } else if (e.type == Applied) {
      applied(e);
    } else {  // Replied
      startCompute(w, e.time);
    }
    return true;
  }

  void schedule(SharedLink& link, Type type) {
    double time = 0;
    int worker = 0;
    if (link.next(&time, &worker)) events_.push({time, type, worker, link.epoch()});
  }

  void startCompute(int w, double time) {
    computeStart_[w] = time;
    myCompute_[w] = k_.c * sampler_.next();
    events_.push({time + myCompute_[w], Computed, w});
  }

  void reply(int w, double time) {
    pulled_[w] = version_;
    replyStart_[w] = time;
    egress_.add(time, w, k_.pullWire, k_.pullShard);
    schedule(egress_, Pulled);
  }

  // Worker e.worker's transfer on `link` (started at `start`, `wire` seconds alone) is through: the
  // link's next end is scheduled, and the time beyond its own wire time counts as queueing.
  void transferEnded(SharedLink& link, Type type, const Event& e, double start, double wire) {
    link.remove(e.time, e.worker);
    schedule(link, type);
    myQueue_[e.worker] += e.time - start - wire;
  }

  // The push is through the shard's link: it queues for the shard's CPU.
  void pushArrived(const Event& e) {
    const int w = e.worker;
    transferEnded(ingress_, Pushed, e, sendStart_[w], k_.pushWire);
    const double arrival = e.time + k_.a;
    const double done = std::max(cpuFree_, arrival) + k_.cpu;
    myServerQueue_[w] += done - k_.cpu - arrival;
    cpuFree_ = done;
    events_.push({done, Applied, w});
  }

  // The reply is through: the worker's cycle is over (counted once the measured window is open).
  void replyArrived(const Event& e) {
    const int w = e.worker;
    transferEnded(egress_, Pulled, e, replyStart_[w], k_.pullWire);
    const double done = e.time + k_.a;
    if (measureFrom_ >= 0) {
      const double cycle = done - computeStart_[w];
      const double own = k_.pushWire + k_.pullWire + 2 * k_.a + k_.workerCpu;
      t_.compute += myCompute_[w];
      t_.comm += own + myQueue_[w];
      t_.server += k_.cpu + myServerQueue_[w];
      t_.wait += std::max(0.0, cycle - myCompute_[w] - own - myQueue_[w] - k_.cpu - myServerQueue_[w]);
      t_.steps += 1;
      t_.bytes += k_.push;
    }
    myQueue_[w] = 0;
    myServerQueue_[w] = 0;
    events_.push({done, Replied, w});
  }

  // The shard applied a push. The measured window opens at a step boundary (an applied push;
  // under sync a closed step), after the warm-up, and counts what is applied after it.
  void applied(const Event& e) {
    const bool measuring = measureFrom_ >= 0;
    const int64_t warmup = std::min<int64_t>(5, s_.steps / 4);
    const bool opens = !measuring && applied_ >= warmup * k_.workers;
    if (s_.psMode == PsMode::Sync) {
      appliedSync(e, measuring, opens);
    } else {
      appliedAsync(e, measuring, opens);
    }
  }

  // async, softsync and ssp: every push is applied on its own; ssp holds the reply of a worker
  // more than `staleness` clocks ahead of the slowest.
  void appliedAsync(const Event& e, bool measuring, bool opens) {
    const int w = e.worker;
    if (measuring && e.time > measureFrom_) {  // pushes applied with the opening one are before it
      t_.staleness += double(version_ - pulled_[w]);
      t_.stalenessCount += 1;
      t_.samples += s_.batch;
    }
    ++applied_;
    if (opens) measureFrom_ = e.time;
    if (s_.psMode == PsMode::Softsync) {
      if (++inStep_ >= s_.softsync) {
        ++version_;
        inStep_ = 0;
      }
    } else {
      ++version_;
    }
    clocks_.erase(clocks_.find(clock_[w]));
    ++clock_[w];
    clocks_.insert(clock_[w]);
    if (s_.psMode != PsMode::Ssp || sspReleasable(w)) {
      reply(w, e.time);
    } else {
      held_.push_back(w);
    }
    if (s_.psMode == PsMode::Ssp && !held_.empty()) releaseHeld(e.time);
  }

  bool sspReleasable(int w) const { return clock_[w] - *clocks_.begin() <= s_.staleness; }

  void releaseHeld(double time) {
    std::vector<int> still;
    for (int h : held_) {
      if (sspReleasable(h)) {
        reply(h, time);
      } else {
        still.push_back(h);
      }
    }
    held_.swap(still);
  }

  // sync: a step closes with N - b pushes; every held worker is then released at once, and a
  // late push (a backup worker's) is answered at once.
  void appliedSync(const Event& e, bool measuring, bool opens) {
    const int w = e.worker;
    if (stepOf_[w] < stepOpen_) {  // late: the step closed without it (a backup worker's push)
      stepOf_[w] = stepOpen_;
      reply(w, e.time);
      return;
    }
    held_.push_back(w);
    if (++inStep_ < k_.needed) return;
    ++version_;
    ++stepOpen_;
    inStep_ = 0;
    applied_ += k_.needed;
    if (measuring) t_.samples += double(k_.needed) * s_.batch;
    if (opens) measureFrom_ = e.time;
    for (int h : held_) {
      stepOf_[h] = stepOpen_;
      reply(h, e.time);
    }
    held_.clear();
  }

  const Scenario& s_;
  const PsCosts k_;
  Sampler sampler_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  SharedLink ingress_, egress_;
  double cpuFree_ = 0;
  int64_t version_ = 0;
  int64_t stepOpen_ = 0;  // sync: the step being collected
  int inStep_ = 0;        // sync: pushes counted for stepOpen; softsync: pushes since the last version
  std::vector<int64_t> clock_, pulled_, stepOf_;
  std::vector<double> computeStart_, sendStart_, replyStart_, myCompute_, myQueue_, myServerQueue_;
  std::vector<int> held_;  // sync: waiting for the step to close; ssp: over the bound
  std::multiset<int64_t> clocks_;
  Totals t_;
  int64_t applied_ = 0;
  double measureFrom_ = -1;
};

Totals simulatePs(const Scenario& s, const Derived& d, double computeScale, const std::vector<double>& phase,
                  uint64_t seed) {
  PsSimulation simulation(s, psCosts(s, d, computeScale), seed);
  return simulation.run(phase, d.compute);
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

}  // namespace

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

}  // namespace cohort::sim
