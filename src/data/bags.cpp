// Bag-of-ids data sets: the libsvm / Vowpal-style reader and the seeded synthetic generator.
#include "data/bags.h"

#include <cohort/error.h>

#include <torch/torch.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

namespace cohort {

namespace {

// The most classes a file's labels may make (labels 0..kMaxClasses-1). The model's last layer has
// hidden x classes weights and the evaluation counts a classes x classes confusion matrix of int64
// (128 MiB at this count); libsvm's multi-class sets have at most 1000 classes (aloi). A label of
// 10^7 would make the layer alone 2.5 GB.
constexpr int64_t kMaxClasses = 4096;
// The most rows a file's feature ids may ask of the embedding table (ids 0..kMaxFeatureRows-1).
// The table is rows x dim float32 and the optimizer may keep two more of it (Adam): at this count
// and the default 32 dimensions, 1 GiB and 3 GiB, as much as a training process here should hold.
// Hashed feature spaces are usually smaller (Vowpal Wabbit's default is 2^18); a larger one must
// be hashed below this.
constexpr int64_t kMaxFeatureRows = int64_t{1} << 23;

// Examples as read, before they become tensors.
struct Bags {
  std::vector<int64_t> ids;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> labels;
  int64_t maxId = -1;
  std::string maxIdSource;  // FILE:LINE of the largest id
};

Dataset toDataset(const Bags& b, size_t from, size_t to) {
  Dataset d;
  const int64_t first = b.offsets[from];
  const int64_t last = b.offsets[to];
  d.labels = torch::tensor(std::vector<int64_t>(b.labels.begin() + ptrdiff_t(from), b.labels.begin() + ptrdiff_t(to)),
                           torch::kInt64);
  d.bagIds = torch::tensor(std::vector<int64_t>(b.ids.begin() + first, b.ids.begin() + last), torch::kInt64);
  std::vector<int64_t> offsets;
  for (size_t i = from; i <= to; ++i) offsets.push_back(b.offsets[i] - first);
  d.bagOffsets = torch::tensor(offsets, torch::kInt64);
  return d;
}

bool isSpace(char c) { return c == ' ' || c == '\t' || c == '\r'; }

// Reads FILE into `out`, refusing the first malformed line with FILE:LINE.
void readBagFile(const std::string& path, Bags& out) {
  std::error_code error;  // a directory opens, and reads as a read error
  COHORT_CHECK(!std::filesystem::is_directory(path, error), IoError, path, ": is a directory, not a data file");
  std::ifstream in(path);
  COHORT_CHECK(in.good(), IoError, path, ": cannot open the data file");
  std::string line;
  int64_t lineNo = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    const std::string where = path + ":" + std::to_string(lineNo);
    std::vector<std::string_view> tokens;
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && isSpace(line[i])) ++i;
      const size_t start = i;
      while (i < line.size() && !isSpace(line[i])) ++i;
      if (i > start) tokens.emplace_back(line.data() + start, i - start);
    }
    if (tokens.empty() || tokens[0][0] == '#') continue;  // blank lines and comments
    int64_t label = 0;
    {
      const auto t = tokens[0];
      // LIBSVM's binary sets (a9a, rcv1.binary...) write +1 and -1; from_chars takes no '+'.
      const size_t sign = t.size() > 1 && t[0] == '+' ? 1 : 0;
      const auto [end, ec] = std::from_chars(t.data() + sign, t.data() + t.size(), label);
      COHORT_CHECK(ec == std::errc() && end == t.data() + t.size() && label >= -1, IoError, where, ": the label '",
                   std::string(t), "' is not a class (a whole number >= 0, or -1 for class 0)");
      COHORT_CHECK(label < kMaxClasses, IoError, where, ": the label ", label, " is above ", kMaxClasses - 1,
                   ", the largest class this reader takes (", kMaxClasses, " classes at most)");
      if (label == -1) label = 0;
    }
    const size_t before = out.ids.size();
    for (size_t k = 1; k < tokens.size(); ++k) {
      const auto t = tokens[k];
      if (t == "|") continue;  // Vowpal's namespace bar
      const size_t colon = t.find(':');
      const std::string_view idText = t.substr(0, colon);
      int64_t id = 0;
      const auto [end, ec] = std::from_chars(idText.data(), idText.data() + idText.size(), id);
      COHORT_CHECK(ec == std::errc() && end == idText.data() + idText.size() && !idText.empty(), IoError, where,
                   ": the feature '", std::string(t), "' is not ID or ID:VALUE with ID a whole number");
      COHORT_CHECK(id >= 0, IoError, where, ": the feature id ", id, " is negative (ids index the embedding table)");
      COHORT_CHECK(id < kMaxFeatureRows, IoError, where, ": the feature id ", id, " is above ", kMaxFeatureRows - 1,
                   ", the largest id this reader takes (ids index an embedding table of at most ", kMaxFeatureRows,
                   " rows): hash the ids below ", kMaxFeatureRows);
      if (colon != std::string_view::npos) {
        const std::string value(t.substr(colon + 1));
        char* stop = nullptr;
        const double v = std::strtod(value.c_str(), &stop);
        COHORT_CHECK(!value.empty() && stop == value.c_str() + value.size(), IoError, where, ": the feature '",
                     std::string(t), "' has no number after the colon");
        COHORT_CHECK(v == 1.0, IoError, where, ": the feature '", std::string(t),
                     "' has value ", value, "; a bag of ids takes presence only (value 1)");
      }
      out.ids.push_back(id);
      if (id > out.maxId) {
        out.maxId = id;
        out.maxIdSource = where;
      }
    }
    COHORT_CHECK(out.ids.size() > before, IoError, where, ": the bag is empty (a label and no feature ids)");
    out.offsets.push_back(int64_t(out.ids.size()));
    out.labels.push_back(label);
  }
  COHORT_CHECK(!in.bad(), IoError, path, ": read error");
  COHORT_CHECK(!out.labels.empty(), IoError, path, ": holds no examples");
}

int64_t parseCount(const std::string& text, const std::string& spec) {
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  COHORT_CHECK(ec == std::errc() && end == text.data() + text.size() && n > 0, InvalidArgument, "--data ", spec,
               ": '", text, "' is not a positive whole number (synthetic-bags[:N[,ROWS]])");
  return n;
}

// Uniform in [0, 1) from 53 random bits: portable, unlike std::uniform_real_distribution.
double uniform(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

double normal(std::mt19937_64& rng) {
  // Box-Muller; 1 - u keeps the logarithm finite.
  const double u = 1.0 - uniform(rng);
  const double v = uniform(rng);
  return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * M_PI * v);
}

}  // namespace

DataSplits loadBagFiles(const std::string& trainPath, const std::string& testPath) {
  Bags train;
  readBagFile(trainPath, train);
  int64_t maxLabel = 0;
  for (int64_t l : train.labels) maxLabel = std::max(maxLabel, l);
  DataSplits splits;
  splits.name = "libsvm:" + trainPath + (testPath.empty() ? "" : "," + testPath);
  if (testPath.empty()) {
    const size_t n = train.labels.size();
    COHORT_CHECK(n >= 2, IoError, trainPath, ": needs at least 2 examples to hold out a test set (or give ",
                 "libsvm:TRAIN,TEST)");
    const size_t held = std::max<size_t>(1, n / 6);
    splits.train = toDataset(train, 0, n - held);
    splits.test = toDataset(train, n - held, n);
  } else {
    Bags test;
    readBagFile(testPath, test);
    if (test.maxId > train.maxId) {
      train.maxId = test.maxId;
      train.maxIdSource = test.maxIdSource;
    }
    for (int64_t l : test.labels) maxLabel = std::max(maxLabel, l);
    splits.train = toDataset(train, 0, train.offsets.size() - 1);
    splits.test = toDataset(test, 0, test.labels.size());
  }
  splits.classes = std::max<int64_t>(2, maxLabel + 1);
  splits.featureRows = train.maxId + 1;
  splits.featureRowsSource = train.maxIdSource;
  return splits;
}

DataSplits makeSyntheticBags(const SyntheticBagsOptions& o) {
  COHORT_CHECK(o.examples >= 6 && o.rows >= 1 && o.minIds >= 1 && o.maxIds >= o.minIds && o.hiddenRows >= 1,
               InvalidArgument, "synthetic bags need at least 6 examples, 1 row and 1 <= minIds <= maxIds");
  std::mt19937_64 rng(o.seed ^ 0xBA65EEDULL);
  const int64_t hidden = std::min(o.hiddenRows, o.rows);
  std::vector<double> weights(static_cast<size_t>(hidden));
  for (auto& w : weights) w = normal(rng);
  const double logRows = std::log(double(o.rows) + 1.0);
  double attainable = 0;
  auto make = [&](int64_t n, bool isTest) {
    Bags b;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = o.minIds + int64_t(rng() % uint64_t(o.maxIds - o.minIds + 1));
      double score = 0;
      for (int64_t k = 0; k < len; ++k) {
        // P(id) = log((id + 2) / (id + 1)) / log(rows + 1), about 1 / (id + 1): a power law.
        const int64_t id = std::min<int64_t>(o.rows - 1, int64_t(std::exp(uniform(rng) * logRows)) - 1);
        b.ids.push_back(id);
        if (id < hidden) score += weights[size_t(id)];
      }
      b.offsets.push_back(int64_t(b.ids.size()));
      b.labels.push_back(score + o.noise * normal(rng) > 0 ? 1 : 0);
      // The hidden model predicts the sign of score; it is right with probability Phi(|score| / noise).
      if (isTest) attainable += o.noise > 0 ? 0.5 * std::erfc(-std::abs(score) / (o.noise * M_SQRT2)) : 1.0;
    }
    return b;
  };
  const Bags train = make(o.examples, false);
  const int64_t testCount = std::max<int64_t>(o.examples / 6, 1);
  const Bags test = make(testCount, true);
  DataSplits splits;
  splits.name = "synthetic-bags";
  splits.train = toDataset(train, 0, train.labels.size());
  splits.test = toDataset(test, 0, test.labels.size());
  splits.classes = 2;
  splits.featureRows = o.rows;
  splits.featureRowsSource = "synthetic-bags (ROWS " + std::to_string(o.rows) + ")";
  splits.attainableAccuracy = attainable / double(testCount);
  return splits;
}

DataSplits loadBagSpec(const std::string& spec, uint64_t seed) {
  if (spec.rfind("libsvm:", 0) == 0) {
    const std::string files = spec.substr(7);
    COHORT_CHECK(!files.empty(), InvalidArgument, "--data libsvm:TRAIN[,TEST] needs a file");
    const size_t comma = files.find(',');
    return loadBagFiles(files.substr(0, comma), comma == std::string::npos ? "" : files.substr(comma + 1));
  }
  SyntheticBagsOptions o;
  o.seed = seed;
  if (spec.size() > 15) {  // "synthetic-bags:"
    const std::string rest = spec.substr(15);
    const size_t comma = rest.find(',');
    o.examples = parseCount(rest.substr(0, comma), spec);
    if (comma != std::string::npos) o.rows = parseCount(rest.substr(comma + 1), spec);
  }
  return makeSyntheticBags(o);
}

Batch makeBagBatch(const Dataset& data, std::span<const int64_t> indices) {
  const int64_t* offsets = data.bagOffsets.data_ptr<int64_t>();
  const int64_t* ids = data.bagIds.data_ptr<int64_t>();
  const int64_t size = data.size();
  int64_t longest = 0;
  for (int64_t i : indices) {
    // Checked before the offsets are read: an index past the bags would read and copy beyond them.
    COHORT_CHECK(i >= 0 && i < size, InvalidArgument, "makeBatch: index ", i, " is not an example of this data set (",
                 size, " examples)");
    longest = std::max(longest, offsets[i + 1] - offsets[i]);
  }
  Batch batch;
  batch.inputs = torch::full({int64_t(indices.size()), longest}, kBagPadding, torch::kInt64);
  int64_t* out = batch.inputs.data_ptr<int64_t>();
  for (size_t r = 0; r < indices.size(); ++r) {
    const int64_t i = indices[r];
    std::copy(ids + offsets[i], ids + offsets[i + 1], out + int64_t(r) * longest);
  }
  auto index = torch::from_blob(const_cast<int64_t*>(indices.data()), {int64_t(indices.size())}, torch::kInt64);
  batch.targets = data.labels.index_select(0, index);
  return batch;
}

}  // namespace cohort
