//! A `kv`-mode decision allocates nothing once the VM's buffers have grown: the candidates,
//! costs, scores and fallbacks are reused through `SelectorState` (`decide`, then `recycle`).
//! The counting allocator ([`crate::alloc_count`], per thread, so the test harness's own threads
//! do not count) measures `decide` over a thousand requests with the default policy and with the
//! seed's cost.
#![allow(clippy::unwrap_used, clippy::indexing_slicing)] // test code

use crate::config::Config;
use crate::learn::LearnedTimings;
use crate::load::SlotLoad;
use crate::request::{parse_request, Endpoint, Pin};
use crate::router::{decide, prompt_blocks, RouteInput, SelectorState};
use crate::types::Overlap;

/// Allocations per decision over `n` decisions of a 4k-token prompt on 64 workers, after a
/// warm-up, varying overlaps and load so that every decision picks and ranks anew.
fn allocations_per_decision(policy: &str, n: u64) -> (u64, usize) {
    let workers: Vec<String> = (1..=64)
        .map(|i| {
            format!(
                r#"{{"id": {i}, "address": "10.0.{}.{}:8000"}}"#,
                i / 200,
                i % 200
            )
        })
        .collect();
    let json = format!(
        r#"{{"policy": "{policy}", "block_size": 16, "fallback_count": 2, "workers": [{}]}}"#,
        workers.join(",")
    );
    let config = Config::from_json(json.as_bytes()).unwrap();
    let ids: Vec<String> = (0..4096).map(|i| i.to_string()).collect();
    let body = format!(r#"{{"prompt": [{}], "max_tokens": 16}}"#, ids.join(","));
    let request = parse_request(body.as_bytes(), Endpoint::Completions).unwrap();
    let mut learned = LearnedTimings::default();
    learned.resize(64);
    let mut overlaps = vec![Overlap::default(); 64];
    let mut load = vec![SlotLoad::default(); 64];
    let mut state = SelectorState::new(7);
    // Preallocated: the test's own bookkeeping must not count.
    let mut picked = vec![false; 64];
    let mut run = |rounds: u64, picked: &mut Vec<bool>| {
        for r in 0..rounds {
            let i = (r % 64) as usize;
            overlaps[i].device_blocks = (r % 256) as u32;
            load[(i * 7) % 64].decode_blocks = (r % 97) as f64;
            let input = RouteInput {
                request: &request,
                header_pin: Pin::default(),
                prompt_blocks: prompt_blocks(&config, &request),
                overlaps: &overlaps,
                load: &load,
                stale_slots: &[],
                kv_usage: &[],
                learned: Some(&learned),
                arrivals_per_ms: 0.0,
            };
            let decision = decide(&config, &input, &mut state).unwrap();
            assert_eq!(decision.fallbacks.len(), 2);
            if let Some(p) = picked.get_mut(usize::from(decision.slot)) {
                *p = true;
            }
            state.recycle(decision);
        }
    };
    run(16, &mut picked);
    let before = crate::alloc_count::allocations();
    run(n, &mut picked);
    let allocated = crate::alloc_count::allocations() - before;
    (allocated, picked.iter().filter(|p| **p).count())
}

#[test]
fn a_kv_decision_allocates_nothing_once_warm() {
    for policy in ["adaptive", "dynamo"] {
        let (allocated, distinct) = allocations_per_decision(policy, 1000);
        assert_eq!(
            allocated, 0,
            "{policy}: {allocated} allocations in 1,000 decisions"
        );
        // The inputs moved the choice around: the loop measured real decisions.
        assert!(distinct > 8, "{policy}: only {distinct} distinct picks");
    }
}
