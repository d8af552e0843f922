#include "gossip/wire.h"

#include "base/coding.h"
#include "base/crypto.h"
#include "compress/codec.h"

#include <cohort/error.h>

#include <algorithm>
#include <cstring>

namespace cohort::gossip {

namespace {

// Throws when a read of `what`'s body (of `size` bytes) ran past its end.
void checkFits(const ByteReader& r, const char* what, size_t size) {
  COHORT_CHECK(r.ok(), InvalidArgument, "gossip ", what, " frame is truncated (", size, " bytes)");
}

std::vector<uint8_t> withHeader(FrameType type) {
  std::vector<uint8_t> frame;
  putFixed32(frame, kMagic);
  frame.push_back(uint8_t(type));
  frame.insert(frame.end(), 3, 0);
  putFixed32(frame, 0);  // length, written at the end
  return frame;
}

void setLength(std::vector<uint8_t>& frame) {
  const uint64_t body = frame.size() - kHeaderBytes;
  COHORT_CHECK(body <= UINT32_MAX, InvalidArgument, "a gossip frame of ", body, " bytes is too large (4 GiB at most)");
  encodeFixed32(frame.data() + 8, uint32_t(body));
}

}  // namespace

FrameHeader parseHeader(std::span<const uint8_t, kHeaderBytes> bytes, uint32_t maxBody) {
  const uint32_t magic = decodeFixed32(bytes.data());
  COHORT_CHECK(magic == kMagic, InvalidArgument, "not a gossip frame (magic ", magic,
               "): is another program talking to this port?");
  const uint8_t type = bytes[4];
  COHORT_CHECK(type >= 1 && type <= 6, InvalidArgument, "unknown gossip frame type ", int(type));
  FrameHeader h;
  h.type = FrameType(type);
  h.length = decodeFixed32(bytes.data() + 8);
  COHORT_CHECK(h.length <= maxBody, InvalidArgument, "gossip frame of ", h.length, " bytes exceeds the limit of ",
               maxBody, " bytes here");
  return h;
}

std::vector<uint8_t> doneFrame(const PeerReport& p) {
  auto frame = withHeader(FrameType::kDone);
  for (int64_t v : {p.steps, p.bytesSent, p.bytesReceived, p.messagesApplied, p.stalenessSum, p.stalenessMax,
                    p.peersLost, p.stopJob}) {
    putFixed64(frame, uint64_t(v));
  }
  setLength(frame);
  return frame;
}

void beginUpdateFrame(const UpdateMeta& m, std::vector<uint8_t>& frame) {
  frame = withHeader(FrameType::kUpdate);
  putFixed32(frame, m.sender);
  putFixed32(frame, uint32_t(m.encoding));
  putFixed64(frame, uint64_t(m.version));
  putFixed64(frame, uint64_t(m.step));
  putFixed64(frame, uint64_t(m.steps));
  putFixed64(frame, uint64_t(m.samples));
  putFixed64(frame, m.numel);
}

PeerReport parseDone(std::span<const uint8_t> body) {
  COHORT_CHECK(body.size() == 64, InvalidArgument, "gossip DONE frame of ", body.size(), " bytes, expected 64");
  ByteReader r(body);
  PeerReport p;
  for (int64_t* v : {&p.steps, &p.bytesSent, &p.bytesReceived, &p.messagesApplied, &p.stalenessSum, &p.stalenessMax,
                     &p.peersLost, &p.stopJob}) {
    *v = int64_t(r.u64());
  }
  return p;
}

UpdateMeta parseUpdate(std::span<const uint8_t> body) {
  ByteReader r(body);
  UpdateMeta m;
  m.sender = r.u32();
  const uint32_t encoding = r.u32();
  m.version = int64_t(r.u64());
  m.step = int64_t(r.u64());
  m.steps = int64_t(r.u64());
  m.samples = int64_t(r.u64());
  m.numel = r.u64();
  checkFits(r, "UPDATE", body.size());
  COHORT_CHECK(encoding <= 1, InvalidArgument, "gossip UPDATE with unknown encoding ", encoding);
  m.encoding = Encoding(encoding);
  COHORT_CHECK(m.steps >= 1 && m.samples >= 0 && m.version >= 0 && m.step >= 0, InvalidArgument,
               "gossip UPDATE with impossible counters (steps ", m.steps, ", samples ", m.samples, ")");
  return m;
}

size_t rowValueBytes(RowValues values) { return values == RowValues::kFloat32 ? sizeof(float) : sizeof(uint16_t); }

void appendRowPayload(std::vector<uint8_t>& frame, std::span<const uint8_t> denseMessage,
                      std::span<const RowTable> tables, std::span<const std::vector<uint32_t>> rows,
                      std::span<const float> update, RowValues values) {
  COHORT_CHECK(rows.size() == tables.size(), InvalidArgument, "gossip: rows for ", rows.size(), " tables, expected ",
               tables.size());
  putFixed64(frame, denseMessage.size());
  frame.insert(frame.end(), denseMessage.begin(), denseMessage.end());
  putFixed32(frame, uint32_t(values));
  const size_t valueBytes = rowValueBytes(values);
  std::vector<uint16_t> bits;
  for (size_t t = 0; t < tables.size(); ++t) {
    const RowTable& table = tables[t];
    putFixed32(frame, uint32_t(rows[t].size()));
    for (uint32_t r : rows[t]) putFixed32(frame, r);
    bits.resize(table.dim);
    for (uint32_t r : rows[t]) {
      const std::span<const float> v = update.subspan(size_t(table.offset + uint64_t(r) * table.dim), table.dim);
      const size_t at = frame.size();
      frame.resize(at + table.dim * valueBytes);
      // Little-endian host (compress/format.h): the wire's byte order is the memory's.
      switch (values) {
        case RowValues::kFloat32:
          std::memcpy(frame.data() + at, v.data(), table.dim * sizeof(float));
          break;
        case RowValues::kFloat16:
          compress::floatsToHalf(v, bits);
          std::memcpy(frame.data() + at, bits.data(), table.dim * sizeof(uint16_t));
          break;
        case RowValues::kBfloat16:
          compress::floatsToBf16(v, bits);
          std::memcpy(frame.data() + at, bits.data(), table.dim * sizeof(uint16_t));
          break;
      }
    }
  }
}

RowPayload parseRowPayload(std::span<const uint8_t> payload, std::span<const RowTable> tables) {
  const char* what = "UPDATE (rows)";
  ByteReader r(payload);
  RowPayload out;
  const uint64_t messageBytes = r.u64();
  checkFits(r, what, payload.size());
  COHORT_CHECK(messageBytes <= r.left(), InvalidArgument, "gossip UPDATE with a dense part of ", messageBytes,
               " bytes in a payload of ", payload.size());
  out.denseMessage = r.bytes(size_t(messageBytes));
  const uint32_t valueType = r.u32();
  checkFits(r, what, payload.size());
  COHORT_CHECK(valueType <= uint32_t(RowValues::kBfloat16), InvalidArgument, "gossip UPDATE with unknown row values ",
               valueType, " (0 float32, 1 fp16, 2 bf16)");
  out.valueType = RowValues(valueType);
  const size_t valueBytes = rowValueBytes(out.valueType);
  std::vector<uint16_t> bits;
  for (const RowTable& table : tables) {
    const uint32_t count = r.u32();
    checkFits(r, what, payload.size());
    COHORT_CHECK(count <= table.rows, InvalidArgument, "gossip UPDATE with ", count, " rows of a table of ",
                 table.rows);
    const uint64_t bytes = uint64_t(count) * 4 + uint64_t(count) * table.dim * valueBytes;
    COHORT_CHECK(bytes <= r.left(), InvalidArgument, "gossip UPDATE (rows) frame is truncated (", count,
                 " rows of ", table.dim, " values of ", valueBytes, " bytes in ", r.left(), " bytes)");
    std::vector<uint32_t> rows(count);
    for (uint32_t i = 0; i < count; ++i) {
      rows[i] = r.u32();
      COHORT_CHECK(rows[i] < table.rows, InvalidArgument, "gossip UPDATE with row ", rows[i], " of a table of ",
                   table.rows, " rows");
      COHORT_CHECK(i == 0 || rows[i] > rows[i - 1], InvalidArgument, "gossip UPDATE rows not strictly increasing at row ",
                   rows[i]);
    }
    std::vector<float> values(size_t(count) * table.dim);
    const uint8_t* data = r.take(values.size() * valueBytes);
    if (!values.empty()) {
      if (out.valueType == RowValues::kFloat32) {
        std::memcpy(values.data(), data, values.size() * sizeof(float));
      } else {
        bits.resize(values.size());
        std::memcpy(bits.data(), data, bits.size() * sizeof(uint16_t));
        if (out.valueType == RowValues::kFloat16) {
          compress::halfToFloats(bits, values);
        } else {
          compress::bf16ToFloats(bits, values);
        }
      }
    }
    out.rows.push_back(std::move(rows));
    out.values.push_back(std::move(values));
  }
  COHORT_CHECK(r.left() == 0, InvalidArgument, "gossip UPDATE with ", r.left(), " bytes after its rows");
  return out;
}

namespace {

template <size_t N>
void putBytes(std::vector<uint8_t>& out, const std::array<uint8_t, N>& bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}


void checkProtocol(uint32_t protocol) {
  COHORT_CHECK(protocol == kProtocol, InvalidArgument, "gossip protocol ", protocol, " (this build speaks ",
               kProtocol, "): run the same cohort binary on every peer");
}

// Throws unless the reads of `what`'s body fitted and used all of it.
void checkConsumed(const ByteReader& r, std::span<const uint8_t> body, const char* what) {
  checkFits(r, what, body.size());
  COHORT_CHECK(r.left() == 0, InvalidArgument, "gossip ", what, " frame of ", body.size(), " bytes, expected ",
               r.consumed());
}

// The transcript: a zero byte (ending the label) | protocol | connector | acceptor | world size |
// acceptor nonce | connector nonce.
auth::Handshake handshake(const std::string& secret, const Transcript& t) {
  constexpr auth::Labels kLabels{"cohort gossip connector", "cohort gossip acceptor", "cohort gossip session"};
  std::vector<uint8_t> bytes{0};
  putFixed32(bytes, kProtocol);
  putFixed32(bytes, t.connector);
  putFixed32(bytes, t.acceptor);
  putFixed32(bytes, t.worldSize);
  putBytes(bytes, t.acceptorNonce);
  putBytes(bytes, t.connectorNonce);
  return auth::Handshake(secret, kLabels, std::move(bytes));
}

}  // namespace

std::vector<uint8_t> challengeFrame(const Challenge& c) {
  auto frame = withHeader(FrameType::kChallenge);
  putFixed32(frame, c.protocol);
  putFixed32(frame, c.rank);
  putFixed32(frame, c.worldSize);
  putBytes(frame, c.nonce);
  setLength(frame);
  return frame;
}

std::vector<uint8_t> helloFrame(const Hello& h) {
  auto frame = withHeader(FrameType::kHello);
  putFixed32(frame, h.protocol);
  putFixed32(frame, h.rank);
  putFixed32(frame, h.worldSize);
  putBytes(frame, h.nonce);
  putBytes(frame, h.proof);
  setLength(frame);
  return frame;
}

std::vector<uint8_t> acceptFrame(const Proof& proof) {
  auto frame = withHeader(FrameType::kAccept);
  putBytes(frame, proof);
  setLength(frame);
  return frame;
}

std::vector<uint8_t> refuseFrame(RefuseReason reason) {
  auto frame = withHeader(FrameType::kRefuse);
  putFixed32(frame, uint32_t(reason));
  setLength(frame);
  return frame;
}

Challenge parseChallenge(std::span<const uint8_t> body) {
  ByteReader r(body);
  Challenge c;
  c.protocol = r.u32();
  checkFits(r, "CHALLENGE", body.size());
  checkProtocol(c.protocol);
  c.rank = r.u32();
  c.worldSize = r.u32();
  r.copyTo(c.nonce);
  checkConsumed(r, body, "CHALLENGE");
  return c;
}

Hello parseHello(std::span<const uint8_t> body) {
  ByteReader r(body);
  Hello h;
  h.protocol = r.u32();
  checkFits(r, "HELLO", body.size());
  checkProtocol(h.protocol);
  h.rank = r.u32();
  h.worldSize = r.u32();
  r.copyTo(h.nonce);
  r.copyTo(h.proof);
  checkConsumed(r, body, "HELLO");
  return h;
}

Proof parseAccept(std::span<const uint8_t> body) {
  ByteReader r(body);
  Proof p{};
  r.copyTo(p);
  checkConsumed(r, body, "ACCEPT");
  return p;
}

RefuseReason parseRefuse(std::span<const uint8_t> body) {
  ByteReader r(body);
  const uint32_t reason = r.u32();
  checkConsumed(r, body, "REFUSE");
  COHORT_CHECK(reason >= 1 && reason <= 4, InvalidArgument, "gossip REFUSE with unknown reason ", reason);
  return RefuseReason(reason);
}

Proof connectorProof(const std::string& secret, const Transcript& t) { return handshake(secret, t).connectorProof(); }

Proof acceptorProof(const std::string& secret, const Transcript& t) { return handshake(secret, t).acceptorProof(); }

Proof sessionKey(const std::string& secret, const Transcript& t) { return handshake(secret, t).sessionKey(); }

Nonce freshNonce() { return auth::freshNonce(); }

bool sameProof(const Proof& a, const Proof& b) { return crypto::equalConstantTime(a, b); }

// A stream's frames go one way, to the acceptor.
FrameSealer::FrameSealer(const Proof& sessionKey) : tags_(sessionKey, auth::Direction::kToAcceptor) {}

FrameSealer::~FrameSealer() = default;

void FrameSealer::seal(std::vector<uint8_t>& frame) {
  COHORT_CHECK(frame.size() >= kHeaderBytes, InvalidArgument, "a gossip frame without a header");
  frame.resize(frame.size() + kTagBytes);  // the length covers the tag
  setLength(frame);
  const auth::Tag t = tags_.seal(std::span(frame).first(kHeaderBytes),
                                 std::span(frame).subspan(kHeaderBytes, frame.size() - kHeaderBytes - kTagBytes));
  std::copy(t.begin(), t.end(), frame.end() - kTagBytes);
}

std::span<const uint8_t> FrameSealer::open(std::span<const uint8_t, kHeaderBytes> header,
                                           std::span<const uint8_t> body) {
  COHORT_CHECK(body.size() >= kTagBytes, InvalidArgument, "gossip frame of ", body.size(),
               " bytes has no room for its tag");
  const auto content = body.first(body.size() - kTagBytes);
  COHORT_CHECK(tags_.open(header, content, body.last(kTagBytes)), InvalidArgument,
               "gossip frame with a wrong tag: altered, replayed or out of order");
  return content;
}

}  // namespace cohort::gossip
