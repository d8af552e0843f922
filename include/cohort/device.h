// Where a job's model and tensors live: the CPU or one CUDA device.
//
//   c10::Device d = cohort::resolveDevice("cuda", job.cluster().localRank);   // cuda:LOCAL_RANK mod count
//   net->to(d);
//
// Names: "auto" (or ""): the local rank's GPU when this LibTorch has CUDA and the process sees a
// GPU, else the CPU; "cpu"; "cuda": the local rank's GPU, cuda:(localRank mod device count), so that
// the processes of one host spread over its GPUs as torchrun's do; "cuda:N".
#pragma once

#include <cohort/export.h>

#include <c10/core/Device.h>

#include <string>

namespace cohort {

// Parses `name` and checks it against this machine and this LibTorch. Throws InvalidArgument naming
// the problem and the fix: CUDA asked for where this LibTorch has none or the process sees no GPU,
// an index past the GPUs it sees, a name that is none of the above.
COHORT_API c10::Device resolveDevice(const std::string& name, int localRank = 0);

// The CUDA devices this process sees (0 when this LibTorch has no CUDA or there is no GPU).
COHORT_API int cudaDeviceCount();

// Whether `name` asks for a device explicitly ("cpu", "cuda", "cuda:N"), not "auto" or "".
COHORT_API bool isExplicitDevice(const std::string& name);

}  // namespace cohort
