// `cohort launch`: N local processes of one command, wired together as one job.
//
// The contract (scripts and tests rely on it):
//
// Environment. Every child gets the launcher's environment plus RANK=i, WORLD_SIZE=N,
// LOCAL_RANK=i, LOCAL_WORLD_SIZE=N, MASTER_ADDR=host and MASTER_PORT=port (with port 0, see "Ports"
// below). Unless the launcher's environment sets OMP_NUM_THREADS, it also gets
// OMP_NUM_THREADS = max(1, cores / N) and the same OPENBLAS_NUM_THREADS (kept when set), so that N
// workers never oversubscribe the cores. Variables through which another launcher would assign
// ranks (OMPI_COMM_WORLD_*, SLURM_PROCID, TF_CONFIG, and the torchrun ones above) are removed from
// the children's environment: under `cohort launch` the launcher's assignment wins, even when
// `cohort launch` itself runs inside mpirun, srun or a TF_CONFIG job.
//
// Ports. No process is handed a port that another chose: the processes that listen bind port 0
// and tell the launcher the port they got over their channel ("port P", below). With port 0 (no
// --port) rank 0 is started first with MASTER_PORT=0 (its rendezvous store binds any free port),
// and the other ranks once it has told its port ("port none": it listens on nothing, a scheme
// without a store); they get MASTER_PORT=P. With --ps, the shards start before everyone (their
// own address in TF_CONFIG has port 0) and the chief once every shard has told its port; the
// TF_CONFIG of a task started later holds the ports told so far. A listener that exits with 0
// without telling counts as "none". One that tells nothing within 120 s ends the job with an error
// naming it: a program that does not speak the channel needs --port P (the chief is then given P
// and every rank starts at once) and cannot run with --ps. Each group restart starts over: fresh
// ports. A shard restarted alone gets the port it told (the workers know that one).
//
// Processes. Children are forked and exec'd with execvp semantics (PATH lookup), so COMMAND can be
// any program. They stay in the launcher's process group (a Ctrl-C at a terminal reaches them
// directly as well) and get SIGTERM when the launcher dies (PR_SET_PDEATHSIG). When COMMAND cannot
// be executed the child prints "cohort launch: cannot run COMMAND: <reason>" and exits 127.
//
// Output. A child's stdout and stderr go to the launcher's stdout and stderr, line by line, every
// line prefixed with "[rank i] ". A last line without a newline is written (with one) when the
// pipe closes or when every child has exited; a line longer than 64 KiB is cut into pieces. The
// launcher stops listening once every child has exited, even if a grandchild still holds a pipe.
//
// Ending. The launcher returns 0 when every child exits 0. The first child to exit non-zero or to be
// killed by a signal ends the job: the launcher prints one line to stderr ("cohort launch: rank i
// exited with status S" or "cohort launch: rank i was killed by signal K (SIGNAME)", followed by
// ": REASON" when the child said why over its channel, below), sends SIGTERM
// to the children still running, SIGKILL to those still running graceSeconds later, and returns S,
// or 128 + K. Unless the failure policy (cli/launch_policy.h) says otherwise:
//   - when the job's scheme survives a lost worker (the chief said so) and a worker other than the
//     chief fails, the launcher says so in one line ("...; the others go on without it") and the
//     others carry on; the job's status is then that of the others, and when it is 0 the launcher
//     ends with "cohort launch: the job finished without rank i, ...";
//   - with maxRestarts K > 0, a failure that would end the job instead restarts it, up to K times
//     in all: every process is stopped as above and, once all have exited, started again with new
//     ports (MASTER_PORT, TF_CONFIG; told anew) and COHORT_RESTART_COUNT = the restarts so far, from which
//     `cohort train` resumes from its newest checkpoint; in the asynchronous ps modes a failed worker
//     other than the chief, or a shard that writes checkpoints, is restarted alone instead. The
//     line says which ("...; starting it again alone (restart r of K)" or "...; restarting every
//     process from the newest checkpoint (restart r of K)"). A process that said "finished" before
//     failing (its run is recorded, its final checkpoint could not be written) is never restarted:
//     the job ends with its status ("...; it had finished its run ... not restarted"). SIGINT or SIGTERM sent to the launcher is forwarded to every running child as the
// same signal and ends the job the same way, returning 128 + the signal (the launcher says so in
// one line on stderr). Such a signal while the job is already ending (a second Ctrl-C) sends
// SIGKILL to the remaining children at once. Once the job is ending, further child exits are not
// reported. Every child has been reaped when runLaunch returns.
//
// The launcher channel. Every child also gets COHORT_LAUNCH_FD=3, a pipe to the launcher open at
// descriptor 3 (base/launcher_channel.h; `echo ... >&3` from a shell), and COHORT_RESTART_COUNT
// (0 at first); a process restarted alone also gets COHORT_RESTARTED_ALONE=1 (a shard then serves
// the state it restores to every worker at once: the others run on). A child may write
// lines there: "fault-policy stops-group|tolerated|rejoins" (from rank 0: what the scheme survives),
// "shard-checkpoints" and "shard-has-checkpoint" (from a shard), "error REASON" (why it is about to fail), "finished" (it ran
// every step and wrote its done event; a failure after this is not restarted), "port P" or
// "port none" (from rank 0 and the shards: see "Ports"). Other lines are ignored; a program that
// writes nothing gets the behaviour of a synchronous scheme.
//
// Every child of a job gets the same COHORT_AUTH_TOKEN (a random secret, unless the launcher's
// environment sets one): parameter-server shards and gossip peers refuse calls without it.
//
// Parameter servers (parameterServers = M > 0). M more children run the same command as the
// shards "ps 0" .. "ps M-1" (their output lines are prefixed with "[ps k] "). Every child then also
// gets TF_CONFIG describing the whole job: {"cluster": {"chief": [host:port], "worker": [the other
// workers], "ps": [the shards]}, "task": {"type": "chief" | "worker" | "ps", "index": k}}: the
// chief and the shards at the ports they told, the other workers (which listen on nothing) at
// port 0; the shards get no RANK or WORLD_SIZE. Shards end on their own when the
// workers are done; any still running graceSeconds (at least 1 s) after the last worker exited
// with 0 get SIGTERM, which a cohort shard answers by checkpointing and exiting with 0.
//
// Evaluator (evaluator = true). One more child runs the same command as the task "evaluator 0"
// (prefix "[evaluator] "), and every child gets TF_CONFIG as above with an "evaluator" list. Its
// failure is reported but never ends the job: killed by a signal, it is started again alone (up to
// 3 times per job, apart from maxRestarts: "cohort launch: evaluator was killed by signal 9
// (SIGKILL); starting it again, it goes on from its record (evaluator restart 1 of 3); the workers
// go on"), and the restarted evaluator skips the checkpoints its record holds; exited with a status
// S, it is not restarted ("cohort launch: evaluator exited with status S; the workers go on").
// When the workers end the job early it is stopped with them. After the
// workers exit with 0 the launcher waits for it to finish evaluating (it exits on its own once it
// has read the chief's last checkpoint, or after its --evaluator-timeout). The exit status is the
// workers'.
//
// runLaunch installs handlers for SIGINT, SIGTERM and SIGCHLD while it runs (restoring the previous
// ones before it returns), so only one may run at a time in a process.
#pragma once

#include <string>
#include <vector>

namespace cohort::cli {

struct LaunchOptions {
  int processes = 1;               // N: ranks 0 .. N-1
  std::string host = "127.0.0.1";  // MASTER_ADDR, and where the listeners bind
  int port = 0;                    // MASTER_PORT; 0: the chief binds any free port and tells it
  int parameterServers = 0;        // M: --ps shards, started after the workers (see below)
  bool evaluator = false;          // one evaluator task, started after the shards (see below)
  double graceSeconds = 10;        // from SIGTERM to SIGKILL when the job ends early
  int maxRestarts = 0;             // failures the job may recover from by restarting (see above)
  std::vector<std::string> command;
};

// Runs the job described above and returns the launcher's exit status. Throws InvalidArgument for
// options that cannot work (processes < 1, more processes than the machine allows (1024, or half
// of RLIMIT_NPROC), no command, a port outside 0..65535, a host that does not resolve or is not
// an address of this machine, a negative grace or --max-restarts), Error when the children cannot
// be started (any already started are killed and reaped first).
int runLaunch(const LaunchOptions& options);

}  // namespace cohort::cli
