//! Sends event calls through the event cluster and matches replies to them by token. When to call
//! whom is [`crate::polling::PollSchedule`]'s decision; only the VM holding the poller lease polls.

use super::host::{self, HostStore};
use crate::config::{Config, UnseenTraffic};
use crate::events::Booked;
use crate::learn;
use crate::load::SlotLoad;
use crate::load_store;
use crate::polling::{
    call_path, call_timeout_ms, declare_path, CallKind, Declarations, Next, PollSchedule,
    ReplyOutcome,
};
use crate::replication::coalesce::Coalescer;
use crate::replication::log::LogHead;
use hashbrown::HashMap;
use std::time::Duration;

#[derive(Clone, Copy, Debug)]
pub struct PendingCall {
    pub worker: u16,
    pub kind: CallKind,
    /// The occupant's membership generation when the call was made (0 without membership): a
    /// reply for an earlier occupant of the entry is dropped.
    pub generation: u64,
}

pub struct Poller {
    /// Calls in flight by token; at most one per worker (a newer call replaces a lost one's
    /// entry, so the map stays bounded by the number of workers).
    pending: HashMap<u32, PendingCall>,
    pub schedule: PollSchedule,
    /// The membership generation each worker entry was last polled for (all 0 without
    /// membership): when it moves, the entry has a new occupant and its poll state starts over.
    generations: Vec<u64>,
    /// Applied replies waiting for this tick's batch.
    pub queued: Coalescer,
    /// This VM's random nonce: the Envoy's router id if no VM has set one yet.
    nonce: u64,
    /// The load table as last viewed (at that ms), for the bookings each events call declares:
    /// one view serves every call of a tick.
    booked_view: (u64, Vec<SlotLoad>),
    /// What each worker's bridge last heard from this Envoy.
    declarations: Declarations,
    /// Declaration calls in flight by token (at most one per worker).
    declaring: HashMap<u32, u16>,
}

impl Poller {
    pub fn new(workers: usize, nonce: u64) -> Poller {
        Poller {
            pending: HashMap::new(),
            schedule: PollSchedule::new(workers),
            generations: vec![0; workers],
            queued: Coalescer::default(),
            nonce,
            booked_view: (u64::MAX, Vec::new()),
            declarations: Declarations::default(),
            declaring: HashMap::new(),
        }
    }

    /// This Envoy's id and what it has booked on `worker`, for an events call.
    fn declaration(&mut self, config: &Config, worker: u16, now_ms: u64) -> (u64, Booked) {
        let booked = self.booked_on(config, worker, now_ms);
        (
            load_store::router_id(&HostStore, self.nonce),
            with_timing(config, worker, booked, now_ms),
        )
    }

    fn booked_on(&mut self, config: &Config, worker: u16, now_ms: u64) -> Booked {
        if self.booked_view.0 != now_ms {
            // Into the same vector every time: the VM's linear memory never shrinks.
            self.booked_view.0 = now_ms;
            load_store::read_snapshot(&HostStore, config.slots.len())
                .view_into(now_ms, &mut self.booked_view.1);
        }
        load_store::booked_on(&self.booked_view.1, config.worker_slots(worker))
    }

    /// With `load.unseen_traffic: relayed`, tells each worker's bridge at once when this Envoy's
    /// bookings there moved since it last declared them (a request more or less, a quarter of
    /// the queued prefill), instead of with its next poll, which waits for the worker's next
    /// event: the bridge wakes the other Envoys' polls with it. Returns the calls sent and those
    /// the host refused.
    pub fn declare_moved(&mut self, config: &Config, now_ms: u64) -> (u64, u64) {
        let (mut sent, mut failed) = (0, 0);
        if config.load.unseen_traffic != UnseenTraffic::Relayed
            || config.events.declare_path.is_empty()
        {
            return (sent, failed);
        }
        for (i, spec) in config.workers.iter().enumerate() {
            let Ok(worker) = u16::try_from(i) else { break };
            if spec.is_vacant() || !spec.kv_mode.has_events() {
                continue;
            }
            let booked = self.booked_on(config, worker, now_ms);
            if !self.declarations.due(worker, &booked) {
                continue;
            }
            let booked = with_timing(config, worker, booked, now_ms);
            let router = load_store::router_id(&HostStore, self.nonce);
            let Some(path) = declare_path(&config.events, router, &booked) else {
                break;
            };
            let headers = call_headers("POST", &path, &spec.events_address_text);
            let timeout = Duration::from_millis(config.events.timeout_ms);
            match host::http_call(&config.events.cluster, headers, timeout) {
                Ok(token) => {
                    self.declaring.insert(token, worker);
                    self.declarations.sent(worker, booked, true);
                    sent += 1;
                }
                Err(_) => failed += 1,
            }
        }
        (sent, failed)
    }

    /// Whether `token` answers a declaration call (then done with), answered with `status`.
    pub fn take_declaration(&mut self, token: u32, status: Option<&str>) -> bool {
        match self.declaring.remove(&token) {
            Some(worker) => {
                self.declarations.answered(worker, status);
                true
            }
            None => false,
        }
    }

    /// Sends the calls that are due. Returns how many the host refused.
    pub fn dispatch_due(&mut self, config: &Config, head: &LogHead, now_ms: u64) -> usize {
        let mut failed = 0;
        for (i, seen) in self.generations.iter_mut().enumerate() {
            let Ok(worker) = u16::try_from(i) else { break };
            let now_gen = head.member_generation(worker);
            if *seen != now_gen {
                // A new occupant: the old one's call in flight, backoff and gap history are not its.
                *seen = now_gen;
                self.schedule.reset(worker);
                self.declarations.forget(worker);
                self.pending.retain(|_, call| call.worker != worker);
                self.queued.forget(worker);
            }
        }
        for (worker, state) in head.workers.iter().enumerate() {
            if state.retry_after_ms > now_ms {
                if let Ok(worker) = u16::try_from(worker) {
                    self.schedule
                        .adopt_backoff(worker, state.retry_after_ms, state.rejections);
                }
            }
        }
        for worker in self.schedule.due(now_ms) {
            // `kv_mode: approximate`: the worker publishes no events.
            let polled = config
                .workers
                .get(usize::from(worker))
                .is_some_and(|w| w.kv_mode.has_events());
            if polled && !self.dispatch_next(config, head, worker, now_ms) {
                failed += 1;
            }
        }
        failed
    }

    /// The call the worker needs now: its events after the cursor (a queued reply's, else the
    /// head's), or its dump if it has no cursor or showed a gap.
    pub fn dispatch_next(
        &mut self,
        config: &Config,
        head: &LogHead,
        worker: u16,
        now: u64,
    ) -> bool {
        let cursor = self
            .queued
            .cursor(worker)
            .or_else(|| head.workers.get(usize::from(worker)).and_then(|w| w.cursor))
            .filter(|_| !self.schedule.wants_dump(worker));
        let kind = cursor.map_or(CallKind::Dump, |after| CallKind::Events { after });
        let generation = head.member_generation(worker);
        self.dispatch(config, worker, kind, generation, now)
    }

    fn dispatch(
        &mut self,
        config: &Config,
        worker: u16,
        kind: CallKind,
        generation: u64,
        now_ms: u64,
    ) -> bool {
        let Some(spec) = config.workers.get(usize::from(worker)) else {
            return false;
        };
        if spec.is_vacant() {
            // A membership pool entry without a host: nothing to poll (not a failure).
            return true;
        }
        let declare = match kind {
            CallKind::Events { .. } => Some(self.declaration(config, worker, now_ms)),
            CallKind::Dump => None,
        };
        if let Some((_, booked)) = declare {
            self.declarations.sent(worker, booked, false);
        }
        let path = call_path(&config.events, kind, declare);
        let headers = call_headers("GET", &path, &spec.events_address_text);
        let timeout_ms = call_timeout_ms(&config.events, kind);
        match host::http_call(
            &config.events.cluster,
            headers,
            Duration::from_millis(timeout_ms),
        ) {
            Ok(token) => {
                self.pending.retain(|_, call| call.worker != worker);
                self.pending.insert(
                    token,
                    PendingCall {
                        worker,
                        kind,
                        generation,
                    },
                );
                self.schedule.sent(worker, kind, timeout_ms, now_ms);
                true
            }
            Err(_) => {
                self.schedule.send_failed(worker, &config.events, now_ms);
                false
            }
        }
    }

    /// The call a reply answers (`None`: not ours, or replaced by a newer call).
    pub fn take(&mut self, token: u32) -> Option<PendingCall> {
        self.pending.remove(&token)
    }

    /// Records how the call ended; see [`PollSchedule::replied`].
    pub fn replied(
        &mut self,
        config: &Config,
        worker: u16,
        outcome: ReplyOutcome,
        now_ms: u64,
    ) -> Next {
        self.schedule
            .replied(worker, outcome, &config.events, now_ms)
    }
}

/// A call to a worker's event endpoint through the event cluster, steered to `address` as the
/// request path steers requests (ORIGINAL_DST or override_host, whichever the cluster is).
fn call_headers<'a>(method: &'a str, path: &'a str, address: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        (":method", method),
        (":path", path),
        (":authority", address),
        (":scheme", "http"),
        ("x-envoy-original-dst-host", address),
        ("x-gateway-destination-endpoint", address),
    ]
}

/// `booked` with what this Envoy learned of `worker`'s timing, for the other Envoys (one
/// shared-data get per declaration, never per request); as it is without learning.
fn with_timing(config: &Config, worker: u16, mut booked: Booked, now_ms: u64) -> Booked {
    if config.ttft.as_ref().is_some_and(|t| t.learn) {
        let record = learn::read_record(&HostStore, usize::from(worker));
        booked.timing = (record.samples > 0).then(|| record.sums_at(now_ms));
    }
    booked
}
