// Summing flat float32 buffers over the ranks through a codec (--codec), for the strategies that
// exchange with collectives (allreduce, average).
//
// How each codec travels:
//   none       Gloo allreduce of the float32 buffer (ring: 2 (N-1)/N of it each way).
//   fp16       converted to binary16 (compress::floatsToHalf, saturating) and summed by Gloo's
//              allreduce in 16 bits (c10d's ProcessGroupGloo sums at::kHalf); asynchronous, so the
//              allreduce strategy keeps overlapping it with backward.
//   bf16       c10d 1.13's ProcessGroupGloo refuses at::kBFloat16 ("Invalid scalar type", even for
//              an allgather), so every rank's bf16 bits are allgathered in a kHalf-typed carrier
//              and summed in float32 on arrival ((N-1) buffers each way; for N = 2 the same bytes
//              as a ring allreduce). After backward, not overlapped.
//   sparse     (topk, threshold, onebit) each rank encodes its buffer (with its residual) into a
//              message, the messages are allgathered (Communicator::allgatherVariable) and each is
//              decoded and added on arrival, in rank order on every rank, so the replicas get the
//              same sum bit for bit. Bytes are counted from the messages' real sizes: this rank's
//              message once to each other rank, the others' messages in. (Gloo's allgather pads
//              every message to the longest; the padding is not counted.)
//
// Contract: like every collective, sum() must be called by every rank, for the same buffers, in
// the same order.
#pragma once

#include <cohort/communicator.h>

#include "compress/codec.h"

#include <torch/types.h>

#include <memory>
#include <vector>

namespace cohort {

class CompressedSum {
 public:
  // `buffers`: the length of each buffer this object will sum (one encoder, so one residual,
  // each).
  CompressedSum(std::shared_ptr<Communicator> comm, compress::CodecSpec spec, std::vector<int64_t> buffers);

  const compress::CodecSpec& spec() const { return spec_; }

  // Starts summing buffer `id` (contiguous float32 `flat`, this rank's contribution). fp16 and
  // none return the allreduce under way; call finish() after waiting on it. The other codecs do
  // the whole exchange here, write the sum into flat, and return an empty CommWork.
  CommWork start(size_t id, torch::Tensor flat);
  // After start()'s work is done: the sum into flat (fp16: converts back from 16 bits).
  void finish(size_t id, torch::Tensor flat);

  // Payload bytes of the exchanges since construction, as the codec put them on the wire.
  int64_t bytesSent() const { return bytesSent_; }
  int64_t bytesReceived() const { return bytesReceived_; }
  // Forgets every residual (after the warm-up, or when the parameters are replaced).
  void resetResiduals();
  // Buffer `id`'s residual (error feedback), empty for the codecs without one; setResidual() puts
  // a saved one back (InvalidArgument for another size).
  std::span<const float> residual(size_t id) const { return encoders_.at(id).residual(); }
  void setResidual(size_t id, std::span<const float> residual) { encoders_.at(id).setResidual(residual); }

 private:
  std::shared_ptr<Communicator> comm_;
  compress::CodecSpec spec_;
  std::vector<compress::Encoder> encoders_;
  std::vector<torch::Tensor> wire16_;  // fp16 / bf16: the 16-bit form of each buffer
  std::vector<uint8_t> message_;
  int64_t bytesSent_ = 0;
  int64_t bytesReceived_ = 0;
};

}  // namespace cohort
