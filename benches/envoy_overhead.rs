//! What the filter adds to a request inside a real Envoy (V8): the same requests alternate
//! between an Envoy with the filter (kv mode, index fed by events) and the same Envoy without it,
//! both in front of the same echo worker. Prints medians and their difference; asserts nothing.
//!
//! Usage: `cargo bench --bench envoy_overhead` (needs `make build` first: .venv Envoy, the .wasm,
//! the mock worker).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use envoy_kv_router_tools::client as http;
use envoy_kv_router_tools::harness::{Envoy, EnvoyOptions, Worker};
use kv_router_testkit::kv_events::{stored_event, GPU};
use serde_json::json;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let worker = Worker::spawn(1, &["--mode", "echo", "--block-size", "64"]).expect("worker");
    let config = json!({"mode": "kv", "block_size": 64,
        "workers": [{"id": 1, "address": worker.addr}]});
    let start = |with_filter: bool| {
        let mut opts = EnvoyOptions::new(config.clone(), vec![worker.addr.clone()]);
        opts.with_filter = with_filter;
        opts.log_level = "warning";
        Envoy::start(&opts).expect("envoy")
    };
    let (with, without) = (start(true), start(false));
    println!("request latency through Envoy, median of interleaved requests (echo worker, 2 Envoy threads)");
    println!(
        "{:>8} {:>9} {:>7} {:>13} {:>13} {:>13} {:>10}",
        "tokens", "body", "iters", "with filter", "without", "filter adds", "per token"
    );
    for tokens in [1024u32, 8192, 32768, 131_072] {
        let prompt: Vec<u32> = (0..tokens)
            .map(|i| i.wrapping_mul(2_654_435_761) % 50_000)
            .collect();
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
        // The worker reports the prompt's blocks cached, so the filter's lookup matches them all.
        let hashes: Vec<u64> = (0..u64::from(tokens / 64))
            .map(|h| h + u64::from(tokens) * 1000)
            .collect();
        let stored = json!([stored_event(&hashes, None, &prompt, 64, GPU)]);
        let before = with.router_stat("events.applied");
        worker.admin("/admin/events", &stored).expect("publish");
        // Applied by every replica: the main thread's VM and the 2 worker threads'.
        assert!(
            with.wait_for(Duration::from_secs(30), |e| {
                e.router_stat("events.applied") >= before + 3
            }),
            "the filter did not apply the published blocks"
        );
        let iters = if quick {
            20
        } else {
            (200_000 / tokens).clamp(40, 400) as usize
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for i in 0..iters + 5 {
            for (envoy, out) in [(&with, &mut a), (&without, &mut b)] {
                let t = Instant::now();
                let resp = http::request(
                    &envoy.listener,
                    "POST",
                    "/v1/completions",
                    &[],
                    body.as_bytes(),
                    Duration::from_secs(30),
                )
                .expect("request");
                assert_eq!(resp.status, 200);
                if i >= 5 {
                    out.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
        let (ma, mb) = (median(a), median(b));
        println!(
            "{:>8} {:>8}K {:>7} {:>10.0} us {:>10.0} us {:>10.0} us {:>7.1} ns",
            tokens,
            body.len() / 1024,
            iters,
            ma,
            mb,
            ma - mb,
            (ma - mb) * 1000.0 / f64::from(tokens)
        );
    }
}
