// Inside a gossip Peer (gossip/peer.h says what one does): Peer::Impl and what its parts share.
// Impl's methods live with their idea:
//   peer.cpp         construction, the peers' state and counters, finish()
//   peer_accept.cpp  the listening socket; the acceptor thread runs every incoming handshake
//   peer_connect.cpp the connector's handshake; each sender thread opens its stream
//   peer_inbox.cpp   reader threads: the other peers' frames into the inbox; drain()
//   peer_outbox.cpp  publish() into the per-peer accumulators; sender threads encode and send them
#pragma once

#include "gossip/peer.h"

#include "base/thread_annotations.h"
#include "compress/codec.h"

#include <cohort/env.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace cohort::gossip {

using Clock = std::chrono::steady_clock;

// How often blocked threads look at the stop flag.
constexpr int kTickMs = 100;

inline Clock::duration secondsToDuration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Writes a whole frame; `timeout` bounds each wait for the peer to take more of it (a slow link
// that moves is not a dead peer), and the write ends within a tick of `stop` turning true.
// Returns an empty string or what failed.
std::string writeFrame(int fd, const std::vector<uint8_t>& frame, Clock::duration timeout,
                       const std::atomic<bool>& stop);

// One connection attempt waits at most this long (or the timeout, if shorter), so that a peer
// being destroyed does not wait out a connect to a silent address; openStream() retries.
constexpr double kConnectAttemptSeconds = 1;

// "HELLO", "UPDATE", ...: for messages.
const char* frameName(FrameType t);

// At most one warning a second through env; the next one logged says how many were left out. For
// what strangers cause (refused connections, accept failures), which they can cause by the
// thousand.
class WarningLimiter {
 public:
  explicit WarningLimiter(Env& env) : env_(env) {}
  void warn(const std::string& message) EXCLUDES(mu_);

 private:
  Env& env_;
  Mutex mu_;
  bool printed_ GUARDED_BY(mu_) = false;
  Clock::time_point last_ GUARDED_BY(mu_);
  int64_t leftOut_ GUARDED_BY(mu_) = 0;
};

// A connection accepted but not yet authenticated. The acceptor thread alone touches these.
struct Handshake {
  int fd = -1;
  std::string from;  // host:port, for the log
  Clock::time_point deadline;
  Nonce nonce{};  // sent in our CHALLENGE
  std::array<uint8_t, kHeaderBytes + kMaxHandshakeBody> buffer{};
  size_t got = 0;
};

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
  Env& env;
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

  // peer.cpp
  explicit Impl(PeerOptions o);
  std::string who(int r) const { return "gossip peer " + std::to_string(r); }
  // Logs once; the peer is dropped from sending and from what finish() waits for. Not while this
  // peer is stopping: a transfer it cut short is no loss of the other's.
  void markLost(int r, const std::string& why) EXCLUDES(stateMutex);

  // peer_accept.cpp
  // Binds, listens and starts the acceptor thread; throws CommError when it cannot.
  void listen();
  // Closes a connection that is not a peer's stream, at once; `reason` is sent first when there is one.
  void refuse(int fd, const std::string& from, const std::string& why, std::optional<RefuseReason> reason)
      EXCLUDES(stateMutex);
  // The acceptor thread: accepts connections and runs every handshake, without blocking on any.
  void acceptLoop();
  void acceptOne(std::vector<Handshake>& pending, std::chrono::milliseconds& pause, Clock::time_point& pausedUntil);
  // Reads what has arrived on a handshake; true when it is over (a stream, or refused).
  bool advance(Handshake& h);
  // A complete HELLO: refuses it, or makes the connection that rank's stream.
  void welcome(const Handshake& h, const Hello& hello) EXCLUDES(stateMutex, readersMutex);

  // peer_connect.cpp
  enum class Attempt { kOk, kRetry, kGiveUp };
  // Reads one handshake frame (at most kMaxHandshakeBody) into body; kRetry when the connection
  // ended or the deadline passed.
  Attempt readHandshakeFrame(int fd, Clock::time_point deadline, FrameHeader& h, std::vector<uint8_t>& body,
                             std::string& error);
  // The connector's half of the handshake (gossip/wire.h) with the peer of rank r.
  Attempt handshake(int fd, int r, const HostPort& to, Proof& key, std::string& error);
  // Connects to rank r and runs the handshake, retrying (back-off 20 ms to 1 s) for the timeout:
  // its address is published only once it listens, and a flood of strangers may evict a
  // handshake. Returns -1 when the peer was marked lost instead (or the peer is stopping).
  int openStream(int r, const HostPort& to, Proof& key);
  // The sender thread of rank r: opens its stream, then sendFrames() until DONE or a failure.
  void sendLoop(int r, const HostPort& to);

  // peer_inbox.cpp
  // One authenticated incoming stream until its DONE, its end, or a malformed frame. Closes fd.
  void readLoop(int fd, int from, Proof key);
  void readFrames(int fd, int from, const Proof& key);
  // An UPDATE's codec message of all numel floats.
  void receiveDense(std::span<const uint8_t> message, const UpdateMeta& meta, std::vector<float>& decoded)
      EXCLUDES(inboxMutex);
  // An UPDATE's row payload: checked whole (its layout, finite values) before it joins the inbox.
  void receiveRows(std::span<const uint8_t> payload, const UpdateMeta& meta, std::vector<float>& decoded)
      EXCLUDES(inboxMutex);

  // peer_outbox.cpp
  // How the rows' values travel under `encoding`.
  RowValues rowValues(Encoding encoding) const;
  // Sends what publish() accumulates in box on the stream fd until DONE, a failure or stop.
  void sendFrames(int fd, int r, Outbox& box, const Proof& key);
};

}  // namespace cohort::gossip
