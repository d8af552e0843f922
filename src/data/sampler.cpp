#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/sampler.h>

#include <numeric>
#include <random>

namespace cohort {

ShardSampler::ShardSampler(SamplerOptions options) : options_(options) {
  COHORT_CHECK(options_.worldSize >= 1, InvalidArgument, "world size must be at least 1, got ",
               options_.worldSize);
  COHORT_CHECK(options_.rank >= 0 && options_.rank < options_.worldSize, InvalidArgument, "rank ",
               options_.rank, " is outside the world of ", options_.worldSize);
  COHORT_CHECK(options_.datasetSize >= options_.worldSize, InvalidArgument, "a data set of ",
               options_.datasetSize, " examples cannot be shared by ", options_.worldSize,
               " replicas");
}

int64_t ShardSampler::batchesPerEpoch(int64_t batchSize) const {
  COHORT_CHECK(batchSize >= 1, InvalidArgument, "a batch must hold at least 1 example, got a batch size of ",
               batchSize);
  return (samplesPerRank() + batchSize - 1) / batchSize;
}

std::vector<int64_t> ShardSampler::epochIndices(int64_t epoch) const {
  std::vector<int64_t> perm(size_t(options_.datasetSize));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  if (options_.shuffle) {
    // std::mt19937_64 and a hand-written Fisher-Yates: the order must be the same on every
    // machine and standard library, which std::shuffle does not promise.
    std::mt19937_64 rng(options_.seed * 0x9E3779B97F4A7C15ULL + uint64_t(epoch) + 1);
    for (size_t i = perm.size() - 1; i > 0; --i) {
      const size_t j = size_t(rng() % (i + 1));
      std::swap(perm[i], perm[j]);
    }
  }
  const int64_t count = samplesPerRank();
  std::vector<int64_t> mine(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) {
    mine[size_t(k)] = perm[size_t(options_.rank + k * options_.worldSize)];
  }
  return mine;
}

}  // namespace cohort

namespace cohort {

namespace {

ShardSampler makeShard(int64_t datasetSize, const Job& job, uint64_t seed, bool shuffle) {
  COHORT_CHECK(datasetSize >= job.worldSize(), InvalidArgument, "DistributedSampler: ", datasetSize,
               " examples cannot be shared among ", job.worldSize(), " workers");
  return ShardSampler(
      {.datasetSize = datasetSize, .rank = job.rank(), .worldSize = job.worldSize(), .seed = seed, .shuffle = shuffle});
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t datasetSize, const Job& job, uint64_t seed, bool shuffle)
    : sampler_(makeShard(datasetSize, job, seed, shuffle)) {}

int64_t DistributedSampler::batches(int64_t batchSize) const {
  COHORT_CHECK(batchSize >= 1, InvalidArgument,
               "DistributedSampler::batches: a batch must hold at least 1 example, got ", batchSize);
  return sampler_.batchesPerEpoch(batchSize);
}

}  // namespace cohort
