// What the files of the Shard (shard.cpp, shard_push.cpp, shard_stream.cpp, shard_checkpoint.cpp)
// and of its update policies (update_policy.h) share: its limits and the helpers their messages
// use. Private to src/ps.
#pragma once

#include "base/clock.h"
#include "ps.pb.h"
#include "ps/optimizer.h"
#include "ps/shard.h"
#include "ps/status.h"

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

namespace cohort::ps::shard_internal {

// The staleness histogram's last bucket counts every tau at or above it.
constexpr int64_t kHistogramBuckets = 64;
// Model size one shard accepts (elements): 8 GiB of float32.
constexpr uint64_t kMaxElements = uint64_t(1) << 31;
// Steps a worker may claim to have pushed (far beyond any run; keeps clock arithmetic exact).
constexpr int64_t kMaxClock = int64_t(1) << 50;
// How often a held push looks again for lost workers.
constexpr auto kTick = std::chrono::milliseconds(100);
// Protobuf refuses to serialize a message of 2 GiB or more; a checkpoint holds the values and
// up to two optimizer slots.
constexpr uint64_t kMaxCheckpointBytes = (uint64_t(1) << 31) - (uint64_t(64) << 20);

// The rule the shard's optimizer runs: the policy's optimizer, or none (plain sgd, no state) under
// push updates, where the workers run theirs and the shard only adds what they send.
UpdateRule serverRule(const wire::Policy& policy);

// "60 s", "0.5 s": a timeout as the user gave it.
std::string seconds(double s);

// UNAVAILABLE, so that clients retry until the chief's Init arrives.
Status notInitialized();

// A push's piece holding NaN or Inf at element `bad`.
Status nonFinite(const wire::PieceSpec& piece, std::span<const float> values, size_t bad);

// A push held across an Init that replaced the layout.
Status reinitializedWhileHeld();

}  // namespace cohort::ps::shard_internal

namespace cohort::ps {

struct Shard::Worker {
  int64_t clock = 0;  // pushes handled (applied or dropped)
  bool done = false;
  bool lost = false;
  bool held = false;  // ssp: a push of its is waiting for the slowest to catch up
  // It made its last push and waits for the others (StatsRequest.finishing): a sync step closes
  // without it, as without a worker that said Done. A push of its (a restarted worker) clears it.
  bool finishing = false;
  // sync: its gradient is in a step that has closed, and the push's reply, which counts it in
  // `clock`, has not run yet (it waits for the lock). A checkpoint taken meanwhile counts it: every
  // worker's clock in a checkpoint of version V is then V, and all resume at the same step.
  bool inClosedStep = false;
  // sync: the clock of its push held in the step being gathered (-1: none). A retry of that push
  // (its connection dropped while it was held) waits for it and is answered as its duplicate.
  int64_t heldClock = -1;
  // Its push of clock `pushingClock` (under Init `pushingGeneration`) not counted yet, of which
  // pieces [0, piecesIn) are applied or gathered: by a streamed attempt cut midway, or by one
  // still arriving. Pieces come in order, so a prefix. A retry of that push (the worker's client
  // sends it whole again, on a new connection, while the cut attempt may still take in a chunk
  // gRPC had read) applies only the pieces from piecesIn on: each piece once per push.
  int64_t pushingClock = -1;
  uint64_t pushingGeneration = 0;
  size_t piecesIn = 0;
  Clock::time_point lastSeen;  // on the shard's clock (Shard::now()), set when the worker is made
};

}  // namespace cohort::ps
