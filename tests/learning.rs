//! The closed loop through a real Envoy, at the filter's defaults: each worker's timing is
//! learned from its responses' first tokens, and routing follows what was learned.
//!
//! The fleet is the mock engine (a roofline model of a GPU with per-step jitter, not the
//! filter's polynomials) at different `--speedup`s, which the filter is not told.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

fn engines(speedups: &[f64]) -> Vec<Worker> {
    speedups
        .iter()
        .zip(1u64..)
        .map(|(speedup, id)| {
            let s = speedup.to_string();
            Worker::spawn(
                id,
                &["--mode", "engine", "--block-size", "64", "--speedup", &s],
            )
            .expect("mock engine")
        })
        .collect()
}

/// A streamed request of `len` fresh tokens (seeded by `n`), pinned to `pin` if given; returns
/// the worker that served it.
fn stream_one(listener: &str, n: u32, len: u32, max_tokens: u32, pin: Option<u64>) -> Option<u64> {
    let mut body = json!({"model": "m", "prompt": tokens(1_000_000 + n * 10_000, len),
                          "stream": true, "max_tokens": max_tokens});
    if let Some(id) = pin {
        body["nvext"] = json!({"backend_instance_id": id});
    }
    let resp = http::request(
        listener,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
        Duration::from_secs(30),
    )
    .ok()?;
    (resp.status == 200).then(|| served_by(&resp)).flatten()
}

/// The tests here measure time on engines sharing the machine's cores: one at a time, so that
/// neither's fleet slows the other's timing.
static ONE_FLEET_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn factor(envoy: &Envoy, id: u64) -> f64 {
    envoy.router_stat(&format!("worker.{id}.timing_factor_milli")) as f64 / 1000.0
}

#[test]
fn a_mixed_fleet_is_learned_and_the_fast_worker_gets_more() {
    let _alone = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // Worker 1 runs at speed 1, worker 2 three times as fast; the filter is told neither.
    let workers = engines(&[1.0, 3.0]);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));
    // A bounded number of samples: 12 requests on each worker (pinned, so each gets them), of
    // 16,384 tokens: long enough that the path's fixed few ms (Envoy, HTTP, a busy machine)
    // barely count.
    for n in 0..24u32 {
        let id = u64::from(n % 2) + 1;
        assert_eq!(
            stream_one(&envoy.listener, n, 16_384, 2, Some(id)),
            Some(id)
        );
    }
    // The factors are published on the tick: wait until both reflect every sample.
    assert!(envoy.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("worker.1.timing_samples") >= 12
            && e.router_stat("worker.2.timing_samples") >= 12
    }));
    let (slow, fast) = (factor(&envoy, 1), factor(&envoy, 2));
    let ratio = slow / fast;
    assert!(
        (3.0 * 0.85..=3.0 * 1.15).contains(&ratio),
        "learned {slow:.3} and {fast:.3}: ratio {ratio:.2}, true 3"
    );
    // Unpinned, under concurrent load: the fast worker takes the larger share.
    let served: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6u32)
            .map(|c| {
                let listener = envoy.listener.clone();
                s.spawn(move || {
                    (0..15u32)
                        .filter_map(|i| stream_one(&listener, 10_000 + c * 100 + i, 2048, 4, None))
                        .collect::<Vec<u64>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(served.len(), 90, "every request served");
    let on_slow = served.iter().filter(|w| **w == 1).count();
    let on_fast = served.iter().filter(|w| **w == 2).count();
    assert!(
        on_fast >= 2 * on_slow && on_slow > 0,
        "served {on_slow} on the slow worker, {on_fast} on the fast one"
    );
    // The observed TTFT and the prediction error are histograms in Envoy's stats, per worker
    // too (they show values once Envoy's stats flush merged the threads', every 5 s).
    let names = [
        "kv_router.ttft_ms: P0",
        "kv_router.prediction_error_pct: P0",
    ];
    let per_worker = [
        "kv_router.worker.2.ttft_ms: P0",
        "kv_router.worker.2.prediction_error_pct: P0",
    ];
    let stats = || {
        http::get(&envoy.admin, "/stats?filter=kv_router")
            .map(|r| r.text())
            .unwrap_or_default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut text = stats();
    while !names.iter().chain(&per_worker).all(|n| text.contains(n))
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(200));
        text = stats();
    }
    for name in names.iter().chain(&per_worker) {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
}

#[test]
fn a_burst_on_one_prefix_spreads_and_contracts() {
    let _alone = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // Four equal workers; a 6,144-token shared prefix, first computed on one of them.
    let workers = engines(&[1.0, 1.0, 1.0, 1.0]);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));
    let prefix = tokens(7, 96 * 64);
    let with_suffix = |n: u32| {
        let mut p = prefix.clone();
        p.extend(tokens(5_000_000 + n * 1_000, 256));
        json!({"model": "m", "prompt": p, "stream": true, "max_tokens": 2})
    };
    let send = |listener: &str, n: u32| -> (u64, u32) {
        let resp = http::request(
            listener,
            "POST",
            "/v1/completions",
            &[],
            with_suffix(n).to_string().as_bytes(),
            Duration::from_secs(30),
        )
        .expect("request");
        assert_eq!(resp.status, 200);
        let overlap = resp
            .header("x-kv-router-overlap-blocks")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        (served_by(&resp).expect("x-worker-id"), overlap)
    };
    let (holder, _) = send(&envoy.listener, 0);
    // Quiet: the next requests go to the holder, prefix cached.
    for n in 1..4 {
        assert_eq!(
            send(&envoy.listener, n),
            (holder, 96),
            "request {n} before the burst"
        );
    }
    // A burst of 48 at once: the holder's queue soon costs more than recomputing 6k tokens.
    let burst: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..48u32)
            .map(|i| {
                let listener = envoy.listener.clone();
                let send = &send;
                s.spawn(move || send(&listener, 100 + i).0)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut spread: BTreeMap<u64, usize> = BTreeMap::new();
    for w in &burst {
        *spread.entry(*w).or_default() += 1;
    }
    assert!(
        spread.len() >= 2,
        "the burst stayed on one worker: {spread:?}"
    );
    assert!(
        spread.get(&holder).copied().unwrap_or(0) < 48,
        "the holder took the whole burst: {spread:?}"
    );
    // Quiet again: every request is served where the prefix is cached (no new copy made).
    assert!(envoy.wait_for(Duration::from_secs(10), |e| {
        e.router_stat("load.active_entries") == 0
    }));
    let holders: std::collections::BTreeSet<u64> = spread.keys().copied().collect();
    for n in 200..210 {
        let (w, overlap) = send(&envoy.listener, n);
        assert_eq!(
            overlap, 96,
            "request {n} after the burst recomputed the prefix on {w}"
        );
        assert!(
            holders.contains(&w),
            "request {n} went to {w}, outside {holders:?}"
        );
    }
}

/// Two Envoys in front of the same bridged workers, at the defaults (`load.unseen_traffic:
/// relayed`): each tells a worker's `kv-event-bridge` at once when its bookings there moved (not
/// only with its next poll), and what one learned of each worker's timing reaches the other
/// through the bridges: an Envoy that never sent a worker a request prices it as the one that
/// did.
#[test]
fn replicas_hear_each_others_bookings_at_once_and_learn_from_each_others_responses() {
    let _alone = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // Worker 1 runs at speed 1, worker 2 three times as fast; neither Envoy is told.
    let workers: Vec<Worker> = [(1, "1"), (2, "3")]
        .into_iter()
        .map(|(id, speedup)| {
            let args = [
                "--mode",
                "engine",
                "--block-size",
                "64",
                "--speedup",
                speedup,
            ];
            Worker::spawn_bridged(id, 64, &args).expect("bridged mock engine")
        })
        .collect();
    let config = filter_config(&workers, json!({"events": {"long_poll_ms": 1000}}));
    let a = start_envoy(&workers, config.clone());
    let b = start_envoy(&workers, config);

    // A request through A, held on worker 1 for a while (256 output tokens): a third router
    // polling worker 1's bridge sees it in A's bookings, declared between A's polls.
    let bridge = workers[0].bridge.as_ref().unwrap().addr.clone();
    let others = || -> serde_json::Value {
        let page = http::get(&bridge, "/kv/events?after=0&limit=1&router=ff&booked=0,0,0");
        page.unwrap().json().unwrap()["load"]["other_routers"].clone()
    };
    let listener = a.listener.clone();
    let long = std::thread::spawn(move || stream_one(&listener, 0, 2048, 256, Some(1)));
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while others()["requests"] != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "A's booking never reached the bridge: {}",
            others()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(a.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("events.declared") >= 1
    }));
    assert_eq!(long.join().unwrap(), Some(1));
    assert_eq!(a.router_stat("events.declare_failed"), 0);

    // A learns both workers from its own responses; B serves nothing.
    for n in 0..24u32 {
        let id = u64::from(n % 2) + 1;
        assert_eq!(
            stream_one(&a.listener, 100 + n, 16_384, 2, Some(id)),
            Some(id)
        );
    }
    assert!(a.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("worker.1.timing_samples") >= 12
            && e.router_stat("worker.2.timing_samples") >= 12
    }));
    let learned = (factor(&a, 1), factor(&a, 2));
    assert!(
        learned.0 > 2.0 * learned.1,
        "A learned {learned:?}: the test needs workers priced apart"
    );
    // B's factors follow A's from what the bridges relay (A declares its sums with each poll).
    let close = |x: f64, y: f64| (x - y).abs() <= 0.15 * y;
    let heard = b.wait_for(Duration::from_secs(15), |e| {
        close(factor(e, 1), factor(&a, 1)) && close(factor(e, 2), factor(&a, 2))
    });
    assert!(
        heard,
        "B prices the workers {:?}, A {:?}",
        (factor(&b, 1), factor(&b, 2)),
        (factor(&a, 1), factor(&a, 2))
    );
    assert_eq!(
        b.router_stat("worker.1.timing_samples"),
        0,
        "B served nothing"
    );
    assert_eq!(b.router_stat("worker.2.timing_samples"), 0);
}
