#include "gossip/wire.h"

#include "base/crypto.h"
#include "compress/codec.h"

#include <cohort/error.h>

#include <algorithm>
#include <cstring>

namespace cohort::gossip {

namespace {

template <typename T>
void put(std::vector<uint8_t>& out, T value) {
  uint8_t bytes[sizeof(T)];
  for (size_t i = 0; i < sizeof(T); ++i) bytes[i] = uint8_t(uint64_t(value) >> (8 * i));
  out.insert(out.end(), bytes, bytes + sizeof(T));
}

// Reads little-endian integers from a body, checking every read against its end.
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, const char* what) : bytes_(bytes), what_(what) {}
  template <typename T>
  T get() {
    COHORT_CHECK(at_ + sizeof(T) <= bytes_.size(), InvalidArgument, "gossip ", what_, " frame is truncated (",
                 bytes_.size(), " bytes)");
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t(bytes_[at_ + i]) << (8 * i);
    at_ += sizeof(T);
    return T(v);
  }
  std::span<const uint8_t> rest() const { return bytes_.subspan(at_); }
  size_t at() const { return at_; }

 private:
  std::span<const uint8_t> bytes_;
  const char* what_;
  size_t at_ = 0;
};

std::vector<uint8_t> withHeader(FrameType type) {
  std::vector<uint8_t> frame;
  put<uint32_t>(frame, kMagic);
  put<uint8_t>(frame, uint8_t(type));
  frame.insert(frame.end(), 3, 0);
  put<uint32_t>(frame, 0);  // length, written at the end
  return frame;
}

void setLength(std::vector<uint8_t>& frame) {
  const uint64_t body = frame.size() - kHeaderBytes;
  COHORT_CHECK(body <= UINT32_MAX, InvalidArgument, "a gossip frame of ", body, " bytes is too large (4 GiB at most)");
  for (size_t i = 0; i < 4; ++i) frame[8 + i] = uint8_t(body >> (8 * i));
}

}  // namespace

FrameHeader parseHeader(std::span<const uint8_t, kHeaderBytes> bytes, uint32_t maxBody) {
  Reader r(bytes, "header of a");
  const auto magic = r.get<uint32_t>();
  COHORT_CHECK(magic == kMagic, InvalidArgument, "not a gossip frame (magic ", magic,
               "): is another program talking to this port?");
  const auto type = r.get<uint8_t>();
  COHORT_CHECK(type >= 1 && type <= 6, InvalidArgument, "unknown gossip frame type ", int(type));
  r.get<uint8_t>();
  r.get<uint16_t>();
  FrameHeader h;
  h.type = FrameType(type);
  h.length = r.get<uint32_t>();
  COHORT_CHECK(h.length <= maxBody, InvalidArgument, "gossip frame of ", h.length, " bytes exceeds the limit of ",
               maxBody, " bytes here");
  return h;
}

std::vector<uint8_t> doneFrame(const PeerReport& p) {
  auto frame = withHeader(FrameType::kDone);
  for (int64_t v : {p.steps, p.bytesSent, p.bytesReceived, p.messagesApplied, p.stalenessSum, p.stalenessMax,
                    p.peersLost, p.stopJob}) {
    put<int64_t>(frame, v);
  }
  setLength(frame);
  return frame;
}

void beginUpdateFrame(const UpdateMeta& m, std::vector<uint8_t>& frame) {
  frame = withHeader(FrameType::kUpdate);
  put<uint32_t>(frame, m.sender);
  put<uint32_t>(frame, uint32_t(m.encoding));
  put<int64_t>(frame, m.version);
  put<int64_t>(frame, m.step);
  put<int64_t>(frame, m.steps);
  put<int64_t>(frame, m.samples);
  put<uint64_t>(frame, m.numel);
}

PeerReport parseDone(std::span<const uint8_t> body) {
  COHORT_CHECK(body.size() == 64, InvalidArgument, "gossip DONE frame of ", body.size(), " bytes, expected 64");
  Reader r(body, "DONE");
  PeerReport p;
  for (int64_t* v : {&p.steps, &p.bytesSent, &p.bytesReceived, &p.messagesApplied, &p.stalenessSum, &p.stalenessMax,
                     &p.peersLost, &p.stopJob}) {
    *v = r.get<int64_t>();
  }
  return p;
}

UpdateMeta parseUpdate(std::span<const uint8_t> body) {
  Reader r(body, "UPDATE");
  UpdateMeta m;
  m.sender = r.get<uint32_t>();
  const auto encoding = r.get<uint32_t>();
  COHORT_CHECK(encoding <= 1, InvalidArgument, "gossip UPDATE with unknown encoding ", encoding);
  m.encoding = Encoding(encoding);
  m.version = r.get<int64_t>();
  m.step = r.get<int64_t>();
  m.steps = r.get<int64_t>();
  m.samples = r.get<int64_t>();
  m.numel = r.get<uint64_t>();
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
  put<uint64_t>(frame, denseMessage.size());
  frame.insert(frame.end(), denseMessage.begin(), denseMessage.end());
  put<uint32_t>(frame, uint32_t(values));
  const size_t valueBytes = rowValueBytes(values);
  std::vector<uint16_t> bits;
  for (size_t t = 0; t < tables.size(); ++t) {
    const RowTable& table = tables[t];
    put<uint32_t>(frame, uint32_t(rows[t].size()));
    for (uint32_t r : rows[t]) put<uint32_t>(frame, r);
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
  Reader r(payload, "UPDATE (rows)");
  RowPayload out;
  const auto messageBytes = r.get<uint64_t>();
  COHORT_CHECK(messageBytes <= r.rest().size(), InvalidArgument, "gossip UPDATE with a dense part of ", messageBytes,
               " bytes in a payload of ", payload.size());
  out.denseMessage = r.rest().subspan(0, size_t(messageBytes));
  Reader kind(r.rest().subspan(size_t(messageBytes)), "UPDATE (rows)");
  const auto valueType = kind.get<uint32_t>();
  COHORT_CHECK(valueType <= uint32_t(RowValues::kBfloat16), InvalidArgument, "gossip UPDATE with unknown row values ",
               valueType, " (0 float32, 1 fp16, 2 bf16)");
  out.valueType = RowValues(valueType);
  const size_t valueBytes = rowValueBytes(out.valueType);
  size_t at = r.at() + size_t(messageBytes) + kind.at();
  std::vector<uint16_t> bits;
  for (const RowTable& table : tables) {
    Reader t(payload.subspan(at), "UPDATE (rows)");
    const auto count = t.get<uint32_t>();
    COHORT_CHECK(count <= table.rows, InvalidArgument, "gossip UPDATE with ", count, " rows of a table of ",
                 table.rows);
    const uint64_t bytes = uint64_t(count) * 4 + uint64_t(count) * table.dim * valueBytes;
    COHORT_CHECK(bytes <= t.rest().size(), InvalidArgument, "gossip UPDATE (rows) frame is truncated (", count,
                 " rows of ", table.dim, " values of ", valueBytes, " bytes in ", t.rest().size(), " bytes)");
    std::vector<uint32_t> rows(count);
    for (uint32_t i = 0; i < count; ++i) {
      rows[i] = t.get<uint32_t>();
      COHORT_CHECK(rows[i] < table.rows, InvalidArgument, "gossip UPDATE with row ", rows[i], " of a table of ",
                   table.rows, " rows");
      COHORT_CHECK(i == 0 || rows[i] > rows[i - 1], InvalidArgument, "gossip UPDATE rows not strictly increasing at row ",
                   rows[i]);
    }
    std::vector<float> values(size_t(count) * table.dim);
    const uint8_t* data = t.rest().data();
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
    at += t.at() + values.size() * valueBytes;
    out.rows.push_back(std::move(rows));
    out.values.push_back(std::move(values));
  }
  COHORT_CHECK(at == payload.size(), InvalidArgument, "gossip UPDATE with ", payload.size() - at,
               " bytes after its rows");
  return out;
}

namespace {

template <size_t N>
void putBytes(std::vector<uint8_t>& out, const std::array<uint8_t, N>& bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

template <size_t N>
std::array<uint8_t, N> getBytes(Reader& r) {
  std::array<uint8_t, N> out{};
  for (auto& b : out) b = r.get<uint8_t>();
  return out;
}

void checkProtocol(uint32_t protocol) {
  COHORT_CHECK(protocol == kProtocol, InvalidArgument, "gossip protocol ", protocol, " (this build speaks ",
               kProtocol, "): run the same cohort binary on every peer");
}

void checkConsumed(const Reader& r, std::span<const uint8_t> body, const char* what) {
  COHORT_CHECK(r.at() == body.size(), InvalidArgument, "gossip ", what, " frame of ", body.size(),
               " bytes, expected ", r.at());
}

// label | protocol | connector | acceptor | world size | acceptor nonce | connector nonce
Proof transcriptMac(const std::string& secret, std::string_view label, const Transcript& t) {
  std::vector<uint8_t> bytes;
  put<uint32_t>(bytes, kProtocol);
  put<uint32_t>(bytes, t.connector);
  put<uint32_t>(bytes, t.acceptor);
  put<uint32_t>(bytes, t.worldSize);
  putBytes(bytes, t.acceptorNonce);
  putBytes(bytes, t.connectorNonce);
  crypto::HmacSha256 mac(secret);
  mac.update(label).update(std::string_view("\0", 1)).update(bytes);
  return mac.final();
}

}  // namespace

std::vector<uint8_t> challengeFrame(const Challenge& c) {
  auto frame = withHeader(FrameType::kChallenge);
  put<uint32_t>(frame, c.protocol);
  put<uint32_t>(frame, c.rank);
  put<uint32_t>(frame, c.worldSize);
  putBytes(frame, c.nonce);
  setLength(frame);
  return frame;
}

std::vector<uint8_t> helloFrame(const Hello& h) {
  auto frame = withHeader(FrameType::kHello);
  put<uint32_t>(frame, h.protocol);
  put<uint32_t>(frame, h.rank);
  put<uint32_t>(frame, h.worldSize);
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
  put<uint32_t>(frame, uint32_t(reason));
  setLength(frame);
  return frame;
}

Challenge parseChallenge(std::span<const uint8_t> body) {
  Reader r(body, "CHALLENGE");
  Challenge c;
  c.protocol = r.get<uint32_t>();
  checkProtocol(c.protocol);
  c.rank = r.get<uint32_t>();
  c.worldSize = r.get<uint32_t>();
  c.nonce = getBytes<kNonceBytes>(r);
  checkConsumed(r, body, "CHALLENGE");
  return c;
}

Hello parseHello(std::span<const uint8_t> body) {
  Reader r(body, "HELLO");
  Hello h;
  h.protocol = r.get<uint32_t>();
  checkProtocol(h.protocol);
  h.rank = r.get<uint32_t>();
  h.worldSize = r.get<uint32_t>();
  h.nonce = getBytes<kNonceBytes>(r);
  h.proof = getBytes<kProofBytes>(r);
  checkConsumed(r, body, "HELLO");
  return h;
}

Proof parseAccept(std::span<const uint8_t> body) {
  Reader r(body, "ACCEPT");
  const Proof p = getBytes<kProofBytes>(r);
  checkConsumed(r, body, "ACCEPT");
  return p;
}

RefuseReason parseRefuse(std::span<const uint8_t> body) {
  Reader r(body, "REFUSE");
  const auto reason = r.get<uint32_t>();
  checkConsumed(r, body, "REFUSE");
  COHORT_CHECK(reason >= 1 && reason <= 4, InvalidArgument, "gossip REFUSE with unknown reason ", reason);
  return RefuseReason(reason);
}

Proof connectorProof(const std::string& secret, const Transcript& t) {
  return transcriptMac(secret, "cohort gossip connector", t);
}

Proof acceptorProof(const std::string& secret, const Transcript& t) {
  return transcriptMac(secret, "cohort gossip acceptor", t);
}

Proof sessionKey(const std::string& secret, const Transcript& t) {
  return transcriptMac(secret, "cohort gossip session", t);
}

Nonce freshNonce() {
  Nonce n{};
  crypto::randomBytes(n);
  return n;
}

bool sameProof(const Proof& a, const Proof& b) { return crypto::equalConstantTime(a, b); }

struct FrameSealer::State {
  // AES-128-GMAC under the first 16 bytes of the session key: the frames are bulk (a whole
  // model's update), and GHASH tags them several times faster than HMAC-SHA256 would.
  explicit State(const Proof& key) : mac(std::span<const uint8_t, 16>(key.data(), 16)) {}
  crypto::Gmac mac;
};

FrameSealer::FrameSealer(const Proof& sessionKey) : state_(std::make_unique<State>(sessionKey)) {}

FrameSealer::~FrameSealer() = default;

std::array<uint8_t, kTagBytes> FrameSealer::tag(std::span<const uint8_t> header, std::span<const uint8_t> body) {
  // The nonce is the frame's number: unique under this session's key, and a replayed or
  // reordered frame is checked under another number.
  std::array<uint8_t, 12> nonce{};
  const uint64_t number = next_++;
  for (int i = 0; i < 8; ++i) nonce[size_t(i)] = uint8_t(number >> (8 * i));
  return state_->mac.tag(nonce, {header, body});
}

void FrameSealer::seal(std::vector<uint8_t>& frame) {
  COHORT_CHECK(frame.size() >= kHeaderBytes, InvalidArgument, "a gossip frame without a header");
  frame.resize(frame.size() + kTagBytes);  // the length covers the tag
  setLength(frame);
  const auto t = tag(std::span(frame).first(kHeaderBytes),
                     std::span(frame).subspan(kHeaderBytes, frame.size() - kHeaderBytes - kTagBytes));
  std::copy(t.begin(), t.end(), frame.end() - kTagBytes);
}

std::span<const uint8_t> FrameSealer::open(std::span<const uint8_t, kHeaderBytes> header,
                                           std::span<const uint8_t> body) {
  COHORT_CHECK(body.size() >= kTagBytes, InvalidArgument, "gossip frame of ", body.size(),
               " bytes has no room for its tag");
  const auto content = body.first(body.size() - kTagBytes);
  const auto expected = tag(header, content);
  COHORT_CHECK(crypto::equalConstantTime(expected, body.last(kTagBytes)), InvalidArgument,
               "gossip frame with a wrong tag: altered, replayed or out of order");
  return content;
}

}  // namespace cohort::gossip
