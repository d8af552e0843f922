// What library code needs from the process around it, passed in rather than taken from globals
// (LevelDB's Env is the model): where its messages for a person go, what time it is, and the
// points where a test may inject a fault. cohort's library writes nothing to stderr itself and
// reads no environment variable to misbehave: it calls the Env of the Job (JobOptions::env) or of
// the options it was given.
//
//   struct Quiet : cohort::Env {
//     void log(cohort::LogLevel, const std::string&) override {}
//   };
//   Quiet quiet;
//   auto job = cohort::Job::fromEnvironment({.env = &quiet});
//
// Every member may be called from any thread at once: an Env must be thread-safe, and must outlive
// everything it was given to.
#pragma once

#include <cohort/export.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace cohort {

enum class LogLevel { kInfo, kWarning, kError };

class COHORT_API Env {
 public:
  virtual ~Env();

  // One line for a person (no trailing newline): what the library chose, a warning, why it
  // retries. Not for errors it throws: those reach the caller as exceptions.
  virtual void log(LogLevel level, const std::string& line) = 0;

  // Now, on a clock that never goes back (the ps shard measures workers' silence on it).
  virtual std::chrono::steady_clock::time_point now();

  // A named point in library code that a test may turn into a fault: the code calls
  // fault("ps.shard.version", v) each time a shard reaches version v, and a test's Env may, say,
  // kill the process there. The points are listed where they are called (grep "->fault(" and
  // ".fault("). The default does nothing.
  virtual void fault(const char* point, int64_t value);

  // The process-wide default: each line to stderr in one write, as "cohort: LINE",
  // "cohort: warning: LINE" or "cohort: error: LINE"; the steady clock; no faults.
  static Env& standard();
};

// env, or Env::standard() when it is null: for options structs whose Env is optional.
inline Env& envOrStandard(Env* env) { return env != nullptr ? *env : Env::standard(); }

}  // namespace cohort
