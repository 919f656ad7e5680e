//! Load accounting, eligibility filters and the basic modes through a real Envoy (2 threads).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

const BLOCK: u32 = 16;

fn envoy_with(workers: &[Worker], extra: Value) -> Envoy {
    let mut config = filter_config(workers, json!({"block_size": BLOCK}));
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    start_envoy_with(workers, config, |o| {
        o.concurrency = 2;
        o.route_timeout = Duration::from_millis(1500);
    })
}

fn distribution(envoy: &Envoy, n: u32, body: impl Fn(u32) -> Value) -> HashMap<u64, u32> {
    let mut counts = HashMap::new();
    for i in 0..n {
        let (w, _, _) = route(envoy, &body(i));
        *counts.entry(w).or_insert(0) += 1;
    }
    counts
}

#[test]
fn load_returns_to_zero_after_a_thousand_mixed_requests() {
    let workers = echo_workers(3, BLOCK);
    let envoy = envoy_with(
        &workers,
        json!({"mode": "kv", "load": {"track_output_blocks": true}}),
    );
    let listener = envoy.listener.clone();
    send_mixed_requests(&listener);
    let settled = envoy.wait_for(Duration::from_secs(10), |e| total_load(e) == (0, 0));
    assert!(
        settled,
        "load left after all requests ended: {:?}",
        total_load(&envoy)
    );
    assert_eq!(envoy.router_stat("load.release_failed"), 0);
}

#[test]
fn a_long_prefill_repels_requests_until_its_first_token() {
    let workers = echo_workers(2, BLOCK);
    let envoy = envoy_with(&workers, json!({"mode": "kv"}));
    // A long prompt on worker 1 whose first token takes 2 s.
    let body = json!({"model": "m", "prompt": tokens(1, 200 * BLOCK), "stream": true, "max_tokens": 2,
        "nvext": {"backend_instance_id": 1}, "mock": {"first_token_delay_ms": 2000, "chunks": 2, "chunk_interval_ms": 3000}});
    let listener = envoy.listener.clone();
    let long = std::thread::spawn(move || {
        let mut s = stream_completion(&listener, &body).expect("long");
        let _ = s.next_event();
        std::thread::sleep(Duration::from_millis(200));
        s.abort();
    });
    // Wait until the long request is booked (its prefill tokens show on worker 1).
    assert!(envoy.wait_for(Duration::from_secs(10), |e| {
        e.router_stat("worker.1.rank.0.prefill_tokens") > 0
    }));
    let during = distribution(&envoy, 10, |i| {
        completion(&tokens(10_000 * (i + 1), 4 * BLOCK))
    });
    assert_eq!(
        during.get(&1),
        None,
        "worker 1 is busy prefilling: {during:?}"
    );
    long.join().expect("long request");
    assert!(envoy.wait_for(Duration::from_secs(5), |e| total_load(e) == (0, 0)));
    let after = distribution(&envoy, 20, |i| {
        completion(&tokens(20_000 * (i + 1), 4 * BLOCK))
    });
    assert!(
        after.get(&1).copied().unwrap_or(0) > 0,
        "worker 1 gets requests again: {after:?}"
    );
}

#[test]
fn round_robin_spreads_evenly() {
    let workers = echo_workers(3, BLOCK);
    let envoy = envoy_with(&workers, json!({"mode": "round-robin"}));
    let counts = distribution(&envoy, 60, |i| completion(&tokens(i, 20)));
    for w in 1..=3 {
        let c = counts.get(&w).copied().unwrap_or(0);
        assert!((14..=26).contains(&c), "{counts:?}");
    }
}

#[test]
fn random_reaches_every_worker() {
    let workers = echo_workers(3, BLOCK);
    let envoy = envoy_with(&workers, json!({"mode": "random"}));
    let counts = distribution(&envoy, 60, |i| completion(&tokens(i, 20)));
    assert_eq!(counts.len(), 3, "{counts:?}");
}

#[test]
fn least_loaded_and_power_of_two_avoid_a_worker_holding_long_requests() {
    for mode in ["least-loaded", "power-of-two"] {
        let workers = echo_workers(2, BLOCK);
        let envoy = envoy_with(&workers, json!({"mode": mode}));
        let held: Vec<_> = (0..3)
            .map(|i| {
                let body = json!({"model": "m", "prompt": tokens(i * 100, 20), "stream": true, "max_tokens": 2,
                    "nvext": {"backend_instance_id": 1}, "mock": {"chunks": 2, "chunk_interval_ms": 4000}});
                let mut s = http::request_streaming(&envoy.listener, "POST", "/v1/completions", &[], body.to_string().as_bytes(), Duration::from_secs(20)).expect("held");
                let _ = s.next_event();
                s
            })
            .collect();
        let counts = distribution(&envoy, 10, |i| completion(&tokens(i, 20)));
        assert_eq!(counts.get(&2).copied(), Some(10), "{mode}: {counts:?}");
        drop(held);
    }
}

#[test]
fn device_aware_weighted_sends_about_ratio_to_one() {
    let gpu = Worker::spawn(1, &["--mode", "echo", "--block-size", "16"]).expect("gpu");
    let cpu = Worker::spawn(2, &["--mode", "echo", "--block-size", "16"]).expect("cpu");
    let workers = vec![gpu, cpu];
    let list = json!([{"id": 1, "address": workers[0].addr, "device": "gpu"},
                      {"id": 2, "address": workers[1].addr, "device": "cpu"}]);
    let envoy = envoy_with(
        &workers,
        json!({"mode": "device-aware-weighted", "device_ratio": 4.0, "workers": list}),
    );
    // Concurrent held requests: the in-flight ratio follows the weights (4:1).
    let held: Vec<_> = (0..25)
        .map(|i| {
            let body = json!({"model": "m", "prompt": tokens(i * 100, 20), "stream": true, "max_tokens": 2,
                "mock": {"chunks": 2, "chunk_interval_ms": 4000}});
            let mut s = http::request_streaming(&envoy.listener, "POST", "/v1/completions", &[], body.to_string().as_bytes(), Duration::from_secs(20)).expect("held");
            let _ = s.next_event();
            s.header("x-worker-id").and_then(|v| v.parse::<u64>().ok()).map(|w| (w, s))
        })
        .collect();
    let gpu_count = held.iter().flatten().filter(|(w, _)| *w == 1).count();
    let cpu_count = held.iter().flatten().filter(|(w, _)| *w == 2).count();
    assert_eq!(gpu_count + cpu_count, 25);
    assert!(
        (19..=21).contains(&gpu_count),
        "gpu {gpu_count} cpu {cpu_count}"
    );
}

#[test]
fn allow_list_limits_candidates() {
    let workers = echo_workers(3, BLOCK);
    let envoy = envoy_with(&workers, json!({"mode": "round-robin"}));
    let counts = distribution(&envoy, 12, |i| {
        let mut b = completion(&tokens(i, 20));
        b["nvext"] = json!({"allowed_worker_ids": [1, 3]});
        b
    });
    assert_eq!(counts.get(&2), None, "{counts:?}");
    assert!(counts.contains_key(&1) && counts.contains_key(&3));
}

#[test]
fn pin_errors_are_distinct() {
    let workers = echo_workers(2, BLOCK);
    let list = json!([{"id": 1, "address": workers[0].addr, "dp_size": 2, "kv_capacity_blocks": 1000},
                      {"id": 2, "address": workers[1].addr, "kv_capacity_blocks": 10}]);
    let envoy = envoy_with(
        &workers,
        json!({"mode": "kv", "workers": list, "busy": {"decode_blocks_fraction": 0.5}}),
    );
    let pinned = |id: u64, rank: Option<u32>| {
        let mut b = completion(&tokens(1, 20));
        b["nvext"] = json!({"backend_instance_id": id, "dp_rank": rank});
        envoy.post_json("/v1/completions", &b).expect("request")
    };
    let unknown = pinned(9, None);
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    assert!(unknown.text().contains('9'));
    let needs_rank = pinned(1, None);
    assert_eq!(needs_rank.status, 400, "{}", needs_rank.text());
    let bad_rank = pinned(1, Some(5));
    assert_eq!(bad_rank.status, 400, "{}", bad_rank.text());
    assert_eq!(pinned(1, Some(1)).status, 200);
    // Worker 2 (10 blocks of capacity, busy above 5) gets a 7-block request held in flight.
    let body = json!({"model": "m", "prompt": tokens(1, 7 * BLOCK), "stream": true, "max_tokens": 2,
        "nvext": {"backend_instance_id": 2}, "mock": {"chunks": 2, "chunk_interval_ms": 3000}});
    let mut held = http::request_streaming(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
        Duration::from_secs(20),
    )
    .expect("held");
    let _ = held.next_event();
    let overloaded = pinned(2, None);
    assert_eq!(overloaded.status, 503, "{}", overloaded.text());
    assert!(overloaded.header("retry-after").is_some());
    assert!(overloaded.json().is_ok(), "JSON error body");
}

#[test]
fn all_workers_overloaded_is_a_503_with_retry_after() {
    let workers = echo_workers(1, BLOCK);
    // The long prompt's prefill must count in full until its first token (3 s), not decay over
    // its predicted ~22 ms.
    let envoy = envoy_with(
        &workers,
        json!({"mode": "kv", "busy": {"prefill_tokens": 100},
               "load": {"prefill_load_model": "none"}}),
    );
    let body = json!({"model": "m", "prompt": tokens(1, 20 * BLOCK), "stream": true, "max_tokens": 2,
        "mock": {"first_token_delay_ms": 3000}});
    let listener = envoy.listener.clone();
    let long = std::thread::spawn(move || {
        let _ = http::request(
            &listener,
            "POST",
            "/v1/completions",
            &[],
            body.to_string().as_bytes(),
            Duration::from_secs(10),
        );
    });
    assert!(envoy.wait_for(Duration::from_secs(10), |e| {
        e.router_stat("worker.1.rank.0.prefill_tokens") > 0
    }));
    let resp = envoy
        .post_json("/v1/completions", &completion(&tokens(5, 20)))
        .expect("request");
    assert_eq!(resp.status, 503, "{}", resp.text());
    assert!(resp.header("retry-after").is_some());
    assert!(resp.json().expect("json")["error"]["message"]
        .as_str()
        .is_some());
    long.join().expect("long");
}

#[test]
fn required_taints_and_models_filter_workers() {
    let workers = echo_workers(3, BLOCK);
    let list = json!([{"id": 1, "address": workers[0].addr, "taints": ["a100"], "models": ["llama"]},
                      {"id": 2, "address": workers[1].addr, "taints": ["h100"], "models": ["llama"]},
                      {"id": 3, "address": workers[2].addr, "models": ["qwen"]}]);
    let envoy = envoy_with(&workers, json!({"mode": "round-robin", "workers": list}));
    let counts = distribution(
        &envoy,
        8,
        |i| json!({"model": "llama", "prompt": tokens(i, 20), "nvext": {"required_taints": ["h100"]}}),
    );
    assert_eq!(
        counts.keys().copied().collect::<Vec<_>>(),
        vec![2],
        "{counts:?}"
    );
    let counts = distribution(
        &envoy,
        6,
        |i| json!({"model": "qwen", "prompt": tokens(i, 20)}),
    );
    assert_eq!(counts.keys().copied().collect::<Vec<_>>(), vec![3]);
    let none = envoy
        .post_json(
            "/v1/completions",
            &json!({"model": "mistral", "prompt": tokens(1, 20)}),
        )
        .expect("request");
    assert_eq!(
        none.status,
        404,
        "an unserved model is not found: {}",
        none.text()
    );
    assert!(none.text().contains("mistral") || none.text().contains("model"));
}

/// Another router's traffic is invisible in this Envoy's load table; the worker's own counters
/// (reported with its events) make this Envoy avoid it too.
#[test]
fn worker_reported_load_steers_away_from_a_worker_busy_with_other_traffic() {
    for mode in ["kv", "least-loaded"] {
        let workers = echo_workers(2, BLOCK);
        let list = json!([{"id": 1, "address": workers[0].addr, "kv_capacity_blocks": 1000},
                          {"id": 2, "address": workers[1].addr, "kv_capacity_blocks": 1000}]);
        let envoy = envoy_with(&workers, json!({"mode": mode, "workers": list}));
        let before = distribution(&envoy, 12, |i| completion(&tokens(i * 100, 20)));
        assert_eq!(
            before.len(),
            2,
            "{mode}: idle workers share the traffic: {before:?}"
        );
        let report = json!({"num_running": 40, "num_waiting": 10, "kv_usage": 0.9});
        workers[0]
            .admin("/admin/load", &report)
            .expect("report load");
        // 24 in a row avoiding worker 1 cannot happen by chance (2^-24) before the report lands.
        let moved = envoy.wait_for(Duration::from_secs(5), |e| {
            !distribution(e, 24, |i| completion(&tokens(50_000 + i * 100, 20))).contains_key(&1)
        });
        assert!(moved, "{mode}: the busy worker is avoided");
        let after = distribution(&envoy, 12, |i| completion(&tokens(90_000 + i * 100, 20)));
        assert_eq!(after.get(&1), None, "{mode}: {after:?}");
    }
}

/// Two echo workers of 1,000 KV blocks each, indexed from their events alone (the probes'
/// predicted blocks would put the prefix on worker 2 too), worker 1 holding a 64-block prefix:
/// the workers, their `workers` list and the prefix.
fn a_holder_of_64_blocks() -> (Vec<Worker>, Value, Vec<u32>) {
    let workers = echo_workers(2, BLOCK);
    let list = json!([{"id": 1, "address": workers[0].addr, "kv_capacity_blocks": 1000, "kv_mode": "events"},
                      {"id": 2, "address": workers[1].addr, "kv_capacity_blocks": 1000, "kv_mode": "events"}]);
    let prefix = tokens(1, 64 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(&prefix, BLOCK, None, 1, "GPU")],
    );
    (workers, list, prefix)
}

/// A worker's reported KV usage counts every block its running requests reference, the cached
/// prefixes they share included: not load the cost's decode term prices (the blocks each request
/// adds). With capacities known (configured here; described by the workers under
/// `membership`), a holder of the prompt's prefix whose two running requests reference 60% of
/// its cache keeps the prompt; the busy threshold still reads the usage and skips it.
#[test]
fn a_reported_kv_usage_keeps_prompts_on_their_prefix_and_still_marks_a_full_worker_busy() {
    let (workers, list, prefix) = a_holder_of_64_blocks();
    let prompt = |i: u32| {
        let mut p = prefix.clone();
        p.extend(tokens(100_000 + i * 1_000, 8 * BLOCK));
        json!({"model": "m", "prompt": p, "max_tokens": 16})
    };
    let report = json!({"num_running": 2, "num_waiting": 0, "kv_usage": 0.6});
    // Worker 1's reported requests, from `x-kv-router-loads` (`1/0=prefill:requests:overlap`).
    let reported = |resp: &http::Response| -> u32 {
        let loads = resp.header("x-kv-router-loads").unwrap_or_default();
        let worker_1 = loads.split(',').find_map(|l| l.strip_prefix("1/0="));
        worker_1
            .and_then(|l| l.split(':').nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    for busy in [None, Some(0.5)] {
        let mut extra = json!({"mode": "kv", "workers": list});
        if let Some(fraction) = busy {
            extra["busy"] = json!({"decode_blocks_fraction": fraction});
        }
        let envoy = envoy_with(&workers, extra);
        assert!(
            wait_for_overlap(&envoy, &prompt(0), 64, Duration::from_secs(5)),
            "the prefix is indexed on worker 1"
        );
        workers[0]
            .admin("/admin/load", &report)
            .expect("report load");
        let mut probe = 0;
        let landed = envoy.wait_for(Duration::from_secs(5), |e| {
            probe += 1;
            let resp = e
                .post_json("/v1/completions", &prompt(probe))
                .expect("request");
            resp.status == 200 && reported(&resp) >= 2
        });
        assert!(landed, "busy {busy:?}: the report reaches the filter");
        let served = distribution(&envoy, 12, |i| prompt(1_000 + i));
        match busy {
            None => assert_eq!(
                served.get(&1),
                Some(&12),
                "the holder keeps them: {served:?}"
            ),
            Some(_) => assert_eq!(served.get(&2), Some(&12), "60% > 50%: busy: {served:?}"),
        }
    }
}

/// `ttft.admission_wait`: a worker whose cache is nearly full of running requests (its own
/// report) keeps the prompts whose new blocks fit in its free ones, and loses to a worker with
/// room the prompts that would wait there for running requests to finish, although it holds
/// their prefix. Without the option the same prompt goes to the holder.
#[test]
fn a_prompt_that_would_wait_for_kv_room_goes_where_it_fits() {
    let (workers, list, prefix) = a_holder_of_64_blocks();
    let with_new = |blocks: u32, i: u32| {
        let mut prompt = prefix.clone();
        prompt.extend(tokens(100_000 + i * 10_000, blocks * BLOCK));
        json!({"model": "m", "prompt": prompt, "max_tokens": 256})
    };
    // Worker 1: 970 of 1,000 blocks in use, 20 free past the 1% watermark; worker 2: half full.
    // Both report 30 running requests, so the decode terms nearly agree.
    let reports = [
        json!({"num_running": 30, "num_waiting": 0, "kv_usage": 0.97}),
        json!({"num_running": 30, "num_waiting": 0, "kv_usage": 0.5}),
    ];
    for admission in [false, true] {
        // The predicted-TTFT policy's admission term is the subject: `compute_weight` 0, since the
        // adaptive weight (Little's law: the 60 reported running requests over the ~1 ms
        // lifetime of the mock's own answers) would reach its cap of 100 and keep every prompt
        // on the holder of its prefix.
        // The balance guard (`max_load_ratio`) is off: while one report has landed and the
        // other not, it would drop the reporting worker from the candidates.
        let ttft =
            json!({"admission_wait": admission, "compute_weight": 0.0, "max_load_ratio": 0.0});
        let envoy = envoy_with(
            &workers,
            json!({"mode": "kv", "policy": "predicted", "workers": list, "ttft": ttft}),
        );
        assert!(
            wait_for_overlap(&envoy, &with_new(1, 0), 64, Duration::from_secs(5)),
            "the prefix is indexed on worker 1"
        );
        let idle = costs(&route(&envoy, &with_new(60, 1)).2);
        for (worker, report) in workers.iter().zip(&reports) {
            worker.admin("/admin/load", report).expect("report load");
        }
        // The reports landed once both decode terms (30 running, 97% / 50% full: 34 / 26 ms a
        // step) show.
        let mut probe = 2;
        let landed = envoy.wait_for(Duration::from_secs(5), |e| {
            probe += 1;
            let now = costs(&route(e, &with_new(60, probe)).2);
            let risen = |id: u64| match (now.get(&id), idle.get(&id)) {
                (Some(now), Some(idle)) => *now > idle + 20.0,
                _ => false,
            };
            risen(1) && risen(2)
        });
        assert!(
            landed,
            "admission {admission}: the reports reach the filter"
        );
        // 8 new blocks fit in worker 1's 20 free ones: the holder keeps the prompt.
        let (fits, overlap, resp) = route(&envoy, &with_new(8, 1_000));
        assert_eq!(
            (fits, overlap),
            (1, 64),
            "admission {admission}: costs {:?} loads {:?}",
            costs(&resp),
            resp.header("x-kv-router-loads")
        );
        // 60 new blocks do not: ~360 ms of waiting for room on worker 1 against ~9 ms more
        // prefill and decode on worker 2.
        let (big, _, resp) = route(&envoy, &with_new(60, 2_000));
        let expect = if admission { 2 } else { 1 };
        assert_eq!(
            big,
            expect,
            "admission {admission}: costs {:?}",
            costs(&resp)
        );
    }
}

#[test]
fn a_mixed_fleet_is_priced_at_each_workers_own_speed() {
    let workers = echo_workers(2, BLOCK);
    // Worker 2's engine is four times faster (another GPU generation): its polynomials are the
    // defaults divided by 4.
    let slow = [16.5, 0.0152, 4.21e-7];
    let fast: Vec<f64> = slow.iter().map(|c| c / 4.0).collect();
    let list = |own: bool| {
        let mut second = json!({"id": 2, "address": workers[1].addr});
        if own {
            second["prefill_time_ms_poly"] = json!(fast);
            second["decode_step_ms_poly"] = json!([5.74 / 4.0, 54.01 / 4.0, -25.74 / 4.0]);
        }
        json!([{"id": 1, "address": workers[0].addr}, second])
    };
    let prompt = |i: u32| completion(&tokens(30_000 * (i + 1), 125 * BLOCK));

    // The predicted-TTFT policy is the subject, with exact predictions: the polynomials' own
    // (`learn` off).
    let ttft = json!({"learn": false});
    // The booked prefill below must stay in full until its first token (no decay over its
    // predicted ~92 ms): the held-back first token is the fast worker's queue.
    let load = json!({"prefill_load_model": "none"});
    // One polynomial for the fleet: two idle workers tie and split the prompts.
    let same = envoy_with(
        &workers,
        json!({"mode": "kv", "policy": "predicted", "ttft": ttft, "load": load,
               "workers": list(false)}),
    );
    let split = distribution(&same, 30, prompt);
    assert!(split.len() == 2, "a tie splits: {split:?}");
    drop(same);

    // Each worker's own: the fast one is predicted at a quarter of the slow one's time (2,000
    // tokens: 48.6 against 12.1 ms) and takes every prompt while both are idle.
    let envoy = envoy_with(
        &workers,
        json!({"mode": "kv", "policy": "predicted", "ttft": ttft, "load": load,
               "workers": list(true)}),
    );
    let (w, _, resp) = route(&envoy, &prompt(100));
    let c = costs(&resp);
    let expect_slow = 16.5 + 0.0152 * 2000.0 + 4.21e-7 * 2000.0 * 2000.0;
    assert_eq!(w, 2, "costs {c:?}");
    assert!((c[&1] - expect_slow).abs() < 0.5, "costs {c:?}");
    assert!((c[&2] - expect_slow / 4.0).abs() < 0.2, "costs {c:?}");
    let idle = distribution(&envoy, 20, prompt);
    assert_eq!(idle.get(&1), None, "the fast worker is idle: {idle:?}");

    // A 16,000-token prefill booked on the fast worker (its first token held back 3 s) puts a
    // 2,000-token prompt there at ~99 ms, against 48.6 ms on the idle slow one.
    let long = json!({"model": "m", "prompt": tokens(1, 1000 * BLOCK), "stream": true, "max_tokens": 2,
        "nvext": {"backend_instance_id": 2}, "mock": {"first_token_delay_ms": 3000, "chunks": 2, "chunk_interval_ms": 3000}});
    let listener = envoy.listener.clone();
    let holder = std::thread::spawn(move || {
        let mut s = stream_completion(&listener, &long).expect("long");
        let _ = s.next_event();
        s.abort();
    });
    assert!(envoy.wait_for(Duration::from_secs(10), |e| {
        e.router_stat("worker.2.rank.0.prefill_tokens") > 0
    }));
    let busy = distribution(&envoy, 5, |i| prompt(200 + i));
    assert_eq!(
        busy.get(&2),
        None,
        "the fast worker's queue costs more: {busy:?}"
    );
    holder.join().expect("long request");
}

/// At the defaults (the adaptive policy), a worker's own timing polynomials price it from the
/// first request: the cost is scaled by its polynomial's time over the fleet's, on top of what
/// is learned against that polynomial (which, for an accurate one, is what every worker learns).
#[test]
fn at_the_defaults_a_workers_own_timing_prices_it_from_the_first_request() {
    let workers = echo_workers(2, BLOCK);
    // Worker 2 four times faster: its prefill polynomial is the fleet's divided by 4.
    let fleet = [16.5, 0.0152, 4.21e-7];
    let fast: Vec<f64> = fleet.iter().map(|c| c / 4.0).collect();
    let list = |own: bool| {
        let mut second = json!({"id": 2, "address": workers[1].addr});
        if own {
            second["prefill_time_ms_poly"] = json!(fast);
        }
        json!([{"id": 1, "address": workers[0].addr}, second])
    };
    let prompt = |i: u32| completion(&tokens(30_000 * (i + 1), 125 * BLOCK));
    let config = |own: bool, ttft: Value| {
        json!({"mode": "kv", "load": {"prefill_time_ms_poly": fleet}, "ttft": ttft,
               "workers": list(own)})
    };

    // Without it, the first prompt finds two idle workers at the same cost.
    let same = envoy_with(&workers, config(false, json!({})));
    let c = costs(&route(&same, &prompt(0)).2);
    assert!((c[&1] - c[&2]).abs() < 1e-6 * c[&1], "costs {c:?}");
    drop(same);

    // With it, worker 2 costs a quarter (the ratio of the polynomials at 4,096 tokens) and
    // takes the first prompt, learning on.
    let envoy = envoy_with(&workers, config(true, json!({})));
    let (w, _, resp) = route(&envoy, &prompt(1));
    let c = costs(&resp);
    let ratio = c[&1] / c[&2];
    assert_eq!(w, 2, "costs {c:?}");
    assert!((ratio - 4.0).abs() < 0.01, "costs {c:?}");
    drop(envoy);

    // Nothing learned (`ttft.learn: false`): the fast worker takes every prompt of an idle
    // fleet, the request-share term allowing it four times the slow one's share.
    let envoy = envoy_with(&workers, config(true, json!({"learn": false})));
    let idle = distribution(&envoy, 20, |i| prompt(10 + i));
    assert_eq!(idle.get(&1), None, "{idle:?}");
    assert_eq!(idle.get(&2), Some(&20), "{idle:?}");
}
