#include "base/tensorboard.h"

#include "base/coding.h"

#include <cohort/error.h>

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

namespace cohort {

namespace {

// Table-driven CRC-32C, one byte at a time; event files are small.
std::array<uint32_t, 256> makeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}

// Protobuf wire format: a key is (field << 3) | wire type; 0 varint, 1 64-bit, 2 length-delimited,
// 5 32-bit. Little-endian fixed-width values.
enum WireType : uint8_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void putVarint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(uint8_t(v | 0x80));
    v >>= 7;
  }
  out.push_back(uint8_t(v));
}

void putKey(std::vector<uint8_t>& out, uint32_t field, WireType type) { putVarint(out, (uint64_t(field) << 3) | type); }

void putBytes(std::vector<uint8_t>& out, uint32_t field, std::span<const uint8_t> bytes) {
  putKey(out, field, kLengthDelimited);
  putVarint(out, bytes.size());
  out.insert(out.end(), bytes.begin(), bytes.end());
}

void putString(std::vector<uint8_t>& out, uint32_t field, std::string_view text) {
  putBytes(out, field, {reinterpret_cast<const uint8_t*>(text.data()), text.size()});
}

void putDouble(std::vector<uint8_t>& out, uint32_t field, double v) {
  putKey(out, field, kFixed64);
  putFixed64(out, std::bit_cast<uint64_t>(v));
}

void putFloat(std::vector<uint8_t>& out, uint32_t field, float v) {
  putKey(out, field, kFixed32);
  putFloat32(out, v);
}

// Event fields (event.proto) and Summary fields (summary.proto).
constexpr uint32_t kEventWallTime = 1;
constexpr uint32_t kEventStep = 2;
constexpr uint32_t kEventFileVersion = 3;
constexpr uint32_t kEventSummary = 5;
constexpr uint32_t kEventSessionLog = 7;
constexpr uint32_t kSessionLogStatus = 1;
constexpr uint64_t kSessionLogStart = 1;
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1;
constexpr uint32_t kValueSimpleValue = 2;

// An Event's wall_time and step, the fields every record after the first starts with.
void putEventHead(std::vector<uint8_t>& event, double wallTime, int64_t step) {
  putDouble(event, kEventWallTime, wallTime);
  putKey(event, kEventStep, kVarint);
  putVarint(event, uint64_t(step));  // int64: two's complement as a 64-bit varint
}

double unixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(std::span<const uint8_t> data) {
  static const std::array<uint32_t, 256> table = makeCrcTable();
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t byte : data) c = table[(c ^ byte) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t maskedCrc32c(std::span<const uint8_t> data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::vector<uint8_t> encodeScalarEvent(double wallTime, int64_t step,
                                       const std::vector<std::pair<std::string, float>>& scalars) {
  std::vector<uint8_t> summary;
  for (const auto& [tag, value] : scalars) {
    if (!std::isfinite(value)) continue;
    std::vector<uint8_t> v;
    putString(v, kValueTag, tag);
    putFloat(v, kValueSimpleValue, value);
    putBytes(summary, kSummaryValue, v);
  }
  std::vector<uint8_t> event;
  putEventHead(event, wallTime, step);
  putBytes(event, kEventSummary, summary);
  return event;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  COHORT_CHECK(!ec && std::filesystem::is_directory(dir), IoError, dir,
               ": cannot create the TensorBoard directory: ", ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const double now = unixSeconds();
  path_ = dir + "/events.out.tfevents." + std::to_string(int64_t(now)) + "." + host + "." + std::to_string(::getpid());
  file_ = std::fopen(path_.c_str(), "wb");
  COHORT_CHECK(file_ != nullptr, IoError, path_, ": cannot create the TensorBoard event file: ", std::strerror(errno));
  std::vector<uint8_t> first;
  putDouble(first, kEventWallTime, now);
  putString(first, kEventFileVersion, "brain.Event:2");
  writeRecord(first);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  writeRecord(encodeScalarEvent(unixSeconds(), step, values));
}

void TensorBoardWriter::sessionStart(int64_t step) {
  std::vector<uint8_t> log;
  putKey(log, kSessionLogStatus, kVarint);
  putVarint(log, kSessionLogStart);
  std::vector<uint8_t> event;
  putEventHead(event, unixSeconds(), step);
  putBytes(event, kEventSessionLog, log);
  writeRecord(event);
}

void TensorBoardWriter::writeRecord(std::span<const uint8_t> data) {
  std::vector<uint8_t> record;
  record.reserve(data.size() + 16);
  putFixed64(record, data.size());
  putFixed32(record, maskedCrc32c(std::span(record).first(8)));
  record.insert(record.end(), data.begin(), data.end());
  putFixed32(record, maskedCrc32c(data));
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_) == record.size() && std::fflush(file_) == 0;
  COHORT_CHECK(ok, IoError, path_, ": cannot write the TensorBoard event file: ", std::strerror(errno));
}

}  // namespace cohort
