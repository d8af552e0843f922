// Data parallelism inside one process: R replica threads, one intra-op thread each, exchanging
// through shared memory instead of sockets (no kernel copies). Three schemes, one handle each:
//
//   Mirrored        (TensorFlow's MirroredStrategy): R copies of the model, each with its own
//                   optimizer; every replica's gradient is summed in memory (bucketed, while backward
//                   runs) and every replica applies the same sum, so the copies stay bit-identical.
//                   With a job of several processes (one per host), the in-memory sums are then
//                   averaged across the processes: replicas inside a host, allreduce across hosts.
//   CentralStorage  (CentralStorageStrategy): one set of parameters and one optimizer; R threads
//                   compute gradients against it, the sum is applied once.
//   Hogwild         (Recht et al. 2011; A3C's lock-free threads): R threads train one shared set of
//                   parameters, each with its own optimizer, without locks; how stale each update
//                   was and how often updates overlapped is counted.
//
//   cohort::Mirrored mirrored(net, optimizer, {.replicas = 2});   // net: std::shared_ptr<Module>
//   for (auto& batch : batches) {
//     double loss = mirrored.step(batch.data, batch.target,
//                                 [](int replica, torch::nn::Module& m, const torch::Tensor& x,
//                                    const torch::Tensor& y) {
//                                   return criterion(m.as<Net>()->forward(x), y);
//                                 });
//   }
//
// step() owns the whole step: it splits the batch along its first dimension into R shards (sizes
// differing by at most one, or with `balance` in proportion to the replicas' speeds), runs forward, loss and backward
// of each shard on its replica's thread, and the optimizer. The loss function runs on a replica thread and must touch
// only its arguments. The gradient is the shards' gradients weighted by their sizes: for Mirrored and CentralStorage a
// step equals one step of a single process on the whole batch. A parameter that no replica got a
// gradient for (a branch the step skipped) keeps .grad none, so the optimizer skips it as one
// process would (across processes: with findUnusedParameters). Parameters may be of any floating
// dtype, or of several: a bucket holds one dtype and its sums are taken in that dtype.
//
// Devices: Mirrored and CentralStorage take a model on the CPU or on a GPU (Hogwild: the CPU only).
// With the model on cuda:K, replica r is on cuda:((K + r) mod the GPU count): with one GPU every
// replica shares it, with several there is one per GPU (TensorFlow's MirroredStrategy). Each
// replica's shard is copied to its device; the gradients are summed on replica 0's device
// (device-to-device copies) and the sum copied back to every replica's, which applies it
// (CentralStorage: replica 0 applies it to the one parameter set, which a replica on another GPU
// copies before each step). The batch may be on any device.
//
// Contract: the model and the optimizer are the caller's and are replica 0's (what it evaluates and
// checkpoints); the other replicas are deep copies made by the constructor (every submodule must be
// torch::nn::Cloneable, as the built-in layers and cohort's TorchScript layers are), with copies of
// the optimizer (SGD, Adam, AdamW, RMSprop or Adagrad; its state included). Between steps the
// caller may read replica 0 but must not train it outside step(). While the handle lives, OpenBLAS
// runs one thread (process-wide; restored by the destructor). A replica that throws ends the step
// on every thread with that error (the step's parameter update is then not applied); every wait
// between replicas is bounded by `timeout`. Errors are cohort::Error subclasses.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace cohort {

// Forward and loss of one replica on its shard; returns a scalar. Called on the replica's thread.
using ShardLoss = std::function<torch::Tensor(int replica, torch::nn::Module& model, const torch::Tensor& inputs,
                                              const torch::Tensor& targets)>;

struct COHORT_API ReplicaOptions {
  int replicas = 2;
  // Mirrored and CentralStorage: gradients are summed bucket by bucket; with overlap, a bucket is
  // summed as soon as every replica's backward has produced it, while backward goes on, and (Mirrored
  // across processes) allreduced with the other processes as soon as it is summed.
  double bucketMb = 4.0;
  bool overlap = true;
  // Mirrored and CentralStorage: split each batch in proportion to the replicas' measured speeds
  // (their forward and backward time per example over recent steps, smoothed) instead of evenly,
  // so that a replica on a slower core does not hold the others at the sums; every replica keeps at
  // least max(1, batch / 4R) examples. A step still equals one step on the whole batch (each shard's
  // gradient is weighted by its size) and the replicas stay bit-identical, but the split, and so
  // the rounding of the sums, depends on timing: two runs are no longer bit for bit the same.
  bool balance = false;
  // Mirrored across processes: a parameter that no replica of any process got a gradient for
  // (a branch the whole step skipped) keeps .grad none, so the optimizer leaves it alone as one
  // process would (DDP's find_unused_parameters); costs one allreduce of an int32 per parameter
  // per step. Without it such a parameter gets zeros (momentum and weight decay move it). Inside
  // one process this needs no communication and is always done.
  bool findUnusedParameters = false;
  std::chrono::milliseconds timeout{60000};  // every wait of one replica for another
};

// Where a replica thread's step time goes, in seconds summed over the steps and averaged over the
// replicas. With waitSeconds they cover a step() call from its start to its return.
struct COHORT_API ReplicaTimes {
  double handOff = 0.0;    // step() waking the thread, and the last thread's end waking step()
  double forward = 0.0;    // the loss function: forward and loss
  double backward = 0.0;   // backward, less the time its gradient hooks spend on the buckets
  double copy = 0.0;       // writing the weighted gradients into the buckets (Mirrored, CentralStorage)
  double sum = 0.0;        // summing its chunks of the buckets (Mirrored, CentralStorage)
  double optimizer = 0.0;  // its optimizer step (CentralStorage: replica 0's only)
};

struct COHORT_API ReplicaStats {
  int64_t steps = 0;
  std::vector<int64_t> lastShards;  // the last step's examples per replica
  int64_t bytesReduced = 0;      // gradient bytes summed in memory (Mirrored, CentralStorage)
  int64_t buckets = 0;           // the buckets the sums go in (Mirrored, CentralStorage)
  // Replica threads' time waiting for each other (at the sums, for the allreduces, for the last
  // thread to end the step), per replica.
  double waitSeconds = 0.0;
  ReplicaTimes times;
  // Mirrored across processes: the averaged sums' traffic, and the time the step waited for it.
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0.0;
  // Hogwild: an update's staleness is the number of other replicas' updates applied between its
  // forward pass reading the parameters and its own update; a conflict is an update whose writing
  // overlapped another's.
  int64_t updates = 0;
  double stalenessSum = 0.0;
  int64_t stalenessMax = 0;
  int64_t conflicts = 0;
};

class COHORT_API ReplicaGroup {
 public:
  ~ReplicaGroup();
  ReplicaGroup(const ReplicaGroup&) = delete;
  ReplicaGroup& operator=(const ReplicaGroup&) = delete;

  // One step on the batch (see above). Returns the loss, the shards' losses weighted by their
  // sizes. A batch smaller than the replica count is taken: the replicas left without examples
  // contribute nothing. Throws InvalidArgument for a batch of no examples, or targets of another
  // count than the inputs.
  double step(const torch::Tensor& inputs, const torch::Tensor& targets, const ShardLoss& loss);

  // Mirrored: makes every replica's floating-point buffers (BatchNorm's running statistics) their
  // average over the replicas (and the processes). A collective of the job's processes.
  void synchronizeBuffers();

  int replicas() const;
  torch::nn::Module& replica(int r);
  // Replica r's optimizer: replica 0's is the caller's, which CentralStorage's replicas all step;
  // Mirrored's and Hogwild's others are copies of it (Hogwild's follow their own gradients: save
  // and load them beside the model to resume exactly).
  torch::optim::Optimizer& optimizer(int r);
  ReplicaStats stats() const;

  struct Impl;

 protected:
  enum class Kind { kMirrored, kCentral, kHogwild };
  ReplicaGroup(Kind kind, const Job* job, std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
               ReplicaOptions options);

 private:
  std::unique_ptr<Impl> impl_;
};

class COHORT_API Mirrored final : public ReplicaGroup {
 public:
  // A job of several processes: a collective of its workers (rank 0's model is broadcast first);
  // every process runs the same replica count and calls step() equally often.
  Mirrored(const Job& job, std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
           ReplicaOptions options = {});
  Mirrored(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer, ReplicaOptions options = {});
};

class COHORT_API CentralStorage final : public ReplicaGroup {
 public:
  CentralStorage(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
                 ReplicaOptions options = {});
};

class COHORT_API Hogwild final : public ReplicaGroup {
 public:
  Hogwild(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer, ReplicaOptions options = {});
};

}  // namespace cohort
