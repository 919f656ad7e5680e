//! Text and chat requests through a real Envoy: exact ids from the tokenizer service (the mock's
//! render endpoints), the fallback when it fails, and approximate mode (the filter's own
//! decisions as predicted blocks).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

fn config_with(workers: &[Worker], extra: Value, kv_mode: Option<&str>) -> Value {
    let mut base = json!({"mode": "kv", "block_size": BLOCK});
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    let mut config = filter_config(workers, base);
    if let Some(mode) = kv_mode {
        for w in config["workers"].as_array_mut().unwrap() {
            w["kv_mode"] = json!(mode);
        }
    }
    config
}

fn chat(system: &str, user: &str, mock: Value) -> Value {
    json!({"model": "mock", "max_tokens": 4, "mock": mock, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

fn long_text(seed: u32, chars: usize) -> String {
    let mut s = String::new();
    let mut i = seed;
    while s.len() < chars {
        s.push_str(&format!("word{i} "));
        i = i.wrapping_mul(31).wrapping_add(7) % 100_000;
    }
    s.truncate(chars);
    s
}

/// Sends a chat body; returns (worker, overlap blocks, reason).
fn send_chat(envoy: &Envoy, body: &Value) -> (u64, u32, String) {
    let resp = envoy
        .post_json("/v1/chat/completions", body)
        .expect("chat request");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let overlap = resp
        .header("x-kv-router-overlap-blocks")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let reason = resp.header("x-kv-router-reason").unwrap_or("").to_string();
    (served_by(&resp).expect("x-worker-id"), overlap, reason)
}

#[test]
fn chat_is_routed_with_exact_ids_from_render() {
    let workers = echo_workers(3, BLOCK);
    let tokenizer = json!({"cluster": "kv_events", "address": workers[0].addr, "timeout_ms": 5000});
    // Events only: the overlap is worker 2's events' (a probe predicted on another worker would
    // give that worker the same prefix).
    let envoy = start_envoy(
        &workers,
        config_with(&workers, json!({"tokenizer": tokenizer}), Some("events")),
    );
    let body = chat(&long_text(1, 900), "what is the answer?", json!({}));
    // The exact prompt ids, as the engine's render endpoint gives them.
    let rendered =
        http::post_json(&workers[0].addr, "/v1/chat/completions/render", &body).expect("render");
    assert_eq!(rendered.status, 200, "{}", rendered.text());
    let ids: Vec<u32> = serde_json::from_str::<Value>(&rendered.text()).unwrap()["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let blocks = ids.len() as u32 / BLOCK;
    assert!(blocks >= 10, "{} ids", ids.len());
    // Worker 2 served the same prompt as token ids earlier and cached it.
    let cached = &ids[..(blocks * BLOCK) as usize];
    publish(
        &workers[1],
        vec![vllm_stored(cached, BLOCK, None, 100, "GPU")],
    );
    assert!(wait_for_overlap(
        &envoy,
        &completion(&ids),
        blocks,
        Duration::from_secs(5)
    ));
    // The chat request: rendered to the same ids, so its overlap is the whole prefix.
    let (worker, overlap, reason) = send_chat(&envoy, &body);
    assert_eq!(reason, "kv-render");
    assert_eq!((worker, overlap), (2, blocks));
    assert_eq!(envoy.router_stat("tokenizer.calls"), 1);
    // Repeats: each VM (one per Envoy worker thread, 2 here) renders the prompt at most once,
    // then serves it from its cache.
    for _ in 0..10 {
        let (worker, overlap, reason) = send_chat(&envoy, &body);
        assert_eq!((worker, overlap, reason.as_str()), (2, blocks, "kv-render"));
    }
    let calls = envoy.router_stat("tokenizer.calls");
    assert!((1..=2).contains(&calls), "{calls}");
    assert_eq!(envoy.router_stat("tokenizer.cache_hit"), 11 - calls);
    // Per-request counters reach the host on the VM's tick.
    assert!(envoy.wait_for(Duration::from_secs(5), |e| e
        .router_stat("routed.kv-render")
        == 11));
}

#[test]
fn render_timeout_and_errors_fall_back_to_text_with_the_reason() {
    let workers = echo_workers(2, BLOCK);
    let tokenizer = json!({"cluster": "kv_events", "address": workers[0].addr, "timeout_ms": 300});
    let config = config_with(
        &workers,
        json!({"tokenizer": tokenizer, "approximate": {}}),
        None,
    );
    let envoy = start_envoy(&workers, config);
    let slow = chat(&long_text(2, 300), "hi", json!({"render_delay_ms": 3000}));
    let (_, _, reason) = send_chat(&envoy, &slow);
    assert_eq!(reason, "kv-text:render_timeout");
    let failing = chat(&long_text(3, 300), "hi", json!({"render_status": 500}));
    let (_, _, reason) = send_chat(&envoy, &failing);
    assert_eq!(reason, "kv-text:render_error");
    assert_eq!(envoy.router_stat("tokenizer.fallback.render_timeout"), 1);
    assert_eq!(envoy.router_stat("tokenizer.fallback.render_error"), 1);
    // Per-request counters reach the host on the VM's tick.
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("routed.kv-text")
            == 2)
    );
    // A tokenizer nobody listens on: routed by text too; without approximate mode (workers on
    // `events`), on load alone.
    let dead = json!({"cluster": "kv_events", "address": "127.0.0.1:1", "timeout_ms": 300});
    let envoy = start_envoy(
        &workers,
        config_with(&workers, json!({"tokenizer": dead}), Some("events")),
    );
    let (_, _, reason) = send_chat(&envoy, &chat("sys", "hi", json!({})));
    assert_eq!(reason, "kv-text-only:render_error");
}

#[test]
fn approximate_entries_expire_after_their_ttl() {
    let workers = echo_workers(3, BLOCK);
    let config = config_with(
        &workers,
        json!({"approximate": {"ttl_ms": 1500}, "tick_ms": 20}),
        Some("approximate"),
    );
    let envoy = start_envoy(&workers, config);
    let body = chat(&long_text(4, 2000), "question", json!({}));
    let chunks = 2000 / (4 * BLOCK); // the system prompt's whole text chunks, at least
    let (first, overlap, reason) = send_chat(&envoy, &body);
    assert_eq!((overlap, reason.as_str()), (0, "kv-text"));
    let (again, overlap, _) = send_chat(&envoy, &body);
    assert_eq!(again, first, "the predicted prefix attracts the repeat");
    assert!(overlap >= chunks, "{overlap} < {chunks}");
    // Both decisions expire; then the same prompt finds nothing predicted.
    let deadline = Instant::now() + Duration::from_secs(10);
    let gauge = "wasmcustom.kv_router.approx.entries";
    let mut seen_entries = false;
    while Instant::now() < deadline {
        match envoy.stats().get(gauge) {
            Some(0) if seen_entries => break,
            Some(n) if *n > 0 => seen_entries = true,
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(seen_entries);
    assert_eq!(envoy.stats().get(gauge), Some(&0), "entries expired");
    let (_, overlap, _) = send_chat(&envoy, &body);
    assert_eq!(overlap, 0);
}

/// 20 requests sharing a new prefix, sent within one event interval (events arrive every 5 s):
/// with predicted entries they stay on one worker; on events alone nothing is known yet and
/// they spread over the tied workers.
#[test]
fn a_burst_sharing_a_new_prefix_lands_on_one_worker_with_predictions() {
    let workers = echo_workers(4, BLOCK);
    let events = json!({"poll_interval_ms": 5000, "stale_after_ms": 30000});
    let prefix = tokens(90_000, 12 * BLOCK);
    let burst = |envoy: &Envoy| -> BTreeSet<u64> {
        (0..20u32)
            .map(|i| {
                let mut prompt = prefix.clone();
                prompt.extend(tokens(200_000 + i * 100, BLOCK));
                route(envoy, &completion(&prompt)).0
            })
            .collect()
    };
    let with = start_envoy(
        &workers,
        config_with(
            &workers,
            json!({"events": events}),
            Some("events+approximate"),
        ),
    );
    let on = burst(&with);
    assert_eq!(on.len(), 1, "{on:?}");
    assert!(with.router_stat("approx.published") >= 20);
    drop(with);
    let without = start_envoy(
        &workers,
        config_with(&workers, json!({"events": events}), Some("events")),
    );
    let on = burst(&without);
    assert!(on.len() >= 2, "{on:?}");
    assert_eq!(without.router_stat("approx.published"), 0);
}

/// A prediction ends when the worker's events speak for its blocks: after a repeat of a prompt
/// is predicted whole on its worker, the worker reports the prompt stored (the predictions give
/// way to the index) and its second half removed; the next repeat finds only the first half.
#[test]
fn a_prediction_ends_when_the_worker_reports_its_blocks_removed() {
    let workers = echo_workers(3, BLOCK);
    let events = json!({"poll_interval_ms": 50, "stale_after_ms": 30000});
    let config = config_with(
        &workers,
        json!({"events": events, "tick_ms": 20}),
        Some("events+approximate"),
    );
    // One worker thread: the thread that routes is the one whose predictions are checked.
    let envoy = start_envoy_with(&workers, config, |o| o.concurrency = 1);
    // The poller's first contact with each worker is its (empty) dump: wait for all three, so
    // the events below arrive as events, not folded into a later dump.
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("events.resyncs")
            >= 3)
    );
    let prompt = tokens(300_000, 8 * BLOCK);
    let (chosen, overlap, _) = route(&envoy, &completion(&prompt));
    assert_eq!(overlap, 0);
    let (again, overlap, _) = route(&envoy, &completion(&prompt));
    assert_eq!(
        (again, overlap),
        (chosen, 8),
        "the whole prompt is predicted on its worker"
    );
    let worker = workers
        .iter()
        .find(|w| w.id == chosen)
        .expect("chosen worker");
    publish(
        worker,
        vec![
            vllm_stored(&prompt, BLOCK, None, 700, "GPU"),
            vllm_removed(&[704, 705, 706, 707], "GPU"),
        ],
    );
    let settled = |e: &Envoy| e.router_stat("approx.confirmed") + e.router_stat("approx.refuted");
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| settled(e) >= 8
            && e.router_stat("events.removed") >= 1),
        "settled: {}",
        settled(&envoy)
    );
    let (after, overlap, _) = route(&envoy, &completion(&prompt));
    assert_eq!(
        (after, overlap),
        (chosen, 4),
        "blocks 4-7 are gone from the worker"
    );
}

#[test]
fn a_multi_turn_chat_sent_as_text_stays_on_its_history_at_the_defaults() {
    // Nothing configured but the workers: no tokenizer, no `approximate`, default block size.
    let workers = echo_workers(4, 64);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));
    // Four conversations, turns interleaved; each turn resends the whole history.
    let mut histories: Vec<Vec<Value>> = (0..4u32)
        .map(|c| vec![json!({"role": "system", "content": long_text(100 + c, 6000)})])
        .collect();
    let mut homes: Vec<Option<u64>> = vec![None; 4];
    for turn in 0..5u32 {
        for (c, history) in histories.iter_mut().enumerate() {
            history
                .push(json!({"role": "user", "content": long_text(1000 * turn + c as u32, 400)}));
            let body = json!({"model": "mock", "max_tokens": 4, "messages": history});
            let (worker, overlap, reason) = send_chat(&envoy, &body);
            assert!(
                reason.starts_with("kv-text"),
                "turn {turn} of {c}: {reason}"
            );
            match homes[c] {
                None => homes[c] = Some(worker),
                Some(home) => {
                    assert_eq!(
                        worker, home,
                        "conversation {c} left its history at turn {turn}"
                    );
                    assert!(overlap > 0, "turn {turn} of {c} found no history");
                }
            }
            history
                .push(json!({"role": "assistant", "content": long_text(7 * turn + c as u32, 300)}));
        }
    }
}
