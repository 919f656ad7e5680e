//! Peer routers as arms of a comparison: `vllm-router` (PyPI, installed in `.venv` by
//! `scripts/setup.sh`) started in front of a fleet of mock workers instead of Envoy.
//!
//! Arms are named `vllm-router:<policy>` (`cache_aware`, `power_of_two`, `round_robin`,
//! `kv_aware`, ...). `kv_aware` subscribes to the workers' ZMQ KV events (and their replay
//! sockets), so the fleet must publish them, under vLLM's default (empty) topic: a static
//! `--kv-event-source` takes no topic and silently drops every message under another one
//! ([`PEER_WORKER_ARGS`]). It recomputes its own block keys from the events' `token_ids` and
//! uses the engine's block hashes only as ids linking a block to its parent, so the mock's
//! hashes (not vLLM's) do not matter.

use crate::client;
use crate::harness::{workspace_root, ProcessGuard, Worker};
use std::io;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Mock-worker flags of a peer arm's fleet on top of ZMQ publishing: vLLM's default (empty)
/// topic, the only one vllm-router's static event sources accept, and vLLM's default block
/// hashes (`sha256`, no PYTHONHASHSEED), so that the events are those a vLLM engine publishes.
pub const PEER_WORKER_ARGS: [&str; 4] = [
    "--kv-events-topic",
    crate::mock::vllm_wire::VLLM_DEFAULT_TOPIC,
    "--block-hash",
    "vllm-sha256",
];

/// The arm-name prefix of a vllm-router arm.
pub const VLLM_ROUTER_PREFIX: &str = "vllm-router:";

/// The policy of a `vllm-router:<policy>` arm name.
pub fn vllm_router_policy(arm: &str) -> Option<&str> {
    arm.strip_prefix(VLLM_ROUTER_PREFIX)
        .filter(|policy| !policy.is_empty())
}

/// `VLLM_ROUTER_BIN`, default `.venv/bin/vllm-router` (installed by `make setup`).
pub fn vllm_router_bin() -> PathBuf {
    std::env::var_os("VLLM_ROUTER_BIN").map_or_else(
        || workspace_root().join(".venv/bin/vllm-router"),
        PathBuf::from,
    )
}

/// The vllm-router binary, or an error that says how to install it.
pub fn require_vllm_router() -> io::Result<PathBuf> {
    let bin = vllm_router_bin();
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "vllm-router not found at {}: install it with `make setup` (pip install \
                 vllm-router into .venv) or set VLLM_ROUTER_BIN",
                bin.display()
            ),
        ))
    }
}

/// A port free right now (the OS picks it; vllm-router cannot bind port 0 and report it).
fn free_port() -> io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// How to start one vllm-router.
#[derive(Clone, Debug)]
pub struct VllmRouterOptions {
    pub policy: String,
    /// KV block size of the workers (for `kv_aware`'s event index).
    pub block_size: u32,
    /// The model name the workers serve (`kv_aware` needs a model identity).
    pub model: String,
    pub extra_args: Vec<String>,
}

/// A running vllm-router, killed on drop. Its log goes to a file; the tail is printed if the
/// thread panics.
pub struct VllmRouter {
    /// `127.0.0.1:port` it serves on.
    pub addr: String,
    /// `127.0.0.1:port` of its Prometheus exporter (`/metrics`).
    pub metrics_addr: String,
    pub log_path: PathBuf,
    process: ProcessGuard,
}

impl VllmRouter {
    /// The command-line arguments for `workers` (without host and ports).
    pub fn args(opts: &VllmRouterOptions, workers: &[Worker]) -> io::Result<Vec<String>> {
        let urls: Vec<String> = workers
            .iter()
            .map(|w| format!("http://{}", w.addr))
            .collect();
        let mut args = vec!["--policy".to_string(), opts.policy.clone()];
        args.push("--worker-urls".into());
        args.extend(urls.iter().cloned());
        // Benchmarks offer more than the default queue of 100; errors should be the router's
        // routing, not retries hiding a failed attempt.
        args.extend(
            [
                "--queue-size",
                "65536",
                "--request-timeout-secs",
                "600",
                "--disable-retries",
                "--log-level",
                "warning",
            ]
            .map(String::from),
        );
        if opts.policy == "kv_aware" {
            for (url, w) in urls.iter().zip(workers) {
                let Some(zmq) = &w.zmq else {
                    return Err(io::Error::other(format!(
                        "kv_aware needs the workers' ZMQ KV events; worker {} publishes none",
                        w.id
                    )));
                };
                args.push("--kv-event-source".into());
                args.push(format!("{url}={zmq}"));
                if let Some(replay) = &w.replay {
                    args.push("--kv-event-replay-source".into());
                    args.push(format!("{url}={replay}"));
                }
            }
            args.push("--kv-event-block-size".into());
            args.push(opts.block_size.to_string());
            args.push("--kv-event-model".into());
            args.push(opts.model.clone());
        }
        args.extend(opts.extra_args.iter().cloned());
        Ok(args)
    }

    /// Starts vllm-router in front of `workers` and waits (at most 60 s) until its `/health`
    /// answers 200 (it checks the workers' health before it listens).
    pub fn start(opts: &VllmRouterOptions, workers: &[Worker]) -> io::Result<VllmRouter> {
        let bin = require_vllm_router()?;
        let args = VllmRouter::args(opts, workers)?;
        let port = free_port()?;
        let metrics_port = free_port()?;
        let dir =
            std::env::temp_dir().join(format!("ekr-vllm-router-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let log_path = dir.join("vllm-router.log");
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // Its Prometheus exporter defaults to a fixed port: parallel arms would clash.
            .args(["--prometheus-port", &metrics_port.to_string()])
            .args(&args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut router = VllmRouter {
            addr: format!("127.0.0.1:{port}"),
            metrics_addr: format!("127.0.0.1:{metrics_port}"),
            log_path,
            process: ProcessGuard::new(child),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !client::get(&router.addr, "/health").is_ok_and(|r| r.status == 200) {
            if !router.process.is_running() || Instant::now() >= deadline {
                router.process.kill();
                return Err(io::Error::other(format!(
                    "vllm-router ({}) did not become ready on {}:\n{}",
                    opts.policy,
                    router.addr,
                    router.log_tail(40)
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(router)
    }

    /// `kv_aware`'s placement lookups so far, `(hit, miss)`, from its Prometheus exporter
    /// (`vllm_router_kv_placement_lookups_total`; a result not yet seen counts 0).
    pub fn placement_lookups(&self) -> io::Result<(f64, f64)> {
        let page = client::get(&self.metrics_addr, "/metrics")?;
        let scrape = crate::prom::Scrape::parse(&String::from_utf8_lossy(&page.body));
        let count = |result: &str| {
            scrape
                .sum(
                    "vllm_router_kv_placement_lookups_total",
                    &[("result", result)],
                )
                .unwrap_or(0.0)
        };
        Ok((count("hit"), count("miss")))
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for VllmRouter {
    fn drop(&mut self) {
        self.process.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- vllm-router log ({}) ---\n{}",
                self.log_path.display(),
                self.log_tail(40)
            );
        } else if let Some(dir) = self.log_path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
