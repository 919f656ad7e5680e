//! The index snapshot: the whole [`KvIndex`] in a compact binary form, so a new replica can start
//! from it instead of replaying the whole log.
//!
//! Version 2 (the compact index): per slot its entries oldest first, without the per-entry
//! stamps of version 1 (eviction order is the FIFO order itself). Version 1 snapshots are
//! rejected; the caller then replays the log.

use super::{ApplyStats, Entry, KvIndex, ALL_TIERS, MAX_SLOTS};
use crate::events::{CodecError, Reader, Writer};
use crate::types::SlotIdx;

const SNAPSHOT_MAGIC: [u8; 3] = *b"EKS";
const SNAPSHOT_VERSION: u8 = 2;
/// ext u64 + seq u64 + tiers u8.
const SNAPSHOT_ENTRY_BYTES: usize = 17;

impl KvIndex {
    /// The whole index in a compact binary form (`"EKS"`, version, slot count, then per slot its
    /// block count and blocks in eviction order), so a decoded replica evicts exactly like one
    /// that replayed the log.
    pub fn encode_snapshot(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_snapshot_into(&mut out);
        out
    }

    /// [`KvIndex::encode_snapshot`] appended to `out`, reserved once (no doubling copies).
    pub fn encode_snapshot_into(&self, out: &mut Vec<u8>) {
        let mut w = Writer {
            bytes: core::mem::take(out),
        };
        let slots = self.fifos.len();
        w.bytes
            .reserve(4 + 4 * (slots + 1) + self.entries.saturating_mul(SNAPSHOT_ENTRY_BYTES));
        w.bytes.extend_from_slice(&SNAPSHOT_MAGIC);
        w.u8(SNAPSHOT_VERSION);
        w.len_prefix(slots);
        for (slot, fifo) in self.fifos.iter().enumerate() {
            w.len_prefix(self.fullest.count(slot));
            let mut cur = fifo.head;
            while let Some(e) = self.pool.get(cur) {
                w.u64(e.ext);
                w.u64(e.seq);
                w.u8(e.tiers());
                cur = e.next();
            }
        }
        *out = w.bytes;
    }

    /// Replaces this index's contents with a snapshot's, reusing its memory (decoding into a
    /// fresh index while this one is alive would double the replica's peak, and wasm memory
    /// keeps peaks). On `Err` the index is left empty. A different slot count or bound decodes
    /// a fresh index instead.
    pub fn reload_snapshot(
        &mut self,
        bytes: &[u8],
        num_slots: usize,
        max_blocks: usize,
    ) -> Result<(), CodecError> {
        if num_slots != self.num_slots() || max_blocks.min(super::MAX_BOUND) != self.max_blocks {
            *self = KvIndex::new(num_slots, max_blocks);
        } else {
            self.reset();
        }
        let decoded = self.decode_into(bytes);
        if decoded.is_err() {
            self.reset();
        }
        decoded
    }

    /// Rebuilds an index from [`KvIndex::encode_snapshot`]. The slot count must match; if the
    /// snapshot holds more than `max_blocks`, the excess is evicted as usual.
    pub fn decode_snapshot(
        bytes: &[u8],
        num_slots: usize,
        max_blocks: usize,
    ) -> Result<KvIndex, CodecError> {
        let mut r = Reader::new(bytes);
        r.header(SNAPSHOT_MAGIC, SNAPSHOT_VERSION)?;
        let got = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
        if got != num_slots || got > MAX_SLOTS {
            return Err(CodecError::SlotCountMismatch {
                expected: num_slots,
                got,
            });
        }
        let mut index = KvIndex::new(num_slots, max_blocks);
        index.decode_into(bytes)?;
        Ok(index)
    }

    /// Decodes a snapshot into this (empty) index, its slot count checked against the header.
    fn decode_into(&mut self, bytes: &[u8]) -> Result<(), CodecError> {
        let num_slots = self.num_slots();
        let mut r = Reader::new(bytes);
        r.header(SNAPSHOT_MAGIC, SNAPSHOT_VERSION)?;
        let got = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
        if got != num_slots || got > MAX_SLOTS {
            return Err(CodecError::SlotCountMismatch {
                expected: num_slots,
                got,
            });
        }
        let index = self;
        for idx in 0..num_slots {
            let slot = SlotIdx::try_from(idx).map_err(|_| CodecError::SlotCountMismatch {
                expected: num_slots,
                got,
            })?;
            let count = r.count("snapshot blocks", SNAPSHOT_ENTRY_BYTES)?;
            for _ in 0..count {
                let ext = r.u64()?;
                let seq = r.u64()?;
                let offset = r.offset();
                let tiers = r.u8()?;
                if tiers == 0 || tiers & !ALL_TIERS != 0 {
                    return Err(CodecError::InvalidTag {
                        field: "tiers",
                        value: tiers,
                        offset,
                    });
                }
                if index.find_block(slot, ext).is_some() {
                    return Err(CodecError::DuplicateBlock { slot, block: ext });
                }
                let Some(id) = index.pool.alloc(Entry::new(ext, seq, slot, tiers)) else {
                    // More than the id space: keep what fits, as eviction would.
                    index.enforce_bound(&mut ApplyStats::default());
                    continue;
                };
                index.add_entry(id);
            }
        }
        r.finish()?;
        index.enforce_bound(&mut ApplyStats::default());
        Ok(())
    }
}
