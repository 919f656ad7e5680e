//! The mock engine's paged KV cache: fixed-size blocks identified by a chained hash of their
//! tokens, prefix reuse, leaf-first LRU eviction, and an optional host tier.
//!
//! Invariants:
//! * `device_count + private_blocks <= device_capacity`; `host_count <= host_capacity`.
//! * Every cached block's parent is cached (on some tier): eviction is leaf-first.
//! * A device block's parent is on the device (blocks enter the device in prefix order and leave
//!   it only when no device child remains), so the host tier is closed under children.
//! * A device block is evictable iff no sequence references it and it has no device child;
//!   a host block iff it has no child at all. Among evictable blocks the least recently used goes.
//! * Events are recorded only for real changes: a block newly cached on a tier ("stored", with its
//!   parent and its tokens), a block leaving a tier ("removed"), or a reset ("cleared").

use std::collections::{BTreeSet, HashMap};

use crate::util::splitmix64;

/// The engine's (opaque) block hash.
pub type BlockHash = u64;

/// Where a cached block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
}

impl Tier {
    /// vLLM's `medium` value.
    pub fn medium(self) -> &'static str {
        match self {
            Tier::Device => "GPU",
            Tier::Host => "CPU",
        }
    }
}

/// A change to the cache, in vLLM's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A chain of blocks newly cached on `tier`; `token_ids` holds all their tokens in order.
    Stored {
        tier: Tier,
        parent: Option<BlockHash>,
        hashes: Vec<BlockHash>,
        token_ids: Vec<u32>,
    },
    Removed {
        tier: Tier,
        hashes: Vec<BlockHash>,
    },
    Cleared,
}

/// One cached block as listed by [`KvCache::snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedBlock {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tier: Tier,
    pub tokens: Vec<u32>,
}

/// Hash of a block given its parent's hash and its tokens.
pub fn chain_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = splitmix64(parent.unwrap_or(0x6D6F_636B_6B76_0000) ^ 0xA076_1D64_78BD_642F);
    for &t in tokens {
        h = splitmix64(h ^ u64::from(t));
    }
    h
}

/// Chained hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            let h = chain_hash(parent, chunk);
            parent = Some(h);
            h
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Block {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    tier: Tier,
    refs: u32,
    dev_children: u32,
    host_children: u32,
    last_used: u64,
    depth: u32,
    listed: Option<(Tier, u64)>,
}

#[derive(Debug, Clone)]
pub struct KvCache {
    block_size: usize,
    device_capacity: usize,
    host_capacity: usize,
    blocks: HashMap<BlockHash, Block>,
    device_count: usize,
    host_count: usize,
    private_blocks: usize,
    referenced: usize,
    device_lru: BTreeSet<(u64, BlockHash)>,
    host_lru: BTreeSet<(u64, BlockHash)>,
    clock: u64,
    events: Vec<CacheEvent>,
}

impl KvCache {
    pub fn new(block_size: usize, device_capacity: usize, host_capacity: usize) -> Self {
        KvCache {
            block_size: block_size.max(1),
            device_capacity,
            host_capacity,
            blocks: HashMap::new(),
            device_count: 0,
            host_count: 0,
            private_blocks: 0,
            referenced: 0,
            device_lru: BTreeSet::new(),
            host_lru: BTreeSet::new(),
            clock: 0,
            events: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn device_capacity(&self) -> usize {
        self.device_capacity
    }

    /// Cached blocks on the device.
    pub fn device_count(&self) -> usize {
        self.device_count
    }

    /// Cached blocks on the host.
    pub fn host_count(&self) -> usize {
        self.host_count
    }

    /// Blocks in use by sequences: referenced cached blocks plus private (uncached) blocks.
    pub fn active_blocks(&self) -> usize {
        self.referenced + self.private_blocks
    }

    /// Device slots neither cached nor allocated.
    pub fn free_slots(&self) -> usize {
        self.device_capacity
            .saturating_sub(self.device_count + self.private_blocks)
    }

    /// Whether a block is cached, and where.
    pub fn tier_of(&self, h: BlockHash) -> Option<Tier> {
        self.blocks.get(&h).map(|b| b.tier)
    }

    /// Length of the prefix of `hashes` cached on the device, then of the continuation on the host.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> (usize, usize) {
        let device = hashes
            .iter()
            .take_while(|h| self.tier_of(**h) == Some(Tier::Device))
            .count();
        let host = hashes
            .iter()
            .skip(device)
            .take_while(|h| self.tier_of(**h) == Some(Tier::Host))
            .count();
        (device, host)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn relist(&mut self, h: BlockHash) {
        let Some(b) = self.blocks.get_mut(&h) else {
            return;
        };
        match b.listed.take() {
            Some((Tier::Device, t)) => {
                self.device_lru.remove(&(t, h));
            }
            Some((Tier::Host, t)) => {
                self.host_lru.remove(&(t, h));
            }
            None => {}
        }
        let evictable = match b.tier {
            Tier::Device => b.refs == 0 && b.dev_children == 0,
            Tier::Host => b.dev_children == 0 && b.host_children == 0,
        };
        if evictable {
            b.listed = Some((b.tier, b.last_used));
            match b.tier {
                Tier::Device => self.device_lru.insert((b.last_used, h)),
                Tier::Host => self.host_lru.insert((b.last_used, h)),
            };
        }
    }

    fn adjust_children(&mut self, parent: Option<BlockHash>, tier: Tier, delta: i32) {
        let Some(p) = parent else {
            return;
        };
        if let Some(b) = self.blocks.get_mut(&p) {
            let c = match tier {
                Tier::Device => &mut b.dev_children,
                Tier::Host => &mut b.host_children,
            };
            *c = c.saturating_add_signed(delta);
            self.relist(p);
        }
    }

    fn push_removed(&mut self, tier: Tier, h: BlockHash) {
        if let Some(CacheEvent::Removed { tier: t, hashes }) = self.events.last_mut() {
            if *t == tier {
                hashes.push(h);
                return;
            }
        }
        self.events.push(CacheEvent::Removed {
            tier,
            hashes: vec![h],
        });
    }

    fn push_stored(&mut self, tier: Tier, parent: Option<BlockHash>, h: BlockHash, tokens: &[u32]) {
        if let Some(CacheEvent::Stored {
            tier: t,
            hashes,
            token_ids,
            ..
        }) = self.events.last_mut()
        {
            if *t == tier && hashes.last().copied() == parent && parent.is_some() {
                hashes.push(h);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.events.push(CacheEvent::Stored {
            tier,
            parent,
            hashes: vec![h],
            token_ids: tokens.to_vec(),
        });
    }

    /// Takes a reference on a device block (a prefix hit). False if it is not on the device.
    pub fn acquire(&mut self, h: BlockHash) -> bool {
        let now = self.tick();
        match self.blocks.get_mut(&h) {
            Some(b) if b.tier == Tier::Device => {
                if b.refs == 0 {
                    self.referenced += 1;
                }
                b.refs += 1;
                b.last_used = now;
                self.relist(h);
                true
            }
            _ => false,
        }
    }

    /// Drops a reference taken by [`KvCache::acquire`], [`KvCache::reload`] or [`KvCache::commit`].
    pub fn release(&mut self, h: BlockHash) {
        let now = self.tick();
        if let Some(b) = self.blocks.get_mut(&h) {
            if b.refs > 0 {
                b.refs -= 1;
                if b.refs == 0 {
                    self.referenced -= 1;
                }
            }
            b.last_used = now;
            self.relist(h);
        }
    }

    /// Evicts least recently used device leaves until `slots` device slots are free.
    pub fn make_room(&mut self, slots: usize) -> bool {
        while self.free_slots() < slots {
            let Some(&(_, victim)) = self.device_lru.iter().next() else {
                return false;
            };
            self.evict_device(victim);
        }
        true
    }

    fn evict_device(&mut self, h: BlockHash) {
        let Some(b) = self.blocks.get_mut(&h) else {
            return;
        };
        if let Some((Tier::Device, t)) = b.listed.take() {
            self.device_lru.remove(&(t, h));
        }
        let parent = b.parent;
        self.push_removed(Tier::Device, h);
        self.device_count -= 1;
        self.adjust_children(parent, Tier::Device, -1);
        let mut to_host = self.host_capacity > 0;
        while to_host && self.host_count >= self.host_capacity {
            match self.host_lru.iter().next() {
                Some(&(_, victim)) => self.drop_host(victim),
                None => to_host = false,
            }
        }
        if to_host {
            let Some(b) = self.blocks.get_mut(&h) else {
                return;
            };
            b.tier = Tier::Host;
            let tokens = b.tokens.clone();
            self.host_count += 1;
            self.adjust_children(parent, Tier::Host, 1);
            self.push_stored(Tier::Host, parent, h, &tokens);
            self.relist(h);
        } else if let Some(b) = self.blocks.remove(&h) {
            // Dropping a host child above may have listed it again.
            match b.listed {
                Some((Tier::Device, t)) => {
                    self.device_lru.remove(&(t, h));
                }
                Some((Tier::Host, t)) => {
                    self.host_lru.remove(&(t, h));
                }
                None => {}
            }
        }
    }

    fn drop_host(&mut self, h: BlockHash) {
        let Some(b) = self.blocks.remove(&h) else {
            return;
        };
        if let Some((Tier::Host, t)) = b.listed {
            self.host_lru.remove(&(t, h));
        }
        self.host_count -= 1;
        self.push_removed(Tier::Host, h);
        self.adjust_children(b.parent, Tier::Host, -1);
    }

    /// Moves a host block back to the device (its parent must be on the device) and takes a
    /// reference on it. Needs a free device slot. False if impossible.
    pub fn reload(&mut self, h: BlockHash) -> bool {
        if self.tier_of(h) != Some(Tier::Host) || self.free_slots() == 0 {
            return false;
        }
        let now = self.tick();
        let Some(b) = self.blocks.get_mut(&h) else {
            return false;
        };
        let parent = b.parent;
        b.tier = Tier::Device;
        b.refs += 1;
        b.last_used = now;
        let tokens = b.tokens.clone();
        self.referenced += 1;
        self.host_count -= 1;
        self.device_count += 1;
        self.push_removed(Tier::Host, h);
        self.push_stored(Tier::Device, parent, h, &tokens);
        self.adjust_children(parent, Tier::Host, -1);
        self.adjust_children(parent, Tier::Device, 1);
        self.relist(h);
        true
    }

    /// Reserves `n` uncached device blocks for a sequence (call [`KvCache::make_room`] first).
    pub fn alloc_private(&mut self, n: usize) -> bool {
        if self.free_slots() < n {
            return false;
        }
        self.private_blocks += n;
        true
    }

    pub fn free_private(&mut self, n: usize) {
        self.private_blocks = self.private_blocks.saturating_sub(n);
    }

    /// Turns one private block, now full with `tokens`, into the cached block `h` under `parent`
    /// (which the caller holds), referenced once. A block already cached is shared instead (no
    /// event); one cached on the host is replaced by the fresh device copy.
    pub fn commit(&mut self, h: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) {
        self.free_private(1);
        match self.tier_of(h) {
            Some(Tier::Device) => {
                self.acquire(h);
                return;
            }
            Some(Tier::Host) => {
                // Reload path: the slot just released is reused.
                self.reload(h);
                return;
            }
            None => {}
        }
        let now = self.tick();
        let depth = parent
            .and_then(|p| self.blocks.get(&p))
            .map_or(0, |p| p.depth + 1);
        self.blocks.insert(
            h,
            Block {
                parent,
                tokens: tokens.to_vec(),
                tier: Tier::Device,
                refs: 1,
                dev_children: 0,
                host_children: 0,
                last_used: now,
                depth,
                listed: None,
            },
        );
        self.referenced += 1;
        self.device_count += 1;
        self.adjust_children(parent, Tier::Device, 1);
        self.push_stored(Tier::Device, parent, h, tokens);
    }

    /// Drops every cached block (references included) and records one "cleared" event.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.device_lru.clear();
        self.host_lru.clear();
        self.device_count = 0;
        self.host_count = 0;
        self.referenced = 0;
        self.events.push(CacheEvent::Cleared);
    }

    /// Takes the events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached block, parents before children.
    pub fn snapshot(&self) -> Vec<CachedBlock> {
        let mut all: Vec<(u32, BlockHash, &Block)> =
            self.blocks.iter().map(|(h, b)| (b.depth, *h, b)).collect();
        all.sort_by_key(|(d, h, _)| (*d, *h));
        all.into_iter()
            .map(|(_, hash, b)| CachedBlock {
                hash,
                parent: b.parent,
                tier: b.tier,
                tokens: b.tokens.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    fn toks(seed: u32, n_blocks: usize) -> Vec<u32> {
        (0..(n_blocks * BS) as u32)
            .map(|i| seed * 1000 + i)
            .collect()
    }

    /// Caches a whole chain as a sequence would (alloc, commit), then releases it.
    fn cache_chain(c: &mut KvCache, tokens: &[u32]) -> Vec<BlockHash> {
        let hashes = block_hashes(tokens, BS);
        let (dev, _) = c.match_prefix(&hashes);
        for h in &hashes[..dev] {
            assert!(c.acquire(*h));
        }
        let need = hashes.len() - dev;
        assert!(c.make_room(need));
        assert!(c.alloc_private(need));
        for i in dev..hashes.len() {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            c.commit(hashes[i], parent, &tokens[i * BS..(i + 1) * BS]);
        }
        for h in &hashes {
            c.release(*h);
        }
        hashes
    }

    #[test]
    fn stored_events_only_for_new_blocks_and_chained() {
        let mut c = KvCache::new(BS, 16, 0);
        let a = toks(1, 3);
        let ha = cache_chain(&mut c, &a);
        let ev = c.take_events();
        assert_eq!(
            ev,
            vec![CacheEvent::Stored {
                tier: Tier::Device,
                parent: None,
                hashes: ha.clone(),
                token_ids: a.clone()
            }]
        );
        // Same prefix, one more block: only the new block is stored, under its parent.
        let mut b = a.clone();
        b.extend(toks(2, 1));
        let hb = cache_chain(&mut c, &b);
        let ev = c.take_events();
        assert_eq!(
            ev,
            vec![CacheEvent::Stored {
                tier: Tier::Device,
                parent: Some(ha[2]),
                hashes: vec![hb[3]],
                token_ids: b[12..16].to_vec()
            }]
        );
        assert_eq!(c.device_count(), 4);
        assert_eq!(c.active_blocks(), 0);
        assert_eq!(c.match_prefix(&hb), (4, 0));
    }

    #[test]
    fn eviction_is_leaf_first_lru() {
        let mut c = KvCache::new(BS, 6, 0);
        let ha = cache_chain(&mut c, &toks(1, 3)); // oldest
        let hb = cache_chain(&mut c, &toks(2, 3));
        c.take_events();
        // Need 2 slots: evicts a's leaf, then a's middle block (now a leaf), never a's root first.
        assert!(c.make_room(2));
        assert_eq!(
            c.take_events(),
            vec![CacheEvent::Removed {
                tier: Tier::Device,
                hashes: vec![ha[2], ha[1]]
            }]
        );
        assert_eq!(c.match_prefix(&ha), (1, 0));
        assert_eq!(c.match_prefix(&hb), (3, 0));
        // Referenced blocks are never evicted.
        for h in &hb {
            c.acquire(*h);
        }
        assert!(c.make_room(3)); // a's root goes
        assert!(!c.make_room(4));
        assert_eq!(c.match_prefix(&hb), (3, 0));
    }

    #[test]
    fn lru_order_follows_use() {
        let mut c = KvCache::new(BS, 2, 0);
        let ha = cache_chain(&mut c, &toks(1, 1));
        let hb = cache_chain(&mut c, &toks(2, 1));
        // Touch a again: b becomes the least recently used.
        c.acquire(ha[0]);
        c.release(ha[0]);
        c.take_events();
        assert!(c.make_room(1));
        assert_eq!(
            c.take_events(),
            vec![CacheEvent::Removed {
                tier: Tier::Device,
                hashes: vec![hb[0]]
            }]
        );
    }

    #[test]
    fn host_tier_offload_reload_and_eviction() {
        let mut c = KvCache::new(BS, 2, 2);
        let ha = cache_chain(&mut c, &toks(1, 2));
        c.take_events();
        assert!(c.make_room(2));
        let ev = c.take_events();
        // Leaf first: each block leaves the device and is stored on the host under its parent.
        assert_eq!(
            ev,
            vec![
                CacheEvent::Removed {
                    tier: Tier::Device,
                    hashes: vec![ha[1]]
                },
                CacheEvent::Stored {
                    tier: Tier::Host,
                    parent: Some(ha[0]),
                    hashes: vec![ha[1]],
                    token_ids: toks(1, 2)[4..].to_vec()
                },
                CacheEvent::Removed {
                    tier: Tier::Device,
                    hashes: vec![ha[0]]
                },
                CacheEvent::Stored {
                    tier: Tier::Host,
                    parent: None,
                    hashes: vec![ha[0]],
                    token_ids: toks(1, 2)[..4].to_vec()
                },
            ]
        );
        assert_eq!(c.match_prefix(&ha), (0, 2));
        // Reload in prefix order.
        assert!(c.reload(ha[0]));
        assert!(c.reload(ha[1]));
        assert_eq!(c.match_prefix(&ha), (2, 0));
        assert_eq!((c.device_count(), c.host_count()), (2, 0));
        c.release(ha[0]);
        c.release(ha[1]);
        // Host full: the host evicts its own leaves first.
        let hb = cache_chain(&mut c, &toks(2, 2)); // pushes a to the host
        let _ = cache_chain(&mut c, &toks(3, 2)); // pushes b to the host, a drops from it
        assert_eq!(c.match_prefix(&ha), (0, 0));
        assert_eq!(c.match_prefix(&hb), (0, 2));
        assert_eq!(c.host_count(), 2);
        // Snapshot lists parents first.
        let snap = c.snapshot();
        assert_eq!(snap.len(), 4);
        for (i, b) in snap.iter().enumerate() {
            if let Some(p) = b.parent {
                assert!(snap[..i].iter().any(|x| x.hash == p));
            }
        }
    }

    #[test]
    fn clear_emits_cleared() {
        let mut c = KvCache::new(BS, 4, 0);
        cache_chain(&mut c, &toks(1, 2));
        c.take_events();
        c.clear();
        assert_eq!(c.take_events(), vec![CacheEvent::Cleared]);
        assert_eq!(c.device_count(), 0);
        assert_eq!(c.free_slots(), 4);
    }
}
