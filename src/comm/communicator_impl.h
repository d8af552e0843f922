// The state behind a Communicator and a CommWork, shared by the files that implement them:
// communicator.cpp (connecting, sub-groups, heartbeats, failures, the operations) and
// communicator_cuda.cpp (which group carries CUDA tensors, and the NCCL group's life).
#pragma once

#include "base/host_port.h"
#include "base/text.h"
#include "base/thread_annotations.h"
#include "comm/store.h"
#include "comm/work_watchdog.h"

#include <cohort/comm_backend.h>
#include <cohort/communicator.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace cohort {

struct COHORT_LOCAL Communicator::Impl {
  int rank = 0;  // in this group
  int size = 1;
  int localRank = 0;  // the process's among the workers on its host (ClusterSpec::localRank); a sub-group's too
  // A sub-group's ranks in the whole job, and the whole job's communicator, which keeps the
  // heartbeats and the counters. Both empty for the whole job.
  std::vector<int> members;
  std::shared_ptr<Impl> world;
  std::function<std::string(int)> rankName;  // of the whole job's; set before any operation
  CommOptions options;
  Env& env() const { return envOrStandard(options.env); }
  HostPort master;
  std::shared_ptr<store::Server> storeServer;  // the chief's; shared with its sub-groups
  c10::intrusive_ptr<c10d::Store> store;
  std::string storePrefix;  // of this group's keys in the store
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;

  // Collectives over CUDA tensors: the first of them chooses (chooseCudaBackend), on every rank
  // alike, and the choice stays. The mutex orders that choice against later CUDA collectives
  // (DataParallel launches them from autograd's device thread).
  Mutex cudaMutex;
  CommBackend cudaChoice GUARDED_BY(cudaMutex) = CommBackend::kAuto;  // kNccl or kGloo once chosen
  c10::intrusive_ptr<c10d::Backend> ncclGroup GUARDED_BY(cudaMutex);
  // A work of the NCCL group failed or timed out (its communicator is aborted): it is aborted, not
  // shut down, with this communicator.
  std::atomic<bool> ncclBroken{false};
  // The NCCL group's works, which the GPU waits for and the host does not (work_watchdog.h); made
  // with the group.
  std::shared_ptr<WorkWatchdog> ncclWatchdog GUARDED_BY(cudaMutex);

  // The heartbeat has its own store connection: the group's connection must never wait behind a
  // heartbeat, nor a heartbeat behind a key Gloo waits for.
  std::unique_ptr<store::Client> heartbeatStore;
  std::thread heartbeat;
  Mutex stopMutex;
  CondVar stopCv;
  bool stopping GUARDED_BY(stopMutex) = false;

  std::atomic<int64_t> bytesSent{0};
  std::atomic<int64_t> bytesReceived{0};
  std::atomic<int64_t> waitNanos{0};

  ~Impl();

  Impl& root() { return world ? *world : *this; }
  int jobRank(int groupRank) const { return members.empty() ? groupRank : members[size_t(groupRank)]; }
  std::string describeRank(int groupRank) {
    const int r = jobRank(groupRank);
    if (root().rankName) return root().rankName(r);
    return "rank " + std::to_string(r);
  }

  void count(int64_t sent, int64_t received) {
    root().bytesSent += sent;
    root().bytesReceived += received;
  }

  // communicator.cpp: the heartbeats, and failures named by the peer that was lost.

  // The heartbeat thread's loop: a beat every period until the communicator stops.
  void beat() EXCLUDES(stopMutex);
  // Heartbeat counters of every rank, or nothing when the store cannot be reached.
  std::optional<std::vector<int64_t>> readHeartbeats();
  // Ranks of the whole job whose heartbeat stopped.
  std::vector<int> lostRanks();
  // Turns a failed operation into cohort's error, naming the lost peer when there is one.
  [[noreturn]] void fail(const std::string& op, const std::exception& e);

  // communicator_cuda.cpp: the group that carries CUDA tensors, and the NCCL group's life.

  // The group that carries a collective over `tensor`.
  c10d::Backend& groupFor(const torch::Tensor& tensor) EXCLUDES(cudaMutex);
  // NCCL or Gloo for CUDA tensors, on every rank of the group alike (a collective over Gloo: every
  // rank gets here at its first collective over CUDA tensors). NCCL needs one GPU per rank; the
  // ranks compare their GPUs' UUIDs, and when any two share one the whole group stays on Gloo
  // (kAuto, said once, by the group's rank 0) or every rank throws InvalidArgument (kNccl).
  void chooseCudaBackend(c10::Device device) REQUIRES(cudaMutex);
  // The first set of this group's ranks whose GPUs are one ("ranks 0 and 1"), or "" when every
  // rank has its own. A Gloo allgather of each rank's GPU identity.
  std::string ranksSharingAGpu(c10::Device device);
  std::shared_ptr<WorkWatchdog> watchdog() EXCLUDES(cudaMutex);
  // The failure the watchdog recorded for an earlier NCCL work (with `drain`: for any work before
  // now), reported as this operation's.
  void checkNccl(bool drain = false) EXCLUDES(cudaMutex);
  // The NCCL group is shut down (NCCL flushes what it has in flight) or, after one of its works
  // failed, aborted. Either can wait for peers inside NCCL (NVIDIA/nccl#863, #1777: a peer that is
  // gone), with no timeout of its own: it runs on a thread of its own, waited for up to the
  // communicator's timeout, and is left behind after that, saying so.
  void closeNccl() EXCLUDES(cudaMutex);
};

struct COHORT_LOCAL CommWork::Impl {
  std::shared_ptr<Communicator::Impl> comm;
  c10::intrusive_ptr<c10d::Work> work;
  std::string op;
  std::vector<torch::Tensor> keepAlive;  // Gloo or NCCL reads and writes these until the work is done
  bool nccl = false;                     // the work is the NCCL group's: waited for on the GPU, watched by ncclWatchdog
  bool waited = false;
};

}  // namespace cohort
