// Inside the rendezvous store (comm/store.h says what it is and its wire): what its server
// (store_server.cpp) and client (store_client.cpp) share: the constants, the request codes, the
// handshake's transcript and the tagged frames of a connection (store_auth.cpp).
#pragma once

#include "base/auth_channel.h"
#include "base/coding.h"
#include "base/socket_io.h"

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort::store {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x31545343;  // "CST1"
constexpr uint32_t kFlagSecret = 1;
constexpr size_t kNonceBytes = auth::kNonceBytes;
constexpr size_t kProofBytes = auth::kProofBytes;
constexpr size_t kChallengeBytes = 8 + kNonceBytes;
constexpr size_t kHelloBytes = kNonceBytes + kProofBytes;
constexpr size_t kAnswerBytes = 1 + kProofBytes;
constexpr size_t kTagBytes = auth::kTagBytes;
constexpr size_t kMaxKeyBytes = 4096;
constexpr size_t kMaxKeys = 4096;
constexpr size_t kReadChunk = size_t(1) << 20;

enum class Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5, kDelete = 6, kNumKeys = 7 };
enum class Status : uint8_t { kOk = 0, kTimedOut = 1, kRefused = 2 };

// A key: its length u32 and its bytes.
void putString(std::vector<uint8_t>& out, const std::string& s);

// A key: its length u32 and its bytes, at most kMaxKeyBytes. A key that does not fit, or a longer
// one, fails the reader.
std::string readString(ByteReader& in);

// The handshake's transcript is the two nonces, the server's first (base/auth_channel.h).
auth::Handshake handshakeOf(const std::string& secret, std::span<const uint8_t> serverNonce,
                            std::span<const uint8_t> clientNonce);

// One side of a connection after the handshake: length-prefixed, tagged frames.
struct Channel {
  int fd = -1;
  std::optional<auth::FrameTags> sendTags, receiveTags;  // with a secret, after the handshake
  size_t maxBody = 0;

  // Tags every later frame; `sends` is this end's direction (the server is the acceptor).
  void seal(const auth::Proof& sessionKey, auth::Direction sends);

  IoStatus send(const std::vector<uint8_t>& body, Clock::time_point deadline);

  // kError also for a frame that is too long or whose tag is wrong (`bad` is set then).
  IoStatus receive(std::vector<uint8_t>& body, Clock::time_point deadline, bool& bad);
};

}  // namespace cohort::store
