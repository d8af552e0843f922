// The vertical split (include/cohort/tensor_parallel.h). Megatron-LM's two collectives, as
// autograd functions over the ways' communicator: GradientSum (identity forward, allreduce of the
// input gradient backward) before a column-split layer, PartialSum (allreduce forward, identity
// backward) after a row-split one.
#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/tensor_parallel.h>
#include "schemes/model_sync.h"

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

struct GradientSum : torch::autograd::Function<GradientSum> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0].contiguous().clone();
    commOf(ctx)->allreduce(g);
    return {g, torch::Tensor()};
  }
};

struct PartialSum : torch::autograd::Function<PartialSum> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    auto y = x.contiguous().clone();
    reinterpret_cast<Communicator*>(comm)->allreduce(y);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return {grads[0], torch::Tensor()}; }
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
  PartialSumLayerImpl(std::shared_ptr<Communicator> c, const torch::Tensor& b, int64_t d) : comm(std::move(c)), dims(d) {
    if (b.defined()) bias = register_parameter("bias", b.detach().clone());
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

bool passesThrough(const std::shared_ptr<nn::Module>& m) {
  return m->as<nn::ReLUImpl>() || m->as<nn::MaxPool2dImpl>() || m->as<nn::AvgPool2dImpl>() || m->as<nn::DropoutImpl>() ||
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

}  // namespace

struct TensorParallel::Impl {
  std::shared_ptr<Communicator> waysComm;
  std::shared_ptr<Communicator> dataComm;
  int ways = 1, way = 0, replicas = 1, replica = 0;
  nn::Sequential local;
  std::string plan;
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
  const torch::Tensor onModelDevice = device ? sample.to(*device) : sample;
  const int world = job.worldSize();
  s.ways = options.ways > 0 ? options.ways : world;
  COHORT_CHECK(world % s.ways == 0, InvalidArgument, kWho, ": ", world, " processes cannot hold copies of ", s.ways,
               " ways: start ways x replicas processes");
  s.replicas = world / s.ways;
  s.way = job.rank() % s.ways;
  s.replica = job.rank() / s.ways;
  std::shared_ptr<Communicator> comm = job.communicator();
  if (comm != nullptr) {
    std::vector<int> mine, copies;
    for (int w = 0; w < s.ways; ++w) mine.push_back(s.replica * s.ways + w);
    for (int q = 0; q < s.replicas; ++q) copies.push_back(q * s.ways + s.way);
    s.waysComm = s.replicas == 1 ? comm : comm->split(mine, "tensor-replica-" + std::to_string(s.replica));
    s.dataComm = comm->split(copies, "tensor-way-" + std::to_string(s.way));
  }

  if (s.ways == 1) {
    s.local = model;
    s.plan = "whole (one way)";
    return;
  }

  std::vector<nn::AnyModule> layers(model->begin(), model->end());
  const auto names = model->named_children().keys();
  // The layers' output shapes, from a dry run on two examples (Flatten needs its input's).
  std::vector<std::vector<int64_t>> shapes;
  {
    torch::NoGradGuard noGrad;
    auto x = onModelDevice.narrow(0, 0, std::min<int64_t>(2, sample.size(0)));
    for (auto& layer : layers) {
      x = layer.forward(x);
      shapes.push_back(x.sizes().vec());
    }
  }
  // Whether layer i's split output can be consumed: through element-wise layers, pooling and a
  // Flatten, by a Linear (after a Linear or a Flatten) or a Conv2d (after a Conv2d).
  auto feedsSplittable = [&](size_t i) {
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
  };

  struct SplitActivation {
    bool on = false;
    int64_t units = 0, offset = 0, size = 0;
    int64_t perUnit = 1;  // features per unit after a Flatten of split channels
  } split;
  std::ostringstream plan;
  nn::Sequential local;
  // (An rvalue name picks Sequential's public push_back overload.)
  auto add = [&](const std::string& layerName, nn::AnyModule layer) {
    local->push_back(std::string(layerName), std::move(layer));
  };
  torch::NoGradGuard noGrad;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto m = layers[i].ptr();
    const std::string& name = names[i];
    auto* linear = m->as<nn::LinearImpl>();
    auto* conv = plainConv(m);
    if (i > 0) plan << "; ";
    plan << i << " " << kindOf(*m) << " ";
    if (!split.on) {
      if ((linear || conv) && feedsSplittable(i)) {
        const int64_t units = linear ? linear->options.out_features() : conv->options.out_channels();
        COHORT_CHECK(units >= s.ways, InvalidArgument, kWho, ": ", describeLayer(i, name, m), " has ", units,
                     linear ? " output units" : " output channels", ", fewer than the ", s.ways,
                     " ways to split them over: use fewer ways (--ways)");
        auto [offset, size] = share(units, s.ways, s.way);
        add(name + "_input", nn::AnyModule(GradientSumLayer(s.waysComm)));
        if (linear) {
          auto part = nn::Linear(nn::LinearOptions(linear->options.in_features(), size).bias(linear->options.bias()));
          part->weight.copy_(linear->weight.narrow(0, offset, size));
          if (linear->options.bias()) part->bias.copy_(linear->bias.narrow(0, offset, size));
          add(name, nn::AnyModule(part));
        } else {
          auto part = nn::Conv2d(convOptions(*conv, conv->options.in_channels(), size));
          part->weight.copy_(conv->weight.narrow(0, offset, size));
          if (conv->options.bias()) part->bias.copy_(conv->bias.narrow(0, offset, size));
          add(name, nn::AnyModule(part));
        }
        split = {true, units, offset, size, 1};
        plan << (linear ? "columns " : "output channels ") << size << "/" << units;
      } else {
        add(name, layers[i]);
        plan << "whole";
      }
      continue;
    }
    if (passesThrough(m)) {
      add(name, layers[i]);
      plan << "split";
    } else if (isFlatten(m)) {
      const auto& in = shapes[i - 1];
      int64_t perChannel = 1;
      for (size_t d = 2; d < in.size(); ++d) perChannel *= in[d];
      split.perUnit *= perChannel;
      add(name, layers[i]);
      plan << "split";
    } else if (linear) {
      const int64_t width = split.units * split.perUnit;
      COHORT_CHECK_EQ(linear->options.in_features(), width, InvalidArgument, kWho, ": ", describeLayer(i, name, m),
                      " expects another input width than the split layers before it give");
      auto part = nn::Linear(nn::LinearOptions(split.size * split.perUnit, linear->options.out_features()).bias(false));
      part->weight.copy_(linear->weight.narrow(1, split.offset * split.perUnit, split.size * split.perUnit));
      add(name, nn::AnyModule(part));
      add(name + "_sum",
          nn::AnyModule(PartialSumLayer(s.waysComm, linear->options.bias() ? linear->bias : torch::Tensor(), 2)));
      split.on = false;
      plan << "rows " << split.size * split.perUnit << "/" << width << " + allreduce";
    } else if (conv) {
      COHORT_CHECK(split.perUnit == 1 && conv->options.in_channels() == split.units, InvalidArgument, kWho, ": ",
                   describeLayer(i, name, m), " does not take the split channels of the layers before it");
      auto part = nn::Conv2d(convOptions(*conv, split.size, conv->options.out_channels()).bias(false));
      part->weight.copy_(conv->weight.narrow(1, split.offset, split.size));
      add(name, nn::AnyModule(part));
      add(name + "_sum",
          nn::AnyModule(PartialSumLayer(s.waysComm, conv->options.bias() ? conv->bias : torch::Tensor(), 4)));
      split.on = false;
      plan << "input channels " << split.size << "/" << split.units << " + allreduce";
    } else {
      throw InvalidArgument(kWho + std::string(": ") + describeLayer(i, name, m) +
                            " would receive a split activation and cannot be split (only Linear, Conv2d, element-wise "
                            "layers, pooling and Flatten can)");
    }
  }
  if (device && !device->is_cpu()) local->to(*device);
  s.local = local;
  s.plan = plan.str();
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
