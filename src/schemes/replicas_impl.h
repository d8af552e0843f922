// ReplicaGroup's state (include/cohort/replicas.h), shared by the files that implement it:
//   replicas.cpp           the handle: the replicas made, a step as the caller sees it, stats
//   replica_gradients.cpp  the gradient buckets and their sum over replicas and processes
//   replica_threads.cpp    the replica threads: one replica's step, Hogwild's step, the waits
//   replica_balance.cpp    how a batch is split over the replicas (even, or by measured speed)
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
#pragma once

#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/replicas.h>

#include "base/clock.h"
#include "base/thread_annotations.h"
#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cohort {

// Thrown on a replica thread that stops because another replica failed: not the step's error.
struct ReplicaAborted {};

struct COHORT_LOCAL ReplicaGroup::Impl {
  struct Bucket {
    std::vector<size_t> params;  // indices into params[r]
    int64_t numel = 0;
    std::vector<torch::Tensor> local;                    // [r]: replica r's weighted gradients, flat
    std::vector<std::vector<torch::Tensor>> localSlots;  // [r][i]: parameter i's part of local[r]
    torch::Tensor sum;                                   // the sum over the replicas, flat, on replica 0's device
    std::vector<torch::Tensor> sumSlots;                 // [i], shaped like the parameter
    // [r]: the sum on replica r's device (the sum itself where that is replica 0's), and its
    // parameter i's part, [r][i]: what replica r's gradients point into.
    std::vector<torch::Tensor> sumOnDevice;
    std::vector<std::vector<torch::Tensor>> sumOnDeviceSlots;
    std::atomic<int> arrived{0};  // replicas that have filled the bucket this step
    std::atomic<int> summedChunks{0};
    CommWork crossWork;  // Mirrored across processes: the sum's allreduce, launched this step
  };

  // Per replica thread; touched by that thread only during a step.
  struct Replica {
    c10::Device device{c10::kCPU};  // where its copy of the model, its shards and its gradients are
    std::shared_ptr<torch::nn::Module> module;
    std::vector<torch::Tensor> params;                      // trainable, in the same order on every replica
    std::unique_ptr<torch::optim::Optimizer> ownOptimizer;  // replicas 1..R-1 (Mirrored, Hogwild)
    torch::optim::Optimizer* optimizer = nullptr;
    std::vector<std::vector<bool>> filled;  // [bucket][i]
    std::vector<size_t> pending;            // [bucket]: gradients still to come
    size_t nextToSum = 0;                   // the first bucket whose chunk this replica has not summed
    double weight = 0;                      // its shard's share of the batch
    ScaleTensors weightTensors;             // the same, for onGradient's mul_out
    double loss = 0;
    bool inBackward = false;
    std::vector<unsigned> hooks;
    double waitSeconds = 0;
    ReplicaTimes times;
    double hookSeconds = 0;     // this step's time in the gradient hooks, taken out of backward
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
  std::atomic<int> finishedSums{0};    // replicas done with all their chunks
  std::atomic<bool> crossDone{false};  // the process-wide average of the sums is in place
  // Mirrored across processes: buckets whose allreduce is launched, in bucket order (the order
  // of collectives every process must follow).
  Mutex launchMutex;
  size_t launched GUARDED_BY(launchMutex) = 0;
  // Mirrored across processes with findUnusedParameters: [k], whether some process's replicas
  // got a gradient for parameter k this step; written by replica 0 before crossDone.
  std::vector<int32_t> usedAcross;
  std::atomic<bool> updating{false};           // a replica has begun its optimizer step
  std::exception_ptr error GUARDED_BY(mutex);  // the first failure
  int errorReplica GUARDED_BY(mutex) = -1;
  bool broken = false;                          // a failure after parameters changed: replicas may differ
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

  // ---- making the replicas (replicas.cpp) ----

  void checkOptions(const ReplicaOptions& o) const;
  // The model's trainable parameters by name, checked: floating-point, on one device (the CPU for
  // Hogwild), at least one.
  std::vector<std::pair<std::string, torch::Tensor>> trainableParameters(torch::nn::Module& model) const;
  // Replica r: its device (the r-th GPU after the model's, wrapping around), its copy of the model
  // (replica 0: the model; CentralStorage and Hogwild copies on the model's device share its
  // memory) and its optimizer (replica 0: the caller's; Mirrored and Hogwild: a copy with its state).
  void makeReplica(size_t r, const std::shared_ptr<torch::nn::Module>& model,
                   const std::vector<std::pair<std::string, torch::Tensor>>& named, torch::optim::Optimizer& optimizer,
                   const std::unordered_map<const void*, size_t>& indexOf);
  std::shared_ptr<torch::nn::Module> cloneModel(torch::nn::Module& model, c10::Device device, c10::Device home) const;
  // indexOf: the model parameter index of each optimizer parameter.
  std::unique_ptr<torch::optim::Optimizer> copyOptimizer(torch::optim::Optimizer& optimizer, const Replica& replica,
                                                         const std::unordered_map<const void*, size_t>& indexOf) const;
  // Every replica's gradient hooks (onGradient).
  void registerHooks();

  // ---- a step, on the caller's thread (replicas.cpp) ----

  // Each replica's shard of the batch, on its device, and its weight.
  void splitBatch(const torch::Tensor& inputs, const torch::Tensor& targets, const std::vector<int64_t>& sizes);
  void resetForStep(const ShardLoss& loss);
  // CentralStorage and Hogwild keep one set of buffers, the model's (replica 0's), but each
  // replica's forward updates a copy of its own (BatchNorm's running statistics; updating the one
  // set from every thread at once was a data race, and counted each step R times): before the
  // step, the copies take the model's; after it, each floating-point buffer of the model becomes
  // the replicas' mean weighted by their shards (a buffer no replica changed is kept bit for bit;
  // integer ones, the batches seen, are replica 0's), and the copies take it. The running mean
  // then equals one process's on the whole batch, up to rounding; the running variance is the
  // shards' variances weighted.
  void pullBuffers();
  void mergeBuffers();
  // The copies of the optimizer (Mirrored, Hogwild) take the caller's options (learning rate,
  // momentum...) as they are now: a schedule that changes them reaches every replica.
  void followCallersOptions();
  // Wakes the replica threads and waits for them (up to twice the timeout); throws the first
  // replica's failure, marking the group broken when the replicas may now differ.
  void runThreads() EXCLUDES(launchMutex, mutex);
  void rethrowFailure() REQUIRES(mutex) EXCLUDES(launchMutex);

  // ---- waits between replicas (replica_threads.cpp) ----

  template <class Ready>
  void waitUntil(Replica& self, const Ready& ready, const char* what) EXCLUDES(mutex) {
    if (ready()) return;
    const auto start = Clock::now();
    // Each wait its own options.timeout, from when it begins: a step may compute for longer.
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    MutexLock lock(mutex);
    auto settled = [&] { return ready() || failed.load(); };
    while (!settled() && changed.waitUntil(mutex, deadline) == std::cv_status::no_timeout) continue;
    const bool ok = settled();
    self.waitSeconds += secondsSince(start);
    if (failed.load()) throw ReplicaAborted{};
    if (!ok) {
      throw TimeoutError(detail::concat(who, ": a replica waited more than ", options.timeout.count(),
                                        " ms for the others ", what,
                                        "; a replica is stuck in its forward or backward"));
    }
  }

  void notifyAll() EXCLUDES(mutex);

  void fail(int r, std::exception_ptr e) EXCLUDES(mutex);

  // ---- gradient buckets (replica_gradients.cpp) ----

  void buildBuckets();

  void onGradient(size_t r, size_t k, const torch::Tensor& grad);

  void arrive(size_t b);

  // Replica r's chunk of bucket b: [b.numel * r / R, b.numel * (r+1) / R).
  void sumChunk(size_t r, Bucket& bucket);

  // Mirrored across processes, overlapped: launches the allreduce of every bucket whose sum is
  // complete, in bucket order. Buckets complete in that order (every replica sums its chunks in
  // bucket order), but the replicas completing two of them race to launch: whoever holds the lock
  // launches all that are ready, so every process issues its collectives in the same order.
  void launchSummed() EXCLUDES(launchMutex);

  void sumReadyChunks(Replica& self, size_t r, bool wait);

  // ---- one replica's step, on its thread (replica_threads.cpp) ----

  // Mirrored and CentralStorage: the replica's forward and backward on its shard, its gradients
  // into the buckets, its chunks of the sums, then (after the others) the optimizer step on the
  // sums. Hogwild: hogwildStep.
  void runReplica(size_t r);
  // runReplica's steps, in order.
  void beginStep(Replica& self, size_t r);
  void forwardBackward(Replica& self, size_t r);
  // Parameters that got no gradient (and a replica without examples) contribute zeros.
  void zeroMissingGradients(Replica& self, size_t r);
  void waitForTheSums(Replica& self, size_t r);
  void applyTheSums(Replica& self, size_t r);
  // Whether parameter k got a gradient this step on some replica of this process, and whether it
  // gets a .grad: one that no replica got keeps none, as in one process (across processes, with
  // findUnusedParameters: no replica of any process). Read once every replica has summed.
  bool usedHere(size_t k) const;
  bool usedThisStep(size_t k) const;

  // On replica 0 once every chunk is summed: waits for the buckets' allreduces (launched while
  // backward ran, or now without overlap) and makes the sums means; with findUnusedParameters,
  // then allreduces which parameters got a gradient (usedAcross). The traffic is counted by
  // step(); the time waited here is the communication backward did not hide.
  void averageAcrossProcesses() EXCLUDES(launchMutex, mutex);

  void hogwildStep(Replica& self, size_t r);

  // ---- the thread loop (replica_threads.cpp) ----

  void threadMain(size_t r);

  // ---- the split of a batch (replica_balance.cpp) ----

  // The examples of each replica in a batch of n (n >= R). Even (sizes differing by at most one),
  // or with options.balance, once every replica has been measured, in proportion to its speed
  // (1 / secondsPerExample) in units of g = max(1, n / 32) examples, each at least max(1, n / 4R)
  // examples. Every new shard size costs oneDNN a new primitive (its kernels generated at the
  // first call), so the split changes only when its predicted step (the slowest shard's time)
  // is more than kGain shorter than the current split's: for a steady speed gap it settles on one.
  std::vector<int64_t> shardSizes(int64_t n);

  // After a step with options.balance: smooths each replica's measured time per example.
  void measureSpeeds();
};

}  // namespace cohort
