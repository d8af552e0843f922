// `cohort launch`'s output: the lines of the children's stdout and stderr forwarded with their
// "[rank i] " prefix, the lines of their launcher channels (base/launcher_channel.h), and the
// launcher's own "cohort launch: ..." lines. Every reader works on a non-blocking pipe and reads a
// bounded amount per call, so that one busy child cannot starve the others (cli/launch.h, "Output").
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::cli {

constexpr size_t kMaxLine = 64 * 1024;  // a longer line is forwarded in pieces

// Writes all of data (base/files.h writeToStream: signals, short writes, a full non-blocking pipe).
// Errors are dropped: there is nowhere to report them.
void writeAll(int fd, std::string_view data);

// One line of the launcher's own on stderr: "cohort launch: LINE".
void say(const std::string& line);

// The lines coming out of one pipe of one child, written with a prefix to one launcher stream.
class LineForwarder {
 public:
  LineForwarder(int fd, int target, std::string prefix) : fd_(fd), target_(target), prefix_(std::move(prefix)) {}
  LineForwarder(const LineForwarder&) = delete;
  LineForwarder& operator=(const LineForwarder&) = delete;
  ~LineForwarder() { close(); }

  int fd() const { return fd_; }
  bool isOpen() const { return fd_ >= 0; }

  // Reads what the pipe holds now (a bounded amount) and forwards every complete line. At end of
  // file, forwards the partial last line and closes the pipe. Returns true if more may be waiting.
  bool readAvailable();
  // Forwards what is left, the partial last line included, and closes the pipe.
  void close();

 private:
  void forwardLines();
  void emit(std::string_view line);

  int fd_;
  const int target_;
  const std::string prefix_;
  std::string pending_;
};

// The read end of a child's launcher channel: whole lines, handed over one by one; a partial last
// line is dropped at end of file.
class ChannelReader {
 public:
  explicit ChannelReader(int fd) : fd_(fd) {}
  ChannelReader(const ChannelReader&) = delete;
  ChannelReader& operator=(const ChannelReader&) = delete;
  ~ChannelReader() { close(); }

  int fd() const { return fd_; }
  bool isOpen() const { return fd_ >= 0; }
  void close();

  // Reads what the pipe holds now and returns the complete lines.
  std::vector<std::string> readLines();

 private:
  int fd_;
  std::string pending_;
};

}  // namespace cohort::cli
