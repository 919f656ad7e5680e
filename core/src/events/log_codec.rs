//! The compact binary codec of the shared event log: batches of [`LogRecord`]s.

use super::binary::{tier_code, CodecError, Reader, Writer};
use super::{IndexEvent, NumberedEvent};
use crate::types::{ExternalBlockHash, LocalBlockHash};

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

/// One event; with `KEEP` false its blocks are read and checked but not kept (no allocation):
/// the check pass of [`check_log_batch`].
fn decode_event<const KEEP: bool>(r: &mut Reader<'_>) -> Result<NumberedEvent, CodecError> {
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
            let mut blocks = Vec::with_capacity(if KEEP { count } else { 0 });
            for _ in 0..count {
                let block = (ExternalBlockHash(r.u64()?), LocalBlockHash(r.u64()?));
                if KEEP {
                    blocks.push(block);
                }
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
            let mut blocks = Vec::with_capacity(if KEEP { count } else { 0 });
            for _ in 0..count {
                let block = ExternalBlockHash(r.u64()?);
                if KEEP {
                    blocks.push(block);
                }
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

/// Encodes one batch of the shared log: `"EKL"`, version, record count, records; little-endian.
pub fn encode_log_batch(records: &[LogRecord]) -> Vec<u8> {
    encode_log_batch_of(records.len(), records.iter())
}

/// [`encode_log_batch`] over borrowed records (a batch assembled from several replies without
/// copying their events).
pub fn encode_log_batch_refs(records: &[&LogRecord]) -> Vec<u8> {
    encode_log_batch_of(records.len(), records.iter().copied())
}

fn encode_log_batch_of<'a>(count: usize, records: impl Iterator<Item = &'a LogRecord>) -> Vec<u8> {
    let mut w = Writer::new();
    w.bytes.extend_from_slice(&LOG_MAGIC);
    w.u8(LOG_VERSION);
    w.len_prefix(count);
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

/// One item of a log batch, in order, as [`visit_log_batch`] reads it: a record's head, then
/// that record's events (none for `WorkerLost`).
#[derive(Debug)]
pub enum LogItem {
    Record(RecordHead),
    Event(NumberedEvent),
}

/// A record without its events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordHead {
    Events { worker: u16 },
    Resync { worker: u16, last_event_id: u64 },
    WorkerLost { worker: u16 },
}

/// Decodes a batch written by [`encode_log_batch`]; any truncation, unknown tag or trailing byte
/// is an error (never a panic).
pub fn decode_log_batch(bytes: &[u8]) -> Result<Vec<LogRecord>, CodecError> {
    let mut records: Vec<LogRecord> = Vec::new();
    visit_log_batch(bytes, |item| match item {
        LogItem::Record(RecordHead::Events { worker }) => records.push(LogRecord::Events {
            worker,
            events: Vec::new(),
        }),
        LogItem::Record(RecordHead::Resync {
            worker,
            last_event_id,
        }) => records.push(LogRecord::Resync {
            worker,
            last_event_id,
            events: Vec::new(),
        }),
        LogItem::Record(RecordHead::WorkerLost { worker }) => {
            records.push(LogRecord::WorkerLost { worker })
        }
        LogItem::Event(event) => {
            if let Some(LogRecord::Events { events, .. } | LogRecord::Resync { events, .. }) =
                records.last_mut()
            {
                events.push(event);
            }
        }
    })?;
    Ok(records)
}

/// Reads a batch item by item, handing each to `visit` as it is decoded: a replica applies a
/// batch of many events without holding all of them decoded at once (its linear memory keeps
/// its highest use for good). Items before a decoding error have been visited; see
/// [`decode_log_batch`] for the errors.
pub fn visit_log_batch(bytes: &[u8], visit: impl FnMut(LogItem)) -> Result<(), CodecError> {
    walk_log_batch::<true>(bytes, visit)
}

/// Whether a batch decodes to its end ([`decode_log_batch`]'s errors), reading every byte
/// without keeping any block.
pub fn check_log_batch(bytes: &[u8]) -> Result<(), CodecError> {
    walk_log_batch::<false>(bytes, |_| {})
}

fn walk_log_batch<const KEEP: bool>(
    bytes: &[u8],
    mut visit: impl FnMut(LogItem),
) -> Result<(), CodecError> {
    let mut r = Reader::new(bytes);
    r.header(LOG_MAGIC, LOG_VERSION)?;
    let count = r.count("records", MIN_RECORD_BYTES)?;
    for _ in 0..count {
        let offset = r.offset();
        let (head, has_events) = match r.u8()? {
            RECORD_EVENTS => (RecordHead::Events { worker: r.u16()? }, true),
            RECORD_RESYNC => (
                RecordHead::Resync {
                    worker: r.u16()?,
                    last_event_id: r.u64()?,
                },
                true,
            ),
            RECORD_WORKER_LOST => (RecordHead::WorkerLost { worker: r.u16()? }, false),
            value => {
                return Err(CodecError::InvalidTag {
                    field: "record",
                    value,
                    offset,
                })
            }
        };
        visit(LogItem::Record(head));
        if has_events {
            let events = r.count("events", MIN_EVENT_BYTES)?;
            for _ in 0..events {
                visit(LogItem::Event(decode_event::<KEEP>(&mut r)?));
            }
        }
    }
    r.finish()
}
