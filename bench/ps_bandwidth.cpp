// Push+pull bandwidth of one parameter-server shard against raw loopback TCP, in separate
// processes, on the same payload: Strom's 14.6M-parameter model (58.4 MB of float32).
//
//   ps_bandwidth [MILLIONS_OF_FLOATS] [ROUNDS] [stream | framed | protobuf | bare | bare-copy]
//
// Prints one JSON line per transport: {"transport": "tcp" | "grpc_stream" | "grpc" |
// "grpc_protobuf" | "grpc_bare" | "grpc_bare_copy", "mb": ..., "gb_per_s": ...}, counting the
// bytes that went both ways (a push of the gradient, the parameters back): raw TCP first, then one
// gRPC path. `stream` (the default, what workers do with a push of more than --ps-push-chunk-mb):
// the zero-copy push as a stream of chunks of whole pieces (PushStream), each checked and applied
// by the shard while the next arrives; `framed` ("grpc"): the same push as one message
// (PushFramed, ps/frame.h); either way the gradient is sent from its own memory and the reply's
// floats are copied straight into the parameters. `protobuf`: the protobuf Push call with the
// same payload (the request built once, the reply left in the message), as before the zero-copy
// path. `bare`: gRPC's own floor, nothing of cohort's on either end: the same bytes as one unary
// call of gRPC's generic API, set up as a shard and its client are (bareServe), the request sent
// from the gradient's memory and the reply's bytes copied into the parameters, the server
// replying from a buffer of its own and doing nothing with the request; `bare-copy`: the same,
// the server also copying the request out of gRPC's slices into a float buffer, the least a
// shard must do with a push. One gRPC measurement per process: the server is forked, and a
// process cannot fork once gRPC's threads run.
#include "ps/client.h"
#include "ps/layout.h"
#include "ps/service.h"
#include "ps/wire.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using namespace cohort::ps;

void sendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, 0);
    if (w <= 0) std::exit(3);
    p += w;
    n -= size_t(w);
  }
}

void recvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) std::exit(4);
    p += r;
    n -= size_t(r);
  }
}

int listenOn(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::listen(fd, 1);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

// The floor: a server process that reads the payload and writes it back, as a shard would.
double rawTcp(size_t bytes, int rounds) {
  int port = 0;
  const int listener = listenOn(&port);
  const pid_t child = ::fork();
  if (child == 0) {
    const int fd = ::accept(listener, nullptr, nullptr);
    std::vector<char> buffer(bytes);
    for (int r = 0; r < rounds + 1; ++r) {
      recvAll(fd, buffer.data(), bytes);
      sendAll(fd, buffer.data(), bytes);
    }
    ::_exit(0);
  }
  ::close(listener);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(uint16_t(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) std::exit(5);
  std::vector<char> out(bytes, 1), in(bytes);
  sendAll(fd, out.data(), bytes);  // warm-up round
  recvAll(fd, in.data(), bytes);
  const auto start = Clock::now();
  for (int r = 0; r < rounds; ++r) {
    sendAll(fd, out.data(), bytes);
    recvAll(fd, in.data(), bytes);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ::close(fd);
  ::waitpid(child, nullptr, 0);
  return 2.0 * double(bytes) * rounds / seconds / 1e9;
}

// A shard in its own process (async, plain SGD) and a worker pushing a gradient and getting the
// parameters back in the reply, as `--strategy ps` does every step.
double grpcShard(size_t floats, int rounds, bool framed, size_t chunkBytes) {
  int port = 0;
  ::close(listenOn(&port));  // a free port
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const pid_t child = ::fork();
  if (child == 0) {
    ServerOptions options;
    options.address = address;
    options.shard.log = [](const std::string&) {};
    keepFreedMemory();  // as `cohort ps` does (src/cli/shard_process.cpp)
    allocateFromOneHeap();
    std::_Exit(serveShard(options).exitStatus());
  }
  keepFreedMemory();
  auto client = makeGrpcClient(address, ClientOptions{.timeoutSeconds = 60, .quiet = true, .pushChunkBytes = chunkBytes});
  // The model as the worker's layout sends it: pieces of at most ps::kMaxPieceElements.
  std::vector<wire::PieceSpec> pieces;
  for (size_t at = 0; at < floats; at += kMaxPieceElements) {
    wire::PieceSpec piece;
    piece.set_key(uint32_t(pieces.size()));
    piece.set_name("w" + std::to_string(pieces.size()));
    piece.set_numel(std::min<size_t>(kMaxPieceElements, floats - at));
    pieces.push_back(piece);
  }
  std::vector<float> values(floats, 0.5f);
  wire::InitRequest init;
  init.set_protocol(kProtocolVersion);
  auto* p = init.mutable_policy();
  p->set_mode(wire::MODE_ASYNC);
  p->set_workers(1);
  p->set_softsync(1);
  p->set_staleness_lr(wire::STALENESS_LR_NONE);
  p->set_max_staleness(-1);
  p->set_push(wire::PUSH_GRADIENTS);
  p->set_optimizer(wire::OPTIMIZER_SGD);
  p->set_lr(0.001);
  p->set_timeout_s(60);
  size_t at = 0;
  for (const auto& piece : pieces) {
    *init.add_pieces() = piece;
    setTensor(init.add_values(), piece, values.data() + at);
    at += piece.numel();
  }
  wire::InitReply initReply;
  if (!client->init(init, &initReply).ok()) std::exit(6);
  std::vector<float> grad(floats, 0.001f);
  wire::PushRequest push;
  push.set_protocol(kProtocolVersion);
  push.set_want_values(true);
  at = 0;
  for (const auto& piece : pieces) {
    setTensor(push.add_values(), piece, grad.data() + at);
    at += piece.numel();
  }
  // The zero-copy push: headers only in the request, the floats from where they lie.
  FramedPush framedPush;
  framedPush.request = push;
  std::vector<FrameTarget> into;
  at = 0;
  for (int i = 0; i < framedPush.request.values_size(); ++i) {
    wire::Tensor* t = framedPush.request.mutable_values(i);
    t->clear_data();
    framedPush.payload.emplace_back(grad.data() + at, size_t(t->numel()));
    into.push_back({.key = t->key(), .values = std::span<float>(values.data() + at, size_t(t->numel()))});
    at += size_t(t->numel());
  }
  auto once = [&]() {
    wire::PushReply reply;
    Status s = framed ? client->pushFramed(framedPush, into, &reply) : client->push(push, &reply);
    if (!s.ok() || reply.values_size() != int(pieces.size())) {
      std::fprintf(stderr, "ps_bandwidth: push failed: %s\n", s.message.c_str());
      std::exit(7);
    }
  };
  once();  // warm-up
  const auto start = Clock::now();
  for (int r = 0; r < rounds; ++r) once();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  wire::DoneRequest done;
  done.set_protocol(kProtocolVersion);
  wire::DoneReply doneReply;
  client->done(done, &doneReply);
  ::waitpid(child, nullptr, 0);
  return 2.0 * double(floats * sizeof(float)) * rounds / seconds / 1e9;
}

// The bare calls' method: any name, as the generic service takes every call.
constexpr const char* kBareMethod = "/ps_bandwidth.Bare/Push";

// `values`' memory as one slice per piece of at most kMaxPieceElements floats, none copied, each
// holding a reference to `keepAlive` until gRPC lets it go: as SerializationTraits<OutgoingFrame>
// (ps/grpc_frame.h) sends a framed push's payload (a shard's reply goes as one slice), less the
// frame's header.
grpc::ByteBuffer wrapped(std::span<float> values, const std::shared_ptr<void>& keepAlive) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < values.size(); at += kMaxPieceElements) {
    const size_t n = std::min<size_t>(kMaxPieceElements, values.size() - at);
    slices.emplace_back(
        values.data() + at, n * sizeof(float), [](void* owner) { delete static_cast<std::shared_ptr<void>*>(owner); },
        new std::shared_ptr<void>(keepAlive));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Copies a received message's bytes into `out` (exactly its size, else false), slice by slice.
// The slices are let go before the buffer, which drops gRPC's last references where it sets up
// what that needs (see IncomingFrame, ps/grpc_frame.h).
bool copyOut(grpc::ByteBuffer& message, std::span<float> out) {
  if (message.Length() != out.size_bytes()) return false;
  {
    std::vector<grpc::Slice> slices;
    if (!message.Dump(&slices).ok()) return false;
    auto* to = reinterpret_cast<uint8_t*>(out.data());
    for (const auto& s : slices) {
      std::memcpy(to, s.begin(), s.size());
      to += s.size();
    }
  }
  message.Clear();
  return true;
}

// The bare server, in the forked child: answers `calls` calls, then exits. gRPC's async generic
// service on one thread that polls its completion queue and runs each step of a call (the next
// call is asked for as soon as one arrives); the shard's service is a sync one, whose handlers run
// on gRPC's polling threads as these steps do.
//
// Set up as ShardServer is (ps/service.cpp) in everything a call's bytes pass through: gRPC's
// local credentials on loopback (plaintext, no frame protection, as a shard's on 127.0.0.1), no
// message size limits, HTTP/2 frames of kHttp2MaxFrame and a kHttp2Window stream window, the same
// resource quota (requestQuotaBytesForMachine), no compression (gRPC's default: neither sets any),
// and keepFreedMemory and allocateFromOneHeap as `cohort ps` calls them. Left out, as nothing of one call at a time
// depends on them: the TokenCheck metadata processor (cohort work), the shard's own accept loop (Connections: a
// listening port of gRPC's here), the handshake timeout and the cap of 16 streams per connection.
[[noreturn]] void bareServe(const std::string& address, size_t floats, int calls, bool copyIn) {
  keepFreedMemory();
  allocateFromOneHeap();
  grpc::AsyncGenericService service;
  grpc::ResourceQuota quota("ps_bandwidth bare");
  grpc::ServerBuilder builder;
  builder.SetResourceQuota(quota.Resize(requestQuotaBytesForMachine()));
  builder.AddListeningPort(address, grpc::experimental::LocalServerCredentials(LOCAL_TCP));
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrame);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2Window);
  builder.RegisterAsyncGenericService(&service);
  std::unique_ptr<grpc::ServerCompletionQueue> queue = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) std::_Exit(8);
  // The reply: a buffer of the parameters' size, made once, sent from where it lies every time.
  auto reply = std::make_shared<std::vector<float>>(floats, 0.5f);
  std::vector<float> received(copyIn ? floats : 0);

  // One call, its tag on the queue; `step` is what its next event means.
  struct Call {
    enum class Step { kArrived, kRead, kAnswered };
    grpc::GenericServerContext context;
    grpc::GenericServerAsyncReaderWriter stream{&context};
    grpc::ByteBuffer request;
    Step step = Step::kArrived;
  };
  auto await = [&](std::unique_ptr<Call> call) {
    service.RequestCall(&call->context, &call->stream, queue.get(), queue.get(), call.get());
    call.release();  // the queue's now: deleted when its last event comes back
  };
  await(std::make_unique<Call>());
  for (int answered = 0; answered < calls;) {
    void* tag = nullptr;
    bool ok = false;
    if (!queue->Next(&tag, &ok)) std::_Exit(9);
    auto* call = static_cast<Call*>(tag);
    if (!ok) std::_Exit(10);  // a call broke: the client says why
    switch (call->step) {
      case Call::Step::kArrived:
        await(std::make_unique<Call>());
        call->step = Call::Step::kRead;
        call->stream.Read(&call->request, call);
        break;
      case Call::Step::kRead:
        if (copyIn && !copyOut(call->request, received)) std::_Exit(11);
        call->request.Clear();
        call->step = Call::Step::kAnswered;
        call->stream.WriteAndFinish(wrapped(*reply, reply), grpc::WriteOptions(), grpc::Status::OK, call);
        break;
      case Call::Step::kAnswered:
        delete call;
        ++answered;
        break;
    }
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  queue->Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (queue->Next(&tag, &ok)) delete static_cast<Call*>(tag);  // the call still awaited
  std::_Exit(0);
}

// gRPC's floor for the shard path: a bare server (bareServe) in its own process and a client that
// pushes the gradient's bytes from where they lie and copies the reply's into the parameters, as
// GrpcClient::pushFramed does: one unary call at a time, the calling thread waiting on a completion
// queue of its own, as its blocking call does. The channel is makeChannel's (src/ps/client.cpp) in
// what a call's bytes pass through: insecure credentials (the shard's local ones put nothing on
// the wire), no message size limits, kHttp2MaxFrame frames and a kHttp2Window window, no
// compression, and the deadline pushFramed gives a call at grpcShard's 60 s timeout. Left out: the
// reconnect back-offs (wait_for_ready instead, for the first call to outwait the server's start)
// and cohort's metadata (the call proof and the declared size).
double bareGrpc(size_t floats, int rounds, bool copyIn) {
  int port = 0;
  ::close(listenOn(&port));  // a free port
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const pid_t child = ::fork();
  if (child == 0) bareServe(address, floats, rounds + 1, copyIn);
  keepFreedMemory();
  auto grad = std::make_shared<std::vector<float>>(floats, 0.001f);
  std::vector<float> values(floats, 0.0f);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrame);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2Window);
  grpc::GenericStub stub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  grpc::CompletionQueue queue;
  auto once = [&]() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2 * 60 + 5));
    context.set_wait_for_ready(true);
    grpc::ByteBuffer reply;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&context, kBareMethod, wrapped(*grad, grad), &queue);
    call->StartCall();
    call->Finish(&reply, &status, call.get());
    void* tag = nullptr;
    bool ok = false;
    if (!queue.Next(&tag, &ok) || !ok || !status.ok()) {
      std::fprintf(stderr, "ps_bandwidth: bare call failed: %s\n", status.error_message().c_str());
      std::exit(7);
    }
    if (!copyOut(reply, values)) {
      std::fprintf(stderr, "ps_bandwidth: the bare reply has %zu bytes, not %zu\n", reply.Length(),
                   values.size() * sizeof(float));
      std::exit(7);
    }
  };
  once();  // warm-up
  const auto start = Clock::now();
  for (int r = 0; r < rounds; ++r) once();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || values.back() != 0.5f) {
    std::fprintf(stderr, "ps_bandwidth: the bare server ended with status %d, or its reply did not arrive\n", status);
    std::exit(7);
  }
  return 2.0 * double(floats * sizeof(float)) * rounds / seconds / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const double millions = argc > 1 ? std::atof(argv[1]) : 14.6;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 10;
  const size_t floats = size_t(millions * 1e6);
  const double mb = double(floats * sizeof(float)) / 1e6;
  const std::string path = argc > 3 ? argv[3] : "stream";
  const bool bare = path == "bare" || path == "bare-copy";
  if (path != "stream" && path != "framed" && path != "protobuf" && !bare) {
    std::fprintf(stderr,
                 "ps_bandwidth: unknown argument '%s': the third is stream, framed, protobuf, bare or bare-copy\n",
                 argv[3]);
    return 2;
  }
  std::printf("{\"transport\": \"tcp\", \"mb\": %.1f, \"gb_per_s\": %.3f}\n", mb, rawTcp(floats * sizeof(float), rounds));
  std::fflush(stdout);
  const char* name = path == "stream"     ? "grpc_stream"
                     : path == "framed"   ? "grpc"
                     : path == "protobuf" ? "grpc_protobuf"
                     : path == "bare"     ? "grpc_bare"
                                          : "grpc_bare_copy";
  const double gbPerS =
      bare ? bareGrpc(floats, rounds, path == "bare-copy")
           : grpcShard(floats, rounds, path != "protobuf", path == "stream" ? kDefaultPushChunkBytes : 0);
  std::printf("{\"transport\": \"%s\", \"mb\": %.1f, \"gb_per_s\": %.3f}\n", name, mb, gbPerS);
  return 0;
}
