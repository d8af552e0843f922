// In-process replicas end to end through the `cohort` binary on the real Fashion-MNIST.
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace cohort::replicas_e2e_test {
namespace {

// Hogwild through `cohort train` reaches the mlp's accuracy bound (0.80 after one epoch) and
// reports its staleness like ps async.
TEST(ReplicasCli, HogwildTrainsTheMlpToItsBound) {
  test::TempDir dir;
  auto r = test::runCommand(test::cohortBinary() +
                                " train --strategy hogwild --replicas 2 --model mlp --data fashion-mnist --epochs 1"
                                " --batch 64 --lr 0.01 --optimizer momentum --progress off --metrics " +
                                dir.file("m.jsonl"),
                            300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_GE(done["test_accuracy"].get<double>(), 0.80) << done.dump();
  EXPECT_EQ(done["updates"].get<int64_t>(), 2 * 938) << done.dump();
  EXPECT_TRUE(done.contains("staleness_mean")) << done.dump();
  EXPECT_TRUE(done.contains("conflict_fraction")) << done.dump();
}

}  // namespace
}  // namespace cohort::replicas_e2e_test
