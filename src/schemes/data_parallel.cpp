#include <cohort/communicator.h>
#include <cohort/data_parallel.h>
#include <cohort/error.h>

#include "base/clock.h"
#include "base/thread_annotations.h"
#include "compress/codec.h"
#include "schemes/compressed.h"
#include "schemes/model_sync.h"
#include "schemes/rows.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace cohort {

namespace {

constexpr const char* kWho = "cohort::DataParallel";
constexpr const char* kNested =
    ": a gradient from a backward nested in another (reentrant checkpointing: a Function whose backward calls "
    "backward()); DataParallel synchronizes one backward per step, and the nested one would end it early, "
    "sending the buckets it had not filled as zeros: recompute without a nested backward (take the parameters "
    "as the Function's inputs, and return their gradients from torch::autograd::grad, which leaves .grad alone)";

// A post hook of a parameter's gradient accumulator: it runs once autograd has added this
// backward's gradient into .grad (as the DDP reducer's hooks do).
class GradientAccumulated : public torch::autograd::FunctionPostHook {
 public:
  // f(the gradient that came in: sparse or not, as autograd made it).
  explicit GradientAccumulated(std::function<void(const torch::Tensor&)> f) : f_(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    f_(inputs.empty() ? torch::Tensor() : inputs[0]);
    return outputs;
  }

 private:
  std::function<void(const torch::Tensor&)> f_;
};

// The parameters some DataParallel handle of this process has hooked. A second handle over one of
// them would hook it again, and each would scale its gradient by 1/N: the average halved, silently.
class HookedParameters {
 public:
  // Claims `params` (their names beside them) for one handle, or throws InvalidArgument naming the
  // first that another handle holds; claims nothing then.
  static void claim(const std::vector<torch::Tensor>& params, const std::vector<std::string>& names) {
    HookedParameters& h = instance();
    MutexLock lock(h.mutex_);
    for (size_t k = 0; k < params.size(); ++k) {
      COHORT_CHECK(h.held_.count(params[k].unsafeGetTensorImpl()) == 0, InvalidArgument, kWho, ": parameter ", names[k],
                   " is already hooked by another DataParallel handle of this process; two handles on one model "
                   "would each average its gradient, and the two scalings would halve it: destroy the first handle "
                   "before making another");
    }
    for (const auto& p : params) h.held_.insert(p.unsafeGetTensorImpl());
  }
  static void release(const std::vector<torch::Tensor>& params) {
    HookedParameters& h = instance();
    MutexLock lock(h.mutex_);
    for (const auto& p : params) h.held_.erase(p.unsafeGetTensorImpl());
  }

 private:
  static HookedParameters& instance() {
    static HookedParameters* const h = new HookedParameters();  // never destroyed: handles may outlive statics
    return *h;
  }
  Mutex mutex_;
  std::unordered_set<const c10::TensorImpl*> held_ GUARDED_BY(mutex_);
};

// Module::parameters_ (protected) read without copying its names: named_parameters() and
// parameters() build a dictionary of names, which a per-step check should not pay for. A pointer
// to a protected member may be formed through a derived class and applied to any Module.
struct ParametersOf : torch::nn::Module {
  static const torch::OrderedDict<std::string, torch::Tensor>& of(const torch::nn::Module& m) {
    return m.*(&ParametersOf::parameters_);
  }
};

}  // namespace

struct COHORT_LOCAL DataParallel::Impl {
  // Notices a synchronized backward whose final callback never ran (see beginSync).
  struct Sentinel {
    explicit Sentinel(Impl* i) : impl(i) {}
    ~Sentinel() {
      if (ran) return;
      impl->inBackward = false;
      if (impl->broken.empty()) {
        impl->broken = "a synchronized backward failed part-way on this rank, so its collectives are out of step "
                       "with the other ranks'";
      }
    }
    Impl* impl;
    bool ran = false;
  };

  struct Bucket {
    torch::Tensor flat;                // the bucket's gradients, side by side
    std::vector<size_t> params;        // indices into params
    // Each parameter's slot of `flat` (slotFor): the parameter's .grad from its first
    // synchronized backward on (the gradients as views of the buckets, DDP's
    // gradient_as_bucket_view), so that autograd adds each gradient into the bucket and no second
    // copy of the gradients lives through backward.
    std::vector<torch::Tensor> slots;
    std::vector<bool> filled;
    size_t pending = 0;  // gradients still to come this step
  };

  // Constant after construction.
  std::shared_ptr<Communicator> comm;  // null for a single process: nothing is hooked
  torch::nn::Module* module = nullptr;
  DataParallelOptions options;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  // Each parameter's gradient accumulator, kept alive (autograd holds it weakly) with our post hook.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hookKeys;
  std::vector<unsigned> tensorHooks;  // per parameter: re-hooks a replaced accumulator
  bool claimed = false;               // params are held in HookedParameters
  // Each parameter's index in params, and the check (its number) that last found it in the module.
  std::unordered_map<const c10::TensorImpl*, size_t> indexOf;
  std::vector<uint64_t> seenBy;
  uint64_t checks = 0;

  ~Impl() {
    if (claimed) HookedParameters::release(params);
  }

  // Puts onGradient on parameter k's current gradient accumulator (off the one it had).
  void hookAccumulator(size_t k) {
    if (accumulators[k] != nullptr) accumulators[k]->del_post_hook(hookKeys[k]);
    accumulators[k] = torch::autograd::impl::grad_accumulator(params[k]);
    hookKeys[k] = accumulators[k]->add_post_hook(
        std::make_unique<GradientAccumulated>([this, k](const torch::Tensor& g) { onGradient(k, g); }));
  }
  std::vector<std::pair<size_t, size_t>> slotOf;  // param -> (bucket, index in bucket)
  // Row-sparse parameters (sparse embedding tables) skip the buckets: after them, each one's
  // gradient is exchanged as rows (exchangeRows).
  std::vector<bool> rowSparse;

  // The training thread's state.
  std::vector<Bucket> buckets;
  std::unique_ptr<CompressedSum> compressed;  // with options.codec
  std::unique_ptr<CompressedSum> plain;       // during the codec warm-up
  size_t nextToLaunch = 0;
  bool inBackward = false;  // a synchronized backward is under way (its final callback is queued)
  bool joining = false;     // inside join()
  // noSync()'s guards hold it weakly: a guard that outlives the handle finds it gone.
  std::shared_ptr<int> noSyncDepth = std::make_shared<int>(0);
  int64_t syncStepsAtJoin = 0;  // stats.syncSteps when join() began
  int64_t stepsBefore = 0;      // an earlier run's synchronized steps (setCodecState)
  // The autograd graph task (its id) whose backward is being synchronized, and the last one that
  // was: a gradient from another task inside it, or from an older one after it, is a backward nested
  // in another (get_current_graph_task_id: -1 outside a backward; ids grow with every backward).
  int syncTask = -1;
  int lastSyncTask = -1;
  double scale = 1.0;
  ScaleTensors scaleTensors;               // `scale`, for scaledInto
  std::vector<torch::Tensor> sparseGrads;  // per parameter: this step's row-sparse gradient (or undefined)
  std::string broken;  // set when a communication failed: the group is unusable
  int64_t sentAtStart = 0;  // the step's exchange's byte counts when the step began
  int64_t receivedAtStart = 0;
  CompressedSum::Phases phasesAtStart;
  DataParallelStats stats;

  int64_t codecSteps() const { return stepsBefore + stats.syncSteps + stats.shadowSteps; }
  CompressedSum& exchange() { return codecSteps() < options.codecWarmupSteps ? *plain : *compressed; }

  void checkUsable() const {
    COHORT_CHECK(broken.empty(), CommError, kWho, " cannot synchronize after an earlier failure (", broken,
                 "); the job's communicator is unusable");
  }

  void buildBuckets() {
    slotOf.resize(params.size());
    std::vector<std::vector<size_t>> groups(1);
    int64_t bytes = 0;
    for (size_t k = params.size(); k-- > 0;) {
      if (rowSparse[k]) continue;
      const int64_t size = params[k].numel() * int64_t(params[k].element_size());
      const double capMb = groups.size() == 1 ? options.firstBucketMb : options.bucketMb;
      // A bucket holds one dtype (a model of float32 and float64 layers gets buckets of each).
      const bool otherDtype = !groups.back().empty() && params[groups.back().front()].dtype() != params[k].dtype();
      if (!groups.back().empty() && (otherDtype || double(bytes + size) > capMb * 1024 * 1024)) {
        groups.emplace_back();
        bytes = 0;
      }
      groups.back().push_back(k);
      bytes += size;
    }
    if (groups.back().empty()) groups.pop_back();  // every parameter is row-sparse
    std::vector<int64_t> sizes;
    for (auto& group : groups) {
      Bucket bucket;
      int64_t numel = 0;
      for (size_t k : group) numel += params[k].numel();
      // On the parameters' device (a CUDA model's buckets are CUDA memory), in their dtype.
      const auto options =
          torch::TensorOptions().dtype(params[group.front()].dtype()).device(params[group.front()].device());
      bucket.flat = torch::zeros({numel}, options);
      int64_t offset = 0;
      for (size_t k : group) {
        slotOf[k] = {buckets.size(), bucket.params.size()};
        bucket.params.push_back(k);
        bucket.slots.push_back(slotFor(bucket.flat, offset, params[k]));
        offset += params[k].numel();
      }
      bucket.filled.assign(group.size(), false);
      sizes.push_back(numel);
      buckets.push_back(std::move(bucket));
    }
    stats.buckets = buckets.size();
    const auto spec = compress::CodecSpec::parse(options.codec);
    compressed = std::make_unique<CompressedSum>(comm, spec, sizes, params.front().device(), selectOnFromEnvironment());
    plain = std::make_unique<CompressedSum>(comm, compress::CodecSpec{}, sizes, params.front().device());
  }

  // The strides of the parameters that are not contiguous (their bucket slots take them): a rank
  // whose model is channels_last where another's is not would add up unlike elements.
  std::string layouts() const {
    std::ostringstream out;
    for (size_t k = 0; k < params.size(); ++k) {
      if (!params[k].is_contiguous()) out << names[k] << " strides " << params[k].strides() << "; ";
    }
    return out.str();
  }

  // Parameter p's slot in `flat` from `offset` on: a tensor shaped like p over p.numel() floats
  // there, with p's strides when p's elements are dense and do not overlap (a channels_last
  // convolution's weight), as DDP's bucket views are, so that autograd's gradient, which follows
  // its parameter's layout, is added in place and the optimizer sees .grad laid out as the
  // parameter; contiguous otherwise. Made with from_blob, not as an autograd view of `flat`,
  // which autograd would refuse to detach in place; each keeps `flat` alive, so a .grad outlives
  // the handle safely. Every rank lays its slots out the same way (checked with the model).
  static torch::Tensor slotFor(const torch::Tensor& flat, int64_t offset, const torch::Tensor& p) {
    const bool ownLayout = p.is_non_overlapping_and_dense() && !p.is_contiguous();
    void* at = static_cast<char*>(flat.data_ptr()) + offset * int64_t(flat.element_size());
    auto keep = [flat](void*) {};
    if (!ownLayout) return torch::from_blob(at, p.sizes(), keep, flat.options());
    return torch::from_blob(at, p.sizes(), p.strides(), keep, flat.options());
  }

  // The ranks still training (join()): a one-integer allreduce at the start of every synchronized
  // step, matched by the shadow rounds of the ranks that have finished.
  int64_t activeRanks(int64_t mine) {
    auto flag = torch::tensor({mine}, torch::kInt64);
    comm->allreduce(flag);
    return flag.item<int64_t>();
  }

  // Calls f on every parameter tensor registered in m and its submodules (a shared one once per
  // place), without the names.
  template <typename F>
  static void forEachParameter(const torch::nn::Module& m, const F& f) {
    for (const auto& item : ParametersOf::of(m)) f(item.value());
    for (const auto& child : m.children()) forEachParameter(*child, f);
  }

  // The parameter `p` of the module, by name (an error's message only: this builds every name).
  std::string nameOf(const torch::Tensor& p) const {
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      if (item.value().unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return item.key();
    }
    return "(unnamed)";
  }

  // The module's trainable parameters are still the ones hooked when the handle was made: one
  // frozen since would get a .grad of zeros at every step (which weight decay and momentum act
  // on), and one unfrozen or registered since has no hook, so each rank would keep its own
  // gradient and the replicas drift apart. One pass over the parameters, no names, no
  // communication (every rank that changed its model the same way refuses the same step).
  void checkModelUnchanged() {
    const uint64_t check = ++checks;
    size_t found = 0;
    const torch::Tensor* stranger = nullptr;
    forEachParameter(*module, [&](const torch::Tensor& p) {
      if (stranger != nullptr || !p.defined() || !p.requires_grad()) return;
      const auto at = indexOf.find(p.unsafeGetTensorImpl());
      if (at == indexOf.end()) {
        stranger = &p;
      } else if (seenBy[at->second] != check) {
        seenBy[at->second] = check;
        ++found;
      }
    });
    constexpr const char* fix = ": make the handle after changing the model";
    COHORT_CHECK(stranger == nullptr, InvalidArgument, kWho, ": parameter ", nameOf(*stranger),
                 " was added or unfrozen after the DataParallel handle was made, which did not hook it (each rank "
                 "would keep its own gradient and the replicas drift apart)",
                 fix);
    if (found == params.size()) return;
    for (size_t k = 0; k < params.size(); ++k) {
      if (seenBy[k] == check) continue;
      COHORT_CHECK(params[k].requires_grad(), InvalidArgument, kWho, ": parameter ", names[k],
                   " was frozen after the DataParallel handle was made (it would still get a .grad of zeros at every "
                   "step, which weight decay and momentum act on)",
                   fix);
      throw InvalidArgument(std::string(kWho) + ": parameter " + names[k] +
                            " is no longer in the model: it was removed or replaced after the DataParallel handle was "
                            "made" +
                            fix);
    }
  }

  void beginSync() {
    checkModelUnchanged();
    const int task = torch::autograd::get_current_graph_task_id();
    // An older task than the last synchronized one: the backward around a nested one that began,
    // and so ended, the synchronization (every bucket it had not filled went as zeros).
    COHORT_CHECK(task < 0 || task >= lastSyncTask, InvalidArgument, kWho, kNested);
    syncTask = task;
    inBackward = true;
    for (auto& bucket : buckets) {
      bucket.pending = bucket.params.size();
      bucket.filled.assign(bucket.params.size(), false);
    }
    nextToLaunch = 0;
    for (auto& g : sparseGrads) g = torch::Tensor();
    scale = 1.0 / comm->worldSize();
    startCounting();
    // libtorch runs no final callback when backward fails part-way; the sentinel, destroyed with
    // the failed pass's graph task, then marks the handle unusable: this rank's collectives are
    // out of step with the others', and going on would pair them wrongly.
    auto sentinel = std::make_shared<Sentinel>(this);
    torch::autograd::Engine::get_default_engine().queue_callback([sentinel] {
      sentinel->ran = true;
      sentinel->impl->endSync();
    });
    if (joining) {
      const int64_t active = guard([&] { return activeRanks(1); });
      scale = 1.0 / double(std::max<int64_t>(1, active));
    }
    scaleTensors.set(scale);
  }

  // slot = gradient * scale, in one kernel. mul_out with a Scalar would not be: in LibTorch 2.11
  // its out= form multiplies into a temporary and copies that into `out` (seen in a --profile
  // trace: 5 operators, an allocation and 2 kernels per parameter); mul_out with a 0-dim CPU
  // tensor is the structured kernel itself, and a CUDA kernel takes a CPU scalar. The product is the
  // same: either way a float32 gradient is multiplied by float(scale) (a 0-dim tensor does not
  // promote the gradient's dtype; other dtypes get the double, so that a float64 gradient gets the
  // exact scale and a 16-bit one is scaled in float, at the cost of the scalar's cast).
  // At one rank, a copy.
  void scaledInto(torch::Tensor& slot, const torch::Tensor& gradient) const {
    if (scale == 1.0) {
      slot.copy_(gradient);
    } else {
      torch::mul_out(slot, gradient, scaleTensors.forTensor(slot));
    }
  }

  // Parameter k's .grad has just had this backward's gradient added (or, after zero_grad() set it
  // to none, is that gradient): this rank's contribution, what earlier backward passes (under
  // noSync, or without zero_grad) left there plus this one's.
  void onGradient(size_t k, const torch::Tensor& incoming) {
    if (*noSyncDepth > 0 || comm == nullptr) return;
    checkUsable();
    torch::Tensor& grad = params[k].mutable_grad();
    COHORT_CHECK(!incoming.is_sparse() || rowSparse[k], InvalidArgument, kWho, ": parameter ", names[k],
                 " got a sparse gradient, but it is not the weight of an nn::Embedding or nn::EmbeddingBag made "
                 "with sparse(true), the row-sparse parameters DataParallel knows");
    if (!inBackward) beginSync();
    COHORT_CHECK(torch::autograd::get_current_graph_task_id() == syncTask, InvalidArgument, kWho, ": parameter ",
                 names[k], kNested);
    // A custom autograd Function may return no gradient (an undefined tensor) for a parameter.
    // With nothing in .grad either, the parameter got none on this rank: its slot is left to the
    // end of backward, as an unused parameter's (zeros, or none under findUnusedParameters).
    if (!incoming.defined() && !grad.defined()) return;
    torch::NoGradGuard noGrad;
    if (rowSparse[k]) {
      sparseGrads[k] = grad;
      grad.reset();
      return;
    }
    auto [b, i] = slotOf[k];
    Bucket& bucket = buckets[b];
    // A second gradient in one synchronized backward (a parameter used by two hooks' worth of
    // graph, retain_graph twice) would be added into a slot already scaled, perhaps on the wire.
    COHORT_CHECK(!bucket.filled[i], InvalidArgument, kWho, ": parameter ", names[k],
                 " got a second gradient in one synchronized backward; DataParallel takes one per parameter and "
                 "step: run the others under noSync()");
    torch::Tensor& slot = bucket.slots[i];
    COHORT_CHECK(!incoming.defined() || incoming.scalar_type() == slot.scalar_type(), InvalidArgument, kWho,
                 ": parameter ", names[k], " has a ", incoming.dtype(), " gradient but was ", slot.dtype(),
                 " when the handle was made: convert the model (module->to(dtype)) before making the handle");
    if (grad.defined() && grad.data_ptr() == slot.data_ptr()) {
      if (scale != 1.0)
        slot.mul_(scaleTensors.forTensor(slot));  // autograd added into the bucket itself (x * 1 is x: no kernel)
    } else if (grad.defined()) {
      scaledInto(slot, grad);  // a .grad of its own (zero_grad() set it to none): copied, dropped
    } else {
      slot.zero_();
    }
    grad = slot;
    bucket.filled[i] = true;
    --bucket.pending;
    if (options.overlap) guard([&] { launchReady(/*duringBackward=*/true); });
  }

  // Every codec's exchange is asynchronous (none: Gloo's allreduce; the others on CompressedSum's
  // communication thread), so a bucket starts from the hook that completes it.
  void launchReady(bool duringBackward) {
    CompressedSum& sum = exchange();
    while (nextToLaunch < buckets.size() && buckets[nextToLaunch].pending == 0) {
      sum.start(nextToLaunch, buckets[nextToLaunch].flat);
      ++nextToLaunch;
      if (duringBackward) ++stats.bucketsStartedInBackward;
    }
  }

  // Whether parameter k has a gradient on this rank at the end of backward: its hook ran in this
  // backward, or its .grad is still there (earlier backward passes under noSync, or no zero_grad()).
  bool hasGradient(size_t k) const {
    if (params[k].grad().defined()) return true;
    if (rowSparse[k]) return sparseGrads[k].defined();
    const auto [b, i] = slotOf[k];
    return buckets[b].filled[i];
  }

  // Per parameter, whether some rank has a gradient for it (`mine`: this rank's; a rank that
  // has joined has none): an allreduce of one int32 per parameter, issued after the buckets by
  // every rank so that the collectives pair up, its bytes counted in stats. Without
  // findUnusedParameters, all true.
  std::vector<bool> usedOnSomeRank(const std::vector<bool>& mine) {
    std::vector<bool> used(params.size(), true);
    if (!options.findUnusedParameters) return used;
    auto counts = torch::zeros({int64_t(params.size())}, torch::kInt32);
    auto* count = counts.data_ptr<int32_t>();
    for (size_t k = 0; k < mine.size(); ++k) count[k] = mine[k] ? 1 : 0;
    const CommCounters before = comm->counters();
    comm->allreduce(counts);
    const CommCounters after = comm->counters();
    stats.bytesSent += after.bytesSent - before.bytesSent;  // in stats() with the buckets' traffic
    stats.bytesReceived += after.bytesReceived - before.bytesReceived;
    for (size_t k = 0; k < params.size(); ++k) used[k] = count[k] > 0;
    return used;
  }

  // At backward's end, the slots no hook filled: what the parameter's .grad holds (averaged like
  // any), else zeros; and the row-sparse gradients left from earlier backward passes.
  void fillMissingSlots() {
    for (auto& bucket : buckets) {
      for (size_t i = 0; i < bucket.params.size(); ++i) {
        if (bucket.filled[i]) continue;
        const torch::Tensor& existing = params[bucket.params[i]].grad();
        if (existing.defined()) {
          scaledInto(bucket.slots[i], existing);
        } else {
          bucket.slots[i].zero_();
        }
        bucket.filled[i] = true;
      }
      bucket.pending = 0;
    }
    for (size_t k = 0; k < params.size(); ++k) {
      if (rowSparse[k] && !sparseGrads[k].defined() && params[k].grad().defined()) {
        sparseGrads[k] = params[k].grad();  // scaled in exchangeRows
      }
    }
  }

  // Every parameter some rank used gets the average as its .grad (a view of its slot, or the
  // summed rows); one no rank used keeps none (findUnusedParameters): its slot summed zeros.
  void assignGradients(const std::vector<bool>& used) {
    for (auto& bucket : buckets) {
      for (size_t i = 0; i < bucket.params.size(); ++i) {
        if (used[bucket.params[i]]) params[bucket.params[i]].mutable_grad() = bucket.slots[i];
      }
    }
    for (size_t k = 0; k < params.size(); ++k) {
      if (rowSparse[k] && used[k]) params[k].mutable_grad() = sparseGrads[k];
    }
  }

  // The autograd final callback of a synchronized backward.
  void endSync() {
    inBackward = false;
    lastSyncTask = syncTask;
    guard([&] {
      torch::NoGradGuard noGrad;
      std::vector<bool> mine(params.size());
      for (size_t k = 0; k < params.size(); ++k) mine[k] = hasGradient(k);
      fillMissingSlots();
      const auto waitStart = Clock::now();
      exchangeAll();
      const std::vector<bool> used = usedOnSomeRank(mine);
      stats.commWaitSeconds += secondsSince(waitStart);
      assignGradients(used);
      if (options.buffers == DataParallelOptions::Buffers::kEveryStep) averageInPlace(*comm, module->buffers());
      ++stats.syncSteps;
    });
  }

  void startCounting() {
    sentAtStart = exchange().bytesSent();
    receivedAtStart = exchange().bytesReceived();
    phasesAtStart = exchange().phases();
  }

  // Launches what is left, waits for every bucket and writes the sums into the buckets.
  void exchangeAll() {
    CompressedSum& sum = exchange();
    launchReady(/*duringBackward=*/false);
    for (size_t b = 0; b < buckets.size(); ++b) sum.finish(b, buckets[b].flat);
    stats.bytesSent += sum.bytesSent() - sentAtStart;
    stats.bytesReceived += sum.bytesReceived() - receivedAtStart;
    const CompressedSum::Phases phases = sum.phases();
    stats.encodeSeconds += phases.encodeSeconds - phasesAtStart.encodeSeconds;
    stats.wireSeconds += phases.wireSeconds - phasesAtStart.wireSeconds;
    stats.decodeSeconds += phases.decodeSeconds - phasesAtStart.decodeSeconds;
    for (size_t k = 0; k < params.size(); ++k) {
      if (rowSparse[k]) exchangeRows(k, sum.spec());
    }
  }

  // The row-sparse gradient of parameter k (what this rank has, scaled; none: no rows) becomes
  // the sum over the ranks, exchanged as rows (allreduceRows: an allgather of row ids and rows,
  // as c10d does for sparse tensors); fp16 and bf16 apply to the rows' values.
  void exchangeRows(size_t k, const compress::CodecSpec& codec) {
    torch::NoGradGuard noGrad;
    const int64_t dim = params[k].size(1);
    torch::Tensor ids = torch::empty({0}, torch::kInt64);
    torch::Tensor rows = torch::empty({0, dim}, torch::kFloat32);
    if (sparseGrads[k].defined()) {
      std::tie(ids, rows) = gradientRows(sparseGrads[k]);
      rows = rows.mul(scale);
    }
    SummedRows sum = allreduceRows(*comm, ids, rows, codec);
    stats.bytesSent += sum.bytesSent;
    stats.bytesReceived += sum.bytesReceived;
    sparseGrads[k] = torch::sparse_coo_tensor(sum.ids.unsqueeze(0), sum.values, params[k].sizes())._coalesced_(true);
  }

  // After this rank's loop in join(): takes part with zeros in the others' steps until all are done.
  void shadowUntilAllJoined() {
    guard([&] {
      torch::NoGradGuard noGrad;
      while (activeRanks(0) > 0) {
        for (auto& bucket : buckets) {
          bucket.flat.zero_();
          bucket.pending = 0;
        }
        nextToLaunch = 0;
        for (auto& g : sparseGrads) g = torch::Tensor();
        startCounting();
        exchangeAll();
        usedOnSomeRank(std::vector<bool>(params.size(), false));
        if (options.buffers == DataParallelOptions::Buffers::kEveryStep) averageInPlace(*comm, module->buffers());
        ++stats.shadowSteps;
      }
      // The ranks that joined early skipped the optimizer steps of the others: every replica
      // takes the model of the rank that trained longest (the lowest such rank), as DDP's Join
      // does. Optimizer state (momentum) stays each rank's own.
      auto steps = comm->allgather(torch::tensor({stats.syncSteps - syncStepsAtJoin}, torch::kInt64));
      int root = 0;
      for (size_t r = 1; r < steps.size(); ++r) {
        if (steps[r].item<int64_t>() > steps[size_t(root)].item<int64_t>()) root = int(r);
      }
      broadcastModel(*comm, *module, root);
    });
  }

  // Runs f; a communication failure makes the handle unusable and gains the hint about uneven
  // inputs, since that is the usual cause of a rank that stopped answering in a training loop.
  template <typename F>
  auto guard(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const TimeoutError& e) {
      broken = e.what();
      throw TimeoutError(std::string(kWho) + ": " + e.what() + hint());
    } catch (const CommError& e) {
      broken = e.what();
      throw CommError(std::string(kWho) + ": " + e.what() + hint());
    } catch (const std::exception& e) {
      // Anything else part-way (a c10::Error, std::bad_alloc for a staging buffer) leaves this
      // rank's collectives out of step with the others' just the same.
      broken = e.what();
      throw;
    }
  }

  std::string hint() const {
    return joining ? "" : " (if the ranks have different numbers of batches, run each rank's loop inside "
                          "DataParallel::join())";
  }
};

DataParallel::DataParallel(const Job& job, torch::nn::Module& module, DataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  COHORT_CHECK(options.bucketMb > 0, InvalidArgument, kWho, ": bucketMb must be positive, got ", options.bucketMb);
  COHORT_CHECK(options.firstBucketMb > 0, InvalidArgument, kWho, ": firstBucketMb must be positive, got ",
               options.firstBucketMb);
  COHORT_CHECK(options.codecWarmupSteps >= 0, InvalidArgument, kWho, ": codecWarmupSteps must be at least 0, got ",
               options.codecWarmupSteps);
  const auto codec = compress::CodecSpec::parse(options.codec);  // throws InvalidArgument naming the accepted forms
  // A parameter no rank used gets no .grad, but an error-feedback codec has already sent part of
  // its residual for it (and counted that part as applied): it would be lost.
  COHORT_CHECK(!options.findUnusedParameters || !codec.errorFeedback(), InvalidArgument, kWho,
               ": findUnusedParameters with codec ", codec.text(),
               ", which keeps a residual: the residual a skipped parameter sends would be dropped; use codec none, "
               "fp16 or bf16, or leave findUnusedParameters off");
  s.options = std::move(options);
  s.module = &module;
  for (auto& [name, p] : uniqueParameters(module)) {
    if (!p.requires_grad()) continue;
    COHORT_CHECK(isAveragedDtype(p.scalar_type()), InvalidArgument, kWho, ": parameter ", name, " is ", p.dtype(),
                 "; DataParallel averages float32, float64, float16 and bfloat16 parameters");
    COHORT_CHECK(p.scalar_type() == torch::kFloat32 || codec.kind == compress::CodecKind::None, InvalidArgument, kWho,
                 ": parameter ", name, " is ", p.dtype(), ", but codec ", codec.text(),
                 " compresses float32 gradients: use codec none (any floating dtype) or a float32 model");
    COHORT_CHECK(s.params.empty() || p.device() == s.params.front().device(), InvalidArgument, kWho, ": parameter ",
                 name, " is on ", p.device(), " but ", s.names.front(), " on ", s.params.front().device(),
                 "; DataParallel needs the whole model on one device: call module->to(device) first");
    s.names.push_back(name);
    s.params.push_back(p);
    s.rowSparse.push_back(p.dim() == 2 && hasRowSparseGradient(module, p));
    COHORT_CHECK(!s.rowSparse.back() || p.scalar_type() == torch::kFloat32, InvalidArgument, kWho, ": parameter ", name,
                 " is a sparse embedding in ", p.dtype(), "; row-sparse gradients are exchanged in float32 only");
  }
  s.sparseGrads.resize(s.params.size());
  COHORT_CHECK(!s.params.empty(), InvalidArgument, kWho,
               ": the module has no parameters that require gradients; there is nothing to average");
  // Before any collective: every rank refuses here alike.
  HookedParameters::claim(s.params, s.names);
  s.claimed = true;
  s.seenBy.assign(s.params.size(), 0);
  for (size_t k = 0; k < s.params.size(); ++k) s.indexOf.emplace(s.params[k].unsafeGetTensorImpl(), k);
  const c10::Device device = s.params.front().device();
  if (!device.is_cpu()) {
    // On a device, the buckets live there. Codec none goes through the communicator's backend for
    // CUDA tensors (NCCL, or Gloo, which stages them through host memory); the others through pinned
    // host buffers of CompressedSum's (fp16 and bf16 cast on the device). The row exchange works on
    // host memory: not yet on devices.
    for (size_t k = 0; k < s.params.size(); ++k) {
      COHORT_CHECK(!s.rowSparse[k], InvalidArgument, kWho, ": parameter ", s.names[k], " is a sparse embedding on ",
                   device, "; row-sparse gradients are exchanged on the CPU only so far: train on the CPU");
    }
  }
  s.comm = job.communicator();
  if (s.comm == nullptr) return;  // one process: nothing to exchange, nothing hooked
  checkSameModel(
      *s.comm, module, kWho,
      detail::concat("options codec=", s.options.codec, " codecWarmupSteps=", s.options.codecWarmupSteps, " bucketMb=",
                     s.options.bucketMb, " firstBucketMb=", s.options.firstBucketMb, " overlap=", s.options.overlap,
                     " buffers=", int(s.options.buffers), " findUnusedParameters=", s.options.findUnusedParameters,
                     " device=", c10::DeviceTypeName(device.type(), /*lower_case=*/true), " layouts=", s.layouts()));
  broadcastModel(*s.comm, module);
  s.buildBuckets();
  s.accumulators.resize(s.params.size());
  s.hookKeys.resize(s.params.size());
  for (size_t k = 0; k < s.params.size(); ++k) {
    s.hookAccumulator(k);
    // Autograd replaces a parameter's accumulator when set_data() changes its device or dtype (a
    // checkpoint loaded onto another device, then moved back); hooks on the parameter itself stay,
    // and run before its accumulator: this one puts the post hook on the new accumulator.
    Impl* impl = impl_.get();
    s.tensorHooks.push_back(s.params[k].register_hook([impl, k](const torch::Tensor&) {
      if (torch::autograd::impl::try_get_grad_accumulator(impl->params[k]) != impl->accumulators[k]) {
        impl->hookAccumulator(k);
      }
    }));
  }
}

DataParallel::~DataParallel() {
  Impl& s = *impl_;
  for (size_t k = 0; k < s.tensorHooks.size(); ++k) s.params[k].remove_hook(s.tensorHooks[k]);
  for (size_t k = 0; k < s.accumulators.size(); ++k) {
    if (s.accumulators[k] != nullptr) s.accumulators[k]->del_post_hook(s.hookKeys[k]);
  }
}

DataParallel::NoSync::NoSync(const std::shared_ptr<int>& depth) : depth_(depth) { ++*depth; }
DataParallel::NoSync::NoSync(NoSync&& other) noexcept : depth_(std::move(other.depth_)) { other.depth_.reset(); }
DataParallel::NoSync::~NoSync() {
  // The handle may be gone already (a guard that outlived it): then there is nothing to undo.
  if (const std::shared_ptr<int> depth = depth_.lock()) --*depth;
}

DataParallel::NoSync DataParallel::noSync() {
  COHORT_CHECK(!impl_->inBackward, InvalidArgument, kWho, "::noSync() called during a backward pass");
  return NoSync(impl_->noSyncDepth);
}

void DataParallel::join(const std::function<void()>& loop) {
  Impl& s = *impl_;
  COHORT_CHECK(!s.joining, InvalidArgument, kWho, "::join() called inside join(): call it once around the loop");
  COHORT_CHECK(*s.noSyncDepth == 0, InvalidArgument, kWho,
               "::join() called under noSync(): end the noSync scope first (a rank that joins must be synchronized)");
  s.joining = true;
  s.syncStepsAtJoin = s.stats.syncSteps;
  try {
    loop();
  } catch (...) {
    s.joining = false;
    throw;
  }
  if (s.comm != nullptr) {
    try {
      s.shadowUntilAllJoined();
    } catch (...) {
      s.joining = false;
      throw;
    }
  }
  s.joining = false;
}

void DataParallel::synchronizeBuffers() {
  Impl& s = *impl_;
  if (s.comm == nullptr) return;
  COHORT_CHECK(!s.joining, InvalidArgument, kWho,
               "::synchronizeBuffers() inside join(): the ranks that have joined cannot take part in it; call it "
               "after join() returns");
  s.checkUsable();
  s.guard([&] { averageInPlace(*s.comm, s.module->buffers()); });
}

DataParallel::CodecState DataParallel::codecState() const {
  Impl& s = *impl_;
  CodecState state{.steps = s.codecSteps(), .residual = {}};
  std::vector<float> residual;
  for (size_t id = 0; id < s.buckets.size(); ++id) {
    const std::span<const float> r = s.compressed->residual(id);
    residual.insert(residual.end(), r.begin(), r.end());
  }
  if (!residual.empty()) state.residual = torch::from_blob(residual.data(), {int64_t(residual.size())}).clone();
  return state;
}

void DataParallel::setCodecState(const CodecState& state) {
  Impl& s = *impl_;
  COHORT_CHECK(state.steps >= 0, InvalidArgument, kWho, ": a saved step count must be at least 0, got ", state.steps);
  if (state.residual.defined()) {
    size_t keeps = 0;
    for (size_t id = 0; id < s.buckets.size(); ++id) keeps += s.compressed->residual(id).size();
    COHORT_CHECK(keeps > 0, InvalidArgument, kWho, ": the saved state holds a codec residual, but codec ",
                 s.options.codec, " keeps none: resume with the codec the checkpoint was written with");
    const torch::Tensor r = state.residual.to(torch::kCPU, torch::kFloat32).contiguous();
    COHORT_CHECK(r.dim() == 1 && size_t(r.numel()) == keeps, InvalidArgument, kWho, ": the saved codec residual has ",
                 r.numel(), " entries, this model's buckets ", keeps,
                 ": resume with the same model, --bucket-mb and --first-bucket-mb");
    size_t at = 0;
    for (size_t id = 0; id < s.buckets.size(); ++id) {
      const size_t n = s.compressed->residual(id).size();
      s.compressed->setResidual(id, {r.data_ptr<float>() + at, n});
      at += n;
    }
  }
  s.stepsBefore = state.steps - s.stats.syncSteps - s.stats.shadowSteps;
}

DataParallelStats DataParallel::stats() const { return impl_->stats; }
int DataParallel::rank() const { return impl_->comm ? impl_->comm->rank() : 0; }
int DataParallel::worldSize() const { return impl_->comm ? impl_->comm->worldSize() : 1; }

}  // namespace cohort
