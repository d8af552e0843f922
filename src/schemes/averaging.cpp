#include <cohort/averaging.h>
#include <cohort/communicator.h>
#include <cohort/error.h>

#include "base/clock.h"
#include "compress/codec.h"
#include "schemes/compressed.h"
#include "schemes/host_mirror.h"
#include "schemes/model_sync.h"
#include "schemes/rows.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>

namespace cohort {

namespace {

constexpr const char* kWho = "cohort::ParameterAveraging";

// Parameter `name` is one averaging can take: float32, float64, float16 or bfloat16 and
// contiguous; float32 under a codec other than none, and as a row-sparse table.
void checkAveraged(const std::string& name, const torch::Tensor& p, const compress::CodecSpec& codec, bool rowSparse) {
  COHORT_CHECK(isAveragedDtype(p.scalar_type()) && p.is_contiguous(), InvalidArgument, kWho, ": parameter ", name,
               " is ", p.dtype(), p.is_contiguous() ? "" : " and not contiguous",
               "; ParameterAveraging averages contiguous float32, float64, float16 and bfloat16 parameters");
  COHORT_CHECK(p.scalar_type() == torch::kFloat32 || codec.kind == compress::CodecKind::None, InvalidArgument, kWho,
               ": parameter ", name, " is ", p.dtype(), "; the codec ", codec.text(),
               " compresses float32 changes: use codec none (the parameters are then averaged in their dtype) "
               "or a float32 model");
  COHORT_CHECK(!rowSparse || p.scalar_type() == torch::kFloat32, InvalidArgument, kWho, ": embedding table ", name,
               " is ", p.dtype(), "; row-sparse tables are averaged by rows in float32: make the table float32");
}

}  // namespace

namespace {

// Each parameter's state tensors (momentum buffers; Adam's exp_avg and exp_avg_sq), in parameter
// order; an empty list for a parameter the optimizer keeps no state for yet.
std::vector<std::vector<torch::Tensor>> statePerParameter(torch::optim::Optimizer& optimizer) {
  std::vector<std::vector<torch::Tensor>> out;
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      std::vector<torch::Tensor>& mine = out.emplace_back();
      auto it = state.find(p.unsafeGetTensorImpl());
      if (it == state.end()) continue;
      if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
        mine.push_back(sgd->momentum_buffer());
      } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        mine = {adam->exp_avg(), adam->exp_avg_sq()};
      } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
        mine = {adamw->exp_avg(), adamw->exp_avg_sq()};
      }
    }
  }
  return out;
}

}  // namespace

std::vector<torch::Tensor> optimizerStateTensors(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  const std::vector<std::vector<torch::Tensor>> states = statePerParameter(optimizer);
  size_t k = 0;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const std::vector<torch::Tensor>& mine = states[k++];
      if (!mine.empty() || optimizer.state().count(p.unsafeGetTensorImpl()) > 0) {
        out.insert(out.end(), mine.begin(), mine.end());
        continue;
      }
      // No state yet (the parameter never had a gradient here): a zero placeholder of the
      // kind the optimizer keeps for this parameter's group, so that every rank packs the same
      // tensors.
      if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
        const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
        if (o.momentum() != 0) out.push_back(torch::zeros_like(p));
      } else if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr ||
                 dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
        out.push_back(torch::zeros_like(p));
        out.push_back(torch::zeros_like(p));
      }
    }
  }
  return out;
}

struct COHORT_LOCAL ParameterAveraging::Impl {
  std::shared_ptr<Communicator> comm;  // null for a single process
  torch::nn::Module* module = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  AveragingOptions options;
  compress::CodecSpec codec;
  // The dense parameters the exchange works on: the module's own on the CPU; on a CUDA device,
  // views of `mirror`'s pinned host buffer, copied from the device before each average and back
  // after it (tables likewise).
  std::vector<torch::Tensor> params;
  std::unique_ptr<HostMirror> mirror;  // null on the CPU
  int64_t sinceAverage = 0;
  std::unique_ptr<CompressedSum> compressed;  // when a codec is set
  torch::Tensor anchor;                       // the parameters after the last average, flat
  torch::Tensor delta;                        // scratch: this replica's change, flat
  // Sparse embedding tables (row-sparse gradients) are averaged by rows: only the rows that
  // changed on some replica since the last average travel (averageRows).
  std::vector<torch::Tensor> tables;
  std::vector<torch::Tensor> tableParams;   // the module's tables, whose gradients name the rows
  std::vector<torch::Tensor> tableAnchors;  // each table after the last average
  // Per table, the rows its gradients touched since the last average (each step's indices, not
  // yet made distinct), so that finding the changed rows costs what the steps touched, not a scan
  // of the table. A dense gradient of a table (not row-sparse after all) sets wholeTable, and the
  // rows are then found by comparing the table with its anchor.
  std::vector<std::vector<torch::Tensor>> touched;
  std::vector<bool> wholeTable;

  // After each optimizer step: the rows the step touched. The optimizers for row-sparse
  // gradients (the lazy ones, torch's sparse-capable ones) change no other row.
  void recordTouchedRows() {
    torch::NoGradGuard noGrad;
    for (size_t t = 0; t < tables.size(); ++t) {
      const torch::Tensor& g = tableParams[t].grad();
      if (!g.defined()) continue;
      if (g.is_sparse()) {
        const torch::Tensor rows = g._indices().select(0, 0);
        touched[t].push_back(rows.device().is_cpu() ? rows.clone() : rows.to(torch::kCPU));
      } else {
        wholeTable[t] = true;
      }
    }
  }

  // table := anchor + the mean over the replicas of their change since the last average, where
  // each replica sends only the rows it changed (ids and the rows' changes).
  void averageRows(size_t t, bool useCodec) {
    torch::NoGradGuard noGrad;
    torch::Tensor& table = tables[t];
    torch::Tensor& anchor = tableAnchors[t];
    torch::Tensor ids;
    if (wholeTable[t]) {
      ids = table.ne(anchor).any(1).nonzero().select(1, 0).contiguous();
    } else if (touched[t].empty()) {
      ids = torch::empty({0}, torch::kInt64);
    } else {
      ids = std::get<0>(torch::_unique(torch::cat(touched[t]), /*sorted=*/true)).contiguous();
    }
    touched[t].clear();
    wholeTable[t] = false;
    const torch::Tensor change = (table.index_select(0, ids) - anchor.index_select(0, ids)).div_(comm->worldSize());
    SummedRows sum = allreduceRows(*comm, ids, change, useCodec ? codec : compress::CodecSpec{});
    stats.bytesSent += sum.bytesSent;
    stats.bytesReceived += sum.bytesReceived;
    anchor.index_add_(0, sum.ids, sum.values);
    table.index_copy_(0, sum.ids, anchor.index_select(0, sum.ids));
  }

  torch::Tensor outerVelocity;                // the outer optimizer's momentum, flat
  AveragingStats stats;

  // Anything but outer SGD with lr 1, which is plain averaging and takes plain averaging's path.
  bool hasOuterOptimizer() const {
    return options.outerOptimizer != AveragingOptions::Outer::kSgd || options.outerLr != 1.0;
  }

  // `change`: the averaged change since the last average. Moves the anchor by the outer
  // optimizer's step and makes it the parameters.
  void applyOuter(const torch::Tensor& change) {
    const double lr = options.outerLr, mu = options.outerMomentum;
    switch (options.outerOptimizer) {
      case AveragingOptions::Outer::kSgd:
        anchor.add_(change, lr);
        break;
      case AveragingOptions::Outer::kMomentum:
        outerVelocity.mul_(mu).add_(change);
        anchor.add_(outerVelocity, lr);
        break;
      case AveragingOptions::Outer::kNesterov:
        outerVelocity.mul_(mu).add_(change);
        anchor.add_(change, lr).add_(outerVelocity, lr * mu);
        break;
    }
    unpackParameters(anchor, params);
  }

  void averageChanges() {
    torch::NoGradGuard noGrad;
    packParameters(params, delta);
    delta.sub_(anchor).mul_(1.0 / comm->worldSize());
    const int64_t sent = compressed->bytesSent(), received = compressed->bytesReceived();
    compressed->start(0, delta);
    compressed->finish(0, delta);
    // The codec's count: its messages' real sizes.
    stats.bytesSent += compressed->bytesSent() - sent;
    stats.bytesReceived += compressed->bytesReceived() - received;
    if (hasOuterOptimizer()) {
      applyOuter(delta);
    } else {
      anchor.add_(delta);
      unpackParameters(anchor, params);
    }
  }

  void average() {
    const auto start = Clock::now();
    if (mirror) mirror->toHost();  // the parameters leave the device once per average
    std::vector<torch::Tensor> tensors;  // averaged uncompressed
    if (compressed && stats.steps > options.codecWarmupSteps) {
      averageChanges();
    } else {
      for (auto& p : params) tensors.push_back(p);
      if (hasOuterOptimizer()) {  // the mean's change from the anchor is the outer step's input
        torch::NoGradGuard noGrad;
        averageCounted(tensors);
        tensors.clear();
        packParameters(params, delta);
        delta.sub_(anchor);
        applyOuter(delta);
      } else if (compressed) {  // the warm-up: average uncompressed, and start the changes from here
        averageCounted(tensors);
        tensors.clear();
        packParameters(params, anchor);
      }
    }
    for (size_t t = 0; t < tables.size(); ++t) {
      averageRows(t, codec.kind != compress::CodecKind::None && stats.steps > options.codecWarmupSteps);
    }
    for (auto& b : module->buffers()) tensors.push_back(b);
    if (options.averageOptimizerState) {
      for (auto& t : stateEveryRankHas()) tensors.push_back(t);
    }
    averageCounted(tensors);  // the buffers and optimizer state on a device: staged through pinned memory
    if (mirror) mirror->toDevice();
    sinceAverage = 0;
    ++stats.averages;
    stats.commWaitSeconds += secondsSince(start);
  }

  // The optimizer state of the parameters every rank keeps state for. A rank without state for a
  // parameter (it never had a gradient there) would average a zero placeholder and then drop the
  // result, leaving the others with half their momentum and the ranks apart; such a parameter's
  // state is left alone on every rank until all have one.
  std::vector<torch::Tensor> stateEveryRankHas() {
    const std::vector<std::vector<torch::Tensor>> states = statePerParameter(*optimizer);
    std::vector<int32_t> flags;
    for (const auto& mine : states) flags.push_back(mine.empty() ? 0 : 1);
    const torch::Tensor has = torch::tensor(flags, torch::kInt32);
    counted([&] { comm->allreduce(has); });  // how many ranks have state, per parameter
    const int32_t* ranks = has.data_ptr<int32_t>();
    std::vector<torch::Tensor> out;
    for (size_t k = 0; k < states.size(); ++k) {
      if (ranks[k] == comm->worldSize()) out.insert(out.end(), states[k].begin(), states[k].end());
    }
    return out;
  }

  void averageCounted(const std::vector<torch::Tensor>& tensors) {
    counted([&] { averageInPlace(*comm, tensors); });
  }

  // Runs `exchange`, counting the bytes it moved in stats.
  template <typename Exchange>
  void counted(const Exchange& exchange) {
    const CommCounters before = comm->counters();
    exchange();
    const CommCounters after = comm->counters();
    stats.bytesSent += after.bytesSent - before.bytesSent;
    stats.bytesReceived += after.bytesReceived - before.bytesReceived;
  }
};

ParameterAveraging::ParameterAveraging(const Job& job, torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                                       AveragingOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  COHORT_CHECK(options.period >= 1, InvalidArgument, kWho, ": period must be at least 1, got ", options.period);
  COHORT_CHECK(options.codecWarmupSteps >= 0, InvalidArgument, kWho, ": codecWarmupSteps must be at least 0, got ",
               options.codecWarmupSteps);
  COHORT_CHECK(!options.averageOptimizerState || optimizer != nullptr, InvalidArgument, kWho,
               ": averageOptimizerState needs the optimizer: pass it to the constructor");
  COHORT_CHECK(!options.averageOptimizerState || dynamic_cast<torch::optim::SGD*>(optimizer) != nullptr ||
                   dynamic_cast<torch::optim::Adam*>(optimizer) != nullptr ||
                   dynamic_cast<torch::optim::AdamW*>(optimizer) != nullptr,
               InvalidArgument, kWho, ": averageOptimizerState knows SGD, Adam and AdamW; this optimizer's state "
               "would not be averaged");
  COHORT_CHECK(options.outerLr > 0 && std::isfinite(options.outerLr), InvalidArgument, kWho,
               ": outerLr must be a positive number, got ", options.outerLr);
  COHORT_CHECK(options.outerMomentum >= 0 && options.outerMomentum < 1, InvalidArgument, kWho,
               ": outerMomentum must be in [0, 1), got ", options.outerMomentum);
  s.codec = compress::CodecSpec::parse(options.codec);
  const c10::Device device = modelDevice(module, kWho);
  s.options = std::move(options);
  s.module = &module;
  s.optimizer = optimizer;
  for (auto& [name, p] : uniqueParameters(module)) {
    const bool rowSparse = p.dim() == 2 && hasRowSparseGradient(module, p);
    checkAveraged(name, p, s.codec, rowSparse);
    if (rowSparse) {
      s.tables.push_back(p);
      s.tableParams.push_back(p);
    } else {
      s.params.push_back(p);
    }
  }
  COHORT_CHECK(!s.params.empty() || !s.tables.empty(), InvalidArgument, kWho, ": the module has no parameters; there is nothing to average");
  s.comm = job.communicator();
  if (s.comm == nullptr) return;
  checkSameModel(*s.comm, module, kWho,
                 detail::concat("outer optimizer ", int(s.options.outerOptimizer), " lr=", s.options.outerLr,
                                " momentum=", s.options.outerMomentum));
  broadcastModel(*s.comm, module);
  if (!device.is_cpu()) {
    // From here on the exchange works on host views of the parameters (see `params`).
    std::vector<torch::Tensor> onDevice = s.params;
    onDevice.insert(onDevice.end(), s.tables.begin(), s.tables.end());
    for (const auto& t : onDevice) {
      COHORT_CHECK(t.scalar_type() == onDevice.front().scalar_type(), InvalidArgument, kWho, ": on ", device,
                   " the parameters are mirrored in host memory in one dtype, and this model has ",
                   onDevice.front().dtype(), " and ", t.dtype(),
                   s.tables.empty() ? "; convert it to one (module->to(dtype))"
                                    : "; its sparse embedding tables must be float32, so make the whole model float32");
    }
    s.mirror = std::make_unique<HostMirror>(onDevice, job.env());
    s.mirror->toHost();
    const auto& views = s.mirror->views();
    s.params.assign(views.begin(), views.begin() + ptrdiff_t(s.params.size()));
    s.tables.assign(views.begin() + ptrdiff_t(s.params.size()), views.end());
  }
  for (auto& t : s.tables) s.tableAnchors.push_back(t.detach().clone());
  s.touched.resize(s.tables.size());
  s.wholeTable.assign(s.tables.size(), false);
  if (s.params.empty()) {
    COHORT_CHECK(!s.hasOuterOptimizer(), InvalidArgument, kWho,
                 ": an outer optimizer needs dense parameters; this module has only row-sparse tables");
    return;  // tables alone: averaged by rows, no anchor of dense parameters
  }
  if (s.codec.kind != compress::CodecKind::None || s.hasOuterOptimizer()) {
    torch::NoGradGuard noGrad;
    std::vector<torch::Tensor> flat;
    for (auto& p : s.params) flat.push_back(p.detach().reshape({-1}));
    // In float32 at least: a 16-bit model's outer steps and momentum would round away small changes.
    s.anchor = torch::cat(flat);
    s.anchor = s.anchor.to(c10::promoteTypes(s.anchor.scalar_type(), torch::kFloat32));
    s.delta = torch::empty_like(s.anchor);
    if (s.hasOuterOptimizer()) s.outerVelocity = torch::zeros_like(s.anchor);
  }
  if (s.codec.kind != compress::CodecKind::None) {
    s.compressed = std::make_unique<CompressedSum>(s.comm, s.codec, std::vector<int64_t>{s.anchor.numel()});
  }
}

ParameterAveraging::~ParameterAveraging() = default;

bool ParameterAveraging::step() {
  Impl& s = *impl_;
  ++s.stats.steps;
  if (s.comm == nullptr) return false;
  s.recordTouchedRows();
  if (++s.sinceAverage < s.options.period) return false;
  s.average();
  return true;
}

void ParameterAveraging::synchronize() {
  Impl& s = *impl_;
  if (s.comm != nullptr && s.sinceAverage > 0) s.average();
}

AveragingStats ParameterAveraging::stats() const { return impl_->stats; }

torch::Tensor ParameterAveraging::outerMomentum() const {
  const Impl& s = *impl_;
  return s.outerVelocity.defined() ? s.outerVelocity.clone() : torch::Tensor();
}

void ParameterAveraging::setOuterMomentum(const torch::Tensor& momentum) {
  Impl& s = *impl_;
  if (!s.outerVelocity.defined()) return;
  COHORT_CHECK(momentum.defined() && momentum.dim() == 1 && momentum.numel() == s.outerVelocity.numel(),
               InvalidArgument, kWho, ": the saved outer momentum has ", momentum.defined() ? momentum.numel() : 0,
               " elements but this model's dense parameters have ", s.outerVelocity.numel(),
               ": restore the momentum saved with this model");
  torch::NoGradGuard noGrad;
  s.outerVelocity.copy_(momentum.to(s.outerVelocity.scalar_type()));
}

ParameterAveraging::CodecState ParameterAveraging::codecState() const {
  const Impl& s = *impl_;
  CodecState state{.steps = s.stats.steps};
  if (s.compressed != nullptr && !s.compressed->residual(0).empty()) {
    const std::span<const float> r = s.compressed->residual(0);
    state.residual = torch::from_blob(const_cast<float*>(r.data()), {int64_t(r.size())}, torch::kFloat32).clone();
  }
  return state;
}

void ParameterAveraging::setCodecState(const CodecState& state) {
  Impl& s = *impl_;
  COHORT_CHECK(state.steps >= 0, InvalidArgument, kWho, ": a saved step count must be at least 0, got ", state.steps);
  if (state.residual.defined()) {
    const bool keepsOne = s.compressed != nullptr && !s.compressed->residual(0).empty();
    COHORT_CHECK(keepsOne, InvalidArgument, kWho, ": the saved state holds a codec residual, but --codec ",
                 s.options.codec, " keeps none: resume with the codec the checkpoint was written with");
    const torch::Tensor r = state.residual.to(torch::kFloat32).contiguous();
    COHORT_CHECK(r.dim() == 1, InvalidArgument, kWho, ": the saved codec residual must be flat, got ", r.dim(),
                 " dimensions");
    s.compressed->setResidual(0, {r.data_ptr<float>(), size_t(r.numel())});
  }
  s.stats.steps = state.steps;
}

}  // namespace cohort
