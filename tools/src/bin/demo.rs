//! `make demo`: Envoy with the filter in front of 4 mock vLLM-like workers on loopback. The same
//! shared-prefix workload runs through KV routing and through round-robin, each on a fresh
//! fleet; the table and a TTFT chart (bench-out/demo-ttft.svg) compare them. Ctrl-C stops
//! everything (the workers and Envoy share the terminal's process group).

use envoy_kv_router_tools::compare::{compare_modes, report_comparison, Fleet};
use envoy_kv_router_tools::harness::workspace_root;
use envoy_kv_router_tools::loadgen::{synthetic, RunOptions, SyntheticSpec};

fn main() {
    // 16 conversations sharing 8k-token prefixes plus 2k-token suffixes. Each worker caches 1024
    // blocks of 64 tokens (64k tokens): about 4 of the 16 prefixes. KV routing keeps each prefix on
    // one worker; round-robin makes every worker cycle through all 16 and evict them.
    let spec = "groups=16,prefix=8192,isl=10240,osl=32,requests=320,rate=6,seed=7";
    let workload = match SyntheticSpec::parse(spec) {
        Ok(spec) => synthetic(&spec),
        Err(e) => {
            eprintln!("demo: bad workload spec: {e}");
            std::process::exit(2);
        }
    };
    let fleet = Fleet::new(4, 64, &["--kv-blocks", "1024", "--speedup", "2"]);
    println!("demo: 4 mock workers, workload {spec}, modes kv then round-robin");
    let results = match compare_modes(
        &["kv", "round-robin"],
        &fleet,
        &workload,
        &RunOptions::default(),
    ) {
        Ok(results) => results,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(1);
        }
    };
    let out = workspace_root().join("bench-out");
    report_comparison(
        &results,
        Some(&out.join("demo-ttft.svg")),
        Some(&out.join("demo.json")),
    );
}
