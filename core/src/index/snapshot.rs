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
/// A run's slot u32 + count u32 in a snapshot part.
const RUN_HEADER_BYTES: usize = 8;

/// Writes a closed run's entry count at its place.
fn close_run(bytes: &mut [u8], run: Option<(usize, u32)>) {
    if let Some((at, count)) = run {
        if let Some(dst) = at.checked_add(4).and_then(|end| bytes.get_mut(at..end)) {
            dst.copy_from_slice(&count.to_le_bytes());
        }
    }
}

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

    /// The index as snapshot *parts*, for a store that holds it in bounded pieces: no buffer
    /// ever holds the whole snapshot. Each part is built in `buf` (reused, so its allocation
    /// stays about `part_bytes`): `prefix` zero bytes for the caller's part header, then runs of
    /// `slot u32 | count u32 | count entries` (the same 17-byte entries as
    /// [`KvIndex::encode_snapshot`], per slot oldest first), the part size chosen so that the
    /// index fits in `max_parts` parts of at least `min_part_bytes`; a slot's entries may
    /// continue in the next part as a new run. `emit` gets the part's number and buffer, and
    /// stores it; `false` aborts. Never more than `max_parts` parts: the last one would take
    /// whatever remains. Returns the number of parts written (an
    /// empty index is one part without runs), `None` if `emit` failed.
    pub fn encode_snapshot_parts(
        &self,
        prefix: usize,
        min_part_bytes: usize,
        max_parts: u32,
        buf: &mut Vec<u8>,
        mut emit: impl FnMut(u32, &mut Vec<u8>) -> bool,
    ) -> Option<u32> {
        // Every entry and a run header per slot, spread over the parts, with room for one more
        // run header and entry per part (a run split across two parts).
        let body = self
            .entries
            .saturating_mul(SNAPSHOT_ENTRY_BYTES)
            .saturating_add(self.fifos.len().saturating_mul(RUN_HEADER_BYTES));
        let parts = usize::try_from(max_parts.max(1)).unwrap_or(usize::MAX);
        let part_bytes = prefix
            .saturating_add(RUN_HEADER_BYTES + SNAPSHOT_ENTRY_BYTES)
            .saturating_add(body.div_ceil(parts))
            .max(min_part_bytes);
        let mut w = Writer {
            bytes: core::mem::take(buf),
        };
        w.bytes.clear();
        w.bytes.reserve(part_bytes);
        w.bytes.resize(prefix, 0);
        let mut part = 0u32;
        let mut ok = true;
        for (slot, fifo) in self.fifos.iter().enumerate() {
            // The open run: where its count goes, and the count so far.
            let mut run: Option<(usize, u32)> = None;
            let mut cur = fifo.head;
            while let Some(e) = self.pool.get(cur) {
                let needed =
                    SNAPSHOT_ENTRY_BYTES + if run.is_none() { RUN_HEADER_BYTES } else { 0 };
                let full = w.bytes.len().saturating_add(needed) > part_bytes;
                if full && w.bytes.len() > prefix && part.saturating_add(1) < max_parts {
                    close_run(&mut w.bytes, run.take());
                    if !emit(part, &mut w.bytes) {
                        ok = false;
                        break;
                    }
                    part += 1;
                    w.bytes.clear();
                    w.bytes.resize(prefix, 0);
                }
                let (_, count) = run.get_or_insert_with(|| {
                    w.len_prefix(slot);
                    let at = w.bytes.len();
                    w.u32(0);
                    (at, 0)
                });
                *count = count.saturating_add(1);
                w.u64(e.ext);
                w.u64(e.seq);
                w.u8(e.tiers());
                cur = e.next();
            }
            close_run(&mut w.bytes, run);
            if !ok {
                break;
            }
        }
        ok = ok && emit(part, &mut w.bytes);
        *buf = w.bytes;
        ok.then_some(part + 1)
    }

    /// Starts loading snapshot parts into this index: empties it, reusing its memory (or makes
    /// a fresh one for another slot count or bound). Then [`KvIndex::decode_snapshot_part`] per
    /// part in order, and [`KvIndex::finish_snapshot_parts`].
    pub fn begin_snapshot_parts(&mut self, num_slots: usize, max_blocks: usize) {
        if num_slots != self.num_slots() || max_blocks.min(super::MAX_BOUND) != self.max_blocks {
            *self = KvIndex::new(num_slots, max_blocks);
        } else {
            self.reset();
        }
    }

    /// Adds one part's runs (the body after the caller's part header). On `Err` the index holds
    /// part of the snapshot: the caller discards it.
    pub fn decode_snapshot_part(&mut self, body: &[u8]) -> Result<(), CodecError> {
        let num_slots = self.num_slots();
        let mut r = Reader::new(body);
        while r.remaining() > 0 {
            let got = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
            let slot = SlotIdx::try_from(got)
                .ok()
                .filter(|_| got < num_slots)
                .ok_or(CodecError::SlotCountMismatch {
                    expected: num_slots,
                    got,
                })?;
            let count = r.count("snapshot blocks", SNAPSHOT_ENTRY_BYTES)?;
            for _ in 0..count {
                self.decode_entry(&mut r, slot)?;
            }
        }
        Ok(())
    }

    /// Ends a load from parts: evicts beyond the bound, as a whole snapshot's decode does.
    pub fn finish_snapshot_parts(&mut self) {
        self.enforce_bound(&mut ApplyStats::default());
    }

    /// Empties the index, keeping its allocations.
    pub fn clear(&mut self) {
        self.reset();
    }

    /// One 17-byte snapshot entry into `slot`.
    fn decode_entry(&mut self, r: &mut Reader<'_>, slot: SlotIdx) -> Result<(), CodecError> {
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
        if self.find_block(slot, ext).is_some() {
            return Err(CodecError::DuplicateBlock { slot, block: ext });
        }
        let Some(id) = self.pool.alloc(Entry::new(ext, seq, slot, tiers)) else {
            // More than the id space: keep what fits, as eviction would.
            self.enforce_bound(&mut ApplyStats::default());
            return Ok(());
        };
        self.add_entry(id);
        Ok(())
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
                index.decode_entry(&mut r, slot)?;
            }
        }
        r.finish()?;
        index.enforce_bound(&mut ApplyStats::default());
        Ok(())
    }
}
