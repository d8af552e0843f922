// base/compute_threads.h: the calls do nothing where a library is missing, and reach OpenBLAS and
// OpenMP once the process has them (loaded here as libtorch loads them, by the dynamic linker).
#include "base/compute_threads.h"

#include <gtest/gtest.h>

#include <dlfcn.h>

namespace cohort {
namespace {

// Both in one test: base_tests links neither library, and a library once loaded stays loaded.
TEST(ComputeThreads, DoNothingWithoutTheLibrariesAndReachThemOnceLoaded) {
  EXPECT_EQ(openBlasThreads(), 0);
  setOpenBlasThreads(2);  // no OpenBLAS: nothing happens
  setOpenMpThreads(2);    // no OpenMP: nothing happens

  ASSERT_NE(::dlopen("libopenblas.so.0", RTLD_NOW | RTLD_GLOBAL), nullptr) << ::dlerror();
  setOpenBlasThreads(3);
  EXPECT_EQ(openBlasThreads(), 3);
  setOpenBlasThreads(1);
  EXPECT_EQ(openBlasThreads(), 1);

  ASSERT_NE(::dlopen("libgomp.so.1", RTLD_NOW | RTLD_GLOBAL), nullptr) << ::dlerror();
  using GetFn = int (*)();
  auto maxThreads = reinterpret_cast<GetFn>(::dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  ASSERT_NE(maxThreads, nullptr);
  setOpenMpThreads(3);
  EXPECT_EQ(maxThreads(), 3);  // this thread's count
}

// One reading of OMP_NUM_THREADS for the trainer, the evaluator and the replica schemes: the
// trainer's atoi once read "4,2" as 4 and the replica schemes' strtol read it as no value at all.
TEST(ComputeThreads, OmpNumThreadsIsTheFirstCountOfItsList) {
  EXPECT_EQ(parseOmpNumThreads("4"), 4);
  EXPECT_EQ(parseOmpNumThreads("4,2"), 4);
  EXPECT_EQ(parseOmpNumThreads(" 3 "), 3);
  EXPECT_EQ(parseOmpNumThreads("65536"), 65536);
  for (const char* bad : {"", " ", "0", "-2", "four", "4x", "4 2", ",4", "65537", "99999999999999999999"}) {
    EXPECT_EQ(parseOmpNumThreads(bad), std::nullopt) << "'" << bad << "'";
  }
  EXPECT_EQ(parseOmpNumThreads(nullptr), std::nullopt);
}

}  // namespace
}  // namespace cohort
