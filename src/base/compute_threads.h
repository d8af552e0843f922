// The thread pools of the math libraries libtorch calls but does not configure for cohort:
// OpenMP's (libtorch's intra-op threads; the count is per calling thread) and OpenBLAS's (one
// pool a process, behind libblas.so.3 for dense layers). Looked up with dlsym at run time:
// libtorch links them, cohort does not, and where one is missing its calls do nothing.
#pragma once

#include <chrono>
#include <optional>

namespace cohort {

// The cores this process may run on (its affinity mask) that were idle over `window`, from
// /proc/stat's per-CPU counters: 1.9 when two are nearly free, 1.0 beside one busy neighbour.
// nullopt where /proc/stat cannot be read. Sleeps for the window.
std::optional<double> idleCores(std::chrono::milliseconds window);

// Intra-op threads for each of `processes` processes about to start on this host when none is
// asked for: the idle cores (idleCores over 100 ms, their sum rounded down once it is within a
// quarter of a core of the next whole one) shared among them, at least 1; all the cores of the
// affinity mask, shared, where /proc/stat cannot be read. For a launcher, before any of them runs.
// A thread on a core a neighbour keeps busy makes every parallel region wait for its time slice:
// on a 2-core machine beside one spinning process, 2 threads ran the mlp at a third of 1 thread's
// speed (docs/BENCHMARKS.md, "Threads").
int defaultComputeThreads(int processes);

// The same for one of `processes` processes of this host that may already be running beside it
// (a rank under Slurm or mpirun): its share of the cores, cores / processes, but no more than the
// idle cores, which its running siblings have already taken from.
int defaultComputeThreadsBeside(int processes);

// OMP_NUM_THREADS's value as OpenMP reads it for the outermost level: the first count of its
// list ("4", or "4,2" for nested levels), spaces around it allowed. nullopt where `text` is null,
// empty, or not a count from 1 to 65536 ("0", "-2", "four", "4x").
std::optional<int> parseOmpNumThreads(const char* text);

// parseOmpNumThreads of this process's OMP_NUM_THREADS: what cohort launch, mpirun or Slurm gave
// this process as its share of the host's cores. One reading for every caller, so that "4,2" is 4
// for the trainer, the evaluator and the replica schemes alike.
std::optional<int> ompNumThreadsFromEnvironment();

// omp_set_num_threads: the OpenMP threads of the calling thread's parallel regions.
void setOpenMpThreads(int threads);

// openblas_get_num_threads; 0 without OpenBLAS.
int openBlasThreads();

// openblas_set_num_threads: the process's OpenBLAS pool.
void setOpenBlasThreads(int threads);

}  // namespace cohort
