//! A peer router as an arm of the comparison: vllm-router (`cache_aware`) in front of a fresh
//! fleet of engine-mode mock workers, driven by the same workload runner as the filter's modes.
//! Fails when vllm-router is not installed (`make setup` installs it).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

use std::time::{Duration, Instant};

use envoy_kv_router_tools::client;
use envoy_kv_router_tools::compare::{quality_table, run_mode, Fleet};
use envoy_kv_router_tools::harness::{Worker, ZMQ_PUBLISH_ARGS};
use envoy_kv_router_tools::loadgen::{synthetic, RunOptions, SyntheticSpec};
use envoy_kv_router_tools::peer::{
    require_vllm_router, vllm_router_policy, VllmRouter, VllmRouterOptions, PEER_WORKER_ARGS,
};
use serde_json::json;

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

#[test]
fn vllm_router_kv_aware_finds_a_prefix_the_mock_published() {
    require_vllm_router().expect("vllm-router is needed: run `make setup`");
    let mut args = vec!["--mode", "engine", "--block-size", "16", "--speedup", "20"];
    args.extend_from_slice(&ZMQ_PUBLISH_ARGS);
    args.extend_from_slice(&PEER_WORKER_ARGS);
    let workers = Worker::spawn_many(2, &args).unwrap();
    let opts = VllmRouterOptions {
        policy: "kv_aware".into(),
        block_size: 16,
        model: "m".into(),
        extra_args: Vec::new(),
    };
    let router = VllmRouter::start(&opts, &workers).unwrap();
    // A prompt's first request stores its 10 blocks on one worker; once that "stored" event is
    // in vllm-router's index, the same prompt's placement lookup is a hit. Before the events
    // were published under vLLM's (empty) topic, every lookup stayed a miss. A subscriber that
    // connects after a prompt's events were published never sees them (ZMQ's slow joiner), and
    // a cached prompt is not stored again: so each attempt sends a new prompt, then repeats it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sent = 0u32;
    for attempt in 0u32.. {
        assert!(
            Instant::now() < deadline,
            "no placement hit after {sent} requests:\n{}",
            router.log_tail(20)
        );
        let prompt: Vec<u32> = (0..160).map(|i| 1000 + attempt * 200 + i).collect();
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2});
        for _ in 0..2 {
            let reply = client::post_json(&router.addr, "/v1/completions", &body).unwrap();
            assert_eq!(reply.status, 200);
            sent += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        if router.placement_lookups().unwrap().0 >= 1.0 {
            break;
        }
    }
    assert!(sent >= 2, "the first request cannot hit: {sent}");
}
