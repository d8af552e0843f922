#include <cohort/checkpoint.h>
#include <cohort/error.h>

#include "base/coding.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <regex>

namespace cohort {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'C', 'O', 'H', 'O', 'R', 'T', 'C', 'K'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kHeaderSize = 8 + 4 + 8 + 4;
// The most payload bytes a header may claim. A payload is one process's model, optimizer state and
// scheme state, which a resume holds twice (the bytes and the tensors made from them): 16 GiB is a
// billion float32 parameters with Adam's two moments, beyond what cohort trains on CPUs. A header
// claiming more (a sparse file, a damaged or hostile one) is refused before anything is allocated.
constexpr uint64_t kMaxPayloadBytes = uint64_t{16} << 30;

uint32_t crc32Of(std::span<const uint8_t> data) {
  uLong crc = crc32(0L, Z_NULL, 0);
  size_t done = 0;
  while (done < data.size()) {
    const size_t n = std::min<size_t>(data.size() - done, 1u << 30);
    crc = crc32(crc, data.data() + done, uInt(n));
    done += n;
  }
  return uint32_t(crc);
}

void writeAll(int fd, const uint8_t* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    COHORT_CHECK(n > 0, IoError, path, ": cannot write checkpoint: ", std::strerror(errno));
    data += n;
    size -= size_t(n);
  }
}

void fsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  COHORT_CHECK(fd >= 0, IoError, path, ": cannot open to sync: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  COHORT_CHECK(rc == 0, IoError, path, ": fsync failed: ", std::strerror(errno));
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, std::string prefix, int keep)
    : dir_(std::move(dir)), prefix_(std::move(prefix)), keep_(std::max(keep, 1)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  COHORT_CHECK(!ec && fs::is_directory(dir_), IoError, dir_,
               ": cannot create the checkpoint directory: ", ec.message());
  removeOrphans();
}

std::string CheckpointStore::hostTag() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  std::string tag;
  for (const char* c = name; *c != '\0' && tag.size() < 64; ++c) {
    if (std::isalnum(static_cast<unsigned char>(*c)) || *c == '-' || *c == '_') tag += *c;
  }
  return tag.empty() ? "host" : tag;
}

// A directory has one writer at a time (the chief, a pipeline stage, a shard), so a temporary file
// (prefix-<step>.ckpt.tmp.<host>.<pid>) of another process is an orphan once that process is
// gone. This machine's: when its pid runs no more. Another machine's (a shared file system, a
// container's), whose pid means nothing to kill() here, or one without a host (an older cohort's
// .tmp.<pid>): only once also untouched for kOrphanAge, which no writer is in the middle of a save
// (each write() of at most 2 GiB updates its mtime).
void CheckpointStore::removeOrphans() const {
  const std::regex pattern(prefix_ + "-[0-9]+\\.ckpt\\.tmp\\.(?:([A-Za-z0-9_-]+)\\.)?([0-9]+)");
  const std::string here = hostTag();
  const auto oldest = fs::file_time_type::clock::now() - kOrphanAge;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, pattern) || m[2].length() > 9) continue;
    const pid_t pid = pid_t(std::stol(m[2].str()));
    const bool mine = m[1].matched && m[1].str() == here;
    if (mine && pid == ::getpid()) continue;
    if (pid <= 0 || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (!mine) {
      std::error_code aged;
      const fs::file_time_type written = fs::last_write_time(entry.path(), aged);
      if (aged || written > oldest) continue;
    }
    std::error_code removed;
    fs::remove(entry.path(), removed);  // best effort, like the old checkpoints
  }
}

std::string CheckpointStore::save(int64_t step, std::span<const uint8_t> payload) {
  char name[64];
  std::snprintf(name, sizeof(name), "-%010lld.ckpt", static_cast<long long>(step));
  const std::string finalPath = (fs::path(dir_) / (prefix_ + name)).string();
  const std::string tmpPath = finalPath + ".tmp." + hostTag() + "." + std::to_string(::getpid());

  std::vector<uint8_t> header(kMagic, kMagic + 8);
  putFixed32(header, kFormatVersion);
  putFixed64(header, payload.size());
  putFixed32(header, crc32Of(payload));

  const int fd = ::open(tmpPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  COHORT_CHECK(fd >= 0, IoError, tmpPath, ": cannot create checkpoint: ", std::strerror(errno));
  try {
    writeAll(fd, header.data(), header.size(), tmpPath);
    writeAll(fd, payload.data(), payload.size(), tmpPath);
    COHORT_CHECK(::fsync(fd) == 0, IoError, tmpPath, ": fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmpPath.c_str());
    throw;
  }
  ::close(fd);
  COHORT_CHECK(::rename(tmpPath.c_str(), finalPath.c_str()) == 0, IoError, finalPath,
               ": cannot rename checkpoint into place: ", std::strerror(errno));
  fsyncPath(dir_, O_RDONLY | O_DIRECTORY);

  auto files = list();
  const int64_t unreadAbove = evaluatedUpTo_ ? evaluatedUpTo_() : INT64_MAX;
  for (size_t i = size_t(keep_); i < files.size(); ++i) {
    if (files[i].step > unreadAbove && i < size_t(keep_ + kMaxUnread)) continue;
    if (files[i].path == finalPath) continue;  // under newer files (unreadable ones a resume skipped)
    std::error_code ec;
    fs::remove(files[i].path, ec);  // best effort: an old checkpoint left behind is harmless
  }
  removeOrphans();  // a crashed writer's, once old enough
  return finalPath;
}

std::vector<CheckpointFile> CheckpointStore::list(const std::function<void(const std::string&)>& onSkipped) const {
  const std::regex pattern(prefix_ + "-([0-9]+)\\.ckpt");
  std::vector<CheckpointFile> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, pattern)) continue;
    const std::string digits = m[1].str();
    int64_t step = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (error != std::errc() || end != digits.data() + digits.size()) {
      if (onSkipped) {
        onSkipped(entry.path().string() + ": not a checkpoint cohort wrote (its step " + digits +
                  " does not fit a 64-bit step count); skipped, remove it");
      }
      continue;
    }
    files.push_back({entry.path().string(), step});
  }
  std::sort(files.begin(), files.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.step > b.step; });
  return files;
}

std::vector<uint8_t> CheckpointStore::readVerified(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  COHORT_CHECK(in.good(), IoError, path, ": cannot open checkpoint: ", std::strerror(errno));
  std::error_code ec;
  const uint64_t fileSize = fs::file_size(path, ec);
  COHORT_CHECK(!ec, IoError, path, ": cannot read the checkpoint's size: ", ec.message());
  uint8_t header[kHeaderSize];
  in.read(reinterpret_cast<char*>(header), kHeaderSize);
  COHORT_CHECK(size_t(in.gcount()) == kHeaderSize && std::memcmp(header, kMagic, 8) == 0, IoError, path,
               ": not a cohort checkpoint (bad header)");
  const uint32_t version = decodeFixed32(&header[8]);
  COHORT_CHECK(version == kFormatVersion, IoError, path, ": checkpoint format version ", version,
               " is not supported (this build reads version ", kFormatVersion, ")");
  // Both checks before the allocation: the header's length must be what the file holds, and a
  // size a checkpoint can have.
  const uint64_t length = decodeFixed64(&header[12]);
  const uint32_t crc = decodeFixed32(&header[20]);
  COHORT_CHECK(fileSize - kHeaderSize == length, IoError, path, ": corrupt checkpoint: ", fileSize - kHeaderSize,
               " payload bytes where the header says ", length);
  COHORT_CHECK(length <= kMaxPayloadBytes, IoError, path, ": the header's payload length is ", length,
               " bytes, more than a checkpoint may hold (", kMaxPayloadBytes,
               "): not a checkpoint cohort wrote; remove it");
  std::vector<uint8_t> payload;
  try {
    payload.resize(length);
  } catch (const std::bad_alloc&) {
    throw IoError(path + ": the checkpoint's " + std::to_string(length) + " payload bytes do not fit in memory");
  }
  in.read(reinterpret_cast<char*>(payload.data()), std::streamsize(length));
  COHORT_CHECK(uint64_t(in.gcount()) == length, IoError, path, ": corrupt checkpoint: it ended after ",
               in.gcount(), " of its ", length, " payload bytes");
  COHORT_CHECK(crc32Of(payload) == crc, IoError, path, ": corrupt checkpoint: checksum mismatch");
  return payload;
}

std::optional<LoadedCheckpoint> CheckpointStore::loadNewest(
    const std::function<void(const std::string&)>& onCorrupt) const {
  for (const auto& file : list()) {
    try {
      return LoadedCheckpoint{file, readVerified(file.path)};
    } catch (const IoError& e) {
      if (onCorrupt) onCorrupt(std::string(e.what()) + "; trying an older checkpoint");
    }
  }
  return std::nullopt;
}

}  // namespace cohort
