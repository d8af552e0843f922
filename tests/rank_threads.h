// Ranks as threads of one process, each with its own Communicator over a real TCPStore on
// 127.0.0.1 (Gloo's test/base_test.h, c10d's ProcessGroupGlooTest do the same).
#pragma once

#include <cohort/communicator.h>
#include <cohort/error.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "test_util.h"

namespace cohort::test {

// Runs body on `world` threads, one rank each, and rethrows the first failure. Rank 0's store
// listens on a port of its choosing (port 0), which it hands to the other ranks before they connect.
// `backend` carries their collectives over CUDA tensors (CommOptions::backend).
inline void onRanks(int world, const std::function<void(std::shared_ptr<Communicator>)>& body,
                    std::chrono::milliseconds timeout = std::chrono::seconds(30),
                    CommBackend backend = CommBackend::kAuto) {
  std::promise<int> listening;
  std::shared_future<int> port = listening.get_future().share();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ClusterSpec spec;
        spec.rank = r;
        spec.worldSize = world;
        spec.master = {"127.0.0.1", 0};
        CommOptions options{.timeout = timeout, .backend = backend};
        if (r == 0) {
          options.onListening = [&](int p) { listening.set_value(p); };
        } else {
          if (port.wait_for(timeout) != std::future_status::ready) {
            throw TimeoutError("rank 0's store did not listen within the timeout");
          }
          spec.master.port = port.get();
        }
        body(Communicator::connect(spec, options));
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
        // Rank 0 failed before its store listened: the others stop waiting for the port.
        if (r == 0) {
          try {
            listening.set_exception(std::current_exception());
          } catch (const std::future_error&) {
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace cohort::test
