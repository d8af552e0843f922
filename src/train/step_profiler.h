// --profile: the PyTorch profiler (Kineto) over a window of training steps. It writes the window's
// trace (Chrome's trace format: chrome://tracing, Perfetto, TensorBoard's profiler plugin) and
// says where the window's time went on each lane: each CPU thread that ran operators, and on a
// GPU each CUDA stream that ran kernels or copies (the compute stream, NCCL's, the copies of the
// compressed exchanges), as the time the lane was busy and what it ran most. The CPU operators
// recorded are the training thread's and autograd's threads' (a backward carries the profiler to
// them); cohort's own threads (the replicas', a codec's communication thread) are not enabled,
// and show in the trace only through their CUDA runtime calls.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

struct ProfileOptions {
  std::string path;  // the trace's file; empty: no profiling
  // The window: steps first..last, numbered from 1 as the step events are.
  int64_t first = 6;
  int64_t last = 10;
};

// "A:B" (1 <= A <= B) into opts.first and opts.last; InvalidArgument naming the form otherwise.
void parseProfileSteps(const std::string& text, ProfileOptions& opts);

// For `cohort train --profile`, before any thread starts (it sets an environment variable): where
// this LibTorch sees no CUDA device, Kineto's own log is kept to what it prints unconditionally
// (KINETO_LOG_LEVEL=5), since LibTorch's CUDA build otherwise logs "ERROR: ... gpuGetDeviceCount
// failed with code 35" (no driver) when the profiler starts on such a machine, an error of nothing
// the run does. A KINETO_LOG_LEVEL of the user's is left as it is.
void quietKinetoWithoutGpu();

// Where the window's time went, per lane.
struct ProfileSummary {
  struct Lane {
    std::string where;       // "cpu thread 1234" (the system's id, as in the trace), "cuda:0 stream 7"
    bool gpu = false;        // a device stream's lane
    double busySeconds = 0;  // the union of its events' intervals (nested operators count once)
    int64_t events = 0;
    std::string top;  // a GPU lane's kernel or copy with the most time; empty on the CPU
    double topSeconds = 0;
  };
  std::string tracePath;
  int64_t steps = 0;         // profiled
  double windowSeconds = 0;  // from the first profiled step's start to the last one's end
  std::vector<Lane> lanes;   // GPU lanes first, then CPU threads, each by busy time
};

class StepProfiler {
 public:
  // `rank`, `worldSize`: with more than one rank, each writes its own trace, the rank before the
  // path's extension ("trace.json" -> "trace.rank1.json").
  StepProfiler(ProfileOptions options, c10::Device device, int rank, int worldSize);
  ~StepProfiler();  // a profiler still running is stopped, its trace not written
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  bool enabled() const { return !options_.path.empty(); }
  // Whether the step numbered `step` is in the window (its time is not the steady state's).
  bool profiles(int64_t step) const { return enabled() && step >= options_.first && step <= options_.last; }
  // Before step `step`: starts the profiler at the first step of the run in the window (the
  // window's first, or a resumed run's first when it resumed inside the window).
  void beforeStep(int64_t step);
  // After step `step`: at the window's last, waits for every GPU, stops the profiler, writes the
  // trace and returns the summary. IoError when the trace cannot be written (the profiler is
  // stopped all the same).
  std::optional<ProfileSummary> afterStep(int64_t step);
  // The run ended inside the window: the same for the steps that ran.
  std::optional<ProfileSummary> finish();

  // Whether the profiler has run (the run had a step in the window).
  bool started() const { return started_; }

 private:
  std::optional<ProfileSummary> stop();

  ProfileOptions options_;
  c10::Device device_;
  std::string path_;
  bool running_ = false;
  bool started_ = false;
  int64_t profiled_ = 0;
  int64_t startNs_ = 0;
};

// A summary's lines for a person: one per lane, busiest first.
std::string describeProfile(const ProfileSummary& summary);

}  // namespace cohort
