#include <cohort/error.h>
#include <cohort/rendezvous.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace cohort {

struct Rendezvous::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string where;
  std::chrono::milliseconds timeout;
};

Rendezvous::Rendezvous(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Rendezvous::~Rendezvous() = default;

std::unique_ptr<Rendezvous> Rendezvous::connect(const ClusterSpec& spec, std::chrono::milliseconds timeout) {
  auto impl = std::make_unique<Impl>();
  impl->where = spec.master.str();
  impl->timeout = timeout;
  try {
    c10d::TCPStoreOptions options;
    options.port = uint16_t(spec.master.port);
    options.isServer = spec.rank == 0;
    options.waitWorkers = false;
    options.timeout = timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(spec.master.host, options);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw CommError("rank " + std::to_string(spec.rank) + ": cannot reach the job's rendezvous store at " +
                    impl->where + ": " + what.substr(0, what.find('\n')) +
                    ": check that the chief runs and that MASTER_ADDR/MASTER_PORT name it");
  }
  return std::unique_ptr<Rendezvous>(new Rendezvous(std::move(impl)));
}

void Rendezvous::set(const std::string& key, const std::string& value) {
  try {
    impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw CommError("rendezvous store at " + impl_->where + ": setting " + key + " failed: " +
                    what.substr(0, what.find('\n')));
  }
}

std::string Rendezvous::get(const std::string& key) {
  try {
    const std::vector<uint8_t> bytes = impl_->store->get(key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw TimeoutError("rendezvous store at " + impl_->where + ": " + key + " did not appear within " +
                       std::to_string(impl_->timeout.count() / 1000) + " s (" + what.substr(0, what.find('\n')) +
                       "): is every worker started?");
  }
}

}  // namespace cohort
