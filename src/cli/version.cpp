// `cohort --version`: what a user asks first on a new machine (is this the LibTorch I meant? does
// it see my GPUs? is NCCL in?), answered without a GPU or a driver being needed to ask.
#include "cli/commands.h"
#include "compress/codec.h"
#include <cohort/comm_backend.h>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <sstream>

// COHORT_VERSION comes from CMake's project() unquoted (0.1.0), so that every compiler that reads
// this file (the lock check's clang too) gets the same definition.
#define COHORT_STRINGIZE_(x) #x
#define COHORT_STRINGIZE(x) COHORT_STRINGIZE_(x)

namespace cohort::cli {

std::string versionText() {
  std::ostringstream out;
  out << "cohort " << COHORT_STRINGIZE(COHORT_VERSION) << "\n";
  out << "LibTorch " << TORCH_VERSION;
  // hasCUDART: LibTorch's CUDA library is loaded (a CUDA build), whether or not a GPU or driver is.
  const at::CUDAHooksInterface& cuda = at::detail::getCUDAHooks();
  if (cuda.hasCUDART()) {
    const long runtime = cuda.versionCUDART();  // 13000: 13.0
    out << ", built for CUDA " << runtime / 1000 << "." << runtime % 1000 / 10;
    if (const long cudnn = cuda.versionCuDNN(); cudnn > 0) {  // 91900: 9.19.0
      out << " and cuDNN " << cudnn / 10000 << "." << cudnn % 10000 / 100 << "." << cudnn % 100;
    }
    const int devices = int(torch::cuda::device_count());
    if (devices > 0) {
      out << "; " << devices << " CUDA device" << (devices > 1 ? "s" : "") << " visible (--device auto trains on cuda:"
          << "LOCAL_RANK mod " << devices << ")\n";
    } else {
      out << "; no CUDA device visible (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them): --device auto "
             "trains on the CPU\n";
    }
  } else {
    out << ", for the CPU only (no CUDA in this LibTorch)\n";
  }
  out << "NCCL: "
      << (hasNccl() ? "built in (--backend auto carries collectives over CUDA tensors through it)"
                    : "not built in (collectives over CUDA tensors go through Gloo)")
      << "\n";
  out << "codec kernels: "
      << (compress::vectorConversions() ? "AVX2 and F16C" : "scalar (this CPU lacks AVX2 or F16C, or they are off)");
  return out.str();
}

}  // namespace cohort::cli
