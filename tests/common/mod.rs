//! Shared set-up for the integration tests: mock workers and an Envoy in front of them.
#![allow(dead_code)]

pub use envoy_kv_router_tools::client as http;
#[allow(unused_imports)]
pub use envoy_kv_router_tools::harness::{Envoy, EnvoyOptions, Steering, Worker};
use kv_router_testkit::kv_events::{removed_event, stored_event};
use serde_json::{json, Value};

/// `count` echo-mode workers (ids 1..=count) with the given block size.
pub fn echo_workers(count: u64, block_size: u32) -> Vec<Worker> {
    let block = block_size.to_string();
    Worker::spawn_many(count, &["--mode", "echo", "--block-size", &block])
        .expect("start mock workers")
}

/// A filter configuration listing `workers` (bridged ones with their bridge as
/// `events_address`), merged with `extra` (top-level keys override). Tests read the decision
/// from response headers and pin workers, so both are switched on here (the defaults are off:
/// see `tests/client_trust.rs`).
pub fn filter_config(workers: &[Worker], extra: Value) -> Value {
    let list: Vec<Value> = workers.iter().map(Worker::filter_entry).collect();
    let mut config =
        json!({"workers": list, "response_headers": true, "client_routing_hints": "honor"});
    if let (Some(target), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        for (key, value) in extra {
            target.insert(key.clone(), value.clone());
        }
    }
    config
}

/// `config` with `"kv_mode": "events"` on every worker entry: the index then holds what the
/// workers' KV events say and nothing else. (The default, `events+approximate`, also records each
/// routing decision as predicted blocks on the chosen worker, so a probe's own request gives the
/// next probe its overlap, and a block the events remove or clear can still count.)
pub fn events_only(mut config: Value) -> Value {
    if let Some(list) = config.get_mut("workers").and_then(Value::as_array_mut) {
        for worker in list {
            worker["kv_mode"] = json!("events");
        }
    }
    config
}

pub fn start_envoy(workers: &[Worker], config: Value) -> Envoy {
    start_envoy_with(workers, config, |_| {})
}

pub fn start_envoy_with(
    workers: &[Worker],
    config: Value,
    tune: impl FnOnce(&mut EnvoyOptions),
) -> Envoy {
    let mut opts = EnvoyOptions::new(config, workers.iter().map(|w| w.addr.clone()).collect());
    tune(&mut opts);
    Envoy::start(&opts).expect("start envoy")
}

/// A streamed `/v1/completions` request with `body`, its response open (20 s limit).
pub fn stream_completion(listener: &str, body: &Value) -> std::io::Result<http::StreamingResponse> {
    http::request_streaming(
        listener,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
        std::time::Duration::from_secs(20),
    )
}

/// The worker id that served a response (the mock worker's `x-worker-id`).
pub fn served_by(resp: &http::Response) -> Option<u64> {
    resp.header("x-worker-id")?.parse().ok()
}

/// A `/v1/completions` body with a token-id prompt.
pub fn completion(tokens: &[u32]) -> Value {
    json!({"model": "mock", "prompt": tokens, "max_tokens": 4})
}

/// `count` tokens starting at `start` (distinct prompts per `start`).
pub fn tokens(start: u32, count: u32) -> Vec<u32> {
    (start..start + count).collect()
}

/// vLLM-shaped "stored" event for `tokens` (whole blocks), engine hashes `first_hash..`.
pub fn vllm_stored(
    tokens: &[u32],
    block_size: u32,
    parent: Option<u64>,
    first_hash: u64,
    medium: &str,
) -> Value {
    let blocks = tokens.len() as u64 / u64::from(block_size);
    let hashes: Vec<u64> = (first_hash..first_hash + blocks).collect();
    stored_event(&hashes, parent, tokens, block_size, medium)
}

/// vLLM-shaped "removed" event of `hashes`.
pub fn vllm_removed(hashes: &[u64], medium: &str) -> Value {
    removed_event(hashes, medium)
}

/// Appends events to a mock worker's event buffer (the filter polls them).
pub fn publish(worker: &Worker, events: Vec<Value>) {
    let resp = worker
        .admin("/admin/events", &Value::Array(events))
        .expect("publish events");
    assert_eq!(resp.status, 200, "publish: {}", resp.text());
}

/// Sends `body` to `/v1/completions` and returns (worker id, overlap blocks, response).
pub fn route(envoy: &Envoy, body: &Value) -> (u64, u32, http::Response) {
    let resp = envoy.post_json("/v1/completions", body).expect("request");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let worker = served_by(&resp).expect("x-worker-id");
    let overlap = resp
        .header("x-kv-router-overlap-blocks")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (worker, overlap, resp)
}

/// Costs reported in `x-kv-router-costs` (`id/rank=cost,...`) by worker id.
pub fn costs(resp: &http::Response) -> std::collections::BTreeMap<u64, f64> {
    resp.header("x-kv-router-costs")
        .unwrap_or("")
        .split(',')
        .filter_map(|item| {
            let (who, cost) = item.split_once('=')?;
            let id = who.split('/').next()?.parse().ok()?;
            Some((id, cost.parse().ok()?))
        })
        .collect()
}

/// Probes with `body` until the router reports at least `blocks` overlap (or `limit` passes).
pub fn wait_for_overlap(
    envoy: &Envoy,
    body: &Value,
    blocks: u32,
    limit: std::time::Duration,
) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if route(envoy, body).1 >= blocks {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// 1,000 mixed requests from 8 client threads (125 each): plain, streamed, aborted mid-stream,
/// 503, hanging past the route timeout, streamed 500. Returns when every client is done.
pub fn send_mixed_requests(listener: &str) {
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let listener = listener.to_string();
            std::thread::spawn(move || {
                for i in 0..125u32 {
                    let n = t * 1000 + i;
                    let prompt: Vec<u32> = (n..n + 40 + (n % 50)).collect();
                    let (stream, mock) = match n % 6 {
                        0 => (false, json!({})),
                        1 => (true, json!({"chunks": 6, "chunk_interval_ms": 2})),
                        2 => (true, json!({"chunks": 50, "chunk_interval_ms": 20})), // aborted below
                        3 => (false, json!({"status": 503})),
                        4 => (false, json!({"hang_ms": 3000})), // route timeout 1.5 s
                        _ => (true, json!({"status": 500})),
                    };
                    let body = json!({"model": "m", "prompt": prompt, "stream": stream, "max_tokens": 8, "mock": mock});
                    let bytes = body.to_string();
                    let timeout = std::time::Duration::from_secs(10);
                    if n % 6 == 2 {
                        if let Ok(mut s) = http::request_streaming(&listener, "POST", "/v1/completions", &[], bytes.as_bytes(), timeout) {
                            let _ = s.next_event();
                            s.abort(); // client goes away mid-stream
                        }
                    } else {
                        let _ = http::request(&listener, "POST", "/v1/completions", &[], bytes.as_bytes(), timeout);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
}

/// Sum of every per-worker load gauge the filter publishes (active requests, prefill tokens,
/// decode blocks), and the requests booked in the shared load table.
pub fn total_load(envoy: &Envoy) -> (u64, u64) {
    let stats = envoy.stats();
    let load: u64 = stats
        .iter()
        .filter(|(k, _)| {
            k.starts_with("wasmcustom.kv_router.worker.")
                && (k.ends_with(".active_requests")
                    || k.ends_with(".prefill_tokens")
                    || k.ends_with(".decode_blocks"))
        })
        .map(|(_, v)| *v)
        .sum();
    let entries = stats
        .get("wasmcustom.kv_router.load.active_entries")
        .copied()
        .unwrap_or(u64::MAX);
    (load, entries)
}
