//! `KvIndex`: which slot holds which prefix (sequence hash) on which tier.
//!
//! # Design note
//!
//! Every Envoy thread holds one replica, rebuilt from the shared event log, so application must be
//! deterministic: hash maps use a fixed hasher, nothing depends on map iteration order, and
//! eviction picks victims by (most blocks, lowest slot index) and per-slot insertion order.
//!
//! Two structures, kept in step by every mutation:
//! * per slot, `blocks`: engine block hash -> (sequence hash, tier mask, stamp). Events name
//!   blocks by the engine's hash, so "removed", "cleared", eviction and worker loss are exact.
//! * global, `holders`: sequence hash -> the slots holding it, with per-tier reference counts
//!   (two engine hashes of one slot may name the same prefix). Lookup walks the prompt once and
//!   touches only the holders of matched blocks: O(sum of holders over matched blocks).
//!
//! Invariants:
//! * `entries` == sum of `blocks.len()` over slots <= `max_blocks` after every public mutation.
//! * A slot appears in `holders[seq]` with count c on tier t iff c of its `blocks` map to `seq`
//!   with tier t set; a `holders` value is never empty.
//! * Each live block has exactly one FIFO element carrying its current stamp (older elements for
//!   the same block are stale and skipped); a slot's FIFO is compacted when it exceeds twice its
//!   live blocks plus a slack, so it stays O(live blocks).
//!
//! Eviction is oldest-stored first (a re-store refreshes), from the slot holding the most blocks.
//! Parents are usually older than children, so eviction may orphan a chain's tail; lookups stop
//! at the first missing block, so orphans only waste space until they are evicted in turn, and a
//! later "stored" that names an evicted parent is reported as `UnknownParent`.
//!
//! Memory per (block, slot) entry on wasm32, roughly: slot map 24 B + control byte at 50-87%
//! load (~30-55 B), FIFO 16-32 B, plus per distinct prefix ~32 B at 50-87% load in `holders`:
//! about 80-130 B, so 1 Mi entries cost ~80-130 MB in every replica.

use core::cmp::Reverse;
use core::fmt;
use core::hash::{BuildHasherDefault, Hasher};
use std::collections::VecDeque;

use crate::events::{tier_code, IndexEvent};
use crate::hashing::chain_sequence_hash;
use crate::types::{ExternalBlockHash, Overlap, SequenceHash, SlotIdx, StorageTier};

mod snapshot;

/// Keys are already hashes, so a multiply-and-fold is enough mixing (and spreads small test ids
/// across hashbrown's control bits). Fixed, so iteration order is the same in every replica.
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let m = self.0.wrapping_mul(MIX);
        m ^ (m >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(MIX);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.rotate_left(5) ^ v;
    }
}

type FixedMap<K, V> = hashbrown::HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// FIFO elements allowed beyond twice the live blocks before a slot's FIFO is compacted.
const FIFO_SLACK: usize = 64;

/// Slots are addressed by `SlotIdx` (u16).
const MAX_SLOTS: usize = 1 << 16;

fn tier_bit(tier: StorageTier) -> u8 {
    1 << tier_code(tier)
}

const DEVICE_BIT: u8 = 1;
const ALL_TIERS: u8 = 0b111;
const TIERS: [StorageTier; 3] = [StorageTier::Device, StorageTier::Host, StorageTier::Disk];

/// One block as one slot holds it.
#[derive(Clone, Copy, Debug)]
struct SlotBlock {
    seq: SequenceHash,
    /// Insertion stamp; matches exactly one FIFO element (the live one).
    stamp: u32,
    /// Bit per tier (`tier_bit`); never 0 while the block is in the map.
    tiers: u8,
}

#[derive(Default, Clone, Debug)]
struct Slot {
    blocks: FixedMap<ExternalBlockHash, SlotBlock>,
    /// Insertion order for eviction, with lazy deletion: (block, stamp when pushed).
    fifo: VecDeque<(ExternalBlockHash, u32)>,
}

impl Slot {
    fn is_live(&self, ext: &ExternalBlockHash, stamp: u32) -> bool {
        self.blocks.get(ext).is_some_and(|b| b.stamp == stamp)
    }
}

/// One slot's hold on one sequence hash: how many of its engine blocks map to it, per tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    slot: SlotIdx,
    counts: [u32; 3],
}

impl Holder {
    fn mask(&self) -> u8 {
        self.counts
            .iter()
            .enumerate()
            .fold(0, |m, (i, &c)| if c > 0 { m | (1 << i) } else { m })
    }
}

/// The slots holding one sequence hash. Most prefixes live on one slot, so that case is inline.
#[derive(Clone, Debug)]
enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => core::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    fn get_mut(&mut self, slot: SlotIdx) -> Option<&mut Holder> {
        match self {
            Holders::One(h) => Some(h).filter(|h| h.slot == slot),
            Holders::Many(v) => v.iter_mut().find(|h| h.slot == slot),
        }
    }

    fn push(&mut self, holder: Holder) {
        match self {
            Holders::One(first) => *self = Holders::Many(vec![*first, holder]),
            Holders::Many(v) => v.push(holder),
        }
    }

    /// Drops `slot`; returns true when no holder is left.
    fn remove(&mut self, slot: SlotIdx) -> bool {
        match self {
            Holders::One(h) => h.slot == slot,
            Holders::Many(v) => {
                v.retain(|h| h.slot != slot);
                match v.as_slice() {
                    [] => true,
                    [only] => {
                        *self = Holders::One(*only);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

fn holder_add(
    holders: &mut FixedMap<SequenceHash, Holders>,
    seq: SequenceHash,
    slot: SlotIdx,
    tiers: u8,
) {
    let add = |h: &mut Holder| {
        for (i, count) in h.counts.iter_mut().enumerate() {
            if tiers & (1 << i) != 0 {
                *count = count.saturating_add(1);
            }
        }
    };
    let mut fresh = Holder {
        slot,
        counts: [0; 3],
    };
    match holders.get_mut(&seq) {
        Some(set) => match set.get_mut(slot) {
            Some(h) => add(h),
            None => {
                add(&mut fresh);
                set.push(fresh);
            }
        },
        None => {
            add(&mut fresh);
            holders.insert(seq, Holders::One(fresh));
        }
    }
}

fn holder_sub(
    holders: &mut FixedMap<SequenceHash, Holders>,
    seq: SequenceHash,
    slot: SlotIdx,
    tiers: u8,
) {
    let Some(set) = holders.get_mut(&seq) else {
        return;
    };
    let Some(h) = set.get_mut(slot) else {
        return;
    };
    for (i, count) in h.counts.iter_mut().enumerate() {
        if tiers & (1 << i) != 0 {
            *count = count.saturating_sub(1);
        }
    }
    if h.mask() == 0 && set.remove(slot) {
        holders.remove(&seq);
    }
}

/// What one `apply` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Blocks named by a "stored" event (new entries and tier additions alike).
    pub stored_blocks: usize,
    /// Block-tier placements dropped by a "removed" event.
    pub removed_blocks: usize,
    /// "removed" blocks this slot did not hold on that tier (evicted earlier, or never seen).
    pub unknown_removed_blocks: usize,
    /// Entries dropped by a "cleared" event.
    pub cleared_blocks: usize,
    /// Entries evicted to stay within `max_blocks` (from any slot).
    pub evicted_blocks: usize,
}

impl ApplyStats {
    pub fn add(&mut self, other: &ApplyStats) {
        self.stored_blocks = self.stored_blocks.saturating_add(other.stored_blocks);
        self.removed_blocks = self.removed_blocks.saturating_add(other.removed_blocks);
        self.unknown_removed_blocks = self
            .unknown_removed_blocks
            .saturating_add(other.unknown_removed_blocks);
        self.cleared_blocks = self.cleared_blocks.saturating_add(other.cleared_blocks);
        self.evicted_blocks = self.evicted_blocks.saturating_add(other.evicted_blocks);
    }
}

/// Why an event could not be applied. The index is unchanged in every case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexError {
    /// The slot index is outside the index's slots (configuration and log disagree).
    SlotOutOfRange { slot: SlotIdx, num_slots: usize },
    /// A "stored" event names a parent this slot does not hold: it was evicted here, or events
    /// were lost. The blocks cannot be placed (their prefix hash is unknown); expected after
    /// evictions, so count it rather than re-syncing.
    UnknownParent {
        slot: SlotIdx,
        parent: ExternalBlockHash,
    },
}

impl fmt::Display for IndexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SlotOutOfRange { slot, num_slots } => {
                write!(f, "slot {slot} out of range (index has {num_slots} slots)")
            }
            Self::UnknownParent { slot, parent } => write!(
                f,
                "slot {slot}: stored blocks follow unknown parent block {}",
                parent.0
            ),
        }
    }
}

impl std::error::Error for IndexError {}

/// The in-VM replica of every slot's cached prefixes. See the module note.
#[derive(Clone, Debug)]
pub struct KvIndex {
    slots: Vec<Slot>,
    holders: FixedMap<SequenceHash, Holders>,
    /// (block, slot) pairs held.
    entries: usize,
    max_blocks: usize,
    next_stamp: u32,
}

impl KvIndex {
    /// An empty index for `num_slots` slots (at most 65536) holding at most `max_blocks`
    /// (block, slot) entries.
    pub fn new(num_slots: usize, max_blocks: usize) -> Self {
        KvIndex {
            slots: vec![Slot::default(); num_slots.min(MAX_SLOTS)],
            holders: FixedMap::default(),
            entries: 0,
            max_blocks,
            next_stamp: 0,
        }
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// (block, slot) pairs held; a block on several tiers of one slot counts once.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Blocks held by one slot (0 for an unknown slot).
    pub fn slot_blocks(&self, slot: SlotIdx) -> usize {
        self.slots
            .get(usize::from(slot))
            .map_or(0, |s| s.blocks.len())
    }

    fn check_slot(&self, slot: SlotIdx) -> Result<usize, IndexError> {
        let idx = usize::from(slot);
        if idx < self.slots.len() {
            Ok(idx)
        } else {
            Err(IndexError::SlotOutOfRange {
                slot,
                num_slots: self.slots.len(),
            })
        }
    }

    /// Applies one normalized event to one slot. `Cleared` clears just this slot (the caller maps
    /// a whole-worker clear to each of its slots). On `Err` nothing changed.
    pub fn apply(&mut self, slot: SlotIdx, event: &IndexEvent) -> Result<ApplyStats, IndexError> {
        let idx = self.check_slot(slot)?;
        let mut stats = ApplyStats::default();
        match event {
            IndexEvent::Stored {
                tier,
                parent,
                blocks,
                ..
            } => {
                let mut prev = match parent {
                    None => None,
                    Some(parent) => {
                        let seq = self
                            .slots
                            .get(idx)
                            .and_then(|s| s.blocks.get(parent))
                            .map(|b| b.seq);
                        match seq {
                            Some(seq) => Some(seq),
                            None => {
                                return Err(IndexError::UnknownParent {
                                    slot,
                                    parent: *parent,
                                })
                            }
                        }
                    }
                };
                for &(ext, local) in blocks {
                    let seq = chain_sequence_hash(prev, local);
                    self.insert_block(slot, ext, seq, tier_bit(*tier));
                    stats.stored_blocks = stats.stored_blocks.saturating_add(1);
                    prev = Some(seq);
                }
            }
            IndexEvent::Removed { tier, blocks, .. } => {
                for ext in blocks {
                    if self.remove_block_tiers(slot, *ext, tier_bit(*tier)) {
                        stats.removed_blocks = stats.removed_blocks.saturating_add(1);
                    } else {
                        stats.unknown_removed_blocks =
                            stats.unknown_removed_blocks.saturating_add(1);
                    }
                }
            }
            IndexEvent::Cleared { .. } => {
                stats.cleared_blocks = self.clear_slot(slot);
            }
        }
        self.compact_fifo(idx);
        self.enforce_bound(&mut stats);
        Ok(stats)
    }

    /// Places `ext` (prefix `seq`) on the tiers in `tiers` for `slot`, refreshing its age.
    fn insert_block(
        &mut self,
        slot: SlotIdx,
        ext: ExternalBlockHash,
        seq: SequenceHash,
        tiers: u8,
    ) {
        let stamp = self.next_stamp;
        self.next_stamp = self.next_stamp.wrapping_add(1);
        let Some(s) = self.slots.get_mut(usize::from(slot)) else {
            return;
        };
        match s.blocks.get_mut(&ext) {
            Some(block) if block.seq == seq => {
                let added = tiers & !block.tiers;
                if added != 0 {
                    holder_add(&mut self.holders, seq, slot, added);
                }
                block.tiers |= tiers;
                block.stamp = stamp;
            }
            Some(block) => {
                // The engine reused a block hash for a different prefix: the old placement is gone.
                holder_sub(&mut self.holders, block.seq, slot, block.tiers);
                holder_add(&mut self.holders, seq, slot, tiers);
                *block = SlotBlock { seq, stamp, tiers };
            }
            None => {
                s.blocks.insert(ext, SlotBlock { seq, stamp, tiers });
                holder_add(&mut self.holders, seq, slot, tiers);
                self.entries = self.entries.saturating_add(1);
            }
        }
        s.fifo.push_back((ext, stamp));
    }

    /// Drops `ext` from the tiers in `tiers` of `slot`; the entry goes when no tier is left.
    /// Returns whether the slot held it on any of those tiers.
    fn remove_block_tiers(&mut self, slot: SlotIdx, ext: ExternalBlockHash, tiers: u8) -> bool {
        let Some(s) = self.slots.get_mut(usize::from(slot)) else {
            return false;
        };
        let Some(block) = s.blocks.get_mut(&ext) else {
            return false;
        };
        let dropped = block.tiers & tiers;
        if dropped == 0 {
            return false;
        }
        holder_sub(&mut self.holders, block.seq, slot, dropped);
        block.tiers &= !dropped;
        if block.tiers == 0 {
            s.blocks.remove(&ext);
            self.entries = self.entries.saturating_sub(1);
        }
        true
    }

    /// Drops every block of one slot; returns how many entries it held.
    pub fn clear_slot(&mut self, slot: SlotIdx) -> usize {
        let Some(s) = self.slots.get_mut(usize::from(slot)) else {
            return 0;
        };
        let blocks = core::mem::take(&mut s.blocks);
        s.fifo = VecDeque::new();
        for block in blocks.values() {
            holder_sub(&mut self.holders, block.seq, slot, block.tiers);
        }
        self.entries = self.entries.saturating_sub(blocks.len());
        blocks.len()
    }

    /// Drops stale FIFO elements once they outnumber the live ones (amortized O(1) per push).
    fn compact_fifo(&mut self, idx: usize) {
        let Some(s) = self.slots.get_mut(idx) else {
            return;
        };
        let limit = s.blocks.len().saturating_mul(2).saturating_add(FIFO_SLACK);
        if s.fifo.len() > limit {
            let blocks = &s.blocks;
            s.fifo
                .retain(|(ext, stamp)| blocks.get(ext).is_some_and(|b| b.stamp == *stamp));
        }
    }

    /// Evicts until `entries <= max_blocks`: the oldest block of the slot holding the most
    /// (lowest slot index on ties).
    fn enforce_bound(&mut self, stats: &mut ApplyStats) {
        while self.entries > self.max_blocks {
            let victim = self
                .slots
                .iter()
                .enumerate()
                .max_by_key(|(i, s)| (s.blocks.len(), Reverse(*i)))
                .map(|(i, _)| i);
            let Some(slot) = victim.and_then(|i| SlotIdx::try_from(i).ok()) else {
                return;
            };
            if !self.evict_oldest(slot) {
                // Unreachable while the FIFO invariant holds; never loop forever.
                return;
            }
            self.compact_fifo(usize::from(slot));
            stats.evicted_blocks = stats.evicted_blocks.saturating_add(1);
        }
    }

    fn evict_oldest(&mut self, slot: SlotIdx) -> bool {
        loop {
            let Some(s) = self.slots.get_mut(usize::from(slot)) else {
                return false;
            };
            let Some((ext, stamp)) = s.fifo.pop_front() else {
                return false;
            };
            if s.is_live(&ext, stamp) {
                return self.remove_block_tiers(slot, ext, ALL_TIERS);
            }
        }
    }

    /// Per-slot overlap of `prompt` (its sequence hashes, in order). `out` is cleared and resized
    /// to `num_slots`; with enough capacity this does not allocate.
    ///
    /// A slot still matches after block i iff its total equals i + 1, so the walk carries the
    /// matching set in `out` itself and stops at the first block no matching slot holds.
    pub fn find_overlaps(&self, prompt: &[SequenceHash], out: &mut Vec<Overlap>) {
        out.clear();
        out.resize(self.slots.len(), Overlap::default());
        for (depth, seq) in prompt.iter().enumerate() {
            let Ok(depth) = u32::try_from(depth) else {
                return;
            };
            let Some(holders) = self.holders.get(seq) else {
                return;
            };
            let mut any = false;
            for holder in holders.as_slice() {
                let Some(o) = out.get_mut(usize::from(holder.slot)) else {
                    continue;
                };
                if o.total_blocks() != depth {
                    continue;
                }
                let mask = holder.mask();
                if mask & DEVICE_BIT != 0 && o.host_blocks == 0 && o.disk_blocks == 0 {
                    o.device_blocks += 1;
                } else if mask & (tier_bit(StorageTier::Host) | DEVICE_BIT) != 0 {
                    // Past the device prefix, a device copy still needs the host/disk blocks
                    // before it loaded first: count it with the host tier (the cheaper slow tier).
                    o.host_blocks += 1;
                } else {
                    o.disk_blocks += 1;
                }
                any = true;
            }
            if !any {
                return;
            }
        }
    }

    /// Whether any slot holds prefix `seq` on any tier: past the first prefix no slot holds,
    /// [`KvIndex::find_overlaps`] reads nothing (the lazy hashing stop, `crate::lazy_hash`).
    pub fn holds_anywhere(&self, seq: SequenceHash) -> bool {
        self.holders.get(&seq).is_some()
    }

    /// Tiers on which `slot` holds prefix `seq` (for tests and debugging endpoints).
    pub fn tiers_held(&self, slot: SlotIdx, seq: SequenceHash) -> Vec<StorageTier> {
        let mask = self
            .holders
            .get(&seq)
            .and_then(|h| {
                h.as_slice()
                    .iter()
                    .find(|h| h.slot == slot)
                    .map(Holder::mask)
            })
            .unwrap_or(0);
        TIERS
            .into_iter()
            .filter(|t| mask & tier_bit(*t) != 0)
            .collect()
    }
}

#[cfg(test)]
// Tests fail by panicking; indexing known-length fixtures keeps them readable.
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::events::CodecError;
    use crate::hashing::{local_block_hashes, prompt_sequence_hashes, DYNAMO_HASH_SEED};
    use crate::types::LocalBlockHash;

    const BS: u32 = 4;

    /// Tiny deterministic PRNG for test streams.
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

    fn tokens(seed: u32, n_blocks: u32) -> Vec<u32> {
        (0..n_blocks * BS)
            .map(|i| seed.wrapping_mul(100_003) ^ i)
            .collect()
    }

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

        /// An engine block hash: content-determined, different per slot (engines hash differently).
        fn ext(&self, slot: SlotIdx, i: usize) -> ExternalBlockHash {
            ExternalBlockHash(self.seqs[i].0 ^ (u64::from(slot) + 1).wrapping_mul(0xabcd_ef01_2345))
        }

        /// Stored event for blocks `range` of this prompt on `slot`.
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

    /// Recomputes `holders` and `entries` from the slot maps and checks the FIFO bound.
    fn check_invariants(index: &KvIndex) {
        let mut expected: std::collections::BTreeMap<(u64, SlotIdx), [u32; 3]> = Default::default();
        let mut entries = 0;
        for (i, s) in index.slots.iter().enumerate() {
            entries += s.blocks.len();
            assert!(
                s.fifo.len() <= 2 * s.blocks.len() + FIFO_SLACK + 1,
                "fifo of slot {i} unbounded"
            );
            let live = s.fifo.iter().filter(|(e, st)| s.is_live(e, *st)).count();
            assert_eq!(
                live,
                s.blocks.len(),
                "every live block has one live FIFO element"
            );
            for b in s.blocks.values() {
                assert!(b.tiers != 0 && b.tiers & !ALL_TIERS == 0);
                let c = expected.entry((b.seq.0, i as SlotIdx)).or_default();
                for (t, count) in c.iter_mut().enumerate() {
                    if b.tiers & (1 << t) != 0 {
                        *count += 1;
                    }
                }
            }
        }
        assert_eq!(entries, index.entries);
        let mut actual: std::collections::BTreeMap<(u64, SlotIdx), [u32; 3]> = Default::default();
        for (seq, hs) in &index.holders {
            assert!(!hs.as_slice().is_empty());
            for h in hs.as_slice() {
                assert_ne!(h.mask(), 0, "empty holder kept");
                assert!(
                    actual.insert((seq.0, h.slot), h.counts).is_none(),
                    "slot listed twice"
                );
            }
        }
        assert_eq!(actual, expected);
    }

    #[test]
    fn worked_example_device_overlaps_2_5_8_of_10() {
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
        // A prompt diverging after block 3 matches at most 3 blocks anywhere.
        let mut other = tokens(1, 10);
        other[3 * BS as usize] ^= 1;
        let q = prompt_sequence_hashes(&other, BS, None);
        assert_eq!(
            overlaps(&index, &q),
            vec![ov(2, 0, 0), ov(3, 0, 0), ov(3, 0, 0)]
        );
        // A LoRA-salted prompt with the same tokens matches nothing.
        let salted = prompt_sequence_hashes(&tokens(1, 10), BS, Some("adapter"));
        assert_eq!(overlaps(&index, &salted), vec![ov(0, 0, 0); 3]);
        check_invariants(&index);
    }

    #[test]
    fn host_and_disk_blocks_continue_past_the_device_prefix() {
        let p = Prompt::new(&tokens(2, 12));
        let mut index = KvIndex::new(2, 1000);
        // Slot 0: device 0..3, host 0..6 (offloaded copies of the device blocks too), disk 6..8,
        // nothing at 8, disk 9 (unreachable).
        index
            .apply(0, &p.stored(0, 0..3, StorageTier::Device))
            .unwrap();
        index
            .apply(0, &p.stored(0, 0..6, StorageTier::Host))
            .unwrap();
        index
            .apply(0, &p.stored(0, 6..8, StorageTier::Disk))
            .unwrap();
        let orphan = IndexEvent::Stored {
            dp_rank: 0,
            tier: StorageTier::Disk,
            parent: None,
            blocks: vec![(ExternalBlockHash(77), p.locals[9])],
        };
        index.apply(0, &orphan).unwrap();
        // Slot 1: host from the start, then a device-only block (counted with host).
        index
            .apply(1, &p.stored(1, 0..2, StorageTier::Host))
            .unwrap();
        index
            .apply(1, &p.stored(1, 2..3, StorageTier::Device))
            .unwrap();
        assert_eq!(overlaps(&index, &p.seqs), vec![ov(3, 3, 2), ov(0, 3, 0)]);
        assert_eq!(
            index.entries(),
            8 + 1 + 3,
            "a block on two tiers is one entry"
        );
        assert_eq!(
            index.tiers_held(0, p.seqs[1]),
            vec![StorageTier::Device, StorageTier::Host]
        );
        check_invariants(&index);
    }

    #[test]
    fn removal_is_per_tier_and_clear_is_per_slot() {
        let p = Prompt::new(&tokens(3, 8));
        let mut index = KvIndex::new(2, 1000);
        for slot in 0..2 {
            index
                .apply(slot, &p.stored(slot, 0..8, StorageTier::Device))
                .unwrap();
        }
        index
            .apply(0, &p.stored(0, 4..5, StorageTier::Host))
            .unwrap();
        // Block 4 leaves the device but stays on host: device run 4, then host.
        let stats = index
            .apply(0, &p.removed(0, 4..5, StorageTier::Device))
            .unwrap();
        assert_eq!(stats.removed_blocks, 1);
        assert_eq!(overlaps(&index, &p.seqs)[0], ov(4, 4, 0));
        // Removing it from host too drops the block: the run stops at block 4.
        index
            .apply(0, &p.removed(0, 4..5, StorageTier::Host))
            .unwrap();
        assert_eq!(overlaps(&index, &p.seqs), vec![ov(4, 0, 0), ov(8, 0, 0)]);
        assert_eq!(index.slot_blocks(0), 7);
        // Removing what is not held (wrong tier, or gone) is counted, not an error.
        let stats = index
            .apply(0, &p.removed(0, 3..5, StorageTier::Disk))
            .unwrap();
        assert_eq!((stats.removed_blocks, stats.unknown_removed_blocks), (0, 2));
        // Cleared drops just this slot.
        let stats = index
            .apply(1, &IndexEvent::Cleared { dp_rank: None })
            .unwrap();
        assert_eq!(stats.cleared_blocks, 8);
        assert_eq!(overlaps(&index, &p.seqs), vec![ov(4, 0, 0), ov(0, 0, 0)]);
        assert_eq!(index.clear_slot(0), 7);
        assert_eq!(index.entries(), 0);
        assert!(index.holders.is_empty());
        check_invariants(&index);
    }

    #[test]
    fn unknown_parent_and_bad_slot_change_nothing() {
        let p = Prompt::new(&tokens(4, 6));
        let mut index = KvIndex::new(2, 1000);
        index
            .apply(0, &p.stored(0, 0..2, StorageTier::Device))
            .unwrap();
        let before = index.encode_snapshot();
        // Parent block 2 was never stored on slot 0.
        assert_eq!(
            index.apply(0, &p.stored(0, 3..6, StorageTier::Device)),
            Err(IndexError::UnknownParent {
                slot: 0,
                parent: p.ext(0, 2)
            })
        );
        // Slot 1 does not hold slot 0's blocks: parents are per slot.
        assert!(matches!(
            index.apply(1, &p.stored(0, 2..3, StorageTier::Device)),
            Err(IndexError::UnknownParent { slot: 1, .. })
        ));
        assert_eq!(
            index.apply(2, &IndexEvent::Cleared { dp_rank: None }),
            Err(IndexError::SlotOutOfRange {
                slot: 2,
                num_slots: 2
            })
        );
        assert_eq!(index.encode_snapshot(), before);
        // With the parent present the chain continues from its sequence hash.
        index
            .apply(0, &p.stored(0, 2..6, StorageTier::Device))
            .unwrap();
        assert_eq!(overlaps(&index, &p.seqs)[0], ov(6, 0, 0));
    }

    #[test]
    fn shared_prefix_names_and_reused_engine_hashes() {
        let p = Prompt::new(&tokens(5, 3));
        let mut index = KvIndex::new(1, 1000);
        index
            .apply(0, &p.stored(0, 0..3, StorageTier::Device))
            .unwrap();
        // The engine stores the same content under a second block hash.
        let dup = IndexEvent::Stored {
            dp_rank: 0,
            tier: StorageTier::Device,
            parent: None,
            blocks: vec![(ExternalBlockHash(5), p.locals[0])],
        };
        index.apply(0, &dup).unwrap();
        let remove_first = IndexEvent::Removed {
            dp_rank: 0,
            tier: StorageTier::Device,
            blocks: vec![p.ext(0, 0)],
        };
        index.apply(0, &remove_first).unwrap();
        // Still held through the duplicate, so blocks 1..3 still chain from it.
        assert_eq!(overlaps(&index, &p.seqs)[0], ov(3, 0, 0));
        // The engine reuses block hash 5 for other content: the old prefix is gone.
        let reuse = IndexEvent::Stored {
            dp_rank: 0,
            tier: StorageTier::Device,
            parent: None,
            blocks: vec![(ExternalBlockHash(5), LocalBlockHash(123))],
        };
        index.apply(0, &reuse).unwrap();
        assert_eq!(overlaps(&index, &p.seqs)[0], ov(0, 0, 0));
        check_invariants(&index);
    }

    #[test]
    fn find_overlaps_reuses_the_output_buffer() {
        let p = Prompt::new(&tokens(6, 4));
        let mut index = KvIndex::new(8, 1000);
        index
            .apply(3, &p.stored(3, 0..4, StorageTier::Device))
            .unwrap();
        let mut out = Vec::with_capacity(8);
        let ptr = out.as_ptr();
        out.push(ov(9, 9, 9));
        index.find_overlaps(&p.seqs, &mut out);
        assert_eq!(out.len(), 8);
        assert_eq!(out.as_ptr(), ptr);
        assert_eq!(out[0], ov(0, 0, 0), "stale contents cleared");
        assert_eq!(out[3], ov(4, 0, 0));
        index.find_overlaps(&[], &mut out);
        assert_eq!(out, vec![ov(0, 0, 0); 8]);
    }

    /// A pseudo-random stream of stored / removed / cleared events over prompts that share
    /// prefixes, as (slot, event).
    fn stream(seed: u64, len: usize, num_slots: u16) -> (Vec<Prompt>, Vec<(SlotIdx, IndexEvent)>) {
        let mut rng = Lcg(seed);
        let prompts: Vec<Prompt> = (0..200)
            .map(|i| {
                let mut t = tokens(i % 5, 6); // 5 shared 6-block prefixes
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
            let tier = tiers[rng.below(10).min(2)]; // mostly device
            let event = match rng.below(1000) {
                0..=649 => p.stored(slot, start..end, tier),
                650..=994 => p.removed(slot, start..end, tier),
                _ => IndexEvent::Cleared { dp_rank: None },
            };
            events.push((slot, event));
        }
        (prompts, events)
    }

    #[test]
    fn eviction_keeps_entries_within_max_blocks() {
        let (_, events) = stream(11, 20_000, 4);
        let mut index = KvIndex::new(4, 300);
        let mut total = ApplyStats::default();
        let mut unknown_parent = 0;
        for (i, (slot, event)) in events.iter().enumerate() {
            match index.apply(*slot, event) {
                Ok(stats) => total.add(&stats),
                Err(IndexError::UnknownParent { .. }) => unknown_parent += 1,
                Err(e) => panic!("{e}"),
            }
            assert!(
                index.entries() <= 300,
                "entries {} at event {i}",
                index.entries()
            );
            if i % 997 == 0 {
                check_invariants(&index);
            }
        }
        check_invariants(&index);
        assert!(
            total.evicted_blocks > 1000,
            "stream should force evictions: {total:?}"
        );
        assert!(
            total.stored_blocks > 10_000 && unknown_parent > 0,
            "{total:?}"
        );
        // Evictions come from the fullest slot, so slots stay balanced.
        let sizes: Vec<usize> = (0..4).map(|s| index.slot_blocks(s)).collect();
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= 150, "unbalanced eviction: {sizes:?}");
    }

    #[test]
    fn eviction_takes_the_oldest_block_of_the_fullest_slot() {
        let a = Prompt::new(&tokens(7, 4));
        let b = Prompt::new(&tokens(8, 4));
        let mut index = KvIndex::new(2, 5);
        index
            .apply(0, &a.stored(0, 0..3, StorageTier::Device))
            .unwrap();
        index
            .apply(1, &b.stored(1, 0..2, StorageTier::Device))
            .unwrap();
        // Refresh block 0 of slot 0: block 1 becomes the oldest there.
        index
            .apply(0, &a.stored(0, 0..1, StorageTier::Host))
            .unwrap();
        let stats = index
            .apply(1, &b.stored(1, 2..3, StorageTier::Device))
            .unwrap();
        // 6 entries, slots tied at 3: the lower slot (0) loses its oldest block (1).
        assert_eq!(stats.evicted_blocks, 1);
        assert_eq!(index.entries(), 5);
        assert_eq!(overlaps(&index, &a.seqs)[0], ov(1, 0, 0));
        assert_eq!(overlaps(&index, &b.seqs)[1], ov(3, 0, 0));
        assert_eq!(index.tiers_held(0, a.seqs[2]), vec![StorageTier::Device]);
    }

    fn all_overlaps(index: &KvIndex, prompts: &[Prompt]) -> Vec<Vec<Overlap>> {
        prompts.iter().map(|p| overlaps(index, &p.seqs)).collect()
    }

    #[test]
    fn snapshot_round_trip_preserves_overlaps_and_future_evictions() {
        let (prompts, events) = stream(21, 12_000, 5);
        let (first, rest) = events.split_at(6_000);
        let mut index = KvIndex::new(5, 400);
        for (slot, event) in first {
            let _ = index.apply(*slot, event);
        }
        let bytes = index.encode_snapshot();
        let mut copy = KvIndex::decode_snapshot(&bytes, 5, 400).unwrap();
        check_invariants(&copy);
        assert_eq!(copy.entries(), index.entries());
        let before = all_overlaps(&index, &prompts);
        assert!(
            before.iter().flatten().any(|o| o.total_blocks() > 3),
            "stream too sparse"
        );
        assert_eq!(all_overlaps(&copy, &prompts), before);
        assert_eq!(copy.encode_snapshot(), bytes);
        // Replaying the rest on both gives the same state, evictions included.
        let mut evicted = 0;
        for (slot, event) in rest {
            let result = index.apply(*slot, event);
            assert_eq!(result, copy.apply(*slot, event));
            evicted += result.map_or(0, |s| s.evicted_blocks);
        }
        assert!(
            evicted > 100,
            "the replay should exercise eviction: {evicted}"
        );
        assert_eq!(
            all_overlaps(&copy, &prompts),
            all_overlaps(&index, &prompts)
        );
        assert_eq!(copy.encode_snapshot(), index.encode_snapshot());
        // A smaller bound on load evicts down to it.
        let small = KvIndex::decode_snapshot(&bytes, 5, 50).unwrap();
        assert_eq!(small.entries(), 50);
        check_invariants(&small);
    }

    #[test]
    fn two_replicas_fed_the_same_stream_agree() {
        let (prompts, events) = stream(31, 8_000, 6);
        let mut a = KvIndex::new(6, 250);
        let mut b = KvIndex::new(6, 250);
        let mut evicted = 0;
        for (slot, event) in &events {
            let result = a.apply(*slot, event);
            assert_eq!(result, b.apply(*slot, event));
            evicted += result.map_or(0, |s| s.evicted_blocks);
        }
        assert!(
            evicted > 100,
            "the stream should exercise eviction: {evicted}"
        );
        assert_eq!(a.encode_snapshot(), b.encode_snapshot());
        assert_eq!(all_overlaps(&a, &prompts), all_overlaps(&b, &prompts));
    }

    #[test]
    fn snapshot_decode_rejects_bad_input() {
        let (_, events) = stream(41, 500, 3);
        let mut index = KvIndex::new(3, 1000);
        for (slot, event) in &events {
            let _ = index.apply(*slot, event);
        }
        let bytes = index.encode_snapshot();
        assert!(index.entries() > 10);
        for len in 0..bytes.len() {
            assert!(
                KvIndex::decode_snapshot(&bytes[..len], 3, 1000).is_err(),
                "len {len}"
            );
        }
        assert_eq!(
            KvIndex::decode_snapshot(&bytes, 4, 1000).err(),
            Some(CodecError::SlotCountMismatch {
                expected: 4,
                got: 3
            })
        );
        let mut longer = bytes.clone();
        longer.push(1);
        assert_eq!(
            KvIndex::decode_snapshot(&longer, 3, 1000).err(),
            Some(CodecError::TrailingBytes { count: 1 })
        );
        // First entry of slot 0 starts after magic+version (4), slot count (4), stamp (4), count (4).
        let mut bad_tiers = bytes.clone();
        bad_tiers[16 + 20] = 8;
        assert!(matches!(
            KvIndex::decode_snapshot(&bad_tiers, 3, 1000),
            Err(CodecError::InvalidTag {
                field: "tiers",
                value: 8,
                ..
            })
        ));
        // Duplicate: a one-slot snapshot with the same block twice.
        let mut dup = Vec::new();
        dup.extend_from_slice(b"EKS\x01");
        dup.extend_from_slice(&1u32.to_le_bytes());
        dup.extend_from_slice(&0u32.to_le_bytes());
        dup.extend_from_slice(&2u32.to_le_bytes());
        for _ in 0..2 {
            dup.extend_from_slice(&9u64.to_le_bytes());
            dup.extend_from_slice(&9u64.to_le_bytes());
            dup.extend_from_slice(&0u32.to_le_bytes());
            dup.push(1);
        }
        assert_eq!(
            KvIndex::decode_snapshot(&dup, 1, 10).err(),
            Some(CodecError::DuplicateBlock { slot: 0, block: 9 })
        );
        // Random corruption never panics; a successful decode is internally consistent.
        let mut rng = Lcg(5);
        for _ in 0..2000 {
            let mut b = bytes.clone();
            let pos = rng.below(b.len());
            b[pos] = rng.next() as u8;
            if let Ok(decoded) = KvIndex::decode_snapshot(&b, 3, 1000) {
                check_invariants(&decoded);
            }
        }
    }

    #[test]
    fn hasher_spreads_small_keys() {
        use core::hash::BuildHasher;
        let build = BuildHasherDefault::<KeyHasher>::default();
        let top7: std::collections::BTreeSet<u64> = (0..64u64)
            .map(|k| build.hash_one(ExternalBlockHash(k)) >> 57)
            .collect();
        assert!(top7.len() > 20, "control bytes not spread: {}", top7.len());
    }
}
