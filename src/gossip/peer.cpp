#include "gossip/peer.h"

#include "base/host_port.h"
#include "base/socket_io.h"

#include "base/thread_annotations.h"
#include "compress/codec.h"

#include <cohort/error.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

namespace cohort::gossip {

namespace {

using Clock = std::chrono::steady_clock;

// How often blocked threads look at the stop flag.
constexpr int kTickMs = 100;
// accept() failing for want of descriptors or memory: pause accepting this long, doubling.
constexpr auto kFirstAcceptPause = std::chrono::milliseconds(50);
constexpr auto kMaxAcceptPause = std::chrono::milliseconds(1000);

Clock::duration secondsToDuration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void warn(const std::string& message) { std::fprintf(stderr, "cohort: warning: %s\n", message.c_str()); }

// At most one warning a second; the next one printed says how many were left out. For what
// strangers cause (refused connections, accept failures), which they can cause by the thousand.
class WarningLimiter {
 public:
  void warn(const std::string& message) EXCLUDES(mu_) {
    int64_t leftOut = 0;
    {
      MutexLock lock(mu_);
      const auto now = Clock::now();
      if (printed_ && now - last_ < std::chrono::seconds(1)) {
        ++leftOut_;
        return;
      }
      printed_ = true;
      last_ = now;
      leftOut = std::exchange(leftOut_, 0);
    }
    gossip::warn(leftOut == 0 ? message
                              : message + " (" + std::to_string(leftOut) + " more like it left out of the log)");
  }

 private:
  Mutex mu_;
  bool printed_ GUARDED_BY(mu_) = false;
  Clock::time_point last_ GUARDED_BY(mu_);
  int64_t leftOut_ GUARDED_BY(mu_) = 0;
};

// Writes a whole frame; `timeout` bounds each wait for the peer to take more of it (a slow link
// that moves is not a dead peer). Returns an empty string or what failed.
std::string writeFrame(int fd, const std::vector<uint8_t>& frame, Clock::duration timeout) {
  const IoStatus status = writeFull(fd, frame.data(), frame.size(), {.idle = timeout});
  if (status == IoStatus::kOk) return "";
  if (status == IoStatus::kTimeout) return "a send timed out";
  return std::string("send failed: ") + std::strerror(errno);
}

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

const char* frameName(FrameType t) {
  switch (t) {
    case FrameType::kHello: return "HELLO";
    case FrameType::kUpdate: return "UPDATE";
    case FrameType::kDone: return "DONE";
    case FrameType::kChallenge: return "CHALLENGE";
    case FrameType::kAccept: return "ACCEPT";
    case FrameType::kRefuse: return "REFUSE";
  }
  return "unknown";
}

// A connection accepted but not yet authenticated. The acceptor thread alone touches these.
struct Handshake {
  int fd = -1;
  std::string from;  // host:port, for the log
  Clock::time_point deadline;
  Nonce nonce{};     // sent in our CHALLENGE
  std::array<uint8_t, kHeaderBytes + kMaxHandshakeBody> buffer{};
  size_t got = 0;
};

}  // namespace

HostPort parsePeerAddress(const std::string& text) {
  std::optional<HostPort> parsed = parseHostPort(text);
  COHORT_CHECK(parsed.has_value(), InvalidArgument, "gossip: bad peer address '", text,
               "': expected host:port or [v6 host]:port with a port in 1..65535");
  return *parsed;
}

struct Peer::Impl {
  // One per destination. The training thread fills `pending`; the sender thread swaps it out.
  struct Outbox {
    Mutex mutex;
    CondVar cv;
    std::vector<float> pending GUARDED_BY(mutex);
    // With row tables: pending is zero but outside them on the rows listed here (per table;
    // marked, so that each is listed once). The sender zeroes what it sent before it swaps back.
    std::vector<std::vector<uint32_t>> pendingRows GUARDED_BY(mutex);
    std::vector<std::vector<uint8_t>> pendingMarks GUARDED_BY(mutex);
    UpdateMeta meta GUARDED_BY(mutex);  // sums over what is pending
    bool hasPending GUARDED_BY(mutex) = false;
    bool ready GUARDED_BY(mutex) = false;  // chosen by publish(), send now
    bool finishing GUARDED_BY(mutex) = false;
    PeerReport report GUARDED_BY(mutex);  // for DONE
    std::atomic<bool> dead{false};
    std::atomic<bool> closed{false};  // the sender thread ended (DONE sent, or gave up)
    std::thread thread;
  };

  // Constant after construction.
  PeerOptions options;
  compress::CodecSpec codec;
  // With row tables: the floats outside them, as [begin, end) ranges, and how many (what the
  // codec encodes; at least 1, as an Encoder wants).
  std::vector<std::pair<size_t, size_t>> denseRanges;
  size_t denseLength = 0;
  bool rowTables() const { return !options.tables.empty(); }
  uint32_t maxBody = 0;  // of a frame after the handshake
  int listenFd = -1;
  int port = 0;
  std::vector<std::unique_ptr<Outbox>> outboxes;  // by rank; null for this peer (threads start in connect())

  std::atomic<bool> stopping{false};
  std::thread acceptor;
  WarningLimiter strangers;  // warnings about connections that are not (yet) peers

  Mutex readersMutex;
  std::vector<std::thread> readers GUARDED_BY(readersMutex);  // one per authenticated stream

  Mutex inboxMutex;
  std::vector<float> inbox GUARDED_BY(inboxMutex);
  Drained received GUARDED_BY(inboxMutex);  // with row tables, its rows list the inbox's rows
  std::vector<std::vector<uint8_t>> inboxMarks GUARDED_BY(inboxMutex);  // per table: listed in received.rows

  mutable Mutex stateMutex;
  CondVar stateCv;
  std::vector<PeerCounters> peers GUARDED_BY(stateMutex);  // by rank
  std::vector<bool> streamTaken GUARDED_BY(stateMutex);    // by rank: an incoming stream was accepted
  int64_t refused GUARDED_BY(stateMutex) = 0;

  explicit Impl(PeerOptions o) : options(std::move(o)), codec(compress::CodecSpec::parse(options.codec)) {
    // The largest message a codec makes is an index and a value per entry, plus headers.
    const uint64_t limit = kUpdateHeaderBytes + 3 * uint64_t(options.numel) * sizeof(float) + 4096 + kTagBytes;
    COHORT_CHECK(limit <= UINT32_MAX, InvalidArgument, "a model of ", options.numel,
                 " parameters is too large for gossip frames (4 GiB at most)");
    maxBody = uint32_t(limit);
    size_t end = 0;
    for (const RowTable& t : options.tables) {
      COHORT_CHECK(t.dim > 0 && t.offset >= end && t.offset + uint64_t(t.rows) * t.dim <= options.numel,
                   InvalidArgument, "gossip: row tables must be disjoint, in order, and inside the ", options.numel,
                   " floats of an update");
      if (t.offset > end) denseRanges.emplace_back(end, size_t(t.offset));
      end = size_t(t.offset + uint64_t(t.rows) * t.dim);
    }
    if (end < options.numel) denseRanges.emplace_back(end, options.numel);
    for (const auto& [b, e] : denseRanges) denseLength += e - b;
    denseLength = std::max<size_t>(denseLength, 1);
    inbox.assign(options.numel, 0.0f);
    {
      MutexLock lock(inboxMutex);
      received.rows.resize(options.tables.size());
      for (const RowTable& t : options.tables) inboxMarks.emplace_back(t.rows, 0);
    }
    peers.resize(size_t(options.worldSize));
    streamTaken.assign(size_t(options.worldSize), false);
    // Made here, not in connect(): a reader may mark a peer lost before connect() runs.
    outboxes.resize(size_t(options.worldSize));
    for (int r = 0; r < options.worldSize; ++r) {
      if (r == options.rank) continue;
      outboxes[size_t(r)] = std::make_unique<Outbox>();
      MutexLock lock(outboxes[size_t(r)]->mutex);
      outboxes[size_t(r)]->pending.assign(options.numel, 0.0f);
      outboxes[size_t(r)]->pendingRows.resize(options.tables.size());
      for (const RowTable& t : options.tables) outboxes[size_t(r)]->pendingMarks.emplace_back(t.rows, 0);
    }
  }

  std::string who(int r) const { return "gossip peer " + std::to_string(r); }

  // Logs once; the peer is dropped from sending and from what finish() waits for.
  void markLost(int r, const std::string& why) EXCLUDES(stateMutex) {
    {
      MutexLock lock(stateMutex);
      PeerCounters& p = peers[size_t(r)];
      if (p.lost || p.finished) return;
      p.lost = true;
    }
    warn(who(r) + " is lost (" + why + "); training goes on without it");
    if (auto& box = outboxes[size_t(r)]) {
      box->dead = true;
      box->cv.notifyAll();
    }
    stateCv.notifyAll();
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
    listenFd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const int one = 1;
    ::setsockopt(listenFd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const bool ok = listenFd >= 0 && ::bind(listenFd, found->ai_addr, found->ai_addrlen) == 0 &&
                    ::listen(listenFd, 64) == 0;
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

  // Closes a connection that is not a peer's stream, at once; `reason` is sent first when there is one.
  void refuse(int fd, const std::string& from, const std::string& why, std::optional<RefuseReason> reason)
      EXCLUDES(stateMutex) {
    if (reason) sendSmall(fd, refuseFrame(*reason));
    ::close(fd);
    {
      MutexLock lock(stateMutex);
      ++refused;
    }
    strangers.warn("gossip: refused a connection from " + from + ": " + why);
  }

  // The acceptor thread: accepts connections and runs every handshake, without blocking on any.
  void acceptLoop() {
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

  void acceptOne(std::vector<Handshake>& pending, std::chrono::milliseconds& pause, Clock::time_point& pausedUntil) {
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

  // Reads what has arrived on a handshake; true when it is over (a stream, or refused).
  bool advance(Handshake& h) {
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
        COHORT_CHECK(header.type == FrameType::kHello, InvalidArgument, "its first frame is ",
                     frameName(header.type), ", not HELLO");
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

  // A complete HELLO: refuses it, or makes the connection that rank's stream.
  void welcome(const Handshake& h, const Hello& hello) EXCLUDES(stateMutex, readersMutex) {
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

  // One authenticated incoming stream until its DONE, its end, or a malformed frame. Closes fd.
  void readLoop(int fd, int from, Proof key) {
    try {
      readFrames(fd, from, key);
    } catch (const std::exception& e) {
      markLost(from, std::string("it sent a malformed frame: ") + e.what());
    } catch (...) {
      markLost(from, "reading from it failed");
    }
    ::close(fd);
  }

  void readFrames(int fd, int from, const Proof& key) {
    FrameSealer sealer(key);
    std::array<uint8_t, kHeaderBytes> header{};
    std::vector<uint8_t> body;
    std::vector<float> decoded;  // each update on its own, checked before it joins the inbox
    while (true) {
      const IoLimits untilStopped{.stop = &stopping};
      IoStatus r = readFull(fd, header.data(), header.size(), untilStopped);
      FrameHeader h;
      if (r == IoStatus::kOk) {
        h = parseHeader(header, maxBody);
        body.resize(h.length);
        r = readFull(fd, body.data(), body.size(), untilStopped);
      }
      if (r == IoStatus::kStopped) return;
      if (r != IoStatus::kOk) {
        markLost(from, r == IoStatus::kClosed ? "its connection closed before it finished" : "reading from it failed");
        return;
      }
      const std::span<const uint8_t> content = sealer.open(header, body);
      const auto frameBytes = int64_t(kHeaderBytes + body.size());
      if (h.type == FrameType::kDone) {
        const PeerReport report = parseDone(content);
        {
          MutexLock lock(stateMutex);
          PeerCounters& p = peers[size_t(from)];
          p.bytesReceived += frameBytes;
          p.report = report;
          if (!p.lost) p.finished = true;
        }
        stateCv.notifyAll();
        return;
      }
      COHORT_CHECK(h.type == FrameType::kUpdate, InvalidArgument, "a ", frameName(h.type),
                   " frame after the handshake");
      const UpdateMeta meta = parseUpdate(content);
      COHORT_CHECK(meta.sender == uint32_t(from) && meta.numel == options.numel, InvalidArgument, "an UPDATE from ",
                   meta.sender, " of ", meta.numel, " floats on the stream of peer ", from, " (expected ",
                   options.numel, ")");
      if (rowTables()) {
        receiveRows(content.subspan(kUpdateHeaderBytes), meta, decoded);
      } else {
        receiveDense(content.subspan(kUpdateHeaderBytes), meta, decoded);
      }
      MutexLock lock(stateMutex);
      PeerCounters& p = peers[size_t(from)];
      p.bytesReceived += frameBytes;
      ++p.messagesReceived;
    }
  }

  // An UPDATE's codec message of all numel floats.
  void receiveDense(std::span<const uint8_t> message, const UpdateMeta& meta, std::vector<float>& decoded)
      EXCLUDES(inboxMutex) {
    // Codec messages describe themselves; decodeAdd checks the whole message before it adds.
    decoded.assign(options.numel, 0.0f);
    compress::decodeAdd(message, decoded, 1.0f);
    // As the shards refuse non-finite pushes: one NaN would poison this replica for good.
    const auto bad = std::find_if(decoded.begin(), decoded.end(), [](float v) { return !std::isfinite(v); });
    COHORT_CHECK(bad == decoded.end(), InvalidArgument, "an update holding ", std::isnan(*bad) ? "NaN" : "Inf",
                 " at element ", bad - decoded.begin());
    MutexLock lock(inboxMutex);
    float* in = inbox.data();
    for (size_t i = 0; i < decoded.size(); ++i) in[i] += decoded[i];
    received.steps += meta.steps;
    received.samples += meta.samples;
    ++received.messages;
    received.metas.push_back(meta);
  }

  // An UPDATE's row payload: checked whole (its layout, finite values) before it joins the inbox.
  void receiveRows(std::span<const uint8_t> payload, const UpdateMeta& meta, std::vector<float>& decoded)
      EXCLUDES(inboxMutex) {
    const RowPayload rows = parseRowPayload(payload, options.tables);
    decoded.assign(denseLength, 0.0f);
    compress::decodeAdd(rows.denseMessage, decoded, 1.0f);
    auto finite = [](const std::vector<float>& v, const char* where) {
      const auto bad = std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
      COHORT_CHECK(bad == v.end(), InvalidArgument, "an update holding ", std::isnan(*bad) ? "NaN" : "Inf", " in ",
                   where);
    };
    finite(decoded, "its dense part");
    for (const auto& v : rows.values) finite(v, "its rows");
    MutexLock lock(inboxMutex);
    float* in = inbox.data();
    size_t at = 0;
    for (const auto& [b, e] : denseRanges) {
      for (size_t i = b; i < e; ++i) in[i] += decoded[at++];
    }
    for (size_t t = 0; t < options.tables.size(); ++t) {
      const RowTable& table = options.tables[t];
      for (size_t j = 0; j < rows.rows[t].size(); ++j) {
        const uint32_t r = rows.rows[t][j];
        if (!inboxMarks[t][r]) {
          inboxMarks[t][r] = 1;
          received.rows[t].push_back(r);
        }
        float* dst = in + table.offset + uint64_t(r) * table.dim;
        const float* src = rows.values[t].data() + j * table.dim;
        for (uint32_t k = 0; k < table.dim; ++k) dst[k] += src[k];
      }
    }
    received.steps += meta.steps;
    received.samples += meta.samples;
    ++received.messages;
    received.metas.push_back(meta);
  }

  enum class Attempt { kOk, kRetry, kGiveUp };

  // Reads one handshake frame (at most kMaxHandshakeBody) into body; kRetry when the connection
  // ended or the deadline passed.
  Attempt readHandshakeFrame(int fd, Clock::time_point deadline, FrameHeader& h, std::vector<uint8_t>& body,
                             std::string& error) {
    const IoLimits limits{.deadline = deadline, .stop = &stopping};
    std::array<uint8_t, kHeaderBytes> header{};
    IoStatus r = readFull(fd, header.data(), header.size(), limits);
    if (r == IoStatus::kOk) {
      h = parseHeader(header, kMaxHandshakeBody);
      body.resize(h.length);
      r = readFull(fd, body.data(), body.size(), limits);
    }
    if (r == IoStatus::kOk) return Attempt::kOk;
    error = r == IoStatus::kTimeout ? "its handshake timed out" : "it closed the connection during the handshake";
    return Attempt::kRetry;
  }

  // The connector's half of the handshake (gossip/wire.h) with the peer of rank r.
  Attempt handshake(int fd, int r, const HostPort& to, Proof& key, std::string& error) {
    const auto deadline = Clock::now() + secondsToDuration(std::min(options.timeoutSeconds, kHandshakeSeconds));
    const std::string at = " at " + to.str();
    FrameHeader h;
    std::vector<uint8_t> body;
    try {
      if (Attempt a = readHandshakeFrame(fd, deadline, h, body, error); a != Attempt::kOk) return a;
      COHORT_CHECK(h.type == FrameType::kChallenge, InvalidArgument, "it sent ", frameName(h.type),
                   " instead of CHALLENGE");
      const Challenge challenge = parseChallenge(body);
      if (challenge.rank != uint32_t(r) || challenge.worldSize != uint32_t(options.worldSize)) {
        error = "the peer" + at + " says it is rank " + std::to_string(challenge.rank) + " of " +
                std::to_string(challenge.worldSize) + ": a stale or forged address";
        return Attempt::kGiveUp;
      }
      const Transcript t{uint32_t(options.rank), uint32_t(r), uint32_t(options.worldSize), challenge.nonce,
                         freshNonce()};
      const auto hello = helloFrame({kProtocol, t.connector, t.worldSize, t.connectorNonce,
                                     connectorProof(options.token, t)});
      if (std::string failed = writeFrame(fd, hello, secondsToDuration(options.timeoutSeconds)); !failed.empty()) {
        error = failed;
        return Attempt::kRetry;
      }
      if (Attempt a = readHandshakeFrame(fd, deadline, h, body, error); a != Attempt::kOk) return a;
      if (h.type == FrameType::kRefuse) {
        switch (parseRefuse(body)) {
          case RefuseReason::kBusy:
            error = "it was too busy with other handshakes";
            return Attempt::kRetry;
          case RefuseReason::kWrongSecret:
            error = "it refused our proof of the secret (every peer must have the job's --auth-token)";
            return Attempt::kGiveUp;
          case RefuseReason::kDuplicate:
            error = "it already has a stream from this rank";
            return Attempt::kGiveUp;
          case RefuseReason::kBadRank:
            error = "it says rank " + std::to_string(options.rank) + " of " + std::to_string(options.worldSize) +
                    " does not fit its job";
            return Attempt::kGiveUp;
        }
      }
      COHORT_CHECK(h.type == FrameType::kAccept, InvalidArgument, "it sent ", frameName(h.type),
                   " instead of ACCEPT");
      if (!sameProof(parseAccept(body), acceptorProof(options.token, t))) {
        error = "the peer" + at + " did not prove the job's secret: a forged address, or another --auth-token";
        return Attempt::kGiveUp;
      }
      key = sessionKey(options.token, t);
      MutexLock lock(stateMutex);
      peers[size_t(r)].bytesSent += int64_t(hello.size());
      return Attempt::kOk;
    } catch (const InvalidArgument& e) {
      error = "the peer" + at + " broke the handshake: " + e.what();
      return Attempt::kGiveUp;
    }
  }

  // Connects to rank r and runs the handshake, retrying (back-off 20 ms to 1 s) for the timeout:
  // its address is published only once it listens, and a flood of strangers may evict a
  // handshake. Returns -1 when the peer was marked lost instead (or the peer is stopping).
  int openStream(int r, const HostPort& to, Proof& key) {
    const auto deadline = Clock::now() + secondsToDuration(options.timeoutSeconds);
    std::string error = "no attempt";
    auto pause = std::chrono::milliseconds(20);
    while (!stopping.load() && Clock::now() < deadline) {
      const int fd = connectTo(to, Clock::now() + secondsToDuration(options.timeoutSeconds), error);
      if (fd >= 0) {
        const Attempt a = handshake(fd, r, to, key, error);
        if (a == Attempt::kOk) return fd;
        ::close(fd);
        if (a == Attempt::kGiveUp) {
          markLost(r, error);
          return -1;
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
    if (!stopping.load()) markLost(r, "cannot open a stream to " + to.str() + ": " + error);
    return -1;
  }

  void sendLoop(int r, const HostPort& to) {
    Outbox& box = *outboxes[size_t(r)];
    int fd = -1;
    try {
      Proof key{};
      fd = openStream(r, to, key);
      if (fd >= 0) sendFrames(fd, r, box, key);
    } catch (const std::exception& e) {
      markLost(r, std::string("sending to it failed: ") + e.what());
    } catch (...) {
      markLost(r, "sending to it failed");
    }
    if (fd >= 0) ::close(fd);
    box.closed = true;
    stateCv.notifyAll();
  }

  // The rows' values travel in 16 bits under fp16 and bf16 once the warm-up is over; topk,
  // threshold and onebit apply to the dense part only (as under ps, allreduce and average).
  RowValues rowValues(Encoding encoding) const {
    if (encoding != Encoding::kCodec) return RowValues::kFloat32;
    if (codec.kind == compress::CodecKind::Fp16) return RowValues::kFloat16;
    if (codec.kind == compress::CodecKind::Bf16) return RowValues::kBfloat16;
    return RowValues::kFloat32;
  }

  void sendFrames(int fd, int r, Outbox& box, const Proof& key) {
    FrameSealer sealer(key);
    std::vector<float> sending(options.numel);
    std::vector<uint8_t> frame, message;
    // One encoder per destination: its residual is what this peer has not yet sent to that one.
    const size_t encoded = rowTables() ? denseLength : options.numel;
    compress::Encoder encoder(codec, encoded);
    compress::Encoder rawEncoder(compress::CodecSpec{}, encoded);  // warm-up steps
    std::vector<std::vector<uint32_t>> sendingRows(options.tables.size());
    std::vector<float> dense(rowTables() ? denseLength : 0);
    auto send = [&](std::vector<uint8_t>& bytes, bool isUpdate) {
      sealer.seal(bytes);
      const std::string failed = writeFrame(fd, bytes, secondsToDuration(options.timeoutSeconds));
      if (!failed.empty()) {
        markLost(r, failed);
        return false;
      }
      MutexLock lock(stateMutex);
      peers[size_t(r)].bytesSent += int64_t(bytes.size());
      if (isUpdate) ++peers[size_t(r)].messagesSent;
      return true;
    };
    bool ok = true;
    while (ok && !stopping.load() && !box.dead.load()) {
      UpdateMeta meta;
      bool finishing = false;
      PeerReport report;
      {
        MutexLock lock(box.mutex);
        const auto wake = [&] {
          box.mutex.assertHeld();
          return (box.ready && box.hasPending) || box.finishing || stopping.load() || box.dead.load();
        };
        if (!wake()) box.cv.waitFor(box.mutex, std::chrono::milliseconds(kTickMs));
        if (stopping.load() || box.dead.load()) break;
        if (box.hasPending && (box.ready || box.finishing)) {
          std::swap(sending, box.pending);
          if (rowTables()) {
            std::swap(sendingRows, box.pendingRows);
            for (size_t t = 0; t < sendingRows.size(); ++t) {
              for (uint32_t row : sendingRows[t]) box.pendingMarks[t][row] = 0;
            }
          }
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
        int64_t rows = 0, rowBytes = 0;
        meta.encoding = codec.kind == compress::CodecKind::None || meta.step <= options.codecWarmupSteps
                            ? Encoding::kRaw
                            : Encoding::kCodec;
        beginUpdateFrame(meta, frame);
        compress::Encoder& enc = meta.encoding == Encoding::kRaw ? rawEncoder : encoder;
        if (rowTables()) {
          // The floats outside the tables through the codec, the rows as they are; then `sending`
          // is made zero again (it comes back as an outbox's pending), at the same cost.
          size_t at = 0;
          for (const auto& [b, e] : denseRanges) {
            std::copy(sending.begin() + ptrdiff_t(b), sending.begin() + ptrdiff_t(e), dense.begin() + ptrdiff_t(at));
            std::fill(sending.begin() + ptrdiff_t(b), sending.begin() + ptrdiff_t(e), 0.0f);
            at += e - b;
          }
          enc.encode(dense, message);
          for (auto& rows : sendingRows) std::sort(rows.begin(), rows.end());
          const size_t before = frame.size();
          appendRowPayload(frame, message, options.tables, sendingRows, sending, rowValues(meta.encoding));
          // What the rows took on the wire, ids and values: the payload less the dense message,
          // its size, the value type and each table's count.
          rowBytes = int64_t(frame.size() - before - 8 - message.size() - 4 - 4 * options.tables.size());
          rows = 0;
          for (size_t t = 0; t < sendingRows.size(); ++t) {
            const RowTable& table = options.tables[t];
            rows += int64_t(sendingRows[t].size());
            for (uint32_t row : sendingRows[t]) {
              float* v = sending.data() + table.offset + uint64_t(row) * table.dim;
              std::fill(v, v + table.dim, 0.0f);
            }
            sendingRows[t].clear();
          }
        } else {
          enc.encode(sending, message);
          frame.insert(frame.end(), message.begin(), message.end());
        }
        ok = send(frame, true);
        if (ok && rowTables()) {
          MutexLock lock(stateMutex);
          peers[size_t(r)].rowsSent += rows;
          peers[size_t(r)].rowBytesSent += rowBytes;
        }
      }
      if (ok && finishing) {
        auto done = doneFrame(report);
        if (send(done, false)) ::shutdown(fd, SHUT_WR);
        break;
      }
    }
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
    if (box) box->cv.notifyAll();
  }
  if (m.acceptor.joinable()) m.acceptor.join();  // no reader starts after this
  for (auto& box : m.outboxes) {
    if (box && box->thread.joinable()) box->thread.join();
  }
  std::vector<std::thread> readers;
  {
    MutexLock lock(m.readersMutex);
    readers.swap(m.readers);
  }
  for (auto& t : readers) t.join();  // each closes its own stream
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

void Peer::publish(std::span<const float> update, const UpdateMeta& meta, std::span<const int> to,
                   std::span<const std::vector<uint32_t>> rows) {
  Impl& m = *impl_;
  COHORT_CHECK(update.size() == m.options.numel, InvalidArgument, "gossip: an update of ", update.size(),
               " floats, expected ", m.options.numel);
  COHORT_CHECK(rows.size() == m.options.tables.size(), InvalidArgument, "gossip: rows of ", rows.size(),
               " tables for a model of ", m.options.tables.size());
  for (size_t t = 0; t < rows.size(); ++t) {
    for (uint32_t row : rows[t]) {
      COHORT_CHECK(row < m.options.tables[t].rows, InvalidArgument, "gossip: row ", row, " of a table of ",
                   m.options.tables[t].rows, " rows");
    }
  }
  for (int r = 0; r < int(m.outboxes.size()); ++r) {
    auto& box = m.outboxes[size_t(r)];
    if (!box || box->dead.load() || box->closed.load()) continue;
    const bool chosen = std::find(to.begin(), to.end(), r) != to.end();
    {
      MutexLock lock(box->mutex);
      if (m.rowTables()) {
        // pending is zero outside its listed rows: add, whether or not something is pending.
        float* p = box->pending.data();
        for (const auto& [b, e] : m.denseRanges) {
          for (size_t i = b; i < e; ++i) p[i] += update[i];
        }
        for (size_t t = 0; t < rows.size(); ++t) {
          const RowTable& table = m.options.tables[t];
          for (uint32_t row : rows[t]) {
            if (!box->pendingMarks[t][row]) {
              box->pendingMarks[t][row] = 1;
              box->pendingRows[t].push_back(row);
            }
            const size_t at = size_t(table.offset + uint64_t(row) * table.dim);
            for (size_t k = at; k < at + table.dim; ++k) p[k] += update[k];
          }
        }
      } else if (!box->hasPending) {
        std::copy(update.begin(), update.end(), box->pending.begin());
      } else {
        float* p = box->pending.data();
        for (size_t i = 0; i < update.size(); ++i) p[i] += update[i];
      }
      if (!box->hasPending) {  // the first update since the last send: its header starts here
        box->meta = meta;
        box->meta.sender = uint32_t(m.options.rank);
        box->meta.numel = m.options.numel;
        box->meta.steps = 0;
        box->meta.samples = 0;
        box->hasPending = true;
      }
      box->meta.version = meta.version;
      box->meta.step = meta.step;
      box->meta.steps += meta.steps;
      box->meta.samples += meta.samples;
      box->ready = box->ready || chosen;
    }
    if (chosen) box->cv.notifyOne();
  }
}

Drained Peer::drain(std::vector<float>& into) {
  Impl& m = *impl_;
  COHORT_CHECK(into.size() == m.options.numel, InvalidArgument, "gossip: drain into ", into.size(), " floats, expected ",
               m.options.numel);
  MutexLock lock(m.inboxMutex);
  std::swap(into, m.inbox);
  Drained out = std::move(m.received);
  m.received = Drained{};
  m.received.rows.resize(m.options.tables.size());
  for (size_t t = 0; t < out.rows.size(); ++t) {
    for (uint32_t r : out.rows[t]) m.inboxMarks[t][r] = 0;
  }
  return out;
}

void Peer::finish(const PeerReport& report) {
  Impl& m = *impl_;
  for (auto& box : m.outboxes) {
    if (!box) continue;
    {
      MutexLock lock(box->mutex);
      box->finishing = true;
      box->report = report;
    }
    box->cv.notifyOne();
  }
  const auto deadline = Clock::now() + secondsToDuration(m.options.timeoutSeconds);
  auto settled = [&](int r) {
    m.stateMutex.assertHeld();
    const PeerCounters& p = m.peers[size_t(r)];
    const auto& box = m.outboxes[size_t(r)];
    return p.lost || (p.finished && (!box || box->closed.load()));
  };
  std::vector<int> late;
  {
    MutexLock lock(m.stateMutex);
    while (true) {
      late.clear();
      for (int r = 0; r < m.options.worldSize; ++r) {
        if (r != m.options.rank && !settled(r)) late.push_back(r);
      }
      if (late.empty() || Clock::now() >= deadline) break;
      m.stateCv.waitFor(m.stateMutex, std::chrono::milliseconds(kTickMs));
    }
  }
  for (int r : late) {
    m.markLost(r, "it did not finish within " + std::to_string(int(m.options.timeoutSeconds)) + " s of this peer");
  }
}

std::vector<int> Peer::livePeers() const {
  MutexLock lock(impl_->stateMutex);
  std::vector<int> out;
  for (int r = 0; r < impl_->options.worldSize; ++r) {
    if (r != impl_->options.rank && !impl_->peers[size_t(r)].lost) out.push_back(r);
  }
  return out;
}

std::vector<PeerCounters> Peer::counters() const {
  MutexLock lock(impl_->stateMutex);
  return impl_->peers;
}

int64_t Peer::bytesSent() const {
  MutexLock lock(impl_->stateMutex);
  int64_t n = 0;
  for (const auto& p : impl_->peers) n += p.bytesSent;
  return n;
}

int64_t Peer::bytesReceived() const {
  MutexLock lock(impl_->stateMutex);
  int64_t n = 0;
  for (const auto& p : impl_->peers) n += p.bytesReceived;
  return n;
}

int64_t Peer::refusedStreams() const {
  MutexLock lock(impl_->stateMutex);
  return impl_->refused;
}

}  // namespace cohort::gossip
