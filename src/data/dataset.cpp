#include <cohort/data.h>
#include <cohort/error.h>
#include <cohort/idx.h>
#include "data/bags.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>
#include <filesystem>

namespace cohort {

namespace fs = std::filesystem;

namespace {

// The file for `stem` in dir, gzip'd or not.
std::string findIdx(const std::string& dir, const std::string& stem) {
  for (const char* suffix : {".gz", ""}) {
    fs::path p = fs::path(dir) / (stem + suffix);
    if (fs::exists(p)) return p.string();
  }
  throw IoError(dir + ": no " + stem + "[.gz] in this directory (an IDX data set needs "
                "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
                "t10k-labels-idx1-ubyte, optionally gzip'd)");
}

Dataset loadIdxPair(const std::string& dir, const std::string& prefix) {
  const std::string imagesPath = findIdx(dir, prefix + "-images-idx3-ubyte");
  IdxArray images = readIdxFile(imagesPath);
  const std::string labelsPath = findIdx(dir, prefix + "-labels-idx1-ubyte");
  IdxArray labels = readIdxFile(labelsPath);
  COHORT_CHECK(images.type == IdxType::kUint8 && (images.dims.size() == 3 || images.dims.size() == 4),
               IoError, imagesPath, ": expected uint8 images of shape [N, H, W] or [N, C, H, W]");
  COHORT_CHECK(labels.type == IdxType::kUint8 && labels.dims.size() == 1, IoError, labelsPath,
               ": expected uint8 labels of shape [N]");
  COHORT_CHECK(images.dims[0] == labels.dims[0], IoError, imagesPath, " holds ", images.dims[0],
               " images but ", labelsPath, " holds ", labels.dims[0], " labels");
  COHORT_CHECK(images.dims[0] > 0, IoError, imagesPath, ": holds no images");
  for (size_t d = 1; d < images.dims.size(); ++d) {
    COHORT_CHECK(images.dims[d] > 0, IoError, imagesPath, ": its images have a dimension of size 0 (dimension ", d,
                 " of its header's ", images.dims.size(), ")");
  }
  std::vector<int64_t> shape = images.dims;
  if (shape.size() == 3) shape.insert(shape.begin() + 1, 1);
  Dataset data;
  data.images = torch::from_blob(images.data.data(), shape, torch::kUInt8).clone();
  data.labels = torch::from_blob(labels.data.data(), {labels.dims[0]}, torch::kUInt8)
                    .to(torch::kInt64);
  return data;
}

DataSplits loadIdxDir(const std::string& name, const std::string& dir) {
  COHORT_CHECK(fs::is_directory(dir), IoError, dir, ": no such directory");
  DataSplits splits;
  splits.name = name;
  splits.train = loadIdxPair(dir, "train");
  splits.test = loadIdxPair(dir, "t10k");
  COHORT_CHECK(splits.train.images.sizes().slice(1) == splits.test.images.sizes().slice(1),
               IoError, dir, ": training and test images have different shapes");
  const int64_t maxLabel =
      std::max(splits.train.labels.max().item<int64_t>(), splits.test.labels.max().item<int64_t>());
  splits.classes = maxLabel + 1;
  // The classes are 0..the largest label: a stray large label (a damaged file) would make a model
  // of that many outputs without a word, most of them for classes no example has.
  const torch::Tensor seen = torch::cat({splits.train.labels, splits.test.labels}).bincount({}, splits.classes) > 0;
  const int64_t present = seen.sum().item<int64_t>();
  COHORT_CHECK(present >= 2, IoError, dir, ": every label is ", maxLabel,
               ": a classifier needs examples of at least 2 classes");
  COHORT_CHECK(2 * present > splits.classes, IoError, dir, ": its labels run to ", maxLabel, ", but only ", present,
               " of the ", splits.classes, " classes 0..", maxLabel,
               " have an example: a damaged labels file? (the classes are 0 to the largest label)");
  return splits;
}

// Images with a learnable label: each class has a random template; an image is its class's
// template plus noise.
Dataset makeSynthetic(int64_t n, const torch::Tensor& templates, torch::Generator& gen) {
  const int64_t classes = templates.size(0);
  Dataset data;
  data.labels = torch::randint(classes, {n}, gen, torch::kInt64);
  auto noise = torch::randn({n, 1, 28, 28}, gen) * 48.0;
  auto images = templates.index_select(0, data.labels) + noise;
  data.images = images.clamp(0, 255).to(torch::kUInt8);
  return data;
}

}  // namespace

DataSplits loadData(const std::string& spec, uint64_t seed) {
  if (spec == "fashion-mnist") {
    const char* env = std::getenv("COHORT_FASHION_MNIST_DIR");
    const std::string dir = (env != nullptr && *env != '\0') ? env : kFashionMnistDir;
    COHORT_CHECK(fs::is_directory(dir), IoError, "Fashion-MNIST is not installed (", dir,
                 " is missing): install Debian's package dataset-fashion-mnist "
                 "(apt-get install dataset-fashion-mnist), or pass --data mnist:DIR or --data synthetic");
    return loadIdxDir("fashion-mnist", dir);
  }
  if (spec.rfind("mnist:", 0) == 0) {
    const std::string dir = spec.substr(6);
    COHORT_CHECK(!dir.empty(), InvalidArgument, "--data mnist:DIR needs a directory");
    return loadIdxDir("mnist:" + dir, dir);
  }
  if (spec == "synthetic" || spec.rfind("synthetic:", 0) == 0) {
    int64_t n = 60000;
    if (spec.size() > 10) {
      try {
        size_t used = 0;
        n = std::stoll(spec.substr(10), &used);
        COHORT_CHECK(used == spec.size() - 10, InvalidArgument, "");
      } catch (const std::exception&) {
        throw InvalidArgument("--data " + spec + ": expected synthetic:N with N a whole number");
      }
      COHORT_CHECK(n >= 6, InvalidArgument, "--data ", spec, ": need at least 6 examples");
    }
    auto gen = at::detail::createCPUGenerator(seed ^ 0x5EEDDA7AULL);
    auto templates = torch::rand({10, 1, 28, 28}, gen) * 255.0;
    DataSplits splits;
    splits.name = "synthetic";
    splits.train = makeSynthetic(n, templates, gen);
    splits.test = makeSynthetic(std::max<int64_t>(n / 6, 1), templates, gen);
    splits.classes = 10;
    return splits;
  }
  if (spec.rfind("libsvm:", 0) == 0 || spec == "synthetic-bags" || spec.rfind("synthetic-bags:", 0) == 0) {
    return loadBagSpec(spec, seed);
  }
  throw InvalidArgument("unknown data set '" + spec +
                        "': expected fashion-mnist, mnist:DIR, synthetic[:N], libsvm:TRAIN[,TEST] or "
                        "synthetic-bags[:N[,ROWS]]");
}

void holdOutValidation(DataSplits& data, int64_t n, uint64_t seed) {
  const int64_t size = data.train.size();
  COHORT_CHECK(n >= 0 && n < size, InvalidArgument, "--validation ", n, " must be between 0 and the ", size,
               " training examples (exclusive)");
  if (n == 0) return;
  COHORT_CHECK(!data.bags(), InvalidArgument, "--validation does not apply to bag-of-ids data (", data.name,
               ") yet: hold the examples out in the file instead");
  // A hand-written Fisher-Yates over std::mt19937_64 (portable, unlike std::shuffle): the split
  // must be the same for every trial of a sweep and every process of a job.
  std::vector<int64_t> order(static_cast<size_t>(size));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed * 0xD1B54A32D192ED03ULL + 0x7A11DA7EULL);
  for (int64_t i = size - 1; i > 0; --i) {
    const auto j = int64_t(rng() % uint64_t(i + 1));
    std::swap(order[size_t(i)], order[size_t(j)]);
  }
  std::vector<int64_t> held(order.begin(), order.begin() + n);
  std::vector<int64_t> kept(order.begin() + n, order.end());
  std::sort(held.begin(), held.end());
  std::sort(kept.begin(), kept.end());
  auto select = [&](std::vector<int64_t>& idx) {
    auto index = torch::from_blob(idx.data(), {int64_t(idx.size())}, torch::kInt64);
    return Dataset{.images = data.train.images.index_select(0, index), .labels = data.train.labels.index_select(0, index)};
  };
  data.validation = select(held);
  data.train = select(kept);
}

Batch makeBatch(const Dataset& data, std::span<const int64_t> indices) {
  if (data.bags()) return makeBagBatch(data, indices);
  // index_select would throw torch's "index out of range in self", naming neither the index nor
  // the set: one pass over the indices names both, as the bag path does.
  const int64_t size = data.size();
  for (const int64_t i : indices) {
    COHORT_CHECK(i >= 0 && i < size, InvalidArgument, "makeBatch: index ", i, " is not an example of this data set (",
                 size, " examples)");
  }
  auto index = torch::from_blob(const_cast<int64_t*>(indices.data()),
                                {int64_t(indices.size())}, torch::kInt64);
  Batch batch;
  batch.inputs = data.images.index_select(0, index).to(torch::kFloat32).div_(255.0f);
  batch.targets = data.labels.index_select(0, index);
  return batch;
}

}  // namespace cohort
