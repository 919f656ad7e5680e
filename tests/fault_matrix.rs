//! The fault matrix against the real Envoy: each case injects one fault while 64 clients stream
//! completions and then checks what a user relies on: no request lost that Envoy could have
//! served (retries and the fallback hosts in the destination header carry requests past a dead
//! worker), each failure one of the requests in flight on what failed (counted), the filter's
//! load gauges back to 0, the index equal to what the workers' dumps hold, Envoy healthy.
//!
//! Already covered elsewhere, not repeated here: event pages that are garbage, oversized, of the
//! wrong block size or a 500 (`kv_routing.rs`), the oversized-dump backoff and an absurd cursor
//! (`event_faults.rs`), hostile clients (`client_trust.rs`), a full 16k-block dump at the defaults
//! (`full_cache_resync.rs`).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
mod faults;
use common::*;
use faults::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Concurrent streaming clients of the background traffic.
const CLIENTS: usize = 64;

/// What one background request saw.
#[derive(Debug)]
struct Outcome {
    /// The worker that answered (`x-worker-id`), if a response head arrived.
    worker: Option<u64>,
    sent: Instant,
    ended: Instant,
    /// `"ok"` (a 200 stream through `[DONE]`), `"cut"` (a 200 stream ended early), else the
    /// status and body, or the transport error.
    result: String,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.result == "ok"
    }
}

/// Requests sent in the background while a fault happens, and what came back.
struct Traffic {
    stop: Arc<AtomicBool>,
    /// Requests finished so far (any outcome).
    done: Arc<AtomicU64>,
    threads: Vec<JoinHandle<Vec<Outcome>>>,
}

impl Traffic {
    /// [`CLIENTS`] clients, each streaming completions over `prompts` in turn (one request at a
    /// time, 5 chunks 40 ms apart), until [`Traffic::finish`].
    fn start(envoy: &Envoy, prompts: Vec<Vec<u32>>) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let prompts = Arc::new(prompts);
        let threads = (0..CLIENTS)
            .map(|client| {
                let (addr, flag, prompts) = (
                    envoy.listener.clone(),
                    Arc::clone(&stop),
                    Arc::clone(&prompts),
                );
                let done = Arc::clone(&done);
                std::thread::spawn(move || {
                    let mut outcomes = Vec::new();
                    let mut i = client;
                    while !flag.load(Ordering::Relaxed) {
                        let mut body = completion(&prompts[i % prompts.len()]);
                        body["stream"] = json!(true);
                        body["mock"] = json!({"chunks": 5, "chunk_interval_ms": 40});
                        i += 1;
                        outcomes.push(stream_once(&addr, &body));
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    outcomes
                })
            })
            .collect();
        let traffic = Traffic {
            stop,
            done,
            threads,
        };
        traffic.flows();
        traffic
    }

    /// Waits (at most 30 s) until two requests per client more have finished: the traffic is
    /// in full flow before a fault, and still flows after the recovery.
    fn flows(&self) {
        let want = self.done.load(Ordering::Relaxed) + 2 * CLIENTS as u64;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.done.load(Ordering::Relaxed) < want {
            assert!(
                Instant::now() < deadline,
                "the traffic stalled: {} of {want} requests done",
                self.done.load(Ordering::Relaxed)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Lets the traffic flow on after the recovery ([`Traffic::flows`]), then stops it; what
    /// every request saw.
    fn finish(self) -> Vec<Outcome> {
        self.flows();
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    }
}

/// One streamed completion, read to its end.
fn stream_once(addr: &str, body: &Value) -> Outcome {
    let sent = Instant::now();
    let outcome = |worker, result: String| Outcome {
        worker,
        sent,
        ended: Instant::now(),
        result,
    };
    let mut resp = match http::request_streaming(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        Duration::from_secs(30),
    ) {
        Ok(r) => r,
        Err(e) => return outcome(None, format!("transport error: {e}")),
    };
    let worker = resp.header("x-worker-id").and_then(|w| w.parse().ok());
    if resp.status != 200 {
        let status = resp.status;
        let text = resp
            .read_to_end()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        return outcome(worker, format!("{status} {text}"));
    }
    loop {
        match resp.next_event() {
            Ok(Some(e)) if e.data == "[DONE]" => return outcome(worker, "ok".into()),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return outcome(worker, "cut".into()),
        }
    }
}

/// Outcome counts by result (and serving worker), for messages.
fn tally(outcomes: &[Outcome]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for o in outcomes {
        let key = match o.worker {
            Some(w) if !o.ok() => format!("{} (worker {w})", o.result),
            _ => o.result.clone(),
        };
        *counts.entry(key).or_insert(0) += 1;
    }
    counts
}

/// What Envoy answers for a request that was on a worker when the worker died before the head of
/// its answer: with the shipped `retry_on` (connect-failure, refused-stream,
/// reset-before-request) it does not resend a request the worker may have started (`reset` in
/// `retry_on` would, at the cost of running it twice). After the head, the stream is cut.
const IN_FLIGHT_AT_KILL: &str =
    "503 upstream connect error or disconnect/reset before headers. reset reason: connection termination";

/// Every request succeeded except requests in flight on worker `failed` while it died (between
/// `down.0` and `down.1`): each failure was sent before it was down, ended after it went down,
/// and was on it (a cut stream from it, or Envoy's reset-before-headers 503). Returns (requests,
/// failures, requests that were in flight on it or before their head while it died).
fn assert_only_in_flight_failed(
    outcomes: &[Outcome],
    failed: u64,
    down: (Instant, Instant),
    what: &str,
) -> (usize, usize, usize) {
    let ok = outcomes.iter().filter(|o| o.ok()).count();
    assert!(
        ok > 0,
        "{what}: no traffic went through: {:?}",
        tally(outcomes)
    );
    let exposed =
        |o: &&Outcome| o.sent < down.1 && o.ended >= down.0 && o.worker.is_none_or(|w| w == failed);
    let in_flight = outcomes.iter().filter(exposed).count();
    let failures: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok()).collect();
    for f in &failures {
        let on_it = (f.result == "cut" && f.worker == Some(failed))
            || (f.result == IN_FLIGHT_AT_KILL && f.worker.is_none());
        assert!(
            on_it && exposed(f),
            "{what}: a failure not in flight on worker {failed} as it died: {f:?}; all: {:?}",
            tally(outcomes)
        );
    }
    println!(
        "{what}: {} requests from {CLIENTS} clients, {} failed, {in_flight} in flight on worker {failed} as it died: {:?}",
        outcomes.len(),
        failures.len(),
        tally(outcomes)
    );
    (outcomes.len(), failures.len(), in_flight)
}

/// After a VM crash (the crashing request between `crash.0` and `crash.1`; the reload seen by
/// `reloaded`), what Envoy does to the VM's requests: the streams in flight through it are cut
/// (FAIL_RELOAD fails the streams of a failed VM), and requests arriving before the reload get
/// an empty fast 503. Every failure is one of those; every other request succeeded. Returns
/// (requests, failures, streams in flight at the crash).
fn assert_only_crash_window_failed(
    outcomes: &[Outcome],
    crash: (Instant, Instant),
    reloaded: Instant,
    what: &str,
) -> (usize, usize, usize) {
    let in_flight = |o: &&Outcome| o.sent < crash.1 && o.ended >= crash.0;
    let in_flight_count = outcomes.iter().filter(in_flight).count();
    let failures: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok()).collect();
    let failed_in_flight = failures.iter().filter(|f| in_flight(f)).count();
    println!(
        "{what}: {} requests from {CLIENTS} clients, {} failed: {failed_in_flight} of the \
         {in_flight_count} in flight at the crash, {} sent before the reload: {:?}",
        outcomes.len(),
        failures.len(),
        failures.len() - failed_in_flight,
        tally(outcomes)
    );
    for f in &failures {
        let cut_at_crash = f.result == "cut" && in_flight(f);
        let reload_window = f.result == "503 " && f.ended >= crash.0 && f.sent <= reloaded;
        assert!(
            cut_at_crash || reload_window,
            "{what}: a failure outside the crash and reload window: {f:?}; all: {:?}",
            tally(outcomes)
        );
    }
    assert!(
        outcomes.len() > 2 * failures.len(),
        "{what}: most requests served"
    );
    (outcomes.len(), failures.len(), in_flight_count)
}

/// Every request succeeded (and there were some).
fn assert_all_served(outcomes: &[Outcome], what: &str) {
    let ok = outcomes.iter().filter(|o| o.ok()).count();
    println!(
        "{what}: {} requests from {CLIENTS} clients, {} failed",
        outcomes.len(),
        outcomes.len() - ok
    );
    assert!(ok > 0, "{what}: no traffic went through");
    assert_eq!(
        ok,
        outcomes.len(),
        "{what}: failed requests: {:?}",
        tally(outcomes)
    );
}

/// The after-fault checks: Envoy ready, load gauges back to 0 (every booking released, none
/// reaped).
fn assert_recovered(envoy: &Envoy) {
    assert!(
        http::get(&envoy.admin, "/ready").is_ok_and(|r| r.status == 200),
        "envoy ready"
    );
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| load_gauges(e) == 0),
        "load gauges back to 0 (sum now {})",
        load_gauges(envoy)
    );
    assert_eq!(envoy.router_stat("load.reaped"), 0, "released, not reaped");
}

/// The index holds exactly the (block, worker) entries the `workers`' dumps list.
fn assert_index_matches(envoy: &Envoy, workers: &[&Worker]) {
    let expected = || -> u64 {
        workers
            .iter()
            .map(|w| dump_blocks(std::slice::from_ref(*w)))
            .sum()
    };
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| e.router_stat("index.entries")
            == expected()),
        "index {} entries, dumps {} blocks",
        envoy.router_stat("index.entries"),
        expected()
    );
}

fn echo_config(workers: &[Worker], extra: Value) -> Value {
    let mut config = json!({"block_size": BLOCK, "events": {"poll_interval_ms": 100,
                                                             "stale_after_ms": 1500}});
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    filter_config(workers, config)
}

fn echo_envoy(workers: &[Worker], extra: Value) -> Envoy {
    start_envoy(workers, echo_config(workers, extra))
}

/// As [`echo_envoy`], with every worker on `"kv_mode": "events"` ([`events_only`]): the overlaps
/// are the events' (and [`cache_on`] waits for the event, not for a probe's own predicted
/// blocks).
fn echo_envoy_on_events(workers: &[Worker], extra: Value) -> Envoy {
    start_envoy(workers, events_only(echo_config(workers, extra)))
}

/// The most blocks of `body`'s prompt the index credits any worker with
/// (`x-kv-router-max-overlap-blocks`). Under 64 clients' load the pick may rightly go to an idle
/// worker rather than the holder of the prefix, so the tests read the index from this while the
/// traffic runs, and check where a prompt goes once it has stopped.
fn credited(envoy: &Envoy, body: &Value) -> u32 {
    let (_, _, resp) = route(envoy, body);
    resp.header("x-kv-router-max-overlap-blocks")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Probes with `body` until some worker is credited at least `blocks` (or `limit` passes).
fn wait_for_credit(envoy: &Envoy, body: &Value, blocks: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if credited(envoy, body) >= blocks {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Publishes `prompt` as stored on `worker` and waits until the router credits it there.
fn cache_on(envoy: &Envoy, worker: &Worker, prompt: &[u32], first_hash: u64) {
    publish(
        worker,
        vec![vllm_stored(prompt, BLOCK, None, first_hash, "GPU")],
    );
    let blocks = prompt.len() as u32 / BLOCK;
    assert!(
        wait_for_credit(envoy, &completion(prompt), blocks, Duration::from_secs(10)),
        "worker {} credited with the prompt",
        worker.id
    );
}

#[test]
fn a_worker_killed_mid_stream_truncates_that_stream_only() {
    let mut workers = echo_workers(3, BLOCK);
    // Events only: worker 1 alone holds `on_1` (a probe predicted on worker 3 would tie it).
    let envoy = echo_envoy_on_events(&workers, json!({}));
    let on_1 = tokens(1000, 4 * BLOCK);
    let on_2 = tokens(2000, 4 * BLOCK);
    cache_on(&envoy, &workers[0], &on_1, 1);
    cache_on(&envoy, &workers[1], &on_2, 1);
    let traffic = Traffic::start(&envoy, vec![tokens(9000, 2 * BLOCK), on_2.clone()]);

    // A long stream to worker 1 (it holds the prompt): 40 chunks 100 ms apart.
    let mut body = completion(&on_1);
    body["stream"] = json!(true);
    body["mock"] = json!({"chunks": 40, "chunk_interval_ms": 100});
    let mut stream = http::request_streaming(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(stream.status, 200);
    assert_eq!(stream.header("x-worker-id"), Some("1"));
    assert!(stream.next_chunk().unwrap().is_some(), "the stream started");
    let down = Instant::now();
    workers[0].kill();
    let down = (down, Instant::now());
    // What Envoy can do once the answer has started: end the stream early, without [DONE].
    let rest = stream.read_to_end();
    assert!(
        rest.as_ref()
            .map_or(true, |b| !String::from_utf8_lossy(b).contains("[DONE]")),
        "the stream was cut: {rest:?}"
    );

    // Worker 1's prompt is served elsewhere (a retry to the next-best host while worker 1 is
    // still listed, load alone once it is stale); worker 2 keeps its prefix.
    for _ in 0..20 {
        let (worker, _, _) = route(&envoy, &completion(&on_1));
        assert_ne!(worker, 1);
    }
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("workers.stale")
            == 1)
    );
    assert_eq!(
        credited(&envoy, &completion(&on_2)),
        4,
        "worker 2 keeps its prefix"
    );
    assert_only_in_flight_failed(&traffic.finish(), 1, down, "a worker killed");
    assert_eq!(
        route(&envoy, &completion(&on_2)).0,
        2,
        "and is chosen for it"
    );
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[1], &workers[2]]);
}

#[test]
fn a_worker_restarted_with_an_empty_cache_and_reset_ids_is_resynced() {
    let mut workers = echo_workers(2, BLOCK);
    // Events only: the traffic's predicted blocks would keep crediting the blocks the restart
    // lost.
    let envoy = echo_envoy_on_events(&workers, json!({}));
    let before = tokens(3000, 5 * BLOCK);
    // Five events: the filter's cursor on worker 1 reaches 5.
    for b in 0..5 {
        let block = &before[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize];
        let parent = (b > 0).then(|| u64::from(b));
        publish(
            &workers[0],
            vec![vllm_stored(block, BLOCK, parent, u64::from(b) + 1, "GPU")],
        );
    }
    assert!(wait_for_credit(
        &envoy,
        &completion(&before),
        5,
        Duration::from_secs(10)
    ));
    let resyncs = envoy.router_stat("events.resyncs");
    let traffic = Traffic::start(&envoy, vec![before.clone(), tokens(9100, 2 * BLOCK)]);

    // The engine restarts on its address: nothing cached, event ids from 1 again.
    let down = Instant::now();
    workers[0].restart().unwrap();
    let down = (down, Instant::now());
    let after = tokens(4000, 3 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(&after, BLOCK, None, 1, "GPU")],
    );
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("events.resyncs")
            > resyncs),
        "the id reset is noticed and the worker re-synced from its dump"
    );
    assert!(
        wait_for_credit(&envoy, &completion(&after), 3, Duration::from_secs(10)),
        "the new cache is indexed"
    );
    assert_eq!(
        credited(&envoy, &completion(&before)),
        0,
        "the blocks lost in the restart are no longer credited"
    );
    assert_only_in_flight_failed(&traffic.finish(), 1, down, "an engine restarted empty");
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

#[test]
fn a_slow_or_silent_event_source_costs_no_request() {
    let workers = echo_workers(3, BLOCK);
    // Worker 3's events address is a port nobody listens on: its event source says nothing.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let mut config = filter_config(
        &workers,
        json!({"block_size": BLOCK, "events": {"poll_interval_ms": 100, "stale_after_ms": 1500,
                                               "timeout_ms": 500}}),
    );
    config["workers"][2]["events_address"] = json!(closed_addr);
    // Events only: the traffic's predicted blocks on worker 2 would be credited while worker 1
    // is stale, and the re-sync "seen" without its dump.
    let envoy = start_envoy(&workers, events_only(config));
    let prompt = tokens(5000, 4 * BLOCK);
    cache_on(&envoy, &workers[0], &prompt, 1);
    let traffic = Traffic::start(&envoy, vec![prompt.clone(), tokens(9200, 2 * BLOCK)]);

    // Worker 1's event source hangs: every call times out; a block published meanwhile lands
    // once it answers again.
    let failed = envoy.router_stat("events.fetch_failed");
    workers[0]
        .admin("/admin/events_fault", &json!({"mode": "hang"}))
        .unwrap();
    let more = tokens(5000, 6 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(
            &more[(4 * BLOCK) as usize..],
            BLOCK,
            Some(4),
            5,
            "GPU",
        )],
    );
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .router_stat("events.fetch_failed")
            >= failed + 2),
        "the hung calls time out"
    );
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("workers.stale")
            >= 2),
        "workers 1 (hung) and 3 (silent) go stale"
    );
    assert_eq!(
        credited(&envoy, &completion(&prompt)),
        0,
        "a stale worker's blocks are not credited"
    );
    workers[0]
        .admin("/admin/events_fault", &json!({"mode": "none"}))
        .unwrap();
    assert!(
        wait_for_credit(&envoy, &completion(&more), 6, Duration::from_secs(10)),
        "re-synced after the hang, the block published meanwhile included"
    );
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("workers.stale")
            == 1),
        "worker 1 is fresh again, worker 3 stays silent"
    );
    assert_all_served(&traffic.finish(), "traffic while events hang or fail");
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

#[test]
fn clients_disconnecting_during_the_body_or_the_stream_leak_nothing() {
    let workers = echo_workers(2, BLOCK);
    let envoy = echo_envoy(&workers, json!({}));
    let traffic = Traffic::start(
        &envoy,
        vec![tokens(9500, 2 * BLOCK), tokens(9600, 3 * BLOCK)],
    );
    for i in 0..20 {
        disconnect_during_body(&envoy.listener, &completion(&tokens(6000 + i * 100, 64)));
    }
    for i in 0..10 {
        let mut body = completion(&tokens(7000 + i * 100, 64));
        body["stream"] = json!(true);
        body["mock"] = json!({"chunks": 50, "chunk_interval_ms": 100});
        disconnect_mid_stream(&envoy.listener, &body);
    }
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("routed.kv")
            >= 10),
        "the streamed requests were routed (and booked)"
    );
    assert_all_served(&traffic.finish(), "clients disconnecting");
    assert_recovered(&envoy);
    // Envoy noticed the aborts (downstream resets), and serves the next client.
    let stats = envoy.stats();
    assert!(
        stats
            .get("http.llm.downstream_rq_rx_reset")
            .copied()
            .unwrap_or(0)
            + stats
                .get("http.llm.downstream_cx_destroy_remote_active_rq")
                .copied()
                .unwrap_or(0)
            >= 10,
        "downstream aborts counted"
    );
    route(&envoy, &completion(&tokens(8000, 64)));
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

/// The test-only build whose VM traps on a request header (`scripts/build-wasm.sh
/// --crash-trigger`, part of `make wasm`).
fn crash_trigger_wasm() -> std::path::PathBuf {
    let path = envoy_kv_router_tools::harness::workspace_root()
        .join("target/envoy_kv_router_crash_trigger.wasm");
    assert!(
        path.is_file(),
        "{} is missing: build it with `bash scripts/build-wasm.sh --crash-trigger` (`make wasm`)",
        path.display()
    );
    path
}

#[test]
fn a_vm_crash_is_reloaded_and_the_state_rebuilt_under_traffic() {
    let workers = echo_workers(2, BLOCK);
    // A booking whose VM died with it is reaped after this (the reloaded VM cannot release it).
    let config = filter_config(
        &workers,
        json!({"block_size": BLOCK, "events": {"poll_interval_ms": 100},
               "load": {"request_timeout_ms": 2000}}),
    );
    // Events only: the index the reloaded VM rebuilt is the subject (a probe's own predicted
    // blocks would give the overlap without it).
    let config = events_only(config);
    let envoy = start_envoy_with(&workers, config, |o| {
        o.wasm = Some(crash_trigger_wasm());
        o.concurrency = 1;
    });
    let prompt = tokens(11000, 4 * BLOCK);
    cache_on(&envoy, &workers[1], &prompt, 1);
    let traffic = Traffic::start(&envoy, vec![prompt.clone(), tokens(9300, 2 * BLOCK)]);
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("routed.kv")
            >= 20)
    );

    let crash_sent = Instant::now();
    let crash = envoy
        .send(
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-kv-router-test-crash", "1"),
            ],
            completion(&prompt).to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(crash.status, 503, "the request that crashed the VM");
    let crash_at = (crash_sent, Instant::now());
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| {
            e.stats()
                .get("wasm.kv_router.vm_reload_success")
                .is_some_and(|n| *n >= 1)
        }),
        "Envoy reloaded the VM"
    );
    let reloaded = Instant::now();
    // The reloaded VM routes on the index it rebuilt (shared log / dumps) and on new events.
    assert!(
        wait_for_credit(&envoy, &completion(&prompt), 4, Duration::from_secs(10)),
        "the index is back after the reload"
    );
    let fresh = tokens(12000, 3 * BLOCK);
    cache_on(&envoy, &workers[0], &fresh, 1);
    assert_only_crash_window_failed(
        &traffic.finish(),
        crash_at,
        reloaded,
        "a VM crash under traffic",
    );
    for _ in 0..50 {
        route(&envoy, &completion(&fresh));
    }
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| load_gauges(e) == 0),
        "load back to 0 (a booking of the dead VM reaped: {})",
        envoy.router_stat("load.reaped")
    );
    // With the dead VM's bookings reaped, the prompt goes where it is cached.
    assert_eq!(route(&envoy, &completion(&prompt)).0, 2);
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

#[test]
fn a_filter_configuration_update_under_traffic_loses_nothing() {
    let workers = echo_workers(3, BLOCK);
    // Events only: the index surviving the swaps is the subject (a probe's own predicted blocks
    // would give the overlap without it).
    let config = events_only(fault_config(&workers));
    let envoy_workers = &workers;
    let mut envoy = start_envoy_with(envoy_workers, config.clone(), |o| {
        o.dynamic_listener = true;
    });
    let prompt = tokens(13000, 4 * BLOCK);
    cache_on(&envoy, &workers[2], &prompt, 1);
    let reason = |envoy: &Envoy| {
        let resp = envoy
            .post_json("/v1/completions", &completion(&prompt))
            .unwrap();
        assert_eq!(resp.status, 200);
        resp.header("x-kv-router-reason").unwrap_or("").to_string()
    };
    assert_eq!(reason(&envoy), "kv");
    let traffic = Traffic::start(&envoy, vec![prompt.clone(), tokens(9400, 2 * BLOCK)]);
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("routed.kv")
            >= 20)
    );

    // Swap the routing mode while the traffic runs, and back.
    let mut round_robin = config.clone();
    round_robin["mode"] = json!("round-robin");
    envoy.update_filter_config(round_robin).unwrap();
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| reason(e) == "round-robin"),
        "the new configuration routes"
    );
    let before = envoy.router_stat("routed.round-robin");
    assert!(envoy.wait_for(Duration::from_secs(10), |e| e
        .router_stat("routed.round-robin")
        >= before + 20));
    envoy.update_filter_config(config).unwrap();
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| reason(e) == "kv"),
        "and the old one again"
    );
    // The index survived both swaps: the prompt still goes where it is cached.
    assert!(wait_for_credit(
        &envoy,
        &completion(&prompt),
        4,
        Duration::from_secs(10)
    ));
    assert_all_served(
        &traffic.finish(),
        "traffic across two configuration updates",
    );
    assert_eq!(route(&envoy, &completion(&prompt)).0, 3);
    assert_eq!(
        envoy
            .stats()
            .get("listener_manager.lds.update_rejected")
            .copied()
            .unwrap_or(0),
        0
    );
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[0], &workers[1], &workers[2]]);
}

/// A VM reloaded after a crash when the log is more than its ring (64 batches) long catches up
/// from the index snapshot (written and loaded in parts), not by losing sync: it holds every
/// block the worker's dump lists, including those whose batches the ring no longer has.
#[test]
fn a_vm_reloaded_beyond_the_log_ring_loads_the_index_snapshot() {
    let workers = echo_workers(1, BLOCK);
    let config = filter_config(
        &workers,
        // A booking whose VM died with it is reaped after this (the reloaded VM cannot
        // release it).
        json!({"block_size": BLOCK, "events": {"poll_interval_ms": 50},
               "load": {"request_timeout_ms": 2000}}),
    );
    // Events only: the oldest prompt must be credited from the snapshot, not from the probes'
    // own predicted blocks.
    let config = events_only(config);
    let envoy = start_envoy_with(&workers, config, |o| {
        o.wasm = Some(crash_trigger_wasm());
        o.concurrency = 1;
    });
    // One publish per batch (each waits until indexed): more batches than the ring holds.
    for i in 0..80u32 {
        let prompt = tokens(20000 + i * 100, 2 * BLOCK);
        let first = 1000 + u64::from(i) * 10;
        publish(
            &workers[0],
            vec![vllm_stored(&prompt, BLOCK, None, first, "GPU")],
        );
        let want = u64::from(i + 1) * 2;
        assert!(
            envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("index.entries")
                >= want),
            "publish {i} indexed"
        );
    }
    assert_eq!(envoy.router_stat("log.snapshot_loaded"), 0);
    let traffic = Traffic::start(
        &envoy,
        vec![tokens(9700, 2 * BLOCK), tokens(20000, 2 * BLOCK)],
    );
    let crash_sent = Instant::now();
    let crash = envoy
        .send(
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-kv-router-test-crash", "1"),
            ],
            completion(&tokens(20000, 2 * BLOCK)).to_string().as_bytes(),
        )
        .unwrap();
    assert_eq!(crash.status, 503, "the request that crashed the VM");
    let crash_at = (crash_sent, Instant::now());
    // Envoy reloads the VM on the next request.
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| {
            let _ = e.send(
                "/v1/completions",
                &[("content-type", "application/json")],
                completion(&tokens(90000, BLOCK)).to_string().as_bytes(),
            );
            e.stats()
                .get("wasm.kv_router.vm_reload_success")
                .is_some_and(|n| *n >= 1)
        }),
        "Envoy reloaded the VM"
    );
    let reloaded = Instant::now();
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| e
            .router_stat("log.snapshot_loaded")
            >= 1),
        "the reloaded VM loaded the snapshot (lost sync {})",
        envoy.router_stat("log.lost_sync")
    );
    assert_index_matches(&envoy, &[&workers[0]]);
    // The oldest prompt's batch left the ring long ago: the reloaded VM routes on it anyway.
    assert!(
        wait_for_credit(
            &envoy,
            &completion(&tokens(20000, 2 * BLOCK)),
            2,
            Duration::from_secs(10)
        ),
        "the oldest prompt is still credited"
    );
    assert_only_crash_window_failed(
        &traffic.finish(),
        crash_at,
        reloaded,
        "a VM reloaded beyond the ring",
    );
    assert!(
        envoy.wait_for(Duration::from_secs(15), |e| load_gauges(e) == 0),
        "load back to 0 (a booking of the dead VM reaped: {})",
        envoy.router_stat("load.reaped")
    );
    assert_index_matches(&envoy, &[&workers[0]]);
}

#[test]
fn a_worker_that_refuses_connections_costs_no_request() {
    let workers = echo_workers(2, BLOCK);
    // Worker 3 is listed (in the filter and in Envoy's cluster) at an address that refuses
    // connections: its events fail, and every request sent there is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let mut config = echo_config(&workers, json!({}));
    config["workers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"id": 3, "address": closed_addr}));
    // Events only: the index is then exactly the live workers' events.
    let config = events_only(config);
    let mut addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    addrs.push(closed_addr);
    let envoy = Envoy::start(&EnvoyOptions::new(config, addrs)).expect("start envoy");
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("workers.stale")
            == 1),
        "worker 3 goes stale"
    );
    let prompt = tokens(14000, 4 * BLOCK);
    cache_on(&envoy, &workers[0], &prompt, 1);
    let refused = |e: &Envoy| {
        e.stats()
            .get("cluster.llm_workers.upstream_cx_connect_fail")
            .copied()
            .unwrap_or(0)
    };
    let before = refused(&envoy);
    let traffic = Traffic::start(&envoy, vec![tokens(9900, 2 * BLOCK), prompt.clone()]);
    // An idle stale worker is routed on load alone: some requests go there first, are refused,
    // and Envoy retries them on the fallback hosts the filter listed.
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| refused(e) > before),
        "requests were sent to the refusing worker"
    );
    let outcomes = traffic.finish();
    println!(
        "a worker refusing connections: {} connections refused, retried",
        refused(&envoy) - before
    );
    assert_all_served(&outcomes, "a worker refusing connections");
    assert!(
        outcomes.iter().all(|o| o.worker != Some(3)),
        "nothing served by worker 3"
    );
    assert_eq!(route(&envoy, &completion(&prompt)).0, 1, "prefix routing");
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

#[test]
fn an_event_gap_under_traffic_is_closed_by_the_dump() {
    let workers = echo_workers(2, BLOCK);
    // Events only: the dump alone says what worker 1 holds after the gap.
    let envoy = echo_envoy_on_events(&workers, json!({}));
    let lost = tokens(15000, 4 * BLOCK);
    cache_on(&envoy, &workers[0], &lost, 1);
    let traffic = Traffic::start(&envoy, vec![lost.clone(), tokens(9950, 2 * BLOCK)]);
    let (gaps, resyncs) = (
        envoy.router_stat("events.gaps"),
        envoy.router_stat("events.resyncs"),
    );
    // Worker 1 loses 3 event ids and its buffer (its dump then holds only what follows).
    workers[0]
        .admin("/admin/drop_events", &json!({"count": 3}))
        .unwrap();
    let after = tokens(16000, 3 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(&after, BLOCK, None, 100, "GPU")],
    );
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("events.gaps")
            > gaps
            && e.router_stat("events.resyncs") > resyncs),
        "the gap is seen and closed by the dump"
    );
    assert!(
        wait_for_credit(&envoy, &completion(&after), 3, Duration::from_secs(10)),
        "the block after the gap is indexed"
    );
    assert_eq!(
        credited(&envoy, &completion(&lost)),
        0,
        "the blocks the dump no longer lists are dropped"
    );
    assert_all_served(&traffic.finish(), "an event gap");
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

#[test]
fn a_bridge_restarted_under_traffic_is_resynced_from_its_dump() {
    let mut workers = Worker::spawn_many_bridged(2, BLOCK, &ENGINE_ARGS).expect("bridged engines");
    let config = filter_config(
        &workers,
        json!({"block_size": BLOCK, "events": {"poll_interval_ms": 100, "stale_after_ms": 1500}}),
    );
    // Events only: the index is then exactly what the engines' events (through the bridges) say.
    let envoy = start_envoy(&workers, events_only(config));
    // Served by engine 1 directly: its cache (and, through its bridge, the index) holds it.
    let prompt = tokens(17000, 8 * BLOCK);
    let resp = workers[0]
        .admin("/v1/completions", &completion(&prompt))
        .unwrap();
    assert_eq!(resp.status, 200);
    assert!(
        wait_for_credit(&envoy, &completion(&prompt), 8, Duration::from_secs(10)),
        "indexed through the bridge"
    );
    let traffic = Traffic::start(&envoy, vec![prompt.clone(), tokens(9970, 2 * BLOCK)]);
    let resyncs = envoy.router_stat("events.resyncs");
    // The bridge restarts on its address: a mirror rebuilt from the engine's replay buffer, new
    // event ids.
    workers[0].bridge.as_mut().unwrap().restart().unwrap();
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e.router_stat("events.resyncs")
            > resyncs),
        "the filter re-syncs from the new bridge's dump"
    );
    assert!(
        wait_for_credit(&envoy, &completion(&prompt), 8, Duration::from_secs(10)),
        "the engine's blocks are back"
    );
    assert_all_served(&traffic.finish(), "a bridge restarted");
    assert_recovered(&envoy);
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}

#[test]
fn an_envoy_hot_restart_under_traffic_loses_nothing() {
    let workers = echo_workers(2, BLOCK);
    // Events only: the new process's index comes from the workers' dumps alone.
    let config = events_only(echo_config(&workers, json!({})));
    let mut envoy = start_envoy_with(&workers, config, |o| o.hot_restart = true);
    let prompt = tokens(18000, 4 * BLOCK);
    cache_on(&envoy, &workers[0], &prompt, 1);
    let traffic = Traffic::start(&envoy, vec![prompt.clone(), tokens(9990, 2 * BLOCK)]);
    // A new Envoy process takes over the listener; the old one drains (1 s) and exits (3 s).
    envoy.hot_restart().unwrap();
    assert!(
        wait_for_credit(&envoy, &completion(&prompt), 4, Duration::from_secs(10)),
        "the new process's VM re-synced from the workers' dumps"
    );
    assert!(
        envoy.wait_parent_exit(Duration::from_secs(15)),
        "the old process drained and exited"
    );
    assert_all_served(&traffic.finish(), "an Envoy hot restart");
    assert_recovered(&envoy);
    assert_eq!(route(&envoy, &completion(&prompt)).0, 1, "prefix routing");
    assert_index_matches(&envoy, &[&workers[0], &workers[1]]);
}
