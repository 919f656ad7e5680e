//! The `KvIndex` this crate used before the compact one (commit d7e38c8: per-slot hashbrown maps,
//! lazy-deletion FIFOs, a global holders map; ~80-130 B per entry natively): simple enough to
//! trust, so it stays as `tests/index_differential.rs`'s reference for the compact index's
//! answers. Snapshot codec and unit tests dropped.
#![allow(dead_code, unused_imports, clippy::all)]

use core::cmp::Reverse;
use core::fmt;
use core::hash::{BuildHasherDefault, Hasher};
use std::collections::VecDeque;

use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::chain_sequence_hash;
use envoy_kv_router::types::{ExternalBlockHash, Overlap, SequenceHash, SlotIdx, StorageTier};

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
    match tier {
        StorageTier::Device => 1,
        StorageTier::Host => 2,
        StorageTier::Disk => 4,
    }
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

use envoy_kv_router::index::{ApplyStats, IndexError};

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
                    self.insert_block(slot, ext, seq, tier_bit(*tier), &mut stats);
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
        stats: &mut ApplyStats,
    ) {
        // A new block at the bound evicts first (as the compact index does).
        let new = self
            .slots
            .get(usize::from(slot))
            .is_some_and(|s| !s.blocks.contains_key(&ext));
        if new && self.entries >= self.max_blocks {
            self.evict_one(stats);
        }
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
            if !self.evict_one(stats) {
                // Unreachable while the FIFO invariant holds; never loop forever.
                return;
            }
        }
    }

    /// Evicts the oldest block of the slot holding the most (lowest slot index on ties).
    fn evict_one(&mut self, stats: &mut ApplyStats) -> bool {
        let victim = self
            .slots
            .iter()
            .enumerate()
            .max_by_key(|(i, s)| (s.blocks.len(), Reverse(*i)))
            .map(|(i, _)| i);
        let Some(slot) = victim.and_then(|i| SlotIdx::try_from(i).ok()) else {
            return false;
        };
        if !self.evict_oldest(slot) {
            return false;
        }
        self.compact_fifo(usize::from(slot));
        stats.evicted_blocks = stats.evicted_blocks.saturating_add(1);
        true
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
