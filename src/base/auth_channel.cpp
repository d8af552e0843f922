#include "base/auth_channel.h"

#include "base/coding.h"
#include "base/crypto.h"

namespace cohort::auth {

Nonce freshNonce() {
  Nonce n{};
  crypto::randomBytes(n);
  return n;
}

Handshake::Handshake(std::string_view secret, const Labels& labels, std::vector<uint8_t> transcript)
    : secret_(secret), labels_(labels), transcript_(std::move(transcript)) {}

Proof Handshake::mac(std::string_view label) const {
  crypto::HmacSha256 mac(secret_);
  mac.update(label).update(transcript_);
  return mac.final();
}

bool Handshake::isConnectorProof(std::span<const uint8_t> proof) const {
  return crypto::equalConstantTime(proof, connectorProof());
}

bool Handshake::isAcceptorProof(std::span<const uint8_t> proof) const {
  return crypto::equalConstantTime(proof, acceptorProof());
}

struct FrameTags::State {
  // GHASH tags bulk frames (a model's update, a store value of up to 1 GiB) several times faster
  // than HMAC-SHA256 would.
  State(const Proof& key, Direction d) : mac(std::span<const uint8_t, 16>(key.data(), 16)), direction(d) {}

  Tag next(std::span<const uint8_t> header, std::span<const uint8_t> body) {
    // Unique under this session's key: a replayed or reordered frame is checked under another
    // number, a frame sent the other way under another direction.
    std::array<uint8_t, 12> nonce{};
    encodeFixed64(nonce.data(), number++);
    nonce[8] = uint8_t(direction);
    return mac.tag(nonce, {header, body});
  }

  crypto::Gmac mac;
  Direction direction;
  uint64_t number = 0;
};

FrameTags::FrameTags(const Proof& sessionKey, Direction direction)
    : state_(std::make_unique<State>(sessionKey, direction)) {}
FrameTags::~FrameTags() = default;
FrameTags::FrameTags(FrameTags&&) noexcept = default;
FrameTags& FrameTags::operator=(FrameTags&&) noexcept = default;

Tag FrameTags::seal(std::span<const uint8_t> header, std::span<const uint8_t> body) {
  return state_->next(header, body);
}

bool FrameTags::open(std::span<const uint8_t> header, std::span<const uint8_t> body, std::span<const uint8_t> tag) {
  return crypto::equalConstantTime(state_->next(header, body), tag);
}

}  // namespace cohort::auth
