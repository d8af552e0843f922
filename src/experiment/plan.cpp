#include "experiment/plan.h"

#include "base/crypto.h"
#include "experiment/netns.h"
#include "experiment/remote.h"
#include "experiment/toml_file.h"

#include <toml++/toml.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

namespace cohort::experiment {

namespace {

// Set by compare and sweep themselves.
const std::set<std::string> kReserved{"metrics", "progress", "config", "help"};

std::string formatNumber(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, end);
}

// A TOML scalar as train's command line would take it; nullopt for arrays and tables.
std::optional<std::string> scalarText(const toml::node& node) {
  if (auto s = node.as_string()) return s->get();
  if (auto i = node.as_integer()) return std::to_string(i->get());
  if (auto f = node.as_floating_point()) return formatNumber(f->get());
  if (auto b = node.as_boolean()) return b->get() ? "true" : "false";
  return std::nullopt;
}

// Adds option `key` = node to args, checked against the catalog.
void addOption(TrainArgs& args, const std::string& key, const toml::node& node, const OptionCatalog& catalog,
               const std::string& where) {
  const std::string name = catalog.check(key, where);
  const auto text = scalarText(node);
  COHORT_CHECK(text.has_value(), InvalidArgument, where, ": option '", key, "' takes one value, not a list or table");
  if (!catalog.takesValue.at(name)) {
    COHORT_CHECK(*text == "true" || *text == "false", InvalidArgument, where, ": option '", key,
                 "' is a flag: true or false");
    if (*text == "true") setArg(args, "--" + name, "");
    return;
  }
  setArg(args, "--" + name, *text);
}

int positiveInt(const toml::node& node, const std::string& where, const std::string& key, int min) {
  auto i = node.as_integer();
  COHORT_CHECK(i != nullptr && i->get() >= min, InvalidArgument, where, ": '", key, "' must be a whole number >= ", min);
  return int(i->get());
}

constexpr int kMasterPort = 29500;
constexpr int kShardPort = 2222;

// A run on an emulated network is the same run when its commands are the same but for the
// namespaces' names (new with every invocation) and the link's rate is the same.
std::string networkIdentity(const JobSpec& job, const EmulatedNetwork& net) {
  std::string text = commandOf(job);
  for (int i = 0; i < net.size(); ++i) {
    const std::string name = net.namespaceOf(i);
    const std::string stable = "NAMESPACE-" + std::to_string(i);
    size_t at = text.find(name);
    while (at != std::string::npos) {
      const size_t after = at + name.size();
      // only the whole name: "cohort-123-1" is not the start of "cohort-123-10"
      if (after < text.size() && std::isdigit(static_cast<unsigned char>(text[after]))) {
        at = text.find(name, after);
        continue;
      }
      text.replace(at, name.size(), stable);
      at = text.find(name, at + stable.size());
    }
  }
  return text + "\nnetwork " + net.rate();
}

// The processes of a distributed configuration on an emulated network: process i in namespace i,
// with what `cohort launch` would have given it.
std::vector<ProcessSpec> networkProcesses(const Configuration& c, const EmulatedNetwork& net,
                                          const std::vector<std::string>& train) {
  const int total = c.workers + c.shards;
  COHORT_CHECK(total <= net.size(), InvalidArgument, c.name, " needs ", total, " processes; the network has ", net.size());
  const std::string token = crypto::randomToken();
  std::vector<ProcessSpec> out;
  if (c.shards == 0) {
    for (int r = 0; r < c.workers; ++r) {
      ProcessSpec p;
      p.argv = net.wrap(r, train);
      p.env = {{"RANK", std::to_string(r)},        {"WORLD_SIZE", std::to_string(c.workers)},
               {"LOCAL_RANK", "0"},                {"LOCAL_WORLD_SIZE", "1"},
               {"MASTER_ADDR", net.addressOf(0)},  {"MASTER_PORT", std::to_string(kMasterPort)},
               {"GLOO_SOCKET_IFNAME", "eth0"},     {"COHORT_AUTH_TOKEN", token}};
      out.push_back(std::move(p));
    }
    return out;
  }
  auto address = [&](int i, int port) { return "\"" + net.addressOf(i) + ":" + std::to_string(port) + "\""; };
  std::string workers, shards;
  for (int r = 1; r < c.workers; ++r) workers += (workers.empty() ? "" : ",") + address(r, kMasterPort);
  for (int k = 0; k < c.shards; ++k) shards += (shards.empty() ? "" : ",") + address(c.workers + k, kShardPort);
  const std::string cluster = "{\"chief\":[" + address(0, kMasterPort) + "],\"worker\":[" + workers + "],\"ps\":[" +
                              shards + "]}";
  for (int i = 0; i < total; ++i) {
    std::string type = i == 0 ? "chief" : i < c.workers ? "worker" : "ps";
    const int index = i == 0 ? 0 : i < c.workers ? i - 1 : i - c.workers;
    ProcessSpec p;
    p.argv = net.wrap(i, train);
    p.env = {{"TF_CONFIG", "{\"cluster\":" + cluster + ",\"task\":{\"type\":\"" + type + "\",\"index\":" +
                               std::to_string(index) + "}}"},
             {"GLOO_SOCKET_IFNAME", "eth0"},
             {"COHORT_AUTH_TOKEN", token}};
    p.waitedFor = type != "ps";
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

std::string OptionCatalog::check(const std::string& name, const std::string& where) const {
  std::string flag = name;
  std::replace(flag.begin(), flag.end(), '_', '-');
  if (flag.rfind("--", 0) == 0) flag = flag.substr(2);
  COHORT_CHECK(!kReserved.count(flag), InvalidArgument, where, ": option '", name,
               "' is set by cohort itself");
  COHORT_CHECK(takesValue.count(flag), InvalidArgument, where, ": unknown option '", name,
               "' (see cohort train --help)");
  return flag;
}

void setArg(TrainArgs& args, const std::string& flag, const std::string& value) {
  for (auto& [f, v] : args) {
    if (f == flag) {
      v = value;
      return;
    }
  }
  args.emplace_back(flag, value);
}

const std::string* findArg(const TrainArgs& args, const std::string& flag) {
  for (const auto& [f, v] : args) {
    if (f == flag) return &v;
  }
  return nullptr;
}

TrainArgs withoutFlagsOfOtherSchemes(const TrainArgs& args, Scheme scheme, const std::string& psMode) {
  TrainArgs out;
  for (const auto& arg : args) {
    if (!whereFlagActs(arg.first, scheme, psMode.empty() ? "async" : psMode)) out.push_back(arg);
  }
  return out;
}

bool Configuration::asynchronous() const {
  if (scheme == Scheme::kGossip) return true;
  if (scheme != Scheme::kPs) return false;
  const std::string* mode = findArg(options, "--ps-mode");
  return mode == nullptr || *mode != "sync";  // async is train's default
}

int Configuration::replicas() const {
  if (scheme == Scheme::kLocal) return 1;
  if (scheme == Scheme::kPipeline) {
    const std::string* r = findArg(options, "--replicas");
    return r != nullptr ? std::max(1, std::atoi(r->c_str())) : 1;
  }
  if (scheme == Scheme::kTensor) {
    // Each layer is split over --ways processes (2 unless given); the copies share the data.
    const std::string* w = findArg(options, "--ways");
    return std::max(1, workers / (w != nullptr ? std::max(1, std::atoi(w->c_str())) : 2));
  }
  // Every other scheme: one copy per process (mirrored, central, hogwild split each process's
  // batch over their threads).
  return workers;
}

std::vector<Configuration> defaultConfigurations(int workers, const std::string& codec) {
  const int w = workers;
  std::vector<Configuration> out{
      {"local", Scheme::kLocal, 1, 0, {}},
      {"allreduce", Scheme::kAllreduce, w, 0, {}},
      {"average-k4", Scheme::kAverage, w, 0, {{"--period", "4"}}},
      {"average-k16", Scheme::kAverage, w, 0, {{"--period", "16"}}},
      {"ps-sync", Scheme::kPs, w, 1, {{"--ps-mode", "sync"}}},
      {"ps-sync-backup", Scheme::kPs, w, 1, {{"--ps-mode", "sync"}, {"--backup-workers", "1"}}},
      {"ps-async", Scheme::kPs, w, 1, {{"--ps-mode", "async"}}},
      {"ps-softsync", Scheme::kPs, w, 1, {{"--ps-mode", "softsync"}, {"--softsync", std::to_string(std::max(1, w / 2))}}},
      {"ps-ssp", Scheme::kPs, w, 1, {{"--ps-mode", "ssp"}, {"--staleness-bound", "2"}}},
      {"gossip", Scheme::kGossip, w, 0, {}},
      {"pipeline", Scheme::kPipeline, w, 0, {{"--stages", std::to_string(w)}}},
  };
  if (codec.empty() || codec == "none") return out;
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) {
    Configuration c = out[i];
    if (c.scheme == Scheme::kLocal || c.scheme == Scheme::kPipeline) continue;
    c.name += "+" + codec.substr(0, codec.find(':')) ;
    c.options.emplace_back("--codec", codec);
    out.push_back(c);
  }
  return out;
}

CompareFile readCompareFile(const std::string& path, const OptionCatalog& catalog) {
  const toml::table root =
      readTomlFile("the compare file", path, "a compare file lists [[configuration]] tables, each naming a scheme");
  CompareFile file;
  for (const auto& [key, node] : root) {
    const std::string k(key.str());
    if (k == "configuration") continue;
    addOption(file.shared, k, node, catalog, path);
  }
  const toml::array* list = root["configuration"].as_array();
  COHORT_CHECK(list != nullptr && !list->empty(), InvalidArgument, path,
               ": no [[configuration]] tables (each names a scheme: strategy = \"allreduce\", workers = 2)");
  std::set<std::string> names;
  std::map<std::string, std::string> nameOfId;  // run 1's job id -> the configuration's name
  for (size_t i = 0; i < list->size(); ++i) {
    const toml::table* t = (*list)[i].as_table();
    const std::string where = path + ": configuration " + std::to_string(i + 1);
    COHORT_CHECK(t != nullptr, InvalidArgument, where, ": write it as a [[configuration]] table");
    Configuration c;
    c.workers = 0;
    for (const auto& [key, node] : *t) {
      const std::string k(key.str());
      if (k == "name") {
        auto s = node.as_string();
        COHORT_CHECK(s != nullptr && !s->get().empty(), InvalidArgument, where, ": 'name' must be a string");
        c.name = s->get();
      } else if (k == "strategy") {
        auto s = node.as_string();
        const std::optional<Scheme> scheme = s != nullptr ? parseScheme(s->get()) : std::nullopt;
        COHORT_CHECK(scheme.has_value(), InvalidArgument, where, ": unknown scheme '",
                     s != nullptr ? s->get() : std::string("?"), "' (", schemeNames(), ")");
        c.scheme = *scheme;
      } else if (k == "workers") {
        c.workers = positiveInt(node, where, k, 1);
      } else if (k == "ps") {
        c.shards = positiveInt(node, where, k, 0);
      } else {
        addOption(c.options, k, node, catalog, where);
      }
    }
    const bool oneProcess = c.scheme == Scheme::kLocal || c.scheme == Scheme::kCentral || c.scheme == Scheme::kHogwild;
    if (c.workers == 0) c.workers = oneProcess || c.scheme == Scheme::kMirrored ? 1 : 2;
    if (c.scheme == Scheme::kPs && c.shards == 0) c.shards = 1;
    COHORT_CHECK(c.scheme == Scheme::kPs || c.shards == 0, InvalidArgument, where,
                 ": 'ps' shards only go with strategy = \"ps\"");
    COHORT_CHECK(!oneProcess || c.workers == 1, InvalidArgument, where, ": strategy ", schemeName(c.scheme),
                 " runs 1 process");
    if (c.name.empty()) c.name = std::string(schemeName(c.scheme)) + "-" + std::to_string(i + 1);
    COHORT_CHECK(names.insert(c.name).second, InvalidArgument, where, ": the name '", c.name, "' is used twice");
    // A job id keeps letters, digits, '-', '_' and '.' of the name: two names may make one id.
    const auto [clash, added] = nameOfId.emplace(jobId(c, 1), c.name);
    COHORT_CHECK(added, InvalidArgument, where, ": the names '", clash->second, "' and '", c.name,
                 "' both make the run id '", clash->first,
                 "' (other characters become '_'): rename one");
    file.configurations.push_back(std::move(c));
  }
  return file;
}

int64_t stepsPerEpoch(int64_t examples, int replicas, int64_t batch) {
  const int64_t perReplica = examples / std::max(1, replicas);
  return (perReplica + batch - 1) / std::max<int64_t>(1, batch);
}

namespace {

// The examples of a bag file as train's reader counts them: every line but blank ones and
// comments (its other errors are train's to name).
int64_t bagFileExamples(const std::string& path, const std::string& data) {
  std::error_code error;
  COHORT_CHECK(!std::filesystem::is_directory(path, error), InvalidArgument, "--data ", data, ": ", path,
               " is a directory, not a data file");
  std::ifstream in(path);
  COHORT_CHECK(in.good(), InvalidArgument, "--data ", data, ": cannot open ", path);
  int64_t n = 0;
  std::string line;
  while (std::getline(in, line)) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first != std::string::npos && line[first] != '#') ++n;
  }
  return n;
}

}  // namespace

int64_t trainingExamples(const std::string& data) {
  if (data == "fashion-mnist") return 60000;
  if (data == "synthetic") return 60000;
  if (data == "synthetic-bags") return 60000;  // data/bags.h: SyntheticBagsOptions::examples
  if (data.rfind("synthetic-bags:", 0) == 0) {
    const std::string count = data.substr(15, data.find(',') == std::string::npos ? std::string::npos
                                                                                   : data.find(',') - 15);
    const char* begin = count.data();
    const char* end = begin + count.size();
    int64_t n = 0;
    auto [ptr, ec] = std::from_chars(begin, end, n);
    COHORT_CHECK(ec == std::errc() && ptr == end && n >= 6, InvalidArgument, "--data ", data,
                 ": expected synthetic-bags:N[,ROWS] with N a whole number >= 6");
    return n;
  }
  if (data.rfind("libsvm:", 0) == 0) {
    // libsvm:TRAIN[,TEST]; without TEST, train holds the last sixth of TRAIN out as the test set.
    const std::string files = data.substr(7);
    const size_t comma = files.find(',');
    COHORT_CHECK(!files.empty() && comma != 0, InvalidArgument, "--data ", data, ": expected libsvm:TRAIN[,TEST]");
    const int64_t n = bagFileExamples(files.substr(0, comma), data);
    if (comma != std::string::npos) return n;
    COHORT_CHECK(n >= 2, InvalidArgument, "--data ", data, ": ", files,
                 " needs at least 2 examples to hold out a test set (or give libsvm:TRAIN,TEST)");
    return n - std::max<int64_t>(1, n / 6);
  }
  if (data.rfind("synthetic:", 0) == 0) {
    int64_t n = 0;
    const char* begin = data.c_str() + 10;
    const char* end = data.c_str() + data.size();
    auto [ptr, ec] = std::from_chars(begin, end, n);
    COHORT_CHECK(ec == std::errc() && ptr == end && n >= 6, InvalidArgument, "--data ", data,
                 ": expected synthetic:N with N a whole number >= 6");
    return n;
  }
  if (data.rfind("mnist:", 0) == 0) {
    const std::string dir = data.substr(6);
    for (const char* name : {"/train-labels-idx1-ubyte", "/train-labels-idx1-ubyte.gz"}) {
      const std::string path = dir + name;
      if (!std::filesystem::exists(path)) continue;
      gzFile f = ::gzopen(path.c_str(), "rb");  // reads plain files as they are
      COHORT_CHECK(f != nullptr, IoError, path, ": cannot open");
      unsigned char header[8] = {};
      const int n = ::gzread(f, header, sizeof(header));
      ::gzclose(f);
      COHORT_CHECK(n == 8 && header[2] == 0x08 && header[3] == 1, IoError, path, ": not an IDX label file");
      return (int64_t(header[4]) << 24) | (int64_t(header[5]) << 16) | (int64_t(header[6]) << 8) | int64_t(header[7]);
    }
    throw InvalidArgument("--data " + data + ": no train-labels-idx1-ubyte[.gz] in " + dir);
  }
  throw InvalidArgument("unknown data set '" + data +
                        "': expected fashion-mnist, mnist:DIR, synthetic[:N], libsvm:TRAIN[,TEST] or "
                        "synthetic-bags[:N[,ROWS]]");
}

std::string jobId(const Configuration& c, int run) {
  std::string id = c.name;
  for (char& ch : id) {
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.')) ch = '_';
  }
  return id + ".r" + std::to_string(run);
}

int64_t epochExamples(const Configuration& c, const PlanOptions& options) {
  const std::string* own = findArg(c.options, "--validation");
  const std::string* text = own != nullptr ? own : findArg(options.shared, "--validation");
  if (text == nullptr) return options.trainExamples;
  int64_t held = 0;
  const char* end = text->data() + text->size();
  const auto [ptr, ec] = std::from_chars(text->data(), end, held);
  COHORT_CHECK(ec == std::errc() && ptr == end && held >= 0 && held < options.trainExamples, InvalidArgument, c.name,
               ": validation = ", *text, " must be a whole number from 0 to below the ", options.trainExamples,
               " training examples");
  return options.trainExamples - held;
}

std::vector<std::string> trainCommand(const Configuration& c, const PlanOptions& options, const std::string& metricsPath) {
  // A shared option of another scheme's (a file's top-level period = 8 beside an allreduce run) is
  // left out; the configuration's own options go as given, for train to refuse what is wrong.
  const std::string* ownMode = findArg(c.options, "--ps-mode");
  const std::string* sharedMode = findArg(options.shared, "--ps-mode");
  const std::string psMode = ownMode != nullptr ? *ownMode : sharedMode != nullptr ? *sharedMode : "";
  TrainArgs args = withoutFlagsOfOtherSchemes(options.shared, c.scheme, psMode);
  for (const auto& [flag, value] : c.options) setArg(args, flag, value);
  setArg(args, "--strategy", schemeName(c.scheme));
  const std::string* batchText = findArg(args, "--batch");
  const int64_t batch = batchText != nullptr ? std::max<int64_t>(1, std::atoll(batchText->c_str())) : 64;
  const int64_t perEpoch = stepsPerEpoch(epochExamples(c, options), c.replicas(), batch);
  int64_t total = 0;
  constexpr int64_t kEpochsUnderTimeBudget = 1000000;  // the clock stops the run first
  if (options.budget.seconds > 0) {
    setArg(args, "--epochs", std::to_string(kEpochsUnderTimeBudget));
    setArg(args, "--max-seconds", formatNumber(options.budget.seconds));
    total = perEpoch;  // evaluations per epoch
  } else if (options.budget.epochs > 0) {
    setArg(args, "--epochs", std::to_string(options.budget.epochs));
    total = options.budget.epochs * perEpoch;
  } else {
    total = options.budget.steps > 0
                ? options.budget.steps
                : (options.budget.examples + batch * c.replicas() - 1) / (batch * c.replicas());
    setArg(args, "--steps", std::to_string(total));
  }
  if (findArg(args, "--eval-every") == nullptr) {
    setArg(args, "--eval-every", std::to_string(std::max<int64_t>(1, total / std::max(1, options.evaluations))));
  }
  setArg(args, "--metrics", metricsPath);
  setArg(args, "--progress", "off");
  std::vector<std::string> argv{options.binary, "train"};
  for (const auto& [flag, value] : args) {
    argv.push_back(flag);
    if (!value.empty()) argv.push_back(value);
  }
  return argv;
}

std::vector<std::string> launchArgv(const std::string& binary, int workers, int shards, std::vector<std::string> train) {
  if (workers == 1 && shards == 0) return train;
  std::vector<std::string> argv{binary, "launch", "-n", std::to_string(workers)};
  if (shards > 0) {
    argv.push_back("--ps");
    argv.push_back(std::to_string(shards));
  }
  argv.push_back("--");
  argv.insert(argv.end(), train.begin(), train.end());
  return argv;
}

std::vector<JobSpec> planJobs(const std::vector<Configuration>& configurations, const PlanOptions& options) {
  std::vector<JobSpec> jobs;
  for (int run = 1; run <= options.runs; ++run) {
    for (const Configuration& c : configurations) {
      JobSpec job;
      job.id = jobId(c, run);
      std::vector<std::string> train = trainCommand(c, options, metricsPathOf(options.dir, job.id));
      job.threadsShare = c.workers;
      if (options.hosts != nullptr) {
        job.processes = remoteProcesses(*options.hosts, c.workers, c.shards, train);
        jobs.push_back(std::move(job));
        continue;
      }
      if (options.network != nullptr && (c.workers > 1 || c.shards > 0)) {
        job.processes = networkProcesses(c, *options.network, train);
        job.identity = networkIdentity(job, *options.network);
        jobs.push_back(std::move(job));
        continue;
      }
      job.processes.push_back(ProcessSpec{.argv = launchArgv(options.binary, c.workers, c.shards, std::move(train))});
      jobs.push_back(std::move(job));
    }
  }
  return jobs;
}

}  // namespace cohort::experiment
