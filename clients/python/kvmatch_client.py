# SPDX-License-Identifier: Apache-2.0
"""Pure-Python client of `kvmatch serve` (docs/PROTOCOL.md), on the standard library's socket
module and python3-msgpack.

Frames are a 4-byte big-endian payload length and one msgpack map with "type" and "id". Messages
are plain dicts with the wire field names, so everything in docs/PROTOCOL.md is usable as written.
A reply's dicts hold only its str keys: an entry whose key is not a str (an int, a bin, an array,
a map, ...) is dropped, key and value whole, at any depth, as docs/PROTOCOL.md says.
msgpack nil reads as ``None``: a decision's ``load_value`` is ``None`` when the policy weighed no
load (``round_robin``), never NaN, so a decision dict can go to ``json.dumps`` as it is.

Blocking use::

    with Client.connect("unix:/tmp/kvmatch.sock", timeout=5.0) as c:
        reply = c.route([{"request_id": "r1", "pool": "default", "tokens": [1, 2, 3]}])
        for decision in reply["decisions"]:
            print(decision["chosen_worker"], decision.get("owner_worker"))

Pipelined use: ``send_route`` / ``send_lifecycle`` / ``send`` return the request id at once;
``receive`` returns the next reply to arrive (any id), ``wait(id)`` the reply to one id; replies that
arrive while waiting for another id are kept and handed out later.

A reply returned is an ERROR or of its request's type (docs/PROTOCOL.md, "Reading replies"): a
DECISION to a ROUTE, holding one decision per route, in order; an ACK to a LIFECYCLE (or DISPATCHED
/ FIRST_TOKEN / FINISHED) or a WORKERS / POOLS add, remove, update, holding one item per event,
worker or pool; a WORKER_LIST / POOL_LIST to a list; a STATUS_REPLY to STATUS. A reply of another
type, or whose count differs, is a protocol error (below).

Errors: an ERROR reply to a blocking call raises ``KvmatchError`` carrying ``code``, ``name`` and
``message`` (the server's words less a leading name of the code, which ``str()`` puts in front; a
code that is not a negative int reads as -16 ``KM_ERR_PROTOCOL``);
``receive`` / ``wait`` return ERROR replies as dicts, the server's words as sent. A timeout raises
``TimeoutError`` and the connection stays usable (a blocking call that timed out gives its
request up: its reply, if it comes, is dropped, checked as any reply is while at most
``MAX_ABANDONED`` (4096) given-up calls await theirs; past that the lowest ids are forgotten and
a reply to one is dropped unchecked; a ``wait`` that timed out may be retried). A
closed or broken connection raises ``ConnectionClosed`` (a ``KvmatchError`` with code -20; also
for a connection-level ERROR, id 0, whatever its code, which the message names) and the client
stays closed. Any other socket error (``OSError``: the kernel's ``ETIMEDOUT``, which Python raises
as a ``TimeoutError`` with an errno, ``EHOSTUNREACH``, ...) is raised as it came and closes the
connection too. So does a reply that cannot be read (one holding a key twice in any of its maps,
at any depth, included), does not fit its request, has an id that is not a non-negative integer
or answers an id that is not outstanding (never sent, or answered already): it raises a
``KvmatchError`` with code -7 ``KM_ERR_TOO_LARGE``, -8 ``KM_ERR_PARSE`` or -16
``KM_ERR_PROTOCOL`` and closes the connection.
A Client is not thread-safe: use one per thread. After any failure that closed it,
``reconnect()`` dials the same address again (the requests that were in flight are not resent).
"""

import socket
import struct
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import msgpack

Message = Dict[str, Any]

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/tmp/kvmatch.sock"
DEFAULT_MAX_FRAME_BYTES = 16 << 20
CLIENT_NAME = "kvmatch-python"
# The ids of blocking calls given up (timed out) kept so that their late replies are checked and
# dropped; past this many the lowest are forgotten, so a server that never answers cannot make the
# client grow with every call that times out.
MAX_ABANDONED = 4096

# Every km_status code (include/kvmatch/error.h): a decision's or ACK item's "status" and an
# ERROR's "code" are one of these; error_name() gives the name.
KM_OK = 0
KM_ERR_INVALID_ARGUMENT = -1
KM_ERR_NULL_POINTER = -2
KM_ERR_BLOCK_SIZE = -3
KM_ERR_WORKER_RANGE = -4
KM_ERR_OUT_OF_MEMORY = -5
KM_ERR_MEMORY_CAP = -6
KM_ERR_TOO_LARGE = -7
KM_ERR_PARSE = -8
KM_ERR_BACKEND_UNAVAILABLE = -9
KM_ERR_CUDA = -10
KM_ERR_IO = -11
KM_ERR_INTERNAL = -12
KM_ERR_CORRUPT = -13
KM_ERR_INCOMPATIBLE = -14
KM_ERR_NOT_FOUND = -15
KM_ERR_PROTOCOL = -16
KM_ERR_OVERLOADED = -17
KM_ERR_SHUTTING_DOWN = -18
KM_ERR_TIMEOUT = -19
KM_ERR_CLOSED = -20
KM_ERR_NO_HEALTHY_WORKER = -21

ERROR_NAMES = {code: name for name, code in globals().items()
               if name.startswith("KM_") and isinstance(code, int) and code <= 0}


def error_name(code: int) -> str:
    """The km_status name of a code ("KM_ERR_NOT_FOUND"), or "KM_ERR_UNKNOWN(<code>)" for a code
    this client does not know (a newer server)."""
    return ERROR_NAMES.get(code, "KM_ERR_UNKNOWN(%d)" % code)


class KvmatchError(Exception):
    """A failure with a km_status code (negative int), its name and a sentence."""

    def __init__(self, code: int, name: str, message: str) -> None:
        super().__init__("%s: %s" % (name, message))
        self.code = code
        self.name = name
        self.message = message


class ConnectionClosed(KvmatchError):
    def __init__(self, message: str) -> None:
        super().__init__(KM_ERR_CLOSED, "KM_ERR_CLOSED", message)


def outcome_from_stream(finish_reason: Optional[str], done_seen: bool,
                        http_status: Optional[int] = None, error: Optional[str] = None) -> str:
    """The outcome rule of docs/PROTOCOL.md: "error" when an error was seen or the HTTP status is
    known and not 2xx; else "complete" only when the final finish_reason and the [DONE] sentinel
    were both seen; else "incomplete" (even with HTTP 200)."""
    if error or (http_status is not None and not 200 <= http_status <= 299):
        return "error"
    if finish_reason and done_seen:
        return "complete"
    return "incomplete"


class _ListenQueueFull(TimeoutError):
    """The server's listen queue stayed full until the deadline (_connect_within)."""


def _connect_within(sock, family, target, deadline):
    """sock.connect(target) by the deadline (None: none). A Unix socket with a timeout is
    non-blocking underneath, and its connect answers EAGAIN at once while the server's listen
    queue is full, where a blocking connect would wait for room: it is tried again every 10 ms
    until the deadline, then TimeoutError."""
    while True:
        try:
            sock.connect(target)
            return
        except BlockingIOError:
            if family != socket.AF_UNIX:
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise _ListenQueueFull() from None
            time.sleep(0.01)


def _parse_address(address):
    if address.startswith("unix:"):
        path = address[5:]
        if not path:
            raise KvmatchError(KM_ERR_INVALID_ARGUMENT, "KM_ERR_INVALID_ARGUMENT",
                               "empty unix socket path")
        return socket.AF_UNIX, path
    if address.startswith("tcp:"):
        rest = address[4:]
        if rest.startswith("["):
            host, sep, port = rest[1:].partition("]:")
        else:
            host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KvmatchError(KM_ERR_INVALID_ARGUMENT, "KM_ERR_INVALID_ARGUMENT",
                               "expected tcp:host:port, got %r" % address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return family, (host, int(port))
    raise KvmatchError(KM_ERR_INVALID_ARGUMENT, "KM_ERR_INVALID_ARGUMENT",
                       "address must start with unix: or tcp:, got %r" % address)


def _error_code(error):
    """An ERROR reply's (code, name). The code is a negative int (docs/PROTOCOL.md): any other
    reads as KM_ERR_PROTOCOL, as in the Go and Rust clients. The name is the reply's when it is
    a str, else the code's."""
    code, name = error.get("code"), error.get("name")
    if type(code) is not int or code >= 0:
        return KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL"
    return code, name if type(name) is str and name else error_name(code)


def _server_words(error):
    """An ERROR reply's message (a str; anything else reads as "") less a leading "KM_ERR_NAME: "
    of its own code (the server words what its decoder refused that way), since the error raised
    names the code already."""
    message = error.get("message")
    message = message if type(message) is str else ""
    prefix = "%s: " % _error_code(error)[1]
    return message[len(prefix):] if message.startswith(prefix) else message


def _is_request_id(rid):
    """Whether rid is an id a request can carry: a non-negative integer, never a bool or a float
    that would compare equal to one."""
    return type(rid) is int and rid >= 0


class _KeyTwice(ValueError):
    """A reply's map holds a str key twice."""


_STR_ONLY = frozenset((str,))


def _decode_reply(payload):
    """A reply's payload as dicts, lists and scalars, read by the msgpack rules of
    docs/PROTOCOL.md: in every map, at any depth, an entry whose key is not a str is ignored, key
    and value whole however they nest, and a str key that appears twice (a field's name or not)
    raises _KeyTwice, unless the map holding it is within an ignored entry."""
    twice = []  # (a map that held a key twice, the key): refused where the reply holds the map

    def entries(pairs):  # object_pairs_hook: called for every map, innermost first
        pairs = pairs if type(pairs) is list else list(pairs)
        try:
            fast = dict(pairs)
        except TypeError:  # an unhashable key: an array or a map
            fast = None
        if fast is not None and len(fast) == len(pairs) and set(map(type, fast)) <= _STR_ONLY:
            return fast
        kept = {}
        for key, value in pairs:
            if type(key) is not str:
                continue
            if key in kept and (not twice or twice[-1][0] is not kept):
                twice.append((kept, key))
            kept[key] = value
        return kept

    message = msgpack.unpackb(payload, raw=False, strict_map_key=False,
                              object_pairs_hook=entries)
    if twice:
        held = {id(m): key for m, key in twice}
        pending = [message]
        while pending:
            value = pending.pop()
            if type(value) is dict:
                if id(value) in held:
                    raise _KeyTwice("key %.80r appears twice in one map" % held[id(value)])
                pending.extend(value.values())
            elif type(value) is list:
                pending.extend(value)
    return message


def _plural(n, noun):
    return noun if n == 1 else noun + "s"


# What a request is answered with besides ERROR (docs/PROTOCOL.md, "Messages"): type -> the reply
# type and, where the reply holds one item per item of the request, the request's list, the
# reply's list and what one item of the request is called. A WORKERS / POOLS list is answered
# with _LISTS, a one-event form with an ACK of one item.
_ANSWERS = {"ROUTE": ("DECISION", "routes", "decisions", "route"),
            "LIFECYCLE": ("ACK", "events", "items", "event"),
            "WORKERS": ("ACK", "workers", "items", "worker"),
            "POOLS": ("ACK", "pools", "items", "pool"),
            "STATUS": ("STATUS_REPLY", None, None, None)}
_LISTS = {"WORKERS": "WORKER_LIST", "POOLS": "POOL_LIST"}
_ONE_EVENT = ("DISPATCHED", "FIRST_TOKEN", "FINISHED")


def _expected_reply(message):
    """What the reply to a request must be besides an ERROR: (the request's type, the reply type,
    the reply's list, the count it must hold, what one item of the request is called). The reply
    type is None for a type no server answers (only an ERROR fits), the list None when no count is
    checked (STATUS_REPLY, WORKER_LIST, POOL_LIST)."""
    kind = message.get("type")
    if kind in _ONE_EVENT:
        return (kind, "ACK", "items", 1, "event")
    if kind in _LISTS and message.get("action") == "list":
        return (kind, _LISTS[kind], None, 0, None)
    if kind not in _ANSWERS:
        return (kind, None, None, 0, None)
    answer, request_key, key, noun = _ANSWERS[kind]
    count = len(message.get(request_key) or ()) if request_key else 0
    return (kind, answer, key, count, noun)


class Client:
    """One connection to kvmatch serve. Create with Client.connect()."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self.address = None  # type: Optional[str]
        self._client_name = CLIENT_NAME
        self._buffer = bytearray()
        self._next_id = 1
        self._kept = {}  # id -> reply dict, arrival order kept by dict order
        # id -> what its reply must hold (_expected_reply), for the requests whose reply has not
        # been returned yet, and for those whose blocking call timed out (the reply is dropped):
        # at most MAX_ABANDONED of these; a reply to an id at or below _forgotten, the highest
        # of those forgotten past it, that is not outstanding is dropped unchecked.
        self._outstanding = {}
        self._abandoned = {}
        self._forgotten = 0
        self._closed = False
        self._max_frame_bytes = max_frame_bytes
        self.welcome = None  # type: Optional[Message]

    # ---- connection ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: str = "unix:" + DEFAULT_SOCKET, timeout: Optional[float] = 5.0,
                client_name: str = CLIENT_NAME) -> "Client":
        """Connect and do the HELLO / WELCOME handshake within `timeout` seconds (None: no
        limit). Raises KvmatchError (KM_ERR_INCOMPATIBLE when the server refuses our version,
        KM_ERR_PARSE / KM_ERR_PROTOCOL for a reply that is unreadable, neither WELCOME nor ERROR,
        a WELCOME to another id than the HELLO's, or one whose limits are not a map or whose
        max_frame_bytes is not a u32 (nil, absent or 0: the default 16 MiB); the server's code,
        e.g. KM_ERR_OVERLOADED at its max_connections or KM_ERR_SHUTTING_DOWN while it drains,
        when it does not take the connection), ConnectionClosed, TimeoutError or OSError."""
        return cls._connect(address, timeout, client_name, 1)

    @classmethod
    def _connect(cls, address, timeout, client_name, first_id):
        """connect(), the HELLO taking id first_id and later requests the ids after it."""
        family, target = _parse_address(address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            sock.settimeout(timeout)
            _connect_within(sock, family, target, deadline)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = cls(sock)
            client._next_id = first_id
            hello_id, frame = client._frame({"type": "HELLO", "protocol": PROTOCOL_VERSION,
                                             "client": client_name})
            client._next_id += 1
            # A server that refuses the connection (max_connections, shutting down) writes an
            # ERROR saying why and closes, maybe before the HELLO is written: the ERROR is still
            # read, and only without one is the failed write the error.
            unsent = None
            try:
                client._set_timeout(deadline)
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError) as exc:
                unsent = exc
            try:
                reply = client._read_message(deadline)
            except ConnectionClosed:
                if unsent is None:
                    raise
                reply = None
            if unsent is not None and (reply is None or reply.get("type") != "ERROR"):
                raise ConnectionClosed("the server closed the connection before the HELLO was "
                                       "sent (%s)" % unsent)
        except socket.timeout as e:
            sock.close()
            raise TimeoutError("connect / handshake with %s timed out%s"
                               % (address, " (the server's listen queue stayed full)"
                                  if isinstance(e, _ListenQueueFull) else ""))
        except BaseException:
            sock.close()
            raise
        if reply.get("type") == "ERROR":
            client.close()
            raise KvmatchError(*_error_code(reply),
                               "the server refused the handshake: %s" % _server_words(reply))
        if reply.get("type") != "WELCOME":
            client.close()
            raise KvmatchError(KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL",
                               "expected WELCOME, got %r" % reply.get("type"))
        if not _is_request_id(reply.get("id")) or reply.get("id") != hello_id:
            client.close()
            raise KvmatchError(KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL",
                               "the WELCOME answers request %.80r, not the HELLO (%r)"
                               % (reply.get("id"), hello_id))
        if reply.get("protocol") != PROTOCOL_VERSION:
            client.close()
            raise KvmatchError(KM_ERR_INCOMPATIBLE, "KM_ERR_INCOMPATIBLE",
                               "the server speaks protocol %r" % reply.get("protocol"))
        # The limits are a map, max_frame_bytes a u32; nil is absent, and absent or 0 keeps the
        # default (docs/PROTOCOL.md).
        limits = reply.get("limits")
        max_frame = limits.get("max_frame_bytes") if type(limits) is dict else None
        if (limits is not None and type(limits) is not dict) or \
                (max_frame is not None and not (_is_request_id(max_frame) and max_frame < 1 << 32)):
            client.close()
            raise KvmatchError(KM_ERR_PARSE, "KM_ERR_PARSE",
                               "the WELCOME's limits %s not a map whose max_frame_bytes is a u32: "
                               "%.80r" % ("are" if type(limits) is dict else "is", limits))
        client.welcome = reply
        client.address, client._client_name = address, client_name
        client._max_frame_bytes = max_frame or DEFAULT_MAX_FRAME_BYTES
        return client

    def reconnect(self, timeout: Optional[float] = 5.0) -> None:
        """Close this connection (if open) and dial the same address again with a new handshake.
        Requests in flight on the old connection get no reply (they are not resent: a router
        decides again); kept replies are dropped. Request ids go on from the old connection's, so
        an id sent before never names a request sent after (wait on it raises). Raises as
        connect() does, leaving the client closed."""
        self.close()
        fresh = type(self)._connect(self.address, timeout, self._client_name, self._next_id)
        self.__dict__.update(fresh.__dict__)

    def close(self) -> None:
        """Close the connection. No reply is read after: the requests whose reply has not arrived
        are forgotten, and replies already kept are still returned by receive / wait."""
        if not self._closed:
            self._closed = True
            self._outstanding = {rid: expected for rid, expected in self._outstanding.items()
                                 if rid in self._kept}
            self._abandoned.clear()
            self._buffer.clear()
            try:
                self._sock.close()
            except OSError:
                pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def outstanding(self) -> int:
        """Requests sent whose reply has not been returned yet and still can be: not given up by a
        blocking call that timed out, and once the connection is closed only those whose reply
        had arrived (kept by wait; receive / wait still return them)."""
        return len(self._outstanding)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._sock.fileno()

    # ---- pipelined ----------------------------------------------------------------------------

    def send(self, message: Message, timeout: Optional[float] = 5.0) -> int:
        """Send a request dict (its "id" is assigned here); returns the id."""
        if self._closed:
            raise ConnectionClosed("the connection is closed")
        if message.get("type") == "HELLO":
            raise KvmatchError(KM_ERR_INVALID_ARGUMENT, "KM_ERR_INVALID_ARGUMENT",
                               "HELLO is sent by connect()")
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._send_raw(message, deadline)

    def send_route(self, routes: Iterable[Message], timeout: Optional[float] = 5.0) -> int:
        return self.send({"type": "ROUTE", "routes": list(routes)}, timeout)

    def send_lifecycle(self, events: Iterable[Message], timeout: Optional[float] = 5.0) -> int:
        return self.send({"type": "LIFECYCLE", "events": list(events)}, timeout)

    def receive(self, timeout: Optional[float] = 5.0) -> Message:
        """The next reply (kept ones first), whatever its id."""
        if self._kept:
            rid = next(iter(self._kept))
            self._outstanding.pop(rid, None)
            return self._kept.pop(rid)
        if self._closed:
            raise ConnectionClosed("the connection is closed")
        if not self._outstanding:
            raise KvmatchError(KM_ERR_INVALID_ARGUMENT, "KM_ERR_INVALID_ARGUMENT",
                               "no request is waiting for a reply")
        deadline = None if timeout is None else time.monotonic() + timeout
        reply = self._read_unabandoned(deadline)
        self._outstanding.pop(reply.get("id"), None)
        return reply

    def wait(self, request_id: int, timeout: Optional[float] = 5.0) -> Message:
        """The reply to request_id; replies to other ids that arrive meanwhile are kept."""
        if request_id in self._kept:
            self._outstanding.pop(request_id, None)
            return self._kept.pop(request_id)
        if self._closed:
            raise ConnectionClosed("the connection is closed")
        if request_id not in self._outstanding:
            raise KvmatchError(KM_ERR_NOT_FOUND, "KM_ERR_NOT_FOUND",
                               "request %r is not waiting for a reply" % (request_id,))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = self._read_unabandoned(deadline)
            rid = reply.get("id")
            if rid == request_id:
                self._outstanding.pop(rid, None)
                return reply
            self._kept[rid] = reply

    # ---- blocking -----------------------------------------------------------------------------

    def call(self, message: Message, timeout: Optional[float] = 5.0) -> Message:
        """send + wait; an ERROR reply raises KvmatchError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rid = self.send(message, timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            reply = self.wait(rid, left)
        except TimeoutError:
            if not self._closed:  # a deadline: the call is given up, the connection kept
                self._give_up(rid)
            raise
        if reply.get("type") == "ERROR":
            raise KvmatchError(*_error_code(reply), _server_words(reply))
        return reply

    def route(self, routes: Iterable[Message], timeout: Optional[float] = 5.0) -> Message:
        """ROUTE -> DECISION dict; check each decision's "status" (0 = decided)."""
        return self.call({"type": "ROUTE", "routes": list(routes)}, timeout)

    def lifecycle(self, events: Iterable[Message], timeout: Optional[float] = 5.0) -> Message:
        """LIFECYCLE -> ACK dict with one {"status", "message"} per event."""
        return self.call({"type": "LIFECYCLE", "events": list(events)}, timeout)

    def dispatched(self, timeout: Optional[float] = 5.0, **fields: Any) -> Message:
        return self.lifecycle([dict(fields, event="DISPATCHED")], timeout)

    def first_token(self, timeout: Optional[float] = 5.0, **fields: Any) -> Message:
        return self.lifecycle([dict(fields, event="FIRST_TOKEN")], timeout)

    def finished(self, timeout: Optional[float] = 5.0, **fields: Any) -> Message:
        """FINISHED; without an explicit "outcome" the server derives it by the outcome rule."""
        return self.lifecycle([dict(fields, event="FINISHED")], timeout)

    def workers(self, action: str, workers: Optional[Iterable[Message]] = None,
                pool: Optional[str] = None, timeout: Optional[float] = 5.0) -> Message:
        message = {"type": "WORKERS", "action": action}
        if workers is not None:
            message["workers"] = list(workers)
        if pool is not None:
            message["pool"] = pool
        return self.call(message, timeout)

    def pools(self, action: str, pools: Optional[Iterable[Message]] = None,
              timeout: Optional[float] = 5.0) -> Message:
        message = {"type": "POOLS", "action": action}
        if pools is not None:
            message["pools"] = list(pools)
        return self.call(message, timeout)

    def remove_pools(self, names: Iterable[str], timeout: Optional[float] = 5.0) -> Message:
        """POOLS remove: each named pool ends (its workers removed, their active work ended with
        outcome records) and everything it holds is released. One ACK item per name:
        KM_ERR_NOT_FOUND for a pool that does not exist."""
        return self.pools("remove", [{"name": name} for name in names], timeout)

    def status(self, timeout: Optional[float] = 5.0) -> Message:
        return self.call({"type": "STATUS"}, timeout)

    # ---- frames -------------------------------------------------------------------------------

    def _fail(self, exc):
        self.close()
        raise exc

    def _frame(self, message):
        """(the id the message is sent with, its frame): the next id, not yet taken."""
        rid = self._next_id
        message = dict(message, id=rid)
        payload = msgpack.packb(message, use_bin_type=True)
        if len(payload) > self._max_frame_bytes:
            raise KvmatchError(KM_ERR_TOO_LARGE, "KM_ERR_TOO_LARGE",
                               "%s message encodes to %d bytes, max_frame_bytes is %d"
                               % (message.get("type"), len(payload), self._max_frame_bytes))
        return rid, struct.pack(">I", len(payload)) + payload

    def _send_raw(self, message, deadline):
        rid, data = self._frame(message)
        if deadline is not None and deadline <= time.monotonic():
            # Nothing sent: the stream is intact, so the connection stays usable.
            raise TimeoutError("send timed out before any byte was sent")
        try:
            sent = self._send_frame(data, deadline)
        except (BrokenPipeError, ConnectionResetError):
            self._next_id += 1
            self._fail(ConnectionClosed("the server closed the connection"))
        except OSError:
            # Any other socket error (ETIMEDOUT, EHOSTUNREACH, ...) leaves it unknown how much of
            # the frame went out: the stream cannot be continued.
            self._next_id += 1
            self.close()
            raise
        if sent == 0 and data:
            # Nothing sent: the stream is intact, so the connection stays usable and the id is
            # not taken.
            raise TimeoutError("send timed out before any byte was sent")
        self._next_id += 1
        if sent < len(data):
            # Part of the frame is out: the stream cannot be continued.
            self._fail(TimeoutError("send timed out; connection closed mid-frame"))
        self._outstanding[rid] = _expected_reply(message)
        return rid

    def _send_frame(self, data, deadline):
        """Send data before deadline (None: no limit); the bytes sent, all of them unless the
        deadline passed first. Each send waits at most the time left and sends what the socket
        takes, so the count is exact, where sendall's timeout cannot say how much went out."""
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            if deadline is None:
                self._sock.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return sent
                self._sock.settimeout(left)
            try:
                sent += self._sock.send(view[sent:])
            except socket.timeout as exc:
                if exc.errno is not None:
                    raise  # the kernel's ETIMEDOUT: the connection is gone, not the deadline
                return sent
        return sent

    def _give_up(self, rid):
        """No one will wait for rid: its late reply is checked and dropped on arrival while rid is
        among the MAX_ABANDONED highest ids given up, and dropped unchecked once forgotten."""
        self._abandoned[rid] = self._outstanding.pop(rid)
        if len(self._abandoned) > MAX_ABANDONED:
            lowest = min(self._abandoned)
            del self._abandoned[lowest]
            self._forgotten = max(self._forgotten, lowest)

    def _read_unabandoned(self, deadline):
        """The next reply that someone may still want (late replies to given-up calls dropped, see
        _give_up), checked against its request. A reply to an id that is not outstanding (never sent, or
        answered already) means the stream cannot be trusted: the connection is closed."""
        while True:
            reply = self._read_reply(deadline)
            rid = reply.get("id")
            if rid in self._abandoned:
                self._check_reply(reply, self._abandoned.pop(rid))
                continue
            if rid not in self._outstanding and rid is not None and 0 < rid <= self._forgotten:
                continue  # a late reply to a call given up and forgotten
            if rid not in self._outstanding or rid in self._kept:
                self._fail(KvmatchError(KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL",
                                        "the server answered request %r, which is not waiting "
                                        "for a reply" % (rid,)))
            self._check_reply(reply, self._outstanding[rid])
            return reply

    def _check_reply(self, reply, expected):
        """A reply is an ERROR or of its request's reply type, and a DECISION or ACK holds one item
        per item of its request (docs/PROTOCOL.md, "Reading replies"): another is a protocol
        error and closes the connection."""
        request, answer, key, count, noun = expected
        kind = reply.get("type")
        if kind == "ERROR":
            return
        if kind != answer:
            self._fail(KvmatchError(KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL",
                                    "the server answered request %r (%s) with %s"
                                    % (reply.get("id"), request, kind)))
        if key is None:
            return
        items = reply.get(key)
        got = len(items) if isinstance(items, list) else 0
        if got != count:
            self._fail(KvmatchError(KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL",
                                    "the server answered request %r with %d %s for %d %s"
                                    % (reply.get("id"), got, _plural(got, key[:-1]), count,
                                       _plural(count, noun))))

    def _set_timeout(self, deadline):
        if deadline is None:
            self._sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self._sock.settimeout(left)

    def _read_message(self, deadline):
        """One whole frame, decoded. A timeout keeps the partial bytes for the next call."""
        while True:
            if len(self._buffer) >= 4:
                (length,) = struct.unpack(">I", self._buffer[:4])
                if length == 0 or length > self._max_frame_bytes:
                    self._fail(KvmatchError(KM_ERR_TOO_LARGE if length else KM_ERR_PROTOCOL,
                                            "KM_ERR_TOO_LARGE" if length else "KM_ERR_PROTOCOL",
                                            "reply frame declares %d bytes" % length))
                if len(self._buffer) >= 4 + length:
                    payload = bytes(self._buffer[4:4 + length])
                    del self._buffer[:4 + length]
                    try:
                        message = _decode_reply(payload)
                    except Exception as exc:  # msgpack raises several types
                        self._fail(KvmatchError(KM_ERR_PARSE, "KM_ERR_PARSE",
                                                "unreadable reply: %s" % exc))
                    if not isinstance(message, dict):
                        self._fail(KvmatchError(KM_ERR_PARSE, "KM_ERR_PARSE",
                                                "a reply is a map, got %s" % type(message).__name__))
                    return message
            if self._closed:
                raise ConnectionClosed("the connection is closed")
            try:
                self._set_timeout(deadline)
                chunk = self._sock.recv(65536)
            except socket.timeout as exc:
                if exc.errno is not None:  # the kernel's ETIMEDOUT: the connection is gone
                    self.close()
                    raise
                raise TimeoutError("no reply before the timeout")
            except ConnectionResetError:
                self._fail(ConnectionClosed("the server reset the connection"))
            except OSError:
                # Any other socket error: what the stream holds next is unknown.
                self.close()
                raise
            if not chunk:
                self._fail(ConnectionClosed("the server closed the connection%s"
                                            % (" mid-frame" if self._buffer else "")))
            self._buffer += chunk

    def _read_reply(self, deadline):
        reply = self._read_message(deadline)
        # An id is a uint64 (docs/PROTOCOL.md); nil or absent only on a connection-level ERROR.
        # Anything else (a list or map, which cannot be looked up; a bool or float, which would
        # pass for the integer it equals; a negative) is a protocol error.
        rid = reply.get("id")
        if rid is not None and not _is_request_id(rid):
            self._fail(KvmatchError(KM_ERR_PROTOCOL, "KM_ERR_PROTOCOL",
                                    "a %s reply's id %.80r is not a non-negative integer"
                                    % (reply.get("type"), rid)))
        # A connection-level ERROR (id 0 or none): the server is closing the connection, so
        # ConnectionClosed whatever code it carries (one such as KM_ERR_TIMEOUT would say the
        # connection is still usable); the server's code goes in the message.
        if reply.get("type") == "ERROR" and not reply.get("id"):
            self._fail(ConnectionClosed("the server closes the connection: %s (%r): %s"
                                        % (reply.get("name", "?"), reply.get("code"),
                                           _server_words(reply))))
        return reply
