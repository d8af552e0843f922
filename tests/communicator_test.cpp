// The Communicator with ranks as threads of one process, over a real TCPStore on 127.0.0.1.
#include <cohort/communicator.h>
#include <cohort/error.h>
#include <cohort/job.h>

#include <torch/torch.h>

#include <optional>
#include <thread>

#include "rank_threads.h"

namespace cohort::communicator_test {
namespace {

// The collectives take a Communicator&; the harness hands out shared pointers.
void onRanks(int world, const std::function<void(Communicator&)>& body) {
  test::onRanks(world, [&](std::shared_ptr<Communicator> comm) { body(*comm); });
}

class CommunicatorTest : public ::testing::TestWithParam<int> {};

TEST_P(CommunicatorTest, AllreduceSums) {
  const int world = GetParam();
  onRanks(world, [&](Communicator& comm) {
    auto t = torch::full({1000}, float(comm.rank() + 1));
    comm.allreduce(t);
    EXPECT_TRUE(torch::all(t == float(world * (world + 1) / 2)).item<bool>());
    if (world > 1) {
      // Ring allreduce: 2 (N-1)/N of the buffer each way.
      EXPECT_EQ(comm.counters().bytesSent, 2 * 4000 * (world - 1) / world);
    }
  });
}

TEST_P(CommunicatorTest, AsyncAllreducesCompleteInOrderOfIssue) {
  const int world = GetParam();
  onRanks(world, [&](Communicator& comm) {
    std::vector<torch::Tensor> ts;
    std::vector<CommWork> works;
    for (int i = 0; i < 5; ++i) {
      ts.push_back(torch::full({100 * (i + 1)}, float(i)));
      works.push_back(comm.allreduceAsync(ts.back()));
    }
    for (auto& w : works) w.wait();
    for (int i = 0; i < 5; ++i) EXPECT_TRUE(torch::all(ts[size_t(i)] == float(i * world)).item<bool>());
  });
}

TEST_P(CommunicatorTest, BroadcastFromAnyRoot) {
  const int world = GetParam();
  onRanks(world, [&](Communicator& comm) {
    const int root = world - 1;
    auto t = comm.rank() == root ? torch::arange(10, torch::kFloat32) : torch::zeros({10});
    comm.broadcast(t, root);
    EXPECT_TRUE(torch::equal(t, torch::arange(10, torch::kFloat32)));
    auto bytes = comm.broadcastBytes(comm.rank() == 0 ? std::vector<uint8_t>{1, 2, 3} : std::vector<uint8_t>{}, 0);
    EXPECT_EQ(bytes, (std::vector<uint8_t>{1, 2, 3}));
  });
}

TEST_P(CommunicatorTest, AllgatherSameAndVariableSizes) {
  const int world = GetParam();
  onRanks(world, [&](Communicator& comm) {
    auto all = comm.allgather(torch::full({3}, comm.rank(), torch::kInt64));
    ASSERT_EQ(int(all.size()), world);
    for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::all(all[size_t(r)] == r).item<bool>());
    // Rank r sends r+1 values (rank 0 one, rank 2 three), and an empty tensor is allowed too.
    auto mine = torch::full({comm.rank() + 1}, float(comm.rank()));
    auto got = comm.allgatherVariable(mine);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(got[size_t(r)].size(0), r + 1);
      EXPECT_TRUE(torch::all(got[size_t(r)] == float(r)).item<bool>());
    }
    auto empty = comm.allgatherVariable(torch::zeros({comm.rank() == 0 ? 0 : 2}));
    EXPECT_EQ(empty[0].size(0), 0);
    comm.barrier();
  });
}

class RingTest : public ::testing::TestWithParam<int> {};

TEST_P(RingTest, SendAndReceiveAroundARing) {
  const int world = GetParam();
  onRanks(world, [&](Communicator& comm) {
    const int next = (comm.rank() + 1) % world;
    const int prev = (comm.rank() + world - 1) % world;
    auto out = torch::full({64}, float(comm.rank()));
    auto in = torch::empty({64});
    auto s = comm.sendAsync(out, next, 7);
    comm.recv(in, prev, 7);
    s.wait();
    EXPECT_TRUE(torch::all(in == float(prev)).item<bool>());
  });
}

// Four ranks as a 2 x 2 grid: groups {0, 2} and {1, 3} reduce alone, point to point in a group
// uses group ranks, and the whole job's group still works beside them.
TEST(Communicator, SplitGroupsWorkSideBySideWithTheJob) {
  onRanks(4, [&](Communicator& comm) {
    const int column = comm.rank() % 2;
    auto group = comm.split({column, column + 2}, "column-" + std::to_string(column));
    EXPECT_EQ(group->worldSize(), 2);
    EXPECT_EQ(group->rank(), comm.rank() / 2);
    auto t = torch::full({10}, float(comm.rank()));
    auto inGroup = group->allreduceAsync(t.clone());
    auto all = torch::ones({3});
    comm.allreduce(all);
    auto sum = t.clone();
    group->allreduce(sum);
    EXPECT_TRUE(torch::all(sum == float(2 * column + 2)).item<bool>());
    EXPECT_TRUE(torch::all(all == 4.0f).item<bool>());
    inGroup.wait();
    auto got = torch::empty({4});
    if (group->rank() == 0) {
      group->send(torch::full({4}, float(comm.rank())), 1, 3);
    } else {
      group->recv(got, 0, 3);
      EXPECT_TRUE(torch::all(got == float(column)).item<bool>());
    }
    EXPECT_THROW(comm.split({(comm.rank() + 1) % 4}, "without me"), InvalidArgument);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CommunicatorTest, ::testing::Values(1, 2, 3));
INSTANTIATE_TEST_SUITE_P(Worlds, RingTest, ::testing::Values(2, 3));

TEST(Communicator, BackendNamesParseAndPrint) {
  for (CommBackend b : {CommBackend::kAuto, CommBackend::kNccl, CommBackend::kGloo}) {
    EXPECT_EQ(parseCommBackend(commBackendName(b)), b) << commBackendName(b);
  }
  try {
    parseCommBackend("mpi");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expected auto, nccl or gloo"), std::string::npos) << e.what();
  }
}

// Under any backend, CPU tensors and the control traffic go through Gloo: with backend nccl, two
// ranks reduce, broadcast and gather CPU tensors, and no CUDA collective has chosen anything. A
// build without NCCL refuses backend nccl when the communicator is made.
TEST(Communicator, CpuTensorsGoThroughGlooUnderEveryBackend) {
  for (CommBackend backend : {CommBackend::kNccl, CommBackend::kGloo, CommBackend::kAuto}) {
    if (backend == CommBackend::kNccl && !hasNccl()) {
      ClusterSpec alone;
      alone.master = {"127.0.0.1", 0};
      EXPECT_THROW(Communicator::connect(alone, {.backend = backend}), InvalidArgument);
      continue;
    }
    test::onRanks(
        2,
        [&](std::shared_ptr<Communicator> comm) {
          EXPECT_EQ(comm->options().backend, backend);
          auto t = torch::full({100}, float(comm->rank() + 1));
          comm->allreduce(t);
          EXPECT_TRUE(torch::all(t == 3.0f).item<bool>()) << commBackendName(backend) << ": " << t[0].item<float>();
          auto b = comm->rank() == 1 ? torch::arange(5, torch::kFloat32) : torch::zeros({5});
          comm->broadcast(b, 1);
          EXPECT_TRUE(torch::equal(b, torch::arange(5, torch::kFloat32)));
          auto all = comm->allgather(torch::tensor({int64_t(comm->rank())}));
          ASSERT_EQ(all.size(), 2u);
          EXPECT_EQ(all[1].item<int64_t>(), 1);
          comm->barrier();
          EXPECT_EQ(comm->cudaBackend(), CommBackend::kAuto) << commBackendName(backend);
        },
        std::chrono::seconds(30), backend);
  }
}

TEST(Communicator, RendezvousTimesOutNamingTheChief) {
  ClusterSpec spec;
  spec.rank = 1;
  spec.worldSize = 2;
  const test::ReservedPort nobody;  // held, never listening: connections are refused
  spec.master = {"127.0.0.1", nobody.port()};
  try {
    Communicator::connect(spec, {.timeout = std::chrono::seconds(2)});
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rendezvous with the chief at 127.0.0.1:" + std::to_string(spec.master.port)),
              std::string::npos)
        << e.what();
  }
}

// A second Job of the same process and rank: it started a second store on the chief's port
// ("another job uses the port") or waited out the timeout for a group that cannot form. Refused at
// once; a copy of the first shares its communicator, and once the first is gone a new one joins.
TEST(Communicator, ASecondJobOfTheSameRankIsRefused) {
  const test::ReservedPort port;
  const auto specOf = [&](int rank) {
    return ClusterSpec{.rank = rank, .worldSize = 2, .master = {"127.0.0.1", port.port()}};
  };
  const JobOptions options{.timeout = std::chrono::seconds(30)};
  std::optional<Job> first;
  std::thread other([&] {
    const Job job = Job::fromSpec(specOf(1), options);
    job.communicator()->barrier();
    job.communicator()->barrier();  // until rank 0 has tried its second Job
  });
  first.emplace(Job::fromSpec(specOf(0), options));
  first->communicator()->barrier();
  const Job copy = *first;
  EXPECT_EQ(copy.communicator(), first->communicator());
  const auto start = std::chrono::steady_clock::now();
  try {
    Job::fromSpec(specOf(0), options).communicator();
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("this process has joined the job already (127.0.0.1:" +
                                         std::to_string(port.port()) + " rank 0) through another Job"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  first->communicator()->barrier();
  other.join();
}

}  // namespace
}  // namespace cohort::communicator_test
