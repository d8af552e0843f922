#include "base/clock.h"
#include "strategy/pipeline.h"

#include <cohort/error.h>

#include "models/cpu_generator.h"
#include "schemes/model_sync.h"
#include "strategy/local.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

namespace cohort {

namespace {

// Tags of the point-to-point messages: 2i for micro-batch i's activations, 2i+1 for its
// gradients; the others above any micro-batch's.
constexpr int kLossTag = 1 << 24;
constexpr int kEvalTag = kLossTag + 1;
constexpr int kEvalOutputTag = kLossTag + 2;
constexpr int kProbeTag = kLossTag + 3;  // and kProbeTag + 1
// Round trips timed by probeMessages (the first, which sets up the connection's buffers, is
// left out).
constexpr int kProbes = 20;
constexpr int kTimedPasses = 3;
// Steps at the start whose idle time and step time the report leaves out (as the Trainer's).
constexpr int64_t kWarmupSteps = 5;
constexpr const char* kManifest = "pipeline.manifest";
// What finish() gathers from each stage: peak activation bytes, then the steady steps' idle,
// step, compute, send and optimizer seconds.
constexpr int kGathered = 6;

int64_t nbytes(const torch::Tensor& t) { return int64_t(t.numel()) * int64_t(t.element_size()); }

// Gloo's point-to-point messages read and write host memory, so on a CUDA stage what crosses
// between stages is staged through pinned host memory. Before a send: copied device to host,
// blocking (Gloo's thread reads the host copy as soon as the send is posted; the send's handle
// keeps it alive until then). A CPU stage sends the tensor itself.
torch::Tensor toWire(const torch::Tensor& t) {
  if (t.device().is_cpu()) return t.contiguous();
  auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  host.copy_(t);
  return host;
}

// A receive buffer for a stage on `device`: pinned host memory when the stage is on a GPU.
torch::Tensor wireBuffer(const std::vector<int64_t>& shape, c10::ScalarType type, const c10::Device& device) {
  return torch::empty(shape, torch::TensorOptions().dtype(type).pinned_memory(!device.is_cpu()));
}

std::vector<int64_t> withBatch(int64_t batch, const std::vector<int64_t>& example) {
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), example.begin(), example.end());
  return shape;
}

std::vector<int64_t> exampleShape(const torch::Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin() + 1, t.sizes().end());
}

// "torch::nn::Conv2dImpl" -> "Conv2d"
std::string shortType(std::string name) {
  if (name.rfind("torch::nn::", 0) == 0) name = name.substr(11);
  if (const auto ns = name.rfind("::"); ns != std::string::npos) name = name.substr(ns + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

struct Manifest {
  int stages = 0;
  int replicas = 0;
  std::vector<int> counts;
  std::vector<int> splits;  // as PipelineStrategy::splits_
};

std::optional<Manifest> readManifest(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  Manifest m;
  std::string key;
  std::string cut;
  while (in >> key) {
    if (key == "stages") in >> m.stages;
    else if (key == "replicas") in >> m.replicas;
    else if (key == "cut") in >> cut;
    else std::getline(in, key);
  }
  COHORT_CHECK(m.stages > 0 && !cut.empty(), IoError, path, ": not a pipeline manifest");
  std::stringstream items(cut);
  for (std::string item; std::getline(items, item, ',');) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    long c = 0;
    if (end != item.c_str() && *end == '+') {
      const char* channels = end + 1;
      c = std::strtol(channels, &end, 10);
      if (end == channels || c <= 0) end = const_cast<char*>(item.c_str());
    }
    COHORT_CHECK(end != item.c_str() && *end == '\0' && v > 0, IoError, path, ": not a pipeline manifest (cut ",
                 cut, ")");
    m.counts.push_back(int(v));
    m.splits.push_back(int(c));
  }
  return m;
}

void writeManifest(const std::string& dir, const Manifest& m, const std::vector<std::string>& layers) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/" + kManifest;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "stages " << m.stages << "\nreplicas " << m.replicas << "\ncut " << joinCut(m.counts, m.splits) << "\n";
    out << "# layers per stage (L+C: and the first C output channels of the next layer); stage K's checkpoints "
           "are in stage-K/\n";
    for (size_t j = 0; j < layers.size(); ++j) out << "# layer " << j << " " << layers[j] << "\n";
    COHORT_CHECK(out.good(), IoError, tmp, ": cannot write the pipeline manifest");
  }
  std::filesystem::rename(tmp, path);
}

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// Output channels of a layer that a cut may split by channels (0: not splittable): a Conv2d of
// one group, a Linear on [batch, features]. `output` is its output in the dry run.
int64_t splittableChannels(const torch::nn::Module& layer, const torch::Tensor& output) {
  if (const auto* conv = dynamic_cast<const torch::nn::Conv2dImpl*>(&layer)) {
    return conv->options.groups() == 1 && output.dim() == 4 ? conv->options.out_channels() : 0;
  }
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&layer)) {
    return output.dim() == 2 ? linear->options.out_features() : 0;
  }
  return 0;
}

// Output channels [from, from + count) of a splittable layer: a new Conv2d or Linear of `count`
// channels with copies of those rows of the weight and bias. Constructing it draws nothing from
// the generator (its state is put back), so every stage's generator stays as in one process.
torch::nn::AnyModule channelSlice(const torch::nn::Module& layer, int64_t from, int64_t count) {
  const torch::Tensor rng = cpuGeneratorState();
  torch::nn::AnyModule out;
  torch::Tensor weight;
  torch::Tensor bias;
  if (const auto* conv = dynamic_cast<const torch::nn::Conv2dImpl*>(&layer)) {
    const auto& o = conv->options;
    torch::nn::Conv2d part(torch::nn::Conv2dOptions(o.in_channels(), count, o.kernel_size())
                               .stride(o.stride())
                               .padding(o.padding())
                               .dilation(o.dilation())
                               .groups(o.groups())
                               .bias(o.bias())
                               .padding_mode(o.padding_mode()));
    weight = part->weight;
    bias = part->bias;
    out = torch::nn::AnyModule(part);
    torch::NoGradGuard noGrad;
    weight.copy_(conv->weight.narrow(0, from, count));
    if (bias.defined()) bias.copy_(conv->bias.narrow(0, from, count));
  } else {
    const auto& linear = dynamic_cast<const torch::nn::LinearImpl&>(layer);
    auto options = linear.options;
    torch::nn::Linear part(options.out_features(count));
    weight = part->weight;
    bias = part->bias;
    out = torch::nn::AnyModule(part);
    torch::NoGradGuard noGrad;
    weight.copy_(linear.weight.narrow(0, from, count));
    if (bias.defined()) bias.copy_(linear.bias.narrow(0, from, count));
  }
  setCpuGeneratorState(rng);
  return out;
}

// A layer split between stages s and s+1 (--partition L+C): stage s runs SplitHead, its first C
// output channels, and sends them with the layer's input, packed in one [m, X + Y] tensor, so
// that one message each way still carries a micro-batch. The packing is by blocks, not by rows:
// the m inputs (m X values), then the m first parts (m Y values), so that both sides unpack
// contiguous tensors (a row-wise packing gave the convolution strided inputs and gradients,
// measured 10-25% slower on the cnn's). The m rows of a kept receive buffer are one contiguous
// block, so this holds on the wire as well. Stage s+1's SplitTail unpacks, computes the other channels from the input and
// outputs the layer's whole output. The gradient of the packed tensor goes back the same way:
// the input's part (from the second part's channels) joins, through the packing, the first
// part's gradient on stage s. Each part registers its slice of the weight and bias under the
// layer's names ("weight", "bias"), so a stage's checkpoint holds its rows of them.
class SplitPart : public torch::nn::Module {
 protected:
  explicit SplitPart(torch::nn::AnyModule part) : part_(std::move(part)) {
    for (const auto& p : part_.ptr()->named_parameters(/*recurse=*/false)) register_parameter(p.key(), p.value());
  }
  torch::nn::AnyModule part_;
};

class SplitHeadImpl : public SplitPart {
 public:
  explicit SplitHeadImpl(torch::nn::AnyModule part) : SplitPart(std::move(part)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::cat({x.reshape({-1}), part_.forward(x).reshape({-1})}).view({x.size(0), -1});
  }
};

class SplitTailImpl : public SplitPart {
 public:
  // One example's input of the layer, and its first part's output.
  SplitTailImpl(torch::nn::AnyModule part, std::vector<int64_t> input, std::vector<int64_t> head)
      : SplitPart(std::move(part)), input_(std::move(input)), head_(std::move(head)) {}
  torch::Tensor forward(const torch::Tensor& packed) {
    const int64_t m = packed.size(0);
    const int64_t x = m * numel(input_);
    const auto flat = packed.reshape({-1});
    const auto in = flat.narrow(0, 0, x).view(withBatch(m, input_));
    const auto first = flat.narrow(0, x, m * numel(head_)).view(withBatch(m, head_));
    return torch::cat({first, part_.forward(in)}, 1);
  }

 private:
  std::vector<int64_t> input_;
  std::vector<int64_t> head_;
};

}  // namespace

torch::nn::Sequential sliceModel(const torch::nn::Sequential& model, int first, int count) {
  torch::nn::Sequential out;
  const auto named = model->named_children();
  for (int j = first; j < first + count; ++j) out->push_back(named[size_t(j)].key(), *(model->begin() + j));
  return out;
}

PipelineStrategy::PipelineStrategy(std::shared_ptr<Communicator> comm, Options options, std::string checkpointDir,
                                   bool resume)
    : comm_(std::move(comm)),
      options_(std::move(options)),
      schedule_(parseSchedule(options_.schedule)),
      checkpointDir_(std::move(checkpointDir)),
      resume_(resume) {
  const int S = options_.stages;
  const int R = options_.replicas;
  COHORT_CHECK(S >= 1, InvalidArgument, "--stages must be positive, got ", S);
  COHORT_CHECK(R >= 1, InvalidArgument, "--replicas must be positive, got ", R);
  COHORT_CHECK(options_.microBatches >= 1 || options_.microBatches == kAutoMicroBatches, InvalidArgument,
               "--micro-batches must be positive or auto, got ", options_.microBatches);
  COHORT_CHECK(comm_ != nullptr && comm_->worldSize() == S * R, InvalidArgument, "--strategy pipeline --stages ", S,
               " --replicas ", R, " needs ", S * R, " processes (cohort launch -n ", S * R, "), but this job has ",
               comm_ ? comm_->worldSize() : 1);
  const bool splitCut = options_.partition == "split" || options_.partition.find('+') != std::string::npos;
  COHORT_CHECK(!(splitCut && options_.microBatches == kAutoMicroBatches), InvalidArgument, "--partition ",
               options_.partition, " splits a layer, which --micro-batches auto does not model: give a count of "
               "micro-batches, or a cut between layers (auto or L1,L2,...)");
  stage_ = comm_->rank() % S;
  replica_ = comm_->rank() / S;
  comm_->setRankNames([S, R](int rank) {
    std::string name = "rank " + std::to_string(rank) + " (stage " + std::to_string(rank % S);
    if (R > 1) name += " of replica " + std::to_string(rank / S);
    return name + ")";
  });
  std::vector<int> peers;
  for (int q = 0; q < R; ++q) peers.push_back(q * S + stage_);
  stageGroup_ = comm_->split(peers, "stage-" + std::to_string(stage_));
}

CheckpointPlan PipelineStrategy::checkpointPlan() const {
  return {.writes = replica_ == 0, .subdir = "stage-" + std::to_string(stage_), .group = stageGroup_};
}

std::string PipelineStrategy::layout() const {
  return "stage=" + std::to_string(stage_) + "/" + std::to_string(options_.stages) + " cut=" + joinCut(counts_, splits_);
}

torch::Tensor PipelineStrategy::forwardCounting(const torch::Tensor& x, int64_t* bytes) {
  torch::Tensor y = x;
  *bytes = nbytes(x);
  for (auto& layer : *model_) {
    y = layer.forward(y);
    *bytes += nbytes(y);
  }
  return y;
}

double PipelineStrategy::probeMessages() {
  if (options_.stages < 2 || comm_->rank() > 1) return 0;
  auto buffer = torch::zeros({1}, torch::kFloat32);
  std::vector<double> rounds;
  for (int i = 0; i <= kProbes; ++i) {
    const auto start = Clock::now();
    if (comm_->rank() == 0) {
      comm_->send(buffer, 1, kProbeTag);
      comm_->recv(buffer, 1, kProbeTag + 1);
    } else {
      comm_->recv(buffer, 0, kProbeTag);
      comm_->send(buffer, 0, kProbeTag + 1);
    }
    if (i > 0) rounds.push_back(secondsSince(start));
  }
  std::nth_element(rounds.begin(), rounds.begin() + kProbes / 2, rounds.end());
  return rounds[size_t(kProbes / 2)];
}

// Forward and backward time of each layer, on rank 0, on one micro-batch: the smallest of a few
// passes. Each layer runs on a detached copy of its input, so its backward can be timed alone.
// The generator and the buffers are put back afterwards, so timing changes nothing in training.
std::vector<double> PipelineStrategy::timeLayers(torch::nn::Sequential& model, const torch::Tensor& inputs) {
  const torch::Tensor rng = cpuGeneratorState();
  std::vector<torch::Tensor> buffers;
  for (auto& b : model->buffers()) buffers.push_back(b.clone());

  const size_t n = model->size();
  std::vector<double> best(n, std::numeric_limits<double>::infinity());
  for (int pass = 0; pass <= kTimedPasses; ++pass) {  // pass 0 warms up
    std::vector<torch::Tensor> ins(n);
    std::vector<torch::Tensor> outs(n);
    std::vector<double> seconds(n, 0.0);
    torch::Tensor x = inputs;
    for (size_t j = 0; j < n; ++j) {
      ins[j] = x.detach();
      // The model's input needs no gradient in training; every later layer's input does.
      if (j > 0 && ins[j].is_floating_point()) ins[j].requires_grad_(true);
      const auto start = Clock::now();
      outs[j] = (model->begin() + int64_t(j))->forward(ins[j]);
      seconds[j] = secondsSince(start);
      x = outs[j];
    }
    for (size_t j = n; j-- > 0;) {
      if (!outs[j].requires_grad()) continue;
      const auto start = Clock::now();
      outs[j].backward(torch::ones_like(outs[j]));
      seconds[j] += secondsSince(start);
    }
    if (pass > 0) {
      for (size_t j = 0; j < n; ++j) best[j] = std::min(best[j], seconds[j]);
    }
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

void PipelineStrategy::printCut(const std::vector<double>& costs, const std::vector<int>& counts,
                                const std::vector<int>& splits, const std::vector<int64_t>& channels) const {
  const int S = int(counts.size());
  std::string stages;
  double slowest = 0;
  double total = 0;
  double carried = 0;  // the second part of a split layer, on the next stage
  bool split = false;
  for (int s = 0, j = 0; s < S; ++s) {
    double cost = carried;
    carried = 0;
    const bool tail = s > 0 && size_t(s) - 1 < splits.size() && splits[size_t(s) - 1] > 0;
    for (int k = 0; k < counts[size_t(s)]; ++k, ++j) cost += (k == 0 && tail) ? 0.0 : costs[size_t(j)];
    if (size_t(s) < splits.size() && splits[size_t(s)] > 0) {
      const double share = double(splits[size_t(s)]) / double(channels[size_t(j)]);
      cost += costs[size_t(j)] * share;
      carried = costs[size_t(j)] * (1 - share);
      split = true;
    }
    slowest = std::max(slowest, cost);
    total += cost;
    char item[64];
    std::snprintf(item, sizeof(item), "%s%.2f ms", s == 0 ? "" : ", ", cost * 1e3);
    stages += item;
  }
  std::string how = "layers per stage";
  if (split) {
    for (int s = 0, j = 0; s + 1 < S; ++s) {
      j += counts[size_t(s)];
      if (splits[size_t(s)] == 0) continue;
      how += "; stage " + std::to_string(s) + " also computes " + std::to_string(splits[size_t(s)]) + " of the " +
             std::to_string(channels[size_t(j)]) + " output channels of layer " + std::to_string(j) + " (" +
             layerNames_[size_t(j)] + "), stage " + std::to_string(s + 1) + " the others";
    }
  }
  std::fprintf(stderr,
               "cohort: pipeline: cut %s (%s); predicted time per stage %s; slowest stage %.2fx the mean (1.00 is "
               "perfect balance)\n",
               joinCut(counts, splits).c_str(), how.c_str(), stages.c_str(), slowest / (total / S));
}

// --micro-batches auto, on rank 0: every layer timed on 1 example and on the whole batch gives
// its cost per micro-batch and per example (a straight line through the two), and
// chooseMicroBatches (pipeline_plan.h) picks M and, with --partition auto, the cut at that M.
MicroBatchChoice PipelineStrategy::chooseMicroBatchCount(torch::nn::Sequential& model, const Batch& sample,
                                                         const std::vector<bool>& cutAfter,
                                                         const std::vector<int>& counts, double messageSeconds) {
  const int64_t B = sample.size();
  const std::vector<double> one = timeLayers(model, sample.inputs.narrow(0, 0, 1));
  const std::vector<double> all = B > 1 ? timeLayers(model, sample.inputs) : one;
  MicroBatchCosts costs;
  costs.messageSeconds = messageSeconds;
  for (size_t j = 0; j < one.size(); ++j) {
    const double perExample = B > 1 ? std::max(0.0, (all[j] - one[j]) / double(B - 1)) : 0.0;
    costs.perExample.push_back(perExample);
    costs.perMicroBatch.push_back(std::max(0.0, one[j] - perExample));
  }
  const MicroBatchChoice choice = chooseMicroBatches(costs, B, options_.stages, counts, cutAfter);
  const int64_t m = (B + choice.microBatches - 1) / choice.microBatches;
  std::fprintf(stderr,
               "cohort: pipeline: --micro-batches auto chose M = %d (micro-batches of %lld examples or fewer): the "
               "slowest stage's fixed cost per micro-batch is %.3f ms (per-op overheads %.3f ms, messages %.3f ms "
               "measured), its work per micro-batch %.2f ms; predicted step %.1f ms (M = 1: %.1f ms)\n",
               choice.microBatches, (long long)m, choice.fixedSeconds * 1e3,
               (choice.fixedSeconds - (options_.stages > 1 ? messageSeconds : 0.0)) * 1e3, messageSeconds * 1e3,
               (choice.slotSeconds - choice.fixedSeconds) * 1e3, choice.stepSeconds * 1e3,
               predictStep(costs, B, options_.stages, choice.counts, 1).stepSeconds * 1e3);
  std::vector<double> atChoice;
  for (size_t j = 0; j < one.size(); ++j) atChoice.push_back(costs.perMicroBatch[j] + costs.perExample[j] * double(m));
  printCut(atChoice, choice.counts);
  autoChoice_ = choice;
  return choice;
}

void PipelineStrategy::chooseCut(torch::nn::Sequential& model, const Batch& sample, const std::vector<bool>& cutAfter,
                                 const std::vector<int64_t>& channels) {
  const int S = options_.stages;
  const int L = int(model->size());
  const bool automatic = options_.partition == "auto" || options_.partition == "split";
  std::vector<int> counts;
  std::vector<int> splits(size_t(S), 0);
  if (!automatic) counts = parsePartition(options_.partition, S, L, &splits);
  // Layers per stage, the splits, then M.
  std::vector<int64_t> wire(2 * size_t(S) + 1, options_.microBatches);
  const bool autoMicroBatches = options_.microBatches == kAutoMicroBatches;
  // Ranks 0 and 1 time the messages first (every rank calls chooseCut).
  const double messageSeconds = autoMicroBatches ? probeMessages() : 0.0;
  if (comm_->rank() == 0) {
    // The manifest of the checkpoints to resume decides, when there is one.
    const std::string manifestPath = checkpointDir_ + "/" + kManifest;
    std::optional<Manifest> manifest;
    if (resume_ && !checkpointDir_.empty()) manifest = readManifest(manifestPath);
    if (manifest) {
      const std::string theirs = joinCut(manifest->counts, manifest->splits);
      COHORT_CHECK(manifest->stages == S, InvalidArgument, manifestPath, ": the checkpoints are of a ",
                   manifest->stages, "-stage pipeline (cut ", theirs, "), but this run has --stages ", S,
                   ": resume with --stages ", manifest->stages, " --partition ", theirs,
                   ", or start in a new --checkpoint-dir");
      if (automatic) {
        counts = manifest->counts;
        splits = manifest->splits;
        std::fprintf(stderr, "cohort: pipeline: resuming with the checkpoints' cut %s (%s)\n", theirs.c_str(),
                     manifestPath.c_str());
      }
      COHORT_CHECK(counts == manifest->counts && splits == manifest->splits, InvalidArgument, manifestPath,
                   ": the checkpoints cut the model as ", theirs,
                   " (layers per stage), but this run asks for --partition ", joinCut(counts, splits),
                   ": resume with --partition ", theirs, " (or auto), or start in a new --checkpoint-dir");
    }
    if (autoMicroBatches) {
      const MicroBatchChoice choice = chooseMicroBatchCount(model, sample, cutAfter, counts, messageSeconds);
      counts = choice.counts;
      wire[2 * size_t(S)] = choice.microBatches;
    } else if (counts.empty()) {
      const int64_t micro = std::max<int64_t>(1, (sample.size() + options_.microBatches - 1) / options_.microBatches);
      const std::vector<double> costs = timeLayers(model, sample.inputs.narrow(0, 0, std::min(micro, sample.size())));
      if (options_.partition == "split") {
        const SplitCut cut = balanceStagesSplit(costs, S, cutAfter, channels);
        counts = cut.counts;
        splits = cut.splits;
      } else {
        counts = balanceStages(costs, S, cutAfter);
      }
      std::string text = "cohort: pipeline: --partition " + options_.partition +
                         " measured forward+backward per layer on a micro-batch of " + std::to_string(micro) + ":";
      for (int j = 0; j < L; ++j) {
        char item[96];
        std::snprintf(item, sizeof(item), " %s %.2f ms", layerNames_[size_t(j)].c_str(), costs[size_t(j)] * 1e3);
        text += item;
      }
      std::fprintf(stderr, "%s\n", text.c_str());
      printCut(costs, counts, splits, channels);
    }
    for (int s = 0; s < S; ++s) {
      wire[size_t(s)] = counts[size_t(s)];
      wire[size_t(S + s)] = splits[size_t(s)];
    }
  }
  // Rank 0's cut is everyone's (timing differs between processes).
  auto shared = torch::tensor(wire, torch::kInt64);
  comm_->broadcast(shared, 0);
  counts_.assign(size_t(S), 0);
  splits_.assign(size_t(S), 0);
  for (int s = 0; s < S; ++s) {
    counts_[size_t(s)] = int(shared[s].item<int64_t>());
    splits_[size_t(s)] = int(shared[S + s].item<int64_t>());
  }
  options_.microBatches = int(shared[2 * S].item<int64_t>());
}

torch::nn::Sequential PipelineStrategy::localModel(torch::nn::Sequential model, const Batch& sample) {
  const int S = options_.stages;
  const int L = int(model->size());
  const auto named = model->named_children();
  for (int j = 0; j < L; ++j) layerNames_.push_back(shortType(named[size_t(j)].value()->name()));
  COHORT_CHECK(!(L == 1 && named[0].key() == "script"), InvalidArgument,
               "--strategy pipeline: the TorchScript model's top level is not an nn.Sequential, so it is one layer "
               "and cannot be cut into stages: script an nn.Sequential whose children are the layers");
  std::string names;
  for (int j = 0; j < L; ++j) names += (j ? ", " : "") + std::to_string(j) + " " + layerNames_[size_t(j)];
  COHORT_CHECK(S <= L, InvalidArgument, "--stages ", S, " is more than the model's ", L, " layers (", names,
               "): every stage needs at least one layer, use --stages ", L, " or fewer");

  // The dry run: every layer's output shape for a batch of 2, in evaluation mode, without
  // gradients (no generator draws, no buffer updates).
  std::vector<torch::Tensor> outputs;
  {
    torch::NoGradGuard noGrad;
    model->eval();
    torch::Tensor x = sample.inputs.narrow(0, 0, std::min<int64_t>(2, sample.size()));
    for (auto& layer : *model) {
      x = layer.forward(x);
      outputs.push_back(x);
    }
    model->train();
  }
  const int64_t n = std::min<int64_t>(2, sample.size());
  std::vector<bool> cutAfter(size_t(L), false);
  std::vector<int64_t> channels(size_t(L), 0);
  for (int j = 0; j < L; ++j) {
    cutAfter[size_t(j)] = outputs[size_t(j)].dim() >= 1 && outputs[size_t(j)].size(0) == n;
    channels[size_t(j)] = splittableChannels(*named[size_t(j)].value(), outputs[size_t(j)]);
  }
  chooseCut(model, sample, cutAfter, channels);
  const std::string cut = joinCut(counts_, splits_);
  int firstLayer = 0;
  for (int s = 0; s < stage_; ++s) firstLayer += counts_[size_t(s)];
  for (int s = 0, j = 0; s + 1 < S; ++s) {
    j += counts_[size_t(s)];
    COHORT_CHECK(cutAfter[size_t(j - 1)], InvalidArgument, "--partition ", cut, " cuts after layer ", j - 1, " (",
                 layerNames_[size_t(j - 1)], "), whose output does not have the batch as its first dimension: cut elsewhere");
    const int c = splits_[size_t(s)];
    COHORT_CHECK(c == 0 || channels[size_t(j)] > 0, InvalidArgument, "--partition ", cut, " splits layer ", j, " (",
                 layerNames_[size_t(j)], "), but only a Conv2d or a Linear on [batch, features] can be split by "
                 "output channels");
    COHORT_CHECK(c < channels[size_t(j)] || c == 0, InvalidArgument, "--partition ", cut, " gives stage ", s, " ", c,
                 " output channels of layer ", j, " (", layerNames_[size_t(j)], "), which has ", channels[size_t(j)],
                 ": give 1 to ", channels[size_t(j)] - 1);
  }
  // Layer j split after its first c channels: one example's input, the first part's output, and
  // what crosses between the stages (both, packed).
  auto layerInput = [&](int j) { return exampleShape(j == 0 ? sample.inputs : outputs[size_t(j - 1)]); };
  auto headShape = [&](int j, int c) {
    auto shape = exampleShape(outputs[size_t(j)]);
    shape[0] = c;
    return shape;
  };
  auto packedShape = [&](int j, int c) { return std::vector<int64_t>{numel(layerInput(j)) + numel(headShape(j, c))}; };
  const int lastLayer = firstLayer + counts_[size_t(stage_)] - 1;
  if (stage_ > 0 && splits_[size_t(stage_) - 1] > 0) {
    inShape_ = packedShape(firstLayer, splits_[size_t(stage_) - 1]);
    inType_ = outputs[size_t(firstLayer)].scalar_type();
  } else if (stage_ > 0) {
    inShape_ = exampleShape(outputs[size_t(firstLayer - 1)]);
    inType_ = outputs[size_t(firstLayer - 1)].scalar_type();
  }
  if (splits_[size_t(stage_)] > 0) {
    outShape_ = packedShape(lastLayer + 1, splits_[size_t(stage_)]);
    outType_ = outputs[size_t(lastLayer + 1)].scalar_type();
  } else {
    outShape_ = exampleShape(outputs[size_t(lastLayer)]);
    outType_ = outputs[size_t(lastLayer)].scalar_type();
  }
  modelOutShape_ = exampleShape(outputs.back());
  modelOutType_ = outputs.back().scalar_type();
  auto local = sliceModel(model, firstLayer, counts_[size_t(stage_)]);
  if (stage_ == 0 && splits_[0] == 0) return local;
  // Put the split layers' parts in place of (or after) the whole layers.
  torch::nn::Sequential out;
  const auto& mine = local->named_children();
  for (int k = 0; k < int(mine.size()); ++k) {
    const int j = firstLayer + k;
    const int c = stage_ > 0 ? splits_[size_t(stage_) - 1] : 0;
    if (k == 0 && c > 0) {
      out->push_back(mine[0].key(), std::make_shared<SplitTailImpl>(channelSlice(*mine[0].value(), c,
                                                                                 channels[size_t(j)] - c),
                                                                    layerInput(j), headShape(j, c)));
    } else {
      out->push_back(mine[size_t(k)].key(), *(local->begin() + k));
    }
  }
  if (const int c = splits_[size_t(stage_)]; c > 0) {
    const int j = lastLayer + 1;
    out->push_back(named[size_t(j)].key(), std::make_shared<SplitHeadImpl>(channelSlice(*named[size_t(j)].value(), 0, c)));
  }
  return out;
}

void PipelineStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  COHORT_CHECK(!counts_.empty(), Error, "PipelineStrategy::attach before localModel");
  model_ = std::move(model);
  optimizer_ = &optimizer;
  // The stage's replicas start alike (after a resume too: each restored the same bytes).
  if (options_.replicas > 1) broadcastModel(*stageGroup_, *model_);
  if (comm_->rank() == 0 && !checkpointDir_.empty()) {
    writeManifest(checkpointDir_, {options_.stages, options_.replicas, counts_, splits_}, layerNames_);
  }
}

StepStats PipelineStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(optimizer_ != nullptr, Error, "PipelineStrategy::step before attach");
  const auto start = Clock::now();
  const CommCounters before = comm_->counters();
  const int64_t B = batch.size();
  // Micro-batch sizes: B split as evenly as possible; every stage computes the same.
  const int M = int(std::min<int64_t>(options_.microBatches, B));
  std::vector<int64_t> size(size_t(M), B / M);
  std::vector<int64_t> offset(size_t(M), 0);
  for (int i = 0; i < M; ++i) {
    if (i < B % M) ++size[size_t(i)];
    if (i > 0) offset[size_t(i)] = offset[size_t(i) - 1] + size[size_t(i) - 1];
  }

  clearGradients(*model_);
  struct Held {
    torch::Tensor input;
    torch::Tensor output;  // the last stage: the micro-batch's share of the loss
    int64_t bytes = 0;
  };
  std::vector<Held> held(static_cast<size_t>(M));
  std::vector<CommWork> sends;
  sends.reserve(size_t(2 * M));
  StepTimes times;
  double lossSum = 0;
  // Receives are posted one micro-batch ahead in each direction (both schedules consume
  // micro-batches in order), so a message that arrives early finds its buffer waiting; at most
  // one extra buffer per direction, which keeps 1F1B's memory bound.
  //
  // The buffers are kept from step to step, so the receive path allocates nothing once the first
  // step has run: K per direction, micro-batch i in buffer i mod K, each sized for the largest
  // micro-batch (i receives into its first m_i rows). K is the schedule's peak of micro-batches in
  // flight plus the one posted ahead: when i+K is posted (on taking i+K-1), the micro-batches in
  // flight are at most the peak, all after i, so i's backward has run and its graph is freed.
  const std::vector<PipeOp> ops = makeSchedule(schedule_, options_.stages, stage_, M);
  const size_t K = size_t(std::min(M, peakInFlight(ops) + 1));
  std::vector<CommWork> activationWork(static_cast<size_t>(M));
  std::vector<CommWork> gradientWork(static_cast<size_t>(M));
  //
  // On a CUDA stage (the device of the batch, where the Trainer put it and the stage's layers) the
  // buffers are pinned host memory, and a micro-batch's rows are copied to the device without
  // blocking. That copy may still be reading the buffer when the receive of micro-batch i+K is
  // posted, so the slot is not kept: the next post takes a new block from the caching host
  // allocator, which hands a block out again only once the copies that read it have completed
  // (the copy records itself on the block). After the first steps those blocks are reused, so the
  // receive path still allocates no new pinned memory.
  const c10::Device device = batch.inputs.device();
  auto post = [&](std::vector<torch::Tensor>& buffers, std::vector<CommWork>& work, int i, bool forward) {
    if (i >= M || work[size_t(i)].valid()) return;
    const auto largest = withBatch(size[0], forward ? inShape_ : outShape_);
    if (buffers.size() < K) buffers.resize(K);
    torch::Tensor& buffer = buffers[size_t(i) % K];
    if (!buffer.defined() || buffer.sizes() != c10::IntArrayRef(largest)) {
      buffer = wireBuffer(largest, forward ? inType_ : outType_, device);
    }
    work[size_t(i)] = comm_->recvAsync(buffer.narrow(0, 0, size[size_t(i)]), forward ? prevRank() : nextRank(),
                                       2 * i + (forward ? 0 : 1));
  };
  // Micro-batch i's rows of its buffer, once they arrived (a new handle on them, so that autograd
  // state never stays on the kept buffer), on the stage's device; the time blocked is idle time.
  auto take = [&](std::vector<torch::Tensor>& buffers, std::vector<CommWork>& work, int i, bool forward) {
    post(buffers, work, i, forward);
    post(buffers, work, i + 1, forward);
    times.idle += work[size_t(i)].wait();
    torch::Tensor& buffer = buffers[size_t(i) % K];
    const torch::Tensor rows = buffer.narrow(0, 0, size[size_t(i)]);
    if (device.is_cpu()) return rows.detach();
    torch::Tensor onDevice = rows.to(device, /*non_blocking=*/true);
    buffer = torch::Tensor();
    return onDevice;
  };
  if (!first()) post(activationBuffers_, activationWork, 0, true);
  if (!last()) post(gradientBuffers_, gradientWork, 0, false);
  int64_t live = 0;
  int64_t peak = 0;
  for (const PipeOp& op : ops) {
    Held& h = held[size_t(op.micro)];
    const int64_t m = size[size_t(op.micro)];
    if (op.forward) {
      if (first()) {
        h.input = batch.inputs.narrow(0, offset[size_t(op.micro)], m);
      } else {
        h.input = take(activationBuffers_, activationWork, op.micro, true);
        if (h.input.is_floating_point()) h.input.requires_grad_(true);
      }
      auto computeStart = Clock::now();
      h.output = forwardCounting(h.input, &h.bytes);
      if (last()) {
        auto targets = batch.targets.narrow(0, offset[size_t(op.micro)], m);
        h.output = loss(h.output, targets) * (double(m) / double(B));
        lossSum += h.output.item<double>();
        times.forward += secondsSince(computeStart);
      } else {
        times.forward += secondsSince(computeStart);
        const auto sendStart = Clock::now();
        sends.push_back(comm_->sendAsync(toWire(h.output.detach()), nextRank(), 2 * op.micro));
        times.send += secondsSince(sendStart);
      }
      live += h.bytes;
      peak = std::max(peak, live);
    } else {
      // A stage with nothing to differentiate (a Flatten alone at the front) has no graph.
      if (last()) {
        const auto computeStart = Clock::now();
        if (h.output.requires_grad()) h.output.backward();
        times.backward += secondsSince(computeStart);
      } else {
        auto grad = take(gradientBuffers_, gradientWork, op.micro, false);
        const auto computeStart = Clock::now();
        if (h.output.requires_grad()) h.output.backward(grad);
        times.backward += secondsSince(computeStart);
      }
      if (!first() && h.input.requires_grad()) {
        const auto sendStart = Clock::now();
        auto grad = h.input.grad();
        if (!grad.defined()) grad = torch::zeros_like(h.input);
        sends.push_back(comm_->sendAsync(toWire(grad), prevRank(), 2 * op.micro + 1));
        times.send += secondsSince(sendStart);
      }
      live -= h.bytes;
      h = Held{};  // frees the micro-batch's graph
    }
  }
  const double idle = times.idle;
  double waited = idle;
  for (auto& s : sends) times.sendWait += s.wait();
  waited += times.sendWait;

  if (options_.replicas > 1) {
    std::vector<torch::Tensor> grads;
    for (auto& p : model_->parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      grads.push_back(p.grad());
    }
    const auto waitStart = Clock::now();
    averageInPlace(*stageGroup_, grads);
    waited += secondsSince(waitStart);
  }
  const auto optimizerStart = Clock::now();
  optimizer_->step();
  times.optimizer = secondsSince(optimizerStart);

  // The chief (stage 0 of replica 0) reports the loss, which the last stage knows.
  if (options_.stages > 1 && replica_ == 0 && (first() || last())) {
    if (last()) {
      waited += lossSend_.wait();
      lossSend_ = comm_->sendAsync(torch::tensor({lossSum}, torch::kFloat64), 0, kLossTag);
    } else {
      auto value = torch::empty({1}, torch::kFloat64);
      waited += comm_->recvAsync(value, options_.stages - 1, kLossTag).wait();
      lossSum = value.item<double>();
    }
  }

  const double seconds = secondsSince(start);
  if (++steps_ > kWarmupSteps) {
    idleSeconds_ += idle;
    stepSeconds_ += seconds;
    steadyTimes_.forward += times.forward;
    steadyTimes_.backward += times.backward;
    steadyTimes_.send += times.send;
    steadyTimes_.sendWait += times.sendWait;
    steadyTimes_.optimizer += times.optimizer;
  }
  peakActivationBytes_ = std::max(peakActivationBytes_, peak);
  const CommCounters after = comm_->counters();
  StepStats stats;
  stats.loss = lossSum;
  stats.samples = B * options_.replicas;
  stats.bytesSent = after.bytesSent - before.bytesSent;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived;
  stats.commWaitSeconds = waited;
  stats.computeSeconds = seconds - waited;
  // Where the step went: compute, blocked on a neighbour (idle), posting and finishing sends,
  // the optimizer; "other_s" is the rest (the loss message, averaging over replicas, the
  // schedule's bookkeeping).
  const double other = seconds - times.forward - times.backward - idle - times.send - times.sendWait - times.optimizer;
  stats.extra = {{"idle_s", idle},
                 {"peak_activation_bytes", peak},
                 {"micro_batches", int64_t(M)},
                 {"forward_s", times.forward},
                 {"backward_s", times.backward},
                 {"send_s", times.send},
                 {"send_wait_s", times.sendWait},
                 {"optimizer_s", times.optimizer},
                 {"other_s", other}};
  return stats;
}

torch::Tensor PipelineStrategy::infer(torch::nn::Sequential& model, const torch::Tensor& inputs) {
  if (options_.stages == 1) return model->forward(inputs);
  const int64_t n = inputs.size(0);
  torch::Tensor x = inputs;
  if (!first()) {
    x = wireBuffer(withBatch(n, inShape_), inType_, inputs.device());
    comm_->recv(x, prevRank(), kEvalTag);
    x = x.to(inputs.device());
  }
  auto y = toWire(model->forward(x));
  if (!last()) {
    comm_->send(y, nextRank(), kEvalTag);
  } else {
    comm_->send(y, 0, kEvalOutputTag);
  }
  if (!first()) return {};
  auto out = torch::empty(withBatch(n, modelOutShape_), torch::TensorOptions().dtype(modelOutType_));
  comm_->recv(out, options_.stages - 1, kEvalOutputTag);
  return out;
}

void PipelineStrategy::synchronize() {
  lossSend_.wait();
  // Buffers (BatchNorm's statistics) are updated by each replica from its own batches.
  if (options_.replicas > 1) averageInPlace(*stageGroup_, model_->buffers());
}

void PipelineStrategy::finish() {
  lossSend_.wait();
  const StepTimes& t = steadyTimes_;
  auto mine = torch::tensor({double(peakActivationBytes_), idleSeconds_, stepSeconds_, t.forward + t.backward,
                             t.send + t.sendWait, t.optimizer},
                            torch::kFloat64);
  auto all = comm_->allgather(mine);
  gathered_.clear();
  for (auto& g : all) {
    for (int k = 0; k < kGathered; ++k) gathered_.push_back(g[k].item<double>());
  }
}

MetricFields PipelineStrategy::report() {
  const int S = options_.stages;
  std::vector<int64_t> peaks;
  std::vector<double> idle;
  double bubble = 0;
  std::vector<double> compute;
  std::vector<double> send;
  std::vector<double> optimizer;
  // Replica 0's stages.
  for (int s = 0; s < S && size_t(kGathered * (s + 1)) <= gathered_.size(); ++s) {
    const double* g = &gathered_[size_t(kGathered * s)];
    peaks.push_back(int64_t(g[0]));
    const double step = g[2];
    auto fraction = [step](double x) { return step > 0 ? x / step : 0.0; };
    idle.push_back(fraction(g[1]));
    compute.push_back(fraction(g[3]));
    send.push_back(fraction(g[4]));
    optimizer.push_back(fraction(g[5]));
    bubble += idle.back() / S;
  }
  // The bubble the schedule predicts for the stages' measured compute (unequal stages included):
  // with t_s a stage's compute per micro-batch, a step takes about sum(t) + (M-1) max(t), and
  // stage s idles 1 - M t_s / that. Equal stages give (S-1)/(M+S-1); what the measured bubble has
  // beyond this is the cost of the messages and of the waits between stages.
  double expected = 0;
  if (!compute.empty()) {
    const double sum = std::accumulate(compute.begin(), compute.end(), 0.0);
    const double slowest = *std::max_element(compute.begin(), compute.end());
    const int M = options_.microBatches;
    const double step = sum + double(M - 1) * slowest;
    for (double c : compute) expected += (step > 0 ? 1.0 - double(M) * c / step : 0.0) / double(compute.size());
  }
  std::vector<int64_t> cut(counts_.begin(), counts_.end());
  std::vector<int64_t> splits(splits_.begin(), splits_.end());
  const int M = options_.microBatches;
  MetricFields fields{{"stages", int64_t(S)},
                      {"replicas", int64_t(options_.replicas)},
                      {"micro_batches", int64_t(M)},
                      {"micro_batches_auto", autoChoice_.has_value()},
                      {"schedule", options_.schedule},
                      {"cut", cut},
                      {"cut_split_channels", splits},
                      {"stage_peak_activation_bytes", peaks},
                      {"stage_idle_fraction", idle},
                      {"stage_compute_fraction", compute},
                      {"stage_send_fraction", send},
                      {"stage_optimizer_fraction", optimizer},
                      {"bubble_fraction", bubble},
                      {"bubble_fraction_theory", double(S - 1) / double(M + S - 1)},
                      {"bubble_fraction_expected", expected}};
  if (autoChoice_) {
    fields.push_back({"micro_batch_fixed_cost_s", autoChoice_->fixedSeconds});
    fields.push_back({"micro_batch_work_s", autoChoice_->slotSeconds - autoChoice_->fixedSeconds});
    fields.push_back({"predicted_step_s", autoChoice_->stepSeconds});
  }
  return fields;
}

}  // namespace cohort
