// What the pipeline learns about a model before cutting it (include/cohort/pipeline.h): every
// layer's output shape from a dry run, where a cut may go, which layers a cut may split, and what
// each layer and a message between stages cost, timed.
#pragma once

#include <cohort/communicator.h>

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cohort {

// One example's shape of a tensor whose first dimension is the batch, and back.
std::vector<int64_t> exampleShape(const torch::Tensor& t);
std::vector<int64_t> withBatch(int64_t batch, const std::vector<int64_t>& example);
int64_t numel(const std::vector<int64_t>& shape);

// The dry run: every layer's output for two examples of the sample, in evaluation mode, without
// gradients (no generator draws, no buffer updates).
struct LayerProfile {
  std::vector<int64_t> input;                 // one example of the model's input
  std::vector<std::vector<int64_t>> outputs;  // one example of each layer's output
  std::vector<c10::ScalarType> types;         // each layer's output dtype
  // Whether the model may be cut after layer j: its output's first dimension is the batch.
  std::vector<bool> cutAfter;
  // Layer j's output channels when a cut may split it (splittableChannels); 0: not splittable.
  std::vector<int64_t> channels;

  // Layer j split after its first c channels: one example's input of the layer, its first part's
  // output, and what crosses between the two stages (both, packed: see SplitHead).
  const std::vector<int64_t>& inputOf(int j) const { return j == 0 ? input : outputs[size_t(j) - 1]; }
  std::vector<int64_t> headOf(int j, int c) const;
  std::vector<int64_t> packedOf(int j, int c) const;
};

// Each layer's type, short: "Conv2d" for torch::nn::Conv2dImpl.
std::vector<std::string> layerNames(const torch::nn::Sequential& model);

LayerProfile dryRun(torch::nn::Sequential& model, const torch::Tensor& sample);

// Forward and backward time of each layer on `inputs`: the smallest of a few passes. Each layer
// runs on a detached copy of its input, so its backward is timed alone. The generator and the
// buffers are put back afterwards, so timing changes nothing in training.
std::vector<double> timeLayers(torch::nn::Sequential& model, const torch::Tensor& inputs);

// The median round trip of a small message between ranks 0 and 1 (0 on other ranks, or with one
// stage): the fixed cost of one micro-batch's messages. Ranks 0 and 1 call it together.
double probeMessages(Communicator& comm, int stages);

}  // namespace cohort
