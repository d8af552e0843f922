// A gossip Peer's outboxes: publish() adds each step's update into one accumulator per
// destination, and that peer's sender thread swaps it out, encodes it (one Encoder per
// destination, so its residual is what this peer has not yet sent to that one) and sends it as
// one UPDATE; DONE follows once finish() asks and nothing is left.
#include "gossip/peer_internal.h"

#include <cohort/error.h>

#include <sys/socket.h>

#include <algorithm>

namespace cohort::gossip {

namespace {

using Outbox = Peer::Impl::Outbox;

// What the sender took out of its outbox in one go.
struct Batch {
  UpdateMeta meta;         // steps 0: nothing to send
  bool finishing = false;  // DONE follows
  PeerReport report;
};

// The sender thread's side of one destination's stream.
class Sender {
 public:
  Sender(Peer::Impl& m, int fd, int r, Outbox& box, const Proof& key)
      : m_(m),
        fd_(fd),
        r_(r),
        box_(box),
        sealer_(key),
        sending_(m.options.numel),
        encoder_(m.codec, encodedLength(m)),
        rawEncoder_(compress::CodecSpec{}, encodedLength(m)),
        sendingRows_(m.options.tables.size()),
        dense_(m.rowTables() ? m.denseLength : 0) {}

  // Until DONE is sent, a send fails, the peer is lost or this one stops.
  void run() {
    bool ok = true;
    while (ok && !m_.stopping.load() && !box_.dead.load()) {
      Batch batch;
      const Next next = take(batch);
      if (next == Next::kStop) break;
      if (next == Next::kIdle) continue;
      if (batch.meta.steps > 0) ok = sendUpdate(batch.meta);
      if (ok && batch.finishing) {
        auto done = doneFrame(batch.report);
        if (send(done, false)) ::shutdown(fd_, SHUT_WR);
        break;
      }
    }
  }

 private:
  enum class Next { kStop, kIdle, kSend };

  // What the codec encodes: the floats outside the row tables, or all of them.
  static size_t encodedLength(const Peer::Impl& m) { return m.rowTables() ? m.denseLength : m.options.numel; }

  // Waits at most a tick for the outbox to be ready (or finishing), then swaps its pending sum
  // into sending_ (sendingRows_ with row tables).
  Next take(Batch& batch) {
    MutexLock lock(box_.mutex);
    const auto wake = [&] {
      box_.mutex.assertHeld();
      return (box_.ready && box_.hasPending) || box_.finishing || m_.stopping.load() || box_.dead.load();
    };
    if (!wake()) box_.cv.waitFor(box_.mutex, std::chrono::milliseconds(kTickMs));
    if (m_.stopping.load() || box_.dead.load()) return Next::kStop;
    if (box_.hasPending && (box_.ready || box_.finishing)) {
      std::swap(sending_, box_.pending);
      if (m_.rowTables()) {
        std::swap(sendingRows_, box_.pendingRows);
        for (size_t t = 0; t < sendingRows_.size(); ++t) {
          for (uint32_t row : sendingRows_[t]) box_.pendingMarks[t][row] = 0;
        }
      }
      batch.meta = box_.meta;
      box_.hasPending = false;
      box_.ready = false;
    } else if (!box_.finishing) {
      return Next::kIdle;
    }
    batch.finishing = box_.finishing && !box_.hasPending;
    batch.report = box_.report;
    return Next::kSend;
  }

  // One UPDATE of what was taken; raw during the codec's warm-up.
  bool sendUpdate(UpdateMeta meta) {
    meta.encoding = m_.codec.kind == compress::CodecKind::None || meta.step <= m_.options.codecWarmupSteps
                        ? Encoding::kRaw
                        : Encoding::kCodec;
    beginUpdateFrame(meta, frame_);
    compress::Encoder& enc = meta.encoding == Encoding::kRaw ? rawEncoder_ : encoder_;
    if (!m_.rowTables()) {
      enc.encode(sending_, message_);
      frame_.insert(frame_.end(), message_.begin(), message_.end());
      return send(frame_, true);
    }
    const RowsSent rows = appendRows(enc, meta.encoding);
    if (!send(frame_, true)) return false;
    MutexLock lock(m_.stateMutex);
    m_.peers[size_t(r_)].rowsSent += rows.rows;
    m_.peers[size_t(r_)].rowBytesSent += rows.bytes;
    return true;
  }

  struct RowsSent {
    int64_t rows = 0;
    int64_t bytes = 0;  // their ids and values in the frame
  };

  // The floats outside the tables through the codec, the rows as they are; then sending_ is made
  // zero again (it comes back as an outbox's pending), at the same cost.
  RowsSent appendRows(compress::Encoder& enc, Encoding encoding) {
    takeDense();
    enc.encode(dense_, message_);
    for (auto& rows : sendingRows_) std::sort(rows.begin(), rows.end());
    const size_t before = frame_.size();
    appendRowPayload(frame_, message_, m_.options.tables, sendingRows_, sending_, m_.rowValues(encoding));
    // What the rows took on the wire, ids and values: the payload less the dense message, its
    // size, the value type and each table's count.
    RowsSent sent;
    sent.bytes = int64_t(frame_.size() - before - 8 - message_.size() - 4 - 4 * m_.options.tables.size());
    sent.rows = clearSentRows();
    return sent;
  }

  // Moves the floats outside the tables from sending_ into dense_, leaving zeros.
  void takeDense() {
    size_t at = 0;
    for (const auto& [b, e] : m_.denseRanges) {
      std::copy(sending_.begin() + ptrdiff_t(b), sending_.begin() + ptrdiff_t(e), dense_.begin() + ptrdiff_t(at));
      std::fill(sending_.begin() + ptrdiff_t(b), sending_.begin() + ptrdiff_t(e), 0.0f);
      at += e - b;
    }
  }

  // Zeroes the sent rows in sending_ and empties their lists; returns how many there were.
  int64_t clearSentRows() {
    int64_t rows = 0;
    for (size_t t = 0; t < sendingRows_.size(); ++t) {
      const RowTable& table = m_.options.tables[t];
      rows += int64_t(sendingRows_[t].size());
      for (uint32_t row : sendingRows_[t]) {
        float* v = sending_.data() + table.offset + uint64_t(row) * table.dim;
        std::fill(v, v + table.dim, 0.0f);
      }
      sendingRows_[t].clear();
    }
    return rows;
  }

  // Seals and writes a frame; on a failure the peer is marked lost and this returns false.
  bool send(std::vector<uint8_t>& bytes, bool isUpdate) {
    sealer_.seal(bytes);
    const std::string failed = writeFrame(fd_, bytes, secondsToDuration(m_.options.timeoutSeconds), m_.stopping);
    if (!failed.empty()) {
      m_.markLost(r_, failed);
      return false;
    }
    MutexLock lock(m_.stateMutex);
    m_.peers[size_t(r_)].bytesSent += int64_t(bytes.size());
    if (isUpdate) ++m_.peers[size_t(r_)].messagesSent;
    return true;
  }

  Peer::Impl& m_;
  const int fd_;
  const int r_;
  Outbox& box_;
  FrameSealer sealer_;
  std::vector<float> sending_;
  std::vector<uint8_t> frame_, message_;
  compress::Encoder encoder_;
  compress::Encoder rawEncoder_;  // warm-up steps
  std::vector<std::vector<uint32_t>> sendingRows_;
  std::vector<float> dense_;  // with row tables: the floats outside them
};

}  // namespace

// The rows' values travel in 16 bits under fp16 and bf16 once the warm-up is over; topk,
// threshold and onebit apply to the dense part only (as under ps, allreduce and average).
RowValues Peer::Impl::rowValues(Encoding encoding) const {
  if (encoding != Encoding::kCodec) return RowValues::kFloat32;
  if (codec.kind == compress::CodecKind::Fp16) return RowValues::kFloat16;
  if (codec.kind == compress::CodecKind::Bf16) return RowValues::kBfloat16;
  return RowValues::kFloat32;
}

void Peer::Impl::sendFrames(int fd, int r, Outbox& box, const Proof& key) { Sender(*this, fd, r, box, key).run(); }

void Peer::publish(std::span<const float> update, const UpdateMeta& meta, std::span<const int> to,
                   std::span<const std::vector<uint32_t>> rows) {
  Impl& m = *impl_;
  COHORT_CHECK(update.size() == m.options.numel, InvalidArgument, "gossip: an update of ", update.size(),
               " floats, expected ", m.options.numel);
  COHORT_CHECK(rows.size() == m.options.tables.size(), InvalidArgument, "gossip: rows of ", rows.size(),
               " tables for a model of ", m.options.tables.size());
  for (size_t t = 0; t < rows.size(); ++t) {
    for (uint32_t row : rows[t]) {
      COHORT_CHECK(row < m.options.tables[t].rows, InvalidArgument, "gossip: row ", row, " of a table of ",
                   m.options.tables[t].rows, " rows");
    }
  }
  for (int r = 0; r < int(m.outboxes.size()); ++r) {
    auto& box = m.outboxes[size_t(r)];
    if (!box || box->dead.load() || box->closed.load()) continue;
    const bool chosen = std::find(to.begin(), to.end(), r) != to.end();
    {
      MutexLock lock(box->mutex);
      if (m.rowTables()) {
        // pending is zero outside its listed rows: add, whether or not something is pending.
        float* p = box->pending.data();
        for (const auto& [b, e] : m.denseRanges) {
          for (size_t i = b; i < e; ++i) p[i] += update[i];
        }
        for (size_t t = 0; t < rows.size(); ++t) {
          const RowTable& table = m.options.tables[t];
          for (uint32_t row : rows[t]) {
            if (!box->pendingMarks[t][row]) {
              box->pendingMarks[t][row] = 1;
              box->pendingRows[t].push_back(row);
            }
            const size_t at = size_t(table.offset + uint64_t(row) * table.dim);
            for (size_t k = at; k < at + table.dim; ++k) p[k] += update[k];
          }
        }
      } else if (!box->hasPending) {
        std::copy(update.begin(), update.end(), box->pending.begin());
      } else {
        float* p = box->pending.data();
        for (size_t i = 0; i < update.size(); ++i) p[i] += update[i];
      }
      if (!box->hasPending) {  // the first update since the last send: its header starts here
        box->meta = meta;
        box->meta.sender = uint32_t(m.options.rank);
        box->meta.numel = m.options.numel;
        box->meta.steps = 0;
        box->meta.samples = 0;
        box->hasPending = true;
      }
      box->meta.version = meta.version;
      box->meta.step = meta.step;
      box->meta.steps += meta.steps;
      box->meta.samples += meta.samples;
      box->ready = box->ready || chosen;
    }
    if (chosen) box->cv.notifyOne();
  }
}

}  // namespace cohort::gossip
