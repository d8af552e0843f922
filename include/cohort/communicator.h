// Collective and point-to-point communication between the workers of one job, over c10d's
// ProcessGroupGloo, with a rendezvous through the store the chief hosts (src/comm/store.h).
// Collectives over CUDA tensors go through c10d's ProcessGroupNCCL instead when the backend
// (CommOptions::backend, <cohort/comm_backend.h>) says so: a second group over the same store,
// formed by the first collective over CUDA tensors, after the ranks have compared their GPUs over
// Gloo (NCCL needs one GPU per rank). CPU tensors, barriers, bytes and point-to-point messages stay
// on Gloo.
//
// Contract (as for c10d's ProcessGroup): every collective must be called by all ranks, in the
// same order, with tensors on the same kind of device (all CPU or all CUDA: the first CUDA
// collective is where the ranks choose NCCL or Gloo together). Every wait has a timeout
// (CommOptions::timeout); when a peer dies, the error names the rank that stopped responding,
// found through heartbeats the ranks keep in the store. NCCL's failures and hangs end the same way:
// cohort waits on NCCL's work itself and aborts the NCCL communicator on a timeout; c10d's NCCL
// watchdog, which would end the process, is not started (the first connect() of a cohort built with
// NCCL sets TORCH_NCCL_BLOCKING_WAIT=1 in the process's environment; src/comm/nccl.cpp says why).
#pragma once

#include <cohort/export.h>

#include <cohort/cluster.h>
#include <cohort/comm_backend.h>
#include <cohort/env.h>

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace cohort {

struct COHORT_API CommOptions {
  std::chrono::milliseconds timeout{60000};
  int glooThreads = 2;  // threads that run Gloo's work
  // Rank 0 only: called with the rendezvous store's port once it listens, before connect() waits
  // for the other ranks. With port 0 in the spec's master address the store listens on any free
  // port; whoever starts the other ranks hands them this one (cohort launch learns it over its
  // channel, base/launcher_channel.h, without this callback).
  std::function<void(int port)> onListening;
  // What carries collectives over CUDA tensors (<cohort/comm_backend.h>). kNccl where this build
  // has no NCCL is refused by connect(); kNccl over ranks that share a GPU by the first collective
  // over CUDA tensors, on every rank.
  CommBackend backend = CommBackend::kAuto;
  // Where the communicator's messages go (<cohort/env.h>); null: Env::standard().
  Env* env = nullptr;
};

// Bytes this rank put on the wire and took off it, by the count of the algorithm used
// (ring allreduce: 2 (N-1)/N of the buffer each way), and the time spent waiting.
struct COHORT_API CommCounters {
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double waitSeconds = 0.0;
};

class Communicator;

// A handle on an operation under way (c10d's Work, with cohort's error policy).
class COHORT_API CommWork {
 public:
  CommWork() = default;
  struct Impl;  // opaque: defined in communicator.cpp
  explicit CommWork(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  bool valid() const { return impl_ != nullptr; }
  bool isCompleted() const;
  // Gloo: blocks until done or the communicator's timeout. NCCL (CUDA tensors): makes the calling
  // thread's current CUDA stream wait for the work and returns at once, as PyTorch's DDP does; the
  // communicator's watchdog bounds the work by the timeout, and a failure is thrown by the next
  // operation on the communicator (a barrier waits for the works before it). Throws CommError /
  // TimeoutError naming the operation and, when it can be found, the rank that was lost. Returns
  // the seconds the host waited (about 0 for NCCL: its time is the stream's, not counted here).
  double wait();

 private:
  std::shared_ptr<Impl> impl_;
};

class COHORT_API Communicator {
 public:
  // Joins the job: the chief (rank 0) hosts the store at spec.master, every rank connects to
  // it and the Gloo process group is formed. Throws CommError when the rendezvous times out,
  // InvalidArgument for CommBackend::kNccl in a build without NCCL.
  static std::shared_ptr<Communicator> connect(const ClusterSpec& spec, const CommOptions& options = {});

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int worldSize() const;
  // This process's rank among the workers on its host (the ClusterSpec::localRank it connected
  // with; a split()'s is its parent's): which GPU is this process's (resolveDevice), whatever its
  // rank in this group.
  int localRank() const;

  // In place: tensor becomes the sum over ranks.
  CommWork allreduceAsync(torch::Tensor tensor);
  void allreduce(torch::Tensor tensor) { allreduceAsync(std::move(tensor)).wait(); }

  // In place: every rank gets root's tensor.
  void broadcast(torch::Tensor tensor, int root = 0);
  // Bytes of any length from root to all.
  std::vector<uint8_t> broadcastBytes(const std::vector<uint8_t>& bytes, int root = 0);

  // Every rank's tensor (same shape everywhere), in rank order.
  std::vector<torch::Tensor> allgather(const torch::Tensor& tensor);
  // Every rank's 1-D tensor, whose lengths may differ between ranks, in rank order.
  std::vector<torch::Tensor> allgatherVariable(const torch::Tensor& tensor);

  void barrier();

  // Point to point goes through Gloo whatever the backend (CUDA tensors staged through host
  // memory): NCCL's would need the pair's ranks to have chosen NCCL together first.
  CommWork sendAsync(torch::Tensor tensor, int dst, int tag = 0);
  CommWork recvAsync(torch::Tensor tensor, int src, int tag = 0);
  void send(torch::Tensor tensor, int dst, int tag = 0) { sendAsync(std::move(tensor), dst, tag).wait(); }
  void recv(torch::Tensor tensor, int src, int tag = 0) { recvAsync(std::move(tensor), src, tag).wait(); }

  // A communicator over a subset of the job's ranks (c10d's new_group): its own Gloo group (and
  // NCCL group, formed by its own first collective over CUDA tensors), rendezvoused through the
  // same store under a prefix made from `name`. Only the ranks in
  // `ranks` call it, each with the same list and name; rank() in the result is the index in
  // `ranks`. It shares this communicator's heartbeats, timeout and byte counters, and its errors
  // name ranks of the whole job. Throws InvalidArgument when this rank is not in `ranks`.
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name);

  // How errors describe a rank of the whole job (default: "rank R"), e.g. "rank 3 (stage 1 of
  // replica 1)". Set once, before any operation.
  void setRankNames(std::function<std::string(int rank)> describe);

  CommCounters counters() const;
  const CommOptions& options() const;

  // What carried this communicator's collectives over CUDA tensors: kNccl or kGloo once the first
  // of them has run (it chooses), kAuto before (CPU tensors always go through Gloo).
  CommBackend cudaBackend() const;

  // Ranks whose heartbeat has stopped (waits about three heartbeat periods to tell).
  // Used to name the lost peer when an operation fails.
  std::vector<int> lostRanks();

  struct Impl;  // opaque: defined in communicator.cpp

 private:
  explicit Communicator(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with CommWork handles still under way
};

}  // namespace cohort
