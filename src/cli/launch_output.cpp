#include "cli/launch_output.h"

#include "base/files.h"

#include <unistd.h>

#include <array>
#include <cerrno>

namespace cohort::cli {

namespace {

constexpr size_t kReadChunk = 64 * 1024;
constexpr int kReadsPerWakeup = 16;  // so that one busy writer cannot starve the others

}  // namespace

void writeAll(int fd, std::string_view data) { writeToStream(fd, data); }

void say(const std::string& line) { writeAll(STDERR_FILENO, "cohort launch: " + line + "\n"); }

bool LineForwarder::readAvailable() {
  std::array<char, kReadChunk> buffer;
  for (int i = 0; i < kReadsPerWakeup && isOpen(); ++i) {
    const ssize_t n = ::read(fd_, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n <= 0) {
      close();
      return false;
    }
    pending_.append(buffer.data(), size_t(n));
    forwardLines();
  }
  return isOpen();
}

void LineForwarder::close() {
  if (!isOpen()) return;
  ::close(fd_);
  fd_ = -1;
  if (!pending_.empty()) emit(pending_);
  pending_.clear();
}

void LineForwarder::forwardLines() {
  size_t begin = 0;
  for (;;) {
    const size_t newline = pending_.find('\n', begin);
    if (newline == std::string::npos) {
      if (pending_.size() - begin < kMaxLine) break;
      emit(std::string_view(pending_).substr(begin, kMaxLine));
      begin += kMaxLine;
      continue;
    }
    emit(std::string_view(pending_).substr(begin, newline - begin));
    begin = newline + 1;
  }
  pending_.erase(0, begin);
}

void LineForwarder::emit(std::string_view line) {
  std::string out;
  out.reserve(prefix_.size() + line.size() + 1);
  out.append(prefix_).append(line).push_back('\n');
  writeAll(target_, out);  // one write per line keeps lines whole when streams are shared
}

void ChannelReader::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::vector<std::string> ChannelReader::readLines() {
  std::vector<std::string> lines;
  std::array<char, 4096> buffer;
  for (int i = 0; i < kReadsPerWakeup && isOpen(); ++i) {
    const ssize_t n = ::read(fd_, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      close();
      break;
    }
    pending_.append(buffer.data(), size_t(n));
    if (pending_.size() > kMaxLine) pending_.erase(0, pending_.size() - kMaxLine);  // a runaway writer
  }
  for (size_t newline = pending_.find('\n'); newline != std::string::npos; newline = pending_.find('\n')) {
    lines.push_back(pending_.substr(0, newline));
    pending_.erase(0, newline + 1);
  }
  return lines;
}

}  // namespace cohort::cli
