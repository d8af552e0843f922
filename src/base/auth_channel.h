// The authenticated channel of cohort's own TCP transports (the rendezvous store, gossip streams):
// a handshake that proves a job's secret in both directions without sending it, and the tags that
// seal every frame after it. The transports frame their messages their own way (comm/store.h,
// gossip/wire.h); what they share, and what is written once here, is the cryptography and its
// rules.
//
// The handshake. The acceptor (the end that was connected to) sends a fresh nonce; the connector
// answers with its own nonce and its proof, HMAC-SHA256(secret, connector label | transcript); the
// acceptor checks it in constant time and answers with its proof under the acceptor label, which
// the connector checks in turn. The transcript holds both nonces and whatever else the transport
// binds (its protocol version, the ranks): a recorded proof fails against a fresh nonce, and a
// proof made for one connection and direction opens no other. Both ends then key the session with
// HMAC(secret, session label | transcript). The secret never crosses the wire; a dictionary attack
// on recorded proofs is its only use, so the secret must be random (`cohort launch` makes 128
// bits).
//
// The frames. Every frame after the handshake carries a 16-byte AES-128-GMAC tag under the first
// 16 bytes of the session key, over the frame's header and body, with the nonce: the frame's
// number (u64, from 0, in the order written, so read) | its direction (u8) | 3 zero bytes. A
// stranger relaying a connection sees the frames (nothing is encrypted) but cannot insert, alter,
// replay or reorder one; dropping the connection is all it can do.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kTagBytes = 16;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;  // a proof, or a session key
using Tag = std::array<uint8_t, kTagBytes>;

// A fresh nonce from the kernel's random source.
Nonce freshNonce();

// A transport's three MAC labels, each distinct from every other transport's.
struct Labels {
  std::string_view connector;
  std::string_view acceptor;
  std::string_view session;
};

// One handshake's proofs and session key, from the secret and the transcript both ends hold.
class Handshake {
 public:
  Handshake(std::string_view secret, const Labels& labels, std::vector<uint8_t> transcript);

  Proof connectorProof() const { return mac(labels_.connector); }
  Proof acceptorProof() const { return mac(labels_.acceptor); }
  Proof sessionKey() const { return mac(labels_.session); }
  // In constant time; false for a proof of another size.
  bool isConnectorProof(std::span<const uint8_t> proof) const;
  bool isAcceptorProof(std::span<const uint8_t> proof) const;

 private:
  Proof mac(std::string_view label) const;

  std::string secret_;
  Labels labels_;
  std::vector<uint8_t> transcript_;
};

// Which way a frame goes; part of its tag's nonce, so that the two directions of one session
// never tag under the same nonce.
enum class Direction : uint8_t { kToAcceptor = 0, kToConnector = 1 };

// The tags of one direction of a session's frames, numbered from 0. One object per end and
// direction: the sender seals, the receiver opens, each in frame order. Not thread-safe.
class FrameTags {
 public:
  FrameTags(const Proof& sessionKey, Direction direction);
  ~FrameTags();
  FrameTags(FrameTags&&) noexcept;
  FrameTags& operator=(FrameTags&&) noexcept;

  // The tag of the next frame.
  Tag seal(std::span<const uint8_t> header, std::span<const uint8_t> body);
  // Whether `tag` is the next frame's (in constant time). A frame is numbered whether or not its
  // tag was right: after a wrong one the session is over.
  bool open(std::span<const uint8_t> header, std::span<const uint8_t> body, std::span<const uint8_t> tag);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace cohort::auth
