// One training step of a pipeline stage (Pipeline::Impl::step, schemes/pipeline_internal.h): the
// batch cut into micro-batches, each one's forward and backward in the schedule's order with the
// neighbouring stages' messages, the gradients averaged over the stage's copies, the optimizer.
#include <cohort/autocast.h>
#include <cohort/error.h>

#include "base/clock.h"
#include "schemes/model_sync.h"
#include "schemes/pipeline_internal.h"

#include <algorithm>

namespace cohort {

namespace {

int64_t nbytes(const torch::Tensor& t) { return int64_t(t.numel()) * int64_t(t.element_size()); }

// Micro-batch i's examples [offset[i], offset[i] + size[i]): the batch split as evenly as
// possible, the larger ones first; every stage computes the same.
struct MicroBatches {
  MicroBatches(int64_t batch, int count) : size(size_t(count), batch / count), offset(size_t(count), 0) {
    for (int i = 0; i < count; ++i) {
      if (i < batch % count) ++size[size_t(i)];
      if (i > 0) offset[size_t(i)] = offset[size_t(i) - 1] + size[size_t(i) - 1];
    }
  }
  int count() const { return int(size.size()); }
  std::vector<int64_t> size;
  std::vector<int64_t> offset;
};

// One micro-batch between its forward and its backward.
struct Held {
  torch::Tensor input;
  torch::Tensor output;  // the last stage: the micro-batch's share of the loss
  int64_t bytes = 0;     // its input and every layer's output
};

// The stage's receives in one direction (activations in, or gradients in) during a step.
//
// Receives are posted one micro-batch ahead in each direction (both schedules consume
// micro-batches in order), so a message that arrives early finds its buffer waiting; at most one
// extra buffer per direction, which keeps 1F1B's memory bound.
//
// The buffers are kept from step to step, so the receive path allocates nothing once the first
// step has run: K per direction, micro-batch i in buffer i mod K, each sized for the largest
// micro-batch (i receives into its first m_i rows). K is the schedule's peak of micro-batches in
// flight plus the one posted ahead: when i+K is posted (on taking i+K-1), the micro-batches in
// flight are at most the peak, all after i, so i's backward has run and its graph is freed.
//
// On a CUDA stage (the device of the batch, where the stage's layers are) the buffers are pinned
// host memory, and a micro-batch's rows are copied to the device without blocking. That copy may
// still be reading the buffer when the receive of micro-batch i+K is posted, so the slot is not
// kept: the next post takes a new block from the caching host allocator, which hands a block out
// again only once the copies that read it have completed (the copy records itself on the block).
// After the first steps those blocks are reused, so the receive path still allocates no new
// pinned memory.
class Inbox {
 public:
  Inbox(Communicator& comm, std::vector<torch::Tensor>& buffers, const MicroBatches& micro, size_t slots,
        bool activations, int peer, const std::vector<int64_t>& example, c10::ScalarType type, c10::Device device)
      : comm_(comm),
        buffers_(buffers),
        micro_(micro),
        slots_(slots),
        activations_(activations),
        peer_(peer),
        largest_(withBatch(micro.size[0], example)),
        type_(type),
        device_(device),
        work_(size_t(micro.count())) {
    if (buffers_.size() < slots_) buffers_.resize(slots_);
  }

  void post(int i) {
    if (i >= micro_.count() || work_[size_t(i)].valid()) return;
    torch::Tensor& buffer = buffers_[size_t(i) % slots_];
    if (!buffer.defined() || buffer.sizes() != c10::IntArrayRef(largest_))
      buffer = wireBuffer(largest_, type_, device_);
    work_[size_t(i)] =
        comm_.recvAsync(buffer.narrow(0, 0, micro_.size[size_t(i)]), peer_, 2 * i + (activations_ ? 0 : 1));
  }

  // Micro-batch i's rows of its buffer, once they arrived (a new handle on them, so that autograd
  // state never stays on the kept buffer), on the stage's device; adds the time blocked to *idle.
  torch::Tensor take(int i, double* idle) {
    post(i);
    post(i + 1);
    *idle += work_[size_t(i)].wait();
    torch::Tensor& buffer = buffers_[size_t(i) % slots_];
    const torch::Tensor rows = buffer.narrow(0, 0, micro_.size[size_t(i)]);
    if (device_.is_cpu()) return rows.detach();
    torch::Tensor onDevice = rows.to(device_, /*non_blocking=*/true);
    buffer = torch::Tensor();
    return onDevice;
  }

 private:
  Communicator& comm_;
  std::vector<torch::Tensor>& buffers_;
  const MicroBatches& micro_;
  size_t slots_;
  bool activations_;
  int peer_;
  std::vector<int64_t> largest_;
  c10::ScalarType type_;
  c10::Device device_;
  std::vector<CommWork> work_;
};

// The forward and backward passes of one step, in the schedule's order.
class StepRun {
 public:
  StepRun(Pipeline::Impl& p, const torch::Tensor& inputs, const torch::Tensor& targets, const PipelineLoss& loss)
      : p_(p),
        inputs_(inputs),
        targets_(targets),
        loss_(loss),
        micro_(inputs.size(0), int(std::min<int64_t>(p.options.microBatches, inputs.size(0)))),
        ops_(makeSchedule(p.options.schedule, p.stages(), p.stage, micro_.count())),
        held_(size_t(micro_.count())) {
    const size_t slots = size_t(std::min(micro_.count(), peakInFlight(ops_) + 1));
    const c10::Device device = inputs.device();
    if (!p.first()) {
      activations_.emplace(*p.comm, p.activationBuffers, micro_, slots, true, p.prevRank(), p.wire.inShape,
                           p.wire.inType, device);
    }
    if (!p.last()) {
      gradients_.emplace(*p.comm, p.gradientBuffers, micro_, slots, false, p.nextRank(), p.wire.outShape,
                         p.wire.outType, device);
    }
    sends_.reserve(size_t(2 * micro_.count()));
  }

  void run() {
    // The batch size first, so that the next stage checks it before it posts a receive.
    if (!p_.last()) sends_.push_back(p_.comm->sendAsync(torch::tensor({inputs_.size(0)}), p_.nextRank(), kBatchTag));
    if (!p_.first()) times.idle += p_.checkBatchOfPrevious(inputs_.size(0), kBatchTag, "step");
    if (activations_) activations_->post(0);
    if (gradients_) gradients_->post(0);
    for (const PipeOp& op : ops_) {
      if (op.forward) {
        forward(op.micro);
      } else {
        backward(op.micro);
      }
    }
    for (auto& s : sends_) times.sendWait += s.wait();
  }

  StepTimes times;
  double lossSum = 0;
  int64_t peak = 0;  // activation bytes held at once
  int microBatches() const { return micro_.count(); }

 private:
  void forward(int i) {
    Held& h = held_[size_t(i)];
    const int64_t m = micro_.size[size_t(i)];
    if (p_.first()) {
      h.input = inputs_.narrow(0, micro_.offset[size_t(i)], m);
    } else {
      h.input = activations_->take(i, &times.idle);
      if (h.input.is_floating_point()) h.input.requires_grad_(true);
    }
    const auto computeStart = Clock::now();
    {
      std::optional<Autocast> autocast;  // PipelineOptions::autocast: the layers and the loss
      if (p_.options.autocast) autocast.emplace(h.input.device().type(), *p_.options.autocast);
      if (p_.first()) {
        h.output = throughLayers(h.input, &h.bytes);
      } else if (p_.copyInput) {
        h.output = throughLayers(h.input.clone(), &h.bytes);
      } else {
        try {
          h.output = throughLayers(h.input, &h.bytes);
        } catch (const std::exception& e) {
          // Only view operations can have run before the in-place one (anything else would have
          // made a new tensor): nothing to undo. From here on every micro-batch goes in as a copy.
          if (!inPlaceOnLeaf(e.what())) throw;
          p_.copyInput = true;
          h.output = throughLayers(h.input.clone(), &h.bytes);
        }
      }
      if (p_.last()) {
        auto targets = targets_.narrow(0, micro_.offset[size_t(i)], m);
        h.output = loss_(h.output, targets) * (double(m) / double(inputs_.size(0)));
      } else if (h.output.is_floating_point() && h.output.scalar_type() != p_.wire.outType) {
        h.output = h.output.to(p_.wire.outType);  // autocast's 16 bits back to the wire's dtype
      }
    }
    if (p_.last()) {
      lossSum += h.output.item<double>();
      times.forward += secondsSince(computeStart);
    } else {
      times.forward += secondsSince(computeStart);
      send(h.output.detach(), p_.nextRank(), 2 * i);
    }
    live_ += h.bytes;
    peak = std::max(peak, live_);
  }

  void backward(int i) {
    Held& h = held_[size_t(i)];
    // A stage with nothing to differentiate (a Flatten alone at the front) has no graph.
    torch::Tensor grad = p_.last() ? torch::Tensor() : gradients_->take(i, &times.idle);
    const auto computeStart = Clock::now();
    if (h.output.requires_grad()) h.output.backward(grad);
    times.backward += secondsSince(computeStart);
    if (!p_.first() && h.input.requires_grad()) {
      auto inputGrad = h.input.grad();
      if (!inputGrad.defined()) inputGrad = torch::zeros_like(h.input);
      send(inputGrad, p_.prevRank(), 2 * i + 1);
    }
    live_ -= h.bytes;
    h = Held{};  // frees the micro-batch's graph
  }

  void send(const torch::Tensor& t, int peer, int tag) {
    const auto start = Clock::now();
    sends_.push_back(p_.comm->sendAsync(toWire(t), peer, tag));
    times.send += secondsSince(start);
  }

  torch::Tensor throughLayers(const torch::Tensor& x, int64_t* bytes) {
    torch::Tensor y = x;
    *bytes = nbytes(x);
    for (auto& layer : *p_.module) {
      y = layer.forward(y);
      *bytes += nbytes(y);
    }
    return y;
  }

  Pipeline::Impl& p_;
  const torch::Tensor& inputs_;
  const torch::Tensor& targets_;
  const PipelineLoss& loss_;
  MicroBatches micro_;
  std::vector<PipeOp> ops_;
  std::vector<Held> held_;
  std::optional<Inbox> activations_;
  std::optional<Inbox> gradients_;
  std::vector<CommWork> sends_;
  int64_t live_ = 0;
};

}  // namespace

bool inPlaceOnLeaf(const std::string& what) {
  return what.find("leaf Variable that requires grad is being used in an in-place operation") != std::string::npos;
}

torch::Tensor toWire(const torch::Tensor& t) {
  if (t.device().is_cpu()) return t.contiguous();
  auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  host.copy_(t);
  return host;
}

torch::Tensor wireBuffer(const std::vector<int64_t>& shape, c10::ScalarType type, const c10::Device& device) {
  return torch::empty(shape, torch::TensorOptions().dtype(type).pinned_memory(!device.is_cpu()));
}

double Pipeline::Impl::checkBatchOfPrevious(int64_t batch, int tag, const char* who) {
  auto theirs = torch::empty({1}, torch::kInt64);
  const double waited = comm->recvAsync(theirs, prevRank(), tag).wait();
  COHORT_CHECK(theirs.item<int64_t>() == batch, InvalidArgument, "cohort::Pipeline::", who, ": stage ", stage,
               " was given a batch of ", batch, " examples and stage ", stage - 1, " (rank ", prevRank(), ") one of ",
               theirs.item<int64_t>(), ": every stage of a replica takes the same batch");
  return waited;
}

namespace {

// Averages the stage's gradients over its copies; returns the seconds it took. A frozen parameter
// (requires_grad false) takes no part. A trainable one that this copy got no gradient for adds
// zeros; one that no copy got a gradient for keeps none, so the optimizer leaves it alone (weight
// decay, momentum) as one process would: the copies agree on that through a mask of which had one,
// averaged with the gradients (nonzero where any copy had one).
double averageGradients(Communicator& stageGroup, torch::nn::Module& module) {
  std::vector<torch::Tensor> trainable;
  for (auto& p : module.parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  if (trainable.empty()) return 0;
  auto had = torch::zeros({int64_t(trainable.size())}, torch::kFloat32);
  std::vector<torch::Tensor> grads;
  for (size_t i = 0; i < trainable.size(); ++i) {
    torch::Tensor& p = trainable[i];
    if (p.grad().defined()) {
      had[int64_t(i)] = 1.0f;
    } else {
      p.mutable_grad() = torch::zeros_like(p);
    }
    grads.push_back(p.grad());
  }
  grads.push_back(had);
  const auto start = Clock::now();
  averageInPlace(stageGroup, grads);
  const double seconds = secondsSince(start);
  const auto anyHad = had.accessor<float, 1>();
  for (size_t i = 0; i < trainable.size(); ++i) {
    if (anyHad[int64_t(i)] == 0.0f) trainable[i].mutable_grad() = torch::Tensor();
  }
  return seconds;
}

// The chief (stage 0 of replica 0) reports the loss, which the last stage knows: the last stage
// sends it (after the previous step's send finished), stage 0 receives it into *loss. Returns the
// seconds waited.
double shareLoss(Pipeline::Impl& p, double* loss) {
  if (p.stages() < 2 || p.replica != 0 || !(p.first() || p.last())) return 0;
  if (p.last()) {
    const double waited = p.lossSend.wait();
    p.lossSend = p.comm->sendAsync(torch::tensor({*loss}, torch::kFloat64), 0, kLossTag);
    return waited;
  }
  auto value = torch::empty({1}, torch::kFloat64);
  const double waited = p.comm->recvAsync(value, p.stages() - 1, kLossTag).wait();
  *loss = value.item<double>();
  return waited;
}

}  // namespace

PipelineStepStats Pipeline::Impl::step(const torch::Tensor& inputs, const torch::Tensor& targets,
                                       const PipelineLoss& loss, torch::optim::Optimizer& optimizer) {
  // Every stage of the replica is given the same batch, so each refuses it alike, before any
  // message (an empty one cut into no micro-batches divided by zero).
  COHORT_CHECK(inputs.dim() >= 1 && inputs.size(0) >= 1, InvalidArgument,
               "cohort::Pipeline::step: a batch of no examples (inputs ", inputs.sizes(), ")");
  COHORT_CHECK(targets.dim() >= 1 && targets.size(0) == inputs.size(0), InvalidArgument,
               "cohort::Pipeline::step: ", inputs.size(0), " inputs but targets ", targets.sizes());
  const auto start = Clock::now();
  const CommCounters before = comm->counters();
  clearGradients(*module);
  StepRun run(*this, inputs, targets, loss);
  run.run();
  StepTimes& times = run.times;
  double waited = times.idle + times.sendWait;
  if (options.replicas > 1) waited += averageGradients(*stageGroup, *module);
  const auto optimizerStart = Clock::now();
  optimizer.step();
  times.optimizer = secondsSince(optimizerStart);
  PipelineStepStats stats;
  stats.loss = run.lossSum;
  waited += shareLoss(*this, &stats.loss);

  stats.seconds = secondsSince(start);
  if (++steps > kWarmupSteps) {
    stepSeconds += stats.seconds;
    steady.idle += times.idle;
    steady.forward += times.forward;
    steady.backward += times.backward;
    steady.send += times.send;
    steady.sendWait += times.sendWait;
    steady.optimizer += times.optimizer;
  }
  peakActivationBytes = std::max(peakActivationBytes, run.peak);
  const CommCounters after = comm->counters();
  stats.microBatches = run.microBatches();
  stats.peakActivationBytes = run.peak;
  stats.forwardSeconds = times.forward;
  stats.backwardSeconds = times.backward;
  stats.idleSeconds = times.idle;
  stats.sendSeconds = times.send;
  stats.sendWaitSeconds = times.sendWait;
  stats.optimizerSeconds = times.optimizer;
  stats.waitSeconds = waited;
  stats.bytesSent = after.bytesSent - before.bytesSent;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived;
  return stats;
}

}  // namespace cohort
