// A Shard's checkpoints: when they are due, the state copied under the lock and written outside
// it, a failed write (logged, counted; fatal only for the final one), and the restore at start
// from the newest readable one.
#include "base/clock.h"
#include "base/launcher_channel.h"
#include "ps/frame.h"
#include "ps/optimizer.h"
#include "ps/shard.h"
#include "ps/shard_internal.h"
#include "ps/update_policy.h"
#include "ps/wire.h"

#include <cohort/checkpoint.h>
#include <cohort/error.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

namespace cohort::ps {

using namespace shard_internal;

void Shard::checkpoint() {
  std::optional<Snapshot> snapshot;
  {
    MutexLock lock(mu_);
    snapshot = snapshotLocked();
  }
  if (!snapshot) return;
  if (const auto error = writeCheckpoint(*snapshot)) {
    log("checkpoint failed: " + *error);
    MutexLock lock(mu_);
    noteCheckpointFailedLocked(*error);
  }
}

std::optional<std::string> Shard::finalCheckpointError() const {
  MutexLock lock(mu_);
  return finalCheckpointError_;
}

void Shard::maybeCheckpointLocked() {
  if (!store_ || policy_.checkpoint_every() <= 0) return;
  if (version_ - lastCheckpointVersion_ >= uint64_t(policy_.checkpoint_every())) checkpointDue_ = true;
}

// One pusher at a time writes; a checkpoint that falls due meanwhile is left to it (the newest
// copy replaces an older one not yet written), so that no other push waits for a write.
void Shard::writeDueCheckpoint() {
  {
    MutexLock lock(mu_);
    if (!checkpointDue_) return;
    checkpointDue_ = false;
    std::optional<Snapshot> snapshot;
    try {  // a copy of the whole state: it may not fit, and the push it follows is applied already
      snapshot = snapshotLocked();
    } catch (const std::exception& e) {
      const std::string error = "the state could not be copied for a checkpoint: " + std::string(e.what());
      log("checkpoint failed, training goes on: " + error);
      noteCheckpointFailedLocked(error);
      return;
    }
    if (!snapshot) return;
    nextCheckpoint_ = std::move(snapshot);
    if (writingCheckpoints_) return;
    writingCheckpoints_ = true;
  }
  for (;;) {
    std::optional<Snapshot> next;
    {
      MutexLock lock(mu_);
      if (!nextCheckpoint_) {
        writingCheckpoints_ = false;
        return;
      }
      next.swap(nextCheckpoint_);
    }
    if (const auto error = writeCheckpoint(*next)) {
      log("checkpoint failed, training goes on: " + *error);
      MutexLock lock(mu_);
      noteCheckpointFailedLocked(*error);
    }
  }
}

// The final checkpoint, when every worker is done: nothing is pushed any more, so holding the lock
// through the write stops no one, and waitFinished() returns only once it is on disk (or failed:
// then finalCheckpointError_ says so before the last worker's Done is answered).
void Shard::checkpointLocked() {
  auto snapshot = snapshotLocked();
  if (!snapshot) return;
  const auto error = writeCheckpoint(*snapshot);
  if (!error) return;
  noteCheckpointFailedLocked(*error);
  std::string message = options_.name + ": the final checkpoint (version " + std::to_string(snapshot->state.version()) +
                        ") could not be written to " + store_->dir() + ": " + *error + "; ";
  std::vector<CheckpointFile> kept;
  {
    MutexLock lock(writeMu_);  // store_ is not thread-safe
    kept = store_->list();
  }
  message += kept.empty() ? "no earlier checkpoint is there"
                          : "the newest checkpoint kept there is " + kept.front().path + " (version " +
                                std::to_string(kept.front().step) + ")";
  message +=
      "; the run's result is in the chief's done event: free space on that disk or give another --checkpoint-dir";
  finalCheckpointError_ = message;
}

std::optional<Shard::Snapshot> Shard::snapshotLocked() {
  if (!store_ || !initialized_) return std::nullopt;
  Snapshot snapshot{.state = {}, .run = run_.load()};
  wire::ShardCheckpoint& c = snapshot.state;
  *c.mutable_policy() = policy_;
  for (const auto& p : pieces_) *c.add_pieces() = p;
  c.set_version(version_);
  c.set_values(reinterpret_cast<const char*>(values_.data()), values_.size() * sizeof(float));
  for (const auto& slot : optimizer_->slots()) {
    c.add_optimizer_slots(reinterpret_cast<const char*>(slot.data()), slot.size() * sizeof(float));
  }
  int64_t steps = 0;
  for (const int64_t n : pieceSteps_) {
    c.add_piece_steps(n);
    steps = std::max(steps, n);
  }
  c.set_optimizer_steps(steps);
  for (const auto& w : workers_) c.add_clocks(w.clock + (w.inClosedStep ? 1 : 0));
  *c.mutable_stats() = stats_;
  c.mutable_stats()->set_staleness_mean(stats_.applied() > 0 ? stalenessSum_ / double(stats_.applied()) : 0.0);
  lastCheckpointVersion_ = version_;
  return snapshot;
}

std::optional<std::string> Shard::writeCheckpoint(const Snapshot& snapshot) {
  MutexLock lock(writeMu_);
  // A fresh Init removed the checkpoints of the run this copy is of; it would come back as the newest.
  if (snapshot.run != run_.load()) return std::nullopt;
  const wire::ShardCheckpoint& state = snapshot.state;
  // Never throws: a writer that did would leave writingCheckpoints_ set, and no checkpoint after.
  try {
    if (options_.beforeCheckpointWrite) options_.beforeCheckpointWrite(state.version());
    std::string bytes;
    if (!state.SerializeToString(&bytes)) {
      return "the state of version " + std::to_string(state.version()) + " could not be serialized (over 2 GiB?)";
    }
    store_->save(int64_t(state.version()), std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  } catch (const std::exception& e) {  // cohort's IoError, or std::bad_alloc for the serialized copy
    return std::string(e.what());
  }
  launcher::tellShardHasCheckpoint();  // a restart alone now has a state to come back to
  return std::nullopt;
}

void Shard::noteCheckpointFailedLocked(const std::string& error) {
  stats_.set_checkpoints_failed(stats_.checkpoints_failed() + 1);
  stats_.set_checkpoint_error(error);
}

bool Shard::loadCheckpoint() {
  // The newest one that reads and makes sense; an unusable one is named and the next tried.
  for (const auto& file : store_->list()) {
    std::vector<uint8_t> payload;
    try {
      payload = CheckpointStore::readVerified(file.path);
    } catch (const Error& e) {
      log(std::string(e.what()) + "; trying an older one");
      continue;
    }
    if (restoreFrom(file.path, payload)) return true;
  }
  return false;
}

bool Shard::restoreFrom(const std::string& path, const std::vector<uint8_t>& bytes) {
  wire::ShardCheckpoint c;
  const auto corrupt = [&](const std::string& why) {
    log(path + ": " + why + "; trying an older one");
    return false;
  };
  if (!c.ParseFromArray(bytes.data(), int(bytes.size()))) return corrupt("not a shard checkpoint");
  if (!checkPolicy(c.policy()).ok()) return corrupt("its policy is invalid");
  const std::vector<wire::PieceSpec> pieces(c.pieces().begin(), c.pieces().end());
  if (!checkPieces(pieces, kMaxElements).ok()) return corrupt("its pieces are invalid");
  uint64_t total = 0;
  for (const auto& p : pieces) total += p.numel();
  if (c.values().size() != total * sizeof(float)) return corrupt("its values do not match its pieces");
  auto optimizer =
      std::make_unique<ServerOptimizer>(serverRule(c.policy()), c.policy().lr(), c.policy().momentum(), size_t(total));
  // Under push updates the shard keeps no optimizer state; slots there (written before it kept
  // none) were never used.
  const bool updates = c.policy().push() == wire::PUSH_UPDATES;
  if (!updates && optimizer->slots().size() != size_t(c.optimizer_slots_size()))
    return corrupt("its optimizer state is incomplete");
  for (size_t s = 0; s < optimizer->slots().size(); ++s) {
    const std::string& slot = c.optimizer_slots(int(s));
    if (slot.size() != total * sizeof(float)) return corrupt("its optimizer state has the wrong size");
    std::memcpy(optimizer->slots()[s].data(), slot.data(), slot.size());
  }
  if (c.clocks_size() != int(c.policy().workers())) return corrupt("its worker clocks do not match its policy");
  if (c.piece_steps_size() != 0 && c.piece_steps_size() != int(pieces.size())) {
    return corrupt("its optimizer steps do not match its pieces");
  }
  std::vector<int64_t> pieceSteps(pieces.size(), c.optimizer_steps());
  for (int k = 0; k < c.piece_steps_size(); ++k) pieceSteps[size_t(k)] = c.piece_steps(k);

  MutexLock lock(mu_);
  policy_ = c.policy();
  updatePolicy_ = UpdatePolicy::make(policy_);
  pieces_.assign(pieces.begin(), pieces.end());
  values_.resize(size_t(total));
  std::memcpy(values_.data(), c.values().data(), c.values().size());
  optimizer_ = std::move(optimizer);
  pieceSteps_ = std::move(pieceSteps);
  version_ = c.version();
  lastCheckpointVersion_ = version_;
  workers_.assign(policy_.workers(), Worker{.lastSeen = now()});
  for (size_t i = 0; i < workers_.size(); ++i) workers_[i].clock = c.clocks(int(i));
  clearPendingLocked();
  stats_ = c.stats();
  stalenessSum_ = stats_.staleness_mean() * double(stats_.applied());
  initialized_ = true;
  initSinceStart_ = options_.restartedInJob;  // ShardOptions::restartedInJob
  log("restored from " + path + " at version " + std::to_string(version_));
  launcher::tellShardHasCheckpoint();
  return true;
}

}  // namespace cohort::ps
