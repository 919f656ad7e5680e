//! `engine_priority` in a real Envoy: the filter writes each routed request's predicted prefill
//! as its `priority`, and an engine that schedules by priority (the mock engine, as vLLM with
//! `--scheduling-policy priority`) serves a short prompt queued behind a long one first.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const BLOCK: u32 = 64;

/// One engine-mode worker that schedules by priority, slowed so that a 24k-token prompt keeps it
/// busy for ~2.5 s (three 8,192-token steps of ~845 ms).
fn priority_engine() -> Worker {
    Worker::spawn(
        1,
        &[
            "--mode",
            "engine",
            "--block-size",
            "64",
            "--speedup",
            "0.2",
            "--scheduling-policy",
            "priority",
        ],
    )
    .expect("start the engine-mode worker")
}

/// The engine's own queue: (waiting, running), from its event page's `load`.
fn engine_queue(worker: &Worker) -> (u64, u64) {
    let page = http::request(
        &worker.addr,
        "GET",
        "/kv/events?after=0",
        &[],
        b"",
        Duration::from_secs(5),
    )
    .ok()
    .and_then(|r| serde_json::from_slice::<Value>(&r.body).ok())
    .unwrap_or(Value::Null);
    let n = |k: &str| page["load"][k].as_u64().unwrap_or(0);
    (n("num_waiting"), n("num_running"))
}

fn wait_for_queue(worker: &Worker, want: (u64, u64)) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine_queue(worker) != want {
        assert!(
            Instant::now() < deadline,
            "the engine's queue never reached {want:?}: {:?}",
            engine_queue(worker)
        );
        std::thread::yield_now();
    }
}

fn streamed(first_token: u32, count: u32) -> Value {
    json!({"model": "m", "prompt": tokens(first_token, count), "max_tokens": 2, "stream": true})
}

/// When the first streamed token of `body` arrived, read on its own thread.
fn first_token_at(listener: &str, body: &Value) -> std::thread::JoinHandle<(u16, Option<Instant>)> {
    let mut stream = stream_completion(listener, body).expect("send");
    std::thread::spawn(move || {
        let status = stream.status;
        let at = stream.next_event().ok().flatten().map(|e| e.at);
        (status, at)
    })
}

/// Sends a 24k-token prompt, then (once the engine runs it) a 16k-token one, then (once that
/// one waits) a 2-block one; returns whether the short one's first token came a step (~845 ms)
/// or more before the long one's. In arrival order the short one is admitted with what the long
/// one's last chunk leaves of that step's budget: both first tokens come from the same step.
fn short_overtakes_long(envoy: &Envoy, worker: &Worker, seed: u32) -> bool {
    let running = first_token_at(&envoy.listener, &streamed(seed, 375 * BLOCK));
    wait_for_queue(worker, (0, 1));
    let long = first_token_at(&envoy.listener, &streamed(seed + 100_000, 250 * BLOCK));
    wait_for_queue(worker, (1, 1));
    let short = first_token_at(&envoy.listener, &streamed(seed + 200_000, 2 * BLOCK));
    wait_for_queue(worker, (2, 1));
    let results: Vec<(u16, Option<Instant>)> = [running, long, short]
        .into_iter()
        .map(|h| h.join().expect("reader"))
        .collect();
    for (status, at) in &results {
        assert_eq!(*status, 200, "{results:?}");
        assert!(at.is_some(), "every request streams a token: {results:?}");
    }
    match (results[2].1, results[1].1) {
        (Some(short), Some(long)) => short + Duration::from_millis(400) < long,
        _ => false,
    }
}

#[test]
fn a_short_prompt_is_served_before_a_long_one_queued_ahead_of_it() {
    let worker = priority_engine();
    let workers = [worker];
    let config = |priority: bool| {
        let mut c = filter_config(&workers, json!({"mode": "kv", "ttft": {}}));
        if priority {
            c["engine_priority"] = json!({});
        }
        c
    };

    // Without the option every request has priority 0: the engine serves in arrival order.
    let envoy = start_envoy(&workers, config(false));
    assert!(
        !short_overtakes_long(&envoy, &workers[0], 1),
        "arrival order without engine_priority"
    );
    drop(envoy);

    // With it, the short prompt's predicted prefill is the lowest priority value.
    let envoy = start_envoy(&workers, config(true));
    assert!(
        short_overtakes_long(&envoy, &workers[0], 1_000_000),
        "the short prompt goes first with engine_priority"
    );
    assert!(envoy.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("engine_priority.written") == 3
    }));
    assert_eq!(envoy.router_stat("engine_priority.unwritten"), 0);
}

#[test]
fn an_engine_in_arrival_order_refuses_the_priority_and_says_so() {
    // The option needs engines that schedule by priority: vLLM (and the mock) answer 400 to a
    // priority on an engine in arrival order, and the error says what to change.
    let worker = Worker::spawn(1, &["--mode", "engine", "--block-size", "64"]).expect("worker");
    let workers = [worker];
    let envoy = start_envoy(
        &workers,
        filter_config(&workers, json!({"mode": "kv", "engine_priority": {}})),
    );
    let resp = http::request(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[],
        completion(&tokens(1, 4 * BLOCK)).to_string().as_bytes(),
        Duration::from_secs(10),
    )
    .expect("request");
    assert_eq!(resp.status, 400);
    let body = String::from_utf8_lossy(&resp.body);
    assert!(body.contains("--scheduling-policy priority"), "{body}");
}

#[test]
fn the_priority_is_written_after_the_tokenizer_renders_a_text_prompt() {
    // A text or chat prompt is held while the tokenizer callout renders it, and routed in the
    // callout's answer: the priority goes into the held body there. An engine in arrival order
    // answering 400 shows that it arrived; one scheduling by priority serves it.
    for (policy, status) in [("fcfs", 400), ("priority", 200)] {
        let worker = Worker::spawn(
            1,
            &[
                "--mode",
                "engine",
                "--block-size",
                "64",
                "--scheduling-policy",
                policy,
            ],
        )
        .expect("worker");
        let workers = [worker];
        let tokenizer =
            json!({"cluster": "kv_events", "address": workers[0].addr, "timeout_ms": 5000});
        let envoy = start_envoy(
            &workers,
            filter_config(
                &workers,
                json!({"mode": "kv", "block_size": BLOCK, "tokenizer": tokenizer,
                       "engine_priority": {}}),
            ),
        );
        let text = "a prompt long enough for several blocks ".repeat(40);
        let completion = json!({"model": "m", "max_tokens": 2, "prompt": text});
        let chat = json!({"model": "m", "max_tokens": 2,
                          "messages": [{"role": "user", "content": text}]});
        for (path, body) in [
            ("/v1/completions", &completion),
            ("/v1/chat/completions", &chat),
        ] {
            let resp = envoy.post_json(path, body).expect("request");
            assert_eq!(resp.status, status, "{policy} {path}: {}", resp.text());
            assert_eq!(
                resp.header("x-kv-router-reason"),
                Some("kv-render"),
                "{policy} {path}"
            );
            if status == 400 {
                assert!(
                    resp.text().contains("--scheduling-policy priority"),
                    "{path}"
                );
            }
        }
        assert!(
            envoy.wait_for(Duration::from_secs(5), |e| {
                e.router_stat("engine_priority.written") == 2
            }),
            "{policy}: written {}",
            envoy.router_stat("engine_priority.written")
        );
        assert_eq!(
            envoy.router_stat("engine_priority.unwritten"),
            0,
            "{policy}"
        );
    }
}

#[test]
fn a_request_routed_by_the_fallback_rule_is_served_after_the_priced_ones() {
    // Bodies over `max_body_bytes` (here the two long prompts) are routed unread. Without a
    // priority the engine would admit the waiting long one first (0 is below every priority the
    // filter writes); with the unpriced priority the short, priced prompt overtakes it.
    let worker = priority_engine();
    let workers = [worker];
    let envoy = start_envoy(
        &workers,
        filter_config(
            &workers,
            json!({"mode": "kv", "ttft": {}, "max_body_bytes": 8192, "engine_priority": {}}),
        ),
    );
    assert!(
        short_overtakes_long(&envoy, &workers[0], 2_000_000),
        "the priced short prompt goes before the unpriced long one"
    );
    assert!(envoy.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("fallback.body_too_large") == 2
            && e.router_stat("engine_priority.written") == 3
    }));
}
