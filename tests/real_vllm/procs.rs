//! Processes of the real-engine test: vLLM engines (`scripts/vllm/serve.sh`) and their
//! `kv-event-bridge`s, each in its own process group and killed with it on drop.
//!
//! `serve.sh` execs python, and vLLM starts more processes under it (EngineCore, a worker, a
//! resource tracker): killing the leader alone would leave those holding the ports. So every
//! process starts as the leader of a new group and the whole group is signalled.

use envoy_kv_router_tools::client as http;
use envoy_kv_router_tools::harness::workspace_root;
use std::fs::OpenOptions;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The vLLM install the engines run from (`VLLM_HOME`, default `<repo>/.vllm`).
pub fn vllm_home() -> PathBuf {
    std::env::var_os("VLLM_HOME").map_or_else(|| workspace_root().join(".vllm"), PathBuf::from)
}

/// `KV_EVENT_BRIDGE_BIN`, default `target/release/kv-event-bridge`.
pub fn bridge_bin() -> PathBuf {
    std::env::var_os("KV_EVENT_BRIDGE_BIN").map_or_else(
        || workspace_root().join("target/release/kv-event-bridge"),
        PathBuf::from,
    )
}

/// Fails loudly (never skips) when something the test needs is missing.
pub fn check_prerequisites() {
    let home = vllm_home();
    assert!(
        home.join(".installed-0.32.0").is_file() && home.join("tiny/config.json").is_file(),
        "no vLLM install in {} (needs .installed-0.32.0 and tiny/): run `bash scripts/vllm/install.sh` \
         (`make test` runs it from scripts/setup.sh)",
        home.display()
    );
    assert!(
        bridge_bin().is_file(),
        "{} is missing: run `cargo build --release -p kv-event-bridge`",
        bridge_bin().display()
    );
}

/// The first port of the kernel's ephemeral range (what outgoing connections use).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// `count` distinct ports free now on every address, below the ephemeral range: a restarted
/// engine binds its ports again while its bridge keeps connecting to them, and a connection from
/// an ephemeral port equal to the listening port would connect to itself and take the port.
pub fn free_ports(count: usize) -> Vec<u16> {
    let top = ephemeral_start();
    let bottom = 10_000u16.min(top / 2);
    let span = u64::from(top - bottom);
    let mut seed = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let mut held: Vec<TcpListener> = Vec::new();
    for _ in 0..10_000 {
        if held.len() == count {
            break;
        }
        seed = envoy_kv_router_tools::util::splitmix64(seed);
        let port = bottom + (seed % span) as u16;
        // The engine's ZMQ sockets bind every address: a port free on 0.0.0.0 is free on all.
        if let Ok(listener) = TcpListener::bind(("0.0.0.0", port)) {
            held.push(listener);
        }
    }
    assert_eq!(held.len(), count, "no {count} free ports below {top}");
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// A process started as the leader of its own process group; the group is killed on drop.
struct Group {
    child: Child,
    pgid: libc::pid_t,
}

impl Group {
    fn spawn(cmd: &mut Command, log: &Path) -> Group {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open log");
        let err = out.try_clone().expect("clone log handle");
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent. With it, a
        // test process that dies without running its destructors sends the leader a SIGTERM
        // (on which vLLM's API server stops its EngineCore and worker: checked by hand).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let pgid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        Group { child, pgid }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) with a negative pid signals our own child's process group; it touches
        // no memory.
        unsafe { libc::kill(-self.pgid, sig) };
    }

    /// Whether any process of the group is still alive (the leader is reaped by `try_wait`).
    fn any_alive(&mut self) -> bool {
        let _ = self.child.try_wait();
        // SAFETY: signal 0 only checks that the group exists.
        unsafe { libc::kill(-self.pgid, 0) == 0 }
    }

    fn leader_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then SIGKILL after `grace`; returns once the whole group is gone (at most 30 s
    /// after the SIGKILL: a process stuck in the kernel is reported, not waited for forever).
    fn stop(&mut self, grace: Duration) {
        if !grace.is_zero() {
            self.signal(libc::SIGTERM);
            let deadline = Instant::now() + grace;
            while self.any_alive() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.any_alive() {
            if Instant::now() >= deadline {
                eprintln!("process group {} still alive 30 s after SIGKILL", self.pgid);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// The last `lines` lines of a log file, without the access-log lines of the bridge's metric
/// scrapes (one a second: they would fill any tail).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("\"GET /metrics HTTP"))
        .collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A real vLLM engine (`scripts/vllm/serve.sh`, fast test configuration: eager, in-process
/// worker, blocks of 32 tokens).
pub struct Engine {
    pub name: String,
    pub port: u16,
    pub pub_port: u16,
    pub replay_port: u16,
    /// `--num-gpu-blocks-override`; `None`: sized by vLLM from `VLLM_CPU_KVCACHE_SPACE`.
    pub num_blocks: Option<u32>,
    run_dir: PathBuf,
    pub log: PathBuf,
    group: Option<Group>,
}

impl Engine {
    pub fn new(name: &str, ports: [u16; 3], num_blocks: Option<u32>, dir: &Path) -> Engine {
        Engine {
            name: name.to_string(),
            port: ports[0],
            pub_port: ports[1],
            replay_port: ports[2],
            num_blocks,
            run_dir: dir.join(format!("{name}-run")),
            log: dir.join(format!("{name}.log")),
            group: None,
        }
    }

    /// `127.0.0.1:port` of its OpenAI server.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the engine (same ports and run dir every time) without waiting for it.
    pub fn start(&mut self) {
        assert!(self.group.is_none(), "{} already started", self.name);
        // One log across restarts, each start marked.
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open engine log");
        let _ = writeln!(log, "--- {} starting ---", self.name);
        let mut cmd = Command::new("bash");
        cmd.arg(workspace_root().join("scripts/vllm/serve.sh"))
            .env("VLLM_HOME", vllm_home())
            .env("HOST", "127.0.0.1")
            .env("PORT", self.port.to_string())
            .env("KV_PUB_PORT", self.pub_port.to_string())
            .env("KV_REPLAY_PORT", self.replay_port.to_string())
            .env("BLOCK_SIZE", "32")
            .env("MAX_LEN", "512")
            .env(
                "NUM_BLOCKS",
                self.num_blocks.map_or_else(String::new, |n| n.to_string()),
            )
            .env("RUN_DIR", &self.run_dir);
        self.group = Some(Group::spawn(&mut cmd, &self.log));
    }

    /// Waits until `GET /health` answers 200; fails at once if the engine exits.
    pub fn wait_healthy(&mut self, limit: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        let deadline = started + limit;
        loop {
            let Some(group) = self.group.as_mut() else {
                return Err(format!("{} is not started", self.name));
            };
            if !group.leader_running() {
                return Err(format!(
                    "{} exited during start-up; log tail:\n{}",
                    self.name,
                    log_tail(&self.log, 40)
                ));
            }
            if http::get(&self.addr(), "/health").is_ok_and(|r| r.status == 200) {
                return Ok(started.elapsed());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} not healthy after {limit:?}; log tail:\n{}",
                    self.name,
                    log_tail(&self.log, 40)
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Kills the engine's whole process group at once (a crash, not a shutdown).
    pub fn kill(&mut self) {
        if let Some(mut group) = self.group.take() {
            group.stop(Duration::ZERO);
        }
    }

    /// The sum of a Prometheus metric's samples (all label sets) from the engine's `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let resp = http::get(&self.addr(), "/metrics").expect("engine /metrics");
        assert_eq!(resp.status, 200, "{} /metrics", self.name);
        resp.text()
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(name)?;
                if !(rest.starts_with('{') || rest.starts_with(' ')) {
                    return None; // another metric with this prefix
                }
                rest.rsplit(' ').next()?.parse::<f64>().ok()
            })
            .sum()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The log as the failure left it, before the shutdown adds its own lines.
        if std::thread::panicking() {
            eprintln!(
                "--- {} log tail ({}) ---\n{}",
                self.name,
                self.log.display(),
                log_tail(&self.log, 40)
            );
        }
        if let Some(mut group) = self.group.take() {
            group.stop(Duration::from_secs(5));
        }
    }
}

/// A `kv-event-bridge` in front of one engine.
pub struct Bridge {
    pub name: String,
    pub port: u16,
    pub log: PathBuf,
    group: Group,
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
            group: Group::spawn(&mut cmd, &dir.join(format!("{}-bridge.log", engine.name))),
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
