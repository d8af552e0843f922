// A parameter-server shard killed (SIGKILL) and started again on its port, as `cohort launch`
// restarts one, with the gRPC client of ps/client.h on the other side: separate processes (the
// shard is `cohort ps`), because an in-process server's shutdown says goodbye (GOAWAY) where a
// killed one does not, and gRPC's channel then takes another path. Waits are on events (the
// shard's "port P" line, the client's retries, the call's end), each with a timeout.
#include "ps/client.h"
#include "ps/wire.h"

#include "ps_test_util.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>

namespace cohort::ps {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// `cohort ps` on 127.0.0.1 at `port` (0: a free one, told on the launcher channel). exec: the
// shell is replaced, so that SIGKILL reaches the shard itself.
std::string shardCommand(int port) {
  return "exec " + test::cohortBinary() + " ps --host 127.0.0.1 --port " + std::to_string(port);
}

// Stats needs no Init: a shard answers it as soon as it listens.
wire::StatsRequest statsRequest() {
  wire::StatsRequest r;
  r.set_protocol(kProtocolVersion);
  return r;
}

// The fault table's ps-async shard row (docs/BENCHMARKS.md): a worker retrying a call while its
// shard is down must find the restarted shard within about a second of its listening, not at gRPC's
// or its own next back-off (in 1 of 3 runs a worker's window ran out 5 s after the shard was back).
// The client has seen several seconds of refused connections first, so that every back-off is
// near its cap when the shard comes back.
TEST(PsRestartTest, AClientFindsAShardRestartedOnItsPortWithinASecondOfListening) {
  test::Process first(shardCommand(0));
  const int port = first.port(60s);
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  test::Retries retries;
  auto client = makeGrpcClient(address, {.timeoutSeconds = 30, .quiet = true, .onRetry = retries.hook()});
  wire::StatsReply reply;
  const Status connected = client->stats(statsRequest(), &reply);
  ASSERT_TRUE(connected.ok()) << connected.message;  // a connection, as a worker's before the kill

  first.kill(SIGKILL);
  const test::CommandResult killed = first.wait(30s);
  ASSERT_EQ(killed.exitCode, 128 + SIGKILL) << killed.output;

  auto call = std::async(std::launch::async, [&] {
    wire::StatsReply r;
    const Status s = client->stats(statsRequest(), &r);
    const auto ended = Clock::now();
    retries.finished();
    return std::make_pair(s, ended);
  });
  // Refused for long enough that gRPC's reconnect back-off and the client's are at their caps (2 s).
  ASSERT_TRUE(retries.waitFor([](const RetryEvent& e) { return !e.shardAnswered && e.spellSeconds >= 5; }, 30s))
      << "the call did not retry for 5 s while the shard was down";

  test::Process second(shardCommand(port));
  ASSERT_EQ(second.port(60s), port) << second.output();  // it listens from here on
  const auto listening = Clock::now();
  ASSERT_EQ(call.wait_for(30s), std::future_status::ready) << "the call did not end";
  const auto [status, ended] = call.get();
  EXPECT_TRUE(status.ok()) << codeName(status.code) << ": " << status.message;
  const double found = std::chrono::duration<double>(ended - listening).count();
  // gRPC's reconnect back-off (0.5 s, +20%) and some slack for a busy 2-core machine. A client
  // that sleeps between retries learns of the connection only at gRPC's backup poll (5 s): 9.2 s
  // here before the fix.
  EXPECT_LT(found, 1.2) << "the client found the restarted shard " << found << " s after it listened";
}

}  // namespace
}  // namespace cohort::ps
