//! Engine events -> mirror + event page, under one lock so that a dump and its `last_event_id`
//! always agree.
//!
//! Only events the filter will accept are forwarded: the filter rejects a whole page for one bad
//! event (block size, token count, unknown medium), and a rejected page would stall its cursor
//! for good. Such events are refused here instead, counted and logged.

use std::collections::BTreeMap;

use kv_router_core::types::StorageTier;

use crate::mirror::{DpRank, Mirror, StoreError, StoreRequest};
use kv_router_protocol::page::{dump_json, event_json, page_json, Load, PageEvent};
use kv_router_protocol::ring::{EventRing, PageLimits};
use kv_router_protocol::vllm::{EngineEvent, StoredBlocks};

/// Bounds and the block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoreLimits {
    pub block_size: u32,
    /// Id of the first event (1, or a time-based start so that a restarted bridge's ids jump
    /// past the old ones; see `--first-event-id`).
    pub first_event_id: u64,
    pub max_blocks: usize,
    pub max_events: usize,
    pub max_ring_bytes: usize,
}

/// Why an engine event was not forwarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    BlockSizeMismatch {
        got: u64,
        expected: u32,
    },
    TokenCount {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    /// A store without token ids whose blocks the mirror does not know either.
    NoTokenIds {
        blocks: usize,
    },
    UnknownMedium {
        medium: String,
    },
    MirrorFull {
        max_blocks: usize,
    },
    /// Another engine endpoint already feeds this rank (configuration error).
    RankConflict {
        rank: DpRank,
        owner: usize,
    },
    /// More distinct ranks than [`MAX_RANKS`] (a misbehaving publisher).
    TooManyRanks {
        rank: DpRank,
    },
}

/// Distinct DP ranks the bridge tracks at most.
pub const MAX_RANKS: usize = 4096;

impl Refusal {
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::BlockSizeMismatch { .. } => "block_size_mismatch",
            Refusal::TokenCount { .. } => "token_count",
            Refusal::NoTokenIds { .. } => "no_token_ids",
            Refusal::UnknownMedium { .. } => "unknown_medium",
            Refusal::MirrorFull { .. } => "mirror_full",
            Refusal::RankConflict { .. } => "rank_conflict",
            Refusal::TooManyRanks { .. } => "too_many_ranks",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::BlockSizeMismatch { got, expected } => write!(
                f,
                "BlockStored with block_size {got}, but --block-size is {expected}: the router \
                 would never match a prefix; set --block-size (and the filter's block_size) to \
                 the engine's KV block size"
            ),
            Refusal::TokenCount {
                tokens,
                blocks,
                block_size,
            } => write!(
                f,
                "BlockStored with {blocks} blocks carries {tokens} token ids, not {blocks} x {block_size} \
                 (a partial page?)"
            ),
            Refusal::NoTokenIds { blocks } => write!(
                f,
                "BlockStored of {blocks} blocks without token ids, and not every block is known \
                 on another medium"
            ),
            Refusal::UnknownMedium { medium } => write!(
                f,
                "medium `{medium}` is not one the router knows (GPU/CPU/CPU_PINNED/DISK/...)"
            ),
            Refusal::MirrorFull { max_blocks } => write!(
                f,
                "the mirror holds --max-blocks ({max_blocks}) blocks; raise it to at least the \
                 engine's cache size (blocks of every medium and rank)"
            ),
            Refusal::RankConflict { rank, owner } => write!(
                f,
                "dp_rank {rank} already comes from engine #{owner}: give each endpoint its own \
                 --dp-rank"
            ),
            Refusal::TooManyRanks { rank } => {
                write!(f, "dp_rank {rank} would be rank number {} (limit)", MAX_RANKS + 1)
            }
        }
    }
}

/// What applying some events did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Forwarded page events by kind: stored, removed, cleared.
    pub forwarded: [u64; 3],
    pub refused: Vec<Refusal>,
    pub removed_unknown: u64,
    pub removed_still_held: u64,
    /// Stores completed with token ids from another medium.
    pub filled_tokens: u64,
}

impl ApplyOutcome {
    pub fn forwarded_total(&self) -> u64 {
        self.forwarded.iter().sum()
    }
}

/// The canonical spelling of a medium (absent or empty = GPU), if the filter knows it.
///
/// vLLM 0.32 names its storage-offload tier `STORAGE`: it is the disk tier and travels as `DISK`,
/// so that filters older than the `STORAGE` spelling accept the page too.
pub fn canonical_medium(medium: Option<&str>) -> Result<String, Refusal> {
    let name = match medium {
        None | Some("") => "GPU".to_owned(),
        Some(m) if m.eq_ignore_ascii_case("STORAGE") => "DISK".to_owned(),
        Some(m) => m.to_ascii_uppercase(),
    };
    match StorageTier::parse(Some(&name)) {
        Some(_) => Ok(name),
        None => Err(Refusal::UnknownMedium { medium: name }),
    }
}

#[derive(Debug)]
pub struct Core {
    limits: CoreLimits,
    mirror: Mirror,
    ring: EventRing,
    rank_owner: BTreeMap<DpRank, usize>,
}

impl Core {
    pub fn new(limits: CoreLimits) -> Self {
        Core {
            limits,
            mirror: Mirror::new(limits.max_blocks),
            ring: EventRing::starting_at(
                limits.first_event_id,
                limits.max_events,
                limits.max_ring_bytes,
            ),
            rank_owner: BTreeMap::new(),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.limits.block_size
    }

    pub fn mirror(&self) -> &Mirror {
        &self.mirror
    }

    pub fn ring(&self) -> &EventRing {
        &self.ring
    }

    pub fn last_event_id(&self) -> u64 {
        self.ring.last_id()
    }

    fn forward(&mut self, event: PageEvent, out: &mut ApplyOutcome) {
        let slot = match event {
            PageEvent::Stored { .. } => 0,
            PageEvent::Removed { .. } => 1,
            PageEvent::Cleared { .. } => 2,
        };
        let json = event_json(self.ring.next_id(), &event, self.limits.block_size);
        self.ring.push(json);
        if let Some(n) = out.forwarded.get_mut(slot) {
            *n += 1;
        }
    }

    /// Applies one batch's events from engine endpoint `engine` to `rank`.
    pub fn apply(&mut self, engine: usize, rank: DpRank, events: &[EngineEvent]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        match self.rank_owner.get(&rank) {
            Some(&owner) if owner != engine => {
                out.refused.push(Refusal::RankConflict { rank, owner });
                return out;
            }
            Some(_) => {}
            None if self.rank_owner.len() >= MAX_RANKS => {
                out.refused.push(Refusal::TooManyRanks { rank });
                return out;
            }
            None => {
                self.rank_owner.insert(rank, engine);
            }
        }
        for event in events {
            match event {
                EngineEvent::Stored(stored) => self.apply_stored(rank, stored, &mut out),
                EngineEvent::Removed {
                    block_hashes,
                    medium,
                } => match canonical_medium(medium.as_deref()) {
                    Ok(medium) => {
                        let removal = self.mirror.remove(rank, &medium, block_hashes);
                        out.removed_unknown += removal.unknown as u64;
                        out.removed_still_held += removal.still_held as u64;
                        if !removal.gone.is_empty() {
                            let event = PageEvent::Removed {
                                dp_rank: rank,
                                medium,
                                block_hashes: removal.gone,
                            };
                            self.forward(event, &mut out);
                        }
                    }
                    Err(refusal) => out.refused.push(refusal),
                },
                EngineEvent::AllCleared => self.clear_rank_into(rank, &mut out),
            }
        }
        out
    }

    fn apply_stored(&mut self, rank: DpRank, stored: &StoredBlocks, out: &mut ApplyOutcome) {
        let block_size = self.limits.block_size;
        if let Some(got) = stored.block_size {
            if got != u64::from(block_size) {
                out.refused.push(Refusal::BlockSizeMismatch {
                    got,
                    expected: block_size,
                });
                return;
            }
        }
        let medium = match canonical_medium(stored.medium.as_deref()) {
            Ok(m) => m,
            Err(refusal) => {
                out.refused.push(refusal);
                return;
            }
        };
        if stored.block_hashes.is_empty() {
            return;
        }
        let mut parent = stored.parent;
        let mut lora_name = stored.lora_name.clone();
        let filled;
        let token_ids: &[u32] = if stored.token_ids.is_empty() {
            match self.known_tokens(rank, &stored.block_hashes) {
                Some((tokens, known_parent, known_lora)) => {
                    parent = parent.or(known_parent);
                    lora_name = lora_name.or(known_lora);
                    out.filled_tokens += 1;
                    filled = tokens;
                    &filled
                }
                None => {
                    out.refused.push(Refusal::NoTokenIds {
                        blocks: stored.block_hashes.len(),
                    });
                    return;
                }
            }
        } else {
            &stored.token_ids
        };
        let request = StoreRequest {
            medium: &medium,
            parent,
            block_hashes: &stored.block_hashes,
            token_ids,
            block_size: block_size as usize,
            lora_name: lora_name.as_deref(),
        };
        match self.mirror.store(rank, &request) {
            Ok(()) => {
                let event = PageEvent::Stored {
                    dp_rank: rank,
                    medium,
                    parent,
                    block_hashes: stored.block_hashes.clone(),
                    token_ids: token_ids.to_vec(),
                    lora_name,
                };
                self.forward(event, out);
            }
            Err(StoreError::TokenCount) => out.refused.push(Refusal::TokenCount {
                tokens: token_ids.len(),
                blocks: stored.block_hashes.len(),
                block_size,
            }),
            Err(StoreError::Full { max_blocks }) => {
                out.refused.push(Refusal::MirrorFull { max_blocks })
            }
        }
    }

    /// Tokens, first parent and LoRA of blocks the rank holds on some medium, if it holds all.
    fn known_tokens(
        &self,
        rank: DpRank,
        hashes: &[u64],
    ) -> Option<(Vec<u32>, Option<u64>, Option<String>)> {
        let mut tokens = Vec::new();
        let mut first_parent = None;
        let mut lora = None;
        for (i, &hash) in hashes.iter().enumerate() {
            let (t, parent, l) = self.mirror.known_block(rank, hash)?;
            if i == 0 {
                first_parent = parent;
                lora = l.map(str::to_owned);
            }
            tokens.extend_from_slice(t);
        }
        Some((tokens, first_parent, lora))
    }

    fn clear_rank_into(&mut self, rank: DpRank, out: &mut ApplyOutcome) {
        self.mirror.clear_rank(rank);
        self.forward(PageEvent::Cleared { dp_rank: rank }, out);
    }

    /// Clears a rank's mirror and tells the page (engine restart, unrecoverable gap).
    pub fn clear_rank(&mut self, rank: DpRank) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        self.clear_rank_into(rank, &mut out);
        out
    }

    /// `GET /kv/events?after=N` body.
    pub fn page(&self, after: u64, limits: PageLimits, load: Option<Load>) -> String {
        let events = self.ring.page(after, limits);
        page_json(
            self.limits.block_size,
            self.ring.first_id(),
            self.ring.last_id(),
            &events,
            load,
        )
    }

    /// `GET /kv/dump` body.
    pub fn dump(&self) -> String {
        dump_json(
            self.limits.block_size,
            self.ring.last_id(),
            &self.mirror.dump(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: CoreLimits = CoreLimits {
        block_size: 2,
        first_event_id: 1,
        max_blocks: 100,
        max_events: 100,
        max_ring_bytes: 1 << 20,
    };

    fn stored(hashes: &[u64], parent: Option<u64>, medium: Option<&str>) -> EngineEvent {
        EngineEvent::Stored(StoredBlocks {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: hashes.iter().flat_map(|&h| [h as u32, 7]).collect(),
            block_size: Some(2),
            medium: medium.map(str::to_owned),
            ..StoredBlocks::default()
        })
    }

    fn removed(hashes: &[u64]) -> EngineEvent {
        EngineEvent::Removed {
            block_hashes: hashes.to_vec(),
            medium: Some("GPU".into()),
        }
    }

    fn page_events(core: &Core, after: u64) -> Vec<serde_json::Value> {
        let page: serde_json::Value = serde_json::from_str(&core.page(
            after,
            PageLimits {
                max_events: 1000,
                max_bytes: 1 << 20,
            },
            None,
        ))
        .unwrap();
        page["events"].as_array().unwrap().clone()
    }

    #[test]
    fn removal_is_forwarded_when_the_last_copy_goes() {
        let mut core = Core::new(LIMITS);
        let out = core.apply(
            0,
            0,
            &[stored(&[1], None, None), stored(&[1], None, Some("gpu"))],
        );
        assert_eq!(out.forwarded, [2, 0, 0]);
        let out = core.apply(0, 0, &[removed(&[1])]);
        assert_eq!((out.forwarded, out.removed_still_held), ([0, 0, 0], 1));
        let out = core.apply(0, 0, &[removed(&[1]), removed(&[1])]);
        assert_eq!((out.forwarded, out.removed_unknown), ([0, 1, 0], 1));
        let events = page_events(&core, 0);
        let ids: Vec<u64> = events
            .iter()
            .map(|e| e["event_id"].as_u64().unwrap())
            .collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(events[2]["type"], "BlockRemoved");
        assert_eq!(events[2]["block_hashes"], serde_json::json!([1]));
        assert_eq!(events[1]["medium"], "GPU");
    }

    #[test]
    fn refusals_keep_the_page_acceptable() {
        let mut core = Core::new(LIMITS);
        let wrong_size = EngineEvent::Stored(StoredBlocks {
            block_hashes: vec![1],
            token_ids: vec![1, 2, 3, 4],
            block_size: Some(4),
            ..StoredBlocks::default()
        });
        let partial = EngineEvent::Stored(StoredBlocks {
            block_hashes: vec![2],
            token_ids: vec![1],
            ..StoredBlocks::default()
        });
        let odd_medium = stored(&[3], None, Some("TAPE"));
        assert_eq!(canonical_medium(Some("storage")), Ok("DISK".to_owned()));
        assert_eq!(
            canonical_medium(Some("cpu_pinned")),
            Ok("CPU_PINNED".to_owned())
        );
        let out = core.apply(
            0,
            0,
            &[wrong_size, partial, odd_medium, stored(&[4], None, None)],
        );
        let labels: Vec<_> = out.refused.iter().map(Refusal::label).collect();
        assert_eq!(
            labels,
            vec!["block_size_mismatch", "token_count", "unknown_medium"]
        );
        assert_eq!(out.forwarded, [1, 0, 0]);
        assert_eq!(core.mirror().entries(), 1);
    }

    #[test]
    fn lower_tier_store_without_tokens_borrows_them() {
        let mut core = Core::new(LIMITS);
        core.apply(0, 0, &[stored(&[1, 2], None, None)]);
        let offload = EngineEvent::Stored(StoredBlocks {
            block_hashes: vec![2],
            medium: Some("CPU".into()),
            ..StoredBlocks::default()
        });
        let out = core.apply(0, 0, &[offload]);
        assert_eq!((out.forwarded, out.filled_tokens), ([1, 0, 0], 1));
        let events = page_events(&core, 1);
        assert_eq!(events[0]["parent_block_hash"], 1);
        assert_eq!(events[0]["token_ids"], serde_json::json!([2, 7]));
        // Unknown blocks cannot be completed.
        let unknown = EngineEvent::Stored(StoredBlocks {
            block_hashes: vec![9],
            medium: Some("CPU".into()),
            ..StoredBlocks::default()
        });
        assert_eq!(
            core.apply(0, 0, &[unknown]).refused,
            vec![Refusal::NoTokenIds { blocks: 1 }]
        );
    }

    #[test]
    fn cleared_names_its_rank_and_ranks_have_one_owner() {
        let mut core = Core::new(LIMITS);
        core.apply(0, 0, &[stored(&[1], None, None)]);
        core.apply(1, 1, &[stored(&[2], None, None)]);
        let out = core.apply(1, 1, &[EngineEvent::AllCleared]);
        assert_eq!(out.forwarded, [0, 0, 1]);
        assert_eq!(
            (core.mirror().rank_entries(0), core.mirror().rank_entries(1)),
            (1, 0)
        );
        let events = page_events(&core, 2);
        assert_eq!(events[0]["type"], "AllBlocksCleared");
        assert_eq!(events[0]["dp_rank"], 1);
        let out = core.apply(0, 1, &[stored(&[3], None, None)]);
        assert_eq!(
            out.refused,
            vec![Refusal::RankConflict { rank: 1, owner: 1 }]
        );
    }
}
