//! The index snapshot: the whole [`KvIndex`] in a compact binary form, so a new replica can start
//! from it instead of replaying the whole log.

use super::{holder_add, ApplyStats, FixedMap, KvIndex, SlotBlock, ALL_TIERS, MAX_SLOTS};
use crate::events::{CodecError, Reader, Writer};
use crate::types::{ExternalBlockHash, SequenceHash, SlotIdx};

const SNAPSHOT_MAGIC: [u8; 3] = *b"EKS";
const SNAPSHOT_VERSION: u8 = 1;
/// ext u64 + seq u64 + stamp u32 + tiers u8.
const SNAPSHOT_ENTRY_BYTES: usize = 21;

impl KvIndex {
    /// The whole index in a compact binary form (`"EKS"`, version, slot count, stamp counter, then
    /// per slot its blocks in eviction order), so a decoded replica evicts exactly like one that
    /// replayed the log.
    pub fn encode_snapshot(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.bytes.extend_from_slice(&SNAPSHOT_MAGIC);
        w.u8(SNAPSHOT_VERSION);
        w.len_prefix(self.slots.len());
        w.u32(self.next_stamp);
        let mut emitted: FixedMap<ExternalBlockHash, ()> = FixedMap::default();
        let mut live: Vec<(ExternalBlockHash, SlotBlock)> = Vec::new();
        for s in &self.slots {
            emitted.clear();
            live.clear();
            for (ext, stamp) in &s.fifo {
                let Some(block) = s.blocks.get(ext).filter(|b| b.stamp == *stamp) else {
                    continue;
                };
                // A wrapped stamp could make two elements look live; emit each block once.
                if emitted.insert(*ext, ()).is_none() {
                    live.push((*ext, *block));
                }
            }
            w.len_prefix(live.len());
            for (ext, block) in &live {
                w.u64(ext.0);
                w.u64(block.seq.0);
                w.u32(block.stamp);
                w.u8(block.tiers);
            }
        }
        w.bytes
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
        index.next_stamp = r.u32()?;
        for (idx, s) in index.slots.iter_mut().enumerate() {
            let slot = SlotIdx::try_from(idx).map_err(|_| CodecError::SlotCountMismatch {
                expected: num_slots,
                got,
            })?;
            let count = r.count("snapshot blocks", SNAPSHOT_ENTRY_BYTES)?;
            s.blocks.reserve(count);
            s.fifo.reserve(count);
            for _ in 0..count {
                let ext = ExternalBlockHash(r.u64()?);
                let seq = SequenceHash(r.u64()?);
                let stamp = r.u32()?;
                let offset = r.offset();
                let tiers = r.u8()?;
                if tiers == 0 || tiers & !ALL_TIERS != 0 {
                    return Err(CodecError::InvalidTag {
                        field: "tiers",
                        value: tiers,
                        offset,
                    });
                }
                if s.blocks
                    .insert(ext, SlotBlock { seq, stamp, tiers })
                    .is_some()
                {
                    return Err(CodecError::DuplicateBlock { slot, block: ext.0 });
                }
                s.fifo.push_back((ext, stamp));
                holder_add(&mut index.holders, seq, slot, tiers);
                index.entries = index.entries.saturating_add(1);
            }
        }
        r.finish()?;
        index.enforce_bound(&mut ApplyStats::default());
        Ok(index)
    }
}
