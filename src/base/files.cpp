#include "base/files.h"

#include <cohort/error.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cohort {

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
  if (error != 0) refuse("cannot read it: " + std::string(std::strerror(error)));
  return text;
}

}  // namespace cohort
