//! The mirror: which blocks each engine rank holds right now, per medium, with reference counts.
//!
//! Invariants:
//! * vLLM does not deduplicate: two physical blocks can carry one hash, each stored and removed
//!   on its own. A block stays in the mirror (and in the filter's index) until its count reaches
//!   0; only then is a `BlockRemoved` forwarded.
//! * The mirror holds what the forwarded events say and nothing else, so `/kv/dump` (built from
//!   the mirror) equals replaying the forwarded events from the start.
//! * At most `max_blocks` (rank, medium, hash) entries; a store that would exceed the bound is
//!   refused whole (and not forwarded), never half applied.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

pub use kv_router_protocol::page::{DpRank, DumpRun};

/// One cached block of one rank on one medium.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Block {
    refs: u32,
    parent: Option<u64>,
    tokens: Box<[u32]>,
    lora_name: Option<Arc<str>>,
}

/// A validated store of `block_hashes.len()` full blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRequest<'a> {
    pub medium: &'a str,
    pub parent: Option<u64>,
    pub block_hashes: &'a [u64],
    /// `block_hashes.len() * block_size` tokens.
    pub token_ids: &'a [u32],
    pub block_size: usize,
    pub lora_name: Option<&'a str>,
}

/// Why a store was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The mirror would hold more than `max_blocks` entries.
    Full { max_blocks: usize },
    /// `token_ids` does not hold `block_size` tokens per block.
    TokenCount,
}

/// What a removal did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    /// Hashes whose last copy went: forward these.
    pub gone: Vec<u64>,
    /// Copies dropped that leave the block held by another copy.
    pub still_held: usize,
    /// Hashes the mirror did not hold (stored before the bridge saw the stream, or refused).
    pub unknown: usize,
}

/// Per-rank blocks by medium.
type RankMedia = BTreeMap<String, HashMap<u64, Block>>;

#[derive(Debug)]
pub struct Mirror {
    ranks: BTreeMap<DpRank, RankMedia>,
    entries: usize,
    max_blocks: usize,
}

impl Mirror {
    pub fn new(max_blocks: usize) -> Self {
        Mirror {
            ranks: BTreeMap::new(),
            entries: 0,
            max_blocks,
        }
    }

    /// (rank, medium, hash) entries held.
    pub fn entries(&self) -> usize {
        self.entries
    }

    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Entries held by one rank.
    pub fn rank_entries(&self, rank: DpRank) -> usize {
        self.ranks
            .get(&rank)
            .map_or(0, |media| media.values().map(HashMap::len).sum())
    }

    /// Reference count of one block (0 when absent).
    pub fn refs(&self, rank: DpRank, medium: &str, hash: u64) -> u32 {
        self.block(rank, medium, hash).map_or(0, |b| b.refs)
    }

    fn block(&self, rank: DpRank, medium: &str, hash: u64) -> Option<&Block> {
        self.ranks.get(&rank)?.get(medium)?.get(&hash)
    }

    /// The tokens and parent of `hash` on any medium of `rank`: lower-tier stores (a CPU
    /// offload of a GPU block) may arrive without token ids.
    pub fn known_block(
        &self,
        rank: DpRank,
        hash: u64,
    ) -> Option<(&[u32], Option<u64>, Option<&str>)> {
        self.ranks
            .get(&rank)?
            .values()
            .find_map(|blocks| blocks.get(&hash))
            .map(|b| (&*b.tokens, b.parent, b.lora_name.as_deref()))
    }

    /// Stores blocks (one more copy of each hash already held). All or nothing.
    pub fn store(&mut self, rank: DpRank, req: &StoreRequest<'_>) -> Result<(), StoreError> {
        let expected = req.block_hashes.len().checked_mul(req.block_size);
        if req.block_size == 0 || expected != Some(req.token_ids.len()) {
            return Err(StoreError::TokenCount);
        }
        let held = self.ranks.get(&rank).and_then(|m| m.get(req.medium));
        let new: HashSet<u64> = req
            .block_hashes
            .iter()
            .copied()
            .filter(|h| held.is_none_or(|blocks| !blocks.contains_key(h)))
            .collect();
        if self.entries.saturating_add(new.len()) > self.max_blocks {
            return Err(StoreError::Full {
                max_blocks: self.max_blocks,
            });
        }
        let lora: Option<Arc<str>> = req.lora_name.map(Arc::from);
        let blocks = self
            .ranks
            .entry(rank)
            .or_default()
            .entry(req.medium.to_owned())
            .or_default();
        let mut parent = req.parent;
        for (&hash, tokens) in req
            .block_hashes
            .iter()
            .zip(req.token_ids.chunks_exact(req.block_size))
        {
            match blocks.get_mut(&hash) {
                Some(block) => block.refs = block.refs.saturating_add(1),
                None => {
                    blocks.insert(
                        hash,
                        Block {
                            refs: 1,
                            parent,
                            tokens: tokens.into(),
                            lora_name: lora.clone(),
                        },
                    );
                    self.entries += 1;
                }
            }
            parent = Some(hash);
        }
        Ok(())
    }

    /// Drops one copy of each hash.
    pub fn remove(&mut self, rank: DpRank, medium: &str, hashes: &[u64]) -> Removal {
        let mut out = Removal::default();
        let Some(blocks) = self.ranks.get_mut(&rank).and_then(|m| m.get_mut(medium)) else {
            out.unknown = hashes.len();
            return out;
        };
        for &hash in hashes {
            match blocks.get_mut(&hash) {
                Some(block) if block.refs > 1 => {
                    block.refs -= 1;
                    out.still_held += 1;
                }
                Some(_) => {
                    blocks.remove(&hash);
                    self.entries = self.entries.saturating_sub(1);
                    out.gone.push(hash);
                }
                None => out.unknown += 1,
            }
        }
        if blocks.is_empty() {
            if let Some(media) = self.ranks.get_mut(&rank) {
                media.remove(medium);
                if media.is_empty() {
                    self.ranks.remove(&rank);
                }
            }
        }
        out
    }

    /// Drops every block of `rank` on every medium; returns how many entries went.
    pub fn clear_rank(&mut self, rank: DpRank) -> usize {
        let dropped = self.rank_entries(rank);
        self.ranks.remove(&rank);
        self.entries = self.entries.saturating_sub(dropped);
        dropped
    }

    /// The whole mirror as "stored" runs, parents before children (within a rank, across media:
    /// the filter looks a parent up on any tier). Blocks whose parent the rank no longer holds
    /// start their own run with that parent (the filter rejects them, as it would have then).
    pub fn dump(&self) -> Vec<DumpRun> {
        let mut runs = Vec::new();
        for (&rank, media) in &self.ranks {
            dump_rank(rank, media, &mut runs);
        }
        runs
    }
}

/// A block of a rank, named by its medium and hash.
type Node<'m> = (&'m str, u64);

fn dump_rank(rank: DpRank, media: &RankMedia, runs: &mut Vec<DumpRun>) {
    let present: HashSet<u64> = media.values().flat_map(|b| b.keys().copied()).collect();
    let mut children: HashMap<u64, Vec<Node<'_>>> = HashMap::new();
    let mut roots: Vec<Node<'_>> = Vec::new();
    for (medium, blocks) in media {
        for (&hash, block) in blocks {
            match block.parent {
                Some(p) if present.contains(&p) => {
                    children.entry(p).or_default().push((medium.as_str(), hash))
                }
                _ => roots.push((medium.as_str(), hash)),
            }
        }
    }
    // Deterministic output: the stack pops the smallest first.
    roots.sort_unstable_by(|a, b| b.cmp(a));
    for kids in children.values_mut() {
        kids.sort_unstable_by(|a, b| b.cmp(a));
    }
    let mut stack = roots;
    let mut expanded: HashSet<u64> = HashSet::new();
    let mut current: Option<DumpRun> = None;
    while let Some((medium, hash)) = stack.pop() {
        let Some(block) = media.get(medium).and_then(|b| b.get(&hash)) else {
            continue;
        };
        let lora = block.lora_name.as_deref();
        let extends = current.as_ref().is_some_and(|run| {
            run.medium == medium
                && run.lora_name.as_deref() == lora
                && run.block_hashes.last().copied() == block.parent
        });
        if !extends {
            runs.extend(current.take());
            current = Some(DumpRun {
                dp_rank: rank,
                medium: medium.to_owned(),
                parent: block.parent,
                block_hashes: Vec::new(),
                token_ids: Vec::new(),
                lora_name: lora.map(str::to_owned),
            });
        }
        if let Some(run) = current.as_mut() {
            run.block_hashes.push(hash);
            run.token_ids.extend_from_slice(&block.tokens);
        }
        // A hash held on several media has one set of children; expand it once. Cycles (only
        // possible with hash collisions) are never reached from a root, so this terminates.
        if expanded.insert(hash) {
            if let Some(kids) = children.get(&hash) {
                stack.extend(kids.iter().copied());
            }
        }
    }
    runs.extend(current);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(
        m: &mut Mirror,
        rank: DpRank,
        parent: Option<u64>,
        hashes: &[u64],
    ) -> Result<(), StoreError> {
        let tokens: Vec<u32> = hashes
            .iter()
            .flat_map(|&h| [h as u32, h as u32 + 1])
            .collect();
        m.store(
            rank,
            &StoreRequest {
                medium: "GPU",
                parent,
                block_hashes: hashes,
                token_ids: &tokens,
                block_size: 2,
                lora_name: None,
            },
        )
    }

    #[test]
    fn double_store_needs_two_removals() {
        let mut m = Mirror::new(100);
        store(&mut m, 0, None, &[1, 2]).unwrap();
        store(&mut m, 0, None, &[1]).unwrap();
        assert_eq!(m.refs(0, "GPU", 1), 2);
        assert_eq!(m.entries(), 2);
        let r = m.remove(0, "GPU", &[1]);
        assert_eq!(
            r,
            Removal {
                gone: vec![],
                still_held: 1,
                unknown: 0
            }
        );
        assert_eq!(m.refs(0, "GPU", 1), 1);
        let r = m.remove(0, "GPU", &[1, 2, 9]);
        assert_eq!(
            r,
            Removal {
                gone: vec![1, 2],
                still_held: 0,
                unknown: 1
            }
        );
        assert_eq!(m.entries(), 0);
        // A third removal of a gone block is unknown, never negative.
        assert_eq!(m.remove(0, "GPU", &[1]).unknown, 1);
    }

    #[test]
    fn media_and_ranks_are_separate() {
        let mut m = Mirror::new(100);
        store(&mut m, 0, None, &[1]).unwrap();
        store(&mut m, 1, None, &[1]).unwrap();
        m.store(
            0,
            &StoreRequest {
                medium: "CPU",
                parent: None,
                block_hashes: &[1],
                token_ids: &[1, 2],
                block_size: 2,
                lora_name: None,
            },
        )
        .unwrap();
        assert_eq!(m.entries(), 3);
        assert_eq!(m.remove(0, "CPU", &[1]).gone, vec![1]);
        assert_eq!(m.refs(0, "GPU", 1), 1);
        assert_eq!(m.refs(1, "GPU", 1), 1);
    }

    #[test]
    fn clear_drops_one_rank_on_every_medium() {
        let mut m = Mirror::new(100);
        store(&mut m, 0, None, &[1, 2]).unwrap();
        store(&mut m, 1, None, &[3]).unwrap();
        assert_eq!(m.clear_rank(0), 2);
        assert_eq!(m.entries(), 1);
        assert_eq!(m.rank_entries(1), 1);
        assert_eq!(m.clear_rank(0), 0);
    }

    #[test]
    fn full_mirror_refuses_the_whole_store() {
        let mut m = Mirror::new(3);
        store(&mut m, 0, None, &[1, 2]).unwrap();
        assert_eq!(
            store(&mut m, 0, Some(2), &[3, 4]),
            Err(StoreError::Full { max_blocks: 3 })
        );
        assert_eq!(m.entries(), 2);
        assert_eq!(m.refs(0, "GPU", 3), 0);
        // Re-storing held blocks needs no room.
        store(&mut m, 0, None, &[1, 2]).unwrap();
        store(&mut m, 0, Some(2), &[3]).unwrap();
        assert_eq!(m.entries(), 3);
    }

    #[test]
    fn token_count_must_match() {
        let mut m = Mirror::new(10);
        let req = StoreRequest {
            medium: "GPU",
            parent: None,
            block_hashes: &[1, 2],
            token_ids: &[1, 2, 3],
            block_size: 2,
            lora_name: None,
        };
        assert_eq!(m.store(0, &req), Err(StoreError::TokenCount));
        assert_eq!(m.entries(), 0);
    }

    #[test]
    fn dump_orders_parents_first_and_merges_chains() {
        let mut m = Mirror::new(100);
        // Stored children first, in separate events: the dump must still put parents first.
        store(&mut m, 0, Some(20), &[30]).unwrap();
        store(&mut m, 0, Some(10), &[20]).unwrap();
        store(&mut m, 0, None, &[10]).unwrap();
        store(&mut m, 0, Some(10), &[25]).unwrap(); // a branch
        store(&mut m, 0, Some(99), &[50]).unwrap(); // orphan: parent not held
        let runs = m.dump();
        let mut seen = HashSet::new();
        for run in &runs {
            if let Some(p) = run.parent {
                assert!(
                    seen.contains(&p) || p == 99,
                    "parent {p} after its child in {runs:?}"
                );
            }
            seen.extend(run.block_hashes.iter().copied());
            assert_eq!(run.token_ids.len(), run.block_hashes.len() * 2);
        }
        assert_eq!(seen.len(), 5);
        // 10 -> 20 -> 30 is one run (the chain), 25 and 50 are runs of their own.
        let chain = runs
            .iter()
            .find(|r| r.block_hashes.first() == Some(&10))
            .unwrap();
        assert_eq!(chain.block_hashes, vec![10, 20, 30]);
        assert_eq!(chain.token_ids, vec![10, 11, 20, 21, 30, 31]);
        assert_eq!(runs.len(), 3);
    }

    #[test]
    fn dump_links_parents_across_media() {
        let mut m = Mirror::new(100);
        m.store(
            0,
            &StoreRequest {
                medium: "CPU",
                parent: Some(1),
                block_hashes: &[2],
                token_ids: &[2, 3],
                block_size: 2,
                lora_name: None,
            },
        )
        .unwrap();
        store(&mut m, 0, None, &[1]).unwrap();
        let runs = m.dump();
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[0].medium.as_str(), runs[0].block_hashes.clone()),
            ("GPU", vec![1])
        );
        assert_eq!((runs[1].medium.as_str(), runs[1].parent), ("CPU", Some(1)));
    }
}
