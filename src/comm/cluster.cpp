#include <cohort/cluster.h>
#include <cohort/error.h>

#include "base/host_port.h"
#include "base/text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace cohort {

namespace {

constexpr char kLoopback[] = "127.0.0.1";
// A guard against a hand-written "node[0-999999999]" exhausting memory; no cluster is that big.
constexpr long long kMaxRangeHosts = 1 << 20;

// The environment with empty values read as unset, as shells and launchers tend to leave them.
class NonEmptyEnv {
 public:
  explicit NonEmptyEnv(const EnvLookup& lookup) : lookup_(lookup) {}

  std::optional<std::string> get(const std::string& name) const {
    std::optional<std::string> value = lookup_ ? lookup_(name) : std::nullopt;
    if (value && value->empty()) return std::nullopt;
    return value;
  }
  bool has(const std::string& name) const { return get(name).has_value(); }

 private:
  const EnvLookup& lookup_;
};

// "NAME=value" parsed as an int; the message names both.
int parseWhole(const std::string& name, const std::string& value) {
  long long parsed = 0;
  const char* first = value.data();
  const char* last = first + value.size();
  const auto [ptr, ec] = std::from_chars(first, last, parsed);
  COHORT_CHECK(ec != std::errc::invalid_argument && ptr == last, InvalidArgument, name, "=", value,
               " is not a whole number");
  COHORT_CHECK(ec != std::errc::result_out_of_range && parsed >= INT_MIN && parsed <= INT_MAX,
               InvalidArgument, name, "=", value, " is too large");
  return int(parsed);
}

std::optional<int> wholeVar(const NonEmptyEnv& env, const std::string& name) {
  std::optional<std::string> value = env.get(name);
  if (!value) return std::nullopt;
  return parseWhole(name, *value);
}

int nonNegativeVar(const NonEmptyEnv& env, const std::string& name, int fallback) {
  const int value = wholeVar(env, name).value_or(fallback);
  COHORT_CHECK(value >= 0, InvalidArgument, name, "=", value, " is negative");
  return value;
}

int positiveVar(const NonEmptyEnv& env, const std::string& name, int fallback) {
  const int value = wholeVar(env, name).value_or(fallback);
  COHORT_CHECK(value >= 1, InvalidArgument, name, "=", value, " must be at least 1");
  return value;
}

// A pair of variables a launcher always sets together (RANK and WORLD_SIZE): both or neither.
void requireBoth(const NonEmptyEnv& env, const std::string& a, const std::string& b, const std::string& who) {
  const bool hasA = env.has(a);
  const bool hasB = env.has(b);
  COHORT_CHECK(hasA || !hasB, InvalidArgument, b, " is set but ", a, " is not: ", who, " sets both");
  COHORT_CHECK(hasB || !hasA, InvalidArgument, a, " is set but ", b, " is not: ", who, " sets both");
}

// Port 0 is the address of a task that listens on any free port and tells its launcher which
// (cohort launch without --port gives it to the chief and the shards, and the real port to the
// tasks started after them); whoever connects to port 0 is refused where it connects.
bool validPort(long long port) { return port >= 0 && port <= 65535; }

int portVar(const NonEmptyEnv& env, const std::string& name) {
  std::optional<std::string> value = env.get(name);
  if (!value) return kDefaultMasterPort;
  const int port = parseWhole(name, *value);
  COHORT_CHECK(validPort(port), InvalidArgument, name, "=", *value, " is not a port (0..65535)");
  return port;
}

// "[::1]" -> "::1": HostPort keeps IPv6 hosts bare.
std::string bareHost(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

HostPort masterFrom(const NonEmptyEnv& env, const std::string& host) {
  return HostPort{bareHost(host), portVar(env, "MASTER_PORT")};
}

const char* roleName(Role role) {
  switch (role) {
    case Role::kWorker:
      return "worker";
    case Role::kParameterServer:
      return "ps";
    case Role::kEvaluator:
      return "evaluator";
  }
  return "worker";
}

// ---------------------------------------------------------------------------------------------
// TF_CONFIG

constexpr const char* kTfJobs[] = {"chief", "worker", "ps", "evaluator"};

bool isTfJob(const std::string& name) {
  for (const char* job : kTfJobs) {
    if (name == job) return true;
  }
  return false;
}

std::vector<HostPort> tfAddresses(const nlohmann::json& cluster, const std::string& job) {
  std::vector<HostPort> out;
  if (!cluster.contains(job)) return out;
  const nlohmann::json& list = cluster.at(job);
  COHORT_CHECK(list.is_array(), InvalidArgument, "TF_CONFIG cluster.", job,
               " is not a list of \"host:port\" strings: ", list.dump());
  for (size_t i = 0; i < list.size(); ++i) {
    COHORT_CHECK(list[i].is_string(), InvalidArgument, "TF_CONFIG cluster.", job, "[", i,
                 "] is not a \"host:port\" string: ", list[i].dump());
    std::optional<HostPort> address = parseHostPort(list[i].get<std::string>(), /*allowPortZero=*/true);
    COHORT_CHECK(address.has_value(), InvalidArgument, "TF_CONFIG cluster.", job, "[", i, "] ",
                 list[i].dump(), " is not host:port with a valid port (0..65535)");
    out.push_back(*address);
  }
  return out;
}

// The task's index, 0 when absent (as TensorFlow reads it).
int tfTaskIndex(const nlohmann::json& task) {
  if (!task.contains("index")) return 0;
  const nlohmann::json& index = task.at("index");
  COHORT_CHECK(index.is_number_integer(), InvalidArgument, "TF_CONFIG task.index ", index.dump(),
               " is not a whole number");
  if (index.is_number_unsigned()) {
    const uint64_t value = index.get<uint64_t>();
    COHORT_CHECK(value <= uint64_t(INT_MAX), InvalidArgument, "TF_CONFIG task.index=", value,
                 " is out of range");
    return int(value);
  }
  const int64_t value = index.get<int64_t>();
  COHORT_CHECK(value >= 0, InvalidArgument, "TF_CONFIG task.index=", value, " is negative");
  COHORT_CHECK(value <= INT_MAX, InvalidArgument, "TF_CONFIG task.index=", value, " is out of range");
  return int(value);
}

ClusterSpec fromTfConfig(const std::string& text) {
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument("TF_CONFIG is not JSON: " + firstLine(e.what()));
  }
  COHORT_CHECK(config.is_object(), InvalidArgument, "TF_CONFIG is not a JSON object with \"cluster\" and \"task\"");
  COHORT_CHECK(config.contains("cluster"), InvalidArgument, "TF_CONFIG has no \"cluster\"");
  COHORT_CHECK(config.contains("task"), InvalidArgument, "TF_CONFIG has no \"task\"");
  const nlohmann::json& cluster = config.at("cluster");
  const nlohmann::json& task = config.at("task");
  COHORT_CHECK(cluster.is_object(), InvalidArgument, "TF_CONFIG \"cluster\" is not an object of job lists");
  COHORT_CHECK(task.is_object(), InvalidArgument, "TF_CONFIG \"task\" is not an object with \"type\" and \"index\"");

  for (const auto& [job, list] : cluster.items()) {
    COHORT_CHECK(isTfJob(job), InvalidArgument, "TF_CONFIG cluster.", job,
                 " is not a job cohort runs (chief, worker, ps, evaluator)");
  }
  const std::vector<HostPort> chiefs = tfAddresses(cluster, "chief");
  const std::vector<HostPort> plainWorkers = tfAddresses(cluster, "worker");
  const std::vector<HostPort> servers = tfAddresses(cluster, "ps");
  const std::vector<HostPort> evaluators = tfAddresses(cluster, "evaluator");
  COHORT_CHECK(chiefs.size() <= 1, InvalidArgument, "TF_CONFIG cluster.chief lists ", chiefs.size(),
               " addresses: there is at most one chief");

  ClusterSpec spec;
  spec.source = "TF_CONFIG";
  spec.workers = chiefs;
  spec.workers.insert(spec.workers.end(), plainWorkers.begin(), plainWorkers.end());
  spec.parameterServers = servers;
  spec.evaluators = evaluators;
  COHORT_CHECK(!spec.workers.empty(), InvalidArgument,
               "TF_CONFIG cluster has no chief and no worker: a job needs at least one worker");
  spec.worldSize = int(spec.workers.size());
  spec.master = spec.workers.front();

  COHORT_CHECK(task.contains("type"), InvalidArgument, "TF_CONFIG task.type is missing");
  COHORT_CHECK(task.at("type").is_string(), InvalidArgument, "TF_CONFIG task.type ", task.at("type").dump(),
               " is not a string");
  const std::string type = task.at("type").get<std::string>();
  COHORT_CHECK(isTfJob(type), InvalidArgument, "TF_CONFIG task.type \"", type,
               "\" is not one of chief, worker, ps, evaluator");
  const int index = tfTaskIndex(task);
  const size_t jobSize = type == "chief"    ? chiefs.size()
                         : type == "worker" ? plainWorkers.size()
                         : type == "ps"     ? servers.size()
                                            : evaluators.size();
  // TensorFlow keeps the evaluator out of the cluster (its own check exempts it, and Kubeflow's
  // TFJob leaves it out): one not listed is taken as it is. The chief, not knowing of it, does not
  // keep checkpoints for it (list it in cluster.evaluator for that).
  const bool unlistedEvaluator = type == "evaluator" && evaluators.empty();
  COHORT_CHECK(jobSize > 0 || unlistedEvaluator, InvalidArgument, "TF_CONFIG task.type is \"", type, "\" but cluster.",
               type, " is absent or empty");
  COHORT_CHECK(unlistedEvaluator || size_t(index) < jobSize, InvalidArgument, "TF_CONFIG task.index=", index,
               " is out of range: cluster.", type, " has ", jobSize, jobSize == 1 ? " entry" : " entries");

  if (type == "chief" || type == "worker") {
    spec.role = Role::kWorker;
    spec.rank = type == "chief" ? 0 : index + int(chiefs.size());
    const std::string& host = spec.workers[size_t(spec.rank)].host;
    spec.localRank = 0;
    spec.localWorldSize = 0;
    for (int r = 0; r < spec.worldSize; ++r) {
      if (spec.workers[size_t(r)].host != host) continue;
      if (r < spec.rank) ++spec.localRank;
      ++spec.localWorldSize;
    }
  } else {
    spec.role = type == "ps" ? Role::kParameterServer : Role::kEvaluator;
    spec.rank = index;
    spec.localRank = 0;
    spec.localWorldSize = 1;
  }
  return spec;
}

// torchrun's variables next to TF_CONFIG must say the same thing (a launcher that sets both is
// usually a wrapper that got one of them wrong).
void checkTorchrunAgreesWithTfConfig(const NonEmptyEnv& env, const ClusterSpec& spec) {
  if (std::optional<int> world = wholeVar(env, "WORLD_SIZE")) {
    COHORT_CHECK(*world == spec.worldSize, InvalidArgument, "WORLD_SIZE=", *world,
                 " disagrees with TF_CONFIG, whose cluster has ", spec.worldSize,
                 " workers (chief included): unset WORLD_SIZE or make them agree");
  }
  if (spec.role != Role::kWorker) return;  // RANK numbers workers; a ps or evaluator has none
  if (std::optional<int> rank = wholeVar(env, "RANK")) {
    COHORT_CHECK(*rank == spec.rank, InvalidArgument, "RANK=", *rank,
                 " disagrees with TF_CONFIG, which makes this task worker rank ", spec.rank,
                 ": unset RANK or make them agree");
  }
}

// ---------------------------------------------------------------------------------------------
// torchrun / cohort launch

// Reads a launcher's world size and rank variables into spec; the rank must be below the size.
void readRankAndSize(const NonEmptyEnv& env, const std::string& rankVar, const std::string& sizeVar,
                     ClusterSpec& spec) {
  spec.worldSize = positiveVar(env, sizeVar, 1);
  spec.rank = nonNegativeVar(env, rankVar, 0);
  COHORT_CHECK(spec.rank < spec.worldSize, InvalidArgument, rankVar, "=", spec.rank, " is not below ", sizeVar,
               "=", spec.worldSize);
}

ClusterSpec fromTorchrun(const NonEmptyEnv& env) {
  requireBoth(env, "RANK", "WORLD_SIZE", "torchrun");
  ClusterSpec spec;
  spec.source = "torchrun";
  readRankAndSize(env, "RANK", "WORLD_SIZE", spec);
  // Kubeflow's PyTorchJob: one pod per node, its processes per node in PET_NPROC_PER_NODE, which
  // WORLD_SIZE counts (replicas x nprocPerNode) while RANK is the pod's. torchrun in the pod turns
  // that into per-process variables (LOCAL_RANK among them); without it a pod is one process.
  // Its default is "auto" (also "cpu", "gpu": torchrun's choice in the pod), with which the
  // operator counts one process a pod: no count to check.
  const std::optional<std::string> perNodeText = env.get("PET_NPROC_PER_NODE");
  const bool perNodeNamed = perNodeText && (*perNodeText == "auto" || *perNodeText == "cpu" || *perNodeText == "gpu");
  const std::optional<int> perNode = perNodeNamed ? std::nullopt : wholeVar(env, "PET_NPROC_PER_NODE");
  COHORT_CHECK(!perNode || *perNode <= 1 || env.has("LOCAL_RANK"), InvalidArgument, "PET_NPROC_PER_NODE=", *perNode,
               " (Kubeflow's nprocPerNode) makes WORLD_SIZE=", spec.worldSize,
               " count processes while RANK numbers pods, but this pod runs one process (no LOCAL_RANK): "
               "set nprocPerNode: \"1\" (cohort uses the pod's cores with threads), or start the command with "
               "torchrun in the pod");
  spec.localRank = nonNegativeVar(env, "LOCAL_RANK", 0);
  const bool localWorldSet = env.has("LOCAL_WORLD_SIZE");
  const int localDefault = perNodeNamed               ? 1
                           : perNode && *perNode >= 1 ? std::min(*perNode, spec.worldSize)
                                                      : spec.worldSize;
  spec.localWorldSize = positiveVar(env, "LOCAL_WORLD_SIZE", localDefault);
  COHORT_CHECK(spec.localWorldSize <= spec.worldSize, InvalidArgument, "LOCAL_WORLD_SIZE=", spec.localWorldSize,
               " is more than WORLD_SIZE=", spec.worldSize);
  COHORT_CHECK(spec.localRank < spec.localWorldSize, InvalidArgument, "LOCAL_RANK=", spec.localRank,
               " is not below LOCAL_WORLD_SIZE=", spec.localWorldSize,
               localWorldSet ? "" : " (unset, so WORLD_SIZE)");
  std::optional<std::string> addr = env.get("MASTER_ADDR");
  COHORT_CHECK(addr || spec.worldSize == 1, InvalidArgument, "MASTER_ADDR is not set: with WORLD_SIZE=",
               spec.worldSize, " every worker needs the host of rank 0 in MASTER_ADDR");
  spec.master = masterFrom(env, addr.value_or(kLoopback));
  return spec;
}

// RANK/WORLD_SIZE next to OpenMPI's variables must agree with them.
void checkTorchrunAgreesWithOpenMpi(const NonEmptyEnv& env, const ClusterSpec& spec) {
  struct Pair {
    const char* torchrun;
    int value;
    const char* openMpi;
  };
  for (const Pair& p : {Pair{"RANK", spec.rank, "OMPI_COMM_WORLD_RANK"},
                        Pair{"WORLD_SIZE", spec.worldSize, "OMPI_COMM_WORLD_SIZE"}}) {
    std::optional<int> theirs = wholeVar(env, p.openMpi);
    COHORT_CHECK(!theirs || *theirs == p.value, InvalidArgument, p.torchrun, "=", p.value, " disagrees with ",
                 p.openMpi, "=", theirs.value_or(0), ": unset one of them or make them agree");
  }
}

// ---------------------------------------------------------------------------------------------
// OpenMPI's mpirun

ClusterSpec fromOpenMpi(const NonEmptyEnv& env) {
  requireBoth(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun");
  requireBoth(env, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun");
  ClusterSpec spec;
  spec.source = "OpenMPI";
  readRankAndSize(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", spec);
  // Without the local pair the layout is unknown: count this process alone on its host.
  const bool localKnown = env.has("OMPI_COMM_WORLD_LOCAL_SIZE");
  spec.localRank = nonNegativeVar(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
  spec.localWorldSize = positiveVar(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  COHORT_CHECK(spec.localWorldSize <= spec.worldSize, InvalidArgument, "OMPI_COMM_WORLD_LOCAL_SIZE=",
               spec.localWorldSize, " is more than OMPI_COMM_WORLD_SIZE=", spec.worldSize);
  COHORT_CHECK(spec.localRank < spec.localWorldSize, InvalidArgument, "OMPI_COMM_WORLD_LOCAL_RANK=", spec.localRank,
               " is not below OMPI_COMM_WORLD_LOCAL_SIZE=", spec.localWorldSize);
  std::optional<std::string> addr = env.get("MASTER_ADDR");
  if (!addr) {
    // mpirun does not say where rank 0 runs; when every rank shares this host, it is here.
    COHORT_CHECK(spec.localWorldSize == spec.worldSize, InvalidArgument, "MASTER_ADDR is not set and the ",
                 spec.worldSize, " mpirun ranks are not all on one host (",
                 localKnown ? "OMPI_COMM_WORLD_LOCAL_SIZE=" + std::to_string(spec.localWorldSize)
                            : std::string("OMPI_COMM_WORLD_LOCAL_SIZE is unset"),
                 "): set it to the host of rank 0, e.g. mpirun -x MASTER_ADDR=host");
    addr = kLoopback;
  }
  spec.master = masterFrom(env, *addr);
  return spec;
}

// ---------------------------------------------------------------------------------------------
// Slurm's srun

// One comma-free-at-top-level item with bracket groups: "rack[1-2]-n[01,03]".
std::vector<std::string> expandHosts(const std::string& item, const std::string& what) {
  const size_t open = item.find('[');
  if (open == std::string::npos) {
    COHORT_CHECK(item.find(']') == std::string::npos, InvalidArgument, what, ": ']' without '['");
    return {item};
  }
  const size_t close = item.find(']', open);
  COHORT_CHECK(close != std::string::npos, InvalidArgument, what, ": '[' without ']'");
  const std::string prefix = item.substr(0, open);
  const std::string body = item.substr(open + 1, close - open - 1);
  COHORT_CHECK(prefix.find(']') == std::string::npos, InvalidArgument, what, ": ']' without '['");
  COHORT_CHECK(body.find('[') == std::string::npos, InvalidArgument, what, ": nested '['");
  COHORT_CHECK(!body.empty(), InvalidArgument, what, ": empty []");
  const std::vector<std::string> rest = expandHosts(item.substr(close + 1), what);

  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    const size_t comma = std::min(body.find(',', start), body.size());
    const std::string range = body.substr(start, comma - start);
    const size_t dash = range.find('-');
    const std::string low = range.substr(0, dash);
    const std::string high = dash == std::string::npos ? low : range.substr(dash + 1);
    auto number = [&](const std::string& digits) {
      long long value = 0;
      const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
      COHORT_CHECK(!digits.empty() && digits.front() != '-' && ec == std::errc() &&
                       ptr == digits.data() + digits.size(),
                   InvalidArgument, what, ": \"", range, "\" is not a number or a range of numbers");
      return value;
    };
    const long long lo = number(low);
    const long long hi = number(high);
    COHORT_CHECK(lo <= hi, InvalidArgument, what, ": the range \"", range, "\" runs backwards");
    COHORT_CHECK(hi - lo < kMaxRangeHosts, InvalidArgument, what, ": the range \"", range, "\" is too large");
    for (long long n = lo; n <= hi; ++n) {
      std::string digits = std::to_string(n);
      if (digits.size() < low.size()) digits.insert(0, low.size() - digits.size(), '0');  // keep "01"
      for (const std::string& suffix : rest) out.push_back(prefix + digits + suffix);
    }
    start = comma + 1;
  }
  return out;
}

std::vector<std::string> expandNodelist(const std::string& text, const std::string& what) {
  std::vector<std::string> hosts;
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i < text.size() && text[i] == '[') ++depth;
    if (i < text.size() && text[i] == ']') --depth;
    if (i < text.size() && (text[i] != ',' || depth > 0)) continue;
    const std::string item = text.substr(start, i - start);
    COHORT_CHECK(!item.empty(), InvalidArgument, what, ": empty host name");
    for (std::string& host : expandHosts(item, what)) hosts.push_back(std::move(host));
    start = i + 1;
  }
  return hosts;
}

std::optional<int> plainNumber(std::string_view text) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

// Tasks on node `node` from Slurm's "2(x3),1" form (3 nodes with 2 tasks, then 1 with 1).
std::optional<int> tasksOnNode(const std::string& perNode, int node) {
  size_t start = 0;
  while (start < perNode.size()) {
    const size_t comma = std::min(perNode.find(',', start), perNode.size());
    const std::string item = perNode.substr(start, comma - start);
    int tasks = 0;
    int repeat = 1;
    const char* end = item.data() + item.size();
    auto [ptr, ec] = std::from_chars(item.data(), end, tasks);
    if (ec != std::errc() || tasks < 1) return std::nullopt;
    if (ptr != end) {
      if (std::string_view(ptr, size_t(end - ptr)).substr(0, 2) != "(x" || end[-1] != ')') return std::nullopt;
      const auto [last, ec2] = std::from_chars(ptr + 2, end - 1, repeat);
      if (ec2 != std::errc() || last != end - 1 || repeat < 1) return std::nullopt;
    }
    if (node < repeat) return tasks;
    node -= repeat;
    start = comma + 1;
  }
  return std::nullopt;
}

ClusterSpec fromSlurm(const NonEmptyEnv& env) {
  requireBoth(env, "SLURM_PROCID", "SLURM_NTASKS", "srun");
  ClusterSpec spec;
  spec.source = "Slurm";
  readRankAndSize(env, "SLURM_PROCID", "SLURM_NTASKS", spec);
  spec.localRank = nonNegativeVar(env, "SLURM_LOCALID", 0);

  // Tasks on this node: --ntasks-per-node when given, else the step's per-node counts picked by
  // SLURM_NODEID, else 1. It only sizes thread pools, so an unreadable list is not an error.
  std::string localFrom =
      "no readable per-node count in SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE";
  spec.localWorldSize = 1;
  std::optional<std::string> perNode = env.get("SLURM_NTASKS_PER_NODE");
  if (std::optional<int> plain = perNode ? plainNumber(*perNode) : std::nullopt; plain && *plain >= 1) {
    spec.localWorldSize = *plain;
    localFrom = "SLURM_NTASKS_PER_NODE=" + *perNode;
  } else {
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      std::optional<std::string> list = env.get(name);
      if (!list) continue;
      const int node = nonNegativeVar(env, "SLURM_NODEID", 0);
      if (std::optional<int> tasks = tasksOnNode(*list, node)) {
        spec.localWorldSize = *tasks;
        localFrom = std::string(name) + "=" + *list + " on SLURM_NODEID=" + std::to_string(node);
        break;
      }
    }
  }
  COHORT_CHECK(spec.localRank < spec.localWorldSize, InvalidArgument, "SLURM_LOCALID=", spec.localRank,
               " is not below the ", spec.localWorldSize, " tasks on this node (", localFrom, ")");

  std::optional<std::string> addr = env.get("MASTER_ADDR");
  if (!addr) {
    // The step's nodes first: a step on part of the allocation (two steps side by side) has its
    // task 0 on its own first node, not the allocation's.
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      std::optional<std::string> list = env.get(name);
      if (!list) continue;
      // The first node of the step runs task 0 under srun's default block distribution.
      addr = expandNodelist(*list, std::string(name) + "=" + *list + " is not a Slurm host list").front();
      break;
    }
  }
  if (!addr) {
    COHORT_CHECK(spec.worldSize == 1, InvalidArgument,
                 "MASTER_ADDR is not set and neither is SLURM_JOB_NODELIST: with SLURM_NTASKS=", spec.worldSize,
                 " every task needs the host of task 0 in MASTER_ADDR");
    addr = kLoopback;
  }
  spec.master = masterFrom(env, *addr);
  return spec;
}

}  // namespace

namespace {

ClusterSpec resolveRoles(const NonEmptyEnv& env) {
  if (std::optional<std::string> tfConfig = env.get("TF_CONFIG")) {
    ClusterSpec spec = fromTfConfig(*tfConfig);
    checkTorchrunAgreesWithTfConfig(env, spec);
    return spec;
  }
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    ClusterSpec spec = fromTorchrun(env);
    checkTorchrunAgreesWithOpenMpi(env, spec);
    return spec;
  }
  if (env.has("OMPI_COMM_WORLD_RANK") || env.has("OMPI_COMM_WORLD_SIZE")) return fromOpenMpi(env);
  // Slurm is not cross-checked against OpenMPI: under mpirun inside an sbatch allocation,
  // SLURM_PROCID is 0 for every rank.
  if (env.has("SLURM_PROCID") || env.has("SLURM_NTASKS")) return fromSlurm(env);
  return ClusterSpec{};
}

}  // namespace

ClusterSpec resolveCluster(const EnvLookup& lookup) {
  const NonEmptyEnv env(lookup);
  ClusterSpec spec = resolveRoles(env);
  spec.secret = env.get("COHORT_AUTH_TOKEN").value_or("");
  // torchrun's default run id is the word "none", which every job without --rdzv-id shares.
  for (const char* name : {"COHORT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE"}) {
    const std::optional<std::string> id = env.get(name);
    if (id && *id != "none") {
      spec.jobIdentity = *id;
      spec.jobIdentitySource = name;
      // Steps of one allocation share its job id: two trainings side by side are told apart by
      // their step, so that one never joins the other's store.
      const std::optional<std::string> step = env.get("SLURM_STEP_ID");
      if (spec.source == "Slurm" && spec.jobIdentitySource == std::string("SLURM_JOB_ID") && step) {
        spec.jobIdentity += "." + *step;
        spec.jobIdentitySource = "SLURM_JOB_ID.SLURM_STEP_ID";
      }
      break;
    }
  }
  return spec;
}

ClusterSpec resolveClusterFromEnvironment() {
  return resolveCluster([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

std::string describe(const ClusterSpec& spec) {
  std::string who = roleName(spec.role) + std::string(" ") + std::to_string(spec.rank);
  if (spec.role == Role::kWorker) {
    who += " of " + std::to_string(spec.worldSize);
  } else if (spec.role == Role::kParameterServer && !spec.parameterServers.empty()) {
    who += " of " + std::to_string(spec.parameterServers.size());
  }
  return who + " (" + spec.source + "), master " + spec.master.str();
}

std::vector<std::string> expandSlurmNodelist(const std::string& nodelist) {
  return expandNodelist(nodelist, "\"" + nodelist + "\" is not a Slurm host list");
}

}  // namespace cohort
