#include "base/compute_threads.h"

#include <dlfcn.h>

namespace cohort {

namespace {

template <typename Fn>
Fn lookUp(const char* name) {
  return reinterpret_cast<Fn>(::dlsym(RTLD_DEFAULT, name));
}

}  // namespace

void setOpenMpThreads(int threads) {
  if (auto fn = lookUp<void (*)(int)>("omp_set_num_threads")) fn(threads);
}

int openBlasThreads() {
  auto fn = lookUp<int (*)()>("openblas_get_num_threads");
  return fn ? fn() : 0;
}

void setOpenBlasThreads(int threads) {
  if (auto fn = lookUp<void (*)(int)>("openblas_set_num_threads")) fn(threads);
}

}  // namespace cohort
