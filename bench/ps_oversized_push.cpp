// A push far over a shard's cap, sent with the job's secret from a connection of its own: what a
// buggy worker of the job (or anyone who read its environment) can send. bench/attack.py runs it
// against a training job's shards; tests/ps_attack_test.cpp is the test of the same.
//
//   COHORT_AUTH_TOKEN=... build/bench/ps_oversized_push HOST:PORT [--mb 512] [--declare honest|none|lie]
//                                                        [--method framed|stream|protobuf]
//
// honest: the call declares its size (cohort-request-bytes), as cohort's client does; none: it
// declares nothing, as a tool that is not cohort's; lie: it declares 4 KB. The body is `--mb` MB of
// one 1 MB block repeated (this process's memory stays small). Prints one JSON line: the status
// the shard answered, its message, and the seconds the call took. Torch-free.
#include "ps/call_auth.h"
#include "ps/client.h"
#include "ps/frame.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

std::string jsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

int usage() {
  std::fprintf(stderr,
               "usage: COHORT_AUTH_TOKEN=... ps_oversized_push HOST:PORT [--mb N] [--declare honest|none|lie] "
               "[--method framed|stream|protobuf]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string address = argv[1];
  long mb = 512;
  std::string declare = "honest", method = "framed";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mb") {
      mb = std::strtol(argv[i + 1], nullptr, 10);
    } else if (flag == "--declare") {
      declare = argv[i + 1];
    } else if (flag == "--method") {
      method = argv[i + 1];
    } else {
      return usage();
    }
  }
  if (mb <= 0 || mb > 4095 || (declare != "honest" && declare != "none" && declare != "lie") ||
      (method != "framed" && method != "stream" && method != "protobuf")) {
    return usage();
  }
  const char* secret = std::getenv("COHORT_AUTH_TOKEN");

  constexpr size_t kBlock = 1 << 20;
  static const std::vector<char> block(kBlock, 'x');
  std::vector<grpc::Slice> slices(size_t(mb), grpc::Slice(block.data(), block.size(), grpc::Slice::STATIC_SLICE));
  const grpc::ByteBuffer body(slices.data(), slices.size());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetInt("cohort.bench.oversized", 1);  // a connection of its own
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  if (secret != nullptr && *secret != '\0') context.AddMetadata("authorization", cohort::ps::makeCallProof(secret));
  if (declare != "none") {
    context.AddMetadata(cohort::ps::kRequestBytesKey, std::to_string(declare == "lie" ? 4096 : mb * kBlock));
  }

  const auto start = std::chrono::steady_clock::now();
  grpc::ByteBuffer reply;
  grpc::Status status;
  if (method == "stream") {
    const grpc::internal::RpcMethod rpc(cohort::ps::kPushStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING,
                                        channel);
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), rpc, &context, &reply));
    writer->Write(body);
    writer->WritesDone();
    status = writer->Finish();
  } else {
    const char* path = method == "protobuf" ? "/cohort.ps.wire.ParameterServer/Push" : cohort::ps::kPushFramedMethod;
    const grpc::internal::RpcMethod rpc(path, grpc::internal::RpcMethod::NORMAL_RPC, channel);
    status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer, grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(), rpc, &context, body, &reply);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("{\"mb\": %ld, \"declare\": %s, \"method\": %s, \"code\": %d, \"message\": %s, \"seconds\": %.3f}\n", mb,
              jsonString(declare).c_str(), jsonString(method).c_str(), int(status.error_code()),
              jsonString(status.error_message()).c_str(), seconds);
  return 0;
}
