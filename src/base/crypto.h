// The few cryptographic pieces cohort's transports need, over OpenSSL's libcrypto (kept out of
// every header): HMAC-SHA256, random bytes from the kernel, and a comparison whose time does not
// depend on where two secrets differ. Torch-free, in cohort_base.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace cohort::crypto {

using Digest = std::array<uint8_t, 32>;

// HMAC-SHA256 with a fixed key, fed in parts. One object computes any number of MACs: final()
// returns one and starts the next under the same key. Not thread-safe; one per stream.
class HmacSha256 {
 public:
  explicit HmacSha256(std::span<const uint8_t> key);
  explicit HmacSha256(std::string_view key);
  ~HmacSha256();
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;

  HmacSha256& update(std::span<const uint8_t> bytes);
  HmacSha256& update(std::string_view text);
  Digest final();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// AES-128-GMAC (GCM with the message as authenticated data and nothing encrypted): a 16-byte
// tag at GHASH's speed, several times HMAC-SHA256's on CPUs with carry-less multiply, for tagging
// bulk frames. Each (key, nonce) pair must tag one message only: callers number their frames.
// Not thread-safe; one per stream.
class Gmac {
 public:
  using Tag = std::array<uint8_t, 16>;
  explicit Gmac(std::span<const uint8_t, 16> key);
  ~Gmac();
  Gmac(const Gmac&) = delete;
  Gmac& operator=(const Gmac&) = delete;

  // The tag of the concatenated parts under a 12-byte nonce.
  Tag tag(std::span<const uint8_t, 12> nonce, std::initializer_list<std::span<const uint8_t>> parts);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Fills `out` from the kernel's random source (getrandom); throws Error when it cannot.
void randomBytes(std::span<uint8_t> out);

// `bytes` as lowercase hex, two digits a byte.
std::string toHex(std::span<const uint8_t> bytes);

// A fresh secret: `bytes` random bytes (getrandom) as lowercase hex.
std::string randomToken(size_t bytes = 16);

// True when a and b hold the same bytes; for equal sizes the time taken does not depend on the
// contents.
bool equalConstantTime(std::span<const uint8_t> a, std::span<const uint8_t> b);

// What is wrong with TLS files for a server (a certificate chain and its private key) or a client
// (the roots it trusts), all PEM: "" when nothing is, else a phrase such as "holds no PEM
// certificate" or "is not the key of --tls-cert's certificate". gRPC takes any bytes at start-up
// and fails each handshake later, with nothing that names the file.
std::string pemCertificateProblem(std::string_view pem);
std::string pemKeyProblem(std::string_view key, std::string_view certificate);

}  // namespace cohort::crypto
