//! A fleet of 400 worker entries behind one Envoy: the poller's replies are appended a tick at a
//! time, so the 64-slot log ring never laps (no VM loses sync or needs the snapshot) and routing
//! follows the events as with a few workers.
//!
//! The entries share 4 mock workers (entry `k` is mock `k % 4 + 1`): each entry is polled on its
//! own, so the filter sees 400 workers' worth of poll replies (about 200 per 50 ms tick).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;

use common::*;
use envoy_kv_router::config::LoadConfig;
use envoy_kv_router::prefill_work::prefill_work_tokens;
use serde_json::{json, Value};
use std::time::Duration;

const BLOCK: u32 = 16;
const ENTRIES: usize = 400;

/// 4 mock workers behind `ENTRIES` worker entries (entry `k` is mock `k % 4 + 1`), in `kv`
/// mode with response headers, `extra` merged into the configuration; `on_events`: every entry
/// on `"kv_mode": "events"` ([`events_only`]).
fn four_hundred_entries(extra: Value, on_events: bool) -> (Vec<Worker>, Envoy) {
    let mocks = echo_workers(4, BLOCK);
    let entries: Vec<Value> = (0..ENTRIES)
        .map(|k| json!({"id": k + 1, "address": mocks[k % 4].addr}))
        .collect();
    let mut config = json!({"mode": "kv", "block_size": BLOCK, "workers": entries,
                            "response_headers": true});
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    if on_events {
        config = events_only(config);
    }
    let envoy = start_envoy(&mocks, config);
    (mocks, envoy)
}

#[test]
fn four_hundred_workers_keep_every_replica_in_step() {
    // Events only: the prefix is where the events put it (a probe routed elsewhere before the
    // event lands would be predicted there).
    let (mocks, envoy) = four_hundred_entries(json!({}), true);
    // At least 10 polls of every entry, all appended to the log.
    assert!(
        envoy.wait_for(Duration::from_secs(30), |e| e
            .router_stat("log.replies_batched")
            >= 10 * ENTRIES as u64),
        "replies appended: {}",
        envoy.router_stat("log.replies_batched")
    );
    let prompt = tokens(500_000, 4 * BLOCK);
    let body = completion(&prompt);
    publish(
        &mocks[1],
        vec![vllm_stored(&prompt, BLOCK, None, 77, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 4, Duration::from_secs(10)));
    for i in 0..20 {
        let (served, overlap, _) = route(&envoy, &body);
        assert_eq!(
            (served, overlap),
            (2, 4),
            "request {i}: the mock holding the prefix"
        );
    }
    assert_eq!(
        envoy.router_stat("log.lost_sync"),
        0,
        "no VM fell a ring behind"
    );
    assert_eq!(envoy.router_stat("log.snapshot_loaded"), 0);
    assert_eq!(envoy.router_stat("workers.marked_stale"), 0);
}

/// The load table of 400 entries spans four shard keys: a request pinned to an entry in the
/// third shard is booked there (its gauge, no other), and its release leaves no load anywhere.
#[test]
fn a_request_past_the_first_load_shard_is_booked_and_released_there() {
    // Exact booked prefill tokens: the load model `none` (nothing decays before the first token).
    let (_mocks, envoy) = four_hundred_entries(
        json!({"client_routing_hints": "honor", "load": {"prefill_load_model": "none"}}),
        false,
    );
    let pinned = 301;
    let body = json!({"model": "m", "prompt": tokens(1, 50 * BLOCK), "stream": true,
        "max_tokens": 2, "nvext": {"backend_instance_id": pinned},
        "mock": {"first_token_delay_ms": 3000, "chunks": 2, "chunk_interval_ms": 100}});
    let listener = envoy.listener.clone();
    let held = std::thread::spawn(move || {
        let mut s = stream_completion(&listener, &body).expect("pinned request");
        while let Ok(Some(_)) = s.next_event() {}
    });
    let gauge = format!("worker.{pinned}.rank.0.prefill_tokens");
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat(&gauge) > 0),
        "the booking shows on entry {pinned}"
    );
    // No prefix cached anywhere: the prefill work of 800 tokens from scratch at the default
    // polynomial, 50 decode blocks, 1 request (the load model is `none`, see above).
    let poly = &LoadConfig::default().prefill_time_ms_poly;
    let work = prefill_work_tokens(poly, f64::from(50 * BLOCK), 0.0).round() as u64;
    assert!(work > 800 && work < 820, "{work}");
    assert_eq!(envoy.router_stat(&gauge), work);
    assert_eq!(
        total_load(&envoy),
        (work + 50 + 1, 1),
        "booked on entry {pinned} only"
    );
    held.join().expect("pinned request");
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| total_load(e) == (0, 0)),
        "load left after the release: {:?}",
        total_load(&envoy)
    );
    assert_eq!(envoy.router_stat("load.release_unknown"), 0);
}
