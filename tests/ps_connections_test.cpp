// How many connections a shard keeps: half its process's open-file limit, with no fixed ceiling
// below it (it had one, 1024: a job of more workers lost the rest at connect, each retrying until
// its timeout said the shard was "unreachable"); a job that cannot fit is refused at Init, and a
// connection past the limit is logged, both naming the limit and the fix.
#include "ps.grpc.pb.h"
#include "ps/client.h"
#include "ps/service.h"
#include "ps/wire.h"
#include "ps_test_server.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cohort::ps {
namespace {

using namespace std::chrono_literals;

// Whether a line of the shard's log says both `a` and `b`.
bool logSays(TestServer& server, const std::string& a, const std::string& b) {
  for (const auto& line : server.log()) {
    if (line.find(a) != std::string::npos && line.find(b) != std::string::npos) return true;
  }
  return false;
}

wire::InitRequest initFor(uint32_t workers) {
  wire::InitRequest r;
  r.set_protocol(kProtocolVersion);
  wire::Policy& p = *r.mutable_policy();
  p.set_mode(wire::MODE_ASYNC);
  p.set_workers(workers);
  p.set_optimizer(wire::OPTIMIZER_SGD);
  p.set_lr(0.5);
  p.set_push(wire::PUSH_GRADIENTS);
  p.set_staleness_lr(wire::STALENESS_LR_NONE);
  p.set_max_staleness(-1);
  p.set_timeout_s(5);
  wire::PieceSpec piece;
  piece.set_key(0);
  piece.set_name("a");
  piece.set_numel(2);
  *r.add_pieces() = piece;
  const float values[2] = {1, 2};
  setTensor(r.add_values(), piece, values);
  return r;
}

// A Stats call on a connection of its own (gRPC shares a connection between channels of the same
// arguments): the connection is proven (the shard has no secret) and stays open with `channel`.
grpc::Status statsOnNewConnection(const std::string& address, int id, std::shared_ptr<grpc::Channel>* channel) {
  grpc::ChannelArguments args;
  args.SetInt("cohort.test.connection", id);
  *channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  auto stub = wire::ParameterServer::NewStub(*channel);
  wire::StatsRequest request;
  request.set_protocol(kProtocolVersion);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 10s);
  context.AddMetadata(kRequestBytesKey, std::to_string(request.ByteSizeLong()));
  wire::StatsReply reply;
  return stub->Stats(&context, request, &reply);
}

// 1,100 workers' worth of connections (each proven by a call) on one shard: every one is kept.
TEST(PsConnectionsTest, AShardKeepsMoreThan1024Connections) {
  constexpr int kConnections = 1100;
  // Both ends are in this process: two descriptors a connection, and the shard keeps half.
  rlimit files{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &files), 0);
  const rlim_t needed = 4 * kConnections + 256;
  if (files.rlim_cur < needed) {
    files.rlim_cur = std::min(files.rlim_max, needed);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &files), 0);
  }
  ASSERT_GE(files.rlim_cur, needed) << "this test needs an open-file limit of " << needed
                                    << " (ulimit -n); the hard limit here is " << files.rlim_max;
  TestServer server;
  std::vector<std::shared_ptr<grpc::Channel>> channels(kConnections);
  int failed = 0;
  std::string firstError;
  for (int i = 0; i < kConnections; ++i) {
    const grpc::Status s = statsOnNewConnection(server.address(), i, &channels[size_t(i)]);
    if (!s.ok() && failed++ == 0) firstError = "connection " + std::to_string(i) + ": " + s.error_message();
  }
  EXPECT_EQ(failed, 0) << firstError;
  const ConnectionCounts counts = server.server->connections();
  EXPECT_EQ(counts.dropped, 0);
  EXPECT_GE(counts.open, kConnections);
  EXPECT_EQ(counts.unproven, 0);
}

// A job with more workers than the shard can keep connections for is refused at its chief's Init,
// naming the limit and the fix; one that fits is taken.
TEST(PsConnectionsTest, AJobTheShardCannotKeepConnectionsForIsRefusedAtInit) {
  TestServer server(ServerOptions{.maxConnections = 100});
  auto client = makeGrpcClient(server.address(), {.timeoutSeconds = 5, .quiet = true});
  wire::InitReply reply;
  // 64 of the 100 stay for callers still proving the secret: 36 workers fit, 37 do not.
  const Status refused = client->init(initFor(37), &reply);
  EXPECT_EQ(refused.code, Code::kFailedPrecondition) << refused.message;
  EXPECT_NE(refused.message.find("at most 100 connections"), std::string::npos) << refused.message;
  EXPECT_NE(refused.message.find("37 workers"), std::string::npos) << refused.message;
  EXPECT_NE(refused.message.find("ulimit -n"), std::string::npos) << refused.message;
  const Status taken = client->init(initFor(36), &reply);
  EXPECT_TRUE(taken.ok()) << taken.message;
}

// A connection past the limit is closed at once, and the shard's log says which limit and how to
// raise it.
TEST(PsConnectionsTest, AConnectionPastTheLimitIsLoggedNamingTheLimitAndTheFix) {
  TestServer server(ServerOptions{.maxConnections = 80});
  std::vector<std::shared_ptr<grpc::Channel>> channels(81);
  for (int i = 0; i < 80; ++i) {
    const grpc::Status s = statsOnNewConnection(server.address(), i, &channels[size_t(i)]);
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  EXPECT_FALSE(statsOnNewConnection(server.address(), 80, &channels[80]).ok());
  EXPECT_GE(server.server->connections().dropped, 1);
  EXPECT_TRUE(logSays(server, "80 are open, the most this shard keeps", "ulimit -n"));
}

}  // namespace
}  // namespace cohort::ps
