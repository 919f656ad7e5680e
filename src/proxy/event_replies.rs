//! The poller's side of the event calls: a worker's page or dump applied to the shared log
//! (coalesced per tick), the call's schedule after it, rejected pages, orphaned batches, and
//! workers whose events stopped coming (stale).

use super::host::HostStore;
use super::metrics::EventKinds;
use super::poller::PendingCall;
use super::vm::{worker_id, VmState};
use crate::events::{encode_log_batch, parse_dump, parse_event_page, EventError, LogRecord};
use crate::polling::{is_gap, CallKind, Next, ReplyOutcome};
use crate::replication::coalesce::{QueuedReply, ReplyKind};
use crate::replication::lease::holds_lease;
use crate::replication::log as replication;
use crate::text::{excerpt, MAX_EXCERPT_BYTES};
use log::{error, info, warn};
use std::rc::Rc;

impl VmState {
    /// Applies one page or dump to the log and says how it went.
    pub(super) fn handle_events_reply(
        &mut self,
        call: PendingCall,
        body: &[u8],
        now: u64,
    ) -> ReplyOutcome {
        let config = Rc::clone(&self.path.config);
        let worker = call.worker;
        let block_size = config.block_size;
        let max_bytes = config.events.max_response_bytes;
        let parsed = match call.kind {
            CallKind::Events { .. } => parse_event_page(body, block_size, max_bytes),
            CallKind::Dump => parse_dump(body, block_size, max_bytes),
        };
        let page = match parsed {
            Ok(page) => page,
            Err(err) => {
                self.reject_page(worker, &err);
                return ReplyOutcome::Rejected;
            }
        };
        let reported = page.load;
        let described = self.vet_description(worker, &page);
        let (queued, outcome) = match call.kind {
            CallKind::Dump => {
                let last = page.last_event_id;
                let events_count = page.events.len() as u64;
                info!(
                    "kv-router: re-syncing worker {} from its dump ({} blocks events, cursor {})",
                    worker_id(&config, worker),
                    events_count,
                    last
                );
                let record = LogRecord::Resync {
                    worker,
                    last_event_id: last,
                    events: page.events,
                };
                let reply = QueuedReply {
                    worker,
                    generation: call.generation,
                    kind: ReplyKind::Dump { last },
                    at_ms: now,
                    reported,
                    described,
                    record: Some(record),
                };
                let outcome = ReplyOutcome::Applied {
                    new_events: events_count > 0,
                    more: false,
                };
                (reply, outcome)
            }
            CallKind::Events { after } => {
                if is_gap(&page, after) {
                    self.metrics.inc("events.gaps");
                    warn!(
                        "kv-router: worker {} lost events after id {} (first buffered {:?}, last {}); re-syncing from its dump",
                        worker_id(&config, worker),
                        after,
                        page.first_event_id,
                        page.last_event_id
                    );
                    return ReplyOutcome::Gap;
                }
                let events: Vec<_> = page
                    .events
                    .into_iter()
                    .filter(|e| e.event_id > after)
                    .collect();
                let cursor = events.last().map_or(after, |e| e.event_id);
                let more = page.last_event_id > cursor;
                let count = events.len() as u64;
                self.metrics.add_event_kinds(EventKinds::of(&events));
                let reply = QueuedReply {
                    worker,
                    generation: call.generation,
                    kind: ReplyKind::Page { after, cursor },
                    at_ms: now,
                    reported,
                    described,
                    record: (!events.is_empty()).then_some(LogRecord::Events { worker, events }),
                };
                let outcome = ReplyOutcome::Applied {
                    new_events: count > 0,
                    more,
                };
                (reply, outcome)
            }
        };
        // At once for the tick's first replies, else with the tick's other replies in one batch
        // (see `replication::coalesce`), or when the queue is full.
        // A new description is flushed at once: the membership it changes (which models the
        // worker serves) is what `membership.described` announces.
        let describes = queued.described.is_some();
        if self.poller.queued.push(queued, body.len()) || describes {
            self.flush_replies(now);
        }
        if let Some(flag) = self.block_size_warned.get_mut(usize::from(worker)) {
            *flag = false;
        }
        outcome
    }

    /// Appends the queued poll replies as one batch and applies it.
    pub(super) fn flush_replies(&mut self, now: u64) {
        if self.poller.queued.is_empty() {
            return;
        }
        let workers = self.path.config.workers.len();
        let flushed = self
            .poller
            .queued
            .flush(&HostStore, self.fingerprint, workers, now);
        // Counted once in the log, so a counter never runs ahead of what requests can see.
        self.metrics.add("events.resyncs", flushed.resyncs as u64);
        self.metrics.add("events.received", flushed.events as u64);
        self.metrics
            .add("log.replies_batched", flushed.applied as u64);
        self.metrics
            .add("log.replies_dropped", flushed.dropped as u64);
        self.sync_replica();
    }

    /// Schedules the worker's next call; sends it at once when it is due now and this VM is
    /// still the poller (a long poll is re-issued the moment its reply is in).
    pub(super) fn after_reply(&mut self, call: PendingCall, outcome: ReplyOutcome, now: u64) {
        let config = Rc::clone(&self.path.config);
        let worker = call.worker;
        match self.poller.replied(&config, worker, outcome, now) {
            Next::Backoff { ms, rejections } => {
                self.metrics.inc("events.backoff");
                let retry_after_ms = now.saturating_add(ms);
                replication::update_head(
                    &HostStore,
                    self.fingerprint,
                    config.workers.len(),
                    now,
                    |head| {
                        if head.member_generation(worker) != call.generation {
                            return false;
                        }
                        let Some(w) = head.workers.get_mut(usize::from(worker)) else {
                            return false;
                        };
                        w.rejections = rejections;
                        w.retry_after_ms = retry_after_ms;
                        true
                    },
                );
                warn!(
                    "kv-router: worker {}: {rejections} event replies refused (or gaps its dump did not close) since its last good page; next fetch in {ms} ms",
                    worker_id(&config, worker)
                );
            }
            Next::Now if holds_lease(&HostStore, self.path.nonce, now) => {
                // The dump if the reply showed a gap, else the next page (a long poll).
                self.poller
                    .dispatch_next(&config, &self.path.replica.head, worker, now);
            }
            Next::Now | Next::After { .. } => {}
        }
    }

    pub(super) fn reject_page(&mut self, worker: u16, err: &EventError) {
        let id = worker_id(&self.path.config, worker);
        self.metrics.inc("events.pages_rejected");
        let text = err.to_string();
        let text = excerpt(&text, MAX_EXCERPT_BYTES * 2);
        match err {
            EventError::BlockSizeMismatch { .. } => {
                self.metrics.inc("events.block_size_mismatch");
                let warned = self
                    .block_size_warned
                    .get(usize::from(worker))
                    .copied()
                    .unwrap_or(false);
                if !warned {
                    error!(
                        "kv-router: worker {id}: {text}. Its KV events are ignored until the filter's block_size matches the engine's KV block size."
                    );
                    if let Some(flag) = self.block_size_warned.get_mut(usize::from(worker)) {
                        *flag = true;
                    }
                }
                return;
            }
            EventError::TooLarge { .. } => self.metrics.inc("events.pages_too_large"),
            EventError::InvalidEventId { .. }
            | EventError::NonIncreasingEventId { .. }
            | EventError::LastEventIdBehind { .. }
            | EventError::FirstEventIdAhead { .. } => {
                self.metrics.inc("events.protocol_errors");
            }
            _ => {}
        }
        warn!("kv-router: rejected an event page from worker {id}: {text}");
    }

    /// A batch claimed but never written blocks every replica; the poller fills it.
    pub(super) fn fill_orphaned_batch(&mut self, now: u64) {
        let Some(seq) = self.path.replica.orphaned_batch(now) else {
            return;
        };
        let workers = self.path.config.workers.len();
        if replication::fill_orphan(&HostStore, self.fingerprint, workers, now, seq) {
            self.metrics.inc("log.orphans_filled");
            error!(
                "kv-router: event log batch {seq} was claimed but never written (its VM died?); filled it, every worker re-syncs from its dump"
            );
        }
        self.sync_replica();
    }

    /// A worker whose events could not be fetched for `stale_after_ms` loses its blocks.
    pub(super) fn mark_stale_workers(&mut self, now: u64) {
        let config = Rc::clone(&self.path.config);
        let stale_after = config.events.stale_after_ms;
        let lost: Vec<u16> = self
            .path
            .replica
            .head
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| !w.stale && now.saturating_sub(w.last_ok_ms) > stale_after)
            // A worker without events (approximate only, or a vacant membership entry) is never
            // stale: nothing is expected from it.
            .filter(|(i, _)| {
                config
                    .workers
                    .get(*i)
                    .is_some_and(|w| w.kv_mode.has_events() && !w.is_vacant())
            })
            .filter_map(|(i, _)| u16::try_from(i).ok())
            .collect();
        if lost.is_empty() {
            return;
        }
        // One batch for every worker that went silent (a network split can silence them all).
        let mut marked: Vec<u16> = Vec::new();
        let appended = replication::append_with(
            &HostStore,
            self.fingerprint,
            config.workers.len(),
            now,
            |head| {
                marked.clear();
                for &worker in &lost {
                    let Some(w) = head.workers.get_mut(usize::from(worker)) else {
                        continue;
                    };
                    if w.stale || now.saturating_sub(w.last_ok_ms) <= stale_after {
                        continue;
                    }
                    w.stale = true;
                    w.cursor = None;
                    w.reported = None;
                    marked.push(worker);
                }
                if marked.is_empty() {
                    return None;
                }
                let records: Vec<LogRecord> = marked
                    .iter()
                    .map(|&worker| LogRecord::WorkerLost { worker })
                    .collect();
                Some(Some(encode_log_batch(&records)))
            },
        );
        if appended {
            for worker in marked {
                self.metrics.inc("workers.marked_stale");
                warn!(
                    "kv-router: no KV events from worker {} for {} ms: its cached blocks are dropped and it is routed on load alone until its events return",
                    worker_id(&config, worker),
                    stale_after
                );
            }
        }
        self.sync_replica();
    }
}
