// Connections' accept loop (service_connections.h): binding the port, accepting, handing to
// gRPC, and the record of each connection it keeps (proven, evicted, reaped once gRPC closed it).
#include "ps/service_connections.h"
#include "base/host_port.h"

#include <cohort/error.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace cohort::ps::service_internal {

Connections::Connections(const std::string& address, std::shared_ptr<Refusals> refusals, int maxConnections)
    : refusals_(std::move(refusals)) {
  if (maxConnections > 0) {
    maxConnections_ = maxConnections;
    limitSource_ = "its ServerOptions::maxConnections";
  } else {
    rlimit files{};
    ::getrlimit(RLIMIT_NOFILE, &files);
    // The other half: gRPC's own, checkpoints, the log. RLIM_INFINITY: bounded all the same.
    maxConnections_ = int(std::clamp<rlim_t>(files.rlim_cur / 2, kMaxUnproven + 16, rlim_t(1) << 24));
    limitSource_ = "half its open-file limit of " +
                   (files.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(files.rlim_cur));
  }
  try {
    listen(address);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    COHORT_CHECK(wake_ >= 0, Error, "eventfd: ", std::strerror(errno));
  } catch (...) {
    closeListening();
    throw;
  }
}

Connections::~Connections() {
  stop();
  closeListening();
  if (wake_ >= 0) ::close(wake_);
}

void Connections::start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor) {
  acceptor_ = std::move(acceptor);
  thread_ = std::thread([this] { acceptLoop(); });
}

void Connections::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t written = ::write(wake_, &one, sizeof(one));
  thread_.join();
}

std::string Connections::raiseLimitHint(int64_t workers) const {
  return "raise the shard process's open-file limit (`ulimit -n`; LimitNOFILE= under systemd, --ulimit nofile= "
         "under docker) to at least " +
         std::to_string(2 * (workers + kMaxUnproven + 16)) + " (twice the workers and " +
         std::to_string(kMaxUnproven + 16) + " for callers proving the secret and restarts)";
}

void Connections::prove(const std::string& peer) {
  const std::string key = peerKey(peer);
  MutexLock lock(mu_);
  const auto found = byPeer_.find(key);
  if (found == byPeer_.end()) return;
  if (auto c = open_.find(found->second); c != open_.end()) c->second.proven = true;
}

Connections::Counts Connections::counts() {
  MutexLock lock(mu_);
  reapLocked();
  Counts out = counts_;
  out.open = int(open_.size());
  out.unproven = 0;
  for (const auto& [id, c] : open_) out.unproven += !c.proven && !c.evicted;
  return out;
}

void Connections::cutAll() {
  MutexLock lock(mu_);
  reapLocked();  // every descriptor left still holds its socket
  for (const auto& [id, c] : open_) ::shutdown(c.fd, SHUT_RDWR);
}

void Connections::setPort(sockaddr_storage& a, int port) {
  if (a.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(a).sin_port = htons(uint16_t(port));
  if (a.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(a).sin6_port = htons(uint16_t(port));
}

int Connections::portOf(const sockaddr_storage& a) {
  return ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(a).sin6_port
                                       : reinterpret_cast<const sockaddr_in&>(a).sin_port);
}

std::string Connections::peerKey(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    if (IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) {
      sockaddr_storage v4{};
      auto& in = reinterpret_cast<sockaddr_in&>(v4);
      in.sin_family = AF_INET;
      std::memcpy(&in.sin_addr, v6.sin6_addr.s6_addr + 12, 4);
      in.sin_port = v6.sin6_port;
      return peerKey(v4);
    }
  }
  return addressText(reinterpret_cast<const sockaddr*>(&a)) + " " + std::to_string(portOf(a));
}

std::string Connections::peerKey(std::string peer) {
  for (const char* escaped : {"%5B", "%5D", "%5b", "%5d", "[", "]"}) {
    for (size_t at; (at = peer.find(escaped)) != std::string::npos;) peer.erase(at, std::strlen(escaped));
  }
  const size_t scheme = peer.find(':');
  const size_t colon = peer.rfind(':');
  if (scheme == std::string::npos || colon == scheme) return peer;
  const std::string host = peer.substr(scheme + 1, colon - scheme - 1);
  const int port = std::atoi(peer.c_str() + colon + 1);
  sockaddr_storage a{};
  if (::inet_pton(AF_INET, host.c_str(), &reinterpret_cast<sockaddr_in&>(a).sin_addr) == 1) {
    a.ss_family = AF_INET;
  } else if (::inet_pton(AF_INET6, host.c_str(), &reinterpret_cast<sockaddr_in6&>(a).sin6_addr) == 1) {
    a.ss_family = AF_INET6;
  } else {
    return peer;
  }
  setPort(a, port);
  return peerKey(a);
}

void Connections::listen(const std::string& address) {
  const auto hostPort = parseHostPort(address, /*allowPortZero=*/true);
  COHORT_CHECK(hostPort.has_value(), InvalidArgument, "cannot listen on ", address, ": expected host:port");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(hostPort->host.c_str(), nullptr, &hints, &found);
  COHORT_CHECK(rc == 0 && found != nullptr, Error, "cannot listen on ", address, ": ", ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  bool both = false;  // IPv4 and IPv6 addresses: each socket takes its own family only
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) both = both || a->ai_family != found->ai_family;
  port_ = hostPort->port;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    sockaddr_storage at{};
    std::memcpy(&at, a->ai_addr, a->ai_addrlen);
    setPort(at, port_);  // the first socket's, when port 0 chose one
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    COHORT_CHECK(fd >= 0, Error, "cannot listen on ", address, ": socket: ", std::strerror(errno));
    listening_.push_back(fd);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // a restarted shard takes its port back
    if (a->ai_family == AF_INET6) {
      int only = both ? 1 : 0;
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &only, sizeof(only));
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&at), a->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      const int error = errno;
      throw Error(detail::concat("cannot listen on ", address, ": ", std::strerror(error),
                                 error == EADDRINUSE ? " (the port is taken)" : ""));
    }
    if (port_ == 0) {
      sockaddr_storage local{};
      socklen_t length = sizeof(local);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length);
      port_ = portOf(local);
    }
  }
  COHORT_CHECK(!listening_.empty(), Error, "cannot listen on ", address, ": it names no IPv4 or IPv6 address");
}

void Connections::closeListening() {
  for (const int fd : listening_) ::close(fd);
  listening_.clear();
}

void Connections::acceptLoop() {
  std::vector<pollfd> fds;
  for (const int fd : listening_) fds.push_back({fd, POLLIN, 0});
  fds.push_back({wake_, POLLIN, 0});
  while (!stopping_) {
    const int ready = ::poll(fds.data(), fds.size(), 1000);
    {
      MutexLock lock(mu_);
      reapLocked();
    }
    if (ready <= 0 || stopping_) continue;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents & POLLIN) acceptAll(fds[i].fd);
    }
  }
}

void Connections::acceptAll(int listener) {
  for (int taken = 0; taken < 256 && !stopping_; ++taken) {
    sockaddr_storage peer{};
    socklen_t length = sizeof(peer);
    const int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        warn(std::string("cannot accept a connection: ") + std::strerror(errno) + "; backing off");
        pollfd wake{wake_, POLLIN, 0};
        ::poll(&wake, 1, 100);
      }
      return;
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      continue;
    }
    {
      MutexLock lock(mu_);
      reapLocked();
      if (int(open_.size()) >= maxConnections_) {
        ++counts_.dropped;
        ::close(fd);
        warn("refused a connection: " + std::to_string(open_.size()) + " are open, the most this shard keeps (" +
             limitSource_ + "); a job of that many workers needs more: " + raiseLimitHint(int64_t(open_.size())));
        continue;
      }
      int unproven = 0;
      for (const auto& [id, c] : open_) unproven += !c.proven && !c.evicted;
      if (unproven >= kMaxUnproven) evictOldestUnprovenLocked();
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      const uint64_t id = nextId_++;
      Connection& c = open_[id];
      c.fd = fd;
      c.device = st.st_dev;
      c.inode = st.st_ino;
      c.peer = peerKey(peer);
      c.accepted = Steady::now();
      byPeer_[c.peer] = id;
    }
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters handed;
    handed.listener_fd = listener;
    handed.fd = fd;
    acceptor_->HandleNewConnection(&handed);  // gRPC owns fd from here
  }
}

void Connections::reapLocked() {
  for (auto it = open_.begin(); it != open_.end();) {
    struct stat st {};
    if (::fstat(it->second.fd, &st) != 0 || st.st_dev != it->second.device || st.st_ino != it->second.inode) {
      if (auto p = byPeer_.find(it->second.peer); p != byPeer_.end() && p->second == it->first) byPeer_.erase(p);
      it = open_.erase(it);
      refusals_->wantTrim();
    } else {
      ++it;
    }
  }
}

void Connections::evictOldestUnprovenLocked() {
  Connection* oldest = nullptr;
  for (auto& [id, c] : open_) {
    if (!c.proven && !c.evicted && (oldest == nullptr || c.accepted < oldest->accepted)) oldest = &c;
  }
  if (oldest == nullptr) return;
  oldest->evicted = true;
  ++counts_.evicted;
  ::shutdown(oldest->fd, SHUT_RDWR);
  if (counts_.evicted <= 10 || counts_.evicted % 1000 == 0) {
    warn("closed a connection that had not proved the secret to make room (" + std::to_string(kMaxUnproven) +
         " at most; " + std::to_string(counts_.evicted) + " closed so far)");
  }
}

void Connections::warn(const std::string& message) {
  const auto now = Steady::now();
  if (now - lastWarning_ < std::chrono::seconds(1)) return;
  lastWarning_ = now;
  refusals_->log(message);
}

}  // namespace cohort::ps::service_internal
