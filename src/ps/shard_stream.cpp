// A Shard's streamed pushes (the PushStream call; see Shard::beginStream in shard.h): the plan a
// stream gets when its header arrives, each chunk checked and applied or gathered as it arrives,
// and its end, counted as one update or refused.
#include "base/clock.h"
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

Status Shard::beginStream(const wire::PushRequest& request, std::unique_ptr<Stream>* stream) {
  std::vector<wire::PieceSpec> pieces;
  if (Status s = admitPush(request, &pieces); !s.ok()) return s;
  Status s =
      !request.compressed().empty() || request.row_sparse() || request.rows_size() > 0 || request.want_rows_size() > 0
          ? Status::error(Code::kInvalidArgument,
                          "push: a streamed push carries float32 values only (no codec, no rows): send "
                          "compressed and row-sparse pushes with Push")
          : checkFramedTensors(request.values(), pieces, size_t(framedPayloadBytes(request.values())), "push",
                               NoGradient::kAllowed);
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
  updatePolicy_->planStream(*this, st);
  if (!st.keepsChunks()) piecesInLocked(request);  // said here; addChunk passes over them
  workers_[id].lastSeen = now();
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
  // A piece the worker had no gradient for has no floats (numel 0 in the header).
  auto floatsIn = [&](size_t k) { return size_t(stream.request.values(int(k)).numel()); };
  size_t bytes = 0;
  for (size_t k = first; s.ok() && k < first + count; ++k) bytes += floatsIn(k) * sizeof(float);
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
    const size_t numel = floatsIn(k);
    size_t bad = numel;
    stream.dense[k] = payload.checkedFloats(offset, numel, stream.copies[k], &bad);
    offset += numel * sizeof(float);
    if (bad < numel) {
      s = nonFinite(stream.pieces[k], stream.dense[k], bad);
    }
  }
  if (!s.ok()) return refuseStream(stream, s);
  stream.nextPiece = first + count;
  stream.bytes += int64_t(payload.size());
  if (stream.keepsChunks()) {
    if (options_.afterChunk) options_.afterChunk(stream.request.worker(), stream.nextPiece);
    return Status::Ok();
  }

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
      workers_[stream.request.worker()].lastSeen = now();
      const Part part{.values = stream.dense[k],
                      .rows = {},
                      .numel = numel,
                      .rowDim = 0,
                      .noGradient = isNoGradient(stream.request.values(int(k)))};
      const bool take = stream.plan == Stream::Plan::kApply || updatePolicy_->stillGathering(*this, stream);
      // else sync's step closed meanwhile: the rest of the push is late (finishStream says so).
      if (take && takePieceLocked(stream.request.worker(), stream.request.clock(), k)) {
        if (stream.plan == Stream::Plan::kApply) {
          applyPieceLocked(k, at, part, stream.scale);
        } else {
          accumulatePieceLocked(k, at, part, stream.scale);
        }
        ++stream.applied;
      } else if (take) {
        ++stream.applied;  // in already, from another attempt of this push
      }
    }
    stream.dense[k] = {};
    FloatScratch().swap(stream.copies[k]);
    at += numel;
  }
  if (options_.afterChunk) options_.afterChunk(stream.request.worker(), stream.nextPiece);
  return Status::Ok();
}

Status Shard::finishStream(Stream& stream, wire::PushReply* reply, std::vector<float>* replyValues) {
  if (stream.ended) return Status::error(Code::kInvalidArgument, "push: the stream was refused");
  if (stream.nextPiece != stream.pieces.size()) {
    const Status s =
        Status::error(Code::kInvalidArgument, "push: the stream ended after " + std::to_string(stream.nextPiece) +
                                                  " of its " + std::to_string(stream.pieces.size()) + " pieces");
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
  // A whole stream that does not count (sync's step closed while it arrived) did not end early.
  const bool whole = stream.nextPiece == stream.pieces.size();
  log("a streamed push of worker " + std::to_string(stream.request.worker()) +
      (whole ? " arrived whole but was not counted: " : " ended early: ") + why.message + "; " + kept);
  return Status::error(why.code, why.message + "; " + kept);
}

}  // namespace cohort::ps
