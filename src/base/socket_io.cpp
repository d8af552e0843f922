#include "base/socket_io.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace cohort {

namespace {

// `from + span`, saturating at the end of time (IoLimits' defaults are the largest values).
IoClock::time_point after(IoClock::time_point from, IoClock::duration span) {
  return span >= IoClock::time_point::max() - from ? IoClock::time_point::max() : from + span;
}

// What poll may wait for a limit at `end`: rounded up, so that a wait does not end just before it
// and spin; at most kStopTick when a stop flag is to be looked at.
int pollMs(IoClock::time_point end, IoClock::time_point now, bool ticks) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(end - now).count();
  const int64_t cap = ticks ? kStopTick.count() : int64_t(1) << 30;
  return int(std::clamp<int64_t>(left, 0, cap));
}

IoStatus transfer(int fd, uint8_t* p, size_t n, bool write, const IoLimits& limits) {
  IoClock::time_point end = std::min(limits.deadline, after(IoClock::now(), limits.idle));
  while (n > 0) {
    if (limits.stop != nullptr && limits.stop->load()) return IoStatus::kStopped;
    pollfd pfd{fd, short(write ? POLLOUT : POLLIN), 0};
    const int ready = ::poll(&pfd, 1, pollMs(end, IoClock::now(), limits.stop != nullptr));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return IoStatus::kError;
    }
    if (ready == 0) {
      if (IoClock::now() >= end) return IoStatus::kTimeout;
      continue;  // a stop tick
    }
    const ssize_t moved =
        write ? ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recv(fd, p, n, MSG_DONTWAIT);
    if (moved < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return IoStatus::kError;
    }
    if (moved == 0) return IoStatus::kClosed;  // a read at the end of the stream
    p += moved;
    n -= size_t(moved);
    end = std::min(limits.deadline, after(IoClock::now(), limits.idle));
  }
  return IoStatus::kOk;
}

// Ends a non-blocking connect in progress: 0, or -1 with errno set.
int finishConnect(int fd, IoClock::time_point deadline) {
  for (;;) {
    pollfd pfd{fd, POLLOUT, 0};
    const int ready = ::poll(&pfd, 1, pollMs(deadline, IoClock::now(), false));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return -1;
    if (ready == 0) {
      if (IoClock::now() < deadline) continue;
      errno = ETIMEDOUT;
      return -1;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return -1;
    errno = err;
    return err == 0 ? 0 : -1;
  }
}

}  // namespace

const char* describe(IoStatus status) {
  switch (status) {
    case IoStatus::kOk: return "ok";
    case IoStatus::kClosed: return "the connection was closed";
    case IoStatus::kTimeout: return "no answer in time";
    case IoStatus::kStopped: return "stopped";
    case IoStatus::kError: return "a socket error";
  }
  return "?";
}

IoStatus readFull(int fd, void* out, size_t n, const IoLimits& limits) {
  return transfer(fd, static_cast<uint8_t*>(out), n, false, limits);
}

IoStatus writeFull(int fd, const void* data, size_t n, const IoLimits& limits) {
  // send() only reads the buffer; transfer() takes one pointer type for both directions.
  return transfer(fd, const_cast<uint8_t*>(static_cast<const uint8_t*>(data)), n, true, limits);
}

void setNoDelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int connectTo(const HostPort& to, IoClock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(to.port);
  if (const int rc = ::getaddrinfo(to.host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    error = ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) rc = finishConnect(fd, deadline);
    if (rc != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd >= 0) setNoDelay(fd);
  return fd;
}

}  // namespace cohort
