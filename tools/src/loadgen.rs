//! The benchmark driver behind the `loadgen` binary: workloads (a Mooncake trace or a synthetic
//! shared-prefix mix), [`run_workload`] (streamed `/v1/completions` with token-id prompts,
//! measuring TTFT, ITL, end-to-end latency, throughput and errors), and reporting
//! ([`print_comparison_table`], [`write_svg_chart`], [`scrape_hit_rate`]).
//!
//! Timing: TTFT is measured from just before the request is written to the arrival of the first
//! SSE chunk carrying text; ITL is the gap between consecutive text chunks (the engine mock sends
//! one token per chunk); end-to-end runs to the end of the stream. Requests of a timed workload
//! are sent at their arrival offsets (each on its own thread, at most `max_in_flight` at once;
//! when that cap holds a request back, its lateness is recorded in `send_delay_ms`).

use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::{self, lock};
use crate::util::{mean, percentile, splitmix64};

/// Tokens per Mooncake hash id.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;
/// Vocabulary of generated token ids.
pub const VOCAB: u64 = 32_000;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Arrival offset from the start of the run (timed workloads).
    pub at_ms: f64,
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
}

/// How requests are released.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// At each request's `at_ms`.
    Timed,
    /// A closed loop of this many clients, each sending its next request when the last one ends.
    Concurrency(usize),
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub requests: Vec<RequestSpec>,
    pub arrival: Arrival,
}

/// Deterministic token `i` of Mooncake hash id `id`.
pub fn mooncake_token(id: u64, i: usize) -> u32 {
    (splitmix64(splitmix64(id) ^ i as u64) % VOCAB) as u32
}

/// A Mooncake prompt: 512 tokens per hash id, truncated to `input_length`.
pub fn mooncake_tokens(hash_ids: &[u64], input_length: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_length);
    'outer: for &id in hash_ids {
        for i in 0..MOONCAKE_BLOCK_TOKENS {
            if out.len() >= input_length {
                break 'outer;
            }
            out.push(mooncake_token(id, i));
        }
    }
    out
}

/// Loads a Mooncake-format trace (JSON lines: `timestamp` ms, `input_length`, `output_length`,
/// `hash_ids`). Timestamps are divided by `time_scale` and made relative to the first request.
pub fn load_mooncake(
    path: &Path,
    time_scale: f64,
    max_requests: Option<usize>,
) -> io::Result<Workload> {
    let file = std::fs::File::open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let scale = if time_scale > 0.0 { time_scale } else { 1.0 };
    let mut requests = Vec::new();
    let mut t0 = None;
    for (n, line) in BufReader::new(file).lines().enumerate() {
        if max_requests.is_some_and(|m| requests.len() >= m) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}:{}: {what}", path.display(), n + 1),
            )
        };
        let v: Value = serde_json::from_str(&line).map_err(|e| bad(&e.to_string()))?;
        let ts = v["timestamp"]
            .as_f64()
            .ok_or_else(|| bad("missing timestamp"))?;
        let input = v["input_length"]
            .as_u64()
            .ok_or_else(|| bad("missing input_length"))? as usize;
        let output = v["output_length"]
            .as_u64()
            .ok_or_else(|| bad("missing output_length"))? as usize;
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .ok_or_else(|| bad("missing hash_ids"))?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        let start = *t0.get_or_insert(ts);
        requests.push(RequestSpec {
            at_ms: (ts - start).max(0.0) / scale,
            tokens: mooncake_tokens(&ids, input),
            max_tokens: output.max(1),
        });
    }
    Ok(Workload {
        name: format!("mooncake:{}", path.display()),
        requests,
        arrival: Arrival::Timed,
    })
}

/// `groups=G,prefix=P,isl=I,osl=O,requests=N,rate=R` (Poisson arrivals, req/s) or
/// `...,concurrency=C` (closed loop); optional `seed=S`.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub groups: usize,
    pub prefix: usize,
    pub isl: usize,
    pub osl: usize,
    pub requests: usize,
    pub rate: Option<f64>,
    pub concurrency: Option<usize>,
    pub seed: u64,
}

impl SyntheticSpec {
    pub fn parse(s: &str) -> Result<SyntheticSpec, String> {
        let mut spec = SyntheticSpec {
            groups: 4,
            prefix: 2048,
            isl: 4096,
            osl: 64,
            requests: 200,
            rate: None,
            concurrency: None,
            seed: 42,
        };
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("synthetic: expected key=value, got {part:?}"))?;
            let num = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("synthetic: bad {k}={v}"))
            };
            match k.trim() {
                "groups" => spec.groups = num(v)?.max(1),
                "prefix" => spec.prefix = num(v)?,
                "isl" => spec.isl = num(v)?,
                "osl" => spec.osl = num(v)?.max(1),
                "requests" => spec.requests = num(v)?,
                "concurrency" => spec.concurrency = Some(num(v)?.max(1)),
                "seed" => spec.seed = num(v)? as u64,
                "rate" => {
                    let r: f64 = v
                        .trim()
                        .parse()
                        .map_err(|_| format!("synthetic: bad rate={v}"))?;
                    if !(r.is_finite() && r > 0.0) {
                        return Err("synthetic: rate must be > 0".into());
                    }
                    spec.rate = Some(r);
                }
                other => return Err(format!("synthetic: unknown key {other:?}")),
            }
        }
        if spec.prefix > spec.isl {
            return Err("synthetic: prefix must be <= isl".into());
        }
        if spec.rate.is_none() && spec.concurrency.is_none() {
            spec.concurrency = Some(8);
        }
        Ok(spec)
    }
}

/// Builds a shared-prefix workload: each request picks a group at random, sends that group's
/// `prefix` tokens followed by `isl - prefix` unique tokens, and asks for `osl` tokens.
pub fn synthetic(spec: &SyntheticSpec) -> Workload {
    let mut state = spec.seed;
    let mut next = move || {
        state = splitmix64(state);
        state
    };
    let mut t = 0.0;
    let requests = (0..spec.requests)
        .map(|n| {
            let group = next() % spec.groups as u64;
            let mut tokens: Vec<u32> = (0..spec.prefix)
                .map(|i| (splitmix64(0xC0FFEE ^ (group << 32) ^ i as u64) % VOCAB) as u32)
                .collect();
            let unique = spec.seed.wrapping_mul(1_000_003) ^ ((n as u64) << 20);
            tokens.extend(
                (spec.prefix..spec.isl).map(|i| (splitmix64(unique ^ i as u64) % VOCAB) as u32),
            );
            if let Some(rate) = spec.rate {
                // Exponential inter-arrival times.
                let u = ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                t += -u.ln() / rate * 1000.0;
            }
            RequestSpec {
                at_ms: if spec.rate.is_some() { t } else { 0.0 },
                tokens,
                max_tokens: spec.osl,
            }
        })
        .collect();
    Workload {
        name: format!(
            "synthetic:groups={},prefix={},isl={},osl={},requests={}",
            spec.groups, spec.prefix, spec.isl, spec.osl, spec.requests
        ),
        requests,
        arrival: match (spec.rate, spec.concurrency) {
            (Some(_), _) => Arrival::Timed,
            (None, c) => Arrival::Concurrency(c.unwrap_or(8)),
        },
    }
}

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub model: String,
    pub path: String,
    /// Connect and per-read idle timeout of each request.
    pub timeout: Duration,
    /// Cap on concurrent requests of a timed workload.
    pub max_in_flight: usize,
    pub extra_headers: Vec<(String, String)>,
    /// Mock workers whose `/metrics` are scraped before and after the run (cache hit rate).
    pub worker_addrs: Vec<String>,
    /// Progress lines on stderr every this often (`None`: silent).
    pub progress_every: Option<Duration>,
    /// Label shown in progress lines.
    pub label: String,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            model: "mock-model".into(),
            path: "/v1/completions".into(),
            timeout: Duration::from_secs(600),
            max_in_flight: 2048,
            extra_headers: Vec::new(),
            worker_addrs: Vec::new(),
            progress_every: Some(Duration::from_secs(2)),
            label: String::new(),
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct RequestResult {
    pub index: usize,
    pub ok: bool,
    pub status: u16,
    pub error: Option<String>,
    /// Offset of the send from the start of the run.
    pub sent_at_ms: f64,
    /// How late the send was relative to the scheduled arrival (timed workloads).
    pub send_delay_ms: f64,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Vec<f64>,
    pub e2e_ms: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens` when reported.
    pub cached_tokens: Option<usize>,
    /// The `x-worker-id` response header.
    pub worker_id: Option<String>,
}

/// Prefix-cache counters summed over mock workers (`/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheCounters {
    pub query_tokens: f64,
    pub hit_tokens: f64,
    pub host_hit_tokens: f64,
}

impl CacheCounters {
    /// Device hit rate since the start of the workers.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.query_tokens > 0.0).then(|| self.hit_tokens / self.query_tokens)
    }

    /// Counters accumulated since `before`.
    pub fn since(&self, before: &CacheCounters) -> CacheCounters {
        CacheCounters {
            query_tokens: self.query_tokens - before.query_tokens,
            hit_tokens: self.hit_tokens - before.hit_tokens,
            host_hit_tokens: self.host_hit_tokens - before.host_hit_tokens,
        }
    }
}

/// Reads and sums the prefix-cache counters of mock workers (`GET /metrics`).
pub fn scrape_hit_rate(worker_addrs: &[String]) -> io::Result<CacheCounters> {
    let mut c = CacheCounters::default();
    for addr in worker_addrs {
        let r = http::request(addr, "GET", "/metrics", &[], &[], Duration::from_secs(5))?;
        if r.status != 200 {
            return Err(io::Error::other(format!(
                "{addr}/metrics: status {}",
                r.status
            )));
        }
        let text = r.text();
        c.query_tokens +=
            metric_value(&text, "mock_worker_prefix_cache_queries_tokens_total").unwrap_or(0.0);
        c.hit_tokens +=
            metric_value(&text, "mock_worker_prefix_cache_hits_tokens_total").unwrap_or(0.0);
        c.host_hit_tokens +=
            metric_value(&text, "mock_worker_prefix_cache_host_hits_tokens_total").unwrap_or(0.0);
    }
    Ok(c)
}

/// Sum of the samples of a metric in Prometheus text (any labels).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Distribution summary in milliseconds (or any unit).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(values: &[f64]) -> Summary {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        Summary {
            count: v.len(),
            mean: mean(&v).unwrap_or(f64::NAN),
            p50: percentile(&v, 50.0).unwrap_or(f64::NAN),
            p90: percentile(&v, 90.0).unwrap_or(f64::NAN),
            p99: percentile(&v, 99.0).unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }

    pub fn to_json(&self) -> Value {
        let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({"count": self.count, "mean": f(self.mean), "p50": f(self.p50), "p90": f(self.p90),
               "p99": f(self.p99), "max": f(self.max)})
    }
}

/// Everything measured in one run.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    pub workload: String,
    pub results: Vec<RequestResult>,
    pub wall_s: f64,
    /// Worker prefix-cache counters accumulated during the run (when workers were given).
    pub cache: Option<CacheCounters>,
}

impl RunStats {
    fn ok(&self) -> impl Iterator<Item = &RequestResult> {
        self.results.iter().filter(|r| r.ok)
    }

    pub fn completed(&self) -> usize {
        self.ok().count()
    }

    pub fn errors(&self) -> usize {
        self.results.len() - self.completed()
    }

    pub fn ttft(&self) -> Summary {
        Summary::of(&self.ok().filter_map(|r| r.ttft_ms).collect::<Vec<_>>())
    }

    pub fn itl(&self) -> Summary {
        Summary::of(
            &self
                .ok()
                .flat_map(|r| r.itl_ms.iter().copied())
                .collect::<Vec<_>>(),
        )
    }

    pub fn e2e(&self) -> Summary {
        Summary::of(&self.ok().map(|r| r.e2e_ms).collect::<Vec<_>>())
    }

    pub fn requests_per_s(&self) -> f64 {
        self.completed() as f64 / self.wall_s.max(1e-9)
    }

    pub fn output_tokens_per_s(&self) -> f64 {
        self.ok().map(|r| r.output_tokens).sum::<usize>() as f64 / self.wall_s.max(1e-9)
    }

    /// Cached prompt tokens / prompt tokens, from the responses' usage.
    pub fn reported_cache_fraction(&self) -> Option<f64> {
        let (mut cached, mut total) = (0usize, 0usize);
        for r in self.ok() {
            if let Some(c) = r.cached_tokens {
                cached += c;
                total += r.prompt_tokens;
            }
        }
        (total > 0).then(|| cached as f64 / total as f64)
    }

    /// Worker prefix-cache hit rate during the run (from `/metrics`), else the usage-based one.
    pub fn hit_rate(&self) -> Option<f64> {
        self.cache
            .and_then(|c| c.hit_rate())
            .or_else(|| self.reported_cache_fraction())
    }

    /// Completed requests per `x-worker-id`, sorted by id.
    pub fn per_worker(&self) -> Vec<(String, usize)> {
        let mut m: std::collections::BTreeMap<String, usize> = Default::default();
        for r in self.ok() {
            *m.entry(r.worker_id.clone().unwrap_or_else(|| "?".into()))
                .or_default() += 1;
        }
        m.into_iter().collect()
    }

    /// The first few distinct error messages with counts.
    pub fn error_summary(&self) -> Vec<(String, usize)> {
        let mut m: std::collections::BTreeMap<String, usize> = Default::default();
        for r in self.results.iter().filter(|r| !r.ok) {
            *m.entry(r.error.clone().unwrap_or_default()).or_default() += 1;
        }
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }

    pub fn summary_json(&self) -> Value {
        json!({
            "workload": self.workload,
            "requests": self.results.len(),
            "completed": self.completed(),
            "errors": self.errors(),
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s(),
            "output_tokens_per_s": self.output_tokens_per_s(),
            "ttft_ms": self.ttft().to_json(),
            "itl_ms": self.itl().to_json(),
            "e2e_ms": self.e2e().to_json(),
            "hit_rate": self.hit_rate(),
            "reported_cache_fraction": self.reported_cache_fraction(),
            "per_worker": self.per_worker().into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "error_kinds": self.error_summary().into_iter().take(5).collect::<Vec<_>>(),
        })
    }
}

fn body_for(spec: &RequestSpec, opts: &RunOptions) -> Vec<u8> {
    let body = json!({
        "model": opts.model,
        "prompt": spec.tokens,
        "max_tokens": spec.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

fn chunk_text(v: &Value) -> Option<&str> {
    let choice = v["choices"].get(0)?;
    choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
}

/// Sends one streamed request and measures it.
pub fn run_one(target: &str, spec: &RequestSpec, opts: &RunOptions) -> RequestResult {
    let body = body_for(spec, opts);
    let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    headers.extend(
        opts.extra_headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str())),
    );
    let mut r = RequestResult {
        prompt_tokens: spec.tokens.len(),
        ..RequestResult::default()
    };
    let t0 = Instant::now();
    let elapsed_ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1000.0;
    let mut s =
        match http::request_streaming(target, "POST", &opts.path, &headers, &body, opts.timeout) {
            Ok(s) => s,
            Err(e) => {
                r.error = Some(format!("connect/send: {}", e.kind()));
                r.e2e_ms = elapsed_ms(Instant::now());
                return r;
            }
        };
    r.status = s.status;
    r.worker_id = s.header("x-worker-id").map(str::to_string);
    if s.status != 200 {
        let text = s
            .read_to_end()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let msg: String = text.chars().take(120).collect();
        r.error = Some(format!("status {}: {}", r.status, msg.trim()));
        r.e2e_ms = elapsed_ms(Instant::now());
        return r;
    }
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    let mut done = false;
    loop {
        match s.next_event() {
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
                r.error = Some(format!("stream: {}", e.kind()));
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

struct Progress {
    total: usize,
    sent: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
}

/// Runs a workload against `target` (`ip:port`, usually Envoy's listener) and measures it.
pub fn run_workload(target: &str, workload: &Workload, opts: &RunOptions) -> RunStats {
    let before = if opts.worker_addrs.is_empty() {
        None
    } else {
        scrape_hit_rate(&opts.worker_addrs)
            .map_err(|e| eprintln!("loadgen: cannot scrape worker metrics: {e}"))
            .ok()
    };
    let n = workload.requests.len();
    let results: Arc<Mutex<Vec<RequestResult>>> = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let progress = Arc::new(Progress {
        total: n,
        sent: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
    });
    let start = Instant::now();
    let stop_progress = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reporter = opts.progress_every.map(|every| {
        let (p, stop, label) = (
            Arc::clone(&progress),
            Arc::clone(&stop_progress),
            opts.label.clone(),
        );
        std::thread::spawn(move || {
            let mut last = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
                if last.elapsed() >= every {
                    last = Instant::now();
                    let (s, d, f) = (
                        p.sent.load(Ordering::SeqCst),
                        p.done.load(Ordering::SeqCst),
                        p.failed.load(Ordering::SeqCst),
                    );
                    eprintln!(
                        "loadgen{}: {:>6.1}s sent {s}/{} done {d} failed {f} in-flight {}",
                        if label.is_empty() {
                            String::new()
                        } else {
                            format!(" [{label}]")
                        },
                        start.elapsed().as_secs_f64(),
                        p.total,
                        s - d
                    );
                }
            }
        })
    });
    let record = {
        let (results, progress) = (Arc::clone(&results), Arc::clone(&progress));
        move |r: RequestResult| {
            if !r.ok {
                progress.failed.fetch_add(1, Ordering::SeqCst);
            }
            progress.done.fetch_add(1, Ordering::SeqCst);
            lock(&results).push(r);
        }
    };
    let shared = Arc::new((workload.requests.clone(), opts.clone(), target.to_string()));
    match workload.arrival {
        Arrival::Concurrency(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            let handles: Vec<_> = (0..c.max(1))
                .map(|_| {
                    let (next, shared, record, progress) = (
                        Arc::clone(&next),
                        Arc::clone(&shared),
                        record.clone(),
                        Arc::clone(&progress),
                    );
                    std::thread::spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(spec) = shared.0.get(i) else {
                            break;
                        };
                        progress.sent.fetch_add(1, Ordering::SeqCst);
                        let sent_at_ms = start.elapsed().as_secs_f64() * 1000.0;
                        let mut r = run_one(&shared.2, spec, &shared.1);
                        r.index = i;
                        r.sent_at_ms = sent_at_ms;
                        record(r);
                    })
                })
                .collect();
            for h in handles {
                let _ = h.join();
            }
        }
        Arrival::Timed => {
            let in_flight = Arc::new(AtomicUsize::new(0));
            let mut handles = Vec::with_capacity(n);
            for i in 0..n {
                let Some(spec) = shared.0.get(i) else {
                    break;
                };
                let due = start + Duration::from_secs_f64(spec.at_ms.max(0.0) / 1000.0);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                while in_flight.load(Ordering::SeqCst) >= opts.max_in_flight.max(1) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                in_flight.fetch_add(1, Ordering::SeqCst);
                progress.sent.fetch_add(1, Ordering::SeqCst);
                let (shared_t, record_t, in_flight_t) =
                    (Arc::clone(&shared), record.clone(), Arc::clone(&in_flight));
                let h = std::thread::Builder::new()
                    .stack_size(512 * 1024)
                    .spawn(move || {
                        let sent = Instant::now();
                        if let Some(spec) = shared_t.0.get(i) {
                            let mut r = run_one(&shared_t.2, spec, &shared_t.1);
                            r.index = i;
                            r.sent_at_ms = sent.duration_since(start).as_secs_f64() * 1000.0;
                            r.send_delay_ms = (r.sent_at_ms - spec.at_ms).max(0.0);
                            record_t(r);
                        }
                        in_flight_t.fetch_sub(1, Ordering::SeqCst);
                    });
                match h {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        record(RequestResult {
                            index: i,
                            error: Some(format!("cannot spawn a client thread: {e}")),
                            ..RequestResult::default()
                        });
                    }
                }
            }
            for h in handles {
                let _ = h.join();
            }
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    stop_progress.store(true, Ordering::SeqCst);
    if let Some(h) = reporter {
        let _ = h.join();
    }
    let after = before.and_then(|_| scrape_hit_rate(&opts.worker_addrs).ok());
    let mut results = std::mem::take(&mut *lock(&results));
    results.sort_by_key(|r| r.index);
    RunStats {
        workload: workload.name.clone(),
        results,
        wall_s,
        cache: before.zip(after).map(|(b, a)| a.since(&b)),
    }
}

fn fmt_ms(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x >= 10_000.0 {
        format!("{:.1}s", x / 1000.0)
    } else {
        format!("{x:.1}")
    }
}

fn fmt_pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

/// The one-run report: counts, throughput, and mean/p50/p90/p99 of TTFT, ITL and E2E (ms).
pub fn format_stats(label: &str, s: &RunStats) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "== {label}: {}", s.workload);
    let _ = writeln!(
        out,
        "requests {}  completed {}  errors {}  wall {:.1}s  {:.2} req/s  {:.1} out tok/s  cache hit {}",
        s.results.len(),
        s.completed(),
        s.errors(),
        s.wall_s,
        s.requests_per_s(),
        s.output_tokens_per_s(),
        fmt_pct(s.hit_rate())
    );
    let _ = writeln!(
        out,
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "ms", "mean", "p50", "p90", "p99", "max"
    );
    for (name, sum) in [("TTFT", s.ttft()), ("ITL", s.itl()), ("E2E", s.e2e())] {
        let _ = writeln!(
            out,
            "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}",
            name,
            fmt_ms(sum.mean),
            fmt_ms(sum.p50),
            fmt_ms(sum.p90),
            fmt_ms(sum.p99),
            fmt_ms(sum.max)
        );
    }
    let per_worker: Vec<String> = s
        .per_worker()
        .iter()
        .map(|(w, c)| format!("{w}:{c}"))
        .collect();
    if !per_worker.is_empty() {
        let _ = writeln!(out, "per worker: {}", per_worker.join(" "));
    }
    for (msg, count) in s.error_summary().iter().take(5) {
        let _ = writeln!(out, "error x{count}: {msg}");
    }
    out
}

/// One row per mode: throughput, errors, hit rate, TTFT/ITL/E2E mean/p50/p99.
pub fn comparison_table(rows: &[(&str, RunStats)]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:>6} {:>5} {:>7} {:>8} {:>7} | {:>9} {:>9} {:>9} | {:>7} {:>7} {:>7} | {:>9} {:>9}",
        "mode", "done", "err", "req/s", "tok/s", "hit", "TTFT mean", "TTFT p50", "TTFT p99",
        "ITL avg", "ITL p50", "ITL p99", "E2E p50", "E2E p99"
    );
    for (name, s) in rows {
        let (t, i, e) = (s.ttft(), s.itl(), s.e2e());
        let _ = writeln!(
            out,
            "{:<22} {:>6} {:>5} {:>7.2} {:>8.1} {:>7} | {:>9} {:>9} {:>9} | {:>7} {:>7} {:>7} | {:>9} {:>9}",
            name,
            s.completed(),
            s.errors(),
            s.requests_per_s(),
            s.output_tokens_per_s(),
            fmt_pct(s.hit_rate()),
            fmt_ms(t.mean),
            fmt_ms(t.p50),
            fmt_ms(t.p99),
            fmt_ms(i.mean),
            fmt_ms(i.p50),
            fmt_ms(i.p99),
            fmt_ms(e.p50),
            fmt_ms(e.p99)
        );
    }
    let _ = writeln!(
        out,
        "(times in ms unless marked s; hit = prefix-cache hit rate of the workers during the run)"
    );
    out
}

pub fn print_comparison_table(rows: &[(&str, RunStats)]) {
    print!("{}", comparison_table(rows));
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG with the TTFT CDF of each mode (log-scaled time axis) and a legend with p50/p99.
pub fn svg_chart(rows: &[(&str, RunStats)]) -> String {
    let (w, h) = (820.0, 480.0);
    let (left, right, top, bottom) = (70.0, 250.0, 40.0, 60.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let series: Vec<(&str, Vec<f64>)> = rows
        .iter()
        .map(|(name, s)| {
            let mut v: Vec<f64> = s
                .results
                .iter()
                .filter(|r| r.ok)
                .filter_map(|r| r.ttft_ms)
                .map(|x| x.max(0.01))
                .collect();
            v.sort_by(f64::total_cmp);
            (*name, v)
        })
        .collect();
    let all = series.iter().flat_map(|(_, v)| v.iter().copied());
    let (mut lo, mut hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if !lo.is_finite() {
        (lo, hi) = (1.0, 1000.0);
    }
    let lo_dec = lo.log10().floor();
    let hi_dec = hi.log10().ceil().max(lo_dec + 1.0);
    let x_of = |ms: f64| left + (ms.log10() - lo_dec) / (hi_dec - lo_dec) * pw;
    let y_of = |p: f64| top + (1.0 - p) * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">Time to first token: CDF per routing mode</text>"#,
        left + pw / 2.0
    );
    // Grid and axes.
    let mut d = lo_dec;
    while d <= hi_dec + 1e-9 {
        let x = x_of(10f64.powf(d));
        let label = {
            let ms = 10f64.powf(d);
            if ms >= 1000.0 {
                format!("{}s", ms / 1000.0)
            } else {
                format!("{ms}ms")
            }
        };
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/>"##,
            top + ph
        );
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{label}</text>"#,
            top + ph + 18.0
        );
        d += 1.0;
    }
    for i in 0..=4 {
        let p = f64::from(i) / 4.0;
        let y = y_of(p);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/>"##,
            left + pw
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{:.0}%</text>"#,
            left - 6.0,
            y + 4.0,
            p * 100.0
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">TTFT (log scale)</text>"#,
        left + pw / 2.0,
        h - 15.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">fraction of requests</text>"#,
        top + ph / 2.0,
        top + ph / 2.0
    );
    for (k, (name, v)) in series.iter().enumerate() {
        let color = COLORS.get(k % COLORS.len()).copied().unwrap_or("#000");
        if !v.is_empty() {
            let n = v.len() as f64;
            let mut pts = format!(
                "{:.1},{:.1}",
                x_of(v.first().copied().unwrap_or(lo)),
                y_of(0.0)
            );
            for (i, x) in v.iter().enumerate() {
                let _ = write!(
                    pts,
                    " {:.1},{:.1} {:.1},{:.1}",
                    x_of(*x),
                    y_of(i as f64 / n),
                    x_of(*x),
                    y_of((i + 1) as f64 / n)
                );
            }
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>"#
            );
        }
        let sum = Summary::of(v);
        let ly = top + 10.0 + k as f64 * 40.0;
        let lx = left + pw + 15.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#,
            lx + 20.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 26.0,
            ly + 4.0,
            xml_escape(name)
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#555">p50 {} p99 {} (n={})</text>"##,
            lx + 26.0,
            ly + 20.0,
            fmt_ms(sum.p50),
            fmt_ms(sum.p99),
            sum.count
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Writes [`svg_chart`] to `path`.
pub fn write_svg_chart(path: &Path, rows: &[(&str, RunStats)]) -> io::Result<()> {
    std::fs::write(path, svg_chart(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_prompts_share_prefixes() {
        let a = mooncake_tokens(&[1, 2, 3], 1100);
        let b = mooncake_tokens(&[1, 2, 4], 1500);
        assert_eq!(a.len(), 1100);
        assert_eq!(b.len(), 1500);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1100], b[1024..1100]);
        assert!(a.iter().all(|&t| u64::from(t) < VOCAB));
        assert_eq!(mooncake_tokens(&[1], 10), mooncake_tokens(&[1], 10));
    }

    #[test]
    fn loads_the_trace_format() {
        let dir = std::env::temp_dir().join(format!("loadgen-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
             {\"timestamp\": 3000, \"input_length\": 100, \"output_length\": 0, \"hash_ids\": [0]}\n\
             {\"timestamp\": 4000, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [9]}\n",
        )
        .unwrap();
        let w = load_mooncake(&p, 2.0, Some(2)).unwrap();
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].at_ms, 0.0);
        assert_eq!(w.requests[1].at_ms, 1000.0);
        assert_eq!(w.requests[0].tokens.len(), 600);
        assert_eq!(w.requests[1].max_tokens, 1);
        assert_eq!(w.requests[0].tokens[..100], w.requests[1].tokens[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn synthetic_workloads() {
        let spec =
            SyntheticSpec::parse("groups=3,prefix=100,isl=150,osl=4,requests=30,rate=10").unwrap();
        let w = synthetic(&spec);
        assert_eq!(w.requests.len(), 30);
        assert_eq!(w.arrival, Arrival::Timed);
        assert!(w.requests.windows(2).all(|p| p[0].at_ms <= p[1].at_ms));
        let prefixes: std::collections::HashSet<Vec<u32>> = w
            .requests
            .iter()
            .map(|r| r.tokens[..100].to_vec())
            .collect();
        assert!(prefixes.len() <= 3 && prefixes.len() >= 2);
        let suffixes: std::collections::HashSet<Vec<u32>> = w
            .requests
            .iter()
            .map(|r| r.tokens[100..].to_vec())
            .collect();
        assert_eq!(suffixes.len(), 30);
        let mean_gap = w.requests.last().unwrap().at_ms / 30.0;
        assert!(mean_gap > 30.0 && mean_gap < 300.0, "{mean_gap}");
        let c =
            synthetic(&SyntheticSpec::parse("requests=5,concurrency=2,isl=10,prefix=5").unwrap());
        assert_eq!(c.arrival, Arrival::Concurrency(2));
        assert!(SyntheticSpec::parse("prefix=10,isl=5").is_err());
        assert!(SyntheticSpec::parse("bogus=1").is_err());
    }

    #[test]
    fn prometheus_parsing() {
        let text = "# HELP x y\nfoo_total{worker_id=\"1\"} 3\nfoo_total{worker_id=\"2\"} 4.5\nfoo_total_other 9\nfoo 1\n";
        assert_eq!(metric_value(text, "foo_total"), Some(7.5));
        assert_eq!(metric_value(text, "foo"), Some(1.0));
        assert_eq!(metric_value(text, "bar"), None);
    }

    fn fake_stats(ttfts: &[f64]) -> RunStats {
        RunStats {
            workload: "w".into(),
            wall_s: 2.0,
            results: ttfts
                .iter()
                .enumerate()
                .map(|(i, t)| RequestResult {
                    index: i,
                    ok: true,
                    status: 200,
                    ttft_ms: Some(*t),
                    itl_ms: vec![5.0, 7.0],
                    e2e_ms: t + 12.0,
                    output_tokens: 3,
                    prompt_tokens: 10,
                    cached_tokens: Some(5),
                    worker_id: Some("1".into()),
                    ..RequestResult::default()
                })
                .chain(std::iter::once(RequestResult {
                    error: Some("status 503: x".into()),
                    ..RequestResult::default()
                }))
                .collect(),
            cache: None,
        }
    }

    #[test]
    fn stats_tables_and_svg() {
        let a = fake_stats(&[10.0, 20.0, 30.0, 40.0]);
        let b = fake_stats(&[100.0, 2000.0]);
        assert_eq!(a.completed(), 4);
        assert_eq!(a.errors(), 1);
        assert_eq!(a.ttft().p50, 20.0);
        assert_eq!(a.ttft().mean, 25.0);
        assert_eq!(a.itl().mean, 6.0);
        assert_eq!(a.requests_per_s(), 2.0);
        assert_eq!(a.hit_rate(), Some(0.5));
        let table = comparison_table(&[("kv", a.clone()), ("random", b.clone())]);
        assert!(table.contains("kv") && table.contains("random"), "{table}");
        assert!(format_stats("kv", &a).contains("error x1: status 503"));
        let svg = svg_chart(&[("kv <1>", a), ("random", b)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("kv &lt;1&gt;"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        let empty = svg_chart(&[("none", RunStats::default())]);
        assert!(empty.contains("</svg>"));
        assert!(a_json_ok());
    }

    fn a_json_ok() -> bool {
        let s = fake_stats(&[1.0]);
        let j = s.summary_json();
        j["ttft_ms"]["p50"] == 1.0 && j["errors"] == 1
    }
}
