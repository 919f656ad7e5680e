//! Membership from Envoy: the filter follows the worker cluster's hosts (filesystem EDS, or a
//! STATIC cluster through the admin path) and their health, through a real Envoy.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use envoy_kv_router_tools::harness::{Discovery, ADMIN_CLUSTER, WORKER_CLUSTER};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

fn membership(max_workers: u32) -> Value {
    json!({"cluster": WORKER_CLUSTER, "admin_cluster": ADMIN_CLUSTER,
           "poll_interval_ms": 100, "max_workers": max_workers})
}

/// An Envoy whose worker cluster holds `initial` (EDS or STATIC per `discovery`) and a filter
/// that lists `static_workers` (possibly none) and follows the cluster.
fn start(
    initial: &[&Worker],
    static_workers: &[&Worker],
    discovery: Discovery,
    extra: Value,
) -> Envoy {
    let list: Vec<Value> = static_workers.iter().map(|w| w.filter_entry()).collect();
    let mut config = json!({"block_size": BLOCK, "response_headers": true,
        "client_routing_hints": "honor", "workers": list, "membership": membership(4),
        "events": {"poll_interval_ms": 50}});
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    let mut opts = EnvoyOptions::new(config, initial.iter().map(|w| w.addr.clone()).collect());
    opts.discovery = Some(discovery);
    opts.route_timeout = Duration::from_millis(1500);
    Envoy::start(&opts).expect("start envoy")
}

fn eds() -> Discovery {
    Discovery {
        eds: true,
        ..Discovery::default()
    }
}

/// The candidates the filter scored for one request (worker ids in `x-kv-router-costs`).
fn candidates(envoy: &Envoy, body: &Value) -> (u64, usize) {
    let (served, _, resp) = route(envoy, body);
    (served, costs(&resp).len())
}

fn addrs(ws: &[&Worker]) -> Vec<String> {
    ws.iter().map(|w| w.addr.clone()).collect()
}

#[test]
fn eds_workers_join_and_leave_without_a_reload() {
    let workers = echo_workers(3, BLOCK);
    let (w1, w2, w3) = (&workers[0], &workers[1], &workers[2]);
    // Discovered workers on events only: worker 3's blocks come from its events and leave with
    // it (the probes' predicted blocks would stay on workers 1 and 2).
    let mut pool = membership(4);
    pool["worker"] = json!({"kv_mode": "events"});
    let envoy = start(&[w1, w2], &[], eds(), json!({"membership": pool}));
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("membership.workers")
            == 2),
        "two hosts discovered"
    );
    for i in 0..20 {
        let (served, n) = candidates(&envoy, &completion(&tokens(i * 100, 40)));
        assert!(served == 1 || served == 2, "served by {served}");
        assert_eq!(n, 2, "only the cluster's hosts are candidates");
    }

    // Worker 3 already caches a prompt; it joins through EDS and its KV events count.
    let prompt = tokens(5000, 4 * BLOCK);
    publish(w3, vec![vllm_stored(&prompt, BLOCK, None, 900, "GPU")]);
    envoy.set_endpoints(&addrs(&[w1, w2, w3])).unwrap();
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("membership.workers")
            == 3),
        "worker 3 discovered"
    );
    let body = completion(&prompt);
    assert!(
        wait_for_overlap(&envoy, &body, 4, Duration::from_secs(10)),
        "worker 3's blocks are routable"
    );
    let (served, overlap, _) = route(&envoy, &body);
    assert_eq!(
        (served, overlap),
        (3, 4),
        "the cached prefix goes to the new worker"
    );
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("index.entries")
            >= 4)
    );
    // An event it publishes after joining (an event page, not the dump) counts too.
    let later = tokens(6000, 2 * BLOCK);
    publish(w3, vec![vllm_stored(&later, BLOCK, None, 950, "GPU")]);
    assert!(
        wait_for_overlap(&envoy, &completion(&later), 2, Duration::from_secs(10)),
        "an event published after joining counts"
    );
    assert_eq!(route(&envoy, &completion(&later)).0, 3);

    // Worker 3 leaves: it stops being a candidate and its blocks leave the index.
    envoy.set_endpoints(&addrs(&[w1, w2])).unwrap();
    let removed = Instant::now();
    let gone = envoy.wait_for(Duration::from_secs(10), |e| {
        candidates(e, &completion(&tokens(7000, 40))).1 == 2
    });
    let took = removed.elapsed();
    assert!(gone, "worker 3 still a candidate");
    eprintln!(
        "figure: removed worker out of the candidates {} ms after the EDS file changed",
        took.as_millis()
    );
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("index.entries")
            == 0)
    );
    for i in 0..20 {
        let (served, overlap, _) = route(&envoy, &completion(&prompt));
        assert_ne!(served, 3, "request {i} reached the removed worker");
        assert_eq!(overlap, 0);
    }
    assert_eq!(envoy.router_stat("membership.joined"), 3);
    assert_eq!(envoy.router_stat("membership.left"), 1);

    // It comes back (a rollout): a fresh entry syncs from its dump again.
    envoy.set_endpoints(&addrs(&[w1, w2, w3])).unwrap();
    assert!(
        wait_for_overlap(&envoy, &body, 4, Duration::from_secs(10)),
        "re-synced after rejoining"
    );
}

#[test]
fn unhealthy_and_ejected_hosts_are_not_chosen_with_the_static_list_as_override() {
    let workers = echo_workers(3, BLOCK);
    let all: Vec<&Worker> = workers.iter().collect();
    // STATIC cluster read through admin; the static list gives ids (override) for the same hosts.
    let discovery = Discovery {
        eds: false,
        health_checks: true,
        outlier_consecutive_5xx: Some(3),
    };
    let envoy = start(&all, &all, discovery, json!({}));
    assert!(envoy.wait_for(Duration::from_secs(10), |e| {
        e.router_stat("membership.workers") == 3 && e.router_stat("membership.unhealthy") == 0
    }));

    // Worker 2 fails its health checks.
    let fault =
        |w: &Worker, v: Value| assert_eq!(w.admin("/admin/serve_fault", &v).unwrap().status, 200);
    fault(&workers[1], json!({"health": 503}));
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("membership.unhealthy")
            == 1),
        "health check failure seen: {:?}",
        envoy.cluster_hosts()
    );
    for i in 0..30 {
        let (served, n) = candidates(&envoy, &completion(&tokens(i * 100, 40)));
        assert_ne!(
            served, 2,
            "request {i} chose the host failing health checks"
        );
        assert_eq!(n, 2);
    }
    fault(&workers[1], json!({"health": 200}));
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("membership.unhealthy")
        == 0));
    assert!(envoy.wait_for(Duration::from_secs(5), |e| candidates(
        e,
        &completion(&tokens(1, 40))
    )
    .1 == 3));

    // Worker 3 answers 500: three pinned requests and outlier detection ejects it.
    fault(&workers[2], json!({"completions": 500}));
    for _ in 0..3 {
        let resp = envoy
            .send(
                "/v1/completions",
                &[("x-worker-instance-id", "3")],
                completion(&tokens(9, 40)).to_string().as_bytes(),
            )
            .unwrap();
        assert_eq!(resp.status, 500);
    }
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("membership.unhealthy")
            == 1),
        "outlier ejection seen: {:?}",
        envoy.cluster_hosts()
    );
    for i in 0..30 {
        let (served, n) = candidates(&envoy, &completion(&tokens(i * 100 + 50, 40)));
        assert_ne!(served, 3, "request {i} chose the ejected host");
        assert_eq!(n, 2);
    }
    // A pin on the ejected host is refused rather than sent to a failing host.
    let resp = envoy
        .send(
            "/v1/completions",
            &[("x-worker-instance-id", "3")],
            completion(&tokens(9, 40)).to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(resp.status, 404, "{}", resp.text());
}

#[test]
fn load_returns_to_zero_with_workers_joining_and_leaving_during_a_thousand_mixed_requests() {
    let workers = echo_workers(4, BLOCK);
    let all: Vec<&Worker> = workers.iter().collect();
    let envoy = start(
        &all,
        &[],
        eds(),
        json!({"mode": "kv", "load": {"track_output_blocks": true}}),
    );
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("membership.workers")
        == 4));
    let listener = envoy.listener.clone();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Workers 3 and 4 leave and rejoin in turn while the requests run.
    let churn = {
        let done = std::sync::Arc::clone(&done);
        let sets: Vec<Vec<String>> = vec![
            addrs(&[all[0], all[1], all[2]]),
            addrs(&[all[0], all[1]]),
            addrs(&[all[0], all[1], all[3]]),
            addrs(&all),
        ];
        let dir = envoy.dir.clone();
        std::thread::spawn(move || {
            let mut changes = 0u32;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let doc = envoy_kv_router_tools::harness::eds_document(
                    &sets[changes as usize % sets.len()],
                );
                let tmp = dir.join("eds.json.tmp");
                std::fs::write(&tmp, doc.to_string()).unwrap();
                std::fs::rename(&tmp, dir.join("eds.json")).unwrap();
                changes += 1;
                std::thread::sleep(Duration::from_millis(250));
            }
            changes
        })
    };
    send_mixed_requests(&listener);
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let changes = churn.join().unwrap();
    envoy.set_endpoints(&addrs(&all)).unwrap();
    let settled = envoy.wait_for(Duration::from_secs(10), |e| total_load(e) == (0, 0));
    assert!(
        settled,
        "load left after all requests ended: {:?}",
        total_load(&envoy)
    );
    assert_eq!(envoy.router_stat("load.release_failed"), 0);
    let (joined, left) = (
        envoy.router_stat("membership.joined"),
        envoy.router_stat("membership.left"),
    );
    eprintln!("figure: {changes} EDS changes during the run; membership.joined {joined}, membership.left {left}");
    assert!(left >= 2, "workers left during the run: {left}");
    assert!(joined >= 4 + 2, "workers rejoined during the run: {joined}");
    // Every worker back: the gauge set is fixed (pool of 4), nothing grew.
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("membership.workers")
        == 4));
    let stats = envoy.stats();
    let gauges: Vec<&String> = stats
        .keys()
        .filter(|k| k.starts_with("wasmcustom.kv_router.worker."))
        .collect();
    // 3 load gauges per slot and, with the default `ttft.learn`, 2 learned-timing gauges
    // (`timing_factor_milli`, `timing_samples`) per worker entry.
    let timing = gauges.iter().filter(|k| k.contains(".timing_")).count();
    assert_eq!(
        (gauges.len() - timing, timing),
        (4 * 3, 4 * 2),
        "per-slot gauges stay one set per pool entry: {gauges:?}"
    );
}

/// A discovered worker describes itself on its event page: its models (and capacity) replace the
/// template's on its pool entry, so a request for a model only it serves goes to it; a DP layout
/// the template's slots do not reserve is refused (counted), the rest applied.
#[test]
fn a_discovered_worker_describes_itself_on_its_event_page() {
    let workers = echo_workers(3, BLOCK);
    let (w1, w2, w3) = (&workers[0], &workers[1], &workers[2]);
    let described = json!({"block_size": BLOCK, "dp_size": 4, "kv_capacity_blocks": 500,
                           "models": ["mock", "only-on-3"]});
    assert_eq!(w3.admin("/admin/describe", &described).unwrap().status, 200);
    let mut m = membership(4);
    m["worker"] = json!({"models": ["mock"]});
    let envoy = start(&[w1, w2, w3], &[], eds(), json!({"membership": m}));
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("membership.described")
            == 1),
        "worker 3's description applied"
    );
    assert_eq!(envoy.router_stat("membership.description_refused"), 1);
    let special =
        |i: u32| json!({"model": "only-on-3", "prompt": tokens(i * 100, 40), "max_tokens": 4});
    for i in 0..20 {
        assert_eq!(route(&envoy, &special(i)).0, 3, "request {i} for only-on-3");
    }
    for i in 0..10 {
        let served = route(&envoy, &completion(&tokens(9000 + i * 100, 40))).0;
        assert!((1..=3).contains(&served), "served by {served}");
    }
    // Without its description (an old worker's page) worker 3 falls back to the template, which
    // does not serve the model.
    assert_eq!(
        w3.admin("/admin/describe", &Value::Null).unwrap().status,
        200
    );
    let _ = w3.admin("/admin/reset", &json!({}));
    envoy.set_endpoints(&addrs(&[w1, w2])).unwrap();
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("membership.workers")
        == 2));
    envoy.set_endpoints(&addrs(&[w1, w2, w3])).unwrap();
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("membership.workers")
        == 3));
    let resp = envoy
        .post_json("/v1/completions", &special(1))
        .expect("request");
    assert_ne!(
        resp.status,
        200,
        "only-on-3 is served by nobody now: {}",
        resp.text()
    );
}

/// A static `workers` entry for a discovered host wins over the host's own description.
#[test]
fn a_static_entry_wins_over_the_hosts_description() {
    let workers = echo_workers(2, BLOCK);
    let (w1, w2) = (&workers[0], &workers[1]);
    let described = json!({"models": ["only-on-2"], "kv_capacity_blocks": 10});
    assert_eq!(w2.admin("/admin/describe", &described).unwrap().status, 200);
    // Events only: the overlap waited for below is worker 2's event (proof its page was read),
    // not a probe's own predicted blocks.
    let mut m = membership(4);
    m["worker"] = json!({"models": ["mock"], "kv_mode": "events"});
    let mut fixed = w2.filter_entry();
    fixed["models"] = json!(["mock"]);
    fixed["kv_mode"] = json!("events");
    let list = vec![fixed];
    let mut config = json!({"block_size": BLOCK, "response_headers": true,
        "client_routing_hints": "honor", "workers": list, "membership": m,
        "events": {"poll_interval_ms": 50}});
    config["membership"]["first_id"] = json!(10);
    let mut opts = EnvoyOptions::new(config, addrs(&[w1, w2]));
    opts.discovery = Some(eds());
    let envoy = Envoy::start(&opts).expect("start envoy");
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("membership.workers")
        == 2));
    // Its events are polled (so its page, with the description, was read) ...
    publish(
        w2,
        vec![vllm_stored(
            &tokens(100, 2 * BLOCK),
            BLOCK,
            None,
            900,
            "GPU",
        )],
    );
    assert!(wait_for_overlap(
        &envoy,
        &completion(&tokens(100, 2 * BLOCK)),
        2,
        Duration::from_secs(10)
    ));
    // ... but the static entry's models stand.
    let resp = envoy
        .post_json(
            "/v1/completions",
            &json!({"model": "only-on-2", "prompt": tokens(1, 40), "max_tokens": 4}),
        )
        .expect("request");
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(envoy.router_stat("membership.described"), 0);
}

/// A discovered worker's timing on its page (`kv-event-bridge --worker-prefill-time-ms-poly`)
/// prices it in the TTFT policy: the faster of two idle workers takes every prompt.
#[test]
fn a_discovered_worker_is_priced_at_its_described_speed() {
    let workers = echo_workers(2, BLOCK);
    let (w1, w2) = (&workers[0], &workers[1]);
    let fast = json!({"prefill_time_ms_poly": [4.125, 0.0038, 1.0525e-7],
                      "decode_step_ms_poly": [1.435, 13.5025, -6.435]});
    assert_eq!(w2.admin("/admin/describe", &fast).unwrap().status, 200);
    // The predicted-TTFT policy is the subject, with exact predictions: the polynomials' own
    // (`learn` off).
    let envoy = start(
        &[w1, w2],
        &[],
        eds(),
        json!({"policy": "predicted", "ttft": {"learn": false}}),
    );
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("membership.described")
            == 1),
        "worker 2's description applied"
    );
    // 2,000 tokens: 48.6 ms at the template's (the fleet's) polynomial, a quarter on worker 2.
    let prompt = |i: u32| completion(&tokens(40_000 * (i + 1), 125 * BLOCK));
    let (_, _, resp) = route(&envoy, &prompt(0));
    let mut c: Vec<f64> = costs(&resp).into_values().collect();
    c.sort_by(f64::total_cmp);
    assert!(
        (c[0] - 12.14).abs() < 0.1 && (c[1] - 48.58).abs() < 0.2,
        "{c:?}"
    );
    for i in 1..20 {
        assert_eq!(route(&envoy, &prompt(i)).0, 2, "prompt {i}");
    }
}
