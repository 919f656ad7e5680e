//! The routing-quality diagnostics of a comparison: per arm, the client-side affinity replay
//! ([`crate::loadgen::affinity_replay`]): share of requests sent to the worker that already held
//! their longest prefix, and share of the available prefix blocks given up; and what outweighed
//! the overlap when the filter sent a request away from the longest prefix its index knew
//! ([`load_misses`], from the `x-kv-router-loads` response header).

use std::fmt::Write as _;

use crate::loadgen::{affinity_replay, pooled_replay, RequestResult, RunStats, Workload};
use crate::mock::timing::prefill_in_steps_ms;

/// One row per arm of the affinity replay, with the arm's hit rate in the cache model and the
/// same requests' hit rate in one cache pooling the `workers` caches (the ceiling).
pub fn affinity_table(
    results: &[(String, RunStats)],
    workload: &Workload,
    block_size: u32,
    capacity_blocks: Option<usize>,
    workers: usize,
) -> String {
    let pct = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", v * 100.0));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<26} {:>8} {:>11} {:>14} {:>16} {:>10} {:>7} {:>8} | {:>6} {:>6} {:>6} {:>6}",
        "arm",
        "requests",
        "with prefix",
        "to max-overlap",
        "prefix given up",
        "blocks",
        "hit",
        "ceiling",
        "load",
        "behind",
        "disagr",
        "n/a"
    );
    for (name, s) in results {
        let a = affinity_replay(workload, &s.results, block_size, capacity_blocks);
        let pooled = capacity_blocks.map(|n| n.saturating_mul(workers.max(1)));
        let ceiling = pooled_replay(workload, &s.results, block_size, pooled);
        let _ = writeln!(
            out,
            "{:<26} {:>8} {:>11} {:>14} {:>16} {:>10} {:>7} {:>8} | {:>6} {:>6} {:>6} {:>6}",
            name,
            a.requests,
            a.with_prefix,
            pct(a.share_to_max_overlap()),
            pct(a.share_given_up()),
            a.available_blocks,
            pct(a.modelled_hit_rate()),
            pct(ceiling.modelled_hit_rate()),
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
            Some(n) => format!(
                "each worker's cache modelled like the engine's: {n} blocks, a running request's \
                 blocks pinned from its send to its end plus its partial and output blocks, a 1% \
                 watermark, blocks stamped when sent and when freed, least recently used \
                 evicted first"
            ),
            // The workers evict (their caches are bounded), the index follows their "removed"
            // events: here "behind" counts those evicted prefixes too.
            None => "evictions not modelled, so \"behind\" also counts prefixes the workers \
                     had evicted (the index dropped them on their events)"
                .to_string(),
        }
    );
    let _ = writeln!(
        out,
        "(hit = prompt tokens the modelled cache of the chosen worker held; ceiling = the same \
         requests, same times, in one {} (no block held twice): a yardstick for placement, not a \
         strict bound, since LRU is not optimal)",
        match capacity_blocks {
            Some(n) => format!(
                "cache of {workers} x {n} blocks modelled the same way",
                workers = workers.max(1)
            ),
            None => "unbounded cache".to_string(),
        }
    );
    let _ = writeln!(
        out,
        "(misses by cause, from the filter's response headers: load = the index knew a longer \
         prefix but the cost or the affinity gate chose a less loaded worker; behind = the index \
         did not hold the prefix yet (event lag, or a burst decided in another order than \
         sent) or any more (evicted); disagr = the index credited the \
         chosen worker with the longest prefix; n/a = no filter headers, e.g. peer arms)"
    );
    out
}

/// One candidate in `x-kv-router-loads`: `worker/rank=prefill_tokens:active:overlap_blocks`.
#[derive(Debug, Clone, PartialEq)]
struct SlotSeen {
    worker: String,
    prefill_tokens: f64,
    active: u32,
    overlap_blocks: u32,
}

fn parse_loads(header: &str) -> Vec<SlotSeen> {
    header
        .split(',')
        .filter_map(|entry| {
            let (name, rest) = entry.split_once('=')?;
            let worker = name.split('/').next()?.to_string();
            let mut it = rest.split(':');
            Some(SlotSeen {
                worker,
                prefill_tokens: it.next()?.parse().ok()?,
                active: it.next()?.parse().ok()?,
                overlap_blocks: it.next()?.parse().ok()?,
            })
        })
        .collect()
}

/// Prefill ms of `tokens` in 8,192-token steps of the mock engine from an empty context (speedup
/// 1; [`crate::mock::timing`]).
fn prefill_only_ms(tokens: f64) -> f64 {
    prefill_in_steps_ms(0.0, tokens, 8192.0)
}

/// The filter's own "load" misses (chosen overlap < the longest overlap in its index), with the
/// holder (the candidate with the longest overlap, least booked prefill among ties) against the
/// chosen worker as the decision saw them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadMisses {
    /// Misses with a readable `x-kv-router-loads` header.
    pub count: usize,
    /// Holder's booked prefill tokens minus the chosen worker's, per miss.
    pub queue_gap_tokens: Vec<f64>,
    /// Prefix tokens the holder had over the chosen worker, per miss.
    pub history_tokens: Vec<f64>,
    /// Misses where the prefill terms alone favoured the chosen worker: the holder's booked
    /// prefill outweighed the history.
    pub queue_decided: usize,
    /// Misses where the prefill terms alone favoured the holder: the decode term (the holder
    /// had requests in flight), the compute weight, or ties decided.
    pub other_decided: usize,
}

/// Collects [`LoadMisses`] from the results' response headers; `block_size` in tokens.
pub fn load_misses(results: &[RequestResult], block_size: u32) -> LoadMisses {
    let bs = f64::from(block_size);
    let mut m = LoadMisses::default();
    for r in results.iter().filter(|r| r.ok) {
        let (Some(chosen_id), Some(header)) = (r.router_worker.as_deref(), &r.router_loads) else {
            continue;
        };
        let slots = parse_loads(header);
        let Some(chosen) = slots.iter().find(|s| s.worker == chosen_id) else {
            continue;
        };
        let Some(max) = slots.iter().map(|s| s.overlap_blocks).max() else {
            continue;
        };
        if chosen.overlap_blocks >= max {
            continue;
        }
        let Some(holder) = slots
            .iter()
            .filter(|s| s.overlap_blocks == max)
            .min_by(|a, b| a.prefill_tokens.total_cmp(&b.prefill_tokens))
        else {
            continue;
        };
        m.count += 1;
        m.queue_gap_tokens
            .push(holder.prefill_tokens - chosen.prefill_tokens);
        let history = f64::from(max - chosen.overlap_blocks) * bs;
        m.history_tokens.push(history);
        // Uncached tokens differ by the history; the prompt length cancels out.
        let holder_ms = prefill_only_ms(holder.prefill_tokens.max(0.0));
        let chosen_ms = prefill_only_ms(chosen.prefill_tokens.max(0.0) + history);
        if holder_ms > chosen_ms {
            m.queue_decided += 1;
        } else {
            m.other_decided += 1;
        }
    }
    m
}

/// One row per arm of [`load_misses`] (arms without the header are left out).
pub fn load_miss_table(results: &[(String, RunStats)], block_size: u32) -> String {
    let med =
        |v: &[f64]| crate::util::percentile(v, 50.0).map_or("-".to_string(), |x| format!("{x:.0}"));
    let mut out = String::new();
    let rows: Vec<(&String, LoadMisses)> = results
        .iter()
        .map(|(name, s)| (name, load_misses(&s.results, block_size)))
        .filter(|(_, m)| m.count > 0)
        .collect();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "{:<26} {:>11} {:>15} {:>15} {:>14} {:>14}",
        "arm", "load misses", "queue decided", "other decided", "queue gap p50", "history p50"
    );
    for (name, m) in rows {
        let _ = writeln!(
            out,
            "{:<26} {:>11} {:>15} {:>15} {:>14} {:>14}",
            name,
            m.count,
            m.queue_decided,
            m.other_decided,
            med(&m.queue_gap_tokens),
            med(&m.history_tokens)
        );
    }
    let _ = writeln!(
        out,
        "(the filter's own misses, from x-kv-router-loads: the worker with the longest overlap in \
         its index against the chosen one; queue decided = the booked prefill ahead on the holder \
         outweighed the history even on prefill time alone; other = the decode term, the compute \
         weight or a tie decided; gaps in tokens: the holder's booked prefill minus the chosen \
         worker's, and the prefix the holder had over it)"
    );
    out
}

/// Prefix the filter credited the chosen worker with that the worker did not serve from its
/// cache: a stale index or a prediction the engine had already evicted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CreditMisses {
    /// Credited-but-not-cached tokens over all prompt tokens (requests with both headers).
    pub share: f64,
    /// Requests short of their credit by more than one block.
    pub requests: usize,
}

/// [`CreditMisses`] from the results' `x-kv-router-overlap-blocks` and the workers' reported
/// cached tokens; `None` when no request has both (peer arms).
pub fn credit_misses(results: &[RequestResult], block_size: u32) -> Option<CreditMisses> {
    let bs = u64::from(block_size);
    let (mut short, mut prompt, mut requests, mut seen) = (0u64, 0u64, 0usize, false);
    for r in results.iter().filter(|r| r.ok) {
        let (Some(credited), Some(cached)) = (r.router_overlap_blocks, r.cached_tokens) else {
            continue;
        };
        seen = true;
        let credited = (u64::from(credited) * bs).min(r.prompt_tokens as u64);
        let missing = credited.saturating_sub(cached as u64);
        short += missing;
        prompt += r.prompt_tokens as u64;
        requests += usize::from(missing > bs);
    }
    seen.then(|| CreditMisses {
        share: if prompt == 0 {
            0.0
        } else {
            short as f64 / prompt as f64
        },
        requests,
    })
}

/// One row per arm of [`credit_misses`] (arms without the filter's headers are left out).
pub fn credit_table(results: &[(String, RunStats)], block_size: u32) -> String {
    let mut out = String::new();
    let rows: Vec<(&String, CreditMisses)> = results
        .iter()
        .filter_map(|(name, s)| Some((name, credit_misses(&s.results, block_size)?)))
        .collect();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "{:<26} {:>22} {:>10}",
        "arm", "credited, not cached", "requests"
    );
    for (name, m) in rows {
        let _ = writeln!(
            out,
            "{:<26} {:>21.1}% {:>10}",
            name,
            m.share * 100.0,
            m.requests
        );
    }
    let _ = writeln!(
        out,
        "(prefix the filter credited the chosen worker with, in x-kv-router-overlap-blocks, that the \
         worker did not serve from its cache: share of all prompt tokens, and requests short by \
         more than one block; a prefill still running on the worker, an index behind its events, \
         or a prediction of blocks the engine had evicted)"
    );
    out
}

/// Upper bounds (exclusive) of the uncached-token classes of [`time_beyond_compute`].
pub const UNCACHED_CLASSES: [f64; 5] = [2048.0, 8192.0, 16384.0, 32768.0, f64::INFINITY];

/// Where one arm's TTFT goes: the part no router can take away (each request's uncached tokens
/// computed alone on an idle mock engine) and the rest (the step in progress, the prefills ahead,
/// the decode work its steps share, the router and the network), by the request's uncached
/// tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TimeBeyondCompute {
    pub requests: usize,
    /// Mean over the requests of their uncached tokens' prefill alone (ms).
    pub alone_ms: f64,
    /// Mean TTFT minus [`Self::alone_ms`].
    pub beyond_ms: f64,
    /// Per class of [`UNCACHED_CLASSES`]: requests, and their mean TTFT beyond their own compute.
    pub classes: [(usize, f64); UNCACHED_CLASSES.len()],
}

/// [`TimeBeyondCompute`] of the requests that reported their cached tokens, on mock engines of
/// `--speedup` `speedup` computing at most `chunk` prompt tokens a step (`--max-batched-tokens`);
/// `None` when none did.
pub fn time_beyond_compute(
    results: &[RequestResult],
    speedup: f64,
    chunk: f64,
) -> Option<TimeBeyondCompute> {
    let mut sums = [(0usize, 0.0f64); UNCACHED_CLASSES.len()];
    let (mut n, mut alone_sum, mut ttft_sum) = (0usize, 0.0, 0.0);
    for r in results.iter().filter(|r| r.ok) {
        let (Some(ttft), Some(cached)) = (r.ttft_ms, r.cached_tokens) else {
            continue;
        };
        let uncached = r.prompt_tokens.saturating_sub(cached) as f64;
        // The uncached tokens after the cached prefix they attend to.
        let alone = prefill_in_steps_ms(cached.min(r.prompt_tokens) as f64, uncached, chunk)
            / speedup.max(1e-9);
        let class = UNCACHED_CLASSES
            .iter()
            .position(|bound| uncached < *bound)
            .unwrap_or(UNCACHED_CLASSES.len() - 1);
        if let Some((count, beyond)) = sums.get_mut(class) {
            *count += 1;
            *beyond += ttft - alone;
        }
        n += 1;
        alone_sum += alone;
        ttft_sum += ttft;
    }
    (n > 0).then(|| TimeBeyondCompute {
        requests: n,
        alone_ms: alone_sum / n as f64,
        beyond_ms: (ttft_sum - alone_sum) / n as f64,
        classes: sums.map(|(count, beyond)| {
            (
                count,
                if count == 0 {
                    0.0
                } else {
                    beyond / count as f64
                },
            )
        }),
    })
}

/// One row per arm of [`time_beyond_compute`]: each class's mean TTFT beyond its own compute
/// and, in brackets, what that class adds to the arm's mean.
pub fn time_beyond_compute_table(
    results: &[(String, RunStats)],
    speedup: f64,
    chunk: f64,
) -> String {
    let mut out = String::new();
    let rows: Vec<(&String, TimeBeyondCompute)> = results
        .iter()
        .filter_map(|(name, s)| Some((name, time_beyond_compute(&s.results, speedup, chunk)?)))
        .collect();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "{:<26} {:>7} {:>7} | {:>12} {:>12} {:>12} {:>12} {:>12}",
        "arm", "alone", "beyond", "<2k", "2k-8k", "8k-16k", "16k-32k", ">=32k"
    );
    for (name, t) in rows {
        let _ = write!(
            out,
            "{:<26} {:>7.1} {:>7.1} |",
            name, t.alone_ms, t.beyond_ms
        );
        for (count, beyond) in t.classes {
            let share = beyond * count as f64 / t.requests as f64;
            let _ = write!(out, " {:>12}", format!("{beyond:.0} ({share:.1})"));
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(
        out,
        "(ms; alone = the mean time each request's uncached tokens take on an idle engine, in \
         steps of --max-batched-tokens after their cached prefix at the mock's step-time model / \
         --speedup: no router goes under it at this \
         hit rate; beyond = TTFT mean minus alone: the step in progress, the prefills ahead, the \
         decode work of the steps it shares, the router and the network; per class of uncached \
         tokens, its requests' mean beyond and (in brackets) what that class adds to the arm's mean)"
    );
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn told(worker: &str, loads: &str) -> RequestResult {
        RequestResult {
            ok: true,
            router_worker: Some(worker.into()),
            router_loads: Some(loads.into()),
            ..RequestResult::default()
        }
    }

    #[test]
    fn load_misses_say_what_outweighed_the_history() {
        let results = vec![
            // Holder 1 (160 blocks = 10,240 tokens) behind 30,000 booked tokens; 3 idle: queue.
            told("3", "1/0=30000:4:160,2/0=500:1:0,3/0=0:0:0"),
            // Holder 1 behind only 1,000 tokens: prefill alone favoured it -> other.
            told("2", "1/0=1000:3:160,2/0=0:0:0"),
            // Went to the holder: no miss.
            told("1", "1/0=1000:3:160,2/0=0:0:0"),
            // No header, or garbage: ignored.
            RequestResult {
                ok: true,
                ..RequestResult::default()
            },
            told("2", "nonsense"),
        ];
        let m = load_misses(&results, 64);
        assert_eq!(m.count, 2);
        assert_eq!((m.queue_decided, m.other_decided), (1, 1));
        assert_eq!(m.queue_gap_tokens, vec![30_000.0, 1000.0]);
        assert_eq!(m.history_tokens, vec![10_240.0, 10_240.0]);
        let stats = RunStats {
            results,
            ..RunStats::default()
        };
        let table = load_miss_table(&[("kv+ttft".to_string(), stats)], 64);
        assert!(table.contains("kv+ttft"), "{table}");
        assert!(load_miss_table(&[], 64).is_empty());
    }

    #[test]
    fn credit_misses_count_the_prefix_the_worker_did_not_have() {
        let served = |credited: u32, cached: usize| RequestResult {
            ok: true,
            prompt_tokens: 1000,
            router_overlap_blocks: Some(credited),
            cached_tokens: Some(cached),
            ..RequestResult::default()
        };
        let results = vec![
            served(10, 640),  // credit kept
            served(10, 0),    // 640 tokens short
            served(10, 600),  // 40 short: less than a block
            served(0, 512),   // more cached than credited: not short
            served(100, 320), // credit capped at the prompt: 680 short
            RequestResult {
                ok: true,
                prompt_tokens: 1000,
                ..RequestResult::default()
            }, // no header: left out
        ];
        let m = credit_misses(&results, 64).unwrap();
        assert_eq!(m.requests, 2);
        assert!(
            (m.share - (640.0 + 40.0 + 680.0) / 5000.0).abs() < 1e-12,
            "{m:?}"
        );
        assert_eq!(credit_misses(&results[5..], 64), None);
        let stats = RunStats {
            results,
            ..RunStats::default()
        };
        let table = credit_table(&[("kv+approx".to_string(), stats)], 64);
        assert!(
            table.contains("kv+approx") && table.contains("27.2%"),
            "{table}"
        );
    }

    #[test]
    fn time_beyond_compute_splits_the_ttft_by_uncached_tokens() {
        let served = |prompt: usize, cached: usize, ttft: f64| RequestResult {
            ok: true,
            prompt_tokens: prompt,
            cached_tokens: Some(cached),
            ttft_ms: Some(ttft),
            ..RequestResult::default()
        };
        // 1,000 uncached tokens after 2,000 cached: 26.7 ms alone at speedup 1.
        let step = crate::mock::timing::prefill_step_ms;
        let short_alone = step(2000.0, 1000.0);
        assert!((26.7..=26.8).contains(&short_alone), "{short_alone}");
        // 20,000 uncached: two full 8,192-token steps and 3,616 tokens, each after the last.
        let long_alone = step(0.0, 8192.0) + step(8192.0, 8192.0) + step(16384.0, 3616.0);
        let results = vec![
            served(3000, 2000, short_alone / 2.0 + 10.0),
            served(20_000, 0, long_alone / 2.0 + 50.0),
            RequestResult {
                ok: true,
                prompt_tokens: 500,
                ttft_ms: Some(5.0),
                ..RequestResult::default()
            }, // no cached tokens reported: left out
        ];
        let t = time_beyond_compute(&results, 2.0, 8192.0).unwrap();
        assert_eq!(t.requests, 2);
        assert!((t.beyond_ms - 30.0).abs() < 1e-9, "{t:?}");
        assert!(
            (t.alone_ms - (short_alone + long_alone) / 4.0).abs() < 1e-9,
            "{t:?}"
        );
        assert_eq!(t.classes[0].0, 1);
        assert!((t.classes[0].1 - 10.0).abs() < 1e-9, "{t:?}");
        assert_eq!(t.classes[3].0, 1);
        assert!((t.classes[3].1 - 50.0).abs() < 1e-9, "{t:?}");
        assert_eq!(time_beyond_compute(&results[2..], 2.0, 8192.0), None);
        let stats = RunStats {
            results,
            ..RunStats::default()
        };
        let table = time_beyond_compute_table(&[("kv".to_string(), stats)], 2.0, 8192.0);
        assert!(
            table.contains("10 (5.0)") && table.contains("50 (25.0)"),
            "{table}"
        );
    }
}
