// Summing flat float32 buffers over the ranks through a codec (--codec), for the strategies that
// exchange with collectives (allreduce, average).
//
// How each codec travels:
//   none       Gloo allreduce of the float32 buffer (ring: 2 (N-1)/N of it each way), launched
//              from the caller's thread.
//   fp16,bf16  a ring allreduce of this class's own, over point-to-point sends and receives: the
//              wire carries 16 bits, the sums are taken in float32. Reduce-scatter: in N-1 hops
//              each rank sends one chunk (its own float32 values rounded to 16 bits, or the partial
//              sum it received last hop plus its own, rounded), receives the next chunk, adds it to
//              its own float32 values and rounds. The rank that adds last owns that chunk's sum,
//              rounded once more to 16 bits. Allgather: N-1 hops pass the owners' 16-bit sums
//              around unchanged, and every rank converts the same 16-bit buffer back to floats:
//              the replicas get the same sum bit for bit. Bytes: 2 (N-1)/N of the 16-bit buffer
//              each way. (Before, fp16 went through c10d Gloo's allreduce of at::kHalf, which sums
//              element by element in software, and bf16, which c10d 1.13 refuses, was allgathered.)
//   sparse     (topk, threshold, onebit) each rank encodes its buffer (with its residual) into a
//              message, the messages are allgathered (Communicator::allgatherVariable) and each is
//              decoded and added in rank order on every rank, so the replicas get the same sum bit
//              for bit. Bytes are counted from the messages' real sizes: this rank's message once
//              to each other rank, the others' messages in. (Gloo's allgather pads every message
//              to the longest; the padding is not counted.)
// Every codec but none runs on a communication thread of this object, one buffer after the other
// in the order start() was called: start() returns at once, so the allreduce scheme starts a
// bucket from its autograd hook and backward goes on while the bucket is encoded, exchanged and
// summed.
//
// Contract: like every collective, start() must be called by every rank for the same buffers in
// the same order, and each start(id) must be followed by finish(id) before the next start(id).
// Between start(id) and finish(id) the caller must not touch the buffer, nor run another
// collective on the same communicator (the communication thread's exchanges would pair with it).
#pragma once

#include <cohort/communicator.h>

#include "base/thread_annotations.h"
#include "compress/codec.h"

#include <torch/types.h>

#include <atomic>
#include <deque>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

namespace cohort {

class CompressedSum {
 public:
  // `buffers`: the length of each buffer this object will sum (one encoder, so one residual,
  // each).
  CompressedSum(std::shared_ptr<Communicator> comm, compress::CodecSpec spec, std::vector<int64_t> buffers);
  // Ends the communication thread after the exchange it is running (bounded by the communicator's
  // timeout); buffers started and not finished are dropped.
  ~CompressedSum();
  CompressedSum(const CompressedSum&) = delete;
  CompressedSum& operator=(const CompressedSum&) = delete;

  const compress::CodecSpec& spec() const { return spec_; }

  // Starts summing buffer `id` (contiguous float32 `flat`, this rank's contribution).
  void start(size_t id, torch::Tensor flat);
  // Waits for buffer `id`'s sum and leaves it in `flat`. Rethrows the exchange's CommError or
  // TimeoutError; after one, every later buffer fails with it too (the ranks are out of step).
  void finish(size_t id, torch::Tensor flat);

  // Payload bytes of the exchanges since construction, as the codec put them on the wire. Up to
  // date for every finished buffer.
  int64_t bytesSent() const { return bytesSent_; }
  int64_t bytesReceived() const { return bytesReceived_; }

  // Where the communication thread's time went, seconds since construction: encoding (the
  // conversion to 16 bits; a sparse encode), waiting on the wire (sends, receives, allgathers),
  // and summing (16-bit addition and rounding, the conversion back; decoding and adding the
  // messages). none has no thread: its allreduce is Gloo's, all of it "wire", counted by the
  // caller's wait.
  struct Phases {
    double encodeSeconds = 0.0;
    double wireSeconds = 0.0;
    double decodeSeconds = 0.0;
  };
  Phases phases() const;

  // Forgets every residual (after the warm-up, or when the parameters are replaced). Not while a
  // buffer is under way.
  void resetResiduals();
  // Buffer `id`'s residual (error feedback), empty for the codecs without one; setResidual() puts
  // a saved one back (InvalidArgument for another size).
  std::span<const float> residual(size_t id) const { return encoders_.at(id).residual(); }
  void setResidual(size_t id, std::span<const float> residual) { encoders_.at(id).setResidual(residual); }

 private:
  struct Job {
    size_t id = 0;
    torch::Tensor flat;
  };
  void run();  // the communication thread
  void exchange(size_t id, torch::Tensor& flat);
  void ring16(size_t id, torch::Tensor& flat);
  void sparse(size_t id, torch::Tensor& flat);

  // Constant after construction.
  std::shared_ptr<Communicator> comm_;
  compress::CodecSpec spec_;
  // Owned by the communication thread while a buffer is under way.
  std::vector<compress::Encoder> encoders_;
  std::vector<torch::Tensor> wire16_;  // fp16 / bf16: the 16-bit form of each buffer
  std::vector<uint8_t> message_;
  std::vector<CommWork> works_;  // none: the allreduce under way, per buffer

  std::atomic<int64_t> bytesSent_{0};
  std::atomic<int64_t> bytesReceived_{0};

  mutable Mutex mutex_;
  CondVar changed_;
  std::deque<Job> queue_ GUARDED_BY(mutex_);
  std::vector<bool> done_ GUARDED_BY(mutex_);  // per buffer: its sum is in its flat
  std::exception_ptr failure_ GUARDED_BY(mutex_);  // the first exchange that failed
  size_t finished_ GUARDED_BY(mutex_) = 0;  // exchanges the thread has ended (its progress)
  bool stopping_ GUARDED_BY(mutex_) = false;
  Phases phases_ GUARDED_BY(mutex_);
  std::thread thread_;  // none: not started
};

}  // namespace cohort
