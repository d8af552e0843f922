// Push+pull bandwidth of one parameter-server shard against raw loopback TCP, in separate
// processes, on the same payload: Strom's 14.6M-parameter model (58.4 MB of float32).
//
//   ps_bandwidth [MILLIONS_OF_FLOATS] [ROUNDS] [stream | framed | protobuf]
//
// Prints one JSON line per transport: {"transport": "tcp" | "grpc_stream" | "grpc" |
// "grpc_protobuf", "mb": ..., "gb_per_s": ...}, counting the bytes that went both ways (a push of
// the gradient, the parameters back): raw TCP first, then one gRPC path. `stream` (the default,
// what workers do with a push of more than --ps-push-chunk-mb): the zero-copy push as a stream of
// chunks of whole pieces (PushStream), each checked and applied by the shard while the next
// arrives; `framed` ("grpc"): the
// same push as one message (PushFramed, ps/frame.h); either way the gradient is sent from its own
// memory and the reply's floats are copied straight into the parameters. `protobuf`: the protobuf
// Push call with the same payload (the request built once, the reply left in the message), as
// before the zero-copy path. One gRPC measurement per process: the shard is forked, and a process
// cannot fork once gRPC's threads run.
#include "ps/client.h"
#include "ps/layout.h"
#include "ps/service.h"
#include "ps/wire.h"

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

}  // namespace

int main(int argc, char** argv) {
  const double millions = argc > 1 ? std::atof(argv[1]) : 14.6;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 10;
  const size_t floats = size_t(millions * 1e6);
  const double mb = double(floats * sizeof(float)) / 1e6;
  const std::string path = argc > 3 ? argv[3] : "stream";
  if (path != "stream" && path != "framed" && path != "protobuf") {
    std::fprintf(stderr, "ps_bandwidth: unknown argument '%s': the third is stream, framed or protobuf\n", argv[3]);
    return 2;
  }
  std::printf("{\"transport\": \"tcp\", \"mb\": %.1f, \"gb_per_s\": %.3f}\n", mb, rawTcp(floats * sizeof(float), rounds));
  std::fflush(stdout);
  const char* name = path == "stream" ? "grpc_stream" : path == "framed" ? "grpc" : "grpc_protobuf";
  std::printf("{\"transport\": \"%s\", \"mb\": %.1f, \"gb_per_s\": %.3f}\n", name, mb,
              grpcShard(floats, rounds, path != "protobuf", path == "stream" ? kDefaultPushChunkBytes : 0));
  return 0;
}
