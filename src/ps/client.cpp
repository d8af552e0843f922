#include "ps/client.h"
#include "ps/call_auth.h"
#include "ps/grpc_frame.h"

#include "ps/shard.h"

#include <cohort/error.h>

#include "base/crypto.h"
#include "base/files.h"
#include "ps.grpc.pb.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <optional>
#include <thread>

namespace cohort::ps {

namespace {

using Clock = std::chrono::steady_clock;

// Back-off between attempts at an unavailable shard.
constexpr auto kFirstBackoff = std::chrono::milliseconds(50);
constexpr auto kMaxBackoff = std::chrono::milliseconds(2000);
// gRPC's own back-off between connection attempts while the shard is unreachable (gRPC's default
// grows to 2 minutes). A refused connection costs nothing; a shard that is back is then connected
// to within this (+20% jitter) of its listening.
constexpr auto kMaxReconnectBackoff = std::chrono::milliseconds(500);

const char* stateName(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE: return "IDLE";
    case GRPC_CHANNEL_CONNECTING: return "CONNECTING";
    case GRPC_CHANNEL_READY: return "READY";
    case GRPC_CHANNEL_TRANSIENT_FAILURE: return "TRANSIENT_FAILURE";
    case GRPC_CHANNEL_SHUTDOWN: return "SHUTDOWN";
  }
  return "unknown";
}

// "60", "1.5": seconds as a person would write them.
std::string seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g", s);
  return text;
}

std::string secondsSince(Clock::time_point from, Clock::time_point to) {
  return seconds(std::chrono::duration<double>(to - from).count());
}

Clock::duration toDuration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Copies `from` into `to` through its wire form, as a transport would.
template <typename Message>
bool roundTrip(const Message& from, Message* to) {
  std::string bytes;
  return from.SerializeToString(&bytes) && to->ParseFromString(bytes);
}

// A framed reply (its bytes in chunks) into `into`: the header checked against the targets, then
// the floats copied straight from the chunks into the targets; nothing written when it does not
// match. A malformed reply is the shard's fault, not the caller's: INTERNAL.
Status readFramedReply(std::span<const std::span<const uint8_t>> chunks, std::span<const FrameTarget> into,
                       wire::PushReply* reply) {
  wire::PushReply header;
  FramePayload payload;
  Status s = parseFrame(chunks, &header, &payload, "reply");
  if (s.ok()) {
    std::vector<wire::PieceSpec> expected(into.size());
    for (size_t i = 0; i < into.size(); ++i) {
      expected[i].set_key(into[i].key);
      expected[i].set_numel(into[i].values.size());
      expected[i].set_name("piece " + std::to_string(into[i].key));
    }
    s = checkFramedTensors(header.values(), expected, payload.size(), "reply");
  }
  if (!s.ok()) return Status::error(Code::kInternal, "malformed framed reply: " + s.message);
  size_t offset = 0;
  for (const auto& target : into) {
    payload.copyFloats(offset, target.values);
    offset += target.values.size_bytes();
  }
  *reply = std::move(header);
  return Status::Ok();
}

// Cuts bytes into chunks of uneven sizes (floats split across them, most not aligned), as a
// transport delivers a message.
std::vector<std::span<const uint8_t>> unevenChunks(const std::string& bytes) {
  std::vector<std::span<const uint8_t>> chunks;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t at = 0;
  for (size_t size = 4093; at < bytes.size(); size = size * 3 + 1) {
    const size_t n = std::min(size, bytes.size() - at);
    chunks.emplace_back(p + at, n);
    at += n;
  }
  return chunks;
}

// A push as PushStream's messages: the header frame (the request, no payload), then chunks of
// consecutive whole pieces of at most chunkBytes each (a larger piece alone), their payload the
// pieces' own memory.
std::vector<OutgoingFrame> streamFrames(const FramedPush& push, size_t chunkBytes) {
  std::vector<OutgoingFrame> frames;
  frames.push_back({.head = frameHead(push.request), .payload = {}, .keepAlive = push.keepAlive});
  const size_t n = push.payload.size();
  for (size_t k = 0; k < n;) {
    wire::PushChunk chunk;
    chunk.set_first_piece(uint32_t(k));
    OutgoingFrame frame{.head = {}, .payload = {}, .keepAlive = push.keepAlive};
    size_t bytes = 0;
    do {
      frame.payload.push_back(push.payload[k]);
      bytes += push.payload[k].size_bytes();
      ++k;
    } while (k < n && bytes + push.payload[k].size_bytes() <= chunkBytes);
    chunk.set_pieces(uint32_t(frame.payload.size()));
    frame.head = frameHead(chunk);
    frames.push_back(std::move(frame));
  }
  return frames;
}

// How many bytes a frame puts on the wire as one gRPC message.
size_t frameSize(const OutgoingFrame& frame) {
  size_t bytes = frame.head.size();
  for (const auto& values : frame.payload) bytes += values.size_bytes();
  return bytes;
}

// A frame's bytes in one string, as they would go to the wire.
std::string frameBytes(const OutgoingFrame& frame) {
  std::string bytes = frame.head;
  for (const auto& v : frame.payload) bytes.append(reinterpret_cast<const char*>(v.data()), v.size_bytes());
  return bytes;
}

class FakeClient : public ShardClient {
 public:
  FakeClient(std::shared_ptr<Shard> shard, std::string name, size_t pushChunkBytes)
      : shard_(std::move(shard)), name_(std::move(name)), pushChunkBytes_(pushChunkBytes) {}

  Status init(const wire::InitRequest& q, wire::InitReply* r) override { return call(&Shard::init, q, r); }
  Status pull(const wire::PullRequest& q, wire::PullReply* r) override { return call(&Shard::pull, q, r); }
  Status push(const wire::PushRequest& q, wire::PushReply* r) override { return call(&Shard::push, q, r); }
  Status done(const wire::DoneRequest& q, wire::DoneReply* r) override { return call(&Shard::done, q, r); }
  Status stats(const wire::StatsRequest& q, wire::StatsReply* r) override { return call(&Shard::stats, q, r); }
  std::string address() const override { return name_; }

  // Through the frames' bytes both ways, cut into chunks as a transport would deliver them.
  Status pushFramed(const FramedPush& push, std::span<const FrameTarget> into, wire::PushReply* reply) override {
    if (pushStreams(push, pushChunkBytes_)) return pushStream(push, into, reply);
    std::string sent = frameHead(push.request);
    for (const auto& v : push.payload) sent.append(reinterpret_cast<const char*>(v.data()), v.size_bytes());
    wire::PushRequest request;
    FramePayload payload;
    Status status = parseFrame(unevenChunks(sent), &request, &payload, "push");
    if (!status.ok()) {
      shard_->countRejected(status);
      return status;
    }
    wire::PushReply header;
    std::vector<float> values;
    status = shard_->pushFramed(request, payload, &header, &values);
    if (!status.ok()) return status;
    std::string back = frameHead(header);
    back.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    return readFramedReply(unevenChunks(back), into, reply);
  }

 private:
  // As the service's PushStream (which keeps a chunk's bytes only for a push handled at the end;
  // here every message's bytes are kept until the reply).
  Status pushStream(const FramedPush& push, std::span<const FrameTarget> into, wire::PushReply* reply) {
    const std::vector<OutgoingFrame> frames = streamFrames(push, pushChunkBytes_);
    std::vector<std::string> sent;
    for (const auto& f : frames) sent.push_back(frameBytes(f));
    wire::PushRequest request;
    FramePayload none;
    Status status = parseFrame(unevenChunks(sent[0]), &request, &none, "push stream");
    if (!status.ok()) {
      shard_->countRejected(status);
      return status;
    }
    std::unique_ptr<Shard::Stream> stream;
    if (status = shard_->beginStream(request, &stream); !status.ok()) return status;
    for (size_t i = 1; i < sent.size(); ++i) {
      wire::PushChunk chunk;
      FramePayload payload;
      if (status = parseFrame(unevenChunks(sent[i]), &chunk, &payload, "push chunk"); !status.ok()) {
        return shard_->refuseStream(*stream, status);
      }
      if (status = shard_->addChunk(*stream, chunk, payload); !status.ok()) return status;
    }
    wire::PushReply header;
    std::vector<float> values;
    if (status = shard_->finishStream(*stream, &header, &values); !status.ok()) return status;
    std::string back = frameHead(header);
    back.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    return readFramedReply(unevenChunks(back), into, reply);
  }

  // Like gRPC, the reply is filled only when the call succeeds.
  template <typename Request, typename Reply>
  Status call(Status (Shard::*method)(const Request&, Reply*), const Request& request, Reply* reply) {
    Request sent;
    if (!roundTrip(request, &sent)) return Status::error(Code::kInternal, "cannot serialize the request");
    Reply answer;
    Status status = (shard_.get()->*method)(sent, &answer);
    if (!status.ok()) return status;
    if (!roundTrip(answer, reply)) return Status::error(Code::kInternal, "cannot serialize the reply");
    return status;
  }

  std::shared_ptr<Shard> shard_;
  std::string name_;
  size_t pushChunkBytes_;
};

std::string readPem(const std::string& path) {
  std::string text = readNamedFile("--tls-ca", path);
  // Empty roots would make gRPC fall back to the system's, trusting what the user did not ask for.
  COHORT_CHECK(!text.empty(), InvalidArgument, "--tls-ca ", path, " is empty");
  const std::string problem = crypto::pemCertificateProblem(text);
  COHORT_CHECK(problem.empty(), InvalidArgument, "--tls-ca ", path, " ", problem);
  return text;
}

std::shared_ptr<grpc::Channel> makeChannel(const std::string& address, const ClientOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tlsCaFile.empty()) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = readPem(options.tlsCaFile);
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  // A push or pull carries a shard's whole slice of the model: tens of MB.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kHttp2MaxFrame);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2Window);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, int(kFirstBackoff.count()));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, int(kMaxReconnectBackoff.count()));
  return grpc::CreateCustomChannel(address, credentials, args);
}

class GrpcClient : public ShardClient {
 public:
  GrpcClient(std::string address, ClientOptions options)
      : address_(std::move(address)),
        options_(std::move(options)),
        channel_(makeChannel(address_, options_)),
        stub_(wire::ParameterServer::NewStub(channel_)),
        pushFramedMethod_(kPushFramedMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel_),
        pushStreamMethod_(kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, channel_) {}

  using Stub = wire::ParameterServer::Stub;
  Status init(const wire::InitRequest& q, wire::InitReply* r) override { return call(&Stub::Init, q, r); }
  Status pull(const wire::PullRequest& q, wire::PullReply* r) override { return call(&Stub::Pull, q, r); }
  Status push(const wire::PushRequest& q, wire::PushReply* r) override { return call(&Stub::Push, q, r); }
  Status done(const wire::DoneRequest& q, wire::DoneReply* r) override { return call(&Stub::Done, q, r); }
  Status stats(const wire::StatsRequest& q, wire::StatsReply* r) override { return call(&Stub::Stats, q, r); }
  std::string address() const override { return address_; }

  Status pushFramed(const FramedPush& push, std::span<const FrameTarget> into, wire::PushReply* reply) override {
    IncomingFrame in;
    Status status;
    if (pushStreams(push, options_.pushChunkBytes)) {
      // A retry sends the whole push again (the shard drops a duplicate by its clock).
      const std::vector<OutgoingFrame> frames = streamFrames(push, options_.pushChunkBytes);
      size_t bytes = 0;
      for (const auto& frame : frames) bytes += frameSize(frame);
      status = retrying(bytes, [&](grpc::ClientContext* context) {
        in = IncomingFrame();
        std::unique_ptr<grpc::ClientWriter<OutgoingFrame>> writer(
            grpc::internal::ClientWriterFactory<OutgoingFrame>::Create(channel_.get(), pushStreamMethod_, context,
                                                                       &in));
        // A failed write means the call is over (the shard refused a chunk, or the connection
        // broke): Finish() says why.
        for (const auto& frame : frames) {
          if (!writer->Write(frame)) break;
        }
        writer->WritesDone();
        return writer->Finish();
      });
    } else {
      const OutgoingFrame out{.head = frameHead(push.request), .payload = push.payload, .keepAlive = push.keepAlive};
      status = retrying(frameSize(out), [&](grpc::ClientContext* context) {
        in = IncomingFrame();
        return grpc::internal::BlockingUnaryCall<OutgoingFrame, IncomingFrame, OutgoingFrame, IncomingFrame>(
            channel_.get(), pushFramedMethod_, context, out, &in);
      });
    }
    if (!status.ok()) return status;
    const Status read = readFramedReply(in.chunks, into, reply);
    if (!read.ok()) return Status::error(read.code, "ps shard " + address_ + ": " + read.message);
    return read;
  }

 private:
  template <typename Request, typename Reply>
  Status call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Reply*), const Request& request,
              Reply* reply) {
    return retrying(request.ByteSizeLong(),
                    [&](grpc::ClientContext* context) { return (stub_.get()->*method)(context, request, reply); });
  }

  // One call (`attempt` makes it on the context it is given) of `requestBytes` (kRequestBytesKey),
  // retried while it fails with UNAVAILABLE. The one place where grpc::Status becomes a ps::Status.
  //
  // The failures come in spells of one kind: the shard unreachable (nothing of it answered: a
  // refused connection, a reset) or the shard refusing (its own UNAVAILABLE, which it marks with
  // kShardAnsweredKey). A spell begins with its first failure and ends with an answer of another
  // kind; each spell may last timeoutSeconds, the call's retries kRetryBoundTimeouts x that. So the
  // window restarts when the shard stops answering (a kill) and when it answers again (a restarted
  // shard's "not initialized yet"): a call that was waiting for the chief's Init when its shard
  // died still gets a whole window for the restart.
  template <typename Attempt>
  Status retrying(size_t requestBytes, const Attempt& attempt) {
    const double timeout = options_.timeoutSeconds;
    const double bound = kRetryBoundTimeouts * timeout;
    const auto start = Clock::now();
    auto backoff = std::chrono::duration_cast<Clock::duration>(kFirstBackoff);
    std::optional<bool> answering;  // the current spell's kind (shardAnswered); none before a failure
    auto spellStart = start;
    for (;;) {
      grpc::ClientContext context;
      // gRPC takes deadlines on the system clock only.
      // A shard may hold a push for up to its own timeout (a sync step, the ssp bound) before it
      // answers, so the call gets twice that and some: the shard names a lost worker first.
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::duration_cast<std::chrono::system_clock::duration>(2 * toDuration(timeout)) +
                           std::chrono::seconds(5));
      // A fresh proof per attempt: a shard takes each once.
      if (!options_.authToken.empty()) context.AddMetadata("authorization", makeCallProof(options_.authToken));
      context.AddMetadata(kRequestBytesKey, std::to_string(requestBytes));
      const grpc::Status status = attempt(&context);
      const auto now = Clock::now();
      if (status.ok()) {
        if (answering == false) say("ps shard " + address_ + " answers again after " + secondsSince(spellStart, now) + " s");
        return Status::Ok();
      }
      const auto code = Code(status.error_code());
      if (code == Code::kDeadlineExceeded) {
        return Status::error(code, "ps shard " + address_ + " did not answer within " +
                                       seconds(2 * timeout + 5) + " s: " + status.error_message());
      }
      if (code != Code::kUnavailable) return Status::error(code, status.error_message());
      const bool answered = context.GetServerTrailingMetadata().count(kShardAnsweredKey) > 0;
      if (answering != answered) {
        // A new spell: one line, its own window and back-off.
        const std::string what = " (" + status.error_message() + "); retrying for up to " + seconds(timeout) + " s";
        if (!answered) {
          say("ps shard " + address_ + " unreachable" + what);
        } else if (answering == false) {
          say("ps shard " + address_ + " answers again after " + secondsSince(spellStart, now) + " s, refusing" + what);
        } else {
          say("ps shard " + address_ + " unavailable" + what);
        }
        answering = answered;
        spellStart = now;
        backoff = std::chrono::duration_cast<Clock::duration>(kFirstBackoff);
      }
      const auto spell = now - spellStart;
      const auto call = now - start;
      const std::string raise = "; raise --timeout (now " + seconds(timeout) + " s)";
      if (spell >= toDuration(timeout)) {
        const std::string channel = answered ? "" : std::string(" (gRPC channel ") + stateName(channel_->GetState(false)) + ")";
        return Status::error(code, "ps shard " + address_ + (answered ? " refused the call for " : " unreachable for ") +
                                       secondsSince(spellStart, now) + " s: " + status.error_message() + channel + raise +
                                       (answered ? " if its chief needs longer to start" :
                                                   " if it needs longer to come back"));
      }
      if (call >= toDuration(bound)) {
        return Status::error(code, "ps shard " + address_ + ": gave up after " + secondsSince(start, now) +
                                       " s of retries (one call retries for at most " +
                                       std::to_string(kRetryBoundTimeouts) +
                                       " x --timeout; the shard came and went): " + status.error_message() + raise);
      }
      if (options_.onRetry) {
        options_.onRetry(RetryEvent{.shardAnswered = answered,
                                    .callSeconds = std::chrono::duration<double>(call).count(),
                                    .spellSeconds = std::chrono::duration<double>(spell).count()});
      }
      const auto pause = std::min({backoff, toDuration(timeout) - spell, toDuration(bound) - call});
      if (answered) {
        std::this_thread::sleep_for(pause);
      } else {
        waitForConnection(Clock::now() + pause);
      }
      backoff = std::min(backoff * 2, std::chrono::duration_cast<Clock::duration>(kMaxBackoff));
    }
  }

  // Waits until the channel is connected (READY) or `until`, whichever comes first. Waiting on the
  // channel's state, rather than sleeping, is what lets a connection attempt finish: gRPC learns
  // that a connect() ended only while some thread polls the channel, and a call made in
  // TRANSIENT_FAILURE fails at once without polling; with nobody waiting, only gRPC's backup
  // poller (every 5 s) saw the restarted shard, which left workers 5-10 s behind it and once lost
  // one (the fault table's ps-async shard row, docs/BENCHMARKS.md).
  // A channel that is READY already (a call failed on a connection that still stands) is not
  // waited on: that is a plain back-off, not a loop of immediate retries.
  void waitForConnection(Clock::time_point until) const {
    if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
      std::this_thread::sleep_until(until);
      return;
    }
    for (;;) {
      const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
      const auto left = until - Clock::now();
      if (state == GRPC_CHANNEL_READY || left <= Clock::duration::zero()) return;
      channel_->WaitForStateChange(
          state, std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(left));
    }
  }

  // One line through the Env, unless quiet.
  void say(const std::string& line) const {
    if (!options_.quiet) envOrStandard(options_.env).log(LogLevel::kInfo, line);
  }

  const std::string address_;
  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<Stub> stub_;
  const grpc::internal::RpcMethod pushFramedMethod_;
  const grpc::internal::RpcMethod pushStreamMethod_;
};

}  // namespace

bool pushStreams(const FramedPush& push, size_t chunkBytes) {
  if (chunkBytes == 0) return false;
  size_t bytes = 0;
  for (const auto& v : push.payload) bytes += v.size_bytes();
  return bytes > chunkBytes;
}

void keepFreedMemory() {
  ::mallopt(M_MMAP_MAX, 0);
  ::mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

void allocateFromOneHeap() { ::mallopt(M_ARENA_MAX, 1); }

std::unique_ptr<ShardClient> makeFakeClient(std::shared_ptr<Shard> shard, std::string name, size_t pushChunkBytes) {
  return std::make_unique<FakeClient>(std::move(shard), std::move(name), pushChunkBytes);
}

std::unique_ptr<ShardClient> makeGrpcClient(const std::string& address, const ClientOptions& options) {
  // Also bounds it so that deadlines stay representable.
  COHORT_CHECK(options.timeoutSeconds > 0 && options.timeoutSeconds <= 1e7, InvalidArgument,
               "the timeout for ps shard ", address, " must be between 0 and 1e7 s, got ", options.timeoutSeconds);
  return std::make_unique<GrpcClient>(address, options);
}

}  // namespace cohort::ps
