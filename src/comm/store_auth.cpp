// The rendezvous store's handshake transcript and the length-prefixed, tagged frames both its
// ends speak after the handshake (comm/store.h has the wire).
#include "comm/store_internal.h"

#include <algorithm>

namespace cohort::store {

void putString(std::vector<uint8_t>& out, const std::string& s) {
  putFixed32(out, uint32_t(s.size()));
  out.insert(out.end(), s.begin(), s.end());
}

std::string readString(ByteReader& in) {
  const uint32_t n = in.u32();
  if (n > kMaxKeyBytes) in.fail();
  const std::span<const uint8_t> bytes = in.bytes(n);
  return std::string(bytes.begin(), bytes.end());
}

auth::Handshake handshakeOf(const std::string& secret, std::span<const uint8_t> serverNonce,
                            std::span<const uint8_t> clientNonce) {
  constexpr auth::Labels kLabels{"cohort-store client", "cohort-store server", "cohort-store session"};
  std::vector<uint8_t> transcript(serverNonce.begin(), serverNonce.end());
  transcript.insert(transcript.end(), clientNonce.begin(), clientNonce.end());
  return auth::Handshake(secret, kLabels, std::move(transcript));
}

void Channel::seal(const auth::Proof& sessionKey, auth::Direction sends) {
  const auto receives =
      sends == auth::Direction::kToAcceptor ? auth::Direction::kToConnector : auth::Direction::kToAcceptor;
  sendTags.emplace(sessionKey, sends);
  receiveTags.emplace(sessionKey, receives);
}

IoStatus Channel::send(const std::vector<uint8_t>& body, Clock::time_point deadline) {
  std::vector<uint8_t> frame;
  frame.reserve(4 + body.size() + kTagBytes);
  putFixed32(frame, uint32_t(body.size()));
  frame.insert(frame.end(), body.begin(), body.end());
  if (sendTags) {
    const auth::Tag t = sendTags->seal(std::span(frame).first(4), body);
    frame.insert(frame.end(), t.begin(), t.end());
  }
  return writeFull(fd, frame.data(), frame.size(), {.deadline = deadline});
}

IoStatus Channel::receive(std::vector<uint8_t>& body, Clock::time_point deadline, bool& bad) {
  bad = false;
  const IoLimits limits{.deadline = deadline};
  uint8_t head[4];
  if (const IoStatus r = readFull(fd, head, 4, limits); r != IoStatus::kOk) return r;
  const uint32_t n = decodeFixed32(head);
  if (n > maxBody) {
    bad = true;
    return IoStatus::kError;
  }
  // Grow as bytes arrive: the length is the peer's claim.
  body.clear();
  while (body.size() < n) {
    const size_t part = std::min(kReadChunk, size_t(n) - body.size());
    const size_t at = body.size();
    body.resize(at + part);
    if (const IoStatus r = readFull(fd, body.data() + at, part, limits); r != IoStatus::kOk) return r;
  }
  if (receiveTags) {
    auth::Tag got{};
    if (const IoStatus r = readFull(fd, got.data(), kTagBytes, limits); r != IoStatus::kOk) return r;
    if (!receiveTags->open(head, body, got)) {
      bad = true;
      return IoStatus::kError;
    }
  }
  return IoStatus::kOk;
}

}  // namespace cohort::store
