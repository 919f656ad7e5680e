//! `make demo`: Envoy with the filter in front of 4 mock vLLM-like workers on loopback, whose KV
//! events reach the filter as a real engine's do (mock -> ZMQ -> kv-event-bridge -> filter). The same
//! shared-prefix workload runs through KV routing and through round-robin, each on a fresh
//! fleet; the table and a TTFT chart (bench-out/demo-ttft.svg) compare them. Ctrl-C stops
//! everything (the workers and Envoy share the terminal's process group).

use std::path::PathBuf;

use clap::Parser;
use envoy_kv_router_tools::compare::{compare_modes, report_comparison, EventsVia, Fleet};
use envoy_kv_router_tools::harness::workspace_root;
use envoy_kv_router_tools::loadgen::{synthetic, RunOptions, SyntheticSpec};

/// 16 conversations sharing 8k-token prefixes plus 2k-token suffixes. Each worker caches 1024
/// blocks of 64 tokens (64k tokens): about 4 of the 16 prefixes. KV routing keeps each prefix on
/// one worker; round-robin makes every worker cycle through all 16 and evict them.
const DEFAULT_SPEC: &str = "groups=16,prefix=8192,isl=10240,osl=32,requests=320,rate=6,seed=7";

#[derive(Debug, Parser)]
#[command(
    name = "demo",
    about = "KV routing vs round-robin through Envoy and the filter, on a fleet of mock workers"
)]
struct Args {
    /// The synthetic workload (see `loadgen --help`).
    #[arg(long, default_value = DEFAULT_SPEC)]
    synthetic: String,
    /// Mock workers in the fleet.
    #[arg(long, default_value_t = 4)]
    fleet: u64,
    /// Extra mock-worker arguments.
    #[arg(
        long,
        default_value = "--kv-blocks 1024 --speedup 2",
        allow_hyphen_values = true
    )]
    worker_args: String,
    /// Routing modes to compare, in order.
    #[arg(long, default_value = "kv,round-robin")]
    modes: String,
    /// How the workers' KV events reach the filter: through a kv-event-bridge per worker (ZMQ,
    /// as with a real engine), or from the mocks' own HTTP event pages.
    #[arg(long, value_enum, default_value_t = EventsVia::Bridge)]
    events_via: EventsVia,
    /// Where the chart and the JSON summary go (default: bench-out/ in the workspace).
    #[arg(long)]
    out_dir: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let workload = match SyntheticSpec::parse(&args.synthetic) {
        Ok(spec) => synthetic(&spec),
        Err(e) => {
            eprintln!("demo: bad workload spec: {e}");
            std::process::exit(2);
        }
    };
    let worker_args: Vec<&str> = args.worker_args.split_whitespace().collect();
    let mut fleet = Fleet::new(args.fleet, 64, &worker_args);
    fleet.events_via = args.events_via;
    let modes: Vec<&str> = args.modes.split(',').filter(|m| !m.is_empty()).collect();
    println!(
        "demo: {} mock workers, workload {}, modes {}",
        args.fleet,
        args.synthetic,
        modes.join(" then ")
    );
    let results = match compare_modes(&modes, &fleet, &workload, &RunOptions::default()) {
        Ok(results) => results,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(1);
        }
    };
    let out = args
        .out_dir
        .unwrap_or_else(|| workspace_root().join("bench-out"));
    report_comparison(
        &results,
        Some(&out.join("demo-ttft.svg")),
        Some(&out.join("demo.json")),
    );
}
