// The replica threads: one replica's part of a step, Hogwild's step, and the waits between
// replicas (see replicas_impl.h).
#include "schemes/replicas_impl.h"

#include "base/compute_threads.h"
#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <algorithm>

namespace cohort {

void ReplicaGroup::Impl::notifyAll() {
  MutexLock lock(mutex);
  changed.notifyAll();
}

void ReplicaGroup::Impl::fail(int r, std::exception_ptr e) {
  MutexLock lock(mutex);
  if (!error) {
    error = e;
    errorReplica = r;
  }
  failed = true;
  changed.notifyAll();
  done.notifyAll();  // runThreads gives the others options.timeout to unwind from here
}

void ReplicaGroup::Impl::runReplica(size_t r) {
  Replica& self = replicas[r];
  if (kind == Kind::kHogwild) {
    hogwildStep(self, r);
    return;
  }
  beginStep(self, r);
  if (shardInputs[r].size(0) > 0) forwardBackward(self, r);
  zeroMissingGradients(self, r);
  sumReadyChunks(self, r, /*wait=*/true);
  finishedSums.fetch_add(1);
  notifyAll();
  waitForTheSums(self, r);
  if (kind == Kind::kCentral && r != 0) return;  // one optimizer, on the one parameter set
  applyTheSums(self, r);
}

void ReplicaGroup::Impl::beginStep(Replica& self, size_t r) {
  clearGradients(*self.module);
  if (kind == Kind::kCentral && elsewhere(r)) {
    // CentralStorage's one parameter set is replica 0's; a replica on another GPU computes
    // against a copy of it, refreshed here (its buffers: pullBuffers).
    torch::NoGradGuard noGrad;
    for (size_t k = 0; k < self.params.size(); ++k) self.params[k].copy_(replicas[0].params[k]);
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    self.filled[b].assign(buckets[b]->params.size(), false);
    self.pending[b] = buckets[b]->params.size();
  }
  self.nextToSum = 0;
  self.hookSeconds = 0;
  self.computeSeconds = 0;
}

void ReplicaGroup::Impl::forwardBackward(Replica& self, size_t r) {
  const auto forwardStart = Clock::now();
  torch::Tensor value = (*lossFn)(int(r), *self.module, shardInputs[r], shardTargets[r]);
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

void ReplicaGroup::Impl::zeroMissingGradients(Replica& self, size_t r) {
  const auto start = Clock::now();
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (self.pending[b] == 0) continue;
    for (size_t i = 0; i < buckets[b]->params.size(); ++i) {
      if (!self.filled[b][i]) buckets[b]->localSlots[r][i].zero_();
    }
    self.pending[b] = 0;
    arrive(b);
  }
  self.times.copy += secondsSince(start);
}

void ReplicaGroup::Impl::waitForTheSums(Replica& self, size_t r) {
  const int R = int(replicas.size());
  if (comm == nullptr) {
    waitUntil(
        self, [&] { return finishedSums.load() == R; }, "to finish summing their gradients");
    return;
  }
  // Replica 0 averages the process's sums with the other processes'; the others wait for it.
  if (r == 0) {
    waitUntil(
        self, [&] { return finishedSums.load() == R; }, "to finish summing their gradients");
    averageAcrossProcesses();
    crossDone = true;
    notifyAll();
  } else {
    waitUntil(
        self, [&] { return crossDone.load(); }, "while replica 0 averages across processes");
  }
}

void ReplicaGroup::Impl::applyTheSums(Replica& self, size_t r) {
  updating = true;
  const auto start = Clock::now();
  if (elsewhere(r)) {
    // The sums, complete on replica 0's device, copied to this replica's.
    torch::NoGradGuard noGrad;
    for (auto& bucket : buckets) bucket->sumOnDevice[r].copy_(bucket->sum);
  }
  for (size_t k = 0; k < self.params.size(); ++k) {
    if (!usedThisStep(k)) {
      self.params[k].mutable_grad().reset();  // its slot holds zeros: the optimizer skips it instead
      continue;
    }
    auto [b, i] = slotOf[k];
    self.params[k].mutable_grad() = buckets[b]->sumOnDeviceSlots[r][i];
  }
  self.optimizer->step();
  self.times.optimizer += secondsSince(start);
}

bool ReplicaGroup::Impl::usedHere(size_t k) const {
  auto [b, i] = slotOf[k];
  for (const auto& replica : replicas) {
    if (replica.filled[b][i]) return true;
  }
  return false;
}

bool ReplicaGroup::Impl::usedThisStep(size_t k) const {
  if (comm == nullptr) return usedHere(k);
  return !options.findUnusedParameters || usedAcross[k] != 0;
}

// On replica 0 once every chunk is summed: waits for the buckets' allreduces (launched while
// backward ran, or now without overlap) and makes the sums means; with findUnusedParameters,
// then allreduces which parameters got a gradient. The traffic is counted by step(); the time
// waited here is the communication backward did not hide.
void ReplicaGroup::Impl::averageAcrossProcesses() {
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
  if (options.findUnusedParameters) {
    // After every bucket, in the same place on every process, so the collectives pair up.
    const size_t P = replicas[0].params.size();
    auto used = torch::empty({int64_t(P)}, torch::kInt32);
    auto* flags = used.data_ptr<int32_t>();
    for (size_t k = 0; k < P; ++k) flags[k] = usedHere(k) ? 1 : 0;
    comm->allreduce(used);
    usedAcross.assign(flags, flags + P);
  }
  MutexLock lock(mutex);
  stats.commWaitSeconds += secondsSince(start);
}

void ReplicaGroup::Impl::hogwildStep(Replica& self, size_t r) {
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

void ReplicaGroup::Impl::threadMain(size_t r) {
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
    } catch (const ReplicaAborted&) {
    } catch (...) {
      fail(int(r), std::current_exception());
    }
    replicas[r].endedAt = Clock::now();
    MutexLock lock(mutex);
    if (--running == 0) done.notifyAll();
  }
}

}  // namespace cohort
