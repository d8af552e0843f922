#include "train/threads.h"

#include "base/compute_threads.h"

#include <torch/torch.h>

#include <thread>

namespace cohort {

int setComputeThreads(int threads) {
  if (threads <= 0) threads = defaultComputeThreads(1);
  torch::set_num_threads(threads);
  setOpenBlasThreads(threads);  // OpenBLAS keeps its own pool
  return threads;
}

}  // namespace cohort
