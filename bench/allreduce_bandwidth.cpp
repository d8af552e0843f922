// Raw allreduce bandwidth of cohort's Communicator. Run under a launcher:
//   build/cohort launch -n 2 -- build/bench/allreduce_bandwidth 4 64
// For each size in MB: 3 warm-up allreduces, then `reps` timed ones; rank 0 prints one JSON line
// per size with the median seconds and the algorithm bandwidth (bytes / time).
#include <cohort/cluster.h>
#include <cohort/communicator.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  auto comm = cohort::Communicator::connect(cohort::resolveClusterFromEnvironment());
  for (int i = 1; i < argc; ++i) {
    const double mb = std::atof(argv[i]);
    const int64_t numel = int64_t(mb * 1024 * 1024 / 4);
    const int reps = mb > 16 ? 10 : 30;
    auto t = torch::ones({numel});
    for (int w = 0; w < 3; ++w) comm->allreduce(t);
    std::vector<double> times;
    for (int r = 0; r < reps; ++r) {
      comm->barrier();
      const auto start = std::chrono::steady_clock::now();
      comm->allreduce(t);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    if (comm->rank() == 0) {
      std::printf("{\"mb\": %g, \"median_s\": %.6f, \"gb_per_s\": %.4f}\n", mb, median,
                  double(numel) * 4 / median / 1e9);
      std::fflush(stdout);
    }
  }
  return 0;
}
