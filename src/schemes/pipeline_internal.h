// The pipeline handle's state (include/cohort/pipeline.h), shared by its files: pipeline.cpp (the
// handle: construction, evaluation, the summary), pipeline_cut.cpp (where the model is cut),
// pipeline_step.cpp (a training step in the schedule's order). The layers' shapes and timings are
// in pipeline_profile.h, the split layers in pipeline_split.h, the manifest in pipeline_manifest.h.
#pragma once

#include <cohort/communicator.h>
#include <cohort/pipeline.h>

#include "schemes/pipeline_plan.h"
#include "schemes/pipeline_profile.h"

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

// Tags of the point-to-point messages: 2i for micro-batch i's activations, 2i+1 for its
// gradients; the others above any micro-batch's.
constexpr int kLossTag = 1 << 24;
constexpr int kEvalTag = kLossTag + 1;
constexpr int kEvalOutputTag = kLossTag + 2;
constexpr int kProbeTag = kLossTag + 3;  // and kProbeTag + 1
// A step's (and an evaluation's) batch size, sent to the next stage before the activations: a
// stage posts its receives sized for its own batch, and Gloo aborts the process on a message of
// another size, so each checks its predecessor's first (checkBatchOfPrevious).
constexpr int kBatchTag = kLossTag + 5;
constexpr int kEvalBatchTag = kLossTag + 6;
// Steps at the start whose idle time and step time the summary leaves out (as the Trainer's).
constexpr int64_t kWarmupSteps = 5;

// What crosses between stages, for one example: the shape and dtype of this stage's input
// (stages > 0), of its output, and of the whole model's output (the evaluation's last message).
struct StageWire {
  std::vector<int64_t> inShape;
  std::vector<int64_t> outShape;
  std::vector<int64_t> modelOutShape;
  c10::ScalarType inType = c10::kFloat;
  c10::ScalarType outType = c10::kFloat;
  c10::ScalarType modelOutType = c10::kFloat;
};

// The steady steps' times, summed (seconds).
struct StepTimes {
  double forward = 0;
  double backward = 0;
  double idle = 0;
  double send = 0;
  double sendWait = 0;
  double optimizer = 0;
};

struct COHORT_LOCAL Pipeline::Impl {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Communicator> stageGroup;  // this stage in every replica
  PipelineOptions options;                   // microBatches as chosen
  int stage = 0;
  int replica = 0;

  std::vector<int> counts;  // layers per stage (a split layer counts in the later stage)
  // Per stage: output channels of the next stage's first layer that this stage computes (0: the
  // stages meet between layers; the last stage's is 0). See SplitHead in pipeline_split.cpp.
  std::vector<int> splits;
  std::optional<MicroBatchChoice> autoChoice;  // kAutoMicroBatches, on rank 0
  std::vector<std::string> layerNames;
  StageWire wire;
  torch::nn::Sequential module{nullptr};  // this stage's layers
  // The stage's first layer writes its input in place (ReLU(inplace), a scripted relu_): the
  // received activation, a leaf that requires its gradient, goes in as a copy (see inPlaceOnLeaf).
  bool copyInput = false;

  CommWork lossSend;
  // Receive buffers kept from step to step, as many as micro-batches can be in flight plus one
  // (stages > 0: activations in; stages < S-1: gradients in). See pipeline_step.cpp.
  std::vector<torch::Tensor> activationBuffers;
  std::vector<torch::Tensor> gradientBuffers;

  // Measured over the steps after the first kWarmupSteps, for the summary.
  int64_t steps = 0;
  int64_t peakActivationBytes = 0;
  double stepSeconds = 0;
  StepTimes steady;

  int stages() const { return options.stages; }
  bool first() const { return stage == 0; }
  bool last() const { return stage == options.stages - 1; }
  int prevRank() const { return comm->rank() - 1; }
  int nextRank() const { return comm->rank() + 1; }

  // pipeline_cut.cpp: sets counts, splits and options.microBatches (rank 0 decides, everyone gets
  // its choice), then checks the cut against the layers.
  void chooseCut(torch::nn::Sequential& model, const torch::Tensor& sample, const LayerProfile& profile);
  // Stage s > 0: receives the batch size stage s-1 sent under `tag` and throws InvalidArgument,
  // naming both, when it is not `batch`; returns the seconds waited. pipeline_step.cpp.
  double checkBatchOfPrevious(int64_t batch, int tag, const char* who);
  // pipeline_step.cpp.
  PipelineStepStats step(const torch::Tensor& inputs, const torch::Tensor& targets, const PipelineLoss& loss,
                         torch::optim::Optimizer& optimizer);
};

// Whether an exception's what() is autograd refusing an in-place operation on a leaf that
// requires its gradient (or on a view of one): what a layer such as ReLU(inplace) does to a
// stage's received activation. A c10::Error from a C++ layer, a std::runtime_error from a
// TorchScript one (the interpreter rethrows it with the script's frames), so callers catch
// std::exception.
bool inPlaceOnLeaf(const std::string& what);

// Gloo's point-to-point messages read and write host memory (pipeline_step.cpp). Before a send:
// a CUDA tensor copied to pinned host memory, blocking (Gloo's thread reads the host copy as soon
// as the send is posted; the send's handle keeps it alive until then); a CPU tensor itself.
torch::Tensor toWire(const torch::Tensor& t);
// A receive buffer for a stage on `device`: pinned host memory when the stage is on a GPU.
torch::Tensor wireBuffer(const std::vector<int64_t>& shape, c10::ScalarType type, const c10::Device& device);

}  // namespace cohort
