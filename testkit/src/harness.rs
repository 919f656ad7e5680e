//! Launches the real Envoy binary with the built filter, mock workers and `kv-event-bridge`
//! processes, for integration tests and the demo.
//!
//! A *bridged* worker ([`Worker::spawn_bridged`]) is an engine-mode mock publishing its KV events
//! on ZMQ like vLLM, with a `kv-event-bridge` next to it serving them as the event page: the
//! filter polls the bridge (`events_address`), the path a real engine takes.
//!
//! Every process is owned by a guard that kills it on drop, so a failing (panicking) test still
//! tears everything down. Ports come from the OS (`--port 0` for workers, port 0 listeners for
//! Envoy, read back from the admin API), so tests run in parallel without clashes.

use crate::client;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The workspace root (where `target/`, `.venv/` and `envoy/` live).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn path_from_env(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var).map_or(default, PathBuf::from)
}

/// `ENVOY_BIN`, default `.venv/bin/envoy` (installed by `make envoy`).
pub fn envoy_bin() -> PathBuf {
    path_from_env("ENVOY_BIN", workspace_root().join(".venv/bin/envoy"))
}

/// `KV_ROUTER_WASM`, default `target/envoy_kv_router.wasm` (built by `make build`).
pub fn wasm_path() -> PathBuf {
    path_from_env(
        "KV_ROUTER_WASM",
        workspace_root().join("target/envoy_kv_router.wasm"),
    )
}

/// `MOCK_WORKER_BIN`, default the newest of `target/{release,debug}/mock-worker`.
pub fn mock_worker_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("MOCK_WORKER_BIN") {
        return PathBuf::from(path);
    }
    let root = workspace_root();
    let candidates =
        ["target/release/mock-worker", "target/debug/mock-worker"].map(|p| root.join(p));
    candidates
        .iter()
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p.clone())))
        .max()
        .map_or_else(|| root.join("target/debug/mock-worker"), |(_, p)| p)
}

/// `KV_EVENT_BRIDGE_BIN`, default `target/release/kv-event-bridge` (built by `make build`).
pub fn kv_event_bridge_bin() -> PathBuf {
    path_from_env(
        "KV_EVENT_BRIDGE_BIN",
        workspace_root().join("target/release/kv-event-bridge"),
    )
}

/// The bridge binary, or an error that says how to build it.
pub fn require_kv_event_bridge() -> std::io::Result<PathBuf> {
    let bin = kv_event_bridge_bin();
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "kv-event-bridge not found at {}: build it with `cargo build --release -p \
                 kv-event-bridge` (`make build` builds the workspace) or set KV_EVENT_BRIDGE_BIN",
                bin.display()
            ),
        ))
    }
}

/// Mock-worker flags that publish KV events on ZMQ, with a replay socket, on free ports.
pub const ZMQ_PUBLISH_ARGS: [&str; 4] = [
    "--kv-events-endpoint",
    "tcp://127.0.0.1:0",
    "--kv-events-replay-endpoint",
    "tcp://127.0.0.1:0",
];

/// A child process killed (and reaped) on drop.
pub struct ProcessGuard {
    child: Child,
}

impl ProcessGuard {
    /// Owns `child` from now on.
    pub fn new(child: Child) -> ProcessGuard {
        ProcessGuard { child }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then a kill if it has not exited within `limit`.
    pub fn terminate(&mut self, limit: Duration) {
        if self.is_running() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let deadline = Instant::now() + limit;
            while self.is_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill();
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running mock worker.
pub struct Worker {
    pub id: u64,
    /// `ip:port` it serves on (traffic, events and admin).
    pub addr: String,
    /// Its ZMQ PUB endpoint, when it publishes KV events there (`zmq` line).
    pub zmq: Option<String>,
    /// Its replay ROUTER endpoint (`replay` line).
    pub replay: Option<String>,
    /// The bridge serving its ZMQ events, for a bridged worker.
    pub bridge: Option<Bridge>,
    /// The flags it was started with (after `--port` and `--id`), for [`Worker::restart`].
    args: Vec<String>,
    /// `None` for an engine this harness did not start ([`Worker::external`]).
    process: Option<ProcessGuard>,
}

impl Worker {
    /// Starts `mock-worker --port 0 --id <id> <args>` and waits for its `listening <addr>` line
    /// (then its `zmq`/`replay` lines when `args` ask for ZMQ publishing).
    pub fn spawn(id: u64, args: &[&str]) -> std::io::Result<Worker> {
        Worker::spawn_on(id, 0, args)
    }

    /// [`Worker::spawn`] on a given port (0: a free one).
    pub fn spawn_on(id: u64, port: u16, args: &[&str]) -> std::io::Result<Worker> {
        let mut child = Command::new(mock_worker_bin())
            .args(["--port", &port.to_string(), "--id", &id.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take();
        let mut process = ProcessGuard { child };
        // The startup lines: `listening`, then one per ZMQ socket bound.
        let has = |flag: &str| {
            args.iter()
                .any(|a| *a == flag || a.strip_prefix(flag).is_some_and(|r| r.starts_with('=')))
        };
        let expected = 1
            + usize::from(has("--kv-events-endpoint"))
            + usize::from(has("--kv-events-replay-endpoint"));
        let mut lines = Vec::new();
        if let Some(stdout) = stdout {
            let mut reader = BufReader::new(stdout);
            for _ in 0..expected {
                let mut line = String::new();
                if reader.read_line(&mut line)? == 0 {
                    break;
                }
                lines.push(line.trim().to_string());
            }
            // Keep draining its stdout so the worker never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = String::new();
                while reader.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                    sink.clear();
                }
            });
        }
        let field = |prefix: &str| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix(prefix).map(str::to_string))
        };
        let Some(addr) = field("listening ") else {
            process.kill();
            return Err(std::io::Error::other(format!(
                "mock-worker did not start: {lines:?}"
            )));
        };
        Ok(Worker {
            id,
            addr,
            zmq: field("zmq "),
            replay: field("replay "),
            bridge: None,
            args: args.iter().map(|a| a.to_string()).collect(),
            process: Some(process),
        })
    }

    /// Kills the worker and starts a fresh one with the same id, flags and address: an engine
    /// restart (empty cache, event ids from 1 again). Not for bridged workers.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.restart_with(&[])
    }

    /// [`Worker::restart`] with `extra` flags for this run only (e.g. `--events-fault http_500`:
    /// the engine fills its cache before any router reads it); a later restart drops them.
    pub fn restart_with(&mut self, extra: &[&str]) -> std::io::Result<()> {
        if self.process.is_none() {
            return Err(std::io::Error::other(format!(
                "worker {} was not started here: cannot restart it",
                self.id
            )));
        }
        self.kill();
        let port = self
            .addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or(0);
        let base = self.args.clone();
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        // The port was just freed; a listener in TIME_WAIT elsewhere can hold it for a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Worker::spawn_on(self.id, port, &args) {
                Ok(fresh) => {
                    *self = fresh;
                    self.args = base;
                    return Ok(());
                }
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Whether its process still runs (false after [`Worker::kill`]).
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(ProcessGuard::is_running)
    }

    /// An engine started elsewhere (e.g. a real vLLM, `envoy_kv_router_tools::vllm::Engine`) at `addr`, with
    /// its ZMQ endpoints: the arms address it like a mock, and never stop it.
    pub fn external(id: u64, addr: String, zmq: Option<String>, replay: Option<String>) -> Worker {
        Worker {
            id,
            addr,
            zmq,
            replay,
            bridge: None,
            args: Vec::new(),
            process: None,
        }
    }

    /// Starts `count` workers with ids 1..=count.
    pub fn spawn_many(count: u64, args: &[&str]) -> std::io::Result<Vec<Worker>> {
        (1..=count).map(|id| Worker::spawn(id, args)).collect()
    }

    /// Starts an engine-mode worker (`args` set the mode and its options; the KV block size must
    /// be `block_size`) publishing on ZMQ, and a `kv-event-bridge` for it (replay socket and
    /// load from the worker's `/metrics` included). The filter polls the bridge.
    pub fn spawn_bridged(id: u64, block_size: u32, args: &[&str]) -> std::io::Result<Worker> {
        require_kv_event_bridge()?;
        let mut all: Vec<&str> = args.to_vec();
        all.extend_from_slice(&ZMQ_PUBLISH_ARGS);
        let mut worker = Worker::spawn(id, &all)?;
        let Some(zmq) = worker.zmq.clone() else {
            return Err(std::io::Error::other(
                "mock-worker did not report its ZMQ endpoint (is it in engine mode?)",
            ));
        };
        let metrics = format!("http://{}/metrics", worker.addr);
        worker.bridge = Some(Bridge::spawn(&BridgeOptions {
            label: format!("worker {id}"),
            engine: zmq,
            replay: worker.replay.clone(),
            block_size,
            engine_metrics_url: Some(metrics),
            extra_args: Vec::new(),
        })?);
        Ok(worker)
    }

    /// Bridged workers with ids 1..=count.
    pub fn spawn_many_bridged(
        count: u64,
        block_size: u32,
        args: &[&str],
    ) -> std::io::Result<Vec<Worker>> {
        (1..=count)
            .map(|id| Worker::spawn_bridged(id, block_size, args))
            .collect()
    }

    /// Where the filter reads this worker's events: its bridge, else the worker itself.
    pub fn events_addr(&self) -> &str {
        self.bridge.as_ref().map_or(&self.addr, |b| &b.addr)
    }

    /// This worker's entry in the filter's `workers` list.
    pub fn filter_entry(&self) -> Value {
        let mut entry = json!({"id": self.id, "address": self.addr});
        if let Some(bridge) = &self.bridge {
            entry["events_address"] = json!(bridge.addr);
        }
        entry
    }

    pub fn admin(&self, path: &str, body: &Value) -> std::io::Result<client::Response> {
        client::post_json(&self.addr, path, body)
    }

    pub fn kill(&mut self) {
        if let Some(p) = self.process.as_mut() {
            p.kill();
        }
    }
}

/// How to start a `kv-event-bridge`.
#[derive(Clone, Debug)]
pub struct BridgeOptions {
    /// Names the bridge in forwarded log lines.
    pub label: String,
    /// The engine's PUB endpoint (`--engine`).
    pub engine: String,
    /// Its replay endpoint (`--replay`).
    pub replay: Option<String>,
    pub block_size: u32,
    /// The engine's Prometheus endpoint, for the page's `load`.
    pub engine_metrics_url: Option<String>,
    pub extra_args: Vec<String>,
}

/// A running `kv-event-bridge` on a free port. Its log goes to a file (warnings and errors are
/// also echoed to stderr); the tail is printed if a test panics.
pub struct Bridge {
    /// `127.0.0.1:port` of its HTTP page.
    pub addr: String,
    pub log_path: PathBuf,
    dir: PathBuf,
    process: ProcessGuard,
    /// How it was started, for [`Bridge::restart`].
    opts: BridgeOptions,
}

/// The log line announcing the bridge's address: `kv-event-bridge on http://<addr> for ...`.
const BRIDGE_LISTENING: &str = "kv-event-bridge on http://";

impl Bridge {
    /// Starts the bridge and waits (at most 30 s) until it is subscribed to the engine
    /// (`/health` answers 200).
    pub fn spawn(opts: &BridgeOptions) -> std::io::Result<Bridge> {
        Bridge::spawn_on(opts, "127.0.0.1:0")
    }

    /// Kills the bridge and starts a fresh one with the same options on the same address (a
    /// bridge restart: its mirror rebuilt from the engine's replay buffer, its event ids new).
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.process.kill();
        let (opts, addr) = (self.opts.clone(), self.addr.clone());
        // The port was just freed; retry while something holds it for a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Bridge::spawn_on(&opts, &addr) {
                Ok(fresh) => {
                    *self = fresh;
                    return Ok(());
                }
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// [`Bridge::spawn`] listening on `listen` (`127.0.0.1:0`: a free port).
    pub fn spawn_on(opts: &BridgeOptions, listen: &str) -> std::io::Result<Bridge> {
        let bin = require_kv_event_bridge()?;
        let dir = scratch_dir()?;
        let log_path = dir.join("bridge.log");
        let mut cmd = Command::new(bin);
        cmd.args(["--engine", &opts.engine])
            .args(["--block-size", &opts.block_size.to_string()])
            .args(["--listen", listen]);
        if let Some(replay) = &opts.replay {
            cmd.args(["--replay", replay]);
        }
        if let Some(url) = &opts.engine_metrics_url {
            cmd.args(["--engine-metrics-url", url]);
        }
        // The address is read from the startup log line, so keep info logging on.
        let child = cmd
            .args(&opts.extra_args)
            .env("RUST_LOG", "info")
            .env("RUST_LOG_STYLE", "never")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut process = ProcessGuard { child };
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        if let Some(stderr) = process.child.stderr.take() {
            let mut log = std::fs::File::create(&log_path)?;
            let label = opts.label.clone();
            std::thread::spawn(move || {
                use std::io::Write as _;
                let mut reader = BufReader::new(stderr);
                let mut line = String::new();
                while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                    let _ = log.write_all(line.as_bytes());
                    if let Some(rest) = line.split_once(BRIDGE_LISTENING).map(|(_, r)| r) {
                        let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        let _ = addr_tx.send(addr);
                    } else if line.contains(" WARN ") || line.contains(" ERROR ") {
                        eprint!("[kv-event-bridge, {label}] {line}");
                    }
                    line.clear();
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            match addr_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(addr) => break addr,
                Err(_) if !process.is_running() || Instant::now() >= deadline => {
                    process.kill();
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    return Err(std::io::Error::other(format!(
                        "kv-event-bridge did not start:\n{log}"
                    )));
                }
                Err(_) => {}
            }
        };
        let bridge = Bridge {
            addr,
            log_path,
            dir,
            process,
            opts: opts.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !client::get(&bridge.addr, "/health").is_ok_and(|r| r.status == 200) {
            if Instant::now() >= deadline {
                return Err(std::io::Error::other(format!(
                    "kv-event-bridge at {} is not connected to {} after 30 s:\n{}",
                    bridge.addr,
                    opts.engine,
                    bridge.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(bridge)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        self.process.kill();
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.process.kill();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- kv-event-bridge log ({}) ---\n{}",
                self.log_path.display(),
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// How the filter's choice reaches Envoy's load balancer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Steering {
    /// A STATIC cluster with the `override_host` policy (header source, round-robin fallback).
    OverrideHost,
    /// An ORIGINAL_DST cluster reading the destination header.
    OriginalDst,
}

#[derive(Clone)]
pub struct EnvoyOptions {
    /// The filter's JSON configuration (the test writes its `workers`).
    pub filter_config: Value,
    /// `ip:port` of every worker the worker cluster holds.
    pub worker_addrs: Vec<String>,
    pub steering: Steering,
    /// Envoy worker threads (`--concurrency`).
    pub concurrency: u32,
    /// Route timeout for upstream requests; zero = none, as in the shipped configs (a long
    /// generation streams for minutes). Tests keep a bound so that a hung response fails fast.
    pub route_timeout: Duration,
    /// Listener and route buffer limit (bytes).
    pub buffer_limit_bytes: u64,
    pub log_level: &'static str,
    /// Load the Wasm filter (false: the same Envoy without it, for overhead comparisons).
    pub with_filter: bool,
    /// The filter's .wasm (default [`wasm_path`]).
    pub wasm: Option<PathBuf>,
    /// Speak HTTP/2 (prior knowledge) to the workers instead of the shipped HTTP/1.1: many
    /// requests in flight share a few upstream connections (benches holding 10,000 requests,
    /// which HTTP/1.1 would need 20,000 descriptors for in Envoy). The mock worker serves both.
    pub upstream_http2: bool,
    /// Serve the listener from a watched LDS file instead of the bootstrap, so that
    /// [`Envoy::update_filter_config`] can swap the filter's configuration while Envoy runs.
    pub dynamic_listener: bool,
    /// Envoy-side membership: the worker cluster from filesystem EDS, health checks, outlier
    /// detection, and the `envoy_admin` cluster the filter's `membership` reads. `None`: a STATIC
    /// worker cluster as before.
    pub discovery: Option<Discovery>,
    /// Start it so that [`Envoy::hot_restart`] can replace it: hot restart on (a base id of its
    /// own), the listener on a fixed port (the new process takes over its socket), drains of 1 s
    /// and the old process ended 3 s after the new one started.
    pub hot_restart: bool,
}

/// How Envoy learns and judges the worker cluster's hosts (`EnvoyOptions::discovery`).
#[derive(Clone, Debug, Default)]
pub struct Discovery {
    /// The worker cluster is EDS from `<dir>/eds.json` (`Envoy::set_endpoints` rewrites it);
    /// false: STATIC with `worker_addrs`.
    pub eds: bool,
    /// Active HTTP health checks on `/health` every 100 ms (one failure marks a host unhealthy).
    pub health_checks: bool,
    /// Outlier detection ejecting a host after this many consecutive 5xx.
    pub outlier_consecutive_5xx: Option<u32>,
}

/// Name of the cluster reaching Envoy's own admin interface (no route points at it).
pub const ADMIN_CLUSTER: &str = "envoy_admin";
/// Name of the routed worker cluster.
pub const WORKER_CLUSTER: &str = "llm_workers";

impl EnvoyOptions {
    pub fn new(filter_config: Value, worker_addrs: Vec<String>) -> EnvoyOptions {
        EnvoyOptions {
            filter_config,
            worker_addrs,
            steering: Steering::OverrideHost,
            concurrency: 2,
            route_timeout: Duration::from_secs(60),
            buffer_limit_bytes: 16 * 1024 * 1024,
            log_level: "info",
            with_filter: true,
            wasm: None,
            upstream_http2: false,
            dynamic_listener: false,
            hot_restart: false,
            discovery: None,
        }
    }
}

static INSTANCE: AtomicU64 = AtomicU64::new(0);

fn scratch_dir() -> std::io::Result<PathBuf> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = INSTANCE.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ekr-{}-{n}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn socket_address(addr: &str) -> Value {
    let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "0"));
    let host = host.trim_start_matches('[').trim_end_matches(']');
    json!({"socket_address": {"address": host, "port_value": port.parse::<u16>().unwrap_or(0)}})
}

/// A free loopback port (bound, read back, released): the admin port must be known before
/// Envoy starts when the filter reads admin through a cluster.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The EDS resource file content for the worker cluster.
pub fn eds_document(addrs: &[String]) -> Value {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|a| json!({"endpoint": {"address": socket_address(a)}}))
        .collect();
    json!({
        "version_info": format!("{}", SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": WORKER_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}]
        }]
    })
}

/// Writes `doc` to `path` atomically (a temporary file renamed over it), as EDS watchers expect.
fn write_atomically(path: &Path, doc: &Value) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, doc.to_string())?;
    std::fs::rename(&tmp, path)
}

/// Adds the discovery parts to a bootstrap: EDS, health checks, outlier detection, the admin
/// cluster on `admin_port`.
fn add_discovery(doc: &mut Value, discovery: &Discovery, dir: &Path, admin_port: u16) {
    doc["admin"] = json!({"address": socket_address(&format!("127.0.0.1:{admin_port}"))});
    // EDS subscriptions need a node identity.
    doc["node"] = json!({"id": "ekr-test", "cluster": "ekr-test"});
    let cluster = &mut doc["static_resources"]["clusters"][0];
    if discovery.eds {
        if let Some(map) = cluster.as_object_mut() {
            map.remove("load_assignment");
        }
        cluster["type"] = json!("EDS");
        cluster["eds_cluster_config"] = json!({"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": dir.join("eds.json").to_string_lossy(),
                "watched_directory": {"path": dir.to_string_lossy()}
            }
        }});
    }
    if discovery.health_checks {
        cluster["health_checks"] = json!([{
            "timeout": "1s", "interval": "0.1s", "no_traffic_interval": "0.1s",
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "http_health_check": {"path": "/health"}
        }]);
    }
    if let Some(n) = discovery.outlier_consecutive_5xx {
        cluster["outlier_detection"] = json!({
            "consecutive_5xx": n, "enforcing_consecutive_5xx": 100,
            "interval": "1s", "base_ejection_time": "60s", "max_ejection_percent": 100,
            // Otherwise the next passing active health check (every 100 ms) un-ejects the host.
            "successful_active_health_check_uneject_host": false
        });
    }
    if let Some(clusters) = doc["static_resources"]["clusters"].as_array_mut() {
        clusters.push(json!({
            "name": ADMIN_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": ADMIN_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": socket_address(&format!("127.0.0.1:{admin_port}"))}}]}]}
        }));
    }
}

/// Envoy's stats tag extraction for the filter's stats, `(tag_name, regex)`: the same
/// `stats_config.stats_tags` as every shipped Envoy configuration (`envoy/*.yaml`, `deploy/`;
/// `tests/metrics_tags.rs` checks they agree, docs/METRICS.md explains them). Each regex's first
/// group is cut from the name, its second is the tag's value, so that
/// `wasmcustom.kv_router.worker.1.rank.0.active_requests` is exported to Prometheus as
/// `kv_router_worker_active_requests{worker="1",rank="0"}`; `/stats` keeps the full names.
pub const STATS_TAGS: [(&str, &str); 5] = [
    ("worker", r"^wasmcustom\.kv_router\.worker\.((\d+)\.)"),
    (
        "rank",
        r"^wasmcustom\.kv_router\.worker\.\d+\.(rank\.(\d+)\.)",
    ),
    ("reason", r"^wasmcustom\.kv_router\.routed(\.([^.]+))$"),
    (
        "why",
        r"^wasmcustom\.kv_router\.(?:tokenizer\.)?fallback(\.([^.]+))$",
    ),
    ("kind", r"^wasmcustom\.kv_router\.rejected(\.([^.]+))$"),
];

/// `stats_config` of the bootstrap: [`STATS_TAGS`] (Envoy's default tags stay on).
pub fn stats_config() -> Value {
    let tags: Vec<Value> = STATS_TAGS
        .iter()
        .map(|(tag, regex)| json!({"tag_name": tag, "regex": regex}))
        .collect();
    json!({"stats_tags": tags})
}

/// The Envoy bootstrap, the same shape as `envoy/envoy.yaml`, with ports chosen by the OS.
/// With `lds_path`, the listener comes from that watched file (see [`lds_resources`]).
pub fn bootstrap(opts: &EnvoyOptions, wasm: &Path, lds_path: Option<&Path>) -> Value {
    let endpoints: Vec<Value> = opts
        .worker_addrs
        .iter()
        .map(|a| json!({"endpoint": {"address": socket_address(a)}}))
        .collect();
    let round_robin = json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]});
    let header = opts.filter_config["destination_header"]
        .as_str()
        .unwrap_or("x-gateway-destination-endpoint")
        .to_string();
    let worker_cluster = match opts.steering {
        Steering::OverrideHost => json!({
            "name": "llm_workers", "type": "STATIC", "connect_timeout": "2s",
            "per_connection_buffer_limit_bytes": opts.buffer_limit_bytes,
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                    "override_host_sources": [{"header": header}],
                    "fallback_policy": round_robin}}}]},
            "load_assignment": {"cluster_name": "llm_workers", "endpoints": [{"lb_endpoints": endpoints}]}
        }),
        Steering::OriginalDst => json!({
            "name": "llm_workers", "type": "ORIGINAL_DST", "connect_timeout": "2s",
            "lb_policy": "CLUSTER_PROVIDED",
            "per_connection_buffer_limit_bytes": opts.buffer_limit_bytes,
            "original_dst_lb_config": {"use_http_header": true, "http_header_name": header}
        }),
    };
    let worker_cluster = with_llm_limits(worker_cluster, opts.upstream_http2);
    let listeners = if opts.dynamic_listener {
        Vec::new()
    } else {
        vec![listener(opts, wasm, "127.0.0.1:0")]
    };
    let mut config = json!({
        "admin": {"address": socket_address("127.0.0.1:0")},
        "stats_config": stats_config(),
        "static_resources": {
            "listeners": listeners,
            "clusters": [worker_cluster, {
                "name": "kv_events", "type": "ORIGINAL_DST", "connect_timeout": "1s",
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {"use_http_header": true},
                // One long poll per worker at a time, plus dumps.
                "circuit_breakers": {"thresholds": [{"max_connections": 16384,
                    "max_pending_requests": 16384, "max_requests": 16384}]}
            }]
        },
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": 100000}}]}
    });
    if let Some(lds) = lds_path {
        let watched = lds
            .parent()
            .map_or_else(String::new, |d| d.to_string_lossy().into_owned());
        // Envoy wants a node identity for any xDS source, a file included.
        config["node"] = json!({"id": "kv-router-test", "cluster": "kv-router-test"});
        config["dynamic_resources"] = json!({"lds_config": {"resource_api_version": "V3",
            "path_config_source": {"path": lds.to_string_lossy(), "watched_directory": {"path": watched}}}});
    }
    config
}

/// The LDS file's content: the one listener, on `address`.
pub fn lds_resources(opts: &EnvoyOptions, wasm: &Path, address: &str) -> Value {
    let mut listener = listener(opts, wasm, address);
    listener["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
    json!({"resources": [listener]})
}

/// The LLM listener on `address`, with the filter (when `opts.with_filter`) and the router.
fn listener(opts: &EnvoyOptions, wasm: &Path, address: &str) -> Value {
    // "0s" disables the route timeout.
    let timeout = format!("{}s", opts.route_timeout.as_secs_f64());
    let wasm_filter = json!({"name": "envoy.filters.http.wasm", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        "config": {
            "name": "kv_router", "root_id": "kv_router",
            "allow_on_headers_stop_iteration": true,
            "failure_policy": "FAIL_RELOAD",
            // A crashed VM is replaced at the next request after this back-off; requests in
            // between fail fast with a 503 (Envoy's default is 1 s).
            "reload_config": {"backoff": {"base_interval": "0.1s", "max_interval": "1s"}},
            "vm_config": {"vm_id": "kv_router", "runtime": "envoy.wasm.runtime.v8",
                "code": {"local": {"filename": wasm.to_string_lossy()}}},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin_configuration(&opts.filter_config)}}}});
    let router = json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}});
    let http_filters = if opts.with_filter {
        vec![wasm_filter, router]
    } else {
        vec![router]
    };
    json!({
                "name": "llm",
                "address": socket_address(address),
                "per_connection_buffer_limit_bytes": opts.buffer_limit_bytes,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "llm",
                        // As envoy/envoy.yaml: a non-streamed completion or a queued long
                        // prompt is silent for minutes before its first byte.
                        "stream_idle_timeout": "900s",
                        "request_headers_timeout": "10s",
                        "route_config": {"virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": [{
                            "match": {"prefix": "/"},
                            "route": {"cluster": "llm_workers", "timeout": timeout,
                                "retry_policy": {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                                 "num_retries": 2}}}]}]},
                        "http_filters": http_filters
                    }}]}]
    })
}

/// The filter's configuration string: a JSON string value as it is (the floor filter's plain
/// `<header> <ip:port>`, `benches/floor-filter`), anything else as its JSON text.
fn plugin_configuration(config: &Value) -> String {
    match config {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Writes the LDS file atomically (a rename into the watched directory, which Envoy reloads).
fn write_lds(path: &Path, opts: &EnvoyOptions, address: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let wasm = opts.wasm.clone().unwrap_or_else(wasm_path);
    let tmp = dir.with_extension("tmp.json");
    std::fs::write(&tmp, lds_resources(opts, &wasm, address).to_string())?;
    std::fs::rename(&tmp, path)
}

/// The worker cluster's limits sized for LLM traffic, as in envoy/envoy.yaml (reasons there):
/// circuit breakers far above the 1,024 defaults with a retry budget instead of 3 concurrent
/// retries, and upstream connections closed before vLLM's 5 s keep-alive closes them.
/// `http2`: HTTP/2 to the workers instead ([`EnvoyOptions::upstream_http2`]).
fn with_llm_limits(mut cluster: Value, http2: bool) -> Value {
    cluster["circuit_breakers"] = json!({"thresholds": [{
        "max_connections": 100_000, "max_pending_requests": 100_000, "max_requests": 100_000,
        "retry_budget": {"budget_percent": {"value": 20}, "min_retry_concurrency": 100}}]});
    cluster["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": if http2 {
                json!({"http2_protocol_options": {}})
            } else {
                json!({"http_protocol_options": {}})
            },
            "common_http_protocol_options": {"idle_timeout": "4s"}}});
    cluster
}

/// A running Envoy with the filter loaded.
pub struct Envoy {
    /// `127.0.0.1:port` of the LLM listener.
    pub listener: String,
    /// `127.0.0.1:port` of the admin API.
    pub admin: String,
    pub dir: PathBuf,
    /// With [`EnvoyOptions::dynamic_listener`]: the options the LDS file was written from.
    dynamic: Option<EnvoyOptions>,
    process: ProcessGuard,
    /// With [`EnvoyOptions::hot_restart`]: what the next epoch needs.
    hot: Option<HotRestart>,
}

/// What [`Envoy::hot_restart`] starts the next process with.
struct HotRestart {
    base_id: String,
    epoch: u32,
    /// Every flag but `--restart-epoch`, `--base-id` and `--admin-address-path`.
    args: Vec<String>,
    /// The previous epoch's process (it drains and exits; killed on drop if it has not).
    parent: Option<ProcessGuard>,
}

/// Starts `envoy <args> <extra> [<extra_path>] --admin-address-path <admin_path>`, its log
/// (stderr) to `log_path`.
fn spawn_envoy(
    args: &[String],
    extra: &[&str],
    extra_path: Option<&Path>,
    admin_path: &Path,
    log_path: &Path,
) -> std::io::Result<Child> {
    let log = std::fs::File::create(log_path)?;
    let mut cmd = Command::new(envoy_bin());
    cmd.args(args).args(extra);
    if let Some(path) = extra_path {
        cmd.arg(path);
    }
    cmd.arg("--admin-address-path")
        .arg(admin_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
}

impl Envoy {
    /// Starts Envoy and waits until its admin API reports ready (at most 60 s).
    pub fn start(opts: &EnvoyOptions) -> std::io::Result<Envoy> {
        let dir = scratch_dir()?;
        let config_path = dir.join("envoy.json");
        let wasm = opts.wasm.clone().unwrap_or_else(wasm_path);
        let lds_path = dir.join("lds/listeners.json");
        let dynamic = if opts.dynamic_listener {
            let mut opts = opts.clone();
            opts.wasm = Some(wasm.clone());
            let port = free_port()?;
            write_lds(&lds_path, &opts, &format!("127.0.0.1:{port}"))?;
            Some(opts)
        } else {
            None
        };
        let lds = dynamic.as_ref().map(|_| lds_path.as_path());
        let mut doc = bootstrap(opts, &wasm, lds);
        if let Some(discovery) = &opts.discovery {
            add_discovery(&mut doc, discovery, &dir, free_port()?);
            write_atomically(&dir.join("eds.json"), &eds_document(&opts.worker_addrs))?;
        }
        if opts.hot_restart {
            // The new process takes over the listener's socket by its address: not port 0.
            let address = socket_address(&format!("127.0.0.1:{}", free_port()?));
            if let Some(listener) = doc["static_resources"]["listeners"].get_mut(0) {
                listener["address"] = address;
            }
        }
        std::fs::write(&config_path, doc.to_string())?;
        let admin_path = dir.join("admin-address");
        let mut args: Vec<String> = vec![
            "-c".into(),
            config_path.to_string_lossy().into_owned(),
            "--concurrency".into(),
            opts.concurrency.to_string(),
            "-l".into(),
            opts.log_level.into(),
            "--component-log-level".into(),
            "wasm:info".into(),
        ];
        let (child, hot) = if opts.hot_restart {
            args.extend(["--drain-time-s", "1", "--parent-shutdown-time-s", "3"].map(String::from));
            let base_id_path = dir.join("base-id");
            let child = spawn_envoy(
                &args,
                &["--use-dynamic-base-id", "--base-id-path"],
                Some(&base_id_path),
                &admin_path,
                &dir.join("envoy.log"),
            )?;
            (child, Some(base_id_path))
        } else {
            // Tests kill Envoy; without hot restart it keeps no shared-memory file in /dev/shm.
            let child = spawn_envoy(
                &args,
                &["--disable-hot-restart"],
                None,
                &admin_path,
                &dir.join("envoy.log"),
            )?;
            (child, None)
        };
        let mut envoy = Envoy {
            listener: String::new(),
            admin: String::new(),
            dir,
            dynamic,
            process: ProcessGuard { child },
            hot: None,
        };
        envoy.wait_ready(&admin_path, Duration::from_secs(60))?;
        if let Some(path) = hot {
            let base_id = std::fs::read_to_string(&path)?.trim().to_string();
            envoy.hot = Some(HotRestart {
                base_id,
                epoch: 0,
                args,
                parent: None,
            });
        }
        Ok(envoy)
    }

    /// An Envoy hot restart (needs [`EnvoyOptions::hot_restart`]): starts the next epoch with the
    /// same configuration, which takes over the listener's socket and tells this process to
    /// drain (1 s) and exit (3 s). Returns once the new process is ready; from then on this
    /// handle (admin, stats, log) is the new process's. The filter's VM in it starts afresh.
    pub fn hot_restart(&mut self) -> std::io::Result<()> {
        let Some(hot) = self.hot.as_mut() else {
            return Err(std::io::Error::other(
                "Envoy was started without EnvoyOptions::hot_restart",
            ));
        };
        hot.epoch += 1;
        let epoch = hot.epoch.to_string();
        let admin_path = self.dir.join(format!("admin-address-{epoch}"));
        let child = spawn_envoy(
            &hot.args,
            &["--base-id", &hot.base_id, "--restart-epoch", &epoch],
            None,
            &admin_path,
            &self.dir.join(format!("envoy-{epoch}.log")),
        )?;
        let old = std::mem::replace(&mut self.process, ProcessGuard { child });
        hot.parent = Some(old);
        let (listener, admin) = (self.listener.clone(), std::mem::take(&mut self.admin));
        if let Err(e) = self.wait_ready(&admin_path, Duration::from_secs(60)) {
            self.admin = admin;
            return Err(e);
        }
        if self.listener != listener {
            return Err(std::io::Error::other(format!(
                "the new Envoy listens on {} instead of {listener}",
                self.listener
            )));
        }
        Ok(())
    }

    /// Waits (at most `limit`) until the process a [`Envoy::hot_restart`] replaced has exited.
    pub fn wait_parent_exit(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let running = self
                .hot
                .as_mut()
                .and_then(|h| h.parent.as_mut())
                .is_some_and(ProcessGuard::is_running);
            if !running {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    fn wait_ready(&mut self, admin_path: &Path, limit: Duration) -> std::io::Result<()> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if !self.process.is_running() {
                return Err(std::io::Error::other(format!(
                    "envoy exited:\n{}",
                    self.log_tail(40)
                )));
            }
            if self.admin.is_empty() {
                if let Ok(addr) = std::fs::read_to_string(admin_path) {
                    self.admin = addr.trim().to_string();
                }
            }
            if !self.admin.is_empty() {
                let ready = client::get(&self.admin, "/ready").is_ok_and(|r| r.status == 200);
                if ready {
                    if let Some(listener) = self.listener_address() {
                        self.listener = listener;
                        return Ok(());
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(std::io::Error::other(format!(
            "envoy not ready in time:\n{}",
            self.log_tail(40)
        )))
    }

    /// The process id (for memory sampling).
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// Resident memory of the Envoy process in KiB (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    /// Replaces the filter's configuration through the watched LDS file (needs
    /// [`EnvoyOptions::dynamic_listener`]); Envoy swaps the listener's filter chain in place and
    /// drains the old one. Returns once `listener_manager.lds.update_success` has moved on.
    pub fn update_filter_config(&mut self, filter_config: Value) -> std::io::Result<()> {
        let Some(opts) = self.dynamic.as_mut() else {
            return Err(std::io::Error::other(
                "Envoy was started without a dynamic listener",
            ));
        };
        opts.filter_config = filter_config;
        let opts = opts.clone();
        let key = "listener_manager.lds.update_success";
        let before = self.stats().get(key).copied().unwrap_or(0);
        write_lds(&self.dir.join("lds/listeners.json"), &opts, &self.listener)?;
        if self.wait_for(Duration::from_secs(30), |e| {
            e.stats().get(key).copied().unwrap_or(0) > before
        }) {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "Envoy did not take the LDS update:\n{}",
                self.log_tail(20)
            )))
        }
    }

    /// The LLM listener's bound address, from `/listeners?format=json`.
    fn listener_address(&self) -> Option<String> {
        let body = client::get(&self.admin, "/listeners?format=json")
            .ok()?
            .json()
            .ok()?;
        let listener = body["listener_statuses"].as_array()?.first()?;
        let socket = &listener["local_address"]["socket_address"];
        Some(format!(
            "{}:{}",
            socket["address"].as_str()?,
            socket["port_value"].as_u64()?
        ))
    }

    /// Replaces the EDS worker cluster's endpoints (`Discovery::eds`).
    pub fn set_endpoints(&self, addrs: &[String]) -> std::io::Result<()> {
        write_atomically(&self.dir.join("eds.json"), &eds_document(addrs))
    }

    /// The worker cluster's hosts as Envoy has them: `(ip:port, health flags)` from
    /// `/clusters?format=json`.
    pub fn cluster_hosts(&self) -> Vec<(String, Value)> {
        let Ok(Ok(body)) = client::get(&self.admin, "/clusters?format=json").map(|r| r.json())
        else {
            return Vec::new();
        };
        let clusters = body["cluster_statuses"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let Some(c) = clusters.iter().find(|c| c["name"] == WORKER_CLUSTER) else {
            return Vec::new();
        };
        c["host_statuses"]
            .as_array()
            .map(|hosts| {
                hosts
                    .iter()
                    .map(|h| {
                        let s = &h["address"]["socket_address"];
                        (
                            format!(
                                "{}:{}",
                                s["address"].as_str().unwrap_or(""),
                                s["port_value"]
                            ),
                            h["health_status"].clone(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Sends a request through Envoy's listener.
    pub fn send(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<client::Response> {
        client::request(
            &self.listener,
            "POST",
            path,
            headers,
            body,
            Duration::from_secs(30),
        )
    }

    pub fn post_json(&self, path: &str, body: &Value) -> std::io::Result<client::Response> {
        self.send(
            path,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    /// Every stat as `name -> value` (counters and gauges).
    pub fn stats(&self) -> std::collections::HashMap<String, u64> {
        let mut stats = std::collections::HashMap::new();
        if let Ok(resp) = client::get(&self.admin, "/stats") {
            for line in resp.text().lines() {
                if let Some((name, value)) = line.split_once(": ") {
                    if let Ok(value) = value.trim().parse() {
                        stats.insert(name.to_string(), value);
                    }
                }
            }
        }
        stats
    }

    /// One of the filter's stats (`wasmcustom.kv_router.<name>`), 0 when not yet defined.
    pub fn router_stat(&self, name: &str) -> u64 {
        self.stats()
            .get(&format!("wasmcustom.kv_router.{name}"))
            .copied()
            .unwrap_or(0)
    }

    /// Polls `cond` every 25 ms until it holds or `limit` passes.
    pub fn wait_for(&self, limit: Duration, mut cond: impl FnMut(&Envoy) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if cond(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The running process's log (after a [`Envoy::hot_restart`], the new epoch's).
    fn log_path(&self) -> PathBuf {
        match self.hot.as_ref().map_or(0, |h| h.epoch) {
            0 => self.dir.join("envoy.log"),
            epoch => self.dir.join(format!("envoy-{epoch}.log")),
        }
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(hot) = self.hot.as_mut() {
            if let Some(parent) = hot.parent.as_mut() {
                parent.terminate(Duration::from_secs(5));
            }
            self.process.terminate(Duration::from_secs(5));
            // Hot restart keeps its state in shared memory named by the base id (times 10), and
            // Envoy leaves it behind even on a clean exit.
            let _ = std::fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}0", hot.base_id));
        }
        self.process.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- envoy log ({}) ---\n{}",
                self.dir.display(),
                self.log_tail(60)
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
