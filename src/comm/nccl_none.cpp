// Stands in for nccl.cpp where this LibTorch has no c10d ProcessGroupNCCL, or the build found no
// nccl.h (CMake's COHORT_NCCL is OFF): collectives over CUDA tensors go through Gloo, and
// --backend nccl / CommBackend::kNccl is refused when the communicator is made
// (Communicator::connect), so nothing below is ever reached.
#include "comm/nccl.h"

#include <cohort/comm_backend.h>
#include <cohort/error.h>

namespace cohort {

bool hasNccl() { return false; }

namespace nccl {

namespace {

[[noreturn]] void unavailable() {
  throw InvalidArgument("this cohort was built without NCCL (its LibTorch has no c10d ProcessGroupNCCL, or CMake "
                        "found no nccl.h): use the gloo backend, or rebuild against a LibTorch with NCCL");
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> makeGroup(c10::intrusive_ptr<c10d::Store>, const GroupOptions&) { unavailable(); }

std::array<int64_t, 2> gpuIdentity(c10::Device) { unavailable(); }

}  // namespace nccl
}  // namespace cohort
