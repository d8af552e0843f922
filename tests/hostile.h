// Tools for tests that play strangers on a listening port or in a file (torch-free): raw TCP
// connections, the process's open descriptors, its peak memory and a cap on its address space.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <thread>

namespace cohort::test {

inline int openDescriptors() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// What each open descriptor is ("3 socket:[4711]", "5 anon_inode:[eventfd]", "7 /tmp/x"), for a
// failure message to say what was left open.
inline std::string describeDescriptors() {
  std::string text;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    text += entry.path().filename().string() + " " + std::filesystem::read_symlink(entry.path(), error).string() + "\n";
  }
  return text;
}

// How many of the open descriptors are sockets: a connection a server failed to close is one,
// where a library's own descriptors opened on first use (gRPC's eventfds and epoll sets) are not.
inline int openSockets() {
  int n = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    n += std::filesystem::read_symlink(entry.path(), error).string().starts_with("socket:") ? 1 : 0;
  }
  return n;
}

// Waits until `count()` (openDescriptors, openSockets) is back to `level` (the server closed its
// ends of the test's connections) and returns the last count; after `limit`, the count it is stuck at.
//
// Why a poll, and why it is correct. The descriptors are closed by the server's own threads some
// time after the client's end closes, and nothing in Linux signals a change of a process's
// descriptor table (no inotify on /proc/self/fd, no pidfd event for it), so there is no event to
// wait on. This is not a sleep as synchronization: it never goes on because time has passed. It
// returns early only when the condition it re-reads holds, and the deadline only turns "not yet"
// into a failure the test reports with the count; a slow machine makes it wait longer, never pass
// wrongly. The pause between reads starts at 1 ms and doubles up to 50 ms, so a quick close is
// seen quickly and a slow one does not spin.
template <typename Count>
int waitForCount(Count count, int level, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto pause = std::chrono::milliseconds(1);
  int n = count();
  while (n != level) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
    n = count();
  }
  return n;
}
inline int waitForDescriptors(int level, std::chrono::seconds limit) {
  return waitForCount(openDescriptors, level, limit);
}
inline int waitForSockets(int level, std::chrono::seconds limit) { return waitForCount(openSockets, level, limit); }

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); -1 when it is missing.
inline int64_t statusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// Resets VmHWM (the peak resident size) to the current size; false when the kernel refuses.
inline bool resetPeakMemory() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

// Caps the process's address space (RLIMIT_AS) at its size now plus `extra` bytes while it lives,
// so that code trying a huge allocation fails at once with std::bad_alloc instead of taking the
// machine's memory; the limit it had comes back at the end. For single-threaded stretches of a
// test only: other threads' allocations would meet the cap too.
class AddressSpaceCap {
 public:
  explicit AddressSpaceCap(int64_t extra) {
    const int64_t size = statusBytes("VmSize");
    ok_ = size > 0 && ::getrlimit(RLIMIT_AS, &old_) == 0;
    rlimit capped = old_;
    capped.rlim_cur = rlim_t(size + extra);
    if (old_.rlim_cur != RLIM_INFINITY) capped.rlim_cur = std::min(capped.rlim_cur, old_.rlim_cur);
    ok_ = ok_ && ::setrlimit(RLIMIT_AS, &capped) == 0;
  }
  ~AddressSpaceCap() {
    if (ok_) ::setrlimit(RLIMIT_AS, &old_);
  }
  AddressSpaceCap(const AddressSpaceCap&) = delete;
  AddressSpaceCap& operator=(const AddressSpaceCap&) = delete;
  bool ok() const { return ok_; }

 private:
  rlimit old_{};
  bool ok_ = false;
};

// A raw TCP connection to 127.0.0.1:port.
class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawConnection() { close(); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  void send(std::span<const uint8_t> bytes) { (void)::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL); }

  // Fills `out` within `limit`; false at EOF, on a reset, or when not all of it came.
  bool read(std::span<uint8_t> out, std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    size_t got = 0;
    while (got < out.size()) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd pfd{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&pfd, 1, int(left.count())) <= 0) return false;
      const ssize_t r = ::recv(fd_, out.data() + got, out.size() - got, 0);
      if (r <= 0) return false;
      got += size_t(r);
    }
    return true;
  }

  // True when the other end closed the connection (EOF or reset) within `limit`; whatever it
  // sent before is skipped.
  bool closedByPeer(std::chrono::seconds limit = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    uint8_t buffer[4096];
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd pfd{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&pfd, 1, int(left.count())) <= 0) return false;
      if (::recv(fd_, buffer, sizeof(buffer), 0) <= 0) return true;
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

}  // namespace cohort::test
