// Locks clang can check (-Wthread-safety), as leveldb and abseil do: a member says which mutex
// guards it (GUARDED_BY), a method which mutex it needs (REQUIRES). The macros are no-ops on
// compilers without the analysis (gcc); every build parses each file of src/ once more with clang
// (cmake/CohortCheckLocks.cmake), which turns violations into errors.
//
// libstdc++'s std::mutex carries no annotations, so the analysis cannot see it: code that wants
// its locks checked uses Mutex, MutexLock and CondVar below, thin wrappers over the std types.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define COHORT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define COHORT_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) COHORT_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY COHORT_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) COHORT_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) COHORT_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) COHORT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) COHORT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) COHORT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) COHORT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) COHORT_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS COHORT_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace cohort {

class CondVar;

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis that the caller holds this mutex where it cannot see it: in a lambda
  // called under the lock (clang analyses a lambda's body on its own).
  void assertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// A condition variable for a Mutex the caller holds; every wait is bounded (STYLE.md rule 5), and
// the mutex is held again when it returns.
class CondVar {
 public:
  template <typename Rep, typename Period>
  std::cv_status waitFor(Mutex& mu, std::chrono::duration<Rep, Period> timeout) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const std::cv_status status = cv_.wait_for(lock, timeout);
    lock.release();  // still held: the caller's MutexLock releases it
    return status;
  }
  template <typename Clock, typename Duration>
  std::cv_status waitUntil(Mutex& mu, std::chrono::time_point<Clock, Duration> until) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const std::cv_status status = cv_.wait_until(lock, until);
    lock.release();
    return status;
  }
  void notifyOne() { cv_.notify_one(); }
  void notifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace cohort
