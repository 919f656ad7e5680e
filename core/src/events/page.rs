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

use kv_router_protocol::page::{DynamoRemoved, DynamoStored, EventId, EventJson, Hash64, PageJson};
use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::{EventError, EventPage, IndexEvent, NumberedEvent, MAX_EVENT_ID};
use crate::hashing::{hash_seed, local_block_hashes};
use crate::types::{DpRank, ExternalBlockHash, LocalBlockHash, StorageTier};
use crate::worker_description::WorkerDescription;

/// Token ids as the filter reads them. During [`fast::parse`] a cut array (`[]` in the copy) takes
/// the ids the structural scan read for it; otherwise serde's value (see [`fast`]).
struct WireTokens(Vec<u32>);

impl<'de> Deserialize<'de> for WireTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let parsed = Vec::<u32>::deserialize(d)?;
        fast::take(parsed)
            .map(WireTokens)
            .map_err(de::Error::custom)
    }
}

/// The protocol's event and page shapes, with the fast token reader.
type RawEvent = EventJson<WireTokens>;
type RawPage = PageJson<RawEvent>;

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

fn malformed(err: &serde_json::Error) -> EventError {
    EventError::Malformed {
        reason: err.to_string(),
    }
}

/// A positive event id (ids start at 1; 0 is the "nothing seen yet" cursor).
fn positive_id(id: EventId, field: &'static str) -> Result<u64, EventError> {
    match u64::try_from(id.0) {
        Ok(v) if v > 0 && v <= MAX_EVENT_ID => Ok(v),
        _ => Err(EventError::InvalidEventId { field, value: id.0 }),
    }
}

/// A cursor: 0 allowed.
fn cursor_id(id: EventId, field: &'static str) -> Result<u64, EventError> {
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

fn ext_hashes(hashes: Vec<Hash64>) -> Vec<ExternalBlockHash> {
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
            let raw: DynamoStored = serde_json::from_value(body).map_err(|e| malformed(&e))?;
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
            let raw: DynamoRemoved = serde_json::from_value(body).map_err(|e| malformed(&e))?;
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
            let tokens = raw
                .token_ids
                .ok_or(EventError::MissingEventField {
                    event_id,
                    field: "token_ids",
                })?
                .0;
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
    let raw: RawPage = match fast::parse(body) {
        Some(raw) => raw,
        None => serde_json::from_slice(body).map_err(|e| malformed(&e))?,
    };
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
    let load = raw.load;
    let (worker, invalid_worker) = match raw.worker {
        None => (None, None),
        Some(value) => match serde_json::from_value::<WorkerDescription>(value) {
            Ok(d) => (Some(d), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    Ok(EventPage {
        block_size: expected_block_size,
        worker,
        invalid_worker,
        first_event_id,
        last_event_id,
        events,
        load,
    })
}

/// The fast pass for the token ids of vLLM `BlockStored` events, which are most of a page's
/// bytes: serde reads a number in ~100 instructions, the request path's SWAR scanner
/// ([`crate::request::scan_token_ids`]) in a few. A structural scan finds every `"token_ids"`
/// key whose value is an array, reads the array with the scanner and cuts it out of a copy of
/// the body (`[]` in its place); serde then parses the copy, and each `token_ids` value it meets
/// takes the next scanned array, in body order.
///
/// Why the answer is the serde pass's: a cut range is a complete array of plain integers (no
/// quotes), so if serde accepts the copy, the original is valid JSON with the same structure, and
/// without backslashes in the body (else no fast pass) a string runs from one `"` to the next,
/// so the scan sees exactly the `"token_ids"` keys of the document, in order. Each key serde
/// reads as an event's `token_ids` takes one entry; an entry serde never reads (the key inside
/// an ignored field) or one taken out of step (a cut entry whose copy is not `[]`) fails the
/// pass, and [`parse_body`] parses the original body with serde alone. `None` also when there is
/// nothing to cut.
mod fast {
    use std::cell::RefCell;
    use std::collections::VecDeque;

    use super::RawPage;
    use crate::request::scan_token_ids;

    const KEY: &[u8] = b"\"token_ids\"";

    /// One entry per `token_ids` array in body order: `Some(ids)` cut, `None` left to serde.
    type Prefill = VecDeque<Option<Vec<u32>>>;

    thread_local! {
        /// The scanned arrays while [`parse`] runs (`None`: no fast pass in progress).
        static PREFILL: RefCell<Option<Prefill>> = const { RefCell::new(None) };
    }

    fn skip_ws(body: &[u8], mut i: usize) -> usize {
        while body
            .get(i)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            i += 1;
        }
        i
    }

    /// The page parsed with the token arrays cut out, or `None` (use the serde pass).
    pub(super) fn parse(body: &[u8]) -> Option<RawPage> {
        if body.contains(&b'\\') {
            return None;
        }
        let mut cuts: Vec<(usize, usize)> = Vec::new();
        let mut found = Prefill::new();
        let mut i = 0;
        while let Some(q) = body.get(i..)?.iter().position(|&b| b == b'"') {
            let start = i + q;
            let close = start + 1 + body.get(start + 1..)?.iter().position(|&b| b == b'"')?;
            i = close + 1;
            if body.get(start..i) != Some(KEY) {
                continue;
            }
            let colon = skip_ws(body, i);
            if body.get(colon) != Some(&b':') {
                continue;
            }
            let value = skip_ws(body, colon + 1);
            if body.get(value) != Some(&b'[') {
                continue;
            }
            // An array of integers ends at the first `]` (the scanner sizes its buffer by the
            // text it is given).
            let end = body
                .get(value..)?
                .iter()
                .position(|&b| b == b']')
                .map_or(body.len(), |p| value + p + 1);
            match scan_token_ids(body.get(value..end)?) {
                Some((ids, len)) => {
                    cuts.push((value, value + len));
                    found.push_back(Some(ids));
                    i = value + len;
                }
                None => found.push_back(None),
            }
        }
        if cuts.is_empty() {
            return None;
        }
        let cut_bytes: usize = cuts.iter().map(|&(s, e)| e - s).sum();
        let mut copy = Vec::with_capacity(body.len() - cut_bytes + 2 * cuts.len());
        let mut at = 0;
        for &(s, e) in &cuts {
            copy.extend_from_slice(body.get(at..s)?);
            copy.extend_from_slice(b"[]");
            at = e;
        }
        copy.extend_from_slice(body.get(at..)?);
        PREFILL.with(|p| p.try_borrow_mut().ok().map(|mut p| *p = Some(found)))?;
        let raw = serde_json::from_slice::<RawPage>(&copy).ok();
        let left = PREFILL.with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.take()));
        // Every scanned array taken, in step.
        raw.filter(|_| left.is_some_and(|l| l.is_empty()))
    }

    /// The ids of the `token_ids` value serde just read as `parsed`.
    pub(super) fn take(parsed: Vec<u32>) -> Result<Vec<u32>, &'static str> {
        PREFILL.with(|p| {
            let Ok(mut p) = p.try_borrow_mut() else {
                return Err("token id prefill busy");
            };
            let Some(queue) = p.as_mut() else {
                return Ok(parsed); // the serde pass
            };
            match queue.pop_front() {
                Some(Some(ids)) if parsed.is_empty() => Ok(ids),
                Some(None) => Ok(parsed),
                _ => Err("token ids out of step with the scan"),
            }
        })
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;

    /// The page as the serde pass alone reads it: a backslash anywhere turns the fast pass off,
    /// and an unknown root field is ignored.
    fn serde_only(body: &str) -> Result<EventPage, EventError> {
        let marked = body.replacen('{', r#"{"_": "\/", "#, 1);
        parse_event_page(marked.as_bytes(), 4, 1 << 20)
    }

    fn both(body: &str) -> (Result<EventPage, EventError>, Result<EventPage, EventError>) {
        (
            parse_event_page(body.as_bytes(), 4, 1 << 20),
            serde_only(body),
        )
    }

    fn stored(id: u64, tokens: &str) -> String {
        format!(
            r#"{{"type": "BlockStored", "event_id": {id}, "block_hashes": [{id}], "parent_block_hash": null, "token_ids": {tokens}, "block_size": 4, "medium": "GPU"}}"#
        )
    }

    fn page(events: &[String], extra: &str) -> String {
        format!(
            r#"{{"block_size": 4, "first_event_id": 1, "last_event_id": 9{extra}, "events": [{}]}}"#,
            events.join(",")
        )
    }

    #[test]
    fn the_token_id_fast_pass_gives_the_serde_pass_answer() {
        let cases = [
            // Plain, spaced, multi-digit and u32::MAX ids.
            page(&[stored(1, "[1,2,3,4]"), stored(2, "[ 10 , 200,\n3000 ,4294967295 ]")], ""),
            // An array the scanner declines (a float, a negative, too large): serde's error.
            page(&[stored(1, "[1,2,3,4.5]")], ""),
            page(&[stored(1, "[1,2,3,-4]")], ""),
            page(&[stored(1, "[1,2,3,4294967296]")], ""),
            page(&[stored(1, "[1,2,3,4]"), stored(2, "[1,2,3]")], ""),
            // `token_ids` where no event reads it: in an ignored root field, in a string.
            page(&[stored(1, "[1,2,3,4]")], r#", "x": {"token_ids": [7, 8]}"#),
            page(&[stored(1, "[5,6,7,8]")], r#", "note": "\"token_ids\": [9]""#),
            page(&[stored(1, "[5,6,7,8]")], r#", "note": "token_ids: [9]""#),
            // Not an array: null (absent), a string.
            page(&[stored(1, "null")], ""),
            page(&[stored(1, r#""1,2,3,4""#)], ""),
            // Truncated bodies.
            page(&[stored(1, "[1,2,3,4]")], "")[..60].to_owned(),
            r#"{"block_size": 4, "last_event_id": 1, "events": [{"type": "BlockStored", "event_id": 1, "token_ids": [1,2"#.to_owned(),
            // A dump-like wrapped event, then a removal.
            page(
                &[
                    stored(1, "[1,2,3,4]"),
                    r#"{"type": "BlockRemoved", "event_id": 2, "block_hashes": [1], "medium": "GPU"}"#.to_owned(),
                ],
                "",
            ),
        ];
        for body in &cases {
            let (fast, plain) = both(body);
            match (&fast, &plain) {
                (Ok(a), Ok(b)) => assert_eq!(a.events, b.events, "{body}"),
                (Err(_), Err(_)) => {}
                _ => panic!("{body}: fast {fast:?} vs serde {plain:?}"),
            }
        }
        // The fast pass took the plain page and gave way on the stray key.
        assert!(fast::parse(cases[0].as_bytes()).is_some());
        assert!(fast::parse(cases[5].as_bytes()).is_none());
        assert!(fast::parse(cases[1].as_bytes()).is_none());
        // The ids it cut are the ones hashed.
        let page = parse_event_page(cases[0].as_bytes(), 4, 1 << 20).unwrap();
        assert_eq!(page.events.len(), 2);
        let IndexEvent::Stored { blocks, .. } = &page.events[1].event else {
            panic!("stored")
        };
        let want = local_block_hashes(&[10, 200, 3000, u32::MAX], 4, hash_seed(None));
        assert_eq!(blocks[0].1, want[0]);
    }
}
