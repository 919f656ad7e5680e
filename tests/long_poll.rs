//! Long-poll event calls (`events.long_poll_ms`) through a real Envoy.
//!
//! The mock worker answers `/kv/events` at once whatever `wait_ms` says, so these tests bring
//! their own small worker: it serves `/kv/events?after=N&wait_ms=M` the way the engine event
//! bridge does (answer as soon as an event after N exists, else after M ms with an empty page),
//! `/kv/dump`, and completions; and it records every event call it gets.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

#[derive(Default)]
struct State {
    /// Events with ids 1..=len.
    events: Vec<Value>,
    /// Every `/kv/events` call: when it arrived and its `wait_ms`.
    calls: Vec<(Instant, Option<u64>)>,
    in_flight: usize,
    max_in_flight: usize,
    dumps: usize,
}

/// A worker with a long-poll event endpoint (see the module docs).
struct LongPollWorker {
    id: u64,
    addr: String,
    /// false: answer at once like an endpoint that ignores `wait_ms`.
    holds_calls: bool,
    state: Mutex<State>,
    changed: Condvar,
}

impl LongPollWorker {
    fn start(id: u64, holds_calls: bool) -> Arc<LongPollWorker> {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let worker = Arc::new(LongPollWorker {
            id,
            addr: listener.local_addr().expect("addr").to_string(),
            holds_calls,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let me = Arc::clone(&worker);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let me = Arc::clone(&me);
                std::thread::spawn(move || me.serve(stream));
            }
        });
        worker
    }

    fn publish(&self, mut event: Value) {
        let mut state = self.state.lock().unwrap();
        event["event_id"] = json!(state.events.len() + 1);
        state.events.push(event);
        self.changed.notify_all();
    }

    fn page(&self, state: &State, after: usize) -> Value {
        json!({"block_size": BLOCK, "first_event_id": 1, "last_event_id": state.events.len(),
               "events": state.events.get(after..).unwrap_or_default()})
    }

    fn events_call(&self, after: usize, wait_ms: Option<u64>) -> Value {
        let mut state = self.state.lock().unwrap();
        state.calls.push((Instant::now(), wait_ms));
        state.in_flight += 1;
        state.max_in_flight = state.max_in_flight.max(state.in_flight);
        let deadline = Instant::now() + Duration::from_millis(wait_ms.unwrap_or(0));
        while self.holds_calls && state.events.len() <= after {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self.changed.wait_timeout(state, left).unwrap().0;
        }
        state.in_flight -= 1;
        self.page(&state, after)
    }

    fn serve(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        let (mut length, mut chunked) = (0usize, false);
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
                break;
            }
            let lower = header.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
                chunked = true;
            }
        }
        drain_body(&mut reader, length, chunked);
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let param = |name: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let body = match path {
            "/kv/events" => {
                let after = usize::try_from(param("after").unwrap_or(0)).unwrap_or(usize::MAX);
                self.events_call(after, param("wait_ms"))
            }
            "/kv/dump" => {
                let mut state = self.state.lock().unwrap();
                state.dumps += 1;
                json!({"block_size": BLOCK, "last_event_id": state.events.len(), "events": state.events})
            }
            _ => json!({"id": "cmpl", "object": "text_completion",
                        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}),
        };
        let text = body.to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nx-worker-id: {}\r\nconnection: close\r\n\r\n",
            text.len(),
            self.id
        );
        let mut out = stream;
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(text.as_bytes());
    }

    fn calls(&self) -> Vec<(Instant, Option<u64>)> {
        self.state.lock().unwrap().calls.clone()
    }
}

fn drain_body(reader: &mut BufReader<TcpStream>, length: usize, chunked: bool) {
    if !chunked {
        let mut body = vec![0u8; length];
        let _ = reader.read_exact(&mut body);
        return;
    }
    loop {
        let mut size = String::new();
        if reader.read_line(&mut size).unwrap_or(0) == 0 {
            return;
        }
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        let mut chunk = vec![0u8; n + 2];
        let _ = reader.read_exact(&mut chunk);
        if n == 0 {
            return;
        }
    }
}

fn envoy_for(workers: &[Arc<LongPollWorker>], events: Value) -> Envoy {
    // Events only: a prompt becomes routable when its event arrives, not when a probe's own
    // routing decision is predicted on some worker.
    let list: Vec<Value> = workers
        .iter()
        .map(|w| json!({"id": w.id, "address": w.addr, "kv_mode": "events"}))
        .collect();
    let config = json!({"workers": list, "response_headers": true, "block_size": BLOCK,
                        "mode": "kv", "events": events});
    let mut opts = EnvoyOptions::new(config, workers.iter().map(|w| w.addr.clone()).collect());
    opts.concurrency = 2;
    Envoy::start(&opts).expect("start envoy")
}

fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Whether the router reports `blocks` of overlap for `prompt` within 10 s.
fn routable(envoy: &Envoy, prompt: &[u32], blocks: u32) -> bool {
    wait_for_overlap(envoy, &completion(prompt), blocks, Duration::from_secs(10))
}

/// A minute between plain polls, so only the long poll can bring an event in within seconds.
#[test]
fn long_polls_bring_each_event_in_without_waiting_for_the_poll_interval() {
    let workers = [
        LongPollWorker::start(1, true),
        LongPollWorker::start(2, true),
    ];
    let envoy = envoy_for(
        &workers,
        json!({"poll_interval_ms": 60000, "long_poll_ms": 1500, "stale_after_ms": 120000}),
    );
    // Started: each worker was dumped and now holds a long poll.
    for w in &workers {
        assert!(wait_until(Duration::from_secs(10), || {
            let s = w.state.lock().unwrap();
            s.dumps >= 1 && s.in_flight == 1
        }));
    }
    let mut delays_ms = Vec::new();
    for round in 0..3u32 {
        let prompt = tokens(50_000 + round * 1000, 4 * BLOCK);
        let start = Instant::now();
        workers[1].publish(vllm_stored(
            &prompt,
            BLOCK,
            None,
            100 * u64::from(round) + 1,
            "GPU",
        ));
        assert!(
            routable(&envoy, &prompt, 4),
            "round {round}: the event counts for routing long before the 60 s poll interval"
        );
        delays_ms.push(start.elapsed().as_millis());
        assert_eq!(route(&envoy, &completion(&prompt)).0, 2);
        if round == 1 {
            // Let a long poll expire empty at least once: the next one is issued at once too.
            let before = workers[1].calls().len();
            assert!(wait_until(Duration::from_secs(10), || workers[1]
                .calls()
                .len()
                >= before + 2));
        }
    }
    println!("long poll: published-to-routable delay ms per round: {delays_ms:?}");
    for w in &workers {
        let state = w.state.lock().unwrap();
        assert_eq!(
            state.max_in_flight, 1,
            "worker {}: one long poll at a time",
            w.id
        );
        assert!(
            state.calls.iter().all(|(_, wait)| *wait == Some(1500)),
            "worker {}: every events call long-polls: {:?}",
            w.id,
            state.calls.iter().map(|c| c.1).collect::<Vec<_>>()
        );
    }
    assert_eq!(envoy.router_stat("workers.stale"), 0);
    assert_eq!(envoy.router_stat("events.fetch_failed"), 0);
}

/// An endpoint that answers at once despite `wait_ms` (an older worker) is polled at the plain
/// interval, not in a busy loop.
#[test]
fn an_endpoint_that_does_not_hold_calls_is_polled_at_the_interval() {
    let workers = [LongPollWorker::start(1, false)];
    let envoy = envoy_for(
        &workers,
        json!({"poll_interval_ms": 200, "long_poll_ms": 1500, "stale_after_ms": 10000}),
    );
    assert!(wait_until(Duration::from_secs(15), || workers[0]
        .calls()
        .len()
        >= 8));
    let calls = workers[0].calls();
    let gaps: Vec<u128> = calls
        .windows(2)
        .map(|w| w[1].0.duration_since(w[0].0).as_millis())
        .collect();
    assert!(
        gaps.iter().all(|g| *g >= 150),
        "consecutive calls at least the interval apart (ms): {gaps:?}"
    );
    // Events still arrive, at the interval.
    let prompt = tokens(70_000, 3 * BLOCK);
    workers[0].publish(vllm_stored(&prompt, BLOCK, None, 1, "GPU"));
    assert!(routable(&envoy, &prompt, 3));
}
