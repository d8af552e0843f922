// The zero-copy framing of a push and its reply (the PushFramed call, protocol 2, and the
// PushStream call, protocol 3, whose messages are frames too): a small
// protobuf header, then the float32 payload as raw bytes, so that the payload travels as gRPC
// slices over the sender's own memory and is read where it lands on the receiver.
//
//   "CPSF" | u32 little-endian H | H bytes: the header (a PushRequest or PushReply whose values
//   carry key, numel and dtype FLOAT32, with empty data) | values[0]'s numel floats | values[1]'s | ...
//
// The payload's length is exactly 4 x the sum of the header values' numel; nothing else follows.
// Everything here is transport-free and treats what arrives as hostile (fuzz/frame_fuzz.cpp).
#pragma once

#include "ps/status.h"
#include "ps/wire.h"
#include "ps.pb.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cohort::ps {

// The gRPC method that carries frames, beside the protobuf ones of proto/ps.proto.
inline constexpr const char* kPushFramedMethod = "/cohort.ps.wire.ParameterServer/PushFramed";
// The same push as a client stream (protocol 3): a frame whose header is the PushRequest and whose
// payload is empty, then one frame per chunk of whole pieces (header: a PushChunk; payload: those
// pieces' floats). The reply is one frame, as PushFramed's.
inline constexpr const char* kPushStreamMethod = "/cohort.ps.wire.ParameterServer/PushStream";
inline constexpr char kFrameMagic[4] = {'C', 'P', 'S', 'F'};
inline constexpr size_t kFramePrefixBytes = 8;
// A header holds piece names and row lists at most; a larger one is refused before it is copied.
inline constexpr uint32_t kMaxFrameHeaderBytes = 16u << 20;

// The payload of a received frame: its bytes as they lie in the receiver's buffers (gRPC's
// slices), which the caller keeps alive while it reads them.
class FramePayload {
 public:
  FramePayload() = default;
  explicit FramePayload(std::vector<std::span<const uint8_t>> parts);

  size_t size() const { return size_; }
  // `count` floats from byte `offset` (offset + 4 count <= size()): a view into the buffers when
  // they lie in one part at an address aligned for floats, else copied into scratch; and the index
  // of the first NaN or Inf among them (count when none), found as they are copied, part by part
  // while each is in cache, rather than in a pass of its own.
  std::span<const float> checkedFloats(size_t offset, size_t count, FloatScratch& scratch,
                                       size_t* firstNonFinite) const;
  // The same without the index.
  std::span<const float> floats(size_t offset, size_t count, FloatScratch& scratch) const;
  // Copies out.size() floats from byte `offset` into out.
  void copyFloats(size_t offset, std::span<float> out) const;
  // How many of the views floats() gave were in place (the rest were copied): for the benchmark.
  size_t inPlaceViews() const { return inPlace_; }

 private:
  std::vector<std::span<const uint8_t>> parts_;
  std::vector<size_t> starts_;  // byte offset of each part
  size_t size_ = 0;
  mutable size_t inPlace_ = 0;
};

// The prefix and header of a frame: "CPSF", the header's length, the header. The payload is sent
// after it as it lies in memory.
std::string frameHead(const google::protobuf::MessageLite& header);

// Splits a received frame (its bytes in `chunks`, in order) into the header (parsed into
// `header`) and the payload, refusing a wrong magic, a truncated prefix or header, a header over
// kMaxFrameHeaderBytes or one that does not parse, naming the problem. The payload's length is
// checked against the header by checkFramedTensors.
Status parseFrame(std::span<const std::span<const uint8_t>> chunks, google::protobuf::MessageLite* header,
                  FramePayload* payload, const char* what);

// The header values of a frame against the pieces they must be (in order: key, FLOAT32, numel,
// empty data; or, where allowed, a piece's no-gradient value, which has no floats in the payload)
// and the payload's length (exactly their floats). The error names the first problem.
Status checkFramedTensors(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors,
                          std::span<const wire::PieceSpec> pieces, size_t payloadBytes, const char* what,
                          NoGradient noGradient = NoGradient::kRefused);

// The payload bytes the header values of a frame (checked by checkFramedTensors) announce.
uint64_t framedPayloadBytes(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors);

}  // namespace cohort::ps
