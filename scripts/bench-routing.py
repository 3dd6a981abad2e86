#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Routing quality across workloads, loads and seeds: `kvmatch sim --sweep` for every built-in
workload shape and the Mooncake trace (when present), each at three seeds, every policy at loads
0.5, 0.8 and 0.95 of the cluster's capacity (docs/SIM.md, "Load"). The trace has one arrival
order, so its three "seeds" are three consecutive windows of it.

usage: bench-routing.py KVMATCH_BINARY [POLICY] [--engine PRESET] [--workers N]
       [--policy-engine PRESET] > bench/results/routing.json

POLICY: the policy judged against the others (default: the one the binary names as default).
--engine PRESET: the engines of another preset (`kvmatch sim --engine`; default: the sim's own
default preset); the output then names it in "engine".
--workers N: a cluster of N engines instead of 4 (loads stay fractions of that cluster's capacity).
--policy-engine PRESET: every policy assumes that preset's engine model instead of the engines' own
(`kvmatch sim --policy-engine`: a router whose model of its engines is wrong); the output names it
in "policy_engine" and its section ends in -assuming-PRESET.
A run on another preset or cluster size has a section of its own in docs/BENCHMARKS.md:
scripts/bench-report.py renders it between <!-- routing-PRESET:begin --> and its end marker, or
routing-N-workers, or routing-PRESET-N-workers, the name the output gives in "section".

The output holds every run's figures and, per (workload, load, seed) cell, the default policy's
TTFT p50 and p99 against the best other policy's, and its p99 against round robin's at load 0.8,
with whether each target holds (docs/BENCHMARKS.md, "Routing"):
  - p50 and p99 no worse than every other policy's, within 2%;
  - at load 0.8, p99 at least 3x better than round robin's, and whether any policy could reach
    that: round robin's p99 over the floor's at that load (`kvmatch sim --json`, load_floors: the
    time to first token no routing goes below, docs/SIM.md, "Workloads").
Every run is made with `--ttft-from` REQUESTS / 10: its TTFT figures leave out the first tenth of
the requests (they warm the engines) and its "every_request" figures count them all. "cells" and
"summary" judge every request; "steady_cells" and "steady_summary" the same cells past the cold
start. The runs go as many at a time as the machine has CPUs (each is deterministic per seed).
Progress goes to stderr. Exit 0 whatever the targets say (a benchmark reports, it does not gate).
"""
import argparse
import concurrent.futures
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

LOADS = "0.5,0.8,0.95"
SEEDS = [1, 2, 3]
WORKERS = 4
REQUESTS = 1000
SHAPES = ["chat", "system_prompt", "agent", "docqa"]
TOLERANCE = 1.02
P99_OVER_ROUND_ROBIN = 3.0
# Past the cold start: the TTFT figures over requests STEADY_FROM and later (`kvmatch sim
# --ttft-from`); the first tenth warm the engines.
STEADY_FROM = REQUESTS // 10


def trace_path():
    path = os.environ.get("KM_MOONCAKE_TRACE", "../shared/data/mooncake/conversation_trace.jsonl")
    return path if os.path.exists(path) else None


def trace_window(path, seed, scratch):
    """The trace's seed-th window of REQUESTS consecutive requests, as a file of its own: a trace
    has one arrival order, so seeds take different stretches of it."""
    out = os.path.join(scratch, f"window-{seed}.jsonl")
    with open(path) as src, open(out, "w") as dst:
        for i, line in enumerate(src):
            if (seed - 1) * REQUESTS <= i < seed * REQUESTS:
                dst.write(line)
    return out


def section_name(engine, workers, policy_engine=None):
    """The BENCHMARKS section a run renders into: routing, then the preset, the cluster size and
    the policies' assumed preset where they are not the defaults."""
    name = "routing"
    if engine:
        name += f"-{engine}"
    if workers != WORKERS:
        name += f"-{workers}-workers"
    if policy_engine:
        name += f"-assuming-{policy_engine}"
    return name


def run(binary, workload, seed, scratch, engine, workers, policy_engine=None, ttft_from=0):
    args = [binary, "sim", "--workers", str(workers), "--requests", str(REQUESTS), "--seed",
            str(seed), "--sweep", LOADS, "--json"]
    if ttft_from:
        args += ["--ttft-from", str(ttft_from)]
    if engine:
        args += ["--engine", engine]
    if policy_engine:
        args += ["--policy-engine", policy_engine]
    if workload.endswith(".jsonl"):
        args += ["--trace", trace_window(workload, seed, scratch)]
    else:
        args += ["--workload", workload]
    started = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    result["wall_s"] = time.monotonic() - started
    return result


def every_request(result):
    """The result with each policy's TTFT figures over every request (the run's "every_request")
    in place of those past the cold start."""
    whole = copy.deepcopy(result)
    for p in whole["policies"]:
        for entry in p["loads"]:
            entry.update(entry["every_request"])
    for entry in whole["load_floors"]:
        entry.update(entry["every_request"])
    return whole


def ttft(p, key):
    """A policy's TTFT figure for comparisons: null (no request got a first token) is worst."""
    v = p[key]
    return float("inf") if v is None else v


def cells(name, seed, result, judged):
    default = judged or result["default_policy"]
    by_policy = {p["policy"]: p["loads"] for p in result["policies"]}
    out = []
    for i, load in enumerate(result["loads"]):
        row = {p: by_policy[p][i] for p in by_policy}
        mine = row[default]
        others = {p: r for p, r in row.items() if p != default}
        best_p50 = min(others.items(), key=lambda kv: ttft(kv[1], "ttft_p50_ms"))
        best_p99 = min(others.items(), key=lambda kv: ttft(kv[1], "ttft_p99_ms"))
        cell = {
            "workload": name, "seed": seed, "load": load,
            "default_p50_ms": mine["ttft_p50_ms"], "default_p99_ms": mine["ttft_p99_ms"],
            "best_other_p50": best_p50[0], "best_other_p50_ms": best_p50[1]["ttft_p50_ms"],
            "best_other_p99": best_p99[0], "best_other_p99_ms": best_p99[1]["ttft_p99_ms"],
            "round_robin_p99_ms": row["round_robin"]["ttft_p99_ms"],
            "floor_p99_ms": result["load_floors"][i]["floor_ttft_p99_ms"],
        }
        # No policy's p99 goes below the floor's, so round robin's p99 over it is the most any
        # policy could gain on round robin.
        rr_p99 = row["round_robin"]["ttft_p99_ms"]
        cell["round_robin_over_floor"] = (rr_p99 / cell["floor_p99_ms"]
                                          if rr_p99 is not None and cell["floor_p99_ms"] > 0
                                          else None)
        cell["p50_holds"] = (mine["ttft_p50_ms"] is not None and
                             mine["ttft_p50_ms"] <= TOLERANCE * ttft(best_p50[1], "ttft_p50_ms"))
        cell["p99_holds"] = (mine["ttft_p99_ms"] is not None and
                             mine["ttft_p99_ms"] <= TOLERANCE * ttft(best_p99[1], "ttft_p99_ms"))
        cell["p99_over_round_robin"] = (rr_p99 / mine["ttft_p99_ms"]
                                        if rr_p99 is not None and mine["ttft_p99_ms"]
                                        else None)
        if abs(load - 0.8) < 1e-9:
            cell["round_robin_target_holds"] = (cell["p99_over_round_robin"] or 0) >= P99_OVER_ROUND_ROBIN
            cell["round_robin_target_reachable"] = (cell["round_robin_over_floor"] or 0) >= P99_OVER_ROUND_ROBIN
        out.append(cell)
    return out


def summarize(cells_):
    """How many cells hold each target."""
    return {
        "cells": len(cells_),
        "p50_holds": sum(c["p50_holds"] for c in cells_),
        "p99_holds": sum(c["p99_holds"] for c in cells_),
        "round_robin_cells": sum("round_robin_target_holds" in c for c in cells_),
        "round_robin_holds": sum(c.get("round_robin_target_holds", False) for c in cells_),
        "round_robin_reachable": sum(c.get("round_robin_target_reachable", False) for c in cells_),
    }


def main():
    parser = argparse.ArgumentParser(usage=__doc__.split("\n\n")[1].removeprefix("usage: "))
    parser.add_argument("binary")
    parser.add_argument("policy", nargs="?")
    parser.add_argument("--engine")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--policy-engine")
    args = parser.parse_args()
    binary, judged, engine, workers = args.binary, args.policy, args.engine, args.workers
    if workers < 1:
        parser.error("--workers must be at least 1")
    workloads = list(SHAPES)
    trace = trace_path()
    if trace:
        workloads.append(trace)
    runs, all_cells, steady_cells = [], [], []
    scratch = tempfile.mkdtemp(prefix="bench-routing-")
    jobs = [(workload, seed) for workload in workloads for seed in SEEDS]

    def one(job):
        workload, seed = job
        name = "mooncake" if workload.endswith(".jsonl") else workload
        print(f"bench-routing: {name}, seed {seed}", file=sys.stderr, flush=True)
        return name, seed, run(binary, workload, seed, scratch, engine, workers,
                               args.policy_engine, STEADY_FROM)

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name, seed, result in pool.map(one, jobs):
            runs.append({"workload": name, "seed": seed, "ttft_from": STEADY_FROM,
                         "result": result})
            all_cells.extend(cells(name, seed, every_request(result), judged))
            steady_cells.extend(cells(name, seed, result, judged))
    for f in os.listdir(scratch):
        os.unlink(os.path.join(scratch, f))
    os.rmdir(scratch)
    summary = summarize(all_cells)
    steady_summary = summarize(steady_cells)
    steady_summary["ttft_from"] = STEADY_FROM
    json.dump({"benchmark": "routing",
               "section": section_name(engine, workers, args.policy_engine), "engine": engine,
               "policy_engine": args.policy_engine, "workers": workers, "requests": REQUESTS, "loads": LOADS,
               "seeds": SEEDS, "trace": bool(trace),
               "judged_policy": judged or runs[0]["result"]["default_policy"],
               "default_policy": runs[0]["result"]["default_policy"],
               "summary": summary, "cells": all_cells, "steady_summary": steady_summary,
               "steady_cells": steady_cells, "runs": runs}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
