#include "comm/work_watchdog.h"

#include <exception>
#include <utility>

namespace cohort {

namespace {

using Clock = std::chrono::steady_clock;

// How long the thread sleeps when it has nothing to watch (a new work wakes it at once).
constexpr std::chrono::milliseconds kIdle{100};

}  // namespace

WorkWatchdog::WorkWatchdog(std::chrono::milliseconds timeout, std::chrono::microseconds poll)
    : timeout_(timeout), poll_(poll) {}

WorkWatchdog::~WorkWatchdog() {
  bool aborting = false;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    // A thread that saw a failure is aborting its work, which can wait inside NCCL for peers that
    // are gone (NVIDIA/nccl#863); it touches nothing of this object any more.
    aborting = failure_.has_value();
  }
  changed_.notifyAll();
  if (!thread_.joinable()) return;
  if (aborting) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void WorkWatchdog::watch(c10::intrusive_ptr<c10d::Work> work, std::string op, std::vector<at::Tensor> keepAlive) {
  MutexLock lock(mu_);
  // After a failure the communicator is aborted, and so is every work of it: nothing to watch.
  if (failure_) return;
  works_.push_back(Entry{std::move(work), std::move(op), std::move(keepAlive), Clock::now() + timeout_});
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  changed_.notifyAll();
}

std::optional<WorkWatchdog::Failure> WorkWatchdog::failure() const {
  MutexLock lock(mu_);
  return failure_;
}

std::optional<WorkWatchdog::Failure> WorkWatchdog::drain() {
  MutexLock lock(mu_);
  // The thread fails the newest work by its deadline; a second more for it to notice.
  const auto until = Clock::now() + timeout_ + std::chrono::seconds(1);
  while (!works_.empty() && !failure_) {
    if (changed_.waitUntil(mu_, until) == std::cv_status::timeout) break;
  }
  if (!failure_ && !works_.empty()) {
    return Failure{works_.front().op, "the watchdog did not see it complete within " +
                                          std::to_string(timeout_.count()) + " ms (timed out)"};
  }
  return failure_;
}

size_t WorkWatchdog::watching() const {
  MutexLock lock(mu_);
  return works_.size();
}

void WorkWatchdog::failLocked(Failure failure) {
  failure_ = std::move(failure);
  changed_.notifyAll();
}

void WorkWatchdog::run() {
  for (;;) {
    c10::intrusive_ptr<c10d::Work> oldest;
    std::string op;
    Clock::time_point deadline;
    {
      MutexLock lock(mu_);
      while (!stopping_ && works_.empty()) changed_.waitFor(mu_, kIdle);
      if (stopping_) return;
      oldest = works_.front().work;
      op = works_.front().op;
      deadline = works_.front().deadline;
    }
    // Checked without the lock: isCompleted asks CUDA for the work's event and NCCL for the
    // communicator's asynchronous error (a lost peer), which then completes it with an exception.
    bool completed = false;
    std::string error;
    try {
      completed = oldest->isCompleted();
      if (completed) {
        if (std::exception_ptr e = oldest->exception()) std::rethrow_exception(e);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (error.empty() && !completed && Clock::now() >= deadline) {
      error = "did not complete within " + std::to_string(timeout_.count()) + " ms (timed out)";
    }
    if (!error.empty()) {
      std::deque<Entry> abandoned;  // their tensors are released after the abort, not before
      {
        MutexLock lock(mu_);
        // Being destroyed (its group is being shut down): the group's close owns the work now, and
        // an abort here, which can wait for peers, would hold the destructor's join.
        if (stopping_) return;
        abandoned.swap(works_);
        failLocked(Failure{std::move(op), std::move(error)});
      }
      // Ends the kernels of this work's communicator (NCCL: ncclCommAbort), so that the streams
      // waiting for them, and the host behind those, go on. From here on this thread touches only
      // what it owns: the destructor may have let it go.
      try {
        oldest->abort();
      } catch (const std::exception&) {
        // the failure is recorded; an abort that fails leaves nothing more to do
      }
      return;
    }
    MutexLock lock(mu_);
    if (completed) {
      works_.pop_front();  // only this thread removes works, so the front is still `oldest`
      if (works_.empty()) changed_.notifyAll();
      continue;
    }
    if (!stopping_) changed_.waitFor(mu_, poll_);
  }
}

}  // namespace cohort
