//! The routing core's logic tests, written once and run both natively (`cargo test`) and on
//! wasm32 under Node (`bash scripts/test-wasm.sh`, wasm-bindgen-test). On wasm32 `usize` is 32
//! bits while hashes, engine block ids and worker ids stay u64: these tests pin the values that
//! would break if any of them went through `usize` (hashes above 2^32, negative i64 engine
//! hashes, event ids up to 2^63 - 1, snapshot and log codecs).

// Tests fail by panicking; indexing known-length fixtures keeps them readable.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use envoy_kv_router::config::Config;
use envoy_kv_router::events::{
    decode_log_batch, encode_log_batch, parse_dump, parse_event_page, IndexEvent, LogRecord,
    NumberedEvent, ReportedLoad, MAX_EVENT_ID,
};
use envoy_kv_router::hashing::{
    hash_seed, local_block_hashes, prompt_sequence_hashes, sequence_hashes, DYNAMO_HASH_SEED,
};
use envoy_kv_router::index::{IndexError, KvIndex};
use envoy_kv_router::load::LoadTable;
use envoy_kv_router::request::{parse_request, parse_request_with, Endpoint, ParseOptions, Pin};
use envoy_kv_router::router::{decide, prompt_blocks, Reason, RouteInput, SelectorState};
use envoy_kv_router::types::{
    ExternalBlockHash, LocalBlockHash, Overlap, SequenceHash, SlotIdx, StorageTier,
};
use serde::Deserialize;

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test;

// Node, not a browser: the runner's default. Stated so that nobody adds `run_in_browser`.
#[cfg(target_arch = "wasm32")]
wasm_bindgen_test::wasm_bindgen_test_configure!(run_in_node_experimental);

/// Marks a test for both targets: a plain `#[test]` natively, `#[wasm_bindgen_test]` on wasm32.
macro_rules! both {
    ($(fn $name:ident() $body:block)*) => {$(
        #[cfg_attr(not(target_arch = "wasm32"), test)]
        #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test)]
        fn $name() $body
    )*};
}

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

const BS: u32 = 4;

/// Tiny deterministic PRNG for event streams.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `n_blocks * BS` token ids, spread over the whole u32 range (ids above 2^31 included).
fn tokens(seed: u32, n_blocks: u32) -> Vec<u32> {
    (0..n_blocks * BS)
        .map(|i| seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(0x9e37_79b9))
        .collect()
}

/// One prompt's hashes, and the events a worker would send for it.
struct Prompt {
    locals: Vec<LocalBlockHash>,
    seqs: Vec<SequenceHash>,
}

impl Prompt {
    fn new(tokens: &[u32]) -> Self {
        Prompt {
            locals: local_block_hashes(tokens, BS, DYNAMO_HASH_SEED),
            seqs: prompt_sequence_hashes(tokens, BS, None),
        }
    }

    /// Engine block hash: full 64-bit values, different per slot.
    fn ext(&self, slot: SlotIdx, i: usize) -> ExternalBlockHash {
        ExternalBlockHash(self.seqs[i].0 ^ (u64::from(slot) + 1).wrapping_mul(0xabcd_ef01_2345))
    }

    fn stored(
        &self,
        slot: SlotIdx,
        range: core::ops::Range<usize>,
        tier: StorageTier,
    ) -> IndexEvent {
        IndexEvent::Stored {
            dp_rank: 0,
            tier,
            parent: range.start.checked_sub(1).map(|p| self.ext(slot, p)),
            blocks: range.map(|i| (self.ext(slot, i), self.locals[i])).collect(),
        }
    }

    fn removed(
        &self,
        slot: SlotIdx,
        range: core::ops::Range<usize>,
        tier: StorageTier,
    ) -> IndexEvent {
        IndexEvent::Removed {
            dp_rank: 0,
            tier,
            blocks: range.map(|i| self.ext(slot, i)).collect(),
        }
    }
}

fn ov(device: u32, host: u32, disk: u32) -> Overlap {
    Overlap {
        device_blocks: device,
        host_blocks: host,
        disk_blocks: disk,
    }
}

fn overlaps(index: &KvIndex, prompt: &[SequenceHash]) -> Vec<Overlap> {
    let mut out = Vec::new();
    index.find_overlaps(prompt, &mut out);
    out
}

/// A pseudo-random stream of stored / removed / cleared events over 120 prompts sharing 5
/// prefixes, as (slot, event).
fn stream(seed: u64, len: usize, num_slots: u16) -> (Vec<Prompt>, Vec<(SlotIdx, IndexEvent)>) {
    let mut rng = Lcg(seed);
    let prompts: Vec<Prompt> = (0..120u32)
        .map(|i| {
            let mut t = tokens(i % 5, 6);
            t.extend(tokens(1000 + i, 6 + i % 7));
            Prompt::new(&t)
        })
        .collect();
    let tiers = [StorageTier::Device, StorageTier::Host, StorageTier::Disk];
    let mut events = Vec::with_capacity(len);
    for _ in 0..len {
        let slot = rng.below(usize::from(num_slots)) as SlotIdx;
        let p = &prompts[rng.below(prompts.len())];
        let n = p.seqs.len();
        let start = if rng.below(3) == 0 { 0 } else { rng.below(n) };
        let end = (start + 1 + rng.below(8)).min(n);
        let tier = tiers[rng.below(10).min(2)];
        let event = match rng.below(1000) {
            0..=649 => p.stored(slot, start..end, tier),
            650..=994 => p.removed(slot, start..end, tier),
            _ => IndexEvent::Cleared { dp_rank: None },
        };
        events.push((slot, event));
    }
    (prompts, events)
}

fn all_overlaps(index: &KvIndex, prompts: &[Prompt]) -> Vec<Vec<Overlap>> {
    prompts.iter().map(|p| overlaps(index, &p.seqs)).collect()
}

#[derive(Deserialize)]
struct Vectors {
    vectors: Vec<Vector>,
}

#[derive(Deserialize)]
struct Vector {
    name: String,
    tokens: Vec<u32>,
    block_size: u32,
    lora_name: Option<String>,
    seed: String,
    local_hashes: Vec<String>,
    sequence_hashes: Vec<String>,
}

/// A parse with the ids left in the body (the filter's), its span's ids read back (or, as the
/// filter does when they are not ids, the body parsed again eagerly).
fn lazy_parse(
    body: &str,
) -> Result<envoy_kv_router::request::LlmRequest, envoy_kv_router::request::RequestError> {
    let opts = ParseOptions {
        lazy_token_ids: true,
        ..ParseOptions::default()
    };
    let mut r = parse_request_with(body.as_bytes(), Endpoint::Completions, &opts)?;
    if let Some(span) = r.token_span.take() {
        match span.ids(body.as_bytes()) {
            Some(ids) => r.token_ids = Some(ids),
            // Not an array of ids after all: the filter parses the body again, eagerly.
            None => return parse_request(body.as_bytes(), Endpoint::Completions),
        }
    }
    Ok(r)
}

fn parse_u64s(values: &[String]) -> Vec<u64> {
    values.iter().map(|v| v.parse::<u64>().unwrap()).collect()
}

const MAX_PAGE: usize = 1 << 20;

/// `router_random_ties_are_the_same_sequence_on_every_target`'s picks, computed natively.
const PINNED_TIE_PICKS: [u16; 24] = [
    2, 4, 0, 2, 2, 1, 1, 3, 0, 4, 4, 1, 4, 2, 0, 0, 0, 2, 0, 4, 0, 4, 2, 1,
];

both! {

fn target_word_size_is_what_we_think() {
    // The point of running these on wasm32: make sure we really are on a 32-bit usize there.
    #[cfg(target_arch = "wasm32")]
    assert_eq!(core::mem::size_of::<usize>(), 4);
    #[cfg(not(target_arch = "wasm32"))]
    assert!(core::mem::size_of::<usize>() >= 4);
}

// ---------------------------------------------------------------------------------------------
// Hashing
// ---------------------------------------------------------------------------------------------

fn hashes_match_independent_python_vectors() {
    let file: Vectors = serde_json::from_str(include_str!("data/hash_vectors.json")).unwrap();
    assert!(file.vectors.len() >= 30, "vector file looks truncated");
    let mut checked_blocks = 0usize;
    let mut above_u32 = 0usize;
    for v in &file.vectors {
        let label = format!("{} bs={} lora={:?}", v.name, v.block_size, v.lora_name);
        let lora = v.lora_name.as_deref();
        let seed = hash_seed(lora);
        assert_eq!(seed.to_string(), v.seed, "seed for {label}");
        let locals = local_block_hashes(&v.tokens, v.block_size, seed);
        let expected_locals: Vec<LocalBlockHash> = parse_u64s(&v.local_hashes)
            .into_iter()
            .map(LocalBlockHash)
            .collect();
        assert_eq!(locals, expected_locals, "local hashes for {label}");
        let expected_seq: Vec<SequenceHash> = parse_u64s(&v.sequence_hashes)
            .into_iter()
            .map(SequenceHash)
            .collect();
        assert_eq!(sequence_hashes(&locals, None), expected_seq, "chain for {label}");
        assert_eq!(
            prompt_sequence_hashes(&v.tokens, v.block_size, lora),
            expected_seq,
            "request path for {label}"
        );
        checked_blocks += expected_seq.len();
        above_u32 += expected_seq.iter().filter(|s| s.0 > u64::from(u32::MAX)).count();
    }
    assert!(checked_blocks > 100, "too few blocks checked: {checked_blocks}");
    assert!(above_u32 > 50, "vectors should exercise the high 32 bits: {above_u32}");
}

fn partial_blocks_and_zero_block_size_hash_nothing() {
    let t = tokens(9, 3);
    assert_eq!(prompt_sequence_hashes(&t[..11], BS, None).len(), 2);
    assert!(prompt_sequence_hashes(&t, 0, None).is_empty());
    assert!(prompt_sequence_hashes(&t, 1024, None).is_empty());
    assert_eq!(
        prompt_sequence_hashes(&t[..8], BS, None),
        prompt_sequence_hashes(&t, BS, None)[..2].to_vec()
    );
}

// ---------------------------------------------------------------------------------------------
// KV index
// ---------------------------------------------------------------------------------------------

fn index_worked_example_device_overlaps_2_5_8_of_10() {
    let p = Prompt::new(&tokens(1, 10));
    let mut index = KvIndex::new(3, 1000);
    for (slot, n) in [(0u16, 2usize), (1, 5), (2, 8)] {
        index
            .apply(slot, &p.stored(slot, 0..n, StorageTier::Device))
            .unwrap();
    }
    assert_eq!(
        overlaps(&index, &p.seqs),
        vec![ov(2, 0, 0), ov(5, 0, 0), ov(8, 0, 0)]
    );
    assert_eq!(index.entries(), 15);
    assert_eq!(index.slot_blocks(1), 5);
    // A prompt diverging at block 3 matches at most 3 blocks anywhere.
    let mut other = tokens(1, 10);
    other[3 * BS as usize] ^= 1;
    let q = prompt_sequence_hashes(&other, BS, None);
    assert_eq!(
        overlaps(&index, &q),
        vec![ov(2, 0, 0), ov(3, 0, 0), ov(3, 0, 0)]
    );
    // The same tokens under a LoRA adapter match nothing.
    let salted = prompt_sequence_hashes(&tokens(1, 10), BS, Some("adapter"));
    assert_eq!(overlaps(&index, &salted), vec![ov(0, 0, 0); 3]);
}

fn index_host_and_disk_continue_the_device_prefix() {
    let p = Prompt::new(&tokens(2, 12));
    let mut index = KvIndex::new(2, 1000);
    index.apply(0, &p.stored(0, 0..3, StorageTier::Device)).unwrap();
    index.apply(0, &p.stored(0, 0..6, StorageTier::Host)).unwrap();
    index.apply(0, &p.stored(0, 6..8, StorageTier::Disk)).unwrap();
    index.apply(1, &p.stored(1, 0..2, StorageTier::Host)).unwrap();
    assert_eq!(overlaps(&index, &p.seqs), vec![ov(3, 3, 2), ov(0, 2, 0)]);
    assert_eq!(index.entries(), 8 + 2, "a block on two tiers is one entry");
    assert_eq!(
        index.tiers_held(0, p.seqs[1]),
        vec![StorageTier::Device, StorageTier::Host]
    );
    // Removing the device copy of block 1 ends the device run there.
    index.apply(0, &p.removed(0, 1..2, StorageTier::Device)).unwrap();
    assert_eq!(overlaps(&index, &p.seqs)[0], ov(1, 5, 2));
    // Unknown parents are refused and change nothing.
    let before = index.encode_snapshot();
    assert!(matches!(
        index.apply(1, &p.stored(0, 5..6, StorageTier::Device)),
        Err(IndexError::UnknownParent { slot: 1, .. })
    ));
    assert_eq!(index.encode_snapshot(), before);
}

fn index_eviction_keeps_entries_within_the_bound() {
    let (prompts, events) = stream(11, 12_000, 4);
    let bound = 300;
    let mut index = KvIndex::new(4, bound);
    let mut evicted = 0usize;
    let mut stored = 0usize;
    for (i, (slot, event)) in events.iter().enumerate() {
        match index.apply(*slot, event) {
            Ok(stats) => {
                evicted += stats.evicted_blocks;
                stored += stats.stored_blocks;
            }
            Err(IndexError::UnknownParent { .. }) => {}
            Err(e) => panic!("event {i}: {e}"),
        }
        assert!(index.entries() <= bound, "entries {} at event {i}", index.entries());
    }
    assert!(stored > 5_000, "stored {stored}");
    assert!(evicted > 1_000, "the stream should force evictions: {evicted}");
    let per_slot: usize = (0..4).map(|s| index.slot_blocks(s)).sum();
    assert_eq!(per_slot, index.entries());
    // Evictions come from the fullest slot, so slots stay balanced.
    let sizes: Vec<usize> = (0..4).map(|s| index.slot_blocks(s)).collect();
    let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
    assert!(max - min <= 150, "unbalanced eviction: {sizes:?}");
    assert!(all_overlaps(&index, &prompts)
        .iter()
        .flatten()
        .any(|o| o.total_blocks() > 0));
}

fn index_snapshot_round_trip_and_replay_agree() {
    let (prompts, events) = stream(21, 10_000, 5);
    let (first, rest) = events.split_at(5_000);
    let mut index = KvIndex::new(5, 400);
    for (slot, event) in first {
        let _ = index.apply(*slot, event);
    }
    let bytes = index.encode_snapshot();
    assert_eq!(&bytes[..4], b"EKS\x02");
    let mut copy = KvIndex::decode_snapshot(&bytes, 5, 400).unwrap();
    assert_eq!(copy.entries(), index.entries());
    assert_eq!(copy.encode_snapshot(), bytes);
    let before = all_overlaps(&index, &prompts);
    assert!(before.iter().flatten().any(|o| o.total_blocks() > 3), "stream too sparse");
    assert_eq!(all_overlaps(&copy, &prompts), before);
    let mut evicted = 0;
    for (slot, event) in rest {
        let result = index.apply(*slot, event);
        assert_eq!(result, copy.apply(*slot, event));
        evicted += result.map_or(0, |s| s.evicted_blocks);
    }
    assert!(evicted > 100, "the replay should exercise eviction: {evicted}");
    assert_eq!(all_overlaps(&copy, &prompts), all_overlaps(&index, &prompts));
    assert_eq!(copy.encode_snapshot(), index.encode_snapshot());
    // A smaller bound on load evicts down to it; bad input is an error, never a panic.
    assert_eq!(KvIndex::decode_snapshot(&bytes, 5, 50).unwrap().entries(), 50);
    assert!(KvIndex::decode_snapshot(&bytes, 4, 400).is_err());
    for len in (0..bytes.len()).step_by(7) {
        assert!(KvIndex::decode_snapshot(&bytes[..len], 5, 400).is_err(), "len {len}");
    }
}

// ---------------------------------------------------------------------------------------------
// Event pages and the shared-log codec
// ---------------------------------------------------------------------------------------------

fn event_page_parses_dynamo_and_vllm_shapes_with_64_bit_values() {
    let body = r#"{"block_size": 4, "first_event_id": 4294967296, "last_event_id": 9223372036854775807,
        "events": [
          {"event_id": 4294967297, "dp_rank": 1, "storage_tier": "host_pinned",
           "data": {"stored": {"parent_hash": 18446744073709551615,
                               "blocks": [{"block_hash": -2, "tokens_hash": "12345678901234567890"}]}}},
          {"worker_id": 1, "storage_tier": "disk", "event": {"event_id": 4294967298, "dp_rank": 2,
           "data": {"removed": {"block_hashes": [4294967296, -9223372036854775808]}}}},
          {"event_id": 4294967299, "type": "BlockStored", "block_hashes": [10, -20],
           "parent_block_hash": null, "token_ids": [1, 2, 3, 4, 4294967295, 6, 7, 8],
           "block_size": 4, "lora_name": "ad", "medium": "GPU"},
          {"event_id": 4294967300, "type": "AllBlocksCleared"},
          {"event_id": 9223372036854775807, "dp_rank": 3, "data": "cleared"}
        ],
        "load": {"num_waiting": 2, "num_running": 4294967295, "kv_usage": 0.5}}"#;
    let page = parse_event_page(body.as_bytes(), 4, MAX_PAGE).unwrap();
    assert_eq!(page.first_event_id, Some(1 << 32));
    assert_eq!(page.last_event_id, MAX_EVENT_ID);
    assert_eq!(
        page.load,
        Some(ReportedLoad { num_waiting: 2, num_running: u32::MAX, kv_usage: 0.5, other_routers: None })
    );
    let ids: Vec<u64> = page.events.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, vec![(1 << 32) + 1, (1 << 32) + 2, (1 << 32) + 3, (1 << 32) + 4, MAX_EVENT_ID]);
    assert_eq!(
        page.events[0].event,
        IndexEvent::Stored {
            dp_rank: 1,
            tier: StorageTier::Host,
            parent: Some(ExternalBlockHash(u64::MAX)),
            blocks: vec![(ExternalBlockHash(u64::MAX - 1), LocalBlockHash(12_345_678_901_234_567_890))],
        }
    );
    assert_eq!(
        page.events[1].event,
        IndexEvent::Removed {
            dp_rank: 2,
            tier: StorageTier::Disk,
            blocks: vec![ExternalBlockHash(1 << 32), ExternalBlockHash(1 << 63)],
        }
    );
    let salted = local_block_hashes(&[1, 2, 3, 4, u32::MAX, 6, 7, 8], 4, hash_seed(Some("ad")));
    assert_eq!(
        page.events[2].event,
        IndexEvent::Stored {
            dp_rank: 0,
            tier: StorageTier::Device,
            parent: None,
            blocks: vec![
                (ExternalBlockHash(10), salted[0]),
                (ExternalBlockHash((-20i64) as u64), salted[1]),
            ],
        }
    );
    assert_eq!(page.events[3].event, IndexEvent::Cleared { dp_rank: None });
    assert_eq!(page.events[4].event, IndexEvent::Cleared { dp_rank: Some(3) });
}

fn event_page_errors_reject_the_whole_page() {
    let ok = r#"{"block_size": 4, "last_event_id": 2, "events": [
        {"event_id": 1, "data": "cleared"}, {"event_id": 2, "data": "cleared"}]}"#;
    assert_eq!(parse_event_page(ok.as_bytes(), 4, MAX_PAGE).unwrap().events.len(), 2);
    // Wrong block size, over the size limit, bad JSON, unknown type, an id that overflows u64.
    assert!(parse_event_page(ok.as_bytes(), 16, MAX_PAGE).is_err());
    assert!(parse_event_page(ok.as_bytes(), 4, 10).is_err());
    assert!(parse_event_page(&ok.as_bytes()[..40], 4, MAX_PAGE).is_err());
    let bad_type = ok.replace(r#""data": "cleared"}]"#, r#""type": "Nope"}]"#);
    assert!(parse_event_page(bad_type.as_bytes(), 4, MAX_PAGE).is_err());
    let overflow = ok.replace(r#""event_id": 2,"#, r#""event_id": 18446744073709551616,"#);
    assert!(parse_event_page(overflow.as_bytes(), 4, MAX_PAGE).is_err());
    // Ids past 2^63 - 1 leave no room for the next one: a protocol error.
    let absurd = ok.replace(r#""last_event_id": 2"#, r#""last_event_id": 18446744073709551615"#);
    assert!(parse_event_page(absurd.as_bytes(), 4, MAX_PAGE).is_err());
    // A dump takes only stored events, ids optional.
    let dump = r#"{"block_size": 4, "last_event_id": 57, "events": [
        {"data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 7, "tokens_hash": 99}]}}}]}"#;
    let page = parse_dump(dump.as_bytes(), 4, MAX_PAGE).unwrap();
    assert_eq!((page.last_event_id, page.events.len()), (57, 1));
    assert!(parse_dump(ok.as_bytes(), 4, MAX_PAGE).is_err());
}

fn parsed_events_drive_the_index() {
    // A vLLM worker stores a 3-block prompt; the index must match the request path's hashes.
    let toks = tokens(77, 3);
    let token_json = format!("{toks:?}");
    let body = format!(
        r#"{{"block_size": 4, "last_event_id": 1, "events": [{{"event_id": 1, "type": "BlockStored",
            "block_hashes": [-1, -2, -3], "parent_block_hash": null, "token_ids": {token_json},
            "block_size": 4, "lora_name": null, "medium": "GPU"}}]}}"#
    );
    let page = parse_event_page(body.as_bytes(), 4, MAX_PAGE).unwrap();
    let mut index = KvIndex::new(2, 100);
    for e in &page.events {
        index.apply(1, &e.event).unwrap();
    }
    let seqs = prompt_sequence_hashes(&toks, BS, None);
    assert_eq!(overlaps(&index, &seqs), vec![ov(0, 0, 0), ov(3, 0, 0)]);
}

fn log_batch_round_trip_with_extreme_values() {
    let records = vec![
        LogRecord::Events {
            worker: 3,
            events: vec![
                NumberedEvent {
                    event_id: u64::MAX,
                    event: IndexEvent::Stored {
                        dp_rank: u32::MAX,
                        tier: StorageTier::Host,
                        parent: Some(ExternalBlockHash(u64::MAX)),
                        blocks: vec![
                            (ExternalBlockHash(1 << 63), LocalBlockHash(u64::MAX - 7)),
                            (ExternalBlockHash(1 << 32), LocalBlockHash(1)),
                        ],
                    },
                },
                NumberedEvent {
                    event_id: 1 << 40,
                    event: IndexEvent::Removed {
                        dp_rank: 7,
                        tier: StorageTier::Disk,
                        blocks: vec![ExternalBlockHash(1), ExternalBlockHash(u64::MAX)],
                    },
                },
                NumberedEvent {
                    event_id: 0,
                    event: IndexEvent::Cleared { dp_rank: None },
                },
            ],
        },
        LogRecord::Resync {
            worker: u16::MAX,
            last_event_id: (1 << 33) + 5,
            events: vec![NumberedEvent {
                event_id: 0,
                event: IndexEvent::Stored {
                    dp_rank: 0,
                    tier: StorageTier::Device,
                    parent: None,
                    blocks: vec![(ExternalBlockHash(5), LocalBlockHash(6))],
                },
            }],
        },
        LogRecord::WorkerLost { worker: 0 },
    ];
    let bytes = encode_log_batch(&records);
    assert_eq!(&bytes[..4], b"EKL\x01");
    assert_eq!(decode_log_batch(&bytes), Ok(records));
    assert_eq!(decode_log_batch(&encode_log_batch(&[])), Ok(vec![]));
    for len in 0..bytes.len() {
        assert!(decode_log_batch(&bytes[..len]).is_err(), "truncated to {len} decoded");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(decode_log_batch(&longer).is_err());
    // A length prefix near u32::MAX must be refused, not allocated (on wasm32 that is all memory).
    let mut huge = b"EKL\x01".to_vec();
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode_log_batch(&huge).is_err());
    let mut rng = Lcg(5);
    for _ in 0..500 {
        let mut b = bytes.clone();
        let pos = rng.below(b.len());
        b[pos] = rng.next() as u8;
        let _ = decode_log_batch(&b);
    }
}

// ---------------------------------------------------------------------------------------------
// Request parsing
// ---------------------------------------------------------------------------------------------

fn request_token_ids_and_pins_keep_full_width() {
    let body = br#"{"model": "m", "prompt": [1, 2], "stream": true,
        "nvext": {"token_data": [0, 4294967295, 2147483648], "backend_instance_id": 18446744073709551615,
                  "dp_rank": 4294967295, "allowed_worker_ids": [4294967296, 7],
                  "agent_hints": {"osl": 4294967295}, "lora_name": "ad"}}"#;
    let r = parse_request(body, Endpoint::Completions).unwrap();
    assert_eq!(r.model.as_deref(), Some("m"));
    assert_eq!(r.token_ids, Some(vec![0, u32::MAX, 1 << 31]));
    assert_eq!(r.pin.worker_id, Some(u64::MAX));
    assert_eq!(r.pin.dp_rank, Some(u32::MAX));
    assert_eq!(r.allowed_worker_ids, Some(vec![1 << 32, 7]));
    assert_eq!(r.osl_hint_tokens, Some(u32::MAX));
    assert_eq!(r.lora_name.as_deref(), Some("ad"));
    assert!(r.stream);
    // Token ids past u32 are a field error, not a silent truncation.
    assert!(parse_request(br#"{"prompt": [4294967296]}"#, Endpoint::Completions).is_err());
    let chat = parse_request(
        br#"{"messages": [{"role": "user", "content": "hello"}]}"#,
        Endpoint::ChatCompletions,
    )
    .unwrap();
    // Every string inside `messages` counts (role included): "user" + "hello".
    assert_eq!((chat.token_ids, chat.text_chars), (None, 9));
}

// The token-id scan (8-byte loads, u64 arithmetic) reads ids of every length the same on
// wasm32 as natively, in compact and spaced arrays, and refuses what serde refuses.
fn token_id_scan_agrees_with_serde() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let ids: Vec<u32> = (0..5000)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Every digit count from 1 to 10.
            (x % 10u64.pow(1 + i % 10)).min(u64::from(u32::MAX)) as u32
        })
        .collect();
    for sep in [",", ", ", " ,\n"] {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        let body = format!(r#"{{"model": "m", "prompt": [{}], "stream": false}}"#, list.join(sep));
        let request = parse_request(body.as_bytes(), Endpoint::Completions).unwrap();
        assert_eq!(request.token_ids.as_deref(), Some(&ids[..]), "{sep:?}");
        assert_eq!(lazy_parse(&body), Ok(request), "{sep:?}");
        // Ids of 1 to 7 digits: the lazy parse leaves them in the body.
        let short: Vec<String> = ids.iter().map(|i| (i % 10_000_000).to_string()).collect();
        let body = format!(r#"{{"prompt": [{}]}}"#, short.join(sep));
        let want: Vec<u32> = ids.iter().map(|i| i % 10_000_000).collect();
        assert_eq!(lazy_parse(&body).unwrap().token_ids, Some(want), "{sep:?}");
    }
    for bad in ["[1,01]", "[1,2,]", "[1,-2]", "[1,2.0]", "[4294967296]", "[1 2]", "[1,2"] {
        let body = format!(r#"{{"prompt": {bad}}}"#);
        assert!(
            parse_request(body.as_bytes(), Endpoint::Completions).is_err(),
            "{bad}"
        );
        assert!(lazy_parse(&body).is_err(), "{bad}");
    }
}

// Arrays in the shapes the SWAR run reads (`,` and `, `), shifted so that ids start at every
// offset of an 8-byte load, with one odd spot (leading zeros, long ids, whitespace variants,
// damage) and fewer than 8 bytes after the array or a body after it: the request's token ids
// are serde's reading of the array, or both refuse it.
fn token_id_scan_agrees_with_serde_at_every_offset() {
    let mut rng = Lcg(0x0ff5e7);
    let odd = [
        "", " ", "\t", "\n", "  ", " ,", ",,", "0", "00", "01", "12345678", "123456789",
        "4294967295", "4294967296", "-", ".", "e", "]",
    ];
    for round in 0..3_000 {
        let sep = [",", ", "][round % 2];
        let list: Vec<String> = (0..1 + rng.below(20))
            .map(|_| (rng.next() % 10u64.pow(1 + rng.below(8) as u32)).to_string())
            .collect();
        let mut array = format!("[{}]", list.join(sep));
        let at = 1 + rng.below(array.len() - 1);
        array.insert_str(at, odd[rng.below(odd.len())]);
        let pad = " ".repeat(round % 8);
        let tail = [", \"max_tokens\": 1}", "}"][round % 2];
        let body = format!(r#"{{"model": "m","prompt":{pad}{array}{tail}"#);
        let want = serde_json::from_str::<Vec<u32>>(&array).ok();
        let got = parse_request(body.as_bytes(), Endpoint::Completions);
        match (&want, &got) {
            (Some(ids), Ok(r)) => assert_eq!(r.token_ids.as_ref(), Some(ids), "{body}"),
            (None, Err(_)) => {}
            _ => panic!("{body}: serde {want:?}, parser {got:?}"),
        }
        // As the filter parses (64-byte simd128 masks, ids read from the body on demand): the
        // same answer.
        assert_eq!(lazy_parse(&body), got, "{body}");
    }
}



// ---------------------------------------------------------------------------------------------
// Routing: the cost worked example, end to end
// ---------------------------------------------------------------------------------------------

fn router_worked_example_end_to_end() {
    // Dynamo's documented example: block size 16, a 160-token prompt (10 blocks), device
    // overlaps 2/5/8, existing decode loads 2/0/7 (10/5/9 with this request's new blocks).
    // Costs 8+10 = 18, 5+5 = 10, 2+9 = 11: worker 2 wins, then 3, then 1.
    // The seed's Dynamo cost is this test's subject.
    let config = Config::from_json(
        br#"{"policy": "dynamo", "block_size": 16, "workers": [
              {"id": 1, "address": "10.0.0.1:8000"},
              {"id": 4294967298, "address": "10.0.0.2:8000"},
              {"id": 3, "address": "10.0.0.3:8000"}]}"#,
    )
    .unwrap();
    let ids: Vec<u32> = (0..160u32).map(|i| u32::MAX - i * 7919).collect();
    let body = format!(r#"{{"model": "m", "prompt": {ids:?}, "max_tokens": 16}}"#);
    let request = parse_request(body.as_bytes(), Endpoint::Completions).unwrap();
    assert_eq!(request.token_ids.as_deref(), Some(&ids[..]));

    // The workers' caches, as events, in the index.
    let locals = local_block_hashes(&ids, 16, DYNAMO_HASH_SEED);
    let seqs = prompt_sequence_hashes(&ids, 16, None);
    let mut index = KvIndex::new(config.num_slots(), 1000);
    for (slot, n) in [(0u16, 2usize), (1, 5), (2, 8)] {
        let event = IndexEvent::Stored {
            dp_rank: 0,
            tier: StorageTier::Device,
            parent: None,
            blocks: (0..n)
                .map(|i| (ExternalBlockHash(u64::MAX - i as u64), locals[i]))
                .collect(),
        };
        index.apply(slot, &event).unwrap();
    }
    let overlaps = overlaps(&index, &seqs);
    assert_eq!(overlaps, vec![ov(2, 0, 0), ov(5, 0, 0), ov(8, 0, 0)]);

    // Requests in flight past their prefill: 2 decode blocks on slot 0, 7 on slot 2. The table
    // goes through its shared-data codec, as it would between Envoy threads.
    let mut table = LoadTable::new(config.num_slots());
    assert!(table.admit(u64::MAX, 0, 0, 2, None, 1_000).is_some());
    assert!(table.admit(1 << 40, 2, 0, 7, None, 1_000).is_some());
    let table = LoadTable::decode(&table.encode(), config.num_slots()).unwrap();
    let load = table.view(1_000);
    let decode: Vec<f64> = load.iter().map(|l| l.decode_blocks).collect();
    assert_eq!(decode, vec![2.0, 0.0, 7.0]);
    assert!(load.iter().all(|l| l.prefill_tokens == 0.0));

    let input = RouteInput {
        request: &request,
        header_pin: Pin::default(),
        prompt_blocks: prompt_blocks(&config, &request),
        overlaps: &overlaps,
        load: &load,
        stale_slots: &[],
        kv_usage: &[],
        learned: None,
        arrivals_per_ms: 0.0,
    };
    assert_eq!(input.prompt_blocks, 10);
    let d = decide(&config, &input, &mut SelectorState::new(1)).unwrap();
    assert_eq!(d.scores, vec![(0, 18.0), (1, 10.0), (2, 11.0)]);
    assert_eq!((d.slot, d.cost, d.reason), (1, Some(10.0), Reason::Kv));
    assert_eq!(config.workers[usize::from(d.slot)].id, 4_294_967_298);
    assert_eq!(d.overlap, ov(5, 0, 0));
    assert_eq!((d.isl_tokens, d.prefill_tokens, d.prompt_blocks), (160, 80, 5));
    assert_eq!(d.fallbacks, vec![2, 0]);
}

fn router_random_ties_are_the_same_sequence_on_every_target() {
    // Equal costs everywhere: the pick comes from the seeded RNG. Pinned values (computed
    // natively) must come out identically on wasm32, or replicas would diverge by platform.
    // The seed's cost, so that the costs stay equal (the default's request-share term would
    // tell the slots apart after the first pick).
    let config = Config::from_json(
        br#"{"policy": "dynamo", "workers": [
              {"id": 1, "address": "10.0.0.1:8000"}, {"id": 2, "address": "10.0.0.2:8000"},
              {"id": 3, "address": "10.0.0.3:8000"}, {"id": 4, "address": "10.0.0.4:8000"},
              {"id": 5, "address": "10.0.0.5:8000"}]}"#,
    )
    .unwrap();
    let request = parse_request(br#"{"prompt": [1, 2, 3]}"#, Endpoint::Completions).unwrap();
    let input = RouteInput {
        request: &request,
        header_pin: Pin::default(),
        prompt_blocks: prompt_blocks(&config, &request),
        overlaps: &[],
        load: &[],
        stale_slots: &[],
        kv_usage: &[],
        learned: None,
        arrivals_per_ms: 0.0,
    };
    let mut state = SelectorState::new(0x5eed);
    let picks: Vec<u16> = (0..24)
        .map(|_| decide(&config, &input, &mut state).unwrap().slot)
        .collect();
    assert_eq!(picks, PINNED_TIE_PICKS.to_vec());
}
}

/// Found by this suite on wasm32: `block_size * 4` (the scratch buffer) overflowed `usize` for
/// block sizes near `u32::MAX` and `Vec::with_capacity` panicked before the zero-block return.
#[cfg_attr(not(target_arch = "wasm32"), test)]
#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test)]
fn huge_block_size_hashes_nothing_without_allocating() {
    let t = tokens(9, 3);
    assert!(prompt_sequence_hashes(&t, u32::MAX, None).is_empty());
    assert!(local_block_hashes(&t, u32::MAX, DYNAMO_HASH_SEED).is_empty());
}

/// The priority is an i64 built from a u64 clock through f64 (`usize` is 32 bits here): the
/// value and the splice are the same on wasm32 as natively.
#[cfg_attr(not(target_arch = "wasm32"), test)]
#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test)]
fn the_engine_priority_is_the_same_on_wasm32() {
    use envoy_kv_router::config::EnginePriorityConfig;
    use envoy_kv_router::priority::{request_priority, splice_priority, EPOCH_MS};
    let by_arrival = EnginePriorityConfig {
        arrival_weight: 1.0,
    };
    // Five years after the epoch (1.6e11 ms) and 40.5 ms of prefill, in µs: past 2^32.
    let now = EPOCH_MS + 157_680_000_000;
    assert_eq!(
        request_priority(&by_arrival, 40.5, now),
        157_680_000_040_500
    );
    let s = splice_priority(br#"{"model":"m"}"#, 157_680_000_040_500).unwrap();
    assert_eq!(
        (s.drain, s.insert.as_slice()),
        (1, &br#"{"priority":157680000040500,"#[..])
    );
}
