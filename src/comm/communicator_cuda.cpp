// Collectives over CUDA tensors: which group carries them (NCCL, one GPU per rank; else Gloo,
// staged through host memory), chosen alike on every rank at the first of them, and the NCCL
// group's life: its works watched, its failures reported, its shutdown bounded.
#include "comm/communicator_impl.h"
#include "comm/nccl.h"

#include <cohort/error.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <array>
#include <future>
#include <map>

namespace cohort {

namespace {

// "ranks 0 and 1", "ranks 0, 2 and 3".
std::string listRanks(const std::vector<std::string>& names) {
  std::string out = "ranks ";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " and " : ", ";
    out += names[i].rfind("rank ", 0) == 0 ? names[i].substr(5) : names[i];
  }
  return out;
}

}  // namespace

c10d::Backend& Communicator::Impl::groupFor(const torch::Tensor& tensor) {
  if (!tensor.is_cuda()) return *group;
  MutexLock lock(cudaMutex);
  if (cudaChoice == CommBackend::kAuto) chooseCudaBackend(tensor.device());
  if (ncclGroup) return *ncclGroup;
  return *group;
}

void Communicator::Impl::chooseCudaBackend(c10::Device device) {
  if (options.backend == CommBackend::kGloo) {
    cudaChoice = CommBackend::kGloo;
    return;
  }
  if (!hasNccl()) {  // kAuto: connect() refused kNccl
    if (rank == 0) {
      env().log(LogLevel::kInfo,
                "this LibTorch has no NCCL: collectives over CUDA tensors go through Gloo (staged through host "
                "memory)");
    }
    cudaChoice = CommBackend::kGloo;
    return;
  }
  if (std::string shared = ranksSharingAGpu(device); !shared.empty()) {
    const std::string what =
        shared + " use one GPU (" + device.str() + " on " + describeRank(rank) + "), and NCCL needs one GPU per rank";
    COHORT_CHECK(options.backend != CommBackend::kNccl, InvalidArgument, describeRank(rank),
                 ": backend nccl (--backend nccl): ", what,
                 ": give each rank a GPU of its own (--device cuda puts a process on cuda:LOCAL_RANK mod the GPU "
                 "count: at most as many processes per host as GPUs), or use --backend gloo or auto (Gloo, "
                 "staged through host memory)");
    if (rank == 0) {
      env().log(LogLevel::kInfo, what +
                                     ": collectives over CUDA tensors go through Gloo (staged through host memory); "
                                     "give each rank a GPU of its own for NCCL");
    }
    cudaChoice = CommBackend::kGloo;
    return;
  }
  try {
    ncclGroup = nccl::makeGroup(c10::make_intrusive<c10d::PrefixStore>(storePrefix + "/nccl", store),
                                {.rank = rank, .size = size, .timeout = options.timeout, .device = device});
    ncclWatchdog = std::make_shared<WorkWatchdog>(options.timeout);
  } catch (const std::exception& e) {
    fail("forming the NCCL group on " + device.str(), e);
  }
  cudaChoice = CommBackend::kNccl;
}

std::string Communicator::Impl::ranksSharingAGpu(c10::Device device) {
  if (size == 1) return "";
  const std::array<int64_t, 2> mine = nccl::gpuIdentity(device);
  std::vector<std::vector<torch::Tensor>> all(1);
  for (int r = 0; r < size; ++r) all[0].push_back(torch::empty({2}, torch::kInt64));
  std::vector<torch::Tensor> input{torch::tensor({mine[0], mine[1]}, torch::kInt64)};
  try {
    group->allgather(all, input)->wait(options.timeout);
  } catch (const std::exception& e) {
    fail("comparing the ranks' GPUs", e);
  }
  std::map<std::pair<int64_t, int64_t>, std::vector<std::string>> byGpu;
  for (int r = 0; r < size; ++r) {
    const auto* id = all[0][size_t(r)].data_ptr<int64_t>();
    byGpu[{id[0], id[1]}].push_back(describeRank(r));
  }
  for (int r = 0; r < size; ++r) {  // in rank order: the same answer on every rank
    const auto* id = all[0][size_t(r)].data_ptr<int64_t>();
    const auto& names = byGpu[{id[0], id[1]}];
    if (names.size() > 1) return listRanks(names);
  }
  return "";
}

std::shared_ptr<WorkWatchdog> Communicator::Impl::watchdog() {
  MutexLock lock(cudaMutex);
  return ncclWatchdog;
}

void Communicator::Impl::checkNccl(bool drain) {
  std::shared_ptr<WorkWatchdog> watching = watchdog();
  if (!watching) return;
  if (std::optional<WorkWatchdog::Failure> failed = drain ? watching->drain() : watching->failure()) {
    ncclBroken = true;
    fail(failed->op, std::runtime_error(failed->what));
  }
}

void Communicator::Impl::closeNccl() {
  c10::intrusive_ptr<c10d::Backend> nccl;
  std::shared_ptr<WorkWatchdog> watchdog;
  {
    MutexLock lock(cudaMutex);
    nccl = std::move(ncclGroup);
    watchdog = std::move(ncclWatchdog);
  }
  if (!nccl) return;
  // The works still in flight end first (their failure is said here: no operation is left to
  // report it); the watchdog's thread then stops before the group is shut down or aborted.
  if (watchdog) {
    if (std::optional<WorkWatchdog::Failure> failed = watchdog->drain()) {
      ncclBroken = true;
      env().log(LogLevel::kError, describeRank(rank) + ": " + failed->op + " failed after its last wait (" +
                                      firstLine(failed->what) + "): the NCCL group is aborted");
    }
  }
  auto closed = std::make_shared<std::promise<void>>();
  std::future<void> done = closed->get_future();
  std::thread([nccl = std::move(nccl), watchdog = std::move(watchdog), broken = ncclBroken.load(), closed,
               &env = env()]() mutable {
    watchdog.reset();  // nothing polls the group while it closes
    try {
      if (broken) {
        nccl->abort();
      } else {
        nccl->shutdown();
      }
    } catch (const std::exception& e) {
      env.log(LogLevel::kWarning, "closing the NCCL group: " + firstLine(e.what()));
    }
    closed->set_value();
  }).detach();
  if (done.wait_for(options.timeout) != std::future_status::ready) {
    env().log(LogLevel::kWarning, describeRank(rank) + ": closing the NCCL group did not end within " +
                                      std::to_string(options.timeout.count() / 1000) +
                                      " s (a peer gone?): left behind");
  }
}

}  // namespace cohort
