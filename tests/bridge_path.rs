//! The production event path: engine-mode mock workers publish their KV events on ZMQ exactly
//! like vLLM 0.32, one real `kv-event-bridge` per worker turns them into the event page, and the
//! filter inside a real Envoy polls the bridges (`events_address`), never the mocks.
//!
//! Needs `target/release/kv-event-bridge` (or `KV_EVENT_BRIDGE_BIN`); without it these tests fail
//! and say how to build it.
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

/// `count` engine-mode workers publishing on ZMQ, each with its bridge.
fn bridged_workers(count: u64, extra: &[&str]) -> Vec<Worker> {
    let block = BLOCK.to_string();
    let mut args = vec![
        "--mode",
        "engine",
        "--block-size",
        &block,
        "--speedup",
        "20",
    ];
    args.extend_from_slice(extra);
    Worker::spawn_many_bridged(count, BLOCK, &args).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs a completion on `worker` directly (not through Envoy): the filter learns of its blocks
/// only from the worker's events.
fn run_on(worker: &Worker, prompt: &[u32], max_tokens: u32) {
    let resp = http::post_json(
        &worker.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens}),
    )
    .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
}

/// A completion pinned to `worker`: its overlap header is that worker's overlap, and running it
/// there stores nothing new (the worker already holds the prompt).
fn pinned(worker: u64, prompt: &[u32]) -> Value {
    json!({"model": "mock", "prompt": prompt, "max_tokens": 1,
           "nvext": {"backend_instance_id": worker}})
}

fn bridge_metric(worker: &Worker, name: &str, labels: &[(&str, &str)]) -> u64 {
    let bridge = worker.bridge.as_ref().unwrap();
    let text = http::get(&bridge.addr, "/metrics").unwrap().text();
    envoy_kv_router_tools::prom::sum(&text, name, labels).unwrap_or(0.0) as u64
}

#[test]
fn a_shared_prefix_is_routed_to_the_worker_holding_it_via_the_bridge() {
    let workers = bridged_workers(2, &[]);
    // Events only: the wait below must prove the bridge's events arrived, not the probes' own
    // predicted blocks.
    let config = events_only(filter_config(
        &workers,
        json!({"mode": "kv", "block_size": BLOCK}),
    ));
    for (entry, w) in config["workers"].as_array().unwrap().iter().zip(&workers) {
        assert_eq!(entry["events_address"], w.bridge.as_ref().unwrap().addr);
        assert_ne!(entry["events_address"], entry["address"]);
    }
    let envoy = start_envoy(&workers, config);

    // Each worker computes its own 8-block prefix; only its events (via its bridge) tell the
    // filter.
    let prefixes: Vec<Vec<u32>> = (0..2u32)
        .map(|i| tokens(100_000 * (i + 1), 8 * BLOCK))
        .collect();
    for (w, prefix) in workers.iter().zip(&prefixes) {
        run_on(w, prefix, 1);
    }
    for (w, prefix) in workers.iter().zip(&prefixes) {
        assert!(
            wait_for_overlap(&envoy, &pinned(w.id, prefix), 8, Duration::from_secs(20)),
            "worker {}'s stored blocks reached the filter through its bridge",
            w.id
        );
    }

    // A new request sharing a prefix goes to the worker that holds it, with the whole prefix as
    // overlap; the other worker's cost is higher.
    for (i, (w, prefix)) in workers.iter().zip(&prefixes).enumerate() {
        let suffix = tokens(900_000 + 1000 * i as u32, 3 * BLOCK);
        let body = completion(&[prefix.clone(), suffix].concat());
        let (worker, overlap, resp) = route(&envoy, &body);
        assert_eq!(worker, w.id, "prefix {i}");
        assert_eq!(overlap, 8, "prefix {i}");
        let costs = costs(&resp);
        let other = workers.iter().find(|o| o.id != w.id).unwrap().id;
        assert!(costs[&w.id] < costs[&other], "{costs:?}");
    }

    // The filter polls the bridges' event pages.
    for w in &workers {
        let deadline = Instant::now() + Duration::from_secs(10);
        while bridge_metric(
            w,
            "kv_bridge_page_requests_total",
            &[("path", "/kv/events")],
        ) == 0
        {
            assert!(
                Instant::now() < deadline,
                "the filter does not poll worker {}'s bridge",
                w.id
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `(dp_rank, medium, hash, parent, tokens)` of a cached block.
type DumpBlock = (u64, String, u64, Option<u64>, Vec<u64>);

/// Every block of a dump (runs of blocks, or one block per event).
fn dump_blocks(dump: &Value) -> BTreeSet<DumpBlock> {
    let mut out = BTreeSet::new();
    for run in dump["events"].as_array().unwrap() {
        let tokens: Vec<u64> = run["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        let mut parent = run["parent_block_hash"].as_u64();
        for (i, h) in run["block_hashes"].as_array().unwrap().iter().enumerate() {
            let h = h.as_u64().unwrap();
            let block = tokens[i * BLOCK as usize..(i + 1) * BLOCK as usize].to_vec();
            out.insert((
                run["dp_rank"].as_u64().unwrap(),
                run["medium"].as_str().unwrap().to_string(),
                h,
                parent,
                block,
            ));
            parent = Some(h);
        }
    }
    out
}

/// Polls until the bridge's dump holds exactly the worker's cache, or fails with both.
fn assert_bridge_mirrors_worker(w: &Worker, what: &str) {
    let bridge = w.bridge.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let theirs = dump_blocks(&http::get(&w.addr, "/kv/dump").unwrap().json().unwrap());
        let ours = dump_blocks(&http::get(&bridge.addr, "/kv/dump").unwrap().json().unwrap());
        if ours == theirs {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the bridge's dump differs from the worker's\n\
             only in the worker: {:?}\nonly in the bridge: {:?}",
            theirs.difference(&ours).collect::<Vec<_>>(),
            ours.difference(&theirs).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_bridge_mirrors_the_engine_cache_through_eviction_offload_and_reset() {
    // 24 device blocks and an 8-block host tier, DP rank 3: stores, offloads (CPU), evictions
    // and a reset all travel mock -> ZMQ -> bridge.
    let workers = bridged_workers(
        1,
        &[
            "--kv-blocks",
            "24",
            "--host-kv-blocks",
            "8",
            "--dp-rank",
            "3",
        ],
    );
    let w = &workers[0];
    assert_bridge_mirrors_worker(w, "empty");
    for round in 0..6u32 {
        run_on(w, &tokens(10_000 * (round + 1), 8 * BLOCK), 3);
    }
    let dump = http::get(&w.addr, "/kv/dump").unwrap().json().unwrap();
    let media: BTreeSet<String> = dump_blocks(&dump).into_iter().map(|b| b.1).collect();
    assert_eq!(
        media,
        BTreeSet::from(["CPU".to_string(), "GPU".to_string()]),
        "the workload fills both tiers"
    );
    assert!(dump_blocks(&dump).iter().all(|b| b.0 == 3), "DP rank 3");
    assert_bridge_mirrors_worker(w, "after evictions and offloads");
    let removed = bridge_metric(
        w,
        "kv_bridge_engine_events_total",
        &[("type", "BlockRemoved")],
    );
    assert!(removed > 0, "evictions were published");

    http::post_json(&w.addr, "/admin/reset", &json!({})).unwrap();
    assert_bridge_mirrors_worker(w, "after a reset");
    run_on(w, &tokens(77_000, 4 * BLOCK), 1);
    assert_bridge_mirrors_worker(w, "after a store following the reset");
    let dump = http::get(&w.bridge.as_ref().unwrap().addr, "/kv/dump")
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(dump_blocks(&dump).len(), 4);
}

/// Each event poll declares what this Envoy has booked on the worker (`router=`, `booked=`), and
/// the bridge relays it to the other routers polling it (`load.other_routers`), which replicas
/// add to their own view with `load.unseen_traffic: relayed`. Alone, the Envoy keeps its plain
/// tick; once another router declares to the bridge, its poller also ticks in between to relay
/// (`events.relay_ticks`).
#[test]
fn the_filter_declares_its_bookings_to_the_bridge_for_the_other_replicas() {
    // A slow engine (~0.2 s a decode step): a 16-token answer stays in flight for seconds.
    let block = BLOCK.to_string();
    let args = [
        "--mode",
        "engine",
        "--block-size",
        &block,
        "--speedup",
        "0.05",
    ];
    let workers = Worker::spawn_many_bridged(1, BLOCK, &args).unwrap_or_else(|e| panic!("{e}"));
    let envoy = start_envoy(
        &workers,
        filter_config(&workers, json!({"block_size": BLOCK})),
    );
    let bridge = workers[0].bridge.as_ref().unwrap().addr.clone();
    // Alone: a request routed and answered (a few hundred ms of ticks), its booking released,
    // and no relay tick meanwhile.
    let short = json!({"model": "m", "prompt": tokens(3, 2 * BLOCK), "max_tokens": 1});
    let answer = envoy.post_json("/v1/completions", &short).unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(envoy.wait_for(Duration::from_secs(15), |e| {
        e.router_stat("load.active_entries") == 0
    }));
    assert_eq!(envoy.router_stat("events.relay_ticks"), 0, "alone");
    // Another router's poll, as a second Envoy's would be.
    let others = || {
        let page: Value = http::get(&bridge, "/kv/events?after=0&router=ff&booked=0,0,0")
            .unwrap()
            .json()
            .unwrap();
        page["load"]["other_routers"].clone()
    };
    let body = json!({"model": "m", "prompt": tokens(7, 4 * BLOCK), "stream": true,
                      "max_tokens": 16});
    let listener = envoy.listener.clone();
    let long = std::thread::spawn(move || {
        let mut s = stream_completion(&listener, &body).expect("stream");
        while let Ok(Some(_)) = s.next_event() {}
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    let declared = loop {
        let o = others();
        if o["requests"] == 1 {
            break o;
        }
        assert!(
            Instant::now() < deadline,
            "no declaration reached the bridge: {o}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        declared["decode_blocks"].as_f64().unwrap() > 0.0,
        "{declared}"
    );
    // The other router's declarations reach the Envoy with its next page: it relays between
    // ticks from then on (while the other router keeps polling, as it does here).
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| {
            others();
            e.router_stat("events.relay_ticks") >= 10
        }),
        "relay ticks: {}",
        envoy.router_stat("events.relay_ticks")
    );
    long.join().unwrap();
    // Once the answer is over, the Envoy's next poll declares nothing in flight.
    let deadline = Instant::now() + Duration::from_secs(15);
    while others()["requests"] != 0 {
        assert!(
            Instant::now() < deadline,
            "the release was never declared: {}",
            others()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
