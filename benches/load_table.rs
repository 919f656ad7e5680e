//! The load table's (`load::LoadTable`) cost per routed request with 64 workers and 0 / 400 /
//! 1,000 / 10,000 requests held in flight: the table is fixed-size, so the cost must not grow
//! with the requests in flight (the per-request table it replaced cost 1.84 ms at 10,000 in
//! flight against 13.7 µs; docs/history/benchmark-log.md, "Load table cost per request").
//!
//! One routed request does what the filter does with the shared-data bytes: read + decode +
//! view (decide), then three CAS rounds of decode + edit + encode (book, first token, release).
//! Host-call overhead and CAS retries are not included (see `benches/envoy_overhead.rs` for the
//! whole filter in Envoy). Prints medians; asserts nothing.
//!
//! Usage: `cargo bench --bench load_table [-- --quick] [--in-flight N]`. Instruction counts per
//! request: run the built binary under `valgrind --tool=callgrind
//! --toggle-collect='load_table::request_*'` with `--quick --in-flight N` and divide each
//! function's inclusive count by its calls.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use envoy_kv_router::load::{LoadTable, Ticket};

const SLOTS: usize = 64;
const TOKENS: u32 = 4096;
const BLOCKS: u32 = 64;

/// One routed request against the fixed-size table's bytes; returns the new bytes.
#[inline(never)]
fn request_fixed(bytes: &[u8], key: u64, now: u64) -> Vec<u8> {
    let view = LoadTable::decode(bytes, SLOTS).unwrap().view(now);
    let slot = (key % SLOTS as u64) as u16;
    black_box(&view);
    let mut t = LoadTable::decode(bytes, SLOTS).unwrap();
    let ticket: Ticket = t
        .admit(key, slot, TOKENS, BLOCKS, Some(300.0), now)
        .unwrap();
    let b = t.encode();
    let mut t = LoadTable::decode(&b, SLOTS).unwrap();
    let ticket = t.first_token(&ticket, now + 1).unwrap();
    let b = t.encode();
    let mut t = LoadTable::decode(&b, SLOTS).unwrap();
    assert!(t.release_at(&ticket, now + 2));
    t.encode()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let iterations = if quick { 200 } else { 2_000 };
    println!("bench load_table: {SLOTS} workers, {TOKENS}-token requests (decode+view, then book / first token / release CAS rounds)");
    println!(
        "{:>10} | {:>12} | {:>11}",
        "in flight", "per request", "table bytes"
    );
    let args: Vec<String> = std::env::args().collect();
    let only: Option<usize> = args
        .iter()
        .position(|a| a == "--in-flight")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok());
    let sizes: Vec<usize> = match only {
        Some(n) => vec![n],
        None => vec![0, 400, 1_000, 10_000],
    };
    for in_flight in sizes {
        let mut fixed = LoadTable::with_timeout(SLOTS, 900_000);
        for k in 0..in_flight as u64 {
            let slot = (k % SLOTS as u64) as u16;
            fixed.admit(k, slot, TOKENS, BLOCKS, Some(300.0), 1_000);
        }
        let fixed_bytes = fixed.encode();
        let mut t_new = Vec::with_capacity(iterations);
        for i in 0..iterations as u64 {
            let key = 1 << 40 | i;
            let start = Instant::now();
            black_box(request_fixed(&fixed_bytes, key, 2_000));
            t_new.push(start.elapsed());
        }
        let n = median(&mut t_new);
        println!(
            "{:>10} | {:>9.1} µs | {:>11}",
            in_flight,
            n.as_secs_f64() * 1e6,
            fixed_bytes.len()
        );
    }
    println!("medians of {iterations} runs");
}
