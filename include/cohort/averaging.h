// Parameter averaging (local SGD; DL4J's ParameterAveraging) for any torch::nn::Module: every rank
// runs its own optimizer on its own batches, and every `period` steps the parameters and buffers
// (and on request the optimizer's state: SGD's momentum buffers, Adam's moments) are averaged.
//
//   cohort::ParameterAveraging avg(job, *net, &optimizer, {.period = 8});  // broadcasts rank 0's
//   for (...) {
//     optimizer.zero_grad(); loss.backward(); optimizer.step();
//     avg.step();                 // averages on every 8th call
//   }
//   avg.synchronize();            // before evaluating or saving: averages what is pending
//
// With a codec, what travels is each rank's change since the last average, through the codec
// (with its residual); buffers and optimizer state travel uncompressed.
//
// Parameters may be float32, float64, float16 or bfloat16, or several in one model (on a GPU, of
// one dtype): they are averaged in their dtype; the outer optimizer's state (the anchor and the
// momentum) is kept in float32, or float64 for a model with float64 parameters. The codecs other than none compress
// float32 changes and refuse other models, as sparse embedding tables other than float32 are refused.
//
// Sparse embedding tables (nn::Embedding / nn::EmbeddingBag with sparse(true)) are averaged by
// rows: each rank sends the rows its gradients touched since the last average, which step() reads
// from the tables' gradients; so between two step() calls a table must change only through its
// rows in the gradient (what an optimizer for sparse gradients does).
//
// A model on a CUDA device trains there: the handle keeps a pinned host copy of its parameters
// (allocated once, the size of the parameters); at each average the parameters leave the device
// once into it, are averaged in host memory as a CPU model's are (the codec and the outer
// optimizer too), and go back without blocking the host (ordered before the next kernels).
// Buffers and optimizer state are staged through pinned host memory the same way. Ranks may mix
// CPU and CUDA models: what travels is host memory either way. Between averages nothing leaves the
// device. A sparse table on a device travels whole between device and host at each average (its
// rows are still exchanged by rows between the ranks).
//
// Contract: every rank calls step() and synchronize() equally often (they are collectives of the
// job's workers), from the training thread. Errors are cohort::Error subclasses; every wait is
// bounded by the job's timeout.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>

namespace cohort {

struct COHORT_API AveragingOptions {
  int64_t period = 1;                  // steps between averages
  bool averageOptimizerState = false;  // needs the optimizer (SGD or Adam)
  std::string codec = "none";          // what the parameter changes travel as (any --codec)
  int64_t codecWarmupSteps = 0;        // averages during the first steps travel uncompressed
  // The outer optimizer (BMUF, Chen and Huo 2016; DiLoCo, Douillard et al. 2023): the averaged
  // change since the last average, D, is applied to the parameters x of the last average by an
  // optimizer of its own, with the momentum m kept on every rank alike:
  //   kSgd:      x += lr D
  //   kMomentum: m = mu m + D;  x += lr m
  //   kNesterov: m = mu m + D;  x += lr (D + mu m)
  // kSgd with lr 1 (the default) is plain averaging: the parameters become the mean, exactly.
  // Buffers and optimizer state are averaged plainly. The momentum is training state of its own:
  // checkpoint it with outerMomentum() (see ParameterAveraging).
  enum class Outer { kSgd, kMomentum, kNesterov };
  Outer outerOptimizer = Outer::kSgd;
  double outerLr = 1.0;
  double outerMomentum = 0.9;
};

struct COHORT_API AveragingStats {
  int64_t steps = 0;     // calls to step()
  int64_t averages = 0;  // averages taken
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0.0;
};

class COHORT_API ParameterAveraging {
 public:
  // Broadcasts rank 0's parameters and buffers (a collective). `optimizer` may be null unless
  // averageOptimizerState is set. Throws InvalidArgument for a module without parameters, models
  // that differ across ranks, a period below 1, or a codec that does not parse.
  ParameterAveraging(const Job& job, torch::nn::Module& module, torch::optim::Optimizer* optimizer = nullptr,
                     AveragingOptions options = {});
  ~ParameterAveraging();
  ParameterAveraging(const ParameterAveraging&) = delete;
  ParameterAveraging& operator=(const ParameterAveraging&) = delete;

  // After the optimizer's step: counts it, and averages on every period-th call. Returns whether
  // it averaged.
  bool step();
  // Averages now if any step was taken since the last average (before evaluation, checkpoints).
  void synchronize();

  AveragingStats stats() const;

  // The outer optimizer's momentum m, flat over the dense parameters in the module's order (a
  // copy); undefined when there is no outer optimizer (outer SGD, plain averaging) or no job. For
  // checkpoints: the outer state is whole right after an average (after synchronize()), when the
  // parameters are the anchor; a run resumed from such parameters and this momentum goes on
  // exactly as the uninterrupted one. setOuterMomentum() puts a saved one back (on every rank
  // alike, after constructing the handle over the restored module); it throws InvalidArgument when
  // the size differs from this model's, and ignores the tensor when there is no outer optimizer.
  torch::Tensor outerMomentum() const;
  void setOuterMomentum(const torch::Tensor& momentum);

  // The codec's state, training state as the outer momentum is and taken at the same point (after
  // synchronize()): the calls to step() so far, which decide when codecWarmupSteps ends, and the
  // residual of error feedback, flat over the dense parameters (undefined for a codec without one,
  // or without a codec or a job). setCodecState() puts a saved state back (every rank its own: the
  // residuals differ); it throws InvalidArgument for a residual of another size, or one given to a
  // handle whose codec keeps none.
  struct CodecState {
    int64_t steps = 0;
    torch::Tensor residual;
  };
  CodecState codecState() const;
  void setCodecState(const CodecState& state);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The optimizer's per-parameter state tensors (momentum buffers; Adam's exp_avg and exp_avg_sq),
// in parameter order, so that all ranks list them alike.
COHORT_API std::vector<torch::Tensor> optimizerStateTensors(torch::optim::Optimizer& optimizer);

}  // namespace cohort
