//! The index's entries: 28 bytes per (block, slot), in 112 KiB chunks allocated as the index
//! grows (the last one cut at the index's bound), so an idle index holds nothing and growth
//! never copies (no doubling peak, which wasm linear memory would keep forever).
//!
//! An entry is addressed by a 24-bit id; the top byte of each of its three link words carries
//! the slot (two bytes) and the tier mask, which is what makes it 28 bytes instead of 32.

/// "No entry" in a link word.
pub(super) const NIL: u32 = ID_MASK;
const ID_MASK: u32 = 0x00FF_FFFF;
/// Ids are 0..NIL, so this many entries at most.
pub(super) const MAX_ENTRIES: usize = NIL as usize;

const TIER_BITS: u8 = 0b111;
const WIDE_FLAG: u32 = 0x8000_0000;

/// 4,096 entries (112 KiB) a chunk. Smaller chunks waste less ahead of use but fit into the
/// holes the transient event buffers (log batches, tens of KiB) leave in the VM's heap, which
/// then fragments: with 28 KiB chunks a replica's linear memory held ~1.4 MiB more than its
/// index at 1M entries, with these 0.1-0.3 MiB.
const CHUNK_BITS: u32 = 12;
const CHUNK_LEN: usize = 1 << CHUNK_BITS;
const CHUNK_MASK: u32 = (1 << CHUNK_BITS) - 1;

/// One (block, slot) entry. `packed(4)`: two u64 and three u32 in 28 bytes (fields are only ever
/// copied, never borrowed, so the 4-byte alignment is harmless).
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
pub(super) struct Entry {
    /// Engine block hash.
    pub ext: u64,
    /// Prefix (sequence) hash.
    pub seq: u64,
    /// Older neighbour in the slot's FIFO | slot low byte << 24.
    prev: u32,
    /// Newer neighbour in the slot's FIFO, or the next free entry | slot high byte << 24.
    next: u32,
    /// Next entry of the same prefix | tier mask << 24 (0 = free) | wide flag << 31.
    seq_next: u32,
}

const _: () = assert!(core::mem::size_of::<Entry>() == 28);

fn with_id(word: u32, id: u32) -> u32 {
    (word & !ID_MASK) | (id & ID_MASK)
}

impl Entry {
    const FREE: Entry = Entry {
        ext: 0,
        seq: 0,
        prev: NIL,
        next: NIL,
        seq_next: NIL,
    };

    pub fn new(ext: u64, seq: u64, slot: u16, tiers: u8) -> Entry {
        let [lo, hi] = slot.to_le_bytes();
        Entry {
            ext,
            seq,
            prev: NIL | (u32::from(lo) << 24),
            next: NIL | (u32::from(hi) << 24),
            seq_next: NIL | (u32::from(tiers) << 24),
        }
    }

    pub fn slot(&self) -> u16 {
        let (prev, next) = (self.prev, self.next);
        u16::from_le_bytes([(prev >> 24) as u8, (next >> 24) as u8])
    }

    pub fn tiers(&self) -> u8 {
        let w = self.seq_next;
        (w >> 24) as u8 & TIER_BITS
    }

    /// Sets the tier mask, keeping the wide flag.
    pub fn set_tiers(&mut self, tiers: u8) {
        let keep = self.seq_next & (ID_MASK | WIDE_FLAG);
        self.seq_next = keep | (u32::from(tiers & TIER_BITS) << 24);
    }

    /// Set on the head of a prefix chain whose holders are also kept as an array (`wide`).
    pub fn wide(&self) -> bool {
        self.seq_next & WIDE_FLAG != 0
    }

    pub fn set_wide(&mut self, wide: bool) {
        if wide {
            self.seq_next |= WIDE_FLAG;
        } else {
            self.seq_next &= !WIDE_FLAG;
        }
    }

    pub fn prev(&self) -> u32 {
        self.prev & ID_MASK
    }

    pub fn next(&self) -> u32 {
        self.next & ID_MASK
    }

    pub fn seq_next(&self) -> u32 {
        self.seq_next & ID_MASK
    }

    pub fn set_prev(&mut self, id: u32) {
        self.prev = with_id(self.prev, id);
    }

    pub fn set_next(&mut self, id: u32) {
        self.next = with_id(self.next, id);
    }

    pub fn set_seq_next(&mut self, id: u32) {
        self.seq_next = with_id(self.seq_next, id);
    }
}

/// Chunked entry storage with a free list threaded through `next`.
#[derive(Clone, Default)]
pub(super) struct Pool {
    chunks: Vec<Box<[Entry]>>,
    /// Ids below this have been handed out at least once.
    high: u32,
    free: Option<u32>,
    /// The most entries the index holds (its `max_blocks`; 0: unknown): the chunk that holds
    /// the bound's last id is cut there instead of filled to [`CHUNK_LEN`] (a chunk is written
    /// whole when allocated, so the part beyond the bound would be resident and never used: up
    /// to 112 KiB per replica, ~0.7 B per entry at 100k entries).
    bound: usize,
}

impl Pool {
    /// An empty pool for an index of at most `bound` entries.
    pub fn with_bound(bound: usize) -> Pool {
        Pool {
            bound,
            ..Pool::default()
        }
    }

    pub fn get(&self, id: u32) -> Option<&Entry> {
        self.chunks
            .get((id >> CHUNK_BITS) as usize)?
            .get((id & CHUNK_MASK) as usize)
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut Entry> {
        self.chunks
            .get_mut((id >> CHUNK_BITS) as usize)?
            .get_mut((id & CHUNK_MASK) as usize)
    }

    /// Stores `entry`; `None` once `MAX_ENTRIES` are live.
    pub fn alloc(&mut self, entry: Entry) -> Option<u32> {
        let id = match self.free {
            Some(id) => {
                let next = self.get(id).map_or(NIL, Entry::next);
                self.free = (next != NIL).then_some(next);
                id
            }
            None => {
                let id = self.high;
                if id >= NIL {
                    return None;
                }
                self.make_room(id);
                self.high = id.saturating_add(1);
                id
            }
        };
        *self.get_mut(id)? = entry;
        Some(id)
    }

    /// Makes `id` (the next never used id) addressable: a new chunk, as long as the bound
    /// needs; a chunk cut at the bound is completed if ids pass it after all (a snapshot of a
    /// larger index being loaded before eviction catches up).
    fn make_room(&mut self, id: u32) {
        let chunk = (id >> CHUNK_BITS) as usize;
        let offset = (id & CHUNK_MASK) as usize;
        match self.chunks.get_mut(chunk) {
            None => {
                let wanted = self.bound.saturating_sub(chunk.saturating_mul(CHUNK_LEN));
                let len = if wanted > offset {
                    wanted.min(CHUNK_LEN)
                } else {
                    CHUNK_LEN
                };
                self.chunks.push(vec![Entry::FREE; len].into_boxed_slice());
            }
            Some(c) if c.len() <= offset => {
                let mut entries = std::mem::take(c).into_vec();
                entries.resize(CHUNK_LEN, Entry::FREE);
                *c = entries.into_boxed_slice();
            }
            Some(_) => {}
        }
    }

    pub fn release(&mut self, id: u32) {
        let next = self.free.unwrap_or(NIL);
        if let Some(e) = self.get_mut(id) {
            *e = Entry::FREE;
            e.set_tiers(0);
            e.set_next(next);
            self.free = Some(id);
        }
    }

    /// Ids handed out so far (live or free), for invariant checks.
    #[cfg(test)]
    pub fn high(&self) -> u32 {
        self.high
    }

    /// Forgets every entry; the chunks stay allocated and are handed out again.
    pub fn reset(&mut self) {
        self.high = 0;
        self.free = None;
    }

    /// Bytes held (for benchmarks and the module note's arithmetic).
    pub fn allocated_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).sum::<usize>() * core::mem::size_of::<Entry>()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn lens(pool: &Pool) -> Vec<usize> {
        pool.chunks.iter().map(|c| c.len()).collect()
    }

    /// The chunk holding the bound's last id stops there; ids past the bound still work (the
    /// chunk is completed), and a pool without a bound uses whole chunks.
    #[test]
    fn the_last_chunk_is_cut_at_the_bound_and_completed_if_ids_pass_it() {
        let bound = CHUNK_LEN + 100;
        let mut pool = Pool::with_bound(bound);
        for i in 0..bound {
            assert_eq!(pool.alloc(Entry::new(i as u64, 0, 0, 1)), Some(i as u32));
        }
        assert_eq!(lens(&pool), vec![CHUNK_LEN, 100]);
        assert_eq!(pool.allocated_bytes(), bound * 28);
        let past = pool.alloc(Entry::new(7, 0, 0, 1)).unwrap();
        assert_eq!(past as usize, bound);
        assert_eq!(lens(&pool), vec![CHUNK_LEN, CHUNK_LEN]);
        assert_eq!(pool.get(past).map(|e| e.ext), Some(7));
        assert_eq!(
            pool.get(99 + CHUNK_LEN as u32).map(|e| e.ext),
            Some(bound as u64 - 1)
        );
        for _ in 0..CHUNK_LEN {
            pool.alloc(Entry::new(0, 0, 0, 1)).unwrap();
        }
        assert_eq!(lens(&pool), vec![CHUNK_LEN, CHUNK_LEN, CHUNK_LEN]);

        let mut exact = Pool::with_bound(2 * CHUNK_LEN);
        for _ in 0..2 * CHUNK_LEN {
            exact.alloc(Entry::new(0, 0, 0, 1)).unwrap();
        }
        assert_eq!(lens(&exact), vec![CHUNK_LEN, CHUNK_LEN]);

        let mut unbounded = Pool::default();
        unbounded.alloc(Entry::new(0, 0, 0, 1)).unwrap();
        assert_eq!(lens(&unbounded), vec![CHUNK_LEN]);
    }
}
