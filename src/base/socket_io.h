// Blocking reads and writes of whole buffers on a TCP socket, every wait bounded: by a deadline
// for the transfer, by an idle limit (no byte moved for that long), and by a stop flag another
// thread sets. The socket may be blocking or not: every call polls before it reads or writes.
// Also a connect with a deadline. Torch-free; no threads.
#pragma once

#include <cohort/host_port.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <string>

namespace cohort {

using IoClock = std::chrono::steady_clock;

// kClosed: the peer closed the connection (a read found its end); kError: errno says what.
enum class IoStatus { kOk, kClosed, kTimeout, kStopped, kError };

// A few words for a message: "the connection was closed", "no answer in time", ...
const char* describe(IoStatus status);

// How long a transfer may wait. The defaults wait forever.
struct IoLimits {
  IoClock::time_point deadline = IoClock::time_point::max();  // for the whole transfer
  IoClock::duration idle = IoClock::duration::max();          // between two bytes moving
  const std::atomic<bool>* stop = nullptr;                     // looked at every kStopTick
};

// How often a transfer with a stop flag looks at it.
constexpr std::chrono::milliseconds kStopTick{100};

// Reads exactly n bytes; kClosed when the peer closed before all arrived.
IoStatus readFull(int fd, void* out, size_t n, const IoLimits& limits);
// Writes all n bytes (without SIGPIPE: a closed peer is kError, errno EPIPE).
IoStatus writeFull(int fd, const void* data, size_t n, const IoLimits& limits);

// Connects to `to` (each address its name resolves to, in turn) before `deadline`. Returns a
// non-blocking, close-on-exec socket with TCP_NODELAY set, or -1 with what failed in `error`.
int connectTo(const HostPort& to, IoClock::time_point deadline, std::string& error);

// TCP_NODELAY: small frames (handshakes, requests, acknowledgements) go out at once.
void setNoDelay(int fd);

}  // namespace cohort
