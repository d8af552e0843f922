// Synchronous data parallelism by gradient allreduce: PyTorch DDP's design in C++.
//
// Gradients are packed into buckets (reverse parameter order, which is roughly the order backward
// produces them). A hook on every parameter copies its gradient, scaled by 1/N, into its bucket's
// flat buffer; when a bucket is full its allreduce is launched at once, so communication overlaps
// the rest of backward. Buckets are launched strictly in index order on every rank (a bucket that
// fills early waits for the ones before it), because Gloo collectives must be issued in the same
// order everywhere. Parameters that got no gradient in a step contribute zeros after backward, so
// unused parameters never hang a step. Every rank applies the same averaged gradient with the
// same optimizer, so the replicas stay bit-identical.
//
// With a codec (--codec, see strategy/compressed.h) the buckets travel compressed: fp16 keeps
// overlapping with backward (a 16-bit Gloo allreduce per bucket); bf16 and the sparse codecs,
// whose exchange is an allgather, run bucket by bucket after backward. The first
// codecWarmupSteps steps are uncompressed.
#pragma once

#include <cohort/communicator.h>
#include <cohort/strategy.h>

#include "strategy/compressed.h"

#include <functional>
#include <memory>
#include <vector>

namespace cohort {

struct AllreduceOptions {
  double bucketMb = 25.0;
  double firstBucketMb = 1.0;  // a small first bucket starts communication early (as DDP does)
  bool overlap = true;         // false: every allreduce after backward (for comparison)
  compress::CodecSpec codec;
  int64_t codecWarmupSteps = 0;
};

class AllreduceStrategy final : public Strategy {
 public:
  AllreduceStrategy(std::shared_ptr<Communicator> comm, AllreduceOptions options);
  ~AllreduceStrategy() override;

  std::string name() const override { return "allreduce"; }
  ReplicaInfo replica() const override;
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Averages floating-point buffers (e.g. BatchNorm's running statistics), which each rank
  // updates from its own shard; parameters are identical already. Every rank must call it.
  void synchronize() override;

  size_t bucketCount() const { return buckets_.size(); }

 private:
  struct Bucket {
    torch::Tensor flat;                // the bucket's gradients, side by side
    std::vector<size_t> params;        // indices into params_
    std::vector<torch::Tensor> views;  // views of flat, shaped like each parameter
    size_t pending = 0;                // gradients still to come this step
    std::vector<bool> filled;
    CommWork work;
    bool launched = false;
  };

  void onGradient(size_t param, const torch::Tensor& grad);
  void launchReady();
  CompressedSum& exchange() { return steps_ < options_.codecWarmupSteps ? *plain_ : *compressed_; }

  std::shared_ptr<Communicator> comm_;
  AllreduceOptions options_;
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::vector<torch::Tensor> params_;
  std::vector<std::pair<size_t, size_t>> slotOf_;  // param -> (bucket, index in bucket)
  std::vector<Bucket> buckets_;
  size_t nextToLaunch_ = 0;
  bool inStep_ = false;
  double scale_ = 1.0;
  std::unique_ptr<CompressedSum> compressed_;  // with options_.codec
  std::unique_ptr<CompressedSum> plain_;       // uncompressed, during the warm-up
  int64_t steps_ = 0;                          // steps taken by this process
};

// Packs the tensors into one flat tensor per dtype, lets `exchange` change it in place (one
// collective per dtype instead of one per tensor), and copies the result back into the tensors.
void exchangePacked(const std::vector<torch::Tensor>& tensors,
                    const std::function<void(torch::Tensor& packed)>& exchange);

// Averages the floating-point tensors over the ranks in place (others are left alone).
void averageInPlace(Communicator& comm, const std::vector<torch::Tensor>& tensors);

// Makes every replica start from rank 0's parameters and buffers.
void broadcastModel(Communicator& comm, torch::nn::Module& model);

}  // namespace cohort
