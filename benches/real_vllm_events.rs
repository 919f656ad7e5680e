//! Event-to-routable latency with a real vLLM engine: from the moment vLLM stamps a KV-event
//! batch (its own `ts`, taken when the scheduler step's events are collected, before its
//! publisher thread sends them) to the moment the filter has the event in its shared log, which
//! every request reads before it is routed. In between: vLLM's ZMQ publisher, the
//! `kv-event-bridge` (decode, mirror, page) and the filter's long poll through Envoy.
//!
//! One engine (scripts/vllm/serve.sh, fast config), its bridge, Envoy with the filter
//! (`events.long_poll_ms: 1000`). Each round sends a fresh 100-token prompt straight to the
//! engine (one batch, one `BlockStored`) while a thread polls the filter's `events.stored` and
//! stamps each rise; at the end the engine's replay socket gives every batch's `ts` (read with
//! the engine's own Python: pyzmq + msgspec). Clocks: one machine, wall time on both sides.
//! Resolution: one admin poll (about a millisecond); the stamps are upper bounds.
//!
//! Usage: `cargo bench --bench real_vllm_events` (needs scripts/vllm/install.sh and `make build`).
//! Prints figures, asserts nothing. `ROUNDS` (default 100) sets the number of events.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[allow(dead_code)]
#[path = "../tests/real_vllm/procs.rs"]
mod procs;

use envoy_kv_router_tools::client as http;
use envoy_kv_router_tools::harness::{Envoy, EnvoyOptions};
use envoy_kv_router_tools::util::{percentile, splitmix64};
use procs::{Bridge, Engine, EngineConfig};
use serde_json::json;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const STAT: &str = "wasmcustom.kv_router.events.stored";

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `events.stored` from Envoy's admin API (only that stat).
fn stored(envoy: &Envoy) -> Option<u64> {
    let resp = http::get(&envoy.admin, "/stats?filter=kv_router\\.events\\.stored$").ok()?;
    resp.text().lines().find_map(|l| {
        let (name, value) = l.split_once(": ")?;
        (name == STAT).then(|| value.trim().parse().ok())?
    })
}

/// Every batch in the engine's replay buffer: (seq, ts, whether it holds a BlockStored).
fn replayed_batches(replay_port: u16) -> Vec<(u64, f64, bool)> {
    const SCRIPT: &str = r#"
import sys, zmq, msgspec
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.RCVTIMEO, 10000)
s.connect("tcp://127.0.0.1:" + sys.argv[1])
s.send_multipart([b"", (0).to_bytes(8, "big")])
while True:
    f = s.recv_multipart()
    if len(f) == 4 and f[1] == b"" and f[2] == b"\xff" * 8:
        break
    ts, events = msgspec.msgpack.decode(f[3])[:2]
    kinds = [e["type"] if isinstance(e, dict) else e[0] for e in events]
    print(int.from_bytes(f[2], "big"), repr(ts), int("BlockStored" in kinds))
"#;
    let python = envoy_kv_router_tools::vllm::vllm_home().join("venv/bin/python");
    let out = Command::new(python)
        .args(["-c", SCRIPT, &replay_port.to_string()])
        .output()
        .expect("run the replay reader");
    assert!(
        out.status.success(),
        "replay reader: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2] == "1")
        })
        .collect()
}

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    procs::check_prerequisites();
    let dir = std::env::temp_dir().join(format!("ekr-vllm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ports = procs::free_ports(4);
    // A cache sized by vLLM (no evictions): every batch is one prefill's BlockStored.
    let config = EngineConfig::default();
    let mut engine = Engine::new("engine", [ports[0], ports[1], ports[2]], config, &dir);
    engine.start().expect("start the engine");
    let up = engine
        .wait_healthy(Duration::from_secs(300))
        .unwrap_or_else(|e| panic!("{e}"));
    println!("engine healthy after {:.1} s", up.as_secs_f64());
    let bridge = Bridge::start(&engine, ports[3], &dir);
    let config = json!({"block_size": 32, "workers": [{"id": 1, "address": engine.addr(),
        "events_address": bridge.addr(), "models": ["tiny"]}],
        "events": {"long_poll_ms": 1000, "timeout_ms": 1000, "stale_after_ms": 5000}});
    let mut opts = EnvoyOptions::new(config, vec![engine.addr()]);
    opts.log_level = "warning";
    let envoy = Arc::new(Envoy::start(&opts).expect("envoy"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while envoy.router_stat("events.resyncs") < 1 {
        assert!(Instant::now() < deadline, "the filter never read the dump");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Warm-up (the first requests after start-up are slower), not measured.
    let prompt = |seed: u64| -> Vec<u32> {
        (0..100u64)
            .map(|i| 4 + (splitmix64((seed << 20) | i) % 508) as u32)
            .collect()
    };
    let send = |seed: u64| {
        let body = json!({"model": "tiny", "prompt": prompt(seed), "max_tokens": 1});
        let resp = http::post_json(&engine.addr(), "/v1/completions", &body).expect("request");
        assert_eq!(resp.status, 200, "{}", resp.text());
    };
    const WARMUP: u64 = 3;
    for seed in 0..WARMUP {
        send(900 + seed);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while stored(&envoy) != Some(WARMUP) {
        assert!(
            Instant::now() < deadline,
            "warm-up events never reached the filter"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Stamps of every rise of events.stored: (count, wall time of the poll that showed it).
    let rises = Arc::new(Mutex::new(Vec::<(u64, f64)>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let poller = {
        let (envoy, rises, done) = (Arc::clone(&envoy), Arc::clone(&rises), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut last = stored(&envoy).unwrap_or(0);
            while !done.load(Ordering::Relaxed) {
                if let Some(v) = stored(&envoy) {
                    if v > last {
                        rises.lock().unwrap().push((v, now_s()));
                        last = v;
                    }
                }
            }
        })
    };
    // The same for the bridge's page (its own long poll): where the time goes.
    let on_page = Arc::new(Mutex::new(Vec::<f64>::new()));
    let page_poller = {
        let (addr, on_page, done) = (bridge.addr(), Arc::clone(&on_page), Arc::clone(&done));
        let page = http::get(&addr, "/kv/events?after=0").expect("page");
        let mut cursor = page.json().expect("page JSON")["last_event_id"]
            .as_u64()
            .expect("last_event_id");
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let Ok(resp) = http::get(&addr, &format!("/kv/events?after={cursor}&wait_ms=200"))
                else {
                    continue;
                };
                let seen = now_s();
                let page = resp.json().expect("page JSON");
                for e in page["events"].as_array().into_iter().flatten() {
                    cursor = e["event_id"].as_u64().expect("event_id");
                    if e["type"] == "BlockStored" {
                        on_page.lock().unwrap().push(seen);
                    }
                }
            }
        })
    };
    let first = stored(&envoy).unwrap_or(0);
    for round in 0..rounds as u64 {
        send(1000 + round);
        // One event at a time: the next request only once this one's event is in.
        let deadline = Instant::now() + Duration::from_secs(30);
        while rises.lock().unwrap().last().map_or(first, |r| r.0) < first + round + 1 {
            assert!(
                Instant::now() < deadline,
                "round {round}: event never reached the filter"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    done.store(true, Ordering::Relaxed);
    poller.join().unwrap();
    page_poller.join().unwrap();

    let batches: Vec<(u64, f64)> = replayed_batches(engine.replay_port)
        .into_iter()
        .filter(|b| b.2)
        .skip(WARMUP as usize)
        .map(|b| (b.0, b.1))
        .collect();
    let rises = rises.lock().unwrap().clone();
    assert_eq!(
        batches.len(),
        rises.len(),
        "one BlockStored batch per rise of events.stored: {batches:?} vs {rises:?}"
    );
    assert!(
        rises.windows(2).all(|w| w[1].0 == w[0].0 + 1),
        "each poll saw one new event: {rises:?}"
    );
    let on_page = on_page.lock().unwrap().clone();
    assert_eq!(
        on_page.len(),
        batches.len(),
        "one BlockStored per batch on the page"
    );
    let report = |what: &str, seen: &mut dyn Iterator<Item = f64>| {
        let mut ms: Vec<f64> = batches
            .iter()
            .zip(seen)
            .map(|((_, ts), seen)| (seen - ts) * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        println!(
            "{what:<44} {:>4} events: median {:>5.1} ms, p90 {:>5.1} ms, p99 {:>5.1} ms, min {:>5.1} ms, max {:>5.1} ms",
            ms.len(),
            percentile(&ms, 50.0).unwrap_or(f64::NAN),
            percentile(&ms, 90.0).unwrap_or(f64::NAN),
            percentile(&ms, 99.0).unwrap_or(f64::NAN),
            ms[0],
            ms[ms.len() - 1]
        );
    };
    report(
        "vLLM batch ts -> on the bridge's page",
        &mut on_page.iter().copied(),
    );
    report(
        "vLLM batch ts -> routable (filter's log)",
        &mut rises.iter().map(|r| r.1),
    );
    drop(envoy);
    drop(bridge);
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}
