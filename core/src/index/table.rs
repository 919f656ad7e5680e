//! An open-addressing hash table of entry ids (4 bytes a bucket): Robin Hood linear probing,
//! backward-shift deletion (no tombstones), any capacity (positions by multiply-shift), so it can
//! be sized to the configured bound exactly instead of the next power of two.
//!
//! Keys live in the entries, not in the table: callers pass the key's hash and an equality test
//! on ids, and a `hash_of(id)` to re-place ids when the table grows. A bucket is
//! `displacement << 24 | (id + 1)` (0 = empty). Robin Hood ordering means a lookup compares keys
//! (reads an entry) only for buckets whose home is its own (one or two at 89% load) and stops as
//! soon as it meets a bucket nearer its home; insertion and deletion never read an entry.
//!
//! Capacity: the first insert allocates the capacity for the configured bound at 89% load (if at
//! most `PRESIZE_MAX_BUCKETS`; else the table grows by 1.5x, at 80% load, up to it). At that
//! capacity the load may reach 15/16 (the index never holds more than its bound, this is a
//! margin), and only beyond that (or if a displacement would pass 255) does it grow further.

const ID_BITS: u32 = 24;
const ID_MASK: u32 = (1 << ID_BITS) - 1;
const MAX_DISPLACEMENT: u32 = 255;
/// Bounds up to this many buckets (16 MiB, `max_blocks` up to ~3.7M) are allocated in full on
/// the first insert; larger ones grow by 1.5x.
const PRESIZE_MAX_BUCKETS: usize = 1 << 22;

/// Buckets for `len` ids at ~89% load. The index evicts before it inserts at its bound, so a
/// table sized for the bound never holds more; Robin Hood ordering keeps lookups short at this
/// load (a miss stops at the first bucket nearer its home).
fn capacity_for(len: usize) -> usize {
    len.saturating_add(len / 8).saturating_add(8)
}

#[derive(Clone, Debug, Default)]
pub(super) struct IdTable {
    buckets: Vec<u32>,
    len: usize,
    /// Capacity that holds the configured bound at 89% load.
    bound_capacity: usize,
}

/// Where a key's probe sequence starts.
fn home(hash: u64, capacity: usize) -> usize {
    (((hash >> 32) * capacity as u64) >> 32) as usize
}

fn bucket_id(bucket: u32) -> u32 {
    (bucket & ID_MASK).wrapping_sub(1)
}

fn displacement(bucket: u32) -> u32 {
    bucket >> ID_BITS
}

fn make_bucket(id: u32, displacement: u32) -> u32 {
    (displacement << ID_BITS) | (id.wrapping_add(1) & ID_MASK)
}

impl IdTable {
    pub fn new(bound: usize) -> IdTable {
        IdTable {
            buckets: Vec::new(),
            len: 0,
            bound_capacity: capacity_for(bound),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn allocated_bytes(&self) -> usize {
        self.buckets.capacity() * 4
    }

    fn next_pos(&self, pos: usize) -> usize {
        if pos + 1 >= self.buckets.len() {
            0
        } else {
            pos + 1
        }
    }

    /// The position and id of the key with `hash` for which `eq(id)` holds.
    pub fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<(usize, u32)> {
        let capacity = self.buckets.len();
        if capacity == 0 {
            return None;
        }
        let mut pos = home(hash, capacity);
        for d in 0..=MAX_DISPLACEMENT {
            let bucket = *self.buckets.get(pos)?;
            if bucket == 0 || displacement(bucket) < d {
                return None;
            }
            if displacement(bucket) == d && eq(bucket_id(bucket)) {
                return Some((pos, bucket_id(bucket)));
            }
            pos = self.next_pos(pos);
        }
        None
    }

    /// Replaces the id at `pos` (same key, so same place).
    pub fn set_id(&mut self, pos: usize, id: u32) {
        if let Some(b) = self.buckets.get_mut(pos) {
            *b = make_bucket(id, displacement(*b));
        }
    }

    /// Adds `id` under `hash`; the key must be absent. `hash_of` re-hashes stored ids on growth.
    pub fn insert(&mut self, hash: u64, id: u32, hash_of: impl Fn(u32) -> u64) {
        self.reserve_one(&hash_of);
        let mut pending = Some((hash, id));
        // At most two rounds: a failed placement grows the table by half.
        for _ in 0..2 {
            let Some((hash, id)) = pending else {
                break;
            };
            pending = self
                .place(hash, id)
                .map(|evicted| (hash_of(evicted), evicted));
            if pending.is_some() {
                let grown = self.buckets.len().saturating_add(self.buckets.len() / 2);
                self.rehash(grown, &hash_of);
            }
        }
        self.len = self.len.saturating_add(1);
    }

    /// Robin Hood placement; returns an id it could not place within the displacement limit
    /// (not necessarily `id`: a poorer one may have been displaced).
    fn place(&mut self, hash: u64, id: u32) -> Option<u32> {
        let capacity = self.buckets.len();
        if capacity == 0 {
            return Some(id);
        }
        let mut carried = make_bucket(id, 0);
        let mut pos = home(hash, capacity);
        for _ in 0..capacity {
            let slot = self.buckets.get_mut(pos)?;
            if *slot == 0 {
                *slot = carried;
                return None;
            }
            if displacement(*slot) < displacement(carried) {
                core::mem::swap(slot, &mut carried);
            }
            if displacement(carried) >= MAX_DISPLACEMENT {
                return Some(bucket_id(carried));
            }
            carried += 1 << ID_BITS;
            pos = self.next_pos(pos);
        }
        Some(bucket_id(carried))
    }

    fn reserve_one(&mut self, hash_of: &impl Fn(u32) -> u64) {
        let capacity = self.buckets.len();
        let limit = if capacity >= self.bound_capacity {
            capacity - (capacity / 16).max(1)
        } else {
            capacity - capacity / 5
        };
        if capacity > 0 && self.len < limit {
            return;
        }
        let mut grown = capacity.saturating_add(capacity / 2).max(64);
        if capacity < self.bound_capacity {
            grown = grown.min(self.bound_capacity);
            if capacity == 0 && self.bound_capacity <= PRESIZE_MAX_BUCKETS {
                // Straight to the bound: the smaller tables a 1.5x growth would leave behind stay
                // resident in wasm linear memory (~2x the final table); untouched buckets of a
                // fresh zeroed allocation are not.
                grown = self.bound_capacity;
            }
        }
        self.rehash(grown, hash_of);
    }

    fn rehash(&mut self, capacity: usize, hash_of: &impl Fn(u32) -> u64) {
        let mut capacity = capacity.max(capacity_for(self.len.saturating_add(1)));
        let mut old = core::mem::replace(&mut self.buckets, vec![0; capacity]);
        let mut pending: Vec<u32> = Vec::new();
        // Normally one round; more only with a pathological hash distribution (crafted engine
        // hashes). Growth stops after a few rounds so memory stays bounded; ids still unplaced
        // then are dropped from the table (their entries just age out of the FIFO).
        for _ in 0..4 {
            let mut stray = Vec::new();
            for &bucket in old.iter().filter(|&&b| b != 0) {
                let id = bucket_id(bucket);
                stray.extend(self.place(hash_of(id), id));
            }
            for id in pending.drain(..) {
                stray.extend(self.place(hash_of(id), id));
            }
            if stray.is_empty() {
                return;
            }
            capacity = capacity.saturating_add(capacity / 2);
            old = core::mem::replace(&mut self.buckets, vec![0; capacity]);
            pending = stray;
        }
    }

    /// Empties the bucket at `pos`, shifting later members of its cluster back one step.
    pub fn remove_at(&mut self, pos: usize) {
        if self.buckets.get(pos).is_none() {
            return;
        }
        self.len = self.len.saturating_sub(1);
        let mut hole = pos;
        for _ in 0..self.buckets.len() {
            let j = self.next_pos(hole);
            let bucket = self.buckets.get(j).copied().unwrap_or(0);
            let shifted = if bucket == 0 || displacement(bucket) == 0 {
                0
            } else {
                bucket - (1 << ID_BITS)
            };
            if let Some(h) = self.buckets.get_mut(hole) {
                *h = shifted;
            }
            if shifted == 0 {
                return;
            }
            hole = j;
        }
    }

    /// Drops every id, keeping the allocation.
    pub fn reset(&mut self) {
        self.buckets.fill(0);
        self.len = 0;
    }

    /// Every stored id (any order).
    #[cfg(test)]
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets
            .iter()
            .filter(|&&b| b != 0)
            .map(|&b| bucket_id(b))
    }
}
