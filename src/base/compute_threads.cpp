#include "base/compute_threads.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cohort {

namespace {

template <typename Fn>
Fn lookUp(const char* name) {
  return reinterpret_cast<Fn>(::dlsym(RTLD_DEFAULT, name));
}

struct CpuTimes {
  uint64_t idle = 0;   // idle and iowait
  uint64_t total = 0;  // user, nice, system, idle, iowait, irq, softirq, steal
};

// The CPUs this process may run on; nullopt where the kernel does not say.
std::optional<cpu_set_t> affinityMask() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof(mask), &mask) != 0) return std::nullopt;
  return mask;
}

// The "cpuN" lines of /proc/stat, summed over the CPUs of `mask` (every CPU without one).
std::optional<CpuTimes> readCpuTimes(const std::optional<cpu_set_t>& mask) {
  std::ifstream in("/proc/stat");
  if (!in) return std::nullopt;
  CpuTimes times;
  bool any = false;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || line[3] < '0' || line[3] > '9') continue;
    std::istringstream fields(line.substr(3));
    int cpu = -1;
    fields >> cpu;
    if (cpu < 0 || (mask && cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &*mask))) continue;
    uint64_t value[8] = {};
    for (uint64_t& v : value) fields >> v;
    if (!fields) continue;
    times.idle += value[3] + value[4];
    for (uint64_t v : value) times.total += v;
    any = true;
  }
  if (!any) return std::nullopt;
  return times;
}

int allowedCores(const std::optional<cpu_set_t>& mask) {
  if (mask) return std::max(1, CPU_COUNT(&*mask));
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

int allowedCores() { return allowedCores(affinityMask()); }

}  // namespace

std::optional<double> idleCores(std::chrono::milliseconds window) {
  const std::optional<cpu_set_t> mask = affinityMask();
  const std::optional<CpuTimes> before = readCpuTimes(mask);
  std::this_thread::sleep_for(window);
  const std::optional<CpuTimes> after = readCpuTimes(mask);
  if (!before || !after || after->total <= before->total) return std::nullopt;
  const double idleShare = double(after->idle - before->idle) / double(after->total - before->total);
  return idleShare * allowedCores(mask);
}

namespace {

// The idle cores as a whole number (at least 1), or every allowed core where it cannot be told.
int freeCores(int cores) {
  const std::optional<double> idle = idleCores(std::chrono::milliseconds(100));
  return idle ? std::clamp(int(std::floor(*idle + 0.25)), 1, cores) : cores;
}

}  // namespace

int defaultComputeThreads(int processes) {
  processes = std::max(1, processes);
  return std::max(1, freeCores(allowedCores()) / processes);
}

int defaultComputeThreadsBeside(int processes) {
  processes = std::max(1, processes);
  const int cores = allowedCores();
  return std::max(1, std::min(cores / processes, freeCores(cores)));
}

void setOpenMpThreads(int threads) {
  if (auto fn = lookUp<void (*)(int)>("omp_set_num_threads")) fn(threads);
}

int openBlasThreads() {
  auto fn = lookUp<int (*)()>("openblas_get_num_threads");
  return fn ? fn() : 0;
}

void setOpenBlasThreads(int threads) {
  if (auto fn = lookUp<void (*)(int)>("openblas_set_num_threads")) fn(threads);
}

std::optional<int> parseOmpNumThreads(const char* text) {
  if (text == nullptr) return std::nullopt;
  const char* p = text;
  while (*p == ' ' || *p == '\t') ++p;
  int64_t count = 0;
  const char* digits = p;
  while (*p >= '0' && *p <= '9' && count <= 65536) count = count * 10 + (*p++ - '0');
  if (p == digits || count < 1 || count > 65536) return std::nullopt;
  while (*p == ' ' || *p == '\t') ++p;
  if (*p != '\0' && *p != ',') return std::nullopt;
  return int(count);
}

std::optional<int> ompNumThreadsFromEnvironment() { return parseOmpNumThreads(std::getenv("OMP_NUM_THREADS")); }

}  // namespace cohort
