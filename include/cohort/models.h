// The model zoo. Every model is a torch::nn::Sequential so that it can be cut into pipeline
// stages; built-in models and TorchScript files alike.
#pragma once

#include <cohort/export.h>

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cohort {

struct COHORT_API InputShape {
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t classes = 10;
  // Bag-of-ids data (DataSplits::featureRows): ids are below this; 0 for images.
  int64_t featureRows = 0;
  std::string featureRowsSource;  // where the largest id is, for the error when the table is smaller
};

struct DataSplits;

// The shape of `data`'s examples as a model takes them: images' channels, height and width, or
// for bags of ids (data.bags()) their rows.
COHORT_API InputShape inputShapeOf(const DataSplits& data);

// spec: "mlp" (784-512-512-10), "mlp:H" (784-H-H-10), "cnn" (the seeds' Keras network), "lstm" (image rows as a
// sequence, hidden 128), or a path ending in .pt: a TorchScript module made with
// torch.jit.script(...).save(path). A scripted nn.Sequential becomes one layer per child.
// For bags of feature ids: "embed[:KEY=VALUE,...]", an embedding table pooled over each bag
// (nn::EmbeddingBag with sparse gradients) and an MLP: rows (default 1000000), dim (32), pool
// (sum | mean; sum), hidden (64), sparse (1 | 0: the same model with a dense gradient).
// Parameters are initialized from torch's default generator: seed it first.
COHORT_API torch::nn::Sequential makeModel(const std::string& spec, const InputShape& shape);

// Loads a TorchScript file as above. Throws IoError naming the path when it is not one.
COHORT_API torch::nn::Sequential loadScriptedModel(const std::string& path);

COHORT_API int64_t parameterCount(const torch::nn::Module& model);

// The sparse embedding tables `model` reads `inputs` through, each with the rows that a forward
// pass of `inputs` reads (sorted, distinct). Empty for a model without one. (A built-in embed
// model with sparse gradients: its table and the batch's ids.)
COHORT_API std::vector<std::pair<torch::Tensor, torch::Tensor>> rowsRead(torch::nn::Sequential& model, const torch::Tensor& inputs);

}  // namespace cohort
