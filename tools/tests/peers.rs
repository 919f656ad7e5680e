//! A peer router as an arm of the comparison: vllm-router (`cache_aware`) in front of a fresh
//! fleet of engine-mode mock workers, driven by the same workload runner as the filter's modes.
//! Fails when vllm-router is not installed (`make setup` installs it).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

use std::time::Duration;

use envoy_kv_router_tools::compare::{quality_table, run_mode, Fleet};
use envoy_kv_router_tools::loadgen::{synthetic, RunOptions, SyntheticSpec};
use envoy_kv_router_tools::peer::{require_vllm_router, vllm_router_policy};

#[test]
fn arm_names_carry_the_policy() {
    assert_eq!(
        vllm_router_policy("vllm-router:cache_aware"),
        Some("cache_aware")
    );
    assert_eq!(vllm_router_policy("vllm-router:"), None);
    assert_eq!(vllm_router_policy("kv"), None);
    assert_eq!(vllm_router_policy("round-robin"), None);
}

#[test]
fn vllm_router_cache_aware_arm_serves_every_request_from_a_worker() {
    require_vllm_router().expect("vllm-router is needed: run `make setup`");
    let fleet = Fleet::new(3, 16, &["--speedup", "20", "--kv-blocks", "4096"]);
    fleet.check(&["vllm-router:cache_aware"]).unwrap();
    let spec = SyntheticSpec::parse("groups=3,prefix=256,isl=320,osl=4,requests=60,concurrency=6")
        .unwrap();
    let opts = RunOptions {
        progress_every: None,
        timeout: Duration::from_secs(30),
        ..RunOptions::default()
    };
    let stats = run_mode("vllm-router:cache_aware", &fleet, &synthetic(&spec), &opts).unwrap();

    assert_eq!(stats.errors(), 0, "{:?}", stats.error_summary());
    assert_eq!(stats.completed(), 60);
    // Every answer carries the id of the mock worker that served it (1..=3).
    let per_worker = stats.per_worker();
    assert!(
        per_worker
            .iter()
            .all(|(id, _)| ["1", "2", "3"].contains(&id.as_str())),
        "{per_worker:?}"
    );
    assert_eq!(per_worker.iter().map(|(_, n)| n).sum::<usize>(), 60);
    // The workers saw all 60 prompts (their /metrics count the prompt tokens).
    let cache = stats.cache().expect("the workers' /metrics were scraped");
    assert_eq!(cache.query_tokens, 60.0 * 320.0);
    // 3 shared prefixes of 256 tokens in 320-token prompts: most prompt tokens hit a cache
    // whichever worker each request goes to (at most 9 cold prefixes: 3 groups x 3 workers).
    let hit = stats.hit_rate().unwrap();
    assert!(hit > 0.6 && hit <= 0.8 + 1e-9, "hit rate {hit}");
    let table = quality_table(&[("vllm-router:cache_aware".into(), stats)], 3);
    let row = table
        .lines()
        .find(|l| l.starts_with("vllm-router:cache_aware "))
        .expect(&table);
    // done, err, then the mean of 60 requests over 3 workers.
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cells[1..3], ["60", "0"], "{row}");
    assert!(row.contains(" 20.0 "), "{row}");
}
