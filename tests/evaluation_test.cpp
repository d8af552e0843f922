// Evaluation metrics, the validation split, and TensorBoard event files read back by a reader of
// this test's own: a bitwise CRC-32C (no table, unlike the writer's) and its own protobuf wire
// decoding, written from the format's description (TFRecord framing; event.proto, summary.proto).
#include <cohort/data.h>
#include <cohort/error.h>
#include "base/tensorboard.h"
#include "train/evaluation.h"

#include "test_util.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

namespace cohort::evaluation_test {
namespace {

// ---------------------------------------------------------------------------------------------
// The independent reader.

uint32_t bitwiseCrc32c(const uint8_t* p, size_t n) {
  uint32_t crc = ~0u;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

struct Field {
  uint32_t number = 0;
  int wire = 0;
  uint64_t integer = 0;  // varint, fixed32, fixed64
  std::string bytes;     // length-delimited
};

// Decodes one message's fields; fails the test on malformed input.
std::vector<Field> decodeFields(const std::string& message) {
  std::vector<Field> out;
  size_t at = 0;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at >= message.size()) throw std::runtime_error("truncated varint");
      const auto byte = uint8_t(message[at++]);
      v |= uint64_t(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return v;
    }
    throw std::runtime_error("varint too long");
  };
  while (at < message.size()) {
    const uint64_t key = varint();
    Field f;
    f.number = uint32_t(key >> 3);
    f.wire = int(key & 7);
    if (f.wire == 0) {
      f.integer = varint();
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      if (at + size_t(n) > message.size()) throw std::runtime_error("truncated fixed field");
      f.integer = le(reinterpret_cast<const uint8_t*>(message.data() + at), n);
      at += size_t(n);
    } else if (f.wire == 2) {
      const uint64_t n = varint();
      if (at + n > message.size()) throw std::runtime_error("truncated bytes field");
      f.bytes = message.substr(at, n);
      at += n;
    } else {
      throw std::runtime_error("unexpected wire type " + std::to_string(f.wire));
    }
    out.push_back(f);
  }
  return out;
}

struct ReadEvent {
  double wallTime = 0;
  int64_t step = 0;
  std::string fileVersion;
  std::map<std::string, float> scalars;
  int64_t sessionStatus = 0;  // SessionLog.status (START = 1); 0: no session log
};

// Reads every record of an event file, checking both CRCs of each.
std::vector<ReadEvent> readEventFile(const std::string& path) {
  const std::string file = test::readFile(path);
  const auto* p = reinterpret_cast<const uint8_t*>(file.data());
  std::vector<ReadEvent> events;
  size_t at = 0;
  while (at < file.size()) {
    if (at + 12 > file.size()) throw std::runtime_error("truncated record header");
    const uint64_t length = le(p + at, 8);
    if (uint32_t(le(p + at + 8, 4)) != mask(bitwiseCrc32c(p + at, 8))) throw std::runtime_error("length CRC mismatch");
    if (at + 12 + length + 4 > file.size()) throw std::runtime_error("truncated record");
    const uint8_t* data = p + at + 12;
    if (uint32_t(le(data + length, 4)) != mask(bitwiseCrc32c(data, length))) throw std::runtime_error("data CRC mismatch");
    ReadEvent e;
    for (const Field& f : decodeFields(std::string(reinterpret_cast<const char*>(data), length))) {
      if (f.number == 1 && f.wire == 1) std::memcpy(&e.wallTime, &f.integer, 8);
      if (f.number == 2 && f.wire == 0) e.step = int64_t(f.integer);
      if (f.number == 3 && f.wire == 2) e.fileVersion = f.bytes;
      if (f.number == 7 && f.wire == 2) {
        for (const Field& s : decodeFields(f.bytes)) {
          if (s.number == 1 && s.wire == 0) e.sessionStatus = int64_t(s.integer);
        }
      }
      if (f.number == 5 && f.wire == 2) {
        for (const Field& value : decodeFields(f.bytes)) {
          if (value.number != 1 || value.wire != 2) continue;
          std::string tag;
          float simple = NAN;
          for (const Field& v : decodeFields(value.bytes)) {
            if (v.number == 1 && v.wire == 2) tag = v.bytes;
            if (v.number == 2 && v.wire == 5) {
              const auto bits = uint32_t(v.integer);
              std::memcpy(&simple, &bits, 4);
            }
          }
          e.scalars[tag] = simple;
        }
      }
    }
    events.push_back(e);
    at += 12 + length + 4;
  }
  return events;
}

std::string onlyEventFile(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) found.push_back(entry.path().string());
  }
  EXPECT_EQ(found.size(), 1u) << dir;
  return found.empty() ? "" : found[0];
}

// ---------------------------------------------------------------------------------------------

TEST(TensorBoard, Crc32cMatchesTheStandardCheckValue) {
  const std::string digits = "123456789";
  const auto* p = reinterpret_cast<const uint8_t*>(digits.data());
  EXPECT_EQ(bitwiseCrc32c(p, digits.size()), 0xE3069283u);
  EXPECT_EQ(crc32c({p, digits.size()}), 0xE3069283u);
  EXPECT_EQ(maskedCrc32c({p, digits.size()}), mask(0xE3069283u));
}

TEST(TensorBoard, WriterFileReadsBackWithCrcsAndValues) {
  test::TempDir dir;
  {
    TensorBoardWriter writer(dir.file("run"));
    writer.scalars(1, {{"train/loss", 2.5f}, {"train/samples_per_s", 1234.0f}});
    writer.scalars(300, {{"test/accuracy", 0.875f}, {"skipped", NAN}});
    writer.scalars(-2, {{"negative_step", 1.0f}});
  }
  const std::string path = onlyEventFile(dir.file("run"));
  const std::vector<ReadEvent> events = readEventFile(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].fileVersion, "brain.Event:2");
  EXPECT_GT(events[0].wallTime, 1.7e9);
  EXPECT_EQ(events[1].step, 1);
  EXPECT_EQ(events[1].scalars.at("train/loss"), 2.5f);
  EXPECT_EQ(events[1].scalars.at("train/samples_per_s"), 1234.0f);
  EXPECT_EQ(events[2].step, 300);
  EXPECT_EQ(events[2].scalars.size(), 1u);  // the NaN is left out
  EXPECT_EQ(events[2].scalars.at("test/accuracy"), 0.875f);
  EXPECT_EQ(events[3].step, -2);
  EXPECT_GE(events[3].wallTime, events[1].wallTime);

  // The reader does check: one flipped bit in a value is a CRC mismatch.
  std::string bytes = test::readFile(path);
  bytes[bytes.size() - 6] ^= 0x01;
  test::writeFile(path, bytes);
  EXPECT_THROW(readEventFile(path), std::runtime_error);
}

// A resumed run's file starts with a SessionLog START at its first step: TensorBoard drops the
// earlier files' events from there on (the steps the crash undid), which it showed twice.
TEST(TensorBoard, AResumedRunMarksWhereItStartsAgain) {
  test::TempDir dir;
  const std::string train = test::cohortBinary() +
                            " train --data synthetic:600 --model mlp --progress off --threads 1 --checkpoint-every 5 "
                            "--checkpoint-dir " +
                            dir.file("ckpt") + " --tensorboard " + dir.file("tb");
  auto first = test::runCommand(train + " --steps 7", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  const std::string firstFile = onlyEventFile(dir.file("tb"));
  for (const ReadEvent& e : readEventFile(firstFile)) EXPECT_EQ(e.sessionStatus, 0);
  std::filesystem::remove(dir.file("ckpt/ckpt-0000000007.ckpt"));  // as if it crashed after step 7
  auto resumed = test::runCommand(train + " --steps 10 --resume", 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  std::vector<ReadEvent> second;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file("tb"))) {
    if (entry.path().string() != firstFile) second = readEventFile(entry.path().string());
  }
  ASSERT_GE(second.size(), 3u) << "no second event file";
  EXPECT_EQ(second[1].sessionStatus, 1);  // after the file version: START
  EXPECT_EQ(second[1].step, 6);
  EXPECT_EQ(second[2].step, 6);  // the first step it trains
  EXPECT_EQ(second[2].scalars.count("train/loss"), 1u);
}

TEST(Scores, FromAConfusionMatrix) {
  // true\predicted: class 0: 3 right, 1 as class 1; class 1: 2 right; class 2: none, but 1
  // example of class 1 predicted as 2; class 3: no example, never predicted.
  const std::vector<int64_t> confusion{3, 1, 0, 0,  //
                                       0, 2, 1, 0,  //
                                       0, 0, 0, 0,  //
                                       0, 0, 0, 0};
  const Scores s = scoresFromConfusion(confusion, 4, 7.0);
  EXPECT_EQ(s.examples, 7);
  EXPECT_DOUBLE_EQ(s.loss, 1.0);
  EXPECT_DOUBLE_EQ(s.accuracy, 5.0 / 7.0);
  // F1 per class: 0: 2*3/(4+3) = 6/7; 1: 2*2/(3+3) = 2/3; 2: 0 (1 predicted, none true); 3 absent.
  EXPECT_NEAR(s.macroF1, (6.0 / 7.0 + 2.0 / 3.0 + 0.0) / 3.0, 1e-12);
  ASSERT_EQ(s.perClassAccuracy.size(), 4u);
  EXPECT_DOUBLE_EQ(s.perClassAccuracy[0], 0.75);
  EXPECT_DOUBLE_EQ(s.perClassAccuracy[1], 2.0 / 3.0);
  EXPECT_TRUE(std::isnan(s.perClassAccuracy[2]));
}

TEST(Scores, AccumulatorAgreesWithTorch) {
  torch::manual_seed(3);
  const torch::Tensor logits = torch::randn({50, 5});
  const torch::Tensor targets = torch::randint(5, {50}, torch::kInt64);
  ScoreAccumulator acc(5);
  acc.add(logits.slice(0, 0, 20), targets.slice(0, 0, 20));
  acc.add(logits.slice(0, 20), targets.slice(0, 20));
  const Scores s = acc.scores();
  EXPECT_NEAR(s.loss, torch::nn::functional::cross_entropy(logits, targets).item<double>(), 1e-5);
  EXPECT_DOUBLE_EQ(s.accuracy, logits.argmax(1).eq(targets).sum().item<double>() / 50.0);
  EXPECT_THROW(acc.add(torch::randn({2, 4}), torch::zeros({2}, torch::kInt64)), InvalidArgument);
}

TEST(Validation, HoldOutIsSeededAndDisjoint) {
  DataSplits a = loadData("synthetic:600", 1);
  const torch::Tensor labelCounts = torch::bincount(a.train.labels, {}, 10);
  const int64_t pixelSum = a.train.images.sum().item<int64_t>();
  holdOutValidation(a, 100, 7);
  EXPECT_EQ(a.validation.size(), 100);
  EXPECT_EQ(a.train.size(), 500);
  // Together they are the original training set.
  EXPECT_TRUE(torch::equal(torch::bincount(a.train.labels, {}, 10) + torch::bincount(a.validation.labels, {}, 10),
                           labelCounts));
  EXPECT_EQ(a.train.images.sum().item<int64_t>() + a.validation.images.sum().item<int64_t>(), pixelSum);
  DataSplits b = loadData("synthetic:600", 1);
  holdOutValidation(b, 100, 7);
  EXPECT_TRUE(torch::equal(a.validation.images, b.validation.images));
  DataSplits c = loadData("synthetic:600", 1);
  holdOutValidation(c, 100, 8);
  EXPECT_FALSE(torch::equal(a.validation.images, c.validation.images));
  DataSplits d = loadData("synthetic:600", 1);
  EXPECT_THROW(holdOutValidation(d, 600, 1), InvalidArgument);
}

// The trainer end to end: validation fields, metrics of the done event, and the TensorBoard file
// agreeing with the JSON lines.
TEST(TensorBoard, TrainerWritesWhatTheMetricsSay) {
  test::TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  auto r = test::runCommand(test::cohortBinary() +
                                " train --data synthetic:600 --model mlp --steps 12 --eval-every 6 --validation 100"
                                " --progress off --threads 1 --metrics " + metrics + " --tensorboard " + dir.file("tb"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const std::vector<ReadEvent> events = readEventFile(onlyEventFile(dir.file("tb")));
  std::map<int64_t, ReadEvent> trainAt, evalAt;
  for (const ReadEvent& e : events) {
    if (e.scalars.count("train/loss") != 0) trainAt[e.step] = e;
    if (e.scalars.count("test/accuracy") != 0) evalAt[e.step] = e;
  }
  int steps = 0, evals = 0;
  for (const std::string& line : test::lines(test::readFile(metrics))) {
    const auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") {
      ++steps;
      const int64_t step = j["step"];
      ASSERT_EQ(trainAt.count(step), 1u) << step;
      EXPECT_EQ(trainAt[step].scalars["train/loss"], float(j["loss"].get<double>()));
      EXPECT_EQ(trainAt[step].scalars["train/learning_rate"], 0.01f);
      EXPECT_EQ(trainAt[step].scalars.count("train/comm_wait_s"), 1u);
      EXPECT_EQ(trainAt[step].scalars.count("train/bytes_sent"), 1u);
    }
    if (j["event"] == "eval") {
      ++evals;
      const int64_t step = j["step"];
      ASSERT_EQ(evalAt.count(step), 1u) << step;
      EXPECT_EQ(evalAt[step].scalars["test/accuracy"], float(j["accuracy"].get<double>()));
      EXPECT_EQ(evalAt[step].scalars["validation/accuracy"], float(j["val_accuracy"].get<double>()));
      EXPECT_EQ(evalAt[step].scalars["validation/loss"], float(j["val_loss"].get<double>()));
      EXPECT_TRUE(j.contains("macro_f1"));
    }
  }
  EXPECT_EQ(steps, 12);
  EXPECT_EQ(evals, 2);
  const auto done = test::lastEvent(metrics, "done");
  ASSERT_FALSE(done.is_null());
  EXPECT_GT(done["val_accuracy"].get<double>(), 0.0);
  EXPECT_GT(done["val_loss"].get<double>(), 0.0);
  EXPECT_GT(done["test_macro_f1"].get<double>(), 0.0);
  ASSERT_EQ(done["test_per_class_accuracy"].size(), 10u);
  ASSERT_EQ(done["val_per_class_accuracy"].size(), 10u);
}

}  // namespace
}  // namespace cohort::evaluation_test
