//! The mock LLM worker (`mock-worker` binary): an OpenAI-compatible server that serves the KV
//! event endpoint of DESIGN.md ("Worker event endpoint (wire format)").
//!
//! Two modes share the HTTP surface:
//! * `echo` ([`echo`]): immediate answers shaped by the request's `mock` field and a KV event
//!   endpoint fed by the test through `/admin/*`.
//! * `engine` ([`engine`]): a vLLM-like simulator (prefix cache, continuous batching, timing
//!   model) that emits vLLM-shaped KV events.
//!
//! Endpoints (both modes; every response carries `x-worker-id`, JSON bodies of completions carry
//! `worker_id` and `received_headers`):
//! `GET /health`, `GET /metrics`, `POST /v1/completions`, `POST /v1/chat/completions`,
//! `GET /kv/events?after=N`, `GET /kv/dump`, `GET /admin/stats`, `POST /admin/events_fault`,
//! `POST /admin/load`, `POST /admin/reset`; echo mode only: `POST /admin/events`,
//! `POST /admin/drop_events`, `POST /admin/dump`.

pub mod echo;
pub mod engine;
pub mod event_log;
pub mod kv_cache;
pub mod openai;

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::net::TcpListener;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::http::{self, lock, Handler, Request, ResponseWriter};
use echo::EchoState;
use engine::{Engine, EngineConfig, Output};
use openai::{ApiKind, Shape};

/// Event buffer bound in engine mode.
pub const ENGINE_EVENT_CAPACITY: usize = 100_000;
/// Step-time multiplier of a CPU device in engine mode.
pub const CPU_SLOWDOWN: f64 = 8.0;
/// Padding added by the `oversized` event fault.
pub const OVERSIZED_PADDING_BYTES: usize = 8 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Echo,
    Engine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Gpu,
    Cpu,
}

/// Command-line options of `mock-worker`.
#[derive(Debug, Clone)]
pub struct Options {
    pub host: String,
    pub port: u16,
    pub id: String,
    pub mode: Mode,
    pub block_size: usize,
    pub kv_blocks: usize,
    pub host_kv_blocks: usize,
    pub max_seqs: usize,
    pub max_batched_tokens: usize,
    pub speedup: f64,
    pub device: Device,
    pub dp_rank: u32,
    pub event_capacity: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            host: "127.0.0.1".into(),
            port: 0,
            id: "0".into(),
            mode: Mode::Echo,
            block_size: 64,
            kv_blocks: 16384,
            host_kv_blocks: 0,
            max_seqs: 256,
            max_batched_tokens: 8192,
            speedup: 1.0,
            device: Device::Gpu,
            dp_rank: 0,
            event_capacity: ENGINE_EVENT_CAPACITY,
        }
    }
}

pub const USAGE: &str =
    "usage: mock-worker --port P --id ID [--mode echo|engine] [--host 127.0.0.1]
  [--block-size 64] [--kv-blocks 16384] [--host-kv-blocks 0] [--max-seqs 256]
  [--max-batched-tokens 8192] [--speedup 1.0] [--device gpu|cpu] [--dp-rank 0]
  [--event-capacity 100000]
--port 0 picks a free port; the first stdout line is `listening <ip:port>`.";

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
}

impl Options {
    /// Parses arguments (without the program name).
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options::default();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let (flag, inline) = match flag.split_once('=') {
                Some((f, v)) => (f, Some(v.to_string())),
                None => (flag.as_str(), None),
            };
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.to_string());
            }
            let value = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?,
            };
            match flag {
                "--host" => o.host = value,
                "--port" => o.port = parse_num(flag, &value)?,
                "--id" => o.id = value,
                "--mode" => {
                    o.mode = match value.as_str() {
                        "echo" => Mode::Echo,
                        "engine" => Mode::Engine,
                        _ => return Err(format!("--mode: expected echo or engine, got {value:?}")),
                    }
                }
                "--block-size" => o.block_size = parse_num(flag, &value)?,
                "--kv-blocks" => o.kv_blocks = parse_num(flag, &value)?,
                "--host-kv-blocks" => o.host_kv_blocks = parse_num(flag, &value)?,
                "--max-seqs" => o.max_seqs = parse_num(flag, &value)?,
                "--max-batched-tokens" => o.max_batched_tokens = parse_num(flag, &value)?,
                "--speedup" => o.speedup = parse_num(flag, &value)?,
                "--device" => {
                    o.device = match value.as_str() {
                        "gpu" => Device::Gpu,
                        "cpu" => Device::Cpu,
                        _ => return Err(format!("--device: expected gpu or cpu, got {value:?}")),
                    }
                }
                "--dp-rank" => o.dp_rank = parse_num(flag, &value)?,
                "--event-capacity" => o.event_capacity = parse_num(flag, &value)?,
                _ => return Err(format!("unknown option {flag}\n{USAGE}")),
            }
        }
        if o.block_size == 0 || o.kv_blocks == 0 || o.max_seqs == 0 || o.max_batched_tokens == 0 {
            return Err(
                "--block-size, --kv-blocks, --max-seqs, --max-batched-tokens must be > 0".into(),
            );
        }
        if !(o.speedup.is_finite() && o.speedup > 0.0) {
            return Err("--speedup must be a positive number".into());
        }
        Ok(o)
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            kv_blocks: self.kv_blocks,
            host_kv_blocks: self.host_kv_blocks,
            max_seqs: self.max_seqs,
            max_batched_tokens: self.max_batched_tokens,
            speedup: self.speedup,
            slowdown: if self.device == Device::Cpu {
                CPU_SLOWDOWN
            } else {
                1.0
            },
            dp_rank: self.dp_rank,
            ..EngineConfig::default()
        }
    }
}

/// How `/kv/events` and `/kv/dump` misbehave (`POST /admin/events_fault {"mode": ...}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventsFault {
    None,
    /// 500 with an error JSON.
    Http500,
    /// 200 with a truncated JSON body.
    Malformed,
    /// No answer until the client gives up (at most 60 s, then 504).
    Hang,
    /// `block_size` reported as twice the real one.
    WrongBlockSize,
    /// A valid page padded with an 8 MiB `padding` string.
    Oversized,
}

impl EventsFault {
    pub fn parse(s: &str) -> Option<EventsFault> {
        Some(match s {
            "none" => EventsFault::None,
            "http_500" => EventsFault::Http500,
            "malformed" => EventsFault::Malformed,
            "hang" => EventsFault::Hang,
            "wrong_block_size" => EventsFault::WrongBlockSize,
            "oversized" => EventsFault::Oversized,
            _ => return None,
        })
    }
}

enum Backend {
    Echo(EchoState),
    Engine(Arc<Engine>),
}

/// One mock worker's state; [`MockWorker::handler`] is its HTTP handler.
pub struct MockWorker {
    opts: Options,
    worker_id: Value,
    backend: Backend,
    fault: Mutex<EventsFault>,
    load_override: Mutex<Option<Value>>,
    requests: AtomicU64,
    in_flight: AtomicI64,
    seq: AtomicU64,
}

struct InFlight<'a>(&'a AtomicI64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The request headers a worker echoes back in `received_headers`.
pub const ECHOED_HEADERS: [&str; 3] = [
    "x-gateway-destination-endpoint",
    "x-dp-rank",
    "x-worker-instance-id",
];

fn received_headers(req: &Request) -> Value {
    let mut m = serde_json::Map::new();
    for name in ECHOED_HEADERS {
        if let Some(v) = req.header(name) {
            m.insert(name.to_string(), json!(v));
        }
    }
    Value::Object(m)
}

impl MockWorker {
    pub fn new(opts: Options) -> Arc<MockWorker> {
        let worker_id = opts
            .id
            .parse::<u64>()
            .map_or_else(|_| json!(opts.id), |n| json!(n));
        let backend = match opts.mode {
            Mode::Echo => Backend::Echo(EchoState::new(opts.block_size)),
            Mode::Engine => {
                Backend::Engine(Engine::start(opts.engine_config(), opts.event_capacity))
            }
        };
        Arc::new(MockWorker {
            opts,
            worker_id,
            backend,
            fault: Mutex::new(EventsFault::None),
            load_override: Mutex::new(None),
            requests: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            seq: AtomicU64::new(0),
        })
    }

    pub fn options(&self) -> &Options {
        &self.opts
    }

    pub fn handler(self: &Arc<Self>) -> Handler {
        let me = Arc::clone(self);
        Arc::new(move |req, w| me.handle(req, w))
    }

    /// Completion requests received so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    pub fn handle(&self, req: Request, w: &mut ResponseWriter) {
        w.add_default_header("x-worker-id", &self.opts.id);
        let r = match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/health") => w.send_json(
                200,
                &json!({"status": "ok", "worker_id": self.worker_id,
                        "mode": self.mode_name(), "device": self.device_name()}),
            ),
            ("GET", "/metrics") => w.send(
                200,
                &[("content-type", "text/plain; version=0.0.4")],
                self.metrics_text().as_bytes(),
            ),
            ("POST", "/v1/completions") => {
                self.completion(ApiKind::Completions, &req, w);
                Ok(())
            }
            ("POST", "/v1/chat/completions") => {
                self.completion(ApiKind::Chat, &req, w);
                Ok(())
            }
            ("GET", "/kv/events") => {
                let after = req.query_param("after").and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
                let mut page = match &self.backend {
                    Backend::Echo(e) => e.events_page(after),
                    Backend::Engine(e) => e.events_page(after),
                };
                if let Some(load) = lock(&self.load_override).clone() {
                    page["load"] = load;
                }
                self.send_event_body(page, w);
                Ok(())
            }
            ("GET", "/kv/dump") => {
                let dump = match &self.backend {
                    Backend::Echo(e) => e.dump(),
                    Backend::Engine(e) => e.dump(),
                };
                self.send_event_body(dump, w);
                Ok(())
            }
            ("GET", "/admin/stats") => w.send_json(
                200,
                &json!({"requests": self.requests(), "in_flight": self.in_flight.load(Ordering::SeqCst),
                        "worker_id": self.worker_id}),
            ),
            ("POST", "/admin/events_fault") => {
                let mode = req.json().ok().and_then(|b| b["mode"].as_str().map(str::to_string));
                match mode.as_deref().and_then(EventsFault::parse) {
                    Some(f) => {
                        *lock(&self.fault) = f;
                        w.send_json(200, &json!({"ok": true}))
                    }
                    None => w.send_json(
                        400,
                        &json!({"error": "mode must be none|http_500|malformed|hang|wrong_block_size|oversized"}),
                    ),
                }
            }
            ("POST", "/admin/load") => match req.json() {
                Ok(v) => {
                    *lock(&self.load_override) = if v.is_null() { None } else { Some(v) };
                    w.send_json(200, &json!({"ok": true}))
                }
                Err(e) => w.send_json(400, &json!({"error": format!("bad JSON: {e}")})),
            },
            ("POST", "/admin/reset") => {
                self.reset();
                w.send_json(200, &json!({"ok": true}))
            }
            _ => {
                let handled = match &self.backend {
                    Backend::Echo(e) => e.admin(&req, w),
                    Backend::Engine(_) => false,
                };
                if handled {
                    Ok(())
                } else {
                    w.send_json(
                        404,
                        &json!({"error": format!("no route for {} {} in {} mode", req.method, req.path, self.mode_name())}),
                    )
                }
            }
        };
        // A failed write means the client is gone; nothing else to do.
        drop(r);
    }

    /// Clears faults, the load override and stats; echo: events and dump (ids restart at 1);
    /// engine: fails in-flight requests and empties the cache (AllBlocksCleared).
    pub fn reset(&self) {
        *lock(&self.fault) = EventsFault::None;
        *lock(&self.load_override) = None;
        self.requests.store(0, Ordering::SeqCst);
        match &self.backend {
            Backend::Echo(e) => e.reset(),
            Backend::Engine(e) => e.reset(),
        }
    }

    fn mode_name(&self) -> &'static str {
        match self.opts.mode {
            Mode::Echo => "echo",
            Mode::Engine => "engine",
        }
    }

    fn device_name(&self) -> &'static str {
        match self.opts.device {
            Device::Gpu => "gpu",
            Device::Cpu => "cpu",
        }
    }

    fn send_event_body(&self, mut body: Value, w: &mut ResponseWriter) {
        let fault = *lock(&self.fault);
        let _ = match fault {
            EventsFault::None => w.send_json(200, &body),
            EventsFault::Http500 => w.send_json(500, &json!({"error": "injected fault"})),
            EventsFault::Malformed => w.send(
                200,
                &[("content-type", "application/json")],
                br#"{"block_size": 64, "first_event_id": 1, "events": [{"event_id": "#,
            ),
            EventsFault::Hang => {
                echo::sleep_watching(w, 60_000);
                w.close_after();
                w.send_json(504, &json!({"error": "hung"}))
            }
            EventsFault::WrongBlockSize => {
                body["block_size"] = json!(self.opts.block_size * 2);
                w.send_json(200, &body)
            }
            EventsFault::Oversized => {
                body["padding"] = json!("x".repeat(OVERSIZED_PADDING_BYTES));
                w.send_json(200, &body)
            }
        };
    }

    fn completion(&self, kind: ApiKind, req: &Request, w: &mut ResponseWriter) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let _guard = InFlight(&self.in_flight);
        let body = match req.json() {
            Ok(v) if v.is_object() => v,
            _ => {
                let err =
                    openai::error_body(400, "request body must be a JSON object", &self.worker_id);
                let _ = w.send_json(400, &err);
                return;
            }
        };
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let shape = Shape::new(kind, seq, &body, &self.worker_id, received_headers(req));
        match &self.backend {
            Backend::Echo(e) => e.completion(&shape, &body, w),
            Backend::Engine(e) => self.engine_completion(e, &shape, &body, w),
        }
    }

    fn engine_completion(
        &self,
        engine: &Engine,
        shape: &Shape,
        body: &Value,
        w: &mut ResponseWriter,
    ) {
        let tokens = openai::prompt_tokens(body);
        let stream = openai::is_stream(body);
        let (id, rx) = match engine.submit(tokens, openai::max_tokens(body)) {
            Ok(x) => x,
            Err(msg) => {
                let _ = w.send_json(400, &openai::error_body(400, &msg, &self.worker_id));
                return;
            }
        };
        if stream && w.start_sse().is_err() {
            engine.abort(id);
            return;
        }
        let mut text = String::new();
        let mut first = true;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Output::Token { token, .. }) => {
                    let piece = format!(" t{token}");
                    if stream {
                        let chunk = shape.chunk(&piece, None, first).to_string();
                        if w.write_sse_data(&chunk).is_err() {
                            engine.abort(id);
                            return;
                        }
                    } else {
                        text.push_str(&piece);
                    }
                    first = false;
                }
                Ok(Output::Finished { usage, .. }) => {
                    let u = openai::usage(
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        usage.cached_tokens,
                    );
                    if stream {
                        let _ = w
                            .write_sse_data(&shape.chunk("", Some("length"), first).to_string())
                            .and_then(|()| w.write_sse_data(&shape.usage_chunk(u).to_string()))
                            .and_then(|()| w.write_sse_data("[DONE]"));
                    } else {
                        let _ = w.send_json(200, &shape.full(&text, "length", u));
                    }
                    return;
                }
                Ok(Output::Failed { message, .. }) => {
                    let err = openai::error_body(503, &message, &self.worker_id);
                    if stream {
                        let _ = w.write_sse_data(&err.to_string());
                    } else {
                        let _ = w.send_json(503, &err);
                    }
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {
                    if w.is_client_disconnected() {
                        engine.abort(id);
                        return;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let err =
                        openai::error_body(500, "engine dropped the request", &self.worker_id);
                    if stream {
                        let _ = w.write_sse_data(&err.to_string());
                    } else {
                        let _ = w.send_json(500, &err);
                    }
                    return;
                }
            }
        }
    }

    /// Prometheus text exposition of the worker's counters.
    pub fn metrics_text(&self) -> String {
        let mut s = String::new();
        let id = &self.opts.id;
        let mut line = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} {kind}");
            let _ = writeln!(s, "{name}{{worker_id=\"{id}\"}} {value}");
        };
        let in_flight = self.in_flight.load(Ordering::SeqCst).max(0) as f64;
        let requests = self.requests() as f64;
        line(
            "mock_worker_requests_total",
            "counter",
            "Completion requests received.",
            requests,
        );
        line(
            "mock_worker_in_flight",
            "gauge",
            "Completion requests being served.",
            in_flight,
        );
        let (m, engine) = match &self.backend {
            Backend::Engine(e) => (e.metrics(), true),
            Backend::Echo(_) => (engine::EngineMetrics::default(), false),
        };
        let c = m.counters;
        let hit_rate = if c.prefix_queries_tokens > 0 {
            c.prefix_hit_tokens as f64 / c.prefix_queries_tokens as f64
        } else {
            0.0
        };
        let running = if engine {
            m.num_running as f64
        } else {
            in_flight
        };
        line(
            "mock_worker_kv_cache_usage_ratio",
            "gauge",
            "Fraction of KV blocks held by running requests.",
            m.kv_usage,
        );
        line(
            "mock_worker_kv_cached_blocks_device",
            "gauge",
            "Blocks cached on the device.",
            m.device_blocks as f64,
        );
        line(
            "mock_worker_kv_cached_blocks_host",
            "gauge",
            "Blocks cached on the host tier.",
            m.host_blocks as f64,
        );
        line(
            "mock_worker_prefix_cache_queries_tokens_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            c.prefix_queries_tokens as f64,
        );
        line(
            "mock_worker_prefix_cache_hits_tokens_total",
            "counter",
            "Prompt tokens found on the device.",
            c.prefix_hit_tokens as f64,
        );
        line(
            "mock_worker_prefix_cache_host_hits_tokens_total",
            "counter",
            "Prompt tokens found on the host tier.",
            c.prefix_host_hit_tokens as f64,
        );
        line(
            "mock_worker_prefix_cache_hit_rate",
            "gauge",
            "Device hit tokens / query tokens since start.",
            hit_rate,
        );
        line(
            "mock_worker_num_requests_waiting",
            "gauge",
            "Requests queued in the engine.",
            m.num_waiting as f64,
        );
        line(
            "mock_worker_num_requests_running",
            "gauge",
            "Requests running in the engine.",
            running,
        );
        line(
            "mock_worker_requests_completed_total",
            "counter",
            "Requests finished by the engine.",
            c.requests_completed as f64,
        );
        line(
            "mock_worker_prefill_tokens_total",
            "counter",
            "Tokens computed by prefill.",
            c.prefill_tokens as f64,
        );
        line(
            "mock_worker_generated_tokens_total",
            "counter",
            "Tokens generated.",
            c.generated_tokens as f64,
        );
        line(
            "mock_worker_preemptions_total",
            "counter",
            "Sequences preempted for lack of KV blocks.",
            c.preemptions as f64,
        );
        line(
            "mock_worker_kv_events_last_id",
            "gauge",
            "Id of the newest KV event.",
            m.last_event_id as f64,
        );
        // vLLM-compatible names for dashboards that expect them.
        line(
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "KV usage (vLLM name).",
            m.kv_usage,
        );
        line(
            "vllm:num_requests_running",
            "gauge",
            "Running requests (vLLM name).",
            running,
        );
        line(
            "vllm:num_requests_waiting",
            "gauge",
            "Waiting requests (vLLM name).",
            m.num_waiting as f64,
        );
        line(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache query tokens (vLLM name).",
            c.prefix_queries_tokens as f64,
        );
        line(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hit tokens (vLLM name).",
            c.prefix_hit_tokens as f64,
        );
        s
    }
}

/// Starts a worker in this process on `opts.host:opts.port` (0 = a free port).
pub fn spawn(opts: Options) -> io::Result<(http::Server, Arc<MockWorker>)> {
    let bind = format!("{}:{}", opts.host, opts.port);
    let worker = MockWorker::new(opts);
    let server = http::spawn(&bind, worker.handler())?;
    Ok((server, worker))
}

/// Binds, prints `listening <ip:port>` as the first stdout line, and serves forever.
pub fn run(opts: Options) -> io::Result<()> {
    let listener = TcpListener::bind((opts.host.as_str(), opts.port))?;
    let addr = listener.local_addr()?;
    let mut out = io::stdout().lock();
    writeln!(out, "listening {addr}")?;
    out.flush()?;
    drop(out);
    let worker = MockWorker::new(opts);
    http::serve(listener, worker.handler());
    Ok(())
}
