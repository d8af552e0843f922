#include "sim/calibration.h"
#include "base/files.h"

#include <cohort/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>

namespace cohort::sim {

using nlohmann::json;

const CodecCost& Calibration::codec(const compress::CodecSpec& spec) const {
  for (const CodecCost& c : codecs) {
    if (compress::CodecSpec::parse(c.codec) == spec) return c;  // validate() parsed each one
  }
  const std::string name = spec.text();
  std::string known;
  for (const CodecCost& c : codecs) known += (known.empty() ? "" : ", ") + c.codec;
  throw InvalidArgument("--codec " + name + ": the calibration has no measurement of it (measured: " + known +
                        "); run cohort simulate --calibrate --codecs ...,"  + name);
}

double Calibration::sharedComputeSecondsPerExample(int ranks) const {
  if (jobCompute.empty()) throw InvalidArgument("the calibration has no job_compute; run cohort simulate --calibrate again");
  const JobCompute* nearest = &jobCompute.front();
  for (const JobCompute& j : jobCompute) {
    const int d = std::abs(j.ranks - ranks), best = std::abs(nearest->ranks - ranks);
    if (d < best || (d == best && j.ranks < nearest->ranks)) nearest = &j;
  }
  return nearest->secondsPerExample / std::max(1.0, double(nearest->ranks) / sharedCores);
}

namespace {

void requirePositive(double value, const char* field, const std::string& where) {
  if (!(value > 0)) throw InvalidArgument(where + ": field \"" + field + "\" must be > 0, got " + std::to_string(value));
}

void requireNonNegative(double value, const char* field, const std::string& where) {
  if (!(value >= 0)) throw InvalidArgument(where + ": field \"" + field + "\" must be >= 0, got " + std::to_string(value));
}

void requireAtMost(double value, double limit, const char* field, const std::string& where) {
  if (!(value <= limit)) {
    throw InvalidArgument(detail::concat(where, ": field \"", field, "\" is ", value, ", above the limit of ", limit,
                                         ": not a calibration cohort wrote; run cohort simulate --calibrate again"));
  }
}

template <typename T>
T field(const json& j, const char* name, const std::string& where) {
  if (!j.contains(name)) throw InvalidArgument(where + ": field \"" + std::string(name) + "\" is missing");
  try {
    return j.at(name).get<T>();
  } catch (const json::exception&) {
    throw InvalidArgument(where + ": field \"" + std::string(name) + "\" has the wrong type");
  }
}

}  // namespace

void validate(const Calibration& c, const std::string& where) {
  if (c.version != kCalibrationVersion) {
    throw InvalidArgument(where + ": field \"version\" is " + std::to_string(c.version) + ", this cohort reads version " +
                          std::to_string(kCalibrationVersion) + "; run cohort simulate --calibrate again");
  }
  requirePositive(c.batch, "batch", where);
  requirePositive(c.computeSecondsPerExample, "compute_seconds_per_example", where);
  requirePositive(c.sharedCores, "shared_cores", where);
  if (c.jobCompute.empty()) throw InvalidArgument(where + ": field \"job_compute\" is empty");
  for (size_t i = 0; i < c.jobCompute.size(); ++i) {
    const JobCompute& j = c.jobCompute[i];
    if (j.ranks < 2) {
      throw InvalidArgument(where + ": field \"job_compute[].ranks\" must be >= 2, got " + std::to_string(j.ranks));
    }
    requirePositive(j.secondsPerExample, "job_compute[].seconds_per_example", where);
    for (size_t k = 0; k < i; ++k) {
      if (c.jobCompute[k].ranks == j.ranks) {
        throw InvalidArgument(where + ": field \"job_compute\" lists ranks " + std::to_string(j.ranks) + " twice");
      }
    }
  }
  if (!(c.backwardFraction >= 0 && c.backwardFraction <= 1)) {
    throw InvalidArgument(where + ": field \"backward_fraction\" must be in [0, 1]");
  }
  requirePositive(c.parameterBytes, "parameter_bytes", where);
  requireAtMost(c.parameterBytes, kMaxParameterBytes, "parameter_bytes", where);
  requirePositive(c.parameterCount, "parameter_count", where);
  requireAtMost(c.parameterCount, kMaxParameterBytes / 4, "parameter_count", where);
  requirePositive(c.layers, "layers", where);
  if (!(c.gradientDensity > 0 && c.gradientDensity <= 1)) {
    throw InvalidArgument(where + ": field \"gradient_density\" must be in (0, 1]");
  }
  requireNonNegative(c.stepTimeSigma, "step_time_sigma", where);
  requireNonNegative(c.latencySeconds, "latency_seconds", where);
  requireNonNegative(c.secondsPerByte, "seconds_per_byte", where);
  requireNonNegative(c.reduceSecondsPerByte, "reduce_seconds_per_byte", where);
  requireNonNegative(c.glooAllgatherSeconds, "gloo_allgather_seconds", where);
  requireNonNegative(c.glooSecondsPerByte, "gloo_seconds_per_byte", where);
  requireNonNegative(c.rpcCallSeconds, "rpc_call_seconds", where);
  requireNonNegative(c.rpcWorkerSecondsPerByte, "rpc_worker_seconds_per_byte", where);
  requireNonNegative(c.shardSecondsPerByte, "shard_seconds_per_byte", where);
  for (const CodecCost& k : c.codecs) {
    try {
      compress::CodecSpec::parse(k.codec);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(where + ": field \"codecs[].codec\" is not a codec: " + e.what());
    }
    requireNonNegative(k.encodeSecondsPerByte, "codecs[].encode_seconds_per_byte", where);
    requireNonNegative(k.decodeSecondsPerByte, "codecs[].decode_seconds_per_byte", where);
    requirePositive(k.sentFraction, "codecs[].sent_fraction", where);
  }
}

std::string toJson(const Calibration& c) {
  json codecs = json::array();
  for (const CodecCost& k : c.codecs) {
    codecs.push_back({{"codec", k.codec},
                      {"encode_seconds_per_byte", k.encodeSecondsPerByte},
                      {"decode_seconds_per_byte", k.decodeSecondsPerByte},
                      {"sent_fraction", k.sentFraction}});
  }
  json jobs = json::array();
  for (const JobCompute& k : c.jobCompute) jobs.push_back({{"ranks", k.ranks}, {"seconds_per_example", k.secondsPerExample}});
  json j = {{"version", c.version},
            {"machine", c.machine},
            {"date", c.date},
            {"model", c.model},
            {"batch", c.batch},
            {"compute_seconds_per_example", c.computeSecondsPerExample},
            {"shared_cores", c.sharedCores},
            {"job_compute", jobs},
            {"backward_fraction", c.backwardFraction},
            {"parameter_bytes", c.parameterBytes},
            {"parameter_count", c.parameterCount},
            {"layers", c.layers},
            {"gradient_density", c.gradientDensity},
            {"step_time_sigma", c.stepTimeSigma},
            {"latency_seconds", c.latencySeconds},
            {"seconds_per_byte", c.secondsPerByte},
            {"reduce_seconds_per_byte", c.reduceSecondsPerByte},
            {"gloo_allgather_seconds", c.glooAllgatherSeconds},
            {"gloo_seconds_per_byte", c.glooSecondsPerByte},
            {"rpc_call_seconds", c.rpcCallSeconds},
            {"rpc_worker_seconds_per_byte", c.rpcWorkerSecondsPerByte},
            {"shard_seconds_per_byte", c.shardSecondsPerByte},
            {"codecs", codecs}};
  return j.dump(2) + "\n";
}

Calibration fromJson(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw InvalidArgument(where + ": not JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object()) throw InvalidArgument(where + ": not a calibration (expected a JSON object)");
  Calibration c;
  c.version = field<int>(j, "version", where);
  if (c.version != kCalibrationVersion) validate(c, where);  // names the version before anything else
  c.machine = field<std::string>(j, "machine", where);
  c.date = field<std::string>(j, "date", where);
  c.model = field<std::string>(j, "model", where);
  c.batch = field<int>(j, "batch", where);
  c.computeSecondsPerExample = field<double>(j, "compute_seconds_per_example", where);
  c.sharedCores = field<int>(j, "shared_cores", where);
  for (const json& k : field<json>(j, "job_compute", where)) {
    const std::string w = where + " job_compute[]";
    c.jobCompute.push_back({.ranks = field<int>(k, "ranks", w), .secondsPerExample = field<double>(k, "seconds_per_example", w)});
  }
  c.backwardFraction = field<double>(j, "backward_fraction", where);
  c.parameterBytes = field<double>(j, "parameter_bytes", where);
  c.parameterCount = field<double>(j, "parameter_count", where);
  c.layers = field<int>(j, "layers", where);
  c.gradientDensity = field<double>(j, "gradient_density", where);
  c.stepTimeSigma = field<double>(j, "step_time_sigma", where);
  c.latencySeconds = field<double>(j, "latency_seconds", where);
  c.secondsPerByte = field<double>(j, "seconds_per_byte", where);
  c.reduceSecondsPerByte = field<double>(j, "reduce_seconds_per_byte", where);
  c.glooAllgatherSeconds = field<double>(j, "gloo_allgather_seconds", where);
  c.glooSecondsPerByte = field<double>(j, "gloo_seconds_per_byte", where);
  c.rpcCallSeconds = field<double>(j, "rpc_call_seconds", where);
  c.rpcWorkerSecondsPerByte = field<double>(j, "rpc_worker_seconds_per_byte", where);
  c.shardSecondsPerByte = field<double>(j, "shard_seconds_per_byte", where);
  for (const json& k : field<json>(j, "codecs", where)) {
    const std::string w = where + " codecs[]";
    c.codecs.push_back({.codec = field<std::string>(k, "codec", w),
                        .encodeSecondsPerByte = field<double>(k, "encode_seconds_per_byte", w),
                        .decodeSecondsPerByte = field<double>(k, "decode_seconds_per_byte", w),
                        .sentFraction = field<double>(k, "sent_fraction", w)});
  }
  validate(c, where);
  return c;
}

Calibration loadCalibration(const std::string& path) {
  return fromJson(readNamedFile("--calibration", path, "run cohort simulate --calibrate first"), path);
}

void saveCalibration(const Calibration& calibration, const std::string& path) {
  validate(calibration, "the measured calibration");
  replaceFileWithText(path, toJson(calibration));
}

}  // namespace cohort::sim
