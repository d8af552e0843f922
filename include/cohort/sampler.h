// Which examples each replica trains on, epoch by epoch.
#pragma once

#include <cohort/export.h>

#include <cstdint>
#include <vector>

namespace cohort {

struct COHORT_API SamplerOptions {
  int64_t datasetSize = 0;
  int rank = 0;
  int worldSize = 1;
  uint64_t seed = 0;
  bool shuffle = true;
};

// ShardSampler gives rank r of W the examples perm[r], perm[r+W], perm[r+2W], ... of the epoch's
// permutation perm, which depends only on (seed, epoch). Every rank gets floor(N/W) examples, so
// all ranks run the same number of steps; the N mod W examples left over change with the epoch.
//
// The strided assignment is what makes data parallelism exact: batch k of every rank together is
// batch k of a single process with W times the batch size over the same permutation.
class COHORT_API ShardSampler {
 public:
  explicit ShardSampler(SamplerOptions options);

  // This rank's examples for `epoch`, in the order to train on them.
  std::vector<int64_t> epochIndices(int64_t epoch) const;

  int64_t samplesPerRank() const { return options_.datasetSize / options_.worldSize; }
  // Batches of batchSize (the last may be short). Throws InvalidArgument unless batchSize >= 1.
  int64_t batchesPerEpoch(int64_t batchSize) const;
  const SamplerOptions& options() const { return options_; }

 private:
  SamplerOptions options_;
};

class Job;

// The library's sampler for a user's own loop: rank r of the job's W workers gets its ShardSampler
// shard of the index range [0, datasetSize), reshuffled every epoch from (seed, epoch), the same
// on every rank, so that no two ranks train on one example in an epoch.
//
//   cohort::DistributedSampler sampler(dataset.size(), job, /*seed=*/1);
//   for (int64_t epoch = 0; epoch < epochs; ++epoch)
//     for (int64_t i : sampler.indices(epoch)) ...
class COHORT_API DistributedSampler {
 public:
  // Throws InvalidArgument when the data set has fewer examples than the job has workers.
  DistributedSampler(int64_t datasetSize, const Job& job, uint64_t seed = 0, bool shuffle = true);

  std::vector<int64_t> indices(int64_t epoch) const { return sampler_.epochIndices(epoch); }
  int64_t size() const { return sampler_.samplesPerRank(); }  // the same on every rank
  // Batches of batchSize a rank has per epoch (the last may be short). Throws InvalidArgument
  // unless batchSize >= 1.
  int64_t batches(int64_t batchSize) const;

 private:
  ShardSampler sampler_;
};

}  // namespace cohort
