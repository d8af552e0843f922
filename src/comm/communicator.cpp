#include "base/host_port.h"
#include "base/launcher_channel.h"
#include "comm/c10d_store.h"
#include "comm/communicator_impl.h"
#include "comm/nccl.h"
#include "comm/rank_claim.h"

#include <cohort/comm_backend.h>
#include <cohort/communicator.h>
#include <cohort/error.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <iostream>
#include <mutex>
#include <thread>

namespace cohort {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kHeartbeatPeriod{500};
// formGlooGroup's wait beyond the timeout, in which Gloo's own error comes first.
constexpr std::chrono::milliseconds kGlooMargin{2000};

std::string heartbeatKey(int rank) { return "cohort/heartbeat/" + std::to_string(rank); }

// One device per interface of GLOO_SOCKET_IFNAME (a comma-separated list, as PyTorch reads it).
std::vector<std::shared_ptr<::gloo::transport::Device>> makeDevices(const std::string& masterHost) {
  if (isLoopbackHost(masterHost)) return {c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")};
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  for (const std::string& name : socketInterfaces()) {
    devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  }
  if (devices.empty()) devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return devices;
}

// The ranks of a group of `size` whose Gloo address is not in the store under `prefix` ("1, 2");
// "" when every rank's is, or when the store cannot tell (it is gone).
std::string ranksWithoutAGlooAddress(c10d::Store& store, const std::string& prefix, int size) {
  // Gloo's keys are "<prefix>/0/<rank>" (ProcessGroupGloo's device 0).
  std::string absent;
  try {
    for (int r = 0; r < size; ++r) {
      if (!store.check({prefix + "/0/" + std::to_string(r)}))
        absent += (absent.empty() ? "" : ", ") + std::to_string(r);
    }
  } catch (const std::exception&) {
    return "";
  }
  return absent;
}

std::string didNotGiveItsAddress(const std::string& absent, const std::string& within) {
  return "rank " + absent + " did not give its Gloo address" + within +
         ": is every worker started, with the same MASTER_ADDR/MASTER_PORT?";
}

// The Gloo group of `size` ranks over the store's keys under `prefix`, formed within the timeout.
// Gloo's own waits are bounded by it, but not its whole: a rank that publishes an address and
// never completes Gloo's handshake (a stranger's, in a job without a secret, whose store anyone
// may write) held the constructor five timeouts (issue 30). It runs on a thread of its own, over a
// store connection of its own, and is left behind when the timeout (and a margin in which Gloo's
// own error, naming the key or the peer, comes first) passes. A thread left behind holds nothing
// of the communicator's; in a process that exits meanwhile it ends with the process. While it
// waits, it checks through `claim` (the job's first group; null for a sub-group, formed after the
// rendezvous) whether another process refused the job (comm/rank_claim.h: a rank claimed twice,
// another world size) and throws InvalidArgument with that process's line.
c10::intrusive_ptr<c10d::ProcessGroupGloo> formGlooGroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                         const store::RankClaim* claim, const std::string& prefix,
                                                         int rank, int size, const HostPort& master,
                                                         const CommOptions& options) {
  auto groupOptions = c10d::ProcessGroupGloo::Options::create(options.timeout);
  groupOptions->devices = makeDevices(master.host);
  groupOptions->threads = options.glooThreads;
  auto own = c10::make_intrusive<c10d::PrefixStore>(prefix, store->clone());
  std::packaged_task<c10::intrusive_ptr<c10d::ProcessGroupGloo>()> form([own, rank, size, groupOptions] {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(own, rank, size, groupOptions);
  });
  std::future<c10::intrusive_ptr<c10d::ProcessGroupGloo>> formed = form.get_future();
  std::thread(std::move(form)).detach();
  const std::string within = " within " + std::to_string(options.timeout.count() / 1000) + " s";
  const auto deadline = Clock::now() + options.timeout + kGlooMargin;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (formed.wait_for(std::clamp(left, std::chrono::milliseconds(0), store::kRefusalCheckPeriod)) ==
        std::future_status::ready) {
      try {
        return formed.get();
      } catch (const std::exception&) {
        // Gloo's own timeout ("keys did not appear") names no rank: the ranks that never came.
        const std::string absent = ranksWithoutAGlooAddress(*store, prefix, size);
        if (absent.empty()) throw;
        throw std::runtime_error(didNotGiveItsAddress(absent, within));
      }
    }
    if (claim != nullptr) {
      if (std::optional<std::string> why = claim->refusal()) throw InvalidArgument(*why);
    }
    if (left <= store::kRefusalCheckPeriod) break;
  }
  // The ranks without an address never came; when every rank has one, an address is not this
  // job's or cannot be reached.
  const std::string absent = ranksWithoutAGlooAddress(*store, prefix, size);
  if (!absent.empty()) throw std::runtime_error(didNotGiveItsAddress(absent, within));
  throw std::runtime_error("every rank gave its Gloo address, but Gloo's connections did not complete" + within +
                           ": an address that is not this job's (without a secret anyone may write the store), or "
                           "one this host cannot reach (GLOO_SOCKET_IFNAME)");
}

// The variables c10d reads when it makes a group, set once, before this process's first group
// (a setenv racing c10d's getenv in another thread's group would be undefined):
// - TORCH_FR_BUFFER_SIZE=0, unless the user set it. c10d's flight recorder (a trace of
//   collectives for debugging NCCL hangs, which cohort's own watchdog and errors cover) inserts
//   into a map without a lock when two groups of one process start their first collectives at
//   once: ranks as threads of one process (the tests, replicas) crashed in
//   FlightRecorder::recordWithResetEnabled, 14 runs in 100 of a unit test.
// - TORCH_NCCL_BLOCKING_WAIT=1 where this cohort has NCCL: a timed-out NCCL wait throws into the
//   caller, which names the rank (nccl.cpp), instead of the watchdog tearing the process down.
void setTorchsEnvironmentOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
    if (hasNccl()) ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/1);
  });
}

// A second process given rank 0 finds the chief's store on the port: when that store is this
// job's (it admits this process's secret or job identity), the rank is claimed there as any other
// and refused, naming both processes, and the chief fails with the same line. Returns when the
// port is another program's or another job's.
void refuseASecondChief(const ClusterSpec& spec, std::chrono::milliseconds timeout) {
  std::unique_ptr<store::Client> store;
  try {
    store = store::Client::connect(spec.master.host, spec.master.port, spec.storeKey(),
                                   std::min(timeout, std::chrono::milliseconds(2000)));
  } catch (const Error&) {
    return;
  }
  store::RankClaim::make(*store, spec.rank, spec.worldSize, timeout);  // throws, unless rank 0 was free
}

int64_t nbytes(const torch::Tensor& t) { return int64_t(t.numel()) * int64_t(t.element_size()); }

}  // namespace

std::string commBackendName(CommBackend backend) {
  switch (backend) {
    case CommBackend::kAuto:
      return "auto";
    case CommBackend::kNccl:
      return "nccl";
    case CommBackend::kGloo:
      return "gloo";
  }
  return "unknown";
}

CommBackend parseCommBackend(const std::string& name) {
  for (CommBackend b : {CommBackend::kAuto, CommBackend::kNccl, CommBackend::kGloo}) {
    if (commBackendName(b) == name) return b;
  }
  throw InvalidArgument("backend \"" + name + "\": expected auto, nccl or gloo");
}

void Communicator::Impl::beat() {
  for (;;) {
    {
      MutexLock lock(stopMutex);
      const auto next = Clock::now() + kHeartbeatPeriod;
      while (!stopping && stopCv.waitUntil(stopMutex, next) == std::cv_status::no_timeout) continue;
      if (stopping) return;
    }
    try {
      heartbeatStore->add(heartbeatKey(rank), 1);
    } catch (const std::exception&) {
      return;  // the store (the chief) is gone; the next operation reports it
    }
  }
}

std::optional<std::vector<int64_t>> Communicator::Impl::readHeartbeats() {
  std::vector<int64_t> out(size_t(size), 0);
  try {
    for (int r = 0; r < size; ++r) out[size_t(r)] = heartbeatStore->add(heartbeatKey(r), 0);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return out;
}

std::vector<int> Communicator::Impl::lostRanks() {
  if (world) return world->lostRanks();
  auto before = readHeartbeats();
  if (!before) return {0};  // the chief hosts the store
  std::this_thread::sleep_for(kHeartbeatPeriod * 3);
  auto after = readHeartbeats();
  if (!after) return {0};
  std::vector<int> lost;
  for (int r = 0; r < size; ++r) {
    if (r != rank && (*after)[size_t(r)] == (*before)[size_t(r)]) lost.push_back(r);
  }
  return lost;
}

void Communicator::Impl::fail(const std::string& op, const std::exception& e) {
  const std::string what = firstLine(e.what());
  const bool timedOut = what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
  std::string who;
  Impl& job = root();
  for (int r : lostRanks()) {
    who += (who.empty() ? "" : ", ") + job.describeRank(r) +
           (r == 0 ? " (the chief, which hosts the rendezvous store)" : "");
  }
  std::string message = describeRank(rank) + ": " + op + " failed";
  if (!who.empty()) message += ": lost " + who + ", whose heartbeat stopped";
  message += " (" + what + ")";
  if (timedOut && who.empty()) {
    message +=
        "; no peer answered within " + std::to_string(options.timeout.count() / 1000) + " s (--timeout to change)";
    throw TimeoutError(message);
  }
  throw CommError(message);
}

Communicator::Impl::~Impl() {
  closeNccl();
  {
    MutexLock lock(stopMutex);
    stopping = true;
  }
  stopCv.notifyAll();
  if (heartbeat.joinable()) heartbeat.join();
}

bool CommWork::isCompleted() const { return impl_ == nullptr || impl_->work->isCompleted(); }

double CommWork::wait() {
  if (impl_ == nullptr || impl_->waited) return 0.0;
  const auto start = Clock::now();
  if (impl_->nccl) impl_->comm->checkNccl();  // an earlier work's failure is this wait's
  try {
    if (impl_->nccl) {
      // As the DDP reducer waits: the caller's current stream waits for NCCL's, the host does not;
      // the watchdog bounds the work's time and keeps its tensors until it completes. Not
      // Work::synchronize(), which blocks the host until the work is done under
      // TORCH_NCCL_BLOCKING_WAIT (nccl.cpp): the work's future, completed when it was launched
      // with events on NCCL's stream, makes the current stream wait for those events only.
      impl_->work->getFuture()->wait();
      impl_->comm->watchdog()->watch(impl_->work, impl_->op, std::move(impl_->keepAlive));
    } else {
      impl_->work->wait(impl_->comm->options.timeout);
    }
  } catch (const std::exception& e) {
    impl_->waited = true;
    if (impl_->nccl) impl_->comm->ncclBroken = true;
    impl_->comm->fail(impl_->op, e);
  }
  impl_->waited = true;
  const auto waited = Clock::now() - start;
  impl_->comm->root().waitNanos += std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count();
  return std::chrono::duration<double>(waited).count();
}

Communicator::Communicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::connect(const ClusterSpec& spec, const CommOptions& options) {
  setTorchsEnvironmentOnce();
  COHORT_CHECK(options.backend != CommBackend::kNccl || hasNccl(), InvalidArgument, "rank ", spec.rank,
               ": backend nccl (--backend nccl), but this cohort was built without NCCL (its LibTorch has no c10d "
               "ProcessGroupNCCL, or CMake found no nccl.h): use --backend gloo or auto, or rebuild cohort against a "
               "LibTorch with NCCL (PyPI's torch==2.11.0, which scripts/setup.sh installs, has it)");
  COHORT_CHECK(spec.worldSize >= 1 && spec.rank >= 0 && spec.rank < spec.worldSize, InvalidArgument, "rank ", spec.rank,
               " of a job of ", spec.worldSize, " workers: a rank is 0 to the world size - 1");
  auto impl = std::make_shared<Impl>();
  impl->rank = spec.rank;
  impl->size = spec.worldSize;
  impl->localRank = spec.localRank;
  impl->options = options;
  impl->master = spec.master;
  const std::string where = spec.master.host + ":" + std::to_string(spec.master.port);
  std::optional<store::RankClaim> claim;  // through impl->heartbeatStore
  try {
    if (spec.rank == 0) {
      if (spec.secret.empty() && spec.worldSize > 1) {
        impl->env().log(LogLevel::kWarning,
                        "this job has no secret (COHORT_AUTH_TOKEN is unset): " +
                            (spec.jobIdentity.empty()
                                 ? "any process that reaches " + where +
                                       " can join it and change its model, and a second job on this port would merge "
                                       "with it"
                                 : "its identity (" + spec.jobIdentitySource + ") keeps other jobs off " + where +
                                       ", but any process that knows it can join and change the model") +
                            "; cohort launch makes one, else set COHORT_AUTH_TOKEN to the same random value on every "
                            "process");
      }
      // Port 0 (cohort launch without --port): any free port, which the launcher learns from here
      // and hands to the other workers it starts only then.
      try {
        impl->storeServer = store::Server::start(store::ServerOptions{
            .host = spec.master.host, .port = spec.master.port, .secret = spec.storeKey(), .env = options.env});
      } catch (const store::AddressInUse&) {
        refuseASecondChief(spec, options.timeout);  // when the port is this job's chief's
        throw;
      }
      impl->master.port = impl->storeServer->port();
      launcher::tellPort(impl->master.port);
      if (options.onListening) options.onListening(impl->master.port);
    }
    const int port = impl->master.port;
    impl->store = c10::make_intrusive<store::C10dStore>(spec.master.host, port, spec.storeKey(), options.timeout);
    impl->heartbeatStore = store::Client::connect(spec.master.host, port, spec.storeKey(), options.timeout);
    claim = store::RankClaim::make(*impl->heartbeatStore, spec.rank, spec.worldSize, options.timeout);
    impl->heartbeatStore->add(heartbeatKey(spec.rank), 1);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("rank " + std::to_string(spec.rank) + ": " + e.what());
  } catch (const Error& e) {
    throw CommError("rank " + std::to_string(spec.rank) + ": rendezvous with the chief at " + where +
                    " failed: " + firstLine(e.what()));
  } catch (const std::exception& e) {
    throw CommError("rank " + std::to_string(spec.rank) + ": rendezvous with the chief at " + where +
                    " failed: " + firstLine(e.what()) + ": check that all " + std::to_string(spec.worldSize) +
                    " workers are started, that MASTER_ADDR/MASTER_PORT name the chief, and that the port "
                    "is free (--timeout to wait longer)");
  }
  const std::string bound = spec.master.host + ":" + std::to_string(impl->master.port);  // port 0: the one taken
  try {
    impl->storePrefix = "cohort/group";
    impl->group =
        formGlooGroup(impl->store, &*claim, impl->storePrefix, spec.rank, spec.worldSize, impl->master, options);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("rank " + std::to_string(spec.rank) + ": " + e.what());
  } catch (const std::exception& e) {
    // A worker with another secret is refused by the chief's store and says so itself; the chief
    // only sees that its rank never came.
    const int64_t refused = impl->storeServer ? impl->storeServer->stats().refused : 0;
    throw CommError("rank " + std::to_string(spec.rank) + ": forming the Gloo group through " + bound +
                    " failed: " + firstLine(e.what()) +
                    (refused == 0 ? ""
                                  : "; the store refused " + std::to_string(refused) + " connection" +
                                        (refused == 1 ? "" : "s") +
                                        " that did not prove the job's secret: is COHORT_AUTH_TOKEN the same on "
                                        "every process?"));
  }
  impl->heartbeat = std::thread([raw = impl.get()] { raw->beat(); });
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl)));
}

std::shared_ptr<Communicator> Communicator::split(const std::vector<int>& ranks, const std::string& name) {
  const int self = impl_->jobRank(impl_->rank);
  const auto at = std::find(ranks.begin(), ranks.end(), self);
  COHORT_CHECK(at != ranks.end(), InvalidArgument, "rank ", self, " is not in the group '", name,
               "' it was asked to join");
  auto sub = std::make_shared<Impl>();
  sub->rank = int(at - ranks.begin());
  sub->size = int(ranks.size());
  sub->localRank = impl_->localRank;
  sub->options = impl_->options;
  sub->master = impl_->master;
  sub->store = impl_->store;
  sub->world = impl_->world ? impl_->world : impl_;
  for (int r : ranks) sub->members.push_back(impl_->members.empty() ? r : impl_->members[size_t(r)]);
  try {
    sub->storePrefix = "cohort/group/" + name;
    sub->group =
        formGlooGroup(impl_->store, nullptr, sub->storePrefix, sub->rank, sub->size, impl_->master, impl_->options);
  } catch (const std::exception& e) {
    sub->fail("forming the group '" + name + "'", e);
  }
  return std::shared_ptr<Communicator>(new Communicator(std::move(sub)));
}

void Communicator::setRankNames(std::function<std::string(int)> describe) {
  impl_->root().rankName = std::move(describe);
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::localRank() const { return impl_->localRank; }
int Communicator::worldSize() const { return impl_->size; }
const CommOptions& Communicator::options() const { return impl_->options; }

CommBackend Communicator::cudaBackend() const {
  MutexLock lock(impl_->cudaMutex);
  return impl_->cudaChoice;
}
std::vector<int> Communicator::lostRanks() { return impl_->lostRanks(); }

CommCounters Communicator::counters() const {
  const Impl& job = impl_->root();
  return {job.bytesSent.load(), job.bytesReceived.load(), double(job.waitNanos.load()) * 1e-9};
}

namespace {

// Launches one operation on `group` (Gloo or NCCL) as a CommWork; a failure to launch is reported
// like a failure to complete. `keep` holds the tensors the group uses until the work is done.
CommWork start(const std::shared_ptr<Communicator::Impl>& comm, c10d::Backend& group, const std::string& op,
               const std::function<c10::intrusive_ptr<c10d::Work>()>& launch, std::vector<torch::Tensor> keep) {
  const bool nccl = group.getBackendName() == "nccl";
  // Any operation, Gloo's too, reports an NCCL work that failed since (after the last step's
  // allreduce, the Trainer's collectives are Gloo's).
  comm->checkNccl();
  try {
    return CommWork(std::make_shared<CommWork::Impl>(CommWork::Impl{comm, launch(), op, std::move(keep), nccl}));
  } catch (const std::exception& e) {
    if (nccl) comm->ncclBroken = true;
    comm->fail(op, e);
  }
}

}  // namespace

CommWork Communicator::allreduceAsync(torch::Tensor tensor) {
  COHORT_CHECK(tensor.is_contiguous(), InvalidArgument, "allreduce needs a contiguous tensor");
  const int64_t n = nbytes(tensor);
  const int64_t onWire = impl_->size > 1 ? 2 * n * (impl_->size - 1) / impl_->size : 0;
  std::vector<torch::Tensor> tensors{tensor};
  c10d::Backend& group = impl_->groupFor(tensor);
  CommWork work = start(impl_, group, "allreduce of " + std::to_string(n) + " bytes",
                        [&] { return group.allreduce(tensors); }, tensors);
  impl_->count(onWire, onWire);
  return work;
}

void Communicator::broadcast(torch::Tensor tensor, int root) {
  COHORT_CHECK(tensor.is_contiguous(), InvalidArgument, "broadcast needs a contiguous tensor");
  std::vector<torch::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  c10d::Backend& group = impl_->groupFor(tensor);
  start(impl_, group, "broadcast", [&] { return group.broadcast(tensors, opts); }, tensors).wait();
  const int64_t n = nbytes(tensor);
  if (impl_->rank == root) {
    impl_->count(n * (impl_->size - 1), 0);
  } else {
    impl_->count(0, n);
  }
}

std::vector<uint8_t> Communicator::broadcastBytes(const std::vector<uint8_t>& bytes, int root) {
  auto size = torch::tensor({int64_t(bytes.size())}, torch::kInt64);
  broadcast(size, root);
  const int64_t n = size.item<int64_t>();
  auto buffer = torch::empty({n}, torch::kUInt8);
  if (impl_->rank == root && n > 0) std::memcpy(buffer.data_ptr(), bytes.data(), size_t(n));
  if (n > 0) broadcast(buffer, root);
  const auto* p = buffer.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + n);
}

std::vector<torch::Tensor> Communicator::allgather(const torch::Tensor& tensor) {
  auto input = tensor.contiguous();
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int r = 0; r < impl_->size; ++r) outputs[0].push_back(torch::empty_like(input));
  std::vector<torch::Tensor> inputs{input};
  std::vector<torch::Tensor> keep = outputs[0];
  keep.push_back(input);
  c10d::Backend& group = impl_->groupFor(input);
  start(impl_, group, "allgather", [&] { return group.allgather(outputs, inputs); }, keep).wait();
  const int64_t n = nbytes(input) * (impl_->size - 1);
  impl_->count(n, n);
  return outputs[0];
}

std::vector<torch::Tensor> Communicator::allgatherVariable(const torch::Tensor& tensor) {
  COHORT_CHECK(tensor.dim() == 1, InvalidArgument, "allgatherVariable takes 1-D tensors, got ", tensor.dim(),
               " dimensions");
  auto lengths = allgather(torch::tensor({tensor.size(0)}, torch::kInt64));
  int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l.item<int64_t>());
  auto padded = torch::zeros({longest}, tensor.options());
  padded.narrow(0, 0, tensor.size(0)).copy_(tensor);
  auto gathered = allgather(padded);
  std::vector<torch::Tensor> out;
  for (int r = 0; r < impl_->size; ++r) out.push_back(gathered[size_t(r)].narrow(0, 0, lengths[size_t(r)].item<int64_t>()));
  return out;
}

void Communicator::barrier() {
  // After the NCCL works before it, as a barrier over NCCL would be: their failure is the barrier's.
  impl_->checkNccl(/*drain=*/true);
  start(impl_, *impl_->group, "barrier", [&] { return impl_->group->barrier(); }, {}).wait();
}

CommWork Communicator::sendAsync(torch::Tensor tensor, int dst, int tag) {
  COHORT_CHECK(tensor.is_contiguous(), InvalidArgument, "send needs a contiguous tensor");
  std::vector<torch::Tensor> tensors{tensor};
  CommWork work = start(impl_, *impl_->group, "send to " + impl_->describeRank(dst),
                        [&] { return impl_->group->send(tensors, dst, tag); }, tensors);
  impl_->count(nbytes(tensor), 0);
  return work;
}

CommWork Communicator::recvAsync(torch::Tensor tensor, int src, int tag) {
  COHORT_CHECK(tensor.is_contiguous(), InvalidArgument, "recv needs a contiguous tensor");
  std::vector<torch::Tensor> tensors{tensor};
  CommWork work = start(impl_, *impl_->group, "receive from " + impl_->describeRank(src),
                        [&] { return impl_->group->recv(tensors, src, tag); }, tensors);
  impl_->count(0, nbytes(tensor));
  return work;
}

}  // namespace cohort
