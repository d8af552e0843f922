#include "cli/experiment_common.h"

#include <cohort/error.h>

#include <unistd.h>

#include <climits>
#include <fstream>
#include <sstream>

namespace cohort::cli {

experiment::OptionCatalog trainCatalog(const CLI::App& app) {
  const CLI::App* train = nullptr;
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == "train") train = sub;
  }
  COHORT_CHECK(train != nullptr, Error, "the train command is not registered");
  experiment::OptionCatalog catalog;
  for (const CLI::Option* option : train->get_options()) {
    for (const std::string& name : option->get_lnames()) catalog.takesValue[name] = option->get_expected_max() != 0;
  }
  return catalog;
}

std::string selfExecutable() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  COHORT_CHECK(n > 0, Error, "cannot find this program's path in /proc/self/exe");
  return std::string(buf, size_t(n));
}

std::string selfInvocation() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  const std::string all = s.str();
  std::vector<std::string> argv;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    argv.push_back(all.substr(at, end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return experiment::shellQuote(argv);
}

}  // namespace cohort::cli
