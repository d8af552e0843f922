#include "base/launcher_channel.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <string>

namespace cohort::launcher {
namespace {

// The pipe's write end, or -1 when this process was not started by `cohort launch`.
int channel() {
  static const int fd = [] {
    const char* text = std::getenv("COHORT_LAUNCH_FD");
    if (text == nullptr) return -1;
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || value <= STDERR_FILENO || value >= 65536) return -1;
    // The launcher's is a pipe. A variable inherited without its descriptor (a wrapper that closed
    // it) may name one this process opened since, a file or a socket: nothing is written there.
    struct stat st {};
    if (::fstat(int(value), &st) != 0 || !S_ISFIFO(st.st_mode)) return -1;
    return int(value);
  }();
  return fd;
}

// One write of at most PIPE_BUF bytes: lines from several threads never interleave.
void tell(std::string line) {
  const int fd = channel();
  if (fd < 0) return;
  for (char& c : line) {
    if (c == '\n') c = ' ';
  }
  if (line.size() > 511) line.resize(511);
  line.push_back('\n');
  ssize_t n = 0;
  do {
    n = ::write(fd, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
}

std::atomic<bool> portTold{false};

}  // namespace

void tellFaultPolicy(std::string_view policy) { tell("fault-policy " + std::string(policy)); }
void tellShardCheckpoints() { tell("shard-checkpoints"); }

void tellShardHasCheckpoint() {
  static std::atomic<bool> told{false};
  if (!told.exchange(true)) tell("shard-has-checkpoint");
}
void tellError(std::string_view message) { tell("error " + std::string(message)); }
void tellFinished() { tell("finished"); }

void tellPort(int port) {
  if (!portTold.exchange(true)) tell("port " + std::to_string(port));
}

void tellNoPort() {
  if (!portTold.exchange(true)) tell("port none");
}

}  // namespace cohort::launcher
