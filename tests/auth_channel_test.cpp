// base/auth_channel.h: the handshake's proofs and key, and the frame tags, pinned to the bytes the
// store and gossip put on the wire.
#include "base/auth_channel.h"

#include "base/crypto.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace cohort::auth {
namespace {

constexpr Labels kLabels{"test connector", "test acceptor", "test session"};

std::vector<uint8_t> transcript(uint8_t fill) { return std::vector<uint8_t>(64, fill); }

TEST(AuthHandshake, ProofsAreHmacOfLabelAndTranscript) {
  const Handshake h("s3cret", kLabels, transcript(5));
  crypto::HmacSha256 mac{std::string_view("s3cret")};
  mac.update(std::string_view("test connector")).update(transcript(5));
  EXPECT_EQ(h.connectorProof(), mac.final());
  mac.update(std::string_view("test acceptor")).update(transcript(5));
  EXPECT_EQ(h.acceptorProof(), mac.final());
  mac.update(std::string_view("test session")).update(transcript(5));
  EXPECT_EQ(h.sessionKey(), mac.final());
}

TEST(AuthHandshake, EachProofOpensOnlyItsOwnCheck) {
  const Handshake h("s3cret", kLabels, transcript(5));
  EXPECT_TRUE(h.isConnectorProof(h.connectorProof()));
  EXPECT_TRUE(h.isAcceptorProof(h.acceptorProof()));
  EXPECT_FALSE(h.isConnectorProof(h.acceptorProof()));  // a reflected proof
  EXPECT_FALSE(h.isAcceptorProof(h.connectorProof()));
  const Proof p = h.connectorProof();
  EXPECT_FALSE(h.isConnectorProof(std::span<const uint8_t>(p).first(31)));  // a short one
  EXPECT_FALSE(h.isConnectorProof({}));
}

TEST(AuthHandshake, AnotherSecretOrTranscriptMakesOtherProofs) {
  const Handshake h("s3cret", kLabels, transcript(5));
  EXPECT_FALSE(Handshake("s3creT", kLabels, transcript(5)).isConnectorProof(h.connectorProof()));
  EXPECT_FALSE(Handshake("s3cret", kLabels, transcript(6)).isConnectorProof(h.connectorProof()));  // replay
  EXPECT_NE(Handshake("s3cret", kLabels, transcript(6)).sessionKey(), h.sessionKey());
  EXPECT_NE(freshNonce(), freshNonce());
}

// The tag of frame `number` in `direction`, computed as the header comment says.
Tag expectedTag(const Proof& key, uint64_t number, Direction direction, std::span<const uint8_t> header,
                std::span<const uint8_t> body) {
  crypto::Gmac mac(std::span<const uint8_t, 16>(key.data(), 16));
  std::array<uint8_t, 12> nonce{};
  for (int i = 0; i < 8; ++i) nonce[size_t(i)] = uint8_t(number >> (8 * i));
  nonce[8] = uint8_t(direction);
  return mac.tag(nonce, {header, body});
}

TEST(AuthFrameTags, SealedFramesOpenInOrder) {
  const Proof key = Handshake("k", kLabels, transcript(1)).sessionKey();
  FrameTags sender(key, Direction::kToAcceptor), receiver(key, Direction::kToAcceptor);
  const std::vector<uint8_t> header = {1, 2, 3, 4};
  for (uint8_t i = 0; i < 3; ++i) {
    const std::vector<uint8_t> body(100, i);
    const Tag t = sender.seal(header, body);
    EXPECT_EQ(t, expectedTag(key, i, Direction::kToAcceptor, header, body));
    EXPECT_TRUE(receiver.open(header, body, t)) << int(i);
  }
}

TEST(AuthFrameTags, AlteredReplayedReorderedOrTurnedFramesFail) {
  const Proof key = Handshake("k", kLabels, transcript(1)).sessionKey();
  const std::vector<uint8_t> header = {9, 9}, body = {1, 2, 3};
  FrameTags sender(key, Direction::kToConnector);
  const Tag first = sender.seal(header, body);
  const Tag second = sender.seal(header, body);
  EXPECT_NE(first, second);  // the number is in the nonce

  {
    FrameTags receiver(key, Direction::kToConnector);
    EXPECT_FALSE(receiver.open(header, body, second));  // out of order
  }
  {
    FrameTags receiver(key, Direction::kToConnector);
    EXPECT_TRUE(receiver.open(header, body, first));
    EXPECT_FALSE(receiver.open(header, body, first));  // replayed
  }
  {
    FrameTags receiver(key, Direction::kToConnector);
    const std::vector<uint8_t> altered = {1, 2, 4};
    EXPECT_FALSE(receiver.open(header, altered, first));
  }
  {
    FrameTags receiver(key, Direction::kToConnector);
    const std::vector<uint8_t> otherHeader = {9, 8};
    EXPECT_FALSE(receiver.open(otherHeader, body, first));
  }
  {
    FrameTags receiver(key, Direction::kToAcceptor);  // the frame turned back to its sender
    EXPECT_FALSE(receiver.open(header, body, first));
  }
  {
    FrameTags receiver(Handshake("other", kLabels, transcript(1)).sessionKey(), Direction::kToConnector);
    EXPECT_FALSE(receiver.open(header, body, first));
  }
}

TEST(AuthFrameTags, AShortTagFails) {
  const Proof key = Handshake("k", kLabels, transcript(1)).sessionKey();
  FrameTags sender(key, Direction::kToAcceptor), receiver(key, Direction::kToAcceptor);
  const std::vector<uint8_t> body = {7};
  const Tag t = sender.seal({}, body);
  EXPECT_FALSE(receiver.open({}, body, std::span<const uint8_t>(t).first(15)));
}

}  // namespace
}  // namespace cohort::auth
