//! Shared set-up for the integration tests: mock workers and an Envoy in front of them.
#![allow(dead_code)]

pub use envoy_kv_router_tools::harness::{Envoy, EnvoyOptions, Steering, Worker};
pub use envoy_kv_router_tools::http;
use serde_json::{json, Value};

/// `count` echo-mode workers (ids 1..=count) with the given block size.
pub fn echo_workers(count: u64, block_size: u32) -> Vec<Worker> {
    let block = block_size.to_string();
    Worker::spawn_many(count, &["--mode", "echo", "--block-size", &block]).expect("start mock workers")
}

/// A filter configuration listing `workers`, merged with `extra` (top-level keys override).
pub fn filter_config(workers: &[Worker], extra: Value) -> Value {
    let list: Vec<Value> = workers.iter().map(|w| json!({"id": w.id, "address": w.addr})).collect();
    let mut config = json!({"workers": list, "response_headers": true});
    if let (Some(target), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        for (key, value) in extra {
            target.insert(key.clone(), value.clone());
        }
    }
    config
}

pub fn start_envoy(workers: &[Worker], config: Value) -> Envoy {
    start_envoy_with(workers, config, |_| {})
}

pub fn start_envoy_with(workers: &[Worker], config: Value, tune: impl FnOnce(&mut EnvoyOptions)) -> Envoy {
    let mut opts = EnvoyOptions::new(config, workers.iter().map(|w| w.addr.clone()).collect());
    tune(&mut opts);
    Envoy::start(&opts).expect("start envoy")
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
