// The thread pools of the math libraries libtorch calls but does not configure for cohort:
// OpenMP's (libtorch's intra-op threads; the count is per calling thread) and OpenBLAS's (one
// pool a process, behind libblas.so.3 for dense layers). Looked up with dlsym at run time:
// libtorch links them, cohort does not, and where one is missing its calls do nothing.
#pragma once

namespace cohort {

// omp_set_num_threads: the OpenMP threads of the calling thread's parallel regions.
void setOpenMpThreads(int threads);

// openblas_get_num_threads; 0 without OpenBLAS.
int openBlasThreads();

// openblas_set_num_threads: the process's OpenBLAS pool.
void setOpenBlasThreads(int threads);

}  // namespace cohort
