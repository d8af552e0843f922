#include "ps/call_auth.h"

#include "base/crypto.h"

#include <algorithm>
#include <array>
#include <charconv>

namespace cohort::ps {

namespace {

constexpr std::string_view kScheme = "CohortHMAC ";
constexpr size_t kNonceHex = 32;

int64_t nowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string callProof(const std::string& secret, int64_t unixMs, const std::string& nonceHex) {
  const std::string stamp = std::to_string(unixMs) + "." + nonceHex;
  crypto::HmacSha256 mac(secret);
  mac.update(std::string_view("cohort-ps call"));
  mac.update(stamp);
  const crypto::Digest d = mac.final();
  return std::string(kScheme) + stamp + "." + crypto::toHex(d);
}

std::string makeCallProof(const std::string& secret) {
  std::array<uint8_t, kNonceHex / 2> nonce{};
  crypto::randomBytes(nonce);
  return callProof(secret, nowMs(), crypto::toHex(nonce));
}

const char* describe(ProofCheck result) {
  switch (result) {
    case ProofCheck::kOk: return "ok";
    case ProofCheck::kMissing: return "no proof of the job's secret";
    case ProofCheck::kMalformed: return "a malformed proof";
    case ProofCheck::kWrong: return "a wrong proof (another secret)";
    case ProofCheck::kStale: return "a proof whose time is off by more than a minute (are the clocks synchronized?)";
    case ProofCheck::kReplayed: return "a replayed proof";
  }
  return "?";
}

CallVerifier::CallVerifier(std::string secret, std::chrono::milliseconds window)
    : secret_(std::move(secret)), windowMs_(window.count()) {}

ProofCheck CallVerifier::check(std::string_view header) { return check(header, nowMs()); }

ProofCheck CallVerifier::check(std::string_view header, int64_t now) {
  if (header.empty()) return ProofCheck::kMissing;
  if (header.substr(0, kScheme.size()) != kScheme) return ProofCheck::kMalformed;
  const std::string_view rest = header.substr(kScheme.size());
  const size_t dot1 = rest.find('.');
  const size_t dot2 = dot1 == std::string_view::npos ? dot1 : rest.find('.', dot1 + 1);
  if (dot2 == std::string_view::npos || dot1 == 0 || dot1 > 19 || dot2 - dot1 - 1 != kNonceHex ||
      rest.size() - dot2 - 1 != 64) {
    return ProofCheck::kMalformed;
  }
  // Digits only (from_chars would take a sign), and within int64_t: 19 digits can exceed it, and
  // this runs before the proof is checked, on anyone's bytes.
  const std::string_view digits = rest.substr(0, dot1);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return ProofCheck::kMalformed;
  }
  int64_t stamp = 0;
  if (std::from_chars(digits.data(), digits.data() + digits.size(), stamp).ec != std::errc()) {
    return ProofCheck::kMalformed;
  }
  const std::string nonce(rest.substr(dot1 + 1, kNonceHex));
  const std::string expected = callProof(secret_, stamp, nonce);
  const std::span<const uint8_t> given(reinterpret_cast<const uint8_t*>(header.data()), header.size());
  const std::span<const uint8_t> want(reinterpret_cast<const uint8_t*>(expected.data()), expected.size());
  if (given.size() != want.size() || !crypto::equalConstantTime(given, want)) return ProofCheck::kWrong;
  if (stamp < now - windowMs_ / 2 || stamp > now + windowMs_ / 2) return ProofCheck::kStale;
  MutexLock lock(mu_);
  while (!order_.empty() && order_.front().first < now - windowMs_) {
    seen_.erase(order_.front().second);
    order_.pop_front();
  }
  if (!seen_.insert(nonce).second) return ProofCheck::kReplayed;
  order_.emplace_back(stamp, nonce);
  return ProofCheck::kOk;
}

}  // namespace cohort::ps
