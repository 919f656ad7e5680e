//! Envoy's resident memory per KV index entry, for the filter before the compact index
//! (`target/envoy_kv_router.before.wasm`, if present) and the current one, at 1 and 4 Envoy
//! worker threads. Each run starts a fresh Envoy with the filter (index.max_blocks = N), feeds N
//! blocks through a mock worker's event page, waits until the filter's `index.entries` gauge
//! shows all N and RSS has settled (every VM applies the log on its tick), and reports
//! (RSS after - RSS before) / N. Every thread's VM (worker threads plus the main thread's) keeps
//! a replica; "per replica" divides by threads + 1. The process figure also holds what is not
//! per replica (the event log ring and the index snapshot in shared data). Asserts nothing.
//!
//! Usage: `cargo bench --bench envoy_memory [-- --quick] [--entries N]` (needs `make build`).
//! To compare, keep the earlier build: `cp target/envoy_kv_router.wasm
//! target/envoy_kv_router.before.wasm` before rebuilding.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use envoy_kv_router_tools::harness::{workspace_root, Envoy, EnvoyOptions, Worker};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BLOCK_SIZE: u64 = 16;
const BLOCKS_PER_EVENT: u64 = 500;

/// Envoy's RSS once it stops moving: three readings 300 ms apart within 256 KiB.
fn settled_rss(envoy: &Envoy) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = envoy.rss_kib().unwrap_or(0);
    let mut stable = 0;
    while stable < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(300));
        let now = envoy.rss_kib().unwrap_or(0);
        stable = if now.abs_diff(last) <= 256 {
            stable + 1
        } else {
            0
        };
        last = now;
    }
    last
}

/// (RSS before KiB, RSS after KiB, entries indexed, seconds to index).
fn run(wasm: &Path, threads: u32, entries: u64) -> (u64, u64, u64, f64) {
    let worker = Worker::spawn(1, &["--mode", "echo", "--block-size", "16"]).expect("worker");
    let config = json!({"mode": "kv", "block_size": BLOCK_SIZE,
        "index": {"max_blocks": entries},
        "workers": [{"id": 1, "address": worker.addr}]});
    let mut opts = EnvoyOptions::new(config, vec![worker.addr.clone()]);
    opts.concurrency = threads;
    opts.log_level = "warning";
    opts.wasm = Some(wasm.to_path_buf());
    let envoy = Envoy::start(&opts).expect("envoy");
    // Let every VM start and tick on an empty log first.
    std::thread::sleep(Duration::from_millis(500));
    let before = settled_rss(&envoy);
    let start = Instant::now();
    let mut parent: Option<u64> = None;
    let mut block = 0u64;
    while block < entries {
        let n = BLOCKS_PER_EVENT.min(entries - block);
        let hashes: Vec<u64> = (block..block + n).map(|h| h + 1).collect();
        let tokens: Vec<u64> = (block * BLOCK_SIZE..(block + n) * BLOCK_SIZE)
            .map(|t| t % 50_000)
            .collect();
        let stored = json!([{"type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": parent, "token_ids": tokens, "block_size": BLOCK_SIZE,
            "medium": "GPU"}]);
        worker.admin("/admin/events", &stored).expect("publish");
        parent = hashes.last().copied();
        block += n;
    }
    envoy.wait_for(Duration::from_secs(300), |e| {
        e.router_stat("index.entries") >= entries
    });
    let indexed = envoy.router_stat("index.entries");
    let elapsed = start.elapsed().as_secs_f64();
    let after = settled_rss(&envoy);
    (before, after, indexed, elapsed)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let entries = args
        .iter()
        .position(|a| a == "--entries")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 50_000 } else { 200_000 });
    let target = workspace_root().join("target");
    let builds: Vec<(&str, PathBuf)> = [
        ("before", target.join("envoy_kv_router.before.wasm")),
        ("current", target.join("envoy_kv_router.wasm")),
    ]
    .into_iter()
    .filter(|(_, p)| p.exists())
    .collect();
    println!(
        "Envoy RSS per index entry: {entries} blocks fed through one mock worker's event page, index.max_blocks = {entries}"
    );
    println!(
        "{:>8} {:>8} {:>10} {:>10} {:>9} {:>8} {:>12} {:>13}",
        "build",
        "threads",
        "RSS before",
        "RSS after",
        "indexed",
        "index s",
        "B/entry",
        "B/entry/VM"
    );
    for threads in [1u32, 4] {
        for (name, wasm) in &builds {
            let (before, after, indexed, secs) = run(wasm, threads, entries);
            let per_entry = (after.saturating_sub(before) * 1024) as f64 / entries as f64;
            println!(
                "{name:>8} {threads:>8} {:>7} MiB {:>7} MiB {indexed:>9} {secs:>8.1} {per_entry:>12.1} {:>13.1}",
                before / 1024,
                after / 1024,
                per_entry / f64::from(threads + 1)
            );
        }
    }
}
