#include "ps/service.h"
#include "base/host_port.h"
#include "base/launcher_channel.h"
#include "base/thread_annotations.h"
#include "ps/call_auth.h"
#include "ps/grpc_frame.h"

#include "ps/client.h"

#include <cohort/error.h>

#include "ps.grpc.pb.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <grpcpp/impl/codegen/rpc_service_method.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/server_builder.h>

#include <arpa/inet.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string_view>
#include <thread>

namespace cohort::ps {

namespace {

using Clock = std::chrono::system_clock;

// How long shutdown lets calls in flight finish before cancelling them.
constexpr auto kShutdownGrace = std::chrono::milliseconds(500);
// How long a connection may take to finish gRPC's handshake.
constexpr int kHandshakeTimeoutMs = 10'000;

// The most bytes an Init may carry: a shard's part of the model, at most what one checkpoint may
// hold (2 GiB), and its names. It is every request's cap until the chief's Init came, and an
// Init's always (a fresh Init replaces the layout).
constexpr uint64_t kInitCap = (uint64_t(2) << 30) + (uint64_t(256) << 20);
// Every other request's cap once a layout is known: twice the shard's values (a row-sparse or
// top-k push carries an index beside each value) as float32, and 1 MB for the header.
uint64_t capForValues(uint64_t values) { return 2 * values * sizeof(float) + (uint64_t(1) << 20); }

// Which cap a request is held to.
enum class Request { kInit, kOther };
constexpr std::string_view kInitMethod = "/cohort.ps.wire.ParameterServer/Init";

// How many calls one connection may have open at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS;
// a client queues more). A worker has one call at a time to each shard.
constexpr int kMaxStreamsPerConnection = 16;

// What gRPC may hold for requests being read: its resource quota. It is not what refuses a large
// request (the caps are): past it gRPC cancels streams of other connections too, the oldest
// first, so an oversized body took the job's workers' pushes down with it (issue 30). It only
// keeps gRPC from taking the machine: half its memory, or of the cgroup's limit if lower, and at
// least what one Init may carry.
size_t quotaForMachine() {
  uint64_t memory = uint64_t(::sysconf(_SC_PHYS_PAGES)) * uint64_t(::sysconf(_SC_PAGESIZE));
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    uint64_t limit = 0;
    if (in >> limit && limit > 0) memory = std::min(memory, limit);  // "max" does not parse: no limit
  }
  return size_t(std::max(memory / 2, kInitCap));
}

std::string readPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  COHORT_CHECK(in.good(), InvalidArgument, "cannot read ", flag, " ", path, ": check the path and its permissions");
  std::stringstream text;
  text << in.rdbuf();
  COHORT_CHECK(!text.str().empty(), InvalidArgument, flag, " ", path, " is empty");
  return text.str();
}

// The listening address ("host:port", "[v6]:port") is on loopback.
bool isLoopbackAddress(const std::string& address) {
  const auto hostPort = parseHostPort(address, /*allowPortZero=*/true);
  return isLoopbackHost(hostPort ? hostPort->host : address);
}

// What the service does with a caller that has not shown the token, or whose request is over the
// cap: counts it, logs it (rate-limited: a misconfigured worker retrying, or a scanner, must not
// flood the log), and asks for the memory its request took back from the heap.
class Refusals {
 public:
  Refusals(std::shared_ptr<Shard> shard, std::string name, std::function<void(const std::string&)> log, Env* env)
      : shard_(std::move(shard)), name_(std::move(name)), log_(std::move(log)), env_(envOrStandard(env)) {}

  grpc::Status refuse(const std::string& peer, ProofCheck why) {
    shard_->countUnauthenticated();
    wantTrim();
    const int64_t n = ++refused_;
    if (n <= 10 || n % 100 == 0) {
      log("refused a request from " + peer + ": " + describe(why) + " (" + std::to_string(n) + " refused so far)");
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        std::string(describe(why)) + ": every process of the job needs the same --auth-token");
  }

  // The most bytes one request may carry (see kInitCap, capForValues).
  uint64_t cap(Request request) const { return request == Request::kInit ? kInitCap : layoutCap_.load(); }
  // After every accepted Init.
  void setLayout(const wire::InitRequest& init) {
    uint64_t values = 0;
    for (const auto& p : init.pieces()) values += p.numel();
    values_ = values;
    layoutCap_ = capForValues(values);
  }

  // The size a call declares (kRequestBytesKey), into `declared`, against the cap: OK or why not
  // (not counted yet: see reject). `read`: whether the body was read already.
  Status checkDeclared(Request request, std::optional<std::string_view> header, bool read, uint64_t* declared) const {
    const std::string when = read ? "" : "; its body was not read";
    if (!header) {
      return refusal(Code::kInvalidArgument, "a request without " + std::string(kRequestBytesKey) +
                                                 " (its size); this shard reads at most " + describeCap(request) + " of one" +
                                                 when);
    }
    const auto parsed = std::from_chars(header->data(), header->data() + header->size(), *declared);
    if (header->empty() || parsed.ec != std::errc() || parsed.ptr != header->data() + header->size()) {
      return refusal(Code::kInvalidArgument,
                     "a request whose " + std::string(kRequestBytesKey) + " is not a number of bytes" + when);
    }
    if (*declared > cap(request)) {
      return refusal(Code::kResourceExhausted, "a request of " + std::to_string(*declared) +
                                                   " bytes is over this shard's cap of " + describeCap(request) + when);
    }
    return Status::Ok();
  }

  // The bytes that arrived (so far) against the cap and what the call declared.
  Status checkRead(Request request, uint64_t bytes, uint64_t declared) const {
    if (bytes > cap(request)) {
      return refusal(Code::kResourceExhausted, "a request of " + std::to_string(bytes) +
                                                   " bytes is over this shard's cap of " + describeCap(request) +
                                                   " (it declared " + std::to_string(declared) + ")");
    }
    if (bytes > declared) {
      return refusal(Code::kInvalidArgument, "a request carries more than the " + std::to_string(declared) +
                                                 " bytes it declared (" + std::to_string(bytes) + " so far)");
    }
    return Status::Ok();
  }

  // A request refused for its size or form: counted as rejected, its memory given back.
  grpc::Status reject(const Status& why) {
    shard_->countRejected(why);
    wantTrim();
    return grpc::Status(grpc::StatusCode(why.code), why.message);
  }

  const std::string& name() const { return name_; }

  void log(const std::string& message) const {
    if (log_) {
      log_(message);
    } else {
      env_.log(LogLevel::kInfo, name_ + ": " + message);
    }
  }

  // A large request that was refused was read into the heap, which keepFreedMemory() keeps from
  // shrinking; the next call (or runShardServer's loop) gives those pages back.
  void wantTrim() { trim_ = true; }
  void trimIfWanted() {
    if (trim_.exchange(false)) ::malloc_trim(0);
  }

 private:
  Status refusal(Code code, const std::string& what) const {
    return Status::error(code, "ps shard " + name_ + ": " + what);
  }

  std::string describeCap(Request request) const {
    const uint64_t values = values_;
    return std::to_string(cap(request)) + " bytes (" +
           (request == Request::kInit || values == 0
                ? std::string("what an Init may carry: a shard's part of the model, at most 2 GiB, and its names")
                : "twice the " + std::to_string(values) + " values this shard holds, as float32, and 1 MB") +
           ")";
  }

  const std::shared_ptr<Shard> shard_;
  const std::string name_;
  const std::function<void(const std::string&)> log_;
  Env& env_;
  std::atomic<int64_t> refused_{0};
  std::atomic<bool> trim_{false};
  std::atomic<uint64_t> layoutCap_{kInitCap};  // until the first Init: an Init's
  std::atomic<uint64_t> values_{0};
};

// The shard's own accept loop. gRPC's listener takes every connection and keeps each that sent
// HTTP/2's preface for as long as its peer holds it open: 1,000 idle strangers held 1,000
// descriptors and 150 MB of a shard (issue 30), where the store and the gossip peers hold at most
// 64 connections that have not proved the secret. So the shard binds the port itself, accepts,
// and hands each connection to gRPC (ExternalConnectionAcceptor) while keeping a record of it:
//  - a connection is proven by its first call that reaches the service with a good proof (any
//    call, where the shard has no secret): Service::handle calls prove() with the call's peer;
//  - at most kMaxUnproven connections are unproven at a time: a newcomer evicts the oldest (it
//    had the most time to prove itself), so a flood cannot lock the job's processes out; an
//    evicted connection is shut down (its client, if it was one, retries on a new one);
//  - at most maxConnections are open in all (half the descriptors the process may open, at most
//    1024): beyond, a newcomer is closed at once.
// gRPC closes a connection by itself as before (the peer left, the handshake deadline); a record
// goes once its descriptor no longer holds its socket (the same device and inode), which the loop
// looks at after every accept and at least once a second. Thread-safe.
class Connections {
 public:
  using Steady = std::chrono::steady_clock;
  static constexpr int kMaxUnproven = 64;

  struct Counts {
    int open = 0;         // connections handed to gRPC and not closed since
    int unproven = 0;     // of those, not proven and not evicted
    int64_t evicted = 0;  // unproven connections shut down for a newcomer
    int64_t dropped = 0;  // newcomers closed at once: too many open
  };

  // Binds `address` ("host:port", "[v6]:port"; port 0: a free one), every address the host
  // resolves to; throws Error naming it when it cannot.
  // `refusals` logs for it and gives back the heap pages of the connections gRPC closed.
  Connections(const std::string& address, std::shared_ptr<Refusals> refusals) : refusals_(std::move(refusals)) {
    rlimit files{};
    ::getrlimit(RLIMIT_NOFILE, &files);
    maxConnections_ = int(std::clamp<rlim_t>(files.rlim_cur / 2, kMaxUnproven + 16, 1024));
    try {
      listen(address);
      wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      COHORT_CHECK(wake_ >= 0, Error, "eventfd: ", std::strerror(errno));
    } catch (...) {
      closeListening();
      throw;
    }
  }

  ~Connections() {
    stop();
    closeListening();
    if (wake_ >= 0) ::close(wake_);
  }
  Connections(const Connections&) = delete;
  Connections& operator=(const Connections&) = delete;

  int port() const { return port_; }

  // Starts accepting into gRPC (the server is started: a connection handed to it earlier is closed).
  void start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor) {
    acceptor_ = std::move(acceptor);
    thread_ = std::thread([this] { acceptLoop(); });
  }

  // Stops accepting; connections already handed over stay gRPC's. Idempotent.
  void stop() {
    if (!thread_.joinable()) return;
    stopping_ = true;
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t written = ::write(wake_, &one, sizeof(one));
    thread_.join();
  }

  // A call from `peer` (ServerContext::peer(): "ipv4:127.0.0.1:5555", "ipv6:%5B::1%5D:5555")
  // carried a good proof.
  void prove(const std::string& peer) {
    const std::string key = peerKey(peer);
    MutexLock lock(mu_);
    const auto found = byPeer_.find(key);
    if (found == byPeer_.end()) return;
    if (auto c = open_.find(found->second); c != open_.end()) c->second.proven = true;
  }

  Counts counts() {
    MutexLock lock(mu_);
    reapLocked();
    Counts out = counts_;
    out.open = int(open_.size());
    out.unproven = 0;
    for (const auto& [id, c] : open_) out.unproven += !c.proven && !c.evicted;
    return out;
  }

 private:
  struct Connection {
    int fd = -1;
    dev_t device = 0;  // the socket's identity: the descriptor's number may be reused once gRPC closes it
    ino_t inode = 0;
    std::string peer;  // peerKey
    Steady::time_point accepted;
    bool proven = false;
    bool evicted = false;
  };

  static void setPort(sockaddr_storage& a, int port) {
    if (a.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(a).sin_port = htons(uint16_t(port));
    if (a.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(a).sin6_port = htons(uint16_t(port));
  }
  static int portOf(const sockaddr_storage& a) {
    return ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(a).sin6_port
                                         : reinterpret_cast<const sockaddr_in&>(a).sin_port);
  }

  // "address port", the same for an accepted peer and for gRPC's spelling of it (an IPv4 address
  // mapped into IPv6 as its IPv4 self).
  static std::string peerKey(const sockaddr_storage& a) {
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
  static std::string peerKey(std::string peer) {
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

  void listen(const std::string& address) {
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

  void closeListening() {
    for (const int fd : listening_) ::close(fd);
    listening_.clear();
  }

  void acceptLoop() {
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

  // Accepts what is waiting on `listener`.
  void acceptAll(int listener) {
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
          warn("refused a connection: " + std::to_string(open_.size()) + " are open, the most this shard keeps");
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

  // Drops the records of connections gRPC has closed, and asks for their memory back from the heap
  // (keepFreedMemory() would keep it).
  void reapLocked() REQUIRES(mu_) {
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

  // Shuts the oldest unproven connection down; gRPC sees it end and closes it. Its descriptor still
  // holds its socket (reapLocked just looked), and only this thread opens sockets in a shard.
  void evictOldestUnprovenLocked() REQUIRES(mu_) {
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

  // At most one line a second.
  void warn(const std::string& message) {
    const auto now = Steady::now();
    if (now - lastWarning_ < std::chrono::seconds(1)) return;
    lastWarning_ = now;
    refusals_->log(message);
  }

  const std::shared_ptr<Refusals> refusals_;
  int maxConnections_ = 1024;
  std::vector<int> listening_;
  int wake_ = -1;
  int port_ = 0;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  Steady::time_point lastWarning_;  // the accept loop's thread only

  Mutex mu_;
  std::map<uint64_t, Connection> open_ GUARDED_BY(mu_);
  std::map<std::string, uint64_t> byPeer_ GUARDED_BY(mu_);  // peerKey -> the latest connection from it
  uint64_t nextId_ GUARDED_BY(mu_) = 0;
  Counts counts_ GUARDED_BY(mu_);
};

// The value of a call's metadata `key`, if it has one.
std::optional<std::string_view> metadataValue(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                              const char* key) {
  const auto found = metadata.find(key);
  if (found == metadata.end()) return std::nullopt;
  return std::string_view(found->second.data(), found->second.size());
}

// Checks the token on a call's metadata, before gRPC reads the request's body: a stranger's
// 512 MB push costs the shard its headers, not 512 MB; then the size the call declares
// (kRequestBytesKey) against the cap, so that an oversized request from a caller with the
// secret is refused unread too. gRPC runs it only under credentials with a security handshake
// (TLS, or its "local" credentials on loopback); plaintext on another interface is checked in the
// handler, after the read.
class TokenCheck final : public grpc::AuthMetadataProcessor {
 public:
  // `verifier`: null when the shard has no secret (the size is checked all the same).
  TokenCheck(std::shared_ptr<CallVerifier> verifier, std::shared_ptr<Refusals> refusals)
      : verifier_(std::move(verifier)), refusals_(std::move(refusals)) {}

  bool IsBlocking() const override { return false; }  // an HMAC and a set lookup: run it on gRPC's thread

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context, OutputMetadata* consumed,
                       OutputMetadata* response) override {
    const ProofCheck result = verifier_ == nullptr ? ProofCheck::kOk
                                                   : verifier_->check(metadataValue(metadata, "authorization")
                                                                          .value_or(std::string_view()));
    if (result == ProofCheck::kOk) {
      uint64_t declared = 0;
      const Request request = metadataValue(metadata, ":path") == kInitMethod ? Request::kInit : Request::kOther;
      const Status size = refusals_->checkDeclared(request, metadataValue(metadata, kRequestBytesKey), false, &declared);
      return size.ok() ? grpc::Status::OK : refusals_->reject(size);
    }
    // gRPC does not tell a processor the caller's address; the transport is what it knows.
    std::string peer = "a caller";
    if (context != nullptr) {
      for (const auto& value : context->FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME)) {
        peer = "a " + std::string(value.data(), value.size()) + " caller";
      }
    }
    return refusals_->refuse(peer, result);
  }

 private:
  const std::shared_ptr<CallVerifier> verifier_;
  const std::shared_ptr<Refusals> refusals_;
};

// TLS when the flags say so; else gRPC's local credentials on a loopback address (plaintext on
// the wire, but with the security handshake that lets TokenCheck run before a body is read);
// else plaintext. Sets `early` when TokenCheck is installed (it checks the proof when there is a
// verifier, and the declared size always).
std::shared_ptr<grpc::ServerCredentials> serverCredentials(const ServerOptions& o,
                                                           const std::shared_ptr<CallVerifier>& verifier,
                                                           const std::shared_ptr<Refusals>& refusals, bool& early) {
  COHORT_CHECK(o.tlsCertFile.empty() == o.tlsKeyFile.empty(), InvalidArgument,
               "TLS needs both --tls-cert and --tls-key, got only ", o.tlsCertFile.empty() ? "--tls-key" : "--tls-cert");
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (!o.tlsCertFile.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({readPem(o.tlsKeyFile, "--tls-key"), readPem(o.tlsCertFile, "--tls-cert")});
    credentials = grpc::SslServerCredentials(ssl);
  } else if (isLoopbackAddress(o.address)) {
    credentials = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    early = false;
    return grpc::InsecureServerCredentials();  // gRPC aborts on a processor for these
  }
  early = true;
  credentials->SetAuthMetadataProcessor(std::make_shared<TokenCheck>(verifier, refusals));
  return credentials;
}

grpc::Status toGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code), s.message);
}

// The bytes a received frame carries.
uint64_t frameBytes(const IncomingFrame& frame) {
  uint64_t bytes = 0;
  for (const auto& c : frame.chunks) bytes += c.size();
  return bytes;
}

class Service final : public wire::ParameterServer::Service {
 public:
  // `verifier` when the handler must check the proof itself (TokenCheck could not run); null
  // when there is no secret or TokenCheck already took the proof (it is good once only).
  // `connections` learns which connections carried a good proof; it outlives the service.
  Service(std::shared_ptr<Shard> shard, std::shared_ptr<CallVerifier> verifier, std::shared_ptr<Refusals> refusals,
          Connections* connections)
      : shard_(std::move(shard)),
        verifier_(std::move(verifier)),
        refusals_(std::move(refusals)),
        connections_(connections) {
    // The zero-copy push, beside proto/ps.proto's methods: its messages are frames, not protobuf.
    AddMethod(new grpc::internal::RpcServiceMethod(
        kPushFramedMethod, grpc::internal::RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<Service, IncomingFrame, OutgoingFrame, IncomingFrame, OutgoingFrame>(
            [](Service* service, grpc::ServerContext* c, const IncomingFrame* q, OutgoingFrame* r) {
              return service->PushFramed(c, q, r);
            },
            this)));
    AddMethod(new grpc::internal::RpcServiceMethod(
        kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING,
        new grpc::internal::ClientStreamingHandler<Service, IncomingFrame, OutgoingFrame>(
            [](Service* service, grpc::ServerContext* c, grpc::ServerReader<IncomingFrame>* q, OutgoingFrame* r) {
              return service->PushStream(c, q, r);
            },
            this)));
  }

  grpc::Status Init(grpc::ServerContext* c, const wire::InitRequest* q, wire::InitReply* r) override {
    return handle(c, Request::kInit, q->ByteSizeLong(), [&](uint64_t) {
      Status s = shard_->init(*q, r);
      if (s.ok()) refusals_->setLayout(*q);
      return s;
    });
  }
  grpc::Status Pull(grpc::ServerContext* c, const wire::PullRequest* q, wire::PullReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->pull(*q, r); });
  }
  grpc::Status Push(grpc::ServerContext* c, const wire::PushRequest* q, wire::PushReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->push(*q, r); });
  }
  // The push's floats are read where gRPC's slices hold them; the reply's are one copy of the
  // shard's values, made under its lock, sent from that buffer without another.
  grpc::Status PushFramed(grpc::ServerContext* c, const IncomingFrame* q, OutgoingFrame* r) {
    return handle(c, Request::kOther, frameBytes(*q), [&](uint64_t) {
      wire::PushRequest request;
      FramePayload payload;
      if (Status s = parseFrame(q->chunks, &request, &payload, "push"); !s.ok()) {
        shard_->countRejected(s);
        return s;
      }
      wire::PushReply reply;
      auto values = std::make_shared<std::vector<float>>();
      Status s = shard_->pushFramed(request, payload, &reply, values.get());
      if (!s.ok()) return s;
      r->head = frameHead(reply);
      if (!values->empty()) r->payload.push_back(*values);
      r->keepAlive = std::move(values);
      return s;
    });
  }
  // The push in chunks: each is checked as it arrives and, unless the push is to be dropped or
  // refused whole at the end, applied (or added to the step being gathered) by Shard::addChunk
  // while gRPC reads the next; the reply is made once the last is in. A chunk's slices are kept
  // only for a push handled at the end (Stream::keepsChunks), whose floats are read where they
  // landed. The token and the declared size were checked before the first chunk was read
  // (handle()); the bytes are counted against both as they come.
  grpc::Status PushStream(grpc::ServerContext* c, grpc::ServerReader<IncomingFrame>* q, OutgoingFrame* r) {
    return handle(c, Request::kOther, std::nullopt, [&](uint64_t declared) {
      std::vector<std::unique_ptr<IncomingFrame>> received;
      auto refuse = [&](const Status& s) {
        shard_->countRejected(s);
        return s;
      };
      received.push_back(std::make_unique<IncomingFrame>());
      if (!q->Read(received.back().get())) {
        return refuse(Status::error(Code::kInvalidArgument, "push stream: it ended before its header"));
      }
      uint64_t bytes = frameBytes(*received.back());
      if (Status s = refusals_->checkRead(Request::kOther, bytes, declared); !s.ok()) return refuse(s);
      wire::PushRequest request;
      FramePayload none;
      if (Status s = parseFrame(received.back()->chunks, &request, &none, "push stream"); !s.ok()) return refuse(s);
      if (none.size() != 0) {
        return refuse(Status::error(Code::kInvalidArgument, "push stream: its header frame carries " +
                                                                std::to_string(none.size()) +
                                                                " payload bytes; the floats belong in the chunks"));
      }
      std::unique_ptr<Shard::Stream> stream;
      if (Status s = shard_->beginStream(request, &stream); !s.ok()) return s;
      auto refuseStream = [&](const Status& s) { return shard_->refuseStream(*stream, s); };
      for (;;) {
        auto frame = std::make_unique<IncomingFrame>();
        if (!q->Read(frame.get())) break;
        bytes += frameBytes(*frame);
        if (Status s = refusals_->checkRead(Request::kOther, bytes, declared); !s.ok()) return refuseStream(s);
        wire::PushChunk chunk;
        FramePayload payload;
        if (Status s = parseFrame(frame->chunks, &chunk, &payload, "push chunk"); !s.ok()) return refuseStream(s);
        if (Status s = shard_->addChunk(*stream, chunk, payload); !s.ok()) return s;
        if (stream->keepsChunks()) received.push_back(std::move(frame));
      }
      if (c->IsCancelled()) {
        return refuseStream(Status::error(Code::kCancelled, "push stream: cancelled by the worker (or its connection "
                                                            "broke) after " + std::to_string(stream->nextPiece) +
                                                            " of " + std::to_string(stream->pieces.size()) +
                                                            " pieces"));
      }
      wire::PushReply reply;
      auto values = std::make_shared<std::vector<float>>();
      Status s = shard_->finishStream(*stream, &reply, values.get());
      if (!s.ok()) return s;
      r->head = frameHead(reply);
      if (!values->empty()) r->payload.push_back(*values);
      r->keepAlive = std::move(values);
      return s;
    });
  }
  grpc::Status Done(grpc::ServerContext* c, const wire::DoneRequest* q, wire::DoneReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->done(*q, r); });
  }
  grpc::Status Stats(grpc::ServerContext* c, const wire::StatsRequest* q, wire::StatsReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->stats(*q, r); });
  }

 private:
  // Runs `call` (given the bytes the call declared) once the call has shown the proof and its size
  // is within the cap: `read`, the bytes of a unary call's request, which gRPC has read whole by
  // now; nullopt for a stream, whose handler starts before its first message is read.
  template <typename Call>
  grpc::Status handle(grpc::ServerContext* context, Request request, std::optional<uint64_t> read, const Call& call) {
    refusals_->trimIfWanted();
    // Where TokenCheck cannot run (plaintext off loopback), this is the check, after gRPC has
    // read the body.
    if (const ProofCheck result = authorized(*context); result != ProofCheck::kOk) {
      refusals_->wantTrim();
      return refusals_->refuse(context->peer(), result);
    }
    connections_->prove(context->peer());
    // TokenCheck checked the declaration too where it runs; the cap may have changed since (an
    // Init came in between), and a stream's is checked here before any of it is read.
    uint64_t declared = 0;
    if (Status s = refusals_->checkDeclared(request, metadataValue(context->client_metadata(), kRequestBytesKey),
                                            read.has_value(), &declared);
        !s.ok()) {
      return refusals_->reject(s);
    }
    if (read) {
      if (Status s = refusals_->checkRead(request, *read, declared); !s.ok()) return refusals_->reject(s);
    }
    try {
      const Status status = call(declared);
      // The shard's own UNAVAILABLE (not initialized yet), told apart from a transport's: a
      // client's retry window restarts when the shard answers (makeGrpcClient).
      if (status.code == Code::kUnavailable) context->AddTrailingMetadata(kShardAnsweredKey, "1");
      return toGrpc(status);
    } catch (const std::exception& e) {
      // Out of memory for a large Init, say: the caller gets the reason, the shard stays up.
      refusals_->wantTrim();
      return grpc::Status(grpc::StatusCode::INTERNAL, "ps shard " + refusals_->name() + ": " + e.what());
    }
  }

  ProofCheck authorized(const grpc::ServerContext& context) const {
    if (verifier_ == nullptr) return ProofCheck::kOk;
    const auto header = metadataValue(context.client_metadata(), "authorization");
    if (!header) return ProofCheck::kMissing;
    return verifier_->check(*header);
  }

  const std::shared_ptr<Shard> shard_;
  const std::shared_ptr<CallVerifier> verifier_;
  const std::shared_ptr<Refusals> refusals_;
  Connections* const connections_;
};

}  // namespace

struct ShardServer::Impl {
  grpc::ResourceQuota quota{"cohort ps shard"};
  size_t quotaBytes = quotaForMachine();
  std::shared_ptr<Shard> shard;
  std::shared_ptr<Refusals> refusals;
  std::unique_ptr<Connections> connections;
  std::unique_ptr<Service> service;
  bool checksBeforeBody = false;  // TokenCheck runs
  bool tokenBeforeBody = false;   // ... and there is a token for it to check
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::once_flag stopped;
};

ShardServer::ShardServer(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  COHORT_CHECK(!options.authToken.empty() || isLoopbackAddress(options.address), InvalidArgument,
               "a parameter-server shard on ", options.address, " (not loopback) needs the job's secret, or anyone who "
               "reaches it could pull and push: give --auth-token / --auth-token-file / $COHORT_AUTH_TOKEN (the same "
               "random value on every process), or listen on 127.0.0.1");
  const auto verifier = options.authToken.empty() ? nullptr : std::make_shared<CallVerifier>(options.authToken);
  // TLS files first: a bad flag fails before any work.
  COHORT_CHECK(options.tlsCertFile.empty() == options.tlsKeyFile.empty(), InvalidArgument,
               "TLS needs both --tls-cert and --tls-key, got only ",
               options.tlsCertFile.empty() ? "--tls-key" : "--tls-cert");
  if (!options.tlsCertFile.empty()) {
    readPem(options.tlsKeyFile, "--tls-key");
    readPem(options.tlsCertFile, "--tls-cert");
  }
  impl_->shard = std::make_shared<Shard>(options.shard);
  impl_->refusals = std::make_shared<Refusals>(impl_->shard, options.shard.name, options.shard.log, options.shard.env);
  const auto credentials = serverCredentials(options, verifier, impl_->refusals, impl_->checksBeforeBody);
  impl_->tokenBeforeBody = impl_->checksBeforeBody && verifier != nullptr;
  impl_->connections = std::make_unique<Connections>(options.address, impl_->refusals);
  impl_->service = std::make_unique<Service>(impl_->shard, impl_->tokenBeforeBody ? nullptr : verifier, impl_->refusals,
                                             impl_->connections.get());
  grpc::ServerBuilder builder;
  builder.SetResourceQuota(impl_->quota.Resize(impl_->quotaBytes));
  // Connections come from Connections' accept loop, not from a port of gRPC's.
  auto acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  // The cap on a request is the shard's (Refusals): gRPC fixes its own limit when the server
  // starts, before the layout is known, and (1.51) checks it only once the whole message is read.
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  // A connection that never completes its handshake is closed after this (gRPC's default: 120 s).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  // Large frames and a deep window: tens of MB per call in 16 KB frames cost more than the copy.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrame);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2Window);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  builder.RegisterService(impl_->service.get());
  impl_->server = builder.BuildAndStart();
  COHORT_CHECK(impl_->server != nullptr, Error, "cannot serve on ", options.address, " (gRPC's log above says why)");
  impl_->connections->start(std::move(acceptor));
  impl_->port = impl_->connections->port();
}

ShardServer::~ShardServer() { shutdown(); }

int ShardServer::port() const { return impl_->port; }

std::shared_ptr<Shard> ShardServer::shard() const { return impl_->shard; }

bool ShardServer::checksTokenBeforeBody() const { return impl_->tokenBeforeBody; }

size_t ShardServer::requestQuotaBytes() const { return impl_->quotaBytes; }

uint64_t ShardServer::requestCapBytes() const { return impl_->refusals->cap(Request::kOther); }

ConnectionCounts ShardServer::connections() const {
  const Connections::Counts c = impl_->connections->counts();
  return {.open = c.open, .unproven = c.unproven, .evicted = c.evicted, .dropped = c.dropped};
}

void ShardServer::trimFreedMemory() { impl_->refusals->trimIfWanted(); }

void ShardServer::shutdown() {
  // gRPC waits for running handlers even past the deadline; Shard::stop lets held pushes go.
  std::call_once(impl_->stopped, [this] {
    // No new connections; held pushes go next, so that gRPC's wait for running handlers is short.
    if (impl_->connections) impl_->connections->stop();
    if (impl_->shard) impl_->shard->stop("the parameter-server shard is shutting down");
    if (impl_->server) impl_->server->Shutdown(Clock::now() + kShutdownGrace);
  });
}

}  // namespace cohort::ps
