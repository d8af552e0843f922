// What `cohort simulate --calibrate` measures on this machine, and the file it is kept in (JSON,
// with a version: a file of another version is refused, naming the field).
#pragma once

#include <string>
#include <vector>

namespace cohort::sim {

inline constexpr int kCalibrationVersion = 1;

// One codec's CPU cost per byte of the dense float32 buffer, and what it sends, measured on a real
// gradient of the calibrated model (so threshold's share is the model's own).
struct CodecCost {
  std::string codec;                 // as --codec spells it
  double encodeSecondsPerByte = 0;   // per dense float32 byte
  double decodeSecondsPerByte = 0;   // decode and add, per dense float32 byte
  double sentFraction = 1;           // message bytes / dense float32 bytes
};

struct Calibration {
  int version = kCalibrationVersion;
  std::string machine;  // where it was measured
  std::string date;
  // The model, profiled with one compute thread.
  std::string model;
  int batch = 64;                        // the batch the compute was timed at
  double computeSecondsPerExample = 0;   // forward, backward and optimizer step
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
  double shardSecondsPerByte = 0;        // a shard's CPU per pushed byte (decode, apply, reply)
  std::vector<CodecCost> codecs;

  // The measured cost of `codec`; throws InvalidArgument naming the codec when it was not measured.
  const CodecCost& codec(const std::string& name) const;
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
