// The pipeline's dry run and timings (schemes/pipeline_profile.h).
#include "schemes/pipeline_profile.h"

#include "base/clock.h"
#include "models/cpu_generator.h"
#include "schemes/model_sync.h"
#include "schemes/pipeline_internal.h"
#include "schemes/pipeline_split.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace cohort {

namespace {

// Round trips timed by probeMessages (the first, which sets up the connection's buffers, is
// left out), and passes of timeLayers (after one that warms up).
constexpr int kProbes = 20;
constexpr int kTimedPasses = 3;

// "torch::nn::Conv2dImpl" -> "Conv2d"
std::string shortType(std::string name) {
  if (name.rfind("torch::nn::", 0) == 0) name = name.substr(11);
  if (const auto ns = name.rfind("::"); ns != std::string::npos) name = name.substr(ns + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

// One pass of timeLayers: each layer's forward, then each backward, in seconds.
std::vector<double> timeOnePass(torch::nn::Sequential& model, const torch::Tensor& inputs) {
  const size_t n = model->size();
  std::vector<torch::Tensor> ins(n);
  std::vector<torch::Tensor> outs(n);
  std::vector<double> seconds(n, 0.0);
  torch::Tensor x = inputs;
  for (size_t j = 0; j < n; ++j) {
    ins[j] = x.detach();
    // The model's input needs no gradient in training; every later layer's input does.
    if (j > 0 && ins[j].is_floating_point()) ins[j].requires_grad_(true);
    const auto start = Clock::now();
    try {
      outs[j] = (model->begin() + int64_t(j))->forward(ins[j]);
    } catch (const std::exception& e) {
      if (!inPlaceOnLeaf(e.what())) throw;
      outs[j] = (model->begin() + int64_t(j))->forward(ins[j].clone());  // as the stage would run it
    }
    seconds[j] = secondsSince(start);
    x = outs[j];
  }
  for (size_t j = n; j-- > 0;) {
    if (!outs[j].requires_grad()) continue;
    const auto start = Clock::now();
    outs[j].backward(torch::ones_like(outs[j]));
    seconds[j] += secondsSince(start);
  }
  return seconds;
}

}  // namespace

std::vector<int64_t> exampleShape(const torch::Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin() + 1, t.sizes().end());
}

std::vector<int64_t> withBatch(int64_t batch, const std::vector<int64_t>& example) {
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), example.begin(), example.end());
  return shape;
}

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

std::vector<int64_t> LayerProfile::headOf(int j, int c) const {
  auto shape = outputs[size_t(j)];
  shape[0] = c;
  return shape;
}

std::vector<int64_t> LayerProfile::packedOf(int j, int c) const { return {numel(inputOf(j)) + numel(headOf(j, c))}; }

std::vector<std::string> layerNames(const torch::nn::Sequential& model) {
  std::vector<std::string> names;
  for (const auto& child : model->named_children()) names.push_back(shortType(child.value()->name()));
  return names;
}

LayerProfile dryRun(torch::nn::Sequential& model, const torch::Tensor& sample) {
  const int64_t n = std::min<int64_t>(2, sample.size(0));
  std::vector<torch::Tensor> outputs;
  {
    torch::NoGradGuard noGrad;
    model->eval();
    torch::Tensor x = sample.narrow(0, 0, n);
    for (auto& layer : *model) {
      x = layer.forward(x);
      outputs.push_back(x);
    }
    model->train();
  }
  LayerProfile profile;
  profile.input = exampleShape(sample);
  const auto named = model->named_children();
  for (size_t j = 0; j < outputs.size(); ++j) {
    profile.outputs.push_back(exampleShape(outputs[j]));
    profile.types.push_back(outputs[j].scalar_type());
    profile.cutAfter.push_back(outputs[j].dim() >= 1 && outputs[j].size(0) == n);
    profile.channels.push_back(splittableChannels(*named[j].value(), outputs[j]));
  }
  return profile;
}

std::vector<double> timeLayers(torch::nn::Sequential& model, const torch::Tensor& inputs) {
  const torch::Tensor rng = cpuGeneratorState();
  std::vector<torch::Tensor> buffers;
  for (auto& b : model->buffers()) buffers.push_back(b.clone());

  std::vector<double> best(model->size(), std::numeric_limits<double>::infinity());
  for (int pass = 0; pass <= kTimedPasses; ++pass) {  // pass 0 warms up
    const std::vector<double> seconds = timeOnePass(model, inputs);
    if (pass == 0) continue;
    for (size_t j = 0; j < best.size(); ++j) best[j] = std::min(best[j], seconds[j]);
  }
  clearGradients(*model);
  {
    torch::NoGradGuard noGrad;
    auto now = model->buffers();
    for (size_t i = 0; i < now.size(); ++i) now[i].copy_(buffers[i]);
  }
  setCpuGeneratorState(rng);
  return best;
}

double probeMessages(Communicator& comm, int stages) {
  if (stages < 2 || comm.rank() > 1) return 0;
  auto buffer = torch::zeros({1}, torch::kFloat32);
  std::vector<double> rounds;
  for (int i = 0; i <= kProbes; ++i) {
    const auto start = Clock::now();
    if (comm.rank() == 0) {
      comm.send(buffer, 1, kProbeTag);
      comm.recv(buffer, 1, kProbeTag + 1);
    } else {
      comm.recv(buffer, 0, kProbeTag);
      comm.send(buffer, 0, kProbeTag + 1);
    }
    if (i > 0) rounds.push_back(secondsSince(start));
  }
  std::nth_element(rounds.begin(), rounds.begin() + kProbes / 2, rounds.end());
  return rounds[size_t(kProbes / 2)];
}

}  // namespace cohort
