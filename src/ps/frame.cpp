#include "ps/frame.h"
#include "ps/wire.h"

#include "base/coding.h"

#include <algorithm>
#include <cstring>

namespace cohort::ps {

namespace {

Status invalid(std::string message) { return Status::error(Code::kInvalidArgument, std::move(message)); }

// Copies n bytes from byte `offset` of the chunks (which hold at least offset + n) into out,
// calling afterChunk(bytes copied so far) after each chunk's share.
template <typename AfterChunk>
void gather(std::span<const std::span<const uint8_t>> chunks, size_t offset, size_t n, uint8_t* out,
            AfterChunk afterChunk) {
  size_t copied = 0;
  for (const auto& c : chunks) {
    if (copied == n) return;
    if (offset >= c.size()) {
      offset -= c.size();
      continue;
    }
    const size_t take = std::min(n - copied, c.size() - offset);
    std::memcpy(out + copied, c.data() + offset, take);
    copied += take;
    offset = 0;
    afterChunk(copied);
  }
}

void gather(std::span<const std::span<const uint8_t>> chunks, size_t offset, size_t n, uint8_t* out) {
  gather(chunks, offset, n, out, [](size_t) {});
}

}  // namespace

FramePayload::FramePayload(std::vector<std::span<const uint8_t>> parts) {
  for (const auto& p : parts) {
    if (p.empty()) continue;
    starts_.push_back(size_);
    size_ += p.size();
    parts_.push_back(p);
  }
}

std::span<const float> FramePayload::checkedFloats(size_t offset, size_t count, FloatScratch& scratch,
                                                   size_t* firstBad) const {
  *firstBad = count;
  if (count == 0) return {};
  const size_t bytes = count * sizeof(float);
  // The part holding `offset`: the last whose start is <= offset.
  const size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin()) - 1;
  const uint8_t* at = parts_[k].data() + (offset - starts_[k]);
  if (offset - starts_[k] + bytes <= parts_[k].size() && reinterpret_cast<uintptr_t>(at) % alignof(float) == 0) {
    ++inPlace_;
    *firstBad = firstNonFinite(at, count);
    return {reinterpret_cast<const float*>(at), count};
  }
  scratch.resize(count);
  size_t checked = 0;  // floats
  gather(parts_, offset, bytes, reinterpret_cast<uint8_t*>(scratch.data()),
         [&](size_t copied) {
           const size_t whole = copied / sizeof(float);  // the floats complete so far, checked while in cache
           if (*firstBad == count && whole > checked) {
             const size_t bad = firstNonFinite(scratch.data() + checked, whole - checked);
             if (bad < whole - checked) *firstBad = checked + bad;
           }
           checked = whole;
         });
  return scratch;
}

std::span<const float> FramePayload::floats(size_t offset, size_t count, FloatScratch& scratch) const {
  size_t unused = 0;
  return checkedFloats(offset, count, scratch, &unused);
}

void FramePayload::copyFloats(size_t offset, std::span<float> out) const {
  gather(parts_, offset, out.size() * sizeof(float), reinterpret_cast<uint8_t*>(out.data()));
}

std::string frameHead(const google::protobuf::MessageLite& header) {
  const size_t n = header.ByteSizeLong();
  std::string head(kFramePrefixBytes + n, '\0');
  std::memcpy(head.data(), kFrameMagic, sizeof(kFrameMagic));
  const uint32_t length = uint32_t(n);
  encodeFixed32(reinterpret_cast<uint8_t*>(head.data() + 4), length);
  header.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(head.data() + kFramePrefixBytes));
  return head;
}

Status parseFrame(std::span<const std::span<const uint8_t>> chunks, google::protobuf::MessageLite* header,
                  FramePayload* payload, const char* what) {
  const std::string w = what;
  size_t total = 0;
  for (const auto& c : chunks) total += c.size();
  if (total < kFramePrefixBytes) {
    return invalid(w + ": a frame of " + std::to_string(total) + " bytes is shorter than its 8-byte prefix");
  }
  uint8_t prefix[kFramePrefixBytes];
  gather(chunks, 0, kFramePrefixBytes, prefix);
  if (std::memcmp(prefix, kFrameMagic, sizeof(kFrameMagic)) != 0) {
    return invalid(w + ": not a cohort frame (its first bytes are not \"CPSF\"): run the same cohort on workers "
                       "and servers");
  }
  const uint32_t length = decodeFixed32(prefix + 4);
  if (length > kMaxFrameHeaderBytes) {
    return invalid(w + ": a frame header of " + std::to_string(length) + " bytes is over the limit of " +
                   std::to_string(kMaxFrameHeaderBytes));
  }
  if (total - kFramePrefixBytes < length) {
    return invalid(w + ": the frame is truncated: its header says " + std::to_string(length) + " bytes, " +
                   std::to_string(total - kFramePrefixBytes) + " follow the prefix");
  }
  std::string bytes(length, '\0');
  gather(chunks, kFramePrefixBytes, length, reinterpret_cast<uint8_t*>(bytes.data()));
  if (!header->ParseFromString(bytes)) return invalid(w + ": the frame's header does not parse");
  // The payload: what follows the header, as it lies in the chunks.
  std::vector<std::span<const uint8_t>> parts;
  size_t skip = kFramePrefixBytes + length;
  for (const auto& c : chunks) {
    if (skip >= c.size()) {
      skip -= c.size();
      continue;
    }
    parts.push_back(c.subspan(skip));
    skip = 0;
  }
  *payload = FramePayload(std::move(parts));
  return Status::Ok();
}

uint64_t framedPayloadBytes(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors) {
  uint64_t bytes = 0;
  // Saturating: the values are not checked yet, and a hostile numel must not wrap to the right sum.
  for (const auto& t : tensors) {
    bytes = t.numel() > (UINT64_MAX - bytes) / sizeof(float) ? UINT64_MAX : bytes + t.numel() * sizeof(float);
  }
  return bytes;
}

Status checkFramedTensors(const google::protobuf::RepeatedPtrField<wire::Tensor>& tensors,
                          std::span<const wire::PieceSpec> pieces, size_t payloadBytes, const char* what,
                          NoGradient noGradient) {
  const std::string w = what;
  uint64_t bytes = 0;
  for (int i = 0; i < tensors.size(); ++i) {
    const wire::Tensor& t = tensors.Get(i);
    if (size_t(i) >= pieces.size()) {
      return invalid(w + ": " + std::to_string(tensors.size()) + " framed pieces, expected " +
                     std::to_string(pieces.size()));
    }
    const wire::PieceSpec& p = pieces[size_t(i)];
    if (t.key() != p.key()) {
      return invalid(w + ": key " + std::to_string(t.key()) + " where piece " + std::to_string(p.key()) + " (" +
                     p.name() + ") belongs");
    }
    if (noGradient == NoGradient::kAllowed && isNoGradient(t)) continue;
    if (Status s = checkPieceShape(t, p, w); !s.ok()) return s;
    if (!t.data().empty()) {
      return invalid(w + ": " + p.name() + " carries data in the frame's header; its values belong in the payload");
    }
    bytes += p.numel() * sizeof(float);  // numel is a piece's: no overflow
  }
  if (size_t(tensors.size()) < pieces.size()) {
    const auto& p = pieces[size_t(tensors.size())];
    return invalid(w + ": piece " + std::to_string(p.key()) + " (" + p.name() + ") is missing");
  }
  if (bytes != payloadBytes) {
    return invalid(w + ": the frame's payload is " + std::to_string(payloadBytes) + " bytes, its pieces need " +
                   std::to_string(bytes));
  }
  return Status::Ok();
}

}  // namespace cohort::ps
