// Bag-of-ids data sets (the sparse model's data): the libsvm / Vowpal-style file reader and the
// seeded synthetic generator behind loadData's "libsvm:" and "synthetic-bags" specs.
#pragma once

#include <cohort/data.h>

#include <cstdint>
#include <span>
#include <string>

namespace cohort {

// "libsvm:TRAIN[,TEST]" or "synthetic-bags[:N[,ROWS]]" (see loadData).
DataSplits loadBagSpec(const std::string& spec, uint64_t seed);

// Reads TRAIN (and TEST; empty: the last sixth of TRAIN is the test set). Throws IoError naming
// FILE:LINE for the first malformed line.
DataSplits loadBagFiles(const std::string& trainPath, const std::string& testPath);

struct SyntheticBagsOptions {
  int64_t examples = 60000;  // training examples; the test set has examples / 6
  int64_t rows = 1000000;    // ids are below this
  int64_t minIds = 20;       // ids per example, uniform in [minIds, maxIds]
  int64_t maxIds = 50;
  int64_t hiddenRows = 1000;  // the hidden model's weights are on ids below this (the most frequent)
  double noise = 2.0;         // standard deviation of the noise added to the hidden score
  uint64_t seed = 1;
};

DataSplits makeSyntheticBags(const SyntheticBagsOptions& options);

// The examples at `indices` as a [B, L] batch of ids padded with kBagPadding.
Batch makeBagBatch(const Dataset& data, std::span<const int64_t> indices);

}  // namespace cohort
