#include "base/crypto.h"

#include <cohort/error.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace cohort::crypto {

namespace {

// Fetched once: looking the algorithm up is far dearer than a MAC of a short message.
EVP_MAC* hmacAlgorithm() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  COHORT_CHECK(mac != nullptr, Error, "OpenSSL has no HMAC: is libcrypto complete?");
  return mac;
}

}  // namespace

struct HmacSha256::State {
  EVP_MAC_CTX* ctx = nullptr;
  ~State() { EVP_MAC_CTX_free(ctx); }
};

HmacSha256::HmacSha256(std::span<const uint8_t> key) : state_(std::make_unique<State>()) {
  state_->ctx = EVP_MAC_CTX_new(hmacAlgorithm());
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  COHORT_CHECK(state_->ctx != nullptr && EVP_MAC_init(state_->ctx, key.data(), key.size(), params) == 1, Error,
               "OpenSSL could not start an HMAC-SHA256");
}

HmacSha256::HmacSha256(std::string_view key)
    : HmacSha256(std::span(reinterpret_cast<const uint8_t*>(key.data()), key.size())) {}

HmacSha256::~HmacSha256() = default;

HmacSha256& HmacSha256::update(std::span<const uint8_t> bytes) {
  COHORT_CHECK(EVP_MAC_update(state_->ctx, bytes.data(), bytes.size()) == 1, Error, "OpenSSL HMAC update failed");
  return *this;
}

HmacSha256& HmacSha256::update(std::string_view text) {
  return update(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

Digest HmacSha256::final() {
  Digest out{};
  size_t written = 0;
  COHORT_CHECK(EVP_MAC_final(state_->ctx, out.data(), &written, out.size()) == 1 && written == out.size(), Error,
               "OpenSSL HMAC final failed");
  // The same key again, for the next message (a null key keeps the one given at construction).
  COHORT_CHECK(EVP_MAC_init(state_->ctx, nullptr, 0, nullptr) == 1, Error, "OpenSSL HMAC restart failed");
  return out;
}

struct Gmac::State {
  EVP_CIPHER_CTX* ctx = nullptr;
  ~State() { EVP_CIPHER_CTX_free(ctx); }
};

Gmac::Gmac(std::span<const uint8_t, 16> key) : state_(std::make_unique<State>()) {
  state_->ctx = EVP_CIPHER_CTX_new();
  COHORT_CHECK(state_->ctx != nullptr &&
                   EVP_EncryptInit_ex(state_->ctx, EVP_aes_128_gcm(), nullptr, key.data(), nullptr) == 1,
               Error, "OpenSSL could not start an AES-128-GCM");
}

Gmac::~Gmac() = default;

Gmac::Tag Gmac::tag(std::span<const uint8_t, 12> nonce, std::initializer_list<std::span<const uint8_t>> parts) {
  EVP_CIPHER_CTX* ctx = state_->ctx;
  int len = 0;
  bool ok = EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, nonce.data()) == 1;
  for (const auto& part : parts) {
    // OpenSSL takes int lengths: feed large parts in pieces.
    for (size_t at = 0; ok && at < part.size(); at += size_t(1) << 30) {
      const size_t n = std::min(part.size() - at, size_t(1) << 30);
      ok = EVP_EncryptUpdate(ctx, nullptr, &len, part.data() + at, int(n)) == 1;
    }
  }
  Tag out{};
  ok = ok && EVP_EncryptFinal_ex(ctx, nullptr, &len) == 1 &&
       EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, int(out.size()), out.data()) == 1;
  COHORT_CHECK(ok, Error, "OpenSSL AES-GMAC failed");
  return out;
}

void randomBytes(std::span<uint8_t> out) {
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::getrandom(out.data() + got, out.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    COHORT_CHECK(n > 0, Error, "getrandom failed: ", std::strerror(errno));
    got += size_t(n);
  }
}

std::string toHex(std::span<const uint8_t> bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * bytes.size());
  for (uint8_t b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

std::string randomToken(size_t bytes) {
  std::vector<uint8_t> raw(bytes);
  randomBytes(raw);
  return toHex(raw);
}

bool equalConstantTime(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Certificate = std::unique_ptr<X509, X509Free>;
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;

// A passphrase callback that has none: OpenSSL's default would prompt on the terminal.
int noPassphrase(char*, int, int, void*) { return 0; }

Bio memoryBio(std::string_view bytes) { return Bio(BIO_new_mem_buf(bytes.data(), int(bytes.size()))); }

// The first certificate of a PEM text, null when it has none.
Certificate firstCertificate(std::string_view pem) {
  Bio bio = memoryBio(pem);
  return Certificate(bio ? PEM_read_bio_X509(bio.get(), nullptr, noPassphrase, nullptr) : nullptr);
}

}  // namespace

std::string pemCertificateProblem(std::string_view pem) {
  const bool found = firstCertificate(pem) != nullptr;
  ERR_clear_error();
  return found ? "" : "holds no PEM certificate (-----BEGIN CERTIFICATE-----)";
}

std::string pemKeyProblem(std::string_view key, std::string_view certificate) {
  Bio bio = memoryBio(key);
  Key parsed(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, noPassphrase, nullptr) : nullptr);
  std::string problem;
  if (parsed == nullptr) {
    problem = "holds no PEM private key (an encrypted one is not read: give it unencrypted)";
  } else if (Certificate c = firstCertificate(certificate);
             c != nullptr && X509_check_private_key(c.get(), parsed.get()) != 1) {
    problem = "is not the key of --tls-cert's certificate";
  }
  ERR_clear_error();
  return problem;
}

}  // namespace cohort::crypto
