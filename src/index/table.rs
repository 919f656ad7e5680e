//! An open-addressing hash table of entry ids (4 bytes a bucket): linear probing, backward-shift
//! deletion (no tombstones), any capacity (positions by multiply-shift), so it can be sized to
//! the configured bound exactly instead of the next power of two.
//!
//! Keys live in the entries, not in the table: callers pass the key's hash and an equality test
//! on ids, and a `hash_of(id)` to re-place ids when the table grows or shifts. A bucket is
//! `tag << 24 | (id + 1)` (0 = empty); the 8-bit tag (hash bits) avoids reading an entry for
//! almost every non-matching probe.
//!
//! Growth: by 1.5x while below the capacity for the configured bound at 80% load; at that
//! capacity the load may reach 15/16 (one event's blocks land before eviction trims them), and
//! only beyond that does it grow further.

const ID_BITS: u32 = 24;
const ID_MASK: u32 = (1 << ID_BITS) - 1;

fn capacity_for(len: usize) -> usize {
    len.saturating_add(len / 4).saturating_add(8)
}

#[derive(Clone, Debug, Default)]
pub(super) struct IdTable {
    buckets: Vec<u32>,
    len: usize,
    /// Capacity that holds the configured bound at 80% load.
    bound_capacity: usize,
}

/// Where a key's probe sequence starts, and its tag.
fn home(hash: u64, capacity: usize) -> usize {
    (((hash >> 32) * capacity as u64) >> 32) as usize
}

fn tag(hash: u64) -> u32 {
    (hash as u32) >> ID_BITS
}

fn bucket_id(bucket: u32) -> u32 {
    (bucket & ID_MASK).wrapping_sub(1)
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
        let tag = tag(hash);
        let mut pos = home(hash, capacity);
        for _ in 0..capacity {
            let bucket = *self.buckets.get(pos)?;
            if bucket == 0 {
                return None;
            }
            if bucket >> ID_BITS == tag && eq(bucket_id(bucket)) {
                return Some((pos, bucket_id(bucket)));
            }
            pos = self.next_pos(pos);
        }
        None
    }

    /// Replaces the id at `pos` (same key, so same tag).
    pub fn set_id(&mut self, pos: usize, id: u32) {
        if let Some(b) = self.buckets.get_mut(pos) {
            *b = (*b & !ID_MASK) | (id.wrapping_add(1) & ID_MASK);
        }
    }

    /// Adds `id` under `hash`; the key must be absent. `hash_of` re-hashes stored ids on growth.
    pub fn insert(&mut self, hash: u64, id: u32, hash_of: impl Fn(u32) -> u64) {
        self.reserve_one(&hash_of);
        self.place(hash, id);
        self.len = self.len.saturating_add(1);
    }

    fn place(&mut self, hash: u64, id: u32) {
        let capacity = self.buckets.len();
        if capacity == 0 {
            return;
        }
        let bucket = (tag(hash) << ID_BITS) | (id.wrapping_add(1) & ID_MASK);
        let mut pos = home(hash, capacity);
        for _ in 0..capacity {
            match self.buckets.get_mut(pos) {
                Some(b) if *b == 0 => {
                    *b = bucket;
                    return;
                }
                Some(_) => pos = self.next_pos(pos),
                None => return,
            }
        }
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
        }
        grown = grown.max(capacity_for(self.len.saturating_add(1)));
        let old = core::mem::replace(&mut self.buckets, vec![0; grown]);
        for bucket in old {
            if bucket != 0 {
                let id = bucket_id(bucket);
                self.place(hash_of(id), id);
            }
        }
    }

    /// Empties the bucket at `pos`, shifting later members of its cluster back.
    pub fn remove_at(&mut self, pos: usize, hash_of: impl Fn(u32) -> u64) {
        let capacity = self.buckets.len();
        let Some(b) = self.buckets.get_mut(pos) else {
            return;
        };
        *b = 0;
        self.len = self.len.saturating_sub(1);
        let mut hole = pos;
        let mut j = pos;
        for _ in 0..capacity {
            j = self.next_pos(j);
            let bucket = self.buckets.get(j).copied().unwrap_or(0);
            if bucket == 0 {
                return;
            }
            let start = home(hash_of(bucket_id(bucket)), capacity);
            // Movable iff the hole lies on its probe path, i.e. within [start, j) cyclically.
            let dist_start = (j + capacity - start) % capacity;
            let dist_hole = (j + capacity - hole) % capacity;
            if dist_start >= dist_hole {
                if let Some(h) = self.buckets.get_mut(hole) {
                    *h = bucket;
                }
                if let Some(b) = self.buckets.get_mut(j) {
                    *b = 0;
                }
                hole = j;
            }
        }
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
