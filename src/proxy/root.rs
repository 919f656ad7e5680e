//! The root context: one per VM (each Envoy worker thread, plus the main thread).
//!
//! It compiles the configuration once, owns the VM's state (index replica, selector, metrics) that
//! request contexts share, and on every tick: applies new log batches, and, if it holds the poller
//! lease, polls worker events, marks silent workers stale and reaps abandoned load entries.

use super::envoy_host::EnvoyHost;
use super::host::{self, HostStore};
use super::http::RequestContext;
use super::metrics::{EventKinds, Metrics};
use super::poller::{PendingCall, Poller};
use super::vm::{worker_id, VmState};
use crate::approx;
use crate::config::Config;
use crate::events::{encode_log_batch, parse_dump, parse_event_page, EventError, LogRecord};
use crate::load_store;
use crate::polling::{disposition, is_gap, CallKind, Disposition, Next, ReplyOutcome};
use crate::replication::coalesce::{QueuedReply, ReplyKind};
use crate::replication::lease::{hold_lease, holds_lease};
use crate::replication::log as replication;
use crate::request_path::RoutingState;
use crate::text::{excerpt, MAX_EXCERPT_BYTES};
use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub struct RouterRoot {
    context_id: u32,
    state: Option<Rc<RefCell<VmState>>>,
}

impl RouterRoot {
    pub fn new(context_id: u32) -> Self {
        RouterRoot {
            context_id,
            state: None,
        }
    }
}

impl Context for RouterRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(state) = &self.state else { return };
        let Ok(mut vm) = state.try_borrow_mut() else {
            return;
        };
        let now = host::now_ms();
        if vm.membership_reply(token_id, num_headers, body_size, now) {
            return;
        }
        let Some(call) = vm.poller.take(token_id) else {
            return;
        };
        let status = if num_headers == 0 {
            None
        } else {
            host::header(MapType::HttpCallResponseHeaders, ":status")
        };
        let max_bytes = vm.path.config.events.max_response_bytes;
        // The size is known before the body is copied into the VM: an oversized page never is.
        let outcome = match disposition(status.as_deref(), body_size, max_bytes) {
            Disposition::Failed => {
                vm.metrics.inc("events.fetch_failed");
                log::debug!(
                    "kv-router: event fetch from worker {} failed: {}",
                    worker_id(&vm.path.config, call.worker),
                    status
                        .as_deref()
                        .unwrap_or("no response (connect failure or timeout)")
                );
                ReplyOutcome::Failed
            }
            Disposition::TooLarge { body_bytes } => {
                vm.reject_page(
                    call.worker,
                    &EventError::TooLarge {
                        body_bytes,
                        max_bytes,
                    },
                );
                ReplyOutcome::Rejected
            }
            Disposition::Read => {
                let body =
                    host::buffer(BufferType::HttpCallResponseBody, body_size).unwrap_or_default();
                vm.handle_events_reply(call, &body, now)
            }
        };
        vm.after_reply(call, outcome, now);
    }

    fn on_done(&mut self) -> bool {
        // A VM torn down (a configuration change) takes its memory out of the process-wide sum.
        if let Some(Ok(mut vm)) = self.state.as_ref().map(|s| s.try_borrow_mut()) {
            let reported = vm.linear_memory_reported as i64;
            vm.metrics.gauge_add("vm.linear_memory_bytes", -reported);
            vm.linear_memory_reported = 0;
        }
        true
    }
}

impl VmState {
    /// Applies one page or dump to the log and says how it went.
    fn handle_events_reply(&mut self, call: PendingCall, body: &[u8], now: u64) -> ReplyOutcome {
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
    fn flush_replies(&mut self, now: u64) {
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
    fn after_reply(&mut self, call: PendingCall, outcome: ReplyOutcome, now: u64) {
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

    fn reject_page(&mut self, worker: u16, err: &EventError) {
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

    /// Applies new log batches and records what happened.
    pub fn sync_replica(&mut self) {
        let mut host = EnvoyHost {
            metrics: &mut self.metrics,
            histograms: &mut self.histogram_ids,
        };
        self.path.sync_replica(&mut host);
    }

    /// Applies the routing decisions other VMs published since the last sync.
    pub fn sync_predictions(&mut self, now: u64) {
        let mut host = EnvoyHost {
            metrics: &mut self.metrics,
            histograms: &mut self.histogram_ids,
        };
        self.path.sync_predictions(&mut host, now);
    }

    fn tick(&mut self) {
        self.metrics.flush();
        let now = host::now_ms();
        let config = Rc::clone(&self.path.config);
        if !self.path.releases.is_empty() {
            self.path.releases.flush(&HostStore, config.slots.len());
        }
        let dropped = std::mem::take(&mut self.path.releases.dropped);
        self.metrics.add("load.release_dropped", dropped);
        let lease_ms = (config.events.poll_interval_ms * 5)
            .max(config.tick_ms * 10)
            .max(1000);
        let leader = hold_lease(&HostStore, self.path.nonce, now, lease_ms);
        // The poller reads cursors from its replica's head: it decodes the whole head.
        self.path.replica.full_head = leader;
        // Replies queued since the last tick, as one batch (also after losing the lease: their
        // preconditions keep a late append from undoing the new poller's work).
        self.flush_replies(now);
        self.poller.queued.new_tick();
        self.sync_replica();
        self.sync_predictions(now);
        self.refresh_learned(&config, now);
        // Every VM adds its own share; the other gauges are the leader's alone.
        self.publish_linear_memory();
        if !leader {
            // Another VM records the gauges meanwhile: on taking the lease back, record all.
            self.slot_gauges.clear();
            return;
        }
        self.fill_orphaned_batch(now);
        self.poll_membership(now);
        self.mark_stale_workers(now);
        let head = self.path.replica.head.clone();
        // The membership may have moved during this tick: poll with the configuration as it is.
        let config = Rc::clone(&self.path.config);
        self.poller.dispatch_due(&config, &head, now);
        self.path.replica.maybe_write_snapshot(&HostStore);
        self.publish_gauges(now);
    }

    /// A batch claimed but never written blocks every replica; the poller fills it.
    fn fill_orphaned_batch(&mut self, now: u64) {
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
    fn mark_stale_workers(&mut self, now: u64) {
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

    fn publish_gauges(&mut self, now: u64) {
        let config = Rc::clone(&self.path.config);
        let slots = config.slots.len();
        let reaped = load_store::reap(&HostStore, slots, now, config.load.request_timeout_ms);
        self.metrics.add("load.reaped", reaped as u64);
        // Bytes first: a reader that sees the entries sees the bytes of the same tick.
        self.metrics.gauge(
            "index.bytes",
            self.path.replica.index.allocated_bytes() as u64,
        );
        self.metrics
            .gauge("index.entries", self.path.replica.index.entries() as u64);
        let stale = self
            .path
            .replica
            .head
            .workers
            .iter()
            .filter(|w| w.stale)
            .count();
        self.metrics.gauge("workers.stale", stale as u64);
        self.membership_gauges();
        let view = load_store::view(&HostStore, slots, now);
        self.slot_gauges.resize(slots, None);
        for ((slot_idx, load), published) in view.iter().enumerate().zip(&mut self.slot_gauges) {
            let Some(slot) = config.slots.get(slot_idx) else {
                continue;
            };
            let id = worker_id(&config, slot.worker);
            let values = [
                u64::from(load.active_requests),
                load.prefill_tokens.ceil() as u64,
                load.decode_blocks.ceil() as u64,
            ];
            // At 1,000 slots every tick would be 3,000 host calls (and names to format): only
            // what changed since the last tick is recorded.
            if *published == Some((id, values)) {
                continue;
            }
            let before = published.filter(|(was, _)| *was == id).map(|(_, v)| v);
            let name = format!("worker.{id}.rank.{}", slot.dp_rank);
            for ((suffix, value), old) in ["active_requests", "prefill_tokens", "decode_blocks"]
                .iter()
                .zip(values)
                .zip(0..)
            {
                if before.and_then(|b| b.get(old).copied()) != Some(value) {
                    self.metrics.gauge(&format!("{name}.{suffix}"), value);
                }
            }
            *published = Some((id, values));
        }
        self.metrics.gauge(
            "load.active_entries",
            view.iter().map(|l| u64::from(l.active_requests)).sum(),
        );
        if let Some(predicted) = &self.path.predicted {
            self.metrics.gauge("approx.entries", predicted.len() as u64);
        }
        self.metrics
            .gauge("load.deferred_releases", self.path.releases.len() as u64);
        self.timing_gauges(&config);
    }

    /// `worker.<id>.timing_factor_milli` (observed over predicted TTFT, x1000) and
    /// `worker.<id>.timing_samples`, recorded when they change.
    fn timing_gauges(&mut self, config: &Config) {
        if !config.ttft.as_ref().is_some_and(|t| t.learn) {
            return;
        }
        self.timing_published.resize(config.workers.len(), None);
        for (i, published) in self.timing_published.iter_mut().enumerate() {
            let Some(worker) = config.workers.get(i) else {
                continue;
            };
            let milli = (self.path.learned.factor(i) * 1000.0).round() as u64;
            let samples = self
                .path
                .learned
                .records
                .get(i)
                .map_or(0, |r| u64::from(r.samples));
            let values = (worker.id, milli, samples);
            if *published == Some(values) {
                continue;
            }
            *published = Some(values);
            self.metrics
                .gauge(&format!("worker.{}.timing_factor_milli", worker.id), milli);
            self.metrics
                .gauge(&format!("worker.{}.timing_samples", worker.id), samples);
        }
    }

    /// `vm.linear_memory_bytes`: the wasm linear memory of every VM of the process, summed. It
    /// holds each index replica; a VM's linear memory never shrinks, so this is each VM's peak.
    fn publish_linear_memory(&mut self) {
        let bytes = host::linear_memory_bytes();
        let delta = bytes as i64 - self.linear_memory_reported as i64;
        self.metrics.gauge_add("vm.linear_memory_bytes", delta);
        self.linear_memory_reported = bytes;
    }
}

impl RootContext for RouterRoot {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = host::buffer(BufferType::PluginConfiguration, plugin_configuration_size)
            .unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(config) => Rc::new(config),
            Err(err) => {
                error!("kv-router: invalid configuration: {err}");
                return false;
            }
        };
        let fingerprint = xxh3_64_with_seed(&bytes, 0);
        let nonce = xxh3_64_with_seed(
            &[
                host::now_nanos().to_le_bytes(),
                u64::from(self.context_id).to_le_bytes(),
            ]
            .concat(),
            fingerprint,
        );
        let workers = config.workers.len();
        let state = VmState {
            path: RoutingState::new(Rc::clone(&config), fingerprint, nonce),
            metrics: Metrics::default(),
            poller: Poller::new(workers),
            slot_gauges: Vec::new(),
            block_size_warned: vec![false; workers],
            fingerprint,
            members_call: None,
            next_members_poll_ms: 0,
            linear_memory_reported: 0,
            learned_cursor: 0,
            timing_published: Vec::new(),
            histogram_ids: Vec::new(),
        };
        load_store::init(
            &HostStore,
            config.slots.len(),
            config.load.request_timeout_ms,
        );
        replication::init(&HostStore);
        if config.approximate.is_some() {
            approx::init(&HostStore);
        }
        let _ = hostcalls::set_tick_period(Duration::from_millis(config.tick_ms));
        info!(
            "kv-router: configured: mode {:?}, {} workers ({} slots), block size {}",
            config.mode,
            workers,
            config.slots.len(),
            config.block_size
        );
        for note in config.advisories() {
            warn!("kv-router: {note}");
        }
        self.state = Some(Rc::new(RefCell::new(state)));
        true
    }

    fn on_tick(&mut self) {
        let Some(state) = &self.state else { return };
        if let Ok(mut vm) = state.try_borrow_mut() {
            vm.tick();
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let state = self.state.as_ref()?;
        Some(Box::new(RequestContext::new(Rc::clone(state))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
