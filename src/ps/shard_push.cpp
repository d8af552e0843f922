// Shard::handlePush, a push from its arrival to the update policy: the checks of its shape and
// values and their decoding (outside the lock), then, under the lock, its admission (the clock,
// the layout it was checked against, the worker heard from, a retry answered as a duplicate).
// What becomes of it then is the update policy's (update_policy.h), which answers it with
// finishPushLocked.
#include "base/clock.h"
#include "ps/frame.h"
#include "ps/shard.h"
#include "ps/shard_internal.h"
#include "ps/update_policy.h"
#include "ps/wire.h"

#include <algorithm>

namespace cohort::ps {

using namespace shard_internal;

// The push's values by piece (Parts) and the buffers they may point into.
struct Shard::DecodedPush {
  Status valid = Status::Ok();
  Parts grad;
  size_t gradSize = 0;
  int64_t pushedBytes = 0;
  std::vector<wire::PieceSpec> densePieces;   // the pieces values (or compressed) cover
  std::vector<std::span<const float>> dense;  // their floats, in order
  std::vector<FloatScratch> copies;           // for misaligned data only
  std::vector<float> decoded;                 // a compressed push
  std::vector<std::vector<float>> rowValues;  // a row-sparse push's rows, as floats
};

namespace {

bool sameLayout(const std::vector<wire::PieceSpec>& now, const std::vector<wire::PieceSpec>& then) {
  return std::equal(now.begin(), now.end(), then.begin(), then.end(),
                    [](const wire::PieceSpec& a, const wire::PieceSpec& b) {
                      return a.key() == b.key() && a.numel() == b.numel() && a.row_dim() == b.row_dim();
                    });
}

// What a push carries against what its transport allows and the layout: one of values and a
// compressed message, rows only when row-sparse, a framed push float32 only. A streamed push's
// header and chunks were checked as they arrived (beginStream, addChunk), against the layout of
// then: only a layout changed since is refused.
Status checkShape(const wire::PushRequest& request, const FramePayload* framed, const Shard::Stream* streamed,
                  const std::vector<wire::PieceSpec>& pieces, const std::vector<wire::PieceSpec>& densePieces) {
  const bool rowSparse = request.row_sparse();
  const bool compressed = !request.compressed().empty();
  if (streamed != nullptr) {
    return sameLayout(pieces, streamed->pieces)
               ? Status::Ok()
               : Status::error(Code::kAborted, "the shard was re-initialized during the push");
  }
  if (compressed) {
    // Beside a compressed message, values only say which pieces have no gradient (their part of
    // the message is ignored): no-gradient values of dense pieces, in the pieces' order.
    size_t next = 0;
    for (const auto& t : request.values()) {
      if (!isNoGradient(t)) {
        return Status::error(Code::kInvalidArgument, "push: carries both values and a compressed message");
      }
      while (next < densePieces.size() && densePieces[next].key() != t.key()) ++next;
      if (next == densePieces.size()) {
        return Status::error(Code::kInvalidArgument, "push: says piece " + std::to_string(t.key()) +
                                                         " has no gradient, but it is no dense piece of this shard "
                                                         "after the one said before");
      }
      ++next;
    }
  }
  if (!rowSparse && (request.rows_size() > 0 || request.want_rows_size() > 0)) {
    return Status::error(Code::kInvalidArgument, "push: carries rows but is not row_sparse");
  }
  if (framed != nullptr && (compressed || rowSparse)) {
    return Status::error(Code::kInvalidArgument,
                         "push: a framed push carries float32 values only (no codec, no rows): send "
                         "compressed and row-sparse pushes with Push");
  }
  if (framed != nullptr) {
    return checkFramedTensors(request.values(), densePieces, framed->size(), "push", NoGradient::kAllowed);
  }
  return compressed ? Status::Ok() : checkTensors(request.values(), densePieces, true, "push", NoGradient::kAllowed);
}

int64_t pushedBytesOf(const wire::PushRequest& request, const FramePayload* framed, const Shard::Stream* streamed) {
  int64_t bytes = request.compressed().empty() ? 0 : int64_t(request.compressed().size());
  for (const auto& t : request.values()) bytes += int64_t(t.data().size());
  if (framed != nullptr) bytes = int64_t(framed->size());
  if (streamed != nullptr) bytes = streamed->bytes;
  for (const auto& r : request.rows()) bytes += int64_t(r.ByteSizeLong());
  return bytes;
}

}  // namespace

void Shard::countRejected(const Status& why) {
  MutexLock lock(mu_);
  stats_.set_rejected(stats_.rejected() + 1);
  if (stats_.rejected() <= 10 || stats_.rejected() % 100 == 0) log("refused a push: " + why.message);
}

Status Shard::admitPush(const wire::PushRequest& request, std::vector<wire::PieceSpec>* pieces, uint64_t* generation) {
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
  if (generation != nullptr) *generation = generation_;
  return Status::Ok();
}

void Shard::decodePush(const wire::PushRequest& request, const FramePayload* framed, const Stream* streamed,
                       const std::vector<wire::PieceSpec>& pieces, DecodedPush& out) const {
  // A row-sparse push: values (or compressed) hold the dense pieces only; rows the others' rows.
  const bool rowSparse = request.row_sparse();
  for (const auto& p : pieces) {
    if (!rowSparse || p.row_dim() == 0) out.densePieces.push_back(p);
  }
  out.pushedBytes = pushedBytesOf(request, framed, streamed);
  Status& valid = out.valid;
  valid = checkShape(request, framed, streamed, pieces, out.densePieces);
  if (valid.ok() && rowSparse) valid = checkRows(request.rows(), pieces, true, true, "push");
  if (valid.ok() && rowSparse) valid = checkRows(request.want_rows(), pieces, false, false, "push (rows asked for)");
  if (!valid.ok()) return;
  out.copies.resize(size_t(request.values_size()));
  if (streamed != nullptr) {
    out.dense = streamed->dense;
  } else if (!request.compressed().empty()) {
    valid = decodeCompressed(request.compressed(), out.densePieces, true, "push", out.decoded);
    size_t offset = 0;
    for (const auto& p : out.densePieces) {
      if (!valid.ok()) break;
      out.dense.push_back(std::span<const float>(out.decoded).subspan(offset, size_t(p.numel())));
      offset += size_t(p.numel());
    }
  } else if (framed != nullptr) {
    // In place where a piece lies in one of the transport's buffers, aligned; else one copy.
    size_t offset = 0;
    for (int i = 0; i < request.values_size() && valid.ok(); ++i) {
      const size_t numel = size_t(request.values(i).numel());
      size_t bad = numel;
      out.dense.push_back(framed->checkedFloats(offset, numel, out.copies[size_t(i)], &bad));
      offset += numel * sizeof(float);
      if (bad < numel) {
        valid = nonFinite(out.densePieces[size_t(i)], out.dense.back(), bad);
      }
    }
  } else {
    for (int i = 0; i < request.values_size(); ++i) {
      out.dense.push_back(floatsOf(request.values(i), out.copies[size_t(i)]));
    }
  }
  if (!valid.ok()) return;
  // The dense pieces the worker had no gradient for: their values say so, one per piece, or
  // (compressed) listed beside the message, which holds zeros (or a codec's residual) for them.
  std::vector<bool> noGradient(out.densePieces.size(), false);
  for (size_t i = 0, next = 0; i < size_t(request.values_size()); ++i) {
    if (!isNoGradient(request.values(int(i)))) continue;
    if (request.compressed().empty()) {
      noGradient[i] = true;
      continue;
    }
    while (out.densePieces[next].key() != request.values(int(i)).key()) ++next;  // checkShape: it is there
    noGradient[next++] = true;
  }
  // Each piece's part: its dense floats (none when the worker had no gradient for it), or the
  // rows the push carries for it.
  out.rowValues.resize(size_t(request.rows_size()));
  size_t nextDense = 0;
  for (const auto& p : pieces) {
    Part part{.values = {}, .rows = {}, .numel = size_t(p.numel())};
    if (!rowSparse || p.row_dim() == 0) {
      part.noGradient = noGradient[nextDense];
      part.values = out.dense[nextDense++];
    } else {
      part.rowDim = size_t(p.row_dim());
      for (int i = 0; i < request.rows_size(); ++i) {
        const wire::Rows& r = request.rows(i);
        if (r.key() != p.key()) continue;
        rowFloats(r, out.rowValues[size_t(i)]);
        part.values = out.rowValues[size_t(i)];
        part.rows = std::span<const uint32_t>(r.rows().data(), size_t(r.rows_size()));
      }
    }
    out.grad.push_back(part);
    out.gradSize += part.numel;
  }
}

Status Shard::acceptLocked(const wire::PushRequest& request, const DecodedPush& decoded, const Stream* streamed,
                           uint64_t admitted) {
  Status valid = decoded.valid;
  if (valid.ok() && (request.clock() < 0 || request.clock() > kMaxClock)) {
    valid =
        Status::error(Code::kInvalidArgument, "push: clock " + std::to_string(request.clock()) + " is out of range");
  }
  // An Init since the push was admitted: its layout, values and clocks are another run's, even where
  // the sizes agree (a worker's clock from the old run would drop its pushes in the new one).
  if (!valid.ok() || generation_ != admitted || decoded.gradSize != values_.size() ||
      request.worker() >= workers_.size()) {
    const Status s = valid.ok() ? Status::error(Code::kAborted, "the shard was re-initialized during the push") : valid;
    stats_.set_rejected(stats_.rejected() + 1);
    if (stats_.rejected() <= 10 || stats_.rejected() % 100 == 0) {
      log("refused a push from worker " + std::to_string(request.worker()) + ": " + s.message);
    }
    return s;
  }
  if (failure_) return Status::error(Code::kAborted, *failure_);
  const bool early = streamed != nullptr && !streamed->keepsChunks();
  if (early && generation_ != streamed->generation) {
    return Status::error(Code::kAborted, "the shard was re-initialized during the push");
  }
  return Status::Ok();
}

bool Shard::noteArrivalLocked(HeldPush& push) {
  Worker& me = workers_[push.id];
  me.lastSeen = push.arrived;
  me.finishing = false;
  if (me.lost) {
    me.lost = false;
    log("worker " + std::to_string(push.id) + " is back");
  }
  if (push.early || push.request.clock() >= me.clock) return false;
  // A retry of a push this shard has already handled (the reply was lost with the connection):
  // it must not count twice.
  replyDuplicateLocked(push);
  return true;
}

void Shard::replyDuplicateLocked(HeldPush& push) {
  stats_.set_dropped_duplicate(stats_.dropped_duplicate() + 1);
  push.reply->set_applied(false);
  push.reply->set_dropped("duplicate");
  push.reply->set_version(version_);
  push.reply->set_samples_total(stats_.samples_total());
  if (push.request.want_values()) fillReplyLocked(push.request, push.reply, push.replyValues);
}

Status Shard::awaitHeldOriginalLocked(HeldPush& push) {
  // Answered "late" at once, as before, the retry would send the worker on with the step's old
  // values, its next pushes late too until the step closed, and the first push's reply would then
  // count its clock a second time.
  if (options_.onHeld) options_.onHeld(push.id, push.request.clock(), -1);
  while (workers_[push.id].heldClock == push.request.clock() && !failure_) {
    changed_.waitFor(mu_, kTick);
    if (generation_ != push.generation) return reinitializedWhileHeld();
    workers_[push.id].lastSeen = now();
  }
  if (failure_) return Status::error(Code::kAborted, *failure_);
  replyDuplicateLocked(push);
  return Status::Ok();
}

int64_t Shard::stalenessLocked(const HeldPush& push) const {
  return int64_t(version_ - std::min<uint64_t>(push.pulled, version_));
}

bool Shard::takePieceLocked(uint32_t worker, int64_t clock, size_t k) {
  Worker& w = workers_[worker];
  // A push counted already (the retry finished first): the cut attempt takes nothing more.
  if (clock < w.clock) return false;
  if (w.pushingClock != clock || w.pushingGeneration != generation_) {
    w.pushingClock = clock;
    w.pushingGeneration = generation_;
    w.piecesIn = 0;
  }
  if (k < w.piecesIn) return false;
  w.piecesIn = k + 1;
  return true;
}

size_t Shard::piecesInLocked(const wire::PushRequest& request) const {
  const Worker& w = workers_[request.worker()];
  if (w.pushingClock != request.clock() || w.pushingGeneration != generation_ || w.piecesIn == 0) return 0;
  log("worker " + std::to_string(request.worker()) + " sent its push of step " + std::to_string(request.clock()) +
      " again: its first " + std::to_string(w.piecesIn) +
      " pieces, in from an attempt cut before, are not applied twice");
  return w.piecesIn;
}

void Shard::markPiecesInLocked(const wire::PushRequest& request, Parts& parts) {
  const size_t in = piecesInLocked(request);
  for (size_t k = 0; k < std::min(in, parts.size()); ++k) parts[k].alreadyIn = true;
}

Status Shard::finishPushLocked(HeldPush& push, bool applied) {
  Worker& me = workers_[push.id];
  me.clock += 1;
  me.pushingClock = -1;
  me.piecesIn = 0;
  me.inClosedStep = false;
  me.heldClock = -1;
  me.lastSeen = now();
  wire::PushReply* reply = push.reply;
  reply->set_applied(applied);
  reply->set_dropped(push.dropped);
  reply->set_version(version_);
  reply->set_samples_total(stats_.samples_total());
  const double held = std::chrono::duration<double>(now() - push.arrived).count();
  reply->set_wait_s(held);
  reply->set_stop_job(stopJob_);
  stats_.set_wait_s(stats_.wait_s() + held);
  if (push.request.want_values()) fillReplyLocked(push.request, reply, push.replyValues);
  changed_.notifyAll();
  return Status::Ok();
}

void Shard::countPushLocked(const HeldPush& push, int64_t pushedBytes) {
  // A shard restored from a checkpoint is behind the workers: their count is the true one.
  workers_[push.id].clock = push.request.clock();
  stats_.set_bytes_pushed(stats_.bytes_pushed() + pushedBytes);
  // Saturating: a hostile `samples` must not overflow the total (found by fuzz/push_fuzz.cpp).
  stats_.set_samples_total(stats_.samples_total() +
                           std::clamp<int64_t>(push.request.samples(), 0, INT64_MAX - stats_.samples_total()));
}

Status Shard::handlePush(const wire::PushRequest& request, const FramePayload* framed, const Stream* streamed,
                         wire::PushReply* reply, std::vector<float>* replyValues) {
  const auto arrived = now();
  std::vector<wire::PieceSpec> pieces;
  uint64_t admitted = 0;
  if (Status s = admitPush(request, &pieces, &admitted); !s.ok()) return s;
  DecodedPush decoded;
  decodePush(request, framed, streamed, pieces, decoded);

  MutexLock lock(mu_);
  if (Status s = acceptLocked(request, decoded, streamed, admitted); !s.ok()) return s;
  const bool early = streamed != nullptr && !streamed->keepsChunks();
  if (!early && request.clock() >= workers_[request.worker()].clock) markPiecesInLocked(request, decoded.grad);
  HeldPush push{.request = request,
                .reply = reply,
                .replyValues = replyValues,
                .streamed = streamed,
                .early = early,
                .grad = decoded.grad,
                .arrived = arrived,
                .id = request.worker(),
                .generation = generation_,
                .pulled = std::min<uint64_t>(request.pulled_version(), version_),  // a restarted shard is behind
                .dropped = {}};
  if (noteArrivalLocked(push)) return Status::Ok();
  if (!push.early && workers_[push.id].heldClock == request.clock()) return awaitHeldOriginalLocked(push);
  countPushLocked(push, decoded.pushedBytes);
  // This push's policy stays alive while it is held, whatever an Init does to updatePolicy_.
  const std::shared_ptr<const UpdatePolicy> policy = updatePolicy_;
  return policy->push(*this, push);
}

}  // namespace cohort::ps
