#include "base/launcher_channel.h"
#include "comm/rank_claim.h"
#include "comm/store.h"

#include <cohort/error.h>
#include <cohort/rendezvous.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace cohort {

namespace store {

namespace {

constexpr const char* kArrivalsKey = "cohort/join/arrivals";
constexpr const char* kRefusedKey = "cohort/join/refused";

std::string arrivalKey(int64_t n) { return "cohort/join/arrival/" + std::to_string(n); }
std::string rankKey(int rank) { return "cohort/join/rank/" + std::to_string(rank); }
std::string claimKey(int rank, int64_t number) { return rankKey(rank) + "/" + std::to_string(number); }
std::string leftKey(int rank, int64_t number) { return claimKey(rank, number) + "/left"; }
std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }
std::string textOf(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

}  // namespace

std::string thisProcess() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return "pid " + std::to_string(::getpid()) + " on host " + host;
}

namespace {

// Whether `who` ("pid 4242 on host node3", thisProcess()) names a process of this host that has
// ended.
bool claimantHasEnded(const std::string& who) {
  const std::string prefix = "pid ", onHost = " on host ";
  const size_t at = who.find(onHost);
  if (who.rfind(prefix, 0) != 0 || at == std::string::npos) return false;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  if (who.substr(at + onHost.size()) != host) return false;
  const std::string digits = who.substr(prefix.size(), at - prefix.size());
  char* end = nullptr;
  const long pid = std::strtol(digits.c_str(), &end, 10);
  if (digits.empty() || *end != '\0' || pid <= 0) return false;
  return ::kill(pid_t(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

RankClaim RankClaim::make(Client& store, int rank, int worldSize, std::chrono::milliseconds timeout) {
  const std::string me = thisProcess();
  // Every process's world size against the first process's to arrive: any two that differ, one of
  // them the first's, end the job when the later of the two arrives.
  const int64_t arrival = store.add(kArrivalsKey, 1);
  store.set(arrivalKey(arrival), bytesOf(std::to_string(worldSize) + " " + std::to_string(rank) + " " + me));
  if (arrival > 1) {
    // The first sets its record just after its add; one that died between the two is not compared.
    const std::optional<std::vector<uint8_t>> first =
        store.get(arrivalKey(1), std::min(timeout, std::chrono::milliseconds(5000)));
    const std::string text = first ? textOf(*first) : "";
    const size_t a = text.find(' '), b = a == std::string::npos ? a : text.find(' ', a + 1);
    if (b != std::string::npos && text.substr(0, a) != std::to_string(worldSize)) {
      const std::string line = "rank " + std::to_string(rank) + " (" + me + ") has a world size of " +
                               std::to_string(worldSize) + ", rank " + text.substr(a + 1, b - a - 1) + " (" +
                               text.substr(b + 1) + ") " + text.substr(0, a) +
                               ": give every process of the job the same WORLD_SIZE (the same cluster in TF_CONFIG)";
      store.set(kRefusedKey, bytesOf(line));
      throw InvalidArgument(line);
    }
  }
  const int64_t number = store.add(rankKey(rank), 1);
  store.set(claimKey(rank, number), bytesOf(me));
  if (number == 1) return RankClaim(store, rank, worldSize, number);
  // The first claimant sets its name just after its add; one that died between the two is unnamed.
  const std::optional<std::vector<uint8_t>> first =
      store.get(claimKey(rank, 1), std::min(timeout, std::chrono::milliseconds(5000)));
  // A process of this host that has ended is no claimant: this one is its restart (a peer started
  // again alone, which its scheme then takes or refuses with its own reason), not a second process
  // given its RANK. On another host there is no telling: refused.
  if (first && claimantHasEnded(textOf(*first))) return RankClaim(store, rank, worldSize, number);
  const std::string line = "rank " + std::to_string(rank) + " is claimed by two processes, " +
                           (first ? textOf(*first) : std::string("another process")) + " and then " + me +
                           ": give each process of the job its own RANK, 0 to " + std::to_string(worldSize - 1) +
                           " (a launch line copied without changing RANK?)";
  store.set(kRefusedKey, bytesOf(line));
  store.set(leftKey(rank, number), {});
  throw InvalidArgument(line);
}

std::optional<std::string> RankClaim::refusal() const {
  if (!store_->check({kRefusedKey})) return std::nullopt;
  const std::optional<std::vector<uint8_t>> line = store_->get(kRefusedKey, std::chrono::milliseconds(0));
  if (!line) return std::nullopt;
  // Best effort: the line is read, and it is this process's error whether or not the chief (whose
  // store this is) is still there to count it leaving; its store gone, the set fails.
  try {
    store_->set(leftKey(rank_, number_), {});
  } catch (const CommError&) {
  }
  if (rank_ == 0) {
    // The chief's store outlives it by nothing: the others' lines first (any that has died, or is
    // still connecting, is waited for kRefusalLinger at most).
    std::vector<std::string> others;
    for (int r = 0; r < worldSize_; ++r) {
      const int64_t claims = store_->add(rankKey(r), 0);
      for (int64_t n = 1; n <= claims; ++n) {
        if (r != rank_ || n != number_) others.push_back(leftKey(r, n));
      }
    }
    if (!others.empty()) store_->wait(others, kRefusalLinger);
  }
  return textOf(*line);
}

}  // namespace store

struct COHORT_LOCAL Rendezvous::Impl {
  std::unique_ptr<store::Server> server;  // the chief's
  std::unique_ptr<store::Client> client;
  std::optional<store::RankClaim> claim;  // through client
  std::chrono::milliseconds timeout;
};

Rendezvous::Rendezvous(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Rendezvous::~Rendezvous() = default;

std::unique_ptr<Rendezvous> Rendezvous::connect(const ClusterSpec& spec, std::chrono::milliseconds timeout) {
  COHORT_CHECK(spec.worldSize >= 1 && spec.rank >= 0 && spec.rank < spec.worldSize, InvalidArgument, "rank ", spec.rank,
               " of a job of ", spec.worldSize, " workers: a rank is 0 to the world size - 1");
  auto impl = std::make_unique<Impl>();
  impl->timeout = timeout;
  try {
    int port = spec.master.port;
    if (spec.rank == 0) {
      // Port 0: any free port, told to the launcher (see Communicator::connect).
      impl->server = store::Server::start(
          store::ServerOptions{.host = spec.master.host, .port = spec.master.port, .secret = spec.storeKey()});
      port = impl->server->port();
      launcher::tellPort(port);
    }
    impl->client = store::Client::connect(spec.master.host, port, spec.storeKey(), timeout);
    impl->claim = store::RankClaim::make(*impl->client, spec.rank, spec.worldSize, timeout);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("rank " + std::to_string(spec.rank) + ": " + e.what());
  } catch (const Error& e) {
    throw CommError("rank " + std::to_string(spec.rank) + ": " + e.what());
  }
  return std::unique_ptr<Rendezvous>(new Rendezvous(std::move(impl)));
}

void Rendezvous::set(const std::string& key, const std::string& value) {
  impl_->client->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Rendezvous::get(const std::string& key) {
  // In periods, between which it checks whether another process refused the job (rank_claim.h).
  const auto deadline = std::chrono::steady_clock::now() + impl_->timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    std::optional<std::vector<uint8_t>> value = impl_->client->get(key, std::min(left, store::kRefusalCheckPeriod));
    if (value) return std::string(value->begin(), value->end());
    if (std::optional<std::string> why = impl_->claim->refusal()) throw InvalidArgument(*why);
  }
  throw TimeoutError("rendezvous store at " + impl_->client->where() + ": " + key + " did not appear within " +
                     std::to_string(impl_->timeout.count() / 1000) + " s: is every worker started?");
}

}  // namespace cohort
