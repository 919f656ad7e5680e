//! The comparison harness on real engines (`loadgen --vllm-engines`): two vLLM CPU engines
//! started once, then our filter twice and vllm-router's `kv_aware` on them, one after another.
//!
//! What a user of the comparison relies on: every arm starts from empty engine caches (else a
//! later arm would inherit the earlier ones' hits), the hit rate is the engines' own, and requests
//! per engine are counted for peers whose responses name no engine.
//!
//! The workload makes a leftover cache plain: 16 requests, one at a time, over 8 groups whose
//! 11-block (352-token) prefix is all but the last block of each 384-token prompt. From empty
//! caches only a group's repeats can hit, so the engines' hit rate is exactly
//! `repeats x 352 / (16 x 384)` when each repeat goes to the engine that served its group;
//! with the caches of an earlier arm every request would hit.
//!
//! Needs `scripts/vllm/install.sh` and vllm-router (`make setup`); fails, never skips, without.
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)] // test code: a failed expectation is the assertion

use std::collections::HashSet;
use std::time::Duration;

use envoy_kv_router_tools::compare::{compare_modes, Fleet};
use envoy_kv_router_tools::loadgen::{synthetic, ModelFit, RunOptions, SyntheticSpec};
use envoy_kv_router_tools::vllm::{require_vllm, EngineConfig, MODEL, VOCAB};
use serde_json::json;

const PREFIX: usize = 352;
const PROMPT: usize = 384;
const REQUESTS: usize = 16;

#[test]
fn every_arm_starts_from_empty_engine_caches() {
    require_vllm().unwrap_or_else(|e| panic!("{e}"));
    let spec = SyntheticSpec::parse(&format!(
        "groups=8,prefix={PREFIX},isl={PROMPT},osl=2,requests={REQUESTS},concurrency=1,seed=7"
    ))
    .unwrap();
    let mut workload = synthetic(&spec);
    workload.fit(&ModelFit {
        trace_block_tokens: None,
        vocab: Some(VOCAB),
        max_prompt_tokens: None,
        max_output_tokens: None,
    });
    let groups: HashSet<&[u32]> = workload
        .requests
        .iter()
        .map(|r| &r.tokens[..PREFIX])
        .collect();
    let repeats = REQUESTS - groups.len();
    assert!(
        repeats >= 4,
        "the seed gives {repeats} repeats: pick another"
    );
    let expected = (repeats * PREFIX) as f64 / (REQUESTS * PROMPT) as f64;

    let mut fleet = Fleet::new(2, 32, &[]);
    fleet.vllm = Some(EngineConfig {
        num_blocks: Some(128),
        ..EngineConfig::default()
    });
    let opts = RunOptions {
        model: MODEL.to_string(),
        extra_body: Some(json!({"ignore_eos": true})),
        progress_every: None,
        timeout: Duration::from_secs(60),
        ..RunOptions::default()
    };
    let arms = ["kv", "kv", "vllm-router:kv_aware"];
    let results = compare_modes(&arms, &fleet, &workload, &opts).expect("the comparison runs");

    for (arm, stats) in &results {
        assert_eq!(
            (stats.completed(), stats.errors()),
            (REQUESTS, 0),
            "{arm}: {:?}",
            stats.error_summary()
        );
        let per_engine: usize = stats.per_worker().iter().map(|(_, n)| n).sum();
        assert_eq!(per_engine, REQUESTS, "{arm}: {:?}", stats.per_worker());
    }
    for (n, (arm, stats)) in results.iter().take(2).enumerate() {
        let hit = stats
            .hit_rate()
            .expect("the engines' prefix-cache counters");
        // At most the cold-cache figure (a leftover cache would beat it); at least most of it
        // (a repeat can beat its group's events to the filter and miss).
        assert!(
            hit <= expected + 0.01 && hit >= 0.75 * expected,
            "{arm} (arm {n}): engines' hit rate {hit:.3}, cold-cache routing gives {expected:.3}"
        );
    }
}
