// Which library carries a communicator's collectives over CUDA tensors (CommOptions::backend,
// JobOptions::backend, `cohort train --backend`). Torch-free.
//
//   kAuto  NCCL when this build has it and every rank of the group has a GPU of its own; Gloo
//          otherwise (ranks sharing a GPU: NCCL refuses them), said once on stderr.
//   kNccl  NCCL, or an InvalidArgument naming the fix where it cannot be (no NCCL in this build,
//          ranks sharing a GPU).
//   kGloo  Gloo, which stages CUDA tensors through host memory.
// CPU tensors, the control traffic (barriers, bytes, counts) and the rendezvous store always go
// through Gloo and cohort's store, whatever the backend.
#pragma once

#include <cohort/export.h>

#include <string>

namespace cohort {

enum class CommBackend { kAuto, kNccl, kGloo };

// "auto", "nccl", "gloo".
COHORT_API std::string commBackendName(CommBackend backend);
// The inverse; throws InvalidArgument naming the accepted names.
COHORT_API CommBackend parseCommBackend(const std::string& name);

// Whether this build of cohort can carry collectives over NCCL: its LibTorch has c10d's
// ProcessGroupNCCL (the PyPI wheel does), and the build found nccl.h (CMake's COHORT_NCCL).
COHORT_API bool hasNccl();

}  // namespace cohort
