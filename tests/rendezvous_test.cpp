// The job's rendezvous refuses what cannot form a job (comm/rank_claim.h): a rank two processes
// claim, a world size that differs from the chief's. Real `cohort train` processes on loopback,
// started as a launcher would with torchrun's variables; and the gossip scheme's Rendezvous with
// ranks as threads.
#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/rendezvous.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <future>
#include <string>
#include <thread>

#include "test_util.h"

namespace cohort::rendezvous_test {
namespace {

// A worker of a job of `world` on the chief's `port` (0: the chief, which takes a free one and tells
// it). exec: the process's pid is the one the test started, which the messages name.
std::string worker(int rank, int world, int port) {
  return "exec env MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " WORLD_SIZE=" + std::to_string(world) +
         " RANK=" + std::to_string(rank) + " " + test::cohortBinary() +
         " train --model mlp --data synthetic:600 --batch 32 --strategy allreduce --threads 1 --progress off"
         " --steps 4 --timeout 30";
}

std::string hostName() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

// Two processes given RANK=1 in a job of 3 (a launch line copied without changing RANK; rank 2
// never comes): the second is refused when it claims the rank, naming both processes, and the
// chief and the first, waiting for their group, fail with the same line instead of waiting out the
// timeout for rank 2 (where they said "rank 2 did not give its Gloo address" or that the store's
// connection closed).
TEST(Rendezvous, TwoProcessesOfOneRankEndTheJobNamingBoth) {
  test::Process chief(worker(0, 3, 0));
  const int port = chief.port();
  ASSERT_GT(port, 0) << chief.output();
  test::Process first(worker(1, 3, port));
  test::Process second(worker(1, 3, port));
  const std::string claimed = "rank 1 is claimed by two processes, pid ";
  const std::string fix = ": give each process of the job its own RANK, 0 to 2";
  const std::string pids[2] = {"pid " + std::to_string(first.pid()) + " on host " + hostName(),
                               "pid " + std::to_string(second.pid()) + " on host " + hostName()};
  for (test::Process* p : {&chief, &first, &second}) {
    const test::CommandResult r = p->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exitCode, 2) << r.output;
    EXPECT_NE(r.output.find(claimed), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(fix), std::string::npos) << r.output;
    // Both processes, in the order they claimed the rank (which the test does not choose).
    const bool named = r.output.find(pids[0] + " and then " + pids[1]) != std::string::npos ||
                       r.output.find(pids[1] + " and then " + pids[0]) != std::string::npos;
    EXPECT_TRUE(named) << r.output;
  }
}

// Two processes given RANK=0 on one host: the second finds the first's store on the port. It is
// refused naming both (it said "another job uses the port"), and the chief fails with the same
// line instead of waiting out the timeout for the ranks that never come.
TEST(Rendezvous, TwoChiefsOnOneHostEndTheJobNamingBoth) {
  const test::ReservedPort reserved;  // held, not listening: the first chief binds it after
  test::Process first(worker(0, 3, reserved.port()));
  ASSERT_EQ(first.port(), reserved.port()) << first.output();  // it listens
  test::Process second(worker(0, 3, reserved.port()));
  const std::string line = "rank 0 is claimed by two processes, pid " + std::to_string(first.pid()) + " on host " +
                           hostName() + " and then pid " + std::to_string(second.pid()) + " on host " + hostName() +
                           ": give each process of the job its own RANK, 0 to 2";
  for (test::Process* p : {&first, &second}) {
    const test::CommandResult r = p->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exitCode, 2) << r.output;
    EXPECT_NE(r.output.find(line), std::string::npos) << r.output;
  }
}

// A worker started with WORLD_SIZE=3 in the chief's job of 2: it is refused before it writes
// anything the chief reads, and the chief fails with the same line (both sizes, both processes;
// the chief came first, and every process is compared with the first).
TEST(Rendezvous, AWorldSizeThatIsNotTheChiefsEndsTheJob) {
  test::Process chief(worker(0, 2, 0));
  const int port = chief.port();
  ASSERT_GT(port, 0) << chief.output();
  test::Process other(worker(1, 3, port));
  const std::string line = "rank 1 (pid " + std::to_string(other.pid()) + " on host " + hostName() +
                           ") has a world size of 3, rank 0 (pid " + std::to_string(chief.pid()) + " on host " +
                           hostName() + ") 2: give every process of the job the same WORLD_SIZE";
  for (test::Process* p : {&chief, &other}) {
    const test::CommandResult r = p->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exitCode, 2) << r.output;
    EXPECT_NE(r.output.find(line), std::string::npos) << r.output;
  }
}

// The gossip scheme's Rendezvous (ranks as threads): a second claimant of rank 1 is refused at
// connect, and the chief, waiting for a key, fails with its line instead of the timeout.
TEST(Rendezvous, TheGossipRendezvousRefusesARankClaimedTwice) {
  const test::ReservedPort reserved;  // held, not listening: the chief's store binds it after
  const int port = reserved.port();
  std::promise<void> chiefUp;
  std::string chiefError;
  std::unique_ptr<Rendezvous> chief;
  std::thread host([&] {
    try {
      chief = Rendezvous::connect(ClusterSpec{.rank = 0, .worldSize = 3, .master = {"127.0.0.1", port}},
                                  std::chrono::seconds(30));
      chiefUp.set_value();
      chief->get("never set");
    } catch (const std::exception& e) {
      chiefError = e.what();
    }
  });
  (void)chiefUp.get_future().wait_for(std::chrono::seconds(30));
  const ClusterSpec rankOne{.rank = 1, .worldSize = 3, .master = {"127.0.0.1", port}};
  const std::unique_ptr<Rendezvous> first = Rendezvous::connect(rankOne, std::chrono::seconds(30));
  std::string secondError;
  try {
    Rendezvous::connect(rankOne, std::chrono::seconds(30));
  } catch (const InvalidArgument& e) {
    secondError = e.what();
  }
  host.join();
  const std::string line = "rank 1 is claimed by two processes, pid " + std::to_string(::getpid());
  EXPECT_NE(secondError.find(line), std::string::npos) << secondError;
  EXPECT_NE(chiefError.find(line), std::string::npos) << chiefError;
}

// The chief of a job of 2 whose rank 1 never comes: the error names rank 1, where it gave Gloo's
// "keys did not appear within 2 s", which names no rank.
TEST(Rendezvous, AChiefWhosePeerNeverComesNamesIt) {
  try {
    Communicator::connect(ClusterSpec{.rank = 0, .worldSize = 2, .master = {"127.0.0.1", 0}},
                          {.timeout = std::chrono::seconds(2)});
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 did not give its Gloo address within 2 s: is every worker started"),
              std::string::npos)
        << e.what();
  }
}

// A worker given another COHORT_AUTH_TOKEN than the chief's: the worker is refused and says why;
// the chief, whose rank 1 never comes, names it and the connection its store refused (it said
// only that Gloo's keys did not appear).
TEST(Rendezvous, AWorkerWithAnotherSecretIsRefusedAndTheChiefSaysSo) {
  const auto timeout = std::chrono::seconds(3);
  std::promise<int> listening;
  std::string chiefError;
  std::thread chief([&] {
    try {
      Communicator::connect(
          ClusterSpec{.rank = 0, .worldSize = 2, .master = {"127.0.0.1", 0}, .secret = "the chief's secret"},
          {.timeout = timeout, .onListening = [&](int port) { listening.set_value(port); }});
    } catch (const std::exception& e) {
      chiefError = e.what();
    }
  });
  std::future<int> port = listening.get_future();
  ASSERT_EQ(port.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  std::string workerError;
  try {
    Communicator::connect(
        ClusterSpec{.rank = 1, .worldSize = 2, .master = {"127.0.0.1", port.get()}, .secret = "another secret"},
        {.timeout = timeout});
  } catch (const CommError& e) {
    workerError = e.what();
  }
  chief.join();
  EXPECT_NE(workerError.find("refused this process's proof of the secret"), std::string::npos) << workerError;
  EXPECT_NE(workerError.find("COHORT_AUTH_TOKEN differs from the chief's"), std::string::npos) << workerError;
  EXPECT_NE(chiefError.find("rank 1 did not give its Gloo address"), std::string::npos) << chiefError;
  EXPECT_NE(chiefError.find("the store refused 1 connection that did not prove the job's secret: is "
                            "COHORT_AUTH_TOKEN the same on every process?"),
            std::string::npos)
      << chiefError;
}

}  // namespace
}  // namespace cohort::rendezvous_test
