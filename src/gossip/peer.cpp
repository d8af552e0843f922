#include "gossip/peer.h"

#include "compress/codec.h"

#include <cohort/error.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

namespace cohort::gossip {

namespace {

using Clock = std::chrono::steady_clock;

// How often blocked threads look at the stop flag.
constexpr int kTickMs = 100;
constexpr uint32_t kMaxHelloBody = 64 * 1024;

void warn(const std::string& message) { std::fprintf(stderr, "cohort: warning: %s\n", message.c_str()); }

enum class Read { kOk, kEof, kStopped, kTimeout, kError };

// Reads exactly n bytes, polling in ticks so that `stop` is seen; deadline is optional.
Read readExact(int fd, uint8_t* p, size_t n, const std::atomic<bool>& stop, std::optional<Clock::time_point> deadline) {
  size_t got = 0;
  while (got < n) {
    if (stop.load()) return Read::kStopped;
    if (deadline && Clock::now() >= *deadline) return Read::kTimeout;
    pollfd pfd{fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, kTickMs);
    if (ready < 0 && errno != EINTR) return Read::kError;
    if (ready <= 0) continue;
    const ssize_t r = ::recv(fd, p + got, n - got, 0);
    if (r == 0) return Read::kEof;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Read::kError;
    }
    got += size_t(r);
  }
  return Read::kOk;
}

// Writes all bytes; the socket's SO_SNDTIMEO bounds each wait. Returns an empty string or what failed.
std::string writeAll(int fd, const uint8_t* p, size_t n) {
  size_t sent = 0;
  while (sent < n) {
    const ssize_t w = ::send(fd, p + sent, n - sent, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return "a send timed out";
      return std::string("send failed: ") + std::strerror(errno);
    }
    sent += size_t(w);
  }
  return "";
}

void setTimeout(int fd, int option, double seconds) {
  timeval tv{};
  tv.tv_sec = time_t(seconds);
  tv.tv_usec = suseconds_t((seconds - double(tv.tv_sec)) * 1e6);
  ::setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

}  // namespace

struct Peer::Impl {
  // One per destination. The training thread fills `pending`; the sender thread swaps it out.
  struct Outbox {
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<float> pending;  // GUARDED_BY(mutex)
    UpdateMeta meta;             // GUARDED_BY(mutex): sums over what is pending
    bool hasPending = false;     // GUARDED_BY(mutex)
    bool ready = false;          // GUARDED_BY(mutex): chosen by publish(), send now
    bool finishing = false;      // GUARDED_BY(mutex)
    PeerReport report;           // GUARDED_BY(mutex): for DONE
    std::atomic<bool> dead{false};
    std::atomic<bool> closed{false};  // the sender thread ended (DONE sent, or gave up)
    std::thread thread;
  };

  PeerOptions options;
  compress::CodecSpec codec;
  uint32_t maxBody = 0;
  int listenFd = -1;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::thread acceptor;

  // Constant after construction (their threads start in connect()).
  std::vector<std::unique_ptr<Outbox>> outboxes;  // by rank; null for this peer

  std::mutex readersMutex;
  std::vector<std::thread> readers;  // GUARDED_BY(readersMutex)
  std::vector<int> readerFds;        // GUARDED_BY(readersMutex)

  std::mutex inboxMutex;
  std::vector<float> inbox;     // GUARDED_BY(inboxMutex)
  Drained received;             // GUARDED_BY(inboxMutex)

  mutable std::mutex stateMutex;
  std::condition_variable stateCv;
  std::vector<PeerCounters> peers;  // GUARDED_BY(stateMutex), by rank
  int64_t refused = 0;              // GUARDED_BY(stateMutex)

  explicit Impl(PeerOptions o) : options(std::move(o)), codec(compress::CodecSpec::parse(options.codec)) {
    // The largest message a codec makes is an index and a value per entry, plus headers.
    const uint64_t limit = kUpdateHeaderBytes + 3 * uint64_t(options.numel) * sizeof(float) + 4096;
    COHORT_CHECK(limit <= UINT32_MAX, InvalidArgument, "a model of ", options.numel,
                 " parameters is too large for gossip frames (4 GiB at most)");
    maxBody = std::max<uint32_t>(uint32_t(limit), kMaxHelloBody);
    inbox.assign(options.numel, 0.0f);
    peers.resize(size_t(options.worldSize));
    // Made here, not in connect(): a reader may mark a peer lost before connect() runs.
    outboxes.resize(size_t(options.worldSize));
    for (int r = 0; r < options.worldSize; ++r) {
      if (r == options.rank) continue;
      outboxes[size_t(r)] = std::make_unique<Outbox>();
      outboxes[size_t(r)]->pending.assign(options.numel, 0.0f);
    }
  }

  std::string who(int r) const { return "gossip peer " + std::to_string(r); }

  // Logs once; the peer is dropped from sending and from what finish() waits for.
  void markLost(int r, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(stateMutex);
      PeerCounters& p = peers[size_t(r)];
      if (p.lost || p.finished) return;
      p.lost = true;
    }
    warn(who(r) + " is lost (" + why + "); training goes on without it");
    if (auto& box = outboxes[size_t(r)]) {
      box->dead = true;
      box->cv.notify_all();
    }
    stateCv.notify_all();
  }

  void listen() {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(options.bindHost.c_str(), "0", &hints, &found);
    COHORT_CHECK(rc == 0 && found != nullptr, CommError, "gossip: cannot resolve ", options.bindHost, ": ",
                 ::gai_strerror(rc));
    listenFd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    ::setsockopt(listenFd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const bool ok = listenFd >= 0 && ::bind(listenFd, found->ai_addr, found->ai_addrlen) == 0 &&
                    ::listen(listenFd, 64) == 0;
    ::freeaddrinfo(found);
    COHORT_CHECK(ok, CommError, "gossip: cannot listen on ", options.bindHost, ": ", std::strerror(errno));
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ::getsockname(listenFd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    acceptor = std::thread([this] { acceptLoop(); });
  }

  void acceptLoop() {
    while (!stopping.load()) {
      pollfd pfd{listenFd, POLLIN, 0};
      if (::poll(&pfd, 1, kTickMs) <= 0) continue;
      const int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      std::lock_guard<std::mutex> lock(readersMutex);
      readerFds.push_back(fd);
      readers.emplace_back([this, fd] { readLoop(fd); });
    }
  }

  void refuse(int fd, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(stateMutex);
      ++refused;
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    char host[INET6_ADDRSTRLEN] = "?";
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && addr.ss_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, host, sizeof(host));
    }
    warn(std::string("gossip: refused a connection from ") + host + ": " + why);
    ::shutdown(fd, SHUT_RDWR);  // the sender sees it at once; the descriptor is closed with the peer
  }

  // One incoming stream: HELLO, then UPDATEs, then DONE.
  void readLoop(int fd) {
    std::array<uint8_t, kHeaderBytes> header{};
    std::vector<uint8_t> body;
    auto frame = [&](std::optional<Clock::time_point> deadline, FrameHeader& h) -> Read {
      Read r = readExact(fd, header.data(), header.size(), stopping, deadline);
      if (r != Read::kOk) return r;
      h = parseHeader(header, maxBody);
      body.resize(h.length);
      return readExact(fd, body.data(), body.size(), stopping, deadline);
    };
    int from = -1;
    try {
      FrameHeader h;
      const Read first = frame(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(options.timeoutSeconds)), h);
      if (first != Read::kOk) {
        if (first != Read::kStopped) refuse(fd, "no HELLO within the timeout");
        return;
      }
      COHORT_CHECK(h.type == FrameType::kHello, InvalidArgument, "the first frame is not HELLO");
      const Hello hello = parseHello(body);
      if (!sameToken(hello.token, options.token)) {
        refuse(fd, "wrong auth token (every peer must have the job's --auth-token / COHORT_AUTH_TOKEN)");
        return;
      }
      COHORT_CHECK(int(hello.worldSize) == options.worldSize && int(hello.rank) < options.worldSize &&
                       int(hello.rank) != options.rank,
                   InvalidArgument, "HELLO from rank ", hello.rank, " of ", hello.worldSize, " does not fit this job of ",
                   options.worldSize);
      from = int(hello.rank);
      {
        std::lock_guard<std::mutex> lock(stateMutex);
        peers[size_t(from)].bytesReceived += int64_t(kHeaderBytes + body.size());
      }
      while (true) {
        const Read r = frame(std::nullopt, h);
        if (r == Read::kStopped) return;
        if (r != Read::kOk) {
          markLost(from, r == Read::kEof ? "its connection closed before it finished" : "reading from it failed");
          return;
        }
        if (h.type == FrameType::kDone) {
          const PeerReport report = parseDone(body);
          {
            std::lock_guard<std::mutex> lock(stateMutex);
            PeerCounters& p = peers[size_t(from)];
            p.bytesReceived += int64_t(kHeaderBytes + body.size());
            p.report = report;
            if (!p.lost) p.finished = true;
          }
          stateCv.notify_all();
          return;
        }
        COHORT_CHECK(h.type == FrameType::kUpdate, InvalidArgument, "a second HELLO on one stream");
        const UpdateMeta meta = parseUpdate(body);
        COHORT_CHECK(int(meta.sender) == from && meta.numel == options.numel, InvalidArgument, "an UPDATE from ",
                     meta.sender, " of ", meta.numel, " floats on the stream of peer ", from, " (expected ",
                     options.numel, ")");
        // Codec messages describe themselves; decodeAdd checks the whole message before it adds.
        const std::span<const uint8_t> message = std::span<const uint8_t>(body).subspan(kUpdateHeaderBytes);
        {
          std::lock_guard<std::mutex> lock(inboxMutex);
          compress::decodeAdd(message, inbox, 1.0f);
          received.steps += meta.steps;
          received.samples += meta.samples;
          ++received.messages;
          received.metas.push_back(meta);
        }
        std::lock_guard<std::mutex> lock(stateMutex);
        PeerCounters& p = peers[size_t(from)];
        p.bytesReceived += int64_t(kHeaderBytes + body.size());
        ++p.messagesReceived;
      }
    } catch (const Error& e) {
      if (from < 0) {
        refuse(fd, e.what());
      } else {
        markLost(from, std::string("it sent a malformed frame: ") + e.what());
      }
    }
  }

  int dial(int r, const HostPort& to) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options.timeoutSeconds));
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    std::string error = "no attempt";
    auto pause = std::chrono::milliseconds(20);
    while (!stopping.load() && Clock::now() < deadline) {
      addrinfo* found = nullptr;
      const int rc = ::getaddrinfo(to.host.c_str(), std::to_string(to.port).c_str(), &hints, &found);
      if (rc == 0 && found != nullptr) {
        const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        setTimeout(fd, SO_SNDTIMEO, options.timeoutSeconds);  // bounds connect() too
        const bool ok = ::connect(fd, found->ai_addr, found->ai_addrlen) == 0;
        error = std::strerror(errno);
        ::freeaddrinfo(found);
        if (ok) {
          const int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          return fd;
        }
        ::close(fd);
      } else {
        error = ::gai_strerror(rc);
      }
      // A peer that has published its address is listening already; this only rides out a
      // transient failure.
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
    if (stopping.load()) return -1;
    markLost(r, "cannot connect to " + to.host + ":" + std::to_string(to.port) + ": " + error);
    return -1;
  }

  void sendLoop(int r, HostPort to) {
    Outbox& box = *outboxes[size_t(r)];
    const int fd = dial(r, to);
    std::vector<float> sending(options.numel);
    std::vector<uint8_t> frame, scratch;
    // One encoder per destination: its residual is what this peer has not yet sent to that one.
    compress::Encoder encoder(codec, options.numel);
    compress::Encoder rawEncoder(compress::CodecSpec{}, options.numel);  // warm-up steps
    auto send = [&](const std::vector<uint8_t>& bytes, bool isUpdate) {
      const std::string failed = writeAll(fd, bytes.data(), bytes.size());
      if (!failed.empty()) {
        markLost(r, failed);
        return false;
      }
      std::lock_guard<std::mutex> lock(stateMutex);
      peers[size_t(r)].bytesSent += int64_t(bytes.size());
      if (isUpdate) ++peers[size_t(r)].messagesSent;
      return true;
    };
    bool ok = fd >= 0 && send(helloFrame({kProtocol, uint32_t(options.rank), uint32_t(options.worldSize), options.token}),
                              false);
    while (ok && !stopping.load() && !box.dead.load()) {
      UpdateMeta meta;
      bool finishing = false;
      PeerReport report;
      {
        std::unique_lock<std::mutex> lock(box.mutex);
        box.cv.wait_for(lock, std::chrono::milliseconds(kTickMs), [&] {
          return (box.ready && box.hasPending) || box.finishing || stopping.load() || box.dead.load();
        });
        if (stopping.load() || box.dead.load()) break;
        if (box.hasPending && (box.ready || box.finishing)) {
          std::swap(sending, box.pending);
          meta = box.meta;
          box.hasPending = false;
          box.ready = false;
        } else if (!box.finishing) {
          continue;
        }
        finishing = box.finishing && !box.hasPending;
        report = box.report;
      }
      if (meta.steps > 0) {
        meta.encoding = codec.kind == compress::CodecKind::None || meta.step <= options.codecWarmupSteps
                            ? Encoding::kRaw
                            : Encoding::kCodec;
        beginUpdateFrame(meta, frame);
        std::vector<uint8_t>& message = scratch;
        (meta.encoding == Encoding::kRaw ? rawEncoder : encoder).encode(sending, message);
        frame.insert(frame.end(), message.begin(), message.end());
        finishUpdateFrame(frame);
        ok = send(frame, true);
      }
      if (ok && finishing) {
        ok = send(doneFrame(report), false);
        if (ok) ::shutdown(fd, SHUT_WR);
        break;
      }
    }
    if (fd >= 0) ::close(fd);
    box.closed = true;
    stateCv.notify_all();
  }
};

Peer::Peer(PeerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  COHORT_CHECK(impl_->options.worldSize >= 1 && impl_->options.rank >= 0 &&
                   impl_->options.rank < impl_->options.worldSize,
               InvalidArgument, "gossip: rank ", impl_->options.rank, " of ", impl_->options.worldSize);
  impl_->listen();
}

Peer::~Peer() {
  Impl& m = *impl_;
  m.stopping = true;
  for (auto& box : m.outboxes) {
    if (box) box->cv.notify_all();
  }
  if (m.acceptor.joinable()) m.acceptor.join();
  for (auto& box : m.outboxes) {
    if (box && box->thread.joinable()) box->thread.join();
  }
  std::vector<std::thread> readers;
  {
    std::lock_guard<std::mutex> lock(m.readersMutex);
    readers.swap(m.readers);
  }
  for (auto& t : readers) t.join();
  for (int fd : m.readerFds) ::close(fd);
  if (m.listenFd >= 0) ::close(m.listenFd);
}

HostPort Peer::address() const { return {impl_->options.bindHost, impl_->port}; }

void Peer::connect(const std::vector<HostPort>& addresses) {
  Impl& m = *impl_;
  COHORT_CHECK(int(addresses.size()) == m.options.worldSize, InvalidArgument, "gossip: ", addresses.size(),
               " addresses for ", m.options.worldSize, " peers");
  for (int r = 0; r < m.options.worldSize; ++r) {
    if (r == m.options.rank) continue;
    m.outboxes[size_t(r)]->thread = std::thread([&m, r, to = addresses[size_t(r)]] { m.sendLoop(r, to); });
  }
}

void Peer::publish(std::span<const float> update, const UpdateMeta& meta, std::span<const int> to) {
  Impl& m = *impl_;
  COHORT_CHECK(update.size() == m.options.numel, InvalidArgument, "gossip: an update of ", update.size(),
               " floats, expected ", m.options.numel);
  for (int r = 0; r < int(m.outboxes.size()); ++r) {
    auto& box = m.outboxes[size_t(r)];
    if (!box || box->dead.load() || box->closed.load()) continue;
    const bool chosen = std::find(to.begin(), to.end(), r) != to.end();
    {
      std::lock_guard<std::mutex> lock(box->mutex);
      if (!box->hasPending) {
        std::copy(update.begin(), update.end(), box->pending.begin());
        box->meta = meta;
        box->meta.sender = uint32_t(m.options.rank);
        box->meta.numel = m.options.numel;
        box->meta.steps = 0;
        box->meta.samples = 0;
        box->hasPending = true;
      } else {
        float* p = box->pending.data();
        for (size_t i = 0; i < update.size(); ++i) p[i] += update[i];
      }
      box->meta.version = meta.version;
      box->meta.step = meta.step;
      box->meta.steps += meta.steps;
      box->meta.samples += meta.samples;
      box->ready = box->ready || chosen;
    }
    if (chosen) box->cv.notify_one();
  }
}

Drained Peer::drain(std::vector<float>& into) {
  Impl& m = *impl_;
  COHORT_CHECK(into.size() == m.options.numel, InvalidArgument, "gossip: drain into ", into.size(), " floats, expected ",
               m.options.numel);
  std::lock_guard<std::mutex> lock(m.inboxMutex);
  std::swap(into, m.inbox);
  Drained out = std::move(m.received);
  m.received = Drained{};
  return out;
}

void Peer::finish(const PeerReport& report) {
  Impl& m = *impl_;
  for (auto& box : m.outboxes) {
    if (!box) continue;
    {
      std::lock_guard<std::mutex> lock(box->mutex);
      box->finishing = true;
      box->report = report;
    }
    box->cv.notify_one();
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(m.options.timeoutSeconds));
  auto settled = [&](int r) {
    const PeerCounters& p = m.peers[size_t(r)];
    const auto& box = m.outboxes[size_t(r)];
    return p.lost || (p.finished && (!box || box->closed.load()));
  };
  std::unique_lock<std::mutex> lock(m.stateMutex);
  std::vector<int> late;
  while (true) {
    late.clear();
    for (int r = 0; r < m.options.worldSize; ++r) {
      if (r != m.options.rank && !settled(r)) late.push_back(r);
    }
    if (late.empty() || Clock::now() >= deadline) break;
    m.stateCv.wait_for(lock, std::chrono::milliseconds(kTickMs));
  }
  lock.unlock();
  for (int r : late) {
    m.markLost(r, "it did not finish within " + std::to_string(int(m.options.timeoutSeconds)) + " s of this peer");
  }
}

std::vector<int> Peer::livePeers() const {
  std::lock_guard<std::mutex> lock(impl_->stateMutex);
  std::vector<int> out;
  for (int r = 0; r < impl_->options.worldSize; ++r) {
    if (r != impl_->options.rank && !impl_->peers[size_t(r)].lost) out.push_back(r);
  }
  return out;
}

std::vector<PeerCounters> Peer::counters() const {
  std::lock_guard<std::mutex> lock(impl_->stateMutex);
  return impl_->peers;
}

int64_t Peer::bytesSent() const {
  std::lock_guard<std::mutex> lock(impl_->stateMutex);
  int64_t n = 0;
  for (const auto& p : impl_->peers) n += p.bytesSent;
  return n;
}

int64_t Peer::bytesReceived() const {
  std::lock_guard<std::mutex> lock(impl_->stateMutex);
  int64_t n = 0;
  for (const auto& p : impl_->peers) n += p.bytesReceived;
  return n;
}

int64_t Peer::refusedStreams() const {
  std::lock_guard<std::mutex> lock(impl_->stateMutex);
  return impl_->refused;
}

}  // namespace cohort::gossip
