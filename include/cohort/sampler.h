// Which examples each replica trains on, epoch by epoch.
#pragma once

#include <cstdint>
#include <vector>

namespace cohort {

struct SamplerOptions {
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
class ShardSampler {
 public:
  explicit ShardSampler(SamplerOptions options);

  // This rank's examples for `epoch`, in the order to train on them.
  std::vector<int64_t> epochIndices(int64_t epoch) const;

  int64_t samplesPerRank() const { return options_.datasetSize / options_.worldSize; }
  int64_t batchesPerEpoch(int64_t batchSize) const {
    return (samplesPerRank() + batchSize - 1) / batchSize;
  }
  const SamplerOptions& options() const { return options_; }

 private:
  SamplerOptions options_;
};

}  // namespace cohort
