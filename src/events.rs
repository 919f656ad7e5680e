//! Worker KV event pages (JSON, see docs/DESIGN.md "Worker event endpoint") -> normalized
//! [`IndexEvent`]s, and the compact binary codec of the shared event log.
//!
//! Validation is all-or-nothing per page: a page that fails any check is rejected whole, so the
//! poller never applies half a page and its cursor stays consistent. Gap detection (comparing
//! `first_event_id` with the cursor) is the poller's job, not this module's.
//!
//! Normalization rules:
//! * Dynamo stored blocks carry their local hash (`tokens_hash`); vLLM `BlockStored` carries the
//!   token ids, which we hash ourselves with the event's LoRA salt.
//! * `dp_rank` absent means rank 0, except for "cleared" events, where absent means every rank of
//!   the worker (a whole-worker reset must not leave other ranks' blocks behind).
//! * Hashes are u64; negative i64 values are reinterpreted bit for bit (engines that emit signed
//!   hashes); decimal strings are accepted (JSON producers that cannot emit 64-bit integers).
//! * Unknown fields are ignored (engines add fields); unknown event types and tiers are errors.

use core::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::hashing::{hash_seed, local_block_hashes};
use crate::types::{DpRank, ExternalBlockHash, LocalBlockHash, StorageTier};

/// Largest event id (and cursor) accepted: 2^63 - 1. Ids are counters from 0 or 1; anything
/// near `u64::MAX` is a broken or hostile worker, and accepting it would leave no room for the
/// next id (`cursor + 1`) to exist.
pub const MAX_EVENT_ID: u64 = i64::MAX as u64;

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

/// Load counters a worker may report with its events.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReportedLoad {
    pub num_waiting: u32,
    pub num_running: u32,
    /// Fraction of the worker's KV cache in use, 0.0..=1.0 as reported (not clamped).
    pub kv_usage: f64,
}

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

// ---------------------------------------------------------------------------------------------
// Wire types
// ---------------------------------------------------------------------------------------------

/// A 64-bit hash as found on the wire: u64, negative i64 (reinterpreted), or a decimal string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WireHash(u64);

struct WireHashVisitor;

impl Visitor<'_> for WireHashVisitor {
    type Value = WireHash;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a 64-bit hash (integer or decimal string)")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
        Ok(WireHash(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
        Ok(WireHash(u64::from_ne_bytes(v.to_ne_bytes())))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<WireHash, E> {
        if let Ok(u) = v.parse::<u64>() {
            return Ok(WireHash(u));
        }
        match v.parse::<i64>() {
            Ok(i) => self.visit_i64(i),
            Err(_) => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(WireHashVisitor)
    }
}

/// An event id or cursor as found on the wire, kept signed so "-1" is reported as a bad id rather
/// than as a JSON type error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WireId(i128);

struct WireIdVisitor;

impl Visitor<'_> for WireIdVisitor {
    type Value = WireId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an integer event id")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireId, E> {
        Ok(WireId(i128::from(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireId, E> {
        Ok(WireId(i128::from(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<WireId, E> {
        v.parse::<i128>()
            .map(WireId)
            .map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
    }
}

impl<'de> Deserialize<'de> for WireId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(WireIdVisitor)
    }
}

#[derive(Deserialize)]
struct RawPage {
    block_size: Option<u64>,
    first_event_id: Option<WireId>,
    last_event_id: Option<WireId>,
    #[serde(default)]
    events: Vec<RawEvent>,
    load: Option<RawLoad>,
}

#[derive(Deserialize)]
struct RawLoad {
    num_waiting: Option<u32>,
    num_running: Option<u32>,
    kv_usage: Option<f64>,
}

/// Union of every event shape's fields; which ones are set tells the shape apart.
#[derive(Deserialize)]
struct RawEvent {
    event_id: Option<WireId>,
    dp_rank: Option<DpRank>,
    storage_tier: Option<String>,
    /// Dynamo's wrapped shape: `{"worker_id", "storage_tier", "event": {...}}`.
    event: Option<Box<RawEvent>>,
    /// Dynamo: `"cleared"`, `{"stored": {...}}` or `{"removed": {...}}`.
    data: Option<serde_json::Value>,
    /// vLLM: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
    #[serde(rename = "type")]
    kind: Option<String>,
    block_hashes: Option<Vec<WireHash>>,
    parent_block_hash: Option<WireHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    lora_name: Option<String>,
    medium: Option<String>,
}

#[derive(Deserialize)]
struct RawDynamoStored {
    parent_hash: Option<WireHash>,
    blocks: Vec<RawDynamoBlock>,
}

#[derive(Deserialize)]
struct RawDynamoBlock {
    block_hash: WireHash,
    tokens_hash: WireHash,
}

#[derive(Deserialize)]
struct RawDynamoRemoved {
    block_hashes: Vec<WireHash>,
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

fn malformed(err: &serde_json::Error) -> EventError {
    EventError::Malformed {
        reason: err.to_string(),
    }
}

/// A positive event id (ids start at 1; 0 is the "nothing seen yet" cursor).
fn positive_id(id: WireId, field: &'static str) -> Result<u64, EventError> {
    match u64::try_from(id.0) {
        Ok(v) if v > 0 && v <= MAX_EVENT_ID => Ok(v),
        _ => Err(EventError::InvalidEventId { field, value: id.0 }),
    }
}

/// A cursor: 0 allowed.
fn cursor_id(id: WireId, field: &'static str) -> Result<u64, EventError> {
    match u64::try_from(id.0) {
        Ok(v) if v <= MAX_EVENT_ID => Ok(v),
        _ => Err(EventError::InvalidEventId { field, value: id.0 }),
    }
}

fn parse_tier(event_id: u64, name: Option<&str>) -> Result<StorageTier, EventError> {
    StorageTier::parse(name).ok_or_else(|| EventError::UnknownTier {
        event_id,
        tier: name.unwrap_or_default().to_owned(),
    })
}

fn ext_hashes(hashes: Vec<WireHash>) -> Vec<ExternalBlockHash> {
    hashes.into_iter().map(|h| ExternalBlockHash(h.0)).collect()
}

/// Normalizes one Dynamo `data` value.
fn dynamo_event(
    event_id: u64,
    dp_rank: Option<DpRank>,
    tier_name: Option<&str>,
    data: serde_json::Value,
) -> Result<IndexEvent, EventError> {
    let (kind, body) = match data {
        serde_json::Value::String(kind) => (kind, serde_json::Value::Null),
        serde_json::Value::Object(map) if map.len() == 1 => match map.into_iter().next() {
            Some((kind, body)) => (kind, body),
            None => (String::new(), serde_json::Value::Null),
        },
        other => {
            return Err(EventError::UnknownEventType {
                event_id,
                kind: other.to_string(),
            })
        }
    };
    match kind.as_str() {
        "stored" => {
            let raw: RawDynamoStored = serde_json::from_value(body).map_err(|e| malformed(&e))?;
            Ok(IndexEvent::Stored {
                dp_rank: dp_rank.unwrap_or(0),
                tier: parse_tier(event_id, tier_name)?,
                parent: raw.parent_hash.map(|h| ExternalBlockHash(h.0)),
                blocks: raw
                    .blocks
                    .into_iter()
                    .map(|b| {
                        (
                            ExternalBlockHash(b.block_hash.0),
                            LocalBlockHash(b.tokens_hash.0),
                        )
                    })
                    .collect(),
            })
        }
        "removed" => {
            let raw: RawDynamoRemoved = serde_json::from_value(body).map_err(|e| malformed(&e))?;
            Ok(IndexEvent::Removed {
                dp_rank: dp_rank.unwrap_or(0),
                tier: parse_tier(event_id, tier_name)?,
                blocks: ext_hashes(raw.block_hashes),
            })
        }
        "cleared" => Ok(IndexEvent::Cleared { dp_rank }),
        _ => Err(EventError::UnknownEventType { event_id, kind }),
    }
}

/// Normalizes one vLLM-shaped event.
fn vllm_event(
    event_id: u64,
    kind: &str,
    raw: RawEvent,
    expected_block_size: u32,
) -> Result<IndexEvent, EventError> {
    let dp_rank = raw.dp_rank;
    match kind {
        "BlockStored" => {
            if let Some(got) = raw.block_size {
                if got != u64::from(expected_block_size) {
                    return Err(EventError::BlockSizeMismatch {
                        expected: expected_block_size,
                        got,
                    });
                }
            }
            let tier = parse_tier(event_id, raw.medium.as_deref())?;
            let hashes = raw.block_hashes.ok_or(EventError::MissingEventField {
                event_id,
                field: "block_hashes",
            })?;
            let tokens = raw.token_ids.ok_or(EventError::MissingEventField {
                event_id,
                field: "token_ids",
            })?;
            let expected_tokens = usize::try_from(expected_block_size)
                .ok()
                .and_then(|size| size.checked_mul(hashes.len()));
            if expected_block_size == 0 || expected_tokens != Some(tokens.len()) {
                return Err(EventError::TokenCountMismatch {
                    event_id,
                    tokens: tokens.len(),
                    blocks: hashes.len(),
                    block_size: expected_block_size,
                });
            }
            let locals = local_block_hashes(
                &tokens,
                expected_block_size,
                hash_seed(raw.lora_name.as_deref()),
            );
            Ok(IndexEvent::Stored {
                dp_rank: dp_rank.unwrap_or(0),
                tier,
                parent: raw.parent_block_hash.map(|h| ExternalBlockHash(h.0)),
                blocks: hashes
                    .into_iter()
                    .map(|h| ExternalBlockHash(h.0))
                    .zip(locals)
                    .collect(),
            })
        }
        "BlockRemoved" => Ok(IndexEvent::Removed {
            dp_rank: dp_rank.unwrap_or(0),
            tier: parse_tier(event_id, raw.medium.as_deref())?,
            blocks: ext_hashes(raw.block_hashes.ok_or(EventError::MissingEventField {
                event_id,
                field: "block_hashes",
            })?),
        }),
        "AllBlocksCleared" => Ok(IndexEvent::Cleared { dp_rank }),
        _ => Err(EventError::UnknownEventType {
            event_id,
            kind: kind.to_owned(),
        }),
    }
}

/// Normalizes one event of any shape. Without `id_required` (dumps) a missing id becomes 0.
fn normalize_event(
    index: usize,
    mut raw: RawEvent,
    expected_block_size: u32,
    id_required: bool,
) -> Result<NumberedEvent, EventError> {
    // Unwrap Dynamo's `{"worker_id", "storage_tier", "event": {...}}`, the inner fields winning.
    if let Some(inner) = raw.event.take() {
        let mut inner = *inner;
        inner.event_id = inner.event_id.or(raw.event_id);
        inner.dp_rank = inner.dp_rank.or(raw.dp_rank);
        inner.storage_tier = inner.storage_tier.or(raw.storage_tier.take());
        raw = inner;
    }
    let event_id = match raw.event_id {
        Some(id) => positive_id(id, "event_id")?,
        None if id_required => return Err(EventError::MissingEventId { index }),
        None => 0,
    };
    let event = if let Some(kind) = raw.kind.take() {
        vllm_event(event_id, &kind, raw, expected_block_size)?
    } else if let Some(data) = raw.data.take() {
        dynamo_event(event_id, raw.dp_rank, raw.storage_tier.as_deref(), data)?
    } else {
        return Err(EventError::UnknownEventType {
            event_id,
            kind: "<no `type` or `data`>".to_owned(),
        });
    };
    Ok(NumberedEvent { event_id, event })
}

/// Parses and validates the body shared by pages and dumps.
fn parse_body(
    body: &[u8],
    expected_block_size: u32,
    max_bytes: usize,
    is_dump: bool,
) -> Result<EventPage, EventError> {
    if body.len() > max_bytes {
        return Err(EventError::TooLarge {
            body_bytes: body.len(),
            max_bytes,
        });
    }
    let raw: RawPage = serde_json::from_slice(body).map_err(|e| malformed(&e))?;
    let got = raw.block_size.ok_or(EventError::MissingField {
        field: "block_size",
    })?;
    if got != u64::from(expected_block_size) {
        return Err(EventError::BlockSizeMismatch {
            expected: expected_block_size,
            got,
        });
    }
    let last_event_id = cursor_id(
        raw.last_event_id.ok_or(EventError::MissingField {
            field: "last_event_id",
        })?,
        "last_event_id",
    )?;
    let first_event_id = raw
        .first_event_id
        .map(|id| cursor_id(id, "first_event_id"))
        .transpose()?;

    let mut events = Vec::with_capacity(raw.events.len());
    let mut previous: Option<u64> = None;
    for (index, raw_event) in raw.events.into_iter().enumerate() {
        let numbered = normalize_event(index, raw_event, expected_block_size, !is_dump)?;
        if is_dump {
            if !matches!(numbered.event, IndexEvent::Stored { .. }) {
                return Err(EventError::NonStoredEventInDump {
                    event_id: numbered.event_id,
                });
            }
        } else {
            if let Some(previous) = previous {
                if numbered.event_id <= previous {
                    return Err(EventError::NonIncreasingEventId {
                        previous,
                        got: numbered.event_id,
                    });
                }
            }
            previous = Some(numbered.event_id);
        }
        events.push(numbered);
    }
    if !is_dump {
        if let Some(max_event_id) = previous {
            if last_event_id < max_event_id {
                return Err(EventError::LastEventIdBehind {
                    last_event_id,
                    max_event_id,
                });
            }
        }
        if let (Some(first_event_id), Some(first)) = (first_event_id, events.first()) {
            if first_event_id > first.event_id {
                return Err(EventError::FirstEventIdAhead {
                    first_event_id,
                    first_in_page: first.event_id,
                });
            }
        }
    }
    let load = raw.load.map(|l| ReportedLoad {
        num_waiting: l.num_waiting.unwrap_or(0),
        num_running: l.num_running.unwrap_or(0),
        kv_usage: l.kv_usage.unwrap_or(0.0),
    });
    Ok(EventPage {
        block_size: expected_block_size,
        first_event_id,
        last_event_id,
        events,
        load,
    })
}

/// Parses a `GET /kv/events?after=N` response body.
pub fn parse_event_page(
    body: &[u8],
    expected_block_size: u32,
    max_bytes: usize,
) -> Result<EventPage, EventError> {
    parse_body(body, expected_block_size, max_bytes, false)
}

/// Parses a `GET /kv/dump` response body: only "stored" events, ids optional and unchecked (a dump
/// is a state snapshot; its position is `last_event_id`). Events without an id get id 0.
pub fn parse_dump(
    body: &[u8],
    expected_block_size: u32,
    max_bytes: usize,
) -> Result<EventPage, EventError> {
    parse_body(body, expected_block_size, max_bytes, true)
}

// ---------------------------------------------------------------------------------------------
// Shared-log codec
// ---------------------------------------------------------------------------------------------

/// One entry of the replicated event log. `worker` is the worker's index in the compiled
/// configuration; the applier maps (worker, dp_rank) to slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogRecord {
    /// Events in id order.
    Events {
        worker: u16,
        events: Vec<NumberedEvent>,
    },
    /// Clear every slot of the worker, then apply `events` (a dump); continue from
    /// `last_event_id`.
    Resync {
        worker: u16,
        last_event_id: u64,
        events: Vec<NumberedEvent>,
    },
    /// Clear every slot of the worker (stale or removed).
    WorkerLost { worker: u16 },
}

/// Why a binary log batch or index snapshot could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CodecError {
    /// The input ends before a value that starts at `offset`.
    Truncated { offset: usize, needed_bytes: usize },
    /// The input does not start with the expected magic bytes (wrong key, or garbage).
    BadMagic,
    /// Written by a different codec version (mixed filter versions during a rollout).
    UnsupportedVersion { got: u8, supported: u8 },
    /// An enum tag byte with no meaning.
    InvalidTag {
        field: &'static str,
        value: u8,
        offset: usize,
    },
    /// A length prefix larger than the remaining input could hold.
    CountTooLarge {
        field: &'static str,
        count: u32,
        offset: usize,
    },
    /// Bytes left over after the last value.
    TrailingBytes { count: usize },
    /// A snapshot for a different number of slots than the current configuration.
    SlotCountMismatch { expected: usize, got: usize },
    /// A snapshot holds the same block twice in one slot.
    DuplicateBlock { slot: u16, block: u64 },
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated {
                offset,
                needed_bytes,
            } => write!(f, "truncated: need {needed_bytes} bytes at offset {offset}"),
            Self::BadMagic => f.write_str("not an envoy-kv-router record (bad magic)"),
            Self::UnsupportedVersion { got, supported } => {
                write!(
                    f,
                    "codec version {got}, this build reads version {supported}"
                )
            }
            Self::InvalidTag {
                field,
                value,
                offset,
            } => write!(f, "invalid {field} tag {value} at offset {offset}"),
            Self::CountTooLarge {
                field,
                count,
                offset,
            } => write!(
                f,
                "{field} count {count} at offset {offset} exceeds the input"
            ),
            Self::TrailingBytes { count } => write!(f, "{count} trailing bytes"),
            Self::SlotCountMismatch { expected, got } => write!(
                f,
                "snapshot has {got} slots, the configuration has {expected}"
            ),
            Self::DuplicateBlock { slot, block } => {
                write!(f, "snapshot holds block {block} twice in slot {slot}")
            }
        }
    }
}

impl std::error::Error for CodecError {}

const LOG_MAGIC: [u8; 3] = *b"EKL";
const LOG_VERSION: u8 = 1;

const RECORD_EVENTS: u8 = 1;
const RECORD_RESYNC: u8 = 2;
const RECORD_WORKER_LOST: u8 = 3;

const EVENT_STORED: u8 = 1;
const EVENT_REMOVED: u8 = 2;
const EVENT_CLEARED: u8 = 3;

/// Smallest encodings, used to reject length prefixes that cannot fit before allocating.
const MIN_RECORD_BYTES: usize = 3;
const MIN_EVENT_BYTES: usize = 10;

/// Stable one-byte code of a tier (shared by the log and the index snapshot).
pub(crate) fn tier_code(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => 0,
        StorageTier::Host => 1,
        StorageTier::Disk => 2,
    }
}

pub(crate) fn tier_from_code(code: u8) -> Option<StorageTier> {
    match code {
        0 => Some(StorageTier::Device),
        1 => Some(StorageTier::Host),
        2 => Some(StorageTier::Disk),
        _ => None,
    }
}

/// Little-endian append helpers.
pub(crate) struct Writer {
    pub(crate) bytes: Vec<u8>,
}

impl Writer {
    pub(crate) fn new() -> Self {
        Writer { bytes: Vec::new() }
    }

    pub(crate) fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }

    pub(crate) fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    /// A length prefix. Lengths over u32::MAX cannot occur on wasm32 (they would not fit in
    /// memory); natively they saturate, which the decoder then rejects as inconsistent.
    pub(crate) fn len_prefix(&mut self, len: usize) {
        self.u32(u32::try_from(len).unwrap_or(u32::MAX));
    }
}

/// Bounds-checked little-endian reader: every read returns `Err` instead of panicking.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    pub(crate) fn offset(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let truncated = CodecError::Truncated {
            offset: self.pos,
            needed_bytes: N,
        };
        let end = self.pos.checked_add(N).ok_or(truncated.clone())?;
        let slice = self.bytes.get(self.pos..end).ok_or(truncated.clone())?;
        let array = <[u8; N]>::try_from(slice).map_err(|_| truncated)?;
        self.pos = end;
        Ok(array)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, CodecError> {
        self.take::<1>().map(|[b]| b)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, CodecError> {
        self.take::<2>().map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, CodecError> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, CodecError> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    /// A length prefix for elements of at least `min_elem_bytes` each, checked against the rest
    /// of the input so garbage cannot make us allocate gigabytes.
    pub(crate) fn count(
        &mut self,
        field: &'static str,
        min_elem_bytes: usize,
    ) -> Result<usize, CodecError> {
        let offset = self.pos;
        let count = self.u32()?;
        let fits = usize::try_from(count)
            .ok()
            .filter(|&n| n.saturating_mul(min_elem_bytes) <= self.remaining());
        fits.ok_or(CodecError::CountTooLarge {
            field,
            count,
            offset,
        })
    }

    /// Checks a 3-byte magic and a version byte.
    pub(crate) fn header(&mut self, magic: [u8; 3], version: u8) -> Result<(), CodecError> {
        let got = self.take::<3>().map_err(|_| CodecError::BadMagic)?;
        if got != magic {
            return Err(CodecError::BadMagic);
        }
        let got = self.u8()?;
        if got != version {
            return Err(CodecError::UnsupportedVersion {
                got,
                supported: version,
            });
        }
        Ok(())
    }

    pub(crate) fn finish(&self) -> Result<(), CodecError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(CodecError::TrailingBytes { count }),
        }
    }

    pub(crate) fn tier(&mut self) -> Result<StorageTier, CodecError> {
        let offset = self.pos;
        let code = self.u8()?;
        tier_from_code(code).ok_or(CodecError::InvalidTag {
            field: "tier",
            value: code,
            offset,
        })
    }

    /// A presence byte (0 absent, 1 present).
    fn flag(&mut self, field: &'static str) -> Result<bool, CodecError> {
        let offset = self.pos;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(CodecError::InvalidTag {
                field,
                value,
                offset,
            }),
        }
    }
}

fn encode_event(w: &mut Writer, numbered: &NumberedEvent) {
    w.u64(numbered.event_id);
    match &numbered.event {
        IndexEvent::Stored {
            dp_rank,
            tier,
            parent,
            blocks,
        } => {
            w.u8(EVENT_STORED);
            w.u32(*dp_rank);
            w.u8(tier_code(*tier));
            match parent {
                Some(p) => {
                    w.u8(1);
                    w.u64(p.0);
                }
                None => w.u8(0),
            }
            w.len_prefix(blocks.len());
            for (ext, local) in blocks {
                w.u64(ext.0);
                w.u64(local.0);
            }
        }
        IndexEvent::Removed {
            dp_rank,
            tier,
            blocks,
        } => {
            w.u8(EVENT_REMOVED);
            w.u32(*dp_rank);
            w.u8(tier_code(*tier));
            w.len_prefix(blocks.len());
            for ext in blocks {
                w.u64(ext.0);
            }
        }
        IndexEvent::Cleared { dp_rank } => {
            w.u8(EVENT_CLEARED);
            match dp_rank {
                Some(rank) => {
                    w.u8(1);
                    w.u32(*rank);
                }
                None => w.u8(0),
            }
        }
    }
}

fn decode_event(r: &mut Reader<'_>) -> Result<NumberedEvent, CodecError> {
    let event_id = r.u64()?;
    let offset = r.offset();
    let event = match r.u8()? {
        EVENT_STORED => {
            let dp_rank = r.u32()?;
            let tier = r.tier()?;
            let parent = if r.flag("parent")? {
                Some(ExternalBlockHash(r.u64()?))
            } else {
                None
            };
            let count = r.count("stored blocks", 16)?;
            let mut blocks = Vec::with_capacity(count);
            for _ in 0..count {
                blocks.push((ExternalBlockHash(r.u64()?), LocalBlockHash(r.u64()?)));
            }
            IndexEvent::Stored {
                dp_rank,
                tier,
                parent,
                blocks,
            }
        }
        EVENT_REMOVED => {
            let dp_rank = r.u32()?;
            let tier = r.tier()?;
            let count = r.count("removed blocks", 8)?;
            let mut blocks = Vec::with_capacity(count);
            for _ in 0..count {
                blocks.push(ExternalBlockHash(r.u64()?));
            }
            IndexEvent::Removed {
                dp_rank,
                tier,
                blocks,
            }
        }
        EVENT_CLEARED => {
            let dp_rank = if r.flag("cleared rank")? {
                Some(r.u32()?)
            } else {
                None
            };
            IndexEvent::Cleared { dp_rank }
        }
        value => {
            return Err(CodecError::InvalidTag {
                field: "event",
                value,
                offset,
            })
        }
    };
    Ok(NumberedEvent { event_id, event })
}

fn encode_events(w: &mut Writer, events: &[NumberedEvent]) {
    w.len_prefix(events.len());
    for event in events {
        encode_event(w, event);
    }
}

fn decode_events(r: &mut Reader<'_>) -> Result<Vec<NumberedEvent>, CodecError> {
    let count = r.count("events", MIN_EVENT_BYTES)?;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(decode_event(r)?);
    }
    Ok(events)
}

/// Encodes one batch of the shared log: `"EKL"`, version, record count, records; little-endian.
pub fn encode_log_batch(records: &[LogRecord]) -> Vec<u8> {
    let mut w = Writer::new();
    w.bytes.extend_from_slice(&LOG_MAGIC);
    w.u8(LOG_VERSION);
    w.len_prefix(records.len());
    for record in records {
        match record {
            LogRecord::Events { worker, events } => {
                w.u8(RECORD_EVENTS);
                w.u16(*worker);
                encode_events(&mut w, events);
            }
            LogRecord::Resync {
                worker,
                last_event_id,
                events,
            } => {
                w.u8(RECORD_RESYNC);
                w.u16(*worker);
                w.u64(*last_event_id);
                encode_events(&mut w, events);
            }
            LogRecord::WorkerLost { worker } => {
                w.u8(RECORD_WORKER_LOST);
                w.u16(*worker);
            }
        }
    }
    w.bytes
}

/// Decodes a batch written by [`encode_log_batch`]; any truncation, unknown tag or trailing byte
/// is an error (never a panic).
pub fn decode_log_batch(bytes: &[u8]) -> Result<Vec<LogRecord>, CodecError> {
    let mut r = Reader::new(bytes);
    r.header(LOG_MAGIC, LOG_VERSION)?;
    let count = r.count("records", MIN_RECORD_BYTES)?;
    let mut records = Vec::with_capacity(count);
    for _ in 0..count {
        let offset = r.offset();
        let record = match r.u8()? {
            RECORD_EVENTS => LogRecord::Events {
                worker: r.u16()?,
                events: decode_events(&mut r)?,
            },
            RECORD_RESYNC => LogRecord::Resync {
                worker: r.u16()?,
                last_event_id: r.u64()?,
                events: decode_events(&mut r)?,
            },
            RECORD_WORKER_LOST => LogRecord::WorkerLost { worker: r.u16()? },
            value => {
                return Err(CodecError::InvalidTag {
                    field: "record",
                    value,
                    offset,
                })
            }
        };
        records.push(record);
    }
    r.finish()?;
    Ok(records)
}

#[cfg(test)]
// Tests fail by panicking; indexing known-length fixtures keeps them readable.
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::hashing::DYNAMO_HASH_SEED;

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
                kv_usage: 0.5
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
        }
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
            if let Ok(records) = decode_log_batch(&bytes) {
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
