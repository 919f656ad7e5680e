//! Load-gated prefix affinity and the predicted-TTFT policy through a real Envoy: a follow-up
//! request goes back to the worker holding its history although that worker's decode load makes
//! the Dynamo cost send it away.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

const BLOCK: u32 = 16;

/// Worker 1 holds a 64-block history (its events) and streams one long unrelated request
/// (200 blocks of decode load, past its first token); worker 2 is idle. Returns who serves the
/// 68-block follow-up (history + 4 new blocks), its overlap and the costs reported.
fn follow_up(extra: Value) -> Vec<(u64, u32, u32, std::collections::BTreeMap<u64, f64>)> {
    let workers = echo_workers(2, BLOCK);
    // The seed's Dynamo cost, or the predicted-TTFT policy when `extra` configures `ttft`: each
    // test's subject.
    let policy = if extra.get("ttft").is_some() {
        json!({"block_size": BLOCK, "mode": "kv", "policy": "predicted"})
    } else {
        json!({"block_size": BLOCK, "mode": "kv", "policy": "dynamo"})
    };
    // Events only: worker 1 alone holds the history (the probes' and the follow-ups' own
    // predicted blocks would put it on worker 2 too).
    let mut config = events_only(filter_config(&workers, policy));
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    let envoy = start_envoy_with(&workers, config, |o| o.concurrency = 2);
    let history = tokens(1, 64 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(&history, BLOCK, None, 100, "GPU")],
    );
    assert!(wait_for_overlap(
        &envoy,
        &completion(&history),
        64,
        Duration::from_secs(5)
    ));
    let held_body = json!({"model": "m", "prompt": tokens(50_000, 200 * BLOCK), "stream": true,
        "max_tokens": 2, "nvext": {"backend_instance_id": 1},
        "mock": {"chunks": 2, "chunk_interval_ms": 4000}});
    let mut held = stream_completion(&envoy.listener, &held_body).expect("held request");
    let _ = held.next_event();
    assert!(envoy.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("worker.1.rank.0.decode_blocks") >= 200
            && e.router_stat("worker.1.rank.0.prefill_tokens") == 0
    }));
    let mut prompt = history.clone();
    prompt.extend(tokens(90_000, 4 * BLOCK));
    let out = (0..5)
        .map(|_| {
            let (w, overlap, resp) = route(&envoy, &completion(&prompt));
            let max_overlap = resp
                .header("x-kv-router-max-overlap-blocks")
                .and_then(|v| v.parse().ok())
                .expect("x-kv-router-max-overlap-blocks");
            (w, overlap, max_overlap, costs(&resp))
        })
        .collect();
    held.abort();
    out
}

#[test]
fn affinity_keeps_a_conversation_on_its_history_despite_decode_load() {
    // The Dynamo cost: worker 1 = 4 uncached + 204 decode blocks = 208, worker 2 = 68 + 68 = 136.
    // The index knew the 64-block history: the miss is a load trade-off, not a missing entry.
    for (w, overlap, max_overlap, c) in follow_up(json!({})) {
        assert_eq!((w, overlap, max_overlap), (2, 0, 64), "costs {c:?}");
        assert_eq!(c.get(&1), Some(&208.0));
        assert_eq!(c.get(&2), Some(&136.0));
    }
    // With affinity at its defaults: worker 1 has 1 more request in flight (margin 4) and less
    // prefill work (64 vs 1088 tokens), so the history wins; the costs reported are unchanged.
    for (w, overlap, max_overlap, c) in follow_up(json!({"affinity": {}})) {
        assert_eq!((w, overlap, max_overlap), (1, 64, 64), "costs {c:?}");
        assert_eq!(c.get(&1), Some(&208.0));
    }
    // A margin of 0 extra requests: the busier holder is given up again.
    for (w, _, _, _) in follow_up(json!({"affinity": {"max_extra_requests": 0}})) {
        assert_eq!(w, 2);
    }
}

#[test]
fn predicted_ttft_keeps_the_conversation_on_its_history() {
    // `ttft`: worker 1 computes the 4 new blocks (64 tokens after the 1,024 cached, which they
    // attend to: 16.5 + 0.0152 * 64 + 4.21e-7 * (1088^2 - 1024^2) = 17.530 ms) plus one decode
    // step of its streaming request (5.74 ms) = 23.270 ms; idle
    // worker 2 computes all 1,088 tokens: 33.536 ms. The history wins, and the headers report
    // the predictions in ms (the polynomials' own: `learn` off, else the held request's first
    // token would scale worker 1's; `compute_weight` 0, else the adaptive weight, from the held
    // request over the probes' ~1 ms lifetimes, would add a compute term to each).
    let ttft = json!({"learn": false, "compute_weight": 0.0});
    for (w, overlap, max_overlap, c) in follow_up(json!({ "ttft": ttft })) {
        assert_eq!((w, overlap, max_overlap), (1, 64, 64), "predictions {c:?}");
        assert_eq!(c.get(&1), Some(&23.27));
        assert_eq!(c.get(&2), Some(&33.536));
    }
}
