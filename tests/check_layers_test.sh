#!/bin/bash
# The include-order check (scripts/check_layers.py) passes on the tree and fails, naming the file
# and the line, on a copy of it with one upward include planted: in src/base/, and in a public
# header (consumers have no src/).
set -euo pipefail
source_dir=$1
python=${2:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" "$source_dir/scripts/check_layers.py" "$source_dir"

# expect_refused FILE INCLUDE MESSAGE: FILE (relative to the tree) with INCLUDE appended must fail
# the check with MESSAGE (a grep pattern; @LINE@ stands for the planted line's number).
expect_refused() {
  rm -rf "$work/tree"
  mkdir -p "$work/tree"
  cp -r "$source_dir/src" "$source_dir/include" "$work/tree/"
  echo "#include \"$2\"" >> "$work/tree/$1"
  local line
  line=$(wc -l < "$work/tree/$1")
  if "$python" "$source_dir/scripts/check_layers.py" "$work/tree" 2> "$work/err"; then
    echo "FAIL: the check accepted $1 including $2" >&2
    exit 1
  fi
  grep -q "${3//@LINE@/$line}" "$work/err" || {
    echo "FAIL: the check's message does not name $1 including $2:" >&2
    cat "$work/err" >&2
    exit 1
  }
}

expect_refused src/base/crypto.cpp strategy/strategy.h \
  "src/base/crypto.cpp:@LINE@: layer base includes strategy/strategy.h of layer strategy"
expect_refused include/cohort/job.h base/crypto.h \
  "include/cohort/job.h:@LINE@: a public header includes base/crypto.h"
echo "check_layers: the tree passes; both planted includes were refused"
