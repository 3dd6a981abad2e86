// SPDX-License-Identifier: Apache-2.0
//! One connection to `kvmatch serve`: handshake, pipelined sends and receives, blocking calls.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::error::{Code, Error, Result};
use crate::messages::{
    AckItem, Decision, LifecycleEvent, Pool, RouteRequest, StatusReply, Welcome, Worker,
};
use crate::value::{Fields, Value};

/// The protocol this client speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// Where `kvmatch serve` listens unless told otherwise.
pub const DEFAULT_ADDRESS: &str = "unix:/tmp/kvmatch.sock";
/// Sent in HELLO, for the server's logs.
pub const CLIENT_NAME: &str = "kvmatch-rust";
const DEFAULT_MAX_FRAME_BYTES: u32 = 16 << 20;
/// The ids of blocking calls given up (timed out) that a connection keeps, so that their late
/// replies are checked and dropped; past this many the lowest are forgotten (a reply to one is
/// dropped unchecked), so a server that never answers cannot make the client grow with every
/// call that times out.
pub const MAX_ABANDONED: usize = 4096;

/// A reply as read: its type, id and whole map. The accessors decode the typed view.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub kind: String,
    pub id: u64,
    pub body: Value,
}

impl Reply {
    /// The failure an ERROR reply carries; None for any other reply.
    pub fn error(&self) -> Option<Error> {
        if self.kind != "ERROR" {
            return None;
        }
        let code = match self.body.get("code").and_then(Value::as_i64) {
            Some(c) if c < 0 => Code(c),
            _ => Code::PROTOCOL,
        };
        let message = self.body.get("message").and_then(Value::as_str).unwrap_or("");
        Some(Error::from_server(code, message))
    }

    fn list(&self, key: &str) -> Result<&[Value]> {
        Fields { value: &self.body, what: &self.kind }.array(key)
    }

    /// DECISION: one decision per route, in the routes' order.
    pub fn decisions(&self) -> Result<Vec<Decision>> {
        let list = self.list("decisions")?;
        let mut out = Vec::with_capacity(list.len());
        for (i, d) in list.iter().enumerate() {
            out.push(Decision::from_value(d, &format!("decisions[{}]", i))?);
        }
        Ok(out)
    }

    /// ACK: one item per event, worker or pool of the request.
    pub fn items(&self) -> Result<Vec<AckItem>> {
        let list = self.list("items")?;
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(AckItem::from_value(item, &format!("items[{}]", i))?);
        }
        Ok(out)
    }

    /// WORKER_LIST.
    pub fn workers(&self) -> Result<Vec<Worker>> {
        let list = self.list("workers")?;
        let mut out = Vec::with_capacity(list.len());
        for (i, w) in list.iter().enumerate() {
            out.push(Worker::from_value(w, &format!("workers[{}]", i))?);
        }
        Ok(out)
    }

    /// POOL_LIST.
    pub fn pools(&self) -> Result<Vec<Pool>> {
        let list = self.list("pools")?;
        let mut out = Vec::with_capacity(list.len());
        for (i, p) in list.iter().enumerate() {
            out.push(Pool::from_value(p, &format!("pools[{}]", i))?);
        }
        Ok(out)
    }

    /// STATUS_REPLY.
    pub fn status(&self) -> Result<StatusReply> {
        StatusReply::from_value(&self.body)
    }
}

/// What the reply to a request must be besides an ERROR.
#[derive(Clone, Debug)]
struct Expected {
    request: String,
    reply: Option<&'static str>, // None: a type no server answers (only ERROR fits)
    list: Option<&'static str>,  // the reply's list whose length is checked
    count: usize,
}

fn expected_reply(message: &Value) -> Expected {
    let kind = message.get("type").and_then(Value::as_str).unwrap_or("").to_string();
    let count = |key: &str| message.get(key).and_then(Value::as_array).map_or(0, |a| a.len());
    let listing = message.get("action").and_then(Value::as_str) == Some("list");
    let (reply, list, n) = match kind.as_str() {
        "ROUTE" => (Some("DECISION"), Some("decisions"), count("routes")),
        "LIFECYCLE" => (Some("ACK"), Some("items"), count("events")),
        "DISPATCHED" | "FIRST_TOKEN" | "FINISHED" => (Some("ACK"), Some("items"), 1),
        "WORKERS" if listing => (Some("WORKER_LIST"), None, 0),
        "POOLS" if listing => (Some("POOL_LIST"), None, 0),
        "WORKERS" => (Some("ACK"), Some("items"), count("workers")),
        "POOLS" => (Some("ACK"), Some("items"), count("pools")),
        "STATUS" => (Some("STATUS_REPLY"), None, 0),
        _ => (None, None, 0),
    };
    Expected { request: kind, reply, list, count: n }
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t).and_then(|_| s.set_write_timeout(t)),
            Stream::Tcp(s) => s.set_read_timeout(t).and_then(|_| s.set_write_timeout(t)),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether `e` is this client's own deadline: a socket timeout (`WouldBlock`, EAGAIN) or a
/// `TimedOut` the client or the standard library made, which carries no OS error code. The
/// kernel's ETIMEDOUT (a TCP connection whose peer stopped answering) carries one: the connection
/// is gone, and the caller closes it as for any other socket error.
fn timed_out(e: &io::Error) -> bool {
    match e.kind() {
        io::ErrorKind::WouldBlock => true,
        io::ErrorKind::TimedOut => e.raw_os_error().is_none(),
        _ => false,
    }
}

/// A connection to kvmatch serve. Not for sharing between threads: use one per thread (the
/// server serves hundreds of connections), or one per task behind a lock.
///
/// Pipelined use: `send_route` / `send_lifecycle` / `send` return the request's id at once;
/// `receive` returns the next reply to arrive (any id), `wait(id)` the reply to one id, keeping
/// replies to other ids that arrive meanwhile. Blocking use: `route`, `lifecycle`, `report`,
/// the WORKERS / POOLS calls and `status` send and wait; an ERROR reply is their `Err`.
///
/// Every wait is bounded by the client's timeout (`set_timeout`); a blocking call's send and
/// wait share one timeout, as the Go (its context) and Python clients' calls do. A timeout
/// (`Code::TIMEOUT`) leaves the connection usable: a blocking call gives its request up (the reply is dropped when
/// it comes, checked as any reply is while at most `MAX_ABANDONED` (4096) given-up calls await
/// theirs; past that the lowest ids are forgotten and a reply to one is dropped unchecked), a
/// `wait` may be called again, a send that timed out before any byte of its frame was written
/// sent nothing; only a send cut off mid-frame closes the connection. A reply that cannot be
/// read, is not of its request's type, holds another count of decisions or items than its
/// request had routes, events, workers or pools, has an id that is not an unsigned integer or
/// answers an id that is not waiting (`Code::PARSE`, `PROTOCOL`, `TOO_LARGE`), a
/// connection-level ERROR (id 0) and a server that goes away (`Code::CLOSED`) close the
/// connection: later calls fail with `Code::CLOSED` until `reconnect`. For a blocking call a
/// reply that cannot be read includes one whose decisions, items, workers, pools or status fields
/// are not of their types; a pipelined caller gets that `Code::PARSE` from the `Reply` accessor,
/// and the connection stays open.
pub struct Client {
    address: String,
    stream: Option<Stream>,
    buffer: Vec<u8>,
    next_id: u64,
    outstanding: HashMap<u64, Expected>,
    // Given up by a blocking call that timed out: the id and what its reply must be, so that a
    // late reply is checked and dropped. At most MAX_ABANDONED; past that the lowest ids are
    // forgotten, and a reply to an id at or below `forgotten` that is not outstanding is dropped
    // unchecked.
    abandoned: HashMap<u64, Expected>,
    forgotten: u64,
    kept: VecDeque<Reply>,
    welcome: Welcome,
    max_frame_bytes: u32,
    timeout: Option<Duration>,
    closed_by: Option<Error>,
}

impl Client {
    /// Connect to "unix:/path" or "tcp:IP:PORT" ("tcp:[::1]:7070" for IPv6) and do the HELLO /
    /// WELCOME handshake, within `timeout` (None: no limit), which stays the client's timeout
    /// (on Linux it bounds the wait for a Unix socket's server to accept, too).
    /// Fails with INVALID_ARGUMENT for an address of another form, IO when the connection fails,
    /// INCOMPATIBLE when the server does not speak PROTOCOL_VERSION, the server's code when it
    /// refuses the handshake or the connection (OVERLOADED at its max_connections, SHUTTING_DOWN
    /// while it drains; read even when the server closed before the HELLO was written), PROTOCOL /
    /// PARSE for a reply that is not a WELCOME to the HELLO.
    pub fn connect(address: &str, timeout: Option<Duration>) -> Result<Client> {
        Client::dial(address, timeout, 1)
    }

    /// connect, the HELLO taking id first_id and later requests the ids after it.
    fn dial(address: &str, timeout: Option<Duration>, first_id: u64) -> Result<Client> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let stream = open(address, timeout)?;
        let mut client = Client {
            address: address.to_string(),
            stream: Some(stream),
            buffer: Vec::new(),
            next_id: first_id,
            outstanding: HashMap::new(),
            abandoned: HashMap::new(),
            forgotten: 0,
            kept: VecDeque::new(),
            welcome: Welcome::default(),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            timeout,
            closed_by: None,
        };
        client.handshake(deadline)?;
        Ok(client)
    }

    fn handshake(&mut self, deadline: Option<Instant>) -> Result<()> {
        let hello = Value::Map(vec![
            ("type".into(), Value::Str("HELLO".into())),
            ("protocol".into(), Value::UInt(PROTOCOL_VERSION as u64)),
            ("client".into(), Value::Str(CLIENT_NAME.into())),
        ]);
        let (id, frame, _) = self.frame(hello)?;
        self.next_id += 1;
        // A server that refuses the connection (max_connections, shutting down) writes an ERROR
        // saying why and closes, maybe before the HELLO is written: the ERROR is still read, and
        // only without one is the failed write the error.
        let (_, written) = match self.stream.as_mut() {
            Some(stream) => write_before(stream, &frame, deadline),
            None => return Err(self.closed_error()),
        };
        let unsent = match written {
            Ok(()) => None,
            Err(e) if timed_out(&e) => {
                let e = Error::new(Code::TIMEOUT, "the HELLO was not sent before the timeout");
                return Err(self.fail(e));
            }
            Err(e) => Some(e),
        };
        let reply = match (self.read_message(deadline), unsent) {
            (Ok(r), None) => r,
            (Ok(r), Some(_)) if r.kind == "ERROR" => r,
            (Err(e), None) => {
                self.close();
                return Err(e);
            }
            (_, Some(w)) => {
                let m = format!("the server closed the connection before the HELLO was sent ({w})");
                self.close();
                return Err(Error::new(Code::CLOSED, m));
            }
        };
        let refuse = |client: &mut Client, e: Error| {
            client.close();
            Err(e)
        };
        // An ERROR answering the HELLO, or sent with id 0 by a server that does not take the
        // connection: the server's code.
        if let Some(e) = reply.error() {
            let code = e.code;
            return refuse(self, Error::new(code, format!("the server refused the handshake: {}", e.message)));
        }
        if reply.kind != "WELCOME" {
            return refuse(self, Error::new(Code::PROTOCOL, format!("expected WELCOME, got {}", reply.kind)));
        }
        if reply.id != id {
            let m = format!("the WELCOME answers request {}, not the HELLO ({})", reply.id, id);
            return refuse(self, Error::new(Code::PROTOCOL, m));
        }
        let welcome = match Welcome::from_value(&reply.body) {
            Ok(w) => w,
            Err(e) => return refuse(self, e),
        };
        if welcome.protocol != PROTOCOL_VERSION {
            let m = format!("the server speaks protocol {}", welcome.protocol);
            return refuse(self, Error::new(Code::INCOMPATIBLE, m));
        }
        if welcome.limits.max_frame_bytes != 0 {
            self.max_frame_bytes = welcome.limits.max_frame_bytes;
        }
        self.welcome = welcome;
        Ok(())
    }

    /// The server's WELCOME on the current connection: versions and limits.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Bounds every later send and wait (None: no limit).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Requests sent whose reply has not been returned yet and still can be (not given up by a
    /// blocking call that timed out; once closed, only those whose reply had arrived).
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Whether the connection is closed; `closed_by` says why.
    pub fn is_closed(&self) -> bool {
        self.stream.is_none()
    }

    pub fn closed_by(&self) -> Option<&Error> {
        self.closed_by.as_ref()
    }

    /// Close the connection. Requests whose reply has not arrived are forgotten; replies already
    /// kept are still returned by receive / wait.
    pub fn close(&mut self) {
        if let Some(s) = self.stream.take() {
            s.shutdown();
        }
        let kept: Vec<u64> = self.kept.iter().map(|r| r.id).collect();
        self.outstanding.retain(|id, _| kept.contains(id));
        self.abandoned.clear();
        self.buffer.clear();
        if self.closed_by.is_none() {
            self.closed_by = Some(Error::new(Code::CLOSED, "the connection is closed"));
        }
    }

    /// Close this connection (if open) and dial the same address again with a new handshake.
    /// Requests in flight on the old connection get no reply (they are not resent: a router
    /// decides again). Request ids go on from the old connection's, so an id sent before never
    /// names a request sent after (wait on it fails). On failure the client stays closed.
    pub fn reconnect(&mut self) -> Result<()> {
        self.close();
        let fresh = Client::dial(&self.address, self.timeout, self.next_id)?;
        *self = fresh;
        Ok(())
    }

    fn fail(&mut self, e: Error) -> Error {
        self.close();
        self.closed_by = Some(e.clone());
        e
    }

    fn closed_error(&self) -> Error {
        match &self.closed_by {
            Some(e) if e.code == Code::CLOSED => e.clone(),
            Some(e) => Error::new(Code::CLOSED, format!("the connection is closed ({})", e)),
            None => Error::new(Code::CLOSED, "the connection is closed"),
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.timeout.map(|t| Instant::now() + t)
    }

    // ---- pipelined ------------------------------------------------------------------------------

    /// Send any request map with its "type" (the id is assigned here); returns the id.
    pub fn send(&mut self, message: Value) -> Result<u64> {
        let deadline = self.deadline();
        self.send_before(message, deadline)
    }

    fn send_before(&mut self, message: Value, deadline: Option<Instant>) -> Result<u64> {
        if message.get("type").and_then(Value::as_str) == Some("HELLO") {
            return Err(Error::new(Code::INVALID_ARGUMENT, "HELLO is sent by connect"));
        }
        if self.stream.is_none() {
            return Err(self.closed_error());
        }
        self.send_value(message, deadline)
    }

    /// Send a ROUTE; returns its id.
    pub fn send_route(&mut self, routes: &[RouteRequest]) -> Result<u64> {
        let list = routes.iter().map(RouteRequest::to_value).collect();
        self.send(message("ROUTE", vec![("routes", Value::Array(list))]))
    }

    /// Send a LIFECYCLE; returns its id.
    pub fn send_lifecycle(&mut self, events: &[LifecycleEvent]) -> Result<u64> {
        let list = events.iter().map(LifecycleEvent::to_value).collect();
        self.send(message("LIFECYCLE", vec![("events", Value::Array(list))]))
    }

    /// The next reply, kept ones first, whatever its id (an ERROR reply too).
    pub fn receive(&mut self) -> Result<Reply> {
        if let Some(r) = self.kept.pop_front() {
            self.outstanding.remove(&r.id);
            return Ok(r);
        }
        if self.stream.is_none() {
            return Err(self.closed_error());
        }
        if self.outstanding.is_empty() {
            return Err(Error::new(Code::INVALID_ARGUMENT, "no request is waiting for a reply"));
        }
        let deadline = self.deadline();
        let reply = self.read_unabandoned(deadline)?;
        self.outstanding.remove(&reply.id);
        Ok(reply)
    }

    /// The reply to request `id` (an ERROR reply too); replies to other ids that arrive meanwhile
    /// are kept. NOT_FOUND at once for an id never sent or already answered.
    pub fn wait(&mut self, id: u64) -> Result<Reply> {
        let deadline = self.deadline();
        self.wait_before(id, deadline)
    }

    fn wait_before(&mut self, id: u64, deadline: Option<Instant>) -> Result<Reply> {
        if let Some(pos) = self.kept.iter().position(|r| r.id == id) {
            self.outstanding.remove(&id);
            return Ok(self.kept.remove(pos).expect("position is in range"));
        }
        if self.stream.is_none() {
            return Err(self.closed_error());
        }
        if !self.outstanding.contains_key(&id) {
            return Err(Error::new(Code::NOT_FOUND, format!("request {} is not waiting for a reply", id)));
        }
        loop {
            let reply = self.read_unabandoned(deadline)?;
            if reply.id == id {
                self.outstanding.remove(&id);
                return Ok(reply);
            }
            self.kept.push_back(reply);
        }
    }

    // ---- blocking -------------------------------------------------------------------------------

    /// send + wait within one timeout, the send's time counted against it; an ERROR reply is
    /// the `Err`. On a timeout the request is given up.
    pub fn call(&mut self, message: Value) -> Result<Reply> {
        let deadline = self.deadline();
        let id = self.send_before(message, deadline)?;
        match self.wait_before(id, deadline) {
            Ok(reply) => match reply.error() {
                Some(e) => Err(e),
                None => Ok(reply),
            },
            Err(e) => {
                if e.code == Code::TIMEOUT {
                    self.give_up(id);
                }
                Err(e)
            }
        }
    }

    /// No one will wait for `id`: its late reply is checked and dropped on arrival while `id` is
    /// among the MAX_ABANDONED highest ids given up, and dropped unchecked once forgotten.
    fn give_up(&mut self, id: u64) {
        if let Some(exp) = self.outstanding.remove(&id) {
            self.abandoned.insert(id, exp);
        }
        if self.abandoned.len() > MAX_ABANDONED {
            if let Some(&lowest) = self.abandoned.keys().min() {
                self.abandoned.remove(&lowest);
                self.forgotten = self.forgotten.max(lowest);
            }
        }
    }

    /// A blocking call's typed view of its reply: one that cannot be read (a field of the wrong
    /// type) closes the connection, as a frame that cannot be read does.
    fn readable<T>(&mut self, view: Result<T>) -> Result<T> {
        view.map_err(|e| self.fail(e))
    }

    /// One decision per route, in the routes' order; a route that failed has a non-OK `status`
    /// (`Decision::result`). The `Err` is the whole request's.
    pub fn route(&mut self, routes: &[RouteRequest]) -> Result<Vec<Decision>> {
        let list = routes.iter().map(RouteRequest::to_value).collect();
        let reply = self.call(message("ROUTE", vec![("routes", Value::Array(list))]))?;
        let view = reply.decisions();
        self.readable(view)
    }

    /// One ACK item per event (`AckItem::result` for each).
    pub fn lifecycle(&mut self, events: &[LifecycleEvent]) -> Result<Vec<AckItem>> {
        let list = events.iter().map(LifecycleEvent::to_value).collect();
        let reply = self.call(message("LIFECYCLE", vec![("events", Value::Array(list))]))?;
        let view = reply.items();
        self.readable(view)
    }

    /// One event; the `Err` is the request's or the event's own.
    pub fn report(&mut self, event: &LifecycleEvent) -> Result<()> {
        let items = self.lifecycle(std::slice::from_ref(event))?;
        match items.first() {
            Some(item) => item.result(),
            None => Err(Error::new(Code::PROTOCOL, "an ACK without its item")),
        }
    }

    fn admin(&mut self, kind: &str, action: &str, key: &str, list: Vec<Value>) -> Result<Vec<AckItem>> {
        let m = message(kind, vec![("action", Value::Str(action.into())), (key, Value::Array(list))]);
        let view = self.call(m)?.items();
        self.readable(view)
    }

    /// WORKERS add: `pool`, `worker` and optionally `name`, `event_endpoint`, `replay_endpoint`,
    /// `dp_rank`, `healthy`. One ACK item per worker.
    pub fn add_workers(&mut self, workers: &[Worker]) -> Result<Vec<AckItem>> {
        self.admin("WORKERS", "add", "workers", workers.iter().map(Worker::to_value).collect())
    }

    /// WORKERS remove (`pool`, `worker`). One ACK item per worker.
    pub fn remove_workers(&mut self, workers: &[Worker]) -> Result<Vec<AckItem>> {
        self.admin("WORKERS", "remove", "workers", workers.iter().map(Worker::to_value).collect())
    }

    /// WORKERS update: `healthy` (required) of workers named by `pool` and `worker`.
    pub fn update_workers(&mut self, workers: &[Worker]) -> Result<Vec<AckItem>> {
        self.admin("WORKERS", "update", "workers", workers.iter().map(Worker::to_value).collect())
    }

    /// WORKERS list, with the runtime fields; `pool` None lists every pool's.
    pub fn list_workers(&mut self, pool: Option<&str>) -> Result<Vec<Worker>> {
        let mut fields = vec![("action", Value::Str("list".into()))];
        if let Some(p) = pool {
            fields.push(("pool", Value::Str(p.into())));
        }
        let view = self.call(message("WORKERS", fields))?.workers();
        self.readable(view)
    }

    /// POOLS add (`name`, `block_size` required). One ACK item per pool.
    pub fn add_pools(&mut self, pools: &[Pool]) -> Result<Vec<AckItem>> {
        self.admin("POOLS", "add", "pools", pools.iter().map(Pool::to_value).collect())
    }

    /// POOLS update (model, policy, params). One ACK item per pool.
    pub fn update_pools(&mut self, pools: &[Pool]) -> Result<Vec<AckItem>> {
        self.admin("POOLS", "update", "pools", pools.iter().map(Pool::to_value).collect())
    }

    /// POOLS remove: each named pool ends (its workers removed, their active work ended with
    /// outcome records) and everything it holds is released. One ACK item per name (NOT_FOUND
    /// for a pool that does not exist).
    pub fn remove_pools(&mut self, names: &[&str]) -> Result<Vec<AckItem>> {
        let list = names.iter().map(|n| Value::Map(vec![("name".to_string(), Value::Str((*n).into()))])).collect();
        self.admin("POOLS", "remove", "pools", list)
    }

    /// POOLS list, with every policy parameter.
    pub fn list_pools(&mut self) -> Result<Vec<Pool>> {
        let reply = self.call(message("POOLS", vec![("action", Value::Str("list".into()))]))?;
        let view = reply.pools();
        self.readable(view)
    }

    /// STATUS.
    pub fn status(&mut self) -> Result<StatusReply> {
        let view = self.call(message("STATUS", vec![]))?.status();
        self.readable(view)
    }

    // ---- frames ---------------------------------------------------------------------------------

    /// The message with the next id (not yet taken) as a frame: (the id, the frame, the message).
    fn frame(&self, message: Value) -> Result<(u64, Vec<u8>, Value)> {
        let id = self.next_id;
        let mut entries = match message {
            Value::Map(e) => e,
            _ => return Err(Error::new(Code::INVALID_ARGUMENT, "a request is a map")),
        };
        entries.retain(|(k, _)| k != "id");
        entries.insert(1.min(entries.len()), ("id".to_string(), Value::UInt(id)));
        let message = Value::Map(entries);
        let mut frame = vec![0u8; 4];
        message.encode(&mut frame);
        let length = frame.len() - 4;
        if length > self.max_frame_bytes as usize {
            let m = format!(
                "{} message encodes to {} bytes, max_frame_bytes is {}",
                message.get("type").and_then(Value::as_str).unwrap_or("?"),
                length,
                self.max_frame_bytes
            );
            return Err(Error::new(Code::TOO_LARGE, m));
        }
        frame[..4].copy_from_slice(&(length as u32).to_be_bytes());
        Ok((id, frame, message))
    }

    fn send_value(&mut self, message: Value, deadline: Option<Instant>) -> Result<u64> {
        let (id, frame, message) = self.frame(message)?;
        let stream = match self.stream.as_mut() {
            Some(s) => s,
            None => return Err(self.closed_error()),
        };
        let (written, result) = write_before(stream, &frame, deadline);
        if written > 0 {
            self.next_id += 1;
        }
        if let Err(e) = result {
            if written == 0 && timed_out(&e) {
                // Nothing sent: the stream is intact, and the id is left for the next request.
                return Err(Error::new(Code::TIMEOUT, "send timed out before any byte was sent"));
            }
            // Part of the frame may be out: the stream cannot be continued.
            let err = if timed_out(&e) {
                Error::new(Code::TIMEOUT, "send timed out; connection closed mid-frame")
            } else {
                Error::new(Code::CLOSED, format!("send failed: {}", e))
            };
            return Err(self.fail(err));
        }
        self.outstanding.insert(id, expected_reply(&message));
        Ok(id)
    }

    /// The next reply someone may still want (late replies to given-up calls are dropped, see
    /// `give_up`), checked against its request.
    fn read_unabandoned(&mut self, deadline: Option<Instant>) -> Result<Reply> {
        loop {
            let reply = self.read_reply(deadline)?;
            if let Some(exp) = self.abandoned.remove(&reply.id) {
                self.check_reply(&reply, &exp)?;
                continue;
            }
            let waiting = self.outstanding.contains_key(&reply.id);
            if reply.id != 0 && reply.id <= self.forgotten && !waiting {
                continue; // a late reply to a call given up and forgotten
            }
            let exp = match self.outstanding.get(&reply.id) {
                Some(exp) if !self.kept.iter().any(|r| r.id == reply.id) => exp.clone(),
                _ => {
                    let m = format!("the server answered request {}, which is not waiting for a reply", reply.id);
                    return Err(self.fail(Error::new(Code::PROTOCOL, m)));
                }
            };
            self.check_reply(&reply, &exp)?;
            return Ok(reply);
        }
    }

    fn check_reply(&mut self, reply: &Reply, exp: &Expected) -> Result<()> {
        if reply.kind == "ERROR" {
            return Ok(());
        }
        if exp.reply != Some(reply.kind.as_str()) {
            let m = format!("the server answered request {} ({}) with {}", reply.id, exp.request, reply.kind);
            return Err(self.fail(Error::new(Code::PROTOCOL, m)));
        }
        if let Some(key) = exp.list {
            let got = reply.body.get(key).and_then(Value::as_array).map_or(0, |a| a.len());
            if got != exp.count {
                let m = format!("the server answered request {} with {} {} for {}", reply.id, got, key, exp.count);
                return Err(self.fail(Error::new(Code::PROTOCOL, m)));
            }
        }
        Ok(())
    }

    /// One whole frame, decoded, with a connection-level ERROR turned into CLOSED. A timeout
    /// keeps the partial bytes for the next call.
    fn read_reply(&mut self, deadline: Option<Instant>) -> Result<Reply> {
        let reply = self.read_message(deadline)?;
        if reply.kind == "ERROR" && reply.id == 0 {
            // The server is closing the connection: CLOSED whatever its code, which is named.
            let e = reply.error().unwrap_or_else(|| Error::new(Code::PROTOCOL, ""));
            let m = format!(
                "the server closes the connection: {} ({}): {}",
                e.code, e.code.0, e.message
            );
            return Err(self.fail(Error::new(Code::CLOSED, m)));
        }
        Ok(reply)
    }

    /// One whole frame, decoded. A timeout keeps the partial bytes for the next call.
    fn read_message(&mut self, deadline: Option<Instant>) -> Result<Reply> {
        let payload = self.read_frame(deadline)?;
        let body = match Value::decode(&payload) {
            Ok(v) => v,
            Err(e) => return Err(self.fail(e)),
        };
        if !matches!(body, Value::Map(_)) {
            return Err(self.fail(Error::new(Code::PARSE, "a reply is a map")));
        }
        let kind = body.get("type").and_then(Value::as_str).unwrap_or("").to_string();
        // An id is a uint64 (docs/PROTOCOL.md); nil or absent only on a connection-level ERROR.
        // Anything else, a float equal to an id sent included, is a protocol error.
        let id = match body.get("id") {
            None => 0,
            Some(v) => match v.as_u64() {
                Some(id) => id,
                None => {
                    let shown: String = format!("{:?}", v).chars().take(80).collect();
                    let m = format!("a {} reply's id {} is not a non-negative integer", kind,
                                    shown);
                    return Err(self.fail(Error::new(Code::PROTOCOL, m)));
                }
            },
        };
        Ok(Reply { kind, id, body })
    }

    fn read_frame(&mut self, deadline: Option<Instant>) -> Result<Vec<u8>> {
        loop {
            if self.buffer.len() >= 4 {
                let mut header = [0u8; 4];
                header.copy_from_slice(&self.buffer[..4]);
                let length = u32::from_be_bytes(header);
                if length == 0 {
                    return Err(self.fail(Error::new(Code::PROTOCOL, "reply frame declares 0 bytes")));
                }
                if length > self.max_frame_bytes {
                    let m = format!("reply frame declares {} bytes, max_frame_bytes is {}", length, self.max_frame_bytes);
                    return Err(self.fail(Error::new(Code::TOO_LARGE, m)));
                }
                let end = 4 + length as usize;
                if self.buffer.len() >= end {
                    let payload = self.buffer[4..end].to_vec();
                    self.buffer.drain(..end);
                    return Ok(payload);
                }
            }
            let left = remaining(deadline);
            if left == Some(Duration::ZERO) {
                return Err(Error::new(Code::TIMEOUT, "no reply before the timeout"));
            }
            let stream = match self.stream.as_mut() {
                Some(s) => s,
                None => return Err(self.closed_error()),
            };
            let mut chunk = [0u8; 65536];
            let got = stream.set_timeouts(left).and_then(|_| stream.read(&mut chunk));
            match got {
                Ok(0) => {
                    let m = if self.buffer.is_empty() {
                        "the server closed the connection"
                    } else {
                        "the server closed the connection mid-frame"
                    };
                    return Err(self.fail(Error::new(Code::CLOSED, m)));
                }
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
                Err(e) if timed_out(&e) => {
                    return Err(Error::new(Code::TIMEOUT, "no reply before the timeout"))
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(self.fail(Error::new(Code::CLOSED, format!("the connection failed: {}", e))))
                }
            }
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

/// Bytes given to one write: a Unix socket's send timeout bounds each wait for buffer space, not
/// the write, so one write of many such waits could outlast the time left; a write this size
/// waits at most once (a Unix socket's default send buffer holds twice as much).
const WRITE_CHUNK: usize = 64 << 10;

/// Write all of `bytes` before `deadline` (None: no limit), each write given only what is left of
/// the time, so a server that drains the frame slowly cannot stretch the send past the deadline.
/// Returns how many bytes were written, with the error that stopped it short of all of them.
fn write_before(
    stream: &mut Stream,
    bytes: &[u8],
    deadline: Option<Instant>,
) -> (usize, io::Result<()>) {
    let mut written = 0;
    while written < bytes.len() {
        let left = remaining(deadline);
        if left == Some(Duration::ZERO) {
            let e = io::Error::new(io::ErrorKind::TimedOut, "the deadline passed");
            return (written, Err(e));
        }
        if let Err(e) = stream.set_timeouts(left) {
            return (written, Err(e));
        }
        let end = bytes.len().min(written + WRITE_CHUNK);
        match stream.write(&bytes[written..end]) {
            Ok(0) => {
                let e = io::Error::new(io::ErrorKind::WriteZero, "the socket took nothing");
                return (written, Err(e));
            }
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (written, Err(e)),
        }
    }
    (written, Ok(()))
}

/// Time left before `deadline`: None for no deadline, ZERO once it passed.
fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

fn message(kind: &str, fields: Vec<(&str, Value)>) -> Value {
    let mut entries = vec![("type".to_string(), Value::Str(kind.to_string()))];
    entries.extend(fields.into_iter().map(|(k, v)| (k.to_string(), v)));
    Value::Map(entries)
}

/// Connect to a Unix socket within `timeout` (None or zero: no limit). A blocking connect to a
/// listener whose queue is full waits until the server accepts, however long that is; a
/// non-blocking one fails at once (EAGAIN) and is tried again until the time is up.
#[cfg(target_os = "linux")]
fn connect_unix(path: &str, timeout: Option<Duration>) -> io::Result<UnixStream> {
    use std::os::raw::{c_int, c_void};
    use std::os::unix::io::FromRawFd;
    const AF_UNIX: c_int = 1;
    const SOCK_STREAM: c_int = 1;
    const SOCK_NONBLOCK: c_int = 0o4000;
    const SOCK_CLOEXEC: c_int = 0o2000000;
    const SUN_PATH: usize = 108;
    #[repr(C)]
    struct SockaddrUn {
        family: u16,
        path: [u8; SUN_PATH],
    }
    extern "C" {
        fn socket(domain: c_int, kind: c_int, protocol: c_int) -> c_int;
        fn connect(fd: c_int, address: *const c_void, length: u32) -> c_int;
    }
    let limit = match timeout {
        Some(t) if t > Duration::ZERO => t,
        _ => return UnixStream::connect(path),
    };
    let bytes = path.as_bytes();
    if bytes.len() >= SUN_PATH || bytes.contains(&0) {
        let m = "a unix socket path is at most 107 bytes, without NUL";
        return Err(io::Error::new(io::ErrorKind::InvalidInput, m));
    }
    let mut address = SockaddrUn { family: AF_UNIX as u16, path: [0; SUN_PATH] };
    address.path[..bytes.len()].copy_from_slice(bytes);
    let length = (2 + bytes.len() + 1) as u32;
    // SAFETY: socket takes no pointers; the descriptor it returns is owned by `stream` at once.
    let fd = unsafe { socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket nothing else owns; dropping the stream closes it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(1);
    loop {
        // SAFETY: `address` is a sockaddr_un that lives across the call; `length` is within it.
        let rc = unsafe { connect(fd, &address as *const SockaddrUn as *const c_void, length) };
        if rc == 0 {
            stream.set_nonblocking(false)?;
            return Ok(stream);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {}
            _ => return Err(e),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let m = "the server did not accept the connection before the timeout";
            return Err(io::Error::new(io::ErrorKind::TimedOut, m));
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

#[cfg(not(target_os = "linux"))]
fn connect_unix(path: &str, _timeout: Option<Duration>) -> io::Result<UnixStream> {
    UnixStream::connect(path)
}

fn open(address: &str, timeout: Option<Duration>) -> Result<Stream> {
    let invalid = |m: String| Error::new(Code::INVALID_ARGUMENT, m);
    if let Some(path) = address.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(invalid("empty unix socket path".into()));
        }
        return connect_unix(path, timeout)
            .map(Stream::Unix)
            .map_err(|e| Error::new(Code::IO, format!("connect to {}: {}", address, e)));
    }
    if let Some(target) = address.strip_prefix("tcp:") {
        let addr: SocketAddr = target
            .parse()
            .map_err(|_| invalid(format!("expected tcp:IP:PORT, got {:?}", address)))?;
        let stream = match timeout {
            Some(t) if t > Duration::ZERO => TcpStream::connect_timeout(&addr, t),
            _ => TcpStream::connect(addr),
        }
        .map_err(|e| Error::new(Code::IO, format!("connect to {}: {}", address, e)))?;
        let _ = stream.set_nodelay(true);
        return Ok(Stream::Tcp(stream));
    }
    Err(invalid(format!("address must start with unix: or tcp:, got {:?}", address)))
}

/// A real `kvmatch serve` whose frame limit is 4,096 bytes, and a client holding a larger one (an
/// out-of-date view of the server, which only this module can give it): the server's
/// KM_ERR_TOO_LARGE for the frame reaches the caller as the connection's end. Calls given up by
/// the thousand, on a socket this module makes non-blocking. The client's own check, and
/// everything else against a real server, are in tests/server.rs.
#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;
    use std::process::{Command, Stdio};

    /// The deadline's errors keep the connection; the kernel's ETIMEDOUT is a dead one.
    #[test]
    fn only_the_clients_own_timeouts_count_as_the_deadline() {
        assert!(timed_out(&io::Error::from(io::ErrorKind::WouldBlock)));
        assert!(timed_out(&io::Error::new(io::ErrorKind::TimedOut, "the deadline passed")));
        let kernel = io::Error::from_raw_os_error(110); // ETIMEDOUT on Linux
        assert_eq!(kernel.kind(), io::ErrorKind::TimedOut);
        assert!(!timed_out(&kernel));
        assert!(!timed_out(&io::Error::from_raw_os_error(113))); // EHOSTUNREACH
    }

    /// One length-prefixed frame's payload off `conn`; None when the peer went away.
    fn read_frame(conn: &mut UnixStream) -> Option<Vec<u8>> {
        let mut header = [0u8; 4];
        conn.read_exact(&mut header).ok()?;
        let mut payload = vec![0u8; u32::from_be_bytes(header) as usize];
        conn.read_exact(&mut payload).ok()?;
        Some(payload)
    }

    /// `reply` as a length-prefixed frame.
    fn frame_of(reply: &Value) -> Vec<u8> {
        let mut frame = vec![0u8; 4];
        reply.encode(&mut frame);
        let length = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&length.to_be_bytes());
        frame
    }

    /// A fake server on `path`: WELCOME to the HELLO, then every ROUTE's reply (a DECISION, or a
    /// STATUS_REPLY, of the wrong type, to a route whose request_id is in `wrong`) held until a
    /// route of request_id "release" comes, then all sent in order before its own.
    fn holding_server(path: &std::path::Path, wrong: &'static [&'static str]) {
        let listener = UnixListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            let mut conn = match listener.accept() {
                Ok((conn, _)) => conn,
                Err(_) => return,
            };
            let mut held = Vec::new();
            while let Some(payload) = read_frame(&mut conn) {
                let m = Value::decode(&payload).expect("a request");
                let id = m.get("id").cloned().unwrap_or(Value::UInt(0));
                let request_id = m
                    .get("routes")
                    .and_then(Value::as_array)
                    .and_then(|r| r.first())
                    .and_then(|r| r.get("request_id"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let reply = match m.get("type").and_then(Value::as_str) {
                    Some("HELLO") => message("WELCOME", vec![
                        ("id", id),
                        ("protocol", Value::UInt(1)),
                        ("kvmatch_version", Value::Str("fake".into())),
                    ]),
                    _ if wrong.contains(&request_id.as_str()) => message("STATUS_REPLY", vec![
                        ("id", id),
                        ("kvmatch_version", Value::Str("fake".into())),
                    ]),
                    _ => {
                        let decision = Value::Map(vec![
                            ("status".into(), Value::UInt(0)),
                            ("decision_id".into(), Value::UInt(1)),
                            ("chosen_worker".into(), Value::UInt(2)),
                            ("source".into(), Value::Str("events".into())),
                        ]);
                        let decisions = Value::Array(vec![decision]);
                        message("DECISION", vec![("id", id), ("decisions", decisions)])
                    }
                };
                held.extend(frame_of(&reply));
                if request_id.is_empty() || request_id == "release" {
                    if conn.write_all(&held).is_err() {
                        return;
                    }
                    held.clear();
                }
            }
        });
    }

    fn set_nonblocking(c: &Client, on: bool) {
        match &c.stream {
            Some(Stream::Unix(s)) => s.set_nonblocking(on).expect("set_nonblocking"),
            _ => panic!("not a unix socket"),
        }
    }

    /// A fake server on `path`: WELCOME to the HELLO, then nothing read for `stall`, then every
    /// byte read and none answered.
    fn stalling_server(path: &std::path::Path, stall: Duration) {
        let listener = UnixListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            let mut conn = match listener.accept() {
                Ok((conn, _)) => conn,
                Err(_) => return,
            };
            let payload = match read_frame(&mut conn) {
                Some(p) => p,
                None => return,
            };
            let id = Value::decode(&payload).ok().and_then(|m| m.get("id").cloned());
            let welcome = message("WELCOME", vec![
                ("id", id.unwrap_or(Value::UInt(0))),
                ("protocol", Value::UInt(1)),
                ("kvmatch_version", Value::Str("fake".into())),
            ]);
            if conn.write_all(&frame_of(&welcome)).is_err() {
                return;
            }
            std::thread::sleep(stall);
            let mut sink = vec![0u8; 1 << 16];
            while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
        });
    }

    #[test]
    fn a_call_gives_up_within_one_timeout_however_long_its_send_took() {
        // The frame (about 5 MB) fills the socket while the server reads nothing for 3 s, so its
        // send takes about 3 s of the call's 4, and no reply ever comes: the call ends at its 4 s,
        // not at the send's end plus another 4 s.
        let path = std::env::temp_dir()
            .join(format!("kvmatch-rust-one-timeout-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        stalling_server(&path, Duration::from_secs(3));
        let address = format!("unix:{}", path.display());
        let mut c = Client::connect(&address, Some(Duration::from_secs(4))).expect("connect");
        let _ = std::fs::remove_file(&path);
        let big = RouteRequest {
            request_id: "big".into(),
            prompt: crate::messages::Prompt::Tokens((0..1_000_000).collect()),
            ..Default::default()
        };
        let start = Instant::now();
        let e = c.route(&[big]).expect_err("no reply comes");
        let took = start.elapsed();
        assert_eq!(e.code, Code::TIMEOUT, "{}", e);
        assert!(e.message.contains("no reply"), "the send completed, the wait timed out: {}", e);
        assert!(took >= Duration::from_secs(3), "the send waited for the server: {:?}", took);
        assert!(took < Duration::from_millis(6500), "one timeout for send and wait: {:?}", took);
    }

    #[test]
    fn given_up_calls_are_bounded() {
        // A blocking call that timed out gives its request up. The ids of at most MAX_ABANDONED
        // (4096) of them are kept, the lowest forgotten past that, so a server that never answers
        // cannot make the client grow with every call that times out. A late reply to a
        // forgotten id is dropped unchecked; one to a kept id is checked (here the lowest kept,
        // of the wrong type, closes the connection).
        assert_eq!(MAX_ABANDONED, 4096);
        let path = std::env::temp_dir()
            .join(format!("kvmatch-rust-abandoned-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        holding_server(&path, &["given-up-0", "given-up-10"]);
        let address = format!("unix:{}", path.display());
        let mut c = Client::connect(&address, Some(Duration::from_secs(20))).expect("connect");
        let _ = std::fs::remove_file(&path);
        // A read that finds no reply now fails at once (read as the timeout), so each call gives
        // its request up without waiting for a timer; a send that finds the socket full sends
        // nothing and is tried again.
        set_nonblocking(&c, true);
        let mut ids = Vec::new(); // the request id of given-up-0, given-up-1, ...
        while ids.len() < MAX_ABANDONED + 10 {
            let name = format!("given-up-{}", ids.len());
            let route = RouteRequest { request_id: name.clone(), ..Default::default() };
            match c.route(&[route]) {
                Err(e) if e.code == Code::TIMEOUT && e.message.contains("before any byte") => {}
                Err(e) if e.code == Code::TIMEOUT => ids.push(c.next_id - 1),
                other => panic!("{}: expected a timeout, got {:?}", name, other),
            }
        }
        assert!(!c.is_closed() && c.outstanding() == 0);
        assert_eq!(c.abandoned.len(), MAX_ABANDONED, "the ids of given-up calls kept");
        set_nonblocking(&c, false);
        // given-up-0 is forgotten: its reply, of the wrong type, is dropped; given-up-10 is kept.
        let release = RouteRequest { request_id: "release".into(), ..Default::default() };
        let e = c.route(&[release]).expect_err("given-up-10's reply is checked");
        assert_eq!(e.code, Code::PROTOCOL, "{}", e);
        let answered = format!("request {} (ROUTE) with STATUS_REPLY", ids[10]);
        assert!(e.message.contains(&answered), "expected {}, got {}", answered, e);
        assert!(c.is_closed());
    }

    fn binary() -> PathBuf {
        let root = match std::env::var("KM_ROOT") {
            Ok(r) if !r.is_empty() => PathBuf::from(r),
            _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."),
        };
        let mut candidates: Vec<PathBuf> = std::env::var("KM_BIN").ok().into_iter().map(PathBuf::from).collect();
        candidates.push(root.join("build/kvmatch"));
        candidates.push(root.join("build-cpu/kvmatch"));
        candidates.into_iter().find(|p| p.is_file()).expect("no kvmatch binary: build it with make, or set KM_BIN")
    }

    #[test]
    fn a_frame_over_the_servers_limit_is_refused_by_the_server() {
        let dir = std::env::temp_dir().join(format!("kvmatch-rust-frame-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let config = dir.join("kvmatch.json");
        std::fs::write(
            &config,
            r#"{"limits": {"max_frame_bytes": 4096},
               "pools": [{"name": "default", "block_size": 16, "workers": [{"id": 0}, {"id": 1}]}]}"#,
        )
        .expect("config");
        let sock = dir.join("kvmatch.sock");
        let mut child = Command::new(binary())
            .args(["serve", "--records", "none", "--config"])
            .arg(&config)
            .arg("--socket")
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kvmatch serve");
        let address = format!("unix:{}", sock.display());
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut client = None;
        while client.is_none() && Instant::now() < deadline {
            client = Client::connect(&address, Some(Duration::from_secs(1))).ok();
            if client.is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut c = client.expect("kvmatch serve did not accept");
            c.set_timeout(Some(Duration::from_secs(20)));
            assert_eq!(c.welcome().limits.max_frame_bytes, 4096);
            c.max_frame_bytes = 1 << 20; // the out-of-date view: nothing stops the frame here
            let big = RouteRequest {
                request_id: "big".into(),
                prompt: crate::messages::Prompt::Tokens((0..3000).map(|i| 1000 + i).collect()),
                ..Default::default()
            };
            let e = c.route(&[big]).expect_err("a frame over the server's limit");
            assert_eq!(e.code, Code::CLOSED, "{}", e);
            assert!(e.message.contains("KM_ERR_TOO_LARGE"), "the server's code is reported: {}", e);
            assert!(c.is_closed());
        }));
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}
