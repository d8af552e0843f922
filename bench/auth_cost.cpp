// What authentication costs per step: the tag of a gossip frame (AES-GMAC since protocol 3,
// HMAC-SHA256 before, for comparison) over a message of the cnn's size, and a shard call's proof
// (made by the worker, checked by the shard). Torch-free; one core. bench/attack.py's table and
// docs/BENCHMARKS.md put these beside a step's time.
//
//   build/bench/auth_cost [--bytes 4402880] [--reps 21]
#include "base/crypto.h"
#include "ps/call_auth.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double medianSeconds(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = 4'402'880;  // the cnn's 1,100,720 float32 parameters: one raw gossip update
  int reps = 21;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--bytes") == 0) bytes = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
  }
  using namespace cohort;
  std::vector<uint8_t> data(bytes);
  crypto::randomBytes(data);
  std::array<uint8_t, 16> key{};
  crypto::randomBytes(key);
  crypto::Gmac gmac(key);
  crypto::HmacSha256 hmac{std::span<const uint8_t>(key)};
  std::array<uint8_t, 12> nonce{};
  volatile uint8_t sink = 0;
  const double tGmac = medianSeconds(reps, [&] {
    nonce[0]++;
    sink = sink + gmac.tag(nonce, {data})[0];
  });
  const double tHmac = medianSeconds(reps, [&] { sink = sink + hmac.update(data).final()[0]; });
  std::vector<uint8_t> copy(bytes);
  const double tCopy = medianSeconds(reps, [&] {
    std::memcpy(copy.data(), data.data(), bytes);
    sink = sink + copy[bytes / 2];
  });
  const std::string secret = crypto::randomToken();
  ps::CallVerifier verifier(secret);
  constexpr int kCalls = 2000;
  std::vector<std::string> proofs(kCalls);
  const double tMake = medianSeconds(5, [&] {
    for (auto& p : proofs) p = ps::makeCallProof(secret);
  }) / kCalls;
  int ok = 0;
  const double tCheck = medianSeconds(1, [&] {
    for (const auto& p : proofs) ok += verifier.check(p) == ps::ProofCheck::kOk;
  }) / kCalls;
  const double mb = double(bytes) / 1e6;
  std::printf("message %.2f MB, median of %d\n", mb, reps);
  std::printf("gossip tag, AES-GMAC (protocol 3):    %7.3f ms  %6.2f GB/s\n", tGmac * 1e3, mb / 1e3 / tGmac);
  std::printf("gossip tag, HMAC-SHA256 (protocol 2): %7.3f ms  %6.2f GB/s\n", tHmac * 1e3, mb / 1e3 / tHmac);
  std::printf("memcpy, for scale:                    %7.3f ms  %6.2f GB/s\n", tCopy * 1e3, mb / 1e3 / tCopy);
  std::printf("shard call proof: make %.2f us, check %.2f us (%d of %d good)\n", tMake * 1e6, tCheck * 1e6, ok,
              kCalls);
  std::printf("{\"bytes\": %zu, \"gmac_ms\": %.4f, \"hmac_ms\": %.4f, \"memcpy_ms\": %.4f, \"proof_make_us\": %.3f, "
              "\"proof_check_us\": %.3f}\n",
              bytes, tGmac * 1e3, tHmac * 1e3, tCopy * 1e3, tMake * 1e6, tCheck * 1e6);
  return sink == 255 ? 0 : 0;
}
