#pragma once

namespace cohort {

// Sets the intra-op thread count of libtorch (OpenMP) and of OpenBLAS, which libtorch calls for
// dense layers but does not configure. threads <= 0: defaultComputeThreads(1), the idle cores.
// Returns the count set.
int setComputeThreads(int threads);

}  // namespace cohort
