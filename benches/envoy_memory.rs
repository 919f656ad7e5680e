//! Envoy's resident memory per KV index entry, as an operator pays it: per index replica (every
//! Envoy thread's VM keeps one), split into a fixed cost per replica and a marginal cost per
//! (block, worker) entry.
//!
//! Each run starts a fresh Envoy with the filter (index.max_blocks = N) at 1 and at 4 worker
//! threads, feeds N blocks through a mock worker's event page, waits until the filter's
//! `index.entries` gauge shows all N and RSS has settled (every VM applies the log on its tick),
//! and records the growth from the idle RSS (every VM started and ticking on an empty log).
//! Three extra threads add three replicas and nothing else (the event log ring and the index
//! snapshot in shared data exist once per process), so
//!   per replica(N) = (growth at 4 threads - growth at 1 thread) / 3,
//! and over several N a least-squares line per replica(N) = fixed + marginal x N gives the
//! fixed cost per replica (what the first events make every VM allocate for good: wasm linear
//! memory never shrinks, V8 compiles the event path) and the marginal cost per entry (the
//! slope). `per replica / N` at each size is what one entry costs with the fixed part spread
//! over N. Envoy's own heap (tcmalloc, admin `/memory`: shared data) is shown apart from the
//! rest of RSS (wasm linear memory, V8 code).
//!
//! Noise: the poller writes the index snapshot into shared data (the heap column) when its
//! replica passes another multiple of 32 log batches, so how large a snapshot a run ends holding
//! varies (up to ~17 B per entry, once per process). Up to and including the build before the
//! snapshot went into parts, the writer VM also encoded it into one buffer in its linear memory
//! (and a VM that reloaded it copied it whole), kept for good: ~17 B per entry more in whichever
//! run held it, so the per-replica difference swung by up to ~10 B per entry at 1M entries.
//! Since, the snapshot is written and loaded in at most 64 parts (src/replication/log.rs), one
//! part-sized buffer at a time. Repeat the runs and compare the heap column before reading one
//! figure, or the per-replica column without the heap's difference (the replicas live in wasm
//! linear memory, outside Envoy's heap).
//! Usage: `cargo bench --bench envoy_memory [-- --quick] [--entries N[,N...]]` (needs
//! `make build`). The before build `target/envoy_kv_router.before.wasm` is measured too when
//! present (runs interleaved with the current one); keep it with
//! `cp target/envoy_kv_router.wasm target/envoy_kv_router.before.wasm` before rebuilding.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use envoy_kv_router_tools::client;
use envoy_kv_router_tools::harness::{workspace_root, Envoy, EnvoyOptions, Worker};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BLOCK_SIZE: u64 = 16;
const BLOCKS_PER_EVENT: u64 = 500;
/// Blocks published ahead of what the filter has indexed (a multiple of `BLOCKS_PER_EVENT`).
const PUBLISH_AHEAD: u64 = 100_000;
const THREADS: [u32; 2] = [1, 4];

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

/// Bytes tcmalloc hands out in Envoy (admin `/memory`), 0 if unknown.
fn heap_allocated(envoy: &Envoy) -> u64 {
    client::get(&envoy.admin, "/memory")
        .ok()
        .and_then(|r| serde_json::from_str::<Value>(&r.text()).ok())
        .and_then(|v| match &v["allocated"] {
            Value::String(s) => s.parse().ok(),
            other => other.as_u64(),
        })
        .unwrap_or(0)
}

#[derive(Clone, Copy, Default)]
struct Run {
    /// RSS growth, KiB.
    rss_kib: i64,
    /// Envoy heap (tcmalloc) growth, KiB.
    heap_kib: i64,
    idle_kib: u64,
    indexed: u64,
    /// Replicas that fell a whole log ring behind and reloaded the index snapshot: each copies
    /// the snapshot into its linear memory, which keeps that high-water mark for good.
    snapshot_loads: u64,
    secs: f64,
}

fn run(wasm: &Path, threads: u32, entries: u64) -> Run {
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
    let heap_before = heap_allocated(&envoy);
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
        // Keep the filter within PUBLISH_AHEAD blocks of the publisher: the mock keeps 64 MiB of
        // event JSON (~650k blocks here), and a poller that falls behind it must re-sync from a
        // dump of the whole cache, which is larger than `events.max_response_bytes`, so the run
        // would stall at 0 entries (seen at 1M entries and 4 threads on a busy machine).
        if block % PUBLISH_AHEAD == 0 && block < entries {
            let behind = block - PUBLISH_AHEAD;
            envoy.wait_for(Duration::from_secs(120), |e| {
                e.router_stat("index.entries") >= behind
            });
        }
    }
    envoy.wait_for(Duration::from_secs(300), |e| {
        e.router_stat("index.entries") >= entries
    });
    let indexed = envoy.router_stat("index.entries");
    let snapshot_loads = envoy.router_stat("log.snapshot_loaded");
    let secs = start.elapsed().as_secs_f64();
    let after = settled_rss(&envoy);
    let heap_after = heap_allocated(&envoy);
    Run {
        rss_kib: after as i64 - before as i64,
        heap_kib: (heap_after as i64 - heap_before as i64) / 1024,
        idle_kib: before,
        indexed,
        snapshot_loads,
        secs,
    }
}

/// Least-squares `y = a + b x`.
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mx, b)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let sizes: Vec<u64> = args
        .iter()
        .position(|a| a == "--entries")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_else(|| {
            if quick {
                vec![50_000, 200_000]
            } else {
                vec![100_000, 400_000, 1_000_000]
            }
        });
    let target = workspace_root().join("target");
    let builds: Vec<(&str, PathBuf)> = [
        ("before", target.join("envoy_kv_router.before.wasm")),
        ("current", target.join("envoy_kv_router.wasm")),
    ]
    .into_iter()
    .filter(|(_, p)| p.exists())
    .collect();
    println!(
        "Envoy RSS per KV index entry: N blocks of one mock worker fed through its event page, \
         index.max_blocks = N; growth from the idle RSS; 1 and 4 Envoy worker threads \
         (3 more replicas)."
    );
    println!();
    println!(
        "| build | N | threads | idle RSS | RSS growth | of it Envoy heap | indexed | index s | snapshot loads |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    // runs[build][size][thread]
    let mut runs = vec![vec![[Run::default(); THREADS.len()]; sizes.len()]; builds.len()];
    for (si, &n) in sizes.iter().enumerate() {
        for (ti, &threads) in THREADS.iter().enumerate() {
            // Builds interleaved: both see the same machine state.
            for (bi, (name, wasm)) in builds.iter().enumerate() {
                let r = run(wasm, threads, n);
                println!(
                    "| {name} | {n} | {threads} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {}{} | {:.1} | {} |",
                    r.idle_kib as f64 / 1024.0,
                    r.rss_kib as f64 / 1024.0,
                    r.heap_kib as f64 / 1024.0,
                    r.indexed,
                    if r.indexed < n { " (INCOMPLETE: figures below meaningless)" } else { "" },
                    r.secs,
                    r.snapshot_loads
                );
                runs[bi][si][ti] = r;
            }
        }
    }
    println!();
    println!(
        "Per replica = (RSS growth at 4 threads - at 1 thread) / 3. B/entry = per replica / N \
         (fixed cost included). Fit over the sizes: per replica = fixed + marginal x N."
    );
    println!();
    println!("| build | N | per replica | B/entry per replica | of it outside Envoy's heap | RSS growth / N at 1 thread (2 VMs + shared data) | at 4 threads |");
    println!("|---|---|---|---|---|---|---|");
    let mut once_per_process = Vec::new();
    for (bi, (name, _)) in builds.iter().enumerate() {
        let mut points = Vec::new();
        for (si, &n) in sizes.iter().enumerate() {
            let [one, four] = runs[bi][si];
            let per_replica = (four.rss_kib - one.rss_kib) as f64 * 1024.0 / 3.0;
            // Without the heap's difference: what the shared-data snapshot a run ends with
            // (once per process, its size varies) adds to one side.
            let outside_heap =
                ((four.rss_kib - four.heap_kib) - (one.rss_kib - one.heap_kib)) as f64 * 1024.0
                    / 3.0;
            points.push((n as f64, per_replica));
            println!(
                "| {name} | {n} | {:.1} MiB | {:.1} | {:.1} | {:.1} | {:.1} |",
                per_replica / (1 << 20) as f64,
                per_replica / n as f64,
                outside_heap / n as f64,
                one.rss_kib as f64 * 1024.0 / n as f64,
                four.rss_kib as f64 * 1024.0 / n as f64
            );
        }
        if points.len() >= 2 {
            let (fixed, marginal) = fit(&points);
            let (fixed1, marginal1) = fit(&sizes
                .iter()
                .enumerate()
                .map(|(si, &n)| (n as f64, runs[bi][si][0].rss_kib as f64 * 1024.0))
                .collect::<Vec<_>>());
            println!(
                "| {name} | fit | fixed {:.1} MiB per replica | marginal {marginal:.1} B per entry per replica | | 1 thread: fixed {:.1} MiB, marginal {marginal1:.1} B per entry | |",
                fixed / (1 << 20) as f64,
                fixed1 / (1 << 20) as f64,
            );
            once_per_process.push((name, marginal1 - 2.0 * marginal));
        }
    }
    println!();
    println!(
        "An operator with T threads pays T + 1 replicas (fixed + marginal x N each) plus, once \
         per process, the index snapshot in shared data (Envoy heap, every 32 log batches) and \
         the snapshot's encoding buffer in the wasm memory of the VM that writes it (the poller): \
         the 1-thread slope less two replicas' slopes:"
    );
    for (name, bytes) in once_per_process {
        println!("  {name}: {bytes:.1} B per entry once per process");
    }
}
