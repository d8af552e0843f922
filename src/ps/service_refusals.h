// The shard service's refusals (service.cpp): the cap a request is held to (kInitCap, capForValues),
// and Refusals, which checks a call's declared and read size against it and counts, logs and
// answers a caller refused for its proof or its size. Private to src/ps.
#pragma once

#include "ps/call_auth.h"
#include "ps/client.h"
#include "ps/shard.h"
#include "ps/status.h"

#include <cohort/env.h>

#include "ps.pb.h"

#include <grpcpp/support/status.h>

#include <malloc.h>

#include <atomic>
#include <charconv>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace cohort::ps::service_internal {

// The most bytes an Init may carry: a shard's part of the model, at most what one checkpoint may
// hold (2 GiB), and its names. It is every request's cap until the chief's Init came, and an
// Init's always (a fresh Init replaces the layout).
constexpr uint64_t kInitCap = (uint64_t(2) << 30) + (uint64_t(256) << 20);
// Every other request's cap once a layout is known: twice the shard's values (a row-sparse or
// top-k push carries an index beside each value) as float32, and 1 MB for the header.
inline uint64_t capForValues(uint64_t values) { return 2 * values * sizeof(float) + (uint64_t(1) << 20); }

// Which cap a request is held to.
enum class Request { kInit, kOther };

// What the service does with a caller that has not shown the token, or whose request is over the
// cap: counts it, logs it (rate-limited: a misconfigured worker retrying, or a scanner, must not
// flood the log), and asks for the memory its request took back from the heap.
class Refusals {
 public:
  Refusals(std::shared_ptr<Shard> shard, std::string name, std::function<void(const std::string&)> log, Env* env)
      : shard_(std::move(shard)), name_(std::move(name)), log_(std::move(log)), env_(envOrStandard(env)) {}

  grpc::Status refuse(const std::string& peer, ProofCheck why) {
    shard_->countUnauthenticated();
    wantTrim();
    const int64_t n = ++refused_;
    if (n <= 10 || n % 100 == 0) {
      log("refused a request from " + peer + ": " + describe(why) + " (" + std::to_string(n) + " refused so far)");
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        std::string(describe(why)) + ": every process of the job needs the same --auth-token");
  }

  // The most bytes one request may carry (see kInitCap, capForValues).
  uint64_t cap(Request request) const { return request == Request::kInit ? kInitCap : layoutCap_.load(); }
  // After every accepted Init.
  void setLayout(const wire::InitRequest& init) {
    uint64_t values = 0;
    for (const auto& p : init.pieces()) values += p.numel();
    values_ = values;
    layoutCap_ = capForValues(values);
  }

  // The size a call declares (kRequestBytesKey), into `declared`, against the cap: OK or why not
  // (not counted yet: see reject). `read`: whether the body was read already.
  Status checkDeclared(Request request, std::optional<std::string_view> header, bool read, uint64_t* declared) const {
    const std::string when = read ? "" : "; its body was not read";
    if (!header) {
      return refusal(Code::kInvalidArgument, "a request without " + std::string(kRequestBytesKey) +
                                                 " (its size); this shard reads at most " + describeCap(request) +
                                                 " of one" + when);
    }
    const auto parsed = std::from_chars(header->data(), header->data() + header->size(), *declared);
    if (header->empty() || parsed.ec != std::errc() || parsed.ptr != header->data() + header->size()) {
      return refusal(Code::kInvalidArgument,
                     "a request whose " + std::string(kRequestBytesKey) + " is not a number of bytes" + when);
    }
    if (*declared > cap(request)) {
      return refusal(Code::kResourceExhausted, "a request of " + std::to_string(*declared) +
                                                   " bytes is over this shard's cap of " + describeCap(request) + when);
    }
    return Status::Ok();
  }

  // The bytes that arrived (so far) against the cap and what the call declared.
  Status checkRead(Request request, uint64_t bytes, uint64_t declared) const {
    if (bytes > cap(request)) {
      return refusal(Code::kResourceExhausted, "a request of " + std::to_string(bytes) +
                                                   " bytes is over this shard's cap of " + describeCap(request) +
                                                   " (it declared " + std::to_string(declared) + ")");
    }
    if (bytes > declared) {
      return refusal(Code::kInvalidArgument, "a request carries more than the " + std::to_string(declared) +
                                                 " bytes it declared (" + std::to_string(bytes) + " so far)");
    }
    return Status::Ok();
  }

  // A request refused for its size or form: counted as rejected, its memory given back.
  grpc::Status reject(const Status& why) {
    shard_->countRejected(why);
    wantTrim();
    return grpc::Status(grpc::StatusCode(why.code), why.message);
  }

  const std::string& name() const { return name_; }

  void log(const std::string& message) const {
    if (log_) {
      log_(message);
    } else {
      env_.log(LogLevel::kInfo, name_ + ": " + message);
    }
  }

  // A large request that was refused was read into the heap, which keepFreedMemory() keeps from
  // shrinking; the next call (or serveShard's loop) gives those pages back.
  void wantTrim() { trim_ = true; }
  void trimIfWanted() {
    if (trim_.exchange(false)) ::malloc_trim(0);
  }

 private:
  Status refusal(Code code, const std::string& what) const {
    return Status::error(code, "ps shard " + name_ + ": " + what);
  }

  std::string describeCap(Request request) const {
    const uint64_t values = values_;
    return std::to_string(cap(request)) + " bytes (" +
           (request == Request::kInit || values == 0
                ? std::string("what an Init may carry: a shard's part of the model, at most 2 GiB, and its names")
                : "twice the " + std::to_string(values) + " values this shard holds, as float32, and 1 MB") +
           ")";
  }

  const std::shared_ptr<Shard> shard_;
  const std::string name_;
  const std::function<void(const std::string&)> log_;
  Env& env_;
  std::atomic<int64_t> refused_{0};
  std::atomic<bool> trim_{false};
  std::atomic<uint64_t> layoutCap_{kInitCap};  // until the first Init: an Init's
  std::atomic<uint64_t> values_{0};
};

}  // namespace cohort::ps::service_internal
