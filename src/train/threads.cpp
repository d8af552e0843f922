#include "train/threads.h"

#include <dlfcn.h>

#include <torch/torch.h>

#include <thread>

namespace cohort {

int setComputeThreads(int threads) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(threads);
  // OpenBLAS (libopenblas0-pthread, behind libblas.so.3) keeps its own pool.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(threads);
  return threads;
}

}  // namespace cohort
