#include "base/clock.h"
#include "base/launcher_channel.h"
#include "ps/shard.h"

#include "ps/frame.h"
#include "ps/optimizer.h"
#include "ps/wire.h"

#include <cohort/checkpoint.h>
#include <cohort/error.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace cohort::ps {

static void killIfTestSaysSo(uint64_t version);  // testing; below

namespace {

// The staleness histogram's last bucket counts every tau at or above it.
constexpr int64_t kHistogramBuckets = 64;
// Model size one shard accepts (elements): 8 GiB of float32.
constexpr uint64_t kMaxElements = uint64_t(1) << 31;
// Steps a worker may claim to have pushed (far beyond any run; keeps clock arithmetic exact).
constexpr int64_t kMaxClock = int64_t(1) << 50;
// How often a held push looks again for lost workers.
constexpr auto kTick = std::chrono::milliseconds(100);

// "60 s", "0.5 s": a timeout as the user gave it.
std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

// Protobuf refuses to serialize a message of 2 GiB or more; a checkpoint holds the values and
// up to two optimizer slots.
constexpr uint64_t kMaxCheckpointBytes = (uint64_t(1) << 31) - (uint64_t(64) << 20);

Status notInitialized() {
  // UNAVAILABLE, so that clients retry until the chief's Init arrives.
  return Status::error(Code::kUnavailable, "not initialized yet: waiting for the chief's Init");
}

bool samePieces(const std::vector<wire::PieceSpec>& a, const google::protobuf::RepeatedPtrField<wire::PieceSpec>& b) {
  if (a.size() != size_t(b.size())) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& q = b.Get(int(i));
    if (a[i].key() != q.key() || a[i].numel() != q.numel() || a[i].row_dim() != q.row_dim()) return false;
  }
  return true;
}

}  // namespace

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
  Clock::time_point lastSeen = Clock::now();
};

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
    std::fprintf(stderr, "cohort %s: %s\n", options_.name.c_str(), message.c_str());
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
  if (initialized_ && request.resume()) {
    if (!samePieces(pieces_, request.pieces())) {
      return Status::error(Code::kFailedPrecondition,
                           "this shard holds a different model (" + std::to_string(pieces_.size()) +
                               " pieces) than the chief's (" + std::to_string(request.pieces_size()) +
                               "): resume with the same model and number of shards, or start afresh");
    }
    if (policy_.workers() != request.policy().workers()) {
      return Status::error(Code::kFailedPrecondition,
                           "this shard's state is from a job of " + std::to_string(policy_.workers()) +
                               " workers, not " + std::to_string(request.policy().workers()));
    }
    if (policy_.optimizer() != request.policy().optimizer() || policy_.momentum() != request.policy().momentum()) {
      return Status::error(Code::kFailedPrecondition,
                           "this shard's state is for optimizer " + policy_.optimizer() + " (momentum " +
                               std::to_string(policy_.momentum()) + "), not " + request.policy().optimizer() +
                               " (momentum " + std::to_string(request.policy().momentum()) +
                               "): resume with the same optimizer, or start afresh");
    }
    policy_ = request.policy();  // the resumed job may change mode or learning rate
    optimizer_->setLr(policy_.lr());
    ++generation_;
    initSinceStart_ = true;
    failure_.reset();
    finished_ = false;
    stopJob_ = false;
    for (auto& w : workers_) w = Worker{.clock = w.clock, .lastSeen = Clock::now()};
    reply->set_version(version_);
    reply->set_resumed(true);
    for (const auto& w : workers_) reply->add_clocks(w.clock);
    log("resumed at version " + std::to_string(version_));
    return Status::Ok();
  }

  if (store_) {
    uint64_t total = 0;
    for (const auto& p : pieces) total += p.numel();
    const uint64_t slots =
        request.policy().push() == "updates" ? 0 : uint64_t(ServerOptimizer::slotCount(request.policy().optimizer()));
    if ((1 + slots) * total * sizeof(float) > kMaxCheckpointBytes) {
      return Status::error(Code::kInvalidArgument,
                           "this shard's part of the model (" + std::to_string(total) +
                               " values and their optimizer state) is too large for one checkpoint (2 GiB): "
                               "use more shards");
    }
  }
  policy_ = request.policy();
  pieces_.assign(pieces.begin(), pieces.end());
  values_.clear();
  for (const auto& t : request.values()) appendFloats(t, values_);
  optimizer_ = std::make_unique<ServerOptimizer>(policy_.optimizer(), policy_.lr(), policy_.momentum(), values_.size());
  pieceSteps_.assign(pieces_.size(), 0);
  version_ = 0;
  lastCheckpointVersion_ = 0;
  workers_.assign(policy_.workers(), Worker{});
  pending_.assign(values_.size(), 0.0f);
  pendingMarked_.assign(pieces_.size(), {});
  pendingRows_.assign(pieces_.size(), {});
  pendingCount_ = 0;
  pendingPieceCount_.assign(pieces_.size(), 0);
  pendingFrom_.assign(policy_.workers(), false);
  failure_.reset();
  finished_ = false;
  stopJob_ = false;
  stats_ = wire::StatsReply();
  stalenessSum_ = 0;
  if (store_) {
    // A fresh run replaces an earlier run's checkpoints, so a restart never picks up those.
    for (const auto& f : store_->list()) std::filesystem::remove(f.path);
  }
  initialized_ = true;
  initSinceStart_ = true;
  ++generation_;  // pushes held under the old state see it and give up
  changed_.notifyAll();
  reply->set_version(version_);
  reply->set_resumed(false);
  for (size_t i = 0; i < workers_.size(); ++i) reply->add_clocks(0);
  return Status::Ok();
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
  w.lastSeen = Clock::now();
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
  const bool updates = policy_.push() == "updates";
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
  killIfTestSaysSo(version_);
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
  pendingPieceCount_[k] += 1;
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
  // streamed push ended midway, or a sync step closed on one midway. A piece given none is left
  // alone (no optimizer step).
  std::vector<float> gathered;
  size_t at = 0;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const size_t numel = size_t(pieces_[k].numel());
    const size_t dim = size_t(pieces_[k].row_dim());
    const int count = pendingPieceCount_[k];
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
  }
}

int64_t Shard::slowestClockLocked() const {
  int64_t slowest = INT64_MAX;
  for (const auto& w : workers_) {
    if (!w.done && !w.lost) slowest = std::min(slowest, w.clock);
  }
  return slowest;
}

// The ssp record, measured independently of the hold decision: how far the fastest worker that
// is free to compute is ahead of the slowest live one.
void Shard::recordClockGapLocked() {
  const int64_t slowest = slowestClockLocked();
  if (slowest == INT64_MAX) return;
  int64_t fastest = INT64_MIN;
  for (const auto& w : workers_) {
    if (!w.done && !w.lost && !w.held) fastest = std::max(fastest, w.clock);
  }
  if (fastest != INT64_MIN) stats_.set_max_clock_gap(std::max(stats_.max_clock_gap(), fastest - slowest));
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

namespace {

Status nonFinite(const wire::PieceSpec& piece, std::span<const float> values, size_t bad) {
  return Status::error(Code::kInvalidArgument, "push: " + piece.name() + " holds " +
                                                   (std::isnan(values[bad]) ? "NaN" : "Inf") + " at element " +
                                                   std::to_string(bad));
}

}  // namespace

Status Shard::beginStream(const wire::PushRequest& request, std::unique_ptr<Stream>* stream) {
  std::vector<wire::PieceSpec> pieces;
  if (Status s = admitPush(request, &pieces); !s.ok()) return s;
  uint64_t bytes = 0;
  for (const auto& p : pieces) bytes += p.numel() * sizeof(float);
  Status s = !request.compressed().empty() || request.row_sparse() || request.rows_size() > 0 ||
                     request.want_rows_size() > 0
                 ? Status::error(Code::kInvalidArgument,
                                 "push: a streamed push carries float32 values only (no codec, no rows): send "
                                 "compressed and row-sparse pushes with Push")
                 : checkFramedTensors(request.values(), pieces, size_t(bytes), "push");
  if (!s.ok()) {
    countRejected(s);
    return s;
  }
  auto opened = std::make_unique<Stream>();
  opened->request = request;
  opened->dense.resize(pieces.size());
  opened->copies.resize(pieces.size());
  opened->pieces = std::move(pieces);
  Stream& st = *opened;

  // The plan: what push() would do with this push now. Whatever ends in a drop (a duplicate, a
  // sync push already late, a warm-up or stale one) or a refusal is left to finishStream, whole;
  // the rest is applied or gathered chunk by chunk.
  MutexLock lock(mu_);
  st.generation = generation_;
  st.version = version_;
  const uint32_t id = request.worker();
  const bool layoutHolds = st.pieces.size() == pieces_.size() && id < workers_.size() &&
                           std::equal(st.pieces.begin(), st.pieces.end(), pieces_.begin(),
                                      [](const wire::PieceSpec& a, const wire::PieceSpec& b) {
                                        return a.key() == b.key() && a.numel() == b.numel();
                                      });
  if (!layoutHolds || failure_ || request.clock() < 0 || request.clock() > kMaxClock ||
      request.clock() < workers_[id].clock) {
    *stream = std::move(opened);
    return Status::Ok();
  }
  const uint64_t pulled = std::min<uint64_t>(request.pulled_version(), version_);
  st.tau = int64_t(version_ - pulled);
  if (policy_.mode() == "sync") {
    if (request.pulled_version() >= version_ && !pendingFrom_[id]) st.plan = Stream::Plan::kAccumulate;
  } else if (policy_.warmup_steps() > 0 && id != 0 && version_ < uint64_t(policy_.warmup_steps())) {
    // held, then dropped: at the end
  } else if (policy_.max_staleness() < 0 || st.tau <= policy_.max_staleness()) {
    st.scale = (policy_.staleness_lr() == "inverse" && st.tau > 1) ? 1.0f / float(st.tau) : 1.0f;
    st.plan = policy_.mode() == "softsync" ? Stream::Plan::kAccumulate : Stream::Plan::kApply;
  }
  workers_[id].lastSeen = Clock::now();
  *stream = std::move(opened);
  return Status::Ok();
}

Status Shard::addChunk(Stream& stream, const wire::PushChunk& chunk, const FramePayload& payload) {
  if (stream.ended) return Status::error(Code::kInvalidArgument, "push: a chunk after the stream was refused");
  const size_t first = chunk.first_piece();
  const size_t count = chunk.pieces();
  const size_t total = stream.pieces.size();
  Status s = Status::Ok();
  if (first != stream.nextPiece) {
    s = Status::error(Code::kInvalidArgument, "push: a chunk begins at piece " + std::to_string(first) +
                                                  " where piece " + std::to_string(stream.nextPiece) +
                                                  " comes next (chunks come in order, each piece once)");
  } else if (count == 0 || count > total - first) {
    s = Status::error(Code::kInvalidArgument, "push: a chunk of " + std::to_string(count) + " pieces from piece " +
                                                  std::to_string(first) + ", the shard has " + std::to_string(total));
  }
  size_t bytes = 0;
  for (size_t k = first; s.ok() && k < first + count; ++k) bytes += size_t(stream.pieces[k].numel()) * sizeof(float);
  if (s.ok() && bytes != payload.size()) {
    s = Status::error(Code::kInvalidArgument, "push: the chunk of pieces " + std::to_string(first) + " to " +
                                                  std::to_string(first + count - 1) + " carries " +
                                                  std::to_string(payload.size()) + " bytes, its pieces need " +
                                                  std::to_string(bytes));
  }
  // In place where a piece lies in one of the transport's buffers, aligned; else one copy. The
  // whole chunk is checked before any of its pieces is applied.
  size_t offset = 0;
  for (size_t k = first; s.ok() && k < first + count; ++k) {
    const size_t numel = size_t(stream.pieces[k].numel());
    stream.dense[k] = payload.floats(offset, numel, stream.copies[k]);
    offset += numel * sizeof(float);
    if (const size_t bad = firstNonFinite(stream.dense[k].data(), numel); bad < numel) {
      s = nonFinite(stream.pieces[k], stream.dense[k], bad);
    }
  }
  if (!s.ok()) return refuseStream(stream, s);
  stream.nextPiece = first + count;
  stream.bytes += int64_t(payload.size());
  if (stream.keepsChunks()) return Status::Ok();

  // Applied (or gathered) now, piece by piece: between two pieces the lock is free for the other
  // workers' pushes and pulls. Each piece is one whole optimizer step at its own count.
  size_t at = 0;
  for (size_t k = 0; k < first; ++k) at += size_t(stream.pieces[k].numel());
  for (size_t k = first; k < first + count; ++k) {
    const size_t numel = size_t(stream.pieces[k].numel());
    {
      MutexLock lock(mu_);
      if (generation_ != stream.generation || failure_) {
        const Status why = failure_ ? Status::error(Code::kAborted, *failure_)
                                    : Status::error(Code::kAborted, "the shard was re-initialized during the push");
        return endStreamLocked(stream, why, false);
      }
      workers_[stream.request.worker()].lastSeen = Clock::now();
      const Part part{.values = stream.dense[k], .rows = {}, .numel = numel};
      if (stream.plan == Stream::Plan::kApply) {
        applyPieceLocked(k, at, part, stream.scale);
        ++stream.applied;
      } else if (policy_.mode() != "sync" || version_ == stream.version) {
        accumulatePieceLocked(k, at, part, stream.scale);
        ++stream.applied;
      }  // else sync's step closed meanwhile: the rest of the push is late (finishStream says so)
    }
    stream.dense[k] = {};
    std::vector<float>().swap(stream.copies[k]);
    at += numel;
  }
  return Status::Ok();
}

Status Shard::finishStream(Stream& stream, wire::PushReply* reply, std::vector<float>* replyValues) {
  if (stream.ended) return Status::error(Code::kInvalidArgument, "push: the stream was refused");
  if (stream.nextPiece != stream.pieces.size()) {
    const Status s = Status::error(Code::kInvalidArgument, "push: the stream ended after " +
                                                               std::to_string(stream.nextPiece) + " of its " +
                                                               std::to_string(stream.pieces.size()) + " pieces");
    return refuseStream(stream, s);
  }
  const Status status = handlePush(stream.request, nullptr, &stream, reply, replyValues);
  if (stream.applied > 0 && (!status.ok() || !reply->applied())) {
    // Its pieces were applied or gathered, but it does not count as an update: sync's step closed
    // while it arrived (late), the job stopped, or the shard failed.
    MutexLock lock(mu_);
    endStreamLocked(stream, status.ok() ? Status::error(Code::kAborted, "dropped (" + reply->dropped() + ")") : status,
                    false);
  }
  writeDueCheckpoint();
  return status;
}

Status Shard::refuseStream(Stream& stream, const Status& why) {
  MutexLock lock(mu_);
  return endStreamLocked(stream, why, true);
}

Status Shard::endStreamLocked(Stream& stream, const Status& why, bool rejected) {
  if (stream.ended) return why;
  stream.ended = true;
  if (rejected) stats_.set_rejected(stats_.rejected() + 1);
  if (stream.applied == 0 || generation_ != stream.generation) {
    if (rejected && (stats_.rejected() <= 10 || stats_.rejected() % 100 == 0)) log("refused a push: " + why.message);
    return why;
  }
  stats_.set_partial_pushes(stats_.partial_pushes() + 1);
  const std::string kept = std::to_string(stream.applied) + " of its " + std::to_string(stream.pieces.size()) +
                           " pieces, received before, were " +
                           (stream.plan == Stream::Plan::kApply ? "applied" : "added to the step being gathered") +
                           " and stay (the push is not counted as an update)";
  log("a streamed push of worker " + std::to_string(stream.request.worker()) + " ended early: " + why.message +
      "; " + kept);
  return Status::error(why.code, why.message + "; " + kept);
}

void Shard::countRejected(const Status& why) {
  MutexLock lock(mu_);
  stats_.set_rejected(stats_.rejected() + 1);
  if (stats_.rejected() <= 10 || stats_.rejected() % 100 == 0) log("refused a push: " + why.message);
}

Status Shard::admitPush(const wire::PushRequest& request, std::vector<wire::PieceSpec>* pieces) {
  MutexLock lock(mu_);
  // The protocol first: a worker of another version must hear so, not retry "not initialized".
  Status s = checkProtocol(request.protocol());
  if (s.ok() && !initialized_) return notInitialized();
  if (s.ok()) s = checkWorker(request.worker());
  if (!s.ok()) {
    stats_.set_rejected(stats_.rejected() + 1);
    if (stats_.rejected() <= 10 || stats_.rejected() % 100 == 0) log("refused a push: " + s.message);
    return s;
  }
  *pieces = pieces_;
  return Status::Ok();
}

Status Shard::handlePush(const wire::PushRequest& request, const FramePayload* framed, const Stream* streamed,
                         wire::PushReply* reply, std::vector<float>* replyValues) {
  const auto arrived = Clock::now();
  std::vector<wire::PieceSpec> pieces;
  if (Status s = admitPush(request, &pieces); !s.ok()) return s;
  // Checked and decoded outside the lock: a large push does not stall the others.
  // A row-sparse push: values (or compressed) hold the dense pieces only; rows the others' rows.
  const bool rowSparse = request.row_sparse();
  std::vector<wire::PieceSpec> densePieces;
  for (const auto& p : pieces) {
    if (!rowSparse || p.row_dim() == 0) densePieces.push_back(p);
  }
  const bool compressed = !request.compressed().empty();
  // A streamed push whose pieces were applied or gathered as they arrived (Stream::Plan): here it
  // is only counted, as the plan made when it began says.
  const bool early = streamed != nullptr && !streamed->keepsChunks();
  // A streamed push's header and chunks were checked as they arrived (beginStream, addChunk),
  // against the layout of then.
  const bool relaid = streamed != nullptr &&
                      !std::equal(pieces.begin(), pieces.end(), streamed->pieces.begin(), streamed->pieces.end(),
                                  [](const wire::PieceSpec& a, const wire::PieceSpec& b) {
                                    return a.key() == b.key() && a.numel() == b.numel() && a.row_dim() == b.row_dim();
                                  });
  Status valid = relaid ? Status::error(Code::kAborted, "the shard was re-initialized during the push")
                 : streamed != nullptr ? Status::Ok()
                 : compressed && request.values_size() > 0
                     ? Status::error(Code::kInvalidArgument, "push: carries both values and a compressed message")
                 : !rowSparse && (request.rows_size() > 0 || request.want_rows_size() > 0)
                     ? Status::error(Code::kInvalidArgument, "push: carries rows but is not row_sparse")
                 : framed != nullptr && (compressed || rowSparse)
                     ? Status::error(Code::kInvalidArgument,
                                     "push: a framed push carries float32 values only (no codec, no rows): send "
                                     "compressed and row-sparse pushes with Push")
                 : framed != nullptr ? checkFramedTensors(request.values(), densePieces, framed->size(), "push")
                 : compressed ? Status::Ok()
                              : checkTensors(request.values(), densePieces, true, "push");
  if (valid.ok() && rowSparse) valid = checkRows(request.rows(), pieces, true, true, "push");
  if (valid.ok() && rowSparse) valid = checkRows(request.want_rows(), pieces, false, false, "push (rows asked for)");
  std::vector<std::span<const float>> dense;
  std::vector<std::vector<float>> copies(size_t(request.values_size()));  // for misaligned data only
  std::vector<float> decoded;                                             // a compressed push
  if (valid.ok() && compressed) valid = decodeCompressed(request.compressed(), densePieces, true, "push", decoded);
  if (valid.ok() && streamed != nullptr) {
    dense = streamed->dense;
  } else if (valid.ok() && compressed) {
    size_t offset = 0;
    for (const auto& p : densePieces) {
      dense.push_back(std::span<const float>(decoded).subspan(offset, size_t(p.numel())));
      offset += size_t(p.numel());
    }
  } else if (valid.ok() && framed != nullptr) {
    // In place where a piece lies in one of the transport's buffers, aligned; else one copy.
    size_t offset = 0;
    for (int i = 0; i < request.values_size() && valid.ok(); ++i) {
      const size_t numel = size_t(request.values(i).numel());
      dense.push_back(framed->floats(offset, numel, copies[size_t(i)]));
      offset += numel * sizeof(float);
      if (const size_t bad = firstNonFinite(dense.back().data(), numel); bad < numel) {
        valid = nonFinite(densePieces[size_t(i)], dense.back(), bad);
      }
    }
  } else if (valid.ok()) {
    for (int i = 0; i < request.values_size(); ++i) dense.push_back(floatsOf(request.values(i), copies[size_t(i)]));
  }
  Parts grad;
  std::vector<std::vector<float>> rowValues(size_t(request.rows_size()));
  size_t gradSize = 0;
  if (valid.ok()) {
    size_t nextDense = 0;
    for (const auto& p : pieces) {
      Part part{.values = {}, .rows = {}, .numel = size_t(p.numel())};
      if (!rowSparse || p.row_dim() == 0) {
        part.values = dense[nextDense++];
      } else {
        part.rowDim = size_t(p.row_dim());
        for (int i = 0; i < request.rows_size(); ++i) {
          const wire::Rows& r = request.rows(i);
          if (r.key() != p.key()) continue;
          rowFloats(r, rowValues[size_t(i)]);
          part.values = rowValues[size_t(i)];
          part.rows = std::span<const uint32_t>(r.rows().data(), size_t(r.rows_size()));
        }
      }
      grad.push_back(part);
      gradSize += part.numel;
    }
  }
  int64_t pushedBytes = compressed ? int64_t(request.compressed().size()) : 0;
  for (const auto& t : request.values()) pushedBytes += int64_t(t.data().size());
  if (framed != nullptr) pushedBytes = int64_t(framed->size());
  if (streamed != nullptr) pushedBytes = streamed->bytes;
  for (const auto& r : request.rows()) pushedBytes += int64_t(r.ByteSizeLong());

  MutexLock lock(mu_);
  if (valid.ok() && (request.clock() < 0 || request.clock() > kMaxClock)) {
    valid = Status::error(Code::kInvalidArgument, "push: clock " + std::to_string(request.clock()) + " is out of range");
  }
  if (!valid.ok() || gradSize != values_.size() || request.worker() >= workers_.size()) {
    // values_ and workers_ can change under a concurrent Init.
    const Status s = valid.ok() ? Status::error(Code::kAborted, "the shard was re-initialized during the push") : valid;
    stats_.set_rejected(stats_.rejected() + 1);
    if (stats_.rejected() <= 10 || stats_.rejected() % 100 == 0) {
      log("refused a push from worker " + std::to_string(request.worker()) + ": " + s.message);
    }
    return s;
  }
  if (failure_) return Status::error(Code::kAborted, *failure_);
  if (early && generation_ != streamed->generation) {
    return Status::error(Code::kAborted, "the shard was re-initialized during the push");
  }
  const uint32_t id = request.worker();
  // Never a reference across a wait: an Init while the push is held may replace workers_.
  const uint64_t generation = generation_;
  auto me = [&]() -> Worker& {
    mu_.assertHeld();
    return workers_[id];
  };
  auto reinitialized = [&]() {
    return Status::error(Code::kAborted, "the shard was re-initialized by a new Init while this push was held");
  };
  me().lastSeen = arrived;
  me().finishing = false;
  if (me().lost) {
    me().lost = false;
    log("worker " + std::to_string(id) + " is back");
  }
  if (!early && request.clock() < me().clock) {
    // A retry of a push this shard has already handled (the reply was lost with the connection):
    // it must not count twice.
    stats_.set_dropped_duplicate(stats_.dropped_duplicate() + 1);
    reply->set_applied(false);
    reply->set_dropped("duplicate");
    reply->set_version(version_);
    reply->set_samples_total(stats_.samples_total());
    if (request.want_values()) fillReplyLocked(request, reply, replyValues);
    return Status::Ok();
  }
  // A shard restored from a checkpoint is behind the workers: their count is the true one.
  me().clock = request.clock();
  stats_.set_bytes_pushed(stats_.bytes_pushed() + pushedBytes);
  // Saturating: a hostile `samples` must not overflow the total (found by fuzz/push_fuzz.cpp).
  stats_.set_samples_total(stats_.samples_total() +
                           std::clamp<int64_t>(request.samples(), 0, INT64_MAX - stats_.samples_total()));
  const auto limit = std::chrono::duration<double>(policy_.timeout_s());
  const bool sync = policy_.mode() == "sync";
  const uint64_t pulled = std::min<uint64_t>(request.pulled_version(), version_);  // a restarted shard is behind
  auto tau = [&]() {
    mu_.assertHeld();
    return int64_t(version_ - std::min<uint64_t>(pulled, version_));
  };
  std::string dropped;

  auto finishReply = [&](bool applied) {
    mu_.assertHeld();
    me().clock += 1;
    me().inClosedStep = false;
    me().lastSeen = Clock::now();
    if (policy_.mode() == "ssp") recordClockGapLocked();
    reply->set_applied(applied);
    reply->set_dropped(dropped);
    reply->set_version(version_);
    reply->set_samples_total(stats_.samples_total());
    const double held = secondsSince(arrived);
    reply->set_wait_s(held);
    reply->set_stop_job(stopJob_);
    stats_.set_wait_s(stats_.wait_s() + held);
    if (request.want_values()) fillReplyLocked(request, reply, replyValues);
    changed_.notifyAll();
    return Status::Ok();
  };

  if (sync) {
    const uint64_t step = version_;
    // A gathered stream is late when its step closed while it arrived (some of its pieces made it).
    if (early ? version_ != streamed->version : (request.pulled_version() < step || pendingFrom_[id])) {
      // Its step closed without it (backup workers), or it already gave a gradient for this one.
      dropped = "late";
      reply->set_staleness(tau());
      stats_.set_dropped_late(stats_.dropped_late() + 1);
      return finishReply(false);
    }
    if (early) {
      pendingCount_ += 1;  // its pieces are in
    } else {
      accumulateLocked(grad, 1.0f);
    }
    pendingFrom_[id] = true;
    reply->set_staleness(0);
    noteStalenessLocked(0);
    stats_.set_applied(stats_.applied() + 1);
    auto closeIfReady = [&]() {
      mu_.assertHeld();
      int live = 0;
      for (const auto& w : workers_) live += (!w.done && !w.lost && !w.finishing) ? 1 : 0;
      const int needed = std::max(1, std::min(int(policy_.workers() - policy_.backup_workers()), live));
      if (version_ != step || pendingCount_ < needed) return;
      for (size_t i = 0; i < workers_.size(); ++i) workers_[i].inClosedStep = pendingFrom_[i];
      applyPendingLocked();
    };
    closeIfReady();
    while (version_ == step && !failure_ && !stopJob_) {
      changed_.waitFor(mu_, kTick);
      if (generation_ != generation) return reinitialized();
      const auto now = Clock::now();
      // Workers held in this step are alive: they are waiting on us.
      for (size_t i = 0; i < workers_.size(); ++i) {
        if (pendingFrom_[i]) workers_[i].lastSeen = std::max(workers_[i].lastSeen, now);
      }
      markLostLocked(now);
      std::string missing;
      for (size_t i = 0; i < workers_.size(); ++i) {
        if (workers_[i].lost && !pendingFrom_[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
      }
      if (!missing.empty() && policy_.backup_workers() == 0) {
        failure_ = "worker " + missing + " sent no gradient for step " + std::to_string(step) + " within " +
                   seconds(policy_.timeout_s()) +
                   ": it is lost, and sync mode needs every worker (--backup-workers K lets the others go on)";
        log(*failure_);
        changed_.notifyAll();
        break;
      }
      closeIfReady();
    }
    if (failure_) return Status::error(Code::kAborted, *failure_);
    if (generation_ != generation) return reinitialized();
    if (version_ == step) dropped = "stopped";  // the job stopped before this step closed
    return finishReply(dropped.empty());
  }

  // The asynchronous modes.
  if (!early && policy_.warmup_steps() > 0 && id != 0 && version_ < uint64_t(policy_.warmup_steps())) {
    // Worker 0 trains alone until version W; the others wait, then start from its parameters.
    // A push is held for at most the timeout (the worker then pushes again and is held again), so
    // that no call outlives the client's deadline; the held worker counts as heard from.
    auto progress = Clock::now();
    uint64_t seen = version_;
    while (version_ < uint64_t(policy_.warmup_steps()) && !failure_ && !stopJob_) {
      changed_.waitFor(mu_, kTick);
      if (generation_ != generation) return reinitialized();
      const auto now = Clock::now();
      me().lastSeen = now;
      if (version_ != seen) {
        seen = version_;
        progress = now;
      } else if (workers_[0].done || workers_[0].lost || now - progress > limit) {
        break;  // worker 0 will not finish the warm-up: go on without it
      }
      if (now - arrived > limit) break;
    }
    if (failure_) return Status::error(Code::kAborted, *failure_);
    dropped = "warmup";
    reply->set_staleness(tau());
    stats_.set_dropped_warmup(stats_.dropped_warmup() + 1);
    return finishReply(false);
  }

  // A stream applied as it arrived keeps the staleness, and so the scale, of when it began.
  const int64_t t = early ? streamed->tau : tau();
  reply->set_staleness(t);
  if (!early && policy_.max_staleness() >= 0 && t > policy_.max_staleness()) {
    dropped = "stale";
    stats_.set_dropped_stale(stats_.dropped_stale() + 1);
  } else {
    const float scale = (policy_.staleness_lr() == "inverse" && t > 1) ? 1.0f / float(t) : 1.0f;
    noteStalenessLocked(t);
    stats_.set_applied(stats_.applied() + 1);
    if (policy_.mode() == "softsync") {
      if (early) {
        pendingCount_ += 1;
      } else {
        accumulateLocked(grad, scale);
      }
      if (pendingCount_ >= int(policy_.softsync())) applyPendingLocked();
    } else if (early) {
      finishUpdateLocked();
    } else {
      applyLocked(grad, scale);
    }
  }

  if (policy_.mode() == "ssp") {
    // Held until this worker, about to start step clock+1, is at most S steps ahead of the slowest.
    me().clock += 1;
    me().held = true;
    const int64_t bound = int64_t(policy_.staleness_bound());
    bool told = false;
    while (!failure_ && !stopJob_) {
      const auto now = Clock::now();
      me().lastSeen = now;
      markLostLocked(now);
      const int64_t slowest = slowestClockLocked();
      if (me().clock - slowest <= bound) break;
      if (options_.onHeld && !told) options_.onHeld(id, me().clock, slowest);
      told = true;
      changed_.waitFor(mu_, kTick);
      if (generation_ != generation) return reinitialized();
    }
    me().held = false;
    me().clock -= 1;  // finishReply counts it
    if (failure_) return Status::error(Code::kAborted, *failure_);
  }
  return finishReply(dropped.empty());
}

Status Shard::done(const wire::DoneRequest& request, wire::DoneReply* reply) {
  if (Status s = checkProtocol(request.protocol()); !s.ok()) return s;
  MutexLock lock(mu_);
  if (!initialized_) return notInitialized();
  if (Status s = checkWorker(request.worker()); !s.ok()) return s;
  Worker& w = workers_[request.worker()];
  w.done = true;
  w.lost = false;
  w.lastSeen = Clock::now();
  changed_.notifyAll();
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
    w.lastSeen = Clock::now();
    w.lost = false;
    if (request.finishing() && !w.finishing) {
      w.finishing = true;
      changed_.notifyAll();  // a sync step held for it may close now
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
      markLostLocked(Clock::now());
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

void Shard::checkpoint() {
  std::optional<wire::ShardCheckpoint> snapshot;
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
    std::optional<wire::ShardCheckpoint> snapshot = snapshotLocked();
    if (!snapshot) return;
    nextCheckpoint_ = std::move(snapshot);
    if (writingCheckpoints_) return;
    writingCheckpoints_ = true;
  }
  for (;;) {
    std::optional<wire::ShardCheckpoint> next;
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
  std::string message = options_.name + ": the final checkpoint (version " + std::to_string(snapshot->version()) +
                        ") could not be written to " + store_->dir() + ": " + *error + "; ";
  std::vector<CheckpointFile> kept;
  {
    MutexLock lock(writeMu_);  // store_ is not thread-safe
    kept = store_->list();
  }
  message += kept.empty() ? "no earlier checkpoint is there"
                          : "the newest checkpoint kept there is " + kept.front().path + " (version " +
                                std::to_string(kept.front().step) + ")";
  message += "; the run's result is in the chief's done event: free space on that disk or give another --checkpoint-dir";
  finalCheckpointError_ = message;
}

std::optional<wire::ShardCheckpoint> Shard::snapshotLocked() {
  if (!store_ || !initialized_) return std::nullopt;
  wire::ShardCheckpoint c;
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
  return c;
}

// Testing: COHORT_TEST_KILL_SHARD_AT=V makes a shard process SIGKILL itself when it reaches version
// V, in its first run only (COHORT_RESTART_COUNT unset or 0): a shard dying at a known point.
static void killIfTestSaysSo(uint64_t version) {
  static const uint64_t killAt = [] {
    const char* at = std::getenv("COHORT_TEST_KILL_SHARD_AT");
    const char* restarts = std::getenv("COHORT_RESTART_COUNT");
    if (!at || (restarts && std::string(restarts) != "0")) return uint64_t(0);
    return uint64_t(std::strtoull(at, nullptr, 10));
  }();
  if (killAt != 0 && version == killAt) std::raise(SIGKILL);
}

std::optional<std::string> Shard::writeCheckpoint(const wire::ShardCheckpoint& snapshot) {
  MutexLock lock(writeMu_);
  if (options_.beforeCheckpointWrite) options_.beforeCheckpointWrite(snapshot.version());
  std::string bytes;
  if (!snapshot.SerializeToString(&bytes)) {
    return "the state of version " + std::to_string(snapshot.version()) + " could not be serialized (over 2 GiB?)";
  }
  try {
    store_->save(int64_t(snapshot.version()), std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  } catch (const Error& e) {
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
  auto optimizer = std::make_unique<ServerOptimizer>(c.policy().optimizer(), c.policy().lr(),
                                                     c.policy().momentum(), size_t(total));
  if (optimizer->slots().size() != size_t(c.optimizer_slots_size())) return corrupt("its optimizer state is incomplete");
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
  pieces_.assign(pieces.begin(), pieces.end());
  values_.resize(size_t(total));
  std::memcpy(values_.data(), c.values().data(), c.values().size());
  optimizer_ = std::move(optimizer);
  pieceSteps_ = std::move(pieceSteps);
  version_ = c.version();
  lastCheckpointVersion_ = version_;
  workers_.assign(policy_.workers(), Worker{});
  for (size_t i = 0; i < workers_.size(); ++i) workers_[i].clock = c.clocks(int(i));
  pending_.assign(values_.size(), 0.0f);
  pendingMarked_.assign(pieces_.size(), {});
  pendingRows_.assign(pieces_.size(), {});
  pendingCount_ = 0;
  pendingPieceCount_.assign(pieces_.size(), 0);
  pendingFrom_.assign(policy_.workers(), false);
  stats_ = c.stats();
  stalenessSum_ = stats_.staleness_mean() * double(stats_.applied());
  initialized_ = true;
  initSinceStart_ = options_.restartedInJob;  // ShardOptions::restartedInJob
  log("restored from " + path + " at version " + std::to_string(version_));
  launcher::tellShardHasCheckpoint();
  return true;
}

}  // namespace cohort::ps
