// How a call proves the job's secret to a shard without sending it: the `authorization` header is
//   CohortHMAC <unix ms>.<nonce, 32 hex>.<HMAC-SHA256(secret, "cohort-ps call" | ms | "." | nonce), 64 hex>
// A shard takes a proof once (a replayed header is refused), and only while its time is within
// the window of the shard's clock. It proves who sent the call, not what the body says: a
// stranger who can alter traffic in flight can alter a body; TLS (--tls-*) protects that too.
// Torch-free.
#pragma once

#include "base/thread_annotations.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_set>

namespace cohort::ps {

// A fresh header value for one call.
std::string makeCallProof(const std::string& secret);
// The header value for the given time and nonce (for tests).
std::string callProof(const std::string& secret, int64_t unixMs, const std::string& nonceHex);

enum class ProofCheck { kOk, kMissing, kMalformed, kWrong, kStale, kReplayed };
const char* describe(ProofCheck result);

class CallVerifier {
 public:
  // Proofs whose time is more than window/2 from this machine's clock are stale: the clocks of a
  // job's machines must agree that well (NTP does).
  explicit CallVerifier(std::string secret, std::chrono::milliseconds window = std::chrono::seconds(120));
  // Thread-safe.
  ProofCheck check(std::string_view header, int64_t nowUnixMs) EXCLUDES(mu_);
  ProofCheck check(std::string_view header);

 private:
  const std::string secret_;
  const int64_t windowMs_;
  Mutex mu_;
  std::unordered_set<std::string> seen_ GUARDED_BY(mu_);             // nonces inside the window
  std::deque<std::pair<int64_t, std::string>> order_ GUARDED_BY(mu_);  // (time, nonce), oldest first
};

}  // namespace cohort::ps
