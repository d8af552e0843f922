#include "gossip/wire.h"

#include <cohort/error.h>

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
  COHORT_CHECK(type >= 1 && type <= 3, InvalidArgument, "unknown gossip frame type ", int(type));
  r.get<uint8_t>();
  r.get<uint16_t>();
  FrameHeader h;
  h.type = FrameType(type);
  h.length = r.get<uint32_t>();
  COHORT_CHECK(h.length <= maxBody, InvalidArgument, "gossip frame of ", h.length, " bytes exceeds the limit of ",
               maxBody, " for this model");
  return h;
}

std::vector<uint8_t> helloFrame(const Hello& hello) {
  auto frame = withHeader(FrameType::kHello);
  put<uint32_t>(frame, hello.protocol);
  put<uint32_t>(frame, hello.rank);
  put<uint32_t>(frame, hello.worldSize);
  put<uint32_t>(frame, uint32_t(hello.token.size()));
  frame.insert(frame.end(), hello.token.begin(), hello.token.end());
  setLength(frame);
  return frame;
}

std::vector<uint8_t> doneFrame(const PeerReport& p) {
  auto frame = withHeader(FrameType::kDone);
  for (int64_t v : {p.steps, p.bytesSent, p.bytesReceived, p.messagesApplied, p.stalenessSum, p.stalenessMax,
                    p.peersLost, p.dropped}) {
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

void finishUpdateFrame(std::vector<uint8_t>& frame) { setLength(frame); }

Hello parseHello(std::span<const uint8_t> body) {
  Reader r(body, "HELLO");
  Hello h;
  h.protocol = r.get<uint32_t>();
  COHORT_CHECK(h.protocol == kProtocol, InvalidArgument, "gossip protocol ", h.protocol, " (this build speaks ",
               kProtocol, "): run the same cohort binary on every peer");
  h.rank = r.get<uint32_t>();
  h.worldSize = r.get<uint32_t>();
  const auto n = r.get<uint32_t>();
  COHORT_CHECK(r.rest().size() == n, InvalidArgument, "gossip HELLO token of ", n, " bytes in a body with ",
               r.rest().size(), " left");
  h.token.assign(reinterpret_cast<const char*>(r.rest().data()), n);
  return h;
}

PeerReport parseDone(std::span<const uint8_t> body) {
  COHORT_CHECK(body.size() == 64, InvalidArgument, "gossip DONE frame of ", body.size(), " bytes, expected 64");
  Reader r(body, "DONE");
  PeerReport p;
  for (int64_t* v : {&p.steps, &p.bytesSent, &p.bytesReceived, &p.messagesApplied, &p.stalenessSum, &p.stalenessMax,
                     &p.peersLost, &p.dropped}) {
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

bool sameToken(const std::string& a, const std::string& b) {
  unsigned diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= unsigned(x ^ y);
  }
  return diff == 0;
}

}  // namespace cohort::gossip
