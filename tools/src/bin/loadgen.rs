//! `loadgen`: replays a Mooncake trace or a synthetic shared-prefix workload against an
//! OpenAI-compatible endpoint (streamed `/v1/completions`, token-id prompts) and reports TTFT,
//! ITL, end-to-end latency, throughput, errors, achieved concurrency, its own CPU use and the
//! workers' cache hit rate and server-side TTFT.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{ArgGroup, Parser};
use envoy_kv_router_tools::compare::{
    compare_modes, quality_table, report_comparison, worker_arg, worker_kv_blocks, EventsVia, Fleet,
};
use envoy_kv_router_tools::loadgen::generate::{generate, write_trace, TraceLoad, WorkloadKind};
use envoy_kv_router_tools::loadgen::{
    chat, format_stats, load_mooncake, run_workload_on, synthetic, write_svg_chart, ChatSpec,
    ModelFit, RequestResult, RunOptions, RunStats, SyntheticSpec, Workload,
};
use envoy_kv_router_tools::quality::{
    affinity_table, credit_table, load_miss_table, time_beyond_compute_table,
};
use envoy_kv_router_tools::race::{
    race, RaceOptions, TraceWorkload, DEFAULT_ARMS, EXTRA_WORKLOADS, WORKLOADS,
};
use envoy_kv_router_tools::sys::raise_fd_limit;
use envoy_kv_router_tools::vllm::{self, EngineConfig};
use serde_json::Value;

#[derive(Debug, Parser)]
#[command(
    name = "loadgen",
    about = "Replays a Mooncake trace or a synthetic shared-prefix workload and measures it",
    group(ArgGroup::new("workload").required(true).args(["trace", "synthetic", "chat"])),
    group(ArgGroup::new("where").required(true).args(["target", "modes", "report_from"])),
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "SPEC: groups=G,prefix=P,isl=I,osl=O,requests=N,(rate=R|concurrency=C)[,seed=S]\n\
CHAT: conversations=C,turns=T,system_prompts=S,system_chars=X,user_chars=U,reply_chars=R,osl=O,\
(rate=Q|concurrency=N)[,seed=E]\n\
Text arms (--modes): kv+text (approximate mode: text prefix hashes and predicted blocks), \
kv+render (exact ids from a render service: an extra mock worker serving \
/v1/chat/completions/render), kv+ids (the same chat prompts sent as token ids: the baseline).\n\
Policy arms: kv+affinity[:R] (load-gated affinity), kv+ttft[+approx][+decay][+compute:W][+affinity[:T]][+fit|+fitmean] \
(the predicted-TTFT policy; +approx: predictions bridging the event lag; +decay: booked prefills \
decay; +compute:W: ttft.compute_weight W; +affinity[:T]: the load-gated affinity in front of it, \
max_extra_prefill_tokens T; +fit: the fleet's timing polynomials: quadratics fitted to the mock's \
step-time model (a roofline, no polynomial) divided by the workers' --speedup, \
or on real engines (--vllm-engines) measured on the first by `calibrate` before the arms; on a \
mixed fleet (--worker-speedups) each worker's own; +fitmean: one polynomial at the fleet's mean speedup; \
+prio[:A]: the filter writes each request's predicted prefill as its engine priority, arrival weight A; \
run the fleet with --worker-args \"--scheduling-policy priority\").\n\
--modes: start a fresh fleet of --fleet mock workers (engine mode, --worker-args; each with a \
kv-event-bridge fed over ZMQ unless --events-via http) and a fresh Envoy with the filter for \
each routing mode in turn, run the same workload through each, and \
print a side-by-side table (and --svg chart). The last line compares kv with round-robin.\n\
Peer arms: vllm-router:<policy> (cache_aware, power_of_two, round_robin, kv_aware, ...) puts \
vllm-router (.venv, `make setup`) in front of the fresh fleet instead of Envoy; kv_aware reads \
the workers' ZMQ KV events.\n\
Mooncake traces (JSON lines: timestamp, input_length, output_length, hash_ids): see \
github.com/kvcache-ai/Mooncake, FAST25-release/traces/.\n\
Subcommands: `loadgen gen-workload agent|conversation --seed S --out FILE [key=value ...]` writes a \
generated multi-turn workload as a Mooncake trace; `loadgen race` runs every workload through \
every arm R times and writes results.json, summary.md and TTFT charts (docs/RACE.md)."
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Where to send requests: IP:PORT, or several separated by commas (spread round-robin,
    /// e.g. a fleet of mock workers addressed directly).
    #[arg(long, value_delimiter = ',')]
    target: Vec<String>,
    /// Routing modes to compare, e.g. kv,round-robin,vllm-router:cache_aware (each on a fresh
    /// fleet and Envoy, or vllm-router for a `vllm-router:<policy>` arm).
    #[arg(long)]
    modes: Option<String>,
    /// Mock workers in the fleet of --modes.
    #[arg(long, default_value_t = 8)]
    fleet: u64,
    /// Real vLLM CPU engines (scripts/vllm/install.sh) as the fleet of --modes instead of
    /// mock workers: this many, started once, their prefix caches emptied before each arm. The
    /// workload is fitted to the tiny model (token ids in its vocabulary, prompts within
    /// --vllm-max-len); its block size is --block-size (a multiple of 32).
    #[arg(long)]
    vllm_engines: Option<u64>,
    /// KV blocks of each real engine (--num-gpu-blocks-override).
    #[arg(long, default_value_t = 256)]
    vllm_blocks: u32,
    /// --max-model-len of each real engine.
    #[arg(long, default_value_t = 2048)]
    vllm_max_len: u32,
    /// --max-num-seqs of each real engine.
    #[arg(long, default_value_t = 8)]
    vllm_max_num_seqs: u32,
    /// More arguments for each real engine, split on whitespace, e.g.
    /// "--scheduling-policy priority" for the `+prio` arms.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    vllm_args: String,
    /// Keep this many tokens of each 512-token block of a Mooncake trace (shorter prompts with
    /// the same sharing, e.g. for the tiny real model).
    #[arg(long)]
    trace_block_tokens: Option<usize>,
    /// Cap every request's output at this many tokens.
    #[arg(long)]
    max_output_tokens: Option<usize>,
    /// Extra mock-worker arguments for the fleet of --modes, e.g. '--kv-blocks 8192'.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    worker_args: String,
    /// A mixed fleet of mock workers (--modes): worker i runs at the i-th of these speedups
    /// (cycled), e.g. '1,3' for two GPU generations. Not with --speedup in --worker-args.
    #[arg(long, value_delimiter = ',')]
    worker_speedups: Vec<f64>,
    /// KV block size of the fleet and the filter (--modes).
    #[arg(long, default_value_t = 64)]
    block_size: u32,
    /// How the fleet's KV events reach the filter (--modes): a kv-event-bridge per worker fed
    /// over ZMQ (as with a real engine), or the mocks' own HTTP event pages.
    #[arg(long, value_enum, default_value_t = EventsVia::Bridge)]
    events_via: EventsVia,
    /// JSON merged into the filter configuration of every mode (--modes).
    #[arg(long)]
    filter_json: Option<String>,
    /// A Mooncake-format trace (JSON lines).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Divides the trace's timestamps (10 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// A synthetic shared-prefix workload (SPEC below).
    #[arg(long)]
    synthetic: Option<String>,
    /// A chat workload: multi-turn conversations with shared system prompts, sent as text
    /// `messages` to /v1/chat/completions (CHAT below).
    #[arg(long)]
    chat: Option<String>,
    /// Use at most this many requests of the workload.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Closed loop of N clients (each sends its next request when the last one ends),
    /// whatever the workload's own arrivals.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Closed loop: start the clients evenly over this many seconds.
    #[arg(long, default_value_t = 0.0)]
    ramp_up_s: f64,
    #[arg(long, default_value = MOCK_MODEL)]
    model: String,
    #[arg(long, default_value = "/v1/completions")]
    path: String,
    /// Connect timeout and idle timeout of each read, in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Cap on concurrent requests of a timed workload.
    #[arg(long, default_value_t = 2048)]
    max_in_flight: usize,
    /// Mock workers (IP:PORT,...) whose /metrics give the run's prefix-cache hit rate,
    /// server-side TTFT and CPU.
    #[arg(long, value_delimiter = ',')]
    workers: Vec<String>,
    /// Label of the run in the report.
    #[arg(long, default_value = "")]
    label: String,
    /// Write the summary as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a TTFT chart (SVG) here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write every request's measurements here, one JSON object a line (with --modes: every
    /// arm's, each line tagged with its "arm").
    #[arg(long)]
    requests_jsonl: Option<PathBuf>,
    /// Run nothing: print the affinity replay and the load-miss tables of a saved
    /// `--requests-jsonl` file of `--modes` (give the same workload and `--worker-args`).
    #[arg(long)]
    report_from: Option<PathBuf>,
    /// A filter build for arms tagged `<mode>@TAG` (repeatable; TAG=PATH to a .wasm), e.g. to
    /// compare a change against the build before it in one run.
    #[arg(long = "arm-wasm")]
    arm_wasm: Vec<String>,
    /// An extra request header 'name: value' (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// JSON object merged into every request body, e.g. '{"mock": {"chunks": 20}}'.
    #[arg(long)]
    body_json: Option<String>,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Writes a generated multi-turn workload (deterministic from --seed) as Mooncake-format
    /// JSON lines for --trace, and prints its pace and offered load.
    GenWorkload(GenWorkloadArgs),
    /// Every workload x arm, each arm on a fresh fleet, --runs times: medians against the
    /// targets in OUT/results.json, OUT/summary.md and `OUT/ttft-<workload>.svg` (docs/RACE.md).
    Race(RaceArgs),
    /// The race's workloads (or --trace) in virtual time: the filter's request path in front of
    /// the mock's engine model, no processes, deterministic (docs/RACE.md, "The simulator").
    Sim(SimArgs),
}

#[derive(Debug, clap::Args)]
struct SimArgs {
    /// Race workloads to run (default: every mock workload the simulator can run).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// A Mooncake-format trace instead, on --fleet workers with --worker-args / --worker-speedups.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// A synthetic workload instead (the spec of `loadgen --synthetic`, e.g. a burst workload of
    /// another seed than the race's), on the same fleet options as --trace.
    #[arg(long, conflicts_with = "trace")]
    synthetic: Option<String>,
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    #[arg(long, default_value_t = 8)]
    fleet: u64,
    #[arg(
        long,
        default_value = "--kv-blocks 8192 --speedup 2",
        allow_hyphen_values = true
    )]
    worker_args: String,
    #[arg(long, value_delimiter = ',')]
    worker_speedups: Vec<f64>,
    #[arg(long, default_value_t = 64)]
    block_size: u32,
    /// Arms: round-robin, kv, kv+set:<a.b>=<value>[+set:...], each with an optional *N (Envoys).
    #[arg(long, value_delimiter = ',', default_value = "kv,round-robin")]
    arms: Vec<String>,
    /// Fraction of every race workload's sessions (or requests).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Where generated race workloads are written.
    #[arg(long, default_value = "target/sim")]
    out: PathBuf,
    #[arg(long, default_value = "bench-data/mooncake_synthetic_trace.jsonl")]
    synthetic_trace: PathBuf,
    /// From an engine's KV event to every Envoy's index (ms).
    #[arg(long, default_value_t = 3.0)]
    event_delay_ms: f64,
    /// How often the bridge scrapes each engine's load (ms).
    #[arg(long, default_value_t = 1000.0)]
    scrape_interval_ms: f64,
    /// Runs of every arm, each with other engine jitter (the table gives their means).
    #[arg(long, default_value_t = 3)]
    runs: u64,
    /// The Envoys of `*N` arms share one shared data (an upper bound for replicas).
    #[arg(long)]
    replicas_share_data: bool,
    /// Bridges that do not relay the Envoys' bookings to each other (before they did).
    #[arg(long)]
    no_relay: bool,
    /// Also run every engine forward at each arrival and print how much later, on average, the
    /// filter's choice gives the first token than the best worker would (slow).
    #[arg(long)]
    probe_regret: bool,
    /// With `--probe-regret`: write each decision (forecast per worker, the filter's costs and
    /// load view) as JSON lines to this file (the last arm's last run).
    #[arg(long)]
    decisions: Option<std::path::PathBuf>,
    /// Tell every Envoy each worker's true speed (its learned factors replaced): what the
    /// learning could at best give.
    #[arg(long)]
    true_speeds: bool,
}

#[derive(Debug, clap::Args)]
struct GenWorkloadArgs {
    /// agent: tool-agent sessions; conversation: multi-turn chat.
    #[arg(value_enum)]
    kind: WorkloadKind,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The trace to write (JSON lines).
    #[arg(long)]
    out: PathBuf,
    /// Overrides of the kind's defaults, key=value (separate or comma-separated; docs/RACE.md
    /// lists the keys), e.g. sessions=100 session_rate=2.
    params: Vec<String>,
    /// The fleet the printed offered load is for: workers ...
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// ... at this --speedup ...
    #[arg(long, default_value_t = 2.0)]
    speedup: f64,
    /// ... replaying at this --time-scale.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
}

#[derive(Debug, clap::Args)]
struct RaceArgs {
    /// Runs of every arm on every workload (the summary takes the medians).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Workloads to run, in this order (default: all).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Arms (default: kv, round-robin and vllm-router's cache_aware, kv_aware, power_of_two).
    #[arg(long, value_delimiter = ',')]
    arms: Vec<String>,
    /// More arms after --arms, e.g. kv+ttft+approx+compute:4+decay+fit.
    #[arg(long, value_delimiter = ',')]
    extra_arms: Vec<String>,
    /// The arm the targets judge.
    #[arg(long, default_value = "kv")]
    candidate: String,
    /// Fraction of every workload's sessions (or requests), at the same pace: 0.2 for a quick pass.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Output directory.
    #[arg(long, default_value = "target/race")]
    out: PathBuf,
    /// The Mooncake synthetic trace (the `synthetic` workload is skipped without it).
    #[arg(long, default_value = "bench-data/mooncake_synthetic_trace.jsonl")]
    synthetic_trace: PathBuf,
    /// Prepare and describe the workloads (sizes, pace, offered load), run nothing.
    #[arg(long)]
    dry_run: bool,
    /// Fewer progress lines.
    #[arg(long)]
    quiet: bool,
    /// A filter build for the arms tagged TAG (`kv@TAG`, `kv*3@TAG`), repeatable: TAG=PATH.
    #[arg(long = "arm-wasm")]
    arm_wasm: Vec<String>,
    /// Your own Mooncake-format trace as workload NAME, on a mock fleet described by keys,
    /// repeatable: `NAME=PATH[;key=value...]`, keys workers, block_size, worker_args, speedups
    /// (comma-separated, one per worker, cycled), time_scale; e.g.
    /// 'mine=prod.jsonl;workers=12;speedups=1,3'. Without --workloads only these run.
    #[arg(long = "trace-workload")]
    trace_workload: Vec<String>,
}

fn gen_workload(a: &GenWorkloadArgs) {
    let (trace, described) = generate(a.kind, a.seed, &a.params).unwrap_or_else(|e| fail(&e));
    if let Err(e) = write_trace(&a.out, &trace) {
        fail(&e.to_string());
    }
    eprintln!(
        "loadgen: wrote {} ({} {described})",
        a.out.display(),
        a.kind.name()
    );
    let load = TraceLoad::of(&trace, a.workers, a.speedup, a.time_scale);
    eprint!("{}", load.report(a.workers, a.speedup));
}

fn run_sim(a: &SimArgs) {
    use envoy_kv_router_tools::sim;
    let opts = sim::SimOptions {
        event_delay_ms: a.event_delay_ms,
        scrape_interval_ms: a.scrape_interval_ms,
        seed: 0,
        replicas_share_data: a.replicas_share_data,
        relay_bookings: !a.no_relay,
        probe_regret: a.probe_regret,
        true_speeds: a.true_speeds,
    };
    let routers: Vec<(String, sim::Router)> = a
        .arms
        .iter()
        .filter(|m| !m.is_empty())
        .map(|m| (m.clone(), sim::arm_router(m).unwrap_or_else(|e| fail(&e))))
        .collect();
    let mut jobs: Vec<(String, Workload, Fleet)> = Vec::new();
    let given = match (&a.trace, &a.synthetic) {
        (Some(path), _) => Some((
            path.display().to_string(),
            load_mooncake(path, a.time_scale, None).unwrap_or_else(|e| fail(&e.to_string())),
        )),
        (None, Some(spec)) => Some((
            format!("synthetic {spec}"),
            synthetic(&SyntheticSpec::parse(spec).unwrap_or_else(|e| fail(&e))),
        )),
        (None, None) => None,
    };
    if let Some((name, workload)) = given {
        let mut fleet = Fleet::new(
            a.fleet,
            a.block_size,
            &a.worker_args.split_whitespace().collect::<Vec<_>>(),
        );
        fleet.speedups = a.worker_speedups.clone();
        jobs.push((name, workload, fleet));
    } else {
        let names: Vec<String> = if a.workloads.is_empty() {
            [
                "synthetic",
                "conversation",
                "chat-text",
                "agent",
                "agent-mixed",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect()
        } else {
            a.workloads.clone()
        };
        let race_opts = RaceOptions {
            scale: a.scale,
            out: a.out.clone(),
            synthetic_trace: a.synthetic_trace.clone(),
            quiet: true,
            ..RaceOptions::default()
        };
        for name in names.iter().filter(|n| !n.is_empty()) {
            match envoy_kv_router_tools::race::prepare(name, &race_opts) {
                Ok(Ok(w)) if w.fleet.vllm.is_none() => jobs.push((w.name, w.workload, w.fleet)),
                Ok(Ok(_)) => eprintln!("sim: {name}: real engines are not simulated; skipped"),
                Ok(Err(why)) => eprintln!("sim: {name}: skipped: {why}"),
                Err(e) => fail(&format!("sim: {name}: {e}")),
            }
        }
    }
    for (name, workload, fleet) in &jobs {
        println!(
            "## {name}: {} requests, {} workers",
            workload.requests.len(),
            fleet.workers
        );
        let mut rows = Vec::new();
        for (arm, router) in &routers {
            let started = std::time::Instant::now();
            let runs: Vec<sim::SimRun> = (0..a.runs.max(1))
                .map(|seed| {
                    let opts = sim::SimOptions { seed, ..opts };
                    sim::simulate(workload, fleet, router, &opts)
                        .unwrap_or_else(|e| fail(&format!("sim: {name} {arm}: {e}")))
                })
                .collect();
            eprintln!(
                "sim: {name} {arm}: {:.1} s",
                started.elapsed().as_secs_f64()
            );
            if let (Some(file), Some(run)) = (&a.decisions, runs.last()) {
                let mut text = run.decisions.join("\n");
                text.push('\n');
                if let Err(e) = std::fs::write(file, text) {
                    fail(&format!("sim: {}: {e}", file.display()));
                }
            }
            for (seed, run) in runs.iter().enumerate() {
                if !run.regret_ms.is_empty() {
                    let n = run.regret_ms.len() as f64;
                    let regret = run.regret_ms.iter().sum::<f64>() / n;
                    let best = run.oracle_best_ms.iter().sum::<f64>() / n;
                    let missed = run.regret_ms.iter().filter(|r| **r > 1.0).count();
                    eprintln!(
                        "sim: {name} {arm} run {seed}: regret {regret:.1} ms a request (best alone {best:.1} ms), {missed} of {n} choices > 1 ms late"
                    );
                }
                for (e, f) in run.factors.iter().enumerate() {
                    let text: Vec<String> =
                        f.iter().map(|x| format!("{:.0}", x * 1000.0)).collect();
                    eprintln!(
                        "sim: {name} {arm} run {seed} envoy {e} factors x1000: {}",
                        text.join(" ")
                    );
                }
            }
            rows.push((arm.clone(), sim::Summary::of(&runs)));
        }
        println!("{}", sim::table(&rows));
    }
}

fn run_race(a: &RaceArgs) {
    if a.runs == 0 {
        fail("race: --runs must be at least 1");
    }
    if !(a.scale.is_finite() && a.scale > 0.0) {
        fail("race: --scale must be > 0");
    }
    let trace_workloads: Vec<TraceWorkload> = a
        .trace_workload
        .iter()
        .map(|spec| TraceWorkload::parse(spec).unwrap_or_else(|e| fail(&format!("race: {e}"))))
        .collect();
    if let Some((i, t)) = trace_workloads
        .iter()
        .enumerate()
        .find(|(i, t)| trace_workloads[..*i].iter().any(|u| u.name == t.name))
    {
        fail(&format!(
            "race: --trace-workload {:?} given twice (#{})",
            t.name,
            i + 1
        ));
    }
    let workloads: Vec<String> = if a.workloads.is_empty() && !trace_workloads.is_empty() {
        trace_workloads.iter().map(|t| t.name.clone()).collect()
    } else if a.workloads.is_empty() {
        WORKLOADS.iter().map(|s| s.to_string()).collect()
    } else {
        a.workloads
            .iter()
            .filter(|w| !w.is_empty())
            .cloned()
            .collect()
    };
    let known = |w: &str| {
        WORKLOADS.contains(&w)
            || EXTRA_WORKLOADS.contains(&w)
            || trace_workloads.iter().any(|t| t.name == w)
    };
    if let Some(w) = workloads.iter().find(|w| !known(w.as_str())) {
        fail(&format!(
            "race: unknown workload {w:?} (known: {},{})",
            WORKLOADS.join(","),
            EXTRA_WORKLOADS.join(",")
        ));
    }
    let mut arms: Vec<String> = if a.arms.is_empty() {
        DEFAULT_ARMS.iter().map(|s| s.to_string()).collect()
    } else {
        a.arms.iter().filter(|m| !m.is_empty()).cloned().collect()
    };
    for extra in a.extra_arms.iter().filter(|m| !m.is_empty()) {
        if !arms.contains(extra) {
            arms.push(extra.clone());
        }
    }
    if !arms.contains(&a.candidate) {
        fail(&format!(
            "race: the candidate {:?} is not among the arms",
            a.candidate
        ));
    }
    let opts = RaceOptions {
        runs: a.runs,
        workloads,
        arms,
        candidate: a.candidate.clone(),
        scale: a.scale,
        out: a.out.clone(),
        synthetic_trace: a.synthetic_trace.clone(),
        dry_run: a.dry_run,
        quiet: a.quiet,
        arm_wasm: a
            .arm_wasm
            .iter()
            .map(|spec| match spec.split_once('=') {
                Some((tag, path)) if !tag.is_empty() => (tag.to_string(), PathBuf::from(path)),
                _ => fail(&format!("--arm-wasm {spec}: expected TAG=PATH")),
            })
            .collect(),
        trace_workloads,
    };
    if let Err(e) = race(&opts) {
        fail(&format!("race: {e}"));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("loadgen: {msg}");
    std::process::exit(2);
}

fn positive_secs(flag: &str, s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_else(|_| fail(&format!("{flag}: bad duration {s}")))
}

fn run_options(args: &Args) -> RunOptions {
    let mut opts = RunOptions {
        model: args.model.clone(),
        path: args.path.clone(),
        timeout: positive_secs("--timeout-s", args.timeout_s),
        max_in_flight: args.max_in_flight,
        concurrency: args.concurrency,
        ramp_up: positive_secs("--ramp-up-s", args.ramp_up_s),
        worker_addrs: args
            .workers
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect(),
        label: args.label.clone(),
        ..RunOptions::default()
    };
    if args.quiet {
        opts.progress_every = None;
    }
    for h in &args.headers {
        match h.split_once(':') {
            Some((k, v)) => opts
                .extra_headers
                .push((k.trim().to_string(), v.trim().to_string())),
            None => fail("--header expects 'name: value'"),
        }
    }
    if let Some(body) = &args.body_json {
        let v: Value =
            serde_json::from_str(body).unwrap_or_else(|e| fail(&format!("--body-json: {e}")));
        if !v.is_object() {
            fail("--body-json must be a JSON object");
        }
        opts.extra_body = Some(v);
    }
    if args.vllm_engines.is_some() {
        if args.model == MOCK_MODEL {
            opts.model = vllm::MODEL.to_string();
        }
        // The tiny model's random weights end outputs early at random: every request runs its
        // full --max-output-tokens instead, as the workload says.
        let body = opts.extra_body.get_or_insert_with(|| serde_json::json!({}));
        if let Some(o) = body.as_object_mut() {
            o.entry("ignore_eos").or_insert(Value::Bool(true));
        }
    }
    opts
}

/// `--model`'s default: the mock workers' model name.
const MOCK_MODEL: &str = "mock-model";

fn main() {
    let args = Args::parse();
    match &args.command {
        Some(Command::GenWorkload(a)) => return gen_workload(a),
        Some(Command::Sim(a)) => return run_sim(a),
        Some(Command::Race(a)) => {
            if let Err(e) = raise_fd_limit() {
                eprintln!("loadgen: cannot raise the open-file limit: {e}");
            }
            return run_race(a);
        }
        None => {}
    }
    match raise_fd_limit() {
        Ok(limit) => {
            let want = args.concurrency.unwrap_or(args.max_in_flight) as u64 + 64;
            if limit < want {
                eprintln!(
                    "loadgen: the open-file limit is {limit}; {want} connections may fail (raise the hard limit: ulimit -Hn)"
                );
            }
        }
        Err(e) => eprintln!("loadgen: cannot raise the open-file limit: {e}"),
    }
    let mut opts = run_options(&args);
    let mut workload = if let Some(path) = &args.trace {
        load_mooncake(path, args.time_scale, args.max_requests)
            .unwrap_or_else(|e| fail(&e.to_string()))
    } else if let Some(spec) = &args.chat {
        let mut spec = ChatSpec::parse(spec).unwrap_or_else(|e| fail(&e));
        if let Some(m) = args.max_requests {
            spec.conversations = spec.conversations.min(m.div_ceil(spec.turns));
        }
        chat(&spec)
    } else {
        let spec = args.synthetic.as_deref().unwrap_or_default();
        let mut spec = SyntheticSpec::parse(spec).unwrap_or_else(|e| fail(&e));
        if let Some(m) = args.max_requests {
            spec.requests = spec.requests.min(m);
        }
        synthetic(&spec)
    };
    workload.fit(&ModelFit {
        trace_block_tokens: args.trace_block_tokens,
        vocab: args.vllm_engines.map(|_| vllm::VOCAB),
        // Room for the output within the engine's context.
        max_prompt_tokens: args.vllm_engines.map(|_| {
            let out = args.max_output_tokens.unwrap_or(64);
            (args.vllm_max_len as usize).saturating_sub(out + 1)
        }),
        max_output_tokens: args.max_output_tokens,
    });
    if let Some(path) = &args.report_from {
        let results = load_arm_results(path).unwrap_or_else(|e| fail(&e));
        print_routing_diagnostics(&results, &workload, &args);
        return;
    }
    if workload.is_chat() && opts.path == "/v1/completions" {
        opts.path = "/v1/chat/completions".to_string();
    }
    if let Some(modes) = &args.modes {
        let mut fleet = Fleet::new(
            args.fleet,
            args.block_size,
            &args.worker_args.split_whitespace().collect::<Vec<_>>(),
        );
        fleet.events_via = args.events_via;
        if !args.worker_speedups.is_empty() {
            if args
                .worker_speedups
                .iter()
                .any(|v| !(v.is_finite() && *v > 0.0))
            {
                fail("--worker-speedups: every speedup must be finite and > 0");
            }
            if worker_arg::<String>(&fleet.worker_args, "--speedup").is_some() {
                fail(
                    "--worker-speedups sets each worker's --speedup: remove it from --worker-args",
                );
            }
            if args.vllm_engines.is_some() {
                fail("--worker-speedups is for mock fleets, not --vllm-engines");
            }
            fleet.speedups = args.worker_speedups.clone();
        }
        if args.vllm_engines.is_none() && !args.vllm_args.trim().is_empty() {
            fail("--vllm-args is for --vllm-engines (mock workers take --worker-args)");
        }
        if let Some(n) = args.vllm_engines {
            // vLLM refuses to start unless one request of the full context fits in its cache
            // beside a spare block.
            let room = u64::from(args.vllm_blocks.saturating_sub(1)) * u64::from(args.block_size);
            if u64::from(args.vllm_max_len) > room {
                fail(&format!(
                    "--vllm-max-len {} does not fit --vllm-blocks {} of {} tokens (at most {room})",
                    args.vllm_max_len, args.vllm_blocks, args.block_size
                ));
            }
            fleet.workers = n;
            fleet.vllm = Some(EngineConfig {
                block_size: args.block_size,
                max_len: args.vllm_max_len,
                num_blocks: Some(args.vllm_blocks),
                max_num_seqs: args.vllm_max_num_seqs,
                extra_args: args
                    .vllm_args
                    .split_whitespace()
                    .map(String::from)
                    .collect(),
                ..EngineConfig::default()
            });
        }
        for spec in &args.arm_wasm {
            let Some((tag, path)) = spec.split_once('=') else {
                fail(&format!("--arm-wasm {spec}: expected TAG=PATH"));
            };
            fleet.arm_wasm.push((tag.to_string(), PathBuf::from(path)));
        }
        if let Some(extra) = &args.filter_json {
            fleet.filter_extra = serde_json::from_str(extra)
                .unwrap_or_else(|e| fail(&format!("--filter-json: {e}")));
        }
        // The per-request decision headers feed the "why" of the affinity replay.
        if let Some(extra) = fleet.filter_extra.as_object_mut() {
            extra.entry("response_headers").or_insert(Value::Bool(true));
        }
        let modes: Vec<&str> = modes.split(',').filter(|m| !m.is_empty()).collect();
        let results = compare_modes(&modes, &fleet, &workload, &opts)
            .unwrap_or_else(|e| fail(&e.to_string()));
        report_comparison(&results, args.svg.as_deref(), args.json.as_deref());
        if let Some(p) = &args.requests_jsonl {
            // Every arm's requests in one file, each line tagged with its arm.
            let mut lines = String::new();
            for (arm, stats) in &results {
                for r in &stats.results {
                    let mut v = serde_json::to_value(r).unwrap_or_default();
                    if let Some(o) = v.as_object_mut() {
                        o.insert("arm".to_string(), Value::String(arm.clone()));
                    }
                    lines.push_str(&v.to_string());
                    lines.push('\n');
                }
            }
            if let Err(e) = std::fs::write(p, lines) {
                eprintln!("loadgen: cannot write {}: {e}", p.display());
            }
        }
        print!("{}", quality_table(&results, fleet_size(&args)));
        print_routing_diagnostics(&results, &workload, &args);
        return;
    }
    let targets: Vec<String> = args
        .target
        .iter()
        .filter(|t| !t.is_empty())
        .cloned()
        .collect();
    if targets.is_empty() {
        fail("--target needs at least one IP:PORT");
    }
    eprintln!(
        "loadgen: {} requests ({}) -> {}",
        workload.requests.len(),
        workload.name,
        targets.join(",")
    );
    let stats = run_workload_on(&targets, &workload, &opts);
    let label = if opts.label.is_empty() {
        "run"
    } else {
        opts.label.as_str()
    };
    print!("{}", format_stats(label, &stats));
    if let Some(p) = &args.json {
        let body = serde_json::to_string_pretty(&stats.summary_json()).unwrap_or_default();
        if let Err(e) = std::fs::write(p, body) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
        }
    }
    if let Some(p) = &args.requests_jsonl {
        let mut lines = String::new();
        for r in &stats.results {
            lines.push_str(&serde_json::to_string(r).unwrap_or_default());
            lines.push('\n');
        }
        if let Err(e) = std::fs::write(p, lines) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
        }
    }
    if let Some(p) = &args.svg {
        if let Err(e) = write_svg_chart(p, &[(label, stats.clone())]) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
        }
    }
    if stats.completed() == 0 {
        std::process::exit(1);
    }
}

/// Workers in the fleet of --modes: real engines or mock workers.
fn fleet_size(args: &Args) -> u64 {
    args.vllm_engines.unwrap_or(args.fleet)
}

/// The affinity replay (unbounded, then with the workers' caches modelled at their capacity, so
/// a max-overlap worker is one that still holds the prefix) and the filter's load misses.
fn print_routing_diagnostics(results: &[(String, RunStats)], workload: &Workload, args: &Args) {
    let workers = usize::try_from(fleet_size(args)).unwrap_or(usize::MAX);
    print!(
        "{}",
        affinity_table(results, workload, args.block_size, None, workers)
    );
    let words: Vec<&str> = args.worker_args.split_whitespace().collect();
    let capacity = match args.vllm_engines {
        Some(_) => args.vllm_blocks as usize,
        None => worker_kv_blocks(&words) as usize,
    };
    print!(
        "{}",
        affinity_table(results, workload, args.block_size, Some(capacity), workers)
    );
    print!("{}", load_miss_table(results, args.block_size));
    print!("{}", credit_table(results, args.block_size));
    // Mock engines of one speed only: their step-time model prices "alone".
    if args.vllm_engines.is_none() && args.worker_speedups.is_empty() {
        let speedup = worker_arg::<f64>(&words, "--speedup").unwrap_or(1.0);
        let chunk = worker_arg::<f64>(&words, "--max-batched-tokens").unwrap_or(8192.0);
        print!("{}", time_beyond_compute_table(results, speedup, chunk));
    }
}

/// A `--requests-jsonl` file of `--modes`: every arm's requests, arms in file order.
fn load_arm_results(path: &Path) -> Result<Vec<(String, RunStats)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut arms: Vec<(String, RunStats)> = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |e: String| format!("{}:{}: {e}", path.display(), n + 1);
        let v: Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let arm = v
            .get("arm")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no \"arm\" (not a --modes file?)".into()))?
            .to_string();
        let r: RequestResult = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
        match arms.iter_mut().find(|(a, _)| *a == arm) {
            Some((_, stats)) => stats.results.push(r),
            None => arms.push((
                arm,
                RunStats {
                    results: vec![r],
                    ..RunStats::default()
                },
            )),
        }
    }
    Ok(arms)
}
