// Ranks as threads of one process, each with its own Communicator over a real TCPStore on
// 127.0.0.1 (Gloo's test/base_test.h, c10d's ProcessGroupGlooTest do the same).
#pragma once

#include <cohort/communicator.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "test_util.h"

namespace cohort::test {

// Runs body on `world` threads, one rank each, and rethrows the first failure.
inline void onRanks(int world, const std::function<void(std::shared_ptr<Communicator>)>& body,
                    std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const int port = freePort();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ClusterSpec spec;
        spec.rank = r;
        spec.worldSize = world;
        spec.master = {"127.0.0.1", port};
        body(Communicator::connect(spec, {.timeout = timeout}));
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace cohort::test
