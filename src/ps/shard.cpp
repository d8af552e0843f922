// A Shard (shard.h): its Init (fresh or resumed), pulls, the arithmetic of an update (apply,
// gather, the gathered step applied), the workers' liveness and clocks, Done, stats and stop. A
// push's path is in shard_push.cpp and the update policies (update_policy.h), streams in
// shard_stream.cpp, checkpoints in shard_checkpoint.cpp.
#include "base/clock.h"
#include "base/launcher_channel.h"
#include "ps/shard.h"

#include "ps/frame.h"
#include "ps/optimizer.h"
#include "ps/shard_internal.h"
#include "ps/update_policy.h"
#include "ps/wire.h"

#include <cohort/checkpoint.h>
#include <cohort/error.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace cohort::ps {

using namespace shard_internal;

namespace shard_internal {

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

UpdateRule serverRule(const wire::Policy& policy) {
  return policy.push() == wire::PUSH_UPDATES ? UpdateRule::kSgd : updateRule(policy.optimizer());
}

Status notInitialized() {
  return Status::error(Code::kUnavailable, "not initialized yet: waiting for the chief's Init");
}

Status nonFinite(const wire::PieceSpec& piece, std::span<const float> values, size_t bad) {
  return Status::error(Code::kInvalidArgument, "push: " + piece.name() + " holds " +
                                                   (std::isnan(values[bad]) ? "NaN" : "Inf") + " at element " +
                                                   std::to_string(bad));
}

Status reinitializedWhileHeld() {
  return Status::error(Code::kAborted, "the shard was re-initialized by a new Init while this push was held");
}

}  // namespace shard_internal

namespace {

bool samePieces(const std::vector<wire::PieceSpec>& a, const google::protobuf::RepeatedPtrField<wire::PieceSpec>& b) {
  if (a.size() != size_t(b.size())) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& q = b.Get(int(i));
    if (a[i].key() != q.key() || a[i].numel() != q.numel() || a[i].row_dim() != q.row_dim()) return false;
  }
  return true;
}

}  // namespace

Shard::Shard(ShardOptions options) : options_(std::move(options)) {
  if (!options_.checkpointDir.empty()) {
    store_ = std::make_unique<CheckpointStore>(options_.checkpointDir, "shard");
    loadCheckpoint();
  }
}

Shard::~Shard() = default;

void Shard::log(const std::string& message) const {
  if (options_.log) {
    options_.log(message);
  } else {
    envOrStandard(options_.env).log(LogLevel::kInfo, options_.name + ": " + message);
  }
}

Status Shard::checkWorker(uint32_t worker) const {
  if (worker < workers_.size()) return Status::Ok();
  return Status::error(Code::kInvalidArgument, "worker " + std::to_string(worker) + " is not in this job of " +
                                                   std::to_string(workers_.size()) + " workers");
}

Status Shard::init(const wire::InitRequest& request, wire::InitReply* reply) {
  if (Status s = checkProtocol(request.protocol()); !s.ok()) return s;
  if (Status s = checkPolicy(request.policy()); !s.ok()) return s;
  const std::vector<wire::PieceSpec> pieces(request.pieces().begin(), request.pieces().end());
  if (Status s = checkPieces(pieces, kMaxElements); !s.ok()) return s;
  if (Status s = checkTensors(request.values(), pieces, true, "Init"); !s.ok()) return s;

  MutexLock lock(mu_);
  if (request.resume() && !initialized_ && store_ && !store_->list().empty()) {
    // Starting afresh would delete them: refuse, and let the user decide.
    return Status::error(Code::kFailedPrecondition,
                         "cannot resume: no checkpoint in " + store_->dir() +
                             " could be restored (the shard's log says why); move them away to start afresh");
  }
  if (initialized_ && request.resume()) return resumeLocked(request, reply);
  if (Status s = checkFitsCheckpoint(request, pieces); !s.ok()) return s;
  startAfreshLocked(request, pieces);
  reply->set_version(version_);
  reply->set_resumed(false);
  for (size_t i = 0; i < workers_.size(); ++i) reply->add_clocks(0);
  return Status::Ok();
}

Status Shard::resumeLocked(const wire::InitRequest& request, wire::InitReply* reply) {
  if (!samePieces(pieces_, request.pieces())) {
    return Status::error(Code::kFailedPrecondition,
                         "this shard holds a different model (" + std::to_string(pieces_.size()) +
                             " pieces) than the chief's (" + std::to_string(request.pieces_size()) +
                             "): resume with the same model and number of shards, or start afresh");
  }
  if (policy_.workers() != request.policy().workers()) {
    return Status::error(Code::kFailedPrecondition, "this shard's state is from a job of " +
                                                        std::to_string(policy_.workers()) + " workers, not " +
                                                        std::to_string(request.policy().workers()));
  }
  // Under push updates the shard runs no optimizer (the workers run theirs) and keeps no state of
  // one: there is nothing to compare. A run that pushes gradients again starts the shard's
  // optimizer afresh (below).
  const bool updatesBefore = policy_.push() == wire::PUSH_UPDATES;
  const bool updatesNow = request.policy().push() == wire::PUSH_UPDATES;
  if (!updatesBefore && !updatesNow &&
      (policy_.optimizer() != request.policy().optimizer() || policy_.momentum() != request.policy().momentum())) {
    return Status::error(Code::kFailedPrecondition, "this shard's state is for optimizer " +
                                                        std::string(optimizerName(policy_.optimizer())) +
                                                        " (momentum " + std::to_string(policy_.momentum()) + "), not " +
                                                        optimizerName(request.policy().optimizer()) + " (momentum " +
                                                        std::to_string(request.policy().momentum()) +
                                                        "): resume with the same optimizer, or start afresh");
  }
  // The step or group being gathered. sync's pushers are held, and this Init aborts them: their
  // workers push those batches again, so their gradients go. softsync's were answered: its group
  // is applied now, not lost, and not carried into a mode the resumed job may change.
  if (policy_.mode() == wire::MODE_SYNC) {
    clearPendingLocked();
  } else if (pendingCount_ > 0) {
    applyPendingLocked();
  }
  policy_ = request.policy();  // the resumed job may change mode or learning rate
  updatePolicy_ = UpdatePolicy::make(policy_);
  if (updatesBefore != updatesNow) {
    // Into push updates: the optimizer's state goes (no slots to keep or checkpoint). Out of it:
    // the shard's optimizer starts from its first step.
    optimizer_ =
        std::make_unique<ServerOptimizer>(serverRule(policy_), policy_.lr(), policy_.momentum(), values_.size());
    pieceSteps_.assign(pieces_.size(), 0);
  }
  optimizer_->setLr(policy_.lr());
  ++generation_;
  initSinceStart_ = true;
  failure_.reset();
  finished_ = false;
  stopJob_ = false;
  // A worker whose step closed while its push waited for the lock has that push applied, though
  // its reply (and clock) never came: it goes on after it, as a checkpoint counts it.
  for (auto& w : workers_) w = Worker{.clock = w.clock + (w.inClosedStep ? 1 : 0), .lastSeen = now()};
  reply->set_version(version_);
  reply->set_resumed(true);
  for (const auto& w : workers_) reply->add_clocks(w.clock);
  log("resumed at version " + std::to_string(version_));
  return Status::Ok();
}

Status Shard::checkFitsCheckpoint(const wire::InitRequest& request, const std::vector<wire::PieceSpec>& pieces) const {
  if (!store_) return Status::Ok();
  uint64_t total = 0;
  for (const auto& p : pieces) total += p.numel();
  const uint64_t slots = uint64_t(ServerOptimizer::slotCount(serverRule(request.policy())));
  if ((1 + slots) * total * sizeof(float) > kMaxCheckpointBytes) {
    return Status::error(Code::kInvalidArgument,
                         "this shard's part of the model (" + std::to_string(total) +
                             " values and their optimizer state) is too large for one checkpoint (2 GiB): "
                             "use more shards");
  }
  return Status::Ok();
}

void Shard::clearPendingLocked() {
  pending_.assign(values_.size(), 0.0f);
  pendingMarked_.assign(pieces_.size(), {});
  pendingRows_.assign(pieces_.size(), {});
  pendingCount_ = 0;
  pendingPieceCount_.assign(pieces_.size(), 0);
  pendingPieceGradient_.assign(pieces_.size(), 0);
  pendingFrom_.assign(policy_.workers(), false);
}

void Shard::startAfreshLocked(const wire::InitRequest& request, const std::vector<wire::PieceSpec>& pieces) {
  policy_ = request.policy();
  updatePolicy_ = UpdatePolicy::make(policy_);
  pieces_.assign(pieces.begin(), pieces.end());
  values_.clear();
  for (const auto& t : request.values()) appendFloats(t, values_);
  optimizer_ = std::make_unique<ServerOptimizer>(serverRule(policy_), policy_.lr(), policy_.momentum(), values_.size());
  pieceSteps_.assign(pieces_.size(), 0);
  version_ = 0;
  lastCheckpointVersion_ = 0;
  workers_.assign(policy_.workers(), Worker{.lastSeen = now()});
  clearPendingLocked();
  failure_.reset();
  finished_ = false;
  stopJob_ = false;
  stats_ = wire::StatsReply();
  stalenessSum_ = 0;
  checkpointDue_ = false;
  nextCheckpoint_.reset();
  if (store_) {
    // A fresh run replaces an earlier run's checkpoints, so a restart never picks up those. Under
    // writeMu_: a write under way ends first (and is removed), and one of the old run's copies not
    // yet written is skipped (run_).
    MutexLock writing(writeMu_);
    run_.fetch_add(1);
    for (const auto& f : store_->list()) {
      std::error_code error;
      std::filesystem::remove(f.path, error);
      if (error) log("could not remove the earlier run's checkpoint " + f.path + ": " + error.message());
    }
  }
  initialized_ = true;
  initSinceStart_ = true;
  ++generation_;  // pushes held under the old state see it and give up
  changed_.notifyAll();
}

void Shard::fillValuesLocked(google::protobuf::RepeatedPtrField<wire::Tensor>* out, std::vector<float>* framed) {
  size_t at = 0;
  for (const auto& p : pieces_) {
    if (framed == nullptr) {
      setTensor(out->Add(), p, values_.data() + at);
    } else {
      wire::Tensor* t = out->Add();
      t->set_key(p.key());
      t->set_numel(p.numel());
      t->set_dtype(wire::FLOAT32);
    }
    at += p.numel();
  }
  if (framed != nullptr) framed->insert(framed->end(), values_.begin(), values_.end());
  stats_.set_bytes_pulled(stats_.bytes_pulled() + int64_t(values_.size() * sizeof(float)));
}

// A push's reply: every piece, or (row-sparse) the dense pieces and the rows asked for.
void Shard::fillReplyLocked(const wire::PushRequest& request, wire::PushReply* reply, std::vector<float>* framed) {
  if (!request.row_sparse() || request.want_all_rows()) {
    fillValuesLocked(reply->mutable_values(), framed);
    return;
  }
  size_t at = 0;
  int64_t bytes = 0;
  for (const auto& p : pieces_) {
    if (p.row_dim() == 0) {
      setTensor(reply->add_values(), p, values_.data() + at);
      bytes += int64_t(p.numel() * sizeof(float));
    } else {
      const uint64_t count = p.numel() / p.row_dim();
      for (const auto& want : request.want_rows()) {
        // Checked against the pieces before the lock; an Init since may have changed them.
        if (want.key() != p.key() || (want.rows_size() > 0 && want.rows(want.rows_size() - 1) >= count)) continue;
        wire::Rows* rows = reply->add_rows();
        setRows(rows, p, std::span<const uint32_t>(want.rows().data(), size_t(want.rows_size())), values_.data() + at);
        bytes += int64_t(rows->ByteSizeLong());
      }
    }
    at += size_t(p.numel());
  }
  stats_.set_bytes_pulled(stats_.bytes_pulled() + bytes);
}

Status Shard::pull(const wire::PullRequest& request, wire::PullReply* reply) {
  if (Status s = checkProtocol(request.protocol()); !s.ok()) return s;
  MutexLock lock(mu_);
  if (!initialized_ || (request.initial() && !initSinceStart_)) return notInitialized();
  if (Status s = checkWorker(request.worker()); !s.ok()) return s;
  if (failure_) return Status::error(Code::kAborted, *failure_);
  Worker& w = workers_[request.worker()];
  w.lastSeen = now();
  reply->set_version(version_);
  reply->set_samples_total(stats_.samples_total());
  reply->set_stop_job(stopJob_);
  fillValuesLocked(reply->mutable_values());
  return Status::Ok();
}

void Shard::noteStalenessLocked(int64_t tau) {
  auto* h = stats_.mutable_staleness_histogram();
  while (h->size() < kHistogramBuckets) h->Add(0);
  (*h)[int(std::min(tau, kHistogramBuckets - 1))] += 1;
  stalenessSum_ += double(tau);
  stats_.set_staleness_max(std::max(stats_.staleness_max(), tau));
}

void Shard::applyPieceLocked(size_t k, size_t at, const Part& part, float scale) {
  if (part.noGradient || part.alreadyIn) return;
  const bool updates = policy_.push() == wire::PUSH_UPDATES;
  const int64_t step = updates ? 0 : ++pieceSteps_[k];
  // A row-sparse part updates its rows alone: untouched rows and their optimizer state are left
  // as they are (lazy updates); the piece's step counts all the same (Adam's bias correction
  // counts every step).
  auto apply = [&](size_t offset, std::span<const float> g) {
    mu_.assertHeld();  // called below, under the lock applyPieceLocked requires
    std::span<float> v(values_.data() + offset, g.size());
    if (updates) {
      for (size_t i = 0; i < g.size(); ++i) v[i] += scale * g[i];
    } else {
      optimizer_->applyPartAtStep(offset, v, g, scale, step);
    }
  };
  if (part.rowDim == 0) {
    apply(at, part.values);
  } else {
    for (size_t i = 0; i < part.rows.size(); ++i) {
      apply(at + size_t(part.rows[i]) * part.rowDim, part.values.subspan(i * part.rowDim, part.rowDim));
    }
  }
}

void Shard::finishUpdateLocked() {
  ++version_;
  envOrStandard(options_.env).fault("ps.shard.version", int64_t(version_));
  changed_.notifyAll();
  maybeCheckpointLocked();
}

void Shard::applyLocked(const Parts& parts, float scale) {
  size_t at = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    applyPieceLocked(k, at, parts[k], scale);
    at += parts[k].numel;
  }
  finishUpdateLocked();
}

void Shard::accumulatePieceLocked(size_t k, size_t at, const Part& part, float scale) {
  if (part.alreadyIn) return;
  pendingPieceCount_[k] += 1;
  if (part.noGradient) return;
  pendingPieceGradient_[k] = 1;
  if (part.rowDim == 0) {
    float* p = pending_.data() + at;
    for (size_t i = 0; i < part.values.size(); ++i) p[i] += scale * part.values[i];
  } else {
    if (pendingMarked_[k].empty()) pendingMarked_[k].assign(part.numel / part.rowDim, 0);
    for (size_t i = 0; i < part.rows.size(); ++i) {
      const uint32_t r = part.rows[i];
      float* p = pending_.data() + at + size_t(r) * part.rowDim;
      const float* g = part.values.data() + i * part.rowDim;
      for (size_t j = 0; j < part.rowDim; ++j) p[j] += scale * g[j];
      if (!pendingMarked_[k][r]) {
        pendingMarked_[k][r] = 1;
        pendingRows_[k].push_back(r);
      }
    }
  }
}

void Shard::accumulateLocked(const Parts& parts, float scale) {
  size_t at = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    accumulatePieceLocked(k, at, parts[k], scale);
    at += parts[k].numel;
  }
  pendingCount_ += 1;
}

// Applies the average of the gathered gradients (sync, softsync) and starts a new gathering.
void Shard::applyPendingLocked() {
  // Each piece averaged over the gradients it was given: pendingCount_ for all of them unless a
  // streamed push ended midway, or a sync step closed on one midway. A piece given none, or only
  // pushes without a gradient for it, is left alone (no optimizer step).
  std::vector<float> gathered;
  size_t at = 0;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const size_t numel = size_t(pieces_[k].numel());
    const size_t dim = size_t(pieces_[k].row_dim());
    const int count = pendingPieceGradient_[k] ? pendingPieceCount_[k] : 0;
    if (count > 0 && dim == 0) {
      applyPieceLocked(k, at,
                       {.values = std::span<const float>(pending_).subspan(at, numel), .rows = {}, .numel = numel},
                       1.0f / float(count));
    } else if (count > 0) {
      // The touched rows, in increasing order, gathered side by side.
      std::vector<uint32_t>& rows = pendingRows_[k];
      std::sort(rows.begin(), rows.end());
      gathered.resize(rows.size() * dim);
      for (size_t i = 0; i < rows.size(); ++i) {
        std::memcpy(gathered.data() + i * dim, pending_.data() + at + size_t(rows[i]) * dim, dim * sizeof(float));
      }
      applyPieceLocked(k, at, {.values = gathered, .rows = rows, .numel = numel, .rowDim = dim}, 1.0f / float(count));
    }
    at += numel;
  }
  finishUpdateLocked();
  at = 0;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const size_t numel = size_t(pieces_[k].numel());
    const size_t dim = size_t(pieces_[k].row_dim());
    if (dim == 0) {
      std::fill_n(pending_.begin() + ptrdiff_t(at), numel, 0.0f);
    } else {
      for (uint32_t r : pendingRows_[k]) {
        std::fill_n(pending_.begin() + ptrdiff_t(at + size_t(r) * dim), dim, 0.0f);
        pendingMarked_[k][r] = 0;
      }
      pendingRows_[k].clear();
    }
    at += numel;
  }
  pendingCount_ = 0;
  std::fill(pendingPieceCount_.begin(), pendingPieceCount_.end(), 0);
  std::fill(pendingPieceGradient_.begin(), pendingPieceGradient_.end(), 0);
  std::fill(pendingFrom_.begin(), pendingFrom_.end(), false);
}

void Shard::markLostLocked(Clock::time_point now) {
  const auto limit = std::chrono::duration<double>(policy_.timeout_s());
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (w.done || w.lost || now - w.lastSeen <= limit) continue;
    w.lost = true;
    log("worker " + std::to_string(i) + " is lost: nothing from it for " + seconds(policy_.timeout_s()) +
        " (at its step " + std::to_string(w.clock) + ")");
    changed_.notifyAll();
    applyLastGroupLocked();
  }
}

void Shard::applyLastGroupLocked() {
  if (!initialized_ || policy_.mode() != wire::MODE_SOFTSYNC) return;
  if (std::none_of(pendingPieceCount_.begin(), pendingPieceCount_.end(), [](int n) { return n > 0; })) return;
  for (const auto& w : workers_) {
    if (!w.done && !w.lost && !w.finishing) return;  // it may still complete the group
  }
  log("applied the last group of " + std::to_string(pendingCount_) + " gradient(s), short of " +
      std::to_string(policy_.softsync()) + ": no worker pushes any more");
  applyPendingLocked();
}

void Shard::finishIfAllDoneLocked() {
  if (finished_) return;
  bool allOver = true;
  bool anyDone = false;
  for (const auto& w : workers_) {
    allOver = allOver && (w.done || w.lost);
    anyDone = anyDone || w.done;
  }
  if (!allOver || !anyDone) return;
  applyLastGroupLocked();  // into the final checkpoint
  finished_ = true;
  checkpointLocked();
  changed_.notifyAll();
}

Status Shard::push(const wire::PushRequest& request, wire::PushReply* reply) {
  const Status status = handlePush(request, nullptr, nullptr, reply, nullptr);
  writeDueCheckpoint();  // after the reply is made and the lock released: the write holds no one
  return status;
}

Status Shard::pushFramed(const wire::PushRequest& request, const FramePayload& payload, wire::PushReply* reply,
                         std::vector<float>* replyValues) {
  const Status status = handlePush(request, &payload, nullptr, reply, replyValues);
  writeDueCheckpoint();
  return status;
}

Status Shard::done(const wire::DoneRequest& request, wire::DoneReply* reply) {
  if (Status s = checkProtocol(request.protocol()); !s.ok()) return s;
  MutexLock lock(mu_);
  if (!initialized_) return notInitialized();
  if (Status s = checkWorker(request.worker()); !s.ok()) return s;
  Worker& w = workers_[request.worker()];
  w.done = true;
  w.lost = false;
  w.lastSeen = now();
  changed_.notifyAll();
  applyLastGroupLocked();  // before the chief's final pull, which comes after the others' Done
  finishIfAllDoneLocked();
  reply->set_all_done(finished_);
  if (finalCheckpointError_) reply->set_final_checkpoint_error(*finalCheckpointError_);
  return Status::Ok();
}

Status Shard::stats(const wire::StatsRequest& request, wire::StatsReply* reply) {
  if (Status s = checkProtocol(request.protocol()); !s.ok()) return s;
  MutexLock lock(mu_);
  if (request.stop_job() && initialized_ && !stopJob_) {
    stopJob_ = true;
    log("the chief stops the job: every worker stops at its next push");
    changed_.notifyAll();
  }
  if (request.has_worker() && request.worker() < workers_.size()) {
    Worker& w = workers_[request.worker()];  // waiting on the others, not lost
    w.lastSeen = now();
    w.lost = false;
    if (request.finishing() && !w.finishing) {
      w.finishing = true;
      changed_.notifyAll();  // a sync step held for it may close now
      applyLastGroupLocked();
    }
  }
  *reply = stats_;
  reply->set_initialized(initialized_);
  reply->set_version(version_);
  const int64_t counted = stats_.applied();
  reply->set_staleness_mean(counted > 0 ? stalenessSum_ / double(counted) : 0.0);
  for (const auto& w : workers_) {
    reply->add_clocks(w.clock);
    reply->add_done(w.done);
    reply->add_lost(w.lost);
  }
  return Status::Ok();
}

void Shard::countUnauthenticated() {
  MutexLock lock(mu_);
  stats_.set_unauthenticated(stats_.unauthenticated() + 1);
}

std::optional<std::string> Shard::waitFinished(std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  const auto until = Clock::now() + timeout;
  while (!finished_ && !failure_) {
    if (initialized_) {
      markLostLocked(now());
      finishIfAllDoneLocked();
      if (finished_) break;
    }
    if (changed_.waitUntil(mu_, std::min(until, Clock::now() + kTick)) == std::cv_status::timeout &&
        Clock::now() >= until) {
      break;
    }
  }
  return failure_;
}

bool Shard::finished() const {
  MutexLock lock(mu_);
  return finished_;
}

void Shard::stop(const std::string& reason) {
  MutexLock lock(mu_);
  if (!failure_) failure_ = reason;
  changed_.notifyAll();
}

}  // namespace cohort::ps
