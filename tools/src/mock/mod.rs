//! The mock LLM worker (`mock-worker` binary): an OpenAI-compatible server that serves the KV
//! event endpoint of DESIGN.md ("Worker event endpoint (wire format)"), on tokio + axum.
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
//! `POST /v1/chat/completions/render`, `POST /v1/completions/render`, `POST /tokenize` (the
//! prompt ids the worker caches for a request, in vLLM 0.32's reply shapes; see [`render`]),
//! `GET /kv/events?after=N`, `GET /kv/dump`, `GET /admin/stats`, `POST /admin/events_fault`,
//! `POST /admin/load`, `POST /admin/reset`; echo mode only: `POST /admin/events`,
//! `POST /admin/drop_events`, `POST /admin/dump`. See [`routes`].
//!
//! Engine mode can also publish its KV events on ZMQ exactly like vLLM 0.32
//! (`--kv-events-endpoint`, [`kv_zmq`], [`vllm_wire`]), so that `kv-event-bridge` can serve them
//! to the filter: the path a real engine takes.
//!
//! A client that goes away is noticed by the server (hyper drops the request's future or its
//! response stream): delays end early, engine requests are aborted and `in_flight` drops.

pub mod block_hasher;
pub mod echo;
pub mod engine;
mod engine_api;
pub mod event_log;
pub mod kv_cache;
pub mod kv_zmq;
mod metrics;
pub mod openai;
pub mod render;
pub mod routes;
pub mod timing;
pub mod vllm_hash;
pub mod vllm_wire;

use std::io;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::http::HeaderValue;
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};

use crate::server::{self, Server};
use crate::util::lock;
use block_hasher::{BlockHashKind, BlockHasher};
use echo::EchoState;
use engine::{Engine, EngineConfig, SchedulingPolicy};
use kv_zmq::{KvPublisher, ZmqConfig};

/// Event buffer bound in engine mode.
pub const ENGINE_EVENT_CAPACITY: usize = 100_000;
/// Step-time multiplier of a CPU device in engine mode.
pub const CPU_SLOWDOWN: f64 = 8.0;
/// Padding added by the `oversized` event fault.
pub const OVERSIZED_PADDING_BYTES: usize = 8 << 20;
/// Largest request body accepted (413 beyond it).
pub const MAX_REQUEST_BODY_BYTES: usize = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Echo,
    Engine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Gpu,
    Cpu,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be > 0".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err("must be a positive number".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn non_negative_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        Ok(_) => Err("must be a number >= 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// `--kv-blocks` when not given (Dynamo's mocker default).
pub const DEFAULT_KV_BLOCKS: usize = 16384;

/// Command-line options of `mock-worker`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "mock-worker",
    about = "A mock LLM worker (echo or vLLM-like engine) serving the KV event endpoint",
    after_help = "--port 0 picks a free port; the first stdout line is `listening <ip:port>`. \
With --kv-events-endpoint the next lines are `zmq <endpoint>` and, with \
--kv-events-replay-endpoint, `replay <endpoint>`, the bound addresses (port 0 resolved). \
Engine mode times each step by a roofline of Llama-3.1-8B in bf16 on one H100 SXM, not by the \
router's predictor polynomials: 3 ms + max(linear and attention FLOPs / 643 TFLOP/s, weights + \
the batch's KV bytes / 2.68 TB/s); a prefill chunk's attention covers its sequence's cached \
prefix too; a reloaded host-tier token adds a quarter of a new token's linear-layer time. \
That time is divided by --speedup, multiplied by 8 on --device cpu and by a \
lognormal factor of mean 1 (--jitter, seeded by --id)."
)]
pub struct Options {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Worker id: `x-worker-id` and `worker_id` in bodies (a number when it parses as one).
    #[arg(long, default_value = "0")]
    pub id: String,
    #[arg(long, value_enum, default_value_t = Mode::Echo)]
    pub mode: Mode,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub block_size: usize,
    /// Device KV cache size in blocks (engine mode).
    #[arg(long, default_value_t = DEFAULT_KV_BLOCKS, value_parser = positive)]
    pub kv_blocks: usize,
    /// Host-tier KV cache size in blocks (engine mode; 0 = none).
    #[arg(long, default_value_t = 0)]
    pub host_kv_blocks: usize,
    #[arg(long, default_value_t = 256, value_parser = positive)]
    pub max_seqs: usize,
    #[arg(long, default_value_t = 8192, value_parser = positive)]
    pub max_batched_tokens: usize,
    /// As vLLM's `--long-prefill-token-threshold`: the most prompt tokens one request computes in
    /// a step while others run or wait (0 = no cap), so a running long prefill does not hold the
    /// whole step's budget while shorter requests wait (engine mode).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Divides every simulated step time (engine mode). At 1 the steps are those of
    /// Llama-3.1-8B in bf16 on one H100 SXM (a roofline: 3 ms + max(FLOPs / 643 TFLOP/s,
    /// bytes / 2.68 TB/s), see `mock::timing`): an 8,192-token prefill step ~208 ms, a decode
    /// step of a few sequences ~9 ms.
    #[arg(long, default_value_t = 1.0, value_parser = positive_f64)]
    pub speedup: f64,
    /// Engine mode: every step time is multiplied by a lognormal factor of mean 1 and this
    /// log-standard-deviation, drawn from a generator seeded by `--id` (0 = none: the model's
    /// times exactly).
    #[arg(long, default_value_t = 0.1, value_parser = non_negative_f64)]
    pub jitter: f64,
    /// Engine mode, streamed answers: tokens per chunk after the first, as vLLM's
    /// `--stream-interval` (fewer, larger chunks for runs with thousands of streams).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub stream_interval: usize,
    /// The order of admission, as vLLM's `--scheduling-policy`: `priority` serves the lowest
    /// request `priority` first (then arrival); `fcfs` refuses a priority other than 0.
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// A `cpu` device is 8x slower per step (engine mode).
    #[arg(long, value_enum, default_value_t = Device::Gpu)]
    pub device: Device,
    /// DP rank reported in vLLM-shaped events.
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    /// Bound of the engine's KV event buffer.
    #[arg(long, default_value_t = ENGINE_EVENT_CAPACITY)]
    pub event_capacity: usize,
    /// Engine mode: also publish KV events on ZMQ as vLLM does, binding this PUB endpoint,
    /// e.g. tcp://127.0.0.1:5557 (port 0: a free one; tcp://*:PORT: every interface).
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// The replay ROUTER endpoint to bind (needs --kv-events-endpoint).
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_replay_endpoint: Option<String>,
    /// How the engine names its KV blocks (in its cache, event pages, dumps and ZMQ events):
    /// its own chained hash, or the hashes a vLLM engine publishes for the same tokens.
    #[arg(long, value_enum, default_value_t = BlockHashKind::Mock)]
    pub block_hash: BlockHashKind,
    /// vLLM's PYTHONHASHSEED for --block-hash vllm-* (unset in vLLM: "vllm-none-hash").
    #[arg(long, default_value = vllm_hash::DEFAULT_SEED)]
    pub hash_seed: String,
    /// ZMQ topic of the KV events (vLLM's default is the empty topic, `--kv-events-topic ""`,
    /// which vllm-router's kv_aware needs).
    #[arg(long, default_value = vllm_wire::DEFAULT_TOPIC)]
    pub kv_events_topic: String,
    /// Batches kept for replay (vLLM's buffer_steps).
    #[arg(long, default_value_t = 10_000, value_parser = positive)]
    pub kv_events_replay_batches: usize,
    /// Bytes of batches kept for replay.
    #[arg(long, default_value_t = 64 << 20, value_parser = positive)]
    pub kv_events_replay_bytes: usize,
    /// The `/kv/events` and `/kv/dump` fault from the start (as `POST /admin/events_fault`
    /// sets it later): `none`, `http_500`, `malformed`, `hang`, `wrong_block_size`, `oversized`.
    /// An engine restarted with `http_500` can fill its cache before any router sees it.
    #[arg(long, default_value = "none", value_parser = events_fault)]
    pub events_fault: EventsFault,
}

impl Default for Options {
    /// The command-line defaults.
    fn default() -> Self {
        Options::parse_from(["mock-worker"])
    }
}

impl Options {
    /// Checks combinations of options that clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.kv_events_endpoint.is_some() && self.mode != Mode::Engine {
            return Err("--kv-events-endpoint needs --mode engine".into());
        }
        if self.kv_events_replay_endpoint.is_some() && self.kv_events_endpoint.is_none() {
            return Err("--kv-events-replay-endpoint needs --kv-events-endpoint".into());
        }
        Ok(())
    }

    /// The ZMQ publisher's settings, when engine mode publishes on ZMQ.
    pub fn zmq_config(&self) -> Option<ZmqConfig> {
        let endpoint = self.kv_events_endpoint.clone()?;
        Some(ZmqConfig {
            endpoint,
            replay_endpoint: self.kv_events_replay_endpoint.clone(),
            topic: self.kv_events_topic.clone(),
            replay_batches: self.kv_events_replay_batches,
            replay_bytes: self.kv_events_replay_bytes,
            block_size: self.block_size,
            dp_rank: self.dp_rank,
        })
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            kv_blocks: self.kv_blocks,
            host_kv_blocks: self.host_kv_blocks,
            max_seqs: self.max_seqs,
            max_batched_tokens: self.max_batched_tokens,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            speedup: self.speedup,
            slowdown: if self.device == Device::Cpu {
                CPU_SLOWDOWN
            } else {
                1.0
            },
            jitter: self.jitter,
            seed: timing::jitter_seed(&self.id),
            dp_rank: self.dp_rank,
            block_hasher: BlockHasher::new(self.block_hash, &self.hash_seed),
            policy: self.scheduling_policy,
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

fn events_fault(s: &str) -> Result<EventsFault, String> {
    EventsFault::parse(s).ok_or_else(|| format!("unknown events fault {s:?}"))
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

pub(crate) enum Backend {
    Echo(EchoState),
    Engine(Arc<Engine>),
}

/// One mock worker's state; [`routes::router`] serves it.
pub struct MockWorker {
    opts: Options,
    worker_id: Value,
    id_header: HeaderValue,
    pub(crate) backend: Backend,
    fault: Mutex<EventsFault>,
    load_override: Mutex<Option<Value>>,
    /// The `worker` description its event pages and dumps carry (`/admin/describe`).
    description: Mutex<Option<Value>>,
    /// Status `/health` answers (200 = healthy); `/admin/serve_fault`.
    health_status: AtomicU64,
    /// Status the completion endpoints answer with instead of serving (200 = serve).
    completion_status: AtomicU64,
    requests: AtomicU64,
    in_flight: AtomicI64,
    seq: AtomicU64,
    first_token_ns: AtomicU64,
    first_tokens: AtomicU64,
}

/// Counts a completion as in flight until dropped (it travels with a streamed body).
pub struct InFlight(Arc<MockWorker>);

impl InFlight {
    pub fn worker(&self) -> &Arc<MockWorker> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MockWorker {
    /// The worker's state; in engine mode with `--kv-events-endpoint`, its ZMQ sockets are bound
    /// when this returns.
    pub fn new(opts: Options) -> io::Result<Arc<MockWorker>> {
        opts.validate().map_err(io::Error::other)?;
        let worker_id = opts
            .id
            .parse::<u64>()
            .map_or_else(|_| json!(opts.id), |n| json!(n));
        let id_header =
            HeaderValue::from_str(&opts.id).unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        let backend = match opts.mode {
            Mode::Echo => Backend::Echo(EchoState::new(opts.block_size)),
            Mode::Engine => {
                let publisher = opts.zmq_config().map(KvPublisher::start).transpose()?;
                Backend::Engine(Engine::start_publishing(
                    opts.engine_config(),
                    opts.event_capacity,
                    publisher,
                ))
            }
        };
        let fault = opts.events_fault;
        Ok(Arc::new(MockWorker {
            opts,
            worker_id,
            id_header,
            backend,
            fault: Mutex::new(fault),
            load_override: Mutex::new(None),
            description: Mutex::new(None),
            health_status: AtomicU64::new(200),
            completion_status: AtomicU64::new(200),
            requests: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            seq: AtomicU64::new(0),
            first_token_ns: AtomicU64::new(0),
            first_tokens: AtomicU64::new(0),
        }))
    }

    /// `(PUB, replay ROUTER)` endpoints as bound, when engine mode publishes on ZMQ.
    pub fn zmq_endpoints(&self) -> Option<(String, Option<String>)> {
        match &self.backend {
            Backend::Engine(e) => e
                .publisher()
                .map(|p| (p.endpoint.clone(), p.replay_endpoint.clone())),
            Backend::Echo(_) => None,
        }
    }

    pub fn options(&self) -> &Options {
        &self.opts
    }

    pub fn worker_id(&self) -> &Value {
        &self.worker_id
    }

    /// Completion requests received so far.
    pub fn set_serve_faults(&self, health: Option<u16>, completions: Option<u16>) {
        if let Some(h) = health {
            self.health_status.store(u64::from(h), Ordering::SeqCst);
        }
        if let Some(c) = completions {
            self.completion_status.store(u64::from(c), Ordering::SeqCst);
        }
    }

    pub fn health_status(&self) -> u16 {
        u16::try_from(self.health_status.load(Ordering::SeqCst)).unwrap_or(500)
    }

    pub fn completion_status(&self) -> u16 {
        u16::try_from(self.completion_status.load(Ordering::SeqCst)).unwrap_or(500)
    }

    /// Counts a request answered without serving it (an injected fault).
    pub fn count_request(&self) {
        self.requests.fetch_add(1, Ordering::SeqCst);
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Completion requests being served now.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Counts a new completion request; the guard keeps it in flight.
    pub fn begin_completion(self: &Arc<Self>) -> (u64, InFlight) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        (seq, InFlight(Arc::clone(self)))
    }

    /// Records a server-side time to first token: from the complete request to the first text
    /// handed to the connection (`/metrics`: `mock_worker_first_token_seconds_total`).
    pub fn record_first_token(&self, received: Instant) {
        let ns = u64::try_from(received.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.first_token_ns.fetch_add(ns, Ordering::Relaxed);
        self.first_tokens.fetch_add(1, Ordering::Relaxed);
    }

    pub fn fault(&self) -> EventsFault {
        *lock(&self.fault)
    }

    pub fn set_fault(&self, f: EventsFault) {
        *lock(&self.fault) = f;
    }

    pub fn load_override(&self) -> Option<Value> {
        lock(&self.load_override).clone()
    }

    pub fn set_load_override(&self, v: Option<Value>) {
        *lock(&self.load_override) = v;
    }

    pub fn description(&self) -> Option<Value> {
        lock(&self.description).clone()
    }

    pub fn set_description(&self, v: Option<Value>) {
        *lock(&self.description) = v;
    }

    /// Clears faults, the load override and stats; echo: events and dump (ids restart at 1);
    /// engine: fails in-flight requests and empties the cache (AllBlocksCleared).
    pub fn reset(&self) {
        self.set_fault(EventsFault::None);
        self.set_load_override(None);
        self.requests.store(0, Ordering::SeqCst);
        match &self.backend {
            Backend::Echo(e) => e.reset(),
            Backend::Engine(e) => e.reset(),
        }
    }

    pub fn mode_name(&self) -> &'static str {
        match self.opts.mode {
            Mode::Echo => "echo",
            Mode::Engine => "engine",
        }
    }

    pub fn device_name(&self) -> &'static str {
        match self.opts.device {
            Device::Gpu => "gpu",
            Device::Cpu => "cpu",
        }
    }

    /// Prometheus text exposition of the worker's counters.
    pub fn metrics_text(&self) -> String {
        metrics::render(self)
    }
}

/// Starts a worker in this process on `opts.host:opts.port` (0 = a free port).
pub fn spawn(opts: Options) -> io::Result<(Server, Arc<MockWorker>)> {
    let listener = server::bind(&opts.host, opts.port)?;
    let worker = MockWorker::new(opts)?;
    let server = server::spawn(listener, routes::router(Arc::clone(&worker)))?;
    Ok((server, worker))
}

/// Binds, prints `listening <ip:port>` as the first stdout line (then `zmq <endpoint>` and
/// `replay <endpoint>` when publishing on ZMQ), and serves forever.
pub fn run(opts: Options) -> io::Result<()> {
    let listener = server::bind(&opts.host, opts.port)?;
    let worker = MockWorker::new(opts)?;
    let mut announce = Vec::new();
    if let Some((endpoint, replay)) = worker.zmq_endpoints() {
        announce.push(format!("zmq {endpoint}"));
        if let Some(replay) = replay {
            announce.push(format!("replay {replay}"));
        }
    }
    server::run_announcing(listener, routes::router(worker), &announce)
}
