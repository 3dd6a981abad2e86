#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Python client against a real `kvmatch serve` started here on a Unix socket in a temporary
directory: routes (blocking, pipelined, batched), the lifecycle reports and the outcome rule,
WORKERS / POOLS (POOLS remove included) / STATUS, each error the server answers (by code and
name), servers of their own configured to refuse (KM_ERR_OVERLOADED from the per-connection
budget, KM_ERR_TOO_LARGE for a frame over the server's limit, KM_ERR_SHUTTING_DOWN after a
SIGTERM while routes are in flight, KM_ERR_OVERLOADED for a connection over max_connections), a
server that goes away mid-request, and reconnecting to it once it is back (request ids go on).
The error-name table is checked against include/kvmatch/error.h. The binary is $KM_BIN, else
build/kvmatch or build-cpu/kvmatch. Run: python tests/test_server.py (exit 0 on success); the
whole run is bounded by an alarm.
Replies a real server never sends (wrong count, wrong type, unknown id) are tested against a fake
server in tests/test_python_client.py."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))

import kvmatch_client as kc  # noqa: E402  (the installed package, or clients/python on PYTHONPATH)

WORKERS = 3


def kvmatch_binary():
    for candidate in (os.environ.get("KM_BIN"), os.path.join(ROOT, "build", "kvmatch"),
                      os.path.join(ROOT, "build-cpu", "kvmatch")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("test_server: no kvmatch binary (build it with make, or set KM_BIN)")


class Server:
    """`kvmatch serve` with one pool "default" (block size 16, policy kv) of WORKERS approximate
    workers, on DIR/kvmatch.sock; start() waits until it accepts."""

    def __init__(self, directory, config=None):
        """config: a dict of config-file keys (docs/SERVICE.md) besides the pool, e.g. the
        scheduler's shedding limits; None: flags only."""
        self.dir = directory
        self.path = os.path.join(directory, "kvmatch.sock")
        self.address = "unix:" + self.path
        self.config = config
        self.proc = None

    def start(self):
        if os.path.exists(self.path):
            os.unlink(self.path)
        args = [kvmatch_binary(), "serve", "--socket", self.path, "--records", "none",
                "--max-workers", "64"]
        if self.config is not None:
            config = dict(self.config, pools=[{"name": "default", "block_size": 16, "policy": "kv",
                                               "workers": [{"id": w} for w in range(WORKERS)]}])
            config_path = os.path.join(self.dir, "kvmatch.json")
            with open(config_path, "w") as f:
                json.dump(config, f)
            args += ["--config", config_path]
        else:
            args += ["--pool", "default:16:kv"]
            for w in range(WORKERS):
                args += ["--worker", "default:%d" % w]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                     stderr=open(os.path.join(self.dir, "serve.log"), "ab"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("kvmatch serve exited with %d" % self.proc.returncode)
            try:
                kc.Client.connect(self.address, timeout=1.0).close()
                return
            except (OSError, kc.KvmatchError):
                time.sleep(0.05)
        raise SystemExit("kvmatch serve did not accept on %s" % self.path)

    def pause(self):
        """SIGSTOP, returning once every thread of the process is stopped (state T in /proc)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for task in os.listdir("/proc/%d/task" % self.proc.pid):
                with open("/proc/%d/task/%s/stat" % (self.proc.pid, task)) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            if all(state == "T" for state in states):
                return
            time.sleep(0.01)
        raise AssertionError("kvmatch serve did not stop")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def expect_error(fn, code, what):
    try:
        fn()
    except kc.KvmatchError as e:
        expect(e.code == code and e.name == kc.error_name(code),
               "%s: expected %s, got %s (%d)" % (what, kc.error_name(code), e.name, e.code))
        return e
    raise AssertionError("%s: no error raised, expected %s" % (what, kc.error_name(code)))


def prompt(n, seed=0):
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def test_error_names_match_the_header(server):
    header = open(os.path.join(ROOT, "include", "kvmatch", "error.h")).read()
    codes = {int(code): name for name, code in re.findall(r"X\((KM_\w+), (-?\d+),", header)}
    expect(codes and codes == kc.ERROR_NAMES,
           "client table %r differs from error.h %r" % (kc.ERROR_NAMES, codes))
    expect(kc.error_name(-99) == "KM_ERR_UNKNOWN(-99)", "an unknown code is named as unknown")


def test_route_and_lifecycle(server):
    with kc.Client.connect(server.address) as c:
        limits = c.welcome["limits"]
        expect(limits["max_batch_items"] >= 1, "WELCOME carries the limits")
        tokens = prompt(100, 1)
        d = c.route([{"request_id": "r1", "attempt_id": 0, "pool": "default", "tokens": tokens,
                      "expected_output_tokens": 50}])["decisions"][0]
        expect(d["status"] == 0, "decided: %r" % d)
        expect(0 <= d["chosen_worker"] < WORKERS, "chosen_worker in the pool")
        expect(d["n_blocks"] == len(tokens) // 16 and d["block_size"] == 16, "n_blocks %r" % d)
        expect(d["source"] == "approx" and d["policy"] == "kv", "source / policy %r" % d)
        expect(d["load_scope"] == "this_instance", "load_scope %r" % d)
        expect(not {"load_instances", "load_oldest_age_ms", "load_stale_instances"} & set(d),
               "this instance's own view carries no cluster fields: %r" % d)
        expect(len(d["candidates"]) == WORKERS and all(len(row) >= 11 for row in d["candidates"]),
               "one candidate row of 11 values per worker")
        did = d["decision_id"]
        for ack in (c.dispatched(decision_id=did, worker=d["chosen_worker"], elapsed_ms=1.0),
                    c.first_token(decision_id=did, elapsed_ms=20.0),
                    c.finished(decision_id=did, finish_reason="stop", done_seen=True,
                               http_status=200, cached_tokens=0, elapsed_ms=90.0)):
            expect(ack["items"] == [{"status": 0}], "lifecycle acked: %r" % ack)
        # The same prompt again: the chosen worker learned its blocks (approximate mode).
        again = c.route([{"request_id": "r2", "tokens": tokens, "brief": True}])["decisions"][0]
        expect(again["owner_worker"] == d["chosen_worker"], "the owner is the worker taught: %r" % again)
        expect(again["owner_depth"] == len(tokens) // 16, "owner_depth %r" % again)
        expect("candidates" not in again or not again["candidates"], "brief: no rows")
        # An event after FINISHED, an unknown decision, "complete" without the evidence, a
        # FIRST_TOKEN twice: item statuses, the connection stays.
        d3 = c.route([{"request_id": "r3", "tokens": tokens}])["decisions"][0]
        ack = c.lifecycle([
            {"event": "FINISHED", "request_id": "r1", "attempt_id": 0},
            {"event": "DISPATCHED", "decision_id": 987654321},
            {"event": "FIRST_TOKEN", "decision_id": d3["decision_id"]},
            {"event": "FIRST_TOKEN", "decision_id": d3["decision_id"]},
            {"event": "FINISHED", "decision_id": d3["decision_id"], "outcome": "complete",
             "finish_reason": "stop", "done_seen": False},
            {"event": "FINISHED", "decision_id": d3["decision_id"], "elapsed_ms": -1.0},
        ])
        got = [item["status"] for item in ack["items"]]
        expect(got == [kc.KM_ERR_PROTOCOL, kc.KM_ERR_NOT_FOUND, 0, kc.KM_ERR_PROTOCOL,
                       kc.KM_ERR_INVALID_ARGUMENT, kc.KM_ERR_INVALID_ARGUMENT],
               "lifecycle statuses %r" % ack["items"])
        expect(kc.outcome_from_stream("stop", True, 200) == "complete", "outcome rule: complete")
        expect(kc.outcome_from_stream("stop", False, 200) == "incomplete", "no [DONE]: incomplete")
        expect(kc.outcome_from_stream(None, True, 200) == "incomplete", "no finish_reason")
        expect(kc.outcome_from_stream("stop", True, 503) == "error", "HTTP 503: error")
        expect(kc.outcome_from_stream("stop", True, 200, "reset") == "error", "an error seen")


def test_route_errors(server):
    with kc.Client.connect(server.address) as c:
        batch = c.route([{"request_id": "ok", "tokens": prompt(40)},
                         {"request_id": "nopool", "pool": "nope", "tokens": prompt(40)},
                         {"request_id": "nomodel", "model": "no-such-model", "tokens": prompt(40)},
                         {"request_id": "both", "tokens": [1], "hashes": [2]},
                         {"request_id": "badsize", "hashes": [1, 2], "block_size": 32},
                         {"request_id": "", "tokens": [1]},
                         {"request_id": "range", "tokens": prompt(20), "candidates": [63]}])
        got = [(d["request_id"] if "request_id" in d else None, d["status"]) for d in batch["decisions"]]
        expect([s for _, s in got] == [0, kc.KM_ERR_NOT_FOUND, kc.KM_ERR_NOT_FOUND, kc.KM_ERR_PARSE,
                                       kc.KM_ERR_INVALID_ARGUMENT, kc.KM_ERR_PARSE,
                                       kc.KM_ERR_NOT_FOUND],
               "per-route statuses, siblings served: %r" % batch["decisions"])
        expect(all(d.get("message") for d in batch["decisions"][1:]), "each failure says why")
        # Message-level errors: an ERROR with the request's id; the connection stays open.
        e = expect_error(lambda: c.call({"type": "NO_SUCH_TYPE"}), kc.KM_ERR_PROTOCOL, "unknown type")
        expect("NO_SUCH_TYPE" in e.message or "type" in e.message, "names the type: %s" % e)
        expect_error(lambda: c.call({"type": "ROUTE", "routes": "r"}), kc.KM_ERR_PARSE, "routes not an array")
        too_many = [{"request_id": "x%d" % i, "tokens": []}
                    for i in range(c.welcome["limits"]["max_batch_items"] + 1)]
        expect_error(lambda: c.route(too_many), kc.KM_ERR_TOO_LARGE, "a batch over max_batch_items")
        expect_error(lambda: c.call({"type": "WORKERS", "action": "explode"}), kc.KM_ERR_PARSE,
                     "unknown WORKERS action")
        expect(c.route([{"request_id": "still", "tokens": [1, 2]}])["decisions"][0]["status"] == 0,
               "still serving after the errors")
        # An unhealthy worker is never chosen: a route that allows only it fails.
        ack = c.workers("update", [{"pool": "default", "worker": 1, "healthy": False}])
        expect(ack["items"] == [{"status": 0}], "health update %r" % ack)
        only = c.route([{"request_id": "down", "tokens": [1], "candidates": [1]}])["decisions"][0]
        expect(only["status"] == kc.KM_ERR_NO_HEALTHY_WORKER, "%r" % only)
        c.workers("update", [{"pool": "default", "worker": 1, "healthy": True}])


def test_admin(server):
    with kc.Client.connect(server.address) as c:
        listed = c.workers("list")
        expect(listed["type"] == "WORKER_LIST" and len(listed["workers"]) == WORKERS, "%r" % listed)
        ack = c.workers("add", [{"pool": "default", "worker": 10, "name": "w10"},
                                {"pool": "default", "worker": 1000},
                                {"pool": "nope", "worker": 11},
                                {"pool": "default", "worker": 12, "name": "bad\nname"},
                                {"pool": "default", "worker": 13, "replay_endpoint": "tcp://127.0.0.1:1"}])
        got = [item["status"] for item in ack["items"]]
        expect(got == [0, kc.KM_ERR_WORKER_RANGE, kc.KM_ERR_NOT_FOUND, kc.KM_ERR_INVALID_ARGUMENT,
                       kc.KM_ERR_INVALID_ARGUMENT], "worker add statuses %r" % ack["items"])
        expect(len(c.workers("list", pool="default")["workers"]) == WORKERS + 1, "w10 listed")
        ack = c.workers("remove", [{"pool": "default", "worker": 10}, {"pool": "default", "worker": 99}])
        expect([i["status"] for i in ack["items"]] == [0, kc.KM_ERR_NOT_FOUND], "%r" % ack)
        ack = c.workers("update", [{"pool": "default", "worker": 0}])
        expect(ack["items"][0]["status"] == kc.KM_ERR_INVALID_ARGUMENT, "update without healthy")
        ack = c.pools("add", [{"name": "second", "block_size": 32, "policy": "least_load",
                               "hash_lookahead_tokens": 2},
                              {"name": "nosize"},
                              {"name": "badparam", "block_size": 16, "params": {"temperature": "hot"}}])
        got = [item["status"] for item in ack["items"]]
        expect(got[0] == 0 and got[1] == kc.KM_ERR_BLOCK_SIZE and got[2] < 0, "pool add %r" % ack["items"])
        pools = c.pools("list")
        expect(pools["type"] == "POOL_LIST" and {p["name"] for p in pools["pools"]} >= {"default", "second"},
               "%r" % pools)
        second = [p for p in pools["pools"] if p["name"] == "second"][0]
        expect(second.get("hash_lookahead_tokens") == 2, "lookahead of a pool: %r" % second)
        empty = c.route([{"request_id": "e", "pool": "second", "tokens": prompt(64)}])["decisions"][0]
        expect(empty["status"] == kc.KM_ERR_NOT_FOUND, "a pool with no worker: %r" % empty)
        status = c.status()
        expect(status["type"] == "STATUS_REPLY" and status["decisions"] >= 1 and status["ready"] in (True, False),
               "%r" % status)
        expect(len(status["workers"]) == WORKERS, "STATUS lists the workers")


def test_remove_pools(server):
    with kc.Client.connect(server.address) as c:
        ack = c.pools("add", [{"name": "gone", "block_size": 16, "policy": "kv"}])
        expect(ack["items"] == [{"status": 0}], "pool add %r" % ack)
        ack = c.workers("add", [{"pool": "gone", "worker": 20}, {"pool": "gone", "worker": 21}])
        expect([i["status"] for i in ack["items"]] == [0, 0], "workers of the pool %r" % ack)
        d = c.route([{"request_id": "in-gone", "pool": "gone", "tokens": prompt(64)}])["decisions"][0]
        expect(d["status"] == 0 and d["chosen_worker"] in (20, 21), "routed in the pool: %r" % d)
        ack = c.remove_pools(["gone", "never-was"])
        expect([i["status"] for i in ack["items"]] == [0, kc.KM_ERR_NOT_FOUND],
               "pool remove statuses %r" % ack["items"])
        expect("gone" not in {p["name"] for p in c.pools("list")["pools"]}, "the pool is gone")
        expect(all(w["worker"] not in (20, 21) for w in c.workers("list")["workers"]),
               "its workers are gone")
        d = c.route([{"request_id": "after", "pool": "gone", "tokens": prompt(64)}])["decisions"][0]
        expect(d["status"] == kc.KM_ERR_NOT_FOUND, "a route to the removed pool: %r" % d)
        # The attempt that was in flight there ended with its worker: its FINISHED comes late.
        ack = c.finished(request_id="in-gone", elapsed_ms=1.0)
        expect(ack["items"][0]["status"] == kc.KM_ERR_NOT_FOUND, "a late FINISHED: %r" % ack)
        # The name is free again.
        ack = c.pools("add", [{"name": "gone", "block_size": 32}])
        expect(ack["items"] == [{"status": 0}], "the name is free again: %r" % ack)
        expect(c.remove_pools(["gone"])["items"] == [{"status": 0}], "removed again")


def test_pipelined(server):
    with kc.Client.connect(server.address) as c:
        ids = {}
        for i in range(64):
            routes = [{"request_id": "p%d-%d" % (i, j), "tokens": prompt(16 * (j + 1), i)}
                      for j in range(1 + i % 4)]
            ids[c.send_route(routes)] = len(routes)
        expect(c.outstanding == 64, "64 in flight")
        seen = set()
        for _ in range(64):
            reply = c.receive()
            expect(reply["id"] in ids and reply["id"] not in seen, "a reply per request, once")
            expect(len(reply["decisions"]) == ids[reply["id"]], "one decision per route")
            seen.add(reply["id"])
        expect(c.outstanding == 0, "nothing left in flight")
        a, b = c.send_route([{"request_id": "wa", "tokens": [1]}]), c.send_route([{"request_id": "wb", "tokens": [2]}])
        expect(c.wait(b)["id"] == b and c.wait(a)["id"] == a, "wait matches ids in any order")
        expect_error(lambda: c.wait(a), kc.KM_ERR_NOT_FOUND, "a reply already returned")


def test_example(server):
    example = os.path.join(HERE, "..", "example.py")
    run = subprocess.run([sys.executable, example, server.address, "default"], capture_output=True,
                         text=True, timeout=60)
    expect(run.returncode == 0 and "chosen_worker" in run.stdout, "example: %s%s" % (run.stdout, run.stderr))
    run = subprocess.run([sys.executable, example, server.address, "no-such-pool"], capture_output=True,
                         text=True, timeout=60)
    expect(run.returncode == 1 and "KM_ERR_NOT_FOUND" in run.stdout, "example, unknown pool: %s" % run.stdout)


def test_server_goes_away_then_reconnect(server):
    c = kc.Client.connect(server.address)
    server.pause()  # the request is read by no one ...
    rid = c.send_route([{"request_id": "lost", "tokens": prompt(32)}])
    server.kill()  # ... and the server dies with it in flight
    expect_error(lambda: c.wait(rid, timeout=10), kc.KM_ERR_CLOSED, "server gone mid-request")
    expect(c.closed, "the client is closed after it")
    expect_error(lambda: c.route([{"request_id": "x", "tokens": [1]}]), kc.KM_ERR_CLOSED, "a call after")
    try:
        c.reconnect(timeout=1.0)
        raise AssertionError("reconnect with no server succeeded")
    except (OSError, kc.KvmatchError):
        pass
    server.start()
    c.reconnect()
    expect(not c.closed and c.outstanding == 0, "a fresh connection")
    expect(c.route([{"request_id": "back", "tokens": [1]}])["decisions"][0]["status"] == 0, "served again")
    c.close()


def own_server(directory, name, config):
    """A second `kvmatch serve` in its own directory under `directory`, with `config`."""
    path = os.path.join(directory, name)
    os.mkdir(path)
    server = Server(path, config)
    server.start()
    return server


def test_a_decision_asks_for_a_warm_up(server):
    """A hot prefix on a worker past the ttft policy's load bound: a route that says its router
    carries out warm-ups (`warm_ups`) stays with the holder, and its decision carries `warm_up`,
    a decision of its own that the router reports like any other."""
    own = own_server(server.dir, "warm", {})
    try:
        with kc.Client.connect(own.address) as c:
            shared = prompt(1024, 5)
            for k in range(6):
                tokens = shared + prompt(16, 100 + k)
                d = c.route([{"request_id": "hot-%d" % k, "tokens": tokens, "candidates": [0],
                              "policy": "ttft"}])["decisions"][0]
                expect(d["status"] == 0, "hot route decided: %r" % d)
                c.first_token(decision_id=d["decision_id"])
            d = c.route([{"request_id": "w", "attempt_id": "a", "tokens": shared + prompt(16, 99),
                          "policy": "ttft", "warm_ups": True}])["decisions"][0]
            expect(d["status"] == 0 and d["chosen_worker"] == 0, "stays with the holder: %r" % d)
            w = d.get("warm_up")
            expect(isinstance(w, dict) and w["worker"] != 0 and w["blocks"] == 64 and
                   w["tokens"] == 1024 and w["attempt_id"] == "a:warm_up" and
                   w["decision_id"] != d["decision_id"], "warm_up %r" % w)
            for ack in (c.dispatched(decision_id=w["decision_id"], worker=w["worker"]),
                        c.first_token(decision_id=w["decision_id"]),
                        c.finished(decision_id=w["decision_id"], finish_reason="length",
                                   done_seen=True, http_status=200)):
                expect(ack["items"] == [{"status": 0}], "warm-up lifecycle acked: %r" % ack)
            plain = c.route([{"request_id": "p", "tokens": shared + prompt(16, 98),
                              "policy": "ttft"}])["decisions"][0]
            expect("warm_up" not in plain, "no warm_ups, no warm-up: %r" % plain)
    finally:
        own.stop()


def free_tcp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_refused_connection_gives_the_servers_code(server):
    """A real server at max_connections 1 with one connection held: connect fails with its
    KM_ERR_OVERLOADED over the Unix socket (where the server's close often comes before the HELLO
    is written) and over TCP."""
    port = free_tcp_port()
    own = own_server(server.dir, "refuse", {"max_connections": 1, "tcp": "127.0.0.1:%d" % port})
    held = None
    try:
        deadline = time.monotonic() + 10
        while held is None:  # the start-up check's connection may still count on its side
            try:
                held = kc.Client.connect(own.address)
            except kc.KvmatchError:
                expect(time.monotonic() < deadline, "the one connection was never taken")
                time.sleep(0.02)
        for address in (own.address, "tcp:127.0.0.1:%d" % port):
            for _ in range(20):
                expect_error(lambda: kc.Client.connect(address).close(), kc.KM_ERR_OVERLOADED,
                             "%s: a connection over max_connections" % address)
    finally:
        if held:
            held.close()
        own.stop()


def test_ids_go_on_after_reconnect(server):
    """A request id sent before a reconnect never names one sent after: waiting on it raises."""
    c = kc.Client.connect(server.address)
    first = c.send_route([{"request_id": "before", "tokens": prompt(32)}])
    c.close()
    c.reconnect()
    second = c.send_route([{"request_id": "after", "tokens": prompt(32)}])
    expect(second != first, "the id %d was used again after the reconnect" % first)
    try:
        reply = c.wait(first)
        raise AssertionError("wait on an id from before the reconnect returned %r" % reply)
    except kc.KvmatchError as e:
        expect(e.code in (kc.KM_ERR_NOT_FOUND, kc.KM_ERR_CLOSED), "raised %s" % e)
    expect(c.wait(second)["decisions"][0]["request_id"] == "after", "the new request's reply")
    c.close()


def test_overloaded_by_the_connection_budget(server):
    """A real server with a budget of 4 routes per connection: a ROUTE frame of 5 is refused at
    once with KM_ERR_OVERLOADED by name, the connection stays usable, and a pipelined burst gets
    one reply per frame, each a decision or that refusal."""
    own = own_server(server.dir, "budget", {"scheduler": {"max_connection_routes": 4,
                                                           "max_queue_wait_ms": 0}})
    try:
        with kc.Client.connect(own.address) as c:
            routes = [{"request_id": "over-%d" % i, "tokens": prompt(32, i)} for i in range(5)]
            e = expect_error(lambda: c.route(routes), kc.KM_ERR_OVERLOADED, "5 routes over a budget of 4")
            expect("max_connection_routes" in e.message, "the refusal names the limit: %s" % e.message)
            expect(c.route(routes[:4])["decisions"][0]["status"] == 0, "4 routes fit the budget")
            sent = [c.send_route([{"request_id": "burst-%d-%d" % (i, j), "tokens": prompt(512, i),
                                   "brief": True} for j in range(3)]) for i in range(40)]
            decided = refused = 0
            for rid in sent:
                reply = c.wait(rid, timeout=30)
                if reply["type"] == "ERROR":
                    expect(reply["code"] == kc.KM_ERR_OVERLOADED and reply["name"] == "KM_ERR_OVERLOADED",
                           "a burst frame failed otherwise: %r" % reply)
                    refused += 1
                else:
                    expect(len(reply["decisions"]) == 3, "one decision per route: %r" % reply)
                    decided += 1
            expect(decided + refused == 40 and decided >= 1, "decided %d, refused %d" % (decided, refused))
            expect(not c.closed, "the connection stays open after refusals")
    finally:
        own.stop()


def test_oversize_frame_is_refused(server):
    """A real server whose frame limit is 4,096 bytes: the client, which learnt the limit from
    WELCOME, refuses a larger request without sending it (the connection stays usable); a
    client holding a larger limit (an out-of-date view of the server) sends it, and reports the
    server's KM_ERR_TOO_LARGE answer as the connection's end."""
    own = own_server(server.dir, "frame", {"limits": {"max_frame_bytes": 4096}})
    try:
        with kc.Client.connect(own.address) as c:
            expect(c.welcome["limits"]["max_frame_bytes"] == 4096, "WELCOME: %r" % c.welcome["limits"])
            big = [{"request_id": "big", "tokens": prompt(3000)}]
            e = expect_error(lambda: c.route(big), kc.KM_ERR_TOO_LARGE, "the client's own check")
            expect("4096" in e.message and not c.closed, "names the limit, stays open: %s" % e.message)
            expect(c.route([{"request_id": "small", "tokens": prompt(64)}])["decisions"][0]["status"] == 0,
                   "a request within the limit is decided")
            c._max_frame_bytes = 1 << 20  # the out-of-date view: nothing stops the frame here
            e = expect_error(lambda: c.route(big, timeout=10), kc.KM_ERR_CLOSED, "the server's refusal")
            expect("KM_ERR_TOO_LARGE" in e.message, "the server's code is reported: %s" % e.message)
            expect(c.closed, "the connection is closed after it")
        with kc.Client.connect(own.address) as c:
            expect(c.route([{"request_id": "next", "tokens": prompt(64)}])["decisions"][0]["status"] == 0,
                   "the server keeps serving other connections")
    finally:
        own.stop()


def test_shutting_down_while_routes_are_in_flight(server):
    """SIGTERM while routes are in flight. A connection that does not read its replies holds the
    drain open (the drain writes every reply before it closes a connection), so the stop is certain
    to find work: a route sent on another open connection during the drain is answered
    KM_ERR_SHUTTING_DOWN by name; every route of the stalled connection is answered (decided, or
    refused the same way when it was still unread) once it reads; then both connections are
    closed (KM_ERR_CLOSED, never a hang) and the server exits 0."""
    own = own_server(server.dir, "drain", {"scheduler": {"max_connection_routes": 0,
                                                          "max_queue_wait_ms": 0,
                                                          "max_queued_routes": 1 << 20},
                                           "drain_timeout_ms": 60000})
    try:
        stalled = kc.Client.connect(own.address)
        light = kc.Client.connect(own.address)
        expect(light.route([{"request_id": "before", "tokens": prompt(64)}])["decisions"][0]["status"] == 0,
               "decided before the stop")
        # About a megabyte of replies, far over what the socket buffers: unread, they keep the
        # server draining.
        sent = [stalled.send_route([{"request_id": "q-%d-%d" % (i, j), "tokens": prompt(64, i * 64 + j)}
                                    for j in range(64)], timeout=30) for i in range(100)]
        own.proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 60
        n = 0
        while refused is None and time.monotonic() < deadline:
            try:
                light.route([{"request_id": "during-%d" % n, "tokens": prompt(64)}], timeout=10)
                n += 1  # read before the stop took effect: decided; try again
            except kc.KvmatchError as e:
                refused = e
        expect(refused is not None and refused.code == kc.KM_ERR_SHUTTING_DOWN
               and refused.name == "KM_ERR_SHUTTING_DOWN",
               "a route during the drain: %s" % refused)
        decided = shut = 0
        for rid in sent:
            reply = stalled.wait(rid, timeout=60)
            if reply["type"] == "ERROR":
                expect(reply["code"] == kc.KM_ERR_SHUTTING_DOWN and reply["name"] == "KM_ERR_SHUTTING_DOWN",
                       "a queued route: %r" % reply)
                shut += 1
            else:
                expect(len(reply["decisions"]) == 64, "one decision per route")
                decided += 1
        expect(decided + shut == len(sent), "decided %d, refused %d" % (decided, shut))
        # Once the drain ends (a few ms after the last reply is read), each connection is closed.
        for c in (stalled, light):
            closed = None
            while closed is None and time.monotonic() < deadline:
                try:
                    c.route([{"request_id": "after", "tokens": [1]}], timeout=10)
                    raise AssertionError("a route was decided after the stop")
                except kc.KvmatchError as e:
                    expect(e.code in (kc.KM_ERR_SHUTTING_DOWN, kc.KM_ERR_CLOSED), "after the drain: %s" % e)
                    if e.code == kc.KM_ERR_CLOSED:
                        closed = e
            expect(closed is not None, "the connection was closed after the drain")
        expect(own.proc.wait(timeout=60) == 0, "kvmatch serve exits 0 after the drain")
    finally:
        own.kill()


def nats_server_binary():
    return shutil.which("nats-server") or next(
        (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if os.access(p, os.X_OK)),
        None)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_decision_load_view_of_a_cluster(server):
    """Two instances sharing a real nats-server: a decision on the second says its view is the
    cluster's, with the first instance's contribution applied, fresh and not stale. Without
    nats-server it fails, as the C cluster tests do (`scripts/install-deps.sh --test` installs
    Debian's nats-server for `make test`)."""
    binary = nats_server_binary()
    if binary is None:
        raise AssertionError("nats-server is not installed (scripts/install-deps.sh --test "
                             "installs Debian's nats-server)")
    directory = tempfile.mkdtemp(prefix="kvmatch-pycluster-")
    port = free_port()
    nats = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    instances = []
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or nats.poll() is not None:
                    raise AssertionError("nats-server did not accept on port %d" % port)
                time.sleep(0.02)
        for name in ("a", "b"):
            own_dir = os.path.join(directory, name)
            os.mkdir(own_dir)
            own = Server(own_dir, {"cluster": {"url": "nats://127.0.0.1:%d" % port,
                                               "instance": "client-" + name}})
            instances.append(own)
            own.start()  # ready once it took the peers' state
        with kc.Client.connect(instances[1].address) as c:
            d = c.route([{"request_id": "cluster-1", "tokens": prompt(64, 3)}])["decisions"][0]
        expect(d["status"] == 0, "decided: %r" % d)
        expect(d["load_scope"] == "cluster", "load_scope %r" % d)
        expect(d["load_instances"] == 1, "the other instance's work is applied: %r" % d)
        age = d["load_oldest_age_ms"]
        expect(isinstance(age, float) and 0.0 <= age < 1000.0,
               "load_oldest_age_ms within the 1000 ms expiry: %r" % d)
        expect(d["load_stale_instances"] == "", "no stale instance: %r" % d)
    finally:
        for own in instances:
            own.kill()
        nats.kill()
        nats.wait()
        shutil.rmtree(directory, ignore_errors=True)


def main():
    signal.alarm(170)
    directory = tempfile.mkdtemp(prefix="kvmatch-pyclient-")
    server = Server(directory)
    tests = [test_error_names_match_the_header, test_route_and_lifecycle, test_route_errors,
             test_admin, test_remove_pools, test_pipelined, test_example,
             test_overloaded_by_the_connection_budget, test_oversize_frame_is_refused,
             test_shutting_down_while_routes_are_in_flight, test_server_goes_away_then_reconnect,
             test_refused_connection_gives_the_servers_code, test_ids_go_on_after_reconnect,
             test_decision_load_view_of_a_cluster, test_a_decision_asks_for_a_warm_up]
    failed = 0
    try:
        server.start()
        for t in tests:
            try:
                t(server)
                print("ok   %s" % t.__name__)
            except Exception as e:  # report every test, then fail
                failed += 1
                print("FAIL %s: %s: %s" % (t.__name__, type(e).__name__, e))
    finally:
        server.stop()
        log = os.path.join(directory, "serve.log")
        if failed and os.path.exists(log):
            sys.stdout.write(open(log).read()[-2000:])
        shutil.rmtree(directory, ignore_errors=True)
    print("test_server: %d of %d tests passed" % (len(tests) - failed, len(tests)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
