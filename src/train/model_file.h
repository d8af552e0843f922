// Trained models on disk: what `cohort train --save-model` writes, and the 8-bit files of
// `cohort quantize`; read back by `cohort ensemble` and `cohort quantize`.
//
// A model file is a torch archive (torch::save of the Sequential: `torch::load(model, path)` still
// reads it) with two more entries that make it self-describing: "cohort_model" (the --model spec:
// mlp, cnn, lstm or a TorchScript path) and "cohort_shape" ([channels, height, width, classes]).
//
// A quantized file holds "cohort_model", "cohort_shape", "cohort_format" = "int8-linear-v1", and per
// tensor of the model in named_parameters() then named_buffers() order: "p<i>" (float, kept as it
// is) or, for the weight of every Linear layer, "q<i>" (int8, [out, in]) and "s<i>" (float
// scales, [out]): symmetric per-channel quantization, w ~= s[row] * q[row][col], |q| <= 127.
#pragma once

#include <cohort/models.h>

#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <vector>

namespace cohort {

void saveModelFile(torch::nn::Sequential& model, const std::string& spec, const InputShape& shape,
                   const std::string& path);

struct ModelFile {
  std::string path;
  std::string spec;
  InputShape shape;
  bool quantized = false;
  torch::nn::Sequential model{nullptr};  // in evaluation mode; a quantized file's weights dequantized
  // A quantized file: for child i of the Sequential that is a Linear layer, its int8 weight and
  // per-row scales (undefined tensors elsewhere).
  std::vector<torch::Tensor> int8Weights;
  std::vector<torch::Tensor> scales;
};

// Reads either kind of file. Throws IoError naming the path when it is not a model file, or a
// model file whose tensors do not fit its description.
ModelFile loadModelFile(const std::string& path);

// Writes the 8-bit form of a float model file. Returns the number of Linear layers quantized;
// throws InvalidArgument, before writing anything, for a model that has none.
int quantizeModelFile(const ModelFile& floatModel, const std::string& outPath);

// The quantized kernels this libtorch offers for dynamic quantization of Linear layers: "onednn",
// "fbgemm", "qnnpack" or "" (none: dequantized float weights are used).
std::string quantizedEngine();

// Replaces every Linear layer of a quantized file's model by one that runs libtorch's dynamic
// int8 kernel (quantized::linear_dynamic) on the file's int8 weights, when quantizedEngine() is not
// empty. Returns the number of layers replaced.
int useQuantizedKernels(ModelFile& quantized);

}  // namespace cohort
