#include "cli/launch_environment.h"

#include "base/compute_threads.h"
#include "base/crypto.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace cohort::cli {

namespace {

bool hasEnv(const char* name) { return std::getenv(name) != nullptr; }

bool usesTfConfig(const LaunchOptions& options) { return options.parameterServers > 0 || options.evaluator; }

}  // namespace

std::vector<std::string> assignedElsewhere() {
  return {"RANK",        "WORLD_SIZE",   "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
          "MASTER_PORT", "SLURM_PROCID", "TF_CONFIG",  "OMPI_COMM_WORLD_*"};
}

EnvChanges sharedChildEnv(int processes) {
  EnvChanges env;
  if (!hasEnv("OMP_NUM_THREADS")) {
    const std::string threads = std::to_string(defaultComputeThreads(processes));
    env["OMP_NUM_THREADS"] = threads;
    if (!hasEnv("OPENBLAS_NUM_THREADS")) env["OPENBLAS_NUM_THREADS"] = threads;
  }
  // Every job gets a secret: ps shards and gossip peers refuse calls without it.
  if (!hasEnv("COHORT_AUTH_TOKEN")) env["COHORT_AUTH_TOKEN"] = crypto::randomToken();
  return env;
}

EnvChanges childEnv(const LaunchOptions& options, const ChildPlace& place, const JobPorts& ports, int restarts) {
  EnvChanges env;
  if (!place.server && !place.evaluator) {
    env["RANK"] = std::to_string(place.index);
    env["WORLD_SIZE"] = std::to_string(options.processes);
    env["LOCAL_RANK"] = std::to_string(place.index);
    env["LOCAL_WORLD_SIZE"] = std::to_string(options.processes);
  }
  env["MASTER_ADDR"] = options.host;
  env["MASTER_PORT"] = std::to_string(ports.master);
  env["COHORT_LAUNCH_FD"] = std::to_string(kChannelFd);
  env["COHORT_RESTART_COUNT"] = std::to_string(restarts);
  if (place.restartedAlone) env["COHORT_RESTARTED_ALONE"] = "1";
  if (usesTfConfig(options)) env["TF_CONFIG"] = tfConfig(options, place, ports);
  return env;
}

std::string tfConfig(const LaunchOptions& options, const ChildPlace& place, const JobPorts& ports) {
  const std::string host = options.host.find(':') != std::string::npos ? "[" + options.host + "]" : options.host;
  auto address = [&](int port) { return "\"" + host + ":" + std::to_string(port) + "\""; };
  std::string workers, servers;
  for (int r = 1; r < options.processes; ++r) workers += (workers.empty() ? "" : ",") + address(0);
  for (const int port : ports.shards) servers += (servers.empty() ? "" : ",") + address(std::max(0, port));
  const int index = place.index;
  const std::string type = place.evaluator ? "evaluator" : place.server ? "ps" : index == 0 ? "chief" : "worker";
  const int taskIndex = place.evaluator ? 0 : place.server ? index - options.processes : index == 0 ? 0 : index - 1;
  const std::string evaluators = options.evaluator ? ",\"evaluator\":[" + address(0) + "]" : "";
  return "{\"cluster\":{\"chief\":[" + address(ports.master) + "],\"worker\":[" + workers + "],\"ps\":[" + servers +
         "]" + evaluators + "},\"task\":{\"type\":\"" + type + "\",\"index\":" + std::to_string(taskIndex) + "}}";
}

}  // namespace cohort::cli
