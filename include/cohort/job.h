// The job this process belongs to: its role, its rank among the workers, and the communicator
// that connects the workers. Made once per process, usually from the environment a launcher left
// behind (TF_CONFIG, torchrun's variables, OpenMPI's, Slurm's; none of them: one process alone).
//
//   auto job = cohort::Job::fromEnvironment();
//   if (job.isChief()) ...;
//
// A Job is a cheap handle: copies share the same communicator. Making one has no global side
// effects (no threads set, no seed, no allocator tuning); that is the caller's business.
#pragma once

#include <cohort/export.h>

#include <cohort/cluster.h>
#include <cohort/comm_backend.h>
#include <cohort/env.h>

#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <string>

namespace cohort {

class Communicator;

struct COHORT_API JobOptions {
  // Every wait on another process (rendezvous, collectives, servers) ends after this long with a
  // cohort::TimeoutError naming who did not answer.
  std::chrono::milliseconds timeout{60000};
  // Where this process trains (resolveDevice in <cohort/device.h>): "auto" (the local rank's GPU
  // when there is one, else the CPU), "cpu", "cuda" (cuda:LOCAL_RANK mod the GPU count), "cuda:N".
  std::string device = "auto";
  // What carries the workers' collectives over CUDA tensors (<cohort/comm_backend.h>): NCCL under
  // kAuto when every worker has a GPU of its own and this build has NCCL.
  CommBackend backend = CommBackend::kAuto;
  // Where the job's library code sends its messages and asks for faults (<cohort/env.h>); not
  // owned, and it must outlive the Job and everything made from it. Null: Env::standard().
  Env* env = nullptr;
};

class COHORT_API Job {
 public:
  // Resolves the cluster from the process environment (resolveClusterFromEnvironment). Nothing is
  // connected yet: communicator() joins the workers' group on first use. Throws InvalidArgument
  // when the environment is inconsistent.
  static Job fromEnvironment(const JobOptions& options = {});
  // A job from an explicit spec (tests, launchers of one's own).
  static Job fromSpec(const ClusterSpec& spec, const JobOptions& options = {});
  // A job around a communicator that is already connected (ranks as threads in tests; a
  // sub-group of a larger job): its rank and world size are the communicator's, its device "auto"
  // for the process's local rank (Communicator::localRank), as fromSpec() would choose.
  static Job fromCommunicator(std::shared_ptr<Communicator> comm);
  // One process alone: rank 0 of 1.
  static Job single();

  const ClusterSpec& cluster() const;
  Role role() const { return cluster().role; }
  int rank() const;
  int worldSize() const;
  bool isChief() const { return role() == Role::kWorker && rank() == 0; }
  std::chrono::milliseconds timeout() const;
  // The device JobOptions::device named, resolved when the Job was made (which throws
  // InvalidArgument for a device this machine does not have).
  c10::Device device() const;
  // JobOptions::backend (fromCommunicator: the communicator's).
  CommBackend backend() const;
  // JobOptions::env, or Env::standard().
  Env& env() const;

  // The workers' communicator (c10d Gloo over the chief's rendezvous store, and NCCL for CUDA
  // tensors as JobOptions::backend says). Connects on the first call,
  // which is therefore collective: every worker must make it (the data-parallel and averaging
  // handles do). Null for a single process. Throws InvalidArgument for a process that is not a
  // worker, CommError / TimeoutError when the other workers do not come.
  std::shared_ptr<Communicator> communicator() const;

 private:
  struct State;
  explicit Job(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace cohort
