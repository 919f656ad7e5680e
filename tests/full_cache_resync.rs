//! A restarted engine whose 16,384-block cache (the mock's default `--kv-blocks`, Dynamo's
//! mocker default) is full when the filter first reads it again is re-synced from its dump at the
//! filter's defaults: no `events.max_response_bytes` (64 MiB), no `index.max_blocks` (derived
//! from the workers' `kv_capacity_blocks`), the default block size (64) and poll settings.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const KV_BLOCKS: u32 = 16_384;
const BLOCK: u32 = 64;
/// Blocks per filling prompt: 16 of them take 16,368 blocks, 16 short of the cache, so no probe's
/// decode block evicts one (every probe and the dump then agree).
const PROMPT_BLOCKS: u32 = 1023;
const PROMPTS: u32 = 16;

/// Engine-mode flags: the cache size under test, fast steps (a 65k-token prefill in ms).
const ARGS: [&str; 10] = [
    "--mode",
    "engine",
    "--block-size",
    "64",
    "--kv-blocks",
    "16384",
    "--speedup",
    "1000",
    "--jitter",
    "0",
];

/// The `i`th prompt of fill `set`: token ids below 100,000 as a real vocabulary's (the dump's
/// size depends on their digits), each prompt from its own offset (no two share a block).
fn prompt(set: u32, i: u32) -> Vec<u32> {
    let offset = 1 + (set * PROMPTS + i) * 3_001;
    (0..PROMPT_BLOCKS * BLOCK)
        .map(|t| (offset + t) % 100_000)
        .collect()
}

/// Serves the `set`'s prompts on `worker` directly (not through Envoy: the filter records no
/// predicted blocks for them, so only events or a dump can credit them).
fn fill(worker: &Worker, set: u32) {
    for i in 0..PROMPTS {
        let body = json!({"model": "mock", "prompt": prompt(set, i), "max_tokens": 1});
        let resp = worker.admin("/v1/completions", &body).unwrap();
        assert_eq!(resp.status, 200, "fill {set}/{i}: {}", resp.text());
    }
}

/// One block of a dump: its hash, its parent's, its tokens.
type DumpBlock = (u64, Option<u64>, Vec<u32>);

/// The engine's dump, block by block, and its size in bytes.
fn dump(worker: &Worker) -> (Vec<DumpBlock>, usize) {
    let resp = http::get(&worker.addr, "/kv/dump").unwrap();
    assert_eq!(resp.status, 200);
    let body: Value = resp.json().unwrap();
    let blocks = body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let hashes = e["block_hashes"].as_array().unwrap();
            assert_eq!(hashes.len(), 1, "one block per dump event");
            let tokens = e["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            (
                hashes[0].as_u64().unwrap(),
                e["parent_block_hash"].as_u64(),
                tokens,
            )
        })
        .collect();
    (blocks, resp.body.len())
}

/// The dump's cached sequences: the token prompt of every block chain (parent to leaf), each a
/// whole number of blocks. A probe of one is credited its full length only if every block of its
/// chain is in the index on that worker.
fn chains(blocks: &[DumpBlock]) -> Vec<Vec<u32>> {
    let by_hash: BTreeMap<u64, (Option<u64>, &Vec<u32>)> =
        blocks.iter().map(|(h, p, t)| (*h, (*p, t))).collect();
    let parents: BTreeSet<u64> = blocks.iter().filter_map(|(_, p, _)| *p).collect();
    blocks
        .iter()
        .filter(|(h, _, _)| !parents.contains(h))
        .map(|(leaf, _, _)| {
            let mut path = Vec::new();
            let mut at = Some(*leaf);
            while let Some(h) = at {
                let (parent, tokens) = by_hash[&h];
                path.push(tokens);
                at = parent;
            }
            path.iter().rev().flat_map(|t| t.iter().copied()).collect()
        })
        .collect()
}

/// Every block of the engine's dump is in the index (each chain's prompt is credited its whole
/// length on `worker`) and nothing else is (the index's entries equal the dump's blocks).
fn assert_index_holds_dump(envoy: &Envoy, worker: &Worker, blocks: &[DumpBlock]) {
    assert_eq!(
        envoy.router_stat("index.entries"),
        blocks.len() as u64,
        "index entries = dump blocks"
    );
    let sequences = chains(blocks);
    assert_eq!(sequences.len(), PROMPTS as usize);
    for seq in &sequences {
        let (served, overlap, resp) = route(envoy, &completion(seq));
        assert_eq!(
            (served, overlap),
            (worker.id, seq.len() as u32 / BLOCK),
            "a cached sequence routes to its worker, credited in full ({:?})",
            resp.header("x-kv-router-costs")
        );
    }
}

/// Event replies the filter refused (over the reply limit, or otherwise invalid).
fn refused_pages(envoy: &Envoy) -> u64 {
    envoy.router_stat("events.pages_rejected") + envoy.router_stat("events.pages_too_large")
}

#[test]
fn a_restarted_worker_with_a_full_cache_is_resynced_from_its_dump_at_the_defaults() {
    let mut workers = Worker::spawn_many(2, &ARGS).expect("start engine workers");
    let mut config = filter_config(&workers, json!({}));
    for entry in config["workers"].as_array_mut().unwrap() {
        entry["kv_capacity_blocks"] = json!(KV_BLOCKS);
    }
    let envoy = start_envoy(&workers, config);

    // A first fill of worker 1, followed through its events: the filter's cursor moves on.
    fill(&workers[0], 0);
    let (first, _) = dump(&workers[0]);
    assert_eq!(first.len() as u32, PROMPTS * PROMPT_BLOCKS);
    assert!(
        envoy.wait_for(Duration::from_secs(30), |e| e.router_stat("index.entries")
            == first.len() as u64),
        "the first fill indexed from events: {} of {}",
        envoy.router_stat("index.entries"),
        first.len()
    );

    // The engine restarts and fills its cache with other prompts before any router reads it
    // (its event endpoint and dump answer 500 meanwhile); the filter marks it stale.
    workers[0]
        .restart_with(&["--events-fault", "http_500"])
        .unwrap();
    fill(&workers[0], 1);
    assert!(
        envoy.wait_for(Duration::from_secs(20), |e| e.router_stat("workers.stale")
            == 1),
        "worker 1 stale while its events fail"
    );
    assert_eq!(
        envoy.router_stat("index.entries"),
        0,
        "its old blocks dropped"
    );
    let filled = u64::from(PROMPTS * PROMPT_BLOCKS);

    // Its events return: one dump of the whole cache re-syncs it.
    let resyncs = envoy.router_stat("events.resyncs");
    let failed = envoy.router_stat("events.fetch_failed");
    let refused = refused_pages(&envoy);
    let start = Instant::now();
    workers[0]
        .admin("/admin/events_fault", &json!({"mode": "none"}))
        .unwrap();
    assert!(
        envoy.wait_for(Duration::from_secs(30), |e| e.router_stat("index.entries")
            == filled),
        "re-synced from the dump: {} of {filled} blocks (resyncs {}, refused {})",
        envoy.router_stat("index.entries"),
        envoy.router_stat("events.resyncs") - resyncs,
        refused_pages(&envoy) - refused,
    );
    let resync = start.elapsed();
    let fetch = Instant::now();
    let (full, dump_bytes) = dump(&workers[0]);
    println!(
        "full-cache resync: {} blocks, dump {dump_bytes} bytes (served in {:.0} ms), indexed {:.0} ms after the events returned ({} failed fetches)",
        full.len(),
        fetch.elapsed().as_secs_f64() * 1000.0,
        resync.as_secs_f64() * 1000.0,
        envoy.router_stat("events.fetch_failed") - failed
    );
    assert!(
        envoy.router_stat("events.resyncs") > resyncs,
        "through a dump"
    );
    assert_eq!(refused_pages(&envoy), refused, "nothing refused");
    assert_eq!(envoy.router_stat("workers.stale"), 0);

    // The index holds exactly the dump's blocks, the restart's prompts route to worker 1 by
    // prefix, and the blocks the restart lost are credited nowhere.
    assert_index_holds_dump(&envoy, &workers[0], &full);
    assert_eq!(dump(&workers[0]).0, full, "the probes evicted nothing");
    let (_, lost, _) = route(&envoy, &completion(&prompt(0, 0)));
    assert_eq!(lost, 0, "the first fill's blocks are gone with the restart");
}
