// libFuzzer target: arbitrary bytes as a framed push (ps/frame.h, the PushFramed call), cut into
// chunks as gRPC's slices would deliver them, through parseFrame, checkFramedTensors and a live
// Shard's pushFramed; or (first byte >= 128) as the chunk messages of a streamed push (the
// PushStream call) after a valid header, through parseFrame and the Shard's beginStream, addChunk
// and finishStream. A frame comes from anyone who can reach the shard (and holds the token), so
// none may crash it or leave a non-finite value in it, and a stream that is refused anywhere must
// leave the pieces after its last accepted chunk bit for bit as they were (those of its accepted
// chunks are applied as they arrive; all of them, when the shard keeps the push for the end). Built by fuzz/CMakeLists.txt; run by the
// ps_frame_fuzz test on the seeds in fuzz/frame_corpus (written by fuzz/ps_frame_seeds.py).
#include "ps/frame.h"
#include "ps/shard.h"
#include "ps/wire.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
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
  std::fprintf(stderr, "ps_frame_fuzz: %s\n", why);
  std::abort();
}

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

// Bytes cut into chunks of chunkSize (the last shorter), each copied to its own allocation, so
// that reads past a chunk are caught.
struct Cut {
  std::vector<std::vector<uint8_t>> owned;
  std::vector<std::span<const uint8_t>> chunks;
  Cut(const uint8_t* data, size_t size, size_t chunkSize) {
    for (size_t at = 0; at < size; at += chunkSize) owned.emplace_back(data + at, data + std::min(size, at + chunkSize));
    for (const auto& c : owned) chunks.emplace_back(c.data(), c.size());
  }
};

std::vector<float> shardValues() {
  wire::PullRequest request;
  request.set_protocol(kProtocolVersion);
  wire::PullReply reply;
  if (!shard().pull(request, &reply).ok()) fail("the fuzz shard refused a pull");
  std::vector<float> out;
  for (const auto& t : reply.values()) appendFloats(t, out);
  return out;
}

// A streamed push: a valid header, then the messages of `data`, each a u16 little-endian length
// and that many bytes (a frame whose header should be a PushChunk), the last one cut short by the
// input's end. Refused anywhere: the pieces no accepted chunk carried are bit for bit as before
// (all of them when the shard kept the push for the end, a duplicate).
void streamedPush(const uint8_t* data, size_t size, size_t chunkSize) {
  wire::PushRequest request;
  request.set_protocol(kProtocolVersion);
  request.set_worker(0);
  request.set_samples(8);
  request.set_want_values(true);
  for (const auto& piece : pieces()) {
    auto* t = request.add_values();
    t->set_key(piece.key());
    t->set_numel(piece.numel());
    t->set_dtype(wire::FLOAT32);
  }
  const std::vector<float> before = shardValues();
  std::unique_ptr<Shard::Stream> stream;
  if (!shard().beginStream(request, &stream).ok()) fail("the fuzz shard refused a valid stream header");
  std::vector<Cut> messages;  // every message's bytes live until finishStream (the service may drop them sooner)
  bool refused = false;
  size_t accepted = 0;  // the pieces of the chunks accepted so far
  for (size_t at = 0; at + 2 <= size && !refused;) {
    const size_t length = std::min<size_t>(size_t(data[at]) | size_t(data[at + 1]) << 8, size - at - 2);
    messages.emplace_back(data + at + 2, length, chunkSize);
    at += 2 + length;
    wire::PushChunk chunk;
    FramePayload payload;
    refused = !parseFrame(messages.back().chunks, &chunk, &payload, "push chunk").ok() ||
              !shard().addChunk(*stream, chunk, payload).ok();
    if (!refused) accepted = stream->nextPiece;
  }
  wire::PushReply reply;
  std::vector<float> values;
  if (!refused && shard().finishStream(*stream, &reply, &values).ok()) {
    for (const float v : values) {
      if (!std::isfinite(v)) fail("the shard holds a non-finite value after a streamed push");
    }
    return;
  }
  const std::vector<float> after = shardValues();
  if (after.size() != before.size()) fail("a refused stream changed the layout");
  size_t untouched = 0;  // the first element no accepted chunk may have changed
  if (!stream->keepsChunks()) {
    for (size_t k = 0; k < accepted; ++k) untouched += size_t(pieces()[k].numel());
  }
  for (size_t i = 0; i < after.size(); ++i) {
    if (!std::isfinite(after[i])) fail("the shard holds a non-finite value after a refused stream");
  }
  if (std::memcmp(after.data() + untouched, before.data() + untouched, (after.size() - untouched) * sizeof(float)) != 0) {
    fail("a refused stream changed pieces none of its accepted chunks carried");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // The first byte chooses the mode (its top bit: a stream) and the chunk size (its low 7 bits:
  // 1..128 bytes), the rest is the frame or the stream's messages.
  const size_t chunkSize = size_t(data[0] & 0x7f) + 1;
  if (data[0] & 0x80) {
    streamedPush(data + 1, size - 1, chunkSize);
    return 0;
  }
  Cut cut(data + 1, size - 1, chunkSize);
  const auto& chunks = cut.chunks;

  wire::PushRequest request;
  FramePayload payload;
  if (!parseFrame(chunks, &request, &payload, "push").ok()) return 0;
  // What checkFramedTensors lets through reads back as exactly the pieces' floats.
  if (checkFramedTensors(request.values(), pieces(), payload.size(), "push").ok()) {
    if (payload.size() != kTotal * sizeof(float)) fail("checkFramedTensors passed a payload of another length");
    std::vector<float> copied(kTotal);
    FloatScratch scratch, checkedScratch;
    payload.copyFloats(0, copied);
    const auto view = payload.floats(0, kTotal, scratch);
    size_t bad = 0;
    const auto checked = payload.checkedFloats(0, kTotal, checkedScratch, &bad);
    for (size_t i = 0; i < kTotal; ++i) {
      if (std::memcmp(&view[i], &copied[i], sizeof(float)) != 0) fail("floats() and copyFloats() disagree");
      if (std::memcmp(&checked[i], &copied[i], sizeof(float)) != 0) fail("checkedFloats() and copyFloats() disagree");
    }
    if (bad != firstNonFinite(copied.data(), kTotal)) fail("checkedFloats() named another first non-finite float");
  }
  if (size % 2 == 0) request.set_protocol(kProtocolVersion);
  request.set_worker(0);
  wire::PushReply reply;
  std::vector<float> values;
  if (shard().pushFramed(request, payload, &reply, &values).ok() && request.want_values()) {
    if (values.size() != kTotal) fail("a framed reply without every value");
    for (const float v : values) {
      if (!std::isfinite(v)) fail("the shard holds a non-finite value after a framed push");
    }
  }
  return 0;
}
