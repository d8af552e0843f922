#include "sim/probe.h"

#include <cohort/error.h>

#include "base/socket_io.h"
#include "base/stats.h"
#include "base/subprocess.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <vector>

namespace cohort::sim {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Reads or writes exactly n bytes before `deadline`.
bool transfer(int fd, char* data, size_t n, bool write, Clock::time_point deadline) {
  const IoLimits limits{.deadline = deadline};
  return (write ? writeFull(fd, data, n, limits) : readFull(fd, data, n, limits)) == IoStatus::kOk;
}

constexpr size_t kBulk = 16 << 20;
constexpr int kPings = 2000;
constexpr int kBulkRounds = 7;

// The peer: answers every ping with one byte, then for each bulk round reads kBulk bytes and
// answers with one byte.
[[noreturn]] void peer(int listener, double timeoutSeconds) {
  const Clock::time_point deadline = after(timeoutSeconds);
  pollfd p{listener, POLLIN, 0};
  if (::poll(&p, 1, int(timeoutSeconds * 1000)) <= 0) ::_exit(1);
  const int fd = ::accept(listener, nullptr, nullptr);
  if (fd < 0) ::_exit(1);
  setNoDelay(fd);
  char byte = 0;
  for (int i = 0; i < kPings; ++i) {
    if (!transfer(fd, &byte, 1, false, deadline) || !transfer(fd, &byte, 1, true, deadline)) ::_exit(1);
  }
  std::vector<char> buffer(kBulk);
  for (int i = 0; i < kBulkRounds; ++i) {
    if (!transfer(fd, buffer.data(), kBulk, false, deadline) || !transfer(fd, &byte, 1, true, deadline)) ::_exit(1);
  }
  ::close(fd);
  ::_exit(0);
}

}  // namespace

LinkProbe probeLoopback(double timeoutSeconds) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  COHORT_CHECK(listener >= 0, CommError, "calibration: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(listener);
    throw CommError(std::string("calibration: cannot listen on 127.0.0.1: ") + std::strerror(errno));
  }
  Subprocess child;
  try {
    child = Subprocess::fork([&]() -> int { peer(listener, timeoutSeconds); });
  } catch (const SubprocessError& e) {
    ::close(listener);
    throw CommError(std::string("calibration: ") + e.what());
  }
  ::close(listener);

  LinkProbe probe;
  const Clock::time_point deadline = after(timeoutSeconds);
  std::string error;
  const int fd = connectTo(HostPort{"127.0.0.1", ntohs(addr.sin_port)}, deadline, error);
  bool ok = fd >= 0;
  std::vector<double> rtt;
  char byte = 1;
  for (int i = 0; ok && i < kPings; ++i) {
    const auto t0 = Clock::now();
    ok = transfer(fd, &byte, 1, true, deadline) && transfer(fd, &byte, 1, false, deadline);
    rtt.push_back(seconds(t0, Clock::now()));
  }
  std::vector<char> buffer(kBulk, 1);
  std::vector<double> bulk;
  for (int i = 0; ok && i < kBulkRounds; ++i) {
    const auto t0 = Clock::now();
    ok = transfer(fd, buffer.data(), kBulk, true, deadline) && transfer(fd, &byte, 1, false, deadline);
    bulk.push_back(seconds(t0, Clock::now()));
  }
  if (fd >= 0) ::close(fd);
  if (!ok) child.signal(SIGKILL);
  COHORT_CHECK(child.wait().ok() && ok, CommError, "calibration: the loopback peer process did not answer within ",
               timeoutSeconds, " s");
  probe.latencySeconds = median(rtt) / 2;
  probe.secondsPerByte = std::max(0.0, (median(bulk) - 2 * probe.latencySeconds) / double(kBulk));
  return probe;
}

double probeReduce(double bytes) {
  const size_t n = size_t(bytes / sizeof(float));
  std::vector<float> out(n, 1.0f), in(n, 0.5f);
  std::vector<double> passes;
  for (int r = 0; r < 9; ++r) {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < n; ++i) out[i] += in[i];
    passes.push_back(seconds(t0, Clock::now()));
  }
  volatile float sink = out[n / 2];
  (void)sink;
  return median(passes) / double(n * sizeof(float));
}

double processCpuSeconds(int pid) {
  // A sum over the live threads' /proc/PID/task/*/schedstat (what the calibration read before)
  // fell when one of the shard's gRPC threads ended between two readings, and the calibration
  // failed with a negative cost; the process's CPU clock keeps the ended threads' time.
  clockid_t clock{};
  const int rc = ::clock_getcpuclockid(pid_t(pid), &clock);
  COHORT_CHECK(rc == 0, CommError, "calibration: cannot read the CPU clock of process ", pid, ": ", std::strerror(rc));
  timespec t{};
  COHORT_CHECK(::clock_gettime(clock, &t) == 0, CommError, "calibration: cannot read the CPU clock of process ", pid,
               ": ", std::strerror(errno));
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

}  // namespace cohort::sim
