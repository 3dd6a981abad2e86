// SPDX-License-Identifier: Apache-2.0
//! The client against a real `kvmatch serve` ($KM_BIN, else build/kvmatch or build-cpu/kvmatch)
//! started on a Unix socket in a temporary directory: routes (blocking, pipelined, batched), the
//! lifecycle reports, a decision that asks for a warm-up and the warm-up's lifecycle, WORKERS /
//! POOLS / STATUS, each error the server answers, servers of their own configured to refuse
//! (OVERLOADED from the per-connection budget and for a connection over max_connections,
//! TOO_LARGE for a request over the server's frame limit, SHUTTING_DOWN after a SIGTERM while
//! routes are in flight), a server that goes away mid-request and reconnecting once it is back
//! (request ids go on). Replies a real server never sends (wrong count, wrong type, unknown id,
//! connection-level ERROR, unreadable or oversize frames, a malformed warm_up) come from a fake
//! server written here. Every wait is bounded by the client's timeout.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use kvmatch_client::{
    outcome_from_stream, Client, Code, Event, LifecycleEvent, Pool, Prompt, RouteRequest, Value,
    Worker,
};

const WORKERS: u32 = 3;
const TIMEOUT: Option<Duration> = Some(Duration::from_secs(20));

fn root() -> PathBuf {
    match std::env::var("KM_ROOT") {
        Ok(r) if !r.is_empty() => PathBuf::from(r),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
    }
}

fn binary() -> PathBuf {
    let mut candidates = Vec::new();
    if let Ok(b) = std::env::var("KM_BIN") {
        candidates.push(PathBuf::from(b));
    }
    candidates.push(root().join("build/kvmatch"));
    candidates.push(root().join("build-cpu/kvmatch"));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .expect("no kvmatch binary: build it with make, or set KM_BIN")
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir()
            .join(format!("kvmatch-rust-{}-{}-{}", tag, std::process::id(), nanos));
        fs::create_dir_all(&dir).expect("temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

struct Server {
    dir: TempDir,
    address: String,
    /// Config-file members besides the pool (JSON text, e.g. `"limits": {...}`); None: flags only.
    config: Option<String>,
    child: Option<Child>,
}

impl Server {
    fn start(tag: &str) -> Server {
        Server::start_with(tag, None)
    }

    fn start_with(tag: &str, config: Option<&str>) -> Server {
        let dir = TempDir::new(tag);
        let address = format!("unix:{}", dir.0.join("kvmatch.sock").display());
        let mut s = Server { dir, address, config: config.map(String::from), child: None };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let sock = self.dir.0.join("kvmatch.sock");
        let _ = fs::remove_file(&sock);
        let mut cmd = Command::new(binary());
        cmd.args(["serve", "--records", "none", "--max-workers", "64"])
            .arg("--socket")
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(members) = &self.config {
            let workers: Vec<String> = (0..WORKERS).map(|w| format!("{{\"id\": {}}}", w)).collect();
            let text = format!(
                "{{{}, \"pools\": [{{\"name\": \"default\", \"block_size\": 16, \"policy\": \"kv\", \"workers\": [{}]}}]}}",
                members,
                workers.join(", ")
            );
            let path = self.dir.0.join("kvmatch.json");
            fs::write(&path, text).expect("config file");
            cmd.arg("--config").arg(path);
        } else {
            cmd.args(["--pool", "default:16:kv"]);
            for w in 0..WORKERS {
                cmd.arg("--worker").arg(format!("default:{}", w));
            }
        }
        self.child = Some(cmd.spawn().expect("start kvmatch serve"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if Client::connect(&self.address, Some(Duration::from_secs(1))).is_ok() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!("kvmatch serve did not accept on {}", sock.display());
    }

    /// SIGSTOP, returning once every thread of the server is stopped.
    fn pause(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill").args(["-STOP", &pid.to_string()]).status();
        assert!(status.map(|s| s.success()).unwrap_or(false), "kill -STOP");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let tasks = fs::read_dir(format!("/proc/{}/task", pid)).expect("/proc");
            let all_stopped = tasks.filter_map(|t| t.ok()).all(|t| {
                let stat = fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                stat.rsplit(')').next().map_or(false, |rest| rest.trim_start().starts_with('T'))
            });
            if all_stopped {
                return;
            }
            thread::sleep(Duration::from_millis(10));
        }
        panic!("kvmatch serve did not stop");
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn prompt(n: usize, seed: usize) -> Vec<u32> {
    (0..n).map(|i| ((seed * 7919 + i * 31) % 50000) as u32).collect()
}

fn tokens(request_id: &str, t: Vec<u32>) -> RouteRequest {
    RouteRequest { request_id: request_id.into(), prompt: Prompt::Tokens(t), ..Default::default() }
}

fn expect_code<T: std::fmt::Debug>(r: kvmatch_client::Result<T>, code: Code, what: &str) {
    match r {
        Err(e) => assert_eq!(e.code, code, "{}: expected {}, got {}", what, code, e),
        Ok(v) => panic!("{}: expected {}, got {:?}", what, code, v),
    }
}

fn str_map(entries: &[(&str, Value)]) -> Value {
    Value::Map(entries.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
}

#[test]
fn error_names_match_the_header() {
    let header = fs::read_to_string(root().join("include/kvmatch/error.h")).expect("error.h");
    let mut n = 0;
    for line in header.lines() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("X(KM_") {
            let mut parts = rest.splitn(3, ',');
            let name = format!("KM_{}", parts.next().unwrap_or("").trim());
            let code: i64 = parts.next().unwrap_or("").trim().parse().expect("a code");
            assert_eq!(Code(code).name(), name, "code {}", code);
            n += 1;
        }
    }
    assert!(n > 0 && n == Code::ALL.len(), "error.h has {} codes, the client {}", n, Code::ALL.len());
    assert_eq!(Code(-99).name(), "KM_ERR_UNKNOWN(-99)");
}

#[test]
fn outcome_rule() {
    assert_eq!(outcome_from_stream(Some("stop"), true, Some(200), None), "complete");
    assert_eq!(outcome_from_stream(Some("stop"), false, Some(200), None), "incomplete");
    assert_eq!(outcome_from_stream(None, true, Some(200), None), "incomplete");
    assert_eq!(outcome_from_stream(Some("stop"), true, Some(503), None), "error");
    assert_eq!(outcome_from_stream(Some("stop"), true, Some(200), Some("reset")), "error");
    assert_eq!(outcome_from_stream(Some("length"), true, None, None), "complete");
}

#[test]
fn address_forms() {
    for bad in ["", "unix:", "tcp:nohost", "http://x", "tcp:localhost:80"] {
        expect_code(Client::connect(bad, TIMEOUT).map(|_| ()), Code::INVALID_ARGUMENT, bad);
    }
}

#[test]
fn route_and_lifecycle() {
    let s = Server::start("route");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    assert_eq!(c.welcome().protocol, 1);
    assert!(c.welcome().limits.max_batch_items >= 1);
    let t = prompt(100, 1);
    let mut r1 = tokens("r1", t.clone());
    r1.attempt_id = Some("0".into());
    r1.pool = Some("default".into());
    r1.expected_output_tokens = Some(50);
    let d = c.route(&[r1]).expect("route").remove(0);
    d.result().expect("decided");
    assert!(d.chosen_worker < WORKERS);
    assert_eq!((d.n_blocks, d.block_size, d.source.as_str()), (6, 16, "approx"));
    assert_eq!(d.policy.as_deref(), Some("kv"));
    assert_eq!(d.load_scope.as_deref(), Some("this_instance"));
    assert_eq!(d.candidates.len(), WORKERS as usize);
    assert!(d.owner_worker.is_none() && d.load_value.is_some());
    assert!(
        d.load_instances.is_none() && d.load_oldest_age_ms.is_none() && d.load_stale_instances.is_none(),
        "this instance's own view carries no cluster fields: {:?}",
        d
    );
    for ev in [
        LifecycleEvent { event: Event::Dispatched, decision_id: Some(d.decision_id), worker: Some(d.chosen_worker), elapsed_ms: Some(1.0), ..Default::default() },
        LifecycleEvent { event: Event::FirstToken, decision_id: Some(d.decision_id), elapsed_ms: Some(20.0), ..Default::default() },
        LifecycleEvent { event: Event::Finished, decision_id: Some(d.decision_id), finish_reason: Some("stop".into()), done_seen: true, http_status: Some(200), cached_tokens: Some(0), elapsed_ms: Some(90.0), ..Default::default() },
    ] {
        c.report(&ev).unwrap_or_else(|e| panic!("{:?}: {}", ev.event, e));
    }
    let mut r2 = tokens("r2", t.clone());
    r2.brief = true;
    let again = c.route(&[r2]).expect("route").remove(0);
    assert_eq!(again.owner_worker, Some(d.chosen_worker), "the chosen worker learned the prompt");
    assert_eq!(again.owner_depth, 6);
    assert!(again.candidates.is_empty(), "brief: no rows");
    let d3 = c.route(&[tokens("r3", t)]).expect("route").remove(0);
    let id3 = Some(d3.decision_id);
    let items = c
        .lifecycle(&[
            LifecycleEvent { event: Event::Finished, request_id: Some("r1".into()), attempt_id: Some("0".into()), ..Default::default() },
            LifecycleEvent { event: Event::Dispatched, decision_id: Some(987654321), ..Default::default() },
            LifecycleEvent { event: Event::FirstToken, decision_id: id3, ..Default::default() },
            LifecycleEvent { event: Event::FirstToken, decision_id: id3, ..Default::default() },
            LifecycleEvent { event: Event::Finished, decision_id: id3, outcome: Some("complete".into()), finish_reason: Some("stop".into()), ..Default::default() },
            LifecycleEvent { event: Event::Finished, decision_id: id3, elapsed_ms: Some(-1.0), ..Default::default() },
        ])
        .expect("lifecycle");
    let got: Vec<Code> = items.iter().map(|i| i.status).collect();
    assert_eq!(got, vec![Code::PROTOCOL, Code::NOT_FOUND, Code::OK, Code::PROTOCOL, Code::INVALID_ARGUMENT, Code::INVALID_ARGUMENT]);
    let e = items[1].result().expect_err("unknown decision");
    assert!(e.code == Code::NOT_FOUND && !e.message.is_empty());
}

#[test]
fn route_errors() {
    let s = Server::start("errors");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let mut nopool = tokens("nopool", prompt(40, 0));
    nopool.pool = Some("nope".into());
    let mut nomodel = tokens("nomodel", prompt(40, 0));
    nomodel.model = Some("no-such-model".into());
    let badsize = RouteRequest { request_id: "badsize".into(), prompt: Prompt::Hashes { hashes: vec![1, 2], block_size: Some(32) }, ..Default::default() };
    let mut range = tokens("range", prompt(20, 0));
    range.candidates = Some(vec![63]);
    let ds = c
        .route(&[tokens("ok", prompt(40, 0)), nopool, nomodel, badsize, tokens("", vec![1]), range, tokens("empty", vec![])])
        .expect("route");
    let got: Vec<Code> = ds.iter().map(|d| d.status).collect();
    assert_eq!(got, vec![Code::OK, Code::NOT_FOUND, Code::NOT_FOUND, Code::INVALID_ARGUMENT, Code::PARSE, Code::NOT_FOUND, Code::OK]);
    assert!(ds[1..6].iter().all(|d| d.message.as_deref().map_or(false, |m| !m.is_empty())));
    expect_code(c.call(str_map(&[("type", Value::Str("NO_SUCH_TYPE".into()))])), Code::PROTOCOL, "unknown type");
    expect_code(c.call(str_map(&[("type", Value::Str("ROUTE".into())), ("routes", Value::Str("r".into()))])), Code::PARSE, "routes not an array");
    let many: Vec<RouteRequest> = (0..=c.welcome().limits.max_batch_items).map(|i| tokens(&format!("x{}", i), vec![])).collect();
    expect_code(c.route(&many), Code::TOO_LARGE, "a batch over max_batch_items");
    expect_code(c.call(str_map(&[("type", Value::Str("WORKERS".into())), ("action", Value::Str("explode".into()))])), Code::PARSE, "unknown action");
    c.route(&[tokens("still", vec![1])]).expect("still serving").remove(0).result().expect("decided");
    let down = Worker { pool: "default".into(), worker: 1, healthy: Some(false), ..Default::default() };
    c.update_workers(&[down]).expect("update").remove(0).result().expect("health update");
    let mut only = tokens("down", vec![1]);
    only.candidates = Some(vec![1]);
    let d = c.route(&[only]).expect("route").remove(0);
    assert_eq!(d.result().map_err(|e| e.code), Err(Code::NO_HEALTHY_WORKER));
}

#[test]
fn admin() {
    let s = Server::start("admin");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let ws = c.list_workers(None).expect("list");
    assert_eq!(ws.len(), WORKERS as usize);
    assert!(ws[0].eligible.is_some() && ws[0].state.is_some());
    let w = |pool: &str, worker: u32| Worker { pool: pool.into(), worker, ..Default::default() };
    let mut named = w("default", 10);
    named.name = Some("w10".into());
    let mut bad_name = w("default", 12);
    bad_name.name = Some("bad\nname".into());
    let mut replay_only = w("default", 13);
    replay_only.replay_endpoint = Some("tcp://127.0.0.1:1".into());
    let items = c.add_workers(&[named, w("default", 1000), w("nope", 11), bad_name, replay_only]).expect("add");
    let got: Vec<Code> = items.iter().map(|i| i.status).collect();
    assert_eq!(got, vec![Code::OK, Code::WORKER_RANGE, Code::NOT_FOUND, Code::INVALID_ARGUMENT, Code::INVALID_ARGUMENT]);
    assert_eq!(c.list_workers(Some("default")).expect("list").len(), WORKERS as usize + 1);
    let items = c.remove_workers(&[w("default", 10), w("default", 99)]).expect("remove");
    assert_eq!(items.iter().map(|i| i.status).collect::<Vec<_>>(), vec![Code::OK, Code::NOT_FOUND]);
    assert_eq!(c.update_workers(&[w("default", 0)]).expect("update")[0].status, Code::INVALID_ARGUMENT);
    let second = Pool {
        name: "second".into(),
        block_size: Some(32),
        hash_lookahead_tokens: Some(2),
        policy: Some("least_load".into()),
        ..Default::default()
    };
    let nosize = Pool { name: "nosize".into(), ..Default::default() };
    let items = c.add_pools(&[second, nosize]).expect("pools add");
    assert_eq!(items.iter().map(|i| i.status).collect::<Vec<_>>(), vec![Code::OK, Code::BLOCK_SIZE]);
    let pools = c.list_pools().expect("pools list");
    assert_eq!(pools.len(), 2);
    assert_eq!((pools[1].name.as_str(), pools[1].block_size), ("second", Some(32)));
    assert_eq!(pools[1].hash_lookahead_tokens, Some(2));
    assert!(!pools[1].params.is_empty());
    let st = c.status().expect("status");
    assert!(!st.kvmatch_version.is_empty() && st.backend.is_some());
    assert_eq!(st.workers.len(), WORKERS as usize);
}

#[test]
fn remove_pools() {
    let s = Server::start("rmpool");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let gone = Pool { name: "gone".into(), block_size: Some(16), policy: Some("kv".into()), ..Default::default() };
    assert_eq!(c.add_pools(&[gone]).expect("pool add")[0].status, Code::OK);
    let w = |worker: u32| Worker { pool: "gone".into(), worker, ..Default::default() };
    let items = c.add_workers(&[w(20), w(21)]).expect("workers add");
    assert_eq!(items.iter().map(|i| i.status).collect::<Vec<_>>(), vec![Code::OK, Code::OK]);
    let mut r = tokens("in-gone", prompt(64, 0));
    r.pool = Some("gone".into());
    let d = c.route(&[r.clone()]).expect("route").remove(0);
    d.result().expect("decided");
    assert!(d.chosen_worker == 20 || d.chosen_worker == 21, "{:?}", d);
    let items = c.remove_pools(&["gone", "never-was"]).expect("pools remove");
    assert_eq!(items.iter().map(|i| i.status).collect::<Vec<_>>(), vec![Code::OK, Code::NOT_FOUND]);
    assert!(c.list_pools().expect("list").iter().all(|p| p.name != "gone"), "the pool is gone");
    assert!(c.list_workers(None).expect("list").iter().all(|w| w.worker != 20 && w.worker != 21), "its workers are gone");
    r.request_id = "after".into();
    assert_eq!(c.route(&[r]).expect("route").remove(0).status, Code::NOT_FOUND, "a route to the removed pool");
    // The attempt in flight there ended with its worker: its FINISHED comes late.
    let late = LifecycleEvent { event: Event::Finished, request_id: Some("in-gone".into()), ..Default::default() };
    assert_eq!(c.lifecycle(&[late]).expect("lifecycle")[0].status, Code::NOT_FOUND);
    let again = Pool { name: "gone".into(), block_size: Some(32), ..Default::default() };
    assert_eq!(c.add_pools(&[again]).expect("the name is free again")[0].status, Code::OK);
}

/// POOLS add names a pool's engine preset (none: the default) and POOL_LIST shows it; an unknown
/// preset fails that pool naming the presets, and an update may repeat the pool's preset only.
#[test]
fn pools_name_their_engine() {
    let s = Server::start("engine");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let pool = |name: &str, engine: Option<&str>| Pool {
        name: name.into(),
        block_size: Some(16),
        engine: engine.map(String::from),
        ..Default::default()
    };
    let items = c
        .add_pools(&[pool("big", Some("llama3-70b-h100x4")), pool("plain", None), pool("odd", Some("h100-9000"))])
        .expect("pools add");
    let got: Vec<Code> = items.iter().map(|i| i.status).collect();
    assert_eq!(got, vec![Code::OK, Code::OK, Code::INVALID_ARGUMENT], "{:?}", items);
    let msg = items[2].message.as_deref().unwrap_or("");
    assert!(msg.contains("h100-9000") && msg.contains("llama3-8b-h100"), "the refusal names the presets: {}", msg);
    let engines = |c: &mut Client| -> Vec<(String, Option<String>)> {
        let mut v: Vec<_> = c.list_pools().expect("pools list").into_iter().map(|p| (p.name, p.engine)).collect();
        v.retain(|(name, _)| name != "default");
        v.sort();
        v
    };
    let listed = engines(&mut c);
    let want = vec![
        ("big".to_string(), Some("llama3-70b-h100x4".to_string())),
        ("plain".to_string(), Some("llama3-8b-h100".to_string())),
    ];
    assert_eq!(listed, want, "the refused pool is not listed");
    let update = |name: &str, engine: &str| Pool { name: name.into(), engine: Some(engine.into()), ..Default::default() };
    let items = c
        .update_pools(&[update("big", "llama3-8b-h100"), update("plain", "llama3-70b-h100x4"), update("big", "llama3-70b-h100x4")])
        .expect("pools update");
    let got: Vec<Code> = items.iter().map(|i| i.status).collect();
    assert_eq!(got, vec![Code::INVALID_ARGUMENT, Code::INVALID_ARGUMENT, Code::OK], "{:?}", items);
    let msg = items[0].message.as_deref().unwrap_or("");
    assert!(msg.contains("llama3-70b-h100x4"), "the refusal names the pool's own preset: {}", msg);
    assert_eq!(engines(&mut c), want, "the refused updates changed nothing");
}

/// A frame of 5 routes over a budget of 4 is refused at once, by name, and the connection stays;
/// a pipelined burst gets one reply per frame, each a decision or that refusal.
#[test]
fn overloaded_by_the_connection_budget() {
    let s = Server::start_with("budget", Some(r#""scheduler": {"max_connection_routes": 4, "max_queue_wait_ms": 0}"#));
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let routes: Vec<RouteRequest> = (0..5).map(|i| tokens(&format!("over-{}", i), prompt(32, i))).collect();
    match c.route(&routes) {
        Err(e) => {
            assert_eq!((e.code, e.code.name()), (Code::OVERLOADED, "KM_ERR_OVERLOADED".to_string()), "{}", e);
            assert!(e.message.contains("max_connection_routes"), "the refusal names the limit: {}", e);
        }
        Ok(v) => panic!("5 routes over a budget of 4 were decided: {:?}", v),
    }
    c.route(&routes[..4]).expect("4 routes fit the budget").remove(0).result().expect("decided");
    let mut ids = Vec::new();
    for i in 0..40usize {
        let burst: Vec<RouteRequest> = (0..3)
            .map(|j| {
                let mut r = tokens(&format!("burst-{}-{}", i, j), prompt(512, i));
                r.brief = true;
                r
            })
            .collect();
        ids.push(c.send_route(&burst).expect("send"));
    }
    let (mut decided, mut refused) = (0, 0);
    for id in ids {
        let reply = c.wait(id).expect("a reply per frame");
        match reply.error() {
            Some(e) => {
                assert_eq!(e.code, Code::OVERLOADED, "a burst frame: {}", e);
                refused += 1;
            }
            None => {
                assert_eq!(reply.decisions().expect("decisions").len(), 3);
                decided += 1;
            }
        }
    }
    assert!(decided + refused == 40 && decided > 0, "decided {}, refused {}", decided, refused);
    assert!(!c.is_closed());
}

/// The client refuses a request over the limit WELCOME gave without sending it, and the connection
/// stays usable (the server's own answer to such a frame: the unit test in src/client.rs).
#[test]
fn oversize_request_is_refused_before_it_is_sent() {
    let s = Server::start_with("frame", Some(r#""limits": {"max_frame_bytes": 4096}"#));
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    assert_eq!(c.welcome().limits.max_frame_bytes, 4096);
    let e = c.route(&[tokens("big", prompt(3000, 0))]).expect_err("over the limit");
    assert_eq!(e.code, Code::TOO_LARGE, "{}", e);
    assert!(e.message.contains("4096") && !c.is_closed(), "{}", e);
    c.route(&[tokens("small", prompt(64, 0))]).expect("within the limit").remove(0).result().expect("decided");
}

/// SIGTERM while routes are in flight. A connection that does not read its replies holds the
/// drain open (the drain writes every reply before it closes a connection), so the stop is certain
/// to find work: a route on another open connection during the drain gets SHUTTING_DOWN by name;
/// every route of the stalled connection is answered (decided, or refused the same way when still
/// unread) once it reads; then both connections end with CLOSED, never a hang, and the server
/// exits 0.
#[test]
fn shutting_down_while_routes_are_in_flight() {
    let mut s = Server::start_with(
        "drain",
        Some(r#""scheduler": {"max_connection_routes": 0, "max_queue_wait_ms": 0, "max_queued_routes": 1048576}, "drain_timeout_ms": 60000"#),
    );
    let mut stalled = Client::connect(&s.address, TIMEOUT).expect("connect");
    let mut light = Client::connect(&s.address, TIMEOUT).expect("connect");
    light.route(&[tokens("before", prompt(64, 0))]).expect("route").remove(0).result().expect("decided before the stop");
    // About a megabyte of replies, far over what the socket buffers: unread, they keep the server
    // draining.
    let mut ids = Vec::new();
    for i in 0..100usize {
        let frame: Vec<RouteRequest> = (0..64).map(|j| tokens(&format!("q-{}-{}", i, j), prompt(64, i * 64 + j))).collect();
        ids.push(stalled.send_route(&frame).expect("send"));
    }
    let pid = s.child.as_ref().expect("running").id();
    assert!(Command::new("kill").args(["-TERM", &pid.to_string()]).status().map(|st| st.success()).unwrap_or(false));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut refused = None;
    let mut n = 0;
    while refused.is_none() && Instant::now() < deadline {
        match light.route(&[tokens(&format!("during-{}", n), prompt(64, 0))]) {
            Ok(_) => n += 1, // read before the stop took effect: decided; try again
            Err(e) => refused = Some(e),
        }
    }
    let e = refused.expect("no refusal during the drain");
    assert_eq!((e.code, e.code.name()), (Code::SHUTTING_DOWN, "KM_ERR_SHUTTING_DOWN".to_string()), "{}", e);
    let (mut decided, mut shut) = (0, 0);
    for id in &ids {
        let reply = stalled.wait(*id).expect("a reply per frame");
        match reply.error() {
            Some(e) => {
                assert_eq!(e.code, Code::SHUTTING_DOWN, "a queued route: {}", e);
                shut += 1;
            }
            None => {
                assert_eq!(reply.decisions().expect("decisions").len(), 64);
                decided += 1;
            }
        }
    }
    assert_eq!(decided + shut, ids.len(), "decided {}, refused {}", decided, shut);
    // Once the drain ends (a few ms after the last reply is read), each connection is closed.
    for c in [&mut stalled, &mut light] {
        loop {
            assert!(Instant::now() < deadline, "the connection was not closed after the drain");
            match c.route(&[tokens("after", vec![1])]) {
                Ok(d) => panic!("a route was decided after the stop: {:?}", d),
                Err(e) if e.code == Code::SHUTTING_DOWN => continue,
                Err(e) => {
                    assert_eq!(e.code, Code::CLOSED, "{}", e);
                    break;
                }
            }
        }
    }
    let status = s.child.take().expect("running").wait().expect("wait");
    assert!(status.success(), "kvmatch serve after the drain: {}", status);
}

/// A hot prefix on a worker past the ttft policy's load bound (six requests sharing 1024 tokens,
/// pinned to worker 0 and streaming): a route whose router carries out warm-ups (`warm_ups`)
/// stays with the holder, and its decision asks for a warm-up of another worker: the 64 shared
/// blocks, a decision of its own whose lifecycle the server acks like any decision's, and which
/// finishes once. A route without `warm_ups` asks for none.
#[test]
fn a_decision_asks_for_a_warm_up() {
    let s = Server::start("warm");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let shared = prompt(1024, 5);
    let with_shared = |seed: usize| [shared.clone(), prompt(16, seed)].concat();
    for k in 0..6usize {
        let mut r = tokens(&format!("hot-{}", k), with_shared(100 + k));
        r.candidates = Some(vec![0]);
        r.policy = Some("ttft".into());
        let d = c.route(&[r]).expect("route").remove(0);
        d.result().unwrap_or_else(|e| panic!("hot-{}: {}", k, e));
        assert_eq!(d.warm_up, None, "hot-{} has no warm_ups: {:?}", k, d);
        let first = LifecycleEvent { event: Event::FirstToken, decision_id: Some(d.decision_id), ..Default::default() };
        c.report(&first).unwrap_or_else(|e| panic!("hot-{} FIRST_TOKEN: {}", k, e));
    }
    let mut r = tokens("w", with_shared(99));
    r.attempt_id = Some("a".into());
    r.policy = Some("ttft".into());
    r.warm_ups = true;
    let d = c.route(&[r]).expect("route").remove(0);
    d.result().expect("decided");
    assert_eq!(d.chosen_worker, 0, "the request stays with the holder: {:?}", d);
    let w = d.warm_up.clone().unwrap_or_else(|| panic!("no warm_up in {:?}", d));
    assert!(w.worker != 0 && w.worker < WORKERS, "the warm-up is for another worker: {:?}", w);
    assert_eq!((w.blocks, w.tokens), (64, 1024), "the shared prefix: {:?}", w);
    assert_eq!(w.attempt_id, "a:warm_up");
    assert_ne!(w.decision_id, d.decision_id, "a decision of its own");
    let warm_up = |event| LifecycleEvent { event, decision_id: Some(w.decision_id), ..Default::default() };
    for ev in [
        LifecycleEvent { worker: Some(w.worker), elapsed_ms: Some(1.0), ..warm_up(Event::Dispatched) },
        LifecycleEvent { elapsed_ms: Some(30.0), ..warm_up(Event::FirstToken) },
        LifecycleEvent { finish_reason: Some("length".into()), done_seen: true, http_status: Some(200), elapsed_ms: Some(31.0), ..warm_up(Event::Finished) },
    ] {
        let items = c.lifecycle(&[ev.clone()]).expect("lifecycle");
        assert_eq!(items.iter().map(|i| i.status).collect::<Vec<_>>(), vec![Code::OK], "warm-up {:?}: {:?}", ev.event, items);
    }
    let again = c.lifecycle(&[warm_up(Event::Finished)]).expect("lifecycle");
    assert_eq!(again[0].status, Code::NOT_FOUND, "a warm-up finishes once: {:?}", again);
    let mut plain = tokens("p", with_shared(98));
    plain.policy = Some("ttft".into());
    let d = c.route(&[plain]).expect("route").remove(0);
    d.result().expect("decided");
    assert_eq!(d.warm_up, None, "no warm_ups, no warm-up: {:?}", d);
}

#[test]
fn pipelined() {
    let s = Server::start("pipelined");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let mut sent = std::collections::HashMap::new();
    for i in 0..64usize {
        let routes: Vec<RouteRequest> = (0..1 + i % 4).map(|j| tokens(&format!("p{}-{}", i, j), prompt(16 * (j + 1), i))).collect();
        sent.insert(c.send_route(&routes).expect("send"), routes.len());
    }
    assert_eq!(c.outstanding(), 64);
    for _ in 0..64 {
        let reply = c.receive().expect("receive");
        let n = sent.remove(&reply.id).expect("a reply per request, once");
        assert_eq!(reply.decisions().expect("decisions").len(), n);
    }
    assert_eq!(c.outstanding(), 0);
    let a = c.send_route(&[tokens("wa", vec![1])]).expect("send");
    let b = c.send_route(&[tokens("wb", vec![2])]).expect("send");
    assert_eq!(c.wait(b).expect("wait b").id, b);
    assert_eq!(c.wait(a).expect("wait a").id, a);
    expect_code(c.wait(a), Code::NOT_FOUND, "a reply already returned");
    expect_code(c.receive(), Code::INVALID_ARGUMENT, "nothing outstanding");
}

#[test]
fn server_goes_away_then_reconnect() {
    let mut s = Server::start("away");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    s.pause(); // the request is read by no one ...
    let id = c.send_route(&[tokens("lost", prompt(32, 0))]).expect("send");
    s.kill(); // ... and the server dies with it in flight
    expect_code(c.wait(id), Code::CLOSED, "server gone mid-request");
    assert!(c.is_closed());
    expect_code(c.route(&[tokens("x", vec![1])]), Code::CLOSED, "a call after");
    expect_code(c.reconnect(), Code::IO, "reconnect with no server");
    s.spawn();
    c.reconnect().expect("reconnect");
    assert!(!c.is_closed() && c.outstanding() == 0);
    c.route(&[tokens("back", vec![1])]).expect("served again").remove(0).result().expect("decided");
}

/// A connection the server does not take (max_connections 1, one held) fails connect with the
/// server's OVERLOADED, over the Unix socket (where the server's close often comes before the
/// HELLO is written) and over TCP.
#[test]
fn refused_connection_gives_the_servers_code() {
    let probe = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = probe.local_addr().expect("its address").port();
    drop(probe);
    let config = format!(r#""max_connections": 1, "tcp": "127.0.0.1:{}""#, port);
    let s = Server::start_with("refuse", Some(&config));
    let deadline = Instant::now() + Duration::from_secs(10);
    // The start-up check's connection may still count on the server's side.
    let _held = loop {
        match Client::connect(&s.address, TIMEOUT) {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "the one connection is not taken: {}", e),
        }
        thread::sleep(Duration::from_millis(20));
    };
    for address in [s.address.clone(), format!("tcp:127.0.0.1:{}", port)] {
        for _ in 0..20 {
            expect_code(Client::connect(&address, TIMEOUT).map(|_| ()), Code::OVERLOADED, &address);
        }
    }
}

/// A request id sent before a reconnect never names one sent after: waiting on it fails.
#[test]
fn ids_go_on_after_reconnect() {
    let s = Server::start("ids");
    let mut c = Client::connect(&s.address, TIMEOUT).expect("connect");
    let first = c.send_route(&[tokens("before", prompt(32, 0))]).expect("send");
    c.close();
    c.reconnect().expect("reconnect");
    let second = c.send_route(&[tokens("after", prompt(32, 0))]).expect("send");
    assert_ne!(first, second, "an id was used again after the reconnect");
    match c.wait(first) {
        Err(e) => assert!(e.code == Code::NOT_FOUND || e.code == Code::CLOSED, "{}", e),
        Ok(r) => panic!("wait on an id from before the reconnect returned {:?}", r.body),
    }
    let reply = c.wait(second).expect("the new request's reply");
    assert_eq!(reply.decisions().expect("decisions")[0].request_id, "after");
}

// ---- a fake server, for replies a real one never sends ------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Fake {
    Miscount,
    WrongType,
    UnknownId,
    ConnectionError,
    Garbage,
    Deep,
    Oversize,
    WelcomeWrongId,
    RefuseHello,
    SilentOnce,
    MistypedField,
    NoSource,
    // A decision whose warm_up lacks its decision_id, or holds its worker twice.
    WarmUpMissingKey,
    WarmUpKeyTwice,
    // Every reply after the WELCOME carries an id that is not a uint: a negative, a float equal to
    // the request's id, a bool, a str, an array, a map; the WELCOME does (a str, a float).
    IdNegative,
    IdFloat,
    IdBool,
    IdStr,
    IdArray,
    IdMap,
    WelcomeIdStr,
    WelcomeIdFloat,
    // A WELCOME whose limits are an int, not a map.
    WelcomeLimitsNotAMap,
}

/// The id a reply carries in the Id* modes, in place of the request's `id`.
fn bad_id(mode: Fake, id: &Value) -> Option<Value> {
    let n = id.as_u64().unwrap_or(0);
    match mode {
        Fake::IdNegative => Some(Value::Int(-(n as i64))),
        Fake::IdFloat | Fake::WelcomeIdFloat => Some(Value::Float(n as f64)),
        Fake::IdBool => Some(Value::Bool(true)),
        Fake::IdStr | Fake::WelcomeIdStr => Some(Value::Str(n.to_string())),
        Fake::IdArray => Some(Value::Array(vec![Value::UInt(n)])),
        Fake::IdMap => Some(str_map(&[("id", Value::UInt(n))])),
        _ => None,
    }
}

fn frame(v: &Value) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    v.encode(&mut out);
    let n = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&n.to_be_bytes());
    out
}

fn raw_frame(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

/// A fake server in `mode` on a socket in `dir`: its address. Each connection is served alone.
fn fake_server(dir: &TempDir, mode: Fake) -> String {
    let path = dir.0.join(format!("fake-{}.sock", mode as u8));
    let listener = UnixListener::bind(&path).expect("bind");
    thread::spawn(move || {
        for conn in listener.incoming() {
            match conn {
                Ok(conn) => {
                    thread::spawn(move || serve_fake(conn, mode));
                }
                Err(_) => return,
            }
        }
    });
    format!("unix:{}", path.display())
}

fn serve_fake(mut conn: UnixStream, mode: Fake) {
    let mut silent = mode == Fake::SilentOnce;
    loop {
        let mut header = [0u8; 4];
        if conn.read_exact(&mut header).is_err() {
            return;
        }
        let mut payload = vec![0u8; u32::from_be_bytes(header) as usize];
        if conn.read_exact(&mut payload).is_err() {
            return;
        }
        let m = match Value::decode(&payload) {
            Ok(m) => m,
            Err(_) => return,
        };
        let kind = m.get("type").and_then(Value::as_str).unwrap_or("").to_string();
        let id = m.get("id").cloned().unwrap_or(Value::UInt(0));
        let welcome_id = matches!(mode, Fake::WelcomeIdStr | Fake::WelcomeIdFloat);
        let id = match bad_id(mode, &id) {
            Some(bad) if welcome_id == (kind == "HELLO") => bad,
            _ => id,
        };
        let n = m.get("routes").and_then(Value::as_array).map_or(0, |r| r.len());
        let row = Value::Array(vec![
            Value::UInt(2), Value::UInt(1), Value::UInt(1), Value::UInt(0), Value::UInt(0), Value::UInt(0),
            Value::UInt(0), Value::UInt(0), Value::Nil, Value::Str("LIVE".into()), Value::Bool(true), Value::Str("appended".into()),
        ]);
        let decision = str_map(&[("status", Value::UInt(0)), ("decision_id", Value::UInt(1)), ("chosen_worker", Value::UInt(2)), ("source", Value::Str("events".into())), ("candidates", Value::Array(vec![row]))]);
        let decision = match mode {
            // A decision whose chosen_worker is a str: the frame reads, the decision does not.
            Fake::MistypedField => match decision {
                Value::Map(mut entries) => {
                    entries.retain(|(k, _)| k != "chosen_worker");
                    entries.push(("chosen_worker".into(), Value::Str("two".into())));
                    Value::Map(entries)
                }
                other => other,
            },
            // A decided decision without its required source.
            Fake::NoSource => match decision {
                Value::Map(mut entries) => {
                    entries.retain(|(k, _)| k != "source");
                    Value::Map(entries)
                }
                other => other,
            },
            Fake::WarmUpMissingKey | Fake::WarmUpKeyTwice => match decision {
                Value::Map(mut entries) => {
                    let mut warm_up = vec![
                        ("worker".to_string(), Value::UInt(1)),
                        ("blocks".to_string(), Value::UInt(4)),
                        ("tokens".to_string(), Value::UInt(64)),
                        ("decision_id".to_string(), Value::UInt(2)),
                        ("attempt_id".to_string(), Value::Str("0:warm_up".into())),
                    ];
                    if mode == Fake::WarmUpMissingKey {
                        warm_up.retain(|(k, _)| k != "decision_id");
                    } else {
                        warm_up.push(("worker".to_string(), Value::UInt(0)));
                    }
                    entries.push(("warm_up".into(), Value::Map(warm_up)));
                    Value::Map(entries)
                }
                other => other,
            },
            _ => decision,
        };
        let decisions = |k: usize| Value::Array(vec![decision.clone(); k]);
        let t = |s: &str| ("type", Value::Str(s.into()));
        let out = if kind == "HELLO" {
            match mode {
                Fake::RefuseHello => frame(&str_map(&[t("ERROR"), ("id", id), ("code", Value::Int(-14)), ("name", Value::Str("KM_ERR_INCOMPATIBLE".into())), ("message", Value::Str("protocol 1 is not spoken here".into()))])),
                Fake::WelcomeWrongId => frame(&str_map(&[t("WELCOME"), ("id", Value::UInt(7)), ("protocol", Value::UInt(1)), ("kvmatch_version", Value::Str("fake".into()))])),
                Fake::WelcomeLimitsNotAMap => frame(&str_map(&[t("WELCOME"), ("id", id), ("protocol", Value::UInt(1)), ("kvmatch_version", Value::Str("fake".into())), ("limits", Value::UInt(4096))])),
                _ => frame(&str_map(&[t("WELCOME"), ("id", id), ("protocol", Value::UInt(1)), ("kvmatch_version", Value::Str("fake".into())), ("limits", str_map(&[("max_frame_bytes", Value::UInt(4096)), ("max_batch_items", Value::UInt(16))]))])),
            }
        } else if silent {
            silent = false;
            continue;
        } else {
            match mode {
                Fake::Miscount => frame(&str_map(&[t("DECISION"), ("id", id), ("decisions", decisions(n.saturating_sub(1)))])),
                Fake::WrongType => frame(&str_map(&[t("STATUS_REPLY"), ("id", id), ("kvmatch_version", Value::Str("fake".into()))])),
                Fake::UnknownId => frame(&str_map(&[t("DECISION"), ("id", Value::UInt(4242)), ("decisions", decisions(n))])),
                Fake::ConnectionError => frame(&str_map(&[t("ERROR"), ("id", Value::UInt(0)), ("code", Value::Int(-19)), ("name", Value::Str("KM_ERR_TIMEOUT".into())), ("message", Value::Str("idle".into()))])),
                Fake::Garbage => raw_frame(&[0xc1, 0x00]),
                Fake::Deep => {
                    let mut p = vec![0x91u8; 100];
                    p.push(0xc0);
                    raw_frame(&p)
                }
                Fake::Oversize => (1u32 << 20).to_be_bytes().to_vec(),
                _ => frame(&str_map(&[t("DECISION"), ("id", id), ("decisions", decisions(n))])),
            }
        };
        if conn.write_all(&out).is_err() {
            return;
        }
    }
}

#[test]
fn refused_replies() {
    let dir = TempDir::new("fake");
    for (mode, code, what) in [
        (Fake::Miscount, Code::PROTOCOL, "one decision fewer"),
        (Fake::WrongType, Code::PROTOCOL, "wrong type"),
        (Fake::UnknownId, Code::PROTOCOL, "unknown id"),
        (Fake::ConnectionError, Code::CLOSED, "connection-level ERROR"),
        (Fake::Garbage, Code::PARSE, "not msgpack"),
        (Fake::Deep, Code::PARSE, "nested too deep"),
        (Fake::Oversize, Code::TOO_LARGE, "frame over max_frame_bytes"),
        (Fake::MistypedField, Code::PARSE, "a decision's chosen_worker is a str"),
        (Fake::NoSource, Code::PARSE, "a decided decision without source"),
        (Fake::WarmUpMissingKey, Code::PARSE, "a warm_up without its decision_id"),
        (Fake::WarmUpKeyTwice, Code::PARSE, "a warm_up holding worker twice"),
    ] {
        let mut c = Client::connect(&fake_server(&dir, mode), TIMEOUT).expect("connect");
        expect_code(c.route(&[tokens("a", vec![]), tokens("b", vec![])]), code, what);
        assert!(c.is_closed(), "{}: the connection stays open", what);
        expect_code(c.route(&[tokens("c", vec![])]), Code::CLOSED, what);
    }
    expect_code(Client::connect(&fake_server(&dir, Fake::WelcomeWrongId), TIMEOUT).map(|_| ()), Code::PROTOCOL, "WELCOME to another id");
    // WELCOME's limits are a map (docs/PROTOCOL.md), as the Go and Python clients refuse others.
    expect_code(Client::connect(&fake_server(&dir, Fake::WelcomeLimitsNotAMap), TIMEOUT).map(|_| ()), Code::PARSE, "WELCOME whose limits are an int");
    expect_code(Client::connect(&fake_server(&dir, Fake::RefuseHello), TIMEOUT).map(|_| ()), Code::INCOMPATIBLE, "refused handshake");
}

#[test]
fn reply_id_that_is_not_a_request_id() {
    // An id is a uint64 (docs/PROTOCOL.md): a reply whose id is anything else, a float equal to
    // the id sent included, is a protocol error that closes the connection, blocking or
    // pipelined, as in the Python and Go clients; a WELCOME with such an id fails the connect.
    let dir = TempDir::new("bad-id");
    for (mode, what) in [
        (Fake::IdNegative, "a negative id"),
        (Fake::IdFloat, "a float id"),
        (Fake::IdBool, "a bool id"),
        (Fake::IdStr, "a str id"),
        (Fake::IdArray, "an array id"),
        (Fake::IdMap, "a map id"),
    ] {
        let address = fake_server(&dir, mode);
        let mut c = Client::connect(&address, TIMEOUT).expect("connect");
        expect_code(c.route(&[tokens("a", vec![])]), Code::PROTOCOL, what);
        assert!(c.is_closed() && c.outstanding() == 0, "{}: the connection stays open", what);
        expect_code(c.route(&[tokens("b", vec![])]), Code::CLOSED, what);
        let mut c = Client::connect(&address, TIMEOUT).expect("connect");
        c.send_route(&[tokens("a", vec![])]).expect("send");
        expect_code(c.receive(), Code::PROTOCOL, what);
        assert!(c.is_closed() && c.outstanding() == 0, "{}, receive: still open", what);
        let mut c = Client::connect(&address, TIMEOUT).expect("connect");
        let id = c.send_route(&[tokens("a", vec![])]).expect("send");
        expect_code(c.wait(id), Code::PROTOCOL, what);
        assert!(c.is_closed() && c.outstanding() == 0, "{}, wait: still open", what);
    }
    for (mode, what) in [(Fake::WelcomeIdStr, "a str"), (Fake::WelcomeIdFloat, "a float")] {
        let address = fake_server(&dir, mode);
        expect_code(Client::connect(&address, TIMEOUT).map(|_| ()), Code::PROTOCOL, what);
    }
}

#[test]
fn timeout_gives_the_request_up() {
    let dir = TempDir::new("silent");
    let mut c = Client::connect(&fake_server(&dir, Fake::SilentOnce), TIMEOUT).expect("connect");
    c.set_timeout(Some(Duration::from_millis(200)));
    expect_code(c.route(&[tokens("slow", vec![])]), Code::TIMEOUT, "no reply");
    assert!(!c.is_closed() && c.outstanding() == 0);
    c.set_timeout(TIMEOUT);
    let d = c.route(&[tokens("next", vec![])]).expect("the connection stays usable").remove(0);
    assert_eq!(d.candidates[0].cost, None);
    assert_eq!(d.candidates[0].state.as_deref(), Some("LIVE"));
    expect_code(c.route(&[tokens("big", vec![0; 4096])]), Code::TOO_LARGE, "a request over max_frame_bytes is not sent");
    assert!(!c.is_closed(), "refusing to send does not close the connection");
}

fn nats_server_binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("nats-server")).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/sbin/nats-server"), PathBuf::from("/usr/bin/nats-server")])
        .find(|p| p.is_file())
}

/// nats-server on a free loopback port, killed when dropped.
struct Nats {
    url: String,
    child: Child,
}

impl Nats {
    fn start(bin: &Path) -> Nats {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        let nats = Nats { url: format!("nats://127.0.0.1:{}", port), child };
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not accept on port {}", port);
            thread::sleep(Duration::from_millis(20));
        }
        nats
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two instances sharing a real nats-server: a decision on the second says its view is the
/// cluster's, with the first instance's contribution applied, fresh and not stale. Without
/// nats-server the test fails, as the C cluster tests do (scripts/install-deps.sh --test installs
/// Debian's nats-server for make test).
#[test]
fn decision_load_view_of_a_cluster() {
    let bin = nats_server_binary()
        .expect("nats-server is not installed (scripts/install-deps.sh --test installs Debian's nats-server)");
    let nats = Nats::start(&bin);
    let member = |id: &str| format!(r#""cluster": {{"url": "{}", "instance": "{}"}}"#, nats.url, id);
    let _a = Server::start_with("cluster-a", Some(&member("client-a")));
    let b = Server::start_with("cluster-b", Some(&member("client-b")));
    let mut c = Client::connect(&b.address, TIMEOUT).expect("connect");
    let d = c.route(&[tokens("cluster-1", prompt(64, 3))]).expect("route").remove(0);
    d.result().expect("decided");
    assert_eq!(d.load_scope.as_deref(), Some("cluster"), "{:?}", d);
    assert_eq!(d.load_instances, Some(1), "the other instance's work is applied: {:?}", d);
    let age = d.load_oldest_age_ms.expect("load_oldest_age_ms");
    assert!((0.0..1000.0).contains(&age), "load_oldest_age_ms within the 1000 ms expiry: {}", age);
    assert_eq!(d.load_stale_instances.as_deref(), Some(""), "no stale instance: {:?}", d);
}

/// A server that reads a request a little at a time: the client's timeout bounds the whole send,
/// not each write, so a large ROUTE to a server that drains it slowly ends with TIMEOUT in about
/// the timeout (the frame is cut off, so the connection is closed).
#[test]
fn timeout_bounds_a_send_to_a_slow_reader() {
    let dir = TempDir::new("slow-reader");
    let path = dir.0.join("slow.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = thread::spawn(move || {
        let (mut conn, _) = match listener.accept() {
            Ok(c) => c,
            Err(_) => return,
        };
        let mut header = [0u8; 4];
        let mut hello = Vec::new();
        if conn.read_exact(&mut header).is_err() {
            return;
        }
        hello.resize(u32::from_be_bytes(header) as usize, 0);
        if conn.read_exact(&mut hello).is_err() {
            return;
        }
        let welcome = str_map(&[
            ("type", Value::Str("WELCOME".into())),
            ("id", Value::UInt(1)),
            ("protocol", Value::UInt(1)),
            ("kvmatch_version", Value::Str("fake".into())),
        ]);
        if conn.write_all(&frame(&welcome)).is_err() {
            return;
        }
        // 4 KiB every 10 ms, for at most 15 s, until the client closes.
        let started = Instant::now();
        let mut chunk = vec![0u8; 4 << 10];
        while started.elapsed() < Duration::from_secs(15) {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    let mut c = Client::connect(&format!("unix:{}", path.display()), TIMEOUT).expect("connect");
    c.set_timeout(Some(Duration::from_secs(1)));
    // About 2 MB on the wire: some 5 s at the server's pace.
    let big: Vec<u32> = (0..400_000u32).map(|i| 1_000_000 + i).collect();
    let started = Instant::now();
    expect_code(c.route(&[tokens("big", big)]), Code::TIMEOUT, "a send to a slow reader");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "a 1 s timeout took {:?}", took);
    assert!(c.is_closed(), "a frame cut off closes the connection");
    drop(c);
    server.join().expect("the fake server");
}

/// A server whose listen queue is full (it stopped accepting): connect gives up within its
/// timeout instead of blocking until the server accepts.
#[test]
fn connect_timeout_bounds_a_full_listen_queue() {
    let dir = TempDir::new("full-queue");
    let path = dir.0.join("full.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    // Fill the queue: connects succeed until it is full; the next would block.
    let (tx, rx) = std::sync::mpsc::channel();
    let filler_path = path.clone();
    thread::spawn(move || {
        let mut held = Vec::new();
        loop {
            match std::os::unix::net::UnixStream::connect(&filler_path) {
                Ok(s) => held.push(s),
                Err(_) => return,
            }
            let _ = tx.send(held.len());
        }
    });
    // The filler blocks once the queue is full: no count for 500 ms.
    while rx.recv_timeout(Duration::from_millis(500)).is_ok() {}
    let address = format!("unix:{}", path.display());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let started = Instant::now();
        let r = Client::connect(&address, Some(Duration::from_millis(500))).map(|_| ());
        let _ = done_tx.send((r, started.elapsed()));
    });
    let outcome = done_rx.recv_timeout(Duration::from_secs(5));
    drop(listener); // wakes whatever still waits on the queue
    let (r, took) = outcome.expect("connect returned within 5 s of a 500 ms timeout");
    assert!(took < Duration::from_secs(3), "took {:?}", took);
    assert!(r.is_err(), "a server that does not accept is not connected");
}

/// A fake server that takes the connection and the HELLO, then reads nothing more until `go`
/// says so; from then on it answers each STATUS with a STATUS_REPLY, until the client closes.
fn stalled_server(dir: &TempDir, go: std::sync::mpsc::Receiver<()>) -> String {
    let path = dir.0.join("stalled.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    thread::spawn(move || {
        let (mut conn, _) = match listener.accept() {
            Ok(c) => c,
            Err(_) => return,
        };
        let read_message = |conn: &mut std::os::unix::net::UnixStream| {
            let mut header = [0u8; 4];
            conn.read_exact(&mut header).ok()?;
            let mut payload = vec![0u8; u32::from_be_bytes(header) as usize];
            conn.read_exact(&mut payload).ok()?;
            Value::decode(&payload).ok()
        };
        if read_message(&mut conn).is_none() {
            return;
        }
        let welcome = str_map(&[
            ("type", Value::Str("WELCOME".into())),
            ("id", Value::UInt(1)),
            ("protocol", Value::UInt(1)),
            ("kvmatch_version", Value::Str("fake".into())),
        ]);
        if conn.write_all(&frame(&welcome)).is_err() || go.recv().is_err() {
            return;
        }
        while let Some(m) = read_message(&mut conn) {
            let id = m.get("id").cloned().unwrap_or(Value::UInt(0));
            let reply = str_map(&[
                ("type", Value::Str("STATUS_REPLY".into())),
                ("id", id),
                ("kvmatch_version", Value::Str("fake".into())),
            ]);
            if conn.write_all(&frame(&reply)).is_err() {
                return;
            }
        }
    });
    format!("unix:{}", path.display())
}

/// A send that times out before any byte of its frame is written (the socket's buffer is full:
/// the server reads nothing) leaves the connection usable, as every other timeout does.
#[test]
fn send_timeout_before_any_byte_keeps_the_connection() {
    let dir = TempDir::new("stalled");
    let (go, wait) = std::sync::mpsc::channel();
    let mut c = Client::connect(&stalled_server(&dir, wait), TIMEOUT).expect("connect");
    c.set_timeout(Some(Duration::from_millis(200)));
    // Small frames, each written whole or not at all, until the socket's buffer is full.
    let status = || str_map(&[("type", Value::Str("STATUS".into()))]);
    let mut sent = 0;
    let err = loop {
        match c.send(status()) {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 1_000_000, "the socket's buffer never filled");
    };
    assert_eq!(err.code, Code::TIMEOUT, "{}", err);
    assert!(!c.is_closed(), "a send of which nothing was written closed the connection: {}", err);
    assert_eq!(c.outstanding(), sent, "the unsent request is not waiting");
    go.send(()).expect("the fake server");
    c.set_timeout(TIMEOUT);
    c.status().expect("the connection is usable after the timeout");
}
