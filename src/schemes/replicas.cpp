// Replicas as threads of one process (include/cohort/replicas.h).
//
// Threads: R persistent replica threads; step() hands each its shard and waits. Every wait of a
// replica for another goes through Impl::waitUntil, which gives up when any replica has failed
// (the failure ends every thread's step) or when the timeout passes.
//
// Gradient sum (Mirrored, CentralStorage): a hook on every replica's parameter copies the
// gradient, weighted by the shard's share of the batch, into that replica's slot of a bucket;
// when all R replicas have filled a bucket it is ready, and replica r sums the r-th chunk of every
// ready bucket over the replicas, in replica order (so the sum does not depend on timing), into
// the bucket's one shared sum. Every replica's .grad then points into that sum. Across processes
// (Mirrored with a job), a bucket's sum is allreduced as soon as its last chunk is summed, while
// the replicas' backward goes on; replica 0 waits for all of them and the others wait for it.
#include "schemes/replicas_impl.h"

#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/optim.h>
#include <cohort/replicas.h>

#include "base/compute_threads.h"
#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>

namespace cohort {

namespace {

template <class O, class Options>
std::unique_ptr<torch::optim::Optimizer> copyAs(torch::optim::Optimizer& original,
                                                std::vector<torch::optim::OptimizerParamGroup>& groups) {
  if (dynamic_cast<O*>(&original) == nullptr) return nullptr;
  return std::make_unique<O>(groups, static_cast<const Options&>(original.defaults()));
}

}  // namespace

ReplicaGroup::ReplicaGroup(Kind kind, const Job* job, std::shared_ptr<torch::nn::Module> model,
                           torch::optim::Optimizer& optimizer, ReplicaOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.kind = kind;
  s.who = kind == Kind::kMirrored ? "cohort::Mirrored" : kind == Kind::kCentral ? "cohort::CentralStorage"
                                                                                 : "cohort::Hogwild";
  COHORT_CHECK(model != nullptr, InvalidArgument, s.who, ": the model is null");
  s.checkOptions(options);
  s.options = options;
  const size_t R = size_t(options.replicas);
  s.secondsPerExample.assign(R, 0.0);
  const auto named = s.trainableParameters(*model);
  if (job != nullptr) s.comm = job->communicator();
  if (s.comm != nullptr) {
    checkSameModel(*s.comm, *model, s.who,
                   detail::concat("replicas=", options.replicas, " bucketMb=", options.bucketMb,
                                  " findUnusedParameters=", options.findUnusedParameters));
    broadcastModel(*s.comm, *model);
  }
  // Which optimizer parameter is which model parameter, to give each copy the same groups.
  std::unordered_map<const void*, size_t> indexOf;
  for (size_t k = 0; k < named.size(); ++k) indexOf[named[k].second.unsafeGetTensorImpl()] = k;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      COHORT_CHECK(indexOf.count(p.unsafeGetTensorImpl()) > 0, InvalidArgument, s.who,
                   ": the optimizer holds a tensor that is not a trainable parameter of the model");
    }
  }
  s.replicas.resize(R);
  for (size_t r = 0; r < R; ++r) s.makeReplica(r, model, named, optimizer, indexOf);
  if (s.sumsGradients()) {
    s.buildBuckets();
    s.registerHooks();
  }
  s.blasThreadsBefore = openBlasThreads();
  setOpenBlasThreads(1);
  for (size_t r = 0; r < R; ++r) s.threads.emplace_back([impl = impl_.get(), r] { impl->threadMain(r); });
}

void ReplicaGroup::Impl::checkOptions(const ReplicaOptions& o) const {
  COHORT_CHECK(o.replicas >= 1, InvalidArgument, who, ": replicas must be at least 1, got ", o.replicas);
  COHORT_CHECK(o.bucketMb > 0, InvalidArgument, who, ": bucketMb must be positive, got ", o.bucketMb);
  COHORT_CHECK(o.timeout.count() > 0, InvalidArgument, who, ": the timeout must be positive");
  COHORT_CHECK(!(o.balance && kind == Kind::kHogwild), InvalidArgument, who,
               ": balance applies to Mirrored and CentralStorage, whose replicas meet at the sums; Hogwild's do not");
}

std::vector<std::pair<std::string, torch::Tensor>> ReplicaGroup::Impl::trainableParameters(
    torch::nn::Module& model) const {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& [name, p] : uniqueParameters(model)) {
    if (!p.requires_grad()) continue;
    COHORT_CHECK(isAveragedDtype(p.scalar_type()), InvalidArgument, who, ": parameter ", name, " is ", p.dtype(),
                 "; replicas train float32, float64, float16 and bfloat16 parameters");
    COHORT_CHECK(kind != Kind::kHogwild || p.device().is_cpu(), InvalidArgument, who, ": parameter ", name,
                 " is on ", p.device(), "; Hogwild's threads update one copy in host memory without locks, a CPU "
                 "scheme: call module->to(torch::kCPU) (--device cpu), or use Mirrored on the GPU");
    COHORT_CHECK(named.empty() || p.device() == named[0].second.device(), InvalidArgument, who, ": parameter ",
                 name, " is on ", p.device(), " and ", named[0].first, " on ", named[0].second.device(),
                 "; move the whole model to one device (module->to(device))");
    // The sums and copies are of dense gradients (a sparse one failed inside a replica with
    // torch's internal assert, or the optimizer's copy).
    COHORT_CHECK(!hasRowSparseGradient(model, p), InvalidArgument, who, ": parameter ", name,
                 " is an embedding table with sparse gradients; the replicas sum and copy dense ones: make it "
                 "dense (sparse(false); --model embed:sparse=0), or use allreduce, average or ps, which exchange "
                 "the touched rows");
    named.emplace_back(name, p);
  }
  COHORT_CHECK(!named.empty(), InvalidArgument, who, ": the module has no parameters that require gradients");
  return named;
}

void ReplicaGroup::Impl::makeReplica(size_t r, const std::shared_ptr<torch::nn::Module>& model,
                                     const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                     torch::optim::Optimizer& optimizer,
                                     const std::unordered_map<const void*, size_t>& indexOf) {
  Replica& replica = replicas[r];
  // Replica r on the r-th GPU after the model's, wrapping around (one GPU: all of them on it).
  const c10::Device home = named[0].second.device();
  replica.device = home.is_cuda() ? c10::Device(c10::kCUDA, c10::DeviceIndex((int(home.index()) + int(r)) %
                                                                             int(torch::cuda::device_count())))
                                  : home;
  replica.module = r == 0 ? model : cloneModel(*model, replica.device, home);
  for (auto& [name, p] : uniqueParameters(*replica.module)) {
    if (p.requires_grad()) replica.params.push_back(p);
  }
  COHORT_CHECK_EQ(replica.params.size(), named.size(), Error, who, ": a copy of the model has another parameter count");
  if (r > 0 && kind != Kind::kMirrored && replica.device == home) {
    // One set of parameters: the copies are distinct tensors (each its own gradient) over the
    // same memory.
    torch::NoGradGuard noGrad;
    // Not the buffers: each replica's forward updates its own (pullBuffers, mergeBuffers).
    for (size_t k = 0; k < named.size(); ++k) replica.params[k].set_data(named[k].second);
  }
  if (r == 0) {
    replica.optimizer = &optimizer;
  } else if (kind != Kind::kCentral) {
    replica.ownOptimizer = copyOptimizer(optimizer, replica, indexOf);
    replica.optimizer = replica.ownOptimizer.get();
  }
}

std::shared_ptr<torch::nn::Module> ReplicaGroup::Impl::cloneModel(torch::nn::Module& model, c10::Device device,
                                                                   c10::Device home) const {
  std::shared_ptr<torch::nn::Module> copy;
  try {
    copy = device == home ? model.clone() : model.clone(device);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw InvalidArgument(detail::concat(who, ": the model cannot be copied into replicas (",
                                         what.substr(0, what.find('\n')),
                                         "): every submodule must be a torch::nn::Cloneable"));
  }
  // torch's clone() gives the copy's parameters a new layer's requires_grad (it sets their data
  // only): a frozen parameter of the model would be trained in the copies.
  const auto original = model.named_parameters(/*recurse=*/true);
  for (auto& p : copy->named_parameters(/*recurse=*/true)) {
    if (const torch::Tensor* o = original.find(p.key())) p.value().requires_grad_(o->requires_grad());
  }
  return copy;
}

std::unique_ptr<torch::optim::Optimizer> ReplicaGroup::Impl::copyOptimizer(
    torch::optim::Optimizer& optimizer, const Replica& replica,
    const std::unordered_map<const void*, size_t>& indexOf) const {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto& group : optimizer.param_groups()) {
    std::vector<torch::Tensor> mine;
    for (auto& p : group.params()) mine.push_back(replica.params[indexOf.at(p.unsafeGetTensorImpl())]);
    groups.emplace_back(std::move(mine), group.options().clone());
  }
  std::unique_ptr<torch::optim::Optimizer> copy;
  if (!copy) copy = copyAs<ForeachSGD, torch::optim::SGDOptions>(optimizer, groups);  // before its base class
  if (!copy) copy = copyAs<torch::optim::SGD, torch::optim::SGDOptions>(optimizer, groups);
  if (!copy) copy = copyAs<torch::optim::Adam, torch::optim::AdamOptions>(optimizer, groups);
  if (!copy) copy = copyAs<torch::optim::AdamW, torch::optim::AdamWOptions>(optimizer, groups);
  if (!copy) copy = copyAs<torch::optim::RMSprop, torch::optim::RMSpropOptions>(optimizer, groups);
  if (!copy) copy = copyAs<torch::optim::Adagrad, torch::optim::AdagradOptions>(optimizer, groups);
  COHORT_CHECK(copy != nullptr, InvalidArgument, who,
               ": every replica needs a copy of the optimizer, and this one cannot be copied; use SGD, Adam, AdamW, "
               "RMSprop or Adagrad");
  // The state (momentum, moments) too: a resumed optimizer's copies go on alike.
  const std::string bytes = optimizerBytes(optimizer);
  torch::serialize::InputArchive in;
  in.load_from(bytes.data(), bytes.size(), replica.device);
  copy->load(in);
  return copy;
}

void ReplicaGroup::Impl::registerHooks() {
  for (size_t r = 0; r < replicas.size(); ++r) {
    for (size_t k = 0; k < replicas[r].params.size(); ++k) {
      replicas[r].hooks.push_back(
          replicas[r].params[k].register_hook([this, r, k](torch::Tensor grad) { onGradient(r, k, grad); }));
    }
  }
}

ReplicaGroup::~ReplicaGroup() {
  Impl& s = *impl_;
  {
    MutexLock lock(s.mutex);
    s.stopping = true;
    s.wake.notifyAll();
  }
  for (auto& t : s.threads) t.join();
  for (auto& replica : s.replicas) {
    for (size_t k = 0; k < replica.hooks.size(); ++k) replica.params[k].remove_hook(replica.hooks[k]);
  }
  if (s.blasThreadsBefore > 0) setOpenBlasThreads(s.blasThreadsBefore);
}

double ReplicaGroup::step(const torch::Tensor& inputs, const torch::Tensor& targets, const ShardLoss& loss) {
  Impl& s = *impl_;
  COHORT_CHECK(!s.broken, Error, s.who,
               ": an earlier step failed while the replicas were updating their parameters "
               "or while this process exchanged with the others, so replicas or processes may be out of step; "
               "make a new handle");
  const int R = int(s.replicas.size());
  const int64_t n = inputs.size(0);
  // Fewer examples than replicas (an epoch's last batch) leaves some replicas none: they add zeros.
  COHORT_CHECK(n >= 1, InvalidArgument, s.who, ": a batch of no examples");
  COHORT_CHECK(targets.size(0) == n, InvalidArgument, s.who, ": ", n, " inputs but ", targets.size(0), " targets");
  const std::vector<int64_t> sizes = s.shardSizes(n);
  s.splitBatch(inputs, targets, sizes);
  s.resetForStep(loss);
  if (s.kind != Kind::kMirrored) s.pullBuffers();
  const CommCounters commBefore = s.comm ? s.comm->counters() : CommCounters{};
  s.runThreads();
  if (s.kind != Kind::kMirrored) s.mergeBuffers();
  const CommCounters after = s.comm ? s.comm->counters() : CommCounters{};
  double total = 0;
  for (auto& replica : s.replicas) total += replica.weight * replica.loss;
  if (s.options.balance) s.measureSpeeds();
  MutexLock lock(s.mutex);
  s.stats.bytesSent += after.bytesSent - commBefore.bytesSent;
  s.stats.bytesReceived += after.bytesReceived - commBefore.bytesReceived;
  ++s.stats.steps;
  s.stats.lastShards = sizes;
  if (s.sumsGradients()) {
    for (auto& bucket : s.buckets) s.stats.bytesReduced += int64_t(bucket->sum.nbytes()) * R;
  }
  return total;
}

void ReplicaGroup::Impl::splitBatch(const torch::Tensor& inputs, const torch::Tensor& targets,
                                    const std::vector<int64_t>& sizes) {
  shardInputs.clear();
  shardTargets.clear();
  const int64_t n = inputs.size(0);
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  COHORT_CHECK(total == n && sizes.size() == replicas.size(), Error, who, ": the shards' sizes add up to ", total,
               ", not the batch's ", n, " examples");
  int64_t offset = 0;
  for (size_t r = 0; r < replicas.size(); ++r) {
    const int64_t size = sizes[r];
    // On the replica's device (a no-op where the batch is already there).
    const c10::Device device = replicas[r].device;
    shardInputs.push_back(inputs.narrow(0, offset, size).to(device));
    shardTargets.push_back(targets.narrow(0, offset, size).to(device));
    replicas[r].weight = double(size) / double(n);
    replicas[r].weightTensors.set(replicas[r].weight);
    replicas[r].loss = 0;
    offset += size;
  }
}

void ReplicaGroup::Impl::resetForStep(const ShardLoss& loss) {
  for (auto& bucket : buckets) {
    bucket->arrived = 0;
    bucket->summedChunks = 0;
  }
  finishedSums = 0;
  crossDone = false;
  {
    MutexLock lock(launchMutex);
    launched = 0;
  }
  updating = false;
  failed = false;
  lossFn = &loss;
  followCallersOptions();
}

void ReplicaGroup::Impl::followCallersOptions() {
  auto& callers = replicas[0].optimizer->param_groups();
  for (size_t r = 1; r < replicas.size(); ++r) {
    if (!replicas[r].ownOptimizer) continue;
    auto& copies = replicas[r].ownOptimizer->param_groups();
    COHORT_CHECK(copies.size() == callers.size(), InvalidArgument, who, ": the optimizer has ", callers.size(),
                 " parameter groups and had ", copies.size(),
                 " when the replicas were made: make the handle after adding them");
    for (size_t g = 0; g < callers.size(); ++g) copies[g].set_options(callers[g].options().clone());
  }
}

void ReplicaGroup::Impl::pullBuffers() {
  torch::NoGradGuard noGrad;
  const auto first = replicas[0].module->buffers();
  for (size_t r = 1; r < replicas.size(); ++r) {
    auto mine = replicas[r].module->buffers();
    for (size_t i = 0; i < mine.size() && i < first.size(); ++i) {
      if (mine[i].defined() && first[i].defined()) mine[i].copy_(first[i]);
    }
  }
}

void ReplicaGroup::Impl::mergeBuffers() {
  torch::NoGradGuard noGrad;
  auto first = replicas[0].module->buffers();
  std::vector<std::vector<torch::Tensor>> others;
  for (size_t r = 1; r < replicas.size(); ++r) others.push_back(replicas[r].module->buffers());
  for (size_t i = 0; i < first.size(); ++i) {
    // Counters (BatchNorm's batches seen) are replica 0's, counted once per step as in one process.
    if (!first[i].defined() || !first[i].is_floating_point()) continue;
    bool changed = false;
    for (const auto& mine : others) changed = changed || !torch::equal(mine[i].to(first[i].device()), first[i]);
    if (!changed) continue;  // untouched (or touched alike): kept bit for bit
    const auto type = c10::promoteTypes(first[i].scalar_type(), torch::kFloat32);
    auto merged = first[i].to(type).mul(replicas[0].weight);
    for (size_t r = 1; r < replicas.size(); ++r) {
      merged.add_(others[r - 1][i].to(first[i].device(), type), replicas[r].weight);
    }
    first[i].copy_(merged);
  }
  pullBuffers();  // replica(r) reads the one set between steps too
}

void ReplicaGroup::Impl::runThreads() {
  MutexLock lock(mutex);
  error = nullptr;
  errorReplica = -1;
  running = int(replicas.size());
  ++generation;
  wokenAt = Clock::now();
  wake.notifyAll();
  // No bound on the step itself: a large batch may compute for longer than the timeout, and each
  // wait between replicas has its own (waitUntil). Once one failed, the others get options.timeout
  // to unwind (one stuck in its own forward never would).
  while (running > 0 && !failed.load()) done.waitFor(mutex, std::chrono::seconds(1));
  const auto until = std::chrono::steady_clock::now() + options.timeout;
  while (running > 0 && done.waitUntil(mutex, until) == std::cv_status::no_timeout) continue;
  if (running > 0) {
    broken = true;
    throw TimeoutError(detail::concat(who, ": ", running, " replica threads did not end their step within ",
                                      options.timeout.count(), " ms of replica ", errorReplica, "'s failure"));
  }
  // A thread that ended first waited for the last; the last one's end waking this thread is the
  // hand-off.
  const auto now = Clock::now();
  auto last = replicas[0].endedAt;
  for (auto& replica : replicas) last = std::max(last, replica.endedAt);
  for (auto& replica : replicas) {
    replica.waitSeconds += std::chrono::duration<double>(last - replica.endedAt).count();
    replica.times.handOff += std::chrono::duration<double>(now - last).count();
  }
  if (error) rethrowFailure();
}

void ReplicaGroup::Impl::rethrowFailure() {
  // A failure before any optimizer step leaves every replica as it was; one during the optimizer
  // steps may leave the copies different. (Hogwild's threads share one parameter set: nothing can
  // differ.)
  if (updating.load() && kind == Kind::kMirrored) broken = true;
  // Across processes, a failed step leaves this process out of step with the others: its own
  // collectives launched, or theirs left waiting for ones this process never launched (a replica
  // that failed in forward, before any bucket was summed).
  if (comm != nullptr) broken = true;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    throw Error(detail::concat(who, ": replica ", errorReplica, " failed: ", e.what()));
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw Error(detail::concat(who, ": replica ", errorReplica, " failed: ", what.substr(0, what.find('\n'))));
  } catch (const std::exception& e) {
    throw Error(detail::concat(who, ": replica ", errorReplica, " failed: ", e.what()));
  }
}

void ReplicaGroup::synchronizeBuffers() {
  Impl& s = *impl_;
  if (s.kind != Kind::kMirrored) return;  // one set of buffers already, merged after every step
  torch::NoGradGuard noGrad;
  std::vector<std::vector<torch::Tensor>> all;
  for (auto& replica : s.replicas) all.push_back(replica.module->buffers());
  std::vector<torch::Tensor> first;
  for (size_t i = 0; i < all[0].size(); ++i) {
    if (!all[0][i].defined() || !all[0][i].is_floating_point()) continue;
    for (size_t r = 1; r < all.size(); ++r) all[0][i].add_(all[r][i].to(all[0][i].device()));
    all[0][i].div_(double(all.size()));
    first.push_back(all[0][i]);
  }
  if (s.comm != nullptr) averageInPlace(*s.comm, first);
  for (size_t i = 0; i < all[0].size(); ++i) {
    if (!all[0][i].defined() || !all[0][i].is_floating_point()) continue;
    for (size_t r = 1; r < all.size(); ++r) all[r][i].copy_(all[0][i]);
  }
}

int ReplicaGroup::replicas() const { return int(impl_->replicas.size()); }

torch::optim::Optimizer& ReplicaGroup::optimizer(int r) {
  COHORT_CHECK(r >= 0 && r < replicas(), InvalidArgument, impl_->who, ": no replica ", r);
  torch::optim::Optimizer* own = impl_->replicas[size_t(r)].optimizer;
  return own != nullptr ? *own : *impl_->replicas[0].optimizer;  // CentralStorage: replica 0's
}

torch::nn::Module& ReplicaGroup::replica(int r) {
  COHORT_CHECK(r >= 0 && r < replicas(), InvalidArgument, impl_->who, ": no replica ", r);
  return *impl_->replicas[size_t(r)].module;
}

ReplicaStats ReplicaGroup::stats() const {
  Impl& s = *impl_;
  ReplicaStats out;
  {
    MutexLock lock(s.mutex);
    out = s.stats;
  }
  out.buckets = int64_t(s.buckets.size());
  const double R = double(s.replicas.size());
  for (auto& replica : s.replicas) {
    out.waitSeconds += replica.waitSeconds / R;
    out.times.handOff += replica.times.handOff / R;
    out.times.forward += replica.times.forward / R;
    out.times.backward += replica.times.backward / R;
    out.times.copy += replica.times.copy / R;
    out.times.sum += replica.times.sum / R;
    out.times.optimizer += replica.times.optimizer / R;
  }
  return out;
}

Mirrored::Mirrored(const Job& job, std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
                   ReplicaOptions options)
    : ReplicaGroup(Kind::kMirrored, &job, std::move(model), optimizer, options) {}

Mirrored::Mirrored(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer, ReplicaOptions options)
    : ReplicaGroup(Kind::kMirrored, nullptr, std::move(model), optimizer, options) {}

CentralStorage::CentralStorage(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer,
                               ReplicaOptions options)
    : ReplicaGroup(Kind::kCentral, nullptr, std::move(model), optimizer, options) {}

Hogwild::Hogwild(std::shared_ptr<torch::nn::Module> model, torch::optim::Optimizer& optimizer, ReplicaOptions options)
    : ReplicaGroup(Kind::kHogwild, nullptr, std::move(model), optimizer, options) {}

}  // namespace cohort
