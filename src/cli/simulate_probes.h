// What `cohort simulate --calibrate` measures through cohort's own transports and with the cores
// shared, each in separate processes: this binary run again (`cohort simulate --probe gloo`, a
// hidden option), a real `cohort ps`, or a real job (`cohort launch ... cohort train`). Every wait on a child is bounded; a child that does not
// answer in time is killed and the calibration fails naming it.
#pragma once

#include "base/subprocess.h"

#include <cstddef>
#include <string>
#include <vector>

namespace cohort::cli {

// A child process running this binary with `args`, stdin and stdout piped to the parent, stderr
// shared. The destructor kills it if it is still running.
class Child {
 public:
  Child(std::string what, const std::vector<std::string>& args);

  int pid() const { return process_.pid(); }
  // The next line of its stdout; throws CommError naming `what` on end of file or after timeout.
  std::string readLine(double timeoutSeconds);
  void write(const std::string& text);
  // Waits for it to end (its stdout closing, then waitpid); throws CommError when it does not end
  // in time (it is then killed) or ends with a non-zero status.
  void wait(double timeoutSeconds);

 private:
  std::string what_;
  Subprocess process_;
  std::string buffer_;
};

// Gloo through Communicator::allgather between 2 processes on 127.0.0.1.
struct GlooProbe {
  double allgatherSeconds = 0;  // median time of one allgather of an 8-byte tensor
  double secondsPerByte = 0;    // (median time of a 1 MiB allgather - the above) / 1 MiB
};
GlooProbe probeGloo(double timeoutSeconds);
// The child side (`--probe gloo --probe-rank R --probe-port P`). Rank 0 is given port 0: it prints
// "port P" (the port its rendezvous store bound) as soon as it listens, then the JSON line.
int runGlooProbeChild(int rank, int port);

// gRPC to a `cohort ps` child on 127.0.0.1, with a call proof as the jobs use.
struct RpcProbe {
  double callSeconds = 0;           // median round trip of a Stats call
  double workerSecondsPerByte = 0;  // this process's CPU per float32 byte pushed (reply: the parameters)
  double shardSecondsPerByte = 0;   // the shard process's CPU per float32 byte pushed
};
RpcProbe probeRpc(size_t floats, double timeoutSeconds);

// A short real job of `ranks` ranks on this machine: `cohort launch -n RANKS -- cohort train
// --strategy allreduce --threads 1 ...` over 127.0.0.1. Returns the median compute_s of the
// chief's steps after the trainer's warm-up, per example: a rank's compute with the others on the
// same cores, its hooks and its communication thread beside it.
struct JobProbeOptions {
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  int batch = 64;
  int steps = 25;  // at least kJobWarmupSteps + 5
};
inline constexpr int kJobWarmupSteps = 5;  // the trainer's steady state starts after these
double probeJobCompute(const JobProbeOptions& options, int ranks, double timeoutSeconds);

// The median compute_s per example of a metrics file's step events after kJobWarmupSteps;
// throws CommError naming the file when it holds none.
double jobComputeSecondsPerExample(const std::string& metricsPath, int batch);


}  // namespace cohort::cli
