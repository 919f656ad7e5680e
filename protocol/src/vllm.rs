//! The engines' KV-event wire format: ZMQ frames and msgpack event batches <-> [`EngineBatch`].
//! The bridge decodes ([`decode_batch`]); the mock worker's engine mode encodes ([`encode_batch`])
//! from the same types, byte for byte as vLLM 0.32 (msgspec) writes them.
//!
//! What vLLM and SGLang really send (see `/kv/...` in the README and the captured fixtures):
//! * a message is 3 frames: `[topic, seq (8-byte big-endian), payload]`;
//! * the payload is a batch, an array `[ts, events]` or `[ts, events, dp_rank]` (msgspec
//!   `array_like`; `dp_rank` may be nil), or a map `{ts, events, data_parallel_rank}`;
//! * an event is a map tagged by `type` (vLLM >= 0.26) or a positional array
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, ...]` (older vLLM, SGLang); trailing fields that equal their default are omitted;
//! * integers come in whatever width msgpack picked; hashes are u64 (also above `i64::MAX`),
//!   signed i64 (SGLang; reinterpreted bit for bit) or 32-byte `bin` (vLLM without
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`; folded to their first 8 bytes, big-endian).
//!
//! Decoding never panics. A malformed batch is one [`DecodeError`]; a malformed event inside a
//! good batch is skipped and reported in [`EngineBatch::skipped`], so one bad event does not hide
//! its neighbours.

use core::fmt;

use rmpv::ValueRef;

/// The sequence frame of the replay's end marker (-1 as a signed 64-bit big-endian integer).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// The largest payload decoded; larger frames are refused before parsing.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 16 << 20;

/// One ZMQ message of the live stream, split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frames<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// One decoded batch of engine events.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineBatch {
    /// Engine wall-clock time of the batch (seconds), when present.
    pub ts: Option<f64>,
    /// The publisher's data-parallel rank, when the batch carries one.
    pub dp_rank: Option<u32>,
    pub events: Vec<EngineEvent>,
    /// Events that could not be decoded (their neighbours were kept).
    pub skipped: Vec<DecodeError>,
}

/// One engine KV-cache event, normalized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    Stored(StoredBlocks),
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllCleared,
}

/// A `BlockStored` event: `block_hashes[0]` follows `parent` (or starts a sequence), each later
/// block follows the one before it; `token_ids` holds every block's tokens in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredBlocks {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: Option<u64>,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    pub medium: Option<String>,
}

/// Why a frame, batch or event was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The message does not have the 3 frames `[topic, seq, payload]`.
    FrameCount { got: usize },
    /// The sequence frame is not 8 bytes.
    SeqFrame { len: usize },
    /// The payload is larger than the configured limit.
    PayloadTooLarge { bytes: usize, max: usize },
    /// Not msgpack, or msgpack with bytes left over.
    Msgpack { reason: String },
    /// Valid msgpack, but not a batch of the known shapes.
    BatchShape { reason: String },
    /// An event that is neither a tagged map nor a tagged array.
    EventShape { reason: String },
    /// An event tag we do not know.
    UnknownEventType { kind: String },
    /// A field of an event is absent or has the wrong type.
    EventField {
        kind: &'static str,
        field: &'static str,
        reason: String,
    },
}

impl DecodeError {
    /// A short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::FrameCount { .. } => "frame_count",
            Self::SeqFrame { .. } => "seq_frame",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::Msgpack { .. } => "msgpack",
            Self::BatchShape { .. } => "batch_shape",
            Self::EventShape { .. } => "event_shape",
            Self::UnknownEventType { .. } => "unknown_event_type",
            Self::EventField { .. } => "event_field",
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::FrameCount { got } => {
                write!(
                    f,
                    "message has {got} frames, expected 3 (topic, seq, payload)"
                )
            }
            Self::SeqFrame { len } => write!(f, "sequence frame is {len} bytes, expected 8"),
            Self::PayloadTooLarge { bytes, max } => {
                write!(f, "payload is {bytes} bytes, over the {max}-byte limit")
            }
            Self::Msgpack { reason } => write!(f, "payload is not msgpack: {reason}"),
            Self::BatchShape { reason } => write!(f, "payload is not an event batch: {reason}"),
            Self::EventShape { reason } => write!(f, "event is malformed: {reason}"),
            Self::UnknownEventType { kind } => write!(f, "unknown event type `{kind}`"),
            Self::EventField {
                kind,
                field,
                reason,
            } => write!(f, "{kind}.{field}: {reason}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Splits a live-stream message into topic, sequence number and payload.
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<Frames<'a>, DecodeError> {
    match frames {
        [topic, seq, payload] => Ok(Frames {
            topic,
            seq: seq_from_frame(seq)?,
            payload,
        }),
        _ => Err(DecodeError::FrameCount { got: frames.len() }),
    }
}

/// An 8-byte big-endian sequence number.
pub fn seq_from_frame(frame: &[u8]) -> Result<u64, DecodeError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| DecodeError::SeqFrame { len: frame.len() })
}

/// Decodes one payload frame into a batch.
pub fn decode_batch(payload: &[u8], max_payload_bytes: usize) -> Result<EngineBatch, DecodeError> {
    if payload.len() > max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            bytes: payload.len(),
            max: max_payload_bytes,
        });
    }
    let mut rest = payload;
    // The depth bound keeps hostile nesting from exhausting the stack; batches nest 4 deep.
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rest, 64).map_err(|e| {
        DecodeError::Msgpack {
            reason: e.to_string(),
        }
    })?;
    if !rest.is_empty() {
        return Err(DecodeError::Msgpack {
            reason: format!("{} bytes after the batch", rest.len()),
        });
    }
    let (ts, events, dp_rank) = batch_parts(&value)?;
    let mut batch =
        EngineBatch {
            ts: ts.and_then(as_f64),
            dp_rank: match dp_rank {
                None | Some(ValueRef::Nil) => None,
                Some(v) => Some(v.as_u64().and_then(|r| u32::try_from(r).ok()).ok_or_else(
                    || DecodeError::BatchShape {
                        reason: format!("dp_rank is not a small unsigned integer: {v}"),
                    },
                )?),
            },
            events: Vec::new(),
            skipped: Vec::new(),
        };
    let ValueRef::Array(events) = events else {
        return Err(DecodeError::BatchShape {
            reason: "`events` is not an array".to_owned(),
        });
    };
    batch.events.reserve(events.len());
    for event in events {
        match decode_event(event) {
            Ok(e) => batch.events.push(e),
            Err(e) => batch.skipped.push(e),
        }
    }
    Ok(batch)
}

type BatchParts<'v, 'a> = (
    Option<&'v ValueRef<'a>>,
    &'v ValueRef<'a>,
    Option<&'v ValueRef<'a>>,
);

/// `(ts, events, dp_rank)` of an array or map batch.
fn batch_parts<'v, 'a>(value: &'v ValueRef<'a>) -> Result<BatchParts<'v, 'a>, DecodeError> {
    match value {
        ValueRef::Array(items) => match items.as_slice() {
            [ts, events] => Ok((Some(ts), events, None)),
            [ts, events, dp_rank, ..] => Ok((Some(ts), events, Some(dp_rank))),
            _ => Err(DecodeError::BatchShape {
                reason: format!(
                    "array of {} items, expected [ts, events, dp_rank?]",
                    items.len()
                ),
            }),
        },
        ValueRef::Map(entries) => {
            let events = map_get(entries, "events").ok_or_else(|| DecodeError::BatchShape {
                reason: "map without `events`".to_owned(),
            })?;
            let dp_rank =
                map_get(entries, "data_parallel_rank").or_else(|| map_get(entries, "dp_rank"));
            Ok((map_get(entries, "ts"), events, dp_rank))
        }
        other => Err(DecodeError::BatchShape {
            reason: format!("expected an array or map, got {}", kind_name(other)),
        }),
    }
}

fn map_get<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    key: &str,
) -> Option<&'v ValueRef<'a>> {
    entries.iter().find_map(|(k, v)| match k {
        ValueRef::String(s) if s.as_str() == Some(key) => Some(v),
        _ => None,
    })
}

fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn kind_name(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "bool",
        ValueRef::Integer(_) => "int",
        ValueRef::F32(_) | ValueRef::F64(_) => "float",
        ValueRef::String(_) => "str",
        ValueRef::Binary(_) => "bin",
        ValueRef::Array(_) => "array",
        ValueRef::Map(_) => "map",
        ValueRef::Ext(..) => "ext",
    }
}

/// Field access for both event encodings: by name in a map, by position in an array.
enum Fields<'v, 'a> {
    Map(&'v [(ValueRef<'a>, ValueRef<'a>)]),
    /// The array without its tag.
    Array(&'v [ValueRef<'a>]),
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field `name`, stored at `position` (1-based after the tag) in positional events.
    /// Nil counts as absent.
    fn get(&self, name: &str, position: usize) -> Option<&'v ValueRef<'a>> {
        let v = match self {
            Fields::Map(entries) => map_get(entries, name),
            Fields::Array(items) => position.checked_sub(1).and_then(|i| items.get(i)),
        };
        v.filter(|v| !matches!(v, ValueRef::Nil))
    }
}

// Positions of the fields in positional (array_like) events, after the tag.
const POS_HASHES: usize = 1;
const POS_PARENT: usize = 2;
const POS_TOKENS: usize = 3;
const POS_BLOCK_SIZE: usize = 4;
const POS_LORA_ID: usize = 5;
const POS_MEDIUM: usize = 6;
const POS_LORA_NAME: usize = 7;
const POS_REMOVED_MEDIUM: usize = 2;

fn decode_event(value: &ValueRef<'_>) -> Result<EngineEvent, DecodeError> {
    let (kind, fields) = match value {
        ValueRef::Map(entries) => {
            let kind = map_get(entries, "type").ok_or_else(|| DecodeError::EventShape {
                reason: "map without `type`".to_owned(),
            })?;
            (kind, Fields::Map(entries))
        }
        ValueRef::Array(items) => match items.split_first() {
            Some((kind, rest)) => (kind, Fields::Array(rest)),
            None => {
                return Err(DecodeError::EventShape {
                    reason: "empty array".to_owned(),
                })
            }
        },
        other => {
            return Err(DecodeError::EventShape {
                reason: format!("expected a map or array, got {}", kind_name(other)),
            })
        }
    };
    let ValueRef::String(kind) = kind else {
        return Err(DecodeError::EventShape {
            reason: format!("event tag is a {}, not a string", kind_name(kind)),
        });
    };
    match kind.as_str() {
        Some("BlockStored") => stored(&fields).map(EngineEvent::Stored),
        Some("BlockRemoved") => Ok(EngineEvent::Removed {
            block_hashes: hashes(&fields, "BlockRemoved")?,
            medium: opt_str(&fields, "BlockRemoved", "medium", POS_REMOVED_MEDIUM)?,
        }),
        Some("AllBlocksCleared") => Ok(EngineEvent::AllCleared),
        Some(other) => Err(DecodeError::UnknownEventType {
            kind: other.to_owned(),
        }),
        None => Err(DecodeError::EventShape {
            reason: "event tag is not UTF-8".to_owned(),
        }),
    }
}

fn stored(fields: &Fields<'_, '_>) -> Result<StoredBlocks, DecodeError> {
    const KIND: &str = "BlockStored";
    let field_err = |field: &'static str, reason: String| DecodeError::EventField {
        kind: KIND,
        field,
        reason,
    };
    let parent = fields
        .get("parent_block_hash", POS_PARENT)
        .map(|v| hash_value(v).map_err(|r| field_err("parent_block_hash", r)))
        .transpose()?;
    let token_ids = match fields.get("token_ids", POS_TOKENS) {
        None => Vec::new(),
        Some(ValueRef::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| field_err("token_ids", format!("{v} is not a u32 token id")))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(field_err(
                "token_ids",
                format!("{} is not an array", kind_name(other)),
            ))
        }
    };
    let block_size = fields
        .get("block_size", POS_BLOCK_SIZE)
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| field_err("block_size", format!("{v} is not a positive integer")))
        })
        .transpose()?;
    // lora_id is informative only (the filter salts by lora_name); tolerate odd values.
    let lora_id = fields.get("lora_id", POS_LORA_ID).and_then(|v| match v {
        ValueRef::Integer(i) => i.as_i64(),
        _ => None,
    });
    Ok(StoredBlocks {
        block_hashes: hashes(fields, KIND)?,
        parent,
        token_ids,
        block_size,
        lora_id,
        lora_name: opt_str(fields, KIND, "lora_name", POS_LORA_NAME)?,
        medium: opt_str(fields, KIND, "medium", POS_MEDIUM)?,
    })
}

fn hashes(fields: &Fields<'_, '_>, kind: &'static str) -> Result<Vec<u64>, DecodeError> {
    let err = |reason: String| DecodeError::EventField {
        kind,
        field: "block_hashes",
        reason,
    };
    match fields.get("block_hashes", POS_HASHES) {
        Some(ValueRef::Array(items)) => items.iter().map(|v| hash_value(v).map_err(err)).collect(),
        Some(other) => Err(err(format!("{} is not an array", kind_name(other)))),
        None => Err(err("absent".to_owned())),
    }
}

fn opt_str(
    fields: &Fields<'_, '_>,
    kind: &'static str,
    field: &'static str,
    position: usize,
) -> Result<Option<String>, DecodeError> {
    match fields.get(field, position) {
        None => Ok(None),
        Some(ValueRef::String(s)) => match s.as_str() {
            Some(s) => Ok(Some(s.to_owned())),
            None => Err(DecodeError::EventField {
                kind,
                field,
                reason: "not UTF-8".to_owned(),
            }),
        },
        Some(other) => Err(DecodeError::EventField {
            kind,
            field,
            reason: format!("{} is not a string", kind_name(other)),
        }),
    }
}

/// An engine block hash as a u64: unsigned as is, negative reinterpreted bit for bit, `bin`
/// folded to its first 8 bytes big-endian (zero-extended when shorter).
pub fn hash_value(v: &ValueRef<'_>) -> Result<u64, String> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| u64::from_ne_bytes(s.to_ne_bytes())))
            .ok_or_else(|| format!("{i} is not a 64-bit integer")),
        ValueRef::Binary(bytes) => Ok(fold_hash_bytes(bytes)),
        other => Err(format!("a {} is not a block hash", kind_name(other))),
    }
}

/// Folds a byte-string hash (vLLM's 32-byte sha256 digests) to u64: its first 8 bytes,
/// big-endian. Digests are uniformly distributed, so the prefix keeps them distinct.
pub fn fold_hash_bytes(bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    let n = bytes.len().min(8);
    // Right-align short inputs so that a short big-endian byte string keeps its value.
    if let (Some(dst), Some(src)) = (buf.get_mut(8 - n..), bytes.get(..n)) {
        dst.copy_from_slice(src);
    }
    u64::from_be_bytes(buf)
}

// ---------------------------------------------------------------------------------------------
// Encoding (vLLM 0.32, as msgspec writes it)
// ---------------------------------------------------------------------------------------------
//
// * A live message is 3 ZMQ frames: `[topic, seq (8-byte big-endian, from 0), payload]`.
// * The payload is a batch `array(3) [ts: float64, events: array, dp_rank: int]`.
// * Each event is a map whose first key is `type`, then its fields in vLLM's declaration order;
//   integers take their smallest msgpack encoding (hashes are u64, often `uint64`).
//   - `BlockStored`: type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//     medium, lora_name, extra_keys (`[nil] * blocks`), group_idx, kv_cache_spec_kind;
//   - `BlockRemoved`: type, block_hashes, medium, group_idx;
//   - `AllBlocksCleared`: type.
// * Replay (ROUTER; the client's DEALER sends `[b"", start_seq]`): one reply
//   `[b"", topic, seq, payload]` per buffered batch with `seq >= start_seq`, then the end marker
//   `[b"", b"", END_SEQ, b""]`.

/// vLLM's attention kind for a plain decoder model.
const KV_CACHE_SPEC_KIND: &str = "full_attention";

/// Why a batch could not be encoded.
#[derive(Debug)]
pub struct EncodeError(String);

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EncodeError {}

impl From<rmp::encode::ValueWriteError> for EncodeError {
    fn from(e: rmp::encode::ValueWriteError) -> Self {
        EncodeError(e.to_string())
    }
}

impl From<std::io::Error> for EncodeError {
    fn from(e: std::io::Error) -> Self {
        EncodeError(e.to_string())
    }
}

impl From<EncodeError> for std::io::Error {
    fn from(e: EncodeError) -> Self {
        std::io::Error::other(e.0)
    }
}

fn len_u32(len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError(format!("{len} items do not fit a msgpack array")))
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) -> Result<(), EncodeError> {
    rmp::encode::write_array_len(out, len_u32(hashes.len())?)?;
    for &h in hashes {
        rmp::encode::write_uint(out, h)?;
    }
    Ok(())
}

fn write_opt_str(out: &mut Vec<u8>, s: Option<&str>) -> Result<(), EncodeError> {
    match s {
        Some(s) => rmp::encode::write_str(out, s)?,
        None => rmp::encode::write_nil(out)?,
    }
    Ok(())
}

fn write_event(out: &mut Vec<u8>, event: &EngineEvent) -> Result<(), EncodeError> {
    use rmp::encode::{
        write_array_len, write_map_len, write_nil, write_sint, write_str, write_uint,
    };
    match event {
        EngineEvent::Stored(s) => {
            write_map_len(out, 11)?;
            write_str(out, "type")?;
            write_str(out, "BlockStored")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, &s.block_hashes)?;
            write_str(out, "parent_block_hash")?;
            match s.parent {
                Some(p) => {
                    write_uint(out, p)?;
                }
                None => write_nil(out)?,
            }
            write_str(out, "token_ids")?;
            write_array_len(out, len_u32(s.token_ids.len())?)?;
            for &t in &s.token_ids {
                write_uint(out, u64::from(t))?;
            }
            write_str(out, "block_size")?;
            match s.block_size {
                Some(b) => {
                    write_uint(out, b)?;
                }
                None => write_nil(out)?,
            }
            write_str(out, "lora_id")?;
            match s.lora_id {
                Some(id) => {
                    write_sint(out, id)?;
                }
                None => write_nil(out)?,
            }
            write_str(out, "medium")?;
            write_opt_str(out, s.medium.as_deref())?;
            write_str(out, "lora_name")?;
            write_opt_str(out, s.lora_name.as_deref())?;
            write_str(out, "extra_keys")?;
            write_array_len(out, len_u32(s.block_hashes.len())?)?;
            for _ in &s.block_hashes {
                write_nil(out)?;
            }
            write_str(out, "group_idx")?;
            write_uint(out, 0)?;
            write_str(out, "kv_cache_spec_kind")?;
            write_str(out, KV_CACHE_SPEC_KIND)?;
        }
        EngineEvent::Removed {
            block_hashes,
            medium,
        } => {
            write_map_len(out, 4)?;
            write_str(out, "type")?;
            write_str(out, "BlockRemoved")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, block_hashes)?;
            write_str(out, "medium")?;
            write_opt_str(out, medium.as_deref())?;
            write_str(out, "group_idx")?;
            write_uint(out, 0)?;
        }
        EngineEvent::AllCleared => {
            write_map_len(out, 1)?;
            write_str(out, "type")?;
            write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

/// One batch payload as vLLM 0.32 writes it: `[ts, [events...], dp_rank]`.
pub fn encode_batch(ts: f64, events: &[EngineEvent], dp_rank: u32) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64 + events.len() * 128);
    rmp::encode::write_array_len(&mut out, 3)?;
    rmp::encode::write_f64(&mut out, ts)?;
    rmp::encode::write_array_len(&mut out, len_u32(events.len())?)?;
    for event in events {
        write_event(&mut out, event)?;
    }
    rmp::encode::write_uint(&mut out, u64::from(dp_rank))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_written_bytes_decode_and_encoding_round_trips() {
        // [1.0, [["BlockStored", [7, -1], nil, [1, 2], 1, nil, "GPU"]], nil]: positional
        // (SGLang's shape), a signed hash, nil rank; written by hand, not by the encoder.
        let mut bytes = vec![0x93, 0xcb];
        bytes.extend_from_slice(&1.0f64.to_be_bytes());
        bytes.extend_from_slice(&[0x91, 0x97, 0xab]);
        bytes.extend_from_slice(b"BlockStored");
        bytes.extend_from_slice(&[0x92, 0x07, 0xff, 0xc0, 0x92, 0x01, 0x02, 0x01, 0xc0, 0xa3]);
        bytes.extend_from_slice(b"GPU");
        bytes.push(0xc0);
        let batch = decode_batch(&bytes, DEFAULT_MAX_PAYLOAD_BYTES).unwrap();
        let stored = StoredBlocks {
            block_hashes: vec![7, u64::MAX],
            parent: None,
            token_ids: vec![1, 2],
            block_size: Some(1),
            lora_id: None,
            lora_name: None,
            medium: Some("GPU".into()),
        };
        assert_eq!(batch.dp_rank, None);
        assert_eq!(batch.events, vec![EngineEvent::Stored(stored.clone())]);

        let events = vec![
            EngineEvent::Stored(StoredBlocks {
                parent: Some(3),
                lora_id: Some(-2),
                lora_name: Some("l".into()),
                ..stored
            }),
            EngineEvent::Removed {
                block_hashes: vec![1 << 40],
                medium: Some("CPU".into()),
            },
            EngineEvent::AllCleared,
        ];
        let payload = encode_batch(2.5, &events, 3).unwrap();
        let back = decode_batch(&payload, DEFAULT_MAX_PAYLOAD_BYTES).unwrap();
        assert_eq!((back.ts, back.dp_rank), (Some(2.5), Some(3)));
        assert_eq!(back.events, events);
        assert!(back.skipped.is_empty());
    }
}
