//! The soak (`make soak`; a 3-minute run in `make test`, `SOAK_SECONDS=180`): mixed traffic through the real Envoy for
//! `SOAK_MINUTES` (default 30) while faults are injected on a schedule, Envoy's resident memory
//! sampled every `SOAK_SAMPLE_SECS` (default 5) into a CSV.
//!
//! Workers are engine-mode mocks (a bounded prefix cache that evicts, so the index churns) on a
//! static list. Faults, one every `SOAK_FAULT_EVERY_SECS` (default 15), in turn: a worker
//! restarted (empty cache, event ids from 1), a worker's event source returning garbage, hanging,
//! oversized pages or 500s for a few seconds, a worker leaving (killed) and joining again (started
//! on its address) a few seconds later, bursts of clients disconnecting during the request body
//! and during a streamed answer. Joins and leaves use the static worker list (stop/restart);
//! dynamic membership is another branch's work.
//!
//! At the end: no client error but those of requests in flight on a worker that died (at most one
//! per client per death), load back to 0 (no leaked bookings, none reaped), the index equal to the blocks the
//! workers' dumps hold, Envoy's memory flat after warm-up. Results go to `target/soak/` (or
//! `SOAK_OUT_DIR`): `memory.csv` (one sample per line) and `summary.json`, also printed.
//! `SOAK_SECONDS` overrides the duration for a short try-out.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
mod faults;
use common::*;
use faults::*;
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WORKERS: u64 = 4;
const CLIENTS: usize = 4;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    ok: AtomicU64,
    streamed_ok: AtomicU64,
    /// Client-visible errors by kind (status + Envoy's reason, or the transport error).
    errors: Mutex<BTreeMap<String, u64>>,
    /// When each error was seen, to tell those of a worker's death from any other.
    error_times: Mutex<Vec<Instant>>,
}

impl Tally {
    fn error(&self, kind: String) {
        *self.errors.lock().unwrap().entry(kind).or_insert(0) += 1;
        self.error_times.lock().unwrap().push(Instant::now());
    }
    fn error_count(&self) -> u64 {
        self.errors.lock().unwrap().values().sum()
    }
}

/// Classifies a failed answer the way a user would report it.
fn error_kind(status: u16, body: &str) -> String {
    let reason = body
        .split("reset reason: ")
        .nth(1)
        .map(|r| r.split(',').next().unwrap_or(r).trim().to_string())
        .unwrap_or_else(|| body.chars().take(60).collect());
    format!("{status} {reason}")
}

/// One client's loop: prompts from a shared pool of prefixes (so the index matters), plain and
/// streamed completions.
fn client_loop(envoy_addr: String, seed: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let mut rng = seed;
    while !stop.load(Ordering::Relaxed) {
        rng = envoy_kv_router_tools::util::splitmix64(rng);
        let prompt = soak_prompt(rng);
        let stream = rng % 4 == 0;
        let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 8, "stream": stream});
        tally.sent.fetch_add(1, Ordering::Relaxed);
        let bytes = body.to_string();
        let headers = [("content-type", "application/json")];
        if stream {
            match http::request_streaming(
                &envoy_addr,
                "POST",
                "/v1/completions",
                &headers,
                bytes.as_bytes(),
                Duration::from_secs(30),
            ) {
                Ok(resp) if resp.status == 200 => match resp.read_to_end() {
                    Ok(body) if String::from_utf8_lossy(&body).contains("[DONE]") => {
                        tally.streamed_ok.fetch_add(1, Ordering::Relaxed);
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => tally.error("200 truncated stream".into()),
                    Err(e) => tally.error(format!("200 stream cut: {}", e.kind())),
                },
                Ok(resp) => {
                    let status = resp.status;
                    let text = resp.into_response().map(|r| r.text()).unwrap_or_default();
                    tally.error(error_kind(status, &text));
                }
                Err(e) => tally.error(format!("transport: {}", e.kind())),
            }
        } else {
            match envoy_request(&envoy_addr, bytes.as_bytes()) {
                Ok(resp) if resp.status == 200 => {
                    tally.ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(resp) => tally.error(error_kind(resp.status, &resp.text())),
                Err(e) => tally.error(format!("transport: {}", e.kind())),
            }
        }
    }
}

fn envoy_request(addr: &str, body: &[u8]) -> std::io::Result<http::Response> {
    http::request(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body,
        Duration::from_secs(30),
    )
}

/// A prompt from one of 64 shared 4-block prefixes plus a 2-block suffix from a few hundred.
fn soak_prompt(rng: u64) -> Vec<u32> {
    let group = (rng % 64) as u32;
    let suffix = ((rng >> 8) % 300) as u32;
    let mut prompt = tokens(group * 1000, 4 * BLOCK);
    prompt.extend(tokens(100_000 + suffix * 100, 2 * BLOCK));
    prompt
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    WorkerRestart,
    EventsGarbage,
    EventsHang,
    EventsOversized,
    EventsNothing,
    WorkerLeaveJoin,
    ClientDisconnectBody,
    ClientDisconnectStream,
}

const SCHEDULE: [Fault; 8] = [
    Fault::WorkerRestart,
    Fault::EventsGarbage,
    Fault::ClientDisconnectBody,
    Fault::EventsHang,
    Fault::WorkerLeaveJoin,
    Fault::EventsOversized,
    Fault::ClientDisconnectStream,
    Fault::EventsNothing,
];

fn name(fault: Fault) -> &'static str {
    match fault {
        Fault::WorkerRestart => "worker restarted (empty cache, ids reset)",
        Fault::EventsGarbage => "event source: garbage",
        Fault::EventsHang => "event source: slow (hangs)",
        Fault::EventsOversized => "event source: oversized pages",
        Fault::EventsNothing => "event source: nothing (HTTP 500)",
        Fault::WorkerLeaveJoin => "worker left and joined again",
        Fault::ClientDisconnectBody => "client disconnects during the body (x10)",
        Fault::ClientDisconnectStream => "client disconnects mid-stream (x10)",
    }
}

/// Injects `fault` on `workers[victim]`; returns when it has been undone, with the number of
/// client requests it sent itself.
fn inject(fault: Fault, workers: &Mutex<Vec<Worker>>, victim: usize, envoy_addr: &str) -> u64 {
    let events_fault = |mode: &str| {
        let w = workers.lock().unwrap();
        let _ = w[victim].admin("/admin/events_fault", &json!({"mode": mode}));
    };
    let hold = Duration::from_secs(4);
    let mut sent = 0;
    match fault {
        Fault::WorkerRestart => workers.lock().unwrap()[victim]
            .restart()
            .expect("restart worker"),
        Fault::EventsGarbage
        | Fault::EventsHang
        | Fault::EventsOversized
        | Fault::EventsNothing => {
            let mode = match fault {
                Fault::EventsGarbage => "malformed",
                Fault::EventsHang => "hang",
                Fault::EventsOversized => "oversized",
                _ => "http_500",
            };
            events_fault(mode);
            std::thread::sleep(hold);
            events_fault("none");
        }
        Fault::WorkerLeaveJoin => {
            workers.lock().unwrap()[victim].kill();
            std::thread::sleep(hold);
            workers.lock().unwrap()[victim]
                .restart()
                .expect("rejoin worker");
        }
        Fault::ClientDisconnectBody => {
            for i in 0..10 {
                disconnect_during_body(envoy_addr, &completion(&soak_prompt(i)));
                sent += 1;
            }
        }
        Fault::ClientDisconnectStream => {
            for i in 0..10u64 {
                let body = json!({"model": "mock", "prompt": soak_prompt(i + 7), "max_tokens": 64,
                                  "stream": true});
                disconnect_mid_stream(envoy_addr, &body);
                sent += 1;
            }
        }
    }
    sent
}

#[test]
#[ignore = "the soak runs for SOAK_MINUTES (30 by default): `make soak`"]
fn soak() {
    let minutes = env_u64("SOAK_MINUTES", 30);
    let sample_every = Duration::from_secs(env_u64("SOAK_SAMPLE_SECS", 5));
    let fault_every = Duration::from_secs(env_u64("SOAK_FAULT_EVERY_SECS", 15));
    // SOAK_SECONDS: a short run (for trying the soak itself out), overrides SOAK_MINUTES.
    let duration = Duration::from_secs(env_u64("SOAK_SECONDS", minutes * 60));
    let out_dir = std::env::var_os("SOAK_OUT_DIR").map_or_else(
        || envoy_kv_router_tools::harness::workspace_root().join("target/soak"),
        std::path::PathBuf::from,
    );
    std::fs::create_dir_all(&out_dir).unwrap();

    let workers = engine_workers(WORKERS);
    let envoy = start_envoy_with(&workers, fault_config(&workers), |o| o.concurrency = 2);
    let workers = Arc::new(Mutex::new(workers));
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (addr, stop, tally) = (envoy.listener.clone(), stop.clone(), tally.clone());
            std::thread::spawn(move || client_loop(addr, 0x50a4 + i as u64, stop, tally))
        })
        .collect();

    let mut csv = std::fs::File::create(out_dir.join("memory.csv")).unwrap();
    writeln!(csv, "elapsed_s,envoy_rss_kib,requests_sent,client_errors,faults,load_active_entries,index_entries,wasm_linear_memory_bytes").unwrap();
    let start = Instant::now();
    let mut next_sample = start;
    let mut next_fault = start + fault_every;
    let mut faults: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut fault_n = 0usize;
    let mut disconnect_requests = 0u64;
    let mut samples: Vec<(u64, u64)> = Vec::new();
    // While a worker dies (killed or restarted) the requests in flight on it may fail: at most
    // one per client, from the fault's start to a second after it is undone.
    let mut death_windows: Vec<(Instant, Instant)> = Vec::new();
    while start.elapsed() < duration {
        let now = Instant::now();
        if now >= next_sample {
            let rss = envoy.rss_kib().unwrap_or(0);
            let elapsed = start.elapsed().as_secs();
            samples.push((elapsed, rss));
            writeln!(
                csv,
                "{elapsed},{rss},{},{},{},{},{},{}",
                tally.sent.load(Ordering::Relaxed),
                tally.error_count(),
                faults.values().sum::<u64>(),
                envoy.router_stat("load.active_entries"),
                envoy.router_stat("index.entries"),
                envoy.router_stat("vm.linear_memory_bytes")
            )
            .unwrap();
            csv.flush().unwrap();
            next_sample += sample_every;
        }
        if now >= next_fault {
            let fault = SCHEDULE[fault_n % SCHEDULE.len()];
            let victim = (fault_n / SCHEDULE.len()) % WORKERS as usize;
            let began = Instant::now();
            disconnect_requests += inject(fault, &workers, victim, &envoy.listener);
            if matches!(fault, Fault::WorkerRestart | Fault::WorkerLeaveJoin) {
                death_windows.push((began, Instant::now() + Duration::from_secs(1)));
            }
            *faults.entry(name(fault)).or_insert(0) += 1;
            fault_n += 1;
            next_fault = Instant::now() + fault_every;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let workers = workers.lock().unwrap();

    // Quiet: every booking released, nothing reaped; the index equals what the workers hold.
    let drained = envoy.wait_for(Duration::from_secs(30), |e| load_gauges(e) == 0);
    let leaked = envoy.router_stat("load.active_entries");
    let per_rank_leaks = load_gauges(&envoy);
    let reaped = envoy.router_stat("load.reaped");
    let expected_blocks = dump_blocks(&workers);
    let consistent = envoy.wait_for(Duration::from_secs(30), |e| {
        e.router_stat("index.entries") == dump_blocks(&workers)
    });
    let index_entries = envoy.router_stat("index.entries");

    let rss_at = |from: u64| {
        samples
            .iter()
            .find(|(t, _)| *t >= from)
            .or(samples.last())
            .map_or(0, |s| s.1)
    };
    // A third of a short run (60 s of 3 minutes), 5 minutes of a long one: the VMs' linear
    // memory grows in steps while the index fills, and in a 3-minute run its last step came at
    // 25-40 s (30.8 MB in every run, 2026-12-06), which a sixth (30 s) split at random.
    let warmup_s = (duration.as_secs() / 3).min(300);
    let rss_start = samples.first().map_or(0, |s| s.1);
    let rss_warm = rss_at(warmup_s);
    let rss_end = samples.last().map_or(0, |s| s.1);
    let rss_max_after_warmup = samples
        .iter()
        .filter(|(t, _)| *t >= warmup_s)
        .map(|s| s.1)
        .max()
        .unwrap_or(0);
    let errors = tally.errors.lock().unwrap().clone();
    let error_times = tally.error_times.lock().unwrap().clone();
    let in_window = |t: &Instant| death_windows.iter().any(|(a, b)| a <= t && t <= b);
    let errors_outside_faults = error_times.iter().filter(|t| !in_window(t)).count();
    let worst_window = death_windows
        .iter()
        .map(|(a, b)| error_times.iter().filter(|t| a <= *t && *t <= b).count())
        .max()
        .unwrap_or(0);
    // Memory: the least-squares slope of RSS over the last two thirds, projected over them.
    let tail: Vec<(f64, f64)> = samples
        .iter()
        .filter(|(t, _)| *t >= duration.as_secs() / 3)
        .map(|&(t, r)| (t as f64, r as f64))
        .collect();
    let slope_kib_per_s = {
        let n = tail.len() as f64;
        let (mt, mr) = (
            tail.iter().map(|p| p.0).sum::<f64>() / n.max(1.0),
            tail.iter().map(|p| p.1).sum::<f64>() / n.max(1.0),
        );
        let var: f64 = tail.iter().map(|p| (p.0 - mt).powi(2)).sum();
        let cov: f64 = tail.iter().map(|p| (p.0 - mt) * (p.1 - mr)).sum();
        if var > 0.0 {
            cov / var
        } else {
            0.0
        }
    };
    let tail_span_s = tail.last().map_or(0.0, |l| l.0) - tail.first().map_or(0.0, |f| f.0);
    let projected_growth_kib = slope_kib_per_s * tail_span_s;
    let summary = json!({
        "seconds": duration.as_secs(),
        "requests_sent": tally.sent.load(Ordering::Relaxed) + disconnect_requests,
        "client_disconnects": disconnect_requests,
        "requests_ok": tally.ok.load(Ordering::Relaxed),
        "streamed_ok": tally.streamed_ok.load(Ordering::Relaxed),
        "client_errors": errors.values().sum::<u64>(),
        "client_errors_by_kind": errors,
        "client_errors_outside_worker_deaths": errors_outside_faults,
        "worker_deaths": death_windows.len(),
        "most_errors_in_one_worker_death": worst_window,
        "faults_injected": faults,
        "faults_total": fault_n,
        "leaked_load_entries": leaked,
        "leaked_load_gauges_sum": per_rank_leaks,
        "load_reaped": reaped,
        "index_entries": index_entries,
        "worker_dump_blocks": expected_blocks,
        "envoy_stats": {
            "retries": envoy.stats().get("cluster.llm_workers.upstream_rq_retry").copied().unwrap_or(0),
            "upstream_resets": envoy.stats().get("cluster.llm_workers.upstream_rq_rx_reset").copied().unwrap_or(0),
            "events_pages_rejected": envoy.router_stat("events.pages_rejected"),
            "events_resyncs": envoy.router_stat("events.resyncs"),
            "events_fetch_failed": envoy.router_stat("events.fetch_failed"),
        },
        "envoy_rss_kib": {"start": rss_start, "after_warmup": rss_warm, "warmup_s": warmup_s,
                          "max_after_warmup": rss_max_after_warmup, "end": rss_end,
                          "slope_last_two_thirds_kib_per_min": slope_kib_per_s * 60.0,
                          "growth_over_last_two_thirds_kib": projected_growth_kib},
    });
    let text = serde_json::to_string_pretty(&summary).unwrap();
    std::fs::write(out_dir.join("summary.json"), &text).unwrap();
    println!("soak summary ({}):\n{text}", out_dir.display());

    assert_eq!(
        errors_outside_faults, 0,
        "client errors outside worker deaths: {errors:?}"
    );
    assert!(
        worst_window <= CLIENTS,
        "{worst_window} errors in one worker death, more than the {CLIENTS} clients"
    );
    assert!(drained && leaked == 0, "leaked load entries: {leaked}");
    assert_eq!(per_rank_leaks, 0, "load gauges left above 0");
    assert_eq!(reaped, 0, "bookings reaped instead of released");
    assert!(
        consistent,
        "index {index_entries} entries, dumps {expected_blocks} blocks"
    );
    // No trend: over the last two thirds the fitted slope adds under 5% of the memory. A run
    // under 10 minutes is still warming up there (caches and pools filling to their bounds:
    // +3.6 and +5.6 MB in two 3-minute runs, against +0.1 MB in the 30-minute one), so only a
    // long run is held to it; the short one keeps the bound on the peak below.
    assert!(
        duration < Duration::from_secs(600) || projected_growth_kib <= rss_warm as f64 * 0.05,
        "envoy RSS trends up: {:.0} KiB/min over the last two thirds ({projected_growth_kib:.0} KiB)",
        slope_kib_per_s * 60.0
    );
    // Flat after warm-up: within 10% of the post-warm-up figure (allocator noise, no trend).
    assert!(
        rss_max_after_warmup <= rss_warm + rss_warm / 10,
        "envoy RSS grew after warm-up: {rss_warm} -> max {rss_max_after_warmup} KiB"
    );
}
