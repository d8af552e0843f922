// A gossip Peer's construction, the state its threads share (who is lost, who finished, the
// counters), finish() and the helpers its parts share (gossip/peer_internal.h).
#include "gossip/peer_internal.h"

#include "base/host_port.h"
#include "base/socket_io.h"

#include <cohort/error.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace cohort::gossip {

std::string writeFrame(int fd, const std::vector<uint8_t>& frame, Clock::duration timeout,
                       const std::atomic<bool>& stop) {
  const IoStatus status = writeFull(fd, frame.data(), frame.size(), {.idle = timeout, .stop = &stop});
  if (status == IoStatus::kOk) return "";
  if (status == IoStatus::kTimeout) return "a send timed out";
  if (status == IoStatus::kStopped) return "this peer is stopping";
  return std::string("send failed: ") + std::strerror(errno);
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

void WarningLimiter::warn(const std::string& message) {
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
  env_.log(LogLevel::kWarning,
           leftOut == 0 ? message : message + " (" + std::to_string(leftOut) + " more like it left out of the log)");
}

HostPort parsePeerAddress(const std::string& text) {
  std::optional<HostPort> parsed = parseHostPort(text);
  COHORT_CHECK(parsed.has_value(), InvalidArgument, "gossip: bad peer address '", text,
               "': expected host:port or [v6 host]:port with a port in 1..65535");
  return *parsed;
}

Peer::Impl::Impl(PeerOptions o)
    : options(std::move(o)),
      env(envOrStandard(options.env)),
      codec(compress::CodecSpec::parse(options.codec)),
      strangers(env) {
  // The largest message a codec makes is an index and a value per entry, plus headers.
  const uint64_t limit = kUpdateHeaderBytes + 3 * uint64_t(options.numel) * sizeof(float) + 4096 + kTagBytes;
  COHORT_CHECK(limit <= UINT32_MAX, InvalidArgument, "a model of ", options.numel,
               " parameters is too large for gossip frames (4 GiB at most)");
  maxBody = uint32_t(limit);
  size_t end = 0;
  for (const RowTable& t : options.tables) {
    COHORT_CHECK(t.dim > 0 && t.offset >= end && t.offset + uint64_t(t.rows) * t.dim <= options.numel, InvalidArgument,
                 "gossip: row tables must be disjoint, in order, and inside the ", options.numel,
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

void Peer::Impl::markLost(int r, const std::string& why) {
  {
    MutexLock lock(stateMutex);
    PeerCounters& p = peers[size_t(r)];
    if (p.lost || p.finished || stopping.load()) return;
    p.lost = true;
  }
  env.log(LogLevel::kWarning, who(r) + " is lost (" + why + "); training goes on without it");
  if (auto& box = outboxes[size_t(r)]) {
    box->dead = true;
    box->cv.notifyAll();
  }
  stateCv.notifyAll();
}

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
  if (late.empty()) return;
  char within[32];
  std::snprintf(within, sizeof(within), "%g", m.options.timeoutSeconds);
  for (int r : late) {
    m.markLost(r, std::string("it did not finish within --timeout (") + within + " s) of this peer's end");
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

std::vector<int> Peer::trainingPeers() const {
  MutexLock lock(impl_->stateMutex);
  std::vector<int> out;
  for (int r = 0; r < impl_->options.worldSize; ++r) {
    const PeerCounters& p = impl_->peers[size_t(r)];
    if (r != impl_->options.rank && !p.lost && !p.finished) out.push_back(r);
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
