// Synchronous data parallelism for any torch::nn::Module: PyTorch's DistributedDataParallel for
// libtorch's C++ frontend.
//
//   cohort::DataParallel dp(job, *net, {.codec = "fp16"});   // broadcasts rank 0's model
//   for (auto& batch : batches) {
//     optimizer.zero_grad();
//     auto loss = criterion(net->forward(batch.data), batch.target);
//     loss.backward();          // gradients are averaged over the ranks while backward runs
//     optimizer.step();         // every rank applies the same averaged gradient
//   }
//
// How: the gradients are views of buckets (buckets hold parameters in reverse order, roughly the
// order backward produces them; the first is small so that communication starts early): after the
// first synchronized step each .grad is its parameter's slot of a bucket, as DDP's
// gradient_as_bucket_view, so no second copy of the gradients is kept; a slot has its parameter's
// strides (a channels_last weight's .grad is channels_last too). A post hook on every
// parameter's gradient accumulator runs once autograd has added the gradient into .grad and scales
// the slot by 1/N (a .grad of its own, after zero_grad() set it to none, is copied in and dropped);
// a full bucket's allreduce is launched at once and overlaps the rest of backward. At the end of
// backward (an autograd final callback) the buckets are waited for and each .grad holds the
// average. Parameters that got no gradient on this rank contribute zeros, so unused parameters
// never hang a step (findUnusedParameters leaves those no rank used without a .grad).
//
// Contract, as for c10d's ProcessGroup:
//   - Every rank constructs the handle over the same model (names, shapes, dtypes and the
//     strides of parameters that are not contiguous are checked; the first difference is named)
//     and runs the same number of synchronized backward passes. Ranks with fewer batches run
//     their loop inside join().
//   - backward() and the handle's methods are called from one thread at a time (the training
//     thread); the handle must outlive every backward pass that started while it existed.
//   - Destroying the handle removes its hooks: the model then trains on alone.
//   - One handle per model: a second over a parameter another handle of the process has hooked is
//     refused (both would scale its gradient, halving the average).
//   - The trainable parameters are those of the model when the handle is made: one frozen,
//     unfrozen, added or replaced after is refused at the next synchronized backward, by name and
//     before any exchange (make the handle after changing the model).
// Every wait is bounded by the job's timeout; a lost rank ends backward() with a CommError or
// TimeoutError naming it. Errors are cohort::Error subclasses.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace cohort {

struct COHORT_API DataParallelOptions {
  double bucketMb = 25.0;      // cap of every bucket but the first
  double firstBucketMb = 1.0;  // a small first bucket starts communication early (as DDP's)
  bool overlap = true;         // false: every bucket's allreduce after backward
  // The communication hook: what the gradients travel as. Any --codec: none, fp16, bf16,
  // topk:RATIO, threshold:TAU, onebit (the sparse ones keep a residual per bucket).
  std::string codec = "none";
  int64_t codecWarmupSteps = 0;  // the first synchronized steps travel uncompressed
  // Buffers (BatchNorm's running statistics) change on every rank in forward. kEveryStep averages
  // them at the end of every synchronized backward (one small allreduce); kOnRequest only in
  // synchronizeBuffers().
  enum class Buffers { kEveryStep, kOnRequest };
  Buffers buffers = Buffers::kEveryStep;
  // DDP's find_unused_parameters. true: a parameter whose .grad is none on every rank when a
  // synchronized backward ends (zero_grad() set it to none and no rank's graph reached it) keeps
  // none, so the optimizer skips it (no weight decay, no momentum), as one process would; it
  // costs one allreduce of an int32 per parameter per step, after the buckets. false: such a
  // parameter's .grad becomes zeros. A .grad that any rank has is averaged either way. Refused
  // with the codecs that keep a residual (topk, threshold, onebit): a skipped parameter's share
  // of it would be sent and then dropped.
  bool findUnusedParameters = false;
};

// Counters since the handle was made.
struct COHORT_API DataParallelStats {
  int64_t syncSteps = 0;         // backward passes whose gradients were averaged
  int64_t shadowSteps = 0;       // steps this rank joined in for others after its loop (join())
  int64_t bytesSent = 0;         // gradient payload as the codec put it on the wire, and findUnusedParameters' flags
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0.0;  // time backward's end waited for communication (not hidden; on
                                 // the host: NCCL's waits are the stream's, about 0 here)
  size_t buckets = 0;
  // Buckets whose exchange started from a gradient hook, before the end of backward (the others
  // start at its end: with overlap off, or parameters that got no gradient).
  int64_t bucketsStartedInBackward = 0;
  // With a codec other than none, where the communication thread's time went (it runs while
  // backward goes on, so these overlap compute and commWaitSeconds): encoding (the conversion to
  // 16 bits, a sparse encode), waiting on the wire, summing (16-bit additions and the conversion
  // back, decoding the messages). none: all zero (Gloo's allreduce is not broken down).
  double encodeSeconds = 0.0;
  double wireSeconds = 0.0;
  double decodeSeconds = 0.0;
};

class COHORT_API DataParallel {
 public:
  // Broadcasts rank 0's parameters and buffers to every rank and hooks the parameters. A collective
  // of the job's workers. Parameters may be of any floating dtype (float32, float64, float16,
  // bfloat16; a bucket holds one dtype, its sums taken in it); codecs other than none need float32.
  // Throws InvalidArgument for a module without trainable parameters, with parameters that are not
  // floating-point (or not float32 under a codec), that differ across ranks, that another
  // DataParallel of this process has hooked (destroy it first), or for a codec that does not parse.
  DataParallel(const Job& job, torch::nn::Module& module, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // While the returned guard lives, backward() accumulates gradients locally without
  // communicating (gradient accumulation: k-1 micro-steps under noSync, the k-th outside it, then
  // the optimizer step, equals one step on k times the batch). A guard may outlive the handle: its
  // end then does nothing.
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class DataParallel;
    explicit NoSync(const std::shared_ptr<int>& depth);
    std::weak_ptr<int> depth_;  // the handle's count of live guards: a guard may outlive the handle
  };
  [[nodiscard]] NoSync noSync();

  // Uneven inputs (PyTorch's Join): runs `loop` (this rank's training loop); when it returns, this
  // rank keeps joining the others' gradient averages with zeros until every rank's loop has
  // returned, and the average is taken over the ranks still training. Every rank calls join(),
  // each with its own loop. Without it, a rank that runs out of batches leaves the others waiting
  // until the timeout. Calling join() inside join() throws InvalidArgument.
  void join(const std::function<void()>& loop);

  // Averages the floating-point buffers over the ranks now (a collective).
  void synchronizeBuffers();

  DataParallelStats stats() const;
  int rank() const;
  int worldSize() const;

  // The codec's state, training state as the optimizer's is, for a checkpoint taken between steps:
  // the synchronized steps so far (with those of an earlier run put back), which decide when
  // codecWarmupSteps ends, and the residual of error feedback, flat over the buckets in order
  // (undefined for a codec without one). Every rank has a residual of its own. setCodecState()
  // puts a saved state back; it throws InvalidArgument for a residual of another size, or one given
  // to a handle whose codec keeps none.
  struct CodecState {
    int64_t steps = 0;
    torch::Tensor residual;
  };
  CodecState codecState() const;
  void setCodecState(const CodecState& state);

  struct Impl;  // opaque: defined in src/schemes/data_parallel.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
