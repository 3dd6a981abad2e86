#!/usr/bin/env bash
# Run the Criterion test binary with a bounded time. Prints every line but the per-test RUN/PASS
# noise: failures, assertion messages and each skipped test with its reason ([SKIP] lines: CUDA
# tests without a usable device, trace tests without the trace), then the skip count, then
# Criterion's own "Synthesis" line last. Exits with the binary's status.
set -uo pipefail
bin=${1:?usage: run-tests.sh TEST_BINARY}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
timeout --foreground 1200 "$bin" --jobs "${KM_TEST_JOBS:-2}" --verbose ${KM_TEST_ARGS:-} >"$log" 2>&1
status=$?
grep -v -E '^\[(RUN |PASS)\] |Synthesis' "$log"
echo "$(grep -c '^\[SKIP\]' "$log") test(s) skipped, listed above with the reason"
grep 'Synthesis' "$log" | tail -n 1
[ "$status" -eq 124 ] && echo "run-tests: $bin timed out" >&2
exit "$status"
