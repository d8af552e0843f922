// libFuzzer target: arbitrary bytes as a PushRequest, through the wire checks and a live Shard,
// float32 values or a compressed (codec) message.
// A shard takes pushes from anyone who can reach it (and holds the token), so a push must never
// crash it, whatever it carries. Built by fuzz/CMakeLists.txt; run by the ps_push_fuzz test.
#include "ps/shard.h"
#include "ps/wire.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using namespace cohort::ps;

wire::PieceSpec spec(uint32_t key, const char* name, uint64_t numel) {
  wire::PieceSpec p;
  p.set_key(key);
  p.set_name(name);
  p.set_numel(numel);
  return p;
}

const std::vector<wire::PieceSpec>& pieces() {
  static const std::vector<wire::PieceSpec> kPieces{spec(0, "bias", 1), spec(1, "small", 7), spec(2, "weight", 300)};
  return kPieces;
}
constexpr size_t kTotal = 1 + 7 + 300;

[[noreturn]] void fail(const char* why) {
  std::fprintf(stderr, "push_fuzz: %s\n", why);
  std::abort();
}

// What checkTensors lets through must decode to exactly the pieces' floats, all finite.
void checkDecoding(const wire::PushRequest& request) {
  if (!checkProtocol(request.protocol()).ok()) return;
  if (!request.compressed().empty()) {
    std::vector<float> floats;
    if (!decodeCompressed(request.compressed(), pieces(), true, "push", floats).ok()) return;
    if (floats.size() != kTotal) fail("decodeCompressed passed a push that does not decode to 308 floats");
    for (float v : floats) {
      if (!std::isfinite(v)) fail("decodeCompressed passed a non-finite value");
    }
    return;
  }
  if (!checkTensors(request.values(), pieces(), true, "push").ok()) return;
  std::vector<float> floats;
  for (const auto& t : request.values()) appendFloats(t, floats);
  if (floats.size() != kTotal) fail("checkTensors passed a push that does not decode to 308 floats");
  for (float v : floats) {
    if (!std::isfinite(v)) fail("checkTensors passed a non-finite value");
  }
}

// One shard for the whole run, as a server would have: state carries from input to input.
// Async mode never holds a push, so no input can block.
Shard& shard() {
  static Shard* instance = [] {
    auto* s = new Shard(ShardOptions{.name = "fuzz", .checkpointDir = "", .log = [](const std::string&) {}});
    wire::InitRequest init;
    init.set_protocol(kProtocolVersion);
    wire::Policy* p = init.mutable_policy();
    p->set_mode(wire::MODE_ASYNC);
    p->set_workers(1);
    p->set_optimizer(wire::OPTIMIZER_SGD);
    p->set_lr(0.1);
    p->set_push(wire::PUSH_GRADIENTS);
    p->set_staleness_lr(wire::STALENESS_LR_NONE);
    p->set_max_staleness(-1);
    p->set_timeout_s(5);
    const std::vector<float> zeros(300, 0.0f);
    for (const auto& piece : pieces()) {
      *init.add_pieces() = piece;
      setTensor(init.add_values(), piece, zeros.data());
    }
    wire::InitReply reply;
    if (!s->init(init, &reply).ok()) fail("the fuzz shard's own Init was refused");
    return s;
  }();
  return *instance;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  wire::PushRequest request;
  if (size > INT32_MAX || !request.ParseFromArray(data, int(size))) return 0;
  checkDecoding(request);
  // Half the inputs (by length) get the right protocol, so the deeper checks are reached.
  if (size % 2 == 0) request.set_protocol(kProtocolVersion);
  request.set_worker(0);
  wire::PushReply reply;
  shard().push(request, &reply);
  return 0;
}
