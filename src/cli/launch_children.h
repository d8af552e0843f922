// `cohort launch`'s children (cli/launch.h, "Processes", "The launcher channel"): one process of
// the job with its pipes, started (or started again) from the command and its environment, and
// what it has said on its channel.
#pragma once

#include "base/subprocess.h"
#include "cli/launch_environment.h"
#include "cli/launch_output.h"
#include "cli/launch_policy.h"

#include <memory>
#include <string>
#include <vector>

namespace cohort::cli {

// The highest TCP port: what a port option and a child's "port P" line may name.
inline constexpr int kMaxPort = 65535;

struct LaunchedChild {
  int rank = 0;
  bool server = false;     // a parameter-server shard (--ps), not a worker
  bool evaluator = false;  // the evaluator task (--evaluator)
  std::string label;       // "rank i", "ps i" or "evaluator"
  Subprocess process;
  std::unique_ptr<LineForwarder> out;
  std::unique_ptr<LineForwarder> err;
  std::unique_ptr<ChannelReader> channel;
  bool writesCheckpoints = false;  // a shard that said "shard-checkpoints"
  bool hasCheckpoint = false;      // a shard that said "shard-has-checkpoint" since it was started
  std::string error;               // what it said before failing ("error ...")
  bool finished = false;           // it said "finished": its run is recorded (launch_policy.h)
  bool pending = false;            // not started yet: it needs a port the launcher does not know yet
  int port = -1;                   // what it said ("port P"; 0: "port none" or exited without); -1: nothing
  bool restartedAlone = false;     // started again alone by the failure policy (COHORT_RESTARTED_ALONE=1)

  bool running() const { return process.running(); }
  // Rank 0 without --port, and the shards, bind port 0 and tell the launcher which port they got.
  bool tellsPort() const { return server || (rank == 0 && !evaluator); }
};

// Starts `child` as `command` with the launcher's environment changed by `env` (and the variables of
// assignedElsewhere() removed): stdout and stderr forwarded with the child's label as prefix, the
// channel at kChannelFd. It stays in the launcher's process group and gets SIGTERM when the
// launcher dies. Throws Error ("launch: cannot start LABEL: ...") when it cannot be started.
void startChild(LaunchedChild& child, const std::vector<std::string>& command, const EnvChanges& env);

// Reads the lines the child wrote on its channel and records what they say; "fault-policy" from
// the chief sets `scheme`.
void readChannel(LaunchedChild& child, WorkerLoss& scheme);

// Reads what an exited child left in its pipes (bounded: a grandchild may still be writing).
void drain(LaunchedChild& child, WorkerLoss& scheme);

// Drains the pipes, forwards what is left and closes them, even if a grandchild still holds one.
void closePipes(LaunchedChild& child, WorkerLoss& scheme);

}  // namespace cohort::cli
