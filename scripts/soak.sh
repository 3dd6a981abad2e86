#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `make soak`: a bounded soak of a real `kvmatch serve` (docs/RELIABILITY.md). For SOAK_SECONDS
# (default 180) it runs, against one server: `kvmatch sim --zmq --connect` rounds (each adds its own
# pool with event-fed engines and full lifecycles, routes, reports, and removes the pool), and
# bursts of `kvmatch bench ipc --connect` (pipelined floods past the queue deadline, shed). At the
# end it checks, and exits 1 naming the first that fails:
#   - threads and file descriptors of the server equal to their count after the first round
#     (pools come and go without leaking their subscriber thread, ZMQ context or sockets);
#   - RSS within SOAK_RSS_SLACK_KB (default 65536) of its value after the first round;
#   - no route answered with an error other than KM_ERR_OVERLOADED (the shed ones);
#   - a clean SIGTERM (exit 0), and records on disk: every line valid (tests/check_records.py),
#     lines written = lines in the files + lines rotation deleted (/metrics).
# Usage: scripts/soak.sh [KVMATCH_BINARY]; SOAK_SECONDS=N, SOAK_KEEP=1 keeps the directory.
set -euo pipefail
bin=${1:-build/kvmatch}
seconds=${SOAK_SECONDS:-180}
slack_kb=${SOAK_RSS_SLACK_KB:-65536}
[ -x "$bin" ] || { echo "soak: $bin not built" >&2; exit 2; }
dir=$(mktemp -d /tmp/kvmatch-soak-XXXXXX)
sock=$dir/s.sock
addr=unix:$sock
http=127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cleanup() {
    [ -n "${srv:-}" ] && kill "$srv" 2>/dev/null || true
    [ "${SOAK_KEEP:-0}" = 1 ] || rm -rf "$dir"
}
trap cleanup EXIT

workers=()
for i in $(seq 100 115); do workers+=(--worker "main:$i"); done # sim uses ids from 0
# Small record files, so rotation and its counted deletions happen within the soak.
cat > "$dir/config.json" <<EOF
{"records": {"path": "$dir/records.jsonl", "max_file_bytes": 16777216, "keep_files": 3}}
EOF
"$bin" serve --config "$dir/config.json" --socket "$sock" --http "$http" --backend cpu \
    --threads 1 --active-ttl-s 5 --pool main:16:kv "${workers[@]}" 2> "$dir/serve.log" &
srv=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "soak: the server did not start" >&2; cat "$dir/serve.log" >&2; exit 1; }

threads() { grep '^Threads:' "/proc/$srv/status" | awk '{print $2}'; }
fds() { ls "/proc/$srv/fd" | wc -l; }
rss() { grep '^VmRSS:' "/proc/$srv/status" | awk '{print $2}'; }
metric() { curl -s "http://$http/metrics" | awk -v n="$1" '$1 == n {print $2}'; }

errors=0
round=0
sim_round() {
    local out
    out=$("$bin" sim --zmq --connect "$addr" --workers 4 --requests 300 --policy kv \
          --seed $((round + 1)) --json 2>&1) || { echo "soak: sim round $round failed: $out" >&2; return 1; }
}
flood_round() {
    # A burst past the queue deadline: the shed frames are answered KM_ERR_OVERLOADED.
    "$bin" bench ipc --connect "$addr" --only 6 --seconds 2 > /dev/null 2>&1 || true
}

start=$(date +%s)
sim_round; flood_round; round=1
sleep 6 # active work of the first round expires (TTL 5 s)
threads0=$(threads); fds0=$(fds); rss0=$(rss)
echo "soak: after the first round: threads $threads0, fds $fds0, RSS $rss0 kB"
while [ $(( $(date +%s) - start )) -lt "$seconds" ]; do
    sim_round
    if [ $((round % 3)) = 0 ]; then flood_round; fi
    round=$((round + 1))
    # RSS along the way, so a steady climb can be told from a step that levels off.
    if [ $((round % 15)) = 0 ]; then echo "soak: round $round ($(( $(date +%s) - start )) s): RSS $(rss) kB"; fi
done
sleep 6
threads1=$(threads); fds1=$(fds); rss1=$(rss)
echo "soak: after $round rounds ($(( $(date +%s) - start )) s): threads $threads1, fds $fds1, RSS $rss1 kB"
decisions=$(metric kvmatch_decisions_total)
written=$(metric kvmatch_records_written_total)
deleted=$(metric kvmatch_records_deleted_total)
shed=$(curl -s "http://$http/metrics" | awk '$1 ~ /^kvmatch_routes_shed_total/ {s += $2} END {print s + 0}')
echo "soak: decisions $decisions, records written $written, deleted by rotation $deleted, routes shed $shed"

fail=0
[ "$threads1" = "$threads0" ] || { echo "soak: FAIL threads $threads0 -> $threads1" >&2; fail=1; }
[ "$fds1" = "$fds0" ] || { echo "soak: FAIL fds $fds0 -> $fds1" >&2; fail=1; }
[ $((rss1 - rss0)) -le "$slack_kb" ] || { echo "soak: FAIL RSS $rss0 -> $rss1 kB" >&2; fail=1; }
kill -TERM "$srv"
set +e
wait "$srv"
status=$?
set -e
srv=
[ "$status" = 0 ] || { echo "soak: FAIL exit status $status after SIGTERM" >&2; fail=1; }
# Records: every line on disk valid; on disk + deleted by rotation = written.
on_disk=$(cat "$dir"/records.jsonl* | wc -l)
if [ -n "$written" ] && [ $((on_disk + deleted)) -lt "$written" ]; then
    echo "soak: FAIL records: $on_disk on disk + $deleted deleted < $written written" >&2; fail=1
fi
python3 tests/check_records.py "$dir"/records.jsonl* > "$dir/check.txt" 2>&1 ||
    { echo "soak: FAIL records do not check:" >&2; tail -5 "$dir/check.txt" >&2; fail=1; }
echo "soak: records on disk $on_disk ($(tail -1 "$dir/check.txt"))"
[ "$fail" = 0 ] && echo "soak: ok" || exit 1
