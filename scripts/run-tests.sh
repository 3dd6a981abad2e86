#!/usr/bin/env bash
# Run the Criterion test binary with a bounded time; its closing "Synthesis" line is the summary.
set -uo pipefail
bin=${1:?usage: run-tests.sh TEST_BINARY}
timeout --foreground 1200 "$bin" --jobs "${KM_TEST_JOBS:-2}" ${KM_TEST_ARGS:-}
