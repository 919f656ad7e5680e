//! KV events: the normalized [`IndexEvent`]s the index applies, and the two formats they travel in.
//!
//! * `page`: worker event pages (JSON, see docs/DESIGN.md "Worker event endpoint") -> events;
//! * `log_codec`: the compact binary encoding of the shared event log ([`LogRecord`]);
//! * `binary`: the bounds-checked little-endian [`Reader`]/[`Writer`] and [`CodecError`], shared
//!   by the log codec and the index snapshot.

use core::fmt;

use crate::types::{DpRank, ExternalBlockHash, LocalBlockHash, StorageTier};

mod binary;
mod log_codec;
mod page;

pub use binary::CodecError;
pub(crate) use binary::{tier_code, Reader, Writer};
pub use log_codec::{
    check_log_batch, decode_log_batch, encode_log_batch, encode_log_batch_refs, visit_log_batch,
    LogItem, LogRecord, RecordHead,
};
pub use page::{parse_dump, parse_event_page};

/// The page format's id bound (2^63 - 1), shared with the producers.
pub use kv_router_protocol::page::MAX_EVENT_ID;

/// One normalized cache change on one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexEvent {
    /// Blocks stored on `tier`, in prefix order: `blocks[0]` follows `parent` (or starts a
    /// sequence), each later block follows the one before it.
    Stored {
        dp_rank: DpRank,
        tier: StorageTier,
        parent: Option<ExternalBlockHash>,
        blocks: Vec<(ExternalBlockHash, LocalBlockHash)>,
    },
    /// Blocks dropped from `tier` (they may remain on other tiers).
    Removed {
        dp_rank: DpRank,
        tier: StorageTier,
        blocks: Vec<ExternalBlockHash>,
    },
    /// Every block of one rank, or of every rank of the worker (`None`), dropped on every tier.
    Cleared { dp_rank: Option<DpRank> },
}

/// An event with the worker's monotonic event id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumberedEvent {
    pub event_id: u64,
    pub event: IndexEvent,
}

/// Load counters a worker may report with its events: the page's `load` object.
pub use kv_router_protocol::page::Load as ReportedLoad;
pub use kv_router_protocol::page::{Booked, TimingSums};

/// One validated page from a worker's event endpoint (or its dump).
#[derive(Clone, Debug, PartialEq)]
pub struct EventPage {
    pub block_size: u32,
    /// Oldest event id the worker still buffers (absent in dumps).
    pub first_event_id: Option<u64>,
    /// The worker's newest event id: the cursor to ask `after=` next.
    pub last_event_id: u64,
    pub events: Vec<NumberedEvent>,
    pub load: Option<ReportedLoad>,
    /// The worker's description of itself (`worker`), if the page carries a valid one.
    pub worker: Option<crate::worker_description::WorkerDescription>,
    /// Why the page's `worker` object was dropped, if it was not valid.
    pub invalid_worker: Option<String>,
}

/// Why a worker's event page was rejected. Every variant rejects the whole page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventError {
    /// The body is larger than `events.max_response_bytes`.
    TooLarge { body_bytes: usize, max_bytes: usize },
    /// Not valid JSON, or a field of the wrong type.
    Malformed { reason: String },
    /// A required page-level field is absent.
    MissingField { field: &'static str },
    /// The worker's KV block size differs from the filter's `block_size`: every hash would differ,
    /// so the index would silently never match.
    BlockSizeMismatch { expected: u32, got: u64 },
    /// The event at position `index` of the page has no `event_id`.
    MissingEventId { index: usize },
    /// An event id (or cursor) outside 1..=[`MAX_EVENT_ID`] (cursors may be 0).
    InvalidEventId { field: &'static str, value: i128 },
    /// Event ids in a page must strictly increase.
    NonIncreasingEventId { previous: u64, got: u64 },
    /// `last_event_id` is older than an event in the same page.
    LastEventIdBehind {
        last_event_id: u64,
        max_event_id: u64,
    },
    /// `first_event_id` claims the oldest buffered event is newer than one in the page.
    FirstEventIdAhead {
        first_event_id: u64,
        first_in_page: u64,
    },
    /// An event whose type (Dynamo `data` key or vLLM `type`) we do not know.
    UnknownEventType { event_id: u64, kind: String },
    /// A `storage_tier` / `medium` we do not know.
    UnknownTier { event_id: u64, tier: String },
    /// A field the event's type requires is absent.
    MissingEventField { event_id: u64, field: &'static str },
    /// vLLM `BlockStored`: `token_ids` must hold exactly `block_hashes.len() * block_size` tokens.
    TokenCountMismatch {
        event_id: u64,
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    /// A dump may only contain "stored" events.
    NonStoredEventInDump { event_id: u64 },
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge {
                body_bytes,
                max_bytes,
            } => write!(
                f,
                "event response is {body_bytes} bytes, over events.max_response_bytes \
                 ({max_bytes}); raise the limit or make the worker page smaller"
            ),
            Self::Malformed { reason } => write!(f, "event response is not valid: {reason}"),
            Self::MissingField { field } => {
                write!(f, "event response lacks the required field `{field}`")
            }
            Self::BlockSizeMismatch { expected, got } => write!(
                f,
                "worker KV block size is {got} but the filter's block_size is {expected}: no \
                 prefix would ever match; set block_size to the engine's block size"
            ),
            Self::MissingEventId { index } => {
                write!(f, "event #{index} of the page has no event_id")
            }
            Self::InvalidEventId { field, value } => {
                write!(
                    f,
                    "`{field}` is {value}; event ids must be positive 64-bit integers"
                )
            }
            Self::NonIncreasingEventId { previous, got } => write!(
                f,
                "event id {got} follows {previous}: ids in a page must strictly increase"
            ),
            Self::LastEventIdBehind {
                last_event_id,
                max_event_id,
            } => write!(
                f,
                "last_event_id {last_event_id} is older than event {max_event_id} in the same page"
            ),
            Self::FirstEventIdAhead {
                first_event_id,
                first_in_page,
            } => write!(
                f,
                "first_event_id {first_event_id} is newer than event {first_in_page} in the page"
            ),
            Self::UnknownEventType { event_id, kind } => {
                write!(f, "event {event_id} has unknown type `{kind}`")
            }
            Self::UnknownTier { event_id, tier } => write!(
                f,
                "event {event_id} has unknown storage tier `{tier}` (known: device/GPU, \
                 host/CPU, disk/NVME/external)"
            ),
            Self::MissingEventField { event_id, field } => {
                write!(f, "event {event_id} lacks the required field `{field}`")
            }
            Self::TokenCountMismatch {
                event_id,
                tokens,
                blocks,
                block_size,
            } => write!(
                f,
                "event {event_id} stores {blocks} blocks of {block_size} tokens but carries \
                 {tokens} token ids"
            ),
            Self::NonStoredEventInDump { event_id } => {
                write!(
                    f,
                    "dump contains event {event_id} that is not a \"stored\" event"
                )
            }
        }
    }
}

impl std::error::Error for EventError {}

#[cfg(test)]
// Tests fail by panicking; indexing known-length fixtures keeps them readable.
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::hashing::{hash_seed, local_block_hashes, DYNAMO_HASH_SEED};

    const MAX: usize = 1 << 20;

    fn page(events: &str) -> String {
        format!(
            r#"{{"block_size": 4, "first_event_id": 1, "last_event_id": 100, "events": [{events}]}}"#
        )
    }

    fn parse_one(event: &str) -> Result<NumberedEvent, EventError> {
        let page = parse_event_page(page(event).as_bytes(), 4, MAX)?;
        assert_eq!(page.events.len(), 1);
        page.events
            .into_iter()
            .next()
            .ok_or(EventError::MissingEventId { index: 0 })
    }

    fn err_of(body: &str) -> EventError {
        match parse_event_page(body.as_bytes(), 4, MAX) {
            Ok(page) => panic!("expected an error, parsed {page:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn page_fields_and_load() {
        let body = r#"{"block_size": 4, "first_event_id": 41, "last_event_id": 57, "events": [],
                       "load": {"num_waiting": 2, "kv_usage": 0.5}, "extra": true}"#;
        let page = parse_event_page(body.as_bytes(), 4, MAX).unwrap();
        assert_eq!(page.block_size, 4);
        assert_eq!(page.first_event_id, Some(41));
        assert_eq!(page.last_event_id, 57);
        assert!(page.events.is_empty());
        assert_eq!(
            page.load,
            Some(ReportedLoad {
                num_waiting: 2,
                num_running: 0,
                kv_usage: 0.5,
                other_routers: None,
            })
        );
        let bare = parse_event_page(br#"{"block_size": 4, "last_event_id": 0}"#, 4, MAX).unwrap();
        assert_eq!(bare.first_event_id, None);
        assert_eq!(bare.load, None);
    }

    #[test]
    fn dynamo_flat_stored_removed_cleared() {
        let e = parse_one(
            r#"{"event_id": 42, "dp_rank": 1, "storage_tier": "host_pinned",
                "data": {"stored": {"parent_hash": 5, "blocks": [{"block_hash": 7, "tokens_hash": 99}]}}}"#,
        )
        .unwrap();
        assert_eq!(
            e,
            NumberedEvent {
                event_id: 42,
                event: IndexEvent::Stored {
                    dp_rank: 1,
                    tier: StorageTier::Host,
                    parent: Some(ExternalBlockHash(5)),
                    blocks: vec![(ExternalBlockHash(7), LocalBlockHash(99))],
                }
            }
        );
        let e = parse_one(r#"{"event_id": 43, "data": {"removed": {"block_hashes": [7, 8]}}}"#)
            .unwrap();
        assert_eq!(
            e.event,
            IndexEvent::Removed {
                dp_rank: 0,
                tier: StorageTier::Device,
                blocks: vec![ExternalBlockHash(7), ExternalBlockHash(8)],
            }
        );
        let e = parse_one(r#"{"event_id": 44, "data": "cleared"}"#).unwrap();
        assert_eq!(e.event, IndexEvent::Cleared { dp_rank: None });
        let e = parse_one(r#"{"event_id": 44, "dp_rank": 3, "data": "cleared"}"#).unwrap();
        assert_eq!(e.event, IndexEvent::Cleared { dp_rank: Some(3) });
    }

    #[test]
    fn dynamo_wrapped_takes_outer_tier_and_inner_fields() {
        let e = parse_one(
            r#"{"worker_id": 1, "storage_tier": "disk", "event": {"event_id": 45, "dp_rank": 2,
                "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}}}"#,
        )
        .unwrap();
        assert_eq!(e.event_id, 45);
        assert_eq!(
            e.event,
            IndexEvent::Stored {
                dp_rank: 2,
                tier: StorageTier::Disk,
                parent: None,
                blocks: vec![(ExternalBlockHash(1), LocalBlockHash(2))],
            }
        );
    }

    #[test]
    fn hashes_accept_negative_and_string_forms() {
        let e = parse_one(
            r#"{"event_id": 1, "data": {"removed": {"block_hashes": [-1, "18446744073709551615", "-2", 3]}}}"#,
        )
        .unwrap();
        assert_eq!(
            e.event,
            IndexEvent::Removed {
                dp_rank: 0,
                tier: StorageTier::Device,
                blocks: vec![
                    ExternalBlockHash(u64::MAX),
                    ExternalBlockHash(u64::MAX),
                    ExternalBlockHash(u64::MAX - 1),
                    ExternalBlockHash(3)
                ],
            }
        );
        assert!(matches!(
            err_of(&page(
                r#"{"event_id": 1, "data": {"removed": {"block_hashes": ["x1"]}}}"#
            )),
            EventError::Malformed { .. }
        ));
        assert!(matches!(
            err_of(&page(
                r#"{"event_id": 1, "data": {"removed": {"block_hashes": [1.5]}}}"#
            )),
            EventError::Malformed { .. }
        ));
    }

    #[test]
    fn vllm_stored_hashes_tokens_with_lora_salt() {
        let tokens = "[1,2,3,4,5,6,7,8]";
        let e = parse_one(&format!(
            r#"{{"event_id": 46, "dp_rank": 0, "type": "BlockStored", "block_hashes": [10, -20],
                "parent_block_hash": 9, "token_ids": {tokens}, "block_size": 4, "lora_name": null,
                "medium": "GPU", "lora_id": null}}"#
        ))
        .unwrap();
        let locals = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, DYNAMO_HASH_SEED);
        assert_eq!(
            e.event,
            IndexEvent::Stored {
                dp_rank: 0,
                tier: StorageTier::Device,
                parent: Some(ExternalBlockHash(9)),
                blocks: vec![
                    (ExternalBlockHash(10), locals[0]),
                    (ExternalBlockHash((-20i64) as u64), locals[1]),
                ],
            }
        );
        let salted = parse_one(&format!(
            r#"{{"event_id": 47, "type": "BlockStored", "block_hashes": [10, 20],
                "token_ids": {tokens}, "lora_name": "ad", "medium": "CPU"}}"#
        ))
        .unwrap();
        let IndexEvent::Stored { blocks, tier, .. } = salted.event else {
            panic!("not stored")
        };
        assert_eq!(tier, StorageTier::Host);
        let salted_locals = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, hash_seed(Some("ad")));
        assert_eq!(blocks[0].1, salted_locals[0]);
        assert_ne!(blocks[0].1, locals[0]);
    }

    #[test]
    fn vllm_removed_and_cleared() {
        let e = parse_one(
            r#"{"event_id": 47, "type": "BlockRemoved", "block_hashes": [5], "medium": "NVME"}"#,
        )
        .unwrap();
        assert_eq!(
            e.event,
            IndexEvent::Removed {
                dp_rank: 0,
                tier: StorageTier::Disk,
                blocks: vec![ExternalBlockHash(5)]
            }
        );
        let e = parse_one(r#"{"event_id": 48, "type": "AllBlocksCleared"}"#).unwrap();
        assert_eq!(e.event, IndexEvent::Cleared { dp_rank: None });
    }

    #[test]
    fn size_json_and_block_size_errors() {
        let body = page("");
        assert_eq!(
            parse_event_page(body.as_bytes(), 4, 10),
            Err(EventError::TooLarge {
                body_bytes: body.len(),
                max_bytes: 10
            })
        );
        assert!(matches!(err_of("{not json"), EventError::Malformed { .. }));
        assert!(matches!(
            err_of(r#"{"block_size": "4", "last_event_id": 1}"#),
            EventError::Malformed { .. }
        ));
        assert_eq!(
            err_of(r#"{"last_event_id": 1}"#),
            EventError::MissingField {
                field: "block_size"
            }
        );
        assert_eq!(
            err_of(r#"{"block_size": 4}"#),
            EventError::MissingField {
                field: "last_event_id"
            }
        );
        assert_eq!(
            err_of(r#"{"block_size": 16, "last_event_id": 1, "events": []}"#),
            EventError::BlockSizeMismatch {
                expected: 4,
                got: 16
            }
        );
        let vllm_bs = page(
            r#"{"event_id": 1, "type": "BlockStored", "block_hashes": [1], "token_ids": [1,2,3,4,5,6,7,8], "block_size": 8}"#,
        );
        assert_eq!(
            err_of(&vllm_bs),
            EventError::BlockSizeMismatch {
                expected: 4,
                got: 8
            }
        );
        let e = EventError::BlockSizeMismatch {
            expected: 4,
            got: 16,
        }
        .to_string();
        assert!(e.contains("16") && e.contains("block_size"), "{e}");
    }

    /// A worker-supplied `u64::MAX` cursor would leave no next id (`after + 1` overflows): ids
    /// above 2^63 - 1 are a protocol error, in pages and dumps alike.
    #[test]
    fn absurd_event_ids_and_cursors_are_rejected() {
        let max = u64::MAX;
        assert_eq!(
            err_of(&format!(r#"{{"block_size": 4, "last_event_id": {max}}}"#)),
            EventError::InvalidEventId {
                field: "last_event_id",
                value: i128::from(max)
            }
        );
        let just_over = MAX_EVENT_ID + 1;
        assert_eq!(
            err_of(&format!(
                r#"{{"block_size": 4, "first_event_id": {just_over}, "last_event_id": 1}}"#
            )),
            EventError::InvalidEventId {
                field: "first_event_id",
                value: i128::from(just_over)
            }
        );
        assert_eq!(
            err_of(&page(&format!(
                r#"{{"event_id": {just_over}, "data": "cleared"}}"#
            ))),
            EventError::InvalidEventId {
                field: "event_id",
                value: i128::from(just_over)
            }
        );
        let dump = format!(r#"{{"block_size": 4, "last_event_id": "{max}", "events": []}}"#);
        assert!(matches!(
            parse_dump(dump.as_bytes(), 4, MAX),
            Err(EventError::InvalidEventId {
                field: "last_event_id",
                ..
            })
        ));
        // The largest accepted id still parses.
        let ok = format!(
            r#"{{"block_size": 4, "last_event_id": {MAX_EVENT_ID}, "events": [{{"event_id": {MAX_EVENT_ID}, "data": "cleared"}}]}}"#
        );
        let page = parse_event_page(ok.as_bytes(), 4, MAX).unwrap();
        assert_eq!(page.last_event_id, MAX_EVENT_ID);
    }

    #[test]
    fn event_id_errors() {
        assert_eq!(
            err_of(&page(r#"{"data": "cleared"}"#)),
            EventError::MissingEventId { index: 0 }
        );
        assert_eq!(
            err_of(&page(r#"{"event_id": 0, "data": "cleared"}"#)),
            EventError::InvalidEventId {
                field: "event_id",
                value: 0
            }
        );
        assert_eq!(
            err_of(&page(r#"{"event_id": -3, "data": "cleared"}"#)),
            EventError::InvalidEventId {
                field: "event_id",
                value: -3
            }
        );
        assert_eq!(
            err_of(&page(
                r#"{"event_id": 5, "data": "cleared"}, {"event_id": 5, "data": "cleared"}"#
            )),
            EventError::NonIncreasingEventId {
                previous: 5,
                got: 5
            }
        );
        assert_eq!(
            err_of(&page(
                r#"{"event_id": 6, "data": "cleared"}, {"event_id": 2, "data": "cleared"}"#
            )),
            EventError::NonIncreasingEventId {
                previous: 6,
                got: 2
            }
        );
        assert_eq!(
            err_of(
                r#"{"block_size": 4, "last_event_id": 3, "events": [{"event_id": 4, "data": "cleared"}]}"#
            ),
            EventError::LastEventIdBehind {
                last_event_id: 3,
                max_event_id: 4
            }
        );
        assert_eq!(
            err_of(r#"{"block_size": 4, "last_event_id": -1}"#),
            EventError::InvalidEventId {
                field: "last_event_id",
                value: -1
            }
        );
        assert_eq!(
            err_of(
                r#"{"block_size": 4, "first_event_id": 9, "last_event_id": 9, "events": [{"event_id": 8, "data": "cleared"}]}"#
            ),
            EventError::FirstEventIdAhead {
                first_event_id: 9,
                first_in_page: 8
            }
        );
    }

    #[test]
    fn type_tier_and_token_errors() {
        assert_eq!(
            err_of(&page(r#"{"event_id": 1, "data": "exploded"}"#)),
            EventError::UnknownEventType {
                event_id: 1,
                kind: "exploded".into()
            }
        );
        assert_eq!(
            err_of(&page(r#"{"event_id": 1, "data": {"moved": {}}}"#)),
            EventError::UnknownEventType {
                event_id: 1,
                kind: "moved".into()
            }
        );
        assert_eq!(
            err_of(&page(r#"{"event_id": 1, "type": "BlockMoved"}"#)),
            EventError::UnknownEventType {
                event_id: 1,
                kind: "BlockMoved".into()
            }
        );
        assert!(matches!(
            err_of(&page(r#"{"event_id": 1}"#)),
            EventError::UnknownEventType { event_id: 1, .. }
        ));
        assert_eq!(
            err_of(&page(
                r#"{"event_id": 1, "storage_tier": "tape", "data": {"removed": {"block_hashes": []}}}"#
            )),
            EventError::UnknownTier {
                event_id: 1,
                tier: "tape".into()
            }
        );
        assert_eq!(
            err_of(&page(
                r#"{"event_id": 1, "type": "BlockRemoved", "block_hashes": [], "medium": "FLOPPY"}"#
            )),
            EventError::UnknownTier {
                event_id: 1,
                tier: "FLOPPY".into()
            }
        );
        assert_eq!(
            err_of(&page(
                r#"{"event_id": 2, "type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1,2,3,4,5]}"#
            )),
            EventError::TokenCountMismatch {
                event_id: 2,
                tokens: 5,
                blocks: 2,
                block_size: 4
            }
        );
        assert_eq!(
            err_of(&page(
                r#"{"event_id": 2, "type": "BlockStored", "block_hashes": [1]}"#
            )),
            EventError::MissingEventField {
                event_id: 2,
                field: "token_ids"
            }
        );
        assert_eq!(
            err_of(&page(r#"{"event_id": 2, "type": "BlockRemoved"}"#)),
            EventError::MissingEventField {
                event_id: 2,
                field: "block_hashes"
            }
        );
        // One bad event rejects the whole page.
        assert!(matches!(
            err_of(&page(
                r#"{"event_id": 1, "data": "cleared"}, {"event_id": 2, "data": "bad"}"#
            )),
            EventError::UnknownEventType { event_id: 2, .. }
        ));
    }

    #[test]
    fn dump_allows_only_stored_and_missing_ids() {
        let body = r#"{"block_size": 4, "last_event_id": 57, "events": [
            {"data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}},
            {"event_id": 3, "type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1, "token_ids": [1,2,3,4]}]}"#;
        let dump = parse_dump(body.as_bytes(), 4, MAX).unwrap();
        assert_eq!(dump.last_event_id, 57);
        assert_eq!(dump.events.len(), 2);
        assert_eq!(dump.events[0].event_id, 0);
        let bad = r#"{"block_size": 4, "last_event_id": 5, "events": [{"event_id": 5, "data": "cleared"}]}"#;
        assert_eq!(
            parse_dump(bad.as_bytes(), 4, MAX),
            Err(EventError::NonStoredEventInDump { event_id: 5 })
        );
        assert_eq!(
            parse_dump(br#"{"block_size": 8, "last_event_id": 5}"#, 4, MAX),
            Err(EventError::BlockSizeMismatch {
                expected: 4,
                got: 8
            })
        );
    }

    fn sample_records() -> Vec<LogRecord> {
        vec![
            LogRecord::Events {
                worker: 3,
                events: vec![
                    NumberedEvent {
                        event_id: 1,
                        event: IndexEvent::Stored {
                            dp_rank: 2,
                            tier: StorageTier::Host,
                            parent: Some(ExternalBlockHash(u64::MAX)),
                            blocks: vec![
                                (ExternalBlockHash(1), LocalBlockHash(2)),
                                (ExternalBlockHash(3), LocalBlockHash(u64::MAX - 7)),
                            ],
                        },
                    },
                    NumberedEvent {
                        event_id: 2,
                        event: IndexEvent::Stored {
                            dp_rank: 0,
                            tier: StorageTier::Device,
                            parent: None,
                            blocks: vec![],
                        },
                    },
                    NumberedEvent {
                        event_id: 3,
                        event: IndexEvent::Removed {
                            dp_rank: 7,
                            tier: StorageTier::Disk,
                            blocks: vec![ExternalBlockHash(1), ExternalBlockHash(9)],
                        },
                    },
                    NumberedEvent {
                        event_id: 4,
                        event: IndexEvent::Cleared { dp_rank: Some(1) },
                    },
                    NumberedEvent {
                        event_id: u64::MAX,
                        event: IndexEvent::Cleared { dp_rank: None },
                    },
                ],
            },
            LogRecord::Resync {
                worker: u16::MAX,
                last_event_id: 57,
                events: vec![NumberedEvent {
                    event_id: 0,
                    event: IndexEvent::Stored {
                        dp_rank: 0,
                        tier: StorageTier::Device,
                        parent: None,
                        blocks: vec![(ExternalBlockHash(5), LocalBlockHash(6))],
                    },
                }],
            },
            LogRecord::WorkerLost { worker: 0 },
            LogRecord::Events {
                worker: 1,
                events: vec![],
            },
        ]
    }

    #[test]
    fn log_batch_round_trip() {
        let records = sample_records();
        let bytes = encode_log_batch(&records);
        assert_eq!(bytes.get(..4), Some(&b"EKL\x01"[..]));
        assert_eq!(decode_log_batch(&bytes), Ok(records));
        assert_eq!(decode_log_batch(&encode_log_batch(&[])), Ok(vec![]));
    }

    #[test]
    fn log_batch_rejects_every_truncation_and_trailing_bytes() {
        let bytes = encode_log_batch(&sample_records());
        for len in 0..bytes.len() {
            let cut = bytes.get(..len).unwrap_or_default();
            assert!(decode_log_batch(cut).is_err(), "truncated to {len} decoded");
            assert!(check_log_batch(cut).is_err(), "truncated to {len} checked");
        }
        assert_eq!(check_log_batch(&bytes), Ok(()));
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(
            decode_log_batch(&longer),
            Err(CodecError::TrailingBytes { count: 1 })
        );
    }

    #[test]
    fn log_batch_rejects_bad_header_tags_and_counts() {
        let mut bytes = encode_log_batch(&sample_records());
        assert_eq!(
            decode_log_batch(b"XYZ\x01\0\0\0\0"),
            Err(CodecError::BadMagic)
        );
        assert_eq!(
            decode_log_batch(b"EKL\x09\0\0\0\0"),
            Err(CodecError::UnsupportedVersion {
                got: 9,
                supported: 1
            })
        );
        assert!(matches!(
            decode_log_batch(b"EKL\x01\xff\xff\xff\xff"),
            Err(CodecError::CountTooLarge {
                field: "records",
                ..
            })
        ));
        bytes[8] = 9; // first record tag
        assert_eq!(
            decode_log_batch(&bytes),
            Err(CodecError::InvalidTag {
                field: "record",
                value: 9,
                offset: 8
            })
        );
    }

    #[test]
    fn log_batch_survives_garbage() {
        // Deterministic pseudo-random corruption: decoding must return (not panic), and any
        // success must re-encode to the same bytes (no silent reinterpretation).
        let clean = encode_log_batch(&sample_records());
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..5000 {
            let mut bytes = clean.clone();
            for _ in 0..3 {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                let pos = (state >> 33) as usize % bytes.len();
                bytes[pos] = (state >> 17) as u8;
            }
            // The check (blocks read, not kept) accepts exactly what decodes, with its error.
            let decoded = decode_log_batch(&bytes);
            assert_eq!(
                check_log_batch(&bytes),
                decoded.as_ref().map(|_| ()).map_err(Clone::clone)
            );
            if let Ok(records) = decoded {
                assert_eq!(encode_log_batch(&records), bytes);
            }
        }
        let mut state = 7u64;
        for len in 0..200usize {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1);
                    (state >> 40) as u8
                })
                .collect();
            let _ = decode_log_batch(&bytes);
        }
    }
}
