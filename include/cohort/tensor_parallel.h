// The vertical split of a network (Géron's exercise 10; Megatron-LM's tensor parallelism): every
// Linear layer's output units, and every Conv2d layer's output channels, divided over W processes.
//
// A Linear or Conv2d layer whose input every process holds whole, and whose output feeds another
// such layer (through element-wise layers, pooling and Flatten), is split column-wise: each
// process computes its share of the output units (units split as evenly as possible: 512 over 3
// is 171, 171, 170). The next one is then split row-wise: each process multiplies its share of
// the input by the matching slice of the weights, and one allreduce sums the parts (the bias is
// added after it). In backward, the column layer's input gradient is the one allreduce of the
// pair. A parametrized layer that ends the chain (the last Linear of an mlp) is kept whole on
// every process. Other layers are kept whole when their input is whole, and refused (naming the
// layer) when it would be split.
//
//   auto job = cohort::Job::fromEnvironment();                  // W processes, or W x R
//   cohort::TensorParallel tp(job, net, sampleInputs, {.ways = 2});
//   torch::optim::SGD opt(tp.module()->parameters(), 0.1);
//   cohort::DataParallel dp(tp.dataJob(), *tp.module());        // only with R > 1 copies
//   ... loss(tp.module()->forward(x), y).backward(); opt.step();   // x: the same batch on the W
//
// Ranks: rank = replica * W + way. The W ways of one replica read the same batches; the R copies
// of one way form dataJob(). Every forward and backward is a collective of the replica's W ways,
// called in the same order (evaluation too). The model may be on the CPU or on one GPU per process
// (the split layers are made on its device); the ways' sums go through the job's Gloo group,
// which stages CUDA tensors through host memory. Errors are cohort::Error subclasses.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>

namespace cohort {

struct COHORT_API TensorParallelOptions {
  int ways = 0;  // 0: every process of the job
};

struct COHORT_API TensorParallelStats {
  int64_t bytesSent = 0;  // over the ways' group, since the handle was made
  int64_t bytesReceived = 0;
};

class COHORT_API TensorParallel {
 public:
  // `model` is the whole network, initialized alike on every process (the same seed); `sample` is
  // a batch of inputs, for the layers' shapes. A collective of the job's workers. Throws
  // InvalidArgument when the job's size is not a multiple of the ways, when a layer to split
  // has fewer units than ways or cannot be split (naming the layer), or when more than one way
  // finds no layer to split (a TorchScript model's layers cannot be). A split layer's parts
  // require their gradients as the layer's weight and bias do (a frozen layer stays frozen).
  TensorParallel(const Job& job, const torch::nn::Sequential& model, const torch::Tensor& sample,
                 TensorParallelOptions options = {});
  ~TensorParallel();
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;

  // This process's part: the same layers, each split one as a smaller layer of its own kind
  // wrapped with its collective. Its forward returns the whole output on every way.
  torch::nn::Sequential module() const;
  int ways() const;
  int way() const;
  int replica() const;
  int replicas() const;
  // The copies of this way in the other replicas (a job of one process when there are none).
  Job dataJob() const;
  // What was done to each layer, e.g. "0 Flatten whole; 1 Linear columns 171/512; ...".
  std::string plan() const;
  TensorParallelStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
