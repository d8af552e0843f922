// The parameter server with real processes on 127.0.0.1: sync equals allreduce, every mode runs
// under cohort launch --ps, and the faults (a worker killed, a shard killed and restarted, a wrong
// token) end as the issue says.
#include <cohort/models.h>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include "model_util.h"
#include "test_util.h"

#include <algorithm>
#include <csignal>
#include <filesystem>

namespace cohort::ps_test {
namespace {

using test::loadParameters;
using test::maxDifference;

std::string launch(int n, int shards = 0) { return test::launchPrefix(n, shards); }

std::string train() { return test::cohortBinary() + " train --threads 1 --progress off"; }

// sync with plain SGD averages the N gradients of a step and applies them once: allreduce.
class SyncEqualsAllreduce : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(SyncEqualsAllreduce, SameParametersOnTheSameData) {
  const auto [n, shards] = GetParam();
  test::TempDir dir;
  const std::string common = " --model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 8 --batch 8";
  auto allreduce = test::runCommand(launch(n) + train() + common + " --strategy allreduce --save-model " +
                                        dir.file("allreduce.pt"), 180);
  ASSERT_EQ(allreduce.exitCode, 0) << allreduce.output;
  auto ps = test::runCommand(launch(n, shards) + train() + common + " --strategy ps --ps-mode sync --save-model " +
                                 dir.file("ps.pt") + " --metrics " + dir.file("m.jsonl"), 180);
  ASSERT_EQ(ps.exitCode, 0) << ps.output;
  EXPECT_LT(maxDifference(loadParameters(dir.file("allreduce.pt")), loadParameters(dir.file("ps.pt"))), 1e-5);
  torch::manual_seed(1);
  auto init = makeModel("mlp", {});
  std::vector<torch::Tensor> initial;
  for (auto& p : init->parameters()) initial.push_back(p.detach());
  EXPECT_GT(maxDifference(initial, loadParameters(dir.file("ps.pt"))), 1e-3) << "nothing was trained";
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  EXPECT_EQ(done["gradients_applied"], 8 * n);
  EXPECT_EQ(done["staleness_max"], 0);
  EXPECT_EQ(done["bytes_pushed_per_shard"].size(), size_t(shards));
}

INSTANTIATE_TEST_SUITE_P(Ps, SyncEqualsAllreduce, ::testing::Values(std::tuple{2, 1}, std::tuple{3, 2}),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "workers_" +
                                  std::to_string(std::get<1>(info.param)) + "shards";
                         });

struct Mode {
  std::string name;
  std::string flags;
  friend void PrintTo(const Mode& m, std::ostream* out) { *out << m.name; }
};

class PsModes : public ::testing::TestWithParam<Mode> {};

// Every mode trains under cohort launch --ps and reports what the servers saw.
TEST_P(PsModes, TrainsAndReportsTheServersRecord) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2, 2) + train() + " --model mlp --data synthetic:2000 --steps 30 --batch 16" +
                                " --strategy ps " + GetParam().flags + " --metrics " + dir.file("m.jsonl"),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 30);
  EXPECT_GT(done["gradients_applied"].get<int64_t>(), 0);
  EXPECT_EQ(done["rejected"], 0);
  EXPECT_EQ(done["unauthenticated"], 0);
  EXPECT_EQ(done["workers_lost"].size(), 0u);
  ASSERT_EQ(done["bytes_pushed_per_shard"].size(), 2u);
  EXPECT_GT(done["bytes_pushed_per_shard"][1].get<int64_t>(), 0);
  // Each of the 60 pushes is applied or dropped, and counted once.
  EXPECT_EQ(done["gradients_applied"].get<int64_t>() + done["dropped_late"].get<int64_t>() +
                done["dropped_stale"].get<int64_t>() + done["dropped_warmup"].get<int64_t>(),
            60);
  int64_t histogramTotal = 0;
  for (auto& c : done["staleness_histogram"]) histogramTotal += c.get<int64_t>();
  EXPECT_EQ(histogramTotal, done["gradients_applied"].get<int64_t>());
  auto step = test::lastEvent(dir.file("m.jsonl"), "step");
  EXPECT_TRUE(step.contains("staleness")) << step.dump();
  if (GetParam().name == "ssp") EXPECT_LE(done["max_clock_gap"].get<int64_t>(), 1);
}

INSTANTIATE_TEST_SUITE_P(
    Ps, PsModes,
    ::testing::Values(Mode{"async", "--ps-mode async"},
                      Mode{"async_updates", "--ps-mode async --push updates --optimizer momentum"},
                      Mode{"softsync", "--ps-mode softsync --softsync 2 --optimizer adam --lr 0.001"},
                      Mode{"ssp", "--ps-mode ssp --staleness-bound 1 --test-slow-worker 1:0.05"},
                      Mode{"sync_backup", "--ps-mode sync --backup-workers 1"},
                      Mode{"async_remedies", "--ps-mode async --staleness-lr inverse --max-staleness 1 --warmup-steps 5"}),
    [](const auto& info) { return info.param.name; });

// sync --backup-workers 1 with worker 1 slowed on purpose (0.5 s a step, the chief 0.25 s): the
// chief's steps close without it, so the slow worker's gradients arrive after their step closed
// and are dropped as late. The slow worker is started first and the chief only once the slow
// worker waits for the chief's Init (its "retrying" line): its first pull then comes within its
// 2 s back-off of the Init, while the chief's 30 steps take at least 7.5 s, however loaded the
// machine. (Started together, a slow worker that came up late could push only after the chief's
// last step, when nothing is late.)
TEST(PsModesSync, BackupWorkersDoNotWaitForTheSlowWorker) {
  test::TempDir dir;
  const std::string flags = " --model mlp --data synthetic:4000 --batch 16 --strategy ps --ps-mode sync"
                            " --backup-workers 1 --timeout 60 --auth-token t0k --test-slow-worker 0:0.25,1:0.5";
  test::Process ps(test::tfConfig(0, 2, {0}, "ps", 0) + " " + train() + flags);
  const int shard = ps.port();
  ASSERT_GT(shard, 0) << ps.output();
  test::Process slow(test::tfConfig(0, 2, {shard}, "worker", 0) + " " + train() + flags + " --steps 30");
  ASSERT_TRUE(slow.waitForOutput("waiting for the chief's Init); retrying")) << slow.output();
  test::Process chief(test::tfConfig(0, 2, {shard}, "chief", 0) + " " + train() + flags + " --steps 30 --metrics " +
                      dir.file("m.jsonl"));
  const test::CommandResult c = chief.wait(std::chrono::seconds(180));
  const test::CommandResult w = slow.wait(std::chrono::seconds(120));
  const test::CommandResult s = ps.wait(std::chrono::seconds(60));
  const std::string logs = "chief:\n" + c.output + "slow worker:\n" + w.output + "ps:\n" + s.output;
  ASSERT_EQ(c.exitCode, 0) << logs;
  EXPECT_EQ(w.exitCode, 0) << logs;
  EXPECT_EQ(s.exitCode, 0) << logs;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << logs;
  EXPECT_EQ(done["steps"], 30);
  // Counted, not timed: a late gradient is one whose step closed without it.
  EXPECT_GE(done["dropped_late"].get<int64_t>(), 1) << "the chief's steps waited for the slow worker\n" << done.dump();
  EXPECT_EQ(done["gradients_applied"].get<int64_t>() + done["dropped_late"].get<int64_t>(), 60) << done.dump();
}

// The asynchronous modes: a worker killed mid-run stops no one; the chief finishes and names it.
// ssp is the hard case: the others must stop waiting for the dead worker's clock.
class PsKilledWorker : public ::testing::TestWithParam<std::string> {};

TEST_P(PsKilledWorker, TheOthersFinishAndTheChiefReportsIt) {
  test::TempDir dir;
  const std::string flags = " --model mlp --data synthetic:4000 --batch 16 --strategy ps --ps-mode " + GetParam() +
                            (GetParam() == "ssp" ? " --staleness-bound 2" : "") +
                            (GetParam() == "softsync" ? " --softsync 1" : "") + " --timeout 3 --auth-token t0k";
  // Started by hand, as a cluster operator would: the shard first, on a port of its choosing.
  test::Process ps(test::tfConfig(0, 2, {0}, "ps", 0) + " " + train() + flags);
  const int shard = ps.port();
  ASSERT_GT(shard, 0);
  // The worker SIGKILLs itself after its 50th step, while the chief (0.01 s a step) has far to go.
  test::Process victim(test::tfConfig(0, 2, {shard}, "worker", 0) + " " + train() + flags +
                       " --steps 100000 --test-kill-at 1:50");
  test::Process chief(test::tfConfig(0, 2, {shard}, "chief", 0) + " " + train() + flags +
                      " --steps 400 --test-slow-worker 0:0.01 --metrics " + dir.file("m.jsonl"));
  const test::CommandResult killed = victim.wait(std::chrono::seconds(120));
  const test::CommandResult c = chief.wait(std::chrono::seconds(180));
  const test::CommandResult s = ps.wait(std::chrono::seconds(60));
  const std::string logs = "chief:\n" + c.output + "ps:\n" + s.output + "victim:\n" + killed.output;
  EXPECT_EQ(killed.exitCode, 128 + SIGKILL) << logs;
  EXPECT_EQ(c.exitCode, 0) << logs;
  EXPECT_EQ(s.exitCode, 0) << logs;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << logs;
  EXPECT_EQ(done["steps"], 400);
  ASSERT_EQ(done["workers_lost"].size(), 1u) << done.dump();
  EXPECT_EQ(done["workers_lost"][0], 1);
  EXPECT_NE(c.output.find("worker 1 stopped before the end"), std::string::npos) << logs;
  EXPECT_NE(s.output.find("worker 1 is lost"), std::string::npos) << logs;
}

INSTANTIATE_TEST_SUITE_P(Ps, PsKilledWorker, ::testing::Values("async", "softsync", "ssp"));

// sync without backup workers: the shard notices the silent worker and everyone stops naming it.
TEST(PsFaults, SyncStopsNamingTheLostWorker) {
  const std::string flags = " --model mlp --data synthetic:4000 --batch 16 --strategy ps --ps-mode sync --timeout 3"
                            " --steps 100000";
  test::Process ps(test::tfConfig(0, 2, {0}, "ps", 0) + " " + train() + flags);
  const int shard = ps.port();
  ASSERT_GT(shard, 0);
  test::Process victim(test::tfConfig(0, 2, {shard}, "worker", 0) + " " + train() + flags + " --test-kill-at 1:20");
  test::Process chief(test::tfConfig(0, 2, {shard}, "chief", 0) + " " + train() + flags);
  const test::CommandResult killed = victim.wait(std::chrono::seconds(120));
  const test::CommandResult c = chief.wait(std::chrono::seconds(120));
  const test::CommandResult s = ps.wait(std::chrono::seconds(60));
  EXPECT_EQ(killed.exitCode, 128 + SIGKILL) << killed.output;
  EXPECT_EQ(c.exitCode, 1) << c.output << s.output;
  EXPECT_EQ(s.exitCode, 1) << c.output << s.output;
  EXPECT_NE(c.output.find("worker 1 sent no gradient"), std::string::npos) << c.output;
  EXPECT_NE(s.output.find("worker 1 sent no gradient"), std::string::npos) << s.output;
}

// A shard SIGKILLed mid-run and started again resumes from its checkpoint; the workers wait for
// it, and training carries on where it was.
TEST(PsFaults, ShardKilledAndRestartedResumesFromItsCheckpoint) {
  test::TempDir dir;
  std::filesystem::create_directories(dir.file("ps"));
  const std::string shardFlags = " --host 127.0.0.1 --auth-token s3 --checkpoint-dir " + dir.file("ps");
  test::Process first(test::cohortBinary() + " ps --port 0" + shardFlags);
  const int port = first.port();
  ASSERT_GT(port, 0);
  const std::string flags = " --model mlp --data fashion-mnist --batch 32 --strategy ps --ps-mode async --lr 0.05"
                            " --checkpoint-every 20 --timeout 30 --auth-token s3 --ps-hosts " +
                            test::loopbackHosts({port}) + " --steps 400 --test-slow-worker 0:0.01";
  // No store under ps: the chief listens on nothing, and MASTER_PORT is only a formality.
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=0 WORLD_SIZE=2";
  test::Process worker(env + " RANK=1 " + train() + flags);
  test::Process chief(env + " RANK=0 " + train() + flags + " --metrics " + dir.file("m.jsonl"));
  // Killed once it has written a second checkpoint (so that it was mid-run); the steps after that
  // one are lost with it and redone from the checkpoint.
  auto checkpoints = [&] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.file("ps"))) {
      n += e.path().extension() == ".ckpt";
    }
    return n;
  };
  ASSERT_TRUE(test::waitForChange(dir.file("ps"), [&] { return checkpoints() >= 2; })) << first.output();
  first.kill(SIGKILL);
  const test::CommandResult killed = first.wait(std::chrono::seconds(30));
  // Started again on the port the workers know.
  test::Process second(test::cohortBinary() + " ps --port " + std::to_string(port) + shardFlags);
  const test::CommandResult c = chief.wait(std::chrono::seconds(240));
  const test::CommandResult w = worker.wait(std::chrono::seconds(60));
  const test::CommandResult s = second.wait(std::chrono::seconds(60));
  const std::string logs = "chief:\n" + c.output + "ps:\n" + killed.output + "ps again:\n" + s.output;
  EXPECT_EQ(c.exitCode, 0) << logs;
  EXPECT_EQ(w.exitCode, 0) << logs << w.output;
  EXPECT_EQ(s.exitCode, 0) << logs;
  EXPECT_NE(s.output.find("restored from"), std::string::npos) << logs;
  // The loss goes on from where it was: no restart from scratch, nothing diverges.
  std::vector<double> losses;
  for (const auto& line : test::lines(test::readFile(dir.file("m.jsonl")))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 400u) << logs;
  auto mean = [&](size_t from, size_t to) {
    double sum = 0;
    for (size_t i = from; i < to; ++i) sum += losses[i];
    return sum / double(to - from);
  };
  EXPECT_LT(mean(350, 400), mean(0, 50) * 0.6);
  for (double l : losses) ASSERT_TRUE(std::isfinite(l));
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  EXPECT_GT(done["test_accuracy"].get<double>(), 0.6) << done.dump();  // 0.70 after 400 steps uninterrupted
}

// A worker with the wrong secret is refused, and the shard counts and logs it.
// sync's shards step together: resumed at different versions (one shard's newest checkpoint lost)
// they hold parts of different models. That is refused, naming the versions, where the run used to
// train on the mixture.
TEST(PsFaults, SyncShardsResumedAtDifferentVersionsAreRefused) {
  test::TempDir dir;
  const std::string common = train() +
                             " --model mlp --data synthetic:200 --batch 8 --strategy ps --ps-mode sync"
                             " --checkpoint-every 5 --checkpoint-dir " +
                             dir.path();
  auto first = test::runCommand(launch(2, 2) + common + " --steps 13", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  ASSERT_TRUE(std::filesystem::remove(dir.file("ps-1/shard-0000000013.ckpt"))) << first.output;
  auto resumed = test::runCommand(launch(2, 2) + common + " --steps 30 --resume", 120);
  EXPECT_EQ(resumed.exitCode, 2) << resumed.output;
  EXPECT_NE(resumed.output.find("the shards resumed at different versions"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find(" at 13, "), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find(" at 10;"), std::string::npos) << resumed.output;
}

TEST(PsFaults, WrongTokenIsRefused) {
  test::Process ps(test::cohortBinary() + " ps --host 127.0.0.1 --port 0 --auth-token right");
  const int port = ps.port();
  ASSERT_GT(port, 0);
  auto r = test::runCommand(train() + " --model mlp --data synthetic:200 --steps 2 --strategy ps --timeout 5"
                                      " --ps-hosts " + test::loopbackHosts({port}) + " --auth-token wrong",
                            60);
  EXPECT_EQ(r.exitCode, 1) << r.output;
  EXPECT_NE(r.output.find("UNAUTHENTICATED"), std::string::npos) << r.output;
  ps.kill(SIGTERM);
  const test::CommandResult s = ps.wait(std::chrono::seconds(30));
  EXPECT_NE(s.output.find("a wrong proof"), std::string::npos) << s.output;
}

TEST(PsFaults, NoServersIsAClearError) {
  auto r = test::runCommand(train() + " --model mlp --data synthetic:200 --steps 2 --strategy ps", 60);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("cohort launch --ps"), std::string::npos) << r.output;
  auto bad = test::runCommand(train() + " --model mlp --data synthetic:200 --steps 2 --strategy ps --ps-mode sync"
                                        " --max-staleness 2 --ps-hosts 127.0.0.1:1", 60);
  EXPECT_EQ(bad.exitCode, 2) << bad.output;
  EXPECT_NE(bad.output.find("--max-staleness does not apply to --ps-mode sync: it acts under --ps-mode async, "
                            "softsync or ssp only"),
            std::string::npos)
      << bad.output;
}

// --ps-hosts is checked before anything starts: a port past 65535 (it used to wrap), none (gRPC's
// 443), one that is not a number (0) and a shard named twice (its keys held twice) are refused
// naming the entry, where each used to fail only after --timeout as an unreachable shard, or with
// "unknown key" from the shard.
TEST(PsFaults, BadPsHostsAreRefusedNamingTheEntry) {
  for (const std::string hosts : {"127.0.0.1:70000", "localhost", "localhost:abc", "127.0.0.1:5000,127.0.0.1:5000"}) {
    auto r = test::runCommand(train() +
                                  " --model mlp --data synthetic:200 --steps 2 --strategy ps --timeout 30"
                                  " --ps-hosts " +
                                  hosts,
                              60);
    EXPECT_EQ(r.exitCode, 2) << hosts << ": " << r.output;
    const std::string entry = hosts.substr(0, hosts.find(','));
    EXPECT_NE(r.output.find("--ps-hosts: '" + entry + "'"), std::string::npos) << r.output;
  }
}

// Under ps, --checkpoint-every counts each shard's updates (the shards checkpoint themselves), and
// --help says so: async with 2 workers writes one every N/2 steps of each worker.
TEST(PsFaults, CheckpointEverySaysItCountsShardUpdatesUnderPs) {
  auto r = test::runCommand(test::cohortBinary() + " train --help", 60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("under --strategy ps each shard checkpoints every N of its updates"), std::string::npos)
      << r.output;
}

// A resume that only some shards can take up (one shard's checkpoints gone) is refused in every
// mode, naming the shards that resumed and those that did not: async used to train on, the shard
// without a checkpoint holding the chief's fresh values beside the others' trained ones.
TEST(PsFaults, AResumeThatOnlySomeShardsCanTakeUpIsRefused) {
  test::TempDir dir;
  const std::string common = train() +
                             " --model mlp --data synthetic:200 --batch 8 --strategy ps --ps-mode async"
                             " --checkpoint-dir " +
                             dir.path();
  auto first = test::runCommand(launch(1, 2) + common + " --steps 10", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  for (const auto& e : std::filesystem::directory_iterator(dir.file("ps-1"))) std::filesystem::remove(e.path());
  auto resumed = test::runCommand(launch(1, 2) + common + " --steps 12 --resume", 120);
  EXPECT_EQ(resumed.exitCode, 2) << resumed.output;
  EXPECT_NE(resumed.output.find("only some shards had a checkpoint to resume from"), std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("(at version 10) resumed"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find(" had none"), std::string::npos) << resumed.output;
}

// async: the chief finishes its steps long before worker 1 (slowed to 0.3 s a step), and waits
// for it as long as it makes steps, past twice the timeout (where it used to fail the job).
TEST(PsFaults, TheChiefWaitsForAWorkerStillTrainingPastTwiceTheTimeout) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2, 1) + train() +
                                " --model mlp --data synthetic:400 --batch 8 --strategy ps --ps-mode async"
                                " --timeout 5 --steps 45 --test-slow-worker 1:0.3 --metrics " +
                                dir.file("m.jsonl"),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["gradients_applied"], 90) << done.dump();
  EXPECT_EQ(done["workers_lost"].size(), 0u) << done.dump();
}

}  // namespace
}  // namespace cohort::ps_test
