#!/usr/bin/env python3
"""Render a benchmark's JSON as its markdown section of docs/BENCHMARKS.md, between the markers
<!-- NAME:begin --> and <!-- NAME:end --> (stdlib only). NAME is the "benchmark" field of the JSON
(index when absent): index and ipc have renderers.

usage: scripts/bench-report.py [bench/results/index.json] [docs/BENCHMARKS.md]
"""
import json
import re
import sys


def fmt(x, digits=0):
    if x is None:
        return "not measured"
    if isinstance(x, float) and digits:
        return f"{x:,.{digits}f}"
    return f"{round(x):,}"


def render(d):
    m = d.get("machine", {})
    out = []
    out.append(f"Command: `{d.get('command', 'kvmatch bench index --json')}`; machine: {m.get('cpu', '?')}, "
               f"{m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB; 1-minute load at start "
               f"{m.get('loadavg_1min_at_start', '?')}. Medians of the repetitions.\n")
    out.append("| backend | workers | threads | requests/s | block probes/s | slot reads/s | batch p50 (us) | batch p99 (us) | bytes/pair | wrong answers |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in d["results"]:
        out.append(f"| {r['backend']} | {r['workers']} | {r.get('threads', '')} | {fmt(r['requests_per_s'])} | "
                   f"{fmt(r['block_probes_per_s'])} | {fmt(r.get('slot_reads_per_s'))} | "
                   f"{fmt(r['batch_p50_us'], 1)} | {fmt(r['batch_p99_us'], 1)} | {fmt(r['bytes_per_pair'], 1)} | "
                   f"{r.get('mismatches', '')} |")
    out.append(f"| cuda | 64, 1024 | | not measured | not measured | not measured | not measured | not measured | not measured | |")
    out.append("")
    out.append(f"Memory ceiling (`limit_slot_reads_per_s`, independent prefetched random 16-byte reads from a "
               f"table of the cpu index's size, same threads): {fmt(d.get('limit_slot_reads_per_s'))} reads/s.\n")
    out.append("| ratio (same run) | 64 workers | 1024 workers |")
    out.append("|---|---:|---:|")
    ratios = d.get("ratios", {})
    keys = []
    for w in ratios.values():
        for k in w:
            if k not in keys:
                keys.append(k)
    for k in keys:
        out.append(f"| {k} | {ratios.get('64', {}).get(k, '')} | {ratios.get('1024', {}).get(k, '')} |")
    notes = d.get("notes", [])
    if notes:
        out.append("")
        out.extend(f"- {n}" for n in notes)
    return "\n".join(out)


def render_ipc(d):
    m = d.get("machine", {})
    w = d.get("workload", {})
    out = []
    out.append(f"Command: `kvmatch bench ipc --json` (a child `kvmatch serve`, CPU backend, "
               f"{w.get('workers', '?')} approximate-mode workers, block size {w.get('block_size', '?')}, "
               f"input {w.get('input', '?')}, records {'on' if w.get('records') else 'off'}, "
               f"{w.get('seconds_per_phase', '?')} s per phase); machine: {m.get('cpu', '?')}, "
               f"{m.get('cores', '?')} cores, 1-minute load at start {m.get('loadavg_1min_at_start', '?')}. "
               f"The driver (one thread polling every connection) runs on the same cores.\n")
    out.append("| prompts | reply | connections | frame | offered/s | decisions/s | rtt p50 (us) | rtt p99 (us) | errors |")
    out.append("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in d["results"]:
        offered = "open" if r.get("offered_per_s") is None else fmt(r["offered_per_s"])
        out.append(f"| {r.get('workload', '')} | {r.get('reply', '')} | {r['connections']} | {r['frame']} | "
                   f"{offered} | {fmt(r['decisions_per_s'])} | {fmt(r['rtt_p50_us'], 1)} | "
                   f"{fmt(r['rtt_p99_us'], 1)} | {r.get('errors', '')} |")
    return "\n".join(out)


RENDERERS = {"index": render, "ipc": render_ipc}


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/index.json"
    doc = sys.argv[2] if len(sys.argv) > 2 else "docs/BENCHMARKS.md"
    with open(src) as f:
        data = json.load(f)
    name = data.get("benchmark", "index")
    section = RENDERERS[name](data)
    with open(doc) as f:
        text = f.read()
    new, n = re.subn(r"(<!-- " + name + r":begin -->\n)(?:.*?\n)?(<!-- " + name + r":end -->)",
                     lambda mo: mo.group(1) + section + "\n" + mo.group(2), text, flags=re.S)
    if n != 1:
        sys.exit(f"{doc}: markers <!-- {name}:begin --> / <!-- {name}:end --> not found")
    with open(doc, "w") as f:
        f.write(new)


if __name__ == "__main__":
    main()
