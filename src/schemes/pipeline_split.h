// A stage's layers (include/cohort/pipeline.h): a slice of the model's layers, and the two parts
// of a layer that a cut splits by output channels between two stages (--partition L+C).
#pragma once

#include "schemes/pipeline_profile.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace cohort {

// Layers [first, first + count) of `model`, the same module objects under the same names.
torch::nn::Sequential sliceModel(const torch::nn::Sequential& model, int first, int count);

// Output channels of a layer that a cut may split by channels (0: not splittable): a Conv2d of
// one group, a Linear on [batch, features]. `output` is its output in the dry run.
int64_t splittableChannels(const torch::nn::Module& layer, const torch::Tensor& output);

// Stage `stage`'s layers under the cut (counts and splits as Pipeline::Impl's): its slice of the
// model, with the second part of a layer the previous stage split in place of that layer, and
// the first part of the next stage's first layer after its own when it splits that one.
torch::nn::Sequential stageLayers(const torch::nn::Sequential& model, const LayerProfile& profile,
                                  const std::vector<int>& counts, const std::vector<int>& splits, int stage);

}  // namespace cohort
