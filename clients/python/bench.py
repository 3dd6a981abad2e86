#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Python client's driver for `kvmatch bench ipc --clients` (scripts/bench-clients.sh): one
connection, closed loop, WINDOW frames in flight, each frame PER_FRAME routes of the chain hashes
read from SCHEDULE (one prompt per line, cycled), in pool "main", for SECONDS (request ids unique to
this process: a later run's are new attempts, never ones still in flight). Prints one JSON
line: decisions/s (routes answered with status 0 per second), round-trip p50 / p99 in us (send to
reply, per frame), frames, errors.

    python bench.py ADDRESS SCHEDULE PER_FRAME WINDOW SECONDS"""

import json
import os
import sys
import time

from kvmatch_client import Client


def percentile(sorted_values, q):
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(address, schedule, per_frame, window, seconds):
    with open(schedule) as f:
        prompts = [[int(x) for x in line.split()] for line in f if line.strip()]
    seq, cursor = 0, 0
    sent_at, rtts = {}, []
    routes_ok = errors = frames = 0
    with Client.connect(address, timeout=10.0) as c:
        def send():
            nonlocal seq, cursor
            routes = []
            for _ in range(per_frame):
                routes.append({"request_id": "py%d-%d" % (os.getpid(), seq), "pool": "main", "hashes": prompts[cursor],
                               "expected_output_tokens": 128})
                seq += 1
                cursor = (cursor + 1) % len(prompts)
            sent_at[c.send_route(routes)] = time.perf_counter()

        start = time.perf_counter()
        end = start + seconds
        for _ in range(window):
            send()
        while True:
            reply = c.receive(timeout=10.0)
            now = time.perf_counter()
            rtts.append((now - sent_at.pop(reply["id"])) * 1e6)
            frames += 1
            for d in reply.get("decisions", ()):
                if d.get("status") == 0:
                    routes_ok += 1
                else:
                    errors += 1
            if reply.get("type") != "DECISION":
                errors += 1
            if now < end:
                send()
            elif not sent_at:
                break
        elapsed = time.perf_counter() - start
    rtts.sort()
    print(json.dumps({"decisions_per_s": routes_ok / elapsed, "rtt_p50_us": percentile(rtts, 0.50),
                      "rtt_p99_us": percentile(rtts, 0.99), "frames": frames, "errors": errors}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit("usage: bench.py ADDRESS SCHEDULE PER_FRAME WINDOW SECONDS")
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
