// The outcome of a parameter-server call, transport-free. The codes are gRPC's, so the service
// passes them through unchanged and a fake transport reports exactly what a real one would.
#pragma once

#include <string>
#include <utility>

namespace cohort::ps {

enum class Code {
  kOk = 0,
  kCancelled = 1,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kInternal = 13,
  kUnavailable = 14,
  kUnauthenticated = 16,
};

struct Status {
  Code code = Code::kOk;
  std::string message;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
  static Status error(Code code, std::string message) { return {code, std::move(message)}; }
};

// "INVALID_ARGUMENT", ... as gRPC spells them.
const char* codeName(Code code);

}  // namespace cohort::ps
