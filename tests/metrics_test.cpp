#include <cohort/error.h>
#include <cohort/metrics.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "test_util.h"

namespace cohort::metrics_test {
namespace {

TEST(Metrics, LineIsJsonWithEventFirst) {
  const std::string line = formatMetricLine(
      "done", {{"steps", int64_t{12}}, {"samples_per_s", 1234.5}, {"model", std::string("cnn")},
               {"ok", true}, {"histogram", std::vector<int64_t>{1, 2, 3}}});
  EXPECT_EQ(line.rfind("{\"event\":\"done\",", 0), 0u) << line;
  auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["steps"], 12);
  EXPECT_DOUBLE_EQ(j["samples_per_s"].get<double>(), 1234.5);
  EXPECT_EQ(j["model"], "cnn");
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["histogram"], nlohmann::json::array({1, 2, 3}));
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(Metrics, NonFiniteNumbersBecomeNull) {
  auto j = nlohmann::json::parse(formatMetricLine(
      "step", {{"loss", std::numeric_limits<double>::quiet_NaN()},
               {"rate", std::numeric_limits<double>::infinity()}}));
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_TRUE(j["rate"].is_null());
}

TEST(Metrics, WriterFlushesEachLine) {
  test::TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsWriter writer(path);
  writer.write("step", {{"step", int64_t{1}}});
  writer.write("eval", {{"accuracy", 0.5}});
  // Read while the writer is still open: nothing may wait in a buffer.
  auto lines = test::lines(test::readFile(path));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["event"], "step");
  EXPECT_EQ(nlohmann::json::parse(lines[1])["accuracy"], 0.5);
}

TEST(Metrics, EmptyPathDiscards) {
  MetricsWriter writer("");
  EXPECT_FALSE(writer.enabled());
  writer.write("step", {{"step", int64_t{1}}});
}

TEST(Metrics, UnwritablePathIsAnError) {
  try {
    MetricsWriter writer("/nonexistent-dir/m.jsonl");
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/m.jsonl"), std::string::npos);
  }
}

}  // namespace
}  // namespace cohort::metrics_test
