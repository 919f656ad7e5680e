//! Per-slot block counts with the eviction victim (most blocks, lowest slot on ties) kept in a
//! tournament tree: O(log slots) per count change, O(1) to read, instead of a scan of every slot
//! per evicted block.

#[derive(Clone, Debug, Default)]
pub(super) struct Fullest {
    counts: Vec<u32>,
    /// Heap-ordered: node i has children 2i and 2i+1; leaves start at `leaves`; each node holds
    /// the winning slot of its subtree (`u32::MAX` for padding).
    tree: Vec<u32>,
    leaves: usize,
}

const NONE: u32 = u32::MAX;

impl Fullest {
    pub fn new(num_slots: usize) -> Fullest {
        let leaves = num_slots.max(1).next_power_of_two();
        let mut tree = vec![NONE; 2 * leaves];
        for (slot, leaf) in tree.iter_mut().skip(leaves).take(num_slots).enumerate() {
            *leaf = u32::try_from(slot).unwrap_or(NONE);
        }
        let mut f = Fullest {
            counts: vec![0; num_slots],
            tree,
            leaves,
        };
        for node in (1..leaves).rev() {
            f.refresh(node);
        }
        f
    }

    pub fn count(&self, slot: usize) -> usize {
        self.counts.get(slot).map_or(0, |&c| c as usize)
    }

    fn wins(&self, a: u32, b: u32) -> bool {
        let count = |s: u32| self.counts.get(s as usize).map(|&c| i64::from(c));
        match (count(a), count(b)) {
            (Some(ca), Some(cb)) => ca > cb || (ca == cb && a < b),
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    fn refresh(&mut self, node: usize) {
        let left = self.tree.get(2 * node).copied().unwrap_or(NONE);
        let right = self.tree.get(2 * node + 1).copied().unwrap_or(NONE);
        let winner = if self.wins(right, left) { right } else { left };
        if let Some(n) = self.tree.get_mut(node) {
            *n = winner;
        }
    }

    pub fn set(&mut self, slot: usize, count: usize) {
        let Some(c) = self.counts.get_mut(slot) else {
            return;
        };
        *c = u32::try_from(count).unwrap_or(u32::MAX);
        let mut node = (self.leaves + slot) / 2;
        while node >= 1 {
            self.refresh(node);
            node /= 2;
        }
    }

    pub fn add(&mut self, slot: usize, delta: isize) {
        let now = self.count(slot).saturating_add_signed(delta);
        self.set(slot, now);
    }

    /// The slot holding the most blocks (lowest index on ties), if any holds one.
    pub fn victim(&self) -> Option<u16> {
        let slot = self.tree.get(1).copied().unwrap_or(NONE);
        if self.count(slot as usize) == 0 {
            return None;
        }
        u16::try_from(slot).ok()
    }
}
