#include "base/launcher_channel.h"
#include "comm/store.h"

#include <cohort/error.h>
#include <cohort/rendezvous.h>

namespace cohort {

struct COHORT_LOCAL Rendezvous::Impl {
  std::unique_ptr<store::Server> server;  // the chief's
  std::unique_ptr<store::Client> client;
  std::chrono::milliseconds timeout;
};

Rendezvous::Rendezvous(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Rendezvous::~Rendezvous() = default;

std::unique_ptr<Rendezvous> Rendezvous::connect(const ClusterSpec& spec, std::chrono::milliseconds timeout) {
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
  } catch (const Error& e) {
    throw CommError("rank " + std::to_string(spec.rank) + ": " + e.what());
  }
  return std::unique_ptr<Rendezvous>(new Rendezvous(std::move(impl)));
}

void Rendezvous::set(const std::string& key, const std::string& value) {
  impl_->client->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Rendezvous::get(const std::string& key) {
  std::optional<std::vector<uint8_t>> value = impl_->client->get(key, impl_->timeout);
  if (!value) {
    throw TimeoutError("rendezvous store at " + impl_->client->where() + ": " + key + " did not appear within " +
                       std::to_string(impl_->timeout.count() / 1000) + " s: is every worker started?");
  }
  return std::string(value->begin(), value->end());
}


}  // namespace cohort
