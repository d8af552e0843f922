// A gossip Peer's accepting side: the listening socket, and the acceptor thread that runs every
// incoming handshake itself (gossip/peer.h says what it bounds against strangers) and hands each
// authenticated stream to a reader thread (peer_inbox.cpp).
#include "gossip/peer_internal.h"

#include <cohort/error.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace cohort::gossip {

namespace {

// accept() failing for want of descriptors or memory: pause accepting this long, doubling.
constexpr auto kFirstAcceptPause = std::chrono::milliseconds(50);
constexpr auto kMaxAcceptPause = std::chrono::milliseconds(1000);

// A handshake frame to a socket that was just accepted (non-blocking): its buffer is empty, so
// a few dozen bytes go at once or the connection is already gone.
bool sendSmall(int fd, const std::vector<uint8_t>& frame) {
  const ssize_t w = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return w == ssize_t(frame.size());
}

std::string describe(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  }
  return HostPort{host, port}.str();
}

}  // namespace

void Peer::Impl::listen() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(options.bindHost.c_str(), "0", &hints, &found);
  COHORT_CHECK(rc == 0 && found != nullptr, CommError, "gossip: cannot resolve ", options.bindHost, ": ",
               ::gai_strerror(rc));
  listenFd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int one = 1;
  ::setsockopt(listenFd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok =
      listenFd >= 0 && ::bind(listenFd, found->ai_addr, found->ai_addrlen) == 0 && ::listen(listenFd, 64) == 0;
  const int error = errno;
  ::freeaddrinfo(found);
  if (!ok && listenFd >= 0) ::close(listenFd);
  COHORT_CHECK(ok, CommError, "gossip: cannot listen on ", options.bindHost, ": ", std::strerror(error));
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(listenFd, reinterpret_cast<sockaddr*>(&addr), &len);
  port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  acceptor = std::thread([this] { acceptLoop(); });
}

void Peer::Impl::refuse(int fd, const std::string& from, const std::string& why, std::optional<RefuseReason> reason) {
  if (reason) sendSmall(fd, refuseFrame(*reason));
  ::close(fd);
  {
    MutexLock lock(stateMutex);
    ++refused;
  }
  strangers.warn("gossip: refused a connection from " + from + ": " + why);
}

void Peer::Impl::acceptLoop() {
  std::vector<Handshake> pending;  // oldest first
  auto pause = kFirstAcceptPause;
  Clock::time_point pausedUntil{};
  std::vector<pollfd> fds;
  while (!stopping.load()) {
    try {
      const auto now = Clock::now();
      const bool accepting = now >= pausedUntil;
      fds.assign(1, pollfd{accepting ? listenFd : -1, POLLIN, 0});  // poll ignores a negative fd
      auto wake = now + std::chrono::milliseconds(kTickMs);
      if (!accepting) wake = std::min(wake, pausedUntil);
      for (const auto& h : pending) {
        fds.push_back(pollfd{h.fd, POLLIN, 0});
        wake = std::min(wake, h.deadline);
      }
      const auto waitMs = std::chrono::ceil<std::chrono::milliseconds>(std::max(wake - now, Clock::duration(0)));
      if (::poll(fds.data(), fds.size(), int(waitMs.count())) < 0 && errno != EINTR) {
        throw CommError(std::string("gossip: poll failed: ") + std::strerror(errno));
      }
      const auto later = Clock::now();
      // Backwards, so that erasing keeps the earlier entries in step with fds.
      for (size_t i = pending.size(); i-- > 0;) {
        Handshake& h = pending[i];
        bool over = false;
        if (fds[i + 1].revents != 0) {
          over = advance(h);
        } else if (later >= h.deadline) {
          refuse(h.fd, h.from, "no handshake within the time allowed", std::nullopt);
          over = true;
        }
        if (over) pending.erase(pending.begin() + std::ptrdiff_t(i));
      }
      if (accepting && (fds[0].revents & POLLIN) != 0) acceptOne(pending, pause, pausedUntil);
    } catch (const std::exception& e) {
      strangers.warn(std::string("gossip: the acceptor hit an error, it goes on: ") + e.what());
    } catch (...) {
      strangers.warn("gossip: the acceptor hit an unknown error, it goes on");
    }
  }
  for (const auto& h : pending) ::close(h.fd);
}

void Peer::Impl::acceptOne(std::vector<Handshake>& pending, std::chrono::milliseconds& pause,
                           Clock::time_point& pausedUntil) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int fd = ::accept4(listenFd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // The connection stays in the backlog; trying again at once would spin.
      strangers.warn(std::string("gossip: cannot accept a connection (") + std::strerror(errno) +
                     "); accepting again in " + std::to_string(pause.count()) + " ms");
      pausedUntil = Clock::now() + pause;
      pause = std::min(pause * 2, kMaxAcceptPause);
    }
    return;  // EAGAIN, ECONNABORTED, EINTR: nothing to do
  }
  pause = kFirstAcceptPause;
  if (int(pending.size()) >= kMaxPendingHandshakes) {
    Handshake& oldest = pending.front();
    refuse(oldest.fd, oldest.from, "too many handshakes at once, the oldest is dropped", RefuseReason::kBusy);
    pending.erase(pending.begin());
  }
  Handshake h;
  h.fd = fd;
  h.from = describe(addr);
  h.deadline = Clock::now() + secondsToDuration(std::min(options.timeoutSeconds, kHandshakeSeconds));
  h.nonce = freshNonce();
  if (!sendSmall(fd, challengeFrame({kProtocol, uint32_t(options.rank), uint32_t(options.worldSize), h.nonce}))) {
    ::close(fd);
    return;
  }
  pending.push_back(std::move(h));
}

bool Peer::Impl::advance(Handshake& h) {
  try {
    size_t want = kHeaderBytes;
    FrameHeader header;
    if (h.got >= kHeaderBytes) {
      header = parseHeader(std::span<const uint8_t, kHeaderBytes>(h.buffer.data(), kHeaderBytes), kMaxHandshakeBody);
      want += header.length;
    }
    const ssize_t r = ::recv(h.fd, h.buffer.data() + h.got, want - h.got, MSG_DONTWAIT);
    if (r == 0) {
      refuse(h.fd, h.from, "it closed the connection during the handshake", std::nullopt);
      return true;
    }
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      refuse(h.fd, h.from, std::string("reading its handshake failed: ") + std::strerror(errno), std::nullopt);
      return true;
    }
    h.got += size_t(r);
    if (h.got == kHeaderBytes) {
      header = parseHeader(std::span<const uint8_t, kHeaderBytes>(h.buffer.data(), kHeaderBytes), kMaxHandshakeBody);
      COHORT_CHECK(header.type == FrameType::kHello, InvalidArgument, "its first frame is ", frameName(header.type),
                   ", not HELLO");
      if (header.length > 0) return false;
    }
    if (h.got < kHeaderBytes) return false;
    header = parseHeader(std::span<const uint8_t, kHeaderBytes>(h.buffer.data(), kHeaderBytes), kMaxHandshakeBody);
    if (h.got < kHeaderBytes + header.length) return false;
    COHORT_CHECK(header.type == FrameType::kHello, InvalidArgument, "its first frame is ", frameName(header.type),
                 ", not HELLO");
    welcome(h, parseHello(std::span<const uint8_t>(h.buffer).subspan(kHeaderBytes, header.length)));
  } catch (const std::exception& e) {
    refuse(h.fd, h.from, std::string("a malformed handshake: ") + e.what(), std::nullopt);
  }
  return true;
}

void Peer::Impl::welcome(const Handshake& h, const Hello& hello) {
  const auto world = uint32_t(options.worldSize);
  // Unsigned: a rank of 0x80000000 must not pass as a negative int.
  if (hello.worldSize != world || hello.rank >= world || hello.rank == uint32_t(options.rank)) {
    refuse(h.fd, h.from,
           "HELLO from rank " + std::to_string(hello.rank) + " of " + std::to_string(hello.worldSize) +
               " does not fit this job of " + std::to_string(options.worldSize),
           RefuseReason::kBadRank);
    return;
  }
  const Transcript t{hello.rank, uint32_t(options.rank), world, h.nonce, hello.nonce};
  if (!sameProof(hello.proof, connectorProof(options.token, t))) {
    refuse(h.fd, h.from,
           "it did not prove the job's secret (every peer must have the job's --auth-token / COHORT_AUTH_TOKEN)",
           RefuseReason::kWrongSecret);
    return;
  }
  const int from = int(hello.rank);
  // Only this thread sets streamTaken, so it cannot change between here and the set below.
  bool taken = false;
  {
    MutexLock lock(stateMutex);
    taken = streamTaken[size_t(from)];
  }
  if (taken) {
    refuse(h.fd, h.from, "a second stream claiming rank " + std::to_string(from) + ", which has one",
           RefuseReason::kDuplicate);
    return;
  }
  if (!sendSmall(h.fd, acceptFrame(acceptorProof(options.token, t)))) {
    refuse(h.fd, h.from, "it went away before the handshake ended", std::nullopt);
    return;
  }
  {
    MutexLock lock(stateMutex);
    streamTaken[size_t(from)] = true;
    peers[size_t(from)].bytesReceived += int64_t(h.got);  // the HELLO
  }
  const Proof key = sessionKey(options.token, t);
  MutexLock lock(readersMutex);
  readers.emplace_back([this, fd = h.fd, from, key] { readLoop(fd, from, key); });
}

}  // namespace cohort::gossip
