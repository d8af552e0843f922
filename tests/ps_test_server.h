// A ShardServer on 127.0.0.1 for the torch-free ps tests (ps_grpc_tests), whose log lines a test
// can read. gRPC's headers: keep it out of the translation units that include torch.
#pragma once

#include "ps/client.h"
#include "ps/service.h"

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cohort::ps {

// A ShardServer on 127.0.0.1 whose log lines the test can read.
struct TestServer {
  std::mutex mu;
  std::vector<std::string> logged;
  std::unique_ptr<ShardServer> server;

  explicit TestServer(ServerOptions options = {}) {
    if (options.address == ServerOptions{}.address) options.address = "127.0.0.1:0";
    options.shard.name = "test";
    options.shard.log = [this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mu);
      logged.push_back(m);
    };
    server = std::make_unique<ShardServer>(options);
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(server->port()); }

  std::unique_ptr<ShardClient> client(ClientOptions options = {.timeoutSeconds = 5, .quiet = true}) const {
    return makeGrpcClient(address(), options);
  }

  std::vector<std::string> log() {
    std::lock_guard<std::mutex> lock(mu);
    return logged;
  }
};

}  // namespace cohort::ps
