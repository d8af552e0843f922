// The gossip wire format: length-prefixed frames on a TCP stream, one stream per (sender,
// receiver) pair, written only by the sender after a handshake in both directions. Torch-free,
// and pure functions, so the framing and the proofs are unit-tested without sockets.
//
//   frame     = magic u32 "CGSP" | type u8 | 3 zero bytes | body length u32 | body
//   CHALLENGE = protocol u32 | acceptor rank u32 | world size u32 | acceptor nonce (32)
//   HELLO     = protocol u32 | connector rank u32 | world size u32 | connector nonce (32) | proof (32)
//   ACCEPT    = proof (32)
//   REFUSE    = reason u32
//   UPDATE    = sender u32 | encoding u32 (0 uncompressed, 1 the job's codec) | version i64 | step i64
//               | steps i64 | samples i64 | numel u64 | payload | tag (16)
//     payload = codec message (compress/codec.h) of all numel floats; or, for a model with row
//               tables (sparse embedding tables, PeerOptions::tables), the row payload:
//               message size u64 | codec message of the floats outside the tables | row values
//               u32 (RowValues) | per table, in order: count u32 | rows u32[count] (strictly
//               increasing, below the table's rows) | their values [count * dim], f32 or 16-bit
//               (binary16 or bfloat16) as row values says. Only the rows changed since the last
//               UPDATE on the stream travel; the codec applies to the part outside the tables,
//               and fp16/bf16 also to the rows' values (topk, threshold, onebit leave them f32).
//   DONE      = the sender's PeerReport (8 i64) | tag (16)
// Integers are little-endian.
//
// The handshake and the tags are base/auth_channel.h's. The acceptor (the receiving end) speaks
// first: CHALLENGE with a fresh random nonce. The connector answers HELLO: its own nonce and its
// proof under the label "cohort gossip connector", where the transcript is a zero byte, protocol,
// connector rank, acceptor rank, world size and both nonces. The acceptor checks it and answers
// ACCEPT with its proof ("cohort gossip acceptor"), which the connector checks in turn; or REFUSE
// with a reason, and closes. The session key ("cohort gossip session") tags every later frame in
// the stream's one direction (to the acceptor), over header | body without the tag. Before ACCEPT
// a frame's body is at most kMaxHandshakeBody.
//
// What this holds against a stranger who can connect to a peer's port, forge the address a peer
// connects to, and read the traffic, but does not know the secret: auth_channel.h's rules; a
// proof harvested at a forged address names that connection's nonces, ranks and direction and
// opens nothing else; a stranger who relays a live handshake between two real peers sees the
// updates go by but cannot insert, change, reorder or replay a frame, only drop the stream, which
// the peers see as a lost peer.
#pragma once

#include "base/auth_channel.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort::gossip {

constexpr uint32_t kMagic = 0x50534743;  // "CGSP"
constexpr uint32_t kProtocol = 4;  // 3: frame tags are AES-GMAC; 4: row payloads say how their values travel
constexpr size_t kHeaderBytes = 12;
constexpr size_t kUpdateHeaderBytes = 48;
constexpr size_t kNonceBytes = auth::kNonceBytes;
constexpr size_t kProofBytes = auth::kProofBytes;
constexpr size_t kTagBytes = auth::kTagBytes;
// The largest body a peer reads before the other end proved the secret (HELLO is 76 bytes).
constexpr uint32_t kMaxHandshakeBody = 256;

enum class FrameType : uint8_t { kHello = 1, kUpdate = 2, kDone = 3, kChallenge = 4, kAccept = 5, kRefuse = 6 };

using Nonce = auth::Nonce;
using Proof = auth::Proof;

struct FrameHeader {
  FrameType type = FrameType::kHello;
  uint32_t length = 0;  // of the body
};

// Parses 12 header bytes; throws InvalidArgument on a wrong magic, an unknown type, or a body
// longer than maxBody.
FrameHeader parseHeader(std::span<const uint8_t, kHeaderBytes> bytes, uint32_t maxBody);

// The acceptor's first frame.
struct Challenge {
  uint32_t protocol = kProtocol;
  uint32_t rank = 0;  // the acceptor's
  uint32_t worldSize = 0;
  Nonce nonce{};
};

// The connector's answer.
struct Hello {
  uint32_t protocol = kProtocol;
  uint32_t rank = 0;  // the connector's
  uint32_t worldSize = 0;
  Nonce nonce{};
  Proof proof{};
};

// Why an acceptor refused a stream, sent before it closes. Unauthenticated, so only advice: the
// connector gives up on kWrongSecret, kDuplicate and kBadRank, and tries again on kBusy.
enum class RefuseReason : uint32_t { kWrongSecret = 1, kDuplicate = 2, kBadRank = 3, kBusy = 4 };

// Everything both ends' proofs and the session key are bound to.
struct Transcript {
  uint32_t connector = 0;
  uint32_t acceptor = 0;
  uint32_t worldSize = 0;
  Nonce acceptorNonce{};
  Nonce connectorNonce{};
};

Proof connectorProof(const std::string& secret, const Transcript& t);
Proof acceptorProof(const std::string& secret, const Transcript& t);
Proof sessionKey(const std::string& secret, const Transcript& t);
// A fresh nonce from the kernel's random source.
Nonce freshNonce();
bool sameProof(const Proof& a, const Proof& b);

// How an UPDATE's payload is encoded.
enum class Encoding : uint32_t { kRaw = 0, kCodec = 1 };

// What an UPDATE carries besides the codec message. Versions count updates (steps) folded into a
// replica, its own and received ones; they measure staleness (gossip/peer.h).
struct UpdateMeta {
  uint32_t sender = 0;
  Encoding encoding = Encoding::kRaw;
  int64_t version = 0;  // the sender's version after its latest step in this message
  int64_t step = 0;     // the sender's own steps, the latest in this message
  int64_t steps = 0;    // steps summed in this message (several when the link was busy)
  int64_t samples = 0;  // examples those steps trained on
  uint64_t numel = 0;   // floats the update has
};

// What a peer says about itself when it finishes (its DONE), for the chief's report.
struct PeerReport {
  int64_t steps = 0;
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  int64_t messagesApplied = 0;
  int64_t stalenessSum = 0;
  int64_t stalenessMax = 0;
  int64_t peersLost = 0;
  int64_t stopJob = 0;  // 1 from the chief when it stopped the job early: the others stop too
};

// The tags of one stream's frames after the handshake: keyed by the session key, numbered from 0
// in the order the frames are written (so read), one object per end.
class FrameSealer {
 public:
  explicit FrameSealer(const Proof& sessionKey);
  ~FrameSealer();
  FrameSealer(const FrameSealer&) = delete;
  FrameSealer& operator=(const FrameSealer&) = delete;

  // Writes the body length (the tag included) into frame's header and appends the tag.
  void seal(std::vector<uint8_t>& frame);
  // Checks the tag at the end of body (header: the frame's 12 bytes); returns the body without
  // it. Throws InvalidArgument when the tag is missing or wrong.
  std::span<const uint8_t> open(std::span<const uint8_t, kHeaderBytes> header, std::span<const uint8_t> body);

 private:
  auth::FrameTags tags_;
};

// Handshake frames, complete with their length.
std::vector<uint8_t> challengeFrame(const Challenge& challenge);
std::vector<uint8_t> helloFrame(const Hello& hello);
std::vector<uint8_t> acceptFrame(const Proof& proof);
std::vector<uint8_t> refuseFrame(RefuseReason reason);
// DONE and UPDATE without their tag: the caller seals them.
std::vector<uint8_t> doneFrame(const PeerReport& report);
// The frame with its header and meta; the caller appends the codec message to `frame` after
// this, then seals it.
void beginUpdateFrame(const UpdateMeta& meta, std::vector<uint8_t>& frame);

// Body parsers; throw InvalidArgument naming what is wrong (never reading past body).
Challenge parseChallenge(std::span<const uint8_t> body);
Hello parseHello(std::span<const uint8_t> body);
Proof parseAccept(std::span<const uint8_t> body);
RefuseReason parseRefuse(std::span<const uint8_t> body);
PeerReport parseDone(std::span<const uint8_t> body);
// The meta, and the payload is body.subspan(kUpdateHeaderBytes).
UpdateMeta parseUpdate(std::span<const uint8_t> body);

// A table of rows inside an update's numel floats: floats [offset, offset + rows * dim), row r at
// offset + r * dim.
struct RowTable {
  uint64_t offset = 0;
  uint32_t rows = 0;
  uint32_t dim = 0;
};

// How a row payload's values travel: float32, or 16 bits under --codec fp16 and bf16 (rounded to
// nearest even, finite values beyond fp16's range saturating: compress::floatToHalf).
enum class RowValues : uint32_t { kFloat32 = 0, kFloat16 = 1, kBfloat16 = 2 };
// 4 for kFloat32, 2 for the 16-bit forms.
size_t rowValueBytes(RowValues values);

// Appends the row payload: denseMessage, then for each table its `rows` (sorted, distinct) with
// their values read from `update` (the whole numel floats), converted as `values` says.
void appendRowPayload(std::vector<uint8_t>& frame, std::span<const uint8_t> denseMessage,
                      std::span<const RowTable> tables, std::span<const std::vector<uint32_t>> rows,
                      std::span<const float> update, RowValues values = RowValues::kFloat32);

struct RowPayload {
  std::span<const uint8_t> denseMessage;       // within the payload parsed
  RowValues valueType = RowValues::kFloat32;   // how the values travelled
  std::vector<std::vector<uint32_t>> rows;     // per table
  std::vector<std::vector<float>> values;      // per table, rows * dim floats (16-bit ones widened)
};
// Throws InvalidArgument naming what is wrong (truncated, an unknown row value type, a row beyond
// its table or out of order, bytes left over); never reads past payload.
RowPayload parseRowPayload(std::span<const uint8_t> payload, std::span<const RowTable> tables);

}  // namespace cohort::gossip
