// c10d's Store over cohort's own (comm/store.h), which authenticates its clients: what Gloo's
// group formation reads from it is what the job's own processes wrote. Failures are thrown as
// c10d's errors are (std::runtime_error with a message), and caught by Communicator::connect.
//
// c10d 2.x asks a store for clone(): an independent connection to the same store, for a thread
// that must not wait behind another's request. Ours connects a new Client with the same secret.
#pragma once

#include "comm/store.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cohort::store {

class C10dStore : public c10d::Store {
 public:
  // Connects a Client (Client::connect's errors and timeout).
  C10dStore(std::string host, int port, std::string secret, std::chrono::milliseconds timeout);

  c10::intrusive_ptr<c10d::Store> clone() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  // Waits the store's timeout for the key; throws TimeoutError when it did not appear.
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  // Throws TimeoutError when the keys did not all appear within `timeout`.
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  std::string host_;
  int port_;
  std::string secret_;
  std::unique_ptr<Client> client_;
};

}  // namespace cohort::store
