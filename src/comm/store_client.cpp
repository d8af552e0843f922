// The rendezvous store's client: one connection that proves the job's secret (comm/store.h) and
// then sends one request at a time.
#include "comm/store.h"

#include "comm/store_internal.h"

#include "base/host_port.h"
#include "base/thread_annotations.h"

#include <cohort/error.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <thread>

namespace cohort::store {

struct Client::Impl {
  std::string where;
  std::chrono::milliseconds timeout{};
  Mutex mu;
  Channel channel GUARDED_BY(mu);
  bool broken GUARDED_BY(mu) = false;

  ~Impl() {
    MutexLock lock(mu);
    if (channel.fd >= 0) ::close(channel.fd);
  }

  // Sends one request and reads its reply; `wait` is how long the server may hold it.
  std::vector<uint8_t> call(const std::vector<uint8_t>& request, std::chrono::milliseconds wait,
                            const std::string& what) EXCLUDES(mu) {
    MutexLock lock(mu);
    COHORT_CHECK(!broken, CommError, "rendezvous store at ", where, ": the connection was lost earlier; cannot ", what);
    const auto deadline = Clock::now() + timeout + wait;
    IoStatus r = channel.send(request, deadline);
    std::vector<uint8_t> reply;
    bool bad = false;
    if (r == IoStatus::kOk) r = channel.receive(reply, deadline, bad);
    if (r != IoStatus::kOk || reply.empty() || reply[0] == uint8_t(Status::kRefused)) {
      broken = true;
      const std::string why = bad ? "a reply failed its authentication tag" : reply.empty() ? describe(r) : "refused";
      if (r == IoStatus::kTimeout) {
        throw TimeoutError("rendezvous store at " + where + ": " + what + ": no answer within " +
                           std::to_string((timeout + wait).count() / 1000) + " s: is the chief alive?");
      }
      throw CommError("rendezvous store at " + where + ": " + what + " failed: " + why +
                      ": the chief (which hosts the store) may have ended");
    }
    return reply;
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

std::unique_ptr<Client> Client::connect(const std::string& host, int port, const std::string& secret,
                                        std::chrono::milliseconds timeout) {
  COHORT_CHECK(port >= 1 && port <= 65535, CommError, "the rendezvous store's address ", HostPort{host, port}.str(),
               " has no port: only the chief may be given port 0 (it then listens on any free port, which "
               "cohort launch hands to the others); give the other workers the chief's MASTER_PORT");
  auto impl = std::make_unique<Impl>();
  impl->where = HostPort{host, port}.str();
  impl->timeout = timeout;
  MutexLock lock(impl->mu);  // nobody else sees impl yet; this keeps the analysis exact
  const auto deadline = Clock::now() + timeout;
  std::string lastError = "nothing listens there";
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    const int fd = connectTo(HostPort{host, port}, deadline, lastError);
    if (fd >= 0) {
      impl->channel.fd = fd;
      break;
    }
    if (Clock::now() + backoff >= deadline) {
      throw TimeoutError("cannot reach the job's rendezvous store at " + impl->where + " within " +
                         std::to_string(timeout.count() / 1000) + " s (" + lastError +
                         "): check that the chief runs and that MASTER_ADDR/MASTER_PORT name it");
    }
    std::this_thread::sleep_for(backoff);  // nothing listens yet: the chief may still be starting
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }

  const int fd = impl->channel.fd;
  auto fail = [&](const std::string& why) -> std::unique_ptr<Client> {
    throw CommError("the rendezvous store at " + impl->where + " " + why);
  };
  std::array<uint8_t, kChallengeBytes> challenge{};
  const IoLimits limits{.deadline = deadline};
  if (const IoStatus r = readFull(fd, challenge.data(), challenge.size(), limits); r != IoStatus::kOk) {
    return fail(std::string("did not greet: ") + describe(r) + ": is that port the chief's store?");
  }
  const uint32_t magic = decodeFixed32(challenge.data()), flags = decodeFixed32(challenge.data() + 4);
  if (magic != kMagic)
    return fail("is not a cohort store (another program, or another version of cohort, on that port)");
  const auto serverNonce = std::span<const uint8_t>(challenge).subspan(8, kNonceBytes);
  if ((flags & kFlagSecret) == 0 && !secret.empty()) {
    return fail(
        "runs without a secret but this process has one: give every process of the job the same "
        "COHORT_AUTH_TOKEN (cohort launch does)");
  }
  if ((flags & kFlagSecret) != 0) {
    if (secret.empty()) {
      return fail("needs the job's secret: set COHORT_AUTH_TOKEN (or --auth-token) to the chief's on every process");
    }
    const auth::Nonce clientNonce = auth::freshNonce();
    const auth::Handshake h = handshakeOf(secret, serverNonce, clientNonce);
    const auth::Proof mine = h.connectorProof();
    std::array<uint8_t, kHelloBytes> hello{};
    std::copy(clientNonce.begin(), clientNonce.end(), hello.begin());
    std::copy(mine.begin(), mine.end(), hello.begin() + kNonceBytes);
    std::array<uint8_t, kAnswerBytes> answer{};
    if (writeFull(fd, hello.data(), hello.size(), limits) != IoStatus::kOk ||
        readFull(fd, answer.data(), answer.size(), limits) != IoStatus::kOk || answer[0] != 1) {
      // Also what a rank of a second job sees when it finds the first job's store on its port.
      return fail(
          "refused this process's proof of the secret: another job may be listening on this port (give "
          "this job a free one: --port or MASTER_PORT), or this process's COHORT_AUTH_TOKEN differs from "
          "the chief's");
    }
    if (!h.isAcceptorProof(std::span<const uint8_t>(answer).subspan(1))) {
      return fail(
          "did not prove the job's secret: another job's store on this port (give this job a free one: "
          "--port or MASTER_PORT), a forged store, or another COHORT_AUTH_TOKEN");
    }
    impl->channel.seal(h.sessionKey(), auth::Direction::kToAcceptor);
  }
  impl->channel.maxBody = size_t(1) << 31;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

void Client::set(const std::string& key, const std::vector<uint8_t>& value) {
  COHORT_CHECK(key.size() <= kMaxKeyBytes, InvalidArgument, "store key longer than ", kMaxKeyBytes, " bytes");
  std::vector<uint8_t> request;
  request.reserve(1 + 4 + key.size() + value.size());
  request.push_back(uint8_t(Op::kSet));
  putString(request, key);
  request.insert(request.end(), value.begin(), value.end());
  impl_->call(request, std::chrono::milliseconds(0), "setting " + key);
}

std::optional<std::vector<uint8_t>> Client::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::vector<uint8_t> request{uint8_t(Op::kGet)};
  putFixed64(request, uint64_t(std::max<int64_t>(timeout.count(), 0)));
  putString(request, key);
  std::vector<uint8_t> reply = impl_->call(request, timeout, "reading " + key);
  if (reply[0] == uint8_t(Status::kTimedOut)) return std::nullopt;
  reply.erase(reply.begin());
  return reply;
}

int64_t Client::add(const std::string& key, int64_t delta) {
  std::vector<uint8_t> request{uint8_t(Op::kAdd)};
  putFixed64(request, uint64_t(delta));
  putString(request, key);
  const std::vector<uint8_t> reply = impl_->call(request, std::chrono::milliseconds(0), "adding to " + key);
  ByteReader in(reply);
  in.u8();
  const auto v = int64_t(in.u64());
  COHORT_CHECK(in.done(), CommError, "rendezvous store at ", impl_->where, ": a malformed answer to add");
  return v;
}

bool Client::check(const std::vector<std::string>& keys) {
  std::vector<uint8_t> request{uint8_t(Op::kCheck)};
  putFixed32(request, uint32_t(keys.size()));
  for (const auto& k : keys) putString(request, k);
  const std::vector<uint8_t> reply = impl_->call(request, std::chrono::milliseconds(0), "checking keys");
  return reply.size() == 2 && reply[1] == 1;
}

bool Client::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<uint8_t> request{uint8_t(Op::kWait)};
  putFixed64(request, uint64_t(std::max<int64_t>(timeout.count(), 0)));
  putFixed32(request, uint32_t(keys.size()));
  for (const auto& k : keys) putString(request, k);
  const std::vector<uint8_t> reply = impl_->call(request, timeout, "waiting for keys");
  return reply[0] == uint8_t(Status::kOk);
}

bool Client::remove(const std::string& key) {
  std::vector<uint8_t> request{uint8_t(Op::kDelete)};
  putString(request, key);
  const std::vector<uint8_t> reply = impl_->call(request, std::chrono::milliseconds(0), "deleting " + key);
  return reply.size() == 2 && reply[1] == 1;
}

int64_t Client::numKeys() {
  const std::vector<uint8_t> reply =
      impl_->call(std::vector<uint8_t>{uint8_t(Op::kNumKeys)}, std::chrono::milliseconds(0), "counting keys");
  ByteReader in(reply);
  in.u8();
  return int64_t(in.u64());
}

std::chrono::milliseconds Client::timeout() const { return impl_->timeout; }
std::string Client::where() const { return impl_->where; }

}  // namespace cohort::store
