//! The compact `KvIndex` against the one it replaced (`index_differential/reference.rs`), fed the
//! same pseudo-random event streams: every `apply` result (stats, errors), entry counts, per-slot
//! counts, overlaps of every prompt and held tiers must agree, evictions included.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

#[path = "index_differential/reference.rs"]
mod legacy;

use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::{local_block_hashes, prompt_sequence_hashes, DYNAMO_HASH_SEED};
use envoy_kv_router::index::KvIndex;
use envoy_kv_router::types::{
    ExternalBlockHash, LocalBlockHash, Overlap, SequenceHash, SlotIdx, StorageTier,
};

const BS: u32 = 4;

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

struct Prompt {
    locals: Vec<LocalBlockHash>,
    seqs: Vec<SequenceHash>,
}

fn prompts() -> Vec<Prompt> {
    (0..150u32)
        .map(|i| {
            // 6 shared 5-block prefixes, then a private tail.
            let mut t: Vec<u32> = (0..5 * BS).map(|j| ((i % 6) * 7_919) ^ j).collect();
            t.extend((0..(3 + i % 9) * BS).map(|j| ((1_000 + i) * 104_729) ^ j));
            Prompt {
                locals: local_block_hashes(&t, BS, DYNAMO_HASH_SEED),
                seqs: prompt_sequence_hashes(&t, BS, None),
            }
        })
        .collect()
}

/// Engine block hash of block `i` of `p` on `slot`; now and then a small shared id instead, so
/// engines also name one prefix twice and reuse a hash for other content.
fn ext(p: &Prompt, slot: SlotIdx, i: usize, rng: &mut Lcg) -> ExternalBlockHash {
    if rng.below(40) == 0 {
        ExternalBlockHash(rng.below(30) as u64)
    } else {
        ExternalBlockHash(p.seqs[i].0 ^ (u64::from(slot) + 1).wrapping_mul(0xabcd_ef01_2345))
    }
}

fn event(prompts: &[Prompt], slots: u16, rng: &mut Lcg) -> (SlotIdx, IndexEvent) {
    let slot = rng.below(usize::from(slots)) as SlotIdx;
    let p = &prompts[rng.below(prompts.len())];
    let n = p.seqs.len();
    let start = if rng.below(3) == 0 { 0 } else { rng.below(n) };
    let end = (start + 1 + rng.below(8)).min(n);
    let tier = [StorageTier::Device, StorageTier::Host, StorageTier::Disk][rng.below(8).min(2)];
    let event = match rng.below(1000) {
        0..=639 => IndexEvent::Stored {
            dp_rank: 0,
            tier,
            parent: start.checked_sub(1).map(|i| ext(p, slot, i, rng)),
            blocks: (start..end)
                .map(|i| (ext(p, slot, i, rng), p.locals[i]))
                .collect(),
        },
        640..=994 => IndexEvent::Removed {
            dp_rank: 0,
            tier,
            blocks: (start..end).map(|i| ext(p, slot, i, rng)).collect(),
        },
        _ => IndexEvent::Cleared { dp_rank: None },
    };
    (slot, event)
}

fn overlaps_new(index: &KvIndex, seqs: &[SequenceHash]) -> Vec<Overlap> {
    let mut out = Vec::new();
    index.find_overlaps(seqs, &mut out);
    out
}

fn overlaps_old(index: &legacy::KvIndex, seqs: &[SequenceHash]) -> Vec<Overlap> {
    let mut out = Vec::new();
    index.find_overlaps(seqs, &mut out);
    out
}

fn run(seed: u64, slots: u16, max_blocks: usize, events: usize) {
    let prompts = prompts();
    let mut rng = Lcg(seed);
    let mut new = KvIndex::new(usize::from(slots), max_blocks);
    let mut old = legacy::KvIndex::new(usize::from(slots), max_blocks);
    let mut evicted = 0;
    for step in 0..events {
        let (slot, event) = event(&prompts, slots, &mut rng);
        let result = new.apply(slot, &event);
        assert_eq!(result, old.apply(slot, &event), "seed {seed} step {step}");
        evicted += result.map_or(0, |s| s.evicted_blocks);
        assert_eq!(new.entries(), old.entries(), "step {step}");
        for s in 0..slots {
            assert_eq!(
                new.slot_blocks(s),
                old.slot_blocks(s),
                "step {step} slot {s}"
            );
        }
        if step % 50 == 0 {
            for p in &prompts {
                assert_eq!(
                    overlaps_new(&new, &p.seqs),
                    overlaps_old(&old, &p.seqs),
                    "seed {seed} step {step}"
                );
                let seq = p.seqs[rng.below(p.seqs.len())];
                assert_eq!(new.holds_anywhere(seq), old.holds_anywhere(seq));
                assert_eq!(new.tiers_held(slot, seq), old.tiers_held(slot, seq));
            }
        }
    }
    if max_blocks < 1_000 {
        assert!(
            evicted > 1_000,
            "the stream should force evictions: {evicted}"
        );
    }
    // A snapshot of the new index replays like the old index too.
    let mut copy =
        KvIndex::decode_snapshot(&new.encode_snapshot(), usize::from(slots), max_blocks).unwrap();
    for _ in 0..2_000 {
        let (slot, event) = event(&prompts, slots, &mut rng);
        assert_eq!(copy.apply(slot, &event), old.apply(slot, &event));
    }
    for p in &prompts {
        assert_eq!(overlaps_new(&copy, &p.seqs), overlaps_old(&old, &p.seqs));
    }
}

#[test]
fn agrees_with_the_previous_index_under_eviction() {
    for seed in 1..=4 {
        run(seed, 4, 300, 15_000);
    }
}

#[test]
fn agrees_with_the_previous_index_without_eviction_and_with_many_slots() {
    run(7, 1, 100_000, 8_000);
    run(8, 40, 500, 15_000);
}
