// SPDX-License-Identifier: Apache-2.0
//! Route a prompt through `kvmatch serve` and report its lifecycle.
//!
//!     cargo run --example route -- [ADDRESS [POOL]]
//!
//! ADDRESS is unix:/path (default unix:/tmp/kvmatch.sock) or tcp:IP:PORT; POOL defaults to
//! "default" and needs a worker, e.g. from
//! `kvmatch serve --pool default:16 --worker default:0 --worker default:1` (a pool with no
//! workers decides nothing). Exits 0 when every step was answered as expected.

use std::process::ExitCode;
use std::time::Duration;

use kvmatch_client::{
    outcome_from_stream, Client, Event, LifecycleEvent, Prompt, RouteRequest, DEFAULT_ADDRESS,
};

fn run(address: &str, pool: &str) -> kvmatch_client::Result<()> {
    let mut c = Client::connect(address, Some(Duration::from_secs(5)))?;
    println!("connected: kvmatch {}, protocol {}", c.welcome().kvmatch_version, c.welcome().protocol);
    let prompt: Vec<u32> = (1000..1100).collect();
    let route = RouteRequest {
        request_id: "example-1".into(),
        pool: Some(pool.into()),
        prompt: Prompt::Tokens(prompt.clone()),
        expected_output_tokens: Some(200),
        ..Default::default()
    };
    let d = c.route(&[route])?.remove(0);
    d.result()?;
    println!(
        "chosen_worker {} (chosen_depth {}), owner_worker {:?}, source {}",
        d.chosen_worker, d.chosen_depth, d.owner_worker, d.source
    );
    let event = |event| LifecycleEvent { event, decision_id: Some(d.decision_id), ..Default::default() };
    c.report(&LifecycleEvent { worker: Some(d.chosen_worker), ..event(Event::Dispatched) })?;
    c.report(&LifecycleEvent { elapsed_ms: Some(41.5), ..event(Event::FirstToken) })?;
    let (finish_reason, done_seen, http_status) = ("stop", true, 200);
    c.report(&LifecycleEvent {
        finish_reason: Some(finish_reason.into()),
        done_seen,
        http_status: Some(http_status),
        cached_tokens: Some(96),
        prompt_tokens: Some(prompt.len() as u64),
        output_tokens: Some(187),
        ..event(Event::Finished)
    })?;
    println!("outcome reported: {}", outcome_from_stream(Some(finish_reason), done_seen, Some(http_status), None));
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let address = args.get(1).map_or(DEFAULT_ADDRESS, String::as_str);
    let pool = args.get(2).map_or("default", String::as_str);
    match run(address, pool) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmatch: {}", e);
            ExitCode::FAILURE
        }
    }
}
