//! Envoy's resident memory per KV index entry, as an operator pays it: per index replica (every
//! Envoy thread's VM keeps one), split into a fixed cost per replica and a marginal cost per
//! (block, worker) entry.
//!
//! Each run starts a fresh Envoy with the filter (index.max_blocks = N) at 1 and at 8 worker
//! threads, feeds N blocks through a mock worker's event page, waits until the filter's
//! `index.entries` gauge shows all N and RSS has settled (every VM applies the log on its tick),
//! and records the growth from the idle RSS (every VM started and ticking on an empty log).
//! Seven extra threads add seven replicas and nothing else (the event log ring and the index
//! snapshot in shared data exist once per process), so
//!   per replica(N) = (growth at 8 threads - growth at 1 thread) / 7,
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
//! Since, the snapshot is written and loaded in at most 64 parts (core/src/replication/log.rs), one
//! part-sized buffer at a time. Repeat the runs and compare the heap column before reading one
//! figure, or the per-replica column without the heap's difference (the replicas live in wasm
//! linear memory, outside Envoy's heap). The filter's `vm.linear_memory_bytes` (every VM's
//! linear memory) and `index.bytes` (one replica's index allocations) and the RSS by kind of
//! mapping (`/proc/<pid>/smaps`) separate the replicas' own memory from Envoy's.
//! Usage: `cargo bench --bench envoy_memory [-- --quick] [--entries N[,N...]]` (needs
//! `make build`). The before build `target/envoy_kv_router.before.wasm` is measured too when
//! present (runs interleaved with the current one); keep it with
//! `cp target/envoy_kv_router.wasm target/envoy_kv_router.before.wasm` before rebuilding.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use envoy_kv_router_tools::client;
use envoy_kv_router_tools::harness::{workspace_root, Envoy, EnvoyOptions, Worker};
use kv_router_testkit::kv_events::{stored_event, GPU};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BLOCK_SIZE: u64 = 16;
const BLOCKS_PER_EVENT: u64 = 500;
/// Blocks published ahead of what the filter has indexed (a multiple of `BLOCKS_PER_EVENT`).
const PUBLISH_AHEAD: u64 = 100_000;
/// Threads of the second Envoy: each adds a replica; more of them divide the run-to-run noise of
/// Envoy's own heap (tcmalloc grows in 2 MiB steps, the shared-data snapshot's size varies).
const MANY_THREADS: u32 = 8;
const THREADS: [u32; 2] = [1, MANY_THREADS];
const EXTRA_REPLICAS: i64 = MANY_THREADS as i64 - 1;

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

/// Envoy's heap (admin `/memory`, tcmalloc): bytes handed out, and bytes resident (handed out,
/// cached or free but not yet returned to the OS: `heap_size - pageheap_unmapped`); 0 if unknown.
fn heap(envoy: &Envoy) -> (u64, u64) {
    let memory = client::get(&envoy.admin, "/memory")
        .ok()
        .and_then(|r| serde_json::from_str::<Value>(&r.text()).ok())
        .unwrap_or(Value::Null);
    let field = |name: &str| match &memory[name] {
        Value::String(s) => s.parse().unwrap_or(0),
        other => other.as_u64().unwrap_or(0),
    };
    let allocated: u64 = field("allocated");
    let resident = field("heap_size").saturating_sub(field("pageheap_unmapped"));
    (allocated, resident)
}

/// Envoy's RSS by kind of mapping (KiB), from `/proc/<pid>/smaps`: wasm linear memories, executable
/// anonymous mappings (V8's compiled code), other anonymous memory (Envoy's heap, V8's own),
/// file-backed (Envoy's binary).
#[derive(Clone, Copy, Default)]
struct RssByMapping {
    linear: i64,
    code: i64,
    anonymous: i64,
    file: i64,
}

fn rss_by_mapping(pid: u32) -> RssByMapping {
    /// (start, end, permissions, anonymous, Rss KiB) of one mapping.
    struct Mapping {
        start: u64,
        end: u64,
        perms: String,
        anonymous: bool,
        rss_kib: i64,
    }
    let mut maps: Vec<Mapping> = Vec::new();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if first == "Rss:" {
            if let Some(m) = maps.last_mut() {
                m.rss_kib = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            }
            continue;
        }
        let Some((lo, hi)) = first.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
        else {
            continue;
        };
        let perms = fields.next().unwrap_or("").to_string();
        maps.push(Mapping {
            start,
            end,
            perms,
            anonymous: fields.nth(3).is_none(),
            rss_kib: 0,
        });
    }
    let mut out = RssByMapping::default();
    for (i, m) in maps.iter().enumerate() {
        // V8 reserves each wasm memory (with its guard region) as several GiB of PROT_NONE and
        // makes the grown part accessible: the accessible part directly precedes the rest.
        let reservation_follows = maps.get(i + 1).is_some_and(|n| {
            n.start == m.end
                && n.anonymous
                && n.perms.starts_with("---")
                && n.end - n.start >= 1 << 32
        });
        let class = if !m.anonymous {
            &mut out.file
        } else if reservation_follows && m.perms.starts_with("rw") {
            &mut out.linear
        } else if m.perms.contains('x') {
            &mut out.code
        } else {
            &mut out.anonymous
        };
        *class += m.rss_kib;
    }
    out
}

impl RssByMapping {
    fn minus(self, o: RssByMapping) -> RssByMapping {
        RssByMapping {
            linear: self.linear - o.linear,
            code: self.code - o.code,
            anonymous: self.anonymous - o.anonymous,
            file: self.file - o.file,
        }
    }
}

#[derive(Clone, Copy, Default)]
struct Run {
    /// RSS growth by kind of mapping.
    mappings: RssByMapping,
    /// RSS growth, KiB.
    rss_kib: i64,
    /// Envoy heap (tcmalloc) growth, KiB: handed out, and resident.
    heap_kib: i64,
    heap_resident_kib: i64,
    /// Growth of the wasm linear memory of all VMs (the filter's `vm.linear_memory_bytes`), KiB.
    linear_kib: i64,
    idle_kib: u64,
    indexed: u64,
    /// The index's own allocations in one replica (the filter's `index.bytes`).
    index_bytes: u64,
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
    // Every VM started and ticking on an empty log: each adds its linear memory to the gauge on
    // its first tick, so the sum holds still once all of them (threads + 1) have.
    let (mut linear, mut since) = (0, Instant::now());
    envoy.wait_for(Duration::from_secs(10), |e| {
        let now = e.router_stat("vm.linear_memory_bytes");
        if now != linear {
            (linear, since) = (now, Instant::now());
        }
        linear >= u64::from(threads + 1) << 16 && since.elapsed() >= Duration::from_millis(300)
    });
    let before = settled_rss(&envoy);
    let (heap_before, heap_resident_before) = heap(&envoy);
    let linear_before = envoy.router_stat("vm.linear_memory_bytes");
    let mappings_before = rss_by_mapping(envoy.pid());
    let start = Instant::now();
    let mut parent: Option<u64> = None;
    let mut block = 0u64;
    while block < entries {
        let n = BLOCKS_PER_EVENT.min(entries - block);
        let hashes: Vec<u64> = (block..block + n).map(|h| h + 1).collect();
        let tokens: Vec<u32> = (block * BLOCK_SIZE..(block + n) * BLOCK_SIZE)
            .map(|t| (t % 50_000) as u32)
            .collect();
        let event = stored_event(&hashes, parent, &tokens, BLOCK_SIZE as u32, GPU);
        let stored = json!([event]);
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
    let index_bytes = envoy.router_stat("index.bytes");
    let snapshot_loads = envoy.router_stat("log.snapshot_loaded");
    let secs = start.elapsed().as_secs_f64();
    let after = settled_rss(&envoy);
    let (heap_after, heap_resident_after) = heap(&envoy);
    // Each VM adds its growth on its tick (50 ms), long done once RSS settled (~1 s).
    let linear_after = envoy.router_stat("vm.linear_memory_bytes");
    Run {
        mappings: rss_by_mapping(envoy.pid()).minus(mappings_before),
        rss_kib: after as i64 - before as i64,
        heap_kib: (heap_after as i64 - heap_before as i64) / 1024,
        heap_resident_kib: (heap_resident_after as i64 - heap_resident_before as i64) / 1024,
        linear_kib: (linear_after as i64 - linear_before as i64) / 1024,
        idle_kib: before,
        indexed,
        index_bytes,
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
         index.max_blocks = N; growth from the idle RSS; 1 and {MANY_THREADS} Envoy worker \
         threads ({EXTRA_REPLICAS} more replicas)."
    );
    println!();
    println!(
        "| build | N | threads | idle RSS | RSS growth | of it Envoy heap | of it wasm linear memory | indexed | index s | snapshot loads |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    // runs[build][size][thread]
    let mut runs = vec![vec![[Run::default(); THREADS.len()]; sizes.len()]; builds.len()];
    for (si, &n) in sizes.iter().enumerate() {
        for (ti, &threads) in THREADS.iter().enumerate() {
            // Builds interleaved: both see the same machine state.
            for (bi, (name, wasm)) in builds.iter().enumerate() {
                let r = run(wasm, threads, n);
                println!(
                    "| {name} | {n} | {threads} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB | {}{} | {:.1} | {} |",
                    r.idle_kib as f64 / 1024.0,
                    r.rss_kib as f64 / 1024.0,
                    r.heap_kib as f64 / 1024.0,
                    r.linear_kib as f64 / 1024.0,
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
        "Per replica = (RSS growth at {MANY_THREADS} threads - at 1 thread) / {EXTRA_REPLICAS}. B/entry = per replica / N \
         (fixed cost included). Fit over the sizes: per replica = fixed + marginal x N."
    );
    println!();
    println!("| build | N | per replica | B/entry per replica | of it outside Envoy's heap | of it wasm linear memory | the index's own allocations | RSS growth / N at 1 thread (2 VMs + shared data) | at {MANY_THREADS} threads |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut once_per_process = Vec::new();
    for (bi, (name, _)) in builds.iter().enumerate() {
        let mut points = Vec::new();
        for (si, &n) in sizes.iter().enumerate() {
            let [one, four] = runs[bi][si];
            let per_replica = (four.rss_kib - one.rss_kib) as f64 * 1024.0 / EXTRA_REPLICAS as f64;
            // Without the heap's difference: what the shared-data snapshot a run ends with
            // (once per process, its size varies) adds to one side.
            let outside_heap =
                ((four.rss_kib - four.heap_kib) - (one.rss_kib - one.heap_kib)) as f64 * 1024.0
                    / EXTRA_REPLICAS as f64;
            let linear = (four.linear_kib - one.linear_kib) as f64 * 1024.0 / EXTRA_REPLICAS as f64;
            points.push((n as f64, per_replica));
            println!(
                "| {name} | {n} | {:.1} MiB | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                per_replica / (1 << 20) as f64,
                per_replica / n as f64,
                outside_heap / n as f64,
                linear / n as f64,
                four.index_bytes as f64 / n as f64,
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
        "RSS growth by kind of mapping (/proc/<pid>/smaps): wasm linear memories, V8's compiled \
         code (executable anonymous), other anonymous (Envoy's heap, V8's own), file-backed; per \
         replica = ({MANY_THREADS} threads - 1 thread) / {EXTRA_REPLICAS}."
    );
    println!();
    println!("| build | N | threads | linear memory | code | other anonymous | of it Envoy's heap resident | file |");
    println!("|---|---|---|---|---|---|---|---|");
    let mib = |kib: i64| kib as f64 / 1024.0;
    for (bi, (name, _)) in builds.iter().enumerate() {
        for (si, &n) in sizes.iter().enumerate() {
            let [one, four] = runs[bi][si];
            let heap_per_replica =
                (four.heap_resident_kib - one.heap_resident_kib) / EXTRA_REPLICAS;
            for (label, m, heap) in [
                ("1", one.mappings, one.heap_resident_kib),
                ("many", four.mappings, four.heap_resident_kib),
                (
                    "per replica",
                    {
                        let d = four.mappings.minus(one.mappings);
                        RssByMapping {
                            linear: d.linear / EXTRA_REPLICAS,
                            code: d.code / EXTRA_REPLICAS,
                            anonymous: d.anonymous / EXTRA_REPLICAS,
                            file: d.file / EXTRA_REPLICAS,
                        }
                    },
                    heap_per_replica,
                ),
            ] {
                println!(
                    "| {name} | {n} | {label} | {:.2} MiB | {:.2} MiB | {:.2} MiB | {:.2} MiB | {:.2} MiB |",
                    mib(m.linear),
                    mib(m.code),
                    mib(m.anonymous),
                    mib(heap),
                    mib(m.file)
                );
            }
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
