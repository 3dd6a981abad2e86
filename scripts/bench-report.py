#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Render a benchmark's JSON as its markdown section of docs/BENCHMARKS.md, between the markers
<!-- NAME:begin --> and <!-- NAME:end --> (stdlib only). NAME is the "benchmark" field of the JSON,
else the file's name without .json (bench/results/events.json -> events): index, ipc, events,
replay, replay-ceiling, sim, growth, routing and cluster have renderers (a routing run on another
engine preset or cluster size goes between the markers of the "section" its JSON names, e.g.
<!-- routing-PRESET:begin -->); `make bench` renders them all.

usage: scripts/bench-report.py [bench/results/index.json] [docs/BENCHMARKS.md]
"""
import json
import os
import re
import sys


def ms(x):
    """A TTFT figure in ms; `kvmatch sim --json` writes null when no request got a first token."""
    return "-" if x is None else f"{x:,.1f}"


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
               f"{m.get('loadavg_1min_at_start', '?')}{round_trip_clause(m)}. Medians of the repetitions.\n")
    out.append("| backend | workers | threads | requests/s | block probes/s | slot reads/s | batch p50 (us) | batch p99 (us) | bytes/pair | wrong answers |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in d["results"]:
        out.append(f"| {r['backend']} | {r['workers']} | {r.get('threads', '')} | {fmt(r['requests_per_s'])} | "
                   f"{fmt(r['block_probes_per_s'])} | {fmt(r.get('slot_reads_per_s'))} | "
                   f"{fmt(r['batch_p50_us'], 1)} | {fmt(r['batch_p99_us'], 1)} | {fmt(r['bytes_per_pair'], 1)} | "
                   f"{r.get('mismatches', '')} |")
    if not any(r["backend"] == "cuda" for r in d["results"]):
        out.append("| cuda | 64, 1024 | | not measured | not measured | not measured | not measured | "
                   "not measured | not measured | |")
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


def server_cpu(r):
    """The server's CPU per decision, with the loop and scheduler threads' shares when known."""
    total = fmt(r.get('server_cpu_us_per_decision'), 2)
    by = r.get('server_cpu_us_per_decision_by_thread') or {}
    # The main thread runs the event loop: "loop" (older result files name it by the process).
    loop, sched = by.get('loop', by.get('kvmatch')), by.get('km-scheduler')
    if loop is None or sched is None:
        return total
    return f"{total} ({fmt(loop, 2)} + {fmt(sched, 2)})"


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
    out.append("| prompts | reply | connections | frame | offered/s | decisions/s | rtt p50 (us) | rtt p99 (us) | errors "
               "| server CPU us / decision (loop + scheduler threads) | driver CPU us / decision | idle % | steal % |")
    out.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    c_rows = [r for r in d["results"] if r.get("client", "c") == "c"]
    for r in c_rows:
        offered = "open" if r.get("offered_per_s") is None else fmt(r["offered_per_s"])
        out.append(f"| {r.get('workload', '')} | {r.get('reply', '')} | {r['connections']} | {r['frame']} | "
                   f"{offered} | {fmt(r['decisions_per_s'])} | {fmt(r['rtt_p50_us'], 1)} | "
                   f"{fmt(r['rtt_p99_us'], 1)} | {r.get('errors', '')} | "
                   f"{server_cpu(r)} | {fmt(r.get('driver_cpu_us_per_decision'), 2)} | "
                   f"{fmt(r.get('idle_pct'), 1)} | {fmt(r.get('steal_pct'), 1)} |")
    out.append("")
    # Same-run ratios of each open-loop row's round trips to the machine's own floor (the echo row:
    # a child that only echoes, no kvmatch), which moves with the VM from run to run.
    echo = next((r for r in c_rows if r.get("reply") == "echo"), None)
    if echo and echo.get("rtt_p99_us") and echo.get("rtt_p50_us"):
        parts = []
        for r in c_rows:
            if r is echo or r.get("offered_per_s") is None:
                continue
            name = "ping" if r.get("reply") == "ping" else f"{r.get('workload')} {r.get('reply')} {r['frame']}"
            parts.append(f"{name} {r['rtt_p50_us'] / echo['rtt_p50_us']:.2f} / {r['rtt_p99_us'] / echo['rtt_p99_us']:.2f}")
        out.append("Round trips against the echo floor of the same run (p50 / p99 ratio), at the same offered "
                   "rate: " + "; ".join(parts) + ".\n")
    # Client languages (bench ipc --clients): each driver's rows beside the C client's of the same
    # run on the same schedule (one connection, closed loop, the same window and frame).
    others = [r for r in d["results"] if r.get("client", "c") != "c"]
    if others:
        out.append("Client languages (`scripts/bench-clients.sh`: `kvmatch bench ipc --clients DIR`), one "
                   "connection, closed loop, repeat prompts, full replies, against the C client in the same run:\n")
        out.append("| client | frame | window | decisions/s | rtt p50 (us) | rtt p99 (us) | errors |")
        out.append("|---|---|---:|---:|---:|---:|---:|")
        for frame in ("single", "batched"):
            shape = [r for r in others if r["frame"] == frame]
            if not shape:
                continue
            window = shape[0].get("window")
            same = [r for r in c_rows if r["frame"] == frame and r["connections"] == 1
                    and r.get("workload") == "repeat" and r.get("reply") == "full"
                    and r.get("offered_per_s") is None and r.get("window", window) == window]
            for r in same[:1] + shape:
                out.append(f"| {r.get('client', 'c')} | {frame} | {window} | {fmt(r['decisions_per_s'])} | "
                           f"{fmt(r['rtt_p50_us'], 1)} | {fmt(r['rtt_p99_us'], 1)} | {r.get('errors', '')} |")
        out.append("")
    out.append("CPU per decision: run time of every server thread (/proc/PID/task/*/schedstat) and of the "
               "driver process over the measured interval, divided by the routes answered (for `ping`, "
               "by the reports answered; for `echo`, by the frames echoed, and the server is the echo "
               "child: one process reading and writing back 64-byte frames with epoll, no kvmatch); in brackets, the loop thread's and the scheduler thread's "
               "shares (by thread name). Idle and steal: the machine's /proc/stat over the same interval; "
               "steal is time the hypervisor gave this VM's CPUs to someone else.")
    return "\n".join(out)


def round_trip_clause(m):
    """The CPUs' round trip at start (bench_common.h), where the JSON has it."""
    rt = m.get("cpu_round_trip_ns_at_start")
    if rt is None or rt < 0:
        return ""
    return f", round trip between its first two CPUs {fmt(rt)} ns"


def machine_line(d, command):
    m = d.get("machine", {})
    load = m.get("loadavg_1min_at_start", "?")
    load = f"{load:.2f}" if isinstance(load, (int, float)) else load
    return (f"Command: `{command}`; machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
            f"1-minute load at start {load}{round_trip_clause(m)}.\n")


def render_events(d):
    out = [machine_line(d, d.get("command", "kvmatch bench events --json"))]
    w = d.get("workload", {})
    t = d.get("targets", {})
    out.append(f"Stream: {fmt(w.get('block_events'))} block events ({fmt(w.get('stored_blocks'))} stored, "
               f"{fmt(w.get('removed_blocks'))} removed) in {fmt(w.get('messages'))} messages, "
               f"{w.get('workers', '?')} workers.\n")
    out.append("| path | block events/s | target | dropped or unmatched |")
    out.append("|---|---:|---:|---:|")
    for r in d["results"]:
        if "messages_per_s" in r:
            continue
        lost = r.get("dropped", r.get("lost_or_unmatched", ""))
        out.append(f"| {r['path']} | {fmt(r['block_events_per_s'])} | {fmt(t.get('block_events_per_s'))} | {lost} |")
    steps = [r for r in d["results"] if "messages_per_s" in r]
    e = d.get("engine_stream")
    if steps and e:
        out.append("")
        timed = ""
        if e.get("warmup_messages"):
            timed = (f" Timed: the last {fmt(e.get('timed_messages'))} messages "
                     f"({fmt(e.get('timed_block_events'))} block events), after the first "
                     f"{fmt(e.get('warmup_messages'))} filled every engine's cache.")
        out.append(f"Engine steps: {fmt(e.get('messages'))} messages from {e.get('engines', '?')} engines, "
                   f"{fmt(e.get('block_events'))} block events ({fmt(e.get('stored_blocks'))} stored, "
                   f"{fmt(e.get('removed_blocks'))} removed, {e.get('clears', 0)} clears).{timed}\n")
        floor = next((r for r in steps if r["path"] == "zmq_floor"), None)
        out.append("| path | messages/s | block events/s | of zmq_floor | target messages/s | dropped |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for r in steps:
            share = f"{r['messages_per_s'] / floor['messages_per_s']:.2f}" if floor and floor["messages_per_s"] else ""
            target = fmt(t.get("engine_messages_per_s")) if r["path"] == "engine_steps" else ""
            out.append(f"| {r['path']} | {fmt(r['messages_per_s'])} | {fmt(r['block_events_per_s'])} | "
                       f"{share} | {target} | {r.get('dropped', '')} |")
        reps = d.get("engine_reps")
        if reps:
            each = "; ".join(
                f"{fmt(x['engine_steps_messages_per_s'])} ({fmt(x['engine_steps_cpu_round_trip_ns_before'])}) / "
                f"{fmt(x['zmq_floor_messages_per_s'])} ({fmt(x['zmq_floor_cpu_round_trip_ns_before'])})"
                for x in reps)
            out.append("")
            out.append(f"Each repetition, `engine_steps` / `zmq_floor` messages/s (in brackets the round trip "
                       f"between the first two CPUs just before, ns): {each}.")
    r = d.get("restart")
    if r:
        out.append("")
        out.append("| restart: pairs | snapshot MB | ready (s) | target (s) | index load (s) | feed state (s) | repetitions |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|")
        out.append(f"| {fmt(r['pairs'])} | {fmt(r['file_bytes'] / 1e6)} | {r['ready_s']:.3f} | "
                   f"{t.get('ready_s', '')} | {r['index_load_s']:.3f} | {r['feed_import_s']:.3f} | {r.get('reps', '')} |")
    return "\n".join(out)


def render_replay(d):
    out = [machine_line(d, "kvmatch bench replay --json")]
    out.append("| index | p99 limit (ms) | sustained queries/s | block ops/s there |")
    out.append("|---|---:|---:|---:|")
    for r in d["results"]:
        if r.get("note"):
            out.append(f"| {r['index']} | {r['p99_limit_ms']} | {r['note']} | |")
        else:
            q = r["sustained_queries_per_s"]
            out.append(f"| {r['index']} | {r['p99_limit_ms']} | {'none' if q is None else fmt(q)} | "
                       f"{'-' if r['block_ops_per_s'] is None else fmt(r['block_ops_per_s'])} |")
    rates = []
    for s in d.get("slices", []):
        for x in s["slices"]:
            if x["offered_queries_per_s"] not in rates:
                rates.append(x["offered_queries_per_s"])
    rates.sort()
    if rates:
        out.append("")
        out.append("Query p99 (ms) at each offered rate (a slice stops the index's climb once over 10 ms):\n")
        out.append("| index | " + " | ".join(f"{fmt(r)}/s" for r in rates) + " |")
        out.append("|---|" + "---:|" * len(rates))
        for s in d["slices"]:
            got = {x["offered_queries_per_s"]: x["query_p99_ms"] for x in s["slices"]}
            out.append(f"| {s['index']} | " + " | ".join(
                f"{got[r]:,.3f}" if r in got else "" for r in rates) + " |")
    return "\n".join(out)


def render_replay_ceiling(d):
    out = [machine_line(d, "kvmatch bench replay --ceiling --json")]
    out.append("| index | updates, block ops/s | stores | removes | queries/s alone |")
    out.append("|---|---:|---:|---:|---:|")
    for c in d["ceilings"]:
        if c.get("note"):
            out.append(f"| {c['index']} | {c['note']} | | | |")
        else:
            out.append(f"| {c['index']} | {fmt(c['update_ops_per_s'])} | {fmt(c['store_ops_per_s'])} | "
                       f"{fmt(c['remove_ops_per_s'])} | {fmt(c['queries_per_s'])} |")
    return "\n".join(out)


def render_sim(d):
    w = d.get("workload", {})
    m = d.get("machine")
    # `kvmatch sim --json` writes no machine field; the wall-time columns still depend on one.
    where = (f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores" if m else
             "machine: not recorded in the JSON")
    out = [f"Command: `kvmatch sim --json` ({w.get('source', '?')} workload, {w.get('requests', '?')} requests, "
           f"seed {w.get('seed', '?')}, {d.get('workers', '?')} engines of {d.get('capacity_blocks', '?')} blocks, "
           f"events {d.get('events', '?')}, delivered {d.get('delivery', '?')}); {where}. Everything but the last two "
           f"columns is virtual time and deterministic.\n"]
    out.append("| policy | requests | actual reused tokens | predicted reused tokens | exact predictions | "
               "owner not chosen | TTFT p50 (ms) | TTFT p99 (ms) | load imbalance | decisions/s (wall) | "
               "decision p99 (us, wall) |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in d["policies"]:
        out.append(f"| {p['policy']} | {p['requests']} | {fmt(p['actual_reused_tokens'])} | "
                   f"{fmt(p['predicted_reused_tokens'])} | {p['exact_predictions']} | {p['owner_not_chosen']} | "
                   f"{ms(p['ttft_p50_ms'])} | {ms(p['ttft_p99_ms'])} | {p['load_imbalance']:.2f} | "
                   f"{fmt(p['decisions_per_s'])} | {fmt(p['decision_p99_us'])} |")
    return "\n".join(out)


def render_growth(d):
    out = [machine_line(d, d.get("command", "kvmatch bench growth --json"))]
    out.append(f"Each call adds {d.get('keys_per_call', '?')} new keys (the feed: a message of "
               f"{d.get('feed_blocks_per_message', '?')} new blocks; `index` `shared sets`: a run of "
               f"{d.get('shared_run_blocks', '?')} blocks; `clear`: one worker's clear). "
               f"Entries: at the end (`clear`: the index's pairs before the first clear).\n")
    out.append("| structure | mode | entries | calls | total (s) | mean (us) | p99.9 (us) | worst call (ms) |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in d["results"]:
        out.append(f"| {r['structure']} | {r['mode']} | {fmt(r['entries'])} | {fmt(r['calls'])} | "
                   f"{r['total_s']:.3f} | {r['mean_us']:.2f} | {r['p999_us']:,.1f} | {r['worst_ms']:,.2f} |")
    return "\n".join(out)


def render_cluster(d):
    out = [machine_line(d, d.get("command", "kvmatch bench cluster --json"))]
    out.append(f"Lag phase: {fmt(d.get('lag_updates_per_instance'))} updates per instance at "
               f"{fmt(d.get('lag_updates_per_instance_per_s'))}/s each; throughput phase: "
               f"{fmt(d.get('throughput_updates_per_instance'))} per instance, as fast as each "
               f"publishes.\n")
    out.append("| instances | updates/s (all published, all applied) | applied/s | lag p50 (ms) | lag p99 (ms) | NATS floor p50 (ms) | NATS floor p99 (ms) | lost detected | restart ready (s) |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in d["results"]:
        def ms(x):
            return "not measured" if x is None else f"{x:.3f}"
        ready = r.get("restart_ready_s")
        out.append(f"| {r['instances']} | {fmt(r['updates_per_s'])} | {fmt(r['applied_per_s'])} | "
                   f"{ms(r['lag_p50_ms'])} | {ms(r['lag_p99_ms'])} | "
                   f"{ms(r.get('floor_lag_p50_ms'))} | {ms(r.get('floor_lag_p99_ms'))} | {r['lost_detected']} | "
                   f"{'not measured' if ready is None else f'{ready:.4f}'} |")
    loss = d.get("injected_loss")
    if loss:
        out.append(f"\nInjected loss (2 instances, one change in {loss['drop_one_in']} not sent, "
                   f"{fmt(loss['updates'])} changes): {loss['detected']} of {loss['injected']} "
                   f"detected.")
    return "\n".join(out)


def section_name(d, kind):
    """The markers' NAME: the "section" the JSON names, else a routing run on another engine
    preset has routing-PRESET, else the kind."""
    if d.get("section"):
        return d["section"]
    return f"{kind}-{d['engine']}" if kind == "routing" and d.get("engine") else kind


def render_routing(d):
    judged = d.get("judged_policy", d.get("default_policy", "?"))
    sm = d["summary"]
    engine = d.get("engine")
    section = section_name(d, "routing")
    options = (f" --engine {engine}" if engine else "") + (
        f" --workers {d['workers']}" if section.endswith("-workers") else "")
    command = f"python3 scripts/bench-routing.py build/kvmatch{options} > bench/results/{section}.json"
    out = [f"Command: `{command}` "
           f"({d['workers']} workers, {d['requests']} requests, loads {d['loads']}, seeds "
           f"{', '.join(str(x) for x in d['seeds'])}; the Mooncake trace "
           f"{'in three windows' if d.get('trace') else 'absent: not run'}). Virtual time: the figures "
           f"are the same on every machine.\n"]
    out.append(f"`{judged}` within 2% of the best other policy: TTFT p50 in {sm['p50_holds']} of "
               f"{sm['cells']} cells, p99 in {sm['p99_holds']} of {sm['cells']}; p99 at least 3x better "
               f"than `round_robin`'s at load 0.8 in {sm['round_robin_holds']} of "
               f"{sm['round_robin_cells']} (reachable at all, round robin's p99 at least 3x the "
               f"floor, in {sm.get('round_robin_reachable', '?')} of {sm['round_robin_cells']}).\n")
    out.append(f"| workload | load | seed | `{judged}` p50 | best other p50 | `{judged}` p99 | "
               f"best other p99 | round robin p99 / `{judged}`'s | round robin p99 / floor |")
    out.append("|---|---:|---:|---:|---|---:|---|---:|---:|")
    for c in d["cells"]:
        p50 = ms(c['default_p50_ms']) + ("" if c["p50_holds"] else " (worse)")
        p99 = ms(c['default_p99_ms']) + ("" if c["p99_holds"] else " (worse)")
        rr = c["p99_over_round_robin"]
        rr_text = f"{rr:.2f}" if rr is not None else "?"
        if "round_robin_target_holds" in c and not c["round_robin_target_holds"]:
            rr_text += " (under 3)"
        reach = c.get("round_robin_over_floor")
        reach_text = f"{reach:.2f}" if reach is not None else "?"
        if "round_robin_target_reachable" in c and not c["round_robin_target_reachable"]:
            reach_text += " (3x out of reach)"
        out.append(f"| {c['workload']} | {c['load']:.2f} | {c['seed']} | {p50} | "
                   f"{c['best_other_p50']} {ms(c['best_other_p50_ms'])} | {p99} | "
                   f"{c['best_other_p99']} {ms(c['best_other_p99_ms'])} | {rr_text} | "
                   f"{reach_text} |")
    st = d.get("steady_summary")
    if st:
        out.append("")
        out.append(f"Past the cold start (the same runs with `--ttft-from {st['ttft_from']}`: the "
                   f"first {st['ttft_from']} requests warm the engines and count in no TTFT "
                   f"figure): `{judged}` within 2% of the best other policy: TTFT p50 in "
                   f"{st['p50_holds']} of {st['cells']} cells, p99 in {st['p99_holds']} of "
                   f"{st['cells']}; p99 at least 3x better than `round_robin`'s at load 0.8 in "
                   f"{st['round_robin_holds']} of {st['round_robin_cells']} (reachable at all, "
                   f"round robin's p99 at least 3x the floor of the same requests, in "
                   f"{st.get('round_robin_reachable', '?')} of {st['round_robin_cells']}).")
        lost = [c for c in d.get("steady_cells", []) if not (c["p50_holds"] and c["p99_holds"])]
        if lost:
            out.append("")
            out.append("Cells another policy wins past the cold start:")
            out.append("")
            for c in lost:
                parts = []
                if not c["p50_holds"]:
                    parts.append(f"p50 {ms(c['default_p50_ms'])} against `{c['best_other_p50']}`'s "
                                 f"{ms(c['best_other_p50_ms'])}")
                if not c["p99_holds"]:
                    parts.append(f"p99 {ms(c['default_p99_ms'])} against `{c['best_other_p99']}`'s "
                                 f"{ms(c['best_other_p99_ms'])}")
                out.append(f"- {c['workload']}, seed {c['seed']}, load {c['load']:.2f}: "
                           f"{'; '.join(parts)}")
    return "\n".join(out)


RENDERERS = {"index": render, "ipc": render_ipc, "events": render_events, "replay": render_replay,
             "replay-ceiling": render_replay_ceiling, "sim": render_sim, "growth": render_growth,
             "routing": render_routing, "cluster": render_cluster}


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/index.json"
    doc = sys.argv[2] if len(sys.argv) > 2 else "docs/BENCHMARKS.md"
    with open(src) as f:
        data = json.load(f)
    kind = data.get("benchmark") or os.path.basename(src).rsplit(".", 1)[0]
    if kind not in RENDERERS:
        sys.exit(f"{src}: no renderer for '{kind}' (have: {', '.join(RENDERERS)})")
    section = RENDERERS[kind](data)
    name = section_name(data, kind)
    with open(doc) as f:
        text = f.read()
    marker = re.escape(name)
    new, n = re.subn(r"(<!-- " + marker + r":begin -->\n)(?:.*?\n)?(<!-- " + marker + r":end -->)",
                     lambda mo: mo.group(1) + section + "\n" + mo.group(2), text, flags=re.S)
    if n != 1:
        sys.exit(f"{doc}: markers <!-- {name}:begin --> / <!-- {name}:end --> not found")
    with open(doc, "w") as f:
        f.write(new)


if __name__ == "__main__":
    main()
