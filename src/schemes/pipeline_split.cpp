// A stage's layers and the split layers' parts (schemes/pipeline_split.h).
#include "schemes/pipeline_split.h"

#include "models/cpu_generator.h"

#include <torch/torch.h>

namespace cohort {

namespace {

// The first `count` output channels from `from` of `layer`'s weight and bias, copied into `part`'s,
// which require their gradient as `layer`'s do (a frozen layer's part stays frozen).
template <typename LayerImpl, typename Layer>
void copyRows(const LayerImpl& layer, Layer& part, int64_t from, int64_t count) {
  torch::NoGradGuard noGrad;
  part->weight.copy_(layer.weight.narrow(0, from, count));
  part->weight.requires_grad_(layer.weight.requires_grad());
  if (part->bias.defined()) {
    part->bias.copy_(layer.bias.narrow(0, from, count));
    part->bias.requires_grad_(layer.bias.requires_grad());
  }
}

// Output channels [from, from + count) of a splittable layer: a new Conv2d or Linear of `count`
// channels with copies of those rows of the weight and bias. Constructing it draws nothing from
// the generator (its state is put back), so every stage's generator stays as in one process.
torch::nn::AnyModule channelSlice(const torch::nn::Module& layer, int64_t from, int64_t count) {
  const torch::Tensor rng = cpuGeneratorState();
  torch::nn::AnyModule out;
  if (const auto* conv = dynamic_cast<const torch::nn::Conv2dImpl*>(&layer)) {
    const auto& o = conv->options;
    torch::nn::Conv2d part(torch::nn::Conv2dOptions(o.in_channels(), count, o.kernel_size())
                               .stride(o.stride())
                               .padding(o.padding())
                               .dilation(o.dilation())
                               .groups(o.groups())
                               .bias(o.bias())
                               .padding_mode(o.padding_mode()));
    copyRows(*conv, part, from, count);
    out = torch::nn::AnyModule(part);
  } else {
    const auto& linear = dynamic_cast<const torch::nn::LinearImpl&>(layer);
    auto options = linear.options;
    torch::nn::Linear part(options.out_features(count));
    copyRows(linear, part, from, count);
    out = torch::nn::AnyModule(part);
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
// block, so this holds on the wire as well. Stage s+1's SplitTail unpacks, computes the other
// channels from the input and outputs the layer's whole output. The gradient of the packed tensor
// goes back the same way: the input's part (from the second part's channels) joins, through the
// packing, the first part's gradient on stage s. Each part registers its slice of the weight and
// bias under the layer's names ("weight", "bias"), so a stage's checkpoint holds its rows of them.
class SplitPart : public torch::nn::Module {
 protected:
  explicit SplitPart(torch::nn::AnyModule part) : part_(std::move(part)) {
    for (const auto& p : part_.ptr()->named_parameters(/*recurse=*/false))
      register_parameter(p.key(), p.value(), p.value().requires_grad());
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

int64_t splittableChannels(const torch::nn::Module& layer, const torch::Tensor& output) {
  if (const auto* conv = dynamic_cast<const torch::nn::Conv2dImpl*>(&layer)) {
    return conv->options.groups() == 1 && output.dim() == 4 ? conv->options.out_channels() : 0;
  }
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&layer)) {
    return output.dim() == 2 ? linear->options.out_features() : 0;
  }
  return 0;
}

torch::nn::Sequential stageLayers(const torch::nn::Sequential& model, const LayerProfile& profile,
                                  const std::vector<int>& counts, const std::vector<int>& splits, int stage) {
  int firstLayer = 0;
  for (int s = 0; s < stage; ++s) firstLayer += counts[size_t(s)];
  const int count = counts[size_t(stage)];
  auto local = sliceModel(model, firstLayer, count);
  const int tail = stage > 0 ? splits[size_t(stage) - 1] : 0;  // channels of our first layer computed before
  const int head = splits[size_t(stage)];                      // channels of the next layer computed here
  if (tail == 0 && head == 0) return local;
  const auto named = model->named_children();
  torch::nn::Sequential out;
  for (int k = 0; k < count; ++k) {
    const int j = firstLayer + k;
    if (k == 0 && tail > 0) {
      auto part = channelSlice(*named[size_t(j)].value(), tail, profile.channels[size_t(j)] - tail);
      out->push_back(named[size_t(j)].key(),
                     std::make_shared<SplitTailImpl>(std::move(part), profile.inputOf(j), profile.headOf(j, tail)));
    } else {
      out->push_back(named[size_t(j)].key(), *(local->begin() + k));
    }
  }
  if (head > 0) {
    const int j = firstLayer + count;
    out->push_back(named[size_t(j)].key(),
                   std::make_shared<SplitHeadImpl>(channelSlice(*named[size_t(j)].value(), 0, head)));
  }
  return out;
}

}  // namespace cohort
