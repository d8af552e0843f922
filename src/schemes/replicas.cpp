// Replicas as threads of one process (include/cohort/replicas.h).
//
// Threads: R persistent replica threads; step() hands each its shard and waits. Every wait of a
// replica for another goes through Impl::waitUntil, which gives up when any replica has failed
// (the failure ends every thread's step) or when the timeout passes.
//
// Gradient sum (Mirrored, CentralStorage): a hook on every replica's parameter copies the
// gradient, weighted by the shard's share of the batch, into that replica's slot of a bucket;
// when all R replicas have filled a bucket it is ready, and replica r sums the r-th chunk of every
// ready bucket over the replicas, in replica order (so the sum does not depend on timing), into
// the bucket's one shared sum. Every replica's .grad then points into that sum. Across processes
// (Mirrored with a job), a bucket's sum is allreduced as soon as its last chunk is summed, while
// the replicas' backward goes on; replica 0 waits for all of them and the others wait for it.
#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/replicas.h>

#include "base/clock.h"
#include "base/compute_threads.h"
#include "base/thread_annotations.h"
#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <unordered_map>

namespace cohort {

namespace {

// Thrown on a replica thread that stops because another replica failed: not the step's error.
struct Aborted {};

template <class O, class Options>
std::unique_ptr<torch::optim::Optimizer> copyAs(torch::optim::Optimizer& original,
                                                std::vector<torch::optim::OptimizerParamGroup>& groups) {
  if (dynamic_cast<O*>(&original) == nullptr) return nullptr;
  return std::make_unique<O>(groups, static_cast<const Options&>(original.defaults()));
}

}  // namespace

struct ReplicaGroup::Impl {
  struct Bucket {
    std::vector<size_t> params;                    // indices into params[r]
    int64_t numel = 0;
    std::vector<torch::Tensor> local;              // [r]: replica r's weighted gradients, flat
    std::vector<std::vector<torch::Tensor>> localSlots;  // [r][i]: parameter i's part of local[r]
    torch::Tensor sum;                             // the sum over the replicas, flat, on replica 0's device
    std::vector<torch::Tensor> sumSlots;           // [i], shaped like the parameter
    // [r]: the sum on replica r's device (the sum itself where that is replica 0's), and its
    // parameter i's part, [r][i]: what replica r's gradients point into.
    std::vector<torch::Tensor> sumOnDevice;
    std::vector<std::vector<torch::Tensor>> sumOnDeviceSlots;
    std::atomic<int> arrived{0};                   // replicas that have filled the bucket this step
    std::atomic<int> summedChunks{0};
    CommWork crossWork;  // Mirrored across processes: the sum's allreduce, launched this step
  };

  // Per replica thread; touched by that thread only during a step.
  struct Replica {
    c10::Device device{c10::kCPU};  // where its copy of the model, its shards and its gradients are
    std::shared_ptr<torch::nn::Module> module;
    std::vector<torch::Tensor> params;  // trainable, in the same order on every replica
    std::unique_ptr<torch::optim::Optimizer> ownOptimizer;  // replicas 1..R-1 (Mirrored, Hogwild)
    torch::optim::Optimizer* optimizer = nullptr;
    std::vector<std::vector<bool>> filled;  // [bucket][i]
    std::vector<size_t> pending;            // [bucket]: gradients still to come
    size_t nextToSum = 0;                   // the first bucket whose chunk this replica has not summed
    double weight = 0;                      // its shard's share of the batch
    double loss = 0;
    bool inBackward = false;
    std::vector<unsigned> hooks;
    double waitSeconds = 0;
    ReplicaTimes times;
    double hookSeconds = 0;  // this step's time in the gradient hooks, taken out of backward
    double computeSeconds = 0;  // this step's forward and backward, less the hooks
    Clock::time_point endedAt;  // when the thread ended its part of the step
  };

  Kind kind = Kind::kMirrored;
  const char* who = "cohort::Mirrored";
  ReplicaOptions options;
  std::shared_ptr<Communicator> comm;  // Mirrored across processes
  int blasThreadsBefore = 0;
  std::vector<Replica> replicas;
  std::vector<std::unique_ptr<Bucket>> buckets;
  std::vector<std::pair<size_t, size_t>> slotOf;  // param -> (bucket, index in bucket)
  // With options.balance: each replica's forward and backward seconds per example, smoothed over
  // the steps (0 until measured), and the split in use for batches of balancedFor examples. Read
  // and written by step() only, between steps.
  std::vector<double> secondsPerExample;
  std::vector<int64_t> balanced;
  int64_t balancedFor = 0;

  // The step under way, set by step() before the threads start.
  const ShardLoss* lossFn = nullptr;
  std::vector<torch::Tensor> shardInputs, shardTargets;

  // Hogwild's counters.
  std::atomic<int64_t> updates{0};
  std::atomic<int> writers{0};
  std::atomic<int64_t> writesBegun{0};

  Mutex mutex;
  CondVar changed;  // a bucket became ready, a replica failed or finished
  std::atomic<bool> failed{false};
  std::atomic<int> finishedSums{0};      // replicas done with all their chunks
  std::atomic<bool> crossDone{false};    // the process-wide average of the sums is in place
  // Mirrored across processes: buckets whose allreduce is launched, in bucket order (the order
  // of collectives every process must follow).
  Mutex launchMutex;
  size_t launched GUARDED_BY(launchMutex) = 0;
  std::atomic<bool> updating{false};     // a replica has begun its optimizer step
  std::exception_ptr error GUARDED_BY(mutex);  // the first failure
  int errorReplica GUARDED_BY(mutex) = -1;
  bool broken = false;                   // a failure after parameters changed: replicas may differ
  std::chrono::steady_clock::time_point deadline;
  Clock::time_point wokenAt GUARDED_BY(mutex);  // when step() woke the threads
  ReplicaStats stats GUARDED_BY(mutex);

  // The worker threads.
  std::vector<std::thread> threads;
  CondVar wake;  // a step for the threads, or the end
  CondVar done;  // a thread finished its part of a step
  int64_t generation GUARDED_BY(mutex) = 0;
  int running GUARDED_BY(mutex) = 0;  // threads still in the step
  bool stopping GUARDED_BY(mutex) = false;

  bool sumsGradients() const { return kind != Kind::kHogwild; }
  // Whether replica r's copy is on another device than replica 0's (a second GPU): its sums are
  // copied to it, and CentralStorage's parameters are copied to it before each step.
  bool elsewhere(size_t r) const { return replicas[r].device != replicas[0].device; }

  // ---- waits between replicas ----

  template <class Ready>
  void waitUntil(Replica& self, const Ready& ready, const char* what) EXCLUDES(mutex) {
    if (ready()) return;
    const auto start = Clock::now();
    MutexLock lock(mutex);
    auto settled = [&] { return ready() || failed.load(); };
    while (!settled() && changed.waitUntil(mutex, deadline) == std::cv_status::no_timeout) continue;
    const bool ok = settled();
    self.waitSeconds += secondsSince(start);
    if (failed.load()) throw Aborted{};
    if (!ok) {
      throw TimeoutError(detail::concat(who, ": a replica waited more than ", options.timeout.count(),
                                        " ms for the others ", what, "; a replica is stuck in its forward or backward"));
    }
  }

  void notifyAll() EXCLUDES(mutex) {
    MutexLock lock(mutex);
    changed.notifyAll();
  }

  void fail(int r, std::exception_ptr e) EXCLUDES(mutex) {
    MutexLock lock(mutex);
    if (!error) {
      error = e;
      errorReplica = r;
    }
    failed = true;
    changed.notifyAll();
  }

  // ---- gradient buckets ----

  void buildBuckets() {
    const auto& params = replicas[0].params;
    slotOf.resize(params.size());
    std::vector<std::vector<size_t>> groups(1);
    int64_t bytes = 0;
    for (size_t k = params.size(); k-- > 0;) {  // roughly the order backward produces them
      const int64_t size = params[k].numel() * int64_t(sizeof(float));
      if (!groups.back().empty() && double(bytes + size) > options.bucketMb * 1024 * 1024) {
        groups.emplace_back();
        bytes = 0;
      }
      groups.back().push_back(k);
      bytes += size;
    }
    const size_t R = replicas.size();
    for (auto& group : groups) {
      auto bucket = std::make_unique<Bucket>();
      for (size_t k : group) bucket->numel += params[k].numel();
      bucket->sum = torch::zeros({bucket->numel}, torch::TensorOptions().device(replicas[0].device));
      bucket->local.resize(R);
      bucket->localSlots.resize(R);
      bucket->sumOnDevice.resize(R);
      bucket->sumOnDeviceSlots.resize(R);
      for (size_t r = 0; r < R; ++r) {
        const auto on = torch::TensorOptions().device(replicas[r].device);
        bucket->local[r] = torch::zeros({bucket->numel}, on);
        bucket->sumOnDevice[r] = elsewhere(r) ? torch::zeros({bucket->numel}, on) : bucket->sum;
      }
      int64_t offset = 0;
      for (size_t k : group) {
        slotOf[k] = {buckets.size(), bucket->params.size()};
        bucket->params.push_back(k);
        bucket->sumSlots.push_back(bucket->sum.narrow(0, offset, params[k].numel()).view(params[k].sizes()));
        for (size_t r = 0; r < R; ++r) {
          bucket->localSlots[r].push_back(bucket->local[r].narrow(0, offset, params[k].numel()).view(params[k].sizes()));
          bucket->sumOnDeviceSlots[r].push_back(
              bucket->sumOnDevice[r].narrow(0, offset, params[k].numel()).view(params[k].sizes()));
        }
        offset += params[k].numel();
      }
      buckets.push_back(std::move(bucket));
    }
    for (auto& replica : replicas) {
      replica.filled.resize(buckets.size());
      replica.pending.resize(buckets.size());
    }
  }

  void onGradient(size_t r, size_t k, const torch::Tensor& grad) {
    Replica& self = replicas[r];
    if (!self.inBackward) return;  // a backward outside step(): not ours
    const auto start = Clock::now();
    torch::NoGradGuard noGrad;
    auto [b, i] = slotOf[k];
    torch::mul_out(buckets[b]->localSlots[r][i], grad, self.weight);
    self.times.copy += secondsSince(start);
    if (!self.filled[b][i]) {
      self.filled[b][i] = true;
      if (--self.pending[b] == 0) arrive(b);
    }
    if (options.overlap) sumReadyChunks(self, r, /*wait=*/false);
    self.hookSeconds += secondsSince(start);
  }

  void arrive(size_t b) {
    if (buckets[b]->arrived.fetch_add(1) + 1 == int(replicas.size())) notifyAll();
  }

  // Replica r's chunk of bucket b: [b.numel * r / R, b.numel * (r+1) / R).
  void sumChunk(size_t r, Bucket& bucket) {
    const int64_t R = int64_t(replicas.size());
    const int64_t begin = bucket.numel * int64_t(r) / R, end = bucket.numel * (int64_t(r) + 1) / R;
    if (end > begin) {
      torch::NoGradGuard noGrad;
      auto out = bucket.sum.narrow(0, begin, end - begin);
      out.copy_(bucket.local[0].narrow(0, begin, end - begin));
      // A replica on another GPU: its part is copied to replica 0's device first (to() orders
      // the copy after the work queued on both devices).
      for (int64_t q = 1; q < R; ++q) out.add_(bucket.local[size_t(q)].narrow(0, begin, end - begin).to(out.device()));
    }
    if (bucket.summedChunks.fetch_add(1) + 1 == R && comm != nullptr && options.overlap) launchSummed();
  }

  // Mirrored across processes, overlapped: launches the allreduce of every bucket whose sum is
  // complete, in bucket order. Buckets complete in that order (every replica sums its chunks in
  // bucket order), but the replicas completing two of them race to launch: whoever holds the lock
  // launches all that are ready, so every process issues its collectives in the same order.
  void launchSummed() EXCLUDES(launchMutex) {
    const int R = int(replicas.size());
    MutexLock lock(launchMutex);
    while (launched < buckets.size() && buckets[launched]->summedChunks.load() == R) {
      buckets[launched]->crossWork = comm->allreduceAsync(buckets[launched]->sum);
      ++launched;
    }
  }

  void sumReadyChunks(Replica& self, size_t r, bool wait) {
    while (self.nextToSum < buckets.size()) {
      Bucket& bucket = *buckets[self.nextToSum];
      auto ready = [&] { return bucket.arrived.load() == int(replicas.size()); };
      if (!ready()) {
        if (!wait) return;
        waitUntil(self, ready, "to finish their backward pass");
      }
      const auto start = Clock::now();
      sumChunk(r, bucket);
      self.times.sum += secondsSince(start);
      ++self.nextToSum;
    }
  }

  // ---- one replica's step, on its thread ----

  void runReplica(size_t r) {
    Replica& self = replicas[r];
    const torch::Tensor& x = shardInputs[r];
    if (kind == Kind::kHogwild) {
      hogwildStep(self, r);
      return;
    }
    clearGradients(*self.module);
    if (kind == Kind::kCentral && elsewhere(r)) {
      // CentralStorage's one parameter set is replica 0's; a replica on another GPU computes
      // against a copy of it, refreshed here (its buffers too: its own updates to them are not kept).
      torch::NoGradGuard noGrad;
      for (size_t k = 0; k < self.params.size(); ++k) self.params[k].copy_(replicas[0].params[k]);
      auto mine = self.module->buffers();
      auto first = replicas[0].module->buffers();
      for (size_t i = 0; i < mine.size() && i < first.size(); ++i) mine[i].copy_(first[i]);
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      self.filled[b].assign(buckets[b]->params.size(), false);
      self.pending[b] = buckets[b]->params.size();
    }
    self.nextToSum = 0;
    self.hookSeconds = 0;
    self.computeSeconds = 0;
    if (x.size(0) > 0) {
      const auto forwardStart = Clock::now();
      torch::Tensor value = (*lossFn)(int(r), *self.module, x, shardTargets[r]);
      self.loss = value.item<double>();
      const double forward = secondsSince(forwardStart);
      self.times.forward += forward;
      const auto start = Clock::now();
      self.inBackward = true;
      try {
        value.backward();
      } catch (...) {
        self.inBackward = false;
        throw;
      }
      self.inBackward = false;
      const double backward = secondsSince(start) - self.hookSeconds;
      self.times.backward += backward;
      self.computeSeconds = forward + backward;
    }
    // Parameters that got no gradient (and a replica without examples) contribute zeros.
    const auto zeroStart = Clock::now();
    for (size_t b = 0; b < buckets.size(); ++b) {
      if (self.pending[b] == 0) continue;
      for (size_t i = 0; i < buckets[b]->params.size(); ++i) {
        if (!self.filled[b][i]) buckets[b]->localSlots[r][i].zero_();
      }
      self.pending[b] = 0;
      arrive(b);
    }
    self.times.copy += secondsSince(zeroStart);
    sumReadyChunks(self, r, /*wait=*/true);
    finishedSums.fetch_add(1);
    notifyAll();
    const int R = int(replicas.size());
    if (comm != nullptr) {
      // Replica 0 averages the process's sums with the other processes'; the others wait for it.
      if (r == 0) {
        waitUntil(self, [&] { return finishedSums.load() == R; }, "to finish summing their gradients");
        averageAcrossProcesses();
        crossDone = true;
        notifyAll();
      } else {
        waitUntil(self, [&] { return crossDone.load(); }, "while replica 0 averages across processes");
      }
    } else {
      waitUntil(self, [&] { return finishedSums.load() == R; }, "to finish summing their gradients");
    }
    if (kind == Kind::kCentral && r != 0) return;  // one optimizer, on the one parameter set
    updating = true;
    const auto start = Clock::now();
    if (elsewhere(r)) {
      // The sums, complete on replica 0's device, copied to this replica's.
      torch::NoGradGuard noGrad;
      for (auto& bucket : buckets) bucket->sumOnDevice[r].copy_(bucket->sum);
    }
    for (size_t k = 0; k < self.params.size(); ++k) {
      auto [b, i] = slotOf[k];
      self.params[k].mutable_grad() = buckets[b]->sumOnDeviceSlots[r][i];
    }
    self.optimizer->step();
    self.times.optimizer += secondsSince(start);
  }

  // On replica 0 once every chunk is summed: waits for the buckets' allreduces (launched while
  // backward ran, or now without overlap) and makes the sums means. The traffic is counted by
  // step(); the time waited here is the communication backward did not hide.
  void averageAcrossProcesses() EXCLUDES(launchMutex, mutex) {
    const auto start = Clock::now();
    if (!options.overlap) {
      MutexLock lock(launchMutex);
      for (auto& bucket : buckets) bucket->crossWork = comm->allreduceAsync(bucket->sum);
      launched = buckets.size();
    }
    for (auto& bucket : buckets) {
      COHORT_CHECK(bucket->crossWork.valid(), Error, who, ": a bucket's allreduce was not launched");
      bucket->crossWork.wait();
      bucket->crossWork = CommWork();
      bucket->sum.div_(comm->worldSize());
    }
    MutexLock lock(mutex);
    stats.commWaitSeconds += secondsSince(start);
  }

  void hogwildStep(Replica& self, size_t r) {
    const torch::Tensor& x = shardInputs[r];
    if (x.size(0) == 0) return;
    clearGradients(*self.module);
    const int64_t readAt = updates.load();
    auto start = Clock::now();
    torch::Tensor value = (*lossFn)(int(r), *self.module, x, shardTargets[r]);
    self.loss = value.item<double>();
    self.times.forward += secondsSince(start);
    start = Clock::now();
    value.backward();
    self.times.backward += secondsSince(start);
    // No lock: the update is written while other replicas read and write the same parameters.
    start = Clock::now();
    const int64_t begunBefore = writesBegun.fetch_add(1);
    bool conflict = writers.fetch_add(1) > 0;
    self.optimizer->step();
    writers.fetch_sub(1);
    self.times.optimizer += secondsSince(start);
    conflict = conflict || writesBegun.load() != begunBefore + 1;
    const int64_t staleness = updates.fetch_add(1) - readAt;
    MutexLock lock(mutex);
    ++stats.updates;
    stats.stalenessSum += double(staleness);
    stats.stalenessMax = std::max(stats.stalenessMax, staleness);
    if (conflict) ++stats.conflicts;
  }

  // The examples of each replica in a batch of n (n >= R). Even (sizes differing by at most one),
  // or with options.balance, once every replica has been measured, in proportion to its speed
  // (1 / secondsPerExample) in units of g = max(1, n / 32) examples, each at least max(1, n / 4R)
  // examples. Every new shard size costs oneDNN a new primitive (its kernels generated at the
  // first call), so the split changes only when its predicted step (the slowest shard's time)
  // is more than kGain shorter than the current split's: for a steady speed gap it settles on one.
  std::vector<int64_t> shardSizes(int64_t n) {
    constexpr double kGain = 0.03;
    const size_t R = replicas.size();
    std::vector<int64_t> even(R);
    for (size_t r = 0; r < R; ++r) even[r] = n / int64_t(R) + (int64_t(r) < n % int64_t(R) ? 1 : 0);
    if (!options.balance) return even;
    double speedSum = 0;
    for (double s : secondsPerExample) {
      if (s <= 0) return even;
      speedSum += 1.0 / s;
    }
    const int64_t g = std::max<int64_t>(1, n / 32), units = n / g, rest = n % g;
    const int64_t least = std::max<int64_t>(1, units / (4 * int64_t(R)));
    std::vector<double> target(R);
    std::vector<int64_t> count(R);
    int64_t total = 0;
    for (size_t r = 0; r < R; ++r) {
      target[r] = double(units) / secondsPerExample[r] / speedSum;
      count[r] = std::max(least, int64_t(target[r]));
      total += count[r];
    }
    // Rounding and the floor: give to whoever is furthest below its target, take from whoever
    // is furthest above it (never below the floor).
    while (total != units) {
      size_t pick = R;
      for (size_t r = 0; r < R; ++r) {
        if (total > units && count[r] <= least) continue;
        const double gap = target[r] - double(count[r]);
        if (pick == R || (total < units ? gap > target[pick] - double(count[pick]) : gap < target[pick] - double(count[pick]))) {
          pick = r;
        }
      }
      const int64_t change = total < units ? 1 : -1;
      count[pick] += change;
      total += change;
    }
    std::vector<int64_t> candidate(R);
    for (size_t r = 0; r < R; ++r) candidate[r] = count[r] * g + (int64_t(r) < rest ? 1 : 0);
    auto predicted = [&](const std::vector<int64_t>& sizes) {
      double slowest = 0;
      for (size_t r = 0; r < R; ++r) slowest = std::max(slowest, double(sizes[r]) * secondsPerExample[r]);
      return slowest;
    };
    if (balancedFor == 0) {
      balancedFor = n;
      balanced = even;
    }
    if (n != balancedFor) {  // another batch size (an epoch's last batch): the split kept is for balancedFor
      return predicted(candidate) < (1 - kGain) * predicted(even) ? candidate : even;
    }
    if (predicted(candidate) < (1 - kGain) * predicted(balanced)) balanced = candidate;
    return balanced;
  }

  // After a step with options.balance: smooths each replica's measured time per example.
  void measureSpeeds() {
    constexpr double kWeight = 0.3;  // of the newest step
    for (size_t r = 0; r < replicas.size(); ++r) {
      const int64_t examples = shardInputs[r].size(0);
      if (examples == 0 || replicas[r].computeSeconds <= 0) continue;
      const double measured = replicas[r].computeSeconds / double(examples);
      double& s = secondsPerExample[r];
      s = s <= 0 ? measured : (1 - kWeight) * s + kWeight * measured;
    }
  }

  void threadMain(size_t r) {
    // ATen sets a thread's OpenMP count to the process-wide at::set_num_threads value at the
    // thread's first parallel operation (at::internal::lazy_init_num_threads, once per thread),
    // which would undo a count set before it: with --threads 2, every replica ran 2 OpenMP
    // threads. Running that initialization first makes the count below stick. It is an inline
    // function with a thread_local flag, and LibTorch 2.x's libtorch_cpu keeps its own copy of the
    // flag: at::get_num_threads(), compiled there, runs libtorch's (calling only the inline one
    // here left every replica at 2 threads on LibTorch 2.11).
    at::internal::lazy_init_num_threads();
    (void)at::get_num_threads();
    setOpenMpThreads(1);
    int64_t seen = 0;
    while (true) {
      Clock::time_point woken;
      {
        MutexLock lock(mutex);
        // Idle between steps for as long as the user likes: the wait only wakes to look again.
        while (!stopping && generation == seen) wake.waitFor(mutex, std::chrono::seconds(1));
        if (stopping) return;
        seen = generation;
        woken = wokenAt;
      }
      replicas[r].times.handOff += secondsSince(woken);
      try {
        runReplica(r);
      } catch (const Aborted&) {
      } catch (...) {
        fail(int(r), std::current_exception());
      }
      replicas[r].endedAt = Clock::now();
      MutexLock lock(mutex);
      if (--running == 0) done.notifyAll();
    }
  }
};

ReplicaGroup::ReplicaGroup(Kind kind, const Job* job, std::shared_ptr<torch::nn::Module> model,
                           torch::optim::Optimizer& optimizer, ReplicaOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.kind = kind;
  s.who = kind == Kind::kMirrored ? "cohort::Mirrored" : kind == Kind::kCentral ? "cohort::CentralStorage"
                                                                                 : "cohort::Hogwild";
  COHORT_CHECK(model != nullptr, InvalidArgument, s.who, ": the model is null");
  COHORT_CHECK(options.replicas >= 1, InvalidArgument, s.who, ": replicas must be at least 1, got ", options.replicas);
  COHORT_CHECK(options.bucketMb > 0, InvalidArgument, s.who, ": bucketMb must be positive, got ", options.bucketMb);
  COHORT_CHECK(options.timeout.count() > 0, InvalidArgument, s.who, ": the timeout must be positive");
  COHORT_CHECK(!(options.balance && kind == Kind::kHogwild), InvalidArgument, s.who,
               ": balance applies to Mirrored and CentralStorage, whose replicas meet at the sums; Hogwild's do not");
  s.options = options;
  const size_t R = size_t(options.replicas);
  s.secondsPerExample.assign(R, 0.0);

  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& [name, p] : uniqueParameters(*model)) {
    if (!p.requires_grad()) continue;
    COHORT_CHECK(p.scalar_type() == torch::kFloat32, InvalidArgument, s.who, ": parameter ", name, " is ", p.dtype(),
                 "; replicas train float32 parameters: call module->to(torch::kFloat32)");
    COHORT_CHECK(kind != Kind::kHogwild || p.device().is_cpu(), InvalidArgument, s.who, ": parameter ", name,
                 " is on ", p.device(), "; Hogwild's threads update one copy in host memory without locks, a CPU "
                 "scheme: call module->to(torch::kCPU) (--device cpu), or use Mirrored on the GPU");
    COHORT_CHECK(named.empty() || p.device() == named[0].second.device(), InvalidArgument, s.who, ": parameter ",
                 name, " is on ", p.device(), " and ", named[0].first, " on ", named[0].second.device(),
                 "; move the whole model to one device (module->to(device))");
    named.emplace_back(name, p);
  }
  COHORT_CHECK(!named.empty(), InvalidArgument, s.who, ": the module has no parameters that require gradients");
  // Replica r on the r-th GPU after the model's, wrapping around (one GPU: all of them on it).
  const c10::Device home = named[0].second.device();
  const int gpus = home.is_cuda() ? int(torch::cuda::device_count()) : 0;
  auto deviceOf = [&](size_t r) {
    if (!home.is_cuda()) return home;
    return c10::Device(c10::kCUDA, c10::DeviceIndex((int(home.index()) + int(r)) % gpus));
  };
  if (job != nullptr) s.comm = job->communicator();
  if (s.comm != nullptr) {
    checkSameModel(*s.comm, *model, s.who, detail::concat("replicas=", options.replicas));
    broadcastModel(*s.comm, *model);
  }

  // Which optimizer parameter is which model parameter, to give each copy the same groups.
  std::unordered_map<const void*, size_t> indexOf;
  for (size_t k = 0; k < named.size(); ++k) indexOf[named[k].second.unsafeGetTensorImpl()] = k;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      COHORT_CHECK(indexOf.count(p.unsafeGetTensorImpl()) > 0, InvalidArgument, s.who,
                   ": the optimizer holds a tensor that is not a trainable parameter of the model");
    }
  }

  s.replicas.resize(R);
  for (size_t r = 0; r < R; ++r) {
    Impl::Replica& replica = s.replicas[r];
    replica.device = deviceOf(r);
    if (r == 0) {
      replica.module = model;
    } else {
      try {
        replica.module = replica.device == home ? model->clone() : model->clone(replica.device);
      } catch (const c10::Error& e) {
        std::string what = e.what_without_backtrace();
        throw InvalidArgument(detail::concat(s.who, ": the model cannot be copied into replicas (",
                                             what.substr(0, what.find('\n')),
                                             "): every submodule must be a torch::nn::Cloneable"));
      }
    }
    for (auto& [name, p] : uniqueParameters(*replica.module)) {
      if (p.requires_grad()) replica.params.push_back(p);
    }
    COHORT_CHECK_EQ(replica.params.size(), named.size(), Error, s.who, ": a copy of the model has another parameter count");
    if (r > 0 && kind != Kind::kMirrored && replica.device == home) {
      // One set of parameters: the copies are distinct tensors (each its own gradient) over the
      // same memory.
      torch::NoGradGuard noGrad;
      for (size_t k = 0; k < named.size(); ++k) replica.params[k].set_data(named[k].second);
      auto mine = replica.module->buffers();
      auto first = model->buffers();
      for (size_t i = 0; i < mine.size() && i < first.size(); ++i) mine[i].set_data(first[i]);
    }
    if (r == 0) {
      replica.optimizer = &optimizer;
    } else if (kind != Kind::kCentral) {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      for (auto& group : optimizer.param_groups()) {
        std::vector<torch::Tensor> mine;
        for (auto& p : group.params()) mine.push_back(replica.params[indexOf[p.unsafeGetTensorImpl()]]);
        groups.emplace_back(std::move(mine), group.options().clone());
      }
      std::unique_ptr<torch::optim::Optimizer> copy;
      if (!copy) copy = copyAs<torch::optim::SGD, torch::optim::SGDOptions>(optimizer, groups);
      if (!copy) copy = copyAs<torch::optim::Adam, torch::optim::AdamOptions>(optimizer, groups);
      if (!copy) copy = copyAs<torch::optim::AdamW, torch::optim::AdamWOptions>(optimizer, groups);
      if (!copy) copy = copyAs<torch::optim::RMSprop, torch::optim::RMSpropOptions>(optimizer, groups);
      if (!copy) copy = copyAs<torch::optim::Adagrad, torch::optim::AdagradOptions>(optimizer, groups);
      COHORT_CHECK(copy != nullptr, InvalidArgument, s.who,
                   ": every replica needs a copy of the optimizer, and this one cannot be copied; use SGD, Adam, AdamW, "
                   "RMSprop or Adagrad");
      // The state (momentum, moments) too: a resumed optimizer's copies go on alike.
      std::vector<char> bytes;
      torch::serialize::OutputArchive out;
      optimizer.save(out);
      out.save_to([&](const void* data, size_t size) {
        bytes.insert(bytes.end(), static_cast<const char*>(data), static_cast<const char*>(data) + size);
        return size;
      });
      torch::serialize::InputArchive in;
      in.load_from(bytes.data(), bytes.size(), replica.device);
      copy->load(in);
      replica.ownOptimizer = std::move(copy);
      replica.optimizer = replica.ownOptimizer.get();
    }
  }

  if (s.sumsGradients()) {
    s.buildBuckets();
    Impl* impl = impl_.get();
    for (size_t r = 0; r < R; ++r) {
      for (size_t k = 0; k < named.size(); ++k) {
        s.replicas[r].hooks.push_back(
            s.replicas[r].params[k].register_hook([impl, r, k](torch::Tensor grad) { impl->onGradient(r, k, grad); }));
      }
    }
  }
  s.blasThreadsBefore = openBlasThreads();
  setOpenBlasThreads(1);
  for (size_t r = 0; r < R; ++r) s.threads.emplace_back([impl = impl_.get(), r] { impl->threadMain(r); });
}

ReplicaGroup::~ReplicaGroup() {
  Impl& s = *impl_;
  {
    MutexLock lock(s.mutex);
    s.stopping = true;
    s.wake.notifyAll();
  }
  for (auto& t : s.threads) t.join();
  for (auto& replica : s.replicas) {
    for (size_t k = 0; k < replica.hooks.size(); ++k) replica.params[k].remove_hook(replica.hooks[k]);
  }
  if (s.blasThreadsBefore > 0) setOpenBlasThreads(s.blasThreadsBefore);
}

double ReplicaGroup::step(const torch::Tensor& inputs, const torch::Tensor& targets, const ShardLoss& loss) {
  Impl& s = *impl_;
  COHORT_CHECK(!s.broken, Error, s.who, ": an earlier step failed while the replicas were updating their parameters, "
               "so they may differ; make a new handle");
  const int R = int(s.replicas.size());
  const int64_t n = inputs.size(0);
  COHORT_CHECK(n >= R, InvalidArgument, s.who, ": a batch of ", n, " examples cannot be split over ", R,
               " replicas: use a batch of at least ", R, " or fewer replicas");
  COHORT_CHECK(targets.size(0) == n, InvalidArgument, s.who, ": ", n, " inputs but ", targets.size(0), " targets");
  s.shardInputs.clear();
  s.shardTargets.clear();
  const std::vector<int64_t> sizes = s.shardSizes(n);
  int64_t offset = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t size = sizes[size_t(r)];
    // On the replica's device (a no-op where the batch is already there).
    const c10::Device device = s.replicas[size_t(r)].device;
    s.shardInputs.push_back(inputs.narrow(0, offset, size).to(device));
    s.shardTargets.push_back(targets.narrow(0, offset, size).to(device));
    s.replicas[size_t(r)].weight = double(size) / double(n);
    s.replicas[size_t(r)].loss = 0;
    offset += size;
  }
  for (auto& bucket : s.buckets) {
    bucket->arrived = 0;
    bucket->summedChunks = 0;
  }
  s.finishedSums = 0;
  s.crossDone = false;
  {
    MutexLock lock(s.launchMutex);
    s.launched = 0;
  }
  const CommCounters commBefore = s.comm ? s.comm->counters() : CommCounters{};
  s.updating = false;
  s.failed = false;
  s.lossFn = &loss;
  s.deadline = std::chrono::steady_clock::now() + s.options.timeout;
  {
    MutexLock lock(s.mutex);
    s.error = nullptr;
    s.errorReplica = -1;
    s.running = R;
    ++s.generation;
    s.wokenAt = Clock::now();
    s.wake.notifyAll();
    // The replicas' own waits end by the deadline; this one allows them a margin to unwind.
    const auto until = s.deadline + s.options.timeout;
    while (s.running > 0 && s.done.waitUntil(s.mutex, until) == std::cv_status::no_timeout) continue;
    const bool finished = s.running == 0;
    if (finished) {
      // A thread that ended first waited for the last; the last one's end waking this thread is
      // the hand-off.
      const auto now = Clock::now();
      auto last = s.replicas[0].endedAt;
      for (auto& replica : s.replicas) last = std::max(last, replica.endedAt);
      for (auto& replica : s.replicas) {
        replica.waitSeconds += std::chrono::duration<double>(last - replica.endedAt).count();
        replica.times.handOff += std::chrono::duration<double>(now - last).count();
      }
    }
    if (!finished) {
      s.broken = true;
      throw TimeoutError(detail::concat(s.who, ": the replica threads did not finish their step within ",
                                        2 * s.options.timeout.count(), " ms"));
    }
    if (s.error) {
      // A failure before any optimizer step leaves every replica as it was; one during the
      // optimizer steps may leave the copies different. (Hogwild's threads share one parameter
      // set: nothing can differ.)
      if (s.updating.load() && s.kind == Kind::kMirrored) s.broken = true;
      // Collectives launched in a failed step leave this process out of step with the others.
      {
        MutexLock launchLock(s.launchMutex);
        if (s.launched > 0) s.broken = true;
      }
      try {
        std::rethrow_exception(s.error);
      } catch (const Error& e) {
        throw Error(detail::concat(s.who, ": replica ", s.errorReplica, " failed: ", e.what()));
      } catch (const c10::Error& e) {
        std::string what = e.what_without_backtrace();
        throw Error(detail::concat(s.who, ": replica ", s.errorReplica, " failed: ", what.substr(0, what.find('\n'))));
      } catch (const std::exception& e) {
        throw Error(detail::concat(s.who, ": replica ", s.errorReplica, " failed: ", e.what()));
      }
    }
  }
  const CommCounters after = s.comm ? s.comm->counters() : CommCounters{};
  double total = 0;
  for (auto& replica : s.replicas) total += replica.weight * replica.loss;
  if (s.options.balance) s.measureSpeeds();
  MutexLock lock(s.mutex);
  s.stats.bytesSent += after.bytesSent - commBefore.bytesSent;
  s.stats.bytesReceived += after.bytesReceived - commBefore.bytesReceived;
  ++s.stats.steps;
  s.stats.lastShards = sizes;
  if (s.sumsGradients()) {
    for (auto& bucket : s.buckets) s.stats.bytesReduced += bucket->numel * int64_t(sizeof(float)) * R;
  }
  return total;
}

void ReplicaGroup::synchronizeBuffers() {
  Impl& s = *impl_;
  if (s.kind != Kind::kMirrored) return;  // one set of buffers already
  torch::NoGradGuard noGrad;
  std::vector<std::vector<torch::Tensor>> all;
  for (auto& replica : s.replicas) all.push_back(replica.module->buffers());
  std::vector<torch::Tensor> first;
  for (size_t i = 0; i < all[0].size(); ++i) {
    if (!all[0][i].defined() || !all[0][i].is_floating_point()) continue;
    for (size_t r = 1; r < all.size(); ++r) all[0][i].add_(all[r][i].to(all[0][i].device()));
    all[0][i].div_(double(all.size()));
    first.push_back(all[0][i]);
  }
  if (s.comm != nullptr) averageInPlace(*s.comm, first);
  for (size_t i = 0; i < all[0].size(); ++i) {
    if (!all[0][i].defined() || !all[0][i].is_floating_point()) continue;
    for (size_t r = 1; r < all.size(); ++r) all[r][i].copy_(all[0][i]);
  }
}

int ReplicaGroup::replicas() const { return int(impl_->replicas.size()); }

torch::nn::Module& ReplicaGroup::replica(int r) {
  COHORT_CHECK(r >= 0 && r < replicas(), InvalidArgument, impl_->who, ": no replica ", r);
  return *impl_->replicas[size_t(r)].module;
}

ReplicaStats ReplicaGroup::stats() const {
  Impl& s = *impl_;
  ReplicaStats out;
  {
    MutexLock lock(s.mutex);
    out = s.stats;
  }
  out.buckets = int64_t(s.buckets.size());
  const double R = double(s.replicas.size());
  for (auto& replica : s.replicas) {
    out.waitSeconds += replica.waitSeconds / R;
    out.times.handOff += replica.times.handOff / R;
    out.times.forward += replica.times.forward / R;
    out.times.backward += replica.times.backward / R;
    out.times.copy += replica.times.copy / R;
    out.times.sum += replica.times.sum / R;
    out.times.optimizer += replica.times.optimizer / R;
  }
  return out;
}

Mirrored::Mirrored(const Job& job, std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
                   ReplicaOptions options)
    : ReplicaGroup(Kind::kMirrored, &job, std::move(model), optimizer, options) {}

Mirrored::Mirrored(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer, ReplicaOptions options)
    : ReplicaGroup(Kind::kMirrored, nullptr, std::move(model), optimizer, options) {}

CentralStorage::CentralStorage(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
                               ReplicaOptions options)
    : ReplicaGroup(Kind::kCentral, nullptr, std::move(model), optimizer, options) {}

Hogwild::Hogwild(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer, ReplicaOptions options)
    : ReplicaGroup(Kind::kHogwild, nullptr, std::move(model), optimizer, options) {}

}  // namespace cohort
