// Faults under `cohort launch`: the failure policy per scheme (cli/launch_policy.h), restarts
// (--max-restarts), what the launcher refuses before forking, and real training jobs that lose a
// worker, are restarted, or stop early at their target accuracy. Every process is started by the
// launcher; the waits are on events (a FIFO, an exit) with timeouts, never sleeps.
#include "cli/launch_policy.h"

#include "test_util.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <filesystem>
#include <numeric>
#include <regex>
#include <set>

namespace cohort {
namespace {

using cli::FailureAction;
using cli::onFailure;
using cli::ProcessKind;
using cli::WorkerLoss;

std::string launch(const std::string& args) { return test::cohortBinary() + " launch " + args; }

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++n;
  return n;
}

TEST(LaunchPolicy, EachFailureByKindSchemeAndRestartsLeft) {
  auto action = [](ProcessKind kind, WorkerLoss scheme, bool checkpoints, int restarts) {
    return onFailure({.kind = kind, .scheme = scheme, .writesCheckpoints = checkpoints, .hasCheckpoint = checkpoints,
                      .restartsLeft = restarts});
  };
  // Synchronous: any failure stops the group, or restarts it.
  for (ProcessKind kind : {ProcessKind::kChief, ProcessKind::kWorker, ProcessKind::kShard}) {
    EXPECT_EQ(action(kind, WorkerLoss::kStopsGroup, true, 0), FailureAction::kEndJob);
    EXPECT_EQ(action(kind, WorkerLoss::kStopsGroup, true, 1), FailureAction::kRestartGroup);
  }
  // A lost worker: the others go on; in the asynchronous ps modes it comes back when it may.
  EXPECT_EQ(action(ProcessKind::kWorker, WorkerLoss::kTolerated, false, 0), FailureAction::kGoOn);
  EXPECT_EQ(action(ProcessKind::kWorker, WorkerLoss::kTolerated, false, 2), FailureAction::kGoOn);
  EXPECT_EQ(action(ProcessKind::kWorker, WorkerLoss::kRejoins, false, 0), FailureAction::kGoOn);
  EXPECT_EQ(action(ProcessKind::kWorker, WorkerLoss::kRejoins, false, 1), FailureAction::kRestartProcess);
  // The chief: the job cannot go on without it.
  EXPECT_EQ(action(ProcessKind::kChief, WorkerLoss::kRejoins, false, 0), FailureAction::kEndJob);
  EXPECT_EQ(action(ProcessKind::kChief, WorkerLoss::kRejoins, false, 1), FailureAction::kRestartGroup);
  // A shard comes back alone only from a checkpoint.
  EXPECT_EQ(action(ProcessKind::kShard, WorkerLoss::kRejoins, false, 0), FailureAction::kEndJob);
  EXPECT_EQ(action(ProcessKind::kShard, WorkerLoss::kRejoins, true, 0), FailureAction::kEndJob);
  EXPECT_EQ(action(ProcessKind::kShard, WorkerLoss::kRejoins, false, 1), FailureAction::kRestartGroup);
  EXPECT_EQ(action(ProcessKind::kShard, WorkerLoss::kRejoins, true, 1), FailureAction::kRestartProcess);
  // ... and only once it has one on disk: before its first, the group is restarted instead.
  EXPECT_EQ(onFailure({.kind = ProcessKind::kShard, .scheme = WorkerLoss::kRejoins, .writesCheckpoints = true,
                       .hasCheckpoint = false, .restartsLeft = 1}),
            FailureAction::kRestartGroup);
  // A process whose run is recorded ("finished") is never restarted, in any scheme.
  for (WorkerLoss scheme : {WorkerLoss::kStopsGroup, WorkerLoss::kRejoins}) {
    EXPECT_EQ(onFailure({.kind = ProcessKind::kChief, .scheme = scheme, .restartsLeft = 3, .finished = true}),
              FailureAction::kEndJob);
  }
  EXPECT_EQ(onFailure({.kind = ProcessKind::kWorker, .scheme = WorkerLoss::kRejoins, .restartsLeft = 3,
                       .finished = true}),
            FailureAction::kGoOn);
  EXPECT_EQ(cli::parseWorkerLoss("rejoins"), WorkerLoss::kRejoins);
  EXPECT_EQ(cli::parseWorkerLoss("tolerated"), WorkerLoss::kTolerated);
  EXPECT_EQ(cli::parseWorkerLoss("stops-group"), WorkerLoss::kStopsGroup);
  EXPECT_FALSE(cli::parseWorkerLoss("sometimes").has_value());
}

// A directory with a FIFO: `fifo()` blocks a writer until a reader opens it, which orders one
// process's step after another's without sleeping.
struct FifoDir {
  test::TempDir dir;
  FifoDir() { EXPECT_EQ(::mkfifo(fifo().c_str(), 0600), 0); }
  std::string fifo() const { return dir.file("fifo"); }
};

// `-- cohort train ...` with a small fast model: the real jobs below.
std::string train(const std::string& flags) {
  return " -- " + test::cohortBinary() + " train --threads 1 --progress off --model mlp --data synthetic:4000 --batch 16 " +
         flags;
}

// Stand-ins for a job's processes: sh scripts that speak the launcher channel as cohort does.
std::string script(const std::string& body) { return " -- sh -c '" + body + "'"; }
const std::string kSay = ">&$COHORT_LAUNCH_FD";
// The stand-ins listen on nothing. With a --port the launcher starts every worker at once; without
// one it would wait for rank 0 to tell the port it listens on. A stand-in shard tells one.
const std::string kAnyPort = " --port 29400";
const std::string kShardPort = "echo port 29401 " + kSay + "; ";

TEST(LaunchFaults, ATolerantSchemeGoesOnWithoutALostWorker) {
  FifoDir d;
  auto r = test::runCommand(
      launch("-n 3" + kAnyPort + script("case $RANK in 0) echo fault-policy tolerated " + kSay + "; echo go > " + d.fifo() +
                             ";; 2) read x < " + d.fifo() + "; kill -9 $$;; esac; echo done-$RANK")),
      60);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 2 was killed by signal 9 (SIGKILL); the others go on without it"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("cohort launch: the job finished without rank 2\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0] done-0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] done-1"), std::string::npos) << r.output;
}

// The same job without the chief's word is synchronous: the lost worker stops everyone.
TEST(LaunchFaults, WithoutTheChiefsWordALostWorkerStopsTheGroup) {
  FifoDir d;
  auto r = test::runCommand(
      launch("-n 3" + kAnyPort + script("case $RANK in 0) echo go > " + d.fifo() + "; exec sleep 60;; 2) read x < " + d.fifo() +
                             "; kill -9 $$;; *) exec sleep 60;; esac")),
      60);
  EXPECT_EQ(r.exitCode, 137) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 2 was killed by signal 9 (SIGKILL)\n"), std::string::npos) << r.output;
}

TEST(LaunchFaults, TheChiefsFailureEndsATolerantJobSayingWhy) {
  auto r = test::runCommand(
      launch("-n 2" + kAnyPort + script("if [ $RANK = 0 ]; then echo fault-policy rejoins " + kSay +
                             "; echo \"error the shards are gone\" " + kSay + "; exit 3; fi; exec sleep 60")),
      60);
  EXPECT_EQ(r.exitCode, 3) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 0 exited with status 3: the shards are gone; the job cannot go on "
                          "without its chief\n"),
            std::string::npos)
      << r.output;
}

// A shard that does not end by itself once the workers are done (the library's
// serveParameterServerShard leaves SIGTERM to its process) is stopped after the grace period, and
// its death by that SIGTERM is the end the launcher asked for, not a failure.
TEST(LaunchFaults, AShardStoppedByTheLauncherAfterTheWorkersIsNoFailure) {
  auto r = test::runCommand(
      launch("-n 1 --ps 1 --grace 1" + kAnyPort + script("if [ -z \"$RANK\" ]; then " + kShardPort +
                                                          "exec sleep 60; fi; echo worker-done")),
      60);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("worker-done"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("killed by signal"), std::string::npos) << r.output;
}

TEST(LaunchFaults, AShardWithoutCheckpointsEndsTheJob) {
  FifoDir d;
  auto r = test::runCommand(
      launch("-n 2 --ps 1" + kAnyPort + script("if [ -z \"$RANK\" ]; then " + kShardPort + "read x < " + d.fifo() + "; exit 5; fi; if [ $RANK = 0 ]; "
                                    "then echo fault-policy rejoins " + kSay + "; echo go > " + d.fifo() +
                                    "; fi; exec sleep 60")),
      60);
  EXPECT_EQ(r.exitCode, 5) << r.output;
  EXPECT_NE(r.output.find("cohort launch: ps 0 exited with status 5; the workers cannot go on without it and it has "
                          "no checkpoint to restart from (--checkpoint-dir)\n"),
            std::string::npos)
      << r.output;
}

// Rank 0 stays until the restarted shard says it is back (the second fifo): with every worker
// finished, the launcher would rightly not restart the shard, and a run where both workers ended
// before the shard's exit 5 failed so.
TEST(LaunchFaults, AShardThatCheckpointsIsRestartedAlone) {
  FifoDir d, back;
  auto r = test::runCommand(
      launch("-n 2 --ps 1 --max-restarts 1" + kAnyPort +
             script("if [ -z \"$RANK\" ]; then " + kShardPort + "echo shard-checkpoints " + kSay +
                    "; echo shard-has-checkpoint " + kSay +
                    "; if [ $COHORT_RESTART_COUNT = 0 ]; "
                    "then read x < " +
                    d.fifo() +
                    "; exit 5; fi; echo shard-back-$COHORT_RESTART_COUNT-alone-$COHORT_RESTARTED_ALONE; "
                    "echo back > " +
                    back.fifo() +
                    "; exit 0; fi; "
                    "if [ $RANK = 0 ]; then echo fault-policy rejoins " +
                    kSay + "; echo go > " + d.fifo() + "; read y < " + back.fifo() +
                    "; fi; echo worker-$RANK-run-$COHORT_RESTART_COUNT")),
      60);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: ps 0 exited with status 5; starting it again alone (restart 1 of 1)\n"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[ps 0] shard-back-1-alone-1\n"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "-run-"), 2u) << "the workers ran once each\n" << r.output;
}

// A shard that fails once the workers are done (here when the launcher stops it) is not restarted:
// the restarted one served no one and was never stopped, so the job did not end.
TEST(LaunchFaults, AShardFailingAfterTheWorkersIsNotRestarted) {
  auto r = test::runCommand(launch("-n 1 --ps 1 --grace 1 --max-restarts 1" + kAnyPort +
                                   script("if [ -z \"$RANK\" ]; then " + kShardPort + "echo shard-checkpoints " + kSay +
                                          "; echo shard-has-checkpoint " + kSay +
                                          "; echo shard-run-$COHORT_RESTART_COUNT; "
                                          "trap \"exit 5\" TERM; sleep 60 & wait; exit 0; fi; echo worker-done")),
                            50);
  EXPECT_EQ(r.exitCode, 5) << r.output;
  EXPECT_NE(
      r.output.find("cohort launch: ps 0 exited with status 5; every worker had finished, so it is not restarted"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("shard-run-1"), std::string::npos) << r.output;
}

// A process that refuses its input (status 2) is not restarted: the restart, which resumes, took
// up an earlier run's checkpoints that the new run had been refused beside, and exited 0.
TEST(LaunchFaults, ARefusedInputIsNotRestarted) {
  test::TempDir dir;
  const std::string train = test::cohortBinary() +
                            " train --model mlp --data synthetic:200 --batch 8 --threads 1 --progress off "
                            "--checkpoint-every 5 --checkpoint-dir " +
                            dir.path();
  auto earlier = test::runCommand(train + " --steps 20", 120);
  ASSERT_EQ(earlier.exitCode, 0) << earlier.output;
  auto r = test::runCommand(launch("-n 1 --max-restarts 1 -- " + train + " --steps 10"), 120);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("it refused its input, which a restart would not change: not restarted"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
}

// A synchronous job restarted: every process again, told it is a restart, and rank 1 is given the
// port rank 0 tells in the new run (a listener binds port 0 afresh: here 30000 + the run).
TEST(LaunchFaults, AFailedGroupIsRestartedOnANewPort) {
  auto r = test::runCommand(
      launch("-n 2 --max-restarts 2" +
             script("if [ $RANK = 0 ]; then echo port $((30000 + COHORT_RESTART_COUNT)) " + kSay + "; fi; "
                    "echo run $RANK $COHORT_RESTART_COUNT $MASTER_PORT; if [ $RANK = 1 ] && [ $COHORT_RESTART_COUNT = 0 ]; "
                    "then exit 4; fi; [ $COHORT_RESTART_COUNT = 1 ] || exec sleep 60")),
      60);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 1 exited with status 4; restarting every process from the newest "
                          "checkpoint (restart 1 of 2)\n"),
            std::string::npos)
      << r.output;
  // Rank 0 is started with port 0 (it binds one of its choosing); rank 1 with the port it told.
  EXPECT_NE(r.output.find("[rank 0] run 0 0 0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] run 1 0 30000\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0] run 0 1 0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] run 1 1 30001\n"), std::string::npos) << r.output;
}

TEST(LaunchFaults, WhenTheRestartsRunOutTheJobEndsWithTheFailure) {
  auto r = test::runCommand(
      launch("-n 2 --max-restarts 1" + kAnyPort + script("if [ $RANK = 1 ]; then exit 4; fi; exec sleep 60")), 60);
  EXPECT_EQ(r.exitCode, 4) << r.output;
  EXPECT_EQ(count(r.output, "restarting every process"), 1u) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 1 exited with status 4 (all 1 restarts used)\n"), std::string::npos)
      << r.output;
}

// A process that said "finished" (its run is recorded; its final checkpoint failed) is not
// restarted, restarts or not: the job ends with its status and the launcher says why.
TEST(LaunchFaults, AFinishedRunThatFailsIsNotRestarted) {
  auto r = test::runCommand(
      launch("-n 2 --max-restarts 2" + kAnyPort +
             script("echo run-$RANK-$COHORT_RESTART_COUNT; if [ $RANK = 0 ]; then echo finished " + kSay +
                    "; echo \"error the final checkpoint could not be written\" " + kSay + "; exit 1; fi")),
      60);
  EXPECT_EQ(r.exitCode, 1) << r.output;
  EXPECT_EQ(count(r.output, "restarting every process"), 0u) << r.output;
  EXPECT_EQ(count(r.output, "[rank 0] run-0-"), 1u) << "rank 0 ran once\n" << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 0 exited with status 1: the final checkpoint could not be written; it "
                          "had finished its run (its done event is written): not restarted, a restart would fail the "
                          "same way\n"),
            std::string::npos)
      << r.output;
}

TEST(LaunchFaults, TooManyProcessesAreRefusedBeforeAnyIsForked) {
  auto r = test::runCommand(launch("-n 100000 -- echo forked"), 30);
  EXPECT_EQ(r.exitCode, 2) << r.output.substr(0, 2000);
  EXPECT_EQ(r.output.find("forked"), std::string::npos) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find("cohort: error: -n 100000 with --ps 0 is 100000 processes, more than "), std::string::npos)
      << r.output;
  r = test::runCommand(launch("-n 2 --max-restarts -1 -- true"), 30);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("--max-restarts must not be negative"), std::string::npos) << r.output;
}

// Under `ulimit -n 64` (soft and hard) -n 30 passed the check, started 19 ranks and failed at the
// 20th ("cannot create a pipe: Too many open files"): the open-file limit caps the job up front.
TEST(LaunchFaults, TheOpenFileLimitCapsTheJobBeforeAnyIsForked) {
  auto r = test::runCommand("sh -c 'ulimit -n 64 && exec " + launch("-n 30 -- echo forked") + "'", 30);
  EXPECT_EQ(r.exitCode, 2) << r.output.substr(0, 2000);
  EXPECT_EQ(r.output.find("forked"), std::string::npos) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find("-n 30 with --ps 0 is 30 processes, more than 13 (3 pipes a process under this user's "
                          "open-file limit, RLIMIT_NOFILE = 64 (ulimit -n))"),
            std::string::npos)
      << r.output;
  r = test::runCommand("sh -c 'ulimit -n 64 && exec " + launch("-n 13 -- true") + "'", 60);
  EXPECT_EQ(r.exitCode, 0) << r.output.substr(0, 2000);
  // Raised only as far as the job needs (2 ranks: 24 + 6), so the children see about their own.
  r = test::runCommand("sh -c 'ulimit -Sn 20 && exec " + launch("-n 2 -- sh -c \"ulimit -Sn\"") + "'", 60);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] 30\n"), std::string::npos) << r.output;
}

// TF_CONFIG's addresses are host:port, an IPv6 host in brackets; the launcher's own reader takes
// them back (cohort train resolves the cluster and prints nothing else).
TEST(LaunchFaults, AnIpv6HostIsBracketedInTfConfig) {
  auto r = test::runCommand(launch("--host ::1 -n 2 --ps 1" + script("echo \"$TF_CONFIG\"")), 60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const std::regex line(R"(\[(rank|ps) \d\] (.*))");
  int seen = 0;
  for (const auto& l : test::lines(r.output)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(l, m, line)) << l;
    const auto config = nlohmann::json::parse(m[2].str());
    for (const auto& address : {config["cluster"]["chief"][0], config["cluster"]["worker"][0], config["cluster"]["ps"][0]}) {
      EXPECT_TRUE(std::regex_match(address.get<std::string>(), std::regex(R"(\[::1\]:\d+)"))) << address;
    }
    ++seen;
  }
  EXPECT_EQ(seen, 3) << r.output;
}

// cohort train reads the bracketed addresses back: a ps job on ::1 runs to its end.
TEST(LaunchFaults, APsJobRunsOnIpv6Loopback) {
  auto r = test::runCommand(launch("--host ::1 -n 2 --ps 1" + train("--strategy ps --steps 5 --timeout 30")), 120);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] done: 5 steps"), std::string::npos) << r.output;
}

// A gossip job on a non-loopback IPv6 address (fd00::5 on the loopback device of a private network
// namespace: unshare -n, as root) trains as one group: each peer listens on the family of the
// address it publishes. It listened on 0.0.0.0 while publishing fd00::5: every stream was refused,
// each peer lost the other after --timeout and trained alone, and the job exited 0.
TEST(LaunchFaults, AGossipJobOnANonLoopbackIpv6HostTrainsAsOneGroup) {
  test::TempDir dir;
  const std::string up = "ip link set lo up && ip -6 addr add fd00::5/128 dev lo nodad";
  auto probe = test::runCommand("unshare -n sh -c '" + up + " && echo ready'", 30);
  ASSERT_NE(probe.output.find("ready"), std::string::npos)
      << "this test adds an IPv6 address in a private network namespace (unshare -n), which needs root:\n"
      << probe.output;
  auto r = test::runCommand("unshare -n sh -c '" + up + " && " +
                                launch("--host fd00::5 -n 2" + train("--strategy gossip --steps 60 --timeout 8 "
                                                                     "--metrics " +
                                                                     dir.file("m.jsonl"))) +
                                "'",
                            120);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(r.output.find("is lost"), std::string::npos) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["workers_lost"].size(), 0u) << done.dump();
  EXPECT_EQ(done["updates_folded"], 2 * 60) << "rank 1's steps did not all reach the chief: " << done.dump();
}

// A gossip peer restarted alone (Kubernetes' restartPolicy OnFailure restarts a failed pod by
// itself; here rank 1's script runs it again after it killed itself at step 20) is refused at
// attach: the others hold a stream from its rank and would refuse it, so it trained alone from the
// step-0 parameters and exited 0. The job must restart whole, with --resume.
TEST(LaunchFaults, AGossipPeerRestartedAloneIsRefusedAtAttach) {
  const std::string run = test::cohortBinary() +
                          " train --threads 1 --progress off --model mlp --data synthetic:4000 --batch 16 --strategy "
                          "gossip --steps 300 --timeout 10 --test-slow-worker 0:0.03";
  auto r = test::runCommand(
      launch("-n 2" + script(run + " --test-kill-at 1:20; if [ $RANK = 1 ]; then exec " + run + "; fi")), 120);
  EXPECT_NE(r.output.find("[rank 1] cohort: error: gossip: rank 1 joins a group that is already training: a gossip "
                          "peer cannot rejoin a running group; restart the whole job with --resume"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 0] done: 300 steps"), std::string::npos) << r.output;
}

// A gossip peer with another model fails at attach, and the chief at once, naming it and why
// (before: the chief waited out --timeout for its address, "is every worker started?").
TEST(LaunchFaults, AGossipPeerWithAnotherModelStopsTheChiefAtOnce) {
  const std::string run = test::cohortBinary() +
                          " train --threads 1 --progress off --data synthetic:4000 --batch 16 --strategy gossip "
                          "--steps 50 --timeout 30 --model";
  auto r = test::runCommand(
      launch("-n 2" + script("if [ $RANK = 0 ]; then exec " + run + " mlp; else exec " + run + " mlp:64; fi")), 120);
  EXPECT_NE(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 1] cohort: error: gossip: parameter 0 ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0] cohort: error: gossip: rank 1 could not join: gossip: parameter 0 ("),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("did not appear within"), std::string::npos) << r.output;
}

// ---- Real training jobs under the launcher ----

// The asynchronous schemes go on without a worker that dies mid-run: the chief finishes and names it.
class LaunchLosesAWorker : public testing::TestWithParam<std::string> {};

TEST_P(LaunchLosesAWorker, TheOthersFinishAndTheChiefNamesIt) {
  test::TempDir dir;
  const std::string scheme = GetParam() == "gossip" ? "--strategy gossip" : "--strategy ps --ps-mode " + GetParam();
  auto r = test::runCommand(launch(std::string("-n 3") + (GetParam() == "gossip" ? "" : " --ps 1") +
                                   train(scheme + (GetParam() == "ssp" ? " --staleness-bound 2" : "") +
                                         " --timeout 10 --steps 150 --test-kill-at 2:20 "
                                         "--metrics " +
                                         dir.file("m.jsonl"))),
                            180);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 2 was killed by signal 9 (SIGKILL); the others go on without it"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("cohort launch: the job finished without rank 2\n"), std::string::npos) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 150);
  ASSERT_EQ(done["workers_lost"].size(), 1u) << done.dump();
  EXPECT_EQ(done["workers_lost"][0], 2);
}

INSTANTIATE_TEST_SUITE_P(Schemes, LaunchLosesAWorker, testing::Values("async", "ssp", "gossip"));

// ps sync with a backup worker loses one of 3: the chief ends first and waits in finish while
// worker 1, slowed, is behind (its pushes were the late third of each step while all 3 ran, so
// its clock is behind the chief's). Its remaining steps close without the waiting chief; before,
// they waited for the chief's gradient and the chief's end wait ran out (status 1).
TEST(LaunchLosesAWorker, PsSyncWithABackupWorkerFinishesWhenTheChiefEndsFirst) {
  test::TempDir dir;
  auto r = test::runCommand(
      launch("-n 3 --ps 1" + train("--strategy ps --ps-mode sync --backup-workers 1 --timeout 5 --steps 100 "
                                   "--test-slow-worker 1:0.05 --test-kill-at 2:20 --metrics " + dir.file("m.jsonl"))),
      180);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 2 was killed by signal 9 (SIGKILL); the others go on without it"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("did not finish within"), std::string::npos) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 100);
  ASSERT_EQ(done["workers_lost"].size(), 1u) << done.dump();
  EXPECT_EQ(done["workers_lost"][0], 2);
}

// allreduce loses a rank: the group restarts and resumes from its newest checkpoint by itself.
TEST(LaunchRestarts, AnAllreduceJobResumesFromItsCheckpoint) {
  test::TempDir dir;
  auto r = test::runCommand(launch("-n 2 --max-restarts 1" +
                                   train("--strategy allreduce --steps 60 --checkpoint-every 20 --checkpoint-dir " +
                                         dir.file("ckpt") + " --test-kill-at 1:30 --metrics " + dir.file("m.jsonl"))),
                            180);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 1 was killed by signal 9 (SIGKILL); restarting every process from the "
                          "newest checkpoint (restart 1 of 1)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 0] cohort: resumed from "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(step 20, "), std::string::npos) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 60);
  EXPECT_EQ(done["restarts"], 1);
}

// gossip loses its chief: the group restarts, and every peer resumes from the chief's newest
// checkpoint (its step, optimizer state and sampler position), not from scratch.
TEST(LaunchRestarts, AGossipGroupResumesFromTheChiefsCheckpoint) {
  test::TempDir dir;
  auto r = test::runCommand(launch("-n 2 --max-restarts 1" +
                                   train("--strategy gossip --timeout 20 --steps 60 --checkpoint-every 20 "
                                         "--checkpoint-dir " + dir.file("ckpt") + " --test-kill-at 0:30 --metrics " +
                                         dir.file("m.jsonl"))),
                            180);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 0 was killed by signal 9 (SIGKILL); restarting every process from the "
                          "newest checkpoint (restart 1 of 1)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 0] cohort: resumed from " + dir.file("ckpt") + "/ckpt-0000000020.ckpt (step 20, "),
            std::string::npos)
      << r.output;
  // The chief's step events: 1..29 from the first run (it died at step 30, before writing it);
  // the restarted run, which begins after the checkpoint's step, drops 21..29 and writes them
  // again: every step once.
  EXPECT_NE(r.output.find("[rank 0] cohort: --metrics " + dir.file("m.jsonl") + ": 9 lines past step 20 dropped"),
            std::string::npos)
      << r.output;
  std::vector<int64_t> steps;
  for (const auto& line : test::lines(test::readFile(dir.file("m.jsonl")))) {
    const auto event = nlohmann::json::parse(line);
    if (event["event"] == "step") steps.push_back(event["step"].get<int64_t>());
  }
  std::vector<int64_t> once(60);
  std::iota(once.begin(), once.end(), 1);
  EXPECT_EQ(steps, once);
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 60);
  EXPECT_EQ(done["restarts"], 1);
  EXPECT_EQ(done["workers_lost"].size(), 0u) << done.dump();
  // Rank 1 resumed at the chief's step too: it took the 40 steps left in the restarted run, not 60
  // (the chief folded 40 of its own and 40 of rank 1's), and each peer's steps count from the
  // checkpoint's step 20, as the chief's do.
  EXPECT_EQ(done["updates_folded"], 2 * 40) << done.dump();
  EXPECT_EQ(done["peer_steps"], nlohmann::json::array({60, 60})) << done.dump();
}

// In the asynchronous ps modes a dead worker is restarted alone and takes up its clock.
TEST(LaunchRestarts, AnAsyncPsWorkerRejoinsAtItsClock) {
  test::TempDir dir;
  auto r = test::runCommand(launch("-n 3 --ps 1 --max-restarts 1" +
                                   train("--strategy ps --ps-mode async --timeout 20 --steps 150 --test-kill-at 2:40 "
                                         "--metrics " + dir.file("m.jsonl"))),
                            180);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 2 was killed by signal 9 (SIGKILL); starting it again alone (restart 1 "
                          "of 1)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 2] cohort: resumed from the parameter servers at step 40"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("finished without"), std::string::npos) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["workers_lost"].size(), 0u) << done.dump();
  EXPECT_EQ(done["restarts"], 0) << "the chief itself was not restarted";
}

// A shard killed before its first checkpoint has nothing to restore: restarted alone it would wait
// for a chief's Init that never comes (every worker failing after --timeout). The launcher restarts
// the group instead, which starts afresh here (no checkpoint anywhere yet) and finishes.
TEST(LaunchRestarts, AShardKilledBeforeItsFirstCheckpointRestartsTheGroup) {
  test::TempDir dir;
  // --checkpoint-every 0: the shard writes only its final checkpoint; it kills itself at version 15.
  auto r = test::runCommand("env COHORT_TEST_KILL_SHARD_AT=15 " +
                                launch("-n 2 --ps 1 --max-restarts 1" +
                                       train("--strategy ps --ps-mode softsync --softsync 2 --timeout 20 --steps 60 "
                                             "--checkpoint-every 0 --checkpoint-dir " + dir.file("ckpt") +
                                             " --metrics " + dir.file("m.jsonl"))),
                            180);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("cohort launch: ps 0 was killed by signal 9 (SIGKILL); shard 0 restarted with no checkpoint "
                          "to restore: restarting the group"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("starting it again alone"), std::string::npos) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["restarts"], 1) << done.dump();
}

// --target-accuracy stops every worker and shard, in the schemes without a collective too: the
// others stop at their next step instead of running on to their last (allreduce, average: at the
// step's collective, not hanging in it).
class TargetStopsEveryone : public testing::TestWithParam<std::string> {};

TEST_P(TargetStopsEveryone, NoOneRunsOnOrWaitsOutTheTimeout) {
  test::TempDir dir;
  const bool gossip = GetParam() == "gossip";
  const bool ps = GetParam() == "sync" || GetParam() == "async" || GetParam() == "ssp";
  const std::string scheme = ps ? "--strategy ps --ps-mode " + GetParam()
                                : "--strategy " + GetParam() + (GetParam() == "average" ? " --period 4" : "");
  auto r = test::runCommand(launch(std::string("-n 3") + (ps ? " --ps 1" : "") +
                                   train(scheme + (GetParam() == "ssp" ? " --staleness-bound 2" : "") +
                                         " --timeout 60 --steps 100000 --eval-every 20 "
                                         "--target-accuracy 0.3 --metrics " +
                                         dir.file("m.jsonl"))),
                            110);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  ASSERT_TRUE(done.contains("seconds_to_target")) << done.dump();
  EXPECT_LT(done["steps"].get<int64_t>(), 100000);
  EXPECT_LT(done["wall_s"].get<double>(), 60) << "the chief waited for the others";
  if (gossip) {
    for (int peer = 1; peer < 3; ++peer) EXPECT_LT(done["peer_steps"][peer].get<int64_t>(), 100000) << done.dump();
  } else if (ps) {
    EXPECT_LT(done["gradients_applied"].get<int64_t>(), 3 * 100000) << done.dump();
  }
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Schemes, TargetStopsEveryone,
                         testing::Values("sync", "async", "ssp", "gossip", "allreduce", "average"));

// A diverging allreduce job: every rank reports the non-finite loss with its cause (not "lost
// rank k"), and the launcher's line about the first exit carries it.
TEST(LaunchFaults, ANonFiniteLossIsReportedByEveryRankWithItsCause) {
  auto r = test::runCommand(launch("-n 2" + train("--strategy allreduce --lr 1e6 --steps 50")), 120);
  EXPECT_EQ(r.exitCode, 1) << r.output;
  for (const std::string rank : {"0", "1"}) {
    EXPECT_TRUE(std::regex_search(r.output, std::regex("\\[rank " + rank + "\\] cohort: error: the loss became -?nan at step "
                                                       "\\d+ on rank " + rank + " .*training diverged; lower --lr")))
        << r.output;
  }
  EXPECT_TRUE(std::regex_search(r.output, std::regex("cohort launch: rank \\d exited with status 1: the loss became")))
      << r.output;
  EXPECT_EQ(r.output.find("lost rank"), std::string::npos) << r.output;
}

// Non-finite values that came from a peer: rank 1's inputs of step 4 are NaN (--test-nan-at), so
// its parameters are, and --period 4 averages them into rank 0's at that step. Rank 0's loss was
// finite at step 4 and is NaN at step 5: its error names the last update, which holds the other
// workers' parameters, as the cause, not divergence.
TEST(LaunchFaults, ANonFiniteLossFromAPeerNamesTheLastUpdate) {
  auto r = test::runCommand(launch("-n 2" + train("--strategy average --period 4 --steps 50 --test-nan-at 1:4")), 120);
  EXPECT_EQ(r.exitCode, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("\\[rank 0\\] cohort: error: the loss became -?nan at step 5 on rank 0 "
                                                     "after a finite loss of \\S+ at step 4: the last update \\(which "
                                                     "holds the other workers' contributions under --strategy average\\) "
                                                     "brought non-finite values")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("\\[rank 1\\] cohort: error: the loss became -?nan at step 4 on rank 1 ")))
      << r.output;
  EXPECT_EQ(r.output.find("training diverged"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("lost rank"), std::string::npos) << r.output;
}

// A final checkpoint on a full disk: the run's result still reaches the done event, the error names
// the directory and the cause, and the previous checkpoint is kept. The disk is a tmpfs in a private
// mount namespace (unshare -m, as root) sized between one and two checkpoints: the one at step 4
// fits, the final one at step 8 does not (older ones are removed only after a save succeeded).
TEST(DiskFull, TheFinalCheckpointFailsLoudlyAfterTheDoneEvent) {
  test::TempDir dir;
  const std::string disk = dir.file("disk");
  std::filesystem::create_directories(disk);
  auto probe = test::runCommand("unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs " + disk + " && echo mounted'", 30);
  ASSERT_NE(probe.output.find("mounted"), std::string::npos)
      << "this test mounts a small tmpfs in a private mount namespace (unshare -m), which needs root:\n"
      << probe.output;
  const std::string train = test::cohortBinary() +
                            " train --threads 1 --progress off --model mlp --data synthetic:4000 --batch 16 --steps 8";
  // How large one checkpoint of this run is.
  auto sized = test::runCommand(train + " --checkpoint-dir " + dir.file("sized"), 120);
  ASSERT_EQ(sized.exitCode, 0) << sized.output;
  uintmax_t bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.file("sized"))) {
    if (e.path().extension() == ".ckpt") bytes = e.file_size();
  }
  ASSERT_GT(bytes, 0u) << sized.output;
  const std::string size = std::to_string((bytes * 3 / 2) / 1024 + 1) + "k";
  auto r = test::runCommand("unshare -m sh -c 'mount -t tmpfs -o size=" + size + " tmpfs " + disk + " && " + train +
                                " --checkpoint-every 4 --checkpoint-dir " + disk + " --metrics " + dir.file("m.jsonl") +
                                "; echo exit=$?; ls " + disk + "'",
                            120);
  EXPECT_NE(r.output.find("exit=1"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("cohort: error: the final checkpoint \\(step 8\\) could not be "
                                                     "written to " + disk + ": .*No space left on device")))
      << r.output;
  EXPECT_NE(r.output.find("the newest checkpoint kept there is " + disk + "/ckpt-0000000004.ckpt (step 4)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\nckpt-0000000004.ckpt\n"), std::string::npos) << "the step-4 checkpoint is gone\n" << r.output;
  const auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 8);
  EXPECT_TRUE(done["test_accuracy"].is_number()) << done.dump();
  EXPECT_NE(done.value("final_checkpoint_error", "").find("No space left on device"), std::string::npos) << done.dump();
}

// The same under `cohort launch --max-restarts 1` with allreduce, on a disk too small for any
// checkpoint: the periodic ones fail and training goes on; the final one fails after the done
// event, and the launcher ends the job with that failure instead of training again from scratch.
TEST(DiskFull, UnderLaunchTheJobEndsWithTheErrorAndIsNotRestarted) {
  test::TempDir dir;
  const std::string disk = dir.file("disk");
  std::filesystem::create_directories(disk);
  auto r = test::runCommand("unshare -m sh -c 'mount -t tmpfs -o size=4k tmpfs " + disk + " && " +
                                test::cohortBinary() + " launch -n 2 --max-restarts 1" +
                                train("--strategy allreduce --steps 8 --checkpoint-every 4 --checkpoint-dir " + disk +
                                      " --metrics " + dir.file("m.jsonl")) +
                                "; echo exit=$?'",
                            120);
  EXPECT_NE(r.output.find("exit=1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checkpoint failed, training goes on"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "restarting every process"), 0u) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("cohort launch: rank 0 exited with status 1: the final checkpoint "
                                                     "\\(step 8\\) could not be written to " + disk +
                                                     ": .*No space left on device.*; it had finished its run")))
      << r.output;
  const auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 8);
  EXPECT_NE(done.value("final_checkpoint_error", "").find("no earlier checkpoint is there"), std::string::npos)
      << done.dump();
}

// The same under ps: the shards write the checkpoints, and a shard's final one on a full disk ends
// the job with its status, naming the shard, the directory and the cause, instead of a warning in
// the shard's log and exit 0. The chief's done event is written and carries the error; the shard
// and the chief both said "finished", so --max-restarts does not train again onto the same disk.
TEST(DiskFull, AShardsFinalCheckpointEndsThePsJobWithTheErrorAndIsNotRestarted) {
  test::TempDir dir;
  const std::string disk = dir.file("disk");
  std::filesystem::create_directories(disk);
  auto r = test::runCommand("unshare -m sh -c 'mount -t tmpfs -o size=4k tmpfs " + disk + " && " +
                                test::cohortBinary() + " launch -n 2 --ps 1 --max-restarts 1" +
                                train("--strategy ps --ps-mode async --timeout 30 --steps 8 --checkpoint-every 4 "
                                      "--checkpoint-dir " + disk + " --metrics " + dir.file("m.jsonl")) +
                                "; echo exit=$?'",
                            120);
  EXPECT_NE(r.output.find("exit=1"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "restarting every process"), 0u) << r.output;
  EXPECT_EQ(count(r.output, "starting it again alone"), 0u) << r.output;
  // The launcher's one line: whichever of the chief and the shard exits first, it names the shard,
  // its directory and the errno text.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("cohort launch: (rank 0|ps 0) exited with status 1: ps 0: the "
                                                     "final checkpoint \\(version \\d+\\) could not be written to " +
                                                     disk + "/ps-0: .*No space left on device.*; it had finished "
                                                     "its run")))
      << r.output;
  EXPECT_NE(r.output.find("[ps 0] cohort ps: error: ps 0: the final checkpoint"), std::string::npos) << r.output;
  const auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 8);
  EXPECT_NE(done.value("final_checkpoint_error", "").find("ps 0: the final checkpoint"), std::string::npos)
      << done.dump();
  EXPECT_NE(done.value("final_checkpoint_error", "").find("No space left on device"), std::string::npos) << done.dump();
  ASSERT_EQ(done["ps_checkpoints_failed"].size(), 1u) << done.dump();
  EXPECT_GE(done["ps_checkpoints_failed"][0].get<int64_t>(), 1) << done.dump();
}

// Input that used to slip through: refused with the bound or the reason, before anything starts.
TEST(BadInput, IsRefusedWithTheReason) {
  const std::string base = test::cohortBinary() + " train --model mlp --data synthetic:200 --steps 2 --progress off ";
  auto expect = [&](const std::string& flags, const std::string& needle) {
    auto r = test::runCommand(base + flags, 60);
    EXPECT_EQ(r.exitCode, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << flags << "\n" << r.output;
  };
  expect("--lr inf", "--lr must be a positive number, got inf");
  expect("--lr nan", "--lr must be a positive number");
  expect("--timeout inf", "--timeout must be a number of seconds in (0, 604800]");
  expect("--timeout 1e300", "--timeout must be a number of seconds in (0, 604800]");
  expect("--threads 100000", "--threads must be in 0..");
  expect("--strategy pipeline --codec fp16", "--codec fp16 applies to allreduce, average, ps and gossip");
}

}  // namespace
}  // namespace cohort
