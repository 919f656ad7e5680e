//! Poll replies coalesced into one log batch per tick.
//!
//! Appending each reply on its own would use one ring slot and one head version per reply: with
//! 1,000 workers the 64-slot ring laps within a tick (replicas fall back to the snapshot) and
//! every request finds the head moved. The poller instead queues the replies that arrive within
//! a tick (or up to [`MAX_BATCH_BYTES`]) and appends them as ONE batch with ONE head edit, so a
//! tick takes one slot (a few if the replies are large), whatever the number of workers.
//!
//! Each queued reply keeps its own precondition (the entry's occupant generation; for a page,
//! the cursor it continues from), checked against the head inside the CAS edit: a reply another
//! poller made stale meanwhile is left out of the batch, the others go in. Replies for one worker
//! apply in arrival order, so a long poll re-issued from a queued cursor continues correctly.

use super::log::{append_with, LogHead};
use crate::events::{encode_log_batch_refs, LogRecord, ReportedLoad};
use crate::membership::description::WorkerDescription;
use crate::store::SharedStore;

/// A batch is appended as soon as its queued replies reach this size (bytes of the replies as
/// received, an upper bound of their encoded size), so a batch's value stays bounded.
pub const MAX_BATCH_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyKind {
    /// A dump: the worker continues from `last`, whatever its cursor was.
    Dump { last: u64 },
    /// A page after `after` (which must still be the worker's cursor), up to `cursor`.
    Page { after: u64, cursor: u64 },
}

/// One applied reply waiting for its tick's batch.
#[derive(Clone, Debug, PartialEq)]
pub struct QueuedReply {
    pub worker: u16,
    /// The occupant's membership generation the call was made for (0 without membership).
    pub generation: u64,
    pub kind: ReplyKind,
    pub at_ms: u64,
    pub reported: Option<ReportedLoad>,
    pub described: Option<WorkerDescription>,
    /// What the reply adds to the log (`None`: an empty page, a head update alone).
    pub record: Option<LogRecord>,
}

/// What one flush did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flushed {
    /// Replies in the batch.
    pub applied: usize,
    /// Replies left out: their precondition failed, or the append did not happen.
    pub dropped: usize,
}

#[derive(Debug, Default)]
pub struct Coalescer {
    queued: Vec<QueuedReply>,
    bytes: usize,
}

impl Coalescer {
    /// Queues a reply of `bytes`; true when the queue reached [`MAX_BATCH_BYTES`] (flush now).
    pub fn push(&mut self, reply: QueuedReply, bytes: usize) -> bool {
        self.queued.push(reply);
        self.bytes = self.bytes.saturating_add(bytes);
        self.bytes >= MAX_BATCH_BYTES
    }

    pub fn len(&self) -> usize {
        self.queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// The cursor the worker's next page continues from if a reply for it is queued (the head
    /// does not have it yet).
    pub fn cursor(&self, worker: u16) -> Option<u64> {
        self.queued
            .iter()
            .rev()
            .find(|r| r.worker == worker)
            .map(|r| match r.kind {
                ReplyKind::Dump { last } => last,
                ReplyKind::Page { cursor, .. } => cursor,
            })
    }

    /// Drops the worker's queued replies (a new occupant took its entry).
    pub fn forget(&mut self, worker: u16) {
        self.queued.retain(|r| r.worker != worker);
    }

    /// Appends every queued reply whose precondition holds as one batch with one head edit.
    pub fn flush(
        &mut self,
        store: &dyn SharedStore,
        fingerprint: u64,
        workers: usize,
        now_ms: u64,
    ) -> Flushed {
        let queued = std::mem::take(&mut self.queued);
        self.bytes = 0;
        if queued.is_empty() {
            return Flushed::default();
        }
        let mut applied = 0;
        let appended = append_with(store, fingerprint, workers, now_ms, |head| {
            let mut records: Vec<&LogRecord> = Vec::new();
            applied = 0;
            for reply in &queued {
                if apply(head, reply) {
                    applied += 1;
                    records.extend(reply.record.as_ref());
                }
            }
            if applied == 0 {
                return None;
            }
            Some((!records.is_empty()).then(|| encode_log_batch_refs(&records)))
        });
        if !appended {
            applied = 0;
        }
        Flushed {
            applied,
            dropped: queued.len() - applied,
        }
    }
}

/// Applies one reply's head edit if its precondition holds.
fn apply(head: &mut LogHead, reply: &QueuedReply) -> bool {
    if head.member_generation(reply.worker) != reply.generation {
        return false; // the entry has another occupant now
    }
    let Some(w) = head.workers.get_mut(usize::from(reply.worker)) else {
        return false;
    };
    match reply.kind {
        ReplyKind::Dump { last } => w.cursor = Some(last),
        ReplyKind::Page { after, cursor } => {
            if w.cursor != Some(after) {
                return false; // another poller moved it: this page is stale
            }
            w.cursor = Some(cursor);
            w.rejections = 0;
            w.retry_after_ms = 0;
        }
    }
    w.last_ok_ms = w.last_ok_ms.max(reply.at_ms);
    w.stale = false;
    w.reported = reply.reported;
    if let Some(d) = &reply.described {
        crate::membership::set_description(head, reply.worker, d);
    }
    true
}
