#include <cohort/data.h>
#include <cohort/error.h>
#include <cohort/idx.h>

#include <zlib.h>

#include "hostile.h"
#include "test_util.h"

namespace cohort::idx_test {
namespace {

std::vector<uint8_t> idxBytes(uint8_t type, std::vector<uint32_t> dims, size_t bodyBytes) {
  std::vector<uint8_t> out{0, 0, type, uint8_t(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(uint8_t(d >> shift));
  }
  for (size_t i = 0; i < bodyBytes; ++i) out.push_back(uint8_t(i * 7));
  return out;
}

void writeGzip(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), unsigned(bytes.size())), int(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

TEST(Idx, ParsesHeaderAndBody) {
  auto bytes = idxBytes(0x08, {3, 2, 2}, 12);
  IdxArray a = parseIdx(bytes, "x");
  EXPECT_EQ(a.type, IdxType::kUint8);
  EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(a.elements(), 12);
  ASSERT_EQ(a.data.size(), 12u);
  EXPECT_EQ(a.data[5], uint8_t(35));
}

TEST(Idx, ElementSizeFollowsType) {
  auto bytes = idxBytes(0x0D, {2, 3}, 24);
  EXPECT_EQ(parseIdx(bytes, "floats").data.size(), 24u);
}

TEST(Idx, RejectsWrongMagic) {
  auto bytes = idxBytes(0x08, {4}, 4);
  bytes[0] = 1;
  EXPECT_NE(errorOf([&] { parseIdx(bytes, "bad.idx"); }).find("bad.idx: not an IDX file: wrong magic"),
            std::string::npos);
  bytes[0] = 0;
  bytes[2] = 0x42;  // unknown type code
  EXPECT_NE(errorOf([&] { parseIdx(bytes, "bad.idx"); }).find("wrong magic"), std::string::npos);
}

TEST(Idx, RejectsTruncatedBodyAndHeader) {
  auto bytes = idxBytes(0x08, {10, 4}, 39);
  EXPECT_NE(errorOf([&] { parseIdx(bytes, "t.idx"); })
                .find("t.idx: truncated IDX file: the header promises 40 bytes of data, the file has 39"),
            std::string::npos);
  auto header = idxBytes(0x08, {10, 4}, 0);
  header.resize(9);
  EXPECT_NE(errorOf([&] { parseIdx(header, "h.idx"); }).find("truncated IDX header"), std::string::npos);
  EXPECT_NE(errorOf([&] { parseIdx(std::vector<uint8_t>{0, 0}, "s.idx"); }).find("shorter than"),
            std::string::npos);
}

TEST(Idx, RejectsTrailingBytes) {
  auto bytes = idxBytes(0x08, {4}, 6);
  EXPECT_NE(errorOf([&] { parseIdx(bytes, "long.idx"); }).find("2 bytes after the data"),
            std::string::npos);
}

TEST(Idx, ReadsGzipAndPlainFilesAlike) {
  test::TempDir dir;
  auto bytes = idxBytes(0x08, {2, 3}, 6);
  writeGzip(dir.file("a.gz"), bytes);
  test::writeFile(dir.file("a"), std::string(bytes.begin(), bytes.end()));
  IdxArray gz = readIdxFile(dir.file("a.gz"));
  IdxArray plain = readIdxFile(dir.file("a"));
  EXPECT_EQ(gz.dims, plain.dims);
  EXPECT_EQ(gz.data, plain.data);
}

TEST(Idx, RejectsTruncatedGzipStream) {
  test::TempDir dir;
  auto bytes = idxBytes(0x08, {1000}, 1000);
  writeGzip(dir.file("full.gz"), bytes);
  std::string packed = test::readFile(dir.file("full.gz"));
  test::writeFile(dir.file("cut.gz"), packed.substr(0, packed.size() / 2));
  const std::string message = errorOf([&] { readIdxFile(dir.file("cut.gz")); });
  EXPECT_NE(message.find(dir.file("cut.gz")), std::string::npos) << message;
}

// A gzip bomb: a header promising 10 images of 28x28 (7840 bytes), then 128 MiB of zeros, which
// pack into about 130 KB. The reader stops 1 MiB past the promise instead of unpacking it all.
TEST(Idx, StopsReadingAGzipBombPastWhatItsHeaderPromises) {
  test::TempDir dir;
  const std::string path = dir.file("train-images-idx3-ubyte.gz");
  {
    gzFile f = gzopen(path.c_str(), "wb1");
    ASSERT_NE(f, nullptr);
    const auto header = idxBytes(0x08, {10, 28, 28}, 0);
    ASSERT_EQ(gzwrite(f, header.data(), unsigned(header.size())), int(header.size()));
    const std::vector<uint8_t> zeros(size_t{1} << 20, 0);
    for (int i = 0; i < 128; ++i) ASSERT_EQ(gzwrite(f, zeros.data(), unsigned(zeros.size())), int(zeros.size()));
    ASSERT_EQ(gzclose(f), Z_OK);
  }
  ASSERT_TRUE(test::resetPeakMemory());
  const int64_t before = test::statusBytes("VmRSS");
  const std::string message = errorOf([&] { readIdxFile(path); });
  const int64_t peak = test::statusBytes("VmHWM");
  EXPECT_NE(message.find(path + ": the file goes on past the 7840 bytes of data its IDX header promises"),
            std::string::npos)
      << message;
  EXPECT_LT(peak - before, int64_t{32} << 20) << "the reader unpacked the bomb";
}

// Dimensions that promise 8 GiB are refused from the header alone.
TEST(Idx, RefusesAHeaderPromisingMoreThanTheLimit) {
  test::TempDir dir;
  const std::string path = dir.file("big-idx3-ubyte");
  const auto header = idxBytes(0x08, {131072, 256, 256}, 0);
  test::writeFile(path, std::string(header.begin(), header.end()));
  const std::string message = errorOf([&] { readIdxFile(path); });
  EXPECT_NE(message.find(path + ": the IDX header's dimensions promise more than 4294967296 bytes"), std::string::npos)
      << message;
}

TEST(Idx, MissingFileNamesThePath) {
  EXPECT_NE(errorOf([] { readIdxFile("/nonexistent/x-idx1-ubyte"); }).find("/nonexistent/x-idx1-ubyte"),
            std::string::npos);
}

TEST(Idx, LoadsFashionMnist) {
  DataSplits data = loadData("fashion-mnist", 1);
  EXPECT_EQ(data.train.images.sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(data.test.images.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(data.classes, 10);
  EXPECT_EQ(data.train.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(data.train.labels.max().item<int64_t>(), 9);
  // Fashion-MNIST's training set is balanced: 6000 of each class.
  EXPECT_EQ(data.train.labels.eq(3).sum().item<int64_t>(), 6000);
}

TEST(Idx, MnistDirNeedsAllFourFiles) {
  test::TempDir dir;
  writeGzip(dir.file("train-images-idx3-ubyte.gz"), idxBytes(0x08, {2, 28, 28}, 2 * 784));
  EXPECT_NE(errorOf([&] { loadData("mnist:" + dir.path(), 1); }).find("no train-labels-idx1-ubyte"),
            std::string::npos);
}

TEST(Idx, MnistDirChecksImageAndLabelCounts) {
  test::TempDir dir;
  writeGzip(dir.file("train-images-idx3-ubyte.gz"), idxBytes(0x08, {3, 28, 28}, 3 * 784));
  writeGzip(dir.file("train-labels-idx1-ubyte.gz"), idxBytes(0x08, {2}, 2));
  writeGzip(dir.file("t10k-images-idx3-ubyte.gz"), idxBytes(0x08, {2, 28, 28}, 2 * 784));
  writeGzip(dir.file("t10k-labels-idx1-ubyte.gz"), idxBytes(0x08, {2}, 2));
  EXPECT_NE(errorOf([&] { loadData("mnist:" + dir.path(), 1); }).find("holds 3 images but"),
            std::string::npos);
}

// An IDX data set of four files: images of `dims` ([N, H, W]) and `labels`, the same for train and
// test.
void writeIdxDir(const std::string& dir, std::vector<uint32_t> dims, const std::vector<uint8_t>& labels) {
  size_t pixels = 1;
  for (uint32_t d : dims) pixels *= d;
  std::vector<uint8_t> labelBytes = idxBytes(0x08, {uint32_t(labels.size())}, 0);
  labelBytes.insert(labelBytes.end(), labels.begin(), labels.end());
  for (const char* split : {"train", "t10k"}) {
    writeGzip(dir + "/" + split + "-images-idx3-ubyte.gz", idxBytes(0x08, dims, pixels));
    writeGzip(dir + "/" + split + "-labels-idx1-ubyte.gz", labelBytes);
  }
}

// Images of width 0 loaded, and the mlp failed in torch ("from is out of bounds for float").
TEST(Idx, MnistDirRefusesImagesOfSizeZero) {
  test::TempDir dir;
  writeIdxDir(dir.path(), {3, 28, 0}, {0, 1, 2});
  EXPECT_NE(errorOf([&] {
              loadData("mnist:" + dir.path(), 1);
            }).find("train-images-idx3-ubyte.gz: its images have a dimension of size 0 (dimension 2"),
            std::string::npos)
      << errorOf([&] { loadData("mnist:" + dir.path(), 1); });
}

// The classes are 0..the largest label: one stray 200 among labels 0..9 made a model of 201
// outputs without a word; a single class trained "to accuracy 1.0".
TEST(Idx, MnistDirRefusesLabelsThatAreMostlyMissingClasses) {
  test::TempDir dir;
  std::vector<uint8_t> labels;
  for (int i = 0; i < 30; ++i) labels.push_back(uint8_t(i % 10));
  labels[7] = 200;
  writeIdxDir(dir.path(), {30, 4, 4}, labels);
  EXPECT_NE(errorOf([&] {
              loadData("mnist:" + dir.path(), 1);
            }).find("its labels run to 200, but only 11 of the 201 classes 0..200 have an example"),
            std::string::npos)
      << errorOf([&] { loadData("mnist:" + dir.path(), 1); });
  test::TempDir one;
  writeIdxDir(one.path(), {4, 4, 4}, {3, 3, 3, 3});
  EXPECT_NE(errorOf([&] { loadData("mnist:" + one.path(), 1); }).find("every label is 3"), std::string::npos);
  // Classes 0..9 with one of them absent load, as ten classes.
  test::TempDir gap;
  for (auto& l : labels) l = l == 200 ? 1 : l == 5 ? 4 : l;
  writeIdxDir(gap.path(), {30, 4, 4}, labels);
  EXPECT_EQ(loadData("mnist:" + gap.path(), 1).classes, 10);
}

TEST(Data, SyntheticIsDeterministicAndShaped) {
  DataSplits a = loadData("synthetic:600", 5);
  DataSplits b = loadData("synthetic:600", 5);
  EXPECT_EQ(a.train.size(), 600);
  EXPECT_EQ(a.test.size(), 100);
  EXPECT_TRUE(torch::equal(a.train.images, b.train.images));
  EXPECT_TRUE(torch::equal(a.train.labels, b.train.labels));
  EXPECT_THROW(loadData("synthetic:abc", 1), InvalidArgument);
  EXPECT_THROW(loadData("imagenet", 1), InvalidArgument);
}

TEST(Data, MakeBatchScalesToUnitRange) {
  DataSplits d = loadData("synthetic:60", 1);
  std::vector<int64_t> idx{3, 1, 4};
  Batch b = makeBatch(d.train, idx);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(b.inputs.scalar_type(), torch::kFloat32);
  EXPECT_LE(b.inputs.max().item<float>(), 1.0f);
  EXPECT_GE(b.inputs.min().item<float>(), 0.0f);
  EXPECT_EQ(b.targets[1].item<int64_t>(), d.train.labels[1].item<int64_t>());
}

// An index outside the set is a cohort error naming the index and the set's size, as on the bag
// path, not torch's "index out of range in self".
TEST(Data, MakeBatchNamesAnIndexOutsideTheSet) {
  DataSplits d = loadData("synthetic:60", 1);
  for (const int64_t bad : {int64_t{60}, int64_t{1000}, int64_t{-1}}) {
    std::vector<int64_t> idx{0, bad, 1};
    try {
      makeBatch(d.train, idx);
      FAIL() << "no error for index " << bad;
    } catch (const InvalidArgument& e) {
      const std::string expected = "index " + std::to_string(bad) + " is not an example of this data set (60 examples)";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace cohort::idx_test
