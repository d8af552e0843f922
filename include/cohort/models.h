// The model zoo. Every model is a torch::nn::Sequential so that it can be cut into pipeline
// stages; built-in models and TorchScript files alike.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>

namespace cohort {

struct InputShape {
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t classes = 10;
};

// spec: "mlp" (784-512-512-10), "mlp:H" (784-H-H-10), "cnn" (the seeds' Keras network), "lstm" (image rows as a
// sequence, hidden 128), or a path ending in .pt: a TorchScript module made with
// torch.jit.script(...).save(path). A scripted nn.Sequential becomes one layer per child.
// Parameters are initialized from torch's default generator: seed it first.
torch::nn::Sequential makeModel(const std::string& spec, const InputShape& shape);

// Loads a TorchScript file as above. Throws IoError naming the path when it is not one.
torch::nn::Sequential loadScriptedModel(const std::string& path);

int64_t parameterCount(const torch::nn::Module& model);

}  // namespace cohort
