#include "base/files.h"

#include <cohort/error.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace cohort {

namespace {

// The most readNamedFile reads: more than any config, host list, token, certificate or calibration
// holds, and a bound on a path that never ends (/dev/zero, /dev/urandom), which would otherwise be
// read until memory runs out.
constexpr size_t kMaxNamedFileBytes = size_t(64) << 20;

}  // namespace

std::string readNamedFile(std::string_view flag, const std::string& path, std::string_view fix) {
  const auto refuse = [&](std::string_view problem) {
    std::string message = std::string(flag) + " " + path + ": " + std::string(problem);
    if (!fix.empty()) message += "; " + std::string(fix);
    throw InvalidArgument(message);
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) refuse(errno == ENOENT ? std::string("no such file") : "cannot open it: " + std::string(std::strerror(errno)));
  std::string text;
  int error = 0;
  struct stat info{};
  if (::fstat(fd, &info) == 0 && S_ISDIR(info.st_mode)) {
    error = EISDIR;
  } else {
    char buffer[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n > 0) {
        if (text.size() + size_t(n) > kMaxNamedFileBytes) {
          error = EFBIG;
          break;
        }
        text.append(buffer, size_t(n));
      } else if (n == 0) {
        break;
      } else if (errno != EINTR) {
        error = errno;
        break;
      }
    }
  }
  ::close(fd);
  if (error == EISDIR) refuse("is a directory, not a file");
  if (error == EFBIG)
    refuse("is larger than " + std::to_string(kMaxNamedFileBytes >> 20) + " MiB, more than such a file holds");
  if (error != 0) refuse("cannot read it: " + std::string(std::strerror(error)));
  return text;
}

void checkOutputPath(std::string_view flag, const std::string& path) {
  const std::string named = std::string(flag) + " " + path;
  COHORT_CHECK(!path.empty(), InvalidArgument, flag, " needs a file to write to, got an empty path");
  std::error_code error;
  COHORT_CHECK(!path.ends_with('/') && !std::filesystem::is_directory(path, error), InvalidArgument, named,
               ": is a directory; name the file to write in it");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  COHORT_CHECK(dir.empty() || std::filesystem::is_directory(dir, error), InvalidArgument, named, ": the directory ",
               dir.string(), " does not exist; create it first");
}

namespace {

// fsync of a file or (O_DIRECTORY) a directory; false with errno set when it fails.
bool syncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return false;
  const bool synced = ::fsync(fd) == 0;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  return synced;
}

}  // namespace

void replaceFile(const std::string& given, const std::function<void(const std::string& tmp)>& write) {
  namespace fs = std::filesystem;
  std::error_code error;
  // A symlink is followed (its target is replaced, the link stays); what is not a regular file
  // (/dev/stdout, /dev/null, a FIFO) is written in place, as a plain open would.
  const fs::file_status status = fs::status(given, error);  // of what a symlink leads to
  const bool link = fs::is_symlink(fs::symlink_status(given, error));
  std::string path = given;
  if (link && fs::is_regular_file(status)) path = fs::canonical(given, error).string();
  if ((fs::exists(status) && !fs::is_regular_file(status)) || (link && (!fs::exists(status) || error))) {
    write(given);  // through the link, or into the device, pipe or FIFO
    return;
  }
  const std::string tmp = path + ".tmp";
  const auto fail = [&](const std::string& what) {
    const std::string reason = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw IoError(path + ": " + what + ": " + reason);
  };
  try {
    write(tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // The new file keeps the old one's permissions.
  if (fs::exists(status)) fs::permissions(tmp, status.permissions(), fs::perm_options::replace, error);
  if (!syncPath(tmp, O_RDONLY)) fail("cannot sync the new file to disk");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot put the new file in place");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  // The rename is done; a directory that cannot be synced (some file systems refuse) loses no data.
  syncPath(dir.empty() ? "." : dir.string(), O_RDONLY | O_DIRECTORY);
}

void replaceFileWithText(const std::string& path, std::string_view text) {
  replaceFile(path, [&](const std::string& tmp) {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    COHORT_CHECK(fd >= 0, IoError, path, ": cannot create ", tmp, ": ", std::strerror(errno));
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string reason = n < 0 ? std::strerror(errno) : "the device took no bytes";
        ::close(fd);
        throw IoError(path + ": cannot write " + tmp + ": " + reason);
      }
      done += size_t(n);
    }
    COHORT_CHECK(::close(fd) == 0, IoError, path, ": cannot write ", tmp, ": ", std::strerror(errno));
  });
}

bool writeToStream(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd ready{.fd = fd, .events = POLLOUT, .revents = 0};
      if (::poll(&ready, 1, -1) < 0 && errno != EINTR) return false;
      continue;
    }
    return false;
  }
  return true;
}

}  // namespace cohort
