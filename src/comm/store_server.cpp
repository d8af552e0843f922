// The rendezvous store's server: the accept loop, one thread per connection that runs the
// handshake (comm/store.h) and then its requests against the key-value map.
#include "comm/store.h"

#include "comm/store_internal.h"

#include "base/host_port.h"
#include "base/thread_annotations.h"

#include <cohort/error.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

namespace cohort::store {

namespace {

bool isLiteralAddress(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

struct Server::Impl {
  ServerOptions options;
  int listenFd = -1;
  int wakeFd = -1;  // an eventfd: written once to stop the accept loop
  int port = 0;
  std::string bound;
  std::thread acceptor;
  std::atomic<bool> stopping{false};

  Mutex mu;
  CondVar changed;  // a key was set or added, or the server is stopping
  std::map<std::string, std::vector<uint8_t>> data GUARDED_BY(mu);
  struct Connection {
    int fd = -1;
    std::thread thread;
    Clock::time_point started;
    bool proven = false;   // it proved the secret (or there is none)
    bool evicted = false;  // shut down to make room for a newer unproven connection
    bool finished = false;
  };
  std::map<uint64_t, Connection> connections GUARDED_BY(mu);
  uint64_t nextConnection GUARDED_BY(mu) = 0;
  int pending GUARDED_BY(mu) = 0;  // connections that have not proved the secret yet
  ServerStats counts GUARDED_BY(mu);
  Clock::time_point lastWarning GUARDED_BY(mu){};

  ~Impl() {
    stopping = true;
    if (wakeFd >= 0) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t w = ::write(wakeFd, &one, sizeof(one));
    }
    if (acceptor.joinable()) acceptor.join();
    std::map<uint64_t, Connection> left;
    {
      MutexLock lock(mu);
      for (auto& [id, c] : connections) {
        if (c.fd >= 0) ::shutdown(c.fd, SHUT_RDWR);
      }
      changed.notifyAll();
      left.swap(connections);
    }
    for (auto& [id, c] : left) {
      if (c.thread.joinable()) c.thread.join();
    }
    if (listenFd >= 0) ::close(listenFd);
    if (wakeFd >= 0) ::close(wakeFd);
  }

  void warn(const std::string& message) EXCLUDES(mu) {
    {
      MutexLock lock(mu);
      const auto now = Clock::now();
      if (now - lastWarning < std::chrono::seconds(1)) return;
      lastWarning = now;
    }
    envOrStandard(options.env).log(LogLevel::kWarning, "rendezvous store at " + bound + ": " + message);
  }

  // Joins the threads of connections that have ended.
  void reap() EXCLUDES(mu) {
    std::vector<std::thread> done;
    {
      MutexLock lock(mu);
      for (auto it = connections.begin(); it != connections.end();) {
        if (it->second.finished) {
          done.push_back(std::move(it->second.thread));
          it = connections.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& t : done) t.join();
  }

  void acceptLoop() {
    while (!stopping) {
      pollfd fds[2] = {{listenFd, POLLIN, 0}, {wakeFd, POLLIN, 0}};
      const int n = ::poll(fds, 2, 1000);
      reap();
      if (n <= 0 || stopping || (fds[1].revents & POLLIN)) continue;
      const int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          warn(std::string("cannot accept a connection: ") + std::strerror(errno) + "; backing off");
          pollfd wake{wakeFd, POLLIN, 0};
          ::poll(&wake, 1, 100);
        }
        continue;
      }
      setNoDelay(fd);
      MutexLock lock(mu);
      if (int(connections.size()) >= options.maxConnections) {
        ++counts.dropped;
        ::close(fd);
        continue;
      }
      if (pending >= options.maxPendingHandshakes) evictOldestUnproven();
      ++pending;
      const uint64_t id = nextConnection++;
      Connection& c = connections[id];
      c.fd = fd;
      c.started = Clock::now();
      c.thread = std::thread([this, id, fd] { serve(id, fd); });
    }
  }

  // A flood of silent connections must not lock the job's own processes out: the oldest unproven
  // one makes room (it has had the most time to prove the secret).
  void evictOldestUnproven() REQUIRES(mu) {
    Connection* oldest = nullptr;
    for (auto& [id, c] : connections) {
      if (!c.proven && !c.evicted && !c.finished && (oldest == nullptr || c.started < oldest->started)) oldest = &c;
    }
    if (oldest == nullptr) return;
    oldest->evicted = true;
    ++counts.dropped;
    ::shutdown(oldest->fd, SHUT_RDWR);
  }

  // Runs one connection: the handshake, then requests until it closes.
  void serve(uint64_t id, int fd) {
    try {
      handshakeAndServe(id, fd);
    } catch (const std::exception& e) {
      warn(std::string("a connection failed: ") + e.what());
    }
    ::shutdown(fd, SHUT_RDWR);
    MutexLock lock(mu);
    ::close(fd);
    if (auto it = connections.find(id); it != connections.end()) {
      if (!it->second.proven) --pending;
      it->second.fd = -1;
      it->second.finished = true;
    }
  }

  void handshakeAndServe(uint64_t id, int fd) {
    const auto handshakeDeadline = Clock::now() + options.handshakeTimeout;
    const auth::Nonce serverNonce = auth::freshNonce();
    std::vector<uint8_t> challenge;
    putFixed32(challenge, kMagic);
    putFixed32(challenge, options.secret.empty() ? 0 : kFlagSecret);
    challenge.insert(challenge.end(), serverNonce.begin(), serverNonce.end());
    const IoLimits handshake{.deadline = handshakeDeadline};
    if (writeFull(fd, challenge.data(), challenge.size(), handshake) != IoStatus::kOk) return refuse();

    Channel channel;
    channel.fd = fd;
    channel.maxBody = options.maxValueBytes + 2 * kMaxKeyBytes + 64;
    if (!options.secret.empty()) {
      std::array<uint8_t, kHelloBytes> hello{};
      if (readFull(fd, hello.data(), hello.size(), handshake) != IoStatus::kOk) return refuse();
      const auth::Handshake h =
          handshakeOf(options.secret, serverNonce, std::span<const uint8_t>(hello).first(kNonceBytes));
      std::array<uint8_t, kAnswerBytes> answer{};
      if (!h.isConnectorProof(std::span<const uint8_t>(hello).subspan(kNonceBytes))) {
        // Counted before the client hears it: a caller that saw the refusal sees the count.
        refuse();
        writeFull(fd, answer.data(), answer.size(), handshake);  // 0: refused
        return;
      }
      answer[0] = 1;
      const auth::Proof mine = h.acceptorProof();
      std::copy(mine.begin(), mine.end(), answer.begin() + 1);
      if (writeFull(fd, answer.data(), answer.size(), handshake) != IoStatus::kOk) return refuse();
      channel.seal(h.sessionKey(), auth::Direction::kToConnector);
    }
    {
      MutexLock lock(mu);
      --pending;
      ++counts.accepted;
      connections[id].proven = true;
    }
    // No deadline between requests: a proven client may stay quiet for the whole job.
    const auto forever = Clock::now() + std::chrono::hours(24 * 365);
    std::vector<uint8_t> body;
    while (!stopping) {
      bool bad = false;
      const IoStatus r = channel.receive(body, forever, bad);
      if (r != IoStatus::kOk) {
        if (bad) countMalformed("a frame too long or with a wrong tag");
        return;
      }
      std::vector<uint8_t> reply;
      if (!handle(body, reply)) {
        countMalformed("a malformed request");
        return;
      }
      if (channel.send(reply, Clock::now() + options.handshakeTimeout * 6) != IoStatus::kOk) return;
    }
  }

  void refuse() EXCLUDES(mu) {
    {
      MutexLock lock(mu);
      ++counts.refused;
    }
    warn("refused a connection that did not prove the job's secret");
  }

  void countMalformed(const std::string& what) EXCLUDES(mu) {
    {
      MutexLock lock(mu);
      ++counts.malformed;
    }
    warn("closed a connection after " + what);
  }

  // Waits until every key is present, the deadline passes, or the server stops.
  bool waitKeys(const std::vector<std::string>& keys, Clock::time_point deadline) REQUIRES(mu) {
    for (;;) {
      const bool all = std::all_of(keys.begin(), keys.end(), [&](const std::string& k) {
        mu.assertHeld();
        return data.count(k) > 0;
      });
      if (all) return true;
      if (stopping || Clock::now() >= deadline) return false;
      changed.waitUntil(mu, std::min(deadline, Clock::now() + std::chrono::milliseconds(500)));
    }
  }

  // Fills the reply; false for a malformed request.
  bool handle(const std::vector<uint8_t>& body, std::vector<uint8_t>& reply) EXCLUDES(mu) {
    ByteReader in(body);
    const auto op = Op(in.u8());
    if (!in.ok()) return false;
    MutexLock lock(mu);
    switch (op) {
      case Op::kSet: return handleSet(in, reply);
      case Op::kGet: return handleGet(in, reply);
      case Op::kAdd: return handleAdd(in, reply);
      case Op::kCheck:
      case Op::kWait: return handleKeys(op, in, reply);
      case Op::kDelete: return handleDelete(in, reply);
      case Op::kNumKeys: return handleNumKeys(in, reply);
    }
    return false;
  }

  // A request's wait in ms, as a deadline (a year at most).
  static Clock::time_point deadlineAfter(uint64_t ms) {
    return Clock::now() + std::chrono::milliseconds(int64_t(std::min<uint64_t>(ms, 365ull * 24 * 3600 * 1000)));
  }

  // The handlers of each Op: each reads its request's fields from `in` and fills the reply;
  // false for a malformed request.
  bool handleSet(ByteReader& in, std::vector<uint8_t>& reply) REQUIRES(mu) {
    std::string key = readString(in);
    if (!in.ok()) return false;
    const std::span<const uint8_t> value = in.rest();
    data[std::move(key)].assign(value.begin(), value.end());
    changed.notifyAll();
    reply.push_back(uint8_t(Status::kOk));
    return true;
  }

  bool handleGet(ByteReader& in, std::vector<uint8_t>& reply) REQUIRES(mu) {
    const uint64_t ms = in.u64();
    const std::string key = readString(in);
    if (!in.done()) return false;
    if (!waitKeys({key}, deadlineAfter(ms))) {
      reply.push_back(uint8_t(Status::kTimedOut));
      return true;
    }
    reply.push_back(uint8_t(Status::kOk));
    const auto& value = data[key];
    reply.insert(reply.end(), value.begin(), value.end());
    return true;
  }

  // The value is decimal text (c10d's TCPStore convention); one that is not counts as 0.
  bool handleAdd(ByteReader& in, std::vector<uint8_t>& reply) REQUIRES(mu) {
    const auto delta = int64_t(in.u64());
    const std::string key = readString(in);
    if (!in.done()) return false;
    auto& value = data[key];
    int64_t now = 0;
    if (!value.empty()) {
      try {
        now = std::stoll(std::string(value.begin(), value.end()));
      } catch (const std::exception&) {
        now = 0;
      }
    }
    now += delta;
    const std::string text = std::to_string(now);
    value.assign(text.begin(), text.end());
    changed.notifyAll();
    reply.push_back(uint8_t(Status::kOk));
    putFixed64(reply, uint64_t(now));
    return true;
  }

  // kCheck answers at once whether every key is present; kWait waits for them.
  bool handleKeys(Op op, ByteReader& in, std::vector<uint8_t>& reply) REQUIRES(mu) {
    const uint64_t ms = op == Op::kWait ? in.u64() : 0;
    const uint64_t n = in.u32();
    if (!in.ok() || n > kMaxKeys) return false;
    std::vector<std::string> keys;
    for (uint64_t i = 0; i < n; ++i) keys.push_back(readString(in));
    if (!in.done()) return false;
    const bool all = waitKeys(keys, op == Op::kWait ? deadlineAfter(ms) : Clock::now());
    if (op == Op::kWait) {
      reply.push_back(uint8_t(all ? Status::kOk : Status::kTimedOut));
    } else {
      reply.push_back(uint8_t(Status::kOk));
      reply.push_back(all ? 1 : 0);
    }
    return true;
  }

  bool handleDelete(ByteReader& in, std::vector<uint8_t>& reply) REQUIRES(mu) {
    const std::string key = readString(in);
    if (!in.done()) return false;
    reply.push_back(uint8_t(Status::kOk));
    reply.push_back(data.erase(key) > 0 ? 1 : 0);
    return true;
  }

  bool handleNumKeys(ByteReader& in, std::vector<uint8_t>& reply) REQUIRES(mu) {
    if (!in.done()) return false;
    reply.push_back(uint8_t(Status::kOk));
    putFixed64(reply, uint64_t(data.size()));
    return true;
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

std::unique_ptr<Server> Server::start(const ServerOptions& options) {
  COHORT_CHECK(options.port >= 0 && options.port <= 65535, InvalidArgument,
               "the rendezvous store's port must be in 0..65535, got ", options.port);
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  const std::string where = HostPort{options.host, options.port}.str();

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(options.host.c_str(), nullptr, &hints, &found); rc != 0 || found == nullptr) {
    throw CommError("the rendezvous store cannot listen on " + where + ": " + ::gai_strerror(rc) +
                    ": MASTER_ADDR must name this machine (the chief)");
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  // A name (not an address) that resolves to loopback, such as a Debian host name in /etc/hosts
  // (127.0.1.1), is still how other machines reach this one: listen everywhere then.
  const bool nameToLoopback =
      !isLiteralAddress(options.host) && !isLoopbackHost(options.host) && isLoopbackHost(addressText(found->ai_addr));

  int lastErrno = 0;
  for (int attempt = 0; attempt < 2 && impl->listenFd < 0; ++attempt) {
    const bool everywhere = nameToLoopback || attempt == 1;
    for (addrinfo* ai = found; ai != nullptr && impl->listenFd < 0; ai = ai->ai_next) {
      sockaddr_storage addr{};
      std::memcpy(&addr, ai->ai_addr, ai->ai_addrlen);
      if (everywhere) {
        if (ai->ai_family == AF_INET) reinterpret_cast<sockaddr_in*>(&addr)->sin_addr.s_addr = htonl(INADDR_ANY);
        if (ai->ai_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr = in6addr_any;
      }
      if (ai->ai_family == AF_INET) reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(uint16_t(options.port));
      if (ai->ai_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(uint16_t(options.port));
      const int fd = ::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        lastErrno = errno;
        continue;
      }
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), ai->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
        lastErrno = errno;
        ::close(fd);
        continue;
      }
      impl->listenFd = fd;
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
      impl->port = ntohs(local.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&local)->sin_port);
      impl->bound = HostPort{addressText(reinterpret_cast<sockaddr*>(&local)), impl->port}.str();
      if (everywhere && !nameToLoopback) {
        envOrStandard(options.env)
            .log(LogLevel::kWarning, "MASTER_ADDR " + options.host +
                                         " is not an address of this machine; the rendezvous store listens on every "
                                         "interface");
      }
    }
    if (impl->listenFd >= 0 || lastErrno != EADDRNOTAVAIL) break;
  }
  if (impl->listenFd < 0) {
    if (lastErrno == EADDRINUSE) {
      throw AddressInUse("the rendezvous store cannot listen on " + where + ": " + std::strerror(lastErrno) +
                         ": another job uses the port; give this job a free one: --port or MASTER_PORT");
    }
    throw CommError("the rendezvous store cannot listen on " + where + ": " + std::strerror(lastErrno) +
                    (lastErrno == EADDRINUSE
                         ? ": another job uses the port; give this job a free one: --port or MASTER_PORT"
                         : ""));
  }
  impl->wakeFd = ::eventfd(0, EFD_CLOEXEC);
  COHORT_CHECK(impl->wakeFd >= 0, CommError, "the rendezvous store cannot make an eventfd: ", std::strerror(errno));
  Impl* raw = impl.get();
  impl->acceptor = std::thread([raw] { raw->acceptLoop(); });
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

int Server::port() const { return impl_->port; }
std::string Server::boundAddress() const { return impl_->bound; }

ServerStats Server::stats() const {
  MutexLock lock(impl_->mu);
  ServerStats s = impl_->counts;
  s.open = 0;
  for (const auto& [id, c] : impl_->connections) s.open += c.finished ? 0 : 1;
  return s;
}

}  // namespace cohort::store
