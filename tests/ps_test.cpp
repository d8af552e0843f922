// The parameter server with real processes on 127.0.0.1: sync equals allreduce, every mode runs
// under cohort launch --ps, and the faults (a worker killed, a shard killed and restarted, a wrong
// token) end as the issue says.
#include <cohort/models.h>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include "model_util.h"
#include "test_util.h"

#include <algorithm>

namespace cohort {
namespace {

using test::loadParameters;
using test::maxDifference;

std::string launch(int n, int shards = 0) { return test::launchPrefix(n, shards); }

std::string train() { return test::cohortBinary() + " train --threads 1 --progress off"; }

// Shell lines that wait (up to 30 s) until the shard logging to `log` listens.
std::string waitListening(const std::string& log) {
  return "for i in $(seq 300); do grep -q listening " + log + " 2>/dev/null && break; sleep 0.1; done\n";
}

using Job = test::TfJob;

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

// sync --backup-workers 1 with worker 1 slowed on purpose: the chief's steps close without it
// (it is never held for the slow worker's 0.5 s) and the slow worker's late gradients are dropped.
// The chief is slowed too (30 x 0.25 s), so that its steps overlap the slow worker's whatever the
// start-up order: the slow worker's first pull can come up to ~2 s after the chief's Init (the
// client's back-off while the shard is not initialized), and with the chief at 0.1 s per step that
// was sometimes after the chief's last step (then nothing is late).
TEST(PsModesSync, BackupWorkersDoNotWaitForTheSlowWorker) {
  test::TempDir dir;
  auto r = test::runCommand(launch(2, 1) + train() + " --model mlp --data synthetic:4000 --steps 30 --batch 16" +
                                " --strategy ps --ps-mode sync --backup-workers 1 --test-slow-worker 0:0.25,1:0.5 --metrics " +
                                dir.file("m.jsonl"), 180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  std::vector<double> held;
  for (const auto& line : test::lines(test::readFile(dir.file("m.jsonl")))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") held.push_back(j["server_wait_s"].get<double>());
  }
  ASSERT_EQ(held.size(), 30u);
  std::sort(held.begin(), held.end());
  EXPECT_LT(held[held.size() / 2], 0.1) << "the chief's steps waited for the slow worker";
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  EXPECT_GE(done["dropped_late"].get<int64_t>(), 1) << done.dump();
  EXPECT_EQ(done["gradients_applied"].get<int64_t>() + done["dropped_late"].get<int64_t>(), 60);
}

// The asynchronous modes: a worker killed mid-run stops no one; the chief finishes and names it.
// ssp is the hard case: the others must stop waiting for the dead worker's clock.
class PsKilledWorker : public ::testing::TestWithParam<std::string> {};

TEST_P(PsKilledWorker, TheOthersFinishAndTheChiefReportsIt) {
  test::TempDir dir;
  Job job(2, 1);
  const std::string flags = " --model mlp --data synthetic:4000 --batch 16 --strategy ps --ps-mode " + GetParam() +
                            " --staleness-bound 2 --softsync 1 --timeout 3 --auth-token t0k";
  test::writeFile(dir.file("run.sh"),
                  job.tfConfig("ps", 0) + " " + train() + flags + " > " + dir.file("ps.log") + " 2>&1 &\nps=$!\n" + waitListening(dir.file("ps.log")) +
                  job.tfConfig("worker", 0) + " " + train() + flags + " --steps 100000 > " + dir.file("worker.log") +
                  " 2>&1 &\nvictim=$!\n" + job.tfConfig("chief", 0) + " " + train() + flags +
                  " --steps 400 --test-slow-worker 0:0.01 --metrics " + dir.file("m.jsonl") + " > " + dir.file("chief.log") +
                  " 2>&1 &\nchief=$!\nsleep 4\nkill -9 $victim\nwait $chief\nc=$?\nwait $ps\ns=$?\necho chief=$c ps=$s\n");
  auto r = test::runCommand("sh " + dir.file("run.sh"), 180);
  const std::string logs = r.output + test::readFile(dir.file("chief.log")) + test::readFile(dir.file("ps.log"));
  EXPECT_NE(r.output.find("chief=0 ps=0"), std::string::npos) << logs;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << logs;
  EXPECT_EQ(done["steps"], 400);
  ASSERT_EQ(done["workers_lost"].size(), 1u) << done.dump();
  EXPECT_EQ(done["workers_lost"][0], 1);
  EXPECT_NE(test::readFile(dir.file("chief.log")).find("worker 1 stopped before the end"), std::string::npos) << logs;
  EXPECT_NE(test::readFile(dir.file("ps.log")).find("worker 1 is lost"), std::string::npos) << logs;
}

INSTANTIATE_TEST_SUITE_P(Ps, PsKilledWorker, ::testing::Values("async", "softsync", "ssp"));

// sync without backup workers: the shard notices the silent worker and everyone stops naming it.
TEST(PsFaults, SyncStopsNamingTheLostWorker) {
  test::TempDir dir;
  Job job(2, 1);
  const std::string flags = " --model mlp --data synthetic:4000 --batch 16 --strategy ps --ps-mode sync --timeout 3"
                            " --steps 100000";
  test::writeFile(dir.file("run.sh"),
                  job.tfConfig("ps", 0) + " " + train() + flags + " > " + dir.file("ps.log") + " 2>&1 &\nps=$!\n" + waitListening(dir.file("ps.log")) +
                  job.tfConfig("worker", 0) + " " + train() + flags + " > " + dir.file("worker.log") +
                  " 2>&1 &\nvictim=$!\n" + job.tfConfig("chief", 0) + " " + train() + flags + " > " + dir.file("chief.log") +
                  " 2>&1 &\nchief=$!\nsleep 5\nkill -9 $victim\nwait $chief\nc=$?\nwait $ps\ns=$?\necho chief=$c ps=$s\n");
  auto r = test::runCommand("sh " + dir.file("run.sh"), 120);
  const std::string chief = test::readFile(dir.file("chief.log"));
  const std::string ps = test::readFile(dir.file("ps.log"));
  EXPECT_NE(r.output.find("chief=1 ps=1"), std::string::npos) << r.output << chief << ps;
  EXPECT_NE(chief.find("worker 1 sent no gradient"), std::string::npos) << chief;
  EXPECT_NE(ps.find("worker 1 sent no gradient"), std::string::npos) << ps;
}

// A shard SIGKILLed mid-run and started again resumes from its checkpoint; the workers wait for
// it, and training carries on where it was.
TEST(PsFaults, ShardKilledAndRestartedResumesFromItsCheckpoint) {
  test::TempDir dir;
  Job job(2, 1);
  const std::string shard = test::cohortBinary() + " ps --host 127.0.0.1 --port " + std::to_string(job.shards[0]) +
                            " --auth-token s3 --checkpoint-dir " + dir.file("ps");
  const std::string flags = " --model mlp --data fashion-mnist --batch 32 --strategy ps --ps-mode async --lr 0.05"
                            " --checkpoint-every 20 --timeout 30 --auth-token s3 --ps-hosts " + job.hosts() +
                            " --steps 400 --test-slow-worker 0:0.01";
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(job.workers[0]) + " WORLD_SIZE=2";
  test::writeFile(dir.file("run.sh"),
                  shard + " > " + dir.file("ps1.log") + " 2>&1 &\nps=$!\n" + waitListening(dir.file("ps1.log")) + env + " RANK=1 " + train() + flags +
                  " > " + dir.file("worker.log") + " 2>&1 &\nworker=$!\n" + env + " RANK=0 " + train() + flags +
                  " --metrics " + dir.file("m.jsonl") + " > " + dir.file("chief.log") + " 2>&1 &\nchief=$!\n" +
                  // Killed once it has a checkpoint (a second one, so that it was mid-run), and a few
                  // steps after it: those are lost with it and redone from the checkpoint.
                  "for i in $(seq 1200); do [ $(ls " + dir.file("ps") + " 2>/dev/null | grep -c 'ckpt$') -ge 2 ] && break; sleep 0.1; done\n"
                  "sleep 1\nkill -9 $ps\nwait $ps\nsleep 2\n" + shard + " > " + dir.file("ps2.log") + " 2>&1 &\nps=$!\n" +
                  "wait $chief\nc=$?\nwait $worker\nw=$?\nwait $ps\ns=$?\necho chief=$c worker=$w ps=$s\n");
  auto r = test::runCommand("sh " + dir.file("run.sh"), 240);
  const std::string logs = r.output + test::readFile(dir.file("chief.log")) + test::readFile(dir.file("ps1.log")) +
                           test::readFile(dir.file("ps2.log"));
  EXPECT_NE(r.output.find("chief=0 worker=0 ps=0"), std::string::npos) << logs;
  const std::string restarted = test::readFile(dir.file("ps2.log"));
  EXPECT_NE(restarted.find("restored from"), std::string::npos) << logs;
  // The loss goes on from where it was: no restart from scratch, nothing diverges.
  std::vector<double> losses;
  for (const auto& line : test::lines(test::readFile(dir.file("m.jsonl")))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 400u) << logs;
  auto mean = [&](size_t from, size_t to) {
    double s = 0;
    for (size_t i = from; i < to; ++i) s += losses[i];
    return s / double(to - from);
  };
  EXPECT_LT(mean(350, 400), mean(0, 50) * 0.6);
  for (double l : losses) ASSERT_TRUE(std::isfinite(l));
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  EXPECT_GT(done["test_accuracy"].get<double>(), 0.6) << done.dump();  // 0.70 after 400 steps uninterrupted
}

// A worker with the wrong secret is refused, and the shard counts and logs it.
TEST(PsFaults, WrongTokenIsRefused) {
  test::TempDir dir;
  const int port = test::freePort();
  const std::string shard = test::cohortBinary() + " ps --host 127.0.0.1 --port " + std::to_string(port) + " --auth-token right";
  test::writeFile(dir.file("run.sh"), shard + " > " + dir.file("ps.log") + " 2>&1 &\nps=$!\n" + waitListening(dir.file("ps.log")) + train() +
                                          " --model mlp --data synthetic:200 --steps 2 --strategy ps --timeout 5"
                                          " --ps-hosts 127.0.0.1:" + std::to_string(port) +
                                          " --auth-token wrong\necho exit=$?\nkill $ps\nwait $ps\n");
  auto r = test::runCommand("sh " + dir.file("run.sh"), 60);
  EXPECT_NE(r.output.find("exit=1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("UNAUTHENTICATED"), std::string::npos) << r.output;
  EXPECT_NE(test::readFile(dir.file("ps.log")).find("a wrong proof"), std::string::npos) << test::readFile(dir.file("ps.log"));
}

TEST(PsFaults, NoServersIsAClearError) {
  auto r = test::runCommand(train() + " --model mlp --data synthetic:200 --steps 2 --strategy ps", 60);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("cohort launch --ps"), std::string::npos) << r.output;
  auto bad = test::runCommand(train() + " --model mlp --data synthetic:200 --steps 2 --strategy ps --ps-mode sync"
                                        " --max-staleness 2 --ps-hosts 127.0.0.1:1", 60);
  EXPECT_EQ(bad.exitCode, 2) << bad.output;
  EXPECT_NE(bad.output.find("asynchronous modes"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace cohort
