#include "comm/store.h"

#include "base/auth_channel.h"
#include "base/coding.h"
#include "base/host_port.h"
#include "base/socket_io.h"
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
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>

namespace cohort::store {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x31545343;  // "CST1"
constexpr uint32_t kFlagSecret = 1;
constexpr size_t kNonceBytes = auth::kNonceBytes;
constexpr size_t kProofBytes = auth::kProofBytes;
constexpr size_t kChallengeBytes = 8 + kNonceBytes;
constexpr size_t kHelloBytes = kNonceBytes + kProofBytes;
constexpr size_t kAnswerBytes = 1 + kProofBytes;
constexpr size_t kTagBytes = auth::kTagBytes;
constexpr size_t kMaxKeyBytes = 4096;
constexpr size_t kMaxKeys = 4096;
constexpr size_t kReadChunk = size_t(1) << 20;

enum class Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5, kDelete = 6, kNumKeys = 7 };
enum class Status : uint8_t { kOk = 0, kTimedOut = 1, kRefused = 2 };

void putString(std::vector<uint8_t>& out, const std::string& s) {
  putFixed32(out, uint32_t(s.size()));
  out.insert(out.end(), s.begin(), s.end());
}

// A key: its length u32 and its bytes, at most kMaxKeyBytes. A key that does not fit, or a longer
// one, fails the reader.
std::string readString(ByteReader& in) {
  const uint32_t n = in.u32();
  if (n > kMaxKeyBytes) in.fail();
  const std::span<const uint8_t> bytes = in.bytes(n);
  return std::string(bytes.begin(), bytes.end());
}

// ---- the handshake and the frames -----------------------------------------------------------

// The handshake's transcript is the two nonces, the server's first (base/auth_channel.h).
auth::Handshake handshakeOf(const std::string& secret, std::span<const uint8_t> serverNonce,
                            std::span<const uint8_t> clientNonce) {
  constexpr auth::Labels kLabels{"cohort-store client", "cohort-store server", "cohort-store session"};
  std::vector<uint8_t> transcript(serverNonce.begin(), serverNonce.end());
  transcript.insert(transcript.end(), clientNonce.begin(), clientNonce.end());
  return auth::Handshake(secret, kLabels, std::move(transcript));
}

// One side of a connection after the handshake: length-prefixed, tagged frames.
struct Channel {
  int fd = -1;
  std::optional<auth::FrameTags> sendTags, receiveTags;  // with a secret, after the handshake
  size_t maxBody = 0;

  // Tags every later frame; `sends` is this end's direction (the server is the acceptor).
  void seal(const auth::Proof& sessionKey, auth::Direction sends) {
    const auto receives =
        sends == auth::Direction::kToAcceptor ? auth::Direction::kToConnector : auth::Direction::kToAcceptor;
    sendTags.emplace(sessionKey, sends);
    receiveTags.emplace(sessionKey, receives);
  }

  IoStatus send(const std::vector<uint8_t>& body, Clock::time_point deadline) {
    std::vector<uint8_t> frame;
    frame.reserve(4 + body.size() + kTagBytes);
    putFixed32(frame, uint32_t(body.size()));
    frame.insert(frame.end(), body.begin(), body.end());
    if (sendTags) {
      const auth::Tag t = sendTags->seal(std::span(frame).first(4), body);
      frame.insert(frame.end(), t.begin(), t.end());
    }
    return writeFull(fd, frame.data(), frame.size(), {.deadline = deadline});
  }

  // kError also for a frame that is too long or whose tag is wrong (`bad` is set then).
  IoStatus receive(std::vector<uint8_t>& body, Clock::time_point deadline, bool& bad) {
    bad = false;
    const IoLimits limits{.deadline = deadline};
    uint8_t head[4];
    if (const IoStatus r = readFull(fd, head, 4, limits); r != IoStatus::kOk) return r;
    const uint32_t n = decodeFixed32(head);
    if (n > maxBody) {
      bad = true;
      return IoStatus::kError;
    }
    // Grow as bytes arrive: the length is the peer's claim.
    body.clear();
    while (body.size() < n) {
      const size_t part = std::min(kReadChunk, size_t(n) - body.size());
      const size_t at = body.size();
      body.resize(at + part);
      if (const IoStatus r = readFull(fd, body.data() + at, part, limits); r != IoStatus::kOk) return r;
    }
    if (receiveTags) {
      auth::Tag got{};
      if (const IoStatus r = readFull(fd, got.data(), kTagBytes, limits); r != IoStatus::kOk) return r;
      if (!receiveTags->open(head, body, got)) {
        bad = true;
        return IoStatus::kError;
      }
    }
    return IoStatus::kOk;
  }
};

bool isLiteralAddress(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

}  // namespace

// ---- the server -------------------------------------------------------------------------------

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
    auto timeoutOf = [](uint64_t ms) {
      return Clock::now() + std::chrono::milliseconds(int64_t(std::min<uint64_t>(ms, 365ull * 24 * 3600 * 1000)));
    };
    MutexLock lock(mu);
    switch (op) {
      case Op::kSet: {
        std::string key = readString(in);
        if (!in.ok()) return false;
        const std::span<const uint8_t> value = in.rest();
        data[std::move(key)].assign(value.begin(), value.end());
        changed.notifyAll();
        reply.push_back(uint8_t(Status::kOk));
        return true;
      }
      case Op::kGet: {
        const uint64_t ms = in.u64();
        const std::string key = readString(in);
        if (!in.done()) return false;
        if (!waitKeys({key}, timeoutOf(ms))) {
          reply.push_back(uint8_t(Status::kTimedOut));
          return true;
        }
        reply.push_back(uint8_t(Status::kOk));
        const auto& value = data[key];
        reply.insert(reply.end(), value.begin(), value.end());
        return true;
      }
      case Op::kAdd: {
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
      case Op::kCheck:
      case Op::kWait: {
        const uint64_t ms = op == Op::kWait ? in.u64() : 0;
        const uint64_t n = in.u32();
        if (!in.ok() || n > kMaxKeys) return false;
        std::vector<std::string> keys;
        for (uint64_t i = 0; i < n; ++i) keys.push_back(readString(in));
        if (!in.done()) return false;
        const bool all = waitKeys(keys, op == Op::kWait ? timeoutOf(ms) : Clock::now());
        if (op == Op::kWait) {
          reply.push_back(uint8_t(all ? Status::kOk : Status::kTimedOut));
        } else {
          reply.push_back(uint8_t(Status::kOk));
          reply.push_back(all ? 1 : 0);
        }
        return true;
      }
      case Op::kDelete: {
        const std::string key = readString(in);
        if (!in.done()) return false;
        reply.push_back(uint8_t(Status::kOk));
        reply.push_back(data.erase(key) > 0 ? 1 : 0);
        return true;
      }
      case Op::kNumKeys: {
        if (!in.done()) return false;
        reply.push_back(uint8_t(Status::kOk));
        putFixed64(reply, uint64_t(data.size()));
        return true;
      }
    }
    return false;
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

std::unique_ptr<Server> Server::start(const ServerOptions& options) {
  COHORT_CHECK(options.port >= 0 && options.port <= 65535, InvalidArgument, "the rendezvous store's port must be in 0..65535, got ",
               options.port);
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
  const bool nameToLoopback = !isLiteralAddress(options.host) && !isLoopbackHost(options.host) &&
                              isLoopbackHost(addressText(found->ai_addr));

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
    throw CommError("the rendezvous store cannot listen on " + where + ": " + std::strerror(lastErrno) +
                    (lastErrno == EADDRINUSE ? ": another job uses the port; give this job a free one: --port or MASTER_PORT" : ""));
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

// ---- the client -------------------------------------------------------------------------------

struct Client::Impl {
  std::string where;
  std::chrono::milliseconds timeout{};
  Mutex mu;
  Channel channel GUARDED_BY(mu);
  bool broken GUARDED_BY(mu) = false;

  ~Impl() {
    MutexLock lock(mu);
    if (channel.fd >= 0) ::close(channel.fd);
  }

  // Sends one request and reads its reply; `wait` is how long the server may hold it.
  std::vector<uint8_t> call(const std::vector<uint8_t>& request, std::chrono::milliseconds wait, const std::string& what)
      EXCLUDES(mu) {
    MutexLock lock(mu);
    COHORT_CHECK(!broken, CommError, "rendezvous store at ", where, ": the connection was lost earlier; cannot ", what);
    const auto deadline = Clock::now() + timeout + wait;
    IoStatus r = channel.send(request, deadline);
    std::vector<uint8_t> reply;
    bool bad = false;
    if (r == IoStatus::kOk) r = channel.receive(reply, deadline, bad);
    if (r != IoStatus::kOk || reply.empty() || reply[0] == uint8_t(Status::kRefused)) {
      broken = true;
      const std::string why = bad ? "a reply failed its authentication tag" : reply.empty() ? describe(r) : "refused";
      if (r == IoStatus::kTimeout) {
        throw TimeoutError("rendezvous store at " + where + ": " + what + ": no answer within " +
                           std::to_string((timeout + wait).count() / 1000) + " s: is the chief alive?");
      }
      throw CommError("rendezvous store at " + where + ": " + what + " failed: " + why +
                      ": the chief (which hosts the store) may have ended");
    }
    return reply;
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

std::unique_ptr<Client> Client::connect(const std::string& host, int port, const std::string& secret,
                                        std::chrono::milliseconds timeout) {
  COHORT_CHECK(port >= 1 && port <= 65535, CommError, "the rendezvous store's address ", HostPort{host, port}.str(),
               " has no port: only the chief may be given port 0 (it then listens on any free port, which "
               "cohort launch hands to the others); give the other workers the chief's MASTER_PORT");
  auto impl = std::make_unique<Impl>();
  impl->where = HostPort{host, port}.str();
  impl->timeout = timeout;
  MutexLock lock(impl->mu);  // nobody else sees impl yet; this keeps the analysis exact
  const auto deadline = Clock::now() + timeout;
  std::string lastError = "nothing listens there";
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    const int fd = connectTo(HostPort{host, port}, deadline, lastError);
    if (fd >= 0) {
      impl->channel.fd = fd;
      break;
    }
    if (Clock::now() + backoff >= deadline) {
      throw TimeoutError("cannot reach the job's rendezvous store at " + impl->where + " within " +
                         std::to_string(timeout.count() / 1000) + " s (" + lastError +
                         "): check that the chief runs and that MASTER_ADDR/MASTER_PORT name it");
    }
    std::this_thread::sleep_for(backoff);  // nothing listens yet: the chief may still be starting
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }

  const int fd = impl->channel.fd;
  auto fail = [&](const std::string& why) -> std::unique_ptr<Client> {
    throw CommError("the rendezvous store at " + impl->where + " " + why);
  };
  std::array<uint8_t, kChallengeBytes> challenge{};
  const IoLimits limits{.deadline = deadline};
  if (const IoStatus r = readFull(fd, challenge.data(), challenge.size(), limits); r != IoStatus::kOk) {
    return fail(std::string("did not greet: ") + describe(r) + ": is that port the chief's store?");
  }
  const uint32_t magic = decodeFixed32(challenge.data()), flags = decodeFixed32(challenge.data() + 4);
  if (magic != kMagic) return fail("is not a cohort store (another program, or another version of cohort, on that port)");
  const auto serverNonce = std::span<const uint8_t>(challenge).subspan(8, kNonceBytes);
  if ((flags & kFlagSecret) == 0 && !secret.empty()) {
    return fail("runs without a secret but this process has one: give every process of the job the same "
                "COHORT_AUTH_TOKEN (cohort launch does)");
  }
  if ((flags & kFlagSecret) != 0) {
    if (secret.empty()) {
      return fail("needs the job's secret: set COHORT_AUTH_TOKEN (or --auth-token) to the chief's on every process");
    }
    const auth::Nonce clientNonce = auth::freshNonce();
    const auth::Handshake h = handshakeOf(secret, serverNonce, clientNonce);
    const auth::Proof mine = h.connectorProof();
    std::array<uint8_t, kHelloBytes> hello{};
    std::copy(clientNonce.begin(), clientNonce.end(), hello.begin());
    std::copy(mine.begin(), mine.end(), hello.begin() + kNonceBytes);
    std::array<uint8_t, kAnswerBytes> answer{};
    if (writeFull(fd, hello.data(), hello.size(), limits) != IoStatus::kOk ||
        readFull(fd, answer.data(), answer.size(), limits) != IoStatus::kOk || answer[0] != 1) {
      // Also what a rank of a second job sees when it finds the first job's store on its port.
      return fail("refused this process's proof of the secret: another job may be listening on this port (give "
                  "this job a free one: --port or MASTER_PORT), or this process's COHORT_AUTH_TOKEN differs from "
                  "the chief's");
    }
    if (!h.isAcceptorProof(std::span<const uint8_t>(answer).subspan(1))) {
      return fail("did not prove the job's secret: another job's store on this port (give this job a free one: "
                  "--port or MASTER_PORT), a forged store, or another COHORT_AUTH_TOKEN");
    }
    impl->channel.seal(h.sessionKey(), auth::Direction::kToAcceptor);
  }
  impl->channel.maxBody = size_t(1) << 31;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

void Client::set(const std::string& key, const std::vector<uint8_t>& value) {
  COHORT_CHECK(key.size() <= kMaxKeyBytes, InvalidArgument, "store key longer than ", kMaxKeyBytes, " bytes");
  std::vector<uint8_t> request;
  request.reserve(1 + 4 + key.size() + value.size());
  request.push_back(uint8_t(Op::kSet));
  putString(request, key);
  request.insert(request.end(), value.begin(), value.end());
  impl_->call(request, std::chrono::milliseconds(0), "setting " + key);
}

std::optional<std::vector<uint8_t>> Client::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::vector<uint8_t> request{uint8_t(Op::kGet)};
  putFixed64(request, uint64_t(std::max<int64_t>(timeout.count(), 0)));
  putString(request, key);
  std::vector<uint8_t> reply = impl_->call(request, timeout, "reading " + key);
  if (reply[0] == uint8_t(Status::kTimedOut)) return std::nullopt;
  reply.erase(reply.begin());
  return reply;
}

int64_t Client::add(const std::string& key, int64_t delta) {
  std::vector<uint8_t> request{uint8_t(Op::kAdd)};
  putFixed64(request, uint64_t(delta));
  putString(request, key);
  const std::vector<uint8_t> reply = impl_->call(request, std::chrono::milliseconds(0), "adding to " + key);
  ByteReader in(reply);
  in.u8();
  const auto v = int64_t(in.u64());
  COHORT_CHECK(in.done(), CommError, "rendezvous store at ", impl_->where, ": a malformed answer to add");
  return v;
}

bool Client::check(const std::vector<std::string>& keys) {
  std::vector<uint8_t> request{uint8_t(Op::kCheck)};
  putFixed32(request, uint32_t(keys.size()));
  for (const auto& k : keys) putString(request, k);
  const std::vector<uint8_t> reply = impl_->call(request, std::chrono::milliseconds(0), "checking keys");
  return reply.size() == 2 && reply[1] == 1;
}

bool Client::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<uint8_t> request{uint8_t(Op::kWait)};
  putFixed64(request, uint64_t(std::max<int64_t>(timeout.count(), 0)));
  putFixed32(request, uint32_t(keys.size()));
  for (const auto& k : keys) putString(request, k);
  const std::vector<uint8_t> reply = impl_->call(request, timeout, "waiting for keys");
  return reply[0] == uint8_t(Status::kOk);
}

bool Client::remove(const std::string& key) {
  std::vector<uint8_t> request{uint8_t(Op::kDelete)};
  putString(request, key);
  const std::vector<uint8_t> reply = impl_->call(request, std::chrono::milliseconds(0), "deleting " + key);
  return reply.size() == 2 && reply[1] == 1;
}

int64_t Client::numKeys() {
  const std::vector<uint8_t> reply =
      impl_->call(std::vector<uint8_t>{uint8_t(Op::kNumKeys)}, std::chrono::milliseconds(0), "counting keys");
  ByteReader in(reply);
  in.u8();
  return int64_t(in.u64());
}

std::chrono::milliseconds Client::timeout() const { return impl_->timeout; }
std::string Client::where() const { return impl_->where; }

}  // namespace cohort::store
