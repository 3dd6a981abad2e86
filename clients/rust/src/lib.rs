// SPDX-License-Identifier: Apache-2.0
//! Client of `kvmatch serve` (docs/PROTOCOL.md), the placement index and decision engine an LLM
//! router asks which engine replica should serve a request: routes (blocking, pipelined, batched),
//! lifecycle reports, WORKERS / POOLS / STATUS, over a Unix socket or loopback TCP.
//!
//! Every fallible call returns `Result<_, Error>`, whose `Code` is a km_status code
//! (`Code::NOT_FOUND`, ...; `Code::name` gives its name). Nothing read from the wire can panic:
//! a reply that cannot be read or does not fit its request is an `Err` and closes the connection.
//!
//! ```no_run
//! use kvmatch_client::{Client, Prompt, RouteRequest, LifecycleEvent, Event};
//! use std::time::Duration;
//! let mut c = Client::connect("unix:/tmp/kvmatch.sock", Some(Duration::from_secs(5)))?;
//! let route = RouteRequest { request_id: "r1".into(), prompt: Prompt::Tokens(vec![1, 2, 3]),
//!                            ..Default::default() };
//! let d = c.route(&[route])?.remove(0);
//! d.result()?;
//! c.report(&LifecycleEvent { event: Event::Dispatched, decision_id: Some(d.decision_id),
//!                            worker: Some(d.chosen_worker), ..Default::default() })?;
//! # Ok::<(), kvmatch_client::Error>(())
//! ```

mod client;
mod error;
mod messages;
mod value;

pub use client::{Client, Reply, CLIENT_NAME, DEFAULT_ADDRESS, MAX_ABANDONED, PROTOCOL_VERSION};
pub use error::{outcome_from_stream, Code, Error, Result};
pub use messages::{
    AckItem, Candidate, Decision, Event, LifecycleEvent, Limits, Pool, Prompt, RouteRequest,
    StatusReply, WarmUp, Welcome, Worker, WorkerLoad,
};
pub use value::Value;
