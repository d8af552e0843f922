// c10d::Store's calls onto a store::Client (comm/c10d_store.h).
#include "comm/c10d_store.h"

#include <cohort/error.h>

#include <optional>

namespace cohort::store {

C10dStore::C10dStore(std::string host, int port, std::string secret, std::chrono::milliseconds timeout)
    : c10d::Store(timeout),
      host_(std::move(host)),
      port_(port),
      secret_(std::move(secret)),
      client_(Client::connect(host_, port_, secret_, timeout)) {}

c10::intrusive_ptr<c10d::Store> C10dStore::clone() {
  return c10::make_intrusive<C10dStore>(host_, port_, secret_, timeout_);
}

void C10dStore::set(const std::string& key, const std::vector<uint8_t>& value) { client_->set(key, value); }

std::vector<uint8_t> C10dStore::get(const std::string& key) {
  std::optional<std::vector<uint8_t>> value = client_->get(key, timeout_);
  if (!value) {
    throw TimeoutError("rendezvous store at " + client_->where() + ": " + key + " did not appear within " +
                       std::to_string(timeout_.count() / 1000) + " s (timed out)");
  }
  return std::move(*value);
}

int64_t C10dStore::add(const std::string& key, int64_t value) { return client_->add(key, value); }
bool C10dStore::deleteKey(const std::string& key) { return client_->remove(key); }
bool C10dStore::check(const std::vector<std::string>& keys) { return client_->check(keys); }
int64_t C10dStore::getNumKeys() { return client_->numKeys(); }
void C10dStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void C10dStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  if (!client_->wait(keys, timeout)) {
    throw TimeoutError("rendezvous store at " + client_->where() + ": keys did not appear within " +
                       std::to_string(timeout.count() / 1000) + " s (timed out)");
  }
}

}  // namespace cohort::store
