// Synchronous data parallelism with real processes on 127.0.0.1: the seeds' equivalence proof,
// bit-identical replicas, the same binary under cohort launch, mpirun and TF_CONFIG, and a worker
// killed mid-training.
#include <cohort/checkpoint.h>
#include <cohort/models.h>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include "model_util.h"
#include "test_util.h"

#include <csignal>
#include <sstream>

namespace cohort::dataparallel_test {
namespace {

using test::loadParameters;
using test::maxDifference;

nlohmann::json doneEvent(const std::string& metrics) { return test::lastEvent(metrics, "done"); }

std::string launch(int n) { return test::launchPrefix(n); }

// The data and optimizer of the equivalence runs: plain SGD, no momentum, a few steps.
const std::string kCommon = " --model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 6 --threads 1 --progress off";

struct Scheme {
  std::string name;
  std::string flags;
  friend void PrintTo(const Scheme& s, std::ostream* out) { *out << s.name; }
};

class Equivalence : public ::testing::TestWithParam<std::tuple<Scheme, int>> {};

// N workers with batch b each end where one worker with batch N*b ends, on the same examples.
TEST_P(Equivalence, NWorkersEqualOneWorkerWithNTimesTheBatch) {
  const auto& [scheme, n] = GetParam();
  test::TempDir dir;
  const int b = 8;
  auto single = test::runCommand(test::cohortBinary() + " train" + kCommon + " --batch " + std::to_string(n * b) +
                                 " --save-model " + dir.file("single.pt"), 120);
  ASSERT_EQ(single.exitCode, 0) << single.output;
  auto multi = test::runCommand(launch(n) + test::cohortBinary() + " train" + kCommon + " --batch " +
                                    std::to_string(b) + " " + scheme.flags + " --save-model " + dir.file("multi.pt"),
                                180);
  ASSERT_EQ(multi.exitCode, 0) << multi.output;
  const auto one = loadParameters(dir.file("single.pt"));
  const auto many = loadParameters(dir.file("multi.pt"));
  // The same computation in another summation order differs in the last bits, and a ReLU whose
  // input sits that close to zero can flip for one example and move a few hundred elements by
  // ~1e-4 a few steps later (seen for average with 3 workers on an AMD EPYC, where allreduce
  // happened to match to 1e-8). A wrong scheme moves nearly every element, so: almost all
  // elements within 1e-5, and none far off.
  const double diff = maxDifference(one, many);
  EXPECT_LT(diff, 1e-3) << scheme.name << " with " << n << " workers";
  EXPECT_LT(test::fractionDifferent(one, many, 1e-5), 0.01) << scheme.name << " with " << n << " workers, max "
                                                             << diff;
  // Something did change: the comparison is not between two untouched initializations.
  torch::manual_seed(1);
  auto init = makeModel("mlp", {});
  std::vector<torch::Tensor> initial;
  for (auto& p : init->parameters()) initial.push_back(p.detach());
  EXPECT_GT(maxDifference(initial, loadParameters(dir.file("multi.pt"))), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, Equivalence,
    ::testing::Combine(::testing::Values(Scheme{"allreduce", "--strategy allreduce"},
                                         Scheme{"allreduce_no_overlap", "--strategy allreduce --no-overlap --bucket-mb 0.5"},
                                         Scheme{"average", "--strategy average --period 1"},
                                         // 2 replica threads in each process, their sums
                                         // allreduced across the processes
                                         Scheme{"mirrored", "--strategy mirrored --replicas 2"}),
                       ::testing::Values(2, 3)),
    [](const auto& info) { return std::get<0>(info.param).name + "_" + std::to_string(std::get<1>(info.param)); });

TEST(DataParallel, AllreduceReplicasStayBitIdentical) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2) + test::cohortBinary() +
                                " train --model cnn --data synthetic:600 --batch 16 --steps 8 --optimizer momentum"
                                " --strategy allreduce --bucket-mb 1 --progress off --save-model " +
                                dir.file("rank{rank}.pt"),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto a = loadParameters(dir.file("rank0.pt"), "cnn");
  auto b = loadParameters(dir.file("rank1.pt"), "cnn");
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

// A batch beyond a rank's share of the data was the whole share every step (each step an epoch,
// 100 samples a step where 160 were asked for), without a word.
TEST(DataParallel, ABatchBeyondARanksShareIsRefused) {
  auto r = test::runCommand(launch(2) + test::cohortBinary() +
                                " train --model mlp --data synthetic:100 --batch 80 --steps 4 --strategy allreduce "
                                "--progress off --timeout 30",
                            120);
  EXPECT_NE(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("--batch 80 is larger than this process's share of the training set (50 of 100 examples "
                          "over 2 data-parallel processes): use --batch of at most 50"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("done:"), std::string::npos) << r.output;
}

// Under average an evaluation (or checkpoint) between averages averages the model early: those
// averages' bytes were missing from the done event (0 bytes for 16 steps at --period 8
// --eval-every 2, whose every average ran at an evaluation).
TEST(DataParallel, AverageCountsTheAveragesOfItsEvaluations) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2) + test::cohortBinary() +
                                " train --model mlp --data synthetic:1024 --batch 32 --steps 16 --strategy average"
                                " --period 8 --eval-every 2 --progress off --timeout 30 --metrics " +
                                dir.file("m.jsonl"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto done = doneEvent(dir.file("m.jsonl"));
  int64_t stepBytes = 0;
  for (const auto& e : test::events(dir.file("m.jsonl"), "step")) stepBytes += e["bytes_sent"].get<int64_t>();
  EXPECT_EQ(stepBytes, 0) << "every average ran at an evaluation, outside the steps";
  // 8 averages (at steps 2, 4, ..., 14 and the end) of the mlp's 2.68 MB: a ring of 2 sends about
  // that much each time; at least 7 of them.
  EXPECT_GT(done["bytes_sent"].get<int64_t>(), 7 * 2'600'000) << done.dump();
}

// allreduce and average: each rank scores a slice of the test set and the counts are summed, so
// no rank waits at its next collective (bounded by --timeout) while the chief alone scores it (a
// cnn on Fashion-MNIST with --timeout 1 failed so); the sums are the whole set's scores, which
// `cohort ensemble` computes from the saved model in one process.
TEST(DataParallel, RanksScoreSlicesThatAddUpToTheWholeTestSet) {
  for (const std::string scheme : {"allreduce", "average --period 3"}) {
    test::TempDir dir;
    const std::string data = " --data synthetic:3000";
    auto r = test::runCommand(launch(2) + test::cohortBinary() + " train --model mlp" + data +
                                  " --steps 10 --eval-every 5 --threads 1 --progress off --strategy " + scheme +
                                  " --save-model " + dir.file("m.pt") + " --metrics " + dir.file("m.jsonl"),
                              180);
    ASSERT_EQ(r.exitCode, 0) << scheme << "\n" << r.output;
    const auto eval = test::lastEvent(dir.file("m.jsonl"), "eval");
    ASSERT_FALSE(eval.is_null()) << scheme;
    EXPECT_EQ(eval.value("scored_by", 0), 2) << scheme << ": " << eval.dump();
    EXPECT_EQ(eval["step"], 10) << eval.dump();
    auto scored = test::runCommand(test::cohortBinary() + " ensemble " + dir.file("m.pt") + data, 120);
    ASSERT_EQ(scored.exitCode, 0) << scored.output;
    // The model's line: its path, validation accuracy ("-"), test accuracy, test loss, test F1.
    std::string line;
    for (const std::string& l : test::lines(scored.output)) {
      if (l.rfind(dir.file("m.pt"), 0) == 0) line = l;
    }
    std::istringstream fields(line.substr(std::min(line.size(), dir.file("m.pt").size())));
    std::string validation;
    double accuracy = -1, loss = -1;
    fields >> validation >> accuracy >> loss;
    ASSERT_TRUE(fields) << scored.output;
    EXPECT_NEAR(eval["accuracy"].get<double>(), accuracy, 5.1e-5) << scheme << "\n" << scored.output;
    EXPECT_NEAR(eval["loss"].get<double>(), loss, 5.1e-5) << scheme << "\n" << scored.output;
  }
}

TEST(DataParallel, AverageWithPeriodKeepsReplicasAveragedAtTheEnd) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2) + test::cohortBinary() +
                                " train --model mlp --data synthetic:600 --batch 16 --steps 10 --optimizer momentum"
                                " --strategy average --period 4 --average-optimizer-state --progress off"
                                " --save-model " + dir.file("rank{rank}.pt") + " --metrics " + dir.file("m.jsonl"),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  // The last average is at the end (synchronize before the final evaluation).
  EXPECT_LT(maxDifference(loadParameters(dir.file("rank0.pt")), loadParameters(dir.file("rank1.pt"))), 1e-6);
  auto done = doneEvent(dir.file("m.jsonl"));
  EXPECT_EQ(done["workers"], 2);
  EXPECT_GT(done["bytes_sent"].get<int64_t>(), 0);
}

// Checkpoints every 10 steps with averaging every 4: the checkpoint's synchronize() is a
// collective, which every rank must join (a chief-only one deadlocked here once).
TEST(DataParallel, AverageCheckpointsOffThePeriodDoNotDesynchronize) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2) + test::cohortBinary() +
                                " train --model mlp --data synthetic:600 --batch 16 --steps 22 --optimizer momentum"
                                " --strategy average --period 4 --checkpoint-every 10 --eval-every 7 --timeout 20"
                                " --progress off --checkpoint-dir " + dir.path() + " --save-model " +
                                dir.file("rank{rank}.pt") + " --metrics " + dir.file("m.jsonl"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(doneEvent(dir.file("m.jsonl"))["steps"], 22);
  EXPECT_EQ(CheckpointStore(dir.path()).list().front().step, 22);
  EXPECT_LT(maxDifference(loadParameters(dir.file("rank0.pt")), loadParameters(dir.file("rank1.pt"))), 1e-6);
}

// The outer optimizer's momentum is training state: a run stopped at an average and resumed from
// its checkpoint ends where the uninterrupted run ends (with the momentum lost, the second outer
// step would be taken from zero momentum and land elsewhere).
TEST(DataParallel, AverageWithOuterNesterovResumesExactly) {
  test::TempDir dir;
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                            " --optimizer sgd --lr 0.1 --strategy average --period 3 --outer-optimizer nesterov"
                            " --outer-lr 0.7 --outer-momentum 0.9";
  auto whole = test::runCommand(train + " --steps 9 --save-model " + dir.file("whole{rank}.pt"), 120);
  ASSERT_EQ(whole.exitCode, 0) << whole.output;
  const std::string ckpt = " --checkpoint-dir " + dir.file("ckpt");
  auto first = test::runCommand(train + " --steps 6" + ckpt, 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  const auto saved = CheckpointStore(dir.file("ckpt")).list();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.front().step, 6);
  auto resumed = test::runCommand(train + " --steps 9 --resume" + ckpt + " --save-model " +
                                      dir.file("resumed{rank}.pt"), 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + saved.front().path), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("no outer momentum"), std::string::npos) << resumed.output;
  for (const std::string rank : {"0", "1"}) {
    EXPECT_LT(maxDifference(loadParameters(dir.file("whole" + rank + ".pt")),
                            loadParameters(dir.file("resumed" + rank + ".pt"))),
              1e-6)
        << "rank " << rank;
  }
}

// Runs `train` for `total` steps, and again stopped at `stopAt` (its final checkpoint) and resumed
// to `total`; every rank's parameters must end alike.
void expectResumesExactly(const std::string& train, int stopAt, int total) {
  test::TempDir dir;
  auto whole = test::runCommand(train + " --steps " + std::to_string(total) + " --save-model " +
                                    dir.file("whole{rank}.pt"), 120);
  ASSERT_EQ(whole.exitCode, 0) << whole.output;
  const std::string ckpt = " --checkpoint-dir " + dir.file("ckpt");
  auto first = test::runCommand(train + " --steps " + std::to_string(stopAt) + ckpt, 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  const auto saved = CheckpointStore(dir.file("ckpt")).list();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.front().step, stopAt);
  auto resumed = test::runCommand(train + " --steps " + std::to_string(total) + " --resume" + ckpt +
                                      " --save-model " + dir.file("resumed{rank}.pt"), 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + saved.front().path), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("warning"), std::string::npos) << resumed.output;
  for (const std::string rank : {"0", "1"}) {
    EXPECT_LT(maxDifference(loadParameters(dir.file("whole" + rank + ".pt")),
                            loadParameters(dir.file("resumed" + rank + ".pt"))),
              1e-6)
        << "rank " << rank;
  }
}

// The codec's state is training state too: how many steps the warm-up has left, and the residual
// of error feedback (what the threshold codec has not sent yet). Stopped inside the warm-up, a
// run resumed without the count sends uncompressed for longer than the uninterrupted one.
TEST(DataParallel, AverageWithCodecResumesExactlyInsideTheWarmUp) {
  expectResumesExactly(launch(2) + test::cohortBinary() +
                           " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                           " --optimizer sgd --lr 0.1 --strategy average --period 2 --codec threshold:0.005"
                           " --codec-warmup-steps 5",
                       4, 10);
}

// Stopped after compressed averages: resumed without the residual, the entries held back before
// the checkpoint would never be sent. With the outer Nesterov optimizer too.
TEST(DataParallel, AverageWithCodecAndOuterNesterovResumesExactlyAfterTheWarmUp) {
  expectResumesExactly(launch(2) + test::cohortBinary() +
                           " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                           " --optimizer sgd --lr 0.1 --strategy average --period 2 --codec threshold:0.005"
                           " --codec-warmup-steps 2 --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9",
                       6, 10);
}

// Each rank's optimizer state is its own between averages (without --average-optimizer-state):
// every rank resumed with the writer's momentum and Adam moments before.
TEST(DataParallel, AverageResumesEveryRanksOwnOptimizerState) {
  for (const std::string optimizer : {"momentum --lr 0.1", "adam --lr 0.01"}) {
    expectResumesExactly(launch(2) + test::cohortBinary() +
                             " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                             " --strategy average --period 1 --optimizer " +
                             optimizer,
                         4, 10);
  }
}

// The same for allreduce: DataParallel's warm-up count and every bucket's residual (before,
// neither was in the checkpoint, and the resumed run ended elsewhere than the uninterrupted one).
TEST(DataParallel, AllreduceWithCodecResumesExactlyInsideTheWarmUp) {
  expectResumesExactly(launch(2) + test::cohortBinary() +
                           " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                           " --optimizer sgd --lr 0.1 --strategy allreduce --codec topk:0.1 --codec-warmup-steps 5",
                       4, 10);
}

TEST(DataParallel, AllreduceWithCodecResumesExactlyAfterTheWarmUp) {
  expectResumesExactly(launch(2) + test::cohortBinary() +
                           " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                           " --optimizer sgd --lr 0.1 --strategy allreduce --codec threshold:0.005"
                           " --codec-warmup-steps 2 --first-bucket-mb 0.05 --bucket-mb 0.2",
                       6, 10);
}

TEST(DataParallel, RunsUnderMpirun) {
  test::TempDir dir;
  const test::ReservedPort port;  // mpirun's ranks must all be told the port before rank 0 listens
  auto r = test::runCommand("mpirun --oversubscribe --allow-run-as-root -n 2 -x MASTER_PORT=" +
                                std::to_string(port.port()) + " " + test::cohortBinary() + " train" + kCommon +
                                " --batch 8 --strategy allreduce --metrics " + dir.file("m.jsonl"),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = doneEvent(dir.file("m.jsonl"));
  EXPECT_EQ(done["workers"], 2);
  EXPECT_EQ(done["steps"], 6);
  EXPECT_EQ(done["samples_per_s"].is_number(), true);
}

TEST(DataParallel, RunsUnderAHandWrittenTfConfig) {
  test::TempDir dir;
  const std::string train = test::cohortBinary() + " train" + kCommon + " --batch 8 --strategy allreduce";
  // Two processes started by hand, each with its own TF_CONFIG, as a cluster operator would: the
  // chief's store on a port of its choosing, which the worker is then given.
  test::Process chief(test::tfConfig(0, 2, {}, "chief", 0) + " " + train + " --metrics " + dir.file("m.jsonl"));
  const int port = chief.port();
  ASSERT_GT(port, 0) << chief.output();
  test::Process worker(test::tfConfig(port, 2, {}, "worker", 0) + " " + train);
  const test::CommandResult c = chief.wait(std::chrono::seconds(180));
  const test::CommandResult w = worker.wait(std::chrono::seconds(60));
  ASSERT_EQ(c.exitCode, 0) << c.output << w.output;
  ASSERT_EQ(w.exitCode, 0) << c.output << w.output;
  auto done = doneEvent(dir.file("m.jsonl"));
  EXPECT_EQ(done["workers"], 2);
  EXPECT_EQ(done["steps"], 6);
}

// Rank 1 is SIGKILLed 50 steps into a long run. Under cohort launch: launch names it and
// exits with its status. Then a restart with --resume continues from the last checkpoint.
TEST(DataParallel, KilledWorkerStopsTheJobAndResumeContinues) {
  test::TempDir dir;
  const std::string train = test::cohortBinary() +
                            " train --model mlp --data fashion-mnist --batch 32 --strategy allreduce --threads 1"
                            " --progress off --checkpoint-every 20 --checkpoint-dir " + dir.path();
  // Rank 1 SIGKILLs itself after its 50th step.
  auto killed = test::runCommand(launch(2) + train + " --steps 100000 --test-kill-at 1:50", 120);
  EXPECT_EQ(killed.exitCode, 137) << killed.output;
  EXPECT_NE(killed.output.find("rank 1 was killed by signal 9"), std::string::npos) << killed.output;
  CheckpointStore store(dir.path());
  auto files = store.list();
  ASSERT_FALSE(files.empty()) << killed.output;
  const int64_t saved = files.front().step;

  auto resumed = test::runCommand(launch(2) + train + " --resume --steps " + std::to_string(saved + 10) +
                                      " --metrics " + dir.file("m.jsonl"), 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + files.front().path), std::string::npos) << resumed.output;
  EXPECT_EQ(doneEvent(dir.file("m.jsonl"))["steps"], saved + 10);
}

// Without a launcher to stop it, the surviving worker itself must notice and name the lost rank.
TEST(DataParallel, SurvivorNamesTheLostRankWithinTheTimeout) {
  const std::string train = test::cohortBinary() +
                            " train --model mlp --data synthetic:60000 --batch 32 --strategy allreduce --threads 1"
                            " --progress off --steps 1000000 --timeout 20";
  test::Process chief("MASTER_ADDR=127.0.0.1 MASTER_PORT=0 WORLD_SIZE=2 RANK=0 " + train);
  const int port = chief.port();
  ASSERT_GT(port, 0) << chief.output();
  // The victim SIGKILLs itself after its 30th step: mid-run, with nothing left to say.
  test::Process victim("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " WORLD_SIZE=2 RANK=1 " + train +
                       " --test-kill-at 1:30");
  const test::CommandResult v = victim.wait(std::chrono::seconds(120));
  const test::CommandResult c = chief.wait(std::chrono::seconds(120));
  EXPECT_EQ(v.exitCode, 128 + SIGKILL) << v.output;
  EXPECT_EQ(c.exitCode, 1) << c.output;
  EXPECT_NE(c.output.find("lost rank 1"), std::string::npos) << c.output;
}

}  // namespace
}  // namespace cohort::dataparallel_test
