// The vertical split (include/cohort/tensor_parallel.h). Megatron-LM's two collectives, as
// autograd functions over the ways' communicator: GradientSum (identity forward, allreduce of the
// input gradient backward) before a column-split layer, PartialSum (allreduce forward, identity
// backward) after a row-split one.
#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/tensor_parallel.h>

#include "models/cpu_generator.h"
#include "schemes/model_sync.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <optional>
#include <sstream>

namespace cohort {

namespace {

constexpr const char* kWho = "cohort::TensorParallel";

namespace nn = torch::nn;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Communicator* commOf(AutogradContext* ctx) { return reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt()); }

// What a collective sums in: float32 at least, so that a 16-bit activation or gradient (a forward
// pass under autocast) is summed over the ways without a rounding per addition. A copy, always:
// the collective writes it in place.
torch::Tensor summable(const torch::Tensor& t) {
  const c10::ScalarType type = c10::promoteTypes(t.scalar_type(), torch::kFloat32);
  return type == t.scalar_type() ? t.contiguous().clone() : t.to(type).contiguous();
}

struct GradientSum : torch::autograd::Function<GradientSum> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = summable(grads[0]);
    commOf(ctx)->allreduce(g);
    return {g.to(grads[0].scalar_type()), torch::Tensor()};
  }
};

struct PartialSum : torch::autograd::Function<PartialSum> {
  // A 16-bit x (under autocast) is summed, and comes out, in float32; its gradient goes back in
  // x's dtype.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["type"] = int64_t(x.scalar_type());
    auto y = summable(x);
    reinterpret_cast<Communicator*>(comm)->allreduce(y);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].to(c10::ScalarType(ctx->saved_data["type"].toInt())), torch::Tensor()};
  }
};

// The layers the split inserts. They keep the communicator alive.
struct GradientSumLayerImpl : nn::Module {
  explicit GradientSumLayerImpl(std::shared_ptr<Communicator> c) : comm(std::move(c)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x.requires_grad() ? GradientSum::apply(x, reinterpret_cast<int64_t>(comm.get())) : x;
  }
  std::shared_ptr<Communicator> comm;
};
TORCH_MODULE(GradientSumLayer);

struct PartialSumLayerImpl : nn::Module {
  // `bias` is added once, after the sum; `dims` is the output's rank (2: Linear, 4: Conv2d).
  // The bias keeps `b`'s requires_grad (a frozen layer's stays frozen).
  PartialSumLayerImpl(std::shared_ptr<Communicator> c, const torch::Tensor& b, int64_t d) : comm(std::move(c)), dims(d) {
    if (b.defined()) bias = register_parameter("bias", b.detach().clone(), b.requires_grad());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = PartialSum::apply(x, reinterpret_cast<int64_t>(comm.get()));
    if (!bias.defined()) return y;
    return dims == 4 ? y + bias.view({1, -1, 1, 1}) : y + bias;
  }
  std::shared_ptr<Communicator> comm;
  torch::Tensor bias;
  int64_t dims;
};
TORCH_MODULE(PartialSumLayer);

// A dropout the split redraws (WayDropout): its p, and for Dropout2d and Dropout3d the dimensions
// each channel's one draw covers.
struct DropoutKind {
  double p = 0;
  int64_t featureDims = 0;  // 0: Dropout, each element its own draw
};

std::optional<DropoutKind> dropoutKind(const std::shared_ptr<nn::Module>& m) {
  if (auto* d = m->as<nn::DropoutImpl>()) return DropoutKind{d->options.p(), 0};
  if (auto* d = m->as<nn::Dropout2dImpl>()) return DropoutKind{d->options.p(), 2};
  if (auto* d = m->as<nn::Dropout3dImpl>()) return DropoutKind{d->options.p(), 3};
  return std::nullopt;
}

// Layers that draw random numbers in training and that the split cannot draw alike on every way.
bool drawsApart(const std::shared_ptr<nn::Module>& m) {
  return m->as<nn::AlphaDropoutImpl>() || m->as<nn::FeatureAlphaDropoutImpl>() || m->as<nn::RReLUImpl>();
}

// A dropout of the split network. Every way draws the mask of the whole activation from a
// generator of its own, seeded alike on the ways of a replica, and applies its slice: a dropout on
// split units drops each way's units as one process drawing that mask would (a mask of the way's
// own shape would repeat one pattern on every way of an even split, and an uneven split would set
// the ways' generators apart), and one on an activation every way holds whole drops the same
// elements on every way (else the layers kept whole would train apart). Not torch's generator:
// the ways' draws do not depend on what else a process draws. The mask is drawn on the CPU and
// copied to the activation's device.
struct WayDropoutImpl : nn::Module {
  struct Slice {
    int64_t total = 0, offset = 0, size = 0;  // of dimension 1; total 0: the activation is whole
  };
  WayDropoutImpl(DropoutKind k, uint64_t seed, Slice s)
      : kind(k), slice(s), generator(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  torch::Tensor forward(const torch::Tensor& x) {
    if (!is_training() || kind.p == 0) return x;
    if (kind.p == 1) return x * torch::zeros({}, x.options());
    std::vector<int64_t> shape = x.sizes().vec();
    if (kind.featureDims > 0) {
      COHORT_CHECK_EQ(x.dim(), kind.featureDims + 2, InvalidArgument, kWho, ": Dropout", kind.featureDims,
                      "d under tensor parallelism takes a batch of channels (N, C, ...) only");
      for (size_t d = 2; d < shape.size(); ++d) shape[d] = 1;
    }
    if (slice.total > 0) shape[1] = slice.total;
    auto mask = torch::empty(shape, torch::kFloat32).bernoulli_(1 - kind.p, generator).div_(1 - kind.p);
    if (slice.total > 0) mask = mask.narrow(1, slice.offset, slice.size);
    return x * mask.to(x.device(), x.scalar_type());
  }
  void pretty_print(std::ostream& out) const override {
    out << "cohort::WayDropout(p=" << kind.p << ", feature_dims=" << kind.featureDims << ")";
  }

  DropoutKind kind;
  Slice slice;
  at::Generator generator;
};
TORCH_MODULE(WayDropout);

// The seed of the dropout at layer `index` of `replica`: way 0's generator state (so that one
// process seeded differently gets other masks) mixed with both, as splitmix64 mixes.
uint64_t dropoutSeed(uint64_t base, size_t index, int replica) {
  uint64_t z = base + 0x9e3779b97f4a7c15ULL * (uint64_t(index) + 1) + 0xbf58476d1ce4e5b9ULL * uint64_t(replica);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

bool passesThrough(const std::shared_ptr<nn::Module>& m) {
  return m->as<nn::ReLUImpl>() || m->as<nn::MaxPool2dImpl>() || m->as<nn::AvgPool2dImpl>() || dropoutKind(m) ||
         m->as<nn::TanhImpl>() || m->as<nn::SigmoidImpl>() || m->as<nn::GELUImpl>() || m->as<nn::LeakyReLUImpl>() ||
         m->as<nn::IdentityImpl>();
}

bool isFlatten(const std::shared_ptr<nn::Module>& m) {
  auto* f = m->as<nn::FlattenImpl>();
  return f != nullptr && f->options.start_dim() == 1 && f->options.end_dim() == -1;
}

nn::Conv2dImpl* plainConv(const std::shared_ptr<nn::Module>& m) {
  auto* conv = m->as<nn::Conv2dImpl>();
  if (conv == nullptr || conv->options.groups() != 1 || !std::holds_alternative<torch::enumtype::kZeros>(conv->options.padding_mode())) {
    return nullptr;
  }
  return conv;
}

// A Conv2d like `conv` with other channel counts.
nn::Conv2dOptions convOptions(const nn::Conv2dImpl& conv, int64_t in, int64_t out) {
  const auto& o = conv.options;
  return nn::Conv2dOptions(in, out, o.kernel_size())
      .stride(o.stride())
      .padding(o.padding())
      .dilation(o.dilation())
      .bias(o.bias())
      .padding_mode(o.padding_mode());
}

// Makes `part`'s weight and bias (copied rows or columns of `whole`'s) frozen where `whole`'s are:
// a new layer's parameters require their gradient.
template <typename LayerImpl, typename Layer>
void keepFrozen(const LayerImpl& whole, Layer& part) {
  part->weight.requires_grad_(whole.weight.requires_grad());
  if (part->bias.defined() && whole.bias.defined()) part->bias.requires_grad_(whole.bias.requires_grad());
}

// One way's share of `units`: as even as possible, the first ones one larger.
std::pair<int64_t, int64_t> share(int64_t units, int ways, int way) {
  const int64_t base = units / ways, extra = units % ways;
  const int64_t size = base + (way < extra ? 1 : 0);
  const int64_t offset = base * way + std::min<int64_t>(way, extra);
  return {offset, size};
}

// "Linear" for torch::nn::LinearImpl.
std::string kindOf(const nn::Module& m) {
  std::string kind = m.name();
  if (auto at = kind.rfind("::"); at != std::string::npos) kind = kind.substr(at + 2);
  if (kind.size() > 4 && kind.compare(kind.size() - 4, 4, "Impl") == 0) kind.resize(kind.size() - 4);
  return kind;
}

std::string describeLayer(size_t index, const std::string& name, const std::shared_ptr<nn::Module>& m) {
  std::ostringstream out;
  out << "layer " << index << " (" << name << ": ";
  m->pretty_print(out);
  out << ")";
  return out.str();
}

// The layers' output shapes, from a dry run on (at most) two examples: a Flatten after split
// channels needs its input's. A dropout in it draws from torch's CPU generator; its state is put
// back.
std::vector<std::vector<int64_t>> outputShapes(std::vector<nn::AnyModule>& layers, const torch::Tensor& sample) {
  torch::NoGradGuard noGrad;
  const torch::Tensor rng = cpuGeneratorState();
  std::vector<std::vector<int64_t>> shapes;
  auto x = sample.narrow(0, 0, std::min<int64_t>(2, sample.size(0)));
  for (auto& layer : layers) {
    x = layer.forward(x);
    shapes.push_back(x.sizes().vec());
  }
  setCpuGeneratorState(rng);
  return shapes;
}

// A seed the ways of a replica agree on, for their dropouts: way 0's generator state, hashed
// (FNV-1a), and broadcast. No collective when the model has no dropout (every way sees the same
// layers).
uint64_t agreedDropoutBase(const std::vector<nn::AnyModule>& layers, Communicator* waysComm) {
  bool any = false;
  for (const auto& layer : layers) any = any || dropoutKind(layer.ptr());
  if (!any) return 0;
  const torch::Tensor state = cpuGeneratorState().contiguous();
  const auto* bytes = state.data_ptr<uint8_t>();
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (int64_t i = 0; i < state.numel(); ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ULL;
  auto agreed = torch::tensor({int64_t(hash)}, torch::kInt64);
  if (waysComm != nullptr) waysComm->broadcast(agreed, 0);
  return uint64_t(agreed.item<int64_t>());
}

// Whether layer i's split output can be consumed: through element-wise layers, pooling and a
// Flatten, by a Linear (after a Linear or a Flatten) or a Conv2d (after a Conv2d).
bool feedsSplittable(const std::vector<nn::AnyModule>& layers, size_t i) {
  enum { kFeatures, kChannels } kind = layers[i].ptr()->as<nn::LinearImpl>() ? kFeatures : kChannels;
  for (size_t j = i + 1; j < layers.size(); ++j) {
    auto m = layers[j].ptr();
    if (passesThrough(m)) continue;
    if (isFlatten(m) && kind == kChannels) {
      kind = kFeatures;
      continue;
    }
    if (m->as<nn::LinearImpl>()) return kind == kFeatures;
    if (plainConv(m)) return kind == kChannels;
    return false;
  }
  return false;
}

// Builds one way's Sequential layer by layer: a Linear or Conv2d whose output a later layer can
// take split is split by its outputs (columns, output channels), the layers after it pass the
// split activation through, and the next Linear or Conv2d is split by its inputs (rows, input
// channels) and followed by the sum over the ways. The rest is kept whole.
class WaySplitter {
 public:
  WaySplitter(std::shared_ptr<Communicator> comm, int ways, int way, int replica, uint64_t dropoutBase)
      : comm_(std::move(comm)), ways_(ways), way_(way), replica_(replica), dropoutBase_(dropoutBase) {}

  void add(const std::vector<nn::AnyModule>& layers, const std::vector<std::string>& names,
           const std::vector<std::vector<int64_t>>& shapes, size_t i) {
    torch::NoGradGuard noGrad;
    auto m = layers[i].ptr();
    if (i > 0) plan_ << "; ";
    plan_ << i << " " << kindOf(*m) << " ";
    if (auto dropout = dropoutKind(m)) {
      addDropout(*dropout, names[i], m, i);
    } else if (split_.on) {
      continueSplit(layers[i], names[i], shapes, i);
    } else if ((m->as<nn::LinearImpl>() || plainConv(m)) && feedsSplittable(layers, i)) {
      splitOutputs(names[i], m, i);
    } else {
      COHORT_CHECK(!drawsApart(m), InvalidArgument, kWho, ": ", describeLayer(i, names[i], m),
                   " draws random numbers, which the ways would draw apart (only Dropout, Dropout2d and Dropout3d "
                   "are drawn alike): replace it, or use another --strategy");
      push(names[i], layers[i]);
      plan_ << "whole";
    }
  }

  nn::Sequential local() const { return local_; }
  std::string plan() const { return plan_.str(); }
  bool splitAny() const { return splitAny_; }

 private:
  // (An rvalue name picks Sequential's public push_back overload.)
  void push(const std::string& name, nn::AnyModule layer) { local_->push_back(std::string(name), std::move(layer)); }

  // Layer i is a dropout: a WayDropout over this way's slice of the activation, or over all of it.
  void addDropout(DropoutKind kind, const std::string& name, const std::shared_ptr<nn::Module>& m, size_t i) {
    WayDropoutImpl::Slice slice;
    if (split_.on) {
      COHORT_CHECK(kind.featureDims == 0 || split_.perUnit == 1, InvalidArgument, kWho, ": ", describeLayer(i, name, m),
                   " drops channels of an activation that is no longer channels");
      slice = {split_.units * split_.perUnit, split_.offset * split_.perUnit, split_.size * split_.perUnit};
    }
    push(name, nn::AnyModule(WayDropout(kind, dropoutSeed(dropoutBase_, i, replica_), slice)));
    plan_ << (split_.on ? "split" : "whole");
  }

  // Layer i (a Linear or a plain Conv2d) keeps this way's share of its outputs.
  void splitOutputs(const std::string& name, const std::shared_ptr<nn::Module>& m, size_t i) {
    auto* linear = m->as<nn::LinearImpl>();
    auto* conv = plainConv(m);
    const int64_t units = linear ? linear->options.out_features() : conv->options.out_channels();
    COHORT_CHECK(units >= ways_, InvalidArgument, kWho, ": ", describeLayer(i, name, m), " has ", units,
                 linear ? " output units" : " output channels", ", fewer than the ", ways_,
                 " ways to split them over: use fewer ways (--ways)");
    auto [offset, size] = share(units, ways_, way_);
    push(name + "_input", nn::AnyModule(GradientSumLayer(comm_)));
    if (linear) {
      auto part = nn::Linear(nn::LinearOptions(linear->options.in_features(), size).bias(linear->options.bias()));
      part->weight.copy_(linear->weight.narrow(0, offset, size));
      if (linear->options.bias()) part->bias.copy_(linear->bias.narrow(0, offset, size));
      keepFrozen(*linear, part);
      push(name, nn::AnyModule(part));
    } else {
      auto part = nn::Conv2d(convOptions(*conv, conv->options.in_channels(), size));
      part->weight.copy_(conv->weight.narrow(0, offset, size));
      if (conv->options.bias()) part->bias.copy_(conv->bias.narrow(0, offset, size));
      keepFrozen(*conv, part);
      push(name, nn::AnyModule(part));
    }
    split_ = {true, units, offset, size, 1};
    splitAny_ = true;
    plan_ << (linear ? "columns " : "output channels ") << size << "/" << units;
  }

  // Layer i receives a split activation: passes it through, or takes it split and sums.
  void continueSplit(const nn::AnyModule& layer, const std::string& name,
                     const std::vector<std::vector<int64_t>>& shapes, size_t i) {
    auto m = layer.ptr();
    if (passesThrough(m) || isFlatten(m)) {
      if (isFlatten(m)) {
        const auto& in = shapes[i - 1];
        for (size_t d = 2; d < in.size(); ++d) split_.perUnit *= in[d];
      }
      push(name, layer);
      plan_ << "split";
    } else if (auto* linear = m->as<nn::LinearImpl>()) {
      const int64_t width = split_.units * split_.perUnit;
      COHORT_CHECK_EQ(linear->options.in_features(), width, InvalidArgument, kWho, ": ", describeLayer(i, name, m),
                      " expects another input width than the split layers before it give");
      auto part =
          nn::Linear(nn::LinearOptions(split_.size * split_.perUnit, linear->options.out_features()).bias(false));
      part->weight.copy_(linear->weight.narrow(1, split_.offset * split_.perUnit, split_.size * split_.perUnit));
      keepFrozen(*linear, part);
      push(name, nn::AnyModule(part));
      push(name + "_sum",
           nn::AnyModule(PartialSumLayer(comm_, linear->options.bias() ? linear->bias : torch::Tensor(), 2)));
      split_.on = false;
      plan_ << "rows " << split_.size * split_.perUnit << "/" << width << " + allreduce";
    } else if (auto* conv = plainConv(m)) {
      COHORT_CHECK(split_.perUnit == 1 && conv->options.in_channels() == split_.units, InvalidArgument, kWho, ": ",
                   describeLayer(i, name, m), " does not take the split channels of the layers before it");
      auto part = nn::Conv2d(convOptions(*conv, split_.size, conv->options.out_channels()).bias(false));
      part->weight.copy_(conv->weight.narrow(1, split_.offset, split_.size));
      keepFrozen(*conv, part);
      push(name, nn::AnyModule(part));
      push(name + "_sum",
           nn::AnyModule(PartialSumLayer(comm_, conv->options.bias() ? conv->bias : torch::Tensor(), 4)));
      split_.on = false;
      plan_ << "input channels " << split_.size << "/" << split_.units << " + allreduce";
    } else {
      throw InvalidArgument(kWho + std::string(": ") + describeLayer(i, name, m) +
                            " would receive a split activation and cannot be split (only Linear, Conv2d, element-wise "
                            "layers, pooling and Flatten can)");
    }
  }

  struct SplitActivation {
    bool on = false;
    int64_t units = 0, offset = 0, size = 0;
    int64_t perUnit = 1;  // features per unit after a Flatten of split channels
  };

  std::shared_ptr<Communicator> comm_;
  int ways_, way_, replica_;
  uint64_t dropoutBase_;
  SplitActivation split_;
  bool splitAny_ = false;
  std::ostringstream plan_;
  nn::Sequential local_;
};

}  // namespace

struct COHORT_LOCAL TensorParallel::Impl {
  std::shared_ptr<Communicator> waysComm;
  std::shared_ptr<Communicator> dataComm;
  int ways = 1, way = 0, replicas = 1, replica = 0;
  nn::Sequential local;
  std::string plan;

  // This rank's way and replica, and the communicators among its ways and among its copies.
  void joinGroups(const Job& job, int waysWanted);
};

TensorParallel::TensorParallel(const Job& job, const nn::Sequential& model, const torch::Tensor& sample,
                               TensorParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  // The model's device (the CPU or one GPU): the dry run runs there, and the split layers, made on
  // the CPU from slices of its weights, are moved there at the end.
  std::optional<c10::Device> device;
  for (const auto& p : model->parameters()) {
    if (!device) device = p.device();
    COHORT_CHECK(p.device() == *device, InvalidArgument, kWho, ": the model's parameters are on ", *device, " and ",
                 p.device(), "; move the whole model to one device (module->to(device))");
  }
  s.joinGroups(job, options.ways);
  if (s.ways == 1) {
    s.local = model;
    s.plan = "whole (one way)";
    return;
  }
  std::vector<nn::AnyModule> layers(model->begin(), model->end());
  const auto names = model->named_children().keys();
  const auto shapes = outputShapes(layers, device ? sample.to(*device) : sample);
  WaySplitter splitter(s.waysComm, s.ways, s.way, s.replica, agreedDropoutBase(layers, s.waysComm.get()));
  for (size_t i = 0; i < layers.size(); ++i) splitter.add(layers, names, shapes, i);
  // Nothing split: every way would train the whole model, each its own copy, silently.
  if (!splitter.splitAny()) {
    bool scripted = false;
    for (const auto& layer : layers) scripted = scripted || kindOf(*layer.ptr()) == "ScriptedLayer";
    throw InvalidArgument(
        std::string(kWho) + ": no layer of the model can be split over " + std::to_string(s.ways) + " ways (" +
        splitter.plan() + "): " +
        (scripted ? "a TorchScript model's layers cannot be split; use a built-in model (--model mlp or cnn), or "
                    "another --strategy"
                  : "only a Linear or a Conv2d whose output reaches another (through element-wise layers, pooling "
                    "and Flatten) can; use another --strategy, or --ways 1"));
  }
  s.local = splitter.local();
  if (device && !device->is_cpu()) s.local->to(*device);
  s.plan = splitter.plan();
}

void TensorParallel::Impl::joinGroups(const Job& job, int waysWanted) {
  const int world = job.worldSize();
  ways = waysWanted > 0 ? waysWanted : world;
  COHORT_CHECK(world % ways == 0, InvalidArgument, kWho, ": ", world, " processes cannot hold copies of ", ways,
               " ways: start ways x replicas processes");
  replicas = world / ways;
  way = job.rank() % ways;
  replica = job.rank() / ways;
  std::shared_ptr<Communicator> comm = job.communicator();
  if (comm == nullptr) return;
  std::vector<int> mine, copies;
  for (int w = 0; w < ways; ++w) mine.push_back(replica * ways + w);
  for (int q = 0; q < replicas; ++q) copies.push_back(q * ways + way);
  waysComm = replicas == 1 ? comm : comm->split(mine, "tensor-replica-" + std::to_string(replica));
  dataComm = comm->split(copies, "tensor-way-" + std::to_string(way));
}

TensorParallel::~TensorParallel() = default;

nn::Sequential TensorParallel::module() const { return impl_->local; }
int TensorParallel::ways() const { return impl_->ways; }
int TensorParallel::way() const { return impl_->way; }
int TensorParallel::replica() const { return impl_->replica; }
int TensorParallel::replicas() const { return impl_->replicas; }
std::string TensorParallel::plan() const { return impl_->plan; }

Job TensorParallel::dataJob() const {
  return impl_->dataComm ? Job::fromCommunicator(impl_->dataComm) : Job::single();
}

TensorParallelStats TensorParallel::stats() const {
  if (!impl_->waysComm) return {};
  const CommCounters c = impl_->waysComm->counters();
  return {c.bytesSent, c.bytesReceived};
}

}  // namespace cohort
