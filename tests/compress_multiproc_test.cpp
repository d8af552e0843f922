// --codec with real processes on 127.0.0.1: fp16 allreduce against float32, every codec under
// allreduce and ps (trains, and sends fewer bytes by the codec's factor), and bad --codec text.
#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include "model_util.h"
#include "test_util.h"

#include <algorithm>
#include <numeric>

namespace cohort::compress_multiproc_test {
namespace {

using test::loadParameters;
using test::maxDifference;

std::string launch(int n, int shards = 0) { return test::launchPrefix(n, shards) + test::cohortBinary() + " train"; }

struct RunMetrics {
  std::vector<double> losses;
  std::vector<int64_t> bytesSent;  // per step, the chief's
  double doneBytes = 0;
};

RunMetrics readRun(const std::string& metrics) {
  RunMetrics run;
  for (const auto& line : test::lines(test::readFile(metrics))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") {
      run.losses.push_back(j["loss"].get<double>());
      run.bytesSent.push_back(j["bytes_sent"].get<int64_t>());
    }
  }
  return run;
}

double mean(std::vector<double>::const_iterator a, std::vector<double>::const_iterator b) {
  return std::accumulate(a, b, 0.0) / double(b - a);
}

double medianBytes(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return double(v[v.size() / 2]);
}

TEST(Compression, AllreduceFp16EqualsFloat32WithinFp16Tolerance) {
  test::TempDir dir;
  const std::string common = " --model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 6 --batch 8 "
                             "--threads 1 --progress off --strategy allreduce";
  auto plain = test::runCommand(launch(2) + common + " --save-model " + dir.file("none.pt"), 120);
  ASSERT_EQ(plain.exitCode, 0) << plain.output;
  auto half = test::runCommand(launch(2) + common + " --codec fp16 --save-model " + dir.file("fp16.pt"), 120);
  ASSERT_EQ(half.exitCode, 0) << half.output;
  const auto a = loadParameters(dir.file("none.pt"));
  const auto b = loadParameters(dir.file("fp16.pt"));
  const double diff = maxDifference(a, b);
  // Six steps of lr 0.1 on gradients rounded to 11 significant bits.
  EXPECT_LT(diff, 2e-4);
  EXPECT_GT(diff, 0.0) << "fp16 gave float32's parameters bit for bit: was the codec used?";
}

struct Expect {
  std::string codec;
  double minRatio, maxRatio;  // bytes per step against none
};

// Every codec trains (the loss of the last steps is well below the first) and sends what it
// should: 16-bit codecs half of float32, the sparse ones a small fraction.
void everyCodec(const std::string& launcher, const std::string& flags, const std::vector<Expect>& expects) {
  test::TempDir dir;
  const std::string common = " --model mlp --data synthetic:2000 --optimizer sgd --lr 0.1 --steps 40 --batch 16 "
                             "--threads 1 --progress off" + flags;
  std::map<std::string, RunMetrics> runs;
  for (const std::string codec : {std::string("none")}) {
    auto r = test::runCommand(launcher + common + " --metrics " + dir.file("none.jsonl"), 180);
    ASSERT_EQ(r.exitCode, 0) << r.output;
    runs[codec] = readRun(dir.file("none.jsonl"));
  }
  const RunMetrics& none = runs["none"];
  ASSERT_EQ(none.losses.size(), 40u);
  const double noneBytes = medianBytes(none.bytesSent);
  ASSERT_GT(noneBytes, 0);
  for (const auto& e : expects) {
    SCOPED_TRACE(e.codec);
    const std::string metrics = dir.file("codec.jsonl");
    auto r = test::runCommand(launcher + common + " --codec " + e.codec + " --metrics " + metrics, 180);
    ASSERT_EQ(r.exitCode, 0) << r.output;
    const RunMetrics run = readRun(metrics);
    ASSERT_EQ(run.losses.size(), 40u);
    const double first = mean(run.losses.begin(), run.losses.begin() + 5);
    const double last = mean(run.losses.end() - 5, run.losses.end());
    EXPECT_LT(last, 0.7 * first) << "did not train: loss " << first << " -> " << last << " (none: "
                                 << mean(none.losses.begin(), none.losses.begin() + 5) << " -> "
                                 << mean(none.losses.end() - 5, none.losses.end()) << ")";
    const double ratio = medianBytes(run.bytesSent) / noneBytes;
    EXPECT_GE(ratio, e.minRatio) << "bytes per step " << medianBytes(run.bytesSent) << " against " << noneBytes;
    EXPECT_LE(ratio, e.maxRatio) << "bytes per step " << medianBytes(run.bytesSent) << " against " << noneBytes;
  }
}

const std::vector<Expect> kExpects{
    {"fp16", 0.49, 0.51},
    {"bf16", 0.49, 0.51},
    {"topk:0.01", 0.005, 0.02},   // 1% of the entries, each a float and a delta-coded index
    {"threshold:0.002", 0.0001, 0.25},
    {"onebit", 0.015, 1.0 / 28},  // a bit per entry (1/32), a little less where zstd finds runs of zeros
};

TEST(Compression, EveryCodecUnderAllreduceTrainsAndSendsLess) {
  everyCodec(launch(2), " --strategy allreduce", kExpects);
}

TEST(Compression, EveryCodecUnderPsTrainsAndSendsLess) {
  everyCodec(launch(2, 1), " --strategy ps --ps-mode sync", kExpects);
}

TEST(Compression, AverageWithACodecTrains) {
  everyCodec(launch(2), " --strategy average --period 1", {{"threshold:0.002", 0.0001, 0.25}});
}

// The first W steps send float32, the rest compressed.
TEST(Compression, WarmupStepsTravelUncompressed) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2) + " --model mlp --data synthetic:600 --steps 8 --batch 16 --threads 1 "
                                        "--progress off --strategy allreduce --codec topk:0.01 --codec-warmup-steps 3 "
                                        "--metrics " + dir.file("m.jsonl"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const RunMetrics run = readRun(dir.file("m.jsonl"));
  ASSERT_EQ(run.bytesSent.size(), 8u);
  for (int s = 1; s < 3; ++s) EXPECT_EQ(run.bytesSent[size_t(s)], run.bytesSent[0]) << "step " << s;
  for (int s = 3; s < 8; ++s) EXPECT_LT(run.bytesSent[size_t(s)] * 20, run.bytesSent[0]) << "step " << s;
}

TEST(Compression, BadCodecTextIsAUsageError) {
  for (const std::string codec : {"zip", "topk:2", "threshold:-1", "fp16:3"}) {
    auto r = test::runCommand(test::cohortBinary() + " train --model mlp --data synthetic:100 --steps 1 --codec " + codec,
                              60);
    EXPECT_EQ(r.exitCode, 2) << r.output;
    EXPECT_NE(r.output.find("accepted: none, fp16, bf16, topk:RATIO"), std::string::npos) << r.output;
  }
  auto r = test::runCommand(test::cohortBinary() + " train --model mlp --data synthetic:100 --steps 1 --codec fp16", 60);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("--strategy local exchanges nothing"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace cohort::compress_multiproc_test
