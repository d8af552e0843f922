// What the tests that need a GPU share (labels gpu and multigpu; scripts/gpu-check.sh runs them).
#pragma once

#include <cohort/device.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <string>

// Without a GPU the test fails at once, naming what is missing: a test that cannot run fails loudly.
#define REQUIRE_GPU()                                                                                    \
  ASSERT_GT(cudaDeviceCount(), 0) << "this test needs a CUDA GPU and this process sees none (label gpu: " \
                                     "run it through scripts/gpu-check.sh on a machine that has one)"
#define REQUIRE_TWO_GPUS()                                                                                       \
  ASSERT_GE(cudaDeviceCount(), 2) << "this test needs two CUDA GPUs and this process sees " << cudaDeviceCount() \
                                  << " (label multigpu: run it where a machine has two or more)"
#define REQUIRE_NCCL() \
  ASSERT_TRUE(hasNccl()) << "this cohort was built without NCCL (CMake's COHORT_NCCL is OFF): nothing to test"

namespace cohort::test {

// "cuda:0 [4] {1, 2, 3, 4}": where a tensor is, its shape and its first values, for messages.
inline std::string showTensor(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.device() << " " << t.sizes() << " {";
  auto flat = t.detach().to(torch::kCPU, torch::kDouble).flatten();
  for (int64_t i = 0; i < std::min<int64_t>(flat.numel(), 6); ++i) out << (i ? ", " : "") << flat[i].item<double>();
  out << (flat.numel() > 6 ? ", ...}" : "}");
  return out.str();
}

}  // namespace cohort::test
