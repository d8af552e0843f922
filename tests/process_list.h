// Test helper shared by the compare tests: which processes are still running. Kept out of
// test_util.h so that only the tests that use it depend on it.
#pragma once

#include "test_util.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace cohort::test {

// Processes whose command line mentions `needle` (other than this test's own): the runners, the
// ssh clients, the remote wrappers and the `cohort train`s of a comparison all name its OUT/runs/.
inline std::vector<int> processesMentioning(const std::string& needle) {
  std::vector<int> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int pid = std::stoi(name);
    if (pid == ::getpid()) continue;
    std::string cmdline = readFile(entry.path().string() + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(needle) != std::string::npos) out.push_back(pid);
  }
  return out;
}

}  // namespace cohort::test
