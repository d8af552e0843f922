// A gossip Peer's connecting side: each sender thread connects to its peer, proves the job's
// secret in the connector's half of the handshake (gossip/wire.h), retrying while the peer is not
// yet listening or too busy, and then sends on that stream (peer_outbox.cpp).
#include "gossip/peer_internal.h"

#include "base/socket_io.h"

#include <cohort/error.h>

#include <unistd.h>

#include <algorithm>

namespace cohort::gossip {

Peer::Impl::Attempt Peer::Impl::readHandshakeFrame(int fd, Clock::time_point deadline, FrameHeader& h,
                                                   std::vector<uint8_t>& body, std::string& error) {
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

Peer::Impl::Attempt Peer::Impl::handshake(int fd, int r, const HostPort& to, Proof& key, std::string& error) {
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
    const Transcript t{uint32_t(options.rank), uint32_t(r), uint32_t(options.worldSize), challenge.nonce, freshNonce()};
    const auto hello =
        helloFrame({kProtocol, t.connector, t.worldSize, t.connectorNonce, connectorProof(options.token, t)});
    if (std::string failed = writeFrame(fd, hello, secondsToDuration(options.timeoutSeconds), stopping);
        !failed.empty()) {
      error = failed;
      return Attempt::kRetry;
    }
    if (Attempt a = readHandshakeFrame(fd, deadline, h, body, error); a != Attempt::kOk) return a;
    if (h.type == FrameType::kRefuse) {
      switch (parseRefuse(body)) {
        case RefuseReason::kBusy: error = "it was too busy with other handshakes"; return Attempt::kRetry;
        case RefuseReason::kWrongSecret:
          error = "it refused our proof of the secret (every peer must have the job's --auth-token)";
          return Attempt::kGiveUp;
        case RefuseReason::kDuplicate: error = "it already has a stream from this rank"; return Attempt::kGiveUp;
        case RefuseReason::kBadRank:
          error = "it says rank " + std::to_string(options.rank) + " of " + std::to_string(options.worldSize) +
                  " does not fit its job";
          return Attempt::kGiveUp;
      }
    }
    COHORT_CHECK(h.type == FrameType::kAccept, InvalidArgument, "it sent ", frameName(h.type), " instead of ACCEPT");
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

int Peer::Impl::openStream(int r, const HostPort& to, Proof& key) {
  const auto deadline = Clock::now() + secondsToDuration(options.timeoutSeconds);
  std::string error = "no attempt";
  auto pause = std::chrono::milliseconds(20);
  while (!stopping.load() && Clock::now() < deadline) {
    const int fd = connectTo(to, std::min(deadline, Clock::now() + secondsToDuration(kConnectAttemptSeconds)), error);
    if (fd >= 0) {
      const Attempt a = handshake(fd, r, to, key, error);
      if (a == Attempt::kOk) return fd;
      // Lost (and said so) before the close, which the other side may be waiting to see.
      if (a == Attempt::kGiveUp) markLost(r, error);
      ::close(fd);
      if (a == Attempt::kGiveUp) return -1;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(1000));
  }
  if (!stopping.load()) markLost(r, "cannot open a stream to " + to.str() + ": " + error);
  return -1;
}

void Peer::Impl::sendLoop(int r, const HostPort& to) {
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

void Peer::connect(const std::vector<HostPort>& addresses) {
  Impl& m = *impl_;
  COHORT_CHECK(int(addresses.size()) == m.options.worldSize, InvalidArgument, "gossip: ", addresses.size(),
               " addresses for ", m.options.worldSize, " peers");
  for (int r = 0; r < m.options.worldSize; ++r) {
    if (r == m.options.rank) continue;
    m.outboxes[size_t(r)]->thread = std::thread([&m, r, to = addresses[size_t(r)]] { m.sendLoop(r, to); });
  }
}

}  // namespace cohort::gossip
