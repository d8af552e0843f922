// The standard Env: stderr, the steady clock, no faults.
#include <cohort/env.h>

#include "base/files.h"

#include <unistd.h>

namespace cohort {

namespace {

class StandardEnv final : public Env {
 public:
  void log(LogLevel level, const std::string& line) override {
    std::string text = "cohort: ";
    if (level == LogLevel::kWarning) text += "warning: ";
    if (level == LogLevel::kError) text += "error: ";
    text += line;
    text += '\n';
    // One write per line, so that lines from threads and processes sharing the terminal do not
    // interleave within a line. A short write, EINTR and a full non-blocking pipe are retried;
    // stderr closed: a log line is not worth failing over.
    writeToStream(STDERR_FILENO, text);
  }
};

}  // namespace

Env::~Env() = default;

std::chrono::steady_clock::time_point Env::now() { return std::chrono::steady_clock::now(); }

void Env::fault(const char*, int64_t) {}

Env& Env::standard() {
  static StandardEnv* env = new StandardEnv;  // never destroyed: threads may log during exit
  return *env;
}

}  // namespace cohort
