#include "train/step_profiler.h"
#include "base/files.h"

#include <cohort/error.h>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <kineto/ActivityType.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <utility>

namespace cohort {

namespace profiler = torch::autograd::profiler;
namespace profiler_impl = torch::profiler::impl;

namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// "trace.json" -> "trace.rank1.json"; "trace" -> "trace.rank1".
std::string pathForRank(const std::string& path, int rank, int worldSize) {
  if (worldSize <= 1) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + p.extension().string())).string();
}

// The length of the union of [start, end) intervals.
double unionSeconds(std::vector<std::pair<uint64_t, uint64_t>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  uint64_t total = 0;
  uint64_t coveredTo = 0;
  for (const auto& [start, end] : intervals) {
    const uint64_t from = std::max(start, coveredTo);
    if (end > from) total += end - from;
    coveredTo = std::max(coveredTo, end);
  }
  return double(total) * 1e-9;
}

// Which lane an event's time belongs to: work a GPU stream ran (kernels, copies, sets), or work a
// CPU thread ran (operators, CUDA runtime and driver calls). Not lanes' work: a stream's waits
// (CUDA_SYNC, which would count the compute stream waiting for NCCL as busy), annotations that
// span other events, the profiler's own overhead, instants.
enum class LaneKind { kNone, kGpu, kCpu };

LaneKind laneKind(uint8_t activity) {
  using libkineto::ActivityType;
  switch (static_cast<ActivityType>(activity)) {
    case ActivityType::CONCURRENT_KERNEL:
    case ActivityType::GPU_MEMCPY:
    case ActivityType::GPU_MEMSET: return LaneKind::kGpu;
    case ActivityType::CPU_OP:
    case ActivityType::CUDA_RUNTIME:
    case ActivityType::CUDA_DRIVER: return LaneKind::kCpu;
    default: return LaneKind::kNone;
  }
}

struct LaneEvents {
  std::vector<std::pair<uint64_t, uint64_t>> intervals;
  std::map<std::string, uint64_t> byName;  // GPU lanes: each kernel's or copy's total
};

}  // namespace

void parseProfileSteps(const std::string& text, ProfileOptions& opts) {
  const auto colon = text.find(':');
  int64_t first = 0;
  int64_t last = 0;
  bool ok = colon != std::string::npos;
  if (ok) {
    try {
      size_t used = 0;
      first = std::stoll(text.substr(0, colon), &used);
      ok = used == colon;
      const std::string rest = text.substr(colon + 1);
      last = std::stoll(rest, &used);
      ok = ok && used == rest.size();
    } catch (const std::exception&) {
      ok = false;
    }
  }
  COHORT_CHECK(ok && first >= 1 && last >= first, InvalidArgument, "--profile-steps ", text,
               ": expected FIRST:LAST, the steps to profile numbered from 1 with FIRST <= LAST (for example 6:10, "
               "after the warm-up)");
  opts.first = first;
  opts.last = last;
}

void quietKinetoWithoutGpu() {
  if (std::getenv("KINETO_LOG_LEVEL") != nullptr || torch::cuda::is_available()) return;
  setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);  // above Kineto's ERROR (4)
}

StepProfiler::StepProfiler(ProfileOptions options, c10::Device device, int rank, int worldSize)
    : options_(std::move(options)), device_(device), path_(pathForRank(options_.path, rank, worldSize)) {
  if (!enabled()) return;
  // Refused now, not after the window's steps ran.
  COHORT_CHECK(!profiler::isProfilerEnabledInMainThread(), InvalidArgument,
               "--profile: the PyTorch profiler is already running in this process; profile one way at a time");
  // Kineto writes FILE.tmp and renames it to FILE, and only logs a rename that fails. The path as
  // given too: with several ranks, DIR would become DIR.rankN beside it, and DIR/ a hidden DIR/.rankN.
  checkOutputPath("--profile", options_.path);
  checkOutputPath("--profile", path_);
}

StepProfiler::~StepProfiler() {
  if (!running_) return;
  try {
    profiler::disableProfiler();
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): nothing to report it to
  }
}

void StepProfiler::beforeStep(int64_t step) {
  if (!enabled() || started_ || !profiles(step)) return;
  const profiler_impl::ProfilerConfig config(profiler_impl::ProfilerState::KINETO);
  std::set<profiler_impl::ActivityType> activities{profiler_impl::ActivityType::CPU};
  if (device_.is_cuda()) activities.insert(profiler_impl::ActivityType::CUDA);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  running_ = true;
  started_ = true;
  profiled_ = 0;
  startNs_ = nowNs();
}

std::optional<ProfileSummary> StepProfiler::afterStep(int64_t step) {
  if (!running_) return std::nullopt;
  ++profiled_;
  if (step < options_.last) return std::nullopt;
  return stop();
}

std::optional<ProfileSummary> StepProfiler::finish() {
  if (!running_) return std::nullopt;
  return stop();
}

std::optional<ProfileSummary> StepProfiler::stop() {
  // The window's kernels, on every GPU (replicas run on several), have run before the profiler
  // stops: a kernel still queued would be left out of the trace.
  if (device_.is_cuda()) {
    for (int64_t d = 0; d < int64_t(torch::cuda::device_count()); ++d) torch::cuda::synchronize(d);
  }
  const int64_t windowNs = nowNs() - startNs_;
  running_ = false;
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  COHORT_CHECK(result != nullptr, Error, "--profile: the profiler returned no result");
  // Kineto logs a trace it could not write (FILE.tmp not renamed: a directory not writable, a full
  // disk) and returns: an earlier run's trace is removed first, so that what is there after the
  // save is this window's.
  std::error_code error;
  std::filesystem::remove(path_, error);
  try {
    result->save(path_);
  } catch (const std::exception& e) {
    throw IoError("--profile: writing the trace " + path_ + " failed: " + e.what());
  }
  if (!std::filesystem::is_regular_file(path_, error)) {
    std::filesystem::remove(path_ + ".tmp", error);
    throw IoError("--profile: the profiler could not write the trace " + path_ +
                  " (its reason is logged above): check that its directory is writable and has room");
  }

  std::map<std::pair<int, std::string>, LaneEvents> lanes;  // (0 GPU / 1 CPU, name)
  for (const profiler::KinetoEvent& e : result->events()) {
    const LaneKind kind = laneKind(e.activityType());
    if (kind == LaneKind::kNone || e.endNs() <= e.startNs()) continue;
    // A thread waiting in cuda*Synchronize is not busy (stop()'s own wait among them).
    if (kind == LaneKind::kCpu && e.name().find("Synchronize") != std::string::npos) continue;
    const bool onGpu = kind == LaneKind::kGpu;
    std::string where;
    if (onGpu) {
      where = "cuda:" + std::to_string(e.deviceIndex()) + " stream " + std::to_string(e.deviceResourceId());
    } else {
      where = "cpu thread " + std::to_string(e.deviceResourceId());  // the trace's tid: the system's
    }
    LaneEvents& lane = lanes[{onGpu ? 0 : 1, where}];
    lane.intervals.emplace_back(e.startNs(), e.endNs());
    if (onGpu) lane.byName[e.name()] += e.endNs() - e.startNs();
  }
  ProfileSummary summary;
  summary.tracePath = path_;
  summary.steps = profiled_;
  summary.windowSeconds = double(windowNs) * 1e-9;
  for (auto& [key, events] : lanes) {
    ProfileSummary::Lane lane;
    lane.where = key.second;
    lane.gpu = key.first == 0;
    lane.events = int64_t(events.intervals.size());
    lane.busySeconds = unionSeconds(std::move(events.intervals));
    for (const auto& [name, ns] : events.byName) {
      if (double(ns) * 1e-9 > lane.topSeconds) {
        lane.top = name;
        lane.topSeconds = double(ns) * 1e-9;
      }
    }
    summary.lanes.push_back(std::move(lane));
  }
  std::stable_sort(summary.lanes.begin(), summary.lanes.end(), [](const auto& a, const auto& b) {
    if (a.gpu != b.gpu) return a.gpu;
    return a.busySeconds > b.busySeconds;
  });
  return summary;
}

std::string describeProfile(const ProfileSummary& summary) {
  std::ostringstream out;
  char line[512];
  std::snprintf(
      line, sizeof line, "profile of %lld step(s), %.3f ms each, written to %s", static_cast<long long>(summary.steps),
      summary.steps > 0 ? summary.windowSeconds * 1e3 / double(summary.steps) : 0.0, summary.tracePath.c_str());
  out << line;
  for (const auto& lane : summary.lanes) {
    const double perStep = summary.steps > 0 ? lane.busySeconds * 1e3 / double(summary.steps) : 0.0;
    const double share = summary.windowSeconds > 0 ? 100.0 * lane.busySeconds / summary.windowSeconds : 0.0;
    std::snprintf(line, sizeof line, "\n  %-24s busy %8.3f ms/step (%5.1f %%), %lld events", lane.where.c_str(),
                  perStep, share, static_cast<long long>(lane.events));
    out << line;
    if (!lane.top.empty()) {
      std::string top = lane.top;
      if (top.size() > 60) top.replace(57, std::string::npos, "...");
      std::snprintf(line, sizeof line, "; most: %s (%.3f ms/step)", top.c_str(),
                    summary.steps > 0 ? lane.topSeconds * 1e3 / double(summary.steps) : 0.0);
      out << line;
    }
  }
  return out.str();
}

}  // namespace cohort
