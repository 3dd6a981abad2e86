#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run the Criterion test binary with a bounded time. Prints every line but the per-test RUN/PASS
# noise: failures, assertion messages and each skipped test with its reason ([SKIP] lines: CUDA
# tests without a usable device, trace tests without the trace), then the skip count, then the
# failures again in brief, then Criterion's own "Synthesis" line last. Exits with the binary's
# status.
set -uo pipefail
bin=${1:?usage: run-tests.sh TEST_BINARY}
# Tests that run the CLI use the kvmatch binary built beside this test binary (so `make asan` runs
# the sanitized CLI), unless KM_BIN says otherwise.
export KM_BIN=${KM_BIN:-$(dirname "$bin")/kvmatch}
# KM_TEST_FILTER, when set, is a Criterion --filter pattern (one word, whatever it holds);
# KM_TEST_ARGS are further options, split on spaces.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
timeout --foreground 1200 "$bin" --jobs "${KM_TEST_JOBS:-2}" --verbose \
    ${KM_TEST_FILTER:+--filter "$KM_TEST_FILTER"} ${KM_TEST_ARGS:-} >"$log" 2>&1
status=$?
# A test the filter leaves out is "disabled" to Criterion: not listed, not counted as skipped.
grep -v -E '^\[(RUN |PASS)\] |Synthesis|^\[SKIP\] .*: Test is disabled$' "$log"
echo "$(grep '^\[SKIP\]' "$log" | grep -c -v ': Test is disabled$') test(s) skipped, listed above" \
    "with the reason"
# The failures again, last, where a log cut to its tail still shows them: each failed test's name
# and first assertion, and each sanitizer report's summary line.
if grep -qE '^\[FAIL\]|SUMMARY: [A-Za-z]+Sanitizer|runtime error:' "$log"; then
    echo "failed: (details above)"
    grep -E '^\[FAIL\]|^\[----\] [^ ]+:[0-9]+: |SUMMARY: [A-Za-z]+Sanitizer|runtime error:' "$log" | head -n 20
fi
grep 'Synthesis' "$log" | tail -n 1
[ "$status" -eq 124 ] && echo "run-tests: $bin timed out" >&2
# Criterion counts a test as passed even when a sanitizer reported in its process: with
# KM_FAIL_ON_SANITIZER=1 any such report fails the run.
if [ "${KM_FAIL_ON_SANITIZER:-0}" = 1 ] && grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$log"; then
    echo "run-tests: a sanitizer reported an error (see above)" >&2
    [ "$status" -eq 0 ] && status=1
fi
exit "$status"
