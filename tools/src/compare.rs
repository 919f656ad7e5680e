//! Runs one workload through several routing modes back to back, each against a fresh fleet of
//! mock workers (so every mode starts with cold caches) behind a fresh Envoy with the filter.
//!
//! By default the workers' KV events take the production path: the mock publishes them on ZMQ
//! like vLLM, a `kv-event-bridge` per worker serves them, and the filter polls the bridges
//! ([`EventsVia::Bridge`]). [`EventsVia::Http`] has the filter poll the mocks' own event pages.
//!
//! Peer arms (`vllm-router:<policy>`, see [`crate::peer`]) put vllm-router in front of the fresh
//! fleet instead of Envoy; the workers publish their KV events on ZMQ (which `kv_aware` reads),
//! with no bridge. The workload, the client measuring TTFT and the workers' `/metrics` giving
//! the hit rate are the same for every arm.

use crate::calibrate::{calibrate, fit_nonnegative, CalibrateOptions};
use crate::harness::{
    require_kv_event_bridge, Bridge, BridgeOptions, Envoy, EnvoyOptions, Worker, ZMQ_PUBLISH_ARGS,
};
use crate::loadgen::{
    print_comparison_table, run_workload, run_workload_on, write_svg_chart, RunOptions, RunStats,
    Spread, Workload,
};
use crate::mock::timing;
use crate::peer::{
    require_vllm_router, vllm_router_policy, VllmRouter, VllmRouterOptions, PEER_WORKER_ARGS,
};
use crate::vllm::{start_engines, Engine, EngineConfig};
use serde_json::{json, Value};
use std::io;
use std::path::Path;
use std::time::Duration;

/// Where the filter reads the workers' KV events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EventsVia {
    /// mock -> ZMQ -> kv-event-bridge -> filter: the path of a real engine.
    Bridge,
    /// The mock's own HTTP event page (no bridge).
    Http,
}

/// The simulated fleet and the filter settings shared by every mode.
#[derive(Clone, Debug)]
pub struct Fleet {
    pub workers: u64,
    /// Extra `mock-worker` arguments (engine mode and block size are set here).
    pub worker_args: Vec<String>,
    pub block_size: u32,
    /// Envoy worker threads.
    pub envoy_threads: u32,
    /// Merged into the filter configuration of every mode (e.g. cost knobs).
    pub filter_extra: Value,
    pub events_via: EventsVia,
    /// Filter builds by tag: an arm `<mode>@<tag>` runs `<mode>` with that build's .wasm
    /// (before/after comparisons in one run).
    pub arm_wasm: Vec<(String, std::path::PathBuf)>,
    /// Real vLLM engines instead of mock workers: started once for the whole comparison, their
    /// prefix caches emptied before each arm.
    pub vllm: Option<EngineConfig>,
    /// The fleet's prefill-time and decode-step polynomials for `+fit` arms, when measured
    /// ([`crate::calibrate`] on a real engine); else those fitted to the mock's step-time model,
    /// divided by its `--speedup`.
    pub timing: Option<(Vec<f64>, Vec<f64>)>,
    /// A mixed fleet: mock worker `id` runs at `speedups[(id - 1) % len]` (`--speedup`), e.g.
    /// two GPU generations. Empty: every worker as `worker_args` say.
    pub speedups: Vec<f64>,
}

/// The value of `flag` in mock-worker arguments (`--flag value` or `--flag=value`), parsed.
pub fn worker_arg<T: std::str::FromStr>(args: &[impl AsRef<str>], flag: &str) -> Option<T> {
    let mut words = args.iter().map(AsRef::as_ref);
    while let Some(word) = words.next() {
        if word == flag {
            return words.next()?.parse().ok();
        }
        if let Some(value) = word.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            return value.parse().ok();
        }
    }
    None
}

/// The mock workers' `--kv-blocks` in `args` (the mock's default when not given).
pub fn worker_kv_blocks(args: &[impl AsRef<str>]) -> u64 {
    worker_arg::<u64>(args, "--kv-blocks")
        .filter(|v| *v > 0)
        .unwrap_or(crate::mock::DEFAULT_KV_BLOCKS as u64)
}

impl Fleet {
    pub fn new(workers: u64, block_size: u32, worker_args: &[&str]) -> Fleet {
        Fleet {
            workers,
            worker_args: worker_args.iter().map(|s| s.to_string()).collect(),
            block_size,
            envoy_threads: 2,
            filter_extra: json!({}),
            events_via: EventsVia::Bridge,
            arm_wasm: Vec::new(),
            vllm: None,
            timing: None,
            speedups: Vec::new(),
        }
    }

    /// `(mode, .wasm)` of an arm `<mode>[@<tag>]`; the default build without a tag.
    fn arm_build<'a>(&self, arm: &'a str) -> io::Result<(&'a str, Option<std::path::PathBuf>)> {
        let Some((mode, tag)) = arm.rsplit_once('@') else {
            return Ok((arm, None));
        };
        match self.arm_wasm.iter().find(|(t, _)| t == tag) {
            Some((_, path)) => Ok((mode, Some(path.clone()))),
            None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{arm}: no build tagged {tag:?} (--arm-wasm {tag}=PATH)"),
            )),
        }
    }

    /// Fails early, with how to fix it, when an arm needs a binary that is not there.
    pub fn check(&self, modes: &[&str]) -> io::Result<()> {
        if modes.iter().any(|m| vllm_router_policy(m).is_some()) {
            require_vllm_router()?;
        }
        for m in modes.iter().filter(|m| vllm_router_policy(m).is_none()) {
            self.arm_build(m)?;
        }
        let filter_arms = modes.iter().any(|m| vllm_router_policy(m).is_none());
        if self.vllm.is_some() {
            crate::vllm::require_vllm()?;
            if filter_arms && self.events_via == EventsVia::Http {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "real engines publish their KV events on ZMQ only: use --events-via bridge",
                ));
            }
        }
        if filter_arms && self.events_via == EventsVia::Bridge {
            require_kv_event_bridge()
                .map_err(|e| io::Error::new(e.kind(), format!("{e}; or use --events-via http")))?;
        }
        Ok(())
    }

    fn spawn_workers(&self, engines: Option<&[Engine]>) -> io::Result<Vec<Worker>> {
        if let Some(engines) = engines {
            return self.engine_workers(engines, self.events_via == EventsVia::Bridge);
        }
        let bridged = self.events_via == EventsVia::Bridge;
        (1..=self.workers)
            .map(|id| {
                let args = self.mock_args(id);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                if bridged {
                    Worker::spawn_bridged(id, self.block_size, &args)
                } else {
                    Worker::spawn(id, &args)
                }
            })
            .collect()
    }

    /// Mock worker `id`'s arguments: engine mode, the block size, `worker_args`, and its own
    /// `--speedup` in a mixed fleet.
    pub fn mock_args(&self, id: u64) -> Vec<String> {
        let mut args: Vec<String> = ["--mode", "engine", "--block-size"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push(self.block_size.to_string());
        args.extend(self.worker_args.iter().cloned());
        if let Some(s) = self.speedup_of(id) {
            args.extend(["--speedup".to_string(), s.to_string()]);
        }
        args
    }

    /// Worker `id`'s own speedup in a mixed fleet (`speedups`), else `None`.
    pub fn speedup_of(&self, id: u64) -> Option<f64> {
        let n = self.speedups.len() as u64;
        if n == 0 || id == 0 {
            return None;
        }
        self.speedups
            .get(usize::try_from((id - 1) % n).ok()?)
            .copied()
    }

    /// The fleet of a peer arm: the same workers, publishing their KV events on ZMQ (no bridge)
    /// under vLLM's default topic, the one vllm-router's `kv_aware` reads.
    fn spawn_publishing_workers(&self, engines: Option<&[Engine]>) -> io::Result<Vec<Worker>> {
        if let Some(engines) = engines {
            return self.engine_workers(engines, false);
        }
        (1..=self.workers)
            .map(|id| {
                let args = self.mock_args(id);
                let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
                args.extend_from_slice(&ZMQ_PUBLISH_ARGS);
                args.extend_from_slice(&PEER_WORKER_ARGS);
                Worker::spawn(id, &args)
            })
            .collect()
    }

    /// Real engines as the workers of one arm: each engine's prefix cache emptied (and the
    /// `AllBlocksCleared` published by a one-token step), then a fresh bridge per engine when
    /// `bridged`, so no arm inherits another's cache or event state.
    fn engine_workers(&self, engines: &[Engine], bridged: bool) -> io::Result<Vec<Worker>> {
        let mut workers = Vec::with_capacity(engines.len());
        for (id, e) in (1..).zip(engines) {
            e.empty_prefix_cache()?;
            let mut w = Worker::external(id, e.addr(), Some(e.zmq()), Some(e.replay()));
            if bridged {
                w.bridge = Some(Bridge::spawn(&BridgeOptions {
                    label: e.name.clone(),
                    engine: e.zmq(),
                    replay: Some(e.replay()),
                    block_size: self.block_size,
                    engine_metrics_url: Some(format!("http://{}/metrics", e.addr())),
                    extra_args: Vec::new(),
                })?);
            }
            workers.push(w);
        }
        Ok(workers)
    }

    /// The value of `flag` in the workers' arguments, parsed.
    fn worker_arg<T: std::str::FromStr>(&self, flag: &str) -> Option<T> {
        worker_arg(&self.worker_args, flag)
    }

    /// The workers' KV blocks: real engines' `num_blocks`, else the mocks' `--kv-blocks` (the
    /// mock's default when not given).
    pub fn worker_kv_blocks(&self) -> u64 {
        match self.vllm.as_ref().and_then(|c| c.num_blocks) {
            Some(n) => u64::from(n),
            None => worker_kv_blocks(&self.worker_args),
        }
    }

    /// The workers' `--speedup` (1 when not given); in a mixed fleet the mean of `speedups`
    /// (the fleet's throughput, as one polynomial for all of it would price it).
    pub fn worker_speedup(&self) -> f64 {
        if !self.speedups.is_empty() {
            return self.speedups.iter().sum::<f64>() / self.speedups.len() as f64;
        }
        self.worker_arg::<f64>("--speedup")
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or(1.0)
    }

    /// The mock workers' KV capacity in tokens (`--kv-blocks` x the block size): the cache the
    /// decode polynomial's fill is a fraction of.
    fn kv_capacity_tokens(&self) -> f64 {
        self.worker_kv_blocks() as f64 * f64::from(self.block_size)
    }

    /// The prefill-time and decode-step polynomials of `+fit` arms: the measured ones, else those
    /// fitted to the mock's step-time model divided by its `--speedup` ([`mock_timing_at`]).
    fn timing_polys(&self) -> (Vec<f64>, Vec<f64>) {
        if let Some(t) = &self.timing {
            return t.clone();
        }
        mock_timing_at(self.worker_speedup(), self.kv_capacity_tokens())
    }

    /// `+fit` on a mixed fleet: each worker of `config` priced at its own speed (`+fitmean`:
    /// one polynomial at the fleet's mean speed for all, what a filter without per-worker
    /// timing can do).
    fn price_each_worker(&self, mode: &str, config: &mut Value) {
        if mode.starts_with("kv+ttft") && mode.split('+').any(|o| o == "fit") {
            self.give_each_worker_its_timing(config);
        }
    }

    /// On a mixed fleet, each worker entry of `config` gets its own timing polynomials: those
    /// fitted to the mock's step-time model at its `--speedup`, as `calibrate` would measure them
    /// on each kind of worker (`+calibrated` arms, `+fit` of `kv+ttft` arms).
    pub fn give_each_worker_its_timing(&self, config: &mut Value) {
        let Some(list) = config["workers"].as_array_mut() else {
            return;
        };
        for w in list {
            if let Some(speedup) = w["id"].as_u64().and_then(|id| self.speedup_of(id)) {
                let (prefill, decode) = mock_timing_at(speedup, self.kv_capacity_tokens());
                w["prefill_time_ms_poly"] = json!(prefill);
                w["decode_step_ms_poly"] = json!(decode);
            }
        }
    }

    /// The filter configuration for `mode` over `workers`.
    pub fn filter_config(&self, mode: &str, workers: &[Worker]) -> Value {
        self.filter_config_for(mode, workers.iter().map(Worker::filter_entry).collect())
    }

    /// The filter configuration for `mode` over the worker entries `list`.
    pub fn filter_config_for(&self, mode: &str, list: Vec<Value>) -> Value {
        // Bridges answer `/kv/events?wait_ms=` as soon as an event arrives, so a long poll puts
        // events in the index without the poll interval's delay (2 s + the 1 s call timeout
        // stays under the 5 s staleness bound).
        let long_poll_ms = match self.events_via {
            EventsVia::Bridge => 2000,
            EventsVia::Http => 0,
        };
        // The index sized to hold every block the fleet caches, as an operator would (the
        // default, 262,144 entries, fits 32 of these workers at 8,192 blocks).
        let fleet_blocks = self.worker_kv_blocks() * list.len() as u64;
        let mut config = json!({
            "mode": mode,
            "block_size": self.block_size,
            "workers": list,
            // Full caches re-sync from multi-megabyte dumps.
            "events": {"max_response_bytes": 64 * 1024 * 1024, "long_poll_ms": long_poll_ms},
            "index": {"max_blocks": fleet_blocks.max(1 << 18)},
        });
        if let (Some(target), Some(extra)) = (config.as_object_mut(), self.filter_extra.as_object())
        {
            for (key, value) in extra {
                target.insert(key.clone(), value.clone());
            }
        }
        config
    }
}

/// The fields an arm `kv+set:<a.b>=<value>[+set:...]` sets, as a configuration fragment (each
/// value read as JSON, else as a string).
pub fn set_fields(arm: &str) -> io::Result<Value> {
    let mut extra = json!({});
    for assignment in arm.trim_start_matches("kv+").split('+') {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{arm}: expected kv+set:<a.b>=<value>[+set:...]"),
            )
        };
        let (path, value) = assignment
            .strip_prefix("set:")
            .and_then(|a| a.split_once('='))
            .ok_or_else(bad)?;
        let value: Value = serde_json::from_str(value).unwrap_or_else(|_| json!(value.to_string()));
        let mut at = &mut extra;
        for key in path.split('.') {
            at = &mut at[key];
        }
        *at = value;
    }
    Ok(extra)
}

/// Runs `workload` once in `mode` on a fresh fleet and Envoy (or, for a `vllm-router:<policy>`
/// arm, vllm-router); everything is stopped afterwards.
pub fn run_mode(
    mode: &str,
    fleet: &Fleet,
    workload: &Workload,
    opts: &RunOptions,
) -> io::Result<RunStats> {
    run_arm(mode, fleet, None, workload, opts)
}

/// `kv*3` -> (`kv`, 3, round-robin): the arm run on that many Envoy replicas, the requests
/// spread round-robin over them; `kv*3~client`: spread by client (a load balancer with client
/// affinity, [`Spread::ByClient`]). 1 without the suffix.
pub fn split_replicas(mode: &str) -> io::Result<(&str, usize, Spread)> {
    let (mode, spread) = match mode.strip_suffix("~client") {
        Some(m) => (m, Spread::ByClient),
        None => (mode, Spread::RoundRobin),
    };
    match mode.rsplit_once('*') {
        None if spread == Spread::RoundRobin => Ok((mode, 1, spread)),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{mode}~client: expected <arm>*<replicas>~client"),
        )),
        Some((base, n)) => match n.parse::<usize>() {
            Ok(n) if (1..=16).contains(&n) => Ok((base, n, spread)),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{mode}: expected <arm>*<replicas>, 1 to 16 replicas"),
            )),
        },
    }
}

/// [`run_mode`], on `engines` (emptied first) instead of a fresh mock fleet when given.
fn run_arm(
    mode: &str,
    fleet: &Fleet,
    engines: Option<&[Engine]>,
    workload: &Workload,
    opts: &RunOptions,
) -> io::Result<RunStats> {
    if let Some(policy) = vllm_router_policy(mode) {
        return run_vllm_router(mode, policy, fleet, engines, workload, opts);
    }
    let arm = mode;
    let (mode, wasm) = fleet.arm_build(arm)?;
    let (mode, replicas, spread) = split_replicas(mode)?;
    // A trailing `+cap` on any other kv arm: the workers' `kv_capacity_blocks` configured, as a
    // worker that describes itself would give it.
    let (mode, with_capacity) = match mode.strip_suffix("+cap") {
        Some(m) if !m.starts_with("kv+ttft") => (m, true),
        _ => (mode, false),
    };
    // A trailing `+calibrated`: each worker's own timing polynomials configured, as `calibrate`
    // measures them per kind of worker (or a worker describes itself under `membership`).
    let (mode, calibrated) = match mode.strip_suffix("+calibrated") {
        Some(m) if !m.starts_with("kv+ttft") => (m, true),
        _ => (mode, false),
    };
    let workers = fleet.spawn_workers(engines)?;
    let mut opts = opts.clone();
    // Text arms: the filter mode is `kv` with a text feature switched on.
    let (filter_mode, text_extra, tokenizer) = match mode {
        "kv+text" => ("kv", json!({"approximate": {}}), None),
        "kv+render" => {
            // A GPU-less render service: an extra mock (same tokenizer and template) outside
            // the fleet, like `vllm launch render`.
            let render = Worker::spawn(1000, &["--mode", "echo", "--block-size", "64"])?;
            let extra = json!({"tokenizer": {"cluster": "kv_events", "address": render.addr,
                                             "timeout_ms": 1000}});
            ("kv", extra, Some(render))
        }
        // Load-gated prefix affinity (the filter's `affinity` option): at its defaults, or
        // `kv+affinity:R` with a margin of R in-flight requests.
        "kv+affinity" => ("kv", json!({"affinity": {}}), None),
        // The predicted-TTFT policy (the filter's `ttft` option) at its defaults; `+approx`:
        // predictions bridging the event lag (workers' `kv_mode` `events+approximate`);
        // `+decay`: booked prefills decay over their predicted duration
        // (`load.prefill_load_model: polynomial`); `+compute:W`: `ttft.compute_weight` W;
        // `+fit`: the fleet's timing polynomials (measured on a real engine by `calibrate`,
        // else fitted to the mock's step-time model and divided by the workers' `--speedup`);
        // `+cap`: the workers' `kv_capacity_blocks`
        // (their `--kv-blocks`: the decode term's KV fill); `+busy:F`: that and
        // `busy.decode_blocks_fraction` F; `+admit`: that and `ttft.admission_wait` (the
        // predicted wait for KV room); `+prio[:A]`: `engine_priority` (arrival weight A; the
        // fleet must run `--scheduling-policy priority`).
        m if m.starts_with("kv+ttft") => {
            let bad = || {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{m}: expected kv+ttft[+approx][+decay][+compute:W][+affinity[:T]][+fit|+fitmean][+cap][+busy:F][+admit][+prio[:A]]"
                    ),
                )
            };
            let mut extra = json!({"policy": "predicted", "ttft": {}});
            for option in m.trim_start_matches("kv+ttft").split('+').skip(1) {
                match option {
                    "approx" | "cap" => {}
                    "admit" => extra["ttft"]["admission_wait"] = json!(true),
                    "prio" => extra["engine_priority"] = json!({}),
                    o if o.starts_with("prio:") => {
                        let a: f64 = o.trim_start_matches("prio:").parse().map_err(|_| bad())?;
                        extra["engine_priority"] = json!({"arrival_weight": a});
                    }
                    o if o.starts_with("busy:") => {
                        let f: f64 = o.trim_start_matches("busy:").parse().map_err(|_| bad())?;
                        extra["busy"] = json!({"decode_blocks_fraction": f});
                    }
                    "decay" => extra["load"]["prefill_load_model"] = json!("polynomial"),
                    "fit" | "fitmean" => {
                        let (prefill, decode) = fleet.timing_polys();
                        extra["load"]["prefill_time_ms_poly"] = json!(prefill);
                        extra["ttft"]["decode_step_ms_poly"] = json!(decode);
                    }
                    // Load-gated affinity in front of the TTFT score (`affinity` at its
                    // defaults, or `affinity:T` with `max_extra_prefill_tokens` T).
                    "affinity" => extra["affinity"] = json!({}),
                    o if o.starts_with("affinity:") => {
                        let t: u64 = o
                            .trim_start_matches("affinity:")
                            .parse()
                            .map_err(|_| bad())?;
                        extra["affinity"] = json!({"max_extra_prefill_tokens": t});
                    }
                    o if o.starts_with("compute:") => {
                        let w: f64 = o
                            .trim_start_matches("compute:")
                            .parse()
                            .map_err(|_| bad())?;
                        extra["ttft"]["compute_weight"] = json!(w);
                    }
                    _ => return Err(bad()),
                }
            }
            ("kv", extra, None)
        }
        // Affinity with predictions bridging the event lag (workers' `kv_mode`
        // `events+approximate`), margin R.
        m if m.starts_with("kv+affinity+approx:") => {
            let margin: u32 = m
                .trim_start_matches("kv+affinity+approx:")
                .parse()
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{m}: expected kv+affinity+approx:<requests>"),
                    )
                })?;
            (
                "kv",
                json!({"affinity": {"max_extra_requests": margin}}),
                None,
            )
        }
        m if m.starts_with("kv+affinity:") => {
            let margin: u32 = m.trim_start_matches("kv+affinity:").parse().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{m}: expected kv+affinity:<requests>"),
                )
            })?;
            (
                "kv",
                json!({"affinity": {"max_extra_requests": margin}}),
                None,
            )
        }
        // The default policy with `ttft.share_weight` W (the request-share term; 0 = off).
        m if m.starts_with("kv+share:") => {
            let w: f64 = m.trim_start_matches("kv+share:").parse().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{m}: expected kv+share:<weight>"),
                )
            })?;
            ("kv", json!({"ttft": {"share_weight": w}}), None)
        }
        // The defaults with fields set: `kv+set:ttft.learn=false+set:ttft.share_weight=3`
        // (each value read as JSON, else as a string), for experiments without a new arm.
        m if m.starts_with("kv+set:") => ("kv", set_fields(m)?, None),
        "kv+ids" => {
            opts.chat_as_ids = true;
            opts.path = "/v1/completions".to_string();
            ("kv", json!({}), None)
        }
        other => (other, json!({}), None),
    };
    let mut config = fleet.filter_config(filter_mode, &workers);
    if mode.starts_with("kv+affinity+approx:")
        || (mode.starts_with("kv+ttft") && mode.contains("+approx"))
    {
        if let Some(list) = config["workers"].as_array_mut() {
            for w in list {
                w["kv_mode"] = json!("events+approximate");
            }
        }
    }
    fleet.price_each_worker(mode, &mut config);
    if calibrated {
        fleet.give_each_worker_its_timing(&mut config);
    }
    if with_capacity
        || mode.starts_with("kv+ttft")
            && (mode.contains("+cap") || mode.contains("+busy:") || mode.contains("+admit"))
    {
        let blocks = fleet.worker_kv_blocks();
        if let Some(list) = config["workers"].as_array_mut() {
            for w in list {
                w["kv_capacity_blocks"] = json!(blocks);
            }
        }
    }
    if let (Some(target), Some(extra)) = (config.as_object_mut(), text_extra.as_object()) {
        for (key, value) in extra {
            target.insert(key.clone(), value.clone());
        }
    }
    let mut envoy_opts =
        EnvoyOptions::new(config, workers.iter().map(|w| w.addr.clone()).collect());
    envoy_opts.concurrency = fleet.envoy_threads;
    if wasm.is_some() {
        envoy_opts.wasm = wasm;
    }
    // No deadline, as in the shipped configs.
    envoy_opts.route_timeout = Duration::ZERO;
    envoy_opts.log_level = "warning";
    // `kv*N`: N independent Envoys (no shared state but the fleet), the requests spread over them
    // as a load balancer in front of a gateway's replicas would: round-robin, or by client.
    let envoys = (0..replicas)
        .map(|_| Envoy::start(&envoy_opts))
        .collect::<io::Result<Vec<Envoy>>>()?;
    // In kv mode, the poller takes every worker's (empty) dump before traffic starts.
    if filter_mode == "kv" {
        let dumps = workers.len() as u64;
        for envoy in &envoys {
            if !envoy.wait_for(Duration::from_secs(10), |e| {
                e.router_stat("events.resyncs") >= dumps
            }) {
                eprintln!("{arm}: the filter had not read every worker's dump within 10 s");
            }
        }
    }
    opts.worker_addrs = workers.iter().map(|w| w.addr.clone()).collect();
    opts.spread = spread;
    opts.label = arm.to_string();
    let listeners: Vec<String> = envoys.iter().map(|e| e.listener.clone()).collect();
    let stats = run_workload_on(&listeners, workload, &opts);
    for envoy in &envoys {
        print_filter_stats(arm, envoy);
        if tokenizer.is_some() {
            print_tokenizer_stats(envoy);
        }
    }
    drop(envoys);
    drop(tokenizer);
    drop(workers);
    Ok(stats)
}

/// The filter's counters behind the affinity diagnostics (summed over the Envoy threads):
/// predictions published / applied / skipped / refuted by events, index evictions, event gaps and
/// re-syncs, and the declarations and relay ticks of replicas.
fn print_filter_stats(mode: &str, envoy: &Envoy) {
    let stats = envoy.stats();
    let names = [
        "approx.published",
        "approx.publish_failed",
        "approx.applied",
        "approx.skipped",
        "approx.confirmed",
        "approx.refuted",
        "approx.entries",
        "index.evicted",
        "events.applied",
        "events.gaps",
        "events.resyncs",
        "workers.marked_stale",
        "log.lost_sync",
        "events.declared",
        "events.relay_ticks",
    ];
    let line: Vec<String> = names
        .iter()
        .map(|n| {
            let v = stats
                .get(&format!("wasmcustom.kv_router.{n}"))
                .copied()
                .unwrap_or(0);
            format!("{n}={v}")
        })
        .collect();
    eprintln!("filter stats [{mode}]: {}", line.join(" "));
    // The learned timing factors (observed over predicted TTFT, x1000) per worker: whether a
    // uniform fleet's workers were learned alike.
    let mut factors: Vec<(String, u64)> = stats
        .iter()
        .filter_map(|(k, v)| {
            let id = k
                .strip_prefix("wasmcustom.kv_router.worker.")?
                .strip_suffix(".timing_factor_milli")?;
            Some((id.to_string(), *v))
        })
        .collect();
    factors.sort();
    if !factors.is_empty() {
        let line: Vec<String> = factors.iter().map(|(w, v)| format!("{w}={v}")).collect();
        eprintln!("timing factors x1000 [{mode}]: {}", line.join(" "));
    }
}

/// The render call's added latency and the render cache's hit rate, from the filter's stats.
fn print_tokenizer_stats(envoy: &Envoy) {
    let stats = envoy.stats();
    let get = |n: &str| {
        stats
            .get(&format!("wasmcustom.kv_router.{n}"))
            .copied()
            .unwrap_or(0)
    };
    let (hits, misses) = (get("tokenizer.cache_hit"), get("tokenizer.cache_miss"));
    eprintln!(
        "tokenizer: {} calls, cache hits {hits} / {} lookups ({:.1}%), fallbacks: timeout {} error {}",
        get("tokenizer.calls"),
        hits + misses,
        100.0 * hits as f64 / (hits + misses).max(1) as f64,
        get("tokenizer.fallback.render_timeout"),
        get("tokenizer.fallback.render_error"),
    );
    // Envoy computes histogram quantiles at its stats flush (every 5 s): wait for one.
    let deadline = std::time::Instant::now() + Duration::from_secs(12);
    while std::time::Instant::now() < deadline {
        if let Ok(resp) = crate::client::get(&envoy.admin, "/stats?filter=tokenizer.render_ms") {
            let text = resp.text();
            if text.contains("P50") {
                eprintln!("tokenizer render_ms histogram: {}", text.trim());
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!("tokenizer render_ms histogram: no flush within 12 s");
}

/// A peer arm: vllm-router with `policy` in front of a fresh fleet.
fn run_vllm_router(
    arm: &str,
    policy: &str,
    fleet: &Fleet,
    engines: Option<&[Engine]>,
    workload: &Workload,
    opts: &RunOptions,
) -> io::Result<RunStats> {
    let workers = fleet.spawn_publishing_workers(engines)?;
    let router = VllmRouter::start(
        &VllmRouterOptions {
            policy: policy.to_string(),
            block_size: fleet.block_size,
            model: opts.model.clone(),
            extra_args: Vec::new(),
        },
        &workers,
    )?;
    if policy == "kv_aware" {
        wait_for_subscribers(&router, &workers)?;
    }
    let mut opts = opts.clone();
    opts.worker_addrs = workers.iter().map(|w| w.addr.clone()).collect();
    opts.label = arm.to_string();
    let stats = run_workload(&router.addr, workload, &opts);
    if policy == "kv_aware" {
        // Whether its event index matched prefixes at all (all misses = a deaf index).
        match router.placement_lookups() {
            Ok((hit, miss)) => eprintln!("{arm}: placement lookups hit {hit} miss {miss}"),
            Err(e) => eprintln!("{arm}: placement lookups unknown: {e}"),
        }
    }
    drop(router);
    drop(workers);
    Ok(stats)
}

/// Waits until kv_aware's event subscriber is connected to every worker's ZMQ publisher (mock
/// workers count the connections their PUB socket accepted; a vLLM engine does not say, so
/// there the first placement lookup of the run may still miss).
fn wait_for_subscribers(router: &VllmRouter, workers: &[Worker]) -> io::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for w in workers {
        loop {
            let text = crate::client::get(&w.addr, "/metrics")?.text();
            match crate::prom::sum(&text, "mock_worker_kv_zmq_connections_total", &[]) {
                None => break,
                Some(n) if n >= 1.0 => break,
                Some(_) => {}
            }
            if std::time::Instant::now() >= deadline {
                return Err(io::Error::other(format!(
                    "vllm-router's kv_aware did not subscribe to {}'s KV events in 30 s:\n{}",
                    w.addr,
                    router.log_tail(20)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Starts `fleet.workers` real vLLM engines for a whole comparison (engine start-up takes tens
/// of seconds; each arm empties their caches instead). Their logs stay in a temporary
/// directory, named on stderr.
fn start_vllm_fleet(fleet: &Fleet, config: &EngineConfig) -> io::Result<Vec<Engine>> {
    let dir = std::env::temp_dir().join(format!("ekr-vllm-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let count = usize::try_from(fleet.workers).map_err(io::Error::other)?;
    let started = std::time::Instant::now();
    eprintln!(
        "== starting {count} vLLM engines ({} blocks of {} tokens each; logs in {})",
        config
            .num_blocks
            .map_or_else(|| "default".to_string(), |n| n.to_string()),
        config.block_size,
        dir.display()
    );
    let engines = start_engines(count, config, &dir, Duration::from_secs(600))?;
    eprintln!(
        "== engines healthy after {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(engines)
}

/// One unmeasured pass of the workload straight to the engines (round-robin), so that no arm
/// meets an engine on its first traffic. Every arm empties the engines' caches before it
/// starts, so nothing of this pass is left cached.
fn warm_up(engines: &[Engine], workload: &Workload, opts: &RunOptions) {
    let targets: Vec<String> = engines.iter().map(Engine::addr).collect();
    let started = std::time::Instant::now();
    let stats = run_workload_on(&targets, workload, opts);
    eprintln!(
        "== engines warmed up by one unmeasured pass of the workload in {:.0} s (TTFT mean {:.0} ms, {} errors)",
        started.elapsed().as_secs_f64(),
        stats.ttft().mean,
        stats.errors()
    );
}

/// The timing polynomials of the first real engine (the `+fit` arms' on a vLLM fleet), measured
/// before any arm: prompts up to the model's length, decodes up to its `--max-num-seqs`.
fn calibrate_engine(engines: &[Engine]) -> io::Result<(Vec<f64>, Vec<f64>)> {
    let engine = engines
        .first()
        .ok_or_else(|| io::Error::other("no engine to calibrate"))?;
    let config = &engine.config;
    let opts = CalibrateOptions {
        model: crate::vllm::MODEL.to_string(),
        vocab: crate::vllm::VOCAB,
        max_prompt_tokens: config.max_len.saturating_sub(64).max(64),
        max_concurrency: config.max_num_seqs,
        decode_prompt_tokens: config.max_len / 2,
        decode_output_tokens: 32,
        ..CalibrateOptions::default()
    };
    eprintln!("== calibrating the +fit arms' timing on {}", engine.name);
    let addr = format!("127.0.0.1:{}", engine.port);
    let c = calibrate(&addr, &opts)?;
    eprint!("{}", c.report());
    eprintln!("== timing: {}", c.filter_json());
    let decode = c
        .decode_poly
        .ok_or_else(|| io::Error::other("the calibration measured no decode"))?;
    Ok((c.prefill_poly, decode))
}

/// Runs every mode in turn and returns their stats in the same order.
pub fn compare_modes(
    modes: &[&str],
    fleet: &Fleet,
    workload: &Workload,
    opts: &RunOptions,
) -> io::Result<Vec<(String, RunStats)>> {
    let (fleet, engines) = prepare_fleet(modes, fleet, workload, opts)?;
    let fleet = &fleet;
    let kind = if engines.is_some() {
        "real vLLM engines"
    } else {
        "mock workers"
    };
    let source = if engines.is_some() { "vLLM" } else { "mock" };
    modes
        .iter()
        .map(|mode| {
            eprintln!(
                "== mode {mode}: {} {kind} ({}), {} requests",
                fleet.workers,
                match (vllm_router_policy(mode), fleet.events_via) {
                    (Some(_), _) =>
                        format!("vllm-router instead of Envoy; events: {source} -> ZMQ"),
                    (None, EventsVia::Bridge) =>
                        format!("events: {source} -> ZMQ -> kv-event-bridge -> filter"),
                    (None, EventsVia::Http) => "events: mock's HTTP page -> filter".to_string(),
                },
                workload.requests.len()
            );
            run_arm(mode, fleet, engines.as_deref(), workload, opts)
                .map(|stats| (mode.to_string(), stats))
        })
        .collect()
}

/// Checks `modes` against `fleet`, starts its real engines once (when it has them) and measures
/// their timing for `+fit` arms: the set-up every comparison shares.
fn prepare_fleet(
    modes: &[&str],
    fleet: &Fleet,
    workload: &Workload,
    opts: &RunOptions,
) -> io::Result<(Fleet, Option<Vec<Engine>>)> {
    fleet.check(modes)?;
    let engines = match &fleet.vllm {
        Some(config) => Some(start_vllm_fleet(fleet, config)?),
        None => None,
    };
    if let Some(engines) = &engines {
        warm_up(engines, workload, opts);
    }
    let mut fleet = fleet.clone();
    if let (Some(engines), true) = (&engines, modes.iter().any(|m| m.contains("+fit"))) {
        fleet.timing = Some(calibrate_engine(engines)?);
    }
    Ok((fleet, engines))
}

/// [`compare_modes`] repeated `runs` times for `loadgen race`: real engines (when the fleet has
/// them) are started once for all runs; within run `r` (from 0) the arms go in `modes` order
/// rotated by `r`, so no arm always runs first; every arm still gets a fresh fleet (or emptied
/// engines) and a fresh Envoy or vllm-router. `on_arm(run, mode, result, took)` is called after
/// each arm with the arm's own time (its fleet, router and workload; not the real engines'
/// start and warm-up before the first arm): a failed arm does not stop the others.
pub fn compare_modes_repeated(
    modes: &[&str],
    fleet: &Fleet,
    workload: &Workload,
    opts: &RunOptions,
    runs: usize,
    mut on_arm: impl FnMut(usize, &str, io::Result<RunStats>, std::time::Duration),
) -> io::Result<()> {
    let (fleet, engines) = prepare_fleet(modes, fleet, workload, opts)?;
    let n = modes.len();
    for run in 0..runs {
        for k in 0..n {
            let mode = modes[(k + run) % n];
            eprintln!(
                "== run {}/{runs}, arm {mode} ({}/{n}): {} {}, {} requests",
                run + 1,
                k + 1,
                fleet.workers,
                if engines.is_some() {
                    "real vLLM engines"
                } else {
                    "mock workers"
                },
                workload.requests.len()
            );
            let started = std::time::Instant::now();
            let result = run_arm(mode, &fleet, engines.as_deref(), workload, opts);
            on_arm(run, mode, result, started.elapsed());
        }
    }
    Ok(())
}

/// `mean TTFT of baseline / mean TTFT of candidate`, when both exist.
pub fn ttft_mean_speedup(
    results: &[(String, RunStats)],
    candidate: &str,
    baseline: &str,
) -> Option<f64> {
    let mean = |name: &str| {
        results
            .iter()
            .find(|(m, _)| m == name)
            .map(|(_, s)| s.ttft().mean)
    };
    let (c, b) = (mean(candidate)?, mean(baseline)?);
    (c > 0.0).then_some(b / c)
}

/// The routing-quality view of a comparison, one row per arm: TTFT (client-side, first streamed
/// token) mean/p50/p90/p99, the workers' prefix-cache hit rate (their `/metrics`, before and
/// after the run), and requests per worker: the busiest, the mean over all `workers` of the
/// fleet (idle ones included) and their ratio.
pub fn quality_table(results: &[(String, RunStats)], workers: u64) -> String {
    use std::fmt::Write as _;
    let ms = |v: f64| format!("{v:.0}");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<26} {:>6} {:>5} {:>7} | {:>9} {:>8} {:>8} {:>8} | {:>7} {:>8} {:>8} | {:>7} {:>6} {:>9} {:>6}",
        "arm",
        "done",
        "err",
        "hit",
        "TTFT mean",
        "p50",
        "p90",
        "p99",
        "req max",
        "req mean",
        "max/mean",
        "prefill",
        "busy",
        "step wait",
        "path"
    );
    for (name, s) in results {
        let t = s.ttft();
        let max = s.per_worker().iter().map(|(_, n)| *n).max().unwrap_or(0);
        let mean = s.completed() as f64 / workers.max(1) as f64;
        let ratio = if mean > 0.0 { max as f64 / mean } else { 0.0 };
        let hit = s
            .hit_rate()
            .map_or_else(|| "-".to_string(), |h| format!("{:.1}%", h * 100.0));
        let (prefill, busy) = s.fleet_utilization().map_or_else(
            || ("-".to_string(), "-".to_string()),
            |(p, b)| (format!("{:.0}%", p * 100.0), format!("{:.0}%", b * 100.0)),
        );
        let step_wait = s
            .step_wait_ms()
            .map_or_else(|| "-".to_string(), |w| format!("{w:.0}"));
        let path = s
            .ttft_overhead_ms()
            .map_or_else(|| "-".to_string(), |d| format!("{d:.1}"));
        let _ = writeln!(
            out,
            "{:<26} {:>6} {:>5} {:>7} | {:>9} {:>8} {:>8} {:>8} | {:>7} {:>8.1} {:>8.2} | {:>7} {:>6} {:>9} {:>6}",
            name,
            s.completed(),
            s.errors(),
            hit,
            ms(t.mean),
            ms(t.p50),
            ms(t.p90),
            ms(t.p99),
            max,
            mean,
            ratio,
            prefill,
            busy,
            step_wait,
            path
        );
    }
    let _ = writeln!(
        out,
        "(TTFT in ms at the client; hit = the workers' prefix-cache hit rate during the run; \
         prefill / busy = the mock engines' modelled time of the steps' prefill share (a step's \
         time beyond its decodes alone) / of whole steps, over workers x the arrival window; \
         step wait = the mean ms a request arriving \
         during a step waits for it to end, sum S^2 / 2 sum S over the engines' steps; path = \
         TTFT mean at the client minus the workers' own: the router and the network)"
    );
    for (name, s) in results {
        for (why, count) in s.error_summary().iter().take(3) {
            let _ = writeln!(out, "{name}: {count} failed: {why}");
        }
    }
    out
}

/// Prints the side-by-side table, writes the chart and the JSON summary when asked, and ends with
/// `kv_vs_round_robin ttft_mean_speedup=<x>` when both modes ran.
pub fn report_comparison(
    results: &[(String, RunStats)],
    svg: Option<&Path>,
    json_out: Option<&Path>,
) {
    let rows: Vec<(&str, RunStats)> = results
        .iter()
        .map(|(m, s)| (m.as_str(), s.clone()))
        .collect();
    print_comparison_table(&rows);
    if let Some(path) = svg {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        match write_svg_chart(path, &rows) {
            Ok(()) => println!("chart: {}", path.display()),
            Err(e) => eprintln!("cannot write {}: {e}", path.display()),
        }
    }
    if let Some(path) = json_out {
        let summary: serde_json::Map<String, Value> = results
            .iter()
            .map(|(m, s)| (m.clone(), s.summary_json()))
            .collect();
        let body = serde_json::to_string_pretty(&Value::Object(summary)).unwrap_or_default();
        if let Err(e) = std::fs::write(path, body) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
    if let Some(x) = ttft_mean_speedup(results, "kv", "round-robin") {
        println!("kv_vs_round_robin ttft_mean_speedup={x:.2}");
    }
}

/// The `+fit` polynomials of mock engines at speedup 1, lowest degree first. The mock's timing
/// ([`crate::mock::timing`], a roofline) is no polynomial: these are least-squares quadratics
/// with non-negative coefficients (the fit `calibrate` makes of an engine's measurements) of its
/// prefill-only step over T = 64..=8,192 new tokens from an empty context, and of its
/// decode-only step over KV fill u = 0..=1 of a cache of `capacity_tokens`, computed from the
/// model: the timing an operator would fit offline.
fn mock_timing_polys(capacity_tokens: f64) -> (Vec<f64>, Vec<f64>) {
    let prefill: Vec<(f64, f64)> = (1..=128)
        .map(|i| {
            let t = 64.0 * f64::from(i);
            (t, timing::prefill_ms(t))
        })
        .collect();
    let decode: Vec<(f64, f64)> = (0..=100)
        .map(|i| {
            let u = f64::from(i) / 100.0;
            (u, timing::decode_fill_ms(u, capacity_tokens))
        })
        .collect();
    // Finite points always fit.
    (
        fit_nonnegative(&prefill, 2).unwrap_or_else(|| vec![timing::prefill_ms(8192.0)]),
        fit_nonnegative(&decode, 2).unwrap_or_else(|| vec![timing::decode_step_ms(1, 0)]),
    )
}

/// The mock engines' `+fit` polynomials at `--speedup` `speedup` (every time divided by it) and
/// a KV capacity of `capacity_tokens`.
fn mock_timing_at(speedup: f64, capacity_tokens: f64) -> (Vec<f64>, Vec<f64>) {
    let k = 1.0 / speedup;
    let (prefill, decode) = mock_timing_polys(capacity_tokens);
    (
        prefill.iter().map(|c| c * k).collect(),
        decode.iter().map(|c| c * k).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_arms_name_their_count() {
        assert_eq!(split_replicas("kv").unwrap(), ("kv", 1, Spread::RoundRobin));
        assert_eq!(
            split_replicas("kv*3").unwrap(),
            ("kv", 3, Spread::RoundRobin)
        );
        assert_eq!(
            split_replicas("kv+share:0*2").unwrap(),
            ("kv+share:0", 2, Spread::RoundRobin)
        );
        assert_eq!(
            split_replicas("kv*3~client").unwrap(),
            ("kv", 3, Spread::ByClient)
        );
        assert!(split_replicas("kv~client").is_err());
        for bad in ["kv*0", "kv*17", "kv*x", "kv*"] {
            assert!(split_replicas(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tagged_arms_run_their_own_build() {
        let mut fleet = Fleet::new(2, 64, &[]);
        fleet
            .arm_wasm
            .push(("before".into(), std::path::PathBuf::from("/tmp/b.wasm")));
        let (mode, wasm) = fleet.arm_build("kv+ttft+decay@before").unwrap();
        assert_eq!(mode, "kv+ttft+decay");
        assert_eq!(wasm, Some(std::path::PathBuf::from("/tmp/b.wasm")));
        assert_eq!(fleet.arm_build("kv").unwrap(), ("kv", None));
        // An unknown tag fails before any arm runs, naming the flag to set.
        let e = fleet.check(&["kv", "kv@after"]).unwrap_err().to_string();
        assert!(e.contains("--arm-wasm after=PATH"), "{e}");
    }

    #[test]
    fn worker_kv_blocks_reads_both_argument_forms() {
        assert_eq!(
            worker_kv_blocks(&["--speedup", "2", "--kv-blocks", "8192"]),
            8192
        );
        assert_eq!(worker_kv_blocks(&["--kv-blocks=4096"]), 4096);
        // A flag that only starts like it is another flag.
        assert_eq!(
            worker_kv_blocks(&["--kv-blocks-x=7"]),
            crate::mock::DEFAULT_KV_BLOCKS as u64
        );
        assert_eq!(
            worker_kv_blocks(&["--kv-blocks", "0"]),
            crate::mock::DEFAULT_KV_BLOCKS as u64
        );
        assert_eq!(
            worker_kv_blocks(&[] as &[&str]),
            crate::mock::DEFAULT_KV_BLOCKS as u64
        );
    }

    #[test]
    fn worker_speedup_reads_the_fleet_arguments() {
        let fleet = |args: &[&str]| Fleet::new(2, 64, args).worker_speedup();
        assert_eq!(fleet(&["--kv-blocks", "8192", "--speedup", "2"]), 2.0);
        assert_eq!(fleet(&["--kv-blocks", "8192"]), 1.0);
        assert_eq!(fleet(&["--speedup", "0"]), 1.0);
        assert_eq!(fleet(&["--speedup"]), 1.0);
    }

    #[test]
    fn the_mocks_fitted_polynomials_follow_its_step_time_model() {
        use crate::calibrate::eval_poly;
        let capacity = 8192.0 * 64.0;
        let (prefill, decode) = mock_timing_polys(capacity);
        assert_eq!((prefill.len(), decode.len()), (3, 3));
        // The roofline's compute-bound part is a quadratic: the fit is within 1.5 ms of it from
        // 512 tokens on (the memory-bound floor under ~250 tokens bends it at the start).
        for t in [512.0, 1024.0, 2048.0, 4096.0, 6144.0, 8192.0] {
            let (fit, model) = (eval_poly(&prefill, t), timing::prefill_ms(t));
            assert!(
                (fit - model).abs() < 1.5,
                "{t}: fit {fit:.2} model {model:.2}"
            );
        }
        let (fit, model) = (eval_poly(&prefill, 64.0), timing::prefill_ms(64.0));
        assert!(
            (fit - model).abs() < 4.0,
            "64: fit {fit:.2} model {model:.2}"
        );
        // The decode step is linear in the fill (the contexts' KV reads).
        for u in [0.0, 0.1, 0.25, 0.5, 0.75, 1.0] {
            let (fit, model) = (eval_poly(&decode, u), timing::decode_fill_ms(u, capacity));
            assert!(
                (fit - model).abs() < 0.1,
                "{u}: fit {fit:.2} model {model:.2}"
            );
        }
        assert!(prefill.iter().chain(&decode).all(|c| *c >= 0.0));
    }

    #[test]
    fn fit_arms_take_the_measured_timing_else_the_mocks_at_its_speedup() {
        let mut fleet = Fleet::new(2, 64, &["--speedup", "2"]);
        let capacity = crate::mock::DEFAULT_KV_BLOCKS as f64 * 64.0;
        let (prefill, decode) = mock_timing_polys(capacity);
        let half = |p: &[f64]| p.iter().map(|c| c / 2.0).collect::<Vec<_>>();
        assert_eq!(fleet.timing_polys(), (half(&prefill), half(&decode)));
        fleet.timing = Some((vec![30.0, 0.01], vec![9.0, 2.0]));
        assert_eq!(fleet.timing_polys(), (vec![30.0, 0.01], vec![9.0, 2.0]));
    }

    #[test]
    fn a_mixed_fleet_prices_each_worker_at_its_own_speed_with_fit() {
        let mut fleet = Fleet::new(3, 64, &["--kv-blocks", "8192"]);
        fleet.speedups = vec![1.0, 4.0];
        assert_eq!(
            (1..=4).map(|id| fleet.speedup_of(id)).collect::<Vec<_>>(),
            vec![Some(1.0), Some(4.0), Some(1.0), Some(4.0)]
        );
        assert!(fleet
            .mock_args(2)
            .ends_with(&["--speedup".into(), "4".into()]));
        // One polynomial for all: the mean speed.
        assert_eq!(fleet.worker_speedup(), 2.5);
        let config = |fleet: &Fleet, mode: &str| {
            let mut c = json!({"workers": [{"id": 1}, {"id": 2}, {"id": 3}]});
            fleet.price_each_worker(mode, &mut c);
            c
        };
        let own = config(&fleet, "kv+ttft+decay+fit+admit");
        let (prefill, decode) = mock_timing_polys(8192.0 * 64.0);
        let quarter = |p: &[f64]| json!(p.iter().map(|c| c / 4.0).collect::<Vec<_>>());
        assert_eq!(own["workers"][1]["prefill_time_ms_poly"], quarter(&prefill));
        assert_eq!(own["workers"][1]["decode_step_ms_poly"], quarter(&decode));
        assert_eq!(own["workers"][2]["prefill_time_ms_poly"], json!(prefill));
        assert_eq!(own["workers"][2]["decode_step_ms_poly"], json!(decode));
        for mode in ["kv+ttft+decay+fitmean", "kv+ttft", "kv"] {
            assert!(
                config(&fleet, mode)["workers"][1]
                    .get("prefill_time_ms_poly")
                    .is_none(),
                "{mode}"
            );
        }
        // A homogeneous fleet keeps one polynomial.
        fleet.speedups.clear();
        assert!(fleet.mock_args(2).iter().all(|a| a != "--speedup"));
        assert!(config(&fleet, "kv+ttft+fit")["workers"][1]
            .get("prefill_time_ms_poly")
            .is_none());
    }

    #[test]
    fn the_quality_table_says_why_requests_failed() {
        use crate::loadgen::{RequestResult, RunStats};
        let failed = |why: &str| RequestResult {
            error: Some(why.into()),
            ..RequestResult::default()
        };
        let stats = RunStats {
            results: vec![
                failed("status 503: no healthy upstream"),
                failed("stream ended without [DONE]"),
                failed("status 503: no healthy upstream"),
            ],
            ..RunStats::default()
        };
        let table = quality_table(
            &[("kv".into(), stats), ("rr".into(), RunStats::default())],
            2,
        );
        assert!(
            table.contains(
                "kv: 2 failed: status 503: no healthy upstream\nkv: 1 failed: stream ended"
            ),
            "{table}"
        );
        assert!(!table.contains("rr:"), "{table}");
    }
}
