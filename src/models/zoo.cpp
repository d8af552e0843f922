#include <cohort/error.h>
#include <cohort/models.h>

#include <torch/torch.h>

namespace cohort {

namespace {

namespace nn = torch::nn;

// [B, C, H, W] -> [B, H, C*W]: the image's rows as a sequence.
struct RowsAsSequenceImpl : nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    return x.permute({0, 2, 1, 3}).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
  }
};
TORCH_MODULE(RowsAsSequence);

// An LSTM over the sequence whose output is its last time step.
struct LastStepLstmImpl : nn::Module {
  LastStepLstmImpl(int64_t input, int64_t hidden)
      : lstm(register_module("lstm", nn::LSTM(nn::LSTMOptions(input, hidden).batch_first(true)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = std::get<0>(lstm->forward(x));
    return out.select(1, out.size(1) - 1);
  }
  nn::LSTM lstm;
};
TORCH_MODULE(LastStepLstm);

nn::Sequential makeMlp(const InputShape& s, int64_t hidden = 512) {
  const int64_t in = s.channels * s.height * s.width;
  return nn::Sequential(nn::Flatten(), nn::Linear(in, hidden), nn::ReLU(), nn::Linear(hidden, hidden),
                        nn::ReLU(), nn::Linear(hidden, s.classes));
}

// The network of the seeds' Keras example: the convolutions have no activation of their own.
nn::Sequential makeCnn(const InputShape& s) {
  auto after = [](int64_t size) { return (size - 4) / 2; };  // 5x5 valid conv, then 2x2 pool
  const int64_t h = after(after(s.height));
  const int64_t w = after(after(s.width));
  COHORT_CHECK(h >= 1 && w >= 1, InvalidArgument, "the cnn needs images of at least 16x16, got ",
               s.height, "x", s.width);
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(s.channels, 32, 5)),
                        nn::MaxPool2d(nn::MaxPool2dOptions(2)),
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 5)),
                        nn::MaxPool2d(nn::MaxPool2dOptions(2)), nn::Flatten(),
                        nn::Linear(64 * h * w, 1024), nn::ReLU(), nn::Linear(1024, s.classes));
}

nn::Sequential makeLstm(const InputShape& s) {
  constexpr int64_t kHidden = 128;
  return nn::Sequential(RowsAsSequence(), LastStepLstm(s.channels * s.width, kHidden),
                        nn::Linear(kHidden, s.classes));
}

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

torch::nn::Sequential makeModel(const std::string& spec, const InputShape& shape) {
  if (spec == "mlp") return makeMlp(shape);
  if (spec.rfind("mlp:", 0) == 0) {  // the mlp with another hidden width, e.g. mlp:4096
    int64_t hidden = 0;
    try {
      size_t used = 0;
      hidden = std::stoll(spec.substr(4), &used);
      if (used != spec.size() - 4) hidden = 0;
    } catch (const std::exception&) {
      hidden = 0;
    }
    COHORT_CHECK(hidden > 0, InvalidArgument, "model '", spec, "': expected mlp:WIDTH with a positive hidden width");
    return makeMlp(shape, hidden);
  }
  if (spec == "cnn") return makeCnn(shape);
  if (spec == "lstm") return makeLstm(shape);
  if (endsWith(spec, ".pt") || spec.find('/') != std::string::npos) return loadScriptedModel(spec);
  throw InvalidArgument("unknown model '" + spec + "': expected mlp, mlp:WIDTH, cnn, lstm or a TorchScript file FILE.pt");
}

int64_t parameterCount(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

}  // namespace cohort
