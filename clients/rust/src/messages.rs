// SPDX-License-Identifier: Apache-2.0
//! The messages of docs/PROTOCOL.md as Rust types. Field names are the wire names
//! (`chosen_worker`, `owner_worker`, `n_blocks`); an `Option` is a field whose absence means
//! something (no owner, no load weighed, unknown cached tokens).

use crate::error::{Code, Error, Result};
use crate::value::{Fields, Value};

/// The server's limits from WELCOME; a client stays within them in what it sends.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Limits {
    pub max_frame_bytes: u32,
    pub max_objects: u32,
    pub max_batch_items: u32,
    pub max_tokens_per_route: u32,
    pub max_hashes_per_route: u32,
    pub max_candidates: u32,
    pub max_params: u32,
    pub max_string_bytes: u32,
}

/// The server's answer to the handshake.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Welcome {
    pub protocol: u32,
    pub kvmatch_version: String,
    pub server: Option<String>,
    pub limits: Limits,
}

/// The prompt of a route: token ids the server hashes, or chain hashes computed as
/// docs/HASHING.md says (with the block size they were computed with, checked against the pool's).
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Hashes { hashes: Vec<u64>, block_size: Option<u32> },
}

impl Default for Prompt {
    fn default() -> Prompt {
        Prompt::Tokens(Vec::new())
    }
}

/// One route of a ROUTE.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteRequest {
    pub request_id: String,
    pub attempt_id: Option<String>,
    pub model: Option<String>,
    pub pool: Option<String>,
    pub endpoint: Option<String>,
    pub prompt: Prompt,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    /// None: every worker of the pool.
    pub candidates: Option<Vec<u32>>,
    /// No candidate rows in the decision.
    pub brief: bool,
    pub policy: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub expected_output_tokens: Option<u64>,
    /// The router carries out the warm-ups a decision asks for (`Decision::warm_up`,
    /// docs/PROTOCOL.md "Warm-ups"); false: no decision asks for one.
    pub warm_ups: bool,
}

/// What a lifecycle event reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The request was sent to the worker.
    Dispatched,
    /// The first streamed token reached the router.
    FirstToken,
    /// The attempt ended.
    Finished,
}

impl Event {
    pub fn wire_name(self) -> &'static str {
        match self {
            Event::Dispatched => "DISPATCHED",
            Event::FirstToken => "FIRST_TOKEN",
            Event::Finished => "FINISHED",
        }
    }
}

impl Default for Event {
    fn default() -> Event {
        Event::Dispatched
    }
}

/// One lifecycle report. At least one of `decision_id` and `request_id` is required.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LifecycleEvent {
    pub event: Event,
    pub decision_id: Option<u64>,
    pub request_id: Option<String>,
    pub attempt_id: Option<String>,
    /// The worker actually used, if the router knows it.
    pub worker: Option<u32>,
    /// Router clock: ms from the request's arrival at the router to this event.
    pub elapsed_ms: Option<f64>,
    // FINISHED only.
    /// None: the server derives it by the outcome rule (`outcome_from_stream`).
    pub outcome: Option<String>,
    pub finish_reason: Option<String>,
    pub done_seen: bool,
    pub http_status: Option<u32>,
    pub error: Option<String>,
    /// None: unknown (not 0).
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub retries: Option<u32>,
}

/// The load this kvmatch instance saw on a worker.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerLoad {
    pub in_flight: u32,
    pub pending_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// A worker map: what WORKERS add / remove / update send (`pool`, `worker`, `name`,
/// `event_endpoint`, `replay_endpoint`, `dp_rank`, `healthy`), and, in WORKER_LIST and
/// STATUS_REPLY, the runtime fields too.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Worker {
    pub pool: String,
    pub worker: u32,
    pub name: Option<String>,
    pub event_endpoint: Option<String>,
    pub replay_endpoint: Option<String>,
    pub dp_rank: Option<u32>,
    pub healthy: Option<bool>,
    pub state: Option<String>,
    pub blocks: Option<u64>,
    pub last_event_age_s: Option<f64>,
    pub expected_seq: Option<u64>,
    pub load: Option<WorkerLoad>,
    pub breaker: Option<String>,
    pub failures: Option<u32>,
    pub eligible: Option<bool>,
}

/// A pool map of POOLS add / update and POOL_LIST.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pool {
    pub name: String,
    pub model: Option<String>,
    /// Required in add (its absence fails that pool with BLOCK_SIZE); None in update: unchanged.
    pub block_size: Option<u32>,
    /// Tokens after each block its hash covers (the engines' lookahead hashing); set in add only,
    /// None there: none.
    pub hash_lookahead_tokens: Option<u32>,
    /// Blocks per chunk of the engines' KV offloading connector (placeholder stores); set in add
    /// only, None there: 1.
    pub offload_chunk_blocks: Option<u32>,
    pub policy: Option<String>,
    /// The engine model preset the pool's workers run (`llama3-8b-h100` or `llama3-70b-h100x4`);
    /// set in add, None there: `llama3-8b-h100`; update may only repeat the pool's own. POOL_LIST:
    /// None for a pool whose model is none of the presets.
    pub engine: Option<String>,
    pub params: Vec<(String, f64)>,
}

/// One candidate row of a decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub worker: u32,
    pub depth: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub in_flight: u32,
    pub pending_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    /// None: not weighed (round_robin, an ineligible worker).
    pub cost: Option<f64>,
    pub state: Option<String>,
    pub eligible: bool,
}

/// A warm-up a decision asks the router to carry out (docs/PROTOCOL.md, "Warm-ups"): send
/// `worker` a request of the router's own, the first `tokens` tokens of the routed prompt
/// (`blocks` whole blocks) asking for one output token, and report its lifecycle by `decision_id`
/// like any decision's.
#[derive(Clone, Debug, PartialEq)]
pub struct WarmUp {
    /// The worker to warm up: never the decision's `chosen_worker`.
    pub worker: u32,
    pub blocks: u32,
    pub tokens: u64,
    /// The warm-up's own decision, which its lifecycle reports name.
    pub decision_id: u64,
    /// The route's attempt id with `:warm_up` appended.
    pub attempt_id: String,
}

/// The answer to one route. `status` OK: decided; else `message` says why and only the ids are set.
/// A decided one without `decision_id`, `chosen_worker` or `source` (docs/PROTOCOL.md: required
/// when the status is 0), or whose `warm_up` lacks one of its keys, is not read: `Code::PARSE`.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub status: Code,
    pub message: Option<String>,
    pub request_id: String,
    pub attempt_id: Option<String>,
    pub decision_id: u64,
    pub pool: Option<String>,
    pub chosen_worker: u32,
    pub chosen_depth: u32,
    pub chosen_state: Option<String>,
    /// The prediction owner (deepest match); None when no worker holds block 0.
    pub owner_worker: Option<u32>,
    pub owner_depth: u32,
    pub owner_state: Option<String>,
    pub n_blocks: u32,
    pub block_size: u32,
    /// "events" (observations) or "approx" (predictions).
    pub source: String,
    pub policy: Option<String>,
    pub reason: Option<String>,
    pub load_kind: Option<String>,
    pub load_scope: Option<String>,
    /// None: the policy weighed no load.
    pub load_value: Option<f64>,
    /// With every `load_scope` but "this_instance" (PROTOCOL.md, CLUSTER.md): the other
    /// instances whose load was added; None with "this_instance".
    pub load_instances: Option<u32>,
    /// Since the oldest contribution used, in ms; None with "this_instance" or when none was used.
    pub load_oldest_age_ms: Option<f64>,
    /// The stale instances' ids, comma-separated ("" when none); None with "this_instance".
    pub load_stale_instances: Option<String>,
    pub candidates: Vec<Candidate>,
    /// The warm-up this decision asks for; None without one (always None for a route without
    /// `warm_ups`).
    pub warm_up: Option<WarmUp>,
}

impl Decision {
    /// Ok for a decided route, else its failure.
    pub fn result(&self) -> Result<()> {
        status_result(self.status, self.message.as_deref())
    }
}

/// One status of an ACK: one per event, worker or pool of the request.
#[derive(Clone, Debug, PartialEq)]
pub struct AckItem {
    pub status: Code,
    pub message: Option<String>,
}

impl AckItem {
    /// Ok for an item that succeeded, else its failure.
    pub fn result(&self) -> Result<()> {
        status_result(self.status, self.message.as_deref())
    }
}

/// The answer to STATUS.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatusReply {
    pub kvmatch_version: String,
    pub uptime_s: f64,
    pub ready: bool,
    pub connections: u32,
    pub decisions: u64,
    pub records_dropped: u64,
    pub backend: Option<String>,
    pub workers: Vec<Worker>,
}

fn status_result(status: Code, message: Option<&str>) -> Result<()> {
    if status.is_ok() {
        Ok(())
    } else {
        Err(Error::from_server(status, message.unwrap_or("")))
    }
}

// ---- encoding -----------------------------------------------------------------------------------

/// A map under construction, absent options left out.
pub(crate) struct MapBuilder(pub Vec<(String, Value)>);

impl MapBuilder {
    pub fn new() -> MapBuilder {
        MapBuilder(Vec::new())
    }
    pub fn put(mut self, key: &str, v: Value) -> MapBuilder {
        self.0.push((key.to_string(), v));
        self
    }
    pub fn str(self, key: &str, v: &Option<String>) -> MapBuilder {
        match v {
            Some(s) => self.put(key, Value::Str(s.clone())),
            None => self,
        }
    }
    pub fn uint(self, key: &str, v: Option<u64>) -> MapBuilder {
        match v {
            Some(u) => self.put(key, Value::UInt(u)),
            None => self,
        }
    }
    pub fn build(self) -> Value {
        Value::Map(self.0)
    }
}

impl RouteRequest {
    pub(crate) fn to_value(&self) -> Value {
        let mut m = MapBuilder::new()
            .put("request_id", Value::Str(self.request_id.clone()))
            .str("attempt_id", &self.attempt_id)
            .str("model", &self.model)
            .str("pool", &self.pool)
            .str("endpoint", &self.endpoint)
            .str("lora_name", &self.lora_name)
            .str("cache_salt", &self.cache_salt)
            .str("policy", &self.policy);
        m = match &self.prompt {
            Prompt::Tokens(t) => m.put(
                "tokens",
                Value::Array(t.iter().map(|&x| Value::UInt(x as u64)).collect()),
            ),
            Prompt::Hashes { hashes, block_size } => m
                .put("hashes", Value::Array(hashes.iter().map(|&x| Value::UInt(x)).collect()))
                .uint("block_size", block_size.map(u64::from)),
        };
        if let Some(c) = &self.candidates {
            m = m.put("candidates", Value::Array(c.iter().map(|&x| Value::UInt(x as u64)).collect()));
        }
        if self.brief {
            m = m.put("brief", Value::Bool(true));
        }
        if self.warm_ups {
            m = m.put("warm_ups", Value::Bool(true));
        }
        m.uint("prompt_tokens", self.prompt_tokens)
            .uint("expected_output_tokens", self.expected_output_tokens)
            .build()
    }
}

impl LifecycleEvent {
    pub(crate) fn to_value(&self) -> Value {
        let mut m = MapBuilder::new()
            .put("event", Value::Str(self.event.wire_name().to_string()))
            .uint("decision_id", self.decision_id)
            .str("request_id", &self.request_id)
            .str("attempt_id", &self.attempt_id)
            .uint("worker", self.worker.map(u64::from));
        if let Some(ms) = self.elapsed_ms {
            m = m.put("elapsed_ms", Value::Float(ms));
        }
        m = m
            .str("outcome", &self.outcome)
            .str("finish_reason", &self.finish_reason)
            .str("error", &self.error);
        if self.done_seen {
            m = m.put("done_seen", Value::Bool(true));
        }
        m.uint("http_status", self.http_status.map(u64::from))
            .uint("cached_tokens", self.cached_tokens)
            .uint("prompt_tokens", self.prompt_tokens)
            .uint("output_tokens", self.output_tokens)
            .uint("retries", self.retries.map(u64::from))
            .build()
    }
}

impl Worker {
    /// The fields a WORKERS request carries (the runtime fields are replies' only).
    pub(crate) fn to_value(&self) -> Value {
        let mut m = MapBuilder::new()
            .put("pool", Value::Str(self.pool.clone()))
            .put("worker", Value::UInt(self.worker as u64))
            .str("name", &self.name)
            .str("event_endpoint", &self.event_endpoint)
            .str("replay_endpoint", &self.replay_endpoint)
            .uint("dp_rank", self.dp_rank.map(u64::from));
        if let Some(h) = self.healthy {
            m = m.put("healthy", Value::Bool(h));
        }
        m.build()
    }

    pub(crate) fn from_value(v: &Value, what: &str) -> Result<Worker> {
        let f = Fields { value: v, what };
        let load = match v.get("load") {
            None => None,
            Some(l) => {
                let lf = Fields { value: l, what: "load" };
                Some(WorkerLoad {
                    in_flight: lf.u32("in_flight")?.unwrap_or(0),
                    pending_prefill_tokens: lf.u64("pending_prefill_tokens")?.unwrap_or(0),
                    active_decode_blocks: lf.u64("active_decode_blocks")?.unwrap_or(0),
                })
            }
        };
        Ok(Worker {
            pool: f.string("pool")?.unwrap_or_default(),
            worker: f.u32("worker")?.unwrap_or(0),
            name: f.string("name")?,
            event_endpoint: f.string("event_endpoint")?,
            replay_endpoint: f.string("replay_endpoint")?,
            dp_rank: f.u32("dp_rank")?,
            healthy: f.bool("healthy")?,
            state: f.string("state")?,
            blocks: f.u64("blocks")?,
            last_event_age_s: f.f64("last_event_age_s")?,
            expected_seq: f.u64("expected_seq")?,
            load,
            breaker: f.string("breaker")?,
            failures: f.u32("failures")?,
            eligible: f.bool("eligible")?,
        })
    }
}

impl Pool {
    pub(crate) fn to_value(&self) -> Value {
        let mut m = MapBuilder::new()
            .put("name", Value::Str(self.name.clone()))
            .str("model", &self.model)
            .str("policy", &self.policy)
            .str("engine", &self.engine)
            .uint("block_size", self.block_size.map(u64::from))
            .uint("hash_lookahead_tokens", self.hash_lookahead_tokens.map(u64::from))
            .uint("offload_chunk_blocks", self.offload_chunk_blocks.map(u64::from));
        if !self.params.is_empty() {
            m = m.put(
                "params",
                Value::Map(self.params.iter().map(|(k, v)| (k.clone(), Value::Float(*v))).collect()),
            );
        }
        m.build()
    }

    pub(crate) fn from_value(v: &Value, what: &str) -> Result<Pool> {
        let f = Fields { value: v, what };
        let mut params = Vec::new();
        if let Some(Value::Map(entries)) = v.get("params") {
            for (k, p) in entries {
                let x = p.as_f64().ok_or_else(|| {
                    Error::new(Code::PARSE, format!("{}.params.{}: expected a number", what, k))
                })?;
                params.push((k.clone(), x));
            }
        }
        Ok(Pool {
            name: f.string("name")?.unwrap_or_default(),
            model: f.string("model")?,
            block_size: f.u32("block_size")?,
            hash_lookahead_tokens: f.u32("hash_lookahead_tokens")?,
            offload_chunk_blocks: f.u32("offload_chunk_blocks")?,
            policy: f.string("policy")?,
            engine: f.string("engine")?,
            params,
        })
    }
}

// ---- decoding -----------------------------------------------------------------------------------

impl Candidate {
    /// A row: its first 11 values in order (nil: absent; later values, which a newer server may
    /// append, are ignored).
    fn from_value(v: &Value, what: &str) -> Result<Candidate> {
        let row = v
            .as_array()
            .ok_or_else(|| Error::new(Code::PARSE, format!("{}: a candidate row is an array", what)))?;
        let at = |i: usize| row.get(i).filter(|x| !matches!(x, Value::Nil));
        let wrong = |i: usize, expected: &str| {
            Error::new(Code::PARSE, format!("{}[{}]: expected {}", what, i, expected))
        };
        let u32_at = |i: usize| -> Result<u32> {
            match at(i) {
                None => Ok(0),
                Some(x) => match x.as_u64() {
                    Some(u) if u <= u32::MAX as u64 => Ok(u as u32),
                    _ => Err(wrong(i, "a u32")),
                },
            }
        };
        let u64_at = |i: usize| -> Result<u64> {
            match at(i) {
                None => Ok(0),
                Some(x) => x.as_u64().ok_or_else(|| wrong(i, "a uint")),
            }
        };
        if row.is_empty() {
            return Err(wrong(0, "the worker id"));
        }
        Ok(Candidate {
            worker: u32_at(0)?,
            depth: u32_at(1)?,
            device_blocks: u32_at(2)?,
            host_blocks: u32_at(3)?,
            disk_blocks: u32_at(4)?,
            in_flight: u32_at(5)?,
            pending_prefill_tokens: u64_at(6)?,
            active_decode_blocks: u64_at(7)?,
            cost: match at(8) {
                None => None,
                Some(x) => Some(x.as_f64().ok_or_else(|| wrong(8, "a number"))?),
            },
            state: match at(9) {
                None => None,
                Some(x) => Some(x.as_str().ok_or_else(|| wrong(9, "a str"))?.to_string()),
            },
            eligible: match at(10) {
                None => true,
                Some(x) => x.as_bool().ok_or_else(|| wrong(10, "a bool"))?,
            },
        })
    }
}

impl WarmUp {
    /// A `warm_up` map: each of its five keys is required, of its type (nil counts as missing).
    fn from_value(v: &Value, what: &str) -> Result<WarmUp> {
        let f = Fields { value: v, what };
        fn required<T>(x: Option<T>, what: &str, key: &str) -> Result<T> {
            x.ok_or_else(|| Error::new(Code::PARSE, format!("{}.{}: missing", what, key)))
        }
        Ok(WarmUp {
            worker: required(f.u32("worker")?, what, "worker")?,
            blocks: required(f.u32("blocks")?, what, "blocks")?,
            tokens: required(f.u64("tokens")?, what, "tokens")?,
            decision_id: required(f.u64("decision_id")?, what, "decision_id")?,
            attempt_id: required(f.string("attempt_id")?, what, "attempt_id")?,
        })
    }
}

impl Decision {
    pub(crate) fn from_value(v: &Value, what: &str) -> Result<Decision> {
        let f = Fields { value: v, what };
        let status = Code(f.i64("status")?.unwrap_or(0));
        let decided = status.is_ok();
        let required = |x: Option<u64>, key: &str| {
            if decided {
                x.ok_or_else(|| Error::new(Code::PARSE, format!("{}.{}: missing", what, key)))
            } else {
                Ok(x.unwrap_or(0))
            }
        };
        let rows = f.array("candidates")?;
        let mut candidates = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            candidates.push(Candidate::from_value(row, &format!("{}.candidates[{}]", what, i))?);
        }
        let warm_up = match f.map("warm_up")? {
            None => None,
            Some(w) => Some(WarmUp::from_value(w, &format!("{}.warm_up", what))?),
        };
        Ok(Decision {
            status,
            message: f.string("message")?,
            request_id: f.string("request_id")?.unwrap_or_default(),
            attempt_id: f.id_string("attempt_id")?,
            decision_id: required(f.u64("decision_id")?, "decision_id")?,
            pool: f.string("pool")?,
            chosen_worker: required(f.u32("chosen_worker")?.map(u64::from), "chosen_worker")? as u32,
            chosen_depth: f.u32("chosen_depth")?.unwrap_or(0),
            chosen_state: f.string("chosen_state")?,
            owner_worker: f.u32("owner_worker")?,
            owner_depth: f.u32("owner_depth")?.unwrap_or(0),
            owner_state: f.string("owner_state")?,
            n_blocks: f.u32("n_blocks")?.unwrap_or(0),
            block_size: f.u32("block_size")?.unwrap_or(0),
            source: match (f.string("source")?, decided) {
                (Some(s), _) => s,
                (None, false) => String::new(),
                (None, true) => {
                    return Err(Error::new(Code::PARSE, format!("{}.source: missing", what)))
                }
            },
            policy: f.string("policy")?,
            reason: f.string("reason")?,
            load_kind: f.string("load_kind")?,
            load_scope: f.string("load_scope")?,
            load_value: f.f64("load_value")?,
            load_instances: f.u32("load_instances")?,
            load_oldest_age_ms: f.f64("load_oldest_age_ms")?,
            load_stale_instances: f.string("load_stale_instances")?,
            candidates,
            warm_up,
        })
    }
}

impl AckItem {
    pub(crate) fn from_value(v: &Value, what: &str) -> Result<AckItem> {
        let f = Fields { value: v, what };
        Ok(AckItem { status: Code(f.i64("status")?.unwrap_or(0)), message: f.string("message")? })
    }
}

impl Welcome {
    pub(crate) fn from_value(v: &Value) -> Result<Welcome> {
        let f = Fields { value: v, what: "WELCOME" };
        let mut limits = Limits::default();
        if let Some(l) = f.map("limits")? {
            let lf = Fields { value: l, what: "WELCOME.limits" };
            limits = Limits {
                max_frame_bytes: lf.u32("max_frame_bytes")?.unwrap_or(0),
                max_objects: lf.u32("max_objects")?.unwrap_or(0),
                max_batch_items: lf.u32("max_batch_items")?.unwrap_or(0),
                max_tokens_per_route: lf.u32("max_tokens_per_route")?.unwrap_or(0),
                max_hashes_per_route: lf.u32("max_hashes_per_route")?.unwrap_or(0),
                max_candidates: lf.u32("max_candidates")?.unwrap_or(0),
                max_params: lf.u32("max_params")?.unwrap_or(0),
                max_string_bytes: lf.u32("max_string_bytes")?.unwrap_or(0),
            };
        }
        Ok(Welcome {
            protocol: f.u32("protocol")?.unwrap_or(0),
            kvmatch_version: f.string("kvmatch_version")?.unwrap_or_default(),
            server: f.string("server")?,
            limits,
        })
    }
}

impl StatusReply {
    pub(crate) fn from_value(v: &Value) -> Result<StatusReply> {
        let f = Fields { value: v, what: "STATUS_REPLY" };
        let mut workers = Vec::new();
        for (i, w) in f.array("workers")?.iter().enumerate() {
            workers.push(Worker::from_value(w, &format!("workers[{}]", i))?);
        }
        Ok(StatusReply {
            kvmatch_version: f.string("kvmatch_version")?.unwrap_or_default(),
            uptime_s: f.f64("uptime_s")?.unwrap_or(0.0),
            ready: f.bool("ready")?.unwrap_or(false),
            connections: f.u32("connections")?.unwrap_or(0),
            decisions: f.u64("decisions")?.unwrap_or(0),
            records_dropped: f.u64("records_dropped")?.unwrap_or(0),
            backend: f.string("backend")?,
            workers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        v.encode(&mut out);
        out
    }

    /// A msgpack map from entries already encoded (key, value), so a key may be of any type or
    /// given twice.
    fn map_bytes(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        assert!(entries.len() < 16);
        let mut out = vec![0x80 | entries.len() as u8];
        for (k, v) in entries {
            out.extend_from_slice(k);
            out.extend_from_slice(v);
        }
        out
    }

    fn key(k: &str) -> Vec<u8> {
        encoded(&Value::Str(k.into()))
    }

    fn complete_warm_up() -> Vec<(Vec<u8>, Vec<u8>)> {
        vec![
            (key("worker"), encoded(&Value::UInt(2))),
            (key("blocks"), encoded(&Value::UInt(64))),
            (key("tokens"), encoded(&Value::UInt(1024))),
            (key("decision_id"), encoded(&Value::UInt(77))),
            (key("attempt_id"), encoded(&Value::Str("a:warm_up".into()))),
        ]
    }

    /// A decided decision (chosen worker 0, decision 76) whose `warm_up` is `warm_up`, read as the
    /// client reads the first decision of a reply.
    fn decision_with(warm_up: Vec<u8>) -> Result<Decision> {
        let decision = map_bytes(&[
            (key("status"), encoded(&Value::UInt(0))),
            (key("decision_id"), encoded(&Value::UInt(76))),
            (key("chosen_worker"), encoded(&Value::UInt(0))),
            (key("source"), encoded(&Value::Str("approx".into()))),
            (key("warm_up"), warm_up),
        ]);
        let value = Value::decode(&decision)?;
        Decision::from_value(&value, "decisions[0]")
    }

    fn expect_parse(r: Result<Decision>, naming: &str) {
        match r {
            Err(e) => {
                assert_eq!(e.code, Code::PARSE, "{}: {}", naming, e);
                assert!(e.message.contains(naming), "the error names {}: {}", naming, e);
            }
            Ok(d) => panic!("{}: read as {:?}", naming, d),
        }
    }

    #[test]
    fn warm_ups_is_sent_only_when_set() {
        let mut r = RouteRequest { request_id: "r".into(), ..Default::default() };
        assert_eq!(r.to_value().get("warm_ups"), None);
        r.warm_ups = true;
        assert_eq!(r.to_value().get("warm_ups"), Some(&Value::Bool(true)));
    }

    #[test]
    fn a_warm_up_is_read_with_its_five_keys() {
        let want = WarmUp {
            worker: 2,
            blocks: 64,
            tokens: 1024,
            decision_id: 77,
            attempt_id: "a:warm_up".into(),
        };
        let d = decision_with(map_bytes(&complete_warm_up())).expect("a complete warm_up");
        assert_eq!(d.warm_up, Some(want.clone()));
        // An entry whose key is not a str is ignored, its value (holding a key of the warm-up's)
        // skipped whole.
        let mut odd = complete_warm_up();
        let holds_worker = map_bytes(&[(key("worker"), encoded(&Value::Nil))]);
        odd.insert(2, (encoded(&Value::UInt(7)), holds_worker));
        let d = decision_with(map_bytes(&odd)).expect("a warm_up with an int key");
        assert_eq!(d.warm_up, Some(want));
        // nil, or no warm_up at all: none asked for.
        assert_eq!(decision_with(encoded(&Value::Nil)).expect("nil").warm_up, None);
        let plain = Value::Map(vec![
            ("status".into(), Value::UInt(0)),
            ("decision_id".into(), Value::UInt(1)),
            ("chosen_worker".into(), Value::UInt(0)),
            ("source".into(), Value::Str("approx".into())),
        ]);
        assert_eq!(Decision::from_value(&plain, "d").expect("no warm_up").warm_up, None);
    }

    #[test]
    fn a_warm_up_missing_a_key_or_holding_one_twice_is_refused() {
        let names = ["worker", "blocks", "tokens", "decision_id", "attempt_id"];
        for (i, name) in names.iter().enumerate() {
            let missing = format!("decisions[0].warm_up.{}: missing", name);
            let mut entries = complete_warm_up();
            entries.remove(i);
            expect_parse(decision_with(map_bytes(&entries)), &missing);
            let mut entries = complete_warm_up();
            entries[i].1 = encoded(&Value::Nil);
            expect_parse(decision_with(map_bytes(&entries)), &missing);
            let mut entries = complete_warm_up();
            entries.push(entries[i].clone());
            let twice = format!("key \"{}\" appears twice", name);
            expect_parse(decision_with(map_bytes(&entries)), &twice);
        }
        let wrong = [
            (0, Value::Str("two".into())),
            (1, Value::UInt(1 << 32)),
            (2, Value::Int(-1)),
            (3, Value::Float(77.0)),
            (4, Value::UInt(5)),
        ];
        for (i, v) in wrong {
            let mut entries = complete_warm_up();
            entries[i].1 = encoded(&v);
            let mistyped = format!("decisions[0].warm_up.{}: expected", names[i]);
            expect_parse(decision_with(map_bytes(&entries)), &mistyped);
        }
        let as_array = encoded(&Value::Array(vec![Value::UInt(2), Value::UInt(64)]));
        expect_parse(decision_with(as_array), "decisions[0].warm_up: expected a map, got array");
    }
}
