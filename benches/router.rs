//! Hot-path benchmark of the routing core (native, std only). Prints figures; asserts none.
//!
//! For prompts of 1k, 8k, 32k and 128k tokens (block size 64) against an index pre-filled from
//! a realistic event stream (8 workers, ~200k entries, shared system prompts and multi-turn
//! conversations), it times each per-request stage side by side in one loop:
//!
//! * `parse`:  `request::parse_request` on an OpenAI completions body with token ids,
//! * `hash`:   `hashing::prompt_sequence_hashes`,
//! * `lookup`: `index::KvIndex::find_overlaps`,
//! * `decide`: `router::decide` (kv mode: filters, Dynamo cost, argmin with random ties,
//!   fallbacks) over the 8 slots' overlaps and a load table with 64 requests in flight,
//!
//! and reports the median and p99 per request, ns per prompt block, and the index's memory per
//! entry measured with a counting global allocator.
//!
//! Usage: `cargo bench --bench router [-- --quick]` (`make bench`). Native figures: on wasm32 (V8) expect the
//! compute stages to be slower and the index smaller (4-byte pointers).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use envoy_kv_router::config::Config;
use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::{local_block_hashes, prompt_sequence_hashes, DYNAMO_HASH_SEED};
use envoy_kv_router::index::KvIndex;
use envoy_kv_router::lazy_hash::PromptHasher;
use envoy_kv_router::load::{LoadTable, SlotLoad};
use envoy_kv_router::request::{parse_request, Endpoint, Pin};
use envoy_kv_router::router::{decide, prompt_blocks, RouteInput, SelectorState};
use envoy_kv_router::types::{ExternalBlockHash, Overlap, SequenceHash, SlotIdx, StorageTier};

// ---------------------------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------------------------

/// `System`, counting bytes allocated and freed (a realloc counts as free + alloc).
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static FREED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to `System`; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        FREED.fetch_add(layout.size(), Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        FREED.fetch_add(layout.size(), Relaxed);
        ALLOCATED.fetch_add(new_size, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Clone, Copy)]
struct AllocMark {
    allocated: usize,
    freed: usize,
}

impl AllocMark {
    fn now() -> Self {
        AllocMark {
            allocated: ALLOCATED.load(Relaxed),
            freed: FREED.load(Relaxed),
        }
    }

    /// (bytes allocated since `self`, net live bytes gained since `self`).
    fn since(self) -> (usize, isize) {
        let now = AllocMark::now();
        let allocated = now.allocated - self.allocated;
        let freed = now.freed - self.freed;
        (allocated, allocated as isize - freed as isize)
    }
}

// ---------------------------------------------------------------------------------------------
// Workload
// ---------------------------------------------------------------------------------------------

const BLOCK_SIZE: u32 = 64;
const WORKERS: u16 = 8;
const TARGET_ENTRIES: usize = 200_000;
const VOCAB: u64 = 128_256;

/// splitmix64: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(VOCAB) as u32).collect()
    }
}

/// A prompt as the index sees it: per-block local and sequence hashes.
struct Chain {
    locals: Vec<envoy_kv_router::types::LocalBlockHash>,
    seqs: Vec<SequenceHash>,
}

impl Chain {
    fn new(tokens: &[u32]) -> Self {
        Chain {
            locals: local_block_hashes(tokens, BLOCK_SIZE, DYNAMO_HASH_SEED),
            seqs: prompt_sequence_hashes(tokens, BLOCK_SIZE, None),
        }
    }

    /// Engine block hash on `slot`: content-determined, engine-specific.
    fn ext(&self, slot: SlotIdx, i: usize) -> ExternalBlockHash {
        ExternalBlockHash(
            self.seqs[i].0 ^ (u64::from(slot) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d),
        )
    }

    /// The "stored" event for blocks `from..` as an engine emits it after a prefill (blocks
    /// already cached are not re-announced, the first new block names its parent).
    fn stored(&self, slot: SlotIdx, from: usize) -> IndexEvent {
        IndexEvent::Stored {
            dp_rank: 0,
            tier: StorageTier::Device,
            parent: from.checked_sub(1).map(|p| self.ext(slot, p)),
            blocks: (from..self.seqs.len())
                .map(|i| (self.ext(slot, i), self.locals[i]))
                .collect(),
        }
    }

    fn removed(&self, slot: SlotIdx, range: core::ops::Range<usize>) -> IndexEvent {
        IndexEvent::Removed {
            dp_rank: 0,
            tier: StorageTier::Device,
            blocks: range.map(|i| self.ext(slot, i)).collect(),
        }
    }
}

#[derive(Default)]
struct Stream {
    events: usize,
    stored_blocks: usize,
    evicted_blocks: usize,
    unknown_parent: usize,
}

/// A realistic event source: 24 system prompts (4-32 blocks, Zipf-ish popularity) followed by
/// conversations of 1-6 turns, each turn extending the previous one by 2-40 blocks and
/// prefilled on one worker (the same one 80% of the time, as a KV-aware router would do).
/// Engines announce only the new blocks; 10% of turns are followed by the engine dropping a
/// few tail blocks.
struct Workload {
    rng: Rng,
    systems: Vec<Vec<u32>>,
}

impl Workload {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let systems = (0..24)
            .map(|_| {
                let blocks = 4 + rng.below(29) as usize;
                rng.tokens(blocks * BLOCK_SIZE as usize)
            })
            .collect();
        Workload { rng, systems }
    }

    /// At least `stored_blocks` blocks' worth of (slot, event), generated up front so that
    /// applying them allocates nothing but the index's own memory.
    fn events(&mut self, stored_blocks: usize) -> Vec<(SlotIdx, IndexEvent)> {
        let mut out = Vec::new();
        let mut stored = 0usize;
        let rng = &mut self.rng;
        while stored < stored_blocks {
            let sys = &self.systems[(rng.below(24) * rng.below(24) / 24) as usize];
            let mut tokens = sys.clone();
            let mut slot = rng.below(u64::from(WORKERS)) as SlotIdx;
            let mut held = 0usize; // blocks of this conversation announced on `slot`
            for _turn in 0..1 + rng.below(6) {
                let add = 2 + rng.below(39) as usize;
                tokens.extend(rng.tokens(add * BLOCK_SIZE as usize));
                let chain = Chain::new(&tokens);
                if rng.below(5) == 0 {
                    slot = rng.below(u64::from(WORKERS)) as SlotIdx;
                    held = 0;
                }
                stored += chain.seqs.len() - held;
                out.push((slot, chain.stored(slot, held)));
                held = chain.seqs.len();
                if rng.below(10) == 0 {
                    let n = chain.seqs.len();
                    let cut = n - 1 - rng.below(n.min(8) as u64) as usize;
                    out.push((slot, chain.removed(slot, cut..n)));
                    held = cut;
                }
            }
        }
        out
    }
}

/// Applies `events` in order until `done` (checked after each).
fn apply_until(
    index: &mut KvIndex,
    events: &[(SlotIdx, IndexEvent)],
    done: impl Fn(&KvIndex, &Stream) -> bool,
) -> Stream {
    let mut s = Stream::default();
    for (slot, e) in events {
        s.events += 1;
        match index.apply(*slot, e) {
            Ok(st) => {
                s.stored_blocks += st.stored_blocks;
                s.evicted_blocks += st.evicted_blocks;
            }
            Err(_) => s.unknown_parent += 1,
        }
        if done(index, &s) {
            break;
        }
    }
    s
}

/// A completions body with token ids, as an OpenAI-compatible client sends it.
fn openai_body(tokens: &[u32]) -> Vec<u8> {
    let mut body = String::with_capacity(tokens.len() * 8 + 256);
    body.push_str(r#"{"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": ["#);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            body.push_str(", ");
        }
        body.push_str(&t.to_string());
    }
    body.push_str(
        r#"], "max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "stream": true,
 "stream_options": {"include_usage": true}, "user": "bench",
 "nvext": {"agent_hints": {"osl": 256}}}"#,
    );
    body.into_bytes()
}

/// A query prompt of `n_tokens`: its first half is an earlier turn cached on two workers (whose
/// first 8 blocks, the system prompt, every worker holds), the rest is new.
fn query_prompt(index: &mut KvIndex, n_tokens: usize, rng: &mut Rng) -> Vec<u32> {
    let bs = BLOCK_SIZE as usize;
    let tokens = rng.tokens(n_tokens);
    let head = Chain::new(&tokens[..n_tokens / bs / 2 * bs]);
    let system = Chain::new(&tokens[..8 * bs]);
    for slot in 0..WORKERS {
        let chain = if slot == 1 || slot == 5 {
            &head
        } else {
            &system
        };
        index.apply(slot, &chain.stored(slot, 0)).unwrap();
    }
    tokens
}

/// The filter configuration: kv mode, 8 workers on distinct addresses, two fallbacks.
fn config() -> Config {
    let workers: Vec<String> = (0..WORKERS)
        .map(|i| {
            format!(
                r#"{{"id": {}, "address": "10.0.0.{}:8000", "kv_capacity_blocks": 16384,
                    "max_num_batched_tokens": 8192, "taints": ["a100"]}}"#,
                i + 1,
                i + 1
            )
        })
        .collect();
    let json = format!(
        r#"{{"mode": "kv", "block_size": {BLOCK_SIZE}, "fallback_count": 2,
            "index": {{"max_blocks": {TARGET_ENTRIES}}}, "workers": [{}]}}"#,
        workers.join(",")
    );
    Config::from_json(json.as_bytes()).unwrap()
}

/// The slots' load as the router reads it: 64 requests in flight, some still in prefill.
fn load_view(config: &Config, rng: &mut Rng) -> Vec<SlotLoad> {
    let mut table = LoadTable::new(config.num_slots());
    for key in 0..64u64 {
        let slot = rng.below(u64::from(WORKERS)) as SlotIdx;
        let prompt_tokens = 512 + rng.below(16_384) as u32;
        let ticket = table.admit(
            key,
            slot,
            prompt_tokens,
            prompt_tokens / BLOCK_SIZE,
            None,
            1_000,
        );
        if let Some(ticket) = ticket.filter(|_| rng.below(4) != 0) {
            table.first_token(&ticket, 1_100);
        }
    }
    LoadTable::decode(&table.encode(), config.num_slots())
        .unwrap()
        .view(1_200)
}

// ---------------------------------------------------------------------------------------------
// Measurement
// ---------------------------------------------------------------------------------------------

struct Samples(Vec<Duration>);

impl Samples {
    fn quantile(&mut self, q: f64) -> Duration {
        self.0.sort_unstable();
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i]
    }
}

fn time<T>(samples: &mut Samples, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = black_box(f());
    samples.0.push(start.elapsed());
    out
}

fn fmt_dur(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} us", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

struct Row {
    tokens: usize,
    blocks: usize,
    matched: Overlap,
    /// How often `decide` chose each slot (1 and 5 hold the prompt's cached half).
    chosen: Vec<u32>,
    body_bytes: usize,
    iters: usize,
    stages: Vec<(&'static str, Duration, Duration)>,
    /// Lazy hashing (the filter's kv path): median time and blocks hashed.
    lazy: (Duration, usize),
}

fn bench_prompt(
    index: &mut KvIndex,
    config: &Config,
    n_tokens: usize,
    iters: usize,
    rng: &mut Rng,
) -> Row {
    let tokens = query_prompt(index, n_tokens, rng);
    let load = load_view(config, rng);
    let mut selector = SelectorState::new(rng.next());
    let body = openai_body(&tokens);
    let index = &*index;
    let mut parse = Samples(Vec::with_capacity(iters));
    let mut hash = Samples(Vec::with_capacity(iters));
    let mut lookup = Samples(Vec::with_capacity(iters));
    let mut route = Samples(Vec::with_capacity(iters));
    let mut lazy = Samples(Vec::with_capacity(iters));
    let mut lazy_blocks = 0;
    let mut lazy_overlaps = Vec::with_capacity(index.num_slots());
    let mut overlaps = Vec::with_capacity(index.num_slots());
    let mut chosen = vec![0u32; index.num_slots()];
    let warmup = iters / 10 + 1;
    for i in 0..warmup + iters {
        let req = time(&mut parse, || {
            parse_request(&body, Endpoint::Completions).unwrap()
        });
        let ids = req.token_ids.as_deref().unwrap();
        let seqs = time(&mut hash, || prompt_sequence_hashes(ids, BLOCK_SIZE, None));
        time(&mut lookup, || index.find_overlaps(&seqs, &mut overlaps));
        // The filter hashes lazily: only up to the first block no worker holds.
        let lazy_seqs = time(&mut lazy, || {
            let mut h = PromptHasher::new(ids, BLOCK_SIZE, None);
            h.hash_while_held(|s| index.holds_anywhere(s));
            h.into_hashes()
        });
        lazy_blocks = lazy_seqs.len();
        index.find_overlaps(&lazy_seqs, &mut lazy_overlaps);
        assert_eq!(lazy_overlaps, overlaps, "lazy hashing changed the overlaps");
        let input = RouteInput {
            request: &req,
            header_pin: Pin::default(),
            prompt_blocks: prompt_blocks(config, &req),
            overlaps: &overlaps,
            load: &load,
            stale_slots: &[],
            kv_usage: &[],
            learned: None,
            arrivals_per_ms: 0.0,
        };
        let decision = time(&mut route, || {
            decide(config, &input, &mut selector).unwrap()
        });
        chosen[usize::from(decision.slot)] += 1;
        if i + 1 == warmup {
            for s in [&mut parse, &mut hash, &mut lookup, &mut route, &mut lazy] {
                s.0.clear();
            }
            chosen.fill(0);
        }
    }
    let best = overlaps
        .iter()
        .copied()
        .max_by_key(Overlap::total_blocks)
        .unwrap_or_default();
    let mut total = Samples(
        (0..parse.0.len())
            .map(|i| parse.0[i] + hash.0[i] + lookup.0[i] + route.0[i])
            .collect(),
    );
    let mut stages = Vec::new();
    for (name, s) in [
        ("parse", &mut parse),
        ("hash", &mut hash),
        ("lookup", &mut lookup),
        ("decide", &mut route),
        ("total", &mut total),
    ] {
        let median = s.quantile(0.5);
        let p99 = s.quantile(0.99);
        stages.push((name, median, p99));
    }
    Row {
        tokens: n_tokens,
        blocks: n_tokens / BLOCK_SIZE as usize,
        matched: best,
        chosen,
        body_bytes: body.len(),
        iters,
        stages,
        lazy: (lazy.quantile(0.5), lazy_blocks),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    println!("bench router: block_size {BLOCK_SIZE}, {WORKERS} workers, native build");
    println!();

    // Index memory per entry at a few sizes (no eviction while building).
    println!("index memory (counting allocator; net = bytes still held by the index afterwards)");
    println!(
        "{:>9} {:>9} {:>13} {:>17} {:>10}",
        "entries", "events", "net B/entry", "allocated B/entry", "build ms"
    );
    let events = Workload::new(7).events(2 * TARGET_ENTRIES);
    for target in [25_000, 100_000, TARGET_ENTRIES] {
        let mark = AllocMark::now();
        let start = Instant::now();
        let mut index = KvIndex::new(usize::from(WORKERS), usize::MAX);
        let s = apply_until(&mut index, &events, |i, _| i.entries() >= target);
        let elapsed = start.elapsed();
        let (allocated, net) = mark.since();
        let n = index.entries();
        println!(
            "{:>9} {:>9} {:>13.1} {:>17.1} {:>10.1}",
            n,
            s.events,
            net as f64 / n as f64,
            allocated as f64 / n as f64,
            elapsed.as_secs_f64() * 1e3
        );
        drop(black_box(index));
    }
    drop(events);
    println!();

    // The lookup index: filled to its bound, then run at the bound until as many blocks again
    // have been stored, so eviction has shaped it.
    let events = Workload::new(42).events(3 * TARGET_ENTRIES);
    let mut index = KvIndex::new(usize::from(WORKERS), TARGET_ENTRIES);
    let filled = apply_until(&mut index, &events, |i, _| i.entries() >= TARGET_ENTRIES);
    let steady = apply_until(&mut index, &events[filled.events..], |_, s| {
        s.stored_blocks >= TARGET_ENTRIES
    });
    drop(events);
    let per_slot: Vec<usize> = (0..WORKERS).map(|s| index.slot_blocks(s)).collect();
    println!(
        "lookup index: {} entries (bound {TARGET_ENTRIES}), per worker {per_slot:?}",
        index.entries()
    );
    println!(
        "  fill: {} events, {} blocks stored; at the bound: {} events, {} stored, {} evicted, {} unknown-parent",
        filled.events,
        filled.stored_blocks,
        steady.events,
        steady.stored_blocks,
        steady.evicted_blocks,
        steady.unknown_parent
    );
    println!();

    let mut rng = Rng(99);
    let config = config();
    let plan = [
        (1_024, 20_000),
        (8_192, 4_000),
        (32_768, 1_500),
        (131_072, 400),
    ];
    let rows: Vec<Row> = plan
        .iter()
        .map(|&(n_tokens, iters)| {
            bench_prompt(
                &mut index,
                &config,
                n_tokens,
                (iters / scale).max(10),
                &mut rng,
            )
        })
        .collect();

    println!("per-request time, median / p99 (the four stages run one after the other in each iteration)");
    println!(
        "{:>7} {:>6} {:>6} {:>6} {:>19} {:>19} {:>19} {:>19} {:>19}",
        "tokens", "blocks", "body", "iters", "parse", "hash", "lookup", "decide", "total"
    );
    for r in &rows {
        let cells: Vec<String> = r
            .stages
            .iter()
            .map(|(_, median, p99)| format!("{} / {}", fmt_dur(*median), fmt_dur(*p99)))
            .collect();
        println!(
            "{:>7} {:>6} {:>5}K {:>6} {:>19} {:>19} {:>19} {:>19} {:>19}",
            r.tokens,
            r.blocks,
            r.body_bytes / 1024,
            r.iters,
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4]
        );
    }
    println!();
    println!("per unit (medians) and outcome");
    println!(
        "{:>7} {:>10} {:>10} {:>10} {:>10} {:>11}  decide picks per slot",
        "tokens", "parse/tok", "hash/blk", "look/blk", "look/hit", "hit d/h/x"
    );
    for r in &rows {
        let per = |i: usize, n: u32| {
            format!(
                "{:.1} ns",
                r.stages[i].1.as_nanos() as f64 / f64::from(n.max(1))
            )
        };
        println!(
            "{:>7} {:>10} {:>10} {:>10} {:>10} {:>11}  {:?}",
            r.tokens,
            per(0, r.tokens as u32),
            per(1, r.blocks as u32),
            per(2, r.blocks as u32),
            per(2, r.matched.total_blocks()),
            format!(
                "{}/{}/{}",
                r.matched.device_blocks, r.matched.host_blocks, r.matched.disk_blocks
            ),
            r.chosen
        );
    }
    println!();
    println!(
        "*/blk: median / prompt blocks; look/hit: lookup median / matched blocks of the best slot"
    );
    println!("hit d/h/x: the best slot's matched device/host/disk blocks (slots 1 and 5 hold half the prompt)");
    println!();
    println!("lazy hashing (the filter's kv path: hash up to the first block no worker holds; same overlaps, asserted)");
    println!(
        "{:>7} {:>12} {:>12} {:>14} {:>8}",
        "tokens", "full hash", "lazy hash", "blocks hashed", "ratio"
    );
    for r in &rows {
        let full = r.stages[1].1;
        println!(
            "{:>7} {:>12} {:>12} {:>7} / {:<6} {:>7.1}x",
            r.tokens,
            fmt_dur(full),
            fmt_dur(r.lazy.0),
            r.lazy.1,
            r.blocks,
            full.as_secs_f64() / r.lazy.0.as_secs_f64().max(1e-12)
        );
    }
}
