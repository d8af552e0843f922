// Summing flat float32 buffers over the ranks through a codec (--codec), for the strategies that
// exchange with collectives (allreduce, average).
//
// How each codec travels:
//   none       Gloo allreduce of the buffer (ring: 2 (N-1)/N of it each way), launched from the
//              caller's thread; the buffer may be of any floating dtype (the others take float32).
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
// Buffers on a device (a CUDA model's buckets) cross to the host and back, each through a pinned
// host buffer of its own, allocated once. start() queues the copy on a stream of this object after
// what the caller's current stream has queued (the kernels that wrote the buffer) and returns; the
// communication thread waits for that copy only, runs the codec on the host as above, and queues
// the copy back into the device buffer (non-blocking, from pinned memory) on the same stream;
// finish() makes the caller's current stream wait for it, without blocking the host. Per codec:
//   none       Gloo's allreduce of the device tensor (c10d stages it through host memory itself).
//   fp16,bf16  the cast to 16 bits on the device, and only the 16-bit buffer crosses; the ring
//              runs on the host as above, except that this rank's own values enter it already
//              rounded to 16 bits (on the CPU they are added in float32 before the first
//              rounding): the sums may differ from the CPU's by a rounding of 16 bits. The 16-bit
//              sum crosses back and is cast to float32 on the device: the replicas still agree bit
//              for bit. fp16's cast on the device follows IEEE: a finite value beyond +-65504
//              becomes infinite, where the CPU's conversion saturates.
//   sparse     the float32 buffer crosses; the encoder, its residual and the decoding stay on the
//              host, exactly as on the CPU (the same messages, residuals and sums for the same
//              buffer). Or, for topk, threshold and onebit with SelectOn::Device: the
//              communication thread runs the codec's pass on the device, on this object's stream
//              (DeviceSelect: acc and the residual stay on the device), and only what the message
//              needs (the selected entries; onebit's scales, sign bitmap and non-finite entries)
//              crosses to the host, where the message is written; the same messages and
//              residuals as the CPU's. The decoded sum is made on the host and crosses back as above.
//              Whichever is faster is for a GPU to measure (bench/gpu_codec.cpp); Host is the
//              default, and COHORT_SPARSE_SELECT=device chooses Device for DataParallel.
//
// Contract: like every collective, start() must be called by every rank for the same buffers in
// the same order, and each start(id) must be followed by finish(id) before the next start(id).
// Between start(id) and finish(id) the caller must not touch the buffer, nor run another
// collective on the same communicator (the communication thread's exchanges would pair with it).
#pragma once

#include <cohort/communicator.h>

#include "base/thread_annotations.h"
#include "compress/codec.h"
#include "schemes/device_select.h"

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/types.h>

#include <atomic>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

namespace cohort {

// Where a device buffer's topk or threshold pass runs (above).
enum class SelectOn : uint8_t { Host, Device };
// COHORT_SPARSE_SELECT: host (or unset) or device; InvalidArgument for anything else.
SelectOn selectOnFromEnvironment();

class CompressedSum {
 public:
  // `buffers`: the length of each buffer this object will sum (one encoder, so one residual,
  // each). `device`: where every buffer given to start() lives (a CUDA device: staged through
  // pinned host memory, as above).
  CompressedSum(std::shared_ptr<Communicator> comm, compress::CodecSpec spec, std::vector<int64_t> buffers,
                c10::Device device = c10::Device(c10::kCPU), SelectOn select = SelectOn::Host);
  // Ends the communication thread after the exchange it is running (bounded by the communicator's
  // timeout); buffers started and not finished are dropped.
  ~CompressedSum();
  CompressedSum(const CompressedSum&) = delete;
  CompressedSum& operator=(const CompressedSum&) = delete;

  const compress::CodecSpec& spec() const { return spec_; }

  // Starts summing buffer `id` (contiguous float32 `flat` on the constructor's device, this rank's
  // contribution).
  void start(size_t id, torch::Tensor flat);
  // Waits for buffer `id`'s sum and leaves it in `flat` (on a device: for the kernels queued on the
  // caller's current stream from now on). Rethrows the exchange's CommError or TimeoutError; after
  // one, every later buffer fails with it too (the ranks are out of step).
  void finish(size_t id, torch::Tensor flat);

  // Payload bytes of the exchanges since construction, as the codec put them on the wire. Up to
  // date for every finished buffer.
  int64_t bytesSent() const { return bytesSent_; }
  int64_t bytesReceived() const { return bytesReceived_; }

  // Where the communication thread's time went, seconds since construction: encoding (the
  // conversion to 16 bits; a sparse encode; on a device, the wait for the copy to the host, which
  // includes the wait for the kernels that wrote the buffer), waiting on the wire (sends, receives, allgathers),
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
  // Buffer `id`'s residual (error feedback), empty for the codecs without one (a device's is copied
  // to the host first); setResidual() puts a saved one back (InvalidArgument for another size).
  std::span<const float> residual(size_t id);
  void setResidual(size_t id, std::span<const float> residual);

 private:
  struct Job {
    size_t id = 0;
    torch::Tensor flat;
  };
  // A device buffer's way through the host.
  struct Staging {
    explicit Staging(c10::DeviceType type) : written(type), copied(type), returned(type) {}
    torch::Tensor host;      // pinned: the float32 buffer (sparse codecs) or its 16-bit form
    torch::Tensor device16;  // fp16, bf16: the 16-bit form on the device
    c10::Event written;      // start(): the caller's stream has queued what wrote the buffer
    c10::Event copied;       // start(): the copy to `host`
    c10::Event returned;     // the sum's copy back into the device buffer
  };
  void run();  // the communication thread
  void exchange(size_t id, torch::Tensor& flat);
  // The 16-bit ring over `wire` (16-bit values: what is sent and received) and `flat` (float32:
  // this rank's values, into which the chunks it reduces are summed). toFloats: flat ends as the
  // float32 of the 16-bit sum; otherwise only wire holds the sum.
  void ring16(torch::Tensor& wire, torch::Tensor& flat, bool toFloats);
  void sparse(size_t id, torch::Tensor& flat);
  // SelectOn::Device: the pass over `flat` on the device, the sum into `host`.
  void sparseOnDevice(size_t id, const torch::Tensor& flat, torch::Tensor& host);
  // The message in message_ allgathered, and every rank's decoded and added into flat (zeroed).
  void gatherAndSum(torch::Tensor& flat, double encodeSeconds);
  void stageToHost(size_t id, const torch::Tensor& flat);
  void exchangeStaged(size_t id, torch::Tensor& flat);

  // Constant after construction.
  std::shared_ptr<Communicator> comm_;
  compress::CodecSpec spec_;
  c10::Device device_;
  std::optional<c10::Stream> stream_;  // on a device, with a codec: the copies' stream
  // Owned by the communication thread while a buffer is under way.
  std::vector<compress::Encoder> encoders_;
  std::vector<DeviceSelect> selects_;  // SelectOn::Device, topk, threshold, onebit: each buffer's pass
  std::vector<torch::Tensor> wire16_;  // fp16 / bf16 on the CPU: the 16-bit form of each buffer
  // On a device: written by start() before it queues the buffer, then used by the communication
  // thread, then (returned) by finish() after the thread marked the buffer done.
  std::vector<Staging> staging_;
  torch::Tensor accumulator_;  // fp16 / bf16 on a device: the ring's float32 sums (longest buffer)
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
