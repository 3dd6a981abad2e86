#!/usr/bin/env python3
"""Where single routes' round trips go, from a stage log of a diagnostic server build.

Build: make CUDA=0 BUILD=build-trace CPPFLAGS=-DKM_SRV_STAGE_TRACE build-trace/kvmatch
Run:   KM_SRV_STAGE_LOG=/tmp/stages.txt build-trace/kvmatch bench ipc --only 7 --seconds 3
Read:  scripts/stage-trace.py /tmp/stages.txt

Each log line is one delivered ROUTE frame: where it was decided (loop or scheduler), its routes,
then each stage's time since the frame's read in us (queued, batch, scored, decided, handed,
picked, written; -1 = never reached, written -1 = left to a uv_write). Prints, for frames of one
route, the share decided on each thread, the server-side read-to-written percentiles, and for the
slowest 1% the median time from the read to each stage, per thread (a reply the scheduler thread
wrote itself is written before the loop thread picks its job up). stdlib only.
"""
import statistics
import sys

STAGES = ["queued", "batch", "scored", "decided", "handed", "picked", "written"]


def done_at(v):
    return v[6] if v[6] >= 0 else v[5]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: stage-trace.py STAGE_LOG")
    rows = []
    with open(sys.argv[1]) as f:
        for line in f:
            p = line.split()
            if len(p) == 9 and p[1] == "1":
                rows.append((p[0], [float(x) for x in p[2:]]))
    if not rows:
        sys.exit("no single-route frames in the log")
    rows.sort(key=lambda r: done_at(r[1]))
    n = len(rows)
    on_loop = sum(r[0] == "loop" for r in rows)
    print(f"single-route frames: {n}, decided on the loop thread {on_loop}, "
          f"on the scheduler thread {n - on_loop}")
    for q in (0.5, 0.9, 0.99):
        print(f"read to written, p{q * 100:g}: {done_at(rows[int(q * (n - 1))][1]):.1f} us")
    tail = rows[int(0.99 * n):]
    print(f"slowest 1% ({len(tail)} frames): median us from the read to each stage, per thread")
    for where in ("loop", "scheduler"):
        vs = [v for w, v in tail if w == where]
        if not vs:
            continue
        parts = []
        for i, name in enumerate(STAGES):
            d = [v[i] for v in vs if v[i] >= 0]
            parts.append(f"{name} {statistics.median(d):.0f}" if d else f"{name} -")
        print(f"  {where} ({len(vs)}): " + ", ".join(parts))


if __name__ == "__main__":
    main()
