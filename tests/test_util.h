// Helpers shared by the test binaries: temporary directories and running the cohort binary.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <netinet/in.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace cohort::test {

// A fresh directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "cohort-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
    if (path_.empty()) throw std::runtime_error("mkdtemp failed");
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct CommandResult {
  int exitCode = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command with a time limit (coreutils timeout sends SIGTERM, then SIGKILL).
inline CommandResult runCommand(const std::string& command, int timeoutSeconds = 300) {
  const std::string wrapped = "timeout -k 5 " + std::to_string(timeoutSeconds) + " " + command + " 2>&1";
  CommandResult result;
  FILE* pipe = ::popen(wrapped.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) result.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  result.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// A port on 127.0.0.1 reserved for as long as this object lives, for the runs that must be told a
// port before anything listens (mpirun, a client started before its server): a socket with
// SO_REUSEADDR bound to it that never listens. Connections there are refused; no process can bind
// it but one that also sets SO_REUSEADDR and is meant to (the rendezvous store and a gRPC shard
// do), so it cannot be taken between the test choosing it and the listener binding it. Tests where
// the listener can tell its port (Process::port(), cohort launch) use that instead.
class ReservedPort {
 public:
  ReservedPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      throw std::runtime_error("ReservedPort: cannot bind 127.0.0.1:0");
    }
    port_ = ntohs(addr.sin_port);
  }
  ~ReservedPort() { ::close(fd_); }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// The build's paths, unless the environment moves them (scripts/gpu-check.sh runs the tests from a
// bundle on another machine: COHORT_TEST_BINARY, COHORT_TEST_SOURCE_DIR).
inline std::string fromEnvironmentOr(const char* name, const char* built) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : built;
}
inline std::string cohortBinary() { return fromEnvironmentOr("COHORT_TEST_BINARY", COHORT_BINARY); }
inline std::string sourceDir() { return fromEnvironmentOr("COHORT_TEST_SOURCE_DIR", COHORT_SOURCE_DIR); }
// The Python with the torch wheel cohort was built against (scripts/setup.sh's .venv by default).
inline std::string python() { return COHORT_PYTHON; }

// "cohort launch -n N [--ps M] -- ": the prefix of a local job. No --port: the chief and the
// shards listen on ports they choose and tell the launcher.
inline std::string launchPrefix(int workers, int shards = 0) {
  return cohortBinary() + " launch -n " + std::to_string(workers) +
         (shards > 0 ? " --ps " + std::to_string(shards) : "") + " -- ";
}

inline std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void writeFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
}

inline std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

// Every `event` line of a metrics file, in order.
inline std::vector<nlohmann::json> events(const std::string& metricsPath, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (const auto& line : lines(readFile(metricsPath))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == event) out.push_back(j);
  }
  return out;
}

// The last `event` line of a metrics file (null when there is none).
inline nlohmann::json lastEvent(const std::string& metricsPath, const std::string& event) {
  nlohmann::json found;
  for (const auto& line : lines(readFile(metricsPath))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == event) found = j;
  }
  return found;
}

// A process the test starts by hand as its launcher would (sh -c COMMAND, which may begin with
// variable assignments): stdout and stderr go to one pipe the test reads, and the launcher channel
// (COHORT_LAUNCH_FD=3, base/launcher_channel.h) to another, so that a process that listens says
// which port it got ("port P") and the test waits for that line instead of choosing a port for it.
// Every wait has a timeout; the destructor kills and reaps what is still running (its process
// group: the shell and what it started).
class Process {
 public:
  explicit Process(const std::string& command) {
    int out[2], channel[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(channel, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    const std::string script = "COHORT_LAUNCH_FD=3; export COHORT_LAUNCH_FD; " + command;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(out[1], STDERR_FILENO);
      if (channel[1] == 3) {
        ::fcntl(3, F_SETFD, 0);
      } else {
        ::dup2(channel[1], 3);
      }
      ::execl("/bin/sh", "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(channel[1]);
    out_ = out[0];
    channel_ = channel[0];
    if (pid_ < 0) throw std::runtime_error("fork failed");
    ::setpgid(pid_, pid_);  // also here: no race with the kill of a destructor that comes early
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      ::kill(-pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    if (out_ >= 0) ::close(out_);
    if (channel_ >= 0) ::close(channel_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& output() const { return output_; }

  // The port it told on the launcher channel (0 for "port none"); -1, with a test failure, when it
  // told none within `timeout` or exited first.
  int port(std::chrono::seconds timeout = std::chrono::seconds(120)) {
    const bool told = pumpUntil([&] { return port_ >= 0; }, timeout);
    if (!told) ADD_FAILURE() << "no \"port\" line on the launcher channel; output:\n" << output_;
    return port_;
  }

  // Waits until the output holds `text`; false when it did not within `timeout` or the output ended.
  bool waitForOutput(const std::string& text, std::chrono::seconds timeout = std::chrono::seconds(120)) {
    return pumpUntil([&] { return output_.find(text) != std::string::npos; }, timeout);
  }

  void kill(int signo) const { ::kill(-pid_, signo); }

  // Reads the output to its end and reaps the process; after `timeout` it is killed (exit code
  // 128 + 9, and the output says so).
  CommandResult wait(std::chrono::seconds timeout = std::chrono::seconds(300)) {
    if (!pumpUntil([&] { return out_ < 0 && channel_ < 0; }, timeout)) {
      output_ += "\n[test: killed after " + std::to_string(timeout.count()) + " s]\n";
      kill(SIGKILL);
    }
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
    CommandResult result;
    result.output = output_;
    result.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return result;
  }

 private:
  // Reads output and channel (poll, no sleeping) until done() or the timeout; false on timeout, or
  // when both pipes closed with done() still false.
  template <typename Done>
  bool pumpUntil(Done done, std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      if (out_ < 0 && channel_ < 0) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd fds[2] = {{out_, POLLIN, 0}, {channel_, POLLIN, 0}};
      if (::poll(fds, 2, int(left.count())) < 0 && errno != EINTR) return false;
      if (fds[0].revents != 0) readInto(out_, output_);
      if (fds[1].revents != 0) {
        readInto(channel_, channelText_);
        for (size_t nl = channelText_.find('\n'); nl != std::string::npos; nl = channelText_.find('\n')) {
          const std::string line = channelText_.substr(0, nl);
          channelText_.erase(0, nl + 1);
          if (port_ < 0 && line.rfind("port ", 0) == 0) port_ = line == "port none" ? 0 : std::stoi(line.substr(5));
        }
      }
    }
    return true;
  }

  static void readInto(int& fd, std::string& text) {
    char buffer[4096];
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      text.append(buffer, size_t(n));
    } else if (n == 0 || errno != EINTR) {
      ::close(fd);  // a negative fd is ignored by poll
      fd = -1;
    }
  }

  pid_t pid_ = -1;
  int out_ = -1;
  int channel_ = -1;
  bool exited_ = false;
  int port_ = -1;
  std::string output_;
  std::string channelText_;
};

// Waits until predicate() holds, checking it again whenever something in directory `dir` changes
// (inotify: woken by the change, no polling); false when it still does not hold after `timeout`.
inline bool waitForChange(const std::string& dir, const std::function<bool()>& predicate,
                          std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const int fd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (fd < 0 || ::inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO |
                                                          IN_DELETE | IN_MOVED_FROM) < 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("waitForChange: cannot watch " + dir);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool held = predicate();
  while (!held) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(left.count())) > 0) {
      alignas(inotify_event) char events[4096];
      while (::read(fd, events, sizeof(events)) > 0) {
      }
    }
    held = predicate();
  }
  ::close(fd);
  return held;
}

// Waits until the file at `path` (in an existing directory) holds `text`.
inline bool waitForFileText(const std::string& path, const std::string& text,
                            std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return waitForChange(dir, [&] { return readFile(path).find(text) != std::string::npos; }, timeout);
}

// Waits until `path` exists, woken by inotify on its deepest existing ancestor (which may be
// created level by level meanwhile); false after `timeout`.
inline bool waitForPath(const std::string& path, std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!std::filesystem::exists(path)) {
    std::filesystem::path ancestor = std::filesystem::path(path).parent_path();
    while (!ancestor.empty() && !std::filesystem::exists(ancestor)) ancestor = ancestor.parent_path();
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    // Back as soon as anything in the ancestor changes: the path, or the next level towards it.
    const std::filesystem::path next = std::filesystem::path(path).lexically_relative(ancestor).begin()->string();
    waitForChange(ancestor.string(), [&] { return std::filesystem::exists(ancestor / next); },
                  std::max(left, std::chrono::seconds(1)));
  }
  return true;
}

// "127.0.0.1:P,...": the addresses of shards at these ports.
inline std::string loopbackHosts(const std::vector<int>& ports) {
  std::string out;
  for (int p : ports) out += (out.empty() ? "" : ",") + std::string("127.0.0.1:") + std::to_string(p);
  return out;
}

// TF_CONFIG='...' for one task of a job on 127.0.0.1, as a cluster operator writes it by hand (a
// shell assignment). Ports not known yet are 0: a chief or shard listens on any free port and
// tells it on its launcher channel (Process::port()); the other workers listen on nothing.
inline std::string tfConfig(int chiefPort, int workers, const std::vector<int>& shards, const std::string& type,
                            int index) {
  std::string others, servers;
  for (int i = 1; i < workers; ++i) others += std::string(others.empty() ? "" : ",") + "\"127.0.0.1:0\"";
  for (int p : shards) servers += (servers.empty() ? "" : ",") + std::string("\"127.0.0.1:") + std::to_string(p) + "\"";
  return "TF_CONFIG='{\"cluster\":{\"chief\":[\"127.0.0.1:" + std::to_string(chiefPort) + "\"],\"worker\":[" + others +
         "],\"ps\":[" + servers + "]},\"task\":{\"type\":\"" + type + "\",\"index\":" + std::to_string(index) + "}}'";
}

}  // namespace cohort::test
