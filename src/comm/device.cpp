#include <cohort/device.h>
#include <cohort/error.h>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

namespace cohort {

namespace {

// Whether this LibTorch was built with CUDA (libtorch_cuda registered its hooks), whether or not
// this machine has a GPU; at::hasCUDA() is false on a machine without one either way.
bool builtWithCuda() { return at::detail::getCUDAHooks().isBuilt(); }

}  // namespace

int cudaDeviceCount() { return builtWithCuda() ? int(torch::cuda::device_count()) : 0; }

bool isExplicitDevice(const std::string& name) { return !name.empty() && name != "auto"; }

namespace {

std::string visibleDevicesNote() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return visible == nullptr ? std::string("CUDA_VISIBLE_DEVICES is unset")
                            : "CUDA_VISIBLE_DEVICES=\"" + std::string(visible) + "\"";
}

// The GPU index in "cuda:N", or -1 for "cuda"; throws for anything else after "cuda:".
int parseIndex(const std::string& name) {
  if (name == "cuda") return -1;
  const std::string digits = name.size() > 5 && name[4] == ':' ? name.substr(5) : "";
  const bool ok = !digits.empty() && digits.size() <= 4 && digits.find_first_not_of("0123456789") == std::string::npos;
  COHORT_CHECK(ok, InvalidArgument, "device \"", name, "\": expected cpu, cuda, cuda:N (N a GPU index) or auto");
  return std::stoi(digits);
}

}  // namespace

c10::Device resolveDevice(const std::string& name, int localRank) {
  COHORT_CHECK(localRank >= 0, InvalidArgument, "resolveDevice: the local rank must be >= 0, got ", localRank);
  if (name == "cpu") return c10::Device(c10::kCPU);
  const bool automatic = !isExplicitDevice(name);
  COHORT_CHECK(automatic || name.rfind("cuda", 0) == 0, InvalidArgument, "device \"", name,
               "\": expected cpu, cuda, cuda:N (N a GPU index) or auto");
  const int index = automatic ? -1 : parseIndex(name);
  const int count = cudaDeviceCount();  // asks the driver: once
  if (automatic && count == 0) return c10::Device(c10::kCPU);
  COHORT_CHECK(builtWithCuda(), InvalidArgument, "device \"", name,
               "\": this LibTorch was built without CUDA; use --device cpu, or build cohort against a CUDA "
               "LibTorch (scripts/setup.sh installs PyPI's torch==2.11.0, built for CUDA 13.0)");
  COHORT_CHECK(count > 0, InvalidArgument, "device \"", name, "\": this process sees no CUDA device (",
               visibleDevicesNote(), "; no GPU, or a driver too old for CUDA 13.0, which needs 580 or later); "
               "use --device cpu, or run where an NVIDIA GPU and its driver are");
  if (index < 0) return c10::Device(c10::kCUDA, c10::DeviceIndex(localRank % count));
  COHORT_CHECK(index < count, InvalidArgument, "device \"", name, "\": this process sees ", count, " CUDA device",
               count == 1 ? "" : "s", " (cuda:0", count == 1 ? "" : " to cuda:" + std::to_string(count - 1), "; ",
               visibleDevicesNote(), "); name one of them, or cuda for the local rank's");
  return c10::Device(c10::kCUDA, c10::DeviceIndex(index));
}

}  // namespace cohort
