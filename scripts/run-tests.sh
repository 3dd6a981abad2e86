#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run the Criterion test binary with a bounded time. Prints every line but the per-test RUN/PASS
# noise: failures, assertion messages and each skipped test with its reason ([SKIP] lines: CUDA
# tests without a usable device, trace tests without the trace), then the skip count, then the
# failures again in brief, then Criterion's own "Synthesis" line last. A run past its bound is
# killed with everything under it, after its processes' states and stacks and the tests that never
# ended are printed, last. Exits with the binary's status (124 when it was killed).
set -uo pipefail
bin=${1:?usage: run-tests.sh TEST_BINARY}
# Tests that run the CLI use the kvmatch binary built beside this test binary (so `make asan` runs
# the sanitized CLI), unless KM_BIN says otherwise.
export KM_BIN=${KM_BIN:-$(dirname "$bin")/kvmatch}
# KM_TEST_FILTER, when set, is a Criterion --filter pattern (one word, whatever it holds);
# KM_TEST_ARGS are further options, split on spaces.
# KM_TEST_LIMIT_S bounds the whole run (default 1200 s).
limit=${KM_TEST_LIMIT_S:-1200}
log=$(mktemp)
trap 'rm -f "$log" "$log.hung"' EXIT

# Every process below pid, deepest last: pid first, then its children, and so on.
descendants() {
    local queue=("$1") next pid
    while [ ${#queue[@]} -gt 0 ]; do
        next=()
        for pid in "${queue[@]}"; do
            echo "$pid"
            next+=($(ps -o pid= --ppid "$pid" 2>/dev/null))
        done
        queue=("${next[@]}")
    done
}

# What a run that outlived its limit was doing: each process under the runner with its state and
# the kernel function it sleeps in, the threads' stacks of the test processes (where gdb can attach),
# then, last, the tests that started and never ended.
diagnose() {
    local runner=$1 pids
    pids=$(descendants "$runner" | tr '\n' ',' | sed 's/,$//')
    echo "run-tests: still running after ${limit} s; the processes under the test runner:"
    ps -o pid,ppid,pgid,stat,wchan:24,etimes,args -p "$pids" 2>/dev/null | cut -c1-200
    if command -v gdb >/dev/null 2>&1; then
        local attached=0
        for pid in ${pids//,/ }; do
            [ "$pid" = "$runner" ] || [ ! -d "/proc/$pid" ] && continue
            # At most 8 processes, 20 s each: the diagnosis stays short.
            [ "$attached" -ge 8 ] && break
            attached=$((attached + 1))
            echo "run-tests: threads of $pid ($({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null |
                cut -c1-120))"
            timeout 20 gdb -nx -batch -p "$pid" -ex 'thread apply all bt 12' 2>/dev/null |
                grep -E '^(Thread|#)' | cut -c1-160 | head -n 60
        done
    fi
    echo "run-tests: tests started and not ended:"
    awk '/^\[RUN \] /{sub(/^\[RUN \] /, ""); open[$0]=1; next}
         /^\[(PASS|FAIL|SKIP)\] /{name=$2; sub(/:$/, "", name); delete open[name]}
         END {for (t in open) print "  " t}' "$log"
}

# Standard input is /dev/null: no test or program it starts may wait on a terminal.
"$bin" --jobs "${KM_TEST_JOBS:-2}" --verbose \
    ${KM_TEST_FILTER:+--filter "$KM_TEST_FILTER"} ${KM_TEST_ARGS:-} >"$log" 2>&1 </dev/null &
runner=$!
timed_out=0
deadline=$((SECONDS + limit))
# The shell's own notice of a killed job is not part of the report.
{
    while kill -0 "$runner" 2>/dev/null; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            timed_out=1
            diagnose "$runner" >"$log.hung" 2>&1
            # The runner and every test process and server under it.
            kill -KILL $(descendants "$runner") 2>/dev/null
            break
        fi
        sleep 1
    done
    wait "$runner"
} 2>/dev/null
status=$?
[ "$timed_out" = 1 ] && status=124
# A test the filter leaves out is "disabled" to Criterion: not listed, not counted as skipped.
grep -v -E '^\[(RUN |PASS)\] |Synthesis|^\[SKIP\] .*: Test is disabled$' "$log"
echo "$(grep '^\[SKIP\]' "$log" | grep -c -v ': Test is disabled$') test(s) skipped, listed above" \
    "with the reason"
# The failures again, last, where a log cut to its tail still shows them: each failed test's name
# and first assertion, and each sanitizer report's summary line.
if grep -qE '^\[FAIL\]|SUMMARY: [A-Za-z]+Sanitizer|runtime error:|^test watchdog: ' "$log"; then
    echo "failed: (details above)"
    grep -E '^\[FAIL\]|^\[----\] [^ ]+:[0-9]+: |SUMMARY: [A-Za-z]+Sanitizer|runtime error:|^test watchdog: ' \
        "$log" | head -n 20
fi
grep 'Synthesis' "$log" | tail -n 1
if [ "$timed_out" = 1 ]; then
    cat "$log.hung"
    echo "run-tests: $bin timed out after ${limit} s" >&2
fi
# Criterion counts a test as passed even when a sanitizer reported in its process: with
# KM_FAIL_ON_SANITIZER=1 any such report fails the run.
if [ "${KM_FAIL_ON_SANITIZER:-0}" = 1 ] && grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$log"; then
    echo "run-tests: a sanitizer reported an error (see above)" >&2
    [ "$status" -eq 0 ] && status=1
fi
exit "$status"
