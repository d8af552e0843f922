#include <cohort/data.h>
#include <cohort/error.h>
#include <cohort/models.h>

#include "models/model_spec.h"

#include <torch/torch.h>

namespace cohort {

InputShape inputShapeOf(const DataSplits& data) {
  if (data.bags()) {
    return {.channels = 1,
            .height = 1,
            .width = 1,
            .classes = data.classes,
            .featureRows = data.featureRows,
            .featureRowsSource = data.featureRowsSource};
  }
  return {data.channels(), data.height(), data.width(), data.classes};
}

namespace {

namespace nn = torch::nn;

// The zoo's own modules are Cloneable, as torch's layers are: mirrored, central and hogwild copy
// the model for each replica thread (nn::Module::clone), and reset() makes each one's layers anew.

// [B, C, H, W] -> [B, H, C*W]: the image's rows as a sequence.
struct RowsAsSequenceImpl : nn::Cloneable<RowsAsSequenceImpl> {
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x.permute({0, 2, 1, 3}).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
  }
};
TORCH_MODULE(RowsAsSequence);

// An LSTM over the sequence whose output is its last time step.
struct LastStepLstmImpl : nn::Cloneable<LastStepLstmImpl> {
  LastStepLstmImpl(int64_t input, int64_t hidden) : input(input), hidden(hidden) { reset(); }
  void reset() override { lstm = register_module("lstm", nn::LSTM(nn::LSTMOptions(input, hidden).batch_first(true))); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = std::get<0>(lstm->forward(x));
    return out.select(1, out.size(1) - 1);
  }
  int64_t input, hidden;
  nn::LSTM lstm{nullptr};
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

// Bags of ids, [B, L] int64 padded with kBagPadding, pooled over an embedding table: the ids
// and each bag's offset go to nn::EmbeddingBag, whose gradient (with sparse) is the touched rows.
struct BagEmbeddingImpl : nn::Cloneable<BagEmbeddingImpl> {
  BagEmbeddingImpl(int64_t rows, int64_t dim, bool mean, bool sparse)
      : options(nn::EmbeddingBagOptions(rows, dim)
                    .mode(mean ? nn::EmbeddingBagMode(torch::kMean) : nn::EmbeddingBagMode(torch::kSum))
                    .sparse(sparse)) {
    reset();
  }
  void reset() override { bag = register_module("bag", nn::EmbeddingBag(options)); }
  torch::Tensor forward(const torch::Tensor& x) {
    COHORT_CHECK(x.scalar_type() == torch::kInt64 && x.dim() == 2, InvalidArgument,
                 "the embed model reads bags of feature ids ([B, L] int64); use --data libsvm:FILE or synthetic-bags");
    const auto mask = x.ne(kBagPadding);
    const auto counts = mask.sum(1);
    return bag->forward(x.masked_select(mask), counts.cumsum(0) - counts);
  }
  nn::EmbeddingBagOptions options;
  nn::EmbeddingBag bag{nullptr};
};
TORCH_MODULE(BagEmbedding);

nn::Sequential makeEmbed(const std::string& spec, const InputShape& s) {
  int64_t rows = 1000000, dim = 32, hidden = 64;
  bool mean = false, sparse = true;
  const std::string usage = "--model embed[:rows=N,dim=D,pool=sum|mean,hidden=H,sparse=1|0]";
  std::string rest = spec.size() > 6 ? spec.substr(6) : "";
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string item = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    const size_t eq = item.find('=');
    COHORT_CHECK(eq != std::string::npos, InvalidArgument, usage, ": '", item, "' is not KEY=VALUE");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "pool") {
      COHORT_CHECK(value == "sum" || value == "mean", InvalidArgument, usage, ": pool is sum or mean, got ", value);
      mean = value == "mean";
      continue;
    }
    int64_t n = 0;
    try {
      size_t used = 0;
      n = std::stoll(value, &used);
      COHORT_CHECK(used == value.size(), InvalidArgument, "");
    } catch (const std::exception&) {
      throw InvalidArgument(usage + ": " + key + " needs a whole number, got '" + value + "'");
    }
    if (key == "rows") rows = n;
    else if (key == "dim") dim = n;
    else if (key == "hidden") hidden = n;
    else if (key == "sparse") sparse = n != 0;
    else throw InvalidArgument(usage + ": unknown key '" + key + "'");
    COHORT_CHECK(n > 0 || key == "sparse", InvalidArgument, usage, ": ", key, " must be positive, got ", n);
  }
  COHORT_CHECK(s.featureRows > 0, InvalidArgument,
               "--model embed reads bags of feature ids: use --data libsvm:FILE or --data synthetic-bags");
  COHORT_CHECK(s.featureRows <= rows, InvalidArgument, s.featureRowsSource, ": feature id ", s.featureRows - 1,
               " is beyond the model's table of ", rows, " rows: use --model embed:rows=", s.featureRows,
               " (or more)");
  return nn::Sequential(BagEmbedding(rows, dim, mean, sparse), nn::Linear(dim, hidden), nn::ReLU(),
                        nn::Linear(hidden, s.classes));
}

}  // namespace

torch::nn::Sequential makeModel(const std::string& spec, const InputShape& shape) {
  if (spec == "embed" || spec.rfind("embed:", 0) == 0) return makeEmbed(spec, shape);
  COHORT_CHECK(shape.featureRows == 0 || isModelFileSpec(spec), InvalidArgument, "--model ", spec,
               " reads images, but the data are bags of feature ids: use --model embed");
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
  if (isModelFileSpec(spec)) return loadScriptedModel(spec);
  throw InvalidArgument("unknown model '" + spec + "': expected mlp, mlp:WIDTH, cnn, lstm, embed or a TorchScript file FILE.pt");
}

int64_t parameterCount(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> rowsRead(torch::nn::Sequential& model, const torch::Tensor& inputs) {
  if (model->size() == 0) return {};
  const auto* embed = model[0]->as<BagEmbeddingImpl>();
  if (embed == nullptr || !embed->bag->options.sparse()) return {};
  const auto ids = inputs.masked_select(inputs.ne(kBagPadding));
  return {{embed->bag->weight, std::get<0>(torch::_unique(ids, /*sorted=*/true))}};
}

}  // namespace cohort
