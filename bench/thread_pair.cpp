// Two cnn workers on two cores, as two threads of one process or as two processes, with nothing
// of cohort's between them: which part of mirrored's gap to the linear limit (issue 16) the
// libraries (ATen, oneDNN, OpenBLAS) and the kernel give two threads of one process, and which the
// replicas' lock-step adds.
//   build/bench/thread_pair MODE [steps] [options]
//   MODE: one       one worker alone
//         threads   two workers as threads of this process, independent (no exchange)
//         barrier   two threads meeting at a barrier every step, after backward (mirrored's sums)
//         spin      the same barrier, waited for by spinning instead of sleeping
//         procs     two workers as child processes (forked before torch is touched)
//   options: --pin (each worker thread or process on its own cpu), --no-mkldnn (convolutions
//            through ATen's own kernels instead of oneDNN), --batch N (64)
// Prints each worker's median step (forward, backward, optimizer) after the first 5 steps, its
// median forward + backward, its time at the barrier, its migrations between cpus and context
// switches over the run (/proc/self/task/TID/sched), and the workers' summed samples/s.
#include "train/threads.h"

#include <torch/torch.h>

#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/syscall.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Options {
  std::string mode = "one";
  int steps = 120;
  int batch = 64;
  bool pin = false;
  bool mkldnn = true;
};

void pinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// A reusable two-party barrier (mutex and condition variable, as the replicas' waits are).
class Barrier {
 public:
  explicit Barrier(int parties) : parties_(parties) {}
  void arriveAndWait(bool spin) {
    if (spin) {
      const long generation = spinGeneration_.load();
      if (spinArrived_.fetch_add(1) + 1 == parties_) {
        spinArrived_ = 0;
        spinGeneration_.fetch_add(1);
        return;
      }
      while (spinGeneration_.load() == generation) {
      }
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    const long generation = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    changed_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  const int parties_;
  int arrived_ = 0;       // GUARDED_BY(mutex_)
  long generation_ = 0;   // GUARDED_BY(mutex_)
  std::atomic<int> spinArrived_{0};
  std::atomic<long> spinGeneration_{0};
};

struct Worker {
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::SGD> optimizer;
  torch::Tensor inputs, targets;
  std::vector<double> step, compute, wait;
  std::string sched;  // migrations and context switches of its thread
};

// The scheduler's counts for the calling thread.
std::string schedCounts() {
  std::ifstream in("/proc/self/task/" + std::to_string(::syscall(SYS_gettid)) + "/sched");
  std::string line, out;
  while (std::getline(in, line)) {
    for (const char* key : {"se.nr_migrations", "nr_voluntary_switches", "nr_involuntary_switches"}) {
      if (line.rfind(key, 0) == 0) {
        const auto colon = line.find(':');
        out += std::string(key) + " " + line.substr(line.find_first_not_of(' ', colon + 1)) + " ";
      }
    }
  }
  return out;
}

// The cnn of src/models/zoo.cpp on 28x28 images.
Worker makeWorker(int batch, int seed) {
  namespace nn = torch::nn;
  torch::manual_seed(seed);
  Worker w;
  w.model = nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 5)), nn::MaxPool2d(nn::MaxPool2dOptions(2)),
                           nn::Conv2d(nn::Conv2dOptions(32, 64, 5)), nn::MaxPool2d(nn::MaxPool2dOptions(2)),
                           nn::Flatten(), nn::Linear(64 * 4 * 4, 1024), nn::ReLU(), nn::Linear(1024, 10));
  w.optimizer = std::make_unique<torch::optim::SGD>(w.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  w.inputs = torch::rand({batch, 1, 28, 28});
  w.targets = torch::randint(0, 10, {batch}, torch::kInt64);
  return w;
}

void train(Worker& w, int steps, Barrier* barrier, bool spin) {
  at::internal::lazy_init_num_threads();
  at::set_num_threads(1);
  for (int s = 0; s < steps; ++s) {
    const auto t0 = Clock::now();
    w.optimizer->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(w.model->forward(w.inputs), w.targets);
    loss.backward();
    const auto t1 = Clock::now();
    if (barrier != nullptr) barrier->arriveAndWait(spin);
    const auto t2 = Clock::now();
    w.optimizer->step();
    loss.item<double>();
    const auto t3 = Clock::now();
    if (s >= 5) {
      w.step.push_back(ms(t0, t3));
      w.compute.push_back(ms(t0, t1));
      w.wait.push_back(ms(t1, t2));
    }
  }
  w.sched = schedCounts();
}

void report(const char* who, const Worker& w, int batch) {
  std::printf("%s: step %.2f ms, forward+backward %.2f ms, barrier %.2f ms, %.1f samples/s; %s\n", who, median(w.step),
              median(w.compute), median(w.wait), 1000.0 * batch / median(w.step), w.sched.c_str());
  std::fflush(stdout);
}

int runOne(const Options& o, int seed, int cpu) {
  cohort::setComputeThreads(1);
  at::globalContext().setUserEnabledMkldnn(o.mkldnn);
  if (cpu >= 0) pinTo(cpu);
  Worker w = makeWorker(o.batch, seed);
  train(w, o.steps, nullptr, false);
  const std::string who = "worker " + std::to_string(seed);
  report(who.c_str(), w, o.batch);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (argc > 1) o.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--pin") {
      o.pin = true;
    } else if (a == "--no-mkldnn") {
      o.mkldnn = false;
    } else if (a == "--batch" && i + 1 < argc) {
      o.batch = std::atoi(argv[++i]);
    } else if (std::isdigit(static_cast<unsigned char>(a[0]))) {
      o.steps = std::atoi(a.c_str());
    } else {
      std::fprintf(stderr, "thread_pair: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (o.mode == "one") return runOne(o, 1, o.pin ? 0 : -1);
  if (o.mode == "procs") {
    std::vector<pid_t> children;
    for (int i = 0; i < 2; ++i) {
      const pid_t pid = fork();
      if (pid == 0) _exit(runOne(o, i + 1, o.pin ? i : -1));
      children.push_back(pid);
    }
    int failures = 0;
    for (pid_t pid : children) {
      int status = 0;
      waitpid(pid, &status, 0);
      failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return failures == 0 ? 0 : 1;
  }
  if (o.mode != "threads" && o.mode != "barrier" && o.mode != "spin") {
    std::fprintf(stderr, "thread_pair: unknown mode '%s' (one, threads, barrier, spin, procs)\n", o.mode.c_str());
    return 2;
  }
  cohort::setComputeThreads(1);
  at::globalContext().setUserEnabledMkldnn(o.mkldnn);
  // Models before the threads: torch's generator is per process.
  std::vector<Worker> workers;
  for (int i = 0; i < 2; ++i) workers.push_back(makeWorker(o.batch, i + 1));
  Barrier barrier(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      if (o.pin) pinTo(i);
      train(workers[size_t(i)], o.steps, o.mode == "threads" ? nullptr : &barrier, o.mode == "spin");
    });
  }
  for (auto& t : threads) t.join();
  double rate = 0;
  for (int i = 0; i < 2; ++i) {
    const std::string who = "thread " + std::to_string(i + 1);
    report(who.c_str(), workers[size_t(i)], o.batch);
    rate += 1000.0 * o.batch / median(workers[size_t(i)].step);
  }
  std::printf("sum: %.1f samples/s\n", rate);
  return 0;
}
