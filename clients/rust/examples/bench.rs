// SPDX-License-Identifier: Apache-2.0
//! The Rust client's driver for `kvmatch bench ipc --clients` (scripts/bench-clients.sh): one
//! connection, closed loop, WINDOW frames in flight, each frame PER_FRAME routes of the chain
//! hashes read from SCHEDULE (one prompt per line, cycled), in pool "main", for SECONDS. Prints one
//! JSON line: decisions/s (routes answered with status 0 per second), round-trip p50 / p99 in us
//! (send to reply, per frame), frames, errors.
//!
//!     cargo run --release --example bench -- ADDRESS SCHEDULE PER_FRAME WINDOW SECONDS

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvmatch_client::{Client, Prompt, RouteRequest};

fn run(args: &[String]) -> Result<String, String> {
    if args.len() != 5 {
        return Err("usage: bench ADDRESS SCHEDULE PER_FRAME WINDOW SECONDS".into());
    }
    let parse = |s: &str| s.parse::<f64>().map_err(|e| format!("{}: {}", s, e));
    let per_frame = parse(&args[2])? as usize;
    let window = parse(&args[3])? as usize;
    let seconds = parse(&args[4])?;
    let text = std::fs::read_to_string(&args[1]).map_err(|e| format!("{}: {}", args[1], e))?;
    let mut prompts: Vec<Vec<u64>> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let p: Result<Vec<u64>, _> = line.split_whitespace().map(str::parse).collect();
        prompts.push(p.map_err(|e| format!("{}: {}", args[1], e))?);
    }
    if prompts.is_empty() || per_frame == 0 || window == 0 {
        return Err("no prompts, or PER_FRAME / WINDOW 0".into());
    }
    let mut c = Client::connect(&args[0], Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    // Request ids unique to this process: a later run's are new attempts, never ones in flight.
    let (mut seq, mut cursor) = (0u64, 0usize);
    let mut sent_at: HashMap<u64, Instant> = HashMap::new();
    let mut send = |c: &mut Client, sent_at: &mut HashMap<u64, Instant>| -> Result<(), String> {
        let routes: Vec<RouteRequest> = (0..per_frame)
            .map(|_| {
                let r = RouteRequest {
                    request_id: format!("rs{}-{}", std::process::id(), seq),
                    pool: Some("main".into()),
                    prompt: Prompt::Hashes { hashes: prompts[cursor].clone(), block_size: None },
                    expected_output_tokens: Some(128),
                    ..Default::default()
                };
                seq += 1;
                cursor = (cursor + 1) % prompts.len();
                r
            })
            .collect();
        let id = c.send_route(&routes).map_err(|e| e.to_string())?;
        sent_at.insert(id, Instant::now());
        Ok(())
    };
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    for _ in 0..window {
        send(&mut c, &mut sent_at)?;
    }
    let mut rtts: Vec<f64> = Vec::new();
    let (mut ok, mut errors, mut frames) = (0u64, 0u64, 0u64);
    while !sent_at.is_empty() {
        let reply = c.receive().map_err(|e| e.to_string())?;
        let now = Instant::now();
        if let Some(at) = sent_at.remove(&reply.id) {
            rtts.push(now.duration_since(at).as_secs_f64() * 1e6);
        }
        frames += 1;
        match reply.decisions() {
            Ok(ds) if reply.kind == "DECISION" => {
                for d in ds {
                    if d.status.is_ok() {
                        ok += 1
                    } else {
                        errors += 1
                    }
                }
            }
            _ => errors += 1,
        }
        if now < end {
            send(&mut c, &mut sent_at)?;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    rtts.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let pct = |q: f64| rtts.get(((q * rtts.len() as f64) as usize).min(rtts.len().saturating_sub(1))).copied().unwrap_or(0.0);
    Ok(format!(
        "{{\"decisions_per_s\": {:.1}, \"rtt_p50_us\": {:.1}, \"rtt_p99_us\": {:.1}, \"frames\": {}, \"errors\": {}}}",
        ok as f64 / elapsed,
        pct(0.50),
        pct(0.99),
        frames,
        errors
    ))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(line) => {
            println!("{}", line);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench: {}", e);
            ExitCode::FAILURE
        }
    }
}
