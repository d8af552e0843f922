// Helpers shared by the parameter-server test binaries (test_util.h's are for every binary).
#pragma once

#include "ps/client.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

namespace cohort::test {

// A client's failed attempts as they come (ClientOptions::onRetry), for a test to wait on.
class Retries {
 public:
  // `act`, if given, runs in the client's thread before the client's next attempt: a test that
  // must change the shard between two attempts does it there, not racing the client's back-off.
  std::function<void(const ps::RetryEvent&)> hook(std::function<void(const ps::RetryEvent&)> act = {}) {
    return [this, act = std::move(act)](const ps::RetryEvent& e) {
      if (act) act(e);
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(e);
      changed_.notify_all();
    };
  }
  // The call has returned: no retry will come.
  void finished() {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    changed_.notify_all();
  }
  // Waits (at most `limit`) for a retry after the last one accepted that `accept` accepts; false
  // when the call returned or the time ran out first.
  bool waitFor(const std::function<bool(const ps::RetryEvent&)>& accept,
               std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    bool found = false;
    changed_.wait_for(lock, limit, [&] {
      for (; seen_ < events_.size() && !found; ++seen_) found = accept(events_[seen_]);
      return found || finished_;
    });
    return found;
  }
  std::vector<ps::RetryEvent> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<ps::RetryEvent> events_;
  size_t seen_ = 0;
  bool finished_ = false;
};

}  // namespace cohort::test
