#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The pure-Python client (clients/python/kvmatch_client.py) against a fake server written here:
a thread accepting on a temporary Unix socket under /tmp (and on 127.0.0.1 for TCP) that speaks
the framing of docs/PROTOCOL.md and answers with DECISIONs computed from each request, holding
replies and sending them in reverse order for the pipelined test, staying silent for the timeout
test, and refusing the handshake on request. Run: python3 tests/test_python_client.py (exit 0 on
success). The whole run is bounded by an alarm."""

import os
import signal
import socket
import struct
import sys
import tempfile
import threading
import time

try:
    import msgpack  # noqa: F401
except ImportError:
    # python3-msgpack is a Debian package: a python3 outside /usr/bin (pyenv) may not see it.
    if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "clients", "python"))
import kvmatch_client as kc  # noqa: E402


def choice(route, index):
    data = route.get("hashes") or route.get("tokens") or []
    return (sum(data) + index) % 7


class FakeServer:
    """modes: normal, reverse (groups of `group` replies reversed), silent_route, refuse_hello,
    late_route, miscount (one decision fewer than routes, one ACK item more than events),
    connection_error (ROUTE answered with ERROR id 0 KM_ERR_TIMEOUT, then closed), wrong_type
    (ROUTE answered with STATUS_REPLY, WORKERS with ACK whatever its action), duplicate (ROUTE
    answered twice), welcome_wrong_id (WELCOME to another id than the HELLO's), bad_id (every
    reply after the WELCOME carries bad_id(its request's id) as its id), bad_welcome_id (the
    WELCOME does), holding (ROUTE replies held until a route of request_id "release" comes, then
    sent in order before its own; those to the request_ids in wrong_type_for as STATUS_REPLY).
    In any mode, craft(request) may return the reply's payload as Raw bytes (a
    map whose keys repeat or are not str, which no dict can hold); None leaves it to the mode."""

    def __init__(self, mode="normal", tcp=False, group=8, bad_id=None, craft=None,
                 wrong_type_for=()):
        self.mode, self.group, self.bad_id, self.craft = mode, group, bad_id, craft
        self.wrong_type_for = wrong_type_for
        if tcp:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.bind(("127.0.0.1", 0))
            self.address = "tcp:127.0.0.1:%d" % self.sock.getsockname()[1]
            self.path = None
        else:
            self.path = os.path.join(tempfile.gettempdir(), "kvmatch-pytest-%d-%s.sock" % (os.getpid(), mode))
            if os.path.exists(self.path):
                os.unlink(self.path)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(self.path)
            self.address = "unix:" + self.path
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def stop(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _frame(message):
        payload = msgpack.packb(message, use_bin_type=True)
        return struct.pack(">I", len(payload)) + payload

    def _reply(self, m):
        t, rid = m.get("type"), m.get("id")
        if t == "HELLO":
            if self.mode == "refuse_hello" or m.get("protocol") != 1:
                return {"type": "ERROR", "id": rid, "code": kc.KM_ERR_INCOMPATIBLE,
                        "name": "KM_ERR_INCOMPATIBLE", "message": "protocol 1 only"}, False
            if self.mode == "welcome_wrong_id":
                rid += 1
            if self.mode == "bad_welcome_id":
                rid = self.bad_id(rid)
            return {"type": "WELCOME", "id": rid, "protocol": 1, "kvmatch_version": "0.1.0-fake",
                    "server": "fake-py", "limits": {"max_frame_bytes": 1 << 20}}, True
        if t == "ROUTE":
            if self.mode == "silent_route":
                return None, True
            if self.mode == "connection_error":
                return {"type": "ERROR", "id": 0, "code": kc.KM_ERR_TIMEOUT, "name": "KM_ERR_TIMEOUT",
                        "message": "KM_ERR_TIMEOUT: fake server gives up"}, False
            if self.mode == "wrong_type":
                return {"type": "STATUS_REPLY", "id": rid, "workers": []}, True
            if self.mode == "late_route":
                time.sleep(0.4)  # past the caller's timeout; the reply still comes
            decisions = []
            for i, r in enumerate(m["routes"]):
                w = choice(r, i)
                decisions.append({"status": 0, "request_id": r["request_id"],
                                  "attempt_id": r.get("attempt_id"),
                                  "decision_id": rid * 1000 + i, "chosen_worker": w,
                                  "chosen_depth": len(r.get("hashes", [])), "owner_worker": (w + 1) % 7,
                                  "owner_depth": 3, "source": "events", "policy": "kv",
                                  "candidates": [{"worker": w, "depth": 1, "load": {"in_flight": 2}}]})
            if self.mode == "miscount":
                decisions.pop()
            return {"type": "DECISION", "id": rid, "kvmatch_version": "0.1.0-fake",
                    "decisions": decisions}, True
        if t == "LIFECYCLE":
            items = []
            for e in m["events"]:
                sent, derived = e.get("outcome"), kc.outcome_from_stream(
                    e.get("finish_reason"), e.get("done_seen", False), e.get("http_status"), e.get("error"))
                if e.get("event") == "FINISHED" and sent == "complete" and derived != "complete":
                    items.append({"status": kc.KM_ERR_INVALID_ARGUMENT, "message": "outcome: needs evidence"})
                else:
                    items.append({"status": 0})
            if self.mode == "miscount":
                items.append({"status": 0})
            return {"type": "ACK", "id": rid, "items": items}, True
        if t == "WORKERS" and self.mode == "wrong_type":
            return {"type": "ACK", "id": rid, "items": [{"status": 0} for _ in m.get("workers", [])]}, True
        if t == "STATUS":
            return {"type": "ERROR", "id": rid, "code": -18, "name": "KM_ERR_SHUTTING_DOWN",
                    "message": "fake server is draining"}, True
        # Worded as the server's decoder words it: its code's name first.
        return {"type": "ERROR", "id": rid or 0, "code": kc.KM_ERR_PROTOCOL, "name": "KM_ERR_PROTOCOL",
                "message": 'KM_ERR_PROTOCOL: type: unknown message type "%s"' % t}, True

    def _serve(self, conn):
        with conn:
            try:
                self._serve_frames(conn)
            except OSError:
                pass  # the client closed first, as it does after a protocol error

    def _serve_frames(self, conn):
        buf, held = b"", []
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 4:
                (n,) = struct.unpack(">I", buf[:4])
                if len(buf) < 4 + n:
                    break
                m = msgpack.unpackb(buf[4:4 + n], raw=False)
                buf = buf[4 + n:]
                crafted = self.craft(m) if self.craft else None
                if crafted is not None:
                    conn.sendall(struct.pack(">I", len(crafted.data)) + crafted.data)
                    continue
                reply, keep_open = self._reply(m)
                if reply is not None and self.mode == "bad_id" and m.get("type") != "HELLO":
                    reply["id"] = self.bad_id(m.get("id"))
                if self.mode == "holding" and m.get("type") == "ROUTE":
                    request_id = m["routes"][0]["request_id"]
                    if request_id in self.wrong_type_for:
                        reply = {"type": "STATUS_REPLY", "id": m["id"], "workers": []}
                    if request_id != "release":
                        held.append(self._frame(reply))
                        continue
                    conn.sendall(b"".join(held))
                    held = []
                if reply is not None and self.mode == "duplicate" and m.get("type") == "ROUTE":
                    conn.sendall(self._frame(reply))
                if reply is not None:
                    if self.mode == "reverse" and m.get("type") != "HELLO":
                        held.append(self._frame(reply))
                        if len(held) == self.group:
                            conn.sendall(b"".join(reversed(held)))
                            held = []
                    else:
                        conn.sendall(self._frame(reply))
                if not keep_open:
                    return


class Raw:
    """Bytes that go into a crafted payload as they are."""

    def __init__(self, data):
        self.data = data


def pack(value):
    return value.data if isinstance(value, Raw) else msgpack.packb(value, use_bin_type=True)


def raw_map(*entries):
    """A msgpack map of the (key, value) entries in their order: a key may repeat, or be a value
    of any type (Raw or packed)."""
    n = len(entries)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return Raw(head + b"".join(pack(k) + pack(v) for k, v in entries))


def raw_list(*items):
    n = len(items)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
    return Raw(head + b"".join(pack(item) for item in items))


def route(i, n=4):
    return {"request_id": "req-%d" % i, "attempt_id": 0, "pool": "default",
            "hashes": [(i * 7919 + k * 104729) % (1 << 64) for k in range(2, 2 + n)]}


def check_decision(d, r, index, msg_id):
    assert d["status"] == 0, d
    assert d["request_id"] == r["request_id"], (d, r)
    assert d["decision_id"] == msg_id * 1000 + index, d
    assert d["chosen_worker"] == choice(r, index), (d, r)
    assert d["owner_worker"] == (d["chosen_worker"] + 1) % 7


def test_blocking(tcp):
    s = FakeServer(tcp=tcp)
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            assert c.welcome["kvmatch_version"] == "0.1.0-fake"
            routes = [route(i) for i in range(5)]
            reply = c.route(routes)
            assert reply["type"] == "DECISION" and len(reply["decisions"]) == 5
            for i, d in enumerate(reply["decisions"]):
                check_decision(d, routes[i], i, reply["id"])
            try:
                c.status()
                raise AssertionError("ERROR reply did not raise")
            except kc.KvmatchError as e:
                assert e.code == -18 and e.name == "KM_ERR_SHUTTING_DOWN" and "draining" in e.message
            # still usable after an ERROR reply
            assert c.route([route(9)])["decisions"][0]["status"] == 0
            assert c.outstanding == 0
    finally:
        s.stop()


def test_pipelined_out_of_order():
    s = FakeServer(mode="reverse", group=8)
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            n = 64
            routes = [route(i, 1 + i % 5) for i in range(n)]
            ids = [c.send_route([r]) for r in routes]
            assert c.outstanding == n
            for i in range(n // 2):
                reply = c.wait(ids[i])
                assert reply["id"] == ids[i]
                check_decision(reply["decisions"][0], routes[i], 0, ids[i])
            seen = set()
            for _ in range(n // 2):
                reply = c.receive()
                i = ids.index(reply["id"])
                assert i >= n // 2 and i not in seen
                seen.add(i)
                check_decision(reply["decisions"][0], routes[i], 0, ids[i])
            assert c.outstanding == 0
            try:
                c.wait(ids[0])
                raise AssertionError("wait on a returned id did not raise")
            except kc.KvmatchError as e:
                assert e.code == kc.KM_ERR_NOT_FOUND
    finally:
        s.stop()


def test_lifecycle():
    s = FakeServer()
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            ack = c.lifecycle([
                {"event": "DISPATCHED", "decision_id": 42},
                {"event": "FINISHED", "request_id": "r1", "outcome": "complete", "http_status": 200},
                {"event": "FINISHED", "request_id": "r2", "finish_reason": "stop", "done_seen": True,
                 "cached_tokens": 512},
            ])
            assert [i["status"] for i in ack["items"]] == [0, kc.KM_ERR_INVALID_ARGUMENT, 0], ack
            assert c.finished(request_id="r3", finish_reason="stop", done_seen=True)["items"][0]["status"] == 0
    finally:
        s.stop()


def test_outcome_rule():
    assert kc.outcome_from_stream("stop", True, 200) == "complete"
    assert kc.outcome_from_stream("stop", False, 200) == "incomplete"  # HTTP 200 is not completion
    assert kc.outcome_from_stream(None, True, 200) == "incomplete"
    assert kc.outcome_from_stream("stop", True, 502) == "error"
    assert kc.outcome_from_stream("stop", True, 200, "reset") == "error"


def test_timeout_then_usable():
    s = FakeServer(mode="silent_route")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            t0 = time.monotonic()
            try:
                c.route([route(1)], timeout=0.2)
                raise AssertionError("no timeout")
            except TimeoutError:
                pass
            # It waited for its timeout; the upper bound (50 times it) only catches a route that
            # ignores its timeout and waits for a reply the silent server never sends.
            assert 0.15 <= time.monotonic() - t0 < 10.0
            ack = c.lifecycle([{"event": "DISPATCHED", "decision_id": 1}])
            assert ack["items"][0]["status"] == 0
    finally:
        s.stop()


def test_late_reply_after_a_timeout_is_dropped():
    # A blocking call that timed out gives its request up: its late reply is read and dropped,
    # not kept for a wait() that will never come (a kept one would be a leak for a blocking-only
    # user).
    s = FakeServer(mode="late_route")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            try:
                c.route([route(1)], timeout=0.1)
                raise AssertionError("no timeout")
            except TimeoutError:
                pass
            assert c.outstanding == 0, c.outstanding
            ack = c.lifecycle([{"event": "DISPATCHED", "decision_id": 1}], timeout=5)
            assert ack["items"][0]["status"] == 0
            assert c.outstanding == 0 and not c._kept, (c.outstanding, c._kept)
    finally:
        s.stop()


def give_up_routes(c, n):
    """n blocking routes that time out on a server that holds their replies: the request_ids
    given-up-0 and on, in the order of their request ids."""
    given_up = 0
    while given_up < n:
        sent = c._next_id
        try:
            c.route([dict(route(given_up), request_id="given-up-%d" % given_up)], timeout=0.001)
            raise AssertionError("a held route was answered")
        except TimeoutError:
            pass
        if c._next_id > sent:  # else it timed out before it was sent: tried again
            given_up += 1


def test_given_up_calls_are_bounded():
    # A blocking call that timed out gives its request up. The ids of at most 4096 of them are
    # kept, the lowest forgotten past that, so a server that never answers cannot make the client
    # grow with every call that times out. A late reply to a kept id is checked, then dropped;
    # one to a forgotten id is dropped unchecked; the connection stays usable.
    assert kc.MAX_ABANDONED == 4096
    s = FakeServer(mode="holding", wrong_type_for={"given-up-0"})
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            give_up_routes(c, kc.MAX_ABANDONED + 10)
            assert c.outstanding == 0, c.outstanding
            assert len(c._abandoned) <= kc.MAX_ABANDONED, len(c._abandoned)
            # The held replies come before this one: given-up-0's, of the wrong type, among them.
            release = dict(route(1), request_id="release")
            reply = c.route([release], timeout=10)
            check_decision(reply["decisions"][0], release, 0, reply["id"])
            assert not c.closed and c.outstanding == 0 and not c._abandoned, len(c._abandoned)
        with kc.Client.connect(s.address, timeout=5) as c:
            give_up_routes(c, 1)
            expect_protocol_error(lambda: c.route([dict(route(1), request_id="release")],
                                                  timeout=10), "(ROUTE) with STATUS_REPLY")
            assert c.closed
    finally:
        s.stop()


def test_send_with_no_time_left_keeps_the_connection():
    # A send whose deadline has already passed sends nothing, so the stream is intact: it raises
    # TimeoutError and the connection stays usable.
    s = FakeServer()
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            try:
                c.send_route([route(1)], timeout=0)
                raise AssertionError("no timeout")
            except TimeoutError:
                pass
            assert c.outstanding == 0
            d = c.route([route(2)], timeout=5)
            check_decision(d["decisions"][0], route(2), 0, d["id"])
    finally:
        s.stop()


def test_send_whose_deadline_passes_before_its_first_byte_keeps_the_connection():
    # The deadline passes after the send began but before any byte went out (the client's clock
    # reads the real time twice, to set the deadline and to check it before sending, and is past
    # the deadline from then on): nothing was sent, so the send raises TimeoutError, its id is not
    # taken and the connection stays usable.
    s = FakeServer()
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            real = kc.time
            readings = [0]

            def monotonic():
                readings[0] += 1
                return real.monotonic() + (0.0 if readings[0] <= 2 else 3600.0)

            first_id = c._next_id
            kc.time = type("clock", (), {"monotonic": staticmethod(monotonic)})
            try:
                c.send_route([route(1)], timeout=60)
                raise AssertionError("no timeout")
            except TimeoutError as e:
                assert "before any byte" in str(e), e
            finally:
                kc.time = real
            assert not c.closed and c.outstanding == 0 and c._next_id == first_id
            d = c.route([route(2)], timeout=5)
            check_decision(d["decisions"][0], route(2), 0, d["id"])
    finally:
        s.stop()


class FailingSocket:
    """The client's socket, with send or recv raising OSError(errno_value) once armed: a socket
    error other than a reset or a broken pipe (ETIMEDOUT on a TCP connection whose peer vanished)."""

    def __init__(self, sock, errno_value):
        self._sock, self._errno, self.fail_send, self.fail_recv = sock, errno_value, False, False

    def send(self, data):
        if self.fail_send:
            raise OSError(self._errno, os.strerror(self._errno))
        return self._sock.send(data)

    def recv(self, n):
        if self.fail_recv:
            raise OSError(self._errno, os.strerror(self._errno))
        return self._sock.recv(n)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_socket_error_closes_the_connection():
    # A socket error other than a reset or a broken pipe, in a send or while a reply is read,
    # leaves the stream in an unknown state: it reaches the caller as raised, and the connection
    # is closed (the next call raises ConnectionClosed instead of writing after a partial frame).
    # The kernel's ETIMEDOUT is one too, though Python raises it as the TimeoutError a deadline
    # raises: it carries an errno, which a deadline's does not.
    import errno
    s = FakeServer()
    try:
        for side, code in (("send", errno.EHOSTUNREACH), ("recv", errno.EHOSTUNREACH),
                           ("send", errno.ETIMEDOUT), ("recv", errno.ETIMEDOUT)):
            c = kc.Client.connect(s.address, timeout=5)
            failing = FailingSocket(c._sock, code)
            c._sock = failing
            setattr(failing, "fail_" + side, True)
            try:
                c.route([route(1)], timeout=5)
                raise AssertionError("no error (%s)" % side)
            except kc.ConnectionClosed:
                raise AssertionError("the socket error was replaced (%s)" % side)
            except OSError as e:
                assert e.errno == code, (side, e)
            assert c.closed, "the connection stayed open after a %s error" % side
            try:
                c.route([route(2)], timeout=5)
                raise AssertionError("a call after the error was sent (%s)" % side)
            except kc.ConnectionClosed:
                pass
            c.close()
    finally:
        s.stop()


def expect_protocol_error(call, words):
    try:
        call()
        raise AssertionError("no protocol error")
    except kc.KvmatchError as e:
        assert e.code == kc.KM_ERR_PROTOCOL and words in e.message, (e.code, e.message)


def test_reply_count_differs_from_the_request():
    # A DECISION holds one decision per route, an ACK one item per event (docs/PROTOCOL.md): a
    # reply whose count differs is refused and the connection closed, blocking or pipelined, so a
    # caller reading decisions[i] for route i never gets another route's decision or an
    # IndexError: such a reply is never returned as it came.
    s = FakeServer(mode="miscount")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            expect_protocol_error(lambda: c.route([route(1), route(2)]), "1 decision for 2 routes")
            try:
                c.route([route(1)])
                raise AssertionError("the connection stayed open")
            except kc.ConnectionClosed:
                pass
        with kc.Client.connect(s.address, timeout=5) as c:
            c.send_route([route(1)])
            expect_protocol_error(lambda: c.receive(timeout=5), "0 decisions for 1 route")
        with kc.Client.connect(s.address, timeout=5) as c:
            expect_protocol_error(lambda: c.dispatched(decision_id=1), "2 items for 1 event")
    finally:
        s.stop()


def test_reply_of_another_type_than_its_requests():
    # A reply is an ERROR or of its request's type (docs/PROTOCOL.md, "Reading replies"): another
    # is refused and the connection closed, blocking or pipelined, as the C client does (a ROUTE's
    # STATUS_REPLY is not returned as its answer).
    s = FakeServer(mode="wrong_type")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            # The right types pass: ACK to a WORKERS update and to a LIFECYCLE.
            assert c.workers("update", [{"pool": "default", "worker": 1, "healthy": False}])["type"] == "ACK"
            assert c.dispatched(decision_id=1)["type"] == "ACK"
            expect_protocol_error(lambda: c.route([route(1)]), "(ROUTE) with STATUS_REPLY")
            try:
                c.route([route(1)])
                raise AssertionError("the connection stayed open")
            except kc.ConnectionClosed:
                pass
        with kc.Client.connect(s.address, timeout=5) as c:
            c.send_route([route(1)])
            expect_protocol_error(lambda: c.receive(timeout=5), "(ROUTE) with STATUS_REPLY")
        with kc.Client.connect(s.address, timeout=5) as c:
            expect_protocol_error(lambda: c.workers("list"), "(WORKERS) with ACK")
    finally:
        s.stop()


def test_reply_to_an_id_not_outstanding():
    # Each request gets exactly one reply: a second one to an id (or one to an id never sent) is
    # refused and the connection closed, as the C client does (receive does not return the
    # duplicate again, and wait does not keep it).
    s = FakeServer(mode="duplicate")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            a, b = c.send_route([route(1)]), c.send_route([route(2)])
            expect_protocol_error(lambda: c.wait(b, timeout=5), "request %d, which is not waiting" % a)
        with kc.Client.connect(s.address, timeout=5) as c:
            a, b = c.send_route([route(1)]), c.send_route([route(2)])
            assert c.receive(timeout=5)["id"] == a
            expect_protocol_error(lambda: c.receive(timeout=5), "request %d, which is not waiting" % a)
    finally:
        s.stop()


def test_reply_id_that_is_not_a_request_id():
    # An id is a uint64 (docs/PROTOCOL.md): a reply whose id is a list, a map, a bool, a negative
    # or a float is a protocol error that closes the connection, blocking or pipelined; a float
    # equal to the id sent, or an unhashable one, must not pass for it nor escape as TypeError.
    bad_ids = [("a list", lambda rid: [rid]), ("a map", lambda rid: {"id": rid}),
               ("a bool", lambda rid: True), ("a negative", lambda rid: -rid),
               ("a float", lambda rid: float(rid))]
    for what, bad_id in bad_ids:
        s = FakeServer(mode="bad_id", bad_id=bad_id)
        try:
            for use in ("route", "receive", "wait"):
                with kc.Client.connect(s.address, timeout=5) as c:
                    if use == "route":
                        call = lambda: c.route([route(1)])
                    elif use == "receive":
                        c.send_route([route(1)])
                        call = lambda: c.receive(timeout=5)
                    else:
                        rid = c.send_route([route(1)])
                        call = lambda: c.wait(rid, timeout=5)
                    try:
                        expect_protocol_error(call, "is not a non-negative integer")
                    except Exception as e:
                        raise AssertionError("%s id, %s: %r" % (what, use, e))
                    assert c.closed and c.outstanding == 0, (what, use, c.closed, c.outstanding)
        finally:
            s.stop()
        s = FakeServer(mode="bad_welcome_id", bad_id=bad_id)
        try:
            expect_protocol_error(lambda: kc.Client.connect(s.address, timeout=5), "not the HELLO")
        except Exception as e:
            raise AssertionError("%s id, WELCOME: %r" % (what, e))
        finally:
            s.stop()


def expect_parse_error(call, words):
    try:
        call()
        raise AssertionError("no parse error")
    except kc.KvmatchError as e:
        assert e.code == kc.KM_ERR_PARSE and words in e.message, (e.code, e.message)


def given(twice, *entries):
    """The entries when twice, else none: the copy of a key that makes it appear twice."""
    return list(entries) if twice else []


def decision_map(twice):
    return raw_map(("status", 0), ("request_id", "r"), ("decision_id", 7), ("chosen_worker", 2),
                   *given(twice, ("chosen_worker", 3)), ("source", "events"))


def worker_map(twice_worker, twice_load):
    load = raw_map(("in_flight", 1), *given(twice_load, ("in_flight", 2)))
    return raw_map(("pool", "default"), ("worker", 1), *given(twice_worker, ("state", "LIVE"),
                                                              ("worker", 2)),
                   ("state", "LIVE"), ("load", load))


def pool_map(twice_pool, twice_param):
    params = raw_map(("temperature", 0.5), *given(twice_param, ("temperature", 2.0)))
    return raw_map(("name", "default"), ("block_size", 16), *given(twice_pool, ("name", "other")),
                   ("params", params))


# (what, the request answered, the call, its reply: a map of it holds a key twice when twice)
KEY_TWICE = [
    ("the message's field", "ROUTE", lambda c: c.route([route(1)]),
     lambda rid, twice: raw_map(("type", "DECISION"), ("id", rid), ("kvmatch_version", "0.1"),
                                ("decisions", raw_list(decision_map(False))),
                                *given(twice, ("kvmatch_version", "0.2")))),
    ("the message's unknown key", "ROUTE", lambda c: c.route([route(1)]),
     lambda rid, twice: raw_map(("type", "DECISION"), ("id", rid), ("later", 1),
                                ("decisions", raw_list(decision_map(False))),
                                *given(twice, ("later", 2)))),
    ("the message's id", "ROUTE", lambda c: c.route([route(1)]),
     lambda rid, twice: raw_map(("type", "DECISION"), ("id", rid), *given(twice, ("id", rid)),
                                ("decisions", raw_list(decision_map(False))))),
    ("a decision", "ROUTE", lambda c: c.route([route(1)]),
     lambda rid, twice: raw_map(("type", "DECISION"), ("id", rid),
                                ("decisions", raw_list(decision_map(twice))))),
    ("an ACK item", "LIFECYCLE", lambda c: c.dispatched(decision_id=7),
     lambda rid, twice: raw_map(("type", "ACK"), ("id", rid), ("items", raw_list(raw_map(
         ("status", 0), *given(twice, ("status", -15))))))),
    ("a worker", "WORKERS", lambda c: c.workers("list"),
     lambda rid, twice: raw_map(("type", "WORKER_LIST"), ("id", rid),
                                ("workers", raw_list(worker_map(twice, False))))),
    ("a worker's load", "WORKERS", lambda c: c.workers("list"),
     lambda rid, twice: raw_map(("type", "WORKER_LIST"), ("id", rid),
                                ("workers", raw_list(worker_map(False, twice))))),
    ("a STATUS_REPLY's worker", "STATUS", lambda c: c.status(),
     lambda rid, twice: raw_map(("type", "STATUS_REPLY"), ("id", rid),
                                ("kvmatch_version", "0.1"),
                                ("workers", raw_list(worker_map(False, False),
                                                     worker_map(twice, False))))),
    ("a pool", "POOLS", lambda c: c.pools("list"),
     lambda rid, twice: raw_map(("type", "POOL_LIST"), ("id", rid),
                                ("pools", raw_list(pool_map(twice, False))))),
    ("a pool's params", "POOLS", lambda c: c.pools("list"),
     lambda rid, twice: raw_map(("type", "POOL_LIST"), ("id", rid),
                                ("pools", raw_list(pool_map(False, twice))))),
]


def welcome_map(hello_id, twice_field, twice_limit):
    limits = raw_map(("max_frame_bytes", 1 << 20), ("max_batch_items", 64),
                     *given(twice_limit, ("max_frame_bytes", 1024)))
    return raw_map(("type", "WELCOME"), ("id", hello_id), ("protocol", 1),
                   *given(twice_field, ("protocol", 1)), ("kvmatch_version", "0.1.0-fake"),
                   ("limits", limits))


def test_key_twice_in_any_map_of_a_reply():
    # A key that appears twice in one map is an error, a field's name or not (docs/PROTOCOL.md):
    # in every map of a reply (the message, a decision, an ACK item, a worker and its load, a
    # pool and its params) it fails the reply with KM_ERR_PARSE naming the key and closes the
    # connection, blocking or pipelined; the same reply with the key once is read.
    for what, request, call, reply in KEY_TWICE:
        for twice in (False, True):
            craft = (lambda m, reply=reply, request=request, twice=twice:
                     reply(m["id"], twice) if m.get("type") == request else None)
            s = FakeServer(craft=craft)
            try:
                with kc.Client.connect(s.address, timeout=5) as c:
                    if not twice:
                        assert call(c)["type"] != "ERROR" and not c.closed, what
                        continue
                    try:
                        expect_parse_error(lambda: call(c), "appears twice")
                    except Exception as e:
                        raise AssertionError("%s: %r" % (what, e))
                    assert c.closed and c.outstanding == 0, (what, c.closed, c.outstanding)
                if request == "ROUTE" and twice:
                    with kc.Client.connect(s.address, timeout=5) as c:
                        c.send_route([route(1)])
                        expect_parse_error(lambda: c.receive(timeout=5), "appears twice")
                        assert c.closed, what
            finally:
                s.stop()
    for field, limit in ((False, False), (True, False), (False, True)):
        s = FakeServer(craft=lambda m, field=field, limit=limit: welcome_map(m["id"], field, limit)
                       if m.get("type") == "HELLO" else None)
        try:
            if not field and not limit:
                with kc.Client.connect(s.address, timeout=5) as c:
                    assert c.welcome["limits"]["max_batch_items"] == 64
                continue
            expect_parse_error(lambda: kc.Client.connect(s.address, timeout=5), "appears twice")
        finally:
            s.stop()


def odd_entries():
    """Entries whose key is not a str: an int, a negative, nil, a bool, a float, a bin, an array, a
    map (holding a key twice) and an ext, each with a value that nests and holds names a reader
    looks for."""
    value = raw_list(1, raw_map(("type", "ERROR"), ("id", 0), ("status", -8)), ["id"])
    keys = [7, -3, None, True, 1.5, b"type", raw_list("id", raw_list(2, raw_map(("id", 1), ("id", 2)))),
            raw_map(("type", raw_map(("x", 1))), ("type", 2)), Raw(b"\xd4\x01\x02")]
    return [(key, value) for key in keys]


def test_entries_whose_key_is_not_a_str_are_ignored():
    # Entries whose key is not a str are ignored (docs/PROTOCOL.md), key and value whole however
    # they nest, in every map of a reply: the message, WELCOME and its limits, a decision, an ACK
    # item, a worker and its load, a pool. The reply reads as it would without them.
    odd = odd_entries()
    decision = [("status", 0), ("request_id", "r"), ("decision_id", 7), ("chosen_worker", 2),
                ("source", "events")]
    worker = [("pool", "default"), ("worker", 1)]
    load = [("in_flight", 3)]
    pool = [("name", "default"), ("block_size", 16)]
    replies = {
        "HELLO": lambda rid: raw_map(*odd[:4], ("type", "WELCOME"), ("id", rid), *odd[4:],
                                     ("protocol", 1), ("kvmatch_version", "0.1.0-fake"),
                                     ("limits", raw_map(*odd, ("max_batch_items", 64)))),
        "ROUTE": lambda rid: raw_map(*odd[:5], ("type", "DECISION"), ("id", rid), *odd[5:],
                                     ("decisions", raw_list(raw_map(*decision[:2], *odd,
                                                                    *decision[2:])))),
        "LIFECYCLE": lambda rid: raw_map(("type", "ACK"), ("id", rid), *odd,
                                         ("items", raw_list(raw_map(*odd, ("status", -15))))),
        "WORKERS": lambda rid: raw_map(("type", "WORKER_LIST"), *odd, ("id", rid),
                                       ("workers", raw_list(raw_map(*worker, *odd, (
                                           "load", raw_map(*odd, *load)))))),
        "POOLS": lambda rid: raw_map(("type", "POOL_LIST"), ("id", rid),
                                     ("pools", raw_list(raw_map(*odd, *pool)))),
    }
    s = FakeServer(craft=lambda m: replies[m["type"]](m["id"]))
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            assert c.welcome == {"type": "WELCOME", "id": 1, "protocol": 1,
                                 "kvmatch_version": "0.1.0-fake",
                                 "limits": {"max_batch_items": 64}}, c.welcome
            reply = c.route([route(1)])
            assert reply == {"type": "DECISION", "id": reply["id"],
                             "decisions": [dict(decision)]}, reply
            reply = c.dispatched(decision_id=7)
            assert reply == {"type": "ACK", "id": reply["id"],
                             "items": [{"status": kc.KM_ERR_NOT_FOUND}]}, reply
            reply = c.workers("list")
            assert reply["workers"] == [dict(worker, load=dict(load))], reply
            reply = c.pools("list")
            assert reply["pools"] == [dict(pool)], reply
            assert not c.closed and c.outstanding == 0
    finally:
        s.stop()


def test_outstanding_after_a_final_error():
    # After a final error no reply is read: outstanding forgets the requests whose reply had not
    # arrived and keeps counting a kept one until it is returned, so a caller draining replies
    # until outstanding is 0 gets there (it does not go on counting all three).
    s = FakeServer(mode="duplicate")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            a, b, third = (c.send_route([route(i)]) for i in range(3))
            expect_protocol_error(lambda: c.wait(third, timeout=5), "request %d, which is not waiting" % a)
            assert c.outstanding == 1, c.outstanding  # a's first reply, kept
            assert c.receive(timeout=5)["id"] == a
            assert c.outstanding == 0, c.outstanding
            for call in (lambda: c.receive(timeout=5), lambda: c.wait(b, timeout=5)):
                try:
                    call()
                    raise AssertionError("a closed client read on")
                except kc.ConnectionClosed:
                    pass
    finally:
        s.stop()


def test_connection_level_error_closes_whatever_its_code():
    # An ERROR of id 0 means the server closes the connection: ConnectionClosed, whatever code it
    # carries, the server's code and words in the message (not a KvmatchError with the server's
    # code, here KM_ERR_TIMEOUT, on a client just closed).
    s = FakeServer(mode="connection_error")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            try:
                c.route([route(1)])
                raise AssertionError("no error")
            except kc.ConnectionClosed as e:
                assert "KM_ERR_TIMEOUT" in e.message and "gives up" in e.message, e.message
    finally:
        s.stop()


def test_server_error_named_once():
    # The server words what its decoder refused as "KM_ERR_NAME: field: ...": the error raised
    # names the code once, as the C client's last error does; receive returns the server's words
    # as sent (str() never reads "KM_ERR_PROTOCOL: KM_ERR_PROTOCOL: type: ...").
    s = FakeServer()
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            try:
                c.call({"type": "BOGUS"})
                raise AssertionError("ERROR reply did not raise")
            except kc.KvmatchError as e:
                assert str(e) == 'KM_ERR_PROTOCOL: type: unknown message type "BOGUS"', str(e)
            c.send({"type": "BOGUS"})
            assert c.receive(timeout=5)["message"].startswith("KM_ERR_PROTOCOL: type: ")
    finally:
        s.stop()
    s = FakeServer(mode="connection_error")
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            try:
                c.route([route(1)])
                raise AssertionError("no error")
            except kc.ConnectionClosed as e:
                assert str(e).count("KM_ERR_TIMEOUT") == 1 and "gives up" in str(e), str(e)
    finally:
        s.stop()


def test_error_whose_code_is_not_a_negative_int():
    # An ERROR's code is a negative int (docs/PROTOCOL.md). One that is nil, absent, 0, positive
    # or not an int, with no name, is raised as KM_ERR_PROTOCOL (as the Go and Rust clients read
    # it), never a TypeError or a KvmatchError whose code is not a code; the reply had a valid id,
    # so the connection stays open. A handshake refused so is KM_ERR_PROTOCOL too. A message that
    # is not a str reads as "".
    for code in (None, 0, 5, "x", 1.5, -15):
        error = {"type": "ERROR", "message": "fake" if code != -15 else None}
        if code is not None:
            error["code"] = code
        want = (-15, "KM_ERR_NOT_FOUND", "") if code == -15 else \
            (kc.KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL", "fake")
        s = FakeServer(craft=lambda m, error=error: Raw(msgpack.packb(dict(error, id=m["id"])))
                       if m.get("type") == "STATUS" else None)
        try:
            with kc.Client.connect(s.address, timeout=5) as c:
                try:
                    c.status()
                    raise AssertionError("code %r: no error" % (code,))
                except kc.KvmatchError as e:
                    assert (e.code, e.name, e.message) == want, (code, e.code, e.name, e.message)
                assert not c.closed, code
                assert c.route([route(1)])["decisions"][0]["status"] == 0, code
        finally:
            s.stop()
        s = FakeServer(craft=lambda m, error=error: Raw(msgpack.packb(dict(error, id=m["id"])))
                       if m.get("type") == "HELLO" else None)
        try:
            try:
                kc.Client.connect(s.address, timeout=5)
                raise AssertionError("code %r: the handshake did not fail" % (code,))
            except kc.KvmatchError as e:
                assert (e.code, e.name) == want[:2], (code, e.code, e.name)
        finally:
            s.stop()


def test_connect_errors():
    s = FakeServer(mode="refuse_hello")
    try:
        kc.Client.connect(s.address, timeout=5)
        raise AssertionError("refused handshake did not raise")
    except kc.KvmatchError as e:
        assert e.code == kc.KM_ERR_INCOMPATIBLE and "protocol 1 only" in e.message
    finally:
        s.stop()
    s = FakeServer(mode="welcome_wrong_id")
    try:
        # A WELCOME answers the HELLO, with its id, as the C client checks: a WELCOME to another
        # id is refused.
        expect_protocol_error(lambda: kc.Client.connect(s.address, timeout=5), "not the HELLO")
    finally:
        s.stop()
    for bad in ("http://x", "tcp:127.0.0.1", "unix:"):
        try:
            kc.Client.connect(bad, timeout=1)
            raise AssertionError("bad address %r accepted" % bad)
        except kc.KvmatchError as e:
            assert e.code == kc.KM_ERR_INVALID_ARGUMENT
    try:
        kc.Client.connect("unix:/tmp/kvmatch-pytest-no-such.sock", timeout=1)
        raise AssertionError("connect to a missing socket succeeded")
    except OSError:
        pass


def test_welcome_limits_read_as_the_protocol_types_them():
    # WELCOME's max_frame_bytes is a u32 (docs/PROTOCOL.md) and nil is the same as absent: nil or
    # absent (and 0, no limit a server announces) keep the default 16 MiB, and the client routes;
    # limits that are not a map, or a max_frame_bytes that is not a u32, fail the connect with
    # KM_ERR_PARSE, the socket closed, as the Go and Rust clients refuse them.
    def welcome(limits):
        return lambda m: (Raw(msgpack.packb({"type": "WELCOME", "id": m["id"], "protocol": 1,
                                             "kvmatch_version": "0.1.0-fake", "limits": limits}))
                          if m.get("type") == "HELLO" else None)
    for limits in ({"max_frame_bytes": None}, {"max_frame_bytes": 0}, {}, None):
        s = FakeServer(craft=welcome(limits))
        try:
            with kc.Client.connect(s.address, timeout=5) as c:
                assert c._max_frame_bytes == kc.DEFAULT_MAX_FRAME_BYTES, (limits, c._max_frame_bytes)
                assert c.route([route(1)])["decisions"][0]["status"] == 0, limits
        finally:
            s.stop()
    for limits in ([1], "big", {"max_frame_bytes": "big"}, {"max_frame_bytes": 1 << 32},
                   {"max_frame_bytes": -1}, {"max_frame_bytes": True}, {"max_frame_bytes": 4096.0}):
        s = FakeServer(craft=welcome(limits))
        closed = []  # the peers of the sockets closed: the client's is the server's path

        def peer(sock):
            try:
                return sock.getpeername()
            except OSError:
                return None
        real_close = socket.socket.close
        socket.socket.close = lambda sock: (closed.append(peer(sock)), real_close(sock))[1]
        try:
            expect_parse_error(lambda: kc.Client.connect(s.address, timeout=5), "limits")
            assert s.path in closed, "the socket of a refused WELCOME (limits %r) was left open" % (limits,)
        finally:
            socket.socket.close = real_close
            s.stop()


def test_frame_limit_client_side():
    s = FakeServer()
    try:
        with kc.Client.connect(s.address, timeout=5) as c:
            # The fake server's WELCOME says max_frame_bytes = 1 MiB.
            try:
                c.route([{"request_id": "big", "tokens": list(range(400000))}])
                raise AssertionError("oversize frame was sent")
            except kc.KvmatchError as e:
                assert e.code == kc.KM_ERR_TOO_LARGE
            assert c.route([route(3)])["decisions"][0]["status"] == 0
    finally:
        s.stop()


def test_connect_waits_while_the_listen_queue_is_full():
    """A Unix server whose listen queue is full answers connect with EAGAIN: the client tries
    again within its timeout, as a blocking connect would wait, says so when the queue stays
    full, and is connected once the server accepts."""
    path = os.path.join(tempfile.gettempdir(), "kvmatch-pytest-%d-queue.sock" % os.getpid())
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)  # room for one connection not yet accepted
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    filler.connect(path)
    try:
        t0 = time.monotonic()
        try:
            kc.Client.connect("unix:" + path, timeout=0.3)
            raise AssertionError("connected to a server that accepts nothing")
        except TimeoutError as e:
            took = time.monotonic() - t0
            assert "listen queue" in str(e), e
            # It kept trying for its timeout; the upper bound only catches one it ignores.
            assert 0.25 <= took < 10.0, took

        def accept_later():
            time.sleep(0.2)
            first, _ = listener.accept()
            first.close()
            conn, _ = listener.accept()
            with conn:
                (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
                hello = msgpack.unpackb(conn.recv(n, socket.MSG_WAITALL), raw=False)
                welcome = msgpack.packb({"type": "WELCOME", "id": hello["id"], "protocol": 1,
                                         "kvmatch_version": "0.1.0-fake", "server": "fake-queue",
                                         "limits": {"max_frame_bytes": 1 << 20}})
                conn.sendall(struct.pack(">I", len(welcome)) + welcome)
                conn.recv(1)  # until the client closes

        thread = threading.Thread(target=accept_later, daemon=True)
        thread.start()
        with kc.Client.connect("unix:" + path, timeout=5) as c:
            assert c.welcome["server"] == "fake-queue", c.welcome
        thread.join(5)
    finally:
        filler.close()
        listener.close()
        os.unlink(path)


def main():
    signal.alarm(60)
    tests = [lambda: test_blocking(False), lambda: test_blocking(True), test_pipelined_out_of_order,
             test_socket_error_closes_the_connection,
             test_lifecycle, test_outcome_rule, test_timeout_then_usable,
             test_late_reply_after_a_timeout_is_dropped, test_given_up_calls_are_bounded,
             test_send_with_no_time_left_keeps_the_connection,
             test_send_whose_deadline_passes_before_its_first_byte_keeps_the_connection,
             test_reply_count_differs_from_the_request, test_reply_of_another_type_than_its_requests,
             test_reply_to_an_id_not_outstanding, test_reply_id_that_is_not_a_request_id,
             test_key_twice_in_any_map_of_a_reply,
             test_entries_whose_key_is_not_a_str_are_ignored,
             test_outstanding_after_a_final_error,
             test_connection_level_error_closes_whatever_its_code, test_server_error_named_once,
             test_error_whose_code_is_not_a_negative_int,
             test_connect_errors, test_welcome_limits_read_as_the_protocol_types_them,
             test_frame_limit_client_side, test_connect_waits_while_the_listen_queue_is_full]
    for t in tests:
        t()
    print("test_python_client: %d tests passed" % len(tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
