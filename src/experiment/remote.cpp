#include "experiment/remote.h"

#include "base/crypto.h"
#include "base/subprocess.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace cohort::experiment {

namespace fs = std::filesystem;

namespace {

// Run by `sh -c SCRIPT cohort-remote WORKDIR HOST SHARE COMMAND...` on the host (see remote.h,
// "Ending"). The token is read with the shell's `read`, which takes one line and no more, so the
// watcher sees the rest: nothing until EOF. An asynchronous list's standard input is /dev/null
// in a shell without job control, hence fd 3 for the watcher. Both scripts are one line: the
// remote login shell parses the quoted command first, and csh's refuses a newline in quotes.
constexpr const char* kRemoteScript =
    "dir=$1 host=$2 share=$3; shift 3; "
    "cd \"$dir\" || { echo \"cohort: error: $host: cannot enter $dir (--hosts needs the same folders on every host)\" "
    ">&2; exit 1; }; "
    "IFS= read -r COHORT_AUTH_TOKEN || { echo \"cohort: error: $host: no token on standard input\" >&2; exit 1; }; "
    "export COHORT_AUTH_TOKEN; "
    "n=$(getconf _NPROCESSORS_ONLN 2>/dev/null) || n=1; t=$((n / share)); [ \"$t\" -ge 1 ] || t=1; "
    "exec 3<&0; "
    "OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t \"$@\" </dev/null 3<&- & child=$!; "
    "{ read -r _ <&3; kill -TERM $child 2>/dev/null; } & watcher=$!; "
    "exec 3<&-; "
    "wait $child; status=$?; "
    "kill $watcher 2>/dev/null; wait $watcher 2>/dev/null; "
    "exit $status";

// Run by `sh -c SCRIPT cohort-check WORKDIR OUT MARKER BINARY DEVICE MODEL` with "cohort\n" on standard
// input; an empty DEVICE: no training step.
constexpr const char* kCheckScript =
    "cd \"$1\" 2>/dev/null || { echo \"cohort-check: has no folder $1 (--hosts runs in the same folder on every "
    "host)\"; exit 0; }; "
    "[ -e \"$3\" ] || { echo \"cohort-check: does not see $2 as this machine does (OUT must be on a filesystem the "
    "hosts share)\"; exit 0; }; "
    "[ -x \"$4\" ] || { echo \"cohort-check: has no executable $4 (--remote-binary)\"; exit 0; }; "
    "IFS= read -r line; [ \"$line\" = cohort ] || { echo \"cohort-check: does not get standard input through the "
    "remote shell (it must pass it on: no ssh -n)\"; exit 0; }; "
    "[ -z \"$5\" ] || out=$(\"$4\" train --model \"$6\" --data synthetic:60 --steps 1 --batch 4 --threads 1 "
    "--progress off --device \"$5\" </dev/null 2>&1) || { echo \"cohort-check: cannot train --model $6 on --device $5: "
    "$(printf '%s\\n' \"$out\" | tail -n 1)\"; exit 0; }; "
    "echo \"cohort-check: ok\"";

bool validHost(const std::string& host) {
  const std::string address = addressOf(host);
  if (address.empty() || host.back() == '@' || host.front() == '@' || host.front() == '-') return false;
  return std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr(".-_:@", c) != nullptr;
  });
}

std::string bracketed(const std::string& address) {
  return address.find(':') != std::string::npos ? "[" + address + "]" : address;
}

std::string replaceAll(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

std::string lastLine(const std::string& text) {
  std::string last;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(at, end - at);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) last = line;
    at = end + 1;
  }
  return last;
}

// How much of a probe's output is read: the check script says one line.
constexpr size_t kProbeOutputLimit = 1 << 20;

struct Probe {
  std::string host;
  std::vector<std::string> argv;
  Subprocess process;  // its stdout and stderr on one pipe, in a process group of its own
  std::string output;
  bool timedOut = false;
};

// Starts argv with "cohort\n" on its standard input and its output on a pipe.
void startProbe(Probe& p) {
  try {
    p.process = Subprocess::spawn({.argv = p.argv,
                                   .in = ChildStream::pipe("cohort\n"),
                                   .out = ChildStream::pipe(),
                                   .err = ChildStream::sameAsStdout(),
                                   .processGroup = kNewGroup,
                                   .execFailurePrefix = ""});
  } catch (const SubprocessError& e) {
    throw Error(std::string("cannot check the hosts: ") + e.what());
  }
  p.process.closeFd(STDIN_FILENO);
}

// Reads every probe's output until all have closed it or the deadline passes (they run at once:
// one reached after the deadline still gives what it wrote); kills the groups of the late ones.
void finishProbes(std::vector<Probe>& probes, double timeoutSeconds) {
  const auto deadline =
      IoClock::now() + std::chrono::duration_cast<IoClock::duration>(std::chrono::duration<double>(timeoutSeconds));
  for (Probe& p : probes) {
    if (p.process.pid() <= 0) continue;  // never started
    const IoStatus status = p.process.readOutput(p.output, deadline, kProbeOutputLimit);
    if (status == IoStatus::kTimeout) p.timedOut = true;
    if (status != IoStatus::kClosed) p.process.signalGroup(SIGKILL);
    p.process.closeFd(STDOUT_FILENO);
    // The output is closed: the remote shell has exited or is about to (or was SIGKILLed).
    p.process.wait();
  }
}

}  // namespace

std::vector<std::string> parseHostList(const std::string& text, char separator, const std::string& where) {
  std::vector<std::string> hosts;
  std::string item;
  auto flush = [&]() {
    const size_t begin = item.find_first_not_of(" \t\r");
    const size_t end = item.find_last_not_of(" \t\r");
    const std::string host = begin == std::string::npos ? "" : item.substr(begin, end - begin + 1);
    item.clear();
    if (host.empty()) return;
    COHORT_CHECK(validHost(host), InvalidArgument, where, ": '", host,
                 "' is not a host (a name or address, optionally user@ before it)");
    hosts.push_back(host);
  };
  bool comment = false;
  for (char c : text) {
    if (c == separator || c == '\n') {
      flush();
      comment = false;
    } else if (c == '#' && separator == '\n') {
      comment = true;
    } else if (!comment) {
      item += c;
    }
  }
  flush();
  COHORT_CHECK(!hosts.empty(), InvalidArgument, where, ": no hosts");
  return hosts;
}

std::string addressOf(const std::string& host) {
  const size_t at = host.rfind('@');
  return at == std::string::npos ? host : host.substr(at + 1);
}

std::vector<std::string> splitShellWords(const std::string& text) {
  std::vector<std::string> words;
  std::string word;
  bool inWord = false;
  char quote = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quote == '\'') {
      if (c == '\'') {
        quote = 0;
      } else {
        word += c;
      }
    } else if (quote == '"') {
      if (c == '"') {
        quote = 0;
      } else if (c == '\\' && i + 1 < text.size() && std::strchr("\"\\$`", text[i + 1]) != nullptr) {
        word += text[++i];
      } else {
        word += c;
      }
    } else if (c == '\'' || c == '"') {
      quote = c;
      inWord = true;
    } else if (c == '\\' && i + 1 < text.size()) {
      word += text[++i];
      inWord = true;
    } else if (c == ' ' || c == '\t' || c == '\n') {
      if (inWord) words.push_back(word);
      word.clear();
      inWord = false;
    } else {
      word += c;
      inWord = true;
    }
  }
  COHORT_CHECK(quote == 0, InvalidArgument, "--remote-shell '", text, "': a quote is not closed");
  if (inWord) words.push_back(word);
  COHORT_CHECK(!words.empty(), InvalidArgument, "--remote-shell is empty");
  const bool hasHost =
      std::any_of(words.begin(), words.end(), [](const std::string& w) { return w.find("{host}") != std::string::npos; });
  COHORT_CHECK(hasHost, InvalidArgument, "--remote-shell '", text,
               "' does not say where the host goes: write {host} (ssh -p 2222 {host})");
  return words;
}

std::vector<std::string> remoteShellArgv(const std::string& shellTemplate, const std::string& host,
                                         const std::string& remoteCommand) {
  std::vector<std::string> argv;
  for (const std::string& word : splitShellWords(shellTemplate)) argv.push_back(replaceAll(word, "{host}", host));
  argv.push_back(remoteCommand);
  return argv;
}

std::vector<ProcessSpec> remoteProcesses(const RemoteHosts& hosts, int workers, int shards,
                                         const std::vector<std::string>& train) {
  COHORT_CHECK(!hosts.hosts.empty(), InvalidArgument, "--hosts: no hosts");
  const int n = int(hosts.hosts.size());
  const int total = workers + shards;
  auto hostOf = [&](int i) { return hosts.hosts[size_t(i % n)]; };
  auto portOf = [&](int i) { return hosts.basePort + i; };
  // How many of this job's processes share process i's host, and which of them it is.
  auto sharing = [&](int i, int limit) {
    int count = 0, before = 0;
    for (int j = 0; j < limit; ++j) {
      if (hostOf(j) != hostOf(i)) continue;
      ++count;
      if (j < i) ++before;
    }
    return std::pair{count, before};
  };
  const std::string token = crypto::randomToken();
  std::string tfCluster;
  if (shards > 0) {
    auto address = [&](int i) { return "\"" + bracketed(addressOf(hostOf(i))) + ":" + std::to_string(portOf(i)) + "\""; };
    std::string others, servers;
    for (int r = 1; r < workers; ++r) others += (others.empty() ? "" : ",") + address(r);
    for (int k = 0; k < shards; ++k) servers += (servers.empty() ? "" : ",") + address(workers + k);
    tfCluster = "{\"chief\":[" + address(0) + "],\"worker\":[" + others + "],\"ps\":[" + servers + "]}";
  }
  std::vector<ProcessSpec> out;
  for (int i = 0; i < total; ++i) {
    std::map<std::string, std::string> env = hosts.env;
    if (shards > 0) {
      const std::string type = i == 0 ? "chief" : i < workers ? "worker" : "ps";
      const int index = i == 0 ? 0 : i < workers ? i - 1 : i - workers;
      env["TF_CONFIG"] = "{\"cluster\":" + tfCluster + ",\"task\":{\"type\":\"" + type + "\",\"index\":" +
                         std::to_string(index) + "}}";
    } else if (total > 1) {
      const auto [local, localRank] = sharing(i, workers);
      env["RANK"] = std::to_string(i);
      env["WORLD_SIZE"] = std::to_string(workers);
      env["LOCAL_RANK"] = std::to_string(localRank);
      env["LOCAL_WORLD_SIZE"] = std::to_string(local);
      env["MASTER_ADDR"] = addressOf(hostOf(0));
      env["MASTER_PORT"] = std::to_string(portOf(0));
    }
    std::vector<std::string> command{"exec", "sh", "-c", kRemoteScript, "cohort-remote", hosts.workdir, hostOf(i),
                                     std::to_string(sharing(i, total).first), "env"};
    for (const auto& [key, value] : env) command.push_back(key + "=" + value);
    command.push_back(hosts.binary);
    command.insert(command.end(), train.begin() + 1, train.end());
    ProcessSpec p;
    p.argv = remoteShellArgv(hosts.shell, hostOf(i), shellQuote(command));
    p.input = token + "\n";
    p.waitedFor = i < workers;
    out.push_back(std::move(p));
  }
  return out;
}

void checkHosts(const RemoteHosts& hosts, const std::string& outDir, const HostTraining& training,
                double timeoutSeconds) {
  // A file only this check knows, made here and looked for there: OUT is shared, not merely
  // present under the same name.
  const std::string marker = (fs::path(outDir) / (".cohort-hosts-" + crypto::randomToken().substr(0, 16))).string();
  {
    std::ofstream touch(marker);
    COHORT_CHECK(touch.good(), IoError, marker, ": cannot write");
  }
  std::vector<Probe> probes;
  std::set<std::string> seen;
  for (const std::string& host : hosts.hosts) {
    if (!seen.insert(host).second) continue;
    Probe p;
    p.host = host;
    p.argv = remoteShellArgv(hosts.shell, host,
                             shellQuote({"exec", "sh", "-c", kCheckScript, "cohort-check", hosts.workdir, outDir,
                                         marker, hosts.binary, training.device, training.model}));
    probes.push_back(std::move(p));
  }
  try {
    for (Probe& p : probes) startProbe(p);
  } catch (...) {
    finishProbes(probes, 0);
    fs::remove(marker);
    throw;
  }
  finishProbes(probes, timeoutSeconds);
  std::error_code ec;
  fs::remove(marker, ec);
  const std::string& shellText = hosts.shell;
  for (const Probe& p : probes) {
    std::string seenLine;  // what the check script said, from the line it begins
    for (size_t at = 0; at < p.output.size();) {
      size_t end = p.output.find('\n', at);
      if (end == std::string::npos) end = p.output.size();
      if (p.output.compare(at, 14, "cohort-check: ") == 0) seenLine = lastLine(p.output.substr(at + 14, end - at - 14));
      at = end + 1;
    }
    if (seenLine == "ok") continue;
    COHORT_CHECK(!p.timedOut, InvalidArgument, "--hosts: host ", p.host, " did not answer within ", int(timeoutSeconds),
                 " s through the remote shell (", shellText, ")");
    if (!seenLine.empty()) throw InvalidArgument("--hosts: host " + p.host + " " + seenLine);
    std::string why = lastLine(p.output);
    if (why.empty()) {
      const ExitStatus status = p.process.status().value_or(ExitStatus{});
      why = status.exited() ? "exit status " + std::to_string(status.code())
                            : "killed by signal " + std::to_string(status.signal());
    }
    throw InvalidArgument("--hosts: host " + p.host + " does not answer through the remote shell (" + shellText +
                          "): " + why);
  }
}

}  // namespace cohort::experiment
