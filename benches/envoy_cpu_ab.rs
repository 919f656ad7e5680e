//! Envoy CPU per request, A/B: the same requests go round-robin, in small batches, to an Envoy
//! without the filter, one with a baseline build of the filter and one with the current build
//! (kv mode, every prompt block indexed on the worker, so lazy hashing hashes the whole prompt),
//! each with one worker thread, all in front of the same echo worker. CPU is the Envoy
//! process's run time from `/proc/<pid>/task/*/schedstat` (nanoseconds; also utime+stime from
//! `/proc/<pid>/stat`, in clock ticks) over all batches, divided by the requests sent. Prints
//! figures; asserts nothing timing-based.
//!
//! Usage: `cargo bench --bench envoy_cpu_ab [-- --quick] [-- --baseline PATH]`
//! (needs `make build`; the baseline defaults to target/envoy_kv_router.before.wasm, skipped
//! when absent). Extra builds to compare: `-- --wasm NAME=PATH[@MODE]` (repeatable; MODE is
//! the routing mode, e.g. `round-robin` to leave out hashing and the index); a build named
//! `floor` gets the floor filter's plain configuration (`benches/floor-filter` on the bench
//! branch: buffer, copy and scan the body once, fixed destination). `--tokens 4096,65536` picks
//! the prompt sizes, `--rounds-scale N` multiplies the batches.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use envoy_kv_router_tools::client as http;
use envoy_kv_router_tools::harness::{wasm_path, workspace_root, Envoy, EnvoyOptions, Worker};
use kv_router_testkit::kv_events::{stored_event, GPU};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

/// Run time of every thread of `pid`, in ns (`schedstat` first field).
fn run_ns(pid: u32) -> u64 {
    let mut total = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                total += s
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    total
}

/// utime + stime of `pid` in clock ticks.
fn ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

struct Variant {
    name: String,
    envoy: Envoy,
    ns: u64,
    ticks: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let baseline = arg("--baseline")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/envoy_kv_router.before.wasm"));
    // (name, wasm, routing mode)
    let mut builds: Vec<(String, Option<PathBuf>, String)> =
        vec![("none".into(), None, "kv".into())];
    if baseline.exists() {
        builds.push(("before".into(), Some(baseline), "kv".into()));
    }
    builds.push(("after".into(), Some(wasm_path()), "kv".into()));
    for (i, a) in args.iter().enumerate() {
        if a == "--wasm" {
            if let Some((n, p)) = args.get(i + 1).and_then(|v| v.split_once('=')) {
                let (p, mode) = p.split_once('@').unwrap_or((p, "kv"));
                builds.push((n.to_string(), Some(PathBuf::from(p)), mode.to_string()));
            }
        }
    }

    let worker = Worker::spawn(1, &["--mode", "echo", "--block-size", "64"]).expect("worker");
    let config = json!({"mode": "kv", "block_size": 64,
        "workers": [{"id": 1, "address": worker.addr}]});
    let mut variants: Vec<Variant> = builds
        .into_iter()
        .map(|(name, wasm, mode)| {
            let filter_config = if name == "floor" {
                json!(format!("x-gateway-destination-endpoint {}", worker.addr))
            } else {
                let mut c = config.clone();
                c["mode"] = json!(mode);
                c
            };
            let mut opts = EnvoyOptions::new(filter_config, vec![worker.addr.clone()]);
            opts.with_filter = wasm.is_some();
            opts.wasm = wasm;
            opts.concurrency = 1;
            opts.log_level = "warning";
            Variant {
                name,
                envoy: Envoy::start(&opts).expect("envoy"),
                ns: 0,
                ticks: 0,
            }
        })
        .collect();
    println!("Envoy CPU per request (1 worker thread; schedstat ns over all batches / requests; batches interleaved)");
    print!("{:>7} {:>7} {:>6}", "tokens", "body", "reqs");
    for v in &variants {
        print!(" {:>12}", v.name);
    }
    for v in variants.iter().skip(1) {
        print!(" {:>14}", format!("{}-none", v.name));
    }
    println!("  (us/request; utime+stime ticks in brackets)");
    let sizes: Vec<u32> = match arg("--tokens") {
        Some(list) => list.split(',').filter_map(|t| t.parse().ok()).collect(),
        None => vec![4096, 16_384, 65_536],
    };
    let scale = arg("--rounds-scale")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1);
    for tokens in sizes {
        let prompt: Vec<u32> = (0..tokens)
            .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
            .collect();
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
        let hashes: Vec<u64> = (0..u64::from(tokens / 64))
            .map(|h| h + u64::from(tokens) * 1000)
            .collect();
        let stored = json!([stored_event(&hashes, None, &prompt, 64, GPU)]);
        let before: Vec<u64> = variants
            .iter()
            .map(|v| v.envoy.router_stat("events.applied"))
            .collect();
        worker.admin("/admin/events", &stored).expect("publish");
        // Applied by both replicas (the main thread's VM and the worker thread's) of every kv
        // filter build (the floor filter has no events; a routing mode that reads none is given
        // up on after 10 s).
        for (v, before) in variants.iter().zip(before) {
            if v.name != "floor" {
                let _ = v.envoy.wait_for(Duration::from_secs(10), |e| {
                    e.router_stat("events.applied") >= before + 2
                });
            }
        }
        let batch = 10usize;
        let rounds = if quick {
            3
        } else {
            (4_000_000 / tokens as usize).clamp(8, 100) * scale
        };
        let send = |envoy: &Envoy| {
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
        };
        for v in &variants {
            send(&v.envoy); // warm up
        }
        for v in variants.iter_mut() {
            v.ns = 0;
            v.ticks = 0;
        }
        for _ in 0..rounds {
            for v in variants.iter_mut() {
                let pid = v.envoy.pid();
                let (n0, t0) = (run_ns(pid), ticks(pid));
                for _ in 0..batch {
                    send(&v.envoy);
                }
                v.ns += run_ns(pid) - n0;
                v.ticks += ticks(pid) - t0;
            }
        }
        let reqs = (rounds * batch) as f64;
        let per: Vec<f64> = variants.iter().map(|v| v.ns as f64 / reqs / 1e3).collect();
        print!(
            "{:>7} {:>6}K {:>6}",
            tokens,
            body.len() / 1024,
            rounds * batch
        );
        for (v, p) in variants.iter().zip(&per) {
            print!(" {:>6.0} [{:>3}]", p, v.ticks);
        }
        for p in per.iter().skip(1) {
            print!(" {:>14.0}", p - per[0]);
        }
        println!();
    }
}
