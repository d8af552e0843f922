// Who this process is in the job: its role, its rank and where its peers are, read from the
// environment a launcher left behind (DESIGN.md, "Processes and how they find each other").
//
// Sources, first match wins:
//   1. TF_CONFIG (Kubernetes operators, hand-written): {"cluster": {"chief": [...], "worker": [...],
//      "ps": [...], "evaluator": [...]}, "task": {"type": ..., "index": ...}}; other top-level keys
//      (Kubeflow's TFJob adds "environment": "cloud") are ignored.
//   2. torchrun / cohort launch: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//      MASTER_PORT. Kubeflow's PyTorchJob sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for one
//      process per pod, with PET_NPROC_PER_NODE, PET_NODE_RANK and PET_NNODES for torchrun: without
//      LOCAL_WORLD_SIZE the processes on this host are PET_NPROC_PER_NODE (else WORLD_SIZE). With
//      PET_NPROC_PER_NODE > 1 and no LOCAL_RANK (no torchrun in the pod) RANK numbers pods while
//      WORLD_SIZE counts processes: an error that says so.
//   3. OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE.
//   4. Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST.
//   5. None of them: a single process.
// A variable set to the empty string counts as unset.
//
// Cross-process contract: every worker of a job must resolve the same worldSize and master, and
// distinct ranks 0..worldSize-1; the resolution is a pure function of the environment so that
// launchers giving every process a consistent environment get that for free.
#pragma once

#include <cohort/export.h>

#include <functional>
#include <cohort/host_port.h>

#include <optional>
#include <string>
#include <vector>

namespace cohort {

enum class Role { kWorker, kParameterServer, kEvaluator };

struct COHORT_API ClusterSpec {
  Role role = Role::kWorker;
  int rank = 0;            // workers: 0..worldSize-1, the chief is 0; ps: the shard index; evaluator: its index
  int worldSize = 1;       // number of workers, chief included
  int localRank = 0;       // among the workers on this host
  int localWorldSize = 1;  // workers on this host
  HostPort master{"127.0.0.1", 29500};     // where the chief's rendezvous store listens
  std::vector<HostPort> workers;           // worker addresses when known (TF_CONFIG), chief first
  std::vector<HostPort> parameterServers;  // ps shard addresses (TF_CONFIG "ps")
  std::vector<HostPort> evaluators;        // evaluator tasks (TF_CONFIG "evaluator"): they evaluate the checkpoints
  std::string source = "single";           // "TF_CONFIG", "torchrun", "OpenMPI", "Slurm" or "single"
  // The job's shared secret ($COHORT_AUTH_TOKEN, which `cohort launch` makes): the rendezvous
  // store, the gossip peers and the shards admit only processes that prove it. Empty: none.
  std::string secret;
  // Without a secret: the launcher's name for this job, which every process of it shares
  // ($COHORT_JOB_ID, torchrun's TORCHELASTIC_RUN_ID, Slurm's SLURM_JOB_ID (JOB_ID.STEP_ID when
  // Slurm's variables gave the roles), OpenMPI's PMIX_NAMESPACE, the first set), and which variable gave it. The rendezvous store then admits
  // only processes that know it, so that two jobs on one port refuse each other. Not a secret:
  // anyone who can read it can still join. Empty: none (then any process is admitted).
  std::string jobIdentity;
  std::string jobIdentitySource;

  bool isChief() const { return role == Role::kWorker && rank == 0; }
  // What the rendezvous store's handshake proves: the secret, else the job's identity, else
  // nothing.
  std::string storeKey() const { return !secret.empty() ? secret : jobIdentity.empty() ? "" : "job:" + jobIdentity; }
};

constexpr int kDefaultMasterPort = 29500;

// Looks up one environment variable; std::nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Resolves role, rank and peers from the environment, in the order above. Throws InvalidArgument
// naming the variable that is wrong and what is wrong with it; two sources that are both set and
// disagree (TF_CONFIG with RANK/WORLD_SIZE, RANK/WORLD_SIZE with OMPI_COMM_WORLD_RANK/SIZE) are
// an error naming both.
COHORT_API ClusterSpec resolveCluster(const EnvLookup& env);

// resolveCluster over the process environment (std::getenv).
COHORT_API ClusterSpec resolveClusterFromEnvironment();

// One line for logs: "worker 1 of 2 (TF_CONFIG), master 127.0.0.1:29500".
COHORT_API std::string describe(const ClusterSpec& spec);

// Expands Slurm's compressed host list, in order: "node[01-03,07],gpu5" ->
// node01 node02 node03 node07 gpu5 (zero padding kept, several bracket groups in one name
// multiply out). Throws InvalidArgument on an unbalanced bracket or a bad range.
COHORT_API std::vector<std::string> expandSlurmNodelist(const std::string& nodelist);

}  // namespace cohort
