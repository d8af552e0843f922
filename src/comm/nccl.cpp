// The NCCL process group (nccl.h), compiled where this LibTorch has c10d's ProcessGroupNCCL and the
// build found nccl.h (CMake's COHORT_NCCL; nccl_none.cpp otherwise). The only file of cohort that
// sees NCCL's and c10d's NCCL headers.
//
// c10d's error handling, and what cohort makes of it (LibTorch 2.11's ProcessGroupNCCL):
//   - By default a watchdog thread checks every collective; on an NCCL error or a timeout it
//     waits for debug dumps (4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, a minute), then rethrows on
//     its own thread, which ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING's default, 3,
//     SkipCleanUp), and a heartbeat monitor ends it too when the watchdog stalls for
//     TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes). Neither is cohort's error policy: a library
//     never ends its caller's process, and a lost peer is named by cohort within --timeout.
//   - With TORCH_NCCL_BLOCKING_WAIT=1 the group starts neither thread (nor keeps a list of works
//     for them), and failures surface where the caller waits. makeGroup sets it, for the whole
//     process, before the first group is made.
//   - cohort waits itself (waitForWork): the caller's stream waits for NCCL's stream, the thread
//     polls the work until done or the communicator's timeout, and a timed-out or failed work
//     aborts its NCCL communicator (ncclCommAbort, so that no kernel spins on the GPU forever)
//     before Communicator::Impl::fail turns the failure into cohort's error naming the lost rank.
// What is not bounded: ncclCommInitRank itself, when a peer dies after the unique id went through
// the store and before it joined (the store's waits before it are bounded).
#include "comm/nccl.h"

#include <cohort/comm_backend.h>
#include <cohort/error.h>

#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace cohort {

bool hasNccl() { return true; }

namespace nccl {

namespace {

using Clock = std::chrono::steady_clock;

// Polling: yield for the first 200 us (a bucket's allreduce that is nearly done), then sleep from
// 10 us doubling to 500 us: a wait costs at most about half a millisecond more than the work.
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr auto kFirstSleep = std::chrono::microseconds(10);
constexpr auto kLongestSleep = std::chrono::microseconds(500);

}  // namespace

c10::intrusive_ptr<c10d::Backend> makeGroup(c10::intrusive_ptr<c10d::Store> store, const GroupOptions& options) {
  // Read by ProcessGroupNCCL's constructor. Set once, before any group of this process exists (a
  // setenv racing c10d's getenv of another group's construction would be undefined).
  // c10d's Options embed nccl.h's ncclConfig_t, whose size changes between NCCL versions: the
  // nccl.h compiled here must be the one LibTorch was built with (torch::cuda::nccl::version() is
  // that version, a constant in libtorch_cuda.so).
  const uint64_t built = torch::cuda::nccl::version();
  const uint64_t here = (uint64_t(NCCL_MAJOR) << 32) | (uint64_t(NCCL_MINOR) << 16) | uint64_t(NCCL_PATCH);
  COHORT_CHECK((built >> 16) == (here >> 16), InvalidArgument, "cohort was compiled with nccl.h ", NCCL_MAJOR, ".",
               NCCL_MINOR, ".", NCCL_PATCH, " and its LibTorch with NCCL ", built >> 32, ".", (built >> 16) & 0xffff, ".",
               built & 0xffff, ": rebuild cohort with -DNCCL_INCLUDE_DIR naming the headers of LibTorch's NCCL (the "
               "wheel's nvidia/nccl/include), or use --backend gloo");
  static std::once_flag blockingWait;
  std::call_once(blockingWait, [] { ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/1); });
  auto groupOptions = c10d::ProcessGroupNCCL::Options::create();
  groupOptions->timeout = options.timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), options.rank, options.size, groupOptions);
  // The NCCL communicator now (ncclCommInitRank through the store), rather than inside the first
  // collective: a failure to form it is reported as such.
  group->eagerConnectSingleDevice(options.device);
  return group;
}

std::array<int64_t, 2> gpuIdentity(c10::Device device) {
  const cudaDeviceProp* properties = at::cuda::getDeviceProperties(device.index());
  std::array<int64_t, 2> id{};
  static_assert(sizeof(properties->uuid.bytes) == sizeof(id));
  std::memcpy(id.data(), properties->uuid.bytes, sizeof(id));
  return id;
}

void waitForWork(c10d::Work& work, std::chrono::milliseconds timeout) {
  work.synchronize();  // the caller's current stream waits for NCCL's (no host synchronization)
  const auto start = Clock::now();
  auto pause = kFirstSleep;
  // isCompleted() also asks NCCL for the communicator's asynchronous error (a peer lost, a
  // network failure): the work then counts as completed, with an exception.
  while (!work.isCompleted()) {
    const auto waited = Clock::now() - start;
    if (waited >= timeout) {
      work.abort();
      throw std::runtime_error("NCCL did not complete it within " + std::to_string(timeout.count()) +
                               " ms (timed out)");
    }
    if (waited < kSpin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, kLongestSleep);
    }
  }
  if (std::exception_ptr error = work.exception()) {
    work.abort();
    std::rethrow_exception(error);
  }
}

}  // namespace nccl
}  // namespace cohort
