// The parameter-server scheme, worker side: pull the parameters, compute a gradient on this
// worker's batch, push it to every shard; the shards run the optimizer and the update policy
// (ps/shard.h). Each push asks for the parameters back, so a step is one round trip per shard,
// to all shards in parallel: the next step's pull rides on this step's push.
//
// With push = "updates" the worker runs its optimizer itself and pushes the change in its
// parameters, which the shards add.
//
// With --codec, each push carries one codec message per shard (PushRequest.compressed) instead of
// float32 values; the worker keeps one encoder, and so one residual, per shard. The pulls stay
// float32.
#pragma once

#include <cohort/strategy.h>

#include "ps/client.h"

#include <functional>
#include <memory>
#include <vector>

namespace cohort {

struct PsContext {
  StrategyOptions::Ps options;
  int rank = 0;
  int workers = 1;
  std::vector<std::string> shards;  // host:port of every shard (used when connect is empty)
  std::string optimizer = "sgd";    // run on the shards
  double lr = 0.01;
  double momentum = 0.9;
  double timeoutSeconds = 60;
  int64_t checkpointEvery = 0;  // shard versions between shard checkpoints
  bool resume = false;
  std::string codec = "none";  // --codec for the pushes (see compress/codec.h)
  int64_t codecWarmupSteps = 0;
  // Test hook: the transport to shard i (defaults to gRPC to shards[i]).
  std::function<std::unique_ptr<ps::ShardClient>(size_t shard)> connect;
  size_t shardCount() const { return shards.size(); }
};

std::unique_ptr<Strategy> makePsStrategy(PsContext context);

}  // namespace cohort
