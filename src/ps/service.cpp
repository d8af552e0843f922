#include "ps/service.h"
#include "base/host_port.h"
#include "base/launcher_channel.h"
#include "base/thread_annotations.h"
#include "ps/call_auth.h"
#include "ps/grpc_frame.h"
#include "ps/service_connections.h"
#include "ps/service_refusals.h"

#include "ps/client.h"

#include <cohort/error.h>

#include "base/crypto.h"
#include "base/files.h"
#include "ps.grpc.pb.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <grpcpp/impl/codegen/rpc_service_method.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/server_builder.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

namespace cohort::ps {

namespace {

using Clock = std::chrono::system_clock;
using service_internal::Connections;
using service_internal::kInitCap;
using service_internal::Refusals;
using service_internal::Request;

// How long shutdown lets calls in flight finish before cancelling them.
constexpr auto kShutdownGrace = std::chrono::milliseconds(500);
// How long a connection may take to finish gRPC's handshake.
constexpr int kHandshakeTimeoutMs = 10'000;
// The method whose requests are held to kInitCap (TokenCheck reads it from a call's :path).
constexpr std::string_view kInitMethod = "/cohort.ps.wire.ParameterServer/Init";

// How many calls one connection may have open at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS;
// a client queues more). A worker has one call at a time to each shard.
constexpr int kMaxStreamsPerConnection = 16;

std::string readPem(const std::string& path, const char* flag) {
  std::string text = readNamedFile(flag, path);
  COHORT_CHECK(!text.empty(), InvalidArgument, flag, " ", path, " is empty");
  return text;
}

// The key and certificate of --tls-key and --tls-cert, read once and checked (a certificate, an
// unencrypted key that matches it); none without those flags.
std::optional<grpc::SslServerCredentialsOptions::PemKeyCertPair> readTlsFiles(const ServerOptions& o) {
  COHORT_CHECK(o.tlsCertFile.empty() == o.tlsKeyFile.empty(), InvalidArgument,
               "TLS needs both --tls-cert and --tls-key, got only ",
               o.tlsCertFile.empty() ? "--tls-key" : "--tls-cert");
  if (o.tlsCertFile.empty()) return std::nullopt;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  pair.cert_chain = readPem(o.tlsCertFile, "--tls-cert");
  pair.private_key = readPem(o.tlsKeyFile, "--tls-key");
  const std::string certificateProblem = crypto::pemCertificateProblem(pair.cert_chain);
  COHORT_CHECK(certificateProblem.empty(), InvalidArgument, "--tls-cert ", o.tlsCertFile, " ", certificateProblem);
  const std::string keyProblem = crypto::pemKeyProblem(pair.private_key, pair.cert_chain);
  COHORT_CHECK(keyProblem.empty(), InvalidArgument, "--tls-key ", o.tlsKeyFile, " ", keyProblem);
  return pair;
}

// The listening address ("host:port", "[v6]:port") is on loopback.
bool isLoopbackAddress(const std::string& address) {
  const auto hostPort = parseHostPort(address, /*allowPortZero=*/true);
  return isLoopbackHost(hostPort ? hostPort->host : address);
}

// The value of a call's metadata `key`, if it has one.
std::optional<std::string_view> metadataValue(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                              const char* key) {
  const auto found = metadata.find(key);
  if (found == metadata.end()) return std::nullopt;
  return std::string_view(found->second.data(), found->second.size());
}

// Checks the token on a call's metadata, before gRPC reads the request's body: a stranger's
// 512 MB push costs the shard its headers, not 512 MB; then the size the call declares
// (kRequestBytesKey) against the cap, so that an oversized request from a caller with the
// secret is refused unread too. gRPC runs it only under credentials with a security handshake
// (TLS, or its "local" credentials on loopback); plaintext on another interface is checked in the
// handler, after the read.
class TokenCheck final : public grpc::AuthMetadataProcessor {
 public:
  // `verifier`: null when the shard has no secret (the size is checked all the same).
  TokenCheck(std::shared_ptr<CallVerifier> verifier, std::shared_ptr<Refusals> refusals)
      : verifier_(std::move(verifier)), refusals_(std::move(refusals)) {}

  bool IsBlocking() const override { return false; }  // an HMAC and a set lookup: run it on gRPC's thread

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context, OutputMetadata* consumed,
                       OutputMetadata* response) override {
    const ProofCheck result = verifier_ == nullptr ? ProofCheck::kOk
                                                   : verifier_->check(metadataValue(metadata, "authorization")
                                                                          .value_or(std::string_view()));
    if (result == ProofCheck::kOk) {
      uint64_t declared = 0;
      const Request request = metadataValue(metadata, ":path") == kInitMethod ? Request::kInit : Request::kOther;
      const Status size = refusals_->checkDeclared(request, metadataValue(metadata, kRequestBytesKey), false, &declared);
      return size.ok() ? grpc::Status::OK : refusals_->reject(size);
    }
    // gRPC does not tell a processor the caller's address; the transport is what it knows.
    std::string peer = "a caller";
    if (context != nullptr) {
      for (const auto& value : context->FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME)) {
        peer = "a " + std::string(value.data(), value.size()) + " caller";
      }
    }
    return refusals_->refuse(peer, result);
  }

 private:
  const std::shared_ptr<CallVerifier> verifier_;
  const std::shared_ptr<Refusals> refusals_;
};

// TLS when the flags say so; else gRPC's local credentials on a loopback address (plaintext on
// the wire, but with the security handshake that lets TokenCheck run before a body is read);
// else plaintext. Sets `early` when TokenCheck is installed (it checks the proof when there is a
// verifier, and the declared size always).
std::shared_ptr<grpc::ServerCredentials> serverCredentials(
    const ServerOptions& o, const std::optional<grpc::SslServerCredentialsOptions::PemKeyCertPair>& tls,
    const std::shared_ptr<CallVerifier>& verifier, const std::shared_ptr<Refusals>& refusals, bool& early) {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (tls) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back(*tls);
    credentials = grpc::SslServerCredentials(ssl);
  } else if (isLoopbackAddress(o.address)) {
    credentials = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    early = false;
    return grpc::InsecureServerCredentials();  // gRPC aborts on a processor for these
  }
  early = true;
  credentials->SetAuthMetadataProcessor(std::make_shared<TokenCheck>(verifier, refusals));
  return credentials;
}

grpc::Status toGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code), s.message);
}

// The bytes a received frame carries.
uint64_t frameBytes(const IncomingFrame& frame) {
  uint64_t bytes = 0;
  for (const auto& c : frame.chunks) bytes += c.size();
  return bytes;
}

// The buffers that replies' floats are sent from, kept for later replies once gRPC has let them
// go. A buffer of the model's size made afresh for each reply was mapped, faulted in page by page
// and unmapped again every time (glibc serves a request that large for a thread from a heap of
// its own): a sixth of the shard's time in bench/ps_bandwidth (issue 30, item 4).
class ReplyBuffers {
 public:
  // An empty buffer, with the capacity of one that went before when there is one; it comes back
  // here when its last holder lets it go (a slice gRPC is still sending, on a thread of gRPC's).
  std::shared_ptr<std::vector<float>> take() {
    std::unique_ptr<std::vector<float>> buffer;
    {
      MutexLock lock(kept_->mu);
      if (!kept_->buffers.empty()) {
        buffer = std::move(kept_->buffers.back());
        kept_->buffers.pop_back();
      }
    }
    if (buffer == nullptr) buffer = std::make_unique<std::vector<float>>();
    buffer->clear();
    return std::shared_ptr<std::vector<float>>(buffer.release(), [kept = kept_](std::vector<float>* given) {
      std::unique_ptr<std::vector<float>> back(given);  // freed after the lock when not kept
      MutexLock lock(kept->mu);
      if (kept->buffers.size() < kKept) kept->buffers.push_back(std::move(back));
    });
  }

 private:
  // A worker has one call at a time to a shard, so as many replies overlap as workers push at
  // once: up to this many buffers (each the model's size) are kept, more are freed.
  static constexpr size_t kKept = 4;
  struct Kept {
    Kept() { buffers.reserve(kKept); }  // the deleter's push_back never allocates, so never throws
    Mutex mu;
    std::vector<std::unique_ptr<std::vector<float>>> buffers GUARDED_BY(mu);
  };
  const std::shared_ptr<Kept> kept_ = std::make_shared<Kept>();
};

class Service final : public wire::ParameterServer::Service {
 public:
  // `verifier` when the handler must check the proof itself (TokenCheck could not run); null
  // when there is no secret or TokenCheck already took the proof (it is good once only).
  // `connections` learns which connections carried a good proof; it outlives the service.
  Service(std::shared_ptr<Shard> shard, std::shared_ptr<CallVerifier> verifier, std::shared_ptr<Refusals> refusals,
          Connections* connections)
      : shard_(std::move(shard)),
        verifier_(std::move(verifier)),
        refusals_(std::move(refusals)),
        connections_(connections) {
    // The zero-copy push, beside proto/ps.proto's methods: its messages are frames, not protobuf.
    AddMethod(new grpc::internal::RpcServiceMethod(
        kPushFramedMethod, grpc::internal::RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<Service, IncomingFrame, OutgoingFrame, IncomingFrame, OutgoingFrame>(
            [](Service* service, grpc::ServerContext* c, const IncomingFrame* q, OutgoingFrame* r) {
              return service->PushFramed(c, q, r);
            },
            this)));
    AddMethod(new grpc::internal::RpcServiceMethod(
        kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING,
        new grpc::internal::ClientStreamingHandler<Service, IncomingFrame, OutgoingFrame>(
            [](Service* service, grpc::ServerContext* c, grpc::ServerReader<IncomingFrame>* q, OutgoingFrame* r) {
              return service->PushStream(c, q, r);
            },
            this)));
  }

  grpc::Status Init(grpc::ServerContext* c, const wire::InitRequest* q, wire::InitReply* r) override {
    return handle(c, Request::kInit, q->ByteSizeLong(), [&](uint64_t) {
      // Each worker holds a connection: a job the shard cannot keep them all for would lose the
      // last ones at connect (closed at once, "unreachable" until their timeout).
      const int64_t workers = q->policy().workers();
      const int64_t room = int64_t(connections_->maxConnections()) - Connections::kMaxUnproven;
      if (workers > room) {
        return Status::error(
            Code::kFailedPrecondition,
            "ps shard " + refusals_->name() + " keeps at most " + std::to_string(connections_->maxConnections()) +
                " connections (" + connections_->limitSource() + "), " + std::to_string(Connections::kMaxUnproven) +
                " of them for callers still proving the secret, and this job has " + std::to_string(workers) +
                " workers, one connection each: " + connections_->raiseLimitHint(workers));
      }
      Status s = shard_->init(*q, r);
      if (s.ok()) refusals_->setLayout(*q);
      return s;
    });
  }
  grpc::Status Pull(grpc::ServerContext* c, const wire::PullRequest* q, wire::PullReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->pull(*q, r); });
  }
  grpc::Status Push(grpc::ServerContext* c, const wire::PushRequest* q, wire::PushReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->push(*q, r); });
  }
  // The push's floats are read where gRPC's slices hold them; the reply's are one copy of the
  // shard's values, made under its lock into a kept buffer, sent from there without another.
  grpc::Status PushFramed(grpc::ServerContext* c, const IncomingFrame* q, OutgoingFrame* r) {
    return handle(c, Request::kOther, frameBytes(*q), [&](uint64_t) {
      wire::PushRequest request;
      FramePayload payload;
      if (Status s = parseFrame(q->chunks, &request, &payload, "push"); !s.ok()) {
        shard_->countRejected(s);
        return s;
      }
      wire::PushReply reply;
      std::shared_ptr<std::vector<float>> values = replyBuffers_.take();
      Status s = shard_->pushFramed(request, payload, &reply, values.get());
      if (!s.ok()) return s;
      r->head = frameHead(reply);
      if (!values->empty()) r->payload.push_back(*values);
      r->keepAlive = std::move(values);
      return s;
    });
  }
  // The push in chunks: each is checked as it arrives and, unless the push is to be dropped or
  // refused whole at the end, applied (or added to the step being gathered) by Shard::addChunk
  // while gRPC reads the next; the reply is made once the last is in. A chunk's slices are kept
  // only for a push handled at the end (Stream::keepsChunks), whose floats are read where they
  // landed. The token and the declared size were checked before the first chunk was read
  // (handle()); the bytes are counted against both as they come.
  grpc::Status PushStream(grpc::ServerContext* c, grpc::ServerReader<IncomingFrame>* q, OutgoingFrame* r) {
    return handle(c, Request::kOther, std::nullopt, [&](uint64_t declared) {
      std::vector<std::unique_ptr<IncomingFrame>> received;
      auto refuse = [&](const Status& s) {
        shard_->countRejected(s);
        return s;
      };
      received.push_back(std::make_unique<IncomingFrame>());
      if (!q->Read(received.back().get())) {
        return refuse(Status::error(Code::kInvalidArgument, "push stream: it ended before its header"));
      }
      uint64_t bytes = frameBytes(*received.back());
      if (Status s = refusals_->checkRead(Request::kOther, bytes, declared); !s.ok()) return refuse(s);
      wire::PushRequest request;
      FramePayload none;
      if (Status s = parseFrame(received.back()->chunks, &request, &none, "push stream"); !s.ok()) return refuse(s);
      if (none.size() != 0) {
        return refuse(Status::error(Code::kInvalidArgument, "push stream: its header frame carries " +
                                                                std::to_string(none.size()) +
                                                                " payload bytes; the floats belong in the chunks"));
      }
      std::unique_ptr<Shard::Stream> stream;
      if (Status s = shard_->beginStream(request, &stream); !s.ok()) return s;
      auto refuseStream = [&](const Status& s) { return shard_->refuseStream(*stream, s); };
      for (;;) {
        auto frame = std::make_unique<IncomingFrame>();
        if (!q->Read(frame.get())) break;
        bytes += frameBytes(*frame);
        if (Status s = refusals_->checkRead(Request::kOther, bytes, declared); !s.ok()) return refuseStream(s);
        wire::PushChunk chunk;
        FramePayload payload;
        if (Status s = parseFrame(frame->chunks, &chunk, &payload, "push chunk"); !s.ok()) return refuseStream(s);
        if (Status s = shard_->addChunk(*stream, chunk, payload); !s.ok()) return s;
        if (stream->keepsChunks()) received.push_back(std::move(frame));
      }
      if (c->IsCancelled()) {
        return refuseStream(Status::error(Code::kCancelled, "push stream: cancelled by the worker (or its connection "
                                                            "broke) after " + std::to_string(stream->nextPiece) +
                                                            " of " + std::to_string(stream->pieces.size()) +
                                                            " pieces"));
      }
      wire::PushReply reply;
      std::shared_ptr<std::vector<float>> values = replyBuffers_.take();
      Status s = shard_->finishStream(*stream, &reply, values.get());
      if (!s.ok()) return s;
      r->head = frameHead(reply);
      if (!values->empty()) r->payload.push_back(*values);
      r->keepAlive = std::move(values);
      return s;
    });
  }
  grpc::Status Done(grpc::ServerContext* c, const wire::DoneRequest* q, wire::DoneReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->done(*q, r); });
  }
  grpc::Status Stats(grpc::ServerContext* c, const wire::StatsRequest* q, wire::StatsReply* r) override {
    return handle(c, Request::kOther, q->ByteSizeLong(), [&](uint64_t) { return shard_->stats(*q, r); });
  }

 private:
  // Runs `call` (given the bytes the call declared) once the call has shown the proof and its size
  // is within the cap: `read`, the bytes of a unary call's request, which gRPC has read whole by
  // now; nullopt for a stream, whose handler starts before its first message is read.
  template <typename Call>
  grpc::Status handle(grpc::ServerContext* context, Request request, std::optional<uint64_t> read, const Call& call) {
    refusals_->trimIfWanted();
    // Where TokenCheck cannot run (plaintext off loopback), this is the check, after gRPC has
    // read the body.
    if (const ProofCheck result = authorized(*context); result != ProofCheck::kOk) {
      refusals_->wantTrim();
      return refusals_->refuse(context->peer(), result);
    }
    connections_->prove(context->peer());
    // TokenCheck checked the declaration too where it runs; the cap may have changed since (an
    // Init came in between), and a stream's is checked here before any of it is read.
    uint64_t declared = 0;
    if (Status s = refusals_->checkDeclared(request, metadataValue(context->client_metadata(), kRequestBytesKey),
                                            read.has_value(), &declared);
        !s.ok()) {
      return refusals_->reject(s);
    }
    if (read) {
      if (Status s = refusals_->checkRead(request, *read, declared); !s.ok()) return refusals_->reject(s);
    }
    try {
      const Status status = call(declared);
      // The shard's own UNAVAILABLE (not initialized yet), told apart from a transport's: a
      // client's retry window restarts when the shard answers (makeGrpcClient).
      if (status.code == Code::kUnavailable) context->AddTrailingMetadata(kShardAnsweredKey, "1");
      return toGrpc(status);
    } catch (const std::exception& e) {
      // Out of memory for a large Init, say: the caller gets the reason, the shard stays up.
      refusals_->wantTrim();
      return grpc::Status(grpc::StatusCode::INTERNAL, "ps shard " + refusals_->name() + ": " + e.what());
    }
  }

  ProofCheck authorized(const grpc::ServerContext& context) const {
    if (verifier_ == nullptr) return ProofCheck::kOk;
    const auto header = metadataValue(context.client_metadata(), "authorization");
    if (!header) return ProofCheck::kMissing;
    return verifier_->check(*header);
  }

  const std::shared_ptr<Shard> shard_;
  const std::shared_ptr<CallVerifier> verifier_;
  const std::shared_ptr<Refusals> refusals_;
  Connections* const connections_;
  ReplyBuffers replyBuffers_;
};

}  // namespace

// What gRPC may hold for requests being read: its resource quota. It is not what refuses a large
// request (the caps are): past it gRPC cancels streams of other connections too, the oldest
// first, so an oversized body took the job's workers' pushes down with it (issue 30). It only
// keeps gRPC from taking the machine: half its memory, or of the cgroup's limit if lower, and at
// least what one Init may carry.
size_t requestQuotaBytesForMachine() {
  uint64_t memory = uint64_t(::sysconf(_SC_PHYS_PAGES)) * uint64_t(::sysconf(_SC_PAGESIZE));
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    uint64_t limit = 0;
    if (in >> limit && limit > 0) memory = std::min(memory, limit);  // "max" does not parse: no limit
  }
  return size_t(std::max(memory / 2, kInitCap));
}

struct ShardServer::Impl {
  grpc::ResourceQuota quota{"cohort ps shard"};
  size_t quotaBytes = requestQuotaBytesForMachine();
  std::shared_ptr<Shard> shard;
  std::shared_ptr<Refusals> refusals;
  std::unique_ptr<Connections> connections;
  std::unique_ptr<Service> service;
  bool checksBeforeBody = false;  // TokenCheck runs
  bool tokenBeforeBody = false;   // ... and there is a token for it to check
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::once_flag stopped;
};

ShardServer::ShardServer(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  COHORT_CHECK(!options.authToken.empty() || isLoopbackAddress(options.address), InvalidArgument,
               "a parameter-server shard on ", options.address, " (not loopback) needs the job's secret, or anyone who "
               "reaches it could pull and push: give --auth-token / --auth-token-file / $COHORT_AUTH_TOKEN (the same "
               "random value on every process), or listen on 127.0.0.1");
  const auto verifier = options.authToken.empty() ? nullptr : std::make_shared<CallVerifier>(options.authToken);
  const auto tls = readTlsFiles(options);  // first: a bad flag fails before any work
  impl_->shard = std::make_shared<Shard>(options.shard);
  impl_->refusals = std::make_shared<Refusals>(impl_->shard, options.shard.name, options.shard.log, options.shard.env);
  const auto credentials = serverCredentials(options, tls, verifier, impl_->refusals, impl_->checksBeforeBody);
  impl_->tokenBeforeBody = impl_->checksBeforeBody && verifier != nullptr;
  impl_->connections = std::make_unique<Connections>(options.address, impl_->refusals, options.maxConnections);
  impl_->service = std::make_unique<Service>(impl_->shard, impl_->tokenBeforeBody ? nullptr : verifier, impl_->refusals,
                                             impl_->connections.get());
  grpc::ServerBuilder builder;
  builder.SetResourceQuota(impl_->quota.Resize(impl_->quotaBytes));
  // Connections come from Connections' accept loop, not from a port of gRPC's.
  auto acceptor = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, credentials);
  // The cap on a request is the shard's (Refusals): gRPC fixes its own limit when the server
  // starts, before the layout is known, and (1.51) checks it only once the whole message is read.
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  // A connection that never completes its handshake is closed after this (gRPC's default: 120 s).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  // Large frames and a deep window: tens of MB per call in 16 KB frames cost more than the copy.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrame);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2Window);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  builder.RegisterService(impl_->service.get());
  impl_->server = builder.BuildAndStart();
  COHORT_CHECK(impl_->server != nullptr, Error, "cannot serve on ", options.address, " (gRPC's log above says why)");
  impl_->connections->start(std::move(acceptor));
  impl_->port = impl_->connections->port();
}

ShardServer::~ShardServer() { shutdown(); }

int ShardServer::port() const { return impl_->port; }

std::shared_ptr<Shard> ShardServer::shard() const { return impl_->shard; }

bool ShardServer::checksTokenBeforeBody() const { return impl_->tokenBeforeBody; }

size_t ShardServer::requestQuotaBytes() const { return impl_->quotaBytes; }

uint64_t ShardServer::requestCapBytes() const { return impl_->refusals->cap(Request::kOther); }

int ShardServer::maxConnections() const { return impl_->connections->maxConnections(); }

void ShardServer::cutConnectionsForTesting() { impl_->connections->cutAll(); }

ConnectionCounts ShardServer::connections() const {
  const Connections::Counts c = impl_->connections->counts();
  return {.open = c.open, .unproven = c.unproven, .evicted = c.evicted, .dropped = c.dropped};
}

void ShardServer::trimFreedMemory() { impl_->refusals->trimIfWanted(); }

void ShardServer::shutdown() {
  // gRPC waits for running handlers even past the deadline; Shard::stop lets held pushes go.
  std::call_once(impl_->stopped, [this] {
    // No new connections; held pushes go next, so that gRPC's wait for running handlers is short.
    if (impl_->connections) impl_->connections->stop();
    if (impl_->shard) impl_->shard->stop("the parameter-server shard is shutting down");
    if (impl_->server) impl_->server->Shutdown(Clock::now() + kShutdownGrace);
  });
}

}  // namespace cohort::ps
