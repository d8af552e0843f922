// The parameter server's pieces without sockets: layout, the shard optimizers against torch's,
// and every update policy driven through a Shard by threads standing in for workers.
#include "ps/layout.h"
#include "ps/optimizer.h"
#include "ps/shard.h"
#include "ps/wire.h"

#include "test_util.h"

#include <cohort/checkpoint.h>
#include <cohort/error.h>

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

namespace cohort::ps::shard_test {
namespace {

using namespace std::chrono_literals;

wire::Policy policy(wire::Mode mode, int workers) {
  wire::Policy p;
  p.set_mode(mode);
  p.set_workers(uint32_t(workers));
  p.set_softsync(1);
  p.set_staleness_lr(wire::STALENESS_LR_NONE);
  p.set_max_staleness(-1);
  p.set_push(wire::PUSH_GRADIENTS);
  p.set_optimizer(wire::OPTIMIZER_SGD);
  p.set_lr(1.0);
  p.set_momentum(0.9);
  p.set_timeout_s(5);
  return p;
}

// A shard of one piece of `n` elements, all starting at `start`.
struct Fixture {
  std::shared_ptr<Shard> shard;
  wire::PieceSpec piece;
  std::vector<std::string> logged;
  std::mutex logMu;

  explicit Fixture(const wire::Policy& p, size_t n = 4, float start = 0.0f, std::string dir = "", bool resume = false,
                   std::function<void(uint64_t)> beforeCheckpointWrite = {},
                   std::function<void(uint32_t, int64_t, int64_t)> onHeld = {}, Env* env = nullptr) {
    shard = std::make_shared<Shard>(ShardOptions{.name = "test",
                                                 .checkpointDir = dir,
                                                 .log =
                                                     [this](const std::string& m) {
                                                       std::lock_guard<std::mutex> lock(logMu);
                                                       logged.push_back(m);
                                                     },
                                                 .env = env,
                                                 .beforeCheckpointWrite = std::move(beforeCheckpointWrite),
                                                 .onHeld = std::move(onHeld)});
    piece.set_key(7);
    piece.set_name("w");
    piece.set_numel(n);
    wire::InitReply reply;
    Status s = init(p, resume, start, &reply);
    EXPECT_TRUE(s.ok()) << s.message;
  }

  // An Init of the same piece, as a chief sends it.
  Status init(const wire::Policy& p, bool resume, float start, wire::InitReply* reply) {
    wire::InitRequest init;
    init.set_protocol(kProtocolVersion);
    *init.mutable_policy() = p;
    *init.add_pieces() = piece;
    init.set_resume(resume);
    std::vector<float> values(piece.numel(), start);
    setTensor(init.add_values(), piece, values.data());
    return shard->init(init, reply);
  }

  // Pushes each worker has made through pushOf: the clock a real worker sends.
  std::array<std::atomic<int64_t>, 8> clocks{};

  wire::PushRequest pushOf(uint32_t worker, uint64_t pulled, float g) {
    wire::PushRequest r;
    r.set_protocol(kProtocolVersion);
    r.set_worker(worker);
    if (worker < clocks.size()) r.set_clock(clocks[worker]++);
    r.set_pulled_version(pulled);
    r.set_samples(10);
    r.set_want_values(true);
    std::vector<float> grad(piece.numel(), g);
    setTensor(r.add_values(), piece, grad.data());
    return r;
  }

  wire::PushReply push(uint32_t worker, uint64_t pulled, float g, Status* status = nullptr) {
    wire::PushReply reply;
    Status s = shard->push(pushOf(worker, pulled, g), &reply);
    if (status != nullptr) *status = s;
    else EXPECT_TRUE(s.ok()) << s.message;
    return reply;
  }

  std::vector<float> values() {
    wire::PullRequest r;
    r.set_protocol(kProtocolVersion);
    wire::PullReply reply;
    EXPECT_TRUE(shard->pull(r, &reply).ok());
    std::vector<float> out;
    for (const auto& t : reply.values()) appendFloats(t, out);
    return out;
  }

  wire::StatsReply stats() {
    wire::StatsRequest r;
    r.set_protocol(kProtocolVersion);
    wire::StatsReply reply;
    EXPECT_TRUE(shard->stats(r, &reply).ok());
    return reply;
  }

  void done(uint32_t worker) {
    wire::DoneRequest r;
    r.set_protocol(kProtocolVersion);
    r.set_worker(worker);
    wire::DoneReply reply;
    EXPECT_TRUE(shard->done(r, &reply).ok());
  }
};

TEST(PsLayout, BalancesShardsAndCoversEveryElementOnce) {
  std::vector<ParamInfo> params{{"conv.weight", 800}, {"conv.bias", 32}, {"fc.weight", 10000}, {"fc.bias", 10}};
  for (int shards : {1, 2, 3, 5}) {
    const auto pieces = planLayout(params, shards);
    const auto loads = shardLoads(pieces, shards);
    const uint64_t total = 10842;
    const uint64_t share = (total + shards - 1) / shards;
    for (auto load : loads) {
      EXPECT_GT(load, 0u);
      EXPECT_LE(load, share + 800) << shards << " shards";  // off by less than one unsplit parameter
    }
    // Every element of every parameter is in exactly one piece, keys in parameter order.
    std::vector<std::vector<int>> covered(params.size());
    for (size_t i = 0; i < params.size(); ++i) covered[i].assign(params[i].numel, 0);
    for (size_t k = 0; k < pieces.size(); ++k) {
      EXPECT_EQ(pieces[k].key, k);
      if (k > 0) EXPECT_LE(pieces[k - 1].param, pieces[k].param);
      for (uint64_t e = 0; e < pieces[k].numel; ++e) covered[pieces[k].param][pieces[k].offset + e] += 1;
    }
    for (const auto& c : covered) {
      for (int n : c) ASSERT_EQ(n, 1);
    }
  }
  // A parameter larger than an even share is cut into chunks across shards.
  const auto split = planLayout(std::vector<ParamInfo>{{"big", 1000}}, 4);
  ASSERT_EQ(split.size(), 4u);
  EXPECT_EQ(split[1].name, "big[250:500]");
  EXPECT_THROW(planLayout(params, 0), InvalidArgument);
}

// The shard's optimizers must step exactly as torch::optim does, or sync ps would not match allreduce.
TEST(PsOptimizer, MatchesTorchMomentumAndAdam) {
  for (const std::string name : {"sgd", "momentum", "adam"}) {
    torch::manual_seed(3);
    auto p = torch::randn({50});
    auto param = p.clone().requires_grad_(true);
    std::unique_ptr<torch::optim::Optimizer> reference;
    if (name == "adam") reference = std::make_unique<torch::optim::Adam>(std::vector{param}, torch::optim::AdamOptions(0.01));
    else reference = std::make_unique<torch::optim::SGD>(std::vector{param}, torch::optim::SGDOptions(0.01).momentum(name == "momentum" ? 0.9 : 0.0));
    const UpdateRule rule = name == "sgd"        ? UpdateRule::kSgd
                            : name == "momentum" ? UpdateRule::kMomentum
                                                 : UpdateRule::kAdam;
    ServerOptimizer mine(rule, 0.01, 0.9, 50);
    std::vector<float> values(p.data_ptr<float>(), p.data_ptr<float>() + 50);
    for (int step = 0; step < 4; ++step) {
      auto g = torch::randn({50});
      param.mutable_grad() = g.clone();
      reference->step();
      mine.apply(values, std::span<const float>(g.data_ptr<float>(), 50));
    }
    auto ref = param.detach();
    for (int i = 0; i < 50; ++i) ASSERT_NEAR(values[size_t(i)], ref[i].item<float>(), 1e-6) << name << " at " << i;
  }
}

TEST(PsShard, AsyncAppliesOnArrivalAndMeasuresStaleness) {
  Fixture f(policy(wire::MODE_ASYNC, 2));
  auto a = f.push(0, 0, 1.0f);  // computed on version 0, applied at version 0: tau 0
  auto b = f.push(1, 0, 1.0f);  // also computed on version 0, but one update went in since: tau 1
  EXPECT_TRUE(a.applied());
  EXPECT_EQ(a.staleness(), 0);
  EXPECT_EQ(b.staleness(), 1);
  EXPECT_EQ(b.version(), 2u);
  EXPECT_FLOAT_EQ(f.values()[0], -2.0f);
  auto s = f.stats();
  EXPECT_EQ(s.applied(), 2);
  ASSERT_GE(s.staleness_histogram_size(), 2);
  EXPECT_EQ(s.staleness_histogram(0), 1);
  EXPECT_EQ(s.staleness_histogram(1), 1);
  EXPECT_DOUBLE_EQ(s.staleness_mean(), 0.5);
  EXPECT_EQ(s.samples_total(), 20);
  EXPECT_EQ(s.bytes_pushed(), 2 * 4 * 4);
}

TEST(PsShard, MaxStalenessDropsExactlyTheGradientsOverTheBound) {
  auto p = policy(wire::MODE_ASYNC, 3);
  p.set_max_staleness(1);
  Fixture f(p);
  f.push(0, 0, 1.0f);             // tau 0: applied
  f.push(1, 0, 1.0f);             // tau 1: applied
  auto late = f.push(2, 0, 1.0f); // tau 2 > 1: dropped
  EXPECT_FALSE(late.applied());
  EXPECT_EQ(late.dropped(), "stale");
  EXPECT_EQ(late.staleness(), 2);
  auto ok = f.push(2, 2, 1.0f);   // tau 0 again
  EXPECT_TRUE(ok.applied());
  EXPECT_FLOAT_EQ(f.values()[0], -3.0f);  // three applied, the stale one never touched them
  EXPECT_EQ(f.stats().dropped_stale(), 1);
  EXPECT_EQ(f.stats().applied(), 3);
}

TEST(PsShard, InverseStalenessScalesTheGradient) {
  auto p = policy(wire::MODE_ASYNC, 3);
  p.set_staleness_lr(wire::STALENESS_LR_INVERSE);
  Fixture f(p);
  f.push(0, 0, 1.0f);  // tau 0 -> scale 1
  f.push(1, 0, 1.0f);  // tau 1 -> scale 1
  f.push(2, 0, 1.0f);  // tau 2 -> scale 1/2
  EXPECT_FLOAT_EQ(f.values()[0], -2.5f);
}

TEST(PsShard, SyncAveragesAllWorkersAndHoldsEachUntilTheStepCloses) {
  Fixture f(policy(wire::MODE_SYNC, 2));
  auto first = std::async(std::launch::async, [&] { return f.push(0, 0, 1.0f); });
  EXPECT_EQ(first.wait_for(300ms), std::future_status::timeout) << "released before the other worker pushed";
  auto second = f.push(1, 0, 3.0f);
  auto a = first.get();
  EXPECT_TRUE(a.applied());
  EXPECT_TRUE(second.applied());
  EXPECT_EQ(a.version(), 1u);
  EXPECT_FLOAT_EQ(f.values()[0], -2.0f);  // the average of 1 and 3, applied once
  ASSERT_EQ(a.values_size(), 1);          // the push brought back the new parameters
}

// Re-reads `condition` until it holds, or `limit` passes: for a state of the shard that nothing
// signals (a push held), as test::waitForCount does for descriptors.
template <typename Condition>
bool eventually(Condition condition, std::chrono::seconds limit = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// A worker's connection drops while its push is held in a sync step, and the client sends the push
// again: the retry waits for the step with the first and is answered as its duplicate. (Answered
// "late" at once, it sent the worker on with the old values into more late pushes, and the first
// push's reply then counted the worker's clock twice, dropping its next push as a duplicate.)
TEST(PsShard, ARetryOfAHeldSyncPushWaitsForTheStepAsItsDuplicate) {
  std::promise<void> retryWaits;
  Fixture f(policy(wire::MODE_SYNC, 2), 4, 0.0f, "", false, {}, [&](uint32_t, int64_t, int64_t slowest) {
    if (slowest == -1) retryWaits.set_value();
  });
  const wire::PushRequest request = f.pushOf(0, 0, 1.0f);
  wire::PushReply replies[2];
  auto send = [&](int i) { return f.shard->push(request, &replies[i]); };
  auto first = std::async(std::launch::async, send, 0);
  auto retry = std::async(std::launch::async, send, 1);
  ASSERT_EQ(retryWaits.get_future().wait_for(30s), std::future_status::ready) << "the retry did not wait";
  f.push(1, 0, 3.0f);  // closes the step
  ASSERT_TRUE(first.get().ok());
  ASSERT_TRUE(retry.get().ok());
  EXPECT_NE(replies[0].applied(), replies[1].applied()) << "one applied, the other its duplicate";
  for (const auto& reply : replies) {
    EXPECT_EQ(reply.version(), 1u);
    EXPECT_EQ(reply.dropped(), reply.applied() ? "" : "duplicate");
    ASSERT_EQ(reply.values_size(), 1);  // the new parameters for both
  }
  EXPECT_FLOAT_EQ(f.values()[0], -2.0f);  // 1 and 3 averaged, once
  EXPECT_EQ(f.stats().clocks(0), 1);
  // The worker goes on at clock 1, and its next push counts.
  auto next = std::async(std::launch::async, [&] { return f.push(0, 1, 1.0f); });
  EXPECT_TRUE(f.push(1, 1, 1.0f).applied());
  EXPECT_TRUE(next.get().applied());
  EXPECT_EQ(f.stats().dropped_duplicate(), 1);
  EXPECT_EQ(f.stats().dropped_late(), 0);
}

// A resume Init while a sync push is held aborts that push; its worker resumes at that push's
// clock and sends the batch again, which the step counts, not the aborted copy.
TEST(PsShard, AResumeInitDropsTheHeldSyncStepsGradients) {
  const auto p = policy(wire::MODE_SYNC, 2);
  Fixture f(p);
  Status aborted;
  auto held = std::async(std::launch::async, [&] { return f.push(0, 0, 100.0f, &aborted); });
  ASSERT_TRUE(eventually([&] { return f.stats().applied() == 1; })) << "the push was not held";
  wire::InitReply reply;
  ASSERT_TRUE(f.init(p, /*resume=*/true, 0.0f, &reply).ok());
  held.get();
  EXPECT_EQ(aborted.code, Code::kAborted) << aborted.message;
  ASSERT_EQ(reply.clocks_size(), 2);
  EXPECT_EQ(reply.clocks(0), 0);
  f.clocks[0] = 0;  // the worker resumes at its clock
  auto again = std::async(std::launch::async, [&] { return f.push(0, 0, 1.0f); });
  EXPECT_TRUE(f.push(1, 0, 3.0f).applied());
  EXPECT_TRUE(again.get().applied());
  EXPECT_FLOAT_EQ(f.values()[0], -2.0f);  // 1 and 3; the aborted 100 is not in it
}

// A sync step's checkpoint is taken by the pusher that closed it, right after its reply, while the
// other worker's held push may not have taken the lock back to count itself. Its clock in the
// checkpoint must count that gradient all the same: every worker restored from the checkpoint of
// version V resumes at step V (one that resumed a step behind pushed once more than the others at
// the end and held them there: the fault table's ps-sync "kill inside a write" row).
TEST(PsShard, SyncCheckpointsCountEveryGradientOfAClosedStep) {
  test::TempDir dir;
  auto p = policy(wire::MODE_SYNC, 2);
  p.set_checkpoint_every(1);
  Fixture f(p, 4, 0.0f, dir.path());
  for (uint64_t step = 0; step < 20; ++step) {
    auto held = std::async(std::launch::async, [&] { return f.push(0, step, 1.0f); });
    f.push(1, step, 1.0f);  // closes the step, then writes its checkpoint
    ASSERT_EQ(held.get().version(), step + 1);
    Shard restored(ShardOptions{.name = "again", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
    wire::StatsRequest sr;
    sr.set_protocol(kProtocolVersion);
    wire::StatsReply stats;
    ASSERT_TRUE(restored.stats(sr, &stats).ok());
    ASSERT_EQ(stats.version(), step + 1);
    ASSERT_EQ(stats.clocks_size(), 2);
    EXPECT_EQ(stats.clocks(0), int64_t(step + 1)) << "worker 0's clock in the checkpoint of version " << step + 1;
    EXPECT_EQ(stats.clocks(1), int64_t(step + 1)) << "worker 1's clock in the checkpoint of version " << step + 1;
  }
}

TEST(PsShard, SyncWithBackupWorkersDoesNotWaitForTheLastAndDropsIt) {
  auto p = policy(wire::MODE_SYNC, 3);
  p.set_backup_workers(1);
  Fixture f(p);
  auto a = std::async(std::launch::async, [&] { return f.push(0, 0, 1.0f); });
  auto b = f.push(1, 0, 3.0f);  // the second of three closes the step
  EXPECT_TRUE(a.get().applied());
  EXPECT_EQ(b.version(), 1u);
  auto late = f.push(2, 0, 100.0f);  // computed on version 0: its step has closed
  EXPECT_FALSE(late.applied());
  EXPECT_EQ(late.dropped(), "late");
  EXPECT_FLOAT_EQ(f.values()[0], -2.0f);
  EXPECT_EQ(f.stats().dropped_late(), 1);
}

TEST(PsShard, SyncStopsNamingAWorkerThatNeverPushes) {
  auto p = policy(wire::MODE_SYNC, 2);
  p.set_timeout_s(0.5);
  Fixture f(p);
  Status status;
  const auto start = std::chrono::steady_clock::now();
  f.push(0, 0, 1.0f, &status);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(status.code, Code::kAborted);
  EXPECT_NE(status.message.find("worker 1"), std::string::npos) << status.message;
  EXPECT_NE(status.message.find("--backup-workers"), std::string::npos) << status.message;
  auto failure = f.shard->waitFinished(10ms);
  ASSERT_TRUE(failure.has_value());
}

TEST(PsShard, SoftsyncAppliesTheAverageOfEverySGradients) {
  auto p = policy(wire::MODE_SOFTSYNC, 3);
  p.set_softsync(2);
  Fixture f(p);
  auto a = f.push(0, 0, 1.0f);
  EXPECT_EQ(a.version(), 0u);  // gathered, not applied yet, and not held
  auto b = f.push(1, 0, 3.0f);
  EXPECT_EQ(b.version(), 1u);
  EXPECT_FLOAT_EQ(f.values()[0], -2.0f);
}

TEST(PsShard, SspNeverLetsAWorkerRunMoreThanTheBoundAhead) {
  auto p = policy(wire::MODE_SSP, 3);
  p.set_staleness_bound(2);
  // Every time the shard holds a push it says so (worker, its clock, the slowest's clock).
  struct Held {
    uint32_t worker;
    int64_t clock;
    int64_t slowest;
  };
  std::mutex mu;
  std::condition_variable heldChanged;
  std::vector<Held> held;
  Fixture f(p, 4, 0.0f, "", false, {}, [&](uint32_t worker, int64_t clock, int64_t slowest) {
    std::lock_guard<std::mutex> lock(mu);
    held.push_back({worker, clock, slowest});
    heldChanged.notify_all();
  });
  auto waitForHold = [&](size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return heldChanged.wait_for(lock, 20s, [&] { return held.size() >= n; });
  };
  // Worker 0 races; workers 1 and 2 push only when the test lets them: one step each, every time
  // worker 0 is held. The shard must hold worker 0 exactly when it is bound + 1 steps ahead.
  auto fast = std::async(std::launch::async, [&] {
    for (int i = 0; i < 30; ++i) f.push(0, 0, 0.0f);
  });
  for (int round = 0; round < 10; ++round) {
    ASSERT_TRUE(waitForHold(size_t(round) + 1)) << "worker 0 was not held in round " << round;
    {
      std::lock_guard<std::mutex> lock(mu);
      const Held h = held.back();
      EXPECT_EQ(h.worker, 0u);
      EXPECT_EQ(h.slowest, round);
      EXPECT_EQ(h.clock - h.slowest, 2 + 1) << "held at the wrong distance in round " << round;
    }
    EXPECT_EQ(f.stats().clocks(0), round + 3);  // not a step further while held
    f.push(1, 0, 0.0f);
    f.push(2, 0, 0.0f);
  }
  ASSERT_TRUE(waitForHold(11));
  f.done(1);
  f.done(2);
  ASSERT_EQ(fast.wait_for(20s), std::future_status::ready) << "worker 0 was not released once the others were done";
  fast.get();
  const auto s = f.stats();
  EXPECT_LE(s.max_clock_gap(), 2);
  EXPECT_GE(s.max_clock_gap(), 1);
  EXPECT_EQ(s.clocks(0), 30);
}

TEST(PsShard, WarmupLetsWorkerZeroTrainAloneFirst) {
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_warmup_steps(3);
  Fixture f(p);
  auto other = std::async(std::launch::async, [&] { return f.push(1, 0, 100.0f); });
  EXPECT_EQ(other.wait_for(200ms), std::future_status::timeout);
  for (int i = 0; i < 3; ++i) f.push(0, uint64_t(i), 1.0f);
  auto r = other.get();
  EXPECT_FALSE(r.applied());
  EXPECT_EQ(r.dropped(), "warmup");
  EXPECT_FLOAT_EQ(f.values()[0], -3.0f);
  EXPECT_EQ(f.stats().dropped_warmup(), 1);
}

TEST(PsShard, RejectsMalformedPushesWithoutTouchingTheParameters) {
  Fixture f(policy(wire::MODE_ASYNC, 1));
  auto check = [&](wire::PushRequest r, Code code, const std::string& words) {
    wire::PushReply reply;
    Status s = f.shard->push(r, &reply);
    EXPECT_EQ(s.code, code) << s.message;
    EXPECT_NE(s.message.find(words), std::string::npos) << s.message;
  };
  auto nan = f.pushOf(0, 0, std::nanf(""));
  check(nan, Code::kInvalidArgument, "NaN");
  auto inf = f.pushOf(0, 0, INFINITY);
  check(inf, Code::kInvalidArgument, "Inf");
  auto key = f.pushOf(0, 0, 1.0f);
  key.mutable_values(0)->set_key(99);
  check(key, Code::kInvalidArgument, "unknown key 99");
  auto shape = f.pushOf(0, 0, 1.0f);
  shape.mutable_values(0)->set_numel(3);
  check(shape, Code::kInvalidArgument, "3 elements");
  auto dtype = f.pushOf(0, 0, 1.0f);
  dtype.mutable_values(0)->set_dtype(wire::DTYPE_UNSPECIFIED);
  check(dtype, Code::kInvalidArgument, "dtype");
  auto truncated = f.pushOf(0, 0, 1.0f);
  truncated.mutable_values(0)->mutable_data()->resize(5);
  check(truncated, Code::kInvalidArgument, "bytes");
  auto missing = f.pushOf(0, 0, 1.0f);
  missing.clear_values();
  check(missing, Code::kInvalidArgument, "missing");
  auto protocol = f.pushOf(0, 0, 1.0f);
  protocol.set_protocol(99);
  check(protocol, Code::kFailedPrecondition, "protocol version 99");
  auto stranger = f.pushOf(5, 0, 1.0f);
  check(stranger, Code::kInvalidArgument, "worker 5");
  for (float v : f.values()) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(f.stats().rejected(), 9);
  EXPECT_EQ(f.stats().applied(), 0);
}

TEST(PsShard, RestoresFromItsCheckpointAndResumes) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 1);
  p.set_optimizer(wire::OPTIMIZER_MOMENTUM);
  p.set_checkpoint_every(2);
  std::vector<float> before;
  {
    Fixture f(p, 4, 1.0f, dir.path());
    for (int i = 0; i < 5; ++i) f.push(0, uint64_t(i), 1.0f);
    f.shard->checkpoint();
    before = f.values();
  }
  // A new shard on the same directory (a restart) has the parameters, version and momentum.
  auto restarted = std::make_shared<Shard>(ShardOptions{.name = "again", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
  wire::StatsRequest sr;
  sr.set_protocol(kProtocolVersion);
  wire::StatsReply stats;
  ASSERT_TRUE(restarted->stats(sr, &stats).ok());
  EXPECT_TRUE(stats.initialized());
  EXPECT_EQ(stats.version(), 5u);
  EXPECT_EQ(stats.clocks(0), 5);
  wire::PullRequest pr;
  pr.set_protocol(kProtocolVersion);
  wire::PullReply pulled;
  ASSERT_TRUE(restarted->pull(pr, &pulled).ok());
  std::vector<float> after;
  appendFloats(pulled.values(0), after);
  EXPECT_EQ(after, before);

  // Its next step continues the momentum: the same as a shard that never stopped.
  Fixture uninterrupted(p, 4, 1.0f);
  for (int i = 0; i < 6; ++i) uninterrupted.push(0, uint64_t(i), 1.0f);
  wire::PushRequest next;
  next.set_protocol(kProtocolVersion);
  next.set_pulled_version(5);
  next.set_clock(5);
  next.set_want_values(true);
  std::vector<float> g(4, 1.0f);
  wire::PieceSpec piece = uninterrupted.piece;
  setTensor(next.add_values(), piece, g.data());
  wire::PushReply reply;
  ASSERT_TRUE(restarted->push(next, &reply).ok());
  std::vector<float> resumed;
  appendFloats(reply.values(0), resumed);
  EXPECT_EQ(resumed, uninterrupted.values());

  // A fresh Init (not --resume) starts over and removes the old checkpoints.
  Fixture fresh(p, 4, 9.0f, dir.path(), false);
  EXPECT_EQ(fresh.values()[0], 9.0f);
  EXPECT_TRUE(CheckpointStore(dir.path(), "shard").list().empty());
}

// A checkpoint is copied under the shard's lock and written outside it: while one is being
// written (held here in the test's hook until the other push has come back), pushes and pulls go
// on. Were the write under the lock, the second push would wait for the hook, which waits for it.
TEST(PsShard, APushIsNotHeldWhileACheckpointIsWritten) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_checkpoint_every(1);
  std::promise<void> writing;
  std::promise<void> pushedMeanwhile;
  std::shared_future<void> pushed = pushedMeanwhile.get_future().share();
  std::atomic<int> hooks{0};
  std::atomic<bool> otherPushCameBack{false};
  Fixture f(p, 1 << 16, 0.0f, dir.path(), false, [&](uint64_t version) {
    if (hooks++ > 0) return;  // the first write only
    writing.set_value();
    otherPushCameBack = pushed.wait_for(30s) == std::future_status::ready;
  });
  auto first = std::async(std::launch::async, [&] { return f.push(0, 0, 1.0f); });
  ASSERT_EQ(writing.get_future().wait_for(30s), std::future_status::ready) << "no checkpoint was written";
  const wire::PushReply reply = f.push(1, 0, 1.0f);  // during the write
  EXPECT_TRUE(reply.applied());
  EXPECT_EQ(f.values()[0], -2.0f);                  // a pull too
  pushedMeanwhile.set_value();
  ASSERT_EQ(first.wait_for(60s), std::future_status::ready);
  EXPECT_TRUE(otherPushCameBack) << "the push waited for the checkpoint's write";
  // The checkpoint written holds the state as it was copied: version 1.
  const auto files = CheckpointStore(dir.path(), "shard").list();
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files.back().step, 1);
}

// A checkpoint that cannot be written (here: a directory stands where its temporary file goes,
// from version 2 on) is counted in the statistics and training goes on; the final one, written
// inside the last worker's Done, is answered in that Done's reply, naming the shard, the
// directory, the cause and the newest checkpoint kept, and stays for the server's exit status.
TEST(PsShard, AFailedCheckpointIsCountedAndAFailedFinalOneIsReported) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_checkpoint_every(1);
  Fixture f(p, 4, 0.0f, ckpt, false, [&](uint64_t version) {
    if (version < 2) return;
    char name[64];
    std::snprintf(name, sizeof name, "shard-%010llu.ckpt", static_cast<unsigned long long>(version));
    std::filesystem::create_directories(ckpt + "/" + name + ".tmp." + CheckpointStore::hostTag() + "." +
                                        std::to_string(::getpid()));
  });
  f.push(0, 0, 1.0f);  // version 1: written
  f.push(1, 1, 1.0f);  // version 2: fails
  f.push(0, 2, 1.0f);  // version 3: fails; training went on
  EXPECT_EQ(f.values()[0], -3.0f);
  const wire::StatsReply stats = f.stats();
  EXPECT_EQ(stats.checkpoints_failed(), 2);
  EXPECT_NE(stats.checkpoint_error().find("shard-0000000003.ckpt.tmp."), std::string::npos) << stats.checkpoint_error();
  EXPECT_FALSE(f.shard->finalCheckpointError().has_value());
  f.done(0);
  wire::DoneRequest last;
  last.set_protocol(kProtocolVersion);
  last.set_worker(1);
  wire::DoneReply reply;
  ASSERT_TRUE(f.shard->done(last, &reply).ok());
  EXPECT_TRUE(reply.all_done());
  const std::string expected = "test: the final checkpoint (version 3) could not be written to " + ckpt + ": ";
  EXPECT_EQ(reply.final_checkpoint_error().rfind(expected, 0), 0u) << reply.final_checkpoint_error();
  EXPECT_NE(reply.final_checkpoint_error().find("the newest checkpoint kept there is " + ckpt +
                                                "/shard-0000000001.ckpt (version 1)"),
            std::string::npos)
      << reply.final_checkpoint_error();
  ASSERT_TRUE(f.shard->finalCheckpointError().has_value());
  EXPECT_EQ(*f.shard->finalCheckpointError(), reply.final_checkpoint_error());
  EXPECT_EQ(f.stats().checkpoints_failed(), 3);
}

// A write that throws (std::bad_alloc for the serialized copy of a large state) is a failed
// checkpoint like any other: the push it follows is answered, and the next checkpoint is written.
TEST(PsShard, ACheckpointWriteThatThrowsLeavesTheNextOneToBeWritten) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_checkpoint_every(1);
  Fixture f(p, 4, 0.0f, dir.path(), false, [&](uint64_t version) {
    if (version == 2) throw std::bad_alloc();
  });
  f.push(0, 0, 1.0f);  // version 1: written
  f.push(1, 1, 1.0f);  // version 2: throws
  f.push(0, 2, 1.0f);  // version 3: written
  EXPECT_EQ(f.stats().checkpoints_failed(), 1);
  EXPECT_NE(f.stats().checkpoint_error().find("bad_alloc"), std::string::npos) << f.stats().checkpoint_error();
  const auto files = CheckpointStore(dir.path(), "shard").list();
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files.front().step, 3);
}

// A fresh Init removes the earlier run's checkpoints, including one being written as it comes and
// one copied and not yet written: neither may come back as the newest checkpoint of the new run.
TEST(PsShard, AFreshInitLeavesNoCheckpointOfTheEarlierRun) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_checkpoint_every(1);
  std::promise<void> writing;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> hooks{0};
  Fixture f(p, 4, 0.0f, dir.path(), false, [&](uint64_t) {
    if (hooks++ > 0) return;  // the first write only
    writing.set_value();
    released.wait();
  });
  auto first = std::async(std::launch::async, [&] { return f.push(0, 0, 1.0f); });  // version 1, held in its write
  ASSERT_EQ(writing.get_future().wait_for(30s), std::future_status::ready) << "no checkpoint was written";
  f.push(1, 0, 1.0f);  // version 2: copied, left to the writer
  auto fresh = std::async(std::launch::async, [&] {
    wire::InitReply reply;
    return f.init(p, /*resume=*/false, 5.0f, &reply);
  });
  // Without the fix the Init finishes at once, before the write; with it, it waits for the write.
  fresh.wait_for(200ms);
  release.set_value();
  ASSERT_TRUE(fresh.get().ok());
  first.get();
  EXPECT_EQ(f.values()[0], 5.0f);
  EXPECT_TRUE(CheckpointStore(dir.path(), "shard").list().empty()) << "a checkpoint of the earlier run is there";
}

TEST(PsShard, FinishesWhenEveryWorkerIsDone) {
  Fixture f(policy(wire::MODE_ASYNC, 2));
  f.done(0);
  EXPECT_FALSE(f.shard->finished());
  f.done(1);
  EXPECT_TRUE(f.shard->finished());
  EXPECT_FALSE(f.shard->waitFinished(10ms).has_value());
}

TEST(PsShard, CountsAWorkerSilentForTheTimeoutAsLost) {
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_timeout_s(0.3);
  Fixture f(p);
  f.done(0);
  f.shard->waitFinished(2s);  // worker 1 never speaks: lost, so the shard is finished
  EXPECT_TRUE(f.shard->finished());
  EXPECT_TRUE(f.stats().lost(1));
}

// An Env whose clock moves only when the test says.
struct ManualClock : Env {
  const Clock::time_point start = Clock::now();
  std::atomic<int64_t> elapsedSeconds{0};
  void log(LogLevel, const std::string&) override {}
  Clock::time_point now() override { return start + std::chrono::seconds(elapsedSeconds.load()); }
};

// The shard measures silence on its Env's clock: an hour of it passes in no time, and a worker
// silent for it is lost, while one silent for no time of it is not.
TEST(PsShard, MeasuresAWorkersSilenceOnItsEnvsClock) {
  ManualClock clock;
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_timeout_s(3600);
  Fixture f(p, 4, 0.0f, "", false, {}, {}, &clock);
  f.done(0);
  f.shard->waitFinished(0ms);  // one look: worker 1 was last heard at the Init, no time ago
  EXPECT_FALSE(f.shard->finished());
  EXPECT_FALSE(f.stats().lost(1));
  clock.elapsedSeconds = 3601;
  f.shard->waitFinished(0ms);
  EXPECT_TRUE(f.shard->finished());
  EXPECT_TRUE(f.stats().lost(1));
}

TEST(PsShard, ARetriedPushIsNotCountedTwice) {
  Fixture f(policy(wire::MODE_ASYNC, 1));
  auto first = f.pushOf(0, 0, 1.0f);
  wire::PushReply reply;
  ASSERT_TRUE(f.shard->push(first, &reply).ok());
  EXPECT_TRUE(reply.applied());
  // The reply was lost with the connection; the client sends the same push again.
  ASSERT_TRUE(f.shard->push(first, &reply).ok());
  EXPECT_FALSE(reply.applied());
  EXPECT_EQ(reply.dropped(), "duplicate");
  EXPECT_FLOAT_EQ(f.values()[0], -1.0f);
  EXPECT_EQ(f.stats().clocks(0), 1);
  EXPECT_EQ(f.stats().dropped_duplicate(), 1);
}

// An Init of one piece, all zeros.
wire::InitRequest initOf(const wire::Policy& p, const wire::PieceSpec& piece, bool resume) {
  wire::InitRequest init;
  init.set_protocol(kProtocolVersion);
  *init.mutable_policy() = p;
  *init.add_pieces() = piece;
  std::vector<float> values(piece.numel(), 0.0f);
  setTensor(init.add_values(), piece, values.data());
  init.set_resume(resume);
  return init;
}

// A shard that took one step and checkpointed it, then went away (as a killed one does).
void checkpointOneStep(const wire::Policy& p, const std::string& dir) {
  Fixture f(p, 4, 1.0f, dir);
  f.push(0, 0, 1.0f);
  f.shard->checkpoint();
}

TEST(PsShard, ARestoredShardServesAFirstPullOnlyAfterAnInit) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 2);
  checkpointOneStep(p, dir.path());
  // Restarted with the directory of an earlier run: a new job's first pull must wait for its
  // chief, but a running job's later pulls are served (that is how it rides out a restart).
  Shard restored(ShardOptions{.name = "again", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
  wire::PullRequest pr;
  pr.set_protocol(kProtocolVersion);
  pr.set_worker(1);
  pr.set_initial(true);
  wire::PullReply pulled;
  Status s = restored.pull(pr, &pulled);
  EXPECT_EQ(s.code, Code::kUnavailable) << s.message;
  pr.set_initial(false);
  EXPECT_TRUE(restored.pull(pr, &pulled).ok());
}

// Started again by its launcher inside the running job (restartedInJob), the state it restores is
// that job's own: a worker whose first pull was still being retried when the shard died is served
// at once, instead of waiting for an Init the chief, already training, will not send again.
TEST(PsShard, AShardRestartedInItsJobServesAFirstPullAtOnce) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 2);
  checkpointOneStep(p, dir.path());
  Shard restored(ShardOptions{.name = "again", .checkpointDir = dir.path(), .log = [](const std::string&) {},
                              .restartedInJob = true});
  wire::PullRequest pr;
  pr.set_protocol(kProtocolVersion);
  pr.set_worker(1);
  pr.set_initial(true);
  wire::PullReply pulled;
  const Status s = restored.pull(pr, &pulled);
  EXPECT_TRUE(s.ok()) << s.message;
  EXPECT_EQ(pulled.version(), 1u);
}

TEST(PsShard, ResumeRefusesToDeleteCheckpointsItCannotRead) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 1);
  checkpointOneStep(p, dir.path());
  // The only checkpoint is made unreadable: a --resume Init must not start afresh over it.
  const auto files = CheckpointStore(dir.path(), "shard").list();
  ASSERT_EQ(files.size(), 1u);
  { std::ofstream(files[0].path, std::ios::binary | std::ios::trunc) << "garbage"; }
  Shard shard(ShardOptions{.name = "again", .checkpointDir = dir.path(), .log = [](const std::string&) {}});
  wire::PieceSpec piece;
  piece.set_key(7);
  piece.set_name("w");
  piece.set_numel(4);
  wire::InitRequest init = initOf(p, piece, true);
  wire::InitReply reply;
  Status s = shard.init(init, &reply);
  EXPECT_EQ(s.code, Code::kFailedPrecondition);
  EXPECT_NE(s.message.find("cannot resume"), std::string::npos) << s.message;
  EXPECT_EQ(CheckpointStore(dir.path(), "shard").list().size(), 1u);
}

TEST(PsShard, ResumeWithAnotherOptimizerIsRefused) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 1);
  Fixture f(p, 4, 1.0f, dir.path());
  auto other = p;
  other.set_optimizer(wire::OPTIMIZER_ADAM);
  wire::InitRequest init = initOf(other, f.piece, true);
  wire::InitReply reply;
  Status s = f.shard->init(init, &reply);
  EXPECT_EQ(s.code, Code::kFailedPrecondition);
  EXPECT_NE(s.message.find("same optimizer"), std::string::npos) << s.message;
}

TEST(PsShard, AWarmupPushIsHeldAtMostTheTimeout) {
  auto p = policy(wire::MODE_ASYNC, 2);
  p.set_warmup_steps(1'000'000'000);
  p.set_timeout_s(0.3);
  Fixture f(p);
  // Worker 0 keeps making progress (back to back, far from the end of the warm-up), so the warm-up
  // goes on; worker 1's push still comes back.
  std::atomic<bool> stop{false};
  auto zero = std::async(std::launch::async, [&] {
    for (uint64_t i = 0; !stop; ++i) f.push(0, i, 0.0f);
  });
  auto one = std::async(std::launch::async, [&] { return f.push(1, 0, 1.0f); });
  const bool back = one.wait_for(3s) == std::future_status::ready;
  stop = true;
  zero.get();
  ASSERT_TRUE(back);
  EXPECT_EQ(one.get().dropped(), "warmup");
  EXPECT_FALSE(f.stats().lost(1));
}

TEST(PsShard, SspWithWarmupIsRefused) {
  auto p = policy(wire::MODE_SSP, 2);
  p.set_warmup_steps(3);
  Status s = checkPolicy(p);
  EXPECT_EQ(s.code, Code::kInvalidArgument);
  EXPECT_NE(s.message.find("ssp"), std::string::npos) << s.message;
}

TEST(PsShard, AnInitWhileAPushIsHeldAbortsThatPush) {
  auto p = policy(wire::MODE_SYNC, 2);
  Fixture f(p);
  Status held;
  auto one = std::async(std::launch::async, [&] { return f.push(0, 0, 1.0f, &held); });
  EXPECT_EQ(one.wait_for(200ms), std::future_status::timeout);
  // A new job's chief re-initializes with three workers (workers_ is replaced under the push).
  wire::InitRequest init = initOf(policy(wire::MODE_SYNC, 3), f.piece, false);
  wire::InitReply reply;
  ASSERT_TRUE(f.shard->init(init, &reply).ok());
  one.get();
  EXPECT_EQ(held.code, Code::kAborted);
  EXPECT_NE(held.message.find("re-initialized"), std::string::npos) << held.message;
}

// Under push updates the workers run the optimizer and the shard only adds what they send: it
// keeps no optimizer state, so its checkpoints hold the values alone (adam's two slots, all zeros,
// made them three times the size, which the size check before the first one did not count), and
// a resume does not compare optimizers.
TEST(PsShard, PushUpdatesKeepsNoOptimizerStateInItsCheckpoints) {
  test::TempDir dir;
  auto p = policy(wire::MODE_ASYNC, 1);
  p.set_push(wire::PUSH_UPDATES);
  p.set_optimizer(wire::OPTIMIZER_ADAM);
  {
    Fixture f(p, 4, 0.0f, dir.path());
    f.push(0, 0, 0.5f);
    f.done(0);  // the final checkpoint
    EXPECT_EQ(f.values()[0], 0.5f);
  }
  const auto files = CheckpointStore(dir.path(), "shard").list();
  ASSERT_EQ(files.size(), 1u);
  const std::vector<uint8_t> bytes = CheckpointStore::readVerified(files.front().path);
  wire::ShardCheckpoint c;
  ASSERT_TRUE(c.ParseFromArray(bytes.data(), int(bytes.size())));
  EXPECT_EQ(c.optimizer_slots_size(), 0);
  EXPECT_EQ(c.values().size(), 4 * sizeof(float));

  // Resumed with another --optimizer (the workers' own): taken, the values kept.
  auto other = p;
  other.set_optimizer(wire::OPTIMIZER_MOMENTUM);
  other.set_momentum(0.5);
  Fixture resumed(other, 4, 9.0f, dir.path(), /*resume=*/true);
  EXPECT_EQ(resumed.values()[0], 0.5f);
  resumed.clocks[0] = 1;  // the worker's clock, as the shard restored it
  resumed.push(0, 1, 0.25f);
  EXPECT_EQ(resumed.values()[0], 0.75f);

  // Pushing gradients again, the shard's optimizer starts from its first step: momentum's first
  // step is plain sgd (lr 1 here).
  auto gradients = policy(wire::MODE_ASYNC, 1);
  gradients.set_optimizer(wire::OPTIMIZER_MOMENTUM);
  wire::InitReply reply;
  ASSERT_TRUE(resumed.init(gradients, true, 9.0f, &reply).ok());
  resumed.push(0, 2, 0.25f);
  EXPECT_EQ(resumed.values()[0], 0.5f);
}

// softsync's last group, short of `softsync` gradients when the workers run out of pushes, is
// applied (averaged over what it holds) once no worker can push any more: before the chief's
// final pull (it is finishing, the others done) and the final checkpoint. It used to be counted as
// applied and never applied.
TEST(PsShard, SoftsyncAppliesItsLastPartialGroupWhenNoWorkerCanPushMore) {
  test::TempDir dir;
  auto p = policy(wire::MODE_SOFTSYNC, 3);
  p.set_softsync(2);
  Fixture f(p, 4, 0.0f, dir.path());
  f.push(0, 0, 1.0f);
  f.push(1, 0, 3.0f);  // a group: -2
  f.push(2, 1, 4.0f);  // gathered, its group short of one
  EXPECT_EQ(f.stats().version(), 1u);
  f.done(1);
  f.done(2);
  EXPECT_EQ(f.stats().version(), 1u) << "applied while the chief could still push";
  wire::StatsRequest finishing;  // the chief, waiting for the others before its final pull
  finishing.set_protocol(kProtocolVersion);
  finishing.set_worker(0);
  finishing.set_finishing(true);
  wire::StatsReply stats;
  ASSERT_TRUE(f.shard->stats(finishing, &stats).ok());
  EXPECT_EQ(stats.version(), 2u);
  EXPECT_EQ(stats.applied(), 3);
  EXPECT_FLOAT_EQ(f.values()[0], -6.0f);
  f.done(0);
  ASSERT_TRUE(f.shard->finished());
  const auto files = CheckpointStore(dir.path(), "shard").list();
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files.front().step, 2) << "the final checkpoint is not of the last update";
}

// ssp: a worker that has made its last push and waits for the others (finishing) is not the
// slowest: the others, with more steps to go, are not held for it. They used to wait for it until
// their calls timed out.
TEST(PsShard, SspDoesNotHoldTheOthersForAFinishingWorker) {
  auto p = policy(wire::MODE_SSP, 2);
  p.set_staleness_bound(1);
  Fixture f(p);
  f.push(0, 0, 1.0f);
  wire::StatsRequest finishing;
  finishing.set_protocol(kProtocolVersion);
  finishing.set_worker(0);
  finishing.set_finishing(true);
  wire::StatsReply stats;
  ASSERT_TRUE(f.shard->stats(finishing, &stats).ok());
  auto rest = std::async(std::launch::async, [&] {
    for (int i = 0; i < 4; ++i) f.push(1, uint64_t(1 + i), 1.0f);
  });
  const bool free = rest.wait_for(3s) == std::future_status::ready;
  if (!free) f.shard->stop("the test gives up");  // lets the held push go
  rest.get();
  ASSERT_TRUE(free) << "worker 1 was held for the finishing worker 0";
  EXPECT_EQ(f.stats().clocks(1), 4);
}

}  // namespace
}  // namespace cohort::ps::shard_test
