// Works the GPU waits for and the host does not.
//
// A collective over CUDA tensors (NCCL's) is waited for as PyTorch's DDP reducer does: the
// caller's CUDA stream is made to wait for the collective's (through the work's future) and the
// host goes on launching kernels, so that a step costs no host synchronization per bucket. What a host
// wait used to give, a bound on the collective's time and its error, the watchdog gives: one thread
// per communicator checks the works it was given, oldest first (one NCCL stream completes them in
// order), until each completes. A work that fails, or that has not completed `timeout` after it was
// given, is aborted (for NCCL: its communicator, so that no kernel spins on the GPU forever) and
// recorded; the communicator's next operation reports it as its own failure (failure()), and a host
// read of the result, blocked behind the aborted kernel, returns.
//
// c10d's ProcessGroupNCCL has a watchdog of its own, but it ends the process on an error (nccl.cpp
// says why cohort turns it off); this one only records.
#pragma once

#include "base/thread_annotations.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace cohort {

class WorkWatchdog {
 public:
  struct Failure {
    std::string op;    // what the work was ("allreduce of 4096 bytes")
    std::string what;  // its error, or "... did not complete within N ms (timed out)"
  };

  // `poll`: how often the oldest work is checked while it runs.
  explicit WorkWatchdog(std::chrono::milliseconds timeout,
                        std::chrono::microseconds poll = std::chrono::milliseconds(1));
  // Stops checking. Works still watched are their group's to finish (its shutdown or abort).
  ~WorkWatchdog();
  WorkWatchdog(const WorkWatchdog&) = delete;
  WorkWatchdog& operator=(const WorkWatchdog&) = delete;

  // Watches `work` from now until it completes, and holds `keepAlive` (the tensors it reads and
  // writes) until then. The first call starts the thread. After a failure nothing more is watched:
  // the work is dropped, its communicator being aborted already.
  void watch(c10::intrusive_ptr<c10d::Work> work, std::string op, std::vector<at::Tensor> keepAlive)
      EXCLUDES(mu_);

  // The first work that failed or timed out, once the thread has seen it.
  std::optional<Failure> failure() const EXCLUDES(mu_);

  // Waits until every watched work has completed or one has failed (its failure, then), at most
  // about the timeout: the thread fails a work that outlives it.
  std::optional<Failure> drain() EXCLUDES(mu_);

  // How many works are being watched (those given and not yet seen complete).
  size_t watching() const EXCLUDES(mu_);

 private:
  struct Entry {
    c10::intrusive_ptr<c10d::Work> work;
    std::string op;
    std::vector<at::Tensor> keepAlive;
    std::chrono::steady_clock::time_point deadline;
  };

  void run() EXCLUDES(mu_);
  void failLocked(Failure failure) REQUIRES(mu_);

  const std::chrono::milliseconds timeout_;
  const std::chrono::microseconds poll_;
  mutable Mutex mu_;
  CondVar changed_;  // a work given, seen complete or failed; stopping
  std::deque<Entry> works_ GUARDED_BY(mu_);
  std::optional<Failure> failure_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // started by the first watch(), under mu_
};

}  // namespace cohort
