// Frames (ps/frame.h) as gRPC messages: the client's and the service's private glue. gRPC calls
// SerializationTraits<T> to turn a message into a ByteBuffer and back; these make a frame's
// payload a slice over the sender's memory (no copy) and keep a received frame's buffer as it
// came, for the receiver to read in place.
#pragma once

#include "ps/frame.h"

#include <grpcpp/impl/codegen/serialization_traits.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cohort::ps {

// A frame to send: its prefix and header (frameHead), then `payload`'s floats in order, each
// handed to gRPC as a slice over that memory. `keepAlive` owns the memory: every slice holds a
// reference to it until gRPC lets the slice go, which may be after the call returned (a cancelled
// call's bytes can still sit in the transport).
struct OutgoingFrame {
  std::string head;
  std::vector<std::span<const float>> payload;
  std::shared_ptr<const void> keepAlive;
};

// A frame received: gRPC's buffer and its slices, held here, and the chunks of bytes the slices
// cover, in order. parseFrame reads the header and payload out of the chunks.
//
// The slices are kept, not only their bytes' addresses: a small slice is inlined, its bytes inside
// the grpc::Slice object itself. The buffer is kept too, so that the last reference to each
// slice's memory is dropped by gRPC: the memory of a received message is charged to the server's
// resource quota, and whoever drops the last reference gives it back, which may register a
// reclaimer with the quota and wake gRPC's reclamation loop. That needs the thread's
// grpc_core::ExecCtx, which gRPC's own threads and its API functions set up and a handler thread
// lacks: a grpc::Slice released there last crashed the shard (issue 30: SIGSEGV in ExecCtx::Run <-
// MaybeRegisterReclaimer <- grpc::Slice::~Slice). The ByteBuffer's destructor
// (grpc_byte_buffer_destroy) sets one up; `buffer` is declared first, so it goes last.
struct IncomingFrame {
  IncomingFrame() = default;
  IncomingFrame(IncomingFrame&&) = default;  // the slices stay where they are: the chunks stay valid
  IncomingFrame& operator=(IncomingFrame&&) = default;
  IncomingFrame(const IncomingFrame&) = delete;  // a copy's chunks would point into the original
  IncomingFrame& operator=(const IncomingFrame&) = delete;

  grpc::ByteBuffer buffer;
  std::vector<grpc::Slice> slices;
  std::vector<std::span<const uint8_t>> chunks;  // into the slices
};

}  // namespace cohort::ps

template <>
class grpc::SerializationTraits<cohort::ps::OutgoingFrame> {
 public:
  static grpc::Status Serialize(const cohort::ps::OutgoingFrame& frame, grpc::ByteBuffer* buffer, bool* ownBuffer) {
    std::vector<grpc::Slice> slices;
    slices.reserve(frame.payload.size() + 1);
    slices.emplace_back(frame.head);  // small: copied
    for (const auto& values : frame.payload) {
      if (values.empty()) continue;
      // gRPC calls release once it holds no reference to the slice any more.
      auto* owner = new std::shared_ptr<const void>(frame.keepAlive);
      slices.emplace_back(const_cast<float*>(values.data()), values.size_bytes(), &release, owner);
    }
    *buffer = grpc::ByteBuffer(slices.data(), slices.size());  // takes references, copies nothing
    *ownBuffer = true;
    return grpc::Status::OK;
  }

 private:
  static void release(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }
};

template <>
class grpc::SerializationTraits<cohort::ps::IncomingFrame> {
 public:
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer, cohort::ps::IncomingFrame* frame) {
    if (buffer == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "no payload");
    frame->chunks.clear();
    const grpc::Status dumped = buffer->Dump(&frame->slices);  // references to the slices, no copy
    frame->buffer.Swap(buffer);  // the frame takes gRPC's own references too (see IncomingFrame)
    buffer->Clear();
    if (!dumped.ok()) return dumped;
    for (const auto& s : frame->slices) frame->chunks.emplace_back(s.begin(), s.size());
    return grpc::Status::OK;
  }
};
