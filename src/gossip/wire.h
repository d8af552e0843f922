// The gossip wire format: length-prefixed frames on a TCP stream, one stream per (sender,
// receiver) pair, written only by the sender. Torch-free, and pure functions, so the framing is
// unit-tested without sockets.
//
//   frame  = magic u32 "CGSP" | type u8 | 3 zero bytes | body length u32 | body
//   HELLO  = protocol u32 | sender rank u32 | world size u32 | token length u32 | token
//   UPDATE = sender u32 | encoding u32 (0 uncompressed, 1 the job's codec) | version i64 | step i64
//            | steps i64 | samples i64 | numel u64 | codec message (compress/codec.h, self-describing)
//   DONE   = the sender's PeerReport (8 i64)
// Integers are little-endian. The first frame on a stream must be HELLO with the job's token;
// anything else closes the stream. DONE is the last frame: the sender finished and everything it
// sent before is on the stream.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort::gossip {

constexpr uint32_t kMagic = 0x50534743;  // "CGSP"
constexpr uint32_t kProtocol = 1;
constexpr size_t kHeaderBytes = 12;
constexpr size_t kUpdateHeaderBytes = 48;

enum class FrameType : uint8_t { kHello = 1, kUpdate = 2, kDone = 3 };

struct FrameHeader {
  FrameType type = FrameType::kHello;
  uint32_t length = 0;  // of the body
};

// Parses 12 header bytes; throws InvalidArgument on a wrong magic, an unknown type, or a body
// longer than maxBody.
FrameHeader parseHeader(std::span<const uint8_t, kHeaderBytes> bytes, uint32_t maxBody);

struct Hello {
  uint32_t protocol = kProtocol;
  uint32_t rank = 0;
  uint32_t worldSize = 0;
  std::string token;
};

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
  int64_t dropped = 0;  // unused slot kept at zero; the format has room for one more counter
};

std::vector<uint8_t> helloFrame(const Hello& hello);
std::vector<uint8_t> doneFrame(const PeerReport& report);
// The frame with its header and meta; the caller appends the codec message to `frame` after
// this, then calls finishUpdateFrame to write the body length.
void beginUpdateFrame(const UpdateMeta& meta, std::vector<uint8_t>& frame);
void finishUpdateFrame(std::vector<uint8_t>& frame);

// Body parsers; throw InvalidArgument naming what is wrong (never reading past body).
Hello parseHello(std::span<const uint8_t> body);
PeerReport parseDone(std::span<const uint8_t> body);
// The meta, and the codec message is body.subspan(kUpdateHeaderBytes).
UpdateMeta parseUpdate(std::span<const uint8_t> body);

// Compares two tokens in time independent of where they differ.
bool sameToken(const std::string& a, const std::string& b);

}  // namespace cohort::gossip
