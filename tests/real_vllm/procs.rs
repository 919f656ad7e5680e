//! Processes of the real-engine test: vLLM engines (`envoy_kv_router_tools::vllm`) and their
//! `kv-event-bridge`s, each in its own process group and killed with it on drop.

use envoy_kv_router_tools::client as http;
use envoy_kv_router_tools::harness::workspace_root;
pub use envoy_kv_router_tools::vllm::{log_tail, Engine, EngineConfig};
use envoy_kv_router_tools::vllm::{require_vllm, ProcessGroup};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `KV_EVENT_BRIDGE_BIN`, default `target/release/kv-event-bridge`.
pub fn bridge_bin() -> PathBuf {
    std::env::var_os("KV_EVENT_BRIDGE_BIN").map_or_else(
        || workspace_root().join("target/release/kv-event-bridge"),
        PathBuf::from,
    )
}

/// Fails loudly (never skips) when something the test needs is missing.
pub fn check_prerequisites() {
    if let Err(e) = require_vllm() {
        panic!("{e}");
    }
    assert!(
        bridge_bin().is_file(),
        "{} is missing: run `cargo build --release -p kv-event-bridge`",
        bridge_bin().display()
    );
}

/// `count` distinct ports free now on every address, below the ephemeral range.
pub fn free_ports(count: usize) -> Vec<u16> {
    envoy_kv_router_tools::vllm::free_ports(count).expect("free ports")
}

/// A `kv-event-bridge` in front of one engine.
pub struct Bridge {
    pub name: String,
    pub port: u16,
    pub log: PathBuf,
    group: ProcessGroup,
}

impl Bridge {
    /// Starts the bridge for `engine` and waits until it is connected (`/health` 200).
    pub fn start(engine: &Engine, port: u16, dir: &Path) -> Bridge {
        let name = format!("bridge of {}", engine.name);
        let log = dir.join(format!("{}-bridge.log", engine.name));
        let mut cmd = Command::new(bridge_bin());
        cmd.args([
            "--engine",
            &format!("tcp://127.0.0.1:{}", engine.pub_port),
            "--replay",
            &format!("tcp://127.0.0.1:{}", engine.replay_port),
            "--block-size",
            "32",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--engine-metrics-url",
            &format!("http://127.0.0.1:{}/metrics", engine.port),
            // Notice a dead publisher within about 2 s instead of the default 10 s.
            "--idle-probe-ms",
            "1000",
        ])
        .env("RUST_LOG", "info");
        let mut bridge = Bridge {
            name,
            port,
            log,
            group: ProcessGroup::spawn(&mut cmd, &dir.join(format!("{}-bridge.log", engine.name)))
                .expect("spawn bridge"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(
                bridge.group.leader_running(),
                "{} exited:\n{}",
                bridge.name,
                log_tail(&bridge.log, 40)
            );
            if http::get(&bridge.addr(), "/health").is_ok_and(|r| r.status == 200) {
                return bridge;
            }
            assert!(
                Instant::now() < deadline,
                "{} not connected after 30 s:\n{}",
                bridge.name,
                log_tail(&bridge.log, 40)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let health = http::request(
                &self.addr(),
                "GET",
                "/health",
                &[],
                &[],
                Duration::from_secs(2),
            )
            .map_or_else(|e| e.to_string(), |r| r.text());
            eprintln!(
                "--- {} /health: {health}\n--- {} log tail ({}) ---\n{}",
                self.name,
                self.name,
                self.log.display(),
                log_tail(&self.log, 30)
            );
        }
        self.group.stop(Duration::from_secs(2));
    }
}
