// `cohort compare --hosts`: a configuration's processes on other machines, each started through a
// remote shell (ssh by default) with the environment `cohort launch` would give it. Torch-free.
//
// The contract:
//
// Placement. Process i of a configuration (ranks 0..W-1, then the parameter-server shards) runs on
// hosts[i mod n] and is given port basePort + i: MASTER_PORT = basePort for rank 0's rendezvous,
// basePort + W + k for shard k (TF_CONFIG), so that several processes fit on one host. A host may
// be listed twice (it then gets twice the share); "user@host" logs in as user and is addressed as
// host. A configuration of one process (local) runs on hosts[0].
//
// Files. The processes run in `workdir` (compare's own working folder) on every host, and write
// their metrics there under OUT: the hosts and this machine must share that filesystem (NFS, a
// cluster's home). checkHosts verifies it before anything runs.
//
// The command. On host H, process i runs
//   TEMPLATE(H) 'exec sh -c SCRIPT cohort-remote WORKDIR H SHARE env K=V... BINARY train ...'
// where TEMPLATE is the remote shell with {host} replaced and every word shell-quoted, so the
// remote login shell sees exactly these words. The variables (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or TF_CONFIG; GLOO_SOCKET_IFNAME, OMP_NUM_THREADS and
// OPENBLAS_NUM_THREADS when compare's own environment sets them) are on that command line; the
// job's COHORT_AUTH_TOKEN is not (command lines are world-readable): it is the first line of the
// remote shell's standard input. Without OMP_NUM_THREADS from compare, SCRIPT sets both thread
// counts to max(1, the host's cores / SHARE), SHARE being the job's processes on that host.
//
// Ending. The runner keeps the remote shell's standard input open while the job runs (a
// ProcessSpec with `input`). SCRIPT starts the command in the background and waits; when its
// standard input ends (the runner ended the job: a timeout, a failed rank, shards stopped after
// the workers, Ctrl-C; or the runner or the remote shell died, and the connection with it), it
// sends the command SIGTERM, waits for it and exits with its status. So the remote shell returns
// only once the remote process is gone. A remote process that ignores SIGTERM is left running
// (`cohort train` does not ignore it); the remote shell itself is SIGKILLed after the grace.
#pragma once

#include "experiment/runner.h"

#include <map>
#include <string>
#include <vector>

namespace cohort::experiment {

struct RemoteHosts {
  std::vector<std::string> hosts;  // as given: "node1", "user@node2", "10.0.0.5"
  // Split into words like a shell would (quotes and backslashes); {host} is replaced in each word.
  std::string shell = "ssh -o BatchMode=yes {host}";
  std::string binary;   // cohort's path on the hosts
  std::string workdir;  // an absolute folder that exists on every host
  int basePort = 29500;
  std::map<std::string, std::string> env;  // passed on to every process (GLOO_SOCKET_IFNAME, ...)
};

constexpr int kDefaultBasePort = 29500;
constexpr double kHostCheckSeconds = 30;

// "a,b" -> {a, b}; a hostfile: one host a line, '#' starts a comment. Throws InvalidArgument for
// an empty list or a name that is not a host ("where" names the option or file).
std::vector<std::string> parseHostList(const std::string& text, char separator, const std::string& where);

// The host part of "user@host" (what the other processes connect to).
std::string addressOf(const std::string& host);

// A remote-shell template split into words; throws InvalidArgument for an unclosed quote, an
// empty template or one without {host}.
std::vector<std::string> splitShellWords(const std::string& text);

// argv of the remote shell running `remoteCommand` (one string the remote login shell runs) on host.
std::vector<std::string> remoteShellArgv(const std::string& shellTemplate, const std::string& host,
                                         const std::string& remoteCommand);

// The processes of a configuration of `workers` ranks and `shards` parameter-server shards running
// `train` (its argv[0] is replaced by hosts.binary), placed as above.
std::vector<ProcessSpec> remoteProcesses(const RemoteHosts& hosts, int workers, int shards,
                                         const std::vector<std::string>& train);

// What checkHosts also asks of every host: that `binary train` can train `model` on `device` (one
// step on a few synthetic examples). Empty device: not asked.
struct HostTraining {
  std::string model;
  std::string device;
};

// Before anything runs: every distinct host answers through the remote shell, passes its standard
// input on, has `workdir`, `outDir` (relative to workdir unless absolute; it must exist here first),
// an executable `binary`, and trains as `training` asks. All hosts are asked at once, each within
// timeoutSeconds. Throws InvalidArgument with one line naming the first host that fails and why.
void checkHosts(const RemoteHosts& hosts, const std::string& outDir, const HostTraining& training = {},
                double timeoutSeconds = kHostCheckSeconds);

}  // namespace cohort::experiment
