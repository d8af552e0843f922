// The state of torch's default CPU generator, read and set under the generator's own mutex, as
// torch asks of whoever touches a generator (at::Generator::mutex(); torch's get_rng_state and
// set_rng_state do the same). The mutex is torch's and unannotated, and what it guards lives in
// torch, so clang's thread-safety analysis cannot check it: these two functions are the one place
// cohort takes it.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>

#include <mutex>

namespace cohort {

inline at::Tensor cpuGeneratorState() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline void setCpuGeneratorState(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace cohort
