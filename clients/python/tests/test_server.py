#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Python client against a real `kvmatch serve` started here on a Unix socket in a temporary
directory: routes (blocking, pipelined, batched), the lifecycle reports and the outcome rule,
WORKERS / POOLS / STATUS, each error the server answers (by code and name), a server that goes
away mid-request, and reconnecting to it once it is back. The error-name table is checked against
include/kvmatch/error.h. The binary is $KM_BIN, else build/kvmatch or build-cpu/kvmatch. Run:
python tests/test_server.py (exit 0 on success); the whole run is bounded by an alarm.
Replies a real server never sends (wrong count, wrong type, unknown id) are tested against a fake
server in tests/test_python_client.py."""

import os
import re
import shutil
import signal
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

    def __init__(self, directory):
        self.dir = directory
        self.path = os.path.join(directory, "kvmatch.sock")
        self.address = "unix:" + self.path
        self.proc = None

    def start(self):
        if os.path.exists(self.path):
            os.unlink(self.path)
        args = [kvmatch_binary(), "serve", "--socket", self.path, "--records", "none",
                "--max-workers", "64", "--pool", "default:16:kv"]
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


def main():
    signal.alarm(120)
    directory = tempfile.mkdtemp(prefix="kvmatch-pyclient-")
    server = Server(directory)
    tests = [test_error_names_match_the_header, test_route_and_lifecycle, test_route_errors,
             test_admin, test_pipelined, test_example, test_server_goes_away_then_reconnect]
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
