// The body of a test that tests/gossip_test.cpp runs on the CPU and tests/gpu_sync_test.cpp on
// cuda:0: a bfloat16 Gossip replica sends its own change exactly and no rounding.
#pragma once

#include "comm/store.h"
#include "gossip/peer.h"

#include <cohort/gossip.h>
#include <cohort/job.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>
#include <vector>

namespace cohort::test {

// A two-peer job whose rank 1 is a Gossip handle and whose chief the test plays: the store on
// 127.0.0.1, a client of it, and rank 1's Job.
struct ChiefPlayedByTest {
  static constexpr const char* kSecret = "g0ss1p";
  std::unique_ptr<store::Server> server = store::Server::start({.host = "127.0.0.1", .port = 0, .secret = kSecret});
  std::unique_ptr<store::Client> chief =
      store::Client::connect("127.0.0.1", server->port(), kSecret, std::chrono::seconds(5));
  Job rank1 =
      Job::fromSpec(ClusterSpec{.rank = 1, .worldSize = 2, .master = {"127.0.0.1", server->port()}, .secret = kSecret},
                    {.timeout = std::chrono::seconds(30)});

  // As the chief's Gossip publishes its parameters for a torch::nn::Linear(3, 2): their shapes
  // (which a peer checks against its own model's), then the 8 values.
  void publishLinearParameters(const std::vector<float>& values) const {
    const std::string shapes = "[2, 3]\n[2]\n";
    chief->set("cohort/gossip/layout", std::vector<uint8_t>(shapes.begin(), shapes.end()));
    std::vector<uint8_t> bytes(values.size() * sizeof(float));
    std::memcpy(bytes.data(), values.data(), bytes.size());
    chief->set("cohort/gossip/init", bytes);
  }
};

// A bfloat16 replica on `device` (rank 1, the handle) against rank 0 played with the transport
// alone. The wire carries float32 changes: rank 1's own change arrives exactly; rank 0's change of
// 0.001 (below half a bfloat16 unit of most weights) reaches rank 1's model rounded to bfloat16,
// and the rounding is not sent back as if rank 1 had made it: what rank 0 receives in all is rank
// 1's one change, exactly.
inline void expectBfloat16ReplicaSendsOnlyItsOwnChange(const torch::Device& device) {
  using namespace std::chrono_literals;
  torch::nn::Linear net(3, 2);
  net->to(device, torch::kBFloat16);
  ChiefPlayedByTest t;
  const std::string secret = t.kSecret;
  const Job& job = t.rank1;
  auto& chief = t.chief;
  gossip::Peer rank0({.rank = 0, .worldSize = 2, .token = secret, .timeoutSeconds = 30, .numel = 8});
  const std::string address = rank0.address().str();
  chief->set("cohort/gossip/addr/0", std::vector<uint8_t>(address.begin(), address.end()));
  std::vector<float> init(8);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.25f * float(i) - 1.0f;  // exact in bfloat16
  t.publishLinearParameters(init);
  auto attaching = std::async(std::launch::async, [&] { return std::make_unique<Gossip>(job, *net); });
  const auto published = chief->get("cohort/gossip/addr/1", 30s);
  const std::unique_ptr<Gossip> gossip = attaching.get();
  ASSERT_TRUE(published.has_value());
  rank0.connect({rank0.address(), gossip::parsePeerAddress(std::string(published->begin(), published->end()))});
  auto flat = [&] { return torch::cat({net->weight.detach().flatten(), net->bias.detach().flatten()}).cpu(); };
  ASSERT_TRUE(torch::equal(flat().to(torch::kFloat32), torch::tensor(init))) << "not the chief's parameters";

  // Rank 1's own change: +0.5 on every weight (exact in bfloat16 here).
  {
    torch::NoGradGuard noGrad;
    for (auto& p : net->parameters()) p.add_(0.5);
  }
  int64_t ownSteps = 1;
  gossip->step(10);
  // Rank 0 sends 0.001 on every weight once it has that change (so rank 1 has stepped).
  std::vector<float> got(8, 0.0f);
  int64_t stepsGot = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (stepsGot < 1 && std::chrono::steady_clock::now() < deadline) {
    std::vector<float> into(8, 0.0f);
    stepsGot += rank0.drain(into).steps;
    for (size_t i = 0; i < 8; ++i) got[i] += into[i];
    if (stepsGot < 1) std::this_thread::yield();
  }
  ASSERT_EQ(stepsGot, 1) << "rank 1's first change did not arrive";
  const std::vector<int> toRank1{1};
  rank0.publish(std::vector<float>(8, 0.001f), gossip::UpdateMeta{.version = 1, .step = 1, .steps = 1, .samples = 10},
                toRank1);
  // Rank 1 steps without changing its model until the 0.001 has been added.
  int64_t applied = 0;
  while (applied == 0 && std::chrono::steady_clock::now() < deadline) {
    applied = gossip->step(10).messagesApplied;
    ++ownSteps;
    if (applied == 0) std::this_thread::yield();
  }
  ASSERT_EQ(applied, 1) << "rank 0's change did not arrive";
  const torch::Tensor expected = (torch::tensor(init) + 0.5f + 0.001f).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(flat(), expected)) << flat() << " against " << expected;
  EXPECT_FALSE(torch::equal(expected.to(torch::kFloat32), torch::tensor(init) + 0.5f + 0.001f))
      << "0.001 was exact in bfloat16 here: the test shows no rounding";
  gossip->step(10);  // no change of its own: sends zeros
  ++ownSteps;
  std::thread finishing([&] { gossip->finish(); });
  rank0.finish(gossip::PeerReport{});
  finishing.join();
  std::vector<float> rest(8, 0.0f);
  stepsGot += rank0.drain(rest).steps;
  for (size_t i = 0; i < 8; ++i) got[i] += rest[i];
  EXPECT_EQ(stepsGot, ownSteps);
  EXPECT_EQ(got, std::vector<float>(8, 0.5f)) << "rank 1 sent more than its own change";
}

}  // namespace cohort::test
