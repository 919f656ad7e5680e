//! The KV index's (`index::KvIndex`) memory per entry and event throughput. (The index it
//! replaced, and the two side by side: docs/history/benchmark-log.md.)
//!
//! Workload: 8 workers, each walking through its own documents and shared system prompts,
//! storing 16-block batches chained to their parent and, like an engine under cache pressure,
//! removing its oldest blocks in batches once it holds its share.
//!
//! * memory: a counting global allocator; `net` = bytes the index still holds, `peak` = the most
//!   it held at once while being built (what wasm linear memory, which never shrinks, keeps).
//!   Rows with bound "none" grow without eviction; rows with bound = entries fill an index
//!   configured for exactly that many entries (its steady state in production).
//! * throughput: events (and blocks) applied per second at the bound, evicting, as medians of
//!   runs over the same pre-built event list.
//!
//! Native figures (64-bit pointers); the index's entries are the same size on wasm32.
//! Usage: `cargo bench --bench index [-- --quick]` (`make bench`). Prints figures; asserts none.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::time::Instant;

use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::chain_sequence_hash;
use envoy_kv_router::index::KvIndex;
use envoy_kv_router::types::{
    ExternalBlockHash, LocalBlockHash, SequenceHash, SlotIdx, StorageTier,
};

/// `System`, tracking live bytes and their peak.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grow(bytes: usize) {
    let live = LIVE.fetch_add(bytes as isize, Relaxed) + bytes as isize;
    PEAK.fetch_max(live, Relaxed);
}

// SAFETY: every call is forwarded unchanged to `System`; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as alloc-then-free: the old block is live until the copy is done.
        grow(new_size);
        LIVE.fetch_sub(layout.size() as isize, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WORKERS: u16 = 8;
const BATCH: usize = 16;

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `count` events; each worker removes its oldest blocks once it holds `per_worker_cap`.
fn workload(seed: u64, count: usize, per_worker_cap: usize) -> Vec<(SlotIdx, IndexEvent)> {
    let mut rng = Rng(seed);
    // 32 shared system prompts of 32 blocks (local hashes), whose blocks every worker may hold.
    let systems: Vec<Vec<u64>> = (0..32)
        .map(|_| (0..32).map(|_| rng.next()).collect())
        .collect();
    struct Worker {
        held: std::collections::VecDeque<u64>,
        /// The current document: (engine hash of its last stored block, blocks left).
        doc: Option<(u64, usize)>,
    }
    let mut workers: Vec<Worker> = (0..WORKERS)
        .map(|_| Worker {
            held: Default::default(),
            doc: None,
        })
        .collect();
    let mut events = Vec::with_capacity(count);
    while events.len() < count {
        let slot = rng.below(usize::from(WORKERS)) as SlotIdx;
        let w = &mut workers[usize::from(slot)];
        if w.held.len() >= per_worker_cap {
            let blocks = (0..BATCH)
                .filter_map(|_| w.held.pop_front())
                .map(ExternalBlockHash)
                .collect();
            events.push((
                slot,
                IndexEvent::Removed {
                    dp_rank: 0,
                    tier: StorageTier::Device,
                    blocks,
                },
            ));
            continue;
        }
        let (parent, left, locals): (Option<u64>, usize, Vec<u64>) = match w.doc {
            Some((parent, left)) => {
                let n = left.min(BATCH);
                (Some(parent), left - n, (0..n).map(|_| rng.next()).collect())
            }
            None => {
                // A new document: half the time behind a shared system prompt (stored in full,
                // 32 blocks, as two batches' worth in one event).
                let len = 8 + rng.below(120);
                if rng.below(2) == 0 {
                    (None, len, systems[rng.below(systems.len())].clone())
                } else {
                    let n = len.min(BATCH);
                    (None, len - n, (0..n).map(|_| rng.next()).collect())
                }
            }
        };
        let blocks: Vec<(ExternalBlockHash, LocalBlockHash)> = locals
            .iter()
            // Engines hash blocks by content (and parent): a re-stored system prompt gets the
            // same engine hashes on one worker, different ones on another.
            .map(|&l| {
                let ext = l ^ (u64::from(slot) + 1).wrapping_mul(0xff51_afd7_ed55_8ccd);
                (ExternalBlockHash(ext), LocalBlockHash(l))
            })
            .collect();
        let last = blocks.last().map(|b| b.0 .0);
        w.held.extend(blocks.iter().map(|b| b.0 .0));
        w.doc = match (last, left) {
            (Some(last), 1..) => Some((last, left)),
            _ => None,
        };
        events.push((
            slot,
            IndexEvent::Stored {
                dp_rank: 0,
                tier: StorageTier::Device,
                parent: parent.map(ExternalBlockHash),
                blocks,
            },
        ));
    }
    events
}

/// (net bytes, peak bytes) per entry after applying events until `target` entries.
fn memory(events: &[(SlotIdx, IndexEvent)], target: usize, bound: usize) -> (f64, f64) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let mut index = KvIndex::new(usize::from(WORKERS), bound);
    for (slot, event) in events {
        if index.entries() >= target {
            break;
        }
        let _ = index.apply(*slot, event);
    }
    let n = index.entries() as f64;
    let net = (LIVE.load(Relaxed) - base) as f64 / n;
    let peak = (PEAK.load(Relaxed) - base) as f64 / n;
    drop(black_box(index));
    (net, peak)
}

/// Events per second applying `events` to an index already at its bound.
fn throughput(
    warm: &[(SlotIdx, IndexEvent)],
    events: &[(SlotIdx, IndexEvent)],
    bound: usize,
) -> f64 {
    let mut index = KvIndex::new(usize::from(WORKERS), bound);
    for (slot, event) in warm {
        let _ = index.apply(*slot, event);
    }
    let start = Instant::now();
    let mut evicted = 0;
    for (slot, event) in events {
        evicted += index.apply(*slot, event).map_or(0, |s| s.evicted_blocks);
    }
    black_box(evicted);
    events.len() as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A prefix every one of `slots` workers holds: (ns per lookup of the 64-block prompt, ns per
/// stored+removed pair of one block). Lookup and the chain walks are O(holders); this shows
/// the constant.
fn wide(slots: u16, rounds: usize) -> (f64, f64) {
    let mut rng = Rng(5);
    let locals: Vec<u64> = (0..64).map(|_| rng.next()).collect();
    let mut index = KvIndex::new(usize::from(slots), usize::MAX);
    let stored = |slot: u16, range: std::ops::Range<usize>| IndexEvent::Stored {
        dp_rank: 0,
        tier: StorageTier::Device,
        parent: range
            .start
            .checked_sub(1)
            .map(|i| ExternalBlockHash(locals[i] ^ u64::from(slot))),
        blocks: range
            .map(|i| {
                (
                    ExternalBlockHash(locals[i] ^ u64::from(slot)),
                    LocalBlockHash(locals[i]),
                )
            })
            .collect(),
    };
    for slot in 0..slots {
        let _ = index.apply(slot, &stored(slot, 0..64));
    }
    let mut prev = None;
    let seqs: Vec<SequenceHash> = locals
        .iter()
        .map(|&l| {
            let seq = chain_sequence_hash(prev, LocalBlockHash(l));
            prev = Some(seq);
            seq
        })
        .collect();
    let mut out = Vec::new();
    let start = Instant::now();
    for _ in 0..rounds {
        index.find_overlaps(&seqs, &mut out);
        black_box(&out);
    }
    let lookup = start.elapsed().as_secs_f64() * 1e9 / rounds as f64;
    let last = IndexEvent::Removed {
        dp_rank: 0,
        tier: StorageTier::Device,
        blocks: vec![ExternalBlockHash(locals[63])],
    };
    let start = Instant::now();
    for i in 0..rounds {
        let slot = (i % usize::from(slots)) as u16;
        let _ = index.apply(
            slot,
            &IndexEvent::Removed {
                dp_rank: 0,
                tier: StorageTier::Device,
                blocks: vec![ExternalBlockHash(locals[63] ^ u64::from(slot))],
            },
        );
        let _ = index.apply(slot, &stored(slot, 63..64));
    }
    black_box(&last);
    let churn = start.elapsed().as_secs_f64() * 1e9 / rounds as f64;
    (lookup, churn)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: &[usize] = if quick {
        &[100_000]
    } else {
        &[100_000, 1_000_000]
    };
    println!("bench index: {WORKERS} workers, {BATCH}-block batches, native build");
    println!();
    println!(
        "memory per entry (counting allocator, bytes; peak = most held at once while filling)"
    );
    println!("{:>9} {:>9} {:>9} {:>9}", "entries", "bound", "net", "peak");
    for &n in sizes {
        // No removals: every stored block stays until the target.
        let events = workload(7, n / 6, usize::MAX);
        for bound in [usize::MAX, n] {
            let (net, peak) = memory(&events, n, bound);
            let bound = if bound == usize::MAX {
                "none".to_string()
            } else {
                bound.to_string()
            };
            println!("{n:>9} {bound:>9} {net:>9.1} {peak:>9.1}");
        }
    }
    println!();

    // Throughput at the bound: the engines' removals and the index's own evictions both run.
    let bound = if quick { 50_000 } else { 200_000 };
    let (warm_n, run_n) = if quick {
        (40_000, 40_000)
    } else {
        (100_000, 200_000)
    };
    let all = workload(11, warm_n + run_n, bound / usize::from(WORKERS) + 2_000);
    let (warm, run) = all.split_at(warm_n);
    let blocks: usize = run
        .iter()
        .map(|(_, e)| match e {
            IndexEvent::Stored { blocks, .. } => blocks.len(),
            IndexEvent::Removed { blocks, .. } => blocks.len(),
            IndexEvent::Cleared { .. } => 0,
        })
        .sum();
    let per_event = blocks as f64 / run.len() as f64;
    let rate = median((0..5).map(|_| throughput(warm, run, bound)).collect());
    println!(
        "apply at the bound ({bound} entries, {} events of {per_event:.1} blocks, median of 5 runs)",
        run.len()
    );
    println!(
        "  {:>6.2} M events/s, {:>6.1} M blocks/s",
        rate / 1e6,
        rate * per_event / 1e6
    );
    println!();

    println!("one 64-block prefix held by every worker (median of 5 runs)");
    println!("{:>8} {:>14} {:>16}", "workers", "lookup", "remove+store");
    for slots in [8u16, 64, 512] {
        let rounds = if quick { 200 } else { 2_000 };
        let n: Vec<(f64, f64)> = (0..5).map(|_| wide(slots, rounds)).collect();
        let med = |f: fn(&(f64, f64)) -> f64| median(n.iter().map(f).collect());
        println!(
            "{slots:>8} {:>11.1} us {:>13.0} ns",
            med(|x| x.0) / 1e3,
            med(|x| x.1)
        );
    }
}
