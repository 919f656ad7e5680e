//! The event page and the dump the filter polls (docs/DESIGN.md, "Worker event endpoint"): their
//! JSON shapes ([`PageJson`], [`EventJson`]: written here for the bridge and the mock, read by the
//! filter's `events::parse_event_page`), the `load` object, the id bound.

use core::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A data-parallel rank.
pub type DpRank = u32;

/// Largest event id (and cursor) accepted: 2^63 - 1. Ids are counters from 0 or 1; anything
/// near `u64::MAX` is a broken or hostile worker, and accepting it would leave no room for the
/// next id (`cursor + 1`) to exist.
pub const MAX_EVENT_ID: u64 = i64::MAX as u64;

/// One "stored" event of a dump: a run of blocks on one rank and medium, each following the one
/// before it, the first following `parent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpRun {
    pub dp_rank: DpRank,
    pub medium: String,
    pub parent: Option<u64>,
    pub block_hashes: Vec<u64>,
    pub token_ids: Vec<u32>,
    pub lora_name: Option<String>,
}

/// An event as forwarded to the page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageEvent {
    Stored {
        dp_rank: DpRank,
        medium: String,
        parent: Option<u64>,
        block_hashes: Vec<u64>,
        token_ids: Vec<u32>,
        lora_name: Option<String>,
    },
    Removed {
        dp_rank: DpRank,
        medium: String,
        block_hashes: Vec<u64>,
    },
    /// Every block of one rank. The rank is always named: the filter reads a clear without
    /// `dp_rank` as "every rank of the worker".
    Cleared { dp_rank: DpRank },
}

impl PageEvent {
    pub fn kind(&self) -> &'static str {
        match self {
            PageEvent::Stored { .. } => "BlockStored",
            PageEvent::Removed { .. } => "BlockRemoved",
            PageEvent::Cleared { .. } => "AllBlocksCleared",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The JSON shapes, once: written by the bridge and the mock, read by the filter.
// ---------------------------------------------------------------------------------------------

/// A 64-bit hash in JSON. Written as an unsigned integer; read from an unsigned integer, a
/// negative i64 (reinterpreted bit for bit: engines that emit signed hashes) or a decimal string
/// (JSON producers that cannot write 64-bit integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hash64(pub u64);

impl Serialize for Hash64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

struct Hash64Visitor;

impl Visitor<'_> for Hash64Visitor {
    type Value = Hash64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a 64-bit hash (integer or decimal string)")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Hash64, E> {
        Ok(Hash64(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Hash64, E> {
        Ok(Hash64(u64::from_ne_bytes(v.to_ne_bytes())))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Hash64, E> {
        if let Ok(u) = v.parse::<u64>() {
            return Ok(Hash64(u));
        }
        match v.parse::<i64>() {
            Ok(i) => self.visit_i64(i),
            Err(_) => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

impl<'de> Deserialize<'de> for Hash64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Hash64Visitor)
    }
}

/// An event id or cursor in JSON, read signed and wide so that "-1" or an id past 2^64 reaches
/// the reader's range check (a clear "bad id") instead of failing as a JSON type error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventId(pub i128);

impl From<u64> for EventId {
    fn from(id: u64) -> Self {
        EventId(i128::from(id))
    }
}

impl Serialize for EventId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i128(self.0)
    }
}

struct EventIdVisitor;

impl Visitor<'_> for EventIdVisitor {
    type Value = EventId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an integer event id")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<EventId, E> {
        Ok(EventId(i128::from(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<EventId, E> {
        Ok(EventId(i128::from(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<EventId, E> {
        v.parse::<i128>()
            .map(EventId)
            .map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
    }
}

impl<'de> Deserialize<'de> for EventId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventIdVisitor)
    }
}

/// One event of a page or a dump: the union of every shape the filter reads; which fields are
/// set tells the shape apart.
///
/// * vLLM's, which the bridge and the mock write: `type` is `BlockStored` (`block_hashes`,
///   `parent_block_hash`, `token_ids`, `block_size`, `medium`, `lora_name`), `BlockRemoved`
///   (`block_hashes`, `medium`) or `AllBlocksCleared`.
/// * Dynamo's: `data` is `"cleared"`, `{"stored": DynamoStored}` or `{"removed": DynamoRemoved}`
///   with `storage_tier`, possibly wrapped as `{"worker_id", "storage_tier", "event": {...}}`.
///
/// `dp_rank` absent means rank 0, except in a clear, where it means every rank of the worker.
/// Unknown fields are ignored (engines add fields). `Tokens` is how `token_ids` is read: a plain
/// `Vec<u32>`, or the filter's fast reader. (A missing optional field reads as `None`.)
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventJson<Tokens = Vec<u32>> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<EventId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<DpRank>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_hashes: Option<Vec<Hash64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_block_hash: Option<Hash64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Tokens>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub medium: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// Dynamo: the tier of `data`'s blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storage_tier: Option<String>,
    /// Dynamo's wrapped shape: the event inside, its fields winning over the wrapper's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<Box<EventJson<Tokens>>>,
    /// Dynamo: `"cleared"`, `{"stored": {...}}` or `{"removed": {...}}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

/// Dynamo's `{"stored": ...}` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoStored {
    pub parent_hash: Option<Hash64>,
    pub blocks: Vec<DynamoBlock>,
}

/// One block of [`DynamoStored`]: the engine's hash and the hash of its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoBlock {
    pub block_hash: Hash64,
    pub tokens_hash: Hash64,
}

/// Dynamo's `{"removed": ...}` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoRemoved {
    pub block_hashes: Vec<Hash64>,
}

/// A `GET /kv/events` page or a `GET /kv/dump` body. A dump has no `first_event_id` and only
/// stored events, their ids optional. Every field is optional here so that the reader can say
/// which one a page lacks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PageJson<Event> {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_event_id: Option<EventId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_id: Option<EventId>,
    #[serde(default = "Vec::new")]
    pub events: Vec<Event>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Load>,
    /// The worker's own description ([`crate::worker::WorkerDescription`]), kept as a value so
    /// that a malformed one costs the description, not the page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<serde_json::Value>,
}

fn hashes(hashes: &[u64]) -> Option<Vec<Hash64>> {
    Some(hashes.iter().copied().map(Hash64).collect())
}

/// A vLLM `BlockStored` event's fields (a page's stored event and a dump's run carry the same).
struct StoredParts<'a> {
    dp_rank: DpRank,
    medium: &'a str,
    parent: Option<u64>,
    block_hashes: &'a [u64],
    token_ids: &'a [u32],
    lora_name: Option<&'a str>,
}

impl StoredParts<'_> {
    fn json(&self, block_size: u32) -> EventJson {
        EventJson {
            dp_rank: Some(self.dp_rank),
            kind: Some("BlockStored".to_owned()),
            block_hashes: hashes(self.block_hashes),
            parent_block_hash: self.parent.map(Hash64),
            token_ids: Some(self.token_ids.to_vec()),
            block_size: Some(u64::from(block_size)),
            medium: Some(self.medium.to_owned()),
            lora_name: self.lora_name.map(str::to_owned),
            ..EventJson::default()
        }
    }
}

impl EventJson {
    /// A dump's run as a vLLM `BlockStored` event.
    pub fn stored(run: &DumpRun, block_size: u32) -> Self {
        StoredParts {
            dp_rank: run.dp_rank,
            medium: &run.medium,
            parent: run.parent,
            block_hashes: &run.block_hashes,
            token_ids: &run.token_ids,
            lora_name: run.lora_name.as_deref(),
        }
        .json(block_size)
    }

    /// The vLLM-shaped JSON of a page event.
    pub fn of(event: &PageEvent, block_size: u32) -> Self {
        let kind = Some(event.kind().to_owned());
        match event {
            PageEvent::Stored {
                dp_rank,
                medium,
                parent,
                block_hashes,
                token_ids,
                lora_name,
            } => StoredParts {
                dp_rank: *dp_rank,
                medium,
                parent: *parent,
                block_hashes,
                token_ids,
                lora_name: lora_name.as_deref(),
            }
            .json(block_size),
            PageEvent::Removed {
                dp_rank,
                medium,
                block_hashes,
            } => EventJson {
                dp_rank: Some(*dp_rank),
                kind,
                block_hashes: hashes(block_hashes),
                medium: Some(medium.clone()),
                ..EventJson::default()
            },
            PageEvent::Cleared { dp_rank } => EventJson {
                dp_rank: Some(*dp_rank),
                kind,
                ..EventJson::default()
            },
        }
    }
}

/// One page event as JSON with its id.
pub fn event_json(event_id: u64, event: &PageEvent, block_size: u32) -> String {
    let json = EventJson {
        event_id: Some(event_id.into()),
        ..EventJson::of(event, block_size)
    };
    // Numbers and strings only: serialization cannot fail.
    serde_json::to_string(&json).unwrap_or_default()
}

/// Worker-reported load, as the page's `load` object. Read leniently: a field left out or
/// `null` is 0 (a producer that knows only some of them still reports those).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Load {
    #[serde(deserialize_with = "null_as_default")]
    pub num_waiting: u32,
    #[serde(deserialize_with = "null_as_default")]
    pub num_running: u32,
    /// Fraction of the worker's KV cache in use, 0.0..=1.0 as reported (not clamped).
    #[serde(deserialize_with = "null_as_default")]
    pub kv_usage: f64,
    /// What the *other* routers in front of the worker have in flight on it, as each declared
    /// when it last polled (`/kv/events?router=...&booked=...`): the bridge relays it, so that
    /// Envoy replicas see each other's bookings without any other channel. Absent from engines
    /// and when no other router polls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_routers: Option<Booked>,
}

/// One router's bookings on one worker: requests in flight, their queued prefill tokens and
/// their decode blocks, as its load table holds them (`booked=<requests>,<tokens>,<blocks>`),
/// and what it has learned of the worker's timing (`timing=`, when it learns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Booked {
    pub requests: u32,
    pub prefill_tokens: f64,
    pub decode_blocks: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timing: Option<TimingSums>,
}

/// Queued prefill tokens that change a declaration enough to tell the other routers at once
/// (beyond a quarter of the larger of the two): requests starting or ending their prefill, not
/// the drift of a decaying estimate.
const MOVED_TOKENS: f64 = 64.0;

impl Booked {
    /// The `booked=` query value.
    pub fn query_value(&self) -> String {
        format!(
            "{},{:.0},{:.1}",
            self.requests, self.prefill_tokens, self.decode_blocks
        )
    }

    /// Parses a `booked=` query value; `None` unless three finite non-negative numbers.
    pub fn parse(value: &str) -> Option<Booked> {
        let mut parts = value.split(',');
        let requests = parts.next()?.trim().parse::<u32>().ok()?;
        let mut number = || {
            parts
                .next()?
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        let prefill_tokens = number()?;
        let decode_blocks = number()?;
        if parts.next().is_some() {
            return None;
        }
        Some(Booked {
            requests,
            prefill_tokens,
            decode_blocks,
            timing: None,
        })
    }

    /// The sum of two routers' bookings (and of what they learned).
    pub fn plus(self, other: Booked) -> Booked {
        let timing = match (self.timing, other.timing) {
            (Some(a), Some(b)) => Some(a.plus(&b)),
            (a, b) => a.or(b),
        };
        Booked {
            requests: self.requests.saturating_add(other.requests),
            prefill_tokens: self.prefill_tokens + other.prefill_tokens,
            decode_blocks: self.decode_blocks + other.decode_blocks,
            timing,
        }
    }

    /// Whether the bookings moved enough since `before` for the other routers to hear of it now
    /// rather than with the next page: a request more or less, or the queued prefill by more
    /// than a quarter (the decode blocks, which grow with every token, and the timing ride
    /// along with the next declaration).
    pub fn moved_from(&self, before: &Booked) -> bool {
        let (a, b) = (self.prefill_tokens, before.prefill_tokens);
        self.requests != before.requests || (a - b).abs() > MOVED_TOKENS + 0.25 * a.max(b)
    }
}

/// What one router learned of a worker's timing, as decayed sums over its samples
/// (`kv_router_core::learn::TimingRecord` without its clock): additive, so the bridge relays
/// the other routers' sum and each router learns from every replica's responses.
/// Serialized as an array of the seven sums, in field order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "[f64; 7]", into = "[f64; 7]")]
pub struct TimingSums {
    pub predicted_ms: f64,
    pub log_ratio: f64,
    pub log_ratio_sq: f64,
    pub predicted_sq: f64,
    pub log_own: f64,
    pub log_own_sq: f64,
    pub cross: f64,
}

impl From<[f64; 7]> for TimingSums {
    fn from(v: [f64; 7]) -> Self {
        let [predicted_ms, log_ratio, log_ratio_sq, predicted_sq, log_own, log_own_sq, cross] = v;
        TimingSums {
            predicted_ms,
            log_ratio,
            log_ratio_sq,
            predicted_sq,
            log_own,
            log_own_sq,
            cross,
        }
    }
}

impl From<TimingSums> for [f64; 7] {
    fn from(t: TimingSums) -> Self {
        [
            t.predicted_ms,
            t.log_ratio,
            t.log_ratio_sq,
            t.predicted_sq,
            t.log_own,
            t.log_own_sq,
            t.cross,
        ]
    }
}

impl TimingSums {
    /// The `timing=` query value: the seven sums, comma-separated, each exactly.
    pub fn query_value(&self) -> String {
        let v: [f64; 7] = (*self).into();
        v.map(|x| x.to_string()).join(",")
    }

    /// Parses a `timing=` value; `None` unless seven finite numbers whose weights (the sums of
    /// weights and of squares) are not negative.
    pub fn parse(value: &str) -> Option<TimingSums> {
        let mut v = [0.0; 7];
        let mut parts = value.split(',');
        for slot in &mut v {
            *slot = parts.next()?.trim().parse::<f64>().ok()?;
        }
        let t = TimingSums::from(v);
        (parts.next().is_none() && t.is_valid()).then_some(t)
    }

    /// Finite sums, the weights and squares not negative.
    pub fn is_valid(&self) -> bool {
        let v: [f64; 7] = (*self).into();
        v.iter().all(|x| x.is_finite())
            && [
                self.predicted_ms,
                self.log_ratio_sq,
                self.predicted_sq,
                self.log_own_sq,
            ]
            .iter()
            .all(|x| *x >= 0.0)
    }

    /// Every sum times `keep` (the samples' weights decayed alike).
    pub fn scaled(&self, keep: f64) -> TimingSums {
        TimingSums::from(<[f64; 7]>::from(*self).map(|v| v * keep))
    }

    pub fn plus(&self, other: &TimingSums) -> TimingSums {
        let (a, b): ([f64; 7], [f64; 7]) = ((*self).into(), (*other).into());
        let mut sum = [0.0; 7];
        for ((s, x), y) in sum.iter_mut().zip(a).zip(b) {
            *s = x + y;
        }
        TimingSums::from(sum)
    }
}

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `GET /kv/events` body: a [`PageJson`] with the events' texts (as the ring keeps them) spliced
/// in, so that serving a page copies its bytes once instead of parsing and re-writing each event.
pub fn page_json(
    block_size: u32,
    first_event_id: u64,
    last_event_id: u64,
    events: &[&str],
    load: Option<Load>,
) -> String {
    let body_len: usize = events.iter().map(|e| e.len() + 1).sum();
    let mut out = String::with_capacity(body_len + 160);
    out.push_str(&format!(
        "{{\"block_size\":{block_size},\"first_event_id\":{first_event_id},\"last_event_id\":{last_event_id},\"events\":["
    ));
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(e);
    }
    out.push(']');
    if let Some(load) = load {
        out.push_str(",\"load\":");
        out.push_str(&serde_json::to_string(&load).unwrap_or_else(|_| "null".to_owned()));
    }
    out.push('}');
    out
}

/// `GET /kv/dump` body: the mirror as stored events (no ids) and the id it corresponds to.
pub fn dump_json(block_size: u32, last_event_id: u64, runs: &[DumpRun]) -> String {
    let dump = PageJson {
        block_size: Some(u64::from(block_size)),
        first_event_id: None,
        last_event_id: Some(last_event_id.into()),
        events: runs
            .iter()
            .map(|run| EventJson::stored(run, block_size))
            .collect(),
        load: None,
        worker: None,
    };
    serde_json::to_string(&dump).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> PageEvent {
        PageEvent::Stored {
            dp_rank: 1,
            medium: "GPU".to_owned(),
            parent: Some(u64::MAX),
            block_hashes: vec![7, 8],
            token_ids: vec![1, 2, 3, 4],
            lora_name: None,
        }
    }

    #[test]
    fn timing_sums_read_back_exactly_and_add_up_across_routers() {
        let t = TimingSums {
            predicted_ms: 1234.5,
            log_ratio: -0.123_456_789_012_345_6,
            log_ratio_sq: 0.5,
            predicted_sq: 98_765.432_1,
            log_own: 61.25,
            log_own_sq: 400.125,
            cross: -7.75,
        };
        assert_eq!(TimingSums::parse(&t.query_value()), Some(t));
        for bad in [
            "",
            "1,2,3,4,5,6",
            "1,2,3,4,5,6,7,8",
            "1,2,3,4,5,6,NaN",
            "-1,2,3,4,5,6,7",
            "1,2,-3,4,5,6,7",
            "1,2,3,inf,5,6,7",
        ] {
            assert_eq!(TimingSums::parse(bad), None, "{bad:?}");
        }
        // A negative log ratio (a worker faster than predicted) is a valid sum.
        assert!(TimingSums::parse("1,-2,3,4,-5,6,-7").is_some());
        let booked = |requests, timing| Booked {
            requests,
            prefill_tokens: 10.0,
            decode_blocks: 1.0,
            timing,
        };
        let sum = booked(1, Some(t))
            .plus(booked(2, Some(t)))
            .plus(booked(3, None));
        assert_eq!(sum.requests, 6);
        assert_eq!(sum.timing.map(|s| s.predicted_ms), Some(2469.0));
        assert_eq!(sum.timing.map(|s| s.cross), Some(-15.5));
        // On the page: an array of the seven sums, absent without timing.
        let json = serde_json::to_string(&booked(1, Some(t))).unwrap();
        assert!(json.contains(r#""timing":[1234.5,"#), "{json}");
        let back: Booked = serde_json::from_str(&json).unwrap();
        assert_eq!(back, booked(1, Some(t)));
        assert!(!serde_json::to_string(&booked(1, None))
            .unwrap()
            .contains("timing"));
    }

    #[test]
    fn a_booking_moves_with_a_request_or_a_quarter_of_its_prefill_not_with_its_decode() {
        let b = |requests, prefill_tokens, decode_blocks| Booked {
            requests,
            prefill_tokens,
            decode_blocks,
            timing: None,
        };
        let before = b(2, 4000.0, 30.0);
        assert!(b(3, 4000.0, 30.0).moved_from(&before));
        assert!(b(1, 4000.0, 30.0).moved_from(&before));
        assert!(b(2, 2000.0, 30.0).moved_from(&before));
        assert!(b(2, 5600.0, 30.0).moved_from(&before));
        assert!(
            !b(2, 3100.0, 30.0).moved_from(&before),
            "a decaying estimate"
        );
        assert!(!b(2, 4000.0, 90.0).moved_from(&before), "decode growth");
        assert!(!b(0, 50.0, 0.0).moved_from(&b(0, 0.0, 0.0)));
    }

    #[test]
    fn a_booking_reads_back_from_its_query_value() {
        let b = Booked {
            requests: 3,
            prefill_tokens: 12_288.0,
            decode_blocks: 40.5,
            timing: None,
        };
        assert_eq!(b.query_value(), "3,12288,40.5");
        assert_eq!(Booked::parse(&b.query_value()), Some(b));
        for bad in [
            "", "3", "3,1", "3,1,2,4", "-1,1,2", "3,NaN,2", "3,1,-2", "x,1,2",
        ] {
            assert_eq!(Booked::parse(bad), None, "{bad:?}");
        }
        // The load object without it (engines, one router) reads and writes as before.
        let load: Load = serde_json::from_str(r#"{"num_waiting": 1}"#).unwrap();
        assert_eq!(load.other_routers, None);
        assert!(!serde_json::to_string(&load)
            .unwrap()
            .contains("other_routers"));
    }

    #[test]
    fn what_the_writers_write_reads_back_as_the_same_page() {
        let events = [
            event_json(5, &stored(), 2),
            event_json(
                6,
                &PageEvent::Removed {
                    dp_rank: 1,
                    medium: "CPU".to_owned(),
                    block_hashes: vec![8],
                },
                2,
            ),
            event_json(7, &PageEvent::Cleared { dp_rank: 0 }, 2),
        ];
        let texts: Vec<&str> = events.iter().map(String::as_str).collect();
        let load = Load {
            num_waiting: 1,
            num_running: 2,
            kv_usage: 0.25,
            other_routers: None,
        };
        let page: PageJson<EventJson> =
            serde_json::from_str(&page_json(2, 5, 7, &texts, Some(load))).unwrap();
        assert_eq!(page.block_size, Some(2));
        assert_eq!(page.first_event_id, Some(EventId(5)));
        assert_eq!(page.last_event_id, Some(EventId(7)));
        assert_eq!(page.load, Some(load));
        let kinds: Vec<_> = page.events.iter().map(|e| e.kind.as_deref()).collect();
        assert_eq!(
            kinds,
            [
                Some("BlockStored"),
                Some("BlockRemoved"),
                Some("AllBlocksCleared")
            ]
        );
        let first = page.events.first().unwrap();
        assert_eq!(first.event_id, Some(EventId(5)));
        assert_eq!(first.block_hashes, Some(vec![Hash64(7), Hash64(8)]));
        assert_eq!(first.parent_block_hash, Some(Hash64(u64::MAX)));
        assert_eq!(first.token_ids, Some(vec![1, 2, 3, 4]));
        assert_eq!(first.block_size, Some(2));
        // A dump is the same shape: stored events without ids.
        let run = DumpRun {
            dp_rank: 1,
            medium: "GPU".to_owned(),
            parent: None,
            block_hashes: vec![7],
            token_ids: vec![1, 2],
            lora_name: Some("adapter".to_owned()),
        };
        let dump: PageJson<EventJson> =
            serde_json::from_str(&dump_json(2, 9, std::slice::from_ref(&run))).unwrap();
        assert_eq!(dump.last_event_id, Some(EventId(9)));
        assert_eq!(dump.first_event_id, None);
        assert_eq!(dump.events, [EventJson::stored(&run, 2)]);
    }

    #[test]
    fn hashes_and_ids_read_in_every_form_producers_write() {
        let read = |json: &str| serde_json::from_str::<Hash64>(json);
        assert_eq!(read("18446744073709551615").unwrap(), Hash64(u64::MAX));
        assert_eq!(read("-1").unwrap(), Hash64(u64::MAX));
        assert_eq!(read(r#""-2""#).unwrap(), Hash64(u64::MAX - 1));
        assert_eq!(read(r#""42""#).unwrap(), Hash64(42));
        assert!(read(r#""0x2a""#).is_err());
        assert!(read("1.5").is_err());
        let id = |json: &str| serde_json::from_str::<EventId>(json);
        assert_eq!(id("-1").unwrap(), EventId(-1));
        assert_eq!(id(r#""18446744073709551616""#).unwrap(), EventId(1 << 64));
        assert_eq!(serde_json::to_string(&EventId(3)).unwrap(), "3");
    }

    #[test]
    fn a_load_object_reads_missing_and_null_fields_as_zero() {
        let load: Load = serde_json::from_str(r#"{"num_waiting": 3, "kv_usage": null}"#).unwrap();
        assert_eq!(
            load,
            Load {
                num_waiting: 3,
                num_running: 0,
                kv_usage: 0.0,
                other_routers: None,
            }
        );
        let written = Load {
            num_waiting: 1,
            num_running: 2,
            kv_usage: 0.5,
            other_routers: None,
        };
        let back: Load = serde_json::from_str(&serde_json::to_string(&written).unwrap()).unwrap();
        assert_eq!(back, written);
        assert!(serde_json::from_str::<Load>(r#"{"num_waiting": -1}"#).is_err());
    }
}
