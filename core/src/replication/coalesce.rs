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
use crate::store::SharedStore;
use crate::worker_description::WorkerDescription;

/// A batch is appended as soon as its queued replies reach this size (bytes of the replies as
/// received, an upper bound of their encoded size), so a batch's value stays bounded: every
/// replica copies each batch into its linear memory, which keeps its peak, and Envoy's
/// tcmalloc keeps freed copies in each thread's cache. The page size,
/// `polling::PAGE_MAX_BYTES`, is the same: a page is one reply, never split, so a lower bound
/// here would not make one worker's batches smaller (each full page already flushes alone),
/// only cut many small replies into more batches (more ring slots per tick). Going from
/// 256 KiB to 128 KiB (pages and batches) took a replica at 100k entries from 39.1-44.3 to
/// 37.6-37.7 B per entry (see `polling::PAGE_MAX_BYTES`).
pub const MAX_BATCH_BYTES: usize = 1 << 17;

/// Batches appended at once from the reply callback per tick, before replies wait for the tick:
/// with a few workers every reply is routable the moment it arrives, with many the tick's replies
/// share one more batch. At most `1 + EARLY_FLUSHES_PER_TICK` ring slots per tick (plus any
/// byte-budget flushes), whatever the number of workers.
pub const EARLY_FLUSHES_PER_TICK: u32 = 2;

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
    /// Dumps among the applied replies.
    pub resyncs: usize,
    /// Events of the applied pages (dumps not included).
    pub events: usize,
}

#[derive(Debug, Default)]
pub struct Coalescer {
    queued: Vec<QueuedReply>,
    bytes: usize,
    /// Flushes since the last [`Coalescer::new_tick`].
    flushes_this_tick: u32,
}

impl Coalescer {
    /// Queues a reply of `bytes`; true when the caller should flush now: the queue reached
    /// [`MAX_BATCH_BYTES`], or this tick has not used its [`EARLY_FLUSHES_PER_TICK`] yet.
    pub fn push(&mut self, reply: QueuedReply, bytes: usize) -> bool {
        self.queued.push(reply);
        self.bytes = self.bytes.saturating_add(bytes);
        self.bytes >= MAX_BATCH_BYTES || self.flushes_this_tick < EARLY_FLUSHES_PER_TICK
    }

    /// The tick's own flush is done: the next replies may be flushed early again.
    pub fn new_tick(&mut self) {
        self.flushes_this_tick = 0;
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
        self.flushes_this_tick = self.flushes_this_tick.saturating_add(1);
        let mut done = Flushed::default();
        let appended = append_with(store, fingerprint, workers, now_ms, |head| {
            let mut records: Vec<&LogRecord> = Vec::new();
            done = Flushed::default();
            for reply in &queued {
                if apply(head, reply) {
                    done.applied += 1;
                    match (&reply.kind, &reply.record) {
                        (ReplyKind::Dump { .. }, _) => done.resyncs += 1,
                        (_, Some(LogRecord::Events { events, .. })) => done.events += events.len(),
                        _ => {}
                    }
                    records.extend(reply.record.as_ref());
                }
            }
            if done.applied == 0 {
                return None;
            }
            Some((!records.is_empty()).then(|| encode_log_batch_refs(&records)))
        });
        if !appended {
            done = Flushed::default();
        }
        done.dropped = queued.len() - done.applied;
        done
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
        super::head::set_description(head, reply.worker, d);
    }
    true
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::events::{IndexEvent, NumberedEvent};
    use crate::replication::log::{append, init, read_head, Replica, LOG_SLOTS};
    use crate::store::fake::{MemStore, Op};
    use crate::types::{ExternalBlockHash, LocalBlockHash, StorageTier};
    use std::cell::Cell;
    use std::rc::Rc;

    const FP: u64 = 42;

    fn config(workers: usize) -> Config {
        let list: Vec<String> = (0..workers)
            .map(|i| {
                format!(
                    r#"{{"id": {}, "address": "10.0.{}.{}:8000"}}"#,
                    i + 1,
                    i / 250,
                    i % 250 + 1
                )
            })
            .collect();
        Config::from_json(format!(r#"{{"workers": [{}]}}"#, list.join(",")).as_bytes()).unwrap()
    }

    /// Event `id` of `worker`: stores one block unique to (worker, id).
    fn event(worker: u16, id: u64) -> NumberedEvent {
        let hash = (u64::from(worker) << 32) | id;
        NumberedEvent {
            event_id: id,
            event: IndexEvent::Stored {
                dp_rank: 0,
                tier: StorageTier::Device,
                parent: None,
                blocks: vec![(ExternalBlockHash(hash), LocalBlockHash(hash))],
            },
        }
    }

    fn load(running: u32) -> Option<ReportedLoad> {
        Some(ReportedLoad {
            num_waiting: 0,
            num_running: running,
            kv_usage: 0.5,
            other_routers: None,
        })
    }

    /// A page of `worker` carrying events `after+1..=cursor`.
    fn page(worker: u16, after: u64, cursor: u64, at_ms: u64) -> QueuedReply {
        let events: Vec<_> = (after + 1..=cursor).map(|id| event(worker, id)).collect();
        QueuedReply {
            worker,
            generation: 0,
            kind: ReplyKind::Page { after, cursor },
            at_ms,
            reported: load(u32::try_from(cursor).unwrap()),
            described: None,
            record: (!events.is_empty()).then_some(LogRecord::Events { worker, events }),
        }
    }

    fn dump(worker: u16, last: u64, at_ms: u64) -> QueuedReply {
        QueuedReply {
            worker,
            generation: 0,
            kind: ReplyKind::Dump { last },
            at_ms,
            reported: load(0),
            described: None,
            record: Some(LogRecord::Resync {
                worker,
                last_event_id: last,
                events: (1..=last).map(|id| event(worker, id)).collect(),
            }),
        }
    }

    /// 1,000 workers answer every tick (a dump, then pages of 2 events); the poller appends
    /// each tick's replies as one batch. A replica that syncs once per tick applies every event
    /// of every tick in order: the 64-slot ring never laps, no snapshot, no lost sync.
    #[test]
    fn a_thousand_workers_per_tick_take_one_slot_and_a_replica_never_falls_behind() {
        const WORKERS: u16 = 1000;
        const TICKS: u64 = 3 * LOG_SLOTS / 2; // past the ring's size: slots are reused
        let config = config(usize::from(WORKERS));
        let store = MemStore::new();
        init(&store);
        let mut replica = Replica::new(&config, FP);
        let mut poller = Coalescer::default();
        let mut cursors = vec![None::<u64>; usize::from(WORKERS)];
        let mut expected_blocks = 0;
        for tick in 0..TICKS {
            let now = tick * 50;
            for worker in 0..WORKERS {
                let reply = match cursors[usize::from(worker)] {
                    None => dump(worker, 1, now),
                    Some(after) => page(worker, after, after + 2, now),
                };
                cursors[usize::from(worker)] = Some(match reply.kind {
                    ReplyKind::Dump { last } => last,
                    ReplyKind::Page { cursor, .. } => cursor,
                });
                // As the filter does: the first replies of a tick go at once, the rest wait
                // (1,000 pages of 100 bytes stay under `MAX_BATCH_BYTES`).
                if poller.push(reply, 100) {
                    let early = poller.flush(&store, FP, usize::from(WORKERS), now);
                    assert_eq!((early.applied, early.dropped), (1, 0));
                }
            }
            let flushed = poller.flush(&store, FP, usize::from(WORKERS), now);
            poller.new_tick();
            let early = u64::from(EARLY_FLUSHES_PER_TICK);
            assert_eq!(
                flushed.applied as u64,
                1000 - early,
                "tick {tick}: the rest in one batch"
            );
            expected_blocks += if tick == 0 { 1000 } else { 2000 };

            let report = replica.sync(&store, &config, now + 10);
            assert_eq!(
                (report.batches, report.snapshot_loaded, report.lost_sync),
                (early + 1, false, false),
                "tick {tick}: three batches, applied from the ring"
            );
            assert_eq!(report.events_applied, if tick == 0 { 1000 } else { 2000 });
            assert_eq!(replica.index.entries(), expected_blocks, "tick {tick}");
        }
        let (head, _) = read_head(&store).unwrap();
        assert_eq!(
            head.seq,
            TICKS * (1 + u64::from(EARLY_FLUSHES_PER_TICK)),
            "three ring slots per tick"
        );
        assert!(head
            .workers
            .iter()
            .zip(&cursors)
            .all(|(w, c)| w.cursor == *c && !w.stale));
        assert!(
            store.key_count() <= 3 + LOG_SLOTS as usize,
            "the key set stays fixed"
        );
    }

    /// The same tick appended reply by reply (the old poller) laps the ring: a replica syncing
    /// once per tick falls back, and without a snapshot reports lost sync. The fallback stays.
    #[test]
    fn a_tick_appended_reply_by_reply_laps_the_ring_and_the_fallback_still_works() {
        let config = config(1000);
        let store = MemStore::new();
        init(&store);
        let mut replica = Replica::new(&config, FP);
        for worker in 0..1000u16 {
            let reply = dump(worker, 1, 0);
            let mut one = Coalescer::default();
            one.push(reply, 300);
            assert_eq!(one.flush(&store, FP, 1000, 0).applied, 1);
        }
        let report = replica.sync(&store, &config, 10);
        assert!(report.lost_sync && !report.snapshot_loaded);
        assert_eq!(report.batches, LOG_SLOTS - 1, "what the ring still holds");
        assert_eq!(replica.applied_seq, 1000);
    }

    /// Replies whose cursor or occupant another poller changed meanwhile are left out; the
    /// others of the tick still go in, in one batch.
    #[test]
    fn a_stale_reply_is_left_out_and_the_rest_of_the_tick_goes_in() {
        let config = config(3);
        let store = MemStore::new();
        init(&store);
        let mut q = Coalescer::default();
        for w in 0..3 {
            q.push(dump(w, 1, 0), 10);
        }
        assert_eq!(q.flush(&store, FP, 3, 0).applied, 3);
        // Another poller already moved worker 1 to 5.
        assert!(append(&store, FP, 3, 0, &[], |head| {
            head.workers[1].cursor = Some(5);
            true
        }));
        q.push(page(0, 1, 3, 100), 10);
        q.push(page(1, 1, 3, 100), 10); // continues from 1: stale
        q.push(page(2, 1, 2, 100), 10);
        let flushed = q.flush(&store, FP, 3, 100);
        assert_eq!(
            (flushed.applied, flushed.dropped, flushed.events),
            (2, 1, 3)
        );
        let (head, _) = read_head(&store).unwrap();
        let cursors: Vec<_> = head.workers.iter().map(|w| w.cursor).collect();
        assert_eq!(cursors, vec![Some(3), Some(5), Some(2)]);
        let mut replica = Replica::new(&config, FP);
        replica.sync(&store, &config, 200);
        assert_eq!(
            replica.index.entries(),
            3 + 2 + 1,
            "dumps, then worker 0's 2 and 2's 1"
        );
    }

    /// A long poll re-issued from a queued cursor: the dump and the pages after it, all queued in
    /// one tick, apply in order in one batch.
    #[test]
    fn pages_chained_on_a_queued_cursor_apply_in_order() {
        let store = MemStore::new();
        init(&store);
        let mut q = Coalescer::default();
        q.push(dump(0, 4, 0), 10);
        assert_eq!(q.cursor(0), Some(4));
        q.push(page(0, 4, 6, 1), 10);
        assert_eq!(q.cursor(0), Some(6));
        q.push(page(0, 6, 9, 2), 10);
        assert_eq!(q.cursor(1), None);
        assert_eq!(q.flush(&store, FP, 2, 3).applied, 3);
        let (head, _) = read_head(&store).unwrap();
        assert_eq!((head.seq, head.workers[0].cursor), (1, Some(9)));
        assert!(q.is_empty());
    }

    /// Replies that change only poll state (empty pages, same reported load) move neither the
    /// log nor the head's version: requests have nothing to re-read.
    #[test]
    fn empty_pages_with_unchanged_load_leave_the_request_path_alone() {
        let config = config(4);
        let store = MemStore::new();
        init(&store);
        let mut q = Coalescer::default();
        for w in 0..4 {
            q.push(dump(w, 2, 0), 10);
        }
        q.flush(&store, FP, 4, 0);
        let mut replica = Replica::new(&config, FP);
        replica.sync(&store, &config, 0);
        assert!(!replica.is_behind(&store));
        for tick in 1..5 {
            for w in 0..4 {
                let mut reply = page(w, 2, 2, tick * 50);
                reply.reported = load(0);
                q.push(reply, 10);
            }
            assert_eq!(q.flush(&store, FP, 4, tick * 50).applied, 4);
            assert!(
                !replica.is_behind(&store),
                "tick {tick}: nothing to re-read"
            );
        }
        let (head, _) = read_head(&store).unwrap();
        assert_eq!(head.workers[3].last_ok_ms, 200, "the poll state did move");
        // A load change is routing state: the version moves.
        q.push(page(1, 2, 2, 300), 10);
        q.flush(&store, FP, 4, 300);
        assert!(replica.is_behind(&store));
    }

    /// A lease hand-over: the old poller flushes its tick while the new one flushes the same
    /// workers' replies, interleaved at every store operation. Each page lands exactly once.
    #[test]
    fn two_pollers_flushing_the_same_tick_append_each_page_once() {
        let config = config(2);
        let probe = MemStore::new();
        init(&probe);
        let before = probe.ops.get();
        let mut q = Coalescer::default();
        q.push(dump(0, 1, 0), 10);
        q.flush(&probe, FP, 2, 0);
        let steps = probe.ops.get() - before;
        for at in 1..=steps + 1 {
            let store = MemStore::new();
            init(&store);
            let seen = Rc::new(Cell::new(0usize));
            let new_result = Rc::new(Cell::new(None));
            let (seen_h, new_h) = (Rc::clone(&seen), Rc::clone(&new_result));
            let new_poller_flush = |s: &MemStore| {
                let mut new_poller = Coalescer::default();
                new_poller.push(page(0, 0, 2, 5), 10);
                new_poller.push(dump(1, 3, 5), 10);
                new_poller.flush(s, FP, 2, 5)
            };
            store.set_hook(move |s: &MemStore, _op: &Op| {
                seen_h.set(seen_h.get() + 1);
                if seen_h.get() == at {
                    new_h.set(Some(new_poller_flush(s)));
                }
            });
            let mut old_poller = Coalescer::default();
            old_poller.push(dump(0, 0, 1), 10);
            old_poller.push(page(0, 0, 2, 1), 10);
            let old = old_poller.flush(&store, FP, 2, 1);
            store.clear_hook();
            let new = new_result.get().unwrap_or_else(|| new_poller_flush(&store));
            let mut replica = Replica::new(&config, FP);
            replica.sync(&store, &config, 10);
            let (head, _) = read_head(&store).unwrap();
            assert_eq!(head.workers[0].cursor, Some(2), "op {at}");
            assert_eq!(head.workers[1].cursor, Some(3), "op {at}");
            // Worker 0's events 1..=2 once, worker 1's dump once.
            assert_eq!(
                replica.index.entries(),
                2 + 3,
                "op {at}: old {old:?}, new {new:?}"
            );
        }
    }
}
