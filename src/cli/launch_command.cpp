#include "cli/commands.h"
#include "cli/launch.h"

#include <memory>

namespace cohort::cli {

Run addLaunchCommand(CLI::App& app) {
  auto options = std::make_shared<LaunchOptions>();
  LaunchOptions& o = *options;
  CLI::App* launch = app.add_subcommand(
      "launch", "Run N processes of a command on this machine as ranks 0 .. N-1");
  launch->footer(
      "Usage: cohort launch -n N [--ps M] [--evaluator] [--max-restarts K] [--port P] [--host H] [--grace S] -- "
      "COMMAND...\n"
      "Every process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and,\n"
      "unless OMP_NUM_THREADS is set, OMP_NUM_THREADS (and OPENBLAS_NUM_THREADS, unless set) = the host's\n"
      "idle cores / N (at least 1). Its output lines are prefixed with [rank i], and every process of the\n"
      "job gets the same random COHORT_AUTH_TOKEN (unless it is set).\n"
      "The first rank to fail stops the others; its status is the exit status, or 2 when another then\n"
      "exits with 2 (a refused input, the cause of the first failure). Under a scheme that\n"
      "survives a lost worker (ps async/softsync/ssp, ps sync with --backup-workers, gossip) a failed\n"
      "worker other than rank 0 is logged and the others go on. --max-restarts K restarts a failed job\n"
      "up to K times; under those ps modes a failed checkpointing shard is restarted alone, and under\n"
      "the asynchronous ones a failed worker too. cohort train resumes from its newest checkpoint. A\n"
      "run that finished but could not write its final checkpoint (a full disk) is not restarted: the\n"
      "job ends with its error.\n"
      "With --ps M, M parameter-server shards run the same command too ([ps k]), and every process gets\n"
      "TF_CONFIG: cohort launch -n 2 --ps 1 -- cohort train --strategy ps\n"
      "With --evaluator, an evaluator task runs it too ([evaluator]): it evaluates every checkpoint the chief\n"
      "writes, so the workers do not pause:\n"
      "  cohort launch -n 2 --evaluator -- cohort train --strategy allreduce --checkpoint-dir D --eval-every 200\n"
      "Its failure does not stop the workers; killed by a signal, it is started again (up to 3 times) and\n"
      "goes on from its record. The launcher waits for it at the end.\n"
      "Without --port, rank 0 and the shards listen on ports they choose (port 0) and say which on the\n"
      "launcher's channel (COHORT_LAUNCH_FD); the processes that connect to them are started after.");
  launch->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  launch->add_option("-n,--nproc", o.processes, "Processes to start (ranks 0 .. N-1)")->required();
  launch->add_option("--ps", o.parameterServers,
                     "Parameter-server shards to start as well (every process gets TF_CONFIG)")
      ->capture_default_str();
  launch->add_flag("--evaluator", o.evaluator,
                   "Start an evaluator task as well (TF_CONFIG type evaluator): it evaluates the checkpoints");
  launch
      ->add_option("--max-restarts", o.maxRestarts,
                   "Restart a failed job up to K times: every process, from its newest checkpoint, or only the "
                   "failed shard or worker where the scheme allows it (below)")
      ->capture_default_str();
  launch->add_option("--port", o.port,
                     "MASTER_PORT (0: rank 0 binds any free port and tells the launcher, which starts the others "
                     "then; a program that does not tell (cohort train does) needs a --port)")
      ->capture_default_str();
  launch->add_option("--host", o.host, "MASTER_ADDR")->capture_default_str();
  launch->add_option("--grace", o.graceSeconds, "Seconds between SIGTERM and SIGKILL when the job ends early")
      ->capture_default_str();
  // Everything from the first positional on is COMMAND, options that start with '-' included; after
  // "--" even a COMMAND that starts with '-'. expandConfig() does not look past "--".
  launch->add_option("command", o.command, "The command to run, after --")->type_name("");
  launch->positionals_at_end();

  return [options]() { return runLaunch(*options); };
}

}  // namespace cohort::cli
