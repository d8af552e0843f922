// The parameter server over real gRPC on 127.0.0.1: the ShardServer, the retrying client, auth
// tokens, TLS, refused pushes, message sizes, and serveShard's ways to end.
#include "compress/codec.h"
#include "ps/client.h"
#include "ps/service.h"
#include "ps/call_auth.h"
#include "ps/frame.h"
#include "ps/grpc_frame.h"
#include "ps/optimizer.h"
#include "ps/wire.h"
#include "ps.grpc.pb.h"

#include "hostile.h"
#include "ps_test_server.h"
#include "ps_test_util.h"
#include "test_util.h"

#include <cohort/error.h>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <grpcpp/impl/codegen/rpc_service_method.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/resource_quota.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

namespace cohort::ps {
namespace {

using namespace std::chrono_literals;
using test::TempDir;

wire::Policy asyncPolicy() {
  wire::Policy p;
  p.set_mode(wire::MODE_ASYNC);
  p.set_workers(1);
  p.set_optimizer(wire::OPTIMIZER_SGD);
  p.set_lr(0.5);
  p.set_push(wire::PUSH_GRADIENTS);
  p.set_staleness_lr(wire::STALENESS_LR_NONE);
  p.set_max_staleness(-1);
  p.set_timeout_s(5);
  return p;
}

wire::PieceSpec piece(uint32_t key, const std::string& name, uint64_t numel) {
  wire::PieceSpec p;
  p.set_key(key);
  p.set_name(name);
  p.set_numel(numel);
  return p;
}

// Two pieces: a = {1, 2, 3}, b = {-1, 4}.
const std::vector<wire::PieceSpec> kPieces{piece(0, "a", 3), piece(1, "b", 2)};
const std::vector<std::vector<float>> kStart{{1, 2, 3}, {-1, 4}};

wire::InitRequest initOf(const wire::Policy& policy, const std::vector<wire::PieceSpec>& pieces,
                         const std::vector<std::vector<float>>& values) {
  wire::InitRequest r;
  r.set_protocol(kProtocolVersion);
  *r.mutable_policy() = policy;
  for (size_t i = 0; i < pieces.size(); ++i) {
    *r.add_pieces() = pieces[i];
    setTensor(r.add_values(), pieces[i], values[i].data());
  }
  return r;
}

wire::PushRequest pushOf(const std::vector<std::vector<float>>& grads, uint32_t worker = 0) {
  wire::PushRequest r;
  r.set_protocol(kProtocolVersion);
  r.set_worker(worker);
  r.set_samples(8);
  for (size_t i = 0; i < grads.size(); ++i) setTensor(r.add_values(), kPieces[i], grads[i].data());
  return r;
}

template <typename Request>
Request withProtocol() {
  Request r;
  r.set_protocol(kProtocolVersion);
  return r;
}

// Every value a Pull returns, pieces concatenated.
std::vector<float> pullAll(ShardClient& client) {
  wire::PullReply reply;
  const Status s = client.pull(withProtocol<wire::PullRequest>(), &reply);
  EXPECT_TRUE(s.ok()) << s.message;
  std::vector<float> out;
  for (const auto& t : reply.values()) appendFloats(t, out);
  return out;
}

wire::StatsReply statsOf(ShardClient& client) {
  wire::StatsReply reply;
  const Status s = client.stats(withProtocol<wire::StatsRequest>(), &reply);
  EXPECT_TRUE(s.ok()) << s.message;
  return reply;
}

// Waits (polling, up to 10 s) until `done` holds; false if it never did.
template <typename Condition>
bool eventually(const Condition& done) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

// What every client of ps/client.h says about a call: its request's bytes (kRequestBytesKey).
void declare(grpc::ClientContext& context, uint64_t bytes) {
  context.AddMetadata(kRequestBytesKey, std::to_string(bytes));
}

uint64_t bytesOf(const std::vector<OutgoingFrame>& messages) {
  uint64_t bytes = 0;
  for (const auto& m : messages) {
    bytes += m.head.size();
    for (const auto& p : m.payload) bytes += p.size_bytes();
  }
  return bytes;
}

void expectInit(ShardClient& client, const std::vector<wire::PieceSpec>& pieces = kPieces,
                const std::vector<std::vector<float>>& values = kStart) {
  wire::InitReply reply;
  const Status s = client.init(initOf(asyncPolicy(), pieces, values), &reply);
  ASSERT_TRUE(s.ok()) << codeName(s.code) << ": " << s.message;
  EXPECT_EQ(reply.version(), 0u);
}

TEST(PsGrpcTest, InitPullPushStatsOverGrpc) {
  TestServer server;
  ASSERT_GT(server.server->port(), 0);
  auto client = server.client();
  expectInit(*client);
  EXPECT_EQ(pullAll(*client), (std::vector<float>{1, 2, 3, -1, 4}));

  wire::PushReply reply;
  const Status s = client->push(pushOf({{2, 4, 6}, {-2, 0.5f}}), &reply);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_TRUE(reply.applied());
  EXPECT_EQ(reply.version(), 1u);
  // sgd with lr 0.5: p - 0.5 g
  EXPECT_EQ(pullAll(*client), (std::vector<float>{0, 0, 0, 0, 3.75f}));

  const auto stats = statsOf(*client);
  EXPECT_TRUE(stats.initialized());
  EXPECT_EQ(stats.applied(), 1);
  EXPECT_EQ(stats.rejected(), 0);
  EXPECT_EQ(stats.bytes_pushed(), 5 * 4);
  EXPECT_EQ(stats.bytes_pulled(), 2 * 5 * 4);
  EXPECT_EQ(stats.samples_total(), 8);
}

TEST(PsGrpcTest, FakeClientRoundTripsLikeTheWire) {
  auto shard = std::make_shared<Shard>(ShardOptions{.log = [](const std::string&) {}});
  auto client = makeFakeClient(shard, "fake 0");
  EXPECT_EQ(client->address(), "fake 0");
  // Before Init the shard asks to be retried, as over gRPC.
  wire::PullReply early;
  EXPECT_EQ(client->pull(withProtocol<wire::PullRequest>(), &early).code, Code::kUnavailable);
  expectInit(*client);
  wire::PushReply reply;
  ASSERT_TRUE(client->push(pushOf({{2, 4, 6}, {-2, 0.5f}}), &reply).ok());
  EXPECT_EQ(pullAll(*client), (std::vector<float>{0, 0, 0, 0, 3.75f}));
  EXPECT_EQ(statsOf(*client).applied(), 1);
}

TEST(PsGrpcTest, AuthTokenIsRequiredAndCounted) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  auto none = server.client();
  auto wrong = server.client({.authToken = "s3cres", .timeoutSeconds = 5, .quiet = true});
  auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});

  wire::InitReply initReply;
  const Status refused = none->init(initOf(asyncPolicy(), kPieces, kStart), &initReply);
  EXPECT_EQ(refused.code, Code::kUnauthenticated) << refused.message;
  EXPECT_NE(refused.message.find("--auth-token"), std::string::npos) << refused.message;
  EXPECT_EQ(statsOf(*right).unauthenticated(), 1);
  EXPECT_FALSE(statsOf(*right).initialized());

  wire::StatsReply statsReply;
  EXPECT_EQ(wrong->stats(withProtocol<wire::StatsRequest>(), &statsReply).code, Code::kUnauthenticated);
  EXPECT_EQ(statsOf(*right).unauthenticated(), 2);

  expectInit(*right);
  EXPECT_EQ(pullAll(*right), (std::vector<float>{1, 2, 3, -1, 4}));
  const auto log = server.log();
  ASSERT_EQ(log.size(), 2u);
  // Refused on its metadata, before the body (gRPC's local credentials on loopback), where the
  // caller's address is not known.
  ASSERT_TRUE(server.server->checksTokenBeforeBody());
  EXPECT_NE(log[0].find("refused a request from a local caller"), std::string::npos) << log[0];
  EXPECT_NE(log[0].find("no proof of the job's secret"), std::string::npos) << log[0];
  EXPECT_NE(log[1].find("a wrong proof"), std::string::npos) << log[1];
}

// Calls prove the secret without carrying it: a header seen on the wire opens nothing twice, and
// an old one (recorded earlier) not at all.
TEST(PsGrpcTest, ACallProofIsGoodOnceAndOnlyFresh) {
  CallVerifier verifier("s3cret", std::chrono::seconds(120));
  const int64_t now = 1'800'000'000'000;
  const std::string nonce(32, 'a');
  const std::string proof = callProof("s3cret", now, nonce);
  EXPECT_EQ(proof.find("s3cret"), std::string::npos);
  EXPECT_EQ(verifier.check(proof, now + 5), ProofCheck::kOk);
  EXPECT_EQ(verifier.check(proof, now + 10), ProofCheck::kReplayed);
  EXPECT_EQ(verifier.check(callProof("s3cret", now - 61'000, std::string(32, 'b')), now), ProofCheck::kStale);
  EXPECT_EQ(verifier.check(callProof("other", now, std::string(32, 'c')), now), ProofCheck::kWrong);
  EXPECT_EQ(verifier.check("Bearer s3cret", now), ProofCheck::kMalformed);
  EXPECT_EQ(verifier.check("", now), ProofCheck::kMissing);
  // A 19-digit stamp past int64_t (read before the proof is checked) is malformed, not an overflow.
  const std::string past = "CohortHMAC 9999999999999999999." + std::string(32, 'f') + "." + std::string(64, '0');
  EXPECT_EQ(verifier.check(past, now), ProofCheck::kMalformed);
  std::string tampered = callProof("s3cret", now, std::string(32, 'd'));
  tampered[tampered.size() - 1] ^= 1;
  EXPECT_EQ(verifier.check(tampered, now), ProofCheck::kWrong);
  // Nonces leave the replay set with the window, and their proofs are stale by then.
  EXPECT_EQ(verifier.check(callProof("s3cret", now + 200'000, std::string(32, 'e')), now + 200'000), ProofCheck::kOk);
  EXPECT_EQ(verifier.check(proof, now + 200'000), ProofCheck::kStale);
}

TEST(PsGrpcTest, AReplayedCallIsRefusedByTheShard) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});
  expectInit(*right);
  auto stub = wire::ParameterServer::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  const std::string recorded = makeCallProof("s3cret");
  for (int attempt = 0; attempt < 2; ++attempt) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", recorded);
    declare(context, withProtocol<wire::StatsRequest>().ByteSizeLong());
    wire::StatsReply reply;
    const grpc::Status status = stub->Stats(&context, withProtocol<wire::StatsRequest>(), &reply);
    EXPECT_EQ(status.ok(), attempt == 0) << attempt << ": " << status.error_message();
  }
  EXPECT_EQ(statsOf(*right).unauthenticated(), 1);
}

TEST(PsGrpcTest, AShardOffLoopbackNeedsASecret) {
  try {
    ShardServer shard(ServerOptions{.address = "0.0.0.0:0"});
    FAIL() << "a shard on every interface started without a secret";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("needs the job's secret"), std::string::npos) << e.what();
  }
}

TEST(PsGrpcTest, TlsWithTheRightCaWorksAndPlaintextDoesNot) {
  TempDir dir;
  const std::string cert = dir.file("cert.pem");
  const std::string key = dir.file("key.pem");
  const auto made = test::runCommand("openssl req -x509 -newkey rsa:2048 -nodes -keyout " + key + " -out " + cert +
                                         " -days 1 -subj /CN=localhost"
                                         " -addext subjectAltName=IP:127.0.0.1,DNS:localhost",
                                     60);
  ASSERT_EQ(made.exitCode, 0) << "openssl could not make a test certificate:\n" << made.output;

  TestServer server(ServerOptions{.tlsCertFile = cert, .tlsKeyFile = key});
  auto tls = server.client({.tlsCaFile = cert, .timeoutSeconds = 5, .quiet = true});
  expectInit(*tls);
  EXPECT_EQ(pullAll(*tls), (std::vector<float>{1, 2, 3, -1, 4}));

  auto plain = server.client({.timeoutSeconds = 1, .quiet = true});
  wire::StatsReply reply;
  const Status s = plain->stats(withProtocol<wire::StatsRequest>(), &reply);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.code, Code::kOk);

  EXPECT_THROW(makeGrpcClient(server.address(), {.tlsCaFile = dir.file("missing.pem")}), InvalidArgument);
  EXPECT_THROW(ShardServer(ServerOptions{.address = "127.0.0.1:0", .tlsCertFile = cert}), InvalidArgument);
  EXPECT_THROW(ShardServer(ServerOptions{.address = "127.0.0.1:0", .tlsCertFile = cert, .tlsKeyFile = dir.file("no")}),
               InvalidArgument);
}

// A file that is not what its flag needs is said when the shard starts or the client is made (gRPC
// would take it and fail every handshake): not PEM, a certificate as the key, another pair's key.
TEST(PsGrpcTest, TlsFilesThatAreNotACertificateOrItsKeyAreNamed) {
  TempDir dir;
  for (const char* pair : {"a", "b"}) {
    const auto made = test::runCommand("openssl req -x509 -newkey rsa:2048 -nodes -keyout " +
                                           dir.file(std::string(pair) + "-key.pem") + " -out " +
                                           dir.file(std::string(pair) + "-cert.pem") + " -days 1 -subj /CN=localhost",
                                       60);
    ASSERT_EQ(made.exitCode, 0) << made.output;
  }
  test::writeFile(dir.file("junk.pem"), "not a certificate\n");
  auto refusal = [&](const std::string& cert, const std::string& key) {
    try {
      ShardServer shard(
          ServerOptions{.address = "127.0.0.1:0", .tlsCertFile = dir.file(cert), .tlsKeyFile = dir.file(key)});
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(started)");
  };
  EXPECT_EQ(refusal("junk.pem", "a-key.pem"),
            "--tls-cert " + dir.file("junk.pem") + " holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  EXPECT_EQ(
      refusal("a-cert.pem", "a-cert.pem").rfind("--tls-key " + dir.file("a-cert.pem") + " holds no PEM private key", 0),
      0u);
  EXPECT_EQ(refusal("a-cert.pem", "b-key.pem"),
            "--tls-key " + dir.file("b-key.pem") + " is not the key of --tls-cert's certificate");
  EXPECT_EQ(refusal("a-cert.pem", "a-key.pem"), "(started)");
  try {
    makeGrpcClient("127.0.0.1:1", {.tlsCaFile = dir.file("junk.pem")});
    ADD_FAILURE() << "a client trusted a CA file with no certificate";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "--tls-ca " + dir.file("junk.pem") + " holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  }
}

TEST(PsGrpcTest, BadPushesAreRefusedAndChangeNothing) {
  TestServer server;
  auto client = server.client();
  expectInit(*client);
  const auto good = pushOf({{1, 1, 1}, {1, 1}});
  struct Case {
    const char* what;
    std::function<void(wire::PushRequest&)> spoil;
    Code expected;
  };
  const std::vector<Case> cases{
      {"unknown key", [](wire::PushRequest& r) { r.mutable_values(1)->set_key(42); }, Code::kInvalidArgument},
      {"wrong numel", [](wire::PushRequest& r) { r.mutable_values(0)->set_numel(4); }, Code::kInvalidArgument},
      {"wrong dtype",
       [](wire::PushRequest& r) { r.mutable_values(0)->set_dtype(wire::DTYPE_UNSPECIFIED); },
       Code::kInvalidArgument},
      {"truncated data", [](wire::PushRequest& r) { r.mutable_values(1)->mutable_data()->resize(7); },
       Code::kInvalidArgument},
      {"NaN",
       [](wire::PushRequest& r) {
         const float nan = std::numeric_limits<float>::quiet_NaN();
         r.mutable_values(1)->mutable_data()->replace(4, 4, reinterpret_cast<const char*>(&nan), 4);
       },
       Code::kInvalidArgument},
      {"protocol 99", [](wire::PushRequest& r) { r.set_protocol(99); }, Code::kFailedPrecondition},
  };
  for (const auto& c : cases) {
    wire::PushRequest bad = good;
    c.spoil(bad);
    wire::PushReply reply;
    const Status s = client->push(bad, &reply);
    EXPECT_EQ(s.code, c.expected) << c.what << ": " << codeName(s.code) << " " << s.message;
  }
  EXPECT_EQ(pullAll(*client), (std::vector<float>{1, 2, 3, -1, 4}));
  const auto stats = statsOf(*client);
  EXPECT_EQ(stats.version(), 0u);
  EXPECT_EQ(stats.applied(), 0);
  EXPECT_EQ(stats.rejected(), int64_t(cases.size()));
}

TEST(PsGrpcTest, ClientWaitsForAShardThatStartsLate) {
  // The client must be given the shard's port before the shard listens: a port reserved for it.
  const test::ReservedPort reserved;
  const int port = reserved.port();
  std::promise<void> retrying;
  auto client = makeGrpcClient("127.0.0.1:" + std::to_string(port),
                               {.timeoutSeconds = 20, .quiet = true, .onRetry = [&, said = std::make_shared<std::atomic<bool>>(false)](const RetryEvent&) {
                                 if (!said->exchange(true)) retrying.set_value();
                               }});
  auto init = std::async(std::launch::async, [&] {
    wire::InitReply reply;
    return client->init(initOf(asyncPolicy(), kPieces, kStart), &reply);
  });
  // What is under test is the client retrying while nothing listens: the shard starts once it does.
  ASSERT_EQ(retrying.get_future().wait_for(15s), std::future_status::ready) << "the client never retried";
  TestServer server(ServerOptions{.address = "127.0.0.1:" + std::to_string(port)});
  ASSERT_EQ(init.wait_for(15s), std::future_status::ready) << "the client did not find the late shard";
  const Status s = init.get();
  EXPECT_TRUE(s.ok()) << codeName(s.code) << ": " << s.message;
  EXPECT_EQ(pullAll(*client), (std::vector<float>{1, 2, 3, -1, 4}));
}

TEST(PsGrpcTest, ClientWaitsForTheChiefsInit) {
  TestServer server;
  std::promise<void> retrying;
  auto worker = server.client({.timeoutSeconds = 20, .quiet = true, .onRetry = [&, said = std::make_shared<std::atomic<bool>>(false)](const RetryEvent&) {
                                 if (!said->exchange(true)) retrying.set_value();
                               }});
  auto pulled = std::async(std::launch::async, [&] {
    wire::PullReply reply;
    const Status s = worker->pull(withProtocol<wire::PullRequest>(), &reply);
    return std::make_pair(s, reply.values_size());
  });
  // The worker's first Pull finds the shard not initialized and retries; then the chief's Init.
  ASSERT_EQ(retrying.get_future().wait_for(15s), std::future_status::ready) << "the pull did not wait";
  expectInit(*server.client());
  ASSERT_EQ(pulled.wait_for(15s), std::future_status::ready) << "the pull was not retried after Init";
  const auto [status, pieces] = pulled.get();
  EXPECT_TRUE(status.ok()) << status.message;
  EXPECT_EQ(pieces, 2);
}

TEST(PsGrpcTest, UnreachableShardFailsInTimeNamingIt) {
  const test::ReservedPort nobody;  // held, never listening: connections are refused
  const std::string address = "127.0.0.1:" + std::to_string(nobody.port());
  auto client = makeGrpcClient(address, {.timeoutSeconds = 1, .quiet = true});
  const auto start = std::chrono::steady_clock::now();
  wire::StatsReply reply;
  const Status s = client->stats(withProtocol<wire::StatsRequest>(), &reply);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code, Code::kUnavailable) << codeName(s.code);
  EXPECT_NE(s.message.find("ps shard " + address + " unreachable for"), std::string::npos) << s.message;
  EXPECT_GE(took, 900ms);
  EXPECT_LT(took, 5s);
  EXPECT_THROW(makeGrpcClient(address, {.timeoutSeconds = 0}), InvalidArgument);
}

// A Pull in a thread: its status, values, and how long it took.
struct PullResult {
  Status status;
  std::vector<float> values;
  std::chrono::steady_clock::duration took{};
};

std::future<PullResult> pullInThread(ShardClient& client, test::Retries& retries, bool initial) {
  return std::async(std::launch::async, [&client, &retries, initial] {
    wire::PullRequest request = withProtocol<wire::PullRequest>();
    request.set_initial(initial);
    wire::PullReply reply;
    PullResult result;
    const auto start = std::chrono::steady_clock::now();
    result.status = client.pull(request, &reply);
    result.took = std::chrono::steady_clock::now() - start;
    for (const auto& t : reply.values()) appendFloats(t, result.values);
    retries.finished();
    return result;
  });
}

// The fault table's ps-async shard row (docs/BENCHMARKS.md): a worker's first pull, refused until
// the chief's Init, was still retrying when its shard was killed. Its wait in all outlasts one
// window (--timeout), which the client used to count from the call's first attempt; now the
// shard's silence gets a window of its own, and the pull is served by the restarted shard.
TEST(PsGrpcTest, ACallRidesOutAShardRestartAfterWaitingLongerThanOneWindow) {
  const TempDir dir;
  {  // What the restarted shard restores: a checkpoint of this job.
    Shard before(ShardOptions{.name = "before", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
    wire::InitReply reply;
    ASSERT_TRUE(before.init(initOf(asyncPolicy(), kPieces, kStart), &reply).ok());
    before.checkpoint();
  }
  const test::ReservedPort reserved;
  const std::string address = "127.0.0.1:" + std::to_string(reserved.port());
  constexpr double kWindow = 3;
  test::Retries retries;
  auto worker = makeGrpcClient(address, {.timeoutSeconds = kWindow, .quiet = true, .onRetry = retries.hook()});
  // Started in a new job (not by a launcher inside this one): it answers a first pull only after
  // an Init, which this test never sends.
  auto shard = std::make_unique<TestServer>(ServerOptions{.address = address, .shard = {.checkpointDir = dir.path()}});
  auto pulled = pullInThread(*worker, retries, /*initial=*/true);
  ASSERT_TRUE(retries.waitFor([](const RetryEvent& e) { return e.shardAnswered && e.callSeconds >= kWindow / 2; }))
      << "the shard did not refuse the first pull for half a window";
  shard.reset();  // gone, as far as the worker can tell: killed
  ASSERT_TRUE(retries.waitFor([](const RetryEvent& e) { return !e.shardAnswered && e.callSeconds > kWindow; }))
      << "the worker did not keep retrying past one window from its first attempt";
  // Started again alone inside its job: it serves the first pull from its checkpoint at once.
  shard = std::make_unique<TestServer>(
      ServerOptions{.address = address, .shard = {.checkpointDir = dir.path(), .restartedInJob = true}});
  ASSERT_EQ(pulled.wait_for(30s), std::future_status::ready) << "the pull did not end";
  const PullResult result = pulled.get();
  EXPECT_TRUE(result.status.ok()) << codeName(result.status.code) << ": " << result.status.message;
  EXPECT_EQ(result.values, (std::vector<float>{1, 2, 3, -1, 4}));
  EXPECT_GT(result.took, std::chrono::duration<double>(kWindow));
}

// The shard is killed while a call waits for it and never returns: the call ends one window after
// the shard went silent (not one after the call began), naming the shard, how long, and --timeout.
TEST(PsGrpcTest, AShardThatNeverComesBackEndsTheCallOneWindowAfterItWentSilent) {
  const test::ReservedPort reserved;
  const std::string address = "127.0.0.1:" + std::to_string(reserved.port());
  constexpr double kWindow = 1.5;
  test::Retries retries;
  auto worker = makeGrpcClient(address, {.timeoutSeconds = kWindow, .quiet = true, .onRetry = retries.hook()});
  auto shard = std::make_unique<TestServer>(ServerOptions{.address = address});  // no Init: refuses
  auto pulled = pullInThread(*worker, retries, /*initial=*/false);
  ASSERT_TRUE(retries.waitFor([](const RetryEvent& e) { return e.shardAnswered && e.callSeconds >= kWindow / 2; }))
      << "the shard did not refuse the pull for half a window";
  shard.reset();
  ASSERT_EQ(pulled.wait_for(30s), std::future_status::ready) << "the pull did not end";
  const PullResult result = pulled.get();
  EXPECT_EQ(result.status.code, Code::kUnavailable) << codeName(result.status.code);
  EXPECT_NE(result.status.message.find("ps shard " + address + " unreachable for 1.5"), std::string::npos)
      << result.status.message;
  EXPECT_NE(result.status.message.find("raise --timeout (now 1.5 s)"), std::string::npos) << result.status.message;
  // Half a window refused, then a whole one unreachable: more than one in all, less than the bound.
  EXPECT_GT(result.took, std::chrono::duration<double>(1.4 * kWindow));
  EXPECT_LT(result.took, std::chrono::duration<double>(kRetryBoundTimeouts * kWindow));
}

// A shard that comes and goes (refusing, then unreachable, then refusing again...), each spell
// shorter than a window: the call still ends, at kRetryBoundTimeouts windows, with a message that
// names the shard, the time and the bound. The shard is stopped and restarted from the client's
// retry hook, between two of its attempts: a test thread woken by the retry raced the client's
// back-off and, on a loaded machine, let a spell run out (CI, 2026-11-26).
TEST(PsGrpcTest, AShardThatComesAndGoesEndsTheCallAtTheOverallBound) {
  const test::ReservedPort reserved;
  const std::string address = "127.0.0.1:" + std::to_string(reserved.port());
  constexpr double kWindow = 2;
  std::unique_ptr<TestServer> shard = std::make_unique<TestServer>(ServerOptions{.address = address});  // no Init: refuses
  int spells = 1;
  // A spell a quarter of a window old is ended by the shard going or coming back; the client's
  // next attempt, up to 0.8 s later (its back-off), finds the other state with the spell's
  // remaining three quarters to spare.
  auto toggle = [&shard, &spells, &address](const RetryEvent& e) {
    if (e.spellSeconds < kWindow / 4 || e.shardAnswered != (shard != nullptr)) return;
    if (shard) {
      shard.reset();
    } else {
      shard = std::make_unique<TestServer>(ServerOptions{.address = address});
    }
    ++spells;
  };
  test::Retries retries;
  auto worker = makeGrpcClient(address, {.timeoutSeconds = kWindow, .quiet = true, .onRetry = retries.hook(toggle)});
  auto pulled = pullInThread(*worker, retries, /*initial=*/false);
  ASSERT_EQ(pulled.wait_for(30s), std::future_status::ready) << "the pull did not end";
  const PullResult result = pulled.get();
  EXPECT_EQ(result.status.code, Code::kUnavailable) << codeName(result.status.code);
  EXPECT_NE(result.status.message.find("ps shard " + address + ": gave up after 6"), std::string::npos)
      << result.status.message;
  EXPECT_NE(result.status.message.find("at most 3 x --timeout"), std::string::npos) << result.status.message;
  EXPECT_NE(result.status.message.find("raise --timeout (now 2 s)"), std::string::npos) << result.status.message;
  EXPECT_GE(spells, 3) << "the shard should have gone and come back at least once";
  // It did come back: a refusal after a spell unreachable.
  bool wasGone = false, cameBack = false;
  for (const auto& e : retries.all()) {
    cameBack = cameBack || (wasGone && e.shardAnswered);
    wasGone = wasGone || !e.shardAnswered;
  }
  EXPECT_TRUE(cameBack);
  EXPECT_GE(result.took, std::chrono::duration<double>(kRetryBoundTimeouts * kWindow));
  EXPECT_LT(result.took, std::chrono::duration<double>(kRetryBoundTimeouts * kWindow + 2));
}

// A shard that comes back after a long silence (many failed connections: gRPC's reconnect back-off
// and the client's at their caps) is found at the client's next retry, at most 2 s later. (In one
// process the server's threads poll for the client's connection too; across processes, where the
// fault table found restarted shards 5-10 s late: PsRestartTest in ps_restart_test.cpp.)
TEST(PsGrpcTest, AShardBackAfterALongSilenceIsFoundAtTheNextRetry) {
  const test::ReservedPort reserved;
  const std::string address = "127.0.0.1:" + std::to_string(reserved.port());
  test::Retries retries;
  auto worker = makeGrpcClient(address, {.timeoutSeconds = 30, .quiet = true, .onRetry = retries.hook()});
  auto shard = std::make_unique<TestServer>(ServerOptions{.address = address});
  expectInit(*shard->client());
  EXPECT_EQ(pullAll(*worker), (std::vector<float>{1, 2, 3, -1, 4}));  // connected
  shard.reset();
  auto pulled = pullInThread(*worker, retries, /*initial=*/false);
  // Long enough for many failed connections, and for both back-offs to reach their caps.
  ASSERT_TRUE(retries.waitFor([](const RetryEvent& e) { return !e.shardAnswered && e.spellSeconds >= 6; }))
      << "the pull did not retry for 6 s";
  const auto back = std::chrono::steady_clock::now();
  shard = std::make_unique<TestServer>(ServerOptions{.address = address});
  expectInit(*shard->client());
  ASSERT_EQ(pulled.wait_for(30s), std::future_status::ready) << "the pull did not end";
  const auto found = std::chrono::steady_clock::now() - back;
  const PullResult result = pulled.get();
  EXPECT_TRUE(result.status.ok()) << codeName(result.status.code) << ": " << result.status.message;
  EXPECT_EQ(result.values, (std::vector<float>{1, 2, 3, -1, 4}));
  // The client's own back-off is at most 2 s; 1 s more for the connection on a busy machine.
  EXPECT_LT(found, 3s);
}

TEST(PsGrpcTest, HeldCallEndsAtTheClientsDeadlineNamingTheShard) {
  TestServer server;
  auto chief = server.client();
  wire::Policy sync = asyncPolicy();
  sync.set_mode(wire::MODE_SYNC);
  sync.set_workers(2);
  // Longer than the client's deadline, and no longer: the server's shutdown waits for the held push.
  sync.set_timeout_s(9);
  wire::InitReply initReply;
  ASSERT_TRUE(chief->init(initOf(sync, kPieces, kStart), &initReply).ok());
  // Worker 0's push waits for worker 1's, which never comes; the client's deadline (2 x 0.5 + 5 s)
  // ends it before the shard's 9 s timeout.
  auto impatient = server.client({.timeoutSeconds = 0.5, .quiet = true});
  wire::PushReply reply;
  const Status s = impatient->push(pushOf({{1, 1, 1}, {1, 1}}), &reply);
  EXPECT_EQ(s.code, Code::kDeadlineExceeded) << codeName(s.code) << ": " << s.message;
  EXPECT_NE(s.message.find("ps shard " + server.address() + " did not answer within 6 s"), std::string::npos)
      << s.message;
}

TEST(PsGrpcTest, ATakenPortIsAnError) {
  TestServer first;
  try {
    ShardServer second(ServerOptions{.address = first.address()});
    FAIL() << "a second server listened on " << first.address();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on " + first.address()), std::string::npos) << e.what();
  }
}

TEST(PsGrpcTest, SixtyFourMegabytePieceRoundTrips) {
  TestServer server;
  auto client = server.client({.timeoutSeconds = 60, .quiet = true});
  const uint64_t n = uint64_t(16) << 20;
  std::vector<float> values(n);
  for (uint64_t i = 0; i < n; ++i) values[i] = float(i % 1000) * 0.25f;
  expectInit(*client, {piece(0, "big", n)}, {values});
  wire::PullReply reply;
  const Status s = client->pull(withProtocol<wire::PullRequest>(), &reply);
  ASSERT_TRUE(s.ok()) << codeName(s.code) << ": " << s.message;
  ASSERT_EQ(reply.values_size(), 1);
  std::vector<float> back;
  appendFloats(reply.values(0), back);
  EXPECT_TRUE(back == values) << "the 64 MB piece came back different";
}

// serveShard on a port of its choosing, in a thread, until it returns.
struct RunningServer {
  ServerOptions options;
  std::promise<int> listening;
  std::shared_future<int> port = listening.get_future().share();
  std::atomic<bool> stop{false};
  std::future<ServeOutcome> exit;

  explicit RunningServer(ServerOptions o) : options(std::move(o)) {
    options.address = "127.0.0.1:0";
    options.shard.log = [](const std::string&) {};
    options.onListening = [this](int p) { listening.set_value(p); };
    options.stopRequested = [this]() -> std::string { return stop ? "asked by the test" : ""; };
    exit = std::async(std::launch::async, [this] { return serveShard(options); });
  }
  std::unique_ptr<ShardClient> client() const {
    EXPECT_EQ(port.wait_for(20s), std::future_status::ready) << "serveShard did not listen";
    return makeGrpcClient("127.0.0.1:" + std::to_string(port.get()), {.timeoutSeconds = 10, .quiet = true});
  }
  ServeOutcome waitExit() {
    EXPECT_EQ(exit.wait_for(20s), std::future_status::ready) << "serveShard did not return";
    return exit.get();
  }
};

TEST(PsGrpcTest, ServeShardEndsWhenEveryWorkerIsDone) {
  RunningServer run({});
  auto client = run.client();
  expectInit(*client);
  wire::DoneRequest done = withProtocol<wire::DoneRequest>();
  wire::DoneReply reply;
  ASSERT_TRUE(client->done(done, &reply).ok());
  EXPECT_TRUE(reply.all_done());
  const ServeOutcome outcome = run.waitExit();
  EXPECT_EQ(outcome.end, ServeOutcome::End::kFinished);
  EXPECT_EQ(outcome.exitStatus(), 0);
}

TEST(PsGrpcTest, ServeShardFailsWhenTheShardFails) {
  RunningServer run({});
  auto client = run.client();
  wire::Policy sync = asyncPolicy();
  sync.set_mode(wire::MODE_SYNC);
  sync.set_workers(2);
  sync.set_timeout_s(1);
  wire::InitReply initReply;
  ASSERT_TRUE(client->init(initOf(sync, kPieces, kStart), &initReply).ok());
  // Worker 1 never pushes: after the timeout sync mode gives up on the step.
  wire::PushReply reply;
  EXPECT_EQ(client->push(pushOf({{1, 1, 1}, {1, 1}}), &reply).code, Code::kAborted);
  const ServeOutcome outcome = run.waitExit();
  EXPECT_EQ(outcome.end, ServeOutcome::End::kFailed);
  EXPECT_FALSE(outcome.message.empty());
  EXPECT_EQ(outcome.exitStatus(), 1);
}

// A stop request (the command line's SIGTERM and SIGINT, src/cli/shard_process.cpp; tested on a
// real `cohort ps` in ps_test.cpp) ends the serving with a checkpoint.
TEST(PsGrpcTest, ServeShardCheckpointsWhenAskedToStop) {
  TempDir dir;
  RunningServer run(ServerOptions{.shard = {.checkpointDir = dir.path()}});
  auto client = run.client();
  expectInit(*client);
  run.stop = true;
  const ServeOutcome outcome = run.waitExit();
  EXPECT_EQ(outcome.end, ServeOutcome::End::kStopped);
  EXPECT_EQ(outcome.message, "asked by the test");
  EXPECT_EQ(outcome.exitStatus(), 0);
  bool written = false;
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) {
    written = written || f.path().extension() == ".ckpt";
  }
  EXPECT_TRUE(written) << "no checkpoint in " << dir.path();
}

// A push may carry one codec message of the shard's pieces side by side (--codec): it applies as
// the float32 push would, counts its real size, and a bad one is refused naming the problem.
TEST(PsGrpcTest, CompressedPushesApplyAndBadOnesAreRefused) {
  TestServer server;
  auto client = server.client();
  expectInit(*client);
  auto compressed = [](const std::vector<uint8_t>& message) {
    wire::PushRequest r = pushOf({});
    r.set_compressed(message.data(), message.size());
    return r;
  };
  // threshold 0.5: {2, 4, 6, -2, 0.25} sends +-0.5 where |g| >= 0.5, so {0.5, 0.5, 0.5, -0.5, 0}.
  compress::Encoder encoder(compress::CodecSpec::parse("threshold:0.5"), 5);
  const std::vector<uint8_t> message = encoder.encode(std::vector<float>{2, 4, 6, -2, 0.25f});
  wire::PushReply reply;
  Status s = client->push(compressed(message), &reply);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_TRUE(reply.applied());
  EXPECT_EQ(pullAll(*client), (std::vector<float>{0.75f, 1.75f, 2.75f, -0.75f, 4}));  // p - 0.5 g
  EXPECT_EQ(statsOf(*client).bytes_pushed(), int64_t(message.size()));

  auto refused = [&](const wire::PushRequest& request, const std::string& words) {
    wire::PushReply r;
    const Status st = client->push(request, &r);
    EXPECT_EQ(st.code, Code::kInvalidArgument) << st.message;
    EXPECT_NE(st.message.find(words), std::string::npos) << st.message;
  };
  compress::Encoder six(compress::CodecSpec::parse("topk:0.5"), 6);
  refused(compressed(six.encode(std::vector<float>{1, 2, 3, 4, 5, 6})), "holds 6 values, this shard's 2 pieces hold 5");
  auto cut = message;
  cut.resize(cut.size() - 3);
  refused(compressed(cut), "malformed codec message");
  compress::Encoder fp16(compress::CodecSpec::parse("fp16"), 5);
  refused(compressed(fp16.encode(std::vector<float>{1, std::numeric_limits<float>::infinity(), 0, 0, 0})), "Inf");
  wire::PushRequest both = pushOf({{2, 4, 6}, {-2, 0.5f}});
  both.set_compressed(message.data(), message.size());
  refused(both, "both values and a compressed message");
  EXPECT_EQ(pullAll(*client), (std::vector<float>{0.75f, 1.75f, 2.75f, -0.75f, 4})) << "a refused push changed the shard";
  EXPECT_EQ(statsOf(*client).rejected(), 4);
}

// A stranger's 512 MB push with a wrong token costs the shard its headers: the token is checked
// on the call's metadata and the stream is closed before its body is read. The client sends one
// 1 MB block 512 times over (its memory stays small), and the process's peak resident size, reset
// before the call, must stay far below the push.
// Sends a raw 512 MB body as a Push to `address` with `proof` as its authorization and `declared`
// as its kRequestBytesKey (none if nullopt); returns the call's status and how far this process's
// peak RSS rose above its level before the call.
struct RawPushResult {
  grpc::Status status;
  int64_t peakGrowth = 0;
};
constexpr uint64_t k512MB = uint64_t(512) << 20;
RawPushResult pushRaw512MB(const std::string& address, const std::string& proof,
                           std::optional<uint64_t> declared = k512MB) {
  constexpr size_t kBlock = 1 << 20, kBlocks = 512;
  static const std::vector<char> block(kBlock, 'x');
  std::vector<grpc::Slice> slices(kBlocks, grpc::Slice(block.data(), block.size(), grpc::Slice::STATIC_SLICE));
  const grpc::ByteBuffer request(slices.data(), slices.size());
  EXPECT_EQ(request.Length(), kBlock * kBlocks);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  grpc::GenericStub stub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));

  EXPECT_TRUE(test::resetPeakMemory()) << "cannot reset VmHWM through /proc/self/clear_refs";
  const int64_t rssBefore = test::statusBytes("VmRSS");
  grpc::ClientContext context;
  context.AddMetadata("authorization", proof);
  if (declared) declare(context, *declared);
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  grpc::CompletionQueue queue;
  auto call = stub.PrepareUnaryCall(&context, "/cohort.ps.wire.ParameterServer/Push", request, &queue);
  call->StartCall();
  grpc::ByteBuffer reply;
  RawPushResult result;
  call->Finish(&reply, &result.status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  EXPECT_EQ(queue.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + 90s), grpc::CompletionQueue::GOT_EVENT);
  result.peakGrowth = test::statusBytes("VmHWM") - rssBefore;
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  return result;
}

std::string freshProof(const std::string& secret) {
  static std::mt19937 rng(std::random_device{}());
  std::string nonce(32, '0');
  for (auto& c : nonce) c = "0123456789abcdef"[rng() % 16];
  const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch()).count();
  return callProof(secret, now, nonce);
}

TEST(PsGrpcTest, AWrongTokenPushIsRefusedBeforeItsBodyIsRead) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  ASSERT_TRUE(server.server->checksTokenBeforeBody());
  auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});
  expectInit(*right);

  const RawPushResult r = pushRaw512MB(server.address(), callProof("wrong", 1, std::string(32, '0')));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << r.status.error_message();
  EXPECT_LT(r.peakGrowth, int64_t(96) << 20) << "peak grew " << (r.peakGrowth >> 20) << " MB: the 512 MB body was read";
  std::fprintf(stderr, "wrong-token 512 MB push: peak RSS grew by %.1f MB\n", double(r.peakGrowth) / (1 << 20));
  EXPECT_EQ(statsOf(*right).unauthenticated(), 1);
  EXPECT_EQ(pullAll(*right), (std::vector<float>{1, 2, 3, -1, 4}));
}

// The cap from the layout: 2.25 GiB until the chief's Init, then twice the shard's values and
// 1 MB. A 512 MB push with a good proof (a buggy worker) that declares its size, or declares
// none (a tool that is not cohort's), is refused from its headers, its body unread: the
// oversized one with RESOURCE_EXHAUSTED naming both sizes. The process's peak stays far below
// the push, and the shard goes on serving the job.
TEST(PsGrpcTest, ARequestOverTheCapIsRefusedBeforeItsBodyIsRead) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  EXPECT_EQ(server.server->requestCapBytes(), (uint64_t(2) << 30) + (uint64_t(256) << 20));
  EXPECT_GE(server.server->requestQuotaBytes(), server.server->requestCapBytes());
  auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});
  expectInit(*right);
  const uint64_t cap = 2 * 5 * sizeof(float) + (1 << 20);
  EXPECT_EQ(server.server->requestCapBytes(), cap);

  const RawPushResult declared = pushRaw512MB(server.address(), freshProof("s3cret"));
  EXPECT_EQ(declared.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << declared.status.error_message();
  for (const std::string& says : {std::to_string(k512MB) + " bytes", "cap of " + std::to_string(cap) + " bytes",
                                  std::string("its body was not read")}) {
    EXPECT_NE(declared.status.error_message().find(says), std::string::npos) << declared.status.error_message();
  }
  EXPECT_LT(declared.peakGrowth, int64_t(96) << 20) << "peak grew " << (declared.peakGrowth >> 20) << " MB";

  const RawPushResult undeclared = pushRaw512MB(server.address(), freshProof("s3cret"), std::nullopt);
  EXPECT_EQ(undeclared.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << undeclared.status.error_message();
  EXPECT_NE(undeclared.status.error_message().find("without cohort-request-bytes"), std::string::npos)
      << undeclared.status.error_message();
  EXPECT_LT(undeclared.peakGrowth, int64_t(96) << 20) << "peak grew " << (undeclared.peakGrowth >> 20) << " MB";
  std::fprintf(stderr, "authenticated 512 MB push past the cap: %s; peak RSS grew by %.1f MB (undeclared: %.1f MB)\n",
               declared.status.error_message().c_str(), double(declared.peakGrowth) / (1 << 20),
               double(undeclared.peakGrowth) / (1 << 20));
  EXPECT_EQ(pullAll(*right), (std::vector<float>{1, 2, 3, -1, 4}));
  EXPECT_EQ(statsOf(*right).rejected(), 2);
}

// Connections that never carried a call with a good proof: a shard holds 64 of them, each newcomer
// evicting the oldest, while a connection that proved the secret is never evicted; a call refused
// for its proof does not prove its connection. (tests/ps_attack_test.cpp floods a `cohort ps`.)
TEST(PsGrpcTest, AShardHoldsAtMost64ConnectionsThatHaveNotProvedTheSecret) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});
  expectInit(*right);
  auto counts = [&] { return server.server->connections(); };
  EXPECT_EQ(counts().open, 1);
  EXPECT_EQ(counts().unproven, 0);

  static const std::string hello =
      std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string("\0\0\0\4\0\0\0\0\0", 9);
  std::vector<std::unique_ptr<test::RawConnection>> strangers;
  for (int i = 0; i < 100; ++i) {
    strangers.push_back(std::make_unique<test::RawConnection>(server.server->port()));
    strangers.back()->send(std::span(reinterpret_cast<const uint8_t*>(hello.data()), hello.size()));
  }
  // The shard's accept loop takes them in its own time: wait for the last one's eviction.
  EXPECT_TRUE(eventually([&] { return counts().evicted == 36; })) << counts().evicted << " evicted";
  EXPECT_EQ(counts().unproven, 64);
  EXPECT_TRUE(strangers.front()->closedByPeer()) << "the oldest stranger is still connected";

  // A call with a wrong proof on a connection of its own (other channel arguments than the
  // client's) leaves it unproven: it evicts one more.
  {
    grpc::ChannelArguments args;
    args.SetInt("cohort.test.stranger", 1);
    auto stub = wire::ParameterServer::NewStub(
        grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext context;
    context.AddMetadata("authorization", callProof("wrong", 1, std::string(32, '0')));
    declare(context, withProtocol<wire::StatsRequest>().ByteSizeLong());
    wire::StatsReply reply;
    EXPECT_EQ(stub->Stats(&context, withProtocol<wire::StatsRequest>(), &reply).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(counts().evicted, 37);
    EXPECT_EQ(counts().unproven, 64);
  }
  // The proven connection is still there and serves.
  wire::PushReply pushed;
  ASSERT_TRUE(right->push(pushOf({{1, 1, 1}, {1, 1}}), &pushed).ok());
  EXPECT_EQ(pullAll(*right), (std::vector<float>{0.5f, 1.5f, 2.5f, -1.5f, 3.5f}));
  EXPECT_EQ(counts().dropped, 0);
}

// Strangers on a shard's port: random bytes, an HTTP/2 preface followed by a frame announcing
// 16 MB, a burst of garbage connections and connections that say nothing. The shard closes them,
// keeps serving (a push and a pull give the undisturbed result), and when it is gone the
// process's descriptors are back at their level before it started.
TEST(PsGrpcTest, StrangersOnTheShardPortAreDroppedAndItKeepsServing) {
  {
    // gRPC opens process-wide descriptors (its pollers) on first use and keeps them: start it
    // before counting, or a test run alone (as ctest runs it) counts them as the shard's.
    TestServer warm(ServerOptions{.authToken = "warm"});
    auto client = warm.client({.authToken = "warm", .timeoutSeconds = 5, .quiet = true});
    expectInit(*client);
  }
  const int before = test::openSockets();
  {
    TestServer server(ServerOptions{.authToken = "s3cret"});
    const int port = server.server->port();
    auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});
    expectInit(*right);
    std::mt19937 rng(19);
    std::vector<std::unique_ptr<test::RawConnection>> silent;
    for (int i = 0; i < 3; ++i) silent.push_back(std::make_unique<test::RawConnection>(port));
    {
      test::RawConnection raw(port);
      std::vector<uint8_t> junk(4096);
      for (auto& b : junk) b = uint8_t(rng());
      raw.send(junk);
      EXPECT_TRUE(raw.closedByPeer()) << "random bytes";
    }
    {
      test::RawConnection raw(port);
      const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
      raw.send(std::span(reinterpret_cast<const uint8_t*>(preface.data()), preface.size()));
      const uint8_t hugeData[] = {0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01};  // DATA, 16 MB, stream 1
      raw.send(hugeData);
      EXPECT_TRUE(raw.closedByPeer()) << "oversized frame";
    }
    for (int i = 0; i < 100; ++i) {
      test::RawConnection raw(port);
      const uint8_t junk[] = {'G', 'E', 'T', ' ', '/', '\r', '\n', '\r', '\n'};
      raw.send(junk);
    }
    wire::PushReply pushed;
    auto push = pushOf({{1, 1, 1}, {1, 1}});
    push.set_want_values(true);
    ASSERT_TRUE(right->push(push, &pushed).ok());
    EXPECT_EQ(pullAll(*right), (std::vector<float>{0.5f, 1.5f, 2.5f, -1.5f, 3.5f}));
    EXPECT_EQ(statsOf(*right).applied(), 1);
    // A connection that never speaks is closed by the server's handshake deadline (10 s; waited for
    // up to 60: gRPC's timers run late on a loaded machine, and 20 s once was not enough).
    EXPECT_TRUE(silent[0]->closedByPeer(std::chrono::seconds(60))) << "a silent connection was kept";
    silent.clear();
  }
  // Sockets, not all descriptors: a dropped connection the shard kept is a socket, and gRPC may
  // open descriptors of its own (eventfds) under load, which once failed a count of them all.
  EXPECT_EQ(test::waitForSockets(before, std::chrono::seconds(10)), before) << test::describeDescriptors();
}

// ---- The zero-copy path (PushFramed, ps/frame.h) ----

// Pieces large enough that a frame's payload spans several of gRPC's buffers.
std::vector<wire::PieceSpec> largePieces() {
  return {piece(0, "bias", 7), piece(1, "w[0:300000]", 300000), piece(2, "w[300000:450001]", 150001)};
}

std::vector<std::vector<float>> randomValues(const std::vector<wire::PieceSpec>& pieces, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> out;
  for (const auto& p : pieces) {
    out.emplace_back(p.numel());
    for (auto& v : out.back()) v = normal(rng);
  }
  return out;
}

// A push of `grads` as a protobuf Push and as the same push framed.
wire::PushRequest protobufPush(const std::vector<wire::PieceSpec>& pieces, const std::vector<std::vector<float>>& grads,
                               int64_t clock) {
  wire::PushRequest r;
  r.set_protocol(kProtocolVersion);
  r.set_clock(clock);
  r.set_pulled_version(uint64_t(clock));
  r.set_samples(16);
  r.set_want_values(true);
  for (size_t i = 0; i < pieces.size(); ++i) setTensor(r.add_values(), pieces[i], grads[i].data());
  return r;
}

FramedPush framedPush(const wire::PushRequest& protobuf, const std::vector<std::vector<float>>& grads) {
  FramedPush f;
  f.request = protobuf;
  for (int i = 0; i < f.request.values_size(); ++i) {
    f.request.mutable_values(i)->clear_data();
    f.payload.emplace_back(grads[size_t(i)]);
  }
  return f;
}

struct FramedTargets {
  std::vector<std::vector<float>> values;
  std::vector<FrameTarget> into;
  explicit FramedTargets(const std::vector<wire::PieceSpec>& pieces) {
    for (const auto& p : pieces) values.emplace_back(p.numel(), -7.0f);
    for (size_t i = 0; i < pieces.size(); ++i) into.push_back({.key = pieces[i].key(), .values = values[i]});
  }
  std::vector<float> all() const {
    std::vector<float> out;
    for (const auto& v : values) out.insert(out.end(), v.begin(), v.end());
    return out;
  }
};

// The same pushes, as protobuf to one shard and framed to another, leave both shards and both
// workers' parameters bit-identical, under every optimizer the shards run.
TEST(PsFrameTest, FramedPushesEqualProtobufPushes) {
  const auto pieces = largePieces();
  for (const wire::Optimizer optimizer : {wire::OPTIMIZER_SGD, wire::OPTIMIZER_MOMENTUM, wire::OPTIMIZER_ADAM}) {
    for (const bool fake : {false, true}) {
     for (const size_t chunkBytes : {size_t(0), size_t(1) << 20}) {
       SCOPED_TRACE(std::string(optimizerName(optimizer)) + (fake ? " over the fake transport" : " over gRPC") +
                    (chunkBytes == 0 ? ", one message" : ", streamed"));
       TestServer protobufServer, framedServer;
       auto fakeShard = std::make_shared<Shard>(ShardOptions{.log = [](const std::string&) {}});
       auto protobufClient = protobufServer.client();
       auto framedClient =
           fake ? makeFakeClient(fakeShard, "fake", chunkBytes)
                : framedServer.client({.timeoutSeconds = 5, .quiet = true, .pushChunkBytes = chunkBytes});
       auto policy = asyncPolicy();
       policy.set_optimizer(optimizer);
       policy.set_momentum(0.9);
       policy.set_lr(0.01);
       const auto start = randomValues(pieces, 1);
       wire::InitReply initReply;
       ASSERT_TRUE(protobufClient->init(initOf(policy, pieces, start), &initReply).ok());
       ASSERT_TRUE(framedClient->init(initOf(policy, pieces, start), &initReply).ok());
       for (int step = 0; step < 4; ++step) {
         const auto grads = randomValues(pieces, 100 + uint32_t(step));
         const auto request = protobufPush(pieces, grads, step);
         wire::PushReply viaProtobuf, viaFrame;
         const Status a = protobufClient->push(request, &viaProtobuf);
         ASSERT_TRUE(a.ok()) << a.message;
         FramedTargets targets(pieces);
         const Status b = framedClient->pushFramed(framedPush(request, grads), targets.into, &viaFrame);
         ASSERT_TRUE(b.ok()) << codeName(b.code) << ": " << b.message;
         EXPECT_EQ(viaFrame.applied(), viaProtobuf.applied());
         EXPECT_EQ(viaFrame.version(), viaProtobuf.version());
         EXPECT_EQ(viaFrame.staleness(), viaProtobuf.staleness());
         EXPECT_EQ(viaFrame.samples_total(), viaProtobuf.samples_total());
         std::vector<float> expected;
         for (const auto& t : viaProtobuf.values()) appendFloats(t, expected);
         ASSERT_EQ(targets.all().size(), expected.size());
         EXPECT_TRUE(targets.all() == expected) << "step " << step << ": the framed reply differs";
         ASSERT_EQ(viaFrame.values_size(), int(pieces.size()));
         EXPECT_TRUE(viaFrame.values(1).data().empty());
      }
      EXPECT_EQ(pullAll(*framedClient), pullAll(*protobufClient));
      const auto p = statsOf(*protobufClient), f = statsOf(*framedClient);
      EXPECT_EQ(f.applied(), 4);
      EXPECT_EQ(f.rejected(), 0);
      EXPECT_EQ(f.bytes_pushed(), p.bytes_pushed());
      EXPECT_EQ(f.bytes_pulled(), p.bytes_pulled());
     }
    }
  }
}

// A frame split at every byte boundary reads back the same header and floats.
TEST(PsFrameTest, AFrameCutAnywhereParsesTheSame) {
  wire::PushRequest header;
  header.set_protocol(kProtocolVersion);
  header.set_clock(3);
  auto* t = header.add_values();
  t->set_key(5);
  t->set_numel(6);
  t->set_dtype(wire::FLOAT32);
  const std::vector<float> floats{1.5f, -2, 3.25f, 1e-30f, -0.0f, 7};
  std::string bytes = frameHead(header);
  bytes.append(reinterpret_cast<const char*>(floats.data()), floats.size() * sizeof(float));
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const std::vector<wire::PieceSpec> pieces{piece(5, "w", 6)};
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    for (size_t second = cut; second <= bytes.size(); second += 3) {
      const std::vector<std::span<const uint8_t>> chunks{
          {data, cut}, {data + cut, second - cut}, {data + second, bytes.size() - second}};
      wire::PushRequest parsed;
      FramePayload payload;
      const Status s = parseFrame(chunks, &parsed, &payload, "push");
      ASSERT_TRUE(s.ok()) << "cut at " << cut << ", " << second << ": " << s.message;
      EXPECT_EQ(parsed.clock(), 3);
      ASSERT_TRUE(checkFramedTensors(parsed.values(), pieces, payload.size(), "push").ok());
      FloatScratch scratch;
      std::vector<float> copied(6);
      const auto view = payload.floats(0, 6, scratch);
      EXPECT_EQ(std::vector<float>(view.begin(), view.end()), floats);
      payload.copyFloats(0, copied);
      EXPECT_EQ(copied, floats);
      const auto tail = payload.floats(8, 4, scratch);
      EXPECT_EQ(std::vector<float>(tail.begin(), tail.end()), std::vector<float>(floats.begin() + 2, floats.end()));
      size_t bad = 0;
      FloatScratch checkedScratch;
      const auto checked = payload.checkedFloats(0, 6, checkedScratch, &bad);
      EXPECT_EQ(std::vector<float>(checked.begin(), checked.end()), floats);
      EXPECT_EQ(bad, 6u) << "every float is finite";
    }
  }
  // A NaN is found wherever the parts cut the floats around it.
  const std::vector<float> withNan{1, 2, std::nanf(""), 4};
  const auto* raw = reinterpret_cast<const uint8_t*>(withNan.data());
  const size_t n = withNan.size() * sizeof(float);
  for (size_t cut = 0; cut <= n; ++cut) {
    const FramePayload payload({{raw, cut}, {raw + cut, n - cut}});
    FloatScratch scratch;
    size_t bad = 0;
    payload.checkedFloats(0, 4, scratch, &bad);
    EXPECT_EQ(bad, 2u) << "cut at byte " << cut;
    payload.checkedFloats(4, 1, scratch, &bad);
    EXPECT_EQ(bad, 1u) << "no NaN among the floats from the second on: cut at byte " << cut;
  }
}

// firstNonFinite: every exponent and both signs, at every place in and past its blocks of 16, at
// any alignment.
TEST(PsWire, FirstNonFiniteFindsEveryNanAndInfAndNothingElse) {
  std::vector<uint8_t> buffer(41 * sizeof(float) + 3);
  for (size_t misalign = 0; misalign < 4; ++misalign) {
    for (uint32_t exponent = 0; exponent < 256; exponent += (exponent < 250 ? 25 : 1)) {
      for (uint32_t sign : {0u, 1u}) {
        for (uint32_t mantissa : {0u, 1u, 0x400000u, 0x7fffffu}) {
          const uint32_t bits = (sign << 31) | (exponent << 23) | mantissa;
          const bool bad = exponent == 255;
          for (size_t at : {size_t(0), size_t(15), size_t(16), size_t(17), size_t(32), size_t(40)}) {
            std::vector<float> values(41, 1.5f);
            std::memcpy(&values[at], &bits, sizeof(bits));
            std::memcpy(buffer.data() + misalign, values.data(), values.size() * sizeof(float));
            EXPECT_EQ(firstNonFinite(buffer.data() + misalign, values.size()), bad ? at : values.size())
                << "bits " << std::hex << bits << std::dec << " at " << at << ", misaligned by " << misalign;
          }
        }
      }
    }
  }
}

// A frame's bytes sent as they are (no client-side checks): what a hostile or broken peer sends.
grpc::Status sendRawFrame(const std::string& address, const std::string& head, const std::vector<float>& payload,
                          IncomingFrame* reply) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  const grpc::internal::RpcMethod method(kPushFramedMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 20s);
  OutgoingFrame frame{.head = head, .payload = {std::span<const float>(payload)}, .keepAlive = nullptr};
  declare(context, bytesOf({frame}));
  return grpc::internal::BlockingUnaryCall<OutgoingFrame, IncomingFrame, OutgoingFrame, IncomingFrame>(
      channel.get(), method, &context, frame, reply);
}

std::string withLength(std::string head, uint32_t length) {
  for (int i = 0; i < 4; ++i) head[4 + size_t(i)] = char((length >> (8 * i)) & 0xff);
  return head;
}

TEST(PsFrameTest, BadFramesAreRefusedNamingTheProblemAndChangeNothing) {
  TestServer server;
  auto client = server.client();
  expectInit(*client);
  wire::PushRequest good;
  good.set_protocol(kProtocolVersion);
  good.set_want_values(true);
  for (const auto& p : kPieces) {
    auto* t = good.add_values();
    t->set_key(p.key());
    t->set_numel(p.numel());
    t->set_dtype(wire::FLOAT32);
  }
  const std::vector<float> ones(5, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto spoiled = [&](const std::function<void(wire::PushRequest&)>& spoil) {
    wire::PushRequest r = good;
    spoil(r);
    return frameHead(r);
  };
  struct Case {
    const char* what;
    std::string head;
    std::vector<float> payload;
    grpc::StatusCode expected;
    const char* says;
  };
  const std::vector<Case> cases{
      {"wrong magic", "XPSF" + frameHead(good).substr(4), ones, grpc::StatusCode::INVALID_ARGUMENT, "not a cohort frame"},
      {"short prefix", "CPS", {}, grpc::StatusCode::INVALID_ARGUMENT, "shorter than its 8-byte prefix"},
      {"header beyond the bytes", withLength(frameHead(good), 1000), {}, grpc::StatusCode::INVALID_ARGUMENT,
       "truncated"},
      {"header over the limit", withLength(frameHead(good), kMaxFrameHeaderBytes + 1), {},
       grpc::StatusCode::INVALID_ARGUMENT, "over the limit"},
      {"header that does not parse", withLength(std::string("CPSF\0\0\0\0\xff\xff", 10), 2), ones,
       grpc::StatusCode::INVALID_ARGUMENT, "does not parse"},
      {"payload short by a float", frameHead(good), std::vector<float>(4, 1.0f), grpc::StatusCode::INVALID_ARGUMENT,
       "payload is 16 bytes, its pieces need 20"},
      {"payload long by a float", frameHead(good), std::vector<float>(6, 1.0f), grpc::StatusCode::INVALID_ARGUMENT,
       "payload is 24 bytes"},
      {"unknown key", spoiled([](auto& r) { r.mutable_values(1)->set_key(42); }), ones,
       grpc::StatusCode::INVALID_ARGUMENT, "key 42"},
      {"wrong numel", spoiled([](auto& r) { r.mutable_values(0)->set_numel(4); }), ones,
       grpc::StatusCode::INVALID_ARGUMENT, "4 elements, expected 3"},
      {"data in the header", spoiled([](auto& r) { r.mutable_values(0)->set_data("abcd"); }), ones,
       grpc::StatusCode::INVALID_ARGUMENT, "belong in the payload"},
      {"a codec message", spoiled([](auto& r) { r.clear_values(); r.set_compressed("x"); }), {},
       grpc::StatusCode::INVALID_ARGUMENT, "float32 values only"},
      {"row-sparse", spoiled([](auto& r) { r.set_row_sparse(true); }), ones, grpc::StatusCode::INVALID_ARGUMENT,
       "float32 values only"},
      {"NaN", frameHead(good), {1, 1, 1, 1, nan}, grpc::StatusCode::INVALID_ARGUMENT, "b holds NaN at element 1"},
      {"protocol 1", spoiled([](auto& r) { r.set_protocol(1); }), ones, grpc::StatusCode::FAILED_PRECONDITION,
       "protocol version 1"},
  };
  for (const auto& c : cases) {
    IncomingFrame reply;
    const grpc::Status s = sendRawFrame(server.address(), c.head, c.payload, &reply);
    EXPECT_EQ(s.error_code(), c.expected) << c.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.says), std::string::npos) << c.what << ": " << s.error_message();
  }
  EXPECT_EQ(pullAll(*client), (std::vector<float>{1, 2, 3, -1, 4}));
  const auto stats = statsOf(*client);
  EXPECT_EQ(stats.version(), 0u);
  EXPECT_EQ(stats.applied(), 0);
  EXPECT_EQ(stats.rejected(), int64_t(cases.size()));

  // The good frame, sent the same way, is applied (sgd, lr 0.5).
  IncomingFrame reply;
  const grpc::Status s = sendRawFrame(server.address(), frameHead(good), ones, &reply);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(pullAll(*client), (std::vector<float>{0.5f, 1.5f, 2.5f, -1.5f, 3.5f}));
}

// A reply whose pieces are not what the worker expects writes nothing into its parameters.
TEST(PsFrameTest, AReplyThatDoesNotMatchTheTargetsWritesNothing) {
  TestServer server;
  auto client = server.client();
  expectInit(*client);
  const std::vector<std::vector<float>> grads{{1, 1, 1}, {1, 1}};
  const auto request = protobufPush(kPieces, grads, 0);
  std::vector<float> a(3, -7.0f), b(1, -7.0f);  // b is one short
  const std::vector<FrameTarget> into{{.key = 0, .values = a}, {.key = 1, .values = b}};
  wire::PushReply reply;
  const Status s = client->pushFramed(framedPush(request, grads), into, &reply);
  EXPECT_EQ(s.code, Code::kInternal) << s.message;
  EXPECT_NE(s.message.find("malformed framed reply"), std::string::npos) << s.message;
  EXPECT_EQ(a, std::vector<float>(3, -7.0f));
  EXPECT_EQ(b, std::vector<float>(1, -7.0f));
}

// A zero-copy push to a shard with a token, sent in one message or (pushChunkBytes small enough) as
// a stream: from a client with the wrong token it is refused and writes nothing; from one with the
// right token it is applied.
void expectAFramedPushNeedsTheToken(size_t pushChunkBytes) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  auto right = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true, .pushChunkBytes = pushChunkBytes});
  auto wrong = server.client({.authToken = "other", .timeoutSeconds = 5, .quiet = true, .pushChunkBytes = pushChunkBytes});
  expectInit(*right);
  const std::vector<std::vector<float>> grads{{1, 1, 1}, {1, 1}};
  const auto request = protobufPush(kPieces, grads, 0);
  FramedTargets targets(kPieces);
  wire::PushReply reply;
  EXPECT_EQ(wrong->pushFramed(framedPush(request, grads), targets.into, &reply).code, Code::kUnauthenticated);
  EXPECT_EQ(targets.all(), std::vector<float>(5, -7.0f));
  const Status s = right->pushFramed(framedPush(request, grads), targets.into, &reply);
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(targets.all(), (std::vector<float>{0.5f, 1.5f, 2.5f, -1.5f, 3.5f}));
  const auto stats = statsOf(*right);
  EXPECT_EQ(stats.unauthenticated(), 1);
  EXPECT_EQ(stats.applied(), 1);
}

// The zero-copy path keeps the shard's authentication: a framed push without the proof is refused.
TEST(PsFrameTest, AFramedPushNeedsTheToken) { expectAFramedPushNeedsTheToken(kDefaultPushChunkBytes); }

// A received frame's chunks read the bytes it came with, from slices small enough that gRPC keeps
// their bytes inside the slice object too (up to 23 bytes: "inlined"), before and after the frame
// is moved. Those bytes live in the frame's own grpc::Slice objects: a frame that kept only the
// buffer read them from freed memory, and under a 512 MB push's load a worker's push once arrived
// with a NaN in it. Whatever the deserializer freed is handed out again and scribbled over (glibc
// gives a freed block back to the next allocation of its size).
TEST(PsFrameTest, AReceivedFrameReadsTheBytesOfItsSmallSlicesToo) {
  const std::vector<std::string> parts{"CPSF", std::string("\x02\0\0\0", 4), "ab", std::string(100, 'z'), "the tail"};
  std::string expected;
  for (const auto& p : parts) expected += p;
  std::vector<grpc::Slice> slices(parts.begin(), parts.end());
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  slices.clear();
  auto scribble = [] {
    std::vector<std::vector<uint8_t>> junk;
    for (size_t bytes = 8; bytes <= 4096; bytes += 8) junk.emplace_back(bytes, 0xff);
    return junk.size();
  };
  auto bytesOf = [](const IncomingFrame& frame) {
    std::string out;
    for (const auto& c : frame.chunks) out.append(reinterpret_cast<const char*>(c.data()), c.size());
    return out;
  };
  IncomingFrame frame;
  ASSERT_TRUE(grpc::SerializationTraits<IncomingFrame>::Deserialize(&buffer, &frame).ok());
  EXPECT_GE(frame.chunks.size(), 2u);  // gRPC merges adjacent small slices into one
  EXPECT_GT(scribble(), 0u);
  EXPECT_EQ(bytesOf(frame), expected);
  IncomingFrame moved = std::move(frame);
  EXPECT_GT(scribble(), 0u);
  EXPECT_EQ(bytesOf(moved), expected);
}

// A server whose one method holds the IncomingFrame it received until told to let it go, under a
// resource quota the test controls.
class HoldingServer {
 public:
  HoldingServer() : service_(this) {
    grpc::ServerBuilder builder;
    builder.SetResourceQuota(quota_.Resize(size_t(64) << 20));
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~HoldingServer() { finish(); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  grpc::ResourceQuota& quota() { return quota_; }
  // Blocks until the handler holds a frame (false: none came within 30 s).
  bool waitHolding() {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, 30s, [&] { return holding_; });
  }
  // Lets the handler return, and waits until gRPC's threads are done with it: its frame was
  // destroyed in its handler thread.
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
      changed_.notify_all();
    }
    server_->Shutdown();
    server_->Wait();
  }

 private:
  class Service final : public grpc::Service {
   public:
    explicit Service(HoldingServer* owner) {
      AddMethod(new grpc::internal::RpcServiceMethod(
          kPushFramedMethod, grpc::internal::RpcMethod::NORMAL_RPC,
          new grpc::internal::RpcMethodHandler<HoldingServer, IncomingFrame, OutgoingFrame, IncomingFrame,
                                               OutgoingFrame>(
              [](HoldingServer* s, grpc::ServerContext*, const IncomingFrame*, OutgoingFrame* r) {
                std::unique_lock<std::mutex> lock(s->mu_);
                s->holding_ = true;
                s->changed_.notify_all();
                s->changed_.wait(lock, [&] { return s->released_; });
                r->head = "held";
                return grpc::Status::OK;
              },
              owner)));
    }
  };

  grpc::ResourceQuota quota_{"holding server"};
  Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::mutex mu_;
  std::condition_variable changed_;
  bool holding_ = false;
  bool released_ = false;
};

// Issue 30's SIGSEGV (grpc_core::ExecCtx::Run <- MaybeRegisterReclaimer <- grpc::Slice::~Slice <-
// IncomingFrame::~IncomingFrame). gRPC charges a received message's memory to the server's
// resource quota; the last unref of its slices gives that memory back, and an allocator that had
// given all its free bytes to an overdrawn quota then registers a reclaimer, waking gRPC's
// reclamation loop through the thread's ExecCtx: a handler thread has none. So the last unref must
// happen inside gRPC (grpc_byte_buffer_destroy sets one up). Deterministic: the handler holds a
// 2 MB frame while the quota is shrunk below what the connection holds; gRPC's reclaimers run
// (the destructive one cancels the call, which the client sees); then the handler lets the frame
// go. In a death-test child, so that a crash fails this test only. Before the fix: SIGSEGV every
// time (20 of 20).
void releaseAFrameWhileTheQuotaIsOverdrawn() {
  HoldingServer server;
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  const grpc::internal::RpcMethod method(kPushFramedMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel);
  const std::vector<float> payload(512 * 1024, 1.0f);
  auto call = std::async(std::launch::async, [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 30s);
    OutgoingFrame frame{.head = "frame", .payload = {std::span<const float>(payload)}, .keepAlive = nullptr};
    IncomingFrame reply;
    return grpc::internal::BlockingUnaryCall<OutgoingFrame, IncomingFrame, OutgoingFrame, IncomingFrame>(
        channel.get(), method, &context, frame, &reply);
  });
  if (!server.waitHolding()) {
    std::fprintf(stderr, "the handler never got the frame\n");
    std::_Exit(2);
  }
  server.quota().Resize(1);
  const grpc::Status cancelled = call.get();
  std::fprintf(stderr, "the call ended (%d: %s); the handler lets its frame go\n", int(cancelled.error_code()),
               cancelled.error_message().c_str());
  server.finish();
  std::fprintf(stderr, "released\n");
  std::_Exit(0);
}

TEST(PsFrameDeathTest, AFrameLetGoWhileTheQuotaIsOverdrawnDoesNotCrashTheServer) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: gRPC's threads do not survive fork
  EXPECT_EXIT(releaseAFrameWhileTheQuotaIsOverdrawn(), testing::ExitedWithCode(0), "released");
}


// ---- The streamed push (PushStream: a chunk of whole pieces per message) ----

struct ModeCase {
  const char* name;
  wire::Policy policy;
  int workers;
};

// The ps modes and staleness remedies, each with a policy under which pushes from one thread never
// wait on another worker: sync with one worker, or with a backup worker (a step closes on the
// first gradient, the other worker's comes late); ssp whose bound the round-robin pushes keep.
std::vector<ModeCase> modeCases() {
  std::vector<ModeCase> out;
  auto with = [](wire::Mode mode, int workers, wire::Optimizer optimizer) {
    wire::Policy p = asyncPolicy();
    p.set_mode(mode);
    p.set_workers(uint32_t(workers));
    p.set_optimizer(optimizer);
    p.set_momentum(0.9);
    p.set_lr(0.01);
    return p;
  };
  out.push_back({"async sgd", with(wire::MODE_ASYNC, 2, wire::OPTIMIZER_SGD), 2});
  out.push_back({"async momentum", with(wire::MODE_ASYNC, 2, wire::OPTIMIZER_MOMENTUM), 2});
  out.push_back({"async adam", with(wire::MODE_ASYNC, 2, wire::OPTIMIZER_ADAM), 2});
  auto remedies = with(wire::MODE_ASYNC, 3, wire::OPTIMIZER_MOMENTUM);
  remedies.set_staleness_lr(wire::STALENESS_LR_INVERSE);
  remedies.set_max_staleness(2);
  out.push_back({"async, staleness_lr inverse, max_staleness 2", remedies, 3});
  auto softsync = with(wire::MODE_SOFTSYNC, 2, wire::OPTIMIZER_SGD);
  softsync.set_softsync(2);
  out.push_back({"softsync 2", softsync, 2});
  out.push_back({"sync, one worker", with(wire::MODE_SYNC, 1, wire::OPTIMIZER_MOMENTUM), 1});
  auto backup = with(wire::MODE_SYNC, 2, wire::OPTIMIZER_SGD);
  backup.set_backup_workers(1);
  out.push_back({"sync, a backup worker", backup, 2});
  auto ssp = with(wire::MODE_SSP, 2, wire::OPTIMIZER_ADAM);
  ssp.set_staleness_bound(2);
  out.push_back({"ssp 2", ssp, 2});
  auto updates = with(wire::MODE_ASYNC, 2, wire::OPTIMIZER_SGD);
  updates.set_push(wire::PUSH_UPDATES);
  out.push_back({"async, pushed updates", updates, 2});
  return out;
}

// The same pushes, as one framed message to one shard and streamed in chunks to another, leave
// both shards and both workers' parameters bit-identical in every mode, with the same replies
// (applied, dropped, staleness, version), the same stats, and a retried push dropped alike.
TEST(PsStreamTest, StreamedPushesEqualOneMessagePushesInEveryMode) {
  const auto pieces = largePieces();
  for (const auto& mode : modeCases()) {
    // Chunks of one piece each (1 MB), of several (1.5 MB: bias and the first large piece), and
    // over the fake transport, whose messages arrive cut into uneven bits (the push is 1.8 MB).
    for (const int transport : {0, 1, 2}) {
      SCOPED_TRACE(std::string(mode.name) + (transport == 2 ? ", fake transport" : ", gRPC, chunks of ") +
                   (transport == 0 ? "1 MB" : transport == 1 ? "1.5 MB" : ""));
      TestServer unaryServer, streamServer;
      auto unary = unaryServer.client({.timeoutSeconds = 5, .quiet = true, .pushChunkBytes = 0});
      auto streamed = transport == 2 ? makeFakeClient(std::make_shared<Shard>(ShardOptions{.log = [](const std::string&) {}}),
                                                      "fake", size_t(700) << 10)
                                     : streamServer.client({.timeoutSeconds = 5, .quiet = true,
                                                            .pushChunkBytes = (size_t(2 + transport) << 20) / 2});
      const auto start = randomValues(pieces, 7);
      wire::InitReply initReply;
      ASSERT_TRUE(unary->init(initOf(mode.policy, pieces, start), &initReply).ok());
      ASSERT_TRUE(streamed->init(initOf(mode.policy, pieces, start), &initReply).ok());
      std::vector<int64_t> clocks(size_t(mode.workers), 0);
      uint64_t version = 0;
      for (int i = 0; i < 9; ++i) {
        const uint32_t worker = uint32_t(i % mode.workers);
        const auto grads = randomValues(pieces, 200 + uint32_t(i));
        // Push 5 is a retry of its worker's previous one (a clock already seen: a duplicate);
        // every third lags a version behind (late under sync, stale under async).
        const bool retry = i == 5;
        auto request = protobufPush(pieces, grads, 0);
        request.set_worker(worker);
        request.set_clock(retry ? clocks[worker] - 1 : clocks[worker]);
        request.set_pulled_version(i % 3 == 2 && version > 0 ? version - 1 : version);
        if (!retry) ++clocks[worker];
        const auto push = framedPush(request, grads);
        FramedTargets a(pieces), b(pieces);
        wire::PushReply viaOne, viaStream;
        const Status sa = unary->pushFramed(push, a.into, &viaOne);
        ASSERT_TRUE(sa.ok()) << codeName(sa.code) << ": " << sa.message;
        const Status sb = streamed->pushFramed(push, b.into, &viaStream);
        ASSERT_TRUE(sb.ok()) << codeName(sb.code) << ": " << sb.message;
        EXPECT_EQ(viaStream.applied(), viaOne.applied()) << "push " << i;
        EXPECT_EQ(viaStream.dropped(), viaOne.dropped()) << "push " << i;
        EXPECT_EQ(viaStream.staleness(), viaOne.staleness()) << "push " << i;
        EXPECT_EQ(viaStream.version(), viaOne.version()) << "push " << i;
        EXPECT_EQ(viaStream.samples_total(), viaOne.samples_total()) << "push " << i;
        const auto one = a.all(), two = b.all();
        ASSERT_EQ(one.size(), two.size());
        EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0)
            << "push " << i << ": the parameters differ";
        version = viaOne.version();
      }
      const auto p = pullAll(*unary), q = pullAll(*streamed);
      ASSERT_EQ(p.size(), q.size());
      EXPECT_EQ(std::memcmp(p.data(), q.data(), p.size() * sizeof(float)), 0);
      const auto x = statsOf(*unary), y = statsOf(*streamed);
      EXPECT_GT(x.version(), 0u);
      EXPECT_EQ(y.version(), x.version());
      EXPECT_EQ(y.applied(), x.applied());
      EXPECT_EQ(y.dropped_late(), x.dropped_late());
      EXPECT_EQ(y.dropped_stale(), x.dropped_stale());
      EXPECT_EQ(y.dropped_duplicate(), x.dropped_duplicate());
      EXPECT_EQ(y.rejected(), 0);
      EXPECT_EQ(y.partial_pushes(), 0);
      EXPECT_EQ(y.bytes_pushed(), x.bytes_pushed());
      EXPECT_EQ(y.samples_total(), x.samples_total());
    }
  }
}

// A stream's messages sent as they are (no client-side checks), optionally cancelled after
// `cancelAfter` of them: what a hostile, broken or dying worker sends.
grpc::Status sendRawStream(const std::string& address, const std::vector<OutgoingFrame>& messages,
                           const std::string& token = "", size_t cancelAfter = SIZE_MAX) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  const grpc::internal::RpcMethod method(kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 20s);
  if (!token.empty()) context.AddMetadata("authorization", makeCallProof(token));
  declare(context, bytesOf(messages));
  IncomingFrame reply;
  std::unique_ptr<grpc::ClientWriter<OutgoingFrame>> writer(
      grpc::internal::ClientWriterFactory<OutgoingFrame>::Create(channel.get(), method, &context, &reply));
  for (size_t i = 0; i < messages.size(); ++i) {
    if (i == cancelAfter) {
      context.TryCancel();
      break;
    }
    if (!writer->Write(messages[i])) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// The message of a chunk: pieces [first, first + count) with `floats` as their payload.
OutgoingFrame chunkMessage(uint32_t first, uint32_t count, const std::vector<float>& floats) {
  wire::PushChunk chunk;
  chunk.set_first_piece(first);
  chunk.set_pieces(count);
  return {.head = frameHead(chunk), .payload = {std::span<const float>(floats)}, .keepAlive = nullptr};
}

// The header of a streamed push of `pieces` (keys, sizes, no data).
wire::PushRequest streamHeader(const std::vector<wire::PieceSpec>& pieces, uint32_t worker = 0, int64_t clock = 0,
                               uint64_t pulled = 0) {
  wire::PushRequest header;
  header.set_protocol(kProtocolVersion);
  header.set_worker(worker);
  header.set_clock(clock);
  header.set_pulled_version(pulled);
  header.set_want_values(true);
  for (const auto& p : pieces) {
    auto* t = header.add_values();
    t->set_key(p.key());
    t->set_numel(p.numel());
    t->set_dtype(wire::FLOAT32);
  }
  return header;
}

// A bad chunk anywhere in a stream, or a stream that ends early, refuses the push there: the
// pieces of the valid chunks before it were applied as they arrived and stay (the error and the
// stats say so), the pieces from the bad chunk on are unchanged bit for bit, and the push is not
// counted as an update (no version, no applied, the worker's clock unchanged).
TEST(PsStreamTest, ABadChunkOrAnEarlyEndKeepsThePiecesOfTheValidChunksBeforeIt) {
  TestServer server(ServerOptions{.authToken = "s3cret"});
  auto client = server.client({.authToken = "s3cret", .timeoutSeconds = 5, .quiet = true});
  expectInit(*client);
  const wire::PushRequest header = streamHeader(kPieces);
  const OutgoingFrame head{.head = frameHead(header), .payload = {}, .keepAlive = nullptr};
  const std::vector<float> a{1, 1, 1}, b{1, 1}, both{1, 1, 1, 1, 1}, none;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> bNan{1, nan}, bInf{std::numeric_limits<float>::infinity(), 1}, bShort{1};
  const std::vector<float> abNan{1, 1, 1, nan, 1};
  auto oldHeader = header;
  oldHeader.set_protocol(2);
  const std::vector<float> stray{1};
  struct Case {
    const char* what;
    std::vector<OutgoingFrame> messages;
    grpc::StatusCode expected;
    const char* says;
    bool keepsFirstPiece;  // piece a's chunk came first and was valid: applied (sgd, lr 0.5: a - 0.5)
  };
  const char* kept = "1 of its 2 pieces, received before, were applied and stay";
  const std::vector<Case> cases{
      {"NaN in the second chunk",
       {head, chunkMessage(0, 1, a), chunkMessage(1, 1, bNan)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "b holds NaN at element 1",
       true},
      {"Inf in the second chunk",
       {head, chunkMessage(0, 1, a), chunkMessage(1, 1, bInf)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "b holds Inf at element 0",
       true},
      {"a chunk of the wrong size",
       {head, chunkMessage(0, 1, a), chunkMessage(1, 1, bShort)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "carries 4 bytes, its pieces need 8",
       true},
      {"a piece twice",
       {head, chunkMessage(0, 1, a), chunkMessage(0, 1, a), chunkMessage(1, 1, b)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "begins at piece 0 where piece 1 comes next",
       true},
      {"truncated after the first chunk",
       {head, chunkMessage(0, 1, a)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "the stream ended after 1 of its 2 pieces",
       true},
      {"a chunk header that does not parse after a good chunk",
       {head,
        chunkMessage(0, 1, a),
        {.head = withLength(std::string("CPSF\0\0\0\0\xff\xff", 10), 2), .payload = {}, .keepAlive = nullptr}},
       grpc::StatusCode::INVALID_ARGUMENT,
       "does not parse",
       true},
      {"out of order",
       {head, chunkMessage(1, 1, b), chunkMessage(0, 1, a)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "begins at piece 1 where piece 0 comes next",
       false},
      {"NaN in the first chunk of two pieces",
       {head, chunkMessage(0, 2, abNan)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "b holds NaN at element 0",
       false},
      {"more pieces than the shard has",
       {head, chunkMessage(0, 3, both)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "a chunk of 3 pieces from piece 0, the shard has 2",
       false},
      {"an empty chunk",
       {head, chunkMessage(0, 0, none)},
       grpc::StatusCode::INVALID_ARGUMENT,
       "a chunk of 0 pieces",
       false},
      {"no header", {}, grpc::StatusCode::INVALID_ARGUMENT, "ended before its header", false},
      {"floats in the header frame",
       {{.head = frameHead(header), .payload = {stray}, .keepAlive = nullptr}},
       grpc::StatusCode::INVALID_ARGUMENT,
       "header frame carries 4 payload bytes",
       false},
      {"a chunk header that does not parse",
       {head, {.head = withLength(std::string("CPSF\0\0\0\0\xff\xff", 10), 2), .payload = {}, .keepAlive = nullptr}},
       grpc::StatusCode::INVALID_ARGUMENT,
       "does not parse",
       false},
      {"protocol 2 (an older worker)",
       {{.head = frameHead(oldHeader), .payload = {}, .keepAlive = nullptr}},
       grpc::StatusCode::FAILED_PRECONDITION,
       "protocol version 2 is not this server's",
       false},
  };
  std::vector<float> expected{1, 2, 3, -1, 4};
  int64_t partial = 0;
  int64_t clock = 100;
  for (auto c : cases) {
    // Each case its own push (its own clock): a second stream of one clock is that push's retry,
    // which does not apply again the pieces the first applied.
    if (!c.messages.empty() && c.messages[0].head == head.head) {
      c.messages[0].head = frameHead(streamHeader(kPieces, 0, clock++));
    }
    const grpc::Status s = sendRawStream(server.address(), c.messages, "s3cret");
    EXPECT_EQ(s.error_code(), c.expected) << c.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.says), std::string::npos) << c.what << ": " << s.error_message();
    EXPECT_EQ(s.error_message().find(kept) != std::string::npos, c.keepsFirstPiece) << c.what << ": "
                                                                                    << s.error_message();
    if (c.keepsFirstPiece) {
      for (size_t i = 0; i < 3; ++i) expected[i] -= 0.5f;
      ++partial;
    }
    EXPECT_EQ(pullAll(*client), expected) << c.what;
    const auto stats = statsOf(*client);
    EXPECT_EQ(stats.partial_pushes(), partial) << c.what;
    EXPECT_EQ(stats.version(), 0u) << c.what;
    EXPECT_EQ(stats.applied(), 0) << c.what;
    ASSERT_EQ(stats.clocks_size(), 1);
    EXPECT_EQ(stats.clocks(0), 0) << c.what;
  }
  EXPECT_EQ(partial, 6);
  // The shard's log names the worker and what stayed, once per partial push.
  int logged = 0;
  for (const auto& line : server.log()) {
    if (line.find("a streamed push of worker 0 ended early") != std::string::npos &&
        line.find(kept) != std::string::npos) {
      ++logged;
    }
  }
  EXPECT_EQ(logged, 6);
  // Without the token: refused before a chunk is read, counted apart.
  const grpc::Status s = sendRawStream(server.address(), {head, chunkMessage(0, 2, both)}, "other");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();

  const auto stats = statsOf(*client);
  EXPECT_EQ(stats.rejected(), int64_t(cases.size()));
  EXPECT_EQ(stats.unauthenticated(), 1);
  EXPECT_EQ(pullAll(*client), (std::vector<float>{-2, -1, 0, -1, 4}));

  // The good stream, sent the same way, is applied (sgd, lr 0.5) and counted, whether cut per
  // piece or whole.
  ASSERT_TRUE(sendRawStream(server.address(), {head, chunkMessage(0, 1, a), chunkMessage(1, 1, b)}, "s3cret").ok());
  EXPECT_EQ(pullAll(*client), (std::vector<float>{-2.5f, -1.5f, -0.5f, -1.5f, 3.5f}));
  wire::PushRequest second = header;
  second.set_clock(1);
  const OutgoingFrame secondHead{.head = frameHead(second), .payload = {}, .keepAlive = nullptr};
  ASSERT_TRUE(sendRawStream(server.address(), {secondHead, chunkMessage(0, 2, both)}, "s3cret").ok());
  EXPECT_EQ(pullAll(*client), (std::vector<float>{-3, -2, -1, -2, 3}));
  const auto after = statsOf(*client);
  EXPECT_EQ(after.version(), 2u);
  EXPECT_EQ(after.applied(), 2);
  EXPECT_EQ(after.partial_pushes(), 6);
}

// A worker that dies (or cancels) after its first chunk: that chunk was applied as it arrived and
// stays, the other piece is unchanged, the push is not counted, and the shard says so; the next
// push is taken as usual.
TEST(PsStreamTest, AStreamCutOffByTheWorkerKeepsTheChunksItSent) {
  TestServer server;
  auto client = server.client();
  expectInit(*client);
  const OutgoingFrame head{.head = frameHead(streamHeader(kPieces)), .payload = {}, .keepAlive = nullptr};
  const std::vector<float> big(3, 100.0f), b{1, 1}, a{1, 1, 1};
  {
    auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
    const grpc::internal::RpcMethod method(kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 20s);
    declare(context, bytesOf({head, chunkMessage(0, 1, big), chunkMessage(1, 1, b)}));
    IncomingFrame reply;
    std::unique_ptr<grpc::ClientWriter<OutgoingFrame>> writer(
        grpc::internal::ClientWriterFactory<OutgoingFrame>::Create(channel.get(), method, &context, &reply));
    ASSERT_TRUE(writer->Write(head));
    ASSERT_TRUE(writer->Write(chunkMessage(0, 1, big)));
    // The shard applies the chunk while the stream is still open: piece a moves before the end.
    ASSERT_TRUE(eventually([&] { return pullAll(*client)[0] == 1.0f - 50.0f; }))
        << "the first chunk was not applied before the stream ended";
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(eventually([&] { return statsOf(*client).partial_pushes() == 1; }));
  EXPECT_EQ(pullAll(*client), (std::vector<float>{-49, -48, -47, -1, 4}));
  auto stats = statsOf(*client);
  EXPECT_EQ(stats.applied(), 0);
  EXPECT_EQ(stats.version(), 0u);
  EXPECT_EQ(stats.rejected(), 1);
  bool logged = false;
  for (const auto& line : server.log()) {
    logged = logged || (line.find("ended early: push stream: cancelled by the worker") != std::string::npos &&
                        line.find("1 of its 2 pieces") != std::string::npos);
  }
  EXPECT_TRUE(logged);
  // The worker's retry of that push (the same clock) completes it: piece a, in already, is not
  // applied a second time; b is, and the push counts once.
  ASSERT_TRUE(sendRawStream(server.address(), {head, chunkMessage(0, 1, a), chunkMessage(1, 1, b)}).ok());
  EXPECT_EQ(pullAll(*client), (std::vector<float>{-49, -48, -47, -1.5f, 3.5f}));
  stats = statsOf(*client);
  EXPECT_EQ(stats.applied(), 1);
  EXPECT_EQ(stats.version(), 1u);
  EXPECT_EQ(stats.partial_pushes(), 1);
  // Its next push is whole again.
  const OutgoingFrame next{.head = frameHead(streamHeader(kPieces, 0, 1, 1)), .payload = {}, .keepAlive = nullptr};
  ASSERT_TRUE(sendRawStream(server.address(), {next, chunkMessage(0, 1, a), chunkMessage(1, 1, b)}).ok());
  EXPECT_EQ(pullAll(*client), (std::vector<float>{-49.5f, -48.5f, -47.5f, -2, 3}));
}

// A streamed push driven on a Shard directly, as the service does, so that the test decides what
// happens between two chunks.
struct DirectStream {
  Shard& shard;
  std::unique_ptr<Shard::Stream> stream;
  DirectStream(Shard& s, const wire::PushRequest& header) : shard(s) {
    const Status st = shard.beginStream(header, &stream);
    EXPECT_TRUE(st.ok()) << st.message;
  }
  Status chunk(uint32_t first, const std::vector<float>& floats) {
    wire::PushChunk c;
    c.set_first_piece(first);
    c.set_pieces(1);
    const FramePayload payload({std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(floats.data()),
                                                         floats.size() * sizeof(float))});
    return shard.addChunk(*stream, c, payload);
  }
  Status finish(wire::PushReply* reply) {
    std::vector<float> values;
    return shard.finishStream(*stream, reply, &values);
  }
};

std::vector<float> pullShard(Shard& shard) {
  wire::PullReply reply;
  const Status s = shard.pull(withProtocol<wire::PullRequest>(), &reply);
  EXPECT_TRUE(s.ok()) << s.message;
  std::vector<float> out;
  for (const auto& t : reply.values()) appendFloats(t, out);
  return out;
}

wire::Policy streamPolicy(wire::Mode mode, wire::Optimizer optimizer, int workers) {
  wire::Policy p = asyncPolicy();
  p.set_mode(mode);
  p.set_optimizer(optimizer);
  p.set_workers(uint32_t(workers));
  return p;
}

// Another worker's push lands between two chunks of a streamed one (async, Adam): each piece gets
// both updates whole, in the order they reached it (a: the stream's first, b: the other's first),
// each at the piece's own step count (Adam's bias correction), bit for bit as two optimizers
// stepping the pieces apart; the version counts each push once, when it completes.
TEST(PsStreamTest, AnotherPushBetweenTwoChunksAppliesWholeToEachPiece) {
  Shard shard(ShardOptions{.log = [](const std::string&) {}});
  wire::Policy policy = streamPolicy(wire::MODE_ASYNC, wire::OPTIMIZER_ADAM, 2);
  policy.set_lr(0.01);
  wire::InitReply initReply;
  ASSERT_TRUE(shard.init(initOf(policy, kPieces, kStart), &initReply).ok());
  const std::vector<float> a0{0.5f, -1.0f, 2.0f}, a1{-0.25f, 3.0f}, b0{-2.0f, 0.75f, 1.5f}, b1{1.0f, -0.5f};

  DirectStream streamed(shard, streamHeader(kPieces, 0, 0, 0));
  ASSERT_TRUE(streamed.chunk(0, a0).ok());
  wire::PushRequest other = pushOf({b0, b1}, 1);
  other.set_clock(0);
  wire::PushReply otherReply;
  ASSERT_TRUE(shard.push(other, &otherReply).ok());
  EXPECT_TRUE(otherReply.applied());
  EXPECT_EQ(otherReply.version(), 1u);  // the stream is not counted yet
  ASSERT_TRUE(streamed.chunk(1, a1).ok());
  wire::PushReply reply;
  ASSERT_TRUE(streamed.finish(&reply).ok());
  EXPECT_TRUE(reply.applied());
  EXPECT_EQ(reply.version(), 2u);
  EXPECT_EQ(reply.staleness(), 0);  // as when it began

  std::vector<float> p0 = kStart[0], p1 = kStart[1];
  ServerOptimizer first(UpdateRule::kAdam, 0.01, 0.0, 3), second(UpdateRule::kAdam, 0.01, 0.0, 2);
  first.apply(p0, a0);
  first.apply(p0, b0);
  second.apply(p1, b1);
  second.apply(p1, a1);
  std::vector<float> expected = p0;
  expected.insert(expected.end(), p1.begin(), p1.end());
  const auto got = pullShard(shard);
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0);
  wire::StatsReply stats;
  ASSERT_TRUE(shard.stats(withProtocol<wire::StatsRequest>(), &stats).ok());
  EXPECT_EQ(stats.applied(), 2);
  EXPECT_EQ(stats.partial_pushes(), 0);
  EXPECT_EQ(stats.clocks(0), 1);
  EXPECT_EQ(stats.clocks(1), 1);
}

// sync with a backup worker: the step closes on the other worker's push while a stream is half
// in. The stream's first piece made the step (that piece averaged over both gradients), its second
// did not (that piece over the other's alone); the stream is late, counted partial, and nothing
// of it leaks into the next step.
TEST(PsStreamTest, ASyncStepClosingMidStreamTakesThePiecesThatArrived) {
  Shard shard(ShardOptions{.log = [](const std::string&) {}});
  wire::Policy policy = streamPolicy(wire::MODE_SYNC, wire::OPTIMIZER_SGD, 2);
  policy.set_backup_workers(1);
  wire::InitReply initReply;
  ASSERT_TRUE(shard.init(initOf(policy, kPieces, kStart), &initReply).ok());

  DirectStream streamed(shard, streamHeader(kPieces, 0, 0, 0));
  ASSERT_TRUE(streamed.chunk(0, {1, 1, 1}).ok());
  wire::PushRequest other = pushOf({{3, 3, 3}, {2, 2}}, 1);
  wire::PushReply otherReply;
  ASSERT_TRUE(shard.push(other, &otherReply).ok());  // one gradient closes the step (2 workers, 1 backup)
  EXPECT_TRUE(otherReply.applied());
  EXPECT_EQ(otherReply.version(), 1u);
  // a: 1 - 0.5 (1 + 3) / 2 ...; b: -1 - 0.5 * 2, 4 - 0.5 * 2.
  EXPECT_EQ(pullShard(shard), (std::vector<float>{0, 1, 2, -2, 3}));
  ASSERT_TRUE(streamed.chunk(1, {100, 100}).ok());
  wire::PushReply reply;
  ASSERT_TRUE(streamed.finish(&reply).ok());
  EXPECT_FALSE(reply.applied());
  EXPECT_EQ(reply.dropped(), "late");
  EXPECT_EQ(pullShard(shard), (std::vector<float>{0, 1, 2, -2, 3}));
  wire::StatsReply stats;
  ASSERT_TRUE(shard.stats(withProtocol<wire::StatsRequest>(), &stats).ok());
  EXPECT_EQ(stats.partial_pushes(), 1);
  EXPECT_EQ(stats.dropped_late(), 1);
  EXPECT_EQ(stats.version(), 1u);

  // The next step holds only what is pushed for it: a zero gradient changes nothing.
  wire::PushRequest zero = pushOf({{0, 0, 0}, {0, 0}}, 1);
  zero.set_clock(1);
  zero.set_pulled_version(1);
  ASSERT_TRUE(shard.push(zero, &otherReply).ok());
  EXPECT_TRUE(otherReply.applied());
  EXPECT_EQ(otherReply.version(), 2u);
  EXPECT_EQ(pullShard(shard), (std::vector<float>{0, 1, 2, -2, 3}));
}

// softsync 2: a group closes on two other pushes while a stream is half in. The stream's first
// piece is averaged in that group (over three gradients), its second in the next group (over two,
// with the push that closes it); the stream counts in the next group, whole.
TEST(PsStreamTest, ASoftsyncGroupClosingMidStreamAveragesEachPieceOverWhatItGot) {
  Shard shard(ShardOptions{.log = [](const std::string&) {}});
  wire::Policy policy = streamPolicy(wire::MODE_SOFTSYNC, wire::OPTIMIZER_SGD, 2);
  policy.set_softsync(2);
  wire::InitReply initReply;
  ASSERT_TRUE(shard.init(initOf(policy, kPieces, kStart), &initReply).ok());

  DirectStream streamed(shard, streamHeader(kPieces, 0, 0, 0));
  ASSERT_TRUE(streamed.chunk(0, {3, 3, 3}).ok());
  wire::PushReply r;
  for (int64_t clock : {0, 1}) {
    wire::PushRequest other = pushOf({{3, 3, 3}, {2, 2}}, 1);
    other.set_clock(clock);
    ASSERT_TRUE(shard.push(other, &r).ok());
  }
  EXPECT_EQ(r.version(), 1u);
  // a: 1 - 0.5 * (9 / 3); b: -1 - 0.5 * (4 / 2).
  EXPECT_EQ(pullShard(shard), (std::vector<float>{-0.5f, 0.5f, 1.5f, -2, 3}));
  ASSERT_TRUE(streamed.chunk(1, {6, 6}).ok());
  ASSERT_TRUE(streamed.finish(&r).ok());
  EXPECT_TRUE(r.applied());
  EXPECT_EQ(r.version(), 1u);  // one push in the new group
  wire::PushRequest closing = pushOf({{2, 2, 2}, {2, 2}}, 1);
  closing.set_clock(2);
  ASSERT_TRUE(shard.push(closing, &r).ok());
  EXPECT_EQ(r.version(), 2u);
  // a: -0.5 - 0.5 * 2 (the closing push alone); b: -2 - 0.5 * (6 + 2) / 2.
  EXPECT_EQ(pullShard(shard), (std::vector<float>{-1.5f, -0.5f, 0.5f, -4, 1}));
  wire::StatsReply stats;
  ASSERT_TRUE(shard.stats(withProtocol<wire::StatsRequest>(), &stats).ok());
  EXPECT_EQ(stats.applied(), 4);
  EXPECT_EQ(stats.partial_pushes(), 0);
}

// A stream cut after its first piece leaves that piece one Adam step ahead of the other; a
// checkpoint keeps each piece's step count, so a shard restored from it goes on exactly as the
// one that wrote it (the same next push, bit for bit).
TEST(PsStreamTest, ACheckpointKeepsEachPiecesOptimizerSteps) {
  TempDir dir;
  wire::Policy policy = streamPolicy(wire::MODE_ASYNC, wire::OPTIMIZER_ADAM, 1);
  policy.set_lr(0.01);
  Shard first(ShardOptions{.name = "first", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
  wire::InitReply initReply;
  ASSERT_TRUE(first.init(initOf(policy, kPieces, kStart), &initReply).ok());
  {
    DirectStream cut(first, streamHeader(kPieces, 0, 0, 0));
    ASSERT_TRUE(cut.chunk(0, {0.5f, -1.0f, 2.0f}).ok());
    wire::PushReply reply;
    EXPECT_EQ(cut.finish(&reply).code, Code::kInvalidArgument);  // ended after 1 of its 2 pieces
  }
  first.checkpoint();
  Shard second(ShardOptions{.name = "second", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
  EXPECT_EQ(pullShard(second), pullShard(first));
  for (Shard* shard : {&first, &second}) {
    wire::PushRequest next = pushOf({{1.0f, 0.25f, -0.5f}, {-2.0f, 0.125f}});
    next.set_clock(1);  // the worker's next push (clock 0 again would be the cut one's retry)
    wire::PushReply reply;
    ASSERT_TRUE(shard->push(next, &reply).ok());
    EXPECT_TRUE(reply.applied());
  }
  const auto a = pullShard(first), b = pullShard(second);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  // Piece b's first Adam step moves each value by about lr (the bias-corrected first step); at
  // the step count of piece a (its second) it would move by less.
  EXPECT_NEAR(b[3], -1.0f + 0.01f, 1e-6);
  EXPECT_NEAR(b[4], 4.0f - 0.01f, 1e-6);
}

// A push may say it has no gradient for a piece (protocol 4: the worker's parameter had none this
// step): the shard leaves that piece and its optimizer state alone, as torch's optimizers skip a
// parameter without a gradient. One-message (protobuf and framed) and streamed pushes alike.
TEST(PsNoGradientTest, APieceWithoutAGradientKeepsItsValueAndMomentum) {
  // Momentum 0.9, lr 0.5: b gets gradient {1, 1}, then none, then {1, 1} again. Left alone in the
  // second push, its buffer is {1, 1} and then {1.9, 1.9}: b = {-1, 4} - 0.5 - 0.95.
  const std::vector<float> expectedB{-2.45f, 2.55f};
  enum class Way { kProtobuf, kFramed, kStreamed };
  for (const Way way : {Way::kProtobuf, Way::kFramed, Way::kStreamed}) {
    SCOPED_TRACE(way == Way::kProtobuf ? "protobuf" : way == Way::kFramed ? "framed" : "streamed");
    auto shard = std::make_shared<Shard>(ShardOptions{.log = [](const std::string&) {}});
    auto client = makeFakeClient(shard, "fake", way == Way::kStreamed ? 8 : 0);
    wire::Policy policy = asyncPolicy();
    policy.set_optimizer(wire::OPTIMIZER_MOMENTUM);
    policy.set_momentum(0.9);
    wire::InitReply initReply;
    ASSERT_TRUE(client->init(initOf(policy, kPieces, kStart), &initReply).ok());
    const std::vector<float> ga{1, 1, 1}, gb{1, 1};
    for (int64_t clock = 0; clock < 3; ++clock) {
      wire::PushRequest request = pushOf({ga, gb});
      request.set_clock(clock);
      request.set_pulled_version(uint64_t(clock));
      if (clock == 1) setNoGradient(request.mutable_values(1), kPieces[1]);
      wire::PushReply reply;
      if (way == Way::kProtobuf) {
        ASSERT_TRUE(client->push(request, &reply).ok());
      } else {
        // The floats travel from a copy of the request's data; the header keeps the shapes only.
        const auto kept = std::make_shared<const wire::PushRequest>(request);
        FramedPush framed;
        framed.request = request;
        for (auto& t : *framed.request.mutable_values()) t.clear_data();
        for (const auto& t : kept->values()) {
          framed.payload.emplace_back(reinterpret_cast<const float*>(t.data().data()), t.data().size() / sizeof(float));
        }
        framed.keepAlive = kept;
        ASSERT_TRUE(client->pushFramed(framed, {}, &reply).ok());
      }
      EXPECT_TRUE(reply.applied());
      EXPECT_EQ(reply.version(), uint64_t(clock + 1));
      const auto values = pullAll(*client);
      if (clock == 1) {
        // b as after the first push (-0.5 each); a moved by its momentum.
        EXPECT_EQ(std::vector<float>(values.begin() + 3, values.end()), (std::vector<float>{-1.5f, 3.5f}));
      }
    }
    const auto values = pullAll(*client);
    EXPECT_NEAR(values[3], expectedB[0], 1e-6);
    EXPECT_NEAR(values[4], expectedB[1], 1e-6);
    // a had three gradients: buffers 1, 1.9, 2.71: a = {1, 2, 3} - 0.5 * 5.61.
    EXPECT_NEAR(values[0], 1 - 0.5f * 5.61f, 1e-5);
    // The pushes carried 5, 3 and 5 floats: the second none of b's.
    const auto stats = statsOf(*client);
    EXPECT_EQ(stats.applied(), 3);
    EXPECT_EQ(stats.bytes_pushed(), 13 * 4);
  }
}

// sync, 2 workers: a piece one worker had no gradient for is averaged over both pushes, as a zero
// (DataParallel's rule for a parameter some ranks did not use); a piece neither had one for is
// left alone, with its momentum.
TEST(PsNoGradientTest, SyncAveragesOverThePushesAndSkipsAPieceNoPushHadAGradientFor) {
  auto shard = std::make_shared<Shard>(ShardOptions{.log = [](const std::string&) {}});
  wire::Policy policy = asyncPolicy();
  policy.set_mode(wire::MODE_SYNC);
  policy.set_workers(2);
  policy.set_optimizer(wire::OPTIMIZER_MOMENTUM);
  policy.set_momentum(0.5);
  wire::InitReply initReply;
  ASSERT_TRUE(shard->init(initOf(policy, kPieces, kStart), &initReply).ok());
  auto step = [&](int64_t clock, bool bFrom0, bool bFrom1) {
    std::vector<std::thread> workers;
    for (uint32_t w = 0; w < 2; ++w) {
      workers.emplace_back([&, w] {
        wire::PushRequest request = pushOf({{2, 2, 2}, {2, 2}}, w);
        request.set_clock(clock);
        request.set_pulled_version(uint64_t(clock));
        if (!(w == 0 ? bFrom0 : bFrom1)) setNoGradient(request.mutable_values(1), kPieces[1]);
        wire::PushReply reply;
        const Status s = shard->push(request, &reply);
        EXPECT_TRUE(s.ok()) << s.message;
        EXPECT_TRUE(reply.applied());
      });
    }
    for (auto& t : workers) t.join();
  };
  step(0, true, false);  // b: (2 + 0) / 2 = 1; buffer 1; b = {-1, 4} - 0.5
  EXPECT_EQ(pullShard(*shard), (std::vector<float>{0, 1, 2, -1.5f, 3.5f}));
  step(1, false, false);  // b: no gradient in the step: unchanged, buffer kept
  EXPECT_EQ(pullShard(*shard), (std::vector<float>{-1.5f, -0.5f, 0.5f, -1.5f, 3.5f}));
  step(2, true, true);  // b: 2; buffer 0.5 * 1 + 2 = 2.5; b -= 1.25
  EXPECT_EQ(pullShard(*shard), (std::vector<float>{-3.25f, -2.25f, -1.25f, -2.75f, 2.25f}));
}

// Where "no gradient" means nothing: an Init's values, a reply's.
TEST(PsNoGradientTest, OnlyAPushMaySayNoGradient) {
  wire::InitRequest init = initOf(asyncPolicy(), kPieces, kStart);
  setNoGradient(init.mutable_values(1), kPieces[1]);
  EXPECT_FALSE(checkTensors(init.values(), kPieces, true, "Init").ok());
  EXPECT_TRUE(checkTensors(init.values(), kPieces, true, "push", NoGradient::kAllowed).ok());
  Shard shard(ShardOptions{.log = [](const std::string&) {}});
  wire::InitReply reply;
  EXPECT_EQ(shard.init(init, &reply).code, Code::kInvalidArgument);
}

// A worker retries a streamed push cut midway (its client sends the whole push again, on a new
// connection): the retry completes that push, each piece applied once. The cut attempt's last
// chunk may still be taken in after the retry began (gRPC had it read): whichever attempt reaches
// a piece first applies it, the other passes over it, and the push counts once (async, sgd).
TEST(PsStreamTest, ARetryOfACutStreamAppliesEachPieceOnce) {
  const std::vector<float> a{1, 1, 1}, b{2, 2};
  for (const bool overlapping : {false, true}) {
    SCOPED_TRACE(overlapping ? "the cut attempt's last chunk arrives during the retry" : "the retry after the cut");
    Shard shard(ShardOptions{.log = [](const std::string&) {}});
    wire::InitReply initReply;
    ASSERT_TRUE(shard.init(initOf(asyncPolicy(), kPieces, kStart), &initReply).ok());
    DirectStream cut(shard, streamHeader(kPieces, 0, 0, 0));
    ASSERT_TRUE(cut.chunk(0, a).ok());
    const Status cancelled = Status::error(Code::kCancelled, "push stream: cancelled");
    if (!overlapping) EXPECT_EQ(shard.refuseStream(*cut.stream, cancelled).code, Code::kCancelled);
    DirectStream retry(shard, streamHeader(kPieces, 0, 0, 0));
    ASSERT_TRUE(retry.chunk(0, a).ok());
    if (overlapping) ASSERT_TRUE(cut.chunk(1, b).ok());
    ASSERT_TRUE(retry.chunk(1, b).ok());
    wire::PushReply reply;
    ASSERT_TRUE(retry.finish(&reply).ok());
    EXPECT_TRUE(reply.applied());
    EXPECT_EQ(reply.version(), 1u);
    if (overlapping) EXPECT_EQ(shard.refuseStream(*cut.stream, cancelled).code, Code::kCancelled);
    // sgd, lr 0.5: a = {1, 2, 3} - 0.5, b = {-1, 4} - 1, once each.
    EXPECT_EQ(pullShard(shard), (std::vector<float>{0.5f, 1.5f, 2.5f, -2, 3}));
    wire::StatsReply stats;
    ASSERT_TRUE(shard.stats(withProtocol<wire::StatsRequest>(), &stats).ok());
    EXPECT_EQ(stats.applied(), 1);
    EXPECT_EQ(stats.version(), 1u);
    EXPECT_EQ(stats.clocks(0), 1);
    EXPECT_EQ(stats.partial_pushes(), 1);
    // The worker's next push is applied whole.
    DirectStream next(shard, streamHeader(kPieces, 0, 1, 1));
    ASSERT_TRUE(next.chunk(0, a).ok());
    ASSERT_TRUE(next.chunk(1, b).ok());
    ASSERT_TRUE(next.finish(&reply).ok());
    EXPECT_EQ(pullShard(shard), (std::vector<float>{0, 1, 2, -3, 2}));
  }
}

// The whole path: the client's streamed push is cut after the shard took its first chunk (the
// connection fails; 96 MB, more than HTTP/2's 64 MB window, so that the rest is still on the
// client's side), the client retries it on a new connection, and each piece is applied once; the
// push counts once (async, sgd, lr 0.5).
TEST(PsStreamTest, AClientsPushCutMidStreamIsRetriedAndAppliedOnce) {
  std::vector<wire::PieceSpec> pieces;
  std::vector<std::vector<float>> start, grads;
  for (uint32_t k = 0; k < 6; ++k) {
    pieces.push_back(piece(k, "w" + std::to_string(k), uint64_t(1) << 22));  // 16 MB, the largest piece
    start.emplace_back(size_t(1) << 22, 0.0f);
    grads.emplace_back(size_t(1) << 22, 1.0f);
  }
  std::atomic<ShardServer*> cutter{nullptr};
  std::atomic<int> cuts{0};
  ServerOptions options;
  options.shard.afterChunk = [&](uint32_t, size_t nextPiece) {
    if (nextPiece == 1 && cuts++ == 0) cutter.load()->cutConnectionsForTesting();
  };
  TestServer server(options);
  cutter = server.server.get();
  auto client = server.client({.timeoutSeconds = 20, .quiet = true});
  expectInit(*client, pieces, start);
  test::Retries retries;
  auto pusher = server.client({.timeoutSeconds = 20, .quiet = true, .onRetry = retries.hook()});  // a chunk a piece
  wire::PushRequest request = protobufPush(pieces, grads, 0);
  request.set_want_values(false);
  wire::PushRequest header = request;
  for (auto& t : *header.mutable_values()) t.clear_data();
  FramedPush push;
  push.request = header;
  for (const auto& g : grads) push.payload.emplace_back(g);
  ASSERT_TRUE(pushStreams(push, kDefaultPushChunkBytes));
  wire::PushReply reply;
  const Status s = pusher->pushFramed(push, {}, &reply);
  retries.finished();
  ASSERT_TRUE(s.ok()) << s.message;
  EXPECT_TRUE(reply.applied()) << reply.dropped();
  EXPECT_GE(retries.all().size(), 1u) << "the client did not retry: the cut did not happen mid-push";
  // The retry found pieces in from the cut attempt, and passed over them.
  bool passedOver = false;
  for (const auto& line : server.log())
    passedOver = passedOver || line.find("sent its push of step 0 again") != std::string::npos;
  EXPECT_TRUE(passedOver);
  EXPECT_TRUE(eventually([&] { return statsOf(*client).partial_pushes() == 1; }));
  const auto stats = statsOf(*client);
  EXPECT_EQ(stats.applied(), 1);
  EXPECT_EQ(stats.version(), 1u);
  EXPECT_EQ(stats.clocks(0), 1);
  const auto values = pullAll(*client);
  size_t twice = 0, wrong = 0;
  for (const float v : values) {
    twice += v == -1.0f;
    wrong += v != -0.5f;
  }
  EXPECT_EQ(wrong, 0u) << twice << " of " << values.size() << " values took the gradient twice";
}

// The same under softsync 2 (pieces gathered as they arrive): the retry of a cut push adds to the
// group only the pieces the cut left out, so that each piece is averaged over one gradient of that
// push, and the push counts once in the group.
TEST(PsStreamTest, ARetryOfACutStreamIsGatheredOnce) {
  Shard shard(ShardOptions{.log = [](const std::string&) {}});
  wire::Policy policy = streamPolicy(wire::MODE_SOFTSYNC, wire::OPTIMIZER_SGD, 2);
  policy.set_softsync(2);
  wire::InitReply initReply;
  ASSERT_TRUE(shard.init(initOf(policy, kPieces, kStart), &initReply).ok());
  DirectStream cut(shard, streamHeader(kPieces, 0, 0, 0));
  ASSERT_TRUE(cut.chunk(0, {3, 3, 3}).ok());
  EXPECT_EQ(shard.refuseStream(*cut.stream, Status::error(Code::kCancelled, "cut")).code, Code::kCancelled);
  DirectStream retry(shard, streamHeader(kPieces, 0, 0, 0));
  ASSERT_TRUE(retry.chunk(0, {3, 3, 3}).ok());
  ASSERT_TRUE(retry.chunk(1, {6, 6}).ok());
  wire::PushReply reply;
  ASSERT_TRUE(retry.finish(&reply).ok());
  EXPECT_TRUE(reply.applied());
  EXPECT_EQ(reply.version(), 0u);  // one push of the two the group needs
  wire::PushRequest other = pushOf({{1, 1, 1}, {2, 2}}, 1);
  ASSERT_TRUE(shard.push(other, &reply).ok());
  EXPECT_EQ(reply.version(), 1u);
  // a: 1 - 0.5 * (3 + 1) / 2; b: -1 - 0.5 * (6 + 2) / 2.
  EXPECT_EQ(pullShard(shard), (std::vector<float>{0, 1, 2, -3, 2}));
  wire::StatsReply stats;
  ASSERT_TRUE(shard.stats(withProtocol<wire::StatsRequest>(), &stats).ok());
  EXPECT_EQ(stats.applied(), 2);
  EXPECT_EQ(stats.partial_pushes(), 1);
}

// A push no larger than one chunk goes as one message: a stream would have nothing to overlap.
// (The pushes of the tests above, 1.8 MB, stream under their chunks of 1 to 1.5 MB.)
TEST(PsStreamTest, OnlyAPushOfMoreThanOneChunkStreams) {
  const auto pieces = largePieces();  // 1800032 bytes in all
  const auto grads = randomValues(pieces, 4);
  const auto push = framedPush(protobufPush(pieces, grads, 0), grads);
  EXPECT_FALSE(pushStreams(push, kDefaultPushChunkBytes));
  EXPECT_FALSE(pushStreams(push, 1800032));
  EXPECT_TRUE(pushStreams(push, 1800031));
  EXPECT_TRUE(pushStreams(push, size_t(1) << 20));
  EXPECT_TRUE(pushStreams(push, (size_t(3) << 20) / 2));
  EXPECT_TRUE(pushStreams(push, size_t(700) << 10));
  EXPECT_FALSE(pushStreams(push, 0));
}

// The client's streamed push keeps the shard's authentication.
TEST(PsStreamTest, AStreamedPushNeedsTheToken) { expectAFramedPushNeedsTheToken(4); }

}  // namespace
}  // namespace cohort::ps
