// TensorBoard event files (events.out.tfevents.*), written without TensorFlow. Torch-free, in
// cohort_base.
//
// The file is a sequence of TFRecords:
//   u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes | data | u32 masked CRC-32C of data
// where masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. Each record's data is a serialized
// tensorflow.Event (event.proto): wall_time = 1 (double), step = 2 (int64), and either
// file_version = 3 (string, the first record: "brain.Event:2"), summary = 5 (a
// tensorflow.Summary, summary.proto: repeated Value value = 1, Value { tag = 1 (string),
// simple_value = 2 (float) }) or session_log = 7 (SessionLog { status = 1 }). The protobuf wire
// format is written by hand: only these fields.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cohort {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), and TFRecord's mask of it.
uint32_t crc32c(std::span<const uint8_t> data);
uint32_t maskedCrc32c(std::span<const uint8_t> data);

// The serialized Event for a set of scalars at one step (exposed for the tests).
std::vector<uint8_t> encodeScalarEvent(double wallTime, int64_t step,
                                       const std::vector<std::pair<std::string, float>>& scalars);

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new file events.out.tfevents.<seconds>.<host>.<pid> in it,
  // starting with the file_version record. Throws IoError naming the path.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event with one Summary value per scalar, stamped with the wall clock. Non-finite values
  // are skipped. Flushed to the kernel every call, so a crash loses at most the record being
  // written (TensorBoard stops at a truncated record).
  void scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values);

  // A SessionLog START at `step` (Event.session_log = 7, SessionLog.status = 1, START = 1): a run
  // resumed from a checkpoint says where it starts again, and TensorBoard drops the events of the
  // earlier files at that step and after (the steps the crash undid), as torch's
  // SummaryWriter(purge_step) has it do.
  void sessionStart(int64_t step);

  const std::string& path() const { return path_; }

 private:
  void writeRecord(std::span<const uint8_t> data);

  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace cohort
