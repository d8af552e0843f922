// Checkpoint files on disk, crash-safe. The payload is opaque bytes (the Trainer puts a torch
// archive in it); this layer makes sure that what it hands back is exactly what was saved.
//
// File layout: "COHORTCK" | u32 format version | u64 payload length | u32 CRC-32 | payload.
// A save writes a temporary file in the same directory, fsyncs it, renames it over the final
// name and fsyncs the directory, so a kill at any moment leaves every earlier checkpoint whole.
#pragma once

#include <cohort/export.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort {

struct COHORT_API CheckpointFile {
  std::string path;
  int64_t step = 0;
};

struct COHORT_API LoadedCheckpoint {
  CheckpointFile file;
  std::vector<uint8_t> payload;
};

class COHORT_API CheckpointStore {
 public:
  // `prefix` names the files (prefix-<step>.ckpt), so several stores can share a directory.
  // The newest `keep` checkpoints are kept. The directory is created if it does not exist. Temporary
  // files of this prefix left by writers that died mid-save (prefix-<step>.ckpt.tmp.<host>.<pid>:
  // this machine's once its pid runs no more; another machine's once also untouched for
  // kOrphanAge) are removed, here and by save().
  explicit CheckpointStore(std::string dir, std::string prefix = "ckpt", int keep = 3);

  // Returns the path written. Throws IoError.
  std::string save(int64_t step, std::span<const uint8_t> payload);

  // Complete checkpoint files (temporary files excluded), newest first. A file named like one
  // whose step does not fit int64 is no checkpoint of this store: it is left out, and passed to
  // `onSkipped` (when given) with a message naming its path.
  std::vector<CheckpointFile> list(const std::function<void(const std::string& message)>& onSkipped = nullptr) const;

  // The newest checkpoint that verifies. Each one that does not is passed to `onCorrupt` with a
  // message naming its path and what is wrong, and the next older one is tried.
  std::optional<LoadedCheckpoint> loadNewest(
      const std::function<void(const std::string& message)>& onCorrupt) const;

  // Reads and verifies one file. Throws IoError naming the path, before allocating anything when
  // the header's payload length is not the file's or is above 16 GiB.
  static std::vector<uint8_t> readVerified(const std::string& path);

  const std::string& dir() const { return dir_; }

  // While an evaluator reads the checkpoints: save() does not prune checkpoints whose step is
  // above what `evaluatedUpTo()` returns (the steps it has done), up to kMaxUnread of them beyond
  // `keep`, so that it evaluates every one even when it falls behind.
  static constexpr int kMaxUnread = 50;
  void keepUnread(std::function<int64_t()> evaluatedUpTo) { evaluatedUpTo_ = std::move(evaluatedUpTo); }

  // How long another machine's temporary file (or one without a host) must have been untouched
  // before it is an orphan: its pid means nothing here, and its writer may be writing still.
  static constexpr std::chrono::minutes kOrphanAge{10};

  // This machine as a temporary file's name carries it: the letters, digits, '-' and '_' of its
  // host name ("host" when none).
  static std::string hostTag();

 private:
  void removeOrphans() const;

  std::string dir_;
  std::string prefix_;
  int keep_;
  std::function<int64_t()> evaluatedUpTo_;
};

}  // namespace cohort
