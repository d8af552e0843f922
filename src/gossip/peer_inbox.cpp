// A gossip Peer's inbox: one reader thread per authenticated incoming stream reads its frames,
// checks each UPDATE whole (its layout, finite values) and adds it into the inbox; drain() swaps
// the inbox out.
#include "gossip/peer_internal.h"

#include "base/socket_io.h"

#include <cohort/error.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace cohort::gossip {

void Peer::Impl::readLoop(int fd, int from, Proof key) {
  try {
    readFrames(fd, from, key);
  } catch (const std::exception& e) {
    markLost(from, std::string("it sent a malformed frame: ") + e.what());
  } catch (...) {
    markLost(from, "reading from it failed");
  }
  ::close(fd);
}

void Peer::Impl::readFrames(int fd, int from, const Proof& key) {
  FrameSealer sealer(key);
  std::array<uint8_t, kHeaderBytes> header{};
  std::vector<uint8_t> body;
  std::vector<float> decoded;  // each update on its own, checked before it joins the inbox
  while (true) {
    const IoLimits untilStopped{.stop = &stopping};
    IoStatus r = readFull(fd, header.data(), header.size(), untilStopped);
    FrameHeader h;
    if (r == IoStatus::kOk) {
      h = parseHeader(header, maxBody);
      body.resize(h.length);
      r = readFull(fd, body.data(), body.size(), untilStopped);
    }
    if (r == IoStatus::kStopped) return;
    if (r != IoStatus::kOk) {
      markLost(from, r == IoStatus::kClosed ? "its connection closed before it finished" : "reading from it failed");
      return;
    }
    const std::span<const uint8_t> content = sealer.open(header, body);
    const auto frameBytes = int64_t(kHeaderBytes + body.size());
    if (h.type == FrameType::kDone) {
      const PeerReport report = parseDone(content);
      {
        MutexLock lock(stateMutex);
        PeerCounters& p = peers[size_t(from)];
        p.bytesReceived += frameBytes;
        p.report = report;
        if (!p.lost) p.finished = true;
      }
      stateCv.notifyAll();
      return;
    }
    COHORT_CHECK(h.type == FrameType::kUpdate, InvalidArgument, "a ", frameName(h.type), " frame after the handshake");
    const UpdateMeta meta = parseUpdate(content);
    COHORT_CHECK(meta.sender == uint32_t(from) && meta.numel == options.numel, InvalidArgument, "an UPDATE from ",
                 meta.sender, " of ", meta.numel, " floats on the stream of peer ", from, " (expected ", options.numel,
                 ")");
    if (rowTables()) {
      receiveRows(content.subspan(kUpdateHeaderBytes), meta, decoded);
    } else {
      receiveDense(content.subspan(kUpdateHeaderBytes), meta, decoded);
    }
    MutexLock lock(stateMutex);
    PeerCounters& p = peers[size_t(from)];
    p.bytesReceived += frameBytes;
    ++p.messagesReceived;
  }
}

void Peer::Impl::receiveDense(std::span<const uint8_t> message, const UpdateMeta& meta, std::vector<float>& decoded) {
  // Codec messages describe themselves; decodeAdd checks the whole message before it adds.
  decoded.assign(options.numel, 0.0f);
  compress::decodeAdd(message, decoded, 1.0f);
  // As the shards refuse non-finite pushes: one NaN would poison this replica for good.
  const auto bad = std::find_if(decoded.begin(), decoded.end(), [](float v) { return !std::isfinite(v); });
  COHORT_CHECK(bad == decoded.end(), InvalidArgument, "an update holding ", std::isnan(*bad) ? "NaN" : "Inf",
               " at element ", bad - decoded.begin());
  MutexLock lock(inboxMutex);
  float* in = inbox.data();
  for (size_t i = 0; i < decoded.size(); ++i) in[i] += decoded[i];
  received.steps += meta.steps;
  received.samples += meta.samples;
  ++received.messages;
  received.metas.push_back(meta);
}

void Peer::Impl::receiveRows(std::span<const uint8_t> payload, const UpdateMeta& meta, std::vector<float>& decoded) {
  const RowPayload rows = parseRowPayload(payload, options.tables);
  decoded.assign(denseLength, 0.0f);
  compress::decodeAdd(rows.denseMessage, decoded, 1.0f);
  auto finite = [](const std::vector<float>& v, const char* where) {
    const auto bad = std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
    COHORT_CHECK(bad == v.end(), InvalidArgument, "an update holding ", std::isnan(*bad) ? "NaN" : "Inf", " in ",
                 where);
  };
  finite(decoded, "its dense part");
  for (const auto& v : rows.values) finite(v, "its rows");
  MutexLock lock(inboxMutex);
  float* in = inbox.data();
  size_t at = 0;
  for (const auto& [b, e] : denseRanges) {
    for (size_t i = b; i < e; ++i) in[i] += decoded[at++];
  }
  for (size_t t = 0; t < options.tables.size(); ++t) {
    const RowTable& table = options.tables[t];
    for (size_t j = 0; j < rows.rows[t].size(); ++j) {
      const uint32_t r = rows.rows[t][j];
      if (!inboxMarks[t][r]) {
        inboxMarks[t][r] = 1;
        received.rows[t].push_back(r);
      }
      float* dst = in + table.offset + uint64_t(r) * table.dim;
      const float* src = rows.values[t].data() + j * table.dim;
      for (uint32_t k = 0; k < table.dim; ++k) dst[k] += src[k];
    }
  }
  received.steps += meta.steps;
  received.samples += meta.samples;
  ++received.messages;
  received.metas.push_back(meta);
}

Drained Peer::drain(std::vector<float>& into) {
  Impl& m = *impl_;
  COHORT_CHECK(into.size() == m.options.numel, InvalidArgument, "gossip: drain into ", into.size(),
               " floats, expected ", m.options.numel);
  MutexLock lock(m.inboxMutex);
  std::swap(into, m.inbox);
  Drained out = std::move(m.received);
  m.received = Drained{};
  m.received.rows.resize(m.options.tables.size());
  for (size_t t = 0; t < out.rows.size(); ++t) {
    for (uint32_t r : out.rows[t]) m.inboxMarks[t][r] = 0;
  }
  return out;
}

}  // namespace cohort::gossip
