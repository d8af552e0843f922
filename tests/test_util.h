// Helpers shared by the test binaries: temporary directories and running the cohort binary.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
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

// A TCP port that was free a moment ago on 127.0.0.1.
inline int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

inline std::string cohortBinary() { return COHORT_BINARY; }
inline std::string sourceDir() { return COHORT_SOURCE_DIR; }

// "cohort launch -n N [--ps M] --port P -- ": the prefix of a local job on a free port.
inline std::string launchPrefix(int workers, int shards = 0) {
  return cohortBinary() + " launch -n " + std::to_string(workers) +
         (shards > 0 ? " --ps " + std::to_string(shards) : "") + " --port " + std::to_string(freePort()) + " -- ";
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

// The last `event` line of a metrics file (null when there is none).
inline nlohmann::json lastEvent(const std::string& metricsPath, const std::string& event) {
  nlohmann::json found;
  for (const auto& line : lines(readFile(metricsPath))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == event) found = j;
  }
  return found;
}

// A hand-written TF_CONFIG job of workers and shards on 127.0.0.1, as a cluster would have;
// tfConfig() is a shell assignment for one task.
struct TfJob {
  std::vector<int> workers;
  std::vector<int> shards;
  TfJob(int n, int m) {
    for (int i = 0; i < n; ++i) workers.push_back(freePort());
    for (int i = 0; i < m; ++i) shards.push_back(freePort());
  }
  std::string tfConfig(const std::string& type, int index) const {
    auto list = [](const std::vector<int>& ports, size_t from) {
      std::string out;
      for (size_t i = from; i < ports.size(); ++i) out += (out.empty() ? "" : ",") + std::string("\\\"127.0.0.1:") + std::to_string(ports[i]) + "\\\"";
      return out;
    };
    return "TF_CONFIG=\"{\\\"cluster\\\":{\\\"chief\\\":[" + list({workers[0]}, 0) + "],\\\"worker\\\":[" + list(workers, 1) +
           "],\\\"ps\\\":[" + list(shards, 0) + "]},\\\"task\\\":{\\\"type\\\":\\\"" + type + "\\\",\\\"index\\\":" +
           std::to_string(index) + "}}\"";
  }
  std::string hosts() const {
    std::string out;
    for (int p : shards) out += (out.empty() ? "" : ",") + std::string("127.0.0.1:") + std::to_string(p);
    return out;
  }
};

}  // namespace cohort::test
