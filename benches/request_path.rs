//! The filter's per-request compute path in kv mode, natively, for instruction counts under
//! callgrind (`benches/README` style: prints figures, asserts nothing timing-based).
//!
//! One iteration is what `decide_and_steer` computes for a completions request with token ids:
//! parse the body (token ids left in it), hash the prompt lazily, reading ids as blocks are
//! hashed (every block is held by one worker, so all of it is hashed: the worst case, unless
//! `<held blocks>` says fewer), check and count the ids not hashed, look up overlaps, read the load table from a shared store (one
//! `get` + decode + view into a reused buffer), decide, book (one CAS set on that read) and
//! release. Each stage is its own
//! `#[inline(never)]` function, so `callgrind_annotate --inclusive=yes` shows its share.
//!
//! Usage:
//!   cargo bench --bench request_path --no-run   # builds target/release/deps/request_path-*
//!   valgrind --tool=callgrind --callgrind-out-file=cg.out <binary> <tokens> <iters>
//!     [<workers> <in flight> <held blocks> <addresses> <holder every>]
//! (`<held blocks>`: only the prompt's first blocks in the index, default all of them;
//! `<addresses>`: the workers share this many addresses round-robin, default one each;
//! `<holder every>`: every this many-th worker holds the prompt, default only the first. The
//! Envoy fleet bench is `4096 N 1000 10000 64 4 4`: 1,000 entries over 4 mocks, the first
//! mock's 250 entries holding the prompt.)
//! Instructions per request = (Ir at iters N) - (Ir at iters 0), divided by N (the binary does
//! its setup either way). Without valgrind it prints the wall time per request.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use envoy_kv_router::config::Config;
use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::{local_block_hashes, prompt_sequence_hashes, DYNAMO_HASH_SEED};
use envoy_kv_router::index::KvIndex;
use envoy_kv_router::lazy_hash::PromptHasher;
use envoy_kv_router::load::SlotLoad;
use envoy_kv_router::load_store;
use envoy_kv_router::request::{parse_request_with, Endpoint, LlmRequest, ParseOptions, Pin};
use envoy_kv_router::router::{decide, prompt_blocks, RouteInput, SelectorState};
use envoy_kv_router::store::{SharedStore, StoreError};
use envoy_kv_router::types::{ExternalBlockHash, Overlap, SequenceHash, StorageTier};

const BLOCK_SIZE: u32 = 64;
/// Default worker count; the third number argument overrides it.
const WORKERS: usize = 8;

/// Envoy's shared data, in memory.
#[derive(Default)]
struct Store(RefCell<HashMap<String, (Vec<u8>, u32)>>);

impl SharedStore for Store {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.0.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.0.borrow_mut();
        let current = map.get(key).map(|(_, c)| *c);
        if cas.is_some_and(|c| c != 0) && current.is_some() && current != cas {
            return Err(StoreError::CasMismatch);
        }
        let next = current.unwrap_or(0) + 1;
        map.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

fn config(workers: usize, addresses: usize) -> Config {
    let workers: Vec<String> = (0..workers)
        .map(|i| {
            let a = i % addresses.max(1);
            format!(
                r#"{{"id": {}, "address": "10.{}.{}.1:8000"}}"#,
                i + 1,
                a / 256,
                a % 256
            )
        })
        .collect();
    let json = format!(
        r#"{{"mode": "kv", "block_size": {BLOCK_SIZE}, "workers": [{}]}}"#,
        workers.join(",")
    );
    Config::from_json(json.as_bytes()).unwrap()
}

/// Token ids as a tokenizer with a 128k vocabulary emits them (mostly 5-6 digits).
fn tokens(n: usize) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 128_256) as u32
        })
        .collect()
}

#[inline(never)]
fn stage_parse(body: &[u8]) -> LlmRequest {
    // As the filter parses: ids left in the body, read as blocks are hashed.
    let opts = ParseOptions {
        read_hints: false,
        lazy_token_ids: true,
        ..ParseOptions::default()
    };
    parse_request_with(body, Endpoint::Completions, &opts).unwrap()
}

#[inline(never)]
fn stage_hash(req: &mut LlmRequest, body: &[u8], index: &KvIndex) -> Vec<SequenceHash> {
    let lora = req.lora_name.clone();
    let mut h = match (&req.token_ids, &req.token_span) {
        (Some(ids), _) => PromptHasher::new(ids, BLOCK_SIZE, lora.as_deref()),
        (None, Some(span)) => PromptHasher::from_span(body, span, BLOCK_SIZE, lora.as_deref()),
        (None, None) => PromptHasher::new(&[], BLOCK_SIZE, lora.as_deref()),
    };
    h.hash_while_held(|s| index.holds_anywhere(s));
    // As the filter does: the ids not hashed are checked and counted before the decision.
    if let Some(span) = req.token_span.as_mut() {
        span.set_count(h.finish().unwrap());
    }
    h.into_hashes()
}

#[inline(never)]
fn stage_lookup(index: &KvIndex, hashes: &[SequenceHash], out: &mut Vec<Overlap>) {
    index.find_overlaps(hashes, out);
}

#[inline(never)]
fn stage_load(
    store: &Store,
    slots: usize,
    now: u64,
    out: &mut Vec<SlotLoad>,
    cache: &mut load_store::ViewCache,
) -> load_store::Snapshot {
    let mut snapshot = load_store::read_snapshot(store, slots);
    snapshot.view_with(now, out, cache);
    snapshot
}

#[inline(never)]
fn stage_decide(
    config: &Config,
    req: &LlmRequest,
    overlaps: &[Overlap],
    load: &[SlotLoad],
    selector: &mut SelectorState,
) -> envoy_kv_router::router::Decision {
    let input = RouteInput {
        request: req,
        header_pin: Pin::default(),
        prompt_blocks: prompt_blocks(config, req),
        overlaps,
        load,
        stale_slots: &[],
        kv_usage: &[],
        learned: None,
        arrivals_per_ms: 0.0,
    };
    decide(config, &input, selector).unwrap()
}

#[inline(never)]
fn stage_book(
    store: &Store,
    slots: usize,
    snapshot: load_store::Snapshot,
    key: u64,
    d: &envoy_kv_router::router::Decision,
    now: u64,
) {
    let ticket = load_store::update_slot_from(store, slots, d.slot, now, Some(snapshot), |t| {
        t.admit(key, d.slot, d.prefill_tokens, d.prompt_blocks, None, now)
    })
    .unwrap();
    load_store::update_slot(store, slots, ticket.slot, now, |t| {
        t.release_at(&ticket, now).then_some(())
    })
    .unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench`: take the numbers among the arguments.
    let nums: Vec<usize> = args.iter().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n_tokens = nums.first().copied().unwrap_or(4096);
    let iters = nums.get(1).copied().unwrap_or(100);
    let workers = nums.get(2).copied().unwrap_or(WORKERS);
    // Requests held in flight while the loop runs (booked round-robin, never released).
    let in_flight = nums.get(3).copied().unwrap_or(0);
    // Leading blocks of the prompt held in the index (default: all of them).
    let held = nums.get(4).copied();
    let addresses = nums.get(5).copied().unwrap_or(workers);
    let holder_every = nums.get(6).copied().unwrap_or(usize::MAX);
    let config = config(workers, addresses);
    let toks = tokens(n_tokens);
    let body = serde_json::json!({"model": "m", "prompt": toks, "max_tokens": 1}).to_string();
    // Every block held by slot 0 (unless `held` says fewer): lazy hashing hashes the whole
    // prompt (the worst case), else the held blocks and the first one nobody holds.
    let mut index = KvIndex::new(workers, 1 << 20);
    let mut locals = local_block_hashes(&toks, BLOCK_SIZE, DYNAMO_HASH_SEED);
    let seqs = prompt_sequence_hashes(&toks, BLOCK_SIZE, None);
    locals.truncate(held.unwrap_or(usize::MAX));
    let stored = IndexEvent::Stored {
        dp_rank: 0,
        tier: StorageTier::Device,
        parent: None,
        blocks: seqs
            .iter()
            .zip(&locals)
            .map(|(s, l)| (ExternalBlockHash(s.0 ^ 0x5555), *l))
            .collect(),
    };
    if !locals.is_empty() {
        for slot in (0..workers).step_by(holder_every.min(workers).max(1)) {
            index.apply(slot as u16, &stored).unwrap();
        }
    }
    let store = Store::default();
    load_store::init(&store, config.slots.len(), 900_000);
    for k in 0..in_flight {
        let slot = (k % workers) as u16;
        load_store::update_slot(&store, config.slots.len(), slot, 1_000, |t| {
            t.admit(1 << 40 | k as u64, slot, 4096, 64, None, 1_000)
        })
        .unwrap();
    }
    let mut selector = SelectorState::new(7);
    let mut overlaps = Vec::new();
    let mut load = Vec::new();
    let mut view_cache = load_store::ViewCache::default();
    let mut chosen = vec![0usize; workers];
    let start = Instant::now();
    for i in 0..iters {
        let now = 1_000 + i as u64;
        let mut req = stage_parse(black_box(body.as_bytes()));
        let hashes = stage_hash(&mut req, body.as_bytes(), &index);
        stage_lookup(&index, &hashes, &mut overlaps);
        let snapshot = stage_load(&store, config.slots.len(), now, &mut load, &mut view_cache);
        let d = stage_decide(&config, &req, &overlaps, &load, &mut selector);
        stage_book(&store, config.slots.len(), snapshot, i as u64, &d, now);
        chosen[usize::from(d.slot)] += 1;
        black_box(&d);
    }
    let per = start.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64;
    println!(
        "workers {workers} in flight {in_flight} tokens {n_tokens} body {} B blocks {} iters {iters}: {per:.1} us/request (wall), chosen by slot 0..8 {:?}",
        body.len(),
        seqs.len(),
        &chosen[..workers.min(8)]
    );
}
