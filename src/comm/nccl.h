// c10d's ProcessGroupNCCL behind c10d's Backend interface, so that NCCL's and CUDA's headers stay
// in one translation unit: nccl.cpp where this LibTorch has NCCL, nccl_none.cpp (which forms no
// group and says why) where it has not. CMake picks one of the two (COHORT_NCCL).
//
// The group is c10d's, with cohort's error policy imposed on it (nccl.cpp says how): no c10d
// watchdog thread and no heartbeat monitor that could take the process down; every wait is
// cohort's own (the communicator's WorkWatchdog, work_watchdog.h), bounded by its timeout.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <chrono>
#include <cstdint>

namespace cohort::nccl {

struct GroupOptions {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{60000};
  c10::Device device{c10::kCUDA, 0};  // this rank's GPU; its NCCL communicator is formed at once
};

// Forms an NCCL group of `size` ranks over `store` (a prefix of the job's store of its own): every
// rank of the group calls it, each with its own GPU. Throws what c10d and NCCL throw (a peer that
// never comes: the store's TimeoutError).
c10::intrusive_ptr<c10d::Backend> makeGroup(c10::intrusive_ptr<c10d::Store> store, const GroupOptions& options);

// The physical GPU behind `device` (its UUID, 16 bytes as two integers): equal in two processes
// exactly when they use the same GPU, whatever CUDA_VISIBLE_DEVICES numbers it as.
std::array<int64_t, 2> gpuIdentity(c10::Device device);

}  // namespace cohort::nccl
