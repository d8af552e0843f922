// One gossip peer's transport (torch-free): a listening socket that receives the other peers'
// updates, and one sender thread per peer that sends them this peer's.
//
// Nothing the training thread does waits for another peer:
// - publish() adds the step's update into a per-destination accumulator (one buffer per peer,
//   so memory is bounded) and wakes that peer's sender thread. While a send to a slow peer is
//   under way, further steps pile up in its accumulator and leave as one message: nothing is
//   dropped, a slow link just carries fewer, larger sums.
// - Receiver threads (one per incoming stream) decode each UPDATE into an inbox buffer as it
//   arrives; drain() swaps that buffer out in O(1) and the caller adds it to its parameters.
// - A peer whose stream fails (a send error, EOF before its DONE, a send timeout, a malformed or
//   non-finite update) is logged once and dropped; training goes on. finish() is the one place
//   that waits, with a deadline.
//
// Strangers on the port (gossip/wire.h says what the handshake proves): the acceptor thread runs
// every handshake itself, without a thread or more than a 268-byte buffer per connection, at most
// kMaxPendingHandshakes at once (a new one beyond that evicts the oldest, so a flood cannot lock
// the real peers out for longer than it lasts), each for at most kHandshakeSeconds. A refused
// socket is closed at once. One authenticated stream per rank: a second one claiming a rank that
// has (or had) a stream is refused. accept() backs off when descriptors run out, and warnings
// about strangers are rate-limited (one a second, with a count of those left out). Every thread
// body catches everything: a failure is a lost peer or a refused connection, never a crash.
#pragma once

#include "gossip/wire.h"

#include <cohort/env.h>
#include <cohort/host_port.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort::gossip {

struct PeerOptions {
  int rank = 0;
  int worldSize = 1;
  std::string token;                  // the job's secret: every stream's handshake must prove it
  std::string bindHost = "127.0.0.1";  // where to listen (port chosen by the kernel)
  double timeoutSeconds = 60;         // connect, each send, and finish()
  size_t numel = 0;                   // floats in an update
  std::string codec = "none";         // --codec (compress/codec.h); "none": float32
  int64_t codecWarmupSteps = 0;       // updates of steps below this go raw (uncompressed)
  // Row tables inside an update (sparse embedding tables), by increasing offset, disjoint: of
  // these only the rows publish() names are read, accumulated and sent, so what a step costs
  // follows the rows it changed. The codec applies to the floats outside them; the rows' values
  // travel as 16 bits under fp16 and bf16 (after the warm-up), as float32 under the other codecs.
  std::vector<RowTable> tables;
  Env* env = nullptr;  // where warnings go (a lost peer, refused strangers); null: Env::standard()
};

// What the receivers folded into the inbox since the last drain().
struct Drained {
  int64_t steps = 0;    // the other peers' steps summed in it
  int64_t samples = 0;  // their examples
  int64_t messages = 0;
  std::vector<UpdateMeta> metas;  // one per message, for staleness
  // Per row table (PeerOptions::tables): the rows that hold received values (distinct, in no
  // order); the tables' other rows in the drained buffer are zero.
  std::vector<std::vector<uint32_t>> rows;
};

// Per-peer counters, indexed by rank.
struct PeerCounters {
  int64_t bytesSent = 0;        // frame bytes this peer wrote to that one
  int64_t bytesReceived = 0;    // frame bytes read from that one
  int64_t messagesSent = 0;
  int64_t messagesReceived = 0;
  int64_t rowsSent = 0;         // with row tables: rows this peer sent to that one (a row once a message)
  int64_t rowBytesSent = 0;     // what their ids and values took in the frames
  bool lost = false;            // its stream failed before it finished
  bool finished = false;        // its DONE arrived
  std::optional<PeerReport> report;  // from its DONE
};

// At most this many handshakes run at once; the oldest is evicted for a new one.
constexpr int kMaxPendingHandshakes = 64;
// A connection has this long (or the peer's timeout, if shorter) to complete its handshake.
constexpr double kHandshakeSeconds = 10;

// "host:port" or "[v6]:port" as peers publish it; throws InvalidArgument naming the text when it
// is not one (no port, a port outside 1..65535, trailing garbage).
HostPort parsePeerAddress(const std::string& text);

class Peer {
 public:
  // Binds and starts listening; throws CommError when it cannot.
  explicit Peer(PeerOptions options);
  ~Peer();
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  // host:port the others should connect to.
  HostPort address() const;

  // Starts one sender thread per other peer, connecting to addresses[rank] (this peer's own entry
  // is ignored).
  void connect(const std::vector<HostPort>& addresses);

  // Adds update (numel floats, made by this peer's step meta.step) to every live peer's
  // accumulator and asks the peers in `to` to send theirs now. Never blocks on the network.
  // With row tables, `rows` names per table the rows of update that hold this step's change
  // (distinct); the tables' other rows of update are not read.
  void publish(std::span<const float> update, const UpdateMeta& meta, std::span<const int> to,
               std::span<const std::vector<uint32_t>> rows = {});

  // Swaps the inbox with `into` (which must hold numel floats, all zero): afterwards `into` holds
  // the sum of the updates received since the last drain, and the inbox is the old `into`.
  Drained drain(std::vector<float>& into);

  // Sends what is left and DONE (with `report`) to every live peer, then waits until every other
  // peer finished or was lost, at most timeoutSeconds; peers still silent then count as lost.
  // (The destructor waits for none: a send or connect under way ends within a tick or a second.)
  void finish(const PeerReport& report);

  // Ranks of the peers still live (not lost), this one excluded.
  std::vector<int> livePeers() const;
  // Of those, the ones still training (their DONE has not arrived): where a step's change is worth
  // sending now. A finished one still gets what is left in its accumulator at finish().
  std::vector<int> trainingPeers() const;
  std::vector<PeerCounters> counters() const;
  int64_t bytesSent() const;
  int64_t bytesReceived() const;
  // Connections refused: a wrong proof, protocol or rank, a duplicate rank, a malformed or late
  // handshake, or evicted by a flood.
  int64_t refusedStreams() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::gossip
