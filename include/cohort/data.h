// Data sets held in memory as uint8 images and int64 labels, and the batches made from them.
#pragma once

#include <cohort/export.h>

#include <torch/types.h>

#include <cstdint>
#include <span>
#include <string>

namespace cohort {

// A batch of bags of feature ids (sparse data) is an int64 tensor [B, L]: each row one example's
// ids, padded with kBagPadding to the longest bag of the batch.
inline constexpr int64_t kBagPadding = -1;

struct COHORT_API Batch {
  torch::Tensor inputs;   // [B, C, H, W] float, scaled to [0, 1]; bags: [B, L] int64 ids
  torch::Tensor targets;  // [B] int64 class indices
  int64_t size() const { return targets.defined() ? targets.size(0) : 0; }
};

struct COHORT_API Dataset {
  torch::Tensor images;  // [N, C, H, W] uint8 (image data sets)
  torch::Tensor labels;  // [N] int64
  // Bag-of-ids data sets: example i's feature ids are bagIds[bagOffsets[i] .. bagOffsets[i+1]).
  torch::Tensor bagIds;      // [nnz] int64, each >= 0
  torch::Tensor bagOffsets;  // [N + 1] int64
  bool bags() const { return bagOffsets.defined(); }
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

struct COHORT_API DataSplits {
  std::string name;
  Dataset train;
  Dataset validation;  // empty unless holdOutValidation() took it from train
  Dataset test;
  int64_t classes = 10;
  // Bag-of-ids data: every id is below featureRows; featureRowsSource says where the largest is
  // ("FILE:LINE"), for the error when a model's table is too small.
  int64_t featureRows = 0;
  std::string featureRowsSource;
  // Synthetic bags: the expected test accuracy of the hidden model that made the labels (the
  // best any model can do on average); < 0 when unknown.
  double attainableAccuracy = -1;
  bool bags() const { return train.bags(); }
  int64_t channels() const { return train.images.size(1); }
  int64_t height() const { return train.images.size(2); }
  int64_t width() const { return train.images.size(3); }
};

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// spec is one of:
//   fashion-mnist          Fashion-MNIST from kFashionMnistDir, or $COHORT_FASHION_MNIST_DIR
//   mnist:DIR              any IDX pair in DIR: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
//   synthetic[:N]          N (default 60000) random 1x28x28 images with 10 classes, plus N/6 test
//                          images; labels depend on the images, so a model can learn them.
//   libsvm:TRAIN[,TEST]    bags of feature ids, one example a line (libsvm / Vowpal style):
//                          LABEL [|] ID[:1] ID[:1] ...; LABEL a class >= 0 (+1 is 1; -1 is read as 0);
//                          without TEST the last sixth of TRAIN is the test set. A malformed
//                          line, a negative id, a value other than 1, an empty bag: IoError
//                          naming FILE:LINE.
//   synthetic-bags[:N[,ROWS]]  N (default 60000) bags of 20-50 ids below ROWS (default 1000000)
//                          drawn from a power law (P(id) ~ 1/(id+1)), plus N/6 test bags; the
//                          label is the sign of a hidden sparse linear model (weights on the
//                          1000 most frequent ids) plus Gaussian noise, so the attainable
//                          accuracy is known (attainableAccuracy).
// Throws InvalidArgument for an unknown spec and IoError for missing or malformed files.
COHORT_API DataSplits loadData(const std::string& spec, uint64_t seed);

// Moves n training examples, chosen by a seeded permutation (the same on every machine for the
// same data, n and seed), into data.validation; the rest stay in data.train in their order.
// Throws InvalidArgument when n is not below the training set's size.
COHORT_API void holdOutValidation(DataSplits& data, int64_t n, uint64_t seed);

// Gathers the examples at `indices` into a batch. Throws InvalidArgument naming an index outside
// [0, data.size()).
COHORT_API Batch makeBatch(const Dataset& data, std::span<const int64_t> indices);

}  // namespace cohort
