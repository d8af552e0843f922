// A parameter-server shard (`cohort ps`, its own process, as `cohort launch --ps` starts one)
// while a job's workers train and another caller breaks the shard's rules. Issue 30: a 512 MB push
// with a good proof took a `cohort launch -n 2 --ps 1` job down in 11 of 15 runs (gRPC's memory
// quota, shared by every call, cancelled the workers' pushes with RST_STREAM 11) and crashed the
// shard in 2 (SIGSEGV in ~IncomingFrame). Here the bad call alone is refused, every worker finishes
// its steps, and the shard ends with status 0. Torch-free: the workers are threads with the gRPC
// client of ps/client.h; waits are on events (the shard's port line, the workers' steps, the calls'
// ends), each with a timeout.
#include "ps/call_auth.h"
#include "ps/client.h"
#include "ps/frame.h"
#include "ps/wire.h"

#include "test_util.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace cohort::ps {
namespace {

using namespace std::chrono_literals;

constexpr char kSecret[] = "attack-test-secret";

// `cohort ps` on 127.0.0.1, a free port (told on the launcher channel), with the job's secret.
// exec: the shell is replaced, so that the exit status is the shard's own.
std::string shardCommand() {
  return std::string("COHORT_AUTH_TOKEN=") + kSecret + " exec " + test::cohortBinary() +
         " ps --host 127.0.0.1 --port 0";
}

wire::PieceSpec piece(uint32_t key, const std::string& name, uint64_t numel) {
  wire::PieceSpec p;
  p.set_key(key);
  p.set_name(name);
  p.set_numel(numel);
  return p;
}

// 450,008 values (1.8 MB a push): the shard's cap is twice that and 1 MB.
const std::vector<wire::PieceSpec> kPieces{piece(0, "bias", 8), piece(1, "w[0:300000]", 300000),
                                           piece(2, "w[300000:450000]", 150000)};
constexpr uint64_t kValues = 450008;
constexpr uint64_t kCap = 2 * kValues * sizeof(float) + (1 << 20);

wire::InitRequest initRequest() {
  wire::InitRequest r;
  r.set_protocol(kProtocolVersion);
  auto* policy = r.mutable_policy();
  policy->set_mode("async");
  policy->set_workers(2);
  policy->set_optimizer("sgd");
  policy->set_lr(0.01);
  policy->set_push("gradients");
  policy->set_staleness_lr("none");
  policy->set_max_staleness(-1);
  policy->set_timeout_s(20);
  for (const auto& p : kPieces) {
    *r.add_pieces() = p;
    const std::vector<float> zeros(p.numel(), 0.0f);
    setTensor(r.add_values(), p, zeros.data());
  }
  return r;
}

// How the oversized push comes. Each is 512 MB of body (the size of issue 30's).
enum class Oversized {
  kDeclared,        // a framed push that declares its 512 MB: refused from its headers
  kStreamDeclared,  // a streamed push that declares its 512 MB: refused from its headers
  kUndeclared,      // a protobuf push that declares nothing (not cohort's client): refused likewise
  kLying,           // a framed push that declares 4 KB: read whole, then refused
};
constexpr uint64_t k512MB = uint64_t(512) << 20;

const char* describe(Oversized o) {
  switch (o) {
    case Oversized::kDeclared: return "framed, declared";
    case Oversized::kStreamDeclared: return "streamed, declared";
    case Oversized::kUndeclared: return "protobuf, undeclared";
    case Oversized::kLying: return "framed, declaring 4 KB";
  }
  return "?";
}

// Sends the oversized push with a good proof, on a connection of its own (other channel
// arguments than the workers' clients), and returns how the shard answered.
grpc::Status sendOversized(const std::string& address, Oversized how) {
  constexpr size_t kBlock = 1 << 20;
  static const std::vector<char> block(kBlock, 'x');
  std::vector<grpc::Slice> slices(k512MB / kBlock, grpc::Slice(block.data(), block.size(), grpc::Slice::STATIC_SLICE));
  const grpc::ByteBuffer body(slices.data(), slices.size());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  context.AddMetadata("authorization", makeCallProof(kSecret));
  if (how != Oversized::kUndeclared) {
    context.AddMetadata(kRequestBytesKey, std::to_string(how == Oversized::kLying ? 4096 : k512MB));
  }
  grpc::ByteBuffer reply;
  if (how == Oversized::kStreamDeclared) {
    const grpc::internal::RpcMethod method(kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, channel);
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method, &context, &reply));
    writer->Write(body);
    writer->WritesDone();
    return writer->Finish();
  }
  const char* path = how == Oversized::kUndeclared ? "/cohort.ps.wire.ParameterServer/Push" : kPushFramedMethod;
  const grpc::internal::RpcMethod method(path, grpc::internal::RpcMethod::NORMAL_RPC, channel);
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer, grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), method, &context, body, &reply);
}

// What the shard must answer, and the words its message must hold.
void expectRefused(const grpc::Status& s, Oversized how) {
  const std::string& m = s.error_message();
  if (how == Oversized::kUndeclared) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << m;
    EXPECT_NE(m.find("without cohort-request-bytes"), std::string::npos) << m;
    return;
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << m;
  EXPECT_NE(m.find("a request of " + std::to_string(k512MB) + " bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("cap of " + std::to_string(kCap) + " bytes"), std::string::npos) << m;
  if (how == Oversized::kLying) {
    EXPECT_NE(m.find("it declared 4096"), std::string::npos) << m;
  } else {
    EXPECT_NE(m.find("its body was not read"), std::string::npos) << m;
  }
}

// Steps the workers take, and when the attack may start and must have ended.
struct Progress {
  std::mutex mu;
  std::condition_variable changed;
  int steps[2] = {0, 0};
  bool attackEnded = false;

  void step(int worker) {
    std::lock_guard<std::mutex> lock(mu);
    ++steps[worker];
    changed.notify_all();
  }
  bool waitForSteps(int n) {
    std::unique_lock<std::mutex> lock(mu);
    return changed.wait_for(lock, 60s, [&] { return steps[0] >= n && steps[1] >= n; });
  }
  void endAttack() {
    std::lock_guard<std::mutex> lock(mu);
    attackEnded = true;
    changed.notify_all();
  }
  bool ended() {
    std::lock_guard<std::mutex> lock(mu);
    return attackEnded;
  }
};

// One worker: framed pushes of small gradients, each answered with the new values, until the
// attack has ended and it has taken kStepsAfter more steps; then Done. Returns the first failure,
// or nullopt when every call succeeded.
constexpr int kStepsBefore = 2;
constexpr int kStepsAfter = 3;
std::optional<std::string> work(const std::string& address, int worker, Progress& progress) {
  // Worker 1 streams its pushes in 1 MB chunks (PushStream), worker 0 sends each as one message.
  auto client = makeGrpcClient(address, {.authToken = kSecret,
                                         .timeoutSeconds = 20,
                                         .quiet = true,
                                         .pushChunkBytes = worker == 1 ? size_t(1) << 20 : kDefaultPushChunkBytes});
  std::vector<std::vector<float>> grads, values;
  std::vector<FrameTarget> into;
  for (const auto& p : kPieces) {
    grads.emplace_back(p.numel(), 0.001f * float(worker + 1));
    values.emplace_back(p.numel());
  }
  for (size_t i = 0; i < kPieces.size(); ++i) into.push_back({.key = kPieces[i].key(), .values = values[i]});
  int after = 0;
  for (int64_t clock = 0; after < kStepsAfter; ++clock) {
    const bool ended = progress.ended();
    FramedPush push;
    push.request.set_protocol(kProtocolVersion);
    push.request.set_worker(uint32_t(worker));
    push.request.set_clock(clock);
    push.request.set_samples(32);
    push.request.set_want_values(true);
    for (size_t i = 0; i < kPieces.size(); ++i) {
      auto* t = push.request.add_values();
      t->set_key(kPieces[i].key());
      t->set_numel(kPieces[i].numel());
      t->set_dtype(wire::FLOAT32);
      push.payload.emplace_back(grads[i]);
    }
    wire::PushReply reply;
    const Status s = client->pushFramed(push, into, &reply);
    if (!s.ok()) return "push " + std::to_string(clock) + ": " + codeName(s.code) + ": " + s.message;
    if (!reply.applied()) return "push " + std::to_string(clock) + " was not applied";
    progress.step(worker);
    if (ended) ++after;
  }
  wire::DoneRequest done;
  done.set_protocol(kProtocolVersion);
  done.set_worker(uint32_t(worker));
  wire::DoneReply reply;
  const Status s = client->done(done, &reply);
  if (!s.ok()) return std::string("done: ") + codeName(s.code) + ": " + s.message;
  return std::nullopt;
}

// The "Done when": an oversized push refused while two workers train, 20 times in a
// row (each of the four ways five times), every worker finishing its steps and the shard ending
// with status 0 each time.
TEST(PsAttackTest, AnOversizedPushIsRefusedAloneWhileTwoWorkersTrain) {
  constexpr int kRounds = 20;
  const auto started = std::chrono::steady_clock::now();
  for (int round = 0; round < kRounds; ++round) {
    const Oversized how = Oversized(round % 4);
    SCOPED_TRACE("round " + std::to_string(round) + ": " + describe(how));
    test::Process shard(shardCommand());
    const int port = shard.port(std::chrono::seconds(60));
    ASSERT_GT(port, 0) << shard.output();
    const std::string address = "127.0.0.1:" + std::to_string(port);
    {
      auto chief = makeGrpcClient(address, {.authToken = kSecret, .timeoutSeconds = 20, .quiet = true});
      wire::InitReply reply;
      const Status s = chief->init(initRequest(), &reply);
      ASSERT_TRUE(s.ok()) << codeName(s.code) << ": " << s.message;
    }

    Progress progress;
    std::vector<std::future<std::optional<std::string>>> workers;
    for (int w = 0; w < 2; ++w) {
      workers.push_back(std::async(std::launch::async, [&, w] { return work(address, w, progress); }));
    }
    const bool training = progress.waitForSteps(kStepsBefore);
    grpc::Status refused;
    if (training) refused = sendOversized(address, how);
    progress.endAttack();
    for (int w = 0; w < 2; ++w) {
      ASSERT_EQ(workers[size_t(w)].wait_for(120s), std::future_status::ready) << "worker " << w << " did not end";
      const std::optional<std::string> failure = workers[size_t(w)].get();
      EXPECT_FALSE(failure.has_value()) << "worker " << w << ": " << *failure;
    }
    ASSERT_TRUE(training) << "the workers did not take their first steps";
    expectRefused(refused, how);
    const test::CommandResult ended = shard.wait(std::chrono::seconds(60));
    EXPECT_EQ(ended.exitCode, 0) << ended.output;
    if (HasFailure()) break;
  }
  std::fprintf(stderr, "%d rounds in %.1f s\n", kRounds,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
}

}  // namespace
}  // namespace cohort::ps
