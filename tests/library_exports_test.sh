#!/bin/bash
# libcohort.so exports cohort's public API and nothing else (include/cohort/export.h,
# cmake/libcohort.map): every defined dynamic symbol is of namespace cohort, none of cohort's
# internal namespaces or of src/'s classes (a public class's Impl included) is among them, and the
# public classes are.
set -euo pipefail
library=$1
symbols=$(nm -D --defined-only -C "$library" | cut -d' ' -f3-)
count=$(printf '%s\n' "$symbols" | wc -l)
echo "libcohort exports $count symbols"
foreign=$(printf '%s\n' "$symbols" | grep -Ev '^(cohort::|typeinfo for cohort::|typeinfo name for cohort::|vtable for cohort::|VTT for cohort::)' \
          | grep -Ev '^(_init|_fini|_edata|_end|__bss_start)$' || true)
if [ -n "$foreign" ]; then
  echo "FAIL: libcohort exports names outside namespace cohort:" >&2
  printf '%s\n' "$foreign" | head -20 >&2
  exit 1
fi
internal=$(printf '%s\n' "$symbols" | grep -E 'cohort::(ps|gossip|compress|sim|experiment|test)::|cohort::(Trainer|Strategy|Peer|Shard)\b|::(Impl|State)::' || true)
if [ -n "$internal" ]; then
  echo "FAIL: libcohort exports internal names:" >&2
  printf '%s\n' "$internal" | head -20 >&2
  exit 1
fi
for api in 'cohort::DataParallel::DataParallel(' 'cohort::Job::fromEnvironment(' 'cohort::ParameterServerClient::step(' \
           'cohort::Gossip::step(' 'cohort::loadData(' 'cohort::makeModel(' 'typeinfo for cohort::InvalidArgument' \
           'cohort::HostPort::str' 'cohort::TensorParallel::' 'cohort::Mirrored::' \
           'cohort::Pipeline::step('; do
  # A here-string, not a pipe: grep -q stops reading at the first match, and with pipefail the
  # writer's SIGPIPE would fail the check (as it did, now and then, under load).
  grep -qF "$api" <<< "$symbols" || { echo "FAIL: libcohort does not export $api" >&2; exit 1; }
done
echo "libcohort: only cohort:: public names are exported"
