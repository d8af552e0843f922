// What `cohort simulate --calibrate` measures on this machine, and the file it is kept in (JSON,
// with a version: a file of another version is refused, naming the field).
#pragma once

#include "compress/codec.h"

#include <string>
#include <vector>

namespace cohort::sim {

inline constexpr int kCalibrationVersion = 3;

// The most float32 bytes of parameters a calibration (or --params) may give a model: 10^13, 2.5
// trillion parameters, above today's largest models. The simulator splits a model into buckets
// of --bucket-mb, a list as long as the model is large, so a figure above this (1e308 in a damaged
// or hostile file) would make it allocate without end.
inline constexpr double kMaxParameterBytes = 1e13;

// One codec's CPU cost per byte of the dense float32 buffer, and what it sends, measured on a real
// gradient of the calibrated model (so threshold's share is the model's own).
struct CodecCost {
  std::string codec;                 // as --codec spells it
  double encodeSecondsPerByte = 0;   // per dense float32 byte
  double decodeSecondsPerByte = 0;   // decode and add, per dense float32 byte
  double sentFraction = 1;           // message bytes / dense float32 bytes
};

// The compute of a real training job's ranks sharing this machine's cores: `ranks` processes of
// an allreduce job over 127.0.0.1, one compute thread each, all on the calibrating machine's
// sharedCores cores. The chief's median compute per step (its forward, backward beside the
// buckets' exchange, optimizer step; the wait for the exchange excluded), per example: what a
// rank of an emulated cluster computes at, with its hooks, its communication thread and the other
// ranks on the same cores.
struct JobCompute {
  int ranks = 2;
  double secondsPerExample = 0;
};

struct Calibration {
  int version = kCalibrationVersion;
  std::string machine;  // where it was measured
  std::string date;
  // The model, profiled with one compute thread.
  std::string model;
  int batch = 64;                        // the batch the compute was timed at
  double computeSecondsPerExample = 0;   // forward, backward and optimizer step
  // Short real jobs on this machine's sharedCores cores (--calibrate's last step; separate runs,
  // never the runs a prediction is checked against), at one or more rank counts.
  int sharedCores = 1;
  std::vector<JobCompute> jobCompute;
  double backwardFraction = 0.6;         // share of the step in backward (what buckets overlap)
  double parameterBytes = 0;             // float32 bytes of the trainable parameters
  double parameterCount = 0;
  int layers = 0;                        // top-level layers (a pipeline cut needs one per stage)
  double gradientDensity = 1;            // share of gradient entries that are nonzero (information)
  double stepTimeSigma = 0;              // sigma of log(step time) over the profiled steps
  // Loopback, real sockets between two processes.
  double latencySeconds = 0;             // a: half a small message's round trip
  double secondsPerByte = 0;             // b: a large transfer's seconds per byte (kernel CPU)
  double reduceSecondsPerByte = 0;       // g: summing two float32 buffers, per byte
  // Through cohort's own transports, over loopback between processes.
  // Gloo (Communicator::allgather, 2 ranks): the time of one allgather of an 8-byte tensor, and
  // the seconds per byte received beyond it (a 1 MiB tensor).
  double glooAllgatherSeconds = 0;
  double glooSecondsPerByte = 0;
  // gRPC to a real `cohort ps` process: the round trip of an empty call (Stats) with the call
  // proof; the CPU of the pushing process and of the shard process per float32 byte of a push
  // whose reply carries the parameters back (serialization, HTTP/2, the kernel's copies, apply).
  double rpcCallSeconds = 0;
  double rpcWorkerSecondsPerByte = 0;
  double shardSecondsPerByte = 0;
  std::vector<CodecCost> codecs;

  // One rank's compute per example at its own speed when `ranks` ranks share the sharedCores
  // cores (ranks > 1): the job measured at the rank count nearest to `ranks` (the smaller one on a
  // tie), divided by max(1, its ranks / sharedCores), the share of a core each of its ranks had.
  // The simulator slows it again by ranks / cores when more ranks than cores compute in step.
  double sharedComputeSecondsPerExample(int ranks) const;

  // The measured cost of `codec` (its entry's text parses to the same spec); throws
  // InvalidArgument naming the codec when it was not measured.
  const CodecCost& codec(const compress::CodecSpec& spec) const;
};

// Checks every field (positive where it must be); throws InvalidArgument naming the first bad one.
void validate(const Calibration& calibration, const std::string& where);

std::string toJson(const Calibration& calibration);
// Throws InvalidArgument naming the file and the field (a version other than
// kCalibrationVersion, a missing or non-numeric field, a negative cost).
Calibration fromJson(const std::string& text, const std::string& where);

Calibration loadCalibration(const std::string& path);
void saveCalibration(const Calibration& calibration, const std::string& path);

}  // namespace cohort::sim
