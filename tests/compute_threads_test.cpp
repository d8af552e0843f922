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

}  // namespace
}  // namespace cohort
