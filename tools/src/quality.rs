//! The routing-quality diagnostics of a comparison: per arm, the client-side affinity replay
//! ([`crate::loadgen::affinity_replay`]): share of requests sent to the worker that already held
//! their longest prefix, and share of the available prefix blocks given up.

use std::fmt::Write as _;

use crate::loadgen::{affinity_replay, RunStats, Workload};

/// One row per arm of the affinity replay.
pub fn affinity_table(
    results: &[(String, RunStats)],
    workload: &Workload,
    block_size: u32,
    capacity_blocks: Option<usize>,
) -> String {
    let pct = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", v * 100.0));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<26} {:>8} {:>11} {:>14} {:>16} {:>10} | {:>6} {:>6} {:>6} {:>6}",
        "arm",
        "requests",
        "with prefix",
        "to max-overlap",
        "prefix given up",
        "blocks",
        "load",
        "behind",
        "disagr",
        "n/a"
    );
    for (name, s) in results {
        let a = affinity_replay(workload, &s.results, block_size, capacity_blocks);
        let _ = writeln!(
            out,
            "{:<26} {:>8} {:>11} {:>14} {:>16} {:>10} | {:>6} {:>6} {:>6} {:>6}",
            name,
            a.requests,
            a.with_prefix,
            pct(a.share_to_max_overlap()),
            pct(a.share_given_up()),
            a.available_blocks,
            a.why.load_outweighed,
            a.why.index_behind,
            a.why.index_disagrees,
            a.why.unknown
        );
    }
    let _ = writeln!(
        out,
        "(replay in send order: max-overlap worker = the one sent the longest prefix of the request \
         earlier in the run; {}; blocks of {block_size} tokens)",
        match capacity_blocks {
            Some(n) => format!("each worker keeps its {n} most recently used blocks (LRU)"),
            None => "evictions not modelled".to_string(),
        }
    );
    let _ = writeln!(
        out,
        "(misses by cause, from the filter's response headers: load = the index knew a longer \
         prefix but the cost or the affinity gate chose a less loaded worker; behind = the index \
         did not hold the prefix yet (event lag) or any more; disagr = the index credited the \
         chosen worker with the longest prefix; n/a = no filter headers, e.g. peer arms)"
    );
    out
}
