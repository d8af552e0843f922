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
//     for them). Communicator::connect sets it, for the whole process, before any group. It also
//     makes a work's wait() and synchronize() hold the host until the work is done, so cohort calls
//     neither: it waits through the work's future (below).
//   - cohort waits itself, as the DDP reducer does: the caller's stream waits for NCCL's stream
//     (the work's future, completed at launch with an event on NCCL's stream) and the host goes on; the communicator's
//     WorkWatchdog (work_watchdog.h) checks each work until done or the communicator's timeout, aborts the NCCL
//     communicator of one that failed or timed out (ncclCommAbort, so that no kernel spins on the GPU forever), and the
//     next operation turns the failure into cohort's error naming the lost rank (Communicator::Impl::fail).
// What is not bounded: ncclCommInitRank itself, when a peer dies after the unique id went through
// the store and before it joined (the store's waits before it are bounded).
#include "comm/nccl.h"

#include <cohort/comm_backend.h>
#include <cohort/error.h>

#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace cohort {

bool hasNccl() { return true; }

namespace nccl {

c10::intrusive_ptr<c10d::Backend> makeGroup(c10::intrusive_ptr<c10d::Store> store, const GroupOptions& options) {
  // c10d's Options embed nccl.h's ncclConfig_t, whose size changes between NCCL versions: the
  // nccl.h compiled here must be the one LibTorch was built with (torch::cuda::nccl::version() is
  // that version, a constant in libtorch_cuda.so).
  const uint64_t built = torch::cuda::nccl::version();
  const uint64_t here = (uint64_t(NCCL_MAJOR) << 32) | (uint64_t(NCCL_MINOR) << 16) | uint64_t(NCCL_PATCH);
  COHORT_CHECK((built >> 16) == (here >> 16), InvalidArgument, "cohort was compiled with nccl.h ", NCCL_MAJOR, ".",
               NCCL_MINOR, ".", NCCL_PATCH, " and its LibTorch with NCCL ", built >> 32, ".", (built >> 16) & 0xffff, ".",
               built & 0xffff, ": rebuild cohort with -DNCCL_INCLUDE_DIR naming the headers of LibTorch's NCCL (the "
               "wheel's nvidia/nccl/include), or use --backend gloo");
  // TORCH_NCCL_BLOCKING_WAIT, which ProcessGroupNCCL's constructor reads, was set by
  // Communicator::connect before any group of this process (setTorchsEnvironmentOnce).
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

}  // namespace nccl
}  // namespace cohort
