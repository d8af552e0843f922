#include "experiment/netns.h"

#include <cohort/error.h>

#include "base/subprocess.h"

#include <unistd.h>

#include <regex>

namespace cohort::experiment {

namespace {

// Runs `ip ARGS...` (or `tc`) and returns whether it exited 0. Its output is dropped.
bool run(std::vector<std::string> argv) {
  try {
    return Subprocess::spawn({.argv = std::move(argv), .out = ChildStream::null(), .err = ChildStream::null()})
        .wait()
        .ok();
  } catch (const SubprocessError&) {
    return false;  // not installed, or no process to spare
  }
}

}  // namespace

EmulatedNetwork::EmulatedNetwork(const std::string& rate, int processes)
    : tag_("cohort-" + std::to_string(::getpid() % 100000)), rate_(rate), processes_(processes) {
  COHORT_CHECK(std::regex_match(rate, std::regex("[0-9]+(\\.[0-9]+)?(kbit|mbit|gbit)")), InvalidArgument,
               "--network ", rate, ": expected a rate like 100mbit, 1gbit or 500kbit");
  COHORT_CHECK(::geteuid() == 0, InvalidArgument,
               "--network needs root to create network namespaces (run as root, or drop --network)");
  COHORT_CHECK(run({"ip", "-V"}), InvalidArgument, "--network needs iproute2's ip and tc (apt-get install iproute2)");
  const std::string hub = tag_ + "-hub";
  const std::string burst = rate.find("gbit") != std::string::npos ? "1mb" : "128kb";
  auto must = [&](std::vector<std::string> argv) {
    if (run(argv)) return;
    destroy();
    std::string text;
    for (const auto& a : argv) text += (text.empty() ? "" : " ") + a;
    throw Error("--network: '" + text + "' failed (is this a container without CAP_NET_ADMIN?)");
  };
  must({"ip", "netns", "add", hub});
  must({"ip", "netns", "exec", hub, "ip", "link", "add", "br0", "type", "bridge"});
  must({"ip", "netns", "exec", hub, "ip", "link", "set", "br0", "up"});
  for (int i = 0; i < processes; ++i) {
    const std::string ns = namespaceOf(i);
    const std::string a = "ce" + std::to_string(::getpid() % 100000) + "a" + std::to_string(i);
    const std::string b = "ce" + std::to_string(::getpid() % 100000) + "b" + std::to_string(i);
    must({"ip", "netns", "add", ns});
    must({"ip", "link", "add", a, "type", "veth", "peer", "name", b});
    must({"ip", "link", "set", a, "netns", ns});
    must({"ip", "link", "set", b, "netns", hub});
    must({"ip", "netns", "exec", ns, "ip", "link", "set", a, "name", "eth0"});
    must({"ip", "netns", "exec", ns, "ip", "addr", "add", addressOf(i) + "/24", "dev", "eth0"});
    must({"ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"});
    must({"ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"});
    must({"ip", "netns", "exec", hub, "ip", "link", "set", b, "master", "br0"});
    must({"ip", "netns", "exec", hub, "ip", "link", "set", b, "up"});
    for (const auto& [space, dev] : {std::pair{ns, std::string("eth0")}, std::pair{hub, b}}) {
      must({"ip", "netns", "exec", space, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
            burst, "latency", "50ms"});
    }
  }
}

EmulatedNetwork::~EmulatedNetwork() { destroy(); }

void EmulatedNetwork::destroy() {
  for (int i = 0; i < processes_; ++i) run({"ip", "netns", "del", namespaceOf(i)});
  run({"ip", "netns", "del", tag_ + "-hub"});
}

std::string EmulatedNetwork::namespaceOf(int process) const { return tag_ + "-" + std::to_string(process); }

std::string EmulatedNetwork::addressOf(int process) const { return "10.77.0." + std::to_string(process + 1); }

std::vector<std::string> EmulatedNetwork::wrap(int process, const std::vector<std::string>& argv) const {
  std::vector<std::string> out{"ip", "netns", "exec", namespaceOf(process)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

}  // namespace cohort::experiment
