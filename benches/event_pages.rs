//! The event page path natively, stage by stage, on the same stream as `envoy_cpu --only events`
//! (1-block events, half BlockStored with 64 token ids, half BlockRemoved) served as the echo
//! mock serves it (pages of at most 1,000 events or 1 MiB of JSON): what the poller VM does per
//! page inside Envoy (parse + hash the token ids, encode the log batch) and what every replica
//! does per batch (decode, apply to its index). Prints ns per event per stage, medians of 5.
//! `--stage parse|encode|decode|apply|all` runs one stage once (for `valgrind --tool=callgrind`).
//!
//! Usage: `cargo bench --bench event_pages [-- --events N] [--page-events P] [--stage S]`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use envoy_kv_router::events::{decode_log_batch, encode_log_batch, parse_event_page, LogRecord};
use envoy_kv_router::index::KvIndex;
use kv_router_testkit::kv_events::{page_event, removed, stored, GPU};
use serde_json::{json, Value};
use std::hint::black_box;
use std::time::Instant;

const BLOCK_SIZE: u32 = 64;

fn wire_events(n: usize) -> Vec<Value> {
    let mut tokens: Vec<u32> = (0..BLOCK_SIZE).collect();
    let mut out = Vec::with_capacity(n);
    let mut next = 1u64;
    for i in 0..n {
        let id = i as u64 + 1;
        if i % 2 == 1 && next > 500 {
            let h = next - 500;
            out.push(page_event(Some(id), &removed(&[h], GPU), BLOCK_SIZE));
        } else {
            tokens[0] = next as u32;
            let event = stored(&[next], None, &tokens, GPU);
            out.push(page_event(Some(id), &event, BLOCK_SIZE));
            next += 1;
        }
    }
    out
}

/// Pages as the mock serves them, serialized.
fn pages(events: &[Value], per_page: usize) -> Vec<Vec<u8>> {
    let last = events.len();
    events
        .chunks(per_page)
        .enumerate()
        .map(|(i, chunk)| {
            serde_json::to_vec(&json!({"block_size": BLOCK_SIZE, "first_event_id": 1,
                "last_event_id": last, "events": chunk, "_page": i}))
            .unwrap()
        })
        .collect()
}

fn parse_all(bodies: &[Vec<u8>]) -> Vec<LogRecord> {
    bodies
        .iter()
        .map(|b| {
            let page = parse_event_page(b, BLOCK_SIZE, 64 << 20).expect("page");
            LogRecord::Events {
                worker: 0,
                events: page.events,
            }
        })
        .collect()
}

fn encode_all(records: &[LogRecord]) -> Vec<Vec<u8>> {
    records
        .iter()
        .map(|r| encode_log_batch(std::slice::from_ref(r)))
        .collect()
}

fn decode_all(batches: &[Vec<u8>]) -> Vec<Vec<LogRecord>> {
    batches
        .iter()
        .map(|b| decode_log_batch(b).expect("batch"))
        .collect()
}

fn apply_all(decoded: &[Vec<LogRecord>]) -> usize {
    let mut index = KvIndex::new(1, 200_000);
    for records in decoded {
        for r in records {
            if let LogRecord::Events { events, .. } = r {
                for e in events {
                    let _ = black_box(index.apply(0, &e.event));
                }
            }
        }
    }
    index.entries()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let n: usize = arg("--events")
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let per_page: usize = arg("--page-events")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let stage = arg("--stage");
    let bodies = pages(&wire_events(n), per_page);
    let bytes: usize = bodies.iter().map(Vec::len).sum();
    let records = parse_all(&bodies);
    let batches = encode_all(&records);
    let decoded = decode_all(&batches);
    if let Some(stage) = stage {
        match stage.as_str() {
            "parse" => drop(black_box(parse_all(&bodies))),
            "encode" => drop(black_box(encode_all(&records))),
            "decode" => drop(black_box(decode_all(&batches))),
            "apply" => {
                black_box(apply_all(&decoded));
            }
            _ => {
                let r = parse_all(&bodies);
                let b = encode_all(&r);
                let d = decode_all(&b);
                black_box(apply_all(&d));
            }
        }
        return;
    }
    println!(
        "{n} events in {} pages of {per_page} ({:.0} B of JSON per event); ns per event, median of 5",
        bodies.len(),
        bytes as f64 / n as f64
    );
    let time = |f: &dyn Fn()| {
        median(
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_nanos() as f64 / n as f64
                })
                .collect(),
        )
    };
    let parse = time(&|| drop(black_box(parse_all(&bodies))));
    let encode = time(&|| drop(black_box(encode_all(&records))));
    let decode = time(&|| drop(black_box(decode_all(&batches))));
    let apply = time(&|| {
        black_box(apply_all(&decoded));
    });
    println!("| stage | ns / event |");
    println!("|---|---|");
    println!("| parse page (JSON, hash token ids) | {parse:.0} |");
    println!("| encode log batch | {encode:.0} |");
    println!("| decode log batch (each replica) | {decode:.0} |");
    println!("| apply to the index (each replica) | {apply:.0} |");
    let poller = parse + encode + decode + apply;
    println!(
        "| poller VM in all | {poller:.0} ({:.2} M events/s) |",
        1e3 / poller
    );
    println!(
        "| other replica | {:.0} ({:.2} M events/s) |",
        decode + apply,
        1e3 / (decode + apply)
    );
}
