//! `loadgen race` (`make race`): every workload of [`WORKLOADS`] through every arm, each arm on
//! a fresh fleet (and a fresh Envoy or vllm-router), repeated `runs` times; the medians per
//! metric against the targets, in `results.json`, `summary.md` and a TTFT chart per workload.
//! The workloads' parameters are fixed here (docs/RACE.md lists them); `--scale` only takes a
//! fraction of each workload's sessions (or requests), at the same pace.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::compare::{compare_modes_repeated, Fleet};
use crate::loadgen::generate::{self, AgentSpec, ConversationSpec, TraceLoad, TraceRequest};
use crate::loadgen::{
    chat, load_mooncake, synthetic, write_svg_chart, ChatSpec, ModelFit, RunOptions, RunStats,
    SyntheticSpec, Workload,
};
use crate::peer::vllm_router_policy;
use crate::vllm::{self, EngineConfig};

mod trace_workload;
pub use trace_workload::TraceWorkload;

/// The workloads, in the order they run.
pub const WORKLOADS: [&str; 6] = [
    "synthetic",
    "conversation",
    "chat-text",
    "agent",
    "agent-mixed",
    "vllm",
];

/// Workloads run only when named in `--workloads`: `burst` (bursts of requests sharing a new
/// prefix, for replicas of the router: `--arms kv,kv*3`).
pub const EXTRA_WORKLOADS: [&str; 1] = ["burst"];

/// The arms: the filter at its defaults, its round-robin mode, and vllm-router's policies.
pub const DEFAULT_ARMS: [&str; 5] = [
    "kv",
    "round-robin",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "vllm-router:power_of_two",
];

/// Mock workers per fleet and their arguments (every arm alike).
pub const MOCK_WORKERS: u64 = 8;
pub const MOCK_WORKER_ARGS: [&str; 4] = ["--kv-blocks", "8192", "--speedup", "2"];
/// Block size of the mock fleets and the filter.
pub const MOCK_BLOCK_SIZE: u32 = 64;
/// `agent-mixed`: worker i's `--speedup` (the base `--speedup 1` times these), mean 2.25.
pub const MIXED_SPEEDUPS: [f64; 8] = [1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0];

/// `synthetic`: the first requests of the Mooncake synthetic trace, timestamps divided by this.
pub const SYNTHETIC_REQUESTS: usize = 1000;
pub const SYNTHETIC_TIME_SCALE: f64 = 8.0;
/// `conversation`: [`ConversationSpec`] overrides (the rest at its defaults), time scale 1.
pub const CONVERSATION_PARAMS: &str = "seed=1,conversations=150";
/// `chat-text`: the `--chat` spec (text `messages` to /v1/chat/completions, Poisson arrivals).
pub const CHAT_TEXT_SPEC: &str = "conversations=200,turns=6,system_prompts=4,system_chars=24000,\
user_chars=4000,reply_chars=1600,osl=64,rate=30,seed=1";
/// `agent` and `agent-mixed`: [`AgentSpec`] overrides (the rest at its defaults), time scale 1.
pub const AGENT_PARAMS: &str = "seed=1,sessions=150";
/// `burst`: the synthetic spec (`--synthetic`) with bursts of 16 requests, each burst sharing a
/// new 8,192-token prefix, 1,024 tokens of its own per request, at 12 requests a second.
pub const BURST_SPEC: &str = "burst=16,prefix=8192,isl=9216,osl=64,requests=480,rate=12,seed=1";
/// `vllm`: two real vLLM CPU engines (tiny model) and a small agent workload fitted to them.
pub const VLLM_ENGINES: u64 = 2;
pub const VLLM_BLOCK_SIZE: u32 = 32;
pub const VLLM_BLOCKS: u32 = 1024;
pub const VLLM_MAX_LEN: u32 = 2048;
pub const VLLM_MAX_NUM_SEQS: u32 = 8;
/// Tokens kept of each 512-token block (one 32-token engine block), and the output cap.
pub const VLLM_TRACE_BLOCK_TOKENS: usize = 32;
pub const VLLM_MAX_OUTPUT_TOKENS: usize = 16;
pub const VLLM_AGENT_PARAMS: &str = "seed=1,sessions=24,session_rate=0.7,turns_min=3,turns_max=8,\
output_min=8,output_max=16,max_context=24576";

/// The race's settings (`loadgen race`).
#[derive(Debug, Clone)]
pub struct RaceOptions {
    pub runs: usize,
    pub workloads: Vec<String>,
    pub arms: Vec<String>,
    /// The arm under test (the others are its peers and baselines).
    pub candidate: String,
    /// Fraction of each workload's sessions (or requests) to run.
    pub scale: f64,
    pub out: PathBuf,
    pub synthetic_trace: PathBuf,
    /// Prepare and describe the workloads, run nothing.
    pub dry_run: bool,
    pub quiet: bool,
    /// Filter builds for `kv@TAG` arms (`--arm-wasm TAG=PATH`), as the compare tool's.
    pub arm_wasm: Vec<(String, PathBuf)>,
    /// Workloads of the user's own traces and fleets (`--trace-workload`), run when named in
    /// `workloads`.
    pub trace_workloads: Vec<TraceWorkload>,
}

impl Default for RaceOptions {
    fn default() -> Self {
        RaceOptions {
            runs: 3,
            workloads: WORKLOADS.iter().map(|s| s.to_string()).collect(),
            arms: DEFAULT_ARMS.iter().map(|s| s.to_string()).collect(),
            candidate: "kv".into(),
            scale: 1.0,
            out: PathBuf::from("target/race"),
            synthetic_trace: PathBuf::from("bench-data/mooncake_synthetic_trace.jsonl"),
            dry_run: false,
            quiet: false,
            arm_wasm: Vec::new(),
            trace_workloads: Vec::new(),
        }
    }
}

/// One workload ready to run.
pub struct RaceWorkload {
    pub name: String,
    /// What it is, its fixed parameters and its fleet, for the summary.
    pub description: String,
    pub params: Value,
    pub workload: Workload,
    pub fleet: Fleet,
    pub run_opts: RunOptions,
    /// Pace and offered prefill load (Mooncake-format workloads).
    pub load: Option<TraceLoad>,
}

impl RaceWorkload {
    fn fleet_json(&self) -> Value {
        let f = &self.fleet;
        json!({
            "workers": f.workers,
            "worker_args": f.worker_args,
            "speedups": f.speedups,
            "block_size": f.block_size,
            "vllm": f.vllm.as_ref().map(|c| json!({
                "block_size": c.block_size, "max_len": c.max_len,
                "num_blocks": c.num_blocks, "max_num_seqs": c.max_num_seqs,
            })),
        })
    }
}

fn scaled(n: usize, scale: f64) -> usize {
    ((n as f64 * scale).round() as usize).max(1)
}

fn mock_fleet() -> Fleet {
    Fleet::new(MOCK_WORKERS, MOCK_BLOCK_SIZE, &MOCK_WORKER_ARGS)
}

fn params_of(s: &str) -> Vec<String> {
    vec![s.to_string()]
}

/// Reads a Mooncake-format trace's lines (the first `max`): each line in the `session` it names
/// (the generated traces' field), else in its own.
pub fn read_trace(path: &Path, max: usize) -> io::Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        if out.len() >= max {
            break;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}:{}: {e}", path.display(), n + 1),
            )
        })?;
        out.push(TraceRequest {
            session: v["session"].as_u64().map_or(n, |s| s as usize),
            turn: 0,
            timestamp_ms: v["timestamp"].as_f64().unwrap_or(0.0).max(0.0) as u64,
            input_length: v["input_length"].as_u64().unwrap_or(0) as usize,
            output_length: v["output_length"].as_u64().unwrap_or(0) as usize,
            hash_ids: v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

/// A generated trace written under `dir/workloads/` (so a run can be replayed) and loaded back
/// through the `--trace` path.
fn generated(
    dir: &Path,
    file: &str,
    trace: &[TraceRequest],
    fit: Option<&ModelFit>,
) -> io::Result<Workload> {
    let path = dir.join("workloads").join(file);
    generate::write_trace(&path, trace)?;
    let mut w = load_mooncake(&path, 1.0, None)?;
    if let Some(fit) = fit {
        w.fit(fit);
    }
    Ok(w)
}

/// Prepares workload `name`, or says why it is skipped.
pub fn prepare(name: &str, opts: &RaceOptions) -> io::Result<Result<RaceWorkload, String>> {
    let mut run_opts = RunOptions {
        progress_every: (!opts.quiet).then(|| std::time::Duration::from_secs(10)),
        ..RunOptions::default()
    };
    let mock = |what: &str| {
        format!(
            "{what}; {MOCK_WORKERS} mock workers `{}`",
            MOCK_WORKER_ARGS.join(" ")
        )
    };
    let speedup = 2.0;
    if let Some(t) = opts.trace_workloads.iter().find(|t| t.name == name) {
        return Ok(Ok(trace_race_workload(t, opts.scale, run_opts)?));
    }
    Ok(Ok(match name {
        "synthetic" => {
            let path = &opts.synthetic_trace;
            if !path.is_file() {
                return Ok(Err(format!(
                    "no Mooncake synthetic trace at {}: save FAST25-release/traces/synthetic_trace.jsonl \
                     from github.com/kvcache-ai/Mooncake there (or pass --synthetic-trace)",
                    path.display()
                )));
            }
            let n = scaled(SYNTHETIC_REQUESTS, opts.scale);
            let trace = read_trace(path, n)?;
            let workload = load_mooncake(path, SYNTHETIC_TIME_SCALE, Some(n))?;
            RaceWorkload {
                name: name.into(),
                description: mock(&format!(
                    "the Mooncake FAST'25 synthetic trace ({}), first {n} requests, `--time-scale {SYNTHETIC_TIME_SCALE}`",
                    path.display()
                )),
                params: json!({"trace": path, "requests": n, "time_scale": SYNTHETIC_TIME_SCALE}),
                load: Some(TraceLoad::of(&trace, MOCK_WORKERS as usize, speedup, SYNTHETIC_TIME_SCALE)),
                workload,
                fleet: mock_fleet(),
                run_opts,
            }
        }
        "conversation" => {
            let mut spec = ConversationSpec::parse(&params_of(CONVERSATION_PARAMS))
                .map_err(io::Error::other)?;
            spec.conversations = scaled(spec.conversations, opts.scale);
            let trace = generate::conversation(&spec);
            RaceWorkload {
                name: name.into(),
                description: mock(&format!(
                    "generated multi-turn chat (`loadgen gen-workload conversation`) {}",
                    spec.describe()
                )),
                params: json!({"kind": "conversation", "params": spec.describe(), "time_scale": 1.0}),
                load: Some(TraceLoad::of(&trace, MOCK_WORKERS as usize, speedup, 1.0)),
                workload: generated(&opts.out, "conversation.jsonl", &trace, None)?,
                fleet: mock_fleet(),
                run_opts,
            }
        }
        "chat-text" => {
            let mut spec = ChatSpec::parse(CHAT_TEXT_SPEC).map_err(io::Error::other)?;
            spec.conversations = scaled(spec.conversations, opts.scale);
            let workload = chat(&spec);
            run_opts.path = "/v1/chat/completions".into();
            RaceWorkload {
                name: name.into(),
                description: mock(&format!(
                    "`--chat` conversations sent as text `messages` to /v1/chat/completions, no \
                     tokenizer configured: {} (with conversations={})",
                    CHAT_TEXT_SPEC, spec.conversations
                )),
                params: json!({"chat": CHAT_TEXT_SPEC, "conversations": spec.conversations}),
                load: None,
                workload,
                fleet: mock_fleet(),
                run_opts,
            }
        }
        "agent" | "agent-mixed" => {
            let mut spec = AgentSpec::parse(&params_of(AGENT_PARAMS)).map_err(io::Error::other)?;
            spec.sessions = scaled(spec.sessions, opts.scale);
            let trace = generate::agent(&spec);
            let mixed = name == "agent-mixed";
            let mut fleet = mock_fleet();
            let (fleet_text, mean_speed) = if mixed {
                fleet.worker_args = vec!["--kv-blocks".into(), "8192".into()];
                fleet.speedups = MIXED_SPEEDUPS.to_vec();
                (
                    format!(
                        "{MOCK_WORKERS} mock workers `--kv-blocks 8192`, worker i at `--speedup` {:?} (mean {})",
                        MIXED_SPEEDUPS,
                        fleet.worker_speedup()
                    ),
                    fleet.worker_speedup(),
                )
            } else {
                (
                    format!(
                        "{MOCK_WORKERS} mock workers `{}`",
                        MOCK_WORKER_ARGS.join(" ")
                    ),
                    speedup,
                )
            };
            RaceWorkload {
                name: name.into(),
                description: format!(
                    "generated tool-agent sessions (`loadgen gen-workload agent`) {}; {fleet_text}",
                    spec.describe()
                ),
                params: json!({"kind": "agent", "params": spec.describe(), "time_scale": 1.0}),
                load: Some(TraceLoad::of(
                    &trace,
                    MOCK_WORKERS as usize,
                    mean_speed,
                    1.0,
                )),
                workload: generated(&opts.out, &format!("{name}.jsonl"), &trace, None)?,
                fleet,
                run_opts,
            }
        }
        "vllm" => {
            if let Err(e) = vllm::require_vllm() {
                return Ok(Err(format!("real vLLM engines not installed: {e}")));
            }
            let mut spec =
                AgentSpec::parse(&params_of(VLLM_AGENT_PARAMS)).map_err(io::Error::other)?;
            spec.sessions = scaled(spec.sessions, opts.scale);
            let trace = generate::agent(&spec);
            let fit = ModelFit {
                trace_block_tokens: Some(VLLM_TRACE_BLOCK_TOKENS),
                vocab: Some(vllm::VOCAB),
                max_prompt_tokens: Some(VLLM_MAX_LEN as usize - VLLM_MAX_OUTPUT_TOKENS - 1),
                max_output_tokens: Some(VLLM_MAX_OUTPUT_TOKENS),
            };
            let mut fleet = Fleet::new(VLLM_ENGINES, VLLM_BLOCK_SIZE, &[]);
            fleet.vllm = Some(EngineConfig {
                block_size: VLLM_BLOCK_SIZE,
                max_len: VLLM_MAX_LEN,
                num_blocks: Some(VLLM_BLOCKS),
                max_num_seqs: VLLM_MAX_NUM_SEQS,
                ..EngineConfig::default()
            });
            run_opts.model = vllm::MODEL.to_string();
            // The tiny model's random weights end outputs early: every request runs its
            // full output, as the workload says (as `loadgen --vllm-engines` does).
            run_opts.extra_body = Some(json!({"ignore_eos": true}));
            RaceWorkload {
                name: name.into(),
                description: format!(
                    "{VLLM_ENGINES} real vLLM CPU engines (tiny model, {VLLM_BLOCKS} blocks of \
                     {VLLM_BLOCK_SIZE} tokens, --max-model-len {VLLM_MAX_LEN}, --max-num-seqs \
                     {VLLM_MAX_NUM_SEQS}); generated tool-agent sessions {}, each 512-token block \
                     cut to {VLLM_TRACE_BLOCK_TOKENS} tokens, outputs capped at \
                     {VLLM_MAX_OUTPUT_TOKENS}",
                    spec.describe()
                ),
                params: json!({"kind": "agent", "params": spec.describe(),
                               "trace_block_tokens": VLLM_TRACE_BLOCK_TOKENS,
                               "max_output_tokens": VLLM_MAX_OUTPUT_TOKENS}),
                load: None,
                workload: generated(&opts.out, "vllm-agent.jsonl", &trace, Some(&fit))?,
                fleet,
                run_opts,
            }
        }
        "burst" => {
            let mut spec = SyntheticSpec::parse(BURST_SPEC).map_err(io::Error::other)?;
            // Whole bursts only.
            spec.requests = scaled(spec.requests / spec.burst, opts.scale) * spec.burst;
            RaceWorkload {
                name: name.into(),
                description: mock(&format!(
                    "bursts of requests sharing a new prefix (`--synthetic {BURST_SPEC}`, with requests={})",
                    spec.requests
                )),
                params: json!({"synthetic": BURST_SPEC, "requests": spec.requests}),
                load: None,
                workload: synthetic(&spec),
                fleet: mock_fleet(),
                run_opts,
            }
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "unknown workload {other:?} (known: {},{})",
                    WORKLOADS.join(","),
                    EXTRA_WORKLOADS.join(",")
                ),
            ))
        }
    }))
}

/// A `--trace-workload`: the first `scale` of the trace's requests on the fleet it names.
fn trace_race_workload(
    t: &TraceWorkload,
    scale: f64,
    run_opts: RunOptions,
) -> io::Result<RaceWorkload> {
    let trace = read_trace(&t.path, usize::MAX)?;
    if trace.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: no requests", t.path.display()),
        ));
    }
    // `--scale` above 1 cannot add requests a trace does not have.
    let n = scaled(trace.len(), scale).min(trace.len());
    let mut fleet = Fleet::new(t.workers, t.block_size, &[]);
    fleet.worker_args.clone_from(&t.worker_args);
    fleet.speedups.clone_from(&t.speedups);
    let load = TraceLoad::of(
        &trace[..n],
        t.workers as usize,
        fleet.worker_speedup(),
        t.time_scale,
    );
    Ok(RaceWorkload {
        name: t.name.clone(),
        description: format!(
            "the trace {} (`--trace-workload`), first {n} of its {} requests, `--time-scale {}`; {}",
            t.path.display(),
            trace.len(),
            t.time_scale,
            t.fleet_text()
        ),
        params: json!({"trace": t.path, "requests": n, "time_scale": t.time_scale}),
        load: Some(load),
        workload: load_mooncake(&t.path, t.time_scale, Some(n))?,
        fleet,
        run_opts,
    })
}

/// What one arm measured in one run.
#[derive(Debug, Clone, Default)]
pub struct ArmRun {
    pub workload: String,
    pub arm: String,
    /// From 1.
    pub run: usize,
    /// The arm could not run (its fleet, router or Envoy failed).
    pub failure: Option<String>,
    /// Seconds from the previous arm's end to this one's (start-up, traffic, drain, teardown).
    pub elapsed_s: f64,
    pub requests: usize,
    pub completed: usize,
    pub errors: usize,
    pub error_kinds: Vec<(String, usize)>,
    pub ttft_mean: f64,
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    pub hit_rate: Option<f64>,
    /// Completed requests per worker id.
    pub per_worker: Vec<(String, usize)>,
    pub req_max: usize,
    /// Completed requests / workers in the fleet (idle ones included).
    pub req_mean: f64,
    pub max_over_mean: f64,
    /// Mixed fleets: each worker's share of the requests over its share of the fleet's speed.
    pub share_over_speed: Vec<(String, f64)>,
    pub wall_s: f64,
    /// The engines' modelled prefill time and whole-step time over workers x arrival window.
    pub prefill_util: Option<f64>,
    pub busy_util: Option<f64>,
    /// The mean time each request's uncached tokens take alone on an idle engine (ms, uniform
    /// mock fleets only): the part of the TTFT mean no router takes away at this hit rate.
    pub alone_ms: Option<f64>,
    /// The same requests' hit rate in one cache pooling every worker's (the affinity replay's
    /// ceiling: what placement could reach, near enough; LRU is not optimal).
    pub ceiling_hit: Option<f64>,
}

impl ArmRun {
    fn measure(workload: &str, arm: &str, run: usize, fleet: &Fleet, s: &RunStats) -> ArmRun {
        let t = s.ttft();
        let per_worker = s.per_worker();
        let req_max = per_worker.iter().map(|(_, n)| *n).max().unwrap_or(0);
        let req_mean = s.completed() as f64 / fleet.workers.max(1) as f64;
        let share_over_speed = if fleet.speedups.is_empty() {
            Vec::new()
        } else {
            let total_speed: f64 = (1..=fleet.workers)
                .filter_map(|id| fleet.speedup_of(id))
                .sum();
            let done = s.completed().max(1) as f64;
            (1..=fleet.workers)
                .map(|id| {
                    let n = per_worker
                        .iter()
                        .find(|(w, _)| w.parse::<u64>().ok() == Some(id))
                        .map_or(0, |(_, n)| *n);
                    let speed = fleet.speedup_of(id).unwrap_or(1.0) / total_speed.max(1e-9);
                    (id.to_string(), n as f64 / done / speed.max(1e-9))
                })
                .collect()
        };
        let util = s.fleet_utilization();
        ArmRun {
            workload: workload.into(),
            arm: arm.into(),
            run,
            failure: None,
            elapsed_s: 0.0,
            requests: s.results.len(),
            completed: s.completed(),
            errors: s.errors(),
            error_kinds: s.error_summary().into_iter().take(3).collect(),
            ttft_mean: t.mean,
            ttft_p50: t.p50,
            ttft_p90: t.p90,
            ttft_p99: t.p99,
            hit_rate: s.hit_rate(),
            per_worker,
            req_max,
            req_mean,
            max_over_mean: if req_mean > 0.0 {
                req_max as f64 / req_mean
            } else {
                f64::NAN
            },
            share_over_speed,
            wall_s: s.wall_s,
            prefill_util: util.map(|u| u.0),
            busy_util: util.map(|u| u.1),
            alone_ms: alone_ms(fleet, s),
            ceiling_hit: None,
        }
    }

    /// The balance figure of the targets: max/mean requests per worker, or on a mixed fleet the
    /// largest share of requests over share of speed.
    pub fn balance(&self) -> f64 {
        if self.share_over_speed.is_empty() {
            self.max_over_mean
        } else {
            self.share_over_speed
                .iter()
                .map(|(_, r)| *r)
                .fold(f64::NAN, f64::max)
        }
    }

    fn to_json(&self) -> Value {
        let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "workload": self.workload,
            "arm": self.arm,
            "run": self.run,
            "failure": self.failure,
            "elapsed_s": f(self.elapsed_s),
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "error_kinds": self.error_kinds,
            "ttft_ms": {"mean": f(self.ttft_mean), "p50": f(self.ttft_p50),
                        "p90": f(self.ttft_p90), "p99": f(self.ttft_p99)},
            "hit_rate": self.hit_rate,
            "per_worker": self.per_worker.iter().cloned().collect::<BTreeMap<_, _>>(),
            "requests_per_worker": {"max": self.req_max, "mean": f(self.req_mean),
                                    "max_over_mean": f(self.max_over_mean)},
            "share_over_speed_share": (!self.share_over_speed.is_empty()).then(|| {
                self.share_over_speed.iter().map(|(w, r)| (w.clone(), f(*r)))
                    .collect::<serde_json::Map<_, _>>()
            }),
            "balance": f(self.balance()),
            "wall_s": f(self.wall_s),
            "prefill_utilization": self.prefill_util,
            "busy_utilization": self.busy_util,
            "alone_ms": self.alone_ms,
            "ceiling_hit_rate": self.ceiling_hit,
        })
    }
}

/// [`ArmRun::alone_ms`]: on mock engines of one speed only (their step-time model prices it).
fn alone_ms(fleet: &Fleet, s: &RunStats) -> Option<f64> {
    if fleet.vllm.is_some() || !fleet.speedups.is_empty() {
        return None;
    }
    let chunk = crate::compare::worker_arg::<f64>(&fleet.worker_args, "--max-batched-tokens")
        .unwrap_or(8192.0);
    crate::quality::time_beyond_compute(&s.results, fleet.worker_speedup(), chunk)
        .map(|t| t.alone_ms)
}

/// [`ArmRun::ceiling_hit`]: the requests replayed through one cache of every worker's blocks.
fn ceiling_hit(w: &RaceWorkload, s: &RunStats) -> Option<f64> {
    let blocks = usize::try_from(w.fleet.worker_kv_blocks()).ok()?;
    let workers = usize::try_from(w.fleet.workers).ok()?;
    let pooled = blocks.checked_mul(workers.max(1));
    crate::loadgen::pooled_replay(&w.workload, &s.results, w.fleet.block_size, pooled)
        .modelled_hit_rate()
}

/// The median of the finite values (the mean of the middle two for an even count).
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// One arm's medians over its runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArmSummary {
    pub arm: String,
    pub runs: usize,
    pub failed_runs: usize,
    pub ttft_mean: Option<f64>,
    pub ttft_p50: Option<f64>,
    pub ttft_p90: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub hit_rate: Option<f64>,
    pub balance: Option<f64>,
    pub prefill_util: Option<f64>,
    pub busy_util: Option<f64>,
    pub alone_ms: Option<f64>,
    pub ceiling_hit: Option<f64>,
    pub errors: usize,
    pub requests: usize,
}

impl ArmSummary {
    pub fn of(arm: &str, runs: &[&ArmRun]) -> ArmSummary {
        let ok: Vec<&&ArmRun> = runs.iter().filter(|r| r.failure.is_none()).collect();
        let m = |f: fn(&ArmRun) -> f64| median(ok.iter().map(|r| f(r)));
        ArmSummary {
            arm: arm.into(),
            runs: ok.len(),
            failed_runs: runs.len() - ok.len(),
            ttft_mean: m(|r| r.ttft_mean),
            ttft_p50: m(|r| r.ttft_p50),
            ttft_p90: m(|r| r.ttft_p90),
            ttft_p99: m(|r| r.ttft_p99),
            hit_rate: m(|r| r.hit_rate.unwrap_or(f64::NAN)),
            balance: m(ArmRun::balance),
            prefill_util: m(|r| r.prefill_util.unwrap_or(f64::NAN)),
            busy_util: m(|r| r.busy_util.unwrap_or(f64::NAN)),
            alone_ms: m(|r| r.alone_ms.unwrap_or(f64::NAN)),
            ceiling_hit: m(|r| r.ceiling_hit.unwrap_or(f64::NAN)),
            errors: ok.iter().map(|r| r.errors).sum(),
            requests: ok.iter().map(|r| r.requests).max().unwrap_or(0),
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "runs": self.runs, "failed_runs": self.failed_runs,
            "ttft_ms": {"mean": self.ttft_mean, "p50": self.ttft_p50, "p90": self.ttft_p90,
                        "p99": self.ttft_p99},
            "hit_rate": self.hit_rate, "balance": self.balance,
            "prefill_utilization": self.prefill_util, "busy_utilization": self.busy_util,
            "alone_ms": self.alone_ms, "ceiling_hit_rate": self.ceiling_hit,
            "errors": self.errors, "requests": self.requests,
        })
    }
}

/// TTFT mean at least this many times better than the best peer's.
pub const TARGET_TTFT_SPEEDUP: f64 = 1.2;
/// Hit rate at most this far (a fraction) below the best peer's.
pub const TARGET_HIT_SLACK: f64 = 0.01;
/// Max/mean requests per worker (mixed fleets: share over speed share) at most this.
pub const TARGET_BALANCE: f64 = 1.3;

/// One target: the candidate's figure, the reference (a peer's, or the fixed bound) and whether
/// it passes (`None`: not measured).
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub name: String,
    pub candidate: Option<f64>,
    pub reference: Option<f64>,
    pub reference_arm: Option<String>,
    pub pass: Option<bool>,
}

/// The candidate against its peers on medians: TTFT mean at least [`TARGET_TTFT_SPEEDUP`]x
/// better than the lowest peer mean, p99 at most the lowest peer p99, hit rate at least the
/// highest peer hit rate less [`TARGET_HIT_SLACK`], balance at most [`TARGET_BALANCE`]. Peers
/// are the `vllm-router:` arms; without any, every other arm (then said in `peers`).
#[derive(Debug, Clone, PartialEq)]
pub struct Targets {
    pub peers: Vec<String>,
    pub peers_are_vllm_router: bool,
    /// Candidate TTFT mean / best peer's.
    pub ttft_ratio: Option<f64>,
    pub list: Vec<Target>,
}

impl Targets {
    pub fn of(candidate: &str, arms: &[ArmSummary], mixed: bool) -> Targets {
        let usable = |a: &&ArmSummary| a.arm != candidate && a.runs > 0;
        let mut peers: Vec<&ArmSummary> = arms
            .iter()
            .filter(usable)
            .filter(|a| vllm_router_policy(&a.arm).is_some())
            .collect();
        let peers_are_vllm_router = !peers.is_empty();
        if peers.is_empty() {
            peers = arms.iter().filter(usable).collect();
        }
        let cand = arms.iter().find(|a| a.arm == candidate && a.runs > 0);
        let best = |f: fn(&ArmSummary) -> Option<f64>, lowest: bool| {
            peers
                .iter()
                .filter_map(|a| f(a).map(|v| (a.arm.clone(), v)))
                .reduce(|x, y| {
                    if (y.1 < x.1) == lowest && y.1 != x.1 {
                        y
                    } else {
                        x
                    }
                })
        };
        let c = |f: fn(&ArmSummary) -> Option<f64>| cand.and_then(f);
        let mean = best(|a| a.ttft_mean, true);
        let p99 = best(|a| a.ttft_p99, true);
        let hit = best(|a| a.hit_rate, false);
        let ttft_ratio = match (c(|a| a.ttft_mean), &mean) {
            (Some(x), Some((_, p))) if *p > 0.0 => Some(x / p),
            _ => None,
        };
        let target = |name: &str,
                      candidate: Option<f64>,
                      reference: Option<(String, f64)>,
                      pass: &dyn Fn(f64, f64) -> bool| {
            let (reference_arm, reference) =
                reference.map_or((None, None), |(a, v)| (Some(a), Some(v)));
            Target {
                name: name.into(),
                candidate,
                reference,
                reference_arm,
                pass: match (candidate, reference) {
                    (Some(c), Some(r)) => Some(pass(c, r)),
                    _ => None,
                },
            }
        };
        let list = vec![
            target(
                &format!("TTFT mean >= {TARGET_TTFT_SPEEDUP}x better than the best peer's"),
                c(|a| a.ttft_mean),
                mean,
                &|c, r| c > 0.0 && r / c >= TARGET_TTFT_SPEEDUP,
            ),
            target(
                "TTFT p99 <= the best peer's",
                c(|a| a.ttft_p99),
                p99,
                &|c, r| c <= r,
            ),
            target(
                "hit rate >= the best peer's - 1 point",
                c(|a| a.hit_rate),
                hit,
                &|c, r| c >= r - TARGET_HIT_SLACK - 1e-12,
            ),
            target(
                if mixed {
                    "each worker's request share <= 1.3x its speed share"
                } else {
                    "max/mean requests per worker <= 1.3"
                },
                c(|a| a.balance),
                Some(("bound".into(), TARGET_BALANCE)),
                &|c, r| c <= r,
            ),
        ];
        Targets {
            peers: peers.iter().map(|a| a.arm.clone()).collect(),
            peers_are_vllm_router,
            ttft_ratio,
            list,
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "peers": self.peers,
            "peers_are_vllm_router": self.peers_are_vllm_router,
            "ttft_mean_ratio_candidate_over_best_peer": self.ttft_ratio,
            "targets": self.list.iter().map(|t| json!({
                "target": t.name, "candidate": t.candidate, "reference": t.reference,
                "reference_arm": t.reference_arm, "pass": t.pass,
            })).collect::<Vec<_>>(),
        })
    }
}

fn fmt_ms(v: Option<f64>) -> String {
    match v {
        Some(x) if x >= 10_000.0 => format!("{:.1} s", x / 1000.0),
        Some(x) => format!("{x:.0} ms"),
        None => "-".into(),
    }
}

fn fmt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{:.1}%", x * 100.0))
}

fn fmt_x(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

/// A workload's outcome in the race.
pub struct WorkloadResult {
    pub name: String,
    pub description: String,
    pub skipped: Option<String>,
    pub mixed: bool,
    pub requests: usize,
    pub load: Option<TraceLoad>,
    pub params: Value,
    pub fleet: Value,
    pub arms: Vec<ArmSummary>,
    pub targets: Option<Targets>,
    pub skipped_arms: Vec<(String, String)>,
    pub chart: Option<String>,
}

impl WorkloadResult {
    fn skipped(name: &str, why: String) -> WorkloadResult {
        WorkloadResult {
            name: name.into(),
            description: String::new(),
            skipped: Some(why),
            mixed: false,
            requests: 0,
            load: None,
            params: Value::Null,
            fleet: Value::Null,
            arms: Vec::new(),
            targets: None,
            skipped_arms: Vec::new(),
            chart: None,
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "status": if self.skipped.is_some() { "skipped" } else { "ran" },
            "reason": self.skipped,
            "description": self.description,
            "requests": self.requests,
            "params": self.params,
            "fleet": self.fleet,
            "offered_load": self.load.map(|l| json!({
                "requests": l.requests, "sessions": l.sessions, "span_s": l.span_s,
                "mean_input_tokens": l.mean_input, "max_input_tokens": l.max_input,
                "mean_output_tokens": l.mean_output, "reusable_fraction": l.reusable_fraction,
                "offered_prefill_uncached": l.offered_prefill_uncached,
                "offered_prefill_pooled": l.offered_prefill_pooled,
            })),
            "skipped_arms": self.skipped_arms.iter().cloned().collect::<BTreeMap<_, _>>(),
            "medians": self.arms.iter().map(|a| (a.arm.clone(), a.to_json()))
                .collect::<serde_json::Map<_, _>>(),
            "targets": self.targets.as_ref().map(Targets::to_json),
            "chart": self.chart,
        })
    }

    /// The workload's section of summary.md.
    pub fn markdown(&self, candidate: &str, runs: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "## {}\n", self.name);
        if let Some(why) = &self.skipped {
            let _ = writeln!(s, "Skipped: {why}\n");
            return s;
        }
        let _ = writeln!(s, "{}. {} requests.", self.description, self.requests);
        if let Some(l) = &self.load {
            let _ = writeln!(
                s,
                "Pace: {:.1} req/s over {:.0} s; prompts mean {:.0} tokens; {:.0}% of prompt tokens \
                 reusable; offered prefill load {:.0}% with nothing cached, {:.0}% with every \
                 reusable prefix cached.",
                l.requests as f64 / l.span_s.max(1e-9),
                l.span_s,
                l.mean_input,
                l.reusable_fraction * 100.0,
                l.offered_prefill_uncached * 100.0,
                l.offered_prefill_pooled * 100.0
            );
        }
        for (arm, why) in &self.skipped_arms {
            let _ = writeln!(s, "\nArm `{arm}` skipped: {why}");
        }
        let balance = if self.mixed {
            "max share/speed"
        } else {
            "max/mean"
        };
        let _ = writeln!(
            s,
            "\nMedians of {runs} run(s):\n\n| arm | runs | TTFT mean | p50 | p90 | p99 | hit | {balance} | prefill / busy | errors | alone | ceiling |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for a in &self.arms {
            let name = if a.arm == candidate {
                format!("**{}**", a.arm)
            } else {
                a.arm.clone()
            };
            let _ = writeln!(
                s,
                "| {name} | {}{} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {} |",
                a.runs,
                if a.failed_runs > 0 {
                    format!(" ({} failed)", a.failed_runs)
                } else {
                    String::new()
                },
                fmt_ms(a.ttft_mean),
                fmt_ms(a.ttft_p50),
                fmt_ms(a.ttft_p90),
                fmt_ms(a.ttft_p99),
                fmt_pct(a.hit_rate),
                fmt_x(a.balance),
                fmt_pct(a.prefill_util),
                fmt_pct(a.busy_util),
                a.errors,
                fmt_ms(a.alone_ms),
                fmt_pct(a.ceiling_hit),
            );
        }
        let _ = writeln!(
            s,
            "\n(alone: the mean time each request's uncached tokens take on an idle mock engine, \
             the part of the TTFT mean no router takes away at that hit rate; ceiling: the same \
             requests' hit rate in one cache of every worker's blocks, as the client-side replay \
             models it)"
        );
        if let Some(t) = &self.targets {
            let peers = if t.peers_are_vllm_router {
                format!("peers: {}", t.peers.join(", "))
            } else {
                format!(
                    "no vllm-router arm ran: compared with the other arms ({})",
                    t.peers.join(", ")
                )
            };
            let _ = writeln!(
                s,
                "\n`{candidate}` TTFT mean / best peer's: {} (the best peer's over `{candidate}`'s: \
                 {}x, target >= {TARGET_TTFT_SPEEDUP}x; {peers})\n",
                fmt_x(t.ttft_ratio),
                fmt_x(t.ttft_ratio.filter(|r| *r > 0.0).map(|r| 1.0 / r))
            );
            let _ = writeln!(
                s,
                "| target | {candidate} | reference | pass |\n|---|---|---|---|"
            );
            for (k, tg) in t.list.iter().enumerate() {
                let show = |v: Option<f64>| match k {
                    0 | 1 => fmt_ms(v),
                    2 => fmt_pct(v),
                    _ => fmt_x(v),
                };
                let reference = match &tg.reference_arm {
                    Some(a) if a != "bound" => format!("{} ({a})", show(tg.reference)),
                    _ => show(tg.reference),
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} |",
                    tg.name,
                    show(tg.candidate),
                    reference,
                    match tg.pass {
                        Some(true) => "PASS",
                        Some(false) => "FAIL",
                        None => "n/a",
                    }
                );
            }
        }
        if let Some(chart) = &self.chart {
            let _ = writeln!(
                s,
                "\nTTFT distribution (every run pooled): [{chart}]({chart})"
            );
        }
        s.push('\n');
        s
    }
}

/// Everything the race measured.
pub struct RaceReport {
    pub runs: Vec<ArmRun>,
    pub workloads: Vec<WorkloadResult>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `secs` since the epoch as `YYYY-MM-DD HH:MM:SS UTC` (days to a civil date: H. Hinnant's
/// algorithm).
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

struct Header {
    started: u64,
    loadavg_start: String,
}

fn write_results(
    opts: &RaceOptions,
    header: &Header,
    finished: bool,
    report: &RaceReport,
) -> io::Result<()> {
    let body = json!({
        "race": {
            "started_unix": header.started,
            "started_utc": utc(header.started),
            "finished_unix": finished.then(unix_now),
            "finished_utc": finished.then(|| utc(unix_now())),
            "loadavg_start": header.loadavg_start,
            "loadavg_now": loadavg(),
            "runs": opts.runs,
            "scale": opts.scale,
            "candidate": opts.candidate,
            "arms": opts.arms,
            "workloads": opts.workloads,
        },
        "workloads": report.workloads.iter().map(|w| (w.name.clone(), w.to_json()))
            .collect::<serde_json::Map<_, _>>(),
        "runs": report.runs.iter().map(ArmRun::to_json).collect::<Vec<_>>(),
    });
    let path = opts.out.join("results.json");
    std::fs::write(&path, serde_json::to_string_pretty(&body)?)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn summary_markdown(opts: &RaceOptions, header: &Header, report: &RaceReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Race: `{}` against its peers\n\nStarted {} (load average {}), finished {} \
         (load average {}); {} run(s) per arm, scale {}; arms: {}.\n",
        opts.candidate,
        utc(header.started),
        header.loadavg_start,
        utc(unix_now()),
        loadavg(),
        opts.runs,
        opts.scale,
        opts.arms.join(", ")
    );
    let _ = writeln!(
        s,
        "Targets (medians of the runs; \"best peer\" per figure: the lowest TTFT mean, the lowest \
         p99, the highest hit rate among the vllm-router arms): TTFT mean >= {TARGET_TTFT_SPEEDUP}x \
         better, p99 <= the best peer's, hit >= the best peer's - 1 point, max/mean requests per \
         worker <= {TARGET_BALANCE} (mixed fleet: each worker's share of requests <= \
         {TARGET_BALANCE}x its share of speed).\n"
    );
    let _ = writeln!(
        s,
        "| workload | {} TTFT mean | best peer | ratio | TTFT | p99 | hit | balance |\n|---|---|---|---|---|---|---|---|",
        opts.candidate
    );
    for w in &report.workloads {
        let Some(t) = &w.targets else {
            let _ = writeln!(
                s,
                "| {} | {} | | | | | | |",
                w.name,
                if w.skipped.is_some() {
                    "skipped"
                } else {
                    "no data"
                }
            );
            continue;
        };
        let mark = |k: usize| match t.list.get(k).and_then(|x| x.pass) {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "n/a",
        };
        let first = &t.list[0];
        let _ = writeln!(
            s,
            "| {} | {} | {} {} | {} | {} | {} | {} | {} |",
            w.name,
            fmt_ms(first.candidate),
            first.reference_arm.clone().unwrap_or_else(|| "-".into()),
            fmt_ms(first.reference),
            fmt_x(t.ttft_ratio),
            mark(0),
            mark(1),
            mark(2),
            mark(3)
        );
    }
    s.push('\n');
    for w in &report.workloads {
        s.push_str(&w.markdown(&opts.candidate, opts.runs));
    }
    s
}

/// Runs the race and writes its outputs into `opts.out`.
pub fn race(opts: &RaceOptions) -> io::Result<RaceReport> {
    std::fs::create_dir_all(&opts.out)?;
    let header = Header {
        started: unix_now(),
        loadavg_start: loadavg(),
    };
    let mut report = RaceReport {
        runs: Vec::new(),
        workloads: Vec::new(),
    };
    for name in &opts.workloads {
        let prepared = match prepare(name, opts)? {
            Ok(mut p) => {
                p.fleet.arm_wasm.clone_from(&opts.arm_wasm);
                p
            }
            Err(why) => {
                eprintln!("race: workload {name} skipped: {why}");
                report.workloads.push(WorkloadResult::skipped(name, why));
                continue;
            }
        };
        let result = run_workload(opts, &header, &prepared, &mut report)?;
        report.workloads.push(result);
        if opts.dry_run {
            continue;
        }
        write_results(opts, &header, false, &report)?;
        if let Some(w) = report.workloads.last() {
            print!("{}", w.markdown(&opts.candidate, opts.runs));
        }
    }
    if !opts.dry_run {
        write_results(opts, &header, true, &report)?;
        let path = opts.out.join("summary.md");
        std::fs::write(&path, summary_markdown(opts, &header, &report))?;
        println!(
            "race: wrote {}, {} and the charts in {}",
            opts.out.join("results.json").display(),
            path.display(),
            opts.out.display()
        );
    }
    Ok(report)
}

fn run_workload(
    opts: &RaceOptions,
    header: &Header,
    w: &RaceWorkload,
    report: &mut RaceReport,
) -> io::Result<WorkloadResult> {
    let mixed = !w.fleet.speedups.is_empty();
    let mut result = WorkloadResult {
        name: w.name.clone(),
        description: w.description.clone(),
        skipped: None,
        mixed,
        requests: w.workload.requests.len(),
        load: w.load,
        params: w.params.clone(),
        fleet: w.fleet_json(),
        arms: Vec::new(),
        targets: None,
        skipped_arms: Vec::new(),
        chart: None,
    };
    eprintln!(
        "race: workload {}: {} requests; {}",
        w.name,
        w.workload.requests.len(),
        w.description
    );
    if let Some(l) = &w.load {
        let speed = w.fleet.worker_speedup();
        eprint!("{}", l.report(w.fleet.workers as usize, speed));
    }
    // Arms whose binaries are missing are left out, each with the reason.
    let mut arms: Vec<&str> = Vec::new();
    for arm in &opts.arms {
        match w.fleet.check(&[arm.as_str()]) {
            Ok(()) => arms.push(arm),
            Err(e) => {
                eprintln!("race: {}: arm {arm} skipped: {e}", w.name);
                result.skipped_arms.push((arm.clone(), e.to_string()));
            }
        }
    }
    if opts.dry_run || arms.is_empty() {
        return Ok(result);
    }
    let mut pooled: Vec<(String, RunStats)> = arms
        .iter()
        .map(|a| (a.to_string(), RunStats::default()))
        .collect();
    let mut runs: Vec<ArmRun> = Vec::new();
    let outcome = compare_modes_repeated(
        &arms,
        &w.fleet,
        &w.workload,
        &w.run_opts,
        opts.runs,
        |run, arm, stats, took| {
            let mut r = match &stats {
                Ok(s) => ArmRun {
                    ceiling_hit: ceiling_hit(w, s),
                    ..ArmRun::measure(&w.name, arm, run + 1, &w.fleet, s)
                },
                Err(e) => ArmRun {
                    workload: w.name.clone(),
                    arm: arm.into(),
                    run: run + 1,
                    failure: Some(e.to_string()),
                    ..ArmRun::default()
                },
            };
            r.elapsed_s = took.as_secs_f64();
            eprintln!(
                "race: {} run {} {arm}: {} in {:.0} s: TTFT mean {} p99 {}, hit {}, balance {}, {} errors",
                w.name,
                run + 1,
                if r.failure.is_some() { "FAILED" } else { "done" },
                r.elapsed_s,
                fmt_ms(Some(r.ttft_mean).filter(|x| x.is_finite())),
                fmt_ms(Some(r.ttft_p99).filter(|x| x.is_finite())),
                fmt_pct(r.hit_rate),
                fmt_x(Some(r.balance()).filter(|x| x.is_finite())),
                r.errors
            );
            if let Some(why) = &r.failure {
                eprintln!("race: {} run {} {arm}: {why}", w.name, run + 1);
            }
            if let (Ok(s), Some((_, p))) = (stats, pooled.iter_mut().find(|(a, _)| a == arm)) {
                p.results.extend(s.results.into_iter().map(|mut q| {
                    q.itl_ms = Vec::new();
                    q
                }));
            }
            runs.push(r.clone());
            report.runs.push(r);
            // Every arm's figures on disk as soon as they exist.
            if let Err(e) = write_results(opts, header, false, report) {
                eprintln!("race: {e}");
            }
        },
    );
    if let Err(e) = outcome {
        eprintln!("race: workload {} failed: {e}", w.name);
        result.skipped = Some(format!("failed: {e}"));
        return Ok(result);
    }
    result.arms = arms
        .iter()
        .map(|arm| {
            let mine: Vec<&ArmRun> = runs.iter().filter(|r| r.arm == *arm).collect();
            ArmSummary::of(arm, &mine)
        })
        .collect();
    result.targets = Some(Targets::of(&opts.candidate, &result.arms, mixed));
    let chart = format!("ttft-{}.svg", w.name);
    let rows: Vec<(&str, RunStats)> = pooled
        .iter()
        .map(|(a, s)| (a.as_str(), s.clone()))
        .collect();
    match write_svg_chart(&opts.out.join(&chart), &rows) {
        Ok(()) => result.chart = Some(chart),
        Err(e) => eprintln!("race: cannot write {chart}: {e}"),
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(arm: &str, mean: f64, p99: f64, hit: f64, balance: f64) -> ArmSummary {
        ArmSummary {
            arm: arm.into(),
            runs: 3,
            ttft_mean: Some(mean),
            ttft_p99: Some(p99),
            hit_rate: Some(hit),
            balance: Some(balance),
            ..ArmSummary::default()
        }
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400 + 3661), "2000-02-29 01:01:01 UTC");
        assert_eq!(utc(1_767_225_599), "2025-12-31 23:59:59 UTC");
    }

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median([f64::NAN, 5.0]), Some(5.0));
        assert_eq!(median(Vec::<f64>::new()), None);
        let run = |mean: f64, failure: Option<&str>| ArmRun {
            ttft_mean: mean,
            max_over_mean: 1.1,
            failure: failure.map(String::from),
            errors: 1,
            ..ArmRun::default()
        };
        let runs = [
            run(100.0, None),
            run(300.0, None),
            run(200.0, None),
            run(1.0, Some("x")),
        ];
        let s = ArmSummary::of("kv", &runs.iter().collect::<Vec<_>>());
        assert_eq!((s.runs, s.failed_runs, s.errors), (3, 1, 3));
        assert_eq!(s.ttft_mean, Some(200.0));
        assert_eq!(s.balance, Some(1.1));
        assert_eq!(s.hit_rate, None);
    }

    #[test]
    fn targets_take_the_best_peer_per_figure() {
        let arms = vec![
            summary("kv", 100.0, 500.0, 0.20, 1.2),
            summary("round-robin", 90.0, 100.0, 0.50, 1.0),
            summary("vllm-router:cache_aware", 130.0, 450.0, 0.205, 1.1),
            summary("vllm-router:kv_aware", 125.0, 700.0, 0.15, 1.5),
        ];
        let t = Targets::of("kv", &arms, false);
        assert!(t.peers_are_vllm_router);
        assert_eq!(t.peers.len(), 2, "round-robin is a baseline, not a peer");
        assert_eq!(t.ttft_ratio, Some(100.0 / 125.0));
        let pass: Vec<Option<bool>> = t.list.iter().map(|x| x.pass).collect();
        // 1.25x better; p99 500 > 450; hit 20.0% >= 20.5% - 1; balance 1.2 <= 1.3.
        assert_eq!(pass, vec![Some(true), Some(false), Some(true), Some(true)]);
        assert_eq!(
            t.list[0].reference_arm.as_deref(),
            Some("vllm-router:kv_aware")
        );
        assert_eq!(
            t.list[1].reference_arm.as_deref(),
            Some("vllm-router:cache_aware")
        );
        assert_eq!(t.list[2].reference, Some(0.205));
        // 1.19x is not enough; a hit 1.1 points below fails.
        let arms2 = vec![
            summary("kv", 105.1, 400.0, 0.194, 1.31),
            summary("vllm-router:cache_aware", 125.0, 450.0, 0.205, 1.1),
        ];
        let t = Targets::of("kv", &arms2, true);
        let pass: Vec<Option<bool>> = t.list.iter().map(|x| x.pass).collect();
        assert_eq!(
            pass,
            vec![Some(false), Some(true), Some(false), Some(false)]
        );
        assert!(t.list[3].name.contains("speed share"));
        // Without vllm-router arms the others stand in; without the candidate nothing passes.
        let t = Targets::of("kv", &arms[..2], false);
        assert!(!t.peers_are_vllm_router);
        assert_eq!(t.peers, vec!["round-robin".to_string()]);
        let t = Targets::of("kv+ttft", &arms, false);
        assert!(t.list.iter().all(|x| x.pass.is_none()));
        // The summary table says all of it.
        let w = WorkloadResult {
            arms,
            targets: Some(Targets::of("kv", &arms2, false)),
            ..WorkloadResult::skipped("agent", String::new())
        };
        let w = WorkloadResult { skipped: None, ..w };
        let md = w.markdown("kv", 3);
        assert!(md.contains("| **kv** | 3 | 100 ms |"), "{md}");
        assert!(md.contains("| FAIL |") && md.contains("| PASS |"), "{md}");
    }

    #[test]
    fn mixed_fleets_weigh_each_worker_by_its_speed() {
        let mut fleet = Fleet::new(4, 64, &[]);
        fleet.speedups = vec![1.0, 1.0, 2.0, 4.0];
        let result = |worker: &str| crate::loadgen::RequestResult {
            ok: true,
            ttft_ms: Some(10.0),
            worker_id: Some(worker.into()),
            ..crate::loadgen::RequestResult::default()
        };
        // 8 requests: 1, 1, 2, 4 (exactly the speed shares), then one more on worker 1.
        let mut results: Vec<_> = ["1", "2", "3", "3", "4", "4", "4", "4"]
            .iter()
            .map(|w| result(w))
            .collect();
        let stats = RunStats {
            results: results.clone(),
            ..RunStats::default()
        };
        let r = ArmRun::measure("w", "kv", 1, &fleet, &stats);
        assert!((r.balance() - 1.0).abs() < 1e-9, "{:?}", r.share_over_speed);
        results.push(result("1"));
        let stats = RunStats {
            results,
            ..RunStats::default()
        };
        let r = ArmRun::measure("w", "kv", 1, &fleet, &stats);
        // Worker 1: 2 of 9 requests against 1/8 of the speed.
        assert!((r.balance() - (2.0 / 9.0) / (1.0 / 8.0)).abs() < 1e-9);
        assert_eq!(r.req_max, 4);
        // A uniform fleet: max/mean.
        let r = ArmRun::measure("w", "kv", 1, &Fleet::new(4, 64, &[]), &stats);
        assert!((r.balance() - 4.0 / (9.0 / 4.0)).abs() < 1e-9);
    }

    #[test]
    fn every_workload_prepares_at_a_small_scale() {
        let dir = std::env::temp_dir().join(format!("race-test-{}", std::process::id()));
        let trace = dir.join("trace.jsonl");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            &trace,
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 3000, \"input_length\": 100, \"output_length\": 2, \"hash_ids\": [0]}\n",
        )
        .unwrap();
        let opts = RaceOptions {
            scale: 0.05,
            out: dir.clone(),
            synthetic_trace: trace,
            ..RaceOptions::default()
        };
        for name in WORKLOADS.iter().chain(&EXTRA_WORKLOADS) {
            let name = *name;
            match prepare(name, &opts).unwrap() {
                Ok(w) => {
                    assert!(!w.workload.requests.is_empty(), "{name}");
                    assert!(!w.description.is_empty(), "{name}");
                    assert_eq!(w.workload.is_chat(), name == "chat-text", "{name}");
                    assert_eq!(
                        !w.fleet.speedups.is_empty(),
                        name == "agent-mixed",
                        "{name}"
                    );
                }
                Err(why) => assert_eq!(name, "vllm", "{why}"),
            }
        }
        let missing = RaceOptions {
            synthetic_trace: dir.join("nope.jsonl"),
            ..opts
        };
        let why = prepare("synthetic", &missing).unwrap().err().unwrap();
        assert!(why.contains("Mooncake"), "{why}");
        assert!(prepare("bogus", &missing).is_err());
        // A trace of one's own, on the fleet its spec names, scaled like the rest.
        let spec = format!(
            "mine={};workers=3;speedups=1,3;time_scale=2",
            missing.synthetic_trace.display()
        );
        let own = RaceOptions {
            scale: 0.5,
            trace_workloads: vec![TraceWorkload::parse(&spec).unwrap()],
            ..missing
        };
        assert!(
            prepare("mine", &own).is_err(),
            "a missing trace is an error"
        );
        let own = RaceOptions {
            trace_workloads: vec![TraceWorkload::parse(&spec.replace("nope", "trace")).unwrap()],
            ..own
        };
        let w = prepare("mine", &own).unwrap().unwrap();
        assert_eq!(
            w.workload.requests.len(),
            1,
            "half of the trace's two requests"
        );
        assert_eq!(
            (w.fleet.workers, &w.fleet.speedups[..]),
            (3, &[1.0, 3.0][..])
        );
        assert_eq!(w.fleet.worker_speedup(), 2.0);
        assert!(
            w.description.contains("first 1 of its 2 requests"),
            "{}",
            w.description
        );
        let whole = RaceOptions { scale: 3.0, ..own };
        let w = prepare("mine", &whole).unwrap().unwrap();
        assert_eq!(w.workload.requests.len(), 2, "the whole trace, no more");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
