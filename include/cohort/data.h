// Data sets held in memory as uint8 images and int64 labels, and the batches made from them.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <span>
#include <string>

namespace cohort {

struct Batch {
  torch::Tensor inputs;   // [B, C, H, W] float, scaled to [0, 1]
  torch::Tensor targets;  // [B] int64 class indices
  int64_t size() const { return targets.defined() ? targets.size(0) : 0; }
};

struct Dataset {
  torch::Tensor images;  // [N, C, H, W] uint8
  torch::Tensor labels;  // [N] int64
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

struct DataSplits {
  std::string name;
  Dataset train;
  Dataset validation;  // empty unless holdOutValidation() took it from train
  Dataset test;
  int64_t classes = 10;
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
// Throws InvalidArgument for an unknown spec and IoError for missing or malformed files.
DataSplits loadData(const std::string& spec, uint64_t seed);

// Moves n training examples, chosen by a seeded permutation (the same on every machine for the
// same data, n and seed), into data.validation; the rest stay in data.train in their order.
// Throws InvalidArgument when n is not below the training set's size.
void holdOutValidation(DataSplits& data, int64_t n, uint64_t seed);

// Gathers the examples at `indices` into a batch.
Batch makeBatch(const Dataset& data, std::span<const int64_t> indices);

}  // namespace cohort
