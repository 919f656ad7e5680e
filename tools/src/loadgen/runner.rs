//! Runs a workload on a tokio runtime with a `reqwest` client: every request is a task that
//! streams its answer (SSE) and stamps each event on arrival.
//!
//! Timing: TTFT is measured from just before the request is handed to the client (so it includes
//! connecting when no pooled connection is free) to the arrival of the first SSE chunk carrying
//! text; ITL is the gap between consecutive text chunks (the engine mock sends one token per
//! chunk); end-to-end runs to the end of the stream. Timed workloads send each request at its
//! arrival offset, at most `max_in_flight` at once (a request held back by that cap records its
//! lateness in `send_delay_ms`); closed-loop workloads run N clients that each send their next
//! request when the last one ends. Connections are kept alive and reused.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::CONTENT_TYPE;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::stats::{
    scrape_workers_async, ClientUsage, RequestResult, RunStats, Summary, WorkerCounters,
};
use super::{Arrival, RequestSpec, Workload};
use crate::client::{base_url, to_io_error};
use crate::sse::EventStream;
use crate::sys;

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub model: String,
    pub path: String,
    /// Connect timeout, and idle timeout of every read (the head, then each body piece).
    pub timeout: Duration,
    /// Cap on concurrent requests of a timed workload.
    pub max_in_flight: usize,
    pub extra_headers: Vec<(String, String)>,
    /// Merged into every request body (top-level keys override): engine options, or a mock
    /// worker's `mock` controls.
    pub extra_body: Option<Value>,
    /// Runs the workload as a closed loop of this many clients, whatever its own arrival.
    pub concurrency: Option<usize>,
    /// Closed loop: the clients start evenly spread over this period instead of all at once.
    pub ramp_up: Duration,
    /// Mock workers whose `/metrics` are scraped before and after the run (cache hit rate,
    /// server-side TTFT, worker CPU).
    pub worker_addrs: Vec<String>,
    /// Progress lines on stderr every this often (`None`: silent).
    pub progress_every: Option<Duration>,
    /// Label shown in progress lines.
    pub label: String,
    /// Chat requests (`messages`) are sent as their token ids to `/v1/completions` instead
    /// (the token-id baseline of a chat workload).
    pub chat_as_ids: bool,
    /// How the requests are spread over several targets (Envoy replicas).
    pub spread: Spread,
}

/// How a load balancer in front of several Envoy replicas spreads the requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Spread {
    /// Each request to the next replica.
    #[default]
    RoundRobin,
    /// Client affinity (a hash of the client, as of its address or a session header): every
    /// request of a client to the same replica; a request without a client round-robin.
    ByClient,
}

impl Spread {
    /// The target (of `n`) for request `i` of client `client`.
    pub fn target(self, i: usize, client: Option<u64>, n: usize) -> usize {
        let n = n.max(1);
        match (self, client) {
            (Spread::ByClient, Some(c)) => (crate::util::splitmix64(c) % n as u64) as usize,
            _ => i % n,
        }
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            model: "mock-model".into(),
            path: "/v1/completions".into(),
            timeout: Duration::from_secs(600),
            max_in_flight: 2048,
            extra_headers: Vec::new(),
            extra_body: None,
            concurrency: None,
            ramp_up: Duration::ZERO,
            worker_addrs: Vec::new(),
            progress_every: Some(Duration::from_secs(2)),
            label: String::new(),
            chat_as_ids: false,
            spread: Spread::RoundRobin,
        }
    }
}

/// Live counters of a run (progress lines and the achieved concurrency).
#[derive(Default)]
struct Gauges {
    sent: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
    in_flight: AtomicUsize,
    open_streams: AtomicUsize,
    peak_in_flight: AtomicUsize,
    peak_open_streams: AtomicUsize,
}

/// Holds one unit of a gauge until dropped, keeping its peak.
struct Held<'a>(&'a AtomicUsize);

impl<'a> Held<'a> {
    fn new(gauge: &'a AtomicUsize, peak: &AtomicUsize) -> Held<'a> {
        let now = gauge.fetch_add(1, Ordering::Relaxed) + 1;
        peak.fetch_max(now, Ordering::Relaxed);
        Held(gauge)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What every request task shares.
struct Run {
    http: reqwest::Client,
    urls: Vec<String>,
    opts: RunOptions,
    requests: Vec<RequestSpec>,
    gauges: Gauges,
    start: Instant,
}

impl Run {
    fn url_for(&self, i: usize) -> &str {
        let client = self.requests.get(i).and_then(|r| r.client);
        let target = self.opts.spread.target(i, client, self.urls.len());
        self.urls.get(target).map_or("", String::as_str)
    }

    fn record(&self, r: &RequestResult) {
        if !r.ok {
            self.gauges.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.gauges.done.fetch_add(1, Ordering::Relaxed);
    }

    fn elapsed_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0
    }
}

/// The JSON body the load generator sends for `spec`.
pub fn body_for(spec: &RequestSpec, opts: &RunOptions) -> Vec<u8> {
    let mut body = json!({
        "model": opts.model,
        "max_tokens": spec.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match &spec.messages {
        Some(messages) if !opts.chat_as_ids => body["messages"] = messages.clone(),
        _ => body["prompt"] = json!(spec.tokens),
    }
    if let (Some(target), Some(Value::Object(extra))) = (body.as_object_mut(), &opts.extra_body) {
        for (k, v) in extra {
            target.insert(k.clone(), v.clone());
        }
    }
    serde_json::to_vec(&body).unwrap_or_default()
}

fn chunk_text(v: &Value) -> Option<&str> {
    let choice = v["choices"].get(0)?;
    choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
}

/// A short, groupable description of an error: its kind, or its message when the kind says
/// nothing.
fn describe(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::Other => e.to_string(),
        kind => kind.to_string(),
    }
}

/// Sends one streamed request and measures it.
async fn run_one(run: &Run, url: &str, spec: &RequestSpec) -> RequestResult {
    let opts = &run.opts;
    let mut req = run
        .http
        .post(url)
        .header(CONTENT_TYPE, "application/json")
        .body(body_for(spec, opts));
    for (k, v) in &opts.extra_headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let mut r = RequestResult {
        prompt_tokens: spec.tokens.len(),
        ..RequestResult::default()
    };
    let g = &run.gauges;
    g.sent.fetch_add(1, Ordering::Relaxed);
    let _in_flight = Held::new(&g.in_flight, &g.peak_in_flight);
    let t0 = Instant::now();
    let elapsed_ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1000.0;
    let resp = match req.send().await {
        Ok(resp) => resp,
        Err(e) => {
            r.error = Some(format!("connect/send: {}", describe(&to_io_error(e))));
            r.e2e_ms = elapsed_ms(Instant::now());
            return r;
        }
    };
    r.status = resp.status().as_u16();
    // The mock names itself; in front of real engines, the filter's decision header does.
    r.worker_id = ["x-worker-id", "x-kv-router-worker"]
        .iter()
        .find_map(|name| {
            resp.headers()
                .get(*name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        });
    let header_u32 = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    };
    r.router_overlap_blocks = header_u32("x-kv-router-overlap-blocks");
    r.router_max_overlap_blocks = header_u32("x-kv-router-max-overlap-blocks");
    let header_text = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    r.router_worker = header_text("x-kv-router-worker");
    r.router_loads = header_text("x-kv-router-loads");
    if r.status != 200 {
        let text = resp.text().await.unwrap_or_default();
        let msg: String = text.chars().take(120).collect();
        r.error = Some(format!("status {}: {}", r.status, msg.trim()));
        r.e2e_ms = elapsed_ms(Instant::now());
        return r;
    }
    let _streaming = Held::new(&g.open_streams, &g.peak_open_streams);
    let mut events = EventStream::new(resp);
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    let mut done = false;
    loop {
        match events.next().await {
            Ok(Some(ev)) => {
                if ev.is_done() {
                    done = true;
                    break;
                }
                let Ok(v) = ev.json() else {
                    r.error = Some("malformed SSE data".into());
                    break;
                };
                if v.get("error").is_some() {
                    r.error = Some(format!("stream error: {}", v["error"]["message"]));
                    break;
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    r.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    r.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .map(|c| c as usize);
                }
                if chunk_text(&v).is_some_and(|t| !t.is_empty()) {
                    chunks += 1;
                    match last {
                        None => r.ttft_ms = Some(elapsed_ms(ev.at)),
                        Some(prev) => r
                            .itl_ms
                            .push(ev.at.duration_since(prev).as_secs_f64() * 1000.0),
                    }
                    last = Some(ev.at);
                }
            }
            Ok(None) => break,
            Err(e) => {
                r.error = Some(format!("stream: {}", describe(&e)));
                break;
            }
        }
    }
    r.e2e_ms = elapsed_ms(Instant::now());
    if r.output_tokens == 0 {
        r.output_tokens = chunks;
    }
    if r.error.is_none() && !done {
        r.error = Some("stream ended without [DONE]".into());
    }
    r.ok = r.error.is_none() && r.ttft_ms.is_some();
    if r.error.is_none() && !r.ok {
        r.error = Some("no tokens".into());
    }
    r
}

/// `clients` tasks, each sending the next request of the workload when its last one ends.
async fn closed_loop(run: Arc<Run>, clients: usize) -> Vec<RequestResult> {
    let clients = clients.max(1);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for k in 0..clients {
        let (run, next) = (Arc::clone(&run), Arc::clone(&next));
        let delay = run.opts.ramp_up.mul_f64(k as f64 / clients as f64);
        tasks.spawn(async move {
            tokio::time::sleep(delay).await;
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(spec) = run.requests.get(i) else {
                    break;
                };
                let sent_at_ms = run.elapsed_ms();
                let mut r = run_one(&run, run.url_for(i), spec).await;
                r.index = i;
                r.sent_at_ms = sent_at_ms;
                run.record(&r);
                out.push(r);
            }
            out
        });
    }
    let mut results = Vec::with_capacity(run.requests.len());
    while let Some(done) = tasks.join_next().await {
        if let Ok(mut out) = done {
            results.append(&mut out);
        }
    }
    results
}

/// Every request at its arrival offset, at most `max_in_flight` at once.
async fn timed(run: Arc<Run>) -> Vec<RequestResult> {
    let cap = run.opts.max_in_flight.clamp(1, Semaphore::MAX_PERMITS);
    let permits = Arc::new(Semaphore::new(cap));
    let mut tasks = JoinSet::new();
    let mut results = Vec::with_capacity(run.requests.len());
    for (i, spec) in run.requests.iter().enumerate() {
        let due = run.start + Duration::from_secs_f64(spec.at_ms.max(0.0) / 1000.0);
        tokio::time::sleep_until(due.into()).await;
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            break;
        };
        let run_t = Arc::clone(&run);
        tasks.spawn(async move {
            let _permit = permit;
            let sent_at_ms = run_t.elapsed_ms();
            let Some(spec) = run_t.requests.get(i) else {
                return RequestResult::default();
            };
            let mut r = run_one(&run_t, run_t.url_for(i), spec).await;
            r.index = i;
            r.sent_at_ms = sent_at_ms;
            r.send_delay_ms = (sent_at_ms - spec.at_ms).max(0.0);
            run_t.record(&r);
            r
        });
        while let Some(done) = tasks.try_join_next() {
            results.extend(done.ok());
        }
    }
    while let Some(done) = tasks.join_next().await {
        results.extend(done.ok());
    }
    results
}

/// How often the lag probe wakes up.
const LAG_PROBE_PERIOD: Duration = Duration::from_millis(10);
/// Lag samples kept (a sample every 10 ms: the first ~45 minutes of a run).
const MAX_LAG_SAMPLES: usize = 1 << 18;

/// Measures how late this runtime runs a task that asked to wake up: the same delay stamps every
/// SSE event late, so it bounds what a busy client adds to its own TTFT and ITL figures.
async fn probe_lag(samples: Arc<std::sync::Mutex<Vec<f64>>>) {
    loop {
        let asked = Instant::now();
        tokio::time::sleep(LAG_PROBE_PERIOD).await;
        let late = asked.elapsed().saturating_sub(LAG_PROBE_PERIOD);
        let mut s = crate::util::lock(&samples);
        if s.len() < MAX_LAG_SAMPLES {
            s.push(late.as_secs_f64() * 1000.0);
        }
    }
}

async fn report_progress(run: Arc<Run>, every: Duration) {
    let label = if run.opts.label.is_empty() {
        String::new()
    } else {
        format!(" [{}]", run.opts.label)
    };
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let g = &run.gauges;
        eprintln!(
            "loadgen{label}: {:>6.1}s sent {}/{} done {} failed {} in-flight {} streaming {}",
            run.start.elapsed().as_secs_f64(),
            g.sent.load(Ordering::Relaxed),
            run.requests.len(),
            g.done.load(Ordering::Relaxed),
            g.failed.load(Ordering::Relaxed),
            g.in_flight.load(Ordering::Relaxed),
            g.open_streams.load(Ordering::Relaxed),
        );
    }
}

/// Every request failed with `why` (the run could not start).
fn failed_run(workload: &Workload, why: &str) -> RunStats {
    RunStats {
        workload: workload.name.clone(),
        results: (0..workload.requests.len())
            .map(|index| RequestResult {
                index,
                error: Some(why.to_string()),
                ..RequestResult::default()
            })
            .collect(),
        ..RunStats::default()
    }
}

async fn run_async(targets: &[String], workload: &Workload, opts: &RunOptions) -> RunStats {
    let http = match reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(opts.timeout)
        .read_timeout(opts.timeout)
        .build()
    {
        Ok(c) => c,
        Err(e) => return failed_run(workload, &format!("cannot build the HTTP client: {e}")),
    };
    let scrape = |http: reqwest::Client| async move {
        if opts.worker_addrs.is_empty() {
            return None::<WorkerCounters>;
        }
        scrape_workers_async(&http, &opts.worker_addrs)
            .await
            .map_err(|e| eprintln!("loadgen: cannot scrape worker metrics: {e}"))
            .ok()
    };
    let before = scrape(http.clone()).await;
    let run = Arc::new(Run {
        http: http.clone(),
        urls: targets
            .iter()
            .map(|t| format!("{}{}", base_url(t), opts.path))
            .collect(),
        opts: opts.clone(),
        requests: workload.requests.clone(),
        gauges: Gauges::default(),
        start: Instant::now(),
    });
    let usage_before = sys::usage().unwrap_or_default();
    let progress = opts
        .progress_every
        .map(|every| tokio::spawn(report_progress(Arc::clone(&run), every)));
    let lag_samples = Arc::new(std::sync::Mutex::new(Vec::new()));
    let lag_probe = tokio::spawn(probe_lag(Arc::clone(&lag_samples)));
    let arrival = match opts.concurrency {
        Some(c) => Arrival::Concurrency(c),
        None => workload.arrival,
    };
    let mut results = match arrival {
        Arrival::Concurrency(c) => closed_loop(Arc::clone(&run), c).await,
        Arrival::Timed => timed(Arc::clone(&run)).await,
    };
    let wall_s = run.start.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.abort();
    }
    lag_probe.abort();
    let lag = Summary::of(&crate::util::lock(&lag_samples));
    let usage_after = sys::usage().unwrap_or_default();
    let after = if before.is_some() {
        scrape(http).await
    } else {
        None
    };
    results.sort_by_key(|r| r.index);
    let g = &run.gauges;
    RunStats {
        workload: workload.name.clone(),
        results,
        wall_s,
        workers: before.zip(after).map(|(b, a)| a.since(&b)),
        client: ClientUsage {
            cpu_s: usage_after
                .cpu()
                .saturating_sub(usage_before.cpu())
                .as_secs_f64(),
            max_rss_bytes: usage_after.max_rss_bytes,
            peak_in_flight: g.peak_in_flight.load(Ordering::Relaxed),
            peak_open_streams: g.peak_open_streams.load(Ordering::Relaxed),
            runtime_lag_ms: lag,
        },
    }
}

/// Runs a workload against `target` (`ip:port`, usually Envoy's listener) and measures it.
pub fn run_workload(target: &str, workload: &Workload, opts: &RunOptions) -> RunStats {
    run_workload_on(&[target.to_string()], workload, opts)
}

/// Runs a workload spread round-robin over `targets` (e.g. a fleet of mock workers addressed
/// directly) and measures it. Blocks on its own runtime: call it from synchronous code.
pub fn run_workload_on(targets: &[String], workload: &Workload, opts: &RunOptions) -> RunStats {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("loadgen")
        .build()
    {
        Ok(rt) => rt.block_on(run_async(targets, workload, opts)),
        Err(e) => failed_run(workload, &format!("cannot start the async runtime: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn client_affinity_keeps_a_client_on_one_target_and_spreads_the_clients() {
        let n = 3;
        let mut per_target = [0usize; 3];
        for client in 0..300u64 {
            let first = Spread::ByClient.target(0, Some(client), n);
            // Wherever its requests fall in the run, a client's go to the same target.
            for i in 1..10 {
                assert_eq!(Spread::ByClient.target(i, Some(client), n), first);
            }
            per_target[first] += 1;
        }
        assert!(
            per_target.iter().all(|&k| (70..=130).contains(&k)),
            "{per_target:?}"
        );
        // Requests without a client, and round-robin arms, take turns.
        let turns: Vec<usize> = (0..6)
            .map(|i| Spread::ByClient.target(i, None, n))
            .collect();
        assert_eq!(turns, [0, 1, 2, 0, 1, 2]);
        let rr: Vec<usize> = (0..4)
            .map(|i| Spread::RoundRobin.target(i, Some(7), n))
            .collect();
        assert_eq!(rr, [0, 1, 2, 0]);
    }
}
