#!/bin/bash
# The lock check (cmake/CohortCheckLocks.cmake) covers every file that locks, and has teeth:
#  - every .cpp of src/ has passed it in this build (a stamp in BUILD/check_locks);
#  - no file of src/ locks with the std types, which the analysis cannot see, but the wrappers
#    themselves (base/thread_annotations.h) and torch's generator lock (models/cpu_generator.h);
#  - the build's own clang command for a file passes it as it is, and refuses a copy with the
#    file's first MutexLock taken out, naming the member then touched without its mutex: in a torch
#    layer (through the precompiled torch) and in a torch-free one.
set -euo pipefail
build=$1
source_dir=$2
clang=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

missing=0
# A build without NCCL (CMake's COHORT_NCCL OFF) has no nccl.h to parse src/comm/nccl.cpp with.
no_nccl='^$'
if grep -q '^COHORT_NCCL:BOOL=OFF' "$build/CMakeCache.txt" 2>/dev/null; then no_nccl='^src/comm/nccl\.cpp$'; fi
while IFS= read -r file; do
  if [[ "$file" =~ $no_nccl ]]; then continue; fi
  if [ ! -e "$build/check_locks/$file.stamp" ]; then
    echo "FAIL: $file has not passed the lock check (no target runs cohort_check_locks on it)" >&2
    missing=1
  fi
done < <(cd "$source_dir" && find src -name '*.cpp' ! -path src/pch.cpp | sort)  # pch.cpp: torch's headers only
[ "$missing" -eq 0 ]

if grep -rnE 'std::(mutex|recursive_mutex|timed_mutex|shared_mutex|lock_guard|unique_lock|scoped_lock|shared_lock|condition_variable)\b' \
     "$source_dir/src" --include='*.cpp' --include='*.h' |
     grep -vE '^[^:]*/src/(base/thread_annotations\.h|models/cpu_generator\.h):' > "$work/std_locks"; then
  echo "FAIL: these lock with the std types, which clang's analysis cannot see; use Mutex, MutexLock" \
       "and CondVar (src/base/thread_annotations.h) with GUARDED_BY:" >&2
  cat "$work/std_locks" >&2
  exit 1
fi

# expect_refused TARGET FILE: FILE (of src/, compiled in TARGET) passes TARGET's check as it is, and
# fails it, naming a mutex, with its first MutexLock line deleted.
expect_refused() {
  local rsp="$build/check_locks/$1.rsp" file=$2
  "$clang" "@$rsp" "$source_dir/$file" || {
    echo "FAIL: the lock check refuses $file as it is" >&2
    exit 1
  }
  mkdir -p "$work/$(dirname "$file")"
  sed '0,/^ *MutexLock [a-zA-Z]*(.*);/{//d}' "$source_dir/$file" > "$work/$file"
  if cmp -s "$source_dir/$file" "$work/$file"; then
    echo "FAIL: $file has no MutexLock line to take out" >&2
    exit 1
  fi
  if "$clang" "@$rsp" "$work/$file" 2> "$work/err"; then
    echo "FAIL: the lock check accepted $file with its first MutexLock taken out" >&2
    exit 1
  fi
  grep -q "requires holding mutex .*\[-Werror,-Wthread-safety-analysis\]" "$work/err" || {
    echo "FAIL: the lock check refused $file without its first MutexLock, but not for the lock:" >&2
    cat "$work/err" >&2
    exit 1
  }
}

expect_refused cohort_comm src/comm/job.cpp
expect_refused cohort_ps src/ps/call_auth.cpp
echo "check_locks: every file of src/ passed; both files without a lock were refused"
