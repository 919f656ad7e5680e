//! Affinity replay: how well an arm kept requests on the worker that already held their prefix,
//! judged from the client side alone (the prompts and the `x-worker-id` of each answer), so it
//! applies to every arm, peers included.
//!
//! Requests are replayed in the order they were sent. Each one is compared with what the fleet
//! had already been sent in this run: for every worker, the prefix blocks of the requests routed
//! to it earlier (full `block_size` blocks, chained like KV block hashes). The request's
//! "max-overlap worker" is the one holding the longest prefix of it; it "went to" that worker
//! when its own worker's overlap equals the maximum. Blocks given up = max overlap minus the
//! overlap of the worker it went to. Without `capacity_blocks` a worker keeps all it was sent
//! (the affinity a router could have had with unbounded caches). With it each worker's cache is
//! modelled like the mock engine's (and vLLM's): at most that many blocks; a running request
//! (from its send to its end, `sent_at_ms + e2e_ms`) pins its prompt blocks and also occupies
//! its partial last prompt block and its output blocks; 1% of the capacity is kept free while
//! requests run (the engine's watermark); blocks are stamped when their request is sent and again
//! when it ends (when the engine frees them), and the least recently stamped unpinned block is
//! evicted first (leaf blocks before their prefix). So "max-overlap worker" means one that still
//! holds the prefix as far as the client can tell. Not modelled: when the engine admitted a
//! request (the send stands for it), preemption, the engine's block ids.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use super::stats::RequestResult;
use super::Workload;
use crate::util::splitmix64;

/// The replay's totals for one arm.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Affinity {
    /// Completed requests with a worker identity.
    pub requests: usize,
    /// Of those, requests some worker already held a prefix of (max overlap > 0).
    pub with_prefix: usize,
    /// Requests with a prefix that went to a max-overlap worker.
    pub to_max_overlap: usize,
    /// Sum over requests of the max overlap (blocks).
    pub available_blocks: u64,
    /// Sum over requests of max overlap minus the chosen worker's overlap (blocks).
    pub given_up_blocks: u64,
    /// Why requests with a prefix missed the max-overlap worker, from the filter's response
    /// headers (our arms with `response_headers`): see [`Why`].
    pub why: Why,
    /// Prompt tokens of the replayed requests.
    pub prompt_tokens: u64,
    /// Of those, tokens the modelled cache of the worker each request went to held.
    pub cached_tokens: u64,
}

/// Requests that missed the max-overlap worker, by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Why {
    /// The filter's index knew a longer prefix than the chosen worker's (overlap < max overlap
    /// header): the cost (decode load, prefill queue) or a failed affinity gate outweighed it.
    pub load_outweighed: usize,
    /// The index's longest overlap was shorter than the replay's: the blocks were not (yet) in
    /// the index: event lag within a burst, or entries evicted/removed.
    pub index_behind: usize,
    /// The index credited the chosen worker with the longest prefix, the replay another one
    /// (a tie in the index, or the index holding blocks the replay does not count).
    pub index_disagrees: usize,
    /// No filter headers (peer arms, or `response_headers` off).
    pub unknown: usize,
}

impl Affinity {
    /// Share of requests with a prefix somewhere that went to a max-overlap worker.
    pub fn share_to_max_overlap(&self) -> Option<f64> {
        (self.with_prefix > 0).then(|| self.to_max_overlap as f64 / self.with_prefix as f64)
    }

    /// Share of the available prefix blocks that the routing gave up.
    pub fn share_given_up(&self) -> Option<f64> {
        (self.available_blocks > 0)
            .then(|| self.given_up_blocks as f64 / self.available_blocks as f64)
    }

    /// Prefix-cache hit rate in the model: cached over prompt tokens.
    pub fn modelled_hit_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }
}

/// Chained hashes of the full `block_size`-token blocks of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let bs = block_size.max(1);
    let mut parent = 0x5EED_u64;
    tokens
        .chunks_exact(bs)
        .map(|chunk| {
            let mut h = splitmix64(parent);
            for t in chunk {
                h = splitmix64(h ^ u64::from(*t));
            }
            parent = h;
            h
        })
        .collect()
}

/// The engine's watermark: free blocks it keeps while requests run (the mock's and vLLM's 1%).
const WATERMARK: f64 = 0.01;

/// One worker's cache as the engine keeps it: cached blocks stamped by last use, the blocks its
/// running requests pin, and the slots those requests occupy beyond their cached blocks.
#[derive(Debug, Default)]
struct WorkerCache {
    /// Block -> stamp of its last use.
    last_use: HashMap<u64, u64>,
    /// Stamp -> block, oldest first.
    by_age: BTreeMap<u64, u64>,
    /// Block -> running requests holding it (never evicted while held).
    pins: HashMap<u64, u32>,
    /// Slots of running requests not in the cache: partial last prompt blocks and output blocks.
    private: usize,
    running: usize,
    clock: u64,
}

impl WorkerCache {
    /// Leading blocks of `hashes` held.
    fn overlap(&self, hashes: &[u64]) -> u64 {
        hashes
            .iter()
            .take_while(|h| self.last_use.contains_key(h))
            .count() as u64
    }

    /// Stamps `hashes` as used now, leaf first, so a prefix outlives its tails.
    fn stamp(&mut self, hashes: &[u64]) {
        for h in hashes.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.last_use.insert(*h, self.clock) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.clock, *h);
        }
    }

    /// A request starts: its blocks are cached and pinned, its other slots taken, and the least
    /// recently used unpinned blocks evicted until everything fits under `capacity` (as far as
    /// unpinned blocks allow: the engine would queue the request instead).
    fn start(&mut self, hashes: &[u64], private: usize, capacity: usize) {
        self.stamp(hashes);
        for h in hashes {
            *self.pins.entry(*h).or_insert(0) += 1;
        }
        self.private += private;
        self.running += 1;
        // The engine keeps its watermark free only while other requests run.
        let watermark = if self.running > 1 {
            (WATERMARK * capacity as f64).ceil() as usize
        } else {
            0
        };
        let limit = capacity.saturating_sub(self.private + watermark);
        let excess = self.last_use.len().saturating_sub(limit);
        if excess == 0 {
            return;
        }
        let victims: Vec<(u64, u64)> = self
            .by_age
            .iter()
            .filter(|(_, h)| !self.pins.contains_key(*h))
            .take(excess)
            .map(|(stamp, h)| (*stamp, *h))
            .collect();
        for (stamp, h) in victims {
            self.by_age.remove(&stamp);
            self.last_use.remove(&h);
        }
    }

    /// A request ends: the engine frees its blocks (stamping them) and its other slots.
    fn end(&mut self, hashes: &[u64], private: usize) {
        for h in hashes {
            if let Some(n) = self.pins.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(h);
                }
            }
        }
        let held: Vec<u64> = hashes
            .iter()
            .copied()
            .filter(|h| self.last_use.contains_key(h))
            .collect();
        self.stamp(&held);
        self.private = self.private.saturating_sub(private);
        self.running = self.running.saturating_sub(1);
    }
}

/// A running request's end, for the bounded replay: (end time, worker, blocks, private slots).
struct Running<'a> {
    end_ms: f64,
    worker: &'a str,
    hashes: Vec<u64>,
    private: usize,
}

impl PartialEq for Running<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.end_ms.total_cmp(&other.end_ms).is_eq()
    }
}
impl Eq for Running<'_> {}
impl PartialOrd for Running<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Running<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.end_ms.total_cmp(&other.end_ms)
    }
}

/// Replays `results` of `workload` (matched by request index) in send order; see the module docs.
pub fn affinity_replay(
    workload: &Workload,
    results: &[RequestResult],
    block_size: u32,
    capacity_blocks: Option<usize>,
) -> Affinity {
    replay(workload, results, block_size, capacity_blocks, |r| {
        r.worker_id.as_deref()
    })
}

/// The same requests, sent at the same times and running as long, all in one cache of
/// `capacity_blocks` (pass the fleet's total): the fleet's caches pooled, no block held twice.
/// Its [`Affinity::modelled_hit_rate`] is the reference ceiling for routing: split caches of
/// the same total size under the same least-recently-used eviction hold no more in practice,
/// since every prefix held twice takes room from another (LRU is not an optimal policy, so a
/// lucky placement can beat it by a little; it is a yardstick, not a proof). Without a
/// capacity, the share of prompt tokens some earlier request of the run had sent.
pub fn pooled_replay(
    workload: &Workload,
    results: &[RequestResult],
    block_size: u32,
    capacity_blocks: Option<usize>,
) -> Affinity {
    // Every request, whether or not its response named a worker (peers in front of real
    // engines name none).
    replay(workload, results, block_size, capacity_blocks, |_| {
        Some("pooled")
    })
}

fn replay<'r>(
    workload: &Workload,
    results: &'r [RequestResult],
    block_size: u32,
    capacity_blocks: Option<usize>,
    cache_of: impl Fn(&'r RequestResult) -> Option<&'r str>,
) -> Affinity {
    let mut order: Vec<&RequestResult> = results
        .iter()
        .filter(|r| r.ok && cache_of(r).is_some())
        .collect();
    order.sort_by(|a, b| a.sent_at_ms.total_cmp(&b.sent_at_ms));
    let mut held: HashMap<&str, WorkerCache> = HashMap::new();
    let mut running: BinaryHeap<Reverse<Running>> = BinaryHeap::new();
    let mut a = Affinity::default();
    for r in order {
        let (Some(spec), Some(worker)) = (workload.requests.get(r.index), cache_of(r)) else {
            continue;
        };
        while running.peek().is_some_and(|e| e.0.end_ms <= r.sent_at_ms) {
            if let Some(Reverse(e)) = running.pop() {
                held.entry(e.worker).or_default().end(&e.hashes, e.private);
            }
        }
        let hashes = block_hashes(&spec.tokens, block_size as usize);
        let best = held.values().map(|h| h.overlap(&hashes)).max().unwrap_or(0);
        let mine = held.get(worker).map_or(0, |h| h.overlap(&hashes));
        a.requests += 1;
        a.prompt_tokens += spec.tokens.len() as u64;
        a.cached_tokens += (mine * u64::from(block_size)).min(spec.tokens.len() as u64);
        if best > 0 {
            a.with_prefix += 1;
            if mine == best {
                a.to_max_overlap += 1;
            }
            a.available_blocks += best;
            a.given_up_blocks += best - mine;
            if mine < best {
                match (r.router_overlap_blocks, r.router_max_overlap_blocks) {
                    (Some(chosen), Some(max)) if chosen < max => a.why.load_outweighed += 1,
                    (Some(_), Some(max)) if u64::from(max) < best => a.why.index_behind += 1,
                    (Some(_), Some(_)) => a.why.index_disagrees += 1,
                    _ => a.why.unknown += 1,
                }
            }
        }
        let cache = held.entry(worker).or_default();
        match capacity_blocks {
            // Unbounded: every block sent stays.
            None => cache.stamp(&hashes),
            Some(capacity) => {
                let bs = block_size.max(1) as usize;
                // Slots beyond the cached blocks: the partial last prompt block and the output.
                let private =
                    spec.tokens.len().div_ceil(bs) - hashes.len() + r.output_tokens.div_ceil(bs);
                cache.start(&hashes, private, capacity);
                running.push(Reverse(Running {
                    end_ms: r.sent_at_ms + r.e2e_ms,
                    worker,
                    hashes,
                    private,
                }));
            }
        }
    }
    a
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{Arrival, RequestSpec};
    use super::*;

    fn spec(tokens: Vec<u32>) -> RequestSpec {
        RequestSpec {
            at_ms: 0.0,
            tokens,
            max_tokens: 1,
            messages: None,
            client: None,
        }
    }

    fn result(index: usize, at: f64, worker: &str) -> RequestResult {
        RequestResult {
            index,
            ok: true,
            sent_at_ms: at,
            worker_id: Some(worker.into()),
            ..RequestResult::default()
        }
    }

    #[test]
    fn counts_requests_sent_away_from_their_prefix() {
        // Prompts of 4-token blocks: A = blocks a b c, B = a b d (shares 2), C = a b c e (3).
        let a: Vec<u32> = (0..12).collect();
        let mut b: Vec<u32> = (0..8).collect();
        b.extend([100, 101, 102, 103]);
        let mut c = a.clone();
        c.extend([200, 201, 202, 203]);
        let w = Workload {
            name: "t".into(),
            requests: vec![spec(a), spec(b), spec(c)],
            arrival: Arrival::Timed,
        };
        // A on w1; B follows it to w1 (2 of 2 blocks); C goes to w2 and gives up all 3.
        let results = vec![
            result(2, 30.0, "w2"),
            result(0, 10.0, "w1"),
            result(1, 20.0, "w1"),
        ];
        let r = affinity_replay(&w, &results, 4, None);
        assert_eq!(r.requests, 3);
        assert_eq!(r.with_prefix, 2);
        assert_eq!(r.to_max_overlap, 1);
        assert_eq!((r.available_blocks, r.given_up_blocks), (5, 3));
        assert_eq!(r.share_to_max_overlap(), Some(0.5));
        assert_eq!(r.share_given_up(), Some(0.6));
        assert_eq!(r.why.unknown, 1);
        // With the filter's headers: C's index knew 3 blocks elsewhere -> load outweighed.
        let mut told = results.clone();
        told[0].router_overlap_blocks = Some(0);
        told[0].router_max_overlap_blocks = Some(3);
        assert_eq!(affinity_replay(&w, &told, 4, None).why.load_outweighed, 1);
        // The index knew only 1 block: it was behind.
        told[0].router_max_overlap_blocks = Some(1);
        told[0].router_overlap_blocks = Some(1);
        assert_eq!(affinity_replay(&w, &told, 4, None).why.index_behind, 1);
        // Failed requests and requests without a worker are left out.
        let mut failed = results.clone();
        failed[0].ok = false;
        failed[2].worker_id = None;
        let r = affinity_replay(&w, &failed, 4, None);
        assert_eq!((r.requests, r.with_prefix), (1, 0));
        assert_eq!(r.share_to_max_overlap(), None);
    }

    #[test]
    fn bounded_caches_forget_what_they_evicted() {
        // 4-token blocks. A (3 blocks) then B (3 other blocks) on w1, then A again on w2.
        let a: Vec<u32> = (0..12).collect();
        let b: Vec<u32> = (100..112).collect();
        let w = Workload {
            name: "t".into(),
            requests: vec![spec(a.clone()), spec(b), spec(a)],
            arrival: Arrival::Timed,
        };
        let results = vec![
            result(0, 10.0, "w1"),
            result(1, 20.0, "w1"),
            result(2, 30.0, "w2"),
        ];
        // Unbounded: w1 still holds A, so the third request gave up 3 blocks.
        let r = affinity_replay(&w, &results, 4, None);
        assert_eq!(
            (r.with_prefix, r.to_max_overlap, r.given_up_blocks),
            (1, 0, 3)
        );
        // 4 blocks per worker: B's 3 blocks evicted A's two tail blocks (leaf first), so w1
        // kept only A's first block: 1 block given up.
        let r = affinity_replay(&w, &results, 4, Some(4));
        assert_eq!((r.with_prefix, r.to_max_overlap), (1, 0));
        assert_eq!((r.available_blocks, r.given_up_blocks), (1, 1));
        // 3 blocks: A is gone entirely; nobody held a prefix of the third request.
        let r = affinity_replay(&w, &results, 4, Some(3));
        assert_eq!((r.with_prefix, r.available_blocks), (0, 0));
    }

    fn timed(index: usize, at: f64, e2e: f64, worker: &str) -> RequestResult {
        RequestResult {
            e2e_ms: e2e,
            ..result(index, at, worker)
        }
    }

    #[test]
    fn running_requests_pin_their_blocks_and_ends_restamp_them() {
        // 4-token blocks: A, B, C three blocks each, nothing shared.
        let [a, b, c]: [Vec<u32>; 3] = [0, 100, 200].map(|base| (base..base + 12).collect());
        let w = Workload {
            name: "t".into(),
            requests: vec![spec(a.clone()), spec(b.clone()), spec(c), spec(a), spec(b)],
            arrival: Arrival::Timed,
        };
        // A runs 10..110 on w1; B runs 20..25; C starts at 30: 9 blocks, capacity 7 less the
        // watermark of 1 (A still runs): 3 unpinned blocks go, and those are B's (finished),
        // not A's (older but running). A again on w2 at 40 gives up w1's 3 blocks; B again on
        // w2 at 50 finds nobody holding it.
        let results = vec![
            timed(0, 10.0, 100.0, "w1"),
            timed(1, 20.0, 5.0, "w1"),
            timed(2, 30.0, 100.0, "w1"),
            timed(3, 40.0, 1.0, "w2"),
            timed(4, 50.0, 1.0, "w2"),
        ];
        let r = affinity_replay(&w, &results, 4, Some(7));
        assert_eq!((r.with_prefix, r.to_max_overlap), (1, 0));
        assert_eq!((r.available_blocks, r.given_up_blocks), (3, 3));

        // Ends restamp: A runs 10..40, B 20..25, both done when C starts at 50 with room for 6
        // blocks: B (last used at 25) goes, not A (freed at 40, though sent first). B again on
        // w2 finds nobody holding it; A again on w1 finds its whole prefix there.
        let results = vec![
            timed(0, 10.0, 30.0, "w1"),
            timed(1, 20.0, 5.0, "w1"),
            timed(2, 50.0, 1.0, "w1"),
            timed(4, 60.0, 1.0, "w2"),
            timed(3, 70.0, 1.0, "w1"),
        ];
        let r = affinity_replay(&w, &results, 4, Some(6));
        assert_eq!((r.with_prefix, r.to_max_overlap), (1, 1));
        assert_eq!((r.available_blocks, r.given_up_blocks), (3, 0));
    }

    #[test]
    fn the_pooled_cache_holds_what_any_worker_was_sent() {
        // 4-token blocks: A (3 blocks) on w1, A again on w2, then B (3 other blocks, 2 tokens
        // beyond them) on w1.
        let a: Vec<u32> = (0..12).collect();
        let b: Vec<u32> = (100..114).collect();
        let w = Workload {
            name: "t".into(),
            requests: vec![spec(a.clone()), spec(b), spec(a)],
            arrival: Arrival::Timed,
        };
        let results = vec![
            result(0, 10.0, "w1"),
            result(2, 20.0, "w2"),
            result(1, 30.0, "w1"),
        ];
        // Separate caches: w2 had nothing of A, so nothing was cached anywhere.
        let split = affinity_replay(&w, &results, 4, Some(6));
        assert_eq!((split.prompt_tokens, split.cached_tokens), (38, 0));
        assert_eq!(split.modelled_hit_rate(), Some(0.0));
        // One cache of both workers' room: A's second send finds all 12 tokens.
        let pooled = pooled_replay(&w, &results, 4, Some(12));
        assert_eq!((pooled.prompt_tokens, pooled.cached_tokens), (38, 12));
        assert_eq!(pooled.modelled_hit_rate(), Some(12.0 / 38.0));
        // Room for 2 blocks only: a running request's blocks are pinned (the engine queues
        // rather than evicts them), so A's second send still finds all three.
        assert_eq!(pooled_replay(&w, &results, 4, Some(2)).cached_tokens, 12);
        // B then evicts A: a fourth send of A finds it only with room for both.
        let mut w4 = w.clone();
        w4.requests.push(w4.requests[0].clone());
        let mut r4 = results.clone();
        r4.push(result(3, 40.0, "w2"));
        assert_eq!(pooled_replay(&w4, &r4, 4, Some(4)).cached_tokens, 12);
        assert_eq!(pooled_replay(&w4, &r4, 4, Some(12)).cached_tokens, 24);
        // Unbounded: the same 12 tokens.
        assert_eq!(pooled_replay(&w, &results, 4, None).cached_tokens, 12);
        // Following A to w1 instead, the arm itself reaches the ceiling.
        let mut followed = results.clone();
        followed[1].worker_id = Some("w1".into());
        assert_eq!(affinity_replay(&w, &followed, 4, Some(6)).cached_tokens, 12);
        // Responses that name no worker (a peer in front of real engines): the same ceiling.
        let anonymous: Vec<RequestResult> = results
            .iter()
            .map(|r| RequestResult {
                worker_id: None,
                ..r.clone()
            })
            .collect();
        assert_eq!(affinity_replay(&w, &anonymous, 4, Some(6)).requests, 0);
        assert_eq!(pooled_replay(&w, &anonymous, 4, Some(12)).cached_tokens, 12);
    }

    #[test]
    fn block_hashes_chain_the_prefix() {
        let x = block_hashes(&[1, 2, 3, 4, 5, 6, 7], 3);
        assert_eq!(x.len(), 2);
        let y = block_hashes(&[9, 2, 3, 4, 5, 6], 3);
        assert_ne!(
            x[1], y[1],
            "a different first block changes every later hash"
        );
    }
}
