// Helpers every scheme uses to keep replicas alike: packing tensors into one flat buffer per
// dtype for a single collective, averaging and broadcasting a model, and checking that every rank
// holds the same parameters before anything is exchanged.
//
// Contract: each function is a collective of `comm` (or of the group given): every rank calls it,
// in the same order, with tensors of the same count, dtypes and shapes.
#pragma once

#include <cohort/communicator.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <functional>
#include <span>
#include <string>
#include <vector>

namespace cohort {

// Packs the tensors into one flat tensor per dtype, lets `exchange` change it in place (one
// collective per dtype instead of one per tensor), and copies the result back into the tensors.
// The packed tensor is always in host memory: tensors on a CUDA device are copied into a pinned
// host buffer and back (the copy back ordered before the device's next kernels), so that every
// rank runs the same host collectives whichever devices its tensors are on.
void exchangePacked(const std::vector<torch::Tensor>& tensors,
                    const std::function<void(torch::Tensor& packed)>& exchange);

// Averages the floating-point tensors over the ranks in place (others are left alone).
void averageInPlace(Communicator& comm, const std::vector<torch::Tensor>& tensors);

// Makes every replica hold `root`'s parameters and buffers.
void broadcastModel(Communicator& comm, torch::nn::Module& model, int root = 0);

// The module's parameters, each tensor once (a parameter registered under two names, as tied
// weights are, is listed at its first name).
std::vector<std::pair<std::string, torch::Tensor>> uniqueParameters(torch::nn::Module& model);

// Throws InvalidArgument on every rank when the ranks' modules differ in their parameters or
// buffers (count, names, dtypes, shapes, which parameters are trainable), naming the first difference and the ranks that hold
// each side. Costs two small collectives, and two broadcasts when there is a difference.
// `extra`: more that must agree (a handle's options), compared as one more line.
void checkSameModel(Communicator& comm, torch::nn::Module& model, const std::string& who,
                    const std::string& extra = "");

// The parameters side by side in the flat tensor `flat`, in the given order, and back (copy_
// converts between dtypes, and moves each parameter's version counter); `flat` holds exactly
// their total count (checked). Not collectives.
void packParameters(const std::vector<torch::Tensor>& params, const torch::Tensor& flat);
void unpackParameters(const torch::Tensor& flat, const std::vector<torch::Tensor>& params);

// The same over a float32 buffer of the caller's.
void flattenParameters(const std::vector<torch::Tensor>& params, std::span<float> flat);
void unflattenParameters(const std::vector<torch::Tensor>& params, std::span<const float> flat);

// Whether backward gives `param` a row-sparse gradient (a sparse COO tensor of whole rows): it is
// the weight of an nn::Embedding or nn::EmbeddingBag made with sparse(true) inside `model`.
bool hasRowSparseGradient(torch::nn::Module& model, const torch::Tensor& param);
// Whether any parameter of `model` has one (a sparse embedding table).
bool hasRowSparseTable(torch::nn::Module& model);

// A row-sparse gradient as (sorted, distinct rows, their values [rows, dim]), duplicates summed;
// a dense gradient of a table is read the same way (its rows that are not all zero).
std::pair<torch::Tensor, torch::Tensor> gradientRows(const torch::Tensor& grad);

// Drops every parameter's gradient (set to none), so the next backward writes it fresh instead
// of adding to zeros.
void clearGradients(torch::nn::Module& model);

// An optimizer's state (what its save() writes) as bytes, for a copy or a gather. Not a collective.
std::string optimizerBytes(const torch::optim::Optimizer& optimizer);

// Loads `archive` into `optimizer` and puts each group's options back as they were: LibTorch's
// load() restores the saved groups' options (the learning rate, the momentum), which would
// override the run's --lr and --momentum without a word. Returns the saved options, group by group.
std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> loadOptimizerKeepingOptions(
    torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive);

// The parameter dtypes the data-parallel handles sum and average (float32, float64, float16,
// bfloat16): what Gloo and NCCL reduce. The float8 types are floating point too, but refused.
inline bool isAveragedDtype(c10::ScalarType type) {
  return type == c10::kFloat || type == c10::kDouble || type == c10::kHalf || type == c10::kBFloat16;
}

// A scale factor (1/N, a shard's weight) as the 0-dim CPU tensors that mul_out and mul_ take
// without a cast: float32 for float32 tensors, double for the others. A 0-dim tensor does not
// promote the other operand's dtype, but one of another dtype than it is cast at every call (an
// allocation and a copy: aten::to in a profile); the double gives a float64 tensor the exact
// factor and a 16-bit one a float factor, at the cost of that cast.
class ScaleTensors {
 public:
  void set(double value) {
    float_ = torch::scalar_tensor(value, torch::kFloat32);
    double_ = torch::scalar_tensor(value, torch::kFloat64);
  }
  // The factor to multiply `t` by.
  const torch::Tensor& forTensor(const torch::Tensor& t) const {
    return t.scalar_type() == torch::kFloat32 ? float_ : double_;
  }

 private:
  torch::Tensor float_, double_;
};

// The one device the parameters of `model` are on (the CPU for a module without parameters).
// Throws InvalidArgument, naming `who`, when they are on two devices, or on one that is neither
// the CPU nor a CUDA device.
c10::Device modelDevice(torch::nn::Module& model, const std::string& who);

// Throws InvalidArgument when a parameter of `model` is not on the CPU, for the handles whose
// exchange works on host memory and has no device path (TensorParallel, so far): `who` names the handle.
void requireCpuModel(torch::nn::Module& model, const std::string& who);

}  // namespace cohort
